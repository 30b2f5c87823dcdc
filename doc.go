// Package asynqmutex runs asynq tasks one at a time per key, across every worker
// process and machine that shares a Redis: two tasks for the same payment, booking or
// account never run at once, while tasks for different ones run in parallel.
// With Limit(n), up to n tasks per key run at once: a concurrency cap per tenant,
// customer or task type.
//
// Middleware derives a lock key from the task type and selected JSON payload fields
// (On("transaction_id")), takes a Redis lock (package mutex) before the handler runs,
// renews it while the handler works, and releases it afterwards. When the key is busy
// the task waits up to MaxWait (ending before the task's deadline, see DeadlineMargin),
// woken the moment the key is released, and then the OnConflict policy applies:
//
//   - RetryLater(d), the default: the task returns to asynq and runs again after about
//     d. With Configure, asynq does not count this as a failure, so contention never
//     spends a task's retries. A task with no retry left waits for the key instead (see
//     LastTryWait), and is archived, saying why, only if it stays busy.
//     MaxReschedules and MaxRescheduleTime cap how often or how long a task is sent
//     back; past the cap its conflicts fail as under Fail.
//   - Skip: the task completes without running.
//   - Fail: an ordinary error; asynq retries it with its normal backoff.
//
// AfterFailure is called each time a task does not get its lock. A payload the key
// cannot be derived from (not JSON, a field missing or not a scalar) archives the task
// at once with an error naming the field: it is never run unlocked, retried in a loop,
// or lost. A lease lost while the handler runs is logged (see Logger); the handler's
// own result decides the task's fate.
//
// Quick start:
//
//	locks := mutex.New(redisOpt.MakeRedisClient().(redis.UniversalClient))
//	srv := asynq.NewServer(redisOpt, asynqmutex.Configure(asynq.Config{Concurrency: 10}))
//	mux := asynq.NewServeMux()
//	mux.Use(asynqmutex.Middleware(locks, asynqmutex.For("payment:capture"), asynqmutex.On("transaction_id")))
//	mux.HandleFunc("payment:capture", func(ctx context.Context, t *asynq.Task) error {
//		fence, _ := asynqmutex.Fence(ctx) // pass to the resource: it rejects stale writers
//		return capture(ctx, t, fence)
//	})
//	err := srv.Run(mux)
//
// For names the task types the middleware is for; other task types on the mux pass
// through untouched. Without For, mux.Use applies the key to every task type on the
// mux, and one whose payload lacks the field is archived as bad input.
//
// Safety: a lock on one Redis is an efficiency lock. It keeps concurrent runs out
// nearly always, but a worker paused past its lease, a failover that loses the key, or
// a Redis restart without persistence can let two handlers overlap. When overlap would
// corrupt data, check the fencing token (Fence) at the resource.
package asynqmutex
