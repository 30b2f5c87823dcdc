package mutex

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
)

func TestTryLockKeysAllOrNothing(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		ctx := context.Background()
		k := uniqueKey(t)
		a, bk, cc := k+":a", k+":b", k+":c"

		held, err := c.TryLock(ctx, bk, time.Minute)
		require.NoError(t, err)
		_, err = c.TryLockKeys(ctx, []string{a, bk, cc}, time.Minute)
		require.ErrorIs(t, err, ErrNotObtained)
		busy, ok := BusyKey(err)
		assert.True(t, ok)
		assert.Equal(t, bk, busy, "the error names the busy key")
		assert.Contains(t, err.Error(), bk)
		for _, key := range []string{a, cc} {
			locked, err := c.Locked(ctx, key)
			require.NoError(t, err)
			assert.False(t, locked, "%s must not stay taken when %s is busy", key, bk)
		}
		f0 := held.Fence()
		require.NoError(t, held.Unlock(ctx))

		l, err := c.TryLockKeys(ctx, []string{cc, a, bk, a}, time.Minute)
		require.NoError(t, err)
		assert.Equal(t, []string{cc, a, bk}, l.Keys(), "the caller's order, without repeats")
		fences := l.Fences()
		require.Len(t, fences, 3)
		assert.Equal(t, fences[0], l.Fence(), "Fence is the first key's")
		assert.Greater(t, fences[2], f0, "the fence of %s is above its earlier holder's", bk)
		for _, key := range []string{a, bk, cc} {
			_, err := c.TryLock(ctx, key, time.Minute)
			assert.ErrorIs(t, err, ErrNotObtained, "%s is held by the set", key)
		}
		_, err = c.TryLockKeys(ctx, []string{a, k + ":d"}, time.Minute)
		assert.ErrorIs(t, err, ErrNotObtained, "an overlapping set is excluded")

		ttl, err := l.TTL(ctx)
		require.NoError(t, err)
		assert.Greater(t, ttl, 50*time.Second)
		require.NoError(t, l.Extend(ctx, 2*time.Minute))
		ttl, err = l.TTL(ctx)
		require.NoError(t, err)
		assert.Greater(t, ttl, 110*time.Second, "Extend renews every key")

		require.NoError(t, l.Unlock(ctx))
		for _, key := range []string{a, bk, cc} {
			locked, err := c.Locked(ctx, key)
			require.NoError(t, err)
			assert.False(t, locked, "%s is free after Unlock", key)
		}
		require.NoError(t, l.Unlock(ctx), "a repeated release is recognised")
		_, err = l.TTL(ctx)
		assert.ErrorIs(t, err, ErrNotHeld)
	})
}

func TestLockKeysInputs(t *testing.T) {
	c := New(redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}))
	ctx := context.Background()
	_, err := c.TryLockKeys(ctx, nil, time.Second)
	assert.ErrorContains(t, err, "no key")
	_, err = c.LockKeys(ctx, []string{"a", ""}, time.Second)
	assert.ErrorContains(t, err, "empty key")
	_, err = c.TryLockKeys(ctx, []string{"a", "b"}, time.Millisecond)
	assert.ErrorContains(t, err, "outside")
	assert.ErrorContains(t, err, `keys a, b:`)
	assert.Error(t, c.WithLockKeys(ctx, []string{"a"}, time.Second, nil))
}

func TestLockKeysWokenByRelease(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		ctx := context.Background()
		k := uniqueKey(t)
		a, bk := k+":a", k+":b"
		const lease = time.Minute // a waiter that is not woken waits this long

		ha, err := c.TryLock(ctx, a, lease)
		require.NoError(t, err)
		hb, err := c.TryLock(ctx, bk, lease)
		require.NoError(t, err)
		got := make(chan *Lock, 1)
		go func() {
			l, err := c.LockKeys(ctx, []string{bk, a}, lease, MaxWait(20*time.Second))
			assert.NoError(t, err)
			got <- l
		}()
		waitQueued(t, b.admin, c.redisKey(a))
		require.NoError(t, ha.Unlock(ctx))
		// Handed a, the waiter keeps it while it waits for b.
		waitQueued(t, b.admin, c.redisKey(bk))
		select {
		case <-got:
			t.Fatal("obtained while b is held")
		default:
		}
		start := time.Now()
		require.NoError(t, hb.Unlock(ctx))
		select {
		case l := <-got:
			assert.Less(t, time.Since(start), 5*time.Second, "woken by the release, not by the lease")
			assert.Len(t, l.Fences(), 2)
			require.NoError(t, l.Unlock(ctx))
		case <-time.After(20 * time.Second):
			t.Fatal("the waiter was not handed the keys")
		}
	})
}

