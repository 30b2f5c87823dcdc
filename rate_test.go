package asynqmutex

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/asynqmutex/asynqmutex/mutex"
	"github.com/asynqmutex/asynqmutex/ratelimit"
)

// events collects the middleware's Events.
type events struct {
	mu sync.Mutex
	e  []Event
}

func (r *events) observe(_ context.Context, e Event) {
	r.mu.Lock()
	r.e = append(r.e, e)
	r.mu.Unlock()
}

func (r *events) ops() []Op {
	r.mu.Lock()
	defer r.mu.Unlock()
	var ops []Op
	for _, e := range r.e {
		ops = append(ops, e.Op)
	}
	return ops
}

func (r *events) last() Event {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.e[len(r.e)-1]
}

func tenantTask(tenant string) *asynq.Task {
	return asynq.NewTask("sync", []byte(`{"tenant":"`+tenant+`"}`))
}

func rates(locks *mutex.Client) *ratelimit.Limiter {
	return ratelimit.New(locks.Redis(), ratelimit.Prefix(locks.Prefix()))
}

// Starts of one key are spaced by the limit's interval, whoever takes them: no
// task starts before the first start plus its place times the interval. The bound
// is from below only; how promptly a task starts is the integration tests' question.
func TestRateSpacesStarts(t *testing.T) {
	for _, lock := range []bool{true, false} {
		t.Run(fmt.Sprintf("lock=%v", lock), func(t *testing.T) {
			locks, _ := newLocks(t)
			const per, n, tasks = time.Second, 10, 5 // a start every 100ms
			opts := []Option{On("tenant"), Rate(n, per), MaxWait(time.Minute)}
			if !lock {
				opts = append(opts, NoLock())
			}
			var (
				mu     sync.Mutex
				starts []time.Time
				ev     events
			)
			h := Middleware(locks, append(opts, Observe(ev.observe))...)(asynq.HandlerFunc(func(context.Context, *asynq.Task) error {
				mu.Lock()
				starts = append(starts, time.Now())
				mu.Unlock()
				return nil
			}))
			t0 := time.Now()
			var wg sync.WaitGroup
			for range tasks {
				wg.Add(1)
				go func() { defer wg.Done(); assert.NoError(t, h.ProcessTask(context.Background(), tenantTask("a"))) }()
			}
			wg.Wait()
			slices.SortFunc(starts, func(a, b time.Time) int { return a.Compare(b) })
			require.Len(t, starts, tasks)
			for i, s := range starts {
				if min := t0.Add(time.Duration(i) * per / n); s.Before(min) {
					t.Errorf("start %d at %v after the first call, before its slot at %v", i, s.Sub(t0), min.Sub(t0))
				}
			}
		})
	}
}

// A task that waits for its start is reported, with the wait, before it runs.
func TestRateWaitedEvent(t *testing.T) {
	locks, _ := newLocks(t)
	var ev events
	const per = time.Second // the second start comes a second after the first
	h := Middleware(locks, On("tenant"), Rate(1, per), MaxWait(time.Minute), Observe(ev.observe))(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return nil }))
	require.NoError(t, h.ProcessTask(context.Background(), tenantTask("a")))
	assert.Empty(t, ev.ops(), "the first start waits for nothing")
	require.NoError(t, h.ProcessTask(context.Background(), tenantTask("a")))
	require.Equal(t, []Op{OpRateWaited}, ev.ops())
	if w := ev.last().Wait; w <= 0 || w > per {
		t.Errorf("OpRateWaited.Wait = %v, want up to %v", w, per)
	}
	assert.Equal(t, Event{Op: OpRateWaited, TaskType: "sync", Key: `["sync","a"]`}, stripped(ev.last()))
}

