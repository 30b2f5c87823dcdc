package mutex

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/asynqmutex/asynqmutex/internal/store"
)

// endSlot makes the lease of the slot that token holds in key end now, as if its
// holder had crashed long ago: the lease end in its field becomes 1 ms after the epoch.
func endSlot(t *testing.T, b backend, c *Client, key, token string) {
	t.Helper()
	ctx := context.Background()
	rkey, field := c.redisKey(key), "h"+identity(token)
	v, err := b.admin.HGet(ctx, rkey, field).Result()
	require.NoError(t, err, "slot of %s", token)
	_, rest, _ := strings.Cut(v, " ")
	require.NoError(t, b.admin.HSet(ctx, rkey, field, "1 "+rest).Err())
}

func TestLimitAdmitsN(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		ctx := context.Background()
		key := uniqueKey(t)
		var held []*Lock
		for i := range 3 {
			l, err := c.TryLock(ctx, key, time.Minute, Limit(3), HeldBy("job", fmt.Sprint(i)))
			require.NoError(t, err, "holder %d", i)
			if i > 0 {
				assert.Greater(t, l.Fence(), held[i-1].Fence(), "fence of holder %d", i)
			}
			held = append(held, l)
		}
		_, err := c.TryLock(ctx, key, time.Minute, Limit(3))
		require.ErrorIs(t, err, ErrNotObtained, "a fourth holder")

		locked, err := c.Locked(ctx, key)
		require.NoError(t, err)
		assert.True(t, locked, "Locked")
		in, err := c.Inspect(ctx, key)
		require.NoError(t, err)
		assert.True(t, in.Held)
		assert.Equal(t, 3, in.Limit)
		require.Len(t, in.Slots, 3)
		for i, s := range in.Slots {
			assert.Equal(t, held[i].Fence(), s.Fence, "slot %d fence", i)
			assert.Equal(t, fmt.Sprint(i), s.Holder.ID, "slot %d holder", i)
			assert.Greater(t, s.TTL, 50*time.Second, "slot %d TTL", i)
		}
		assert.Equal(t, held[2].Fence(), in.Fence, "Info.Fence is the newest holder's")
		var listed []Info
		for li, err := range c.List(ctx) {
			require.NoError(t, err)
			if li.Key == key {
				listed = append(listed, li)
			}
		}
		require.Len(t, listed, 1, "List yields the key once")
		assert.Len(t, listed[0].Slots, 3)

		ttl, err := held[1].TTL(ctx)
		require.NoError(t, err)
		assert.Greater(t, ttl, 50*time.Second)
		require.NoError(t, held[1].Extend(ctx, 2*time.Minute))
		ttl, err = held[1].TTL(ctx)
		require.NoError(t, err)
		assert.Greater(t, ttl, 100*time.Second, "TTL after Extend")

		require.NoError(t, held[1].Unlock(ctx))
		l, err := c.TryLock(ctx, key, time.Minute, Limit(3))
		require.NoError(t, err, "a slot freed by Unlock")
		assert.Greater(t, l.Fence(), held[2].Fence())
		_, err = held[1].TTL(ctx)
		require.ErrorIs(t, err, ErrNotHeld, "TTL of a released slot")
		require.ErrorIs(t, held[1].Extend(ctx, time.Minute), ErrNotHeld, "Extend of a released slot")

		// Everybody leaves: the key is free, for a plain lock too, with a higher fence.
		for _, h := range []*Lock{held[0], held[2], l} {
			require.NoError(t, h.Unlock(ctx))
		}
		locked, err = c.Locked(ctx, key)
		require.NoError(t, err)
		assert.False(t, locked, "Locked after every holder left")
		p, err := c.TryLock(ctx, key, time.Minute)
		require.NoError(t, err, "a plain lock after the last holder left")
		assert.Greater(t, p.Fence(), l.Fence())
		require.NoError(t, p.Unlock(ctx))
	})
}

