package mutex

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
)

// sendTwice sends each of the next n calls of the lock script twice, and returns the
// second reply: the first reply is lost, and the call sent again, as go-redis does.
type sendTwice struct{ n atomic.Int32 }

func (h *sendTwice) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *sendTwice) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *sendTwice) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if isLockScript(cmd) && h.n.Add(-1) >= 0 {
			if err := next(ctx, cmd); err != nil {
				return err
			}
		}
		return next(ctx, cmd)
	}
}

var _ redis.Hook = (*sendTwice)(nil)

// parkedSet is what a test of a set's parking needs: a Client, a client with every
// permission to read lines, and a hook that repeats lock calls.
type parkedSet struct {
	c     *Client
	admin redis.UniversalClient
	twice *sendTwice
}

// eachForSets runs f on each's backends and on a three-master Cluster, where the locks
// of a set live on several servers and take a call each.
func eachForSets(t *testing.T, f func(t *testing.T, p parkedSet)) {
	with := func(t *testing.T, rdb, admin redis.UniversalClient) {
		h := &sendTwice{}
		rdb.AddHook(h)
		c := New(rdb)
		t.Cleanup(func() { c.Close() })
		f(t, parkedSet{c: c, admin: admin, twice: h})
	}
	each(t, func(t *testing.T, b backend) { with(t, b.rdb, b.admin) })
	t.Run("cluster", func(t *testing.T) {
		t.Parallel()
		rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: redistest.StartCluster(t, 3)})
		t.Cleanup(func() { rdb.Close() })
		with(t, rdb, rdb)
	})
}

// tickets is the line of key: each entry's ticket, and "waiter" for a waiter's.
func (p parkedSet) tickets(t *testing.T, key string) []string {
	t.Helper()
	es, err := p.admin.LRange(context.Background(), p.c.redisKey(key)+waitSuffix, 0, -1).Result()
	require.NoError(t, err)
	out := []string{}
	for _, e := range es {
		pe := readEntry(e)
		if !pe.parked {
			out = append(out, "waiter")
			continue
		}
		out = append(out, pe.ticket)
	}
	return out
}

// locked reports whether key is held by anyone (a ticket it was handed to too).
func (p parkedSet) locked(t *testing.T, key string) bool {
	t.Helper()
	in, err := p.c.Inspect(context.Background(), key)
	require.NoError(t, err)
	return in.Held
}

// parkSet acquires keys with ticket, which parks (ParkAfterWait after no wait), and
// checks that it parked at busy.
func (p parkedSet) parkSet(t *testing.T, keys []string, ticket, busy string, s *starts) {
	t.Helper()
	_, err := p.c.LockKeys(context.Background(), keys, 10*time.Second,
		Park(ticket, 5*time.Second, ParkAfterWait), MaxWait(time.Millisecond), StartWith(s.start))
	require.ErrorIs(t, err, ErrParked)
	require.ErrorIs(t, err, ErrNotObtained)
	at, ok := BusyKey(err)
	require.True(t, ok, "BusyKey(%v)", err)
	require.Equal(t, busy, at, "parked at the busy key")
	left, ok := LeaseLeft(err)
	require.True(t, ok, "LeaseLeft(%v)", err)
	assert.Positive(t, left)
}

