package asynqmutex_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex"
	"github.com/asynqmutex/asynqmutex/mutex"
)

// An asynq server whose payment tasks run one at a time per transaction_id.
func Example() {
	m := miniredis.NewMiniRedis()
	m.ClockTTL(true) // without it, keys on miniredis never expire
	if err := m.Start(); err != nil {
		panic(err)
	}
	defer m.Close()
	redisOpt := asynq.RedisClientOpt{Addr: m.Addr()}

	rdb := redisOpt.MakeRedisClient().(redis.UniversalClient)
	defer rdb.Close()
	locks := mutex.New(rdb)
	defer locks.Close()

	client := asynq.NewClient(redisOpt)
	defer client.Close()
	for _, tx := range []string{"tx-1", "tx-1", "tx-1", "tx-2", "tx-2", "tx-2"} {
		payload := fmt.Sprintf(`{"transaction_id":%q}`, tx)
		if _, err := client.Enqueue(asynq.NewTask("payment:capture", []byte(payload))); err != nil {
			panic(err)
		}
	}

	var (
		mu      sync.Mutex
		running = map[string]int{} // tasks running now, per transaction
		maxSeen int
		done    sync.WaitGroup
	)
	done.Add(6)
	srv := asynq.NewServer(redisOpt, asynqmutex.Configure(asynq.Config{
		Concurrency:       6,
		LogLevel:          asynq.ErrorLevel,
		TaskCheckInterval: 10 * time.Millisecond,
	}))
	mux := asynq.NewServeMux()
	mux.Use(asynqmutex.Middleware(locks, asynqmutex.On("transaction_id"), asynqmutex.MaxWait(5*time.Second)))
	mux.HandleFunc("payment:capture", func(ctx context.Context, t *asynq.Task) error {
		defer done.Done()
		var p struct {
			TransactionID string `json:"transaction_id"`
		}
		if err := json.Unmarshal(t.Payload(), &p); err != nil {
			return err
		}
		mu.Lock()
		running[p.TransactionID]++
		maxSeen = max(maxSeen, running[p.TransactionID])
		mu.Unlock()

		time.Sleep(20 * time.Millisecond) // capture the payment

		mu.Lock()
		running[p.TransactionID]--
		mu.Unlock()
		return nil
	})
	if err := srv.Start(mux); err != nil {
		panic(err)
	}
	done.Wait()
	srv.Shutdown()

	fmt.Println("most tasks of one transaction running at once:", maxSeen)
	// Output: most tasks of one transaction running at once: 1
}

// Middleware wraps any asynq.Handler: use it with mux.Use, or call it on a handler.
func ExampleMiddleware() {
	m, err := miniredis.Run()
	if err != nil {
		panic(err)
	}
	defer m.Close()
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	defer rdb.Close()

	handler := asynqmutex.Middleware(mutex.New(rdb), asynqmutex.On("transaction_id"))(
		asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
			fmt.Printf("capturing %s\n", t.Payload())
			return nil
		}))

	ctx := context.Background()
	err = handler.ProcessTask(ctx, asynq.NewTask("payment:capture", []byte(`{"transaction_id":"tx-1"}`)))
	fmt.Println("error:", err)

	// A payload without the field: the handler does not run, and the error makes
	// asynq archive the task.
	err = handler.ProcessTask(ctx, asynq.NewTask("payment:capture", []byte(`{"id":"tx-1"}`)))
	fmt.Println("archived:", errors.Is(err, asynq.SkipRetry))
	// Output:
	// capturing {"transaction_id":"tx-1"}
	// error: <nil>
	// archived: true
}

// For names the task types the middleware is for: on a mux that serves other task
// types too, those pass through to their handlers untouched.
func ExampleFor() {
	m, err := miniredis.Run()
	if err != nil {
		panic(err)
	}
	defer m.Close()
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	defer rdb.Close()
	locks := mutex.New(rdb)
	defer locks.Close()

	mux := asynq.NewServeMux()
	mux.Use(asynqmutex.Middleware(locks, asynqmutex.For("payment:capture"), asynqmutex.On("transaction_id")))
	mux.HandleFunc("payment:capture", func(ctx context.Context, t *asynq.Task) error {
		_, locked := asynqmutex.Fence(ctx)
		fmt.Printf("capture %s, locked: %v\n", t.Payload(), locked)
		return nil
	})
	mux.HandleFunc("customer:sync", func(ctx context.Context, t *asynq.Task) error {
		_, locked := asynqmutex.Fence(ctx)
		fmt.Printf("sync %s, locked: %v\n", t.Payload(), locked)
		return nil
	})

	ctx := context.Background()
	fmt.Println(mux.ProcessTask(ctx, asynq.NewTask("payment:capture", []byte(`{"transaction_id":"tx-1"}`))))
	fmt.Println(mux.ProcessTask(ctx, asynq.NewTask("customer:sync", []byte(`{"customer_id":7}`))))
	// Output:
	// capture {"transaction_id":"tx-1"}, locked: true
	// <nil>
	// sync {"customer_id":7}, locked: false
	// <nil>
}

