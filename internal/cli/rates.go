package cli

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/asynqmutex/asynqmutex/internal/shortkey"
	"github.com/asynqmutex/asynqmutex/ratelimit"
)

// The rate commands: rates lists every rate-limited key, rate shows one, pause and
// resume hold a key's starts back and let them go. They read what package ratelimit
// keeps, through its Limiter; the key they name is the one the limit was taken on.

// rates prints every key Redis remembers a start or a pause of, sorted by key.
func rates(ctx context.Context, rl *ratelimit.Limiter, p *printer) error {
	var all []ratelimit.State
	for st, err := range rl.List(ctx) {
		if err != nil {
			return err
		}
		all = append(all, st)
	}
	slices.SortStableFunc(all, func(a, b ratelimit.State) int {
		return cmp.Or(strings.Compare(a.Key, b.Key), boolCompare(a.Digested, b.Digested))
	})
	if p.json {
		doc := ratesJSON{Prefix: p.prefix, Rates: make([]rateJSON, 0, len(all))}
		for _, st := range all {
			doc.Rates = append(doc.Rates, rateJSONOf(st))
		}
		return p.encode(doc)
	}
	if len(all) == 0 {
		_, err := fmt.Fprintf(p.w, "no rate-limited keys under prefix %s\n", strconv.Quote(p.prefix))
		return err
	}
	tw := tabwriter.NewWriter(p.w, 0, 8, 2, ' ', 0)
	fmt.Fprintln(tw, "KEY\tEVERY\tBURST\tREMAINING\tNEXT\tRESET\tPAUSED\tSTARTS\tAHEAD")
	for _, st := range all {
		every, burst := "-", "-"
		if st.Interval > 0 {
			every, burst = everyText(st.Interval), strconv.Itoa(st.Burst)
		}
		paused := "-"
		if st.Paused > 0 {
			paused = human(st.Paused)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\t%s\t%d\t%d\n", rateTableKey(st), every, burst, st.Remaining,
			until(st.Next), until(st.Full), paused, st.Starts, st.Ahead)
	}
	return tw.Flush()
}

// rateShow prints one key's state, of the first form of the key Redis remembers
// (see forms), and what it remembers of the other forms. A key Redis remembers
// nothing of is idle, or not the key meant: a failure, told on stderr after the
// report, with the limited keys near it listed, as show does for locks.
func rateShow(ctx context.Context, rl *ratelimit.Limiter, forms []form, given string, p *printer, stderr io.Writer) error {
	all, shown, err := lookUp(forms, func(key string) (ratelimit.State, bool, error) {
		st, err := rl.Inspect(ctx, key)
		return st, remembered(st), err
	})
	if err != nil {
		return err
	}
	st, key := all[shown].v, all[shown].key
	var near *nearby
	if !remembered(st) {
		if near, err = findRateNearby(ctx, rl, key); err != nil {
			return err
		}
	}
	if p.json {
		err = p.encode(rateShowJSON{rateJSON: rateJSONOf(st), OtherForms: othersJSON(all, shown), Nearby: rateNearbyOf(near)})
	} else {
		p.rateText(st, all, shown, given, near)
	}
	if err == nil && !remembered(st) {
		err = notFound(stderr, all, p.prefix, rateWords)
	}
	return err
}

// rateText is rate's report for a person.
func (p *printer) rateText(st ratelimit.State, all []found[ratelimit.State], shown int, given string, near *nearby) {
	field := func(label, format string, args ...any) {
		fmt.Fprintf(p.w, "%-13s"+format+"\n", append([]any{label}, args...)...)
	}
	key := all[shown].key
	field("Key:", "%s", keyLine(printable(key), all[shown].form, given))
	if !remembered(st) {
		field("State:", "idle: next start free now; Redis remembers no start and no pause of this key under prefix %s", strconv.Quote(p.prefix))
		writeOthers(p.w, all, shown, rateWords)
		near.writeAs(p.w, p.prefix, rateWords)
		return
	}
	if st.Interval > 0 {
		field("Limit:", "one start every %s, burst %d (the limit of its latest start)", everyText(st.Interval), st.Burst)
		field("Remaining:", "%d %s may begin now", st.Remaining, plural(st.Remaining, "start", "starts"))
	} else {
		field("Limit:", "not known: no start is remembered, only a pause")
	}
	field("Next start:", "%s", until(st.Next))
	switch {
	case st.Interval == 0:
	case st.Full > 0:
		field("Reset in:", "%s (then %s free again)", until(st.Full), burstText(st.Burst))
	default:
		field("Reset in:", "now (%s free)", burstText(st.Burst))
	}
	if st.Paused > 0 {
		field("Paused:", "%s left; 'asynqmutex resume %s' ends it", human(st.Paused), taskArgs(key))
	} else {
		field("Paused:", "no")
	}
	field("Remembered:", "%d %s: those begun in the last 10 to 20 s, and those reserved ahead", st.Starts, plural(st.Starts, "start", "starts"))
	if st.Ahead > 0 {
		field("Ahead:", "%d %s reserved for tasks that wait for them (parked until their start, or in their worker); the last begins in %s",
			st.Ahead, plural(st.Ahead, "start", "starts"), human(st.LastDue))
	} else {
		field("Ahead:", "no start reserved: no task waits for one")
	}
	field("Redis key:", "%s", printable(st.RedisKey))
	writeOthers(p.w, all, shown, rateWords)
}