func TestParkedSetHoldsNothingAndTakesAllWhenHanded(t *testing.T) {
	eachForSets(t, func(t *testing.T, p parkedSet) {
		ctx := context.Background()
		k := uniqueKey(t)
		a, bk, cc := k+":a", k+":b", k+":c"
		s := newStarts()
		hb, err := p.c.TryLock(ctx, bk, 10*time.Second, StartWith(s.start))
		require.NoError(t, err)

		// Taken in order a, b, c: it took a, met b busy, and parks there, giving a back.
		p.parkSet(t, []string{cc, bk, a}, "t", bk, s)
		assert.False(t, p.locked(t, a), "a parked set holds no key before the busy one")
		assert.False(t, p.locked(t, cc), "nor after it")
		assert.Equal(t, []string{"t"}, p.tickets(t, bk))
		assert.Empty(t, p.tickets(t, a))
		assert.Empty(t, p.tickets(t, cc))
		s.none(t, 50*time.Millisecond)

		// b's release hands it to the ticket, and names it to start.
		require.NoError(t, hb.Unlock(ctx))
		assert.Equal(t, Parked{Key: bk, Ticket: "t"}, s.next(t, 5*time.Second))
		in, err := p.c.Inspect(ctx, bk)
		require.NoError(t, err)
		require.True(t, in.Held, "b waits for its ticket's task")
		assert.LessOrEqual(t, in.TTL, 5*time.Second, "for the claim")

		// The task arrives and takes all three, b with the fence of the hand-over.
		l, err := p.c.LockKeys(ctx, []string{cc, bk, a}, 10*time.Second, Park("t", 5*time.Second, ParkLead), MaxWait(10*time.Second))
		require.NoError(t, err)
		assert.Equal(t, in.Fence, l.Fences()[1], "b's fence is the hand-over's")
		for _, key := range []string{a, bk, cc} {
			assert.Empty(t, p.tickets(t, key))
		}
		d, err := l.TTL(ctx)
		require.NoError(t, err)
		assert.Greater(t, d, 5*time.Second, "its own lease on every key")
		require.NoError(t, l.Unlock(ctx))
		for _, key := range []string{a, bk, cc} {
			assert.False(t, p.locked(t, key))
		}
	})
}

func TestParkedSetArrivingAtAnotherBusyKeyGivesBackAndParks(t *testing.T) {
	eachForSets(t, func(t *testing.T, p parkedSet) {
		ctx := context.Background()
		k := uniqueKey(t)
		a, bk := k+":a", k+":b"
		s := newStarts()
		hb, err := p.c.TryLock(ctx, bk, 10*time.Second, StartWith(s.start))
		require.NoError(t, err)
		p.parkSet(t, []string{a, bk}, "t", bk, s)
		// A task of b alone parks behind it.
		_, err = p.c.Lock(ctx, bk, 10*time.Second, Park("y", 5*time.Second, ParkAfterWait), MaxWait(time.Millisecond))
		require.ErrorIs(t, err, ErrParked)
		require.Equal(t, []string{"t", "y"}, p.tickets(t, bk))

		require.NoError(t, hb.Unlock(ctx)) // b goes to t; y, at the head now, is started ahead
		assert.Equal(t, Parked{Key: bk, Ticket: "t"}, s.next(t, 5*time.Second))
		assert.Equal(t, Parked{Key: bk, Ticket: "y"}, s.next(t, 5*time.Second))

		// Before t arrives, someone takes a.
		ha, err := p.c.TryLock(ctx, a, 10*time.Second, StartWith(s.start))
		require.NoError(t, err)
		p.parkSet(t, []string{a, bk}, "t", a, s)
		// It gave b back, to b's line's next, which is named to start.
		assert.Equal(t, Parked{Key: bk, Ticket: "y", Started: true}, s.next(t, 5*time.Second))
		in, err := Parked{Key: bk, Ticket: "y", c: p.c, lock: p.c.redisKey(bk)}.InLine(ctx)
		require.NoError(t, err)
		assert.True(t, in, "b is handed to y")
		in, err = Parked{Key: bk, Ticket: "t", c: p.c, lock: p.c.redisKey(bk)}.InLine(ctx)
		require.NoError(t, err)
		assert.False(t, in, "t no longer holds b")
		assert.Empty(t, p.tickets(t, bk))
		assert.Equal(t, []string{"t"}, p.tickets(t, a), "t parks at a")
		s.none(t, 50*time.Millisecond)

		// a's release hands it to t.
		require.NoError(t, ha.Unlock(ctx))
		assert.Equal(t, Parked{Key: a, Ticket: "t"}, s.next(t, 5*time.Second))
		// y arrives and takes b; t arrives, takes a, meets b busy: it gives a back and
		// parks at b, and a is free, its line empty.
		ly, err := p.c.Lock(ctx, bk, 10*time.Second, Park("y", 5*time.Second, ParkLead), MaxWait(10*time.Second), StartWith(s.start))
		require.NoError(t, err)
		p.parkSet(t, []string{a, bk}, "t", bk, s)
		assert.False(t, p.locked(t, a))
		assert.Equal(t, []string{"t"}, p.tickets(t, bk))
		require.NoError(t, ly.Unlock(ctx))
		assert.Equal(t, Parked{Key: bk, Ticket: "t"}, s.next(t, 5*time.Second))
	})
}

