package integration

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
	"github.com/asynqmutex/asynqmutex/mutex"
)

const (
	fleetHot       = 120                   // tasks of the burst's key
	fleetOthers    = 3                     // other keys
	fleetOtherEach = 20                    // tasks of each
	fleetWork      = 10 * time.Millisecond // a section's work
	fleetBound     = 90 * time.Second
	// fleetHeldMax bounds how many workers, on average over the drain, the fleet's
	// tasks hold outside their sections (waiting for their key, or on their way to
	// park): the line's lead, and moments.
	fleetHeldMax = 3.0
)

// fleetResult is what the referee and asynq say of one run of the burst.
type fleetResult struct {
	done, tasks int
	overlaps    int64   // a section entered while another of its key ran
	stale       int64   // a section's fence not above its key's last
	twice       int     // tasks whose section ran more than once
	retries     int     // retries asynq counted, over all tasks
	held        float64 // workers held outside sections, on average over the drain
	drain       time.Duration
	line        mutex.Info // the hot key's lock and line at the end
}

// runParkFleet runs the burst on two worker processes (Concurrency 10 each) in mode
// (see e2eWorkerSpec): fleetHot tasks of key "hot", then fleetOtherEach of each of
// fleetOthers other keys, enqueued before the workers start, each with MaxRetry(25).
func runParkFleet(t *testing.T, mode string) fleetResult {
	t.Helper()
	ctx := context.Background()
	lockSrv, refSrv := redistest.Start(t), redistest.Start(t)
	opt := asynq.RedisClientOpt{Addr: lockSrv.Addr()}
	ref := refSrv.Client(t)
	insp := newInspector(t, opt)
	cli := newClient(t, opt)

	var keys []string
	for range fleetHot {
		keys = append(keys, "hot")
	}
	for k := range fleetOthers {
		for range fleetOtherEach {
			keys = append(keys, "k"+strconv.Itoa(k))
		}
	}
	for n, k := range keys {
		if _, err := cli.Enqueue(asynq.NewTask(e2eTaskType, payload(t, e2ePayload{Key: k, N: n})),
			asynq.TaskID(e2eTaskID(n)), asynq.MaxRetry(25), asynq.Retention(time.Hour)); err != nil {
			t.Fatalf("enqueue %d: %v", n, err)
		}
	}
	if err := insp.PauseQueue("default"); err != nil {
		t.Fatal(err)
	}
	spec := e2eWorkerSpec{Asynq: lockSrv.Addr(), Referee: refSrv.Addr(), Mode: mode, Work: fleetWork}
	workers := []*e2eProc{startE2EWorker(t, mode+" worker A", spec), startE2EWorker(t, mode+" worker B", spec)}
	waitFor(t, 60*time.Second, "the workers' servers to start", func() (bool, string) {
		n, err := ref.LLen(ctx, "ready").Result()
		return err == nil && n == int64(len(workers)), fmt.Sprintf("%d ready, err %v", n, err)
	})
	if err := insp.UnpauseQueue("default"); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	r := fleetResult{tasks: len(keys)}
	waitFor(t, fleetBound, "every task done", func() (bool, string) {
		n, err := ref.SCard(ctx, "done").Result()
		r.done = int(n)
		return err == nil && r.done == len(keys), fmt.Sprintf("%d of %d done, err %v", n, len(keys), err)
	})
	r.drain = time.Since(start)
	// A section marks its task done before the handler returns (in mode "twice",
	// before its second section): stop the workers only once asynq has every task
	// completed, or the shutdown cancels a handler still running.
	waitFor(t, fleetBound, "asynq to complete every task", func() (bool, string) {
		q, err := insp.GetQueueInfo("default")
		return err == nil && q.Completed == len(keys) && q.Active == 0, fmt.Sprintf("%+v, %v", q, err)
	})
	for _, w := range workers {
		if err := w.stop(30 * time.Second); err != nil {
			t.Errorf("%s: %v; output:\n%s", w.name, err, w.out.String())
		}
	}
	r.overlaps = refInt(t, ref, "overlaps", "get")
	r.stale = refInt(t, ref, "stale", "get")
	if n := refInt(t, ref, "othererrs", "get"); n != 0 {
		log, _ := ref.LRange(ctx, "errlog", 0, 9).Result()
		t.Errorf("%s: %d errors other than a busy key: %v", mode, n, log)
	}
	for n := range keys {
		if refInt(t, ref, "runs:"+strconv.Itoa(n), "get") > 1 {
			r.twice++
		}
	}
	var held time.Duration
	for _, k := range []string{"hot", "k0", "k1", "k2"} {
		held += time.Duration(refInt(t, ref, "held:"+k, "get")) * time.Microsecond
	}
	r.held = held.Seconds() / r.drain.Seconds()
	for n := range keys {
		info, desc := taskInfo(insp, "default", e2eTaskID(n))
		if info == nil {
			t.Errorf("%s: task %d: %s", mode, n, desc)
			continue
		}
		r.retries += info.Retried
	}
	locks := mutex.New(redis.NewClient(&redis.Options{Addr: lockSrv.Addr()}))
	t.Cleanup(func() { _ = locks.Redis().Close() })
	var err error
	if r.line, err = locks.Inspect(ctx, lockKey(t, e2eTaskType, "hot")); err != nil {
		t.Fatal(err)
	}
	t.Logf("%s: %d tasks drained in %v; overlaps %d, stale fences %d, ran twice %d, retries %d, workers held outside sections %.2f on average; the hot key's line: %d",
		mode, r.done, r.drain.Round(time.Millisecond), r.overlaps, r.stale, r.twice, r.retries, r.held, r.line.Waiting)
	return r
}

