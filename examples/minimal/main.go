// Minimal is the README's program: payment:capture tasks run one at a time per
// transaction_id on every worker that shares the Redis; customer:sync is left alone.
package main

import (
	"context"
	"log"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex"
	"github.com/asynqmutex/asynqmutex/mutex"
)

func main() {
	redisOpt := asynq.RedisClientOpt{Addr: "127.0.0.1:6379"}

	// The lock client, from the same settings as the server. Sentinel
	// (RedisFailoverClientOpt) and Cluster (RedisClusterClientOpt) work alike.
	rdb := redisOpt.MakeRedisClient().(redis.UniversalClient)
	locks := mutex.New(rdb)

	// Configure keeps asynq from counting a busy key as a failure.
	srv := asynq.NewServer(redisOpt, asynqmutex.Configure(asynq.Config{Concurrency: 10}))

	mux := asynq.NewServeMux()
	mux.Use(asynqmutex.Middleware(locks,
		asynqmutex.For("payment:capture"), // other task types pass through untouched
		asynqmutex.On("transaction_id"),   // key: task type + payload["transaction_id"]
		asynqmutex.MaxWait(2*time.Second), // a busy key: wait up to 2s, woken on release
	))
	mux.HandleFunc("payment:capture", func(ctx context.Context, t *asynq.Task) error {
		fence, _ := asynqmutex.Fence(ctx) // hand it to the resource: see Safety
		log.Printf("capture %s under fence %d", t.Payload(), fence)
		return nil
	})
	mux.HandleFunc("customer:sync", func(ctx context.Context, t *asynq.Task) error {
		log.Printf("sync %s, unlocked", t.Payload())
		return nil
	})
	log.Fatal(srv.Run(mux))
}