func TestParkedSetRepeatedCallsKeepOneEntry(t *testing.T) {
	// Every lock call is sent twice, its first reply lost: a set parks once, leaves
	// no waiter's entry behind, holds nothing, and takes all when handed its key.
	eachForSets(t, func(t *testing.T, p parkedSet) {
		ctx := context.Background()
		k := uniqueKey(t)
		a, bk, cc := k+":a", k+":b", k+":c"
		s := newStarts()
		hb, err := p.c.TryLock(ctx, bk, 10*time.Second, StartWith(s.start))
		require.NoError(t, err)
		p.twice.n.Store(1000)
		p.parkSet(t, []string{a, bk, cc}, "t", bk, s)
		p.parkSet(t, []string{a, bk, cc}, "t", bk, s) // its fallback brings it back early
		assert.Equal(t, []string{"t"}, p.tickets(t, bk))
		assert.Empty(t, p.tickets(t, a))
		assert.Empty(t, p.tickets(t, cc))
		assert.False(t, p.locked(t, a))
		assert.False(t, p.locked(t, cc))

		require.NoError(t, hb.Unlock(ctx))
		assert.Equal(t, Parked{Key: bk, Ticket: "t"}, s.next(t, 5*time.Second))
		l, err := p.c.LockKeys(ctx, []string{a, bk, cc}, 10*time.Second, Park("t", 5*time.Second, ParkLead), MaxWait(10*time.Second))
		require.NoError(t, err)
		assert.Positive(t, 1000-p.twice.n.Swap(0), "calls were sent twice")
		for _, key := range []string{a, bk, cc} {
			assert.Empty(t, p.tickets(t, key))
		}
		require.NoError(t, l.Unlock(ctx))
	})
}

func TestParkedSetLeadStartsTheHead(t *testing.T) {
	// Under ParkLead, a set that parks behind a line where nobody waits in a process
	// starts the head of the line ahead of its turn, as one key does.
	eachForSets(t, func(t *testing.T, p parkedSet) {
		ctx := context.Background()
		k := uniqueKey(t)
		a, bk := k+":a", k+":b"
		s := newStarts()
		hb, err := p.c.TryLock(ctx, bk, 10*time.Second)
		require.NoError(t, err)
		_, err = p.c.Lock(ctx, bk, 10*time.Second, Park("y", 5*time.Second, ParkAfterWait), MaxWait(time.Millisecond))
		require.ErrorIs(t, err, ErrParked)
		_, err = p.c.LockKeys(ctx, []string{a, bk}, 10*time.Second, Park("t", 5*time.Second, ParkLead), MaxWait(10*time.Second), StartWith(s.start))
		require.ErrorIs(t, err, ErrParked, "y is ahead of it: it parks")
		assert.Equal(t, Parked{Key: bk, Ticket: "y"}, s.next(t, 5*time.Second), "and starts y, as nobody waits in a process")
		assert.Equal(t, []string{"y", "t"}, p.tickets(t, bk))
		assert.False(t, p.locked(t, a))
		require.NoError(t, hb.Unlock(ctx))
	})
}

