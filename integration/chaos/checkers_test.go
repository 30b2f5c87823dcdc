//go:build unix

package chaos

import (
	"context"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
)

// The positive controls: every checker must trip on the fault it exists to catch.
// A checker that stays quiet here is broken, and so is every "0 violations" the
// battery reports.

// TestCheckersTripOnSyntheticFaults feeds each checker a fault directly: histories
// that no mutex can produce, a stale fence, and two sections that overlap.
func TestCheckersTripOnSyntheticFaults(t *testing.T) {
	t.Run("porcupine", func(t *testing.T) {
		// Attempts on one key; times in arbitrary units after t0.
		const t0 = 1000
		acq := func(id, fence, call, got, end, ret int64, kind ErrKind) Attempt {
			return Attempt{Worker: int(id), ID: id, Key: "k", Fence: fence, Call: t0 + call, Acquired: t0 + got, FnEnd: t0 + end, Return: t0 + ret, Kind: kind}
		}
		busy := func(id, call, ret int64) Attempt {
			return Attempt{Worker: int(id), ID: id, Key: "k", Call: t0 + call, Return: t0 + ret, Kind: KindNotObtained}
		}
		unknown := func(id, call, ret int64) Attempt {
			return Attempt{Worker: int(id), ID: id, Key: "k", Call: t0 + call, Return: t0 + ret, Kind: KindOther}
		}
		tests := []struct {
			name     string
			history  []Attempt
			want     porcupine.CheckResult
			whyWrong string
		}{
			{"serial", []Attempt{acq(1, 10, 0, 1, 2, 3, KindOK), acq(2, 11, 4, 5, 6, 7, KindOK)}, porcupine.Ok, ""},
			{"waiting acquire spans the holder", []Attempt{acq(1, 10, 0, 1, 5, 6, KindOK), acq(2, 11, 2, 7, 8, 9, KindOK)}, porcupine.Ok, ""},
			{"busy while held", []Attempt{acq(1, 10, 0, 1, 5, 6, KindOK), busy(2, 2, 3)}, porcupine.Ok, ""},
			{"unknown outcome", []Attempt{unknown(3, 0, 1), acq(1, 10, 2, 3, 4, 5, KindOK), busy(2, 6, 7)}, porcupine.Ok, ""},
			{"two holders", []Attempt{acq(1, 10, 0, 1, 5, 6, KindOK), acq(2, 11, 2, 3, 7, 8, KindOK)}, porcupine.Illegal, "overlap"},
			{"fence goes back", []Attempt{acq(1, 10, 0, 1, 2, 3, KindOK), acq(2, 9, 4, 5, 6, 7, KindOK)}, porcupine.Illegal, "stale fence"},
			{"fence repeats", []Attempt{acq(1, 10, 0, 1, 2, 3, KindOK), acq(2, 10, 4, 5, 6, 7, KindOK)}, porcupine.Illegal, "equal fence"},
			{"busy while free", []Attempt{acq(1, 10, 0, 1, 2, 3, KindOK), busy(2, 4, 5)}, porcupine.Illegal, "busy on a free lock"},
			{"lease lost", []Attempt{acq(1, 10, 0, 1, 2, 3, KindNotHeld)}, porcupine.Illegal, "lease loss"},
		}
		for _, tt := range tests {
			got, _ := CheckLinearizable(t, tt.name, tt.history, 10*time.Second)
			if got != tt.want {
				t.Errorf("%s: porcupine = %s, want %s (%s)", tt.name, verdict(got), verdict(tt.want), tt.whyWrong)
			}
		}
	})

	t.Run("referee", func(t *testing.T) {
		ref := StartReferee(t)
		ctx := context.Background()
		writes := []struct {
			fence  int64
			writer string
			want   bool
		}{
			{10, "a", true},
			{10, "a", true},  // the same holder writes again
			{10, "b", false}, // another holder with the same fence
			{9, "c", false},  // a lower fence
			{11, "c", true},
			{10, "a", false}, // the first holder, resumed
		}
		for i, w := range writes {
			got, err := ref.FencedWrite(ctx, "k", w.fence, w.writer)
			if err != nil {
				t.Fatal(err)
			}
			if got != w.want {
				t.Errorf("write %d (fence %d by %s) accepted = %v, want %v", i, w.fence, w.writer, got, w.want)
			}
		}

		// Two sections on one key, the second entering while the first sleeps
		// between its GET and its SET: one overlap and one lost update.
		cfg := SectionConfig{GapMin: 300 * time.Millisecond, GapMax: 300 * time.Millisecond}
		var wg sync.WaitGroup
		var errs [2]error
		for i := range 2 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				time.Sleep(time.Duration(i) * 100 * time.Millisecond)
				_, errs[i] = ref.Section(ctx, "s", int64(100+i), "w", cfg, rand.New(rand.NewPCG(1, 2)))
			}()
		}
		wg.Wait()
		for _, err := range errs {
			if err != nil {
				t.Fatal(err)
			}
		}
		per, _ := ref.Tally(t, []string{"k", "s"})
		if got := per["k"].Stale; got != 3 {
			t.Errorf("stale writes counted = %d, want 3", got)
		}
		if s := per["s"]; s.Overlaps != 1 || s.Completed != 2 || s.Lost != 1 {
			t.Errorf("overlapping sections: %v; want overlaps=1 completed=2 lost-updates=1", s)
		}
	})
}

