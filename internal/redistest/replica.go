package redistest

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// StartReplica starts a redis-server for the test, as Start does, that replicates
// master (--replicaof on 127.0.0.1), and returns once its link to the master is up,
// the master counts it, and it has acknowledged a write (it sets the master's repl-diskless-sync-delay to 0 first,
// so that the full sync starts at once), or fails the test after 10s. args are as for Start. It is
// safe to call from parallel tests.
func StartReplica(t testing.TB, master *Server, args ...string) *Server {
	t.Helper()
	mc := master.Client(t)
	ctx := context.Background()
	// The master would wait 5s (its default) for more replicas before a full sync.
	if err := mc.ConfigSet(ctx, "repl-diskless-sync-delay", "0").Err(); err != nil {
		t.Fatalf("redistest.StartReplica: %v", err)
	}
	r := Start(t, append([]string{"--replicaof", "127.0.0.1", strconv.Itoa(master.Port())}, args...)...)
	rc := r.Client(t)
	deadline := time.Now().Add(readyTimeout)
	for {
		ri, err1 := rc.Info(ctx, "replication").Result()
		mi, err2 := mc.Info(ctx, "replication").Result()
		if err1 == nil && err2 == nil && strings.Contains(ri, "master_link_status:up") &&
			strings.Contains(mi, "ip=127.0.0.1,port="+strconv.Itoa(r.Port())+",state=online") &&
			acked(ctx, mc) {
			return r
		}
		if time.Now().After(deadline) {
			t.Fatalf("redistest.StartReplica: replica %s did not link to master %s within %v", r.Addr(), master.Addr(), readyTimeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// acked reports whether a replica of mc acknowledges a write within 100ms: a replica
// the master calls online may not yet read what it streams (seen for the better part
// of a second after a full sync).
func acked(ctx context.Context, mc *redis.Client) bool {
	const key = "redistest:replica-ready"
	if mc.Set(ctx, key, "1", time.Second).Err() != nil {
		return false
	}
	n, err := mc.Wait(ctx, 1, 100*time.Millisecond).Result()
	return err == nil && n >= 1
}
