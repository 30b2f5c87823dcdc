package ratelimit_test

// The harness: a fleet of worker processes (this test binary re-executed with
// workerEnv set) taking starts of keys in a Wait loop, and a referee redis-server,
// which no worker limits anything on, recording the moment each start begins on the
// referee's clock.
//
// Referee keys:
//   - starts:<key>  a list of "<begin µs> <call µs> <worker>": begin is the referee's
//     TIME when the worker's record reached it, right after Wait returned; call is
//     the referee's TIME read just before that Wait was called (0 unless the key
//     spec asks for it). The worker's report adds what it measured on its own clock
//     (record).
//   - ready         a list every worker pushes its ID onto once connected.
//   - go:<id>       the parent pushes the referee time of "go" here; worker <id>
//     starts taking starts when it pops it.
//   - report:<id>   worker <id>'s JSON report, pushed as it exits.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
	"github.com/asynqmutex/asynqmutex/ratelimit"
)

// workerEnv carries a worker's JSON spec; set, it makes this binary a worker.
const workerEnv = "ASYNQMUTEX_RATE_WORKER"

// refTimeout bounds every referee command. The referee is never faulted or loaded
// with limits, so reaching it is a broken harness.
const refTimeout = 10 * time.Second

// keySpec is one key a worker takes starts of, and how.
type keySpec struct {
	Name       string
	Limit      ratelimit.Rate
	Goroutines int  // goroutines per worker, each in its own Wait loop
	Calls      bool // record the referee time before each Wait (the pause test needs it)
}

// workerSpec is what a worker process runs.
type workerSpec struct {
	ID          int
	Mode        string // modeLimiter, or modeLocal: the broken control
	RateAddr    string // the Redis the limiter keeps its keys in
	RefereeAddr string
	Keys        []keySpec
	Run         time.Duration // how long to take starts after "go"
	Lifetime    time.Duration // the whole process, waiting for "go" included
}

const (
	// modeLimiter takes every start with ratelimit's Wait, fleet-wide.
	modeLimiter = "limiter"
	// modeLocal is the broken control: each process spaces its own starts at the
	// limit's interval, as a per-process limiter (x/time/rate in one worker) does, so
	// the fleet starts workers times too many.
	modeLocal = "local"
)

// workerReport is what a worker pushes to the referee as it exits.
type workerReport struct {
	ID     int
	Starts map[string]int // starts taken, per key
	// Records gives, for each start, how long after Wait returned its record's
	// reply came back: the referee's TIME in the record was read within that time
	// after the start began.
	Records []record
	Error   string
}

// record is one start as its worker saw it; durations in µs of the worker's clock.
type record struct {
	Key   string
	Begin int64 // the referee time the record returned, µs
	U     int64 // from Wait's return to the record's reply
	// LateLo and LateHi bound how long after the moment the limiter set for the start
	// Wait returned (see probe): 0 when the worker had no probe (the broken control).
	LateLo, LateHi int64
	// Member is the start's member in the key's sorted set and Delay the delay the
	// limiter answered, µs (see probe); "" and 0 without a probe.
	Member string
	Delay  int64
}

// recordScript appends a start to starts:<key> with the referee's time.
//
// KEYS[1] -> starts:<key>, a list of "<begin µs> <call µs> <worker>"
// ARGV[1] -> "<call µs> <worker>"
// Returns the time recorded, in µs as a string. The time is built as a string, not
// a Lua number, so that no float formatting can round it.
var recordScript = redis.NewScript(`
local t = redis.call('TIME')
local now = t[1] .. string.format('%06d', tonumber(t[2]))
redis.call('RPUSH', KEYS[1], now .. ' ' .. ARGV[1])
return now
`)

func startsKey(key string) string { return "starts:" + key }
func goKey(id int) string         { return "go:" + strconv.Itoa(id) }
func reportKey(id int) string     { return "report:" + strconv.Itoa(id) }

