package store

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
)

// heard records what a Follower told: messages as "channel payload", confirmed
// subscriptions, and breaks with when each came.
type heard struct {
	mu       sync.Mutex
	messages []string
	subs     []string
	broken   []error
	silentAt time.Time // the first ErrSilent
}

func (h *heard) events() Events {
	return Events{
		Message: func(channel, payload string) {
			h.mu.Lock()
			defer h.mu.Unlock()
			h.messages = append(h.messages, channel+" "+payload)
		},
		Subscribed: func(channel string) {
			h.mu.Lock()
			defer h.mu.Unlock()
			h.subs = append(h.subs, channel)
		},
		Broken: func(err error) {
			h.mu.Lock()
			defer h.mu.Unlock()
			h.broken = append(h.broken, err)
			if errors.Is(err, ErrSilent) && h.silentAt.IsZero() {
				h.silentAt = time.Now()
			}
		},
	}
}

// read calls fn with h locked.
func (h *heard) read(fn func(h *heard)) {
	h.mu.Lock()
	defer h.mu.Unlock()
	fn(h)
}

func (h *heard) subscribed(channel string) int {
	n := 0
	h.read(func(h *heard) {
		for _, c := range h.subs {
			if c == channel {
				n++
			}
		}
	})
	return n
}

func (h *heard) heardMessage(m string) bool {
	ok := false
	h.read(func(h *heard) { ok = slices.Contains(h.messages, m) })
	return ok
}

func (h *heard) breaks() int {
	n := 0
	h.read(func(h *heard) { n = len(h.broken) })
	return n
}

// eventually polls cond until it holds, failing the test after within.
func eventually(t *testing.T, within time.Duration, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(within); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v", what, within)
		}
	}
}

// subscribers is what the server counts as subscribed to channel.
func subscribers(t *testing.T, admin *redis.Client, channel string) int64 {
	t.Helper()
	n, err := admin.PubSubNumSub(context.Background(), channel).Result()
	if err != nil {
		t.Fatalf("PUBSUB NUMSUB: %v", err)
	}
	return n[channel]
}

func publish(t *testing.T, admin *redis.Client, channel, payload string) {
	t.Helper()
	if err := admin.Publish(context.Background(), channel, payload).Err(); err != nil {
		t.Fatalf("PUBLISH %s: %v", channel, err)
	}
}

func TestFollowerDelivers(t *testing.T) {
	srv := redistest.Start(t)
	admin := srv.Client(t)
	r := New(srv.Client(t))
	h := &heard{}
	f := r.Follow(h.events(), "a", "b")
	defer f.Close()
	eventually(t, 10*time.Second, "subscribed to a and b", func() bool { return h.subscribed("a") == 1 && h.subscribed("b") == 1 })

	publish(t, admin, "a", "1")
	publish(t, admin, "b", "2")
	publish(t, admin, "c", "3") // control: c is not followed yet
	f.Subscribe("c")
	f.Subscribe("a") // followed already: no second SUBSCRIBE
	eventually(t, 10*time.Second, "subscribed to c", func() bool { return h.subscribed("c") == 1 })
	publish(t, admin, "c", "4")
	f.Unsubscribe("b")
	f.Unsubscribe("x") // never followed: nothing to write
	eventually(t, 10*time.Second, "unsubscribed from b", func() bool { return subscribers(t, admin, "b") == 0 })
	publish(t, admin, "b", "5") // control: b is no longer followed
	publish(t, admin, "a", "6")
	eventually(t, 10*time.Second, "the last message heard", func() bool { return h.heardMessage("a 6") })

	h.read(func(h *heard) {
		if want := []string{"a 1", "b 2", "c 4", "a 6"}; !slices.Equal(h.messages, want) {
			t.Errorf("messages = %q, want %q: what was published on the channels followed, in order", h.messages, want)
		}
		if want := []string{"a", "b", "c"}; !slices.Equal(sorted(h.subs), want) {
			t.Errorf("subscriptions confirmed = %q, want %q: one each", h.subs, want)
		}
		if len(h.broken) != 0 {
			t.Errorf("breaks = %v, want none", h.broken)
		}
	})
}

func sorted(s []string) []string {
	s = slices.Clone(s)
	slices.Sort(s)
	return s
}

