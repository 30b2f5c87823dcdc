package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"time"

	"github.com/bsm/redislock"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex"
	"github.com/asynqmutex/asynqmutex/internal/benchkit"
	"github.com/asynqmutex/asynqmutex/mutex"
)

// The middleware scenarios (issue 8's "Speed"): real asynq servers on the same
// redis-server, at asynq's default intervals.
func init() {
	scenarios = append(scenarios,
		scenario{
			name:  "asynq: no-op tasks, distinct keys",
			group: asynqGroup,
			metrics: []metric{
				{name: "throughput", unit: "tasks/s", higher: true,
					goals: []goal{atLeast(0.9, "bare asynq"), atLeast(1, "redislock by hand")}},
				{name: "Redis CPU", unit: "µs/task"},
				{name: "Go CPU", unit: "µs/task"},
				{name: "Redis calls", unit: "per task"},
			},
			run: func(ctx context.Context, e *env) (figures, error) {
				distinct := func(i int) []byte { return []byte(`{"id":"` + strconv.Itoa(i) + `"}`) }
				return runMiddlewares(ctx, e, e.tasks, distinct, func(context.Context) error { return nil }, true)
			},
		},
		scenario{
			name:  fmt.Sprintf("asynq: %d × %v tasks, one key (ideal drain %v)", hotTasks, hotWork, hotTasks*hotWork),
			group: asynqGroup,
			metrics: []metric{
				{name: "drain", unit: "ms", goals: []goal{atMost(1, "redislock by hand")}},
				{name: "Redis CPU", unit: "µs/task", goals: []goal{atMost(0.5, "redislock by hand")}},
				{name: "Redis calls", unit: "per task"},
			},
			run: func(ctx context.Context, e *env) (figures, error) {
				hot := func(int) []byte { return []byte(`{"id":"hot"}`) }
				work := func(ctx context.Context) error { return benchkit.Sleep(ctx, hotWork) }
				return runMiddlewares(ctx, e, hotTasks, hot, work, false)
			},
		},
	)
}

const (
	asynqConcurrency = 10

	// hotTasks tasks of hotWork each, on one key: ideally hotTasks × hotWork.
	hotTasks = 200
	hotWork  = 5 * time.Millisecond
)

// asynqGroup is the table of the middleware scenarios: a column per middleware.
var asynqGroup = &group{
	title:   fmt.Sprintf("## Middleware: asynq v0.26.0 at its default intervals, concurrency %d", asynqConcurrency),
	columns: columnsOf(middlewares),
}

// middleware is a contender of the middleware scenarios: wrap puts a lock, on the
// connection pool lrdb, around the handler, and returns what to run before lrdb
// closes; bare asynq has none.
type middleware struct {
	column
	wrap func(e *env, lrdb *redis.Client, waits bool) (func(asynq.Handler) asynq.Handler, func())
}

var middlewares = []middleware{
	{column: column{name: ours}, wrap: func(e *env, lrdb *redis.Client, waits bool) (func(asynq.Handler) asynq.Handler, func()) {
		opts := []asynqmutex.Option{asynqmutex.On("id")}
		if waits {
			opts = append(opts, asynqmutex.MaxWait(time.Minute))
		}
		locks := mutex.New(lrdb, mutex.Prefix(e.prefix+"asynqmutex:"))
		return asynqmutex.Middleware(locks, opts...), func() { _ = locks.Close() } // it drops its subscription
	}},
	{column: column{name: "redislock by hand", peer: true}, wrap: func(e *env, lrdb *redis.Client, _ bool) (func(asynq.Handler) asynq.Handler, func()) {
		return byHand(redislock.New(lrdb), e.prefix+"byhand:"), func() {}
	}},
	{column: column{name: "bare asynq"}},
}

// byHand is the middleware a user would write on bsm/redislock: the key from the
// task type and the payload's "id", Obtain retrying every 1 ms until the task's
// context ends, Release deferred, no renewal.
func byHand(locker *redislock.Client, prefix string) func(asynq.Handler) asynq.Handler {
	opts := &redislock.Options{RetryStrategy: redislock.LinearBackoff(peerRetry)}
	return func(next asynq.Handler) asynq.Handler {
		return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
			var p struct {
				ID string `json:"id"`
			}
			if err := json.Unmarshal(t.Payload(), &p); err != nil {
				return fmt.Errorf("%v: %w", err, asynq.SkipRetry)
			}
			lock, err := locker.Obtain(ctx, prefix+t.Type()+":"+p.ID, lockTTL, opts)
			if err != nil {
				return err
			}
			defer lock.Release(context.WithoutCancel(ctx))
			return next.ProcessTask(ctx, t)
		})
	}
}

