package main

import (
	"math"
	"strings"
	"testing"
)

func TestCheckLoopback(t *testing.T) {
	for _, tc := range []struct {
		addr string
		ok   bool
	}{
		{"127.0.0.1:6379", true},
		{"127.1.2.3:6379", true},
		{"localhost:6379", true},
		{"[::1]:6379", true},
		{"10.0.0.1:6379", false},
		{"192.168.1.5:6379", false},
		{"redis:6379", false},
		{"127.0.0.1", false},
	} {
		t.Run(tc.addr, func(t *testing.T) {
			if err := checkLoopback(tc.addr); (err == nil) != tc.ok {
				t.Errorf("checkLoopback(%q) = %v, want ok %v", tc.addr, err, tc.ok)
			}
		})
	}
}

var testGroup = &group{columns: []column{{name: ours}, {name: "a", peer: true}, {name: "b", peer: true}, {name: "ref"}}}

func TestRatio(t *testing.T) {
	// Three runs; within each, asynqmutex against the best peer and against ref.
	runs := []figures{
		{ours: {"t": 20, "f": 0.5}, "a": {"t": 10, "f": 0.9}, "b": {"t": 40}, "ref": {"t": 5}},
		{ours: {"t": 30, "f": 0.3}, "a": {"t": 10}, "b": {"t": 15}, "ref": {"t": 10}},
		{ours: {"t": 90, "f": 0.8}, "a": {"t": 30}, "ref": {"t": 90}},
	}
	for _, tc := range []struct {
		name   string
		m      metric
		ref    string
		want   float64
		wantAg float64 // asynqmutex's aggregate
	}{
		{"lower is better, best peer", metric{name: "t"}, "", 3, 30},                // 20/10, 30/10, 90/30
		{"higher is better, best peer", metric{name: "t", higher: true}, "", 2, 30}, // 20/40, 30/15, 90/30
		{"named reference", metric{name: "t"}, "ref", 3, 30},                        // 4, 3, 1
		{"worst of the runs", metric{name: "f", higher: true, worst: true}, "", 0.3 / 0.9, 0.3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			agg := tc.m.aggregate(runs)
			if got := agg[ours]; math.Abs(got-tc.wantAg) > 1e-9 {
				t.Errorf("aggregate()[ours] = %v, want %v", got, tc.wantAg)
			}
			if got := tc.m.ratio(testGroup, runs, agg, tc.ref); math.Abs(got-tc.want) > 1e-9 {
				t.Errorf("ratio(%q) = %v, want %v", tc.ref, got, tc.want)
			}
		})
	}
}

func TestVerdict(t *testing.T) {
	agg := map[string]float64{ours: 6}
	for _, tc := range []struct {
		g     goal
		ratio float64
		want  string
	}{
		{atMost(7, ""), nan(), "pass"},
		{atMost(5, ""), nan(), "FAIL"},
		{atLeast(0.4, ""), nan(), "pass"},
		{atMost(1.05, "x"), 1.05, "pass (1.05×)"},
		{atMost(1.05, "x"), 1.2, "FAIL (1.20×)"},
		{atLeast(1, "x"), 0.9, "FAIL (0.90×)"},
		{atLeast(1, "x"), nan(), "–"},
	} {
		if got := tc.g.verdict(agg, tc.ratio); got != tc.want {
			t.Errorf("%s verdict(ratio %v) = %q, want %q", tc.g.text(), tc.ratio, got, tc.want)
		}
	}
	if got := atMost(7, "").verdict(map[string]float64{}, nan()); got != "–" {
		t.Errorf("verdict without a figure = %q, want –", got)
	}
}

// TestPrintGroupNoPeers checks that a table without peers has no ÷ best peer, goal
// or result columns, in its header and its rows alike.
func TestPrintGroupNoPeers(t *testing.T) {
	g := &group{title: "## T", columns: []column{{name: "x"}, {name: "y"}}, noPeers: true}
	s := scenario{name: "s", group: g, metrics: []metric{{name: "m", unit: "u"}}}
	var out strings.Builder
	printGroup(&out, g, []scenario{s}, [][]figures{{{"x": {"m": 1}, "y": {"m": 2}}}})
	want := "\n## T\n\n| scenario | figure | x | y |\n|---|---|--:|--:|\n| s | m (u) | 1.00 | 2.00 |\n"
	if got := out.String(); got != want {
		t.Errorf("printGroup =\n%q\nwant\n%q", got, want)
	}
}

func TestWithRatios(t *testing.T) {
	figs := figures{
		"one":   {"t": 10, "n": 2},
		"two":   {"t": 15, "n": 2},
		"floor": {"t": 5},
	}
	got := withRatios(figs, []string{"t", "n"}, []string{"one", "floor"})
	for _, tc := range []struct {
		contender, figure string
		want              float64
	}{
		{"two", "t", 15},
		{"two", "t ÷ one", 1.5},
		{"two", "n ÷ one", 1},
		{"two", "t ÷ floor", 3},
		{"one", "t ÷ one", 1},
		{"floor", "t ÷ one", 0.5},
	} {
		if v := got[tc.contender][tc.figure]; v != tc.want {
			t.Errorf("withRatios()[%q][%q] = %v, want %v", tc.contender, tc.figure, v, tc.want)
		}
	}
	if v := got["two"]["n ÷ floor"]; !math.IsNaN(v) {
		t.Errorf("a ratio to a reference without the figure = %v, want NaN", v)
	}
}
