//go:build linux

package failover

import (
	"context"
	"fmt"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// minReplicasArgs makes a master refuse writes, lock grants included, unless at
// least one replica acknowledged the replication stream within the last second (the
// smallest lag Redis accepts).
var minReplicasArgs = []string{"--min-replicas-to-write", "1", "--min-replicas-max-lag", "1"}

// sentinelFault is one way to fail a Sentinel-managed master over.
type sentinelFault struct {
	name string
	// partition needs the proxy between the master and the rest.
	partition bool
	// extra: the long mode runs it only for the modes that list it.
	extra bool
	// closesWindow: with WaitReplicas, the fault claims that the deposed master
	// grants nothing after the promotion (claims.window).
	closesWindow bool
	inject       func(t testing.TB, ctx context.Context, st *sentinelTopo, ev *faultEvents)
}

// waitNamed waits until the first sentinel names a master other than old, and notes
// the time. The sentinel that leads a failover names the promoted replica once it
// saw it answer INFO as a master (it asks once a second), up to a second after the
// replica became one (see nodes_test.go); clients hear of it later (see
// watchSwitch).
func waitNamed(t testing.TB, ctx context.Context, st *sentinelTopo, old string, ev *faultEvents) {
	t.Helper()
	c := sentinelClient(t, st.sentinels[0])
	waitFor(t, ctx, "the sentinels name a new master", func() (bool, string) {
		a := st.masterAddr(ctx, c)
		return a != "" && a != old, a
	})
	ev.set(&ev.Named)
}

// failover asks the first sentinel for a failover (SENTINEL FAILOVER): it leads it,
// with no vote.
func failover(t testing.TB, ctx context.Context, st *sentinelTopo) {
	t.Helper()
	if err := sentinelClient(t, st.sentinels[0]).Failover(ctx, masterName).Err(); err != nil {
		t.Fatalf("SENTINEL FAILOVER: %v", err)
	}
}

// pauseFor is how long the "paused" fault pauses writes on the master before it
// asks for the failover: past the time the other replica follows the old master
// after the promotion (up to the 1 s in which the leading sentinel looks at the
// promoted replica again, and its reconfiguration of the other one), with margin.
const pauseFor = 3 * time.Second

// watchSwitch notes when any sentinel publishes +switch-master, which is what a
// go-redis failover client listens for: it publishes it at the end of the failover,
// once the other replicas follow the new master. It returns a func that stops
// watching.
func watchSwitch(t testing.TB, st *sentinelTopo, ev *faultEvents) func() {
	t.Helper()
	var subs []*redis.PubSub
	for _, addr := range st.sentinels {
		ps := sentinelClient(t, addr).Subscribe(context.Background(), "+switch-master")
		if _, err := ps.Receive(context.Background()); err != nil {
			t.Fatalf("subscribing to +switch-master on %s: %v", addr, err)
		}
		subs = append(subs, ps)
		go func() {
			for range ps.Channel() {
				ev.set(&ev.Switched)
			}
		}()
	}
	return func() {
		for _, ps := range subs {
			_ = ps.Close()
		}
	}
}

// The faults. A stopped or partitioned master comes back one lease after the
// sentinels named its successor, so that holders, waiters and clients that still
// talk to it meet it again as a deposed master.
var sentinelFaults = []sentinelFault{
	{name: "kill", inject: func(t testing.TB, ctx context.Context, st *sentinelTopo, ev *faultEvents) {
		signal(t, st.master, syscall.SIGKILL)
		waitNamed(t, ctx, st, st.master.Addr(), ev)
	}},
	{name: "stop", inject: func(t testing.TB, ctx context.Context, st *sentinelTopo, ev *faultEvents) {
		signal(t, st.master, syscall.SIGSTOP)
		defer signal(t, st.master, syscall.SIGCONT)
		waitNamed(t, ctx, st, st.master.Addr(), ev)
		time.Sleep(ttl)
	}},
	{name: "graceful", inject: func(t testing.TB, ctx context.Context, st *sentinelTopo, ev *faultEvents) {
		failover(t, ctx, st)
		waitNamed(t, ctx, st, st.master.Addr(), ev)
	}},
	{name: "partition", partition: true, inject: func(t testing.TB, ctx context.Context, st *sentinelTopo, ev *faultEvents) {
		st.proxy.Blackhole(true)
		defer st.proxy.Blackhole(false)
		waitNamed(t, ctx, st, st.proxy.Addr(), ev)
		time.Sleep(ttl)
	}},
	// A planned failover run as a procedure: CLIENT PAUSE WRITE on the master for
	// longer than the window, then SENTINEL FAILOVER. Paused, the master runs no
	// script (every lock script may write) and so grants and renews nothing; when
	// the pause ends the other replica has left it, so that a WAIT there is not
	// confirmed (with WaitReplicas, its grants are given back). Meanwhile the replica
	// promoted had every write of the old master.
	{name: "paused", extra: true, closesWindow: true, inject: func(t testing.TB, ctx context.Context, st *sentinelTopo, ev *faultEvents) {
		if err := st.master.Client(t).Do(ctx, "CLIENT", "PAUSE", pauseFor.Milliseconds(), "WRITE").Err(); err != nil {
			t.Fatalf("CLIENT PAUSE: %v", err)
		}
		failover(t, ctx, st)
		waitNamed(t, ctx, st, st.master.Addr(), ev)
	}},
}

// sentinelMode is a server configuration the battery measures.
type sentinelMode struct {
	name string
	args []string
	// sentinel are SENTINEL DEBUG parameters and values set on every sentinel.
	sentinel []string
	// claims fail the test when broken. No mode claims safety: asynchronous
	// replication loses grants in every one (README, F2).
	claims claims
	// ci lists the faults run in the default mode; the long mode runs every fault
	// that is not extra, or those that long lists.
	ci   map[string]bool
	long []string
	// waitReplicas is the workers' and probes' mutex.WaitReplicas (0: none).
	waitReplicas int
	// load is the workers' shape; zero: shortSections.
	load workload
}

// runs reports whether the mode runs fault f in this mode of the battery.
func (m sentinelMode) runs(f sentinelFault) bool {
	switch {
	case !long():
		return m.ci[f.name]
	case m.long != nil:
		return slices.Contains(m.long, f.name)
	}
	return !f.extra
}

// workload is how the workers use the lock.
type workload struct {
	Procs, Goroutines, Keys int
	Hold                    [2]time.Duration // a section's hold; zero: 1-3 ms
}

var (
	// shortSections: twelve workers in three processes on six keys, sections of a
	// few milliseconds, far shorter than a renewal's period.
	shortSections = workload{Procs: 3, Goroutines: 4, Keys: 6}
	// longHolds: sixteen workers in two processes on eight keys, holding a lock
	// 0.3-4 s, so that holders renew (every TTL/3) across the failover, each process
	// following another sentinel (one of them the sentinel that leads the
	// failover).
	longHolds = workload{Procs: 2, Goroutines: 8, Keys: 8, Hold: [2]time.Duration{300 * time.Millisecond, 4 * time.Second}}
)

// syncDelay0 serves a replica's full sync at once.
var syncDelay0 = []string{"--repl-diskless-sync-delay", "0"}

var sentinelModes = []sentinelMode{
	{name: "async", ci: map[string]bool{"kill": true, "stop": true, "graceful": true, "partition": true}},
	// The same full sync holds back the end of a failover, when the sentinel that
	// led it tells its clients (+switch-master).
	{name: "async-sync-delay-0", args: []string{"--repl-diskless-sync-delay", "0"}},
	{name: "min-replicas-1", args: minReplicasArgs, ci: map[string]bool{"partition": true}},
	// A replica that cannot continue from the new master's stream (it took writes of
	// the deposed master) syncs in full, which waits repl-diskless-sync-delay (5 s by
	// default) for other replicas to join; until then a master with
	// min-replicas-to-write 1 refuses every grant.
	{name: "min-replicas-1-sync-delay-0", args: append(slices.Clone(minReplicasArgs), "--repl-diskless-sync-delay", "0"),
		ci: map[string]bool{"graceful": true}},
	// Redis counts a replica's lag in whole seconds since its last acknowledgement,
	// sent every second, so a lag of 1 is near the edge; 2 is the next step.
	// Every grant and renewal waits for one replica (mutex.WaitReplicas(1, 250ms)).
	{name: "wait-1", waitReplicas: 1},
	{name: "wait-1-sync-delay-0", args: syncDelay0, waitReplicas: 1},
	{name: "min-replicas-1-lag-2-sync-delay-0", args: []string{"--min-replicas-to-write", "1", "--min-replicas-max-lag", "2",
		"--repl-diskless-sync-delay", "0"}},
	// Long holds, so that renewals as well as grants fall in the window (see
	// nodes_test.go): without a wait, waiting for one replica, and for both.
	{name: "async-holds", args: syncDelay0, load: longHolds, long: []string{"graceful"}},
	{name: "wait-1-holds", args: syncDelay0, waitReplicas: 1, load: longHolds, long: []string{"graceful", "paused"}},
	// With two replicas, WAIT 2 is confirmed only while both follow the master that
	// wrote: never on a deposed master after the promotion (one of its two replicas
	// was promoted), and on the new master only once the deposed one follows it,
	// which the sentinels order (+convert-to-slave) 4 publish periods after they
	// first saw it answer as a master, at their next INFO (every 10 s).
	{name: "wait-2-holds", args: syncDelay0, waitReplicas: 2, load: longHolds, long: []string{"graceful"},
		claims: claims{window: true}},
	{name: "wait-2-holds-sentinel-debug", args: syncDelay0, sentinel: sentinelDebug, waitReplicas: 2, load: longHolds,
		long: []string{"graceful"}, claims: claims{window: true}},
}

// sentinelDebug shortens the sentinels' wait before they turn a deposed master into
// a replica: INFO every second rather than 10, and hello messages every 500 ms
// rather than 2 s (the wait is four of them).
var sentinelDebug = []string{"info-period", "1000", "publish-period", "500"}

// sentinelRound starts a fresh deployment and runs one failover of fault on it.
func sentinelRound(t *testing.T, mode sentinelMode, f sentinelFault, control func(*roundConfig, *sentinelTopo)) roundResult {
	t.Helper()
	st := startSentinelTopo(t, sentinelConfig{ServerArgs: mode.args, ViaProxy: f.partition, Debug: mode.sentinel})
	load := mode.load
	if load.Procs == 0 {
		load = shortSections
	}
	cfg := roundConfig{
		Procs: load.Procs, Goroutines: load.Goroutines, Keys: keys("k", load.Keys), Hold: load.Hold,
		Conn: st.conn(false), OldMaster: st.master.Addr(), Nodes: st.nodes(),
		Fault: func(t testing.TB, ctx context.Context, ev *faultEvents) {
			t.Cleanup(watchSwitch(t, st, ev))
			f.inject(t, ctx, st, ev)
		},
		Probes: map[string]connSpec{"default": st.conn(false), "tuned": st.conn(true)},
		Fresh:  st.conn(true),
	}
	if f.partition {
		cfg.Stranded = st.master.Addr()
		cfg.OldAliases = []string{st.proxy.Addr()}
	}
	if mode.waitReplicas > 0 {
		cfg.Conn.WaitReplicas = mode.waitReplicas
		for n, p := range cfg.Probes {
			p.WaitReplicas = mode.waitReplicas
			cfg.Probes[n] = p
		}
	}
	if control != nil {
		control(&cfg, st)
	}
	return runRound(t, cfg)
}

func keys(prefix string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s:%02d", prefix, i)
	}
	return out
}

// TestSentinelFailover fails a Sentinel-managed master over while twelve workers in
// three processes take six keys, once per fault and server configuration, and
// reports per fault the overlaps, lost updates, stale fenced writes and the time
// until locking works again. Fences must rise across every failover and no overlap
// may happen before the fault; overlaps after it are figures, since no
// configuration here claims to prevent them.
func TestSentinelFailover(t *testing.T) {
	rounds := count(t, "rounds per fault", 1, 8)
	for _, mode := range sentinelModes {
		for _, f := range sentinelFaults {
			if !mode.runs(f) {
				continue
			}
			name := mode.name + "/" + f.name
			cl := mode.claims
			cl.window = cl.window || (f.closesWindow && mode.waitReplicas > 0)
			t.Run(name, func(t *testing.T) {
				c := &cell{name: name}
				for i := range rounds {
					r := sentinelRound(t, mode, f, nil)
					judge(t, fmt.Sprintf("%s round %d", name, i+1), r, cl)
					c.rounds = append(c.rounds, r)
				}
				t.Log(c)
			})
		}
	}
}
