package order_test

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
)

// fleet is an asynq Redis, a referee, the parent's clients of both, and the
// processes a test started.
type fleet struct {
	redis  *redistest.Server
	rdb    *redis.Client
	refSrv *redistest.Server
	ref    *redis.Client
	procs  []*proc
	// lifetime bounds every process of the fleet.
	lifetime time.Duration
}

func newFleet(t *testing.T, lifetime time.Duration) *fleet {
	t.Helper()
	s, ref := redistest.Start(t), redistest.Start(t)
	return &fleet{redis: s, rdb: s.Client(t), refSrv: ref, ref: ref.Client(t), lifetime: lifetime}
}

// start starts the process spec describes, on the fleet's servers.
func (f *fleet) start(t *testing.T, spec procSpec) *proc {
	t.Helper()
	spec.RedisAddr, spec.RefereeAddr, spec.Lifetime = f.redis.Addr(), f.refSrv.Addr(), f.lifetime
	p := startProc(t, spec)
	f.procs = append(f.procs, p)
	return p
}

// awaitReady waits for every process started to say it is connected.
func (f *fleet) awaitReady(t *testing.T) {
	t.Helper()
	for ready := 0; ready < len(f.procs); ready++ {
		// Processes compile nothing: they start in well under this bound, which only
		// stops a broken one from hanging the test.
		if _, err := f.ref.BLPop(context.Background(), 30*time.Second, "ready").Result(); err != nil {
			t.Fatalf("waiting for %d processes to connect: %v%s", len(f.procs)-ready, err, outputs(f.procs))
		}
	}
}

// signal pushes to the referee key what:<id>.
func (f *fleet) signal(t *testing.T, what string, id int) {
	t.Helper()
	if err := f.ref.RPush(context.Background(), signalKey(what, id), 1).Err(); err != nil {
		t.Fatalf("referee: %s: %v", signalKey(what, id), err)
	}
}

// report waits for p to exit, within the fleet's lifetime, and returns its report;
// it fails the test if p failed.
func (f *fleet) report(t *testing.T, p *proc) procReport {
	t.Helper()
	select {
	case <-p.done:
	case <-time.After(f.lifetime):
		t.Fatalf("%v still running after %v; output:\n%s", p, f.lifetime, p.out.String())
	}
	raw, err := f.ref.LPop(context.Background(), signalKey("report", p.spec.ID)).Result()
	if err != nil {
		t.Fatalf("%v left no report (exit %v): %v; output:\n%s", p, p.err, err, p.out.String())
	}
	var rep procReport
	if err := json.Unmarshal([]byte(raw), &rep); err != nil {
		t.Fatalf("%v report: %v", p, err)
	}
	if rep.Error != "" || p.err != nil {
		t.Fatalf("%v failed: exit %v, %s; output:\n%s", p, p.err, rep.Error, p.out.String())
	}
	return rep
}

// stopWorkers tells every worker to shut its server down, and returns their reports.
func (f *fleet) stopWorkers(t *testing.T) []procReport {
	t.Helper()
	var reps []procReport
	for _, p := range f.procs {
		if p.spec.Role == roleWorker {
			f.signal(t, "stop", p.spec.ID)
		}
	}
	for _, p := range f.procs {
		if p.spec.Role == roleWorker {
			reps = append(reps, f.report(t, p))
		}
	}
	return reps
}

// list reads the referee list key, each item JSON into a T.
func list[T any](t *testing.T, ref *redis.Client, key string) []T {
	t.Helper()
	raw, err := ref.LRange(context.Background(), key, 0, -1).Result()
	if err != nil {
		t.Fatalf("referee: %s: %v", key, err)
	}
	out := make([]T, len(raw))
	for i, s := range raw {
		if err := json.Unmarshal([]byte(s), &out[i]); err != nil {
			t.Fatalf("referee: %s: bad item %q: %v", key, s, err)
		}
	}
	return out
}

// awaitSuccesses waits up to within for the handlers to have succeeded want times
// in all, and fails the test (with the processes' outputs) if they have not.
func (f *fleet) awaitSuccesses(t *testing.T, want int, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	var (
		off int64
		ok  int
	)
	for {
		raw, err := f.ref.LRange(context.Background(), "runs", off, -1).Result()
		if err != nil {
			t.Fatalf("referee: runs: %v", err)
		}
		off += int64(len(raw))
		for _, s := range raw {
			var r runRecord
			if err := json.Unmarshal([]byte(s), &r); err == nil && r.OK {
				ok++
			}
		}
		if ok >= want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d tasks succeeded within %v%s", ok, want, within, outputs(f.procs))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// oneClock checks that the asynq Redis and the referee read one clock, as two
// redis-servers on one machine do: the asynq Redis's TIME, read between two of the
// referee's, falls between them. It returns how far the two may differ.
func (f *fleet) oneClock(t *testing.T) int64 {
	t.Helper()
	ctx := context.Background()
	t1, err := refNow(ctx, f.ref)
	if err != nil {
		t.Fatal(err)
	}
	r, err := refNow(ctx, f.rdb)
	if err != nil {
		t.Fatal(err)
	}
	t2, err := refNow(ctx, f.ref)
	if err != nil {
		t.Fatal(err)
	}
	if r < t1-2 || r > t2+2 {
		t.Fatalf("the asynq Redis read %d µs between the referee's %d and %d: not one clock", r, t1, t2)
	}
	return t2 - t1 + 4
}

// history is what the referee recorded of a run of the fleet.
type history struct {
	stamps map[string]stamp // by task name
	runs   []runRecord      // by Begin
	events []eventRecord
}

func (f *fleet) history(t *testing.T) history {
	t.Helper()
	h := history{stamps: map[string]stamp{}}
	for _, s := range list[stamp](t, f.ref, "stamps") {
		if _, dup := h.stamps[s.Task.name()]; dup {
			t.Fatalf("task %s stamped twice: enqueued twice", s.Task.name())
		}
		h.stamps[s.Task.name()] = s
	}
	h.runs = list[runRecord](t, f.ref, "runs")
	slices.SortStableFunc(h.runs, func(a, b runRecord) int { return int(a.Begin - b.Begin) })
	h.events = list[eventRecord](t, f.ref, "events")
	return h
}

// ops sums the workers' events by Op.
func ops(reps []procReport) map[string]int {
	out := map[string]int{}
	for _, r := range reps {
		for op, n := range r.Ops {
			out[op] += n
		}
	}
	return out
}

func ms(us int64) string { return fmt.Sprintf("%.0fms", float64(us)/1000) }
