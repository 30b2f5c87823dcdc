package integration

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynqmutex/asynqmutex"
)

// tally counts a middleware's events by operation and policy ("limited:park"), and
// keeps the IDs of the tasks passed over.
type tally struct {
	mu     sync.Mutex
	n      map[string]int
	passed []string
	paused time.Time     // when the first OpPaused was seen
	back   time.Duration // its task's RetryIn
}

func newTally() *tally { return &tally{n: map[string]int{}} }

func (c *tally) observe(_ context.Context, e asynqmutex.Event) {
	c.mu.Lock()
	defer c.mu.Unlock()
	k := e.Op.String()
	if e.Policy != "" {
		k += ":" + e.Policy
	}
	c.n[k]++
	switch e.Op {
	case asynqmutex.OpParkPassedOver:
		c.passed = append(c.passed, e.TaskID)
	case asynqmutex.OpPaused:
		if c.paused.IsZero() {
			c.paused = time.Now()
			if le := (*asynqmutex.LockedError)(nil); errors.As(e.Err, &le) {
				c.back = le.RetryIn
			}
		}
	}
}

func (c *tally) count(k string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[k]
}

func (c *tally) String() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return fmt.Sprint(c.n)
}

// rateParkFleet starts two asynq servers (Concurrency 4 each) whose middleware
// limits tenant_id to n starts per per under the default policy, Park, with the
// parking tests' TTL and opts; handle runs in each handler after its start is
// recorded.
func rateParkFleet(t *testing.T, e *env, n int, per time.Duration, st *starts, tr *tracker, ev *tally, handle func(context.Context, tenantPayload) error, opts ...asynqmutex.Option) {
	t.Helper()
	for _, name := range []string{"A", "B"} {
		locks, _ := newLocks(t, e.opt)
		mw := asynqmutex.Middleware(locks, append([]asynqmutex.Option{asynqmutex.On("tenant_id"), asynqmutex.Rate(n, per), asynqmutex.TTL(parkTTL),
			asynqmutex.Observe(ev.observe)}, opts...)...)
		startServer(t, e.opt, asynqmutex.Configure(asynq.Config{Concurrency: 4}), mw(asynq.HandlerFunc(
			func(ctx context.Context, task *asynq.Task) error {
				var p tenantPayload
				if err := json.Unmarshal(task.Payload(), &p); err != nil {
					return err
				}
				st.record(ctx, p)
				tr.enter(p.Tenant, fmt.Sprint(p.Seq), name)
				defer tr.exit(p.Tenant)
				return handle(ctx, p)
			})))
	}
}

// TestRateParkBacklog: a backlog of one key under Rate(10, time.Second), on two
// servers with eight workers, drains at its limit: every task refused at its rate
// parks with its start reserved (none is sent back for a whole second, as before),
// and is started when that start falls due. Every task runs once, no retry is spent,
// and the starts Redis handed out hold no more than the limit in any window (the
// checker, mostInWindow, trips on TestMostInWindowTrips's history). The drain and
// the handlers' own window counts are reported, not checked: a handler that begins
// late shares a window with the next one, and a task later than an interval gives
// its start up and takes one behind the backlog (about 0.96 of the limit and 11 in a
// window on a quiet machine; a loaded one, whose tasks come back later, drains
// slower).
func TestRateParkBacklog(t *testing.T) {
	t.Parallel()
	const tasks, n = 30, 10
	per := time.Second
	interval := per / n
	e := newEnv(t)
	st, tr, ev := newStarts(), newTracker(), newTally()
	for i := range tasks {
		e.enqueue(t, "sync", payload(t, tenantPayload{Tenant: "A", Seq: i}), asynq.MaxRetry(3), asynq.Retention(time.Hour))
	}
	rateParkFleet(t, e, n, per, st, tr, ev, func(context.Context, tenantPayload) error {
		time.Sleep(interval / 10)
		return nil
	})
	checkAllCompleted(t, e, tr, tasks)
	t.Logf("events: %v", ev)
	if st.retried != 0 {
		t.Errorf("%d retries spent, want none", st.retried)
	}
	if got := ev.count("limited:retry"); got != 0 {
		t.Errorf("%d tasks refused at their rate were sent back, want every one parked", got)
	}
	if ev.count("limited:park") == 0 || ev.count("park_started") == 0 {
		t.Errorf("no task parked at its rate and was started: the backlog did not test parking")
	}
	// A task that meets the lock busy while its start comes later parks until that
	// start, not in the lock's line (TestStartLaterParksOutsideTheLine); one that comes
	// back late for its start, on a busy machine, finds the lock held by the task
	// before it and joins the line: how many do is the machine's, reported.
	t.Logf("%d of %d tasks parked in the lock's line", ev.count("conflict:park"), tasks)
	sched := rateSchedule(t, e, lockKey(t, "sync", "A"))
	if len(sched) < tasks {
		t.Errorf("Redis handed out %d starts, want one per task at least, %d", len(sched), tasks)
	}
	if most, where := mostInWindow(sched, per); most > n {
		t.Errorf("Redis handed out %d starts in one window of %v from +%v, want at most %d", most, per, where, n)
	}
	at := st.of("A")
	most, where := mostInWindow(at, per)
	drain, ideal := at[len(at)-1].Sub(at[0]), time.Duration(tasks-1)*interval
	t.Logf("%d starts handed out for %d tasks; handlers saw at most %d in one %v window (at +%v); drain %v, ideal %v (%.2f of the limit)",
		len(sched), tasks, most, per, where, drain, ideal, float64(ideal)/float64(drain))
}

