package asynqmutex

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/asynqmutex/asynqmutex/internal/shortkey"
	"github.com/asynqmutex/asynqmutex/mutex"
)

// lockGate takes the task's lock (or all its keys, or one of its key's Limit(n)
// slots), waiting up to what is left of its wait, and passes the task on while it
// holds it: the lock is renewed meanwhile and released when the rest of the path
// returns. It refuses the task when its key stays busy (under Park, once it parked in
// its key's line), and fails it when Redis cannot say. A lock lost while the handler
// ran is left in tk for the outcome.
func (m *middleware) lockGate(ctx context.Context, tk *task, next func(context.Context) error) error {
	var (
		entered bool
		inner   error     // what the rest of the path returned
		done    time.Time // when it returned, before the release
	)
	fn := func(ctx context.Context) error {
		entered = true
		inner = next(ctx)
		done = time.Now()
		return nil // kept apart, so that err is only about the lock
	}
	wait, held := mutex.MaxWait(m.waitLeft(ctx, tk)), mutex.HeldBy(tk.Type(), tk.meta.id)
	var err error
	switch park := m.parking(ctx, tk); {
	case tk.keys != nil && park != nil:
		err = m.locks.WithLockKeys(ctx, tk.keys, m.ttl, fn, park[0], park[1], held, m.startWith)
	case tk.keys != nil:
		err = m.locks.WithLockKeys(ctx, tk.keys, m.ttl, fn, wait, held, m.startWith)
	case park != nil && m.rates != nil && m.leads() && m.parksUntil(ctx, tk):
		// A task whose start comes later parks until it, not in the lock's line (see
		// startLater): a first attempt takes the lock if it is free, or handed to the
		// task, and queues nobody. Not with MaxWait, under which a task waits for the
		// lock in its worker first, as asked.
		tkt := mutex.Park(ticket(tk.meta.queue, tk.meta.id), m.claim(), mutex.ParkNever)
		err = m.locks.WithLock(ctx, tk.key, m.ttl, fn, tkt, mutex.MaxWait(0), held, m.limitOpt, m.startWith)
		if !entered && errors.Is(err, mutex.ErrNotObtained) && ctx.Err() == nil {
			if later := m.startLater(ctx, tk); later != nil {
				return later
			}
			err = m.locks.WithLock(ctx, tk.key, m.ttl, fn, append(park, held, m.limitOpt, m.startWith)...)
		}
	case park != nil:
		err = m.locks.WithLock(ctx, tk.key, m.ttl, fn, append(park, held, m.limitOpt, m.startWith)...)
	default:
		err = m.locks.WithLock(ctx, tk.key, m.ttl, fn, wait, held, m.limitOpt, m.startWith)
	}
	switch {
	case entered:
		if tk.keys == nil {
			m.unwatchLease(tk.key, done)
		}
		for _, k := range tk.keys {
			m.unwatchLease(k, done)
		}
		if tk.ran && errors.Is(err, mutex.ErrNotHeld) {
			tk.leaseLost = err
		}
		// A release Redis could not confirm needs no retry of the task: the key
		// frees itself when its lease runs out.
		return inner
	case !errors.Is(err, mutex.ErrNotObtained) || ctx.Err() != nil:
		return &wrapError{
			msg: fmt.Sprintf("asynqmutex: task %s%s: taking lock%s: %s", shortkey.Quote(tk.Type()), idSuffix(tk.meta.id), unlessNamed(err, tk.key, tk.keys), oneLine(err)),
			err: err,
		}
	}
	le := &LockedError{Key: tk.key, Keys: tk.keys}
	if busy, ok := mutex.BusyKey(err); ok {
		le.Key = busy
	}
	if left, ok := mutex.LeaseLeft(err); ok && left >= 0 {
		m.watchLease(le.Key, left) // the key it parked at, of several
	}
	return &refusal{op: OpConflict, le: le, parked: errors.Is(err, mutex.ErrParked), full: errors.Is(err, mutex.ErrLineFull)}
}

// parking is what task tk's lock (or its slot of a Limit(n) key) is taken with
// under Park: mutex.Park and its MaxWait, or nil when the task has no ticket: under
// another policy; outside an asynq server, which alone can start it again. A task
// with several keys parks in the line of the first busy one, holding none of them.
// The first task in the line waits up to LeadWait before it parks; with
// MaxWait, every task waits up to MaxWait first. A task that must not park (on its last try, past a
// reschedule cap, or with less than DeadlineMargin left before its deadline) still
// takes its ticket: it claims the key if its line handed it over, and waits in its
// entry's place. Under MaxBacklog a task that may park has its line capped
// (mutex.MaxLine); one that must not park is not.
func (m *middleware) parking(ctx context.Context, tk *task) []mutex.LockOption {
	left := m.waitLeft(ctx, tk) // sets lastTry and pastCap
	if m.policy != Park || tk.meta.id == "" || tk.meta.queue == "" {
		return nil
	}
	mode, wait := mutex.ParkAfterWait, left
	if m.leads() {
		mode, wait = mutex.ParkLead, m.leadWait(ctx)
	}
	if tk.lastTry || tk.pastCap != nil || wait <= 0 {
		mode, wait = mutex.ParkNever, left
	}
	opts := []mutex.LockOption{mutex.Park(ticket(tk.meta.queue, tk.meta.id), m.claim(), mode), mutex.MaxWait(wait)}
	if m.lineCap != nil && mode != mutex.ParkNever {
		opts = append(opts, m.lineCap)
	}
	return opts
}

// claim is how long a key handed to a parked task waits for it to arrive, and how
// long at most a parked task waits before it comes back by itself: the lock's TTL,
// in whole seconds.
func (m *middleware) claim() time.Duration { return wholeSeconds(m.ttl) }
