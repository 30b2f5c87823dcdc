package store

import (
	"context"
	"errors"
	"net"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// HealthEvery is how long a Follower's connection may be silent before it is sent a
// PING; a connection that then stays silent as long again is replaced. A connection
// that dies without a word (a lost network, a frozen server) is thus noticed within
// 2*HealthEvery, plus a read's scheduling.
const HealthEvery = time.Second

const (
	// followBackoff and followBackoffMax bound the pause after a broken connection:
	// it doubles from the first to the second while the breaks go on, and starts
	// again from the first once anything is read.
	followBackoff    = 10 * time.Millisecond
	followBackoffMax = time.Second
	// followWriteTimeout bounds a SUBSCRIBE or UNSUBSCRIBE, its dial included.
	followWriteTimeout = 5 * time.Second
)

// ErrSilent is what Events.Broken is given when the connection stayed silent for
// HealthEvery after a PING, and was replaced.
var ErrSilent = errors.New("subscription connection silent after a PING; replaced")

// Events is what a Follower tells its owner. Each func is called from the Follower's
// one reading goroutine, one call at a time, never with a lock of the Follower held;
// none is called after Close returned, and the connection Close closes is not
// reported as broken. A nil func is skipped.
type Events struct {
	// Message is a message published on a channel followed.
	Message func(channel, payload string)
	// Subscribed says that the server confirmed the subscription to channel: on the
	// first connection, after a break, or after Subscribe. What was published on
	// channel before it was not heard.
	Subscribed func(channel string)
	// Broken says that the connection broke (err), or fell silent and was replaced
	// (ErrSilent): messages may have been lost. The Follower pauses (from 10ms,
	// doubling to 1s while the breaks go on), dials again and subscribes again, which
	// Subscribed reports channel by channel.
	Broken func(err error)
}

// A Follower follows channels on one pub/sub connection of a Runner, for as long as it
// is not closed: it passes on what is published there, PINGs the connection when it
// is silent, replaces it when it stays silent (see HealthEvery), dials again after a
// break, subscribes again to every channel followed, and tells its owner of each
// (Events). Its methods are safe for concurrent use.
type Follower struct {
	run   *Runner
	ev    Events
	every time.Duration // HealthEvery; shorter in tests

	// wmu orders the writes on the connection (SUBSCRIBE, UNSUBSCRIBE), so that the
	// last one matches chans. Taken before mu, never while mu is held.
	wmu sync.Mutex

	mu      sync.Mutex
	ps      *redis.PubSub
	chans   map[string]struct{} // followed
	pending bool                // chans not yet sent on ps: the reading goroutine sends them
	stopped bool

	stop chan struct{} // closed by Close
	done chan struct{} // closed when the reading goroutine returns
}

// Follow returns a Follower of channels, whose connection its reading goroutine
// dials and subscribes: Follow does no I/O. Close stops it.
func (r *Runner) Follow(ev Events, channels ...string) *Follower {
	return r.follow(ev, HealthEvery, channels...)
}

// follow is Follow with a health interval other than HealthEvery.
func (r *Runner) follow(ev Events, every time.Duration, channels ...string) *Follower {
	f := &Follower{
		run: r, ev: ev, every: every,
		ps:    r.Subscribe(context.Background()),
		chans: make(map[string]struct{}, len(channels)), pending: true,
		stop: make(chan struct{}), done: make(chan struct{}),
	}
	for _, c := range channels {
		f.chans[c] = struct{}{}
	}
	go f.read()
	return f
}

// Subscribe follows channels too. It returns once their SUBSCRIBE was written (within
// 5s; a failed write shows up as a break, after which the Follower subscribes again),
// or at once when the reading goroutine has yet to subscribe or the channels are
// followed already.
func (f *Follower) Subscribe(channels ...string) {
	f.write("subscribe", channels, func(c string) bool {
		_, ok := f.chans[c]
		f.chans[c] = struct{}{}
		return !ok
	})
}

// Unsubscribe stops following channels. It returns once their UNSUBSCRIBE was written
// (within 5s), or at once when none of them was followed. A Follower that follows no
// channel keeps its connection until Close.
func (f *Follower) Unsubscribe(channels ...string) {
	f.write("unsubscribe", channels, func(c string) bool {
		_, ok := f.chans[c]
		delete(f.chans, c)
		return ok
	})
}

// write applies change to each of channels, and sends cmd for those it reports
// changed, unless the reading goroutine is yet to send every channel followed.
func (f *Follower) write(cmd string, channels []string, change func(string) bool) {
	f.wmu.Lock()
	defer f.wmu.Unlock()
	f.mu.Lock()
	var changed []string
	for _, c := range channels {
		if change(c) {
			changed = append(changed, c)
		}
	}
	ps, send := f.ps, len(changed) > 0 && !f.pending && !f.stopped
	f.mu.Unlock()
	if !send {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), followWriteTimeout)
	defer cancel()
	// go-redis records the channels even when the write fails, and subscribes again
	// when it reconnects; the next read reports the failure.
	if cmd == "subscribe" {
		_ = ps.Subscribe(ctx, changed...)
	} else {
		_ = ps.Unsubscribe(ctx, changed...)
	}
}

