package mutex

import (
	"context"
	"errors"
	"log/slog"
	"math/rand/v2"
	"net"
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
// a release hands the lock to the longest-queued waiter of any Client, in the release
// script itself, and tells that waiter's Client on its subscription connection: one
// release, one waiter, no race with newcomers, one round trip from release to
// holding. Waiters are served in the order they first queued and keep their place
// while they wait.
//
// A waiter that gives up (ctx done, MaxWait, a Redis error) leaves the queue and, if
// the lock was handed to it meanwhile, passes it on at once. A release skips waiters
// whose Client no longer listens (it died, or is reconnecting and will try again when
// it listens again). A waiter that cannot hear it is handed the lock anyway when Redis
// still counts its connection (its network vanished without a reset) or cannot count
// (Redis Cluster, where PUBLISH counts one node's subscribers): the lock then frees when
// the lease it was handed ends. That lease is ttl for Lock, and 250ms for WithLock,
// whose first renewal lengthens it to ttl. When nothing comes (the holder
// crashed), a waiter tries again when the holder's remaining lease runs out, plus a
// little random jitter. A subscription connection that stops answering is noticed
// within 3s (see Client), after which every waiter of the Client tries again.
//
// ttl is rounded down to whole milliseconds and must lie between MinTTL and MaxTTL;
// key must not be empty.
func (c *Client) Lock(ctx context.Context, key string, ttl time.Duration, opts ...LockOption) (*Lock, error) {
	a, err := c.newAcquisition(key, ttl, opts)
	if err != nil {
		return nil, err
	}
	return c.acquire(ctx, a)
}

// acquire takes the lock for a, waiting as a.maxWait says, and reports the outcome to
// the Client's observers.
func (c *Client) acquire(ctx context.Context, a *acquisition) (*Lock, error) {
	l, err := c.obtain(ctx, a)
	if a.given != nil && l == nil && errors.Is(err, ErrNotObtained) && a.contended {
		for i, j := range a.order {
			if j == a.busy {
				err = &busyError{key: a.given[i], err: err}
			}
		}
	}
	if c.observe != nil {
		e := Event{Key: a.key, Keys: a.given, Name: a.by.name, ID: a.by.id, Contended: a.contended, Err: err}
		switch {
		case l == nil:
			e.Op, e.Wait = OpNotObtained, time.Since(a.start)
		case a.contended:
			e.Op, e.Fence, e.Wait = OpAcquired, l.fence, l.taken.Sub(a.start)
		default:
			e.Op, e.Fence = OpAcquired, l.fence
		}
		c.observe(ctx, e)
	}
	return l, err
}

func (c *Client) obtain(ctx context.Context, a *acquisition) (*Lock, error) {
	if a.maxWait == 0 {
		l, _, err := c.attempt(ctx, a, nil)
		if err == nil && l == nil {
			err = ErrNotObtained
		}
		return l, err
	}
	start := time.Now()
	// Join before the first attempt: a release may hand us the lock as soon as that
	// attempt has queued us, before it even returns.
	w := c.hub.join(a)
	acquired := false
	defer func() { c.hub.leave(ctx, w, acquired) }()

	l, pttl, err := c.attempt(ctx, a, w)
	if l != nil || err != nil {
		acquired = l != nil
		return l, err
	}
	// A hand-over published before the subscription is confirmed reaches nobody, and
	// the release passes us over: every waiter tries again on confirmation.
	c.hub.ensure()
	var deadline <-chan time.Time
	if a.maxWait > 0 {
		t := time.NewTimer(a.maxWait - time.Since(start))
		defer t.Stop()
		deadline = t.C
	}
	timer := time.NewTimer(a.retryAfter(pttl))
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil, errors.Join(ErrNotObtained, ctx.Err())
		case <-deadline:
			return nil, ErrNotObtained
		case f := <-w.grant:
			if a.given != nil {
				// One of several locks: the attempt below takes the rest, or waits
				// for the next busy one, keeping this one.
				break
			}
			// The release that handed us the lock ran after our last attempt was sent,
			// so the lease counts from no earlier than that.
			lease := a.handOverLease()
			if l := a.lock([]int64{f}, w.sent, lease); time.Until(l.validUntil()) > lease/2 {
				l.taken = time.Now() // its wait ended now, not when its attempt was sent
				acquired = true
				return l, nil
			}
			// Most of that lease may have passed: the attempt below renews it.
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
		timer.Reset(a.retryAfter(pttl))
	}
}

