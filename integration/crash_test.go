package integration

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex"
	"github.com/asynqmutex/asynqmutex/mutex"
)

// workerEnv, when set to a Redis address, turns TestHelperWorker into a worker
// process for TestWorkerKilledWhileHoldingLock.
const workerEnv = "ASYNQMUTEX_INTEGRATION_WORKER_REDIS"

const (
	crashTTL    = 2 * time.Second
	crashMarker = "integration:worker-running" // the worker writes "<fence> <task id>" here
	// asynq v0.26 facts, from its source: an active task's lease is 30s
	// (rdb.LeaseDuration), and the recoverer re-queues tasks whose lease expired at
	// least 30s ago (recoverer.go: cutoff = now - 30s), at server start and then once a
	// minute (server.go: interval 1 * time.Minute, not configurable). Lease scores are
	// whole Unix seconds.
	asynqLease          = 30 * time.Second
	asynqRecoverCutoff  = 30 * time.Second
	crashTestBound      = 90 * time.Second
	crashWorkerLifetime = 2 * time.Minute // a worker the parent failed to kill still exits
)

// TestHelperWorker is not a test: run with workerEnv set, it is the worker process of
// TestWorkerKilledWhileHoldingLock. Its handler takes the task's lock, writes
// crashMarker and blocks until the parent kills the process.
func TestHelperWorker(t *testing.T) {
	addr := os.Getenv(workerEnv)
	if addr == "" {
		return
	}
	opt := asynq.RedisClientOpt{Addr: addr}
	rdb := redis.NewClient(&redis.Options{Addr: addr})
	defer rdb.Close()
	mw := asynqmutex.Middleware(mutex.New(rdb), asynqmutex.On("id"), asynqmutex.TTL(crashTTL))
	h := mw(asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		fence, _ := asynqmutex.Fence(ctx)
		id, _ := asynq.GetTaskID(ctx)
		if err := rdb.Set(ctx, crashMarker, fmt.Sprintf("%d %s", fence, id), 0).Err(); err != nil {
			return err
		}
		select {
		case <-ctx.Done():
		case <-time.After(crashWorkerLifetime):
		}
		return errors.New("worker: handler was not killed")
	}))
	srv := asynq.NewServer(opt, asynqmutex.Configure(asynq.Config{
		Concurrency: 1, TaskCheckInterval: taskCheck, DelayedTaskCheckInterval: delayedCheck,
		Logger: quietLogger{}, LogLevel: asynq.WarnLevel,
	}))
	if err := srv.Start(h); err != nil {
		t.Fatalf("worker: Start: %v", err)
	}
	time.Sleep(crashWorkerLifetime)
	srv.Shutdown()
	t.Fatalf("worker: not killed within %v", crashWorkerLifetime)
}

