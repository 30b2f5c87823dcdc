package mutex

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
)

// backend is a Redis the contract tests run against. rdb is what the library uses;
// admin is a client with every permission, for the tests' own reads and writes.
// expire makes a key's lease run out now: FastForward on miniredis, which freezes
// TTLs otherwise; on a real server, where time passes, deleting the key has the same
// effect on every script.
type backend struct {
	rdb, admin *redis.Client
	expire     func(t *testing.T, rkey string)
	real       bool
}

// each runs f against miniredis, a real redis-server, the same server as a user whose
// ACL allows only what the library needs (aclRules), and the same server over TLS.
func each(t *testing.T, f func(t *testing.T, b backend)) {
	t.Run("miniredis", func(t *testing.T) {
		t.Parallel()
		m := miniredis.RunT(t)
		rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
		t.Cleanup(func() { rdb.Close() })
		f(t, backend{rdb: rdb, admin: rdb, expire: func(t *testing.T, rkey string) {
			d := m.TTL(rkey)
			require.Positive(t, d, "key %s has no TTL", rkey)
			m.FastForward(d)
		}})
	})
	real := func(name string, client func(t *testing.T) *redis.Client) {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			admin := sharedServer(t)
			rdb := client(t)
			f(t, backend{rdb: rdb, admin: admin, real: true, expire: func(t *testing.T, rkey string) {
				require.NoError(t, admin.Del(context.Background(), rkey).Err())
			}})
		})
	}
	real("redis-server", sharedServer)
	real("redis-server-acl", aclClient)
	real("redis-server-tls", tlsClient)
}

var (
	serverOnce sync.Once
	server     *redistest.Server
	serverErr  error
	tlsPort    int
	tlsCA      *x509.CertPool
)

// sharedServer is one redis-server for the package's contract tests (they use unique
// keys, so they can share it), stopped when the tests end, and a client of it with
// every permission. It also listens for TLS and has the restricted ACL user. It skips
// or fails the test like redistest.Start when no redis-server is installed.
func sharedServer(t *testing.T) *redis.Client {
	t.Helper()
	serverOnce.Do(func() { server, serverErr = startSharedServer() })
	if serverErr != nil {
		if errors.Is(serverErr, redistest.ErrNoServer) {
			redistest.Start(t) // reports the missing server as Start does: skip, or fail under CI
		}
		t.Fatalf("redis-server: %v", serverErr)
	}
	rdb := redis.NewClient(&redis.Options{Addr: server.Addr()})
	t.Cleanup(func() { rdb.Close() })
	return rdb
}

// uniqueKey gives every test its own lock key so tests can run in parallel, and
// again with -count, on the one shared server.
func uniqueKey(t *testing.T) string {
	return strings.ReplaceAll(t.Name(), "/", ":") + ":" + newToken()[:8]
}

func TestTryLockExclusive(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		ctx := context.Background()
		key := uniqueKey(t)
		const contenders = 8
		var (
			wg      sync.WaitGroup
			winners atomic.Int32
			others  atomic.Int32
			start   = make(chan struct{})
		)
		for range contenders {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				l, err := c.TryLock(ctx, key, time.Minute)
				switch {
				case err == nil:
					winners.Add(1)
					_ = l // held until the test ends
				case errors.Is(err, ErrNotObtained):
					others.Add(1)
				default:
					t.Errorf("TryLock = %v, want nil or ErrNotObtained", err)
				}
			}()
		}
		close(start)
		wg.Wait()
		assert.Equal(t, int32(1), winners.Load(), "winners")
		assert.Equal(t, int32(contenders-1), others.Load(), "ErrNotObtained")
	})
}

