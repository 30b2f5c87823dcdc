package integration

// Helpers of TestAsynqEndToEndWithKill: the worker process (this test binary
// re-executed with e2eWorkerEnv set), the referee scripts its handler runs, and the
// parent's handle on a worker process.
//
// The referee is a redis-server of its own that no fault touches. Its keys:
//
//	occ:<key>       handlers inside the critical section of <key> now
//	overlaps        entries that found occ:<key> already taken (must stay 0)
//	stale           sections whose fence was not above the key's last one (must stay 0)
//	checklog        one line per overlap or stale fence, for the failure message
//	fence:<key>     the last fence seen in a section of <key>
//	active          handlers inside a section now, any key; maxactive: the most ever
//	inside:<pid>    hash n -> key: the sections process <pid> is in now
//	flight:<pid>    hash n -> task ID: tasks inside process <pid>'s handler chain now
//	                (waiting for the lock included)
//	done            set of task numbers whose section completed; runs:<n>: how many times
//	doneby:<pid>    list of the task numbers process <pid> completed
//	dead            set of pids declared dead; their later commands are ignored and
//	                counted in ignored
//	lockederrs      *asynqmutex.LockedError values the ErrorHandlers saw
//	othererrs       any other error they saw (must stay 0); errlog: their text
//	ready           list of pids whose asynq.Server started

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex"
	"github.com/asynqmutex/asynqmutex/mutex"
)

// e2eWorkerEnv, set to a JSON e2eWorkerSpec, turns TestAsynqE2EWorker into a worker
// process of TestAsynqEndToEndWithKill.
const e2eWorkerEnv = "ASYNQMUTEX_INTEGRATION_E2E_WORKER"

const (
	e2eTaskType       = "e2e:txn"
	e2eConcurrency    = 10
	e2eTTL            = 5 * time.Second // lock lease; renewed every TTL/3
	e2eMaxWait        = 2 * time.Second // then the default policy, Park
	e2eWorkerLifetime = 4 * time.Minute // a worker the parent lost track of still exits
	e2eRefTimeout     = 10 * time.Second
)

type e2eWorkerSpec struct {
	Asynq   string `json:"asynq"`   // asynq and lock redis-server
	Referee string `json:"referee"` // referee redis-server
	// Mode, for TestParkFleet: "park" for the middleware's defaults, or one of its
	// controls: "bare" (no middleware), "noconfigure" (the defaults without
	// Configure), "maxwait" (MaxWait(10s)), "twice" (the defaults, and the section of
	// every 25th task run twice). Empty for TestAsynqEndToEndWithKill's options.
	Mode string `json:"mode,omitempty"`
	// Work is how long a section works; 2-6ms when zero.
	Work time.Duration `json:"work,omitempty"`
	// Inspector is the address of asynq's Redis for the middleware's Inspector (the
	// one that starts parked tasks); Asynq when empty.
	Inspector string `json:"inspector,omitempty"`
	// HoldFirst makes the section of task 0 wait until the referee has "release".
	HoldFirst bool `json:"hold_first,omitempty"`
}

type e2ePayload struct {
	Key string `json:"key"`
	N   int    `json:"n"`
}

func e2eTaskID(n int) string { return fmt.Sprintf("e2e-%04d", n) }

