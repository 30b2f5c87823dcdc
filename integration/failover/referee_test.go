//go:build linux

package failover

// The referee: a redis-server that no fault touches, which judges every critical
// section. Its checkers are those of integration/chaos (see its README), kept here in
// the small form this battery needs:
//
//   - occupancy: INCR occ:<k> on entry must return 1, DECR on exit; an entry that finds
//     the section taken is an overlap;
//   - lost updates: GET cnt:<k>, sleep, SET cnt:<k> v+1, and the completed increment
//     counted atomically in done:<k>; done - cnt is the updates an overlap overwrote;
//   - fenced writes: the resource accepts a write only with a fence above the last
//     accepted one (or equal to it, from the same holder); each section writes on
//     entry and before it leaves, and a rejected write is stale.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"golang.org/x/sys/unix"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
)

// now is CLOCK_MONOTONIC in nanoseconds: the same in every process on the machine, so
// the workers' grants and the parent's fault times share one timeline.
func now() int64 {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		panic(fmt.Sprintf("clock_gettime(CLOCK_MONOTONIC): %v", err))
	}
	return ts.Nano()
}

// refereeTimeout bounds every referee command; the referee is never faulted, so a
// command that takes this long is a broken harness.
const refereeTimeout = 10 * time.Second

func refCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), refereeTimeout)
}

// referee keys, per lock key k.
func occKey(k string) string      { return "occ:" + k }
func overlapsKey(k string) string { return "overlaps:" + k }
func counterKey(k string) string  { return "cnt:" + k }
func doneKey(k string) string     { return "done:" + k }
func fenceKey(k string) string    { return "fence:" + k }
func acceptedKey(k string) string { return "accepted:" + k }
func staleKey(k string) string    { return "stale:" + k }

// stopKey, once set, tells the workers to finish their current section and exit.
const stopKey = "stop"

// fencedWriteScript is the resource the fence protects.
//
// KEYS[1] -> fence:<k>     hash {f: last accepted fence, w: its writer}
// KEYS[2] -> accepted:<k>  counter
// KEYS[3] -> stale:<k>     counter
// ARGV[1] -> fence, ARGV[2] -> writer
// Returns 1 when accepted, 0 when rejected as stale. Fences stay below 2^53.
var fencedWriteScript = redis.NewScript(`
local last = redis.call('HMGET', KEYS[1], 'f', 'w')
local f = tonumber(ARGV[1])
local lf = tonumber(last[1] or '0')
if f > lf or (f == lf and last[2] == ARGV[2]) then
  redis.call('HSET', KEYS[1], 'f', ARGV[1], 'w', ARGV[2])
  redis.call('INCR', KEYS[2])
  return 1
end
redis.call('INCR', KEYS[3])
return 0
`)

// referee is a client of the referee redis-server.
type referee struct{ rdb *redis.Client }

// startReferee starts the referee redis-server for the test.
func startReferee(t testing.TB) (*referee, string) {
	t.Helper()
	s := redistest.Start(t)
	return &referee{rdb: s.Client(t)}, s.Addr()
}

func (r *referee) fencedWrite(ctx context.Context, k string, fence int64, writer string) (bool, error) {
	n, err := fencedWriteScript.Run(ctx, r.rdb, []string{fenceKey(k), acceptedKey(k), staleKey(k)}, fence, writer).Int64()
	if err != nil {
		return false, fmt.Errorf("referee: fenced write on %s: %w", k, err)
	}
	return n == 1, nil
}

// sectionResult is what one checked critical section saw.
type sectionResult struct {
	Entered     int64 // now()
	Overlap     bool  // occ:k was already taken on entry
	Interrupted bool  // fn's context ended (the lease was lost) before the SET
	Writes      int   // fenced writes offered
	Stale       int   // fenced writes rejected
}

