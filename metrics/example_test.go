package metrics_test

import (
	"bufio"
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex/metrics"
	"github.com/asynqmutex/asynqmutex/mutex"
)

// A Collector registered with a Prometheus registry hears a lock Client's events:
// here one lock taken, one attempt that found it busy, and the release.
func Example() {
	mr, err := miniredis.Run()
	if err != nil {
		panic(err)
	}
	defer mr.Close()
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()

	m := metrics.New()
	reg := prometheus.NewRegistry()
	reg.MustRegister(m)
	locks := mutex.New(rdb, mutex.Observe(m.Observe))
	defer locks.Close()

	ctx := context.Background()
	l, err := locks.Lock(ctx, "tenant:42", time.Minute, mutex.HeldBy("report:build", "task-1"))
	if err != nil {
		panic(err)
	}
	if _, err := locks.TryLock(ctx, "tenant:42", time.Minute, mutex.HeldBy("report:build", "task-2")); err == nil {
		panic("the key was free")
	}
	if err := l.Unlock(ctx); err != nil {
		panic(err)
	}

	// What Prometheus would scrape from promhttp.HandlerFor(reg, ...) on /metrics.
	rec := httptest.NewRecorder()
	promhttp.HandlerFor(reg, promhttp.HandlerOpts{}).ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	sc := bufio.NewScanner(rec.Body)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "asynqmutex_") && (strings.Contains(line, "_total") || strings.Contains(line, "_count") || strings.Contains(line, "waiters")) {
			fmt.Println(line)
		}
	}
	// Output:
	// asynqmutex_lock_contended_total{task_type="report:build"} 1
	// asynqmutex_lock_hold_seconds_count{task_type="report:build"} 1
	// asynqmutex_lock_wait_seconds_count{outcome="acquired",task_type="report:build"} 1
	// asynqmutex_lock_wait_seconds_count{outcome="not_obtained",task_type="report:build"} 1
	// asynqmutex_lock_waiters{task_type="report:build"} 0
	// asynqmutex_wakeup_lost_total 0
	// asynqmutex_wakeup_recovered_total 0
}
