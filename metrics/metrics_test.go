package metrics_test

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/goleak"

	"github.com/asynqmutex/asynqmutex"
	"github.com/asynqmutex/asynqmutex/internal/redistest"
	"github.com/asynqmutex/asynqmutex/metrics"
	"github.com/asynqmutex/asynqmutex/mutex"
)

func TestMain(m *testing.M) {
	redistest.QuietRedisLogs()
	code := m.Run()
	if err := goleak.Find(); err != nil && code == 0 {
		fmt.Fprintf(os.Stderr, "goleak: %v\n", err)
		code = 1
	}
	os.Exit(code)
}

// scrape is what a registry holding c serves on /metrics, as parseText reads it.
func scrape(t testing.TB, c prometheus.Collector) map[string]float64 {
	t.Helper()
	reg := prometheus.NewPedanticRegistry() // also checks Describe against Collect
	reg.MustRegister(c)
	rec := httptest.NewRecorder()
	promhttp.HandlerFor(reg, promhttp.HandlerOpts{ErrorHandling: promhttp.HTTPErrorOnError}).
		ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	if rec.Code != http.StatusOK {
		t.Fatalf("GET /metrics = %d: %s", rec.Code, rec.Body)
	}
	return parseText(t, rec.Body)
}

// parseText reads the Prometheus text format: each sample by its series as printed
// (name{label="value",...}, labels in client_golang's sorted order), comments and
// _bucket lines left out.
func parseText(t testing.TB, r io.Reader) map[string]float64 {
	t.Helper()
	samples := make(map[string]float64)
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if i < 0 {
			t.Fatalf("metrics line %q: no value", line)
		}
		series, value := line[:i], line[i+1:]
		v, err := strconv.ParseFloat(value, 64)
		if err != nil {
			t.Fatalf("metrics line %q: %v", line, err)
		}
		if strings.Contains(series, "_bucket{") {
			continue
		}
		samples[series] = v
	}
	if err := sc.Err(); err != nil {
		t.Fatalf("reading metrics: %v", err)
	}
	return samples
}

// ours is the samples of the asynqmutex_ series that are not zero: a series a test
// does not expect must not count anything.
func ours(samples map[string]float64) map[string]float64 {
	out := make(map[string]float64)
	for s, v := range samples {
		if strings.HasPrefix(s, "asynqmutex_") && v != 0 {
			out[s] = v
		}
	}
	return out
}

func diff(got, want map[string]float64) string {
	var lines []string
	for s, w := range want {
		if g, ok := got[s]; !ok || !near(g, w) {
			lines = append(lines, fmt.Sprintf("  %s = %v (present %v), want %v", s, g, ok, w))
		}
	}
	for s, g := range got {
		if _, ok := want[s]; !ok {
			lines = append(lines, fmt.Sprintf("  %s = %v, want none", s, g))
		}
	}
	slices.Sort(lines)
	return strings.Join(lines, "\n")
}

func near(a, b float64) bool { return a-b < 1e-9 && b-a < 1e-9 }

