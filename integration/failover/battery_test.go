//go:build linux

package failover

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/asynqmutex/asynqmutex/mutex"
)

// longEnv, set to 1, runs the full counts; by default they are scaled down for CI.
const longEnv = "ASYNQMUTEX_FAILOVER_LONG"

func long() bool { return os.Getenv(longEnv) == "1" }

// roundsEnv, set to a number, overrides the rounds per fault of either mode, to
// repeat one cell (go test -run) without running the long mode's every round.
const roundsEnv = "ASYNQMUTEX_FAILOVER_ROUNDS"

// count returns def, or full in long mode, or the number in roundsEnv, and says which
// in the test output.
func count(t testing.TB, what string, def, full int) int {
	t.Helper()
	if n, err := strconv.Atoi(os.Getenv(roundsEnv)); err == nil && n > 0 {
		t.Logf("%s: %d (%s)", what, n, roundsEnv)
		return n
	}
	if long() {
		t.Logf("%s: %d (long mode)", what, full)
		return full
	}
	t.Logf("%s: %d (default mode, scaled down; %s=1 runs %d)", what, def, longEnv, full)
	return def
}

// ttl is the workers' lease. A failover takes a few times downAfter; the lease is
// long enough that a holder's renewals (every ttl/3) straddle it.
const ttl = 2 * time.Second

// roundConfig is one failover: the workers, the fault, and what the mode claims.
type roundConfig struct {
	Procs, Goroutines int
	Keys              []string
	Conn              connSpec // how the workers reach the deployment
	// Stranded, if set, adds a worker process connected straight to this address (the
	// old master): an application server on the master's side of a partition.
	Stranded string
	// RewindFences makes one worker a broken lock (a positive control).
	RewindFences bool
	// Fault injects the failover; it returns when the fault is over (a stopped
	// server continued, a partition healed) and reports the times it saw.
	Fault func(t testing.TB, ctx context.Context, ev *faultEvents)
	// OldMaster is the address of the master the fault hits; OldAliases are other
	// names the replicas may follow it by (the proxy of a partition). A probe
	// connected to it directly takes a key of its own all round (ProbeKeys["deposed"],
	// or "probe:deposed"), with the workers' WaitReplicas: its grants after the
	// promotion are the deposed master's.
	OldMaster  string
	OldAliases []string
	// Nodes are every redis-server of the group (the old master and its replicas),
	// whose ROLE the node monitor samples.
	Nodes []string
	// Hold is how long a section holds the lock, drawn between the two (zero: 1-3 ms).
	Hold [2]time.Duration
	// Probes reach the deployment as the workers do, with and without the tuned
	// options, to time how long locking is unavailable.
	Probes map[string]connSpec
	// ProbeKeys are the probes' keys; "probe:<name>" by default.
	ProbeKeys map[string]string
	// PreFault, if set, runs just before the fault, in the fault-free window (a
	// nemesis of a positive control).
	PreFault func(t testing.TB)
	// Fresh is how to reach the deployment as it is after the failover, for the
	// final check that every key's fence rose.
	Fresh connSpec
}

// faultEvents are the times (now() values) a fault reports; 0 when not seen.
type faultEvents struct {
	mu       sync.Mutex
	Named    int64 // the deployment named a new master (a sentinel's get-master-addr, a replica's ROLE)
	Switched int64 // clients were told: Sentinel's +switch-master, the cluster's slots moved
}

func (e *faultEvents) set(p *int64) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if *p == 0 {
		*p = now()
	}
}

func (e *faultEvents) get(p *int64) int64 {
	e.mu.Lock()
	defer e.mu.Unlock()
	return *p
}

// roundResult is what the checkers saw in one round.
type roundResult struct {
	Tally           tally
	PreFaultOverlap int      // overlaps among sections entered before the fault
	FenceViolations []string // grants after the failover whose fence was not above every fence before it
	KeysChecked     int      // keys with grants both before and after the failover
	Sections        int
	LeasesLost      int
	Errors          map[errKind]int
	StrandedGrants  int                      // grants to the stranded worker after a new master was named
	DeposedGrants   int                      // grants to the deposed probe that began after the promotion (ROLE)
	DeposedLate     int                      // of those, grants that began after the other replicas had left the old master
	Waited          bool                     // the clients wait for replicas (WaitReplicas)
	Named           time.Duration            // fault -> a new master named (a sentinel's get-master-addr)
	Promoted        time.Duration            // fault -> the promoted replica's ROLE says master (-1: not seen)
	Left            time.Duration            // fault -> no other replica streams from the old master (-1: not seen)
	Window          time.Duration            // Promoted -> Left (-1: not seen)
	Switch          time.Duration            // fault -> clients told
	Demote          time.Duration            // fault -> the old master no longer says it is master (-1: still master at the end)
	Alone           time.Duration            // fault -> the old master's ROLE lists no replica (-1: not seen)
	Recovery        map[string]time.Duration // per probe: fault -> first grant after the longest gap
	Outage          map[string]time.Duration // per probe: the longest gap between two grants
	Elapsed         time.Duration
}

