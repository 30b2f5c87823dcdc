package mutex

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
	"github.com/asynqmutex/asynqmutex/internal/store"
)

// cutOffTimeout is how long the redis client of cutOff waits for an answer: a
// release sent into the proxy's blackhole fails after it.
const cutOffTimeout = time.Second

// cutOff is a Client on the shared server through a fault proxy, with its scripts
// loaded, whose redis client gives up on an answer after cutOffTimeout and does not
// retry, so that a release sent while the proxy is a blackhole fails soon; opts are
// the Client's. It also returns the proxied redis client, for hooks.
func cutOff(t *testing.T, opts ...Option) (*redistest.Proxy, *redis.Client, *Client) {
	t.Helper()
	p := redistest.NewProxy(t, sharedServer(t).Options().Addr)
	via := redis.NewClient(&redis.Options{Addr: p.Addr(), MaxRetries: -1, ReadTimeout: cutOffTimeout, WriteTimeout: cutOffTimeout})
	t.Cleanup(func() { via.Close() })
	c := New(via, opts...)
	ctx := context.Background()
	warm, err := c.TryLock(ctx, uniqueKey(t)+":warm", time.Minute)
	require.NoError(t, err)
	require.NoError(t, warm.Unlock(ctx))
	return p, via, c
}

// lockBefore starts a Lock of key by c, with opts, that waits no longer than until:
// it gets the key only if the key frees before then.
func lockBefore(c *Client, key string, until time.Time, opts ...LockOption) <-chan error {
	got := make(chan error, 1)
	go func() {
		ctx := context.Background()
		l, err := c.Lock(ctx, key, time.Minute, append(opts, MaxWait(time.Until(until)))...)
		if err == nil {
			err = l.Unlock(ctx)
		}
		got <- err
	}()
	return got
}

func TestFailedReleaseIsRetriedWhenRedisAnswers(t *testing.T) {
	// Redis cannot be reached as the holder releases: the release fails, and the
	// caller hears of it. When Redis answers again, the key must free at once, handed
	// to its waiter, not after the rest of its 30s lease: the waiter gives up when
	// that lease would have ended. TestFailedReleaseWithoutRetryHoldsKey is the
	// control: the same waiter, with no retry, does give up.
	const lease = 30 * time.Second
	type setup struct {
		holder, waiter *Client
		b              backend
		p              *redistest.Proxy
		key            string
	}
	// Each release blackholes the proxy before the holder's release, and returns the
	// holder's lock and the release's error; the waiter is queued by then.
	cases := map[string]func(t *testing.T, s setup) (*Lock, <-chan error, error){
		"Unlock": func(t *testing.T, s setup) (*Lock, <-chan error, error) {
			l, err := s.holder.TryLock(context.Background(), s.key, lease)
			require.NoError(t, err)
			got := lockBefore(s.waiter, s.key, l.validUntil())
			waitForWaiters(t, s.b, s.waiter, s.key, 1)
			s.p.Blackhole(true)
			return l, got, l.Unlock(context.Background())
		},
		"WithLock": func(t *testing.T, s setup) (*Lock, <-chan error, error) {
			var (
				l   *Lock
				got <-chan error
			)
			err := s.holder.WithLock(context.Background(), s.key, lease, func(ctx context.Context) error {
				l, _ = FromContext(ctx)
				got = lockBefore(s.waiter, s.key, l.validUntil())
				waitForWaiters(t, s.b, s.waiter, s.key, 1)
				s.p.Blackhole(true)
				return nil
			})
			return l, got, err
		},
		"WithLockKeys": func(t *testing.T, s setup) (*Lock, <-chan error, error) {
			var (
				l   *Lock
				got <-chan error
			)
			err := s.holder.WithLockKeys(context.Background(), []string{s.key + ":other", s.key}, lease, func(ctx context.Context) error {
				l, _ = FromContext(ctx)
				got = lockBefore(s.waiter, s.key, l.validUntil())
				waitForWaiters(t, s.b, s.waiter, s.key, 1)
				s.p.Blackhole(true)
				return nil
			})
			return l, got, err
		},
		"Limit": func(t *testing.T, s setup) (*Lock, <-chan error, error) {
			ctx := context.Background()
			l, err := s.holder.TryLock(ctx, s.key, lease, Limit(2))
			require.NoError(t, err)
			other, err := s.waiter.TryLock(ctx, s.key, lease, Limit(2))
			require.NoError(t, err)
			t.Cleanup(func() { _ = other.Unlock(ctx) })
			got := lockBefore(s.waiter, s.key, l.validUntil(), Limit(2))
			waitForWaiters(t, s.b, s.waiter, s.key, 1)
			s.p.Blackhole(true)
			return l, got, l.Unlock(ctx)
		},
	}
	for name, release := range cases {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			events := &rgRecorder{}
			p, _, holder := cutOff(t, Observe(events.observe))
			b := realBackend(t)
			s := setup{holder: holder, waiter: New(b.rdb), b: b, p: p, key: uniqueKey(t)}
			released := events.count(OpReleased) // cutOff's own lock
			l, got, err := release(t, s)
			require.Error(t, err, "the release sent into the blackhole fails")
			assert.True(t, store.Transient(err), "a release that got no answer: %v", err)
			assert.NotErrorIs(t, err, ErrNotHeld)
			p.Blackhole(false)

			require.NoError(t, <-got, "the key must free, handed to the waiter, before the lease would have ended")
			for i, k := range l.Keys() {
				in, err := s.waiter.Inspect(context.Background(), k)
				require.NoError(t, err)
				held := in.Held && in.Fence == l.Fences()[i]
				for _, slot := range in.Slots {
					held = held || slot.Fence == l.Fences()[i]
				}
				assert.False(t, held, "%s is still the holder's", k)
			}
			rgEventually(t, time.Until(l.validUntil()), "the retry reports OpReleased", func() bool { return events.count(OpReleased) == released+1 })
			assert.Equal(t, 1, events.count(OpReleaseFailed))
			assert.Zero(t, events.count(OpLeaseLost))
		})
	}
}