// TestObserve feeds each operation to a new Collector as synthetic events and checks
// every series that is not zero on its /metrics page.
func TestObserve(t *testing.T) {
	t.Parallel()
	busy := mutex.ErrNotObtained
	for _, tc := range []struct {
		name   string
		events []any // mutex.Event or asynqmutex.Event
		want   map[string]float64
	}{
		{"acquired at once", []any{
			mutex.Event{Op: mutex.OpAcquired, Key: "k", Name: "pay", ID: "1", Fence: 7, Wait: 2 * time.Millisecond},
		}, map[string]float64{
			`asynqmutex_lock_wait_seconds_count{outcome="acquired",task_type="pay"}`: 1,
			`asynqmutex_lock_wait_seconds_sum{outcome="acquired",task_type="pay"}`:   0.002,
		}},
		{"contended, then acquired", []any{
			mutex.Event{Op: mutex.OpContended, Key: "k", Name: "pay", ID: "1"},
			mutex.Event{Op: mutex.OpAcquired, Key: "k", Name: "pay", ID: "1", Contended: true, Wait: 1500 * time.Millisecond},
		}, map[string]float64{
			`asynqmutex_lock_contended_total{task_type="pay"}`:                       1,
			`asynqmutex_lock_wait_seconds_count{outcome="acquired",task_type="pay"}`: 1,
			`asynqmutex_lock_wait_seconds_sum{outcome="acquired",task_type="pay"}`:   1.5,
		}},
		{"contended and waiting", []any{
			mutex.Event{Op: mutex.OpContended, Key: "k", Name: "pay", ID: "1"},
		}, map[string]float64{
			`asynqmutex_lock_contended_total{task_type="pay"}`: 1,
			`asynqmutex_lock_waiters{task_type="pay"}`:         1,
		}},
		{"busy until the wait ended", []any{
			mutex.Event{Op: mutex.OpContended, Key: "k", Name: "pay", ID: "1"},
			mutex.Event{Op: mutex.OpNotObtained, Key: "k", Name: "pay", ID: "1", Contended: true, Wait: time.Second, Err: busy},
		}, map[string]float64{
			`asynqmutex_lock_contended_total{task_type="pay"}`:                           1,
			`asynqmutex_lock_wait_seconds_count{outcome="not_obtained",task_type="pay"}`: 1,
			`asynqmutex_lock_wait_seconds_sum{outcome="not_obtained",task_type="pay"}`:   1,
		}},
		{"context ended the wait", []any{
			mutex.Event{Op: mutex.OpNotObtained, Key: "k", Name: "pay", Err: errors.Join(busy, context.Canceled)},
		}, map[string]float64{
			`asynqmutex_lock_wait_seconds_count{outcome="not_obtained",task_type="pay"}`: 1,
		}},
		{"Redis error", []any{
			mutex.Event{Op: mutex.OpNotObtained, Key: "k", Name: "pay", Wait: 3 * time.Millisecond, Err: errors.New("mutex: lock \"k\": dial tcp: connection refused")},
		}, map[string]float64{
			`asynqmutex_lock_wait_seconds_count{outcome="error",task_type="pay"}`: 1,
			`asynqmutex_lock_wait_seconds_sum{outcome="error",task_type="pay"}`:   0.003,
		}},
		{"released", []any{
			mutex.Event{Op: mutex.OpReleased, Key: "k", Name: "pay", ID: "1", Held: 250 * time.Millisecond},
		}, map[string]float64{
			`asynqmutex_lock_hold_seconds_count{task_type="pay"}`: 1,
			`asynqmutex_lock_hold_seconds_sum{task_type="pay"}`:   0.25,
		}},
		{"lease lost", []any{
			mutex.Event{Op: mutex.OpLeaseLost, Key: "k", Name: "pay", ID: "1", Held: time.Minute, Err: mutex.ErrNotHeld},
		}, map[string]float64{
			`asynqmutex_lease_lost_total{task_type="pay"}`: 1,
		}},
		{"renewal failed", []any{
			mutex.Event{Op: mutex.OpRenewFailed, Key: "k", Name: "pay", Err: errors.New("i/o timeout")},
			mutex.Event{Op: mutex.OpRenewFailed, Key: "k", Name: "pay", Err: errors.New("i/o timeout")},
		}, map[string]float64{
			`asynqmutex_lease_renew_failures_total{task_type="pay"}`: 2,
		}},
		{"release failed", []any{
			mutex.Event{Op: mutex.OpReleaseFailed, Key: "k", Name: "pay", Err: errors.New("i/o timeout")},
		}, map[string]float64{
			`asynqmutex_lock_release_failures_total{task_type="pay"}`: 1,
		}},
		{"conflicts by policy", []any{
			asynqmutex.Event{Op: asynqmutex.OpConflict, Key: "k", TaskType: "pay", Policy: "skip"},
			asynqmutex.Event{Op: asynqmutex.OpConflict, Key: "k", TaskType: "pay", Policy: "fail"},
			asynqmutex.Event{Op: asynqmutex.OpConflict, Key: "k", TaskType: "pay", Policy: "retry"},
			asynqmutex.Event{Op: asynqmutex.OpConflict, Key: "k", TaskType: "pay", Policy: "retry"},
			asynqmutex.Event{Op: asynqmutex.OpConflict, Key: "k", TaskType: "pay", Policy: "archive"},
			asynqmutex.Event{Op: asynqmutex.OpConflict, Key: "k", TaskType: "pay", Policy: "a policy of tomorrow"},
		}, map[string]float64{
			`asynqmutex_task_conflicts_total{policy="skip",task_type="pay"}`:    1,
			`asynqmutex_task_conflicts_total{policy="fail",task_type="pay"}`:    1,
			`asynqmutex_task_conflicts_total{policy="retry",task_type="pay"}`:   2,
			`asynqmutex_task_conflicts_total{policy="archive",task_type="pay"}`: 1,
			`asynqmutex_task_conflicts_total{policy="other",task_type="pay"}`:   1,
		}},
		{"bad input", []any{
			asynqmutex.Event{Op: asynqmutex.OpBadInput, TaskType: "pay", TaskID: "1", Err: errors.New("no field tenant")},
		}, map[string]float64{
			`asynqmutex_task_bad_input_total{task_type="pay"}`: 1,
		}},
		{"rate limits", []any{
			asynqmutex.Event{Op: asynqmutex.OpLimited, Key: "k", TaskType: "pay", Policy: "retry"},
			asynqmutex.Event{Op: asynqmutex.OpLimited, Key: "k", TaskType: "pay", Policy: "skip"},
			asynqmutex.Event{Op: asynqmutex.OpRateWaited, Key: "k", TaskType: "pay", Wait: 250 * time.Millisecond},
			asynqmutex.Event{Op: asynqmutex.OpPaused, Key: "k", TaskType: "pay", Wait: 30 * time.Second},
		}, map[string]float64{
			`asynqmutex_task_rate_limited_total{policy="retry",task_type="pay"}`: 1,
			`asynqmutex_task_rate_limited_total{policy="skip",task_type="pay"}`:  1,
			`asynqmutex_task_rate_wait_seconds_count{task_type="pay"}`:           1,
			`asynqmutex_task_rate_wait_seconds_sum{task_type="pay"}`:             0.25,
			`asynqmutex_key_pauses_total{task_type="pay"}`:                       1,
		}},
		{"order", []any{
			asynqmutex.Event{Op: asynqmutex.OpOutOfTurn, Key: "k", TaskType: "pay", Policy: "retry"},
			asynqmutex.Event{Op: asynqmutex.OpOrderSkipped, Key: "k", TaskType: "pay", Err: &asynqmutex.GapError{Key: "k", Place: 3, Reason: "missing"}},
			asynqmutex.Event{Op: asynqmutex.OpOrderSkipped, Key: "k", TaskType: "pay", Err: errors.New("not a gap")},
			asynqmutex.Event{Op: asynqmutex.OpOutOfOrder, Key: "k", TaskType: "pay"},
			asynqmutex.Event{Op: asynqmutex.OpOrderStalled, Key: "k", TaskType: "pay", Err: &asynqmutex.StallError{Key: "k", Place: 1, Readers: 0}},
			asynqmutex.Event{Op: asynqmutex.OpOrderStalled, Key: "k", TaskType: "pay", Err: &asynqmutex.StallError{Key: "k", Place: 1, Readers: 2}},
			asynqmutex.Event{Op: asynqmutex.OpOrderStalled, Key: "k", TaskType: "pay", Err: &asynqmutex.StallError{Key: "k", Place: 1, Readers: -1}},
			asynqmutex.Event{Op: asynqmutex.OpOrderHalted, Key: "k", TaskType: "pay", Err: &asynqmutex.HaltError{Key: "k", Place: 2, Err: errors.New("boom")}},
		}, map[string]float64{
			`asynqmutex_order_halts_total{task_type="pay"}`:                             1,
			`asynqmutex_task_out_of_turn_total{policy="retry",task_type="pay"}`:         1,
			`asynqmutex_order_places_skipped_total{reason="missing",task_type="pay"}`:   1,
			`asynqmutex_order_places_skipped_total{reason="other",task_type="pay"}`:     1,
			`asynqmutex_task_out_of_order_total{task_type="pay"}`:                       1,
			`asynqmutex_task_order_stalled_total{queue_read="no",task_type="pay"}`:      1,
			`asynqmutex_task_order_stalled_total{queue_read="yes",task_type="pay"}`:     1,
			`asynqmutex_task_order_stalled_total{queue_read="unknown",task_type="pay"}`: 1,
		}},
		{"parked tasks", []any{
			asynqmutex.Event{Op: asynqmutex.OpConflict, Key: "k", TaskType: "pay", Policy: "park"},
			asynqmutex.Event{Op: asynqmutex.OpParkStarted, Key: "k", TaskType: "pay", TaskID: "1"},
			asynqmutex.Event{Op: asynqmutex.OpParkPassedOver, Key: "k", TaskID: "2", Err: errors.New("asynq: task not found")},
		}, map[string]float64{
			`asynqmutex_task_conflicts_total{policy="park",task_type="pay"}`: 1,
			`asynqmutex_task_park_started_total{task_type="pay"}`:            1,
			`asynqmutex_task_park_passed_over_total{task_type=""}`:           1,
		}},
		{"a backlog cap", []any{
			asynqmutex.Event{Op: asynqmutex.OpConflict, Key: "k", TaskType: "pay", Policy: "backlog_skip"},
			asynqmutex.Event{Op: asynqmutex.OpConflict, Key: "k", TaskType: "pay", Policy: "backlog_fail"},
			asynqmutex.Event{Op: asynqmutex.OpSuperseded, Key: "k", TaskType: "pay", TaskID: "3"},
		}, map[string]float64{
			`asynqmutex_task_conflicts_total{policy="backlog_skip",task_type="pay"}`: 1,
			`asynqmutex_task_conflicts_total{policy="backlog_fail",task_type="pay"}`: 1,
			`asynqmutex_task_superseded_total{task_type="pay"}`:                      1,
		}},
		{"wake-ups lost and recovered", []any{
			mutex.Event{Op: mutex.OpWakeupLost, Err: errors.New("EOF")},
			mutex.Event{Op: mutex.OpWakeupRecovered},
			mutex.Event{Op: mutex.OpWakeupLost, Err: errors.New("EOF")},
		}, map[string]float64{
			`asynqmutex_wakeup_lost_total`:      2,
			`asynqmutex_wakeup_recovered_total`: 1,
		}},
		{"a lock without HeldBy", []any{
			mutex.Event{Op: mutex.OpContended, Key: "k"},
			mutex.Event{Op: mutex.OpAcquired, Key: "k", Contended: true, Wait: time.Second},
			mutex.Event{Op: mutex.OpReleased, Key: "k", Held: time.Second},
		}, map[string]float64{
			`asynqmutex_lock_contended_total{task_type=""}`:                       1,
			`asynqmutex_lock_wait_seconds_count{outcome="acquired",task_type=""}`: 1,
			`asynqmutex_lock_wait_seconds_sum{outcome="acquired",task_type=""}`:   1,
			`asynqmutex_lock_hold_seconds_count{task_type=""}`:                    1,
			`asynqmutex_lock_hold_seconds_sum{task_type=""}`:                      1,
		}},
		{"an operation it does not know", []any{
			mutex.Event{Op: mutex.Op(200), Key: "k", Name: "pay", Wait: time.Second, Held: time.Second},
			mutex.Event{Op: 0, Key: "k", Name: "pay"},
		}, map[string]float64{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := metrics.New()
			for _, e := range tc.events {
				switch e := e.(type) {
				case mutex.Event:
					c.Observe(context.Background(), e)
				case asynqmutex.Event:
					c.ObserveTask(context.Background(), e)
				default:
					t.Fatalf("event of type %T", e)
				}
			}
			if d := diff(ours(scrape(t, c)), tc.want); d != "" {
				t.Errorf("after %d events, /metrics differs:\n%s", len(tc.events), d)
			}
		})
	}
}

