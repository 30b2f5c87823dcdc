package mutex_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex/mutex"
)

func Example() {
	m := miniredis.NewMiniRedis()
	m.ClockTTL(true) // without it, keys on miniredis never expire
	if err := m.Start(); err != nil {
		panic(err)
	}
	defer m.Close()
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	defer rdb.Close()

	locks := mutex.New(rdb)
	defer locks.Close()
	ctx := context.Background()

	lock, err := locks.TryLock(ctx, "report:daily", 30*time.Second)
	if err != nil {
		panic(err)
	}
	fmt.Println("locked", lock.Key())

	// Another worker: the lock is taken.
	_, err = locks.TryLock(ctx, "report:daily", 30*time.Second)
	fmt.Println("second TryLock:", err, errors.Is(err, mutex.ErrNotObtained))

	if err := lock.Unlock(ctx); err != nil {
		panic(err)
	}
	// Releasing again is safe: a release repeated after a lost reply must not
	// report a lost lease.
	fmt.Println("second Unlock:", lock.Unlock(ctx))
	// Output:
	// locked report:daily
	// second TryLock: mutex: not obtained true
	// second Unlock: <nil>
}

// New takes any redis.UniversalClient. An asynq program can build one from the
// connection options it gives asynq, whether a single node, Sentinel or Cluster.
func ExampleNew() {
	var opt asynq.RedisConnOpt = asynq.RedisClientOpt{Addr: "localhost:6379"}
	// or: asynq.RedisFailoverClientOpt{MasterName: "mymaster", SentinelAddrs: []string{"localhost:26379"}}
	// or: asynq.RedisClusterClientOpt{Addrs: []string{"localhost:7000", "localhost:7001"}}

	rdb := opt.MakeRedisClient().(redis.UniversalClient)
	defer rdb.Close()
	locks := mutex.New(rdb)
	defer locks.Close()

	srv := asynq.NewServer(opt, asynq.Config{})
	_, _ = locks, srv
}

func ExampleClient_WithLock() {
	m, err := miniredis.Run()
	if err != nil {
		panic(err)
	}
	defer m.Close()
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	defer rdb.Close()
	locks := mutex.New(rdb)
	defer locks.Close()

	// The lease is renewed every 10s while fn runs, and fn's context is cancelled
	// if it is lost.
	err = locks.WithLock(context.Background(), "invoice:42", 30*time.Second, func(ctx context.Context) error {
		lock, _ := mutex.FromContext(ctx)
		fmt.Println("sending invoice 42 under", lock.Key())
		return nil
	})
	fmt.Println("error:", err)

	held, _ := locks.Locked(context.Background(), "invoice:42")
	fmt.Println("still locked:", held)
	// Output:
	// sending invoice 42 under invoice:42
	// error: <nil>
	// still locked: false
}

func ExampleClient_Lock() {
	m, err := miniredis.Run()
	if err != nil {
		panic(err)
	}
	defer m.Close()
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	defer rdb.Close()
	locks := mutex.New(rdb)
	defer locks.Close()
	ctx := context.Background()

	first, err := locks.TryLock(ctx, "account:7", 30*time.Second)
	if err != nil {
		panic(err)
	}

	// The holder is busy for longer than we are willing to wait.
	_, err = locks.Lock(ctx, "account:7", 30*time.Second, mutex.MaxWait(50*time.Millisecond))
	fmt.Println("waited 50ms:", err)

	// The holder releases after 50ms; the waiter is woken at once.
	go func() {
		time.Sleep(50 * time.Millisecond)
		_ = first.Unlock(ctx)
	}()
	second, err := locks.Lock(ctx, "account:7", 30*time.Second, mutex.MaxWait(5*time.Second))
	fmt.Println("waited up to 5s:", err)
	_ = second.Unlock(ctx)
	// Output:
	// waited 50ms: mutex: not obtained
	// waited up to 5s: <nil>
}

// Each acquisition of a key gets a higher fence. A resource that remembers the
// highest fence it saw can refuse a writer whose lease ran out while it was paused.
func ExampleLock_Fence() {
	m, err := miniredis.Run()
	if err != nil {
		panic(err)
	}
	defer m.Close()
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	defer rdb.Close()
	locks := mutex.New(rdb)
	defer locks.Close()
	ctx := context.Background()

	var highest int64 // kept by the resource, with the data
	write := func(fence int64) error {
		if fence <= highest {
			return fmt.Errorf("fence %d is stale", fence)
		}
		highest = fence
		return nil
	}

	a, err := locks.TryLock(ctx, "doc:1", time.Second)
	if err != nil {
		panic(err)
	}
	m.FastForward(time.Second) // a pauses; its lease runs out
	b, err := locks.TryLock(ctx, "doc:1", time.Second)
	if err != nil {
		panic(err)
	}
	fmt.Println("b's fence is higher:", b.Fence() > a.Fence())
	fmt.Println("b writes:", write(b.Fence()))
	fmt.Println("a wakes and writes:", write(a.Fence()) != nil)
	_ = b.Unlock(ctx)
	// Output:
	// b's fence is higher: true
	// b writes: <nil>
	// a wakes and writes: true
}

