package integration

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynqmutex/asynqmutex"
	"github.com/asynqmutex/asynqmutex/internal/rediskey"
)

// starts records when each task's handler began, per tenant, and with how many
// retries spent.
type starts struct {
	mu      sync.Mutex
	at      map[string][]time.Time
	runs    map[int]int
	retried int
}

func newStarts() *starts { return &starts{at: map[string][]time.Time{}, runs: map[int]int{}} }

func (s *starts) record(ctx context.Context, p tenantPayload) {
	n, _ := asynq.GetRetryCount(ctx)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.at[p.Tenant] = append(s.at[p.Tenant], time.Now())
	s.runs[p.Seq]++
	s.retried += n
}

func (s *starts) of(tenant string) []time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.SortedFunc(slices.Values(s.at[tenant]), func(a, b time.Time) int { return a.Compare(b) })
}

// mostInWindow is the largest number of times, sorted, that fall in any window of
// length w, and the offset from the first time at which that window starts.
func mostInWindow(times []time.Time, w time.Duration) (int, time.Duration) {
	most, at := 0, time.Duration(0)
	j := 0
	for i := range times {
		for times[i].Sub(times[j]) >= w {
			j++
		}
		if n := i - j + 1; n > most {
			most, at = n, times[j].Sub(times[0])
		}
	}
	return most, at
}

// TestMostInWindowTrips: the window checker counts what it should (its positive
// control: a history with n+2 starts in one window must report them).
func TestMostInWindowTrips(t *testing.T) {
	t0 := time.Now()
	var h []time.Time
	for i := range 10 {
		h = append(h, t0.Add(time.Duration(i)*100*time.Millisecond)) // 10 a second
	}
	if n, _ := mostInWindow(h, time.Second); n != 10 {
		t.Errorf("mostInWindow(10 evenly in 1s) = %d, want 10", n)
	}
	h = append(h, t0.Add(950*time.Millisecond), t0.Add(960*time.Millisecond))
	slices.SortFunc(h, func(a, b time.Time) int { return a.Compare(b) })
	if n, _ := mostInWindow(h, time.Second); n != 12 {
		t.Errorf("mostInWindow with 2 extra = %d, want 12", n)
	}
	if n, _ := mostInWindow(h, 100*time.Millisecond); n != 3 {
		t.Errorf("mostInWindow(100ms) = %d, want 3 (900, 950, 960ms)", n)
	}
}

