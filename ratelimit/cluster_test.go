package ratelimit

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
)

// On Redis Cluster each key's limit lives on the node of its slot: keys spread over
// every master are limited, paused and listed as on one server.
func TestCluster(t *testing.T) {
	t.Parallel()
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: redistest.StartCluster(t, 3)})
	t.Cleanup(func() { rdb.Close() })
	l, ctx := New(rdb), context.Background()
	lim := PerMinute(1)
	const keys = 30
	masters := map[string]bool{}
	for i := range keys {
		key := fmt.Sprintf("tenant-%d", i)
		for j, want := range []bool{true, false} {
			r, err := l.Allow(ctx, key, lim)
			if err != nil || r.Allowed != want {
				t.Fatalf("Allow #%d of %s = %+v, %v; want allowed %v", j+1, key, r, err, want)
			}
		}
		node, err := rdb.MasterForKey(ctx, redisKey(DefaultPrefix, key))
		if err != nil {
			t.Fatal(err)
		}
		masters[node.Options().Addr] = true
	}
	if len(masters) != 3 {
		t.Fatalf("keys on %d masters, want 3: the test must reach every node", len(masters))
	}
	if _, err := l.Pause(ctx, "tenant-0", lim, time.Hour); err != nil {
		t.Fatal(err)
	}
	listed, paused := 0, 0
	for st, err := range l.List(ctx) {
		if err != nil {
			t.Fatal(err)
		}
		listed++
		if st.Paused > 59*time.Minute {
			paused++
		}
	}
	if listed != keys || paused != 1 {
		t.Errorf("List: %d keys, %d paused; want %d and 1", listed, paused, keys)
	}
}
