package asynqmutex

import (
	"fmt"
	"math"
	"time"

	"github.com/asynqmutex/asynqmutex/internal/shortkey"
	"github.com/asynqmutex/asynqmutex/mutex"
	"github.com/asynqmutex/asynqmutex/ratelimit"
)

// DeadlineMargin is how long before a task's deadline (asynq's Timeout or Deadline
// option; 30 minutes by default) a wait for a busy key ends, however long MaxWait is.
// The policy's result must reach asynq before the deadline does: past it, asynq
// records "context deadline exceeded" as a failure, spends a retry, and archives the
// task once its retries are used up. A task with less than this left tries the key
// once.
const DeadlineMargin = 500 * time.Millisecond

// LastTryWait is how long at least a task with no retry left waits for a busy key
// under RetryLater: a task with MaxRetry(0), or whose retries real failures used up.
// asynq archives such a task for any error it returns, contention included, so it
// waits for the key instead, up to the longer of MaxWait and LastTryWait (which
// matches DefaultTTL, the longest a crashed holder keeps a key), ending
// DeadlineMargin before its deadline. If the key is still busy then, the task is
// archived with an error saying the key was busy and that it had no retry left,
// wrapping a *LockedError and asynq.SkipRetry; run it again from the archive
// (asynq.Inspector.RunTask) once the key is free.
const LastTryWait = 30 * time.Second

// LeadWait is how long, under Park without MaxWait, the first task in a busy key's
// line waits in its worker for the key before it parks too: it is handed the key the
// moment the key frees, while the tasks behind it wait in Redis. A key held longer
// than this costs its lead this much of a worker, once.
const LeadWait = time.Second

// MaxReschedules caps how many times RetryLater sends one task back for a busy key:
// the task's conflict after its n-th reschedule, and every one after that, fails as
// under Fail. It returns an ordinary error wrapping mutex.ErrNotObtained, so asynq
// spends one of the task's retries on it (with its usual backoff) and archives the
// task once they are used up; the error's text, asynq's LastErr, names the task, the
// key and the cap. A task that reached the cap and then used up its retries is
// archived at its next conflict, as under Fail, rather than wait LastTryWait.
//
// The count is kept in Redis, shared by every worker that uses the same lock Redis
// and prefix, and restarts when the task obtains its key (see RetryLater). Given
// with MaxRescheduleTime, whichever cap is reached first applies. The default is no
// cap: a task is sent back for as long as its key stays busy. A conflict Redis
// cannot count is not counted toward the cap (see RetryLater).
//
// MaxReschedules applies to RetryLater and Park (where each park counts); Middleware
// panics if it is given with Skip or Fail. MaxReschedules panics if n is less than 1: to never reschedule, use
// OnConflict(Fail).
func MaxReschedules(n int) Option {
	if n < 1 {
		panic(fmt.Sprintf("asynqmutex.MaxReschedules: %d is less than 1; leave it out for no cap, or use OnConflict(Fail) to never reschedule", n))
	}
	return once("MaxReschedules", fmt.Sprintf("MaxReschedules(%d)", n), func(c *config) { c.maxReschedules = n })
}

// MaxRescheduleTime caps how long RetryLater keeps sending one task back for a busy
// key: the task's first conflict d or more after its first one, and every one after
// that, fails as under Fail, as described for MaxReschedules. The time is measured
// on the Redis server's clock, from the first conflict that Redis counted, so
// workers whose clocks differ agree on it. As the cap is checked at a conflict, the
// task can stay busy up to one reschedule delay (at most 16·d of RetryLater(d))
// past it. The default is no cap; given with MaxReschedules, whichever cap is
// reached first applies.
//
// MaxRescheduleTime applies to RetryLater and Park; Middleware panics if it is given
// with Skip or Fail. MaxRescheduleTime panics if d is zero or negative.
func MaxRescheduleTime(d time.Duration) Option {
	if d <= 0 {
		panic(fmt.Sprintf("asynqmutex.MaxRescheduleTime: %v is not positive; leave it out for no cap", d))
	}
	return once("MaxRescheduleTime", fmt.Sprintf("MaxRescheduleTime(%v)", d), func(c *config) { c.maxRescheduleTime = d })
}

