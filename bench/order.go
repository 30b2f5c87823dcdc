package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex"
	"github.com/asynqmutex/asynqmutex/internal/benchkit"
	"github.com/asynqmutex/asynqmutex/mutex"
)

// Ordered tasks (per-key FIFO): what InOrder costs on distinct keys, against the
// lock alone and bare asynq, and how close a hot key's drain comes to one task
// after another with nothing between them. Real asynq servers on the same
// redis-server, at asynq's default intervals, as in the middleware scenarios; only
// the public API (Producer.Enqueue, InOrder) is used.
func init() {
	scenarios = append(scenarios,
		scenario{
			name:  "order: no-op tasks, distinct keys",
			group: orderGroup,
			metrics: []metric{
				{name: "throughput", unit: "tasks/s", higher: true},
				{name: ratioTo("throughput", bareColumn), unit: "×", higher: true},
				{name: ratioTo("throughput", plainColumn), unit: "×", higher: true},
				{name: "Redis server time", unit: "µs/task"},
				{name: ratioTo("Redis server time", bareColumn), unit: "×"},
				{name: "Redis calls", unit: "per task"},
				{name: "Redis CPU", unit: "µs/task"},
				{name: "Go CPU", unit: "µs/task"},
				{name: "enqueue", unit: "µs/task"},
				{name: "enqueue Redis server time", unit: "µs/task"},
				{name: "out of order", unit: "tasks, worst run", worst: true, goals: []goal{atMost(0, "")}},
			},
			run: func(ctx context.Context, e *env) (figures, error) {
				return runOrdered(ctx, e, orderDistinct(e.tasks), true)
			},
		},
		scenario{
			name: fmt.Sprintf("order: %d × %v tasks on one key (nominal drain %v)",
				orderHotTasks, orderHotWork, orderHotTasks*orderHotWork),
			group: orderGroup,
			metrics: []metric{
				{name: "drain", unit: "ms"},
				{name: "drain ÷ ideal", unit: "×", goals: []goal{atMost(1.2, "")}},
				{name: "drain ÷ nominal", unit: "×"},
				{name: "first start", unit: "ms"},
				{name: "handler mean", unit: "ms"},
				{name: "gap mean", unit: "µs"},
				{name: "gap p50", unit: "µs"},
				{name: "gap p99", unit: "µs"},
				{name: "inversions", unit: "pairs, worst run", worst: true, goals: []goal{atMost(0, "")}},
				{name: "out of order", unit: "tasks, worst run", worst: true, goals: []goal{atMost(0, "")}},
				{name: "sent back", unit: "per batch"},
				{name: "Redis server time", unit: "µs/task"},
				{name: "Redis calls", unit: "per task"},
			},
			run: func(ctx context.Context, e *env) (figures, error) {
				return runOrdered(ctx, e, orderHot(e.orderWorkers), false)
			},
		},
	)
}

const (
	bareColumn  = "bare asynq"
	plainColumn = "lock only"

	// orderConcurrency is the asynq servers' on distinct keys.
	orderConcurrency = 20

	// The hot key: orderHotTasks tasks of orderHotWork each, enqueued in order, run
	// by one server of orderHotConcurrency workers (-order-concurrency); ideally one
	// after another, orderHotTasks × orderHotWork in all.
	orderHotTasks       = 200
	orderHotWork        = 5 * time.Millisecond
	orderHotConcurrency = 4

	// orderCycles is how many times a run cycles through the contenders, forwards
	// and backwards, a batch per turn: a batch lasts about a second, and on a shared
	// machine one or two per contender left a run's ratio to the noise of a few
	// seconds (0.7 to 1.2 between runs on distinct keys).
	orderCycles = 3
)

func ratioTo(figure, ref string) string { return figure + " ÷ " + ref }

// orderGroup is the table of the ordered-task scenarios. Its "peer" is the lock
// alone, so that ÷ best peer is what order adds to the plain middleware.
var orderGroup = &group{
	title: "## Ordered tasks: asynqmutex = Middleware with InOrder (tasks enqueued with Producer.Enqueue); " +
		"lock only = Middleware without it (asynq.Client); ÷ best peer is ÷ lock only",
	columns: columnsOf(orderContenders),
}

