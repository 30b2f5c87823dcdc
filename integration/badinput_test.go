package integration

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex"
	"github.com/asynqmutex/asynqmutex/mutex"
)

// TestBadPayloadArchived sends payloads no key can be derived from: each task is
// archived at once, with retries left unused, and an error naming the task type and
// the field; the handler never runs.
func TestBadPayloadArchived(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int32
	var hook hookRecorder
	locks, _ := newLocks(t, e.opt)
	mux := asynq.NewServeMux()
	mux.Handle("bad:flat", asynqmutex.Middleware(locks, asynqmutex.On("id"), asynqmutex.AfterFailure(hook.hook))(countingHandler(&runs)))
	mux.Handle("bad:nested", asynqmutex.Middleware(locks, asynqmutex.On("customer.id"), asynqmutex.AfterFailure(hook.hook))(countingHandler(&runs)))
	emptyKey := func(context.Context, *asynq.Task) (string, error) { return "", nil }
	mux.Handle("bad:keyby", asynqmutex.Middleware(locks, asynqmutex.KeyBy(emptyKey), asynqmutex.AfterFailure(hook.hook))(countingHandler(&runs)))
	startServer(t, e.opt, asynqmutex.Configure(asynq.Config{Concurrency: 4}), mux)

	tests := []struct {
		name, typ, payload string
		want               []string // LastErr must contain each
	}{
		// On's doc: "A task whose payload is not a JSON object or lacks a field is
		// archived at once with an error naming the field".
		{"not JSON", "bad:flat", `not json`, []string{`"bad:flat"`, "not a JSON object", `"id"`}},
		{"missing field", "bad:flat", `{"other":1}`, []string{`"bad:flat"`, `field "id"`, "missing"}},
		{"nested through a string", "bad:nested", `{"customer":"c-42"}`, []string{`"bad:nested"`, `field "customer.id"`, "is a string, not an object"}},
		// On's doc: only scalar values make keys; KeyBy is for the rest.
		{"object value", "bad:flat", `{"id":{"n":1}}`, []string{`"bad:flat"`, `field "id" is an object`, "KeyBy"}},
		{"not UTF-8", "bad:flat", "{\"id\":\"\xff\"}", []string{`"bad:flat"`, `field "id"`, "not valid UTF-8"}},
		// KeyFunc's doc: an empty key is bad input, not a Redis error to retry.
		{"KeyBy empty key", "bad:keyby", `{}`, []string{`"bad:keyby"`, "KeyBy returned an empty key"}},
	}
	ids := make([]string, len(tests))
	for i, tc := range tests {
		ids[i] = e.enqueue(t, tc.typ, []byte(tc.payload), asynq.MaxRetry(5), asynq.Retention(time.Hour)).ID
	}
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			info := waitState(t, e.insp, "default", ids[i], asynq.TaskStateArchived, 10*time.Second)
			if info.Retried != 0 {
				t.Errorf("%s; want archived at once, Retried 0", describeTask(info))
			}
			for _, w := range tc.want {
				if !strings.Contains(info.LastErr, w) {
					t.Errorf("LastErr = %q, want it to contain %s", info.LastErr, w)
				}
			}
		})
	}
	archived, err := e.insp.ListArchivedTasks("default")
	if err != nil || len(archived) != len(tests) {
		t.Errorf("ListArchivedTasks = %d tasks, %v; want %d", len(archived), err, len(tests))
	}
	if n := runs.Load(); n != 0 {
		t.Errorf("handler ran %d times, want 0", n)
	}
	if n := hook.count(); n != len(tests) {
		t.Errorf("AfterFailure called %d times, want %d (once per bad task)", n, len(tests))
	}
}

// TestLockRedisDown points the lock client at a dead port while asynq's Redis is up:
// the handler does not run, and the task is retried as after an ordinary failure,
// not archived (the payload is fine; Redis may come back).
func TestLockRedisDown(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	dead := redis.NewClient(&redis.Options{Addr: deadAddr(t), MaxRetries: 1, DialTimeout: time.Second})
	t.Cleanup(func() { _ = dead.Close() })

	var runs atomic.Int32
	var hook hookRecorder
	mw := asynqmutex.Middleware(mutex.New(dead), asynqmutex.On("id"), asynqmutex.AfterFailure(hook.hook))
	slow := func(int, error, *asynq.Task) time.Duration { return time.Hour } // stay in retry to be inspected
	startServer(t, e.opt, asynqmutex.Configure(asynq.Config{Concurrency: 2, RetryDelayFunc: slow}), mw(countingHandler(&runs)))
	task := e.enqueue(t, "pay", payload(t, map[string]string{"id": "t8"}), asynq.MaxRetry(3), asynq.Retention(time.Hour))

	info := waitState(t, e.insp, "default", task.ID, asynq.TaskStateRetry, 15*time.Second)
	if info.Retried != 1 || !strings.Contains(info.LastErr, "taking lock") {
		t.Errorf("task: %s; want Retried 1 and LastErr about taking the lock", describeTask(info))
	}
	if n := runs.Load(); n != 0 {
		t.Errorf("handler ran %d times without its lock, want 0", n)
	}
	calls := hook.calls()
	if len(calls) != 1 {
		t.Fatalf("AfterFailure called %d times, want 1", len(calls))
	}
	var le *asynqmutex.LockedError
	if errors.As(calls[0], &le) || errors.Is(calls[0], asynq.SkipRetry) {
		t.Errorf("AfterFailure err = %v; want a Redis error, neither a LockedError nor SkipRetry", calls[0])
	}
}

// TestLongKeyErrorBounded makes a task meet a busy key whose payload field is a
// megabyte: the LastErr asynq stores with the task, and what the hook and the
// ErrorHandler see, stay a few hundred bytes, with the key shortened.
func TestLongKeyErrorBounded(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	big := strings.Repeat("x", 1<<20)
	e.hold(t, lockKey(t, "pay", big))

	var runs atomic.Int32
	var hook hookRecorder
	var errs errRecorder
	locks, _ := newLocks(t, e.opt)
	mw := asynqmutex.Middleware(locks, asynqmutex.On("id"), asynqmutex.OnConflict(asynqmutex.RetryLater(time.Hour)), asynqmutex.AfterFailure(hook.hook))
	startServer(t, e.opt, asynqmutex.Configure(asynq.Config{Concurrency: 2, ErrorHandler: &errs}), mw(countingHandler(&runs)))
	task := e.enqueue(t, "pay", payload(t, map[string]string{"id": big}), asynq.MaxRetry(3), asynq.Retention(time.Hour))

	info := waitState(t, e.insp, "default", task.ID, asynq.TaskStateRetry, 15*time.Second)
	const bound = 400
	if len(info.LastErr) > bound || !strings.Contains(info.LastErr, heldMsg) || !strings.Contains(info.LastErr, "…sha256:") {
		t.Errorf("LastErr is %d bytes: %.500q; want at most %d, saying the key is %s, shortened with a digest", len(info.LastErr), info.LastErr, bound, heldMsg)
	}
	seen := append(hook.calls(), errs.all()...)
	if len(seen) != 2 {
		t.Fatalf("hook and ErrorHandler saw %d errors, want 1 each", len(seen))
	}
	for _, err := range seen {
		if len(err.Error()) > bound {
			t.Errorf("error seen by a hook is %d bytes: %.500q; want at most %d", len(err.Error()), err.Error(), bound)
		}
	}
	if n := runs.Load(); n != 0 {
		t.Errorf("handler ran %d times while the key was held", n)
	}
	t.Logf("LastErr (%d bytes): %s", len(info.LastErr), info.LastErr)
}
