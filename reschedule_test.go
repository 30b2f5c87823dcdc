package asynqmutex

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/asynqmutex/asynqmutex/internal/conflicts"
	"github.com/asynqmutex/asynqmutex/internal/redistest"
	"github.com/asynqmutex/asynqmutex/mutex"
)

// fakeTask stands in for the metadata an asynq server puts in a handler's context,
// which only asynq can build: the tests change it between runs as asynq would.
type fakeTask struct {
	mu   sync.Mutex
	meta taskMeta
}

func newFakeTask(id string, maxRetry int) *fakeTask {
	return &fakeTask{meta: taskMeta{id: id, queue: "default", maxRetry: maxRetry, counted: true}}
}

func (f *fakeTask) option() Option {
	return optionFunc(func(c *config) {
		c.meta = func(context.Context) taskMeta {
			f.mu.Lock()
			defer f.mu.Unlock()
			return f.meta
		}
	})
}

// retried records that asynq spent a retry on the task, as it does for a failure.
func (f *fakeTask) retried() {
	f.mu.Lock()
	f.meta.retried++
	f.mu.Unlock()
}

// busyKey holds the lock on the key Middleware(On("id")) derives for id.
func busyKey(t *testing.T, locks *mutex.Client, id string) *mutex.Lock {
	t.Helper()
	l, err := locks.TryLock(context.Background(), `["pay","`+id+`"]`, time.Hour)
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Unlock(context.Background()) })
	return l
}

func payTask(id string) *asynq.Task { return asynq.NewTask("pay", []byte(`{"id":"`+id+`"}`)) }

// mustNotRun is a handler for tasks whose key is held.
func mustNotRun(t *testing.T) asynq.Handler {
	return asynq.HandlerFunc(func(context.Context, *asynq.Task) error {
		t.Error("the handler ran without the lock")
		return nil
	})
}

// rescheduled checks that err sends the task back after want without spending a
// retry.
func rescheduled(t *testing.T, err error, want time.Duration, what string) {
	t.Helper()
	var le *LockedError
	if !errors.As(err, &le) {
		t.Fatalf("%s: got %v, want a *LockedError", what, err)
	}
	assert.Equal(t, want, le.RetryIn, "%s: RetryIn", what)
	assert.False(t, IsFailure(err), "%s: a reschedule is no failure", what)
}

// failedAtCap checks that err is an ordinary failure past the cap, naming the task,
// the key and the cap.
func failedAtCap(t *testing.T, err error, wants ...string) {
	t.Helper()
	require.Error(t, err)
	var le *LockedError
	assert.False(t, errors.As(err, &le), "past the cap the error is not a *LockedError: %v", err)
	assert.ErrorIs(t, err, mutex.ErrNotObtained)
	assert.True(t, IsFailure(err), "past the cap a conflict is a failure")
	assert.NotErrorIs(t, err, asynq.SkipRetry, "asynq decides by the retries left, as under Fail")
	for _, w := range append([]string{`task "pay" (id `, `lock ["pay","`, "reschedule cap"}, wants...) {
		assert.Contains(t, err.Error(), w)
	}
}

