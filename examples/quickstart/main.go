// Quickstart: a burst of payment tasks over a few transactions, run by one asynq
// server with 8 workers. asynqmutex runs one task at a time per transaction_id
// while different transactions run in parallel; tasks that find their transaction
// busy wait for it (MaxWait) and start the moment it is released.
//
//	go run ./examples/quickstart
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex"
	"github.com/asynqmutex/asynqmutex/examples/internal/demo"
	"github.com/asynqmutex/asynqmutex/mutex"
)

const (
	queue   = "asynqmutex-quickstart"
	workers = 8
	work    = 150 * time.Millisecond // how long one capture takes
)

var transactions = []string{"tx-A", "tx-B", "tx-C"}

type payment struct {
	TransactionID string `json:"transaction_id"`
	N             int    `json:"n"` // the task's number, for the timeline
}

func main() { os.Exit(run()) }

func run() int {
	redisOpt, stop := demo.Redis(queue)
	defer stop()

	// The lock client and the asynq server may share a Redis, as here, or not.
	rdb := redisOpt.MakeRedisClient().(redis.UniversalClient)
	defer rdb.Close()
	locks := mutex.New(rdb)
	defer locks.Close() // before rdb.Close: drops the connection its waiters shared

	// Enqueue the burst first: 12 tasks, 4 per transaction, interleaved.
	client := asynq.NewClient(redisOpt)
	defer client.Close()
	const tasks = 12
	for n := 1; n <= tasks; n++ {
		p, _ := json.Marshal(payment{TransactionID: transactions[(n-1)%len(transactions)], N: n})
		if _, err := client.Enqueue(asynq.NewTask("payment:capture", p), asynq.Queue(queue)); err != nil {
			fmt.Fprintln(os.Stderr, "enqueue:", err)
			return 1
		}
	}
	fmt.Printf("%d payment:capture tasks over %d transactions, %d workers, each capture takes %v\n\n",
		tasks, len(transactions), workers, work)

	tl := newTimeline()
	done := make(chan struct{}, tasks)
	mux := asynq.NewServeMux()
	mux.Use(asynqmutex.Middleware(locks,
		asynqmutex.For("payment:capture"),  // other task types on the mux pass through
		asynqmutex.On("transaction_id"),    // one task at a time per transaction_id
		asynqmutex.MaxWait(5*time.Second))) // a busy transaction: wait for it, woken on release
	mux.HandleFunc("payment:capture", func(ctx context.Context, t *asynq.Task) error {
		var p payment
		if err := json.Unmarshal(t.Payload(), &p); err != nil {
			return err
		}
		tl.event(p.TransactionID, +1, fmt.Sprintf("start #%d", p.N))
		time.Sleep(work) // capture the payment
		tl.event(p.TransactionID, -1, fmt.Sprintf("end   #%d", p.N))
		done <- struct{}{}
		return nil
	})

	srv := asynq.NewServer(redisOpt, asynqmutex.Configure(demo.Config(queue, workers)))
	tl.header()
	if err := srv.Start(mux); err != nil {
		fmt.Fprintln(os.Stderr, "server:", err)
		return 1
	}
	defer srv.Shutdown()

	timeout := time.After(10 * time.Second)
	for range tasks {
		select {
		case <-done:
		case <-timeout:
			fmt.Println("timed out waiting for the tasks")
			return 1
		}
	}

	perTx, overall := tl.max()
	fmt.Printf("\nmax concurrent per transaction = %d, max concurrent overall = %d\n", perTx, overall)
	if perTx != 1 || overall < 2 {
		fmt.Println("FAIL: expected one task at a time per transaction, transactions in parallel")
		return 1
	}
	fmt.Println("ok: one task at a time per transaction, transactions in parallel")
	return 0
}

// timeline prints events in one column per transaction and counts how many tasks
// run at once.
type timeline struct {
	mu               sync.Mutex
	start            time.Time
	running          map[string]int // per transaction
	total            int
	maxPerTx, maxAll int
}

const columnWidth = 12

func newTimeline() *timeline { return &timeline{running: make(map[string]int)} }

func (tl *timeline) header() {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	tl.start = time.Now()
	line := fmt.Sprintf("%6s  ", "ms")
	for _, tx := range transactions {
		line += fmt.Sprintf("%-*s", columnWidth, tx)
	}
	fmt.Println(strings.TrimRight(line, " "))
}

// event records that a task of tx started (+1) or ended (-1) and prints what.
func (tl *timeline) event(tx string, delta int, what string) {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	tl.running[tx] += delta
	tl.total += delta
	tl.maxPerTx = max(tl.maxPerTx, tl.running[tx])
	tl.maxAll = max(tl.maxAll, tl.total)
	pad := strings.Repeat(" ", slices.Index(transactions, tx)*columnWidth)
	fmt.Printf("%6d  %s%s\n", time.Since(tl.start).Milliseconds(), pad, what)
}

func (tl *timeline) max() (perTx, all int) {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	return tl.maxPerTx, tl.maxAll
}
