package store

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
)

func TestRunWait(t *testing.T) {
	master := redistest.Start(t)
	replica := redistest.StartReplica(t, master)
	admin, rc := master.Client(t), replica.Client(t)
	ctx := context.Background()
	want := Replicas{N: 1, Timeout: time.Second}
	// waits is how many WAITs go: one per sending of the pipeline (a fallback sends it
	// again, and the WAIT after a call that failed answers at once).
	check := func(t *testing.T, r *Runner, key string, waits int64) {
		t.Helper()
		before := readStats(t, admin)
		cmd, w := r.RunWait(ctx, testSet, want, []string{key}, key)
		got, err := cmd.Text()
		require.NoError(t, err)
		assert.Equal(t, "hello "+key, got)
		assert.True(t, w.Confirmed(want), "RunWait(...) waited %+v, want 1 replica", w)
		assert.Equal(t, waits, readStats(t, admin)["wait"].calls-before["wait"].calls, "WAITs")
		// WAIT returned after the replica had the write.
		v, err := rc.Get(ctx, key).Result()
		require.NoError(t, err)
		assert.Equal(t, "hello "+key, v)
	}

	t.Run("by FCALL", func(t *testing.T) {
		r := New(master.Client(t))
		require.NoError(t, r.Load(ctx, testSet))
		check(t, r, "storetest:wait1", 1)
	})
	t.Run("function missing", func(t *testing.T) {
		r := New(master.Client(t))
		require.NoError(t, admin.FunctionFlush(ctx).Err())
		check(t, r, "storetest:wait2", 2)
	})
	t.Run("by EVALSHA, script missing", func(t *testing.T) {
		r := New(master.Client(t))
		r.evalOnly.Store(true)
		require.NoError(t, admin.ScriptFlush(ctx).Err())
		check(t, r, "storetest:wait3", 2)
	})
	t.Run("no wait asked", func(t *testing.T) {
		before := readStats(t, admin)
		cmd, w := New(master.Client(t)).RunWait(ctx, testSet, Replicas{}, []string{"storetest:wait4"}, "x")
		require.NoError(t, cmd.Err())
		assert.Equal(t, Waited{}, w)
		assert.Zero(t, readStats(t, admin)["wait"].calls-before["wait"].calls, "no WAIT")
	})
	t.Run("replica gone", func(t *testing.T) {
		r := New(master.Client(t))
		replica.Stop(t)
		short := Replicas{N: 1, Timeout: 100 * time.Millisecond}
		start := time.Now()
		cmd, w := r.RunWait(ctx, testSet, short, []string{"storetest:wait5"}, "x")
		require.NoError(t, cmd.Err(), "the script ran")
		assert.False(t, w.Confirmed(short), "RunWait(...) waited %+v, want unconfirmed", w)
		assert.Zero(t, w.Acked)
		assert.GreaterOrEqual(t, time.Since(start), short.Timeout, "WAIT waited its timeout")
	})
}

func TestRunWaitOnCluster(t *testing.T) {
	addrs := redistest.StartCluster(t, 3)
	ctx := context.Background()
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs})
	t.Cleanup(func() { _ = rdb.Close() })
	masters := map[string]*redis.Client{}
	for _, a := range addrs {
		masters[a] = redis.NewClient(&redis.Options{Addr: a})
		t.Cleanup(func() { _ = masters[a].Close() })
	}
	var keys []string
	on := map[string]int64{} // keys per master
	for i := range 6 {
		k := fmt.Sprintf("storetest:{w%d}", i)
		keys = append(keys, k)
		node, err := rdb.MasterForKey(ctx, k)
		require.NoError(t, err)
		on[node.Options().Addr]++
	}
	r := New(rdb)
	require.NoError(t, r.Run(ctx, testSet, keys[:1], "x").Err(), "the library is loaded on every master")
	before := map[string]cmdstats{}
	for a, m := range masters {
		before[a] = readStats(t, m)
	}
	// No master has a replica: every WAIT answers 0 after its timeout, on the master
	// of its key's slot.
	want := Replicas{N: 1, Timeout: 10 * time.Millisecond}
	for _, k := range keys {
		cmd, w := r.RunWait(ctx, testSet, want, []string{k}, k)
		require.NoError(t, cmd.Err())
		assert.Equal(t, Waited{Acked: 0}, w)
	}
	for a, m := range masters {
		assert.Equal(t, on[a], readStats(t, m)["wait"].calls-before[a]["wait"].calls, "WAITs on %s", a)
	}
	n := 0
	r.EachWait(ctx, testSet, want, keys, 1, []any{"x"}, func(_ []string, cmd *redis.Cmd, w Waited) bool {
		n++
		return assert.NoError(t, cmd.Err())
	})
	assert.Equal(t, len(keys), n, "EachWait: one call per key on Cluster")
}

// A master that died refuses connections: go-redis tries the dial again until its
// retries run out and then returns the error from Exec alone. Every pipeline of the
// Runner must give it to its commands, so that a caller reads "connection refused"
// and not an empty reply ("redis: unexpected type=<nil> for Slice").
func TestPipelinesReportAFailedDial(t *testing.T) {
	srv := redistest.Start(t)
	dead := redis.NewClient(&redis.Options{Addr: srv.Addr(), MaxRetries: 2,
		MinRetryBackoff: time.Millisecond, MaxRetryBackoff: 2 * time.Millisecond})
	t.Cleanup(func() { _ = dead.Close() })
	srv.Stop(t)
	ctx := context.Background()
	failed := func(t *testing.T, what string, err error) {
		t.Helper()
		require.Error(t, err, "%s: no error from a dead master", what)
		assert.Contains(t, err.Error(), "connection refused", what)
		assert.True(t, Transient(err), "%s: Transient(%v) = false, want true", what, err)
	}

	t.Run("RunWait", func(t *testing.T) {
		cmd, w := New(dead).RunWait(ctx, testSet, Replicas{N: 1, Timeout: 10 * time.Millisecond}, []string{"storetest:dead1"}, "x")
		failed(t, "the script", cmd.Err())
		failed(t, "the WAIT", w.Err)
		assert.False(t, w.Confirmed(Replicas{N: 1}))
	})
	t.Run("a carried Rider", func(t *testing.T) {
		r := New(dead)
		rd := r.NewRider([]string{"storetest:{dead2}:rider"})
		rd.Board(testSet, "rider")
		failed(t, "the carrying call", r.Run(Carry(ctx, rd), testSet, []string{"storetest:{dead2}:main"}, "main").Err())
		failed(t, "the Rider", rd.Result(ctx).Err())
	})
	t.Run("calls of a scan", func(t *testing.T) {
		cmds, err := New(dead).scanCalls(ctx, dead, []string{"storetest:dead3", "storetest:dead4"}, testSet,
			func(k string) []string { return []string{k} }, []any{"x"})
		require.NoError(t, err)
		for i, cmd := range cmds {
			failed(t, fmt.Sprintf("call %d", i), cmd.Err())
		}
	})
}