// TestCheckersTripOnDeletedLocks is the positive control of the loop run: a nemesis
// deletes the lock keys under their holders, so that a second worker takes a key
// while the first is still in its section. The occupancy and lost-update checkers
// must report violations, and porcupine must find the history not linearizable.
func TestCheckersTripOnDeletedLocks(t *testing.T) {
	rig := NewRig(t)
	keys := Keys("nemesis-del", 2)
	var deletes atomic.Int64
	res := rig.RunLoop(t, LoopConfig{
		Workers: 4, Sections: 60, Keys: keys, TTL: 2 * time.Second,
		Section: SectionConfig{GapMin: 2 * time.Millisecond, GapMax: 5 * time.Millisecond},
		During: func(ctx context.Context) {
			rkeys := []string{RedisLockKey(keys[0]), RedisLockKey(keys[1])}
			// Delete for about a second, then let the workers finish.
			n, err := Every(ctx, 2*time.Millisecond, 500, func(ctx context.Context) error {
				d, err := rig.LockRDB.Del(ctx, rkeys...).Result()
				deletes.Add(d)
				return err
			})
			if err != nil {
				t.Errorf("nemesis: %v", err)
			}
			t.Logf("nemesis: %d rounds of DEL, %d held lock keys deleted", n, deletes.Load())
		},
	})
	if res.Total.Overlaps == 0 {
		t.Errorf("occupancy checker saw no overlap although %d held locks were deleted: the checker is broken", deletes.Load())
	}
	if res.Total.Lost == 0 {
		t.Errorf("lost-update checker saw no lost update although %d held locks were deleted: the checker is broken", deletes.Load())
	}
	if res.Verdict != porcupine.Illegal {
		t.Errorf("porcupine = %s on a history with deleted locks, want Illegal: the model or the recording is broken", verdict(res.Verdict))
	}
}

// TestCheckersTripOnRewoundFences is the positive control of the fenced-write checker
// in a loop run: the workers are a deliberately broken lock that hands every other
// section a fence far below the one it was given, as a lock whose fences went back
// would. The referee must reject writes, and porcupine must reject the history
// (fences must increase).
func TestCheckersTripOnRewoundFences(t *testing.T) {
	rig := NewRig(t)
	keys := Keys("nemesis-fence", 2)
	res := rig.RunLoop(t, LoopConfig{
		Workers: 4, Sections: 60, Keys: keys, TTL: 2 * time.Second, RewindFences: true,
		Section: SectionConfig{GapMin: 200 * time.Microsecond, GapMax: time.Millisecond},
	})
	if res.Total.Stale == 0 {
		t.Errorf("fenced-write checker rejected no write although fences were rewound: the checker is broken")
	}
	if res.Verdict != porcupine.Illegal {
		t.Errorf("porcupine = %s on a history with rewound fences, want Illegal", verdict(res.Verdict))
	}
	t.Logf("rejected writes (last 5): %q", res.StaleLog)
}
