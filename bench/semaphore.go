package main

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/asynqmutex/asynqmutex/internal/benchkit"
	"github.com/asynqmutex/asynqmutex/mutex"
)

// The semaphore scenarios: G goroutines of one process take one key with at most
// semLimit holders at once (mutex.Limit), in rounds as the hot-key scenarios do,
// for G = 8, 16 and 32, so that the figures show whether the cost per acquisition
// stays flat as waiters grow. No peer library offers a semaphore, so the columns are
// asynqmutex and two references: a notified one (BLPOP on a list of semLimit tokens)
// and a raw floor (INCR, and DECR and a sleep when over the limit).
func init() {
	for _, g := range []int{8, 16, 32} {
		scenarios = append(scenarios, semScenario(g))
	}
}

const semLimit = 4

// semGroup is the table of the semaphore scenarios.
var semGroup = &group{title: "## Semaphore (mutex.Limit)", columns: columnsOf(semContenders)}

// semContender is a semaphore the semaphore scenarios measure. open makes one
// process's semaphore on a client of its own whose round trips trips counts.
type semContender struct {
	column
	sent []string // as contender.sent
	open func(ctx context.Context, e *env, trips *benchkit.RoundTrips) (*locker, error)
}

// semContenders, in the columns' order.
var semContenders = []semContender{
	{column: column{name: ours}, sent: benchkit.LockCommands, open: openOursLimit},
	{column: column{name: "BLPOP reference"}, sent: []string{"blpop", "lpush"}, open: openBLPOPSem},
	{column: column{name: "INCR floor"}, sent: []string{"incr", "decr"}, open: openIncrFloor},
}

func semScenario(workers int) scenario {
	return scenario{
		name:  fmt.Sprintf("semaphore n=%d, %d goroutines", semLimit, workers),
		group: semGroup,
		metrics: []metric{
			{name: "throughput", unit: "acq/s", higher: true},
			{name: "wait p99", unit: "ms"},
			{name: "wait p50", unit: "ms"},
			{name: "round trips", unit: "per acq", goals: []goal{atMost(4, "")}},
			{name: "Redis calls", unit: "per acq"},
			{name: "fairness, worst round", unit: "fewest/most", higher: true, worst: true},
		},
		run: func(ctx context.Context, e *env) (figures, error) {
			var (
				names []string
				sides []side
			)
			for _, c := range semContenders {
				trips := new(benchkit.RoundTrips)
				l, err := c.open(ctx, e, trips)
				if err != nil {
					return nil, err
				}
				defer l.close()
				s := &semSide{hotKeySide: hotKeySide{l: l, key: "sem", workers: workers, round: e.round, m: e.meter(c.sent)}, trips: trips}
				names, sides = append(names, c.name), append(sides, s)
			}
			for i, s := range sides {
				if err := s.run(ctx, time.Now().Add(50*time.Millisecond)); err != nil {
					return nil, errors.Join(errors.New(names[i]+": warm-up"), err)
				}
				s.reset()
			}
			return interleave(ctx, e.d, 1, names, sides)
		},
	}
}

// semSide is a hot-key side that also counts the round trips its client made:
// commands and pipelines sent, not what scripts run inside the server, nor the
// subscription's own traffic.
type semSide struct {
	hotKeySide
	trips *benchkit.RoundTrips
	sent  int64
}

func (s *semSide) reset() { s.hotKeySide.reset(); s.sent = 0 }

func (s *semSide) run(ctx context.Context, deadline time.Time) error {
	n := s.trips.Load()
	err := s.hotKeySide.run(ctx, deadline)
	s.sent += s.trips.Load() - n
	return err
}

func (s *semSide) figures() map[string]float64 {
	f := s.hotKeySide.figures()
	f["round trips"] = float64(s.sent) / float64(s.acqs)
	return f
}

// openOursLimit: one mutex.Client; Lock with mutex.Limit(semLimit), then Unlock.
func openOursLimit(_ context.Context, e *env, trips *benchkit.RoundTrips) (*locker, error) {
	rdb := e.redis(trips)
	locks := mutex.New(rdb, mutex.Prefix(e.prefix+"asynqmutex-sem:"))
	return &locker{
		lock: func(ctx context.Context, key string) (func(context.Context) error, error) {
			l, err := locks.Lock(ctx, key, lockTTL, mutex.Limit(semLimit))
			if err != nil {
				return nil, err
			}
			return l.Unlock, nil
		},
		close: func() {
			_ = locks.Close()
			rdb.Close()
		},
	}, nil
}

// openBLPOPSem is the notified reference: the key is a list that holds one token per
// free slot (semLimit, seeded once per program run). Acquire is BLPOP, release LPUSH:
// one round trip per step, waiters served in the order they blocked, no lease.
func openBLPOPSem(ctx context.Context, e *env, trips *benchkit.RoundTrips) (*locker, error) {
	rdb := e.redis(trips)
	list := e.prefix + "blpop-sem:sem"
	seeded, err := rdb.SetNX(ctx, list+":seeded", "1", 0).Result()
	if err == nil && seeded {
		tokens := make([]any, semLimit)
		for i := range tokens {
			tokens[i] = "token" + strconv.Itoa(i)
		}
		err = rdb.LPush(ctx, list, tokens...).Err()
	}
	if err != nil {
		rdb.Close()
		return nil, err
	}
	return &locker{
		lock: func(ctx context.Context, _ string) (func(context.Context) error, error) {
			tok, err := rdb.BLPop(ctx, opBound, list).Result()
			if err != nil {
				return nil, fmt.Errorf("BLPOP: %w", err)
			}
			return func(ctx context.Context) error { return rdb.LPush(ctx, list, tok[1]).Err() }, nil
		},
		close: func() { rdb.Close() },
	}, nil
}

// openIncrFloor is the raw floor: INCR the key's counter; over semLimit, DECR it
// and sleep benchkit.FloorRetry before trying again; release is DECR. No lease, no
// token, no order.
func openIncrFloor(_ context.Context, e *env, trips *benchkit.RoundTrips) (*locker, error) {
	rdb := e.redis(trips)
	key := e.prefix + "incr-sem:sem"
	return &locker{
		lock: func(ctx context.Context, _ string) (func(context.Context) error, error) {
			for {
				n, err := rdb.Incr(ctx, key).Result()
				if err != nil {
					return nil, err
				}
				if n <= semLimit {
					return func(ctx context.Context) error { return rdb.Decr(ctx, key).Err() }, nil
				}
				if err := rdb.Decr(ctx, key).Err(); err != nil {
					return nil, err
				}
				if err := benchkit.Sleep(ctx, benchkit.FloorRetry); err != nil {
					return nil, err
				}
			}
		},
		close: func() { rdb.Close() },
	}, nil
}
