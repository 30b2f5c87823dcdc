package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/go-redis/redis_rate/v10"
	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex/internal/benchkit"
	"github.com/asynqmutex/asynqmutex/internal/rediskey"
	"github.com/asynqmutex/asynqmutex/ratelimit"
)

// Rate limits (issue 18): a decision of ratelimit.Limiter.Allow against
// go-redis/redis_rate's Allow and a fixed-window floor, one goroutine each, a turn
// each in every cycle (runRate). A turn is a fixed number of decisions (bounded by -d
// in time too), so that every contender makes as many on keys in the same state.
func init() {
	for _, rc := range rateCases {
		scenarios = append(scenarios, scenario{
			name:    rc.name,
			group:   rateGroup,
			metrics: rateMetrics,
			run: func(ctx context.Context, e *env) (figures, error) {
				return runRate(ctx, e, rc)
			},
		})
	}
}

const (
	redisRateColumn = "redis_rate"
	rateFloorColumn = "INCR floor"
	// rateCycles is how many times a rate scenario cycles through its contenders, a
	// turn each, per run.
	rateCycles = 9
)

// rateCase is a rate scenario: decisions on keys, taken in turn, each key limited
// to perSecond starts a second (per minute when perMinute), with burst 1.
type rateCase struct {
	name      string
	keys      int
	perSecond int
	perMinute bool
	// turn is the number of decisions of a turn; each continues the round-robin over
	// the keys where the last stopped.
	turn int
	// fresh: every turn starts on keys of its own, first given preload starts each
	// (not measured), so that the keys hold a known number of starts.
	fresh   bool
	preload int
	// denied: the scenario's decisions are refused (the key is over its limit).
	denied bool
}

var rateCases = []rateCase{
	{name: "rate: 1,000 keys, allowed", keys: 1000, perSecond: 1000, turn: 2000},
	{name: "rate: 10,000 keys, allowed", keys: 10000, perSecond: 1000, turn: 5000},
	{name: "rate: 100 keys, 60→120 starts each (listpack)", keys: 100, perSecond: 10000, turn: 6000, fresh: true, preload: 60},
	{name: "rate: 100 keys, 130→170 starts each (skiplist)", keys: 100, perSecond: 10000, turn: 4000, fresh: true, preload: 130},
	{name: "rate: one hot key, allowed", keys: 1, perSecond: 100000, turn: 2000},
	{name: "rate: one hot key, denied", keys: 1, perSecond: 1, perMinute: true, turn: 2000, denied: true},
}

// rateMetrics are the rows of every rate scenario. The ratios are taken within each
// cycle (runRate); the ÷ best peer column divides the runs' medians by redis_rate's.
var rateMetrics = []metric{
	{name: "latency", unit: "µs/op"},
	{name: "latency ÷ " + redisRateColumn, unit: "×"},
	{name: "latency ÷ " + rateFloorColumn, unit: "×"},
	{name: "Redis server time", unit: "µs/op"},
	{name: "Redis server time ÷ " + redisRateColumn, unit: "×", goals: []goal{atMost(1.2, "")}},
	{name: "Redis server time ÷ " + rateFloorColumn, unit: "×"},
	{name: "round trips", unit: "per op", goals: []goal{atMost(1, "")}},
	{name: "Redis calls", unit: "per op"},
	{name: "allowed", unit: "share"},
	{name: "starts per key", unit: "at turn's end"},
	{name: "listpack keys", unit: "share"},
}

// rateGroup is the table of the rate scenarios: asynqmutex, its peer redis_rate, and
// the floor.
var rateGroup = &group{title: "## Rate limits: one decision (Allow)", columns: columnsOf(rateContenders)}

// rateContender is a rate limiter the rate scenarios measure.
type rateContender struct {
	column
	// sent are the commands its client sends itself (see contender.sent).
	sent []string
	ns   string // of its keys, under the run's prefix
	// open makes the limiter of one process, on a connection pool of its own; the
	// caller closes it. ns is a namespace of the run's prefix for its keys.
	open func(e *env, ns string) *rateLimiter
}

// rateLimiter is one process's limiter. allow decides one start of key under rc's
// limit; rkey is the Redis key it keeps key's limit in (for asynqmutex, whose sets
// the scenarios inspect; "" for the others).
type rateLimiter struct {
	allow func(ctx context.Context, key string, rc rateCase) (bool, error)
	rkey  func(key string) string
	trips *benchkit.RoundTrips
	close func()
}

