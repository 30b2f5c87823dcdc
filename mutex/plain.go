package mutex

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/redis/go-redis/v9"
)

// plainKind is the plain lock: one holder of one key, or of a set of keys taken as
// one (LockKeys). Its value is a string (layout.go), its waiters queue at the key +
// waitSuffix, and its scripts are lua/plain_*.lua. A set is taken in one script call
// on a single Redis and in one call per key where keys live on several servers.
type plainKind struct{ c *Client }

var _ kind = plainKind{}

func (plainKind) queue(rkey string) string { return rkey + waitSuffix }

func (k plainKind) attempt(ctx context.Context, a *acquisition, w *waiter) (outcome, error) {
	for freed := false; ; freed = true {
		o, limited, err := k.try(ctx, a, w)
		if err != nil || limited < 0 {
			return o, err
		}
		// Lock limited (in a.locks' order) is held with Limit(n): its holders whose
		// leases ended are dropped, and if none is left it is free for us to try again.
		rkey := a.locks[limited]
		res, hs, err := k.c.slots.free(ctx, rkey, a.starter != nil)
		k.c.start(a.starter, hs)
		switch {
		case err != nil:
			return outcome{}, err
		case res[0] == -1:
			return outcome{refused: fmt.Errorf("mutex: lock %s: the Redis key %s holds a value of another type, not written by this package",
				show(a.givenKey(limited)), show(rkey))}, nil
		case res[0] > 0 || freed:
			return outcome{refused: &LimitError{Key: a.givenKey(limited), Held: int(res[1]), Asked: 1}}, nil
		}
	}
}

