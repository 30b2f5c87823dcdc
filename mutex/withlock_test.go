package mutex

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
)

func TestWithLockRenews(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		if !b.real {
			t.Skip("needs a server whose TTLs follow the clock")
		}
		c := New(b.rdb)
		ctx := context.Background()
		key := uniqueKey(t)
		const ttl = 150 * time.Millisecond
		var fence int64
		err := c.WithLock(ctx, key, ttl, func(ctx context.Context) error {
			l, ok := FromContext(ctx)
			require.True(t, ok)
			fence = l.Fence()
			// Hold for about five leases, checking that the lock stays ours.
			for i := range 15 {
				select {
				case <-ctx.Done():
					return context.Cause(ctx)
				case <-time.After(ttl / 3):
				}
				_, err := l.TTL(context.Background())
				if err != nil {
					return err
				}
				_, err = c.TryLock(context.Background(), key, ttl)
				if !errors.Is(err, ErrNotObtained) {
					t.Errorf("after %d checks TryLock by another = %v, want ErrNotObtained", i, err)
				}
			}
			return nil
		})
		require.NoError(t, err)
		assert.Positive(t, fence)
		locked, err := c.Locked(ctx, key)
		require.NoError(t, err)
		assert.False(t, locked, "WithLock releases")
	})
}

func TestWithLockCancelsOnLoss(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		ctx := context.Background()
		key := uniqueKey(t)
		const ttl = 300 * time.Millisecond
		fnErr := errors.New("fn saw the cancellation")
		start := time.Now()
		var cancelledAfter time.Duration
		err := c.WithLock(ctx, key, ttl, func(ctx context.Context) error {
			require.NoError(t, b.admin.Del(context.Background(), c.redisKey(key)).Err())
			select {
			case <-ctx.Done():
				cancelledAfter = time.Since(start)
				assert.ErrorIs(t, context.Cause(ctx), ErrNotHeld, "cause")
				return fnErr
			case <-time.After(30 * time.Second):
				return errors.New("not cancelled")
			}
		})
		assert.ErrorIs(t, err, ErrNotHeld)
		assert.ErrorIs(t, err, fnErr, "fn's error is kept")
		// The next renewal, ttl/3 after the start, finds the key gone.
		assert.Less(t, cancelledAfter, ttl, "cancelled %v after the start", cancelledAfter)
	})
}

func TestWithLockPartitionCancelsByOwnClock(t *testing.T) {
	// Renewals get no answer (a partition): fn must be cancelled when the lease ends on
	// our own clock, although Redis never said the lock was lost.
	each(t, func(t *testing.T, b backend) {
		p := redistest.NewProxy(t, b.rdb.Options().Addr)
		opts := *b.rdb.Options() // same user and TLS settings, through the proxy
		opts.Addr = p.Addr()
		via := redis.NewClient(&opts)
		t.Cleanup(func() { via.Close() })
		c := New(via)
		key := uniqueKey(t)
		const ttl = 300 * time.Millisecond
		var held time.Duration
		err := c.WithLock(context.Background(), key, ttl, func(ctx context.Context) error {
			start := time.Now()
			p.Blackhole(true)
			select {
			case <-ctx.Done():
				held = time.Since(start)
				assert.ErrorIs(t, context.Cause(ctx), ErrNotHeld, "cause")
			case <-time.After(30 * time.Second):
				t.Error("not cancelled")
			}
			return nil
		})
		assert.ErrorIs(t, err, ErrNotHeld)
		assert.Less(t, held, ttl, "cancelled %v after the acquisition", held)
		p.Blackhole(false)
	})
}

func TestWithLockReleasesOnPanic(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		ctx := context.Background()
		key := uniqueKey(t)
		assert.PanicsWithValue(t, "boom", func() {
			_ = c.WithLock(ctx, key, time.Minute, func(context.Context) error { panic("boom") })
		})
		locked, err := c.Locked(ctx, key)
		require.NoError(t, err)
		assert.False(t, locked)
	})
}

func TestWithLockContextDoneStillReleases(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		key := uniqueKey(t)
		ctx, cancel := context.WithCancel(context.Background())
		err := c.WithLock(ctx, key, time.Minute, func(context.Context) error {
			cancel()
			return nil
		})
		require.NoError(t, err)
		locked, err := c.Locked(context.Background(), key)
		require.NoError(t, err)
		assert.False(t, locked, "a cancelled caller must not leave the lock held for its lease")
	})
}
