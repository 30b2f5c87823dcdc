package mutex

// Sets of keys under lost replies: a waiter is queued once, and a waiter that gives
// up leaves nothing behind to swallow a release.

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// subscribed waits until c's hub listens on its channel: its first attempt has
// returned (hub.ensure runs after it), go-redis's repeats included.
func subscribed(t *testing.T, admin *redis.Client, c *Client) {
	t.Helper()
	require.Eventually(t, func() bool {
		m, err := admin.PubSubNumSub(context.Background(), c.hub.channel).Result()
		return err == nil && m[c.hub.channel] > 0
	}, 10*time.Second, 5*time.Millisecond, "the waiter's client never subscribed")
}

// TestLockKeysLostReplyQueuesOnce: the reply to the attempt that queues a set
// waiter on its busy key is lost; go-redis sends the same EVALSHA again (queued
// "0"), and plain_lock.lua pushes the waiter's entry a second time. The set later takes
// that key because its holder's lease ran out (take() removes one entry only), so
// the stale entry stays: the set's own release hands the key to the stale entry,
// a waiter that no longer exists, and the key stays held by nobody for a whole
// lease.
func TestLockKeysLostReplyQueuesOnce(t *testing.T) {
	admin, p, _, c := throughProxy(t)
	ctx := context.Background()
	k := uniqueKey(t)
	a, bk, other := k+":a", k+":b", k+":other"
	direct := New(admin)

	hb, err := direct.TryLock(ctx, bk, time.Minute)
	require.NoError(t, err)
	const ttl = 3 * time.Second // the set retries within ttl/3 while it keeps a
	p.DropReplies(1)            // the reply to the set's first attempt
	got := make(chan *Lock, 1)
	go func() {
		l, err := c.LockKeys(ctx, []string{a, bk}, ttl, MaxWait(20*time.Second))
		assert.NoError(t, err)
		got <- l
	}()
	subscribed(t, admin, c)
	assert.Equal(t, 1, p.Dropped(), "the first attempt's reply was dropped")
	n, err := admin.LLen(ctx, c.redisKey(bk)+waitSuffix).Result()
	require.NoError(t, err)
	assert.EqualValues(t, 1, n, "a waiter is queued once, even when go-redis repeats its attempt")

	keepSubscribed(t, admin, c, direct, other)

	// b's holder dies: its lease runs out. The set takes b at its next attempt.
	require.NoError(t, admin.Del(ctx, c.redisKey(bk)).Err())
	_ = hb
	var l *Lock
	select {
	case l = <-got:
	case <-time.After(20 * time.Second):
		t.Fatal("the set did not take b after its holder's lease ran out")
	}
	require.NotNil(t, l)
	require.NoError(t, l.Unlock(ctx))
	locked, err := direct.Locked(ctx, bk)
	require.NoError(t, err)
	assert.False(t, locked, "after the set's release nobody waits for b, so b must be free; it was handed to the set's stale queue entry")
	_, err = direct.TryLock(ctx, bk, time.Minute)
	assert.NoError(t, err, "b must be free for a newcomer after the set released it")
}

// TestLockLostReplyQueuesOnce: the same fault on one key, where the common path
// (a release hands the key over) leaves the duplicate: a single-key waiter handed
// the lock makes no further attempt, so nothing removes its second entry, and its
// own Unlock hands the key to that entry. The key then stays held by a waiter that
// left, for the hand-over lease (ttl for Lock).
func TestLockLostReplyQueuesOnce(t *testing.T) {
	admin, p, _, c := throughProxy(t)
	ctx := context.Background()
	k := uniqueKey(t)
	key, other := k+":key", k+":other"
	direct := New(admin)

	h, err := direct.TryLock(ctx, key, time.Minute)
	require.NoError(t, err)

	p.DropReplies(1) // the reply to the waiter's first attempt
	got := make(chan *Lock, 1)
	go func() {
		l, err := c.Lock(ctx, key, time.Minute, MaxWait(20*time.Second))
		assert.NoError(t, err)
		got <- l
	}()
	subscribed(t, admin, c)
	n, err := admin.LLen(ctx, c.redisKey(key)+waitSuffix).Result()
	require.NoError(t, err)
	assert.EqualValues(t, 1, n, "a waiter is queued once, even when go-redis repeats its attempt")

	keepSubscribed(t, admin, c, direct, other)

	require.NoError(t, h.Unlock(ctx)) // handed to the waiter
	var l *Lock
	select {
	case l = <-got:
	case <-time.After(20 * time.Second):
		t.Fatal("the waiter was not handed the key")
	}
	require.NotNil(t, l)
	require.NoError(t, l.Unlock(ctx))
	_, err = direct.TryLock(ctx, key, time.Minute)
	assert.NoError(t, err, "nobody waits any more, so the key must be free after the release; it was handed to the waiter's stale entry and stays held for a minute")
}