// try runs plain_lock.lua once, in one call for all of a's locks, or one call per
// lock where they live on several servers. limited is the index (in a.locks' order)
// of a lock found held with Limit(n), else -1. A non-nil w is queued on the busy lock,
// and the locks before it stay taken (a.kept); with a nil w (TryLock) nothing stays
// taken.
func (k plainKind) try(ctx context.Context, a *acquisition, w *waiter) (o outcome, limited int, err error) {
	head := ""
	var queued, all any = "0", "1" // constants in an interface cost no allocation
	if w != nil {
		head, all = w.head, "0"
		if w.queued {
			queued = "1"
		}
	}
	var ticket, claim, who, mode, apart any = "", "0", "", "", ""
	if p := a.park; p != nil { // without w, the ticket only claims: nothing is queued
		ticket, claim, who, mode = p.ticket, p.claim.Milliseconds(), parkedDescription(a.by), a.parkMode()
		if w != nil && a.apart() {
			apart = "ask" // a call parks nowhere: the caller first gives back the others' locks
		}
	}
	var (
		fences    []int64
		busy, ask bool
	)
	limited = -1
	maxLine, replace := a.lineCap(w)
	args := []any{a.id, a.ttl.Milliseconds(), head, queued, a.desc, all, k.c.channels, k.c.countsSubscribers, ticket, claim, who, mode, apart, maxLine, replace}
	o.unconfirmed = k.c.callEach(ctx, plainLockScript, a.keys, 2, args,
		func(b []string, cmd *redis.Cmd) bool {
			var (
				res []int64
				hs  []handed
			)
			res, hs, err = scriptReply(cmd, k, b, 2)
			o.handed = append(o.handed, hs...)
			switch {
			case err != nil:
			case (len(res) == 3 || len(res) == 4 && res[3] == 1) && res[0] <= 0 && res[2] >= 1 && int(res[2]) <= len(b)/2:
				if len(res) == 4 {
					// Its turn came at a lock before the busy one, claimed in this call: the
					// calls that follow do not know it (see acquisition.claimed).
					a.claimed = true
				}
				i := len(fences) + int(res[2]) - 1 // in a.locks' order
				switch res[0] {
				case -1:
					limited = i
				case -2:
					o.parked = true
				case -4:
					ask = true
				case -5:
					o.refused = &lineFullError{key: a.key, n: a.maxLine}
				}
				busy, o.pttl, a.busy = true, time.Duration(res[1])*time.Millisecond, i
				if w != nil { // the locks before the busy one were taken, and kept
					fences = append(fences, make([]int64, res[2]-1)...)
				}
			case len(res) == len(b)/2 && res[0] > 0:
				fences = append(fences, res...)
				return true
			case apart != "" && len(res) == len(b)/2+1 && res[0] > 0 && res[len(res)-1] == 0:
				// A lock handed to the ticket, claimed: see acquisition.claimed.
				a.claimed = true
				fences = append(fences, res[:len(res)-1]...)
				return true
			default:
				err = fmt.Errorf("unexpected reply %v", res)
			}
			return false
		})
	if err != nil || !busy {
		o.fences = fences
		return o, -1, err
	}
	if ask && a.claimed && a.parkMode() == "wait" {
		// Its turn came at a lock before this one, in an earlier call, which this
		// one could not know: it waits rather than parks. The next attempt, at once,
		// queues it here.
		a.kept, o.pttl = len(fences), 0
		return o, -1, nil
	}
	if ask {
		a.kept = 0
		return k.parkApart(ctx, a, w, o)
	}
	if apart != "" && !a.cleared {
		// Locks after the busy one were not looked at: one may have been handed to
		// the ticket (it parked there before). Give it back, once: the ticket then
		// stands in no other line, so nothing more is handed to it.
		// With the waiter's entry, this is no release sent again: the ticket is the
		// task's for all its acquisitions, and a lock its earlier one handed on must
		// not make this one name that lock's new holder to start again.
		a.cleared = true
		rest := a.keys[2*(a.busy+1):]
		_, hs, _ := k.release(ctx, rest, parkedIdentity(a.park.ticket), w.entry, 0, a.park.ticket)
		o.handed = append(o.handed, hs...)
	}
	switch {
	case w == nil && len(fences) > 0:
		// One lock per call (several servers): give back those taken before the busy
		// one, so that TryLock takes all or nothing.
		k.c.abandon(ctx, a)
	case o.parked:
	case w != nil && len(fences) < a.kept && 2*(len(fences)+1) < len(a.keys):
		// A kept lock was lost (its lease ran out while we did not come back, and
		// someone took it): the locks after it that we still hold, or that a release
		// hands us from the queues we were in, must not wait with us for it, or a set
		// that holds it could wait for them. Give them back, and leave those queues.
		k.c.giveBack(ctx, a, a.keys[2*(len(fences)+1):], w.entry)
	}
	a.kept = 0
	if w != nil && !o.parked {
		a.kept = len(fences)
	}
	return o, limited, nil
}

// parkApart parks a, whose locks live on several servers (a call each), at the
// busy lock a.busy, for the outcome o of the attempt that found it busy and changed
// nothing there (plain_lock.lua's "ask"): first every other lock that a holds, or
// that was handed to its ticket, is given back, a release call each, handing it to
// its line's next, and a leaves their lines; then one call parks a at the busy lock,
// taking nothing (plain_lock.lua's "only"). In that order a parked task never holds
// a lock, even if its process dies between the calls: it is then in no line but, if
// it waited there, the busy lock's, as a dead waiter, which a release may hand the
// lock to for a hand-over's short lease (as to any dead waiter); its task comes back
// by asynq's own recovery as any task whose worker died. A lock freed meanwhile goes
// to the first in its line, who may be a's own ticket.
func (k plainKind) parkApart(ctx context.Context, a *acquisition, w *waiter, o outcome) (outcome, int, error) {
	i := a.busy
	others := append(slices.Clone(a.keys[:2*i]), a.keys[2*i+2:]...)
	_, hs, err := k.release(ctx, others, a.id, w.entry, 0, "")
	o.handed = append(o.handed, hs...)
	if err == nil && !a.cleared {
		// The calls before lock i claimed what was handed to the ticket there.
		a.cleared = true
		_, hs, err = k.release(ctx, a.keys[2*i+2:], parkedIdentity(a.park.ticket), w.entry, 0, a.park.ticket)
		o.handed = append(o.handed, hs...)
	}
	if err != nil {
		return o, -1, err // not parked: the waiter's leave gives back what is left
	}
	limited := -1
	args := []any{a.id, a.ttl.Milliseconds(), w.head, "1", a.desc, "0", k.c.channels, k.c.countsSubscribers,
		a.park.ticket, a.park.claim.Milliseconds(), parkedDescription(a.by), a.parkMode(), "only"}
	o.unconfirmed = k.c.callEach(ctx, plainLockScript, a.keys[2*i:2*i+2], 2, args,
		func(b []string, cmd *redis.Cmd) bool {
			var res []int64
			res, hs, err = scriptReply(cmd, k, b, 2)
			o.handed = append(o.handed, hs...)
			switch {
			case err != nil:
			case len(res) == 3 && res[0] == -2:
				o.parked, o.pttl = true, time.Duration(res[1])*time.Millisecond
			case len(res) == 3 && res[0] == -1:
				limited = i
			default:
				err = fmt.Errorf("unexpected reply %v", res)
			}
			return false
		})
	return o, limited, err
}

