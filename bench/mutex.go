package main

import (
	"context"
	"errors"
	"math"
	"math/rand/v2"
	"slices"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex/internal/benchkit"
)

// The lock scenarios (issue 7's table). Each runs every contender that applies, in
// turn; middleware scenarios go in their own files and append to scenarios in an init
// function.
var scenarios = []scenario{
	{
		name:  "uncontended lock+unlock",
		group: lockGroup,
		metrics: []metric{
			{name: "latency", unit: "µs/op", goals: []goal{atMost(1.05, "redislock 1ms")}},
			{name: "Redis calls", unit: "per op", goals: []goal{atMost(7, "")}},
			{name: "Redis server time", unit: "µs/op"},
		},
		run: func(ctx context.Context, e *env) (figures, error) {
			return runContenders(ctx, e, []string{"uncontended"}, false, false, opsSides(1))
		},
	},
	{
		name:  "8 goroutines × 1,000 keys",
		group: lockGroup,
		metrics: []metric{
			{name: "throughput", unit: "ops/s", higher: true, goals: []goal{atLeast(1, "redislock 1ms")}},
			{name: "Redis calls", unit: "per op"},
		},
		run: func(ctx context.Context, e *env) (figures, error) {
			keys := make([]string, 1000)
			for i := range keys {
				keys[i] = "k:" + strconv.Itoa(i)
			}
			return runContenders(ctx, e, keys, true, false, opsSides(8))
		},
	},
	hotKey(8),
	hotKey(32),
	{
		name:  "handoff to one blocked waiter",
		group: lockGroup,
		metrics: []metric{
			{name: "p50", unit: "µs", goals: []goal{atMost(1.3, "BLPOP reference")}},
			{name: "p99", unit: "µs"},
		},
		run: func(ctx context.Context, e *env) (figures, error) {
			return runContenders(ctx, e, []string{"handoff"}, true, false, handoffSides)
		},
	},
}

// sidesFor makes a contender's side of a scenario, and what closes it; a nil side
// leaves the contender out.
type sidesFor func(ctx context.Context, e *env, c contender, keys []string) (side, func(), error)

// timeCycles is how many times a timed scenario cycles through its contenders,
// forwards and backwards: load from elsewhere on a shared machine comes and goes
// within seconds, and short turns spread it over all contenders.
const timeCycles = 5

// runContenders runs one lock scenario: a side per contender (only those that wait,
// if waiting), each warmed up for 50ms, then interleaved. Each side runs for
// e.d/(2 × timeCycles × sides) per turn, so the scenario lasts e.d; with rounds, a
// turn is one round, bounded by e.d, and there is one cycle.
func runContenders(ctx context.Context, e *env, keys []string, waiting, rounds bool, mk sidesFor) (figures, error) {
	var (
		names []string
		sides []side
	)
	for _, c := range contenders {
		if waiting && !c.waits {
			continue
		}
		s, closeSide, err := mk(ctx, e, c, keys)
		if err != nil {
			return nil, err
		}
		if s == nil {
			continue
		}
		defer closeSide()
		names, sides = append(names, c.name), append(sides, s)
	}
	for i, s := range sides {
		if err := s.run(ctx, time.Now().Add(50*time.Millisecond)); err != nil {
			return nil, errors.Join(errors.New(names[i]+": warm-up"), err)
		}
		s.reset()
	}
	if rounds {
		return interleave(ctx, e.d, 1, names, sides)
	}
	return interleave(ctx, e.d/time.Duration(2*timeCycles*len(sides)), timeCycles, names, sides)
}

// opsSides: workers goroutines lock and unlock a key chosen at random among the
// scenario's keys, again and again.
func opsSides(workers int) sidesFor {
	return func(ctx context.Context, e *env, c contender, keys []string) (side, func(), error) {
		l, err := c.open(ctx, e, keys)
		if err != nil {
			return nil, nil, err
		}
		return &opsSide{l: l, keys: keys, workers: workers, m: e.meter(c.sent)}, l.close, nil
	}
}

// opsSide runs lock+unlock of random keys on workers goroutines until the deadline.
type opsSide struct {
	l       *locker
	keys    []string
	workers int
	m       *meter

	ops     int64
	elapsed time.Duration
	usage
}

