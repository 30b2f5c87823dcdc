package asynqmutex

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynqmutex/asynqmutex/internal/shortkey"
	"github.com/asynqmutex/asynqmutex/mutex"
	"github.com/asynqmutex/asynqmutex/order"
)

// PlaceHeader is the task header in which Producer.Enqueue carries a task's place in
// its key's order (order.FormatPlace's text), and from which InOrder reads it.
const PlaceHeader = "asynqmutex-place"

// DefaultOrderGrace is how long, unless OrderGrace says otherwise, a place whose
// task asynq does not know is waited for before its key moves past it: long enough
// for a producer between taking the place and enqueuing the task, which takes
// milliseconds.
const DefaultOrderGrace = 10 * time.Second

// maxOrderSteps bounds the places one task moves its key past before it runs or
// gives up: each is a gap whose task is gone.
const maxOrderSteps = 64

// TaskLookup is what InOrder asks about the task that holds the place a key waits
// for, to tell a task still to come from one that is gone: *asynq.Inspector is one,
// on the asynq Redis. GetTaskInfo must return an error wrapping asynq.ErrTaskNotFound
// or asynq.ErrQueueNotFound for a task asynq does not hold, and be safe for
// concurrent use.
type TaskLookup interface {
	GetTaskInfo(queue, id string) (*asynq.TaskInfo, error)
}

// InOrder makes the tasks of a key run one at a time in the order their producer
// enqueued them with Producer.Enqueue, on every worker that shares the lock Redis: a
// task runs only when every task enqueued before it under its key has finished
// (completed, or been moved past by a gap rule), and holds the key's lock while it
// runs. Tasks of other keys run in parallel. Give producer and middleware the same
// options (On, KeyBy, Scope, For, InOrder), so that both derive the same keys.
//
// A task whose turn has not come waits up to MaxWait while the task ahead of it
// runs, woken when that task finishes (a pub/sub message, not polling); then, or at
// once when the task ahead is queued or waits for a retry, the OnConflict policy
// applies as for a busy key. Under Park, the default, it parks at once: it leaves its
// worker, its place is marked in Redis, and the finish of the place before it starts
// it (asynq's Inspector.RunTask). That finish also starts the parked task after it,
// ahead of its turn: it waits up to LeadWait in its worker for the task ahead, so a
// backlog passes from task to task without waiting for asynq to dispatch each. A
// parked task that is gone when its turn comes (deleted, archived) is moved past at
// once. RetryLater sends it back without
// spending a retry (with Configure), for RetryLater's delay without backoff or
// jitter, or until a second after the task ahead is due; under it, ordered keys drain
// quickly only with a MaxWait that covers a handler's run. A task with no retry left waits for any task ahead, up to
// LastTryWait, and is archived if its turn has not come: give ordered tasks retries.
//
// A task that fails and will be retried keeps its place: the key waits for it, and
// the tasks waiting for it are told (in its lock release's round trip) and go back
// to the queue, as behind a queued task, instead of holding worker slots that its
// retry may need. A task
// that will not run again (its handler succeeded, it was skipped, or its last try
// failed and asynq archives it) finishes its place, and the next task is woken. A key
// never waits for a task that is gone: when a task's predecessor is not running,
// the middleware asks tasks (asynq's Inspector) about it, and moves past it if asynq
// holds it archived or completed, or does not hold it and its place was taken more
// than OrderGrace ago (a producer that crashed before enqueuing it, a task an
// operator deleted). Each move is reported to Observe as OpOrderSkipped. A task asynq
// holds pending is never moved past, however long it waits (in a queue no server
// reads, say): once its place is older than OrderGrace, each task sent back behind it
// is reported as OpOrderStalled, and a Warn line says so once per place.
//
// A task without a place (enqueued without Producer.Enqueue), or whose place its key
// moved past already (run again from the archive, say), runs under the lock alone,
// reported as OpOutOfOrder. docs/order.md states the guarantee and its limits.
//
// Each ordered task costs one round trip beside its lock's, to ask whether its turn
// has come; its place is finished in the pipeline of its lock's release. The
// sequences live beside the locks: on the Middleware's mutex.Client's Redis, under
// its prefix (package order, built from the Client as Rate's limiter is), where
// NewProducer takes places too. The default is no order.
//
// tasks may be nil in options only NewProducer gets, since a producer asks asynq
// nothing. Middleware panics if tasks is nil, or if InOrder is given with OnEach or
// KeysBy, Limit(n > 1), NoLock, or OnConflict(Skip), which would complete every task
// whose turn has not come without running it. Under Fail such a task spends a retry.
func InOrder(tasks TaskLookup) Option {
	return once("InOrder", "InOrder(tasks)", func(c *config) { c.ordered, c.tasks = true, tasks })
}