func TestParkedSetWhoseTurnCameWaitsForItsNextKey(t *testing.T) {
	// A set handed a key, arriving, finds a later key busy: under ParkLead it waits
	// there in its process, keeping the key its turn came at, rather than give its
	// turn back and park: sets whose turns came at one key each would otherwise pass
	// their keys round, each waiting for one on its way to another, and none run.
	eachForSets(t, func(t *testing.T, p parkedSet) {
		ctx := context.Background()
		k := uniqueKey(t)
		a, bk := k+":a", k+":b"
		s := newStarts()
		ha, err := p.c.TryLock(ctx, a, 10*time.Second, StartWith(s.start))
		require.NoError(t, err)
		p.parkSet(t, []string{a, bk}, "t", a, s)
		hb, err := p.c.TryLock(ctx, bk, 10*time.Second)
		require.NoError(t, err)
		// b's line holds a task parked: a lead would park behind it.
		_, err = p.c.Lock(ctx, bk, 10*time.Second, Park("y", 5*time.Second, ParkAfterWait), MaxWait(time.Millisecond))
		require.ErrorIs(t, err, ErrParked)
		require.NoError(t, ha.Unlock(ctx))
		assert.Equal(t, Parked{Key: a, Ticket: "t"}, s.next(t, 5*time.Second))

		got := make(chan error, 1)
		go func() {
			l, err := p.c.LockKeys(ctx, []string{a, bk}, 10*time.Second, Park("t", 5*time.Second, ParkLead), MaxWait(20*time.Second), HeldBy("set", "t"))
			if err == nil {
				err = l.Unlock(ctx)
			}
			got <- err
		}()
		require.Eventually(t, func() bool {
			return slices.Equal(p.tickets(t, bk), []string{"y", "waiter"})
		}, 10*time.Second, 5*time.Millisecond, "t waits for b in its process, behind y")
		in, err := p.c.Inspect(ctx, a)
		require.NoError(t, err)
		assert.Equal(t, "t", in.Holder.ID, "keeping a, where its turn came")
		require.NoError(t, hb.Unlock(ctx)) // b goes to y, whose task comes and goes
		ly, err := p.c.Lock(ctx, bk, 10*time.Second, Park("y", 5*time.Second, ParkLead), MaxWait(10*time.Second))
		require.NoError(t, err)
		require.NoError(t, ly.Unlock(ctx))
		select {
		case err := <-got:
			require.NoError(t, err, "handed b, it takes both")
		case <-time.After(20 * time.Second):
			t.Fatal("t was not handed b")
		}
	})
}

// TestParkedSetsUnderContention runs tasks of random overlapping sets of keys that
// park, each started again by its line (a Starter that wakes it) or by its fallback
// (a claim later): every task must run once, none overlapping another on a key, and
// tasks must park about once each, not hand their keys round.
func TestParkedSetsUnderContention(t *testing.T) {
	run := func(t *testing.T, c *Client) {
		k := uniqueKey(t)
		keys := []string{k + ":0", k + ":1", k + ":2", k + ":3"}
		const tasks = 40
		const claim = time.Second
		var (
			mu       sync.Mutex
			inside   = map[string]int{}
			overlaps int
			parks    int
			woken    = make([]chan struct{}, tasks)
		)
		for i := range woken {
			woken[i] = make(chan struct{}, 1)
		}
		starter := func(_ context.Context, p Parked) bool {
			var i int
			if _, err := fmt.Sscanf(p.Ticket, "t%d", &i); err == nil && i >= 0 && i < tasks {
				select {
				case woken[i] <- struct{}{}:
				default:
				}
			}
			return false
		}
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		var wg sync.WaitGroup
		errs := make(chan error, tasks)
		for i := range tasks {
			r := rand.New(rand.NewPCG(uint64(i), 7))
			set := slices.Clone(keys)
			r.Shuffle(len(set), func(a, b int) { set[a], set[b] = set[b], set[a] })
			set = set[:2]
			ticket := fmt.Sprintf("t%d", i)
			wg.Add(1)
			go func() {
				defer wg.Done()
				for attempt := 0; ; attempt++ {
					if attempt == 100 {
						errs <- fmt.Errorf("%s %q: parked 100 times", ticket, set)
						return
					}
					err := c.WithLockKeys(ctx, set, 2*time.Second, func(context.Context) error {
						mu.Lock()
						for _, key := range set {
							if inside[key]++; inside[key] > 1 {
								overlaps++
							}
						}
						mu.Unlock()
						time.Sleep(time.Millisecond)
						mu.Lock()
						for _, key := range set {
							inside[key]--
						}
						mu.Unlock()
						return nil
					}, Park(ticket, claim, ParkLead), MaxWait(200*time.Millisecond), StartWith(starter))
					if !errors.Is(err, ErrParked) {
						if err != nil {
							errs <- fmt.Errorf("%s %q: %w", ticket, set, err)
						}
						return
					}
					mu.Lock()
					parks++
					mu.Unlock()
					select { // started by its line, or back by its fallback
					case <-woken[i]:
					case <-time.After(claim):
					case <-ctx.Done():
						errs <- fmt.Errorf("%s %q: %w", ticket, set, ctx.Err())
						return
					}
				}
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Error(err)
		}
		t.Logf("%d tasks, %d parks", tasks, parks)
		assert.Zero(t, overlaps, "sections overlapped on a key")
		assert.LessOrEqual(t, parks, 5*tasks, "tasks parked again and again")
	}
	t.Run("redis-server", func(t *testing.T) {
		t.Parallel()
		c := New(sharedServer(t))
		t.Cleanup(func() { c.Close() })
		run(t, c)
	})
	t.Run("cluster", func(t *testing.T) {
		t.Parallel()
		rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: redistest.StartCluster(t, 3)})
		t.Cleanup(func() { rdb.Close() })
		c := New(rdb)
		t.Cleanup(func() { c.Close() })
		run(t, c)
	})
}

