// Package benchkit holds what the two sets of benchmarks of this module share: the
// bench program (bench/, a module of its own), which measures the lock and the
// middleware side by side with their peers and prints ratios, and the Go benchmarks
// (mutex/bench_test.go, bench_test.go).
//
// It needs only go-redis and asynq, never package mutex: mutex/bench_test.go is an
// internal test of package mutex, which cannot import a package that imports mutex.
// So it recognises a lock attempt by its reply, not by its script (AttemptCounter),
// and the wait queue and wake-up channel by their documented names (WaitBlocked).
package benchkit

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// LockCommands are the commands a mutex.Client sends itself: its steps by FCALL, or
// by EVALSHA where the server has no functions, and what loads them. INFO
// commandstats also counts the commands that scripts run (SET, DEL, PUBLISH...),
// which cannot be told apart from sent ones, but the lock never sends those directly.
var LockCommands = []string{"fcall", "function", "evalsha", "eval", "script", "subscribe", "unsubscribe", "ping"}

// FloorCommands are the commands the raw SET NX/DEL floor sends.
var FloorCommands = []string{"set", "del"}

// FloorRetry is how long the floor's spin lock (SpinLock) sleeps after "not set".
const FloorRetry = 500 * time.Microsecond

// CmdStats is a sum over some commands of INFO commandstats: calls, and the
// microseconds the server spent running them (for a script, the whole script).
type CmdStats struct{ Calls, Usec int64 }

// Sub is a - b.
func (a CmdStats) Sub(b CmdStats) CmdStats { return CmdStats{a.Calls - b.Calls, a.Usec - b.Usec} }

// CommandStats sums the INFO commandstats of cmds (lower case, as in LockCommands).
func CommandStats(ctx context.Context, rdb *redis.Client, cmds []string) (CmdStats, error) {
	all, err := CommandStatsByName(ctx, rdb)
	if err != nil {
		return CmdStats{}, err
	}
	var sum CmdStats
	for _, name := range cmds {
		sum.Calls += all[name].Calls
		sum.Usec += all[name].Usec
	}
	return sum, nil
}

// CommandStatsByName is INFO commandstats: the calls and microseconds of every
// command the server has run, by lower-case name ("evalsha", "set", "info"...). The
// INFO that reads them is not among them yet; a later read counts it.
func CommandStatsByName(ctx context.Context, rdb *redis.Client) (map[string]CmdStats, error) {
	info, err := rdb.Info(ctx, "commandstats").Result()
	if err != nil {
		return nil, err
	}
	all := make(map[string]CmdStats)
	for _, line := range strings.Split(info, "\n") {
		name, rest, ok := strings.Cut(strings.TrimSpace(line), ":")
		if !ok || !strings.HasPrefix(name, "cmdstat_") {
			continue
		}
		var st CmdStats
		for _, field := range strings.Split(rest, ",") {
			k, v, _ := strings.Cut(field, "=")
			var dst *int64
			switch k {
			case "calls":
				dst = &st.Calls
			case "usec":
				dst = &st.Usec
			default:
				continue
			}
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				return nil, fmt.Errorf("commandstats line %q: %w", line, err)
			}
			*dst = n
		}
		all[strings.TrimPrefix(name, "cmdstat_")] = st
	}
	return all, nil
}

// RoundTrips is a go-redis hook counting round trips: each command or pipeline sent,
// counted when its reply (or error) has come back. Subscriptions' own traffic is not
// counted.
type RoundTrips struct{ n atomic.Int64 }

var _ redis.Hook = (*RoundTrips)(nil)

// Load is the number of round trips so far.
func (h *RoundTrips) Load() int64 { return h.n.Load() }

func (h *RoundTrips) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *RoundTrips) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		defer h.n.Add(1)
		return next(ctx, cmd)
	}
}
func (h *RoundTrips) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		defer h.n.Add(1)
		return next(ctx, cmds)
	}
}

// AttemptCounter is a go-redis hook on a mutex.Client's connection pool that counts
// lock attempts, and those that found the key held. It recognises a lock attempt by
// its reply, an array of integers no other step of package mutex returns: a plain
// lock's {fence} (one key) or {0, pttl, i} (busy), a slot's {fence, 0} or {0, ms}.
type AttemptCounter struct{ Attempts, Failed atomic.Int64 }

var _ redis.Hook = (*AttemptCounter)(nil)

func (h *AttemptCounter) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *AttemptCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *AttemptCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if name := cmd.Name(); name != "fcall" && name != "evalsha" && name != "eval" {
			return err
		}
		c, ok := cmd.(*redis.Cmd)
		if !ok {
			return err
		}
		if res, rerr := c.Int64Slice(); rerr == nil && len(res) >= 1 && len(res) <= 3 {
			h.Attempts.Add(1)
			if res[0] <= 0 {
				h.Failed.Add(1)
			}
		}
		return err
	}
}