// retryAfter is how long a waiter that hears nothing sleeps: until the holder's lease
// runs out, plus jitter so that waiters of a crashed holder do not all arrive at once.
// A waiter that keeps locks taken before a busy one comes back within a third of
// its lease, and its attempt renews them.
func (a *acquisition) retryAfter(pttl time.Duration) time.Duration {
	if pttl < 0 || pttl > MaxTTL { // no expiry, or set by hand: look again later
		pttl = time.Second
	}
	d := pttl + rand.N(pttl/8+time.Millisecond)
	if a.kept > 0 {
		d = min(d, a.ttl/3)
	}
	return d
}

const (
	// hubLinger is how long the subscription connection stays open after the last
	// waiter left, so that bursts of contention do not dial a connection each.
	hubLinger = 200 * time.Millisecond

	// healthEvery is how long the subscription may be silent before it is sent a
	// PING; a connection that then stays silent as long again is replaced. A dead
	// connection is thus noticed within 2*healthEvery plus a read's scheduling.
	healthEvery = time.Second
)

// hub receives the hand-overs addressed to one Client's waiters, on one pub/sub
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
}

// subscription is one pub/sub connection (replaced when it dies silently) and the
// goroutine that reads it.
type subscription struct {
	ps   *redis.PubSub // guarded by hub.mu
	stop chan struct{}
	done chan struct{}
}

type waiter struct {
	a      *acquisition
	id     string
	head   string     // "<client>.<waiter> <hand-over lease ms>", as lock.lua queues it
	entry  string     // the queue entry lock.lua writes: head, then the identity
	queued bool       // an attempt may have queued it: take it out when done
	sent   time.Time  // when the last attempt was sent
	grant  chan int64 // capacity 1: the fence of a hand-over
	wake   chan struct{}
}

func newHub(c *Client) *hub {
	id := newToken() // base64url: no '.'
	return &hub{
		c: c, id: id, channel: c.channels + id, linger: hubLinger,
		waiters: make(map[string]*waiter),
	}
}

// join registers a waiter for a.
func (h *hub) join(a *acquisition) *waiter {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.idle != nil {
		h.idle.Stop()
		h.idle = nil
	}
	h.seq++
	id := strconv.FormatUint(h.seq, 36)
	head := h.id + "." + id + " " + strconv.FormatInt(a.handOverLease().Milliseconds(), 10)
	if a.limit > 1 {
		head += "/" + strconv.Itoa(a.limit) // the limit it waits under (semaphore.lua)
	}
	w := &waiter{
		a: a, id: id, head: head, entry: head + " " + a.id + a.desc,
		grant: make(chan int64, 1), wake: make(chan struct{}, 1),
	}
	h.waiters[id] = w
	return w
}

// ensure opens the subscription if it is not open.
func (h *hub) ensure() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.cur == nil {
		h.cur = h.start()
	}
}

// leave removes w. If w gave up after an attempt may have queued it, it is taken out
// of the key's queue, and a lock handed to it meanwhile is passed on, so that a
// waiter who left does not swallow a release.
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
	h.c.giveBack(ctx, w.a, w.a.keys, w.entry)
}

