package asynqmutex

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"math"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/asynqmutex/asynqmutex/mutex"
)

func newLocks(t *testing.T) (*mutex.Client, *miniredis.Miniredis) {
	t.Helper()
	m := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	t.Cleanup(func() { rdb.Close() })
	locks := mutex.New(rdb)
	t.Cleanup(func() { locks.Close() }) // runs first: before rdb is closed
	return locks, m
}

// recorder is an AfterFailure hook that keeps what it was given.
type recorder struct {
	mu   sync.Mutex
	errs []error
}

func (r *recorder) hook(_ context.Context, _ *asynq.Task, err error) {
	r.mu.Lock()
	r.errs = append(r.errs, err)
	r.mu.Unlock()
}

func (r *recorder) got() []error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]error(nil), r.errs...)
}

func TestMiddlewareRunsHandlerUnderLock(t *testing.T) {
	locks, _ := newLocks(t)
	ctx := context.Background()
	want := errors.New("handler result")
	var fence int64
	h := Middleware(locks, On("id"))(asynq.HandlerFunc(func(ctx context.Context, t2 *asynq.Task) error {
		locked, err := locks.Locked(ctx, `["pay","t1"]`)
		require.NoError(t, err)
		assert.True(t, locked, "the handler runs while the key is locked")
		var ok bool
		fence, ok = Fence(ctx)
		assert.True(t, ok)
		return want
	}))
	err := h.ProcessTask(ctx, asynq.NewTask("pay", []byte(`{"id":"t1"}`)))
	assert.Same(t, want, err, "the handler's result comes back untouched")
	assert.Positive(t, fence)
	locked, err := locks.Locked(ctx, `["pay","t1"]`)
	require.NoError(t, err)
	assert.False(t, locked, "released after the handler")
	_, ok := Fence(ctx)
	assert.False(t, ok, "no fence outside a handler")
}

func TestMiddlewareConflictPolicies(t *testing.T) {
	tests := []struct {
		name   string
		policy Policy
		check  func(t *testing.T, err error)
	}{
		{"Skip", Skip, func(t *testing.T, err error) {
			assert.NoError(t, err, "a skipped task completes")
		}},
		{"Fail", Fail, func(t *testing.T, err error) {
			assert.ErrorIs(t, err, mutex.ErrNotObtained)
			var le *LockedError
			assert.False(t, errors.As(err, &le), "Fail is an ordinary error, not a LockedError")
			assert.True(t, IsFailure(err), "Fail counts as a failure")
		}},
		{"RetryLater", RetryLater(3 * time.Second), func(t *testing.T, err error) {
			var le *LockedError
			require.True(t, errors.As(err, &le), "got %v, want a *LockedError", err)
			assert.Equal(t, 3*time.Second, le.RetryIn)
			assert.Equal(t, `["pay","t1"]`, le.Key)
			assert.ErrorIs(t, err, mutex.ErrNotObtained)
			assert.False(t, IsFailure(err), "a busy key is not a failure")
			assert.Contains(t, err.Error(), `task "pay"`)
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			locks, _ := newLocks(t)
			ctx := context.Background()
			holder, err := locks.TryLock(ctx, `["pay","t1"]`, time.Minute)
			require.NoError(t, err)
			defer holder.Unlock(ctx)

			var rec recorder
			h := Middleware(locks, On("id"), OnConflict(tt.policy), AfterFailure(rec.hook))(
				asynq.HandlerFunc(func(context.Context, *asynq.Task) error {
					t.Error("the handler ran without the lock")
					return nil
				}))
			err = h.ProcessTask(ctx, asynq.NewTask("pay", []byte(`{"id":"t1"}`)))
			tt.check(t, err)
			got := rec.got()
			require.Len(t, got, 1, "AfterFailure calls")
			var le *LockedError
			assert.True(t, errors.As(got[0], &le), "the hook gets a *LockedError, got %v", got[0])
		})
	}
}

func TestMiddlewareOtherKeysRun(t *testing.T) {
	locks, _ := newLocks(t)
	ctx := context.Background()
	holder, err := locks.TryLock(ctx, `["pay","t1"]`, time.Minute)
	require.NoError(t, err)
	defer holder.Unlock(ctx)
	ran := 0
	h := Middleware(locks, On("id"))(asynq.HandlerFunc(func(context.Context, *asynq.Task) error {
		ran++
		return nil
	}))
	for _, p := range []string{`{"id":"t2"}`, `{"id":1}`, `{"id":null}`} {
		require.NoError(t, h.ProcessTask(ctx, asynq.NewTask("pay", []byte(p))), p)
	}
	require.NoError(t, h.ProcessTask(ctx, asynq.NewTask("refund", []byte(`{"id":"t1"}`))), "another task type")
	assert.Equal(t, 4, ran)
}

func TestMiddlewareMaxWaitWokenByRelease(t *testing.T) {
	locks, _ := newLocks(t)
	ctx := context.Background()
	holder, err := locks.TryLock(ctx, `["pay"]`, time.Hour)
	require.NoError(t, err)
	ran := make(chan struct{})
	h := Middleware(locks, MaxWait(time.Minute))(asynq.HandlerFunc(func(context.Context, *asynq.Task) error {
		close(ran)
		return nil
	}))
	done := make(chan error, 1)
	go func() { done <- h.ProcessTask(ctx, asynq.NewTask("pay", nil)) }()
	select {
	case <-ran:
		t.Fatal("ran while the key was held")
	case <-time.After(50 * time.Millisecond):
	}
	require.NoError(t, holder.Unlock(ctx))
	// The holder's lease is an hour: only the release notification lets it run.
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("waiting task not woken by the release")
	}
}

