package integration

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex"
	"github.com/asynqmutex/asynqmutex/internal/redistest"
	"github.com/asynqmutex/asynqmutex/mutex"
	"github.com/asynqmutex/asynqmutex/order"
)

const orderedType = "ord:step"

type orderPayload struct {
	Key      string `json:"key"`
	Producer int    `json:"producer"`
	Seq      int    `json:"seq"` // the producer's count of its tasks of the key
}

func (p orderPayload) name() string { return fmt.Sprintf("%s/p%d/%d", p.Key, p.Producer, p.Seq) }

// orderLog records the handler runs of an ordered workload: per key, the tasks whose
// runs succeeded, in the order the runs began, and the enqueue calls' stamps on one
// logical clock, so that order can be judged by what the producers saw alone.
type orderLog struct {
	clock atomic.Int64

	mu        sync.Mutex
	stamps    map[string][2]int64 // per task: the clock before and after its Enqueue
	runs      map[string][]string // per key: the tasks whose runs succeeded, by start
	succeeded map[string]int      // per task
	failed    int                 // runs that returned the injected failure
	running   map[string]int      // per key: runs under way
	keysAtMax int                 // the most keys with a run under way at once
	events    []asynqmutex.Event
}

func newOrderLog() *orderLog {
	return &orderLog{stamps: map[string][2]int64{}, runs: map[string][]string{}, succeeded: map[string]int{}, running: map[string]int{}}
}

func (l *orderLog) observe(_ context.Context, e asynqmutex.Event) {
	l.mu.Lock()
	l.events = append(l.events, e)
	l.mu.Unlock()
}

func (l *orderLog) eventsOf(op asynqmutex.Op) []asynqmutex.Event {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []asynqmutex.Event
	for _, e := range l.events {
		if e.Op == op {
			out = append(out, e)
		}
	}
	return out
}

// enqueue stamps the call enq that enqueues the task p.
func (l *orderLog) enqueue(p orderPayload, enq func() error) error {
	before := l.clock.Add(1)
	err := enq()
	after := l.clock.Add(1)
	l.mu.Lock()
	l.stamps[p.name()] = [2]int64{before, after}
	l.mu.Unlock()
	return err
}

// failsOnce is the injected transient failure: one task in ten fails its first run.
func failsOnce(p orderPayload) bool {
	h := fnv.New32a()
	h.Write([]byte(p.name()))
	return h.Sum32()%10 == 0
}

var errInjected = errors.New("injected transient failure")

// handler runs for a random 0-3ms, and fails the first run of the tasks failsOnce
// picks.
func (l *orderLog) handler(ctx context.Context, t *asynq.Task) error {
	var p orderPayload
	if err := json.Unmarshal(t.Payload(), &p); err != nil {
		return err
	}
	retried, _ := asynq.GetRetryCount(ctx)
	l.mu.Lock()
	l.running[p.Key]++
	l.keysAtMax = max(l.keysAtMax, len(l.running))
	l.mu.Unlock()
	time.Sleep(time.Duration(rand.IntN(3000)) * time.Microsecond)
	fail := failsOnce(p) && retried == 0
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.running[p.Key]--; l.running[p.Key] == 0 {
		delete(l.running, p.Key)
	}
	if fail {
		l.failed++
		return errInjected
	}
	l.runs[p.Key] = append(l.runs[p.Key], p.name())
	l.succeeded[p.name()]++
	return nil
}

// outOfOrder counts, per key, the pairs of runs in the wrong order: a task that ran
// after another although its Enqueue had returned before the other's began.
func (l *orderLog) outOfOrder() (int, string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	n, first := 0, ""
	for key, runs := range l.runs {
		for i := range runs {
			for j := i + 1; j < len(runs); j++ {
				if l.stamps[runs[j]][1] < l.stamps[runs[i]][0] {
					if n == 0 {
						first = fmt.Sprintf("key %s: %s ran before %s, which was enqueued first", key, runs[i], runs[j])
					}
					n++
				}
			}
		}
	}
	return n, first
}

func (l *orderLog) done() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, c := range l.succeeded {
		n += c
	}
	return n
}