// runMiddlewares runs one middleware scenario: a side per middleware (all, or only
// those with a lock), each warmed up with one batch, then interleaved, one batch per
// turn. The locks wait for a busy key when waits is set (the hot key).
func runMiddlewares(ctx context.Context, e *env, tasks int, payload func(int) []byte, work func(context.Context) error, withBare bool) (figures, error) {
	var (
		names []string
		sides []side
	)
	for _, mw := range middlewares {
		if mw.wrap == nil && !withBare {
			continue
		}
		s := &asynqSide{e: e, tasks: tasks, payload: payload, work: work, m: e.meter(nil),
			enq: e.redis(), rdb: e.redis()}
		if mw.wrap != nil {
			s.lrdb = e.redis()
			s.wrap, s.closeLock = mw.wrap(e, s.lrdb, !withBare)
		}
		defer s.close()
		names, sides = append(names, mw.name), append(sides, s)
	}
	for i, s := range sides {
		if err := s.run(ctx, time.Now()); err != nil {
			return nil, fmt.Errorf("%s: warm-up: %w", names[i], err)
		}
		s.reset()
	}
	return interleave(ctx, 0, 1, names, sides)
}

// quietLogger keeps asynq's errors, on stderr, and drops the rest.
var quietLogger = benchkit.QuietLogger(stderrln, stderrln)

func stderrln(args ...any) { fmt.Fprintln(os.Stderr, args...) }

// asynqSide runs one batch per turn (benchkit.Batch): enqueue it, start a server,
// wait until every task of the batch ran its handler, shut the server down. One
// connection pool for asynq, and one for the lock, serve all its batches, as in a
// long-running worker process.
type asynqSide struct {
	e       *env
	m       *meter
	tasks   int
	payload func(i int) []byte
	work    func(ctx context.Context) error // the handler's work
	wrap    func(asynq.Handler) asynq.Handler

	enq       *redis.Client // enqueues; not measured
	rdb       *redis.Client // asynq's
	lrdb      *redis.Client // the lock's; nil for bare asynq
	closeLock func()        // runs before lrdb closes

	totals benchkit.BatchResult
	usage
}

func (s *asynqSide) reset() { s.totals, s.usage = benchkit.BatchResult{}, usage{} }

func (s *asynqSide) close() {
	if s.lrdb != nil {
		s.closeLock()
		s.lrdb.Close()
	}
	s.enq.Close()
	s.rdb.Close()
}

// run runs one batch, whatever the deadline, on a queue of its own, which it deletes
// afterwards.
func (s *asynqSide) run(ctx context.Context, _ time.Time) error {
	qname := s.e.prefix + "q:" + token()
	defer func() {
		if err := benchkit.DeleteQueue(s.e.stats, qname); err != nil {
			fmt.Fprintln(os.Stderr, "bench: deleting queue:", err)
		}
	}()
	b := benchkit.Batch{Enq: s.enq, Rdb: s.rdb, Queue: qname,
		Tasks: s.tasks, Concurrency: asynqConcurrency, Payload: s.payload, Work: s.work,
		Wrap: s.wrap, Configure: defaultIntervals, Logger: quietLogger, Bound: s.bound(),
		Start: func() error { return s.m.start(ctx) },
		Stop:  func() error { return s.m.stop(ctx, &s.usage) },
	}
	r, err := b.Run(ctx)
	if err != nil {
		return err
	}
	if r.Done < r.Tasks {
		return fmt.Errorf("%d of %d tasks done within %v", r.Done, r.Tasks, s.bound())
	}
	s.totals.Add(r)
	return nil
}

// bound is how long a batch may take once its server started: opBound, and 1 ms more
// per task.
func (s *asynqSide) bound() time.Duration { return opBound + time.Duration(s.tasks)*time.Millisecond }

// defaultIntervals undoes benchkit.AsynqConfig's short intervals: asynq then checks
// an empty queue every second and moves retries back every 5 s, as it does for users
// who set neither.
func defaultIntervals(cfg asynq.Config) asynq.Config {
	cfg.TaskCheckInterval, cfg.DelayedTaskCheckInterval = 0, 0
	return cfg
}

func (s *asynqSide) figures() map[string]float64 {
	t := s.totals
	n := float64(t.Done)
	batches := float64(t.Done / s.tasks)
	return map[string]float64{
		// The first handler call starts the clock: n-1 tasks per batch ran after it.
		"throughput":  (n - batches) / t.Elapsed.Seconds(),
		"drain":       float64(t.Drain.Microseconds()) / 1e3 / batches,
		"Redis CPU":   float64(s.redisCPU.Microseconds()) / n,
		"Go CPU":      float64(s.goCPU.Microseconds()) / n,
		"Redis calls": float64(s.calls) / n,
	}
}
