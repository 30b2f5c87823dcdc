package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynqmutex/asynqmutex"
	"github.com/asynqmutex/asynqmutex/internal/benchkit"
	"github.com/asynqmutex/asynqmutex/mutex"
)

// Busy keys: what a task that meets a busy key costs the fleet today, under each way
// the middleware can be told to handle it, against no middleware at all. Two asynq
// servers (as two worker processes, each with its own pools and mutex.Client) at
// concurrency 10 and asynq's default intervals run 20 ms handlers under
// Middleware(locks, On("tenant_id"), ...) with Configure. Each column runs one batch
// per run; a batch is enqueued (one goroutine, in order), then both servers start, and
// it ends when every task has succeeded or -busy-cap after its first enqueue, which
// then reports how far it got. The figures and the goals: busyGroup's table.
func init() {
	common := []metric{
		{name: "handler mean", unit: fmt.Sprintf("ms, a %v sleep", busyWork)},
		{name: "workers waiting", unit: fmt.Sprintf("average of %d", busyServers*busyConcurrency), goals: []goal{below(2)}},
		{name: "workers waiting, peak", unit: fmt.Sprintf("of %d", busyServers*busyConcurrency)},
		{name: "Redis calls", unit: "per completed task", goals: []goal{atMost(60, "")}},
		{name: "sent back", unit: "per task"},
		{name: "retries spent", unit: "beyond the handlers' own failures", goals: []goal{atMost(0, "")}},
	}
	scenarios = append(scenarios,
		scenario{
			name:  "busy: burst",
			group: busyGroup,
			metrics: append([]metric{
				{name: "burst drain", unit: "s"},
				{name: "burst drain ÷ ideal", unit: fmt.Sprintf("× %v, %v with Limit(2)", burstTasks*busyWork, burstTasks*busyWork/2), goals: []goal{atMost(1.2, "")}},
				{name: ratioTo("burst drain", noMiddleware), unit: "×"},
				{name: "burst gap p50", unit: "ms from a return to the next start, one at a time"},
				{name: "others' drain", unit: "s, worst tenant"},
				{name: "others' drain ÷ ideal", unit: fmt.Sprintf("× %v", burstOtherTasks*busyWork)},
				{name: ratioTo("others' drain", noMiddleware), unit: "×"},
				{name: "others' drain − " + noMiddleware, unit: "s", goals: []goal{atMost(0.8, "")}},
			}, common...),
			run: func(ctx context.Context, e *env) (figures, error) { return runBusy(ctx, e, burstWorkload()) },
		},
		scenario{
			name:  "busy: rate backlog",
			group: busyGroup,
			metrics: append([]metric{
				{name: "drain", unit: "s, worst tenant"},
				{name: "drain ÷ ideal", unit: fmt.Sprintf("× %v", backlogIdeal)},
				{name: ratioTo("drain", noMiddleware), unit: "×"},
				{name: "starts ÷ limit", unit: fmt.Sprintf("× %d/s, worst tenant", backlogRate), goals: []goal{atLeast(0.9, "")}},
			}, common...),
			run: func(ctx context.Context, e *env) (figures, error) { return runBusy(ctx, e, backlogWorkload()) },
		},
		scenario{
			// Not "order": -only order runs the ordered-task scenarios.
			name:  "busy: InOrder behind a retry",
			group: busyGroup,
			metrics: append([]metric{
				{name: "next start p50", unit: "ms after the retried task's success"},
				{name: "next start p99", unit: fmt.Sprintf("ms, of %d keys", retryKeys), goals: []goal{atMost(100, "")}},
				{name: "drain", unit: "s"},
			}, common...),
			run: func(ctx context.Context, e *env) (figures, error) { return runBusy(ctx, e, retryWorkload()) },
		},
	)
}

