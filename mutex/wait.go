package mutex

import (
	"context"
	"errors"
	"math/rand/v2"
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
// A waiter does not poll. Unlock publishes on the key's channel, and each Client wakes
// one of its own waiters for that key, which then tries again; when nothing is
// published (the holder crashed), the waiter tries again when the holder's remaining
// lease runs out, plus a little random jitter. ttl is rounded down to whole
// milliseconds and must be at least 1ms; key must not be empty.
func (c *Client) Lock(ctx context.Context, key string, ttl time.Duration, opts ...LockOption) (*Lock, error) {
	a, err := c.newAcquisition(key, ttl, opts)
	if err != nil {
		return nil, err
	}
	return c.acquire(ctx, a)
}

func (c *Client) acquire(ctx context.Context, a *acquisition) (*Lock, error) {
	start := time.Now()
	before := c.hub.snapshot(a.rkey)
	l, pttl, err := c.attempt(ctx, a)
	if l != nil || err != nil {
		return l, err
	}
	if a.maxWait == 0 {
		return nil, ErrNotObtained
	}
	var deadline <-chan time.Time
	if a.maxWait > 0 {
		t := time.NewTimer(a.maxWait - time.Since(start))
		defer t.Stop()
		deadline = t.C
	}

	w := c.hub.join(a.rkey)
	acquired := false
	defer func() { c.hub.leave(w, acquired) }()

	// A release between the first attempt and our subscription would wake nobody, so
	// unless the key's channel was already subscribed before that attempt, try once
	// more as soon as Redis confirms the subscription.
	var subscribed <-chan struct{}
	if ready, ok := c.hub.unchanged(w, before); !ok {
		subscribed = ready
	}
	timer := time.NewTimer(retryAfter(pttl))
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil, errors.Join(ErrNotObtained, ctx.Err())
		case <-deadline:
			return nil, ErrNotObtained
		case <-subscribed:
			subscribed = nil
		case <-w.wake:
		case <-timer.C:
		}
		l, pttl, err = c.attempt(ctx, a)
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

// hub delivers release notifications to the waiters of one Client over one pub/sub
// connection, subscribed to the channels of the keys that have local waiters.
type hub struct {
	c      *Client
	linger time.Duration

	mu     sync.Mutex
	queues map[string]*queue // by Redis key, which is also the channel name
	cur    *subscription     // nil while nobody waits and the linger has passed
	idle   *time.Timer

	opsMu sync.Mutex // keeps SUBSCRIBE and UNSUBSCRIBE in the order they were decided
}

// subscription is one pub/sub connection and the goroutine that reads it.
type subscription struct {
	ps       *redis.PubSub
	channels map[string]bool // guarded by hub.opsMu
	stop     chan struct{}
	done     chan struct{}
}

// queue holds the local waiters of one key, oldest first.
type queue struct {
	rkey    string
	waiters []*waiter
	ready   chan struct{} // closed when Redis confirmed the subscription
	epoch   uint64        // grows when the connection was lost and ready reopened
	pending bool          // a release came while every waiter had a wake-up already
}

type waiter struct {
	q    *queue
	wake chan struct{} // capacity 1: a wake-up not yet acted on
}

// snap records a key's queue before a first attempt; see hub.unchanged.
type snap struct {
	q     *queue
	epoch uint64
}

func newHub(c *Client) *hub {
	return &hub{c: c, linger: hubLinger, queues: make(map[string]*queue)}
}

// snapshot returns the key's queue if its channel is subscribed and confirmed.
func (h *hub) snapshot(rkey string) snap {
	h.mu.Lock()
	defer h.mu.Unlock()
	q := h.queues[rkey]
	if q == nil || !isClosed(q.ready) {
		return snap{}
	}
	return snap{q: q, epoch: q.epoch}
}

// unchanged reports whether w's queue was subscribed when before was taken and has
// stayed so: then every release since reached this Client and woke someone. It also
// returns the channel closed when the subscription is confirmed.
func (h *hub) unchanged(w *waiter, before snap) (chan struct{}, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return w.q.ready, before.q == w.q && w.q.epoch == before.epoch && isClosed(w.q.ready)
}

func (h *hub) join(rkey string) *waiter {
	h.mu.Lock()
	if h.idle != nil {
		h.idle.Stop()
		h.idle = nil
	}
	var resync []string // keys that waited through a Close: subscribe them again
	if h.cur == nil {
		h.cur = h.start()
		for k := range h.queues {
			resync = append(resync, k)
		}
	}
	s := h.cur
	q := h.queues[rkey]
	if q == nil {
		q = &queue{rkey: rkey, ready: make(chan struct{})}
		h.queues[rkey] = q
		resync = append(resync, rkey)
	}
	w := &waiter{q: q, wake: make(chan struct{}, 1)}
	q.waiters = append(q.waiters, w)
	if q.pending {
		q.pending = false
		w.wake <- struct{}{}
	}
	h.mu.Unlock()
	for _, k := range resync {
		h.sync(s, k)
	}
	return w
}

// leave removes w. A wake-up that w received but did not use (it gave up, or got the
// lock for another reason) passes to the next waiter unless w got the lock.
func (h *hub) leave(w *waiter, acquired bool) {
	h.mu.Lock()
	q := w.q
	for i, x := range q.waiters {
		if x == w {
			q.waiters = append(q.waiters[:i], q.waiters[i+1:]...)
			break
		}
	}
	if len(w.wake) > 0 && !acquired {
		q.wakeOne()
	}
	var s *subscription
	if len(q.waiters) == 0 && h.queues[q.rkey] == q {
		delete(h.queues, q.rkey)
		s = h.cur
		if len(h.queues) == 0 && h.cur != nil && h.idle == nil {
			h.idle = time.AfterFunc(h.linger, h.closeIfIdle)
		}
	}
	h.mu.Unlock()
	if s != nil {
		h.sync(s, q.rkey)
	}
}

// wakeOne wakes the oldest waiter without a wake-up, or remembers the release for the
// next one that joins. Called with hub.mu held.
func (q *queue) wakeOne() {
	for _, w := range q.waiters {
		select {
		case w.wake <- struct{}{}:
			return
		default:
		}
	}
	q.pending = true
}

// sync subscribes or unsubscribes the channel of rkey on s to match whether the key
// has waiters now. Calls are serialized so Redis sees them in decision order.
func (h *hub) sync(s *subscription, rkey string) {
	h.opsMu.Lock()
	defer h.opsMu.Unlock()
	h.mu.Lock()
	want := h.cur == s && h.queues[rkey] != nil
	h.mu.Unlock()
	if want == s.channels[rkey] {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	// go-redis records the channel before writing, and resubscribes recorded channels
	// when it reconnects, so a failed write here is repaired by the reconnect.
	if want {
		_ = s.ps.Subscribe(ctx, rkey)
		s.channels[rkey] = true
	} else {
		_ = s.ps.Unsubscribe(ctx, rkey)
		delete(s.channels, rkey)
	}
}

// start opens the subscription connection lazily and starts reading it. Called with
// hub.mu held; no I/O happens here.
func (h *hub) start() *subscription {
	s := &subscription{
		ps:       h.c.rdb.Subscribe(context.Background()),
		channels: make(map[string]bool),
		stop:     make(chan struct{}),
		done:     make(chan struct{}),
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
	if s == nil || (!force && len(h.queues) > 0) {
		h.mu.Unlock()
		return
	}
	h.cur = nil
	if h.idle != nil {
		h.idle.Stop()
		h.idle = nil
	}
	h.resetLocked() // waiters left behind retry now, then by their holders' leases
	h.mu.Unlock()
	close(s.stop)
	_ = s.ps.Close()
	<-s.done
}

func (h *hub) read(s *subscription) {
	defer close(s.done)
	backoff := 10 * time.Millisecond
	for {
		msg, err := s.ps.Receive(context.Background())
		if err != nil {
			select {
			case <-s.stop:
				return
			default:
			}
			// The connection broke: releases may have been missed, and go-redis will
			// resubscribe on the next Receive. Let every waiter try again now, and wait
			// for new confirmations before trusting the subscriptions.
			h.reset()
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
				h.confirmed(m.Channel)
			}
		case *redis.Message:
			h.released(m.Channel)
		}
	}
}

func (h *hub) confirmed(ch string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if q := h.queues[ch]; q != nil && !isClosed(q.ready) {
		close(q.ready)
	}
}

func (h *hub) released(ch string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if q := h.queues[ch]; q != nil {
		q.wakeOne()
	}
}

func (h *hub) reset() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.resetLocked()
}

// resetLocked marks every subscription unconfirmed and wakes every waiter, after
// releases may have been missed. Called with hub.mu held.
func (h *hub) resetLocked() {
	for _, q := range h.queues {
		q.epoch++
		if isClosed(q.ready) {
			q.ready = make(chan struct{})
		}
		for _, w := range q.waiters {
			select {
			case w.wake <- struct{}{}:
			default:
			}
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