// TestMaxReschedules sends a task back twice under MaxReschedules(2), doubling the
// delay; its third and fourth conflicts are failures that leave the record counting,
// and once asynq spent its last retry the next conflict fails at once (no
// LastTryWait) and ends the record.
func TestMaxReschedules(t *testing.T) {
	locks, m := newLocks(t)
	busyKey(t, locks, "t1")
	task := newFakeTask("t1", 2)
	var rec recorder
	h := Middleware(locks, On("id"), OnConflict(RetryLater(time.Second)), MaxReschedules(2), AfterFailure(rec.hook), task.option())(mustNotRun(t))
	ctx := context.Background()
	const key = "asynqmutex:reschedule:default:t1"

	rescheduled(t, h.ProcessTask(ctx, payTask("t1")), time.Second, "conflict 1")
	rescheduled(t, h.ProcessTask(ctx, payTask("t1")), 2*time.Second, "conflict 2")
	require.True(t, m.Exists(key), "the count is kept in Redis at %s; keys: %v", key, m.Keys())
	assert.Equal(t, cappedExpiry(time.Second, task.meta), m.TTL(key), "the record's expiry: long enough for asynq's backoff past the cap")

	err := h.ProcessTask(ctx, payTask("t1"))
	failedAtCap(t, err, "MaxReschedules(2)", "3 conflicts")
	assert.NotContains(t, err.Error(), "archived")
	task.retried()
	failedAtCap(t, h.ProcessTask(ctx, payTask("t1")), "MaxReschedules(2)", "4 conflicts")
	task.retried() // now 2 of 2: no retry left
	assert.True(t, m.Exists(key), "the record lives while asynq retries the task")

	// A last try would wait LastTryWait; past the cap it fails at once, and the
	// error's text says asynq archives it.
	ctx2, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	err = h.ProcessTask(ctx2, payTask("t1"))
	failedAtCap(t, err, "MaxReschedules(2)", "5 conflicts", "no retry left", "archived")
	assert.NotContains(t, err.Error(), "waited")
	assert.False(t, m.Exists(key), "the record ends with the task's archiving")

	got := rec.got()
	require.Len(t, got, 5, "AfterFailure calls")
	for i, err := range got {
		var le *LockedError
		require.True(t, errors.As(err, &le), "hook call %d: %v", i, err)
		if i >= 2 && le.RetryIn != 0 {
			t.Errorf("hook call %d: RetryIn = %v, want 0 past the cap", i, le.RetryIn)
		}
	}
}

// TestMaxReschedulesNoRecordWaits is the positive control of the last try above: a
// task on its last retry with no record of a reached cap (its retries went to real
// failures) still waits for the key as long as LastTryWait and its deadline allow.
func TestMaxReschedulesNoRecordWaits(t *testing.T) {
	locks, _ := newLocks(t)
	busyKey(t, locks, "t2")
	task := newFakeTask("t2", 1)
	task.retried()
	h := Middleware(locks, On("id"), OnConflict(RetryLater(time.Second)), MaxReschedules(1), task.option())(mustNotRun(t))
	ctx, cancel := context.WithTimeout(context.Background(), DeadlineMargin+200*time.Millisecond)
	defer cancel()
	err := h.ProcessTask(ctx, payTask("t2"))
	require.ErrorIs(t, err, asynq.SkipRetry)
	assert.Contains(t, err.Error(), "no retry left, so it waited")
	var le *LockedError
	require.ErrorAs(t, err, &le)
	assert.Greater(t, le.waited, 100*time.Millisecond, "it waited for the key, up to its deadline less DeadlineMargin")
	assert.NotContains(t, err.Error(), "reschedule cap")
}

// TestMaxRescheduleTime moves the Redis server's clock: conflicts before the cap are
// rescheduled, the first one at the cap fails, and the time counts from the first
// conflict.
func TestMaxRescheduleTime(t *testing.T) {
	locks, m := newLocks(t)
	busyKey(t, locks, "t3")
	task := newFakeTask("t3", 3)
	h := Middleware(locks, On("id"), OnConflict(RetryLater(time.Second)), MaxRescheduleTime(time.Minute), task.option())(mustNotRun(t))
	ctx := context.Background()
	t0 := time.Now()
	m.SetTime(t0)
	rescheduled(t, h.ProcessTask(ctx, payTask("t3")), time.Second, "at 0s")
	m.SetTime(t0.Add(59 * time.Second))
	rescheduled(t, h.ProcessTask(ctx, payTask("t3")), 2*time.Second, "at 59s")
	m.SetTime(t0.Add(time.Minute))
	failedAtCap(t, h.ProcessTask(ctx, payTask("t3")), "MaxRescheduleTime(1m0s)", "3 conflicts in 1m0s")
}