// TestSeriesAtZero checks that the series an event creates start where they should:
// a contended acquisition that ended leaves its waiters gauge at 0, not absent, and
// the wake-up counters exist before any wake-up event.
func TestSeriesAtZero(t *testing.T) {
	t.Parallel()
	c := metrics.New()
	got := scrape(t, c)
	for _, s := range []string{"asynqmutex_wakeup_lost_total", "asynqmutex_wakeup_recovered_total"} {
		if v, ok := got[s]; !ok || v != 0 {
			t.Errorf("new Collector: %s = %v (present %v), want 0", s, v, ok)
		}
	}
	c.Observe(context.Background(), mutex.Event{Op: mutex.OpContended, Key: "k", Name: "pay"})
	c.Observe(context.Background(), mutex.Event{Op: mutex.OpAcquired, Key: "k", Name: "pay", Contended: true})
	got = scrape(t, c)
	if v, ok := got[`asynqmutex_lock_waiters{task_type="pay"}`]; !ok || v != 0 {
		t.Errorf("after a contended acquisition: waiters = %v (present %v), want 0", v, ok)
	}
}

// TestHistogramBuckets checks that wait and hold times land in the buckets of their
// size, from a millisecond to ten minutes.
func TestHistogramBuckets(t *testing.T) {
	t.Parallel()
	c := metrics.New()
	for _, d := range []time.Duration{500 * time.Microsecond, 20 * time.Millisecond, 45 * time.Second, time.Hour} {
		c.Observe(context.Background(), mutex.Event{Op: mutex.OpReleased, Name: "pay", Held: d})
	}
	want := `
# HELP asynqmutex_lock_hold_seconds Time a lock was held until its holder released it; broken down by task type.
# TYPE asynqmutex_lock_hold_seconds histogram
asynqmutex_lock_hold_seconds_bucket{task_type="pay",le="0.001"} 1
asynqmutex_lock_hold_seconds_bucket{task_type="pay",le="0.0025"} 1
asynqmutex_lock_hold_seconds_bucket{task_type="pay",le="0.005"} 1
asynqmutex_lock_hold_seconds_bucket{task_type="pay",le="0.01"} 1
asynqmutex_lock_hold_seconds_bucket{task_type="pay",le="0.025"} 2
asynqmutex_lock_hold_seconds_bucket{task_type="pay",le="0.05"} 2
asynqmutex_lock_hold_seconds_bucket{task_type="pay",le="0.1"} 2
asynqmutex_lock_hold_seconds_bucket{task_type="pay",le="0.25"} 2
asynqmutex_lock_hold_seconds_bucket{task_type="pay",le="0.5"} 2
asynqmutex_lock_hold_seconds_bucket{task_type="pay",le="1"} 2
asynqmutex_lock_hold_seconds_bucket{task_type="pay",le="2.5"} 2
asynqmutex_lock_hold_seconds_bucket{task_type="pay",le="5"} 2
asynqmutex_lock_hold_seconds_bucket{task_type="pay",le="10"} 2
asynqmutex_lock_hold_seconds_bucket{task_type="pay",le="30"} 2
asynqmutex_lock_hold_seconds_bucket{task_type="pay",le="60"} 3
asynqmutex_lock_hold_seconds_bucket{task_type="pay",le="120"} 3
asynqmutex_lock_hold_seconds_bucket{task_type="pay",le="300"} 3
asynqmutex_lock_hold_seconds_bucket{task_type="pay",le="600"} 3
asynqmutex_lock_hold_seconds_bucket{task_type="pay",le="+Inf"} 4
asynqmutex_lock_hold_seconds_sum{task_type="pay"} 3645.0205
asynqmutex_lock_hold_seconds_count{task_type="pay"} 4
`
	if err := testutil.CollectAndCompare(c, strings.NewReader(want), "asynqmutex_lock_hold_seconds"); err != nil {
		t.Error(err)
	}
}