// TestParkedSetWaitsAtEachNextKey: a set of three whose turn came at a, waiting at b
// (keeping a), is handed b in a later attempt, and meeting c busy with a line there
// waits at c too, keeping a and b, rather than give its turn back and park: the
// attempts after the one that claimed a know of its turn (the busy reply says so).
func TestParkedSetWaitsAtEachNextKey(t *testing.T) {
	eachForSets(t, func(t *testing.T, p parkedSet) {
		ctx := context.Background()
		k := uniqueKey(t)
		a, bk, cc := k+":a", k+":b", k+":c"
		s := newStarts()
		ha, err := p.c.TryLock(ctx, a, 10*time.Second, StartWith(s.start))
		require.NoError(t, err)
		p.parkSet(t, []string{a, bk, cc}, "t", a, s)
		hb, err := p.c.TryLock(ctx, bk, 10*time.Second)
		require.NoError(t, err)
		hc, err := p.c.TryLock(ctx, cc, 10*time.Second)
		require.NoError(t, err)
		_, err = p.c.Lock(ctx, bk, 10*time.Second, Park("x", 5*time.Second, ParkAfterWait), MaxWait(time.Millisecond))
		require.ErrorIs(t, err, ErrParked)
		_, err = p.c.Lock(ctx, cc, 10*time.Second, Park("y", 5*time.Second, ParkAfterWait), MaxWait(time.Millisecond))
		require.ErrorIs(t, err, ErrParked)
		require.NoError(t, ha.Unlock(ctx))
		assert.Equal(t, Parked{Key: a, Ticket: "t"}, s.next(t, 5*time.Second))

		got := make(chan error, 1)
		go func() {
			l, err := p.c.LockKeys(ctx, []string{a, bk, cc}, 10*time.Second, Park("t", 5*time.Second, ParkLead), MaxWait(20*time.Second), HeldBy("set", "t"))
			if err == nil {
				err = l.Unlock(ctx)
			}
			got <- err
		}()
		require.Eventually(t, func() bool {
			return slices.Equal(p.tickets(t, bk), []string{"x", "waiter"})
		}, 10*time.Second, 5*time.Millisecond, "t waits for b in its process, behind x")
		// b goes to x, whose task comes and goes; then to t.
		require.NoError(t, hb.Unlock(ctx))
		lx, err := p.c.Lock(ctx, bk, 10*time.Second, Park("x", 5*time.Second, ParkLead), MaxWait(10*time.Second))
		require.NoError(t, err)
		require.NoError(t, lx.Unlock(ctx))
		select {
		case err := <-got:
			t.Fatalf("set returned before c was free: %v (a held: %v, c line %v)", err, p.locked(t, a), p.tickets(t, cc))
		case <-time.After(2 * time.Second):
		}
		in, err := p.c.Inspect(ctx, a)
		require.NoError(t, err)
		assert.Equal(t, "t", in.Holder.ID, "keeping a, where its turn came")
		assert.Equal(t, []string{"y", "waiter"}, p.tickets(t, cc))
		require.NoError(t, hc.Unlock(ctx))
		ly, err := p.c.Lock(ctx, cc, 10*time.Second, Park("y", 5*time.Second, ParkLead), MaxWait(10*time.Second))
		require.NoError(t, err)
		require.NoError(t, ly.Unlock(ctx))
		require.NoError(t, <-got)
	})
}
