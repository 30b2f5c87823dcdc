package mutex

import (
	"context"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
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
		if b.real { // miniredis's TIME is the wall clock too, but not its TTLs
			assert.WithinDuration(t, time.Now(), in.Since, 5*time.Second)
		}

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
		l, err := c.TryLock(ctx, key, time.Minute, HeldBy("a\tb\nc"+long, long))
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

		before, to, err := c.ForceRelease(ctx, key)
		require.NoError(t, err)
		assert.False(t, before.Held, "nothing to release")
		assert.Zero(t, to)

		old, err := c.TryLock(ctx, key, time.Minute, HeldBy("stuck", "1"))
		require.NoError(t, err)
		before, to, err = c.ForceRelease(ctx, key)
		require.NoError(t, err)
		assert.True(t, before.Held)
		assert.Equal(t, "stuck", before.Holder.Name)
		assert.Equal(t, old.Fence(), before.Fence)
		assert.Zero(t, to, "nobody waited")

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
		before, _, err = c.ForceRelease(ctx, key)
		require.NoError(t, err)
		assert.True(t, before.Held && before.Foreign)
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

		_, to, err := c.ForceRelease(ctx, key)
		require.NoError(t, err)
		w := <-got
		require.NotNil(t, w)
		assert.Equal(t, w.Fence(), to, "handed to the waiter")
		assert.Greater(t, w.Fence(), old.Fence())
		assert.ErrorIs(t, old.Extend(ctx, time.Minute), ErrNotHeld)
		assert.ErrorIs(t, old.Unlock(ctx), ErrNotHeld)
		require.NoError(t, w.Unlock(ctx))
	})
}
