package mutex

import (
	"context"
	"fmt"
	"time"
)

// slotsKind is a lock with Limit(n), n > 1: up to n holders of one key at once, each
// with a slot of its own (token, lease, fence). It is a hash at the key a plain lock
// would use (layout.go), its waiters queue at the key + slotsSuffix with entries that
// carry the limit (and parked tasks' entries, as a plain lock's line holds them), and
// its scripts are lua/slots_*.lua. It shares the plain lock's subscription and
// hand-over.
type slotsKind struct{ c *Client }

var _ kind = slotsKind{}

func (slotsKind) queue(rkey string) string { return rkey + slotsSuffix }

func (k slotsKind) attempt(ctx context.Context, a *acquisition, w *waiter) (outcome, error) {
	head, queued := "", "0"
	if w != nil {
		head = w.head
		if w.queued {
			queued = "1"
		}
	}
	var ticket, claim, who, mode any = "", "0", "", ""
	if pk := a.park; pk != nil { // without w, the ticket only claims: nothing is queued
		ticket, claim, who, mode = pk.ticket, pk.claim.Milliseconds(), parkedDescription(a.by), a.parkMode()
	}
	maxLine, replace := a.lineCap(w)
	cmd, unconfirmed := k.c.call(ctx, slotsLockScript, a.keys,
		a.id, a.ttl.Milliseconds(), head, queued, a.desc, a.limit, k.c.channels, k.c.countsSubscribers,
		ticket, claim, who, mode, maxLine, replace)
	res, hs, err := scriptReply(cmd, k, a.keys, 2)
	if err == nil && len(res) != 2 {
		err = fmt.Errorf("unexpected reply %v", res)
	}
	if err != nil {
		return outcome{handed: hs}, err
	}
	o := outcome{handed: hs}
	switch res[0] {
	case -1:
		o.refused = &LimitError{Key: a.key, Held: int(res[1]), Asked: a.limit}
	case -2:
		o.refused = &LimitError{Key: a.key, Held: 1, Asked: a.limit}
	case -3:
		o.refused = fmt.Errorf("mutex: lock %s: the Redis key %s holds a value of another type, not written by this package",
			show(a.key), show(a.keys[0]))
	case -4:
		o.parked, o.pttl = true, time.Duration(res[1])*time.Millisecond
	case -5:
		o.refused = &lineFullError{key: a.key, n: a.maxLine}
	case 0:
		o.pttl = time.Duration(res[1]) * time.Millisecond
	default:
		o.fences, o.unconfirmed = res[:1], unconfirmed
	}
	return o, nil
}

// release frees the slot identity id holds. A release repeated after a lost reply is
// recognised by fence, so that a slot a reused token held before is not taken for
// this one.
func (k slotsKind) release(ctx context.Context, keys []string, id, entry string, fence int64, ticket string) (released, []handed, error) {
	ks := []string{keys[0], keys[1], releasedKey(keys[0], id)}
	nums, hs, err := scriptReply(k.c.run.Run(ctx, slotsReleaseScript, ks,
		id, entry, k.c.channels, k.c.countsSubscribers, tombstoneMillis, fence, ticket), k, ks, 3)
	if err == nil && len(nums) != 1 {
		err = fmt.Errorf("unexpected reply %v", nums)
	}
	if err != nil {
		return notOurs, hs, err
	}
	return released(nums[0]), hs, nil
}

func (k slotsKind) extend(ctx context.Context, l *Lock, ttl time.Duration) (bool, error) {
	cmd, unconfirmed := k.c.call(ctx, slotsExtendScript, l.locks, l.id, ttl.Milliseconds())
	n, err := cmd.Int64()
	if err == nil && n == 1 && unconfirmed != nil {
		unconfirmed.Key = l.key
		return true, unconfirmed
	}
	return n == 1, err
}

func (k slotsKind) pttl(ctx context.Context, l *Lock) (time.Duration, bool, error) {
	n, err := k.c.run.Run(ctx, slotsPTTLScript, l.locks, l.id).Int64()
	return time.Duration(n) * time.Millisecond, n >= 0, err
}

// free drops the holders whose leases have ended of the lock at Redis key rkey, a
// lock with Limit(n), and hands their slots to its line; when nobody is left it
// becomes a plain lock's tombstone. It returns {holders, limit} as the lock is left:
// {0, 0} when it is free for a plain lock, {-1, 0} when the key holds a value of
// another type; and, when starts (the caller has a Starter for them), the parked
// tasks the hand-over asks to start.
func (k slotsKind) free(ctx context.Context, rkey string, starts bool) ([]int64, []handed, error) {
	ks := []string{rkey, k.queue(rkey)}
	var collect any = "0"
	if starts {
		collect = "1"
	}
	res, hs, err := scriptReply(k.c.run.Run(ctx, slotsFreeScript, ks,
		k.c.channels, k.c.countsSubscribers, tombstoneMillis, collect), k, ks, 2)
	if err == nil && len(res) != 2 {
		err = fmt.Errorf("unexpected reply %v", res)
	}
	return res, hs, err
}
