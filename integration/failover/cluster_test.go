//go:build linux

package failover

import (
	"context"
	"fmt"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
)

// clusterTopo is three masters, each with a replica; the faults hit the master of
// the first shard, which holds every key of the round.
type clusterTopo struct {
	masters, replicas []*redistest.Server
	addrs             []string
}

// startClusterTopo starts six cluster nodes, gives the first three a third of the
// slots each, makes each of the others a replica of one of them, and returns once
// every node sees the cluster ok and every master one replica online.
func startClusterTopo(t testing.TB) *clusterTopo {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), topoTimeout)
	defer cancel()
	ct := &clusterTopo{}
	var clients []*redis.Client
	for i := range 6 {
		s := redistest.Start(t, "--cluster-enabled", "yes",
			"--cluster-config-file", filepath.Join(t.TempDir(), "nodes.conf"),
			"--cluster-node-timeout", strconv.FormatInt(downAfter.Milliseconds(), 10),
			// A replica's first sync, and a returning master's, start at once rather
			// than after the default 5 s wait for more replicas.
			"--repl-diskless-sync-delay", "0")
		if i < 3 {
			ct.masters = append(ct.masters, s)
		} else {
			ct.replicas = append(ct.replicas, s)
		}
		ct.addrs = append(ct.addrs, s.Addr())
		clients = append(clients, s.Client(t))
	}
	const slots = 16384
	for i := range 3 {
		if err := clients[i].Do(ctx, "CLUSTER", "ADDSLOTSRANGE", i*slots/3, (i+1)*slots/3-1).Err(); err != nil {
			t.Fatalf("CLUSTER ADDSLOTSRANGE: %v", err)
		}
	}
	for _, s := range append(ct.masters[1:], ct.replicas...) {
		if err := clients[0].ClusterMeet(ctx, "127.0.0.1", strconv.Itoa(s.Port())).Err(); err != nil {
			t.Fatalf("CLUSTER MEET %s: %v", s.Addr(), err)
		}
	}
	waitFor(t, ctx, "every node knows the six", func() (bool, string) {
		for _, c := range clients {
			info, err := c.ClusterInfo(ctx).Result()
			if err != nil || !strings.Contains(info, "cluster_known_nodes:6\r\n") {
				return false, fmt.Sprint(info, err)
			}
		}
		return true, ""
	})
	for i := range 3 {
		id, err := clients[i].Do(ctx, "CLUSTER", "MYID").Text()
		if err != nil {
			t.Fatalf("CLUSTER MYID: %v", err)
		}
		waitFor(t, ctx, "a replica follows master "+ct.masters[i].Addr(), func() (bool, string) {
			err := clients[3+i].ClusterReplicate(ctx, id).Err()
			return err == nil, fmt.Sprint(err)
		})
	}
	waitFor(t, ctx, "the cluster is ok with a replica online per master", func() (bool, string) {
		for i, c := range clients {
			info, err := c.ClusterInfo(ctx).Result()
			if err != nil || !strings.Contains(info, "cluster_state:ok\r\n") {
				return false, fmt.Sprint(info, err)
			}
			if i < 3 {
				repl, err := c.Info(ctx, "replication").Result()
				if err != nil || strings.Count(repl, "state=online") != 1 {
					return false, fmt.Sprint(repl, err)
				}
			}
		}
		return true, ""
	})
	return ct
}

func (ct *clusterTopo) conn(tuned bool) connSpec {
	return connSpec{Kind: "cluster", Addrs: ct.addrs, Tuned: tuned}
}

// keysInFirstShard returns n keys named after prefix whose locks hash to the first
// master's slots.
func (ct *clusterTopo) keysInFirstShard(t testing.TB, prefix string, n int) []string {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: ct.addrs[0]})
	defer c.Close()
	var out []string
	for i := 0; len(out) < n && i < 1000; i++ {
		k := fmt.Sprintf("%s:%03d", prefix, i)
		slot, err := c.ClusterKeySlot(context.Background(), "{"+k+"}").Result()
		if err != nil {
			t.Fatalf("CLUSTER KEYSLOT: %v", err)
		}
		if slot < 16384/3 {
			out = append(out, k)
		}
	}
	if len(out) < n {
		t.Fatalf("only %d of 1000 keys hash to the first shard", len(out))
	}
	return out
}

