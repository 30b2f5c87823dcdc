package mutex

import (
	"context"
	"time"
)

// kind is a kind of lock: how its steps run in Redis. Each has a file of its own and
// scripts of its own (lua/<kind>_*.lua): plain (plain.go) takes one key, or a set of
// keys as one lock; slots (slots.go) lets up to n holders share a key (Limit). The
// rest of the package (waiting, hand-over, renewal, events, inspection) is the same
// for every kind. A Client has one value of each; they are safe for concurrent use.
type kind interface {
	// queue is the Redis key of the waiters of the lock at Redis key rkey.
	queue(rkey string) string

	// attempt makes one attempt to take every lock of a. When one is busy, it queues
	// w behind it, atomically with the attempt, unless w is nil (TryLock): then it
	// takes nothing. An error is Redis's: the attempt may have been applied.
	attempt(ctx context.Context, a *acquisition, w *waiter) (outcome, error)

	// release gives up what identity id holds of the locks in keys (each followed by
	// its queue), handing each to its next waiter. A non-empty entry (a waiter that
	// gives up) is first taken out of the queues, and a lock handed to it is passed
	// on. fence is the fence of what is released, or 0 when not known. A non-empty
	// ticket's parked entries are taken out of the queues first.
	// hs are the parked tasks the hand-overs ask to start (park.go).
	release(ctx context.Context, keys []string, id, entry string, fence int64, ticket string) (r released, hs []handed, err error)

	// extend replaces the lease of l with ttl; held is false when l is not ours. With
	// WaitReplicas, a write fewer replicas confirmed is a *ReplicasError.
	extend(ctx context.Context, l *Lock, ttl time.Duration) (held bool, err error)

	// pttl is the lease left of l (the shortest, of several keys; < 0: no expiry);
	// held is false when l is not ours.
	pttl(ctx context.Context, l *Lock) (d time.Duration, held bool, err error)
}

// outcome is what an attempt came to, when Redis answered.
type outcome struct {
	// fences, when every lock of the acquisition is ours: the fence of each, in the
	// order of its locks.
	fences []int64
	// pttl, when a lock is busy: the lease left of the holder that blocks it (< 0:
	// no expiry).
	pttl time.Duration
	// refused is a final answer other than busy (a *LimitError): the acquisition
	// ends with it.
	refused error
	// unconfirmed, with WaitReplicas: fewer replicas than asked acknowledged the
	// attempt's writes (of any of its calls) in time.
	unconfirmed *ReplicasError
	// parked, with Park: the lock was busy and the acquisition parked (park.go).
	parked bool
	// handed: the parked tasks the attempt's hand-overs ask to start.
	handed []handed
}

// released is what a release did, as the release scripts answer.
type released int64

const (
	notOurs    released = 0 // the key is gone or holds another token: nothing changed
	releasedOK released = 1 // released, now or by an earlier sending of the same call
	forced     released = 2 // ForceRelease took the lock from us: nothing changed
)
