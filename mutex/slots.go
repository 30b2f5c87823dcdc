package mutex

import (
	"context"
	"fmt"
	"time"
)

// slotsKind is a lock with Limit(n), n > 1: up to n holders of one key at once, each
// with a slot of its own (token, lease, fence). It is a hash at the key a plain lock
// would use (layout.go), its waiters queue at the key + slotsSuffix with entries that
// carry the limit, and its scripts are lua/slots_*.lua. It shares the plain lock's
// subscription and hand-over.
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
	cmd, unconfirmed := k.c.call(ctx, slotsLockScript, a.keys,
		a.id, a.ttl.Milliseconds(), head, queued, a.desc, a.limit, k.c.channels, k.c.countsSubscribers)
	res, err := cmd.Int64Slice()
	if err == nil && len(res) != 2 {
		err = fmt.Errorf("unexpected reply %v", res)
	}
	if err != nil {
		return outcome{}, err
	}
	switch res[0] {
	case -1:
		return outcome{refused: &LimitError{Key: a.key, Held: int(res[1]), Asked: a.limit}}, nil
	case -2:
		return outcome{refused: &LimitError{Key: a.key, Held: 1, Asked: a.limit}}, nil
	case -3:
		return outcome{refused: fmt.Errorf("mutex: lock %s: the Redis key %s holds a value of another type, not written by this package",
			show(a.key), show(a.keys[0]))}, nil
	case 0:
		return outcome{pttl: time.Duration(res[1]) * time.Millisecond}, nil
	}
	return outcome{fences: res[:1], unconfirmed: unconfirmed}, nil
}

// release frees the slot identity id holds. A release repeated after a lost reply is
// recognised by fence, so that a slot a reused token held before is not taken for
// this one.
func (k slotsKind) release(ctx context.Context, keys []string, id, entry string, fence int64, _ string) (released, []handed, error) {
	r, err := k.c.run.Run(ctx, slotsReleaseScript, []string{keys[0], keys[1], releasedKey(keys[0], id)},
		id, entry, k.c.channels, k.c.countsSubscribers, tombstoneMillis, fence).Int64()
	return released(r), nil, err
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
// lock with Limit(n), and hands their slots to its waiters; when nobody is left it
// becomes a plain lock's tombstone. It returns {holders, limit} as the lock is left:
// {0, 0} when it is free for a plain lock, {-1, 0} when the key holds a value of
// another type.
func (k slotsKind) free(ctx context.Context, rkey string) ([]int64, error) {
	res, err := k.c.run.Run(ctx, slotsFreeScript, []string{rkey, k.queue(rkey)},
		k.c.channels, k.c.countsSubscribers, tombstoneMillis).Int64Slice()
	if err == nil && len(res) != 2 {
		err = fmt.Errorf("unexpected reply %v", res)
	}
	return res, err
}