// OrderGrace sets how long InOrder waits for a place whose task asynq does not hold
// before its key moves past it, counted from when the place was taken on the Redis
// server's clock. It bounds how long a producer that crashed between taking a place
// and enqueuing its task stalls the key; a producer slower than d has its task run out
// of order. The default is DefaultOrderGrace (10 s). OrderGrace panics if d is not
// positive; Middleware panics if it is given without InOrder.
func OrderGrace(d time.Duration) Option {
	if d <= 0 {
		panic(fmt.Sprintf("asynqmutex.OrderGrace: grace %v is not positive", d))
	}
	return once("OrderGrace", fmt.Sprintf("OrderGrace(%v)", d), func(c *config) { c.orderGrace, c.graceSet = d, true })
}

// HaltOnFailure makes a key under InOrder halt at a task that fails for good (its
// last try failed and asynq archives it, or its handler returned asynq.SkipRetry, or
// its turn came while its lock was busy on its last try), and at any task asynq holds
// archived when the key's turn comes to it (its worker died on its last try, its
// deadline passed, a person archived it): the tasks after it wait, parked, however
// long, until a person acts (a task on its last try waits up to LastTryWait, then is
// archived, and halts the key in turn when its place comes). A task whose handler
// returned asynq.RevokeTask is deleted by asynq, not archived: the key moves past it. Run the task again
// from asynq's archive (asynqmon, Inspector.RunTask): its place is still the key's
// next, and when it completes the key moves on. Or move the key past it:
// asynqmutex order --skip N KEY. By default a key moves past such a task (reported
// as OpOrderSkipped, reason "failed"), which suits updates that later ones make
// whole again; halt where each task builds on the one before (a ledger, a
// migration). A halt is reported as OpOrderHalted, logged at Warn, shown by
// asynqmutex order and listed by order --blocked; the gap rules that move a key past
// a task that is gone (archived, deleted) do not move past a halted place. Middleware
// panics if it is given without InOrder.
func HaltOnFailure() Option {
	return once("HaltOnFailure", "HaltOnFailure()", func(c *config) { c.halt = true })
}

// checkOrder panics on an order configuration that cannot work; worker is false for
// NewProducer's options.
func (c *config) checkOrder(worker bool) {
	switch {
	case worker && c.ordered && c.tasks == nil:
		panic("asynqmutex.Middleware: InOrder without a TaskLookup (an *asynq.Inspector): a worker asks asynq whether a task its key waits for is gone")
	case c.graceSet && !c.ordered:
		panic("asynqmutex.Middleware: OrderGrace without InOrder")
	case c.halt && !c.ordered:
		panic("asynqmutex.Middleware: HaltOnFailure without InOrder")
	case !c.ordered:
	case c.keySetBy == "OnEach" || c.keySetBy == "KeysBy":
		panic("asynqmutex.Middleware: InOrder orders the tasks of one key; " + c.keySetBy + " gives a task several keys")
	case c.limit > 1:
		panic("asynqmutex.Middleware: InOrder runs the tasks of a key one at a time; Limit lets several run")
	case c.noLock:
		panic("asynqmutex.Middleware: InOrder holds the key's lock while a task runs; NoLock takes none")
	case c.policy == Skip:
		panic("asynqmutex.Middleware: InOrder with OnConflict(Skip) would complete, unrun, every task whose turn has not come")
	}
}

