package mutex

import (
	"context"
	"errors"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// Lock takes the lock on key for ttl, waiting while another holder has it: until the
// lock is obtained, ctx is done, or the MaxWait option's bound elapses. It returns
// ErrNotObtained when the wait ended without the lock (joined with ctx.Err() when ctx
// ended it) and a wrapped Redis error when Redis cannot be reached (after trying to
// release anything the failed attempt may have taken).
//
// A waiter does not poll. A failed attempt queues it in Redis, in the same script, and
// a release wakes the longest-queued waiter of any Client through that Client's
// subscription connection: one release, one waiter woken. (In Redis Cluster, where a
// release cannot tell whether a wake-up was received, a waiter whose Client died can
// swallow one; the next waiter then comes back when the lease would have ended.) When
// nothing wakes it (the holder crashed), a waiter tries again when the holder's
// remaining lease runs out, plus a little random jitter. ttl is rounded down to whole milliseconds and must be
// at least 1ms; key must not be empty.
func (c *Client) Lock(ctx context.Context, key string, ttl time.Duration, opts ...LockOption) (*Lock, error) {
	a, err := c.newAcquisition(key, ttl, opts)
	if err != nil {
		return nil, err
	}
	return c.acquire(ctx, a)
}

func (c *Client) acquire(ctx context.Context, a *acquisition) (*Lock, error) {
	if a.maxWait == 0 {
		l, _, err := c.attempt(ctx, a, nil)
		if err == nil && l == nil {
			err = ErrNotObtained
		}
		return l, err
	}
	start := time.Now()
	// Join before the first attempt: a release may wake us as soon as that attempt
	// has queued us, before it even returns.
	w, confirmed := c.hub.join(a.rkey)
	acquired := false
	defer func() { c.hub.leave(ctx, w, acquired) }()

	l, pttl, err := c.attempt(ctx, a, w)
	if l != nil || err != nil {
		acquired = l != nil
		return l, err
	}
	// A release published before our Client's subscription is confirmed is lost: in
	// that case try once more when it is confirmed.
	ready := c.hub.ensure(confirmed)
	var deadline <-chan time.Time
	if a.maxWait > 0 {
		t := time.NewTimer(a.maxWait - time.Since(start))
		defer t.Stop()
		deadline = t.C
	}
	timer := time.NewTimer(retryAfter(pttl))
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil, errors.Join(ErrNotObtained, ctx.Err())
		case <-deadline:
			return nil, ErrNotObtained
		case <-ready:
			ready = nil
		case <-w.wake:
		case <-timer.C:
		}
		l, pttl, err = c.attempt(ctx, a, w)
		if l != nil {
			acquired = true
			return l, nil
		}
		if err != nil {
			return nil, err
		}
		timer.Reset(retryAfter(pttl))
	}
}

// retryAfter is how long a waiter that hears nothing sleeps: until the holder's lease
// runs out, plus jitter so that waiters of a crashed holder do not all arrive at once.
func retryAfter(pttl time.Duration) time.Duration {
	if pttl < 0 { // the key has no expiry: someone set it by hand
		pttl = time.Second
	}
	return pttl + rand.N(pttl/8+time.Millisecond)
}

// hubLinger is how long the subscription connection stays open after the last waiter
// left, so that bursts of contention do not dial a connection each.
const hubLinger = 200 * time.Millisecond

// hub receives the wake-ups addressed to one Client's waiters, on one pub/sub
// connection subscribed to the Client's own channel.
type hub struct {
	c       *Client
	id      string // this Client's name in wait queues; no '.'
	channel string
	linger  time.Duration

	mu      sync.Mutex
	waiters map[string]*waiter // by waiter id
	seq     uint64
	cur     *subscription // nil while nobody waits and the linger has passed
	idle    *time.Timer
	passing sync.WaitGroup // wake-ups being passed on
}

// subscription is one pub/sub connection and the goroutine that reads it.
type subscription struct {
	ps    *redis.PubSub
	ready chan struct{} // closed when Redis confirmed the subscription; replaced after a reconnect
	stop  chan struct{}
	done  chan struct{}
}

type waiter struct {
	id, rkey string
	member   string        // "<client>.<waiter>" in the key's wait queue
	queued   bool          // an attempt may have queued it: remove it when done
	wake     chan struct{} // capacity 1: a wake-up not yet acted on
}

func newHub(c *Client) *hub {
	id := newToken() // base64url: no '.'
	return &hub{
		c: c, id: id, channel: c.prefix + channelInfix + id, linger: hubLinger,
		waiters: make(map[string]*waiter),
	}
}