const (
	busyServers     = 2
	busyConcurrency = 10
	busyWork        = 20 * time.Millisecond
	noMiddleware    = "no middleware"

	// The burst: burstTasks tasks of one tenant, then burstOtherTasks of each of
	// burstOthers other tenants.
	burstTasks      = 300
	burstOthers     = 4
	burstOtherTasks = 20

	// The rate backlog: backlogTenants × backlogTasks tasks, enqueued tenant after
	// tenant, under Rate(backlogRate, time.Second): ideally each tenant's last start
	// comes backlogTasks/backlogRate seconds after its first enqueue.
	backlogTenants = 4
	backlogTasks   = 25
	backlogRate    = 10
	backlogIdeal   = backlogTasks * time.Second / backlogRate

	// InOrder behind a retry: retryKeys keys of two tasks each, enqueued with the
	// Producer key after key; each key's first task fails once (a handler's run), and
	// asynq retries key k's after retryDelay + k × retrySpread (its RetryDelayFunc for
	// real failures), so that the retries spread over one DelayedTaskCheckInterval (5 s
	// by default): asynq moves due retries back to the queue at each of its ticks, and
	// retries all due at once would all meet the same tick, making a run's samples one
	// sample. The spread is in the delay, not in the failing runs: runs of up to 5 s
	// would hold the fleet's 20 workers (125 worker-seconds over 5 s), and the figure
	// would be asynq's queue waiting for a free worker, not the hand-over.
	retryKeys   = 50
	retryDelay  = 300 * time.Millisecond
	retrySpread = 5 * time.Second / retryKeys
)

// busyGroup is the table of the busy-key scenarios: a column per way of handling a
// busy key. Its goals judge every column but the floor, so it prints itself
// (printBusy).
var busyGroup = &group{
	title: fmt.Sprintf("## Busy keys: %d asynq servers × concurrency %d, %v handlers, asynq's default intervals, "+
		"Middleware(locks, On(\"tenant_id\"), …) with Configure; a run is cut at -busy-cap from the first enqueue",
		busyServers, busyConcurrency, busyWork),
	columns: columnsOf(busyModes),
	print:   printBusy,
}

// busyMode is a column: the options that say how the middleware handles a busy key,
// or none for no middleware (the floor). limit is the slots per key (Limit).
type busyMode struct {
	column
	opts  []asynqmutex.Option
	none  bool
	limit int
}

var busyModes = []busyMode{
	{column: column{name: "defaults"}, limit: 1},
	{column: column{name: "RetryLater(1s)"}, opts: []asynqmutex.Option{asynqmutex.OnConflict(asynqmutex.RetryLater(time.Second))}, limit: 1},
	{column: column{name: "MaxWait(10s)"}, opts: []asynqmutex.Option{asynqmutex.MaxWait(10 * time.Second)}, limit: 1},
	{column: column{name: "Limit(2)+MaxWait(10s)"}, opts: []asynqmutex.Option{asynqmutex.Limit(2), asynqmutex.MaxWait(10 * time.Second)}, limit: 2},
	{column: column{name: noMiddleware}, none: true, limit: 1},
}

// busyTask is a task of a batch: its tenant (the key), and whether its handler fails
// on its first run (after its work).
type busyTask struct {
	tenant string
	fail   bool
}

// busyWorkload is a busy-key scenario: its tasks in the order they are enqueued, the
// options every middleware column adds (inspector: the server's own, for InOrder),
// what it changes in asynq's config, whether the Producer enqueues, which columns
// run, and how a batch's result becomes figures.
type busyWorkload struct {
	tasks     []busyTask
	extra     func(inspector *asynq.Inspector) []asynqmutex.Option
	configure func(asynq.Config) asynq.Config
	ordered   bool
	runs      func(busyMode) bool
	figures   func(busyResult) map[string]float64
	ratios    []string // figures also shown over the floor's
	minus     []string // figures also shown less the floor's
}

func tenant(i int) string { return "t" + strconv.Itoa(i) }

func burstWorkload() busyWorkload {
	var tasks []busyTask
	for range burstTasks {
		tasks = append(tasks, busyTask{tenant: tenant(0)})
	}
	for o := 1; o <= burstOthers; o++ {
		for range burstOtherTasks {
			tasks = append(tasks, busyTask{tenant: tenant(o)})
		}
	}
	return busyWorkload{tasks: tasks, runs: func(busyMode) bool { return true }, figures: burstFigures,
		ratios: []string{"burst drain", "others' drain"}, minus: []string{"others' drain"}}
}

func backlogWorkload() busyWorkload {
	var tasks []busyTask
	for t := range backlogTenants {
		for range backlogTasks {
			tasks = append(tasks, busyTask{tenant: tenant(t)})
		}
	}
	return busyWorkload{tasks: tasks, runs: func(busyMode) bool { return true }, figures: backlogFigures,
		extra: func(*asynq.Inspector) []asynqmutex.Option {
			return []asynqmutex.Option{asynqmutex.Rate(backlogRate, time.Second)}
		},
		ratios: []string{"drain"}}
}

