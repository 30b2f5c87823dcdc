package asynqmutex

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/asynqmutex/asynqmutex/ratelimit"
)

// dueRecorder is a dueLoop's start: it records the tickets started, in order.
type dueRecorder struct {
	mu      sync.Mutex
	started []string
	done    chan string
}

func newDueRecorder() *dueRecorder { return &dueRecorder{done: make(chan string, 100)} }

func (r *dueRecorder) start(_ context.Context, p parkedTask) string {
	r.mu.Lock()
	r.started = append(r.started, p.ticket)
	r.mu.Unlock()
	r.done <- p.ticket
	return ""
}

// wait returns once n tasks were started, failing the test after a while.
func (r *dueRecorder) wait(t *testing.T, n int) []string {
	t.Helper()
	for i := range n {
		select {
		case <-r.done:
		case <-time.After(10 * time.Second):
			t.Fatalf("%d of %d tasks started", i, n)
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.started)
}

// idle waits until d's goroutine has ended, failing the test after a while.
func idle(t *testing.T, d *dueLoop) {
	t.Helper()
	for range 1000 {
		d.mu.Lock()
		running := d.running
		d.mu.Unlock()
		if !running {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatal("the loop still runs with nothing due")
}

// TestDueLoopStartsInDueOrder: tasks added in any order are started in the order
// they fall due, none before its time; an entry added ahead of the one the loop
// waits for is started first; the loop's goroutine ends when nothing is left, and
// starts again with the next task.
func TestDueLoopStartsInDueOrder(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	r := newDueRecorder()
	d := newDueLoop(r.start)
	const step = 20 * time.Millisecond
	t0 := time.Now()
	dues := map[string]time.Time{}
	for _, i := range []int{5, 2, 4, 1, 3} {
		tk := fmt.Sprint("t", i)
		dues[tk] = t0.Add(time.Duration(i) * step)
		d.add(dues[tk], parkedTask{ticket: tk})
	}
	d.add(t0, parkedTask{ticket: "t0"}) // ahead of the one the loop waits for
	got := r.wait(t, 6)
	if want := []string{"t0", "t1", "t2", "t3", "t4", "t5"}; !slices.Equal(got, want) {
		t.Errorf("started %v, want %v", got, want)
	}
	idle(t, d)
	if n := d.size(); n != 0 {
		t.Errorf("%d tasks left, want none", n)
	}

	d.add(time.Now(), parkedTask{ticket: "again"})
	if got := r.wait(t, 1); got[len(got)-1] != "again" {
		t.Errorf("started %v after the loop had ended, want again last", got)
	}
	idle(t, d)
}

// TestDueLoopNotBeforeItsTime: a task is started at its due time, not before.
func TestDueLoopNotBeforeItsTime(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	var (
		mu sync.Mutex
		at time.Time
	)
	done := make(chan struct{})
	d := newDueLoop(func(context.Context, parkedTask) string {
		mu.Lock()
		at = time.Now()
		mu.Unlock()
		close(done)
		return ""
	})
	due := time.Now().Add(50 * time.Millisecond)
	d.add(due, parkedTask{ticket: "t"})
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("never started")
	}
	mu.Lock()
	defer mu.Unlock()
	if at.Before(due) {
		t.Errorf("started %v before it was due", due.Sub(at))
	}
	idle(t, d)
}

// TestDueLoopParkedAgainReplaces: a task parked again before it was started is
// started once, at its new time.
func TestDueLoopParkedAgainReplaces(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	r := newDueRecorder()
	d := newDueLoop(r.start)
	t0 := time.Now()
	d.add(t0.Add(time.Hour), parkedTask{ticket: "a"})
	d.add(t0.Add(40*time.Millisecond), parkedTask{ticket: "b"})
	d.add(t0.Add(20*time.Millisecond), parkedTask{ticket: "a"}) // parked again, earlier
	got := r.wait(t, 2)
	if want := []string{"a", "b"}; !slices.Equal(got, want) {
		t.Errorf("started %v, want %v", got, want)
	}
	idle(t, d)
	if got := r.wait(t, 0); len(got) != 2 {
		t.Errorf("started %v, want a and b once each", got)
	}
}

// TestDueLoopDrop: a task dropped (it came early and runs) is not started; the
// others are, and the loop ends.
func TestDueLoopDrop(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	r := newDueRecorder()
	d := newDueLoop(r.start)
	t0 := time.Now()
	d.add(t0.Add(30*time.Millisecond), parkedTask{ticket: "a"})
	d.add(t0.Add(20*time.Millisecond), parkedTask{ticket: "b"})
	d.add(t0.Add(40*time.Millisecond), parkedTask{ticket: "c"})
	d.drop("a")
	d.drop("gone") // nothing due for it
	got := r.wait(t, 2)
	idle(t, d)
	if want := []string{"b", "c"}; !slices.Equal(got, want) {
		t.Errorf("started %v, want %v", got, want)
	}
}

// TestLeadFollowsTheDispatchLag: tasks that come late for their start make the lead
// (how early the due loop starts one) grow toward their lag and a half, so that a
// queue with a backlog does not make every parked task late; one that came by its
// fallback, very late, moves it only so far; tasks on time bring it back down, never
// below startEarly nor above a claim.
func TestLeadFollowsTheDispatchLag(t *testing.T) {
	m := &middleware{config: config{ttl: 30 * time.Second}}
	if got := m.lead(); got != startEarly {
		t.Fatalf("lead before any sample = %v, want startEarly (%v)", got, startEarly)
	}
	for range 40 { // a queue whose tasks wait 800 ms for a worker
		m.sawLag(800*time.Millisecond - m.lead())
	}
	if got := m.lead(); got < time.Second || got > 1300*time.Millisecond {
		t.Fatalf("lead after a steady lag of 800ms = %v, want about 1.2s", got)
	}
	before := m.lead()
	m.sawLag(m.claim()) // came by its fallback
	if got := m.lead(); got > 2*before {
		t.Errorf("one fallback moved the lead from %v to %v", before, got)
	}
	for range 60 { // the backlog is gone: tasks come early
		m.sawLag(20*time.Millisecond - m.lead())
	}
	if got := m.lead(); got != startEarly {
		t.Errorf("lead after the backlog = %v, want back at startEarly (%v)", got, startEarly)
	}
	for range 100 {
		m.sawLag(time.Hour)
	}
	if got := m.lead(); got != m.claim() {
		t.Errorf("lead under an endless lag = %v, want a claim (%v)", got, m.claim())
	}
}

// TestDueLoopDropsOnlyWhatWasSetBefore: a release drops the look at its key's line
// set before it, not one a task parked behind the new holder set since.
func TestDueLoopDropsOnlyWhatWasSetBefore(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	r := newDueRecorder()
	d := newDueLoop(r.start)
	released := time.Now()
	time.Sleep(time.Millisecond) // set strictly after the release
	d.add(time.Now().Add(50*time.Millisecond), parkedTask{ticket: "later"})
	d.dropSetBefore("later", released)
	if got := d.size(); got != 1 {
		t.Fatalf("%d entries after dropping those set before the release, want the later one kept", got)
	}
	d.dropSetBefore("later", time.Now())
	if got := d.size(); got != 0 {
		t.Fatalf("%d entries after dropping those set before now, want none", got)
	}
	idle(t, d)
}

// TestParkUntilFallsBackAfterItsTime: however early the lead has a parked task
// started, its fallback comes a claim after its own time, never before.
func TestParkUntilFallsBackAfterItsTime(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	r := newDueRecorder()
	m := &middleware{config: config{ttl: 10 * time.Second}, due: newDueLoop(r.start), rates: &ratelimit.Limiter{}}
	m.lag.Store(int64(5 * time.Second)) // a lead of a claim: tasks were coming late
	tk := &task{meta: taskMeta{id: "i", queue: "q"}}
	due := time.Now().Add(1500 * time.Millisecond)
	if back := m.parkUntil(tk, "k", due); back < time.Until(due)+m.claim() {
		t.Errorf("fallback %v, want at least the time to its start (%v) and a claim (%v)", back, time.Until(due), m.claim())
	}
	r.wait(t, 1) // started at once: its lead is longer than the time to its start
	idle(t, m.due)
}