// TestMaxTaskTypes checks that task types past the bound share the label "other",
// that one already admitted keeps its own, and that "" does not count.
func TestMaxTaskTypes(t *testing.T) {
	t.Parallel()
	c := metrics.New(metrics.MaxTaskTypes(2))
	for _, name := range []string{"a", "", "b", "c", "a", "d", ""} {
		c.Observe(context.Background(), mutex.Event{Op: mutex.OpLeaseLost, Name: name})
	}
	want := map[string]float64{
		`asynqmutex_lease_lost_total{task_type="a"}`:     2,
		`asynqmutex_lease_lost_total{task_type="b"}`:     1,
		`asynqmutex_lease_lost_total{task_type="other"}`: 2, // c and d
		`asynqmutex_lease_lost_total{task_type=""}`:      2,
	}
	if d := diff(ours(scrape(t, c)), want); d != "" {
		t.Errorf("MaxTaskTypes(2): /metrics differs:\n%s", d)
	}
}

// TestDefaultMaxTaskTypes checks the default bound: task type 1001 is "other".
func TestDefaultMaxTaskTypes(t *testing.T) {
	t.Parallel()
	c := metrics.New()
	for i := range metrics.DefaultMaxTaskTypes + 5 {
		c.ObserveTask(context.Background(), asynqmutex.Event{Op: asynqmutex.OpBadInput, TaskType: "type-" + strconv.Itoa(i)})
	}
	got := scrape(t, c)
	n := 0
	for s := range ours(got) {
		if strings.HasPrefix(s, "asynqmutex_task_bad_input_total{") {
			n++
		}
	}
	if n != metrics.DefaultMaxTaskTypes+1 {
		t.Errorf("task_bad_input_total has %d series, want %d task types and other", n, metrics.DefaultMaxTaskTypes+1)
	}
	if v := got[`asynqmutex_task_bad_input_total{task_type="other"}`]; v != 5 {
		t.Errorf(`task_bad_input_total{task_type="other"} = %v, want 5`, v)
	}
	if v := got[`asynqmutex_task_bad_input_total{task_type="type-999"}`]; v != 1 {
		t.Errorf(`task_bad_input_total{task_type="type-999"} = %v, want 1`, v)
	}
}

