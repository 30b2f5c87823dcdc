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

	"github.com/asynqmutex/asynqmutex/internal/store"
)

// hubLinger is how long the subscription connection stays open after the last waiter
// left, so that bursts of contention do not dial a connection each.
const hubLinger = 200 * time.Millisecond

// hub receives the hand-overs addressed to one Client's waiters, on one pub/sub
// connection subscribed to the Client's own channel, which a store.Follower follows:
// a dead connection is noticed within 2*store.HealthEvery plus a read's scheduling.
type hub struct {
	c       *Client
	id      string // this Client's name in wait queues; no '.'
	channel string
	linger  time.Duration

	mu      sync.Mutex
	waiters map[string]*waiter // by waiter id
	seq     uint64
	cur     *store.Follower // nil while nobody waits and the linger has passed
	idle    *time.Timer
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
		h.cur = h.c.run.Follow(h.events(), h.channel)
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

func (h *hub) closeIfIdle() { h.shut(false) }

func (h *hub) close() { h.shut(true) }

// shut closes the subscription: when nobody waits, or always when force is set.
func (h *hub) shut(force bool) {
	h.mu.Lock()
	f := h.cur
	if f == nil || (!force && len(h.waiters) > 0) {
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
	f.Close()
}

// events is what the hub does on what its follower tells: a message is a hand-over
// to one waiter; a broken connection, or a subscription confirmed, makes every
// waiter try again, since hand-overs may have passed it over meanwhile. A break is
// logged and reported once until the subscription is confirmed again.
func (h *hub) events() store.Events {
	lost := false // touched by the follower's goroutine alone
	return store.Events{
		Message: func(_, payload string) { h.handedOver(payload) },
		Subscribed: func(string) {
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
		},
		Broken: func(err error) {
			// A connection closed on our side (the redis client was closed) is no
			// fault to report.
			if !lost && !errors.Is(err, net.ErrClosed) && !errors.Is(err, redis.ErrClosed) {
				lost = true
				h.c.log().LogAttrs(context.Background(), slog.LevelWarn, "mutex: subscription for hand-overs lost; waiters try again, and again once it is back",
					slog.String("error", err.Error()))
				h.c.emit(context.Background(), Event{Op: OpWakeupLost, Err: err})
			}
			// Hand-overs may have been lost: every waiter tries again now, and again
			// when the subscription is confirmed.
			h.mu.Lock()
			h.wakeAll()
			h.mu.Unlock()
		},
	}
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