var rateContenders = []rateContender{
	{column: column{name: ours}, sent: benchkit.LockCommands, ns: "rate-ours", open: openOursRate},
	{column: column{name: redisRateColumn, peer: true}, sent: []string{"evalsha", "eval", "script"}, ns: "rate-redis_rate", open: openRedisRate},
	{column: column{name: rateFloorColumn}, sent: []string{"evalsha", "eval", "script"}, ns: "rate-floor", open: openRateFloor},
}

func (rc rateCase) limit() ratelimit.Rate {
	if rc.perMinute {
		return ratelimit.PerMinute(rc.perSecond)
	}
	return ratelimit.PerSecond(rc.perSecond)
}

// window is the limit's interval: a fixed window's length.
func (rc rateCase) window() time.Duration { return rc.limit().Per }

// openOursRate: one ratelimit.Limiter; Allow.
func openOursRate(e *env, ns string) *rateLimiter {
	trips := new(benchkit.RoundTrips)
	rdb := e.redis(trips)
	prefix := e.prefix + ns
	l := ratelimit.New(rdb, ratelimit.Prefix(prefix))
	return &rateLimiter{
		allow: func(ctx context.Context, key string, rc rateCase) (bool, error) {
			r, err := l.Allow(ctx, key, rc.limit())
			return r.Allowed, err
		},
		// layout.go: prefix + "rate:{" + rediskey.Encode(key) + "}".
		rkey:  func(key string) string { return prefix + "rate:{" + rediskey.Encode(key) + "}" },
		trips: trips,
		close: func() { rdb.Close() },
	}
}

// openRedisRate: one redis_rate.Limiter; Allow with Rate, Period and Burst 1.
func openRedisRate(e *env, ns string) *rateLimiter {
	trips := new(benchkit.RoundTrips)
	rdb := e.redis(trips)
	l := redis_rate.NewLimiter(rdb)
	return &rateLimiter{
		allow: func(ctx context.Context, key string, rc rateCase) (bool, error) {
			lim := rc.limit()
			r, err := l.Allow(ctx, e.prefix+ns+key, redis_rate.Limit{Rate: lim.N, Period: lim.Per, Burst: 1})
			if err != nil {
				return false, err
			}
			return r.Allowed > 0, nil
		},
		trips: trips,
		close: func() { rdb.Close() },
	}
}

// rateFloorScript is the floor: a fixed window counted with INCR, which PEXPIREs
// the counter when INCR made it (the window starts at its first decision), in one
// Lua script sent by EVALSHA. It is no fair limit (2n may pass around a window's
// boundary, and a resend counts twice), only the least a decision can cost.
var rateFloorScript = redis.NewScript(`
local n = redis.call('INCR', KEYS[1])
if n == 1 then
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
end
return n`)

func openRateFloor(e *env, ns string) *rateLimiter {
	trips := new(benchkit.RoundTrips)
	rdb := e.redis(trips)
	return &rateLimiter{
		allow: func(ctx context.Context, key string, rc rateCase) (bool, error) {
			n, err := rateFloorScript.Run(ctx, rdb, []string{e.prefix + ns + key}, rc.window().Milliseconds()).Int64()
			return n <= int64(rc.limit().N), err
		},
		trips: trips,
		close: func() { rdb.Close() },
	}
}

// runRate runs one rate scenario: a side per contender, each warmed up by a pass over
// the keys, then rateCycles cycles of a turn each, every cycle starting one contender
// further (so that each takes every place as often and none follows itself). Load
// from elsewhere on a shared machine comes and goes within a turn or two, so each
// figure, and each ratio to redis_rate and to the floor, is taken within a cycle, and
// the run reports its median over the cycles.
func runRate(ctx context.Context, e *env, rc rateCase) (figures, error) {
	names := make([]string, len(rateContenders))
	sides := make([]*rateSide, len(rateContenders))
	for i, c := range rateContenders {
		s := newRateSide(e, c, rc)
		defer s.l.close()
		if err := s.warm(ctx, time.Now().Add(e.d)); err != nil {
			return nil, errors.Join(errors.New(c.name+": warm-up"), err)
		}
		names[i], sides[i] = c.name, s
	}
	var cycles []figures
	for cycle := range rateCycles {
		all := make(figures, len(sides))
		for k := range sides {
			i := (cycle + k) % len(sides)
			if err := sides[i].run(ctx, time.Now().Add(e.d)); err != nil {
				return nil, errors.Join(errors.New(names[i]), err)
			}
		}
		for i, s := range sides {
			all[names[i]] = s.figures()
			s.reset()
		}
		cycles = append(cycles, withRatios(all, []string{"latency", "Redis server time"}, []string{redisRateColumn, rateFloorColumn}))
	}
	return medianOfCycles(cycles), nil
}

