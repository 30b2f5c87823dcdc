package asynqmutex

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"sync"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynqmutex/asynqmutex/internal/shortkey"
	"github.com/asynqmutex/asynqmutex/mutex"
)

// DefaultTTL is the lease of a task's lock unless TTL says otherwise. It matches
// asynq's own lease on an active task, so a worker that dies frees its key about when
// asynq hands its task to another worker.
const DefaultTTL = 30 * time.Second

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

// Option configures Middleware. Options follow asynq's style: On("id"), TTL(d).
type Option interface{ apply(*config) }

type optionFunc func(*config)

func (f optionFunc) apply(c *config) { f(c) }

type config struct {
	key      KeyFunc
	keySetBy string // "On" or "KeyBy", to refuse both
	ttl      time.Duration
	maxWait  time.Duration
	policy   Policy
	hook     func(context.Context, *asynq.Task, error)
	logger   *slog.Logger // nil: slog.Default() at the time of logging
	limit    int          // tasks per key at once; 0 means 1
}

// On makes the lock key the task type plus the values of these JSON payload fields,
// so tasks of one type with the same values run one at a time ("customer.id" names
// the field id inside the object customer). A value must be a string, a number, a
// boolean or null; see KeyFunc for the key's exact form. Without On or KeyBy the key
// is the task type alone: at most one task of each type runs at a time. A task whose
// payload is not a JSON object, lacks a field, or holds an object, an array or a
// string that is not UTF-8 there, is archived at once with an error naming the field
// (see Middleware). On panics if no field is given or a name is empty.
func On(fields ...string) Option {
	if len(fields) == 0 {
		panic("asynqmutex.On: no field given")
	}
	validateFields("asynqmutex.On", fields)
	fields = append([]string(nil), fields...)
	return optionFunc(func(c *config) { c.setKey("On", fieldsKey(fields)) })
}

// KeyBy makes fn derive the lock key, for keys On cannot express. An error from fn,
// or an empty key, archives the task as a malformed payload does. KeyBy panics if fn
// is nil.
func KeyBy(fn KeyFunc) Option {
	if fn == nil {
		panic("asynqmutex.KeyBy: nil KeyFunc")
	}
	return optionFunc(func(c *config) { c.setKey("KeyBy", fn) })
}

func (c *config) setKey(by string, fn KeyFunc) {
	if c.keySetBy != "" && c.keySetBy != by {
		panic("asynqmutex.Middleware: both On and KeyBy given; use one")
	}
	c.key, c.keySetBy = fn, by
}

// TTL sets the lease of a task's lock. The middleware renews it every d/3 while the
// handler runs, so d bounds how long a key stays locked after its worker died, not how
// long a handler may run. The default is DefaultTTL (30 s). TTL panics if d lies
// outside [mutex.MinTTL, mutex.MaxTTL] (20ms to 7 days): a shorter lease cannot be
// renewed reliably, and every task would fail to lock.
func TTL(d time.Duration) Option {
	if d < mutex.MinTTL || d > mutex.MaxTTL {
		panic(fmt.Sprintf("asynqmutex.TTL: lease %v outside [%v, %v] (mutex.MinTTL, mutex.MaxTTL)", d, mutex.MinTTL, mutex.MaxTTL))
	}
	return optionFunc(func(c *config) { c.ttl = d })
}

// MaxWait makes a task whose key is busy wait up to d for it, woken the moment the
// holder releases it, before the OnConflict policy applies. The default is 0: the
// policy applies at once. A waiting task occupies one of the server's worker slots,
// so MaxWait suits keys held briefly; RetryLater suits keys held long. The wait ends
// DeadlineMargin before the task's own deadline (asynq's Timeout or Deadline) if that
// comes first, so that the policy, not the deadline, decides what happens to the
// task. MaxWait panics if d is negative.
func MaxWait(d time.Duration) Option {
	if d < 0 {
		panic(fmt.Sprintf("asynqmutex.MaxWait: negative wait %v", d))
	}
	return optionFunc(func(c *config) { c.maxWait = d })
}

// OnConflict sets what happens when the key stays busy: Skip, Fail or RetryLater(d).
// The default is RetryLater(DefaultRetryDelay). OnConflict panics on a Policy that
// none of those returned.
func OnConflict(p Policy) Option {
	if !p.valid() {
		panic(fmt.Sprintf("asynqmutex.OnConflict: invalid policy %d", p))
	}
	return optionFunc(func(c *config) { c.policy = p })
}