// TestMiddlewareWaitEndsBeforeDeadline gives a task less time before its deadline
// than MaxWait: the wait ends early enough for the policy's result to come back,
// not the deadline's error.
func TestMiddlewareWaitEndsBeforeDeadline(t *testing.T) {
	locks, _ := newLocks(t)
	holder, err := locks.TryLock(context.Background(), `["pay"]`, time.Hour)
	require.NoError(t, err)
	defer holder.Unlock(context.Background())
	var rec recorder
	h := Middleware(locks, MaxWait(time.Hour), AfterFailure(rec.hook))(asynq.HandlerFunc(func(context.Context, *asynq.Task) error {
		t.Error("the handler ran without the lock")
		return nil
	}))
	for _, left := range []time.Duration{DeadlineMargin + 300*time.Millisecond, DeadlineMargin / 2, -time.Second} {
		ctx, cancel := context.WithTimeout(context.Background(), left)
		err := h.ProcessTask(ctx, asynq.NewTask("pay", nil))
		cancel()
		var le *LockedError
		if left > 0 {
			assert.True(t, errors.As(err, &le), "%v before the deadline: got %v, want a *LockedError", left, err)
			assert.NotErrorIs(t, err, context.DeadlineExceeded)
		} else {
			assert.ErrorIs(t, err, context.DeadlineExceeded, "a task already past its deadline")
		}
	}
	assert.Len(t, rec.got(), 3)
}

func TestBackoff(t *testing.T) {
	for _, tt := range []struct {
		d    time.Duration
		n    int
		want time.Duration
	}{
		{time.Second, 1, time.Second},
		{time.Second, 2, 2 * time.Second},
		{time.Second, 5, 16 * time.Second},
		{time.Second, 100, 16 * time.Second},
		{math.MaxInt64 / 3, 3, math.MaxInt64},
	} {
		if got := backoff(tt.d, tt.n); got != tt.want {
			t.Errorf("backoff(%v, %d) = %v, want %v", tt.d, tt.n, got, tt.want)
		}
	}
}

func TestMiddlewareBadInput(t *testing.T) {
	tests := []struct {
		name, payload string
		opts          []Option
		want          []string
	}{
		{"not JSON", `{"id":`, []Option{On("id")}, []string{`"pay"`, "JSON"}},
		{"missing field", `{"other":1}`, []Option{On("id")}, []string{`"pay"`, `"id"`, "missing"}},
		{"through a string", `{"customer":"c1"}`, []Option{On("customer.id")}, []string{`"pay"`, `"customer.id"`}},
		{"KeyBy error", `{}`, []Option{KeyBy(func(context.Context, *asynq.Task) (string, error) {
			return "", errors.New("no tenant header")
		})}, []string{`"pay"`, "no tenant header"}},
		{"KeyBy empty key", `{}`, []Option{KeyBy(func(context.Context, *asynq.Task) (string, error) {
			return "", nil
		})}, []string{`"pay"`, "KeyBy returned an empty key"}},
		{"object value", `{"id":{"n":1}}`, []Option{On("id")}, []string{`"pay"`, `field "id" is an object`, "KeyBy"}},
		{"OnEach missing field", `{"from":"a"}`, []Option{OnEach("from", "to")}, []string{`"pay"`, `"to"`, "missing"}},
		{"OnEach object value", `{"from":"a","to":[1]}`, []Option{OnEach("from", "to")}, []string{`"pay"`, `field "to" is an array`}},
		{"OnEach not JSON", `[`, []Option{OnEach("from", "to")}, []string{`"pay"`, `"from", "to"`}},
		{"KeysBy error", `{}`, []Option{KeysBy(func(context.Context, *asynq.Task) ([]string, error) {
			return nil, errors.New("no accounts")
		})}, []string{`"pay"`, "no accounts"}},
		{"KeysBy no key", `{}`, []Option{KeysBy(func(context.Context, *asynq.Task) ([]string, error) {
			return nil, nil
		})}, []string{`"pay"`, "KeysBy returned no key"}},
		{"KeysBy empty key", `{}`, []Option{KeysBy(func(context.Context, *asynq.Task) ([]string, error) {
			return []string{"a", ""}, nil
		})}, []string{`"pay"`, "KeysBy returned an empty key"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			locks, _ := newLocks(t)
			var rec recorder
			opts := append(tt.opts, AfterFailure(rec.hook))
			h := Middleware(locks, opts...)(asynq.HandlerFunc(func(context.Context, *asynq.Task) error {
				t.Error("the handler ran without a key")
				return nil
			}))
			err := h.ProcessTask(context.Background(), asynq.NewTask("pay", []byte(tt.payload)))
			require.Error(t, err)
			assert.ErrorIs(t, err, asynq.SkipRetry, "archived at once, not retried in a loop")
			for _, w := range tt.want {
				assert.Contains(t, err.Error(), w)
			}
			assert.Len(t, rec.got(), 1, "AfterFailure calls")
		})
	}
}

