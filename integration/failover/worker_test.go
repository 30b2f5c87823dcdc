//go:build linux

package failover

// Worker processes: this test binary re-executed with workerEnv set to a JSON
// workerSpec. Each runs goroutines that take the lock on random keys through one
// mutex.Client (one process, one client, as an asynq worker has) and run the
// referee's checked section, until the parent sets the referee's stop key, a
// count of sections is reached, or the worker's lifetime ends.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex/mutex"
)

// workerEnv carries a worker's JSON workerSpec; when set, TestMain runs the worker
// instead of the tests.
const workerEnv = "ASYNQMUTEX_FAILOVER_WORKER"

// connSpec says how a process reaches the lock Redis.
type connSpec struct {
	Kind       string   // "sentinel", "cluster" or "direct"
	Addrs      []string // sentinels, cluster seeds, or the one server
	MasterName string   // sentinel only
	Tuned      bool     // the shorter timeouts and retries below
	// ReloadOnError (cluster only) reloads the slot map when a command fails on a
	// network error (reloadHook).
	ReloadOnError bool
	// WaitReplicas, if above 0, makes the lock wait for that many replicas after every
	// grant and renewal (mutex.WaitReplicas, with waitTimeout).
	WaitReplicas int
}

// waitTimeout is how long a lock with WaitReplicas waits for the replicas: below the
// tuned ReadTimeout, which bounds the round trip of a script and its WAIT.
const waitTimeout = 250 * time.Millisecond

// newLocks makes the lock client c describes, on rdb (from newRedis(c)).
func newLocks(c connSpec, rdb redis.UniversalClient) *mutex.Client {
	if c.WaitReplicas > 0 {
		return mutex.New(rdb, mutex.WaitReplicas(c.WaitReplicas, waitTimeout))
	}
	return mutex.New(rdb)
}

// The client options the battery compares with go-redis's defaults: dials and
// replies to a dead or stopped server give up in a fraction of the defaults (5 s
// dial, 3 s read), and a failed command is tried again soon, on another
// connection, which after a failover dials the new master.
const (
	tunedDial    = 250 * time.Millisecond
	tunedRead    = 500 * time.Millisecond
	tunedRetries = 5
	tunedBackoff = 50 * time.Millisecond
)

// newRedis makes the go-redis client c describes.
func newRedis(c connSpec) redis.UniversalClient {
	switch c.Kind {
	case "sentinel":
		o := &redis.FailoverOptions{MasterName: c.MasterName, SentinelAddrs: c.Addrs}
		if c.Tuned {
			o.DialTimeout, o.ReadTimeout, o.WriteTimeout = tunedDial, tunedRead, tunedRead
			o.MaxRetries, o.MinRetryBackoff, o.MaxRetryBackoff = tunedRetries, 10*time.Millisecond, tunedBackoff
		}
		return redis.NewFailoverClient(o)
	case "cluster":
		o := &redis.ClusterOptions{Addrs: c.Addrs}
		if c.Tuned {
			o.DialTimeout, o.ReadTimeout, o.WriteTimeout = tunedDial, tunedRead, tunedRead
			o.MaxRetries, o.MinRetryBackoff, o.MaxRetryBackoff = tunedRetries, 10*time.Millisecond, tunedBackoff
		}
		c2 := redis.NewClusterClient(o)
		if c.ReloadOnError {
			c2.AddHook(&reloadHook{c: c2})
		}
		return c2
	default:
		return redis.NewClient(&redis.Options{Addr: c.Addrs[0]})
	}
}

// reloadHook makes a Cluster client reload its slot map after a command failed on a
// network error. Without it, go-redis sends a dead master's slots to the dead master
// until a MOVED reply or its ten-second refresh of the map; a dead server sends no
// MOVED. Reloads run in the background, at most one at a time.
type reloadHook struct {
	c    *redis.ClusterClient
	last atomic.Int64 // unix nanoseconds of the last reload asked
}

func (h *reloadHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *reloadHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		h.check(ctx, err)
		return err
	}
}

func (h *reloadHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		err := next(ctx, cmds)
		h.check(ctx, err)
		return err
	}
}

// reloadEvery spaces reloads: a dead node fails every command sent to it.
const reloadEvery = 100 * time.Millisecond

func (h *reloadHook) check(ctx context.Context, err error) {
	var ne net.Error
	if !errors.As(err, &ne) {
		return
	}
	if t, last := time.Now().UnixNano(), h.last.Load(); t-last > int64(reloadEvery) && h.last.CompareAndSwap(last, t) {
		h.c.ReloadState(ctx)
	}
}