func TestRateLimitedPolicies(t *testing.T) {
	locks, _ := newLocks(t)
	ctx := context.Background()
	ran := 0
	handler := asynq.HandlerFunc(func(context.Context, *asynq.Task) error { ran++; return nil })
	var (
		r  recorder
		ev events
	)
	mw := func(p Policy) asynq.Handler {
		return Middleware(locks, On("tenant"), Rate(1, time.Minute), OnConflict(p), AfterFailure(r.hook), Observe(ev.observe))(handler)
	}
	require.NoError(t, mw(Skip).ProcessTask(ctx, tenantTask("a")))
	require.Equal(t, 1, ran)

	err := mw(RetryLater(time.Second)).ProcessTask(ctx, tenantTask("a"))
	var le *LockedError
	require.ErrorAs(t, err, &le)
	assert.True(t, errors.Is(err, ratelimit.ErrLimited) && errors.Is(err, mutex.ErrNotObtained), "wraps ErrLimited and ErrNotObtained")
	assert.Equal(t, time.Minute, le.RetryIn, "the time until a start is free, in whole seconds, not RetryLater's delay")
	assert.False(t, IsFailure(err), "Configure spends no retry on it")
	assert.Contains(t, err.Error(), `key ["sync","a"] is at its rate limit (1 per 1m0s): next start in`)
	assert.Equal(t, Event{Op: OpLimited, TaskType: "sync", Key: `["sync","a"]`, Policy: "retry"}, stripped(ev.last()))

	require.NoError(t, mw(Skip).ProcessTask(ctx, tenantTask("a")))
	assert.Equal(t, "skip", ev.last().Policy)
	err = mw(Fail).ProcessTask(ctx, tenantTask("a"))
	require.ErrorIs(t, err, mutex.ErrNotObtained)
	assert.True(t, IsFailure(err), "Fail spends a retry")
	assert.Len(t, r.got(), 3, "AfterFailure hears of every limited task")

	require.NoError(t, mw(Skip).ProcessTask(ctx, tenantTask("b")), "another key has its own limit")
	assert.Equal(t, 2, ran)
}

// stripped is e without its Wait and Err, which vary.
func stripped(e Event) Event {
	e.Wait, e.Err = 0, nil
	return e
}

// A task takes its lock before its start: one that meets a busy lock spends none.
func TestRateBusyLockSpendsNoStart(t *testing.T) {
	locks, _ := newLocks(t)
	ctx := context.Background()
	busy, err := locks.TryLock(ctx, `["sync","a"]`, time.Minute)
	require.NoError(t, err)
	var ev events
	h := Middleware(locks, On("tenant"), Rate(1, time.Minute), OnConflict(Skip), Observe(ev.observe))(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return nil }))
	require.NoError(t, h.ProcessTask(ctx, tenantTask("a")))
	assert.Equal(t, []Op{OpConflict}, ev.ops())
	st, err := rates(locks).Inspect(ctx, `["sync","a"]`)
	require.NoError(t, err)
	assert.Zero(t, st.Starts, "no start spent behind a busy lock")

	require.NoError(t, busy.Unlock(ctx))
	require.NoError(t, h.ProcessTask(ctx, tenantTask("a")))
	st, _ = rates(locks).Inspect(ctx, `["sync","a"]`)
	assert.Equal(t, 1, st.Starts)
}

