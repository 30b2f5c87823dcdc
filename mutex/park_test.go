package mutex

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// starts records what a Starter was asked, and answers gone for the tickets in gone.
type starts struct {
	mu   sync.Mutex
	got  []Parked
	gone map[string]bool
	ch   chan Parked
}

func newStarts() *starts { return &starts{gone: map[string]bool{}, ch: make(chan Parked, 16)} }

func (s *starts) start(_ context.Context, p Parked) bool {
	p = Parked{Key: p.Key, Ticket: p.Ticket, Started: p.Started, Replaced: p.Replaced} // what a Starter is told
	s.mu.Lock()
	s.got = append(s.got, p)
	gone := s.gone[p.Ticket]
	s.mu.Unlock()
	s.ch <- p
	return gone
}

// next is the next ticket the Starter was asked to start, within d.
func (s *starts) next(t *testing.T, d time.Duration) Parked {
	t.Helper()
	select {
	case p := <-s.ch:
		return p
	case <-time.After(d):
		t.Fatalf("no ticket started within %v", d)
		return Parked{}
	}
}

// none checks that nothing is started within d.
func (s *starts) none(t *testing.T, d time.Duration) {
	t.Helper()
	select {
	case p := <-s.ch:
		t.Fatalf("started %+v", p)
	case <-time.After(d):
	}
}

// holdAndPark takes key with a 10s lease and parks tickets behind it, in order, with
// claims of 5s; it returns the holder.
func holdAndPark(t *testing.T, c *Client, key string, tickets ...string) *Lock {
	t.Helper()
	ctx := context.Background()
	h, err := c.Lock(ctx, key, 10*time.Second)
	require.NoError(t, err)
	for _, tk := range tickets {
		_, err = c.Lock(ctx, key, 10*time.Second, Park(tk, 5*time.Second, ParkAfterWait), MaxWait(time.Millisecond))
		require.ErrorIs(t, err, ErrParked)
	}
	return h
}

// lineOf is the entries of key's line, parked ones and waiters, oldest first.
func lineOf(t *testing.T, b backend, c *Client, key string) []parsedEntry {
	t.Helper()
	return queueOf(t, b, c.redisKey(key)+waitSuffix)
}

// queueOf is the entries of the queue at Redis key q, oldest first.
func queueOf(t *testing.T, b backend, q string) []parsedEntry {
	t.Helper()
	es, err := b.admin.LRange(context.Background(), q, 0, -1).Result()
	require.NoError(t, err)
	var out []parsedEntry
	for _, e := range es {
		out = append(out, readEntry(e))
	}
	return out
}

func TestParkedTaskIsHandedTheLockAndStarted(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		ctx := context.Background()
		c := New(b.rdb)
		key := uniqueKey(t)
		s := newStarts()
		h, err := c.Lock(ctx, key, 10*time.Second, StartWith(s.start))
		require.NoError(t, err)

		// Parks at once, after no wait in the process.
		_, err = c.Lock(ctx, key, 10*time.Second, Park("t1", 5*time.Second, ParkAfterWait), MaxWait(time.Millisecond), HeldBy("pay", "t1"))
		require.ErrorIs(t, err, ErrParked)
		require.ErrorIs(t, err, ErrNotObtained)
		line := lineOf(t, b, c, key)
		require.Len(t, line, 1)
		assert.True(t, line[0].parked)
		assert.False(t, line[0].started)
		assert.Equal(t, "t1", line[0].ticket)
		assert.Equal(t, "pay", line[0].Name)
		assert.WithinDuration(t, time.Now(), line[0].since, 5*time.Second)

		// Parking again keeps one entry.
		_, err = c.Lock(ctx, key, 10*time.Second, Park("t1", 5*time.Second, ParkAfterWait), MaxWait(time.Millisecond), HeldBy("pay", "t1"))
		require.ErrorIs(t, err, ErrParked)
		require.Len(t, lineOf(t, b, c, key), 1)

		require.NoError(t, h.Unlock(ctx))
		p := s.next(t, 5*time.Second)
		assert.Equal(t, Parked{Key: key, Ticket: "t1"}, p)
		in, err := c.Inspect(ctx, key)
		require.NoError(t, err)
		require.True(t, in.Held, "the lock waits for its ticket's task")
		assert.Equal(t, "pay", in.Holder.Name)
		assert.Greater(t, in.Fence, h.Fence())
		assert.LessOrEqual(t, in.TTL, 5*time.Second, "for the claim")

		// Someone else finds it busy; the ticket's task claims it.
		_, err = c.TryLock(ctx, key, time.Second)
		require.ErrorIs(t, err, ErrNotObtained)
		l, err := c.Lock(ctx, key, 10*time.Second, Park("t1", 5*time.Second, ParkAfterWait), MaxWait(time.Millisecond))
		require.NoError(t, err)
		assert.Equal(t, in.Fence, l.Fence(), "the fence of the hand-over")
		d, err := l.TTL(ctx)
		require.NoError(t, err)
		assert.Greater(t, d, 5*time.Second, "its own lease")
		require.NoError(t, l.Unlock(ctx))
		assert.Empty(t, lineOf(t, b, c, key))
	})
}