// refNow is the referee's TIME in microseconds.
func refNow(ctx context.Context, ref *redis.Client) (int64, error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), refTimeout)
	defer cancel()
	t, err := ref.Time(ctx).Result()
	if err != nil {
		return 0, fmt.Errorf("referee: TIME: %w", err)
	}
	return t.UnixMicro(), nil
}

// workerMain runs in a worker process and returns its exit code.
func workerMain(raw string) int {
	var spec workerSpec
	if err := json.Unmarshal([]byte(raw), &spec); err != nil {
		fmt.Fprintf(os.Stderr, "worker: bad spec: %v\n", err)
		return 2
	}
	ctx, cancel := context.WithTimeout(context.Background(), spec.Lifetime)
	defer cancel()
	rate := redis.NewClient(&redis.Options{Addr: spec.RateAddr})
	rate.AddHook(probeHook{})
	ref := redis.NewClient(&redis.Options{Addr: spec.RefereeAddr})
	defer rate.Close()
	defer ref.Close()
	rep := workerReport{ID: spec.ID, Starts: map[string]int{}}
	if err := runWorker(ctx, spec, rate, ref, &rep); err != nil {
		rep.Error = err.Error()
	}
	b, _ := json.Marshal(rep)
	rctx, rcancel := context.WithTimeout(context.Background(), refTimeout)
	defer rcancel()
	if err := ref.RPush(rctx, reportKey(spec.ID), b).Err(); err != nil {
		fmt.Fprintf(os.Stderr, "worker %d: pushing report: %v\n", spec.ID, err)
		return 1
	}
	if rep.Error != "" {
		fmt.Fprintf(os.Stderr, "worker %d: %s\n", spec.ID, rep.Error)
		return 1
	}
	return 0
}

func runWorker(ctx context.Context, spec workerSpec, rate, ref *redis.Client, rep *workerReport) error {
	if err := ref.RPush(ctx, "ready", spec.ID).Err(); err != nil {
		return fmt.Errorf("referee: ready: %w", err)
	}
	// Wait for "go" in one-second polls, so that the lifetime bounds the wait.
	for {
		_, err := ref.BLPop(ctx, time.Second, goKey(spec.ID)).Result()
		if err == nil {
			break
		}
		if !errors.Is(err, redis.Nil) {
			return fmt.Errorf("waiting for go: %w", err)
		}
	}
	runCtx, stop := context.WithTimeout(ctx, spec.Run)
	defer stop()
	lim := ratelimit.New(rate)
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		first error
	)
	for _, ks := range spec.Keys {
		take := func(ctx context.Context) error { return lim.Wait(ctx, ks.Name, ks.Limit) }
		if spec.Mode == modeLocal {
			take = (&spacer{interval: ks.Limit.Per / time.Duration(ks.Limit.N)}).wait
		}
		for range ks.Goroutines {
			wg.Add(1)
			go func() {
				defer wg.Done()
				recs, err := takeLoop(runCtx, spec, ks, take, ref)
				mu.Lock()
				defer mu.Unlock()
				rep.Starts[ks.Name] += len(recs)
				rep.Records = append(rep.Records, recs...)
				if err != nil && first == nil {
					first = err
				}
			}()
		}
	}
	wg.Wait()
	return first
}

