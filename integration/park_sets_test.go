package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynqmutex/asynqmutex"
)

type setPayload struct {
	From string `json:"from"`
	To   string `json:"to"`
	N    string `json:"n"`
}

// setRecorder runs the tests' transfers: "set:hold" stays inside until release is
// closed; "set:task" records that it ran. Each is inside both its accounts meanwhile,
// and two inside one account at once are an overlap.
type setRecorder struct {
	release  chan struct{}
	mu       sync.Mutex
	inside   map[string]int
	overlaps []string
	runs     map[string]int
	ran      []string
}

func newSetRecorder() *setRecorder {
	return &setRecorder{release: make(chan struct{}), inside: map[string]int{}, runs: map[string]int{}}
}

func (r *setRecorder) handler() asynq.Handler {
	return asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		var p setPayload
		if err := json.Unmarshal(task.Payload(), &p); err != nil {
			return err
		}
		r.mu.Lock()
		for _, a := range []string{p.From, p.To} {
			if r.inside[a]++; r.inside[a] > 1 {
				r.overlaps = append(r.overlaps, fmt.Sprintf("%s found account %s busy", p.N, a))
			}
		}
		r.runs[p.N]++
		r.mu.Unlock()
		if task.Type() == "set:hold" {
			select {
			case <-r.release:
			case <-ctx.Done():
			}
		} else {
			time.Sleep(5 * time.Millisecond) // long enough for a broken lock to show
		}
		r.mu.Lock()
		r.inside[p.From]--
		r.inside[p.To]--
		if task.Type() != "set:hold" {
			r.ran = append(r.ran, p.N)
		}
		r.mu.Unlock()
		return nil
	})
}

// TestParkSeveralKeys: transfers under OnEach("from", "to") that all touch a busy
// account park in its line, holding none of their keys, with no worker waiting but
// the line's lead; when the account frees, the line runs them one at a time, started
// by it well before their fallback, none twice, none spending a retry, no two on one
// account at once. The control shows that the overlap checker trips.
func TestParkSeveralKeys(t *testing.T) {
	t.Parallel()
	t.Run("OnEach", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		r := newSetRecorder()
		var (
			evMu     sync.Mutex
			policies = map[string]int{}
		)
		mw := asynqmutex.Middleware(e.locks, asynqmutex.OnEach("from", "to"), asynqmutex.Scope("acct"), asynqmutex.TTL(parkTTL),
			asynqmutex.Observe(func(_ context.Context, ev asynqmutex.Event) {
				if ev.Op == asynqmutex.OpConflict {
					evMu.Lock()
					policies[ev.Policy]++
					evMu.Unlock()
				}
			}))
		startServer(t, e.opt, asynqmutex.Configure(asynq.Config{Concurrency: 8}), mw(r.handler()))
		enqueue := func(typ string, p setPayload) {
			e.enqueue(t, typ, payload(t, p), asynq.TaskID(p.N), asynq.MaxRetry(5), asynq.Retention(time.Hour))
		}
		inspect := func(account string) (held bool, waiting, parked int, desc string) {
			in, err := e.locks.Inspect(context.Background(), lockKey(t, "acct", account))
			if err != nil {
				t.Fatalf("Inspect: %v", err)
			}
			return in.Held, in.Waiting, in.Parked, fmt.Sprintf("%s: held %v by %v, %d waiting, %d parked", account, in.Held, in.Holder.ID, in.Waiting, in.Parked)
		}

		enqueue("set:hold", setPayload{From: "A", To: "X", N: "hold"})
		waitFor(t, 10*time.Second, "hold to hold A", func() (bool, string) {
			held, _, _, desc := inspect("A")
			return held, desc
		})
		tasks := []setPayload{{"A", "B", "t1"}, {"B", "A", "t2"}, {"A", "C", "t3"}, {"C", "A", "t4"}, {"A", "B", "t5"}, {"B", "A", "t6"}}
		inWorkers := 0 // the most entries of A's line that were not parked
		for i, p := range tasks {
			enqueue("set:task", p)
			waitFor(t, 10*time.Second, fmt.Sprintf("%d in A's line", i+1), func() (bool, string) {
				_, waiting, parked, desc := inspect("A")
				inWorkers = max(inWorkers, waiting-parked)
				return waiting == i+1, desc
			})
		}
		for _, p := range tasks[1:] {
			waitState(t, e.insp, "default", p.N, asynq.TaskStateRetry, 10*time.Second)
		}
		_, waiting, parked, desc := inspect("A")
		inWorkers = max(inWorkers, waiting-parked)
		if inWorkers > 1 {
			t.Errorf("up to %d of A's line waited in a worker, want the lead alone (%s)", inWorkers, desc)
		}
		active, err := e.insp.ListActiveTasks("default")
		if err != nil {
			t.Fatalf("ListActiveTasks: %v", err)
		}
		if len(active) > 2 {
			t.Errorf("%d tasks hold a worker, want hold and the lead at most", len(active))
		}
		for _, acct := range []string{"B", "C"} {
			if held, waiting, _, desc := inspect(acct); held || waiting != 0 {
				t.Errorf("a parked transfer holds or waits for its other account: %s", desc)
			}
		}

		released := time.Now()
		close(r.release)
		waitFor(t, parkTTL/2, "the line to run", func() (bool, string) {
			r.mu.Lock()
			defer r.mu.Unlock()
			return len(r.ran) == len(tasks), fmt.Sprintf("ran %v", r.ran)
		})
		t.Logf("the line ran %v within %v of the release", r.ran, time.Since(released).Round(time.Millisecond))
		for _, p := range tasks {
			if info := waitState(t, e.insp, "default", p.N, asynq.TaskStateCompleted, 10*time.Second); info.Retried != 0 {
				t.Errorf("%s spent %d retries, want 0", p.N, info.Retried)
			}
		}
		evMu.Lock()
		if policies["park"] == 0 || len(policies) != 1 {
			t.Errorf("conflicts by policy %v, want parks alone", policies)
		}
		evMu.Unlock()
		r.mu.Lock()
		defer r.mu.Unlock()
		for n, runs := range r.runs {
			if runs != 1 {
				t.Errorf("%s ran %d times, want once", n, runs)
			}
		}
		if len(r.overlaps) > 0 {
			t.Errorf("%d overlaps, first: %s", len(r.overlaps), r.overlaps[0])
		}
	})
	t.Run("control without locks", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		r := newSetRecorder()
		startServer(t, e.opt, asynqmutex.Configure(asynq.Config{Concurrency: 4}), r.handler())
		for _, p := range []setPayload{{"A", "B", "c1"}, {"B", "A", "c2"}} {
			e.enqueue(t, "set:hold", payload(t, p), asynq.TaskID(p.N))
		}
		waitFor(t, 10*time.Second, "both inside", func() (bool, string) {
			r.mu.Lock()
			defer r.mu.Unlock()
			return r.runs["c1"] == 1 && r.runs["c2"] == 1, fmt.Sprintf("runs %v", r.runs)
		})
		close(r.release)
		r.mu.Lock()
		defer r.mu.Unlock()
		if len(r.overlaps) == 0 {
			t.Error("two transfers on one account ran at once, unseen: the checker cannot see a broken lock")
		}
	})
}

