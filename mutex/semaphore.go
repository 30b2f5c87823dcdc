package mutex

import (
	"context"
	"crypto/sha256"
	_ "embed"
	"encoding/hex"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex/internal/shortkey"
)

// A lock with Limit(n), n > 1, is a counting semaphore: up to n holders at once. It
// is stored as semaphore.lua describes, with a queue of its own (<key>:slots) whose
// entries carry the limit, and shares the plain lock's subscription and hand-over;
// the functions here are what Lock, TryLock, WithLock, Unlock, Extend, TTL, Locked,
// Inspect and ForceRelease do for it.

var (
	//go:embed semaphore.lua
	semaphoreLua string

	//go:embed sem_lock.lua
	semLockLua    string
	semLockScript = newScript(semaphoreLua + "\n" + semLockLua)

	//go:embed sem_release.lua
	semReleaseLua    string
	semReleaseScript = newScript(semaphoreLua + "\n" + semReleaseLua)

	//go:embed sem_extend.lua
	semExtendLua    string
	semExtendScript = newScript(semaphoreLua + "\n" + semExtendLua)

	//go:embed sem_pttl.lua
	semPTTLLua    string
	semPTTLScript = newScript(semaphoreLua + "\n" + semPTTLLua)

	//go:embed sem_inspect.lua
	semInspectLua    string
	semInspectScript = newScript(semaphoreLua + "\n" + semInspectLua)

	//go:embed sem_free.lua
	semFreeLua    string
	semFreeScript = newScript(semaphoreLua + "\n" + semFreeLua)
)

// MaxLimit is the largest n Limit accepts. Every step of a lock with Limit(n) reads
// all its holders in one script, so its cost grows with n: about 1 µs of Redis time
// per holder per step, during which Redis serves nobody else (see Limit). At
// MaxLimit holders a step takes about a millisecond.
const MaxLimit = 1000

// releasedInfix names the key that marks, for a while after a release, that an
// identity released its slot: <redis key> + releasedInfix + a digest of the identity.
const releasedInfix = ":released:"

// semWaitSuffix names the queue of the waiters of a lock with Limit(n): <redis key>
// + semWaitSuffix. It is not a plain lock's (waitSuffix), so that a release of one
// kind never hands the key to a waiter of the other.
const semWaitSuffix = ":slots"

// Limit lets up to n holders hold the lock on a key at once: a counting semaphore,
// for example at most 5 tasks of one tenant at a time. TryLock, Lock and WithLock
// take it. Limit(1), like no Limit, is the plain lock. The default is 1.
//
// Each holder has a lock of its own: its own token, lease, renewal (WithLock renews
// it every ttl/3 and cancels fn when it is lost, as for a plain lock), HeldBy
// description, and fence; fences increase across all holders of the key, by the
// plain lock's rule (see the package doc). Unlock frees the holder's slot and hands
// it, in the same script, to the waiter queued longest, as a plain lock's release
// hands over the lock; a crashed holder's slot frees when its lease ends, and waiters
// try again by themselves when the earliest lease of the key ends (plus jitter).
// Lost replies are handled as for a plain lock: an acquisition repeated by the same
// token gets its slot and fence back, and a repeated Unlock succeeds for 10s.
//
// The limit belongs to the key while anyone holds it. An acquisition asking for
// another limit (a plain lock, or Limit(m) with m != n) fails with a *LimitError
// naming both limits, not ErrNotObtained: at once when it finds the key held, or, when
// it was waiting as the limit changed (every holder gone and a new one taking the key
// with another limit), at its next attempt: a release never hands a slot to a waiter
// under another limit, nor a plain lock to a waiter of Limit(n) or back. When nobody
// holds the key, the limit asked for becomes the key's. A plain lock whose key a
// Limit(n) holder took after its lease ended gets ErrNotHeld from Unlock, Extend and
// TTL, as for any lost lease. Inspect and List show every holder (Info.Slots);
// ForceRelease refuses a key held with Limit(n), n > 1, with an error that says so.
//
// Every step is one script call, as for a plain lock, and reads all holders of the
// key, so its cost grows with n: in one run of BenchmarkLimitServerTime a TryLock and
// Unlock took 43 µs of Redis time with 3 other holders and about 410 µs with 199,
// about 1 µs per holder per step, where a plain lock's took 21 µs. The holders live in
// a Redis hash at the key a plain lock would use (so the two cannot be mixed
// unnoticed), the waiters in the key plus ":slots", and a release marks itself for 10s
// in the key plus ":released:" and a digest of the token; all share the key's hash
// tag, so one Redis Cluster slot. Limit panics if n is below 1 or above MaxLimit.
func Limit(n int) LockOption {
	if n < 1 || n > MaxLimit {
		panic(fmt.Sprintf("mutex.Limit: limit %d outside [1, %d] (MaxLimit)", n, MaxLimit))
	}
	return lockOptionFunc(func(c *lockConfig) { c.limit = n })
}