// takeLoop takes starts of ks until the run is over and records each on the referee
// the moment it begins. It returns the starts it took.
func takeLoop(ctx context.Context, spec workerSpec, ks keySpec, take func(context.Context) error, ref *redis.Client) ([]record, error) {
	// No goroutine can take more than the key's whole limit over the run; the bound
	// only keeps a broken limiter from looping for ever.
	bound := ks.Limit.N*int(spec.Run/ks.Limit.Per+1) + 10
	var recs []record
	for range bound {
		var (
			call int64
			pr   probe
		)
		if ks.Calls {
			var err error
			if call, err = refNow(ctx, ref); err != nil {
				return recs, err
			}
		}
		err := take(context.WithValue(ctx, probeKey{}, &pr))
		switch {
		case errors.Is(err, ratelimit.ErrLimited), err != nil && ctx.Err() != nil:
			return recs, nil // the next start would come after the run
		case err != nil:
			return recs, fmt.Errorf("%s: %w", ks.Name, err)
		}
		began := time.Now()
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), refTimeout)
		at, err := recordScript.Run(rctx, ref, []string{startsKey(ks.Name)}, fmt.Sprintf("%d %d", call, spec.ID)).Text()
		cancel()
		if err != nil {
			return recs, fmt.Errorf("referee: record: %w", err)
		}
		u := micros(time.Since(began))
		begin, err := strconv.ParseInt(at, 10, 64)
		if err != nil {
			return recs, fmt.Errorf("referee: record returned %q", at)
		}
		rc := record{Key: ks.Name, Begin: begin, U: u}
		if !pr.sent.IsZero() {
			rc.LateLo, rc.LateHi = micros(began.Sub(pr.sent)), micros(began.Sub(pr.read))
			rc.Member, rc.Delay = pr.member, pr.delay
		}
		recs = append(recs, rc)
	}
	return recs, fmt.Errorf("%s: %d starts in %v, more than the limit %v allows", ks.Name, bound, spec.Run, ks.Limit)
}

// probe is where probeHook leaves, for one Wait, bounds of the moment the limiter's
// answer set for its start, on the worker's clock: the server decided between the
// take script's sending and its reply's arrival, and set the start the reply's
// delay after that. It also keeps the start's member (the call's argument) and the
// delay, so that the parent can find the start's TAT in Redis. Wait itself does not
// tell; the hook reads the call and its reply on their way.
type probe struct {
	sent, read time.Time
	member     string
	delay      int64 // µs
}

type probeKey struct{}

// probeHook fills the probe in a command's context from a take script's reply
// ({taken, delay µs, remaining, paused, found, late}). It is a test's view of the wire format,
// not an API.
type probeHook struct{}

