package order_test

// The harness: worker processes (real asynq.Servers whose handlers run behind
// asynqmutex.Middleware) and producer processes (asynqmutex.Producer on an
// asynq.Client), each this test binary re-executed with procEnv set to a JSON
// procSpec, and a referee redis-server that records what they did on its clock.
//
// Referee keys:
//   - ready        a list every process pushes "<role>:<id>" onto once connected.
//   - go:<id>      the parent pushes here when process <id> may begin (a producer
//     enqueues; a worker is running already).
//   - held:<id>    a producer with HoldBefore pushes here when it reached that task;
//     resume:<id> is where the parent lets it go on.
//   - stop:<id>    the parent pushes here when worker <id> shuts its server down.
//   - stamps       per task enqueued, a JSON stamp: the referee's TIME read before
//     Enqueue was called and after it returned.
//   - runs         per handler run, a JSON runRecord: the referee's TIME read as the
//     handler began and as it ended, the task, its place, and its outcome.
//   - events       per OpOrderSkipped and OpOutOfOrder event, a JSON eventRecord.
//   - report:<id>  process <id>'s JSON procReport, pushed as it exits.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
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

// procEnv carries a process's JSON procSpec; set, it makes this binary a worker or a
// producer.
const procEnv = "ASYNQMUTEX_ORDER_PROC"

// refTimeout bounds every referee command. The referee is never faulted, so reaching
// it is a broken harness.
const refTimeout = 10 * time.Second

// taskType is the type of every task the tests enqueue.
const taskType = "ord:step"

const (
	roleWorker   = "worker"
	roleProducer = "producer"
)

// taskRef is a task's payload: the producer's count of its tasks of the key.
type taskRef struct {
	Key      string `json:"key"`
	Producer int    `json:"producer"`
	Seq      int    `json:"seq"`
}

func (r taskRef) name() string { return fmt.Sprintf("%s/p%d/%d", r.Key, r.Producer, r.Seq) }

// procSpec is what a worker or producer process runs.
type procSpec struct {
	Role        string
	ID          int
	Ordered     bool   // InOrder and Producer.Enqueue; without, the lock alone and plain Enqueue
	RedisAddr   string // the asynq Redis: tasks, locks and sequences
	RefereeAddr string
	Lifetime    time.Duration // the whole process; it gives up after it

	// Worker.
	Concurrency int
	Grace       time.Duration // OrderGrace; 0 leaves the default
	MaxWait     time.Duration
	Park        bool          // the default policy, Park, with no MaxWait; else MaxWait and RetryLater(1s)
	MaxDelay    time.Duration // a handler sleeps a random time below it
	FailPercent int           // the share of runs that fail, transiently

	// Producer.
	AsynqAddr  string    // where the producer's asynq.Client connects; RedisAddr if ""
	Tasks      []taskRef // enqueued in this order
	HoldBefore int       // if above 0, the index of a task before which to wait for resume
	MaxRetry   int
}

// stamp is one Enqueue as its producer saw it, in referee µs.
type stamp struct {
	Task          taskRef
	ID            string
	Before, After int64
}

// runRecord is one handler run, in referee µs: the handler was running at Begin and
// at End.
type runRecord struct {
	Task       taskRef
	ID         string
	Place      string // the task's PlaceHeader, "" without one
	Worker     int
	Retry      int
	OK         bool // false: the run returned the injected failure
	Begin, End int64
}

// eventRecord is one OpOrderSkipped or OpOutOfOrder event a worker's middleware
// reported.
type eventRecord struct {
	Op     string
	Worker int
	TaskID string // the task that moved the key, or ran out of order
	Key    string
	At     int64 // referee µs when it was recorded
	// The GapError's fields, for OpOrderSkipped.
	Place  int64
	GapID  string
	Reason string
	Err    string
}

// procReport is what a process pushes as it exits.
type procReport struct {
	ID     int
	Role   string
	Ops    map[string]int // a worker's events, by Op
	Runs   int            // a worker's handler runs
	Tasks  int            // a producer's tasks enqueued
	Error  string
	Uptime time.Duration
}

// timeScript returns the referee's TIME in µs, built as a string so that no float
// formatting can round it.
var timeScript = redis.NewScript(`
local t = redis.call('TIME')
return t[1] .. string.format('%06d', tonumber(t[2]))
`)