func TestParkLeadWaitsAndTheNextIsStartedAhead(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		ctx := context.Background()
		c := New(b.rdb)
		key := uniqueKey(t)
		s := newStarts()
		h, err := c.Lock(ctx, key, 10*time.Second)
		require.NoError(t, err)

		lead := make(chan *Lock, 1)
		go func() {
			l, err := c.Lock(ctx, key, 10*time.Second, Park("a", 5*time.Second, ParkLead), MaxWait(10*time.Second), StartWith(s.start))
			assert.NoError(t, err)
			lead <- l
		}()
		waitForWaiters(t, b, c, key, 1)
		_, err = c.Lock(ctx, key, 10*time.Second, Park("b", 5*time.Second, ParkLead), MaxWait(10*time.Second))
		require.ErrorIs(t, err, ErrParked, "someone waits in a process already")
		_, err = c.Lock(ctx, key, 10*time.Second, Park("c", 5*time.Second, ParkLead), MaxWait(10*time.Second))
		require.ErrorIs(t, err, ErrParked)

		require.NoError(t, h.Unlock(ctx))
		a := <-lead
		require.NotNil(t, a)
		// The releaser had no Starter: b is marked started, its start left to its
		// fallback; with one (a's), the next hand-over starts the head.
		line := lineOf(t, b, c, key)
		require.Len(t, line, 2)
		assert.True(t, line[0].started, "b is on its way")
		assert.Equal(t, "b", line[0].ticket)
		assert.False(t, line[1].started)

		// b arrives while a holds: it waits in its place, as a waiter.
		gotB := make(chan *Lock, 1)
		go func() {
			l, err := c.Lock(ctx, key, 10*time.Second, Park("b", 5*time.Second, ParkLead), MaxWait(10*time.Second), StartWith(s.start))
			assert.NoError(t, err)
			gotB <- l
		}()
		require.Eventually(t, func() bool {
			line := lineOf(t, b, c, key)
			return len(line) == 2 && !line[0].parked
		}, 5*time.Second, 5*time.Millisecond, "b's entry became its waiter's, in its place")

		require.NoError(t, a.Unlock(ctx))
		lb := <-gotB
		require.NotNil(t, lb)
		p := s.next(t, 5*time.Second)
		assert.Equal(t, Parked{Key: key, Ticket: "c"}, p, "a's release started c ahead of its turn")
		s.none(t, 100*time.Millisecond)
		require.NoError(t, lb.Unlock(ctx))
		p = s.next(t, 5*time.Second)
		assert.Equal(t, Parked{Key: key, Ticket: "c", Started: true}, p, "b's release handed c the lock")
	})
}

func TestGoneTicketPassesTheLockOn(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		ctx := context.Background()
		c := New(b.rdb)
		key := uniqueKey(t)
		s := newStarts()
		s.gone["gone"] = true
		h, err := c.Lock(ctx, key, 10*time.Second, StartWith(s.start))
		require.NoError(t, err)
		for _, tk := range []string{"gone", "next"} {
			_, err = c.Lock(ctx, key, 10*time.Second, Park(tk, 5*time.Second, ParkAfterWait), MaxWait(time.Millisecond))
			require.ErrorIs(t, err, ErrParked)
		}
		require.NoError(t, h.Unlock(ctx))
		assert.Equal(t, "gone", s.next(t, 5*time.Second).Ticket)
		assert.Equal(t, "next", s.next(t, 5*time.Second).Ticket, "the lock went on to the next")
		in, err := c.Inspect(ctx, key)
		require.NoError(t, err)
		assert.True(t, in.Held)
		assert.Empty(t, lineOf(t, b, c, key))
		_, err = c.TryLock(ctx, key, time.Second, Park("gone", 5*time.Second, ParkAfterWait))
		require.ErrorIs(t, err, ErrNotObtained, "the gone ticket no longer holds it")
	})
}

func TestParkedTicketNobodyStartsFreesAtItsClaim(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		ctx := context.Background()
		c := New(b.rdb)
		key := uniqueKey(t)
		h, err := c.Lock(ctx, key, 10*time.Second)
		require.NoError(t, err)
		claim := 300 * time.Millisecond
		_, err = c.Lock(ctx, key, 10*time.Second, Park("t", claim, ParkAfterWait), MaxWait(time.Millisecond))
		require.ErrorIs(t, err, ErrParked)
		require.NoError(t, h.Unlock(ctx)) // no Starter: nobody starts t
		in, err := c.Inspect(ctx, key)
		require.NoError(t, err)
		require.True(t, in.Held, "handed to t")
		assert.LessOrEqual(t, in.TTL, claim)
		b.expire(t, c.redisKey(key))
		_, err = c.TryLock(ctx, key, time.Second)
		require.NoError(t, err, "free once its claim ended")
	})
}