func TestPauseKey(t *testing.T) {
	locks, _ := newLocks(t)
	ctx := context.Background()
	var ev events
	calls := 0
	h := Middleware(locks, On("tenant"), Rate(100, time.Second), OnConflict(Skip), Observe(ev.observe))(asynq.HandlerFunc(func(_ context.Context, t *asynq.Task) error {
		calls++
		if strings.Contains(string(t.Payload()), `"a"`) && calls == 1 {
			return PauseKey(30*time.Second, errors.New("HTTP 429"))
		}
		return nil
	}))
	err := h.ProcessTask(ctx, tenantTask("a"))
	var (
		le *LockedError
		pe *PauseError
	)
	require.ErrorAs(t, err, &le)
	require.ErrorAs(t, err, &pe)
	assert.Equal(t, 31*time.Second, le.RetryIn, "sent back for the pause and a second, whatever the policy")
	assert.False(t, IsFailure(err))
	assert.Equal(t, `asynqmutex: task "sync": handler asked to pause key ["sync","a"] for 30s (HTTP 429); retry in 31s`, err.Error())
	assert.Equal(t, Event{Op: OpPaused, TaskType: "sync", Key: `["sync","a"]`}, stripped(ev.last()))
	assert.Equal(t, 30*time.Second, ev.last().Wait)

	require.NoError(t, h.ProcessTask(ctx, tenantTask("a")), "Skip")
	assert.Equal(t, 1, calls, "no task of the paused key runs")
	assert.Equal(t, OpLimited, ev.last().Op)
	assert.Regexp(t, `key \["sync","a"\] is paused for (29\.\d+|30)s$`, ev.last().Err.Error())
	require.NoError(t, h.ProcessTask(ctx, tenantTask("b")))
	assert.Equal(t, 2, calls, "tasks of other keys run")

	// Without a rate gate the task is sent back, and the error says the key was not paused.
	plain := Middleware(locks, On("tenant"))(asynq.HandlerFunc(func(context.Context, *asynq.Task) error {
		return PauseKey(1500*time.Millisecond, nil)
	}))
	err = plain.ProcessTask(ctx, tenantTask("c"))
	require.ErrorAs(t, err, &le)
	assert.Equal(t, 3*time.Second, le.RetryIn)
	assert.Contains(t, err.Error(), "not paused: the middleware has no Rate or RateBy")
}

// TestPauseKeyLogged: a pause a handler asks for is logged at Warn, once: with the
// key, how long, until when and the handler's error; a task whose key another pause
// holds back longer logs nothing. A pause without a rate gate is logged too, saying
// the key was not paused.
func TestPauseKeyLogged(t *testing.T) {
	locks, _ := newLocks(t)
	ctx := context.Background()
	var buf bytes.Buffer
	logger := slog.New(slog.NewTextHandler(&buf, nil))
	lim := ratelimit.PerSecond(100)
	h := Middleware(locks, On("tenant"), Rate(lim.N, lim.Per), Logger(logger))(asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		if strings.Contains(string(t.Payload()), `"longer"`) {
			// Another task's pause, longer than this one's, came first.
			if _, err := rates(locks).Pause(ctx, `["sync","longer"]`, lim, time.Minute); err != nil {
				return err
			}
		}
		return PauseKey(30*time.Second, errors.New("HTTP 429"))
	}))
	before := time.Now()
	require.Error(t, h.ProcessTask(ctx, tenantTask("a")))
	logged := buf.String()
	assert.Equal(t, 1, strings.Count(logged, "a handler asked to pause its key"), logged)
	for _, want := range []string{"level=WARN", `key="[\"sync\",\"a\"]"`, "for=30s", `error="HTTP 429"`, "until="} {
		assert.Contains(t, logged, want)
	}
	until, err := time.Parse(time.RFC3339, regexp.MustCompile(`until=(\S+)`).FindStringSubmatch(logged)[1])
	require.NoError(t, err)
	assert.False(t, until.Before(before.Add(30*time.Second).Truncate(time.Second)), "until %v: the pause's end", until)

	require.Error(t, h.ProcessTask(ctx, tenantTask("longer")))
	assert.Equal(t, 1, strings.Count(buf.String(), "a handler asked to pause its key"), "a key held back longer already logs nothing: %s", buf.String())

	plain := Middleware(locks, On("tenant"), Logger(logger))(asynq.HandlerFunc(func(context.Context, *asynq.Task) error {
		return PauseKey(time.Second, nil)
	}))
	require.Error(t, plain.ProcessTask(ctx, tenantTask("c")))
	assert.Equal(t, 2, strings.Count(buf.String(), "a handler asked to pause its key"), buf.String())
	assert.Contains(t, buf.String(), `not_paused="the middleware has no Rate or RateBy`)
}