// GapError is the Err of an OpOrderSkipped event: a place its key moved past without
// its task finishing, and why. TaskID and Queue are empty for an abandoned place
// that the finish of an earlier one moved past along with it: only its producer
// knew its task.
type GapError struct {
	Key           string // the key, whole (see LockedError.Key)
	Place         int64
	TaskID, Queue string // the task that held the place, as its producer recorded it
	// Reason is "failed" (its last try failed, or its handler asked for no retry),
	// "archived" or "completed" (asynq holds it so), "missing" (asynq does not hold
	// it, and its place is older than OrderGrace) or "abandoned" (its producer could
	// not enqueue it).
	Reason string
}

// Error names the key, the place, the task and the reason, on one line.
func (e *GapError) Error() string {
	if e.TaskID == "" {
		return fmt.Sprintf("asynqmutex: key %s moved past place %d: %s", shortkey.Show(e.Key), e.Place, e.Reason)
	}
	return fmt.Sprintf("asynqmutex: key %s moved past place %d (task %s in queue %s): %s",
		shortkey.Show(e.Key), e.Place, shortkey.Quote(e.TaskID), shortkey.Quote(e.Queue), e.Reason)
}

// turnWait is why an ordered task did not run: its place and the place its key
// waits for.
type turnWait struct {
	place, next int64
	holder      order.Holder
	due         time.Time // when holder is due, if it waits for a retry or its ProcessAt
}

// placeOf reads the task's place from its headers.
func placeOf(t *asynq.Task) (order.Place, bool) {
	v, ok := t.Headers()[PlaceHeader]
	if !ok {
		return order.Place{}, false
	}
	return order.ParsePlace(v)
}

// orderGate waits for the task's turn in its key's order (see InOrder), up to what
// is left of its wait, moving the key past places whose task is gone, and passes
// the task on once its turn has come, its place to be finished by its outcome
// (finishPlace). It refuses the task when its turn has not come, and fails it when
// Redis cannot say. A task without a place, or whose place its key moved past
// already, goes on under the lock alone, reported as OpOutOfOrder.
func (m *middleware) orderGate(ctx context.Context, tk *task, next func(context.Context) error) error {
	p, ok := placeOf(tk.Task)
	if !ok {
		m.emit(ctx, Event{Op: OpOutOfOrder, TaskType: tk.Type(), TaskID: tk.meta.id, Key: tk.key, Err: errNoPlace})
		return next(ctx)
	}
	var due time.Time
	turn, err := m.awaitTurn(ctx, tk, p, &due)
	if err == nil && turn.State == order.TurnWait && m.mayPark(tk) {
		// It parks: the finish of the place before its own starts it. The turn may
		// have come meanwhile: then it goes on.
		if turn, err = m.seq.Park(ctx, tk.key, p, ticket(tk.meta.queue, tk.meta.id)); err == nil && turn.State == order.TurnWait {
			return &refusal{op: OpOutOfTurn, parked: true, le: &LockedError{Key: tk.key, turn: &turnWait{place: p.N, next: turn.Next, holder: turn.Holder, due: due}}}
		}
	}
	switch {
	case err != nil:
		return &wrapError{
			msg: fmt.Sprintf("asynqmutex: task %s%s: waiting for its turn (place %d) in key %s: %s", shortkey.Quote(tk.Type()), idSuffix(tk.meta.id), p.N, shortkey.Show(tk.key), oneLine(err)),
			err: err,
		}
	case turn.State == order.TurnWait:
		return &refusal{op: OpOutOfTurn, le: &LockedError{Key: tk.key, turn: &turnWait{place: p.N, next: turn.Next, holder: turn.Holder, due: due}}}
	case turn.State != order.TurnNow:
		why := errPlacePassed
		if turn.State == order.TurnUnknown {
			why = errPlaceUnknown
		}
		m.emit(ctx, Event{Op: OpOutOfOrder, TaskType: tk.Type(), TaskID: tk.meta.id, Key: tk.key, Err: why})
		return next(ctx)
	}
	if turn.Ahead && m.policy == Park {
		// The task after it parked and nothing started it ahead (this one's turn came
		// by a retry, not by a finish): started now, it waits for this one in a worker.
		// Only a start sooner is at stake: an error leaves it to this one's finish.
		_ = m.seq.StartAhead(ctx, tk.key, p)
	}
	// A task that will not run again finishes its place in the round trip of its
	// lock's release: the Finish rides in the release's pipeline (see
	// order.Sequencer.FinishLater), sent first, so that the next task is woken as the
	// lock frees.
	lctx, later := m.seq.FinishLater(ctx, tk.key, p)
	tk.place = &placed{Place: p, later: later, ended: ctx.Err}
	return next(lctx)
}

