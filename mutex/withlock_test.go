package mutex

import (
	"context"
	"errors"
	"sync/atomic"
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

// TestLateRenewal: a process that did not run for the whole of its lease (stopped,
// starved of CPU right after a hand-over's short lease) finds the lease ended on its
// clock before any renewal went. It asks Redis once: the lock is still its own when
// nobody took the key, and lost when somebody did (the control).
func TestLateRenewal(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		ctx := context.Background()
		for _, taken := range []bool{false, true} {
			key := uniqueKey(t)
			const ttl = 3 * time.Second
			l, err := c.TryLock(ctx, key, ttl)
			require.NoError(t, err)
			l.mu.Lock()
			l.until = time.Now().Add(-time.Millisecond) // as after a stop longer than the lease
			l.mu.Unlock()
			if taken {
				require.NoError(t, b.admin.Del(ctx, c.redisKey(key)).Err())
			}
			kctx, stop := context.WithCancel(ctx)
			var cause atomic.Value
			done := make(chan error, 1)
			go func() { done <- l.keepAlive(kctx, ttl, func(err error) { cause.Store(err) }) }()
			if taken {
				select {
				case err := <-done:
					assert.ErrorIs(t, err, ErrNotHeld, "a lease somebody ended is lost")
					assert.NotNil(t, cause.Load(), "fn is cancelled")
				case <-time.After(ttl):
					t.Fatal("keepAlive did not end a lease somebody ended")
				}
				stop()
				continue
			}
			deadline := time.Now().Add(ttl)
			for time.Until(l.validUntil()) <= 0 && time.Now().Before(deadline) {
				time.Sleep(time.Millisecond)
			}
			stop()
			assert.NoError(t, <-done)
			assert.Nil(t, cause.Load(), "fn was cancelled, though nobody took the key")
			assert.Greater(t, time.Until(l.validUntil()), ttl/2, "the late renewal lengthened the lease")
			require.NoError(t, l.Unlock(ctx))
		}
	})
}
