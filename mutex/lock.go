package mutex

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"
)

// Lock is a held lock. Its methods are safe for concurrent use; Unlock and the other
// methods are safe on a nil *Lock, which holds nothing.
type Lock struct {
	c       *Client
	kind    kind
	key     string   // the caller's key (the first, of several)
	given   []string // several keys: all of them, as the caller gave them; nil for one
	keys    []string // the Redis keys: each lock and its queue, in the order taken
	locks   []string // the Redis keys of the locks alone
	id      string   // identity(token)
	fence   int64    // of key
	fences  []int64  // of given, in its order; nil for one key
	by      heldBy
	starter Starter   // StartWith: starts the parked tasks its release hands the lock to
	taken   time.Time // when the attempt that took it was sent, on our clock

	mu    sync.Mutex
	until time.Time // lease end on our own monotonic clock, conservatively
	ended bool      // OpReleased or OpLeaseLost was reported
	// retrying: a release that got no answer is being sent again (retryRelease)
	retrying bool
}

// Key returns the key the lock was taken on, as the caller gave it.
func (l *Lock) Key() string {
	if l == nil {
		return ""
	}
	return l.key
}

// Keys returns the keys the lock was taken on, as the caller gave them (without
// repeats): one for a lock taken by TryLock, Lock or WithLock. The slice is the
// caller's to keep.
func (l *Lock) Keys() []string {
	if l == nil {
		return nil
	}
	if l.given == nil {
		return []string{l.key}
	}
	return slices.Clone(l.given)
}

// Token returns the token of this acquisition: the one given with the Token option,
// or a random one. It is a secret of the holder: whoever knows it can release the lock.
func (l *Lock) Token() string {
	if l == nil {
		return ""
	}
	return l.id[lenDigits:]
}

// Fence returns the fencing token of this acquisition: strictly greater than the
// fence of every earlier acquisition of the same key (see the package doc for the
// limits). Pass it to the resource you protect and have it reject lower fences.
func (l *Lock) Fence() int64 {
	if l == nil {
		return 0
	}
	return l.fence
}

// Fences returns the fencing token of each key, in the order of Keys: each strictly
// greater than the fence of every earlier acquisition of its key (see Fence). Pass
// to each resource the fence of its own key. The slice is the caller's to keep.
func (l *Lock) Fences() []int64 {
	if l == nil {
		return nil
	}
	if l.fences == nil {
		return []int64{l.fence}
	}
	return slices.Clone(l.fences)
}

// TTL returns the remaining lease as Redis sees it (the shortest, of several keys).
// It returns an error wrapping ErrNotHeld when the lock is no longer ours, and a
// wrapped Redis error when Redis cannot be reached.
func (l *Lock) TTL(ctx context.Context) (time.Duration, error) {
	if l == nil {
		return 0, ErrNotHeld
	}
	d, held, err := l.kind.pttl(ctx, l)
	switch {
	case err != nil:
		return 0, fmt.Errorf("mutex: ttl of %s: %w", l.what(), err)
	case !held:
		return 0, fmt.Errorf("mutex: ttl of %s: %w", l.what(), ErrNotHeld)
	}
	return d, nil
}

// Extend replaces the remaining lease with ttl if the lock is still ours. It returns
// an error wrapping ErrNotHeld (and changes nothing) when the lease expired or another
// token holds the key, and a wrapped Redis error when Redis cannot be reached; it is
// safe to repeat. ttl is rounded down to whole milliseconds and must lie between
// MinTTL and MaxTTL.
func (l *Lock) Extend(ctx context.Context, ttl time.Duration) error {
	if l == nil {
		return ErrNotHeld
	}
	err := l.extend(ctx, ttl)
	if errors.Is(err, ErrNotHeld) {
		l.emit(ctx, OpLeaseLost, err)
	}
	return err
}

// extend is Extend without the event of a lost lease.
func (l *Lock) extend(ctx context.Context, ttl time.Duration) error {
	return l.setLease(ctx, ttl, false)
}

// renew is WithLock's renewal: extend, where the lease only ever moves forward on our
// clock, as several renewals with the same ttl may answer out of order.
func (l *Lock) renew(ctx context.Context, ttl time.Duration) error {
	return l.setLease(ctx, ttl, true)
}

