package mutex

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/asynqmutex/asynqmutex/internal/keyset"
	"github.com/asynqmutex/asynqmutex/internal/store"
)

// renewedHandOver is the lease a release hands a WithLock waiter: its renewal
// lengthens it at once, and a waiter cut off from Redis as the lock is handed to it
// (its process stopped, its network lost) holds the lock no longer than this.
const renewedHandOver = 250 * time.Millisecond

// TryLock makes one attempt to take the lock on key for ttl. It returns
// ErrNotObtained when another holder has it, and a wrapped Redis error when Redis
// cannot be reached; in that case it first tries to release the key in case the
// server applied the attempt but its reply was lost, so no lock leaks for a whole
// lease. ttl is rounded down to whole milliseconds and must lie between MinTTL and
// MaxTTL; key must not be empty.
func (c *Client) TryLock(ctx context.Context, key string, ttl time.Duration, opts ...LockOption) (*Lock, error) {
	a, err := c.newAcquisition(key, ttl, opts)
	if err != nil {
		return nil, err
	}
	a.maxWait = 0
	return c.acquire(ctx, a)
}

// Lock takes the lock on key for ttl, waiting while another holder has it: until the
// lock is obtained, ctx is done, or the MaxWait option's bound elapses. It returns
// ErrNotObtained when the wait ended without the lock (joined with ctx.Err() when ctx
// ended it) and a wrapped Redis error when Redis cannot be reached (after trying to
// release anything the failed attempt may have taken).
//
// A waiter does not poll. A failed attempt queues it in Redis, in the same script, and
// a release hands the lock to the longest-queued waiter of any Client, in the release
// script itself, and tells that waiter's Client on its subscription connection: one
// release, one waiter, no race with newcomers, one round trip from release to
// holding. Waiters are served in the order they first queued and keep their place
// while they wait.
//
// Once waiting, a Redis that cannot be reached for a while (a restart, dropped
// connections) does not end the wait: the waiter tries again, with a growing pause
// of up to a second and at once when its subscription is back, until the wait ends;
// then it returns the last Redis error. A Redis that cannot be reached at the first
// attempt, or that refuses the call, ends it at once.
//
// A waiter that gives up (ctx done, MaxWait, a Redis error) leaves the queue and, if
// the lock was handed to it meanwhile, passes it on at once. A release skips waiters
// whose Client no longer listens (it died, or is reconnecting and will try again when
// it listens again). A waiter that cannot hear it is handed the lock anyway when Redis
// still counts its connection (its network vanished without a reset) or cannot count
// (Redis Cluster, where PUBLISH counts one node's subscribers): the lock then frees when
// the lease it was handed ends. That lease is ttl for Lock, and 250ms for WithLock,
// whose first renewal lengthens it to ttl. When nothing comes (the holder
// crashed), a waiter tries again when the holder's remaining lease runs out, plus a
// little random jitter. A subscription connection that stops answering is noticed
// within 3s (see Client), after which every waiter of the Client tries again.
//
// ttl is rounded down to whole milliseconds and must lie between MinTTL and MaxTTL;
// key must not be empty.
func (c *Client) Lock(ctx context.Context, key string, ttl time.Duration, opts ...LockOption) (*Lock, error) {
	a, err := c.newAcquisition(key, ttl, opts)
	if err != nil {
		return nil, err
	}
	return c.acquire(ctx, a)
}

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
// is as for TryLock. The options are those of TryLock, but for Limit: a key held
// with Limit(n) fails the acquisition with a *LimitError.
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
// little; TryLockKeys takes nothing while it fails, and a set that parks (Park) holds
// none of its keys.
func (c *Client) LockKeys(ctx context.Context, keys []string, ttl time.Duration, opts ...LockOption) (*Lock, error) {
	a, err := c.newMultiAcquisition(keys, ttl, opts)
	if err != nil {
		return nil, err
	}
	return c.acquire(ctx, a)
}

// acquisition is one call of TryLock, Lock or WithLock (or of their several-keys
// forms): several attempts share its token.
type acquisition struct {
	c         *Client
	kind      kind
	renewed   bool // WithLock renews the lease: a hand-over may give a short one
	contended bool // an attempt found another holder: OpContended was reported
	parkNow   bool // with Park: the wait in the process ended; the next attempt parks
	cleared   bool // several keys apart, with Park: locks after a busy one were given back
	claimed   bool // several keys, with Park: a lock handed to the ticket was claimed: its turn came
	kept      int  // several keys: how many the last attempt kept before a busy one
	busy      int  // several keys: the index in keys' order of the last busy one
	start     time.Time
	id        string   // identity(token)
	desc      string   // what the holder says about itself, counted (see describe)
	key       string   // the caller's key (the first, of several)
	given     []string // several keys: all of them, in the caller's order; nil for one
	keys      []string // each lock's Redis key and its queue, in the order to take them
	locks     []string // the Redis keys of the locks alone, in that order
	order     []int    // several keys: where each of given is in keys' order
	ttl       time.Duration
	lockConfig
}