// runRound runs one failover with cfg: workers start and take locks for a lease's
// time, the fault hits, and they go on until clients were told of the new master and
// it has served them for two leases; then the checkers are read.
func runRound(t *testing.T, cfg roundConfig) roundResult {
	t.Helper()
	start := now()
	ref, refAddr := startReferee(t)
	var workers []*worker
	spec := func(id int, conn connSpec) workerSpec {
		return workerSpec{ID: id, Conn: conn, RefereeAddr: refAddr, Keys: cfg.Keys, TTL: ttl, Hold: cfg.Hold,
			Goroutines: cfg.Goroutines, MaxSections: 100_000, Lifetime: 2 * time.Minute}
	}
	for i := range cfg.Procs {
		s := spec(i+1, cfg.Conn)
		if cfg.Conn.Kind == "sentinel" {
			// Each process asks the sentinels in its own order, as independently
			// configured servers would.
			s.Conn.Addrs = append(slices.Clone(cfg.Conn.Addrs[i%len(cfg.Conn.Addrs):]), cfg.Conn.Addrs[:i%len(cfg.Conn.Addrs)]...)
		}
		s.RewindFences = cfg.RewindFences && i == 0
		workers = append(workers, startWorker(t, s))
	}
	strandedID := 0
	if cfg.Stranded != "" {
		strandedID = cfg.Procs + 1
		workers = append(workers, startWorker(t, spec(strandedID, connSpec{Kind: "direct", Addrs: []string{cfg.Stranded}, WaitReplicas: cfg.Conn.WaitReplicas})))
	}
	probes := startProbes(t, cfg.Probes, cfg.ProbeKeys)
	direct := map[string]connSpec{}
	if cfg.OldMaster != "" {
		direct["deposed"] = connSpec{Kind: "direct", Addrs: []string{cfg.OldMaster}, WaitReplicas: cfg.Conn.WaitReplicas}
	}
	deposed := startProbes(t, direct, cfg.ProbeKeys)
	stopNodes := watchNodes(cfg.Nodes)
	defer stopNodes() // when the round fails before it reads them
	// Let every worker take locks for a lease's time before the fault (a fault-free
	// window in which the lock claims mutual exclusion), then fail the master over.
	time.Sleep(ttl)
	if cfg.PreFault != nil {
		cfg.PreFault(t)
	}
	ctx, cancel := context.WithTimeout(context.Background(), topoTimeout)
	defer cancel()
	var ev faultEvents
	faultAt := now()
	cfg.Fault(t, ctx, &ev)
	waitFor(t, ctx, "clients are told of the new master", func() (bool, string) { return ev.get(&ev.Switched) != 0, "" })
	// Run on until every probe took its key again, and then for two leases, in which
	// holders of the old master's grants and renewals meet the new master's.
	if !probes.waitOK(ctx, ev.get(&ev.Switched)) {
		t.Errorf("a probe took no lock within %v of the fault", topoTimeout)
	}
	time.Sleep(2 * ttl)

	if err := ref.rdb.Set(context.Background(), stopKey, 1, 0).Err(); err != nil {
		t.Fatalf("referee: %v", err)
	}
	var attempts []attempt
	for _, w := range workers {
		attempts = append(attempts, w.wait(t, time.Minute).Attempts...)
	}
	probeRuns := probes.stop()
	deposedRuns := deposed.stop()["deposed"]
	nt := readNodes(stopNodes(), cfg.OldMaster, cfg.OldAliases, faultAt)

	res := roundResult{Tally: ref.tally(t, cfg.Keys), Errors: map[errKind]int{},
		Recovery: map[string]time.Duration{}, Outage: map[string]time.Duration{}}
	since := func(at int64) time.Duration {
		if at == 0 {
			return -1
		}
		return time.Duration(at - faultAt)
	}
	named := ev.get(&ev.Named)
	res.Named, res.Switch = since(named), since(ev.get(&ev.Switched))
	res.Promoted, res.Left, res.Demote, res.Alone = since(nt.Promoted), since(nt.Left), since(nt.Demoted), since(nt.Alone)
	res.Window = nt.window()
	for _, r := range deposedRuns {
		if r.Granted && nt.Promoted != 0 && r.Start > nt.Promoted {
			res.DeposedGrants++
			if nt.Left != 0 && r.Start > nt.Left {
				res.DeposedLate++
			}
		}
	}
	res.Waited = cfg.Conn.WaitReplicas > 0
	before := map[string]int64{} // the highest fence granted before the fault, per key
	for _, a := range attempts {
		if a.Kind != kindOK {
			res.Errors[a.Kind]++
		}
		if a.LostAt != 0 {
			res.LeasesLost++
		}
		if !a.ran() {
			continue
		}
		res.Sections++
		if a.Section.Overlap && a.Section.Entered < faultAt {
			res.PreFaultOverlap++
		}
		if a.Worker == strandedID && named != 0 && a.Acquired > named {
			res.StrandedGrants++
		}
		if a.Acquired < faultAt {
			before[a.Key] = max(before[a.Key], a.Fence)
		}
	}
	res.FenceViolations, res.KeysChecked = fencesRose(attempts, faultAt, before)
	res.FenceViolations = append(res.FenceViolations, finalFences(t, cfg.Fresh, before)...)
	for name, runs := range probeRuns {
		res.Recovery[name], res.Outage[name] = recovery(runs, faultAt)
	}
	res.Elapsed = time.Duration(now() - start)
	return res
}

