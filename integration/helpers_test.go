package integration

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
	"github.com/asynqmutex/asynqmutex/mutex"
)

// Small asynq intervals keep the suite fast: retries are moved back to their queue
// every 100ms instead of 5s, and idle processors look for work every ~50ms.
const (
	delayedCheck = 100 * time.Millisecond
	taskCheck    = 50 * time.Millisecond
	pollEvery    = 20 * time.Millisecond
)

// lockKey is the key the middleware derives for On(fields...): the JSON array text
// of the task type followed by the field values.
func lockKey(t testing.TB, taskType string, values ...any) string {
	t.Helper()
	b, err := json.Marshal(append([]any{taskType}, values...))
	if err != nil {
		t.Fatalf("json.Marshal: %v", err)
	}
	return string(b)
}

// redisLockKey is the Redis key of a lock as the mutex package documents it:
// prefix + "{" + encoded key + "}". The keys used here need no escaping.
func redisLockKey(t testing.TB, key string) string {
	t.Helper()
	if strings.ContainsAny(key, "%{}#") || len(key) > 256 {
		t.Fatalf("redisLockKey: key %q would be escaped or digested", key)
	}
	return mutex.DefaultPrefix + "{" + key + "}"
}

func payload(t testing.TB, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatalf("json.Marshal: %v", err)
	}
	return b
}

// quietLogger drops asynq's logs unless ASYNQMUTEX_TEST_LOG is set: asynq logs every
// retry at warning level, which would bury test output.
type quietLogger struct{}

func (quietLogger) log(level string, args ...any) {
	if os.Getenv("ASYNQMUTEX_TEST_LOG") != "" {
		fmt.Fprintf(os.Stderr, "asynq %s: %s\n", level, fmt.Sprint(args...))
	}
}
func (l quietLogger) Debug(args ...any) {}
func (l quietLogger) Info(args ...any)  {}
func (l quietLogger) Warn(args ...any)  { l.log("WARN", args...) }
func (l quietLogger) Error(args ...any) { l.log("ERROR", args...) }
func (l quietLogger) Fatal(args ...any) { l.log("FATAL", args...) }

// startServer starts a real asynq.Server on opt running h, with the test's small
// intervals filled in where cfg leaves them zero. Handlers get a base context that is
// cancelled before Shutdown, so a handler still waiting for a lock cannot hold the
// shutdown (and leak its goroutine past it).
func startServer(t testing.TB, opt asynq.RedisConnOpt, cfg asynq.Config, h asynq.Handler) *asynq.Server {
	t.Helper()
	if cfg.Concurrency == 0 {
		cfg.Concurrency = 4
	}
	if cfg.DelayedTaskCheckInterval == 0 {
		cfg.DelayedTaskCheckInterval = delayedCheck
	}
	if cfg.TaskCheckInterval == 0 {
		cfg.TaskCheckInterval = taskCheck
	}
	if cfg.ShutdownTimeout == 0 {
		cfg.ShutdownTimeout = 5 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = quietLogger{}
	}
	if cfg.LogLevel == 0 {
		cfg.LogLevel = asynq.WarnLevel
	}
	base, cancel := context.WithCancel(context.Background())
	cfg.BaseContext = func() context.Context { return base }
	srv := asynq.NewServer(opt, cfg)
	if err := srv.Start(h); err != nil {
		cancel()
		t.Fatalf("asynq.Server.Start: %v", err)
	}
	t.Cleanup(func() {
		cancel()
		srv.Shutdown()
	})
	return srv
}

func newClient(t testing.TB, opt asynq.RedisConnOpt) *asynq.Client {
	t.Helper()
	c := asynq.NewClient(opt)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func newInspector(t testing.TB, opt asynq.RedisConnOpt) *asynq.Inspector {
	t.Helper()
	i := asynq.NewInspector(opt)
	t.Cleanup(func() { _ = i.Close() })
	return i
}

// newLocks builds a mutex.Client from the same settings the asynq server uses, as the
// README tells users to.
func newLocks(t testing.TB, opt asynq.RedisConnOpt) (*mutex.Client, redis.UniversalClient) {
	t.Helper()
	rdb, ok := opt.MakeRedisClient().(redis.UniversalClient)
	if !ok {
		t.Fatalf("%T.MakeRedisClient() is not a redis.UniversalClient", opt)
	}
	t.Cleanup(func() { _ = rdb.Close() })
	return mutex.New(rdb), rdb
}

// env is one redis-server with the asynq and lock clients a test needs.
type env struct {
	redis *redistest.Server
	opt   asynq.RedisClientOpt
	rdb   *redis.Client // raw access, for what no public API offers
	locks *mutex.Client // the test's own lock client, to hold keys
	cli   *asynq.Client
	insp  *asynq.Inspector
}

func newEnv(t testing.TB) *env {
	t.Helper()
	s := redistest.Start(t)
	opt := asynq.RedisClientOpt{Addr: s.Addr()}
	locks, _ := newLocks(t, opt)
	return &env{
		redis: s,
		opt:   opt,
		rdb:   s.Client(t),
		locks: locks,
		cli:   newClient(t, opt),
		insp:  newInspector(t, opt),
	}
}

// hold takes key from the test's own lock client, as another worker would.
func (e *env) hold(t testing.TB, key string) *mutex.Lock {
	t.Helper()
	l, err := e.locks.TryLock(context.Background(), key, time.Minute)
	if err != nil {
		t.Fatalf("TryLock(%s) = %v, want the lock", key, err)
	}
	t.Cleanup(func() { _ = l.Unlock(context.Background()) })
	return l
}

func (e *env) enqueue(t testing.TB, typ string, body []byte, opts ...asynq.Option) *asynq.TaskInfo {
	t.Helper()
	info, err := e.cli.Enqueue(asynq.NewTask(typ, body), opts...)
	if err != nil {
		t.Fatalf("Enqueue(%s): %v", typ, err)
	}
	return info
}

// waitFor polls cond every pollEvery until it returns true, failing the test with
// cond's last description after timeout.
func waitFor(t testing.TB, timeout time.Duration, what string, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for i := 0; ; i++ {
		ok, desc := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("waiting %v for %s: last seen: %s", timeout, what, desc)
		}
		time.Sleep(pollEvery)
	}
}

