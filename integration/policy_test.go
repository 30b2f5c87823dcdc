package integration

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynqmutex/asynqmutex"
	"github.com/asynqmutex/asynqmutex/mutex"
)

// countingHandler counts its runs.
func countingHandler(runs *atomic.Int32) asynq.HandlerFunc {
	return func(context.Context, *asynq.Task) error {
		runs.Add(1)
		return nil
	}
}

const heldMsg = "held by another task"

// TestRetryLaterKeepsRetries holds a task's key while the task meets it twice under
// RetryLater with Configure: the task goes back to retry each time with its retry
// count at 0 and is never archived, although MaxRetry(1) would archive it after a
// single failure; once the key is free it completes, still with no retry spent.
func TestRetryLaterKeepsRetries(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	key := lockKey(t, "pay", "t1")
	held := e.hold(t, key)

	var runs atomic.Int32
	var hook hookRecorder
	locks, _ := newLocks(t, e.opt)
	mw := asynqmutex.Middleware(locks, asynqmutex.On("id"),
		asynqmutex.OnConflict(asynqmutex.RetryLater(time.Second)), asynqmutex.AfterFailure(hook.hook))
	startServer(t, e.opt, asynqmutex.Configure(asynq.Config{Concurrency: 2}), mw(countingHandler(&runs)))
	task := e.enqueue(t, "pay", payload(t, map[string]string{"id": "t1"}), asynq.MaxRetry(1), asynq.Retention(time.Hour))

	// Count the times the task lands in retry (each sets a new NextProcessAt); each
	// must leave the retry count alone.
	conflicts, seen := 0, map[time.Time]bool{}
	waitFor(t, 20*time.Second, "two conflicts", func() (bool, string) {
		info, desc := taskInfo(e.insp, "default", task.ID)
		if info == nil {
			return false, desc
		}
		switch {
		case info.State == asynq.TaskStateArchived || info.Retried != 0:
			t.Fatalf("after %d conflicts: %s; want retry count 0 and never archived", conflicts, desc)
		case info.State == asynq.TaskStateCompleted:
			t.Fatalf("task completed while its key was held by the test: %s", desc)
		case info.State == asynq.TaskStateRetry && !seen[info.NextProcessAt]:
			seen[info.NextProcessAt] = true
			conflicts++
			if !strings.Contains(info.LastErr, heldMsg) {
				t.Errorf("LastErr = %q, want it to say the lock is %s", info.LastErr, heldMsg)
			}
		}
		return conflicts >= 2, desc
	})
	if n := runs.Load(); n != 0 {
		t.Fatalf("handler ran %d times while the key was held", n)
	}

	if err := held.Unlock(context.Background()); err != nil {
		t.Fatalf("Unlock: %v", err)
	}
	info := waitState(t, e.insp, "default", task.ID, asynq.TaskStateCompleted, 20*time.Second)
	if info.Retried != 0 {
		t.Errorf("completed task: Retried = %d, want 0", info.Retried)
	}
	if n := runs.Load(); n != 1 {
		t.Errorf("handler ran %d times, want 1", n)
	}
	calls := hook.calls()
	if len(calls) < 2 {
		t.Errorf("AfterFailure called %d times, want >= 2 (one per conflict)", len(calls))
	}
	for i, err := range calls {
		var le *asynqmutex.LockedError
		if !errors.As(err, &le) || le.Key != key || le.RetryIn < time.Second || !isNotObtained(err) {
			t.Errorf("AfterFailure call %d: err = %v, want a *LockedError on %s with RetryIn >= 1s wrapping mutex.ErrNotObtained", i, err, key)
		}
	}
	t.Logf("%d conflicts observed, hook called %d times", conflicts, len(calls))
}

