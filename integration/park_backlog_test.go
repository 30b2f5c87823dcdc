package integration

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynqmutex/asynqmutex"
	"github.com/asynqmutex/asynqmutex/internal/redistest"
	"github.com/asynqmutex/asynqmutex/mutex"
)

const (
	backlogCap   = 5
	backlogBurst = 30
	backlogQueue = "bl"
	backlogWork  = 20 * time.Millisecond
)

// backlogRun is a burst of backlogBurst tasks of one key, "n0"..., behind a task
// ("hold") that holds the key until release is closed, on two asynq servers.
type backlogRun struct {
	t       *testing.T
	insp    *asynq.Inspector
	cli     *asynq.Client
	tr      *tracker
	release chan struct{}

	mu         sync.Mutex
	policies   map[string]map[string]bool // OpConflict's policy → task IDs
	superseded map[string]bool            // OpSuperseded's task IDs
	lineFull   int                        // AfterFailure's calls with mutex.ErrLineFull
}

// startBacklog starts the two servers, with MaxBacklog(backlogCap, full), or with
// no middleware when bare, and the task that holds the key; with the middleware, it
// returns once that task holds it.
func startBacklog(t *testing.T, full asynqmutex.Overflow, bare bool) *backlogRun {
	t.Helper()
	opt := asynq.RedisClientOpt{Addr: redistest.Start(t).Addr()}
	locks, _ := newLocks(t, opt)
	r := &backlogRun{t: t, insp: newInspector(t, opt), cli: newClient(t, opt), tr: newTracker(), release: make(chan struct{}),
		policies: map[string]map[string]bool{}, superseded: map[string]bool{}}
	t.Cleanup(func() {
		select {
		case <-r.release:
		default:
			close(r.release)
		}
	})
	var h asynq.Handler = asynq.HandlerFunc(r.handle)
	if !bare {
		h = asynqmutex.Middleware(locks, asynqmutex.On("key"), asynqmutex.Scope("bl"), asynqmutex.TTL(parkTTL),
			asynqmutex.MaxBacklog(backlogCap, full), asynqmutex.Observe(r.observe), asynqmutex.AfterFailure(r.failed))(h)
	}
	cfg := asynqmutex.Configure(asynq.Config{Concurrency: 4, Queues: map[string]int{backlogQueue: 1},
		RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return time.Second }})
	startServer(t, opt, cfg, h)
	startServer(t, opt, cfg, h)
	if !bare {
		r.enqueue("bl:hold", "hold")
		waitFor(t, 10*time.Second, "hold to hold the key", func() (bool, string) {
			in, err := locks.Inspect(context.Background(), lockKey(t, "bl", "k"))
			return err == nil && in.Held && in.Holder.ID == "hold", fmt.Sprintf("held %v by %v (%v)", in.Held, in.Holder, err)
		})
	}
	return r
}

func (r *backlogRun) handle(ctx context.Context, task *asynq.Task) error {
	var p parkPayload
	if err := json.Unmarshal(task.Payload(), &p); err != nil {
		return err
	}
	r.tr.enter(p.Key, p.N, "")
	defer r.tr.exit(p.Key)
	if task.Type() == "bl:hold" {
		select {
		case <-r.release:
		case <-ctx.Done():
		}
		return nil
	}
	time.Sleep(backlogWork)
	return nil
}

func (r *backlogRun) observe(_ context.Context, e asynqmutex.Event) {
	r.mu.Lock()
	defer r.mu.Unlock()
	switch e.Op {
	case asynqmutex.OpConflict:
		if r.policies[e.Policy] == nil {
			r.policies[e.Policy] = map[string]bool{}
		}
		r.policies[e.Policy][e.TaskID] = true
	case asynqmutex.OpSuperseded:
		r.superseded[e.TaskID] = true
	}
}

func (r *backlogRun) failed(_ context.Context, _ *asynq.Task, err error) {
	var le *asynqmutex.LockedError
	if errors.As(err, &le) && errors.Is(err, mutex.ErrLineFull) {
		r.mu.Lock()
		r.lineFull++
		r.mu.Unlock()
	}
}

// with is how many tasks OpConflict reported with policy, and OpSuperseded.
func (r *backlogRun) with(policy string) (int, int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.policies[policy]), len(r.superseded)
}