func TestFailedReleaseWithoutRetryHoldsKey(t *testing.T) {
	// The control of TestFailedReleaseIsRetriedWhenRedisAnswers: the same release,
	// sent once without the retry, leaves the key held for the rest of its lease
	// after Redis answers again, and the waiter gives up when the lease would have
	// ended. A short lease keeps the test short; nothing but the lease frees the key.
	const lease = 5 * time.Second
	p, _, holder := cutOff(t)
	b := realBackend(t)
	waiter := New(b.rdb)
	ctx := context.Background()
	key := uniqueKey(t)
	l, err := holder.TryLock(ctx, key, lease)
	require.NoError(t, err)
	got := lockBefore(waiter, key, l.validUntil())
	waitForWaiters(t, b, waiter, key, 1)
	p.Blackhole(true)
	_, _, err = l.kind.release(ctx, l.keys, l.id, "", l.fence, "")
	require.True(t, store.Transient(err), "the release sent into the blackhole fails: %v", err)
	p.Blackhole(false)
	require.NoError(t, holder.Redis().Ping(ctx).Err(), "Redis answers again")
	assert.ErrorIs(t, <-got, ErrNotObtained, "without the retry the key stays held for the whole lease")
}

func TestFailedReleaseRestartingRedisIsRetried(t *testing.T) {
	// What an operator saw: Redis restarts (keeping its data, here in its append-only
	// file) while a lock is held; the release, sent while it is down, fails. The key
	// must free as soon as Redis is back, not after the rest of its lease.
	const lease = 30 * time.Second
	s := redistest.Start(t, "--appendonly", "yes")
	rdb := s.Client(t)
	c, waiter := New(rdb), New(s.Client(t))
	ctx := context.Background()
	key := uniqueKey(t)
	l, err := c.TryLock(ctx, key, lease)
	require.NoError(t, err)

	s.Stop(t)
	err = l.Unlock(ctx)
	require.Error(t, err, "the release fails while Redis is down")
	require.True(t, store.Transient(err), "%v", err)
	s.Restart(t)

	// The restart kept the lock (held, or released since by the retry): without
	// persistence it would have lost it, and the test would show nothing.
	v, err := rdb.Get(ctx, c.redisKey(key)).Result()
	require.NoError(t, err, "control: the restart kept the key")
	require.Contains(t, v, l.id, "control: the lock, or its tombstone, is the holder's")
	require.NoError(t, <-lockBefore(waiter, key, l.validUntil()), "the key must free before the lease would have ended")
}