// orderContender is a column of the ordered-task scenarios: open makes one worker
// process's middleware (none for bare asynq) and, for ordered tasks, the Producer.
type orderContender struct {
	column
	open func(e *env, p orderPools) orderMiddleware
}

// orderPools are a side's connection pools: the lock's and the worker's Sequencer's
// (lrdb), the asynq server's and Inspector's (rdb), and the producer's (enq, and the
// asynq.Client on it); observe hears the middleware's events.
type orderPools struct {
	lrdb, rdb, enq *redis.Client
	client         *asynq.Client
	observe        func(context.Context, asynqmutex.Event)
}

// orderMiddleware is a contender's side of one process: wrap is nil for bare asynq,
// prod nil but for InOrder, and closeFn runs before the pools close.
type orderMiddleware struct {
	wrap      func(asynq.Handler) asynq.Handler
	prod      *asynqmutex.Producer
	configure func(asynq.Config) asynq.Config
	closeFn   func()
}

var orderContenders = []orderContender{
	{column: column{name: ours}, open: func(e *env, p orderPools) orderMiddleware {
		locks := mutex.New(p.lrdb, mutex.Prefix(e.prefix+"order-lock:"))
		// The producer's places are taken on the enqueuing pool, the worker's on the
		// lock's: as in two processes.
		prodLocks := mutex.New(p.enq, mutex.Prefix(e.prefix+"order-lock:"))
		insp := asynq.NewInspectorFromRedisClient(p.rdb) // shares rdb: never closed through asynq
		opts := func(tasks asynqmutex.TaskLookup) []asynqmutex.Option {
			return []asynqmutex.Option{asynqmutex.On("id"), asynqmutex.MaxWait(time.Minute),
				asynqmutex.InOrder(tasks), asynqmutex.Observe(p.observe)}
		}
		return orderMiddleware{
			wrap:      asynqmutex.Middleware(locks, opts(insp)...),
			prod:      asynqmutex.NewProducer(prodLocks, p.client, opts(nil)...),
			configure: asynqmutex.Configure,
			closeFn:   func() { _ = locks.Close(); _ = prodLocks.Close() },
		}
	}},
	{column: column{name: plainColumn, peer: true}, open: func(e *env, p orderPools) orderMiddleware {
		locks := mutex.New(p.lrdb, mutex.Prefix(e.prefix+"order-plain:"))
		return orderMiddleware{
			wrap: asynqmutex.Middleware(locks, asynqmutex.On("id"), asynqmutex.MaxWait(time.Minute),
				asynqmutex.Observe(p.observe)),
			configure: asynqmutex.Configure,
			closeFn:   func() { _ = locks.Close() },
		}
	}},
	{column: column{name: bareColumn}, open: func(*env, orderPools) orderMiddleware {
		return orderMiddleware{closeFn: func() {}}
	}},
}

// orderWorkload is a batch's shape: its tasks (payload {"id": key(i), "n": i}),
// enqueued by how many goroutines (1 keeps the enqueue order that of n), the
// handler's work, the servers' concurrency, and whether to record the order of the
// handlers' starts.
type orderWorkload struct {
	tasks, enqueuers, concurrency int
	key                           func(batch string, i int) string
	work                          time.Duration
	record                        bool
}

func orderDistinct(tasks int) orderWorkload {
	// Keys new in every batch: an ordered key's first task, as order IDs are.
	return orderWorkload{tasks: tasks, enqueuers: 8, concurrency: orderConcurrency,
		key: func(batch string, i int) string { return batch + "-" + strconv.Itoa(i) }}
}

func orderHot(concurrency int) orderWorkload {
	return orderWorkload{tasks: orderHotTasks, enqueuers: 1, concurrency: concurrency,
		key: func(batch string, _ int) string { return batch }, work: orderHotWork, record: true}
}

