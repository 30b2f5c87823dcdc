package mutex

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// This file is the line's other half: tasks that wait for a lock (or a slot of a
// lock with Limit(n)) in Redis alone, in no process, and are started when their turn
// comes (Park, Starter). Their entries share the lock's queue with waiting goroutines
// (layout.go), so one line keeps the order of both; the scripts hand the lock to a
// parked task as they hand it to a waiter, and return its ticket for the caller's
// Starter to start.

// ErrParked is joined with ErrNotObtained when an acquisition with Park did not get
// the lock and left a parked entry in its line instead: a Starter will be asked to
// start its ticket when its turn comes. LeaseLeft reads from the error how long the
// holder it parked behind had left.
var ErrParked = errors.New("mutex: parked in the key's line")

// ParkMode says when an acquisition with Park parks rather than waits in its process.
type ParkMode int

const (
	// ParkLead waits in the process when nobody else does (no waiter and no task on
	// its way in the key's line), up to MaxWait, and parks otherwise: one task per
	// busy key waits, to be handed the lock at once, while the rest wait in Redis.
	ParkLead ParkMode = iota
	// ParkAfterWait waits in the process up to MaxWait, as without Park, and parks
	// when that ends.
	ParkAfterWait
	// ParkNever never parks: the acquisition takes the lock if it was handed to its
	// ticket, and otherwise waits in the process, up to MaxWait, in the place of its
	// ticket's entry if the line has one (a task that must not leave its worker, on
	// its last try, still has its place). When the wait ends it leaves the line.
	ParkNever
)

// Park lets an acquisition (Lock, WithLock; with Limit(n) too; LockKeys,
// WithLockKeys) that finds a key busy leave its place in the key's line to a parked
// entry for ticket, and return an error wrapping ErrNotObtained and ErrParked, rather
// than wait on or leave the line: at once, or when its wait in the process ends at
// MaxWait, as mode says. A wait that ends with the context does not park; nor does a
// single attempt (TryLock, MaxWait(0)), which only takes the lock if it was handed to
// the ticket.
//
// When the parked entry's turn comes, the lock is handed to the ticket for claim (a
// lease nobody renews), and the Starter of the acquisition that handed it over (see
// StartWith) is asked to start its task; so, a little earlier, is the Starter of the
// hand-over before (the task at the head of the line is started ahead of its turn, to
// wait for it in a process). The task arrives and takes the lock by acquiring it with
// the same ticket: it holds it under its own token from then on, with the fence of
// the hand-over. A task that arrives before its turn (its own fallback, a run by
// hand) keeps its place. A lock handed to a ticket whose task does not come within
// claim frees when the claim ends.
//
// A set of keys parks holding nothing. It takes its keys in their fixed order,
// claiming those handed to its ticket; at the first busy one it waits in the process,
// keeping the keys before it, as LockKeys does, or parks in that key's line: then it
// gives back every other key it holds or that was handed to its ticket, each handed
// to its line's next as a release hands it (a parked task so handed a key is started
// by this acquisition's Starter), and parks in one line only (BusyKey names that
// key). When that key is handed to the ticket, the task arrives and takes its keys in
// order again. Meeting a busy key after it, under ParkLead it waits there in the
// process, keeping the keys before it, until MaxWait ends and it parks: its turn
// came, and sets that gave such turns back would pass their keys round, each for one
// on its way to another, none running. Meeting a busy key before it, it gives back
// the one handed to it, and at that one parks, or, under ParkLead with nobody else
// waiting there, waits in the process as the line's first does. On a single Redis that is one script
// call; where keys live on several servers (Redis Cluster, Ring), the keys are given
// back, a release call each, before the call that parks, so that a parked task never
// holds a key. There is no order across lines: a set may be passed over again and
// again by tasks of one of its keys, which take the key while the set waits at
// another; in exchange, nothing waits on a key the set does not use.
//
// With Limit(n) the line is the slots' own, and what is handed over is a slot: each
// slot freed (a release, or a lease that ran out, noticed by the next attempt) goes
// to the first in line, parked or waiting, and the ticket then claims that slot.
// ParkLead waits in the process when nobody else waits for any of the n slots.
//
// ticket names the task to whoever starts it: it must be unique per task, non-empty,
// at most 1000 bytes and without spaces; Park panics otherwise, or if claim is
// outside [MinTTL, MaxTTL]. Finding a ticket's entry reads the key's whole line (for
// a set, the lines of its keys), so a park costs time in Redis in proportion to the
// line.
func Park(ticket string, claim time.Duration, mode ParkMode) LockOption {
	if ticket == "" || len(ticket) > 1000 || strings.ContainsAny(ticket, " ") {
		panic(fmt.Sprintf("mutex.Park: ticket %q is empty, longer than 1000 bytes, or has a space", show(ticket)))
	}
	if err := checkTTL(claim); err != nil {
		panic("mutex.Park: claim " + err.Error())
	}
	p := &parking{ticket: ticket, claim: claim, mode: mode}
	return lockOptionFunc(func(c *lockConfig) { c.park = p })
}

