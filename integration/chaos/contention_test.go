//go:build unix

package chaos

import (
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
)

// TestSectionsUnderContention is scenario 1: worker processes perform checked
// critical sections under WithLock (TTL 2s, no faults) on 16 keys. Pass: every
// section runs, 0 overlaps, 0 lost updates, 0 stale fenced writes, and the history
// is linearizable (porcupine Ok). Its positive control is TestCheckersTripOnDeletedLocks.
func TestSectionsUnderContention(t *testing.T) {
	workers := Count(t, "workers", 8, 8)
	sections := Count(t, "sections per worker", 500, 5000)
	lifetime := 3 * time.Minute
	if Long() {
		lifetime = 15 * time.Minute
	}
	rig := NewRig(t)
	res := rig.RunLoop(t, LoopConfig{
		Workers: workers, Sections: sections, Keys: Keys("contention", 16), TTL: 2 * time.Second,
		Section:  SectionConfig{GapMin: 200 * time.Microsecond, GapMax: time.Millisecond},
		Lifetime: lifetime, PorcupineTimeout: 3 * time.Minute,
	})
	want := int64(workers * sections)
	if res.Sections != workers*sections || len(res.Errors) > 0 {
		t.Errorf("%d of %d sections ran; WithLock errors: %v", res.Sections, workers*sections, res.Errors)
	}
	if res.Total.Overlaps != 0 {
		t.Errorf("occupancy: %d overlaps, want 0", res.Total.Overlaps)
	}
	if res.Total.Lost != 0 || res.Total.Completed != want || res.Total.Counter != want {
		t.Errorf("lost updates: counter %d after %d completed increments (%d sections), want both %d",
			res.Total.Counter, res.Total.Completed, res.Sections, want)
	}
	if res.Total.Stale != 0 || res.Total.Accepted != 2*want {
		t.Errorf("fenced writes: %d stale, %d accepted; want 0 and %d. Last rejected: %q",
			res.Total.Stale, res.Total.Accepted, 2*want, res.StaleLog)
	}
	if res.Verdict != porcupine.Ok {
		t.Errorf("porcupine: %s%s, want Ok", verdict(res.Verdict), badKeys(res.BadKeys))
	}
}
