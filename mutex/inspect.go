package mutex

import (
	"context"
	"errors"
	"fmt"
	"iter"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/asynqmutex/asynqmutex/internal/store"
)

// Holder is who holds, or waits for, a lock: what it recorded when it asked for it.
type Holder struct {
	// Name and ID are what HeldBy gave: for the asynqmutex middleware the task type
	// and the task ID. Empty without HeldBy.
	Name, ID string
	// Host is the holder's host name (os.Hostname), PID its process ID.
	Host string
	PID  int
}

// String describes h in one line, such as `payment:capture 3f2a… on web-1 (pid 812)`,
// or "unknown" for a Holder that recorded nothing.
func (h Holder) String() string {
	var b strings.Builder
	b.WriteString(h.Name)
	if h.ID != "" {
		if b.Len() > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(h.ID)
	}
	if h.Host != "" {
		if b.Len() > 0 {
			b.WriteByte(' ')
		}
		b.WriteString("on " + h.Host)
	}
	if h.PID != 0 {
		if b.Len() > 0 {
			b.WriteByte(' ')
		}
		b.WriteString("(pid " + strconv.Itoa(h.PID) + ")")
	}
	if b.Len() == 0 {
		return "unknown"
	}
	return b.String()
}

// Info is the state of one lock, as Inspect, List and ForceRelease read it in one
// script call. It is a snapshot: the lock may have changed hands by the time it is read.
type Info struct {
	// Key is the caller's key, decoded from the Redis key. For a key longer than 256
	// bytes once escaped, the Redis key holds only its first 64 bytes and a digest,
	// and Key is those 64 bytes (Digested is then true): not a key to pass back.
	Key      string
	Digested bool
	// RedisKey is the Redis key of the lock; its queue of waiters is RedisKey + ":wait"
	// (RedisKey + ":slots" for a lock with Limit(n); see docs/protocol.md).
	RedisKey string
	// Held reports whether anyone holds the lock. The fields below it describe the
	// holder. When the lock is not held, Fence and Since are those of the last holder
	// for 10 s after its release (0 and the zero time after that), and Holder is empty.
	Held bool
	// Foreign reports a value this package did not write (set by hand): the key counts
	// as held, but nothing else of it can be read.
	Foreign bool
	Holder  Holder
	// Since is when the holder got the lock, on the Redis server's clock, and HeldFor
	// how long ago that was when the lock was read, by the same clock.
	Since   time.Time
	HeldFor time.Duration
	// TTL is the lease left: how long until the lock frees itself unless renewed.
	// -1 means the key has no expiry (set by hand).
	TTL   time.Duration
	Fence int64
	// Waiting is how many waiters are queued, Waiters the first of them, oldest first
	// (Inspect fills it; List leaves it empty). A queued waiter whose process has died
	// stays listed until a release passes it over or the queue expires.
	Waiting int
	Waiters []Holder
	// Parked is how many of Waiting are parked tasks (see Park), started ones
	// included, and ParkedFor how long the oldest of them has waited in the line when
	// the lock was read, by the Redis server's clock. Both are 0 when none is parked,
	// and in ForceRelease's Released.Before, which does not count them.
	Parked    int
	ParkedFor time.Duration
	// Limit is n for a key held with Limit(n), n > 1, and 0 for a plain lock; Slots
	// then lists every holder, oldest fence first, and Holder, Fence, Since and
	// HeldFor describe the newest, while TTL is the longest lease left.
	Limit int
	Slots []Slot
}

// Slot is one holder of a lock with Limit(n), as Inspect and List read it.
type Slot struct {
	Holder Holder // what the holder recorded about itself (see HeldBy)
	Fence  int64  // the fence of its acquisition
	// Since is when the holder got its slot, on the Redis server's clock; TTL is its
	// lease left.
	Since time.Time
	TTL   time.Duration
}

// maxListedWaiters is how many waiters Inspect returns.
const maxListedWaiters = 100

// Inspect reads the lock on key and up to its first 100 waiters, and counts its
// parked tasks, changing nothing. Counting them reads the key's whole line, so it
// costs time in Redis in proportion to the line. A key nobody holds gives an Info
// with Held false (and no error). It returns a wrapped Redis error when Redis cannot
// be reached. Safe for concurrent use.
func (c *Client) Inspect(ctx context.Context, key string) (Info, error) {
	return c.inspect(ctx, key, maxListedWaiters, true)
}

// Locked reports whether anyone holds the lock on key. The answer may be stale by the
// time it returns; use it for monitoring, not to decide whether to lock.
func (c *Client) Locked(ctx context.Context, key string) (bool, error) {
	in, err := c.inspect(ctx, key, 0, false)
	return in.Held, err
}

// inspect is Inspect listing up to n waiters, and counting parked tasks if parked.
func (c *Client) inspect(ctx context.Context, key string, n int, parked bool) (Info, error) {
	if key == "" {
		return Info{}, errors.New("mutex: empty key")
	}
	rkey := c.redisKey(key)
	res, err := c.run.Run(ctx, inspectScript, c.inspectKeys(rkey), n, countParked(parked)).Slice()
	if err != nil {
		return Info{}, fmt.Errorf("mutex: inspect %s: %w", show(key), err)
	}
	return c.info(rkey, res)
}

