package order_test

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynqmutex/asynqmutex"
	"github.com/asynqmutex/asynqmutex/internal/redistest"
	"github.com/asynqmutex/asynqmutex/mutex"
	"github.com/asynqmutex/asynqmutex/order"
)

// TestProducerKilledBetweenTakeAndEnqueue: a producer process whose asynq.Client
// reaches Redis through a proxy enqueues three tasks of key k; then the proxy goes
// silent, the producer's Producer.Enqueue of a fourth takes its place (place 4; the
// Sequencer reaches Redis directly) and stalls in asynq's enqueue, and the test kills
// the process with SIGKILL. A second producer process then enqueues five more tasks
// of k and five of another key j. The key moves on by the documented rule: the task
// of place 5 begins no sooner than OrderGrace after place 4 was taken and within a
// bound, one OpOrderSkipped event reports a GapError for place 4, reason "missing",
// naming the killed producer's task; nothing else of k is lost or reordered, and j
// does not wait for k's gap.
//
// The bound is the grace and half a grace more: after the grace, the waiting task
// asks asynq, moves the key on and takes the lock, a few round trips (docs/order.md).
// Before Await aged the Turn it returns, the grace was waited out twice (place 5
// began 3.86-3.99 s after place 4 was taken, with a grace of 2 s).
//
// The control lifts the stall instead of killing the producer: its enqueue lands,
// the key has no gap, and the gap checker must say so.
func TestProducerKilledBetweenTakeAndEnqueue(t *testing.T) {
	t.Parallel()
	const grace = 2 * time.Second
	t.Run("killed", func(t *testing.T) {
		t.Parallel()
		r := producerKilled(t, grace, true)
		r.g.Bound = grace + grace/2
		r.check(t)
	})
	t.Run("control: the stall lifted", func(t *testing.T) {
		t.Parallel()
		r := producerKilled(t, grace, false)
		r.g.Bound = grace + grace/2
		faults, _ := gapFaults(r.g, r.h.runs, r.h.events)
		if len(faults) == 0 {
			t.Fatalf("the producer's enqueue landed, and the gap checker found the key moved past its place")
		}
		if fs, done := placeFaults(r.h.runs); len(fs) > 0 || !slices.Equal(done["k"], []int64{1, 2, 3, 4, 5, 6, 7, 8, 9}) {
			t.Errorf("key k: places succeeded %v, faults %v; want 1..9 in order", done["k"], fs)
		}
		if r.st.Skipped != 0 {
			t.Errorf("the key skipped %d places, want none", r.st.Skipped)
		}
		t.Logf("the stall lifted: the gap checker found %v", faults)
	})
}

// killResult is what a run of producerKilled recorded.
type killResult struct {
	h             history
	g             gapCase // Bound for the caller to set
	st            order.State
	reps          []procReport
	first, second []taskRef
	jLast         int64 // when key j's last run ended, referee µs
}

// producerKilled runs the scenario of TestProducerKilledBetweenTakeAndEnqueue with
// workers of OrderGrace grace and a MaxWait of two graces; with kill false, it lifts
// the stall instead of killing the producer, and its enqueue lands.
func producerKilled(t *testing.T, grace time.Duration, kill bool) killResult {
	const gap = 4 // the killed producer's place
	ctx := context.Background()
	f := newFleet(t, 20*grace)
	proxy := redistest.NewProxy(t, f.redis.Addr())
	for w := 1; w <= 2; w++ {
		f.start(t, procSpec{Role: roleWorker, ID: w, Ordered: true, Concurrency: 4,
			Grace: grace, MaxWait: 2 * grace, MaxDelay: 3 * time.Millisecond})
	}
	var first, second []taskRef
	for seq := range gap {
		first = append(first, taskRef{Key: "k", Producer: 0, Seq: seq})
	}
	for seq := range 5 {
		second = append(second, taskRef{Key: "k", Producer: 1, Seq: seq}, taskRef{Key: "j", Producer: 1, Seq: seq})
	}
	killed := f.start(t, procSpec{Role: roleProducer, ID: 100, Ordered: true, MaxWait: 2 * grace,
		AsynqAddr: proxy.Addr(), Tasks: first, HoldBefore: gap - 1, MaxRetry: 3})
	later := f.start(t, procSpec{Role: roleProducer, ID: 101, Ordered: true, MaxWait: 2 * grace,
		Tasks: second, MaxRetry: 3})
	f.awaitReady(t)

	// The parent's Producer only derives the key, as the processes' do.
	client := asynq.NewClient(asynq.RedisClientOpt{Addr: f.redis.Addr()})
	t.Cleanup(func() { _ = client.Close() })
	seq := order.New(f.rdb) // the parent reads the key's order, as an operator would
	prod := asynqmutex.NewProducer(mutex.New(f.rdb), client, options(procSpec{Ordered: true, MaxWait: grace}, nil, nil)...)
	lockKey, err := prod.Key(ctx, asynq.NewTask(taskType, []byte(`{"key":"k"}`)))
	if err != nil {
		t.Fatal(err)
	}

	f.signal(t, "go", killed.spec.ID)
	if _, err := f.ref.BLPop(ctx, 10*grace, signalKey("held", killed.spec.ID)).Result(); err != nil {
		t.Fatalf("waiting for the producer to enqueue %d tasks: %v; output:\n%s", gap-1, err, killed.out.String())
	}
	proxy.Blackhole(true)
	f.signal(t, "resume", killed.spec.ID)
	var st order.State
	deadline := time.Now().Add(10 * grace)
	for st.Last < gap {
		if time.Now().After(deadline) {
			t.Fatalf("the producer took no place %d within %v: %+v; output:\n%s", gap, 10*grace, st, killed.out.String())
		}
		time.Sleep(5 * time.Millisecond)
		if st, err = seq.Inspect(ctx, lockKey); err != nil {
			t.Fatal(err)
		}
	}
	if kill {
		killed.kill()
	}
	proxy.Blackhole(false)
	if st.Last != gap {
		t.Fatalf("the key's last place is %d, want %d", st.Last, gap)
	}
	taken, gapID := placeRecord(t, f, st.RedisKey, gap)
	insp := asynq.NewInspector(asynq.RedisClientOpt{Addr: f.redis.Addr()})
	t.Cleanup(func() { _ = insp.Close() })
	if kill {
		if _, err := insp.GetTaskInfo("default", gapID); !errors.Is(err, asynq.ErrTaskNotFound) {
			t.Fatalf("GetTaskInfo of the killed producer's task = %v, want asynq.ErrTaskNotFound: its enqueue was to be lost", err)
		}
	} else if rep := f.report(t, killed); rep.Tasks != gap {
		t.Fatalf("the producer whose stall was lifted enqueued %d tasks, want %d", rep.Tasks, gap)
	}

	f.signal(t, "go", later.spec.ID)
	f.report(t, later)
	want := len(first) + len(second)
	if kill {
		want--
	}
	f.awaitSuccesses(t, want, 10*grace)
	// The last task's place is finished after its handler returned.
	deadline = time.Now().Add(10 * grace)
	for {
		if st, err = seq.Inspect(ctx, lockKey); err != nil {
			t.Fatal(err)
		}
		if st.Next == st.Last+1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the key's places not all finished within %v: %+v", 10*grace, st)
		}
		time.Sleep(10 * time.Millisecond)
	}
	reps := f.stopWorkers(t)
	h := f.history(t)
	eps := f.oneClock(t)

	r := killResult{h: h, st: st, reps: reps, first: first, second: second,
		g: gapCase{Key: "k", LockKey: lockKey, Place: gap, GapID: gapID, Taken: taken, Eps: eps, Grace: grace}}
	for _, run := range h.runs {
		if run.Task.Key == "j" {
			r.jLast = max(r.jLast, run.End)
		}
	}
	return r
}