func TestParkedTaskArrivingEarlyKeepsItsPlace(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		ctx := context.Background()
		c := New(b.rdb)
		key := uniqueKey(t)
		h := holdAndPark(t, c, key, "x", "y", "z")
		// y comes back by its fallback, or run by hand: it parks again in its place.
		_, err := c.Lock(ctx, key, 10*time.Second, Park("y", 5*time.Second, ParkLead), MaxWait(time.Millisecond))
		require.ErrorIs(t, err, ErrNotObtained)
		var tickets []string
		for _, e := range lineOf(t, b, c, key) {
			tickets = append(tickets, e.ticket)
		}
		assert.Equal(t, []string{"x", "y", "z"}, tickets)
		require.NoError(t, h.Unlock(ctx))
	})
}

func TestParkRefusesWhatItCannotPark(t *testing.T) {
	for _, bad := range []string{"", "a b", strings.Repeat("x", 1001)} {
		assert.Panics(t, func() { Park(bad, time.Second, ParkLead) }, "ticket %q", bad)
	}
	assert.Panics(t, func() { Park("t", time.Millisecond, ParkLead) })
}

func TestLineOutlivesALongHolder(t *testing.T) {
	// A key held, and renewed, for longer than three claims: its parked tasks come
	// back by their fallback and park again in place, which keeps the line, in order.
	m := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	t.Cleanup(func() { rdb.Close() })
	ctx := context.Background()
	c := New(rdb)
	h, err := c.Lock(ctx, "k", 2*time.Second)
	require.NoError(t, err)
	park := func(tk string) {
		_, err := c.Lock(ctx, "k", 2*time.Second, Park(tk, time.Second, ParkAfterWait), MaxWait(time.Millisecond))
		require.ErrorIs(t, err, ErrParked)
	}
	park("a")
	park("b")
	for range 30 { // each task comes back every second, in any order
		m.FastForward(time.Second)
		require.NoError(t, h.Extend(ctx, 2*time.Second))
		park("b")
		park("a")
	}
	var tickets []string
	for _, e := range lineOf(t, backend{admin: rdb}, c, "k") {
		tickets = append(tickets, e.ticket)
	}
	require.Equal(t, []string{"a", "b"}, tickets, "the line kept its order")
}

func TestRepeatedReleaseStillStartsItsTickets(t *testing.T) {
	// A release whose reply is lost is sent again (by go-redis, or the release's own
	// retry): the repeat names again the tickets to start, the one handed the lock
	// and the one started ahead.
	each(t, func(t *testing.T, b backend) {
		ctx := context.Background()
		c := New(b.rdb)
		key := uniqueKey(t)
		h := holdAndPark(t, c, key, "t1", "t2")
		_, first, err := c.plain.release(ctx, h.keys, h.id, "", h.fence, "")
		require.NoError(t, err)
		require.Len(t, first, 2, "t1 handed the lock, t2 started ahead") // this reply is lost
		r, again, err := c.plain.release(ctx, h.keys, h.id, "", h.fence, "")
		require.NoError(t, err)
		require.Equal(t, releasedOK, r)
		var tickets []string
		for _, x := range again {
			tickets = append(tickets, x.ticket)
		}
		assert.Equal(t, []string{"t1", "t2"}, tickets, "the repeat names them again")
	})
}

func TestForceReleaseStartsNobodyAhead(t *testing.T) {
	// A release by force hands the lock to a parked task it cannot start, and marks
	// nobody as on their way: the next task to arrive starts the head.
	each(t, func(t *testing.T, b backend) {
		ctx := context.Background()
		c := New(b.rdb)
		key := uniqueKey(t)
		holdAndPark(t, c, key, "t1", "t2")
		_, err := c.ForceRelease(ctx, key)
		require.NoError(t, err)
		line := lineOf(t, b, c, key)
		require.Len(t, line, 1)
		assert.False(t, line[0].started, "t2 is not marked as on its way")
		s := newStarts()
		_, err = c.Lock(ctx, key, 10*time.Second, Park("t3", 5*time.Second, ParkLead), MaxWait(10*time.Second), StartWith(s.start))
		require.ErrorIs(t, err, ErrParked, "t1 holds the claim and t2 waits; t3 parks")
		assert.Equal(t, Parked{Key: key, Ticket: "t2"}, s.next(t, 5*time.Second), "and starts the head, as nobody is on the way")
	})
}

