package mutex

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// parkedFor checks that in.ParkedFor is the age of the line's oldest parked entry
// (lineOf's), by the server clock read at before and after the read of in.
func parkedFor(t *testing.T, in Info, line []parsedEntry, before, after time.Time) {
	t.Helper()
	var oldest time.Time
	for _, e := range line {
		if e.parked && (oldest.IsZero() || e.since.Before(oldest)) {
			oldest = e.since
		}
	}
	require.False(t, oldest.IsZero(), "the line holds a parked entry")
	assert.GreaterOrEqual(t, in.ParkedFor, before.Sub(oldest), "ParkedFor, against its since %v", oldest)
	assert.LessOrEqual(t, in.ParkedFor, after.Sub(oldest), "ParkedFor, against its since %v", oldest)
}

// inspectAt reads key with Inspect, and the server clock before and after.
func inspectAt(t *testing.T, b backend, c *Client, key string) (in Info, before, after time.Time) {
	t.Helper()
	ctx := context.Background()
	before, err := b.admin.Time(ctx).Result()
	require.NoError(t, err)
	in, err = c.Inspect(ctx, key)
	require.NoError(t, err)
	after, err = b.admin.Time(ctx).Result()
	require.NoError(t, err)
	return in, before, after
}

func TestInspectCountsParkedTasks(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		ctx := context.Background()
		c := New(b.rdb)
		defer c.Close()
		key := uniqueKey(t)

		free, err := c.Inspect(ctx, key)
		require.NoError(t, err)
		assert.Zero(t, free.Parked)
		assert.Zero(t, free.ParkedFor)

		h, err := c.Lock(ctx, key, 10*time.Second)
		require.NoError(t, err)
		in, err := c.Inspect(ctx, key)
		require.NoError(t, err)
		assert.Zero(t, in.Parked, "nobody parked")
		assert.Zero(t, in.ParkedFor)

		// a waits in its process; b and c park behind it.
		wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		defer cancel()
		lead := make(chan *Lock, 1)
		go func() {
			l, err := c.Lock(wctx, key, 10*time.Second, Park("a", 5*time.Second, ParkLead), MaxWait(10*time.Second), HeldBy("pay", "a"))
			assert.NoError(t, err)
			lead <- l
		}()
		waitForWaiters(t, b, c, key, 1)
		in, err = c.Inspect(ctx, key)
		require.NoError(t, err)
		assert.Equal(t, 1, in.Waiting)
		assert.Zero(t, in.Parked, "a waiter in a process is not parked")
		assert.Zero(t, in.ParkedFor)
		for _, tk := range []string{"b", "c"} {
			_, err = c.Lock(ctx, key, 10*time.Second, Park(tk, 5*time.Second, ParkLead), MaxWait(10*time.Second), HeldBy("pay", tk))
			require.ErrorIs(t, err, ErrParked)
		}
		in, before, after := inspectAt(t, b, c, key)
		assert.Equal(t, 3, in.Waiting)
		assert.Equal(t, 2, in.Parked)
		parkedFor(t, in, lineOf(t, b, c, key), before, after)
		require.Len(t, in.Waiters, 3)
		assert.Equal(t, Holder{Name: "pay", ID: "b"}, in.Waiters[1], "a parked task is listed by its task")

		// The release hands the lock to a and starts b ahead of its turn: a started
		// entry is still parked in the line.
		require.NoError(t, h.Unlock(ctx))
		a := <-lead
		require.NotNil(t, a)
		defer a.Unlock(ctx)
		line := lineOf(t, b, c, key)
		require.Len(t, line, 2)
		require.True(t, line[0].started)
		in, before, after = inspectAt(t, b, c, key)
		assert.Equal(t, 2, in.Waiting)
		assert.Equal(t, 2, in.Parked, "started ones included")
		parkedFor(t, in, line, before, after)

		// List counts them too.
		found := false
		for li, err := range c.List(ctx) {
			require.NoError(t, err)
			if li.Key == key {
				found = true
				assert.Equal(t, 2, li.Parked)
				assert.GreaterOrEqual(t, li.ParkedFor, in.ParkedFor, "read later")
			}
		}
		assert.True(t, found, "List yields %s", key)
		held, err := c.Locked(ctx, key)
		require.NoError(t, err)
		assert.True(t, held)
	})
}

// TestInspectFindsTheOldestParkedEntry reads a line written by hand: longer than one
// LRANGE of inspect.lua, its oldest parked entry neither first nor in the first chunk.
func TestInspectFindsTheOldestParkedEntry(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		ctx := context.Background()
		c := New(b.rdb)
		defer c.Close()
		key := uniqueKey(t)
		now, err := b.admin.Time(ctx).Result()
		require.NoError(t, err)
		entry := func(mark byte, ticket string, age time.Duration) string {
			return fmt.Sprintf("%c.%s 5000 %d %s%s", mark, ticket, now.Add(-age).UnixMilli(),
				parkedIdentity(ticket), describe("\t\t", "pay", ticket))
		}
		line := []any{entryHead("client", "w1", time.Second, 0) + " " + identity(newToken()) + describe("host\t1\t", "pay", "w1")}
		for i := range 2500 {
			age := 2 * time.Second
			if i == 1998 {
				age = 9 * time.Second // the oldest, last of the second chunk
			}
			mark := byte(parkedMark)
			if i%7 == 0 {
				mark = startedMark
			}
			line = append(line, entry(mark, fmt.Sprintf("t%d", i), age))
		}
		line = append(line, entry(parkedMark, "last", 5*time.Second))
		require.NoError(t, b.admin.RPush(ctx, c.redisKey(key)+waitSuffix, line...).Err())
		oldest := time.UnixMilli(now.Add(-9 * time.Second).UnixMilli())

		in, before, after := inspectAt(t, b, c, key) // the lock itself is absent
		assert.False(t, in.Held)
		assert.Equal(t, 2502, in.Waiting)
		assert.Equal(t, 2501, in.Parked)
		assert.GreaterOrEqual(t, in.ParkedFor, before.Sub(oldest))
		assert.LessOrEqual(t, in.ParkedFor, after.Sub(oldest))
		require.Len(t, in.Waiters, maxListedWaiters)
		assert.Equal(t, Holder{Host: "host", PID: 1, Name: "pay", ID: "w1"}, in.Waiters[0])
		assert.Equal(t, Holder{Name: "pay", ID: "t0"}, in.Waiters[1])
	})
}