// check checks a run of producerKilled whose producer was killed.
func (r killResult) check(t *testing.T) {
	t.Helper()
	const gap = 4
	h, st, grace, taken, eps := r.h, r.st, r.g.Grace, r.g.Taken, r.g.Eps
	if st.Last != gap+5 || st.Skipped != 1 {
		t.Errorf("the key's sequence: %+v; want %d places taken, 1 skipped", st, gap+5)
	}
	want := append(slices.Clone(r.first[:gap-1]), r.second...)
	if faults := onceFaults(want, h.runs); len(faults) > 0 {
		t.Errorf("not every task run exactly once on success, or the lost one ran: %v", faults)
	}
	faults, done := placeFaults(h.runs)
	if len(faults) > 0 {
		t.Errorf("runs out of place order: %v", faults)
	}
	if got, want := done["k"], []int64{1, 2, 3, 5, 6, 7, 8, 9}; !slices.Equal(got, want) {
		t.Errorf("key k: places succeeded %v, want %v", got, want)
	}
	if got, want := done["j"], []int64{1, 2, 3, 4, 5}; !slices.Equal(got, want) {
		t.Errorf("key j: places succeeded %v, want %v", got, want)
	}
	if n, first := outOfOrder(h); n > 0 {
		t.Errorf("%d pairs ran out of enqueue order; first: %s", n, first)
	}
	if faults := overlapFaults(h.runs); len(faults) > 0 {
		t.Errorf("runs overlapped another of their key: %v", faults)
	}
	faults, after := gapFaults(r.g, h.runs, h.events)
	if len(faults) > 0 {
		t.Errorf("the key's move past the lost place: %v", faults)
	}
	// Key j's tasks were enqueued after the kill and did not wait out k's grace.
	if r.jLast > taken+grace.Microseconds()+eps {
		t.Errorf("key j's last run ended %v after k's lost place was taken: it waited for k's gap (grace %v)",
			time.Duration(r.jLast-taken)*time.Microsecond, grace)
	}
	t.Logf("place %d taken by the killed producer; place %d began %v after (grace %v, bound %v); key j done %v after; events %v",
		gap, gap+1, after.Round(time.Millisecond), grace, r.g.Bound, time.Duration(r.jLast-taken)*time.Microsecond, ops(r.reps))
}

// placeRecord reads place n's record from the key's sequence hash (docs/protocol.md:
// "<µs taken> <queue> <task id>") and returns when it was taken, in µs of the asynq
// Redis's clock, and its task ID.
func placeRecord(t *testing.T, f *fleet, redisKey string, n int64) (int64, string) {
	t.Helper()
	rec, err := f.rdb.HGet(context.Background(), redisKey, strconv.FormatInt(n, 10)).Result()
	if err != nil {
		t.Fatalf("HGET %s %d: %v", redisKey, n, err)
	}
	fields := strings.SplitN(rec, " ", 3)
	if len(fields) != 3 {
		t.Fatalf("place %d's record %q: want \"<µs> <queue> <id>\"", n, rec)
	}
	us, err := strconv.ParseInt(fields[0], 10, 64)
	if err != nil {
		t.Fatalf("place %d's record %q: %v", n, rec, err)
	}
	return us, fields[2]
}