// TestRetryLaterWithoutConfigureSpendsRetries is the positive control of
// TestRetryLaterKeepsRetries: without Configure's IsFailure a conflict is an
// ordinary failure, and the retry count grows, which that test would catch.
func TestRetryLaterWithoutConfigureSpendsRetries(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	key := lockKey(t, "pay", "t2")
	held := e.hold(t, key)

	var runs atomic.Int32
	locks, _ := newLocks(t, e.opt)
	mw := asynqmutex.Middleware(locks, asynqmutex.On("id"), asynqmutex.OnConflict(asynqmutex.RetryLater(time.Second)))
	// RetryDelay only, so the retry comes as soon as in the test above; no IsFailure.
	startServer(t, e.opt, asynq.Config{Concurrency: 2, RetryDelayFunc: asynqmutex.RetryDelay}, mw(countingHandler(&runs)))
	task := e.enqueue(t, "pay", payload(t, map[string]string{"id": "t2"}), asynq.MaxRetry(1), asynq.Retention(time.Hour))

	waitFor(t, 20*time.Second, "a retry spent on the conflict", func() (bool, string) {
		info, desc := taskInfo(e.insp, "default", task.ID)
		return info != nil && info.Retried >= 1, desc
	})
	// Its retries used up, the task now waits for the key rather than be archived.
	if err := held.Unlock(context.Background()); err != nil {
		t.Fatalf("Unlock: %v", err)
	}
	info := waitState(t, e.insp, "default", task.ID, asynq.TaskStateCompleted, 20*time.Second)
	if info.Retried != 1 {
		t.Errorf("completed task: Retried = %d, want 1 (the conflict counted as a failure)", info.Retried)
	}
	if n := runs.Load(); n != 1 {
		t.Errorf("handler ran %d times, want 1", n)
	}
}

// TestNoRetryLeftWaits gives a MaxRetry(0) task a busy key: any error would archive
// it, so the middleware waits for the key instead, within the task's Timeout.
func TestNoRetryLeftWaits(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	key := lockKey(t, "pay", "t3")
	held := e.hold(t, key)

	var runs atomic.Int32
	var hook hookRecorder
	locks, _ := newLocks(t, e.opt)
	mw := asynqmutex.Middleware(locks, asynqmutex.On("id"), asynqmutex.AfterFailure(hook.hook)) // the default policy: a last try waits
	startServer(t, e.opt, asynqmutex.Configure(asynq.Config{Concurrency: 2}), mw(countingHandler(&runs)))
	task := e.enqueue(t, "pay", payload(t, map[string]string{"id": "t3"}),
		asynq.MaxRetry(0), asynq.Timeout(30*time.Second), asynq.Retention(time.Hour))

	waitState(t, e.insp, "default", task.ID, asynq.TaskStateActive, 10*time.Second)
	// For a second the task must stay active, waiting, and never reach retry or archive.
	for end := time.Now().Add(time.Second); time.Now().Before(end); time.Sleep(pollEvery) {
		info, desc := taskInfo(e.insp, "default", task.ID)
		if info == nil || info.State != asynq.TaskStateActive {
			t.Fatalf("while the key is held: %s; want the task active, waiting for the key", desc)
		}
	}
	if n := runs.Load(); n != 0 {
		t.Fatalf("handler ran %d times while the key was held", n)
	}
	if err := held.Unlock(context.Background()); err != nil {
		t.Fatalf("Unlock: %v", err)
	}
	info := waitState(t, e.insp, "default", task.ID, asynq.TaskStateCompleted, 10*time.Second)
	if info.Retried != 0 || info.LastErr != "" {
		t.Errorf("completed task: %s; want no retry and no error", describeTask(info))
	}
	if n := runs.Load(); n != 1 {
		t.Errorf("handler ran %d times, want 1", n)
	}
	if n := hook.count(); n != 0 {
		t.Errorf("AfterFailure called %d times, want 0: the task waited and got its lock", n)
	}
	archived, err := e.insp.ListArchivedTasks("default")
	if err != nil || len(archived) != 0 {
		t.Errorf("ListArchivedTasks = %d tasks, %v; want none", len(archived), err)
	}
}