// orderedWorkload enqueues keys x perKey tasks with 2 producers that share every
// key, while 4 asynq servers run them, and waits for every task to succeed. With
// ordered, the producers use Producer.Enqueue and the middleware InOrder; without,
// plain Enqueue and the lock alone.
func orderedWorkload(t *testing.T, ordered bool, keys, perKey int) *orderLog {
	e := newEnv(t)
	log := newOrderLog()
	const producers, servers = 2, 4
	opts := func(insp *asynq.Inspector) []asynqmutex.Option {
		o := []asynqmutex.Option{asynqmutex.For(orderedType), asynqmutex.On("key"),
			// A wait that covers a failed task's return (its retry comes within about a
			// second), so that successors seldom go back to the queue.
			asynqmutex.MaxWait(3 * time.Second), asynqmutex.OnConflict(asynqmutex.RetryLater(time.Second)),
			asynqmutex.Observe(log.observe)}
		if ordered {
			o = append(o, asynqmutex.InOrder(insp))
		}
		return o
	}
	for range servers {
		locks, _ := newLocks(t, e.opt)
		mux := asynq.NewServeMux()
		mux.HandleFunc(orderedType, log.handler)
		mux.Use(asynqmutex.Middleware(locks, opts(newInspector(t, e.opt))...))
		startServer(t, e.opt, asynqmutex.Configure(asynq.Config{
			Concurrency:    8,
			RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return time.Second },
		}), mux)
	}
	var wg sync.WaitGroup
	for pr := range producers {
		client := newClient(t, e.opt)
		var prod *asynqmutex.Producer
		if ordered {
			// A producer asks asynq nothing: it needs no TaskLookup.
			locks, _ := newLocks(t, e.opt)
			prod = asynqmutex.NewProducer(locks, client, opts(nil)...)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for seq := range perKey / producers {
				for k := range keys {
					p := orderPayload{Key: fmt.Sprintf("k%02d", k), Producer: pr, Seq: seq}
					task := asynq.NewTask(orderedType, payload(t, p))
					err := log.enqueue(p, func() error {
						var err error
						if prod != nil {
							_, err = prod.Enqueue(context.Background(), task, asynq.MaxRetry(3))
						} else {
							_, err = client.Enqueue(task, asynq.MaxRetry(3))
						}
						return err
					})
					if err != nil {
						t.Errorf("Enqueue(%s): %v", p.name(), err)
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	total := keys * perKey
	waitFor(t, 45*time.Second, fmt.Sprintf("%d tasks to succeed", total), func() (bool, string) {
		n := log.done()
		return n >= total, fmt.Sprintf("%d succeeded", n)
	})
	return log
}

// TestOrderPerKey: 20 keys x 50 tasks, enqueued by 2 producers that share every key,
// run by 4 servers with handlers of random short delays, one task in ten failing its
// first run and retried: each key's handler sees its tasks in enqueue order, each
// exactly once on success, and keys run in parallel. Without order, the same
// workload runs tasks out of order (the positive control).
//
// Not parallel with the package's other tests: its thousands of tasks would take the
// CPU from those that time a drain against its ideal.
func TestOrderPerKey(t *testing.T) {
	const keys, perKey = 20, 50
	if testing.Short() {
		t.Skip("-short")
	}
	t.Run("ordered", func(t *testing.T) {
		t.Parallel()
		start := time.Now()
		log := orderedWorkload(t, true, keys, perKey)
		if n, first := log.outOfOrder(); n > 0 {
			t.Errorf("%d pairs ran out of enqueue order; first: %s", n, first)
		}
		log.mu.Lock()
		defer log.mu.Unlock()
		for name, n := range log.succeeded {
			if n != 1 {
				t.Errorf("task %s succeeded %d times, want 1", name, n)
			}
		}
		if len(log.succeeded) != keys*perKey {
			t.Errorf("%d tasks succeeded, want %d", len(log.succeeded), keys*perKey)
		}
		if log.failed == 0 {
			t.Errorf("no injected failure happened; the test did not test retries")
		}
		if log.keysAtMax < 2 {
			t.Errorf("at most %d key ran at once, want keys in parallel", log.keysAtMax)
		}
		var skipped, outOfOrder int
		for _, e := range log.events {
			switch e.Op {
			case asynqmutex.OpOrderSkipped:
				skipped++
			case asynqmutex.OpOutOfOrder:
				outOfOrder++
			}
		}
		if skipped+outOfOrder > 0 {
			t.Errorf("%d places skipped and %d tasks run out of order, want none", skipped, outOfOrder)
		}
		t.Logf("ordered: %d tasks in %v, %d injected failures, up to %d keys at once, %d events",
			keys*perKey, time.Since(start).Round(time.Millisecond), log.failed, log.keysAtMax, len(log.events))
	})
	t.Run("control without order", func(t *testing.T) {
		t.Parallel()
		log := orderedWorkload(t, false, keys, perKey)
		n, first := log.outOfOrder()
		if n == 0 {
			t.Fatalf("without InOrder every key ran in enqueue order; the checker would not see a violation")
		}
		t.Logf("without order: %d pairs out of order; first: %s", n, first)
	})
}

// gapEnv is one server's worth of an ordered key whose tasks a test enqueues before
// any worker runs, so that it can make a gap among them first.
type gapEnv struct {
	*env
	log   *orderLog
	seq   *order.Sequencer
	prod  *asynqmutex.Producer
	opts  []asynqmutex.Option
	ids   []string
	grace time.Duration
}

func newGapEnv(t *testing.T, grace time.Duration) *gapEnv {
	e := newEnv(t)
	g := &gapEnv{env: e, log: newOrderLog(), grace: grace}
	g.seq = order.New(e.rdb)
	g.opts = []asynqmutex.Option{asynqmutex.For(orderedType), asynqmutex.On("key"),
		asynqmutex.InOrder(e.insp), asynqmutex.OrderGrace(grace),
		asynqmutex.MaxWait(2 * grace), asynqmutex.OnConflict(asynqmutex.RetryLater(time.Second)),
		asynqmutex.Observe(g.log.observe)}
	g.prod = asynqmutex.NewProducer(mutex.New(e.rdb), e.cli, g.opts...)
	return g
}

// enqueue enqueues task seq of key k.
func (g *gapEnv) enqueue(t *testing.T, seq int, opts ...asynq.Option) string {
	t.Helper()
	p := orderPayload{Key: "k", Seq: seq}
	info, err := g.prod.Enqueue(context.Background(), asynq.NewTask(orderedType, payload(t, p)), opts...)
	if err != nil {
		t.Fatalf("Enqueue(%d): %v", seq, err)
	}
	g.ids = append(g.ids, info.ID)
	return info.ID
}

// start runs a server with handler h (the log's by default).
func (g *gapEnv) start(t *testing.T, h asynq.HandlerFunc) time.Time {
	if h == nil {
		h = g.log.handler
	}
	mux := asynq.NewServeMux()
	mux.HandleFunc(orderedType, h)
	mux.Use(asynqmutex.Middleware(g.locks, g.opts...))
	startServer(t, g.opt, asynqmutex.Configure(asynq.Config{
		Concurrency:    4,
		RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return time.Second },
	}), mux)
	return time.Now()
}

// ran waits for want successful runs and returns them in order.
func (g *gapEnv) ran(t *testing.T, want int, within time.Duration) []string {
	t.Helper()
	waitFor(t, within, fmt.Sprintf("%d runs", want), func() (bool, string) {
		n := g.log.done()
		return n >= want, fmt.Sprintf("%d runs", n)
	})
	g.log.mu.Lock()
	defer g.log.mu.Unlock()
	return slices.Clone(g.log.runs["k"])
}

func names(seqs ...int) []string {
	out := make([]string, len(seqs))
	for i, s := range seqs {
		out[i] = orderPayload{Key: "k", Seq: s}.name()
	}
	return out
}

// skips returns the reasons of the OpOrderSkipped events, by place.
func (g *gapEnv) skips() map[int64]string {
	out := map[int64]string{}
	for _, e := range g.log.eventsOf(asynqmutex.OpOrderSkipped) {
		var ge *asynqmutex.GapError
		if errors.As(e.Err, &ge) {
			out[ge.Place] = ge.Reason
		}
	}
	return out
}

// TestOrderGaps: a key never waits for a task that is gone. Each case makes place 2
// of five a gap and checks that the other four run in order, that the key moved past
// place 2 for the documented reason, and within the documented bound.
func TestOrderGaps(t *testing.T) {
	t.Parallel()
	const grace = time.Second
	// The bound of the rules that wait out the grace: the grace, plus a retry's
	// return (RetryLater(1s) and asynq's whole seconds) should a task meet the gap
	// at the end of its wait.
	const graceBound = grace + 3*time.Second

	t.Run("deleted by an operator", func(t *testing.T) {
		t.Parallel()
		g := newGapEnv(t, grace)
		taken := time.Now() // before place 2 is: its grace runs from when it was taken
		for i := range 5 {
			g.enqueue(t, i)
		}
		if err := g.insp.DeleteTask("default", g.ids[1]); err != nil {
			t.Fatal(err)
		}
		g.start(t, nil)
		if got, want := g.ran(t, 4, 10*graceBound), names(0, 2, 3, 4); !slices.Equal(got, want) {
			t.Fatalf("runs %v, want %v", got, want)
		}
		elapsed := time.Since(taken)
		if got := g.skips(); got[2] != "missing" || len(got) != 1 {
			t.Errorf("skipped places %v, want place 2 for missing", got)
		}
		if elapsed < grace || elapsed > graceBound {
			t.Errorf("the key moved on after %v, want after the grace of %v and within %v", elapsed, grace, graceBound)
		}
	})

	t.Run("archived after its retries", func(t *testing.T) {
		t.Parallel()
		g := newGapEnv(t, grace)
		for i := range 5 {
			opts := []asynq.Option{}
			if i == 1 {
				opts = append(opts, asynq.MaxRetry(1))
			}
			g.enqueue(t, i, opts...)
		}
		var tries atomic.Int32
		start := g.start(t, func(ctx context.Context, task *asynq.Task) error {
			if info, _ := asynq.GetTaskID(ctx); info == g.ids[1] {
				tries.Add(1)
				return errors.New("always fails")
			}
			return g.log.handler(ctx, task)
		})
		if got, want := g.ran(t, 4, 20*time.Second), names(0, 2, 3, 4); !slices.Equal(got, want) {
			t.Fatalf("runs %v, want %v", got, want)
		}
		// Its last try failing moves the key on at once: no grace is waited out, only
		// asynq's retry of the first failure (a second, in whole seconds) and the
		// return of the tasks behind it, which went back when it failed (RetryLater's
		// second, in whole seconds; twice for one back before the retry ran).
		if elapsed := time.Since(start); elapsed > 6*time.Second {
			t.Errorf("the key moved on after %v, want the one retry's delay and its waiters' return", elapsed)
		}
		if got := g.skips(); got[2] != "failed" || len(got) != 1 {
			t.Errorf("skipped places %v, want place 2 for failed", got)
		}
		if n := tries.Load(); n != 2 {
			t.Errorf("the failing task ran %d times, want 2 (MaxRetry(1))", n)
		}
		waitState(t, g.insp, "default", g.ids[1], asynq.TaskStateArchived, 5*time.Second)
	})

	t.Run("archived by an operator", func(t *testing.T) {
		t.Parallel()
		g := newGapEnv(t, grace)
		for i := range 5 {
			g.enqueue(t, i)
		}
		if err := g.insp.ArchiveTask("default", g.ids[1]); err != nil {
			t.Fatal(err)
		}
		taken := time.Now()
		g.start(t, nil)
		if got, want := g.ran(t, 4, 10*graceBound), names(0, 2, 3, 4); !slices.Equal(got, want) {
			t.Fatalf("runs %v, want %v", got, want)
		}
		if elapsed := time.Since(taken); elapsed > graceBound {
			t.Errorf("the key moved on after %v, want within %v", elapsed, graceBound)
		}
		if got := g.skips(); got[2] != "archived" || len(got) != 1 {
			t.Errorf("skipped places %v, want place 2 for archived", got)
		}
		// Run again from the archive, the task runs late, outside the order.
		if err := g.insp.RunTask("default", g.ids[1]); err != nil {
			t.Fatal(err)
		}
		if got := g.ran(t, 5, 10*time.Second); got[4] != names(1)[0] {
			t.Fatalf("runs %v, want task 1 last", got)
		}
		if n := len(g.log.eventsOf(asynqmutex.OpOutOfOrder)); n != 1 {
			t.Errorf("%d OpOutOfOrder events, want 1 for the task run from the archive", n)
		}
	})

	t.Run("producer killed between taking a place and enqueuing", func(t *testing.T) {
		t.Parallel()
		g := newGapEnv(t, grace)
		g.enqueue(t, 0)
		// What Producer.Enqueue does before it enqueues, done by a producer that then
		// dies: a place taken for a task that never comes.
		key, err := g.prod.Key(context.Background(), asynq.NewTask(orderedType, payload(t, orderPayload{Key: "k"})))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := g.seq.Take(context.Background(), key, "default", "never-enqueued"); err != nil {
			t.Fatal(err)
		}
		taken := time.Now()
		for i := 2; i < 5; i++ {
			g.enqueue(t, i)
		}
		g.start(t, nil)
		if got, want := g.ran(t, 4, 10*graceBound), names(0, 2, 3, 4); !slices.Equal(got, want) {
			t.Fatalf("runs %v, want %v", got, want)
		}
		elapsed := time.Since(taken)
		if got := g.skips(); got[2] != "missing" || len(got) != 1 {
			t.Errorf("skipped places %v, want place 2 for missing", got)
		}
		if elapsed < grace || elapsed > graceBound {
			t.Errorf("the key moved on after %v, want after the grace of %v and within %v", elapsed, grace, graceBound)
		}
		// The last task finishes its place after its handler returned.
		waitFor(t, 5*time.Second, "the key's last place finished, one skipped", func() (bool, string) {
			st, err := g.seq.Inspect(context.Background(), key)
			return err == nil && st.Next == 6 && st.Last == 5 && st.Skipped == 1, fmt.Sprintf("%+v, %v", st, err)
		})
	})

	t.Run("enqueue refused", func(t *testing.T) {
		t.Parallel()
		g := newGapEnv(t, time.Minute) // a gap waited out would fail the test's bound
		g.enqueue(t, 0, asynq.Unique(time.Minute))
		ctx := context.Background()
		// asynq refuses a duplicate of a unique task: its place is given up.
		dup := asynq.NewTask(orderedType, payload(t, orderPayload{Key: "k", Seq: 0}))
		if _, err := g.prod.Enqueue(ctx, dup, asynq.Unique(time.Minute)); !errors.Is(err, asynq.ErrDuplicateTask) {
			t.Fatalf("Enqueue of a duplicate = %v, want asynq.ErrDuplicateTask", err)
		}
		// A task ID asynq holds: the place Take gives back is that task's, and stays so.
		again := asynq.NewTask(orderedType, payload(t, orderPayload{Key: "k", Seq: 9}))
		if _, err := g.prod.Enqueue(ctx, again, asynq.TaskID(g.ids[0])); !errors.Is(err, asynq.ErrTaskIDConflict) {
			t.Fatalf("Enqueue with a taken ID = %v, want asynq.ErrTaskIDConflict", err)
		}
		for i := 2; i < 5; i++ {
			g.enqueue(t, i)
		}
		g.start(t, nil)
		if got, want := g.ran(t, 4, 10*time.Second), names(0, 2, 3, 4); !slices.Equal(got, want) {
			t.Fatalf("runs %v, want %v", got, want)
		}
		key, _ := g.prod.Key(ctx, dup)
		waitFor(t, 5*time.Second, "the key's last place finished", func() (bool, string) {
			st, err := g.seq.Inspect(ctx, key)
			return err == nil && st.Next == 6 && st.Last == 5 && st.Skipped == 1, fmt.Sprintf("%+v, %v", st, err)
		})
		// Place 2 was given up while place 1 was running: the key moved past it with
		// place 1's finish, which reports it.
		if got := g.skips(); got[2] != "abandoned" || len(got) != 1 {
			t.Errorf("skipped places %v, want place 2 for abandoned", got)
		}
		// A place given up when it is the key's next is moved past at once, and the
		// producer reports it: a unique task (enqueued without a place, for later)
		// makes asynq refuse its duplicate.
		later := asynq.NewTask(orderedType, payload(t, orderPayload{Key: "k", Seq: 7}))
		if _, err := g.cli.Enqueue(later, asynq.Unique(time.Hour), asynq.ProcessIn(time.Hour)); err != nil {
			t.Fatal(err)
		}
		if _, err := g.prod.Enqueue(ctx, later, asynq.Unique(time.Hour)); !errors.Is(err, asynq.ErrDuplicateTask) {
			t.Fatalf("Enqueue of a duplicate = %v, want asynq.ErrDuplicateTask", err)
		}
		if got := g.skips(); got[6] != "abandoned" || len(got) != 2 {
			t.Errorf("skipped places %v, want place 6 for abandoned too", got)
		}
	})
}

// TestOrderTaskWithoutPlace: a task enqueued without the Producer runs under the lock
// alone, reported.
func TestOrderTaskWithoutPlace(t *testing.T) {
	t.Parallel()
	g := newGapEnv(t, time.Second)
	g.env.enqueue(t, orderedType, payload(t, orderPayload{Key: "k"}))
	g.start(t, nil)
	g.ran(t, 1, 10*time.Second)
	waitFor(t, 5*time.Second, "an OpOutOfOrder event", func() (bool, string) {
		n := len(g.log.eventsOf(asynqmutex.OpOutOfOrder))
		return n == 1, fmt.Sprintf("%d events", n)
	})
}

// TestOrderLastTryWaits: tasks with no retry left, which asynq would archive if sent
// back, wait for their turn while the task ahead is delayed (ProcessIn), and run in
// order once it has run. The delayed task also shows that a delay holds back the
// key's later tasks rather than letting them pass.
func TestOrderLastTryWaits(t *testing.T) {
	t.Parallel()
	// A short grace: the delayed task is past it, so that only its being a last try
	// keeps the others waiting.
	g := newGapEnv(t, 100*time.Millisecond)
	// asynq keeps a task's time in whole seconds, so it may run up to a second early.
	const delay = 2 * time.Second
	start := time.Now()
	g.enqueue(t, 0, asynq.MaxRetry(0), asynq.ProcessIn(delay))
	for i := 1; i < 4; i++ {
		g.enqueue(t, i, asynq.MaxRetry(0))
	}
	g.start(t, nil)
	if got, want := g.ran(t, 4, 10*time.Second), names(0, 1, 2, 3); !slices.Equal(got, want) {
		t.Fatalf("runs %v, want %v", got, want)
	}
	if elapsed := time.Since(start); elapsed < delay-time.Second {
		t.Errorf("all ran after %v, before the first task's delay of %v (less asynq's second)", elapsed, delay)
	}
	for _, id := range g.ids {
		if info, err := g.insp.GetTaskInfo("default", id); err == nil && info.State == asynq.TaskStateArchived {
			t.Errorf("task %s archived: %s", id, info.LastErr)
		}
	}
}

// countHook counts the commands a redis client sends (a pipeline counts once).
type countHook struct{ n atomic.Int64 }

func (h *countHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *countHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.n.Add(1)
		return next(ctx, cmd)
	}
}
func (h *countHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		h.n.Add(1)
		return next(ctx, cmds)
	}
}

// TestOrderCosts counts the round trips order adds: per task, one on the producer's
// side (take) and one on the worker's (enter: the finish rides in the lock
// release's pipeline), when each task finds its turn come; none for a task of a type
// without order. The worker's lock and sequence share one redis client, as
// README's example has them.
func TestOrderCosts(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var prodCalls, workCalls countHook
	client := func(h *countHook) *redis.Client {
		rdb := redis.NewClient(&redis.Options{Addr: e.redis.Addr()})
		rdb.AddHook(h)
		t.Cleanup(func() { rdb.Close() })
		return rdb
	}
	log := newOrderLog()
	opts := func(insp *asynq.Inspector) []asynqmutex.Option {
		return []asynqmutex.Option{asynqmutex.For(orderedType), asynqmutex.On("key"),
			asynqmutex.InOrder(insp), asynqmutex.MaxWait(5 * time.Second)}
	}
	prod := asynqmutex.NewProducer(mutex.New(client(&prodCalls)), e.cli, opts(nil)...)
	worker := client(&workCalls)
	mux := asynq.NewServeMux()
	mux.HandleFunc(orderedType, log.handler)
	var locked atomic.Int64
	mux.HandleFunc("locked", func(context.Context, *asynq.Task) error { locked.Add(1); return nil })
	mux.HandleFunc("plain", func(context.Context, *asynq.Task) error { return nil })
	locks := mutex.New(worker)
	mux.Use(asynqmutex.Middleware(locks, opts(e.insp)...))
	mux.Use(asynqmutex.Middleware(locks, asynqmutex.For("locked"), asynqmutex.On("key")))
	startServer(t, e.opt, asynqmutex.Configure(asynq.Config{Concurrency: 1}), mux)

	enqueue := func(seq int) {
		t.Helper()
		p := orderPayload{Key: "k", Producer: 7, Seq: seq}
		if failsOnce(p) {
			t.Fatalf("task %s would fail", p.name())
		}
		if _, err := prod.Enqueue(context.Background(), asynq.NewTask(orderedType, payload(t, p))); err != nil {
			t.Fatal(err)
		}
	}
	idle := func(what string) {
		t.Helper()
		waitFor(t, 10*time.Second, what, func() (bool, string) {
			q, err := e.insp.GetQueueInfo("default")
			return err == nil && q.Pending == 0 && q.Active == 0, fmt.Sprint(q, err)
		})
	}
	// One task of each kind first, so that the scripts are loaded before the count.
	enqueue(0)
	e.enqueue(t, "locked", payload(t, map[string]string{"key": "k"}))
	idle("the first tasks")
	const n = 5
	p0, w0 := prodCalls.n.Load(), workCalls.n.Load()
	seqs := []int{}
	for s := 1; len(seqs) < n; s++ {
		if !failsOnce(orderPayload{Key: "k", Producer: 7, Seq: s}) {
			seqs = append(seqs, s)
		}
	}
	// One at a time, so that each finds its turn come (the injected failures spared).
	for _, s := range seqs {
		enqueue(s)
		idle("the ordered task")
	}
	p1, w1 := prodCalls.n.Load(), workCalls.n.Load()
	// The same number under the lock alone, and a task of a type the middleware does
	// not cover.
	for range n {
		e.enqueue(t, "locked", payload(t, map[string]string{"key": "k"}))
		idle("the locked task")
	}
	e.enqueue(t, "plain", nil)
	idle("the plain task")
	w2 := workCalls.n.Load()
	if log.done() != n+1 || locked.Load() != n+1 {
		t.Fatalf("ran %d ordered and %d locked tasks, want %d of each", log.done(), locked.Load(), n+1)
	}
	if got := p1 - p0; got != n {
		t.Errorf("producer: %d round trips for %d tasks, want %d", got, n, n)
	}
	ordered, plain := w1-w0, w2-w1
	if plain != 2*n {
		t.Errorf("worker: %d round trips for %d tasks under the lock alone and one of a type without the middleware, want %d (a lock and a release each)", plain, n, 2*n)
	}
	if ordered != plain+n {
		t.Errorf("worker: %d round trips for %d ordered tasks, want %d: the lock's %d and one more each", ordered, n, plain+n, plain)
	}
	t.Logf("round trips for %d tasks: producer %d; worker %d ordered, %d under the lock alone", n, p1-p0, ordered, plain)
}

// TestOrderFailedTaskSendsItsWaitersBack: a task that fails and will be retried
// keeps its place and announces it (in its lock release's pipeline), so that the task
// waiting for it goes back to the queue at once instead of holding a worker slot for
// its MaxWait while the failed task's retry may find no slot. The control: a
// predecessor that keeps running for two thirds of the MaxWait holds its waiter,
// which is never sent back.
func TestOrderFailedTaskSendsItsWaitersBack(t *testing.T) {
	t.Parallel()
	const grace = 3 * time.Second // MaxWait is two graces
	maxWait := 2 * grace
	for _, fails := range []bool{true, false} {
		t.Run(fmt.Sprintf("fails=%v", fails), func(t *testing.T) {
			t.Parallel()
			g := newGapEnv(t, grace)
			g.enqueue(t, 0)
			g.enqueue(t, 1)
			var returned atomic.Int64 // when task 0's first run returned, µs since the epoch
			h := func(ctx context.Context, task *asynq.Task) error {
				var p orderPayload
				_ = json.Unmarshal(task.Payload(), &p)
				if retried, _ := asynq.GetRetryCount(ctx); p.Seq == 0 && retried == 0 {
					// Run until task 1 waits for this one (it listens on the key's channel).
					waitFor(t, 10*time.Second, "task 1 to wait", func() (bool, string) {
						ch, err := g.rdb.PubSubChannels(context.Background(), "asynqmutex:order:*").Result()
						return err == nil && len(ch) > 0, fmt.Sprint(ch, err)
					})
					if !fails {
						time.Sleep(maxWait * 2 / 3) // still running past half task 1's MaxWait
					}
					returned.Store(time.Now().UnixMicro())
					if fails {
						return errors.New("transient")
					}
				}
				return g.log.handler(ctx, task)
			}
			g.start(t, h)
			// When task 1 goes back, measured from when task 0 returned.
			var back time.Time
			waitFor(t, 2*maxWait, "task 1 sent back, or task 0 done", func() (bool, string) {
				if len(g.log.eventsOf(asynqmutex.OpOutOfTurn)) > 0 || g.log.done() > 0 && !fails {
					back = time.Now()
					return true, ""
				}
				return false, "waiting"
			})
			if got := g.ran(t, 2, 3*maxWait); !slices.Equal(got, names(0, 1)) {
				t.Fatalf("ran %v, want %v", got, names(0, 1))
			}
			if fails {
				after := back.Sub(time.UnixMicro(returned.Load()))
				if after > maxWait/2 {
					t.Errorf("task 1 went back %v after task 0 failed, want well within half its MaxWait (%v)", after, maxWait/2)
				}
				t.Logf("task 1 went back %v after task 0 failed (MaxWait %v)", after, maxWait)
			} else if n := len(g.log.eventsOf(asynqmutex.OpOutOfTurn)); n > 0 {
				t.Errorf("control: task 1 went back %d times; want it to wait for task 0, which ran for two thirds of its MaxWait", n)
			}
		})
	}
}

// TestOrderAfterLockRedisLosesWrites: the locks and sequences live in a Redis of
// their own, restarted while a key's tasks wait in asynq's. Without persistence the
// sequences are lost, and every waiting task runs outside the order, reported as
// OpOutOfOrder (docs/order.md, "What breaks order"): the control that shows the
// case is real. With appendfsync always nothing is lost: the tasks run in order and
// none is reported.
func TestOrderAfterLockRedisLosesWrites(t *testing.T) {
	t.Parallel()
	const tasks = 6
	for _, tc := range []struct {
		name       string
		args       []string
		outOfOrder int
	}{
		{"without persistence", nil, tasks},
		{"appendfsync always", []string{"--appendonly", "yes", "--appendfsync", "always"}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t) // asynq's Redis: its tasks survive
			lockRedis := redistest.Start(t, tc.args...)
			locks := mutex.New(lockRedis.Client(t))
			log := newOrderLog()
			opts := func(insp *asynq.Inspector) []asynqmutex.Option {
				return []asynqmutex.Option{asynqmutex.For(orderedType), asynqmutex.On("key"),
					asynqmutex.InOrder(insp), asynqmutex.MaxWait(5 * time.Second), asynqmutex.Observe(log.observe)}
			}
			prod := asynqmutex.NewProducer(locks, e.cli, opts(nil)...)
			for seq := range tasks {
				p := orderPayload{Key: "k", Seq: seq}
				if err := log.enqueue(p, func() error {
					_, err := prod.Enqueue(context.Background(), asynq.NewTask(orderedType, payload(t, p)))
					return err
				}); err != nil {
					t.Fatal(err)
				}
			}
			lockRedis.Restart(t)

			mux := asynq.NewServeMux()
			mux.HandleFunc(orderedType, func(ctx context.Context, task *asynq.Task) error {
				var p orderPayload
				if err := json.Unmarshal(task.Payload(), &p); err != nil {
					return err
				}
				log.mu.Lock()
				defer log.mu.Unlock()
				log.runs[p.Key] = append(log.runs[p.Key], p.name())
				log.succeeded[p.name()]++
				return nil
			})
			// The locks' Redis is not asynq's: parked tasks are started through asynq's.
			mux.Use(asynqmutex.Middleware(mutex.New(lockRedis.Client(t)), append(opts(e.insp), asynqmutex.Inspector(e.insp))...))
			startServer(t, e.opt, asynqmutex.Configure(asynq.Config{Concurrency: 4}), mux)
			waitFor(t, 30*time.Second, "every task ran", func() (bool, string) {
				n := log.done()
				return n == tasks, fmt.Sprintf("%d of %d ran", n, tasks)
			})
			if got := len(log.eventsOf(asynqmutex.OpOutOfOrder)); got != tc.outOfOrder {
				t.Errorf("%d tasks reported out of order, want %d", got, tc.outOfOrder)
			}
			if tc.outOfOrder == 0 {
				if n, first := log.outOfOrder(); n > 0 {
					t.Errorf("%d pairs ran out of order; first: %s", n, first)
				}
			}
		})
	}
}

