package mutex

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestWaiterBehindCrashedHolder(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		if !b.real {
			t.Skip("needs a server whose TTLs follow the clock")
		}
		c := New(b.rdb)
		ctx := context.Background()
		key := uniqueKey(t)
		const ttl = time.Second
		// The holder "crashes": it never unlocks, so nothing is published and the
		// waiter must come back when the lease runs out, not poll, not sleep on.
		_, err := c.TryLock(ctx, key, ttl)
		require.NoError(t, err)
		start := time.Now()
		l, err := c.Lock(ctx, key, ttl, MaxWait(10*ttl))
		require.NoError(t, err)
		took := time.Since(start)
		// A correctness bound, not a speed figure: the waiter must come back at the
		// lease's end (plus up to ttl/8 jitter), long before its 10 s MaxWait.
		assert.Less(t, took, ttl+ttl/2, "waited %v behind a %v lease", took, ttl)
		require.NoError(t, l.Unlock(ctx))
	})
}

func TestOneReleaseWakesOneWaiter(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		ctx := context.Background()
		key := uniqueKey(t)
		holder, err := c.TryLock(ctx, key, time.Hour)
		require.NoError(t, err)

		const waiters = 5
		var (
			wg    sync.WaitGroup
			mu    sync.Mutex
			order []int64
		)
		for range waiters {
			wg.Add(1)
			go func() {
				defer wg.Done()
				l, err := c.Lock(ctx, key, time.Hour, MaxWait(time.Minute))
				if !assert.NoError(t, err) {
					return
				}
				mu.Lock()
				order = append(order, l.Fence())
				mu.Unlock()
				assert.NoError(t, l.Unlock(ctx)) // wakes the next one
			}()
		}
		waitForWaiters(t, c, key, waiters)

		// Count the waiters holding a wake-up right after one release is delivered.
		c.hub.released(c.redisKey(key))
		c.hub.mu.Lock()
		woken := 0
		for _, w := range c.hub.queues[c.redisKey(key)].waiters {
			woken += len(w.wake)
		}
		c.hub.mu.Unlock()
		assert.LessOrEqual(t, woken, 1, "one release must wake at most one local waiter")

		require.NoError(t, holder.Unlock(ctx))
		wg.Wait() // every waiter got the lock in turn, woken by the one before it
		assert.Len(t, order, waiters)
	})
}

func TestHubClosesWhenIdle(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		c.hub.linger = time.Millisecond
		ctx := context.Background()
		key := uniqueKey(t)
		holder, err := c.TryLock(ctx, key, time.Hour)
		require.NoError(t, err)
		done := make(chan error, 1)
		go func() {
			l, err := c.Lock(ctx, key, time.Minute)
			if err == nil {
				err = l.Unlock(ctx)
			}
			done <- err
		}()
		waitForWaiters(t, c, key, 1)
		require.NoError(t, holder.Unlock(ctx))
		require.NoError(t, <-done)
		deadline := time.Now().Add(10 * time.Second)
		for time.Now().Before(deadline) {
			c.hub.mu.Lock()
			closed := c.hub.cur == nil && len(c.hub.queues) == 0
			c.hub.mu.Unlock()
			if closed {
				return
			}
			time.Sleep(time.Millisecond)
		}
		t.Fatal("subscription still open 10 s after the last waiter left")
	})
}

func TestCloseWhileWaiting(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		ctx := context.Background()
		key := uniqueKey(t)
		holder, err := c.TryLock(ctx, key, time.Hour)
		require.NoError(t, err)
		got := make(chan error, 1)
		go func() {
			l, err := c.Lock(ctx, key, time.Minute, MaxWait(time.Minute))
			if err == nil {
				err = l.Unlock(ctx)
			}
			got <- err
		}()
		waitForWaiters(t, c, key, 1)
		require.NoError(t, c.Close())
		require.NoError(t, c.Close(), "Close is idempotent")

		// A later waiter reopens the subscription for both keys' waiters.
		second := make(chan error, 1)
		go func() {
			l, err := c.Lock(ctx, key, time.Minute, MaxWait(time.Minute))
			if err == nil {
				err = l.Unlock(ctx)
			}
			second <- err
		}()
		waitForWaiters(t, c, key, 2)
		require.NoError(t, holder.Unlock(ctx))
		for _, ch := range []chan error{got, second} {
			select {
			case err := <-ch:
				require.NoError(t, err)
			case <-time.After(30 * time.Second):
				t.Fatal("waiter not woken after Close and a new subscription")
			}
		}
		require.NoError(t, c.Close())
	})
}
