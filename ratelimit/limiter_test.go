package ratelimit

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
)

// These tests take their times from the limit they test: a start every Per/N. A
// Delay is the server's answer, so they compare it with the spacing, allowing for
// the time the calls themselves took (measured, never assumed).

func TestAllowSpacesStarts(t *testing.T) {
	t.Parallel()
	l, ctx, key := New(sharedServer(t)), context.Background(), uniqueKey(t)
	lim := Rate{N: 4, Per: 2 * time.Second} // one start every 500ms
	start := time.Now()
	r, err := l.Allow(ctx, key, lim)
	if err != nil || !r.Allowed || r.Delay != 0 || r.Remaining != 0 {
		t.Fatalf("first Allow = %+v, %v; want allowed at once, 0 remaining", r, err)
	}
	r, err = l.Allow(ctx, key, lim)
	elapsed := time.Since(start)
	if err != nil || r.Allowed {
		t.Fatalf("second Allow = %+v, %v; want limited", r, err)
	}
	if r.Delay > 500*time.Millisecond || r.Delay < 500*time.Millisecond-elapsed {
		t.Errorf("second Allow's Delay = %v, want 500ms less the %v the calls took", r.Delay, elapsed)
	}
}

func TestBurst(t *testing.T) {
	t.Parallel()
	l, ctx, key := New(sharedServer(t)), context.Background(), uniqueKey(t)
	lim := Rate{N: 1, Per: time.Minute, Burst: 3}
	for i, want := range []int{2, 1, 0} {
		r, err := l.Allow(ctx, key, lim)
		if err != nil || !r.Allowed || r.Remaining != want {
			t.Fatalf("Allow #%d = %+v, %v; want allowed, %d remaining", i+1, r, err, want)
		}
	}
	r, err := l.Allow(ctx, key, lim)
	if err != nil || r.Allowed || r.Delay < 59*time.Second {
		t.Fatalf("Allow #4 = %+v, %v; want limited for about a minute", r, err)
	}
}

func TestReserveQueuesStarts(t *testing.T) {
	t.Parallel()
	l, ctx, key := New(sharedServer(t)), context.Background(), uniqueKey(t)
	lim := PerSecond(10) // every 100ms
	const n = 5
	start := time.Now()
	var got []time.Duration
	for range n {
		r, err := l.Reserve(ctx, key, lim, time.Second)
		if err != nil || !r.Allowed {
			t.Fatalf("Reserve = %+v, %v; want allowed", r, err)
		}
		got = append(got, r.Delay)
	}
	elapsed := time.Since(start)
	for i, d := range got {
		want := time.Duration(i) * 100 * time.Millisecond
		if d > want || d < want-elapsed {
			t.Errorf("Reserve #%d: Delay = %v, want %v less up to the %v the calls took", i+1, d, want, elapsed)
		}
	}
	r, err := l.Reserve(ctx, key, lim, 400*time.Millisecond)
	if err != nil || r.Allowed || r.Delay <= 400*time.Millisecond-elapsed {
		t.Errorf("Reserve beyond maxWait = %+v, %v; want limited, Delay about 500ms", r, err)
	}
}

func TestCancelGivesBackTheLatestStart(t *testing.T) {
	t.Parallel()
	l, ctx, key := New(sharedServer(t)), context.Background(), uniqueKey(t)
	lim := PerMinute(1)
	first, err := l.Allow(ctx, key, lim)
	if err != nil || !first.Allowed {
		t.Fatalf("Allow = %+v, %v", first, err)
	}
	second, err := l.Reserve(ctx, key, lim, 2*time.Minute)
	if err != nil || !second.Allowed {
		t.Fatalf("Reserve = %+v, %v", second, err)
	}
	if ok, err := l.Cancel(ctx, key, first); ok || err != nil {
		t.Errorf("Cancel(first) = %v, %v; want false: a later start was taken", ok, err)
	}
	if ok, err := l.Cancel(ctx, key, second); !ok || err != nil {
		t.Fatalf("Cancel(second) = %v, %v; want true", ok, err)
	}
	// The key is as before the second start: the next one comes a minute after the first.
	r, err := l.Reserve(ctx, key, lim, 2*time.Minute)
	if err != nil || !r.Allowed || r.Delay > time.Minute || r.Delay < 59*time.Second {
		t.Errorf("Reserve after Cancel = %+v, %v; want a start about a minute away", r, err)
	}
	if ok, err := l.Cancel(ctx, key, Result{}); ok || err != nil {
		t.Errorf("Cancel(Result{}) = %v, %v; want false, nil", ok, err)
	}
}