// Limit lets up to n tasks with the same key run at once, on every worker that
// shares the lock Redis, instead of one: with On("tenant_id") and Limit(5), at most
// five tasks of each tenant run at a time; with Limit alone, at most n tasks of the
// type run in the whole fleet. A task beyond the limit is handled as one whose key is
// busy: it waits up to MaxWait, woken when a running task of its key finishes, and
// then the OnConflict policy applies. Each running task holds a slot of its own
// (mutex.Limit), with its own lease, renewal and fence. The default is 1.
//
// Every middleware that takes a key must use the same n while tasks hold it: a task
// that meets another limit (during a rolling deploy that changes n, say) fails with an
// ordinary, retryable error wrapping *mutex.LimitError, which names both limits, and
// AfterFailure is called. Limit panics if n is below 1 or above mutex.MaxLimit.
func Limit(n int) Option {
	if n < 1 || n > mutex.MaxLimit {
		panic(fmt.Sprintf("asynqmutex.Limit: limit %d outside [1, %d] (mutex.MaxLimit)", n, mutex.MaxLimit))
	}
	return optionFunc(func(c *config) { c.limit = n })
}

// AfterFailure calls fn each time a task runs without its handler because the lock
// was not obtained: the key was busy (err is a *LockedError), Redis could not be
// reached, or no key could be derived from the task. It is not called for a lease lost
// while the handler ran: the handler did run, and Logger hears of that. It runs on the
// worker goroutine before the middleware returns, so it should be quick; it must be
// safe for concurrent use. By default nothing is called. AfterFailure panics if fn is
// nil.
func AfterFailure(fn func(ctx context.Context, t *asynq.Task, err error)) Option {
	if fn == nil {
		panic("asynqmutex.AfterFailure: nil function")
	}
	return optionFunc(func(c *config) { c.hook = fn })
}

// Logger sets where the middleware logs what needs a person's attention: a lock lost
// while its handler ran, at level Warn, which means another worker may have run a
// task with the same key at the same time. A record names the task type and ID, the
// key (shortened past 100 bytes, with a digest), whether the task completed, and
// why the lock was lost; never a token or the payload. The default is slog.Default(),
// looked up when a record is logged. l must be safe for concurrent use, as every
// *slog.Logger is. Logger panics if l is nil.
func Logger(l *slog.Logger) Option {
	if l == nil {
		panic("asynqmutex.Logger: nil *slog.Logger")
	}
	return optionFunc(func(c *config) { c.logger = l })
}

// Middleware returns asynq middleware that runs each task's handler under a Redis
// lock on the task's key (see On and KeyBy), so tasks with equal keys never run at
// the same time (or no more than n at a time, with Limit) on any worker that shares
// the lock Redis, while tasks with other keys run in parallel. Use it with mux.Use(...) or Middleware(...)(handler).
//
// Per task: derive the key; take the lock, waiting up to MaxWait; run the handler
// while the lease is renewed every TTL/3; release; return the handler's result
// untouched. When the lease is lost while the handler runs (Redis lost the key, or
// could not be reached for a whole lease), the handler's context is cancelled and the
// loss is logged (see Logger). The handler's own result still decides: if it returns
// nil the task completes, since its work is done and a second run could not undo an
// overlap; if it returns an error, the task fails with an error wrapping both that
// error and mutex.ErrNotHeld. The handler's fencing token is available through Fence.
//
// When the lock is not obtained the handler does not run: a busy key is handled by the
// OnConflict policy and reported to AfterFailure; a Redis error is returned as an
// ordinary, retryable error; a key that cannot be derived (payload not JSON, a missing
// field, an object where On wants a scalar, a KeyBy error or empty key) returns an
// error naming the task and the field, wrapping
// asynq.SkipRetry, so the task goes to the archive where it can be inspected and run
// again, rather than retrying in a loop. A task is never run without its lock. No
// error text the middleware adds grows with the key or the payload: a key or task
// type longer than 100 bytes is shown shortened, with a digest.
//
// Each lock records the task type and task ID as its holder (mutex.HeldBy), which
// mutex.Client.Inspect and the asynqmutex command show. Events go to the observers
// of locks (mutex.Observe): the lock's own, and OpConflict with the policy applied
// and OpBadInput for a task archived for its input.
//
// Middleware panics if locks is nil or the options conflict. The returned middleware
// is safe for concurrent use.
func Middleware(locks *mutex.Client, opts ...Option) asynq.MiddlewareFunc {
	if locks == nil {
		panic("asynqmutex.Middleware: nil *mutex.Client")
	}
	m := &middleware{
		locks:     locks,
		config:    config{key: taskTypeKey, ttl: DefaultTTL, policy: Policy(DefaultRetryDelay)},
		conflicts: conflicts{seen: make(map[string]conflict)},
	}
	for _, o := range opts {
		o.apply(&m.config)
	}
	return func(next asynq.Handler) asynq.Handler {
		if next == nil {
			panic("asynqmutex.Middleware: nil handler")
		}
		return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
			return m.process(ctx, t, next)
		})
	}
}