// placed is a task's place in its key's order, once its turn came.
type placed struct {
	order.Place
	later   *order.Later
	ended   func() error // the task's context's Err
	readied bool         // its Finish rides in the lock's release
	reason  string       // why its place was skipped, for OpOrderSkipped; "" if it was not
	halted  bool         // its task failed for good and its key halts (HaltOnFailure)
}

// handled readies the finish of task tk's place, whose handler just returned, while
// the task still holds its lock: when the task will not run again, its place is to
// be finished in the release's round trip; when it will, the tasks waiting for it
// are sent back to the queue instead of holding worker slots until its retry. A
// pause its handler asked for decides after the release.
func (m *middleware) handled(tk *task) {
	pl := tk.place
	var how order.How
	if !errors.As(tk.result, new(*PauseError)) {
		how, pl.reason = placeOutcome(tk.result, tk.meta, pl.ended() != nil, m.halt)
	}
	pl.halted = how == order.Halted
	switch {
	case how != 0:
		pl.readied = pl.later.Finish(how) == nil
	case tk.result != nil:
		pl.later.Requeue()
	}
}

// finishPlace finishes the place of task tk, whose result is err, when it will not
// run again; a place Redis did not finish is moved past as a gap (its task is gone).
// The task's result stands whatever Redis says.
func (m *middleware) finishPlace(ctx context.Context, tk *task, err error) {
	pl := tk.place
	fctx := context.WithoutCancel(ctx)
	var (
		next int64 // the key's next place after the finish; 0 if it moved nothing
		ferr error
	)
	how, r := placeOutcome(err, tk.meta, ctx.Err() != nil, m.halt)
	switch {
	case pl.readied:
		next, ferr = pl.later.Result(fctx)
	case how != 0:
		// The handler did not run (its lock was busy), or asked for a pause: the task
		// is over all the same.
		pl.reason, pl.halted = r, how == order.Halted
		next, ferr = m.seq.Finish(fctx, tk.key, pl.Place, how)
	default:
		if _, rerr := pl.later.Result(fctx); rerr != nil { // a Requeue no call carried
			m.placeWarn(fctx, tk, "asynqmutex: could not tell the tasks waiting for a task's turn that it will run again later; they wait for it until their MaxWait", rerr)
		}
		return
	}
	switch {
	case ferr != nil && pl.halted:
		m.placeWarn(fctx, tk, "asynqmutex: could not halt an ordered key at a task that failed for good; the next task may move the key past it", ferr)
		return
	case ferr != nil:
		m.placeWarn(fctx, tk, "asynqmutex: could not finish a task's place in its key's order; the next task waits until the gap rule moves past it", ferr)
		return
	case pl.halted:
		if next > 0 {
			m.haltReport(ctx, tk.Type(), tk.key, pl.N, tk.meta.id, tk.meta.queue, err)
		}
		return
	}
	if pl.reason != "" {
		m.emit(ctx, Event{Op: OpOrderSkipped, TaskType: tk.Type(), TaskID: tk.meta.id, Key: tk.key,
			Err: &GapError{Key: tk.key, Place: pl.N, TaskID: tk.meta.id, Queue: tk.meta.queue, Reason: pl.reason}})
	}
	m.abandonedPast(ctx, tk.Type(), tk.key, pl.N, next)
}

// errArchived is why a key halted at a place whose task asynq holds archived, found
// by a task waiting behind it.
var errArchived = errors.New("asynq holds the task archived")

