package main

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex"
	"github.com/asynqmutex/asynqmutex/internal/benchkit"
	"github.com/asynqmutex/asynqmutex/mutex"
)

// The middleware over bare asynq, on the same redis-server: the floor is the same
// asynq server, with the same Config and handler, without the middleware.
func init() {
	scenarios = append(scenarios,
		scenario{
			name: "asynq: no-op tasks, distinct keys, concurrency 10",
			metrics: []metric{
				{name: "throughput", unit: "tasks/s", higher: true, goal: "lock ≥ 0.85 × floor", pass: rateAtLeast(0.85)},
				{name: "round trips", unit: "per task"},
				{name: "lock round trips", unit: "per task"},
				{name: "redis CPU", unit: "µs/task"},
				{name: "Go CPU", unit: "µs/task"},
			},
			run: asynqOverhead,
		},
		scenario{
			name: fmt.Sprintf("asynq: %d × %v tasks, one key, concurrency 10", hotTasks, hotWork),
			metrics: []metric{
				{name: "drain, MaxWait(1m)", unit: "ms", goal: "ratio ≤ 1.3", pass: ratioAtMost(1.3)},
				{name: "drain, no lock, concurrency 1", unit: "ms"},
				{name: "drain, RetryLater(1s)", unit: "ms"},
				{name: "RetryLater(1s) done", unit: "tasks"},
				{name: "RetryLater(1s) conflicts", unit: "per task done"},
			},
			run: asynqHotKey,
		},
	)
}

const (
	// overheadTasks is the batch enqueued before each asynq server of the overhead
	// scenario starts; the server runs until all are processed.
	overheadTasks = 2000

	asynqConcurrency = 10

	// hotTasks tasks of hotWork each, on one key: ideally hotTasks × hotWork.
	hotTasks = 200
	hotWork  = 5 * time.Millisecond
)

// rateAtLeast is a goal on the lock's rate as a share of the floor's; ratio is
// floor/lock for rates.
func rateAtLeast(share float64) func(figure, float64) bool {
	return func(_ figure, r float64) bool { return 1/r >= share }
}

// quietLogger keeps asynq's errors, on stderr, and drops the rest.
var quietLogger = benchkit.QuietLogger(stderrln, stderrln)

func stderrln(args ...any) { fmt.Fprintln(os.Stderr, args...) }

// asynqSide runs batches through asynq servers (benchkit.Batch): enqueue a batch,
// start a server, wait until every task of the batch ran its handler, shut the server
// down. One Redis connection pool for asynq (and one for the lock) serves all its
// batches, as a long-running worker process would.
type asynqSide struct {
	e           *env
	tasks       int
	concurrency int
	payload     func(i int) []byte
	work        func(ctx context.Context) error // the handler's work
	wrap        func(asynq.Handler) asynq.Handler
	configure   func(asynq.Config) asynq.Config
	bound       time.Duration // of one batch, after its server started

	enq        *redis.Client // enqueues; not counted
	rdb        *redis.Client // asynq's
	asynqTrips *benchkit.RoundTrips
	lockTrips  *benchkit.RoundTrips // nil without the lock
	lockRdb    *redis.Client        // the lock's; nil without it
	conflicts  atomic.Int64         // tasks that did not get the lock (AfterFailure)

	totals batchResult
}

// batchResult is what one or more batches measured: benchkit's figures, and the CPU
// time of the server and of this process over the same time.
type batchResult struct {
	benchkit.BatchResult
	redisCPU time.Duration
	goCPU    time.Duration
}

func (r *batchResult) add(o batchResult) {
	r.BatchResult.Add(o.BatchResult)
	r.redisCPU += o.redisCPU
	r.goCPU += o.goCPU
}

func newAsynqSide(e *env, tasks, concurrency int) *asynqSide {
	s := &asynqSide{e: e, tasks: tasks, concurrency: concurrency, asynqTrips: new(benchkit.RoundTrips), bound: opBound,
		work: func(context.Context) error { return nil }}
	s.payload = func(i int) []byte { return []byte(`{"id":"` + strconv.Itoa(i) + `"}`) }
	s.enq = e.redis()
	s.rdb = e.redis(s.asynqTrips)
	return s
}

