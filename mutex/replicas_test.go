package mutex

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
)

// replicated is a master with one replica, started for the test: a Client that waits
// for the replica (WaitReplicas(1, 200ms)), one that does not, and an admin client of
// the master. stopReplica stops the replica: every WAIT then times out.
type replicated struct {
	master, replica *redistest.Server
	waits, plain    *Client
	admin           *redis.Client
	backend         backend
}

const replicaTimeout = 200 * time.Millisecond

func startReplicated(t *testing.T) *replicated {
	t.Helper()
	master := redistest.Start(t)
	r := &replicated{master: master, replica: redistest.StartReplica(t, master), admin: master.Client(t)}
	r.waits = New(master.Client(t), WaitReplicas(1, replicaTimeout))
	r.plain = New(master.Client(t))
	t.Cleanup(func() { _ = r.waits.Close(); _ = r.plain.Close() })
	r.backend = backend{rdb: r.admin, admin: r.admin, real: true}
	// Load the library, so that the tests' first calls are not sent twice.
	l, err := r.plain.TryLock(context.Background(), uniqueKey(t), time.Second)
	require.NoError(t, err)
	require.NoError(t, l.Unlock(context.Background()))
	return r
}

// waits is how many WAITs the master has run.
func (r *replicated) waitCalls(t *testing.T) int64 {
	t.Helper()
	return commandCalls(t, r.admin, "wait")
}

func commandCalls(t *testing.T, c *redis.Client, name string) int64 {
	t.Helper()
	info, err := c.Info(context.Background(), "commandstats").Result()
	require.NoError(t, err)
	_, rest, ok := strings.Cut(info, "cmdstat_"+name+":calls=")
	if !ok {
		return 0
	}
	n, err := strconv.ParseInt(rest[:strings.IndexByte(rest, ',')], 10, 64)
	require.NoError(t, err)
	return n
}

// requireUnconfirmed checks that err is the error of a grant the replica did not
// confirm.
func requireUnconfirmed(t *testing.T, err error) {
	t.Helper()
	require.ErrorIs(t, err, ErrNotObtained)
	var re *ReplicasError
	require.ErrorAs(t, err, &re, "%v", err)
	assert.Equal(t, 1, re.Want)
	assert.Equal(t, 0, re.Got)
	assert.Contains(t, err.Error(), "0 of 1 replicas acknowledged")
}

func TestWaitReplicasDirect(t *testing.T) {
	t.Parallel()
	r := startReplicated(t)
	ctx := context.Background()
	key := uniqueKey(t)
	rc := r.replica.Client(t)

	before := r.waitCalls(t)
	l, err := r.waits.TryLock(ctx, key, time.Second)
	require.NoError(t, err)
	assert.Equal(t, int64(1), r.waitCalls(t)-before, "one WAIT, after the lock's script")
	v, err := rc.Get(ctx, r.waits.redisKey(key)).Result()
	require.NoError(t, err, "the replica has the lock when TryLock returns")
	assert.Contains(t, v, l.id)
	require.NoError(t, l.Unlock(ctx))

	// Control: without WaitReplicas, no WAIT.
	before = r.waitCalls(t)
	l, err = r.plain.TryLock(ctx, key, time.Second)
	require.NoError(t, err)
	require.NoError(t, l.Unlock(ctx))
	assert.Zero(t, r.waitCalls(t)-before)

	r.replica.Stop(t)
	start := time.Now()
	l, err = r.waits.TryLock(ctx, key, time.Second)
	assert.Nil(t, l)
	requireUnconfirmed(t, err)
	assert.GreaterOrEqual(t, time.Since(start), replicaTimeout, "it waited for the replica")
	// The grant was given back: another client takes the key at once.
	l, err = r.plain.TryLock(ctx, key, time.Second)
	require.NoError(t, err, "the key is free")
	require.NoError(t, l.Unlock(ctx))

	// Lock ends its wait with the same error rather than waiting on.
	l, err = r.waits.Lock(ctx, key, time.Second, MaxWait(5*time.Second))
	assert.Nil(t, l)
	requireUnconfirmed(t, err)
}

