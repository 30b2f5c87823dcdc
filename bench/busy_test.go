package main

import (
	"math"
	"strings"
	"testing"
	"time"
)

var busyT0 = time.Unix(1000, 0)

// at is busyT0 plus ms milliseconds; a negative ms is the zero time (did not happen).
func at(ms float64) time.Time {
	if ms < 0 {
		return time.Time{}
	}
	return busyT0.Add(time.Duration(ms * float64(time.Millisecond)))
}

func times(ms ...float64) []time.Time {
	ts := make([]time.Time, len(ms))
	for i, m := range ms {
		ts[i] = at(m)
	}
	return ts
}

func durations(ms ...float64) []time.Duration {
	ds := make([]time.Duration, len(ms))
	for i, m := range ms {
		ds[i] = time.Duration(m * float64(time.Millisecond))
	}
	return ds
}

func tasksOf(tenants ...string) []busyTask {
	ts := make([]busyTask, len(tenants))
	for i, t := range tenants {
		ts[i] = busyTask{tenant: t}
	}
	return ts
}

func checkFigures(t *testing.T, fn string, got map[string]float64, want map[string]float64) {
	t.Helper()
	for name, w := range want {
		g, ok := got[name]
		switch {
		case !ok:
			t.Errorf("%s has no %q; want %v", fn, name, w)
		case math.IsNaN(w) && !math.IsNaN(g), math.IsInf(w, 1) && !math.IsInf(g, 1):
			t.Errorf("%s[%q] = %v, want %v", fn, name, g, w)
		case !math.IsNaN(w) && !math.IsInf(w, 0) && math.Abs(g-w) > 1e-9:
			t.Errorf("%s[%q] = %v, want %v", fn, name, g, w)
		}
	}
}

func TestGauge(t *testing.T) {
	var g gauge
	g.reset(at(0))
	g.add(1, at(10))  // 1 from 10 ms
	g.add(2, at(20))  // 3 from 20 ms
	g.add(-1, at(15)) // late: counts from 20 ms, so 2 from 20 ms
	g.add(-2, at(40)) // 0 from 40 ms
	area, peak := g.read(at(100))
	// 1 × 10 ms + 2 × 20 ms.
	if want := 0.050; math.Abs(area-want) > 1e-12 || peak != 3 {
		t.Errorf("gauge.read = %v, %d; want %v, 3", area, peak, want)
	}
	g.add(1, at(100))
	if area, _ := g.read(at(200)); math.Abs(area-0.150) > 1e-12 {
		t.Errorf("gauge.read after another 100 ms at 1 = %v, want 0.15", area)
	}
}

// TestBurstFigures: three burst tasks (t0) run one after another 2 and 4 ms apart,
// two other tenants' tasks, one of which did not succeed before the cap.
func TestBurstFigures(t *testing.T) {
	r := busyResult{
		tasks:    tasksOf("t0", "t0", "t0", "t1", "t1", "t2", "t2"),
		work:     20 * time.Millisecond,
		limit:    1,
		enqueued: times(0, 1, 2, 3, 4, 5, 6),
		started:  times(10, 32, 56, 10, 30, 12, 40),
		done:     times(30, 52, 76, 30, 50, 32, -1),
		ran:      durations(20, 20, 20, 20, 20, 26, 0),
		retried:  []int{0, 1, 0, 0, 0, 0, 2},
		failed:   []bool{false, true, false, false, false, false, false},
		served:   at(8), end: at(108),
		waitArea: 0.05, waitPeak: 3,
		calls: 600, sentBack: 7, cap: 90 * time.Second,
	}
	checkFigures(t, "burstFigures()", burstFigures(r), map[string]float64{
		"burst drain":           0.076,
		"burst done":            3,
		"burst tasks":           3,
		"burst drain ÷ ideal":   0.076 / 0.060,
		"burst gap p50":         4, // of 2 and 4 ms
		"others' drain":         math.Inf(1),
		"others done":           3,
		"others tasks":          4,
		"others' drain ÷ ideal": math.Inf(1),
		"handler mean":          21, // the six that succeeded
		"workers waiting":       0.5,
		"workers waiting, peak": 3,
		"Redis calls":           100,
		"sent back":             1,
		"retries spent":         2, // 3, less the handler's own failure
		"cap":                   90,
	})

	// All done, and two slots per key: the burst's ideal halves, its tasks overlap.
	r.done[6], r.ran[6], r.limit = at(60), 20*time.Millisecond, 2
	checkFigures(t, "burstFigures(Limit(2))", burstFigures(r), map[string]float64{
		"burst drain ÷ ideal":   0.076 / 0.030,
		"burst gap p50":         nan(),
		"others' drain":         0.055, // t2: 5 to 60 ms; t1: 3 to 50 ms
		"others' drain ÷ ideal": 0.055 / 0.040,
	})
	// Without the middleware a tenant's tasks may overlap: no gap either.
	r.limit, r.floor = 1, true
	checkFigures(t, "burstFigures(no middleware)", burstFigures(r), map[string]float64{
		"burst drain ÷ ideal": 0.076 / 0.060,
		"burst gap p50":       nan(),
	})
}