// workerSpec tells a worker process what to do.
type workerSpec struct {
	ID          int // 1, 2, ...
	Conn        connSpec
	RefereeAddr string
	Keys        []string
	TTL         time.Duration
	Hold        [2]time.Duration // a section's hold, drawn between the two; zero: 1-3 ms
	Goroutines  int
	MaxSections int           // per goroutine
	Lifetime    time.Duration // the worker gives up and exits after this long
	// RewindFences makes the worker a deliberately broken lock, for positive
	// controls: every other section uses and records a fence far below the one the
	// lock gave it.
	RewindFences bool
	Seed         uint64
	Report       string // path of the JSON report; set by startWorker
}

// errKind classifies how a WithLock call ended.
type errKind string

const (
	kindOK          errKind = ""
	kindNotObtained errKind = "not-obtained"
	kindUnconfirmed errKind = "unconfirmed" // not obtained: the replicas did not confirm the grant
	kindNotHeld     errKind = "not-held"    // the lease was lost
	kindOther       errKind = "other"       // a Redis error
)

// attempt is one WithLock call. Times are now() values, 0 when it did not happen.
type attempt struct {
	Worker   int
	Key      string
	Fence    int64 // the fence the section used
	Call     int64
	Acquired int64 // fn started
	FnEnd    int64
	LostAt   int64 // fn's context was cancelled with a cause wrapping ErrNotHeld
	Kind     errKind
	Err      string `json:",omitempty"`
	Section  sectionResult
}

func (a attempt) ran() bool { return a.Acquired != 0 }

// workerReport is what a worker leaves behind.
type workerReport struct {
	ID       int
	Attempts []attempt
	Error    string
}

// workerMain runs in a worker process and returns its exit code.
func workerMain(raw string) int {
	var spec workerSpec
	if err := json.Unmarshal([]byte(raw), &spec); err != nil {
		fmt.Fprintf(os.Stderr, "worker: bad spec: %v\n", err)
		return 2
	}
	ctx, cancel := context.WithTimeout(context.Background(), spec.Lifetime)
	defer cancel()
	rdb := newRedis(spec.Conn)
	locks := newLocks(spec.Conn, rdb)
	ref := &referee{rdb: redis.NewClient(&redis.Options{Addr: spec.RefereeAddr})}

	var mu sync.Mutex
	rep := &workerReport{ID: spec.ID}
	var wg sync.WaitGroup
	errs := make([]error, spec.Goroutines)
	for g := range spec.Goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(spec.Seed, uint64(spec.ID*100+g)))
			writer := func(i int) string { return fmt.Sprintf("%d.%d.%d", spec.ID, g, i) }
			for i := range spec.MaxSections {
				if stop, err := ref.stopped(ctx); err != nil || stop || ctx.Err() != nil {
					errs[g] = err
					return
				}
				a, err := runOne(ctx, locks, ref, spec, spec.Keys[rng.IntN(len(spec.Keys))], writer(i), spec.RewindFences && i%2 == 1, rng)
				mu.Lock()
				rep.Attempts = append(rep.Attempts, a)
				mu.Unlock()
				if err != nil {
					errs[g] = err
					return
				}
				if a.Kind != kindOK {
					// A failing Redis answers at once; do not spin on it.
					time.Sleep(5*time.Millisecond + time.Duration(rng.Int64N(int64(10*time.Millisecond))))
				}
			}
		}()
	}
	wg.Wait()
	_ = locks.Close()
	_ = rdb.Close()
	_ = ref.rdb.Close()
	if err := errors.Join(errs...); err != nil {
		rep.Error = err.Error()
	}
	b, err := json.Marshal(rep)
	if err == nil {
		err = os.WriteFile(spec.Report, b, 0o600)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "worker %d: writing report: %v\n", spec.ID, err)
		return 1
	}
	if rep.Error != "" {
		fmt.Fprintf(os.Stderr, "worker %d: %s\n", spec.ID, rep.Error)
		return 1
	}
	return 0
}

// callTimeout bounds one WithLock call, its wait included; a failover stalls calls
// for a few seconds at most.
const callTimeout = 15 * time.Second

