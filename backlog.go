package asynqmutex

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynqmutex/asynqmutex/mutex"
)

// Overflow says what MaxBacklog does with a task that meets its key busy and its
// line full.
type Overflow uint8

const (
	// OverflowSkip completes the newcomer without running it, as Skip does: the
	// handler returns nil. OpConflict reports it with Policy "backlog_skip".
	OverflowSkip Overflow = iota + 1
	// OverflowFail fails the newcomer, as Fail does: an ordinary error wrapping
	// mutex.ErrNotObtained and mutex.ErrLineFull, so asynq spends one of its retries
	// and retries it with its own backoff, archiving it when they are used up.
	// OpConflict reports it with Policy "backlog_fail".
	OverflowFail
	// OverflowReplace parks the newcomer at the back of the line and takes the oldest
	// parked task (one not started ahead of its turn, nor waiting in a worker) out of
	// it: the middleware deletes that task from asynq if asynq holds it in the retry
	// or scheduled set, and reports OpSuperseded. A replaced task that is in no such
	// set (run by hand, or come back by its fallback meanwhile) is not deleted: it
	// runs, or joins the line again as a newcomer. A line full of tasks that cannot
	// be replaced (waiting in their worker, or on their way) sends the newcomer back
	// as RetryLater(DefaultRetryDelay) does, spending no retry: OpConflict with
	// Policy "retry".
	OverflowReplace
)

// String returns "OverflowSkip", "OverflowFail" or "OverflowReplace".
func (o Overflow) String() string {
	switch o {
	case OverflowSkip:
		return "OverflowSkip"
	case OverflowFail:
		return "OverflowFail"
	case OverflowReplace:
		return "OverflowReplace"
	}
	return fmt.Sprintf("Overflow(%d)", uint8(o))
}

// MaxBacklog caps a busy key's line under Park: when a task meets its key busy and
// n tasks or more of the key already wait in its line (parked in Redis, or waiting in
// their worker as its first), the task neither waits nor parks, and full says what
// becomes of it (OverflowSkip, OverflowFail) or of the line's oldest parked task
// (OverflowReplace). The line is counted and the task refused, or the oldest
// replaced, in the script call that would have parked the task: no Redis call
// beyond the park's (mutex.MaxLine). A task back to its own place in the line (started
// when its turn came, or back by its fallback while its entry stands) is never
// refused, and a task that must not park (on its last try, past a reschedule cap,
// or near its deadline: it waits in its worker) is not capped, though it counts in
// the line.
//
// AfterFailure hears of a refused task as of any conflict, with a *LockedError that
// says the line was full. The default is no cap. MaxBacklog panics if n is below 1
// or full is none of the Overflow values; Middleware panics if it is given with
// another OnConflict policy than Park, with InOrder (whose line is the key's order,
// not its lock's), with OnEach or KeysBy (a task with several keys), or with NoLock.
func MaxBacklog(n int, full Overflow) Option {
	if n < 1 {
		panic(fmt.Sprintf("asynqmutex.MaxBacklog: n %d below 1", n))
	}
	if full < OverflowSkip || full > OverflowReplace {
		panic(fmt.Sprintf("asynqmutex.MaxBacklog: invalid overflow %d", full))
	}
	return once("MaxBacklog", fmt.Sprintf("MaxBacklog(%d, %v)", n, full), func(c *config) { c.backlog, c.overflow = n, full })
}

// checkBacklog panics on a MaxBacklog that cannot apply.
func (c *config) checkBacklog() {
	switch {
	case c.backlog == 0:
	case c.policy != Park:
		panic(fmt.Sprintf("asynqmutex.Middleware: MaxBacklog caps the line of Park, not of %v", c.policy))
	case c.ordered:
		panic("asynqmutex.Middleware: MaxBacklog caps a lock's line; under InOrder a task waits in its key's order")
	case c.keySetBy == "OnEach" || c.keySetBy == "KeysBy":
		panic("asynqmutex.Middleware: MaxBacklog caps the line of one key; " + c.keySetBy + " gives a task several keys")
	case c.noLock:
		panic("asynqmutex.Middleware: MaxBacklog caps a lock's line; NoLock takes no lock")
	}
}

// backlogCap is the mutex.MaxLine option of MaxBacklog, nil without it.
func (c *config) backlogCap() mutex.LockOption {
	if c.backlog == 0 {
		return nil
	}
	return mutex.MaxLine(c.backlog, c.overflow == OverflowReplace)
}

// overflowed decides what task tk pays for finding its key's line full (refusal r),
// under MaxBacklog: done is false when the task is sent back as any conflict is
// (OverflowReplace, with nothing to replace).
func (m *middleware) overflowed(r *refusal, report func(string)) (result error, done bool) {
	r.le.full = m.backlog
	switch m.overflow {
	case OverflowSkip:
		report("backlog_skip")
		return nil, true
	case OverflowFail:
		report("backlog_fail")
		return fmt.Errorf("%s: %w; %w", r.le.Error(), mutex.ErrNotObtained, mutex.ErrLineFull), true
	}
	return nil, false
}

// supersede drops the task of a ticket that left its line to make room for a
// newcomer (MaxBacklog with OverflowReplace): asynq deletes it if it is in the retry
// or scheduled set. One that is active is returning from its park, and is waited
// for, a while, to be in the retry set. Any other (pending: run by hand or back by
// its fallback; archived; completed; gone) is left alone, and so is the task when
// asynq's Redis does not answer: it comes back by its fallback and joins the line
// again.
func (s *starter) supersede(ctx context.Context, p mutex.Parked) {
	queue, id, ok := fromTicket(p.Ticket)
	if !ok {
		return
	}
	pause := 5 * time.Millisecond
	for deadline := time.Now().Add(activeFor); ; {
		info, err := s.insp.GetTaskInfo(queue, id)
		switch {
		case errors.Is(err, asynq.ErrTaskNotFound) || errors.Is(err, asynq.ErrQueueNotFound):
			return
		case err != nil:
			s.unanswered(ctx, queue, id, err)
			return
		}
		s.failed.Store(false)
		switch info.State {
		case asynq.TaskStateRetry, asynq.TaskStateScheduled:
			if err := s.insp.DeleteTask(queue, id); err == nil {
				s.emit(ctx, Event{Op: OpSuperseded, TaskType: info.Type, TaskID: id, Key: p.Key})
				return
			}
			// It moved meanwhile: look again.
		case asynq.TaskStateActive:
		default:
			return
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(pause):
		}
		pause = min(2*pause, 200*time.Millisecond)
	}
}