func TestRateBy(t *testing.T) {
	locks, _ := newLocks(t)
	ctx := context.Background()
	ran := map[string]int{}
	h := Middleware(locks, On("tenant"), OnConflict(Skip), NoLock(), RateBy(func(_ context.Context, t *asynq.Task) (ratelimit.Rate, error) {
		switch p := string(t.Payload()); {
		case strings.Contains(p, "gold"):
			return ratelimit.Rate{}, nil // no limit
		case strings.Contains(p, "free"):
			return ratelimit.PerMinute(1), nil
		case strings.Contains(p, "bad"):
			return ratelimit.Rate{N: 0, Per: time.Second}, nil
		}
		return ratelimit.Rate{}, errors.New("plan store unreachable")
	}))(asynq.HandlerFunc(func(_ context.Context, t *asynq.Task) error {
		ran[string(t.Payload())]++
		return nil
	}))
	for range 3 {
		require.NoError(t, h.ProcessTask(ctx, tenantTask("gold")))
		require.NoError(t, h.ProcessTask(ctx, tenantTask("free")))
	}
	assert.Equal(t, 3, ran[`{"tenant":"gold"}`])
	assert.Equal(t, 1, ran[`{"tenant":"free"}`])

	err := h.ProcessTask(ctx, tenantTask("bad"))
	assert.ErrorContains(t, err, `asynqmutex: task "sync": RateBy: ratelimit: limit 0 per 1s: N must be at least 1`)
	assert.True(t, IsFailure(err) && !errors.Is(err, asynq.SkipRetry), "an ordinary, retryable error")
	err = h.ProcessTask(ctx, tenantTask("other"))
	assert.EqualError(t, err, `asynqmutex: task "sync": RateBy: plan store unreachable`)
}

// RateBy says what a task costs (ratelimit.Rate's Cost): of a burst of 4, a task of
// cost 3 leaves room for one of cost 1, not for another of cost 3.
func TestRateByCost(t *testing.T) {
	locks, _ := newLocks(t)
	ctx := context.Background()
	ran := map[string]int{}
	h := Middleware(locks, On("tenant"), OnConflict(Skip), NoLock(), RateBy(func(_ context.Context, t *asynq.Task) (ratelimit.Rate, error) {
		lim := ratelimit.Rate{N: 1, Per: time.Minute, Burst: 4}
		if strings.Contains(string(t.Payload()), "heavy") {
			lim.Cost = 3
		}
		return lim, nil
	}))(asynq.HandlerFunc(func(_ context.Context, t *asynq.Task) error {
		ran[string(t.Payload())]++
		return nil
	}))
	heavy := asynq.NewTask("sync", []byte(`{"tenant":"a","size":"heavy"}`))
	light := asynq.NewTask("sync", []byte(`{"tenant":"a","size":"light"}`))
	for _, task := range []*asynq.Task{heavy, heavy, light, light} {
		require.NoError(t, h.ProcessTask(ctx, task))
	}
	assert.Equal(t, 1, ran[string(heavy.Payload())], "a second task of cost 3 found 3 of the 4 starts spent")
	assert.Equal(t, 1, ran[string(light.Payload())], "one start of the 4 was left after the task of cost 3")
}

// NoLock lets tasks of one key run at once, gated only by their starts.
func TestNoLockRunsTogether(t *testing.T) {
	locks, _ := newLocks(t)
	const n = 4
	var (
		mu      sync.Mutex
		inside  int
		most    int
		release = make(chan struct{})
	)
	h := Middleware(locks, On("tenant"), Rate(1000, time.Second), Burst(n), NoLock())(asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
		if _, ok := Fence(ctx); ok {
			t.Error("a fence without a lock")
		}
		mu.Lock()
		inside++
		most = max(most, inside)
		if inside == n {
			close(release)
		}
		mu.Unlock()
		select {
		case <-release:
		case <-time.After(time.Minute):
			t.Error("tasks of one key did not run together under NoLock")
		}
		return nil
	}))
	var wg sync.WaitGroup
	for range n {
		wg.Add(1)
		go func() { defer wg.Done(); assert.NoError(t, h.ProcessTask(context.Background(), tenantTask("a"))) }()
	}
	wg.Wait()
	assert.Equal(t, n, most)
}

