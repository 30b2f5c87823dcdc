package cli

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/asynqmutex/asynqmutex/internal/shortkey"
	"github.com/asynqmutex/asynqmutex/mutex"
	"github.com/asynqmutex/asynqmutex/order"
)

// printer writes a command's result as text for people or, with json, as one JSON
// document for scripts.
type printer struct {
	w      io.Writer
	json   bool
	prefix string
}

func (p *printer) encode(v any) error {
	enc := json.NewEncoder(p.w)
	enc.SetIndent("", "  ")
	enc.SetEscapeHTML(false)
	return enc.Encode(v)
}

// list prints every held lock, sorted by key; a lock held by the task whose turn
// it is in its key's order (InOrder) shows the task's place.
func list(ctx context.Context, locks *mutex.Client, orders *order.Sequencer, p *printer) error {
	var held []mutex.Info
	for in, err := range locks.List(ctx) {
		if err != nil {
			return err
		}
		held = append(held, in)
	}
	slices.SortFunc(held, func(a, b mutex.Info) int {
		return cmp.Or(strings.Compare(a.Key, b.Key), strings.Compare(a.RedisKey, b.RedisKey))
	})
	places, err := placesOf(ctx, orders, held)
	if err != nil {
		return err
	}
	if p.json {
		doc := listJSON{Prefix: p.prefix, Locks: make([]lockJSON, 0, len(held))}
		for i, in := range held {
			j := p.lockJSON(in, false)
			j.Place = places[i]
			doc.Locks = append(doc.Locks, j)
		}
		return p.encode(doc)
	}
	if len(held) == 0 {
		_, err := fmt.Fprintf(p.w, "no locks held under prefix %s\n", strconv.Quote(p.prefix))
		return err
	}
	tw := tabwriter.NewWriter(p.w, 0, 8, 2, ' ', 0)
	fmt.Fprintln(tw, "KEY\tHOLDER\tHELD FOR\tLEASE\tFENCE\tWAITING")
	for i, in := range held {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", p.tableKey(in), holderBrief(in, places[i]), p.heldFor(in), leaseText(in), fenceText(in), waitingText(in))
	}
	return tw.Flush()
}

// placesOf returns, for each lock of held, the place in its key's order of the task
// that holds it, or 0: the key has no order, its turn is another task's, or the
// holder recorded no task (one read of the key's order per such lock). A user
// whose ACL rules leave out order's (docs/operating.md) is shown no places.
func placesOf(ctx context.Context, orders *order.Sequencer, held []mutex.Info) ([]int64, error) {
	places := make([]int64, len(held))
	for i, in := range held {
		if in.Holder.ID == "" || in.Digested || in.Foreign || in.Limit > 1 {
			continue // InOrder takes plain locks, as HeldBy(task type, task ID)
		}
		st, err := orders.Inspect(ctx, in.Key)
		if refusedByACL(err) {
			return places, nil
		}
		if err != nil {
			return nil, err
		}
		if st.Waiting() > 0 && st.Holder.TaskID == in.Holder.ID {
			places[i] = st.Next
		}
	}
	return places, nil
}

// show prints one lock in full, of the first form of the key that is held (see
// forms), and what the other forms hold. A key nobody holds is a failure, told on
// stderr after the report: the keys held near it are listed, so that a mistyped key
// is not read as a free one.
func show(ctx context.Context, locks *mutex.Client, forms []form, given string, p *printer, stderr io.Writer) error {
	all, shown, err := lookUp(forms, func(key string) (mutex.Info, bool, error) {
		in, err := locks.Inspect(ctx, key)
		return in, in.Held, err
	})
	if err != nil {
		return err
	}
	in, key := all[shown].v, all[shown].key
	var near *nearby
	if !in.Held {
		if near, err = findNearby(ctx, locks, key); err != nil {
			return err
		}
	}
	if p.json {
		if err := p.encode(showJSON{lockJSON: p.lockJSON(in, true), OtherForms: othersJSON(all, shown), Nearby: near}); err != nil {
			return err
		}
	} else if err := p.showText(in, all, shown, given, near); err != nil {
		return err
	}
	if !in.Held {
		return notFound(stderr, all, p.prefix, lockWords)
	}
	return nil
}