// MaxLine caps the line of an acquisition with Park (Lock, WithLock; with Limit(n)
// too, whose line is the slots'): when the key is busy and its line already holds n
// entries or more (waiters and parked entries, started or not), a caller that has
// no entry there yet neither waits nor parks, and the acquisition returns an error
// wrapping ErrNotObtained and ErrLineFull. With replace, the oldest parked entry
// that was not started ahead of its turn (never a waiter, never a task on its way)
// leaves the line instead, and the caller takes its place in the line as usual, at
// the back: the replaced ticket is given to the acquisition's Starter (StartWith)
// with Parked.Replaced set, never started, so that its task is dropped; when no such
// entry is left, the caller is refused as without replace.
//
// The count and the refusal or replacement are part of the attempt's own script
// call: atomic, and no Redis call beyond it. They apply to the acquisition's first
// attempt: a caller whose ticket already stands in the line (a task coming back to
// its place, an attempt go-redis sent again after a lost reply), and later attempts
// of a waiting acquisition, are never refused nor counted twice. The replaced ticket
// is named in the reply of the call that replaced it only: when that reply is lost,
// the Starter does not hear of it, and its task, if it comes back, joins the line as
// a newcomer. The line is counted as it is read, so it costs what a park costs: time
// in proportion to the line.
//
// MaxLine applies only with Park: an acquisition with MaxLine and without Park, or
// of several keys (LockKeys, WithLockKeys), fails at once with an error saying so.
// The default is no cap. MaxLine panics if n is below 1.
func MaxLine(n int, replace bool) LockOption {
	if n < 1 {
		panic(fmt.Sprintf("mutex.MaxLine: n %d below 1", n))
	}
	return lockOptionFunc(func(c *lockConfig) { c.maxLine, c.replace = n, replace })
}

// Parked is a parked task whose turn has come, or is near (see Park), or that left
// its line to make room for another (Replaced, see MaxLine).
type Parked struct {
	Key    string // the lock's key
	Ticket string // as given to Park
	// Started is set when a Starter was asked to start the ticket before, ahead of its
	// turn: its task may be on its way.
	Started bool
	// Replaced is set when the ticket's parked entry left the line to make room for
	// a newcomer (MaxLine with replace): its task is not to be started, but dropped
	// if it can be; one that comes all the same joins the line as a newcomer. Nothing
	// was handed to it: what the Starter returns is ignored.
	Replaced bool

	c    *Client
	lock string // the lock's Redis key
}

