package integration

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynqmutex/asynqmutex"
	"github.com/asynqmutex/asynqmutex/mutex"
)

// quickRetry is the delay asynq gives ordinary failures in these tests: a conflict
// past the reschedule cap is one, and the tests need not wait asynq's default
// backoff for it.
func quickRetry(int, error, *asynq.Task) time.Duration { return 100 * time.Millisecond }

// recordKey is the Redis key of a task's reschedule count, as RetryLater documents it.
func recordKey(queue, id string) string {
	return mutex.DefaultPrefix + "reschedule:" + queue + ":" + id
}

// lockedErrs splits errs, in order, into the conflicts that were sent back (a
// *LockedError with RetryIn > 0) and the rest, and reports whether every one of
// the first kind came before every one of the second.
func lockedErrs(errs []error) (rescheduled []*asynqmutex.LockedError, failed []error, ordered bool) {
	ordered = true
	for _, err := range errs {
		var le *asynqmutex.LockedError
		if errors.As(err, &le) && le.RetryIn > 0 {
			if len(failed) > 0 {
				ordered = false
			}
			rescheduled = append(rescheduled, le)
			continue
		}
		failed = append(failed, err)
	}
	return rescheduled, failed, ordered
}

// TestMaxReschedules holds a task's key the whole time: under RetryLater(1s) and
// MaxReschedules(2) the task is sent back twice without spending a retry, then each
// conflict is an ordinary failure that spends one of its MaxRetry(2), and the task
// is archived with a LastErr that names the key and the cap. The Inspector is read
// throughout: the retry count may grow only after the cap's conflicts.
func TestMaxReschedules(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	key := lockKey(t, "pay", "r1")
	e.hold(t, key)

	var runs atomic.Int32
	var hook hookRecorder
	var errs errRecorder
	locks, _ := newLocks(t, e.opt)
	mw := asynqmutex.Middleware(locks, asynqmutex.On("id"), asynqmutex.OnConflict(asynqmutex.RetryLater(time.Second)),
		asynqmutex.MaxReschedules(2), asynqmutex.AfterFailure(hook.hook))
	startServer(t, e.opt, asynqmutex.Configure(asynq.Config{Concurrency: 2, RetryDelayFunc: quickRetry, ErrorHandler: &errs}), mw(countingHandler(&runs)))
	task := e.enqueue(t, "pay", payload(t, map[string]string{"id": "r1"}), asynq.MaxRetry(2), asynq.Retention(time.Hour))

	sawRescheduled := false // in retry after both reschedules, no retry spent
	waitFor(t, 60*time.Second, "the task archived", func() (bool, string) {
		// The hook runs before asynq records a result: every retry the Inspector shows
		// was spent by a conflict counted by then, so the bound takes the count read
		// after it; a conflict between two reads would otherwise look like a retry
		// spent too early.
		before := hook.count()
		info, desc := taskInfo(e.insp, "default", task.ID)
		if info == nil {
			return false, desc
		}
		n := hook.count()
		// The first two conflicts spend nothing; each one after spends a retry.
		if spendable := max(n-2, 0); info.Retried > spendable {
			t.Fatalf("after %d conflicts: %s; want at most %d retries spent", n, desc, spendable)
		}
		if before == 2 && n == 2 && info.State == asynq.TaskStateRetry && info.Retried == 0 {
			sawRescheduled = true
		}
		return info.State == asynq.TaskStateArchived, desc
	})
	if !sawRescheduled {
		t.Errorf("never saw the task in retry with Retried 0 after its second conflict")
	}
	info, _ := taskInfo(e.insp, "default", task.ID)
	if info.Retried != 2 {
		t.Errorf("archived task: %s; want Retried 2", describeTask(info))
	}
	for _, want := range []string{key, "reschedule cap MaxReschedules(2) reached", "5 conflicts", "archived", "not obtained"} {
		if !strings.Contains(info.LastErr, want) {
			t.Errorf("archived task: LastErr = %q; want it to contain %q", info.LastErr, want)
		}
	}
	if n := runs.Load(); n != 0 {
		t.Errorf("handler ran %d times while the key was held", n)
	}

	rescheduled, failed, ordered := lockedErrs(errs.all())
	if len(rescheduled) != 2 || len(failed) != 3 || !ordered {
		t.Fatalf("ErrorHandler saw %d reschedules and %d failures (in order: %v), want 2 then 3: %v", len(rescheduled), len(failed), ordered, errs.all())
	}
	if rescheduled[0].RetryIn != time.Second || rescheduled[1].RetryIn != 2*time.Second {
		t.Errorf("RetryIn = %v, %v; want 1s, 2s", rescheduled[0].RetryIn, rescheduled[1].RetryIn)
	}
	for i, err := range failed {
		var le *asynqmutex.LockedError
		if errors.As(err, &le) || !isNotObtained(err) || !asynqmutex.IsFailure(err) {
			t.Errorf("failure %d: %v; want an ordinary error wrapping mutex.ErrNotObtained", i, err)
		}
	}
	if n := hook.count(); n != 5 {
		t.Errorf("AfterFailure called %d times, want 5", n)
	}
	if n, err := e.rdb.Exists(context.Background(), recordKey("default", task.ID)).Result(); err != nil || n != 0 {
		t.Errorf("EXISTS %s = %d, %v; want the count gone with the task's archiving", recordKey("default", task.ID), n, err)
	}
}

