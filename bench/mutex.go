package main

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex/internal/benchkit"
	"github.com/asynqmutex/asynqmutex/mutex"
)

// The scenarios of package mutex. Each compares the lock with the least Redis work
// that does the same job: SET NX PX + DEL for a lock, DEL + PUBLISH and SET NX for
// a wake-up handoff, a SET NX spin lock for contention. Middleware scenarios go in
// their own files and append to scenarios in an init function.
var scenarios = []scenario{
	{
		name: "uncontended TryLock+Unlock",
		metrics: []metric{
			{name: "latency", unit: "µs/op", goal: "ratio ≤ 1.1", pass: ratioAtMost(1.1)},
			{name: "commands", unit: "cmds/op"},
			{name: "server time", unit: "µs/op"},
		},
		run: uncontended,
	},
	{
		name: "handoff to a blocked waiter",
		metrics: []metric{
			{name: "median", unit: "µs", goal: "lock < 1000 µs", pass: lockBelow(1000)},
			{name: "p99", unit: "µs"},
			{name: "waiter attempts", unit: "per handoff"},
		},
		run: handoff,
	},
	{
		name:    "8 goroutines × 1 key, 1 Client",
		metrics: contendedMetrics(false),
		run:     contendedRun(1, 1),
	},
	{
		name:    "8 goroutines × 1 key, 8 Clients",
		metrics: contendedMetrics(false),
		run:     contendedRun(1, 8),
	},
	{
		name:    "8 goroutines × 1000 keys, 1 Client",
		metrics: contendedMetrics(true),
		run:     contendedRun(1000, 1),
	},
}

const (
	lockTTL = 30 * time.Second

	// opBound bounds every Redis call and every wait of a scenario, so a lost
	// wake-up or a dead server ends the program with an error instead of hanging it.
	opBound = 30 * time.Second

	// hubLinger exceeds how long a mutex.Client keeps its subscription connection
	// after the last waiter left; waiting it out before closing the connection pool
	// keeps go-redis from logging a connection broken under a read.
	hubLinger = 300 * time.Millisecond
)

func contendedRun(keys, clients int) func(context.Context, *env, time.Duration) (map[string]figure, error) {
	return func(ctx context.Context, e *env, d time.Duration) (map[string]figure, error) {
		return contended(ctx, e, d, keys, clients)
	}
}

func contendedMetrics(rateGoal bool) []metric {
	rate := metric{name: "throughput", unit: "acq/s", higher: true}
	cmds := metric{name: "commands", unit: "cmds/acq", goal: "lock ≤ 3", pass: lockAtMost(3)}
	if rateGoal {
		rate.goal, rate.pass = "ratio ≤ 1.1", ratioAtMost(1.1)
		cmds.goal, cmds.pass = "", nil
	}
	return []metric{rate, cmds, {name: "failed attempts", unit: "per acq"}}
}

// token is a random lock token for the floor, like the lock's own.
func token() string {
	return strconv.FormatUint(rand.Uint64(), 36) + strconv.FormatUint(rand.Uint64(), 36)
}

// uncontended: one goroutine takes and releases a free key, again and again.
func uncontended(ctx context.Context, e *env, d time.Duration) (map[string]figure, error) {
	frdb, lrdb := e.redis(), e.redis()
	defer frdb.Close()
	defer lrdb.Close()
	locks := mutex.New(lrdb, mutex.Prefix(e.prefix))
	fkey, lkey := e.prefix+"floor:uncontended", "uncontended"
	floor := &latencySide{stats: e.stats, cmds: benchkit.FloorCommands, op: func(ctx context.Context) error {
		ok, err := benchkit.SetNX(ctx, frdb, fkey, token(), lockTTL)
		if err == nil && !ok {
			err = fmt.Errorf("SET NX %s: not set", fkey)
		}
		if err != nil {
			return err
		}
		return frdb.Del(ctx, fkey).Err()
	}}
	lock := &latencySide{stats: e.stats, cmds: benchkit.LockCommands, op: func(ctx context.Context) error {
		l, err := locks.TryLock(ctx, lkey, lockTTL)
		if err != nil {
			return err
		}
		return l.Unlock(ctx)
	}}
	// Warm both pools and load the scripts outside the measurement.
	for _, s := range []*latencySide{floor, lock} {
		if err := s.op(ctx); err != nil {
			return nil, err
		}
	}
	return interleave(ctx, d, floor, lock)
}