func (s *opsSide) reset() { s.ops, s.elapsed, s.usage = 0, 0, usage{} }

// run counts over the steady state only: the first tenth of the time, when pools
// dial and subscriptions open, is a warm-up whose one-off commands would otherwise be
// spread over the operations and depend on the run's length. The workers stop
// between the two, so that no operation straddles the meter's start.
func (s *opsSide) run(ctx context.Context, deadline time.Time) error {
	ctx, cancel := context.WithDeadline(ctx, deadline.Add(opBound))
	defer cancel()
	var ops atomic.Int64
	work := func(until time.Time) error {
		return benchkit.StartWorkers(s.workers, func() bool { return time.Now().Before(until) }, func(int) error {
			unlock, err := s.l.lock(ctx, s.keys[rand.N(len(s.keys))])
			if err == nil {
				err = unlock(ctx)
			}
			if err == nil {
				ops.Add(1)
			}
			return err
		})()
	}
	if err := work(time.Now().Add(time.Until(deadline) / 10)); err != nil {
		return err
	}
	if err := s.m.start(ctx); err != nil {
		return err
	}
	ops0, start := ops.Load(), time.Now()
	if err := work(deadline); err != nil {
		return err
	}
	s.elapsed += time.Since(start)
	s.ops += ops.Load() - ops0
	return s.m.stop(ctx, &s.usage)
}

func (s *opsSide) figures() map[string]float64 {
	n := float64(s.ops)
	return map[string]float64{
		"throughput":        n / s.elapsed.Seconds(),
		"latency":           float64(s.elapsed.Microseconds()) * float64(s.workers) / n,
		"Redis calls":       float64(s.calls) / n,
		"Redis server time": float64(s.usec) / n,
		"round trips":       float64(s.sentCalls) / n,
	}
}

// hotKey: workers goroutines of one process lock and unlock one key, in rounds of
// e.round acquisitions; fairness is, per round, the fewest acquisitions any goroutine
// made over the most, and the table shows the worst round.
func hotKey(workers int) scenario {
	return scenario{
		name:  "one hot key, " + strconv.Itoa(workers) + " goroutines",
		group: lockGroup,
		metrics: []metric{
			{name: "throughput", unit: "acq/s", higher: true, goals: []goal{atLeast(1, "redislock 1ms")}},
			{name: "wait p99", unit: "ms", goals: []goal{atMost(2, "BLPOP reference")}},
			{name: "wait p50", unit: "ms"},
			{name: "Redis calls", unit: "per acq", goals: []goal{atMost(7, "")}},
			{name: "fairness, worst round", unit: "fewest/most", higher: true, worst: true, goals: []goal{atLeast(0.4, "")}},
		},
		run: func(ctx context.Context, e *env) (figures, error) {
			return runContenders(ctx, e, []string{"hot"}, true, true,
				func(ctx context.Context, e *env, c contender, keys []string) (side, func(), error) {
					l, err := c.open(ctx, e, keys)
					if err != nil {
						return nil, nil, err
					}
					return &hotKeySide{l: l, key: keys[0], workers: workers, round: e.round, m: e.meter(c.sent)}, l.close, nil
				})
		},
	}
}

// hotKeySide runs one round per turn: workers goroutines take the key until round
// acquisitions are made or the deadline passes.
type hotKeySide struct {
	l       *locker
	key     string
	workers int
	round   int
	m       *meter

	acqs     int64
	elapsed  time.Duration
	waits    []time.Duration // from calling lock to holding the key
	fairness float64         // of the worst round so far; NaN before the first
	usage
}

func (s *hotKeySide) reset() {
	s.acqs, s.elapsed, s.waits, s.fairness, s.usage = 0, 0, nil, nan(), usage{}
}