// A task whose context ends while it waits for its start gives the start back.
func TestRateWaitCancelled(t *testing.T) {
	locks, _ := newLocks(t)
	lim := Rate(1, time.Minute)
	h := Middleware(locks, On("tenant"), lim, MaxWait(time.Hour))(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return nil }))
	require.NoError(t, h.ProcessTask(context.Background(), tenantTask("a")))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- h.ProcessTask(ctx, tenantTask("a")) }()
	deadline := time.Now().Add(time.Minute)
	for st, _ := rates(locks).Inspect(context.Background(), `["sync","a"]`); st.Starts < 2 && time.Now().Before(deadline); st, _ = rates(locks).Inspect(context.Background(), `["sync","a"]`) {
		time.Sleep(5 * time.Millisecond)
	}
	cancel()
	err := <-done
	require.ErrorIs(t, err, context.Canceled)
	assert.Contains(t, err.Error(), `asynqmutex: task "sync": waiting for its start under the rate limit of key ["sync","a"]: context canceled`)
	st, err := rates(locks).Inspect(context.Background(), `["sync","a"]`)
	require.NoError(t, err)
	assert.Equal(t, 1, st.Starts, "the start given back")
}

func TestRateRedisDown(t *testing.T) {
	locks, m := newLocks(t)
	h := Middleware(locks, On("tenant"), Rate(10, time.Second), NoLock())(asynq.HandlerFunc(func(context.Context, *asynq.Task) error {
		t.Error("ran without its start")
		return nil
	}))
	m.Close()
	err := h.ProcessTask(context.Background(), tenantTask("a"))
	require.Error(t, err)
	assert.True(t, IsFailure(err) && !errors.Is(err, asynq.SkipRetry), "an ordinary, retryable error")
	assert.Contains(t, err.Error(), `asynqmutex: task "sync": taking its start under the rate limit of key ["sync","a"]: ratelimit: key ["sync","a"]: `)
	assert.NotContains(t, err.Error(), "\n")
}

func TestRateOptionPanics(t *testing.T) {
	locks := mutex.New(redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}))
	for _, tt := range []struct {
		name string
		f    func()
		want string
	}{
		{"Rate(0)", func() { Rate(0, time.Second) }, "asynqmutex.Rate: ratelimit: limit 0 per 1s: N must be at least 1"},
		{"Burst(0)", func() { Burst(0) }, "asynqmutex.Burst: burst 0 outside [1, 1000000] (ratelimit.MaxBurst)"},
		{"RateBy(nil)", func() { RateBy(nil) }, "asynqmutex.RateBy: nil function"},
		{"Burst alone", func() { Middleware(locks, Burst(2)) }, "asynqmutex.Middleware: Burst without Rate; RateBy's limits carry their own Burst"},
		{"NoLock alone", func() { Middleware(locks, NoLock()) }, "asynqmutex.Middleware: NoLock without Rate or RateBy leaves nothing to gate the tasks"},
		{"NoLock with Limit", func() { Middleware(locks, Rate(1, time.Second), NoLock(), Limit(2)) }, "asynqmutex.Middleware: NoLock and Limit both given; Limit caps the tasks that hold a key's lock"},
		{"Rate with OnEach", func() { Middleware(locks, OnEach("a", "b"), Rate(1, time.Second)) }, "asynqmutex.Middleware: Rate limits one key per task; OnEach gives a task several keys"},
		{"Rate and RateBy", func() {
			Middleware(locks, Rate(1, time.Second), RateBy(func(context.Context, *asynq.Task) (ratelimit.Rate, error) { return ratelimit.Rate{}, nil }))
		}, "asynqmutex.Middleware: Rate and RateBy both given; give one"},
	} {
		t.Run(tt.name, func(t *testing.T) { assert.PanicsWithValue(t, tt.want, tt.f) })
	}
}