// e2eEnterScript enters the checked section of a key: occupancy, the fence check and
// the global concurrency count, and notes the section under the process's pid so the
// parent can undo it if the process is killed inside it.
//
// KEYS: occ:<k>, inside:<pid>, active, maxactive, overlaps, checklog, dead, fence:<k>,
// stale, ignored. ARGV: n, k, pid, fence. Returns the occupancy it found (1 = alone),
// or -1 when pid was declared dead (nothing is recorded then).
var e2eEnterScript = redis.NewScript(`
if redis.call('SISMEMBER', KEYS[7], ARGV[3]) == 1 then
  redis.call('INCR', KEYS[10])
  return -1
end
local o = redis.call('INCR', KEYS[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
local a = redis.call('INCR', KEYS[3])
if a > tonumber(redis.call('GET', KEYS[4]) or '0') then
  redis.call('SET', KEYS[4], a)
end
if o ~= 1 then
  redis.call('INCR', KEYS[5])
  redis.call('RPUSH', KEYS[6], 'overlap: task ' .. ARGV[1] .. ' (pid ' .. ARGV[3] .. ') entered ' .. ARGV[2] .. ' at occupancy ' .. o)
end
local f = tonumber(ARGV[4])
local lf = tonumber(redis.call('GET', KEYS[8]) or '0')
if f <= lf then
  redis.call('INCR', KEYS[9])
  redis.call('RPUSH', KEYS[6], 'stale fence: task ' .. ARGV[1] .. ' (pid ' .. ARGV[3] .. ') on ' .. ARGV[2] .. ' fence ' .. ARGV[4] .. ' <= last ' .. lf)
else
  redis.call('SET', KEYS[8], ARGV[4])
end
return o
`)

// e2eExitScript records the task as done and leaves the section, in one step.
//
// KEYS: occ:<k>, inside:<pid>, active, done, runs:<n>, doneby:<pid>, dead, ignored.
// ARGV: n, pid. Returns 1, or -1 when pid was declared dead.
var e2eExitScript = redis.NewScript(`
if redis.call('SISMEMBER', KEYS[7], ARGV[2]) == 1 then
  redis.call('INCR', KEYS[8])
  return -1
end
redis.call('SADD', KEYS[4], ARGV[1])
redis.call('INCR', KEYS[5])
redis.call('RPUSH', KEYS[6], ARGV[1])
redis.call('DECR', KEYS[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('DECR', KEYS[3])
return 1
`)

// e2eRepairScript declares pid dead and takes back the occupancy its handlers left in
// their sections when it was killed. It returns the hash inside:<pid> it undid, as a
// flat list n1, key1, n2, key2, ...
//
// KEYS: inside:<pid>, dead, active. ARGV: pid.
var e2eRepairScript = redis.NewScript(`
redis.call('SADD', KEYS[2], ARGV[1])
local h = redis.call('HGETALL', KEYS[1])
for i = 1, #h, 2 do
  redis.call('DECR', 'occ:' .. h[i + 1])
  redis.call('DECR', KEYS[3])
end
redis.call('DEL', KEYS[1])
return h
`)

