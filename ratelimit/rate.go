package ratelimit

import (
	"errors"
	"fmt"
	"time"
)

// Rate is how often a key may start: at most N starts per Per, spaced Per/N apart,
// with up to Burst of them at once after the key was idle. The zero Burst means 1.
//
// With Burst 1, no window of length Per, wherever it falls, holds more than N
// starts; with Burst b, no such window holds more than N+b-1, and a key idle for
// b·Per/N may start b tasks at once. A Rate is a plain value, safe to share.
//
// Cost makes one start weigh more than one (a call that sends 5 requests to an API
// limited to 100 a minute: Rate{N: 100, Per: time.Minute, Cost: 5}): the start then
// counts as Cost starts of the key (the next start after it comes Cost·Per/N later;
// Result.Remaining counts starts of cost 1). A start that costs more than Burst
// waits, on an idle key too, until the part beyond the burst has passed, and begins
// all its cost at once: a window of Per then holds up to N+k-1 of cost, k the
// largest cost in it, where N+b-1 holds while no cost exceeds the burst b. Starts
// of a key may have different costs.
type Rate struct {
	N     int           // starts per Per, at least 1
	Per   time.Duration // at least 1ms, at most MaxPer
	Burst int           // starts that may begin at once, 0 (meaning 1) to MaxBurst
	Cost  int           // what this start counts as, 0 (meaning 1) to N·MaxPer/Per
}

// MaxPer is the longest interval a Rate may have, and MaxBurst its largest burst.
const (
	MaxPer   = 7 * 24 * time.Hour
	MaxBurst = 1_000_000
)

// PerSecond returns n starts a second, one every 1s/n.
func PerSecond(n int) Rate { return Rate{N: n, Per: time.Second} }

// PerMinute returns n starts a minute, one every 1m/n.
func PerMinute(n int) Rate { return Rate{N: n, Per: time.Minute} }

// Validate returns an error saying what is wrong with l, or nil: N below 1, Per
// outside [1ms, MaxPer], Burst outside [0, MaxBurst], more than one start per
// microsecond (the resolution of the server's clock), or a Cost below 0 or worth
// more than MaxPer of the key's starts.
func (l Rate) Validate() error {
	switch {
	case l.N < 1:
		return fmt.Errorf("ratelimit: limit %v: N must be at least 1", l)
	case l.Per < time.Millisecond || l.Per > MaxPer:
		return fmt.Errorf("ratelimit: limit %v: Per outside [1ms, %v]", l, MaxPer)
	case l.Burst < 0 || l.Burst > MaxBurst:
		return fmt.Errorf("ratelimit: limit %v: Burst outside [0, %d]", l, MaxBurst)
	case l.Per/time.Microsecond < time.Duration(l.N):
		return fmt.Errorf("ratelimit: limit %v: more than one start per microsecond", l)
	case l.Cost < 0 || l.cost() > int64(MaxPer/time.Microsecond)/l.interval():
		return fmt.Errorf("ratelimit: limit %v: Cost outside [0, %d], the starts of %v", l, int64(MaxPer/time.Microsecond)/l.interval(), MaxPer)
	}
	return nil
}

// String returns l as "50 per 1s", "50 per 1s, burst 5" or "50 per 1s, cost 3".
func (l Rate) String() string {
	s := fmt.Sprintf("%d per %v", l.N, l.Per)
	if l.Burst > 1 {
		s += fmt.Sprintf(", burst %d", l.Burst)
	}
	if l.Cost > 1 {
		s += fmt.Sprintf(", cost %d", l.Cost)
	}
	return s
}

// interval is the spacing of starts in microseconds, rounded up, so that the
// rounding never lets more than N through per Per.
func (l Rate) interval() int64 {
	us := int64(l.Per / time.Microsecond)
	return (us + int64(l.N) - 1) / int64(l.N)
}

// stale is how late after its start was due a named caller (TakeAs) may come back
// for it: one interval. Starts spaced an interval apart, each begun up to an
// interval late, put at most one start more in a window than the limit, as a
// handler that begins late does; a caller later than that would put more.
func (l Rate) stale() time.Duration {
	return time.Duration(l.interval()) * time.Microsecond
}

func (l Rate) burst() int64 { return int64(max(l.Burst, 1)) }

// MinDelay is the least a start of l's Cost waits, on a key nobody used lately too:
// the part of its cost beyond the burst, (Cost-Burst)·Per/N, rounded as the
// spacing is; 0 while Cost is at most Burst. Reserve, Take and TakeAs never take such
// a start with a maxWait (for TakeAs, a hold) shorter than this: give it a little
// more (the call's own time counts against it).
func (l Rate) MinDelay() time.Duration {
	return time.Duration(max(l.cost()-l.burst(), 0)*l.interval()) * time.Microsecond
}

func (l Rate) cost() int64 { return int64(max(l.Cost, 1)) }

// ErrLimited means a start was not taken: the key's limit, or a pause, allows the
// next start only later than the caller would wait. Wait returns it (wrapped, with
// the delay in its text).
var ErrLimited = errors.New("ratelimit: limited")
