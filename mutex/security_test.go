package mutex

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
)

// aclRules are the only permissions the library needs, for the default prefix: its
// keys and channels, the script commands, the commands the scripts call, and what
// go-redis sends on connecting and subscribing. docs/operating.md quotes them.
const aclRules = workerACLRules + " " + functionACLRules + " " + limitACLRules + " " + operatorACLRules

// workerACLRules are what a worker needs: locking, waiting, renewing, releasing,
// one key or several.
const workerACLRules = "resetkeys ~asynqmutex:* resetchannels &asynqmutex:* -@all " +
	"+evalsha +eval +ping +hello +subscribe +unsubscribe " +
	"+get +set +pexpire +pttl +time +rpush +lpop +lrem +lpos +lindex +lset +lrange +publish"

// functionACLRules let a worker run the steps as Redis functions (FCALL), loading the
// library where it is missing; without them it sends EVALSHA. The contract tests run
// as a user with them (aclUser) and as users without (the others).
const functionACLRules = "+fcall +function|load"

// limitACLRules are what a worker needs more for locks with Limit(n).
const limitACLRules = "+type +del +hget +hgetall +hset +hdel"

// operatorACLRules are what Inspect, List and ForceRelease need more.
const operatorACLRules = "+lrange +llen +scan +type +del"

const (
	workerUser   = "worker"
	functionUser = "functions" // workerACLRules and functionACLRules
	limiterUser  = "limiter"   // workerACLRules and limitACLRules
	operatorUser = "operator"  // workerACLRules and operatorACLRules
)

// certDir holds the shared server's certificates; TestMain removes it.
var certDir string

const (
	aclUser     = "locker"
	aclPassword = "locker-secret"
)

// startSharedServer starts the contract tests' redis-server: plain TCP for admin,
// TLS on a second port, and the restricted ACL user.
func startSharedServer() (*redistest.Server, error) {
	dir, err := os.MkdirTemp("", "mutex-tls-")
	if err != nil {
		return nil, err
	}
	certDir = dir
	pool, err := redistest.WriteCerts(dir)
	if err != nil {
		return nil, err
	}
	port, err := redistest.FreePort()
	if err != nil {
		return nil, err
	}
	s, err := redistest.StartProcess(redistest.TLSArgs(dir, port)...)
	if err != nil {
		return nil, err
	}
	admin := redis.NewClient(&redis.Options{Addr: s.Addr()})
	defer admin.Close()
	for user, rules := range map[string]string{aclUser: aclRules, workerUser: workerACLRules,
		functionUser: workerACLRules + " " + functionACLRules,
		limiterUser:  workerACLRules + " " + limitACLRules, operatorUser: workerACLRules + " " + operatorACLRules} {
		args := []any{"ACL", "SETUSER", user, "reset", "on", ">" + aclPassword}
		for _, r := range strings.Fields(rules) {
			args = append(args, r)
		}
		if err := admin.Do(context.Background(), args...).Err(); err != nil {
			s.Close()
			return nil, fmt.Errorf("ACL SETUSER %s: %w", user, err)
		}
	}
	tlsPort, tlsCA = port, pool
	return s, nil
}

func aclClient(t *testing.T) *redis.Client {
	sharedServer(t)
	rdb := redis.NewClient(&redis.Options{Addr: server.Addr(), Username: aclUser, Password: aclPassword})
	t.Cleanup(func() { rdb.Close() })
	return rdb
}

func tlsClient(t *testing.T) *redis.Client {
	sharedServer(t)
	rdb := redis.NewClient(&redis.Options{
		Addr:      net.JoinHostPort("127.0.0.1", strconv.Itoa(tlsPort)),
		TLSConfig: &tls.Config{RootCAs: tlsCA, ServerName: "127.0.0.1", MinVersion: tls.VersionTLS12},
	})
	t.Cleanup(func() { rdb.Close() })
	return rdb
}