// haltReport reports that key halted at place, whose task (id, in queue) failed for
// good with err (HaltOnFailure): OpOrderHalted, and a Warn line that says how to go
// on. taskType is the reporting task's.
func (m *middleware) haltReport(ctx context.Context, taskType, key string, place int64, id, queue string, err error) {
	he := &HaltError{Key: key, Place: place, TaskID: id, Queue: queue, Err: err}
	m.emit(ctx, Event{Op: OpOrderHalted, TaskType: taskType, TaskID: id, Key: key, Err: he})
	m.log().LogAttrs(ctx, slog.LevelWarn, "asynqmutex: an ordered key halted at a task that failed for good (HaltOnFailure); the tasks after it wait until the task is run again from asynq's archive and completes, or the key is moved past it: asynqmutex order --skip PLACE KEY",
		slog.String("task_type", shortkey.Shorten(taskType)),
		slog.String("task_id", shortkey.Shorten(id)),
		slog.String("key", shortkey.Show(key)),
		slog.Int64("place", place),
		slog.String("error", oneLine(err)))
}

// HaltError is the Err of an OpOrderHalted event: a key under InOrder and
// HaltOnFailure that halted at a place whose task failed for good (Err, what the
// task returned). The key waits there until the task, run again from asynq's
// archive, completes, or a person moves it past the place (asynqmutex order
// --skip).
type HaltError struct {
	Key           string // the key, whole (see LockedError.Key)
	Place         int64
	TaskID, Queue string
	Err           error
}

// Error names the key, the place, the task and what it returned, on one line.
func (e *HaltError) Error() string {
	return fmt.Sprintf("asynqmutex: key %s halted at place %d (task %s in queue %s), which failed for good: %s",
		shortkey.Show(e.Key), e.Place, shortkey.Quote(e.TaskID), shortkey.Quote(e.Queue), oneLine(e.Err))
}

// Unwrap returns Err.
func (e *HaltError) Unwrap() error { return e.Err }

// placeWarn logs msg at Warn about the place of task tk, which Redis could not
// update (err).
func (m *middleware) placeWarn(ctx context.Context, tk *task, msg string, err error) {
	m.log().LogAttrs(ctx, slog.LevelWarn, msg,
		slog.String("task_type", shortkey.Shorten(tk.Type())),
		slog.String("task_id", shortkey.Shorten(tk.meta.id)),
		slog.String("key", shortkey.Show(tk.key)),
		slog.Int64("place", tk.place.N),
		slog.String("error", oneLine(err)))
}

// abandonedPast reports, as OpOrderSkipped events with the reason "abandoned", the
// places after place that a finish of place moved the key past along with it (a
// Finish moves past abandoned places only so): those up to next, the key's next place
// after the finish, or none when next is 0. taskType is the finishing task's.
func (c *config) abandonedPast(ctx context.Context, taskType, key string, place, next int64) {
	for p := place + 1; p < next; p++ {
		c.emit(ctx, Event{Op: OpOrderSkipped, TaskType: taskType, Key: key, Err: &GapError{Key: key, Place: p, Reason: "abandoned"}})
	}
}

var (
	errNoPlace      = errors.New("asynqmutex: the task carries no place in its key's order (enqueued without Producer.Enqueue): run under the lock alone")
	errPlacePassed  = errors.New("asynqmutex: the task's key moved past its place: run under the lock alone")
	errPlaceUnknown = errors.New("asynqmutex: the task's key has no order of its place's epoch (forgotten, or another key's): run under the lock alone")
)

// placeOutcome says how to finish the place of a task whose turn came and that
// returned err: order.Done when asynq deletes or completes it, order.Skipped (with
// the reason) when asynq archives or drops it, or order.Halted when asynq archives it
// and the key halts (halt, HaltOnFailure), 0 when asynq retries it (the task keeps
// its place). A task whose context ended (ended is true) and that failed
// keeps its place too: asynq puts back a task its server's shutdown interrupted,
// and one it archives instead is moved past by the gap rule.
func placeOutcome(err error, meta taskMeta, ended, halt bool) (order.How, string) {
	switch {
	case err == nil:
		return order.Done, ""
	case ended:
		return 0, ""
	case !(errors.Is(err, asynq.SkipRetry) || errors.Is(err, asynq.RevokeTask) || meta.noRetryLeft()):
		return 0, ""
	case halt && !errors.Is(err, asynq.RevokeTask): // asynq deletes a revoked task: nothing to run again
		return order.Halted, "failed"
	}
	return order.Skipped, "failed"
}

