package order

import (
	"context"
	"strconv"
	"testing"
	"time"
)

// TestHalt: a key halted at its next place stays there: a gap rule's Skipped moves
// nothing, the waiters see the holder halted, Inspect says where and since when; the
// place's own Done (its task run again) moves on and drops the mark, and so does a
// person's Forced. The control: without the halt, Skipped moves the key on.
func TestHalt(t *testing.T) {
	t.Parallel()
	s, ctx := New(sharedServer(t)), context.Background()
	places := func(key string) []Place {
		var ps []Place
		for i := range 4 {
			p, err := s.Take(ctx, key, "q", "task-"+strconv.Itoa(i+1))
			if err != nil {
				t.Fatal(err)
			}
			ps = append(ps, p)
		}
		return ps
	}

	key := uniqueKey(t)
	ps := places(key)
	if n, err := s.Finish(ctx, key, ps[0], Halted); n != 1 || err != nil {
		t.Fatalf("Finish(Halted) = %d, %v; want 1: it halted the key at place 1, moving nothing", n, err)
	}
	if n, err := s.Finish(ctx, key, ps[0], Halted); n != 0 || err != nil {
		t.Fatalf("Finish(Halted) again = %d, %v; want 0: halted there already", n, err)
	}
	st, err := s.Inspect(ctx, key)
	if err != nil || st.Halted != 1 || st.Next != 1 || !st.Holder.Halted || st.HaltedFor < 0 || st.HaltedFor > time.Minute {
		t.Fatalf("Inspect after the halt = %+v, %v; want halted at 1, next 1", st, err)
	}
	if turn, err := s.Enter(ctx, key, ps[1]); err != nil || turn.State != TurnWait || !turn.Holder.Halted || turn.Holder.TaskID != "task-1" {
		t.Fatalf("Enter of place 2 = %+v, %v; want to wait for task-1, halted", turn, err)
	}
	if turn, err := s.Park(ctx, key, ps[2], "ticket-3"); err != nil || !turn.Holder.Halted {
		t.Fatalf("Park of place 3 = %+v, %v; want the holder halted", turn, err)
	}
	if n, err := s.Finish(ctx, key, ps[0], Skipped); n != 0 || err != nil {
		t.Fatalf("Finish(Skipped) of the halted place = %d, %v; want 0: a gap rule does not move past it", n, err)
	}
	if turn, err := s.Enter(ctx, key, ps[0]); err != nil || turn.State != TurnNow {
		t.Fatalf("Enter of the halted place = %+v, %v; want its turn: its task may run again", turn, err)
	}
	if n, err := s.Finish(ctx, key, ps[0], Done); n != 2 || err != nil {
		t.Fatalf("Finish(Done) of the halted place = %d, %v; want next 2", n, err)
	}
	if st, err := s.Inspect(ctx, key); err != nil || st.Halted != 0 || st.Holder.Halted {
		t.Fatalf("Inspect after the halted place finished = %+v, %v; want no halt", st, err)
	}

	// Halted again at 2; a person moves the key past it.
	if _, err := s.Finish(ctx, key, ps[1], Halted); err != nil {
		t.Fatal(err)
	}
	if n, err := s.Finish(ctx, key, ps[1], Forced); n != 3 || err != nil {
		t.Fatalf("Finish(Forced) of the halted place = %d, %v; want next 3", n, err)
	}
	if st, err := s.Inspect(ctx, key); err != nil || st.Halted != 0 || st.Skipped != 1 {
		t.Fatalf("Inspect after Forced = %+v, %v; want no halt, one place skipped", st, err)
	}

	// The control: not halted, a gap rule's Skipped moves on.
	key = uniqueKey(t)
	ps = places(key)
	if n, err := s.Finish(ctx, key, ps[0], Skipped); n != 2 || err != nil {
		t.Fatalf("Finish(Skipped) of a place not halted = %d, %v; want next 2", n, err)
	}
	// A halt of a place that is not the key's next marks nothing.
	if _, err := s.Finish(ctx, key, ps[2], Halted); err != nil {
		t.Fatal(err)
	}
	if st, err := s.Inspect(ctx, key); err != nil || st.Halted != 0 {
		t.Fatalf("Inspect after a halt of a later place = %+v, %v; want no halt", st, err)
	}
}

// TestHaltTellsTheWaiters: a halt wakes the Awaits on the place, as Requeue does,
// so that they judge the key again rather than wait for a finish.
func TestHaltTellsTheWaiters(t *testing.T) {
	t.Parallel()
	s, ctx, key := New(sharedServer(t)), context.Background(), uniqueKey(t)
	first, err := s.Take(ctx, key, "q", "a")
	if err != nil {
		t.Fatal(err)
	}
	second, err := s.Take(ctx, key, "q", "b")
	if err != nil {
		t.Fatal(err)
	}
	const maxWait = 30 * time.Second
	got := make(chan Turn, 1)
	w := s.Watch(key)
	defer w.Close()
	turn, err := s.Enter(ctx, key, second)
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		t, _ := w.Await(ctx, second, turn, maxWait)
		got <- t
	}()
	// The waiter listens once its Watch subscribed; a halt sent before that would go
	// unheard, so halt until it is heard (Halted again changes nothing).
	deadline := time.After(maxWait)
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		if _, err := s.Finish(ctx, key, first, Halted); err != nil {
			t.Fatal(err)
		}
		select {
		case turn := <-got:
			if !turn.Holder.Requeued {
				t.Fatalf("Await after the halt = %+v; want the holder announced as not running", turn)
			}
			return
		case <-deadline:
			t.Fatalf("Await did not return within %v of the halt", maxWait)
		case <-tick.C:
		}
	}
}
