package mutex

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex/internal/store"
)

// WaitReplicas makes the Client wait, after every write that grants or keeps a lock,
// until n replicas of the master have acknowledged it, for at most timeout (Redis's
// WAIT, sent after the script on the same connection, in one round trip). The default
// is no wait.
//
// It covers every way a lock is granted: an acquisition that takes a free key (a
// lock, a slot of Limit(n), every key of a set, one call per key on Cluster, each
// waited for), a lock handed over by another holder's release (the waiter first
// renews the lease it was handed, to ttl, and waits after that write of its own), and
// every renewal (WithLock's, and Extend).
//
// When fewer than n replicas confirm within timeout, an acquisition gives the lock
// back at once, handing it to the next waiter as a release does, and returns
// ErrNotObtained joined with a *ReplicasError; it does not wait on. A renewal so
// unconfirmed counts as a failed renewal: WithLock tries again within the lease, and
// when none is confirmed before the lease ends on this process's clock it cancels fn
// as for a lease it could not renew; Extend returns the *ReplicasError (wrapped) and
// leaves the lease on our clock as it was.
//
// What it narrows: a failover to a replica that had not received the grant or the
// renewal (the promoted replica lacks the lock, or holds it with a shorter lease, and
// grants it again while the holder works on). What it cannot prevent: WAIT counts any replica, also one that
// is not promoted, or one that still follows a master already deposed, so a deposed
// master that a client still writes to can grant and be confirmed; replication stays
// asynchronous between the write and the WAIT, so a failover in that window may still
// lose the grant that was then reported unconfirmed (it is given back on the master
// that answered, which may be the deposed one); and n above the replicas that are up
// makes every acquisition fail until they are back. A Redis lock stays an efficiency
// lock: check the fence at the resource.
//
// Cost: one WAIT per script call that grants or renews, in the same round trip, which
// returns when the replica has acknowledged the write: a TryLock and Unlock took
// about 60µs more (186µs without, 246µs with, on a busy two-core machine with a
// loopback replica; BenchmarkWaitReplicas). An attempt that finds the key busy waits
// too, as its script may have queued the waiter; while the replicas are down, every
// attempt takes up to timeout.
//
// A user restricted by an ACL needs the WAIT command (+wait) beside the rules
// docs/operating.md lists. timeout must be below the redis client's ReadTimeout (3s
// by default), which bounds the round trip. WaitReplicas panics if n < 1 or timeout <= 0; New panics when the
// client is a Ring, whose WAIT cannot be sent to the server of the key, or when
// timeout is not below the client's ReadTimeout.
func WaitReplicas(n int, timeout time.Duration) Option {
	if n < 1 {
		panic(fmt.Sprintf("mutex.WaitReplicas: %d replicas; want at least 1", n))
	}
	if timeout <= 0 {
		panic(fmt.Sprintf("mutex.WaitReplicas: timeout %v; want a positive one (WAIT 0 would wait forever)", timeout))
	}
	return optionFunc(func(c *Client) { c.replicas = store.Replicas{N: n, Timeout: timeout} })
}

// checkReplicas panics, for New, if c's wait for replicas cannot work on its client.
func (c *Client) checkReplicas() {
	if c.replicas.N == 0 {
		return
	}
	if !c.run.SupportsWait() {
		panic("mutex.New: WaitReplicas needs a single-node, Sentinel or Cluster client; a Ring cannot send WAIT to the server of a key")
	}
	var read time.Duration
	switch rc := c.rdb.(type) {
	case *redis.Client:
		read = rc.Options().ReadTimeout
	case *redis.ClusterClient:
		read = rc.Options().ReadTimeout
	}
	if read > 0 && c.replicas.Timeout >= read {
		panic(fmt.Sprintf("mutex.New: WaitReplicas timeout %v is not below the redis client's ReadTimeout %v", c.replicas.Timeout, read))
	}
}

// ReplicasError says that fewer replicas than WaitReplicas asked for acknowledged a
// write that granted or renewed a lock, within its timeout. An acquisition returns it
// joined with ErrNotObtained, after giving the lock back; a renewal or Extend returns
// it wrapped, and the lease on our clock is not lengthened.
type ReplicasError struct {
	Key  string // the caller's key (the first, of several)
	Want int    // the replicas asked for
	Got  int    // the replicas that acknowledged in time
	Err  error  // why the WAIT got no answer (a Redis error), or nil
}

// Error names the key and the counts.
func (e *ReplicasError) Error() string {
	s := fmt.Sprintf("mutex: lock %s: %d of %d replicas acknowledged the write in time", show(e.Key), e.Got, e.Want)
	if e.Err != nil {
		s += ": " + oneLine(e.Err)
	}
	return s
}

// Unwrap returns the WAIT's own error, if any.
func (e *ReplicasError) Unwrap() error { return e.Err }

// call runs s as the Runner does, followed by the wait WaitReplicas asks for; the
// *ReplicasError is non-nil when the wait was asked and not confirmed (its Key is
// the caller's to set).
func (c *Client) call(ctx context.Context, s *store.Script, keys []string, args ...any) (*redis.Cmd, *ReplicasError) {
	cmd, w := c.run.RunWait(ctx, s, c.replicas, keys, args...)
	return cmd, c.unconfirmed(w)
}

// callEach is store.Runner.Each with the wait of WaitReplicas after every call; it
// returns the first call's *ReplicasError, as call does.
func (c *Client) callEach(ctx context.Context, s *store.Script, keys []string, per int, args []any, fn func(keys []string, cmd *redis.Cmd) bool) *ReplicasError {
	var first *ReplicasError
	c.run.EachWait(ctx, s, c.replicas, keys, per, args, func(b []string, cmd *redis.Cmd, w store.Waited) bool {
		if e := c.unconfirmed(w); e != nil && first == nil {
			first = e
		}
		return fn(b, cmd)
	})
	return first
}

func (c *Client) unconfirmed(w store.Waited) *ReplicasError {
	if c.replicas.N == 0 || w.Confirmed(c.replicas) {
		return nil
	}
	return &ReplicasError{Want: c.replicas.N, Got: w.Acked, Err: w.Err}
}

// confirmHandOver takes a lock handed to waiter w with fence f when WaitReplicas asks
// for replicas: it renews the lease to a.ttl, waiting for the replicas after that
// write. It returns the lock; or ErrNotObtained joined with a *ReplicasError when the
// replicas did not confirm (the waiter's leave gives the lock back); or nil, nil when
// the lock is no longer ours or Redis did not answer, for an attempt to find out.
func (c *Client) confirmHandOver(ctx context.Context, a *acquisition, f int64, w *waiter) (*Lock, error) {
	l := a.lock([]int64{f}, w.sent, a.handOverLease())
	err := l.setLease(ctx, a.ttl, false)
	var re *ReplicasError
	switch {
	case err == nil:
		l.taken = time.Now()
		return l, nil
	case errors.As(err, &re):
		return nil, join(ErrNotObtained, re)
	}
	return nil, nil
}