// TestOrderStalledBehindPendingTask: a key's first task goes to a queue no server
// reads; the key's next task, on a queue that is read, is sent back behind it for as
// long as it stays so (the key does not move past a task that will run), and each
// time it is, an OpOrderStalled event names the place, its task, its queue and that
// no server reads it; a Warn line says so once. Control: with a server that reads
// the queue, busy with another task, the stall is reported as a task merely pending.
func TestOrderStalledBehindPendingTask(t *testing.T) {
	t.Parallel()
	const grace = time.Second
	for _, read := range []bool{false, true} {
		t.Run(fmt.Sprintf("queue read=%v", read), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			log := newOrderLog()
			var logged redistest.SyncBuffer
			opts := []asynqmutex.Option{asynqmutex.For(orderedType), asynqmutex.On("key"),
				asynqmutex.InOrder(e.insp), asynqmutex.OrderGrace(grace), asynqmutex.OnConflict(asynqmutex.RetryLater(time.Second)),
				asynqmutex.Observe(log.observe), asynqmutex.Logger(slog.New(slog.NewTextHandler(&logged, nil)))}
			locks := mutex.New(e.rdb)
			prod := asynqmutex.NewProducer(locks, e.cli, opts...)
			release := make(chan struct{})
			t.Cleanup(func() { close(release) })
			if read {
				// A server that reads "critical", busy with a task that holds its only
				// worker until the test ends.
				busy := asynq.NewServeMux()
				busy.HandleFunc("blocker", func(ctx context.Context, _ *asynq.Task) error {
					select {
					case <-release:
					case <-ctx.Done():
					}
					return nil
				})
				busy.HandleFunc(orderedType, log.handler)
				busy.Use(asynqmutex.Middleware(locks, opts...))
				startServer(t, e.opt, asynqmutex.Configure(asynq.Config{Concurrency: 1, Queues: map[string]int{"critical": 1}}), busy)
				info, err := e.cli.Enqueue(asynq.NewTask("blocker", nil), asynq.Queue("critical"))
				if err != nil {
					t.Fatal(err)
				}
				waitState(t, e.insp, "critical", info.ID, asynq.TaskStateActive, 10*time.Second)
			}
			first, err := prod.Enqueue(context.Background(), asynq.NewTask(orderedType, payload(t, orderPayload{Key: "k", Seq: 0})), asynq.Queue("critical"))
			if err != nil {
				t.Fatal(err)
			}
			if _, err := prod.Enqueue(context.Background(), asynq.NewTask(orderedType, payload(t, orderPayload{Key: "k", Seq: 1}))); err != nil {
				t.Fatal(err)
			}
			mux := asynq.NewServeMux()
			mux.HandleFunc(orderedType, log.handler)
			mux.Use(asynqmutex.Middleware(locks, opts...))
			startServer(t, e.opt, asynqmutex.Configure(asynq.Config{Concurrency: 2, Queues: map[string]int{"default": 1}}), mux)

			waitFor(t, 10*grace+10*time.Second, "the second task sent back twice behind a stalled place", func() (bool, string) {
				n := len(log.eventsOf(asynqmutex.OpOrderStalled))
				return n >= 2, fmt.Sprintf("%d stall events", n)
			})
			if n := log.done(); n != 0 {
				t.Fatalf("%d tasks ran, want none: the key waits for its first task", n)
			}
			for _, ev := range log.eventsOf(asynqmutex.OpOrderStalled) {
				var se *asynqmutex.StallError
				if !errors.As(ev.Err, &se) {
					t.Fatalf("OpOrderStalled's Err = %v, want a *StallError", ev.Err)
				}
				if se.Place != 1 || se.TaskID != first.ID || se.Queue != "critical" || se.Age < grace {
					t.Errorf("stall %+v, want place 1, task %s in queue critical, older than %v", se, first.ID, grace)
				}
				if wantUnread := !read; (se.Readers == 0) != wantUnread {
					t.Errorf("stall with %d readers of its queue: %v; want no reader %v", se.Readers, se, wantUnread)
				}
			}
			if n := strings.Count(logged.String(), "an ordered key waits for a task that has not started"); n != 1 {
				t.Errorf("logged the stall %d times, want once per place: %s", n, logged.String())
			}
			if !strings.Contains(logged.String(), "queue=critical") {
				t.Errorf("the log line names no queue: %s", logged.String())
			}
		})
	}
}

