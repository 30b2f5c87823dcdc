// Package demo is the setup the examples share: which Redis they talk to.
package demo

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// Redis returns the Redis an example uses: the one at REDIS_ADDR (host:port) when
// it is set, otherwise an embedded miniredis on 127.0.0.1, which is for demos only.
// It prints which one it is. queue is the example's own asynq queue: on a real
// Redis it is emptied first and deleted by stop, so that tasks an interrupted run
// left behind do not show up in the next one. Call stop before the program exits.
// Redis exits the program when REDIS_ADDR does not answer.
func Redis(queue string) (opt asynq.RedisClientOpt, stop func()) {
	addr := os.Getenv("REDIS_ADDR")
	if addr == "" {
		m := miniredis.NewMiniRedis()
		// Without ClockTTL miniredis never lets a key expire on its own: a lock
		// whose holder died would stay taken forever, and asynq's leases with it.
		m.ClockTTL(true)
		if err := m.Start(); err != nil {
			fmt.Fprintln(os.Stderr, "starting miniredis:", err)
			os.Exit(1)
		}
		fmt.Println("redis: embedded miniredis (set REDIS_ADDR=host:port to use a real Redis)")
		return asynq.RedisClientOpt{Addr: m.Addr()}, m.Close
	}

	opt = asynq.RedisClientOpt{Addr: addr}
	rdb := opt.MakeRedisClient().(redis.UniversalClient)
	defer rdb.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	if err := rdb.Ping(ctx).Err(); err != nil {
		fmt.Fprintf(os.Stderr, "REDIS_ADDR=%s: %v\n", addr, err)
		os.Exit(1)
	}
	fmt.Printf("redis: %s (REDIS_ADDR)\n", addr)
	deleteQueue := func() {
		insp := asynq.NewInspector(opt)
		defer insp.Close()
		if err := insp.DeleteQueue(queue, true); err != nil && !errors.Is(err, asynq.ErrQueueNotFound) {
			fmt.Fprintf(os.Stderr, "deleting queue %q: %v\n", queue, err)
		}
	}
	deleteQueue()
	return opt, deleteQueue
}

// Config is the asynq.Config of the examples: one queue, quiet logs, and short
// polling intervals so that a demo takes seconds. Production servers keep asynq's
// defaults (1 s to find new tasks, 5 s to move due retries back to their queue).
func Config(queue string, concurrency int) asynq.Config {
	return asynq.Config{
		Concurrency:              concurrency,
		Queues:                   map[string]int{queue: 1},
		LogLevel:                 asynq.ErrorLevel,
		TaskCheckInterval:        20 * time.Millisecond,
		DelayedTaskCheckInterval: 100 * time.Millisecond,
		ShutdownTimeout:          3 * time.Second,
	}
}