// waitQueued waits until someone is queued on the lock whose Redis key is rkey (as a
// plain lock or with Limit(n)).
func waitQueued(t *testing.T, admin redis.Cmdable, rkey string) {
	t.Helper()
	require.Eventually(t, func() bool {
		n, err := admin.LLen(context.Background(), rkey+waitSuffix).Result()
		m, err2 := admin.LLen(context.Background(), rkey+slotsSuffix).Result()
		return err == nil && err2 == nil && n+m > 0
	}, 10*time.Second, 5*time.Millisecond, "nobody queued on %s", rkey)
}

func TestLockKeysGivingUpReleasesWhatItKept(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		ctx := context.Background()
		k := uniqueKey(t)
		a, bk := k+":a", k+":b"
		hb, err := c.TryLock(ctx, bk, time.Minute)
		require.NoError(t, err)
		wctx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() {
			_, err := c.LockKeys(wctx, []string{a, bk}, time.Minute)
			done <- err
		}()
		waitQueued(t, b.admin, c.redisKey(bk))
		locked, err := c.Locked(ctx, a)
		require.NoError(t, err)
		assert.True(t, locked, "the waiter keeps a, the key before the busy one")
		cancel()
		select {
		case err := <-done:
			assert.ErrorIs(t, err, ErrNotObtained)
			assert.ErrorIs(t, err, context.Canceled)
			busy, _ := BusyKey(err)
			assert.Equal(t, bk, busy)
		case <-time.After(10 * time.Second):
			t.Fatal("LockKeys did not return on cancel")
		}
		locked, err = c.Locked(ctx, a)
		require.NoError(t, err)
		assert.False(t, locked, "a waiter that gives up releases what it kept")
		n, err := b.admin.LLen(ctx, c.redisKey(bk)+waitSuffix).Result()
		require.NoError(t, err)
		assert.Zero(t, n, "and leaves the queue")
		require.NoError(t, hb.Unlock(ctx))
	})
}

func TestWithLockKeysRenewsAndCancelsOnAnyLoss(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		if !b.real {
			t.Skip("renewal against the clock needs a server whose time passes")
		}
		c := New(b.rdb)
		ctx := context.Background()
		k := uniqueKey(t)
		keys := []string{k + ":a", k + ":b", k + ":c"}
		const ttl = 300 * time.Millisecond
		err := c.WithLockKeys(ctx, keys, ttl, func(ctx context.Context) error {
			time.Sleep(3 * ttl)
			for _, key := range keys {
				locked, err := c.Locked(ctx, key)
				require.NoError(t, err)
				assert.True(t, locked, "%s renewed past its first lease", key)
			}
			l, ok := FromContext(ctx)
			require.True(t, ok)
			assert.Len(t, l.Fences(), 3)
			return nil
		})
		require.NoError(t, err)

		fnErr := errors.New("fn saw the cancellation")
		err = c.WithLockKeys(ctx, keys, ttl, func(fctx context.Context) error {
			require.NoError(t, b.admin.Del(ctx, c.redisKey(keys[1])).Err())
			select {
			case <-fctx.Done():
				assert.ErrorIs(t, context.Cause(fctx), ErrNotHeld)
				return fnErr
			case <-time.After(30 * time.Second):
				return errors.New("not cancelled")
			}
		})
		assert.ErrorIs(t, err, ErrNotHeld, "losing one key loses the lock")
		assert.ErrorIs(t, err, fnErr)
		for _, key := range keys {
			locked, err := c.Locked(ctx, key)
			require.NoError(t, err)
			assert.False(t, locked, "%s released", key)
		}
	})
}

// TestLockKeysNeverDeadlock takes random overlapping sets in random orders from
// several goroutines: every call must complete, and no key may have two holders.
func TestLockKeysNeverDeadlock(t *testing.T) {
	t.Run("redis-server", func(t *testing.T) {
		crossingSets(t, New(sharedServer(t)))
	})
	t.Run("cluster", func(t *testing.T) {
		rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: redistest.StartCluster(t, 3)})
		t.Cleanup(func() { rdb.Close() })
		crossingSets(t, New(rdb))
	})
}