// join registers a waiter for rkey and reports whether the subscription was
// confirmed at that moment (see ensure).
func (h *hub) join(rkey string) (*waiter, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.idle != nil {
		h.idle.Stop()
		h.idle = nil
	}
	h.seq++
	id := strconv.FormatUint(h.seq, 36)
	w := &waiter{id: id, rkey: rkey, member: h.id + "." + id, wake: make(chan struct{}, 1)}
	h.waiters[id] = w
	return w, h.cur != nil && isClosed(h.cur.ready)
}

// ensure opens the subscription if needed. If it was not confirmed when the waiter
// joined, it returns a channel closed on confirmation; otherwise nil, since the
// confirmed subscription saw every wake-up since.
func (h *hub) ensure(confirmed bool) <-chan struct{} {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.cur == nil {
		h.cur = h.start()
	}
	if confirmed {
		return nil
	}
	return h.cur.ready
}

// leave removes w. If w gave up, it is taken out of the key's queue; a wake-up it
// received but did not use is passed on, so that a waiter who left does not swallow
// a release.
func (h *hub) leave(ctx context.Context, w *waiter, acquired bool) {
	h.mu.Lock()
	delete(h.waiters, w.id)
	if len(h.waiters) == 0 && h.cur != nil && h.idle == nil {
		h.idle = time.AfterFunc(h.linger, h.closeIfIdle)
	}
	h.mu.Unlock()
	if acquired || !w.queued {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
	defer cancel()
	_ = unwaitScript.Run(ctx, h.c.rdb, []string{w.rkey + waitSuffix, w.rkey + claimSuffix}, w.member).Err()
	if len(w.wake) > 0 {
		_, _ = h.c.release(ctx, w.rkey, "")
	}
}

// start opens the subscription connection and starts reading it. Called with hub.mu
// held; the connection is dialled by the reading goroutine.
func (h *hub) start() *subscription {
	s := &subscription{
		ps:    h.c.rdb.Subscribe(context.Background()),
		ready: make(chan struct{}),
		stop:  make(chan struct{}),
		done:  make(chan struct{}),
	}
	go h.read(s)
	return s
}

func (h *hub) closeIfIdle() { h.shut(false) }

func (h *hub) close() { h.shut(true) }

// shut closes the subscription: when nobody waits, or always when force is set.
func (h *hub) shut(force bool) {
	h.mu.Lock()
	s := h.cur
	if s == nil || (!force && len(h.waiters) > 0) {
		h.mu.Unlock()
		return
	}
	h.cur = nil
	if h.idle != nil {
		h.idle.Stop()
		h.idle = nil
	}
	h.wakeAll() // waiters left behind try again now, then by their holders' leases
	h.mu.Unlock()
	close(s.stop)
	_ = s.ps.Close()
	<-s.done
	h.passing.Wait()
}

func (h *hub) read(s *subscription) {
	defer close(s.done)
	backoff := 10 * time.Millisecond
	subscribe := true
	for {
		var (
			msg any
			err error
		)
		if subscribe {
			// go-redis records the channel and subscribes again by itself after
			// reconnecting; a failed write shows up as an error from Receive.
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			err = s.ps.Subscribe(ctx, h.channel)
			cancel()
			subscribe = err != nil
		}
		if err == nil {
			msg, err = s.ps.Receive(context.Background())
		}
		if err != nil {
			select {
			case <-s.stop:
				return
			default:
			}
			// The connection broke: wake-ups may have been lost, and go-redis will
			// resubscribe on the next Receive. Let every waiter try again now, and wait
			// for a new confirmation before trusting the subscription.
			h.mu.Lock()
			if isClosed(s.ready) {
				s.ready = make(chan struct{})
			}
			h.wakeAll()
			h.mu.Unlock()
			t := time.NewTimer(backoff)
			select {
			case <-s.stop:
				t.Stop()
				return
			case <-t.C:
			}
			backoff = min(2*backoff, time.Second)
			continue
		}
		backoff = 10 * time.Millisecond
		switch m := msg.(type) {
		case *redis.Subscription:
			if m.Kind == "subscribe" {
				h.mu.Lock()
				if !isClosed(s.ready) {
					close(s.ready)
				}
				h.mu.Unlock()
			}
		case *redis.Message:
			h.woken(m.Payload)
		}
	}
}

// woken handles "<waiter> <lock key>" from a release: it wakes that waiter, or, if it
// has left, passes the wake-up on to the key's next waiter.
func (h *hub) woken(payload string) {
	id, rkey, ok := strings.Cut(payload, " ")
	if !ok {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if w := h.waiters[id]; w != nil {
		select {
		case w.wake <- struct{}{}:
		default:
		}
		return
	}
	h.passing.Add(1)
	go func() {
		defer h.passing.Done()
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_, _ = h.c.release(ctx, rkey, "")
	}()
}

// wakeAll wakes every waiter. Called with hub.mu held.
func (h *hub) wakeAll() {
	for _, w := range h.waiters {
		select {
		case w.wake <- struct{}{}:
		default:
		}
	}
}

func isClosed(ch chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}
