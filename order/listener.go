package order

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex/internal/store"
)

// listenHealthEvery is how long the shared subscription may be silent before it is
// sent a PING; one silent for another such interval after it is dialled again. A dead
// connection is thus noticed within 2*listenHealthEvery.
const listenHealthEvery = time.Second

// listener shares one pub/sub connection among a Sequencer's waiting Awaits: it is
// subscribed to a key's channel while an Await waits on that key, passes each
// announcement on the channel to the key's waiters, and tells every waiter to ask
// again when a subscription is confirmed (again, after a reconnection) or the
// connection broke, since announcements may have been lost meanwhile. The
// connection is open only while someone waits.
type listener struct {
	run *store.Runner

	// wmu orders the writes on the connection (SUBSCRIBE, UNSUBSCRIBE, opening and
	// closing it), so that the last one matches what the waiters want. Taken before
	// mu, never while mu is held.
	wmu sync.Mutex

	mu    sync.Mutex
	cur   *listening
	chans map[string]*channel
}

// listening is one connection and the goroutine that reads it.
type listening struct {
	ps   *redis.PubSub
	stop chan struct{}
	done chan struct{}
}

// channel is a key's channel: its waiters, and whether SUBSCRIBE was sent for it
// on the current connection.
type channel struct {
	waiters   map[*listen]struct{}
	sent      bool
	confirmed bool // the server confirmed the subscription on the current connection
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
	l.mu.Lock()
	c := l.chans[name]
	want := c != nil && len(c.waiters) > 0
	if !want && c != nil {
		delete(l.chans, name)
	}
	cur, sent := l.cur, c != nil && c.sent
	idle := len(l.chans) == 0
	if want && cur == nil {
		cur = &listening{ps: l.run.Subscribe(context.Background()), stop: make(chan struct{}), done: make(chan struct{})}
		l.cur = cur
		go l.read(cur)
	}
	if want && !sent {
		c.sent = true // go-redis records the channel even when the write fails, and subscribes again when it reconnects
	}
	if idle {
		l.cur = nil
	}
	l.mu.Unlock()

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	switch {
	case idle && cur != nil:
		close(cur.stop)
		_ = cur.ps.Close()
		l.wmu.Unlock() // the reader may want it to see that it was stopped (replace)
		<-cur.done
		return
	case want && !sent:
		_ = cur.ps.Subscribe(ctx, name)
	case !want && sent && cur != nil:
		_ = cur.ps.Unsubscribe(ctx, name)
	}
	l.wmu.Unlock()
}

// read reads s until it is stopped.
func (l *listener) read(s *listening) {
	defer close(s.done)
	ps := s.ps
	pinged := false
	backoff := 10 * time.Millisecond
	for {
		msg, err := ps.ReceiveTimeout(context.Background(), listenHealthEvery)
		select {
		case <-s.stop:
			return
		default:
		}
		if err != nil && isTimeout(err) {
			if !pinged {
				pinged = true
				if err = ps.Ping(context.Background()); err == nil {
					continue
				}
			} else if ps = l.replace(s); ps != nil {
				// Silent for a whole interval after a PING: the connection is dead though
				// nothing said so (a lost network, a frozen server).
				pinged = false
				l.askAll(false)
				continue
			} else {
				return
			}
		}
		if err != nil {
			// The connection broke: announcements may have been lost, and go-redis
			// subscribes again on the next Receive. Every waiter asks again now, and
			// again when its subscription is confirmed.
			l.askAll(true)
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
				l.confirmed(m.Channel)
			}
		case *redis.Message:
			l.tell(m.Channel, m.Payload)
		}
	}
}

// replace gives s a new connection, subscribed to every channel waited on, and
// closes the old one; it returns nil if s was stopped.
func (l *listener) replace(s *listening) *redis.PubSub {
	l.wmu.Lock()
	defer l.wmu.Unlock()
	l.mu.Lock()
	if l.cur != s {
		l.mu.Unlock()
		return nil
	}
	old := s.ps
	s.ps = l.run.Subscribe(context.Background())
	names := make([]string, 0, len(l.chans))
	for name, c := range l.chans {
		names = append(names, name)
		c.sent, c.confirmed = true, false
	}
	ps := s.ps
	l.mu.Unlock()
	_ = old.Close()
	if len(names) > 0 {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_ = ps.Subscribe(ctx, names...)
		cancel()
	}
	return ps
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

// askAll tells every waiter to ask again; broken says the connection broke, so that
// no subscription counts as confirmed until the server confirms it again.
func (l *listener) askAll(broken bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, c := range l.chans {
		if broken {
			c.confirmed = false
		}
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

func isTimeout(err error) bool {
	var ne interface{ Timeout() bool }
	return errors.As(err, &ne) && ne.Timeout()
}