func crossingSets(t *testing.T, c *Client) {
	k := uniqueKey(t)
	keys := []string{k + ":0", k + ":1", k + ":2", k + ":3", k + ":4"}
	var (
		mu       sync.Mutex
		inside   = map[string]int{}
		overlaps int
	)
	const workers, rounds = 8, 25
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, workers*rounds)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(w), 1))
			for range rounds {
				set := append([]string(nil), keys...)
				r.Shuffle(len(set), func(i, j int) { set[i], set[j] = set[j], set[i] })
				set = set[:2+r.IntN(3)]
				err := c.WithLockKeys(ctx, set, 5*time.Second, func(context.Context) error {
					mu.Lock()
					for _, key := range set {
						inside[key]++
						if inside[key] > 1 {
							overlaps++
						}
					}
					mu.Unlock()
					time.Sleep(time.Duration(r.IntN(2000)) * time.Microsecond)
					mu.Lock()
					for _, key := range set {
						inside[key]--
					}
					mu.Unlock()
					return nil
				})
				if err != nil {
					errs <- fmt.Errorf("set %q: %w", set, err)
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err) // a deadlock shows as the context's deadline
	}
	assert.Zero(t, overlaps, "sections overlapped on a key")
}

func TestLockKeysOnCluster(t *testing.T) {
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: redistest.StartCluster(t, 3)})
	t.Cleanup(func() { rdb.Close() })
	c := New(rdb)
	ctx := context.Background()
	k := uniqueKey(t)
	var keys []string
	masters := map[string]bool{}
	for i := 0; len(masters) < 2 || len(keys) < 4; i++ {
		require.Less(t, i, 100)
		key := fmt.Sprintf("%s:%d", k, i)
		addr, err := rdb.MasterForKey(ctx, c.redisKey(key))
		require.NoError(t, err)
		masters[addr.Options().Addr] = true
		keys = append(keys, key)
	}
	held, err := c.TryLock(ctx, keys[len(keys)-1], time.Minute)
	require.NoError(t, err)
	_, err = c.TryLockKeys(ctx, keys, time.Minute)
	require.ErrorIs(t, err, ErrNotObtained)
	for _, key := range keys[:len(keys)-1] {
		locked, err := c.Locked(ctx, key)
		require.NoError(t, err)
		assert.False(t, locked, "%s given back", key)
	}
	require.NoError(t, held.Unlock(ctx))
	l, err := c.TryLockKeys(ctx, keys, time.Minute)
	require.NoError(t, err, "keys on %d masters", len(masters))
	require.NoError(t, l.Extend(ctx, time.Minute))
	_, err = l.TTL(ctx)
	require.NoError(t, err)
	require.NoError(t, l.Unlock(ctx))
	for _, key := range keys {
		locked, err := c.Locked(ctx, key)
		require.NoError(t, err)
		assert.False(t, locked)
	}
}

func TestLockKeysLostReplyDoesNotLeak(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		hook := &loseReply{}
		b.rdb.AddHook(hook)
		c := New(b.rdb)
		ctx := context.Background()
		k := uniqueKey(t)
		keys := []string{k + ":a", k + ":b"}
		hook.n.Store(1)
		_, err := c.TryLockKeys(ctx, keys, time.Hour)
		require.Error(t, err)
		assert.NotErrorIs(t, err, ErrNotObtained)
		for _, key := range keys {
			locked, err := c.Locked(ctx, key)
			require.NoError(t, err)
			assert.False(t, locked, "%s must not stay held for its hour", key)
		}
	})
}

