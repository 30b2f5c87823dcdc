package mutex

import (
	"context"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex/internal/benchkit"
	"github.com/asynqmutex/asynqmutex/internal/redistest"
)

// Benchmarks against a real redis-server on 127.0.0.1, the one sharedServer starts.
// Figures only mean something next to the floor measured in the same run on the
// same server: compare BenchmarkTryLockUnlock with BenchmarkFloorSetNXDel, and
// each "lock" sub-benchmark with its "floor" sibling. No benchmark asserts a time.
//
//	go test -bench . -run '^$' -count 3 ./mutex
//
// bench/ ((cd bench && go run .)) measures the same scenarios interleaved and prints the
// ratios against the goals.

const (
	benchTTL = 30 * time.Second

	// benchBound bounds every benchmark round in time, so a lost wake-up or a dead
	// server fails the benchmark instead of hanging it.
	benchBound = 2 * time.Minute
)

// benchRedis returns a client of the package's shared redis-server, skipping the
// benchmark as sharedServer skips a test when no redis-server is installed.
func benchRedis(b *testing.B, hooks ...redis.Hook) *redis.Client {
	b.Helper()
	serverOnce.Do(func() { server, serverErr = redistest.StartProcess() })
	if serverErr != nil {
		redistest.Start(b) // skips, or fails under CI, like the tests
		b.Fatalf("redis-server: %v", serverErr)
	}
	rdb := redis.NewClient(&redis.Options{Addr: server.Addr()})
	for _, h := range hooks {
		rdb.AddHook(h)
	}
	b.Cleanup(func() { rdb.Close() })
	if err := rdb.Ping(context.Background()).Err(); err != nil {
		b.Fatalf("ping: %v", err)
	}
	return rdb
}

// benchClient is a Client of its own connection pool to the shared server. When the
// benchmark ends it waits (at most 2s) for the Client's subscription connection to
// close after its linger, so that closing the pool does not break it under a read.
func benchClient(b *testing.B, hooks ...redis.Hook) *Client {
	c := New(benchRedis(b, hooks...))
	b.Cleanup(func() { // runs before benchRedis's Close
		for deadline := time.Now().Add(2 * time.Second); time.Now().Before(deadline); {
			c.hub.mu.Lock()
			idle := c.hub.cur == nil
			c.hub.mu.Unlock()
			if idle {
				return
			}
			time.Sleep(5 * time.Millisecond)
		}
	})
	return c
}

// benchCtx bounds one benchmark round.
func benchCtx(b *testing.B) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), benchBound)
	b.Cleanup(cancel)
	return ctx
}

// benchKey is a key no other benchmark or test uses.
func benchKey(b *testing.B, i int) string {
	return "bench:" + strings.ReplaceAll(b.Name(), "/", ":") + ":" + strconv.Itoa(i)
}

// BenchmarkFloorSetNXDel is the floor the lock is measured against: the two round
// trips of the simplest Redis lock, SET key token NX PX 30000 and DEL key.
func BenchmarkFloorSetNXDel(b *testing.B) {
	rdb := benchRedis(b)
	ctx := benchCtx(b)
	key, tok := benchKey(b, 0), newToken()
	b.ResetTimer()
	for range b.N {
		if ok, err := benchkit.SetNX(ctx, rdb, key, tok, benchTTL); err != nil || !ok {
			b.Fatalf("SET NX: %v (set: %v)", err, ok)
		}
		if err := rdb.Del(ctx, key).Err(); err != nil {
			b.Fatalf("DEL: %v", err)
		}
	}
}