// section is the checked critical section, run while holding the lock on k with
// fence: take occupancy, a fenced write, the racy increment (GET, sleep gap, SET,
// counted in done:k), a second fenced write, leave. A cancelled ctx cuts the sleep
// short and skips the SET and the second write, as a holder that stops when told
// its lease is lost would. Referee errors are returned: they are harness failures.
func (r *referee) section(ctx context.Context, k string, fence int64, writer string, gap time.Duration) (res sectionResult, err error) {
	rctx, cancel := refCtx(ctx)
	defer cancel()
	res.Entered = now()
	n, err := r.rdb.Incr(rctx, occKey(k)).Result()
	if err != nil {
		return res, fmt.Errorf("referee: enter %s: %w", k, err)
	}
	defer func() {
		if derr := r.rdb.Decr(rctx, occKey(k)).Err(); derr != nil && err == nil {
			err = fmt.Errorf("referee: leave %s: %w", k, derr)
		}
	}()
	if n != 1 {
		res.Overlap = true
		if err := r.rdb.Incr(rctx, overlapsKey(k)).Err(); err != nil {
			return res, fmt.Errorf("referee: count overlap on %s: %w", k, err)
		}
	}
	write := func() error {
		ok, err := r.fencedWrite(rctx, k, fence, writer)
		if err != nil {
			return err
		}
		res.Writes++
		if !ok {
			res.Stale++
		}
		return nil
	}
	if err := write(); err != nil {
		return res, err
	}
	v, err := r.rdb.Get(rctx, counterKey(k)).Int64()
	if err != nil && !errors.Is(err, redis.Nil) {
		return res, fmt.Errorf("referee: read counter %s: %w", k, err)
	}
	timer := time.NewTimer(gap)
	select {
	case <-timer.C:
	case <-ctx.Done():
		timer.Stop()
		res.Interrupted = true
		return res, nil
	}
	if _, err := r.rdb.TxPipelined(rctx, func(p redis.Pipeliner) error {
		p.Set(rctx, counterKey(k), v+1, 0)
		p.Incr(rctx, doneKey(k))
		return nil
	}); err != nil {
		return res, fmt.Errorf("referee: write counter %s: %w", k, err)
	}
	return res, write()
}

// stopped reports whether the parent has asked the workers to stop.
func (r *referee) stopped(ctx context.Context) (bool, error) {
	rctx, cancel := refCtx(ctx)
	defer cancel()
	n, err := r.rdb.Exists(rctx, stopKey).Result()
	return n == 1, err
}

// tally is what the checkers counted on the referee over a set of keys.
type tally struct {
	Overlaps  int64 // entries that found another holder in the section
	Completed int64 // increments completed, counted atomically
	Lost      int64 // increments another section overwrote
	Accepted  int64 // fenced writes accepted
	Stale     int64 // fenced writes rejected: a fence below one already accepted
}

func (a tally) String() string {
	return fmt.Sprintf("overlaps=%d lost-updates=%d stale-writes=%d (accepted %d, increments %d)",
		a.Overlaps, a.Lost, a.Stale, a.Accepted, a.Completed)
}

func (r *referee) tally(t testing.TB, keys []string) tally {
	t.Helper()
	ctx, cancel := refCtx(context.Background())
	defer cancel()
	var total tally
	for _, k := range keys {
		vals, err := r.rdb.MGet(ctx, overlapsKey(k), doneKey(k), counterKey(k), acceptedKey(k), staleKey(k)).Result()
		if err != nil {
			t.Fatalf("referee: tally %s: %v", k, err)
		}
		n := make([]int64, len(vals))
		for i, v := range vals {
			if s, ok := v.(string); ok {
				n[i], _ = strconv.ParseInt(s, 10, 64)
			}
		}
		total.Overlaps += n[0]
		total.Completed += n[1]
		total.Lost += max(n[1]-n[2], 0)
		total.Accepted += n[3]
		total.Stale += n[4]
	}
	return total
}

// hold is the sleep between the counter's GET and SET, drawn between within[0] and
// within[1]; by default 1-3 ms: wide enough that an overlap loses updates, short
// against every lease. A hold longer than a third of the lease spans renewals.
func hold(rng *rand.Rand, within [2]time.Duration) time.Duration {
	if within[1] <= within[0] {
		within = [2]time.Duration{time.Millisecond, 3 * time.Millisecond}
	}
	return within[0] + time.Duration(rng.Int64N(int64(within[1]-within[0])))
}
