package order

import (
	"context"
	"testing"
	"time"
)

// startedTickets is a Starter that hands on what it is asked to start.
func startedTickets() (Starter, chan Parked) {
	ch := make(chan Parked, 16)
	return func(_ context.Context, p Parked) { ch <- p }, ch
}

// nextStart waits for the Starter's next call, within a bound no correct run nears.
func nextStart(t *testing.T, ch chan Parked) Parked {
	t.Helper()
	select {
	case p := <-ch:
		return p
	case <-time.After(10 * time.Second):
		t.Fatal("no parked task was started")
		return Parked{}
	}
}

// noStart checks that the Starter was not asked to start anything (yet).
func noStart(t *testing.T, ch chan Parked, after string) {
	t.Helper()
	select {
	case p := <-ch:
		t.Fatalf("after %s, started %+v; want nothing started", after, p)
	default:
	}
}

func TestParkedPlaceIsStartedByTheFinishBeforeIt(t *testing.T) {
	t.Parallel()
	start, started := startedTickets()
	s, ctx, key := New(sharedServer(t), StartWith(start)), context.Background(), uniqueKey(t)
	p1, _ := s.Take(ctx, key, "q", "t1")
	p2, _ := s.Take(ctx, key, "q", "t2")
	p3, _ := s.Take(ctx, key, "q", "t3")

	// The place whose turn it is parks nothing: its task goes on.
	if turn, err := s.Park(ctx, key, p1, "ticket-1"); err != nil || turn.State != TurnNow {
		t.Fatalf("Park(place 1) = %+v, %v; want its turn", turn, err)
	}
	for _, p := range []Place{p2, p3} {
		if turn, err := s.Park(ctx, key, p, "ticket-"+p.String()); err != nil || turn.State != TurnWait || turn.Next != 1 || turn.Holder.TaskID != "t1" {
			t.Fatalf("Park(place %d) = %+v, %v; want a wait for place 1 held by t1", p.N, turn, err)
		}
	}
	// Parked again (its fallback came back early): one mark, the new ticket.
	if _, err := s.Park(ctx, key, p3, "ticket-3"); err != nil {
		t.Fatal(err)
	}
	if st, err := s.Inspect(ctx, key); err != nil || st.Parked != 2 {
		t.Fatalf("Inspect = %+v, %v; want 2 parked", st, err)
	}
	noStart(t, started, "parking")

	// Finishing place 1 starts place 2's task, whose turn came, and place 3's ahead
	// of its turn; place 3's Enter says so.
	if n, err := s.Finish(ctx, key, p1, Done); err != nil || n != 2 {
		t.Fatalf("Finish(1) = %d, %v; want next 2", n, err)
	}
	if got := nextStart(t, started); got.Key != key || got.Place != p2 || got.Ticket != "ticket-"+p2.String() || got.Started || got.Ahead {
		t.Fatalf("started %+v; want place 2 with its ticket, its turn come", got)
	}
	if got := nextStart(t, started); got.Place != p3 || got.Ticket != "ticket-3" || got.Started || !got.Ahead {
		t.Fatalf("started %+v; want place 3 with ticket-3, ahead of its turn", got)
	}
	if turn, err := s.Enter(ctx, key, p3); err != nil || turn.State != TurnWait || !turn.Ahead {
		t.Fatalf("Enter(place 3) = %+v, %v; want a wait, started ahead", turn, err)
	}
	if turn, err := s.Enter(ctx, key, p2); err != nil || turn.State != TurnNow || turn.Ahead {
		t.Fatalf("Enter(place 2) = %+v, %v; want its turn", turn, err)
	}
	// A Finish sent again (its reply lost) names both again, as started before: a
	// start the lost reply missed is made then.
	if n, err := s.Finish(ctx, key, p1, Done); err != nil || n != 0 {
		t.Fatalf("Finish(1) again = %d, %v; want 0", n, err)
	}
	if got := nextStart(t, started); got.Place != p2 || !got.Started || got.Ahead {
		t.Fatalf("started %+v; want place 2 again, started before", got)
	}
	if got := nextStart(t, started); got.Place != p3 || !got.Started || !got.Ahead {
		t.Fatalf("started %+v; want place 3 again, started before, ahead", got)
	}
	if st, err := s.Inspect(ctx, key); err != nil || st.Parked != 0 {
		t.Fatalf("Inspect = %+v, %v; want none parked: both were started", st, err)
	}
	// Place 2 is skipped (its task was gone): place 3's task is started, marked as
	// started before; a Finish carried by a Later starts it too.
	lctx, later := s.FinishLater(ctx, key, p2)
	_ = later.Finish(Skipped)
	if _, err := s.Enter(lctx, key, p3); err != nil {
		t.Fatal(err)
	}
	if n, err := later.Result(ctx); err != nil || n != 3 {
		t.Fatalf("Later.Result = %d, %v; want next 3", n, err)
	}
	if got := nextStart(t, started); got.Place != p3 || got.Ticket != "ticket-3" || !got.Started || got.Ahead {
		t.Fatalf("started %+v; want place 3 with ticket-3, started before", got)
	}
	if st, err := s.Inspect(ctx, key); err != nil || st.Parked != 0 {
		t.Fatalf("Inspect = %+v, %v; want none parked", st, err)
	}
	for _, bad := range []string{"", "^t"} {
		if _, err := s.Park(ctx, key, p3, bad); err == nil {
			t.Fatalf("Park with ticket %q: want an error", bad)
		}
	}
}

