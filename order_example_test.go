package asynqmutex_test

import (
	"context"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex"
	"github.com/asynqmutex/asynqmutex/mutex"
)

// The transfers of one account run in the order they were enqueued, one at a time, on
// every worker; other accounts' run beside them. Producer and worker share one option
// list, so that both derive the same key from a task.
func ExampleProducer() {
	redisOpt := asynq.RedisClientOpt{Addr: "127.0.0.1:6379"}
	locks := mutex.New(redis.NewClient(&redis.Options{Addr: redisOpt.Addr}))
	inspector := asynq.NewInspector(redisOpt)
	ctx := context.Background()
	payload := []byte(`{"account_id":"acct-7","amount":100}`)

	opts := []asynqmutex.Option{asynqmutex.For("transfer"), asynqmutex.On("account_id"),
		asynqmutex.InOrder(inspector), asynqmutex.MaxWait(10 * time.Second)}

	// Producer: takes the task's place in its account's order, then enqueues it.
	producer := asynqmutex.NewProducer(locks, asynq.NewClient(redisOpt), opts...)
	_, err := producer.Enqueue(ctx, asynq.NewTask("transfer", payload), asynq.Queue("transfers"))

	// Worker: runs a transfer when every earlier one of its account has finished.
	mux := asynq.NewServeMux()
	mux.Use(asynqmutex.Middleware(locks, opts...))
	srv := asynq.NewServer(redisOpt, asynqmutex.Configure(asynq.Config{Queues: map[string]int{"transfers": 1}}))

	_, _ = err, srv
}
