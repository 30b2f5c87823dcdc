package benchkit

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// QuietLogger is an asynq.Logger that keeps asynq's errors and drops the rest: it
// passes them, after "asynq:" or "asynq: fatal:", to logError or logFatal.
func QuietLogger(logError, logFatal func(args ...any)) asynq.Logger {
	return quietLogger{logError, logFatal}
}

type quietLogger struct{ err, fatal func(args ...any) }

func (quietLogger) Debug(...any)        {}
func (quietLogger) Info(...any)         {}
func (quietLogger) Warn(...any)         {}
func (l quietLogger) Error(args ...any) { l.err(append([]any{"asynq:"}, args...)...) }
func (l quietLogger) Fatal(args ...any) { l.fatal(append([]any{"asynq: fatal:"}, args...)...) }

// AsynqConfig is the Config every asynq server of the benchmarks runs with, with or
// without the middleware. TaskCheckInterval is how long the processor sleeps when it
// finds every queue empty; a batch keeps its queue full until its last tasks, so it
// matters only where tasks leave the queue (RetryLater) and at the end of a batch.
// DelayedTaskCheckInterval is how often retries are moved back to their queue.
func AsynqConfig(qname string, concurrency int, logger asynq.Logger) asynq.Config {
	return asynq.Config{
		Concurrency:              concurrency,
		Queues:                   map[string]int{qname: 1},
		TaskCheckInterval:        time.Millisecond,
		DelayedTaskCheckInterval: 100 * time.Millisecond,
		ShutdownTimeout:          5 * time.Second,
		Logger:                   logger,
		LogLevel:                 asynq.ErrorLevel,
	}
}

// Batch is one batch of tasks: enqueued on a queue of their own, then run by an asynq
// server until every task has run its handler or Bound passes.
type Batch struct {
	Enq   *redis.Client // enqueues; not counted
	Rdb   *redis.Client // the asynq server's
	Queue string        // the batch's own; the caller deletes it (DeleteQueue)

	Tasks       int
	Concurrency int
	Payload     func(i int) []byte
	Work        func(ctx context.Context) error   // the handler's work
	Wrap        func(asynq.Handler) asynq.Handler // the middleware; nil for none
	Configure   func(asynq.Config) asynq.Config   // applied to AsynqConfig; nil for none
	Logger      asynq.Logger
	Bound       time.Duration // of the wait for the tasks, from the server's start

	// Counted, where set, from the server's start to the end of the wait: the round
	// trips of Rdb and of the lock's pool, and the task runs that did not get the lock.
	Trips, LockTrips *RoundTrips
	Conflicts        *atomic.Int64

	// Start and Stop, where set, run just before the server starts and just after the
	// wait for the tasks ends, before the server shuts down: around what is measured.
	Start, Stop func() error
}

// BatchResult is what one batch, or the sum of several, measured.
type BatchResult struct {
	Tasks     int           // tasks enqueued
	Done      int           // of them, handled
	Elapsed   time.Duration // from the first handler call to the last handler's return
	Drain     time.Duration // from the server's start to the last handler's return
	Trips     int64         // of Batch.Trips
	LockTrips int64         // of Batch.LockTrips
	Conflicts int64         // of Batch.Conflicts
}

// Add adds o to r.
func (r *BatchResult) Add(o BatchResult) {
	r.Tasks += o.Tasks
	r.Done += o.Done
	r.Elapsed += o.Elapsed
	r.Drain += o.Drain
	r.Trips += o.Trips
	r.LockTrips += o.LockTrips
	r.Conflicts += o.Conflicts
}

