package order

import (
	"context"
	"sync"
	"time"

	"github.com/asynqmutex/asynqmutex/internal/store"
)

// listener shares one pub/sub connection among a Sequencer's waiting Awaits: it is
// subscribed to a key's channel while an Await waits on that key, passes each
// announcement on the channel to the key's waiters, and tells every waiter to ask
// again when a subscription is confirmed (again, after a reconnection) or the
// connection broke, since announcements may have been lost meanwhile. The
// connection is open only while someone waits; a store.Follower follows it, noticing
// a dead one within 2*store.HealthEvery.
type listener struct {
	run *store.Runner

	// wmu orders the changes to the subscription (opening the follower, subscribing,
	// unsubscribing, closing it), so that the last one matches what the waiters want.
	// Taken before mu, never while mu is held.
	wmu sync.Mutex

	mu    sync.Mutex
	cur   *store.Follower
	chans map[string]*channel
}

// channel is a key's channel: its waiters, and whether the server confirmed the
// subscription to it on the current connection.
type channel struct {
	waiters   map[*listen]struct{}
	confirmed bool
}

// listen is one Await's place in the listener.
type listen struct {
	name string
	kick chan struct{} // has a value when news or again changed

	mu    sync.Mutex
	news  []string // announcements not yet read
	again bool     // ask again: a subscription was confirmed, or the connection broke
}

func newListener(run *store.Runner) *listener {
	return &listener{run: run, chans: map[string]*channel{}}
}

// join registers a waiter on the channel name, subscribing to it if nobody listens
// to it yet. The waiter is told to ask again once the subscription is confirmed; and
// at once, if it is already and ask is set (the waiter's question came before it
// joined).
func (l *listener) join(name string, ask bool) *listen {
	w := &listen{name: name, kick: make(chan struct{}, 1)}
	l.mu.Lock()
	c := l.chans[name]
	if c == nil {
		c = &channel{waiters: map[*listen]struct{}{}}
		l.chans[name] = c
	}
	c.waiters[w] = struct{}{}
	if c.confirmed && ask {
		w.add("")
	}
	l.mu.Unlock()
	l.sync(name)
	return w
}

// leave removes w, unsubscribing from its channel when it was the last waiter on
// it, and closing the connection when nobody waits.
func (l *listener) leave(w *listen) {
	l.mu.Lock()
	if c := l.chans[w.name]; c != nil {
		delete(c.waiters, w)
	}
	l.mu.Unlock()
	l.sync(w.name)
}

// sync makes the connection match what the waiters want for the channel name: open
// and subscribed while someone waits on it, unsubscribed after, closed when nobody
// waits on any.
func (l *listener) sync(name string) {
	l.wmu.Lock()
	defer l.wmu.Unlock()
	l.mu.Lock()
	c := l.chans[name]
	want := c != nil && len(c.waiters) > 0
	if !want && c != nil {
		delete(l.chans, name)
	}
	cur, opened := l.cur, false
	if want && cur == nil {
		cur, opened = l.run.Follow(l.events(), name), true // it subscribes to name
		l.cur = cur
	}
	idle := len(l.chans) == 0
	if idle {
		l.cur = nil
	}
	l.mu.Unlock()

	switch {
	case cur == nil, opened:
	case idle:
		// Under wmu: a connection opened next starts once this one's events ended.
		cur.Close()
	case want:
		cur.Subscribe(name)
	default:
		cur.Unsubscribe(name)
	}
}

// events is what the listener does on what its follower tells: an announcement goes
// to its channel's waiters; a confirmed subscription makes that channel's waiters ask
// again, a broken connection every waiter.
func (l *listener) events() store.Events {
	return store.Events{
		Message:    l.tell,
		Subscribed: l.confirmed,
		Broken:     func(error) { l.askAll() },
	}
}

// tell passes an announcement on channel name to its waiters; "" tells them to ask
// again.
func (l *listener) tell(name, payload string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if c := l.chans[name]; c != nil {
		for w := range c.waiters {
			w.add(payload)
		}
	}
}

// confirmed records that the server confirmed the subscription to channel name, and
// tells its waiters to ask again: an announcement before it was not heard.
func (l *listener) confirmed(name string) {
	l.mu.Lock()
	if c := l.chans[name]; c != nil {
		c.confirmed = true
	}
	l.mu.Unlock()
	l.tell(name, "")
}

// askAll tells every waiter to ask again, the connection having broken: no
// subscription counts as confirmed until the server confirms it again.
func (l *listener) askAll() {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, c := range l.chans {
		c.confirmed = false
		for w := range c.waiters {
			w.add("")
		}
	}
}

// add records an announcement, or "" for ask again, and wakes the waiter.
func (w *listen) add(payload string) {
	w.mu.Lock()
	if payload == "" {
		w.again = true
	} else if len(w.news) < maxNews {
		w.news = append(w.news, payload)
	} else {
		w.again, w.news = true, w.news[:0] // too many to keep: ask instead
	}
	w.mu.Unlock()
	select {
	case w.kick <- struct{}{}:
	default:
	}
}

// maxNews bounds the announcements a waiter keeps between two reads.
const maxNews = 64

// next waits until there is news, ctx ends, or the timer fires; it returns the
// announcements and whether to ask again, and false when it did not wake for news.
func (w *listen) next(ctx context.Context, timer <-chan time.Time) (news []string, again, ok bool) {
	select {
	case <-w.kick:
	case <-ctx.Done():
		return nil, false, false
	case <-timer:
		return nil, false, false
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	news, again = w.news, w.again
	w.news, w.again = nil, false
	return news, again, true
}
