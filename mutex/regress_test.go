package mutex

// Regression tests for the defects of issue 15. They use only the exported API of
// this package, go-redis hooks and internal/redistest, so that they hold across a
// rework of the package's internals; every helper here starts with "rg" for the
// same reason. Each test fails on the code it was written against, for the defect it
// names, and says what a fixed package does instead.

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
	"github.com/asynqmutex/asynqmutex/internal/store"
)

// rgServer is a redis-server of the test's own and a client of it with go-redis's
// default options.
func rgServer(t *testing.T) (*redistest.Server, *redis.Client) {
	t.Helper()
	s := redistest.Start(t)
	return s, s.Client(t)
}

// rgPrefix is a key prefix no other test uses, so that the documented names under
// it (the channels prefix + "wake:" + id) can be listed with a pattern.
func rgPrefix(t *testing.T) string {
	t.Helper()
	var b [6]byte
	_, _ = rand.Read(b[:])
	return "rg" + hex.EncodeToString(b[:]) + ":"
}

// rgNew is New, quiet (the tests check what it would log through their results and
// events), and closed when the test ends.
func rgNew(t *testing.T, rdb redis.UniversalClient, opts ...Option) *Client {
	t.Helper()
	c := New(rdb, append([]Option{Logger(slog.New(slog.NewTextHandler(io.Discard, nil)))}, opts...)...)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// rgEventually polls cond every millisecond until it holds, failing the test with
// what after limit.
func rgEventually(t *testing.T, limit time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("not within %v: %s", limit, what)
		}
		time.Sleep(time.Millisecond)
	}
}

// rgWaiting blocks until n waiters are queued for key and at least subs Clients of
// prefix listen for hand-overs (the package doc names their channels prefix +
// "wake:" + an id), so that a release now reaches them.
func rgWaiting(t *testing.T, admin *redis.Client, c *Client, prefix, key string, n, subs int) {
	t.Helper()
	ctx := context.Background()
	rgEventually(t, 10*time.Second, fmt.Sprintf("%d waiters queued for %q and %d Clients subscribed", n, key, subs), func() bool {
		info, err := c.Inspect(ctx, key)
		if err != nil || info.Waiting != n {
			return false
		}
		chans, err := admin.PubSubChannels(ctx, prefix+"wake:*").Result()
		return err == nil && len(chans) >= subs
	})
}

// rgRecorder keeps the events a Client reports.
type rgRecorder struct {
	mu     sync.Mutex
	events []Event
}

func (r *rgRecorder) observe(_ context.Context, e Event) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.events = append(r.events, e)
}

func (r *rgRecorder) count(op Op) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, e := range r.events {
		if e.Op == op {
			n++
		}
	}
	return n
}

// rgHook is a go-redis hook whose ProcessHook is process; a nil process passes every
// command on.
type rgHook struct {
	process func(ctx context.Context, cmd redis.Cmder, next redis.ProcessHook) error
}

func (h *rgHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *rgHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *rgHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if h.process == nil {
			return next(ctx, cmd)
		}
		return h.process(ctx, cmd, next)
	}
}

var _ redis.Hook = (*rgHook)(nil)

// rgIsScript reports whether cmd runs server-side code: every step of a lock is one
// such call, whether sent as a script or as a function.
func rgIsScript(cmd redis.Cmder) bool {
	switch cmd.Name() {
	case "eval", "evalsha", "eval_ro", "evalsha_ro", "fcall", "fcall_ro":
		return true
	}
	return false
}

// rgRuns reports whether cmd, a call of server-side code, runs s: as a function, by
// its digest or by its source.
func rgRuns(cmd redis.Cmder, s *store.Script) bool {
	args := cmd.Args()
	return len(args) > 1 && (args[1] == s.Function() || args[1] == s.Hash() || args[1] == s.Source())
}

// rgNoScript reports whether err is Redis's answer to an EVALSHA of a script it has
// not loaded yet: nothing ran, and go-redis sends the script itself next.
func rgNoScript(err error) bool {
	return err != nil && strings.HasPrefix(err.Error(), "NOSCRIPT")
}

// Defect 1: order breaks after a holder's lease runs out.

