package mutex

// The wait and hand-over protocol of Limit(n): cancellation, fences across kinds of
// lock, lost release replies.

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A Limit(2) waiter cancelled as a release hands it the slot passes it on: the second
// waiter gets it at once, not after the first's hour-long lease.
func TestLimitWaiterCancelledAsHandedOverPassesItOn(t *testing.T) {
	b := realBackend(t)
	c := New(b.rdb)
	t.Cleanup(func() { c.Close() })
	ctx := context.Background()
	cancelledFirst := 0 // trials where the cancellation came before the slot
	for trial := range 8 {
		key := fmt.Sprintf("%s:%d", uniqueKey(t), trial)
		other, err := c.TryLock(ctx, key, time.Hour, Limit(2))
		require.NoError(t, err)
		holder, err := c.TryLock(ctx, key, time.Hour, Limit(2))
		require.NoError(t, err)
		first, cancel := context.WithCancel(ctx)
		firstDone := make(chan error, 1)
		go func() {
			_, err := c.Lock(first, key, time.Hour, Limit(2))
			firstDone <- err
		}()
		waitQueueLen(t, b.admin, c, key, 1)
		second := make(chan error, 1)
		go func() {
			l, err := c.Lock(ctx, key, time.Minute, Limit(2), MaxWait(time.Minute))
			if err == nil {
				err = l.Unlock(ctx)
			}
			second <- err
		}()
		waitQueueLen(t, b.admin, c, key, 2)
		go func() {
			time.Sleep(time.Duration(rand.N(300)) * time.Microsecond)
			cancel()
		}()
		time.Sleep(time.Duration(rand.N(300)) * time.Microsecond)
		require.NoError(t, holder.Unlock(ctx))
		if err := <-firstDone; err == nil {
			require.NoError(t, b.admin.Del(ctx, c.redisKey(key)).Err())
			continue
		} else {
			require.ErrorIs(t, err, ErrNotObtained, "trial %d", trial)
		}
		cancelledFirst++
		select {
		case err := <-second:
			require.NoError(t, err, "trial %d", trial)
		case <-time.After(20 * time.Second):
			t.Fatalf("trial %d: the cancelled waiter swallowed the slot", trial)
		}
		require.NoError(t, other.Unlock(ctx))
	}
	require.Positive(t, cancelledFirst, "no trial had the waiter cancelled before it took the slot")
}

// Fences increase across semaphore → tombstone → plain → plain crash → semaphore →
// every holder crashed (hash expired) → semaphore, on every backend.
func TestLimitFencesAcrossKinds(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		ctx := context.Background()
		key := uniqueKey(t)
		var last int64
		next := func(what string) func(*Lock, error) *Lock {
			return func(l *Lock, err error) *Lock {
				t.Helper()
				require.NoError(t, err, what)
				assert.Greater(t, l.Fence(), last, what)
				last = l.Fence()
				return l
			}
		}
		s1 := next("sem 1")(c.TryLock(ctx, key, time.Minute, Limit(3)))
		s2 := next("sem 2")(c.TryLock(ctx, key, time.Minute, Limit(3)))
		require.NoError(t, s1.Unlock(ctx))
		require.NoError(t, s2.Unlock(ctx))
		p := next("plain after tombstone")(c.TryLock(ctx, key, time.Minute))
		require.NoError(t, p.Unlock(ctx))
		s3 := next("sem after plain tombstone")(c.TryLock(ctx, key, time.Minute, Limit(3)))
		require.NoError(t, s3.Unlock(ctx))
		next("plain again")(c.TryLock(ctx, key, time.Hour))
		b.expire(t, c.redisKey(key))
		next("sem after a plain crash")(c.TryLock(ctx, key, time.Hour, Limit(3)))
		b.expire(t, c.redisKey(key))
		next("sem after every holder crashed")(c.TryLock(ctx, key, time.Minute, Limit(3)))
		require.NoError(t, b.admin.Del(ctx, c.redisKey(key)).Err())
	})
}

// A release whose reply is lost after it handed the slot to a waiter is resent by
// go-redis and succeeds; the waiter holds; the slot was freed once.
func TestLimitLostReleaseReplyWithWaiter(t *testing.T) {
	rdb, p, _, c := throughProxy(t)
	t.Cleanup(func() { c.Close() })
	ctx := context.Background()
	key := uniqueKey(t)
	direct := New(rdb)
	t.Cleanup(func() { direct.Close() })
	warm, err := c.TryLock(ctx, key+":warm", time.Minute, Limit(2))
	require.NoError(t, err)
	require.NoError(t, warm.Unlock(ctx))
	h1, err := c.TryLock(ctx, key, time.Hour, Limit(2))
	require.NoError(t, err)
	h2, err := direct.TryLock(ctx, key, time.Hour, Limit(2))
	require.NoError(t, err)
	got := make(chan *Lock, 1)
	go func() {
		l, err := direct.Lock(ctx, key, time.Minute, Limit(2), MaxWait(20*time.Second))
		if err == nil {
			got <- l
		}
		close(got)
	}()
	waitQueueLen(t, rdb, direct, key, 1)
	p.DropReplies(1)
	require.NoError(t, h1.Unlock(ctx), "the resent release is recognised")
	assert.Equal(t, 1, p.Dropped())
	w := <-got
	require.NotNil(t, w, "the waiter was handed the slot")
	_, err = direct.TryLock(ctx, key, time.Minute, Limit(2))
	require.ErrorIs(t, err, ErrNotObtained, "two holders: h2 and the waiter")
	require.NoError(t, w.Unlock(ctx))
	require.NoError(t, h2.Unlock(ctx))
}
