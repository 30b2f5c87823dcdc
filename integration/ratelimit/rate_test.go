package ratelimit_test

import (
	"testing"
	"time"

	"github.com/asynqmutex/asynqmutex/ratelimit"
)

// fleetWorkers is how many worker processes hammer the keys.
const fleetWorkers = 4

// rateKeys are the keys of the rate test, hammered at once: the 50 a second,
// and two others with other limits and windows, so that a key that disturbed
// another would show in that key's windows or throughput.
func rateKeys(prefix string) []keySpec {
	return []keySpec{
		{Name: prefix + ":a", Limit: ratelimit.Rate{N: 50, Per: time.Second}, Goroutines: 2},
		{Name: prefix + ":b", Limit: ratelimit.Rate{N: 20, Per: 500 * time.Millisecond}, Goroutines: 1},
		{Name: prefix + ":c", Limit: ratelimit.Rate{N: 3, Per: 100 * time.Millisecond}, Goroutines: 1},
	}
}

// TestFleetRate: 4 worker processes take starts of three keys with Wait for ten
// times the main key's Per. On every key, no window of its Per holds more starts
// than the limiter may set, nor more begins than N + burst (see setBound), and
// the key is used at 95% of its limit or more whenever a caller waits
// (checkSaturated); the rate of begins over the whole run is reported.
func TestFleetRate(t *testing.T) {
	t.Parallel()
	keys := rateKeys("rate")
	run := 10 * keys[0].Limit.Per
	f := newFleet(t)
	res := f.run(t, fleetConfig{Workers: fleetWorkers, Keys: keys, Run: run})
	for _, ks := range keys {
		begins := res.begins(ks.Name)
		v, werr := checkWindows(res.Starts[ks.Name], ks.Limit)
		sat, serr := checkSaturated(res.Starts[ks.Name], ks.Limit)
		rate, _ := checkThroughput(begins, ks.Limit, res.GoAt, run)
		t.Logf("%s (%v, %d loops): %d starts; most in a window of %v: %s; %.2f per %v while callers waited (%v idle: nobody asked), %.2f per %v begun over the %v run",
			ks.Name, ks.Limit, fleetWorkers*ks.Goroutines, len(begins), ks.Limit.Per, v.String(ks.Limit),
			sat.Rate, ks.Limit.Per, sat.Idle.Round(time.Millisecond), rate, ks.Limit.Per, run)
		if werr != nil {
			t.Errorf("%s: windows: %v; the fullest begun window:%s", ks.Name, werr, describeWindow(res.Starts[ks.Name], ks.Limit.Per))
		}
		if serr != nil {
			t.Errorf("%s: throughput: %v", ks.Name, serr)
		}
	}
}

// TestFleetRateControl is the live positive control of the window checker: the same
// fleet, each process limiting on its own at the key's rate (a per-process limiter),
// must be caught starting about 4 times too many.
func TestFleetRateControl(t *testing.T) {
	t.Parallel()
	ks := rateKeys("local")[0]
	f := newFleet(t)
	res := f.run(t, fleetConfig{Workers: fleetWorkers, Mode: modeLocal, Keys: []keySpec{ks}, Run: 2 * ks.Limit.Per})
	v, err := checkWindows(res.Starts[ks.Name], ks.Limit)
	t.Logf("control, per-process limiting at %v: %d starts, most in a window of %v: %s: %v",
		ks.Limit, len(res.Starts[ks.Name]), ks.Limit.Per, v.String(ks.Limit), err)
	if err == nil {
		t.Fatalf("the window checker passed a fleet of %d processes each limiting on its own", fleetWorkers)
	}
}
