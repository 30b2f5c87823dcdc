// Skip: for work that any concurrent run makes redundant, like refreshing a cache,
// a task whose key is busy completes at once without running. Five "refresh the
// products cache" tasks enqueued together: one refreshes, the other four are skipped
// and reported to AfterFailure. A refresh enqueued after it finished runs again.
//
//	go run ./examples/skip
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex"
	"github.com/asynqmutex/asynqmutex/examples/internal/demo"
	"github.com/asynqmutex/asynqmutex/mutex"
)

const (
	queue = "asynqmutex-skip"
	burst = 5
)

type refresh struct {
	Cache string `json:"cache"`
	N     int    `json:"n"` // the task's number, for the output
}

func main() { os.Exit(run()) }

func run() int {
	redisOpt, stop := demo.Redis(queue)
	defer stop()
	rdb := redisOpt.MakeRedisClient().(redis.UniversalClient)
	defer rdb.Close()
	locks := mutex.New(rdb)
	defer locks.Close()

	var (
		mu            sync.Mutex
		ran, skipped  int
		othersSkipped = make(chan struct{})
		done          = make(chan struct{}, burst+1)
	)
	mux := asynq.NewServeMux()
	// Outermost: tells main when a task is finished, its lock released.
	mux.Use(func(next asynq.Handler) asynq.Handler {
		return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
			defer func() { done <- struct{}{} }()
			return next.ProcessTask(ctx, t)
		})
	})
	mux.Use(asynqmutex.Middleware(locks,
		asynqmutex.For("cache:refresh"),
		asynqmutex.On("cache"),
		asynqmutex.OnConflict(asynqmutex.Skip),
		asynqmutex.AfterFailure(func(ctx context.Context, t *asynq.Task, err error) {
			var p refresh
			_ = json.Unmarshal(t.Payload(), &p)
			var locked *asynqmutex.LockedError
			if !errors.As(err, &locked) {
				fmt.Printf("  #%d not run: %v\n", p.N, err) // Redis unreachable, bad payload
				return
			}
			fmt.Printf("  #%d skipped: lock %s is held\n", p.N, locked.Key)
			mu.Lock()
			if skipped++; skipped == burst-1 {
				close(othersSkipped)
			}
			mu.Unlock()
		})))
	mux.HandleFunc("cache:refresh", func(ctx context.Context, t *asynq.Task) error {
		var p refresh
		if err := json.Unmarshal(t.Payload(), &p); err != nil {
			return err
		}
		fmt.Printf("  #%d refreshing the %s cache...\n", p.N, p.Cache)
		// A refresh takes a while. Here it lasts until the rest of the burst has come
		// and been skipped, so that the demo does not depend on timing.
		select {
		case <-othersSkipped:
		case <-time.After(3 * time.Second):
		}
		fmt.Printf("  #%d refreshed\n", p.N)
		mu.Lock()
		ran++
		mu.Unlock()
		return nil
	})

	srv := asynq.NewServer(redisOpt, asynqmutex.Configure(demo.Config(queue, 8)))
	if err := srv.Start(mux); err != nil {
		fmt.Fprintln(os.Stderr, "server:", err)
		return 1
	}
	defer srv.Shutdown()
	client := asynq.NewClient(redisOpt)
	defer client.Close()

	enqueue := func(from, to int) bool {
		for n := from; n <= to; n++ {
			p, _ := json.Marshal(refresh{Cache: "products", N: n})
			if _, err := client.Enqueue(asynq.NewTask("cache:refresh", p), asynq.Queue(queue)); err != nil {
				fmt.Fprintln(os.Stderr, "enqueue:", err)
				return false
			}
		}
		timeout := time.After(5 * time.Second)
		for n := from; n <= to; n++ {
			select {
			case <-done:
			case <-timeout:
				fmt.Println("timed out")
				return false
			}
		}
		return true
	}

	fmt.Printf("\n%d refreshes of the products cache enqueued at once:\n", burst)
	if !enqueue(1, burst) {
		return 1
	}
	fmt.Println("\none more, enqueued after that refresh finished:")
	if !enqueue(burst+1, burst+1) {
		return 1
	}

	mu.Lock()
	defer mu.Unlock()
	fmt.Printf("\nran %d, skipped %d\n", ran, skipped)
	if ran != 2 || skipped != burst-1 {
		fmt.Printf("FAIL: expected ran 2, skipped %d\n", burst-1)
		return 1
	}
	return 0
}
