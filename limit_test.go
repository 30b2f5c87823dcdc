package asynqmutex

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/asynqmutex/asynqmutex/mutex"
)

func TestMiddlewareLimit(t *testing.T) {
	locks, _ := newLocks(t)
	ctx := context.Background()
	const n = 2
	var (
		inside = map[string]*atomic.Int32{"a": {}, "b": {}}
		most   = map[string]*atomic.Int32{"a": {}, "b": {}}
		fences sync.Map
	)
	h := Middleware(locks, On("tenant"), Limit(n), MaxWait(10*time.Second))(asynq.HandlerFunc(func(ctx context.Context, t2 *asynq.Task) error {
		tenant := string(t2.Payload()[11:12])
		now := inside[tenant].Add(1)
		defer inside[tenant].Add(-1)
		for m := most[tenant].Load(); now > m && !most[tenant].CompareAndSwap(m, now); m = most[tenant].Load() {
		}
		f, ok := Fence(ctx)
		if _, dup := fences.LoadOrStore(f, true); !ok || dup {
			return fmt.Errorf("fence %d (ok %v) given twice", f, ok)
		}
		time.Sleep(20 * time.Millisecond)
		return nil
	}))
	var wg sync.WaitGroup
	for i := range 12 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			tenant := []string{"a", "b"}[i%2]
			err := h.ProcessTask(ctx, asynq.NewTask("export", []byte(`{"tenant":"`+tenant+`"}`)))
			assert.NoError(t, err)
		}()
	}
	wg.Wait()
	for tenant, m := range most {
		assert.Equal(t, int32(n), m.Load(), "most tasks of tenant %s at once", tenant)
	}
}

func TestMiddlewareLimitConflicts(t *testing.T) {
	locks, _ := newLocks(t)
	ctx := context.Background()
	release := make(chan struct{})
	started := make(chan struct{}, 2)
	block := asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
		started <- struct{}{}
		<-release
		return nil
	})
	h := Middleware(locks, Limit(2))(block)
	var wg sync.WaitGroup
	for range 2 {
		wg.Add(1)
		go func() { defer wg.Done(); assert.NoError(t, h.ProcessTask(ctx, asynq.NewTask("report", nil))) }()
	}
	<-started
	<-started

	var r recorder
	third := Middleware(locks, Limit(2), OnConflict(Skip), AfterFailure(r.hook))(asynq.HandlerFunc(func(context.Context, *asynq.Task) error {
		t.Error("a third task ran under Limit(2)")
		return nil
	}))
	require.NoError(t, third.ProcessTask(ctx, asynq.NewTask("report", nil)), "Skip")
	var le *LockedError
	require.Len(t, r.got(), 1)
	assert.ErrorAs(t, r.got()[0], &le)

	// Another limit on the same key is a clear, ordinary error.
	other := Middleware(locks, Limit(3))(block)
	err := other.ProcessTask(ctx, asynq.NewTask("report", nil))
	var lim *mutex.LimitError
	require.ErrorAs(t, err, &lim)
	assert.Equal(t, 2, lim.Held)
	assert.False(t, errors.Is(err, mutex.ErrNotObtained))
	close(release)
	wg.Wait()

	assert.PanicsWithValue(t, fmt.Sprintf("asynqmutex.Limit: limit 0 outside [1, %d] (mutex.MaxLimit)", mutex.MaxLimit), func() { Limit(0) })
}
