package order_test

import (
	"fmt"
	"slices"
	"testing"
	"time"
)

// The workload of TestOrderedFleet: keys x perKey tasks, from producers that share
// every key, run by workers processes of concurrency goroutines each.
const (
	keys        = 20
	perKey      = 50
	producers   = 2
	workers     = 4
	concurrency = 8
	// maxWait covers a failed task's return (due at once, moved back to its queue
	// within asynq's check of delayed tasks, 100 ms), so that the tasks behind it
	// seldom go back to the queue.
	maxWait = 3 * time.Second
	// drainBound only stops a broken run (README.md has the drain times measured): a
	// key whose task meets the task ahead waiting for its retry can drain at one task
	// a second (a task sent back returns a second after the task ahead is due), so
	// perKey seconds, and a few waits more.
	drainBound = perKey*time.Second + 5*maxWait
)

// workloadTasks is what producer pr enqueues, in order: its perKey/producers tasks
// of every key, the keys interleaved.
func workloadTasks(pr int) []taskRef {
	var out []taskRef
	for seq := range perKey / producers {
		for k := range keys {
			out = append(out, taskRef{Key: fmt.Sprintf("k%02d", k), Producer: pr, Seq: seq})
		}
	}
	return out
}

// runWorkload runs the workload, ordered or under the lock alone, its workers parking
// busy tasks (park) or waiting and sending them back, and returns what the referee
// recorded, the workers' reports and how long the drain took from the producers' go.
func runWorkload(t *testing.T, ordered, park bool) (history, []procReport, time.Duration) {
	f := newFleet(t, drainBound+30*time.Second)
	for w := 1; w <= workers; w++ {
		f.start(t, procSpec{Role: roleWorker, ID: w, Ordered: ordered, Concurrency: concurrency,
			MaxWait: maxWait, Park: park, MaxDelay: 3 * time.Millisecond, FailPercent: 10})
	}
	var prods []*proc
	for pr := range producers {
		prods = append(prods, f.start(t, procSpec{Role: roleProducer, ID: 100 + pr, Ordered: ordered,
			MaxWait: maxWait, Tasks: workloadTasks(pr), MaxRetry: 20}))
	}
	f.awaitReady(t)
	start := time.Now()
	for _, p := range prods {
		f.signal(t, "go", p.spec.ID)
	}
	for _, p := range prods {
		if rep := f.report(t, p); rep.Tasks != len(p.spec.Tasks) {
			t.Fatalf("%v enqueued %d tasks, want %d", p, rep.Tasks, len(p.spec.Tasks))
		}
	}
	f.awaitSuccesses(t, keys*perKey, drainBound)
	took := time.Since(start)
	reps := f.stopWorkers(t)
	return f.history(t), reps, took
}

func allTasks() []taskRef {
	var out []taskRef
	for pr := range producers {
		out = append(out, workloadTasks(pr)...)
	}
	return out
}

// TestOrderedFleet: 4 worker processes, 20 keys x 50 tasks enqueued in order by 2
// producer processes that share every key, handlers with random short delays and 10%
// of runs failing transiently and retried: each key's handler sees its tasks in
// enqueue order (by the producers' stamps, and by their places, failed runs
// included), each exactly once on success, one at a time, and keys run in parallel.
// The control runs the same workload without order, under the lock alone: its tasks
// run out of enqueue order, which the order checker must see.
func TestOrderedFleet(t *testing.T) {
	t.Parallel()
	for _, park := range []bool{false, true} {
		name := "ordered, MaxWait and RetryLater"
		if park {
			name = "ordered, parked (the defaults)"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			h, reps, took := runWorkload(t, true, park)
			checkOrdered(t, h, reps, took)
			// Positive control of the path under test: tasks did park and were
			// started when the task ahead finished.
			if started := ops(reps)["park_started"]; park && started == 0 {
				t.Errorf("no parked task was started (events %v): the run did not test parking", ops(reps))
			}
		})
	}
	t.Run("control without order", func(t *testing.T) {
		t.Parallel()
		h, reps, took := runWorkload(t, false, false)
		// The lock alone still runs each task once, one at a time per key.
		if faults := onceFaults(allTasks(), h.runs); len(faults) > 0 {
			t.Errorf("%d tasks not run exactly once on success; first: %s", len(faults), faults[0])
		}
		if faults := overlapFaults(h.runs); len(faults) > 0 {
			t.Errorf("%d runs overlapped another of their key; first: %s", len(faults), faults[0])
		}
		n, first := outOfOrder(h)
		if n == 0 {
			t.Fatalf("without InOrder every key ran in enqueue order; the checker would not see a violation")
		}
		keysAt, _ := keysAtOnce(h.runs)
		t.Logf("without order: drained in %v, %d pairs out of order, up to %d keys at once; first: %s; events %v",
			took.Round(time.Millisecond), n, keysAt, first, ops(reps))
	})
}

// checkOrdered checks an ordered run: each task succeeded once, in enqueue order and
// place order, one at a time per key, keys in parallel, failures retried, no place
// skipped.
func checkOrdered(t *testing.T, h history, reps []procReport, took time.Duration) {
	t.Helper()
	if faults := onceFaults(allTasks(), h.runs); len(faults) > 0 {
		t.Errorf("%d tasks not run exactly once on success; first: %s", len(faults), faults[0])
	}
	if n, first := outOfOrder(h); n > 0 {
		t.Errorf("%d pairs ran out of enqueue order; first: %s", n, first)
	}
	faults, done := placeFaults(h.runs)
	if len(faults) > 0 {
		t.Errorf("%d runs out of place order; first: %s", len(faults), faults[0])
	}
	for k := range keys {
		key := fmt.Sprintf("k%02d", k)
		want := make([]int64, perKey)
		for i := range want {
			want[i] = int64(i + 1)
		}
		if !slices.Equal(done[key], want) {
			t.Errorf("key %s: places succeeded %v, want 1..%d in order", key, done[key], perKey)
		}
	}
	if faults := overlapFaults(h.runs); len(faults) > 0 {
		t.Errorf("%d runs overlapped another of their key; first: %s", len(faults), faults[0])
	}
	n, _ := keysAtOnce(h.runs)
	if n < 2 {
		t.Errorf("at most %d key ran at once, want keys in parallel", n)
	}
	failed := 0
	for _, r := range h.runs {
		if !r.OK {
			failed++
		}
	}
	if failed == 0 {
		t.Errorf("no run failed: the test did not test retries")
	}
	if len(h.events) > 0 {
		t.Errorf("%d places skipped or tasks run out of order, want none; first: %+v", len(h.events), h.events[0])
	}
	t.Logf("ordered: %d tasks drained in %v over %d runs (%d failed and retried), up to %d keys at once; events %v",
		keys*perKey, took.Round(time.Millisecond), len(h.runs), failed, n, ops(reps))
}