func retryWorkload() busyWorkload {
	var tasks []busyTask
	for k := range retryKeys {
		tasks = append(tasks, busyTask{tenant: tenant(k), fail: true}, busyTask{tenant: tenant(k)})
	}
	return busyWorkload{tasks: tasks, ordered: true, figures: retryFigures,
		// InOrder refuses Limit(n > 1); without the middleware there is no order.
		runs: func(m busyMode) bool { return !m.none && m.limit == 1 },
		extra: func(insp *asynq.Inspector) []asynqmutex.Option {
			return []asynqmutex.Option{asynqmutex.InOrder(insp)}
		},
		configure: func(cfg asynq.Config) asynq.Config {
			cfg.RetryDelayFunc = func(_ int, _ error, t *asynq.Task) time.Duration {
				var p busyPayload
				if json.Unmarshal(t.Payload(), &p) != nil {
					return retryDelay
				}
				k, _ := strconv.Atoi(strings.TrimPrefix(p.Tenant, "t"))
				return retryDelay + time.Duration(k)*retrySpread
			}
			return cfg
		}}
}

// runBusy runs the workload once per column, in the table's order, and adds the
// ratios to, and differences from, the floor's figures.
func runBusy(ctx context.Context, e *env, w busyWorkload) (figures, error) {
	figs := make(figures)
	for _, m := range busyModes {
		if !w.runs(m) {
			continue
		}
		r, err := runBusyBatch(ctx, e, w, m)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", m.name, err)
		}
		figs[m.name] = w.figures(r)
	}
	return againstFloor(figs, w.ratios, w.minus), nil
}

// againstFloor is figs with, for each column, each of ratios over the floor's
// figure, named figure + " ÷ no middleware", and each of minus less the floor's,
// named figure + " − no middleware"; NaN where the floor did not run.
func againstFloor(figs figures, ratios, minus []string) figures {
	figs = withRatios(figs, ratios, []string{noMiddleware})
	for _, f := range figs {
		for _, name := range minus {
			f[name+" − "+noMiddleware] = value(f, name) - value(figs[noMiddleware], name)
		}
	}
	return figs
}

// busyResult is what one batch measured. Times are by task (its index in tasks); a
// zero time is an event that did not happen before the batch ended.
type busyResult struct {
	tasks    []busyTask
	work     time.Duration   // a handler's
	limit    int             // slots per key
	floor    bool            // no middleware: nothing keeps a tenant's tasks apart
	enqueued []time.Time     // when its enqueue was sent
	started  []time.Time     // its handler's first start
	done     []time.Time     // its handler's successful return
	ran      []time.Duration // its handler's successful run
	retried  []int           // the highest retry count asynq gave it
	failed   []bool          // its handler failed on purpose (busyTask.fail)

	served, end time.Time // the servers' start; every task done, or the cap
	waitArea    float64   // workers waiting × seconds, from served to end
	waitPeak    int
	calls       int64 // Redis calls from served to end (meter: INFO commandstats, less INFO)
	sentBack    int64 // tasks sent back to asynq for a busy key (policy "retry")
	cap         time.Duration
}