func TestMaxTaskTypesPanics(t *testing.T) {
	t.Parallel()
	defer func() {
		if r := recover(); r == nil || !strings.Contains(fmt.Sprint(r), "metrics.MaxTaskTypes") {
			t.Errorf("MaxTaskTypes(0) panicked with %v, want a panic naming metrics.MaxTaskTypes", r)
		}
	}()
	metrics.MaxTaskTypes(0)
}

// TestTaskTypeLabel checks that a task type is labelled as mutex.HeldBy stores it,
// whether the event came from the lock (which stores it so) or from the middleware
// (which passes it raw), and that any task type makes a valid label: Prometheus
// refuses label values that are not UTF-8.
func TestTaskTypeLabel(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("report:", 30) // 210 bytes
	c := metrics.New()
	for _, name := range []string{long, stored(long), "bad\xffutf8", "tab\tand\nnewline"} {
		c.ObserveTask(context.Background(), asynqmutex.Event{Op: asynqmutex.OpBadInput, TaskType: name})
	}
	// 100 bytes that are not UTF-8 become 300 bytes of U+FFFD: still at most 100 as a
	// label, as the lock stores it.
	invalid := strings.Repeat("\xff", 100)
	c.ObserveTask(context.Background(), asynqmutex.Event{Op: asynqmutex.OpBadInput, TaskType: invalid})
	got := ours(scrape(t, c))
	for line := range got {
		if v, ok := strings.CutPrefix(line, `asynqmutex_task_bad_input_total{task_type="`); ok && strings.HasPrefix(v, "\uFFFD") {
			if n := len(strings.TrimSuffix(v, `"}`)); n > 100 {
				t.Errorf("a task type of invalid bytes made a label of %d bytes, want at most 100", n)
			}
			delete(got, line)
		}
	}
	want := map[string]float64{
		`asynqmutex_task_bad_input_total{task_type="` + stored(long) + `"}`:    2, // raw and as stored: one label
		`asynqmutex_task_bad_input_total{task_type="bad` + "\uFFFD" + `utf8"}`: 1,
		`asynqmutex_task_bad_input_total{task_type="tab and newline"}`:         1,
	}
	if d := diff(got, want); d != "" {
		t.Errorf("/metrics differs:\n%s", d)
	}
}

