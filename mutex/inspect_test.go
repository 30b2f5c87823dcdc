package mutex

import (
	"context"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
	"github.com/asynqmutex/asynqmutex/internal/store"
)

func TestInspectRecordsHolderAndWaiters(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		defer c.Close()
		ctx := context.Background()
		key := uniqueKey(t) + ":{odd}#%"

		free, err := c.Inspect(ctx, key)
		require.NoError(t, err)
		assert.False(t, free.Held)
		assert.Equal(t, key, free.Key, "the key decodes from the Redis key")

		l, err := c.TryLock(ctx, key, time.Minute, HeldBy("payment:capture", "task-1"))
		require.NoError(t, err)
		in, err := c.Inspect(ctx, key)
		require.NoError(t, err)
		host, _ := os.Hostname()
		assert.True(t, in.Held)
		assert.Equal(t, Holder{Name: "payment:capture", ID: "task-1", Host: host, PID: os.Getpid()}, in.Holder)
		assert.Equal(t, l.Fence(), in.Fence)
		assert.Equal(t, c.redisKey(key), in.RedisKey)
		assert.Greater(t, in.TTL, 50*time.Second)
		assert.WithinDuration(t, time.Now(), in.Since, 5*time.Second)
		assert.Less(t, in.HeldFor, 5*time.Second)

		// Two waiters queue in order, each with its own description.
		wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		defer cancel()
		var wg sync.WaitGroup
		got := make(chan *Lock, 2)
		for i, id := range []string{"task-2", "task-3"} {
			wg.Add(1)
			go func() {
				defer wg.Done()
				w, err := c.Lock(wctx, key, time.Minute, HeldBy("payment:capture", id))
				if err == nil {
					got <- w
				}
			}()
			waitForWaiters(t, b, c, key, i+1)
		}
		in, err = c.Inspect(ctx, key)
		require.NoError(t, err)
		require.Len(t, in.Waiters, 2)
		assert.Equal(t, "task-2", in.Waiters[0].ID)
		assert.Equal(t, "task-3", in.Waiters[1].ID)
		assert.Equal(t, os.Getpid(), in.Waiters[1].PID)

		// The release hands the lock to task-2, whose description the value now holds.
		require.NoError(t, l.Unlock(ctx))
		w := <-got
		in, err = c.Inspect(ctx, key)
		require.NoError(t, err)
		assert.Equal(t, "task-2", in.Holder.ID)
		assert.Equal(t, w.Fence(), in.Fence)
		assert.Equal(t, 1, in.Waiting)
		require.NoError(t, w.Unlock(ctx))
		require.NoError(t, (<-got).Unlock(ctx))
		wg.Wait()

		gone, err := c.Inspect(ctx, key)
		require.NoError(t, err)
		assert.False(t, gone.Held, "a tombstone is not held")
		assert.Zero(t, gone.TTL)
	})
}

func TestHeldByIsBounded(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		ctx := context.Background()
		key := uniqueKey(t)
		long := strings.Repeat("x", 5000)
		l, err := c.TryLock(ctx, key, time.Minute, HeldBy("a\tb\nc"+long, strings.Repeat("\xff", 99)))
		require.NoError(t, err)
		defer l.Unlock(ctx)
		in, err := c.Inspect(ctx, key)
		require.NoError(t, err)
		assert.LessOrEqual(t, len(in.Holder.Name), 100)
		assert.True(t, strings.HasPrefix(in.Holder.Name, "a b c"), in.Holder.Name)
		assert.LessOrEqual(t, len(in.Holder.ID), 100)
		v, err := b.admin.Get(ctx, c.redisKey(key)).Result()
		require.NoError(t, err)
		assert.Less(t, len(v), 400, "the value stays small")
		assert.NotContains(t, v, long)
	})
}

