package mutex

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
	"github.com/asynqmutex/asynqmutex/internal/store"
)

// The tests in this file each pin down a way the wait and lease protocol once
// failed under a fault, against a real redis-server.

// realBackend is the shared redis-server as a backend for helpers such as
// waitForWaiters.
func realBackend(t *testing.T) backend {
	rdb := sharedServer(t)
	return backend{rdb: rdb, admin: rdb, real: true}
}

func TestLostReleaseReplyWithWaiterIsNotALostLease(t *testing.T) {
	// The release hands the lock to a queued waiter; its reply is lost and go-redis
	// sends it again, when the waiter already holds the key. fn ran under a valid
	// lease: WithLock must not report ErrNotHeld, and the waiter keeps the lock.
	b := realBackend(t)
	_, p, _, c := throughProxy(t)
	other := New(b.rdb)
	ctx := context.Background()
	key := uniqueKey(t)

	got := make(chan *Lock, 1)
	err := c.WithLock(ctx, key, time.Minute, func(context.Context) error {
		go func() {
			l, err := other.Lock(ctx, key, time.Minute, MaxWait(time.Minute))
			assert.NoError(t, err)
			got <- l
		}()
		waitForWaiters(t, b, other, key, 1)
		p.DropReplies(1) // the release's reply, after fn returns
		return nil
	})
	require.NoError(t, err, "a repeated release that finds the key handed on is not a lost lease")
	assert.Equal(t, 1, p.Dropped(), "a reply was dropped")
	l := <-got
	require.NotNil(t, l)
	_, err = l.TTL(ctx)
	assert.NoError(t, err, "the waiter holds the lock the release handed it")
	require.NoError(t, l.Unlock(ctx))
}

func TestFencesSurviveRestore(t *testing.T) {
	// A snapshot taken, two more locks, a restart that loads the snapshot: the
	// first fence after it must exceed every fence issued before.
	s := redistest.Start(t)
	rdb := s.Client(t)
	c := New(rdb)
	ctx := context.Background()
	key := uniqueKey(t)
	lockOnce := func() int64 {
		l, err := c.TryLock(ctx, key, time.Minute)
		require.NoError(t, err)
		require.NoError(t, l.Unlock(ctx))
		return l.Fence()
	}
	lockOnce()
	held, err := c.TryLock(ctx, key, time.Minute) // in the snapshot as held
	require.NoError(t, err)
	require.NoError(t, rdb.Save(ctx).Err())
	require.NoError(t, held.Unlock(ctx))
	var last int64
	for range 2 {
		last = lockOnce()
	}
	s.Restart(t)
	v, err := rdb.Get(ctx, c.redisKey(key)).Result()
	require.NoError(t, err, "control: the restart restored the snapshot")
	require.True(t, strings.HasPrefix(v[idAt:], identity(held.Token())), "control: the snapshot's holder is back: %q", v)

	// The restored holder releases, and the next holder's fence still exceeds all.
	require.NoError(t, held.Unlock(ctx))
	after := lockOnce()
	assert.Greater(t, after, last, "fence after the restore")

	// A restart without the snapshot loses the key altogether: still higher.
	require.NoError(t, rdb.FlushAll(ctx).Err())
	assert.Greater(t, lockOnce(), after, "fence after the key was lost")
}

