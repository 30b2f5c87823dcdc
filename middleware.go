package asynqmutex

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynqmutex/asynqmutex/internal/conflicts"
	"github.com/asynqmutex/asynqmutex/internal/shortkey"
	"github.com/asynqmutex/asynqmutex/internal/store"
	"github.com/asynqmutex/asynqmutex/mutex"
	"github.com/asynqmutex/asynqmutex/order"
	"github.com/asynqmutex/asynqmutex/ratelimit"
)

// Middleware returns asynq middleware that runs each task's handler under a Redis lock
// on the task's key (see On, OnEach, KeyBy, KeysBy and Scope), so tasks with equal
// keys never run at the same time (or no more than n at a time, with Limit) on any
// worker that shares the lock Redis, while tasks with other keys run in parallel. Use
// it on the handlers it is for, Middleware(...)(handler), or with mux.Use(...) and
// For naming their task types. It applies to every task it wraps unless For says
// otherwise: under mux.Use without For that is every task type on the mux, and a
// type whose payload lacks On's fields is archived without running.
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
// mutex.Client.Inspect and the asynqmutex command show. The lock's events go to the
// Client's observers (mutex.Observe); the middleware's own, a conflict with the
// policy applied and a task archived for its input, to Observe's.
//
// Middleware panics if locks is nil or the options conflict. The returned middleware
// is safe for concurrent use.
func Middleware(locks *mutex.Client, opts ...Option) asynq.MiddlewareFunc {
	if locks == nil {
		panic("asynqmutex.Middleware: nil *mutex.Client")
	}
	m := &middleware{
		locks:  locks,
		config: config{ttl: DefaultTTL, policy: Park, meta: asynqMeta, limit: 1, orderGrace: DefaultOrderGrace},
	}
	for _, o := range opts {
		o.apply(&m.config)
	}
	m.keyFuncs()
	m.checkRate()
	m.checkOrder(true)
	m.checkBacklog()
	if m.capped() && (m.policy == Skip || m.policy == Fail) {
		panic(fmt.Sprintf("asynqmutex.Middleware: MaxReschedules and MaxRescheduleTime apply to RetryLater and Park, not to %v", m.policy))
	}
	m.conflicts = conflicts.New(store.New(locks.Redis()), locks.Prefix())
	m.limitOpt = mutex.Limit(m.limit)
	m.lineCap = m.backlogCap()
	insp := m.inspector
	if insp == nil {
		insp = asynq.NewInspectorFromRedisClient(locks.Redis())
	}
	m.starter = &starter{insp: insp, log: m.log, emit: m.emit}
	m.startWith = mutex.StartWith(m.starter.startLocked)
	m.due = newDueLoop(m.starter.start)
	if m.rateBy != "" {
		m.rates = ratelimit.New(locks.Redis(), ratelimit.Prefix(locks.Prefix()))
	}
	if m.ordered {
		m.seq = sequencer(locks, order.StartWith(m.startOrdered))
	}
	m.path = m.gates()
	return func(next asynq.Handler) asynq.Handler {
		if next == nil {
			panic("asynqmutex.Middleware: nil handler")
		}
		if m.types != nil {
			return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
				if !m.types[t.Type()] {
					return next.ProcessTask(ctx, t)
				}
				return m.process(ctx, t, next)
			})
		}
		return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
			return m.process(ctx, t, next)
		})
	}
}

type middleware struct {
	locks *mutex.Client
	config
	conflicts *conflicts.Counter // on the locks' Redis and prefix
	limitOpt  mutex.LockOption   // mutex.Limit(limit)
	lineCap   mutex.LockOption   // MaxBacklog's mutex.MaxLine; nil for none
	starter   *starter           // starts parked tasks (Park)
	startWith mutex.LockOption   // mutex.StartWith(starter.startLocked): every lock passes it
	due       *dueLoop           // starts tasks parked until a time (a rate start, a pause's end)
	lag       atomic.Int64       // ns: how late tasks started by due arrive (sawLag, lead)
	rates     *ratelimit.Limiter // with Rate or RateBy: on the locks' Redis and prefix
	seq       *order.Sequencer   // with InOrder: on the locks' Redis and prefix
	stalls    stallWatch         // with InOrder: keys stalled behind a pending task
	path      []gate             // gates(): what every task passes before its handler
}

// gates is the path every task takes, its gates in their true order: its key is
// derived; it waits for its turn in its key's order (InOrder); it takes its key's
// lock, or one of its Limit(n) slots (unless NoLock); it takes its start under its
// key's rate (Rate, RateBy). Past the last gate its handler runs. (One step crosses
// over: under Park a task that meets its lock busy asks the rate gate whether its
// start comes later, and then parks until it rather than in the lock's line; see
// startLater.) A gate passes the
// task on, refuses it with a *refusal (its key is busy: busy.go decides what that
// costs the task), or fails it; outcome makes the task's result of what happened.
func (m *middleware) gates() []gate {
	path := []gate{m.keyGate}
	if m.ordered {
		path = append(path, m.orderGate)
	}
	if !m.noLock {
		path = append(path, m.lockGate)
	}
	if m.rates != nil {
		path = append(path, m.rateGate)
	}
	return path
}