// stored is name as mutex.HeldBy documents storing it: whole up to 100 bytes, or its
// first 64 bytes, "…sha256:" and the first 12 hex digits of its SHA-256.
func stored(name string) string {
	if len(name) <= 100 {
		return name
	}
	sum := sha256.Sum256([]byte(name))
	return name[:64] + "…sha256:" + hex.EncodeToString(sum[:6])
}

// TestWaiters checks the waiters gauge through overlapping acquisitions: an
// acquisition counts from its OpContended to the end event marked Contended, whatever
// its key, name and ID, and uncontended ones never count.
func TestWaiters(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	contended := func(key, id string) mutex.Event {
		return mutex.Event{Op: mutex.OpContended, Key: key, Name: "pay", ID: id}
	}
	acquired := func(key, id string, waited bool) mutex.Event {
		return mutex.Event{Op: mutex.OpAcquired, Key: key, Name: "pay", ID: id, Contended: waited}
	}
	notObtained := func(key, id string, waited bool) mutex.Event {
		return mutex.Event{Op: mutex.OpNotObtained, Key: key, Name: "pay", ID: id, Contended: waited, Err: mutex.ErrNotObtained}
	}
	type step struct {
		e    mutex.Event
		want float64
	}
	for _, tc := range []struct {
		name  string
		steps []step
	}{
		{"two keys", []step{
			{contended("a", "1"), 1}, {contended("b", "2"), 2}, {acquired("a", "1", true), 1}, {notObtained("b", "2", true), 0},
		}},
		{"uncontended acquisitions do not count", []step{
			{acquired("a", "1", false), 0}, {notObtained("a", "2", false), 0}, {contended("a", "3"), 1}, {acquired("a", "4", false), 1}, {acquired("a", "3", true), 0},
		}},
		{"same key, name and ID, both contended", []step{
			{contended("a", "1"), 1}, {contended("a", "1"), 2}, {acquired("a", "1", true), 1}, {acquired("a", "1", true), 0},
		}},
		{"same key, name and ID, one uncontended", []step{
			{contended("a", "1"), 1}, {acquired("a", "1", false), 1}, {notObtained("a", "1", true), 0},
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := metrics.New()
			for i, s := range tc.steps {
				c.Observe(ctx, s.e)
				if got := scrape(t, c)[`asynqmutex_lock_waiters{task_type="pay"}`]; got != s.want {
					t.Fatalf("step %d (%v key %s id %s): waiters = %v, want %v", i, s.e.Op, s.e.Key, s.e.ID, got, s.want)
				}
			}
		})
	}
}