// TestRegressWaitersServedInOrderAfterLeaseRanOut: four waiters queue, in order,
// behind a holder that never releases (its process crashed). When its lease runs
// out they must be served 1 2 3 4, the order they queued in, as Client.Lock promises.
// Today each waiter tries again at the lease's end plus a jitter of its own, and the
// first to arrive takes the free key (lock.lua does not look at the queue on a free
// key): it is waiter 1 about one time in four, so five rounds all in order happen by
// chance about once in a thousand runs.
func TestRegressWaitersServedInOrderAfterLeaseRanOut(t *testing.T) {
	t.Parallel()
	_, rdb := rgServer(t)
	const (
		rounds  = 5
		waiters = 4
		lease   = time.Second // the crashed holder's: time enough to queue four waiters
	)
	for round := range rounds {
		t.Run(fmt.Sprintf("round %d", round), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			prefix := rgPrefix(t)
			const key = "order"
			look := rgNew(t, rdb, Prefix(prefix))
			taken := time.Now()
			_, err := rgNew(t, rdb, Prefix(prefix)).TryLock(ctx, key, lease) // never released
			require.NoError(t, err)

			var (
				mu    sync.Mutex
				order []int
			)
			done := make(chan error, waiters)
			for i := 1; i <= waiters; i++ {
				c := rgNew(t, rdb, Prefix(prefix))
				go func() {
					l, err := c.Lock(ctx, key, 10*lease, MaxWait(10*lease), HeldBy("waiter", strconv.Itoa(i)))
					if err == nil {
						mu.Lock()
						order = append(order, i)
						mu.Unlock()
						err = l.Unlock(ctx)
					}
					done <- err
				}()
				rgWaiting(t, rdb, look, prefix, key, i, i)
			}
			info, err := look.Inspect(ctx, key)
			require.NoError(t, err)
			require.True(t, info.Held, "control: the crashed holder still holds the key")
			require.Less(t, time.Since(taken), lease, "control: all waiters queued before the lease ran out")
			var queued []string
			for _, w := range info.Waiters {
				queued = append(queued, w.ID)
			}
			require.Equal(t, []string{"1", "2", "3", "4"}, queued, "control: the waiters queued in order")

			for range waiters {
				require.NoError(t, <-done)
			}
			assert.Equal(t, []int{1, 2, 3, 4}, order, "served in the order they queued, after the holder's lease ran out")
		})
	}
}

// TestRegressNewcomerDoesNotOvertakeWaitersAfterLeaseRanOut: two waiters queue
// behind a holder that never releases; a newcomer tries the key again and again
// (TryLock) as the lease runs out. It must not get the key before the waiters queued
// for it. Today the newcomer's attempt on the free key takes it, while the waiters
// sleep until the lease's end plus their jitter; it wins nearly every round.
func TestRegressNewcomerDoesNotOvertakeWaitersAfterLeaseRanOut(t *testing.T) {
	t.Parallel()
	_, rdb := rgServer(t)
	const (
		rounds  = 3
		waiters = 2
		lease   = time.Second
	)
	for round := range rounds {
		t.Run(fmt.Sprintf("round %d", round), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			prefix := rgPrefix(t)
			const key = "newcomer"
			look := rgNew(t, rdb, Prefix(prefix))
			taken := time.Now()
			_, err := rgNew(t, rdb, Prefix(prefix)).TryLock(ctx, key, lease) // never released
			require.NoError(t, err)

			var served atomic.Int32 // waiters that got the key
			release := make(chan struct{})
			done := make(chan error, waiters)
			for i := 1; i <= waiters; i++ {
				c := rgNew(t, rdb, Prefix(prefix))
				go func() {
					l, err := c.Lock(ctx, key, 10*lease, MaxWait(10*lease))
					if err == nil {
						served.Add(1)
						<-release // hold it until the newcomer has stopped trying
						err = l.Unlock(ctx)
					}
					done <- err
				}()
				rgWaiting(t, rdb, look, prefix, key, i, i)
			}
			require.Less(t, time.Since(taken), lease*3/4, "control: the waiters queued well before the lease ran out")

			newcomer := rgNew(t, rdb, Prefix(prefix))
			time.Sleep(time.Until(taken.Add(lease * 3 / 4)))
			won, tries := false, 0
			for served.Load() == 0 && time.Since(taken) < 3*lease {
				tries++
				l, err := newcomer.TryLock(ctx, key, 10*lease)
				if err == nil {
					won = true
					require.NoError(t, l.Unlock(ctx))
					break
				}
				require.ErrorIs(t, err, ErrNotObtained)
				time.Sleep(time.Millisecond)
			}
			close(release)
			for range waiters {
				require.NoError(t, <-done)
			}
			assert.False(t, won, "a newcomer took the key before the %d waiters queued for it (%d tries)", waiters, tries)
			assert.EqualValues(t, waiters, served.Load(), "every waiter was served")
		})
	}
}

