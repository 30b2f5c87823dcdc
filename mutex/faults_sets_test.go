package mutex

// Faults of the single-key protocol (protocol_test.go, faults_test.go,
// wait_test.go) on a set of keys and on a lock with Limit(n): a set that gives up as
// its busy key is handed to it, a set's release whose reply is lost, TryLockKeys
// retried after a lost reply, a slot handed to a waiter nobody hears.

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/asynqmutex/asynqmutex/internal/store"
)

// TestSetWaiterCancelledAsHandedOverPassesItOn: a set waiting on {a, b} keeps a and
// waits for b; its context ends as b's holder releases, which may hand b to it. The
// set must leave nothing held: b reaches the single-key waiter queued behind it at
// once, not after the set's hour-long lease, and a is free.
func TestSetWaiterCancelledAsHandedOverPassesItOn(t *testing.T) {
	b := realBackend(t)
	c := New(b.rdb)
	t.Cleanup(func() { c.Close() })
	ctx := context.Background()
	cancelled := 0
	const trials, enough = 20, 6 // bounded; stop once enough trials ended in a cancel
	for trial := 0; trial < trials && cancelled < enough; trial++ {
		k := fmt.Sprintf("%s:%d", uniqueKey(t), trial)
		a, bk := k+":a", k+":b" // a's Redis key sorts first: the set keeps a, waits for b
		holder, err := c.TryLock(ctx, bk, time.Hour)
		require.NoError(t, err)
		first, cancel := context.WithCancel(ctx)
		firstDone := make(chan error, 1)
		var set *Lock
		go func() {
			l, err := c.LockKeys(first, []string{a, bk}, time.Hour)
			set = l
			firstDone <- err
		}()
		waitForWaiters(t, b, c, bk, 1)
		held, err := c.Locked(ctx, a)
		require.NoError(t, err)
		require.True(t, held, "control: the waiting set keeps a")
		second := lockThenUnlock(c, bk)
		waitForWaiters(t, b, c, bk, 2)

		// Cancel and release as close together as the scheduler allows, in either order.
		go func() {
			time.Sleep(time.Duration(rand.N(300)) * time.Microsecond)
			cancel()
		}()
		time.Sleep(time.Duration(rand.N(300)) * time.Microsecond)
		require.NoError(t, holder.Unlock(ctx))
		var ferr error
		select {
		case ferr = <-firstDone:
		case <-time.After(20 * time.Second):
			t.Fatalf("trial %d: LockKeys did not return after its context was cancelled", trial)
		}
		if ferr == nil {
			// It took both keys before the cancel, so this trial says nothing of a
			// cancel: release them, handing b to the second waiter.
			cancel()
			require.NoError(t, set.Unlock(ctx))
			select {
			case err := <-second:
				require.NoError(t, err)
			case <-time.After(20 * time.Second):
				t.Fatalf("trial %d: the second waiter was not handed b by the set's release", trial)
			}
			continue
		}
		cancel()
		require.ErrorIs(t, ferr, context.Canceled, "trial %d", trial)
		cancelled++
		select {
		case err := <-second:
			require.NoError(t, err, "trial %d", trial)
		case <-time.After(20 * time.Second):
			t.Fatalf("trial %d: the cancelled set swallowed the hand-over of b", trial)
		}
		held, err = c.Locked(ctx, a)
		require.NoError(t, err)
		assert.False(t, held, "trial %d: the cancelled set left a held", trial)
		held, err = c.Locked(ctx, bk)
		require.NoError(t, err)
		assert.False(t, held, "trial %d: b is held after its last waiter released it", trial)
	}
	t.Logf("%d trials ended with the set cancelled", cancelled)
}

// TestLostReleaseReplyOfSetWithWaitersIsNotALostLease: the release of a set hands
// a and b to their waiters; the reply is lost and go-redis sends the release again,
// when the waiters hold the keys. The repeat must count as released: Unlock returns
// nil, and WithLockKeys, whose fn ran under valid leases, does not report
// ErrNotHeld. Each waiter keeps the key it was handed.
func TestLostReleaseReplyOfSetWithWaitersIsNotALostLease(t *testing.T) {
	b := realBackend(t)
	_, p, via, c := throughProxy(t)
	ctx := context.Background()
	require.NoError(t, store.New(via).Load(ctx, plainReleaseScript))
	other := New(b.rdb)
	t.Cleanup(func() { other.Close() })
	k := uniqueKey(t)
	a, bk := k+":a", k+":b"

	got := make(chan *Lock, 2)
	queue := func() { // a waiter on a and one on b, queued
		for _, key := range []string{a, bk} {
			go func() {
				l, err := other.Lock(ctx, key, time.Minute, MaxWait(time.Minute))
				assert.NoError(t, err)
				got <- l
			}()
			waitForWaiters(t, b, other, key, 1)
		}
	}
	handed := func(what string) { // each waiter holds its own key, then releases it
		keys := map[string]bool{}
		for range 2 {
			var l *Lock
			select {
			case l = <-got:
			case <-time.After(20 * time.Second):
				t.Fatalf("%s: a waiter was not handed its key", what)
			}
			require.NotNil(t, l)
			_, err := l.TTL(ctx)
			assert.NoError(t, err, "%s: the waiter holds the key the release handed it", what)
			keys[l.Keys()[0]] = true
			require.NoError(t, l.Unlock(ctx))
		}
		assert.Equal(t, map[string]bool{a: true, bk: true}, keys, "%s: each waiter got its own key", what)
	}

	l, err := c.TryLockKeys(ctx, []string{a, bk}, time.Minute)
	require.NoError(t, err)
	queue()
	p.DropReplies(1) // the release's reply
	require.NoError(t, l.Unlock(ctx), "the repeated release finds the keys handed on by itself")
	assert.Equal(t, 1, p.Dropped(), "a reply was dropped")
	handed("Unlock")

	err = c.WithLockKeys(ctx, []string{a, bk}, time.Minute, func(context.Context) error {
		queue()
		p.DropReplies(1) // the release's reply, after fn returns
		return nil
	})
	require.NoError(t, err, "a repeated release that finds the keys handed on is not a lost lease")
	assert.Equal(t, 2, p.Dropped(), "a reply was dropped")
	handed("WithLockKeys")
}

