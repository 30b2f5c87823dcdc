package mutex

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/asynqmutex/asynqmutex/internal/shortkey"
)

type lockContextKey struct{}

// FromContext returns the lock that WithLock runs fn under, from fn's context or one
// derived from it. It reports false elsewhere.
func FromContext(ctx context.Context) (*Lock, bool) {
	l, ok := ctx.Value(lockContextKey{}).(*Lock)
	return l, ok
}

// WithLock takes the lock on key for ttl as Lock does (waiting unless MaxWait(0)),
// runs fn while holding it, and releases it when fn returns or panics.
//
// While fn runs the lease is renewed every ttl/3 (a lock handed over by a releasing
// holder starts with a 250ms lease, renewed at once; a process that did not run for
// all of a lease asks Redis whether the lock is still its own before it counts it
// lost). If Redis says the lock
// is no longer ours, or renewals fail until the lease would have ended on this
// process's own monotonic clock (a partition, a long pause), fn's context is cancelled
// at once, with a cause wrapping ErrNotHeld, and WithLock returns an error wrapping
// ErrNotHeld joined with fn's error: another holder may have overlapped with fn. The
// lock is available to fn through FromContext, for its fencing token.
//
// WithLock returns the error of taking the lock (ErrNotObtained, ctx's error, a Redis
// error) without calling fn; otherwise fn's error, joined with any error of the
// release. A release that failed because Redis could not be reached for a while is
// still reported, and is sent again in the background until Redis answers, within
// the lease (see Lock.Unlock): the key frees as soon as Redis is back.
// A lease is reported lost only if it was: a release whose first reply was lost
// recognises itself however often the key changed hands since, and a release that
// finds the key gone or re-taken otherwise means the lease ended while fn ran. The
// release is sent even when ctx has ended (see Lock.Unlock).
// No goroutine outlives the call but that retry, which ends with the lease, and the
// start of parked tasks the release hands the key to (StartWith), bounded by the
// Starter's 10s. It is safe for concurrent use; fn must honour its context to benefit from the
// cancellation.
func (c *Client) WithLock(ctx context.Context, key string, ttl time.Duration, fn func(context.Context) error, opts ...LockOption) error {
	if fn == nil {
		return errors.New("mutex: WithLock with nil fn")
	}
	a, err := c.newAcquisition(key, ttl, opts)
	if err != nil {
		return err
	}
	return c.withLock(ctx, a, fn)
}

// WithLockKeys takes the locks on all of keys as one lock, as LockKeys does (waiting
// unless MaxWait(0)), runs fn while holding them, and releases them all when fn
// returns or panics. It renews all of them together, every ttl/3, in one call on a
// single Redis; if any lease is lost (Redis says a key is no longer ours, or renewals
// fail until the lease would have ended on this process's clock), fn's context is
// cancelled at once and WithLockKeys returns an error wrapping ErrNotHeld, exactly as
// WithLock does for one key. FromContext gives fn the Lock, whose Fences are the
// fencing tokens of the keys. The results are those of WithLock.
func (c *Client) WithLockKeys(ctx context.Context, keys []string, ttl time.Duration, fn func(context.Context) error, opts ...LockOption) error {
	if fn == nil {
		return errors.New("mutex: WithLockKeys with nil fn")
	}
	a, err := c.newMultiAcquisition(keys, ttl, opts)
	if err != nil {
		return err
	}
	return c.withLock(ctx, a, fn)
}