// runBusyBatch runs one batch of w under mode m, on a queue and lock prefix of its
// own: enqueue, start both servers, wait until every task succeeded or the cap
// passed (counted from the first enqueue), measure, shut the servers down.
func runBusyBatch(ctx context.Context, e *env, w busyWorkload, m busyMode) (busyResult, error) {
	batch := token()
	qname := e.prefix + "q:" + batch
	prefix := e.prefix + "busy:" + batch + ":"
	defer func() {
		if err := benchkit.DeleteQueue(e.stats, qname); err != nil {
			fmt.Fprintln(os.Stderr, "bench: deleting queue:", err)
		}
	}()
	log := newBusyLog(w.tasks)
	options := func(insp *asynq.Inspector) []asynqmutex.Option {
		opts := append([]asynqmutex.Option{asynqmutex.On("tenant_id"), asynqmutex.Observe(log.observe)}, m.opts...)
		if w.extra != nil {
			opts = append(opts, w.extra(insp)...)
		}
		return opts
	}

	type worker struct {
		srv *asynq.Server
		h   asynq.Handler
	}
	var workers []worker
	for range busyServers {
		// A worker process of its own: asynq's pool, the lock's, its mutex.Client.
		rdb, lrdb := e.redis(), e.redis()
		locks := mutex.New(lrdb, mutex.Prefix(prefix))
		defer func() { _ = locks.Close(); lrdb.Close(); rdb.Close() }()
		h := asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error { return log.handle(ctx, t, busyWork) })
		var wrapped asynq.Handler = h
		cfg := defaultIntervals(benchkit.AsynqConfig(qname, busyConcurrency, quietLogger))
		if w.configure != nil {
			cfg = w.configure(cfg)
		}
		if !m.none {
			wrapped = asynqmutex.Middleware(locks, options(asynq.NewInspectorFromRedisClient(rdb))...)(h)
			cfg = asynqmutex.Configure(cfg)
		}
		workers = append(workers, worker{asynq.NewServerFromRedisClient(rdb, cfg), log.outer(wrapped)})
	}

	enq := e.redis()
	defer enq.Close()
	client := asynq.NewClientFromRedisClient(enq)
	defer client.Close() // does not close enq: the pool is shared
	enqueue := client.EnqueueContext
	if w.ordered && !m.none {
		plocks := mutex.New(enq, mutex.Prefix(prefix))
		defer plocks.Close()
		enqueue = asynqmutex.NewProducer(plocks, client, options(nil)...).Enqueue
	}
	for n, t := range w.tasks {
		p, err := json.Marshal(busyPayload{Tenant: t.tenant, N: n})
		if err != nil {
			return busyResult{}, err
		}
		log.enqueued[n] = time.Now() // no server runs yet
		if _, err := enqueue(ctx, asynq.NewTask("bench:busy", p), asynq.Queue(qname)); err != nil {
			return busyResult{}, err
		}
	}

	mt := e.meter(nil)
	if err := mt.start(ctx); err != nil {
		return busyResult{}, err
	}
	served := time.Now()
	log.waiting.reset(served)
	var started []*asynq.Server
	shutdown := func() {
		var wg sync.WaitGroup // each may take its ShutdownTimeout: at once
		for _, srv := range started {
			wg.Add(1)
			go func() { defer wg.Done(); srv.Shutdown() }()
		}
		wg.Wait()
	}
	for _, wk := range workers {
		if err := wk.srv.Start(wk.h); err != nil {
			shutdown()
			return busyResult{}, err
		}
		started = append(started, wk.srv)
	}
	t := time.NewTimer(time.Until(log.enqueued[0].Add(e.busyCap)))
	select {
	case <-log.all:
	case <-t.C:
	case <-ctx.Done():
	}
	t.Stop()
	r := log.result(served, time.Now())
	var u usage
	err := mt.stop(ctx, &u)
	shutdown()
	r.work, r.limit, r.floor, r.calls, r.cap = busyWork, m.limit, m.none, u.calls, e.busyCap
	if e.verbose {
		done := 0
		for _, at := range r.done {
			if !at.IsZero() {
				done++
			}
		}
		printCalls(os.Stderr, m.name, u.byName, done)
	}
	return r, errors.Join(err, ctx.Err())
}

type busyPayload struct {
	Tenant string `json:"tenant_id"`
	N      int    `json:"n"`
}

// busyLog is what a batch's tasks did, as its handlers and the middleware's
// observer saw it; safe for concurrent use.
type busyLog struct {
	tasks    []busyTask
	all      chan struct{} // closed when every task succeeded
	waiting  gauge         // tasks inside the middleware, not yet in the handler
	sentBack atomic.Int64

	mu                      sync.Mutex
	enqueued, started, done []time.Time
	ran                     []time.Duration
	retried                 []int
	failed                  []bool
	succeeded               int
}

func newBusyLog(tasks []busyTask) *busyLog {
	n := len(tasks)
	return &busyLog{tasks: tasks, all: make(chan struct{}),
		enqueued: make([]time.Time, n), started: make([]time.Time, n), done: make([]time.Time, n), ran: make([]time.Duration, n),
		retried: make([]int, n), failed: make([]bool, n)}
}

func (l *busyLog) observe(_ context.Context, ev asynqmutex.Event) {
	if ev.Policy == "retry" {
		l.sentBack.Add(1)
	}
}

// inHandler is the context key of a run's *atomic.Bool, set when the run reaches
// the handler (or leaves the middleware without it).
type inHandler struct{}