func TestMiddlewareRedisDown(t *testing.T) {
	locks, m := newLocks(t)
	m.Close()
	var rec recorder
	h := Middleware(locks, AfterFailure(rec.hook))(asynq.HandlerFunc(func(context.Context, *asynq.Task) error {
		t.Error("the handler ran without the lock")
		return nil
	}))
	err := h.ProcessTask(context.Background(), asynq.NewTask("pay", nil))
	require.Error(t, err)
	assert.NotErrorIs(t, err, asynq.SkipRetry, "a Redis outage is retryable")
	assert.NotErrorIs(t, err, mutex.ErrNotObtained)
	assert.True(t, IsFailure(err))
	assert.Contains(t, err.Error(), `task "pay"`)
	assert.Len(t, rec.got(), 1)
}

func TestMiddlewareLeaseLost(t *testing.T) {
	locks, m := newLocks(t)
	handlerErr := errors.New("stopped")
	h := Middleware(locks, TTL(30*time.Millisecond), Logger(slog.New(slog.DiscardHandler)))(asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
		m.Del(`asynqmutex:{["pay"]}`)
		select {
		case <-ctx.Done():
			return handlerErr
		case <-time.After(30 * time.Second):
			return errors.New("not cancelled")
		}
	}))
	err := h.ProcessTask(context.Background(), asynq.NewTask("pay", nil))
	assert.ErrorIs(t, err, mutex.ErrNotHeld)
	assert.ErrorIs(t, err, handlerErr)
	assert.Contains(t, err.Error(), "lost")
	assert.True(t, IsFailure(err))
}

// TestMiddlewareLeaseLostAfterSuccess loses the lease while a handler runs that
// then returns nil: the task completes, the loss is logged once at Warn with the
// task and key but no token, and AfterFailure is not called.
func TestMiddlewareLeaseLostAfterSuccess(t *testing.T) {
	locks, m := newLocks(t)
	var logs bytes.Buffer
	logger := slog.New(slog.NewTextHandler(&logs, nil))
	var rec recorder
	var token string
	h := Middleware(locks, TTL(30*time.Millisecond), Logger(logger), AfterFailure(rec.hook))(asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
		l, _ := mutex.FromContext(ctx)
		token = l.Token()
		m.Del(`asynqmutex:{["pay"]}`)
		select {
		case <-ctx.Done(): // the loss is noticed while the handler runs
		case <-time.After(30 * time.Second):
			t.Error("the handler's context was not cancelled when its lease was lost")
		}
		return nil // its work was done
	}))
	ctx := context.Background()
	err := h.ProcessTask(ctx, asynq.NewTask("pay", nil))
	assert.NoError(t, err, "a handler's nil stands when the lease was lost")
	assert.Empty(t, rec.got(), "AfterFailure is for tasks that did not run")
	out := logs.String()
	assert.Equal(t, 1, strings.Count(out, "\n"), "one log record: %s", out)
	for _, want := range []string{"level=WARN", "lock lost while the handler ran", "task_type=pay", `key="[\"pay\"]"`, "handler returned nil", "not held"} {
		assert.Contains(t, out, want)
	}
	require.NotEmpty(t, token)
	assert.NotContains(t, out, token, "tokens never appear in logs")
}

func TestConfigure(t *testing.T) {
	locked := &LockedError{Key: "k", RetryIn: 4 * time.Second}
	other := errors.New("boom")
	task := asynq.NewTask("pay", nil)

	cfg := Configure(asynq.Config{})
	assert.False(t, cfg.IsFailure(locked))
	assert.True(t, cfg.IsFailure(other))
	for range 100 {
		d := cfg.RetryDelayFunc(0, locked, task)
		assert.GreaterOrEqual(t, d, 4*time.Second)
		assert.Less(t, d, 6*time.Second+time.Millisecond)
	}

	var calls []string
	chained := Configure(asynq.Config{
		IsFailure: func(err error) bool { calls = append(calls, "isFailure"); return false },
		RetryDelayFunc: func(n int, err error, t *asynq.Task) time.Duration {
			calls = append(calls, "retryDelay")
			return time.Minute
		},
	})
	assert.False(t, chained.IsFailure(other), "the user's IsFailure decides other errors")
	assert.Equal(t, time.Minute, chained.RetryDelayFunc(1, other, task))
	assert.False(t, chained.IsFailure(locked))
	assert.GreaterOrEqual(t, chained.RetryDelayFunc(1, locked, task), 4*time.Second)
	assert.Equal(t, []string{"isFailure", "retryDelay"}, calls, "the user's functions see only their errors")
}