// TestAsynqE2EWorker is not a test: run with e2eWorkerEnv set, it is a worker process
// of TestAsynqEndToEndWithKill. It runs an asynq.Server (Concurrency 10, Configure,
// the middleware On("key") with MaxWait and the default policy, Park) until its
// stdin closes, then shuts down cleanly.
func TestAsynqE2EWorker(t *testing.T) {
	raw := os.Getenv(e2eWorkerEnv)
	if raw == "" {
		return
	}
	var spec e2eWorkerSpec
	if err := json.Unmarshal([]byte(raw), &spec); err != nil {
		t.Fatalf("worker: bad %s %q: %v", e2eWorkerEnv, raw, err)
	}
	pid := strconv.Itoa(os.Getpid())
	ref := redis.NewClient(&redis.Options{Addr: spec.Referee})
	defer ref.Close()
	rdb := redis.NewClient(&redis.Options{Addr: spec.Asynq})
	defer rdb.Close()
	locks := mutex.New(rdb)
	defer locks.Close()

	refCtx := func(ctx context.Context) (context.Context, context.CancelFunc) {
		return context.WithTimeout(context.WithoutCancel(ctx), e2eRefTimeout)
	}
	section := asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		var p e2ePayload
		if err := json.Unmarshal(task.Payload(), &p); err != nil {
			return fmt.Errorf("worker: bad payload %q: %w", task.Payload(), err)
		}
		fence, ok := asynqmutex.Fence(ctx)
		if f, bare := ctx.Value(bareFence{}).(int64); bare {
			fence, ok = f, true
		}
		if !ok {
			return errors.New("worker: handler runs without a lock")
		}
		defer addSectionTime(ctx, time.Now())
		rctx, cancel := refCtx(ctx)
		defer cancel()
		n := strconv.Itoa(p.N)
		if err := e2eEnterScript.Run(rctx, ref,
			[]string{"occ:" + p.Key, "inside:" + pid, "active", "maxactive", "overlaps", "checklog", "dead", "fence:" + p.Key, "stale", "ignored"},
			n, p.Key, pid, fence).Err(); err != nil {
			return fmt.Errorf("worker: referee enter: %w", err)
		}
		work := spec.Work
		if work == 0 {
			work = time.Duration(2+rand.IntN(5)) * time.Millisecond
		}
		time.Sleep(work)
		for i := 0; spec.HoldFirst && p.N == 0 && i < 6000; i++ { // 60s at most
			if n, _ := ref.Exists(rctx, "release").Result(); n == 1 {
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
		if err := e2eExitScript.Run(rctx, ref,
			[]string{"occ:" + p.Key, "inside:" + pid, "active", "done", "runs:" + n, "doneby:" + pid, "dead", "ignored"},
			n, pid).Err(); err != nil {
			return fmt.Errorf("worker: referee exit: %w", err)
		}
		return nil
	})
	var locked asynq.Handler
	switch spec.Mode {
	case "":
		locked = asynqmutex.Middleware(locks, asynqmutex.On("key"), asynqmutex.MaxWait(e2eMaxWait), asynqmutex.TTL(e2eTTL))(section)
	case "bare":
		locked = asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
			// No lock: a fence that only grows, so that the section's checks run.
			return section.ProcessTask(context.WithValue(ctx, bareFence{}, time.Now().UnixNano()), task)
		})
	case "maxwait":
		locked = asynqmutex.Middleware(locks, asynqmutex.On("key"), asynqmutex.MaxWait(10*time.Second), asynqmutex.TTL(e2eTTL))(section)
	case "twice":
		twice := asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
			var p e2ePayload
			if err := section.ProcessTask(ctx, task); err != nil || json.Unmarshal(task.Payload(), &p) != nil || p.N%25 != 0 {
				return err
			}
			return section.ProcessTask(ctx, task)
		})
		locked = asynqmutex.Middleware(locks, asynqmutex.On("key"), asynqmutex.TTL(e2eTTL))(twice)
	default: // park, noconfigure
		opts := []asynqmutex.Option{asynqmutex.On("key"), asynqmutex.TTL(e2eTTL)}
		if spec.Inspector != "" {
			insp := asynq.NewInspector(asynq.RedisClientOpt{Addr: spec.Inspector})
			defer insp.Close()
			opts = append(opts, asynqmutex.Inspector(insp))
		}
		locked = asynqmutex.Middleware(locks, opts...)(section)
	}
	// flight:<pid> lists the tasks inside the handler chain, lock wait included;
	// held:<key> adds up, in µs, how long its tasks held a worker outside their
	// section.
	h := asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		var p e2ePayload
		_ = json.Unmarshal(task.Payload(), &p)
		id, _ := asynq.GetTaskID(ctx)
		rctx, cancel := refCtx(ctx)
		defer cancel()
		ref.HSet(rctx, "flight:"+pid, p.N, id)
		defer ref.HDel(rctx, "flight:"+pid, strconv.Itoa(p.N))
		start := time.Now()
		sctx := withSectionTimer(ctx)
		err := locked.ProcessTask(sctx, task)
		ref.IncrBy(rctx, "held:"+p.Key, (time.Since(start) - sectionTime(sctx)).Microseconds())
		return err
	})

	base, cancelBase := context.WithCancel(context.Background())
	defer cancelBase()
	configure := asynqmutex.Configure
	if spec.Mode == "noconfigure" {
		configure = func(cfg asynq.Config) asynq.Config { return cfg }
	}
	srv := asynq.NewServer(asynq.RedisClientOpt{Addr: spec.Asynq}, configure(asynq.Config{
		Concurrency:              e2eConcurrency,
		TaskCheckInterval:        taskCheck,
		DelayedTaskCheckInterval: delayedCheck,
		ShutdownTimeout:          5 * time.Second,
		BaseContext:              func() context.Context { return base },
		Logger:                   quietLogger{},
		LogLevel:                 asynq.WarnLevel,
		// Only asynq's recoverer fails a task here (ErrLeaseExpired, for the tasks of a
		// killed worker); asynq's default delay for that is 15-45s, one second keeps
		// the test short. LockedError delays still come from Configure's RetryDelay.
		RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return time.Second },
		ErrorHandler: asynq.ErrorHandlerFunc(func(ctx context.Context, task *asynq.Task, err error) {
			rctx, cancel := refCtx(ctx)
			defer cancel()
			var le *asynqmutex.LockedError
			if errors.As(err, &le) {
				ref.Incr(rctx, "lockederrs")
				return
			}
			ref.Incr(rctx, "othererrs")
			ref.RPush(rctx, "errlog", fmt.Sprintf("pid %s task %s: %v", pid, task.Payload(), err))
		}),
	}))
	if err := srv.Start(h); err != nil {
		t.Fatalf("worker: Start: %v", err)
	}
	if err := ref.RPush(context.Background(), "ready", pid).Err(); err != nil {
		t.Errorf("worker: announcing readiness: %v", err)
	}

	stdinClosed := make(chan struct{})
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		close(stdinClosed)
	}()
	select {
	case <-stdinClosed:
	case <-time.After(e2eWorkerLifetime):
		t.Errorf("worker: not stopped within %v", e2eWorkerLifetime)
	}
	cancelBase()
	srv.Shutdown()
}

