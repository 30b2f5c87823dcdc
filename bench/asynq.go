package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex"
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

// asynqConfig is the Config every asynq server of the scenarios runs with, with or
// without the middleware. TaskCheckInterval is how long the processor sleeps when it
// finds every queue empty; a batch keeps its queue full until its last tasks, so it
// matters only where tasks leave the queue (RetryLater) and at the end of a batch.
// DelayedTaskCheckInterval is how often retries are moved back to their queue.
func asynqConfig(qname string, concurrency int) asynq.Config {
	return asynq.Config{
		Concurrency:              concurrency,
		Queues:                   map[string]int{qname: 1},
		TaskCheckInterval:        time.Millisecond,
		DelayedTaskCheckInterval: 100 * time.Millisecond,
		ShutdownTimeout:          5 * time.Second,
		Logger:                   quietLogger{},
		LogLevel:                 asynq.ErrorLevel,
	}
}

// quietLogger keeps asynq's errors and drops the rest.
type quietLogger struct{}

func (quietLogger) Debug(...any)      {}
func (quietLogger) Info(...any)       {}
func (quietLogger) Warn(...any)       {}
func (quietLogger) Error(args ...any) { fmt.Fprintln(os.Stderr, append([]any{"asynq:"}, args...)...) }
func (quietLogger) Fatal(args ...any) {
	fmt.Fprintln(os.Stderr, append([]any{"asynq: fatal:"}, args...)...)
}

var _ asynq.Logger = quietLogger{}

// roundTrips is a go-redis hook counting round trips: each command or pipeline
// sent. Subscriptions' own traffic is not counted.
type roundTrips struct{ n atomic.Int64 }

var _ redis.Hook = (*roundTrips)(nil)

func (h *roundTrips) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *roundTrips) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.n.Add(1)
		return next(ctx, cmd)
	}
}
func (h *roundTrips) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		h.n.Add(1)
		return next(ctx, cmds)
	}
}

// asynqSide runs batches through asynq servers: enqueue a batch, start a server,
// wait until every task of the batch ran its handler, shut the server down. One
// Redis connection pool for asynq (and one for the lock) serves all its batches, as
// a long-running worker process would.
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
	asynqTrips *roundTrips
	lockTrips  *roundTrips   // nil without the lock
	lockRdb    *redis.Client // the lock's; nil without it
	conflicts  atomic.Int64  // tasks that did not get the lock (AfterFailure)

	totals batchResult
}

// batchResult is what one or more batches measured.
type batchResult struct {
	tasks     int           // tasks enqueued
	done      int           // of them, handled
	elapsed   time.Duration // from the first handler call to the last handler's return
	drain     time.Duration // from the server's start to the last handler's return
	trips     int64         // asynq's round trips
	lockTrips int64
	redisCPU  time.Duration
	goCPU     time.Duration
	conflicts int64 // runs of a task that did not get the lock
}

func (r *batchResult) add(o batchResult) {
	r.tasks += o.tasks
	r.done += o.done
	r.elapsed += o.elapsed
	r.drain += o.drain
	r.trips += o.trips
	r.lockTrips += o.lockTrips
	r.redisCPU += o.redisCPU
	r.goCPU += o.goCPU
	r.conflicts += o.conflicts
}

func newAsynqSide(e *env, tasks, concurrency int) *asynqSide {
	s := &asynqSide{e: e, tasks: tasks, concurrency: concurrency, asynqTrips: new(roundTrips), bound: opBound,
		work: func(context.Context) error { return nil }}
	s.payload = func(i int) []byte { return []byte(`{"id":"` + strconv.Itoa(i) + `"}`) }
	s.enq = e.redis()
	s.rdb = e.redis(s.asynqTrips)
	return s
}

// withLock makes the side run its handler through the middleware, on a mutex.Client
// of its own pool; close releases it.
func (s *asynqSide) withLock(opts ...asynqmutex.Option) *mutex.Client {
	s.lockTrips = new(roundTrips)
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
		if r.done < r.tasks {
			return fmt.Errorf("%d of %d tasks done within %v", r.done, r.tasks, s.bound)
		}
		s.totals.add(r)
	}
	return nil
}

func (s *asynqSide) figures() map[string]float64 {
	t := s.totals
	n := float64(t.done)
	f := map[string]float64{
		// The first handler call starts the clock: n-1 tasks per batch ran after it.
		"throughput":  (n - float64(t.done/s.tasks)) / t.elapsed.Seconds(),
		"round trips": float64(t.trips+t.lockTrips) / n,
		"redis CPU":   float64(t.redisCPU.Microseconds()) / n,
		"Go CPU":      float64(t.goCPU.Microseconds()) / n,
	}
	if s.lockTrips != nil {
		f["lock round trips"] = float64(t.lockTrips) / n
	}
	return f
}