// Defect 2: WithLock's release depends on the caller's context.

// TestRegressWithLockReleaseOutlivesCallerDeadline: fn returns before the caller's
// deadline, and the deadline passes while the release is on its way to Redis (the
// hook holds the release back until it has). The release must not depend on the
// caller's context: the key is free once WithLock returns, and WithLock reports no
// error, since fn ran under the lock and the lock was released. Today the release
// is sent with the caller's context and dies in go-redis before it reaches Redis,
// in every round, with or without ContextTimeoutEnabled; the key stays held for the
// rest of its lease.
func TestRegressWithLockReleaseOutlivesCallerDeadline(t *testing.T) {
	t.Parallel()
	s, admin := rgServer(t)
	for _, timeouts := range []bool{false, true} {
		t.Run(fmt.Sprintf("ContextTimeoutEnabled=%v", timeouts), func(t *testing.T) {
			t.Parallel()
			const (
				rounds = 10
				ttl    = time.Minute
				window = 200 * time.Millisecond // from WithLock to the caller's deadline
			)
			var (
				armed  atomic.Bool
				caller atomic.Pointer[context.Context]
				held   atomic.Int32 // releases held back until the deadline passed
			)
			hook := &rgHook{process: func(ctx context.Context, cmd redis.Cmder, next redis.ProcessHook) error {
				if rgIsScript(cmd) && armed.CompareAndSwap(true, false) {
					<-(*caller.Load()).Done() // the deadline lands while the release is on its way
					held.Add(1)
				}
				return next(ctx, cmd)
			}}
			rdb := redis.NewClient(&redis.Options{Addr: s.Addr(), ContextTimeoutEnabled: timeouts})
			rdb.AddHook(hook)
			t.Cleanup(func() { _ = rdb.Close() })
			c := rgNew(t, rdb)
			look := rgNew(t, admin)
			leaked, failed := 0, 0
			var firstErr error
			for round := range rounds {
				key := fmt.Sprintf("%s:%d", t.Name(), round)
				ctx, cancel := context.WithTimeout(context.Background(), window)
				caller.Store(&ctx)
				err := c.WithLock(ctx, key, ttl, func(context.Context) error {
					armed.Store(true) // the next script call is the release
					return nil
				})
				cancel()
				require.EqualValues(t, round+1, held.Load(), "control: round %d's release was held back", round)
				locked, lerr := look.Locked(context.Background(), key)
				require.NoError(t, lerr)
				if locked {
					leaked++
				}
				if err != nil {
					failed++
					firstErr = cmp.Or(firstErr, err)
				}
			}
			assert.Zero(t, leaked, "keys still held after WithLock returned, of %d", rounds)
			assert.Zero(t, failed, "WithLock failed though fn returned nil inside the deadline, of %d; the first: %v", rounds, firstErr)
		})
	}
}

// TestRegressWithLockNearDeadlineFreesKey is the same defect without a hook: fn
// returns a little before the caller's deadline, by a margin swept across the time a
// release takes, so that in some rounds the deadline passes while the release is in
// flight. Every key must be free when WithLock returns. Today some are left held
// (mostly with ContextTimeoutEnabled, where go-redis also cuts the release off the
// wire).
func TestRegressWithLockNearDeadlineFreesKey(t *testing.T) {
	t.Parallel()
	s, admin := rgServer(t)
	// The margins swept: without ContextTimeoutEnabled a context ends a command only
	// until go-redis has a connection for it, a short window; with it, also on the wire.
	for _, v := range []struct {
		timeouts bool
		step     time.Duration
	}{{false, 20 * time.Microsecond}, {true, 50 * time.Microsecond}} {
		timeouts, step := v.timeouts, v.step
		t.Run(fmt.Sprintf("ContextTimeoutEnabled=%v", timeouts), func(t *testing.T) {
			t.Parallel()
			const (
				rounds = 90
				ttl    = time.Minute
				window = 30 * time.Millisecond // from WithLock to the caller's deadline
			)
			rdb := redis.NewClient(&redis.Options{Addr: s.Addr(), ContextTimeoutEnabled: timeouts})
			t.Cleanup(func() { _ = rdb.Close() })
			c := rgNew(t, rdb)
			look := rgNew(t, admin)
			leaked, ran := 0, 0
			for round := range rounds {
				key := fmt.Sprintf("%s:%d", t.Name(), round)
				margin := time.Duration(round%30) * step
				ctx, cancel := context.WithTimeout(context.Background(), window)
				deadline, _ := ctx.Deadline()
				_ = c.WithLock(ctx, key, ttl, func(context.Context) error {
					ran++
					time.Sleep(time.Until(deadline.Add(-margin)))
					return nil
				})
				cancel()
				locked, err := look.Locked(context.Background(), key)
				require.NoError(t, err)
				if locked {
					leaked++
				}
			}
			require.Positive(t, ran, "control: fn ran")
			assert.Zero(t, leaked, "keys still held after WithLock returned, of %d runs of fn", ran)
		})
	}
}

