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

	t.Run("window", func(t *testing.T) {
		// old is the master; a is promoted at 300; b follows old (through the proxy
		// p) until 1100, then a. Samples every 100 from 0.
		const old, a, b, p = "old:1", "a:1", "b:1", "p:1"
		samples := map[string][]roleSample{}
		for at := int64(0); at <= 2000; at += 100 {
			so := roleSample{At: at, Role: "master", Replicas: 2}
			if at >= 300 {
				so.Replicas = 1
			}
			samples[old] = append(samples[old], so)
			sa := roleSample{At: at, Role: "slave", Master: p, Link: "connected"}
			if at >= 300 {
				sa = roleSample{At: at, Role: "master", Replicas: 1}
			}
			samples[a] = append(samples[a], sa)
			sb := roleSample{At: at, Role: "slave", Master: p, Link: "connected"}
			if at >= 1100 {
				sb.Master = a
			}
			samples[b] = append(samples[b], sb)
		}
		nt := readNodes(samples, old, []string{p}, 50)
		if nt.Promoted != 300 || nt.Left != 1100 || nt.window() != 800 {
			t.Errorf("readNodes: %v, window %v; want promoted 300, left 1100, window 800ns", nt, nt.window())
		}
		// Without the alias, b never followed old: no window.
		if nt := readNodes(samples, old, nil, 50); nt.window() != 0 {
			t.Errorf("readNodes without the proxy's name: window %v, want 0", nt.window())
		}
		// b still follows old at the end: the window did not close in the round.
		for i := range samples[b] {
			samples[b][i].Master = p
		}
		if nt := readNodes(samples, old, []string{p}, 50); nt.window() != -1 || nt.Left != 0 {
			t.Errorf("readNodes, b never left: %v, window %v; want left 0, window -1", nt, nt.window())
		}
		// A replica that is still syncing confirms nothing: it does not follow.
		if s := (roleSample{Role: "slave", Master: old, Link: "sync"}); s.follows(map[string]bool{old: true}) {
			t.Errorf("a replica in sync counted as following")
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
// report). The failover is SENTINEL FAILOVER with WaitReplicas(1): the window, in
// which the other replica still follows the deposed master and confirms what it
// grants, is Redis's own (the leading sentinel looks at the promoted replica once a
// second), so the node monitor must see it, and the probe that talks to the deposed
// master must have been granted locks in it, confirmed, and none after it.
func TestCheckersTripInARound(t *testing.T) {
	var deleted int64
	r := sentinelRound(t, modeNamed(t, "wait-1-sync-delay-0"), faultNamed(t, "graceful"), func(cfg *roundConfig, st *sentinelTopo) {
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
	t.Logf("promoted replica's ROLE master %v after SENTINEL FAILOVER, other replica left the old master %v after it (window %v); sentinels named it %v after it; the deposed master granted %d locks after the promotion, confirmed",
		r.Promoted, r.Left, r.Window, r.Named, r.DeposedGrants)
	if r.Window <= 0 {
		t.Errorf("the node monitor saw no time in which the other replica followed the deposed master after the promotion: the window check is broken")
	}
	if r.DeposedGrants == 0 {
		t.Errorf("the deposed master granted no confirmed lock after the promotion: the window's checker is broken")
	}
	if r.Promoted < 0 || r.Named < 0 || r.Promoted >= r.Named {
		t.Errorf("the promoted replica answered as a master %v after the fault, not before the sentinels named it (%v): the window is dated by what clients are told", r.Promoted, r.Named)
	}
	if r.DeposedLate > 0 {
		t.Errorf("the deposed master granted %d confirmed locks after the node monitor saw its replicas leave: the window it measures is too short", r.DeposedLate)
	}
}

func modeNamed(t testing.TB, name string) sentinelMode {
	t.Helper()
	for _, m := range sentinelModes {
		if m.name == name {
			return m
		}
	}
	t.Fatalf("no Sentinel mode %q", name)
	return sentinelMode{}
}

func faultNamed(t testing.TB, name string) sentinelFault {
	t.Helper()
	for _, f := range sentinelFaults {
		if f.name == name {
			return f
		}
	}
	t.Fatalf("no Sentinel fault %q", name)
	return sentinelFault{}
}
