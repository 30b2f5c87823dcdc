package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynqmutex/asynqmutex"
	"github.com/asynqmutex/asynqmutex/internal/redistest"
	"github.com/asynqmutex/asynqmutex/mutex"
)

// parkTTL is the lock's TTL in the parking tests: a parked task comes back by itself
// after it (its fallback), so a task that ran well before it was started by its line.
const parkTTL = 10 * time.Second

type parkPayload struct {
	Key string `json:"key"`
	N   string `json:"n"`
}

// parkRecorder runs the parking tests' handlers: "park:hold" holds its key until
// release is closed; "park:task" records that it ran, and when.
type parkRecorder struct {
	release chan struct{}
	tr      *tracker
	mu      sync.Mutex
	order   []string
	at      map[string]time.Time
}

func newParkRecorder() *parkRecorder {
	return &parkRecorder{release: make(chan struct{}), tr: newTracker(), at: map[string]time.Time{}}
}

func (r *parkRecorder) handler() asynq.Handler {
	return asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		var p parkPayload
		if err := json.Unmarshal(task.Payload(), &p); err != nil {
			return err
		}
		r.tr.enter(p.Key, p.N, "")
		defer r.tr.exit(p.Key)
		if task.Type() == "park:hold" {
			select {
			case <-r.release:
			case <-ctx.Done():
			}
			return nil
		}
		r.mu.Lock()
		r.order = append(r.order, p.N)
		r.at[p.N] = time.Now()
		r.mu.Unlock()
		return nil
	})
}

func (r *parkRecorder) ran() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.order)
}

// lineOf is what the lock Redis says of key's line: entries, and how many are parked.
func lineOf(t testing.TB, locks *mutex.Client, key string) (waiting, parked int) {
	t.Helper()
	in, err := locks.Inspect(context.Background(), key)
	if err != nil {
		t.Fatalf("Inspect: %v", err)
	}
	return in.Waiting, in.Parked
}

// parkLine enqueues a task that holds key "k" (in Scope "park") and then the tasks
// ns, each once the one before it is in the key's line, so that the line's order is
// theirs; it returns when every one is parked (in the retry set) but the first, which
// may be waiting in a worker as the line's lead.
func parkLine(t *testing.T, cli *asynq.Client, insp *asynq.Inspector, locks *mutex.Client, queue string, ns ...string) {
	t.Helper()
	enqueue := func(typ, n string, opts ...asynq.Option) {
		if _, err := cli.Enqueue(asynq.NewTask(typ, payload(t, parkPayload{Key: "k", N: n})), append(opts, asynq.TaskID(n), asynq.Queue(queue), asynq.Retention(time.Hour))...); err != nil {
			t.Fatalf("Enqueue %s: %v", n, err)
		}
	}
	enqueue("park:hold", "hold")
	// Active is dequeued, not yet holding: the tasks after it must find the key held.
	waitFor(t, 10*time.Second, "hold to hold the key", func() (bool, string) {
		in, err := locks.Inspect(context.Background(), lockKey(t, "park", "k"))
		return err == nil && in.Held && in.Holder.ID == "hold", fmt.Sprintf("held %v by %v (%v)", in.Held, in.Holder, err)
	})
	for i, n := range ns {
		enqueue("park:task", n, asynq.MaxRetry(5))
		waitFor(t, 10*time.Second, fmt.Sprintf("%d in the line", i+1), func() (bool, string) {
			in, err := locks.Inspect(context.Background(), lockKey(t, "park", "k"))
			_, task := taskInfo(insp, queue, n)
			_, hold := taskInfo(insp, queue, "hold")
			return err == nil && in.Waiting == i+1, fmt.Sprintf("%d waiting, %d parked, held %v by %v (%v); %s; hold: %s",
				in.Waiting, in.Parked, in.Held, in.Holder, err, task, hold)
		})
	}
	for _, n := range ns[1:] {
		waitState(t, insp, queue, n, asynq.TaskStateRetry, 10*time.Second)
	}
}

