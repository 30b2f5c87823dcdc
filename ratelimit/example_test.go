package ratelimit_test

import (
	"context"
	"fmt"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex/ratelimit"
)

// Calls to a payment provider that allows 100 a minute per merchant, from every
// process that shares the Redis.
func Example() {
	m, err := miniredis.Run()
	if err != nil {
		panic(err)
	}
	defer m.Close()
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	defer rdb.Close()
	ctx := context.Background()

	limiter := ratelimit.New(rdb)
	perMerchant := ratelimit.PerMinute(100) // one call every 600ms

	r, err := limiter.Allow(ctx, "merchant:m-1", perMerchant)
	if err != nil {
		panic(err) // Redis could not be reached
	}
	fmt.Println("first call allowed:", r.Allowed)

	r, _ = limiter.Allow(ctx, "merchant:m-1", perMerchant)
	fmt.Println("second call allowed:", r.Allowed, "- next in about", r.Delay.Round(100*time.Millisecond))

	// Wait sleeps until the merchant's next start instead, up to ctx's deadline.
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := limiter.Wait(ctx, "merchant:m-1", perMerchant); err != nil {
		panic(err)
	}
	fmt.Println("third call waited for its start")
	// Output:
	// first call allowed: true
	// second call allowed: false - next in about 600ms
	// third call waited for its start
}
