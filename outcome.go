package asynqmutex

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynqmutex/asynqmutex/internal/shortkey"
	"github.com/asynqmutex/asynqmutex/ratelimit"
)

// handle runs task tk's handler h, the end of the path, and keeps its result for the
// outcome. Under InOrder the task's place is readied to finish (or its waiters sent
// back) before the lock's release, in whose round trip it is sent.
func (m *middleware) handle(ctx context.Context, tk *task, h asynq.Handler) {
	tk.ran = true
	tk.result = h.ProcessTask(ctx, tk.Task)
	if tk.place != nil {
		m.handled(tk)
	}
}

// outcome makes task tk's result of what its path returned (err): a refusal costs the
// task what busy.go decides; a gate's error is returned as it is; a task whose
// handler ran returns the handler's result, but for a pause it asked for and a lock
// lost meanwhile. Under InOrder the task's place is then finished by that result.
func (m *middleware) outcome(ctx context.Context, tk *task, err error) error {
	if r, ok := err.(*refusal); ok {
		err = m.refused(ctx, tk, r)
	} else if err != nil {
		m.failed(ctx, tk.Task, err)
	} else {
		err = m.ran(ctx, tk)
	}
	if tk.place != nil {
		m.finishPlace(ctx, tk, err)
	}
	return err
}

// ran is the result of task tk, whose handler ran: the handler's own, unless it
// asked for its key to be paused or the lock was lost while it ran.
func (m *middleware) ran(ctx context.Context, tk *task) error {
	if m.capped() && tk.meta.id != "" { // caps come with RetryLater only (see Middleware)
		// The conflicts are over: a later one starts a new count. Without a cap the
		// record is left to expire, so that an uncontended task costs no Redis
		// command beyond its lock's (see RetryLater).
		m.clearRecord(ctx, tk.meta)
	}
	result := tk.result
	if pe := (*PauseError)(nil); errors.As(result, &pe) {
		result = m.paused(ctx, tk, pe)
	}
	if tk.leaseLost == nil {
		return result
	}
	m.leaseLost(ctx, tk.Task, tk.meta.id, showKeys(tk.key, tk.keys), tk.leaseLost, result)
	if result == nil {
		// The work is done: running it again would add a second run, not undo the
		// overlap.
		return nil
	}
	return &wrapError{
		msg: fmt.Sprintf("asynqmutex: task %s%s: lock%s lost while the handler ran, so another worker may have run concurrently: %s; the handler returned: %s",
			shortkey.Quote(tk.Type()), idSuffix(tk.meta.id), unlessNamed(tk.leaseLost, tk.key, tk.keys), oneLine(tk.leaseLost), oneLine(result)),
		err: errors.Join(tk.leaseLost, result),
	}
}

// leaseLost logs that the lock was lost while the handler ran: the one event that
// needs a person, since another worker may have run a task with the same key
// meanwhile, and AfterFailure is only for tasks whose handler did not run.
func (m *middleware) leaseLost(ctx context.Context, t *asynq.Task, id, shown string, err, handlerErr error) {
	outcome := "completed: the handler returned nil"
	if handlerErr != nil {
		outcome = "failed: the handler returned an error"
	}
	m.log().LogAttrs(ctx, slog.LevelWarn, "asynqmutex: lock lost while the handler ran; another worker may have run a task with the same key at the same time",
		slog.String("task_type", shortkey.Shorten(t.Type())),
		slog.String("task_id", shortkey.Shorten(id)),
		slog.String("key", shown),
		slog.String("task", outcome),
		slog.String("error", oneLine(err)))
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
// and tasks of other keys run on. Under Park, the default, the task itself parks
// until its key is free again (the pause's end, or later if starts taken before it
// hold the key longer) and is started then by the process it ran on, coming back by
// itself a TTL later if that process dies (see Park); under another policy it is
// sent back to run again once d has passed (d rounded up to whole seconds, and a
// second more, since asynq keeps retry times in whole seconds), as a busy key's task
// under RetryLater. With Configure it spends no retry, whatever the OnConflict
// policy. A task with no retry left is archived by asynq with this error, as for
// any error. Without a rate gate the key is not paused, and the task is only parked
// or sent back for d. err may be nil.
//
// Each pause is logged at Warn (see Logger) with the key, how long and until when,
// and err; a task whose key another pause holds back longer logs nothing. The task's
// error, a *LockedError, wraps the *PauseError: an ErrorHandler tells a pause from a
// busy key with errors.As(err, new(*PauseError)) (docs/conflicts.md).
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

// paused handles the PauseError pe that task tk's handler returned: it pauses the
// key (with a rate gate; sent even when the task's context has ended, as the
// handler's answer stands), logs the pause at Warn unless another one held the key
// back longer already, and returns the task's error, a *LockedError. Under Park the
// task parks until its key is free again (see parksUntil); otherwise its RetryIn is
// the pause, rounded up to whole seconds, and one second more: asynq keeps a retry's
// time in whole seconds, cut short, so that a task sent back for RetryIn may return
// up to a second before it.
func (m *middleware) paused(ctx context.Context, tk *task, pe *PauseError) error {
	d := max(pe.For, time.Second)
	le := &LockedError{Key: tk.key, RetryIn: wholeSeconds(d) + time.Second, taskType: tk.Type(), taskID: tk.meta.id, paused: d, cause: pe}
	held := d // how long the key is held back from now
	if tk.lim != (ratelimit.Rate{}) {
		h, err := m.rates.Pause(context.WithoutCancel(ctx), tk.key, tk.lim, min(d, ratelimit.MaxPer))
		if err != nil {
			le.pauseErr = err
		} else {
			held = h
		}
	} else {
		le.pauseErr = errNoRateGate
	}
	if held <= d {
		attrs := []slog.Attr{
			slog.String("task_type", shortkey.Shorten(tk.Type())),
			slog.String("task_id", shortkey.Shorten(tk.meta.id)),
			slog.String("key", shortkey.Show(tk.key)),
			slog.Duration("for", d),
			slog.Time("until", time.Now().Add(held)),
		}
		if pe.Err != nil {
			attrs = append(attrs, slog.String("error", oneLine(pe.Err)))
		}
		if le.pauseErr != nil {
			attrs = append(attrs, slog.String("not_paused", oneLine(le.pauseErr)))
		}
		m.log().LogAttrs(ctx, slog.LevelWarn, "asynqmutex: a handler asked to pause its key", attrs...)
	}
	if m.parksUntil(ctx, tk) {
		le.parked = true
		le.RetryIn = m.parkUntil(tk, tk.key, time.Now().Add(held))
	}
	m.emit(ctx, Event{Op: OpPaused, TaskType: tk.Type(), TaskID: tk.meta.id, Key: tk.key, Wait: d, Err: le})
	return le
}

var errNoRateGate = errors.New("the middleware has no Rate or RateBy, so the key was not paused")