// checkParkedOn parks two tasks behind a held key on a server and lock client built
// from opt, in a queue of their own (other servers may read "default"), and checks that the release runs them in order, started by their line,
// well before their fallback.
func checkParkedOn(t *testing.T, opt asynq.RedisConnOpt) {
	t.Helper()
	r := newParkRecorder()
	locks, _ := newLocks(t, opt)
	insp, cli := newInspector(t, opt), newClient(t, opt)
	mw := asynqmutex.Middleware(locks, asynqmutex.On("key"), asynqmutex.Scope("park"), asynqmutex.TTL(parkTTL))
	startServer(t, opt, asynqmutex.Configure(asynq.Config{Concurrency: 4, Queues: map[string]int{"park": 1}}), mw(r.handler()))
	parkLine(t, cli, insp, locks, "park", "p1", "p2")
	close(r.release)
	waitFor(t, parkTTL/2, "the line to run", func() (bool, string) {
		got := r.ran()
		return len(got) == 2, fmt.Sprintf("ran %v", got)
	})
	if got := r.ran(); !slices.Equal(got, []string{"p1", "p2"}) {
		t.Errorf("ran %v, want [p1 p2]", got)
	}
}

// TestParkedTaskPassedOverOrKeptInPlace: tasks of a busy key park in its line; when
// the holder ends, the line starts them one at a time, in order, long before their
// fallback (the TTL). A parked task an operator deletes or archives meanwhile is
// passed over (an archived one stays archived), and one run by hand arrives early and
// keeps its place. None spends a retry, none runs twice, none overlaps another.
func TestParkedTaskPassedOverOrKeptInPlace(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		op   string
		want []string
	}{
		{"none", []string{"p1", "p2", "p3"}},
		{"delete", []string{"p2", "p3"}},
		{"archive", []string{"p2", "p3"}},
		{"run by hand", []string{"p1", "p2", "p3"}},
	} {
		t.Run(c.op, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			r := newParkRecorder()
			locks, _ := newLocks(t, e.opt)
			var (
				evMu sync.Mutex
				ops  = map[asynqmutex.Op][]string{} // task IDs by op
			)
			observe := func(_ context.Context, ev asynqmutex.Event) {
				evMu.Lock()
				ops[ev.Op] = append(ops[ev.Op], ev.TaskID)
				evMu.Unlock()
			}
			mw := asynqmutex.Middleware(locks, asynqmutex.On("key"), asynqmutex.Scope("park"), asynqmutex.TTL(parkTTL), asynqmutex.Observe(observe))
			startServer(t, e.opt, asynqmutex.Configure(asynq.Config{Concurrency: 4}), mw(r.handler()))
			parkLine(t, e.cli, e.insp, e.locks, "default", "p1", "p2", "p3")

			switch c.op {
			case "delete", "archive":
				// p1 is the line's lead: it parks too once LeadWait is over.
				waitState(t, e.insp, "default", "p1", asynq.TaskStateRetry, 10*time.Second)
				var err error
				if c.op == "delete" {
					err = e.insp.DeleteTask("default", "p1")
				} else {
					err = e.insp.ArchiveTask("default", "p1")
				}
				if err != nil {
					t.Fatalf("%s p1: %v", c.op, err)
				}
			case "run by hand":
				if err := e.insp.RunTask("default", "p2"); err != nil {
					t.Fatalf("RunTask p2: %v", err)
				}
				waitFor(t, 10*time.Second, "p2 to arrive and find its place", func() (bool, string) {
					info, desc := taskInfo(e.insp, "default", "p2")
					return info != nil && info.State != asynq.TaskStatePending, desc
				})
				if w, _ := lineOf(t, e.locks, lockKey(t, "park", "k")); w != 3 {
					t.Fatalf("line after p2 arrived early: %d entries, want 3", w)
				}
			}
			released := time.Now()
			close(r.release)
			waitFor(t, parkTTL/2, "the line to run", func() (bool, string) {
				got := r.ran()
				return len(got) == len(c.want), fmt.Sprintf("ran %v", got)
			})
			if got := r.ran(); !slices.Equal(got, c.want) {
				t.Errorf("ran %v, want %v in this order", got, c.want)
			}
			for _, n := range c.want {
				info := waitState(t, e.insp, "default", n, asynq.TaskStateCompleted, 10*time.Second)
				if info.Retried != 0 {
					t.Errorf("%s spent %d retries, want 0", n, info.Retried)
				}
			}
			if c.op == "archive" {
				waitState(t, e.insp, "default", "p1", asynq.TaskStateArchived, time.Second)
			}
			evMu.Lock()
			passed, started := ops[asynqmutex.OpParkPassedOver], ops[asynqmutex.OpParkStarted]
			evMu.Unlock()
			if wantPassed := c.op == "delete" || c.op == "archive"; wantPassed != slices.Equal(passed, []string{"p1"}) {
				t.Errorf("OpParkPassedOver for %v, want p1 alone when it was deleted or archived", passed)
			}
			if len(started) == 0 {
				t.Errorf("no OpParkStarted reported")
			}
			r.tr.mu.Lock()
			defer r.tr.mu.Unlock()
			for n, runs := range r.tr.runs {
				if runs != 1 {
					t.Errorf("%s ran %d times, want once", n, runs)
				}
			}
			if r.tr.maxPerKey["k"] != 1 {
				t.Errorf("up to %d tasks of the key ran at once, want 1", r.tr.maxPerKey["k"])
			}
			t.Logf("%s: the line ran %v within %v of the release", c.op, c.want, time.Since(released).Round(time.Millisecond))
		})
	}
}

