// Command bench measures asynqmutex against a floor measured in the same run, on the
// same redis-server, and prints a Markdown table of the ratios and the goals.
//
//	go run ./bench              # starts its own redis-server on 127.0.0.1
//	REDIS_ADDR=127.0.0.1:6379 go run ./bench -d 5s -runs 5
//
// Machines are shared and noisy, so absolute figures mean little: every scenario
// measures its floor and the lock alternately (floor, lock, lock, floor, floor, lock)
// in one run, and the table reports the median of -runs runs. See README.md.
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net"
	"os"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
)

func main() {
	d := flag.Duration("d", 3*time.Second, "time per scenario and run, floor and lock together")
	runs := flag.Int("runs", 3, "runs of every scenario; the table shows the medians")
	only := flag.String("only", "", "run only the scenarios whose name contains this")
	verbose := flag.Bool("v", false, "print every run's figures to stderr")
	retryLater := flag.Duration("retrylater", 15*time.Second, "bound on the asynq hot-key drain under RetryLater, which is slow by design")
	flag.Parse()
	if *d < 100*time.Millisecond || *runs < 1 {
		fmt.Fprintln(os.Stderr, "bench: -d must be at least 100ms and -runs at least 1")
		os.Exit(2)
	}
	if err := run(os.Stdout, *d, *runs, *only, *verbose, *retryLater); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func run(out io.Writer, d time.Duration, runs int, only string, verbose bool, retryLater time.Duration) error {
	addr, stop, err := redisAddr()
	if err != nil {
		return err
	}
	defer stop()

	var tok [6]byte
	_, _ = rand.Read(tok[:])
	e := &env{addr: addr, prefix: "asynqmutex-bench:" + hex.EncodeToString(tok[:]) + ":", retryLater: retryLater}
	e.stats = e.redis()
	defer e.stats.Close()
	defer e.cleanup()
	ctx := context.Background()
	version, err := serverVersion(ctx, e.stats)
	if err != nil {
		return fmt.Errorf("redis at %s: %w", addr, err)
	}

	var todo []scenario
	for _, s := range scenarios {
		if strings.Contains(s.name, only) {
			todo = append(todo, s)
		}
	}
	if len(todo) == 0 {
		return fmt.Errorf("no scenario matches -only %q", only)
	}
	// Every run measures every scenario once, so drift over the whole program
	// touches all scenarios alike.
	results := make([][]map[string]figure, len(todo))
	for r := range runs {
		for i, s := range todo {
			fmt.Fprintf(os.Stderr, "run %d/%d: %s\n", r+1, runs, s.name)
			figs, err := s.run(ctx, e, d)
			if err != nil {
				return fmt.Errorf("%s: %w", s.name, err)
			}
			if verbose {
				for _, m := range s.metrics {
					f := figs[m.name]
					fmt.Fprintf(os.Stderr, "  %-28s floor %10.2f  lock %10.2f  %s\n", m.name, f.floor, f.lock, m.unit)
				}
			}
			results[i] = append(results[i], figs)
		}
	}

	fmt.Fprintf(out, "redis-server %s at %s, GOMAXPROCS %d, %s/%s; %d runs of %v per scenario, medians\n\n",
		version, addr, runtime.GOMAXPROCS(0), runtime.GOOS, runtime.GOARCH, runs, d)
	fmt.Fprintln(out, "| scenario | metric | floor | lock | ratio | goal | result |")
	fmt.Fprintln(out, "|---|---|--:|--:|--:|---|---|")
	for i, s := range todo {
		for _, m := range s.metrics {
			var floors, locks, ratios []float64
			for _, figs := range results[i] {
				f := figs[m.name]
				floors, locks = append(floors, f.floor), append(locks, f.lock)
				ratios = append(ratios, m.ratio(f))
			}
			f := figure{floor: median(floors), lock: median(locks)}
			ratio := median(ratios)
			verdict := "info"
			if m.pass != nil {
				verdict = "FAIL"
				if m.pass(f, ratio) {
					verdict = "pass"
				}
			}
			fmt.Fprintf(out, "| %s | %s (%s) | %s | %s | %s | %s | %s |\n",
				s.name, m.name, m.unit, num(f.floor), num(f.lock), ratioText(ratio), m.goal, verdict)
		}
	}
	fmt.Fprintln(out, "\nratio = lock cost / floor cost: lock/floor for times and commands, floor/lock for rates; above 1 the lock is slower.")
	return nil
}

// scenario measures a floor and the lock on the same server, alternately, for about
// d, and returns a figure for each of its metrics by name.
type scenario struct {
	name    string
	metrics []metric
	run     func(ctx context.Context, e *env, d time.Duration) (map[string]figure, error)
}

// metric is one row of the table.
type metric struct {
	name   string
	unit   string
	higher bool   // higher is better (a rate); otherwise lower is (a time, a count)
	goal   string // as the table shows it; "" when the row is for information
	pass   func(f figure, ratio float64) bool
}

// ratio is the lock's cost over the floor's: above 1 the lock is slower.
func (m metric) ratio(f figure) float64 {
	if m.higher {
		return f.floor / f.lock
	}
	return f.lock / f.floor
}

// figure is one metric's value for the floor and for the lock. A NaN floor means
// the metric has none.
type figure struct{ floor, lock float64 }

// ratioAtMost is a goal on the ratio.
func ratioAtMost(limit float64) func(figure, float64) bool {
	return func(_ figure, r float64) bool { return r <= limit }
}

// lockBelow and lockAtMost are goals on the lock's own figure.
func lockBelow(limit float64) func(figure, float64) bool {
	return func(f figure, _ float64) bool { return f.lock < limit }
}

func lockAtMost(limit float64) func(figure, float64) bool {
	return func(f figure, _ float64) bool { return f.lock <= limit }
}

// side is the floor or the lock half of a scenario. run works until the deadline
// (finishing the operation in progress) and adds to the side's totals; figures turns
// the totals into metrics by name.
type side interface {
	run(ctx context.Context, deadline time.Time) error
	figures() map[string]float64
}

// chunks is the order in which interleave runs the sides: ABBAAB cancels a drift
// that is linear in time.
var chunks = []bool{false, true, true, false, false, true} // true: lock

// interleave runs floor and lock alternately, for d in all, and pairs their figures.
func interleave(ctx context.Context, d time.Duration, floor, lock side) (map[string]figure, error) {
	each := d / time.Duration(len(chunks))
	for _, isLock := range chunks {
		s := floor
		if isLock {
			s = lock
		}
		if err := s.run(ctx, time.Now().Add(each)); err != nil {
			return nil, err
		}
	}
	ff, lf := floor.figures(), lock.figures()
	figs := make(map[string]figure, len(lf))
	for name, v := range lf {
		f, ok := ff[name]
		if !ok {
			f = nan()
		}
		figs[name] = figure{floor: f, lock: v}
	}
	return figs, nil
}

// env is the Redis the scenarios share.
type env struct {
	addr   string
	prefix string // of every key and channel of this run, so cleanup finds them
	stats  *redis.Client

	retryLater time.Duration // bound on the asynq RetryLater drain (-retrylater)
}

// redis returns a new client of the server; the caller closes it.
func (e *env) redis(hooks ...redis.Hook) *redis.Client {
	rdb := redis.NewClient(&redis.Options{Addr: e.addr})
	for _, h := range hooks {
		rdb.AddHook(h)
	}
	return rdb
}

// cleanup deletes what the run left (fencing counters outlive their locks by days),
// which matters on a REDIS_ADDR server. It is bounded in time and count.
func (e *env) cleanup() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var cursor uint64
	for range 10000 {
		keys, next, err := e.stats.Scan(ctx, cursor, e.prefix+"*", 1000).Result()
		if err != nil {
			fmt.Fprintln(os.Stderr, "bench: cleanup:", err)
			return
		}
		if len(keys) > 0 {
			_ = e.stats.Unlink(ctx, keys...).Err()
		}
		if cursor = next; cursor == 0 {
			return
		}
	}
}

