package asynqmutex

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynqmutex/asynqmutex/internal/shortkey"
	"github.com/asynqmutex/asynqmutex/ratelimit"
)

// Rate lets at most n tasks of a key start per interval per, on every worker that
// shares the lock Redis: with On("tenant_id") and Rate(100, time.Minute), each tenant
// starts at most 100 tasks a minute, one every 600ms (see Burst to let some start at
// once). It is one more gate before the handler, beside the lock, and keyed like it
// (On, KeyBy, Scope); with Limit(5) a tenant runs at most 5 tasks at once and starts
// at most 100 a minute. The limiter is package ratelimit's (GCRA on the Redis
// server's clock, one decision per task, one Redis key per limited key).
//
// A task over the limit is handled as one whose key is busy: it waits up to MaxWait
// if its start comes within it, taking its start ahead (a timer, not polling: tasks
// waiting for one key start in the order they asked); otherwise the OnConflict
// policy applies, with RetryLater sending the task back for the time until a start
// is free, rounded up to whole seconds, instead of its fixed delay. Skip, Fail,
// AfterFailure, the reschedule caps and Configure's "no retry spent" apply as for a
// busy key; the error is a *LockedError that also wraps ratelimit.ErrLimited.
//
// A task takes its lock first and its start second, holding the lock while it waits
// for the start: a task that meets a busy lock spends no start, and waiting with the
// lock costs nothing, since the key's rate is then what binds. With NoLock a task
// takes its start only. A handler can pause its key fleet-wide with PauseKey.
//
// The default is no rate limit. Rate panics if n is below 1 or per is outside
// [1ms, ratelimit.MaxPer], or if per/n is below a microsecond; Middleware panics if
// Rate (or RateBy) is given with OnEach or KeysBy, or both are given.
func Rate(n int, per time.Duration) Option {
	lim := ratelimit.Limit{N: n, Per: per}
	if err := lim.Validate(); err != nil {
		panic("asynqmutex.Rate: " + err.Error())
	}
	return optionFunc(func(c *config) { c.setRate("Rate", lim, nil) })
}

// Burst lets up to b tasks of a key start at once under Rate after the key was idle,
// instead of one: with Rate(100, time.Minute) and Burst(10), an idle tenant may start
// 10 tasks at once, then one every 600ms. Any window of the interval then holds up
// to n+b-1 starts. The default is 1, which keeps every window of the interval, wherever
// it falls, at n starts: what an API that counts per window allows. Burst panics if b
// is below 1 or above ratelimit.MaxBurst; Middleware panics if it is given without
// Rate (RateBy's limits carry their own burst).
func Burst(b int) Option {
	if b < 1 || b > ratelimit.MaxBurst {
		panic(fmt.Sprintf("asynqmutex.Burst: burst %d outside [1, %d] (ratelimit.MaxBurst)", b, ratelimit.MaxBurst))
	}
	return optionFunc(func(c *config) { c.burst = b })
}

// RateBy is Rate with a limit per task, for keys whose limits differ (a tenant's
// plan): fn returns the limit of the task's key, or the zero Limit for no limit. It
// runs on the worker before each task takes its start, so it should be quick (cache
// what it looks up) and must be safe for concurrent use; tasks of one key should get
// one limit, and a new limit applies from the next start. An error from fn, or an
// invalid limit, fails the task with an ordinary, retryable error naming it, before
// the handler runs. Otherwise RateBy behaves as Rate. RateBy panics if fn is nil.
func RateBy(fn func(ctx context.Context, t *asynq.Task) (ratelimit.Limit, error)) Option {
	if fn == nil {
		panic("asynqmutex.RateBy: nil function")
	}
	return optionFunc(func(c *config) { c.setRate("RateBy", ratelimit.Limit{}, fn) })
}

// NoLock makes the middleware take no lock: tasks of a key run at once, as many as
// the workers allow, and only Rate (or RateBy) gates them. Fence then reports false.
// Middleware panics if NoLock is given without Rate or RateBy, or with Limit.
func NoLock() Option {
	return optionFunc(func(c *config) { c.noLock = true })
}

func (c *config) setRate(by string, lim ratelimit.Limit, fn func(context.Context, *asynq.Task) (ratelimit.Limit, error)) {
	if c.rateBy != "" {
		panic("asynqmutex.Middleware: " + c.rateBy + " and " + by + " both given; give one")
	}
	c.rateBy, c.rate, c.rateFunc = by, lim, fn
}

// checkRate panics on a rate configuration that cannot work.
func (c *config) checkRate() {
	switch {
	case c.burst > 0 && c.rateBy != "Rate":
		panic("asynqmutex.Middleware: Burst without Rate; RateBy's limits carry their own Burst")
	case c.noLock && c.rateBy == "":
		panic("asynqmutex.Middleware: NoLock without Rate or RateBy leaves nothing to gate the tasks")
	case c.noLock && c.limit > 1:
		panic("asynqmutex.Middleware: NoLock and Limit both given; Limit caps the tasks that hold a key's lock")
	case c.rateBy != "" && (c.keySetBy == "OnEach" || c.keySetBy == "KeysBy"):
		panic("asynqmutex.Middleware: " + c.rateBy + " limits one key per task; " + c.keySetBy + " gives a task several keys")
	}
	c.rate.Burst = c.burst
}

// limitOf is the rate limit of task t: Rate's, or RateBy's answer; the zero Limit
// for none.
func (m *middleware) limitOf(ctx context.Context, t *asynq.Task, id string) (ratelimit.Limit, error) {
	if m.rateFunc == nil {
		return m.rate, nil
	}
	lim, err := m.rateFunc(ctx, t)
	if err == nil && lim != (ratelimit.Limit{}) {
		err = lim.Validate()
	}
	if err != nil {
		return ratelimit.Limit{}, fmt.Errorf("asynqmutex: task %s%s: RateBy: %s", shortkey.Quote(t.Type()), idSuffix(id), oneLine(err))
	}
	return lim, nil
}