func TestACLConfinesTheUser(t *testing.T) {
	// Positive control for the ACL backend: the restricted user really is restricted,
	// so the contract passing under it shows the library needs nothing more.
	rdb := aclClient(t)
	ctx := context.Background()
	assert.ErrorContains(t, rdb.FlushAll(ctx).Err(), "NOPERM", "commands the library does not use are not granted")
	assert.ErrorContains(t, rdb.Set(ctx, "other:x", "v", time.Minute).Err(), "NOPERM", "keys outside the prefix are not granted")
	_, err := New(rdb, Prefix("other:")).TryLock(ctx, "k", time.Minute)
	assert.ErrorContains(t, err, "NOPERM", "a lock outside the prefix is refused")
	l, err := New(rdb).TryLock(ctx, uniqueKey(t), time.Minute)
	require.NoError(t, err)
	require.NoError(t, l.Unlock(ctx))
}

func TestTokensNeverInErrors(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		c := New(b.rdb)
		ctx := context.Background()
		key := uniqueKey(t)
		const secret = "the-secret-token"
		l, err := c.TryLock(ctx, key, time.Minute, Token(secret))
		require.NoError(t, err)
		var errs []error
		_, err = c.TryLock(ctx, key, time.Minute)
		errs = append(errs, err)
		b.expire(t, c.redisKey(key))
		errs = append(errs, l.Unlock(ctx), l.Extend(ctx, time.Minute))
		_, err = l.TTL(ctx)
		errs = append(errs, err)
		errs = append(errs, c.WithLock(ctx, key, 150*time.Millisecond, func(fctx context.Context) error {
			if err := b.admin.Del(ctx, c.redisKey(key)).Err(); err != nil {
				return err
			}
			select { // the next renewal finds the key gone
			case <-fctx.Done():
				return nil
			case <-time.After(10 * time.Second):
				return errors.New("lease loss not noticed")
			}
		}, Token(secret)))
		down := New(unreachable(t))
		_, err = down.TryLock(ctx, key, time.Minute, Token(secret))
		errs = append(errs, err)
		for i, err := range errs {
			require.Error(t, err, "error %d", i)
			assert.NotContains(t, err.Error(), secret, "error %d: %v", i, err)
			assert.True(t, errors.Is(err, ErrNotObtained) || errors.Is(err, ErrNotHeld) || i == len(errs)-1, "error %d: %v", i, err)
		}
	})
}

func TestErrorsBounded(t *testing.T) {
	// A key built from a payload can be megabytes: no error text may carry it whole.
	m := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	defer rdb.Close()
	c := New(rdb)
	ctx := context.Background()
	key := strings.Repeat("k", 1<<20)
	l, err := c.TryLock(ctx, key, time.Minute)
	require.NoError(t, err)
	require.NoError(t, rdb.Del(ctx, c.redisKey(key)).Err())
	_, ttlErr := l.TTL(ctx)
	_, downErr := New(unreachable(t)).TryLock(ctx, key, time.Minute)
	for i, err := range []error{l.Unlock(ctx), l.Extend(ctx, time.Minute), ttlErr, downErr} {
		require.Error(t, err, "error %d", i)
		assert.Less(t, len(err.Error()), 400, "error %d: %.200q", i, err)
		assert.Contains(t, err.Error(), "sha256:", "error %d names the key by a digest", i)
	}
}

// TestDocsQuoteTheACLRules: docs/operating.md, where the README sends operators,
// gives these lines.
func TestDocsQuoteTheACLRules(t *testing.T) {
	b, err := os.ReadFile("../docs/operating.md")
	require.NoError(t, err)
	text := string(b)
	i := strings.Index(text, "ACL SETUSER locker on >password ")
	require.GreaterOrEqual(t, i, 0)
	block := strings.Join(strings.Fields(text[i:i+strings.Index(text[i:], "```")]), " ")
	for _, rules := range []string{workerACLRules, functionACLRules, limitACLRules, operatorACLRules} {
		assert.Contains(t, block, strings.Join(strings.Fields(rules), " "))
	}
}