func TestWaitReplicasHandOver(t *testing.T) {
	t.Parallel()
	for _, renewed := range []bool{false, true} {
		t.Run(fmt.Sprintf("renewed=%v", renewed), func(t *testing.T) {
			r := startReplicated(t)
			ctx := context.Background()
			key := uniqueKey(t)
			ttl := 2 * time.Second
			holder, err := r.plain.TryLock(ctx, key, ttl)
			require.NoError(t, err)

			type result struct {
				l   *Lock
				err error
				ttl time.Duration // the key's lease when fn began (WithLock)
			}
			take := func(c *Client) chan result {
				done := make(chan result, 1)
				go func() {
					if !renewed {
						l, err := c.Lock(ctx, key, ttl, MaxWait(10*time.Second))
						done <- result{l: l, err: err}
						return
					}
					var res result
					res.err = c.WithLock(ctx, key, ttl, func(ctx context.Context) error {
						res.l, _ = FromContext(ctx)
						res.ttl, _ = r.admin.PTTL(ctx, c.redisKey(key)).Result()
						return nil
					}, MaxWait(10*time.Second))
					done <- res
				}()
				return done
			}

			// A hand-over confirmed: the waiter renews and waits after its own write.
			got := take(r.waits)
			waitForWaiters(t, r.backend, r.waits, key, 1)
			before := r.waitCalls(t)
			require.NoError(t, holder.Unlock(ctx))
			res := <-got
			require.NoError(t, res.err)
			require.NotNil(t, res.l)
			assert.Equal(t, int64(1), r.waitCalls(t)-before, "one WAIT, after the waiter's renewal")
			if renewed {
				assert.Greater(t, res.ttl, renewedHandOver, "the hand-over's 250ms lease was renewed to ttl")
			} else {
				require.NoError(t, res.l.Unlock(ctx))
			}

			// The replica stops while the waiter waits: the hand-over is not
			// confirmed, and the waiter passes the lock on to the next one.
			holder, err = r.plain.TryLock(ctx, key, ttl)
			require.NoError(t, err)
			got = take(r.waits)
			waitForWaiters(t, r.backend, r.waits, key, 1)
			next := make(chan result, 1)
			go func() {
				l, err := r.plain.Lock(ctx, key, ttl, MaxWait(10*time.Second))
				next <- result{l: l, err: err}
			}()
			waitForWaiters(t, r.backend, r.plain, key, 2)
			r.replica.Stop(t)
			require.NoError(t, holder.Unlock(ctx))
			res = <-got
			assert.Nil(t, res.l)
			requireUnconfirmed(t, res.err)
			n := <-next
			require.NoError(t, n.err, "the next waiter was handed the lock")
			require.NoError(t, n.l.Unlock(ctx))
		})
	}
}

func TestWaitReplicasLimit(t *testing.T) {
	t.Parallel()
	r := startReplicated(t)
	ctx := context.Background()
	key := uniqueKey(t)

	before := r.waitCalls(t)
	l, err := r.waits.TryLock(ctx, key, time.Second, Limit(2))
	require.NoError(t, err)
	assert.Equal(t, int64(1), r.waitCalls(t)-before, "one WAIT, after the slot's script")
	require.NoError(t, l.Unlock(ctx))

	r.replica.Stop(t)
	l, err = r.waits.TryLock(ctx, key, time.Second, Limit(2))
	assert.Nil(t, l)
	requireUnconfirmed(t, err)
	info, err := r.plain.Inspect(ctx, key)
	require.NoError(t, err)
	assert.Empty(t, info.Slots, "the slot was given back")
	// Both slots are free.
	for range 2 {
		l, err := r.plain.TryLock(ctx, key, time.Second, Limit(2))
		require.NoError(t, err)
		defer l.Unlock(ctx)
	}
}

func TestWaitReplicasKeys(t *testing.T) {
	t.Parallel()
	r := startReplicated(t)
	ctx := context.Background()
	keys := []string{uniqueKey(t), uniqueKey(t), uniqueKey(t)}

	before := r.waitCalls(t)
	l, err := r.waits.TryLockKeys(ctx, keys, time.Second)
	require.NoError(t, err)
	assert.Equal(t, int64(1), r.waitCalls(t)-before, "one WAIT, after the one script call on a single Redis")
	require.NoError(t, l.Unlock(ctx))

	r.replica.Stop(t)
	l, err = r.waits.TryLockKeys(ctx, keys, time.Second)
	assert.Nil(t, l)
	requireUnconfirmed(t, err)
	_, ok := BusyKey(err)
	assert.False(t, ok, "no key was busy")
	l, err = r.plain.TryLockKeys(ctx, keys, time.Second)
	require.NoError(t, err, "every key was given back")
	require.NoError(t, l.Unlock(ctx))
}