// setLease replaces l's lease with ttl in Redis, and the end of the lease on our clock
// with the one it grants, or with the later of the two when forward is set.
func (l *Lock) setLease(ctx context.Context, ttl time.Duration, forward bool) error {
	if err := checkTTL(ttl); err != nil {
		return fmt.Errorf("mutex: extend %s: %w", l.what(), err)
	}
	sent := time.Now()
	held, err := l.kind.extend(ctx, l, ttl)
	switch {
	case err != nil:
		return fmt.Errorf("mutex: extend %s: %w", l.what(), err)
	case !held:
		return fmt.Errorf("mutex: extend %s: %w", l.what(), ErrNotHeld)
	}
	l.mu.Lock()
	if end := leaseEnd(sent, ttl); !forward || end.After(l.until) {
		l.until = end
	}
	l.mu.Unlock()
	return nil
}

// Unlock releases the lock, handing it to the waiter, of any Client, queued longest.
// It returns an error wrapping ErrNotHeld when the lease had expired, another token
// holds the key, or ForceRelease took it (then nothing changes), and a wrapped Redis
// error when Redis cannot be reached. The release is sent even when ctx is done, and
// ctx's end does not stop it (the redis client's own timeouts bound it), so that a
// deadline that comes as the work ends does not leave the key held for the rest of
// its lease.
//
// A release that failed because Redis could not be reached or serve it for a while
// (a restart, a dropped connection, a failover) still returns its error, and is sent
// again in the background, with a pause growing to a second, up to 100 times, until
// Redis answers, but never once the lease would have ended on this process's clock:
// the key frees (handed to its waiter) as soon as Redis is back, at the latest when
// the lease runs out. A late retry is harmless: it releases only this lock's own
// token. It reports OpReleased if it releases the lock; no Close is needed for it.
//
// Repeating an Unlock that succeeded returns nil for 10s, however often the key
// changed hands since: that is how a release whose reply was lost, and which go-redis
// sent again, is told apart from a lost lease. Unlock on a nil *Lock returns
// ErrNotHeld, so `defer l.Unlock(ctx)` is always safe.
func (l *Lock) Unlock(ctx context.Context) error {
	if l == nil {
		return ErrNotHeld
	}
	err := l.unlock(ctx)
	switch {
	case err == nil:
		l.emit(ctx, OpReleased, nil)
	case errors.Is(err, ErrNotHeld):
		l.emit(ctx, OpLeaseLost, err)
	default:
		l.emit(ctx, OpReleaseFailed, err)
		l.retryRelease(ctx, err)
	}
	return err
}

// unlock is Unlock without events: WithLock decides what its result means. The
// release is sent whether or not ctx is done, and does not end with it: a lock must
// not stay held for the rest of its lease because the caller's deadline came as fn
// returned. The redis client's own timeouts bound it.
func (l *Lock) unlock(ctx context.Context) error {
	r, hs, err := l.kind.release(context.WithoutCancel(ctx), l.keys, l.id, "", l.fence, "")
	l.c.start(l.starter, hs)
	switch {
	case err != nil:
		return fmt.Errorf("mutex: unlock %s: %w", l.what(), err)
	case r == notOurs:
		return fmt.Errorf("mutex: unlock %s: %w", l.what(), ErrNotHeld)
	case r == forced:
		return fmt.Errorf("mutex: unlock %s: %w: %w", l.what(), errForced, ErrNotHeld)
	}
	return nil
}

// emit reports op on l to the Client's observers, with how long l has been held.
// Of OpReleased and OpLeaseLost only the first is reported: a lock ends once,
// however many calls find out.
func (l *Lock) emit(ctx context.Context, op Op, err error) {
	if l.c.observe == nil {
		return
	}
	if op == OpReleased || op == OpLeaseLost {
		l.mu.Lock()
		again := l.ended
		l.ended = true
		l.mu.Unlock()
		if again {
			return
		}
	}
	l.c.observe(ctx, Event{Op: op, Key: l.key, Keys: l.given, Name: l.by.name, ID: l.by.id, Fence: l.fence, Held: time.Since(l.taken), Err: err})
}

// what is the lock's key or keys, for errors.
func (l *Lock) what() string { return showKeys(l.key, l.given) }

// validUntil is when the lease ends on our own clock, allowing for drift between
// our clock and Redis's.
func (l *Lock) validUntil() time.Time {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.until
}

// leaseEnd is the conservative end of a lease granted by a command sent at sent:
// Redis started counting after that, and its clock may run up to 1% faster than ours
// (the drift allowance of the Redlock analysis, plus 2ms).
func leaseEnd(sent time.Time, ttl time.Duration) time.Time {
	return sent.Add(ttl - ttl/100 - 2*time.Millisecond)
}
