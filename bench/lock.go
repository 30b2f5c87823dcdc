package main

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strconv"
	"time"

	"github.com/bsm/redislock"
	"github.com/go-redsync/redsync/v4"
	"github.com/go-redsync/redsync/v4/redis/goredis/v9"
	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex/internal/benchkit"
	"github.com/asynqmutex/asynqmutex/mutex"
)

const (
	lockTTL = 30 * time.Second

	// opBound bounds every Redis call and every wait of a scenario, so a lost
	// wake-up or a dead server ends the program with an error instead of hanging it.
	opBound = 30 * time.Second

	// peerRetry is the tuned peers' retry delay.
	peerRetry = time.Millisecond
)

// lockGroup is the table of the lock scenarios: a column per contender.
var lockGroup = &group{title: "## Locks", columns: columnsOf(contenders)}

// contender is a lock the lock scenarios measure.
type contender struct {
	column
	// sent are the commands its clients send themselves: its server time is their
	// commandstats usec, which for a script includes what the script runs.
	sent []string
	// waits is false for a lock that gives up at once on a busy key: it takes part
	// only in the uncontended scenario.
	waits bool
	// open makes the lock of one process, on a connection pool of its own, for the
	// scenario's keys; the caller closes it.
	open func(ctx context.Context, e *env, keys []string) (*locker, error)
}

// locker is one process's lock.
type locker struct {
	// lock returns once it holds key (waiting while it is busy), with what releases it.
	lock func(ctx context.Context, key string) (unlock func(context.Context) error, err error)
	// blocked returns once a lock call on key, started when mark returned n, waits for
	// the holder's release: it is past its first attempt.
	mark    func() int64
	blocked func(ctx context.Context, key string, n int64) error
	close   func()
}

// contenders, in the columns' order. Each keeps its keys under a prefix of its own.
var contenders = []contender{
	{column: column{name: ours}, sent: benchkit.LockCommands, waits: true, open: openOurs},
	{column: column{name: "redislock 1ms", peer: true}, sent: []string{"evalsha", "eval"}, waits: true,
		open: openRedislock("redislock-1ms:", &redislock.Options{RetryStrategy: redislock.LinearBackoff(peerRetry)})},
	{column: column{name: "redislock default", peer: true}, sent: []string{"evalsha", "eval"},
		open: openRedislock("redislock-default:", nil)},
	{column: column{name: "redsync 1ms", peer: true}, sent: []string{"set", "evalsha", "eval"}, waits: true,
		open: openRedsync("redsync-1ms:", redsync.WithExpiry(lockTTL), redsync.WithRetryDelay(peerRetry), redsync.WithTries(math.MaxInt32))},
	{column: column{name: "redsync default", peer: true}, sent: []string{"set", "evalsha", "eval"}, waits: true,
		open: openRedsync("redsync-default:")},
	{column: column{name: "BLPOP reference"}, sent: []string{"blpop", "lpush"}, waits: true, open: openBLPOP},
	{column: column{name: "SET NX floor"}, sent: benchkit.FloorCommands, waits: true, open: openFloor},
}

// openOurs: one mutex.Client; Lock, then Unlock.
func openOurs(ctx context.Context, e *env, keys []string) (*locker, error) {
	return openOursWith("asynqmutex:")(ctx, e, keys)
}

// openOursWith is openOurs with keys under the namespace ns and the Client's
// options opts.
func openOursWith(ns string, opts ...mutex.Option) func(context.Context, *env, []string) (*locker, error) {
	return func(_ context.Context, e *env, _ []string) (*locker, error) {
		prefix := e.prefix + ns
		hook := new(benchkit.AttemptCounter)
		rdb := e.redis(hook)
		locks := mutex.New(rdb, append([]mutex.Option{mutex.Prefix(prefix)}, opts...)...)
		return &locker{
			lock: func(ctx context.Context, key string) (func(context.Context) error, error) {
				l, err := locks.Lock(ctx, key, lockTTL)
				if err != nil {
					return nil, err
				}
				return l.Unlock, nil
			},
			mark: hook.Attempts.Load,
			// The key's Redis key is prefix + "{" + key + "}" (the scenarios' keys need no
			// escaping), whose wait queue WaitBlocked looks at.
			blocked: func(ctx context.Context, key string, n int64) error {
				return benchkit.WaitBlocked(ctx, hook, n, e.stats, prefix, prefix+"{"+key+"}")
			},
			close: func() {
				_ = locks.Close() // first: it drops its subscription, on rdb
				rdb.Close()
			},
		}, nil
	}
}

// openRedislock: Obtain with opts, then Release. With nil opts (the default, no
// retry) a busy key fails at once.
func openRedislock(ns string, opts *redislock.Options) func(context.Context, *env, []string) (*locker, error) {
	return func(_ context.Context, e *env, _ []string) (*locker, error) {
		trips := new(benchkit.RoundTrips)
		rdb := e.redis(trips)
		c := redislock.New(rdb)
		return pollingLocker(rdb, trips, func(ctx context.Context, key string) (func(context.Context) error, error) {
			l, err := c.Obtain(ctx, e.prefix+ns+key, lockTTL, opts)
			if err != nil {
				return nil, err
			}
			return l.Release, nil
		}), nil
	}
}