// Tasks whose fields are equal exclude each other; others do not. Here the handler
// of one task tries to run two more while it holds its key.
func ExampleOn() {
	m, err := miniredis.Run()
	if err != nil {
		panic(err)
	}
	defer m.Close()
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	defer rdb.Close()

	var handler asynq.Handler
	handler = asynqmutex.Middleware(mutex.New(rdb),
		asynqmutex.On("customer.id", "currency"), // "customer.id": the field id of the object customer
		asynqmutex.OnConflict(asynqmutex.Skip),
		asynqmutex.AfterFailure(func(ctx context.Context, t *asynq.Task, err error) {
			fmt.Printf("  skipped %s\n", t.Payload())
		}),
	)(asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		fmt.Printf("running %s\n", t.Payload())
		if string(t.Payload()) == `{"customer":{"id":7},"currency":"EUR"}` {
			for _, p := range []string{
				`{"currency":"EUR","customer":{"id":7,"name":"Ann"}}`, // same id and currency
				`{"customer":{"id":7},"currency":"USD"}`,              // another currency
			} {
				_ = handler.ProcessTask(ctx, asynq.NewTask("invoice:send", []byte(p)))
			}
		}
		return nil
	}))
	_ = handler.ProcessTask(context.Background(), asynq.NewTask("invoice:send", []byte(`{"customer":{"id":7},"currency":"EUR"}`)))
	// Output:
	// running {"customer":{"id":7},"currency":"EUR"}
	//   skipped {"currency":"EUR","customer":{"id":7,"name":"Ann"}}
	// running {"customer":{"id":7},"currency":"USD"}
}

// Configure installs IsFailure and RetryDelayFunc, so that a task whose key is busy
// is retried after its RetryIn without spending one of its retries.
func ExampleConfigure() {
	cfg := asynqmutex.Configure(asynq.Config{
		Concurrency: 10,
		// Functions set before Configure still decide for every other error.
		IsFailure: func(err error) bool { return !errors.Is(err, context.Canceled) },
	})

	busy := &asynqmutex.LockedError{Key: `["payment:capture","tx-1"]`, RetryIn: 5 * time.Second}
	fmt.Println("busy key is a failure:", cfg.IsFailure(busy))
	fmt.Println("canceled is a failure:", cfg.IsFailure(context.Canceled))
	fmt.Println("other error is a failure:", cfg.IsFailure(errors.New("card declined")))
	d := cfg.RetryDelayFunc(0, busy, asynq.NewTask("payment:capture", nil))
	fmt.Println("busy key retried after RetryIn plus jitter:", d >= 5*time.Second && d < 5*time.Second*5/4+time.Second)

	// Then: srv := asynq.NewServer(redisOpt, cfg)

	// Output:
	// busy key is a failure: false
	// canceled is a failure: false
	// other error is a failure: true
	// busy key retried after RetryIn plus jitter: true
}

// asynq calls Config.ErrorHandler for every error a handler returns, the
// *LockedError of each busy key included, with Configure too. errors.As tells them
// apart, to report only real failures, and a pause that a handler asked for (a 429)
// from a busy key.
func ExampleConfigure_errorHandler() {
	cfg := asynqmutex.Configure(asynq.Config{
		ErrorHandler: asynq.ErrorHandlerFunc(func(ctx context.Context, t *asynq.Task, err error) {
			var pe *asynqmutex.PauseError // first: a pause is a LockedError too
			if errors.As(err, &pe) {
				fmt.Println("service asked for a pause of", pe.For, "because", pe.Err)
				return
			}
			var le *asynqmutex.LockedError
			if errors.As(err, &le) {
				return // a busy key: the task runs again later; nothing failed
			}
			fmt.Println("task failed:", err)
		}),
	})

	task := asynq.NewTask("payment:capture", nil)
	cfg.ErrorHandler.HandleError(context.Background(), task, &asynqmutex.LockedError{Key: `["payment:capture","tx-1"]`, RetryIn: 5 * time.Second})
	cfg.ErrorHandler.HandleError(context.Background(), task, asynqmutex.PauseKey(30*time.Second, errors.New("HTTP 429")))
	cfg.ErrorHandler.HandleError(context.Background(), task, errors.New("card declined"))

	// Output:
	// service asked for a pause of 30s because HTTP 429
	// task failed: card declined
}

