package main

import (
	"math"
	"testing"
	"time"
)

func TestInversions(t *testing.T) {
	for _, tc := range []struct {
		starts []int
		want   int
	}{
		{nil, 0},
		{[]int{0, 1, 2, 3}, 0},
		{[]int{1, 0, 2, 3}, 1},
		{[]int{3, 2, 1, 0}, 6},
		{[]int{0, 3, 1, 2}, 2},
	} {
		if got := inversions(tc.starts); got != tc.want {
			t.Errorf("inversions(%v) = %d, want %d", tc.starts, got, tc.want)
		}
	}
}

func TestGaps(t *testing.T) {
	t0 := time.Unix(0, 0)
	at := func(ms float64) time.Time { return t0.Add(time.Duration(ms * float64(time.Millisecond))) }
	spans := [][2]time.Time{{at(0), at(5)}, {at(5.5), at(10.5)}, {at(10), at(15)}}
	got := gaps(spans)
	want := []time.Duration{500 * time.Microsecond, -500 * time.Microsecond}
	if len(got) != len(want) || got[0] != want[0] || got[1] != want[1] {
		t.Errorf("gaps = %v, want %v", got, want)
	}
}

// TestOrderFigures checks the arithmetic of the ordered-task rows: two batches of
// 4 tasks of 5 ms, drained in 25 and 23 ms (ideal 20 ms each).
func TestOrderFigures(t *testing.T) {
	tot := orderTotals{batches: 2, tasks: 8, done: 8,
		elapsed: 42 * time.Millisecond, drain: 48 * time.Millisecond, firstStart: 2 * time.Millisecond,
		enqueue: 800 * time.Microsecond, inversions: 1, handlers: 41 * time.Millisecond,
		gaps:      []time.Duration{100 * time.Microsecond, 200 * time.Microsecond, 300 * time.Microsecond, 1000 * time.Microsecond, 400 * time.Microsecond, 500 * time.Microsecond},
		outOfTurn: 3}
	run := usage{usec: 800, calls: 240, redisCPU: 1600 * time.Microsecond, goCPU: 2400 * time.Microsecond}
	enq := usage{usec: 160}
	f := orderFigures(tot, run, enq, 5*time.Millisecond)
	for name, want := range map[string]float64{
		"throughput":                6 / 0.042, // the first call of each batch starts its clock
		"Redis server time":         100,
		"Redis calls":               30,
		"Redis CPU":                 200,
		"Go CPU":                    300,
		"enqueue":                   100,
		"enqueue Redis server time": 20,
		"sent back":                 1.5,
		"drain":                     24,
		"drain ÷ nominal":           1.2,
		"first start":               1,
		"inversions":                1,
		"handler mean":              5.125,
		"drain ÷ ideal":             48.0 / 41,
		"gap mean":                  2500.0 / 6,
		"gap p50":                   400,
		"gap p99":                   1000,
	} {
		if got := f[name]; math.Abs(got-want) > 1e-9 {
			t.Errorf("orderFigures()[%q] = %v, want %v", name, got, want)
		}
	}
	if _, ok := orderFigures(tot, run, enq, 0)["drain ÷ ideal"]; ok {
		t.Errorf("orderFigures without work has a drain ÷ ideal; want none")
	}
}
