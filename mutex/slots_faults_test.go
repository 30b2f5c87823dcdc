package mutex

// Faults a lock with Limit(n) must survive: a plain lock and Limit(n) on one key,
// limits that change, lost replies, tokens used again, leases that ended.

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// waitQueueLen is waitForWaiters, then 50ms more: the subscription's confirmation
// wakes every waiter once more, and that attempt (which finds its entry queued) must
// pass before the caller changes the key.
func waitQueueLen(t *testing.T, admin *redis.Client, c *Client, key string, n int64) {
	t.Helper()
	waitForWaiters(t, backend{admin: admin}, c, key, int(n))
	time.Sleep(50 * time.Millisecond)
}

// A plain lock's waiter queued behind a holder that crashed must not be handed a slot
// by the first Limit(3) acquisition that finds the key free (the two kinds queue
// apart): it would hold the key it asked to hold alone while the Limit(3) holder
// holds it too. It may only wait, or learn of the limit (LimitError).
func TestPlainWaiterIsNotHandedASemaphoreSlot(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		t.Cleanup(func() { c.Close() })
		ctx := context.Background()
		key := uniqueKey(t)
		rkey := c.redisKey(key)

		_, err := c.TryLock(ctx, key, time.Hour) // the holder that will crash
		require.NoError(t, err)
		wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		defer cancel()
		got := make(chan *Lock, 1)
		errs := make(chan error, 1)
		go func() {
			l, err := c.Lock(wctx, key, time.Minute) // a plain waiter
			if err != nil {
				errs <- err
				return
			}
			got <- l
		}()
		waitQueueLen(t, b.admin, c, key, 1)
		b.expire(t, rkey) // the plain holder crashed: its lease ends; the waiter sleeps for an hour

		sem, err := c.TryLock(ctx, key, time.Minute, Limit(3))
		require.NoError(t, err, "a Limit(3) acquisition on the free key")
		defer sem.Unlock(ctx)

		select {
		case l := <-got:
			// The plain waiter now "holds" the key alone while sem holds a slot of it.
			in, ierr := c.Inspect(ctx, key)
			require.NoError(t, ierr)
			t.Errorf("plain waiter was handed a slot of Limit(3): plain lock fence %d, sem fence %d, key held by %d slots (limit %d)",
				l.Fence(), sem.Fence(), len(in.Slots), in.Limit)
			uerr := l.Unlock(ctx)
			assert.NoError(t, uerr, "and the plain holder cannot even Unlock it")
		case err := <-errs:
			var le *LimitError
			assert.ErrorAs(t, err, &le, "a plain waiter may only learn that the key is held with Limit(3)")
		case <-time.After(2 * time.Second):
			// Correct: the plain waiter still waits (the key is held with Limit(3)).
			cancel()
			select {
			case <-got:
				t.Error("plain waiter got the key after cancellation")
			case <-errs:
			case <-time.After(10 * time.Second):
				t.Fatal("plain waiter did not return after cancel")
			}
		}
	})
}

// The reverse: a Limit(2) waiter queued behind slots that crashed must not be handed
// the plain lock that took the free key when that lock's holder releases it to its
// own waiter: the plain waiter gets it, and the Limit(2) waiter only waits or learns
// of the plain lock (LimitError).
func TestSemaphoreWaiterIsNotHandedAPlainLock(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		t.Cleanup(func() { c.Close() })
		ctx := context.Background()
		key := uniqueKey(t)
		rkey := c.redisKey(key)

		for range 2 { // the slot holders that will crash
			_, err := c.TryLock(ctx, key, time.Hour, Limit(2))
			require.NoError(t, err)
		}
		wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		defer cancel()
		semGot := make(chan *Lock, 1)
		semErr := make(chan error, 1)
		go func() {
			l, err := c.Lock(wctx, key, time.Minute, Limit(2))
			if err != nil {
				semErr <- err
				return
			}
			semGot <- l
		}()
		waitQueueLen(t, b.admin, c, key, 1)
		b.expire(t, rkey) // both slot holders crashed; the waiter sleeps for an hour

		p, err := c.TryLock(ctx, key, time.Hour)
		require.NoError(t, err, "a plain lock on the free key")
		plainGot := make(chan error, 1)
		go func() {
			l, err := c.Lock(wctx, key, time.Minute)
			if err == nil {
				err = l.Unlock(ctx)
			}
			plainGot <- err
		}()
		waitQueueLen(t, b.admin, c, key, 2)
		require.NoError(t, p.Unlock(ctx))

		select {
		case l := <-semGot:
			v, _ := b.admin.Get(ctx, rkey).Result()
			t.Errorf("the Limit(2) waiter was handed the plain lock (key value %q)", v)
			assert.NoError(t, l.Unlock(ctx), "its Unlock must free what it was handed")
			select {
			case err := <-plainGot:
				assert.NoError(t, err)
			case <-time.After(3 * time.Second):
				t.Error("the plain waiter is stuck behind a plain lock that its holder cannot release")
			}
		case err := <-semErr:
			var le *LimitError
			assert.ErrorAs(t, err, &le, "a Limit(2) waiter may only learn that a plain lock holds the key")
		case <-time.After(3 * time.Second): // still waiting: correct
		}
		select {
		case err := <-plainGot:
			assert.NoError(t, err, "the plain waiter is handed the plain lock and releases it")
		case <-time.After(10 * time.Second):
			t.Error("the plain waiter was not handed the plain lock")
		}
		cancel()
		_ = b.admin.Del(ctx, rkey).Err()
	})
}

