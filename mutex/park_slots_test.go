package mutex

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The parked tasks of a lock with Limit(n): the same line as a plain lock's
// (park_test.go), in the slots' queue.

// holdSlotsAndPark takes both slots of key with Limit(2) (leases of 10s, the first
// with opts) and parks tickets behind them, in order, with claims of 5s; it returns
// the holders.
func holdSlotsAndPark(t *testing.T, c *Client, key string, opts []LockOption, tickets ...string) (*Lock, *Lock) {
	t.Helper()
	ctx := context.Background()
	h1, err := c.Lock(ctx, key, 10*time.Second, append(opts, Limit(2))...)
	require.NoError(t, err)
	h2, err := c.Lock(ctx, key, 10*time.Second, Limit(2))
	require.NoError(t, err)
	for _, tk := range tickets {
		_, err = c.Lock(ctx, key, 10*time.Second, Limit(2), Park(tk, 5*time.Second, ParkAfterWait), MaxWait(time.Millisecond))
		require.ErrorIs(t, err, ErrParked)
	}
	return h1, h2
}

// slotsLineOf is the entries of the line of key, a lock with Limit(n).
func slotsLineOf(t *testing.T, b backend, c *Client, key string) []parsedEntry {
	t.Helper()
	return queueOf(t, b, c.redisKey(key)+slotsSuffix)
}

// ticketsOf is the tickets of line's entries, "" for a waiter's.
func ticketsOf(line []parsedEntry) []string {
	var out []string
	for _, e := range line {
		out = append(out, e.ticket)
	}
	return out
}

func TestSlotsParkedTaskIsHandedASlotAndStarted(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		ctx := context.Background()
		c := New(b.rdb)
		key := uniqueKey(t)
		s := newStarts()
		h1, h2 := holdSlotsAndPark(t, c, key, []LockOption{StartWith(s.start)})
		_, err := c.Lock(ctx, key, 10*time.Second, Limit(2), Park("t1", 5*time.Second, ParkAfterWait), MaxWait(time.Millisecond), HeldBy("pay", "t1"))
		require.ErrorIs(t, err, ErrParked)
		require.ErrorIs(t, err, ErrNotObtained)
		line := slotsLineOf(t, b, c, key)
		require.Len(t, line, 1)
		assert.True(t, line[0].parked)
		assert.Equal(t, "t1", line[0].ticket)
		assert.Equal(t, "pay", line[0].Name)
		in, err := c.Inspect(ctx, key)
		require.NoError(t, err)
		assert.Equal(t, 1, in.Parked, "Inspect counts the slots' parked tasks")

		require.NoError(t, h1.Unlock(ctx))
		assert.Equal(t, Parked{Key: key, Ticket: "t1"}, s.next(t, 5*time.Second))
		in, err = c.Inspect(ctx, key)
		require.NoError(t, err)
		require.Len(t, in.Slots, 2, "the freed slot waits for its ticket's task")
		assert.Equal(t, "pay", in.Holder.Name)
		assert.Greater(t, in.Fence, h2.Fence())
		inLine, err := Parked{Key: key, Ticket: "t1", c: c, lock: c.redisKey(key)}.InLine(ctx)
		require.NoError(t, err)
		assert.True(t, inLine, "handed a slot")

		_, err = c.TryLock(ctx, key, time.Second, Limit(2))
		require.ErrorIs(t, err, ErrNotObtained, "both slots are taken")
		l, err := c.Lock(ctx, key, 10*time.Second, Limit(2), Park("t1", 5*time.Second, ParkAfterWait), MaxWait(time.Millisecond))
		require.NoError(t, err)
		assert.Equal(t, in.Fence, l.Fence(), "the fence of the hand-over")
		d, err := l.TTL(ctx)
		require.NoError(t, err)
		assert.Greater(t, d, 5*time.Second, "its own lease")
		in, err = c.Inspect(ctx, key)
		require.NoError(t, err)
		assert.Len(t, in.Slots, 2, "claimed: its slot, not another")
		require.NoError(t, l.Unlock(ctx))
		require.NoError(t, h2.Unlock(ctx))
		assert.Empty(t, slotsLineOf(t, b, c, key))
	})
}

