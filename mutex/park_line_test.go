package mutex

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A line's cap (MaxLine): a newcomer is refused, or replaces the oldest parked entry,
// in the script call that would have parked it.

// queueTickets is the queue at Redis key q: each entry's ticket, "^" before a started
// one's, and "waiter" for a waiter's.
func queueTickets(t *testing.T, p parkedSet, q string) []string {
	t.Helper()
	es, err := p.admin.LRange(context.Background(), q, 0, -1).Result()
	require.NoError(t, err)
	out := []string{}
	for _, e := range es {
		switch pe := readEntry(e); {
		case !pe.parked:
			out = append(out, "waiter")
		case pe.started:
			out = append(out, "^"+pe.ticket)
		default:
			out = append(out, pe.ticket)
		}
	}
	return out
}

// parkCapped parks ticket at key (ParkAfterWait after no wait) with opts, and returns
// the acquisition's error.
func parkCapped(p parkedSet, key, ticket string, opts ...LockOption) error {
	_, err := p.c.Lock(context.Background(), key, 10*time.Second,
		append([]LockOption{Park(ticket, 5*time.Second, ParkAfterWait), MaxWait(time.Millisecond)}, opts...)...)
	return err
}

// replaced is the next ticket s was told had left its line to make room.
func (s *starts) replaced(t *testing.T) string {
	t.Helper()
	for range 10 { // tickets started ahead come first, if any
		p := s.next(t, 5*time.Second)
		if p.Replaced {
			return p.Ticket
		}
	}
	t.Fatal("no replaced ticket among 10 told")
	return ""
}

func TestMaxLineRefusesNewcomer(t *testing.T) {
	eachForSets(t, func(t *testing.T, p parkedSet) {
		key := uniqueKey(t)
		q := p.c.redisKey(key) + waitSuffix
		h := holdAndPark(t, p.c, key, "t1", "t2")
		defer h.Unlock(context.Background())

		err := parkCapped(p, key, "t3", MaxLine(2, false))
		require.ErrorIs(t, err, ErrLineFull)
		require.ErrorIs(t, err, ErrNotObtained)
		require.NotErrorIs(t, err, ErrParked)
		assert.Equal(t, []string{"t1", "t2"}, queueTickets(t, p, q), "a refused newcomer changes nothing")

		// A ticket already in the line keeps its place however full the line is.
		require.ErrorIs(t, parkCapped(p, key, "t1", MaxLine(1, false)), ErrParked)
		require.ErrorIs(t, parkCapped(p, key, "t2", MaxLine(1, true)), ErrParked)
		assert.Equal(t, []string{"t1", "t2"}, queueTickets(t, p, q))

		// Below the cap, the newcomer parks.
		require.ErrorIs(t, parkCapped(p, key, "t3", MaxLine(3, false)), ErrParked)
		assert.Equal(t, []string{"t1", "t2", "t3"}, queueTickets(t, p, q))
	})
}

func TestMaxLineReplacesOldestParked(t *testing.T) {
	eachForSets(t, func(t *testing.T, p parkedSet) {
		key := uniqueKey(t)
		q := p.c.redisKey(key) + waitSuffix
		s := newStarts()
		h := holdAndPark(t, p.c, key, "t1", "t2", "t3")
		defer h.Unlock(context.Background())

		err := parkCapped(p, key, "t4", MaxLine(3, true), StartWith(s.start))
		require.ErrorIs(t, err, ErrParked)
		assert.Equal(t, []string{"t2", "t3", "t4"}, queueTickets(t, p, q))
		assert.Equal(t, "t1", s.replaced(t))

		// An attempt sent twice (a lost reply's resend) replaces once: the second
		// finds its own entry. (The first reply, which named t2, is the one lost.)
		p.twice.n.Store(1)
		err = parkCapped(p, key, "t5", MaxLine(3, true), StartWith(s.start))
		require.ErrorIs(t, err, ErrParked)
		assert.Equal(t, []string{"t3", "t4", "t5"}, queueTickets(t, p, q))
	})
}

