package mutex

import (
	"context"
	"time"

	"github.com/asynqmutex/asynqmutex/internal/store"
)

// releaseRetries bounds how often retryRelease sends a release again; the lease's
// end bounds for how long.
const releaseRetries = 100

// retryRelease sends l's release again in the background when err, the error of its
// release, says that Redis could not be reached or serve the call for a while
// (store.Transient); any other error, or none, is left as it is. It tries with a
// pause growing from 10ms to a second, up to releaseRetries times, until Redis
// answers, and sends no attempt once l's lease would have ended on this process's
// monotonic clock: then the key frees itself. So a key whose release met a Redis
// restart or a dropped connection frees, handed to its waiter, as soon as Redis
// answers again rather than when its lease runs out. A release that arrives late is
// harmless: the script releases only l's own token, and knows a repeat of itself.
//
// The goroutine ends with the lease at the latest (an attempt on its way, within the
// redis client's timeouts), so the Client needs no Close for it, and at its next
// attempt once the redis client is closed. One runs per Lock at a time. A retry that
// releases the lock reports OpReleased, with the caller's context values; the caller
// has already had OpReleaseFailed. retryRelease reports whether a retry runs.
func (l *Lock) retryRelease(ctx context.Context, err error) bool {
	if !store.Transient(err) {
		return false
	}
	l.mu.Lock()
	if l.retrying {
		l.mu.Unlock()
		return true
	}
	l.retrying = true
	l.mu.Unlock()
	ctx = context.WithoutCancel(ctx)
	go func() {
		defer func() {
			l.mu.Lock()
			l.retrying = false
			l.mu.Unlock()
		}()
		var backoff, pause time.Duration
		for range releaseRetries {
			backoff, pause = growBackoff(backoff)
			until := l.validUntil()
			if !time.Now().Add(pause).Before(until) {
				return // the lease ends before the next attempt: the key frees anyway
			}
			time.Sleep(pause)
			actx, cancel := context.WithDeadline(ctx, until)
			r, hs, err := l.kind.release(actx, l.keys, l.id, "", l.fence, "")
			l.c.start(l.starter, hs)
			cancel()
			switch {
			case store.Transient(err):
				continue
			case err == nil && r == releasedOK:
				l.emit(ctx, OpReleased, nil)
			}
			return // answered: released, or not ours any more (nothing changed)
		}
	}()
	return true
}
