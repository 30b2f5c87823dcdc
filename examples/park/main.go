// Park, the default policy: tasks whose key is busy leave their worker and wait in
// their key's line in Redis, and start the moment the key frees, in the order they
// met it; their retry count stays 0. Five syncs of account acct-42 are enqueued at once, then one of
// acct-7, on a server with three workers: acct-42's first sync runs, its second waits
// in a worker to be handed the key, and the rest park, so the third worker, which
// they would have held, runs acct-7 at once.
//
//	go run ./examples/park
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex"
	"github.com/asynqmutex/asynqmutex/examples/internal/demo"
	"github.com/asynqmutex/asynqmutex/mutex"
)

const queue = "asynqmutex-park"

type accountSync struct {
	Account string `json:"account_id"`
	N       int    `json:"n"` // the task's number, for the output
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
		mu     sync.Mutex
		order  []int    // the task numbers, in the order they ran
		parked []string // the IDs of the tasks that parked, in the order they did
		done   = make(chan struct{}, 6)
	)
	mux := asynq.NewServeMux()
	mux.Use(asynqmutex.Middleware(locks,
		asynqmutex.For("account:sync"),
		asynqmutex.On("account_id"),
		asynqmutex.Observe(func(_ context.Context, e asynqmutex.Event) {
			if e.Op == asynqmutex.OpConflict {
				fmt.Printf("  %s: key %s busy: %s\n", e.TaskID, e.Key, e.Policy)
				mu.Lock()
				parked = append(parked, e.TaskID)
				mu.Unlock()
			}
		})))
	mux.HandleFunc("account:sync", func(ctx context.Context, t *asynq.Task) error {
		var p accountSync
		if err := json.Unmarshal(t.Payload(), &p); err != nil {
			return err
		}
		retried, _ := asynq.GetRetryCount(ctx)
		fmt.Printf("  #%d syncs %s (retry count %d)\n", p.N, p.Account, retried)
		time.Sleep(200 * time.Millisecond)
		mu.Lock()
		order = append(order, p.N)
		mu.Unlock()
		done <- struct{}{}
		return nil
	})

	srv := asynq.NewServer(redisOpt, asynqmutex.Configure(demo.Config(queue, 3)))
	if err := srv.Start(mux); err != nil {
		fmt.Fprintln(os.Stderr, "server:", err)
		return 1
	}
	defer srv.Shutdown()
	client := asynq.NewClient(redisOpt)
	defer client.Close()

	fmt.Println("\nfive syncs of acct-42, then one of acct-7, on three workers:")
	for n, account := range []string{"acct-42", "acct-42", "acct-42", "acct-42", "acct-42", "acct-7"} {
		p, _ := json.Marshal(accountSync{Account: account, N: n + 1})
		if _, err := client.Enqueue(asynq.NewTask("account:sync", p), asynq.Queue(queue), asynq.TaskID(fmt.Sprintf("sync-%d", n+1))); err != nil {
			fmt.Fprintln(os.Stderr, "enqueue:", err)
			return 1
		}
	}
	timeout := time.After(20 * time.Second)
	for range 6 {
		select {
		case <-done:
		case <-timeout:
			fmt.Println("timed out")
			return 1
		}
	}

	mu.Lock()
	defer mu.Unlock()
	fmt.Printf("\nran in the order %v\n", order)
	// Tasks taken from the queue together race for the key; those that met it busy
	// run in the order they met it.
	var parkedRan []string
	for _, n := range order {
		if id := fmt.Sprintf("sync-%d", n); slices.Contains(parked, id) {
			parkedRan = append(parkedRan, id)
		}
	}
	fmt.Printf("parked in the order %v, ran in the order %v\n", parked, parkedRan)
	if len(parked) == 0 || !slices.Equal(parkedRan, parked) || slices.Index(order, 6) > 2 {
		fmt.Println("FAIL: expected the parked syncs to run in the order they parked, and acct-7's among the first three")
		return 1
	}
	return 0
}