// release runs plain_release.lua on each lock of keys with its queue and the mark of
// a hand-over by id. fence, of a single lock, tells a repeat of this release from a
// release of the same token's earlier lock; it is 0 for several.
func (k plainKind) release(ctx context.Context, keys []string, id, entry string, fence int64, ticket string) (released, []handed, error) {
	withMarks := make([]string, 0, len(keys)/2*3)
	for i := 0; i+1 < len(keys); i += 2 {
		withMarks = append(withMarks, keys[i], keys[i+1], releasedKey(keys[i], id))
	}
	if len(keys) > 2 {
		fence = 0
	}
	res := releasedOK
	var (
		errs error
		hs   []handed
	)
	k.c.run.Each(ctx, plainReleaseScript, withMarks, 3, []any{id, entry, k.c.channels, k.c.countsSubscribers, tombstoneMillis, fence, ticket},
		func(b []string, cmd *redis.Cmd) bool {
			nums, more, err := scriptReply(cmd, k, b, 3)
			hs = append(hs, more...)
			switch {
			case err == nil && len(nums) != 1:
				errs = join(errs, fmt.Errorf("unexpected reply %v", nums))
			case err != nil:
				errs = join(errs, err)
			case released(nums[0]) == forced || (released(nums[0]) == notOurs && res == releasedOK):
				res = released(nums[0])
			}
			return true // every lock is tried
		})
	return res, hs, errs
}

func (k plainKind) extend(ctx context.Context, l *Lock, ttl time.Duration) (held bool, err error) {
	held = true
	unconfirmed := k.c.callEach(ctx, plainExtendScript, l.locks, 1, []any{l.id, ttl.Milliseconds()},
		func(_ []string, cmd *redis.Cmd) bool {
			var n int64
			n, err = cmd.Int64()
			held = held && n == 1
			return err == nil && held
		})
	if err == nil && held && unconfirmed != nil {
		unconfirmed.Key = l.key
		err = unconfirmed
	}
	return held, err
}

func (k plainKind) pttl(ctx context.Context, l *Lock) (d time.Duration, held bool, err error) {
	least := int64(-1)
	held = true
	k.c.run.Each(ctx, plainPTTLScript, l.locks, 1, []any{l.id},
		func(_ []string, cmd *redis.Cmd) bool {
			var n int64
			n, err = cmd.Int64()
			switch {
			case err != nil:
				return false
			case n == -3:
				held = false
				return false
			case n >= 0 && (least < 0 || n < least):
				least = n
			}
			return true
		})
	if least < 0 {
		return -1, held, err // no expiry: someone removed it by hand
	}
	return time.Duration(least) * time.Millisecond, held, err
}