// limitedError is why a task did not start under its rate limit: its next start
// comes in delay (paused: held back by a pause that long). It carries the gate's
// answer out of the lock's fn to the conflict policy.
type limitedError struct {
	lim           ratelimit.Limit
	delay, paused time.Duration
}

func (e *limitedError) Error() string { return "rate limit: next start in " + e.delay.String() }
func (e *limitedError) Unwrap() error { return ratelimit.ErrLimited }

// takeStart takes the task's start under lim on key, waiting up to maxWait for it
// (see ratelimit.Limiter.Take), and returns how long it waited. It returns a
// *limitedError when the start comes later than maxWait, ctx's error if ctx ends
// while it waits (the start is given back), or a Redis error.
func (m *middleware) takeStart(ctx context.Context, key string, lim ratelimit.Limit, maxWait time.Duration) (time.Duration, error) {
	r, err := m.rates.Take(ctx, key, lim, max(maxWait, 0))
	switch {
	case err != nil:
		return 0, err
	case !r.Allowed:
		return 0, &limitedError{lim: lim, delay: r.Delay, paused: r.Paused}
	}
	return r.Delay, nil
}

// PauseError is what PauseKey returns: a handler's request to hold its key's tasks
// back for For, fleet-wide.
type PauseError struct {
	For time.Duration // how long to hold the key back
	Err error         // why, for the task's error: the 429, say
}

// PauseKey returns an error for a handler to return when the service behind its
// key asks to be left alone for d, an HTTP 429 with Retry-After: 30, say: under Rate
// or RateBy the middleware pauses the task's key for d on every worker (see
// ratelimit.Limiter.Pause), so that no task of the key starts before d has passed,
// and tasks of other keys run on. The task itself is sent back to run again after d
// (rounded up to whole seconds), as a busy key's task under RetryLater: with
// Configure it spends no retry, whatever the OnConflict policy. A task with no retry
// left is archived by asynq with this error, as for any error. Without a rate gate
// the key is not paused, and the task is only sent back. err may be nil.
func PauseKey(d time.Duration, err error) error {
	return &PauseError{For: d, Err: err}
}

// Error says how long the key is to be paused, and why.
func (e *PauseError) Error() string {
	msg := "asynqmutex: pause the key for " + e.For.String()
	if e.Err != nil {
		msg += ": " + oneLine(e.Err)
	}
	return msg
}

// Unwrap returns Err.
func (e *PauseError) Unwrap() error { return e.Err }

// paused handles a handler's PauseError pe for task t on key: it pauses the key (with
// a rate gate; sent even when the task's context has ended, as the handler's answer
// stands) and returns the task's error, a *LockedError whose RetryIn is the
// pause, rounded up to whole seconds.
func (m *middleware) paused(ctx context.Context, t *asynq.Task, id, key string, lim ratelimit.Limit, pe *PauseError) error {
	d := max(pe.For, time.Second)
	le := &LockedError{Key: key, RetryIn: wholeSeconds(d), taskType: t.Type(), taskID: id, paused: d, cause: pe}
	if lim != (ratelimit.Limit{}) {
		if _, err := m.rates.Pause(context.WithoutCancel(ctx), key, lim, min(d, ratelimit.MaxPer)); err != nil {
			le.pauseErr = err
		}
	} else {
		le.pauseErr = errNoRateGate
	}
	m.emit(ctx, Event{Op: OpPaused, TaskType: t.Type(), TaskID: id, Key: key, Wait: d, Err: le})
	return le
}

var errNoRateGate = errors.New("the middleware has no Rate or RateBy, so the key was not paused")

// wholeSeconds is d rounded up to whole seconds, at least one: asynq keeps retry
// times in whole seconds.
func wholeSeconds(d time.Duration) time.Duration {
	if r := d.Truncate(time.Second); r < d {
		d = r + time.Second
	}
	return max(d, time.Second)
}

// rateGate takes task t's start on key under lim, waiting up to maxWait for it; a
// zero lim lets the task through. A wait is reported as OpRateWaited.
func (m *middleware) rateGate(ctx context.Context, t *asynq.Task, id, key string, lim ratelimit.Limit, maxWait time.Duration) error {
	if lim == (ratelimit.Limit{}) {
		return nil
	}
	waited, err := m.takeStart(ctx, key, lim, maxWait)
	var limited *limitedError
	switch {
	case errors.As(err, &limited):
		return err
	case err != nil:
		return &gateError{err: err, waiting: ctx.Err() != nil}
	case waited > 0:
		m.emit(ctx, Event{Op: OpRateWaited, TaskType: t.Type(), TaskID: id, Key: key, Wait: waited})
	}
	return nil
}

// gateError is an error of the rate gate other than a refusal: RateBy's, Redis's,
// or the context's while the task waited for its start.
type gateError struct {
	err     error
	named   bool // err names the task already (RateBy's)
	waiting bool // the context ended while the task waited for its start
}

func (e *gateError) Error() string { return e.err.Error() }
func (e *gateError) Unwrap() error { return e.err }

// describe is the task's error text: the task, the key, what failed.
func (e *gateError) describe(taskType, id, key string) string {
	if e.named {
		return oneLine(e.err)
	}
	what := "taking its start under the rate limit of key " + shortkey.Show(key)
	if e.waiting {
		what = "waiting for its start under the rate limit of key " + shortkey.Show(key)
	}
	return fmt.Sprintf("asynqmutex: task %s%s: %s: %s", shortkey.Quote(taskType), idSuffix(id), what, oneLine(e.err))
}
