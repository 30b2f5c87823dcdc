package ratelimit_test

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
	"github.com/asynqmutex/asynqmutex/ratelimit"
)

// knownGapsEnv, set to 1, runs the tests of gaps found in package ratelimit and not
// yet closed: they fail until it changes, so by default they are skipped.
const knownGapsEnv = "ASYNQMUTEX_RATE_KNOWN_GAPS"

// TestPauseHoldsWaitsAlreadySleeping: Pause's doc says it "lets no start of key
// begin for d from now, on every Limiter that shares the Redis", and the issue asks
// that a 429 pause stop every worker of the key. A Wait that reserved its start
// before the pause sleeps until that start and begins inside the pause: Pause keeps
// starts already taken ("A pause, or starts already taken, that hold the key back
// longer stay"), and Wait does not look again when it wakes. TestFleetPause sees it
// in the fleet: up to one start per Wait loop, up to 8 intervals into the pause. So
// an API that answered 429 is called again during its Retry-After by every task
// that was already waiting for a slot.
func TestPauseHoldsWaitsAlreadySleeping(t *testing.T) {
	if os.Getenv(knownGapsEnv) != "1" {
		t.Skipf("a known gap in package ratelimit (a Wait reserved before a Pause begins inside it); %s=1 runs it", knownGapsEnv)
	}
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

// TestLostReplyCancelAndResumeReportTheTruth: Cancel and Resume are sent again by
// go-redis when their reply is lost, like every call. Their first run gives the
// start back, or ends the pause; the second finds nothing to do and answers false,
// which the caller gets: "left the start taken" and "had no pause", both untrue.
// (take.lua remembers its calls for this; cancel.lua and resume.lua do not.)
func TestLostReplyCancelAndResumeReportTheTruth(t *testing.T) {
	if os.Getenv(knownGapsEnv) != "1" {
		t.Skipf("a known gap in package ratelimit (Cancel and Resume answer false after a lost reply); %s=1 runs it", knownGapsEnv)
	}
	t.Parallel()
	r := newLostReplyRig(t)
	ctx := context.Background()
	lim := ratelimit.PerSecond(10)
	through, direct := ratelimit.New(r.through), ratelimit.New(r.direct)
	if _, err := through.Allow(ctx, "warm", lim); err != nil { // the library is loaded
		t.Fatal(err)
	}

	res, err := through.Reserve(ctx, "gap:cancel", lim, time.Second)
	if err != nil || !res.Allowed {
		t.Fatalf("Reserve = %+v, %v", res, err)
	}
	r.proxy.DropReplies(1)
	ok, err := through.Cancel(ctx, "gap:cancel", res)
	st, ierr := direct.Inspect(ctx, "gap:cancel")
	if ierr != nil {
		t.Fatal(ierr)
	}
	t.Logf("Cancel behind a lost reply = %v, %v; starts kept: %d (%d replies lost)", ok, err, st.Starts, r.proxy.Dropped())
	if err != nil || ok != (st.Starts == 0) {
		t.Errorf("Cancel behind a lost reply = %v, %v, but the key keeps %d starts", ok, err, st.Starts)
	}

	if _, err := through.Pause(ctx, "gap:resume", lim, time.Minute); err != nil {
		t.Fatal(err)
	}
	r.proxy.DropReplies(1)
	had, err := through.Resume(ctx, "gap:resume")
	st, ierr = direct.Inspect(ctx, "gap:resume")
	if ierr != nil {
		t.Fatal(ierr)
	}
	t.Logf("Resume behind a lost reply = %v, %v; paused for %v (%d replies lost)", had, err, st.Paused, r.proxy.Dropped())
	if err != nil || (had != (st.Paused == 0)) {
		t.Errorf("Resume behind a lost reply = %v, %v, after a pause of a minute, now paused for %v", had, err, st.Paused)
	}
}