func TestLimitHandsOverOnRelease(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		ctx := context.Background()
		key := uniqueKey(t)
		a, err := c.TryLock(ctx, key, time.Hour, Limit(2))
		require.NoError(t, err)
		bl, err := c.TryLock(ctx, key, time.Hour, Limit(2))
		require.NoError(t, err)

		got := make(chan *Lock, 2)
		errs := make(chan error, 2)
		for range 2 {
			go func() {
				l, err := c.Lock(ctx, key, time.Minute, Limit(2), MaxWait(time.Minute))
				if err != nil {
					errs <- err
					return
				}
				got <- l
			}()
		}
		waitForWaiters(t, b, c, key, 2)
		// The holders' leases are an hour: only the release's hand-over can wake a waiter.
		require.NoError(t, a.Unlock(ctx))
		var first *Lock
		select {
		case first = <-got:
		case err := <-errs:
			t.Fatal(err)
		case <-time.After(30 * time.Second):
			t.Fatal("no waiter was handed the slot")
		}
		assert.Greater(t, first.Fence(), bl.Fence())
		select {
		case l := <-got:
			t.Fatalf("a second waiter got a slot (fence %d) while two are held", l.Fence())
		case <-time.After(50 * time.Millisecond):
		}
		in, err := c.Inspect(ctx, key)
		require.NoError(t, err)
		assert.Len(t, in.Slots, 2)
		assert.Equal(t, 1, in.Waiting, "the other waiter keeps its place")

		require.NoError(t, first.Unlock(ctx))
		select {
		case l := <-got:
			require.NoError(t, l.Unlock(ctx))
		case err := <-errs:
			t.Fatal(err)
		case <-time.After(30 * time.Second):
			t.Fatal("the second waiter was not handed the slot")
		}
		require.NoError(t, bl.Unlock(ctx))
	})
}

func TestLimitCrashedHolderFrees(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		ctx := context.Background()
		key := uniqueKey(t)
		_, err := c.TryLock(ctx, key, time.Hour, Limit(2), Token("crashed"))
		require.NoError(t, err)
		live, err := c.TryLock(ctx, key, time.Hour, Limit(2))
		require.NoError(t, err)
		_, err = c.TryLock(ctx, key, time.Hour, Limit(2))
		require.ErrorIs(t, err, ErrNotObtained)

		endSlot(t, b, c, key, "crashed")
		in, err := c.Inspect(ctx, key)
		require.NoError(t, err)
		assert.Len(t, in.Slots, 1, "Inspect does not count an ended lease")
		l, err := c.TryLock(ctx, key, time.Hour, Limit(2))
		require.NoError(t, err, "the crashed holder's slot")
		assert.Greater(t, l.Fence(), live.Fence())
	})
}

func TestLimitWaiterGetsEndedSlot(t *testing.T) {
	// A waiter whose holder crashed is told nothing: it comes back when the earliest
	// lease of the key ends. Real leases, short ones, since it sleeps on its own clock.
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		ctx := context.Background()
		key := uniqueKey(t)
		_, err := c.TryLock(ctx, key, 300*time.Millisecond, Limit(2)) // never released
		require.NoError(t, err)
		_, err = c.TryLock(ctx, key, time.Hour, Limit(2))
		require.NoError(t, err)
		start := time.Now()
		l, err := c.Lock(ctx, key, time.Minute, Limit(2), MaxWait(5*time.Second))
		require.NoError(t, err)
		waited := time.Since(start)
		assert.Less(t, waited, 300*time.Millisecond+300*time.Millisecond/8+200*time.Millisecond, "waited for the ended lease")
		require.NoError(t, l.Unlock(ctx))
	})
}