// TestRateParkDeletedPassedOver: a task parked with its start reserved and deleted
// before that start is passed over when it falls due (OpParkPassedOver names it),
// and the key's other tasks go on starting: every one completes, once, with no
// retry spent. Its start lapses unused. NoLock: no task parks in a lock's line, so
// the one passed over can only have parked for its start.
func TestRateParkDeletedPassedOver(t *testing.T) {
	t.Parallel()
	const tasks, n = 8, 4
	// Starts half a second apart: the last reserved waits parked for its start (3.5 s
	// after the first) long enough to be seen so on a busy machine.
	per := 2 * time.Second
	e := newEnv(t)
	st, tr, ev := newStarts(), newTracker(), newTally()
	for i := range tasks {
		e.enqueue(t, "sync", payload(t, tenantPayload{Tenant: "A", Seq: i}), asynq.MaxRetry(3), asynq.Retention(time.Hour),
			asynq.TaskID(fmt.Sprint("seq-", i)))
	}
	rateParkFleet(t, e, n, per, st, tr, ev, func(context.Context, tenantPayload) error { return nil }, asynqmutex.NoLock())
	// The victim: of the tasks parked, the one due back last (its fallback follows its
	// start), so the latest start reserved. Which task reserved which start is the
	// servers' race to the limiter.
	var victim string
	waitFor(t, 10*time.Second, "half the tasks parked", func() (bool, string) {
		parked, err := e.insp.ListRetryTasks("default")
		if err != nil || len(parked) < tasks/2 {
			return false, fmt.Sprintf("%d parked (%v)", len(parked), err)
		}
		last := parked[0]
		for _, p := range parked {
			if p.NextProcessAt.After(last.NextProcessAt) {
				last = p
			}
		}
		victim = last.ID
		return true, ""
	})
	if err := e.insp.DeleteTask("default", victim); err != nil {
		t.Fatalf("DeleteTask(%s): %v", victim, err)
	}
	waitFor(t, parkTTL, "the deleted task passed over and the others done", func() (bool, string) {
		q, err := e.insp.GetQueueInfo("default")
		if err != nil {
			return false, err.Error()
		}
		ev.mu.Lock()
		passed := fmt.Sprint(ev.passed)
		ev.mu.Unlock()
		return q.Completed == tasks-1 && passed == "["+victim+"]", fmt.Sprintf("completed=%d retry=%d; passed over %s; events %v", q.Completed, q.Retry, passed, ev)
	})
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.retried != 0 {
		t.Errorf("%d retries spent, want none", st.retried)
	}
	for seq := range tasks {
		switch want := 1; {
		case fmt.Sprint("seq-", seq) == victim && st.runs[seq] != 0:
			t.Errorf("the deleted task ran %d times", st.runs[seq])
		case fmt.Sprint("seq-", seq) != victim && st.runs[seq] != want:
			t.Errorf("task %d ran %d times, want 1", seq, st.runs[seq])
		}
	}
}

