package ratelimit_test

import (
	"context"
	"testing"
	"time"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
	"github.com/asynqmutex/asynqmutex/ratelimit"
)

// TestFleetPause: 4 worker processes take starts of two keys with Wait for six
// times Per; after two Per the parent pauses one of them for two Per (100
// intervals). No Wait called after the pause began may begin before it ends, on any
// process; the paused key takes up its rate again after the pause; and the
// other key keeps its rate all along, the pause included (checkSaturated: judged on
// the limiter's decisions, which a stalled worker does not disturb; the pause lasts
// long enough for that check to see a full Per of them). No start is set for a moment
// inside the pause either: those reserved before it are taken again after it when
// they fall due. The live control: the pause checker, run on the key that was not
// paused, must find starts called and begun inside the pause.
func TestFleetPause(t *testing.T) {
	t.Parallel()
	lim := ratelimit.Rate{N: 50, Per: time.Second}
	iv := interval(lim)
	paused := keySpec{Name: "pause:p", Limit: lim, Goroutines: 2, Calls: true}
	other := keySpec{Name: "pause:q", Limit: lim, Goroutines: 2, Calls: true}
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

	v, err := checkPause(res.Starts[paused.Name], p)
	lastInside := time.Duration(0)
	for _, s := range v.Inside {
		lastInside = max(lastInside, time.Duration(s.Begin-p.After)*time.Microsecond)
	}
	t.Logf("%s, paused: %d starts; called after the pause began and begun inside it: %d; set inside it: %d; begun inside it (set before it): %d, the last %v after the pause returned",
		paused.Name, len(res.Starts[paused.Name]), len(v.Late), len(v.Set), len(v.Inside), lastInside.Round(100*time.Microsecond))
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
	cv, cerr := checkPause(res.Starts[other.Name], p)
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

// TestPauseHoldsWaitsAlreadySleeping: a 429 pause must stop every worker of the
// key, those already sleeping until a start they reserved before it included: a
// Wait confirms its start when it is due, and takes another after the pause if one
// began meanwhile. (Without the check, such a Wait began about one interval into a
// pause of ten, and TestFleetPause saw up to 8 of them in the fleet.)
func TestPauseHoldsWaitsAlreadySleeping(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	l := ratelimit.New(redistest.Start(t).Client(t))
	lim := ratelimit.PerSecond(10)
	iv, key := interval(lim), "gap:pause"
	if r, err := l.Allow(ctx, key, lim); err != nil || !r.Allowed {
		t.Fatalf("Allow = %+v, %v", r, err)
	}
	woke := make(chan error, 1)
	var began time.Time
	go func() {
		err := l.Wait(ctx, key, lim) // reserves the next slot, an interval from now
		began = time.Now()
		woke <- err
	}()
	// Pause once the Wait has reserved, well before its slot comes.
	for i := 0; ; i++ {
		st, err := l.Inspect(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		if st.Starts == 2 {
			break
		}
		if i == 100 {
			t.Fatalf("the Wait reserved nothing: %+v", st)
		}
		time.Sleep(iv / 100)
	}
	paused := time.Now()
	d := 10 * iv
	if _, err := l.Pause(ctx, key, lim, d); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-woke:
		if err != nil {
			t.Fatalf("Wait: %v", err)
		}
	case <-time.After(2 * d):
		t.Fatalf("Wait still sleeping %v after a pause of %v", 2*d, d)
	}
	if into := began.Sub(paused); into < d {
		t.Errorf("a Wait that reserved before Pause(%v) began %v into the pause; want no start before it ends", d, into.Round(time.Millisecond))
	}
}