// BenchmarkTryLockUnlock is TryLock and Unlock of a free key, one after the other:
// the goal is at most 1.1 times BenchmarkFloorSetNXDel.
func BenchmarkTryLockUnlock(b *testing.B) {
	c := benchClient(b)
	ctx := benchCtx(b)
	key := benchKey(b, 0)
	l, err := c.TryLock(ctx, key, benchTTL) // loads the scripts
	if err != nil {
		b.Fatal(err)
	}
	_ = l.Unlock(ctx)
	b.ResetTimer()
	for range b.N {
		l, err := c.TryLock(ctx, key, benchTTL)
		if err != nil {
			b.Fatalf("TryLock: %v", err)
		}
		if err := l.Unlock(ctx); err != nil {
			b.Fatalf("Unlock: %v", err)
		}
	}
}

// BenchmarkHandoff measures, per handoff, the time from just before the holder
// releases to the moment a waiter blocked on the key holds it, and reports its median
// and 99th percentile (the goal: median below 1ms on loopback). Each handoff waits
// first until the waiter is blocked: its attempt failed and queued it in the key's
// wait queue, and its Client's wake-up channel is subscribed (see benchkit.WaitBlocked).
//
// The floor is the least a wake-on-release lock can do: the holder sends DEL and
// PUBLISH in one round trip, and the waiter, already subscribed, takes the key
// with SET NX when the message arrives. The lock does the same work in scripts: the
// release pops the waiter from the key's wait queue and publishes to its Client's
// channel; the woken waiter's attempt takes the key and leaves the queue.
func BenchmarkHandoff(b *testing.B) {
	b.Run("floor", func(b *testing.B) {
		rdb := benchRedis(b)
		waiterRdb := benchRedis(b)
		ctx := benchCtx(b)
		key := benchKey(b, 0)
		ps := waiterRdb.Subscribe(ctx, key)
		if _, err := ps.Receive(ctx); err != nil { // the subscription's confirmation
			b.Fatal(err)
		}
		if err := rdb.Set(ctx, key, "holder", benchTTL).Err(); err != nil {
			b.Fatal(err)
		}
		got := make(chan time.Time, 1)
		var wg sync.WaitGroup
		defer func() {
			// "stop" ends the reader, which then closes the subscription: closing it
			// under a blocked read would make go-redis log a bad connection.
			_ = rdb.Publish(context.Background(), key, "stop").Err()
			wg.Wait()
		}()
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer ps.Close()
			for {
				m, err := ps.ReceiveMessage(ctx)
				if err != nil || m.Payload == "stop" {
					return
				}
				if ok, err := benchkit.SetNX(ctx, waiterRdb, key, "waiter", benchTTL); err != nil || !ok {
					b.Errorf("waiter SET NX: %v (set: %v)", err, ok)
				}
				got <- time.Now()
			}
		}()
		samples := make([]time.Duration, 0, b.N)
		b.ResetTimer()
		for range b.N {
			t0 := time.Now()
			if _, err := rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
				p.Del(ctx, key)
				p.Publish(ctx, key, "")
				return nil
			}); err != nil {
				b.Fatal(err)
			}
			select {
			case t1 := <-got:
				samples = append(samples, t1.Sub(t0))
			case <-ctx.Done():
				b.Fatal("no handoff before the bound")
			}
		}
		b.StopTimer()
		reportHandoff(b, samples)
	})

	b.Run("lock", func(b *testing.B) {
		var hooks [2]benchkit.AttemptCounter
		clients := [2]*Client{benchClient(b, &hooks[0]), benchClient(b, &hooks[1])}
		stats := benchRedis(b) // polled while a waiter blocks: no traffic on its pool
		ctx := benchCtx(b)
		key := benchKey(b, 0)
		held, err := clients[0].TryLock(ctx, key, benchTTL)
		if err != nil {
			b.Fatal(err)
		}
		type acquired struct {
			l   *Lock
			at  time.Time
			err error
		}
		samples := make([]time.Duration, 0, b.N)
		b.ResetTimer()
		for i := range b.N {
			b.StopTimer()
			w := (i + 1) % 2 // the waiter's client; the holder used the other one
			before := hooks[w].Attempts.Load()
			got := make(chan acquired, 1)
			go func() {
				l, err := clients[w].Lock(ctx, key, benchTTL)
				got <- acquired{l, time.Now(), err}
			}()
			c := clients[w]
			if err := benchkit.WaitBlocked(ctx, &hooks[w], before, stats, c.prefix, c.redisKey(key)); err != nil {
				b.Fatal(err)
			}
			b.StartTimer()
			t0 := time.Now()
			if err := held.Unlock(ctx); err != nil {
				b.Fatalf("Unlock: %v", err)
			}
			a := <-got
			if a.err != nil {
				b.Fatalf("Lock: %v", a.err)
			}
			samples = append(samples, a.at.Sub(t0))
			held = a.l
		}
		b.StopTimer()
		_ = held.Unlock(ctx)
		reportHandoff(b, samples)
	})
}

