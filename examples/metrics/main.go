// Metrics: Prometheus metrics of the locks. Report tasks for a few tenants run one
// at a time per tenant on an asynq server whose lock client is observed by a
// metrics.Collector; tasks that find their tenant busy wait for it. The program
// serves /metrics on a loopback port while they run, prints its URL, scrapes it once
// the tasks are done, prints the asynqmutex_ lines (histogram buckets left out), and
// exits.
//
//	go run ./examples/metrics
//	go run ./examples/metrics -serve 1m   # then keep serving /metrics for a minute
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex"
	"github.com/asynqmutex/asynqmutex/examples/internal/demo"
	"github.com/asynqmutex/asynqmutex/metrics"
	"github.com/asynqmutex/asynqmutex/mutex"
)

const (
	queue   = "asynqmutex-metrics"
	workers = 6
	work    = 100 * time.Millisecond // how long one report takes
)

var tenants = []string{"acme", "globex", "initech"}

const perTenant = 3

func main() {
	serve := flag.Duration("serve", 0, "keep serving /metrics this long after the tasks ran (Ctrl-C ends it)")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, os.Stdout, *serve); err != nil {
		fmt.Fprintln(os.Stderr, "FAIL:", err)
		os.Exit(1)
	}
}

// run runs the tasks, serving /metrics meanwhile and for linger after, and prints
// what it scraped.
func run(ctx context.Context, out io.Writer, linger time.Duration) error {
	redisOpt, stopRedis := demo.Redis(queue)
	defer stopRedis()
	rdb := redisOpt.MakeRedisClient().(redis.UniversalClient)
	defer rdb.Close()

	// One Collector, registered once, observes the lock client.
	m := metrics.New()
	reg := prometheus.NewRegistry()
	reg.MustRegister(m)
	locks := mutex.New(rdb, mutex.Observe(m.Observe))
	defer locks.Close()

	ln, err := net.Listen("tcp", "127.0.0.1:0") // loopback only, a free port
	if err != nil {
		return err
	}
	web := http.NewServeMux()
	web.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	srv := &http.Server{Handler: web, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	defer srv.Close()
	url := "http://" + ln.Addr().String() + "/metrics"
	fmt.Fprintf(out, "serving %s\n", url)

	client := asynq.NewClient(redisOpt)
	defer client.Close()
	tasks := 0
	for i := range perTenant {
		for _, tenant := range tenants {
			p, _ := json.Marshal(map[string]any{"tenant": tenant, "n": i + 1})
			if _, err := client.Enqueue(asynq.NewTask("report:build", p), asynq.Queue(queue)); err != nil {
				return fmt.Errorf("enqueue: %w", err)
			}
			tasks++
		}
	}
	fmt.Fprintf(out, "%d report:build tasks over %d tenants, %d workers, each report takes %v\n",
		tasks, len(tenants), workers, work)

	done := make(chan struct{}, tasks)
	mux := asynq.NewServeMux()
	mux.Use(asynqmutex.Middleware(locks,
		asynqmutex.For("report:build"),
		asynqmutex.On("tenant"),            // one report at a time per tenant
		asynqmutex.MaxWait(5*time.Second),  // a busy tenant: wait for it
		asynqmutex.Observe(m.ObserveTask))) // conflicts and bad input, by task type
	mux.HandleFunc("report:build", func(ctx context.Context, t *asynq.Task) error {
		time.Sleep(work) // build the report
		done <- struct{}{}
		return nil
	})
	worker := asynq.NewServer(redisOpt, asynqmutex.Configure(demo.Config(queue, workers)))
	if err := worker.Start(mux); err != nil {
		return fmt.Errorf("asynq server: %w", err)
	}
	stopped := false
	defer func() {
		if !stopped {
			worker.Shutdown()
		}
	}()

	timeout := time.After(10 * time.Second)
	for range tasks {
		select {
		case <-done:
		case <-timeout:
			return errors.New("timed out waiting for the tasks")
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	// A handler returns before the middleware releases its lock: Shutdown waits for
	// the last releases, so that the scrape below counts them.
	worker.Shutdown()
	stopped = true

	samples, err := scrape(ctx, url)
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "\nGET %s (buckets left out):\n", url)
	for _, s := range samples {
		fmt.Fprintln(out, s.line)
	}
	if err := check(samples, tasks); err != nil {
		return err
	}
	fmt.Fprintln(out, "\nok: every task's lock is counted, the ones that waited among them")

	if linger > 0 {
		fmt.Fprintf(out, "serving %s for %v more\n", url, linger)
		select {
		case <-time.After(linger):
		case <-ctx.Done():
		}
	}
	return nil
}

// sample is one line of the text format: series, value.
type sample struct {
	line, series string
	value        float64
}

// scrape GETs url and returns its asynqmutex_ samples, buckets left out.
func scrape(ctx context.Context, url string) ([]sample, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("scraping: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("scraping: %s", resp.Status)
	}
	var samples []sample
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "asynqmutex_") || strings.Contains(line, "_bucket{") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if i < 0 || err != nil {
			return nil, fmt.Errorf("scraping: bad line %q", line)
		}
		samples = append(samples, sample{line: line, series: line[:i], value: v})
	}
	return samples, sc.Err()
}

// check: every task was acquired and released once, some after waiting, and nobody
// waits now.
func check(samples []sample, tasks int) error {
	get := func(series string) float64 {
		for _, s := range samples {
			if s.series == series {
				return s.value
			}
		}
		return 0
	}
	acquired := get(`asynqmutex_lock_wait_seconds_count{outcome="acquired",task_type="report:build"}`)
	held := get(`asynqmutex_lock_hold_seconds_count{task_type="report:build"}`)
	contended := get(`asynqmutex_lock_contended_total{task_type="report:build"}`)
	waiting := get(`asynqmutex_lock_waiters{task_type="report:build"}`)
	if acquired != float64(tasks) || held != float64(tasks) || contended < 1 || waiting != 0 {
		return fmt.Errorf("scraped %v acquired, %v released, %v contended, %v waiting; want %d, %d, at least 1, 0",
			acquired, held, contended, waiting, tasks, tasks)
	}
	return nil
}