// TestOrderParkedTaskGoneIsMovedPast: under the default policy, the tasks behind a
// running ordered task park; one of them deleted while parked is moved past the
// moment its turn comes (reason "missing"), and the task after it is started by that
// same step, not by its fallback.
func TestOrderParkedTaskGoneIsMovedPast(t *testing.T) {
	t.Parallel()
	g := newGapEnv(t, 10*time.Second)
	g.opts = []asynqmutex.Option{asynqmutex.For(orderedType), asynqmutex.On("key"),
		asynqmutex.InOrder(g.insp), asynqmutex.Observe(g.log.observe)}
	first, second, third := g.enqueue(t, 1), g.enqueue(t, 2), g.enqueue(t, 3)
	release := make(chan struct{})
	var released sync.Once
	t.Cleanup(func() { released.Do(func() { close(release) }) })
	g.start(t, func(ctx context.Context, task *asynq.Task) error {
		if id, _ := asynq.GetTaskID(ctx); id == first {
			<-release
		}
		return g.log.handler(ctx, task)
	})

	// Both tasks behind the first park (the second after its LeadWait) and are back in
	// asynq's retry set.
	waitFor(t, 10*asynqmutex.LeadWait, "tasks 2 and 3 parked", func() (bool, string) {
		parked := 0
		for _, e := range g.log.eventsOf(asynqmutex.OpOutOfTurn) {
			if e.Policy == "park" {
				parked++
			}
		}
		info, err := g.insp.GetTaskInfo("default", second)
		return parked >= 2 && err == nil && info.State == asynq.TaskStateRetry, fmt.Sprintf("%d parked, task 2: %v", parked, err)
	})
	if err := g.insp.DeleteTask("default", second); err != nil {
		t.Fatal(err)
	}
	released.Do(func() { close(release) })

	if got, want := g.ran(t, 2, 30*time.Second), names(1, 3); !slices.Equal(got, want) {
		t.Fatalf("ran %v, want %v", got, want)
	}
	if r := g.skips()[2]; r != "missing" {
		t.Errorf("place 2 skipped for %q, want missing; skips %v", r, g.skips())
	}
	started := false
	for _, e := range g.log.eventsOf(asynqmutex.OpParkStarted) {
		started = started || e.TaskID == third
	}
	if !started {
		t.Errorf("task 3 was not started when the key moved past place 2 (it came by its fallback); events %v", g.log.events)
	}
}