// TestBothCaps: whichever cap comes first applies.
func TestBothCaps(t *testing.T) {
	for _, tt := range []struct {
		name     string
		step     time.Duration // server time between conflicts
		failAt   int
		wantText string
	}{
		{"count first", time.Second, 4, "MaxReschedules(3)"},
		{"time first", 30 * time.Second, 3, "MaxRescheduleTime(1m0s)"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			locks, m := newLocks(t)
			busyKey(t, locks, "t4")
			task := newFakeTask("t4", 5)
			h := Middleware(locks, On("id"), OnConflict(RetryLater(time.Second)),
				MaxReschedules(3), MaxRescheduleTime(time.Minute), task.option())(mustNotRun(t))
			now := time.Now()
			for i := 1; i <= tt.failAt; i++ {
				m.SetTime(now)
				now = now.Add(tt.step)
				err := h.ProcessTask(context.Background(), payTask("t4"))
				if i < tt.failAt {
					rescheduled(t, err, backoff(time.Second, i), "conflict")
					continue
				}
				failedAtCap(t, err, tt.wantText)
				other := map[string]string{"MaxReschedules(3)": "MaxRescheduleTime", "MaxRescheduleTime(1m0s)": "MaxReschedules"}[tt.wantText]
				assert.NotContains(t, err.Error(), other, "only the cap reached is named")
			}
		})
	}
}

// TestRescheduleCountShared counts one task's conflicts in two middlewares with
// their own mutex.Clients, as on two workers: the doubling and the cap go on from
// one to the other.
func TestRescheduleCountShared(t *testing.T) {
	m := miniredis.RunT(t)
	worker := func() asynq.Handler {
		rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
		t.Cleanup(func() { rdb.Close() })
		locks := mutex.New(rdb)
		t.Cleanup(func() { locks.Close() })
		return Middleware(locks, On("id"), OnConflict(RetryLater(time.Second)), MaxReschedules(3), newFakeTask("t5", 9).option())(mustNotRun(t))
	}
	a, b := worker(), worker()
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	t.Cleanup(func() { rdb.Close() })
	holder := mutex.New(rdb)
	t.Cleanup(func() { holder.Close() })
	busyKey(t, holder, "t5")

	ctx := context.Background()
	rescheduled(t, a.ProcessTask(ctx, payTask("t5")), time.Second, "conflict 1 on a")
	rescheduled(t, b.ProcessTask(ctx, payTask("t5")), 2*time.Second, "conflict 2 on b")
	rescheduled(t, a.ProcessTask(ctx, payTask("t5")), 4*time.Second, "conflict 3 on a")
	failedAtCap(t, b.ProcessTask(ctx, payTask("t5")), "MaxReschedules(3)", "4 conflicts")
}

// TestRescheduleRecordCleared: a task that obtains its key ends its count, so a later
// conflict starts again from d and from a fresh cap.
func TestRescheduleRecordCleared(t *testing.T) {
	locks, m := newLocks(t)
	holder := busyKey(t, locks, "t6")
	task := newFakeTask("t6", 3)
	var runs atomic.Int32
	h := Middleware(locks, On("id"), OnConflict(RetryLater(time.Second)), MaxReschedules(2), task.option())(
		asynq.HandlerFunc(func(context.Context, *asynq.Task) error { runs.Add(1); return errors.New("real failure") }))
	ctx := context.Background()
	rescheduled(t, h.ProcessTask(ctx, payTask("t6")), time.Second, "conflict 1")
	rescheduled(t, h.ProcessTask(ctx, payTask("t6")), 2*time.Second, "conflict 2")
	require.NoError(t, holder.Unlock(ctx))
	require.EqualError(t, h.ProcessTask(ctx, payTask("t6")), "real failure")
	assert.Equal(t, int32(1), runs.Load())
	assert.False(t, m.Exists("asynqmutex:reschedule:default:t6"), "the record is deleted once the task had its key")

	task.retried()
	busyKey(t, locks, "t6")
	rescheduled(t, h.ProcessTask(ctx, payTask("t6")), time.Second, "first conflict after the run")
	rescheduled(t, h.ProcessTask(ctx, payTask("t6")), 2*time.Second, "second conflict after the run")
}