// TestParkFleet: a burst on one key among a few others, on two worker processes with
// the middleware's defaults (Park). Checked on a referee Redis and through asynq:
// every task done exactly once, no two sections of a key at once, fences growing, no
// retry spent, fewer than fleetHeldMax workers held on average outside sections, and
// the key free with an empty line at the end. Each checker has a control that trips
// it: no middleware (overlaps), no Configure (retries), MaxWait (workers held), and a
// handler that runs some sections twice (runs per task).
func TestParkFleet(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: runs a burst on two worker processes, and four controls")
	}
	t.Parallel()
	t.Run("park", func(t *testing.T) {
		t.Parallel()
		r := runParkFleet(t, "park")
		if r.overlaps != 0 || r.stale != 0 {
			t.Errorf("%d overlaps and %d stale fences, want none", r.overlaps, r.stale)
		}
		if r.twice != 0 {
			t.Errorf("%d tasks ran more than once, want none", r.twice)
		}
		if r.retries != 0 {
			t.Errorf("%d retries spent, want none", r.retries)
		}
		if r.held >= fleetHeldMax {
			t.Errorf("%.2f workers held outside sections on average, want fewer than %v", r.held, fleetHeldMax)
		}
		if r.line.Held || r.line.Waiting != 0 {
			t.Errorf("at the end the hot key is held %v with %d in its line, want free and empty", r.line.Held, r.line.Waiting)
		}
	})
	controls := []struct {
		mode, trips string
		tripped     func(fleetResult) bool
	}{
		{"bare", "overlaps", func(r fleetResult) bool { return r.overlaps > 0 }},
		{"noconfigure", "retries spent", func(r fleetResult) bool { return r.retries > 0 }},
		{"maxwait", "workers held", func(r fleetResult) bool { return r.held >= fleetHeldMax }},
		{"twice", "runs per task", func(r fleetResult) bool { return r.twice > 0 }},
	}
	for _, c := range controls {
		t.Run("control "+c.mode, func(t *testing.T) {
			t.Parallel()
			if r := runParkFleet(t, c.mode); !c.tripped(r) {
				t.Errorf("the %s checker did not trip in mode %s: %+v", c.trips, c.mode, r)
			}
		})
	}
}

