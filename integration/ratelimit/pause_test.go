package ratelimit_test

import (
	"context"
	"testing"
	"time"

	"github.com/asynqmutex/asynqmutex/ratelimit"
)

// TestFleetPause: 4 worker processes take starts of two keys with Wait for six
// times Per; after two Per the parent pauses one of them for two Per (100
// intervals). No Wait called after the pause began may begin before it ends, on any
// process; at most one start per Wait loop (one reserved before the pause) may
// begin inside it; the paused key takes up its rate again after the pause; and the
// other key keeps its rate all along, the pause included (checkSaturated: judged on
// the limiter's decisions, which a stalled worker does not disturb; the pause lasts
// long enough for that check to see a full Per of them). The live control: the
// pause checker, run on the key that was not paused, must find starts called and
// begun inside the pause.
func TestFleetPause(t *testing.T) {
	t.Parallel()
	lim := ratelimit.Limit{N: 50, Per: time.Second}
	iv := interval(lim)
	paused := keySpec{Name: "pause:p", Limit: lim, Goroutines: 2, Calls: true}
	other := keySpec{Name: "pause:q", Limit: lim, Goroutines: 2, Calls: true}
	loops := fleetWorkers * paused.Goroutines
	run, d := 6*lim.Per, 100*iv
	f := newFleet(t)
	l := ratelimit.New(f.RateRDB)
	var p pauseRecord
	res := f.run(t, fleetConfig{
		Workers: fleetWorkers, Keys: []keySpec{paused, other}, Run: run,
		During: func(int64) {
			time.Sleep(2 * lim.Per)
			ctx := context.Background()
			var err error
			if p.Before, err = refNow(ctx, f.Ref); err != nil {
				t.Error(err)
				return
			}
			held, err := l.Pause(ctx, paused.Name, lim, d)
			if err != nil || held < d-iv {
				t.Errorf("Pause(%v) = %v, %v; want the key held back about %v", d, held, err, d)
			}
			if p.After, err = refNow(ctx, f.Ref); err != nil {
				t.Error(err)
			}
			p.D = d
		},
	})
	if p.D == 0 {
		t.Fatal("the pause was not made")
	}
	t.Logf("pause of %v (%d intervals of %v); its call took %v on the referee", d, d/iv, iv, time.Duration(p.After-p.Before)*time.Microsecond)

	v, err := checkPause(res.Starts[paused.Name], p, loops)
	lastInside := time.Duration(0)
	for _, s := range v.Inside {
		lastInside = max(lastInside, time.Duration(s.Begin-p.After)*time.Microsecond)
	}
	t.Logf("%s, paused: %d starts; called after the pause began and begun inside it: %d; begun inside it (reserved before it): %d, the last %v after the pause returned (%d loops of at most %v each)",
		paused.Name, len(res.Starts[paused.Name]), len(v.Late), len(v.Inside), lastInside.Round(100*time.Microsecond), loops, iv)
	if err != nil {
		t.Errorf("%s: %v", paused.Name, err)
	}
	// checkSaturated judges gaps between consecutive moments set, so each part it
	// is given must hold every start set between its first and its last: parts are
	// cut by S (rate server clock), from starts chosen on the referee's clock.
	// After the pause: from the earliest start set for a Wait called after it.
	// During it: from the first start of the other key begun in it to the last.
	afterPause := bySet(res.Starts[paused.Name], func(st start) bool { return st.Call > p.After })
	duringPause := bySet(res.Starts[other.Name], func(st start) bool { return st.Begin >= p.After && st.Begin < p.end() })
	saturated := func(what string, starts []start) {
		t.Helper()
		sat, err := checkSaturated(starts, lim)
		t.Logf("%s: %d starts, %.2f per %v while callers waited (%v idle: nobody asked)", what, len(starts), sat.Rate, lim.Per, sat.Idle.Round(time.Millisecond))
		if err != nil {
			t.Errorf("%s: %v", what, err)
		}
	}
	saturated(paused.Name+" after the pause", afterPause)
	saturated(other.Name+" over the run", res.Starts[other.Name])
	saturated(other.Name+" during the pause", duringPause)
	for _, ks := range []keySpec{paused, other} {
		v, err := checkWindows(res.Starts[ks.Name], lim)
		t.Logf("%s: most in a window of %v: %s", ks.Name, lim.Per, v.String(lim))
		if err != nil {
			t.Errorf("%s: windows: %v; the window:%s", ks.Name, err, describeWindow(res.Starts[ks.Name], lim.Per))
		}
	}

	// The control: the other key was never paused, so the checker must find its
	// starts called and begun inside the pause.
	cv, cerr := checkPause(res.Starts[other.Name], p, loops)
	t.Logf("control, the pause checker on %s: %d called and begun inside the pause: %v", other.Name, len(cv.Late), cerr)
	if cerr == nil {
		t.Errorf("the pause checker passed %s, which was not paused", other.Name)
	}
}

// bySet returns the starts whose S lies between the least and the greatest S of the
// starts that match: every start the limiter set in that stretch.
func bySet(starts []start, match func(start) bool) []start {
	lo, hi, any := int64(0), int64(0), false
	for _, st := range starts {
		if match(st) {
			if !any || st.S < lo {
				lo = st.S
			}
			if !any || st.S > hi {
				hi = st.S
			}
			any = true
		}
	}
	var out []start
	for _, st := range starts {
		if any && st.S >= lo && st.S <= hi {
			out = append(out, st)
		}
	}
	return out
}