func TestWaiterCancelledAsHandedOverPassesItOn(t *testing.T) {
	// The first waiter's context ends as the release hands it the lock: the lock
	// must reach the second waiter at once, not after the first's hour-long lease.
	b := realBackend(t)
	c := New(b.rdb)
	ctx := context.Background()
	for trial := range 6 {
		key := fmt.Sprintf("%s:%d", uniqueKey(t), trial)
		holder, err := c.TryLock(ctx, key, time.Hour)
		require.NoError(t, err)
		first, cancel := context.WithCancel(ctx)
		firstDone := make(chan error, 1)
		go func() {
			_, err := c.Lock(first, key, time.Hour)
			firstDone <- err
		}()
		waitForWaiters(t, b, c, key, 1)
		second := lockThenUnlock(c, key)
		waitForWaiters(t, b, c, key, 2)

		// Cancel and release as close together as the scheduler allows, in either order.
		go func() {
			time.Sleep(time.Duration(rand.N(300)) * time.Microsecond)
			cancel()
		}()
		time.Sleep(time.Duration(rand.N(300)) * time.Microsecond)
		require.NoError(t, holder.Unlock(ctx))
		if err := <-firstDone; err != nil {
			assert.ErrorIs(t, err, context.Canceled)
		} else {
			// It took the lock before the cancel: it holds it for an hour, so the
			// second waiter's wait says nothing. Release it by hand.
			require.NoError(t, b.admin.Del(ctx, c.redisKey(key)).Err())
			continue
		}
		select {
		case err := <-second:
			require.NoError(t, err, "trial %d", trial)
		case <-time.After(20 * time.Second):
			t.Fatalf("trial %d: the cancelled waiter swallowed the hand-over", trial)
		}
	}
}

func TestSilentlyDeadSubscriptionIsReplaced(t *testing.T) {
	// The waiter's subscription connection dies without a reset: Redis still counts
	// it as a subscriber, so the release hands the lock to a waiter that does not
	// hear. The Client must notice within its health-check bound, subscribe again,
	// and the waiter find that it holds the lock.
	b := realBackend(t)
	p := redistest.NewProxy(t, b.rdb.Options().Addr)
	via := redis.NewClient(&redis.Options{Addr: p.Addr()})
	t.Cleanup(func() { via.Close() })
	c := New(via)
	ctx := context.Background()
	key := uniqueKey(t)
	holder, err := New(b.rdb).TryLock(ctx, key, time.Hour)
	require.NoError(t, err)
	got := lockThenUnlock(c, key)
	waitForWaiters(t, b, c, key, 1)
	require.Equal(t, 1, p.FreezeSubscribers(), "the subscription connection")
	freeze := time.Now()
	require.NoError(t, holder.Unlock(ctx))
	select {
	case err := <-got:
		require.NoError(t, err)
		// A correctness bound, not a speed figure: 2 health intervals plus a reconnect.
		assert.Less(t, time.Since(freeze), 3*store.HealthEvery+2*time.Second, "noticed within the documented bound")
	case <-time.After(30 * time.Second):
		t.Fatal("the waiter never learned it was handed the lock")
	}
}

func TestWaitersRequeuedBeforeResubscribeAreHandedTheLock(t *testing.T) {
	// After a restart without persistence the waiter's attempt queues it again
	// before its Client has subscribed again; a release in that gap passes it over.
	// When the subscription is confirmed, the waiter must try again.
	s := redistest.Start(t)
	rdb := s.Client(t)
	admin := backend{rdb: rdb, admin: rdb, real: true}
	ctx := context.Background()
	for trial := range 8 {
		c := New(rdb)
		key := fmt.Sprintf("%s:%d", uniqueKey(t), trial)
		holder := New(rdb)
		_, err := holder.TryLock(ctx, key, time.Hour)
		require.NoError(t, err)
		got := lockThenUnlock(c, key)
		waitForWaiters(t, admin, c, key, 1)
		s.Restart(t)
		// Someone takes the key again at once and releases it as soon as the waiter
		// has queued again, whether or not its Client has subscribed again.
		var l *Lock
		for i := 0; i < 1000 && l == nil; i++ {
			l, err = holder.TryLock(ctx, key, time.Hour)
			if err != nil {
				time.Sleep(time.Millisecond)
			}
		}
		require.NotNil(t, l, "trial %d: took the key after the restart: %v", trial, err)
		for i := 0; i < 10000; i++ {
			if n, _ := rdb.LLen(ctx, c.redisKey(key)+waitSuffix).Result(); n > 0 {
				break
			}
			time.Sleep(time.Millisecond)
		}
		require.NoError(t, l.Unlock(ctx))
		released := time.Now()
		select {
		case err := <-got:
			require.NoError(t, err, "trial %d", trial)
			t.Logf("trial %d: the waiter had the lock %v after the release", trial, time.Since(released))
		case <-time.After(20 * time.Second):
			t.Fatalf("trial %d: the waiter was never handed the lock", trial)
		}
		require.NoError(t, c.Close())
	}
}