// newAcquisition is an acquisition of the lock on key.
func (c *Client) newAcquisition(key string, ttl time.Duration, opts []LockOption) (*acquisition, error) {
	if key == "" {
		return nil, errors.New("mutex: empty key")
	}
	if err := checkTTL(ttl); err != nil {
		return nil, fmt.Errorf("mutex: lock %s: %w", show(key), err)
	}
	a := &acquisition{c: c, start: time.Now(), key: key, ttl: ttl, lockConfig: lockConfig{maxWait: -1}}
	c.configure(a, opts)
	if a.maxLine > 0 && a.park == nil {
		return nil, fmt.Errorf("mutex: lock %s: MaxLine applies to acquisitions with Park", show(key))
	}
	rkey := c.redisKey(key)
	a.keys = []string{rkey, a.kind.queue(rkey)}
	a.locks = a.keys[:1]
	return a, nil
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
	c.configure(a, opts)
	if a.limit > 1 {
		return nil, fmt.Errorf("mutex: lock %s: Limit(%d) applies to one key; a set of keys takes plain locks", a.what(), a.limit)
	}
	if a.maxLine > 0 {
		return nil, fmt.Errorf("mutex: lock %s: MaxLine applies to one key, not yet to a set of keys", a.what())
	}
	for _, r := range sorted {
		a.keys = append(a.keys, r, a.kind.queue(r))
	}
	for i, r := range rkeys {
		a.order[i], _ = slices.BinarySearch(sorted, r)
	}
	return a, nil
}

// configure applies opts to a and sets what follows from them.
func (c *Client) configure(a *acquisition, opts []LockOption) {
	for _, o := range opts {
		o.applyLock(&a.lockConfig)
	}
	if a.token == "" {
		a.token = newToken()
	}
	a.id = identity(a.token)
	a.desc = c.describe(a.by)
	a.kind = c.plain
	if a.limit > 1 {
		a.kind = c.slots
	}
}

// parkMode is what a's next attempt does at a busy lock, for plain_lock.lua and
// slots_lock.lua: it parks now once its wait in the process has ended (parkNow). A
// set whose turn came at one of its keys (claimed) waits, as plain_lock.lua has it
// do in the call that claims.
func (a *acquisition) parkMode() string {
	switch {
	case a.parkNow:
		return "park"
	case a.park.mode == ParkLead && !a.claimed:
		return "lead"
	}
	return "wait" // ParkAfterWait, ParkNever
}

// lineCap is MaxLine's n and replace as the lock scripts take them, for an attempt
// by waiter w: only the first attempt that may queue it is capped (see MaxLine).
func (a *acquisition) lineCap(w *waiter) (n, replace any) {
	if w == nil || w.queued || a.maxLine == 0 || a.park == nil {
		return "0", "0"
	}
	if a.replace {
		return a.maxLine, "1"
	}
	return a.maxLine, "0"
}

// apart reports whether a takes several locks in calls of their own: they live on
// several servers (Redis Cluster, Ring).
func (a *acquisition) apart() bool { return a.given != nil && !a.c.run.OneNode() }

// what is the acquisition's key or keys, for errors.
func (a *acquisition) what() string { return showKeys(a.key, a.given) }

// givenKey is the caller's key of the i-th lock in the order they are taken.
func (a *acquisition) givenKey(i int) string {
	for g, j := range a.order {
		if j == i {
			return a.given[g]
		}
	}
	return a.key
}

// acquire takes the lock for a, waiting as a.maxWait says, and reports the outcome to
// the Client's observers.
func (c *Client) acquire(ctx context.Context, a *acquisition) (*Lock, error) {
	l, err := c.obtain(ctx, a)
	var re *ReplicasError
	if a.given != nil && l == nil && errors.Is(err, ErrNotObtained) && a.contended && !errors.As(err, &re) {
		err = &busyError{key: a.givenKey(a.busy), err: err}
	}
	if c.observe != nil {
		e := Event{Key: a.key, Keys: a.given, Name: a.by.name, ID: a.by.id, Contended: a.contended, Err: err}
		switch {
		case l == nil:
			e.Op, e.Wait = OpNotObtained, time.Since(a.start)
		case a.contended:
			e.Op, e.Fence, e.Wait = OpAcquired, l.fence, l.taken.Sub(a.start)
		default:
			e.Op, e.Fence = OpAcquired, l.fence
		}
		c.observe(ctx, e)
	}
	return l, err
}