// withLock is WithLock for acquisition a.
func (c *Client) withLock(ctx context.Context, a *acquisition, fn func(context.Context) error) (err error) {
	ttl := a.ttl
	a.renewed = true
	l, err := c.acquire(ctx, a)
	if err != nil {
		return err
	}

	fctx, cancelFn := context.WithCancelCause(context.WithValue(ctx, lockContextKey{}, l))
	r := l.renewFrom(ctx, ttl, cancelFn)

	defer func() {
		leaseErr := r.end()
		cancelFn(context.Canceled)
		uerr := l.unlock(ctx)
		if errors.Is(uerr, ErrNotHeld) {
			// A release repeated after a lost reply knows itself (Unlock): the lease
			// really ended while fn ran, or an operator took the lock away.
			if leaseErr == nil {
				leaseErr = uerr
				if !errors.Is(uerr, errForced) {
					leaseErr = fmt.Errorf("mutex: lease on %s ended before the release: %w", l.what(), ErrNotHeld)
				}
			}
			uerr = nil
		}
		switch {
		case leaseErr != nil:
			l.emit(ctx, OpLeaseLost, leaseErr)
		case uerr == nil:
			l.emit(ctx, OpReleased, nil)
		default:
			l.emit(ctx, OpReleaseFailed, uerr)
			msg := "mutex: releasing a lock got no answer; it frees itself when its lease runs out"
			if l.retryRelease(ctx, uerr) {
				msg = "mutex: releasing a lock got no answer; trying again until Redis answers, within its lease"
			}
			l.c.log().LogAttrs(ctx, slog.LevelWarn, msg,
				slog.String("key", shortkey.Shorten(l.key)), slog.String("name", l.by.name), slog.String("id", l.by.id),
				slog.String("error", uerr.Error()))
		}
		switch {
		case leaseErr != nil:
			err = join(leaseErr, err)
		case uerr != nil:
			err = join(err, uerr)
		}
	}()
	return fn(fctx)
}

// renewal is the renewal of a lock while WithLock's fn runs. It starts when the
// first renewal is due, so that fn that end sooner (most tasks) cost neither a
// goroutine nor a context for it.
type renewal struct {
	timer *time.Timer

	mu    sync.Mutex
	ended bool
	stop  context.CancelFunc // nil until started
	lost  chan error         // keepAlive's result, once started
}

// renewFrom renews l for ttl from when its first renewal is due (at once for a lease
// shorter than a third of ttl: a lock handed over by a release), cancelling fn's
// context through cancel when the lease is lost (see keepAlive).
func (l *Lock) renewFrom(ctx context.Context, ttl time.Duration, cancel context.CancelCauseFunc) *renewal {
	r := &renewal{}
	every := max(ttl/3, time.Millisecond)
	first := every
	if time.Until(l.validUntil()) < every {
		first = 0
	}
	r.timer = time.AfterFunc(first, func() {
		r.mu.Lock()
		if r.ended {
			r.mu.Unlock()
			return
		}
		kctx, stop := context.WithCancel(context.WithoutCancel(ctx))
		r.stop, r.lost = stop, make(chan error, 1)
		r.mu.Unlock()
		r.lost <- l.keepAlive(kctx, ttl, cancel)
	})
	return r
}

// end stops the renewal, waiting for a renewal on its way, and returns keepAlive's
// result: an error wrapping ErrNotHeld when the lease was lost.
func (r *renewal) end() error {
	r.timer.Stop()
	r.mu.Lock()
	r.ended = true
	stop, lost := r.stop, r.lost
	r.mu.Unlock()
	if stop == nil {
		return nil
	}
	stop()
	return <-lost
}