// TestOrderHaltOnFailure: under HaltOnFailure a task that fails for good halts its
// key at its place: the tasks after it park and none runs while it stays halted (no
// gap rule moves past the archived task, waited out over four graces), and
// OpOrderHalted names the place. Run again from asynq's archive, the task completes
// and moves the key on: the rest run in order. The control: without HaltOnFailure,
// under the same defaults, the key moves past the failed task at once.
func TestOrderHaltOnFailure(t *testing.T) {
	t.Parallel()
	const grace = time.Second
	for _, halt := range []bool{true, false} {
		t.Run(fmt.Sprintf("halt=%v", halt), func(t *testing.T) {
			t.Parallel()
			g := newGapEnv(t, grace)
			g.opts = []asynqmutex.Option{asynqmutex.For(orderedType), asynqmutex.On("key"),
				asynqmutex.InOrder(g.insp), asynqmutex.OrderGrace(grace), asynqmutex.Observe(g.log.observe)}
			if halt {
				g.opts = append(g.opts, asynqmutex.HaltOnFailure())
			}
			g.prod = asynqmutex.NewProducer(mutex.New(g.rdb), g.cli, g.opts...)
			first := g.enqueue(t, 1, asynq.MaxRetry(0))
			g.enqueue(t, 2)
			g.enqueue(t, 3)
			key, err := g.prod.Key(context.Background(), asynq.NewTask(orderedType, payload(t, orderPayload{Key: "k"})))
			if err != nil {
				t.Fatal(err)
			}
			var failed atomic.Bool
			g.start(t, func(ctx context.Context, task *asynq.Task) error {
				if id, _ := asynq.GetTaskID(ctx); id == first && !failed.Swap(true) {
					return fmt.Errorf("the ledger refused the entry: %w", asynq.SkipRetry)
				}
				return g.log.handler(ctx, task)
			})
			if !halt {
				if got, want := g.ran(t, 2, 30*time.Second), names(2, 3); !slices.Equal(got, want) {
					t.Fatalf("ran %v, want %v", got, want)
				}
				if r := g.skips()[1]; r != "failed" {
					t.Errorf("place 1 skipped for %q, want failed; skips %v", r, g.skips())
				}
				return
			}

			waitFor(t, 10*asynqmutex.LeadWait, "the key halted at place 1, task 2 parked", func() (bool, string) {
				st, err := g.seq.Inspect(context.Background(), key)
				return err == nil && st.Halted == 1 && st.Parked >= 1, fmt.Sprintf("%+v, %v", st, err)
			})
			time.Sleep(4 * grace) // a gap rule would have moved past the archived task by now
			if n := g.log.done(); n != 0 {
				t.Fatalf("%d tasks ran behind the halted place, want none; runs %v", n, g.log.runs)
			}
			if st, err := g.seq.Inspect(context.Background(), key); err != nil || st.Next != 1 || st.Halted != 1 {
				t.Fatalf("order after %v halted = %+v, %v; want still at place 1, halted", 4*grace, st, err)
			}
			halts := g.log.eventsOf(asynqmutex.OpOrderHalted)
			var he *asynqmutex.HaltError
			if len(halts) != 1 || !errors.As(halts[0].Err, &he) || he.Place != 1 || he.TaskID != first || !errors.Is(he, asynq.SkipRetry) {
				t.Errorf("OpOrderHalted events %v, want one naming place 1 and task %s, wrapping its error", halts, first)
			}

			if err := g.insp.RunTask("default", first); err != nil {
				t.Fatal(err)
			}
			if got, want := g.ran(t, 3, 30*time.Second), names(1, 2, 3); !slices.Equal(got, want) {
				t.Fatalf("ran %v after task 1 was run again, want %v", got, want)
			}
			if len(g.skips()) != 0 {
				t.Errorf("places skipped %v, want none", g.skips())
			}
		})
	}
}