// TestLockKeysGivesBackWhatFollowsALostKey: a waiter that kept a and waits for b
// loses a (its lease ran out, someone took it). Handed b meanwhile, it must not keep
// b while it waits for a again: a set holding a could be waiting for b.
func TestLockKeysGivesBackWhatFollowsALostKey(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		ctx := context.Background()
		k := uniqueKey(t)
		a, bk := k+":a", k+":b"
		hb, err := c.TryLock(ctx, bk, 3*time.Minute) // outlives a's lease on miniredis's clock
		require.NoError(t, err)
		got := make(chan error, 1)
		go func() {
			l, err := c.LockKeys(ctx, []string{a, bk}, time.Minute, MaxWait(20*time.Second))
			if err == nil {
				err = l.Unlock(ctx)
			}
			got <- err
		}()
		waitQueued(t, b.admin, c.redisKey(bk)) // it keeps a and waits for b
		// a's lease runs out and someone takes it. The waiter may take a again first
		// (it tries again once its subscription is confirmed): then again.
		var ha *Lock
		for i := 0; ha == nil; i++ {
			require.Less(t, i, 50, "a could not be taken from the waiter")
			b.expire(t, c.redisKey(a))
			ha, err = c.TryLock(ctx, a, 2*time.Minute)
			if !errors.Is(err, ErrNotObtained) {
				require.NoError(t, err)
			}
		}
		require.NoError(t, hb.Unlock(ctx)) // b is handed to the waiter
		require.Eventually(t, func() bool {
			locked, err := c.Locked(ctx, bk)
			return err == nil && !locked
		}, 10*time.Second, 5*time.Millisecond, "the waiter keeps b while it waits for a, which another holder has")
		require.NoError(t, ha.Unlock(ctx))
		select {
		case err := <-got:
			require.NoError(t, err, "the waiter gets both once a is free")
		case <-time.After(20 * time.Second):
			t.Fatal("the waiter was not handed a")
		}
	})
}

// TestLimitOnCluster: a lock with Limit(n) keeps its holders, queue and release marks
// in one hash slot, so it works in Redis Cluster as on one server.
func TestLimitOnCluster(t *testing.T) {
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: redistest.StartCluster(t, 3)})
	t.Cleanup(func() { rdb.Close() })
	c := New(rdb)
	t.Cleanup(func() { c.Close() })
	ctx := context.Background()
	key := uniqueKey(t)
	a, err := c.TryLock(ctx, key, time.Minute, Limit(2))
	require.NoError(t, err)
	b, err := c.TryLock(ctx, key, time.Minute, Limit(2))
	require.NoError(t, err)
	assert.Greater(t, b.Fence(), a.Fence())
	_, err = c.TryLock(ctx, key, time.Minute, Limit(2))
	require.ErrorIs(t, err, ErrNotObtained)
	got := make(chan error, 1)
	go func() {
		l, err := c.Lock(ctx, key, time.Minute, Limit(2), MaxWait(20*time.Second))
		if err == nil {
			err = l.Unlock(ctx)
		}
		got <- err
	}()
	waitQueued(t, rdb, c.redisKey(key))
	require.NoError(t, a.Extend(ctx, time.Minute))
	require.NoError(t, a.Unlock(ctx))
	select {
	case err := <-got:
		require.NoError(t, err, "the freed slot is handed to the waiter")
	case <-time.After(20 * time.Second):
		t.Fatal("the waiter was not handed the slot")
	}
	require.NoError(t, b.Unlock(ctx))
	require.NoError(t, a.Unlock(ctx), "a repeated release is recognised")
}

// TestWaitingSetRenewsKeptKeys: a set that waits for b longer than its lease keeps a
// all the while: its attempts come back within a third of the lease and renew it.
func TestWaitingSetRenewsKeptKeys(t *testing.T) {
	rdb := sharedServer(t)
	c := New(rdb)
	t.Cleanup(func() { c.Close() })
	ctx := context.Background()
	k := uniqueKey(t)
	a, bk := k+":a", k+":b"
	const ttl = time.Second // renewed every third: slack for a loaded machine
	hb, err := c.TryLock(ctx, bk, time.Minute)
	require.NoError(t, err)
	got := make(chan error, 1)
	go func() {
		l, err := c.LockKeys(ctx, []string{a, bk}, ttl, HeldBy("set", "w"), MaxWait(20*time.Second))
		if err == nil {
			err = l.Unlock(ctx)
		}
		got <- err
	}()
	waitQueued(t, rdb, c.redisKey(bk))
	for range 6 { // three leases
		time.Sleep(ttl / 2)
		in, err := c.Inspect(ctx, a)
		require.NoError(t, err)
		require.True(t, in.Held, "the waiting set lost a, which it keeps while it waits for b")
		assert.Equal(t, "w", in.Holder.ID)
	}
	require.NoError(t, hb.Unlock(ctx))
	select {
	case err := <-got:
		require.NoError(t, err)
	case <-time.After(20 * time.Second):
		t.Fatal("the set was not handed b")
	}
}