// A handler that returns PauseKey as its context ends (a deadline reached while it
// waited on the API) still pauses its key: the pause is the handler's answer.
func TestPauseKeyAfterContextEnded(t *testing.T) {
	locks, _ := newLocks(t)
	ctx, cancel := context.WithCancel(context.Background())
	h := Middleware(locks, On("tenant"), Rate(100, time.Second))(asynq.HandlerFunc(func(context.Context, *asynq.Task) error {
		cancel()
		return PauseKey(time.Minute, errors.New("HTTP 429"))
	}))
	err := h.ProcessTask(ctx, tenantTask("a"))
	var le *LockedError
	require.ErrorAs(t, err, &le)
	assert.NotContains(t, err.Error(), "not paused")
	st, err := rates(locks).Inspect(context.Background(), `["sync","a"]`)
	require.NoError(t, err)
	assert.Greater(t, st.Paused, 59*time.Second, "the key is paused")
}

// Under Park, a task refused at its rate by an asynq server parks with its start
// reserved: its error is the parked LockedError, whose fallback is the time to that
// start plus the claim, and OpLimited reports policy "park"; the due loop starts it
// when the start falls due (here passed over: the Inspector's Redis has no such
// queue). A task on its last try, or near its deadline, is not parked: it waits, or
// is sent back, as before.
func TestRateParks(t *testing.T) {
	locks, _ := newLocks(t)
	ctx := context.Background()
	var ev events
	task := newFakeTask("t1", 3)
	mw := Middleware(locks, On("tenant"), Observe(ev.observe), task.option(), RateBy(func(_ context.Context, t *asynq.Task) (ratelimit.Rate, error) {
		if strings.Contains(string(t.Payload()), "slow") {
			return ratelimit.PerMinute(1), nil
		}
		return ratelimit.Rate{N: 1, Per: 300 * time.Millisecond}, nil
	}))(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return nil }))
	setID := func(id string, maxRetry int) {
		task.mu.Lock()
		task.meta.id, task.meta.maxRetry = id, maxRetry
		task.mu.Unlock()
	}

	require.NoError(t, mw.ProcessTask(ctx, tenantTask("fast")))
	setID("t2", 3)
	err := mw.ProcessTask(ctx, tenantTask("fast"))
	var le *LockedError
	require.ErrorAs(t, err, &le)
	assert.True(t, le.parked, "parked: %v", err)
	assert.Equal(t, time.Second+wholeSeconds(DefaultTTL), le.RetryIn, "its start in whole seconds, plus the claim")
	assert.Contains(t, err.Error(), "is at its rate limit")
	assert.Equal(t, "park", ev.last().Policy)
	require.Eventually(t, func() bool { return slices.Contains(ev.ops(), OpParkPassedOver) }, 10*time.Second, 10*time.Millisecond,
		"the parked task was not started when its start fell due")

	require.NoError(t, mw.ProcessTask(ctx, tenantTask("slow")))
	setID("t3", 0) // its last try: its start, a minute away, is beyond LastTryWait
	err = mw.ProcessTask(ctx, tenantTask("slow"))
	require.ErrorIs(t, err, asynq.SkipRetry, "archived on its last try, not parked")
	assert.Equal(t, "archive", ev.last().Policy)

	setID("t4", 3)
	near, cancel := context.WithTimeout(ctx, DeadlineMargin/2)
	defer cancel()
	err = mw.ProcessTask(near, tenantTask("slow"))
	require.ErrorAs(t, err, &le)
	assert.False(t, le.parked, "near its deadline a task is sent back: %v", err)
	assert.Equal(t, "retry", ev.last().Policy)
}

// TestBusyLockSpendsOneStart: a task that meets its lock busy under Park while its
// start is free takes one start for its run, not two: the start it took before
// joining the lock's line is given back (else, a spare burst making that start due in
// the past, the rate gate would give it up as late and take another). The control: a
// task that finds the lock free takes one.
func TestBusyLockSpendsOneStart(t *testing.T) {
	locks, _ := newLocks(t)
	ctx := context.Background()
	run := func(key string, busy bool) ratelimit.State {
		t.Helper()
		if busy {
			held, err := locks.TryLock(ctx, `["sync","`+key+`"]`, time.Minute)
			require.NoError(t, err)
			go func() { time.Sleep(200 * time.Millisecond); _ = held.Unlock(ctx) }()
		}
		h := Middleware(locks, On("tenant"), Rate(1, time.Minute), Burst(3), newFakeTask("t-"+key, 3).option())(
			asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return nil }))
		require.NoError(t, h.ProcessTask(ctx, tenantTask(key)))
		st, err := rates(locks).Inspect(ctx, `["sync","`+key+`"]`)
		require.NoError(t, err)
		return st
	}
	if st := run("free", false); st.Remaining != 2 {
		t.Fatalf("the control, a free lock: %d of a burst of 3 remaining, want 2", st.Remaining)
	}
	if st := run("busy", true); st.Remaining != 2 {
		t.Errorf("a task that met its lock busy: %d of a burst of 3 remaining after its run, want 2 (one start)", st.Remaining)
	}
}