// Run enqueues the batch, starts an asynq server on it, waits until every task ran
// its handler, Bound passes or ctx is done, and shuts the server down. A batch cut
// short by Bound is no error: Done says how far it got.
func (b *Batch) Run(ctx context.Context) (BatchResult, error) {
	if err := Enqueue(ctx, b.Enq, b.Queue, b.Tasks, b.Payload); err != nil {
		return BatchResult{}, err
	}
	var (
		done      atomic.Int64
		firstCall atomic.Int64 // UnixNano of the first handler call
		lastDone  atomic.Int64 // UnixNano of the last handler return
		all       = make(chan struct{})
	)
	var h asynq.Handler = asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
		firstCall.CompareAndSwap(0, time.Now().UnixNano())
		if err := b.Work(ctx); err != nil {
			return err
		}
		lastDone.Store(time.Now().UnixNano())
		if done.Add(1) == int64(b.Tasks) {
			close(all)
		}
		return nil
	})
	if b.Wrap != nil {
		h = b.Wrap(h)
	}
	cfg := AsynqConfig(b.Queue, b.Concurrency, b.Logger)
	if b.Configure != nil {
		cfg = b.Configure(cfg)
	}
	srv := asynq.NewServerFromRedisClient(b.Rdb, cfg)

	if b.Start != nil {
		if err := b.Start(); err != nil {
			return BatchResult{}, err
		}
	}
	trips0, lockTrips0, conflicts0 := load(b.Trips), load(b.LockTrips), loadInt(b.Conflicts)
	start := time.Now()
	if err := srv.Start(h); err != nil {
		return BatchResult{}, err
	}
	t := time.NewTimer(b.Bound)
	select {
	case <-all:
	case <-t.C:
	case <-ctx.Done():
	}
	t.Stop()
	r := BatchResult{Tasks: b.Tasks, Done: int(done.Load()), Trips: load(b.Trips) - trips0,
		LockTrips: load(b.LockTrips) - lockTrips0, Conflicts: loadInt(b.Conflicts) - conflicts0}
	var err error
	if b.Stop != nil {
		err = b.Stop()
	}
	srv.Shutdown()
	if err != nil {
		return BatchResult{}, err
	}
	if last := lastDone.Load(); last != 0 {
		r.Elapsed = time.Duration(last - firstCall.Load())
		r.Drain = time.Unix(0, last).Sub(start)
	}
	return r, ctx.Err()
}

func load(h *RoundTrips) int64 {
	if h == nil {
		return 0
	}
	return h.Load()
}

func loadInt(n *atomic.Int64) int64 {
	if n == nil {
		return 0
	}
	return n.Load()
}

// Enqueue puts tasks tasks of type "bench:task" and payload(i) on qname, from 8
// goroutines.
func Enqueue(ctx context.Context, rdb *redis.Client, qname string, tasks int, payload func(i int) []byte) error {
	c := asynq.NewClientFromRedisClient(rdb)
	defer c.Close() // does not close rdb: the connection is shared
	return Parallel(8, tasks, func(i int) error {
		_, err := c.EnqueueContext(ctx, asynq.NewTask("bench:task", payload(i)), asynq.Queue(qname))
		return err
	})
}

// Parallel calls fn(i) for every i in [0, n) from workers goroutines, each taking
// the next i; a goroutine stops at its first error. It returns the errors joined.
func Parallel(workers, n int, fn func(i int) error) error {
	var (
		next  atomic.Int64
		wg    sync.WaitGroup
		mu    sync.Mutex
		first error
	)
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := int(next.Add(1)) - 1; i < n; i = int(next.Add(1)) - 1 {
				if err := fn(i); err != nil {
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

// DeleteQueue removes what asynq keeps of a queue, by a SCAN of its hash tag.
func DeleteQueue(rdb *redis.Client, qname string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var cursor uint64
	for range 1000 {
		keys, next, err := rdb.Scan(ctx, cursor, "asynq:{"+qname+"}*", 1000).Result()
		if err != nil {
			return err
		}
		if len(keys) > 0 {
			_ = rdb.Unlink(ctx, keys...).Err()
		}
		if cursor = next; cursor == 0 {
			break
		}
	}
	return rdb.SRem(ctx, "asynq:queues", qname).Err()
}