func TestStaleHolderChangesNothing(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		ctx := context.Background()
		key := uniqueKey(t)

		stale, err := c.TryLock(ctx, key, time.Minute)
		require.NoError(t, err)
		b.expire(t, c.redisKey(key))
		fresh, err := c.TryLock(ctx, key, time.Minute)
		require.NoError(t, err)
		before, err := fresh.TTL(ctx)
		require.NoError(t, err)

		assert.ErrorIs(t, stale.Extend(ctx, time.Hour), ErrNotHeld, "stale Extend")
		assert.ErrorIs(t, stale.Unlock(ctx), ErrNotHeld, "stale Unlock")
		_, err = stale.TTL(ctx)
		assert.ErrorIs(t, err, ErrNotHeld, "stale TTL")

		after, err := fresh.TTL(ctx)
		require.NoError(t, err, "the fresh holder must still hold the lock")
		assert.LessOrEqual(t, after, before, "stale Extend must not lengthen the fresh lease")
		locked, err := c.Locked(ctx, key)
		require.NoError(t, err)
		assert.True(t, locked)

		require.NoError(t, fresh.Unlock(ctx))
		locked, err = c.Locked(ctx, key)
		require.NoError(t, err)
		assert.False(t, locked)
		assert.NoError(t, fresh.Unlock(ctx), "a repeated Unlock is idempotent")
		next, err := c.TryLock(ctx, key, time.Minute)
		assert.NoError(t, err, "a released lock's tombstone is free")
		assert.NoError(t, fresh.Unlock(ctx), "a repeated Unlock is recognised after the next holder took the key")
		locked, err = c.Locked(ctx, key)
		require.NoError(t, err)
		assert.True(t, locked, "the holder after it is not touched")
		require.NoError(t, next.Unlock(ctx))
		_, err = c.TryLock(ctx, key, time.Minute)
		require.NoError(t, err)
		assert.NoError(t, fresh.Unlock(ctx), "two hands later, the repeat is recognised by its mark")
		locked, err = c.Locked(ctx, key)
		require.NoError(t, err)
		assert.True(t, locked, "and touches nothing")
		b.expire(t, releasedKey(c.redisKey(key), fresh.id))
		assert.ErrorIs(t, fresh.Unlock(ctx), ErrNotHeld, "once its mark is gone, the repeat is not recognised")
		locked, err = c.Locked(ctx, key)
		require.NoError(t, err)
		assert.True(t, locked, "and touches nothing")
	})
}

func TestForeignValueIsNotOurs(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		ctx := context.Background()
		key := uniqueKey(t)
		// A value written by something else, not of our form, must not match an empty
		// or partial token.
		since := "0000000000000001h0000000000000001"
		for _, v := range []string{"tok", "0003tok", "0000000000000001h0002tok", "0000000000000001h00003tok", "0000000000000001h",
			since + "0002tok0000", since + "00003tok0000", since} {
			require.NoError(t, b.admin.Set(ctx, c.redisKey(key), v, time.Minute).Err())
			_, err := c.TryLock(ctx, key, time.Minute, Token("tok"))
			assert.ErrorIs(t, err, ErrNotObtained, "value %q", v)
		}
		require.NoError(t, b.admin.Set(ctx, c.redisKey(key), since+"0005a:tok0000", time.Minute).Err())
		_, err := c.TryLock(ctx, key, time.Minute, Token("tok"))
		assert.ErrorIs(t, err, ErrNotObtained, "token is compared whole")
		l, err := c.TryLock(ctx, key, time.Minute, Token("a:tok"))
		require.NoError(t, err, "same token, with a ':' inside")
		assert.Equal(t, int64(1), l.Fence())
	})
}

func TestFencesIncrease(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		ctx := context.Background()
		key := uniqueKey(t)
		var last int64
		for i := range 20 {
			l, err := c.TryLock(ctx, key, time.Minute)
			require.NoError(t, err)
			assert.Greater(t, l.Fence(), last, "acquisition %d", i)
			last = l.Fence()
			if i%2 == 0 {
				require.NoError(t, l.Unlock(ctx))
			} else {
				b.expire(t, c.redisKey(key))
			}
			if i == 10 { // the key deleted by hand: fences must not restart low
				require.NoError(t, b.admin.Del(ctx, c.redisKey(key)).Err())
			}
		}
	})
}

func TestTokenReclaims(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		ctx := context.Background()
		key := uniqueKey(t)
		first, err := c.TryLock(ctx, key, time.Minute, Token("job-42"))
		require.NoError(t, err)
		again, err := c.TryLock(ctx, key, time.Minute, Token("job-42"))
		require.NoError(t, err, "the same token reclaims its own lock")
		assert.Equal(t, first.Fence(), again.Fence(), "a reclaim keeps the fence")
		_, err = c.TryLock(ctx, key, time.Minute, Token("job-43"))
		assert.ErrorIs(t, err, ErrNotObtained)
		assert.Equal(t, "job-42", again.Token())
		assert.Equal(t, key, again.Key())
	})
}

func TestLockWaitsForRelease(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		ctx := context.Background()
		key := uniqueKey(t)
		holder, err := c.TryLock(ctx, key, time.Hour)
		require.NoError(t, err)

		got := make(chan error, 1)
		go func() {
			l, err := c.Lock(ctx, key, time.Minute)
			if err == nil && l.Fence() <= holder.Fence() {
				err = fmt.Errorf("fence %d after %d", l.Fence(), holder.Fence())
			}
			got <- err
		}()
		waitForWaiters(t, b, c, key, 1)
		require.NoError(t, holder.Unlock(ctx))
		// The holder's lease is an hour: only the release notification can wake the waiter.
		select {
		case err := <-got:
			require.NoError(t, err)
		case <-time.After(30 * time.Second):
			t.Fatal("waiter not woken by the release")
		}
	})
}