// Defect 3: a lock handed over loses its short lease when its first renewal's reply
// is lost.

// TestRegressHandedOverLockSurvivesLostFirstRenewalReply: a WithLock waiter is
// handed the lock by a release, with the short lease a hand-over gives a renewing
// waiter (250ms); the reply to its first renewal is lost (the proxy drops it, and
// go-redis does not retry). The renewal must be tried again inside the lease the
// waiter actually holds, so fn keeps the lock for many of those leases. Today the
// retry comes every/8 plus jitter later (125-250ms at a 3s ttl), after the short
// lease ran out: fn is cancelled about 245ms in, and WithLock reports ErrNotHeld.
func TestRegressHandedOverLockSurvivesLostFirstRenewalReply(t *testing.T) {
	t.Parallel()
	const (
		rounds   = 4
		ttl      = 3 * time.Second
		handOver = 250 * time.Millisecond // the lease a release hands a WithLock waiter (Client.Lock's doc)
		tries    = 10                     // per round, for the hand-over with the short lease to happen
	)
	errPremise := errors.New("the lock was not handed over with the short lease")
	for round := range rounds {
		t.Run(fmt.Sprintf("round %d", round), func(t *testing.T) {
			t.Parallel()
			s, admin := rgServer(t)
			ctx := context.Background()
			var err error
			for try := range tries {
				prefix := rgPrefix(t)
				const key = "handed"
				p := redistest.NewProxy(t, s.Addr())
				via := redis.NewClient(&redis.Options{Addr: p.Addr(), MaxRetries: -1})
				t.Cleanup(func() { _ = via.Close() })
				// The reply to the first renewal is the one dropped: armed as that renewal
				// is sent, since a hand-over's renewal goes at once, beside fn, and can be
				// answered before fn could arm the proxy itself.
				var renewals atomic.Int32
				via.AddHook(&rgHook{process: func(ctx context.Context, cmd redis.Cmder, next redis.ProcessHook) error {
					if rgIsScript(cmd) && rgRuns(cmd, plainExtendScript) && renewals.Add(1) == 1 {
						p.DropReplies(1)
					}
					return next(ctx, cmd)
				}})
				rec := &rgRecorder{}
				waiter := rgNew(t, via, Prefix(prefix), Observe(rec.observe))
				direct := rgNew(t, admin, Prefix(prefix))
				holder, lerr := direct.TryLock(ctx, key, time.Hour)
				require.NoError(t, lerr)

				done := make(chan error, 1)
				go func() {
					done <- waiter.WithLock(ctx, key, ttl, func(fctx context.Context) error {
						start := time.Now()
						info, err := direct.Inspect(ctx, key)
						if err != nil {
							return err
						}
						if info.TTL > handOver {
							return fmt.Errorf("%w: its lease is %v", errPremise, info.TTL)
						}
						select {
						case <-fctx.Done():
							return fmt.Errorf("fn cancelled %v in, its lease then %v: %w", time.Since(start).Round(time.Millisecond), info.TTL, context.Cause(fctx))
						case <-time.After(4 * handOver):
						}
						if _, err := direct.TryLock(ctx, key, time.Second); !errors.Is(err, ErrNotObtained) {
							return fmt.Errorf("another TryLock after 4 hand-over leases = %v, want ErrNotObtained", err)
						}
						return nil
					}, MaxWait(time.Minute))
				}()
				rgWaiting(t, admin, direct, prefix, key, 1, 1)
				require.NoError(t, holder.Unlock(ctx))
				err = <-done
				if errors.Is(err, errPremise) {
					t.Logf("try %d: %v", try, err)
					continue
				}
				require.Equal(t, 1, p.Dropped(), "control: one reply was dropped")
				require.Equal(t, 1, rec.count(OpRenewFailed), "control: the reply dropped was the first renewal's")
				break
			}
			require.NotErrorIs(t, err, errPremise, "in %d tries", tries)
			assert.NoError(t, err, "a lost renewal reply must be retried within the hand-over's lease")
		})
	}
}