// countParked is inspect.lua's ARGV[2]: whether it counts parked tasks.
func countParked(yes bool) string {
	if yes {
		return "1"
	}
	return "0"
}

// inspectKeys are the keys inspect.lua reads of the lock at Redis key rkey.
func (c *Client) inspectKeys(rkey string) []string {
	return []string{rkey, c.plain.queue(rkey), c.slots.queue(rkey)}
}

// info reads inspect.lua's reply about the lock at Redis key rkey.
func (c *Client) info(rkey string, res []any) (Info, error) {
	if len(res) < 6 {
		return Info{}, fmt.Errorf("mutex: inspect %s: unexpected reply %v", show(rkey), res)
	}
	in := Info{RedisKey: rkey}
	in.Key, in.Digested = keyOf(c.prefix, rkey)
	typ, _ := res[0].(string)
	pttl, _ := res[2].(int64)
	waiting, _ := res[3].(int64)
	in.Waiting = int(waiting)
	entries, _ := res[4].([]any)
	for _, e := range entries {
		s, _ := e.(string)
		in.Waiters = append(in.Waiters, readEntry(s).Holder)
	}
	now := serverTime(res[5])
	if len(res) >= 8 { // not from plain_force.lua, whose reply has no counts
		parked, _ := res[6].(int64)
		in.Parked = int(parked)
		if oldest, ok := res[7].(int64); ok && parked > 0 && !now.IsZero() {
			in.ParkedFor = max(now.Sub(time.UnixMilli(oldest)), 0)
		}
	}
	switch typ {
	case "none":
		return in, nil
	case "hash":
		fields, _ := res[1].([]any)
		slotsInfo(&in, fields, now)
		return in, nil
	case "string":
	default:
		in.Held, in.Foreign, in.TTL = true, true, -1
		return in, nil
	}
	v, _ := res[1].(string)
	in.TTL = time.Duration(pttl) * time.Millisecond
	if pttl < 0 {
		in.TTL = -1
	}
	lv, ok := parseValue(v)
	if !ok {
		in.Held, in.Foreign = true, true
		return in, nil
	}
	in.Held = lv.state != stateReleased
	in.Fence, in.Holder, in.Since = lv.fence, lv.holder, time.UnixMicro(lv.since)
	if !now.IsZero() {
		in.HeldFor = max(now.Sub(in.Since), 0)
	}
	if !in.Held {
		in.TTL = 0 // the tombstone's own expiry is no lease
	}
	return in, nil
}

// slotsInfo fills in from the fields of a lock with Limit(n), read at server time
// now. The holders are listed in Slots, oldest fence first; Holder, Fence, Since and
// HeldFor describe the newest holder, and TTL is the longest lease left: when the key
// frees unless renewed.
func slotsInfo(in *Info, fields []any, now time.Time) {
	for i := 0; i+1 < len(fields); i += 2 {
		f, _ := fields[i].(string)
		v, _ := fields[i+1].(string)
		switch {
		case f == slotsLimit:
			in.Limit, _ = strconv.Atoi(v)
		case strings.HasPrefix(f, slotHolder):
			s, ok := parseSlot(v)
			if !ok || (!now.IsZero() && !s.end.After(now)) {
				continue // its lease has ended
			}
			s.TTL = s.end.Sub(now)
			in.Slots = append(in.Slots, s.Slot)
		}
	}
	sort.Slice(in.Slots, func(i, j int) bool { return in.Slots[i].Fence < in.Slots[j].Fence })
	if len(in.Slots) == 0 {
		return
	}
	in.Held = true
	newest := in.Slots[len(in.Slots)-1]
	in.Holder, in.Fence, in.Since = newest.Holder, newest.Fence, newest.Since
	if !now.IsZero() {
		in.HeldFor = max(now.Sub(in.Since), 0)
	}
	for _, s := range in.Slots {
		in.TTL = max(in.TTL, s.TTL)
	}
}

// serverTime reads the reply of Redis's TIME, or returns the zero time.
func serverTime(reply any) time.Time {
	t, _ := reply.([]any)
	if len(t) != 2 {
		return time.Time{}
	}
	sec, err1 := strconv.ParseInt(fmt.Sprint(t[0]), 10, 64)
	usec, err2 := strconv.ParseInt(fmt.Sprint(t[1]), 10, 64)
	if err1 != nil || err2 != nil {
		return time.Time{}
	}
	return time.Unix(sec, usec*1000)
}