// latencySide runs op back to back.
type latencySide struct {
	stats *redis.Client
	cmds  []string
	op    func(context.Context) error

	ops     int64
	elapsed time.Duration
	server  benchkit.CmdStats
}

func (s *latencySide) run(ctx context.Context, deadline time.Time) error {
	before, err := benchkit.CommandStats(ctx, s.stats, s.cmds)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithDeadline(ctx, deadline.Add(opBound))
	defer cancel()
	start := time.Now()
	n := int64(0)
	for ; time.Now().Before(deadline); n++ {
		if err := s.op(ctx); err != nil {
			return err
		}
	}
	s.elapsed += time.Since(start)
	s.ops += n
	after, err := benchkit.CommandStats(ctx, s.stats, s.cmds)
	if err != nil {
		return err
	}
	d := after.Sub(before)
	s.server.Calls += d.Calls
	s.server.Usec += d.Usec
	return nil
}

func (s *latencySide) figures() map[string]float64 {
	n := float64(s.ops)
	return map[string]float64{
		"latency":     float64(s.elapsed.Microseconds()) / n,
		"commands":    float64(s.server.Calls) / n,
		"server time": float64(s.server.Usec) / n,
	}
}

// handoff: a holder releases while a waiter is blocked on the key; the figure is the
// time from just before the release to the waiter holding the lock.
func handoff(ctx context.Context, e *env, d time.Duration) (map[string]figure, error) {
	floor, err := newFloorHandoff(ctx, e)
	if err != nil {
		return nil, err
	}
	defer floor.close()
	lock, err := newLockHandoff(ctx, e)
	if err != nil {
		return nil, err
	}
	defer lock.close()
	return interleave(ctx, d, floor, lock)
}

type samples []time.Duration

func (s samples) figures() map[string]float64 {
	if len(s) == 0 {
		return map[string]float64{"median": nan(), "p99": nan(), "waiter attempts": nan()}
	}
	p50, p99 := benchkit.Percentiles(s)
	us := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 }
	return map[string]float64{"median": us(p50), "p99": us(p99), "waiter attempts": 1}
}

// floorHandoff: the holder sends DEL and PUBLISH in one round trip; the waiter,
// subscribed all along, takes the key with SET NX when the message arrives.
type floorHandoff struct {
	holder, waiter *redis.Client
	key            string
	ps             *redis.PubSub
	got            chan handed
	done           chan struct{}
	samples
}

// handed is when a waiter got the key, or why it did not.
type handed struct {
	at  time.Time
	err error
}

func newFloorHandoff(ctx context.Context, e *env) (*floorHandoff, error) {
	h := &floorHandoff{holder: e.redis(), waiter: e.redis(), key: e.prefix + "floor:handoff",
		got: make(chan handed, 1), done: make(chan struct{})}
	h.ps = h.waiter.Subscribe(ctx, h.key)
	if _, err := h.ps.Receive(ctx); err != nil { // the subscription's confirmation
		h.ps.Close()
		h.holder.Close()
		h.waiter.Close()
		return nil, err
	}
	go func() {
		defer close(h.done)
		defer h.ps.Close()
		for {
			m, err := h.ps.ReceiveMessage(context.Background())
			if err != nil || m.Payload == "stop" {
				return
			}
			wctx, cancel := context.WithTimeout(context.Background(), opBound)
			ok, err := benchkit.SetNX(wctx, h.waiter, h.key, "waiter", lockTTL)
			cancel()
			if err == nil && !ok {
				err = errors.New("floor waiter: SET NX after the release: not set")
			}
			h.got <- handed{time.Now(), err}
		}
	}()
	return h, nil
}