func TestPause(t *testing.T) {
	t.Parallel()
	l, ctx, key := New(sharedServer(t)), context.Background(), uniqueKey(t)
	lim := Rate{N: 10, Per: time.Second, Burst: 5}
	left, err := l.Pause(ctx, key, lim, time.Minute)
	if err != nil || left > time.Minute || left < 59*time.Second {
		t.Fatalf("Pause = %v, %v; want about a minute", left, err)
	}
	if left, _ := l.Pause(ctx, key, lim, time.Second); left < 59*time.Second {
		t.Errorf("a shorter Pause shortened the pause to %v", left)
	}
	r, err := l.Allow(ctx, key, lim)
	if err != nil || r.Allowed || r.Paused < 59*time.Second || r.Delay < 59*time.Second {
		t.Fatalf("Allow while paused = %+v, %v; want limited for about a minute", r, err)
	}
	other, err := l.Allow(ctx, uniqueKey(t), lim)
	if err != nil || !other.Allowed {
		t.Errorf("Allow on another key = %+v, %v; want allowed: a pause is per key", other, err)
	}
	if had, err := l.Resume(ctx, key); err != nil || !had {
		t.Errorf("Resume = %v, %v; want true", had, err)
	}
	r, err = l.Allow(ctx, key, lim)
	if err != nil || !r.Allowed || r.Paused != 0 {
		t.Errorf("Allow after Resume = %+v, %v; want allowed", r, err)
	}
}

func TestNoBurstAfterPause(t *testing.T) {
	t.Parallel()
	l, ctx, key := New(sharedServer(t)), context.Background(), uniqueKey(t)
	lim := Rate{N: 10, Per: time.Second, Burst: 5} // every 100ms, 5 at once
	start := time.Now()
	if _, err := l.Pause(ctx, key, lim, 300*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	a, err1 := l.Reserve(ctx, key, lim, time.Second)
	b, err2 := l.Reserve(ctx, key, lim, time.Second)
	elapsed := time.Since(start)
	if err1 != nil || err2 != nil || !a.Allowed || !b.Allowed {
		t.Fatalf("Reserve = %+v, %v; %+v, %v", a, err1, b, err2)
	}
	if a.Delay > 300*time.Millisecond || a.Delay < 300*time.Millisecond-elapsed {
		t.Errorf("first start after the pause in %v, want when it ends, 300ms", a.Delay)
	}
	if gap := b.Delay - a.Delay; gap > 100*time.Millisecond || gap < 100*time.Millisecond-elapsed {
		t.Errorf("second start %v after the first, want the spacing, 100ms: no burst after a pause", gap)
	}
}

func TestWait(t *testing.T) {
	t.Parallel()
	l, key := New(sharedServer(t)), uniqueKey(t)
	lim := Rate{N: 1, Per: 200 * time.Millisecond}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := l.Wait(ctx, key, lim); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if err := l.Wait(ctx, key, lim); err != nil {
		t.Fatal(err)
	}
	if waited := time.Since(start); waited > 200*time.Millisecond+time.Second || waited < 100*time.Millisecond {
		t.Errorf("second Wait returned after %v, want about 200ms", waited)
	}

	// The next start is a minute away, past any deadline the Wait has: however late
	// this runs, it is refused at once.
	slow := Rate{N: 1, Per: time.Minute}
	k2 := uniqueKey(t)
	if _, err := l.Allow(context.Background(), k2, slow); err != nil {
		t.Fatal(err)
	}
	short, cancel2 := context.WithTimeout(context.Background(), time.Second)
	defer cancel2()
	if err := l.Wait(short, k2, slow); !errors.Is(err, ErrLimited) || !strings.Contains(err.Error(), "after the context's deadline") {
		t.Errorf("Wait past the deadline = %v, want ErrLimited at once", err)
	}

	// A Wait whose context ends while it sleeps gives its start back.
	cctx, cancel3 := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- l.Wait(cctx, k2, slow) }()
	deadline := time.Now().Add(time.Minute)
	for st, _ := l.Inspect(context.Background(), k2); st.Starts < 2 && time.Now().Before(deadline); st, _ = l.Inspect(context.Background(), k2) {
		time.Sleep(10 * time.Millisecond)
	}
	cancel3()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Errorf("Wait cancelled = %v, want context.Canceled", err)
	}
	if st, err := l.Inspect(context.Background(), k2); err != nil || st.Starts != 1 {
		t.Errorf("after a cancelled Wait: %+v, %v; want 1 start remembered", st, err)
	}
}