// showText is show's report for a person.
func (p *printer) showText(in mutex.Info, all []found[mutex.Info], shown int, given string, near *nearby) error {
	field := func(label, format string, args ...any) {
		fmt.Fprintf(p.w, "%-13s"+format+"\n", append([]any{label}, args...)...)
	}
	field("Key:", "%s", keyLine(keyText(in), all[shown].form, given))
	field("Redis key:", "%s", printable(in.RedisKey))
	switch {
	case in.Foreign:
		field("State:", "held, by a value not written by asynqmutex (set by hand?)")
		field("Lease left:", "%s", leaseText(in))
	case in.Held && in.Limit > 1:
		field("State:", "held by %d %s, at most %d at once (Limit %d)", len(in.Slots), plural(len(in.Slots), "holder", "holders"), in.Limit, in.Limit)
	case in.Held:
		field("State:", "held")
		field("Holder:", "%s", holderText(in))
		field("Since:", "%s (held for %s)", in.Since.UTC().Format(time.RFC3339Nano), p.heldFor(in))
		field("Lease left:", "%s", leaseText(in))
		field("Fence:", "%d", in.Fence)
	default:
		field("State:", "not held: nobody holds this key under prefix %s", strconv.Quote(p.prefix))
		if in.Holder != (mutex.Holder{}) {
			field("Last holder:", "%s", holderText(in))
		}
		if in.Fence != 0 {
			field("Last fence:", "%d (released recently; the next holder's will be higher)", in.Fence)
		}
	}
	field("Waiting:", "%s", waitingText(in))
	for i, w := range in.Waiters {
		fmt.Fprintf(p.w, "  %d. %s\n", i+1, printable(w.String()))
	}
	if more := in.Waiting - len(in.Waiters); more > 0 {
		fmt.Fprintf(p.w, "  … and %d more\n", more)
	}
	if in.Held && in.Limit > 1 && len(in.Slots) > 0 {
		fmt.Fprintf(p.w, "Holders:\n")
		if err := p.slots(in); err != nil {
			return err
		}
	}
	writeOthers(p.w, all, shown, lockWords)
	if near != nil {
		near.write(p.w, p.prefix)
	}
	return nil
}

