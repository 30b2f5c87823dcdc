package integration

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynqmutex/asynqmutex"
	"github.com/asynqmutex/asynqmutex/mutex"
)

// TestLongHandlerKeepsLock runs a handler for five TTLs: the renewal keeps the key
// locked the whole time (another client's TryLock keeps failing), the handler's
// context is never cancelled, and the key is free once the task is done.
func TestLongHandlerKeepsLock(t *testing.T) {
	t.Parallel()
	// A lease long enough that a renewal every ttl/3 survives a busy machine's stalls,
	// and a handler five leases long.
	const ttl, work = time.Second, 5 * time.Second
	ctx := context.Background()
	e := newEnv(t)
	key := lockKey(t, "report", "r6")

	started, finished := make(chan int64, 1), make(chan error, 1)
	locks, _ := newLocks(t, e.opt)
	mw := asynqmutex.Middleware(locks, asynqmutex.On("id"), asynqmutex.TTL(ttl))
	startServer(t, e.opt, asynqmutex.Configure(asynq.Config{Concurrency: 2}), mw(asynq.HandlerFunc(
		func(ctx context.Context, _ *asynq.Task) error {
			fence, ok := asynqmutex.Fence(ctx)
			if !ok {
				fence = -1
			}
			started <- fence
			select {
			case <-time.After(work):
				finished <- nil
				return nil
			case <-ctx.Done():
				finished <- context.Cause(ctx)
				return ctx.Err()
			}
		})))
	task := e.enqueue(t, "report", payload(t, map[string]string{"id": "r6"}), asynq.MaxRetry(0), asynq.Retention(time.Hour))

	var fence int64
	select {
	case fence = <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("handler did not start within 10s")
	}
	if fence <= 0 {
		t.Errorf("Fence(ctx) in the handler = %d, want > 0 (reported ok)", fence)
	}

	checks := 0
	var handlerErr error
loop:
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); {
		select {
		case handlerErr = <-finished:
			break loop
		default:
		}
		l, err := e.locks.TryLock(ctx, key, time.Second)
		if !errors.Is(err, mutex.ErrNotObtained) {
			_ = l.Unlock(ctx)
			t.Fatalf("TryLock(%s) %v into the handler = %v, want ErrNotObtained: the lease was not kept", key, time.Duration(checks)*50*time.Millisecond, err)
		}
		checks++
		time.Sleep(50 * time.Millisecond)
	}
	if handlerErr != nil {
		t.Fatalf("handler's context was cancelled: %v", handlerErr)
	}
	if checks < int(work/ttl) {
		t.Errorf("only %d TryLock checks during a %v handler", checks, work)
	}

	info := waitState(t, e.insp, "default", task.ID, asynq.TaskStateCompleted, 10*time.Second)
	if info.LastErr != "" {
		t.Errorf("completed task: %s", describeTask(info))
	}
	l, err := e.locks.TryLock(ctx, key, time.Second)
	if err != nil {
		t.Fatalf("TryLock after the task completed = %v, want the lock (released)", err)
	}
	defer l.Unlock(ctx)
	if l.Fence() <= fence {
		t.Errorf("fence after the task = %d, want > the handler's %d", l.Fence(), fence)
	}
	t.Logf("%d TryLock checks failed as they should during the handler", checks)
}

// TestLeaseLostCancelsHandler deletes the lock key in Redis while the handler runs:
// the renewal finds it gone, the handler's context is cancelled with a cause wrapping
// mutex.ErrNotHeld, and the task fails with an error that says the lock was lost.
func TestLeaseLostCancelsHandler(t *testing.T) {
	t.Parallel()
	const ttl = 600 * time.Millisecond
	e := newEnv(t)
	key := lockKey(t, "ledger", "l7")
	rkey := redisLockKey(t, key)

	var runs atomic.Int32
	started := make(chan struct{}, 1)
	cause := make(chan error, 1)
	var errs errRecorder
	locks, _ := newLocks(t, e.opt)
	mw := asynqmutex.Middleware(locks, asynqmutex.On("id"), asynqmutex.TTL(ttl))
	startServer(t, e.opt, asynqmutex.Configure(asynq.Config{Concurrency: 2, ErrorHandler: &errs}), mw(asynq.HandlerFunc(
		func(ctx context.Context, _ *asynq.Task) error {
			runs.Add(1)
			started <- struct{}{}
			select {
			case <-ctx.Done():
				cause <- context.Cause(ctx)
				return ctx.Err()
			case <-time.After(10 * time.Second):
				cause <- nil
				return nil
			}
		})))
	task := e.enqueue(t, "ledger", payload(t, map[string]string{"id": "l7"}), asynq.MaxRetry(0), asynq.Retention(time.Hour))

	e.loseLease(t, started, rkey)
	deleted := time.Now()
	select {
	case err := <-cause:
		if err == nil {
			t.Fatal("handler ran 10s after its lock key was deleted without its context being cancelled")
		}
		if !errors.Is(err, mutex.ErrNotHeld) {
			t.Errorf("context.Cause = %v, want it to wrap mutex.ErrNotHeld", err)
		}
		t.Logf("handler cancelled %v after the key was deleted: %v", time.Since(deleted).Round(time.Millisecond), err)
	case <-time.After(15 * time.Second):
		t.Fatal("handler still running 15s after its lock key was deleted")
	}

	info := waitState(t, e.insp, "default", task.ID, asynq.TaskStateArchived, 10*time.Second)
	if !strings.Contains(info.LastErr, "lost") || !strings.Contains(info.LastErr, "not held") {
		t.Errorf("archived task: %s; want LastErr saying the lock was lost (mutex: not held)", describeTask(info))
	}
	got := errs.all()
	if len(got) != 1 {
		t.Fatalf("ErrorHandler saw %d errors, want 1: %v", len(got), got)
	}
	if !errors.Is(got[0], mutex.ErrNotHeld) || !strings.Contains(got[0].Error(), "lost") {
		t.Errorf("task error = %v; want one mentioning \"lost\" that wraps mutex.ErrNotHeld", got[0])
	}
	if n := runs.Load(); n != 1 {
		t.Errorf("handler ran %d times, want 1", n)
	}
}