// bareFence is the context key of the fence a section of mode "bare" uses: it runs
// under no lock.
type bareFence struct{}

// sectionTimer is the context key of the time a task spent in its sections.
type sectionTimer struct{}

func withSectionTimer(ctx context.Context) context.Context {
	return context.WithValue(ctx, sectionTimer{}, new(time.Duration))
}

func addSectionTime(ctx context.Context, since time.Time) {
	if d, ok := ctx.Value(sectionTimer{}).(*time.Duration); ok {
		*d += time.Since(since)
	}
}

func sectionTime(ctx context.Context) time.Duration {
	if d, ok := ctx.Value(sectionTimer{}).(*time.Duration); ok {
		return *d
	}
	return 0
}

// e2eProc is the parent's handle on one worker process.
type e2eProc struct {
	name  string
	cmd   *exec.Cmd
	stdin io.WriteCloser
	out   *syncBuffer
	done  chan struct{} // closed when the process has been reaped
	err   error         // its exit status, once done is closed
	once  sync.Once
}

func startE2EWorker(t testing.TB, name string, spec e2eWorkerSpec) *e2eProc {
	t.Helper()
	raw, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	p := &e2eProc{name: name, out: &syncBuffer{}, done: make(chan struct{})}
	p.cmd = exec.Command(os.Args[0], "-test.run=^TestAsynqE2EWorker$", "-test.count=1", "-test.v")
	p.cmd.Env = append(os.Environ(), e2eWorkerEnv+"="+string(raw))
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.out
	if p.stdin, err = p.cmd.StdinPipe(); err != nil {
		t.Fatalf("%s: stdin pipe: %v", name, err)
	}
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("starting %s: %v", name, err)
	}
	go func() {
		p.err = p.cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		_ = p.cmd.Process.Kill()
		<-p.done
	})
	return p
}

func (p *e2eProc) pid() int { return p.cmd.Process.Pid }

func (p *e2eProc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// kill sends SIGKILL and waits until the process has been reaped.
func (p *e2eProc) kill(t testing.TB) {
	t.Helper()
	if err := p.cmd.Process.Kill(); err != nil {
		t.Fatalf("SIGKILL %s: %v", p.name, err)
	}
	<-p.done
}

// stop closes the worker's stdin, which shuts its server down, and waits for it to
// exit; it reports the exit status (the worker's -race and goleak checks included).
func (p *e2eProc) stop(timeout time.Duration) error {
	p.once.Do(func() { _ = p.stdin.Close() })
	select {
	case <-p.done:
		return p.err
	case <-time.After(timeout):
		_ = p.cmd.Process.Kill()
		<-p.done
		return fmt.Errorf("did not exit within %v of its stdin closing; killed", timeout)
	}
}