// TestRescheduleFastPath counts the Redis commands of a task that meets no busy
// key: without a cap, exactly those of the lock alone; with one, one more (the
// record's deletion).
func TestRescheduleFastPath(t *testing.T) {
	locks, m := newLocks(t)
	ctx := context.Background()
	noop := asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return nil })
	commands := func(run func()) int {
		run() // scripts loaded, connections open
		before := m.CommandCount()
		run()
		return m.CommandCount() - before
	}
	lockOnly := commands(func() {
		require.NoError(t, locks.WithLock(ctx, `["pay","t7"]`, DefaultTTL, func(context.Context) error { return nil },
			mutex.MaxWait(0), mutex.HeldBy("pay", "t7")))
	})
	noCap := Middleware(locks, On("id"), newFakeTask("t7", 3).option())(noop)
	capped := Middleware(locks, On("id"), MaxReschedules(3), newFakeTask("t7", 3).option())(noop)
	assert.Equal(t, lockOnly, commands(func() { require.NoError(t, noCap.ProcessTask(ctx, payTask("t7"))) }), "no cap: the lock's commands only")
	assert.Equal(t, lockOnly+1, commands(func() { require.NoError(t, capped.ProcessTask(ctx, payTask("t7"))) }), "a cap: one more, to delete the record")
}

// TestRescheduleNotCountedWhenRedisFails makes the counting script fail while the
// lock's commands work: the task is sent back after d as at a first conflict, never
// failed by the cap or lost, and the middleware logs it at Warn. The positive
// control is TestMaxReschedules, where the third conflict fails.
func TestRescheduleNotCountedWhenRedisFails(t *testing.T) {
	m := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	t.Cleanup(func() { rdb.Close() })
	var failCounts atomic.Bool
	rdb.AddHook(countFailer{&failCounts})
	locks := mutex.New(rdb)
	t.Cleanup(func() { locks.Close() })
	busyKey(t, locks, "t8")
	var logs bytes.Buffer
	var mu sync.Mutex
	logger := slog.New(slog.NewTextHandler(&lockedWriter{w: &logs, mu: &mu}, nil))
	h := Middleware(locks, On("id"), OnConflict(RetryLater(time.Second)), MaxReschedules(1), Logger(logger), newFakeTask("t8", 3).option())(mustNotRun(t))

	ctx := context.Background()
	failCounts.Store(true)
	for range 3 {
		rescheduled(t, h.ProcessTask(ctx, payTask("t8")), time.Second, "uncounted conflict")
	}
	mu.Lock()
	out := logs.String()
	mu.Unlock()
	assert.Equal(t, 3, strings.Count(out, "level=WARN"), "one Warn per uncounted conflict: %s", out)
	for _, w := range []string{"could not count a conflict", "task_id=t8", `key="[\"pay\",\"t8\"]"`, "injected"} {
		assert.Contains(t, out, w)
	}

	failCounts.Store(false) // Redis counts again: the cap applies from here
	rescheduled(t, h.ProcessTask(ctx, payTask("t8")), time.Second, "first counted conflict")
	failedAtCap(t, h.ProcessTask(ctx, payTask("t8")), "MaxReschedules(1)", "2 conflicts")
}

// countFailer fails the commands that touch a reschedule record, while on.
type countFailer struct{ on *atomic.Bool }

func (countFailer) DialHook(next redis.DialHook) redis.DialHook { return next }

func (f countFailer) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if f.on.Load() {
			for _, a := range cmd.Args() {
				if s, ok := a.(string); ok && strings.Contains(s, conflicts.Infix) {
					err := errors.New("injected: connection reset")
					cmd.SetErr(err)
					return err
				}
			}
		}
		return next(ctx, cmd)
	}
}

func (countFailer) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

