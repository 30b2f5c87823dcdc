// RetryLater: a task whose key is busy goes back to asynq and runs again after a
// delay, rather than wait in its key's line as under the default policy, Park. With asynqmutex.Configure asynq does not count that as a failure,
// so the task's retry count stays 0 however often it meets a busy key, and it is
// never archived for contention. (Without Configure each conflict would spend one of
// its retries.)
//
// Task #1 syncs account acct-42 and holds its key; task #2 for the same account
// finds the key busy twice, is retried later each time (after 1s, then 2s), and runs
// once #1 is done, with retry count 0.
//
//	go run ./examples/retrylater
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex"
	"github.com/asynqmutex/asynqmutex/examples/internal/demo"
	"github.com/asynqmutex/asynqmutex/mutex"
)

const (
	queue     = "asynqmutex-retrylater"
	conflicts = 2 // how often #2 finds the key busy before #1 finishes
)

type accountSync struct {
	AccountID string `json:"account_id"`
	N         int    `json:"n"` // the task's number, for the output
}

func main() { os.Exit(run()) }

func run() int {
	redisOpt, stop := demo.Redis(queue)
	defer stop()
	rdb := redisOpt.MakeRedisClient().(redis.UniversalClient)
	defer rdb.Close()
	locks := mutex.New(rdb)
	defer locks.Close()

	start := time.Now()
	logf := func(format string, args ...any) {
		fmt.Printf("%5.1fs  %s\n", time.Since(start).Seconds(), fmt.Sprintf(format, args...))
	}
	var (
		firstStarted = make(chan struct{})
		firstMayEnd  = make(chan struct{})
		secondRan    = make(chan int, 1) // its retry count
		seen         atomic.Int32        // conflicts of #2, counted by the hook
	)

	mux := asynq.NewServeMux()
	mux.Use(asynqmutex.Middleware(locks,
		asynqmutex.For("account:sync"),
		asynqmutex.On("account_id"),
		// The default is Park; RetryLater sends the task back for a while instead.
		asynqmutex.OnConflict(asynqmutex.RetryLater(time.Second)),
		asynqmutex.AfterFailure(func(ctx context.Context, t *asynq.Task, err error) {
			var locked *asynqmutex.LockedError
			if !errors.As(err, &locked) {
				logf("not run: %v", err)
				return
			}
			retried, _ := asynq.GetRetryCount(ctx)
			logf("#2 key busy, retry in %v; retry count %d", locked.RetryIn, retried)
			if seen.Add(1) == conflicts {
				close(firstMayEnd)
			}
		})))
	mux.HandleFunc("account:sync", func(ctx context.Context, t *asynq.Task) error {
		var p accountSync
		if err := json.Unmarshal(t.Payload(), &p); err != nil {
			return err
		}
		retried, _ := asynq.GetRetryCount(ctx)
		maxRetry, _ := asynq.GetMaxRetry(ctx)
		logf("#%d syncing %s; retry count %d of max %d", p.N, p.AccountID, retried, maxRetry)
		if p.N == 1 {
			close(firstStarted)
			// A long sync. Here it lasts until #2 has met the busy key a few times,
			// so that the demo does not depend on timing.
			select {
			case <-firstMayEnd:
			case <-time.After(8 * time.Second):
			}
			logf("#1 done")
			return nil
		}
		secondRan <- retried
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

	enqueue := func(n int) error {
		p, _ := json.Marshal(accountSync{AccountID: "acct-42", N: n})
		_, err := client.Enqueue(asynq.NewTask("account:sync", p), asynq.Queue(queue), asynq.MaxRetry(3))
		return err
	}
	if err := enqueue(1); err != nil {
		fmt.Fprintln(os.Stderr, "enqueue:", err)
		return 1
	}
	<-firstStarted
	if err := enqueue(2); err != nil {
		fmt.Fprintln(os.Stderr, "enqueue:", err)
		return 1
	}

	select {
	case retried := <-secondRan:
		if retried != 0 {
			fmt.Println("FAIL: contention spent a retry")
			return 1
		}
		fmt.Println("ok: #2 waited its turn without spending a retry")
		return 0
	case <-time.After(10 * time.Second):
		fmt.Println("FAIL: #2 did not run")
		return 1
	}
}