// InLine reports whether the ticket still stands in its key's line: the lock (or a
// slot of a lock with Limit(n)) is handed to it, or a parked entry names it. A Starter asks it before it reports a
// task gone that may have arrived and run meanwhile. It reports true when the line is
// longer than Inspect lists, past the entries it read; an error is Redis's. Safe for
// concurrent use.
func (p Parked) InLine(ctx context.Context) (bool, error) {
	if p.c == nil {
		return false, errors.New("mutex: Parked.InLine on a Parked no Starter was given")
	}
	res, err := p.c.run.Run(ctx, inspectScript, p.c.inspectKeys(p.lock), maxListedWaiters, countParked(false)).Slice()
	if err != nil {
		return false, fmt.Errorf("mutex: inspect %s: %w", show(p.Key), err)
	}
	if len(res) < 6 {
		return false, fmt.Errorf("mutex: inspect %s: unexpected reply %v", show(p.Key), res)
	}
	switch v := res[1].(type) {
	case string:
		if lv, ok := parseValue(v); ok && lv.state != stateReleased && lv.id == parkedIdentity(p.Ticket) {
			return true, nil
		}
	case []any: // a lock with Limit(n): a slot handed to the ticket, its claim running
		now := serverTime(res[5])
		for i := 0; i+1 < len(v); i += 2 {
			if f, _ := v[i].(string); f == slotHolder+parkedIdentity(p.Ticket) {
				s, _ := v[i+1].(string)
				if sv, ok := parseSlot(s); ok && (now.IsZero() || sv.end.After(now)) {
					return true, nil
				}
			}
		}
	}
	entries, _ := res[4].([]any)
	for _, e := range entries {
		if s, _ := e.(string); s != "" {
			if pe := readEntry(s); pe.parked && pe.ticket == p.Ticket {
				return true, nil
			}
		}
	}
	waiting, _ := res[3].(int64)
	return int(waiting) > len(entries), nil
}

// Starter starts the task parked under p.Ticket, and reports gone when it will not
// come: it no longer waits (deleted, archived, done, run elsewhere for good). The
// lock handed to a gone ticket, if any, passes at once to the next in line, and its
// entry leaves the line. A Starter given to acquisitions with MaxLine and replace is
// also told of replaced tickets (p.Replaced), which it must not start. A Starter runs in a goroutine of its own, at most one per
// script call that handed over, with a context that ends after 10s; it must be safe
// for concurrent use.
type Starter func(ctx context.Context, p Parked) (gone bool)

// StartWith gives an acquisition the Starter for the parked tasks that its attempts
// and its release hand the lock to, or start ahead of their turn. Without one, a
// parked task handed the lock is not started: it comes when its own fallback brings
// it, and the lock handed to it frees when its claim ends.
func StartWith(s Starter) LockOption {
	return lockOptionFunc(func(c *lockConfig) { c.starter = s })
}

// Serve does for key's line what the next attempt to take the key would do, and
// takes nothing itself: when nobody holds the key (its holder released it, or crashed
// and its lease ran out) and its line is not empty, the key goes to the first in
// line, as a release hands it over: a waiter is told in its process, a parked task
// is handed the key for its claim and its ticket given to the Starter of opts (see
// StartWith), and the parked task at the head after it is started ahead of its turn.
// With Limit(n), every free slot goes so, and holders whose lease ended free theirs.
// A key that is held changes nothing. Serve is for whoever knows when a holder's
// lease ends: when every task of a key is parked, nobody else comes then, and a
// crashed holder's key would wait for the parked tasks' own fallback.
//
// left is the lease left, after the call, of the key's holder (the one it was just
// handed to, if any); for Limit(n), of the holder whose lease ends first when all n
// slots are held, and 0 when one is free; 0 when the key is free, and negative when
// the key has no expiry (set by hand). waiting reports whether the line still holds
// anyone, parked or waiting: then Serve has something to do again once left has
// passed, unless someone releases the key first.
//
// Of opts, Limit(n) says which line a key nobody holds has, so it must be the key's
// acquisitions' own (a key held with Limit(n) is served with its holders' limit even
// without it); StartWith gives the Starter; the others are ignored. Serve is one
// script call. On a wrapped Redis error the call may have been applied: a parked
// task it handed the key to then comes by its own fallback, or the key passes on when
// its claim ends. Safe for concurrent use.
func (c *Client) Serve(ctx context.Context, key string, opts ...LockOption) (left time.Duration, waiting bool, err error) {
	if key == "" {
		return 0, false, errors.New("mutex: empty key")
	}
	var cfg lockConfig
	for _, o := range opts {
		o.applyLock(&cfg)
	}
	rkey := c.redisKey(key)
	keys := []string{rkey, c.plain.queue(rkey), c.slots.queue(rkey)}
	nums, hs, err := scriptReply(c.run.Run(ctx, serveScript, keys,
		max(cfg.limit, 1), c.channels, c.countsSubscribers, tombstoneMillis), c.plain, keys, 3)
	if err == nil && (len(nums) != 3 || (nums[2] != 1 && nums[2] != 2)) {
		err = fmt.Errorf("unexpected reply %v", nums)
	}
	if err != nil {
		return 0, false, fmt.Errorf("mutex: serve %s: %w", show(key), err)
	}
	if nums[0] == -3 {
		return 0, false, fmt.Errorf("mutex: serve %s: the Redis key %s holds a value of another type, not written by this package",
			show(key), show(rkey))
	}
	if nums[2] == 2 { // the slots' line: its tickets are slots'
		for i := range hs {
			hs[i].kind, hs[i].queue = c.slots, keys[2]
		}
	}
	c.start(cfg.starter, hs)
	return time.Duration(nums[0]) * time.Millisecond, nums[1] == 1, nil
}

