package main

import (
	"math"
	"strings"
	"testing"
	"time"
)

func TestRateFigures(t *testing.T) {
	u := usage{calls: 4000, usec: 12000, sentCalls: 1000}
	f := rateFigures(1000, 250, 1000, 50*time.Millisecond, u, []float64{10, 30, 20}, []float64{1, 0, 1})
	for name, want := range map[string]float64{
		"latency":           50, // µs per decision
		"Redis server time": 12,
		"round trips":       1,
		"Redis calls":       4,
		"allowed":           0.25,
		"starts per key":    20, // the median turn
		"listpack keys":     1,
	} {
		if got := f[name]; math.Abs(got-want) > 1e-9 {
			t.Errorf("rateFigures()[%q] = %v, want %v", name, got, want)
		}
	}
	if f := rateFigures(10, 10, 10, time.Millisecond, usage{}, nil, nil); len(f) != 5 {
		t.Errorf("rateFigures without a set = %v, want no starts per key or listpack share", f)
	}
}

// TestRateTable checks a rate table's rows end to end: each ratio is taken within a
// cycle and the run reports the median over cycles (a spike in one cycle moves
// neither), the goal reads asynqmutex's ratio to redis_rate, and ÷ best peer divides
// the run's medians by redis_rate's, the only peer.
func TestRateTable(t *testing.T) {
	cycle := func(our, peer, floor float64) figures {
		return withRatios(figures{
			ours:            {"Redis server time": our},
			redisRateColumn: {"Redis server time": peer},
			rateFloorColumn: {"Redis server time": floor},
		}, []string{"Redis server time"}, []string{redisRateColumn, rateFloorColumn})
	}
	// Ratios to redis_rate 1.1, 1.5, 4 (a spike); to the floor 5.5, 6, 16.
	run := medianOfCycles([]figures{cycle(11, 10, 2), cycle(12, 8, 2), cycle(40, 10, 2.5)})
	var ms []metric
	for _, m := range rateMetrics {
		if strings.HasPrefix(m.name, "Redis server time") {
			ms = append(ms, m)
		}
	}
	s := scenario{name: "s", group: rateGroup, metrics: ms}
	var out strings.Builder
	printGroup(&out, rateGroup, []scenario{s}, [][]figures{{run}})
	for _, want := range []string{
		"| scenario | figure | asynqmutex | redis_rate | INCR floor | ÷ best peer | goal | result |",
		"|---|---|--:|--:|--:|--:|---|---|",
		"| s | Redis server time (µs/op) | 12.0 | 10.0 | 2.00 | 1.20× |  |  |",
		"| s | Redis server time ÷ redis_rate (×) | 1.50 | 1.00 | 0.25 | 1.50× | ≤ 1.2 | FAIL |",
		"| s | Redis server time ÷ INCR floor (×) | 6.00 | 4.00 | 1.00 | 1.50× |  |  |",
	} {
		if !strings.Contains(out.String(), want+"\n") {
			t.Errorf("printGroup lacks the row\n%s\nin\n%s", want, out.String())
		}
	}
}