// batch enqueues s.tasks tasks on a queue of their own, runs an asynq server until
// they are all handled or s.bound passes, and deletes the queue.
func (s *asynqSide) batch(ctx context.Context) (batchResult, error) {
	qname := s.e.prefix + "q:" + token()
	defer s.e.deleteQueue(qname)
	if err := s.enqueue(ctx, qname); err != nil {
		return batchResult{}, err
	}

	var (
		done      atomic.Int64
		firstCall atomic.Int64 // UnixNano of the first handler call
		lastDone  atomic.Int64 // UnixNano of the last handler return
		all       = make(chan struct{})
	)
	var h asynq.Handler = asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		firstCall.CompareAndSwap(0, time.Now().UnixNano())
		err := s.work(ctx)
		if err != nil {
			return err
		}
		lastDone.Store(time.Now().UnixNano())
		if done.Add(1) == int64(s.tasks) {
			close(all)
		}
		return nil
	})
	if s.wrap != nil {
		h = s.wrap(h)
	}
	cfg := asynqConfig(qname, s.concurrency)
	if s.configure != nil {
		cfg = s.configure(cfg)
	}
	srv := asynq.NewServerFromRedisClient(s.rdb, cfg)

	cpu0, err := redisCPU(ctx, s.e.stats)
	if err != nil {
		return batchResult{}, err
	}
	go0, trips0, conflicts0 := processCPU(), s.asynqTrips.n.Load(), s.conflicts.Load()
	var lock0 int64
	if s.lockTrips != nil {
		lock0 = s.lockTrips.n.Load()
	}
	start := time.Now()
	if err := srv.Start(h); err != nil {
		return batchResult{}, err
	}
	t := time.NewTimer(s.bound)
	select {
	case <-all:
	case <-t.C:
	case <-ctx.Done():
	}
	t.Stop()
	r := batchResult{tasks: s.tasks, done: int(done.Load()), goCPU: processCPU() - go0,
		trips: s.asynqTrips.n.Load() - trips0, conflicts: s.conflicts.Load() - conflicts0}
	if s.lockTrips != nil {
		r.lockTrips = s.lockTrips.n.Load() - lock0
	}
	cpu1, err := redisCPU(ctx, s.e.stats)
	srv.Shutdown()
	if err != nil {
		return batchResult{}, err
	}
	r.redisCPU = cpu1 - cpu0
	if last := lastDone.Load(); last != 0 {
		r.elapsed = time.Duration(last - firstCall.Load())
		r.drain = time.Unix(0, last).Sub(start)
	}
	return r, ctx.Err()
}

// enqueue puts s.tasks tasks on qname, from 8 goroutines.
func (s *asynqSide) enqueue(ctx context.Context, qname string) error {
	c := asynq.NewClientFromRedisClient(s.enq)
	defer c.Close() // does not close s.enq: the connection is shared
	const senders = 8
	var (
		next  atomic.Int64
		wg    sync.WaitGroup
		mu    sync.Mutex
		first error
	)
	for range senders {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := int(next.Add(1)) - 1; i < s.tasks; i = int(next.Add(1)) - 1 {
				task := asynq.NewTask("bench:task", s.payload(i))
				if _, err := c.EnqueueContext(ctx, task, asynq.Queue(qname)); err != nil {
					mu.Lock()
					first = errors.Join(first, err)
					mu.Unlock()
					return
				}
			}
		}()
	}
	wg.Wait()
	return first
}

// deleteQueue removes what asynq keeps of a queue, by a SCAN of its hash tag.
func (e *env) deleteQueue(qname string) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var cursor uint64
	for range 1000 {
		keys, next, err := e.stats.Scan(ctx, cursor, "asynq:{"+qname+"}*", 1000).Result()
		if err != nil {
			fmt.Fprintln(os.Stderr, "bench: deleting queue:", err)
			return
		}
		if len(keys) > 0 {
			_ = e.stats.Unlink(ctx, keys...).Err()
		}
		if cursor = next; cursor == 0 {
			break
		}
	}
	_ = e.stats.SRem(ctx, "asynq:queues", qname).Err()
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
	work := func(ctx context.Context) error {
		t := time.NewTimer(hotWork)
		defer t.Stop()
		select {
		case <-t.C:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	hot := func(int) []byte { return []byte(`{"id":"hot"}`) }
	drain := func(s *asynqSide) (batchResult, error) {
		s.work, s.payload = work, hot
		return s.batch(ctx)
	}
	ms := func(r batchResult) float64 {
		if r.done < r.tasks {
			return nan()
		}
		return float64(r.drain.Microseconds()) / 1e3
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
	if r.done < r.tasks {
		return nil, fmt.Errorf("MaxWait: %d of %d tasks done within %v", r.done, r.tasks, wait.bound)
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
	figs["RetryLater(1s) done"] = figure{nan(), float64(r.done)}
	figs["RetryLater(1s) conflicts"] = figure{nan(), float64(r.conflicts) / float64(r.done)}
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
