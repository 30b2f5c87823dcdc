// Command bench measures asynqmutex side by side with its peers, bsm/redislock and
// go-redsync/redsync, and with references that bound what a Redis lock can do (a
// notified BLPOP lock, a raw SET NX/DEL floor), in the same run on the same
// redis-server, and prints Markdown tables of every figure, its ratio to the best
// peer, and the goals.
//
//	go run .                 # in bench/: starts its own redis-server on 127.0.0.1
//	REDIS_ADDR=127.0.0.1:6379 go run . -d 5s -runs 5 -tasks 20000
//
// It is a module of its own so that the peer libraries stay out of what users of
// asynqmutex compile. Machines are shared and noisy, so absolute figures mean little:
// every scenario runs its contenders in turn, forwards then backwards, so that drift
// touches them alike, and the tables report the median of -runs runs. See README.md.
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
	var o options
	flag.DurationVar(&o.d, "d", 2*time.Second, "time per lock scenario and run, all contenders together; also the bound of one hot-key round")
	flag.IntVar(&o.runs, "runs", 3, "runs of every scenario; the tables show the medians (fairness: the worst round)")
	flag.IntVar(&o.round, "round", 1000, "acquisitions per hot-key round, over which fairness is taken")
	flag.IntVar(&o.tasks, "tasks", 5000, "no-op tasks per asynq batch on distinct keys; one batch per contender, twice per run")
	flag.IntVar(&o.orderWorkers, "order-concurrency", orderHotConcurrency, "the asynq server's concurrency in the ordered hot-key scenario")
	flag.DurationVar(&o.busyCap, "busy-cap", 90*time.Second, "how long a busy-key batch may run, from its first enqueue, before it reports how far it got")
	flag.StringVar(&o.only, "only", "", "run only the scenarios whose name contains this")
	flag.BoolVar(&o.verbose, "v", false, "print every run's figures to stderr")
	flag.IntVar(&o.callgrind, "callgrind", 0, "with -only naming one rate scenario exactly and -contender: the pid of the valgrind --tool=callgrind running the REDIS_ADDR server; one measured turn (see rate.go's probeRate and callgrind.sh)")
	flag.StringVar(&o.contender, "contender", "", "the contender of -callgrind: asynqmutex, redis_rate or \"INCR floor\"")
	flag.Parse()
	if o.d < 100*time.Millisecond || o.runs < 1 || o.round < 10 || o.tasks < 100 || o.orderWorkers < 1 || o.busyCap < time.Second {
		fmt.Fprintln(os.Stderr, "bench: want -d ≥ 100ms, -runs ≥ 1, -round ≥ 10, -tasks ≥ 100, -order-concurrency ≥ 1, -busy-cap ≥ 1s")
		os.Exit(2)
	}
	if err := run(os.Stdout, o); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

// options are the command's flags.
type options struct {
	d       time.Duration
	runs    int
	round   int
	tasks   int
	only    string
	verbose bool

	orderWorkers int           // the ordered hot key's concurrency
	busyCap      time.Duration // of a busy-key batch, from its first enqueue

	callgrind int
	contender string
}

func run(out io.Writer, o options) error {
	addr, stop, err := redisAddr()
	if err != nil {
		return err
	}
	defer stop()

	var tok [6]byte
	_, _ = rand.Read(tok[:])
	e := &env{addr: addr, prefix: "asynqmutex-bench:" + hex.EncodeToString(tok[:]) + ":", options: o}
	e.stats = redis.NewClient(&redis.Options{Addr: addr})
	defer e.stats.Close()
	defer e.cleanup()
	ctx := context.Background()
	version, err := serverVersion(ctx, e.stats)
	if err != nil {
		return fmt.Errorf("redis at %s: %w", addr, err)
	}

	if o.callgrind != 0 {
		return probeRate(ctx, e, o.only, o.contender, o.callgrind)
	}

	var todo []scenario
	for _, s := range scenarios {
		if strings.Contains(s.name, o.only) {
			todo = append(todo, s)
		}
	}
	if len(todo) == 0 {
		return fmt.Errorf("no scenario matches -only %q", o.only)
	}
	// Every run measures every scenario once, so drift over the whole program
	// touches all scenarios alike.
	results := make([][]figures, len(todo))
	for r := range o.runs {
		for i, s := range todo {
			fmt.Fprintf(os.Stderr, "run %d/%d: %s\n", r+1, o.runs, s.name)
			figs, err := s.run(ctx, e)
			if err != nil {
				return fmt.Errorf("%s: %w", s.name, err)
			}
			if o.verbose {
				for _, m := range s.metrics {
					fmt.Fprintf(os.Stderr, "  %s (%s):", m.name, m.unit)
					for _, c := range s.group.columns {
						if v, ok := figs[c.name][m.name]; ok {
							fmt.Fprintf(os.Stderr, "  %s %s", c.name, num(v))
						}
					}
					fmt.Fprintln(os.Stderr)
				}
			}
			results[i] = append(results[i], figs)
		}
	}

	fmt.Fprintf(out, "redis-server %s at %s, GOMAXPROCS %d, %s/%s; -d %v -round %d -tasks %d -order-concurrency %d -busy-cap %v; %d runs, medians (fairness: worst round)\n",
		version, addr, runtime.GOMAXPROCS(0), runtime.GOOS, runtime.GOARCH, o.d, o.round, o.tasks, o.orderWorkers, o.busyCap, o.runs)
	for _, g := range []*group{lockGroup, asynqGroup, orderGroup, hookGroup, semGroup, keysGroup, functionsGroup, rateGroup, busyGroup} {
		printGroup(out, g, todo, results)
	}
	fmt.Fprintln(out, "\n÷ best peer: asynqmutex's figure over the best of the peer libraries' (redislock, redsync, or the hand-written middleware); goals name their own reference.")
	return nil
}