// A Token reused by a later acquisition within 10s of its earlier Unlock: the earlier
// release's mark must not make the later one's Unlock succeed once its slot is lost
// (its lease ended): it returns ErrNotHeld, as the plain lock does in the same steps
// (checked below as a control), so that WithLock reports the lost lease.
func TestReusedTokenLostSlotIsNotReleased(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		ctx := context.Background()
		key := uniqueKey(t)

		l1, err := c.TryLock(ctx, key, time.Minute, Limit(2), Token("job-7"))
		require.NoError(t, err)
		other, err := c.TryLock(ctx, key, time.Minute, Limit(2))
		require.NoError(t, err)
		defer other.Unlock(ctx)
		require.NoError(t, l1.Unlock(ctx))

		l2, err := c.TryLock(ctx, key, time.Minute, Limit(2), Token("job-7"))
		require.NoError(t, err, "the job runs again with the same token")
		endSlot(t, b, c, key, l2.Token()) // its lease ends: the slot is lost
		_, err = l2.TTL(ctx)
		require.ErrorIs(t, err, ErrNotHeld, "TTL sees the lost slot")
		assert.ErrorIs(t, l2.Unlock(ctx), ErrNotHeld, "Unlock of a lost slot must report ErrNotHeld")

		// Control: the plain lock, same steps.
		pkey := key + ":plain"
		p1, err := c.TryLock(ctx, pkey, time.Minute, Token("job-8"))
		require.NoError(t, err)
		require.NoError(t, p1.Unlock(ctx))
		p2, err := c.TryLock(ctx, pkey, time.Minute, Token("job-8"))
		require.NoError(t, err)
		b.expire(t, c.redisKey(pkey))
		assert.ErrorIs(t, p2.Unlock(ctx), ErrNotHeld, "control: the plain lock reports the lost lease")
	})
}

// A plain lock whose lease ended while the key became a Limit(n) hash: its Unlock,
// Extend and TTL return ErrNotHeld, as documented, not a Redis WRONGTYPE error, so
// that WithLock's renewal sees a lost lease rather than a Redis fault.
func TestPlainLockOnSemaphoreKeyIsNotHeld(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		ctx := context.Background()
		key := uniqueKey(t)
		p, err := c.TryLock(ctx, key, time.Minute)
		require.NoError(t, err)
		b.expire(t, c.redisKey(key)) // its lease ends
		s, err := c.TryLock(ctx, key, time.Minute, Limit(2))
		require.NoError(t, err)
		defer s.Unlock(ctx)

		_, err = p.TTL(ctx)
		assert.ErrorIs(t, err, ErrNotHeld, "TTL")
		assert.ErrorIs(t, p.Extend(ctx, time.Minute), ErrNotHeld, "Extend")
		assert.ErrorIs(t, p.Unlock(ctx), ErrNotHeld, "Unlock")
	})
}