// On Cluster every key of a set is a call of its own, on its own master, each followed
// by its WAIT. The cluster has no replicas: no WAIT is ever confirmed.
func TestWaitReplicasKeysOnCluster(t *testing.T) {
	t.Parallel()
	addrs := redistest.StartCluster(t, 3)
	ctx := context.Background()
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs})
	t.Cleanup(func() { _ = rdb.Close() })
	c := New(rdb, WaitReplicas(1, 20*time.Millisecond))
	plain := New(rdb)
	keys := []string{"a" + uniqueKey(t), "b" + uniqueKey(t), "c" + uniqueKey(t), "d" + uniqueKey(t)}
	on := map[string]int64{}
	masters := map[string]*redis.Client{}
	for _, k := range keys {
		node, err := rdb.MasterForKey(ctx, c.redisKey(k))
		require.NoError(t, err)
		a := node.Options().Addr
		on[a]++
		if masters[a] == nil {
			masters[a] = redis.NewClient(&redis.Options{Addr: a})
			t.Cleanup(func() { _ = masters[a].Close() })
		}
	}
	// Load the library first, so that no call is sent twice.
	l, err := plain.TryLockKeys(ctx, keys, time.Second)
	require.NoError(t, err)
	require.NoError(t, l.Unlock(ctx))
	before := map[string]int64{}
	for a, m := range masters {
		before[a] = commandCalls(t, m, "wait")
	}
	l, err = c.TryLockKeys(ctx, keys, time.Second)
	assert.Nil(t, l)
	requireUnconfirmed(t, err)
	for a, m := range masters {
		assert.Equal(t, on[a], commandCalls(t, m, "wait")-before[a], "WAITs on %s, one per key there", a)
	}
	l, err = plain.TryLockKeys(ctx, keys, time.Second)
	require.NoError(t, err, "every key was given back")
	require.NoError(t, l.Unlock(ctx))
}

func TestWaitReplicasRenewal(t *testing.T) {
	t.Parallel()
	r := startReplicated(t)
	ctx := context.Background()
	key := uniqueKey(t)
	ttl := 600 * time.Millisecond

	// Renewals are waited for.
	before := r.waitCalls(t)
	err := r.waits.WithLock(ctx, key, ttl, func(ctx context.Context) error {
		time.Sleep(ttl) // two or three renewals
		return ctx.Err()
	})
	require.NoError(t, err)
	assert.GreaterOrEqual(t, r.waitCalls(t)-before, int64(3), "a WAIT after the grant and after every renewal")

	l, err := r.waits.TryLock(ctx, key, 10*time.Second)
	require.NoError(t, err)
	// The replica stops while fn runs: no renewal is confirmed, and fn is cancelled
	// when the lease ends on our clock, though the master keeps the key.
	var cancelledAfter time.Duration
	err = r.waits.WithLock(ctx, key+":w", ttl, func(ctx context.Context) error {
		r.replica.Stop(t)
		// A renewal sent before the replica was gone may have been confirmed: the
		// lease ends no later than ttl from now.
		start := time.Now()
		select {
		case <-ctx.Done():
			cancelledAfter = time.Since(start)
		case <-time.After(5 * ttl):
		}
		return nil
	})
	require.ErrorIs(t, err, ErrNotHeld)
	assert.Positive(t, cancelledAfter, "fn was cancelled")
	assert.Less(t, cancelledAfter, 2*ttl, "fn was cancelled by its lease's end (within ttl, and time for a loaded machine)")
	// Extend reports the unconfirmed write, and the lease on our clock stays.
	until := l.validUntil()
	err = l.Extend(ctx, 5*time.Second)
	var re *ReplicasError
	require.ErrorAs(t, err, &re)
	assert.NotErrorIs(t, err, ErrNotHeld)
	assert.Equal(t, until, l.validUntil())
	_ = l.Unlock(ctx)
}

func TestWaitReplicasBadArguments(t *testing.T) {
	t.Parallel()
	assert.PanicsWithValue(t, "mutex.WaitReplicas: 0 replicas; want at least 1", func() { WaitReplicas(0, time.Second) })
	assert.Panics(t, func() { WaitReplicas(1, 0) })
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", ReadTimeout: time.Second})
	t.Cleanup(func() { _ = rdb.Close() })
	assert.Panics(t, func() { New(rdb, WaitReplicas(1, time.Second)) }, "timeout not below ReadTimeout")
	assert.NotPanics(t, func() { New(rdb, WaitReplicas(1, 500*time.Millisecond)) })
	ring := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": "127.0.0.1:1"}})
	t.Cleanup(func() { _ = ring.Close() })
	assert.Panics(t, func() { New(ring, WaitReplicas(1, 500*time.Millisecond)) })
	assert.True(t, errors.Is(join(ErrNotObtained, &ReplicasError{}), ErrNotObtained))
}