// start opens the subscription connection and starts reading it. Called with hub.mu
// held; the connection is dialled by the reading goroutine.
func (h *hub) start() *subscription {
	s := &subscription{
		ps:   h.c.rdb.Subscribe(context.Background()),
		stop: make(chan struct{}),
		done: make(chan struct{}),
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
	ps := s.ps
	h.mu.Unlock()
	close(s.stop)
	_ = ps.Close()
	<-s.done
}

func (h *hub) read(s *subscription) {
	defer close(s.done)
	h.mu.Lock()
	ps := s.ps
	h.mu.Unlock()
	backoff := 10 * time.Millisecond
	subscribe, pinged, lost := true, false, false
	wakeupLost := func(err error) {
		// A connection closed on our side (the redis client was closed) is no fault
		// to report.
		if !lost && !errors.Is(err, net.ErrClosed) && !errors.Is(err, redis.ErrClosed) {
			lost = true
			h.c.log().LogAttrs(context.Background(), slog.LevelWarn, "mutex: subscription for hand-overs lost; waiters try again, and again once it is back",
				slog.String("error", err.Error()))
			h.c.emit(context.Background(), Event{Op: OpWakeupLost, Err: err})
		}
	}
	for {
		var (
			msg any
			err error
		)
		if subscribe {
			// go-redis records the channel and subscribes again by itself after
			// reconnecting; a failed write shows up as an error from Receive.
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			err = ps.Subscribe(ctx, h.channel)
			cancel()
			subscribe = err != nil
		}
		if err == nil {
			msg, err = ps.ReceiveTimeout(context.Background(), healthEvery)
		}
		if err != nil && isTimeout(err) {
			if !pinged {
				pinged = true
				if err = ps.Ping(context.Background()); err == nil {
					continue
				}
			} else if ps = h.replace(s); ps != nil {
				// Silent for a whole interval after a PING: the connection is dead
				// though nothing said so (a lost network, a frozen server).
				subscribe, pinged = true, false
				wakeupLost(errors.New("subscription connection silent after a PING; replaced"))
			} else {
				return
			}
		}
		if err != nil {
			select {
			case <-s.stop:
				return
			default:
			}
			// The connection broke: hand-overs may have been lost, and go-redis will
			// resubscribe on the next Receive. Let every waiter try again now, and
			// again when the subscription is confirmed.
			wakeupLost(err)
			h.mu.Lock()
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
		backoff, pinged = 10*time.Millisecond, false
		switch m := msg.(type) {
		case *redis.Subscription:
			if m.Kind == "subscribe" {
				// Releases while we were not subscribed passed our waiters over: each
				// tries again, which queues it again if it has to.
				h.mu.Lock()
				h.wakeAll()
				h.mu.Unlock()
				if lost {
					lost = false
					h.c.log().LogAttrs(context.Background(), slog.LevelInfo, "mutex: subscription for hand-overs is back")
					h.c.emit(context.Background(), Event{Op: OpWakeupRecovered})
				}
			}
		case *redis.Message:
			h.handedOver(m.Payload)
		}
	}
}

// replace closes s's connection and gives s a new one, unless s was shut; then it
// returns nil.
func (h *hub) replace(s *subscription) *redis.PubSub {
	h.mu.Lock()
	if h.cur != s {
		h.mu.Unlock()
		return nil
	}
	old := s.ps
	s.ps = h.c.rdb.Subscribe(context.Background())
	ps := s.ps
	h.mu.Unlock()
	_ = old.Close()
	return ps
}

// handedOver handles "<waiter> <fence>" from a release: the lock is that waiter's;
// fence 0 means that the waiter was taken out of the queue without it, and should
// try again now (semaphore.lua). A waiter that has left is not told: its leave
// passes the lock on.
func (h *hub) handedOver(payload string) {
	id, fence, ok := strings.Cut(payload, " ")
	f, err := strconv.ParseInt(fence, 10, 64)
	if !ok || err != nil {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	w := h.waiters[id]
	switch {
	case w == nil:
	case f == 0:
		select {
		case w.wake <- struct{}{}:
		default:
		}
	default:
		select {
		case w.grant <- f:
		default:
		}
	}
}

// wakeAll makes every waiter try again. Called with hub.mu held.
func (h *hub) wakeAll() {
	for _, w := range h.waiters {
		select {
		case w.wake <- struct{}{}:
		default:
		}
	}
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}