// awaitTurn waits up to what is left of task tk's wait for its place p to come, moving the key past places
// whose task is gone (see InOrder). It waits only while the task that holds the
// key's next place is running: one that is queued, or will be retried, comes after
// tasks already in the queue, and waiting for it would keep worker slots from them.
// A task on its last try (which asynq would archive if sent back) waits for any task
// ahead. It returns the last Turn.
//
// dueAt is set to when that task, waiting for a retry or its ProcessAt, is due; zero
// when it is not waiting so.
func (m *middleware) awaitTurn(ctx context.Context, tk *task, p order.Place, dueAt *time.Time) (order.Turn, error) {
	key, id := tk.key, tk.meta.id
	deadline := time.Now().Add(m.waitLeft(ctx, tk))
	turn, err := m.seq.Enter(ctx, key, p)
	// Started ahead of its turn under Park (the task ahead was started as the place
	// before it finished): it waits in its worker up to LeadWait for the task ahead,
	// which is on its way or running, to start the moment that one finishes.
	ahead := err == nil && turn.State == order.TurnWait && turn.Ahead && m.leads()
	if ahead {
		deadline = time.Now().Add(m.leadWait(ctx))
	}
	// A task that waits listens on its key's channel until it is done waiting, so
	// that it hears what is announced while it asks asynq about the task ahead, and
	// asks Redis again only when an announcement leaves it unsure.
	var watch *order.Watch
	defer func() {
		if watch != nil {
			watch.Close()
		}
	}()
	for range maxOrderSteps {
		if err != nil || turn.State != order.TurnWait {
			return turn, err
		}
		h := turn.Holder
		if h.Halted {
			// Its task failed for good and the key halts there (HaltOnFailure): no
			// gap rule moves past it, and nothing will finish it soon. A task on its
			// last try waits all the same, up to LastTryWait, as behind any task.
			left := time.Until(deadline)
			if !tk.lastTry || left <= 0 {
				return turn, nil
			}
			if watch == nil {
				watch = m.seq.Watch(key)
			}
			turn, err = watch.Await(ctx, p, turn, left)
			continue
		}
		reason, running, due, pending := m.holderState(h)
		*dueAt = due
		if reason == "archived" && m.halt {
			// Under HaltOnFailure an archived task halts its key, whoever archived it
			// (its worker died on its last try, its deadline passed, a person).
			gap := order.Place{Epoch: p.Epoch, N: turn.Next}
			if n, err := m.seq.Finish(ctx, key, gap, order.Halted); err != nil {
				return turn, err
			} else if n > 0 {
				m.haltReport(ctx, tk.Type(), key, gap.N, h.TaskID, h.Queue, errArchived)
			}
			turn, err = m.seq.Enter(ctx, key, p)
			continue
		}
		if reason != "" {
			gap := order.Place{Epoch: p.Epoch, N: turn.Next}
			if n, err := m.seq.Finish(ctx, key, gap, order.Skipped); err != nil {
				return turn, err
			} else if n > 0 {
				m.emit(ctx, Event{Op: OpOrderSkipped, TaskType: tk.Type(), TaskID: id, Key: key,
					Err: &GapError{Key: key, Place: turn.Next, TaskID: h.TaskID, Queue: h.Queue, Reason: reason}})
				m.abandonedPast(ctx, tk.Type(), key, turn.Next, n)
			}
			turn, err = m.seq.Enter(ctx, key, p)
			continue
		}
		left := time.Until(deadline)
		// A task ahead whose place is younger than the grace may be on its way still:
		// its producer enqueuing it, or asynq about to hand it to a worker. Unless it
		// said it will run again later, wait for it until the grace has passed, then
		// ask asynq again.
		young := !running && h.Age < m.orderGrace && !h.Requeued
		// One started ahead waits for a task ahead that was started with it, unless
		// that one will run only later (it failed, or is scheduled).
		onItsWay := ahead && !h.Requeued && due.IsZero()
		if left <= 0 || !running && !young && !onItsWay && !tk.lastTry {
			if pending && h.Age >= m.orderGrace {
				m.stalls.report(ctx, m, tk, turn)
			}
			return turn, nil
		}
		if young && !onItsWay {
			left = min(left, m.orderGrace-h.Age)
		}
		if watch == nil {
			watch = m.seq.Watch(key)
		}
		turn, err = watch.Await(ctx, p, turn, left)
	}
	return turn, err
}