// outer wraps the middleware (or, for no middleware, the handler): a run counts as
// waiting from here until its handler starts, or until it leaves without it.
func (l *busyLog) outer(next asynq.Handler) asynq.Handler {
	return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		n, err := l.index(t)
		if err != nil {
			return err
		}
		if rc, ok := asynq.GetRetryCount(ctx); ok {
			l.mu.Lock()
			l.retried[n] = max(l.retried[n], rc)
			l.mu.Unlock()
		}
		in := new(atomic.Bool)
		l.waiting.add(1, time.Now())
		err = next.ProcessTask(context.WithValue(ctx, inHandler{}, in), t)
		if in.CompareAndSwap(false, true) {
			l.waiting.add(-1, time.Now())
		}
		return err
	})
}

// handle is the handler: it sleeps work, and then fails on its first run if its task
// is one that fails once.
func (l *busyLog) handle(ctx context.Context, t *asynq.Task, work time.Duration) error {
	now := time.Now()
	if in, ok := ctx.Value(inHandler{}).(*atomic.Bool); ok && in.CompareAndSwap(false, true) {
		l.waiting.add(-1, now)
	}
	n, err := l.index(t)
	if err != nil {
		return err
	}
	l.mu.Lock()
	if l.started[n].IsZero() {
		l.started[n] = now
	}
	fail := l.tasks[n].fail && !l.failed[n]
	if fail {
		l.failed[n] = true
	}
	l.mu.Unlock()
	if err := benchkit.Sleep(ctx, work); err != nil {
		return err
	}
	if fail {
		return errors.New("bench: this task's first run fails")
	}
	end := time.Now()
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.done[n].IsZero() {
		l.done[n], l.ran[n] = end, end.Sub(now)
		if l.succeeded++; l.succeeded == len(l.tasks) {
			close(l.all)
		}
	}
	return nil
}

// index is the task's n, checked against the batch.
func (l *busyLog) index(t *asynq.Task) (int, error) {
	var p busyPayload
	if err := json.Unmarshal(t.Payload(), &p); err != nil || p.N < 0 || p.N >= len(l.tasks) {
		return 0, fmt.Errorf("bench: task %q is none of this batch's: %v: %w", t.Payload(), err, asynq.SkipRetry)
	}
	return p.N, nil
}

// result is what the log holds, the servers having started at served and the batch
// ended at end.
func (l *busyLog) result(served, end time.Time) busyResult {
	area, peak := l.waiting.read(end)
	l.mu.Lock()
	defer l.mu.Unlock()
	return busyResult{tasks: l.tasks,
		enqueued: slices.Clone(l.enqueued), started: slices.Clone(l.started), done: slices.Clone(l.done), ran: slices.Clone(l.ran),
		retried: slices.Clone(l.retried), failed: slices.Clone(l.failed),
		served: served, end: end, waitArea: area, waitPeak: peak, sentBack: l.sentBack.Load()}
}

// gauge is a count that moves over time (workers waiting): its integral over time
// since reset, and its peak. Safe for concurrent use.
type gauge struct {
	mu      sync.Mutex
	n, peak int
	last    time.Time
	area    float64 // count × seconds
}

func (g *gauge) reset(at time.Time) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.last, g.area, g.peak = at, 0, g.n
}

// add moves the count by d at time at. Changes that reach it out of order (at
// before the last one's) count from the last one's time.
func (g *gauge) add(d int, at time.Time) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if at.After(g.last) {
		g.area += float64(g.n) * at.Sub(g.last).Seconds()
		g.last = at
	}
	g.n += d
	g.peak = max(g.peak, g.n)
}

// read is the integral up to at, and the peak.
func (g *gauge) read(at time.Time) (area float64, peak int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	area = g.area
	if at.After(g.last) {
		area += float64(g.n) * at.Sub(g.last).Seconds()
	}
	return area, g.peak
}

