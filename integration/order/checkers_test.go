package order_test

// Checkers judge what the referee recorded. Each returns what it found wrong (or a
// measure the test bounds); checkers_control_test.go shows each trips.
//
// A run's Begin and End are the referee's TIME read by the handler as it began and
// as it was about to return: the handler was running over all of [Begin, End]. Two
// such spans that overlap are runs that overlapped; two that do not may still have.
// So overlap found within a key is a fault for certain, and overlap found across keys
// is parallelism for certain.

import (
	"fmt"
	"slices"
	"time"

	"github.com/asynqmutex/asynqmutex/order"
)

// byKey groups runs by key, keeping their order (by Begin).
func byKey(runs []runRecord) map[string][]runRecord {
	out := map[string][]runRecord{}
	for _, r := range runs {
		out[r.Task.Key] = append(out[r.Task.Key], r)
	}
	return out
}

// outOfOrder counts, per key, the pairs of tasks whose successful runs began in the
// wrong order: a task that ran after another although its Enqueue had returned
// before the other's was called, on the referee's clock. It returns the count and
// the first such pair, described.
func outOfOrder(h history) (int, string) {
	n, first := 0, ""
	for key, runs := range byKey(h.runs) {
		var ok []runRecord
		for _, r := range runs {
			if r.OK {
				ok = append(ok, r)
			}
		}
		for i := range ok {
			for j := i + 1; j < len(ok); j++ {
				a, b := h.stamps[ok[i].Task.name()], h.stamps[ok[j].Task.name()]
				if b.After < a.Before {
					if n == 0 {
						first = fmt.Sprintf("key %s: %s ran before %s, which was enqueued first", key, ok[i].Task.name(), ok[j].Task.name())
					}
					n++
				}
			}
		}
	}
	return n, first
}

// placeFaults checks the places the handlers saw: per key, no run (a failed one
// included) begins with a place lower than a run that began before it, no place
// succeeds twice, and every run carries a place of one sequence. It returns the
// faults, and per key the places that succeeded, in the order they ran.
func placeFaults(runs []runRecord) ([]string, map[string][]int64) {
	var faults []string
	done := map[string][]int64{}
	for key, runs := range byKey(runs) {
		var (
			epoch   string
			highest int64
			seen    = map[int64]bool{}
		)
		for _, r := range runs {
			p, ok := order.ParsePlace(r.Place)
			switch {
			case !ok:
				faults = append(faults, fmt.Sprintf("key %s: task %s ran with place %q", key, r.Task.name(), r.Place))
				continue
			case epoch == "":
				epoch = p.Epoch
			case p.Epoch != epoch:
				faults = append(faults, fmt.Sprintf("key %s: task %s ran with a place of epoch %s, not %s", key, r.Task.name(), p.Epoch, epoch))
			}
			if p.N < highest {
				faults = append(faults, fmt.Sprintf("key %s: task %s (place %d) began after a run of place %d", key, r.Task.name(), p.N, highest))
			}
			highest = max(highest, p.N)
			if r.OK {
				if seen[p.N] {
					faults = append(faults, fmt.Sprintf("key %s: place %d succeeded twice", key, p.N))
				}
				seen[p.N] = true
				done[key] = append(done[key], p.N)
			}
		}
	}
	slices.Sort(faults)
	return faults, done
}

// onceFaults checks that each task in want succeeded exactly once, and that no other
// task ran.
func onceFaults(want []taskRef, runs []runRecord) []string {
	wanted := map[string]bool{}
	for _, r := range want {
		wanted[r.name()] = true
	}
	ok := map[string]int{}
	var faults []string
	for _, r := range runs {
		if !wanted[r.Task.name()] {
			faults = append(faults, fmt.Sprintf("task %s ran, but was not to", r.Task.name()))
			continue
		}
		if r.OK {
			ok[r.Task.name()]++
		}
	}
	for _, r := range want {
		if n := ok[r.name()]; n != 1 {
			faults = append(faults, fmt.Sprintf("task %s succeeded %d times, want 1", r.name(), n))
		}
	}
	slices.Sort(faults)
	return faults
}