// holderState says whether the task h that holds a key's next place is gone for
// good, and why ("archived", "completed", "missing", "abandoned"); else whether it is
// running, or pending in its queue, or when it is due if it waits for a retry or its
// ProcessAt. A task asynq
// does not hold counts as missing only once its place is older than OrderGrace. A
// task that announced it will run again later (Holder.Requeued) is not running,
// whatever asynq says for the moment before it moves it. When asynq cannot say, the
// task counts as running, so that a successor waits as it would without the question.
func (m *middleware) holderState(h order.Holder) (gone string, running bool, due time.Time, pending bool) {
	if h.Abandoned {
		return "abandoned", false, due, false
	}
	if h.TaskID == "" {
		return "missing", false, due, false
	}
	info, err := m.tasks.GetTaskInfo(h.Queue, h.TaskID)
	switch {
	case errors.Is(err, asynq.ErrTaskNotFound), errors.Is(err, asynq.ErrQueueNotFound):
		if h.Age >= m.orderGrace {
			return "missing", false, due, false
		}
		return "", false, due, false
	case err != nil:
		return "", !h.Requeued, due, false
	case info.State == asynq.TaskStateArchived:
		return "archived", false, due, false
	case info.State == asynq.TaskStateCompleted:
		return "completed", false, due, false
	case info.State == asynq.TaskStateRetry, info.State == asynq.TaskStateScheduled:
		due = info.NextProcessAt
	}
	return "", info.State == asynq.TaskStateActive && !h.Requeued, due, info.State == asynq.TaskStatePending
}

// StallError is the Err of an OpOrderStalled event: a key whose next place's task
// asynq holds pending, in its queue, though the place was taken more than OrderGrace
// ago. The key waits for it, however long: the task will run once a server reads its
// queue, and moving past it would run the tasks after it first, which is what InOrder
// forbids. An operator decides: start a server for the queue, or move the key past
// the place (the asynqmutex command's order --skip).
type StallError struct {
	Key           string        // the key, whole (see LockedError.Key)
	Place         int64         // the place the key waits for
	TaskID, Queue string        // its task, as its producer recorded it
	Age           time.Duration // since the place was taken, on the Redis server's clock
	// Readers is how many active asynq servers read Queue, as the TaskLookup says
	// (an *asynq.Inspector can): 0 for a queue nobody reads; -1 when it cannot tell.
	Readers int
}

// Error names the key, the place, its task and queue, and why the key waits.
func (e *StallError) Error() string {
	why := "is pending"
	if e.Readers == 0 {
		why = "is pending in a queue no server reads"
	}
	return fmt.Sprintf("asynqmutex: key %s waits for place %d, whose task %s in queue %s %s, %v after the place was taken",
		shortkey.Show(e.Key), e.Place, shortkey.Quote(e.TaskID), shortkey.Quote(e.Queue), why, e.Age.Round(time.Second))
}

// stallWatch reports keys stalled behind a pending task (see StallError): an event
// for each task sent back behind one, a Warn line once per place and process.
type stallWatch struct {
	mu      sync.Mutex
	logged  map[string]bool             // key and place, once logged
	readers map[string]queueReadersSeen // by queue
}

// queueReadersSeen is how many servers read a queue, when last asked.
type queueReadersSeen struct {
	n  int
	at time.Time
}

// stallLogKeep bounds the places stallWatch remembers having logged; past it, it
// forgets them all, and logs each stalled place once more.
const stallLogKeep = 1024

// readersTTL is how long stallWatch trusts what asynq said of a queue's servers.
const readersTTL = 5 * time.Second

// serverLister is what a TaskLookup also is when it can list asynq's servers, as
// *asynq.Inspector can.
type serverLister interface {
	Servers() ([]*asynq.ServerInfo, error)
}