func TestValidate(t *testing.T) {
	l, ctx := New(sharedServer(t)), context.Background()
	for _, lim := range []Rate{
		{N: 0, Per: time.Second},
		{N: 1, Per: 0},
		{N: 1, Per: MaxPer + 1},
		{N: 1, Per: time.Second, Burst: -1},
		{N: 1, Per: time.Second, Burst: MaxBurst + 1},
		{N: 2000, Per: time.Millisecond},
	} {
		if err := lim.Validate(); err == nil {
			t.Errorf("%+v.Validate() = nil, want an error", lim)
		}
		if _, err := l.Allow(ctx, "k", lim); err == nil || !strings.HasPrefix(err.Error(), "ratelimit: limit ") {
			t.Errorf("Allow with %+v = %v, want the limit's error", lim, err)
		}
	}
	if _, err := l.Reserve(ctx, "k", PerSecond(1), -time.Second); err == nil {
		t.Error("Reserve with a negative wait: no error")
	}
	if _, err := l.Pause(ctx, "k", PerSecond(1), 0); err == nil {
		t.Error("Pause(0): no error")
	}
	if got := (Rate{N: 50, Per: time.Second, Burst: 5}).String(); got != "50 per 1s, burst 5" {
		t.Errorf("String() = %q", got)
	}
}

// A call go-redis sends again after its reply was lost finds the start its first run
// took: it counts once, and is reported taken even when the key has no start left.
func TestLostReplyCountsOnce(t *testing.T) {
	t.Parallel()
	rdb := sharedServer(t)
	proxy := redistest.NewProxy(t, rdb.Options().Addr)
	through := redis.NewClient(&redis.Options{Addr: proxy.Addr(), MaxRetries: 3, MinRetryBackoff: time.Millisecond, MaxRetryBackoff: 2 * time.Millisecond})
	t.Cleanup(func() { through.Close() })
	ctx := context.Background()
	if err := through.Ping(ctx).Err(); err != nil {
		t.Fatal(err)
	}

	// Positive control: the proxy makes go-redis send a call twice.
	ctl := uniqueKey(t)
	proxy.DropReplies(1)
	if err := through.Incr(ctx, ctl).Err(); err != nil {
		t.Fatal(err)
	}
	if n, _ := rdb.Get(ctx, ctl).Int(); n != 2 {
		t.Fatalf("control: INCR behind a lost reply counted %d, want 2: the proxy did not cause a resend", n)
	}

	l := New(through)
	if _, err := l.Allow(ctx, uniqueKey(t), PerSecond(1)); err != nil { // the library is loaded
		t.Fatal(err)
	}
	key := uniqueKey(t)
	proxy.DropReplies(1)
	r, err := l.Allow(ctx, key, PerMinute(1))
	if err != nil || !r.Allowed {
		t.Fatalf("Allow behind a lost reply = %+v, %v; want allowed: its first run took the start", r, err)
	}
	st, err := New(rdb).Inspect(ctx, key)
	if err != nil || st.Starts != 1 {
		t.Errorf("after a lost reply: %+v, %v; want 1 start", st, err)
	}
	if r, _ := l.Allow(ctx, key, PerMinute(1)); r.Allowed {
		t.Errorf("a second call = %+v, want limited", r)
	}
}

