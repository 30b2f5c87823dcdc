package integration

// Regression tests for the defects of issue 15 that show through the middleware. Each
// fails on the code it was written against, for the defect it names.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex"
	"github.com/asynqmutex/asynqmutex/internal/redistest"
	"github.com/asynqmutex/asynqmutex/mutex"
)

// TestRegressSetTaskMeetingLimitKeyGetsLimitError: a transfer under
// Scope("account") and OnEach("from", "to") meets an account key held with Limit(2)
// (by tasks of another type that share the scope under Limit). As for a task of one
// key (the control), the middleware must fail it with an error wrapping
// *mutex.LimitError, which names both limits, without running the handler, and tell
// AfterFailure. Today the set of keys gets Redis's WRONGTYPE script error in a string.
func TestRegressSetTaskMeetingLimitKeyGetsLimitError(t *testing.T) {
	t.Parallel()
	s := redistest.Start(t)
	rdb := s.Client(t)
	ctx := context.Background()
	held, err := asynqmutex.Key("account", `"A"`)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := quietLocks(rdb).TryLock(ctx, held, time.Minute, mutex.Limit(2)); err != nil {
		t.Fatalf("TryLock(%s, Limit(2)) = %v", held, err)
	}
	for _, tc := range []struct {
		name string
		key  asynqmutex.Option
	}{
		{"control: On", asynqmutex.On("from")},
		{"OnEach", asynqmutex.OnEach("from", "to")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var (
				runs atomic.Int32
				hook hookRecorder
			)
			mw := asynqmutex.Middleware(quietLocks(rdb), asynqmutex.Scope("account"), tc.key, asynqmutex.AfterFailure(hook.hook))
			task := asynq.NewTask("transfer", payload(t, transferPayload{From: "A", To: "B"}))
			err := mw(countingHandler(&runs)).ProcessTask(ctx, task)
			var le *mutex.LimitError
			if !errors.As(err, &le) {
				t.Fatalf("ProcessTask = %v; want an error wrapping *mutex.LimitError", err)
			}
			if le.Key != held || le.Held != 2 || le.Asked != 1 {
				t.Errorf("LimitError = %+v; want key %s, held with 2, asked with 1", *le, held)
			}
			if strings.Contains(err.Error(), "WRONGTYPE") {
				t.Errorf("ProcessTask = %v; want no Redis error text", err)
			}
			if n := runs.Load(); n != 0 {
				t.Errorf("handler ran %d times, want 0", n)
			}
			if calls := hook.calls(); len(calls) != 1 || !errors.As(calls[0], &le) {
				t.Errorf("AfterFailure calls %v; want one with a *mutex.LimitError", calls)
			}
		})
	}
}

// TestRegressWaitingTaskRidesOutLockRedisRestart: a task waits (MaxWait 20s) for a
// key another worker holds when the locks' Redis stops and is back 0.3s later,
// without persistence, so the key is free. The wait must ride out the outage and
// run the task, which completes without spending a retry. Today the wait ends at
// once with "connection refused": the task fails and spends a retry. asynq has a
// Redis of its own here, so that only the locks' Redis goes away.
func TestRegressWaitingTaskRidesOutLockRedisRestart(t *testing.T) {
	t.Parallel()
	const (
		maxWait = 20 * time.Second
		outage  = 300 * time.Millisecond
	)
	e := newEnv(t)
	s := redistest.Start(t)
	lockRdb := s.Client(t)
	holder := quietLocks(s.Client(t))
	key := lockKey(t, "pay", "t1")
	if _, err := holder.TryLock(context.Background(), key, time.Hour); err != nil {
		t.Fatalf("TryLock(%s) = %v", key, err)
	}

	var (
		runs atomic.Int32
		hook hookRecorder
	)
	mw := asynqmutex.Middleware(quietLocks(lockRdb), asynqmutex.On("id"), asynqmutex.MaxWait(maxWait), asynqmutex.AfterFailure(hook.hook))
	slow := func(int, error, *asynq.Task) time.Duration { return time.Hour } // stay in retry to be inspected
	startServer(t, e.opt, asynqmutex.Configure(asynq.Config{Concurrency: 2, RetryDelayFunc: slow}), mw(countingHandler(&runs)))
	task := e.enqueue(t, "pay", payload(t, map[string]string{"id": "t1"}), asynq.MaxRetry(3), asynq.Retention(time.Hour))

	waitFor(t, 10*time.Second, "the task to wait for its key", func() (bool, string) {
		info, err := holder.Inspect(context.Background(), key)
		if err != nil {
			return false, err.Error()
		}
		return info.Waiting == 1, fmt.Sprintf("%d waiting", info.Waiting)
	})
	s.Stop(t)
	time.Sleep(outage)
	s.Restart(t)

	var info *asynq.TaskInfo
	waitFor(t, maxWait+5*time.Second, "the task to complete or spend a retry", func() (bool, string) {
		i, desc := taskInfo(e.insp, "default", task.ID)
		info = i
		return i != nil && (i.State == asynq.TaskStateCompleted || i.Retried > 0), desc
	})
	if info.State != asynq.TaskStateCompleted || info.Retried != 0 {
		t.Errorf("task: %s; want completed with no retry spent: the outage was shorter than MaxWait", describeTask(info))
	}
	if n := runs.Load(); n != 1 {
		t.Errorf("handler ran %d times, want 1", n)
	}
	if calls := hook.calls(); len(calls) != 0 {
		t.Errorf("AfterFailure called with %v; want no call", calls)
	}
}

