package ratelimit_test

import (
	"context"
	"testing"
	"time"

	"github.com/asynqmutex/asynqmutex/ratelimit"
)

// TestFleetPause: 4 worker processes take starts of two keys with Wait; after one
// Per the parent pauses one of them for 20 intervals. No Wait called after the pause
// began may begin before it ends, on any process; at most one start per Wait loop
// (one reserved before the pause) may begin inside it; the paused key takes up its
// rate again after the pause; and the other key keeps its rate all along, the pause
// included. The live control: the pause checker, run on the key that was not paused,
// must find starts called and begun inside the pause.
func TestFleetPause(t *testing.T) {
	t.Parallel()
	lim := ratelimit.Limit{N: 50, Per: time.Second}
	iv := interval(lim)
	paused := keySpec{Name: "pause:p", Limit: lim, Goroutines: 2, Calls: true}
	other := keySpec{Name: "pause:q", Limit: lim, Goroutines: 2, Calls: true}
	loops := fleetWorkers * paused.Goroutines
	run, d := 3*lim.Per, 20*iv
	f := newFleet(t)
	l := ratelimit.New(f.RateRDB)
	var p pauseRecord
	res := f.run(t, fleetConfig{
		Workers: fleetWorkers, Keys: []keySpec{paused, other}, Run: run,
		During: func(int64) {
			time.Sleep(lim.Per)
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
	after := time.Duration(res.GoAt+micros(run)-p.end()) * time.Microsecond
	if rate, err := checkThroughput(res.begins(paused.Name), lim, p.end(), after); err != nil {
		t.Errorf("%s after the pause: %v", paused.Name, err)
	} else {
		t.Logf("%s after the pause: %.2f per %v over %v", paused.Name, rate, lim.Per, after.Round(time.Millisecond))
	}

	for _, ks := range []keySpec{paused, other} {
		v, err := checkWindows(res.Starts[ks.Name], lim)
		t.Logf("%s: most in a window of %v: %s", ks.Name, lim.Per, v.String(lim))
		if err != nil {
			t.Errorf("%s: windows: %v; the window:%s", ks.Name, err, describeWindow(res.Starts[ks.Name], lim.Per))
		}
	}
	rate, err := checkThroughput(res.begins(other.Name), lim, res.GoAt, run)
	t.Logf("%s, not paused: %.2f per %v over the run", other.Name, rate, lim.Per)
	if err != nil {
		t.Errorf("%s over the run: %v", other.Name, err)
	}
	rate, err = checkThroughput(res.begins(other.Name), lim, p.After, d)
	t.Logf("%s, not paused: %.2f per %v during the pause", other.Name, rate, lim.Per)
	if err != nil {
		t.Errorf("%s during the pause: %v", other.Name, err)
	}

	// The control: the other key was never paused, so the checker must find its
	// starts called and begun inside the pause.
	cv, cerr := checkPause(res.Starts[other.Name], p, loops)
	t.Logf("control, the pause checker on %s: %d called and begun inside the pause: %v", other.Name, len(cv.Late), cerr)
	if cerr == nil {
		t.Errorf("the pause checker passed %s, which was not paused", other.Name)
	}
}