// Policy says what the middleware does with a task whose key another task holds
// (after waiting up to MaxWait). The policies are Park, Skip, Fail and RetryLater(d);
// the default is Park. A Policy is a plain value, safe to share.
type Policy time.Duration

const (
	// Park, the default, leaves the task's worker at once and has the task wait in
	// its key's line in the lock Redis, holding no worker and spending no retry: the
	// release that frees the key hands it to the first in line and starts that task
	// (asynq's Inspector.RunTask moves it from the retry set to its queue), so it
	// runs the moment the key frees, in the order the tasks met the key. One task per
	// busy key, the first in line, waits in its worker instead, up to LeadWait, to be
	// handed the key at once (with MaxWait, every task waits up to MaxWait in its
	// worker before it parks); and the task after it is
	// started as it is handed the key, so that it too waits in a worker rather than
	// in asynq's queue.
	//
	// The handler returns a *LockedError with RetryIn = TTL, rounded up to whole
	// seconds: a parked task whose start is lost (the process that was to start it
	// died, Redis lost the line) comes back by itself after that, and keeps its place
	// in the line if it is still in it. Configure is needed, as for RetryLater: without
	// it each park spends a retry. A parked task that an operator deletes, archives or
	// runs is passed over, or keeps its place when it arrives early.
	//
	// Under InOrder, a task whose turn has not come parks in its key's order the same
	// way: the finish of the task ahead starts it, and the task after it ahead of its
	// turn, to wait up to LeadWait in its worker. Under Rate or RateBy, a task whose
	// start comes later than it may wait takes the start ahead, up to four TTLs, and
	// parks until it; a task whose key is paused, or whose handler returned PauseKey,
	// parks until the key is free again. Either is started by the process it parked
	// on, at that time, and comes back by itself a TTL after it if that process dies.
	//
	// Park applies to a task's lock, run by an asynq server: one key, or one slot of
	// a Limit(n) key, whose line hands each slot freed to the first in line as a
	// lock's line hands the key, or several keys (OnEach, KeysBy), which park in the
	// line of the first busy one holding none of the others (handed that one, a task
	// waits up to LeadWait, or MaxWait, in its worker for a busy key after it); to
	// its turn under InOrder; and to its rate and pauses. A task whose start is
	// further ahead is sent back as under RetryLater(DefaultRetryDelay) (for the time
	// until a start is free). A task with no retry left waits as RetryLater says, in
	// its place in the line if it has one. MaxReschedules and
	// MaxRescheduleTime count parks too. See docs/conflicts.md for the line, its
	// bounds and its failure cases.
	Park Policy = -3

	// Skip completes the task without running it: the handler returns nil, so asynq
	// deletes the task (or keeps it as completed when it has a Retention). Use it for
	// work that any concurrent run makes redundant, like refreshing a cache.
	Skip Policy = -1

	// Fail returns an ordinary error wrapping mutex.ErrNotObtained, so asynq retries the
	// task with its normal backoff, counts the attempt, and archives the task when its
	// retries are used up.
	Fail Policy = -2
)

// DefaultRetryDelay is the delay of RetryLater's examples and of what Park sends back
// rather than park (a start further ahead than Park holds):
// RetryLater(DefaultRetryDelay). asynq moves due retries back to their queue every DelayedTaskCheckInterval (5 s by
// default) and stores retry times in whole seconds, so shorter delays are not kept.
const DefaultRetryDelay = 5 * time.Second