func TestInspectAndList(t *testing.T) {
	t.Parallel()
	rdb := sharedServer(t)
	prefix := "rl" + uniqueKey(t) + ":"
	l, ctx := New(rdb, Prefix(prefix)), context.Background()
	a, b := "tenant{a}", strings.Repeat("x", 400)
	lim := Rate{N: 10, Per: time.Second, Burst: 4}
	for range 3 {
		if _, err := l.Allow(ctx, a, lim); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := l.Pause(ctx, b, lim, time.Minute); err != nil {
		t.Fatal(err)
	}
	st, err := l.Inspect(ctx, a)
	if err != nil {
		t.Fatal(err)
	}
	if st.Interval != 100*time.Millisecond || st.Burst != 4 || st.Starts != 3 || st.Remaining > 1 || st.Full > 400*time.Millisecond || st.Full < 200*time.Millisecond {
		t.Errorf("Inspect = %+v; want interval 100ms, burst 4, 3 starts, at most 1 remaining, full in 200-400ms", st)
	}
	seen := map[string]State{}
	for st, err := range l.List(ctx) {
		if err != nil {
			t.Fatal(err)
		}
		seen[st.Key] = st
	}
	if len(seen) != 2 || seen[a].Starts != 3 {
		t.Errorf("List = %+v; want %q and the long key", seen, a)
	}
	if st.RedisKey != prefix+"rate:{tenant%7Ba%7D}" {
		t.Errorf("Inspect(%q).RedisKey = %q", a, st.RedisKey)
	}
	if lb := seen[b[:64]]; !lb.Digested || lb.Paused < 59*time.Second || lb.Next < 59*time.Second {
		t.Errorf("List's long paused key = %+v; want digested, paused about a minute", lb)
	}
	if st, err := l.Inspect(ctx, "never"); err != nil || st.Starts != 0 || st.Remaining != 0 || st.Interval != 0 {
		t.Errorf("Inspect of a key never limited = %+v, %v", st, err)
	}
}

// A key expires once its starts and its pause are forgotten: between 10 and 30
// seconds after its TAT, never before.
func TestKeyExpires(t *testing.T) {
	t.Parallel()
	rdb := sharedServer(t)
	l, ctx := New(rdb), context.Background()
	key := uniqueKey(t)
	lim := PerMinute(1)
	if _, err := l.Allow(ctx, key, lim); err != nil {
		t.Fatal(err)
	}
	ttl := rdb.PTTL(ctx, redisKey(DefaultPrefix, key)).Val()
	// The start's TAT is a minute away: the key lives at least 10 s past it.
	if ttl < 70*time.Second || ttl > 90*time.Second {
		t.Errorf("PTTL after a start whose TAT is 1m away = %v, want 70-90s", ttl)
	}
	if _, err := l.Pause(ctx, key, lim, time.Hour); err != nil {
		t.Fatal(err)
	}
	if ttl := rdb.PTTL(ctx, redisKey(DefaultPrefix, key)).Val(); ttl < time.Hour+10*time.Second || ttl > time.Hour+30*time.Second {
		t.Errorf("PTTL after an hour's pause = %v, want 1h10s-1h30s", ttl)
	}
}

func TestMemberRoundTrip(t *testing.T) {
	lim := Rate{N: 3, Per: time.Second, Burst: 7}
	iv, b, ok := memberLimit(member(newID(), lim))
	if !ok || iv != 333334*time.Microsecond || b != 7 {
		t.Errorf("memberLimit(member(%v)) = %v, %d, %v; want 333.334ms, 7, true", lim, iv, b, ok)
	}
	if id := strings.Fields(member(newID(), lim))[0]; len(id) != idChars {
		t.Errorf("member's identity %q has %d characters, want %d", id, len(id), idChars)
	}
	if _, _, ok := memberLimit(pauseMember); ok {
		t.Errorf("memberLimit(%q) ok", pauseMember)
	}
}

// A start taken ahead does not begin during a pause that began while it waited:
// Take gives it back when it is due and takes one after the pause.
func TestTakeHeldBackByPauseWhileWaiting(t *testing.T) {
	t.Parallel()
	l, ctx, key := New(sharedServer(t)), context.Background(), uniqueKey(t)
	lim := Rate{N: 10, Per: time.Second} // every 100ms
	if _, err := l.Allow(ctx, key, lim); err != nil {
		t.Fatal(err)
	}
	type result struct {
		r   Result
		err error
		at  time.Time
	}
	done := make(chan result, 1)
	go func() {
		r, err := l.Take(ctx, key, lim, 10*time.Second) // due in 100ms
		done <- result{r, err, time.Now()}
	}()
	deadline := time.Now().Add(10 * time.Second)
	for st, _ := l.Inspect(ctx, key); st.Starts < 2 && time.Now().Before(deadline); st, _ = l.Inspect(ctx, key) {
		time.Sleep(time.Millisecond)
	}
	paused := time.Now()
	const pause = 500 * time.Millisecond // five intervals
	if _, err := l.Pause(ctx, key, lim, pause); err != nil {
		t.Fatal(err)
	}
	got := <-done
	if got.err != nil || !got.r.Allowed {
		t.Fatalf("Take = %+v, %v; want allowed after the pause", got.r, got.err)
	}
	if began := got.at.Sub(paused); began < pause {
		t.Errorf("the start began %v after the pause began, want after its %v", began, pause)
	}
	if got.r.Delay < pause-lim.Per/time.Duration(2*lim.N) { // less the calls, well under half an interval
		t.Errorf("Take's Delay = %v, want the time it slept, past the pause", got.r.Delay)
	}
}

// The layout (layout.go): the latest start is the set's first entry, and the scores
// are minus the TATs, a start's TAT the interval after the one before it.
func TestLayoutLatestFirst(t *testing.T) {
	t.Parallel()
	rdb := sharedServer(t)
	l, ctx, key := New(rdb), context.Background(), uniqueKey(t)
	lim := PerSecond(10)
	var taken []Result
	for range 3 {
		r, err := l.Reserve(ctx, key, lim, time.Second)
		if err != nil || !r.Allowed {
			t.Fatalf("Reserve = %+v, %v", r, err)
		}
		taken = append(taken, r)
	}
	zs, err := rdb.ZRangeWithScores(ctx, redisKey(DefaultPrefix, key), 0, -1).Result()
	if err != nil || len(zs) != 3 {
		t.Fatalf("ZRANGE = %v, %v; want 3 starts", zs, err)
	}
	for i, z := range zs {
		if want := taken[2-i].member; z.Member != want {
			t.Errorf("entry %d = %q, want start %d's member %q", i, z.Member, 3-i, want)
		}
		if i > 0 {
			if d := z.Score - zs[i-1].Score; d != float64(lim.interval()) {
				t.Errorf("score %d - score %d = %v, want the interval, %d: scores are minus the TATs", i, i-1, d, lim.interval())
			}
		}
	}
	if zs[0].Score >= 0 {
		t.Errorf("the latest start's score = %v, want minus its TAT", zs[0].Score)
	}
}

// Starts whose TAT is over 10 s old are forgotten once the key's TAT enters a new
// epoch, and the key is then set to expire 10 to 30 s after its TAT. A trim in the
// wrong direction (the scores are negated) would drop the new start instead.
func TestForgetsOldStarts(t *testing.T) {
	t.Parallel()
	rdb := sharedServer(t)
	l, ctx, key := New(rdb), context.Background(), uniqueKey(t)
	rkey := redisKey(DefaultPrefix, key)
	now, err := rdb.Time(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	old := now.Add(-25*time.Second).UnixMicro() + PerSecond(1).interval()
	stale := member("stale", PerSecond(1))
	if err := rdb.ZAdd(ctx, rkey, redis.Z{Score: -float64(old), Member: stale}).Err(); err != nil {
		t.Fatal(err)
	}
	r, err := l.Allow(ctx, key, PerSecond(1))
	if err != nil || !r.Allowed {
		t.Fatalf("Allow = %+v, %v; want allowed: the only start is 25 s old", r, err)
	}
	if ms, err := rdb.ZRange(ctx, rkey, 0, -1).Result(); err != nil || len(ms) != 1 || ms[0] != r.member {
		t.Errorf("members = %q, %v; want the new start's alone, %q", ms, err, r.member)
	}
	if ttl := rdb.PTTL(ctx, rkey).Val(); ttl < 10*time.Second || ttl > 31*time.Second {
		t.Errorf("PTTL = %v, want 10-31 s: the epoch after next of a TAT 1 s away", ttl)
	}
}