// printHeader prints the head of g's table: the scenario and figure columns, one
// right-aligned column per contender, then the columns named in tail, the first
// numeric of them right-aligned.
func printHeader(out io.Writer, g *group, tail []string, numeric int) {
	fmt.Fprintf(out, "\n%s\n\n| scenario | figure |", g.title)
	for _, c := range g.columns {
		fmt.Fprintf(out, " %s |", c.name)
	}
	for _, t := range tail {
		fmt.Fprintf(out, " %s |", t)
	}
	fmt.Fprint(out, "\n|---|---|")
	for range g.columns {
		fmt.Fprint(out, "--:|")
	}
	for i := range tail {
		if i < numeric {
			fmt.Fprint(out, "--:|")
		} else {
			fmt.Fprint(out, "---|")
		}
	}
	fmt.Fprintln(out)
}

// printGroup prints the table of the group's scenarios among todo: a row per metric,
// a column per contender; or as the group's own print does.
func printGroup(out io.Writer, g *group, todo []scenario, results [][]figures) {
	if g.print != nil {
		g.print(out, g, todo, results)
		return
	}
	header := false
	for i, s := range todo {
		if s.group != g {
			continue
		}
		if !header {
			header = true
			if g.noPeers {
				printHeader(out, g, nil, 0)
			} else {
				printHeader(out, g, []string{"÷ best peer", "goal", "result"}, 1)
			}
		}
		for _, m := range s.metrics {
			agg := m.aggregate(results[i])
			fmt.Fprintf(out, "| %s | %s (%s) |", s.name, m.name, m.unit)
			for _, c := range g.columns {
				fmt.Fprintf(out, " %s |", num(value(agg, c.name)))
			}
			if g.noPeers {
				fmt.Fprintln(out)
				continue
			}
			var texts, verdicts []string
			for _, gl := range m.goals {
				texts = append(texts, gl.text())
				verdicts = append(verdicts, gl.verdict(agg, m.ratio(g, results[i], agg, gl.ref)))
			}
			fmt.Fprintf(out, " %s | %s | %s |\n", ratioText(m.ratio(g, results[i], agg, "")),
				strings.Join(texts, "; "), strings.Join(verdicts, "; "))
		}
	}
}

// scenario measures its contenders on the same server, in turn, and returns their
// figures.
type scenario struct {
	name    string
	group   *group
	metrics []metric
	run     func(ctx context.Context, e *env) (figures, error)
}

// figures are one run's values: by contender, then by metric. A contender lacks the
// metrics that do not apply to it.
type figures map[string]map[string]float64

// group is a table: the scenarios that share its columns.
type group struct {
	title   string
	columns []column
	noPeers bool // no ÷ best peer, goal or result: its metrics carry their own ratios
	// print, where set, prints the group's table instead of printGroup.
	print func(out io.Writer, g *group, todo []scenario, results [][]figures)
}

// column is a contender, as tables show it.
type column struct {
	name string
	peer bool // what a user would pick instead of asynqmutex: a candidate for "best peer"
}

func (c column) col() column { return c }

// columnsOf are the columns of contenders, in order.
func columnsOf[C interface{ col() column }](contenders []C) []column {
	cols := make([]column, len(contenders))
	for i, c := range contenders {
		cols[i] = c.col()
	}
	return cols
}

// ours is the name of asynqmutex's column in every group.
const ours = "asynqmutex"

// ratio is asynqmutex's figure over ref's, or, when ref is "", over the best peer's:
// the median of the runs' ratios, each taken within one run, where the contenders
// ran side by side; for a metric aggregated by its worst, the ratio of the worst.
func (m metric) ratio(g *group, runs []figures, agg map[string]float64, ref string) float64 {
	if m.worst {
		return value(agg, ours) / m.reference(g, agg, ref)
	}
	var rs []float64
	for _, figs := range runs {
		vals := make(map[string]float64, len(figs))
		for c, ms := range figs {
			if v, ok := ms[m.name]; ok {
				vals[c] = v
			}
		}
		rs = append(rs, value(vals, ours)/m.reference(g, vals, ref))
	}
	return median(rs)
}