// go-redis resends a Limit(n) Lock's queuing attempt whose reply was lost: the waiter
// must be queued once. A second entry would later be handed the slot its waiter had
// just released (its Client still listens): a phantom holder for the whole lease,
// keeping a third acquirer out although only one holder is real.
func TestLostQueueReplyLeavesNoPhantomHolder(t *testing.T) {
	rdb, p, _, c := throughProxy(t)
	ctx := context.Background()
	key := uniqueKey(t)
	t.Cleanup(func() { c.Close() })
	// Warm the semaphore scripts on the proxied connection.
	warm, err := c.TryLock(ctx, key+":warm", time.Minute, Limit(2))
	require.NoError(t, err)
	require.NoError(t, warm.Unlock(ctx))

	direct := New(rdb)
	h1, err := direct.TryLock(ctx, key, time.Hour, Limit(2))
	require.NoError(t, err)
	h2, err := direct.TryLock(ctx, key, time.Hour, Limit(2))
	require.NoError(t, err)
	defer h2.Unlock(ctx)

	keepSubscribed(t, rdb, c, direct, key+":other")

	wctx, wcancel := context.WithTimeout(ctx, 20*time.Second)
	defer wcancel()
	got := make(chan *Lock, 1)
	errs := make(chan error, 1)
	p.DropReplies(1) // the reply of the waiter's first attempt
	go func() {
		l, err := c.Lock(wctx, key, time.Minute, Limit(2))
		if err != nil {
			errs <- err
			return
		}
		got <- l
	}()
	q := c.redisKey(key) + slotsSuffix
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) && rdb.LLen(ctx, q).Val() < 1 {
		time.Sleep(time.Millisecond)
	}
	time.Sleep(200 * time.Millisecond) // let go-redis resend
	entries := rdb.LRange(ctx, q, 0, -1).Val()
	assert.Equal(t, 1, p.Dropped(), "the queuing attempt's reply was dropped")
	assert.Len(t, entries, 1, "a resent attempt must not queue the waiter twice")

	require.NoError(t, h1.Unlock(ctx))
	var w *Lock
	select {
	case w = <-got:
	case err := <-errs:
		t.Fatalf("waiter: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("waiter not handed the slot")
	}
	require.NoError(t, w.Unlock(ctx))

	in, err := direct.Inspect(ctx, key)
	require.NoError(t, err)
	assert.Len(t, in.Slots, 1, "only h2 holds a slot after the waiter released")
	third, err := direct.TryLock(ctx, key, time.Minute, Limit(2))
	assert.NoError(t, err, "a slot is free")
	if third != nil {
		_ = third.Unlock(ctx)
	}
	if err != nil {
		_ = rdb.Del(ctx, c.redisKey(key)).Err()
	}
}

// Limit(2) holders crash with a Limit(2) waiter queued; a Limit(5) acquisition then
// finds the key free and makes 5 its limit. The waiter must not be handed a slot (it
// would run with up to four others where it asked for one): it is taken out of the
// queue and told at once, and its Lock returns the *LimitError naming both limits.
func TestWaiterOfAnotherLimitIsNotHandedASlot(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		t.Cleanup(func() { c.Close() })
		ctx := context.Background()
		key := uniqueKey(t)
		for range 2 {
			_, err := c.TryLock(ctx, key, time.Hour, Limit(2))
			require.NoError(t, err)
		}
		wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		defer cancel()
		got := make(chan *Lock, 1)
		failed := make(chan error, 1)
		go func() {
			l, err := c.Lock(wctx, key, time.Minute, Limit(2))
			if err == nil {
				got <- l
				return
			}
			failed <- err
		}()
		waitQueueLen(t, b.admin, c, key, 1)
		b.expire(t, c.redisKey(key)) // both holders crashed
		var five []*Lock
		for i := range 4 {
			l, err := c.TryLock(ctx, key, time.Minute, Limit(5))
			require.NoError(t, err, "Limit(5) holder %d", i)
			five = append(five, l)
		}
		select {
		case l := <-got:
			in, err := c.Inspect(ctx, key)
			require.NoError(t, err)
			t.Errorf("the Limit(2) waiter holds a slot of a key with limit %d and %d holders (fence %d)", in.Limit, len(in.Slots), l.Fence())
		case err := <-failed:
			// Taken out of the queue and told at once (its own timer would wait for
			// an hour, the crashed holders' lease), it learns of the limit in force.
			var le *LimitError
			require.ErrorAs(t, err, &le)
			assert.Equal(t, LimitError{Key: key, Held: 5, Asked: 2}, *le)
		case <-time.After(10 * time.Second):
			t.Error("the Limit(2) waiter was not told of the limit in force")
		}
		cancel()
		_ = b.admin.Del(ctx, c.redisKey(key)).Err()
	})
}

