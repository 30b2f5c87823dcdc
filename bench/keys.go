package main

import (
	"context"
	"errors"
	"strconv"

	"github.com/asynqmutex/asynqmutex/internal/benchkit"
	"github.com/asynqmutex/asynqmutex/mutex"
)

// Several keys as one lock: mutex.Client.LockKeys takes a set in one script call on a
// single Redis and Unlock releases it in one, so a set should cost the round trips of
// one single-key lock, where taking the keys one by one costs one per key each way.
func init() {
	scenarios = append(scenarios, scenario{
		name:  "several keys: uncontended lock+unlock",
		group: keysGroup,
		metrics: []metric{
			{name: "latency", unit: "µs/op"},
			{name: "latency ÷ " + oneKey, unit: "×"},
			{name: "latency ÷ " + floorColumn, unit: "×"},
			{name: "round trips", unit: "per op"},
			{name: "round trips ÷ " + oneKey, unit: "×"},
			{name: "Redis calls", unit: "per op"},
			{name: "Redis server time", unit: "µs/op"},
			{name: "Redis server time ÷ " + oneKey, unit: "×"},
			{name: "Redis server time ÷ " + floorColumn, unit: "×"},
		},
		run: func(ctx context.Context, e *env) (figures, error) {
			return runCycled(ctx, e, keysContenders(), []string{"latency", "round trips", "Redis server time"}, oneKey, floorColumn)
		},
	})
}

const (
	oneKey      = "1 key"
	floorColumn = "SET NX floor"
)

// keysContenders are asynqmutex's Client taking one key (the reference), 2 and 4
// keys as one lock with LockKeys, and 2 and 4 keys one at a time with Lock, and the
// raw SET NX/DEL floor on one key.
func keysContenders() []contender {
	return []contender{
		{column: column{name: oneKey}, sent: benchkit.LockCommands, open: openOursWith("keys-1:")},
		{column: column{name: "2 keys, LockKeys"}, sent: benchkit.LockCommands, open: openOursKeys("keys-2:", 2, true)},
		{column: column{name: "2 keys, Lock each"}, sent: benchkit.LockCommands, open: openOursKeys("keys-2x1:", 2, false)},
		{column: column{name: "4 keys, LockKeys"}, sent: benchkit.LockCommands, open: openOursKeys("keys-4:", 4, true)},
		{column: column{name: "4 keys, Lock each"}, sent: benchkit.LockCommands, open: openOursKeys("keys-4x1:", 4, false)},
		{column: column{name: floorColumn}, sent: benchkit.FloorCommands, open: openFloor},
	}
}

// keysGroup is the table of the several-keys scenario: asynqmutex alone and the
// floor; its figures compare with one key's and the floor's, not with a peer.
var keysGroup = &group{
	title:   "## Several keys: one lock of 2 or 4 keys (LockKeys), the keys locked one by one (Lock each), one key",
	columns: columnsOf(keysContenders()),
	noPeers: true,
}

// openOursKeys: one mutex.Client taking n keys derived from the scenario's key: as
// one lock with LockKeys and one Unlock when together, otherwise with a Lock each, in
// one order, and an Unlock each.
func openOursKeys(ns string, n int, together bool) func(context.Context, *env, []string) (*locker, error) {
	return func(_ context.Context, e *env, _ []string) (*locker, error) {
		rdb := e.redis()
		locks := mutex.New(rdb, mutex.Prefix(e.prefix+ns))
		set := func(key string) []string {
			keys := make([]string, n)
			for i := range keys {
				keys[i] = key + ":" + strconv.Itoa(i)
			}
			return keys
		}
		lock := func(ctx context.Context, key string) (func(context.Context) error, error) {
			l, err := locks.LockKeys(ctx, set(key), lockTTL)
			if err != nil {
				return nil, err
			}
			return l.Unlock, nil
		}
		if !together {
			lock = func(ctx context.Context, key string) (func(context.Context) error, error) {
				held := make([]*mutex.Lock, 0, n)
				unlock := func(ctx context.Context) error {
					var errs []error
					for _, l := range held {
						errs = append(errs, l.Unlock(ctx))
					}
					return errors.Join(errs...)
				}
				for _, k := range set(key) {
					l, err := locks.Lock(ctx, k, lockTTL)
					if err != nil {
						return nil, errors.Join(err, unlock(ctx))
					}
					held = append(held, l)
				}
				return unlock, nil
			}
		}
		return &locker{
			lock:  lock,
			close: func() { _ = locks.Close(); rdb.Close() },
		}, nil
	}
}