// TestLimitACLSuffices: a worker with the rules docs/operating.md gives for Limit(n) takes,
// waits for (a hand-over), renews and releases a slot, and serves the line of crashed
// holders; without them it is refused.
func TestLimitACLSuffices(t *testing.T) {
	sharedServer(t)
	for _, user := range []string{limiterUser, workerUser} {
		rdb := redis.NewClient(&redis.Options{Addr: server.Addr(), Username: user, Password: aclPassword})
		t.Cleanup(func() { rdb.Close() })
		c := New(rdb)
		defer c.Close()
		ctx := context.Background()
		key := uniqueKey(t) + ":" + user
		l, err := c.TryLock(ctx, key, time.Minute, Limit(2))
		if user == workerUser {
			assert.ErrorContains(t, err, "can't run this command", "control: Limit(n) needs its own rules")
			continue
		}
		require.NoError(t, err)
		l2, err := c.TryLock(ctx, key, time.Minute, Limit(2))
		require.NoError(t, err)
		got := make(chan error, 1)
		go func() {
			w, err := c.Lock(ctx, key, time.Minute, Limit(2), MaxWait(20*time.Second))
			if err == nil {
				err = w.Unlock(ctx)
			}
			got <- err
		}()
		waitForWaiters(t, backend{admin: sharedServer(t)}, c, key, 1)
		require.NoError(t, l.Extend(ctx, time.Minute))
		_, err = l.TTL(ctx)
		require.NoError(t, err)
		require.NoError(t, l.Unlock(ctx))
		require.NoError(t, <-got, "handed over and released")
		require.NoError(t, l2.Unlock(ctx))

		// Serve hands the slots of crashed holders to a parked task.
		_, err = c.TryLock(ctx, key, time.Minute, Limit(2), Token("h1"))
		require.NoError(t, err)
		h2, err := c.TryLock(ctx, key, time.Minute, Limit(2))
		require.NoError(t, err)
		_, err = c.Lock(ctx, key, time.Minute, Limit(2), Park("p", time.Minute, ParkAfterWait), MaxWait(time.Millisecond))
		require.ErrorIs(t, err, ErrParked)
		endSlot(t, backend{admin: sharedServer(t)}, c, key, "h1")
		_, waiting, err := c.Serve(ctx, key, Limit(2))
		require.NoError(t, err)
		assert.False(t, waiting)
		p, err := c.TryLock(ctx, key, time.Minute, Limit(2), Park("p", time.Minute, ParkNever))
		require.NoError(t, err, "handed to p")
		require.NoError(t, p.Unlock(ctx))
		require.NoError(t, h2.Unlock(ctx)) // no hash is left for List to meet (TestOperatorACLSuffices)
	}
}

func TestWorkerACLSuffices(t *testing.T) {
	// What docs/operating.md tells workers to grant: lock, wait (a hand-over), renew,
	// release, one key or several, park and serve the line; and Inspect needs more.
	sharedServer(t)
	rdb := redis.NewClient(&redis.Options{Addr: server.Addr(), Username: workerUser, Password: aclPassword})
	t.Cleanup(func() { rdb.Close() })
	c := New(rdb)
	defer c.Close()
	ctx := context.Background()
	key := uniqueKey(t)
	l, err := c.TryLock(ctx, key, time.Minute)
	require.NoError(t, err)
	got := lockThenUnlock(c, key)
	waitForWaiters(t, backend{admin: sharedServer(t)}, c, key, 1)
	require.NoError(t, l.Extend(ctx, time.Minute))
	require.NoError(t, l.Unlock(ctx))
	require.NoError(t, <-got, "handed over and released")
	require.NoError(t, c.WithLock(ctx, key, 60*time.Millisecond, func(ctx context.Context) error {
		time.Sleep(100 * time.Millisecond) // a renewal or two
		return ctx.Err()
	}))
	require.NoError(t, c.WithLockKeys(ctx, []string{key, key + ":2"}, 60*time.Millisecond, func(ctx context.Context) error {
		time.Sleep(100 * time.Millisecond) // a renewal or two
		return ctx.Err()
	}))
	// Serve hands a crashed holder's key to its parked task.
	_, err = c.TryLock(ctx, key, time.Minute)
	require.NoError(t, err)
	_, err = c.Lock(ctx, key, time.Minute, Park("p", time.Minute, ParkAfterWait), MaxWait(time.Millisecond))
	require.ErrorIs(t, err, ErrParked)
	require.NoError(t, sharedServer(t).Del(ctx, c.redisKey(key)).Err())
	_, waiting, err := c.Serve(ctx, key)
	require.NoError(t, err)
	assert.False(t, waiting)
	p, err := c.TryLock(ctx, key, time.Minute, Park("p", time.Minute, ParkNever))
	require.NoError(t, err, "handed to p")
	require.NoError(t, p.Unlock(ctx))
	_, err = c.Inspect(ctx, key)
	assert.ErrorContains(t, err, "can't run this command", "inspection needs the operator's rules")
}