// withLock makes the side run its handler through the middleware, on a mutex.Client
// of its own pool; close releases it.
func (s *asynqSide) withLock(opts ...asynqmutex.Option) *mutex.Client {
	s.lockTrips = new(benchkit.RoundTrips)
	s.lockRdb = s.e.redis(s.lockTrips)
	locks := mutex.New(s.lockRdb, mutex.Prefix(s.e.prefix))
	count := asynqmutex.AfterFailure(func(context.Context, *asynq.Task, error) { s.conflicts.Add(1) })
	s.wrap = asynqmutex.Middleware(locks, append(opts, count)...)
	return locks
}

func (s *asynqSide) close(locks *mutex.Client) {
	if locks != nil {
		_ = locks.Close() // first: it drops its subscription, on lockRdb
		s.lockRdb.Close()
	}
	s.enq.Close()
	s.rdb.Close()
}

func (s *asynqSide) run(ctx context.Context, deadline time.Time) error {
	for first := true; first || time.Now().Before(deadline); first = false {
		r, err := s.batch(ctx)
		if err != nil {
			return err
		}
		if r.Done < r.Tasks {
			return fmt.Errorf("%d of %d tasks done within %v", r.Done, r.Tasks, s.bound)
		}
		s.totals.add(r)
	}
	return nil
}

func (s *asynqSide) figures() map[string]float64 {
	t := s.totals
	n := float64(t.Done)
	f := map[string]float64{
		// The first handler call starts the clock: n-1 tasks per batch ran after it.
		"throughput":  (n - float64(t.Done/s.tasks)) / t.Elapsed.Seconds(),
		"round trips": float64(t.Trips+t.LockTrips) / n,
		"redis CPU":   float64(t.redisCPU.Microseconds()) / n,
		"Go CPU":      float64(t.goCPU.Microseconds()) / n,
	}
	if s.lockTrips != nil {
		f["lock round trips"] = float64(t.LockTrips) / n
	}
	return f
}

// batch runs s.tasks tasks on a queue of their own until they are all handled or
// s.bound passes, and deletes the queue.
func (s *asynqSide) batch(ctx context.Context) (batchResult, error) {
	qname := s.e.prefix + "q:" + token()
	defer func() {
		if err := benchkit.DeleteQueue(s.e.stats, qname); err != nil {
			fmt.Fprintln(os.Stderr, "bench: deleting queue:", err)
		}
	}()
	var (
		r         batchResult
		cpu0, go0 time.Duration
	)
	b := benchkit.Batch{Enq: s.enq, Rdb: s.rdb, Queue: qname,
		Tasks: s.tasks, Concurrency: s.concurrency, Payload: s.payload, Work: s.work,
		Wrap: s.wrap, Configure: s.configure, Logger: quietLogger, Bound: s.bound,
		Trips: s.asynqTrips, LockTrips: s.lockTrips, Conflicts: &s.conflicts,
		Start: func() (err error) {
			cpu0, err = redisCPU(ctx, s.e.stats)
			go0 = processCPU()
			return err
		},
		Stop: func() error {
			r.goCPU = processCPU() - go0
			cpu1, err := redisCPU(ctx, s.e.stats)
			r.redisCPU = cpu1 - cpu0
			return err
		},
	}
	var err error
	r.BatchResult, err = b.Run(ctx)
	if err != nil {
		return batchResult{}, err
	}
	return r, nil
}