// TestParkedTasksComeBackAfterLockRedisRestart: tasks parked in a line that a lock
// Redis without persistence loses (restarted) come back by their fallback, the TTL,
// and each runs once, one at a time, spending no retry.
func TestParkedTasksComeBackAfterLockRedisRestart(t *testing.T) {
	t.Parallel()
	const ttl, tasks = 2 * time.Second, 5
	e := newEnv(t) // asynq's Redis
	lockSrv := redistest.Start(t)
	locks := mutex.New(lockSrv.Client(t))
	r := newParkRecorder()
	mw := asynqmutex.Middleware(locks, asynqmutex.On("key"), asynqmutex.Scope("park"), asynqmutex.TTL(ttl), asynqmutex.Inspector(e.insp))
	startServer(t, e.opt, asynqmutex.Configure(asynq.Config{Concurrency: 4}), mw(r.handler()))

	other := mutex.New(lockSrv.Client(t))
	if _, err := other.TryLock(context.Background(), lockKey(t, "park", "k-held"), time.Minute); err != nil {
		t.Fatal(err)
	}
	for i := range tasks {
		n := fmt.Sprintf("p%d", i)
		e.enqueue(t, "park:task", payload(t, parkPayload{Key: "k-held", N: n}), asynq.TaskID(n), asynq.MaxRetry(5), asynq.Retention(time.Hour))
	}
	waitFor(t, 10*time.Second, "every task in the line", func() (bool, string) {
		w, p := lineOf(t, locks, lockKey(t, "park", "k-held"))
		return w == tasks, fmt.Sprintf("%d waiting, %d parked", w, p)
	})
	lockSrv.Restart(t)
	restarted := time.Now()
	waitFor(t, 30*time.Second, "every task to run", func() (bool, string) {
		got := r.ran()
		return len(got) == tasks, fmt.Sprintf("ran %v", got)
	})
	t.Logf("all %d ran %v after the restart (fallback %v)", tasks, time.Since(restarted).Round(time.Millisecond), ttl)
	for i := range tasks {
		info := waitState(t, e.insp, "default", fmt.Sprintf("p%d", i), asynq.TaskStateCompleted, 10*time.Second)
		if info.Retried != 0 {
			t.Errorf("p%d spent %d retries, want 0", i, info.Retried)
		}
	}
	r.tr.mu.Lock()
	defer r.tr.mu.Unlock()
	for n, runs := range r.tr.runs {
		if runs != 1 {
			t.Errorf("%s ran %d times, want once", n, runs)
		}
	}
	if m := r.tr.maxPerKey["k-held"]; m != 1 {
		t.Errorf("up to %d tasks of the key ran at once, want 1", m)
	}
}