// startsDuring is the starts of at that fall inside (from, to).
func startsDuring(at []time.Time, from, to time.Time) []time.Time {
	var in []time.Time
	for _, s := range at {
		if s.After(from) && s.Before(to) {
			in = append(in, s)
		}
	}
	return in
}

// TestStartsDuringTrips: the pause checker's positive control.
func TestStartsDuringTrips(t *testing.T) {
	t0 := time.Now()
	at := []time.Time{t0, t0.Add(time.Second), t0.Add(3 * time.Second)}
	if in := startsDuring(at, t0.Add(500*time.Millisecond), t0.Add(2*time.Second)); len(in) != 1 {
		t.Errorf("startsDuring = %v, want the start at +1s", in)
	}
	if in := startsDuring(at[:1], t0.Add(500*time.Millisecond), t0.Add(2*time.Second)); len(in) != 0 {
		t.Errorf("startsDuring = %v, want none", in)
	}
}

// TestRateParkPause: a handler pauses its key while the key's backlog is parked
// with starts reserved: no task of the key starts during the pause, neither those
// whose reserved start fell in it (started, they find it given up and park again
// for a start after the pause) nor the task that asked for it, which parks until
// the pause's end rather than be sent back. After it, every task completes once
// (the pausing one twice), no retry spent, and every refusal parked. The pause is
// known to hold once the middleware reports it (OpPaused), at p0; it began on the
// server a little earlier, and ends as much before p0 + pause; a start confirmed
// just before it may record its time up to an interval later, so the check leaves
// an interval at either end.
func TestRateParkPause(t *testing.T) {
	t.Parallel()
	const tasks, n = 16, 10
	per := time.Second
	interval := per / n
	pause := 15 * interval // 1.5s, within the reservations' reach
	e := newEnv(t)
	st, tr, ev := newStarts(), newTracker(), newTally()
	for i := range tasks {
		e.enqueue(t, "sync", payload(t, tenantPayload{Tenant: "A", Seq: i}), asynq.MaxRetry(3), asynq.Retention(time.Hour))
	}
	var first atomic.Bool
	rateParkFleet(t, e, n, per, st, tr, ev, func(_ context.Context, p tenantPayload) error {
		if p.Seq == 3 && first.CompareAndSwap(false, true) {
			return asynqmutex.PauseKey(pause, errors.New("HTTP 429: Retry-After"))
		}
		return nil
	})
	waitFor(t, 40*time.Second, "every task completed", func() (bool, string) {
		q, err := e.insp.GetQueueInfo("default")
		if err != nil {
			return false, err.Error()
		}
		return q.Completed == tasks, fmt.Sprintf("completed=%d retry=%d archived=%d; events %v", q.Completed, q.Retry, q.Archived, ev)
	})
	t.Logf("events: %v", ev)
	ev.mu.Lock()
	p0, back := ev.paused, ev.back
	ev.mu.Unlock()
	if p0.IsZero() {
		t.Fatal("the task that pauses never ran")
	}
	if back < pause+parkTTL {
		t.Errorf("the task that paused was sent back for %v, want parked: started at the pause's end, back by itself a TTL (%v) after it", back, parkTTL)
	}
	at := st.of("A")
	if in := startsDuring(at, p0.Add(interval), p0.Add(pause-interval)); len(in) != 0 {
		for _, s := range in {
			t.Logf("a start at +%v of the pause", s.Sub(p0))
		}
		t.Errorf("%d tasks of the paused key started during its pause of %v", len(in), pause)
	}
	if after := startsDuring(at, p0.Add(pause-interval), p0.Add(time.Hour)); len(after) == 0 {
		t.Errorf("no task started after the pause: the check saw nothing to hold back")
	}
	if got := ev.count("limited:retry"); got != 0 {
		t.Errorf("%d tasks refused at their rate or pause were sent back, want every one parked", got)
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.retried != 0 {
		t.Errorf("%d retries spent, want none: a pause is not a failure", st.retried)
	}
	for seq := range tasks {
		want := 1
		if seq == 3 {
			want = 2
		}
		if st.runs[seq] != want {
			t.Errorf("task %d ran %d times, want %d", seq, st.runs[seq], want)
		}
	}
}
