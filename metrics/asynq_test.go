package metrics_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex"
	"github.com/asynqmutex/asynqmutex/internal/redistest"
	"github.com/asynqmutex/asynqmutex/metrics"
	"github.com/asynqmutex/asynqmutex/mutex"
)

// TestMiddlewareMetrics runs tasks through the asynqmutex middleware on a real asynq
// server and redis-server, with lock clients observed by one Collector, and reads
// the figures from a real /metrics endpoint over HTTP: tasks that wait for their
// tenant (seen waiting on the gauge, then acquired), conflicts under each policy, a
// task without a key, a lease lost while its handler ran, and a plain lock user's
// acquisitions, contended, uncontended and failed.
func TestMiddlewareMetrics(t *testing.T) {
	t.Parallel()
	s := redistest.Start(t)
	opt := asynq.RedisClientOpt{Addr: s.Addr()}
	rdb := opt.MakeRedisClient().(redis.UniversalClient)
	t.Cleanup(func() { _ = rdb.Close() })

	m := metrics.New()
	reg := prometheus.NewRegistry()
	reg.MustRegister(m)
	web := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{ErrorHandling: promhttp.HTTPErrorOnError}))
	t.Cleanup(web.Close)

	locks := mutex.New(rdb, mutex.Observe(m.Observe))
	t.Cleanup(func() { _ = locks.Close() })
	other := mutex.New(rdb) // another worker's, not observed: it holds keys for the test
	t.Cleanup(func() { _ = other.Close() })
	ctx := context.Background()
	hold := func(taskType, tenant string) string {
		t.Helper()
		key, err := asynqmutex.Key(taskType, `"`+tenant+`"`)
		if err != nil {
			t.Fatal(err)
		}
		l, err := other.TryLock(ctx, key, time.Minute)
		if err != nil {
			t.Fatalf("TryLock(%s) = %v, want the lock", key, err)
		}
		t.Cleanup(func() { _ = l.Unlock(context.Background()) })
		return key
	}
	hold("report:skip", "z")
	hold("report:fail", "z")
	hold("report:archive", "z")

	quiet := asynqmutex.Logger(slog.New(slog.DiscardHandler)) // the lost lease is on purpose
	seen := asynqmutex.Observe(m.ObserveTask)
	release := make(chan struct{})
	var built atomic.Int32
	build := func(ctx context.Context, t *asynq.Task) error {
		select {
		case <-release:
		case <-ctx.Done():
			return ctx.Err()
		}
		built.Add(1)
		return nil
	}
	mux := asynq.NewServeMux()
	mux.Handle("report:build", asynqmutex.Middleware(locks, seen, asynqmutex.On("tenant"), asynqmutex.MaxWait(30*time.Second))(asynq.HandlerFunc(build)))
	noop := asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return nil })
	mux.Handle("report:skip", asynqmutex.Middleware(locks, seen, asynqmutex.On("tenant"), asynqmutex.OnConflict(asynqmutex.Skip))(noop))
	mux.Handle("report:fail", asynqmutex.Middleware(locks, seen, asynqmutex.On("tenant"), asynqmutex.OnConflict(asynqmutex.Fail))(noop))
	mux.Handle("report:archive", asynqmutex.Middleware(locks, seen, asynqmutex.On("tenant"))(noop))
	// A lease lost while the handler runs: another worker force-releases the key, the
	// next renewal (every 100 ms) finds it gone and cancels the handler.
	lostStarted := make(chan string, 1)
	mux.Handle("report:lost", asynqmutex.Middleware(locks, seen, asynqmutex.On("tenant"), asynqmutex.TTL(300*time.Millisecond), quiet)(
		asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
			lostStarted <- string(t.Payload())
			<-ctx.Done()
			return nil
		})))

	cli := asynq.NewClient(opt)
	t.Cleanup(func() { _ = cli.Close() })
	enqueue := func(typ, payload string, opts ...asynq.Option) {
		t.Helper()
		if _, err := cli.Enqueue(asynq.NewTask(typ, []byte(payload)), opts...); err != nil {
			t.Fatalf("Enqueue(%s): %v", typ, err)
		}
	}
	// Three tasks of tenant a, two of b, one of c: three of them wait for their tenant.
	for _, tenant := range []string{"a", "a", "a", "b", "b", "c"} {
		enqueue("report:build", `{"tenant":"`+tenant+`"}`)
	}
	enqueue("report:build", `{}`) // no tenant: archived as bad input
	enqueue("report:skip", `{"tenant":"z"}`)
	enqueue("report:fail", `{"tenant":"z"}`, asynq.MaxRetry(0))
	// No retry left under RetryLater: it waits until 500 ms before its deadline, then
	// is archived.
	enqueue("report:archive", `{"tenant":"z"}`, asynq.MaxRetry(0), asynq.Timeout(1500*time.Millisecond))
	enqueue("report:lost", `{"tenant":"l"}`)

	base, cancel := context.WithCancel(context.Background())
	srv := asynq.NewServer(opt, asynqmutex.Configure(asynq.Config{
		Concurrency:              12,
		TaskCheckInterval:        20 * time.Millisecond,
		DelayedTaskCheckInterval: 100 * time.Millisecond,
		ShutdownTimeout:          5 * time.Second,
		LogLevel:                 asynq.FatalLevel, // it logs every failure on purpose here
		BaseContext:              func() context.Context { return base },
	}))
	if err := srv.Start(mux); err != nil {
		cancel()
		t.Fatalf("asynq.Server.Start: %v", err)
	}
	t.Cleanup(func() { cancel(); srv.Shutdown() })

	// The plain lock user: no HeldBy, so task_type "".
	busy := hold("plain", "p")
	if l, err := locks.TryLock(ctx, busy, time.Minute); err == nil {
		_ = l.Unlock(ctx)
		t.Fatalf("TryLock of a held key succeeded")
	}
	l, err := locks.Lock(ctx, "plain-free", time.Minute)
	if err != nil {
		t.Fatalf("Lock of a free key: %v", err)
	}
	time.Sleep(20 * time.Millisecond) // so that the hold time is not 0
	if err := l.Unlock(ctx); err != nil {
		t.Fatalf("Unlock: %v", err)
	}
	dead, err := redistest.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	unreachable := redis.NewClient(&redis.Options{Addr: fmt.Sprintf("127.0.0.1:%d", dead), MaxRetries: -1})
	t.Cleanup(func() { _ = unreachable.Close() })
	offline := mutex.New(unreachable, mutex.Observe(m.Observe))
	t.Cleanup(func() { _ = offline.Close() })
	if _, err := offline.TryLock(ctx, "plain-offline", time.Minute); err == nil {
		t.Fatal("TryLock on a server that is not there succeeded")
	}

	// While the first task of tenants a and b holds its key, the others wait.
	waitScrape(t, web.URL, "three report:build tasks waiting", func(got map[string]float64) bool {
		return got[`asynqmutex_lock_waiters{task_type="report:build"}`] == 3
	})
	close(release)
	payload := <-lostStarted
	if _, err := other.ForceRelease(ctx, mustKey(t, "report:lost", "l")); err != nil {
		t.Fatalf("ForceRelease (task %s): %v", payload, err)
	}

	want := map[string]float64{
		`asynqmutex_lock_contended_total{task_type="report:build"}`:                             3,
		`asynqmutex_lock_wait_seconds_count{outcome="acquired",task_type="report:build"}`:       6,
		`asynqmutex_lock_hold_seconds_count{task_type="report:build"}`:                          6,
		`asynqmutex_task_bad_input_total{task_type="report:build"}`:                             1,
		`asynqmutex_lock_contended_total{task_type="report:skip"}`:                              1,
		`asynqmutex_lock_wait_seconds_count{outcome="not_obtained",task_type="report:skip"}`:    1,
		`asynqmutex_task_conflicts_total{policy="skip",task_type="report:skip"}`:                1,
		`asynqmutex_lock_contended_total{task_type="report:fail"}`:                              1,
		`asynqmutex_lock_wait_seconds_count{outcome="not_obtained",task_type="report:fail"}`:    1,
		`asynqmutex_task_conflicts_total{policy="fail",task_type="report:fail"}`:                1,
		`asynqmutex_lock_contended_total{task_type="report:archive"}`:                           1,
		`asynqmutex_lock_wait_seconds_count{outcome="not_obtained",task_type="report:archive"}`: 1,
		`asynqmutex_task_conflicts_total{policy="archive",task_type="report:archive"}`:          1,
		`asynqmutex_lock_wait_seconds_count{outcome="acquired",task_type="report:lost"}`:        1,
		`asynqmutex_lease_lost_total{task_type="report:lost"}`:                                  1,
		`asynqmutex_lock_contended_total{task_type=""}`:                                         1,
		`asynqmutex_lock_wait_seconds_count{outcome="not_obtained",task_type=""}`:               1,
		`asynqmutex_lock_wait_seconds_count{outcome="acquired",task_type=""}`:                   1,
		`asynqmutex_lock_hold_seconds_count{task_type=""}`:                                      1,
		`asynqmutex_lock_wait_seconds_count{outcome="error",task_type=""}`:                      1,
	}
	got := waitScrape(t, web.URL, "every task done", func(got map[string]float64) bool {
		for s, v := range want {
			if got[s] < v {
				return false
			}
		}
		return true
	})
	if d := diff(counts(ours(got)), want); d != "" {
		t.Errorf("/metrics differs:\n%s", d)
	}
	if n := built.Load(); n != 6 {
		t.Errorf("report:build handler ran %d times, want 6", n)
	}
	// The archived task waited for its key before the policy applied, and no longer
	// than its timeout.
	if s := got[`asynqmutex_lock_wait_seconds_sum{outcome="not_obtained",task_type="report:archive"}`]; s < 0.25 || s > 1.5 {
		t.Errorf("report:archive waited %vs, want a good part of its 1.5 s timeout", s)
	}
	// No series is labelled by anything unbounded.
	labelName := regexp.MustCompile(`([a-z_]+)="`)
	for s := range got {
		if !strings.HasPrefix(s, "asynqmutex_") {
			continue
		}
		for _, m := range labelName.FindAllStringSubmatch(s, -1) {
			switch m[1] {
			case "task_type", "outcome", "policy", "reason":
			default:
				t.Errorf("series %s has label %s; want only task_type, outcome, policy and reason", s, m[1])
			}
		}
	}
}

func mustKey(t testing.TB, taskType, tenant string) string {
	t.Helper()
	key, err := asynqmutex.Key(taskType, `"`+tenant+`"`)
	if err != nil {
		t.Fatal(err)
	}
	return key
}

// counts drops the _sum samples, whose values depend on timing.
func counts(samples map[string]float64) map[string]float64 {
	out := make(map[string]float64, len(samples))
	for s, v := range samples {
		if !strings.Contains(s, "_sum{") {
			out[s] = v
		}
	}
	return out
}

// waitScrape GETs url + "/metrics" every 20 ms until cond holds, and returns what it
// read then; it fails the test after 20 s.
func waitScrape(t testing.TB, url, what string, cond func(map[string]float64) bool) map[string]float64 {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		resp, err := http.Get(url + "/metrics")
		if err != nil {
			t.Fatalf("GET /metrics: %v", err)
		}
		got := parseText(t, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("GET /metrics: %s", resp.Status)
		}
		if cond(got) {
			return got
		}
		if time.Now().After(deadline) {
			t.Fatalf("waiting for %s: after 20s /metrics shows:\n%s", what, diff(counts(ours(got)), nil))
		}
		time.Sleep(20 * time.Millisecond)
	}
}