func TestBacklogFigures(t *testing.T) {
	r := busyResult{
		tasks:    tasksOf("a", "a", "a", "b", "b", "b"),
		work:     20 * time.Millisecond,
		limit:    1,
		enqueued: times(0, 0, 0, 1, 1, 1),
		started:  times(10, 110, 210, 11, 311, -1),
		done:     times(30, 130, 230, 31, 331, -1),
		ran:      durations(20, 20, 20, 20, 20, 0),
		retried:  make([]int, 6),
		failed:   make([]bool, 6),
		served:   at(5), end: at(1001),
	}
	// b got 2 starts, one after its first, and one task never started: over the
	// time from its enqueue to the end, 1 ms to 1001 ms.
	checkFigures(t, "backlogFigures()", backlogFigures(r), map[string]float64{
		"drain":          math.Inf(1),
		"done":           5,
		"tasks":          6,
		"drain ÷ ideal":  math.Inf(1),
		"starts ÷ limit": 1.0 / backlogRate,
	})
	a := busyResult{tasks: r.tasks[:3], work: r.work, limit: 1, enqueued: r.enqueued[:3],
		started: r.started[:3], done: r.done[:3], ran: r.ran[:3], retried: r.retried[:3], failed: r.failed[:3],
		served: r.served, end: r.end}
	// a: 2 starts after its first in 210 ms from its enqueue.
	checkFigures(t, "backlogFigures(a)", backlogFigures(a), map[string]float64{
		"drain":          0.230,
		"drain ÷ ideal":  0.230 / backlogIdeal.Seconds(),
		"starts ÷ limit": 2 / 0.210 / backlogRate,
	})
}

func TestRetryFigures(t *testing.T) {
	tasks := tasksOf("k0", "k0", "k1", "k1", "k2", "k2", "k3", "k3")
	for i := 0; i < len(tasks); i += 2 {
		tasks[i].fail = true
	}
	r := busyResult{
		tasks:    tasks,
		work:     20 * time.Millisecond,
		limit:    1,
		enqueued: times(0, 0, 0, 0, 0, 0, 0, 0),
		// The failing tasks' first runs started at 10 ms; each succeeded later.
		started: times(10, 110, 10, 230, 10, 320, 10, -1),
		done:    times(100, 130, 200, 250, 300, 340, -1, -1),
		ran:     durations(20, 20, 20, 20, 20, 20, 0, 0),
		// k1's retry met a busy key that spent a retry; k3's first task failed
		// and was not run again before the cap.
		retried: []int{1, 0, 2, 0, 1, 0, 0, 0},
		failed:  []bool{true, false, true, false, true, false, true, false},
		served:  at(5), end: at(1000),
	}
	checkFigures(t, "retryFigures()", retryFigures(r), map[string]float64{
		"next start p50": 20, // of 10, 30 and 20 ms
		"next start p99": 30,
		"drain":          math.Inf(1),
		"done":           6,
		"tasks":          8,
		"retries spent":  1, // k1's second; k3's own failure is not seen yet
	})
	r.done = times(100, 130, 200, 250, 300, 340, -1, -1)
	r.started[3], r.started[5] = time.Time{}, time.Time{}
	r.started[1] = time.Time{}
	checkFigures(t, "retryFigures(no next start)", retryFigures(r), map[string]float64{
		"next start p50": nan(),
		"next start p99": nan(),
	})
}

func TestAgainstFloor(t *testing.T) {
	got := againstFloor(figures{
		"a":          {"d": 2, "x": 5},
		noMiddleware: {"d": 0.5, "x": 1},
	}, []string{"d"}, []string{"x"})
	checkFigures(t, "againstFloor()[a]", got["a"], map[string]float64{
		"d ÷ " + noMiddleware: 4,
		"x − " + noMiddleware: 4,
	})
	checkFigures(t, "againstFloor()[floor]", got[noMiddleware], map[string]float64{
		"d ÷ " + noMiddleware: 1,
		"x − " + noMiddleware: 0,
	})
	alone := againstFloor(figures{"a": {"d": 2, "x": 5}}, []string{"d"}, []string{"x"})
	checkFigures(t, "againstFloor() without a floor", alone["a"], map[string]float64{
		"d ÷ " + noMiddleware: nan(),
		"x − " + noMiddleware: nan(),
	})
}

// TestPrintBusy checks the busy table end to end over two runs: medians, a drain cut
// at the cap, goals marked for every column but the floor, a strict goal, and a
// column that did not run.
func TestPrintBusy(t *testing.T) {
	g := &group{title: "## B", columns: []column{{name: "defaults"}, {name: "MaxWait(10s)"}, {name: "other"}, {name: noMiddleware}}, print: printBusy}
	s := scenario{name: "busy: s", group: g, metrics: []metric{
		{name: "burst drain", unit: "s"},
		{name: "burst drain ÷ ideal", unit: "×", goals: []goal{atMost(1.2, "")}},
		{name: "workers waiting", unit: "average", goals: []goal{below(2)}},
	}}
	run := func(capped, waiting float64) figures {
		return figures{
			"defaults": {"burst drain": math.Inf(1), "burst drain ÷ ideal": math.Inf(1), "burst done": capped, "burst tasks": 300, "cap": 90,
				"workers waiting": waiting},
			"MaxWait(10s)": {"burst drain": 6.6, "burst drain ÷ ideal": 1.1, "workers waiting": 18},
			noMiddleware:   {"burst drain": 0.4, "burst drain ÷ ideal": 0.07, "workers waiting": 0},
		}
	}
	var out strings.Builder
	printGroup(&out, g, []scenario{s}, [][]figures{{run(85, 1), run(87, 3)}})
	want := "\n## B\n\n" +
		"| scenario | figure | defaults | MaxWait(10s) | other | no middleware | goal |\n" +
		"|---|---|--:|--:|--:|--:|---|\n" +
		"| busy: s | burst drain (s) | 86 of 300 after 90s | 6.60 | – | 0.40 |  |\n" +
		"| busy: s | burst drain ÷ ideal (×) | not drained missed | 1.10 met | – | 0.07 | ≤ 1.2 |\n" +
		"| busy: s | workers waiting (average) | 2.00 missed | 18.0 missed | – | 0.00 | < 2 |\n"
	if got := out.String(); got != want {
		t.Errorf("printGroup =\n%s\nwant\n%s", got, want)
	}
}