func TestLeaseBounds(t *testing.T) {
	m := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	defer rdb.Close()
	c := New(rdb)
	ctx := context.Background()
	for _, ttl := range []time.Duration{time.Millisecond, 3 * time.Millisecond, MinTTL - time.Millisecond, MaxTTL + time.Millisecond, math.MaxInt64} {
		_, err := c.TryLock(ctx, "k", ttl)
		require.Error(t, err, "ttl %v", ttl)
		assert.Contains(t, err.Error(), MinTTL.String(), "the error names the bound")
		assert.Contains(t, err.Error(), MaxTTL.String(), "the error names the bound")
		err = c.WithLock(ctx, "k", ttl, func(context.Context) error { return errors.New("ran") })
		assert.NotContains(t, fmt.Sprint(err), "ran", "fn must not run under an unkeepable lease")
	}
	l, err := c.TryLock(ctx, "k", MinTTL)
	require.NoError(t, err)
	assert.Error(t, l.Extend(ctx, time.Millisecond))
	assert.Error(t, l.Extend(ctx, math.MaxInt64))
	require.NoError(t, l.Extend(ctx, MaxTTL))

	// A key set by hand with an enormous expiry: a waiter must sleep, not spin.
	for _, pttl := range []time.Duration{-1, 0, time.Millisecond, MaxTTL, MaxTTL + 1, math.MaxInt64} {
		d := (&acquisition{}).retryAfter(pttl)
		assert.True(t, d > 0 && d <= MaxTTL+MaxTTL/8+time.Millisecond, "retryAfter(%v) = %v", pttl, d)
	}
}

func TestWithLockKeepsTheShortestLease(t *testing.T) {
	// MinTTL is a lease WithLock can keep: fn runs for several leases uncancelled.
	b := realBackend(t)
	c := New(b.rdb)
	err := c.WithLock(context.Background(), uniqueKey(t), MinTTL, func(ctx context.Context) error {
		select {
		case <-ctx.Done():
			return context.Cause(ctx)
		case <-time.After(5 * MinTTL):
			return nil
		}
	})
	require.NoError(t, err)
}

func TestFairHandOver(t *testing.T) {
	// Goroutines of two Clients lock one key in a loop. Waiters are served in the
	// order they queued and a releaser that comes straight back queues behind
	// them, so every goroutine gets a fair share in every round.
	b := realBackend(t)
	clients := []*Client{New(b.rdb), New(b.rdb)}
	const workers, rounds, per = 8, 3, 200
	for round := range rounds {
		key := fmt.Sprintf("%s:%d", uniqueKey(t), round)
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		var (
			mu     sync.Mutex
			counts [workers]int
			total  int
			wg     sync.WaitGroup
		)
		for i := range workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					l, err := clients[i%2].Lock(ctx, key, 10*time.Second)
					if err != nil {
						assert.ErrorIs(t, err, context.DeadlineExceeded)
						return
					}
					mu.Lock()
					done := total >= workers*per
					if !done {
						counts[i]++
						total++
					}
					mu.Unlock()
					assert.NoError(t, l.Unlock(ctx))
					if done {
						return
					}
				}
			}()
		}
		wg.Wait()
		cancel()
		lo, hi := counts[0], counts[0]
		for _, n := range counts {
			lo, hi = min(lo, n), max(hi, n)
		}
		t.Logf("round %d: acquisitions per goroutine %v", round, counts)
		assert.GreaterOrEqual(t, float64(lo), 0.4*float64(hi), "round %d: fewest %d, most %d", round, lo, hi)
		checkLeftovers(t, b.admin, clients[0], key)
	}
}

