package ratelimit

import (
	"github.com/redis/go-redis/v9"

	"context"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestCostCountsAsSeveralStarts: a start of Cost k takes k of the burst, and moves the
// next start k intervals on; a start that costs more than the burst waits on an idle
// key for what lies beyond it.
func TestCostCountsAsSeveralStarts(t *testing.T) {
	t.Parallel()
	l, ctx := New(sharedServer(t)), context.Background()
	lim := Rate{N: 1, Per: time.Minute, Burst: 5} // a start a minute, 5 at once

	key := uniqueKey(t)
	r, err := l.Allow(ctx, key, Rate{N: lim.N, Per: lim.Per, Burst: lim.Burst, Cost: 3})
	if err != nil || !r.Allowed || r.Remaining != 2 {
		t.Fatalf("Allow of cost 3 on an idle key = %+v, %v; want allowed, 2 remaining", r, err)
	}
	r, err = l.Allow(ctx, key, Rate{N: lim.N, Per: lim.Per, Burst: lim.Burst, Cost: 3})
	if err != nil || r.Allowed || r.Delay < 59*time.Second || r.Delay > time.Minute {
		t.Fatalf("a second Allow of cost 3 = %+v, %v; want limited for about a minute (one start short)", r, err)
	}
	for i, want := range []int{1, 0} {
		r, err := l.Allow(ctx, key, lim)
		if err != nil || !r.Allowed || r.Remaining != want {
			t.Fatalf("Allow #%d of cost 1 = %+v, %v; want allowed, %d remaining", i+1, r, err, want)
		}
	}

	// The control: the same calls without a cost take one start each.
	key = uniqueKey(t)
	for range 2 {
		if r, err := l.Allow(ctx, key, lim); err != nil || !r.Allowed {
			t.Fatalf("Allow of cost 1 = %+v, %v", r, err)
		}
	}
	if r, err := l.Allow(ctx, key, lim); err != nil || !r.Allowed || r.Remaining != 2 {
		t.Fatalf("a third Allow of cost 1 = %+v, %v; want allowed, 2 remaining", r, err)
	}

	// Beyond the burst: 7 starts' worth on an idle key with a burst of 5 begin two
	// intervals from now.
	key = uniqueKey(t)
	r, err = l.Reserve(ctx, key, Rate{N: lim.N, Per: lim.Per, Burst: lim.Burst, Cost: 7}, 3*time.Minute)
	if err != nil || !r.Allowed || r.Delay < 119*time.Second || r.Delay > 2*time.Minute {
		t.Fatalf("Reserve of cost 7 = %+v, %v; want allowed in about two minutes", r, err)
	}
}

// TestCostGivenBack: Cancel of a start of cost k gives back all k.
func TestCostGivenBack(t *testing.T) {
	t.Parallel()
	l, ctx, key := New(sharedServer(t)), context.Background(), uniqueKey(t)
	lim := Rate{N: 1, Per: time.Minute, Burst: 4}
	r, err := l.Allow(ctx, key, Rate{N: 1, Per: time.Minute, Burst: 4, Cost: 3})
	if err != nil || !r.Allowed {
		t.Fatalf("Allow of cost 3 = %+v, %v", r, err)
	}
	if ok, err := l.Cancel(ctx, key, r); !ok || err != nil {
		t.Fatalf("Cancel = %v, %v; want true", ok, err)
	}
	if r, err := l.Allow(ctx, key, lim); err != nil || !r.Allowed || r.Remaining != 3 {
		t.Errorf("Allow after the Cancel = %+v, %v; want allowed, 3 remaining: the whole cost given back", r, err)
	}
}

func TestCostValidated(t *testing.T) {
	for _, lim := range []Rate{
		{N: 1, Per: time.Second, Cost: -1},
		{N: 1, Per: MaxPer, Cost: 2},                                        // two weeks' worth
		{N: 1000, Per: time.Second, Cost: 1000*int(MaxPer/time.Second) + 1}, // past MaxPer
	} {
		if err := lim.Validate(); err == nil || !strings.Contains(err.Error(), "Cost") {
			t.Errorf("%+v.Validate() = %v, want an error about Cost", lim, err)
		}
	}
	for _, lim := range []Rate{{N: 1, Per: MaxPer, Cost: 1}, {N: 10, Per: time.Second, Cost: 10 * int(MaxPer/time.Second)}} {
		if err := lim.Validate(); err != nil {
			t.Errorf("%+v.Validate() = %v, want nil", lim, err)
		}
	}
	if got := (Rate{N: 50, Per: time.Second, Burst: 5, Cost: 3}).String(); got != "50 per 1s, burst 5, cost 3" {
		t.Errorf("String() = %q", got)
	}
}

// TestReset: Reset forgets a key's starts, those taken ahead too, so that its whole
// burst is free again; a pause stays, with the key's expiry.
func TestReset(t *testing.T) {
	t.Parallel()
	rdb := sharedServer(t)
	l, ctx, key := New(rdb), context.Background(), uniqueKey(t)
	lim := Rate{N: 1, Per: time.Minute, Burst: 2}
	for range 2 {
		if r, err := l.Allow(ctx, key, lim); err != nil || !r.Allowed {
			t.Fatalf("Allow = %+v, %v", r, err)
		}
	}
	if r, err := l.Reserve(ctx, key, lim, 2*time.Minute); err != nil || !r.Allowed || r.Delay < 59*time.Second {
		t.Fatalf("Reserve ahead = %+v, %v", r, err)
	}
	if r, err := l.Allow(ctx, key, lim); err != nil || r.Allowed {
		t.Fatalf("Allow before Reset = %+v, %v; want limited (the control)", r, err)
	}
	if n, err := l.Reset(ctx, key); n != 3 || err != nil {
		t.Fatalf("Reset = %d, %v; want 3 starts forgotten", n, err)
	}
	if n, err := l.Reset(ctx, key); n != 0 || err != nil {
		t.Errorf("Reset again = %d, %v; want 0", n, err)
	}
	if r, err := l.Allow(ctx, key, lim); err != nil || !r.Allowed || r.Remaining != 1 {
		t.Fatalf("Allow after Reset = %+v, %v; want allowed, 1 remaining: the whole burst free", r, err)
	}

	if _, err := l.Pause(ctx, key, lim, time.Hour); err != nil {
		t.Fatal(err)
	}
	paused := rdb.PTTL(ctx, redisKey(DefaultPrefix, key)).Val()
	if n, err := l.Reset(ctx, key); n != 1 || err != nil {
		t.Fatalf("Reset of a paused key = %d, %v; want the one start forgotten", n, err)
	}
	if r, err := l.Allow(ctx, key, lim); err != nil || r.Allowed || r.Paused < 59*time.Minute {
		t.Errorf("Allow after the Reset of a paused key = %+v, %v; want held back by the pause", r, err)
	}
	// The pause's expiry, set from the TAT it leaves (an hour and an interval away):
	// the same after Reset, but for the time the calls took.
	if ttl := rdb.PTTL(ctx, redisKey(DefaultPrefix, key)).Val(); ttl > paused || ttl < paused-10*time.Second || ttl < time.Hour {
		t.Errorf("PTTL of the paused key after Reset = %v, want the %v it had after Pause", ttl, paused)
	}
	if n, err := l.Reset(ctx, uniqueKey(t)); n != 0 || err != nil {
		t.Errorf("Reset of an unknown key = %d, %v; want 0, nil", n, err)
	}
}

// TestCostWindowBound: starts of random costs, all taken ahead at once on a key with a
// long spacing (so that the calls' own time is nothing beside it): in every window of
// Per, the costs of the starts that begin in it add up to at most N + max(Burst, k) -
// 1, k the largest cost among them. A start of cost k above the burst begins its k at
// once after the limiter spaced them before it; the control shows that such a window
// holds more than N + Burst - 1.
func TestCostWindowBound(t *testing.T) {
	t.Parallel()
	l, ctx := New(sharedServer(t)), context.Background()
	const n, burst = 10, 2
	per := 10 * time.Minute // a minute per start
	costs := []int{1, 1, 7, 1, 1, 1, 1, 1, 1, 1, 1, 1, 3, 12, 1, 1, 2, 5, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}
	key := uniqueKey(t)
	type start struct {
		at   time.Duration
		cost int
	}
	var starts []start
	began := time.Now()
	for i, c := range costs {
		r, err := l.Reserve(ctx, key, Rate{N: n, Per: per, Burst: burst, Cost: c}, 24*time.Hour)
		if err != nil || !r.Allowed {
			t.Fatalf("Reserve #%d of cost %d = %+v, %v", i+1, c, r, err)
		}
		starts = append(starts, start{time.Since(began) + r.Delay, c})
	}
	// Begins fall on whole spacings (a minute) from the first, known to within what
	// the calls took: a start is in the window of another when it begins less than
	// Per less half a spacing after it.
	if slack := time.Since(began); slack > per/n/4 {
		t.Fatalf("the calls took %v, too long to tell starts a spacing apart", slack)
	}
	exceeded := false
	for i, s := range starts {
		sum, most := 0, 0
		for _, o := range starts[i:] {
			if o.at-s.at < per-per/n/2 {
				sum += o.cost
				most = max(most, o.cost)
			}
		}
		if bound := n + max(burst, most) - 1; sum > bound {
			t.Errorf("the window of %v from start #%d holds %d units; want at most %d", per, i+1, sum, bound)
		}
		if sum > n+burst-1 {
			exceeded = true
		}
	}
	if !exceeded {
		t.Error("no window held more than N + Burst - 1: the control did not trip, and the bound was not tested where it differs")
	}
}

// TestInspectAhead: Inspect counts the starts reserved ahead (taken, not yet begun),
// and says when the last of them begins; starts begun, and a pause, are not counted.
func TestInspectAhead(t *testing.T) {
	t.Parallel()
	l, ctx, key := New(sharedServer(t)), context.Background(), uniqueKey(t)
	lim := Rate{N: 1, Per: time.Minute, Burst: 2}
	allow(t, l, key, lim, 2) // the burst: begun
	if st, err := l.Inspect(ctx, key); err != nil || st.Ahead != 0 || st.LastDue != 0 {
		t.Fatalf("Inspect after two starts begun = %+v, %v; want none ahead", st, err)
	}
	for i := range 3 {
		if _, err := l.TakeAs(ctx, key, lim, "task-"+string(rune('a'+i)), 0, time.Hour); err != nil {
			t.Fatal(err)
		}
	}
	st, err := l.Inspect(ctx, key)
	if err != nil || st.Starts != 5 || st.Ahead != 3 || st.LastDue < 179*time.Second || st.LastDue > 3*time.Minute {
		t.Fatalf("Inspect with three starts reserved = %+v, %v; want 5 remembered, 3 ahead, the last in about 3m", st, err)
	}
	if _, err := l.Pause(ctx, key, lim, time.Hour); err != nil {
		t.Fatal(err)
	}
	if st, err := l.Inspect(ctx, key); err != nil || st.Ahead != 3 {
		t.Errorf("Inspect after a pause = %+v, %v; want still 3 ahead, the pause not counted", st, err)
	}
}

func allow(t *testing.T, l *Limiter, key string, lim Rate, n int) {
	t.Helper()
	for i := range n {
		if r, err := l.Allow(context.Background(), key, lim); err != nil || !r.Allowed {
			t.Fatalf("Allow #%d = %+v, %v; want allowed", i+1, r, err)
		}
	}
}

// TestResetKeepsMarksOfAnEndedPause: Reset of a key whose pause ended long ago (kept
// until its starts are forgotten) keeps the key, and the marks of its cancels, at
// least KEEP: a Cancel go-redis sends again after a lost reply still finds its mark.
func TestResetKeepsMarksOfAnEndedPause(t *testing.T) {
	t.Parallel()
	rdb := sharedServer(t)
	l, ctx, key := New(rdb), context.Background(), uniqueKey(t)
	lim := Rate{N: 1, Per: time.Minute}
	r, err := l.Reserve(ctx, key, lim, time.Hour)
	if err != nil || !r.Allowed {
		t.Fatalf("Reserve = %+v, %v", r, err)
	}
	if ok, err := l.Cancel(ctx, key, r); !ok || err != nil {
		t.Fatalf("Cancel = %v, %v", ok, err)
	}
	// A pause that ended 25 s ago, as the key keeps one until it is forgotten.
	now, err := rdb.Time(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	rkey := redisKey(DefaultPrefix, key)
	if err := rdb.ZAdd(ctx, rkey, redis.Z{Score: -float64(now.Add(-25 * time.Second).UnixMicro()), Member: pauseMember}).Err(); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Reset(ctx, key); err != nil {
		t.Fatal(err)
	}
	if ttl := rdb.PTTL(ctx, rkey).Val(); ttl < time.Duration(keepMicros)*time.Microsecond {
		t.Errorf("PTTL after Reset = %v, want at least KEEP (%v): the marks are kept that long", ttl, time.Duration(keepMicros)*time.Microsecond)
	}
	if ok, err := l.Cancel(ctx, key, r); !ok || err != nil {
		t.Errorf("the Cancel sent again after Reset = %v, %v; want true, from its mark", ok, err)
	}
}

// TestPauseHoldsBackStartsTakenAhead: a pause holds back the starts already taken
// ahead within it, also when the key's starts reach past its end: a caller that comes
// for its start within the pause gives it up and takes one after the key's last.
func TestPauseHoldsBackStartsTakenAhead(t *testing.T) {
	t.Parallel()
	l, ctx, key := New(sharedServer(t)), context.Background(), uniqueKey(t)
	lim := Rate{N: 10, Per: time.Second} // a start every 100ms
	var due []time.Duration
	for i := range 20 { // two seconds of starts, held for their callers
		r, err := l.TakeAs(ctx, key, lim, "task-"+strconv.Itoa(i), 0, time.Minute)
		if err != nil || !(r.Allowed || r.Held) {
			t.Fatalf("TakeAs #%d = %+v, %v", i, r, err)
		}
		due = append(due, r.Delay)
	}
	if left, err := l.Pause(ctx, key, lim, time.Second); err != nil || left < 1900*time.Millisecond {
		t.Fatalf("Pause(1s) = %v, %v; want the key held back by its last start, about 2s", left, err)
	}
	// task-5's start, due about half a second from now, falls within the pause.
	r, err := l.TakeAs(ctx, key, lim, "task-5", 0, time.Minute)
	if err != nil || !r.Found || r.Delay < 1900*time.Millisecond {
		t.Errorf("TakeAs for a start within the pause = %+v, %v; want it given up and one taken after the key's last, about 2s away (was due in %v)", r, err, due[5])
	}
	// task-15's start, due after the pause, stands.
	r, err = l.TakeAs(ctx, key, lim, "task-15", 0, time.Minute)
	if err != nil || !r.Found || r.Delay > due[15] {
		t.Errorf("TakeAs for a start after the pause = %+v, %v; want it kept, due in %v or less", r, err, due[15])
	}
}
