package ratelimit_test

import (
	"context"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex/internal/rediskey"
	"github.com/asynqmutex/asynqmutex/internal/redistest"
	"github.com/asynqmutex/asynqmutex/ratelimit"
)

// lostReplyRig is a rate Redis, a proxy that loses replies in front of it, a client
// through the proxy (go-redis's default retries: it sends a command again when its
// reply is lost) and one straight to the server.
type lostReplyRig struct {
	proxy           *redistest.Proxy
	through, direct *redis.Client
}

func newLostReplyRig(t *testing.T) *lostReplyRig {
	t.Helper()
	srv := redistest.Start(t)
	r := &lostReplyRig{proxy: redistest.NewProxy(t, srv.Addr()), direct: srv.Client(t)}
	r.through = redis.NewClient(&redis.Options{Addr: r.proxy.Addr(), PoolSize: 16})
	t.Cleanup(func() { r.through.Close() })
	return r
}

// dropWhile loses one reply at a time, every period, while ctx lasts, and at most
// limit in all; the next loss is armed only once the last happened, so that no
// connection's handshake meets two in a row. It returns the replies lost.
func (r *lostReplyRig) dropWhile(ctx context.Context, period time.Duration, limit int) int {
	tick := time.NewTicker(period)
	defer tick.Stop()
	armed := 0
	for armed < limit {
		select {
		case <-ctx.Done():
			r.proxy.DropReplies(0)
			return r.proxy.Dropped()
		case <-tick.C:
		}
		if r.proxy.Dropped() == armed {
			r.proxy.DropReplies(1)
			armed++
		}
	}
	<-ctx.Done()
	r.proxy.DropReplies(0)
	return r.proxy.Dropped()
}

// scriptCalls is how many script calls (FCALL, EVALSHA, EVAL) the server has run.
func scriptCalls(t *testing.T, rdb *redis.Client) int64 {
	t.Helper()
	info, err := rdb.Info(context.Background(), "commandstats").Result()
	if err != nil {
		t.Fatal(err)
	}
	var n int64
	for _, line := range strings.Split(info, "\n") {
		for _, cmd := range []string{"cmdstat_fcall:", "cmdstat_evalsha:", "cmdstat_eval:"} {
			if rest, ok := strings.CutPrefix(strings.TrimSpace(line), cmd+"calls="); ok {
				v, _ := strconv.ParseInt(rest[:strings.IndexByte(rest, ',')], 10, 64)
				n += v
			}
		}
	}
	return n
}

// TestLostRepliesControl is the positive control: through the same proxy, an INCR
// whose reply is lost is sent again and counted twice, so the counting checker of
// TestLostReplies (counted in Redis == seen by the callers) trips on a limiter that
// is not idempotent.
func TestLostRepliesControl(t *testing.T) {
	t.Parallel()
	r := newLostReplyRig(t)
	ctx := context.Background()
	const calls, goroutines = 200, 4
	dctx, stop := context.WithCancel(ctx)
	dropped := make(chan int, 1)
	go func() { dropped <- r.dropWhile(dctx, 5*time.Millisecond, 10) }()
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		seen int64
		errs int
	)
	for range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range calls / goroutines {
				err := r.through.Incr(ctx, "counter").Err()
				mu.Lock()
				if err != nil {
					errs++
				} else {
					seen++
				}
				mu.Unlock()
				time.Sleep(time.Millisecond)
			}
		}()
	}
	wg.Wait()
	stop()
	lost := <-dropped
	counted, err := r.direct.Get(ctx, "counter").Int64()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("control, INCR through the proxy: %d replies lost, %d calls failed; counted %d, seen %d", lost, errs, counted, seen)
	if lost == 0 {
		t.Fatal("the proxy lost no reply")
	}
	if counted <= seen+int64(errs) {
		t.Errorf("INCR behind %d lost replies counted %d, seen %d (%d failed): go-redis did not send it again", lost, counted, seen, errs)
	}
}