func (s *hotKeySide) run(ctx context.Context, deadline time.Time) error {
	ctx, cancel := context.WithDeadline(ctx, deadline.Add(opBound))
	defer cancel()
	counts := make([]int, s.workers)
	waits := make([][]time.Duration, s.workers) // each worker appends to its own
	var claimed atomic.Int64
	if err := s.m.start(ctx); err != nil {
		return err
	}
	start := time.Now()
	more := func() bool { return claimed.Add(1) <= int64(s.round) && time.Now().Before(deadline) }
	err := benchkit.StartWorkers(s.workers, more, func(w int) error {
		t0 := time.Now()
		unlock, err := s.l.lock(ctx, s.key)
		if err != nil {
			return err
		}
		waits[w] = append(waits[w], time.Since(t0))
		counts[w]++
		return unlock(ctx)
	})()
	s.elapsed += time.Since(start)
	if err != nil {
		return err
	}
	for w := range waits {
		s.waits = append(s.waits, waits[w]...)
		s.acqs += int64(counts[w])
	}
	if most := slices.Max(counts); most > 0 {
		f := float64(slices.Min(counts)) / float64(most)
		if math.IsNaN(s.fairness) || f < s.fairness { // NaN: the first round
			s.fairness = f
		}
	}
	return s.m.stop(ctx, &s.usage)
}

func (s *hotKeySide) figures() map[string]float64 {
	p50, p99 := benchkit.Percentiles(s.waits)
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1e3 }
	n := float64(s.acqs)
	return map[string]float64{
		"throughput":            n / s.elapsed.Seconds(),
		"wait p99":              ms(p99),
		"wait p50":              ms(p50),
		"Redis calls":           float64(s.calls) / n,
		"fairness, worst round": s.fairness,
	}
}

// handoffSides: two processes take turns on the key; the waiter calls lock while the
// other holds it, and once it is blocked the holder releases. The SET NX floor is
// floorHandoff, which does the same with a subscribed SET NX waiter.
func handoffSides(ctx context.Context, e *env, c contender, keys []string) (side, func(), error) {
	if c.name == "SET NX floor" {
		h, err := newFloorHandoff(ctx, e)
		if err != nil {
			return nil, nil, err
		}
		return h, h.close, nil
	}
	h := &handoffSide{key: keys[0]}
	for i := range h.lockers {
		l, err := c.open(ctx, e, keys)
		if err != nil {
			h.close()
			return nil, nil, err
		}
		h.lockers[i] = l
	}
	unlock, err := h.lockers[0].lock(ctx, h.key)
	if err != nil {
		h.close()
		return nil, nil, err
	}
	h.unlock = unlock
	return h, h.close, nil
}

// samples are handoff times: the time from just before the release to the waiter
// holding the key.
type samples []time.Duration

func (s *samples) reset() { *s = nil }

func (s samples) figures() map[string]float64 {
	p50, p99 := benchkit.Percentiles(s)
	us := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 }
	if len(s) == 0 {
		return map[string]float64{"p50": nan(), "p99": nan()}
	}
	return map[string]float64{"p50": us(p50), "p99": us(p99)}
}

// handoffSide: lockers[turn] holds the key, and unlock releases it.
type handoffSide struct {
	lockers [2]*locker
	key     string
	unlock  func(context.Context) error
	turn    int
	samples
}

// handed is when a waiter got the key, or why it did not.
type handed struct {
	at  time.Time
	err error
}

func (h *handoffSide) run(ctx context.Context, deadline time.Time) error {
	type acquired struct {
		unlock func(context.Context) error
		handed
	}
	for time.Now().Before(deadline) {
		w := 1 - h.turn
		n := h.lockers[w].mark()
		got := make(chan acquired, 1)
		wctx, cancel := context.WithTimeout(ctx, opBound)
		go func() {
			unlock, err := h.lockers[w].lock(wctx, h.key)
			got <- acquired{unlock, handed{time.Now(), err}}
		}()
		err := h.lockers[w].blocked(ctx, h.key, n)
		if err == nil {
			t0 := time.Now()
			err = h.unlock(ctx)
			a := <-got
			if err == nil {
				err = a.err
			}
			if err == nil {
				h.samples = append(h.samples, a.at.Sub(t0))
				h.unlock, h.turn = a.unlock, w
			}
		}
		cancel()
		if err != nil {
			return err
		}
	}
	return nil
}

func (h *handoffSide) close() {
	ctx, cancel := context.WithTimeout(context.Background(), opBound)
	defer cancel()
	if h.unlock != nil {
		_ = h.unlock(ctx)
	}
	for _, l := range h.lockers {
		if l != nil {
			l.close()
		}
	}
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