// medianOfCycles is, per contender and figure, the median over cycles.
func medianOfCycles(cycles []figures) figures {
	vals := make(map[string]map[string][]float64)
	for _, figs := range cycles {
		for c, f := range figs {
			if vals[c] == nil {
				vals[c] = make(map[string][]float64)
			}
			for name, v := range f {
				vals[c][name] = append(vals[c][name], v)
			}
		}
	}
	out := make(figures, len(vals))
	for c, byFigure := range vals {
		out[c] = make(map[string]float64, len(byFigure))
		for name, vs := range byFigure {
			out[c][name] = median(vs)
		}
	}
	return out
}

// rateSide makes a turn's decisions, one at a time, on one goroutine.
type rateSide struct {
	e  *env
	l  *rateLimiter
	rc rateCase
	m  *meter

	gen  int // turns so far, naming a fresh scenario's keys
	next int // the round-robin's next key

	ops, allowed int64
	elapsed      time.Duration
	trips        int64
	members      []float64 // per turn: asynqmutex's mean starts per key at its end
	listpack     []float64 // per turn: the share of keys kept as a listpack
	usage
}

func newRateSide(e *env, c rateContender, rc rateCase) *rateSide {
	ns := c.ns + ":"
	for i := range rateCases {
		if rateCases[i].name == rc.name {
			ns += strconv.Itoa(i) + ":"
		}
	}
	return &rateSide{e: e, l: c.open(e, ns), rc: rc, m: e.meter(c.sent)}
}

func (s *rateSide) reset() {
	s.ops, s.allowed, s.elapsed, s.trips, s.members, s.listpack, s.usage = 0, 0, 0, 0, nil, nil, usage{}
}

// key is the i-th key of the scenario; a fresh scenario's keys are the turn's own.
func (s *rateSide) key(i int) string {
	if s.rc.fresh {
		return "g" + strconv.Itoa(s.gen) + ":k" + strconv.Itoa(i)
	}
	return "k" + strconv.Itoa(i)
}

// prepare readies the keys of a turn: for a fresh scenario, new keys given their
// preload starts, on 8 goroutines, not measured; for a denied one, its start.
func (s *rateSide) prepare(ctx context.Context, deadline time.Time) error {
	switch {
	case s.rc.fresh:
		s.gen++
		var claimed atomic.Int64
		total := int64(s.rc.keys * s.rc.preload)
		more := func() bool { return claimed.Load() < total && time.Now().Before(deadline) }
		return benchkit.StartWorkers(8, more, func(int) error {
			n := claimed.Add(1) - 1
			if n >= total {
				return nil
			}
			_, err := s.l.allow(ctx, s.key(int(n)%s.rc.keys), s.rc)
			return err
		})()
	case s.rc.denied:
		for i := range s.rc.keys {
			if _, err := s.l.allow(ctx, s.key(i), s.rc); err != nil {
				return err
			}
		}
	}
	return nil
}

// run prepares the turn's keys, then makes the turn's decisions, or as many as come
// before the deadline, measured.
func (s *rateSide) run(ctx context.Context, deadline time.Time) error {
	ctx, cancel := context.WithDeadline(ctx, deadline.Add(opBound))
	defer cancel()
	if err := s.prepare(ctx, deadline.Add(opBound)); err != nil {
		return err
	}
	if err := s.measure(ctx, deadline, nil); err != nil {
		return err
	}
	return s.inspect(ctx)
}

// warm runs a turn of at least one pass over the keys, so that every key has been
// decided on once, and drops its totals.
func (s *rateSide) warm(ctx context.Context, deadline time.Time) error {
	turn := s.rc.turn
	s.rc.turn = max(turn, s.rc.keys)
	err := s.run(ctx, deadline)
	s.rc.turn = turn
	s.reset()
	return err
}