func TestListYieldsHeldLocks(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb, Prefix("asynqmutex:list"+newToken()[:6]+"*?:")) // glob characters are matched literally
		ctx := context.Background()
		keys := map[string]bool{}
		for i := range 450 { // more than one SCAN batch
			key := uniqueKey(t) + ":" + string(rune('a'+i%26)) + newToken()[:4]
			l, err := c.TryLock(ctx, key, time.Minute, HeldBy("t", ""))
			require.NoError(t, err)
			if i%3 == 0 {
				require.NoError(t, l.Unlock(ctx)) // tombstones are not listed
				continue
			}
			keys[key] = true
		}
		other := New(b.rdb, Prefix("asynqmutex:other:"))
		ol, err := other.TryLock(ctx, uniqueKey(t), time.Minute)
		require.NoError(t, err)
		defer ol.Unlock(ctx)

		seen := map[string]bool{}
		for in, err := range c.List(ctx) {
			require.NoError(t, err)
			assert.True(t, in.Held)
			assert.Equal(t, "t", in.Holder.Name)
			assert.Nil(t, in.Waiters)
			seen[in.Key] = true
		}
		assert.Equal(t, keys, seen)

		n := 0
		for range c.List(ctx) {
			if n++; n == 3 {
				break // stopping early is allowed
			}
		}
		assert.Equal(t, 3, n)
	})
}

func TestForceRelease(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		ctx := context.Background()
		key := uniqueKey(t)

		r, err := c.ForceRelease(ctx, key)
		require.NoError(t, err)
		assert.False(t, r.Before.Held, "nothing to release")
		assert.Zero(t, r.Fence)

		old, err := c.TryLock(ctx, key, time.Minute, HeldBy("stuck", "1"))
		require.NoError(t, err)
		r, err = c.ForceRelease(ctx, key)
		require.NoError(t, err)
		assert.True(t, r.Before.Held)
		assert.Equal(t, "stuck", r.Before.Holder.Name)
		assert.Equal(t, old.Fence(), r.Before.Fence)
		assert.Positive(t, r.Before.TTL)
		assert.Zero(t, r.Before.Waiting)
		assert.Zero(t, r.Fence, "nobody waited")
		assert.Zero(t, r.HandedTo)

		assert.ErrorIs(t, old.Extend(ctx, time.Minute), ErrNotHeld, "the old holder cannot extend")
		assert.ErrorIs(t, old.Unlock(ctx), ErrNotHeld, "nor release")
		next, err := c.TryLock(ctx, key, time.Minute)
		require.NoError(t, err, "the key is free")
		assert.Greater(t, next.Fence(), old.Fence())
		assert.ErrorIs(t, old.Unlock(ctx), ErrNotHeld, "the old holder cannot release the next one's lock")
		locked, err := c.Locked(ctx, key)
		require.NoError(t, err)
		assert.True(t, locked)
		require.NoError(t, next.Unlock(ctx))

		// A value set by hand is deleted.
		require.NoError(t, b.admin.Set(ctx, c.redisKey(key), "by hand", time.Minute).Err())
		r, err = c.ForceRelease(ctx, key)
		require.NoError(t, err)
		assert.True(t, r.Before.Held && r.Before.Foreign)
		locked, err = c.Locked(ctx, key)
		require.NoError(t, err)
		assert.False(t, locked)
	})
}

func TestForceReleaseHandsOver(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		defer c.Close()
		ctx := context.Background()
		key := uniqueKey(t)
		old, err := c.TryLock(ctx, key, time.Minute)
		require.NoError(t, err)

		wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		defer cancel()
		got := make(chan *Lock, 1)
		go func() {
			w, err := c.Lock(wctx, key, time.Minute, HeldBy("waiter", ""))
			assert.NoError(t, err)
			got <- w
		}()
		waitForWaiters(t, b, c, key, 1)

		r, err := c.ForceRelease(ctx, key)
		require.NoError(t, err)
		w := <-got
		require.NotNil(t, w)
		assert.Equal(t, 1, r.Before.Waiting)
		assert.Equal(t, w.Fence(), r.Fence, "handed to the waiter")
		assert.Equal(t, "waiter", r.HandedTo.Name)
		assert.Greater(t, w.Fence(), old.Fence())
		assert.ErrorIs(t, old.Extend(ctx, time.Minute), ErrNotHeld)
		assert.ErrorIs(t, old.Unlock(ctx), ErrNotHeld)
		require.NoError(t, w.Unlock(ctx))
	})
}