// Defect 4: a brief Redis outage ends every wait.

// TestRegressWaitRidesOutBriefOutage: a Lock waits, with most of its MaxWait left,
// when Redis stops and comes back 0.3s later (without persistence: the holder's key
// is gone). A wait must ride out an outage shorter than its MaxWait and take the now
// free key. Today the waiter's Client sees its subscription break, every waiter tries
// again at once, finds "connection refused" after go-redis's few quick retries, and
// Lock returns that error.
func TestRegressWaitRidesOutBriefOutage(t *testing.T) {
	t.Parallel()
	const (
		rounds  = 3
		maxWait = 20 * time.Second
		outage  = 300 * time.Millisecond
	)
	for round := range rounds {
		t.Run(fmt.Sprintf("round %d", round), func(t *testing.T) {
			t.Parallel()
			s, admin := rgServer(t)
			ctx := context.Background()
			prefix := rgPrefix(t)
			const key = "outage"
			holder := rgNew(t, admin, Prefix(prefix))
			_, err := holder.TryLock(ctx, key, time.Hour)
			require.NoError(t, err)

			rdb := s.Client(t)
			waiter := rgNew(t, rdb, Prefix(prefix))
			type result struct {
				l   *Lock
				err error
				at  time.Time
			}
			got := make(chan result, 1)
			go func() {
				l, err := waiter.Lock(ctx, key, time.Minute, MaxWait(maxWait))
				got <- result{l, err, time.Now()}
			}()
			rgWaiting(t, admin, holder, prefix, key, 1, 1)

			s.Stop(t)
			stopped := time.Now()
			time.Sleep(outage)
			s.Restart(t)
			back := time.Now()

			r := <-got
			require.NoError(t, r.err, "Lock failed %v after Redis stopped (down %v), with %v of MaxWait left",
				r.at.Sub(stopped).Round(time.Millisecond), back.Sub(stopped).Round(time.Millisecond), maxWait-r.at.Sub(stopped))
			locked, err := holder.Locked(ctx, key)
			require.NoError(t, err)
			assert.True(t, locked, "the waiter holds the key")
			require.NoError(t, r.l.Unlock(ctx))
		})
	}
}

// Defect 5: a set of keys meeting a key held with Limit(n).

// TestRegressKeySetMeetingLimitKeyGetsLimitError: a key is held with Limit(2); a set
// of keys that includes it must fail as a single key does, with a *LimitError naming
// the key and both limits, and keep none of its other keys. Today TryLockKeys,
// LockKeys and WithLockKeys return Redis's WRONGTYPE script error in a string.
func TestRegressKeySetMeetingLimitKeyGetsLimitError(t *testing.T) {
	t.Parallel()
	_, rdb := rgServer(t)
	c := rgNew(t, rdb)
	ctx := context.Background()
	const free, limited = "a", "b" // the set takes "a" first, then meets "b"
	_, err := c.TryLock(ctx, limited, time.Minute, Limit(2))
	require.NoError(t, err)

	const maxWait = 20 * time.Second
	check := func(t *testing.T, start time.Time, err error) {
		t.Helper()
		assert.Less(t, time.Since(start), maxWait/4, "failed at once, not after waiting out MaxWait")
		var le *LimitError
		require.ErrorAs(t, err, &le, "error %v", err)
		assert.Equal(t, limited, le.Key)
		assert.Equal(t, 2, le.Held)
		assert.Equal(t, 1, le.Asked)
		assert.NotContains(t, err.Error(), "WRONGTYPE")
		locked, lerr := c.Locked(ctx, free)
		require.NoError(t, lerr)
		assert.False(t, locked, "the set kept %q", free)
	}
	t.Run("control: one key", func(t *testing.T) {
		start := time.Now()
		_, err := c.Lock(ctx, limited, time.Minute, MaxWait(maxWait))
		check(t, start, err)
	})
	t.Run("TryLockKeys", func(t *testing.T) {
		start := time.Now()
		_, err := c.TryLockKeys(ctx, []string{free, limited}, time.Minute)
		check(t, start, err)
	})
	t.Run("LockKeys", func(t *testing.T) {
		start := time.Now()
		_, err := c.LockKeys(ctx, []string{free, limited}, time.Minute, MaxWait(maxWait))
		check(t, start, err)
	})
	t.Run("WithLockKeys", func(t *testing.T) {
		start := time.Now()
		ran := false
		err := c.WithLockKeys(ctx, []string{limited, free}, time.Minute, func(context.Context) error {
			ran = true
			return nil
		}, MaxWait(maxWait))
		assert.False(t, ran, "fn ran")
		check(t, start, err)
	})
}