// RetryLater returns the task to asynq to run again after about d without spending
// its retries: the handler returns a *LockedError with RetryIn = d, doubled for each
// further conflict of the same task up to 16·d. With Configure, asynq does not count
// a LockedError as a failure and RetryDelay adds jitter; without Configure it is an
// ordinary error that spends a retry, and asynq's own backoff sets the delay. A task
// is sent back for as long as its key stays busy unless MaxReschedules or
// MaxRescheduleTime caps that; past a cap its conflicts fail as under Fail.
//
// Park, the default, costs less for most keys: a task waits in its key's line and
// starts the moment the key frees, rather than after a guessed delay. RetryLater
// suits tasks that should leave the key alone for a while, and a fleet whose
// processes cannot reach asynq's Redis through an Inspector.
//
// A task with no retry left (MaxRetry(0), or retries used up by real failures) would
// be archived by asynq for any error, so it waits for the key instead, up to
// LastTryWait (or MaxWait if longer), and is archived with an error saying the key
// was busy if it still is.
//
// The conflicts behind the doubling and the caps are counted per task in the lock
// Redis, one script call per conflict, so every worker counts a task alike. If Redis
// cannot count a conflict, the task is sent back after d, uncounted, and the
// middleware logs it at Warn (see Logger): the task is never lost. A task that meets
// no busy key costs no Redis command beyond its lock's, unless a cap is set, which
// adds one to clear the count when the task gets its key. docs/conflicts.md has the
// details.
//
// asynq keeps retry times in whole seconds, so d is rounded up to a whole number of
// seconds, at least 1s. RetryLater suits keys held for long; for hot keys held
// briefly prefer MaxWait, whose waiters are woken the moment the key is released.
// RetryLater panics if d is zero or negative.
func RetryLater(d time.Duration) Policy {
	if d <= 0 {
		panic(fmt.Sprintf("asynqmutex.RetryLater: delay %v is not positive", d))
	}
	if r := d.Truncate(time.Second); r < d && r <= math.MaxInt64-time.Second {
		d = r + time.Second
	}
	return Policy(d)
}

// valid reports whether p is Skip, Fail, or what RetryLater returns: a whole number
// of seconds, at least one.
func (p Policy) valid() bool {
	return p == Park || p == Skip || p == Fail || time.Duration(p) >= time.Second && time.Duration(p)%time.Second == 0
}

// retryDelay is RetryLater's delay, or DefaultRetryDelay under Park, for what does
// not park.
func (p Policy) retryDelay() time.Duration {
	if p == Park {
		return DefaultRetryDelay
	}
	return time.Duration(p)
}

// String returns "Park", "Skip", "Fail" or "RetryLater(d)".
func (p Policy) String() string {
	switch p {
	case Park:
		return "Park"
	case Skip:
		return "Skip"
	case Fail:
		return "Fail"
	}
	return fmt.Sprintf("RetryLater(%v)", time.Duration(p))
}

// LockedError is what a task returns under RetryLater when its key was busy: held by
// another task, at its rate limit (Rate, RateBy; then it also wraps
// ratelimit.ErrLimited), or, under InOrder, waiting for an earlier task; and what a task whose handler returned PauseKey's error
// returns. It wraps mutex.ErrNotObtained. Configure makes asynq treat it as no failure and retry
// the task after RetryIn plus jitter. Past a reschedule cap (MaxReschedules,
// MaxRescheduleTime) the task returns an ordinary error instead, as under Fail, whose
// text is the LockedError's followed by mutex.ErrNotObtained's. The AfterFailure
// hook receives a LockedError for every conflict, with RetryIn 0 under Skip and Fail
// and past a cap.
type LockedError struct {
	// Key is the lock key the task needed, whole: it may be long and hold payload
	// values, so log Error()'s text, which shortens it, rather than Key.
	Key string
	// Keys are all the keys of a task that needed several (OnEach, KeysBy); nil for
	// one key. Key is then the one found busy (see mutex.BusyKey).
	Keys    []string
	RetryIn time.Duration // when to run the task again; 0 when it will not be retried

	taskType, taskID string
	waited           time.Duration // with archived and no caps: how long the task waited
	archived         bool          // the task had no retry left: asynq archives it

	caps      string        // the reschedule caps reached, "" if none
	conflicts int           // with caps: the conflicts counted, this one included
	since     time.Duration // with caps: since the first conflict

	limited  *limited      // the key was at its rate limit, not held
	paused   time.Duration // the handler asked for its key to be paused this long (PauseKey)
	cause    *PauseError   // with paused: the handler's error
	pauseErr error         // with paused: why the key was not paused, nil if it was

	turn *turnWait // under InOrder: an earlier task of the key had not finished

	parked bool // under Park: the task waits in its key's line; RetryIn is its fallback
	full   int  // under MaxBacklog: the key's line held this many tasks or more
}