// TestLagNotFromTheLockLine: a task started for its reserved start that then waits in
// its lock's line is late for that start by the wait, which is no dispatch lag: were
// it a sample, the lead would grow with every such task, until tasks waited a claim
// in their workers. Only a run's first take is one.
func TestLagNotFromTheLockLine(t *testing.T) {
	locks, _ := newLocks(t)
	ctx := context.Background()
	m := &middleware{config: config{ttl: DefaultTTL}, rates: rates(locks)}
	lim := ratelimit.Rate{N: 1, Per: 100 * time.Millisecond}
	key := `["sync","lag"]`
	if r, err := m.rates.Allow(ctx, key, lim); err != nil || !r.Allowed {
		t.Fatalf("Allow = %+v, %v", r, err)
	}
	run := func() *task {
		return &task{Task: tenantTask("lag"), key: key, meta: taskMeta{id: "t1", queue: "default", counted: true, maxRetry: 3}}
	}
	parked, err := m.takeAs(ctx, run(), lim, 0)
	require.NoError(t, err)
	require.True(t, parked.Held, "the task's start is reserved ahead: %+v", parked)

	// The task comes back for its start, as the due loop starts it, and takes it;
	// then it waits in its lock's line a second, and the rate gate takes again.
	time.Sleep(parked.Delay)
	tk := run()
	first, err := m.takeAs(ctx, tk, lim, m.lead())
	require.NoError(t, err)
	require.True(t, first.Found, "the run found its reserved start: %+v", first)
	time.Sleep(time.Second)
	second, err := m.takeAs(ctx, tk, lim, m.lead())
	require.NoError(t, err)
	require.True(t, second.Found && second.Late >= time.Second, "the second take found the start a second late: %+v", second)
	// One sample of a prompt arrival keeps the lead near startEarly; the second
	// take's second, as a sample, would have made it about 400ms.
	if lead := m.lead(); lead >= 300*time.Millisecond {
		t.Errorf("lead %v after one prompt arrival and a take after a second in the lock's line, want near %v", lead, startEarly)
	}
}

// A start that costs more than its burst waits, on an idle key too, for its cost
// beyond the burst (ratelimit.Rate.MinDelay): under RetryLater with no MaxWait the
// task waits that in its worker, rather than be sent back to find the same wait
// forever.
func TestCostAboveBurstStarts(t *testing.T) {
	locks, _ := newLocks(t)
	ctx := context.Background()
	ran := 0
	h := Middleware(locks, On("tenant"), NoLock(), OnConflict(RetryLater(time.Second)), RateBy(func(context.Context, *asynq.Task) (ratelimit.Rate, error) {
		return ratelimit.Rate{N: 1000, Per: time.Second, Cost: 200}, nil // 199ms beyond its burst of 1
	}))(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { ran++; return nil }))
	require.NoError(t, h.ProcessTask(ctx, tenantTask("heavy")))
	assert.Equal(t, 1, ran, "a start of cost 200 on an idle key ran")
}