// openRedsync: a redsync.Mutex with opts per acquisition, as concurrent callers
// need; LockContext, then UnlockContext. Its defaults: 8 s expiry, 32 tries 50–250
// ms apart.
func openRedsync(ns string, opts ...redsync.Option) func(context.Context, *env, []string) (*locker, error) {
	return func(_ context.Context, e *env, _ []string) (*locker, error) {
		trips := new(benchkit.RoundTrips)
		rdb := e.redis(trips)
		rs := redsync.New(goredis.NewPool(rdb))
		return pollingLocker(rdb, trips, func(ctx context.Context, key string) (func(context.Context) error, error) {
			m := rs.NewMutex(e.prefix+ns+key, opts...)
			if err := m.LockContext(ctx); err != nil {
				return nil, err
			}
			return func(ctx context.Context) error {
				ok, err := m.UnlockContext(ctx)
				if err == nil && !ok {
					err = errors.New("redsync: not unlocked")
				}
				return err
			}, nil
		}), nil
	}
}

// pollingLocker is a lock that retries on a timer: a waiter is blocked once its first
// attempt has come back.
func pollingLocker(rdb *redis.Client, trips *benchkit.RoundTrips, lock func(context.Context, string) (func(context.Context) error, error)) *locker {
	return &locker{
		lock: lock,
		mark: trips.Load,
		blocked: func(ctx context.Context, _ string, n int64) error {
			return poll(ctx, func() (bool, error) { return trips.Load() > n, nil })
		},
		close: func() { rdb.Close() },
	}
}

// openBLPOP is the notified reference: each key is a list that holds one token while
// the key is free. Lock is BLPOP, which takes the token or blocks until a release
// pushes it; release is LPUSH. One round trip per step and per handoff, and waiters
// are served in the order they blocked. It is no safe lock (no lease: a holder that
// dies keeps the token), only the least a notified lock can cost.
func openBLPOP(ctx context.Context, e *env, keys []string) (*locker, error) {
	rdb := e.redis()
	ns := e.prefix + "blpop:"
	// Seed each list once per program run, whichever process opens it first.
	seeded := make([]*redis.BoolCmd, len(keys))
	if _, err := rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, k := range keys {
			seeded[i] = p.SetNX(ctx, ns+k+":seeded", "1", 0)
		}
		return nil
	}); err != nil {
		rdb.Close()
		return nil, err
	}
	if _, err := rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, k := range keys {
			if seeded[i].Val() {
				p.LPush(ctx, ns+k, "token")
			}
		}
		return nil
	}); err != nil {
		rdb.Close()
		return nil, err
	}
	return &locker{
		lock: func(ctx context.Context, key string) (func(context.Context) error, error) {
			if err := rdb.BLPop(ctx, opBound, ns+key).Err(); err != nil {
				return nil, fmt.Errorf("BLPOP: %w", err)
			}
			return func(ctx context.Context) error { return rdb.LPush(ctx, ns+key, "token").Err() }, nil
		},
		mark: func() int64 { return 0 },
		blocked: func(ctx context.Context, _ string, _ int64) error {
			return poll(ctx, func() (bool, error) {
				info, err := e.stats.Info(ctx, "clients").Result()
				if err != nil {
					return false, err
				}
				n, _ := infoField(info, "blocked_clients")
				return n != "" && n != "0", nil
			})
		},
		close: func() { rdb.Close() },
	}, nil
}

// openFloor is the raw floor: SET key tok NX PX, sleeping benchkit.FloorRetry after
// "not set", then DEL (no token check). In the handoff scenario the floor is
// floorHandoff instead.
func openFloor(_ context.Context, e *env, _ []string) (*locker, error) {
	trips := new(benchkit.RoundTrips)
	rdb := e.redis(trips)
	ns := e.prefix + "floor:"
	return pollingLocker(rdb, trips, func(ctx context.Context, key string) (func(context.Context) error, error) {
		if err := benchkit.SpinAcquire(ctx, rdb, ns+key, token(), lockTTL, nil); err != nil {
			return nil, err
		}
		return func(ctx context.Context) error { return rdb.Del(ctx, ns+key).Err() }, nil
	}), nil
}

// token is a random lock token for the floor, like the lock's own.
func token() string {
	return strconv.FormatUint(rand.Uint64(), 36) + strconv.FormatUint(rand.Uint64(), 36)
}

// poll returns once cond holds, checking every 20µs for at most 5 s.
func poll(ctx context.Context, cond func() (bool, error)) error {
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		ok, err := cond()
		if err != nil || ok {
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		time.Sleep(20 * time.Microsecond)
	}
	return errors.New("the waiter did not block within 5s")
}
