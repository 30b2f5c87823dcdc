// Command operate shows what an operator sees of a task's lock, end to end on one
// machine: a task holds its invoice's lock and hangs; a second task for the same
// invoice waits. The asynqmutex command lists the lock with its holder (task type
// and ID, host, process) and its waiter; /metrics shows the waiter; a forced release
// hands the lock to the waiting task, and the stuck task's late write is rejected
// by the store because its fence is lower.
//
//	go run ./examples/operate   # embedded Redis unless REDIS_ADDR=host:port
//
// It exits non-zero if any of that does not hold.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex"
	"github.com/asynqmutex/asynqmutex/examples/internal/demo"
	"github.com/asynqmutex/asynqmutex/internal/cli"
	"github.com/asynqmutex/asynqmutex/metrics"
	"github.com/asynqmutex/asynqmutex/mutex"
)

const queue = "example-operate"

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := run(ctx, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "FAIL:", err)
		os.Exit(1)
	}
}

// store is the resource the lock protects: it keeps the highest fence it has seen
// and rejects writes carrying a lower one.
type store struct {
	mu      sync.Mutex
	highest int64
}

func (s *store) write(fence int64) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if fence < s.highest {
		return fmt.Errorf("fence %d is lower than %d, already written", fence, s.highest)
	}
	s.highest = fence
	return nil
}