// List yields every lock key of the Client's prefix that is held, in no particular
// order, reading them SCAN batch by batch with one pipelined script call per key
// (with a Cluster client, every master is scanned in turn; a single-node client
// pointed at one Cluster node sees that node's keys only). Waiters holds no entries;
// Waiting counts them, and Parked the parked tasks among them, reading each key's
// whole line. A lock taken or released while List runs may or may not be yielded.
// Iteration stops at the first error, which is yielded with a zero Info. Safe for
// concurrent use.
func (c *Client) List(ctx context.Context) iter.Seq2[Info, error] {
	return store.List(ctx, c.run, "mutex: list", store.EscapeGlob(c.prefix)+"{*}", "", inspectScript, c.inspectKeys, []any{0, countParked(true)},
		func(rkey string, reply []any) (Info, bool, error) {
			in, err := c.info(rkey, reply)
			return in, err == nil && in.Held, err
		})
}

// Released is what ForceRelease did.
type Released struct {
	// Before is the lock as it was, its waiters counted but not listed, its parked
	// tasks not counted (Parked and ParkedFor are 0). Before.Held is false when
	// nobody held it: then nothing changed.
	Before Info
	// Fence is the fence of the waiter the lock was handed to, HandedTo what that
	// waiter recorded about itself; 0 and empty when the lock became free.
	Fence    int64
	HandedTo Holder
	// Repeated reports that Redis had already applied this call: its reply was lost
	// and go-redis sent it again. Then Before, Fence and HandedTo are not known (Before
	// is zero but for its keys), and the repeat changed nothing.
	Repeated bool
}

// ForceRelease frees the lock on key whoever holds it, for an operator unsticking a
// key whose holder hangs while renewing. It hands the lock to the longest-queued
// waiter, as a release does, or leaves it free. Afterwards the old holder's token
// holds nothing: its Extend and Unlock return ErrNotHeld, WithLock cancels its fn at
// its next renewal (within ttl/3), and every later holder's fence is higher than
// its own, so a resource that checks fences rejects its late writes. A value not of
// this package's form (set by hand) is deleted. One exception: a key that a waiting
// set of keys keeps (see LockKeys) is taken again by that waiter's next attempt,
// within a third of its lease, as nothing of the set has run yet; to free it for
// good, stop the waiting task, or free the key it waits for. A key held with
// Limit(n), n > 1, is refused with an error naming the limit and its holders while
// any lease runs (a key whose every lease ended is freed).
//
// A wrapped Redis error means nothing is known. A call whose reply was lost and that
// go-redis sent again recognises its own release (Repeated) and changes nothing more:
// it never takes the lock from the waiter it was handed to. Safe for
// concurrent use.
func (c *Client) ForceRelease(ctx context.Context, key string) (Released, error) {
	if key == "" {
		return Released{}, errors.New("mutex: empty key")
	}
	rkey := c.redisKey(key)
	// Twice at most: a key held with Limit(n) whose every lease ended is made a
	// plain lock's tombstone, and then found free.
	for range 2 {
		res, err := c.run.Run(ctx, plainForceScript, []string{rkey, c.plain.queue(rkey)},
			identity("force:"+newToken()), c.channels, c.countsSubscribers, tombstoneMillis).Slice()
		if err == nil && len(res) != 7 {
			err = fmt.Errorf("unexpected reply %v", res)
		}
		if err != nil {
			return Released{}, fmt.Errorf("mutex: force release %s: %w", show(key), err)
		}
		if res[6] == int64(2) {
			if err := c.forceSlots(ctx, key, rkey); err != nil {
				return Released{}, err
			}
			continue
		}
		var r Released
		r.Repeated = res[6] == int64(1)
		// The reply starts as inspect.lua's does for a plain lock, without its type.
		typ := "none"
		if _, ok := res[0].(string); ok {
			typ = "string"
		}
		if r.Before, err = c.info(rkey, append([]any{typ}, res[:5]...)); err != nil {
			return Released{}, err
		}
		if after, ok := res[5].(string); ok {
			if lv, ok := parseValue(after); ok {
				r.Fence, r.HandedTo = lv.fence, lv.holder
			}
		}
		return r, nil
	}
	return Released{}, fmt.Errorf("mutex: force release %s: the key was taken with Limit(n) again as it freed; try again", show(key))
}

// forceSlots is what ForceRelease does with a key held with Limit(n): holders whose
// leases ended hold nothing, and when none is left the key becomes a plain lock's
// tombstone (nil: ForceRelease then finds it free); otherwise it refuses.
func (c *Client) forceSlots(ctx context.Context, key, rkey string) error {
	res, _, err := c.slots.free(ctx, rkey, false) // as a plain lock's: nobody to start
	switch {
	case err != nil:
		return fmt.Errorf("mutex: force release %s: %w", show(key), err)
	case res[0] == 0:
		return nil
	case res[0] < 0:
		return fmt.Errorf("mutex: force release %s: the Redis key holds a value of another type, not written by this package; delete it by hand: redis-cli DEL %s",
			show(key), shellQuote(rkey))
	}
	return fmt.Errorf("mutex: force release %s: the key is held with Limit(%d) by %d holders; ForceRelease frees plain locks only: wait for their leases to end, or delete the key by hand: redis-cli DEL %s",
		show(key), res[1], res[0], shellQuote(rkey))
}

// shellQuote is s quoted for a POSIX shell, as an operator pastes it into redis-cli.
func shellQuote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
