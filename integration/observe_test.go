package integration

import (
	"context"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex"
	"github.com/asynqmutex/asynqmutex/mutex"
)

// TestRunningTaskIsVisible runs a task on a real asynq.Server: while its handler runs,
// Inspect names the task's type and ID, this host and process, and a lease; events
// carry the task's type and ID; a second task with the key, under Skip, is a conflict
// event with policy "skip".
func TestRunningTaskIsVisible(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	rdb, ok := e.opt.MakeRedisClient().(redis.UniversalClient)
	if !ok {
		t.Fatal("not a redis.UniversalClient")
	}
	t.Cleanup(func() { _ = rdb.Close() })
	var (
		mu     sync.Mutex
		events []mutex.Event
		tasks  []asynqmutex.Event
	)
	locks := mutex.New(rdb, mutex.Observe(func(_ context.Context, ev mutex.Event) {
		mu.Lock()
		events = append(events, ev)
		mu.Unlock()
	}))
	started, release := make(chan struct{}, 2), make(chan struct{})
	mw := asynqmutex.Middleware(locks, asynqmutex.On("account"), asynqmutex.OnConflict(asynqmutex.Skip),
		asynqmutex.Observe(func(_ context.Context, ev asynqmutex.Event) {
			mu.Lock()
			tasks = append(tasks, ev)
			mu.Unlock()
		}))
	startServer(t, e.opt, asynqmutex.Configure(asynq.Config{Concurrency: 2}), mw(asynq.HandlerFunc(
		func(ctx context.Context, _ *asynq.Task) error {
			started <- struct{}{}
			select {
			case <-release:
			case <-time.After(30 * time.Second):
			}
			return nil
		})))
	first := e.enqueue(t, "transfer", payload(t, map[string]string{"account": "a-1"}), asynq.Retention(time.Hour))
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("handler did not start within 10s")
	}
	key, err := asynqmutex.Key("transfer", `"a-1"`)
	if err != nil {
		t.Fatal(err)
	}
	in, err := e.locks.Inspect(context.Background(), key)
	if err != nil {
		t.Fatal(err)
	}
	host, _ := os.Hostname()
	want := mutex.Holder{Name: "transfer", ID: first.ID, Host: host, PID: os.Getpid()}
	if !in.Held || in.Holder != want || in.TTL <= 0 || in.Fence <= 0 {
		t.Errorf("Inspect while the task runs = held %v, holder %+v, ttl %v, fence %d; want held by %+v", in.Held, in.Holder, in.TTL, in.Fence, want)
	}

	second := e.enqueue(t, "transfer", payload(t, map[string]string{"account": "a-1"}), asynq.Retention(time.Hour))
	waitState(t, e.insp, "default", second.ID, asynq.TaskStateCompleted, 10*time.Second)
	close(release)
	waitState(t, e.insp, "default", first.ID, asynq.TaskStateCompleted, 10*time.Second)

	mu.Lock()
	defer mu.Unlock()
	var conflict, released bool
	for _, ev := range tasks {
		if ev.Op == asynqmutex.OpConflict && ev.TaskID == second.ID {
			conflict = ev.Policy == "skip" && ev.TaskType == "transfer" && ev.Key == key
		}
	}
	for _, ev := range events {
		switch {
		case ev.Op == mutex.OpReleased && ev.ID == first.ID:
			released = ev.Name == "transfer" && ev.Held > 0
		}
	}
	if !conflict || !released {
		t.Errorf("events: conflict of the second task seen %v, release by the first %v; got %+v and %+v", conflict, released, tasks, events)
	}
}
