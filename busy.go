package asynqmutex

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"strings"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynqmutex/asynqmutex/internal/conflicts"
	"github.com/asynqmutex/asynqmutex/internal/shortkey"
	"github.com/asynqmutex/asynqmutex/mutex"
)

// This file decides what a busy key costs a task: how long it may wait, and what
// happens when a gate refuses it all the same (the OnConflict policy, the last try,
// the reschedule caps, AfterFailure and the events).

// refused decides what task tk pays for refusal r (its key was busy, at its rate
// limit, or not yet the task's turn), reports it to Observe and AfterFailure, and
// returns the task's result: under Skip none, under Fail an ordinary error; under
// Park or RetryLater, a task with no retry left is archived and a task past a
// reschedule cap fails, while any other is sent back without spending a retry (see
// Configure): a parked task for its fallback, to be started before it when its turn
// comes; any other for a while, for how long depending on what was busy.
func (m *middleware) refused(ctx context.Context, tk *task, r *refusal) error {
	le, id := r.le, tk.meta.id
	le.taskType, le.taskID = tk.Type(), id
	report := func(policy string) {
		m.emit(ctx, Event{Op: r.op, TaskType: tk.Type(), TaskID: id, Key: le.Key, Keys: le.Keys, Wait: time.Since(tk.start), Policy: policy, Err: le})
		m.failed(ctx, tk.Task, le)
	}
	if r.full {
		if result, done := m.overflowed(r, report); done {
			return result
		}
	}
	switch m.policy {
	case Skip:
		report("skip")
		return nil
	case Fail:
		report("fail")
		return fmt.Errorf("%s: %w", le.Error(), mutex.ErrNotObtained)
	}
	if tk.lastTry {
		le.waited, le.archived = tk.wait, true
		report("archive")
		return &wrapError{msg: le.Error(), err: errors.Join(le, asynq.SkipRetry)}
	}

	if c := tk.pastCap; c != nil {
		// Past its cap and out of retries: asynq archives the task for this error,
		// and its count ends here.
		m.clearRecord(ctx, tk.meta)
		le.caps, le.conflicts, le.since, le.archived = m.capsReached(*c), c.N+1, c.Elapsed, true
		report("archive")
		return fmt.Errorf("%s: %w", le.Error(), mutex.ErrNotObtained)
	}
	rec := conflicts.Record{N: 1}              // a conflict Redis did not count is taken as a first one
	if id != "" && (!r.parked || m.capped()) { // a park has no backoff to count for
		if got, err := m.conflicts.Count(ctx, tk.meta.queue, id, m.expiryOf(tk.meta)); err != nil {
			m.countFailed(ctx, tk.Type(), id, showKeys(le.Key, le.Keys), err)
		} else {
			rec = got
		}
	}
	if caps := m.capsReached(rec); caps != "" {
		le.caps, le.conflicts, le.since = caps, rec.N, rec.Elapsed
		report("fail")
		return fmt.Errorf("%s: %w", le.Error(), mutex.ErrNotObtained)
	}
	delay := m.policy.retryDelay()
	switch {
	case r.parked:
		// Its fallback: it is started when its turn comes, and comes back by itself
		// after this if that start is lost; behind a task due later, a second after
		// that one is due.
		le.RetryIn, le.parked = m.claim(), true
		switch {
		case !r.due.IsZero():
			le.RetryIn = m.parkUntil(tk, le.Key, r.due)
		case le.turn != nil:
			if due := time.Until(le.turn.due); due > 0 {
				le.RetryIn = max(le.RetryIn, wholeSeconds(due)+time.Second)
			}
		}
		report("park")
		return le
	case le.limited != nil:
		// The time until a start is free, not a backoff: waiting longer leaves the
		// key's starts unused.
		le.RetryIn = wholeSeconds(le.limited.delay)
	case le.turn != nil:
		// No backoff either: the task waits for one task to finish, not for a
		// contended key to calm down, and each doubling would delay the key's tail.
		// A task waiting for one that is due later comes back a second after it, so
		// as to find it queued ahead of itself.
		le.RetryIn = delay
		if due := time.Until(le.turn.due); due > 0 {
			le.RetryIn = max(le.RetryIn, wholeSeconds(due)+time.Second)
		}
	default:
		le.RetryIn = backoff(delay, rec.N)
	}
	report("retry")
	return le
}

// mayPark reports whether task tk, refused, parks: under Park, run by an asynq
// server (which alone can start it again), neither on its last try nor past a
// reschedule cap. Call it after waitLeft, which judges both.
func (m *middleware) mayPark(tk *task) bool {
	return m.policy == Park && tk.meta.id != "" && tk.meta.queue != "" && !tk.lastTry && tk.pastCap == nil
}

// leads reports whether, under Park, the first task in a busy key's line waits in its
// worker, up to LeadWait, rather than parks: when MaxWait is not set.
func (c *config) leads() bool { return c.policy == Park && c.maxWait == 0 }

// leadWait is how long the first task in a busy key's line waits in its worker under
// Park: LeadWait, ending DeadlineMargin before the task's deadline.
func (m *middleware) leadWait(ctx context.Context) time.Duration {
	wait := LeadWait
	if deadline, ok := ctx.Deadline(); ok {
		wait = min(wait, time.Until(deadline)-DeadlineMargin)
	}
	return max(wait, 0)
}