// syncBuffer is a bytes.Buffer safe for the exec package's copying goroutine.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestWorkerKilledWhileHoldingLock kills a worker process with SIGKILL while its
// handler holds a task's lock (TTL 2s): the key frees within the TTL, and the task is
// not lost: asynq's recoverer hands it to another server, whose middleware takes the
// lock and runs it to completion.
//
// It takes about a minute: asynq only recovers a task 30s after its 30s lease ran
// out, and has no setting to shorten either.
func TestWorkerKilledWhileHoldingLock(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: waits about 65s for asynq's task lease (30s) and recoverer cutoff (30s) to pass")
	}
	t.Parallel()
	bound := time.Now().Add(crashTestBound)
	ctx := context.Background()
	e := newEnv(t)
	key := lockKey(t, "crash", "k9")
	task := e.enqueue(t, "crash", payload(t, map[string]string{"id": "k9"}), asynq.MaxRetry(3), asynq.Retention(time.Hour))

	out := &syncBuffer{}
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperWorker$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), workerEnv+"="+e.redis.Addr())
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting worker process: %v", err)
	}
	var waited atomic.Bool
	wait := func() {
		if waited.CompareAndSwap(false, true) {
			_ = cmd.Wait()
		}
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		wait()
	})

	var workerFence int64
	waitFor(t, 30*time.Second, "the worker's handler to hold the lock", func() (bool, string) {
		v, err := e.rdb.Get(ctx, crashMarker).Result()
		if err != nil {
			return false, fmt.Sprintf("GET %s: %v; worker output:\n%s", crashMarker, err, out.String())
		}
		f, id, _ := strings.Cut(v, " ")
		if id != task.ID {
			t.Fatalf("worker ran task %q, want %q", id, task.ID)
		}
		workerFence, _ = strconv.ParseInt(f, 10, 64)
		return true, ""
	})
	if workerFence <= 0 {
		t.Errorf("worker handler's Fence = %d, want > 0", workerFence)
	}
	// Positive control for the recovery check below: the worker does hold the key.
	if _, err := e.locks.TryLock(ctx, key, time.Second); !errors.Is(err, mutex.ErrNotObtained) {
		t.Fatalf("TryLock while the worker holds %s = %v, want ErrNotObtained", key, err)
	}
	leaseEnd, err := e.rdb.ZScore(ctx, "asynq:{default}:lease", task.ID).Result()
	if err != nil {
		t.Fatalf("reading the task's asynq lease: %v", err)
	}

	if err := cmd.Process.Kill(); err != nil {
		t.Fatalf("SIGKILL worker: %v", err)
	}
	wait()
	killed := time.Now()

	// (a) The key frees within its TTL: a waiter bounded by TTL + 2s gets it.
	l, err := e.locks.Lock(ctx, key, time.Second, mutex.MaxWait(crashTTL+2*time.Second))
	if err != nil {
		t.Fatalf("Lock(%s, MaxWait(TTL+2s)) after the kill = %v, want the lock", key, err)
	}
	freed := time.Since(killed)
	if l.Fence() <= workerFence {
		t.Errorf("fence after the crash = %d, want > the dead worker's %d", l.Fence(), workerFence)
	}
	if err := l.Unlock(ctx); err != nil {
		t.Fatalf("Unlock: %v", err)
	}

	// asynq still counts the task as active: its worker is gone, its lease is not.
	if info, desc := taskInfo(e.insp, "default", task.ID); info == nil || info.State != asynq.TaskStateActive {
		t.Fatalf("after the kill: %s; want the task still active until asynq recovers it", desc)
	}

	// (b) The task is not lost. Start the second server once the recoverer's cutoff has
	// passed the lease, so the recovery it runs at start picks the task up.
	recoverAt := time.Unix(int64(leaseEnd), 0).Add(asynqRecoverCutoff + time.Second)
	t.Logf("lock freed %v after SIGKILL; asynq lease ends %v after the kill, recoverable %v after it",
		freed.Round(time.Millisecond), time.Until(time.Unix(int64(leaseEnd), 0)).Round(time.Second), time.Until(recoverAt).Round(time.Second))
	if d := time.Until(recoverAt); d > asynqLease+asynqRecoverCutoff+5*time.Second || recoverAt.Add(15*time.Second).After(bound) {
		t.Fatalf("asynq would recover the task only in %v, past the test's bound", d)
	}
	time.Sleep(time.Until(recoverAt))

	var runs atomic.Int32
	locks, _ := newLocks(t, e.opt)
	mw := asynqmutex.Middleware(locks, asynqmutex.On("id"), asynqmutex.TTL(crashTTL))
	// asynq's default delay after a lease expiry is 15-45s; one second keeps this short.
	fast := func(int, error, *asynq.Task) time.Duration { return time.Second }
	startServer(t, e.opt, asynqmutex.Configure(asynq.Config{Concurrency: 1, RetryDelayFunc: fast}), mw(countingHandler(&runs)))

	info := waitState(t, e.insp, "default", task.ID, asynq.TaskStateCompleted, time.Until(bound))
	if n := runs.Load(); n != 1 {
		t.Errorf("the recovered task ran %d times on the second server, want 1", n)
	}
	if info.Retried != 1 || !strings.Contains(info.LastErr, "lease expired") {
		t.Errorf("recovered task: %s; want Retried 1 with asynq's lease-expired error", describeTask(info))
	}
	t.Logf("task completed %v after SIGKILL", time.Since(killed).Round(time.Second))
}