// waitForWaiters blocks until n waiters are queued for key in Redis (in the queue of
// a plain lock and that of Limit(n) together) and Redis counts c's subscription: a
// release now reaches one of them.
func waitForWaiters(t *testing.T, b backend, c *Client, key string, n int) {
	t.Helper()
	rkey := c.redisKey(key)
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		subs, err := b.admin.PubSubNumSub(context.Background(), c.hub.channel).Result()
		require.NoError(t, err)
		ready := subs[c.hub.channel] > 0
		plain, err := b.admin.LLen(context.Background(), rkey+waitSuffix).Result()
		require.NoError(t, err)
		slots, err := b.admin.LLen(context.Background(), rkey+slotsSuffix).Result()
		require.NoError(t, err)
		if ready && plain+slots == int64(n) {
			return
		}
		time.Sleep(time.Millisecond)
	}
	t.Fatalf("%d waiters for %q not queued within 10s", n, key)
}

func TestLockCancellation(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		key := uniqueKey(t)
		_, err := c.TryLock(context.Background(), key, time.Hour)
		require.NoError(t, err)

		ctx, cancel := context.WithCancel(context.Background())
		got := make(chan error, 1)
		go func() {
			_, err := c.Lock(ctx, key, time.Minute)
			got <- err
		}()
		waitForWaiters(t, b, c, key, 1)
		cancel()
		err = <-got
		assert.ErrorIs(t, err, ErrNotObtained)
		assert.ErrorIs(t, err, context.Canceled)

		_, err = c.Lock(context.Background(), key, time.Minute, MaxWait(20*time.Millisecond))
		assert.ErrorIs(t, err, ErrNotObtained, "MaxWait elapsed")
		assert.NotErrorIs(t, err, context.DeadlineExceeded, "MaxWait is not the context's deadline")

		_, err = c.Lock(context.Background(), key, time.Minute, MaxWait(0))
		assert.ErrorIs(t, err, ErrNotObtained, "MaxWait(0) is one attempt")

		done, cancelDone := context.WithCancel(context.Background())
		cancelDone()
		_, err = c.TryLock(done, key+":free", time.Minute)
		assert.ErrorIs(t, err, context.Canceled, "a done context takes nothing")
		locked, lerr := c.Locked(context.Background(), key+":free")
		require.NoError(t, lerr)
		assert.False(t, locked)
	})
}

func TestBadArguments(t *testing.T) {
	m := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	defer rdb.Close()
	c := New(rdb)
	ctx := context.Background()
	tests := []struct {
		name string
		call func() error
	}{
		{"empty key", func() error { _, err := c.TryLock(ctx, "", time.Second); return err }},
		{"ttl below 1ms", func() error { _, err := c.Lock(ctx, "k", time.Microsecond); return err }},
		{"WithLock nil fn", func() error { return c.WithLock(ctx, "k", time.Second, nil) }},
		{"Locked empty key", func() error { _, err := c.Locked(ctx, ""); return err }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			assert.Error(t, tt.call())
		})
	}

	var nilLock *Lock
	assert.ErrorIs(t, nilLock.Unlock(ctx), ErrNotHeld)
	assert.ErrorIs(t, nilLock.Extend(ctx, time.Second), ErrNotHeld)
	assert.Zero(t, nilLock.Fence())
	assert.Empty(t, nilLock.Key())

	assert.PanicsWithValue(t, "mutex.New: nil redis client", func() { New(nil) })
	assert.PanicsWithValue(t, "mutex.Token: empty token", func() { Token("") })
	assert.Panics(t, func() { Prefix("a{b") })
}

func TestRedisDown(t *testing.T) {
	// A port nothing listens on: every call reports the Redis error, never a lock.
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1, DialTimeout: 100 * time.Millisecond})
	defer rdb.Close()
	c := New(rdb)
	ctx := context.Background()
	_, err := c.TryLock(ctx, "k", time.Second)
	require.Error(t, err)
	assert.NotErrorIs(t, err, ErrNotObtained)
	assert.Contains(t, err.Error(), `mutex: lock k:`)
	err = c.WithLock(ctx, "k", time.Second, func(context.Context) error {
		t.Error("fn ran without the lock")
		return nil
	})
	assert.Error(t, err)
}

func TestPrefix(t *testing.T) {
	m := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	defer rdb.Close()
	ctx := context.Background()
	a, b := New(rdb, Prefix("app-a:")), New(rdb, Prefix("app-b:"))
	_, err := a.TryLock(ctx, "k", time.Minute)
	require.NoError(t, err)
	_, err = b.TryLock(ctx, "k", time.Minute)
	require.NoError(t, err, "different prefixes do not exclude each other")
	assert.True(t, m.Exists("app-a:{k}"))
	_, err = New(rdb, Prefix("app-a:")).TryLock(ctx, "k", time.Minute)
	assert.ErrorIs(t, err, ErrNotObtained, "same prefix, another Client")
}
