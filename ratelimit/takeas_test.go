package ratelimit

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// testLimiter is a Limiter on the shared server, with the client to read its keys.
type testLimiter struct {
	*Limiter
	rdb *redis.Client
}

func newTestLimiter(t *testing.T) testLimiter {
	rdb := sharedServer(t)
	return testLimiter{New(rdb), rdb}
}

// starts is how many starts key's set holds (the pause and marks left out).
func starts(t *testing.T, l testLimiter, key string) int {
	t.Helper()
	ms, err := l.rdb.ZRange(context.Background(), redisKey(l.prefix, key), 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, m := range ms {
		if !strings.HasPrefix(m, "~") {
			n++
		}
	}
	return n
}

// TestTakeAsHoldsAndFindsItsStart: a start beyond maxWait but within hold is taken
// and held for its caller; the caller coming back finds it (no second start taken,
// its Delay counting down), and once it is due begins at once on it (the interval,
// a second, is how late it may come: far more than a sleep overshoots).
func TestTakeAsHoldsAndFindsItsStart(t *testing.T) {
	t.Parallel()
	l, ctx, key := newTestLimiter(t), context.Background(), uniqueKey(t)
	lim := Rate{N: 1, Per: time.Second}
	if r, err := l.TakeAs(ctx, key, lim, "a", 0, time.Minute); err != nil || !r.Allowed || r.Held {
		t.Fatalf("TakeAs(a) = %+v, %v; want allowed at once", r, err)
	}
	r, err := l.TakeAs(ctx, key, lim, "queue.b", 0, time.Minute)
	if err != nil || r.Allowed || !r.Held || r.Delay <= 0 || r.Delay > lim.Per {
		t.Fatalf("TakeAs(b) = %+v, %v; want held, due within %v", r, err, lim.Per)
	}
	again, err := l.TakeAs(ctx, key, lim, "queue.b", 0, time.Minute)
	if err != nil || !again.Held || again.Delay > r.Delay {
		t.Fatalf("TakeAs(b) again = %+v, %v; want held, due within the first answer's %v", again, err, r.Delay)
	}
	if n := starts(t, l, key); n != 2 {
		t.Fatalf("key holds %d starts after b came back, want 2: b's start found, not taken again", n)
	}
	// Another caller whose name shares b's beginning (a ticket of the same queue)
	// takes a start of its own.
	if c, err := l.TakeAs(ctx, key, lim, "queue.c", 0, time.Minute); err != nil || !c.Held || c.Delay <= again.Delay {
		t.Fatalf("TakeAs(c) = %+v, %v; want held after b's start (%v)", c, err, again.Delay)
	}
	time.Sleep(again.Delay)
	due, err := l.TakeAs(ctx, key, lim, "queue.b", 0, time.Minute)
	if err != nil || !due.Allowed || due.Held || due.Delay != 0 {
		t.Fatalf("TakeAs(b) when due = %+v, %v; want allowed at once", due, err)
	}
	if n := starts(t, l, key); n != 3 {
		t.Errorf("key holds %d starts, want 3 (a, b, c)", n)
	}
	// Within maxWait, a start found is slept for, as Take sleeps.
	c, err := l.TakeAs(ctx, key, lim, "queue.c", time.Minute, time.Minute)
	if err != nil || !c.Allowed || c.Held {
		t.Fatalf("TakeAs(c) within maxWait = %+v, %v; want allowed after a sleep", c, err)
	}
	if n := starts(t, l, key); n != 3 {
		t.Errorf("key holds %d starts after c began, want 3", n)
	}
}

// TestTakeAsBeyondHold: a start later than hold is neither taken nor held; the
// answer says when one could be.
func TestTakeAsBeyondHold(t *testing.T) {
	t.Parallel()
	l, ctx, key := newTestLimiter(t), context.Background(), uniqueKey(t)
	lim := PerMinute(1)
	if r, err := l.TakeAs(ctx, key, lim, "a", 0, time.Second); err != nil || !r.Allowed {
		t.Fatalf("TakeAs(a) = %+v, %v; want allowed", r, err)
	}
	r, err := l.TakeAs(ctx, key, lim, "b", 0, time.Second)
	if err != nil || r.Allowed || r.Held || r.Delay < 59*time.Second {
		t.Fatalf("TakeAs(b) = %+v, %v; want neither allowed nor held, next start in about a minute", r, err)
	}
	if n := starts(t, l, key); n != 1 {
		t.Errorf("key holds %d starts, want 1", n)
	}
	if _, err := l.TakeAs(ctx, key, lim, "b", 0, -time.Second); err == nil {
		t.Error("TakeAs with a negative hold: no error")
	}
}

// TestTakeAsLateGivesUp: a caller that comes back for its start more than an
// interval after it was due takes another, at the key's next free start, rather
// than begin on the old one beside the key's later starts.
func TestTakeAsLateGivesUp(t *testing.T) {
	t.Parallel()
	l, ctx, key := newTestLimiter(t), context.Background(), uniqueKey(t)
	lim := Rate{N: 1, Per: 100 * time.Millisecond}
	if _, err := l.TakeAs(ctx, key, lim, "a", 0, time.Minute); err != nil {
		t.Fatal(err)
	}
	r, err := l.TakeAs(ctx, key, lim, "b", 0, time.Minute)
	if err != nil || !r.Held {
		t.Fatalf("TakeAs(b) = %+v, %v; want held", r, err)
	}
	time.Sleep(r.Delay + lim.stale() + lim.Per)
	// Meanwhile the key started others, up to a start still to come.
	for _, id := range []string{"c", "d"} {
		if _, err := l.TakeAs(ctx, key, lim, id, 0, time.Minute); err != nil {
			t.Fatal(err)
		}
	}
	late, err := l.TakeAs(ctx, key, lim, "b", 0, time.Minute)
	if err != nil || late.Allowed || !late.Held {
		t.Fatalf("TakeAs(b), late = %+v, %v; want held for a new start after c's and d's", late, err)
	}
	if n := starts(t, l, key); n != 4 {
		t.Errorf("key holds %d starts, want 4: b's old one moved, not added to", n)
	}
}

// TestTakeAsPauseGivesUp: a pause that begins after a start was held holds it back:
// the caller coming back takes one after the pause.
func TestTakeAsPauseGivesUp(t *testing.T) {
	t.Parallel()
	l, ctx, key := newTestLimiter(t), context.Background(), uniqueKey(t)
	lim := PerSecond(2) // every 500ms
	if _, err := l.TakeAs(ctx, key, lim, "a", 0, time.Minute); err != nil {
		t.Fatal(err)
	}
	r, err := l.TakeAs(ctx, key, lim, "b", 0, time.Minute)
	if err != nil || !r.Held {
		t.Fatalf("TakeAs(b) = %+v, %v; want held", r, err)
	}
	const pause = 20 * time.Second
	if _, err := l.Pause(ctx, key, lim, pause); err != nil {
		t.Fatal(err)
	}
	after, err := l.TakeAs(ctx, key, lim, "b", 0, time.Minute)
	if err != nil || !after.Held || after.Delay < pause-time.Second || after.Paused <= 0 {
		t.Fatalf("TakeAs(b) after a pause of %v = %+v, %v; want held until the pause ends", pause, after, err)
	}
	// A start held after a pause began is not held back by it.
	c, err := l.TakeAs(ctx, key, lim, "c", 0, time.Minute)
	if err != nil || !c.Held {
		t.Fatalf("TakeAs(c) = %+v, %v; want held", c, err)
	}
	if again, err := l.TakeAs(ctx, key, lim, "c", 0, time.Minute); err != nil || !again.Held || again.Delay > c.Delay {
		t.Fatalf("TakeAs(c) again = %+v, %v; want its start found (due in %v at most)", again, err, c.Delay)
	}
}
