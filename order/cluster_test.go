package order

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
)

// On Redis Cluster each key's sequence lives on the node of its slot, and its channel
// reaches the waiters wherever they subscribed: keys spread over every master keep
// their order and wake their waiters as on one server.
func TestCluster(t *testing.T) {
	t.Parallel()
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: redistest.StartCluster(t, 3)})
	t.Cleanup(func() { rdb.Close() })
	s, ctx := New(rdb), context.Background()
	const keys = 12
	masters := map[string]bool{}
	for i := range keys {
		key := fmt.Sprintf("account-%d", i)
		p1, err := s.Take(ctx, key, "default", "a")
		if err != nil {
			t.Fatal(err)
		}
		p2, err := s.Take(ctx, key, "default", "b")
		if err != nil || p2.N != 2 {
			t.Fatalf("Take(b) = %+v, %v; want place 2", p2, err)
		}
		got := make(chan Turn, 1)
		go func() {
			turn, err := s.Await(ctx, key, p2, time.Minute)
			if err != nil {
				t.Errorf("Await: %v", err)
			}
			got <- turn
		}()
		time.Sleep(20 * time.Millisecond) // let it subscribe; its answer does not depend on it
		if n, err := s.Finish(ctx, key, p1, Done); err != nil || n != 2 {
			t.Fatalf("Finish(1) of %s = %d, %v; want next 2", key, n, err)
		}
		select {
		case turn := <-got:
			if turn.State != TurnNow {
				t.Fatalf("Await of %s = %+v, want its turn", key, turn)
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("Await of %s was not woken", key)
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
}