// redisAddr starts a redis-server on a free 127.0.0.1 port, or uses REDIS_ADDR
// when it is set and names a loopback address: the figures are meant for loopback,
// and the benchmark must never load a server someone else depends on by mistake.
func redisAddr() (string, func(), error) {
	if addr := os.Getenv("REDIS_ADDR"); addr != "" {
		if err := checkLoopback(addr); err != nil {
			return "", nil, err
		}
		return addr, func() {}, nil
	}
	s, err := redistest.StartProcess()
	if errors.Is(err, redistest.ErrNoServer) {
		return "", nil, fmt.Errorf("%w: install redis-server, or set REDIS_ADDR to a loopback address", err)
	}
	if err != nil {
		return "", nil, err
	}
	return s.Addr(), func() {
		if err := s.Close(); err != nil {
			fmt.Fprintln(os.Stderr, "bench: stopping redis-server:", err)
		}
	}, nil
}

func checkLoopback(addr string) error {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("REDIS_ADDR %q: want host:port: %w", addr, err)
	}
	if host == "localhost" {
		return nil
	}
	if ip := net.ParseIP(host); ip != nil && ip.IsLoopback() {
		return nil
	}
	return fmt.Errorf("REDIS_ADDR %q is not a loopback address; refusing to benchmark it", addr)
}

func serverVersion(ctx context.Context, rdb *redis.Client) (string, error) {
	info, err := rdb.Info(ctx, "server").Result()
	if err != nil {
		return "", err
	}
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "redis_version:"); ok {
			return v, nil
		}
	}
	return "?", nil
}

func median(xs []float64) float64 {
	xs = slices.DeleteFunc(slices.Clone(xs), math.IsNaN)
	if len(xs) == 0 {
		return nan()
	}
	slices.Sort(xs)
	if len(xs)%2 == 1 {
		return xs[len(xs)/2]
	}
	return (xs[len(xs)/2-1] + xs[len(xs)/2]) / 2
}

func nan() float64 { return math.NaN() }

func num(x float64) string {
	switch {
	case math.IsNaN(x):
		return "–"
	case x >= 1000:
		return fmt.Sprintf("%.0f", x)
	case x >= 10:
		return fmt.Sprintf("%.1f", x)
	default:
		return fmt.Sprintf("%.2f", x)
	}
}

func ratioText(r float64) string {
	if math.IsNaN(r) || math.IsInf(r, 0) {
		return "–"
	}
	return fmt.Sprintf("%.2f×", r)
}