// TestMaxReschedulesAcrossServers hands one task from server to server, each with
// the middleware of its own worker (own mutex.Client): worker A meets the key first,
// worker B second, A again third, B fourth. The count is shared, so B's conflict
// doubles RetryIn and A's second conflict, the third in all, is past
// MaxReschedules(2): a count kept per worker would have sent it back again. Each
// server stops taking tasks after one, so the turns do not depend on timing.
func TestMaxReschedulesAcrossServers(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	key := lockKey(t, "pay", "r2")
	e.hold(t, key)

	type worker struct {
		mw   asynq.MiddlewareFunc
		hook *hookRecorder
	}
	newWorker := func() worker {
		var hook hookRecorder
		locks, _ := newLocks(t, e.opt)
		return worker{
			mw: asynqmutex.Middleware(locks, asynqmutex.On("id"), asynqmutex.OnConflict(asynqmutex.RetryLater(time.Second)),
				asynqmutex.MaxReschedules(2), asynqmutex.AfterFailure(hook.hook)),
			hook: &hook,
		}
	}
	a, b := newWorker(), newWorker()
	var runs atomic.Int32
	task := e.enqueue(t, "pay", payload(t, map[string]string{"id": "r2"}), asynq.MaxRetry(1), asynq.Retention(time.Hour))

	// turn runs a server with w's middleware for one task: the server stops taking
	// tasks once it has handled one. It waits until asynq recorded the result (the
	// task in state), then shuts the server down. A task sent to retry after 100ms
	// (quickRetry) may be pending again before a poll sees it in retry: with its
	// LastErr new, that is the result recorded too.
	turn := func(w worker, state asynq.TaskState) *asynq.TaskInfo {
		t.Helper()
		before, _ := taskInfo(e.insp, "default", task.ID)
		var (
			srv     atomic.Pointer[asynq.Server]
			handled atomic.Int32
		)
		inner := w.mw(countingHandler(&runs))
		h := asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
			err := inner.ProcessTask(ctx, task)
			handled.Add(1)
			srv.Load().Stop() // no second task on this server
			return err
		})
		srv.Store(startServer(t, e.opt, asynqmutex.Configure(asynq.Config{Concurrency: 1, RetryDelayFunc: quickRetry}), h))
		var info *asynq.TaskInfo
		waitFor(t, 30*time.Second, "the task handled and its result recorded", func() (bool, string) {
			if handled.Load() == 0 {
				return false, "not handled yet"
			}
			var desc string
			info, desc = taskInfo(e.insp, "default", task.ID)
			back := state == asynq.TaskStateRetry && info != nil && info.State == asynq.TaskStatePending &&
				before != nil && info.LastErr != before.LastErr
			return info != nil && (info.State == state || back), desc
		})
		srv.Load().Shutdown()
		if n := handled.Load(); n != 1 {
			t.Fatalf("the server handled %d tasks, want 1", n)
		}
		return info
	}
	if info := turn(a, asynq.TaskStateRetry); info.Retried != 0 {
		t.Fatalf("after A's conflict: %s; want Retried 0", describeTask(info))
	}
	if info := turn(b, asynq.TaskStateRetry); info.Retried != 0 {
		t.Fatalf("after B's conflict: %s; want Retried 0", describeTask(info))
	}
	if info := turn(a, asynq.TaskStateRetry); info.Retried != 1 || !strings.Contains(info.LastErr, "MaxReschedules(2)") {
		t.Fatalf("after A's second conflict, the third in all: %s; want Retried 1 and the cap in LastErr", describeTask(info))
	}
	info := turn(b, asynq.TaskStateArchived)
	for _, want := range []string{key, "reschedule cap MaxReschedules(2) reached", "4 conflicts", "archived"} {
		if !strings.Contains(info.LastErr, want) {
			t.Errorf("archived task: LastErr = %q; want it to contain %q", info.LastErr, want)
		}
	}

	retryIn := func(w worker, i int) time.Duration {
		var le *asynqmutex.LockedError
		if calls := w.hook.calls(); i < len(calls) && errors.As(calls[i], &le) {
			return le.RetryIn
		}
		return -1
	}
	if got := []time.Duration{retryIn(a, 0), retryIn(b, 0), retryIn(a, 1), retryIn(b, 1)}; got[0] != time.Second || got[1] != 2*time.Second || got[2] != 0 || got[3] != 0 {
		t.Errorf("RetryIn of the conflicts A, B, A, B = %v; want [1s 2s 0s 0s]: doubled across workers, then past the cap", got)
	}
	if n := runs.Load(); n != 0 {
		t.Errorf("handler ran %d times while the key was held", n)
	}
}

