package ratelimit_test

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/asynqmutex/asynqmutex/ratelimit"
)

// The checkers judge the starts a run recorded (see start: when each was set, on the
// rate server's clock, and begun, on the referee's). Each has a positive control in
// checkers_control_test.go.

func micros(d time.Duration) int64 { return int64(d / time.Microsecond) }

// interval is the spacing of lim's starts.
func interval(lim ratelimit.Rate) time.Duration { return lim.Per / time.Duration(lim.N) }

// span is when something happened, known to lie between Lo and Hi (referee µs).
type span struct{ Lo, Hi int64 }

// certainInWindow returns the most spans that certainly lie in one window of per:
// spans that all fit in it, so that wherever in its span each event really was, one
// window [x, x+per) holds them all. With points (Lo == Hi) it is the most events in
// any half-open window of per. Quadratic, which a few hundred starts afford.
func certainInWindow(spans []span, per int64) (most int, at int64) {
	for _, a := range spans {
		x, n := a.Lo, 0
		for _, s := range spans {
			if s.Lo >= x && s.Hi < x+per {
				n++
			}
		}
		if n > most {
			most, at = n, x
		}
	}
	return most, at
}

// spans maps starts to one of their spans.
func spans(starts []start, f func(start) span) []span {
	out := make([]span, len(starts))
	for i, s := range starts {
		out[i] = f(s)
	}
	return out
}

// Two bounds, two views of a start (see start.set and start.began).
//
// The limiter promises that the moments it sets, on its clock, put at most N+b-1
// in any window of Per (N with the default burst b of 1): setBound. The checker
// counts the starts whose set moments certainly fall in one window, from bounds
// each worker measured (probe, record): the server decided between the take
// script's sending and its reply, plus the delay it answered; the referee's clock
// is reached through the record's round trip. Those bounds hold however long a
// process or the referee stalls; a stall only widens them.
//
// The bound, beginBound, is on the moments starts begin: N + burst. A start
// begins when Wait returns, never before the moment set but often after it: Wait
// sleeps the delay from when it read the reply, and its timer and the scheduler may
// wake it late. The lateness differs from start to start: if the first start of a
// full window begins late by d while the start N later begins on time, they are
// Per-d apart and a window of Per holds N+1. The one start more covers any lateness
// below an interval (Per/N: 20ms at 50/s). A process stalled for longer (a loaded
// machine) can bunch more, which no limiter can prevent once it has answered: N+2
// in a window needs a start late by more than an interval. Each start's lateness
// is measured (its begin less the exact moment set, both servers reading one clock;
// see start.LateUp), so a window beyond beginBound is blamed on the limiter only
// when no start in it can have been late by an interval.
//
// Either way the referee's own delay (it reads its clock when the record reaches
// it) is measured and taken out, not allowed for: a referee stalled for longer than
// an interval would otherwise bunch records of starts that did not bunch.
func setBound(lim ratelimit.Rate) int   { return lim.N + max(lim.Burst, 1) - 1 }
func beginBound(lim ratelimit.Rate) int { return lim.N + max(lim.Burst, 1) }

// windowVerdict is what checkWindows found: the most starts in one window of Per,
// as set by the limiter and as begun (both certain, see certainInWindow), and as
// recorded (the referee's times taken as exact), with the latest start of the
// fullest begun window.
type windowVerdict struct {
	Set, Began, Recorded int
	BeganAt              int64
	Late                 time.Duration // the most any start of the fullest begun window can have been late
}

func (v windowVerdict) String(lim ratelimit.Rate) string {
	return fmt.Sprintf("%d set (bound %d), %d begun (bound %d; the latest of them up to %v late), %d recorded",
		v.Set, setBound(lim), v.Began, beginBound(lim), v.Late.Round(100*time.Microsecond), v.Recorded)
}

