package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"

	"github.com/bsm/redislock"
	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex/internal/benchkit"
	"github.com/asynqmutex/asynqmutex/mutex"
)

// Redis functions: a mutex.Client runs its steps as functions of one library (FCALL)
// where the server and the user's ACL allow, and by EVALSHA elsewhere. The two ways
// are measured side by side, in the event hook scenario's cycles, on one server: the
// EVALSHA column's Client connects as a Redis user who may not call functions, as a
// worker without the README's functions line does. redislock (its EVALSHA, 1 ms
// retry: nothing waits here) is the peer the goals name.
func init() {
	scenarios = append(scenarios, scenario{
		name:  "functions: uncontended lock+unlock",
		group: functionsGroup,
		metrics: []metric{
			{name: "latency", unit: "µs/op"},
			{name: "latency ÷ " + evalshaColumn, unit: "×"},
			{name: "latency ÷ " + redislockColumn, unit: "×"},
			{name: "Redis server time", unit: "µs/op"},
			{name: "Redis server time ÷ " + evalshaColumn, unit: "×"},
			{name: "Redis server time ÷ " + redislockColumn, unit: "×"},
		},
		run: func(ctx context.Context, e *env) (figures, error) {
			return runCycled(ctx, e, functionsContenders(), []string{"latency", "Redis server time"}, evalshaColumn, redislockColumn)
		},
	})
}

const (
	fcallColumn     = "asynqmutex, FCALL"
	evalshaColumn   = "asynqmutex, EVALSHA"
	redislockColumn = "redislock 1ms"
)

func functionsContenders() []contender {
	return []contender{
		{column: column{name: fcallColumn}, sent: benchkit.LockCommands, open: openOursWith("fn-fcall:")},
		{column: column{name: evalshaColumn}, sent: benchkit.LockCommands, open: openOursEvalsha("fn-evalsha:")},
		{column: column{name: redislockColumn}, sent: []string{"evalsha", "eval"},
			open: openRedislock("fn-redislock:", &redislock.Options{RetryStrategy: redislock.LinearBackoff(peerRetry)})},
	}
}

// functionsGroup is the table of the functions scenario: asynqmutex both ways, and
// redislock.
var functionsGroup = &group{
	title:   "## Redis functions: asynqmutex's steps by FCALL and by EVALSHA, redislock",
	columns: columnsOf(functionsContenders()),
	noPeers: true,
}

// openOursEvalsha is openOursWith's Client, connected as a Redis user of its own who
// may run every command but FCALL: its Runner finds functions refused at its first
// call and sends EVALSHA from then on. The user is deleted when the locker closes.
func openOursEvalsha(ns string) func(context.Context, *env, []string) (*locker, error) {
	return func(ctx context.Context, e *env, keys []string) (*locker, error) {
		var tok [8]byte
		_, _ = rand.Read(tok[:])
		user, password := "asynqmutex-bench-"+hex.EncodeToString(tok[:4]), hex.EncodeToString(tok[4:])
		if err := e.stats.Do(ctx, "ACL", "SETUSER", user, "on", ">"+password, "~*", "&*", "+@all", "-fcall").Err(); err != nil {
			return nil, fmt.Errorf("a Redis user without FCALL (ACL SETUSER): %w", err)
		}
		hook := new(benchkit.AttemptCounter)
		rdb := redis.NewClient(&redis.Options{Addr: e.addr, PoolSize: 64, Username: user, Password: password})
		rdb.AddHook(hook)
		locks := mutex.New(rdb, mutex.Prefix(e.prefix+ns))
		return &locker{
			lock: func(ctx context.Context, key string) (func(context.Context) error, error) {
				l, err := locks.Lock(ctx, key, lockTTL)
				if err != nil {
					return nil, err
				}
				return l.Unlock, nil
			},
			mark: hook.Attempts.Load,
			close: func() {
				_ = locks.Close()
				rdb.Close()
				_ = e.stats.Do(context.Background(), "ACL", "DELUSER", user).Err()
			},
		}, nil
	}
}