// TestCostAboveBurstParks: under Park, a start whose cost beyond its burst puts it
// past the reservations' usual reach (four claims) is reserved and parked for all
// the same, and started when it falls due; it would be sent back otherwise, to find
// the same wait each time it came back.
func TestCostAboveBurstParks(t *testing.T) {
	t.Parallel()
	locks, _ := newLocks(t)
	ctx := context.Background()
	var ev events
	heavy := ratelimit.Rate{N: 10, Per: time.Second, Cost: 42} // 4.1s beyond its burst: past four claims of 1s
	p := Middleware(locks, On("tenant"), TTL(time.Second), Observe(ev.observe), newFakeTask("t-park", 3).option(),
		RateBy(func(context.Context, *asynq.Task) (ratelimit.Rate, error) { return heavy, nil }))(mustNotRun(t))
	err := p.ProcessTask(ctx, tenantTask("heavier"))
	var le *LockedError
	require.ErrorAs(t, err, &le)
	assert.True(t, le.parked, "parked until its start, 4.1s away: %v", err)
	assert.Equal(t, "park", ev.last().Policy)
	// Its start falls due and the due loop starts it (not in asynq here: passed over).
	require.Eventually(t, func() bool { return slices.Contains(ev.ops(), OpParkPassedOver) }, 30*time.Second, 10*time.Millisecond,
		"the parked task was not started when its start fell due")
}

// TestRetryTakesItsOwnStart: a task that failed and is retried within an interval of
// the start its failed run took takes a start of its own: that start was spent by the
// failed run, and beginning on it again would put two runs on one start.
func TestRetryTakesItsOwnStart(t *testing.T) {
	t.Parallel()
	locks, _ := newLocks(t)
	ctx := context.Background()
	task := newFakeTask("t-retry", 3)
	var ev events
	runs := 0
	h := Middleware(locks, On("tenant"), Rate(1, 2*time.Second), Observe(ev.observe), task.option())(asynq.HandlerFunc(func(context.Context, *asynq.Task) error {
		runs++
		return errors.New("the API said 500")
	}))
	require.Error(t, h.ProcessTask(ctx, tenantTask("retry")))
	task.retried() // asynq spends a retry on the failure and runs the task again
	err := h.ProcessTask(ctx, tenantTask("retry"))
	var le *LockedError
	require.ErrorAs(t, err, &le, "the retry, before the key's next start, is refused")
	assert.True(t, le.parked, "and parks for its own start: %v", err)
	assert.Equal(t, 1, runs, "the retry ran on the start its failed run had spent")
	require.Eventually(t, func() bool { return slices.Contains(ev.ops(), OpParkPassedOver) }, 30*time.Second, 10*time.Millisecond,
		"the parked retry was not started when its start fell due")
}

// TestStartLaterParksOutsideTheLine: under Park a task that meets its lock busy while
// its start comes later parks until that start, reserved for it, and not in the
// lock's line, where it would be handed the lock only to park again for its start
// (without the rate-first park it stands in the line, as an OpConflict).
func TestStartLaterParksOutsideTheLine(t *testing.T) {
	t.Parallel()
	locks, _ := newLocks(t)
	ctx := context.Background()
	key := `["sync","later"]`
	_, err := locks.TryLock(ctx, key, time.Minute)
	require.NoError(t, err)
	r, err := rates(locks).Allow(ctx, key, ratelimit.PerSecond(1)) // the key's next start is a second away
	require.True(t, err == nil && r.Allowed, "%+v, %v", r, err)
	var ev events
	err = Middleware(locks, On("tenant"), Rate(1, time.Second), Observe(ev.observe), newFakeTask("t-later", 3).option())(mustNotRun(t)).
		ProcessTask(ctx, tenantTask("later"))
	var le *LockedError
	require.ErrorAs(t, err, &le)
	assert.True(t, le.parked, "parked: %v", err)
	assert.Equal(t, OpLimited, ev.last().Op, "parked for its start, not for the lock: %v", ev.last())
	in, err := locks.Inspect(ctx, key)
	require.NoError(t, err)
	assert.Zero(t, in.Waiting, "entries in the lock's line")
	// Its start falls due and the due loop starts it (not in asynq here: passed over).
	require.Eventually(t, func() bool { return slices.Contains(ev.ops(), OpParkPassedOver) }, 30*time.Second, 10*time.Millisecond,
		"the task parked for its start was not started: %v", ev.ops())
}