// TestRateTenants: 200 tasks of 4 tenants on two asynq servers, each with its own
// Client, under On("tenant_id") and Rate(20, time.Second), with MaxWait: every task
// completes once with no retry spent, and the starts Redis handed out (the scores of
// the tenant's rate key: each start's TAT, its time plus one interval) are one per
// task, an interval apart at least, so no window of one second holds more than 20.
//
// With NoLock, tasks take their starts ahead, and each tenant drains within 1.2 times
// the ideal, 49 intervals from its first start to its last, as its handlers see it:
// the servers have a worker for every task, so that every task takes its start as
// soon as the servers begin, and the drain is the limiter's alone, not how fast a
// loaded machine dispatches tasks (with 32 workers holding tasks for their starts,
// 80 a second had to be dispatched to keep up).
// With the lock, a tenant's next task takes its start only once the previous one has
// finished and handed the lock over: the rate is reached while that takes less than an
// interval, which a loaded machine does not promise, so its drain time is only
// reported. The handlers' own clock readings are reported too, not checked: a handler
// that begins late for its start (a slow machine) shares a window with the next one's.
func TestRateTenants(t *testing.T) {
	t.Parallel()
	for _, lock := range []bool{true, false} {
		t.Run(fmt.Sprintf("lock=%v", lock), func(t *testing.T) {
			t.Parallel()
			const tasks, tenants, n = 200, 4, 20
			per := time.Second
			interval := per / n
			e := newEnv(t)
			st := newStarts()
			tr := newTracker()
			var hook hookRecorder
			// Every task is queued before the servers start, so that the drain is the
			// limiter's, not how fast this process enqueues (on a busy machine, slower
			// than 20 a second).
			for i := range tasks {
				e.enqueue(t, "sync", payload(t, tenantPayload{Tenant: fmt.Sprintf("tenant-%d", i%tenants), Seq: i}),
					asynq.MaxRetry(3), asynq.Retention(time.Hour))
			}
			for _, name := range []string{"A", "B"} {
				locks, _ := newLocks(t, e.opt)
				opts := []asynqmutex.Option{asynqmutex.On("tenant_id"), asynqmutex.Rate(n, per),
					// Long enough for a tenant's whole drain, twice over.
					asynqmutex.MaxWait(2 * tasks / tenants * interval), asynqmutex.AfterFailure(hook.hook)}
				if !lock {
					opts = append(opts, asynqmutex.NoLock())
				}
				concurrency := 16
				if !lock {
					concurrency = tasks / 2
				}
				startServer(t, e.opt, asynqmutex.Configure(asynq.Config{Concurrency: concurrency}), asynqmutex.Middleware(locks, opts...)(asynq.HandlerFunc(
					func(ctx context.Context, task *asynq.Task) error {
						var p tenantPayload
						if err := json.Unmarshal(task.Payload(), &p); err != nil {
							return err
						}
						st.record(ctx, p)
						tr.enter(p.Tenant, fmt.Sprint(p.Seq), name)
						defer tr.exit(p.Tenant)
						time.Sleep(interval / 10)
						return nil
					})))
			}
			checkAllCompleted(t, e, tr, tasks)
			if n := hook.count(); n != 0 {
				t.Errorf("AfterFailure called %d times, want 0: %v", n, hook.calls())
			}
			if st.retried != 0 {
				t.Errorf("%d retries spent, want none", st.retried)
			}
			ideal := time.Duration(tasks/tenants-1) * interval
			for i := range tenants {
				tenant := fmt.Sprintf("tenant-%d", i)
				sched := rateSchedule(t, e, lockKey(t, "sync", tenant))
				if len(sched) != tasks/tenants {
					t.Errorf("%s: Redis handed out %d starts, want one per task, %d", tenant, len(sched), tasks/tenants)
				}
				if most, where := mostInWindow(sched, per); most > n {
					t.Errorf("%s: Redis handed out %d starts in one window of %v from +%v, want at most %d", tenant, most, per, where, n)
				}
				at := st.of(tenant)
				most, where := mostInWindow(at, per)
				drain := at[len(at)-1].Sub(at[0])
				span := sched[len(sched)-1].Sub(sched[0])
				t.Logf("%s: %d starts; handlers saw at most %d in one %v window (at +%v) and a drain of %v (Redis's schedule %v, ideal %v)", tenant, len(at), most, per, where, drain, span, ideal)
				// The drain is the limiter's: the handlers follow the schedule Redis
				// handed out, which on a quiet machine is the ideal (on a busy one,
				// asynq dispatches the tasks late, and the schedule with them).
				if !lock && drain > span+2*interval {
					t.Errorf("%s: drained in %v, want within two intervals of Redis's schedule, %v", tenant, drain, span)
				}
			}
		})
	}
}

