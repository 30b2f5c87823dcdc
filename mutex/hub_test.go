package mutex

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

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

// countAttempts is a go-redis hook counting plain_lock.lua calls.
type countAttempts struct{ n atomic.Int64 }

func (h *countAttempts) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *countAttempts) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *countAttempts) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if isLockScript(cmd) {
			h.n.Add(1)
		}
		return next(ctx, cmd)
	}
}

func TestOneReleaseWakesOneWaiter(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		attempts := &countAttempts{}
		b.rdb.AddHook(attempts)
		// Three Clients, as three worker processes would have, two waiters each.
		clients := []*Client{New(b.rdb), New(b.rdb), New(b.rdb)}
		ctx := context.Background()
		key := uniqueKey(t)
		holder, err := clients[0].TryLock(ctx, key, time.Hour)
		require.NoError(t, err)

		const perClient = 2
		var (
			wg     sync.WaitGroup
			turn   = make(chan *Lock)
			nLocks = len(clients) * perClient
		)
		for _, c := range clients {
			for range perClient {
				wg.Add(1)
				go func() {
					defer wg.Done()
					l, err := c.Lock(ctx, key, time.Hour, MaxWait(time.Minute))
					if assert.NoError(t, err) {
						turn <- l
					}
				}()
			}
		}
		for _, c := range clients {
			waitForWaiters(t, b, c, key, nLocks)
		}
		// A waiter that joined before its Client's subscription was confirmed makes one
		// more attempt once it is: let those finish before counting.
		for i, last := 0, int64(-1); i < 100 && attempts.n.Load() != last; i++ {
			last = attempts.n.Load()
			time.Sleep(50 * time.Millisecond)
		}

		check := func(name string, release func()) {
			before := attempts.n.Load()
			release()
			l := <-turn
			// Give a thundering herd time to show itself: every woken waiter attempts.
			time.Sleep(100 * time.Millisecond)
			// The release hands the lock over: the waiter holds it without an attempt.
			assert.Equal(t, int64(0), attempts.n.Load()-before, "%s: attempts after one release", name)
			select {
			case extra := <-turn:
				t.Errorf("%s: a second waiter holds the lock too (fences %d, %d)", name, l.Fence(), extra.Fence())
			default:
			}
			holder = l
		}
		check("first release", func() { require.NoError(t, holder.Unlock(ctx)) })
		check("second release", func() { require.NoError(t, holder.Unlock(ctx)) })

		// Positive control: waking every local waiter, as a broadcast would, is caught.
		before := attempts.n.Load()
		for _, c := range clients {
			c.hub.mu.Lock()
			c.hub.wakeAll()
			c.hub.mu.Unlock()
		}
		time.Sleep(100 * time.Millisecond)
		assert.Equal(t, int64(nLocks-2), attempts.n.Load()-before, "control: a broadcast wakes every waiter")

		for range nLocks - 2 { // the rest take the lock in turn, each woken by the one before
			require.NoError(t, holder.Unlock(ctx))
			holder = <-turn
		}
		require.NoError(t, holder.Unlock(ctx))
		wg.Wait()
		queued, err := b.admin.LLen(ctx, clients[0].redisKey(key)+waitSuffix).Result()
		require.NoError(t, err)
		assert.Zero(t, queued, "no waiter left queued")
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
		done := lockThenUnlock(c, key)
		waitForWaiters(t, b, c, key, 1)
		require.NoError(t, holder.Unlock(ctx))
		require.NoError(t, <-done)
		deadline := time.Now().Add(10 * time.Second)
		for time.Now().Before(deadline) {
			c.hub.mu.Lock()
			closed := c.hub.cur == nil && len(c.hub.waiters) == 0
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
		got := lockThenUnlock(c, key)
		waitForWaiters(t, b, c, key, 1)
		require.NoError(t, c.Close())
		require.NoError(t, c.Close(), "Close is idempotent")

		// A later waiter reopens the subscription for both keys' waiters.
		second := lockThenUnlock(c, key)
		waitForWaiters(t, b, c, key, 2)
		require.NoError(t, holder.Unlock(ctx))
		for _, ch := range []<-chan error{got, second} {
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

func TestReleaseSkipsWaiterNobodyHears(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		ctx := context.Background()
		key := uniqueKey(t)
		rkey := c.redisKey(key)
		holder, err := c.TryLock(ctx, key, time.Hour)
		require.NoError(t, err)
		got := lockThenUnlock(c, key)
		waitForWaiters(t, b, c, key, 1)
		// Waiters of a Client that died: first in line, and no one subscribed to
		// their channel. More of them than any fixed bound on a release's work.
		for i := range 40 {
			require.NoError(t, b.admin.LPush(ctx, rkey+waitSuffix, fmt.Sprintf("dead.%d 3600000 tok%d", i, i)).Err())
		}

		require.NoError(t, holder.Unlock(ctx))
		// The holder's lease was an hour: only a wake-up passed on past the dead waiter
		// lets the live one in.
		select {
		case err := <-got:
			require.NoError(t, err)
		case <-time.After(30 * time.Second):
			t.Fatal("the dead waiter swallowed the release")
		}
	})
}

// lockThenUnlock waits for key in the background (up to a minute), releases it at
// once, and reports the outcome.
func lockThenUnlock(c *Client, key string) <-chan error {
	got := make(chan error, 1)
	go func() {
		ctx := context.Background()
		l, err := c.Lock(ctx, key, time.Minute, MaxWait(time.Minute))
		if err == nil {
			err = l.Unlock(ctx)
		}
		got <- err
	}()
	return got
}