// refNow is the referee's TIME in µs.
func refNow(ctx context.Context, ref redis.Scripter) (int64, error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), refTimeout)
	defer cancel()
	s, err := timeScript.Run(ctx, ref, nil).Text()
	if err != nil {
		return 0, fmt.Errorf("referee: TIME: %w", err)
	}
	return strconv.ParseInt(s, 10, 64)
}

// refPush appends v, as JSON, to the referee list key.
func refPush(ctx context.Context, ref *redis.Client, key string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), refTimeout)
	defer cancel()
	if err := ref.RPush(ctx, key, b).Err(); err != nil {
		return fmt.Errorf("referee: %s: %w", key, err)
	}
	return nil
}

// awaitSignal pops key in one-second polls until it holds something or ctx ends.
func awaitSignal(ctx context.Context, ref *redis.Client, key string) error {
	for ctx.Err() == nil {
		_, err := ref.BLPop(ctx, time.Second, key).Result()
		if err == nil {
			return nil
		}
		if !errors.Is(err, redis.Nil) && ctx.Err() == nil {
			return fmt.Errorf("referee: waiting on %s: %w", key, err)
		}
	}
	return fmt.Errorf("waiting on %s: %w", key, ctx.Err())
}

func signalKey(what string, id int) string { return what + ":" + strconv.Itoa(id) }

// procMain runs in a worker or producer process and returns its exit code.
func procMain(raw string) int {
	var spec procSpec
	if err := json.Unmarshal([]byte(raw), &spec); err != nil {
		fmt.Fprintf(os.Stderr, "process: bad spec: %v\n", err)
		return 2
	}
	began := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), spec.Lifetime)
	defer cancel()
	ref := redis.NewClient(&redis.Options{Addr: spec.RefereeAddr})
	defer ref.Close()
	rep := procReport{ID: spec.ID, Role: spec.Role}
	var err error
	switch spec.Role {
	case roleWorker:
		err = runWorker(ctx, spec, ref, &rep)
	case roleProducer:
		err = runProducer(ctx, spec, ref, &rep)
	default:
		err = fmt.Errorf("unknown role %q", spec.Role)
	}
	if err != nil {
		rep.Error = err.Error()
	}
	rep.Uptime = time.Since(began)
	if err := refPush(context.Background(), ref, signalKey("report", spec.ID), rep); err != nil {
		fmt.Fprintf(os.Stderr, "%s %d: pushing report: %v\n", spec.Role, spec.ID, err)
		return 1
	}
	if rep.Error != "" {
		fmt.Fprintf(os.Stderr, "%s %d: %s\n", spec.Role, spec.ID, rep.Error)
		return 1
	}
	return 0
}

// options are the middleware's and producer's options: one list serves both, as
// NewProducer's doc suggests.
func options(spec procSpec, tasks asynqmutex.TaskLookup, observe func(context.Context, asynqmutex.Event)) []asynqmutex.Option {
	o := []asynqmutex.Option{asynqmutex.For(taskType), asynqmutex.On("key")}
	if !spec.Park {
		o = append(o, asynqmutex.MaxWait(spec.MaxWait), asynqmutex.OnConflict(asynqmutex.RetryLater(time.Second)))
	}
	if spec.Ordered {
		o = append(o, asynqmutex.InOrder(tasks))
		if spec.Grace > 0 {
			o = append(o, asynqmutex.OrderGrace(spec.Grace))
		}
	}
	if observe != nil {
		o = append(o, asynqmutex.Observe(observe))
	}
	return o
}

var errInjected = errors.New("injected transient failure")

// worker is a worker process's handler and observer.
type worker struct {
	spec  procSpec
	ref   *redis.Client
	runs  atomic.Int64
	mu    sync.Mutex
	ops   map[string]int
	first error // the first referee error, which fails the process
}

func (w *worker) fail(err error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.first == nil {
		w.first = err
	}
}

func (w *worker) observe(ctx context.Context, e asynqmutex.Event) {
	w.mu.Lock()
	w.ops[e.Op.String()]++
	w.mu.Unlock()
	if e.Op != asynqmutex.OpOrderSkipped && e.Op != asynqmutex.OpOutOfOrder {
		return
	}
	rec := eventRecord{Op: e.Op.String(), Worker: w.spec.ID, TaskID: e.TaskID, Key: e.Key}
	if e.Err != nil {
		rec.Err = e.Err.Error()
	}
	var ge *asynqmutex.GapError
	if errors.As(e.Err, &ge) {
		rec.Place, rec.GapID, rec.Reason = ge.Place, ge.TaskID, ge.Reason
	}
	at, err := refNow(ctx, w.ref)
	if err == nil {
		rec.At = at
		err = refPush(ctx, w.ref, "events", rec)
	}
	if err != nil {
		w.fail(err)
	}
}