func TestParkedPlaceBehindAbandonedOnesIsStarted(t *testing.T) {
	t.Parallel()
	start, started := startedTickets()
	s, ctx, key := New(sharedServer(t), StartWith(start)), context.Background(), uniqueKey(t)
	p1, _ := s.Take(ctx, key, "q", "t1")
	p2, _ := s.Take(ctx, key, "q", "t2")
	p3, _ := s.Take(ctx, key, "q", "t3")
	// Place 3 parks, then its key moves past it with place 2 skipped as abandoned
	// along with place 1's finish.
	if _, err := s.Park(ctx, key, p3, "ticket-3"); err != nil {
		t.Fatal(err)
	}
	if n, err := s.Finish(ctx, key, p2, Abandoned); err != nil || n != 0 {
		t.Fatalf("Finish(2, Abandoned) = %d, %v; want 0 (place 1 not finished)", n, err)
	}
	if n, err := s.Finish(ctx, key, p1, Done); err != nil || n != 3 {
		t.Fatalf("Finish(1) = %d, %v; want next 3", n, err)
	}
	if got := nextStart(t, started); got.Place != p3 {
		t.Fatalf("started %+v; want place 3", got)
	}
	// A task started ahead that parks again (its wait ran out) is no longer marked
	// started, and the counts stay true through it all.
	p4, _ := s.Take(ctx, key, "q", "t4")
	p5, _ := s.Take(ctx, key, "q", "t5")
	for _, p := range []Place{p4, p5} {
		if _, err := s.Park(ctx, key, p, "ticket-"+p.String()); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := s.Finish(ctx, key, p3, Done); err != nil {
		t.Fatal(err)
	}
	nextStart(t, started)
	if got := nextStart(t, started); got.Place != p5 || !got.Ahead {
		t.Fatalf("started %+v; want place 5 ahead of its turn", got)
	}
	if turn, err := s.Park(ctx, key, p5, "ticket-5"); err != nil || turn.State != TurnWait || !turn.Ahead {
		t.Fatalf("Park(place 5) = %+v, %v; want a wait, started ahead before this park", turn, err)
	}
	if turn, err := s.Enter(ctx, key, p5); err != nil || turn.Ahead {
		t.Fatalf("Enter(place 5) after its park = %+v, %v; want no longer started ahead", turn, err)
	}
	if st, err := s.Inspect(ctx, key); err != nil || st.Parked != 1 {
		t.Fatalf("Inspect = %+v, %v; want 1 parked", st, err)
	}
	if _, err := s.Finish(ctx, key, p4, Done); err != nil {
		t.Fatal(err)
	}
	if got := nextStart(t, started); got.Place != p5 || got.Ticket != "ticket-5" || got.Started || got.Ahead {
		t.Fatalf("started %+v; want place 5, its turn come, not started before", got)
	}
	if _, err := s.Finish(ctx, key, p5, Done); err != nil {
		t.Fatal(err)
	}
	if st, err := s.Inspect(ctx, key); err != nil || st.Parked != 0 {
		t.Fatalf("Inspect = %+v, %v; want none parked", st, err)
	}
	noStart(t, started, "the last finish")
}

func TestStartAheadOfAPlaceWhoseTurnCameByItself(t *testing.T) {
	t.Parallel()
	start, started := startedTickets()
	s, ctx, key := New(sharedServer(t), StartWith(start)), context.Background(), uniqueKey(t)
	p1, _ := s.Take(ctx, key, "q", "t1")
	p2, _ := s.Take(ctx, key, "q", "t2")
	// Before anything parks behind it, place 1's turn names nothing to start.
	if turn, err := s.Enter(ctx, key, p1); err != nil || turn.State != TurnNow || turn.Ahead {
		t.Fatalf("Enter(place 1) = %+v, %v; want its turn, nothing behind", turn, err)
	}
	if _, err := s.Park(ctx, key, p2, "ticket-2"); err != nil {
		t.Fatal(err)
	}
	// Place 1's turn came without a finish (its task was retried): its Enter says
	// that the place after it waits unstarted, and StartAhead starts it, once.
	if turn, err := s.Enter(ctx, key, p1); err != nil || turn.State != TurnNow || !turn.Ahead {
		t.Fatalf("Enter(place 1) = %+v, %v; want its turn, a parked place behind", turn, err)
	}
	if err := s.StartAhead(ctx, key, p1); err != nil {
		t.Fatal(err)
	}
	if got := nextStart(t, started); got.Place != p2 || got.Ticket != "ticket-2" || !got.Ahead {
		t.Fatalf("started %+v; want place 2 ahead of its turn", got)
	}
	if turn, err := s.Enter(ctx, key, p2); err != nil || turn.State != TurnWait || !turn.Ahead {
		t.Fatalf("Enter(place 2) = %+v, %v; want a wait, started ahead", turn, err)
	}
	if turn, err := s.Enter(ctx, key, p1); err != nil || turn.Ahead {
		t.Fatalf("Enter(place 1) = %+v, %v; want nothing behind left to start", turn, err)
	}
	// Again, or for a place whose turn has not come: nothing.
	if err := s.StartAhead(ctx, key, p1); err != nil {
		t.Fatal(err)
	}
	if err := s.StartAhead(ctx, key, p2); err != nil {
		t.Fatal(err)
	}
	noStart(t, started, "StartAhead again")
	// The finish of place 1 starts place 2, its turn come, as started before.
	if _, err := s.Finish(ctx, key, p1, Done); err != nil {
		t.Fatal(err)
	}
	if got := nextStart(t, started); got.Place != p2 || !got.Started || got.Ahead {
		t.Fatalf("started %+v; want place 2, its turn come, started before", got)
	}
}
