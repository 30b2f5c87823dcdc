package mutex

import (
	"context"
	"log/slog"
	"strconv"
	"time"
)

// Op says what happened in an Event.
type Op uint8

// The operations an Event reports.
const (
	// OpAcquired: the lock was taken. Wait is the time from the first attempt to the
	// moment it was taken, 0 when the first attempt took it; Fence is the new fence;
	// Contended is true when OpContended was reported before it.
	OpAcquired Op = iota + 1
	// OpContended: an acquisition found the key held by another, once per acquisition
	// (a TryLock, Lock or WithLock call), however often it then tries again.
	OpContended
	// OpNotObtained: an acquisition ended without the lock. Err wraps ErrNotObtained
	// when the key stayed busy (joined with the context's error when that ended the
	// wait), is a *LimitError when the key's holders use another limit (see Limit),
	// and is a Redis error otherwise; Wait is how long it tried; Contended as
	// for OpAcquired. Every OpContended is followed by one OpAcquired or OpNotObtained
	// with Contended set, so "waiting now" is the difference of their counts.
	OpNotObtained
	// OpReleased: the holder released the lock. Held is how long it held it, on its
	// own clock.
	OpReleased
	// OpRenewFailed: a renewal by WithLock got no answer (Err); it is tried again
	// well before the lease ends, and the lease still stands.
	OpRenewFailed
	// OpReleaseFailed: a release got no answer (Err); the lock may have been
	// released. When Redis could not be reached for a while, the release is tried
	// again in the background, within the lease (see Lock.Unlock), and OpReleased
	// follows if a retry releases it; else the lock frees itself when its lease runs
	// out. Held as for OpReleased.
	OpReleaseFailed
	// OpLeaseLost: the lease ended while the holder still counted on it: Redis said
	// the key was gone or held by another token, or renewals failed until the lease
	// ran out, or ForceRelease took it. Another holder may have overlapped. Err says
	// why; Held is how long it had been held. A Lock reports OpReleased or
	// OpLeaseLost once, whichever comes first, however many of its calls find out.
	OpLeaseLost
	// OpWakeupLost: the Client's subscription connection broke or fell silent (Err),
	// so its waiters may miss a hand-over; they try again at once and when the
	// connection is back, and meanwhile when the holder's lease runs out.
	OpWakeupLost
	// OpWakeupRecovered: the subscription is confirmed again after OpWakeupLost.
	OpWakeupRecovered
)

var opNames = [...]string{
	OpAcquired: "acquired", OpContended: "contended", OpNotObtained: "not_obtained",
	OpReleased: "released", OpRenewFailed: "renew_failed", OpReleaseFailed: "release_failed",
	OpLeaseLost:  "lease_lost",
	OpWakeupLost: "wakeup_lost", OpWakeupRecovered: "wakeup_recovered",
}

// String returns the operation's name in snake case, such as "lease_lost", for logs
// and metric labels.
func (o Op) String() string {
	if int(o) < len(opNames) && opNames[o] != "" {
		return opNames[o]
	}
	return "op(" + strconv.Itoa(int(o)) + ")"
}

// Event is something that happened to a lock, reported to the function given to
// Observe. Fields that do not apply to Op are zero.
type Event struct {
	Op Op
	// Key is the lock's key as the caller gave it; empty for the wake-up operations.
	// It can be long and unbounded in number: never use it as a metric label.
	Key string
	// Keys are all the keys of a lock taken on several (see Client.LockKeys), in the
	// caller's order, Key being the first; nil for a lock on one key. Do not modify.
	Keys []string
	// Name and ID are what the holder said about itself with HeldBy: for the
	// asynqmutex middleware, the task type and the task ID.
	Name, ID  string
	Fence     int64
	Contended bool          // OpAcquired, OpNotObtained
	Wait      time.Duration // OpAcquired, OpNotObtained
	Held      time.Duration // OpReleased, OpLeaseLost
	Err       error         // OpNotObtained, OpRenewFailed, OpReleaseFailed, OpLeaseLost, OpWakeupLost
}

// Observe makes the Client call fn for every Event of its locks and its waiters. fn
// runs synchronously on the goroutine where the event happened, with the context of the call that caused it (context.Background
// for the wake-up operations), so it must be quick, must not block, and must be safe
// for concurrent use; it must not call the Client. Given more than once, every fn is
// called, in order. By default nothing is called, and an unset observer costs
// nothing but a nil check. Observe panics if fn is nil.
func Observe(fn func(ctx context.Context, e Event)) Option {
	if fn == nil {
		panic("mutex.Observe: nil function")
	}
	return optionFunc(func(c *Client) {
		if prev := c.observe; prev != nil {
			c.observe = func(ctx context.Context, e Event) { prev(ctx, e); fn(ctx, e) }
			return
		}
		c.observe = fn
	})
}

// emit passes e to the Client's observers, if any.
func (c *Client) emit(ctx context.Context, e Event) {
	if c.observe != nil {
		c.observe(ctx, e)
	}
}

// Logger sets where the Client logs what an operator should hear of: a renewal that
// got no answer (Warn, once per run of failures, with the key shortened and the
// holder's HeldBy name and ID), a WithLock release that got no answer (Warn), and the
// subscription connection breaking (Warn) and recovering (Info). Lost leases are not
// logged here: WithLock, Lock.Extend and Lock.Unlock return them to the caller, and
// the asynqmutex middleware logs them. Tokens are never logged. The default is
// slog.Default(), looked up when a record is logged. Logger panics if l is nil.
func Logger(l *slog.Logger) Option {
	if l == nil {
		panic("mutex.Logger: nil *slog.Logger")
	}
	return optionFunc(func(c *Client) { c.logger = l })
}

func (c *Client) log() *slog.Logger {
	if c.logger != nil {
		return c.logger
	}
	return slog.Default()
}