// TestParkUnderWorkerACL: a lock client logged in as a user with only the worker
// rules docs/operating.md quotes parks tasks and starts them in order, given the
// Inspector of asynq's own connection. Control: the default Inspector, on the lock
// client, may not read asynq's keys, so the line cannot start its tasks, which then
// come only by their fallback (the TTL).
func TestParkUnderWorkerACL(t *testing.T) {
	t.Parallel()
	acl := redistest.ReadDocACL(t, "../docs/operating.md")
	for _, c := range []struct {
		name      string
		inspector bool
	}{{"Inspector of asynq's connection", true}, {"control: default Inspector", false}} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			locker := e.redis.User(t, e.rdb, "locker", acl.Worker)
			locks := mutex.New(locker)
			r := newParkRecorder()
			opts := []asynqmutex.Option{asynqmutex.On("key"), asynqmutex.Scope("park"), asynqmutex.TTL(parkTTL)}
			if c.inspector {
				opts = append(opts, asynqmutex.Inspector(e.insp))
			}
			startServer(t, e.opt, asynqmutex.Configure(asynq.Config{Concurrency: 4}), asynqmutex.Middleware(locks, opts...)(r.handler()))
			parkLine(t, e.cli, e.insp, e.locks, "default", "p1", "p2", "p3")
			close(r.release)
			deadline := time.Now().Add(parkTTL / 2)
			for time.Now().Before(deadline) && len(r.ran()) < 3 {
				time.Sleep(pollEvery)
			}
			got := r.ran()
			switch {
			case c.inspector && !slices.Equal(got, []string{"p1", "p2", "p3"}):
				t.Errorf("within %v of the release ran %v, want [p1 p2 p3]", parkTTL/2, got)
			case !c.inspector && len(got) == 3:
				t.Errorf("control: the line started all of %v without asynq's rights", got)
			}
		})
	}
}

// TestParkLimit: the tasks of a Limit(2) key park in its line when both its slots are
// held; as each holder ends, the line hands its slot to the next parked task and
// starts it, long before its fallback (the TTL). At most two run at once, each once,
// and none spends a retry.
func TestParkLimit(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	r := newParkRecorder()
	var (
		evMu     sync.Mutex
		policies = map[string]int{} // the policies of the conflicts
	)
	observe := func(_ context.Context, ev asynqmutex.Event) {
		if ev.Op == asynqmutex.OpConflict {
			evMu.Lock()
			policies[ev.Policy]++
			evMu.Unlock()
		}
	}
	mw := asynqmutex.Middleware(e.locks, asynqmutex.On("key"), asynqmutex.Scope("park"), asynqmutex.Limit(2),
		asynqmutex.TTL(parkTTL), asynqmutex.Observe(observe))
	startServer(t, e.opt, asynqmutex.Configure(asynq.Config{Concurrency: 6}), mw(r.handler()))
	key := lockKey(t, "park", "k")
	enqueue := func(typ, n string) {
		e.enqueue(t, typ, payload(t, parkPayload{Key: "k", N: n}), asynq.TaskID(n), asynq.MaxRetry(5), asynq.Retention(time.Hour))
	}
	for i, n := range []string{"hold1", "hold2"} {
		enqueue("park:hold", n)
		waitFor(t, 10*time.Second, n+" to hold a slot", func() (bool, string) {
			in, err := e.locks.Inspect(context.Background(), key)
			return err == nil && len(in.Slots) == i+1, fmt.Sprintf("slots %v (%v)", in.Slots, err)
		})
	}
	ns := []string{"p1", "p2", "p3", "p4"}
	for i, n := range ns {
		enqueue("park:task", n)
		waitFor(t, 10*time.Second, fmt.Sprintf("%d in the line", i+1), func() (bool, string) {
			in, err := e.locks.Inspect(context.Background(), key)
			return err == nil && in.Waiting == i+1, fmt.Sprintf("%d waiting (%d parked): %v; %d slots held; %v", in.Waiting, in.Parked, in.Waiters, len(in.Slots), err)
		})
	}
	waitFor(t, 10*time.Second, "the tasks after the lead parked", func() (bool, string) {
		w, p := lineOf(t, e.locks, key)
		return p >= len(ns)-1, fmt.Sprintf("%d waiting, %d parked", w, p)
	})
	released := time.Now()
	close(r.release)
	waitFor(t, parkTTL/2, "the line to run", func() (bool, string) {
		got := r.ran()
		return len(got) == len(ns), fmt.Sprintf("ran %v", got)
	})
	t.Logf("the line ran %v within %v of the release", r.ran(), time.Since(released).Round(time.Millisecond))
	for _, n := range ns {
		if info := waitState(t, e.insp, "default", n, asynq.TaskStateCompleted, 10*time.Second); info.Retried != 0 {
			t.Errorf("%s spent %d retries, want 0", n, info.Retried)
		}
	}
	evMu.Lock()
	if policies["park"] == 0 || len(policies) != 1 {
		t.Errorf("conflicts by policy %v, want parks alone", policies)
	}
	evMu.Unlock()
	r.tr.mu.Lock()
	defer r.tr.mu.Unlock()
	for n, runs := range r.tr.runs {
		if runs != 1 {
			t.Errorf("%s ran %d times, want once", n, runs)
		}
	}
	if m := r.tr.maxPerKey["k"]; m != 2 {
		t.Errorf("up to %d tasks of the key ran at once, want 2", m)
	}
}