func reportHandoff(b *testing.B, samples []time.Duration) {
	if len(samples) == 0 {
		return
	}
	p50, p99 := benchkit.Percentiles(samples)
	b.ReportMetric(float64(p50), "ns/handoff-p50")
	b.ReportMetric(float64(p99), "ns/handoff-p99")
	b.ReportMetric(0, "ns/op") // the loop also waits for the waiter to block
}

// BenchmarkContended8x1Key runs 8 goroutines taking and releasing one key, and
// reports acquisitions per second and the commands clients sent per acquisition
// (goal: at most 3). "lock" shares one Client, as the goroutines of one process do;
// "lock-8clients" gives each goroutine its own, as 8 processes would; "floor" is a
// SET NX/DEL spin lock sleeping 500µs after "not set".
func BenchmarkContended8x1Key(b *testing.B) {
	benchContended(b, 1)
}

// BenchmarkContended8x1000Keys is BenchmarkContended8x1Key on a key chosen at random
// among 1,000 at each iteration: little contention, so the goal is the floor's rate.
func BenchmarkContended8x1000Keys(b *testing.B) {
	benchContended(b, 1000)
}

func benchContended(b *testing.B, keys int) {
	const workers = 8
	b.Run("floor", func(b *testing.B) {
		rdb := benchRedis(b)
		ctx := benchCtx(b)
		var failed atomic.Int64
		runContended(b, ctx, rdb, benchkit.FloorCommands, workers, func(i int) error {
			return benchkit.SpinLock(ctx, rdb, benchKey(b, rand.N(keys)), newToken(), benchTTL, &failed)
		})
		b.ReportMetric(float64(failed.Load())/float64(b.N), "fails/acq")
	})
	lock := func(b *testing.B, clients int) {
		hook := new(benchkit.AttemptCounter)
		cs := make([]*Client, clients)
		for i := range cs {
			cs[i] = benchClient(b, hook)
		}
		ctx := benchCtx(b)
		l, err := cs[0].TryLock(ctx, benchKey(b, 0), benchTTL) // loads the scripts
		if err != nil {
			b.Fatal(err)
		}
		_ = l.Unlock(ctx)
		hook.Attempts.Store(0)
		hook.Failed.Store(0)
		runContended(b, ctx, benchRedis(b), benchkit.LockCommands, workers, func(i int) error {
			l, err := cs[i%clients].Lock(ctx, benchKey(b, rand.N(keys)), benchTTL)
			if err != nil {
				return err
			}
			return l.Unlock(ctx)
		})
		b.ReportMetric(float64(hook.Failed.Load())/float64(b.N), "fails/acq")
	}
	b.Run("lock", func(b *testing.B) { lock(b, 1) })
	if keys == 1 {
		b.Run("lock-8clients", func(b *testing.B) { lock(b, workers) })
	}
}