func TestOptionPanics(t *testing.T) {
	locks, _ := newLocks(t)
	tests := []struct {
		name, want string
		f          func()
	}{
		{"nil client", "asynqmutex.Middleware", func() { Middleware(nil) }},
		{"On without fields", "asynqmutex.On", func() { On() }},
		{"On empty field", "asynqmutex.On", func() { On("") }},
		{"KeyBy nil", "asynqmutex.KeyBy", func() { KeyBy(nil) }},
		{"both", "asynqmutex.Middleware", func() {
			Middleware(locks, On("a"), KeyBy(func(context.Context, *asynq.Task) (string, error) { return "", nil }))
		}},
		{"OnEach without fields", "asynqmutex.OnEach", func() { OnEach() }},
		{"OnEach empty field", "asynqmutex.OnEach", func() { OnEach("a", "") }},
		{"KeysBy nil", "asynqmutex.KeysBy", func() { KeysBy(nil) }},
		{"Scope empty", "asynqmutex.Scope", func() { Scope("") }},
		{"Scope with KeyBy", "KeyBy makes its own keys", func() {
			Middleware(locks, Scope("a"), KeyBy(func(context.Context, *asynq.Task) (string, error) { return "", nil }))
		}},
		{"On and OnEach", `two key options, On("a") and OnEach("b"); give one`, func() { Middleware(locks, On("a"), OnEach("b")) }},
		{"On twice", `two key options, On("customer_id") and On("region"); give every field to one On`, func() {
			Middleware(locks, On("customer_id"), On("region"))
		}},
		{"OnEach twice", `two key options, OnEach("from") and OnEach("to"); give every field to one OnEach`, func() {
			Middleware(locks, OnEach("from"), OnEach("to"))
		}},
		{"KeyBy twice", "two key options, KeyBy(fn) and KeyBy(fn)", func() {
			fn := func(context.Context, *asynq.Task) (string, error) { return "k", nil }
			Middleware(locks, KeyBy(fn), KeyBy(fn))
		}},
		{"For without types", "asynqmutex.For: no task type", func() { For() }},
		{"For empty type", "asynqmutex.For: empty task type", func() { For("a", "") }},
		{"For twice", `For("a") and For("b", "c") both given; list every task type in one For`, func() {
			Middleware(locks, For("a"), On("id"), For("b", "c"))
		}},
		{"TTL", "asynqmutex.TTL", func() { TTL(0) }},
		{"TTL below MinTTL", "20ms", func() { TTL(3 * time.Millisecond) }},
		{"TTL above MaxTTL", "168h0m0s", func() { TTL(math.MaxInt64) }},
		{"MaxWait", "asynqmutex.MaxWait", func() { MaxWait(-time.Second) }},
		{"RetryLater zero", "asynqmutex.RetryLater", func() { RetryLater(0) }},
		{"RetryLater negative", "asynqmutex.RetryLater", func() { RetryLater(-time.Second) }},
		{"OnConflict", "asynqmutex.OnConflict", func() { OnConflict(Policy(0)) }},
		{"OnConflict part of a second", "asynqmutex.OnConflict", func() { OnConflict(Policy(1500 * time.Millisecond)) }},
		{"Limit with OnEach", "Limit caps the tasks of one key; OnEach", func() { Middleware(locks, OnEach("a", "b"), Limit(2)) }},
		{"Limit with KeysBy", "KeysBy gives a task several keys", func() {
			Middleware(locks, Limit(2), KeysBy(func(context.Context, *asynq.Task) ([]string, error) { return nil, nil }))
		}},
		{"Scope with KeysBy", "KeysBy makes its own keys", func() {
			Middleware(locks, Scope("a"), KeysBy(func(context.Context, *asynq.Task) ([]string, error) { return nil, nil }))
		}},
		{"KeysBy and On", `two key options, KeysBy(fn) and On("a")`, func() {
			Middleware(locks, KeysBy(func(context.Context, *asynq.Task) ([]string, error) { return nil, nil }), On("a"))
		}},
		{"AfterFailure", "asynqmutex.AfterFailure", func() { AfterFailure(nil) }},
		{"Logger", "asynqmutex.Logger", func() { Logger(nil) }},
		{"MaxBacklog zero", "asynqmutex.MaxBacklog: n 0 below 1", func() { MaxBacklog(0, OverflowSkip) }},
		{"MaxBacklog no overflow", "asynqmutex.MaxBacklog: invalid overflow 0", func() { MaxBacklog(1, Overflow(0)) }},
		{"MaxBacklog with Skip", "MaxBacklog caps the line of Park, not of Skip", func() {
			Middleware(locks, On("a"), MaxBacklog(5, OverflowSkip), OnConflict(Skip))
		}},
		{"MaxBacklog with RetryLater", "MaxBacklog caps the line of Park", func() {
			Middleware(locks, On("a"), MaxBacklog(5, OverflowFail), OnConflict(RetryLater(time.Second)))
		}},
		{"MaxBacklog with InOrder", "under InOrder a task waits in its key's order", func() {
			Middleware(locks, On("a"), MaxBacklog(5, OverflowReplace), InOrder(noTasks{}))
		}},
		{"MaxBacklog with OnEach", "MaxBacklog caps the line of one key; OnEach", func() {
			Middleware(locks, OnEach("a", "b"), MaxBacklog(5, OverflowSkip))
		}},
		{"MaxBacklog with KeysBy", "MaxBacklog caps the line of one key; KeysBy", func() {
			Middleware(locks, MaxBacklog(5, OverflowSkip), KeysBy(func(context.Context, *asynq.Task) ([]string, error) { return nil, nil }))
		}},
		{"MaxBacklog twice", "MaxBacklog(5, OverflowSkip) and MaxBacklog(2, OverflowFail) both given", func() {
			Middleware(locks, On("a"), MaxBacklog(5, OverflowSkip), MaxBacklog(2, OverflowFail))
		}},
		{"MaxReschedules zero", "asynqmutex.MaxReschedules", func() { MaxReschedules(0) }},
		{"MaxReschedules negative", "asynqmutex.MaxReschedules", func() { MaxReschedules(-1) }},
		{"MaxRescheduleTime zero", "asynqmutex.MaxRescheduleTime", func() { MaxRescheduleTime(0) }},
		{"MaxRescheduleTime negative", "asynqmutex.MaxRescheduleTime", func() { MaxRescheduleTime(-time.Second) }},
		{"cap with Skip", "asynqmutex.Middleware", func() { Middleware(locks, MaxReschedules(1), OnConflict(Skip)) }},
		{"cap with Fail", "asynqmutex.Middleware", func() { Middleware(locks, OnConflict(Fail), MaxRescheduleTime(time.Minute)) }},
		{"nil handler", "asynqmutex.Middleware", func() { Middleware(locks)(nil) }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			defer func() {
				r := recover()
				require.NotNil(t, r, "no panic")
				assert.True(t, strings.Contains(r.(string), tt.want), "panic %q does not name %s", r, tt.want)
			}()
			tt.f()
		})
	}
}