func TestSlotsLineServesParkedAndWaitingInOrder(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		ctx := context.Background()
		c := New(b.rdb)
		key := uniqueKey(t)
		s := newStarts()
		h1, h2 := holdSlotsAndPark(t, c, key, []LockOption{StartWith(s.start)}, "a")
		got := make(chan *Lock, 1)
		go func() {
			l, err := c.Lock(ctx, key, 10*time.Second, Limit(2), MaxWait(10*time.Second))
			assert.NoError(t, err)
			got <- l
		}()
		waitForWaiters(t, b, c, key, 2)
		_, err := c.Lock(ctx, key, 10*time.Second, Limit(2), Park("c", 5*time.Second, ParkAfterWait), MaxWait(time.Millisecond))
		require.ErrorIs(t, err, ErrParked)
		require.Equal(t, []string{"a", "", "c"}, ticketsOf(slotsLineOf(t, b, c, key)))

		require.NoError(t, h1.Unlock(ctx))
		assert.Equal(t, Parked{Key: key, Ticket: "a"}, s.next(t, 5*time.Second), "the first freed slot goes to a")
		select {
		case <-got:
			t.Fatal("the waiter behind a was handed a slot")
		default:
		}
		require.NoError(t, h2.Unlock(ctx)) // no Starter: c is marked on its way
		w := <-got
		require.NotNil(t, w, "the next freed slot goes to the waiter")
		line := slotsLineOf(t, b, c, key)
		require.Len(t, line, 1)
		assert.True(t, line[0].started, "c, at the head, is started ahead")
		require.NoError(t, w.Unlock(ctx))
	})
}

func TestSlotsParkLeadWaitsAlone(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		ctx := context.Background()
		c := New(b.rdb)
		key := uniqueKey(t)
		h1, h2 := holdSlotsAndPark(t, c, key, nil)
		lead := make(chan *Lock, 1)
		go func() {
			l, err := c.Lock(ctx, key, 10*time.Second, Limit(2), Park("a", 5*time.Second, ParkLead), MaxWait(10*time.Second))
			assert.NoError(t, err)
			lead <- l
		}()
		waitForWaiters(t, b, c, key, 1)
		_, err := c.Lock(ctx, key, 10*time.Second, Limit(2), Park("b", 5*time.Second, ParkLead), MaxWait(10*time.Second))
		require.ErrorIs(t, err, ErrParked, "someone waits in a process already")
		require.NoError(t, h1.Unlock(ctx))
		a := <-lead
		require.NotNil(t, a)
		require.NoError(t, a.Unlock(ctx))
		require.NoError(t, h2.Unlock(ctx))
	})
}

func TestSlotsGoneTicketPassesTheSlotOn(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		ctx := context.Background()
		c := New(b.rdb)
		key := uniqueKey(t)
		s := newStarts()
		s.gone["gone"] = true
		h1, _ := holdSlotsAndPark(t, c, key, []LockOption{StartWith(s.start)}, "gone", "next")
		require.NoError(t, h1.Unlock(ctx))
		assert.Equal(t, "gone", s.next(t, 5*time.Second).Ticket)
		assert.Equal(t, "next", s.next(t, 5*time.Second).Ticket, "the slot went on to the next")
		assert.Empty(t, slotsLineOf(t, b, c, key))
		_, err := c.TryLock(ctx, key, time.Second, Limit(2), Park("gone", 5*time.Second, ParkAfterWait))
		require.ErrorIs(t, err, ErrNotObtained, "the gone ticket no longer holds a slot")
		l, err := c.TryLock(ctx, key, time.Second, Limit(2), Park("next", 5*time.Second, ParkAfterWait))
		require.NoError(t, err, "next claims the slot handed to it")
		require.NoError(t, l.Unlock(ctx))
	})
}