// waitLeft is how long task tk may still wait for its key at a gate: what is left of
// its wait (see budget), never below zero.
func (m *middleware) waitLeft(ctx context.Context, tk *task) time.Duration {
	if !tk.budgeted {
		m.budget(ctx, tk)
	}
	return max(time.Until(tk.start.Add(tk.wait)), 0)
}

// budget sets, once per task, how long it may wait for its key in all, and whether
// a refusal would be its last try: under RetryLater with no retry left it waits at
// least LastTryWait, unless it reached a reschedule cap on an earlier run (then a
// conflict fails at once, as under Fail, and asynq archives it). Only a task that
// has spent a retry can be past a cap, so an uncontended task costs no Redis command
// here, unless it is on its last retry with a cap set.
func (m *middleware) budget(ctx context.Context, tk *task) {
	tk.budgeted = true
	tk.lastTry = m.policy != Skip && m.policy != Fail && tk.meta.noRetryLeft()
	if tk.lastTry && m.capped() && tk.meta.retried > 0 && tk.meta.id != "" {
		if r, err := m.conflicts.Peek(ctx, tk.meta.queue, tk.meta.id); err == nil && m.capsReached(r) != "" {
			tk.lastTry, tk.pastCap = false, &r
		} // on an error, the last try waits as any other: Redis will say more when it answers
	}
	tk.wait = m.wait(ctx, tk.lastTry)
}

// wait returns how long the task may wait for a busy key: MaxWait, or at least
// LastTryWait on a last try under RetryLater (lastTry), and in any case ending
// DeadlineMargin before the task's deadline.
func (m *middleware) wait(ctx context.Context, lastTry bool) time.Duration {
	wait := m.maxWait
	if lastTry {
		wait = max(wait, LastTryWait)
	}
	if deadline, ok := ctx.Deadline(); ok {
		wait = min(wait, time.Until(deadline)-DeadlineMargin)
	}
	return max(wait, 0)
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

// wholeSeconds is d rounded up to whole seconds, at least one: asynq keeps retry
// times in whole seconds.
func wholeSeconds(d time.Duration) time.Duration {
	if r := d.Truncate(time.Second); r < d {
		d = r + time.Second
	}
	return max(d, time.Second)
}

// recordExpiry is how long a record outlives the conflict that last counted in it:
// twice the longest delay RetryLater asks for (16·d, plus jitter of up to a quarter
// of it), plus an hour for the task to wait in its queue behind others.
func recordExpiry(d time.Duration) time.Duration {
	longest := backoff(d, 5)
	if longest > (math.MaxInt64-time.Hour)/2 {
		return math.MaxInt64
	}
	return 2*longest + time.Hour
}

// cappedExpiry is how long the record of a task under a cap outlives a conflict: at
// least recordExpiry, and past the cap, as the task's failures are then retried
// after asynq's own backoff, longer than asynq's DefaultRetryDelayFunc can wait
// before its next retry (n⁴ + 15 + 30·(n+1) seconds after the n-th failure), plus
// the same hour, so that the count does not restart while the task waits.
func cappedExpiry(d time.Duration, meta taskMeta) time.Duration {
	e := recordExpiry(d)
	if !meta.counted {
		return e
	}
	n := int64(meta.retried) + 1 // the failure this conflict may be
	if n > 1000 {
		n = 1000 // past any real MaxRetry: 1000⁴ s is 31,000 years
	}
	wait := time.Duration(n*n*n*n+15+30*(n+1))*time.Second + time.Hour
	return max(e, wait)
}

// expiryOf is how long the record of a task outlives a conflict it counts in.
func (m *middleware) expiryOf(meta taskMeta) time.Duration {
	d := m.policy.retryDelay()
	if m.policy == Park {
		d = max(d, m.claim()) // a parked task counts again at its fallback
	}
	if m.capped() {
		return cappedExpiry(d, meta)
	}
	return recordExpiry(d)
}

// capped reports whether a reschedule cap is set.
func (c *config) capped() bool { return c.maxReschedules > 0 || c.maxRescheduleTime > 0 }

// capsReached names the caps that r has reached, "" if none.
func (c *config) capsReached(r conflicts.Record) string {
	var caps []string
	if c.maxReschedules > 0 && r.N > c.maxReschedules {
		caps = append(caps, fmt.Sprintf("MaxReschedules(%d)", c.maxReschedules))
	}
	if c.maxRescheduleTime > 0 && r.Elapsed >= c.maxRescheduleTime {
		caps = append(caps, fmt.Sprintf("MaxRescheduleTime(%v)", c.maxRescheduleTime))
	}
	return strings.Join(caps, " and ")
}

// clearRecord deletes the task's record once it has obtained its key. A failure
// leaves the record to expire: a later conflict of the same task within that time
// would count on from it.
func (m *middleware) clearRecord(ctx context.Context, meta taskMeta) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
	defer cancel()
	_ = m.conflicts.Clear(ctx, meta.queue, meta.id)
}

// countFailed logs that Redis could not count a conflict, which leaves the task
// outside any reschedule cap for this conflict; shown is the key or keys, shortened.
func (m *middleware) countFailed(ctx context.Context, t, id, shown string, err error) {
	m.log().LogAttrs(ctx, slog.LevelWarn, "asynqmutex: could not count a conflict in Redis; the task is sent back as after a first conflict, and this conflict does not count toward a reschedule cap",
		slog.String("task_type", shortkey.Shorten(t)),
		slog.String("task_id", shortkey.Shorten(id)),
		slog.String("key", shown),
		slog.String("error", err.Error()))
}