// Close stops the Follower: it closes the connection and returns once the reading
// goroutine has. Events are not called after it began. It is idempotent.
func (f *Follower) Close() {
	f.mu.Lock()
	if f.stopped {
		f.mu.Unlock()
		<-f.done
		return
	}
	f.stopped = true
	ps := f.ps
	f.mu.Unlock()
	close(f.stop)
	_ = ps.Close()
	<-f.done
}

// read follows the connection until Close.
func (f *Follower) read() {
	defer close(f.done)
	backoff := followBackoff
	pinged := false
	for {
		ps, err := f.subscribePending()
		var msg any
		if err == nil {
			msg, err = ps.ReceiveTimeout(context.Background(), f.every)
		}
		if f.stopping() {
			return
		}
		if err != nil && isTimeout(err) {
			switch {
			case !pinged:
				pinged = true
				if err = ps.Ping(context.Background()); err == nil {
					continue
				}
			case !f.replace():
				return
			default:
				// Silent for a whole interval after a PING: the connection is dead
				// though nothing said so (a lost network, a frozen server).
				pinged, err = false, ErrSilent
			}
		}
		if err != nil {
			if f.ev.Broken != nil {
				f.ev.Broken(err)
			}
			if !f.pause(backoff) {
				return
			}
			backoff = min(2*backoff, followBackoffMax)
			continue
		}
		backoff, pinged = followBackoff, false
		switch m := msg.(type) {
		case *redis.Subscription:
			if m.Kind == "subscribe" && f.ev.Subscribed != nil {
				f.ev.Subscribed(m.Channel)
			}
		case *redis.Message:
			if f.ev.Message != nil {
				f.ev.Message(m.Channel, m.Payload)
			}
		}
	}
}

// subscribePending returns the connection, having sent SUBSCRIBE for every channel
// followed if it was yet to be sent there (a new connection); the error is the
// write's.
func (f *Follower) subscribePending() (*redis.PubSub, error) {
	f.wmu.Lock()
	defer f.wmu.Unlock()
	f.mu.Lock()
	ps, pending := f.ps, f.pending
	f.pending = false
	var names []string
	if pending {
		names = make([]string, 0, len(f.chans))
		for c := range f.chans {
			names = append(names, c)
		}
	}
	f.mu.Unlock()
	if len(names) == 0 {
		return ps, nil
	}
	// go-redis records the channels even when the write fails, and subscribes again
	// by itself when it reconnects.
	ctx, cancel := context.WithTimeout(context.Background(), followWriteTimeout)
	defer cancel()
	return ps, ps.Subscribe(ctx, names...)
}

// replace closes the connection and gives the Follower a new one, to subscribe on
// the next read; false if the Follower was closed.
func (f *Follower) replace() bool {
	f.mu.Lock()
	if f.stopped {
		f.mu.Unlock()
		return false
	}
	old := f.ps
	f.ps, f.pending = f.run.Subscribe(context.Background()), true
	f.mu.Unlock()
	_ = old.Close()
	return true
}

// pause waits d; false if Close came first.
func (f *Follower) pause(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-f.stop:
		return false
	case <-t.C:
		return true
	}
}

func (f *Follower) stopping() bool {
	select {
	case <-f.stop:
		return true
	default:
		return false
	}
}

// isTimeout reports whether err is a read that timed out.
func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}