// TestOrderHaltOnArchived: under HaltOnFailure a key halts at any task asynq holds
// archived when the key's turn comes to it, not only at one whose worker saw it fail:
// here a last try cut short by its deadline (asynq archives it; its worker keeps its
// place, as for a shutdown), found by the task after it; and a task on its last try
// behind a halted place waits for it (LastTryWait) rather than be archived at once,
// and runs when the key moves on. Nothing is skipped.
func TestOrderHaltOnArchived(t *testing.T) {
	t.Parallel()
	const grace = time.Second
	g := newGapEnv(t, grace)
	// A short TTL: the tasks parked behind the first come back by their fallback (a
	// claim) to find it archived.
	g.opts = []asynqmutex.Option{asynqmutex.For(orderedType), asynqmutex.On("key"), asynqmutex.TTL(2 * time.Second),
		asynqmutex.InOrder(g.insp), asynqmutex.OrderGrace(grace), asynqmutex.Observe(g.log.observe), asynqmutex.HaltOnFailure()}
	g.prod = asynqmutex.NewProducer(mutex.New(g.rdb), g.cli, g.opts...)
	first := g.enqueue(t, 1, asynq.MaxRetry(0), asynq.Timeout(time.Second))
	g.enqueue(t, 2)
	key, err := g.prod.Key(context.Background(), asynq.NewTask(orderedType, payload(t, orderPayload{Key: "k"})))
	if err != nil {
		t.Fatal(err)
	}
	var cut atomic.Bool
	g.start(t, func(ctx context.Context, task *asynq.Task) error {
		if id, _ := asynq.GetTaskID(ctx); id == first && !cut.Swap(true) {
			<-ctx.Done()
			return fmt.Errorf("the ledger call timed out: %w", ctx.Err())
		}
		return g.log.handler(ctx, task)
	})
	waitFor(t, 30*time.Second, "the key halted at place 1", func() (bool, string) {
		st, err := g.seq.Inspect(context.Background(), key)
		return err == nil && st.Halted == 1, fmt.Sprintf("%+v, %v", st, err)
	})
	halts := g.log.eventsOf(asynqmutex.OpOrderHalted)
	var he *asynqmutex.HaltError
	if len(halts) == 0 || !errors.As(halts[0].Err, &he) || he.Place != 1 || he.TaskID != first {
		t.Errorf("OpOrderHalted events %v, want one naming place 1 and task %s", halts, first)
	}
	// A task on its last try takes the next place behind the halted one.
	g.enqueue(t, 3, asynq.MaxRetry(0))
	time.Sleep(4 * grace)
	if n := g.log.done(); n != 0 {
		t.Fatalf("%d tasks ran behind the halted place, want none; runs %v", n, g.log.runs)
	}
	if info, err := g.insp.GetTaskInfo("default", g.ids[2]); err != nil || info.State == asynq.TaskStateArchived {
		t.Fatalf("task 3, on its last try behind the halted place, is %v (%v); want it waiting, not archived at once", info.State, err)
	}
	if err := g.insp.RunTask("default", first); err != nil {
		t.Fatal(err)
	}
	if got, want := g.ran(t, 3, 30*time.Second), names(1, 2, 3); !slices.Equal(got, want) {
		t.Fatalf("ran %v after task 1 was run again, want %v", got, want)
	}
	if len(g.skips()) != 0 {
		t.Errorf("places skipped %v, want none", g.skips())
	}
}