// TestSkip completes a task whose key is busy without running it, and reports the
// conflict to AfterFailure once.
func TestSkip(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	key := lockKey(t, "cache:refresh", "c1")
	e.hold(t, key)

	var runs atomic.Int32
	var hook hookRecorder
	locks, _ := newLocks(t, e.opt)
	mw := asynqmutex.Middleware(locks, asynqmutex.On("id"), asynqmutex.OnConflict(asynqmutex.Skip), asynqmutex.AfterFailure(hook.hook))
	startServer(t, e.opt, asynqmutex.Configure(asynq.Config{Concurrency: 2}), mw(countingHandler(&runs)))
	task := e.enqueue(t, "cache:refresh", payload(t, map[string]string{"id": "c1"}), asynq.MaxRetry(3), asynq.Retention(time.Hour))

	info := waitState(t, e.insp, "default", task.ID, asynq.TaskStateCompleted, 10*time.Second)
	if info.Retried != 0 || info.LastErr != "" {
		t.Errorf("skipped task: %s; want completed with no retry and no error", describeTask(info))
	}
	if n := runs.Load(); n != 0 {
		t.Errorf("handler ran %d times, want 0 (skipped)", n)
	}
	calls := hook.calls()
	if len(calls) != 1 {
		t.Fatalf("AfterFailure called %d times, want 1: %v", len(calls), calls)
	}
	var le *asynqmutex.LockedError
	if !errors.As(calls[0], &le) {
		t.Fatalf("AfterFailure err = %T %v, want a *asynqmutex.LockedError", calls[0], calls[0])
	}
	if !errors.Is(calls[0], mutex.ErrNotObtained) {
		t.Errorf("errors.Is(%v, mutex.ErrNotObtained) = false, want true", calls[0])
	}
	if le.Key != key || le.RetryIn != 0 {
		t.Errorf("LockedError = {Key: %q, RetryIn: %v}, want {Key: %q, RetryIn: 0}", le.Key, le.RetryIn, key)
	}
}

// TestFail makes a conflict an ordinary error: it spends a retry, and once the
// retries are used up the task is archived, without the handler ever running.
func TestFail(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	key := lockKey(t, "pay", "t5")
	e.hold(t, key)

	var runs atomic.Int32
	locks, _ := newLocks(t, e.opt)
	mw := asynqmutex.Middleware(locks, asynqmutex.On("id"), asynqmutex.OnConflict(asynqmutex.Fail))
	fast := func(int, error, *asynq.Task) time.Duration { return time.Second }
	startServer(t, e.opt, asynqmutex.Configure(asynq.Config{Concurrency: 2, RetryDelayFunc: fast}), mw(countingHandler(&runs)))
	task := e.enqueue(t, "pay", payload(t, map[string]string{"id": "t5"}), asynq.MaxRetry(1), asynq.Retention(time.Hour))

	sawRetry := false
	waitFor(t, 20*time.Second, "the task archived after spending its retry", func() (bool, string) {
		info, desc := taskInfo(e.insp, "default", task.ID)
		if info == nil {
			return false, desc
		}
		if info.State == asynq.TaskStateRetry && info.Retried == 1 {
			sawRetry = true
		}
		return info.State == asynq.TaskStateArchived, desc
	})
	info, _ := taskInfo(e.insp, "default", task.ID)
	if !sawRetry {
		t.Errorf("never saw the task in retry with Retried 1 before it was archived")
	}
	if info.Retried != 1 || !strings.Contains(info.LastErr, heldMsg) || !strings.Contains(info.LastErr, "not obtained") {
		t.Errorf("archived task: %s; want Retried 1 and LastErr saying the lock is %s (mutex: not obtained)", describeTask(info), heldMsg)
	}
	if n := runs.Load(); n != 0 {
		t.Errorf("handler ran %d times, want 0", n)
	}
}