// obtain takes the lock for a: one attempt when a.maxWait is 0, else waiting for a
// hand-over or for the holder's lease to end, within a.maxWait and ctx. A wait rides
// out a Redis it can no longer reach: it tries again with a growing pause, and at once
// when the subscription is back, and returns the Redis error only if the wait ends
// first.
func (c *Client) obtain(ctx context.Context, a *acquisition) (*Lock, error) {
	if a.maxWait == 0 {
		l, _, err := c.attempt(ctx, a, nil)
		if err == nil && l == nil {
			err = ErrNotObtained
		}
		return l, err
	}
	// Join before the first attempt: a release may hand us the lock as soon as that
	// attempt has queued us, before it even returns.
	w := c.hub.join(a)
	acquired := false
	defer func() { c.hub.leave(ctx, w, acquired) }()

	var deadline <-chan time.Time
	if a.maxWait > 0 {
		t := time.NewTimer(a.maxWait)
		defer t.Stop()
		deadline = t.C
	}
	var (
		timer    *time.Timer
		lastErr  error         // of the last attempt, when Redis could not be reached
		backoff  time.Duration // before the next attempt after such an error
		subbed   bool          // the subscription was asked for
		attempts int
	)
	for {
		if attempts > 0 {
			select {
			case <-ctx.Done():
				return nil, join(ErrNotObtained, ctx.Err())
			case <-deadline:
				if lastErr != nil {
					return nil, lastErr
				}
				if a.park == nil || a.park.mode == ParkNever {
					return nil, ErrNotObtained
				}
				// Park in our place: one more attempt, which takes the lock if it is
				// ours by now.
				a.parkNow = true
				l, _, err := c.attempt(ctx, a, w)
				switch {
				case l != nil:
					acquired = true
				case err == nil:
					err = ErrNotObtained
				}
				return l, err
			case f := <-w.grant:
				if a.given != nil {
					// One of several locks: the attempt below takes the rest, or waits
					// for the next busy one, keeping this one.
					break
				}
				if c.replicas.N > 0 {
					// The lock was written by the releaser's call, which our WAIT
					// cannot follow: renew it, and wait after that write of ours.
					l, err := c.confirmHandOver(ctx, a, f, w)
					switch {
					case l != nil:
						acquired = true
						return l, nil
					case err != nil:
						return nil, err
					}
					break // the hand-over's lease ended: the attempt below tries again
				}
				// The release that handed us the lock ran after our last attempt was
				// sent, so the lease counts from no earlier than that.
				lease := a.handOverLease()
				if l := a.lock([]int64{f}, w.sent, lease); time.Until(l.validUntil()) > lease/2 {
					l.taken = time.Now() // its wait ended now, not when its attempt was sent
					acquired = true
					return l, nil
				}
				// Most of that lease may have passed: the attempt below renews it.
			case <-w.wake:
			case <-timer.C:
			}
		}
		attempts++
		l, pttl, err := c.attempt(ctx, a, w)
		var ue *unreachableError
		switch {
		case l != nil:
			acquired = true
			return l, nil
		case errors.As(err, &ue) && attempts > 1 && ctx.Err() == nil:
			// Redis answered before, and found the key busy; now it cannot be reached:
			// wait on, and try again. (A Redis that cannot be reached at the first
			// attempt is reported at once: it may be no passing outage.)
			lastErr = err
			backoff, pttl = growBackoff(backoff)
		case err != nil:
			return nil, err
		default:
			lastErr, backoff = nil, 0
			pttl = a.retryAfter(pttl)
		}
		if !subbed {
			// A hand-over published before the subscription is confirmed reaches
			// nobody, and the release passes us over: every waiter tries again on
			// confirmation.
			c.hub.ensure()
			subbed = true
		}
		if timer == nil {
			timer = time.NewTimer(pttl)
			defer timer.Stop()
		} else {
			timer.Reset(pttl)
		}
	}
}