func TestLimitMismatch(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		ctx := context.Background()
		key := uniqueKey(t)
		s, err := c.TryLock(ctx, key, time.Minute, Limit(3))
		require.NoError(t, err)

		var le *LimitError
		_, err = c.TryLock(ctx, key, time.Minute, Limit(2))
		require.ErrorAs(t, err, &le, "Limit(2) on a key held with Limit(3)")
		assert.Equal(t, LimitError{Key: key, Held: 3, Asked: 2}, *le)
		assert.NotErrorIs(t, err, ErrNotObtained)
		assert.Contains(t, err.Error(), "Limit(3)")

		for name, opts := range map[string][]LockOption{"no Limit": nil, "Limit(1)": {Limit(1)}} {
			_, err = c.Lock(ctx, key, time.Minute, append(opts, MaxWait(time.Second))...)
			require.ErrorAs(t, err, &le, "%s on a key held with Limit(3)", name)
			assert.Equal(t, LimitError{Key: key, Held: 3, Asked: 1}, *le)
			assert.Contains(t, err.Error(), "held with Limit(3), asked with no Limit")
		}
		_, err = c.ForceRelease(ctx, key)
		require.Error(t, err)
		assert.Contains(t, err.Error(), "held with Limit(3) by 1 holders")

		require.NoError(t, s.Unlock(ctx))
		p, err := c.TryLock(ctx, key, time.Minute)
		require.NoError(t, err, "a plain lock once the semaphore is free")
		_, err = c.TryLock(ctx, key, time.Minute, Limit(3))
		require.ErrorAs(t, err, &le, "Limit(3) on a key held by a plain lock")
		assert.Equal(t, LimitError{Key: key, Held: 1, Asked: 3}, *le)
		require.NoError(t, p.Unlock(ctx))

		// A plain lock's tombstone is free; the new limit takes over, fences go on.
		s2, err := c.TryLock(ctx, key, time.Minute, Limit(2))
		require.NoError(t, err)
		assert.Greater(t, s2.Fence(), p.Fence())
		require.NoError(t, p.Unlock(ctx), "the plain release, repeated as after a lost reply, knows itself under the hash")
		in, err := c.Inspect(ctx, key)
		require.NoError(t, err)
		assert.Equal(t, 2, in.Limit)

		// A plain lock finding only holders whose lease ended takes the key.
		endSlot(t, b, c, key, s2.Token())
		p2, err := c.TryLock(ctx, key, time.Minute)
		require.NoError(t, err, "a plain lock on a key whose holders' leases ended")
		assert.Greater(t, p2.Fence(), s2.Fence())
	})
}

func TestLimitIdempotent(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		ctx := context.Background()
		key := uniqueKey(t)
		l1, err := c.TryLock(ctx, key, time.Minute, Limit(2), Token("job-1"))
		require.NoError(t, err)
		other, err := c.TryLock(ctx, key, time.Minute, Limit(2))
		require.NoError(t, err)
		l2, err := c.TryLock(ctx, key, time.Minute, Limit(2), Token("job-1"))
		require.NoError(t, err, "the same token again (a retry after a lost reply)")
		assert.Equal(t, l1.Fence(), l2.Fence(), "the retry gets its slot and fence back")
		in, err := c.Inspect(ctx, key)
		require.NoError(t, err)
		assert.Len(t, in.Slots, 2, "one slot per token")

		require.NoError(t, l1.Unlock(ctx))
		require.NoError(t, l2.Unlock(ctx), "a release repeated after a lost reply")
		// The slot was really freed once: one newcomer gets it, the next does not.
		n, err := c.TryLock(ctx, key, time.Minute, Limit(2))
		require.NoError(t, err)
		_, err = c.TryLock(ctx, key, time.Minute, Limit(2))
		require.ErrorIs(t, err, ErrNotObtained)
		require.NoError(t, n.Unlock(ctx))
		require.NoError(t, other.Unlock(ctx))
		require.NoError(t, l1.Unlock(ctx), "repeated after the key became free")

		stranger := &Lock{c: c, kind: c.slots, key: key, keys: l1.keys, locks: l1.locks, id: identity("never-held")}
		require.ErrorIs(t, stranger.Unlock(ctx), ErrNotHeld, "a token that never held a slot")
	})
}

func TestLimitWithLock(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		ctx := context.Background()
		key := uniqueKey(t)
		const n, workers = 2, 6
		// A lease a loaded machine running -race can renew: beside two busy loops a
		// 60ms one lapsed before a late renewal in 4 of 10 runs (300ms: 1 of 10),
		// which says nothing about Limit(n). fn holds its slot for 2.5 leases.
		const ttl = 500 * time.Millisecond
		var (
			inside, most atomic.Int32
			wg           sync.WaitGroup
		)
		for range workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				err := c.WithLock(ctx, key, ttl, func(ctx context.Context) error {
					now := inside.Add(1)
					defer inside.Add(-1)
					for m := most.Load(); now > m && !most.CompareAndSwap(m, now); m = most.Load() {
					}
					select { // several lease lengths: renewals must keep the slot
					case <-time.After(5 * ttl / 2):
						return nil
					case <-ctx.Done():
						return context.Cause(ctx)
					}
				}, Limit(n))
				assert.NoError(t, err)
			}()
		}
		wg.Wait()
		assert.Equal(t, int32(n), most.Load(), "most holders at once")

	})
}