// reference is ref's value in vals or, when ref is "", the best of g's peers'; NaN
// when there is none.
func (m metric) reference(g *group, vals map[string]float64, ref string) float64 {
	if ref != "" {
		return value(vals, ref)
	}
	best := nan()
	for _, c := range g.columns {
		v := value(vals, c.name)
		if !c.peer || math.IsNaN(v) {
			continue
		}
		if math.IsNaN(best) || (m.higher && v > best) || (!m.higher && v < best) {
			best = v
		}
	}
	return best
}

// value is vals[name], or NaN when it has none.
func value(vals map[string]float64, name string) float64 {
	if v, ok := vals[name]; ok {
		return v
	}
	return nan()
}

// metric is one row of a table.
type metric struct {
	name   string
	unit   string
	higher bool // higher is better (a rate, fairness); otherwise lower is (a time, a count)
	worst  bool // over runs, take the worst value rather than the median
	goals  []goal
}

// aggregate is each contender's value over the runs: the median, or the worst.
func (m metric) aggregate(runs []figures) map[string]float64 {
	vals := make(map[string][]float64)
	for _, figs := range runs {
		for c, ms := range figs {
			if v, ok := ms[m.name]; ok {
				vals[c] = append(vals[c], v)
			}
		}
	}
	agg := make(map[string]float64, len(vals))
	for c, vs := range vals {
		switch {
		case !m.worst:
			agg[c] = median(vs)
		case m.higher:
			agg[c] = slices.Min(vs)
		default:
			agg[c] = slices.Max(vs)
		}
	}
	return agg
}

// goal is asynqmutex's figure compared with a limit: at most (below, when strict) or
// at least limit times the figure of the contender ref, or, when ref is "", the limit
// itself.
type goal struct {
	atLeast bool
	strict  bool
	limit   float64
	ref     string
}

func atMost(limit float64, ref string) goal  { return goal{limit: limit, ref: ref} }
func atLeast(limit float64, ref string) goal { return goal{atLeast: true, limit: limit, ref: ref} }
func below(limit float64) goal               { return goal{strict: true, limit: limit} }

// met reports whether v, the figure or, with a ref, the ratio, meets the goal.
func (g goal) met(v float64) bool {
	switch {
	case g.atLeast:
		return v >= g.limit
	case g.strict:
		return v < g.limit
	default:
		return v <= g.limit
	}
}

func (g goal) text() string {
	op := "≤"
	switch {
	case g.atLeast:
		op = "≥"
	case g.strict:
		op = "<"
	}
	if g.ref == "" {
		return fmt.Sprintf("%s %g", op, g.limit)
	}
	return fmt.Sprintf("%s %g× %s", op, g.limit, g.ref)
}

// verdict is "pass" or "FAIL", with the ratio when the goal has a reference; "–"
// when a figure is missing. ratio is asynqmutex's figure over ref's (metric.ratio).
func (g goal) verdict(agg map[string]float64, ratio float64) string {
	v, suffix := value(agg, ours), ""
	if g.ref != "" {
		v, suffix = ratio, " ("+ratioText(ratio)+")"
	}
	switch {
	case math.IsNaN(v) || math.IsInf(v, 0):
		return "–"
	case g.met(v):
		return "pass" + suffix
	default:
		return "FAIL" + suffix
	}
}

// side is one contender of a scenario. run works until the deadline (finishing the
// operation in progress, or, for a side that works in rounds or batches, one round or
// batch) and adds to the side's totals; figures turns the totals into metrics by name.
type side interface {
	run(ctx context.Context, deadline time.Time) error
	figures() map[string]float64
	reset() // drops the totals, after a warm-up
}

// interleave runs the sides in turn for each at a time, forwards then backwards (a
// drift linear in time touches them alike), cycles times over, and returns their
// figures by name.
func interleave(ctx context.Context, each time.Duration, cycles int, names []string, sides []side) (figures, error) {
	order := make([]int, 0, 2*len(sides))
	for i := range sides {
		order = append(order, i)
	}
	for i := range sides {
		order = append(order, len(sides)-1-i)
	}
	for range cycles {
		for _, i := range order {
			if err := sides[i].run(ctx, time.Now().Add(each)); err != nil {
				return nil, fmt.Errorf("%s: %w", names[i], err)
			}
		}
	}
	figs := make(figures, len(sides))
	for i, s := range sides {
		figs[names[i]] = s.figures()
	}
	return figs, nil
}

// env is the Redis the scenarios share, and the command's options.
type env struct {
	addr   string
	prefix string // of every key and channel of this run, so cleanup finds them
	stats  *redis.Client
	options
}

// redis returns a new client of the server; the caller closes it. Its pool holds 64
// connections, more than the goroutines of any scenario, so a contender that blocks
// on a connection (BLPOP) never waits for the pool instead.
func (e *env) redis(hooks ...redis.Hook) *redis.Client {
	rdb := redis.NewClient(&redis.Options{Addr: e.addr, PoolSize: 64})
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
	if v, ok := infoField(info, "redis_version"); ok {
		return v, nil
	}
	return "?", nil
}

// infoField is the value of field in an INFO reply.
func infoField(info, field string) (string, bool) {
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), field+":"); ok {
			return v, true
		}
	}
	return "", false
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
	case math.IsNaN(x) || math.IsInf(x, 0):
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
