package integration

import (
	"context"
	"encoding/json"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynqmutex/asynqmutex"
)

// TestOneMuxTwoTaskTypes serves two task types from one mux, the middleware added
// with mux.Use as the README's first lines show: payment:capture locked per
// transaction_id, and customer:sync, whose payload has no transaction_id. With For
// naming payment:capture, both types complete and neither is harmed; the control,
// the same mux without For, archives every customer:sync, which shows the test can
// tell the two apart.
func TestOneMuxTwoTaskTypes(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name       string
		opts       []asynqmutex.Option
		syncIsSafe bool // customer:sync tasks run and complete
	}{
		{"For", []asynqmutex.Option{asynqmutex.For("payment:capture"), asynqmutex.On("transaction_id")}, true},
		{"control without For", []asynqmutex.Option{asynqmutex.On("transaction_id")}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			locks, _ := newLocks(t, e.opt)
			tr := newTracker()
			var syncs atomic.Int32

			mux := asynq.NewServeMux()
			mux.Use(asynqmutex.Middleware(locks, append(tc.opts, asynqmutex.MaxWait(10*time.Second))...))
			mux.HandleFunc("payment:capture", func(ctx context.Context, task *asynq.Task) error {
				var p struct {
					TransactionID string `json:"transaction_id"`
				}
				if err := json.Unmarshal(task.Payload(), &p); err != nil {
					return err
				}
				id, _ := asynq.GetTaskID(ctx)
				tr.enter(p.TransactionID, id, "")
				defer tr.exit(p.TransactionID)
				time.Sleep(20 * time.Millisecond) // long enough for tasks of one transaction to meet
				return nil
			})
			mux.HandleFunc("customer:sync", func(ctx context.Context, task *asynq.Task) error {
				syncs.Add(1)
				return nil
			})
			startServer(t, e.opt, asynqmutex.Configure(asynq.Config{Concurrency: 6}), mux)

			var payments, customerSyncs []string
			for n := range 8 {
				tx := []string{"tx-A", "tx-B"}[n%2]
				payments = append(payments, e.enqueue(t, "payment:capture", payload(t, map[string]any{"transaction_id": tx, "n": n}),
					asynq.MaxRetry(3), asynq.Retention(time.Hour)).ID)
			}
			for n := range 4 {
				customerSyncs = append(customerSyncs, e.enqueue(t, "customer:sync", payload(t, map[string]any{"customer_id": n}),
					asynq.MaxRetry(3), asynq.Retention(time.Hour)).ID)
			}

			for _, id := range payments {
				if info := waitState(t, e.insp, "default", id, asynq.TaskStateCompleted, 20*time.Second); info.Retried != 0 {
					t.Errorf("payment:capture %s; want completed without a retry spent", describeTask(info))
				}
			}
			if n, key := tr.maxOverlap(); n != 1 {
				t.Errorf("%d payment:capture tasks of %s ran at once, want 1", n, key)
			}
			for _, id := range customerSyncs {
				if tc.syncIsSafe {
					if info := waitState(t, e.insp, "default", id, asynq.TaskStateCompleted, 20*time.Second); info.Retried != 0 || info.LastErr != "" {
						t.Errorf("customer:sync %s; want completed untouched", describeTask(info))
					}
					continue
				}
				info := waitState(t, e.insp, "default", id, asynq.TaskStateArchived, 20*time.Second)
				if !strings.Contains(info.LastErr, `field "transaction_id" missing`) {
					t.Errorf("control: customer:sync %s; want archived for the missing field", describeTask(info))
				}
			}
			want := int32(0)
			if tc.syncIsSafe {
				want = int32(len(customerSyncs))
			}
			if n := syncs.Load(); n != want {
				t.Errorf("customer:sync handler ran %d times, want %d", n, want)
			}
		})
	}
}