// TestForPassesOtherTypesThrough: under For, a task of another type reaches the
// handler as it came, whatever its payload, and costs no Redis command; a task of a
// named type is locked, and archived when its payload lacks the field.
func TestForPassesOtherTypesThrough(t *testing.T) {
	for _, tt := range []struct {
		name string
		opts []Option
	}{
		{"On", []Option{For("pay", "refund"), On("id")}},
		{"OnEach", []Option{OnEach("from", "to"), For("pay", "refund")}},
		{"task type key", []Option{For("pay", "refund")}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			locks, m := newLocks(t)
			ctx := context.Background()
			var hook recorder
			var seen []*asynq.Task
			var locked []bool
			h := Middleware(locks, append(tt.opts, AfterFailure(hook.hook))...)(asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
				seen = append(seen, task)
				_, ok := Fence(ctx)
				locked = append(locked, ok)
				return nil
			}))

			before := m.CommandCount()
			other := asynq.NewTask("customer:sync", []byte(`not even JSON`))
			require.NoError(t, h.ProcessTask(ctx, other))
			assert.Equal(t, before, m.CommandCount(), "a task of another type costs no Redis command")
			require.Len(t, seen, 1)
			assert.Same(t, other, seen[0], "the handler gets the task itself")
			assert.False(t, locked[0], "a task of another type runs without a lock")

			require.NoError(t, h.ProcessTask(ctx, asynq.NewTask("refund", []byte(`{"id":"r1","from":"A","to":"B"}`))))
			require.Len(t, locked, 2)
			assert.True(t, locked[1], "a named type runs under its lock")
			assert.Greater(t, m.CommandCount(), before, "and that lock is taken in Redis")

			if tt.name != "task type key" {
				err := h.ProcessTask(ctx, asynq.NewTask("pay", []byte(`{}`)))
				assert.ErrorIs(t, err, asynq.SkipRetry, "a named type whose payload lacks the field is bad input")
				assert.Len(t, seen, 2, "and does not run")
				assert.Len(t, hook.got(), 1)
			}
		})
	}
}

func TestRetryLaterRoundsUp(t *testing.T) {
	for d, want := range map[time.Duration]time.Duration{
		time.Nanosecond:         time.Second,
		500 * time.Millisecond:  time.Second,
		time.Second:             time.Second,
		1500 * time.Millisecond: 2 * time.Second,
		time.Minute:             time.Minute,
		math.MaxInt64:           math.MaxInt64,
	} {
		if got := time.Duration(RetryLater(d)); got != want {
			t.Errorf("RetryLater(%v) = %v, want %v", d, got, want)
		}
	}
}

func TestPolicyString(t *testing.T) {
	for p, want := range map[Policy]string{Skip: "Skip", Fail: "Fail", RetryLater(2 * time.Second): "RetryLater(2s)"} {
		if got := p.String(); got != want {
			t.Errorf("Policy(%d).String() = %q, want %q", p, got, want)
		}
	}
}