// report reports that task tk is sent back behind place turn.Next of its key, whose
// task is pending and older than the grace.
func (w *stallWatch) report(ctx context.Context, m *middleware, tk *task, turn order.Turn) {
	h := turn.Holder
	se := &StallError{Key: tk.key, Place: turn.Next, TaskID: h.TaskID, Queue: h.Queue, Age: h.Age, Readers: w.readersOf(m.tasks, h.Queue)}
	m.emit(ctx, Event{Op: OpOrderStalled, TaskType: tk.Type(), TaskID: tk.meta.id, Key: tk.key, Err: se})
	if !w.firstLog(tk.key, turn.Next) {
		return
	}
	m.log().LogAttrs(ctx, slog.LevelWarn, "asynqmutex: an ordered key waits for a task that has not started; its later tasks wait with it",
		slog.String("key", shortkey.Show(tk.key)),
		slog.Int64("place", turn.Next),
		slog.String("task_id", shortkey.Shorten(h.TaskID)),
		slog.String("queue", shortkey.Shorten(h.Queue)),
		slog.Int("queue_readers", se.Readers),
		slog.Duration("age", h.Age.Round(time.Second)))
}

// firstLog reports whether place of key is to be logged: the first time it is asked.
func (w *stallWatch) firstLog(key string, place int64) bool {
	id := key + "\x00" + strconv.FormatInt(place, 10)
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.logged[id] {
		return false
	}
	if w.logged == nil || len(w.logged) >= stallLogKeep {
		w.logged = make(map[string]bool)
	}
	w.logged[id] = true
	return true
}

// readersOf is how many active asynq servers read queue, as tasks says (asked at
// most every readersTTL per queue); -1 when it cannot say.
func (w *stallWatch) readersOf(tasks TaskLookup, queue string) int {
	lister, ok := tasks.(serverLister)
	if !ok {
		return -1
	}
	w.mu.Lock()
	seen, ok := w.readers[queue]
	w.mu.Unlock()
	if ok && time.Since(seen.at) < readersTTL {
		return seen.n
	}
	servers, err := lister.Servers()
	if err != nil {
		return -1
	}
	seen = queueReadersSeen{at: time.Now()}
	for _, s := range servers {
		if _, reads := s.Queues[queue]; reads && s.Status == "active" {
			seen.n++
		}
	}
	w.mu.Lock()
	if w.readers == nil {
		w.readers = make(map[string]queueReadersSeen)
	}
	w.readers[queue] = seen
	w.mu.Unlock()
	return seen.n
}

// sequencer is the Sequencer of the keys of locks: on its Redis client, under its
// prefix, so that a task's Finish can ride in its lock's release (see
// order.Sequencer.FinishLater), and producers and workers meet in one place.
func sequencer(locks *mutex.Client, opts ...order.Option) *order.Sequencer {
	return order.New(locks.Redis(), append([]order.Option{order.Prefix(locks.Prefix())}, opts...)...)
}

// startOrdered starts the task parked at place p of its key, whose turn has come or
// is next (an order.Starter). A task whose turn has come and that will not come
// (deleted, archived, completed) is moved past at once, as the gap rule would move
// past it, and reported as OpOrderSkipped: the finish starts the task after it if
// that one parked too.
func (m *middleware) startOrdered(ctx context.Context, p order.Parked) {
	inLine := func(ctx context.Context) (bool, error) { // its place is not finished
		turn, err := m.seq.Enter(ctx, p.Key, p.Place)
		return turn.State == order.TurnNow || turn.State == order.TurnWait, err
	}
	gone := m.starter.start(ctx, parkedTask{key: p.Key, ticket: p.Ticket, started: p.Started, inLine: inLine})
	if gone == "" || p.Ahead {
		return // one started ahead and gone is moved past when its turn comes
	}
	n, err := m.seq.Finish(ctx, p.Key, p.Place, order.Skipped)
	if err != nil || n == 0 {
		return // Redis did not answer, or the task ran and finished its place after all
	}
	queue, id, _ := fromTicket(p.Ticket)
	m.emit(ctx, Event{Op: OpOrderSkipped, TaskID: id, Key: p.Key,
		Err: &GapError{Key: p.Key, Place: p.Place.N, TaskID: id, Queue: queue, Reason: gone}})
	m.abandonedPast(ctx, "", p.Key, p.Place.N, n)
}