func (r *backlogRun) enqueue(typ, id string) {
	r.t.Helper()
	if _, err := r.cli.Enqueue(asynq.NewTask(typ, payload(r.t, parkPayload{Key: "k", N: id})),
		asynq.TaskID(id), asynq.Queue(backlogQueue), asynq.MaxRetry(25), asynq.Retention(time.Hour)); err != nil {
		r.t.Fatalf("Enqueue %s: %v", id, err)
	}
}

// burst enqueues tasks "n<from>" to "n<to-1>".
func (r *backlogRun) burst(from, to int) {
	for i := from; i < to; i++ {
		r.enqueue("park:task", "n"+strconv.Itoa(i))
	}
}

// queueIdle waits, within a minute, until cond holds of the queue.
func (r *backlogRun) queueIdle(what string, cond func(q *asynq.QueueInfo) (bool, string)) {
	r.t.Helper()
	waitFor(r.t, 60*time.Second, what, func() (bool, string) {
		q, err := r.insp.GetQueueInfo(backlogQueue)
		if err != nil {
			return false, err.Error()
		}
		return cond(q)
	})
}

// ran is how many times each task's handler ran; overlap, the most handlers of the
// key that ever ran at once.
func (r *backlogRun) ran(id string) int {
	r.tr.mu.Lock()
	defer r.tr.mu.Unlock()
	return r.tr.runs[id]
}

func (r *backlogRun) overlap() int {
	n, _ := r.tr.maxOverlap()
	return n
}

// TestMaxBacklogSkip: a burst of tasks on a key held by another task, under
// MaxBacklog(5, OverflowSkip): the line takes five, the rest complete unrun. Every
// task ran once or was skipped, never both, no retry was spent, no two ran at once.
func TestMaxBacklogSkip(t *testing.T) {
	t.Parallel()
	r := startBacklog(t, asynqmutex.OverflowSkip, false)
	r.burst(0, backlogBurst)
	r.queueIdle("the burst to park or be skipped", func(q *asynq.QueueInfo) (bool, string) {
		skipped, _ := r.with("backlog_skip")
		return q.Pending == 0 && q.Active == 1 && q.Retry == backlogCap && skipped == backlogBurst-backlogCap,
			fmt.Sprintf("%+v; %d skipped", q, skipped)
	})
	close(r.release)
	r.queueIdle("every task completed", func(q *asynq.QueueInfo) (bool, string) {
		return q.Completed == backlogBurst+1, fmt.Sprintf("%+v", q)
	})
	r.mu.Lock()
	skipped, heard := r.policies["backlog_skip"], r.lineFull
	r.mu.Unlock()
	if heard != len(skipped) {
		t.Errorf("AfterFailure heard of %d full lines, want one per task skipped, %d", heard, len(skipped))
	}
	ran := 0
	for i := range backlogBurst {
		id := "n" + strconv.Itoa(i)
		runs := r.ran(id)
		switch {
		case skipped[id] && runs != 0:
			t.Errorf("%s skipped and ran %d times", id, runs)
		case !skipped[id] && runs != 1:
			t.Errorf("%s not skipped and ran %d times, want once", id, runs)
		}
		ran += runs
		if info, desc := taskInfo(r.insp, backlogQueue, id); info == nil || info.Retried != 0 {
			t.Errorf("%s: %s, want no retry spent", id, desc)
		}
	}
	if len(skipped) < 1 || ran != backlogCap {
		t.Errorf("%d skipped, %d ran; want %d ran", len(skipped), ran, backlogCap)
	}
	if n := r.overlap(); n != 1 {
		t.Errorf("%d tasks of the key ran at once, want 1", n)
	}
}

// TestMaxBacklogOverlapControl: the overlap checker trips without the middleware.
func TestMaxBacklogOverlapControl(t *testing.T) {
	t.Parallel()
	r := startBacklog(t, asynqmutex.OverflowSkip, true)
	r.burst(0, backlogBurst)
	r.queueIdle("every task completed", func(q *asynq.QueueInfo) (bool, string) {
		return q.Completed == backlogBurst, fmt.Sprintf("%+v", q)
	})
	if n := r.overlap(); n < 2 {
		t.Errorf("without the middleware %d tasks of the key ran at once, want the checker to see more", n)
	}
}