// checkWindows fails when a window of lim.Per certainly holds more than setBound
// set moments, or more than beginBound begins none of which was late by an
// interval or more.
func checkWindows(starts []start, lim ratelimit.Rate) (windowVerdict, error) {
	per := micros(lim.Per)
	var v windowVerdict
	v.Set, _ = certainInWindow(spans(starts, start.set), per)
	v.Began, v.BeganAt = certainInWindow(spans(starts, start.began), per)
	v.Recorded, _ = certainInWindow(spans(starts, func(s start) span { return span{s.Begin, s.Begin} }), per)
	for _, s := range starts {
		if s.Begin-s.U >= v.BeganAt && s.Begin < v.BeganAt+per {
			v.Late = max(v.Late, time.Duration(s.LateUp)*time.Microsecond)
		}
	}
	switch {
	case v.Set > setBound(lim):
		return v, fmt.Errorf("the limiter set %d starts in one window of %v, more than N %d + burst %d - 1", v.Set, lim.Per, lim.N, max(lim.Burst, 1))
	case v.Began > beginBound(lim) && v.Late < interval(lim):
		return v, fmt.Errorf("%d starts began in the window of %v from %d µs, more than N %d + burst %d, none of them an interval late",
			v.Began, lim.Per, v.BeganAt, lim.N, max(lim.Burst, 1))
	}
	return v, nil
}

// describeWindow lists the starts of the fullest begun window of per and a little
// after it, each as its offset from the window's start, its worker, its referee
// delay and its lateness: a violation's explanation.
func describeWindow(starts []start, per time.Duration) string {
	_, at := certainInWindow(spans(starts, start.began), micros(per))
	var b strings.Builder
	for _, s := range starts {
		if s.Begin >= at && s.Begin <= at+micros(per)+micros(per)/10 {
			fmt.Fprintf(&b, " +%.1fms(w%d U %.1fms late %.1f-%.1fms)", float64(s.Begin-at)/1000, s.Worker,
				float64(s.U)/1000, float64(s.LateHi)/1000, float64(s.LateUp)/1000)
		}
	}
	return b.String()
}

// minShare is the least share of a limit a saturated key must use.
const minShare = 0.95

// checkThroughput counts the begins in [from, from+run) and fails when they are
// fewer than minShare of what lim allows in run. It returns the rate seen, in
// starts per Per. The fleet tests report it and assert checkSaturated instead: a
// loaded machine leaves stretches in which nobody asks, which counting begins
// would blame on the limiter.
func checkThroughput(begins []int64, lim ratelimit.Rate, from int64, run time.Duration) (float64, error) {
	n := 0
	for _, b := range begins {
		if b >= from && b < from+micros(run) {
			n++
		}
	}
	ideal := float64(lim.N) * float64(run) / float64(lim.Per)
	rate := float64(n) * float64(lim.Per) / float64(run)
	if float64(n) < minShare*ideal {
		return rate, fmt.Errorf("%d starts in %v, %.1f per %v, below %.0f%% of %d per %v (%.0f starts)",
			n, run, rate, lim.Per, 100*minShare, lim.N, lim.Per, ideal)
	}
	return rate, nil
}

// pauseRecord is a Pause the parent made: the referee's time just before the call
// and just after its answer, and the pause's length.
type pauseRecord struct {
	Before, After int64
	D             time.Duration
}

// end is the earliest the pause can have ended: it began no earlier than Before.
func (p pauseRecord) end() int64 { return p.Before + micros(p.D) }

// pauseVerdict is what checkPause found for one key.
type pauseVerdict struct {
	// Late: starts whose Wait was called after the pause had begun (Call > After) and
	// that began before it could have ended. Each is a violation.
	Late []start
	// Set: starts the limiter set for a moment inside the pause (S after After,
	// before end), whenever their Wait was called. Each is a violation: a start taken
	// before the pause and due inside it must be given back when it is due and taken
	// again after the pause (ratelimit.Limiter.Take confirms it).
	Set []start
	// Inside: every start that began inside the pause (after After, before end): a
	// start set before the pause began whose Wait returned late, or a violation above.
	Inside []start
}