type lockedWriter struct {
	w  *bytes.Buffer
	mu *sync.Mutex
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// TestRescheduleNoTaskID: a task not run by an asynq server has no ID to count it by:
// each conflict is a first one, and nothing is written to Redis.
func TestRescheduleNoTaskID(t *testing.T) {
	locks, m := newLocks(t)
	busyKey(t, locks, "t9")
	h := Middleware(locks, On("id"), OnConflict(RetryLater(time.Second)), MaxReschedules(1))(mustNotRun(t))
	for range 3 {
		rescheduled(t, h.ProcessTask(context.Background(), payTask("t9")), time.Second, "conflict without an ID")
	}
	for _, k := range m.Keys() {
		assert.NotContains(t, k, conflicts.Infix)
	}
}

func TestRecordExpiry(t *testing.T) {
	for d, want := range map[time.Duration]time.Duration{
		time.Second:     32*time.Second + time.Hour,
		5 * time.Second: 160*time.Second + time.Hour,
		time.Hour:       33 * time.Hour,
		math.MaxInt64:   math.MaxInt64,
	} {
		if got := recordExpiry(d); got != want {
			t.Errorf("recordExpiry(%v) = %v, want %v", d, got, want)
		}
		if got := recordExpiry(d); got <= backoff(d, 5) && got != math.MaxInt64 {
			t.Errorf("recordExpiry(%v) = %v, not past the longest delay %v", d, got, backoff(d, 5))
		}
	}
}

// TestMaxReschedulesSeveralKeys: a task with several keys (OnEach) is counted as one
// task, whichever of its keys is busy, and the cap's text names its keys.
func TestMaxReschedulesSeveralKeys(t *testing.T) {
	locks, _ := newLocks(t)
	holder, err := locks.TryLock(context.Background(), `["xfer","B"]`, time.Hour)
	require.NoError(t, err)
	t.Cleanup(func() { _ = holder.Unlock(context.Background()) })
	h := Middleware(locks, OnEach("from", "to"), OnConflict(RetryLater(time.Second)), MaxReschedules(1),
		newFakeTask("t10", 3).option())(mustNotRun(t))
	task := asynq.NewTask("xfer", []byte(`{"from":"A","to":"B"}`))
	rescheduled(t, h.ProcessTask(context.Background(), task), time.Second, "conflict 1")
	err = h.ProcessTask(context.Background(), task)
	require.ErrorIs(t, err, mutex.ErrNotObtained)
	assert.True(t, IsFailure(err))
	for _, w := range []string{`["xfer","A"]`, `["xfer","B"]`, "reschedule cap MaxReschedules(1) reached", "2 conflicts"} {
		assert.Contains(t, err.Error(), w)
	}
}

// TestRescheduleScriptSentAsFunction: on a real redis-server the count goes by FCALL,
// as the function of its own library, and on miniredis, which has no functions, by
// EVALSHA; each backend is the other's control.
func TestRescheduleScriptSentAsFunction(t *testing.T) {
	for _, tc := range []struct {
		backend string
		addr    func(t *testing.T) string
		want    string
	}{
		{"redis-server", func(t *testing.T) string { return redistest.Start(t).Addr() }, conflicts.Script.Function()},
		{"miniredis", func(t *testing.T) string { return miniredis.RunT(t).Addr() }, conflicts.Script.Hash()},
	} {
		t.Run(tc.backend, func(t *testing.T) {
			mw := cappedMiddleware(t, &redis.Options{Addr: tc.addr(t)})
			var (
				mu   sync.Mutex
				sent []string // what each call of server-side code names: a function, a digest or a source
			)
			mw.locks.Redis().(*redis.Client).AddHook(scriptWatcher(func(cmd redis.Cmder) {
				switch cmd.Name() {
				case "fcall", "evalsha", "eval":
					mu.Lock()
					sent = append(sent, cmd.Args()[1].(string))
					mu.Unlock()
				}
			}))
			ctx := context.Background()
			meta := taskMeta{id: "t-fn", queue: "default"}
			for want := 1; want <= 3; want++ {
				r, err := mw.conflicts.Count(ctx, meta.queue, meta.id, mw.expiryOf(meta))
				require.NoError(t, err)
				require.Equal(t, want, r.N)
			}
			mu.Lock()
			defer mu.Unlock()
			require.NotEmpty(t, sent)
			assert.Equal(t, tc.want, sent[len(sent)-1], "the last count")
			assert.Equal(t, tc.want, sent[len(sent)-2], "and the one before")
		})
	}
}

// scriptWatcher is a go-redis hook that shows every command to a function before
// sending it.
type scriptWatcher func(redis.Cmder)

func (scriptWatcher) DialHook(next redis.DialHook) redis.DialHook { return next }
func (w scriptWatcher) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		w(cmd)
		return next(ctx, cmd)
	}
}
func (scriptWatcher) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
