package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynqmutex/asynqmutex"
)

type txnPayload struct {
	Txn string `json:"txn"`
	Seq int    `json:"seq"`
}

// trackingHandler runs for work while tr counts how many handlers hold each key.
func trackingHandler(t testing.TB, tr *tracker, label string, work time.Duration) asynq.HandlerFunc {
	return func(ctx context.Context, task *asynq.Task) error {
		var p txnPayload
		if err := json.Unmarshal(task.Payload(), &p); err != nil {
			t.Errorf("handler: bad payload %q: %v", task.Payload(), err)
			return err
		}
		tr.enter(p.Txn, fmt.Sprint(p.Seq), label)
		defer tr.exit(p.Txn)
		time.Sleep(work)
		return nil
	}
}

// enqueueTxns enqueues n tasks over keys transaction IDs, kept as completed.
func enqueueTxns(t testing.TB, e *env, n, keys int) {
	t.Helper()
	for i := range n {
		e.enqueue(t, "txn:apply", payload(t, txnPayload{Txn: fmt.Sprintf("tx-%d", i%keys), Seq: i}),
			asynq.MaxRetry(3), asynq.Retention(time.Hour))
	}
}

// checkAllCompleted waits for n handler runs, then checks that every task completed
// exactly once without a retry.
func checkAllCompleted(t testing.TB, e *env, tr *tracker, n int) {
	t.Helper()
	waitFor(t, 40*time.Second, fmt.Sprintf("%d handler runs", n), func() (bool, string) {
		d := tr.finished()
		return d >= n, fmt.Sprintf("%d runs", d)
	})
	waitFor(t, 10*time.Second, "all tasks completed", func() (bool, string) {
		q, err := e.insp.GetQueueInfo("default")
		if err != nil {
			return false, err.Error()
		}
		return q.Completed == n && q.Retry == 0 && q.Archived == 0 && q.Pending == 0 && q.Active == 0,
			fmt.Sprintf("completed=%d retry=%d archived=%d pending=%d active=%d", q.Completed, q.Retry, q.Archived, q.Pending, q.Active)
	})
	tr.mu.Lock()
	defer tr.mu.Unlock()
	for seq := range n {
		if got := tr.runs[fmt.Sprint(seq)]; got != 1 {
			t.Errorf("task seq %d ran %d times, want 1", seq, got)
		}
	}
}

// TestSerializesPerKey runs 60 tasks over 4 transaction IDs on a server with
// concurrency 10: tasks with one ID never overlap, tasks with different IDs do.
func TestSerializesPerKey(t *testing.T) {
	t.Parallel()
	const tasks, keys = 60, 4

	t.Run("one server", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		tr := newTracker()
		var hook hookRecorder
		mw := asynqmutex.Middleware(e.locks, asynqmutex.On("txn"), asynqmutex.MaxWait(20*time.Second),
			asynqmutex.TTL(5*time.Second), asynqmutex.AfterFailure(hook.hook))
		startServer(t, e.opt, asynqmutex.Configure(asynq.Config{Concurrency: 10}),
			mw(trackingHandler(t, tr, "srv", 15*time.Millisecond)))
		enqueueTxns(t, e, tasks, keys)
		checkAllCompleted(t, e, tr, tasks)

		if n, key := tr.maxOverlap(); n != 1 {
			t.Errorf("max handlers at once on key %s = %d, want 1", key, n)
		}
		if tr.maxGlobal < 2 {
			t.Errorf("max handlers at once over all keys = %d, want > 1 (keys should run in parallel)", tr.maxGlobal)
		}
		if n := hook.count(); n != 0 {
			t.Errorf("AfterFailure called %d times, want 0 with MaxWait(20s): %v", n, hook.calls())
		}
		t.Logf("max in flight: %d over all keys", tr.maxGlobal)
	})

	t.Run("two servers", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		tr := newTracker()
		for _, name := range []string{"A", "B"} {
			locks, _ := newLocks(t, e.opt) // each server its own mutex.Client and connections
			mw := asynqmutex.Middleware(locks, asynqmutex.On("txn"), asynqmutex.MaxWait(20*time.Second), asynqmutex.TTL(5*time.Second))
			startServer(t, e.opt, asynqmutex.Configure(asynq.Config{Concurrency: 5}),
				mw(trackingHandler(t, tr, name, 15*time.Millisecond)))
		}
		enqueueTxns(t, e, tasks, keys)
		checkAllCompleted(t, e, tr, tasks)

		if n, key := tr.maxOverlap(); n != 1 {
			t.Errorf("max handlers at once on key %s = %d, want 1", key, n)
		}
		if tr.maxGlobal < 2 {
			t.Errorf("max handlers at once over all keys = %d, want > 1", tr.maxGlobal)
		}
		tr.mu.Lock()
		a, b := tr.by["A"], tr.by["B"]
		tr.mu.Unlock()
		if a == 0 || b == 0 {
			t.Errorf("server A ran %d tasks, B %d: want both > 0 for the test to show cross-server exclusion", a, b)
		}
		t.Logf("server A ran %d tasks, B %d; max in flight %d", a, b, tr.maxGlobal)
	})

	// Positive control: the same checker, without the middleware, sees overlap.
	t.Run("control without middleware", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		tr := newTracker()
		startServer(t, e.opt, asynq.Config{Concurrency: 4}, trackingHandler(t, tr, "srv", 200*time.Millisecond))
		enqueueTxns(t, e, 8, 1)
		checkAllCompleted(t, e, tr, 8)
		if n, _ := tr.maxOverlap(); n < 2 {
			t.Errorf("without the middleware max handlers at once on one key = %d, want > 1: the checker cannot see overlap", n)
		}
	})
}