// release frees the lock on key by force and says what happened to it. Finding
// nobody holding it is a failure: nothing was done, and a mistyped key is the
// likeliest cause.
func release(ctx context.Context, locks *mutex.Client, key, given string, p *printer, stderr io.Writer) error {
	r, err := locks.ForceRelease(ctx, key)
	if err != nil {
		return err
	}
	if !r.Before.Held && !r.Repeated && given != "" && given != key {
		// A key of KeyBy's that only looks like the middleware's, held as typed. A
		// release of a free key changes nothing, so trying both forms is safe.
		asGiven, err := locks.ForceRelease(ctx, given)
		if err != nil {
			return err
		}
		if asGiven.Before.Held || asGiven.Repeated {
			r, key = asGiven, given
		}
	}
	before, handedTo := r.Before, r.Fence
	var near *nearby
	if !before.Held && !r.Repeated {
		if near, err = findNearby(ctx, locks, key); err != nil {
			return err
		}
	}
	if r.Repeated {
		// The request was sent again after its reply was lost, and found its own work.
		if p.json {
			return p.encode(releaseJSON{Key: key, RedisKey: before.RedisKey, Released: true, Repeated: true, Before: p.beforeJSON(before)})
		}
		_, err := fmt.Fprintf(p.w, "Released %s. The reply was lost and the request sent again, which found the release done;\n"+
			"who held it and where it went are not known: run 'asynqmutex show' to see who holds it now.\n", quoteKey(key))
		return err
	}
	if p.json {
		doc := releaseJSON{Key: key, RedisKey: before.RedisKey, Released: before.Held, Before: p.beforeJSON(before), Nearby: near}
		if before.Held {
			doc.Free = handedTo == 0
			if handedTo != 0 {
				doc.HandedToFence = &handedTo
				h := holderJSON(r.HandedTo)
				doc.HandedTo = &h
			}
		}
		if err := p.encode(doc); err != nil {
			return err
		}
	}
	if !before.Held {
		fmt.Fprintf(stderr, "asynqmutex: nothing to release: nobody holds %s under prefix %s\n", quoteKey(key), strconv.Quote(p.prefix))
		if near != nil {
			near.write(stderr, p.prefix)
		}
		return errReported
	}
	if p.json {
		return nil
	}
	fmt.Fprintf(p.w, "Released %s.\n", keyText(before))
	if before.Foreign {
		fmt.Fprintf(p.w, "Its value was not written by asynqmutex (set by hand?) and has been deleted; the key is now free.\n")
		return nil
	}
	fmt.Fprintf(p.w, "Previous holder: %s, fence %d, held for %s.\n", holderText(before), before.Fence, p.heldFor(before))
	if handedTo != 0 {
		fmt.Fprintf(p.w, "Handed to the next waiter, %s, with fence %d.\n", printable(r.HandedTo.String()), handedTo)
	} else {
		fmt.Fprintf(p.w, "Now free; the next holder's fence will be higher than %d.\n", before.Fence)
	}
	fmt.Fprintf(p.w, "The previous holder can no longer extend or release it: its Extend and Unlock return\n"+
		"ErrNotHeld. Under WithLock or the middleware its work is cancelled at its next renewal,\n"+
		"or reported as a lost lease if it ends first. Until then it may still write: a resource\n"+
		"that checks fences rejects fence %d.\n", before.Fence)
	return nil
}

type listJSON struct {
	Prefix string     `json:"prefix"`
	Locks  []lockJSON `json:"locks"`
}

// lockJSON is mutex.Info for scripts. When held is false, since and fence (and
// holder, if known) describe the last holder while Redis still remembers it.
type lockJSON struct {
	Key         string       `json:"key"`
	Digested    bool         `json:"digested"` // key is only the first 64 bytes of a longer key
	RedisKey    string       `json:"redis_key"`
	Held        bool         `json:"held"`
	Foreign     bool         `json:"foreign"` // held by a value asynqmutex did not write
	Holder      *holderJSON  `json:"holder"`
	Since       *string      `json:"since"`
	HeldForMS   *int64       `json:"held_for_ms"`
	LeaseLeftMS *int64       `json:"lease_left_ms"` // -1: no expiry
	Fence       int64        `json:"fence"`
	Waiting     int          `json:"waiting"`
	Waiters     []holderJSON `json:"waiters,omitempty"` // show only
	// Parked: how many of waiting are tasks parked in the key's line (mutex.Park),
	// started ones included; null where not counted (release's before).
	// ParkedForMS: how long the oldest of them has waited; null when none is.
	Parked      *int   `json:"parked"`
	ParkedForMS *int64 `json:"parked_for_ms"`
	// Limit and Holders: a key held with Limit(n), n > 1; holder, since, fence and
	// held_for_ms then describe the newest holder, lease_left_ms the longest lease.
	Limit   int        `json:"limit,omitempty"`
	Holders []slotJSON `json:"holders,omitempty"`
	// Place: list only, the holder's place in the key's order (InOrder), when its
	// task is the one whose turn it is.
	Place int64 `json:"place,omitempty"`
}

type slotJSON struct {
	Holder      holderJSON `json:"holder"`
	Since       string     `json:"since"`
	Fence       int64      `json:"fence"`
	LeaseLeftMS int64      `json:"lease_left_ms"`
}

type holderJSON struct {
	Name string `json:"name"`
	ID   string `json:"id"`
	Host string `json:"host"`
	PID  int    `json:"pid"`
}