// burstText says which starts of a burst of n are meant: its one, or all n.
func burstText(n int) string {
	if n == 1 {
		return "its one start is"
	}
	return fmt.Sprintf("all %d starts are", n)
}

// pause holds every start of key back for --for, under the limit --every and
// --burst give, or else the one Redis remembers for the key.
func pause(ctx context.Context, rl *ratelimit.Limiter, inv *invocation, key string, p *printer, stderr io.Writer) error {
	before, key, err := inspectRate(ctx, rl, key, inv.givenKey())
	if err != nil {
		return err
	}
	every, burst := inv.every, inv.burst
	if !inv.set["every"] {
		if before.Interval == 0 {
			return usagef("Redis remembers no start of %s, so not its limit: give the limit its tasks use with\n"+
				"--every (and --burst), so that the pause ends for them when it should", quoteKey(key))
		}
		every = before.Interval
	}
	if !inv.set["burst"] {
		burst = max(before.Burst, 1)
	}
	lim := limitEvery(every, burst)
	left, err := rl.Pause(ctx, key, lim, inv.pauseFor)
	if err != nil {
		return err
	}
	// Pause leaves a longer hold in place, and then reports it.
	changed := left <= inv.pauseFor
	if changed && before.Interval > 0 && (before.Interval != every.Truncate(time.Microsecond) || before.Burst != burst) {
		fmt.Fprintf(stderr, "asynqmutex: note: the latest start of %s was taken under one start every %s, burst %d;\n"+
			"the pause is kept under the limit given, so for tasks under the other it may end a little sooner or later.\n",
			quoteKey(key), everyText(before.Interval), before.Burst)
	}
	if p.json {
		return p.encode(pauseJSON{Key: key, Paused: changed, HeldBackMS: ceilMS(left),
			IntervalMS: intervalMS(every), Burst: burst})
	}
	if !changed {
		_, err := fmt.Fprintf(p.w, "%s is already held back for %s, longer than --for %s: nothing changed.\n",
			quoteKey(key), human(left), inv.pauseFor)
		return err
	}
	_, err = fmt.Fprintf(p.w, "Paused %s for %s: no start of it begins before then, on any worker.\n"+
		"After the pause its starts come one every %s, one at a time until the key is idle again (burst %d).\n"+
		"End it early with: asynqmutex resume %s\n",
		quoteKey(key), human(left), everyText(every), burst, taskArgs(key))
	return err
}

// resume ends key's pause. Finding none is a failure, as release finding nothing
// to release is: nothing changed, and a mistyped key is the likeliest cause.
func resume(ctx context.Context, rl *ratelimit.Limiter, key, given string, p *printer, stderr io.Writer) error {
	before, key, err := inspectRate(ctx, rl, key, given)
	if err != nil {
		return err
	}
	had, err := rl.Resume(ctx, key)
	if err != nil {
		return err
	}
	after, err := rl.Inspect(ctx, key)
	if err != nil {
		return err
	}
	// Resume reports a pause Redis still keeps, though it may have ended: only one
	// that still held the key back counts as resumed.
	resumed := had && before.Paused > 0
	var near *nearby
	if !resumed && !remembered(before) {
		if near, err = findRateNearby(ctx, rl, key); err != nil {
			return err
		}
	}
	if p.json {
		doc := resumeJSON{Key: key, Resumed: resumed, State: rateJSONOf(after), Nearby: rateNearbyOf(near)}
		if resumed {
			doc.PausedLeftMS = ceilMS(before.Paused)
		}
		if err := p.encode(doc); err != nil {
			return err
		}
	}
	if !resumed {
		if had {
			fmt.Fprintf(stderr, "asynqmutex: nothing to resume: the pause of %s had already ended\n", quoteKey(key))
		} else {
			fmt.Fprintf(stderr, "asynqmutex: nothing to resume: %s is not paused under prefix %s\n", quoteKey(key), strconv.Quote(p.prefix))
		}
		if near != nil {
			near.writeAs(stderr, p.prefix, rateWords)
		}
		return errReported
	}
	if p.json {
		return nil
	}
	fmt.Fprintf(p.w, "Resumed %s: its pause had %s left.\n", quoteKey(key), human(before.Paused))
	switch {
	case after.Next > 0:
		fmt.Fprintf(p.w, "Its next start comes in %s: starts taken while it was paused keep their times.\n", until(after.Next))
	case after.Interval == 0: // no start remembered, so no limit to count under
		fmt.Fprintf(p.w, "Its starts may begin now.\n")
	default:
		fmt.Fprintf(p.w, "Its starts may begin now (%d remaining).\n", after.Remaining)
	}
	return nil
}

