// AfterFailure: called each time a task does not get its lock, for logs and
// metrics. The error says why: a *LockedError (errors.Is mutex.ErrNotObtained) when
// the key was busy, with RetryIn set under RetryLater; an error wrapping
// asynq.SkipRetry when no key could be derived from the payload, and the task is
// archived where it can be inspected and re-run; any other error when Redis could
// not be reached, and asynq retries the task as an ordinary failure.
//
//	go run ./examples/hook
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sort"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex"
	"github.com/asynqmutex/asynqmutex/examples/internal/demo"
	"github.com/asynqmutex/asynqmutex/mutex"
)

const queue = "asynqmutex-hook"

// failures is a stand-in for a metrics counter, by task type and reason.
type failures struct {
	mu sync.Mutex
	n  map[string]int
}

func (f *failures) inc(taskType, reason string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.n[fmt.Sprintf("lock_failures_total{type=%q,reason=%q}", taskType, reason)]++
}

func main() { os.Exit(run()) }

func run() int {
	redisOpt, stop := demo.Redis(queue)
	defer stop()
	rdb := redisOpt.MakeRedisClient().(redis.UniversalClient)
	defer rdb.Close()
	locks := mutex.New(rdb)
	defer locks.Close()
	ctx := context.Background()

	metrics := &failures{n: make(map[string]int)}
	busy := make(chan struct{}, 1)
	shipped := make(chan struct{}, 1)

	hook := func(ctx context.Context, t *asynq.Task, err error) {
		var locked *asynqmutex.LockedError
		switch {
		case errors.As(err, &locked): // the key was busy
			metrics.inc(t.Type(), "busy")
			fmt.Printf("  hook: %s: key %s busy, retry in %v (errors.Is(err, mutex.ErrNotObtained) = %v)\n",
				t.Type(), locked.Key, locked.RetryIn, errors.Is(err, mutex.ErrNotObtained))
			select {
			case busy <- struct{}{}:
			default:
			}
		case errors.Is(err, asynq.SkipRetry): // no key: the task is archived
			metrics.inc(t.Type(), "no_key")
			fmt.Printf("  hook: %s: no lock key, archived: %v\n", t.Type(), err)
		default: // Redis could not be reached: asynq retries it as a failure
			metrics.inc(t.Type(), "redis")
			fmt.Printf("  hook: %s: %v\n", t.Type(), err)
		}
	}

	mux := asynq.NewServeMux()
	mux.Use(asynqmutex.Middleware(locks,
		asynqmutex.For("order:ship"),
		asynqmutex.On("order_id"),
		asynqmutex.OnConflict(asynqmutex.RetryLater(time.Second)),
		asynqmutex.AfterFailure(hook)))
	mux.HandleFunc("order:ship", func(ctx context.Context, t *asynq.Task) error {
		fmt.Printf("  handler: shipping %s\n", t.Payload())
		shipped <- struct{}{}
		return nil
	})
	srv := asynq.NewServer(redisOpt, asynqmutex.Configure(demo.Config(queue, 4)))
	if err := srv.Start(mux); err != nil {
		fmt.Fprintln(os.Stderr, "server:", err)
		return 1
	}
	defer srv.Shutdown()
	client := asynq.NewClient(redisOpt)
	defer client.Close()
	inspector := asynq.NewInspector(redisOpt)
	defer inspector.Close()

	fmt.Println("\n1. a payload without order_id:")
	info, err := client.Enqueue(asynq.NewTask("order:ship", []byte(`{"order":"o-8"}`)), asynq.Queue(queue))
	if err != nil {
		fmt.Fprintln(os.Stderr, "enqueue:", err)
		return 1
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		info, err = inspector.GetTaskInfo(queue, info.ID)
		if err == nil && info.State == asynq.TaskStateArchived {
			break
		}
		if time.Now().After(deadline) {
			fmt.Println("FAIL: the task was not archived")
			return 1
		}
	}
	fmt.Printf("  inspector: state %v, retried %d, last error:\n    %s\n", info.State, info.Retried, info.LastErr)

	fmt.Println("\n2. order o-7 while another process holds its key:")
	// The key On("order_id") derives for it: task type and field value as a JSON
	// array (see asynqmutex.KeyFunc).
	held, err := locks.TryLock(ctx, `["order:ship","o-7"]`, 10*time.Second)
	if err != nil {
		fmt.Fprintln(os.Stderr, "lock:", err)
		return 1
	}
	if _, err := client.Enqueue(asynq.NewTask("order:ship", []byte(`{"order_id":"o-7"}`)), asynq.Queue(queue)); err != nil {
		fmt.Fprintln(os.Stderr, "enqueue:", err)
		return 1
	}
	select {
	case <-busy:
	case <-time.After(5 * time.Second):
		fmt.Println("FAIL: o-7 did not find its key busy")
		return 1
	}
	fmt.Println("  the other process releases the key")
	if err := held.Unlock(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "unlock:", err)
		return 1
	}
	select {
	case <-shipped:
	case <-time.After(5 * time.Second):
		fmt.Println("FAIL: o-7 was not shipped")
		return 1
	}

	fmt.Println("\nmetrics:")
	metrics.mu.Lock()
	defer metrics.mu.Unlock()
	names := make([]string, 0, len(metrics.n))
	for name := range metrics.n {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		fmt.Printf("  %s %d\n", name, metrics.n[name])
	}
	return 0
}