// TestLostReplies: 8 goroutines take starts of one key with Reserve through a proxy
// that loses a reply every few intervals, go-redis sending each such call again.
// No double counting: the starts kept in Redis are exactly those the callers saw
// taken (a call that failed for good may have taken one unseen: those are bounded
// by the failures). No phantom allowance: the key's recorded TATs are an interval
// apart at least, and the moments the callers were given, bounded on their own clock
// by the call's sending and reply plus its delay, never put more than N in a window
// of Per. The server ran more script calls than the callers made: the resends.
func TestLostReplies(t *testing.T) {
	t.Parallel()
	r := newLostReplyRig(t)
	ctx := context.Background()
	lim := ratelimit.Rate{N: 50, Per: time.Second}
	iv := interval(lim)
	l := ratelimit.New(r.through)
	if _, err := l.Allow(ctx, "warm", lim); err != nil { // the library is loaded
		t.Fatal(err)
	}
	const goroutines = 8
	run := 2 * lim.Per
	key := "lost:a"
	before := scriptCalls(t, r.direct)

	dctx, stop := context.WithCancel(ctx)
	dropped := make(chan int, 1)
	go func() { dropped <- r.dropWhile(dctx, 3*iv, int(run/(3*iv))) }()
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		calls   int
		errs    []error
		limited int
		set     []span // the moments the callers were given, local µs since t0
	)
	t0 := time.Now()
	end := t0.Add(run)
	for range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < lim.N*int(run/lim.Per+1) && time.Now().Before(end); i++ {
				// Allow, and Reserves that accept 2 and 4 intervals: some are
				// limited, so that a call sent again after its first run took the
				// start must find it rather than answer "limited".
				maxWait := time.Duration(i%3) * 2 * iv
				sent := time.Now()
				res, err := l.Reserve(ctx, key, lim, maxWait)
				read := time.Now()
				mu.Lock()
				calls++
				switch {
				case err != nil:
					errs = append(errs, err)
				case !res.Allowed:
					limited++
				default:
					set = append(set, span{micros(sent.Sub(t0) + res.Delay), micros(read.Sub(t0)+res.Delay) + 1})
				}
				mu.Unlock()
				// Sleep until the start as Wait would, or until a start could come.
				time.Sleep(min(res.Delay, goroutines*iv))
			}
		}()
	}
	wg.Wait()
	stop()
	lost := <-dropped
	ran := scriptCalls(t, r.direct) - before

	st, err := ratelimit.New(r.direct).Inspect(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	tats := keyTATs(t, r.direct, key)
	t.Logf("%d goroutines, %d Reserve calls in %v: %d replies lost, the server ran %d script calls; %d starts seen taken, %d kept in Redis, %d limited; %d calls failed %v",
		goroutines, calls, run, lost, ran, len(set), st.Starts, limited, len(errs), errs)
	if lost == 0 || limited == 0 {
		t.Fatalf("%d replies lost, %d calls limited: the run tested nothing", lost, limited)
	}
	if int(ran) < calls+1 {
		t.Errorf("the server ran %d script calls for %d Reserve calls and %d lost replies: nothing was sent again", ran, calls, lost)
	}
	if st.Starts < len(set) || st.Starts > len(set)+len(errs) {
		t.Errorf("double counting: %d starts in Redis, %d seen taken, %d calls failed", st.Starts, len(set), len(errs))
	}
	if len(tats) != st.Starts {
		t.Errorf("%d TATs read, Inspect says %d starts", len(tats), st.Starts)
	}
	for i := 1; i < len(tats); i++ {
		if tats[i]-tats[i-1] < micros(iv) {
			t.Errorf("phantom allowance: starts %d and %d of the key are %d µs apart, less than the interval %v", i-1, i, tats[i]-tats[i-1], iv)
			break
		}
	}
	most, at := certainInWindow(set, micros(lim.Per))
	t.Logf("most moments given in a window of %v: %d (bound %d)", lim.Per, most, setBound(lim))
	if most > setBound(lim) {
		t.Errorf("phantom allowance: the callers were given %d moments in the window of %v from %d µs", most, lim.Per, at)
	}
	// Lost replies cost the callers go-redis's retry backoff, so this run's
	// throughput says nothing of the limiter; it must only have taken enough
	// starts to fill windows.
	if len(set) < lim.N {
		t.Errorf("%d starts in %v, fewer than the %d of one window: the run tested nothing", len(set), run, lim.N)
	}
}

// keyTATs reads the scores of a key's starts (their TATs, µs of the server's clock,
// see ratelimit/layout.go and docs/protocol.md), lowest first, without the pause.
func keyTATs(t *testing.T, rdb *redis.Client, key string) []int64 {
	t.Helper()
	zs, err := rdb.ZRangeWithScores(context.Background(), rateRedisKey(key), 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	var out []int64
	for _, z := range zs {
		if m, _ := z.Member.(string); m != "~pause" {
			out = append(out, -int64(z.Score)) // scores are minus the TATs
		}
	}
	slices.Sort(out)
	return out
}

// rateRedisKey is the Redis key of a rate key under the default prefix, as
// ratelimit/layout.go names it.
func rateRedisKey(key string) string {
	return ratelimit.DefaultPrefix + "rate:{" + rediskey.Encode(key) + "}"
}

// TestLostReplyCancelAndResumeReportTheTruth: Cancel and Resume are sent again by
// go-redis when their reply is lost, like every call. Their first run gives the
// start back, or ends the pause, and leaves a mark; the second finds the mark and
// answers as the first did, not "left the start taken" or "had no pause". (Without
// the marks both answered false here.)
func TestLostReplyCancelAndResumeReportTheTruth(t *testing.T) {
	t.Parallel()
	r := newLostReplyRig(t)
	ctx := context.Background()
	lim := ratelimit.PerSecond(10)
	through, direct := ratelimit.New(r.through), ratelimit.New(r.direct)
	if _, err := through.Allow(ctx, "warm", lim); err != nil { // the library is loaded
		t.Fatal(err)
	}

	res, err := through.Reserve(ctx, "gap:cancel", lim, time.Second)
	if err != nil || !res.Allowed {
		t.Fatalf("Reserve = %+v, %v", res, err)
	}
	r.proxy.DropReplies(1)
	ok, err := through.Cancel(ctx, "gap:cancel", res)
	st, ierr := direct.Inspect(ctx, "gap:cancel")
	if ierr != nil {
		t.Fatal(ierr)
	}
	t.Logf("Cancel behind a lost reply = %v, %v; starts kept: %d (%d replies lost)", ok, err, st.Starts, r.proxy.Dropped())
	if err != nil || ok != (st.Starts == 0) {
		t.Errorf("Cancel behind a lost reply = %v, %v, but the key keeps %d starts", ok, err, st.Starts)
	}

	if _, err := through.Pause(ctx, "gap:resume", lim, time.Minute); err != nil {
		t.Fatal(err)
	}
	r.proxy.DropReplies(1)
	had, err := through.Resume(ctx, "gap:resume")
	st, ierr = direct.Inspect(ctx, "gap:resume")
	if ierr != nil {
		t.Fatal(ierr)
	}
	t.Logf("Resume behind a lost reply = %v, %v; paused for %v (%d replies lost)", had, err, st.Paused, r.proxy.Dropped())
	if err != nil || (had != (st.Paused == 0)) {
		t.Errorf("Resume behind a lost reply = %v, %v, after a pause of a minute, now paused for %v", had, err, st.Paused)
	}
}