func TestSlotsClaimThatEndsFreesTheSlotForTheLine(t *testing.T) {
	// A slot handed to a ticket nobody starts frees when its claim ends; the next
	// attempt serves the line with it, and its Starter starts the next parked task.
	each(t, func(t *testing.T, b backend) {
		ctx := context.Background()
		c := New(b.rdb)
		key := uniqueKey(t)
		claim := 300 * time.Millisecond
		h1, h2 := holdSlotsAndPark(t, c, key, nil)
		for _, tk := range []string{"a", "b"} {
			_, err := c.Lock(ctx, key, 10*time.Second, Limit(2), Park(tk, claim, ParkAfterWait), MaxWait(time.Millisecond))
			require.ErrorIs(t, err, ErrParked)
		}
		require.NoError(t, h1.Unlock(ctx)) // no Starter: nobody starts a
		in, err := c.Inspect(ctx, key)
		require.NoError(t, err)
		require.Len(t, in.Slots, 2, "a slot handed to a")
		require.Eventually(t, func() bool {
			in, err := c.Inspect(ctx, key)
			return err == nil && len(in.Slots) == 1
		}, 20*claim, claim/10, "a's claim ends")
		s := newStarts()
		_, err = c.TryLock(ctx, key, time.Second, Limit(2), StartWith(s.start))
		require.ErrorIs(t, err, ErrNotObtained, "the freed slot goes to the line first")
		assert.Equal(t, Parked{Key: key, Ticket: "b", Started: true}, s.next(t, 5*time.Second),
			"b, started ahead when a was handed its slot, is handed the slot a left")
		require.NoError(t, h2.Unlock(ctx))
	})
}

func TestSlotsParkedTaskArrivingEarlyKeepsItsPlace(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		ctx := context.Background()
		c := New(b.rdb)
		key := uniqueKey(t)
		holdSlotsAndPark(t, c, key, nil, "x", "y", "z")
		_, err := c.Lock(ctx, key, 10*time.Second, Limit(2), Park("y", 5*time.Second, ParkLead), MaxWait(time.Millisecond))
		require.ErrorIs(t, err, ErrNotObtained)
		assert.Equal(t, []string{"x", "y", "z"}, ticketsOf(slotsLineOf(t, b, c, key)))
	})
}

func TestSlotsRepeatedReleaseStillStartsItsTickets(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		ctx := context.Background()
		c := New(b.rdb)
		key := uniqueKey(t)
		h1, _ := holdSlotsAndPark(t, c, key, nil, "t1", "t2")
		_, first, err := c.slots.release(ctx, h1.keys, h1.id, "", h1.fence, "")
		require.NoError(t, err)
		require.Equal(t, []string{"t1", "t2"}, ticketsOfHanded(first), "t1 handed a slot, t2 started ahead") // this reply is lost
		r, again, err := c.slots.release(ctx, h1.keys, h1.id, "", h1.fence, "")
		require.NoError(t, err)
		require.Equal(t, releasedOK, r)
		assert.Equal(t, []string{"t1", "t2"}, ticketsOfHanded(again), "the repeat names them again")
		l, err := c.TryLock(ctx, key, time.Second, Limit(2), Park("t1", 5*time.Second, ParkNever))
		require.NoError(t, err)
		_, again, err = c.slots.release(ctx, h1.keys, h1.id, "", h1.fence, "")
		require.NoError(t, err)
		assert.Equal(t, []string{"t2"}, ticketsOfHanded(again), "not t1, which claimed its slot")
		require.NoError(t, l.Unlock(ctx))
	})
}

// ticketsOfHanded is the tickets of hs.
func ticketsOfHanded(hs []handed) []string {
	var out []string
	for _, h := range hs {
		out = append(out, h.ticket)
	}
	return out
}

