package mutex

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/asynqmutex/asynqmutex/internal/store"
)

// Serve: the line of a key whose holder crashed, served when its lease ends by
// whoever knows when that is, where every task of the key is parked and no attempt
// comes to serve it.

// countRuns counts the calls of s that rdb sends and Redis answers without an error.
func countRuns(rdb *redis.Client, s *store.Script) *atomic.Int32 {
	n := new(atomic.Int32)
	rdb.AddHook(&rgHook{process: func(ctx context.Context, cmd redis.Cmder, next redis.ProcessHook) error {
		err := next(ctx, cmd)
		if err == nil && rgRuns(cmd, s) {
			n.Add(1)
		}
		return err
	}})
	return n
}

func TestServeHandsACrashedHoldersKeyToTheLine(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		ctx := context.Background()
		c := New(b.rdb)
		key := uniqueKey(t)
		s := newStarts()
		h, err := c.Lock(ctx, key, 10*time.Second) // never renewed nor released: it crashed
		require.NoError(t, err)
		parkBehind(t, c, key, nil, "t1", "t2")

		left, waiting, err := c.Serve(ctx, key, StartWith(s.start))
		require.NoError(t, err)
		assert.True(t, waiting)
		assert.Positive(t, left, "the holder's lease runs")
		assert.LessOrEqual(t, left, 10*time.Second)
		in, err := c.Inspect(ctx, key)
		require.NoError(t, err)
		assert.Equal(t, h.Fence(), in.Fence, "the holder keeps the key")
		line := lineOf(t, b, c, key)
		require.Equal(t, []string{"t1", "t2"}, ticketsOf(line))
		assert.False(t, line[0].started || line[1].started, "nobody is started")

		b.expire(t, c.redisKey(key)) // its lease runs out
		left, waiting, err = c.Serve(ctx, key, StartWith(s.start))
		require.NoError(t, err)
		assert.True(t, waiting, "t2 is still in line")
		assert.Positive(t, left, "t1's claim")
		assert.LessOrEqual(t, left, 5*time.Second)
		assert.Equal(t, Parked{Key: key, Ticket: "t1"}, s.next(t, 5*time.Second), "handed the key")
		assert.Equal(t, Parked{Key: key, Ticket: "t2"}, s.next(t, 5*time.Second), "started ahead")
		line = lineOf(t, b, c, key)
		require.Equal(t, []string{"t2"}, ticketsOf(line))
		assert.True(t, line[0].started)
		in, err = c.Inspect(ctx, key)
		require.NoError(t, err)
		require.True(t, in.Held)
		assert.Greater(t, in.Fence, h.Fence())

		l, err := c.TryLock(ctx, key, 10*time.Second, Park("t1", 5*time.Second, ParkNever))
		require.NoError(t, err, "t1 claims the key handed to its ticket")
		assert.Equal(t, in.Fence, l.Fence(), "the fence of the hand-over")
		require.NoError(t, l.Unlock(ctx))
	})
}

func TestServeHandsExpiredSlotsToTheLine(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		for _, tc := range []struct {
			name string
			end  func(t *testing.T, c *Client, key string) // ends both holders' leases
			// serve is the options Serve is given after the leases ended: a hash whose
			// holders' leases ended has its limit; a hash gone needs the caller's.
			serve []LockOption
		}{
			{"slots ended", func(t *testing.T, c *Client, key string) {
				endSlot(t, b, c, key, "h1")
				endSlot(t, b, c, key, "h2")
			}, nil},
			{"hash expired", func(t *testing.T, c *Client, key string) {
				b.expire(t, c.redisKey(key))
			}, []LockOption{Limit(2)}},
		} {
			t.Run(tc.name, func(t *testing.T) {
				ctx := context.Background()
				c := New(b.rdb)
				key := uniqueKey(t)
				s := newStarts()
				for _, tk := range []string{"h1", "h2"} {
					_, err := c.Lock(ctx, key, 10*time.Second, Limit(2), Token(tk)) // crashed
					require.NoError(t, err)
				}
				parkBehind(t, c, key, []LockOption{Limit(2)}, "a", "b", "c")

				left, waiting, err := c.Serve(ctx, key, Limit(2), StartWith(s.start))
				require.NoError(t, err)
				assert.True(t, waiting)
				assert.Positive(t, left, "the holders' leases run")
				assert.LessOrEqual(t, left, 10*time.Second)
				require.Equal(t, []string{"a", "b", "c"}, ticketsOf(slotsLineOf(t, b, c, key)))

				tc.end(t, c, key)
				left, waiting, err = c.Serve(ctx, key, append(tc.serve, StartWith(s.start))...)
				require.NoError(t, err)
				assert.True(t, waiting, "c is still in line")
				assert.Positive(t, left, "the claims")
				assert.LessOrEqual(t, left, 5*time.Second)
				for _, want := range []string{"a", "b", "c"} { // c started ahead
					assert.Equal(t, Parked{Key: key, Ticket: want}, s.next(t, 5*time.Second))
				}
				line := slotsLineOf(t, b, c, key)
				require.Equal(t, []string{"c"}, ticketsOf(line))
				assert.True(t, line[0].started)
				in, err := c.Inspect(ctx, key)
				require.NoError(t, err)
				assert.Equal(t, 2, in.Limit)
				assert.Len(t, in.Slots, 2, "handed to a and b")

				for _, tk := range []string{"a", "b"} {
					l, err := c.TryLock(ctx, key, 10*time.Second, Limit(2), Park(tk, 5*time.Second, ParkNever))
					require.NoError(t, err, "%s claims the slot handed to its ticket", tk)
					require.NoError(t, l.Unlock(ctx))
				}
			})
		}
	})
}