// handle records the run on the referee: its begin, a random short delay, and its
// end, failing spec.FailPercent of runs with a transient error.
func (w *worker) handle(ctx context.Context, t *asynq.Task) error {
	var r taskRef
	if err := json.Unmarshal(t.Payload(), &r); err != nil {
		return fmt.Errorf("%w: %v", asynq.SkipRetry, err)
	}
	begin, err := refNow(ctx, w.ref)
	if err != nil {
		w.fail(err)
		return err
	}
	w.runs.Add(1)
	if w.spec.MaxDelay > 0 {
		time.Sleep(rand.N(w.spec.MaxDelay))
	}
	ok := rand.IntN(100) >= w.spec.FailPercent
	end, err := refNow(ctx, w.ref)
	if err != nil {
		w.fail(err)
		return err
	}
	id, _ := asynq.GetTaskID(ctx)
	retry, _ := asynq.GetRetryCount(ctx)
	rec := runRecord{Task: r, ID: id, Place: t.Headers()[asynqmutex.PlaceHeader], Worker: w.spec.ID,
		Retry: retry, OK: ok, Begin: begin, End: end}
	if err := refPush(ctx, w.ref, "runs", rec); err != nil {
		w.fail(err)
		return err
	}
	if !ok {
		return errInjected
	}
	return nil
}

// quietLogger drops asynq's logs, which log every injected failure, unless
// ASYNQMUTEX_TEST_LOG is set.
type quietLogger struct{}

func (quietLogger) log(level string, args ...any) {
	if os.Getenv("ASYNQMUTEX_TEST_LOG") != "" {
		fmt.Fprintf(os.Stderr, "asynq %s: %s\n", level, fmt.Sprint(args...))
	}
}
func (quietLogger) Debug(...any)        {}
func (quietLogger) Info(...any)         {}
func (l quietLogger) Warn(args ...any)  { l.log("WARN", args...) }
func (l quietLogger) Error(args ...any) { l.log("ERROR", args...) }
func (l quietLogger) Fatal(args ...any) { l.log("FATAL", args...) }

// runWorker runs an asynq server until the parent says stop or the lifetime ends.
func runWorker(ctx context.Context, spec procSpec, ref *redis.Client, rep *procReport) error {
	opt := asynq.RedisClientOpt{Addr: spec.RedisAddr}
	rdb := redis.NewClient(&redis.Options{Addr: spec.RedisAddr})
	defer rdb.Close()
	insp := asynq.NewInspector(opt)
	defer insp.Close()
	w := &worker{spec: spec, ref: ref, ops: map[string]int{}}
	mux := asynq.NewServeMux()
	mux.HandleFunc(taskType, w.handle)
	mux.Use(asynqmutex.Middleware(mutex.New(rdb), options(spec, insp, w.observe)...))
	srv := asynq.NewServer(opt, asynqmutex.Configure(asynq.Config{
		Concurrency: spec.Concurrency,
		// A failed task is due again at once; asynq moves it back to its queue at the
		// next check of delayed tasks.
		RetryDelayFunc:           func(int, error, *asynq.Task) time.Duration { return 0 },
		DelayedTaskCheckInterval: 100 * time.Millisecond,
		TaskCheckInterval:        50 * time.Millisecond,
		ShutdownTimeout:          5 * time.Second,
		Logger:                   quietLogger{},
		LogLevel:                 asynq.WarnLevel,
	}))
	if err := srv.Start(mux); err != nil {
		return fmt.Errorf("asynq.Server.Start: %w", err)
	}
	if err := ref.RPush(ctx, "ready", roleWorker+":"+strconv.Itoa(spec.ID)).Err(); err != nil {
		srv.Shutdown()
		return fmt.Errorf("referee: ready: %w", err)
	}
	err := awaitSignal(ctx, ref, signalKey("stop", spec.ID))
	srv.Shutdown()
	w.mu.Lock()
	defer w.mu.Unlock()
	rep.Ops, rep.Runs = w.ops, int(w.runs.Load())
	if w.first != nil {
		return w.first
	}
	return err
}