// TestFunctionACL: a worker with the rules docs/operating.md gives for functions runs every
// step by FCALL, and one without them by EVALSHA, both through a hand-over, renewals
// and a set of keys (TestWorkerACLSuffices checks the rest of a worker's life without
// them).
func TestFunctionACL(t *testing.T) {
	sharedServer(t)
	for user, want := range map[string]string{functionUser: "fcall", workerUser: "evalsha"} {
		t.Run(user, func(t *testing.T) {
			rdb := redis.NewClient(&redis.Options{Addr: server.Addr(), Username: user, Password: aclPassword})
			t.Cleanup(func() { rdb.Close() })
			var (
				mu    sync.Mutex
				names []string
			)
			rdb.AddHook(&rgHook{process: func(ctx context.Context, cmd redis.Cmder, next redis.ProcessHook) error {
				if rgIsScript(cmd) {
					mu.Lock()
					names = append(names, cmd.Name())
					mu.Unlock()
				}
				return next(ctx, cmd)
			}})
			c := New(rdb)
			defer c.Close()
			ctx := context.Background()
			key := uniqueKey(t)
			l, err := c.TryLock(ctx, key, time.Minute)
			require.NoError(t, err)
			got := lockThenUnlock(c, key)
			waitForWaiters(t, backend{admin: sharedServer(t)}, c, key, 1)
			require.NoError(t, l.Extend(ctx, time.Minute))
			require.NoError(t, l.Unlock(ctx))
			require.NoError(t, <-got, "handed over and released")
			require.NoError(t, c.WithLockKeys(ctx, []string{key, key + ":2"}, time.Minute, func(context.Context) error { return nil }))

			mu.Lock()
			defer mu.Unlock()
			require.NotEmpty(t, names)
			// Without the rules the first call is refused by the ACL before it runs;
			// then EVALSHA for good (an EVAL where the script was not cached yet).
			first := 0
			if want == "evalsha" {
				assert.Equal(t, "fcall", names[0], "the first call tries a function")
				first = 1
			}
			for i, name := range names[first:] {
				if want == "evalsha" && name == "eval" {
					continue
				}
				assert.Equal(t, want, name, "call %d of %v", first+i, names)
			}
		})
	}
}

// TestOperatorACLSuffices: with the worker's rules and the operator's line, Inspect,
// Locked, List and ForceRelease work on plain locks (TestWorkerACLSuffices is the
// control: without that line Inspect is refused).
func TestOperatorACLSuffices(t *testing.T) {
	sharedServer(t)
	rdb := redis.NewClient(&redis.Options{Addr: server.Addr(), Username: operatorUser, Password: aclPassword})
	t.Cleanup(func() { rdb.Close() })
	c := New(rdb)
	defer c.Close()
	ctx := context.Background()
	key := uniqueKey(t)
	l, err := c.TryLock(ctx, key, time.Minute, HeldBy("stuck", "1"))
	require.NoError(t, err)
	in, err := c.Inspect(ctx, key)
	require.NoError(t, err)
	assert.True(t, in.Held)
	assert.Equal(t, "stuck", in.Holder.Name)
	locked, err := c.Locked(ctx, key)
	require.NoError(t, err)
	assert.True(t, locked)
	listed := false
	for in, err := range c.List(ctx) {
		require.NoError(t, err)
		listed = listed || in.Key == key
	}
	assert.True(t, listed, "List yields the held key")
	r, err := c.ForceRelease(ctx, key)
	require.NoError(t, err)
	assert.True(t, r.Before.Held)
	assert.ErrorIs(t, l.Unlock(ctx), ErrNotHeld)
}
