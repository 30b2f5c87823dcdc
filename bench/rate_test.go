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

// TestRateTable checks a rate table's row end to end: the ratio to the floor is
// taken within each run (withRatios), the ÷ best peer column and the goal compare
// with redis_rate, the only peer, and both are medians of the runs' ratios.
func TestRateTable(t *testing.T) {
	run := func(ours, peer, floor float64) figures {
		return withRatios(figures{
			"asynqmutex":    {"Redis server time": ours, "latency": ours},
			redisRateColumn: {"Redis server time": peer, "latency": peer},
			rateFloorColumn: {"Redis server time": floor, "latency": floor},
		}, []string{"latency", "Redis server time"}, []string{rateFloorColumn})
	}
	// Run ratios to redis_rate 1.1, 1.5, 1.2; to the floor 5.5, 6, 4.8.
	runs := []figures{run(11, 10, 2), run(12, 8, 2), run(12, 10, 2.5)}
	s := scenario{name: "s", group: rateGroup, metrics: []metric{rateMetrics[2], rateMetrics[3]}}
	var out strings.Builder
	printGroup(&out, rateGroup, []scenario{s}, [][]figures{runs})
	for _, want := range []string{
		"| scenario | figure | asynqmutex | redis_rate | INCR floor | ÷ best peer | goal | result |",
		"| s | Redis server time (µs/op) | 12.0 | 10.0 | 2.00 | 1.20× | ≤ 1.2× redis_rate | pass (1.20×) |",
		"| s | Redis server time ÷ INCR floor (×) | 5.50 | 4.00 | 1.00 | 1.20× |  |  |",
	} {
		if !strings.Contains(out.String(), want+"\n") {
			t.Errorf("printGroup lacks the row\n%s\nin\n%s", want, out.String())
		}
	}
}