// TestMaxRescheduleTime caps the time instead: under RetryLater(1s) and
// MaxRescheduleTime(2s) the first conflicts are sent back, and the first one 2s or
// more after the first conflict (by the Redis server's clock) and every one after it
// fail; the task, MaxRetry(1), is then archived with the cap in LastErr. How many
// conflicts fit in the 2s depends on asynq's timing, so the test checks the order,
// not the count.
func TestMaxRescheduleTime(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	key := lockKey(t, "pay", "r3")
	e.hold(t, key)

	var runs atomic.Int32
	var errs errRecorder
	locks, _ := newLocks(t, e.opt)
	mw := asynqmutex.Middleware(locks, asynqmutex.On("id"), asynqmutex.OnConflict(asynqmutex.RetryLater(time.Second)),
		asynqmutex.MaxRescheduleTime(2*time.Second))
	startServer(t, e.opt, asynqmutex.Configure(asynq.Config{Concurrency: 2, RetryDelayFunc: quickRetry, ErrorHandler: &errs}), mw(countingHandler(&runs)))
	task := e.enqueue(t, "pay", payload(t, map[string]string{"id": "r3"}), asynq.MaxRetry(1), asynq.Retention(time.Hour))

	info := waitState(t, e.insp, "default", task.ID, asynq.TaskStateArchived, 60*time.Second)
	if info.Retried != 1 {
		t.Errorf("archived task: %s; want Retried 1", describeTask(info))
	}
	for _, want := range []string{key, "reschedule cap MaxRescheduleTime(2s) reached", "archived"} {
		if !strings.Contains(info.LastErr, want) {
			t.Errorf("archived task: LastErr = %q; want it to contain %q", info.LastErr, want)
		}
	}
	rescheduled, failed, ordered := lockedErrs(errs.all())
	if len(rescheduled) < 1 || len(failed) != 2 || !ordered {
		t.Fatalf("ErrorHandler saw %d reschedules and %d failures (in order: %v), want at least 1 then 2: %v", len(rescheduled), len(failed), ordered, errs.all())
	}
	for i, err := range failed {
		since, ok := capElapsed(err.Error())
		if !ok || since < 2*time.Second {
			t.Errorf("failure %d: %q; want it to say the conflicts span at least 2s", i, err)
		}
	}
	if n := runs.Load(); n != 0 {
		t.Errorf("handler ran %d times while the key was held", n)
	}
}

// capElapsed reads the time since the first conflict from a cap's error text:
// "... N conflicts in D, ...".
func capElapsed(msg string) (time.Duration, bool) {
	_, rest, ok := strings.Cut(msg, " conflicts in ")
	if !ok {
		return 0, false
	}
	text, _, _ := strings.Cut(rest, ",")
	d, err := time.ParseDuration(text)
	return d, err == nil
}