// TestTryLockKeysLostReplyRetriedFindsItsOwn: the reply to TryLockKeys's script is
// lost after Redis took every key; go-redis sends it again on a new connection. The
// retry must find the keys held by its own token and succeed with the fences the
// first call issued, not report ErrNotObtained while it holds them.
func TestTryLockKeysLostReplyRetriedFindsItsOwn(t *testing.T) {
	rdb, p, via, c := throughProxy(t)
	ctx := context.Background()
	require.NoError(t, store.New(via).Load(ctx, plainLockScript))
	k := uniqueKey(t)
	keys := []string{k + ":b", k + ":a", k + ":c"}

	p.DropReplies(1)
	l, err := c.TryLockKeys(ctx, keys, time.Minute)
	require.NoError(t, err, "the retried attempt must find its own token")
	assert.Equal(t, 1, p.Dropped(), "a reply was dropped")
	require.Equal(t, keys, l.Keys())
	fences := l.Fences()
	require.Len(t, fences, len(keys))
	for i, key := range keys {
		val, err := rdb.Get(ctx, c.redisKey(key)).Result()
		require.NoError(t, err, "key %s", key)
		assert.True(t, strings.HasPrefix(val[idAt:], identity(l.Token())), "our token holds %s: %q", key, val)
		f, err := strconv.ParseInt(val[:16], 10, 64)
		require.NoError(t, err, "fence of %s in %q", key, val)
		assert.Equal(t, f, fences[i], "the fence of %s is the one the first call issued", key)
	}
	require.NoError(t, l.Unlock(ctx))
	for _, key := range keys {
		held, err := c.Locked(ctx, key)
		require.NoError(t, err)
		assert.False(t, held, "%s after the release", key)
	}
}

// TestLimitReleaseSkipsWaiterNobodyHears: a Limit(2) key is full; waiters of a
// Client that died (nobody subscribed to their channel) are first in line, a live
// waiter behind them. A release must hand the slot past the dead ones to the live
// one: a slot handed to a dead waiter stays taken for its hour-long lease.
func TestLimitReleaseSkipsWaiterNobodyHears(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		t.Cleanup(func() { c.Close() })
		ctx := context.Background()
		key := uniqueKey(t)
		rkey := c.redisKey(key)
		h1, err := c.TryLock(ctx, key, time.Hour, Limit(2))
		require.NoError(t, err)
		h2, err := c.TryLock(ctx, key, time.Hour, Limit(2))
		require.NoError(t, err)
		// First in line, a waiter of a Client that dies: its connections close, so it
		// neither hears a hand-over nor takes its entry out of the queue.
		opt := *b.rdb.Options()
		deadRdb := redis.NewClient(&opt)
		d := New(deadRdb)
		deadDone := make(chan error, 1)
		go func() {
			_, err := d.Lock(ctx, key, time.Hour, Limit(2), MaxWait(time.Minute))
			deadDone <- err
		}()
		waitForWaiters(t, b, d, key, 1)
		got := make(chan error, 1)
		go func() {
			l, err := c.Lock(ctx, key, time.Minute, Limit(2), MaxWait(time.Minute))
			if err == nil {
				err = l.Unlock(ctx)
			}
			got <- err
		}()
		waitForWaiters(t, b, c, key, 2)
		require.NoError(t, deadRdb.Close())
		require.NoError(t, d.Close())
		select {
		case err := <-deadDone:
			require.Error(t, err, "the dead Client's waiter cannot reach Redis")
		case <-time.After(20 * time.Second):
			t.Fatal("the dead Client's waiter did not return")
		}
		require.Eventually(t, func() bool {
			m, err := b.admin.PubSubNumSub(ctx, d.hub.channel).Result()
			return err == nil && m[d.hub.channel] == 0
		}, 10*time.Second, 5*time.Millisecond, "the dead Client is still subscribed")
		n, err := b.admin.LLen(ctx, rkey+slotsSuffix).Result()
		require.NoError(t, err)
		require.EqualValues(t, 2, n, "control: the dead waiter's entry is still queued, ahead of the live one")
		// More dead waiters, in the form slots_lock.lua queues them, ahead of those: more
		// of them than any fixed bound on a release's work.
		const dead = 40
		for i := range dead {
			tok := fmt.Sprintf("deadtok%02d", i)
			entry := fmt.Sprintf("dead%d.1 3600000/2 %04d%s", i, len(tok), tok)
			require.NoError(t, b.admin.LPush(ctx, rkey+slotsSuffix, entry).Err())
		}

		require.NoError(t, h1.Unlock(ctx))
		// The holders' leases are an hour: only a slot handed past the dead waiters
		// lets the live one in.
		select {
		case err := <-got:
			require.NoError(t, err)
		case <-time.After(30 * time.Second):
			t.Fatal("a dead waiter swallowed the released slot")
		}
		in, err := c.Inspect(ctx, key)
		require.NoError(t, err)
		assert.Len(t, in.Slots, 1, "only the remaining holder holds a slot, no dead waiter")
		assert.Zero(t, in.Waiting, "the dead waiters are out of the queue")
		require.NoError(t, h2.Unlock(ctx))
	})
}