// parking is what Park asks for.
type parking struct {
	ticket string
	claim  time.Duration
	mode   ParkMode
}

// startTimeout bounds one call of a Starter.
const startTimeout = 10 * time.Second

// handed is a ticket a script asked to start: the lock and queue it waits at, and
// the lock's kind.
type handed struct {
	kind        kind
	lock, queue string
	ticket      string
	started     bool
	replaced    bool // left the line to make room (MaxLine): to drop, not start
}

// scriptReply reads the reply of a script of kind k: its numbers, then the tickets to
// start, "<i> <mark><ticket>", where i counts the locks of the call (keys come per
// of them, the lock and its queue first).
func scriptReply(cmd *redis.Cmd, k kind, keys []string, per int) (nums []int64, hs []handed, err error) {
	vals, err := cmd.Slice()
	if err != nil {
		return nil, nil, err
	}
	for _, v := range vals {
		switch x := v.(type) {
		case int64:
			if hs != nil {
				return nil, nil, fmt.Errorf("unexpected reply %v", vals)
			}
			nums = append(nums, x)
		case string:
			is, rest, ok := strings.Cut(x, " ")
			i, err := strconv.Atoi(is)
			if !ok || err != nil || i < 1 || per*i > len(keys) || len(rest) < 2 {
				return nil, nil, fmt.Errorf("unexpected reply %v", vals)
			}
			hs = append(hs, handed{kind: k, lock: keys[per*(i-1)], queue: keys[per*(i-1)+1], ticket: rest[1:], started: rest[0] == startedMark, replaced: rest[0] == replacedMark})
		default:
			return nil, nil, fmt.Errorf("unexpected reply %v", vals)
		}
	}
	return nums, hs, nil
}

// start has s start the tickets hs, in a goroutine, and passes on what a gone ticket
// held. Without s, the tickets come by their own fallback.
func (c *Client) start(s Starter, hs []handed) {
	if s != nil && len(hs) > 0 {
		go c.starting(s, hs) // apart, so that a call with nothing to start allocates nothing
	}
}

// starting is start's goroutine: at most 100 tickets, those passed on included.
func (c *Client) starting(s Starter, hs []handed) {
	for n := 0; n < 100 && len(hs) > 0; n++ {
		h := hs[0]
		hs = hs[1:]
		key, _ := keyOf(c.prefix, h.lock)
		ctx, cancel := context.WithTimeout(context.Background(), startTimeout)
		if s(ctx, Parked{Key: key, Ticket: h.ticket, Started: h.started, Replaced: h.replaced, c: c, lock: h.lock}) && !h.replaced {
			_, more, _ := h.kind.release(ctx, []string{h.lock, h.queue}, parkedIdentity(h.ticket), "", 0, h.ticket)
			hs = append(hs, more...)
		}
		cancel()
	}
}