// TestMaxBacklogReplace: under MaxBacklog(5, OverflowReplace), each newcomer past
// the fifth replaces the oldest parked task, which the middleware deletes from asynq.
// Every task ran once or was superseded (and is gone from asynq), never both; the
// newest ran; no retry was spent; no two ran at once.
func TestMaxBacklogReplace(t *testing.T) {
	t.Parallel()
	r := startBacklog(t, asynqmutex.OverflowReplace, false)
	r.burst(0, backlogBurst-1)
	r.queueIdle("the burst to park or be superseded", func(q *asynq.QueueInfo) (bool, string) {
		_, sup := r.with("")
		return q.Pending == 0 && q.Active == 1 && q.Retry == backlogCap && sup == backlogBurst-1-backlogCap,
			fmt.Sprintf("%+v; %d superseded", q, sup)
	})
	newest := "n" + strconv.Itoa(backlogBurst-1)
	r.burst(backlogBurst-1, backlogBurst)
	r.queueIdle("the newest to park", func(q *asynq.QueueInfo) (bool, string) {
		_, sup := r.with("")
		return q.Pending == 0 && q.Active == 1 && sup == backlogBurst-backlogCap, fmt.Sprintf("%+v; %d superseded", q, sup)
	})
	close(r.release)
	r.queueIdle("the line to run", func(q *asynq.QueueInfo) (bool, string) {
		return q.Completed == backlogCap+1 && q.Pending+q.Active+q.Retry+q.Scheduled+q.Archived == 0, fmt.Sprintf("%+v", q)
	})
	r.mu.Lock()
	sup := r.superseded
	r.mu.Unlock()
	for i := range backlogBurst {
		id := "n" + strconv.Itoa(i)
		runs := r.ran(id)
		info, err := r.insp.GetTaskInfo(backlogQueue, id)
		switch {
		case sup[id] && (runs != 0 || !errors.Is(err, asynq.ErrTaskNotFound)):
			t.Errorf("%s superseded, ran %d times, asynq says %v %v", id, runs, info, err)
		case !sup[id] && (runs != 1 || err != nil || info.Retried != 0):
			t.Errorf("%s not superseded, ran %d times, want once; asynq says %v %v", id, runs, info, err)
		}
	}
	if r.ran(newest) != 1 {
		t.Errorf("the newest task, %s, ran %d times, want once", newest, r.ran(newest))
	}
	if n := r.overlap(); n != 1 {
		t.Errorf("%d tasks of the key ran at once, want 1", n)
	}
}

// TestMaxBacklogFail: under MaxBacklog(5, OverflowFail), the newcomers refused spend
// a retry, asynq retries them, and every task runs once in the end, no two at once.
func TestMaxBacklogFail(t *testing.T) {
	t.Parallel()
	r := startBacklog(t, asynqmutex.OverflowFail, false)
	r.burst(0, backlogBurst)
	r.queueIdle("the burst to park or be refused", func(q *asynq.QueueInfo) (bool, string) {
		failed, _ := r.with("backlog_fail")
		return q.Pending == 0 && failed == backlogBurst-backlogCap, fmt.Sprintf("%+v; %d refused", q, failed)
	})
	close(r.release)
	r.queueIdle("every task completed", func(q *asynq.QueueInfo) (bool, string) {
		return q.Completed == backlogBurst+1, fmt.Sprintf("%+v", q)
	})
	r.mu.Lock()
	refused := r.policies["backlog_fail"]
	r.mu.Unlock()
	for i := range backlogBurst {
		id := "n" + strconv.Itoa(i)
		info, desc := taskInfo(r.insp, backlogQueue, id)
		if runs := r.ran(id); runs != 1 {
			t.Errorf("%s ran %d times, want once", id, runs)
		}
		switch {
		case info == nil:
			t.Errorf("%s: %s", id, desc)
		case refused[id] && info.Retried < 1:
			t.Errorf("%s refused, yet %s: want a retry spent", id, desc)
		}
	}
	if n := r.overlap(); n != 1 {
		t.Errorf("%d tasks of the key ran at once, want 1", n)
	}
}
