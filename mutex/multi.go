package mutex

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/asynqmutex/asynqmutex/internal/keyset"
	"github.com/asynqmutex/asynqmutex/internal/shortkey"
)

// TryLockKeys makes one attempt to take the locks on all of keys as one lock, for
// ttl: all of them or none. It returns ErrNotObtained when another holder has any of
// them, and a wrapped Redis error when Redis cannot be reached (after trying to
// release whatever the attempt may have taken). Each key is locked as TryLock would
// lock it alone, so a lock on one of the keys, taken by TryLock, Lock or WithLock
// anywhere, excludes this one and the other way round.
//
// On a single Redis (also with Sentinel) the attempt is one script call, atomic: no
// other client sees some of the keys taken. Where keys live on several servers
// (Redis Cluster, Ring: each key is in its own hash slot), it takes one key per
// call, in a fixed order, and gives back those it took when one is busy; another
// client may see them taken meanwhile.
//
// keys must hold at least one key, none empty; a key given twice is locked once. ttl
// is as for TryLock. The options are those of TryLock.
func (c *Client) TryLockKeys(ctx context.Context, keys []string, ttl time.Duration, opts ...LockOption) (*Lock, error) {
	a, err := c.newMultiAcquisition(keys, ttl, opts)
	if err != nil {
		return nil, err
	}
	a.maxWait = 0
	return c.acquire(ctx, a)
}

// LockKeys takes the locks on all of keys as one lock, as Lock takes one, waiting
// while any of them is busy: until it holds all of them, ctx is done, or the MaxWait
// option's bound elapses. It returns all the locks or none, with ErrNotObtained or a
// wrapped Redis error as Lock does.
//
// Overlapping sets taken in any order never deadlock: every acquisition takes its
// keys in one fixed order (of their Redis keys), and while it waits for a busy key it
// keeps the keys before it in that order (renewing them within a third of ttl), never
// one after it: should it lose a key it kept (its process stalled past the lease and
// someone took the key), it gives back the keys after that one before it waits
// again. So no waiter holds a key another waiter needs to get past it, and waiters
// of one key are served in the order they queued, as for a single key. A
// waiter is handed each busy key by its holder's release, as Lock is, and its next
// attempt takes the keys after it that are free, in the same script call on a
// single Redis (one call per key in Redis Cluster). A waiter that gives up releases
// the keys it kept, handing them to their own waiters.
//
// The price of that order: while a set waits for its last busy key, the keys it
// keeps are busy for anyone else. With keys that are each busy briefly this costs
// little; TryLockKeys takes nothing while it fails.
func (c *Client) LockKeys(ctx context.Context, keys []string, ttl time.Duration, opts ...LockOption) (*Lock, error) {
	a, err := c.newMultiAcquisition(keys, ttl, opts)
	if err != nil {
		return nil, err
	}
	return c.acquire(ctx, a)
}

// WithLockKeys takes the locks on all of keys as one lock, as LockKeys does (waiting
// unless MaxWait(0)), runs fn while holding them, and releases them all when fn
// returns or panics. It renews all of them together, every ttl/3, in one call on a
// single Redis; if any lease is lost (Redis says a key is no longer ours, or renewals
// fail until the lease would have ended on this process's clock), fn's context is
// cancelled at once and WithLockKeys returns an error wrapping ErrNotHeld, exactly as
// WithLock does for one key. FromContext gives fn the Lock, whose Fences are the
// fencing tokens of the keys. The results are those of WithLock.
func (c *Client) WithLockKeys(ctx context.Context, keys []string, ttl time.Duration, fn func(context.Context) error, opts ...LockOption) error {
	if fn == nil {
		return errors.New("mutex: WithLockKeys with nil fn")
	}
	a, err := c.newMultiAcquisition(keys, ttl, opts)
	if err != nil {
		return err
	}
	return c.withLock(ctx, a, fn)
}

// Keys returns the keys the lock was taken on, as the caller gave them (without
// repeats): one for a lock taken by TryLock, Lock or WithLock. The slice is the
// caller's to keep.
func (l *Lock) Keys() []string {
	if l == nil {
		return nil
	}
	if l.given == nil {
		return []string{l.key}
	}
	return slices.Clone(l.given)
}