// waitClusterPromoted waits until the first shard's replica says it is master.
func (ct *clusterTopo) waitPromoted(t testing.TB, ctx context.Context, ev *faultEvents) {
	t.Helper()
	waitFor(t, ctx, "the replica takes over", func() (bool, string) {
		r := role(ct.replicas[0].Addr())
		return r == "master", r
	})
	ev.set(&ev.Named)
}

// watchSlots notes when the other masters see the first shard's replica as a
// master: from then on they redirect clients there.
func (ct *clusterTopo) watchSlots(t testing.TB, ev *faultEvents) func() {
	t.Helper()
	c := ct.masters[1].Client(t)
	id, err := ct.replicas[0].Client(t).Do(context.Background(), "CLUSTER", "MYID").Text()
	if err != nil {
		t.Fatalf("CLUSTER MYID: %v", err)
	}
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			nodes, err := c.ClusterNodes(context.Background()).Result()
			if err == nil {
				for _, line := range strings.Split(nodes, "\n") {
					if f := strings.Fields(line); len(f) > 2 && f[0] == id && strings.Contains(f[2], "master") {
						ev.set(&ev.Switched)
						return
					}
				}
			}
			select {
			case <-stop:
				return
			case <-time.After(10 * time.Millisecond):
			}
		}
	}()
	return func() { close(stop); <-done }
}

// clusterFaults fail the first shard's master over.
var clusterFaults = []struct {
	name   string
	inject func(t testing.TB, ctx context.Context, ct *clusterTopo, ev *faultEvents)
}{
	{"kill", func(t testing.TB, ctx context.Context, ct *clusterTopo, ev *faultEvents) {
		signal(t, ct.masters[0], syscall.SIGKILL)
		ct.waitPromoted(t, ctx, ev)
	}},
	{"stop", func(t testing.TB, ctx context.Context, ct *clusterTopo, ev *faultEvents) {
		signal(t, ct.masters[0], syscall.SIGSTOP)
		defer signal(t, ct.masters[0], syscall.SIGCONT)
		ct.waitPromoted(t, ctx, ev)
		time.Sleep(ttl)
	}},
	{"graceful", func(t testing.TB, ctx context.Context, ct *clusterTopo, ev *faultEvents) {
		// CLUSTER FAILOVER without FORCE: the master stops its clients until the
		// replica has caught up, then the replica takes over.
		if err := ct.replicas[0].Client(t).ClusterFailover(ctx).Err(); err != nil {
			t.Fatalf("CLUSTER FAILOVER: %v", err)
		}
		ct.waitPromoted(t, ctx, ev)
	}},
}

// TestClusterFailover fails the master of a Cluster shard over while twelve workers
// in three processes take six keys of that shard, once per fault, and reports the
// same figures as TestSentinelFailover. It runs in the long mode only
// (ASYNQMUTEX_FAILOVER_LONG=1), to keep CI short.
func TestClusterFailover(t *testing.T) {
	if !long() {
		t.Skipf("the Cluster rounds run in the long mode only (%s=1)", longEnv)
	}
	rounds := count(t, "rounds per fault", 1, 8)
	for _, f := range clusterFaults {
		t.Run(f.name, func(t *testing.T) {
			c := &cell{name: "cluster/" + f.name}
			for i := range rounds {
				ct := startClusterTopo(t)
				keys := ct.keysInFirstShard(t, "c", 10)
				reload := ct.conn(true)
				reload.ReloadOnError = true
				r := runRound(t, roundConfig{
					Procs: 3, Goroutines: 4, Keys: keys[:6], Conn: ct.conn(false), OldMaster: ct.masters[0].Addr(),
					Nodes: []string{ct.masters[0].Addr(), ct.replicas[0].Addr()},
					Fault: func(t testing.TB, ctx context.Context, ev *faultEvents) {
						stop := ct.watchSlots(t, ev)
						t.Cleanup(stop)
						f.inject(t, ctx, ct, ev)
					},
					Probes:    map[string]connSpec{"default": ct.conn(false), "tuned": ct.conn(true), "tuned+reload": reload},
					ProbeKeys: map[string]string{"default": keys[6], "tuned": keys[7], "tuned+reload": keys[8], "deposed": keys[9]},
					Fresh:     ct.conn(true),
				})
				judge(t, fmt.Sprintf("cluster/%s round %d", f.name, i+1), r, claims{})
				c.rounds = append(c.rounds, r)
			}
			t.Log(c)
		})
	}
}
