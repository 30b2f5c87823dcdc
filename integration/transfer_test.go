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
	"github.com/asynqmutex/asynqmutex/mutex"
)

type transferPayload struct {
	From string `json:"from"`
	To   string `json:"to"`
	Seq  int    `json:"seq"`
}

// ledger is the resource transfers race on: balances updated by read, pause, write,
// so that two transfers on one account at once lose an update, and a count of
// handlers inside per account.
type ledger struct {
	mu        sync.Mutex
	balance   map[string]int
	inside    map[string]int
	overlaps  []string
	running   int
	most      int // handlers at once, over all accounts
	completed int
}

func newLedger() *ledger { return &ledger{balance: map[string]int{}, inside: map[string]int{}} }

func (l *ledger) transfer(ctx context.Context, task *asynq.Task) error {
	var p transferPayload
	if err := json.Unmarshal(task.Payload(), &p); err != nil {
		return err
	}
	l.mu.Lock()
	for _, a := range []string{p.From, p.To} {
		l.inside[a]++
		if l.inside[a] > 1 {
			l.overlaps = append(l.overlaps, fmt.Sprintf("transfer %d found account %s busy", p.Seq, a))
		}
	}
	l.running++
	l.most = max(l.most, l.running)
	from, to := l.balance[p.From], l.balance[p.To]
	l.mu.Unlock()

	time.Sleep(time.Duration(5+rand.IntN(10)) * time.Millisecond)

	l.mu.Lock()
	l.balance[p.From], l.balance[p.To] = from-1, to+1
	l.inside[p.From]--
	l.inside[p.To]--
	l.running--
	l.completed++
	l.mu.Unlock()
	return nil
}

// enqueueTransfers enqueues n transfers of 1 between random distinct accounts out of
// accounts, and returns the balances they should leave.
func enqueueTransfers(t *testing.T, e *env, n, accounts int) map[string]int {
	want := map[string]int{}
	r := rand.New(rand.NewPCG(42, uint64(n)))
	for i := range n {
		from := r.IntN(accounts)
		to := (from + 1 + r.IntN(accounts-1)) % accounts
		p := transferPayload{From: fmt.Sprintf("acct-%d", from), To: fmt.Sprintf("acct-%d", to), Seq: i}
		want[p.From]--
		want[p.To]++
		e.enqueue(t, "transfer", payload(t, p), asynq.MaxRetry(3), asynq.Retention(time.Hour))
	}
	return want
}

// runTransfers runs n transfers over accounts on two asynq servers, each through
// the middleware mw returns for its own mutex.Client (none when mw is nil), and
// returns the ledger once all ran and the balances they should have left.
func runTransfers(t *testing.T, n, accounts int, mw func(*mutex.Client) asynq.MiddlewareFunc) (*ledger, map[string]int) {
	e := newEnv(t)
	l := newLedger()
	for range 2 {
		var h asynq.Handler = asynq.HandlerFunc(l.transfer)
		if mw != nil {
			locks, _ := newLocks(t, e.opt)
			h = mw(locks)(h)
		}
		startServer(t, e.opt, asynqmutex.Configure(asynq.Config{Concurrency: 5}), h)
	}
	want := enqueueTransfers(t, e, n, accounts)
	waitFor(t, 60*time.Second, fmt.Sprintf("%d transfers", n), func() (bool, string) {
		l.mu.Lock()
		defer l.mu.Unlock()
		return l.completed >= n, fmt.Sprintf("%d done", l.completed)
	})
	return l, want
}

// TestTransfersLockBothAccounts runs transfers between random pairs of 10 accounts on
// two servers: with OnEach("from", "to") no two transfers touching one account ever
// run at once, so no update is lost, while transfers on distinct accounts run
// together. The control runs the same checker on On("from"), which locks one
// account of the two, and must see it trip.
func TestTransfersLockBothAccounts(t *testing.T) {
	t.Parallel()
	const n, accounts = 80, 10
	t.Run("OnEach", func(t *testing.T) {
		t.Parallel()
		l, want := runTransfers(t, n, accounts, func(locks *mutex.Client) asynq.MiddlewareFunc {
			return asynqmutex.Middleware(locks, asynqmutex.OnEach("from", "to"),
				asynqmutex.MaxWait(20*time.Second), asynqmutex.TTL(5*time.Second))
		})
		l.mu.Lock()
		defer l.mu.Unlock()
		if len(l.overlaps) > 0 {
			t.Errorf("%d overlaps, first: %s", len(l.overlaps), l.overlaps[0])
		}
		for a, b := range want {
			if l.balance[a] != b {
				t.Errorf("account %s: balance %d, want %d (an update was lost)", a, l.balance[a], b)
			}
		}
		if l.most < 2 {
			t.Errorf("at most %d transfers ran at once: transfers on distinct accounts should run together", l.most)
		}
		t.Logf("%d transfers, at most %d at once, 0 overlaps", n, l.most)
	})
	t.Run("control locking one account", func(t *testing.T) {
		t.Parallel()
		l, want := runTransfers(t, n, accounts, func(locks *mutex.Client) asynq.MiddlewareFunc {
			return asynqmutex.Middleware(locks, asynqmutex.On("from"),
				asynqmutex.MaxWait(20*time.Second), asynqmutex.TTL(5*time.Second))
		})
		l.mu.Lock()
		defer l.mu.Unlock()
		lost := 0
		for a, b := range want {
			if l.balance[a] != b {
				lost++
			}
		}
		if len(l.overlaps) == 0 || lost == 0 {
			t.Errorf("locking only the source account: %d overlaps, %d accounts with a lost update; want both > 0, or the checkers cannot see a broken lock", len(l.overlaps), lost)
		}
	})
}