// runOrdered runs one ordered-task scenario: a side per contender (bare asynq only
// when withBare), each warmed up with one batch, then interleaved, one batch per turn,
// forwards then backwards, orderCycles times. The ratios are taken within the run.
func runOrdered(ctx context.Context, e *env, w orderWorkload, withBare bool) (figures, error) {
	var (
		names []string
		sides []side
	)
	for _, c := range orderContenders {
		if c.name == bareColumn && !withBare {
			continue
		}
		s := newOrderSide(e, c, w)
		defer s.close()
		names, sides = append(names, c.name), append(sides, s)
	}
	for i, s := range sides {
		if err := s.run(ctx, time.Now()); err != nil {
			return nil, fmt.Errorf("%s: warm-up: %w", names[i], err)
		}
		s.reset()
	}
	figs, err := interleave(ctx, 0, orderCycles, names, sides)
	if err != nil {
		return nil, err
	}
	refs := []string{plainColumn}
	if withBare {
		refs = append(refs, bareColumn)
	}
	return withRatios(figs, []string{"throughput", "Redis server time"}, refs), nil
}

// orderSide is a contender's worker process and producer: one batch per turn.
type orderSide struct {
	e  *env
	w  orderWorkload
	mw orderMiddleware

	enq        *redis.Client // the producer's; enqueues are measured apart
	client     *asynq.Client
	rdb, lrdb  *redis.Client // asynq's, and the lock's and Sequencer's
	run0, enq0 *meter

	outOfTurn, outOfOrder, skipped atomic.Int64

	totals orderTotals
	runUse usage // over the servers' runs
	enqUse usage // over the enqueues
}

// orderTotals are what a side's batches measured, summed.
type orderTotals struct {
	batches, tasks, done int
	elapsed              time.Duration // first handler call to last return
	drain                time.Duration // server start to last return
	firstStart           time.Duration // server start to first handler call
	enqueue              time.Duration
	inversions           int
	gaps                 []time.Duration // from a handler's return to the next one's start, recorded batches
	handlers             time.Duration   // the handlers' runs, summed, recorded batches
	outOfTurn            int64
	outOfOrder           int64
}

func newOrderSide(e *env, c orderContender, w orderWorkload) *orderSide {
	s := &orderSide{e: e, w: w, enq: e.redis(), rdb: e.redis(), lrdb: e.redis()}
	s.client = asynq.NewClientFromRedisClient(s.enq)
	s.run0, s.enq0 = e.meter(benchkit.LockCommands), e.meter(benchkit.LockCommands)
	s.mw = c.open(e, orderPools{lrdb: s.lrdb, rdb: s.rdb, enq: s.enq, client: s.client, observe: s.observe})
	return s
}

func (s *orderSide) observe(_ context.Context, ev asynqmutex.Event) {
	switch ev.Op {
	case asynqmutex.OpOutOfTurn:
		s.outOfTurn.Add(1)
	case asynqmutex.OpOutOfOrder:
		s.outOfOrder.Add(1)
	case asynqmutex.OpOrderSkipped:
		s.skipped.Add(1)
	}
}

func (s *orderSide) reset() {
	s.totals, s.runUse, s.enqUse = orderTotals{}, usage{}, usage{}
}

func (s *orderSide) close() {
	s.mw.closeFn()
	_ = s.client.Close() // does not close enq: the pool is shared
	s.enq.Close()
	s.rdb.Close()
	s.lrdb.Close()
}

