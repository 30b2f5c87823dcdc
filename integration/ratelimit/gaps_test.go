package ratelimit_test

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/asynqmutex/asynqmutex/ratelimit"
)

// knownGapsEnv, set to 1, runs the tests of gaps found in package ratelimit and not
// yet closed: they fail until it changes, so by default they are skipped.
const knownGapsEnv = "ASYNQMUTEX_RATE_KNOWN_GAPS"

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