func TestListOnCluster(t *testing.T) {
	addrs := redistest.StartCluster(t, 3)
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs})
	t.Cleanup(func() { rdb.Close() })
	c := New(rdb)
	ctx := context.Background()
	want := map[string]bool{}
	for i := range 60 {
		key := uniqueKey(t) + ":" + strconv.Itoa(i)
		_, err := c.TryLock(ctx, key, time.Minute)
		require.NoError(t, err)
		want[key] = true
	}
	masters := map[string]bool{}
	for key := range want {
		addr, err := rdb.MasterForKey(ctx, c.redisKey(key))
		require.NoError(t, err)
		masters[addr.Options().Addr] = true
	}
	require.Greater(t, len(masters), 1, "the keys spread over several masters")

	got := map[string]bool{}
	n := 0 // yield is never called concurrently: the race detector watches n
	for in, err := range c.List(ctx) {
		require.NoError(t, err)
		n++
		got[in.Key] = true
	}
	assert.Equal(t, want, got)
	assert.Equal(t, len(want), n)
}

func TestKeysDecodeExactly(t *testing.T) {
	c := New(redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}))
	for range 50 { // an order-dependent decoding fails some of the time
		for _, key := range []string{"a%7Bb", "%2523", "{x}#%", "%%7D{%23}", "plain"} {
			got, digested := keyOf(c.prefix, c.redisKey(key))
			require.Equal(t, key, got)
			require.False(t, digested)
		}
	}
	long := strings.Repeat("%7B", 200)
	got, digested := keyOf(c.prefix, c.redisKey(long))
	assert.True(t, digested)
	assert.True(t, strings.HasPrefix(long, got), "the readable head of %q", got)
}

func TestForceReleaseIsALostLeaseForWithLock(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		for _, next := range []string{"nobody", "a newcomer"} {
			var r recorder
			c := New(b.rdb, Observe(r.observe))
			ctx := context.Background()
			key := uniqueKey(t)
			var newcomer *Lock
			err := c.WithLock(ctx, key, time.Minute, func(ctx context.Context) error {
				_, err := c.ForceRelease(ctx, key)
				require.NoError(t, err)
				if next == "a newcomer" {
					newcomer, err = c.TryLock(ctx, key, time.Minute)
					require.NoError(t, err)
				}
				return nil // fn ends well inside its lease, before any renewal
			})
			require.ErrorIs(t, err, ErrNotHeld, "then %s: the release learns of the force release", next)
			assert.ErrorContains(t, err, "released by force")
			got := ops(r.take())
			assert.Contains(t, got, OpLeaseLost, "then %s", next)
			assert.NotContains(t, got, OpReleased, "then %s", next)
			if newcomer != nil {
				require.NoError(t, newcomer.Unlock(ctx), "the newcomer's lock is untouched")
			}
		}
	})
}

func TestLockEndsOnce(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		var r recorder
		c := New(b.rdb, Observe(r.observe))
		ctx := context.Background()
		l, err := c.TryLock(ctx, uniqueKey(t), time.Minute)
		require.NoError(t, err)
		require.NoError(t, l.Unlock(ctx))
		require.NoError(t, l.Unlock(ctx), "a repeat finds its own tombstone")
		b.expire(t, c.redisKey(l.Key()))
		if b.real { // on miniredis the mark expired with the tombstone
			b.expire(t, releasedKey(c.redisKey(l.Key()), l.id))
		}
		assert.ErrorIs(t, l.Unlock(ctx), ErrNotHeld, "once tombstone and mark are gone")
		assert.Equal(t, []Op{OpAcquired, OpReleased}, ops(r.take()), "released once, never lost after")
	})
}