// checkLeftovers checks that key has no queue entry left and that every Redis key
// of it has a TTL.
func checkLeftovers(t *testing.T, admin *redis.Client, c *Client, key string) {
	t.Helper()
	ctx := context.Background()
	rkey := c.redisKey(key)
	n, err := admin.LLen(ctx, rkey+waitSuffix).Result()
	require.NoError(t, err)
	assert.Zero(t, n, "queue entries outlived their waiters")
	for _, k := range []string{rkey, rkey + waitSuffix} {
		d, err := admin.PTTL(ctx, k).Result()
		require.NoError(t, err)
		assert.NotEqual(t, time.Duration(-1), d, "%s has no TTL", k)
	}
}

func TestHandOverToCutOffWaiterFreesSoon(t *testing.T) {
	// A WithLock waiter is cut off from Redis (its network silently gone) just as the
	// lock is handed to it: the hand-over's short lease frees the key within
	// renewedHandOver, not after the waiter's hour-long ttl.
	b := realBackend(t)
	p := redistest.NewProxy(t, b.rdb.Options().Addr)
	via := redis.NewClient(&redis.Options{Addr: p.Addr(), MaxRetries: -1})
	t.Cleanup(func() { via.Close() })
	cut := New(via)
	direct := New(b.rdb)
	ctx := context.Background()
	key := uniqueKey(t)
	holder, err := direct.TryLock(ctx, key, time.Hour)
	require.NoError(t, err)
	wctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		done <- cut.WithLock(wctx, key, time.Hour, func(context.Context) error { return nil })
	}()
	waitForWaiters(t, b, cut, key, 1)
	p.Blackhole(true)
	require.NoError(t, holder.Unlock(ctx))
	v, err := b.admin.Get(ctx, direct.redisKey(key)).Result()
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(v[idAt:], cut.hub.waiterIdentity(t)), "control: the lock was handed to the cut-off waiter: %q", v)
	start := time.Now()
	l, err := direct.Lock(ctx, key, time.Minute, MaxWait(10*time.Second))
	require.NoError(t, err, "the key must free once the hand-over's short lease ends")
	// A correctness bound, not a speed figure: the short lease plus the waiter's retry.
	assert.Less(t, time.Since(start), renewedHandOver+2*time.Second)
	require.NoError(t, l.Unlock(ctx))
	cancel()
	p.Blackhole(false)
	<-done
}

func TestHandOverToWithLockKeepsTheLease(t *testing.T) {
	// The short lease of a hand-over to a WithLock waiter is lengthened by its first
	// renewal: fn keeps the lock for many times that lease.
	b := realBackend(t)
	c := New(b.rdb)
	ctx := context.Background()
	key := uniqueKey(t)
	holder, err := c.TryLock(ctx, key, time.Hour)
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() {
		done <- c.WithLock(ctx, key, 3*time.Second, func(fctx context.Context) error {
			select {
			case <-fctx.Done():
				return context.Cause(fctx)
			case <-time.After(4 * renewedHandOver):
			}
			_, err := c.TryLock(ctx, key, time.Second)
			if !errors.Is(err, ErrNotObtained) {
				return fmt.Errorf("another TryLock = %v, want ErrNotObtained", err)
			}
			return nil
		})
	}()
	waitForWaiters(t, b, c, key, 1)
	require.NoError(t, holder.Unlock(ctx))
	require.NoError(t, <-done)
}

// waiterIdentity is the identity of the one waiter of h.
func (h *hub) waiterIdentity(t *testing.T) string {
	h.mu.Lock()
	defer h.mu.Unlock()
	require.Len(t, h.waiters, 1)
	for _, w := range h.waiters {
		return w.a.id
	}
	return ""
}