type middleware struct {
	locks *mutex.Client
	config
	conflicts conflicts
}

func (m *middleware) process(ctx context.Context, t *asynq.Task, next asynq.Handler) error {
	id, _ := asynq.GetTaskID(ctx)
	key, err := m.key(ctx, t)
	if err == nil && key == "" {
		err = &keyError{taskType: t.Type(), msg: "KeyBy returned an empty key"}
	}
	if err != nil {
		var ke *keyError
		if !errors.As(err, &ke) { // a KeyBy error need not name the task
			err = fmt.Errorf("asynqmutex: task %s: lock key: %w", shortkey.Quote(t.Type()), err)
		}
		err = fmt.Errorf("%w; %s archived without running: %w", err, taskRef(id), asynq.SkipRetry)
		m.locks.Emit(ctx, mutex.Event{Op: mutex.OpBadInput, Name: t.Type(), ID: id, Err: err})
		m.failed(ctx, t, err)
		return err
	}

	wait, lastTry := m.wait(ctx)

	var (
		ran        bool
		handlerErr error
	)
	start := time.Now()
	err = m.locks.WithLock(ctx, key, m.ttl, func(ctx context.Context) error {
		ran = true
		handlerErr = next.ProcessTask(ctx, t)
		return nil // kept apart, so that err is only about the lock
	}, mutex.MaxWait(wait), mutex.HeldBy(t.Type(), id), mutex.Limit(max(m.limit, 1)))

	if ran {
		m.conflicts.forget(id)
		if !errors.Is(err, mutex.ErrNotHeld) {
			// A release Redis could not confirm needs no retry of the task: the key frees
			// itself when its lease runs out.
			return handlerErr
		}
		m.leaseLost(ctx, t, id, key, err, handlerErr)
		if handlerErr == nil {
			// The work is done: running it again would add a second run, not undo the
			// overlap.
			return nil
		}
		return fmt.Errorf("asynqmutex: task %s%s: lock %s was lost while the handler ran, so another worker may have run concurrently: %w", shortkey.Quote(t.Type()), idSuffix(id), shortkey.Show(key), errors.Join(err, handlerErr))
	}
	if !errors.Is(err, mutex.ErrNotObtained) || ctx.Err() != nil {
		err = fmt.Errorf("asynqmutex: task %s%s: taking lock %s: %w", shortkey.Quote(t.Type()), idSuffix(id), shortkey.Show(key), err)
		m.failed(ctx, t, err)
		return err
	}

	le := &LockedError{Key: key, taskType: t.Type(), taskID: id}
	conflict := func(policy string) {
		m.locks.Emit(ctx, mutex.Event{Op: mutex.OpConflict, Key: key, Name: t.Type(), ID: id, Wait: time.Since(start), Policy: policy, Err: le})
		m.failed(ctx, t, le)
	}
	switch m.policy {
	case Skip:
		conflict("skip")
		return nil
	case Fail:
		conflict("fail")
		return fmt.Errorf("%s: %w", le.Error(), mutex.ErrNotObtained)
	}
	if lastTry {
		le.waited, le.archived = wait, true
		conflict("archive")
		return &wrapError{msg: le.Error(), err: errors.Join(le, asynq.SkipRetry)}
	}
	n := m.conflicts.add(id)
	le.RetryIn = backoff(time.Duration(m.policy), n)
	conflict("retry")
	return le
}

// wait returns how long the task may wait for a busy key: MaxWait, or at least
// LastTryWait when the task has no retry left under RetryLater (lastTry), and in
// any case ending DeadlineMargin before the task's deadline.
func (m *middleware) wait(ctx context.Context) (wait time.Duration, lastTry bool) {
	wait = m.maxWait
	if m.policy != Skip && m.policy != Fail && noRetryLeft(ctx) {
		wait, lastTry = max(wait, LastTryWait), true
	}
	if deadline, ok := ctx.Deadline(); ok {
		wait = min(wait, time.Until(deadline)-DeadlineMargin)
	}
	return max(wait, 0), lastTry
}

