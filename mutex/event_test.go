package mutex

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
)

// recorder collects the events of a Client.
type recorder struct {
	mu     sync.Mutex
	events []Event
}

func (r *recorder) observe(_ context.Context, e Event) {
	r.mu.Lock()
	r.events = append(r.events, e)
	r.mu.Unlock()
}

// take returns the events so far, forgetting them.
func (r *recorder) take() []Event {
	r.mu.Lock()
	defer r.mu.Unlock()
	e := r.events
	r.events = nil
	return e
}

func ops(events []Event) []Op {
	var o []Op
	for _, e := range events {
		o = append(o, e.Op)
	}
	return o
}

// waitFor returns the events once op has been seen, failing after 30s.
func (r *recorder) waitFor(t *testing.T, op Op) []Event {
	t.Helper()
	var all []Event
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		all = append(all, r.take()...)
		for _, e := range all {
			if e.Op == op {
				return all
			}
		}
	}
	t.Fatalf("no %v event within 30s; got %v", op, ops(all))
	return nil
}

func TestEventsOfALock(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		var r, r2 recorder
		c := New(b.rdb, Observe(r.observe), Observe(r2.observe))
		defer c.Close()
		ctx := context.Background()
		key := uniqueKey(t)

		l, err := c.TryLock(ctx, key, time.Minute, HeldBy("pay", "t1"))
		require.NoError(t, err)
		ev := r.take()
		require.Equal(t, []Op{OpAcquired}, ops(ev))
		assert.Equal(t, Event{Op: OpAcquired, Key: key, Name: "pay", ID: "t1", Fence: l.Fence()}, ev[0], "no wait, not contended")
		assert.Equal(t, []Op{OpAcquired}, ops(r2.take()), "every observer hears it")

		_, err = c.TryLock(ctx, key, time.Minute, HeldBy("pay", "t2"))
		require.ErrorIs(t, err, ErrNotObtained)
		ev = r.take()
		require.Equal(t, []Op{OpContended, OpNotObtained}, ops(ev))
		assert.Equal(t, "t2", ev[0].ID)
		assert.ErrorIs(t, ev[1].Err, ErrNotObtained)
		assert.True(t, ev[1].Contended)

		// A waiter: contended once, however often it tries, then acquired with its wait.
		got := make(chan *Lock, 1)
		go func() {
			w, err := c.Lock(ctx, key, time.Minute, MaxWait(20*time.Second), HeldBy("pay", "t3"))
			assert.NoError(t, err)
			got <- w
		}()
		waitForWaiters(t, b, c, key, 1)
		time.Sleep(20 * time.Millisecond)
		require.NoError(t, l.Unlock(ctx))
		w := <-got
		ev = r.take()
		// The waiter may hear of the hand-over before the releaser's Unlock returns.
		require.ElementsMatch(t, []Op{OpContended, OpReleased, OpAcquired}, ops(ev))
		assert.Equal(t, OpContended, ev[0].Op)
		for _, e := range ev[1:] {
			switch e.Op {
			case OpReleased:
				assert.Equal(t, "t1", e.ID)
				assert.Positive(t, e.Held)
			case OpAcquired:
				assert.Equal(t, "t3", e.ID)
				assert.True(t, e.Contended)
				assert.GreaterOrEqual(t, e.Wait, 20*time.Millisecond, "the wait is reported")
				assert.Equal(t, w.Fence(), e.Fence)
			}
		}

		// A lock taken away: Extend and Unlock report the lost lease.
		_, err = c.ForceRelease(ctx, key)
		require.NoError(t, err)
		assert.ErrorIs(t, w.Extend(ctx, time.Minute), ErrNotHeld)
		assert.ErrorIs(t, w.Unlock(ctx), ErrNotHeld)
		ev = r.take()
		require.Equal(t, []Op{OpLeaseLost}, ops(ev), "reported once per lock")
		assert.ErrorIs(t, ev[0].Err, ErrNotHeld)
	})
}

func TestEventsOfWithLock(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		var r recorder
		c := New(b.rdb, Observe(r.observe))
		ctx := context.Background()
		key := uniqueKey(t)
		require.NoError(t, c.WithLock(ctx, key, time.Minute, func(context.Context) error { return nil }, HeldBy("pay", "t1")))
		assert.Equal(t, []Op{OpAcquired, OpReleased}, ops(r.take()))

		err := c.WithLock(ctx, key, 300*time.Millisecond, func(ctx context.Context) error {
			require.NoError(t, b.admin.Del(ctx, c.redisKey(key)).Err())
			<-ctx.Done() // the next renewal finds the key gone
			return nil
		}, HeldBy("pay", "t2"))
		require.ErrorIs(t, err, ErrNotHeld)
		ev := r.take()
		require.Equal(t, []Op{OpAcquired, OpLeaseLost}, ops(ev), "one event for the loss, none for the release")
		assert.Equal(t, "t2", ev[1].ID)
		assert.ErrorIs(t, ev[1].Err, ErrNotHeld)
	})
}