type releaseJSON struct {
	Key      string `json:"key"`
	RedisKey string `json:"redis_key"`
	// Released is false when nobody held the lock: then nothing changed.
	Released bool `json:"released"`
	// Before is the lock as it was, its waiters counted but not listed (parked is
	// null: not counted).
	Before lockJSON `json:"before"`
	// HandedTo and HandedToFence are the waiter the lock went to and its fence, Free
	// whether it went to none.
	HandedTo      *holderJSON `json:"handed_to"`
	HandedToFence *int64      `json:"handed_to_fence"`
	Free          bool        `json:"free"`
	// Repeated: the request was sent again after its reply was lost and found its own
	// release applied; before, handed_to and free are then not known.
	Repeated bool `json:"repeated"`
	// Nearby: when nobody held the key, the keys held near it.
	Nearby *nearby `json:"nearby,omitempty"`
}

// showJSON is show's document: the lock, the other forms of its key and, when
// nobody holds it, the keys held near it.
type showJSON struct {
	lockJSON
	// OtherForms: the other keys the command line may mean (see forms).
	OtherForms []otherFormJSON `json:"other_forms,omitempty"`
	Nearby     *nearby         `json:"nearby,omitempty"`
}

func (p *printer) lockJSON(in mutex.Info, waiters bool) lockJSON {
	j := lockJSON{
		Key: in.Key, Digested: in.Digested, RedisKey: in.RedisKey, Held: in.Held, Foreign: in.Foreign,
		Fence: in.Fence, Waiting: in.Waiting, Parked: &in.Parked,
	}
	if in.Parked > 0 {
		ms := in.ParkedFor.Milliseconds()
		j.ParkedForMS = &ms
	}
	if in.Holder != (mutex.Holder{}) {
		h := holderJSON(in.Holder)
		j.Holder = &h
	}
	known := !in.Foreign && in.Fence != 0
	if known {
		since := in.Since.UTC().Format(time.RFC3339Nano)
		j.Since = &since
	}
	if in.Held && known {
		ms := in.HeldFor.Milliseconds()
		j.HeldForMS = &ms
	}
	if in.Held && in.TTL != 0 {
		ms := in.TTL.Milliseconds()
		if in.TTL < 0 {
			ms = -1
		}
		j.LeaseLeftMS = &ms
	}
	if in.Limit > 1 {
		j.Limit = in.Limit
		for _, s := range in.Slots {
			j.Holders = append(j.Holders, slotJSON{Holder: holderJSON(s.Holder), Since: s.Since.UTC().Format(time.RFC3339Nano),
				Fence: s.Fence, LeaseLeftMS: s.TTL.Milliseconds()})
		}
	}
	if waiters {
		j.Waiters = make([]holderJSON, 0, len(in.Waiters))
		for _, w := range in.Waiters {
			j.Waiters = append(j.Waiters, holderJSON(w))
		}
	}
	return j
}

// beforeJSON is the lock as ForceRelease found it, which does not count its parked
// tasks.
func (p *printer) beforeJSON(in mutex.Info) lockJSON {
	j := p.lockJSON(in, false)
	j.Parked, j.ParkedForMS = nil, nil
	return j
}

// tableKey is the key as list shows it: shortened, and marked when digested.
func (p *printer) tableKey(in mutex.Info) string {
	k := shortkey.Show(in.Key)
	if in.Digested {
		k += "…"
	}
	return k
}

// keyText is the key whole, marked when only its start is known.
func keyText(in mutex.Info) string {
	k := printable(in.Key)
	if in.Digested {
		k += "… (a longer key: Redis keeps its first 64 bytes and a digest)"
	}
	return k
}

func quoteKey(key string) string { return shortkey.Show(key) }

func holderText(in mutex.Info) string {
	if in.Foreign {
		return "unknown (value not written by asynqmutex)"
	}
	if in.Limit > 1 && len(in.Slots) > 1 {
		return printable(in.Holder.String()) + fmt.Sprintf(" and %d more (Limit %d)", len(in.Slots)-1, in.Limit)
	}
	return printable(in.Holder.String())
}