// TestLeaseLostAfterSuccessCompletes deletes the lock key while the handler runs;
// the handler notices (its context is cancelled) but has done its work and returns
// nil. The task completes: it runs once, with Retried 0 and no error, AfterFailure
// is not called, and the loss is logged at Warn naming the task.
func TestLeaseLostAfterSuccessCompletes(t *testing.T) {
	t.Parallel()
	const ttl = 600 * time.Millisecond
	e := newEnv(t)
	key := lockKey(t, "capture", "c9")
	rkey := redisLockKey(t, key)

	var runs atomic.Int32
	var hook hookRecorder
	var logs syncBuffer
	started := make(chan struct{}, 1)
	locks, _ := newLocks(t, e.opt)
	mw := asynqmutex.Middleware(locks, asynqmutex.On("id"), asynqmutex.TTL(ttl), asynqmutex.AfterFailure(hook.hook),
		asynqmutex.Logger(slog.New(slog.NewTextHandler(&logs, nil))))
	startServer(t, e.opt, asynqmutex.Configure(asynq.Config{Concurrency: 2}), mw(asynq.HandlerFunc(
		func(ctx context.Context, _ *asynq.Task) error {
			runs.Add(1)
			started <- struct{}{}
			select {
			case <-ctx.Done(): // the work is done; the lease was lost on the way
			case <-time.After(10 * time.Second):
				t.Error("handler's context not cancelled 10s after its lock key was deleted")
			}
			return nil
		})))
	task := e.enqueue(t, "capture", payload(t, map[string]string{"id": "c9"}), asynq.MaxRetry(3), asynq.Retention(time.Hour))

	e.loseLease(t, started, rkey)
	info := waitState(t, e.insp, "default", task.ID, asynq.TaskStateCompleted, 15*time.Second)
	if info.Retried != 0 || info.LastErr != "" {
		t.Errorf("completed task: %s; want Retried 0 and no error", describeTask(info))
	}
	// Long enough for a retry to have come back, were there one.
	time.Sleep(5 * delayedCheck)
	if n := runs.Load(); n != 1 {
		t.Errorf("handler ran %d times, want 1", n)
	}
	if n := hook.count(); n != 0 {
		t.Errorf("AfterFailure called %d times, want 0: the handler ran", n)
	}
	out := logs.String()
	for _, want := range []string{"level=WARN", "lock lost while the handler ran", "task_type=capture", "task_id=" + task.ID, "handler returned nil"} {
		if !strings.Contains(out, want) {
			t.Errorf("log = %q, want it to contain %q", out, want)
		}
	}
}

// loseLease waits for the handler to say it started, then deletes its lock key, rkey,
// where the mutex package documents it: the handler's lease is lost under it.
func (e *env) loseLease(t *testing.T, started <-chan struct{}, rkey string) {
	t.Helper()
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("handler did not start within 10s")
	}
	if n, err := e.rdb.Del(context.Background(), rkey).Result(); err != nil || n != 1 {
		t.Fatalf("DEL %s = %d, %v; want 1 (the lock key as documented)", rkey, n, err)
	}
}

// TestLeaseLapsesWithoutRenewal is the positive control of TestLongHandlerKeepsLock:
// a lock nobody renews is taken by another client soon after its TTL, so the TryLock
// checks there do catch a lease that was not kept.
func TestLeaseLapsesWithoutRenewal(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t)
	other, _ := newLocks(t, e.opt)
	key := lockKey(t, "report", "r6-control")
	if _, err := e.locks.TryLock(ctx, key, 300*time.Millisecond); err != nil {
		t.Fatalf("TryLock: %v", err)
	}
	l, err := other.Lock(ctx, key, time.Second, mutex.MaxWait(5*time.Second))
	if err != nil {
		t.Fatalf("Lock on a lapsed lease = %v, want the lock", err)
	}
	_ = l.Unlock(ctx)
}