// gate is one gate of the path: it passes task tk on by calling next (with the
// context the rest of the path is to run in) and returns what next returned, or
// returns without calling it: a *refusal when the task's key is busy, or an error
// that fails the task, its text naming the task and the key.
type gate func(ctx context.Context, tk *task, next func(context.Context) error) error

// task is one task on its path: what asynq says of it, and what each gate learns
// that a later gate, the handler or the outcome needs.
type task struct {
	*asynq.Task
	meta  taskMeta
	start time.Time // when it set out: its waits count from here

	key  string   // its key; with keys, the first of them
	keys []string // its keys, when it has several (OnEach, KeysBy); nil for one

	budgeted bool              // lastTry, pastCap and wait are set (see budget)
	lastTry  bool              // a conflict would archive it: RetryLater with no retry left
	pastCap  *conflicts.Record // past a reschedule cap with no retry left: a conflict fails
	wait     time.Duration     // how long, from start, it may wait for its key in all

	place   *placed        // its place in its key's order, once its turn came (InOrder)
	lim     ratelimit.Rate // its rate limit; zero for none
	limSet  bool           // lim is known (rateOf)
	lagSeen bool           // a take of its start ran (takeAs): a later one's lateness is no dispatch lag

	ran       bool  // its handler ran
	result    error // what its handler returned
	leaseLost error // the lock was lost while its handler ran (mutex.ErrNotHeld)
}

// refusal is the one value a gate refuses a task with: its key is busy (held, at its
// rate limit or paused, or not yet the task's turn). It says what was busy; busy.go
// decides what that costs the task.
type refusal struct {
	op     Op           // OpConflict, OpLimited or OpOutOfTurn
	le     *LockedError // what was busy, in the error the task may return
	parked bool         // the task parked in its key's line (Park)
	full   bool         // its key's line was full (MaxBacklog): it neither waited nor parked
	due    time.Time    // with parked: when this process starts it (a rate start, a pause's end); zero in a lock's line
}

func (r *refusal) Error() string { return r.le.Error() }

// process takes task t down the path to its handler h, and returns its result.
func (m *middleware) process(ctx context.Context, t *asynq.Task, h asynq.Handler) error {
	tk := &task{Task: t, meta: m.meta(ctx), start: time.Now()}
	return m.outcome(ctx, tk, m.pass(ctx, tk, 0, h))
}

// pass hands tk to gate i of the path, and past the last one to its handler h.
func (m *middleware) pass(ctx context.Context, tk *task, i int, h asynq.Handler) error {
	if i == len(m.path) {
		m.handle(ctx, tk, h)
		return nil
	}
	return m.path[i](ctx, tk, func(ctx context.Context) error { return m.pass(ctx, tk, i+1, h) })
}

// showKeys is key, or keys when there are several, each shown shortened.
func showKeys(key string, keys []string) string {
	if keys == nil {
		return shortkey.Show(key)
	}
	shown := make([]string, len(keys))
	for i, k := range keys {
		shown[i] = shortkey.Show(k)
	}
	return strings.Join(shown, " and ")
}

// unlessNamed is " " and the keys shown, for an error about them that wraps err,
// from package mutex, unless err already names one of them, as mutex's errors
// mostly do: an error names its key once.
func unlessNamed(err error, key string, keys []string) string {
	text := " " + err.Error() + " "
	all := keys
	if all == nil {
		all = []string{key}
	}
	for _, k := range all {
		shown := shortkey.Show(k)
		if strings.Contains(text, " "+shown+" ") || strings.Contains(text, " "+shown+":") {
			return ""
		}
	}
	return " " + showKeys(key, keys)
}

// oneLine is err's text on one line: errors.Join puts each error on a line of its
// own, which a log line or asynq's LastErr would carry as it is.
func oneLine(err error) string {
	return strings.ReplaceAll(err.Error(), "\n", "; ")
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

func (m *middleware) log() *slog.Logger {
	if m.logger != nil {
		return m.logger
	}
	return slog.Default()
}

func (m *middleware) failed(ctx context.Context, t *asynq.Task, err error) {
	if m.hook != nil {
		m.hook(ctx, t, err)
	}
}

// taskMeta is what asynq tells a handler about its task.
type taskMeta struct {
	id, queue         string // "" when not run by an asynq server
	retried, maxRetry int
	counted           bool // retried and maxRetry are known
}

func asynqMeta(ctx context.Context) taskMeta {
	id, _ := asynq.GetTaskID(ctx)
	queue, _ := asynq.GetQueueName(ctx)
	retried, ok1 := asynq.GetRetryCount(ctx)
	maxRetry, ok2 := asynq.GetMaxRetry(ctx)
	return taskMeta{id: id, queue: queue, retried: retried, maxRetry: maxRetry, counted: ok1 && ok2}
}

// noRetryLeft reports whether asynq would archive the task for any error it returns
// now: asynq compares the retry count with MaxRetry before it asks IsFailure.
func (t taskMeta) noRetryLeft() bool { return t.counted && t.retried >= t.maxRetry }

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
