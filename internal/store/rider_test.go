package store

import (
	"context"
	"sync/atomic"
	"testing"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
)

// trips counts what a redis client sends: single commands and pipelines, each one
// round trip.
type trips struct{ single, pipelines atomic.Int64 }

func (h *trips) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *trips) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.single.Add(1)
		return next(ctx, cmd)
	}
}
func (h *trips) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		h.pipelines.Add(1)
		return next(ctx, cmds)
	}
}

func (h *trips) take() (single, pipelines int64) { return h.single.Swap(0), h.pipelines.Swap(0) }

func TestRider(t *testing.T) {
	srv := redistest.Start(t)
	admin := srv.Client(t)
	ctx := context.Background()
	newRunner := func(t *testing.T) (*Runner, *trips) {
		c := srv.Client(t)
		h := &trips{}
		c.AddHook(h)
		return New(c), h
	}
	get := func(t *testing.T, key string) string {
		t.Helper()
		v, err := admin.Get(ctx, key).Result()
		require.NoError(t, err)
		return v
	}

	t.Run("carried in one round trip", func(t *testing.T) {
		r, h := newRunner(t)
		require.NoError(t, r.Load(ctx, testSet))
		h.take()
		rd := r.NewRider([]string{"storetest:{r1}:rider"})
		cctx := Carry(ctx, rd)
		rd.Board(testSet, "rider")
		got, err := r.Run(cctx, testSet, []string{"storetest:{r1}:main"}, "main").Text()
		require.NoError(t, err)
		assert.Equal(t, "hello main", got)
		single, pipes := h.take()
		assert.Equal(t, [2]int64{0, 1}, [2]int64{single, pipes}, "single commands, pipelines")
		assert.Equal(t, "hello rider", get(t, "storetest:{r1}:rider"))
		got, err = rd.Result(ctx).Text()
		require.NoError(t, err)
		assert.Equal(t, "hello rider", got)

		// It went once: a later call with the context, and Result, send nothing more.
		require.NoError(t, r.Run(cctx, testGet, []string{"storetest:{r1}:main"}).Err())
		rd.Result(ctx)
		single, pipes = h.take()
		assert.Equal(t, [2]int64{1, 0}, [2]int64{single, pipes}, "single commands, pipelines after it went")
	})

	t.Run("control: not boarded, not carried", func(t *testing.T) {
		r, h := newRunner(t)
		require.NoError(t, r.Load(ctx, testSet))
		h.take()
		rd := r.NewRider([]string{"storetest:{r2}:rider"})
		require.NoError(t, r.Run(Carry(ctx, rd), testSet, []string{"storetest:{r2}:main"}, "main").Err())
		single, pipes := h.take()
		assert.Equal(t, [2]int64{1, 0}, [2]int64{single, pipes}, "single commands, pipelines")
		assert.Nil(t, rd.Result(ctx), "a Rider that never boarded has no reply")
		assert.Zero(t, admin.Exists(ctx, "storetest:{r2}:rider").Val())
	})

	t.Run("another client: Result sends it alone", func(t *testing.T) {
		r, h := newRunner(t)
		other, ho := newRunner(t)
		require.NoError(t, r.Load(ctx, testSet))
		require.NoError(t, other.c.Ping(ctx).Err(), "a connection dialled before the count")
		h.take()
		ho.take()
		rd := other.NewRider([]string{"storetest:{r3}:rider"})
		cctx := Carry(ctx, rd)
		rd.Board(testSet, "rider")
		require.NoError(t, r.Run(cctx, testSet, []string{"storetest:{r3}:main"}, "main").Err())
		assert.Zero(t, admin.Exists(ctx, "storetest:{r3}:rider").Val(), "not carried by a Runner on another client")
		got, err := rd.Result(ctx).Text()
		require.NoError(t, err)
		assert.Equal(t, "hello rider", got)
		single, pipes := h.take()
		osingle, opipes := ho.take()
		assert.Equal(t, [4]int64{1, 0, 1, 0}, [4]int64{single, pipes, osingle, opipes}, "each client's single commands, pipelines")
	})

	t.Run("function missing: each goes again alone", func(t *testing.T) {
		r, _ := newRunner(t)
		require.NoError(t, admin.FunctionFlush(ctx).Err())
		rd := r.NewRider([]string{"storetest:{r4}:rider"})
		cctx := Carry(ctx, rd)
		rd.Board(testSet, "rider")
		got, err := r.Run(cctx, testSet, []string{"storetest:{r4}:main"}, "main").Text()
		require.NoError(t, err)
		assert.Equal(t, "hello main", got)
		got, err = rd.Result(ctx).Text()
		require.NoError(t, err)
		assert.Equal(t, "hello rider", got)
		assert.Equal(t, "hello rider", get(t, "storetest:{r4}:rider"))
	})

	t.Run("by EVALSHA, script missing", func(t *testing.T) {
		r, h := newRunner(t)
		r.evalOnly.Store(true)
		require.NoError(t, admin.ScriptFlush(ctx).Err())
		rd := r.NewRider([]string{"storetest:{r5}:rider"})
		cctx := Carry(ctx, rd)
		rd.Board(testSet, "rider")
		require.NoError(t, r.Run(cctx, testSet, []string{"storetest:{r5}:main"}, "main").Err())
		got, err := rd.Result(ctx).Text()
		require.NoError(t, err)
		assert.Equal(t, "hello rider", got)
		// Cached now: the next pair is one round trip by EVALSHA.
		h.take()
		rd = r.NewRider([]string{"storetest:{r5}:rider"})
		cctx = Carry(ctx, rd)
		rd.Board(testSet, "again")
		require.NoError(t, r.Run(cctx, testSet, []string{"storetest:{r5}:main"}, "main").Err())
		require.NoError(t, rd.Result(ctx).Err())
		single, pipes := h.take()
		assert.Equal(t, [2]int64{0, 1}, [2]int64{single, pipes}, "single commands, pipelines")
		assert.Equal(t, "hello again", get(t, "storetest:{r5}:rider"))
	})
}

func TestRiderOnCluster(t *testing.T) {
	addrs := redistest.StartCluster(t, 3)
	c := redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs})
	t.Cleanup(func() { _ = c.Close() })
	r := New(c)
	ctx := context.Background()
	// Keys of one slot, and of two slots on different masters: both arrive.
	for _, keys := range [][2]string{{"storetest:{c}:rider", "storetest:{c}:main"}, {"storetest:{a}:rider", "storetest:{b}:main"}} {
		rd := r.NewRider([]string{keys[0]})
		cctx := Carry(ctx, rd)
		rd.Board(testSet, "rider")
		require.NoError(t, r.Run(cctx, testSet, []string{keys[1]}, "main").Err(), "keys %v", keys)
		got, err := rd.Result(ctx).Text()
		require.NoError(t, err, "keys %v", keys)
		assert.Equal(t, "hello rider", got)
		v, err := c.Get(ctx, keys[0]).Result()
		require.NoError(t, err)
		assert.Equal(t, "hello rider", v)
	}
}