// TestLockKeysLostReplyThenGiveUp: the duplicate entry of
// TestLockKeysLostReplyQueuesOnce on the most common path, a waiter that gives up
// (MaxWait, a cancelled context; the middleware's MaxWait then RetryLater): its
// leave takes one entry out of the queue (LREM count 1), the other stays, and the
// holder's release hands the key to it. The key stays held, by a waiter that left,
// for the hand-over lease.
func TestLockKeysLostReplyThenGiveUp(t *testing.T) {
	admin, p, _, c := throughProxy(t)
	ctx := context.Background()
	k := uniqueKey(t)
	a, bk, other := k+":a", k+":b", k+":other"
	direct := New(admin)

	hb, err := direct.TryLock(ctx, bk, time.Minute)
	require.NoError(t, err)

	p.DropReplies(1) // the reply to the set's first attempt
	wctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		_, err := c.LockKeys(wctx, []string{a, bk}, time.Minute)
		done <- err
	}()
	subscribed(t, admin, c) // its first attempt, go-redis's repeat included, has returned
	assert.Equal(t, 1, p.Dropped(), "the first attempt's reply was dropped")
	keepSubscribed(t, admin, c, direct, other)
	cancel()
	select {
	case err := <-done:
		require.ErrorIs(t, err, ErrNotObtained)
	case <-time.After(10 * time.Second):
		t.Fatal("LockKeys did not return on cancel")
	}
	n, err := admin.LLen(ctx, c.redisKey(bk)+waitSuffix).Result()
	require.NoError(t, err)
	assert.Zero(t, n, "a waiter that gave up has left the queue")
	require.NoError(t, hb.Unlock(ctx))
	_, err = direct.TryLock(ctx, bk, time.Minute)
	assert.NoError(t, err, "nobody waits for b, so its release must free it; it was handed to the stale entry of a waiter that left")
}

// BenchmarkNewMultiAcquisitionManyKeys: preparing a set of keys is linear in their
// number (×4 keys should give about ×4 time), so that a large set costs less here
// than in Redis.
func BenchmarkNewMultiAcquisitionManyKeys(b *testing.B) {
	c := New(redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}))
	for _, n := range []int{1000, 4000, 16000} {
		keys := make([]string, n)
		for i := range keys {
			keys[i] = "key:" + newToken()
		}
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			for b.Loop() {
				if _, err := c.newMultiAcquisition(keys, time.Minute, nil); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// keepSubscribed holds key with holder and has c wait for it until the test ends, so
// that c's subscription stays open, as in a worker with other tasks waiting: a
// release then finds c listening, whichever of its waiters it hands a key to.
func keepSubscribed(t *testing.T, admin *redis.Client, c, holder *Client, key string) {
	t.Helper()
	ctx := context.Background()
	h, err := holder.TryLock(ctx, key, time.Hour)
	require.NoError(t, err)
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	done := make(chan struct{})
	go func() {
		defer close(done)
		if l, err := c.Lock(wctx, key, time.Minute); err == nil {
			_ = l.Unlock(context.Background())
		}
	}()
	t.Cleanup(func() {
		cancel()
		<-done
		_ = h.Unlock(context.Background())
	})
	waitQueued(t, admin, c.redisKey(key))
}
