package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynqmutex/asynqmutex"
)

type tenantPayload struct {
	Tenant string `json:"tenant_id"`
	Seq    int    `json:"seq"`
}

// tenantWait is how long a task may wait for its tenant's slot, and so how long a handler
// may wait for the tenant's other tasks to start: both wait for the same dispatch.
const tenantWait = 20 * time.Second

// fill holds each tenant's handlers until the tenant has limit of them running at once,
// or until every task of the tenant has started (its last ones may be fewer than limit).
// The servers take tasks as the test enqueues them, so how many of a tenant's tasks
// overlap otherwise depends on how fast Enqueue is against the handler's run time: on a
// busy machine a tenant may never reach its limit, and Limit(3) looks like Limit(2).
type fill struct {
	limit    int
	mu       sync.Mutex
	left     map[string]int           // tasks of the tenant not yet started
	running  map[string]int           // tasks of the tenant in their handler
	full     map[string]chan struct{} // closed when the tenant next reaches limit
	timedOut int                      // handlers that gave up waiting after tenantWait
}

// newFill expects perTenant tasks of each tenant in all, to be known before any starts.
func newFill(limit int, perTenant map[string]int) *fill {
	return &fill{limit: limit, left: perTenant, running: map[string]int{}, full: map[string]chan struct{}{}}
}

// wait counts the handler in and returns once its tenant has limit running (or had, since
// it entered), no task of it is left to start, ctx ends or tenantWait passes. The caller
// calls done when its handler ends.
func (f *fill) wait(ctx context.Context, tenant string) {
	f.mu.Lock()
	f.left[tenant]--
	f.running[tenant]++
	ch := f.full[tenant]
	if ch == nil {
		ch = make(chan struct{})
		f.full[tenant] = ch
	}
	if f.running[tenant] >= f.limit || f.left[tenant] <= 0 {
		close(ch)
		delete(f.full, tenant)
	}
	f.mu.Unlock()
	timer := time.NewTimer(tenantWait)
	defer timer.Stop()
	select {
	case <-ch:
	case <-ctx.Done():
	case <-timer.C:
		f.mu.Lock()
		f.timedOut++
		f.mu.Unlock()
	}
}

func (f *fill) done(tenant string) {
	f.mu.Lock()
	f.running[tenant]--
	f.mu.Unlock()
}

// runTenants runs 50 tasks over 3 tenants on two asynq servers (concurrency 8 each,
// each with its own mutex.Client) whose middleware keys on tenant_id with Limit(limit),
// waiting up to tenantWait for a slot, and returns the tracker once all completed. Each
// handler holds until its tenant has limit tasks running (see fill), so every tenant
// reaches its limit whatever the machine's speed, and then works 30ms more, so that a
// task let in past the limit would find the others still running.
func runTenants(t *testing.T, limit int) *tracker {
	const tasks, tenants = 50, 3
	tenantOf := func(i int) string { return fmt.Sprintf("tenant-%d", i%tenants) }
	perTenant := map[string]int{}
	for i := range tasks {
		perTenant[tenantOf(i)]++
	}
	f := newFill(limit, perTenant)
	e := newEnv(t)
	tr := newTracker()
	var hook hookRecorder
	for _, name := range []string{"A", "B"} {
		locks, _ := newLocks(t, e.opt)
		mw := asynqmutex.Middleware(locks, asynqmutex.On("tenant_id"), asynqmutex.Limit(limit),
			asynqmutex.MaxWait(tenantWait), asynqmutex.TTL(5*time.Second), asynqmutex.AfterFailure(hook.hook))
		startServer(t, e.opt, asynqmutex.Configure(asynq.Config{Concurrency: 8}), mw(asynq.HandlerFunc(
			func(ctx context.Context, task *asynq.Task) error {
				var p tenantPayload
				if err := json.Unmarshal(task.Payload(), &p); err != nil {
					return err
				}
				tr.enter(p.Tenant, fmt.Sprint(p.Seq), name)
				defer tr.exit(p.Tenant)
				f.wait(ctx, p.Tenant)
				defer f.done(p.Tenant)
				time.Sleep(30 * time.Millisecond)
				return nil
			})))
	}
	for i := range tasks {
		e.enqueue(t, "report:export", payload(t, tenantPayload{Tenant: tenantOf(i), Seq: i}),
			asynq.MaxRetry(3), asynq.Retention(time.Hour))
	}
	checkAllCompleted(t, e, tr, tasks)
	if n := hook.count(); n != 0 {
		t.Errorf("AfterFailure called %d times, want 0 with MaxWait(%v): %v", n, tenantWait, hook.calls())
	}
	f.mu.Lock()
	if f.timedOut != 0 {
		t.Errorf("%d handlers waited %v for their tenant to have %d running, want none: its next task did not start", f.timedOut, tenantWait, f.limit)
	}
	f.mu.Unlock()
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