// common are the figures every busy-key scenario shows.
func (r busyResult) common() map[string]float64 {
	done, retried, ran := 0, 0, time.Duration(0)
	for i := range r.tasks {
		if !r.done[i].IsZero() {
			done++
			ran += r.ran[i]
		}
		// A handler's own failure spends a retry: only those beyond it count.
		own := 0
		if r.failed[i] {
			own = 1
		}
		retried += max(r.retried[i]-own, 0)
	}
	return map[string]float64{
		"handler mean":          ms(ran) / float64(done),
		"workers waiting":       r.waitArea / r.end.Sub(r.served).Seconds(),
		"workers waiting, peak": float64(r.waitPeak),
		"Redis calls":           float64(r.calls) / float64(done),
		"sent back":             float64(r.sentBack) / float64(len(r.tasks)),
		"retries spent":         float64(retried),
		"cap":                   r.cap.Seconds(),
	}
}

// tenants are the batch's tenants, in the order of their first task.
func (r busyResult) tenants() []string {
	var ts []string
	for _, t := range r.tasks {
		if !slices.Contains(ts, t.tenant) {
			ts = append(ts, t.tenant)
		}
	}
	return ts
}

// drain is the time in seconds from the first enqueue of the tasks that keep says
// to keep to the last one's success, +Inf when some did not succeed; and how many
// succeeded, of how many.
func (r busyResult) drain(keep func(busyTask) bool) (secs float64, done, total int) {
	var first, last time.Time
	for i, t := range r.tasks {
		if !keep(t) {
			continue
		}
		total++
		if first.IsZero() || r.enqueued[i].Before(first) {
			first = r.enqueued[i]
		}
		if !r.done[i].IsZero() {
			done++
			if r.done[i].After(last) {
				last = r.done[i]
			}
		}
	}
	if done < total || total == 0 {
		return math.Inf(1), done, total
	}
	return last.Sub(first).Seconds(), done, total
}

func of(tenant string) func(busyTask) bool {
	return func(t busyTask) bool { return t.tenant == tenant }
}

// burstFigures: the first tenant's drain against its ideal, its tasks one after
// another (or limit at a time), and the other tenants' worst drain against theirs.
func burstFigures(r busyResult) map[string]float64 {
	f := r.common()
	ts := r.tenants()
	d, done, total := r.drain(of(ts[0]))
	ideal := (time.Duration(total) * r.work).Seconds() / float64(r.limit)
	f["burst drain"], f["burst done"], f["burst tasks"], f["burst drain ÷ ideal"] = d, float64(done), float64(total), d/ideal
	f["burst gap p50"] = nan()
	if r.limit == 1 && !r.floor {
		var spans [][2]time.Time
		for i, t := range r.tasks {
			if t.tenant == ts[0] && !r.done[i].IsZero() {
				spans = append(spans, [2]time.Time{r.started[i], r.done[i]})
			}
		}
		slices.SortFunc(spans, func(a, b [2]time.Time) int { return a[0].Compare(b[0]) })
		if gs := gaps(spans); len(gs) > 0 {
			p50, _ := benchkit.Percentiles(gs)
			f["burst gap p50"] = ms(p50)
		}
	}
	worst, odone, ototal, oideal := 0.0, 0, 0, 0.0
	for _, t := range ts[1:] {
		d, done, total := r.drain(of(t))
		worst, odone, ototal = max(worst, d), odone+done, ototal+total
		oideal = max(oideal, (time.Duration(total) * r.work).Seconds())
	}
	f["others' drain"], f["others done"], f["others tasks"], f["others' drain ÷ ideal"] = worst, float64(odone), float64(ototal), worst/oideal
	return f
}

// backlogFigures: the worst tenant's drain against backlogTasks/backlogRate, and
// the rate at which its tasks started, as a fraction of the limit.
func backlogFigures(r busyResult) map[string]float64 {
	f := r.common()
	worst, done, total, rate := 0.0, 0, 0, math.Inf(1)
	for _, t := range r.tenants() {
		d, dn, tt := r.drain(of(t))
		worst, done, total = max(worst, d), done+dn, total+tt
		rate = min(rate, r.startRate(t))
	}
	f["drain"], f["done"], f["tasks"] = worst, float64(done), float64(total)
	f["drain ÷ ideal"] = worst / backlogIdeal.Seconds()
	f["starts ÷ limit"] = rate / backlogRate
	return f
}