// taskInfo returns the task's info, or nil and a description of the error.
func taskInfo(insp *asynq.Inspector, queue, id string) (*asynq.TaskInfo, string) {
	info, err := insp.GetTaskInfo(queue, id)
	if err != nil {
		return nil, fmt.Sprintf("GetTaskInfo: %v", err)
	}
	return info, describeTask(info)
}

func describeTask(info *asynq.TaskInfo) string {
	return fmt.Sprintf("state=%v retried=%d maxRetry=%d lastErr=%q", info.State, info.Retried, info.MaxRetry, info.LastErr)
}

// waitState waits until the task is in state and returns its info.
func waitState(t testing.TB, insp *asynq.Inspector, queue, id string, state asynq.TaskState, timeout time.Duration) *asynq.TaskInfo {
	t.Helper()
	var got *asynq.TaskInfo
	waitFor(t, timeout, fmt.Sprintf("task %s to be %v", id, state), func() (bool, string) {
		info, desc := taskInfo(insp, queue, id)
		got = info
		return info != nil && info.State == state, desc
	})
	return got
}

// tracker records, per key, how many handlers run at once, and the most that ever did.
type tracker struct {
	mu        sync.Mutex
	inflight  map[string]int
	maxPerKey map[string]int
	global    int
	maxGlobal int
	runs      map[string]int // per task (by a caller-chosen id)
	by        map[string]int // per server (or any label)
	done      int
}

func newTracker() *tracker {
	return &tracker{inflight: map[string]int{}, maxPerKey: map[string]int{}, runs: map[string]int{}, by: map[string]int{}}
}

func (tr *tracker) enter(key, task, label string) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	tr.inflight[key]++
	tr.maxPerKey[key] = max(tr.maxPerKey[key], tr.inflight[key])
	tr.global++
	tr.maxGlobal = max(tr.maxGlobal, tr.global)
	tr.runs[task]++
	tr.by[label]++
}

func (tr *tracker) exit(key string) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	tr.inflight[key]--
	tr.global--
	tr.done++
}

func (tr *tracker) finished() int {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	return tr.done
}

// maxOverlap returns the largest per-key concurrency seen and its key.
func (tr *tracker) maxOverlap() (int, string) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	n, k := 0, ""
	for key, m := range tr.maxPerKey {
		if m > n {
			n, k = m, key
		}
	}
	return n, k
}

// deadAddr returns a loopback address nothing listens on (it was free a moment ago).
func deadAddr(t testing.TB) string {
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(freePort(t)))
}

// errRecorder collects the errors asynq's ErrorHandler sees, which are the handler's
// real error values (Inspector only keeps their text).
type errRecorder struct {
	mu   sync.Mutex
	errs []error
}

func (r *errRecorder) HandleError(_ context.Context, _ *asynq.Task, err error) {
	r.mu.Lock()
	r.errs = append(r.errs, err)
	r.mu.Unlock()
}

func (r *errRecorder) all() []error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]error(nil), r.errs...)
}

// hookRecorder is an AfterFailure hook that keeps what it was called with.
type hookRecorder struct {
	mu   sync.Mutex
	errs []error
}

func (h *hookRecorder) hook(_ context.Context, _ *asynq.Task, err error) {
	h.mu.Lock()
	h.errs = append(h.errs, err)
	h.mu.Unlock()
}

func (h *hookRecorder) calls() []error {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]error(nil), h.errs...)
}

func (h *hookRecorder) count() int { return len(h.calls()) }

// isNotObtained is errors.Is(err, mutex.ErrNotObtained) spelled for t.Errorf lines.
func isNotObtained(err error) bool { return errors.Is(err, mutex.ErrNotObtained) }