// TestErrorTextsBounded gives tasks a megabyte key: every error text the
// middleware produces, and every one the hook sees, stays a few hundred bytes,
// showing the key shortened with a digest; LockedError.Key keeps it whole.
func TestErrorTextsBounded(t *testing.T) {
	big := strings.Repeat("x", 1<<20)
	task := asynq.NewTask("pay", []byte(`{"id":"`+big+`"}`))
	key := `["pay","` + big + `"]`
	const bound = 400
	check := func(t *testing.T, what string, err error) {
		t.Helper()
		if err == nil {
			return
		}
		// The key readable, never Go-quoted: a key of JSON escaped twice is hard to read.
		msg := err.Error()
		shown := strings.Contains(msg, `["pay","xxxx`) && !strings.Contains(msg, `\"`)
		if len(msg) > bound || !shown || strings.Count(msg, "…sha256:") != 1 {
			t.Errorf("%s: error text is %d bytes: %.300q; want at most %d, the key shortened with a digest, once", what, len(msg), msg, bound)
		}
	}
	for _, p := range []Policy{Skip, Fail, RetryLater(time.Second)} {
		t.Run("busy "+p.String(), func(t *testing.T) {
			locks, _ := newLocks(t)
			ctx := context.Background()
			holder, err := locks.TryLock(ctx, key, time.Minute)
			require.NoError(t, err)
			defer holder.Unlock(ctx)
			var rec recorder
			h := Middleware(locks, On("id"), OnConflict(p), AfterFailure(rec.hook))(asynq.HandlerFunc(func(context.Context, *asynq.Task) error {
				t.Error("the handler ran without the lock")
				return nil
			}))
			check(t, "returned", h.ProcessTask(ctx, task))
			got := rec.got()
			require.Len(t, got, 1)
			check(t, "hook", got[0])
			var le *LockedError
			require.True(t, errors.As(got[0], &le))
			assert.Equal(t, key, le.Key, "LockedError.Key is the whole key")
		})
	}
	t.Run("Redis down", func(t *testing.T) {
		locks, m := newLocks(t)
		m.Close()
		h := Middleware(locks, On("id"))(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return nil }))
		err := h.ProcessTask(context.Background(), task)
		require.Error(t, err)
		check(t, "Redis down", err)
	})
	t.Run("lease lost", func(t *testing.T) {
		locks, m := newLocks(t)
		h := Middleware(locks, On("id"), TTL(30*time.Millisecond), Logger(slog.New(slog.DiscardHandler)))(asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
			for _, k := range m.Keys() {
				if strings.HasPrefix(k, "asynqmutex:{") && !strings.Contains(k, "fence") {
					m.Del(k)
				}
			}
			<-ctx.Done()
			return errors.New("stopped")
		}))
		err := h.ProcessTask(context.Background(), task)
		require.ErrorIs(t, err, mutex.ErrNotHeld)
		check(t, "lease lost", err)
	})
	t.Run("task type", func(t *testing.T) {
		locks, _ := newLocks(t)
		h := Middleware(locks, On("id"))(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return nil }))
		err := h.ProcessTask(context.Background(), asynq.NewTask(big, []byte(`{}`)))
		require.Error(t, err)
		if msg := err.Error(); len(msg) > bound || !strings.Contains(msg, "…sha256:") {
			t.Errorf("error text is %d bytes: %.300q; want at most %d, the type shortened", len(msg), msg, bound)
		}
	})
}

func TestMiddlewareEvents(t *testing.T) {
	m := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	t.Cleanup(func() { rdb.Close() })
	var (
		mu     sync.Mutex
		events []mutex.Event
		tasks  []Event
	)
	locks := mutex.New(rdb, mutex.Observe(func(_ context.Context, e mutex.Event) {
		mu.Lock()
		events = append(events, e)
		mu.Unlock()
	}))
	t.Cleanup(func() { locks.Close() })
	take := func() ([]mutex.Event, []Event) {
		mu.Lock()
		defer mu.Unlock()
		e, tk := events, tasks
		events, tasks = nil, nil
		return e, tk
	}
	ctx := context.Background()
	var holder mutex.Info
	h := Middleware(locks, On("id"), OnConflict(Skip), Observe(func(_ context.Context, e Event) {
		mu.Lock()
		tasks = append(tasks, e)
		mu.Unlock()
	}))(asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
		var err error
		holder, err = locks.Inspect(ctx, `["pay","t1"]`)
		return err
	}))
	require.NoError(t, h.ProcessTask(ctx, asynq.NewTask("pay", []byte(`{"id":"t1"}`))))
	assert.Equal(t, "pay", holder.Holder.Name, "the lock records the task type")
	ev, tk := take()
	require.Len(t, ev, 2)
	assert.Equal(t, mutex.OpAcquired, ev[0].Op)
	assert.Equal(t, "pay", ev[0].Name)
	assert.Equal(t, mutex.OpReleased, ev[1].Op)
	assert.Empty(t, tk, "a task that ran is no event of the middleware's")

	busy, err := locks.TryLock(ctx, `["pay","t1"]`, time.Minute)
	require.NoError(t, err)
	defer busy.Unlock(ctx)
	take()
	require.NoError(t, h.ProcessTask(ctx, asynq.NewTask("pay", []byte(`{"id":"t1"}`))))
	ev, tk = take()
	require.Len(t, ev, 2)
	assert.Equal(t, []mutex.Op{mutex.OpContended, mutex.OpNotObtained}, []mutex.Op{ev[0].Op, ev[1].Op})
	require.Len(t, tk, 1)
	assert.Equal(t, OpConflict, tk[0].Op)
	assert.Equal(t, "skip", tk[0].Policy)
	assert.Equal(t, "pay", tk[0].TaskType)
	assert.Equal(t, `["pay","t1"]`, tk[0].Key)
	var le *LockedError
	assert.ErrorAs(t, tk[0].Err, &le)

	err = h.ProcessTask(ctx, asynq.NewTask("pay\tx", []byte(`{"no":"id"}`)))
	require.Error(t, err)
	ev, tk = take()
	assert.Empty(t, ev, "no lock was tried")
	require.Len(t, tk, 1)
	assert.Equal(t, OpBadInput, tk[0].Op)
	assert.Equal(t, "pay x", tk[0].TaskType, "the task type cleaned as mutex.HeldBy cleans it")
	assert.Equal(t, err, tk[0].Err)
	assert.Equal(t, "bad_input", OpBadInput.String())
	assert.Equal(t, "order_stalled", OpOrderStalled.String())
	assert.Equal(t, "park_passed_over", OpParkPassedOver.String())
	assert.Equal(t, "op(99)", Op(99).String())
}