// runProducer enqueues spec.Tasks in order once the parent says go, stamping each
// on the referee. Its Sequencer reaches the asynq Redis directly, its asynq.Client
// through spec.AsynqAddr: a proxy can stall the enqueue after the place was taken.
func runProducer(ctx context.Context, spec procSpec, ref *redis.Client, rep *procReport) error {
	asynqAddr := spec.AsynqAddr
	if asynqAddr == "" {
		asynqAddr = spec.RedisAddr
	}
	client := asynq.NewClient(asynq.RedisClientOpt{Addr: asynqAddr})
	defer client.Close()
	rdb := redis.NewClient(&redis.Options{Addr: spec.RedisAddr})
	defer rdb.Close()
	var prod *asynqmutex.Producer
	if spec.Ordered {
		// A producer asks asynq nothing: it needs no TaskLookup.
		prod = asynqmutex.NewProducer(mutex.New(rdb), client, options(spec, nil, nil)...)
	}
	if err := ref.RPush(ctx, "ready", roleProducer+":"+strconv.Itoa(spec.ID)).Err(); err != nil {
		return fmt.Errorf("referee: ready: %w", err)
	}
	if err := awaitSignal(ctx, ref, signalKey("go", spec.ID)); err != nil {
		return err
	}
	for i, r := range spec.Tasks {
		if spec.HoldBefore > 0 && i == spec.HoldBefore {
			if err := ref.RPush(ctx, signalKey("held", spec.ID), i).Err(); err != nil {
				return fmt.Errorf("referee: held: %w", err)
			}
			if err := awaitSignal(ctx, ref, signalKey("resume", spec.ID)); err != nil {
				return err
			}
		}
		b, err := json.Marshal(r)
		if err != nil {
			return err
		}
		task := asynq.NewTask(taskType, b)
		before, err := refNow(ctx, ref)
		if err != nil {
			return err
		}
		var info *asynq.TaskInfo
		if prod != nil {
			info, err = prod.Enqueue(ctx, task, asynq.MaxRetry(spec.MaxRetry))
		} else {
			info, err = client.EnqueueContext(ctx, task, asynq.MaxRetry(spec.MaxRetry))
		}
		if err != nil {
			return fmt.Errorf("Enqueue(%s): %w", r.name(), err)
		}
		after, err := refNow(ctx, ref)
		if err != nil {
			return err
		}
		if err := refPush(ctx, ref, "stamps", stamp{Task: r, ID: info.ID, Before: before, After: after}); err != nil {
			return err
		}
		rep.Tasks++
	}
	return nil
}

// proc is a worker or producer process.
type proc struct {
	spec procSpec
	cmd  *exec.Cmd
	out  *syncBuffer
	done chan struct{}
	err  error // cmd.Wait's, once done is closed
}

// startProc re-executes the test binary as the process spec describes; t.Cleanup
// kills it if it still runs and fails the test if it reported a data race.
func startProc(t *testing.T, spec procSpec) *proc {
	t.Helper()
	raw, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	p := &proc{spec: spec, out: &syncBuffer{}, done: make(chan struct{})}
	p.cmd = exec.Command(os.Args[0])
	p.cmd.Env = append(os.Environ(), procEnv+"="+string(raw))
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.out
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("starting %s %d: %v", spec.Role, spec.ID, err)
	}
	go func() {
		p.err = p.cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		p.kill()
		if strings.Contains(p.out.String(), "DATA RACE") {
			t.Errorf("%s %d reported a data race:\n%s", spec.Role, spec.ID, p.out.String())
		}
	})
	return p
}

// kill sends SIGKILL if the process still runs, and waits for it to exit.
func (p *proc) kill() {
	select {
	case <-p.done:
	default:
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

func (p *proc) String() string { return fmt.Sprintf("%s %d", p.spec.Role, p.spec.ID) }

func outputs(procs []*proc) string {
	var b strings.Builder
	for _, p := range procs {
		fmt.Fprintf(&b, "\n%v output:\n%s", p, p.out.String())
	}
	return b.String()
}

// syncBuffer is a bytes buffer safe for exec's copying goroutine; it keeps the
// first 64 KiB.
type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.b.Len() < 64<<10 {
		s.b.Write(p)
	}
	return len(p), nil
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