// TestParkStarterKilled: the worker whose release hands a key to a parked task is
// killed (SIGKILL) before it starts that task: its Inspector's connection is cut, so
// that the start hangs, and the kill comes once the lock names the parked task as its
// holder while the task is still in the retry set. The task still runs, once, on
// another worker, without spending a retry, by its fallback: within the TTL and its
// jitter (RetryDelay adds up to a quarter of it, plus a second) of its park.
func TestParkStarterKilled(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	lockSrv, refSrv := redistest.Start(t), redistest.Start(t)
	proxy := redistest.NewProxy(t, lockSrv.Addr())
	opt := asynq.RedisClientOpt{Addr: lockSrv.Addr()}
	ref := refSrv.Client(t)
	insp := newInspector(t, opt)
	cli := newClient(t, opt)
	locks := mutex.New(lockSrv.Client(t))
	key := lockKey(t, e2eTaskType, "k")

	a := startE2EWorker(t, "worker A", e2eWorkerSpec{Asynq: lockSrv.Addr(), Referee: refSrv.Addr(), Mode: "park",
		Inspector: proxy.Addr(), HoldFirst: true})
	waitFor(t, 60*time.Second, "worker A to start", func() (bool, string) {
		n, err := ref.LLen(ctx, "ready").Result()
		return err == nil && n == 1, fmt.Sprintf("%d ready, err %v", n, err)
	})
	for n := range 2 { // 0 holds the key until released; 1 parks behind it
		if _, err := cli.Enqueue(asynq.NewTask(e2eTaskType, payload(t, e2ePayload{Key: "k", N: n})),
			asynq.TaskID(e2eTaskID(n)), asynq.MaxRetry(3), asynq.Retention(time.Hour)); err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			waitFor(t, 10*time.Second, "task 0 in its section", func() (bool, string) {
				v := refInt(t, ref, "active", "get")
				return v == 1, fmt.Sprintf("%d active", v)
			})
		}
	}
	waitFor(t, 10*time.Second, "task 1 parked", func() (bool, string) {
		info, desc := taskInfo(insp, "default", e2eTaskID(1))
		in, err := locks.Inspect(ctx, key)
		return err == nil && info != nil && info.State == asynq.TaskStateRetry && in.Parked == 1, desc
	})
	parked := time.Now()
	proxy.Blackhole(true)
	if err := ref.Set(ctx, "release", 1, 0).Err(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the key handed to task 1", func() (bool, string) {
		in, err := locks.Inspect(ctx, key)
		return err == nil && in.Held && in.Holder.ID == e2eTaskID(1) && in.Holder.PID == 0, fmt.Sprintf("%+v, %v", in.Holder, err)
	})
	if info, desc := taskInfo(insp, "default", e2eTaskID(1)); info == nil || info.State != asynq.TaskStateRetry {
		t.Fatalf("task 1 was started before the kill: %s", desc)
	}
	a.kill(t)
	killed := time.Now()
	proxy.Blackhole(false)
	b := startE2EWorker(t, "worker B", e2eWorkerSpec{Asynq: lockSrv.Addr(), Referee: refSrv.Addr(), Mode: "park"})
	bound := e2eTTL + e2eTTL/4 + time.Second // its fallback and RetryDelay's jitter
	info := waitState(t, insp, "default", e2eTaskID(1), asynq.TaskStateCompleted, bound+30*time.Second)
	t.Logf("task 1 completed %v after its park, %v after the kill (fallback %v plus up to %v of jitter)",
		time.Since(parked).Round(time.Millisecond), time.Since(killed).Round(time.Millisecond), e2eTTL, e2eTTL/4+time.Second)
	if info.Retried != 0 {
		t.Errorf("task 1 spent %d retries, want none", info.Retried)
	}
	if n := refInt(t, ref, "runs:1", "get"); n != 1 {
		t.Errorf("task 1 ran %d times, want once", n)
	}
	if n := refInt(t, ref, "overlaps", "get"); n != 0 {
		t.Errorf("%d overlaps, want none", n)
	}
	if err := b.stop(30 * time.Second); err != nil {
		t.Errorf("worker B: %v; output:\n%s", err, b.out.String())
	}
}