// TestFollowerNoticesSilence: a connection that falls silent without a word (the
// proxy swallows every byte) is noticed within two health intervals and replaced, and
// the Follower subscribes again once the network is back. Controls: the same
// Follower on a healthy network, PINGed but never replaced in that time; and one
// whose interval is longer than the bound, which the check finds too late.
func TestFollowerNoticesSilence(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	admin := srv.Client(t)
	const every = HealthEvery
	// Two intervals, and one more for the scheduling of a loaded machine.
	const bound = 3 * every
	type follower struct {
		name string
		p    *redistest.Proxy
		f    *Follower
		h    *heard
	}
	follow := func(name string, every time.Duration) *follower {
		p := redistest.NewProxy(t, srv.Addr())
		c := redis.NewClient(&redis.Options{Addr: p.Addr(), ClientName: name})
		t.Cleanup(func() { _ = c.Close() })
		h := &heard{}
		f := New(c).follow(h.events(), every, name)
		t.Cleanup(f.Close)
		eventually(t, 10*time.Second, name+" subscribed", func() bool { return h.subscribed(name) == 1 })
		return &follower{name: name, p: p, f: f, h: h}
	}
	dead := follow("dead", every)
	healthy := follow("healthy", every)
	deaf := follow("deaf", 10*bound) // control: checks too seldom to notice in time

	// noticed is the checker: an ErrSilent within bound of the silence.
	noticed := func(fl *follower, since time.Time) (bool, string) {
		var at time.Time
		fl.h.read(func(h *heard) { at = h.silentAt })
		if at.IsZero() {
			return false, "not noticed"
		}
		return at.Sub(since) <= bound, "noticed after " + at.Sub(since).String()
	}
	silence := time.Now()
	dead.p.Blackhole(true)
	deaf.p.Blackhole(true)
	time.Sleep(bound)
	if ok, took := noticed(dead, silence); !ok {
		t.Errorf("a silent connection %s, want noticed within %v", took, bound)
	}
	if ok, _ := noticed(deaf, silence); ok {
		t.Errorf("control: a Follower with an interval of %v noticed the silence within %v", 10*bound, bound)
	}
	if n := healthy.h.breaks(); n != 0 {
		t.Errorf("control: a healthy connection broke %d times", n)
	}
	// The healthy Follower was PINGed: the check ran, and its answer counted.
	if list, err := admin.ClientList(context.Background()).Result(); err != nil {
		t.Fatal(err)
	} else if !strings.Contains(list, " name=healthy ") || !containsLine(list, "name=healthy", "cmd=ping") {
		t.Errorf("control: the healthy connection was not PINGed in %v: %s", bound, list)
	}

	// The network comes back: the replaced connection subscribes again and hears.
	dead.p.Blackhole(false)
	eventually(t, 30*time.Second, "subscribed again after the silence", func() bool { return dead.h.subscribed("dead") >= 2 })
	publish(t, admin, "dead", "back")
	eventually(t, 10*time.Second, "a message after the silence", func() bool { return dead.h.heardMessage("dead back") })
}

// containsLine reports whether a line of list contains every one of parts.
func containsLine(list string, parts ...string) bool {
	for _, line := range strings.Split(list, "\n") {
		all := true
		for _, p := range parts {
			all = all && strings.Contains(line, p)
		}
		if all {
			return true
		}
	}
	return false
}

// TestFollowerSubscribesAgainAfterRestart: a server restarted without persistence
// forgets every subscription; the Follower reports the break, subscribes again and
// hears what is published after. Control: a subscription nobody reads is not made
// again.
func TestFollowerSubscribesAgainAfterRestart(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	admin := srv.Client(t)
	rdb := srv.Client(t)
	h := &heard{}
	f := New(rdb).Follow(h.events(), "news")
	defer f.Close()
	unread := rdb.Subscribe(context.Background(), "unread")
	defer unread.Close()
	eventually(t, 10*time.Second, "subscribed", func() bool {
		return h.subscribed("news") == 1 && subscribers(t, admin, "unread") == 1
	})

	srv.Restart(t)
	eventually(t, 30*time.Second, "the break reported and the subscription made again", func() bool {
		return h.breaks() > 0 && h.subscribed("news") == 2 && subscribers(t, admin, "news") == 1
	})
	if n := subscribers(t, admin, "unread"); n != 0 {
		t.Errorf("control: the unread subscription counts %d subscribers after the restart, want 0", n)
	}
	publish(t, admin, "news", "after")
	eventually(t, 10*time.Second, "a message after the restart", func() bool { return h.heardMessage("news after") })
}

// TestFollowerCloses: Close returns, leaving no goroutine behind, whatever the
// Follower was doing: reading a healthy connection, pausing between dials to a
// server that is down, or waiting on a new connection that swallows everything. The
// control: before Close, the check finds the Follower's goroutine. Not parallel:
// goleak sees the goroutines of every test running.
func TestFollowerCloses(t *testing.T) {
	before := goleak.IgnoreCurrent()
	cases := []struct {
		name  string
		quiet bool // nothing breaks before Close: it must report no break either
		fault func(t *testing.T, srv *redistest.Server, p *redistest.Proxy, h *heard)
	}{
		{"reading", true, func(*testing.T, *redistest.Server, *redistest.Proxy, *heard) {}},
		{"server down", false, func(t *testing.T, srv *redistest.Server, _ *redistest.Proxy, h *heard) {
			srv.Stop(t)
			eventually(t, 10*time.Second, "the break reported", func() bool { return h.breaks() > 0 })
		}},
		{"blackholed", false, func(t *testing.T, _ *redistest.Server, p *redistest.Proxy, h *heard) {
			p.Blackhole(true)
			// Replaced: it waits on a new connection whose handshake goes unanswered.
			eventually(t, 10*HealthEvery, "the silence noticed", func() bool { return h.breaks() > 0 })
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			srv := redistest.Start(t)
			p := redistest.NewProxy(t, srv.Addr())
			c := redis.NewClient(&redis.Options{Addr: p.Addr()})
			t.Cleanup(func() { _ = c.Close() })
			h := &heard{}
			f := New(c).Follow(h.events(), "ch")
			eventually(t, 10*time.Second, "subscribed", func() bool { return h.subscribed("ch") == 1 })
			tc.fault(t, srv, p, h)
			if err := goleak.Find(before); err == nil || !strings.Contains(err.Error(), "(*Follower).read") {
				t.Errorf("control: before Close, goleak.Find = %v, want the Follower's goroutine", err)
			}
			closed := make(chan struct{})
			go func() {
				f.Close()
				f.Close() // idempotent
				close(closed)
			}()
			select {
			case <-closed:
			case <-time.After(30 * time.Second):
				t.Fatal("Close did not return")
			}
			if n := h.breaks(); tc.quiet && n != 0 {
				t.Errorf("a healthy connection closed reported %d breaks, want none", n)
			}
		})
		// The subtest's cleanups stopped its proxy, client and server.
		if err := goleak.Find(before); err != nil {
			t.Errorf("%s: goroutines left after Close: %v", tc.name, err)
		}
	}
}