// run runs one batch, whatever the deadline, on a queue of its own, which it deletes
// afterwards: enqueue it (measured apart), start a server, wait until every task's
// handler returned, stop the measures, shut the server down.
func (s *orderSide) run(ctx context.Context, _ time.Time) error {
	batch := token()
	qname := s.e.prefix + "q:" + batch
	defer func() {
		if err := benchkit.DeleteQueue(s.e.stats, qname); err != nil {
			fmt.Fprintln(os.Stderr, "bench: deleting queue:", err)
		}
	}()
	if err := s.enq0.start(ctx); err != nil {
		return err
	}
	t0 := time.Now()
	if err := s.enqueue(ctx, batch, qname); err != nil {
		return err
	}
	enqueued := time.Since(t0)
	if err := s.enq0.stop(ctx, &s.enqUse); err != nil {
		return err
	}

	rec := &startLog{record: s.w.record, done: make(chan struct{}), tasks: s.w.tasks}
	var h asynq.Handler = asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		return rec.handle(ctx, t, s.w.work)
	})
	if s.mw.wrap != nil {
		h = s.mw.wrap(h)
	}
	cfg := defaultIntervals(benchkit.AsynqConfig(qname, s.w.concurrency, quietLogger))
	if s.mw.configure != nil {
		cfg = s.mw.configure(cfg)
	}
	srv := asynq.NewServerFromRedisClient(s.rdb, cfg)
	turn0, order0 := s.outOfTurn.Load(), s.outOfOrder.Load()
	if err := s.run0.start(ctx); err != nil {
		return err
	}
	start := time.Now()
	if err := srv.Start(h); err != nil {
		return err
	}
	bound := opBound + time.Duration(s.w.tasks)*(time.Millisecond+s.w.work)
	t := time.NewTimer(bound)
	select {
	case <-rec.done:
	case <-t.C:
	case <-ctx.Done():
	}
	t.Stop()
	err := s.run0.stop(ctx, &s.runUse)
	srv.Shutdown()
	if err != nil {
		return err
	}
	r := rec.result(start)
	if r.done < s.w.tasks {
		return fmt.Errorf("%d of %d tasks done within %v", r.done, s.w.tasks, bound)
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	r.enqueue = enqueued
	r.outOfTurn, r.outOfOrder = s.outOfTurn.Load()-turn0, s.outOfOrder.Load()-order0
	s.totals.add(r)
	return nil
}

// enqueue puts the batch's tasks on qname from w.enqueuers goroutines: with the
// Producer for ordered tasks, with the asynq.Client otherwise.
func (s *orderSide) enqueue(ctx context.Context, batch, qname string) error {
	return benchkit.Parallel(s.w.enqueuers, s.w.tasks, func(i int) error {
		p, _ := json.Marshal(orderPayload{ID: s.w.key(batch, i), N: i})
		task := asynq.NewTask("bench:ordered", p)
		var err error
		if s.mw.prod != nil {
			_, err = s.mw.prod.Enqueue(ctx, task, asynq.Queue(qname))
		} else {
			_, err = s.client.EnqueueContext(ctx, task, asynq.Queue(qname))
		}
		return err
	})
}

type orderPayload struct {
	ID string `json:"id"`
	N  int    `json:"n"`
}

// startLog is what a batch's handlers saw: the first call, the last return, and,
// when record is set, each task's n and times, in the order the handlers started.
type startLog struct {
	record bool
	tasks  int
	done   chan struct{} // closed when every task's handler returned

	mu          sync.Mutex
	n           int
	first, last time.Time
	starts      []int          // n, by start
	spans       [][2]time.Time // start and return, by start
}

func (l *startLog) handle(ctx context.Context, t *asynq.Task, work time.Duration) error {
	start := time.Now()
	at := -1
	if l.record {
		var p orderPayload
		if err := json.Unmarshal(t.Payload(), &p); err != nil {
			return fmt.Errorf("%v: %w", err, asynq.SkipRetry)
		}
		l.mu.Lock()
		if l.first.IsZero() {
			l.first = start
		}
		at = len(l.starts)
		l.starts = append(l.starts, p.N)
		l.spans = append(l.spans, [2]time.Time{start})
		l.mu.Unlock()
	}
	if work > 0 {
		if err := benchkit.Sleep(ctx, work); err != nil {
			return err
		}
	}
	end := time.Now()
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.first.IsZero() || start.Before(l.first) {
		l.first = start
	}
	l.last = end
	if at >= 0 {
		l.spans[at][1] = end
	}
	if l.n++; l.n == l.tasks {
		close(l.done)
	}
	return nil
}

