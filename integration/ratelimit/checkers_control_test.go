package ratelimit_test

import (
	"slices"
	"testing"
	"time"

	"github.com/asynqmutex/asynqmutex/ratelimit"
)

// at returns starts that began at begins, recorded at once (U 0).
func at(begins []int64) []start {
	out := make([]start, len(begins))
	for i, b := range begins {
		out[i] = start{Begin: b}
	}
	return out
}

// evenly returns n begins spaced every, from from.
func evenly(from int64, n int, every time.Duration) []int64 {
	out := make([]int64, n)
	for i := range out {
		out[i] = from + int64(i)*micros(every)
	}
	return out
}

// TestCheckersTripOnSyntheticHistories: each checker passes a history the limit
// allows and trips on one it does not.
func TestCheckersTripOnSyntheticHistories(t *testing.T) {
	t.Parallel()
	lim := ratelimit.Rate{N: 50, Per: time.Second}
	iv := interval(lim)
	const t0 = 1_000_000_000
	run := 10 * lim.Per
	perfect := evenly(t0, 500, iv)

	t.Run("windows", func(t *testing.T) {
		check := func(name string, starts []start, set, began, recorded int, fails bool) {
			t.Helper()
			v, err := checkWindows(starts, lim)
			if v.Set != set || v.Began != began || v.Recorded != recorded || (err != nil) != fails {
				t.Errorf("%s: set %d, began %d, recorded %d, %v; want %d, %d, %d, failing %v",
					name, v.Set, v.Began, v.Recorded, err, set, began, recorded, fails)
			}
		}
		check("evenly spaced", at(perfect), 50, 50, 50, false)

		// Two starts begin and are recorded an interval less a little late: the
		// lateness beginBound allows, N+1 begun in a window.
		late := at(perfect)
		for _, i := range []int{100, 101} {
			late[i].Begin += micros(iv) - 1
			late[i].LateLo, late[i].LateHi, late[i].LateUp = micros(iv)-1, micros(iv)-1, micros(iv)-1
		}
		check("late below an interval", late, 50, 51, 51, false)

		// Two starts too many, set by the limiter: N+2.
		extra := append(append([]int64{}, perfect...), t0+micros(3*iv/2), t0+micros(5*iv/2))
		slices.Sort(extra)
		check("two extra starts", at(extra), 52, 52, 52, true)

		// A referee that stalled: starts 0-2, set and begun an interval apart, are
		// recorded together just before start 3, each with the record's time U.
		// Recorded, a window holds N+3; certainly, N.
		stalled := at(perfect)
		for i := range 3 {
			stalled[i].Begin = t0 + 3*micros(iv) - 3 + int64(i)
			stalled[i].U = stalled[i].Begin - (t0 + int64(i)*micros(iv))
		}
		check("a stalled referee", stalled, 50, 50, 53, false)

		// A stalled worker: starts 0-2, set an interval apart, begin together just
		// before start 3, late by up to 3 intervals: N+3 begun, not the limiter's.
		stalledWorker := at(perfect)
		for i := range 3 {
			stalledWorker[i].Begin = t0 + 3*micros(iv) - 3 + int64(i)
			stalledWorker[i].LateHi = stalledWorker[i].Begin - (t0 + int64(i)*micros(iv))
			stalledWorker[i].LateLo = stalledWorker[i].LateHi
			stalledWorker[i].LateUp = stalledWorker[i].LateHi
		}
		check("a stalled worker", stalledWorker, 50, 53, 53, false)

		// The same begins, none of them late (the set moments unknown, LateLo wide):
		// N+3 begun that no lateness explains.
		for i := range 3 {
			stalledWorker[i].LateHi, stalledWorker[i].LateUp = 0, micros(iv)-1
		}
		check("bunched begins, none late", stalledWorker, 50, 53, 53, true)

		// The same records without their U or lateness: N+3 set, a violation.
		for i := range 3 {
			stalled[i].U = 0
		}
		check("bunched starts", stalled, 53, 53, 53, true)

		// A fixed window's boundary: N at the end of one second and N at the start of
		// the next, as INCR+EXPIRE allows.
		edge := append(evenly(t0+micros(lim.Per)-micros(lim.Per)/10, 50, iv/10), evenly(t0+micros(lim.Per), 50, iv/10)...)
		check("fixed-window boundary", at(edge), 100, 100, 100, true)
	})

	t.Run("throughput", func(t *testing.T) {
		if rate, err := checkThroughput(perfect, lim, t0, run); err != nil {
			t.Errorf("saturated: %.1f, %v; want no error", rate, err)
		}
		if rate, err := checkThroughput(evenly(t0, 450, run/450), lim, t0, run); err == nil {
			t.Errorf("45 per second passed as %.1f", rate)
		}
		// Saturated but for one idle second in the middle.
		gap := append(evenly(t0, 250, iv), evenly(t0+micros(6*lim.Per), 200, iv)...)
		if rate, err := checkThroughput(gap, lim, t0, run); err == nil {
			t.Errorf("an idle second passed as %.1f", rate)
		}
		// Every start before the run: none counts.
		if rate, err := checkThroughput(perfect, lim, t0+micros(run), run); err == nil {
			t.Errorf("starts outside the run passed as %.1f", rate)
		}
	})

	t.Run("saturation", func(t *testing.T) {
		// set returns starts the limiter set every `every` from t0, each told to
		// wait (Delay > 0) but the first.
		set := func(n int, every time.Duration) []start {
			out := make([]start, n)
			for i := range out {
				out[i] = start{S: t0 + int64(i)*micros(every), Delay: 1000, HasS: true}
			}
			out[0].Delay = 0
			return out
		}
		check := func(name string, starts []start, fails bool) {
			t.Helper()
			sat, err := checkSaturated(starts, lim)
			if (err != nil) != fails {
				t.Errorf("%s: %.2f per %v, %v idle, %v; want failing %v", name, sat.Rate, lim.Per, sat.Idle, err, fails)
			}
		}
		check("saturated", set(500, iv), false)

		// A second nobody asked in: the start after it was answered "now".
		idle := set(500, iv)
		for i := 250; i < len(idle); i++ {
			idle[i].S += micros(lim.Per)
		}
		idle[250].Delay = 0
		if sat, err := checkSaturated(idle, lim); err != nil || sat.Idle != lim.Per || sat.Rate != 50 {
			t.Errorf("an idle second: %.2f per %v, %v idle, %v; want 50, 1s, nil", sat.Rate, lim.Per, sat.Idle, err)
		}
		// The same gap with the start after it told to wait: a slot went unused.
		idle[250].Delay = 1000
		check("a wasted second", idle, true)
		// A limiter 10% slow: every start waits a little longer than the interval.
		check("10% slow", set(500, iv+iv/10), true)
		// Two starts half an interval apart.
		tooClose := set(500, iv)
		tooClose[1].S = t0 + micros(iv)/2
		check("too close", tooClose, true)
		// Every start answered "now", each after a pause: never saturated.
		sparse := set(10, 3*iv)
		for i := range sparse {
			sparse[i].Delay = 0
		}
		check("never saturated", sparse, true)
	})

	t.Run("pause", func(t *testing.T) {
		p := pauseRecord{Before: t0 + 1000, After: t0 + 2000, D: 20 * iv}
		ok := []start{
			{Begin: t0 + 500, Call: t0, S: t0 + 400, HasS: true},             // before the pause
			{Begin: t0 + 2500, Call: t0 + 100, S: t0 + 900, HasS: true},      // set before it, its Wait returned late
			{Begin: p.end(), Call: t0 + 3000, S: p.end(), HasS: true},        // called during it, begins at its end
			{Begin: p.end() + 1, Call: t0 + 100, S: p.end() + 1, HasS: true}, // reserved before it, taken again after it
		}
		if v, err := checkPause(ok, p); err != nil {
			t.Errorf("allowed starts: %+v, %v", v, err)
		}
		late := append(ok, start{Begin: p.end() - 1, Call: p.After + 1})
		if v, err := checkPause(late, p); err == nil || len(v.Late) != 1 {
			t.Errorf("a start called in the pause and begun in it: %+v, %v; want one late start", v, err)
		}
		set := append(ok, start{Begin: t0 + 2600, Call: t0 + 100, S: t0 + 2550, HasS: true})
		if v, err := checkPause(set, p); err == nil || len(v.Set) != 1 {
			t.Errorf("a start reserved before the pause and set inside it: %+v, %v; want an error", v, err)
		}
	})
}