func TestLimitLostSlotCancelsWithLock(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		ctx := context.Background()
		key := uniqueKey(t)
		other, err := c.TryLock(ctx, key, time.Minute, Limit(2))
		require.NoError(t, err)
		err = c.WithLock(ctx, key, 300*time.Millisecond, func(ctx context.Context) error {
			l, _ := FromContext(ctx)
			endSlot(t, b, c, key, l.Token())
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(10 * time.Second):
				return errors.New("fn was not cancelled")
			}
		}, Limit(2))
		require.ErrorIs(t, err, ErrNotHeld)
		require.NoError(t, other.Unlock(ctx), "the other holder keeps its slot")
	})
}

func TestLimitEvents(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		r := &recorder{}
		c := New(b.rdb, Observe(r.observe))
		ctx := context.Background()
		key := uniqueKey(t)
		l, err := c.TryLock(ctx, key, time.Minute, Limit(2))
		require.NoError(t, err)
		l2, err := c.TryLock(ctx, key, time.Minute, Limit(2))
		require.NoError(t, err)
		_, err = c.TryLock(ctx, key, time.Minute, Limit(2))
		require.ErrorIs(t, err, ErrNotObtained)
		require.NoError(t, l.Unlock(ctx))
		require.NoError(t, l2.Unlock(ctx))
		assert.Equal(t, []Op{OpAcquired, OpAcquired, OpContended, OpNotObtained, OpReleased, OpReleased}, ops(r.take()))
	})
}

func TestLimitPanics(t *testing.T) {
	for _, n := range []int{0, -1, MaxLimit + 1} {
		assert.PanicsWithValue(t, fmt.Sprintf("mutex.Limit: limit %d outside [1, %d] (MaxLimit)", n, MaxLimit), func() { Limit(n) })
	}
	assert.NotPanics(t, func() { Limit(1); Limit(MaxLimit) })
}

func TestLimitLostReplies(t *testing.T) {
	// Real replies lost on the wire (see TestLostReplyRetriedThroughProxy): go-redis
	// sends the script again, which must find its own slot (acquire) or its own
	// release, not report "not obtained" or a lost lease.
	_, p, _, c := throughProxy(t)
	ctx := context.Background()
	key := uniqueKey(t)
	for _, s := range []*store.Script{slotsLockScript, slotsReleaseScript} {
		require.NoError(t, c.run.Load(ctx, s))
	}
	other, err := c.TryLock(ctx, key, time.Minute, Limit(2))
	require.NoError(t, err)

	p.DropReplies(1)
	l, err := c.TryLock(ctx, key, time.Minute, Limit(2))
	require.NoError(t, err, "the retried attempt must find its own slot")
	assert.Equal(t, 1, p.Dropped(), "a reply was dropped")
	in, err := c.Inspect(ctx, key)
	require.NoError(t, err)
	assert.Len(t, in.Slots, 2, "one slot for the attempt and its repeat")

	p.DropReplies(1)
	require.NoError(t, l.Unlock(ctx), "the repeated release finds its own mark")
	assert.Equal(t, 2, p.Dropped())
	in, err = c.Inspect(ctx, key)
	require.NoError(t, err)
	assert.Len(t, in.Slots, 1, "the release freed exactly one slot")
	// Control: without its mark, the repeat would be told the slot is not held.
	n, err := c.run.Run(ctx, slotsReleaseScript, []string{l.keys[0], l.keys[1], l.keys[0] + releasedInfix + "none"},
		l.id, "", c.channels, c.countsSubscribers, tombstoneMillis, l.fence, "").Int64Slice()
	require.NoError(t, err)
	assert.Equal(t, []int64{0}, n, "control: a repeated release without its mark")

	err = c.WithLock(ctx, key, time.Minute, func(context.Context) error {
		p.DropReplies(1) // the release's reply, after fn returns
		return nil
	}, Limit(2))
	require.NoError(t, err, "WithLock must not report a lost lease")
	assert.Equal(t, 3, p.Dropped())
	require.NoError(t, other.Unlock(ctx))
}