func TestReleaseRetryLeavesAnotherTokensLock(t *testing.T) {
	// A release retried after Redis answers again must not release a lock that
	// another token took meanwhile: here Redis ended the lease early (a clock jump,
	// or a restore, as if it had run out) and another holder took the key.
	for _, limit := range []int{1, 2} {
		t.Run(limitText(limit), func(t *testing.T) {
			t.Parallel()
			var (
				mu      sync.Mutex
				replies []int64 // of the releases Redis answered through the proxy
			)
			p, via, holder := cutOff(t)
			via.AddHook(&rgHook{process: func(ctx context.Context, cmd redis.Cmder, next redis.ProcessHook) error {
				err := next(ctx, cmd)
				if (rgRuns(cmd, plainReleaseScript) || rgRuns(cmd, slotsReleaseScript)) && err == nil {
					n, _ := cmd.(*redis.Cmd).Int64()
					if vals, err := cmd.(*redis.Cmd).Slice(); err == nil && len(vals) > 0 { // plain: {released, tickets...}
						n, _ = vals[0].(int64)
					}
					mu.Lock()
					replies = append(replies, n)
					mu.Unlock()
				}
				return err
			}})
			b := realBackend(t)
			other := New(b.rdb)
			ctx := context.Background()
			key := uniqueKey(t)
			l, err := holder.TryLock(ctx, key, 30*time.Second, Limit(limit))
			require.NoError(t, err)

			p.Blackhole(true)
			require.True(t, store.Transient(l.Unlock(ctx)), "the release fails")
			require.NoError(t, b.admin.Del(ctx, holder.redisKey(key)).Err())
			taken, err := other.TryLock(ctx, key, time.Minute, Limit(limit))
			require.NoError(t, err)
			p.Blackhole(false)

			rgEventually(t, time.Until(l.validUntil()), "the retried release is answered", func() bool {
				mu.Lock()
				defer mu.Unlock()
				return len(replies) > 0
			})
			mu.Lock()
			assert.Equal(t, []int64{int64(notOurs)}, replies, "the retry finds another token and changes nothing")
			mu.Unlock()
			_, err = taken.TTL(ctx)
			require.NoError(t, err, "the other holder keeps the key")

			// Control: a release blind to tokens would have taken it; the check sees that.
			require.NoError(t, b.admin.Del(ctx, holder.redisKey(key)).Err())
			_, err = taken.TTL(ctx)
			assert.True(t, errors.Is(err, ErrNotHeld), "control: a lock taken away is seen: %v", err)
		})
	}
}

func TestReleaseRetryEndsWithTheLease(t *testing.T) {
	// Redis stays out of reach: the retried release must send nothing once the lease
	// would have ended on our clock, and its goroutine must end.
	const lease = 2 * time.Second
	var (
		mu   sync.Mutex
		sent []time.Time // of every release sent through the proxy
	)
	p, via, holder := cutOff(t)
	via.AddHook(&rgHook{process: func(ctx context.Context, cmd redis.Cmder, next redis.ProcessHook) error {
		if rgRuns(cmd, plainReleaseScript) {
			mu.Lock()
			sent = append(sent, time.Now())
			mu.Unlock()
		}
		return next(ctx, cmd)
	}})
	ctx := context.Background()
	l, err := holder.TryLock(ctx, uniqueKey(t), lease)
	require.NoError(t, err)
	p.Blackhole(true)
	require.True(t, store.Transient(l.Unlock(ctx)), "the release fails")
	// An attempt on its way at the lease's end gives up after cutOffTimeout.
	rgEventually(t, time.Until(l.validUntil())+10*cutOffTimeout, "the retry ends", func() bool {
		l.mu.Lock()
		defer l.mu.Unlock()
		return !l.retrying
	})
	mu.Lock()
	defer mu.Unlock()
	assert.Greater(t, len(sent), 1, "the release was tried again")
	for i, at := range sent {
		assert.True(t, at.Before(l.validUntil()), "release %d sent %v after the lease ended", i, at.Sub(l.validUntil()))
	}
}
