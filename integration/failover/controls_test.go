//go:build linux

package failover

import (
	"context"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/asynqmutex/asynqmutex/mutex"
)

// The positive controls: every checker the battery reports with must trip on the
// fault it exists to catch, or its "0" means nothing.

// TestCheckersTripOnSyntheticFaults feeds the referee two overlapping sections and
// stale writes, the fence check a grant after a failover whose fence went back, and
// the recovery reading a gap in a probe's grants.
func TestCheckersTripOnSyntheticFaults(t *testing.T) {
	t.Run("referee", func(t *testing.T) {
		ref, _ := startReferee(t)
		ctx := context.Background()
		for i, w := range []struct {
			fence  int64
			writer string
			want   bool
		}{{10, "a", true}, {10, "a", true}, {10, "b", false}, {9, "c", false}, {11, "c", true}} {
			got, err := ref.fencedWrite(ctx, "w", w.fence, w.writer)
			if err != nil {
				t.Fatal(err)
			}
			if got != w.want {
				t.Errorf("write %d (fence %d by %s) accepted = %v, want %v", i, w.fence, w.writer, got, w.want)
			}
		}
		// The second section enters while the first sleeps between its GET and SET.
		var wg sync.WaitGroup
		errs := make([]error, 2)
		for i := range 2 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				time.Sleep(time.Duration(i) * 100 * time.Millisecond)
				_, errs[i] = ref.section(ctx, "s", int64(100+i), "x", 300*time.Millisecond)
			}()
		}
		wg.Wait()
		for _, err := range errs {
			if err != nil {
				t.Fatal(err)
			}
		}
		if got := ref.tally(t, []string{"w"}); got.Stale != 2 {
			t.Errorf("stale writes = %d, want 2", got.Stale)
		}
		if got := ref.tally(t, []string{"s"}); got.Overlaps != 1 || got.Lost != 1 {
			t.Errorf("overlapping sections: %v, want overlaps=1 lost-updates=1", got)
		}
	})

	t.Run("fences", func(t *testing.T) {
		const faultAt = 1000
		grant := func(key string, fence, at int64) attempt {
			return attempt{Worker: 1, Key: key, Fence: fence, Acquired: at}
		}
		before := map[string]int64{"a": 50, "b": 70}
		for _, tt := range []struct {
			name string
			a    attempt
			bad  int
		}{
			{"risen", grant("a", 51, faultAt+1), 0},
			{"went back", grant("a", 49, faultAt+1), 1},
			{"repeated", grant("b", 70, faultAt+1), 1},
			{"before the fault", grant("b", 10, faultAt-1), 0},
			{"key not taken before", grant("c", 1, faultAt+1), 0},
		} {
			if bad, _ := fencesRose([]attempt{tt.a}, faultAt, before); len(bad) != tt.bad {
				t.Errorf("%s: fencesRose reported %q, want %d violations", tt.name, bad, tt.bad)
			}
		}
	})

	t.Run("recovery", func(t *testing.T) {
		ms := func(n int64) int64 { return n * int64(time.Millisecond) }
		run := func(start, end int64, ok bool) probeRun { return probeRun{Start: ms(start), End: ms(end), OK: ok} }
		for _, tt := range []struct {
			name             string
			runs             []probeRun
			faultAt          int64
			wantRec, wantGap time.Duration
		}{
			{"failed runs", []probeRun{run(0, 10, true), run(30, 40, true), run(60, 70, false), run(90, 2000, false), run(2020, 2030, true), run(2050, 2060, true)},
				50, 1980 * time.Millisecond, 1990 * time.Millisecond},
			{"a stalled run", []probeRun{run(0, 10, true), run(30, 3040, true), run(3060, 3070, true)},
				50, 2990 * time.Millisecond, 3030 * time.Millisecond},
			{"never again", []probeRun{run(0, 10, true), run(60, 70, false)}, 50, -1, 0},
		} {
			rec, gap := recovery(tt.runs, ms(tt.faultAt))
			if rec != tt.wantRec || gap != tt.wantGap {
				t.Errorf("%s: recovery = %v, gap %v; want %v, gap %v", tt.name, rec, gap, tt.wantRec, tt.wantGap)
			}
		}
	})
}

// TestCheckersTripInARound runs a Sentinel round with two deliberate faults of the
// lock on top of the failover: before it, a nemesis deletes the lock keys on the
// master under their holders for two leases (the overlap and lost-update checkers,
// and the check that nothing overlaps before the fault, must report), and one worker
// uses a fence far below the one it was given in every other section (the
// fenced-write checker and the check that fences rose across the failover must
// report).
func TestCheckersTripInARound(t *testing.T) {
	var deleted int64
	r := sentinelRound(t, sentinelModes[0], sentinelFaults[0], func(cfg *roundConfig, st *sentinelTopo) {
		cfg.RewindFences = true
		rdb := st.master.Client(t)
		cfg.PreFault = func(t testing.TB) {
			rkeys := make([]string, len(cfg.Keys))
			for i, k := range cfg.Keys {
				rkeys[i] = mutex.DefaultPrefix + "{" + k + "}"
			}
			rng := rand.New(rand.NewPCG(1, 2))
			for end := time.Now().Add(2 * ttl); time.Now().Before(end); time.Sleep(time.Millisecond + time.Duration(rng.Int64N(int64(time.Millisecond)))) {
				n, err := rdb.Del(context.Background(), rkeys...).Result()
				if err != nil {
					t.Errorf("nemesis: %v", err)
					return
				}
				deleted += n
			}
		}
	})
	t.Logf("nemesis deleted %d held locks; %v; %d overlaps before the fault; %d fence violations",
		deleted, r.Tally, r.PreFaultOverlap, len(r.FenceViolations))
	if r.PreFaultOverlap == 0 || r.Tally.Overlaps == 0 {
		t.Errorf("no overlap before the fault although the nemesis deleted %d held locks: the occupancy checker is broken", deleted)
	}
	if r.Tally.Lost == 0 {
		t.Errorf("no lost update although the nemesis deleted %d held locks: the lost-update checker is broken", deleted)
	}
	if r.Tally.Stale == 0 {
		t.Errorf("no stale write rejected although a worker rewound its fences: the fenced-write checker is broken")
	}
	if len(r.FenceViolations) == 0 {
		t.Errorf("fences rose across the failover for a worker that rewound them: the fence check is broken")
	}
}