func run(ctx context.Context, w io.Writer) error {
	out := &syncWriter{w: w} // the middleware logs to it from a worker goroutine
	redisOpt, stopRedis := demo.Redis(queue)
	defer stopRedis()
	rdb := redisOpt.MakeRedisClient().(redis.UniversalClient)
	defer rdb.Close()

	m := metrics.New()
	reg := prometheus.NewRegistry()
	reg.MustRegister(m)
	locks := mutex.New(rdb, mutex.Observe(m.Observe))
	defer locks.Close()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	web := &http.Server{Handler: promhttp.HandlerFor(reg, promhttp.HandlerOpts{}), ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = web.Serve(ln) }()
	defer web.Close()
	metricsURL := "http://" + ln.Addr().String() + "/metrics"

	var (
		db        store
		started   = make(chan int64, 1) // the stuck task's fence
		unstick   = make(chan struct{})
		stuckDone = make(chan error, 1) // the stuck task's late write
		nextDone  = make(chan int64, 1) // the waiting task's fence, once written
	)
	mux := asynq.NewServeMux()
	mux.Use(asynqmutex.Middleware(locks,
		asynqmutex.For("invoice:send"),
		asynqmutex.On("invoice_id"),
		asynqmutex.Observe(m.ObserveTask),
		asynqmutex.TTL(3*time.Second),      // renewed every second while the handler runs
		asynqmutex.MaxWait(30*time.Second), // a second task for the invoice waits
		asynqmutex.Logger(slog.New(slog.NewTextHandler(out, &slog.HandlerOptions{
			ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
				if a.Key == slog.TimeKey {
					return slog.Attr{}
				}
				return a
			},
		})))))
	mux.HandleFunc("invoice:send", func(ctx context.Context, t *asynq.Task) error {
		fence, _ := asynqmutex.Fence(ctx)
		if err := db.write(fence); err != nil {
			return err
		}
		var p struct{ Attempt int }
		_ = json.Unmarshal(t.Payload(), &p)
		if p.Attempt != 1 {
			nextDone <- fence
			return nil
		}
		// The first task hangs, as a handler stuck on a slow call does; it learns of
		// the forced release when its next renewal fails, and then writes late.
		started <- fence
		<-unstick
		select {
		case <-ctx.Done():
		case <-time.After(10 * time.Second):
		}
		stuckDone <- db.write(fence)
		return nil
	})
	worker := asynq.NewServer(redisOpt, asynqmutex.Configure(demo.Config(queue, 4)))
	if err := worker.Start(mux); err != nil {
		return fmt.Errorf("asynq server: %w", err)
	}
	stopped := false
	defer func() {
		if !stopped {
			worker.Shutdown()
		}
	}()
	client := asynq.NewClient(redisOpt)
	defer client.Close()

	enqueue := func(attempt int) (string, error) {
		info, err := client.Enqueue(asynq.NewTask("invoice:send",
			[]byte(fmt.Sprintf(`{"invoice_id":"inv-7","attempt":%d}`, attempt))), asynq.Queue(queue))
		if err != nil {
			return "", fmt.Errorf("enqueue: %w", err)
		}
		return info.ID, nil
	}
	first, err := enqueue(1)
	if err != nil {
		return err
	}
	var oldFence int64
	select {
	case oldFence = <-started:
	case <-time.After(10 * time.Second):
		return errors.New("the first task did not start within 10s")
	}
	second, err := enqueue(2)
	if err != nil {
		return err
	}
	key, _ := asynqmutex.Key("invoice:send", `"inv-7"`)
	if err := waitUntil(ctx, func() bool { in, err := locks.Inspect(ctx, key); return err == nil && in.Waiting == 1 }); err != nil {
		return errors.New("the second task did not queue for the lock")
	}

	addr := redisOpt.Addr
	listed, err := command(ctx, out, "--uri", addr, "list")
	if err != nil {
		return err
	}
	// list shows the task ID's first 8 characters; show gives it whole.
	if !strings.Contains(listed, "  "+first[:8]+"… on ") {
		return fmt.Errorf("list does not name task %s as the holder", first)
	}

	fmt.Fprintf(out, "\n$ curl -s %s | grep asynqmutex_lock_waiters\n", metricsURL)
	waiters, err := scrape(ctx, metricsURL, "asynqmutex_lock_waiters")
	if err != nil {
		return err
	}
	fmt.Fprint(out, waiters)
	if !strings.Contains(waiters, `asynqmutex_lock_waiters{task_type="invoice:send"} 1`) {
		return errors.New("/metrics does not show the waiting task")
	}

	released, err := command(ctx, out, "--uri", addr, "release", "--force", "--task", "invoice:send", "inv-7")
	if err != nil {
		return err
	}
	if !strings.Contains(released, "Handed to the next waiter, invoice:send "+second) {
		return fmt.Errorf("the forced release did not hand the lock to task %s", second)
	}
	var newFence int64
	select {
	case newFence = <-nextDone:
	case <-time.After(10 * time.Second):
		return errors.New("the waiting task did not run within 10s of the forced release")
	}
	fmt.Fprintf(out, "\ntask %s wrote with fence %d\n", second, newFence)
	close(unstick)
	var late error
	select {
	case late = <-stuckDone:
	case <-time.After(20 * time.Second):
		return errors.New("the stuck task did not finish")
	}
	if late == nil {
		return fmt.Errorf("the stuck task's late write with fence %d was accepted", oldFence)
	}
	fmt.Fprintf(out, "task %s's late write was rejected: %v\n", first, late)
	// Shutdown waits for the middleware to finish with the stuck task: it logs the
	// lost lease (above) and counts it.
	worker.Shutdown()
	stopped = true
	fmt.Fprintf(out, "\n$ curl -s %s | grep asynqmutex_lease_lost_total\n", metricsURL)
	lost, err := scrape(ctx, metricsURL, "asynqmutex_lease_lost_total")
	if err != nil {
		return err
	}
	fmt.Fprint(out, lost)
	if !strings.Contains(lost, `asynqmutex_lease_lost_total{task_type="invoice:send"} 1`) {
		return errors.New("/metrics does not count the stuck task's lost lease")
	}
	fmt.Fprintln(out, "\nok: the holder was listed, the waiter counted, the lock handed over, the late write fenced off")
	return nil
}

// command runs the asynqmutex command in process, printing it and its output.
func command(ctx context.Context, out io.Writer, args ...string) (string, error) {
	var stdout, stderr strings.Builder
	code := cli.Run(ctx, args, func(string) string { return "" }, &stdout, &stderr)
	fmt.Fprintf(out, "\n$ asynqmutex %s\n%s%s", strings.Join(args, " "), stdout.String(), stderr.String())
	if code != 0 {
		return "", fmt.Errorf("asynqmutex %s: exit status %d", strings.Join(args, " "), code)
	}
	return stdout.String(), nil
}

// scrape GETs url and returns its lines that start with prefix.
func scrape(ctx context.Context, url, prefix string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return "", err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	var b strings.Builder
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if strings.HasPrefix(sc.Text(), prefix) {
			b.WriteString(sc.Text() + "\n")
		}
	}
	return b.String(), sc.Err()
}

// waitUntil polls cond every 10ms for up to 10s.
func waitUntil(ctx context.Context, cond func() bool) error {
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); {
		if cond() {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
	return errors.New("timed out")
}

// syncWriter serialises writes to w.
type syncWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (s *syncWriter) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.w.Write(p)
}