// runOne makes one WithLock call on key and runs the checked section under it. The
// error is a referee (harness) error; how the call ended is in the attempt.
func runOne(ctx context.Context, locks *mutex.Client, ref *referee, spec workerSpec, key, writer string, rewind bool, rng *rand.Rand) (attempt, error) {
	a := attempt{Worker: spec.ID, Key: key, Call: now()}
	cctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	var secErr error
	lost := make(chan int64, 1)
	err := locks.WithLock(cctx, key, spec.TTL, func(fctx context.Context) error {
		a.Acquired = now()
		l, _ := mutex.FromContext(fctx)
		a.Fence = l.Fence()
		if rewind {
			a.Fence /= 2
		}
		context.AfterFunc(fctx, func() {
			var at int64
			if errors.Is(context.Cause(fctx), mutex.ErrNotHeld) {
				at = now()
			}
			lost <- at
		})
		a.Section, secErr = ref.section(fctx, key, a.Fence, writer, hold(rng, spec.Hold))
		a.FnEnd = now()
		return secErr
	}, mutex.MaxWait(2*spec.TTL))
	if a.ran() {
		select {
		case a.LostAt = <-lost:
		case <-time.After(5 * time.Second):
			return a, errors.New("fn's context was not cancelled when WithLock returned")
		}
	}
	switch {
	case err == nil:
		a.Kind = kindOK
	case !a.ran() && errors.As(err, new(*mutex.ReplicasError)):
		a.Kind = kindUnconfirmed
	case !a.ran() && errors.Is(err, mutex.ErrNotObtained):
		a.Kind = kindNotObtained
	case errors.Is(err, mutex.ErrNotHeld):
		a.Kind = kindNotHeld
	default:
		a.Kind = kindOther
	}
	if err != nil {
		a.Err = err.Error()
	}
	return a, secErr
}

// worker is a worker process started by startWorker.
type worker struct {
	spec workerSpec
	cmd  *exec.Cmd
	out  *syncBuffer
	done chan struct{}
	err  error
}

// startWorker re-executes the test binary as a worker running spec, and kills it in
// t.Cleanup if it is still running.
func startWorker(t testing.TB, spec workerSpec) *worker {
	t.Helper()
	if spec.Seed == 0 {
		spec.Seed = rand.Uint64()
	}
	spec.Report = filepath.Join(t.TempDir(), "worker-"+strconv.Itoa(spec.ID)+".json")
	raw, err := json.Marshal(spec)
	if err != nil {
		t.Fatalf("worker spec: %v", err)
	}
	w := &worker{spec: spec, out: &syncBuffer{}, done: make(chan struct{})}
	w.cmd = exec.Command(os.Args[0])
	w.cmd.Env = append(os.Environ(), workerEnv+"="+string(raw))
	w.cmd.Stdout, w.cmd.Stderr = w.out, w.out
	if err := w.cmd.Start(); err != nil {
		t.Fatalf("starting worker %d: %v", spec.ID, err)
	}
	go func() { w.err = w.cmd.Wait(); close(w.done) }()
	t.Cleanup(func() {
		select {
		case <-w.done:
		default:
			_ = w.cmd.Process.Kill()
			<-w.done
		}
		if strings.Contains(w.out.String(), "DATA RACE") {
			t.Errorf("worker %d reported a data race:\n%s", spec.ID, w.out.String())
		}
	})
	return w
}

// wait waits up to timeout for the worker to exit and returns its report, failing
// the test if it does not exit in time, fails, or leaves no report.
func (w *worker) wait(t testing.TB, timeout time.Duration) *workerReport {
	t.Helper()
	select {
	case <-w.done:
	case <-time.After(timeout):
		_ = w.cmd.Process.Kill()
		<-w.done
		t.Fatalf("worker %d did not exit within %v; output:\n%s", w.spec.ID, timeout, w.out.String())
	}
	b, err := os.ReadFile(w.spec.Report)
	if err != nil {
		t.Fatalf("worker %d exited (%v) without a report: %v; output:\n%s", w.spec.ID, w.err, err, w.out.String())
	}
	var rep workerReport
	if err := json.Unmarshal(b, &rep); err != nil {
		t.Fatalf("worker %d report: %v", w.spec.ID, err)
	}
	if w.err != nil || rep.Error != "" {
		t.Fatalf("worker %d failed: exit %v, error %q; output:\n%s", w.spec.ID, w.err, rep.Error, w.out.String())
	}
	return &rep
}

// syncBuffer is a bytes.Buffer safe for exec's copying goroutine; it keeps the first
// megabyte.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.b.Len() > 1<<20 {
		return len(p), nil
	}
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
