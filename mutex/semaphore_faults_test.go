package mutex

// Faults a lock with Limit(n) must survive: a plain lock and Limit(n) on one key,
// limits that change, lost replies, tokens used again, leases that ended.

import (
	"context"
	"errors"
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

// A plain lock's waiter queued behind a holder that crashed is handed a slot by the
// first Limit(n) acquisition that finds the key free: sem_lock.lua's semHandOver pops
// the plain waiter's entry, writes it into the hash as a holder and PUBLISHes its
// fence, and the plain Lock returns as if it held the key alone, while the Limit(3)
// holder holds it too. The README promises that a plain lock and a Limit(n) on one key
// exclude each other (LimitError), so this breaks mutual exclusion of the plain lock.
func TestPlainWaiterIsNotHandedASemaphoreSlot(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		t.Cleanup(func() { c.Close() })
		ctx := context.Background()
		key := uniqueKey(t)
		rkey := c.redisKey(key)

		crashed, err := c.TryLock(ctx, key, time.Hour)
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
		_ = crashed

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
			t.Logf("plain waiter ended with %v (acceptable: a LimitError, or the wait ending)", err)
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

// The reverse: a Limit(2) waiter queued behind slots that crashed; a plain lock takes
// the free key (lock.lua does not look at the queue) and a plain waiter queues behind
// it (marking the lock "w"). The plain Unlock's hand-over (release.lua) pops the
// Limit(2) waiter's entry and makes it the plain lock's holder. The semaphore waiter's
// Lock returns a slot; its Unlock (sem_release.lua: the key is no hash) reports
// ErrNotHeld and frees nothing, so the plain waiter waits out the whole lease.
func TestSemaphoreWaiterIsNotHandedAPlainLock(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		t.Cleanup(func() { c.Close() })
		ctx := context.Background()
		key := uniqueKey(t)
		rkey := c.redisKey(key)

		s1, err := c.TryLock(ctx, key, time.Hour, Limit(2))
		require.NoError(t, err)
		s2, err := c.TryLock(ctx, key, time.Hour, Limit(2))
		require.NoError(t, err)
		_, _ = s1, s2
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
			t.Logf("semaphore waiter ended with %v", err)
		case <-time.After(3 * time.Second):
			t.Log("semaphore waiter still waiting (correct)")
		}
		cancel()
		_ = b.admin.Del(ctx, rkey).Err()
	})
}

// A Token reused by a later acquisition within 10s of its earlier Unlock: the earlier
// release's mark (<key>:released:<digest of the identity>) is still there, so when the
// later acquisition's slot is lost (its lease ended, a crash-like pause), its Unlock
// returns nil instead of ErrNotHeld; WithLock would report success for work done
// without the slot. The plain lock does report ErrNotHeld in the same scenario
// (checked below as a control).
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
// Extend and TTL return Redis's raw WRONGTYPE error, not ErrNotHeld as documented
// ("ErrNotHeld when the lease had expired, another token holds the key"). WithLock's
// renewal then sees a Redis error, not a lost lease.
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

// go-redis resends a Lock's queuing attempt whose reply was lost: the first attempt
// queued the waiter (RPUSH), the resend carries the same "not queued yet" flag, so
// sem_lock.lua pushes the entry a second time. The waiter later gets a slot by the
// first entry; when it releases, its own release pops the duplicate and grants the
// slot straight back to the identity that just released (its Client still
// listens), a phantom holder for the whole lease: one slot of two is lost for ttl,
// and a third acquirer cannot get in although only one holder is real.
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
	q := c.redisKey(key) + semWaitSuffix
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) && rdb.LLen(ctx, q).Val() < 1 {
		time.Sleep(time.Millisecond)
	}
	time.Sleep(200 * time.Millisecond) // let go-redis resend
	entries := rdb.LRange(ctx, q, 0, -1).Val()
	t.Logf("queue after the lost reply: %d entries, dropped %d", len(entries), p.Dropped())
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
	if !errors.Is(err, nil) {
		_ = rdb.Del(ctx, c.redisKey(key)).Err()
	}
}

// The queue does not say which limit a waiter asked for. Limit(2) holders crash with a
// Limit(2) waiter queued; a Limit(5) acquisition then finds the key free, makes 5 its
// limit, and hands a slot to the Limit(2) waiter, whose Lock returns: it runs with up
// to four others where it asked for at most one other. The documented outcome of
// asking with another limit is a *LimitError.
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
		go func() {
			l, err := c.Lock(wctx, key, time.Minute, Limit(2))
			if err == nil {
				got <- l
			}
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
		case <-time.After(2 * time.Second):
		}
		cancel()
		_ = b.admin.Del(ctx, c.redisKey(key)).Err()
	})
}

// The plain lock has the same duplicate-queue fault as TestLostQueueReplyLeaves
// NoPhantomHolder: lock.lua pushes the entry again on go-redis's resend, and the
// waiter's own release later hands the lock back to itself (a phantom holder for the
// handed lease). Shown here because Limit(n) shares lock.lua's queue protocol.
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
// the next taker made the key a Limit(2) hash: Unlock's doc promises nil while the key
// is "held by whoever took it next"; it returns Redis's raw WRONGTYPE error, so
// WithLock reports a failed release for work that completed under the lock.
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
// the hash not yet expired because one lease was long): it refuses, saying the key is
// "held ... by 0 holders" and to wait for leases that have already ended, while
// Locked and Inspect say the key is free.
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
