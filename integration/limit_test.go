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

type tenantPayload struct {
	Tenant string `json:"tenant_id"`
	Seq    int    `json:"seq"`
}

// runTenants runs 50 tasks over 3 tenants on two asynq servers (concurrency 8 each,
// each with its own mutex.Client) whose middleware keys on tenant_id with Limit(limit),
// waiting up to 20s for a slot, and returns the tracker once all completed.
func runTenants(t *testing.T, limit int) *tracker {
	const tasks, tenants = 50, 3
	e := newEnv(t)
	tr := newTracker()
	var hook hookRecorder
	for _, name := range []string{"A", "B"} {
		locks, _ := newLocks(t, e.opt)
		mw := asynqmutex.Middleware(locks, asynqmutex.On("tenant_id"), asynqmutex.Limit(limit),
			asynqmutex.MaxWait(20*time.Second), asynqmutex.TTL(5*time.Second), asynqmutex.AfterFailure(hook.hook))
		startServer(t, e.opt, asynqmutex.Configure(asynq.Config{Concurrency: 8}), mw(asynq.HandlerFunc(
			func(ctx context.Context, task *asynq.Task) error {
				var p tenantPayload
				if err := json.Unmarshal(task.Payload(), &p); err != nil {
					return err
				}
				tr.enter(p.Tenant, fmt.Sprint(p.Seq), name)
				defer tr.exit(p.Tenant)
				time.Sleep(30 * time.Millisecond)
				return nil
			})))
	}
	for i := range tasks {
		e.enqueue(t, "report:export", payload(t, tenantPayload{Tenant: fmt.Sprintf("tenant-%d", i%tenants), Seq: i}),
			asynq.MaxRetry(3), asynq.Retention(time.Hour))
	}
	checkAllCompleted(t, e, tr, tasks)
	if n := hook.count(); n != 0 {
		t.Errorf("AfterFailure called %d times, want 0 with MaxWait(20s): %v", n, hook.calls())
	}
	tr.mu.Lock()
	t.Logf("Limit(%d): most at once per tenant %v, over all tenants %d; server A ran %d, B %d",
		limit, tr.maxPerKey, tr.maxGlobal, tr.by["A"], tr.by["B"])
	tr.mu.Unlock()
	return tr
}

// TestTenantLimit: with On("tenant_id") and Limit(2), 50 tasks of 3 tenants on two
// servers: never more than 2 of one tenant at once (and 2 is reached), every task
// completes exactly once. The control runs Limit(3) under the same check, which must
// see 3.
func TestTenantLimit(t *testing.T) {
	t.Parallel()
	t.Run("limit 2", func(t *testing.T) {
		t.Parallel()
		tr := runTenants(t, 2)
		if n, key := tr.maxOverlap(); n != 2 {
			t.Errorf("most tasks of tenant %s at once = %d, want 2", key, n)
		}
		if tr.maxGlobal <= 2 {
			t.Errorf("most tasks at once over all tenants = %d, want > 2 (tenants run in parallel)", tr.maxGlobal)
		}
	})
	t.Run("control: limit 3 where 2 is checked", func(t *testing.T) {
		t.Parallel()
		tr := runTenants(t, 3)
		if n, _ := tr.maxOverlap(); n <= 2 {
			t.Errorf("with Limit(3) most tasks of one tenant at once = %d, want 3: the check cannot see a limit broken", n)
		}
	})
}