// overlapFaults finds runs of one key that overlapped: the key's lock did not hold.
func overlapFaults(runs []runRecord) []string {
	var faults []string
	for key, runs := range byKey(runs) {
		end, last := int64(0), ""
		for _, r := range runs {
			if r.Begin < end {
				faults = append(faults, fmt.Sprintf("key %s: %s began while %s ran", key, r.Task.name(), last))
			}
			if r.End > end {
				end, last = r.End, r.Task.name()
			}
		}
	}
	slices.Sort(faults)
	return faults
}

// keysAtOnce is the most keys with a run under way at one instant, and the instant,
// in referee µs.
func keysAtOnce(runs []runRecord) (int, int64) {
	type edge struct {
		at    int64
		delta int
		key   string
	}
	var edges []edge
	for _, r := range runs {
		edges = append(edges, edge{r.Begin, 1, r.Task.Key}, edge{r.End, -1, r.Task.Key})
	}
	// At one instant, ends before begins: spans that only touch are not counted as
	// overlapping, since two TIME reads of one microsecond say nothing of order.
	slices.SortFunc(edges, func(a, b edge) int {
		if a.at != b.at {
			return int(a.at - b.at)
		}
		return a.delta - b.delta
	})
	running := map[string]int{}
	best, at := 0, int64(0)
	for _, e := range edges {
		if running[e.key] += e.delta; running[e.key] == 0 {
			delete(running, e.key)
		}
		if len(running) > best {
			best, at = len(running), e.at
		}
	}
	return best, at
}

// gapCase is what a test expects of a key whose place was taken by a producer that
// died before enqueuing its task.
type gapCase struct {
	Key     string // the tasks' key field
	LockKey string // the key the middleware derives from it (Producer.Key)
	Place   int64  // the place its producer took
	GapID   string // the task ID recorded with it
	// Taken is when the place was taken, in µs of the asynq Redis's clock; Eps how far
	// that clock and the referee's may differ (fleet.oneClock).
	Taken, Eps int64
	// Grace is the workers' OrderGrace; Bound how long after Taken the next task of the
	// key may begin at the latest.
	Grace, Bound time.Duration
}

// gapFaults checks a key's runs and the workers' events against g: the first run of
// the place after g.Place began no sooner than g.Grace after g.Taken and no later than
// g.Bound after it; exactly one event moved the key past g.Place, for the reason
// "missing", naming g.GapID; no task ran out of order. It returns the faults and how
// long after Taken the next place's run began.
func gapFaults(g gapCase, runs []runRecord, events []eventRecord) ([]string, time.Duration) {
	var faults []string
	next := int64(-1)
	for _, r := range runs {
		if p, ok := order.ParsePlace(r.Place); ok && r.Task.Key == g.Key && p.N == g.Place+1 {
			next = r.Begin
			break
		}
	}
	var after time.Duration
	if next < 0 {
		faults = append(faults, fmt.Sprintf("key %s: no run of place %d, after the gap", g.Key, g.Place+1))
	} else {
		after = time.Duration(next-g.Taken) * time.Microsecond
		lo, hi := g.Taken+g.Grace.Microseconds()-g.Eps, g.Taken+g.Bound.Microseconds()+g.Eps
		switch {
		case next < lo:
			faults = append(faults, fmt.Sprintf("key %s: place %d began %v after place %d was taken, before the grace of %v", g.Key, g.Place+1, after, g.Place, g.Grace))
		case next > hi:
			faults = append(faults, fmt.Sprintf("key %s: place %d began %v after place %d was taken, later than the bound %v", g.Key, g.Place+1, after, g.Place, g.Bound))
		}
	}
	skips := 0
	for _, e := range events {
		switch {
		case e.Op == "out_of_order":
			faults = append(faults, fmt.Sprintf("task %s ran out of order: %s", e.TaskID, e.Err))
		case e.Op != "order_skipped":
		case e.Key != g.LockKey:
			faults = append(faults, fmt.Sprintf("a place of another key was skipped: %s", e.Err))
		case e.Place != g.Place || e.Reason != "missing" || e.GapID != g.GapID:
			faults = append(faults, fmt.Sprintf("skipped place %d (task %s) for %q, want place %d (task %s) for \"missing\"", e.Place, e.GapID, e.Reason, g.Place, g.GapID))
		default:
			skips++
		}
	}
	if skips != 1 {
		faults = append(faults, fmt.Sprintf("%d events moved key %s past place %d for \"missing\", want 1", skips, g.Key, g.Place))
	}
	return faults, after
}