// LimitError is the error of an acquisition that asked for a key with another limit
// than the one its holders use (see Limit). Nothing changed in Redis. A plain lock
// counts as Limit(1).
type LimitError struct {
	Key   string // the key as the caller gave it
	Held  int    // the limit of the key's holders
	Asked int    // the limit asked for
}

// Error names the key (shortened past 100 bytes) and both limits.
func (e *LimitError) Error() string {
	return fmt.Sprintf("mutex: lock %s: held with %s, asked with %s; every holder of a key must use the same limit while it is held",
		shortkey.Quote(e.Key), limitText(e.Held), limitText(e.Asked))
}

func limitText(n int) string {
	if n <= 1 {
		return "no Limit (a plain lock)"
	}
	return "Limit(" + strconv.Itoa(n) + ")"
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

// semAttempt is attempt for a lock with Limit(n), n > 1: it runs sem_lock.lua once.
func (c *Client) semAttempt(ctx context.Context, a *acquisition, w *waiter) (*Lock, time.Duration, error) {
	if err := ctx.Err(); err != nil {
		return nil, 0, errors.Join(ErrNotObtained, err)
	}
	head, queued := "", "0"
	if w != nil {
		head = w.head
		if w.queued {
			queued = "1"
		}
	}
	sent := time.Now()
	res, err := semLockScript.Run(ctx, c.rdb, a.keys,
		a.id, a.ttl.Milliseconds(), head, queued, a.desc, a.limit, c.channels, c.countsSubscribers).Int64Slice()
	if err == nil && len(res) != 2 {
		err = fmt.Errorf("unexpected reply %v", res)
	}
	if err := c.attempted(ctx, a, w, sent, err); err != nil {
		return nil, 0, err
	}
	switch res[0] {
	case -1:
		return nil, 0, &LimitError{Key: a.key, Held: int(res[1]), Asked: a.limit}
	case -2:
		return nil, 0, &LimitError{Key: a.key, Held: 1, Asked: a.limit}
	case -3:
		return nil, 0, fmt.Errorf("mutex: lock %s: the Redis key %s holds a value of another type, not written by this package",
			shortkey.Quote(a.key), shortkey.Quote(a.keys[0]))
	case 0:
		c.contended(ctx, a)
		return nil, time.Duration(res[1]) * time.Millisecond, nil
	}
	return a.lock(res[:1], sent, a.ttl), 0, nil
}

// semLimitHeld is what a plain lock's attempt does when it finds the key held with
// Limit(n) (Redis answered WRONGTYPE): holders whose lease has ended are dropped, and
// when none is left the key is made free and the attempt is made again; otherwise it
// fails with a *LimitError.
func (c *Client) semLimitHeld(ctx context.Context, a *acquisition, w *waiter) (*Lock, time.Duration, error) {
	res, err := c.semFree(ctx, a.keys[0])
	if err != nil {
		if ctx.Err() != nil {
			return nil, 0, errors.Join(ErrNotObtained, ctx.Err())
		}
		return nil, 0, fmt.Errorf("mutex: lock %s: %w", shortkey.Quote(a.key), err)
	}
	if res[0] == 0 {
		return c.attempt(ctx, a, w)
	}
	return nil, 0, &LimitError{Key: a.key, Held: int(res[1]), Asked: max(a.limit, 1)}
}

// semFree runs sem_free.lua on the lock at Redis key rkey, and returns {holders,
// limit} as it is left.
func (c *Client) semFree(ctx context.Context, rkey string) ([]int64, error) {
	res, err := semFreeScript.Run(ctx, c.rdb, []string{rkey, rkey + semWaitSuffix}, c.channels, c.countsSubscribers, tombstoneMillis).Int64Slice()
	if err == nil && len(res) != 2 {
		err = fmt.Errorf("unexpected reply %v", res)
	}
	return res, err
}

// isWrongType reports whether err is Redis's answer to a plain lock's command on a
// key held with Limit(n), which is a HASH. Redis starts the error of a script with
// WRONGTYPE; miniredis puts it inside a compile error.
func isWrongType(err error) bool {
	var re redis.Error
	return errors.As(err, &re) && strings.Contains(re.Error(), "WRONGTYPE Operation against a key holding the wrong kind of value")
}

// semRelease runs sem_release.lua: it frees the slot identity id holds in the lock
// whose Redis keys (lock, queue) are keys, and hands it on. A non-empty entry (a
// waiter that gives up) is first taken out of the queue, and a slot handed to it
// meanwhile is passed on.
//
// fence is the fence of the slot to release, or 0 when not known (a waiter that
// gives up, an attempt abandoned): a release repeated after a lost reply is
// recognised by it, so that a slot a reused token held before is not taken for this
// one.
func (c *Client) semRelease(ctx context.Context, keys []string, id, entry string, fence int64) (int64, error) {
	return semReleaseScript.Run(ctx, c.rdb, []string{keys[0], keys[1], releasedKey(keys[0], id)},
		id, entry, c.channels, c.countsSubscribers, tombstoneMillis, fence).Int64()
}

// releasedKey is the key that marks that identity id released its slot of the lock
// at rkey: in rkey's hash slot, and named by a digest so that no token shows in a
// key name.
func releasedKey(rkey, id string) string {
	sum := sha256.Sum256([]byte(id))
	return rkey + releasedInfix + hex.EncodeToString(sum[:16])
}

// semUnlock is unlock for a lock with Limit(n).
func (l *Lock) semUnlock(ctx context.Context) error {
	n, err := l.c.semRelease(ctx, l.keys, l.id, "", l.fence)
	if err != nil {
		return fmt.Errorf("mutex: unlock %s: %w", shortkey.Quote(l.key), err)
	}
	if n == 0 {
		return fmt.Errorf("mutex: unlock %s: %w", shortkey.Quote(l.key), ErrNotHeld)
	}
	return nil
}

// semExtend is extend for a lock with Limit(n).
func (l *Lock) semExtend(ctx context.Context, ttl time.Duration) error {
	if err := checkTTL(ttl); err != nil {
		return fmt.Errorf("mutex: extend %s: %w", shortkey.Quote(l.key), err)
	}
	sent := time.Now()
	n, err := semExtendScript.Run(ctx, l.c.rdb, l.keys[:1], l.id, ttl.Milliseconds()).Int64()
	if err != nil {
		return fmt.Errorf("mutex: extend %s: %w", shortkey.Quote(l.key), err)
	}
	if n == 0 {
		return fmt.Errorf("mutex: extend %s: %w", shortkey.Quote(l.key), ErrNotHeld)
	}
	l.mu.Lock()
	l.until = leaseEnd(sent, ttl)
	l.mu.Unlock()
	return nil
}

// semTTL is TTL for a lock with Limit(n).
func (l *Lock) semTTL(ctx context.Context) (time.Duration, error) {
	n, err := semPTTLScript.Run(ctx, l.c.rdb, l.keys[:1], l.id).Int64()
	switch {
	case err != nil:
		return 0, fmt.Errorf("mutex: ttl of %s: %w", shortkey.Quote(l.key), err)
	case n < 0:
		return 0, fmt.Errorf("mutex: ttl of %s: %w", shortkey.Quote(l.key), ErrNotHeld)
	}
	return time.Duration(n) * time.Millisecond, nil
}

// semLocked is Locked for a key held with Limit(n).
func (c *Client) semLocked(ctx context.Context, key string) (bool, error) {
	in, err := c.semInspect(ctx, key)
	return in.Held, err
}

// semInspect is Inspect for a key held with Limit(n).
func (c *Client) semInspect(ctx context.Context, key string) (Info, error) {
	rkey := c.redisKey(key)
	res, err := semInspectScript.Run(ctx, c.rdb, []string{rkey, rkey + semWaitSuffix}, maxListedWaiters).Slice()
	if err != nil {
		return Info{}, fmt.Errorf("mutex: inspect %s: %w", shortkey.Quote(key), err)
	}
	return c.semInfo(rkey, res)
}

// semInfo reads sem_inspect.lua's reply about the lock at Redis key rkey. The
// holders are listed in Slots, oldest fence first; Holder, Fence, Since and HeldFor
// describe the newest holder, and TTL is the longest lease left: when the key frees
// unless renewed.
func (c *Client) semInfo(rkey string, res []any) (Info, error) {
	if len(res) < 5 {
		return Info{}, fmt.Errorf("mutex: inspect %s: unexpected reply %v", shortkey.Quote(rkey), res)
	}
	in := Info{RedisKey: rkey}
	in.Key, in.Digested = c.keyOf(rkey)
	fields, _ := res[0].([]any)
	waiting, _ := res[2].(int64)
	in.Waiting = int(waiting)
	entries, _ := res[3].([]any)
	for _, e := range entries {
		s, _ := e.(string)
		in.Waiters = append(in.Waiters, parseEntry(s))
	}
	now := serverTime(res[4])
	for i := 0; i+1 < len(fields); i += 2 {
		f, _ := fields[i].(string)
		v, _ := fields[i+1].(string)
		switch {
		case f == "limit":
			in.Limit, _ = strconv.Atoi(v)
		case strings.HasPrefix(f, "h"):
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
		return in, nil
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
	return in, nil
}

type slotValue struct {
	Slot
	end time.Time // lease end, on the server's clock
}

// parseSlot reads a holder's value: "<lease end ms> <fence> <since µs> <description>".
func parseSlot(v string) (slotValue, bool) {
	f := strings.SplitN(v, " ", 4)
	if len(f) < 4 {
		return slotValue{}, false
	}
	end, err1 := strconv.ParseInt(f[0], 10, 64)
	fence, err2 := strconv.ParseInt(f[1], 10, 64)
	since, err3 := strconv.ParseInt(f[2], 10, 64)
	if err1 != nil || err2 != nil || err3 != nil {
		return slotValue{}, false
	}
	s := slotValue{Slot: Slot{Fence: fence, Since: time.UnixMicro(since)}, end: time.UnixMilli(end)}
	if desc, _, ok := cutCounted(f[3]); ok {
		s.Holder = parseDescription(desc)
	}
	return s, true
}

// semForceRelease is ForceRelease's answer for a key held with Limit(n).
func (c *Client) semForceRelease(ctx context.Context, key string) (Released, error) {
	// Holders whose leases ended hold nothing: when none is left, the key becomes a
	// plain lock's tombstone, which the force release below finds free.
	if res, err := c.semFree(ctx, c.redisKey(key)); err == nil && res[0] == 0 {
		return c.forceRelease(ctx, key, false)
	}
	in, err := c.semInspect(ctx, key)
	if err != nil {
		return Released{}, fmt.Errorf("mutex: force release %s: %w", shortkey.Quote(key), err)
	}
	return Released{}, fmt.Errorf("mutex: force release %s: the key is held with Limit(%d) by %d holders; ForceRelease frees plain locks only: wait for their leases to end, or delete the Redis key %s by hand",
		shortkey.Quote(key), in.Limit, len(in.Slots), shortkey.Quote(in.RedisKey))
}