// attempt makes one attempt of a, for waiter w (nil for none): it returns the lock, or
// nil and the remaining lease of the first lock another holder has (-1: none), or an
// error: ErrNotObtained joined with ctx's error when ctx ended it, a refusal such as a
// *LimitError, or a wrapped Redis error (an *unreachableError when it may pass). A
// single attempt that got an error releases whatever it may have taken first.
func (c *Client) attempt(ctx context.Context, a *acquisition, w *waiter) (*Lock, time.Duration, error) {
	if err := ctx.Err(); err != nil {
		return nil, 0, join(ErrNotObtained, err)
	}
	sent := time.Now()
	o, err := a.kind.attempt(ctx, a, w)
	c.start(a.starter, o.handed)
	if w != nil {
		w.queued = true // even after an error: the server may have queued it
		w.sent = sent
	}
	switch {
	case err != nil:
		// The server may have applied the attempt and lost its reply. A waiter's next
		// attempt finds its own token, and its leave gives back what it holds; a
		// single attempt gives back at once.
		if w == nil {
			c.abandon(ctx, a)
		}
		if ctx.Err() != nil {
			return nil, 0, join(ErrNotObtained, ctx.Err())
		}
		err = fmt.Errorf("mutex: lock %s: %w", a.what(), err)
		if store.Transient(err) {
			return nil, 0, &unreachableError{err}
		}
		return nil, 0, err
	case o.refused != nil:
		var lf *lineFullError
		if w != nil && errors.As(o.refused, &lf) {
			w.queued = false // its line refused it: it stands nowhere, and leaving costs no call
		}
		return nil, 0, o.refused
	case o.parked:
		w.queued = false // its entry is a parked one now: leaving takes nothing out
		c.contended(ctx, a)
		return nil, 0, &parkedError{left: o.pttl}
	case o.fences == nil:
		c.contended(ctx, a)
		return nil, o.pttl, nil
	case o.unconfirmed != nil:
		// The replicas did not confirm the grant: give it back, handed to the next
		// waiter (a waiter's leave does it, with its queue entry).
		if w == nil {
			c.abandon(ctx, a)
		}
		o.unconfirmed.Key = a.key
		return nil, 0, join(ErrNotObtained, o.unconfirmed)
	}
	return a.lock(o.fences, sent, a.ttl), 0, nil
}

// growBackoff is the pause after prev before Redis, which could not be reached, is
// tried again: next doubles from 10ms up to a second, and pause is next with jitter,
// between half of it and all of it, so that clients do not all come back at once.
func growBackoff(prev time.Duration) (next, pause time.Duration) {
	next = min(max(2*prev, 10*time.Millisecond), time.Second)
	return next, next/2 + rand.N(next/2+1)
}

// unreachableError is an attempt's error when Redis could not be reached or could not
// serve it for a while (store.Transient): a wait goes on past it.
type unreachableError struct{ err error }

func (e *unreachableError) Error() string { return e.err.Error() }
func (e *unreachableError) Unwrap() error { return e.err }

// contended reports OpContended the first time an attempt of a finds the lock busy.
func (c *Client) contended(ctx context.Context, a *acquisition) {
	if !a.contended {
		a.contended = true
		c.emit(ctx, Event{Op: OpContended, Key: a.key, Keys: a.given, Name: a.by.name, ID: a.by.id})
	}
}

// lock is the Lock this acquisition holds with fences f (in the order of a.locks),
// granted for lease by a command sent at sent or later.
func (a *acquisition) lock(f []int64, sent time.Time, lease time.Duration) *Lock {
	l := &Lock{c: a.c, kind: a.kind, key: a.key, given: a.given, keys: a.keys, locks: a.locks, id: a.id,
		fence: f[0], by: a.by, starter: a.starter, taken: sent, until: leaseEnd(sent, lease)}
	if a.order != nil {
		l.fences = make([]int64, len(a.order))
		for i, j := range a.order {
			l.fences[i] = f[j]
		}
		l.fence = l.fences[0]
	}
	return l
}

// handOverLease is the lease a release hands this acquisition's waiter.
func (a *acquisition) handOverLease() time.Duration {
	if a.renewed {
		return min(a.ttl, renewedHandOver)
	}
	return a.ttl
}

// retryAfter is how long a waiter that hears nothing sleeps: until the holder's lease
// runs out, plus jitter so that waiters of a crashed holder do not all arrive at once.
// A waiter that keeps locks taken before a busy one comes back within a third of
// its lease, and its attempt renews them.
func (a *acquisition) retryAfter(pttl time.Duration) time.Duration {
	if pttl < 0 || pttl > MaxTTL { // no expiry, or set by hand: look again later
		pttl = time.Second
	}
	d := pttl + rand.N(pttl/8+time.Millisecond)
	if a.kept > 0 {
		d = min(d, a.ttl/3)
	}
	return d
}

// giveBack releases a's hold of the locks in keys (each followed by its queue), if
// any, handing each to its next waiter, and takes entry (a waiter that gives up, or
// "") out of their queues. It tries for at most a second, and never past the lease,
// after which the locks are free anyway.
func (c *Client) giveBack(ctx context.Context, a *acquisition, keys []string, entry string) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), min(a.ttl, time.Second))
	defer cancel()
	_, hs, _ := a.kind.release(ctx, keys, a.id, entry, 0, "")
	c.start(a.starter, hs)
}

// abandon releases whatever an attempt that ended in an error may have taken: the
// server may have applied it and lost the reply.
func (c *Client) abandon(ctx context.Context, a *acquisition) { c.giveBack(ctx, a, a.keys, "") }