func TestSlotsParkNeverClaimsAndWaitsInItsPlace(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		ctx := context.Background()
		c := New(b.rdb)
		key := uniqueKey(t)
		h1, h2 := holdSlotsAndPark(t, c, key, nil, "a", "b")
		got := make(chan *Lock, 1)
		go func() {
			l, err := c.Lock(ctx, key, 10*time.Second, Limit(2), Park("a", 5*time.Second, ParkNever), MaxWait(10*time.Second))
			assert.NoError(t, err)
			got <- l
		}()
		require.Eventually(t, func() bool {
			line := slotsLineOf(t, b, c, key)
			return len(line) == 2 && !line[0].parked && line[1].ticket == "b"
		}, 5*time.Second, 5*time.Millisecond, "a waits in its entry's place, ahead of b")
		require.NoError(t, h1.Unlock(ctx))
		a := <-got
		require.NotNil(t, a)
		require.NoError(t, a.Unlock(ctx)) // hands the slot to b, which nobody starts

		l, err := c.TryLock(ctx, key, 10*time.Second, Limit(2), Park("b", 5*time.Second, ParkNever))
		require.NoError(t, err, "one attempt claims the slot handed to its ticket")
		_, err = c.Lock(ctx, key, 10*time.Second, Limit(2), Park("c", 5*time.Second, ParkNever), MaxWait(time.Millisecond))
		require.ErrorIs(t, err, ErrNotObtained, "ParkNever does not park")
		require.NotErrorIs(t, err, ErrParked)
		assert.Empty(t, slotsLineOf(t, b, c, key))
		require.NoError(t, l.Unlock(ctx))
		require.NoError(t, h2.Unlock(ctx))
	})
}

func TestSlotsLineOutlivesItsParkedTasks(t *testing.T) {
	// A waiter that queues behind parked tasks must not shorten the line's life to
	// its own (twice the holders' lease and a second): the parked tasks come back
	// only after their claim.
	each(t, func(t *testing.T, b backend) {
		ctx := context.Background()
		c := New(b.rdb)
		key := uniqueKey(t)
		holdSlotsAndPark(t, c, key, nil, "a") // leases of 10s, a claim of 5s
		_, err := c.Lock(ctx, key, 10*time.Second, Limit(2), MaxWait(50*time.Millisecond))
		require.ErrorIs(t, err, ErrNotObtained)
		d, err := b.admin.PTTL(ctx, c.redisKey(key)+slotsSuffix).Result()
		require.NoError(t, err)
		assert.Greater(t, d, 21*time.Second, "the line lives past the parked task's return")
		assert.Equal(t, []string{"a"}, ticketsOf(slotsLineOf(t, b, c, key)))
	})
}

func TestInspectShowsTheSlotsLineOfAFreeKey(t *testing.T) {
	// A Limit(n) key whose holders all left (a claim that ended) may keep its line:
	// Inspect, which cannot tell the kind of a free key, shows it when the plain
	// queue is empty.
	each(t, func(t *testing.T, b backend) {
		ctx := context.Background()
		c := New(b.rdb)
		key := uniqueKey(t)
		rkey := c.redisKey(key)
		require.NoError(t, b.admin.RPush(ctx, rkey+slotsSuffix, "~.a 5000 1 "+parkedIdentity("a")+parkedDescription(heldBy{name: "pay", id: "a"})).Err())
		in, err := c.Inspect(ctx, key)
		require.NoError(t, err)
		assert.False(t, in.Held)
		assert.Equal(t, 1, in.Waiting)
		assert.Equal(t, 1, in.Parked)
		require.Len(t, in.Waiters, 1)
		assert.Equal(t, "pay", in.Waiters[0].Name)
		// A plain line has the key's queue: it is the one shown.
		require.NoError(t, b.admin.RPush(ctx, rkey+waitSuffix, "~.b 5000 1 "+parkedIdentity("b")+parkedDescription(heldBy{name: "plain", id: "b"})).Err())
		in, err = c.Inspect(ctx, key)
		require.NoError(t, err)
		require.Len(t, in.Waiters, 1)
		assert.Equal(t, "plain", in.Waiters[0].Name)
	})
}