func TestReleaseDropsMalformedQueueEntries(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		ctx := context.Background()
		key := uniqueKey(t)
		l, err := c.TryLock(ctx, key, time.Minute)
		require.NoError(t, err)
		q := c.redisKey(key) + waitSuffix
		// Entries no plain_lock.lua writes: no lease, a zero, a negative and a word.
		for _, e := range []string{"x", "c.1 0 0003abc0000", "c.2 -5 0003abc0000", "c.3 soon 0003abc0000", "nodot 100 0003abc0000"} {
			require.NoError(t, b.admin.RPush(ctx, q, e).Err())
		}
		v, err := b.admin.Get(ctx, c.redisKey(key)).Result()
		require.NoError(t, err)
		require.NoError(t, b.admin.Set(ctx, c.redisKey(key), v[:16]+"w"+v[17:], time.Minute).Err())
		require.NoError(t, l.Unlock(ctx), "the release passes over what it cannot hand the lock to")
		n, err := b.admin.LLen(ctx, q).Result()
		require.NoError(t, err)
		assert.Zero(t, n)
		next, err := c.TryLock(ctx, key, time.Minute)
		require.NoError(t, err, "the lock is free")
		assert.Greater(t, next.Fence(), l.Fence())
		require.NoError(t, next.Unlock(ctx))
	})
}

func TestReleaseFailureIsObserved(t *testing.T) {
	c, hook, r, buf := observedFailingClient(t)
	err := c.WithLock(context.Background(), uniqueKey(t), time.Minute, func(context.Context) error {
		hook.on.Store(true)
		return nil
	}, HeldBy("pay", "t1"))
	require.Error(t, err)
	assert.NotErrorIs(t, err, ErrNotHeld)
	assert.Contains(t, buf.String(), "level=WARN msg=\"mutex: releasing a lock got no answer; trying again")
	assert.Contains(t, buf.String(), "name=pay id=t1")
	// The release is tried again once Redis answers, and that is observed too.
	hook.on.Store(false)
	assert.Equal(t, []Op{OpAcquired, OpReleaseFailed, OpReleased}, ops(r.waitFor(t, OpReleased)))
}

func TestForceReleaseRetriedAfterLostReply(t *testing.T) {
	// The force release's reply is lost and go-redis sends it again: the repeat must
	// recognise its own work, not force-release the waiter the lock was handed to,
	// nor report that nobody held the key.
	rdb, p, _, c := throughProxy(t)
	direct := New(rdb)
	defer direct.Close()
	ctx := context.Background()
	// Loaded, so that the dropped reply is the script's, not a NOSCRIPT that makes
	// go-redis send EVAL (then the script runs once, and nothing is repeated).
	require.NoError(t, store.New(rdb).Load(ctx, plainForceScript))
	for _, waiting := range []bool{false, true} {
		key := uniqueKey(t)
		old, err := direct.TryLock(ctx, key, time.Minute)
		require.NoError(t, err)
		got := make(chan *Lock, 1)
		if waiting {
			go func() {
				w, err := direct.Lock(ctx, key, time.Minute, MaxWait(20*time.Second))
				assert.NoError(t, err)
				got <- w
			}()
			waitForWaiters(t, backend{admin: rdb}, direct, key, 1)
		}
		dropped := p.Dropped()
		p.DropReplies(1)
		r, err := c.ForceRelease(ctx, key)
		require.NoError(t, err, "waiting %v", waiting)
		assert.Equal(t, dropped+1, p.Dropped(), "a reply was dropped")
		assert.True(t, r.Repeated, "waiting %v: the retry found its own release", waiting)
		assert.ErrorIs(t, old.Extend(ctx, time.Minute), ErrNotHeld)
		if waiting {
			w := <-got
			require.NotNil(t, w)
			require.NoError(t, w.Extend(ctx, time.Minute), "the waiter's lock survives the repeat")
			require.NoError(t, w.Unlock(ctx))
		}
	}
}
