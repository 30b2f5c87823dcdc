package asynqmutex

import (
	"context"
	"strconv"
	"time"

	"github.com/asynqmutex/asynqmutex/internal/shortkey"
)

// Op says what the middleware did with a task in an Event.
type Op uint8

// The operations an Event reports. What happens to the locks themselves (acquired,
// contended, released, lost) is reported by package mutex (mutex.Observe).
const (
	// OpConflict: the middleware did not run a task because its key was busy. Policy
	// says what became of the task: "park" (it waits in its key's line, under Park),
	// "skip", "fail", "retry" (sent back for a while, under RetryLater or what Park
	// does not park), "archive" (no retry was left, or past a reschedule cap with
	// none left), or, its line full under MaxBacklog, "backlog_skip" or
	// "backlog_fail". Err is the *LockedError; Wait how long the task tried.
	OpConflict Op = iota + 1
	// OpBadInput: the middleware archived a task because no key could be derived
	// from it; Err says why.
	OpBadInput
	// OpLimited: the middleware did not run a task because its key was at its rate
	// limit (Rate, RateBy) or paused, for longer than the task could wait. Policy
	// and Wait as for OpConflict; Err is the *LockedError.
	OpLimited
	// OpRateWaited: a task waited Wait for its start under its rate limit, and then
	// ran. The one Event of a task that ran.
	OpRateWaited
	// OpPaused: a handler returned PauseKey's error: its key was paused for Wait on
	// every worker (Err, the task's *LockedError, says if it could not be), and the
	// task sent back.
	OpPaused
	// OpOutOfTurn: under InOrder, the middleware did not run a task because an
	// earlier task of its key had not finished within the task's wait. Policy and
	// Wait as for OpConflict; Err is the *LockedError, which names the place the key
	// waits for and its task.
	OpOutOfTurn
	// OpOrderSkipped: under InOrder, a key moved past a place whose task will not
	// finish (see InOrder); Err is a *GapError that names the place, its task and why.
	// TaskID is the task that moved the key: the one whose last try failed, or the
	// one that found the gap.
	OpOrderSkipped
	// OpOutOfOrder: under InOrder, a task ran under its lock alone, outside its key's
	// order: it carried no place, or its key had moved past it. Err says which.
	OpOutOfOrder
	// OpOrderStalled: under InOrder, a task was sent back behind a place whose task
	// asynq holds pending though the place is older than OrderGrace: in a queue no
	// server reads, say. Err is a *StallError; the task's own OpOutOfTurn follows.
	OpOrderStalled
	// OpParkStarted: a parked task's turn came, or was near, or the start it reserved
	// under its rate limit or its key's pause's end came (see Park), and the
	// middleware had asynq move it from the retry set to its queue. Key is its key.
	OpParkStarted
	// OpParkPassedOver: a parked task's turn came, or was near, and it no longer
	// waited (deleted, archived, done): its key passed on to the next in its line.
	// Err says what asynq said of it; TaskType is empty when asynq no longer knew it.
	OpParkPassedOver
	// OpOrderHalted: under InOrder and HaltOnFailure, a task failed for good and its
	// key halted at its place; Err is a *HaltError that names the place and wraps
	// what the task returned.
	OpOrderHalted
	// OpSuperseded: under MaxBacklog with OverflowReplace, a parked task left its
	// key's line to make room for a newcomer, and the middleware deleted it from
	// asynq (from the retry or scheduled set). Key is its key. A replaced task asynq
	// held in no such set is not deleted, and not reported.
	OpSuperseded
)

var opNames = [...]string{OpConflict: "conflict", OpBadInput: "bad_input", OpLimited: "limited", OpRateWaited: "rate_waited", OpPaused: "paused",
	OpOutOfTurn: "out_of_turn", OpOrderSkipped: "order_skipped", OpOutOfOrder: "out_of_order", OpOrderStalled: "order_stalled",
	OpParkStarted: "park_started", OpParkPassedOver: "park_passed_over", OpOrderHalted: "order_halted",
	OpSuperseded: "superseded"}

// String returns the operation's name in snake case, such as "bad_input", for logs
// and metric labels.
func (o Op) String() string {
	if int(o) < len(opNames) && opNames[o] != "" {
		return opNames[o]
	}
	return "op(" + strconv.Itoa(int(o)) + ")"
}

// Event is something the middleware did with a task instead of running its handler
// (or, for OpRateWaited and OpPaused, before and after it), reported to the function
// given to Observe. Fields that do not apply to Op are zero.
type Event struct {
	Op Op
	// TaskType and TaskID name the task; TaskID is empty outside an asynq server.
	// Both are cleaned as mutex.HeldBy cleans them (shortened past 100 bytes, valid
	// UTF-8, no tabs), so that they match the Name and ID of the task's lock events.
	TaskType, TaskID string
	// Key is the task's lock key, and Keys all of them when it has several (see
	// OnEach); empty for OpBadInput. Keys can be long and unbounded in number: never
	// use them as a metric label.
	Key    string
	Keys   []string
	Policy string        // OpConflict, OpLimited, OpOutOfTurn
	Wait   time.Duration // OpConflict, OpLimited, OpOutOfTurn, OpRateWaited; OpPaused: the pause
	Err    error
}

// Observe makes the middleware call fn for every Event: each task it did not run
// because its key was busy or at its rate limit, or because no key could be derived,
// each wait for a start under a rate limit, and each pause a handler asked for. fn runs
// synchronously on the worker goroutine, before the middleware returns, so it must
// be quick and safe for concurrent use. Given more than once, every fn is called, in
// order. By default nothing is called. Observe panics if fn is nil.
//
// The lock events of the same tasks (acquired, contended, released, lease lost) come
// from the mutex.Client, through mutex.Observe; the metrics package takes both.
func Observe(fn func(ctx context.Context, e Event)) Option {
	if fn == nil {
		panic("asynqmutex.Observe: nil function")
	}
	return optionFunc(func(c *config) {
		if prev := c.observe; prev != nil {
			c.observe = func(ctx context.Context, e Event) { prev(ctx, e); fn(ctx, e) }
			return
		}
		c.observe = fn
	})
}

// emit passes e to the observers, if any.
func (c *config) emit(ctx context.Context, e Event) {
	if c.observe != nil {
		e.TaskType, e.TaskID = shortkey.Field(e.TaskType), shortkey.Field(e.TaskID)
		c.observe(ctx, e)
	}
}