// fencesRose checks that every grant after the fault, by whichever server, carries a
// fence above every fence of its key granted before the fault: fences follow the
// server clock, which every server of the deployment shares here. It returns the
// violations and on how many keys the check had grants on both sides.
func fencesRose(attempts []attempt, faultAt int64, before map[string]int64) ([]string, int) {
	var bad []string
	checked := map[string]bool{}
	for _, a := range attempts {
		if !a.ran() || a.Acquired <= faultAt {
			continue
		}
		b, ok := before[a.Key]
		if !ok {
			continue
		}
		checked[a.Key] = true
		if a.Fence <= b {
			bad = append(bad, fmt.Sprintf("%s: worker %d was granted fence %d after the fault, not above %d granted before it",
				a.Key, a.Worker, a.Fence, b))
		}
	}
	return bad, len(checked)
}

// finalFences takes every key once more through a client made after the failover and
// reports each whose fence is not above the highest granted before the fault.
func finalFences(t testing.TB, conn connSpec, before map[string]int64) []string {
	t.Helper()
	rdb := newRedis(conn)
	defer rdb.Close()
	locks := mutex.New(rdb)
	defer locks.Close()
	var bad []string
	keys := make([]string, 0, len(before))
	for k := range before {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		l, err := lockAgain(locks, k)
		if err != nil {
			t.Fatalf("taking %s after the failover: %v", k, err)
		}
		if l.Fence() <= before[k] {
			bad = append(bad, fmt.Sprintf("%s: fence %d after the failover, not above %d before it", k, l.Fence(), before[k]))
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		_ = l.Unlock(ctx)
		cancel()
	}
	return bad
}

// lockAgain takes key, trying again for up to topoTimeout while the deployment
// answers with an error: a master with min-replicas-to-write refuses every grant
// until a replica has acknowledged it recently, which the probes time; this check is
// about fences.
func lockAgain(locks *mutex.Client, key string) (*mutex.Lock, error) {
	deadline := time.Now().Add(topoTimeout)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		l, err := locks.Lock(ctx, key, ttl, mutex.MaxWait(2*ttl))
		cancel()
		if err == nil || errors.Is(err, mutex.ErrNotObtained) || time.Now().After(deadline) {
			return l, err
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// probeRun is one TryLock + Unlock of a probe.
type probeRun struct {
	Start, End int64
	Granted    bool // TryLock took the key
	OK         bool // and Unlock gave it back
}

type probes struct {
	cancel context.CancelFunc
	wg     sync.WaitGroup
	mu     sync.Mutex
	runs   map[string][]probeRun
	names  map[string]bool
}

// probeEvery is the pause between two probe runs; probeTimeout bounds one run, well
// above the default options' own timeouts so that they, not the probe, decide.
const (
	probeEvery   = 20 * time.Millisecond
	probeTimeout = 15 * time.Second
)

// startProbes runs, per named connection, a loop that takes and releases a key of its
// own (keys[name], or "probe:<name>") until stop.
func startProbes(t testing.TB, conns map[string]connSpec, keys map[string]string) *probes {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	p := &probes{cancel: cancel, runs: map[string][]probeRun{}, names: map[string]bool{}}
	t.Cleanup(func() { p.stop() }) // when the round fails before it stops them
	for name, conn := range conns {
		p.names[name] = true
		rdb := newRedis(conn)
		locks := newLocks(conn, rdb)
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			defer rdb.Close()
			defer locks.Close()
			key := keys[name]
			if key == "" {
				key = "probe:" + name
			}
			for ctx.Err() == nil {
				r := probeRun{Start: now()}
				pctx, pcancel := context.WithTimeout(ctx, probeTimeout)
				l, err := locks.TryLock(pctx, key, ttl)
				if err == nil {
					r.Granted = true
					err = l.Unlock(pctx)
				}
				pcancel()
				r.End, r.OK = now(), err == nil
				if ctx.Err() != nil {
					return // cut short by stop: not a failure of the deployment
				}
				p.mu.Lock()
				p.runs[name] = append(p.runs[name], r)
				p.mu.Unlock()
				select {
				case <-ctx.Done():
				case <-time.After(probeEvery):
				}
			}
		}()
	}
	return p
}

// waitOK waits until every probe has finished a successful run that started after
// since, and reports whether they all did before ctx ended.
func (p *probes) waitOK(ctx context.Context, since int64) bool {
	for {
		p.mu.Lock()
		all := true
		for name := range p.names {
			ok := false
			for _, r := range p.runs[name] {
				ok = ok || (r.OK && r.Start > since)
			}
			all = all && ok
		}
		p.mu.Unlock()
		if all {
			return true
		}
		select {
		case <-ctx.Done():
			return false
		case <-time.After(10 * time.Millisecond):
		}
	}
}

func (p *probes) stop() map[string][]probeRun {
	p.cancel()
	p.wg.Wait()
	return p.runs
}

// recovery reads a probe's runs: the longest time between the ends of two
// successful runs that spans or follows the fault (a run that failed or stalled
// makes the gap), and the time from the fault to the end of the run that closed it.
// It returns -1 for the recovery when no run succeeded after the fault.
func recovery(runs []probeRun, faultAt int64) (time.Duration, time.Duration) {
	prev := int64(0)
	var gapEnd, longest int64
	for _, r := range runs {
		if !r.OK {
			continue
		}
		if r.End > faultAt && prev != 0 && r.End-prev > longest {
			longest, gapEnd = r.End-prev, r.End
		}
		prev = r.End
	}
	if prev <= faultAt {
		return -1, time.Duration(longest)
	}
	return time.Duration(gapEnd - faultAt), time.Duration(longest)
}

// cell gathers the rounds of one fault in one mode.
type cell struct {
	name   string
	rounds []roundResult
}

func (c *cell) String() string {
	var tl tally
	var lost, strand, deposed, roundsWith, unconfirmed int
	var named, promoted, left, window, sw, demote, alone []time.Duration
	rec, out := map[string][]time.Duration{}, map[string][]time.Duration{}
	for _, r := range c.rounds {
		tl.Overlaps += r.Tally.Overlaps
		tl.Lost += r.Tally.Lost
		tl.Stale += r.Tally.Stale
		tl.Accepted += r.Tally.Accepted
		tl.Completed += r.Tally.Completed
		lost += r.LeasesLost
		unconfirmed += r.Errors[kindUnconfirmed]
		strand += r.StrandedGrants
		deposed += r.DeposedGrants
		if r.Tally.Overlaps > 0 {
			roundsWith++
		}
		named, promoted, left, window = append(named, r.Named), append(promoted, r.Promoted), append(left, r.Left), append(window, r.Window)
		sw, demote, alone = append(sw, r.Switch), append(demote, r.Demote), append(alone, r.Alone)
		for n, d := range r.Recovery {
			rec[n] = append(rec[n], d)
		}
		for n, d := range r.Outage {
			out[n] = append(out[n], d)
		}
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%s: %d rounds; %v; overlaps in %d rounds; leases lost %d; stranded grants %d; deposed master's grants after the promotion %d; "+
		"after the fault: promoted replica's ROLE master %s, other replicas left the old master %s (window %s), new master named %s, clients told %s, old master's ROLE lists no replica %s, old master demoted %s",
		c.name, len(c.rounds), tl, roundsWith, lost, strand, deposed,
		span(promoted), span(left), span(window), span(named), span(sw), span(alone), span(demote))
	if unconfirmed > 0 {
		fmt.Fprintf(&b, "; grants the replicas did not confirm %d", unconfirmed)
	}
	names := make([]string, 0, len(rec))
	for n := range rec {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		fmt.Fprintf(&b, "; %s client: longest gap without a grant %s, closed %s after the fault", n, span(out[n]), span(rec[n]))
	}
	return b.String()
}

// span is "a-b s" over durations (a single value when they agree).
func span(ds []time.Duration) string {
	if len(ds) == 0 {
		return "-"
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	f := func(d time.Duration) string {
		if d < 0 {
			return "never"
		}
		return fmt.Sprintf("%.2f", d.Seconds())
	}
	if s[len(s)-1] < 0 {
		return "not within the round"
	}
	if f(s[0]) == f(s[len(s)-1]) {
		return f(s[0]) + " s"
	}
	return f(s[0]) + "-" + f(s[len(s)-1]) + " s"
}

// judge fails the test on what no mode tolerates: an overlap while nothing was
// faulted, a fence that did not rise across the failover, locking that never came
// back; and on what the mode claims to prevent (overlaps and lost updates, or the
// deposed master's grants).
// Otherwise overlaps, lost updates and stale writes are figures.
func judge(t *testing.T, name string, r roundResult, claims claims) {
	t.Helper()
	ms := func(d time.Duration) string {
		if d < 0 {
			return "not within the round"
		}
		return d.Round(time.Millisecond).String()
	}
	t.Logf("%s: %d sections, errors %v, leases lost %d; %v; stranded grants %d; deposed master's grants after the promotion %d; "+
		"after the fault: promoted replica's ROLE master %v, other replicas left the old master %v (window %v), new master named %v, clients told %v, old master's ROLE lists no replica %v, old master demoted %v; "+
		"longest gap without a grant %v, closed %v after the fault; fences compared on %d keys; round %v",
		name, r.Sections, r.Errors, r.LeasesLost, r.Tally, r.StrandedGrants, r.DeposedGrants,
		ms(r.Promoted), ms(r.Left), ms(r.Window), ms(r.Named), ms(r.Switch), ms(r.Alone), ms(r.Demote),
		r.Outage, r.Recovery, r.KeysChecked, ms(r.Elapsed))
	if r.Sections == 0 {
		t.Errorf("%s: no section ran", name)
	}
	if r.PreFaultOverlap > 0 {
		t.Errorf("%s: %d overlaps before the fault, with every server healthy", name, r.PreFaultOverlap)
	}
	for _, v := range r.FenceViolations {
		t.Errorf("%s: fences did not rise across the failover: %s", name, v)
	}
	for n, d := range r.Recovery {
		if d < 0 {
			t.Errorf("%s: locking through the %s client never worked again after the fault", name, n)
		}
	}
	if claims.safety && (r.Tally.Overlaps > 0 || r.Tally.Lost > 0) {
		t.Errorf("%s: %d overlaps and %d lost updates in a mode that claims to prevent them", name, r.Tally.Overlaps, r.Tally.Lost)
	}
	if r.Waited && r.DeposedLate > 0 {
		// With WaitReplicas every grant is confirmed by a replica: one that began after
		// the node monitor saw the last replica leave the deposed master means the
		// monitor missed a replica that still followed it.
		t.Errorf("%s: the deposed master granted %d confirmed locks after its replicas had left it, by the node monitor: the window it measures is too short",
			name, r.DeposedLate)
	}
	if claims.window && r.DeposedGrants > 0 {
		t.Errorf("%s: the deposed master granted %d locks after the promotion, in a mode that claims to close the window", name, r.DeposedGrants)
	}
}

// claims are what a mode says it prevents; what it does not claim is a figure.
type claims struct {
	// safety: no overlap, no lost update after the fault.
	safety bool
	// window: no lock granted by the deposed master after the promotion, to the probe
	// that talks to it directly (with WaitReplicas: granted and confirmed).
	window bool
}