func (h *floorHandoff) run(ctx context.Context, deadline time.Time) error {
	for time.Now().Before(deadline) {
		if err := h.holder.Set(ctx, h.key, "holder", lockTTL).Err(); err != nil {
			return err
		}
		t0 := time.Now()
		if _, err := h.holder.Pipelined(ctx, func(p redis.Pipeliner) error {
			p.Del(ctx, h.key)
			p.Publish(ctx, h.key, "")
			return nil
		}); err != nil {
			return err
		}
		select {
		case a := <-h.got:
			if a.err != nil {
				return a.err
			}
			h.samples = append(h.samples, a.at.Sub(t0))
		case <-time.After(opBound):
			return errors.New("floor handoff: no wake-up")
		}
	}
	return nil
}

func (h *floorHandoff) close() {
	// "stop" ends the reader, which closes the subscription itself: closing it
	// under a blocked read would make go-redis log a broken connection.
	ctx, cancel := context.WithTimeout(context.Background(), opBound)
	defer cancel()
	if h.holder.Publish(ctx, h.key, "stop").Err() == nil {
		<-h.done
	}
	h.holder.Close()
	h.waiter.Close()
}

// lockHandoff: two Clients, as two processes, take turns. The waiter calls Lock
// while the other holds the key; once it is blocked, the holder unlocks.
type lockHandoff struct {
	rdbs    [2]*redis.Client
	clients [2]*mutex.Client
	hooks   [2]*benchkit.AttemptCounter
	stats   *redis.Client
	prefix  string
	key     string
	rkey    string // the key's Redis key: prefix + "{" + key + "}"
	held    *mutex.Lock
	turn    int
	samples
	attempts int64 // of the waiters, over all handoffs
}

func (h *lockHandoff) figures() map[string]float64 {
	f := h.samples.figures()
	f["waiter attempts"] = float64(h.attempts) / float64(len(h.samples))
	return f
}

func newLockHandoff(ctx context.Context, e *env) (*lockHandoff, error) {
	h := &lockHandoff{stats: e.stats, prefix: e.prefix, key: "handoff", rkey: e.prefix + "{handoff}"}
	for i := range h.clients {
		h.hooks[i] = new(benchkit.AttemptCounter)
		h.rdbs[i] = e.redis(h.hooks[i])
		h.clients[i] = mutex.New(h.rdbs[i], mutex.Prefix(e.prefix))
	}
	l, err := h.clients[0].TryLock(ctx, h.key, lockTTL)
	if err != nil {
		h.close()
		return nil, err
	}
	h.held = l
	return h, nil
}

func (h *lockHandoff) run(ctx context.Context, deadline time.Time) error {
	type acquired struct {
		l *mutex.Lock
		handed
	}
	for time.Now().Before(deadline) {
		w := 1 - h.turn // the waiter's Client; h.turn's holds the lock
		before := h.hooks[w].Attempts.Load()
		got := make(chan acquired, 1)
		wctx, cancel := context.WithTimeout(ctx, opBound)
		go func() {
			l, err := h.clients[w].Lock(wctx, h.key, lockTTL)
			got <- acquired{l, handed{time.Now(), err}}
		}()
		err := benchkit.WaitBlocked(ctx, h.hooks[w], before, h.stats, h.prefix, h.rkey)
		if err == nil {
			t0 := time.Now()
			err = h.held.Unlock(ctx)
			a := <-got
			if err == nil {
				err = a.err
			}
			if err == nil {
				h.samples = append(h.samples, a.at.Sub(t0))
				h.attempts += h.hooks[w].Attempts.Load() - before
				h.held, h.turn = a.l, w
			}
		}
		cancel()
		if err != nil {
			return err
		}
	}
	return nil
}

func (h *lockHandoff) close() {
	ctx, cancel := context.WithTimeout(context.Background(), opBound)
	defer cancel()
	_ = h.held.Unlock(ctx)
	time.Sleep(hubLinger)
	for _, rdb := range h.rdbs {
		if rdb != nil {
			rdb.Close()
		}
	}
}

