package redistest

import (
	"context"
	"fmt"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// clusterTimeout bounds how long StartCluster waits for every node to report
// cluster_state:ok. Joining takes a few gossip rounds (about a second each).
const clusterTimeout = 20 * time.Second

// StartCluster starts n redis-server masters with cluster mode on, each on its own
// free 127.0.0.1 port as Start starts them, gives each an equal share of the 16384
// hash slots, joins them, and returns their addresses once every node reports
// cluster_state:ok and knows all n nodes. The servers are stopped in t.Cleanup.
//
// It skips or fails the test as Start does when no redis-server is installed, and
// fails it if n < 1 or the cluster is not ready within 20s. It is safe to call
// from parallel tests: every cluster has its own processes and ports.
func StartCluster(t testing.TB, n int) []string {
	t.Helper()
	if n < 1 {
		t.Fatalf("redistest.StartCluster: %d nodes, want at least 1", n)
	}
	ctx, cancel := context.WithTimeout(context.Background(), clusterTimeout)
	defer cancel()
	const slots = 16384
	nodes := make([]*Server, n)
	clients := make([]*redis.Client, n)
	addrs := make([]string, n)
	for i := range nodes {
		s := Start(t, "--cluster-enabled", "yes",
			"--cluster-config-file", filepath.Join(t.TempDir(), "nodes.conf"),
			"--cluster-node-timeout", "5000")
		nodes[i], clients[i], addrs[i] = s, s.Client(t), s.Addr()
		first, last := i*slots/n, (i+1)*slots/n-1
		if err := clients[i].Do(ctx, "CLUSTER", "ADDSLOTSRANGE", first, last).Err(); err != nil {
			t.Fatalf("redistest.StartCluster: CLUSTER ADDSLOTSRANGE %d %d on %s: %v", first, last, s.Addr(), err)
		}
	}
	for _, s := range nodes[1:] {
		if err := clients[0].ClusterMeet(ctx, "127.0.0.1", strconv.Itoa(s.Port())).Err(); err != nil {
			t.Fatalf("redistest.StartCluster: CLUSTER MEET %s: %v", s.Addr(), err)
		}
	}
	want := "cluster_known_nodes:" + strconv.Itoa(n) + "\r\n"
	var last string
	for ctx.Err() == nil {
		ready := true
		for i, c := range clients {
			info, err := c.ClusterInfo(ctx).Result()
			if err != nil {
				ready, last = false, fmt.Sprintf("%s: CLUSTER INFO: %v", addrs[i], err)
				break
			}
			if !strings.Contains(info, "cluster_state:ok\r\n") || !strings.Contains(info, want) {
				ready, last = false, fmt.Sprintf("%s: %s", addrs[i], strings.ReplaceAll(info, "\r\n", " "))
				break
			}
		}
		if ready {
			return addrs
		}
		select {
		case <-ctx.Done():
		case <-time.After(20 * time.Millisecond):
		}
	}
	t.Fatalf("redistest.StartCluster: cluster of %d not ready within %v; last seen: %s", n, clusterTimeout, last)
	return nil
}
