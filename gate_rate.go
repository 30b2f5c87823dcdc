package asynqmutex

import (
	"context"
	"fmt"
	"strconv"
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
// policy applies. Under Park, the default, the task takes its start ahead all the
// same, if it comes within four TTLs, and parks until it: the process it parked on
// starts it when the start falls due, and it runs on the start it holds (see
// ratelimit.Limiter.TakeAs), so a backlog drains at the limit with no worker waiting.
// A task whose key is paused longer parks until the pause ends; one whose start comes
// later still is sent back as under RetryLater. RetryLater sends the task back for
// the time until a start is free, rounded up to whole seconds, instead of its fixed
// delay. Skip, Fail, AfterFailure, the reschedule caps and Configure's "no retry
// spent" apply as for a busy key; the error is a *LockedError that also wraps
// ratelimit.ErrLimited.
//
// A task takes its lock first and its start second, holding the lock while it waits
// for the start: waiting with the lock costs nothing, since the key's rate is then
// what binds. Under Park without MaxWait a task that meets its lock busy asks for its
// start at once, and parks until it when it comes later than the task would wait,
// rather than in the lock's line, whose hand-over would only bring it back to park
// again for its start; otherwise it gives that start back and joins the line. With
// NoLock a task takes its start only. A handler can pause its key fleet-wide with
// PauseKey.
//
// The default is no rate limit. Rate panics if n is below 1 or per is outside
// [1ms, ratelimit.MaxPer], or if per/n is below a microsecond; Middleware panics if
// Rate (or RateBy) is given with OnEach or KeysBy, or both are given.
func Rate(n int, per time.Duration) Option {
	lim := ratelimit.Rate{N: n, Per: per}
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
	return once("Burst", fmt.Sprintf("Burst(%d)", b), func(c *config) { c.burst = b })
}

// RateBy is Rate with a limit per task, for keys whose limits differ (a tenant's
// plan): fn returns the limit of the task's key, or the zero Rate for no limit; its
// Cost says what the task counts as (a task that makes 5 calls to an API limited to
// 100 a minute: ratelimit.Rate{N: 100, Per: time.Minute, Cost: 5}); a task whose cost
// is above the burst waits for the rest at least (ratelimit.Rate.MinDelay), in its
// worker or, under Park, parked. It
// runs on the worker before each task takes its start, so it should be quick (cache
// what it looks up) and must be safe for concurrent use; tasks of one key should get
// one limit, and a new limit applies from the next start. An error from fn, or an
// invalid limit, fails the task with an ordinary, retryable error naming it, before
// the handler runs. Otherwise RateBy behaves as Rate. RateBy panics if fn is nil.
func RateBy(fn func(ctx context.Context, t *asynq.Task) (ratelimit.Rate, error)) Option {
	if fn == nil {
		panic("asynqmutex.RateBy: nil function")
	}
	return optionFunc(func(c *config) { c.setRate("RateBy", ratelimit.Rate{}, fn) })
}

// NoLock makes the middleware take no lock: tasks of a key run at once, as many as
// the workers allow, and only Rate (or RateBy) gates them. Fence then reports false.
// Middleware panics if NoLock is given without Rate or RateBy, or with Limit.
func NoLock() Option {
	return once("NoLock", "NoLock()", func(c *config) { c.noLock = true })
}

func (c *config) setRate(by string, lim ratelimit.Rate, fn func(context.Context, *asynq.Task) (ratelimit.Rate, error)) {
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

// rateOf is task tk's rate limit (limitOf), asked once per run and kept in tk.
func (m *middleware) rateOf(ctx context.Context, tk *task) (ratelimit.Rate, error) {
	if tk.limSet {
		return tk.lim, nil
	}
	lim, err := m.limitOf(ctx, tk.Task, tk.meta.id)
	if err == nil {
		tk.lim, tk.limSet = lim, true
	}
	return lim, err
}

// limitOf is the rate limit of task t: Rate's, or RateBy's answer; the zero Rate
// for none.
func (m *middleware) limitOf(ctx context.Context, t *asynq.Task, id string) (ratelimit.Rate, error) {
	if m.rateFunc == nil {
		return m.rate, nil
	}
	lim, err := m.rateFunc(ctx, t)
	if err == nil && lim != (ratelimit.Rate{}) {
		err = lim.Validate()
	}
	if err != nil {
		return ratelimit.Rate{}, fmt.Errorf("asynqmutex: task %s%s: RateBy: %s", shortkey.Quote(t.Type()), idSuffix(id), oneLine(err))
	}
	return lim, nil
}

// rateGate takes the task's start under its key's rate limit (Rate, or RateBy's
// answer), waiting up to what is left of its wait for it, and passes the task on. A
// wait is reported as OpRateWaited. It refuses the task when its start comes later
// (or its key is paused), and fails it when RateBy or Redis fails, or the task's
// context ends while it waits (its start is given back). Under Park (see parksUntil)
// a start due later, within hold, is reserved under the task's ticket, and the
// refusal parks the task until it: the task, started then, finds its start
// reserved. A task whose key is paused for longer than hold parks until the pause
// ends, without a start; one whose start is due later for other reasons is sent
// back.
func (m *middleware) rateGate(ctx context.Context, tk *task, next func(context.Context) error) error {
	lim, err := m.rateOf(ctx, tk)
	if err != nil {
		return &wrapError{msg: oneLine(err), err: err}
	}
	if lim == (ratelimit.Rate{}) {
		return next(ctx)
	}
	var r ratelimit.Result
	park := m.parksUntil(ctx, tk)
	if park {
		// A start within the lead is waited for here: parking would take longer.
		r, err = m.takeAs(ctx, tk, lim, max(m.waitLeft(ctx, tk), m.lead()))
	} else {
		// A start that costs more than the burst is waited for, for its cost beyond it
		// at least: it would find that wait again whenever it came back.
		r, err = m.rates.Take(ctx, tk.key, lim, max(m.waitLeft(ctx, tk), costWait(lim)))
	}
	switch {
	case err != nil:
		return m.rateFailed(ctx, tk, err)
	case !r.Allowed:
		return m.notYet(tk, lim, r, park)
	case r.Delay > 0:
		m.emit(ctx, Event{Op: OpRateWaited, TaskType: tk.Type(), TaskID: tk.meta.id, Key: tk.key, Wait: r.Delay})
	}
	if park {
		m.due.drop(ticket(tk.meta.queue, tk.meta.id)) // in case it came before its start fell due
	}
	return next(ctx)
}

// startLater is, for task tk that met its key's lock (or slots) busy and may park,
// a refusal that parks it until its start when its key's rate, or a pause, holds it
// back past its wait left, or startEarly, the least lead: it waits for its start
// outside the lock's line, and takes the lock when the start is due, rather than be
// handed the lock first only to park again for its start (a task through asynq once
// more, and every task behind it in the line handed the lock, started and parked
// again in turn). It returns nil when the start comes
// sooner: the task joins the lock's line, and takes its start when it holds the lock.
// A start taken here for that (now, or within the wait) is given back, as the rate
// gate would give it up as late after a wait in the line and take another: two
// starts for one run. One held for the task before, which it came back for, stays:
// the rate gate finds it. A task with no rate limit gets nil.
func (m *middleware) startLater(ctx context.Context, tk *task) error {
	lim, err := m.rateOf(ctx, tk)
	if err != nil {
		return &wrapError{msg: oneLine(err), err: err}
	}
	if lim == (ratelimit.Rate{}) {
		return nil
	}
	r, err := m.takeAs(ctx, tk, lim, 0)
	switch {
	case err != nil:
		return m.rateFailed(ctx, tk, err)
	case !r.Allowed && !(r.Held && r.Delay <= max(m.waitLeft(ctx, tk), startEarly)):
		// Not the lead, which grows with the dispatch lag: the line would hand the lock
		// to a task whose start is not due, and it would park again for it.
		return m.notYet(tk, lim, r, true)
	case !r.Found:
		// Given back unless a start was taken after it: then it lapses, and the key
		// starts one task fewer.
		_, _ = m.rates.Cancel(ctx, tk.key, r)
	}
	return nil
}

// takeAs takes task tk's start under lim, reserved for this run of the task (its
// ticket and retry count: a retry after a failure takes a start of its own), waiting
// for it up to maxWait (ratelimit.Limiter.TakeAs, held up to hold, or longer for a
// start that costs more than the burst), and records, on a run's first take, how late
// a task that parked until its start came for it: a later take of the run finds the
// same start after the run's wait in the lock's line, which is no dispatch lag.
func (m *middleware) takeAs(ctx context.Context, tk *task, lim ratelimit.Rate, maxWait time.Duration) (ratelimit.Result, error) {
	id := ticket(tk.meta.queue, tk.meta.id) + "#" + strconv.Itoa(tk.meta.retried)
	r, err := m.rates.TakeAs(ctx, tk.key, lim, id, maxWait, m.hold()+costWait(lim))
	if err == nil && r.Found && !tk.lagSeen {
		m.sawLag(r.Late)
	}
	tk.lagSeen = true
	return r, err
}

// costWait is how long a start under lim waits at least, on an idle key too
// (ratelimit.Rate.MinDelay), and an interval more for the calls' own time; 0 for a
// start that costs no more than the burst.
func costWait(lim ratelimit.Rate) time.Duration {
	if d := lim.MinDelay(); d > 0 {
		return d + lim.Per/time.Duration(lim.N)
	}
	return 0
}

// notYet is the refusal of task tk, not started under lim (r): it parks until its
// reserved start, or, when park, until its key's pause ends if that is beyond what it
// may reserve; otherwise it is sent back.
func (m *middleware) notYet(tk *task, lim ratelimit.Rate, r ratelimit.Result, park bool) *refusal {
	ref := &refusal{op: OpLimited, le: &LockedError{Key: tk.key, limited: &limited{lim: lim, delay: r.Delay, paused: r.Paused}}}
	switch {
	case r.Held: // its start is reserved: it parks until then
		ref.parked, ref.due = true, time.Now().Add(r.Delay)
	case park && r.Paused > m.hold(): // paused too long to reserve a start after it
		ref.parked, ref.due = true, time.Now().Add(r.Paused)
	}
	return ref
}

// rateFailed is the error of task tk whose start Redis could not give (err).
func (m *middleware) rateFailed(ctx context.Context, tk *task, err error) error {
	what := "taking its start under the rate limit of key " + shortkey.Show(tk.key)
	if ctx.Err() != nil {
		what = "waiting for its start under the rate limit of key " + shortkey.Show(tk.key)
	}
	return &wrapError{
		msg: fmt.Sprintf("asynqmutex: task %s%s: %s: %s", shortkey.Quote(tk.Type()), idSuffix(tk.meta.id), what, oneLine(err)),
		err: err,
	}
}

// limited is why a task did not start under its rate limit: its next start comes
// in delay (paused: held back by a pause that long).
type limited struct {
	lim           ratelimit.Rate
	delay, paused time.Duration
}