// startRate is the starts per second tenant's tasks got while it had a backlog:
// its starts after the first over the time from its first enqueue (the backlog is
// there from then on; a limit kept would start a task at once and one per interval
// after it) to its last start, or, when some of its tasks never started, to the
// batch's end. 0 for fewer than two starts.
func (r busyResult) startRate(tenant string) float64 {
	var first, last time.Time
	starts, all := 0, true
	for i, t := range r.tasks {
		if t.tenant != tenant {
			continue
		}
		if first.IsZero() || r.enqueued[i].Before(first) {
			first = r.enqueued[i]
		}
		if r.started[i].IsZero() {
			all = false
			continue
		}
		starts++
		if r.started[i].After(last) {
			last = r.started[i]
		}
	}
	if starts < 2 {
		return 0
	}
	if !all {
		last = r.end
	}
	return float64(starts-1) / last.Sub(first).Seconds()
}

// retryFigures: for each task that fails once, the time from its successful retry's
// return to the start of the next task of its key; and the drain of them all.
func retryFigures(r busyResult) map[string]float64 {
	f := r.common()
	var gaps []time.Duration
	for i, t := range r.tasks {
		if !t.fail || r.done[i].IsZero() {
			continue
		}
		if j := slices.IndexFunc(r.tasks[i+1:], of(t.tenant)); j >= 0 && !r.started[i+1+j].IsZero() {
			gaps = append(gaps, r.started[i+1+j].Sub(r.done[i]))
		}
	}
	f["next start p50"], f["next start p99"] = nan(), nan()
	if len(gaps) > 0 {
		p50, p99 := benchkit.Percentiles(gaps)
		f["next start p50"], f["next start p99"] = ms(p50), ms(p99)
	}
	d, done, total := r.drain(func(busyTask) bool { return true })
	f["drain"], f["done"], f["tasks"] = d, float64(done), float64(total)
	return f
}

func ms(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e6 }

// busyDone names, for a drain, the figures that say how far a batch cut at the cap
// got: its tasks done, of how many.
var busyDone = map[string][2]string{
	"burst drain":   {"burst done", "burst tasks"},
	"others' drain": {"others done", "others tasks"},
	"drain":         {"done", "tasks"},
}

// printBusy prints the busy-key table: a row per figure, a column per mode (the
// median over runs), and the goal, which every column but the floor is marked as
// having met or missed. A drain cut at the cap reads "85 of 300 after 90s".
func printBusy(out io.Writer, g *group, todo []scenario, results [][]figures) {
	header := false
	for i, s := range todo {
		if s.group != g {
			continue
		}
		if !header {
			header = true
			printHeader(out, g, []string{"goal"}, 0)
		}
		for _, m := range s.metrics {
			agg := m.aggregate(results[i])
			fmt.Fprintf(out, "| %s | %s (%s) |", s.name, m.name, m.unit)
			for _, c := range g.columns {
				fmt.Fprintf(out, " %s |", busyCell(m, c.name, agg, results[i]))
			}
			var texts []string
			for _, gl := range m.goals {
				texts = append(texts, gl.text())
			}
			fmt.Fprintf(out, " %s |\n", strings.Join(texts, "; "))
		}
	}
}

// busyCell is column col's cell of metric m: its figure, and whether it met m's
// goals.
func busyCell(m metric, col string, agg map[string]float64, runs []figures) string {
	v, ok := agg[col]
	if !ok {
		return "–"
	}
	text := num(v)
	if math.IsInf(v, 1) {
		text = "not drained"
		if names, ok := busyDone[m.name]; ok {
			at := func(name string) float64 { return value(metric{name: name}.aggregate(runs), col) }
			text = fmt.Sprintf("%.0f of %.0f after %ss", at(names[0]), at(names[1]),
				strconv.FormatFloat(at("cap"), 'f', -1, 64))
		}
	}
	if col == noMiddleware || len(m.goals) == 0 || math.IsNaN(v) {
		return text
	}
	for _, gl := range m.goals {
		if gl.met(v) {
			text += " met"
		} else {
			text += " missed"
		}
	}
	return text
}

// printCalls prints a batch's Redis calls per completed task by command, the most
// first: where the "Redis calls" figure goes.
func printCalls(out io.Writer, column string, byName map[string]int64, done int) {
	names := make([]string, 0, len(byName))
	for n := range byName {
		names = append(names, n)
	}
	slices.SortFunc(names, func(a, b string) int { return int(byName[b] - byName[a]) })
	fmt.Fprintf(out, "  %s: Redis calls per completed task by command:", column)
	for _, n := range names {
		fmt.Fprintf(out, " %s %.1f", n, float64(byName[n])/float64(max(done, 1)))
	}
	fmt.Fprintln(out)
}