func TestMiddlewareSeveralKeys(t *testing.T) {
	locks, _ := newLocks(t)
	ctx := context.Background()
	var fences []int64
	var rec recorder
	mw := Middleware(locks, OnEach("from", "to"), OnConflict(Fail), AfterFailure(rec.hook))
	h := mw(asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		var p struct{ From, To string }
		require.NoError(t, json.Unmarshal(task.Payload(), &p))
		for _, a := range []string{p.From, p.To} {
			key := `["transfer","` + a + `"]`
			locked, err := locks.Locked(ctx, key)
			require.NoError(t, err)
			assert.True(t, locked, "%s is held while the handler runs", key)
		}
		l, ok := mutex.FromContext(ctx)
		require.True(t, ok)
		fences = l.Fences()
		return nil
	}))
	require.NoError(t, h.ProcessTask(ctx, asynq.NewTask("transfer", []byte(`{"from":"A","to":"B"}`))))
	assert.Len(t, fences, 2)

	held, err := locks.TryLock(ctx, `["transfer","B"]`, time.Minute)
	require.NoError(t, err)
	err = h.ProcessTask(ctx, asynq.NewTask("transfer", []byte(`{"from":"C","to":"B"}`)))
	require.ErrorIs(t, err, mutex.ErrNotObtained)
	assert.Contains(t, err.Error(), `lock ["transfer","B"] (of ["transfer","C"] and ["transfer","B"]) is held`)
	var le *LockedError
	require.Len(t, rec.got(), 1)
	require.ErrorAs(t, rec.got()[0], &le)
	assert.Equal(t, `["transfer","B"]`, le.Key, "Key is the busy one")
	assert.Equal(t, []string{`["transfer","C"]`, `["transfer","B"]`}, le.Keys)
	locked, err := locks.Locked(ctx, `["transfer","C"]`)
	require.NoError(t, err)
	assert.False(t, locked, "the free key is not kept when the task does not run")
	require.NoError(t, held.Unlock(ctx))

	// The same account on both sides is one key.
	require.NoError(t, h.ProcessTask(ctx, asynq.NewTask("transfer", []byte(`{"from":"A","to":"A"}`))))
	assert.Len(t, fences, 1)
}

func TestMiddlewareScopeSharesKeysAcrossTypes(t *testing.T) {
	locks, _ := newLocks(t)
	ctx := context.Background()
	var inner asynq.Handler
	ran := map[string]bool{}
	body := asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		ran[task.Type()] = true
		if task.Type() == "transfer" {
			// A deposit on account B while the transfer holds it: refused.
			err := inner.ProcessTask(ctx, asynq.NewTask("deposit", []byte(`{"account":"B"}`)))
			assert.ErrorIs(t, err, mutex.ErrNotObtained, "a deposit on B waits for the transfer from A to B")
			assert.Contains(t, err.Error(), `["account","B"]`)
		}
		return nil
	})
	deposit := Middleware(locks, Scope("account"), On("account"), OnConflict(Fail))(body)
	inner = deposit
	transfer := Middleware(locks, OnEach("from", "to"), Scope("account"), OnConflict(Fail))(body)
	require.NoError(t, transfer.ProcessTask(ctx, asynq.NewTask("transfer", []byte(`{"from":"A","to":"B"}`))))
	assert.True(t, ran["transfer"])
	assert.False(t, ran["deposit"])
	key, err := Key("account", `"B"`)
	require.NoError(t, err)
	assert.Equal(t, `["account","B"]`, key, "Key(scope, values...) finds a scoped task's lock")

	// Without On, a scope is one key for every type given it.
	held, err := locks.TryLock(ctx, `["mailer"]`, time.Minute)
	require.NoError(t, err)
	err = Middleware(locks, Scope("mailer"), OnConflict(Fail))(body).ProcessTask(ctx, asynq.NewTask("email:welcome", nil))
	assert.ErrorIs(t, err, mutex.ErrNotObtained)
	require.NoError(t, held.Unlock(ctx))
}

func TestMiddlewareBusySetNamesEachKeyOnce(t *testing.T) {
	locks, _ := newLocks(t)
	ctx := context.Background()
	held, err := locks.TryLock(ctx, "b", time.Minute)
	require.NoError(t, err)
	defer held.Unlock(ctx)
	var rec recorder
	h := Middleware(locks, KeysBy(func(context.Context, *asynq.Task) ([]string, error) {
		return []string{"a", "b", "a"}, nil
	}), OnConflict(Skip), AfterFailure(rec.hook))(mustNotRun(t))
	require.NoError(t, h.ProcessTask(ctx, asynq.NewTask("pay", nil)))
	require.Len(t, rec.got(), 1)
	var le *LockedError
	require.ErrorAs(t, rec.got()[0], &le)
	assert.Equal(t, []string{"a", "b"}, le.Keys, "a key given twice is one key")
	assert.Equal(t, "b", le.Key, "the busy one")
}

