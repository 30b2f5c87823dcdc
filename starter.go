package asynqmutex

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynqmutex/asynqmutex/internal/shortkey"
	"github.com/asynqmutex/asynqmutex/mutex"
)

// This file is the asynq side of parking (see Park): a parked task is named in its
// key's line by a ticket made of its queue and ID, and started, when its turn comes,
// by asynq's public Inspector: RunTask moves it from the retry set to its queue.

// ticket names task id of queue in its key's line: both base64url, joined by '.'.
func ticket(queue, id string) string {
	return base64.RawURLEncoding.EncodeToString([]byte(queue)) + "." + base64.RawURLEncoding.EncodeToString([]byte(id))
}

// fromTicket reads what ticket wrote.
func fromTicket(t string) (queue, id string, ok bool) {
	q, i, ok := strings.Cut(t, ".")
	qb, err1 := base64.RawURLEncoding.DecodeString(q)
	ib, err2 := base64.RawURLEncoding.DecodeString(i)
	return string(qb), string(ib), ok && err1 == nil && err2 == nil && len(qb) > 0 && len(ib) > 0
}

// starter starts parked tasks through an Inspector of asynq's Redis, and reports
// what it did to Observe.
type starter struct {
	insp   *asynq.Inspector
	log    func() *slog.Logger
	emit   func(context.Context, Event)
	warned atomic.Bool // a queue was not found: logged once
	failed atomic.Bool // asynq's Redis did not answer: logged once until it does
}

// fallbackMargin is how close to its fallback a parked task is left to it rather than
// started: RunTask moves a task whatever its state but pending or active, a completed
// one too, so a task that its fallback brought back and completed between the start's
// look (GetTaskInfo) and RunTask would run twice. The window is two calls; the margin
// covers a process stalled that long, on a busy machine.
const fallbackMargin = 2 * time.Second

// activeFor bounds how long a starter waits for a task that has just parked to be
// back in asynq's retry set (its handler is returning): asynq moves it there as
// soon as the middleware returns.
const activeFor = 2 * time.Second

// parkedTask is a parked task whose turn has come (or is near), as any line names it:
// its key, its ticket, whether it was started before (see mutex.Parked.Started),
// and how to ask whether it still stands in its line (nil: it does).
type parkedTask struct {
	key, ticket string
	started     bool
	inLine      func(context.Context) (bool, error)
}

// startLocked starts a task parked in a lock's line (a mutex.Starter), or drops one
// that left it to make room for a newcomer (MaxBacklog with OverflowReplace).
func (s *starter) startLocked(ctx context.Context, p mutex.Parked) (gone bool) {
	if p.Replaced {
		s.supersede(ctx, p)
		return false
	}
	return s.start(ctx, parkedTask{key: p.Key, ticket: p.Ticket, started: p.Started, inLine: p.InLine}) != ""
}

// start starts the task parked under p's ticket, and reports why, when it will not
// come: "missing" when it is not in its queue (deleted, or done and not kept),
// "archived" or "completed"; "" otherwise. A task in the retry set (or scheduled) is moved to its queue; one that
// is pending is on its way already; one that is active is on its way when it was
// started before (p.Started), and is returning from its park otherwise, so start
// waits, a while, for it to be in the retry set. A Redis error leaves the task to its
// fallback (for a lock's line: the lock handed to it frees when its claim ends).
//
// Between reading a task's state and RunTask an operator may act on it; RunTask
// moves any task that is not pending or active (archived and completed ones too), so
// a task archived in that instant is run once more. asynq's public API offers
// nothing tighter. asynq itself may act too: a task whose fallback is due within
// fallbackMargin is left to it.
func (s *starter) start(ctx context.Context, p parkedTask) (gone string) {
	queue, id, ok := fromTicket(p.ticket)
	if !ok {
		return "missing" // not a ticket of ours: nobody to start
	}
	passedOver := func(typ, reason string, why error) string {
		// Unless it arrived and ran meanwhile: then there is nothing to pass over.
		// When Redis cannot say, it is passed over, so that the line does not wait on
		// a task asynq no longer has.
		if p.inLine != nil {
			if in, err := p.inLine(ctx); err == nil && !in {
				return ""
			}
		}
		s.emit(ctx, Event{Op: OpParkPassedOver, TaskType: typ, TaskID: id, Key: p.key, Err: why})
		return reason
	}
	pause := 5 * time.Millisecond
	sawActive := false // it ran meanwhile: whatever it is now, it is not waiting to be started
	for deadline := time.Now().Add(activeFor); ; {
		info, err := s.insp.GetTaskInfo(queue, id)
		switch {
		case sawActive && (errors.Is(err, asynq.ErrTaskNotFound) || err == nil && info.State != asynq.TaskStateActive && info.State != asynq.TaskStateRetry):
			return "" // done, or failed on its own: not ours to report
		case errors.Is(err, asynq.ErrTaskNotFound):
			return passedOver("", "missing", err)
		case errors.Is(err, asynq.ErrQueueNotFound):
			s.queueNotFound(ctx, queue, id)
			return passedOver("", "missing", err)
		case err != nil:
			s.unanswered(ctx, queue, id, err)
			return ""
		}
		s.failed.Store(false)
		switch info.State {
		case asynq.TaskStateRetry, asynq.TaskStateScheduled:
			if time.Until(info.NextProcessAt) < fallbackMargin {
				// Its fallback is due, or nearly: asynq may move it to its queue, run it
				// and complete it between this look and RunTask, which would then run it
				// again. It comes by that fallback instead, to the key handed to it.
				return ""
			}
			if err := s.insp.RunTask(queue, id); err == nil {
				s.emit(ctx, Event{Op: OpParkStarted, TaskType: info.Type, TaskID: id, Key: p.key})
				return ""
			}
			// It moved meanwhile: look again.
		case asynq.TaskStatePending:
			return ""
		case asynq.TaskStateActive:
			if p.started {
				return ""
			}
			sawActive = true
		default: // archived, completed, aggregating: not ours to run
			return passedOver(info.Type, info.State.String(), fmt.Errorf("asynq: task is %v", info.State))
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return ""
		}
		select {
		case <-ctx.Done():
			return ""
		case <-time.After(pause):
		}
		pause = min(2*pause, 200*time.Millisecond)
	}
}

// unanswered logs, once until asynq's Redis answers again, that a parked task could
// not be started (no answer, or a refusal such as an ACL's): it comes by its
// fallback.
func (s *starter) unanswered(ctx context.Context, queue, id string, err error) {
	if s.failed.Swap(true) {
		return
	}
	s.log().LogAttrs(ctx, slog.LevelWarn, "asynqmutex: could not start a parked task whose turn came: the Inspector's Redis did not answer, or refused (see the option Inspector); it comes back by its fallback (the lock's TTL)",
		slog.String("queue", shortkey.Shorten(queue)),
		slog.String("task_id", shortkey.Shorten(id)),
		slog.String("error", err.Error()))
}

// queueNotFound logs, once, that the Inspector does not know a parked task's queue:
// it reads another Redis than asynq's.
func (s *starter) queueNotFound(ctx context.Context, queue, id string) {
	if s.warned.Swap(true) {
		return
	}
	s.log().LogAttrs(ctx, slog.LevelError, "asynqmutex: a parked task's queue is not in the Redis the Inspector reads, so parked tasks come back only after their fallback (the lock's TTL); give Middleware the Inspector of asynq's Redis (option Inspector)",
		slog.String("queue", shortkey.Shorten(queue)),
		slog.String("task_id", shortkey.Shorten(id)))
}