// checkPause looks at a key's starts (with Call recorded, and S where known)
// around pause p. A Wait called after the Pause returned must not begin before the
// pause ends, and no start may be set for a moment inside the pause.
func checkPause(starts []start, p pauseRecord) (pauseVerdict, error) {
	var v pauseVerdict
	for _, s := range starts {
		if s.Begin > p.After && s.Begin < p.end() {
			v.Inside = append(v.Inside, s)
		}
		if s.Call > p.After && s.Begin < p.end() {
			v.Late = append(v.Late, s)
		}
		if s.HasS && s.S > p.After && s.S < p.end() {
			v.Set = append(v.Set, s)
		}
	}
	switch {
	case len(v.Late) > 0:
		s := v.Late[0]
		return v, fmt.Errorf("%d starts called after the pause began before it ended; the first called %d µs after the pause returned, began %d µs before its end",
			len(v.Late), s.Call-p.After, p.end()-s.Begin)
	case len(v.Set) > 0:
		s := v.Set[0]
		return v, fmt.Errorf("%d starts set for a moment inside the pause; the first %d µs after the pause returned, called %d µs before it",
			len(v.Set), s.S-p.After, p.After-s.Call)
	}
	return v, nil
}

// saturation is what checkSaturated found.
type saturation struct {
	Rate float64       // starts per Per while some caller was waiting
	Idle time.Duration // time no caller was waiting: nobody asked
	Busy time.Duration // the rest of the span from the first start set to the last
}

// checkSaturated judges use of the limit from the limiter's own decisions: the
// exact moment S it set for each start and the delay it answered (start.S and
// start.Delay), both on the rate server's clock. With burst 1, GCRA sets a start at
// the later of the decision and one interval after the start before; so a gap of
// more than an interval before a start is idle time when that start was answered
// "now" (delay 0: nobody had asked during the gap), and waste when it was told to
// wait (someone was waiting while a slot went unused). A worker stalled before it
// asks makes idle time, which is the machine's; waste is the limiter's. It fails on
// any waste, on starts closer than an interval, and when the rate while callers
// waited is below minShare of the limit. starts must all have S.
func checkSaturated(starts []start, lim ratelimit.Rate) (saturation, error) {
	var sat saturation
	if len(starts) < 2 {
		return sat, fmt.Errorf("%d starts: nothing to judge", len(starts))
	}
	ss := slices.Clone(starts)
	slices.SortFunc(ss, func(a, b start) int { return cmp.Compare(a.S, b.S) })
	iv := tau(ratelimit.Rate{N: lim.N, Per: lim.Per}) // the interval, rounded as the limiter does
	var idle int64
	for k := 1; k < len(ss); k++ {
		g := ss[k].S - ss[k-1].S
		switch {
		case g < iv:
			return sat, fmt.Errorf("starts set %d µs apart at %d µs, less than the interval %d µs", g, ss[k].S, iv)
		case g > iv && ss[k].Delay > 0:
			return sat, fmt.Errorf("waste: a start set at %d µs was told to wait %d µs although the slot at %d µs was free (%d µs unused)",
				ss[k].S, ss[k].Delay, ss[k-1].S+iv, g-iv)
		case g > iv:
			idle += g - iv
		}
	}
	busy := ss[len(ss)-1].S - ss[0].S - idle
	sat.Idle, sat.Busy = time.Duration(idle)*time.Microsecond, time.Duration(busy)*time.Microsecond
	if busy < micros(lim.Per) {
		return sat, fmt.Errorf("callers waited only %v in all: the key was never saturated", sat.Busy)
	}
	sat.Rate = float64(len(ss)-1) * float64(micros(lim.Per)) / float64(busy)
	if sat.Rate < minShare*float64(lim.N) {
		return sat, fmt.Errorf("%.2f starts per %v while callers waited, below %.0f%% of %v", sat.Rate, lim.Per, 100*minShare, lim)
	}
	return sat, nil
}
