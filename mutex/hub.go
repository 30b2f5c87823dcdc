package mutex

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"strconv"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

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
	head   string     // the head of its queue entry (layout.go)
	entry  string     // its queue entry, as the lock scripts write it: head, then who it is
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
	head := entryHead(h.id, id, a.handOverLease(), a.limit)
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
		ps:   h.c.run.Subscribe(context.Background()),
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
	s.ps = h.c.run.Subscribe(context.Background())
	ps := s.ps
	h.mu.Unlock()
	_ = old.Close()
	return ps
}

// handedOver handles a wake-up message (layout.go): the lock is the waiter's, with
// the fence given; or, fence 0, the waiter was taken out of the queue without it, and
// should try again now. A waiter that has left is not told: its leave passes the lock
// on.
func (h *hub) handedOver(payload string) {
	id, f, ok := parseWake(payload)
	if !ok {
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