// result is the batch's figures, its server having started at start.
func (l *startLog) result(start time.Time) orderTotals {
	l.mu.Lock()
	defer l.mu.Unlock()
	r := orderTotals{batches: 1, tasks: l.tasks, done: l.n}
	if l.n == 0 {
		return r
	}
	r.elapsed, r.drain, r.firstStart = l.last.Sub(l.first), l.last.Sub(start), l.first.Sub(start)
	if l.record {
		r.inversions = inversions(l.starts)
		r.gaps = gaps(l.spans)
		for _, sp := range l.spans {
			r.handlers += sp[1].Sub(sp[0])
		}
	}
	return r
}

func (t *orderTotals) add(o orderTotals) {
	t.batches += o.batches
	t.tasks += o.tasks
	t.done += o.done
	t.elapsed += o.elapsed
	t.drain += o.drain
	t.firstStart += o.firstStart
	t.enqueue += o.enqueue
	t.inversions += o.inversions
	t.gaps = append(t.gaps, o.gaps...)
	t.handlers += o.handlers
	t.outOfTurn += o.outOfTurn
	t.outOfOrder += o.outOfOrder
}

// inversions counts the pairs of tasks that started in the opposite order of their
// n: 0 when every task started after every task enqueued before it.
func inversions(starts []int) int {
	n := 0
	for i := range starts {
		for j := i + 1; j < len(starts); j++ {
			if starts[j] < starts[i] {
				n++
			}
		}
	}
	return n
}

// gaps are, for each task but the first (by start), the time from the return of the
// task started before it to its own start; negative where the two overlapped.
func gaps(spans [][2]time.Time) []time.Duration {
	var out []time.Duration
	for i := 1; i < len(spans); i++ {
		out = append(out, spans[i][0].Sub(spans[i-1][1]))
	}
	return out
}

func (s *orderSide) figures() map[string]float64 {
	return orderFigures(s.totals, s.runUse, s.enqUse, s.w.work)
}

// orderFigures turns a side's totals into its figures; work is the handler's, which
// makes a drain's ideal.
func orderFigures(t orderTotals, run, enq usage, work time.Duration) map[string]float64 {
	n, b := float64(t.done), float64(t.batches)
	f := map[string]float64{
		// The first handler call starts the clock: n-1 tasks per batch ran after it.
		"throughput":                (n - b) / t.elapsed.Seconds(),
		"Redis server time":         float64(run.usec) / n,
		"Redis calls":               float64(run.calls) / n,
		"Redis CPU":                 float64(run.redisCPU.Microseconds()) / n,
		"Go CPU":                    float64(run.goCPU.Microseconds()) / n,
		"enqueue":                   float64(t.enqueue.Microseconds()) / float64(t.tasks),
		"enqueue Redis server time": float64(enq.usec) / float64(t.tasks),
		"out of order":              float64(t.outOfOrder),
		"sent back":                 float64(t.outOfTurn) / b,
	}
	if work > 0 {
		nominal := time.Duration(t.tasks) * work // over all batches
		f["drain"] = float64(t.drain.Microseconds()) / 1e3 / b
		f["drain ÷ nominal"] = t.drain.Seconds() / nominal.Seconds()
		f["first start"] = float64(t.firstStart.Microseconds()) / 1e3 / b
		f["inversions"] = float64(t.inversions)
		f["handler mean"] = float64(t.handlers.Microseconds()) / 1e3 / n
		// The ideal is the handlers' runs end to end, as they ran: one at a time, with
		// no time between them. A sleep of work overshoots on a busy machine, which is
		// no cost of the key's handoff; drain ÷ nominal counts it.
		f["drain ÷ ideal"] = t.drain.Seconds() / t.handlers.Seconds()
		if len(t.gaps) > 0 {
			var sum time.Duration
			for _, g := range t.gaps {
				sum += g
			}
			f["gap mean"] = float64(sum.Nanoseconds()) / 1e3 / float64(len(t.gaps))
			p50, p99 := benchkit.Percentiles(t.gaps)
			f["gap p50"] = float64(p50.Nanoseconds()) / 1e3
			f["gap p99"] = float64(p99.Nanoseconds()) / 1e3
		}
	}
	return f
}