func TestMaxLineNeverReplacesWaitersOrStarted(t *testing.T) {
	eachForSets(t, func(t *testing.T, p parkedSet) {
		ctx := context.Background()
		key := uniqueKey(t)
		q := p.c.redisKey(key) + waitSuffix
		s := newStarts()
		h := holdAndPark(t, p.c, key, "t1")
		defer h.Unlock(ctx)

		// A lead with nobody on the way parks and has the head (t1) started ahead.
		_, err := p.c.Lock(ctx, key, 10*time.Second, Park("t2", 5*time.Second, ParkLead), MaxWait(time.Millisecond), StartWith(s.start))
		require.ErrorIs(t, err, ErrParked)
		require.Equal(t, []string{"^t1", "t2"}, queueTickets(t, p, q))

		// A newcomer that waits in its process replaces t2, not the older t1 on its way.
		wctx, cancel := context.WithCancel(ctx)
		var wg sync.WaitGroup
		wg.Add(1)
		var werr error
		go func() {
			defer wg.Done()
			_, werr = p.c.Lock(wctx, key, 10*time.Second, Park("t3", 5*time.Second, ParkAfterWait), MaxWait(time.Minute), MaxLine(2, true), StartWith(s.start))
		}()
		defer func() { cancel(); wg.Wait() }()
		assert.Equal(t, "t2", s.replaced(t))
		for i := 0; i < 500 && len(queueTickets(t, p, q)) < 2; i++ {
			time.Sleep(10 * time.Millisecond)
		}
		require.Equal(t, []string{"^t1", "waiter"}, queueTickets(t, p, q))

		// Nothing parked is left to replace: refused, as without replace.
		err = parkCapped(p, key, "t4", MaxLine(2, true), StartWith(s.start))
		require.ErrorIs(t, err, ErrLineFull)
		assert.Equal(t, []string{"^t1", "waiter"}, queueTickets(t, p, q))
		cancel()
		wg.Wait()
		require.ErrorIs(t, werr, ErrNotObtained)
		require.False(t, errors.Is(werr, ErrLineFull), "a newcomer let in is not refused later: %v", werr)
	})
}

func TestMaxLineSlots(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		ctx := context.Background()
		c := New(b.rdb)
		key := uniqueKey(t)
		s := newStarts()
		h1, h2 := holdSlotsAndPark(t, c, key, nil, "t1", "t2")
		defer h1.Unlock(ctx)
		defer h2.Unlock(ctx)
		park := func(ticket string, opts ...LockOption) error {
			_, err := c.Lock(ctx, key, 10*time.Second, append([]LockOption{Limit(2), Park(ticket, 5*time.Second, ParkAfterWait), MaxWait(time.Millisecond), StartWith(s.start)}, opts...)...)
			return err
		}
		err := park("t3", MaxLine(2, false))
		require.ErrorIs(t, err, ErrLineFull)
		assert.Equal(t, []string{"t1", "t2"}, ticketsOf(slotsLineOf(t, b, c, key)))

		require.ErrorIs(t, park("t3", MaxLine(2, true)), ErrParked)
		assert.Equal(t, []string{"t2", "t3"}, ticketsOf(slotsLineOf(t, b, c, key)))
		assert.Equal(t, "t1", s.replaced(t))

		require.ErrorIs(t, park("t2", MaxLine(1, false)), ErrParked, "a ticket in the line keeps its place")
		assert.Equal(t, []string{"t2", "t3"}, ticketsOf(slotsLineOf(t, b, c, key)))
	})
}

func TestMaxLineOptions(t *testing.T) {
	ctx := context.Background()
	assert.Panics(t, func() { MaxLine(0, false) })
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		_, err := c.Lock(ctx, uniqueKey(t), time.Second, MaxLine(1, false))
		require.ErrorContains(t, err, "MaxLine applies to acquisitions with Park")
		_, err = c.LockKeys(ctx, []string{uniqueKey(t), uniqueKey(t) + "b"}, time.Second, Park("t", time.Second, ParkLead), MaxLine(1, false))
		require.ErrorContains(t, err, "MaxLine applies to one key")
	})
}
