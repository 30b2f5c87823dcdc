package order_test

import (
	"fmt"
	"testing"
	"time"
)

// Positive controls on synthetic histories: each checker trips on the fault it looks
// for, and passes a history without it. The real controls are beside the tests: the
// workload without order (TestOrderedFleet) and the stall lifted instead of the
// producer killed (TestProducerKilledBetweenTakeAndEnqueue).

// run is a synthetic run of task key/p0/seq at place n over [begin, end].
func run(key string, seq int, n int64, begin, end int64, ok bool) runRecord {
	place := ""
	if n > 0 {
		place = fmt.Sprintf("100:%d", n)
	}
	return runRecord{Task: taskRef{Key: key, Seq: seq}, Place: place, Begin: begin, End: end, OK: ok}
}

// stamped is a history of runs whose tasks key/p0/seq were enqueued one after
// another, seq 0 first, each Enqueue over [10*seq, 10*seq+5]; the runs in the order
// given.
func stamped(runs ...runRecord) history {
	h := history{stamps: map[string]stamp{}, runs: runs}
	for _, r := range runs {
		h.stamps[r.Task.name()] = stamp{Task: r.Task, Before: int64(10 * r.Task.Seq), After: int64(10*r.Task.Seq + 5)}
	}
	return h
}

func TestCheckersTripOnSyntheticHistories(t *testing.T) {
	t.Run("enqueue order", func(t *testing.T) {
		good := stamped(run("a", 0, 1, 100, 110, true), run("a", 1, 2, 120, 130, true), run("b", 1, 2, 105, 125, true), run("b", 0, 1, 130, 140, false))
		if n, first := outOfOrder(good); n != 0 {
			t.Errorf("in order: %d pairs out of order, %s", n, first)
		}
		bad := stamped(run("a", 1, 2, 100, 110, true), run("a", 0, 1, 120, 130, true), run("a", 2, 3, 140, 150, true))
		if n, _ := outOfOrder(bad); n != 1 {
			t.Errorf("task 1 before task 0: %d pairs out of order, want 1", n)
		}
		// Enqueues that overlapped have no order to keep.
		conc := stamped(run("a", 1, 2, 100, 110, true), run("a", 0, 1, 120, 130, true))
		conc.stamps["a/p0/1"] = stamp{Before: 3, After: 12}
		if n, first := outOfOrder(conc); n != 0 {
			t.Errorf("concurrent enqueues: %d pairs out of order, %s", n, first)
		}
	})
	t.Run("places", func(t *testing.T) {
		good := []runRecord{run("a", 0, 1, 100, 110, false), run("a", 0, 1, 120, 130, true), run("a", 1, 2, 140, 150, true)}
		if faults, done := placeFaults(good); len(faults) != 0 || fmt.Sprint(done["a"]) != "[1 2]" {
			t.Errorf("in order: faults %v, done %v", faults, done)
		}
		for name, runs := range map[string][]runRecord{
			"a failed run of place 2 before place 1": {run("a", 1, 2, 100, 110, false), run("a", 0, 1, 120, 130, true), run("a", 1, 2, 140, 150, true)},
			"place 1 succeeded twice":                {run("a", 0, 1, 100, 110, true), run("a", 0, 1, 120, 130, true)},
			"a run without a place":                  {run("a", 0, 0, 100, 110, true)},
			"places of two epochs":                   {run("a", 0, 1, 100, 110, true), {Task: taskRef{Key: "a", Seq: 1}, Place: "200:2", OK: true, Begin: 120, End: 130}},
		} {
			if faults, _ := placeFaults(runs); len(faults) == 0 {
				t.Errorf("%s: no fault found", name)
			}
		}
	})
	t.Run("exactly once", func(t *testing.T) {
		want := []taskRef{{Key: "a", Seq: 0}, {Key: "a", Seq: 1}}
		if faults := onceFaults(want, []runRecord{run("a", 0, 1, 1, 2, false), run("a", 0, 1, 3, 4, true), run("a", 1, 2, 5, 6, true)}); len(faults) != 0 {
			t.Errorf("once each: %v", faults)
		}
		for name, runs := range map[string][]runRecord{
			"succeeded twice": {run("a", 0, 1, 1, 2, true), run("a", 0, 1, 3, 4, true), run("a", 1, 2, 5, 6, true)},
			"lost":            {run("a", 0, 1, 1, 2, true), run("a", 1, 2, 5, 6, false)},
			"a stray task":    {run("a", 0, 1, 1, 2, true), run("a", 1, 2, 5, 6, true), run("a", 2, 3, 7, 8, true)},
		} {
			if faults := onceFaults(want, runs); len(faults) == 0 {
				t.Errorf("%s: no fault found", name)
			}
		}
	})
	t.Run("one at a time per key", func(t *testing.T) {
		if faults := overlapFaults([]runRecord{run("a", 0, 1, 100, 110, true), run("b", 0, 1, 105, 115, true), run("a", 1, 2, 111, 120, true)}); len(faults) != 0 {
			t.Errorf("serial per key: %v", faults)
		}
		if faults := overlapFaults([]runRecord{run("a", 0, 1, 100, 110, true), run("a", 1, 2, 109, 120, true)}); len(faults) != 1 {
			t.Errorf("overlapping runs of a key: faults %v, want 1", faults)
		}
	})
	t.Run("keys in parallel", func(t *testing.T) {
		if n, _ := keysAtOnce([]runRecord{run("a", 0, 1, 100, 110, true), run("b", 0, 1, 110, 120, true), run("a", 1, 2, 121, 130, true)}); n != 1 {
			t.Errorf("keys one after another (touching at 110): %d at once, want 1", n)
		}
		if n, at := keysAtOnce([]runRecord{run("a", 0, 1, 100, 110, true), run("b", 0, 1, 105, 120, true), run("c", 0, 1, 108, 109, true)}); n != 3 || at != 108 {
			t.Errorf("three keys overlapping at 108: %d at once at %d", n, at)
		}
	})
	t.Run("gap", func(t *testing.T) {
		const grace, bound = time.Second, 2 * time.Second
		g := gapCase{Key: "k", LockKey: "K", Place: 2, GapID: "lost", Taken: 1_000_000, Eps: 10, Grace: grace, Bound: bound}
		at := func(ms int64) []runRecord {
			return []runRecord{run("k", 0, 1, 0, 10, true), run("k", 2, 3, 1_000_000+ms*1000, 1_000_000+ms*1000+10, true)}
		}
		skip := eventRecord{Op: "order_skipped", Key: "K", Place: 2, GapID: "lost", Reason: "missing"}
		if faults, after := gapFaults(g, at(1500), []eventRecord{skip}); len(faults) != 0 || after != 1500*time.Millisecond {
			t.Errorf("moved on within the bound: faults %v, after %v", faults, after)
		}
		wrong := func(f func(*eventRecord)) []eventRecord { e := skip; f(&e); return []eventRecord{e} }
		for name, c := range map[string]struct {
			runs   []runRecord
			events []eventRecord
		}{
			"before the grace":    {at(900), []eventRecord{skip}},
			"after the bound":     {at(2100), []eventRecord{skip}},
			"never":               {at(0)[:1], []eventRecord{skip}},
			"no event":            {at(1500), nil},
			"two events":          {at(1500), []eventRecord{skip, skip}},
			"another reason":      {at(1500), wrong(func(e *eventRecord) { e.Reason = "archived" })},
			"another place":       {at(1500), wrong(func(e *eventRecord) { e.Place = 3 })},
			"another task":        {at(1500), wrong(func(e *eventRecord) { e.GapID = "other" })},
			"another key":         {at(1500), append(wrong(func(e *eventRecord) { e.Key = "J" }), skip)},
			"a task out of order": {at(1500), []eventRecord{skip, {Op: "out_of_order", Key: "K", TaskID: "x"}}},
		} {
			if faults, _ := gapFaults(g, c.runs, c.events); len(faults) == 0 {
				t.Errorf("%s: no fault found", name)
			}
		}
	})
}