// reset forgets key's starts (ratelimit.Limiter.Reset): its whole burst may begin
// now. A key with no start to forget is nothing to reset: told on stderr, with the
// limited keys near it when Redis remembers nothing of it, exit 1.
func reset(ctx context.Context, rl *ratelimit.Limiter, key, given string, p *printer, stderr io.Writer) error {
	before, key, err := inspectRate(ctx, rl, key, given)
	if err != nil {
		return err
	}
	forgot, err := rl.Reset(ctx, key)
	if err != nil {
		return err
	}
	after, err := rl.Inspect(ctx, key)
	if err != nil {
		return err
	}
	var near *nearby
	if forgot == 0 && !remembered(before) {
		if near, err = findRateNearby(ctx, rl, key); err != nil {
			return err
		}
	}
	if p.json {
		if err := p.encode(resetJSON{Key: key, Forgotten: forgot, State: rateJSONOf(after), Nearby: rateNearbyOf(near)}); err != nil {
			return err
		}
	}
	if forgot == 0 {
		fmt.Fprintf(stderr, "asynqmutex: nothing to reset: Redis remembers no start of %s under prefix %s\n", quoteKey(key), strconv.Quote(p.prefix))
		if near != nil {
			near.writeAs(stderr, p.prefix, rateWords)
		}
		return errReported
	}
	if p.json {
		return nil
	}
	fmt.Fprintf(p.w, "Reset %s: forgot %d %s.\n", quoteKey(key), forgot, plural(forgot, "start", "starts"))
	if after.Paused > 0 {
		fmt.Fprintf(p.w, "It is still paused for %s: 'asynqmutex resume %s' ends that.\n", human(after.Paused), taskArgs(key))
	} else {
		fmt.Fprintf(p.w, "Its starts may begin now.\n")
	}
	return nil
}

// inspectRate reads key's state, or, when Redis remembers nothing of key and given
// (the KEY as typed) differs, given's if Redis remembers that: a key of KeyBy's that
// only looks like the middleware's. It returns the state and the key it is of.
func inspectRate(ctx context.Context, rl *ratelimit.Limiter, key, given string) (ratelimit.State, string, error) {
	st, err := rl.Inspect(ctx, key)
	if err != nil || remembered(st) || given == "" || given == key {
		return st, key, err
	}
	asGiven, err := rl.Inspect(ctx, given)
	if err != nil {
		return st, key, err
	}
	if remembered(asGiven) {
		return asGiven, given, nil
	}
	return st, key, nil
}

// remembered reports whether Redis keeps anything of the key st is of.
func remembered(st ratelimit.State) bool {
	return st.Starts > 0 || st.Interval > 0 || st.Paused > 0 || st.Full > 0
}

// findRateNearby lists the limited keys near key (see nearby), with one SCAN.
func findRateNearby(ctx context.Context, rl *ratelimit.Limiter, key string) (*nearby, error) {
	return nearKeys(key, func(yield func(keyOf, error) bool) {
		for st, err := range rl.List(ctx) {
			if !yield(keyOf{st.Key, st.Digested}, err) {
				return
			}
		}
	})
}

// limitEvery is the Limit of one start every every, with burst: its spacing is
// every, to the microsecond (ratelimit's resolution), also below a millisecond,
// the shortest Per a Rate takes.
func limitEvery(every time.Duration, burst int) ratelimit.Rate {
	if every >= time.Millisecond {
		return ratelimit.Rate{N: 1, Per: every, Burst: burst}
	}
	return ratelimit.Rate{N: 1000, Per: every * 1000, Burst: burst}
}

type ratesJSON struct {
	Prefix string     `json:"prefix"`
	Rates  []rateJSON `json:"rates"`
}