// Defect 6: a repeated release after two changes of hands is taken for a lost lease.

// TestRegressUnlockRepeatedAfterTwoHandChanges: an Unlock reaches Redis and releases
// the lock; its reply is lost; before go-redis's repeat arrives, the key changes
// hands twice (taken, released, taken again). The lock was released, not lost:
// Unlock must return nil and report OpReleased, never OpLeaseLost (which the
// metrics count as asynqmutex_lease_lost_total). Today the repeat finds a stranger
// holding the key with another previous holder, and Unlock returns ErrNotHeld and
// reports OpLeaseLost. The control, a lease that really ran out before the release,
// must keep reporting ErrNotHeld and OpLeaseLost.
func TestRegressUnlockRepeatedAfterTwoHandChanges(t *testing.T) {
	t.Parallel()
	s, admin := rgServer(t)
	ctx := context.Background()
	others := rgNew(t, admin)
	changeHands := func(t *testing.T, key string) {
		t.Helper()
		b, err := others.TryLock(ctx, key, time.Minute)
		require.NoError(t, err, "control: the key was free after the release")
		require.NoError(t, b.Unlock(ctx))
		_, err = others.TryLock(ctx, key, time.Minute)
		require.NoError(t, err)
	}

	t.Run("released", func(t *testing.T) {
		key := t.Name()
		var (
			armed   atomic.Bool
			applied atomic.Int32
		)
		hook := &rgHook{process: func(ctx context.Context, cmd redis.Cmder, next redis.ProcessHook) error {
			if !rgIsScript(cmd) || !armed.Load() {
				return next(ctx, cmd)
			}
			err := next(ctx, cmd)
			if rgNoScript(err) || !armed.CompareAndSwap(true, false) {
				return err
			}
			if err == nil {
				applied.Add(1)
			}
			// The reply is lost; go-redis sends the command again later, after the
			// key has changed hands twice.
			changeHands(t, key)
			return next(ctx, cmd)
		}}
		rdb := redis.NewClient(&redis.Options{Addr: s.Addr()})
		rdb.AddHook(hook)
		t.Cleanup(func() { _ = rdb.Close() })
		rec := &rgRecorder{}
		c := rgNew(t, rdb, Observe(rec.observe))
		l, err := c.TryLock(ctx, key, time.Minute)
		require.NoError(t, err)
		armed.Store(true) // the next script call is the release
		err = l.Unlock(ctx)
		require.EqualValues(t, 1, applied.Load(), "control: the release reached Redis and succeeded")
		assert.NoError(t, err, "the release was applied; its repeat is no lost lease")
		assert.Zero(t, rec.count(OpLeaseLost), "OpLeaseLost reported for a lock that was released")
		assert.Equal(t, 1, rec.count(OpReleased), "OpReleased reported")
	})

	t.Run("control: lease ran out before the release", func(t *testing.T) {
		key := t.Name()
		rec := &rgRecorder{}
		c := rgNew(t, admin, Observe(rec.observe))
		const lease = 50 * time.Millisecond
		l, err := c.TryLock(ctx, key, lease)
		require.NoError(t, err)
		rgEventually(t, 10*lease, "the lease ran out", func() bool {
			locked, err := c.Locked(ctx, key)
			return err == nil && !locked
		})
		changeHands(t, key)
		err = l.Unlock(ctx)
		assert.ErrorIs(t, err, ErrNotHeld)
		assert.Equal(t, 1, rec.count(OpLeaseLost), "a lease that ran out is lost")
	})
}