// Inspect says who holds a key and who waits; ForceRelease frees a stuck key so that
// its old holder can neither renew nor release it, and the next fence is higher.
func ExampleClient_ForceRelease() {
	m, err := miniredis.Run()
	if err != nil {
		panic(err)
	}
	defer m.Close()
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	defer rdb.Close()
	locks := mutex.New(rdb)
	ctx := context.Background()

	stuck, err := locks.TryLock(ctx, "invoice:7", time.Minute, mutex.HeldBy("invoice:send", "task-17"))
	if err != nil {
		panic(err)
	}
	in, err := locks.Inspect(ctx, "invoice:7")
	if err != nil {
		panic(err)
	}
	fmt.Println("held by", in.Holder.Name, in.Holder.ID, "lease left", in.TTL.Round(time.Minute))

	r, err := locks.ForceRelease(ctx, "invoice:7")
	if err != nil {
		panic(err)
	}
	fmt.Println("released the lock of", r.Before.Holder.ID)
	fmt.Println("old holder extends:", errors.Is(stuck.Extend(ctx, time.Minute), mutex.ErrNotHeld))
	next, err := locks.TryLock(ctx, "invoice:7", time.Minute)
	if err != nil {
		panic(err)
	}
	defer next.Unlock(ctx)
	fmt.Println("next fence is higher:", next.Fence() > stuck.Fence())
	// Output:
	// held by invoice:send task-17 lease left 1m0s
	// released the lock of task-17
	// old holder extends: true
	// next fence is higher: true
}

// Observe hears every lifecycle event of a Client's locks, for metrics or tracing.
func ExampleObserve() {
	m, err := miniredis.Run()
	if err != nil {
		panic(err)
	}
	defer m.Close()
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	defer rdb.Close()
	locks := mutex.New(rdb, mutex.Observe(func(_ context.Context, e mutex.Event) {
		fmt.Println(e.Op, e.Key, e.Name)
	}))
	ctx := context.Background()

	_ = locks.WithLock(ctx, "report:daily", 30*time.Second, func(context.Context) error {
		_, err := locks.TryLock(ctx, "report:daily", 30*time.Second, mutex.HeldBy("second", ""))
		return err
	}, mutex.HeldBy("first", ""))
	// Output:
	// acquired report:daily first
	// contended report:daily second
	// not_obtained report:daily second
	// released report:daily first
}

// A transfer locks both accounts as one lock: it waits while any transfer (or any
// other holder) has either of them, and never deadlocks with a transfer the other
// way round.
func ExampleClient_WithLockKeys() {
	m, err := miniredis.Run()
	if err != nil {
		panic(err)
	}
	defer m.Close()
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	defer rdb.Close()
	locks := mutex.New(rdb)
	defer locks.Close()
	ctx := context.Background()

	accounts := []string{"account:A", "account:B"}
	err = locks.WithLockKeys(ctx, accounts, 30*time.Second, func(ctx context.Context) error {
		lock, _ := mutex.FromContext(ctx)
		fmt.Println("moving money under", lock.Keys(), "with", len(lock.Fences()), "fences")

		// Meanwhile a transfer from B to C cannot start: B is taken.
		_, err := locks.TryLockKeys(ctx, []string{"account:B", "account:C"}, 30*time.Second)
		fmt.Println("B to C:", err)
		return nil
	})
	fmt.Println("error:", err)

	// All or nothing: C was not left taken by the attempt that failed.
	held, _ := locks.Locked(ctx, "account:C")
	fmt.Println("C locked:", held)
	// Output:
	// moving money under [account:A account:B] with 2 fences
	// B to C: mutex: not obtained: key account:B is held
	// error: <nil>
	// C locked: false
}

// Limit(n) lets n holders in at once: here at most 2 exports per tenant run at a
// time. A third waits until one of them releases its slot, which is handed to it at
// once.
func ExampleLimit() {
	m, err := miniredis.Run()
	if err != nil {
		panic(err)
	}
	defer m.Close()
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	defer rdb.Close()
	locks := mutex.New(rdb)
	defer locks.Close()
	ctx := context.Background()

	key := "export:tenant-7"
	a, _ := locks.TryLock(ctx, key, 30*time.Second, mutex.Limit(2))
	b, _ := locks.TryLock(ctx, key, 30*time.Second, mutex.Limit(2))
	_, err = locks.TryLock(ctx, key, 30*time.Second, mutex.Limit(2))
	fmt.Println("third TryLock:", err)

	in, _ := locks.Inspect(ctx, key)
	fmt.Printf("holders: %d of %d; fences increase: %v\n", len(in.Slots), in.Limit, b.Fence() > a.Fence())

	// Every holder of a key must ask with the same limit.
	_, err = locks.TryLock(ctx, key, 30*time.Second)
	var le *mutex.LimitError
	fmt.Println("plain TryLock:", errors.As(err, &le), le.Held, le.Asked)

	go func() {
		time.Sleep(50 * time.Millisecond)
		_ = a.Unlock(ctx)
	}()
	c, err := locks.Lock(ctx, key, 30*time.Second, mutex.Limit(2), mutex.MaxWait(5*time.Second))
	fmt.Println("waited for a slot:", err, c.Fence() > b.Fence())
	_ = b.Unlock(ctx)
	_ = c.Unlock(ctx)
	// Output:
	// third TryLock: mutex: not obtained
	// holders: 2 of 2; fences increase: true
	// plain TryLock: true 2 1
	// waited for a slot: <nil> true
}