func TestParkNeverClaimsAndWaitsInItsPlace(t *testing.T) {
	// A task that must not park (its last try) still has its ticket: it takes the
	// lock handed to it, in one attempt, or waits in its parked entry's place.
	each(t, func(t *testing.T, b backend) {
		ctx := context.Background()
		c := New(b.rdb)
		key := uniqueKey(t)
		h := holdAndPark(t, c, key, "a", "b")
		got := make(chan *Lock, 1)
		go func() {
			l, err := c.Lock(ctx, key, 10*time.Second, Park("a", 5*time.Second, ParkNever), MaxWait(10*time.Second))
			assert.NoError(t, err)
			got <- l
		}()
		require.Eventually(t, func() bool {
			line := lineOf(t, b, c, key)
			return len(line) == 2 && !line[0].parked && line[1].ticket == "b"
		}, 5*time.Second, 5*time.Millisecond, "a waits in its entry's place, ahead of b")
		require.NoError(t, h.Unlock(ctx))
		a := <-got
		require.NotNil(t, a)
		require.NoError(t, a.Unlock(ctx)) // hands the lock to b, which nobody starts

		l, err := c.TryLock(ctx, key, 10*time.Second, Park("b", 5*time.Second, ParkNever))
		require.NoError(t, err, "one attempt claims the lock handed to its ticket")
		require.NoError(t, l.Unlock(ctx))
	})
}

func TestParkedInLine(t *testing.T) {
	// A Starter asks whether a ticket still stands in its line before it reports its
	// task gone: parked, handed the lock, and no longer once its task took the lock.
	each(t, func(t *testing.T, b backend) {
		ctx := context.Background()
		c := New(b.rdb)
		key := uniqueKey(t)
		h := holdAndPark(t, c, key, "a")
		inLine := func(ticket string) bool {
			t.Helper()
			in, err := Parked{Key: key, Ticket: ticket, c: c, lock: c.redisKey(key)}.InLine(ctx)
			require.NoError(t, err)
			return in
		}
		assert.True(t, inLine("a"), "parked")
		assert.False(t, inLine("b"), "never parked")
		require.NoError(t, h.Unlock(ctx)) // hands the lock to a, which nobody starts
		assert.True(t, inLine("a"), "handed the lock")
		l, err := c.TryLock(ctx, key, 10*time.Second, Park("a", 5*time.Second, ParkNever))
		require.NoError(t, err)
		assert.False(t, inLine("a"), "its task took the lock")
		require.NoError(t, l.Unlock(ctx))
		_, err = Parked{Key: key, Ticket: "a"}.InLine(ctx)
		assert.Error(t, err, "a Parked no Starter was given")
	})
}

// parkBehind parks tickets on key (with opts, claims of 5s) behind holders whose
// leases are at most 10s, checking that each park tells the lease left.
func parkBehind(t *testing.T, c *Client, key string, opts []LockOption, tickets ...string) {
	t.Helper()
	for _, tk := range tickets {
		_, err := c.Lock(context.Background(), key, 10*time.Second,
			append(opts, Park(tk, 5*time.Second, ParkAfterWait), MaxWait(time.Millisecond))...)
		require.ErrorIs(t, err, ErrParked)
		require.ErrorIs(t, err, ErrNotObtained)
		left, ok := LeaseLeft(err)
		require.True(t, ok, "LeaseLeft(%v)", err)
		assert.Positive(t, left, "the holder's lease left")
		assert.LessOrEqual(t, left, 10*time.Second)
	}
}

func TestParkTellsTheLeaseLeft(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		ctx := context.Background()
		c := New(b.rdb)
		for _, tc := range []struct {
			opts    []LockOption
			holders int // that take every slot
		}{{nil, 1}, {[]LockOption{Limit(2)}, 2}} {
			key := uniqueKey(t)
			for range tc.holders {
				_, err := c.Lock(ctx, key, 10*time.Second, tc.opts...)
				require.NoError(t, err)
			}
			parkBehind(t, c, key, tc.opts, "a", "b")
			// No hash is left for List to meet (TestOperatorACLSuffices).
			rkey := c.redisKey(key)
			require.NoError(t, b.admin.Del(ctx, rkey, rkey+waitSuffix, rkey+slotsSuffix).Err())
		}
	})
}

func TestLeaseLeftOnlyForAParkedAcquisition(t *testing.T) {
	for _, err := range []error{nil, ErrNotObtained, ErrParked, join(ErrNotObtained, ErrParked)} {
		_, ok := LeaseLeft(err)
		assert.False(t, ok, "LeaseLeft(%v)", err)
	}
	err := error(&parkedError{left: time.Second})
	assert.Equal(t, join(ErrNotObtained, ErrParked).Error(), err.Error(), "the text of the two joined")
	left, ok := LeaseLeft(join(err, context.Canceled))
	assert.True(t, ok)
	assert.Equal(t, time.Second, left)
}
