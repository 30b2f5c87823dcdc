package mutex

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
)

// Benchmarks against a real redis-server on 127.0.0.1, the one sharedServer starts.
// Figures only mean something next to the floor measured in the same run on the
// same server: compare BenchmarkTryLockUnlock with BenchmarkFloorSetNXDel, and
// each "lock" sub-benchmark with its "floor" sibling. No benchmark asserts a time.
//
//	go test -bench . -run '^$' -count 3 ./mutex
//
// bench/ (go run ./bench) measures the same scenarios interleaved and prints the
// ratios against the goals.

const (
	benchTTL = 30 * time.Second

	// benchBound bounds every benchmark round in time, so a lost wake-up or a dead
	// server fails the benchmark instead of hanging it.
	benchBound = 2 * time.Minute

	// floorRetry is how long the floor's spin lock sleeps after "not set".
	floorRetry = 500 * time.Microsecond
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

// clientCommands are the commands a mutex.Client sends itself. INFO commandstats also
// counts the commands scripts run (SET, DEL, PUBLISH...), so those cannot be
// attributed to the client; the lock never sends them directly.
var clientCommands = []string{"evalsha", "eval", "script", "subscribe", "unsubscribe", "ping"}

// floorCommands are the commands the raw SET NX/DEL floor sends.
var floorCommands = []string{"set", "del"}

// commandCalls sums the calls of cmds in the server's INFO commandstats.
func commandCalls(ctx context.Context, rdb *redis.Client, cmds []string) (int64, error) {
	info, err := rdb.Info(ctx, "commandstats").Result()
	if err != nil {
		return 0, err
	}
	var sum int64
	for _, line := range strings.Split(info, "\n") {
		name, rest, ok := strings.Cut(strings.TrimSpace(line), ":")
		if !ok || !slices.Contains(cmds, strings.TrimPrefix(name, "cmdstat_")) {
			continue
		}
		calls, _, _ := strings.Cut(strings.TrimPrefix(rest, "calls="), ",")
		n, err := strconv.ParseInt(calls, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("commandstats line %q: %w", line, err)
		}
		sum += n
	}
	return sum, nil
}

// attemptCounter is a go-redis hook counting lock.lua runs and those that found the
// key held by someone else.
type attemptCounter struct{ attempts, failed atomic.Int64 }

var _ redis.Hook = (*attemptCounter)(nil)

func (h *attemptCounter) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *attemptCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *attemptCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		args := cmd.Args()
		if len(args) < 2 || (args[1] != lockScript.Hash() && args[1] != lockLua) {
			return err
		}
		h.attempts.Add(1)
		if c, ok := cmd.(*redis.Cmd); ok {
			if res, rerr := c.Int64Slice(); rerr == nil && len(res) == 2 && res[0] == 0 {
				h.failed.Add(1)
			}
		}
		return err
	}
}