// The resource checks the fencing token, so a worker that lost its lock while
// paused cannot overwrite what a later holder wrote.
func ExampleFence() {
	m, err := miniredis.Run()
	if err != nil {
		panic(err)
	}
	defer m.Close()
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	defer rdb.Close()

	account := &ledger{} // the resource: remembers the highest fence it accepted
	handler := asynqmutex.Middleware(mutex.New(rdb), asynqmutex.On("account_id"))(
		asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
			fence, _ := asynqmutex.Fence(ctx)
			return account.write(fence, string(t.Payload()))
		}))

	ctx := context.Background()
	for range 2 {
		if err := handler.ProcessTask(ctx, asynq.NewTask("account:post", []byte(`{"account_id":"a-1"}`))); err != nil {
			fmt.Println(err)
		}
	}
	fmt.Println("writes accepted:", account.writes)
	fmt.Println("a stale writer:", account.write(account.fence-1, "late"))

	_, ok := asynqmutex.Fence(ctx)
	fmt.Println("fence outside a handler:", ok)
	// Output:
	// writes accepted: 2
	// a stale writer: stale fence
	// fence outside a handler: false
}

type ledger struct {
	mu     sync.Mutex
	fence  int64
	writes int
}

func (l *ledger) write(fence int64, _ string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if fence <= l.fence {
		return errors.New("stale fence")
	}
	l.fence = fence
	l.writes++
	return nil
}

// Transfers lock both accounts, and deposits the one they touch: Scope("account")
// gives both task types the same keys, so no two tasks on one account run at once,
// while tasks on distinct accounts do.
func ExampleOnEach() {
	m, err := miniredis.Run()
	if err != nil {
		panic(err)
	}
	defer m.Close()
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	defer rdb.Close()
	locks := mutex.New(rdb)
	defer locks.Close()

	mux := asynq.NewServeMux()
	var deposit asynq.Handler
	mux.Handle("transfer", asynqmutex.Middleware(locks,
		asynqmutex.OnEach("from", "to"), asynqmutex.Scope("account"), asynqmutex.OnConflict(asynqmutex.Skip),
	)(asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		fmt.Printf("transfer %s\n", t.Payload())
		for _, p := range []string{`{"account":"B"}`, `{"account":"C"}`} {
			_ = deposit.ProcessTask(ctx, asynq.NewTask("deposit", []byte(p)))
		}
		return nil
	})))
	deposit = asynqmutex.Middleware(locks,
		asynqmutex.On("account"), asynqmutex.Scope("account"), asynqmutex.OnConflict(asynqmutex.Skip),
		asynqmutex.AfterFailure(func(ctx context.Context, t *asynq.Task, err error) {
			fmt.Printf("  deposit %s skipped: account busy\n", t.Payload())
		}),
	)(asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		fmt.Printf("  deposit %s\n", t.Payload())
		return nil
	}))
	_ = mux.ProcessTask(context.Background(), asynq.NewTask("transfer", []byte(`{"from":"A","to":"B"}`)))
	// Output:
	// transfer {"from":"A","to":"B"}
	//   deposit {"account":"B"} skipped: account busy
	//   deposit {"account":"C"}
}

// A task whose key stays busy is sent back at most 20 times, and not once an hour
// has passed since its first conflict: past either cap each conflict is a failure,
// and asynq archives the task when its retries are used up.
func ExampleMaxReschedules() {
	redisOpt := asynq.RedisClientOpt{Addr: "127.0.0.1:6379"}
	rdb := redisOpt.MakeRedisClient().(redis.UniversalClient)
	defer rdb.Close()

	locks := mutex.New(rdb)
	defer locks.Close()

	mux := asynq.NewServeMux()
	mux.Use(asynqmutex.Middleware(locks, asynqmutex.For("payment:capture"), asynqmutex.On("transaction_id"),
		asynqmutex.OnConflict(asynqmutex.RetryLater(10*time.Second)),
		asynqmutex.MaxReschedules(20),           // at most 20 reschedules, and/or
		asynqmutex.MaxRescheduleTime(time.Hour), // none once an hour has passed since the first conflict
	))
	srv := asynq.NewServer(redisOpt, asynqmutex.Configure(asynq.Config{Concurrency: 10}))
	_ = srv // srv.Run(mux)
}