// failAll is a go-redis hook that, once on, fails every command without sending it.
type failAll struct{ on atomic.Bool }

func (h *failAll) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *failAll) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *failAll) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if h.on.Load() {
			cmd.SetErr(io.ErrUnexpectedEOF)
			return io.ErrUnexpectedEOF
		}
		return next(ctx, cmd)
	}
}

// observedFailingClient is a Client of a real redis-server whose commands fail while
// hook is on, with its events recorded in r and its logs in buf.
func observedFailingClient(t *testing.T) (c *Client, hook *failAll, r *recorder, buf *syncBuffer) {
	b := realBackend(t)
	rdb := redis.NewClient(&redis.Options{Addr: b.rdb.Options().Addr, MaxRetries: -1})
	t.Cleanup(func() { rdb.Close() })
	hook, r, buf = &failAll{}, &recorder{}, &syncBuffer{}
	rdb.AddHook(hook)
	return New(rdb, Observe(r.observe), Logger(slog.New(slog.NewTextHandler(buf, nil)))), hook, r, buf
}

func TestRenewFailedIsObservedAndLogged(t *testing.T) {
	c, hook, r, buf := observedFailingClient(t)
	l := (*Lock)(nil)
	err := c.WithLock(context.Background(), uniqueKey(t), 300*time.Millisecond, func(ctx context.Context) error {
		l, _ = FromContext(ctx)
		hook.on.Store(true)
		select {
		case <-ctx.Done():
		case <-time.After(30 * time.Second):
			t.Error("not cancelled")
		}
		return nil
	}, HeldBy("pay", "t1"))
	hook.on.Store(false)
	require.ErrorIs(t, err, ErrNotHeld)
	got := ops(r.take())
	assert.Greater(t, len(got), 3, "several renewals failed: %v", got)
	assert.Equal(t, OpAcquired, got[0])
	for _, op := range got[1 : len(got)-1] {
		assert.Equal(t, OpRenewFailed, op, "%v", got)
	}
	assert.Equal(t, OpLeaseLost, got[len(got)-1], "the lease ran out on our clock: %v", got)
	logs := buf.String()
	assert.Equal(t, 1, strings.Count(logs, "level=WARN"), "one record per run of failures: %s", logs)
	assert.Contains(t, logs, "name=pay id=t1")
	assert.NotContains(t, logs, l.Token())
}

func TestWakeupLostAndRecovered(t *testing.T) {
	b := realBackend(t)
	p := redistest.NewProxy(t, b.rdb.Options().Addr)
	via := redis.NewClient(&redis.Options{Addr: p.Addr()})
	t.Cleanup(func() { via.Close() })
	var (
		r   recorder
		buf syncBuffer
	)
	c := New(via, Observe(r.observe), Logger(slog.New(slog.NewTextHandler(&buf, nil))))
	ctx := context.Background()
	key := uniqueKey(t)
	holder, err := New(b.rdb).TryLock(ctx, key, time.Hour)
	require.NoError(t, err)
	got := lockThenUnlock(c, key)
	waitForWaiters(t, b, c, key, 1)
	r.take()
	require.Equal(t, 1, p.FreezeSubscribers())
	ev := r.waitFor(t, OpWakeupRecovered)
	assert.Equal(t, []Op{OpWakeupLost, OpWakeupRecovered}, ops(ev))
	assert.Error(t, ev[0].Err)
	require.NoError(t, holder.Unlock(ctx))
	require.NoError(t, <-got)
	logs := buf.String()
	assert.Contains(t, logs, "level=WARN msg=\"mutex: subscription for hand-overs lost")
	assert.Contains(t, logs, "level=INFO msg=\"mutex: subscription for hand-overs is back\"")
}

// syncBuffer is a bytes.Buffer safe for concurrent writes.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func TestOpString(t *testing.T) {
	assert.Equal(t, "lease_lost", OpLeaseLost.String())
	assert.Equal(t, "wakeup_recovered", OpWakeupRecovered.String())
	assert.Equal(t, "op(200)", Op(200).String())
}