// runContended runs b.N calls of acquire over workers goroutines and reports
// acquisitions per second and the calls of cmds per acquisition.
func runContended(b *testing.B, ctx context.Context, stats *redis.Client, cmds []string, workers int, acquire func(worker int) error) {
	before, err := benchkit.CommandStats(ctx, stats, cmds)
	if err != nil {
		b.Fatal(err)
	}
	var next atomic.Int64
	b.ResetTimer()
	wait := benchkit.StartWorkers(workers, func() bool { return next.Add(1) <= int64(b.N) && ctx.Err() == nil }, acquire)
	err = wait()
	b.StopTimer()
	if err != nil {
		b.Fatal(err)
	}
	after, err := benchkit.CommandStats(ctx, stats, cmds)
	if err != nil {
		b.Fatal(err)
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "acq/s")
	b.ReportMetric(float64(after.Calls-before.Calls)/float64(b.N), "cmds/acq")
}

// BenchmarkLimitServerTime is TryLock and Unlock of a free slot of a key held with
// Limit(n) by n-1 others, next to a plain lock's: it reports the Redis server time
// per TryLock+Unlock spent in the scripts (server-µs/op) and the commands Redis ran
// for it, the scripts' own included (cmds/op), from INFO commandstats. Every step of
// Limit(n) reads all holders, so server-µs/op grows with n.
func BenchmarkLimitServerTime(b *testing.B) {
	for _, n := range []int{1, 4, 200} {
		b.Run("limit="+strconv.Itoa(n), func(b *testing.B) {
			c := benchClient(b)
			rdb := c.rdb.(*redis.Client)
			ctx := benchCtx(b)
			key := benchKey(b, 0) + ":" + newToken() // the framework runs this more than once
			for range n - 1 {
				if _, err := c.TryLock(ctx, key, benchBound, Limit(n)); err != nil {
					b.Fatalf("holder: %v", err)
				}
			}
			cycle := func() {
				l, err := c.TryLock(ctx, key, benchTTL, Limit(n))
				if err != nil {
					b.Fatalf("TryLock: %v", err)
				}
				if err := l.Unlock(ctx); err != nil {
					b.Fatalf("Unlock: %v", err)
				}
			}
			cycle() // loads the scripts
			before, err := benchkit.CommandStatsByName(ctx, rdb)
			if err != nil {
				b.Fatal(err)
			}
			b.ResetTimer()
			for range b.N {
				cycle()
			}
			b.StopTimer()
			after, err := benchkit.CommandStatsByName(ctx, rdb)
			if err != nil {
				b.Fatal(err)
			}
			var calls, usec int64
			for cmd, st := range after {
				if cmd == "info" {
					continue
				}
				d := st.Sub(before[cmd])
				calls += d.Calls
				if cmd == "fcall" || cmd == "evalsha" || cmd == "eval" {
					usec += d.Usec
				}
			}
			b.ReportMetric(float64(usec)/float64(b.N), "server-µs/op")
			b.ReportMetric(float64(calls)/float64(b.N), "cmds/op")
		})
	}
}

// BenchmarkWaitReplicas is BenchmarkTryLockUnlock on a master with one replica on
// loopback, started for it: "off" without WaitReplicas, "wait1" with
// WaitReplicas(1, 1s). The difference is the cost of the wait per lock (the release
// does not wait).
func BenchmarkWaitReplicas(b *testing.B) {
	master := redistest.Start(b)
	redistest.StartReplica(b, master)
	for _, bc := range []struct {
		name string
		opts []Option
	}{{"off", nil}, {"wait1", []Option{WaitReplicas(1, time.Second)}}} {
		b.Run(bc.name, func(b *testing.B) {
			c := New(master.Client(b), bc.opts...)
			b.Cleanup(func() { _ = c.Close() })
			ctx := benchCtx(b)
			key := benchKey(b, 0)
			l, err := c.TryLock(ctx, key, benchTTL) // loads the scripts
			if err != nil {
				b.Fatal(err)
			}
			_ = l.Unlock(ctx)
			b.ResetTimer()
			for range b.N {
				l, err := c.TryLock(ctx, key, benchTTL)
				if err != nil {
					b.Fatalf("TryLock: %v", err)
				}
				if err := l.Unlock(ctx); err != nil {
					b.Fatalf("Unlock: %v", err)
				}
			}
		})
	}
}