// holderBrief is the holder as list shows it, to keep a line within a terminal's
// width: without its task type when the key begins with it, the ID cut to its
// first 8 characters, and the count of further holders of a key held with
// Limit(n). show gives it whole. The task at place (when not 0) in its key's order
// is shown by its type and place instead: the IDs Producer gives its tasks begin
// with the time, alike in their first characters.
func holderBrief(in mutex.Info, place int64) string {
	if in.Foreign {
		return "unknown (set by hand?)"
	}
	h := in.Holder
	switch typ, _, ok := splitKey(in.Key); {
	case place > 0:
		h.ID = "place " + strconv.FormatInt(place, 10)
	case ok && typ == h.Name && h.ID != "":
		h.Name = ""
	}
	if cut := 8; place == 0 && len(h.ID) > cut+1 {
		for cut > 0 && !utf8.RuneStart(h.ID[cut]) {
			cut--
		}
		h.ID = h.ID[:cut] + "…"
	}
	text := printable(h.String())
	if in.Limit > 1 && len(in.Slots) > 1 {
		text += fmt.Sprintf(" +%d (Limit %d)", len(in.Slots)-1, in.Limit)
	}
	return text
}

// slots lists the holders of a key held with Limit(n), oldest fence first.
func (p *printer) slots(in mutex.Info) error {
	tw := tabwriter.NewWriter(p.w, 0, 8, 2, ' ', 0)
	fmt.Fprintln(tw, "  HOLDER\tSINCE\tLEASE LEFT\tFENCE")
	for _, s := range in.Slots {
		fmt.Fprintf(tw, "  %s\t%s\t%s\t%d\n", printable(s.Holder.String()), s.Since.UTC().Format(time.RFC3339Nano), human(s.TTL), s.Fence)
	}
	return tw.Flush()
}

func (p *printer) heldFor(in mutex.Info) string {
	if in.Foreign || in.Since.IsZero() {
		return "-"
	}
	return human(in.HeldFor)
}

func leaseText(in mutex.Info) string {
	switch {
	case in.TTL < 0:
		return "no expiry"
	case in.TTL == 0:
		return "-"
	}
	return human(in.TTL)
}

// waitingText is how many wait for the lock, and how many of them are tasks parked
// in its line and since when: "12 (10 parked, oldest 4.2s)".
func waitingText(in mutex.Info) string {
	if in.Parked == 0 {
		return strconv.Itoa(in.Waiting)
	}
	return fmt.Sprintf("%d (%d parked, oldest %s)", in.Waiting, in.Parked, human(in.ParkedFor))
}

func fenceText(in mutex.Info) string {
	if in.Foreign {
		return "-"
	}
	return strconv.FormatInt(in.Fence, 10)
}

// human rounds d to what a person reads at a glance: milliseconds below a second,
// tenths of a second below a minute, seconds below an hour, minutes below a day.
func human(d time.Duration) string {
	switch {
	case d < time.Second:
		return d.Round(time.Millisecond).String()
	case d < time.Minute:
		return d.Round(100 * time.Millisecond).String()
	case d < time.Hour:
		return d.Round(time.Second).String()
	case d < 24*time.Hour:
		return strings.TrimSuffix(d.Round(time.Minute).String(), "0s")
	}
	d = d.Round(time.Hour)
	if d%(24*time.Hour) == 0 {
		return fmt.Sprintf("%dd", d/(24*time.Hour))
	}
	return fmt.Sprintf("%dd%dh", d/(24*time.Hour), d%(24*time.Hour)/time.Hour)
}

// printable returns s as it is when every character prints, and quoted otherwise, so
// that a key or host name cannot move the cursor or break a table's columns.
func printable(s string) string {
	for _, r := range s {
		if r == unicode.ReplacementChar || !unicode.IsPrint(r) {
			return strconv.Quote(s)
		}
	}
	return s
}