// TestErrorsNameKeyOnceOnOneLine: whatever the middleware returns or hands to
// AfterFailure names the key once, readable, on one line, also where it wraps an
// TestOptionGivenTwice: every option given twice to one Middleware panics, naming
// both calls, whatever it sets: none is kept silently over the other.
func TestOptionGivenTwice(t *testing.T) {
	locks, _ := newLocks(t)
	noop := func(context.Context, *asynq.Task, error) {}
	for _, tt := range []struct {
		a, b Option
		want string
	}{
		{TTL(time.Second), TTL(2 * time.Second), "TTL(1s) and TTL(2s) both given; give TTL once"},
		{MaxWait(time.Second), MaxWait(time.Second), "MaxWait(1s) and MaxWait(1s) both given; give MaxWait once"},
		{OnConflict(Skip), OnConflict(Fail), "OnConflict(Skip) and OnConflict(Fail) both given; give OnConflict once"},
		{Limit(2), Limit(3), "Limit(2) and Limit(3) both given; give Limit once"},
		{AfterFailure(noop), AfterFailure(noop), "AfterFailure(fn) and AfterFailure(fn) both given"},
		{Logger(slog.Default()), Logger(slog.Default()), "Logger(l) and Logger(l) both given"},
		{Scope("a"), Scope("b"), `Scope("a") and Scope("b") both given`},
		{MaxReschedules(1), MaxReschedules(2), "MaxReschedules(1) and MaxReschedules(2) both given"},
		{MaxRescheduleTime(time.Minute), MaxRescheduleTime(time.Hour), "MaxRescheduleTime(1m0s) and MaxRescheduleTime(1h0m0s) both given"},
		{Burst(2), Burst(3), "Burst(2) and Burst(3) both given"},
		{NoLock(), NoLock(), "NoLock() and NoLock() both given"},
		{OrderGrace(time.Second), OrderGrace(time.Second), "OrderGrace(1s) and OrderGrace(1s) both given"},
		{Rate(1, time.Second), Rate(2, time.Second), "Rate and Rate both given; give one"},
	} {
		t.Run(tt.want, func(t *testing.T) {
			defer func() {
				r, _ := recover().(string)
				if !strings.HasPrefix(r, "asynqmutex.Middleware: ") || !strings.Contains(r, tt.want) {
					t.Fatalf("Middleware with an option twice panics %q, want it to say %q", r, tt.want)
				}
			}()
			Middleware(locks, tt.a, tt.b)
		})
	}
	// Control: each given once is accepted.
	Middleware(locks, TTL(time.Second), MaxWait(time.Second), Limit(2), AfterFailure(noop), Logger(slog.Default()), Scope("a"), MaxReschedules(1), MaxRescheduleTime(time.Minute))
}

// error of package mutex (which names the key itself) or one joined from several.
func TestErrorsNameKeyOnceOnOneLine(t *testing.T) {
	task := asynq.NewTask("order:ship", []byte(`{"order_id":"o-1"}`))
	const key = `["order:ship","o-1"]`
	check := func(t *testing.T, err error, wants ...string) {
		t.Helper()
		require.Error(t, err)
		msg := err.Error()
		assert.NotContains(t, msg, "\n", "one line")
		assert.Equal(t, 1, strings.Count(msg, "o-1"), "the key once: %s", msg)
		assert.Equal(t, 1, strings.Count(msg, key)+strings.Count(msg, `"[\"order:ship\",\"o-1\"]"`), "the key shown whole: %s", msg)
		for _, w := range wants {
			assert.Contains(t, msg, w)
		}
	}
	t.Run("Redis down", func(t *testing.T) {
		locks, m := newLocks(t)
		m.Close()
		var rec recorder
		err := Middleware(locks, On("order_id"), AfterFailure(rec.hook))(mustNotRun(t)).ProcessTask(context.Background(), task)
		check(t, err, `task "order:ship"`, "taking lock")
		require.Len(t, rec.got(), 1)
		check(t, rec.got()[0])
	})
	t.Run("cancelled while waiting", func(t *testing.T) {
		locks, _ := newLocks(t)
		held, err := locks.TryLock(context.Background(), key, time.Minute)
		require.NoError(t, err)
		defer held.Unlock(context.Background())
		ctx, cancel := context.WithCancel(context.Background())
		h := Middleware(locks, On("order_id"), MaxWait(time.Minute), Logger(slog.New(slog.DiscardHandler)))(mustNotRun(t))
		done := make(chan error, 1)
		go func() { done <- h.ProcessTask(ctx, task) }()
		require.Eventually(t, func() bool {
			in, err := locks.Inspect(context.Background(), key)
			return err == nil && in.Waiting == 1
		}, 10*time.Second, time.Millisecond, "the task queues for the key")
		cancel()
		err = <-done
		assert.ErrorIs(t, err, context.Canceled)
		assert.ErrorIs(t, err, mutex.ErrNotObtained)
		check(t, err, "taking lock")
	})
	t.Run("lease lost", func(t *testing.T) {
		locks, m := newLocks(t)
		handlerErr := errors.New("stopped")
		h := Middleware(locks, On("order_id"), TTL(30*time.Millisecond), Logger(slog.New(slog.DiscardHandler)))(asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
			m.Del(`asynqmutex:{` + key + `}`)
			<-ctx.Done()
			return handlerErr
		}))
		err := h.ProcessTask(context.Background(), task)
		assert.ErrorIs(t, err, mutex.ErrNotHeld)
		assert.ErrorIs(t, err, handlerErr)
		check(t, err, "lost while the handler ran", "the handler returned: stopped")
	})
	t.Run("busy", func(t *testing.T) {
		locks, _ := newLocks(t)
		held, err := locks.TryLock(context.Background(), key, time.Minute)
		require.NoError(t, err)
		defer held.Unlock(context.Background())
		err = Middleware(locks, On("order_id"), OnConflict(RetryLater(time.Second)))(mustNotRun(t)).ProcessTask(context.Background(), task)
		check(t, err, "held by another task; retry in 1s")
		assert.NotContains(t, err.Error(), "if the server", "LockedError states its delay, without doubt")
	})
}