// Error names the task and the key, shortened past 100 bytes (with a digest), on
// one line, what kept the task from running (a holder, the key's rate limit, a
// pause its handler asked for), and the delay asked for, or the reschedule cap
// reached. The delay is RetryIn, which a server set up with Configure keeps; without
// Configure asynq's own backoff applies instead, and the conflict spends a retry.
func (e *LockedError) Error() string {
	what := "lock " + shortkey.Show(e.Key) + " is held by another task"
	switch {
	case e.Keys != nil:
		what = "lock " + shortkey.Show(e.Key) + " (of " + showKeys(e.Key, e.Keys) + ") is held by another task"
	case e.turn != nil:
		what = fmt.Sprintf("key %s: its place %d waits for place %d", shortkey.Show(e.Key), e.turn.place, e.turn.next)
		if h := e.turn.holder; h.TaskID != "" {
			what += fmt.Sprintf(" (task %s in queue %s)", shortkey.Quote(h.TaskID), shortkey.Quote(h.Queue))
		}
	case e.limited != nil && e.limited.paused > 0:
		what = fmt.Sprintf("key %s is paused for %v", shortkey.Show(e.Key), e.limited.paused.Round(time.Millisecond))
	case e.limited != nil:
		what = fmt.Sprintf("key %s is at its rate limit (%v): next start in %v", shortkey.Show(e.Key), e.limited.lim, e.limited.delay.Round(time.Millisecond))
	case e.paused > 0:
		what = fmt.Sprintf("handler asked to pause key %s for %v", shortkey.Show(e.Key), e.paused)
		if e.cause.Err != nil {
			what += " (" + oneLine(e.cause.Err) + ")"
		}
		if e.pauseErr != nil {
			what += "; not paused: " + oneLine(e.pauseErr)
		}
	}
	if e.full > 0 {
		what += fmt.Sprintf(", and its line is full (MaxBacklog(%d))", e.full)
	}
	msg := "asynqmutex: " + what
	if e.taskType != "" {
		msg = fmt.Sprintf("asynqmutex: task %s%s: %s", shortkey.Quote(e.taskType), idSuffix(e.taskID), what)
	}
	switch {
	case e.caps != "":
		msg += fmt.Sprintf("; reschedule cap %s reached: %d conflicts in %v, so this one is a failure", e.caps, e.conflicts, e.since.Round(time.Millisecond))
		if e.archived {
			msg += " and, with no retry left, the task is archived"
		}
	case e.parked:
		msg += fmt.Sprintf("; parked, started when its turn comes (back by itself in %v at the latest)", e.RetryIn)
	case e.archived:
		msg += fmt.Sprintf("; no retry left, so it waited %v, the longest allowed, and is archived: run it again once the key is free", e.waited.Round(time.Millisecond))
	case e.RetryIn > 0:
		msg += fmt.Sprintf("; retry in %v", e.RetryIn)
	}
	return msg
}

// Unwrap returns mutex.ErrNotObtained; also ratelimit.ErrLimited when the key was at
// its rate limit or paused, the handler's *PauseError after PauseKey, and
// mutex.ErrLineFull when its line was full (MaxBacklog).
func (e *LockedError) Unwrap() []error {
	switch {
	case e.limited != nil:
		return []error{mutex.ErrNotObtained, ratelimit.ErrLimited}
	case e.cause != nil:
		return []error{mutex.ErrNotObtained, e.cause}
	case e.full > 0:
		return []error{mutex.ErrNotObtained, mutex.ErrLineFull}
	}
	return []error{mutex.ErrNotObtained}
}