// BenchmarkFloorSetNXDel is the floor the lock is measured against: the two round
// trips of the simplest Redis lock, SET key token NX PX 30000 and DEL key.
func BenchmarkFloorSetNXDel(b *testing.B) {
	rdb := benchRedis(b)
	ctx := benchCtx(b)
	key, tok := benchKey(b, 0), newToken()
	b.ResetTimer()
	for range b.N {
		if err := rdb.Do(ctx, "set", key, tok, "nx", "px", benchTTL.Milliseconds()).Err(); err != nil {
			b.Fatalf("SET NX: %v", err)
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
// wait queue, and its Client's wake-up channel is subscribed (see waitBlocked).
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
				if err := waiterRdb.Do(ctx, "set", key, "waiter", "nx", "px", benchTTL.Milliseconds()).Err(); err != nil {
					b.Errorf("waiter SET NX: %v", err)
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
		var hooks [2]attemptCounter
		clients := [2]*Client{benchClient(b, &hooks[0]), benchClient(b, &hooks[1])}
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
			before := hooks[w].attempts.Load()
			got := make(chan acquired, 1)
			go func() {
				l, err := clients[w].Lock(ctx, key, benchTTL)
				got <- acquired{l, time.Now(), err}
			}()
			if err := waitBlocked(ctx, clients[w], &hooks[w], before, clients[w].redisKey(key)); err != nil {
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

// waitBlocked returns once the waiter that Client c runs for rkey is blocked in Lock:
// c made at least one attempt since before (h counts them), that attempt queued the
// waiter in rkey's wait queue, c's subscription to its wake-up channel is confirmed,
// and c has made no further attempt for 2ms since then. A waiter whose Client was
// subscribed when it joined blocks after one failed attempt; one that joined before
// the confirmation makes one more attempt after it, which the 2ms of quiet wait out.
func waitBlocked(ctx context.Context, c *Client, h *attemptCounter, before int64, rkey string) error {
	const quiet = 2 * time.Millisecond
	deadline := time.Now().Add(5 * time.Second)
	last, since := int64(-1), time.Time{} // attempts seen, and since when nothing changed
	wasReady := false
	for time.Now().Before(deadline) && ctx.Err() == nil {
		n := h.attempts.Load() - before
		c.hub.mu.Lock()
		ready := c.hub.cur != nil && isClosed(c.hub.cur.ready)
		c.hub.mu.Unlock()
		if n != last || ready != wasReady {
			last, wasReady, since = n, ready, time.Now()
		}
		if n >= 1 && ready && time.Since(since) > quiet {
			queued, err := c.rdb.ZCard(ctx, rkey+waitSuffix).Result()
			if err != nil {
				return err
			}
			if queued >= 1 {
				return nil
			}
		}
		time.Sleep(20 * time.Microsecond)
	}
	return fmt.Errorf("the waiter did not block within 5s (%d attempts)", h.attempts.Load()-before)
}

func reportHandoff(b *testing.B, samples []time.Duration) {
	if len(samples) == 0 {
		return
	}
	slices.Sort(samples)
	b.ReportMetric(float64(samples[len(samples)/2]), "ns/handoff-p50")
	b.ReportMetric(float64(samples[(len(samples)*99)/100]), "ns/handoff-p99")
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
		runContended(b, ctx, rdb, floorCommands, workers, func(i int) error {
			key, tok := benchKey(b, rand.N(keys)), newToken()
			for {
				err := rdb.Do(ctx, "set", key, tok, "nx", "px", benchTTL.Milliseconds()).Err()
				if err == nil {
					break
				}
				if !errors.Is(err, redis.Nil) {
					return err
				}
				failed.Add(1)
				t := time.NewTimer(floorRetry)
				select {
				case <-t.C:
				case <-ctx.Done():
					t.Stop()
					return ctx.Err()
				}
			}
			return rdb.Del(ctx, key).Err()
		})
		b.ReportMetric(float64(failed.Load())/float64(b.N), "fails/acq")
	})
	lock := func(b *testing.B, clients int) {
		hook := new(attemptCounter)
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
		hook.attempts.Store(0)
		hook.failed.Store(0)
		runContended(b, ctx, benchRedis(b), clientCommands, workers, func(i int) error {
			l, err := cs[i%clients].Lock(ctx, benchKey(b, rand.N(keys)), benchTTL)
			if err != nil {
				return err
			}
			return l.Unlock(ctx)
		})
		b.ReportMetric(float64(hook.failed.Load())/float64(b.N), "fails/acq")
	}
	b.Run("lock", func(b *testing.B) { lock(b, 1) })
	if keys == 1 {
		b.Run("lock-8clients", func(b *testing.B) { lock(b, workers) })
	}
}

// runContended runs b.N calls of acquire over workers goroutines and reports
// acquisitions per second and the calls of cmds per acquisition.
func runContended(b *testing.B, ctx context.Context, stats *redis.Client, cmds []string, workers int, acquire func(worker int) error) {
	before, err := commandCalls(ctx, stats, cmds)
	if err != nil {
		b.Fatal(err)
	}
	var (
		next    atomic.Int64
		wg      sync.WaitGroup
		errOnce sync.Once
		first   error
	)
	b.ResetTimer()
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for next.Add(1) <= int64(b.N) && ctx.Err() == nil {
				if err := acquire(w); err != nil {
					errOnce.Do(func() { first = err })
					return
				}
			}
		}()
	}
	wg.Wait()
	b.StopTimer()
	if first != nil {
		b.Fatal(first)
	}
	after, err := commandCalls(ctx, stats, cmds)
	if err != nil {
		b.Fatal(err)
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "acq/s")
	b.ReportMetric(float64(after-before)/float64(b.N), "cmds/acq")
}