// rateJSON is ratelimit.State for scripts. Times until something are in whole
// milliseconds rounded up, so that 0 means now.
type rateJSON struct {
	Key      string `json:"key"`
	Digested bool   `json:"digested"` // key is only the first 64 bytes of a longer key
	// IntervalMS and Burst are the limit of the latest start: one start every
	// interval_ms (to the microsecond), up to burst at once; 0 when no start is
	// remembered.
	IntervalMS float64 `json:"interval_ms"`
	Burst      int     `json:"burst"`
	Remaining  int     `json:"remaining"` // starts that may begin now
	NextMS     int64   `json:"next_ms"`   // until a start may begin
	ResetMS    int64   `json:"reset_ms"`  // until every start of the burst is free
	PausedMS   int64   `json:"paused_ms"` // until the pause ends; 0 without one
	Starts     int     `json:"starts"`    // starts remembered
	Ahead      int     `json:"ahead"`     // of those, reserved to begin later
	LastDueMS  int64   `json:"last_due_ms"`
}

func rateJSONOf(st ratelimit.State) rateJSON {
	return rateJSON{
		Key: st.Key, Digested: st.Digested, IntervalMS: intervalMS(st.Interval), Burst: st.Burst,
		Remaining: st.Remaining, NextMS: ceilMS(st.Next), ResetMS: ceilMS(st.Full), PausedMS: ceilMS(st.Paused),
		Starts: st.Starts, Ahead: st.Ahead, LastDueMS: ceilMS(st.LastDue),
	}
}

// rateShowJSON is rate's document: the key's state, the other forms of the key
// and, when Redis remembers nothing of it, the limited keys near it.
type rateShowJSON struct {
	rateJSON
	OtherForms []otherFormJSON `json:"other_forms,omitempty"` // see showJSON
	Nearby     *rateNearby     `json:"nearby,omitempty"`
}

type pauseJSON struct {
	Key string `json:"key"`
	// Paused is false when the key was already held back longer: nothing changed.
	Paused     bool    `json:"paused"`
	HeldBackMS int64   `json:"held_back_ms"` // until a start may begin
	IntervalMS float64 `json:"interval_ms"`  // the limit the pause was kept under
	Burst      int     `json:"burst"`
}

// resetJSON is reset's --json document.
type resetJSON struct {
	Key       string      `json:"key"`
	Forgotten int         `json:"forgotten"` // starts forgotten; 0: nothing changed
	State     rateJSON    `json:"state"`     // the key after
	Nearby    *rateNearby `json:"nearby,omitempty"`
}

type resumeJSON struct {
	Key string `json:"key"`
	// Resumed is false when the key had no pause left: nothing changed.
	Resumed      bool        `json:"resumed"`
	PausedLeftMS int64       `json:"paused_left_ms"` // what the pause had left
	State        rateJSON    `json:"state"`          // the key after
	Nearby       *rateNearby `json:"nearby,omitempty"`
}

// rateNearby is nearby for limited keys: the count is of limited keys.
type rateNearby struct {
	TaskType string   `json:"task_type"`
	Keys     []string `json:"keys"`
	More     int      `json:"more"`
	Limited  int      `json:"limited"` // every limited key under the prefix
}

func rateNearbyOf(n *nearby) *rateNearby {
	if n == nil {
		return nil
	}
	return &rateNearby{TaskType: n.TaskType, Keys: n.Keys, More: n.More, Limited: n.Held}
}

// rateTableKey is the key as rates shows it: shortened, and marked when digested.
func rateTableKey(st ratelimit.State) string {
	k := shortkey.Show(st.Key)
	if st.Digested {
		k += "…"
	}
	return k
}

// everyText is a spacing exact to the microsecond, without trailing zero units:
// 16.667ms, 2s, 1m, 1h30m.
func everyText(d time.Duration) string {
	s := d.String()
	if strings.HasSuffix(s, "m0s") {
		s = strings.TrimSuffix(s, "0s")
	}
	if strings.HasSuffix(s, "h0m") {
		s = strings.TrimSuffix(s, "0m")
	}
	return s
}

// until is a time to wait as a person reads it: "now" for none.
func until(d time.Duration) string {
	switch {
	case d <= 0:
		return "now"
	case d < time.Millisecond:
		return "<1ms"
	}
	return human(d)
}

func ceilMS(d time.Duration) int64 {
	return int64((max(d, 0) + time.Millisecond - 1) / time.Millisecond)
}

func intervalMS(d time.Duration) float64 {
	return float64(d/time.Microsecond) / 1000
}

func boolCompare(a, b bool) int {
	switch {
	case a == b:
		return 0
	case b:
		return -1
	}
	return 1
}