// TestParkedLineResumesAtLeaseEnd: a holder that crashes (takes the key and neither
// renews nor releases it) leaves every task of its key parked, with nobody to come;
// when its lease ends, a worker that parked a task there hands the key to the first
// in line and starts it, long before the parked tasks' own fallback (the TTL).
func TestParkedLineResumesAtLeaseEnd(t *testing.T) {
	t.Parallel()
	const lease = 3 * time.Second
	e := newEnv(t)
	r := newParkRecorder()
	locks, _ := newLocks(t, e.opt)
	crashed, _ := newLocks(t, e.opt)
	var mu sync.Mutex
	started := map[string]time.Time{}
	mw := asynqmutex.Middleware(locks, asynqmutex.On("key"), asynqmutex.Scope("park"), asynqmutex.TTL(parkTTL),
		asynqmutex.Observe(func(_ context.Context, ev asynqmutex.Event) {
			if ev.Op == asynqmutex.OpParkStarted {
				mu.Lock()
				started[ev.TaskID] = time.Now()
				mu.Unlock()
			}
		}))
	startServer(t, e.opt, asynqmutex.Configure(asynq.Config{Concurrency: 4}), mw(r.handler()))
	key := lockKey(t, "park", "k")
	if _, err := crashed.Lock(context.Background(), key, lease); err != nil {
		t.Fatal(err)
	}
	held := time.Now()
	// Each enqueued once the one before it is in the key's line, so that the line's
	// order is theirs.
	for i, n := range []string{"p1", "p2"} {
		if _, err := e.cli.Enqueue(asynq.NewTask("park:task", payload(t, parkPayload{Key: "k", N: n})), asynq.TaskID(n), asynq.MaxRetry(5)); err != nil {
			t.Fatal(err)
		}
		waitFor(t, lease/2, fmt.Sprintf("%s in the line", n), func() (bool, string) {
			waiting, parked := lineOf(t, locks, key)
			return waiting == i+1, fmt.Sprintf("%d waiting, %d parked", waiting, parked)
		})
	}
	waitFor(t, parkTTL, "both tasks to run", func() (bool, string) {
		got := r.ran()
		return len(got) == 2, fmt.Sprintf("ran %v", got)
	})
	if got := r.ran(); !slices.Equal(got, []string{"p1", "p2"}) {
		t.Errorf("ran %v, want [p1 p2]", got)
	}
	mu.Lock()
	defer mu.Unlock()
	at, ok := started["p1"]
	if !ok {
		t.Fatalf("p1 was not started by its line when the crashed holder's lease ended (it came by its fallback); started %v", started)
	}
	if since := at.Sub(held); since < lease {
		t.Errorf("p1 started %v after the key was taken, before the holder's lease of %v ended", since, lease)
	}
	if n, desc := r.tr.maxOverlap(); n > 1 {
		t.Errorf("%d tasks of the key at once: %s", n, desc)
	}
}