// TestRegressHandlerNearDeadlineFreesItsKey: the handler returns nil before the
// task's deadline, and the deadline passes while the release is on its way to Redis
// (a go-redis hook on the locks' client holds the release back until it has). The
// release must not depend on the task's context: the key is free when the
// middleware returns. Today the release is sent with the task's context, dies in
// go-redis, and the key stays held for the rest of its TTL, so the next task of the
// key meets a busy key for up to 30s.
func TestRegressHandlerNearDeadlineFreesItsKey(t *testing.T) {
	t.Parallel()
	const window = 200 * time.Millisecond // from the task's start to its deadline
	s := redistest.Start(t)
	var (
		armed atomic.Bool
		task  atomic.Pointer[context.Context]
		held  atomic.Int32
	)
	rdb := redis.NewClient(&redis.Options{Addr: s.Addr()})
	rdb.AddHook(releaseHolder{hold: func(cmd redis.Cmder) {
		if scriptCall(cmd) && armed.CompareAndSwap(true, false) {
			<-(*task.Load()).Done()
			held.Add(1)
		}
	}})
	t.Cleanup(func() { _ = rdb.Close() })
	look := quietLocks(s.Client(t))

	locks := quietLocks(rdb)
	// The client's first call dials and loads its scripts, which on a busy machine can
	// take longer than the window: made here, it is no part of a round.
	if l, err := locks.Lock(context.Background(), "warm-up", time.Second); err != nil {
		t.Fatal(err)
	} else if err := l.Unlock(context.Background()); err != nil {
		t.Fatal(err)
	}
	mw := asynqmutex.Middleware(locks, asynqmutex.On("id"))
	h := mw(asynq.HandlerFunc(func(context.Context, *asynq.Task) error {
		armed.Store(true) // the next script call is the release
		return nil
	}))
	const rounds = 5
	leaked := 0
	for round := range rounds {
		id := fmt.Sprintf("t%d", round)
		ctx, cancel := context.WithTimeout(context.Background(), window)
		task.Store(&ctx)
		err := h.ProcessTask(ctx, asynq.NewTask("pay", payload(t, map[string]string{"id": id})))
		cancel()
		if err != nil {
			t.Errorf("round %d: ProcessTask = %v, want nil: the handler returned nil", round, err)
		}
		if held.Load() != int32(round+1) {
			t.Fatalf("control: round %d's release was not held back", round)
		}
		locked, err := look.Locked(context.Background(), lockKey(t, "pay", id))
		if err != nil {
			t.Fatal(err)
		}
		if locked {
			leaked++
		}
	}
	if leaked != 0 {
		t.Errorf("%d of %d keys still held after the middleware returned, want 0", leaked, rounds)
	}
}

// quietLocks is a mutex.Client on rdb that logs nothing: these tests check what it
// would log through results and task states.
func quietLocks(rdb redis.UniversalClient) *mutex.Client {
	return mutex.New(rdb, mutex.Logger(slog.New(slog.NewTextHandler(io.Discard, nil))))
}

// releaseHolder is a go-redis hook that calls hold before every command is sent.
type releaseHolder struct{ hold func(redis.Cmder) }

func (h releaseHolder) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h releaseHolder) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h releaseHolder) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.hold(cmd)
		return next(ctx, cmd)
	}
}

// scriptCall reports whether cmd runs server-side code, as every step of a lock does.
func scriptCall(cmd redis.Cmder) bool {
	switch cmd.Name() {
	case "eval", "evalsha", "eval_ro", "evalsha_ro", "fcall", "fcall_ro":
		return true
	}
	return false
}