// backoff is d doubled for each conflict after the first, up to 16·d, and never
// past the largest Duration.
func backoff(d time.Duration, conflicts int) time.Duration {
	for range min(conflicts-1, 4) {
		if d > math.MaxInt64/2 {
			return math.MaxInt64
		}
		d *= 2
	}
	return d
}

// leaseLost logs that the lock was lost while the handler ran: the one event that
// needs a person, since another worker may have run a task with the same key
// meanwhile, and AfterFailure is only for tasks whose handler did not run.
func (m *middleware) leaseLost(ctx context.Context, t *asynq.Task, id, key string, err, handlerErr error) {
	outcome := "completed: the handler returned nil"
	if handlerErr != nil {
		outcome = "failed: the handler returned an error"
	}
	logger := m.logger
	if logger == nil {
		logger = slog.Default()
	}
	logger.LogAttrs(ctx, slog.LevelWarn, "asynqmutex: lock lost while the handler ran; another worker may have run a task with the same key at the same time",
		slog.String("task_type", shortkey.Shorten(t.Type())),
		slog.String("task_id", shortkey.Shorten(id)),
		slog.String("key", shortkey.Shorten(key)),
		slog.String("task", outcome),
		slog.String("error", err.Error()))
}

// wrapError is an error with the text msg that wraps err.
type wrapError struct {
	msg string
	err error
}

func (e *wrapError) Error() string { return e.msg }
func (e *wrapError) Unwrap() error { return e.err }

// taskRef and idSuffix name a task by its ID in errors, when asynq gave one.
func taskRef(id string) string {
	if id == "" {
		return "the task is"
	}
	return "task " + id + " is"
}

func idSuffix(id string) string {
	if id == "" {
		return ""
	}
	return " (id " + id + ")"
}

func (m *middleware) failed(ctx context.Context, t *asynq.Task, err error) {
	if m.hook != nil {
		m.hook(ctx, t, err)
	}
}

// noRetryLeft reports whether asynq would archive the task for any error it returns
// now: asynq compares the retry count with MaxRetry before it asks IsFailure.
func noRetryLeft(ctx context.Context) bool {
	retried, ok1 := asynq.GetRetryCount(ctx)
	maxRetry, ok2 := asynq.GetMaxRetry(ctx)
	return ok1 && ok2 && retried >= maxRetry
}

// conflicts counts, per task ID, the conflicts a task met in this process, to back off
// RetryLater. asynq cannot count them: a busy key is not a failure, so the retry count
// it passes on stays the same, and a handler cannot change what asynq stores with the
// task. Entries expire, and the map is bounded (see RetryLater).
type conflicts struct {
	mu   sync.Mutex
	seen map[string]conflict
}

type conflict struct {
	n    int
	last time.Time
}

const (
	conflictMemory = time.Hour
	maxConflicts   = 100_000
)

func (c *conflicts) add(id string) int {
	if id == "" { // not run by an asynq server: nothing to remember it by
		return 1
	}
	now := time.Now()
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.seen) >= maxConflicts {
		for k, v := range c.seen {
			if now.Sub(v.last) > conflictMemory {
				delete(c.seen, k)
			}
		}
		if len(c.seen) >= maxConflicts {
			clear(c.seen) // backoff restarts for everyone: bounded memory matters more
		}
	}
	e := c.seen[id]
	if now.Sub(e.last) > conflictMemory {
		e.n = 0
	}
	e.n++
	e.last = now
	c.seen[id] = e
	return e.n
}

func (c *conflicts) forget(id string) {
	c.mu.Lock()
	delete(c.seen, id)
	c.mu.Unlock()
}

// Fence returns the fencing token of the lock the handler runs under: strictly
// greater than that of any earlier holder of the same key. Pass it to the resource you
// write to and have it reject writes with a lower fence; that, not the lock alone,
// keeps a paused or partitioned worker from overwriting newer data. It reports false
// outside a handler run by Middleware (or mutex.Client.WithLock).
func Fence(ctx context.Context) (int64, bool) {
	l, ok := mutex.FromContext(ctx)
	if !ok {
		return 0, false
	}
	return l.Fence(), true
}