func TestServeGoneTicketPassesTheSlotOn(t *testing.T) {
	// A ticket Serve hands a slot to, whose task will not come, lets the slot go to
	// the next in the slots' line, as after a release.
	each(t, func(t *testing.T, b backend) {
		ctx := context.Background()
		c := New(b.rdb)
		key := uniqueKey(t)
		s := newStarts()
		s.gone["gone"] = true
		for _, tk := range []string{"h1", "h2"} {
			_, err := c.Lock(ctx, key, 10*time.Second, Limit(2), Token(tk)) // crashed
			require.NoError(t, err)
		}
		parkBehind(t, c, key, []LockOption{Limit(2)}, "gone", "next", "third")
		endSlot(t, b, c, key, "h1")
		endSlot(t, b, c, key, "h2")
		_, _, err := c.Serve(ctx, key, Limit(2), StartWith(s.start))
		require.NoError(t, err)
		for _, want := range []Parked{
			{Key: key, Ticket: "gone"}, {Key: key, Ticket: "next"}, {Key: key, Ticket: "third"},
			{Key: key, Ticket: "third", Started: true}, // handed the slot gone left
		} {
			assert.Equal(t, want, s.next(t, 5*time.Second))
		}
		assert.Empty(t, slotsLineOf(t, b, c, key))
		l, err := c.TryLock(ctx, key, 10*time.Second, Limit(2), Park("third", 5*time.Second, ParkNever))
		require.NoError(t, err, "third claims the slot gone left")
		require.NoError(t, l.Unlock(ctx))
	})
}

func TestServeWakesAWaiter(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		ctx := context.Background()
		attempts := countRuns(b.rdb, plainLockScript)
		c := New(b.rdb)
		key := uniqueKey(t)
		_, err := c.Lock(ctx, key, time.Minute) // crashed
		require.NoError(t, err)
		got := make(chan error, 1)
		go func() {
			// It would try again itself when the holder's lease ends, past its MaxWait.
			l, err := c.Lock(ctx, key, time.Minute, MaxWait(30*time.Second))
			if err == nil {
				err = l.Unlock(ctx)
			}
			got <- err
		}()
		// The holder's attempt, the waiter's, and the waiter's again once its
		// subscription is confirmed; none after that until its MaxWait.
		require.Eventually(t, func() bool { return attempts.Load() == 3 }, 10*time.Second, time.Millisecond)
		waitForWaiters(t, b, c, key, 1)

		b.expire(t, c.redisKey(key))
		left, waiting, err := New(b.rdb).Serve(ctx, key)
		require.NoError(t, err)
		assert.False(t, waiting)
		assert.Positive(t, left, "the waiter's lease")
		select {
		case err := <-got:
			require.NoError(t, err)
		case <-time.After(40 * time.Second):
			t.Fatal("the waiter did not return")
		}
		assert.Equal(t, int32(3), attempts.Load(), "the waiter was handed the key, not taking it itself")
	})
}

func TestServeChangesNothingWithNothingToServe(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		ctx := context.Background()
		c := New(b.rdb)
		for _, tc := range []struct {
			opts    []LockOption
			holders int // that hold every slot
		}{{nil, 1}, {[]LockOption{Limit(2)}, 2}} {
			opts := tc.opts
			key := uniqueKey(t)
			rkey := c.redisKey(key)
			left, waiting, err := c.Serve(ctx, key, opts...)
			require.NoError(t, err)
			assert.False(t, waiting, "a free key, nobody in line")
			assert.Zero(t, left)
			n, err := b.admin.Exists(ctx, rkey, rkey+waitSuffix, rkey+slotsSuffix).Result()
			require.NoError(t, err)
			assert.Zero(t, n, "nothing written")

			var held []*Lock
			for range tc.holders {
				l, err := c.TryLock(ctx, key, 10*time.Second, opts...)
				require.NoError(t, err)
				held = append(held, l)
			}
			left, waiting, err = c.Serve(ctx, key, opts...)
			require.NoError(t, err)
			assert.False(t, waiting, "a held key, nobody in line")
			assert.Positive(t, left)
			assert.LessOrEqual(t, left, 10*time.Second)

			for _, l := range held {
				require.NoError(t, l.Unlock(ctx))
			}
			tomb, err := b.admin.Get(ctx, rkey).Result()
			require.NoError(t, err, "a tombstone")
			left, waiting, err = c.Serve(ctx, key, opts...)
			require.NoError(t, err)
			assert.False(t, waiting, "a released key, nobody in line")
			assert.Zero(t, left)
			after, err := b.admin.Get(ctx, rkey).Result()
			require.NoError(t, err)
			assert.Equal(t, tomb, after, "the tombstone stays as it was")
		}
		_, _, err := c.Serve(ctx, "")
		assert.ErrorContains(t, err, "empty key")
	})
}
