package asynqmutex_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex"
	"github.com/asynqmutex/asynqmutex/mutex"
	"github.com/asynqmutex/asynqmutex/ratelimit"
)

// At most 10 emails a second per tenant, fleet-wide, as many at once as the workers
// allow; a task over the limit waits for its start up to 5 seconds, then comes back
// later without spending a retry.
func ExampleRate() {
	m, err := miniredis.Run()
	if err != nil {
		panic(err)
	}
	defer m.Close()
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	defer rdb.Close()
	locks := mutex.New(rdb)
	mux := asynq.NewServeMux()
	mux.HandleFunc("email:send", func(context.Context, *asynq.Task) error { return nil })

	mux.Use(asynqmutex.Middleware(locks, asynqmutex.For("email:send"), asynqmutex.On("tenant_id"),
		asynqmutex.Rate(10, time.Second), asynqmutex.NoLock(), asynqmutex.MaxWait(5*time.Second)))

	start := time.Now()
	for range 3 {
		if err := mux.ProcessTask(context.Background(), asynq.NewTask("email:send", []byte(`{"tenant_id":"acme"}`))); err != nil {
			panic(err)
		}
	}
	fmt.Println("three starts spaced 100ms apart:", time.Since(start) >= 200*time.Millisecond)
	// Output:
	// three starts spaced 100ms apart: true
}

// A handler whose API answers 429 pauses its key on every worker for the time the
// API asks; the task comes back after it.
func ExamplePauseKey() {
	m, err := miniredis.Run()
	if err != nil {
		panic(err)
	}
	defer m.Close()
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	defer rdb.Close()
	locks := mutex.New(rdb)

	handler := asynqmutex.Middleware(locks, asynqmutex.On("merchant_id"), asynqmutex.Rate(100, time.Minute))(
		asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
			resp := &http.Response{Status: "429 Too Many Requests", StatusCode: http.StatusTooManyRequests, Header: http.Header{"Retry-After": {"30"}}}
			if resp.StatusCode == http.StatusTooManyRequests {
				secs, _ := strconv.Atoi(resp.Header.Get("Retry-After"))
				return asynqmutex.PauseKey(time.Duration(secs)*time.Second, errors.New(resp.Status))
			}
			return nil
		}))

	err = handler.ProcessTask(context.Background(), asynq.NewTask("charge", []byte(`{"merchant_id":"m-1"}`)))
	var le *asynqmutex.LockedError
	fmt.Println(errors.As(err, &le), le.RetryIn) // a second more than the pause: asynq keeps whole seconds, cut short
	// Output:
	// true 31s
}

// Limits that differ per key: a tenant's plan.
func ExampleRateBy() {
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379"}) // no I/O until a task runs
	defer rdb.Close()
	locks := mutex.New(rdb)
	mux := asynq.NewServeMux()
	planOf := func(context.Context, *asynq.Task) (string, error) { return "pro", nil } // your lookup, cached

	plans := map[string]ratelimit.Rate{
		"free": ratelimit.PerMinute(10),
		"pro":  {N: 100, Per: time.Second, Burst: 20},
	}
	mux.Use(asynqmutex.Middleware(locks, asynqmutex.On("tenant_id"), asynqmutex.Limit(5),
		asynqmutex.RateBy(func(ctx context.Context, t *asynq.Task) (ratelimit.Rate, error) {
			plan, err := planOf(ctx, t)
			return plans[plan], err // an unknown plan: the zero Rate, no rate limit
		})))

	fmt.Println(plans["pro"])
	// Output:
	// 100 per 1s, burst 20
}