// Fences returns the fencing token of each key, in the order of Keys: each strictly
// greater than the fence of every earlier acquisition of its key (see Fence). Pass
// to each resource the fence of its own key. The slice is the caller's to keep.
func (l *Lock) Fences() []int64 {
	if l == nil {
		return nil
	}
	if l.fences == nil {
		return []int64{l.fence}
	}
	return slices.Clone(l.fences)
}

// newMultiAcquisition is an acquisition of the locks on keys, taken in the order of
// their Redis keys.
func (c *Client) newMultiAcquisition(keys []string, ttl time.Duration, opts []LockOption) (*acquisition, error) {
	if slices.Contains(keys, "") {
		return nil, errors.New("mutex: empty key among several")
	}
	given := slices.Clone(keyset.Distinct(keys)) // the caller's slice stays the caller's
	switch len(given) {
	case 0:
		return nil, errors.New("mutex: no key given")
	case 1:
		return c.newAcquisition(given[0], ttl, opts)
	}
	if err := checkTTL(ttl); err != nil {
		return nil, fmt.Errorf("mutex: lock %s: %w", showKeys("", given), err)
	}
	rkeys := make([]string, len(given))
	for i, k := range given {
		rkeys[i] = c.redisKey(k)
	}
	sorted := slices.Clone(rkeys)
	slices.Sort(sorted) // distinct keys have distinct Redis keys
	a := &acquisition{c: c, start: time.Now(), key: given[0], given: given,
		keys: make([]string, 0, 2*len(sorted)), locks: sorted, order: make([]int, len(given)),
		ttl: ttl, lockConfig: lockConfig{maxWait: -1}}
	for _, r := range sorted {
		a.keys = append(a.keys, r, r+waitSuffix)
	}
	for i, r := range rkeys {
		a.order[i], _ = slices.BinarySearch(sorted, r)
	}
	c.configure(a, opts)
	if a.limit > 1 {
		return nil, fmt.Errorf("mutex: lock %s: Limit(%d) applies to one key; a set of keys takes plain locks", a.what(), a.limit)
	}
	return a, nil
}

// what is the lock's key or keys, quoted and shortened, for errors.
func (l *Lock) what() string { return showKeys(l.key, l.given) }

// what is the acquisition's key or keys, quoted and shortened, for errors.
func (a *acquisition) what() string { return showKeys(a.key, a.given) }

// showKeys is key, or keys when there are several, each quoted and shortened.
func showKeys(key string, keys []string) string {
	if keys == nil {
		return shortkey.Quote(key)
	}
	q := make([]string, len(keys))
	for i, k := range keys {
		q[i] = shortkey.Quote(k)
	}
	return "keys " + strings.Join(q, ", ")
}

// batch is the i-th of the calls that run a script on keys, groups of per Redis keys
// that belong to one lock, and whether there is one: a single call on a single
// Redis, one per lock where keys live on several servers (each lock has its own hash
// slot).
func (c *Client) batch(keys []string, per, i int) ([]string, bool) {
	if c.oneNode || len(keys) == per {
		return keys, i == 0
	}
	if i*per >= len(keys) {
		return nil, false
	}
	return keys[i*per : (i+1)*per], true
}

// BusyKey returns the key another holder had when TryLockKeys, LockKeys or
// WithLockKeys returned err, an error wrapping ErrNotObtained: of the keys found
// busy, the first in the order they are taken. It reports false for any other
// error, and for an acquisition of one key, whose key the caller knows.
func BusyKey(err error) (key string, ok bool) {
	var be *busyError
	if errors.As(err, &be) {
		return be.key, true
	}
	return "", false
}

// busyError is ErrNotObtained (joined with the context's error, if any) from an
// acquisition of several keys, naming the key that was busy.
type busyError struct {
	key string
	err error
}

func (e *busyError) Error() string {
	if e.err == ErrNotObtained {
		return "mutex: not obtained: key " + shortkey.Quote(e.key) + " is held"
	}
	return "mutex: not obtained, key " + shortkey.Quote(e.key) + " being held: " + e.err.Error()
}

func (e *busyError) Unwrap() error { return e.err }
