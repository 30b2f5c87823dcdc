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