// redisCPU is the CPU time the server used so far, user and system.
func redisCPU(ctx context.Context, rdb *redis.Client) (time.Duration, error) {
	info, err := rdb.Info(ctx, "cpu").Result()
	if err != nil {
		return 0, err
	}
	var sum time.Duration
	for _, field := range []string{"used_cpu_user", "used_cpu_sys"} {
		v, ok := infoField(info, field)
		if !ok {
			return 0, fmt.Errorf("INFO cpu: no %s", field)
		}
		secs, err := strconv.ParseFloat(v, 64)
		if err != nil {
			return 0, fmt.Errorf("INFO cpu: %s: %w", field, err)
		}
		sum += time.Duration(secs * float64(time.Second))
	}
	return sum, nil
}

// asynqOverhead: overheadTasks no-op tasks with distinct keys, through asynq alone
// and through the middleware with On("id"), interleaved.
func asynqOverhead(ctx context.Context, e *env, d time.Duration) (map[string]figure, error) {
	floor := newAsynqSide(e, overheadTasks, asynqConcurrency)
	defer floor.close(nil)
	lock := newAsynqSide(e, overheadTasks, asynqConcurrency)
	locks := lock.withLock(asynqmutex.On("id"))
	defer lock.close(locks)
	// Warm both pools and load the scripts outside the measurement.
	for _, s := range []*asynqSide{floor, lock} {
		if _, err := s.batch(ctx); err != nil {
			return nil, err
		}
	}
	return interleave(ctx, d, floor, lock)
}

// asynqHotKey: hotTasks tasks of hotWork each, all on one key, at concurrency 10,
// with MaxWait and with RetryLater; the floor is the ideal, hotTasks × hotWork run
// back to back. For reference, the same tasks without the lock at concurrency 1:
// what asynq itself adds to serial work.
func asynqHotKey(ctx context.Context, e *env, _ time.Duration) (map[string]figure, error) {
	ideal := float64((hotTasks * hotWork).Milliseconds())
	work := func(ctx context.Context) error { return benchkit.Sleep(ctx, hotWork) }
	hot := func(int) []byte { return []byte(`{"id":"hot"}`) }
	drain := func(s *asynqSide) (batchResult, error) {
		s.work, s.payload = work, hot
		return s.batch(ctx)
	}
	ms := func(r batchResult) float64 {
		if r.Done < r.Tasks {
			return nan()
		}
		return float64(r.Drain.Microseconds()) / 1e3
	}
	figs := make(map[string]figure)

	serial := newAsynqSide(e, hotTasks, 1)
	r, err := drain(serial)
	serial.close(nil)
	if err != nil {
		return nil, err
	}
	figs["drain, no lock, concurrency 1"] = figure{ideal, ms(r)}

	wait := newAsynqSide(e, hotTasks, asynqConcurrency)
	locks := wait.withLock(asynqmutex.On("id"), asynqmutex.MaxWait(time.Minute))
	r, err = drain(wait)
	wait.close(locks)
	if err != nil {
		return nil, err
	}
	if r.Done < r.Tasks {
		return nil, fmt.Errorf("MaxWait: %d of %d tasks done within %v", r.Done, r.Tasks, wait.bound)
	}
	figs["drain, MaxWait(1m)"] = figure{ideal, ms(r)}

	retry := newAsynqSide(e, hotTasks, asynqConcurrency)
	locks = retry.withLock(asynqmutex.On("id"), asynqmutex.OnConflict(asynqmutex.RetryLater(time.Second)))
	retry.configure = asynqmutex.Configure
	// asynq's whole-second retry times and the policy's backoff make this drain slow
	// (see README.md): it is bounded by -retrylater, and what it did by then reported.
	retry.bound = e.retryLater
	r, err = drain(retry)
	retry.close(locks)
	if err != nil {
		return nil, err
	}
	figs["drain, RetryLater(1s)"] = figure{ideal, ms(r)}
	figs["RetryLater(1s) done"] = figure{nan(), float64(r.Done)}
	figs["RetryLater(1s) conflicts"] = figure{nan(), float64(r.Conflicts) / float64(r.Done)}
	return figs, nil
}

// infoField is the value of field in an INFO reply.
func infoField(info, field string) (string, bool) {
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), field+":"); ok {
			return v, true
		}
	}
	return "", false
}