// contended: 8 goroutines take and release a key chosen at random among keys, using
// clients Clients between them; the floor is a SET NX spin lock that sleeps
// benchkit.FloorRetry after "not set".
func contended(ctx context.Context, e *env, d time.Duration, keys, clients int) (map[string]figure, error) {
	const workers = 8
	frdb := e.redis()
	defer frdb.Close()
	var floorFailed atomic.Int64
	floor := &contendedSide{stats: e.stats, cmds: benchkit.FloorCommands, workers: workers, failed: &floorFailed,
		acquire: func(ctx context.Context, _ int) error {
			key := e.prefix + "floor:contended:" + strconv.Itoa(rand.N(keys))
			return benchkit.SpinLock(ctx, frdb, key, token(), lockTTL, &floorFailed)
		}}

	hook := new(benchkit.AttemptCounter)
	rdbs := make([]*redis.Client, clients)
	cs := make([]*mutex.Client, clients)
	for i := range cs {
		rdbs[i] = e.redis(hook)
		cs[i] = mutex.New(rdbs[i], mutex.Prefix(e.prefix))
	}
	defer func() {
		time.Sleep(hubLinger)
		for _, rdb := range rdbs {
			rdb.Close()
		}
	}()
	lock := &contendedSide{stats: e.stats, cmds: benchkit.LockCommands, workers: workers, failed: &hook.Failed,
		acquire: func(ctx context.Context, w int) error {
			l, err := cs[w%clients].Lock(ctx, "contended:"+strconv.Itoa(rand.N(keys)), lockTTL)
			if err != nil {
				return err
			}
			return l.Unlock(ctx)
		}}
	// Warm both pools (every connection a worker will use) and load the scripts.
	for _, s := range []*contendedSide{floor, lock} {
		if err := s.run(ctx, time.Now().Add(50*time.Millisecond)); err != nil {
			return nil, err
		}
		s.reset()
	}
	return interleave(ctx, d, floor, lock)
}

// contendedSide runs acquire on workers goroutines until the deadline.
type contendedSide struct {
	stats   *redis.Client
	cmds    []string
	workers int
	acquire func(ctx context.Context, worker int) error
	failed  *atomic.Int64 // failed attempts, counted by acquire or by a hook

	acqs    int64
	fails   int64
	elapsed time.Duration
	server  benchkit.CmdStats
}

func (s *contendedSide) reset() {
	s.acqs, s.fails, s.elapsed, s.server = 0, 0, 0, benchkit.CmdStats{}
}

// run counts over the steady state only: the first tenth of the time, when the
// Clients dial and subscribe, is a warm-up whose one-off commands would otherwise
// be spread over the acquisitions and depend on the run's length.
func (s *contendedSide) run(ctx context.Context, deadline time.Time) error {
	ctx, cancel := context.WithDeadline(ctx, deadline.Add(opBound))
	defer cancel()
	var acqs atomic.Int64
	start := time.Now()
	warm := start.Add(time.Until(deadline) / 10)
	wait := benchkit.StartWorkers(s.workers, func() bool { return time.Now().Before(deadline) }, func(w int) error {
		err := s.acquire(ctx, w)
		if err == nil {
			acqs.Add(1)
		}
		return err
	})
	time.Sleep(time.Until(warm))
	measured := time.Now()
	before, err := benchkit.CommandStats(ctx, s.stats, s.cmds)
	acqsBefore, failedBefore := acqs.Load(), s.failed.Load()
	first := wait()
	if err != nil {
		return err
	}
	s.elapsed += time.Since(measured)
	if first != nil {
		return first
	}
	after, err := benchkit.CommandStats(ctx, s.stats, s.cmds)
	if err != nil {
		return err
	}
	s.acqs += acqs.Load() - acqsBefore
	s.fails += s.failed.Load() - failedBefore
	s.server.Calls += after.Sub(before).Calls
	return nil
}

func (s *contendedSide) figures() map[string]float64 {
	n := float64(s.acqs)
	return map[string]float64{
		"throughput":      n / s.elapsed.Seconds(),
		"commands":        float64(s.server.Calls) / n,
		"failed attempts": float64(s.fails) / n,
	}
}