// rateSchedule is the starts the rate key of key holds, as times, earliest first:
// each score is minus a start's TAT, its time plus one interval, in microseconds of
// the server's clock (ratelimit/layout.go).
func rateSchedule(t *testing.T, e *env, key string) []time.Time {
	t.Helper()
	zs, err := e.rdb.ZRangeWithScores(context.Background(), "asynqmutex:rate:{"+rediskey.Encode(key)+"}", 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	var at []time.Time
	for _, z := range zs {
		// Not the pause, nor the marks of starts given back (positive scores).
		if m, _ := z.Member.(string); z.Score < 0 && !strings.HasPrefix(m, "~") {
			at = append(at, time.UnixMicro(-int64(z.Score)))
		}
	}
	slices.SortFunc(at, func(a, b time.Time) int { return a.Compare(b) })
	return at
}

// TestPauseKeyStopsOnlyItsKey: a handler of tenant A returns PauseKey: no task of A
// starts on either server until the pause ends, not even those that had taken their
// start ahead (NoLock lets many wait at once), tenant B's tasks run on meanwhile, and
// every task completes once with no retry spent (the paused one comes back). The
// pause is known to hold once the middleware reports it (OpPaused), at p0; it began
// on the server a little earlier, and ends as much before p0 + pause. A start
// confirmed just before it may record its time up to an interval later, so the check
// leaves an interval at either end.
func TestPauseKeyStopsOnlyItsKey(t *testing.T) {
	t.Parallel()
	const n = 20
	per := time.Second
	interval := per / n
	pause := 40 * interval // 2s
	e := newEnv(t)
	st := newStarts()
	tr := newTracker()
	var (
		mu       sync.Mutex
		pausedAt time.Time
		first    atomic.Bool
	)
	for _, name := range []string{"A", "B"} {
		locks, _ := newLocks(t, e.opt)
		mw := asynqmutex.Middleware(locks, asynqmutex.On("tenant_id"), asynqmutex.Rate(n, per), asynqmutex.NoLock(),
			asynqmutex.MaxWait(4*pause), asynqmutex.Observe(func(_ context.Context, e asynqmutex.Event) {
				if e.Op == asynqmutex.OpPaused {
					mu.Lock()
					pausedAt = time.Now()
					mu.Unlock()
				}
			}))
		startServer(t, e.opt, asynqmutex.Configure(asynq.Config{Concurrency: 8}), mw(asynq.HandlerFunc(
			func(ctx context.Context, task *asynq.Task) error {
				var p tenantPayload
				if err := json.Unmarshal(task.Payload(), &p); err != nil {
					return err
				}
				st.record(ctx, p)
				tr.enter(p.Tenant, fmt.Sprint(p.Seq), name)
				defer tr.exit(p.Tenant)
				if p.Seq == 4 && first.CompareAndSwap(false, true) {
					return asynqmutex.PauseKey(pause, errors.New("HTTP 429: Retry-After"))
				}
				return nil
			})))
	}
	const tasks = 40
	for i := range tasks {
		e.enqueue(t, "sync", payload(t, tenantPayload{Tenant: []string{"A", "B"}[i%2], Seq: i}),
			asynq.MaxRetry(3), asynq.Retention(time.Hour))
	}
	// The paused task runs twice: once to pause, once after.
	waitFor(t, 40*time.Second, "every task completed", func() (bool, string) {
		q, err := e.insp.GetQueueInfo("default")
		if err != nil {
			return false, err.Error()
		}
		return q.Completed == tasks, fmt.Sprintf("completed=%d retry=%d archived=%d", q.Completed, q.Retry, q.Archived)
	})
	mu.Lock()
	p0 := pausedAt
	mu.Unlock()
	if p0.IsZero() {
		t.Fatal("the task that pauses never ran")
	}
	var during, bDuring int
	for _, at := range st.of("A") {
		// The pause began on the server before p0: it ends before p0 + pause.
		if at.After(p0.Add(interval)) && at.Before(p0.Add(pause-interval)) {
			t.Logf("a start of A at +%v of the pause", at.Sub(p0))
			during++
		}
	}
	for _, at := range st.of("B") {
		if at.After(p0) && at.Before(p0.Add(pause)) {
			bDuring++
		}
	}
	t.Logf("pause of %v: %d starts of A during it, %d of B", pause, during, bDuring)
	if during != 0 {
		t.Errorf("%d tasks of the paused tenant started during its pause", during)
	}
	if bDuring == 0 && len(st.of("B")) == tasks/2 && st.of("B")[tasks/2-1].After(p0.Add(pause)) {
		t.Errorf("tenant B started nothing during A's pause, though it had tasks left")
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.retried != 0 {
		t.Errorf("%d retries spent, want none: a pause is not a failure", st.retried)
	}
	for seq := range tasks {
		want := 1
		if seq == 4 {
			want = 2
		}
		if st.runs[seq] != want {
			t.Errorf("task %d ran %d times, want %d", seq, st.runs[seq], want)
		}
	}
}

// TestPauseKeyTaskReturnsAfterItsPause: a task whose handler asks for a pause of a
// second is not run again before that second has passed, though asynq keeps retry
// times in whole seconds, cut short. Without a rate gate nothing else holds it back,
// so its own return is what is measured; eight tasks make a return across a second's
// boundary, the case that came back early, all but certain.
func TestPauseKeyTaskReturnsAfterItsPause(t *testing.T) {
	t.Parallel()
	const tasks, pause = 8, time.Second
	e := newEnv(t)
	locks, _ := newLocks(t, e.opt)
	var (
		mu       sync.Mutex
		asked    = map[string]time.Time{} // when each task's first run returned its pause
		returned = map[string]time.Duration{}
	)
	mw := asynqmutex.Middleware(locks, asynqmutex.On("tenant_id"), asynqmutex.Logger(slog.New(slog.DiscardHandler)))
	startServer(t, e.opt, asynqmutex.Configure(asynq.Config{Concurrency: tasks}), mw(asynq.HandlerFunc(
		func(ctx context.Context, task *asynq.Task) error {
			id, _ := asynq.GetTaskID(ctx)
			mu.Lock()
			defer mu.Unlock()
			if at, ok := asked[id]; ok {
				returned[id] = time.Since(at)
				return nil
			}
			asked[id] = time.Now()
			return asynqmutex.PauseKey(pause, errors.New("HTTP 429"))
		})))
	for i := range tasks {
		e.enqueue(t, "sync", payload(t, tenantPayload{Tenant: fmt.Sprint("t", i), Seq: i}))
	}
	waitFor(t, 30*time.Second, "every task ran again", func() (bool, string) {
		mu.Lock()
		defer mu.Unlock()
		return len(returned) == tasks, fmt.Sprintf("%d of %d back", len(returned), tasks)
	})
	mu.Lock()
	defer mu.Unlock()
	for id, after := range returned {
		if after < pause {
			t.Errorf("task %s ran again %v after asking for a pause of %v", id, after, pause)
		}
	}
}