// The plain lock under the same fault as TestLostQueueReplyLeavesNoPhantomHolder:
// a resent queuing attempt must queue the waiter once, or the waiter's own release
// would hand the lock back to itself (a phantom holder for the handed lease).
func TestPlainLostQueueReplyLeavesNoPhantomHolder(t *testing.T) {
	rdb, p, _, c := throughProxy(t)
	ctx := context.Background()
	key := uniqueKey(t)
	t.Cleanup(func() { c.Close() })
	direct := New(rdb)
	h1, err := direct.TryLock(ctx, key, time.Hour)
	require.NoError(t, err)

	keepSubscribed(t, rdb, c, direct, key+":other")

	wctx, wcancel := context.WithTimeout(ctx, 20*time.Second)
	defer wcancel()
	got := make(chan *Lock, 1)
	p.DropReplies(1)
	go func() {
		l, err := c.Lock(wctx, key, time.Minute)
		if err == nil {
			got <- l
		}
	}()
	q := c.redisKey(key) + waitSuffix
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) && rdb.LLen(ctx, q).Val() < 1 {
		time.Sleep(time.Millisecond)
	}
	time.Sleep(200 * time.Millisecond)
	assert.Equal(t, 1, p.Dropped(), "the queuing attempt's reply was dropped")
	assert.Len(t, rdb.LRange(ctx, q, 0, -1).Val(), 1, "a resent attempt must not queue the waiter twice")
	require.NoError(t, h1.Unlock(ctx))
	var w *Lock
	select {
	case w = <-got:
	case <-time.After(10 * time.Second):
		t.Fatal("waiter not handed the lock")
	}
	require.NoError(t, w.Unlock(ctx))
	locked, err := direct.Locked(ctx, key)
	require.NoError(t, err)
	assert.False(t, locked, "the key is free after its only holder released")
	_ = rdb.Del(ctx, c.redisKey(key)).Err()
}

// A plain Unlock repeated (as go-redis resends a release whose reply was lost) after
// the next taker made the key a Limit(2) hash returns nil, as Unlock's doc promises
// while the key is "held by whoever took it next", not a Redis WRONGTYPE error.
func TestRepeatedPlainUnlockAfterSemaphoreTookTheKey(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		ctx := context.Background()
		key := uniqueKey(t)
		p, err := c.TryLock(ctx, key, time.Minute)
		require.NoError(t, err)
		require.NoError(t, p.Unlock(ctx))
		s, err := c.TryLock(ctx, key, time.Minute, Limit(2))
		require.NoError(t, err, "the next taker, with Limit(2)")
		defer s.Unlock(ctx)
		assert.NoError(t, p.Unlock(ctx), "the repeated release of a lock that was released")

		// Control: the same with a plain next taker returns nil.
		key2 := key + ":plain"
		p2, err := c.TryLock(ctx, key2, time.Minute)
		require.NoError(t, err)
		require.NoError(t, p2.Unlock(ctx))
		n2, err := c.TryLock(ctx, key2, time.Minute)
		require.NoError(t, err)
		defer n2.Unlock(ctx)
		assert.NoError(t, p2.Unlock(ctx), "control: plain next taker")
	})
}

// ForceRelease of a key whose Limit(n) holders have all crashed (every lease ended,
// the hash not yet expired because one lease was long) frees it, as Locked and
// Inspect say it is free, rather than refuse it for "0 holders".
func TestForceReleaseOfEndedSemaphore(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		ctx := context.Background()
		key := uniqueKey(t)
		l, err := c.TryLock(ctx, key, time.Hour, Limit(2))
		require.NoError(t, err)
		endSlot(t, b, c, key, l.Token())
		locked, err := c.Locked(ctx, key)
		require.NoError(t, err)
		require.False(t, locked, "Locked: the only lease ended")
		_, err = c.ForceRelease(ctx, key)
		assert.NoError(t, err, "ForceRelease of a key nobody holds")
		_ = b.admin.Del(ctx, c.redisKey(key)).Err()
	})
}