// TestConcurrentObserve has goroutines contend and end acquisitions, and register new
// task types, while others scrape; under -race it checks the Collector's locking, and
// at the end that the gauge is back to zero.
func TestConcurrentObserve(t *testing.T) {
	t.Parallel()
	c := metrics.New(metrics.MaxTaskTypes(5))
	reg := prometheus.NewRegistry()
	reg.MustRegister(c)
	const workers, rounds = 8, 500
	var wg sync.WaitGroup
	stop := make(chan struct{})
	scraped := make(chan error, 1)
	go func() {
		var err error
		for {
			select {
			case <-stop:
				scraped <- err
				return
			default:
			}
			if _, e := reg.Gather(); e != nil && err == nil {
				err = e
			}
		}
	}()
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range rounds {
				name := "type-" + strconv.Itoa((w+i)%9)
				key := "key-" + strconv.Itoa(i%3)
				id := strconv.Itoa(w)
				c.Observe(context.Background(), mutex.Event{Op: mutex.OpContended, Key: key, Name: name, ID: id})
				if i%2 == 0 {
					c.Observe(context.Background(), mutex.Event{Op: mutex.OpAcquired, Key: key, Name: name, ID: id, Contended: true})
					c.Observe(context.Background(), mutex.Event{Op: mutex.OpReleased, Key: key, Name: name, ID: id})
				} else {
					c.Observe(context.Background(), mutex.Event{Op: mutex.OpNotObtained, Key: key, Name: name, ID: id, Contended: true, Err: mutex.ErrNotObtained})
				}
			}
		}()
	}
	wg.Wait()
	close(stop)
	if err := <-scraped; err != nil {
		t.Fatalf("Gather while observing: %v", err)
	}
	got := scrape(t, c)
	var waiting, contended, types float64
	for s, v := range got {
		switch {
		case strings.HasPrefix(s, "asynqmutex_lock_waiters{"):
			waiting += v
			types++
		case strings.HasPrefix(s, "asynqmutex_lock_contended_total{"):
			contended += v
		}
	}
	if waiting != 0 || contended != workers*rounds || types != 6 {
		t.Errorf("after %d contended acquisitions that all ended: waiters sum %v, contended %v, task types %v; want 0, %d, 6 (5 and other)",
			workers*rounds, waiting, contended, types, workers*rounds)
	}
}

// TestObserveAllocs checks that an event of a task type seen before allocates nothing,
// so that the observer adds no garbage per lock.
func TestObserveAllocs(t *testing.T) {
	c := metrics.New()
	ctx := context.Background()
	events := []mutex.Event{
		{Op: mutex.OpAcquired, Key: "k", Name: "pay", Wait: time.Millisecond},
		{Op: mutex.OpReleased, Key: "k", Name: "pay", Held: time.Millisecond},
	}
	for _, e := range events {
		c.Observe(ctx, e)
	}
	allocs := testing.AllocsPerRun(100, func() {
		for _, e := range events {
			c.Observe(ctx, e)
		}
	})
	if allocs != 0 {
		t.Errorf("Observe of an uncontended lock and unlock: %v allocations, want 0", allocs)
	}
}

func BenchmarkObserve(b *testing.B) {
	c := metrics.New()
	ctx := context.Background()
	acquired := mutex.Event{Op: mutex.OpAcquired, Key: "k", Name: "pay", Wait: time.Millisecond}
	released := mutex.Event{Op: mutex.OpReleased, Key: "k", Name: "pay", Held: time.Millisecond}
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			c.Observe(ctx, acquired)
			c.Observe(ctx, released)
		}
	})
}