// TestShortTimeoutKeepsRetries gives a task a Timeout shorter than MaxWait on a key
// that stays busy: each wait ends before the task's deadline, so RetryLater's
// *LockedError, not "context deadline exceeded", reaches asynq, and with Configure
// the task keeps its retries and is never archived; once the key is free it runs.
func TestShortTimeoutKeepsRetries(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	key := lockKey(t, "pay", "t10")
	held := e.hold(t, key)

	var runs atomic.Int32
	var hook hookRecorder
	locks, _ := newLocks(t, e.opt)
	mw := asynqmutex.Middleware(locks, asynqmutex.On("id"), asynqmutex.MaxWait(3*time.Second),
		asynqmutex.OnConflict(asynqmutex.RetryLater(time.Second)), asynqmutex.AfterFailure(hook.hook))
	startServer(t, e.opt, asynqmutex.Configure(asynq.Config{Concurrency: 2}), mw(countingHandler(&runs)))
	task := e.enqueue(t, "pay", payload(t, map[string]string{"id": "t10"}),
		asynq.Timeout(time.Second), asynq.MaxRetry(2), asynq.Retention(time.Hour))

	waitFor(t, 30*time.Second, "three conflicts", func() (bool, string) {
		info, desc := taskInfo(e.insp, "default", task.ID)
		if info != nil && (info.State == asynq.TaskStateArchived || info.Retried != 0) {
			t.Fatalf("after %d conflicts: %s; want retry count 0 and never archived", hook.count(), desc)
		}
		return hook.count() >= 3, desc
	})
	for i, err := range hook.calls() {
		var le *asynqmutex.LockedError
		if !errors.As(err, &le) || le.RetryIn < time.Second {
			t.Errorf("AfterFailure call %d: err = %v, want a *LockedError with RetryIn >= 1s", i, err)
		}
	}
	if err := held.Unlock(context.Background()); err != nil {
		t.Fatalf("Unlock: %v", err)
	}
	info := waitState(t, e.insp, "default", task.ID, asynq.TaskStateCompleted, 30*time.Second)
	if info.Retried != 0 {
		t.Errorf("completed task: %s; want Retried 0", describeTask(info))
	}
	if n := runs.Load(); n != 1 {
		t.Errorf("handler ran %d times, want 1", n)
	}
}

// TestNoRetryLeftArchivedWhenBusy gives MaxRetry(0) tasks a key that stays busy:
// each waits for it as long as LastTryWait and its deadline allow, then is archived
// with an error saying the key was busy and it had no retry left, so it can be run
// again from the archive; it never holds its worker until its deadline.
func TestNoRetryLeftArchivedWhenBusy(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		opts []asynq.Option
		in   time.Duration // archived within
	}{
		{"Timeout 3s", []asynq.Option{asynq.Timeout(3 * time.Second)}, 15 * time.Second},
		// asynq's default Timeout is 30 minutes: LastTryWait bounds the wait.
		{"default Timeout", nil, asynqmutex.LastTryWait + 15*time.Second},
	}
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			id := fmt.Sprintf("t11-%d", i)
			e.hold(t, lockKey(t, "pay", id))

			var runs atomic.Int32
			var hook hookRecorder
			locks, _ := newLocks(t, e.opt)
			mw := asynqmutex.Middleware(locks, asynqmutex.On("id"), asynqmutex.AfterFailure(hook.hook)) // the default policy: a last try waits
			startServer(t, e.opt, asynqmutex.Configure(asynq.Config{Concurrency: 2}), mw(countingHandler(&runs)))
			opts := append([]asynq.Option{asynq.MaxRetry(0), asynq.Retention(time.Hour)}, tc.opts...)
			task := e.enqueue(t, "pay", payload(t, map[string]string{"id": id}), opts...)

			info := waitState(t, e.insp, "default", task.ID, asynq.TaskStateArchived, tc.in)
			for _, want := range []string{heldMsg, "no retry left", "archived"} {
				if !strings.Contains(info.LastErr, want) {
					t.Errorf("archived task: %s; want LastErr to contain %q", describeTask(info), want)
				}
			}
			if n := runs.Load(); n != 0 {
				t.Errorf("handler ran %d times while the key was held", n)
			}
			calls := hook.calls()
			if len(calls) != 1 {
				t.Fatalf("AfterFailure called %d times, want 1", len(calls))
			}
			var le *asynqmutex.LockedError
			if !errors.As(calls[0], &le) || le.RetryIn != 0 {
				t.Errorf("AfterFailure err = %v, want a *LockedError with RetryIn 0", calls[0])
			}
			t.Logf("LastErr: %s", info.LastErr)
		})
	}
}