// TestParkSeveralKeysBurst: transfers between random pairs of four accounts, on two
// servers, all enqueued at once, under the default Park: every one runs, once, with
// no two on one account at once and no retry spent, and a task parks about once, not
// again and again: a task whose turn came at one account and that finds its other
// busy waits for it, rather than hand its turn on (each giving back a key for one
// that is on its way to another task, the keys went round and the accounts ran
// almost nothing, long past the fallback).
func TestParkSeveralKeysBurst(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	r := newSetRecorder()
	close(r.release)
	var (
		evMu      sync.Mutex
		conflicts int
	)
	for range 2 {
		locks, _ := newLocks(t, e.opt)
		mw := asynqmutex.Middleware(locks, asynqmutex.OnEach("from", "to"), asynqmutex.Scope("acct"), asynqmutex.TTL(parkTTL),
			asynqmutex.Observe(func(_ context.Context, ev asynqmutex.Event) {
				if ev.Op == asynqmutex.OpConflict {
					evMu.Lock()
					conflicts++
					evMu.Unlock()
				}
			}))
		startServer(t, e.opt, asynqmutex.Configure(asynq.Config{Concurrency: 5}), mw(r.handler()))
	}
	const n, accounts = 60, 4
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range n {
		from := rng.IntN(accounts)
		to := (from + 1 + rng.IntN(accounts-1)) % accounts
		p := setPayload{From: fmt.Sprintf("a%d", from), To: fmt.Sprintf("a%d", to), N: fmt.Sprintf("t%d", i)}
		e.enqueue(t, "set:task", payload(t, p), asynq.TaskID(p.N), asynq.MaxRetry(5), asynq.Retention(time.Hour))
	}
	waitFor(t, 3*parkTTL, fmt.Sprintf("%d transfers", n), func() (bool, string) {
		r.mu.Lock()
		defer r.mu.Unlock()
		return len(r.ran) == n, fmt.Sprintf("ran %d", len(r.ran))
	})
	for i := range n {
		if info := waitState(t, e.insp, "default", fmt.Sprintf("t%d", i), asynq.TaskStateCompleted, 10*time.Second); info.Retried != 0 {
			t.Errorf("t%d spent %d retries, want 0", i, info.Retried)
		}
	}
	evMu.Lock()
	defer evMu.Unlock()
	t.Logf("%d transfers, %d conflicts", n, conflicts)
	if conflicts > 5*n {
		t.Errorf("%d conflicts for %d transfers: tasks parked again and again", conflicts, n)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for id, runs := range r.runs {
		if runs != 1 {
			t.Errorf("%s ran %d times, want once", id, runs)
		}
	}
	if len(r.overlaps) > 0 {
		t.Errorf("%d overlaps, first: %s", len(r.overlaps), r.overlaps[0])
	}
}