// measure makes the turn's decisions until the deadline, under the meter; zero, when
// set, is called just before the first (the callgrind probe's).
func (s *rateSide) measure(ctx context.Context, deadline time.Time, zero func() error) error {
	if err := s.m.start(ctx); err != nil {
		return err
	}
	if zero != nil {
		if err := zero(); err != nil {
			return err
		}
	}
	trips0, start := s.l.trips.Load(), time.Now()
	var ops, allowed int64
	for ; ops < int64(s.rc.turn) && time.Now().Before(deadline); ops++ {
		ok, err := s.l.allow(ctx, s.key(s.next), s.rc)
		if err != nil {
			return err
		}
		if ok {
			allowed++
		}
		s.next = (s.next + 1) % s.rc.keys
	}
	s.elapsed += time.Since(start)
	s.trips += s.l.trips.Load() - trips0
	s.ops += ops
	s.allowed += allowed
	return s.m.stop(ctx, &s.usage)
}

// inspect records, for asynqmutex, the mean number of starts its keys hold and the
// share kept as a listpack, over up to 100 of them, after the meter has stopped.
func (s *rateSide) inspect(ctx context.Context) error {
	if s.l.rkey == nil {
		return nil
	}
	n := min(s.rc.keys, 100)
	cards := make([]*redis.IntCmd, n)
	encs := make([]*redis.StringCmd, n)
	if _, err := s.e.stats.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i := range n {
			k := s.l.rkey(s.key(i * s.rc.keys / n))
			cards[i] = p.ZCard(ctx, k)
			encs[i] = p.ObjectEncoding(ctx, k)
		}
		return nil
	}); err != nil && !errors.Is(err, redis.Nil) {
		return fmt.Errorf("inspecting the keys: %w", err)
	}
	var sum, lp float64
	for i := range n {
		sum += float64(cards[i].Val())
		if encs[i].Val() == "listpack" {
			lp++
		}
	}
	s.members = append(s.members, sum/float64(n))
	s.listpack = append(s.listpack, lp/float64(n))
	return nil
}

func (s *rateSide) figures() map[string]float64 {
	return rateFigures(s.ops, s.allowed, s.trips, s.elapsed, s.usage, s.members, s.listpack)
}

// rateFigures turns a side's totals into its figures, per decision. members and
// listpack are per turn (nil for a side that keeps no set); their median is taken.
func rateFigures(ops, allowed, trips int64, elapsed time.Duration, u usage, members, listpack []float64) map[string]float64 {
	n := float64(ops)
	f := map[string]float64{
		"latency":           float64(elapsed.Nanoseconds()) / 1e3 / n,
		"Redis server time": float64(u.usec) / n,
		"round trips":       float64(trips) / n,
		"Redis calls":       float64(u.calls) / n,
		"allowed":           float64(allowed) / n,
	}
	if len(members) > 0 {
		f["starts per key"] = median(members)
		f["listpack keys"] = median(listpack)
	}
	return f
}

// probeRate is -callgrind's run: one turn of one contender of one rate scenario on a
// redis-server running under callgrind (process pid), after a warm-up of one pass
// over the keys; the counters are zeroed (callgrind_control -z) just before the
// measured decisions, and the program returns after them, so that the profile the
// server writes when it stops holds those decisions only. It prints the number of
// decisions.
func probeRate(ctx context.Context, e *env, name, contender string, pid int) error {
	var rc *rateCase
	for i := range rateCases {
		if rateCases[i].name == name {
			rc = &rateCases[i]
		}
	}
	var c *rateContender
	for i := range rateContenders {
		if rateContenders[i].name == contender {
			c = &rateContenders[i]
		}
	}
	if rc == nil || c == nil {
		return fmt.Errorf("-callgrind: no rate scenario %q or contender %q", name, contender)
	}
	s := newRateSide(e, *c, *rc)
	defer s.l.close()
	deadline := time.Now().Add(10 * time.Minute)
	if err := s.warm(ctx, deadline); err != nil {
		return err
	}
	if err := s.prepare(ctx, deadline); err != nil {
		return err
	}
	zero := func() error {
		out, err := exec.CommandContext(ctx, "callgrind_control", "-z", strconv.Itoa(pid)).CombinedOutput()
		if err != nil {
			return fmt.Errorf("callgrind_control -z %d: %w: %s", pid, err, out)
		}
		return nil
	}
	if err := s.measure(ctx, deadline, zero); err != nil {
		return err
	}
	if err := s.inspect(ctx); err != nil {
		return err
	}
	f := s.figures()
	fmt.Fprintf(os.Stderr, "%s, %s: %d decisions, %.2f allowed, %.2f round trips, %.2f Redis calls, %.1f starts per key, %.2f listpack\n",
		name, contender, s.ops, f["allowed"], f["round trips"], f["Redis calls"], value(f, "starts per key"), value(f, "listpack keys"))
	fmt.Println(s.ops)
	return nil
}