func (probeHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (probeHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

func (probeHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		sent := time.Now()
		err := next(ctx, cmd)
		read := time.Now()
		pr, ok := ctx.Value(probeKey{}).(*probe)
		if !ok || err != nil {
			return err
		}
		if c, ok := cmd.(*redis.Cmd); ok {
			if res, err := c.Int64Slice(); err == nil && len(res) == 6 && res[0] == 1 {
				delay := time.Duration(res[1]) * time.Microsecond
				pr.sent, pr.read = sent.Add(delay), read.Add(delay)
				pr.delay = res[1]
				// FCALL or EVALSHA <name> <numkeys> <keys...> <member> ...
				if args := c.Args(); len(args) > 3 {
					if nk, ok := args[2].(int); ok && len(args) > 3+nk {
						pr.member, _ = args[3+nk].(string)
					}
				}
			}
		}
		return err
	}
}

// spacer is the broken control's limiter: one per process and key, it spaces that
// process's starts at the limit's interval and knows nothing of the others.
type spacer struct {
	mu       sync.Mutex
	next     time.Time
	interval time.Duration
}

func (s *spacer) wait(ctx context.Context) error {
	s.mu.Lock()
	at := time.Now()
	if s.next.After(at) {
		at = s.next
	}
	s.next = at.Add(s.interval)
	s.mu.Unlock()
	timer := time.NewTimer(time.Until(at))
	defer timer.Stop()
	select {
	case <-timer.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// fleet is a rate Redis, a referee, and the parent's clients of both.
type fleet struct {
	Rate    *redistest.Server
	RateRDB *redis.Client
	Ref     *redis.Client
	refSrv  *redistest.Server
}

func newFleet(t *testing.T) *fleet {
	t.Helper()
	rate, ref := redistest.Start(t), redistest.Start(t)
	return &fleet{Rate: rate, RateRDB: rate.Client(t), Ref: ref.Client(t), refSrv: ref}
}

// fleetConfig is one run of the fleet.
type fleetConfig struct {
	Workers int
	Mode    string // default modeLimiter
	Keys    []keySpec
	Run     time.Duration
	// During, if set, runs in the parent (the test goroutine) from "go" on, while the
	// workers take starts; goAt is the referee time of "go".
	During func(goAt int64)
}

// start is one recorded start; times are referee µs.
type start struct {
	Begin, Call int64
	Worker      int
	// U, LateLo and LateHi come from the worker's report (record): the start began
	// in [Begin-U, Begin] and the limiter set it for a moment in
	// [Begin-U-LateLo, Begin-LateHi], referee µs. Where S is known, LateHi is at
	// least Begin-U-S less the clocks' difference (see oneClock).
	U, LateLo, LateHi int64
	// LateUp bounds from above how late the start began after the moment set:
	// LateLo, or Begin-S plus the clocks' difference where S is known and that is
	// less. LateHi is the bound from below.
	LateUp int64
	// S is the moment the limiter set for the start, exactly, in µs of the rate
	// server's clock: its TAT in the key's sorted set less the limit's tau (see
	// ratelimit/layout.go); Delay is the delay it answered, so S - Delay is when it
	// decided. HasS is false without a probe (the broken control) or when the
	// start's member was not found.
	S, Delay int64
	HasS     bool
}

// clockGrain widens every span by the resolution of the clocks it is read from
// (Redis's TIME and the measured durations are whole microseconds), so that
// rounding never narrows a span below what it bounds.
const clockGrain = 2

// began is the span in which s began.
func (s start) began() span { return span{s.Begin - s.U - clockGrain, s.Begin + clockGrain} }

// set is the span of the moment the limiter set for s: exactly S (on the rate
// server's clock) when known, else bounded from the worker's measures (on the
// referee's). All the starts of a key have S, or none.
func (s start) set() span {
	if s.HasS {
		return span{s.S, s.S}
	}
	return span{s.Begin - s.U - s.LateLo - clockGrain, s.Begin - s.LateHi + clockGrain}
}

// fleetResult is what a run recorded.
type fleetResult struct {
	GoAt    int64              // referee time of "go"
	Starts  map[string][]start // per key, by Begin
	Reports []workerReport
}

// begins is the begin times of key's starts, in order.
func (r fleetResult) begins(key string) []int64 {
	out := make([]int64, len(r.Starts[key]))
	for i, s := range r.Starts[key] {
		out[i] = s.Begin
	}
	return out
}

// run starts cfg.Workers worker processes, lets them take starts for cfg.Run, and
// returns what the referee recorded. It fails the test if a worker fails or any
// step exceeds its bound.
func (f *fleet) run(t *testing.T, cfg fleetConfig) fleetResult {
	t.Helper()
	if cfg.Mode == "" {
		cfg.Mode = modeLimiter
	}
	ctx := context.Background()
	lifetime := cfg.Run + 30*time.Second
	procs := make([]*proc, cfg.Workers)
	for i := range procs {
		procs[i] = startWorker(t, workerSpec{
			ID: i + 1, Mode: cfg.Mode, RateAddr: f.Rate.Addr(), RefereeAddr: f.refSrv.Addr(),
			Keys: cfg.Keys, Run: cfg.Run, Lifetime: lifetime,
		})
	}
	for ready := 0; ready < cfg.Workers; {
		_, err := f.Ref.BLPop(ctx, 20*time.Second, "ready").Result()
		if err != nil {
			t.Fatalf("waiting for %d workers to connect: %v; %s", cfg.Workers-ready, err, outputs(procs))
		}
		ready++
	}
	goAt, err := refNow(ctx, f.Ref)
	if err != nil {
		t.Fatal(err)
	}
	for i := range procs {
		if err := f.Ref.RPush(ctx, goKey(i+1), goAt).Err(); err != nil {
			t.Fatalf("referee: go: %v", err)
		}
	}
	// The rate Redis forgets a start 10 to 20 seconds after its TAT; snapshots
	// every Per of the run keep every TAT for the checkers.
	tats := map[string]int64{}
	snapDone := make(chan struct{})
	snapStop := make(chan struct{})
	stopSnapshots := sync.OnceFunc(func() { close(snapStop); <-snapDone })
	t.Cleanup(stopSnapshots) // a test that fails mid-run leaves no goroutine behind
	go func() {
		defer close(snapDone)
		for range int(lifetime/time.Second) + 1 {
			f.snapshot(cfg.Keys, tats)
			select {
			case <-snapStop:
				return
			case <-time.After(time.Second):
			}
		}
	}()
	if cfg.During != nil {
		cfg.During(goAt)
	}
	res := fleetResult{GoAt: goAt, Starts: map[string][]start{}}
	deadline := time.Now().Add(lifetime)
	for _, p := range procs {
		select {
		case <-p.done:
		case <-time.After(time.Until(deadline)):
			t.Fatalf("worker %d still running %v after go; output:\n%s", p.id, lifetime, p.out.String())
		}
		raw, err := f.Ref.LPop(ctx, reportKey(p.id)).Result()
		if err != nil {
			t.Fatalf("worker %d left no report (exit %v): %v; output:\n%s", p.id, p.err, err, p.out.String())
		}
		var rep workerReport
		if err := json.Unmarshal([]byte(raw), &rep); err != nil {
			t.Fatalf("worker %d report: %v", p.id, err)
		}
		if rep.Error != "" || p.err != nil {
			t.Fatalf("worker %d failed: exit %v, %s; output:\n%s", p.id, p.err, rep.Error, p.out.String())
		}
		res.Reports = append(res.Reports, rep)
	}
	stopSnapshots()
	f.snapshot(cfg.Keys, tats)
	eps := f.oneClock(t)
	type at struct {
		worker int
		begin  int64
	}
	recs := map[at]record{}
	for _, rep := range res.Reports {
		for _, rc := range rep.Records {
			recs[at{rep.ID, rc.Begin}] = rc
		}
	}
	for _, ks := range cfg.Keys {
		res.Starts[ks.Name] = f.recorded(t, ks.Name)
		for i, s := range res.Starts[ks.Name] {
			rc, ok := recs[at{s.Worker, s.Begin}]
			if !ok {
				t.Fatalf("%s: the referee recorded a start at %d µs that worker %d did not report", ks.Name, s.Begin, s.Worker)
			}
			st := &res.Starts[ks.Name][i]
			st.U, st.LateLo, st.LateHi, st.Delay = rc.U, rc.LateLo, rc.LateHi, rc.Delay
			st.LateUp = rc.LateLo
			if score, ok := tats[rc.Member]; ok && rc.Member != "" {
				st.S, st.HasS = score-tau(ks.Limit), true
				// The start began at Begin-U or later, on the one clock of both
				// servers: at least that long after the moment set.
				st.LateHi = max(st.LateHi, st.Begin-st.U-st.S-eps)
				st.LateUp = min(st.LateUp, st.Begin-st.S+eps)
			} else if rc.Member != "" {
				t.Fatalf("%s: the TAT of worker %d's start at %d µs (member %q) was not kept", ks.Name, s.Worker, s.Begin, rc.Member)
			}
		}
		seen := 0
		for _, rep := range res.Reports {
			seen += rep.Starts[ks.Name]
		}
		if seen != len(res.Starts[ks.Name]) {
			t.Fatalf("%s: workers took %d starts, the referee recorded %d", ks.Name, seen, len(res.Starts[ks.Name]))
		}
	}
	return res
}

// snapshot adds the members and scores (TATs) of keys' sorted sets in the rate
// Redis to tats. It runs beside the test goroutine, so it reports nothing: a member
// it missed fails the test when the starts are matched.
func (f *fleet) snapshot(keys []keySpec, tats map[string]int64) {
	for _, ks := range keys {
		zs, err := f.RateRDB.ZRangeWithScores(context.Background(), rateRedisKey(ks.Name), 0, -1).Result()
		if err != nil {
			continue
		}
		for _, z := range zs {
			if m, ok := z.Member.(string); ok {
				tats[m] = -int64(z.Score) // scores are minus the TATs
			}
		}
	}
}

// oneClock checks that the referee and the rate Redis read one clock, as two
// redis-servers on one machine do (TIME is the system's clock): the rate server's
// TIME, read between two of the referee's, falls between them. It returns how far
// the two may differ: the referee's reads' distance, and a grain each side.
func (f *fleet) oneClock(t *testing.T) int64 {
	t.Helper()
	ctx := context.Background()
	t1, err := refNow(ctx, f.Ref)
	if err != nil {
		t.Fatal(err)
	}
	r, err := refNow(ctx, f.RateRDB)
	if err != nil {
		t.Fatal(err)
	}
	t2, err := refNow(ctx, f.Ref)
	if err != nil {
		t.Fatal(err)
	}
	if r < t1-clockGrain || r > t2+clockGrain {
		t.Fatalf("the rate Redis read %d µs between the referee's %d and %d: not one clock", r, t1, t2)
	}
	return t2 - t1 + 2*clockGrain
}

// tau is lim's tau in µs as package ratelimit computes it (limit.go): burst times
// the interval, rounded up to a whole µs.
func tau(lim ratelimit.Rate) int64 {
	us, n := micros(lim.Per), int64(lim.N)
	return int64(max(lim.Burst, 1)) * ((us + n - 1) / n)
}

// recorded reads starts:<key> from the referee, sorted by begin time.
func (f *fleet) recorded(t *testing.T, key string) []start {
	t.Helper()
	raw, err := f.Ref.LRange(context.Background(), startsKey(key), 0, -1).Result()
	if err != nil {
		t.Fatalf("referee: starts of %s: %v", key, err)
	}
	out := make([]start, 0, len(raw))
	for _, line := range raw {
		var s start
		if _, err := fmt.Sscanf(line, "%d %d %d", &s.Begin, &s.Call, &s.Worker); err != nil {
			t.Fatalf("referee: bad record %q of %s: %v", line, key, err)
		}
		out = append(out, s)
	}
	slices.SortFunc(out, func(a, b start) int { return int(a.Begin - b.Begin) })
	return out
}

// proc is a worker process.
type proc struct {
	id   int
	cmd  *exec.Cmd
	out  *syncBuffer
	done chan struct{}
	err  error // cmd.Wait's, once done is closed
}

// startWorker re-executes the test binary as a worker running spec; t.Cleanup kills
// it if it still runs and fails the test if it reported a data race.
func startWorker(t *testing.T, spec workerSpec) *proc {
	t.Helper()
	raw, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	p := &proc{id: spec.ID, out: &syncBuffer{}, done: make(chan struct{})}
	p.cmd = exec.Command(os.Args[0])
	p.cmd.Env = append(os.Environ(), workerEnv+"="+string(raw))
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.out
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("starting worker %d: %v", spec.ID, err)
	}
	go func() {
		p.err = p.cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		select {
		case <-p.done:
		default:
			_ = p.cmd.Process.Kill()
			<-p.done
		}
		if strings.Contains(p.out.String(), "DATA RACE") {
			t.Errorf("worker %d reported a data race:\n%s", spec.ID, p.out.String())
		}
	})
	return p
}

func outputs(procs []*proc) string {
	var b strings.Builder
	for _, p := range procs {
		fmt.Fprintf(&b, "\nworker %d output:\n%s", p.id, p.out.String())
	}
	return b.String()
}

// syncBuffer is a bytes buffer safe for exec's copying goroutine; it keeps the
// first 64 KiB.
type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.b.Len() < 64<<10 {
		s.b.Write(p)
	}
	return len(p), nil
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