// SetNX is the floor's lock attempt, SET key tok NX PX ttl: whether it set the key.
func SetNX(ctx context.Context, rdb *redis.Client, key, tok string, ttl time.Duration) (bool, error) {
	err := rdb.Do(ctx, "set", key, tok, "nx", "px", ttl.Milliseconds()).Err()
	if errors.Is(err, redis.Nil) {
		return false, nil
	}
	return err == nil, err
}

// SpinLock is one acquisition of the contended floor: SpinAcquire, then DEL.
func SpinLock(ctx context.Context, rdb *redis.Client, key, tok string, ttl time.Duration, failed *atomic.Int64) error {
	if err := SpinAcquire(ctx, rdb, key, tok, ttl, failed); err != nil {
		return err
	}
	return rdb.Del(ctx, key).Err()
}

// SpinAcquire is the floor's wait for a key: SetNX until it sets the key, sleeping
// FloorRetry after each "not set" (counted in failed, unless it is nil).
func SpinAcquire(ctx context.Context, rdb *redis.Client, key, tok string, ttl time.Duration, failed *atomic.Int64) error {
	for {
		ok, err := SetNX(ctx, rdb, key, tok, ttl)
		if err != nil || ok {
			return err
		}
		if failed != nil {
			failed.Add(1)
		}
		if err := Sleep(ctx, FloorRetry); err != nil {
			return err
		}
	}
}

// Sleep waits for d, or returns ctx's error if it is done first.
func Sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// StartWorkers starts n goroutines, each calling op(worker) for as long as more
// reports true, and returns a function that waits for them all and returns the
// errors of those that stopped on one (a worker stops at its first).
func StartWorkers(n int, more func() bool, op func(worker int) error) (wait func() error) {
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		first error // of every worker that failed
	)
	for w := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for more() {
				if err := op(w); err != nil {
					mu.Lock()
					first = errors.Join(first, err)
					mu.Unlock()
					return
				}
			}
		}()
	}
	return func() error {
		wg.Wait()
		return first
	}
}

// WaitBlocked returns once a waiter is blocked in Lock on the key whose Redis key is
// rkey: its Client, which counts its attempts in c (before is the count before it
// started), made at least one attempt; that attempt queued the waiter in rkey's wait
// queue (a list of "<client>.<waiter> <lease ms> <token>"); the Client's channel,
// <prefix>wake:<client>, is subscribed; and the Client has made no further attempt for
// 2ms since. A waiter whose Client was subscribed when it joined blocks after one
// failed attempt; one that joined before the confirmation makes one more attempt
// after it, which the 2ms of quiet wait out. stats is a client of its own, so the
// polling adds nothing to the waiter's pool.
func WaitBlocked(ctx context.Context, c *AttemptCounter, before int64, stats *redis.Client, prefix, rkey string) error {
	const quiet = 2 * time.Millisecond
	deadline := time.Now().Add(5 * time.Second)
	last, since := int64(-1), time.Time{} // attempts seen, and since when nothing changed
	wasReady := false
	for time.Now().Before(deadline) {
		if err := ctx.Err(); err != nil {
			return err
		}
		n := c.Attempts.Load() - before
		ready := false
		if n >= 1 {
			var err error
			if ready, err = queuedAndSubscribed(ctx, stats, prefix, rkey); err != nil {
				return err
			}
		}
		if n != last || ready != wasReady {
			last, wasReady, since = n, ready, time.Now()
		}
		if ready && time.Since(since) > quiet {
			return nil
		}
		time.Sleep(20 * time.Microsecond)
	}
	return fmt.Errorf("handoff: the waiter did not block within 5s (%d attempts)", c.Attempts.Load()-before)
}

// queuedAndSubscribed reports whether rkey's wait queue holds a waiter whose Client's
// wake-up channel has a subscriber.
func queuedAndSubscribed(ctx context.Context, stats *redis.Client, prefix, rkey string) (bool, error) {
	members, err := stats.LRange(ctx, rkey+":wait", 0, -1).Result()
	if err != nil || len(members) == 0 {
		return false, err
	}
	channels := make([]string, 0, len(members))
	for _, m := range members {
		client, _, _ := strings.Cut(m, ".")
		channels = append(channels, prefix+"wake:"+client)
	}
	subs, err := stats.PubSubNumSub(ctx, channels...).Result()
	if err != nil {
		return false, err
	}
	for _, ch := range channels {
		if subs[ch] > 0 {
			return true, nil
		}
	}
	return false, nil
}

// Percentiles are the median and the 99th percentile of samples, which it does not
// modify; zero for none.
func Percentiles(samples []time.Duration) (p50, p99 time.Duration) {
	if len(samples) == 0 {
		return 0, 0
	}
	s := slices.Sorted(slices.Values(samples))
	return s[len(s)/2], s[len(s)*99/100]
}