// keepAlive renews l every ttl/3 until ctx is done, the first time at once. When the
// lease is lost, or cannot be renewed before it ends on our own clock, it cancels fn
// through cancel and returns an error wrapping ErrNotHeld; otherwise it returns nil.
// A lease that ran out before any renewal was sent (the process did not run for all
// of it) is not taken for lost on our clock alone: one renewal goes at once, and its
// answer, awaited for lateAnswer, decides.
//
// A renewal runs in its own goroutine so that a Redis that does not answer cannot
// delay the cancellation past the lease's end (go-redis honours a context's deadline
// only with ContextTimeoutEnabled). Retries fit the lease actually held, which after a
// hand-over is short: a renewal that failed is tried again within a quarter of the
// lease left, and one that has not answered within a third of the lease left is sent
// again beside it (a renewal is idempotent), up to maxRenewals at once. keepAlive waits
// for them before returning.
func (l *Lock) keepAlive(ctx context.Context, ttl time.Duration, cancel context.CancelCauseFunc) error {
	every := max(ttl/3, time.Millisecond)
	next := time.Now()
	timer := time.NewTimer(every)
	defer timer.Stop()
	type result struct {
		sent time.Time
		err  error
	}
	var (
		results  = make(chan result, maxRenewals)
		inflight int
		lastErr  error
		renewed  time.Time // when the last renewal that succeeded was sent
		sentAny  bool      // a renewal was sent
		late     time.Time // until when a late renewal's answer is awaited (see below)
	)
	defer func() {
		for ; inflight > 0; inflight-- {
			<-results
		}
	}()
	for {
		wake := l.validUntil()
		if late.After(wake) {
			wake = late
		}
		if inflight < maxRenewals && next.Before(wake) {
			wake = next
		}
		timer.Reset(max(time.Until(wake), 0))
		select {
		case <-ctx.Done():
			return nil
		case r := <-results:
			inflight--
			switch {
			case r.err == nil:
				if r.sent.After(renewed) {
					renewed, lastErr, next, late = r.sent, nil, r.sent.Add(every), time.Time{}
				}
			case errors.Is(r.err, ErrNotHeld):
				err := fmt.Errorf("mutex: lease on %s lost: %w", l.what(), ErrNotHeld)
				cancel(err)
				return err
			case ctx.Err() != nil:
				return nil
			case r.sent.Before(renewed):
				// A later renewal succeeded: this one's failure changes nothing.
			case !time.Now().Before(l.validUntil()):
				// The lease has ended on our clock, and this renewal (one sent late, see
				// below) could not extend it.
				err := fmt.Errorf("mutex: lease on %s ran out before it could be renewed: %w", l.what(), ErrNotHeld)
				err = join(err, renewCause(r.err))
				cancel(err)
				return err
			default:
				// Redis did not answer: try again soon, well before the lease ends.
				if lastErr == nil {
					l.c.log().LogAttrs(ctx, slog.LevelWarn, "mutex: renewing a lease got no answer; trying again before it ends",
						slog.String("key", shortkey.Shorten(l.key)), slog.String("name", l.by.name), slog.String("id", l.by.id),
						slog.String("error", r.err.Error()))
				}
				l.emit(ctx, OpRenewFailed, r.err)
				lastErr = r.err
				left := time.Until(l.validUntil())
				retry := time.Now().Add(max(min(every/8+rand.N(every/8+time.Millisecond), left/4), time.Millisecond))
				if retry.Before(next) {
					next = retry
				}
			}
			continue
		case <-timer.C:
		}
		now := time.Now()
		until := l.validUntil()
		if !now.Before(until) && !sentAny {
			// The lease ran out before its first renewal went: this process did not run
			// (stopped, starved of CPU) from the lease's start, a hand-over's short one
			// most likely, to its end. Nothing says the lock was lost: ask Redis, which
			// knows, once and briefly. A renewal that finds our token proves that nobody
			// held the key meanwhile.
			sentAny, inflight = true, inflight+1
			late = now.Add(lateAnswer(every))
			next = late
			go func(sent time.Time) {
				rctx, rcancel := context.WithDeadline(ctx, late)
				defer rcancel()
				results <- result{sent, l.renew(rctx, ttl)}
			}(now)
			continue
		}
		if !now.Before(until) && !now.Before(late) {
			err := fmt.Errorf("mutex: lease on %s ran out before it could be renewed: %w", l.what(), ErrNotHeld)
			if lastErr != nil {
				err = join(err, renewCause(lastErr))
			}
			cancel(err)
			return err
		}
		if now.Before(until) && inflight < maxRenewals && !now.Before(next) {
			inflight, sentAny = inflight+1, true
			// If this one has not answered within a third of the lease left, another
			// goes beside it.
			next = now.Add(max(until.Sub(now)/3, time.Millisecond))
			go func(sent time.Time) {
				rctx, rcancel := context.WithDeadline(ctx, until)
				defer rcancel()
				results <- result{sent, l.renew(rctx, ttl)}
			}(now)
		}
	}
}

// lateAnswer is how long keepAlive waits for the answer of a renewal sent after the
// lease ran out on our clock before any renewal went (see keepAlive): fn runs on
// meanwhile, so it is short.
func lateAnswer(every time.Duration) time.Duration {
	return max(min(every/4, renewedHandOver), time.Millisecond)
}

// maxRenewals is how many renewals of one lease keepAlive has on their way at once.
const maxRenewals = 3

// renewCause is what a failed renewal's error (Lock.Extend's, which names the key)
// says beyond the key: joined to an error that names the key already, so that the
// key is named once.
func renewCause(err error) error {
	if cause := errors.Unwrap(err); cause != nil {
		return cause
	}
	return err
}
