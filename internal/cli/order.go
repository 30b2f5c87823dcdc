package cli

import (
	"context"
	"fmt"
	"io"
	"strconv"

	"github.com/asynqmutex/asynqmutex/order"
)

// The order command shows a key's order: what package order keeps for the
// middleware's InOrder, through its Sequencer.

// orderJSON is order's --json document.
type orderJSON struct {
	Key      string `json:"key"`
	RedisKey string `json:"redis_key"`
	Ordered  bool   `json:"ordered"` // the key has a sequence
	Epoch    string `json:"epoch,omitempty"`
	Next     int64  `json:"next"`
	Last     int64  `json:"last"`
	Waiting  int64  `json:"waiting"` // places taken and not finished
	Skipped  int64  `json:"skipped"`
	Parked   int64  `json:"parked"` // of the places waiting, those whose task parked
	// Halted is the place the key halted at (its task failed for good under
	// HaltOnFailure), 0 if none; HaltedMS how long ago.
	Halted   int64            `json:"halted"`
	HaltedMS int64            `json:"halted_ms,omitempty"`
	Holder   *orderHolderJSON `json:"holder,omitempty"`
	// OtherForms: see showJSON. Nearby: when the key has no order, the ordered keys
	// near it.
	OtherForms []otherFormJSON `json:"other_forms,omitempty"`
	Nearby     *orderNearby    `json:"nearby,omitempty"`
}

type orderHolderJSON struct {
	TaskID    string `json:"task_id"`
	Queue     string `json:"queue"`
	AgeMS     int64  `json:"age_ms"`
	Abandoned bool   `json:"abandoned,omitempty"`
}

// orderNearby is nearby for ordered keys: the count is of ordered keys.
type orderNearby struct {
	TaskType string   `json:"task_type"`
	Keys     []string `json:"keys"`
	More     int      `json:"more"`
	Ordered  int      `json:"ordered"` // every ordered key under the prefix
}

// orderShow prints key's order, of the first form of the key that has one (see
// forms): its next place and the task that holds it. A key without an order is a
// failure, told on stderr after the report, with the ordered keys near it listed,
// as show does for locks.
func orderShow(ctx context.Context, seq *order.Sequencer, forms []form, given string, p *printer, stderr io.Writer) error {
	all, shown, err := lookUp(forms, func(key string) (order.State, bool, error) {
		st, err := seq.Inspect(ctx, key)
		return st, st.Epoch != "", err
	})
	if err != nil {
		return err
	}
	st, key := all[shown].v, all[shown].key
	var near *nearby
	if st.Epoch == "" {
		if near, err = findOrderNearby(ctx, seq, key); err != nil {
			return err
		}
	}
	if p.json {
		doc := orderJSON{Key: key, RedisKey: st.RedisKey, Ordered: st.Epoch != "", Epoch: st.Epoch,
			Next: st.Next, Last: st.Last, Waiting: st.Waiting(), Skipped: st.Skipped, Parked: st.Parked, OtherForms: othersJSON(all, shown),
			Halted: st.Halted, HaltedMS: st.HaltedFor.Milliseconds()}
		if st.Waiting() > 0 && st.Holder.TaskID != "" {
			doc.Holder = &orderHolderJSON{TaskID: st.Holder.TaskID, Queue: st.Holder.Queue,
				AgeMS: st.Holder.Age.Milliseconds(), Abandoned: st.Holder.Abandoned}
		}
		if near != nil {
			doc.Nearby = &orderNearby{TaskType: near.TaskType, Keys: near.Keys, More: near.More, Ordered: near.Held}
		}
		err = p.encode(doc)
	} else {
		p.orderText(st, all, shown, given, near)
	}
	if err == nil && st.Epoch == "" {
		err = notFound(stderr, all, p.prefix, orderWords)
	}
	return err
}

// orderText is order's report for a person.
func (p *printer) orderText(st order.State, all []found[order.State], shown int, given string, near *nearby) {
	field := func(label, format string, args ...any) {
		fmt.Fprintf(p.w, "%-13s"+format+"\n", append([]any{label}, args...)...)
	}
	field("Key:", "%s", keyLine(printable(all[shown].key), all[shown].form, given))
	if st.Epoch == "" {
		field("State:", "not ordered: no task of this key took a place under prefix %s (or its order was idle for %s and forgotten)",
			strconv.Quote(p.prefix), human(order.IdleKeep))
		writeOthers(p.w, all, shown, orderWords)
		near.writeAs(p.w, p.prefix, orderWords)
		return
	}
	switch w := st.Waiting(); {
	case w == 0:
		field("Next place:", "%d; every place taken is finished", st.Next)
	default:
		field("Next place:", "%d of %d taken: %d %s not finished, %d parked (in no worker, started when their turn comes)",
			st.Next, st.Last, w, plural(int(w), "place", "places"), st.Parked)
		h := st.Holder
		switch {
		case h.TaskID == "":
			field("Waits for:", "no task recorded for the place")
		case h.Abandoned:
			field("Waits for:", "task %s in queue %s, never enqueued (its producer gave the place up); the key moves past it",
				printable(h.TaskID), printable(h.Queue))
		case h.Halted:
			field("Waits for:", "task %s in queue %s, which failed for good %s ago: the key HALTED there (HaltOnFailure)",
				printable(h.TaskID), printable(h.Queue), human(st.HaltedFor))
			field("To go on:", "run the task again from asynq's archive (it finishes its place when it completes), or move the key past it: asynqmutex order --skip %d %s",
				st.Next, taskArgs(all[shown].key))
		default:
			field("Waits for:", "task %s in queue %s, which took its place %s ago", printable(h.TaskID), printable(h.Queue), human(h.Age))
		}
	}
	field("Skipped:", "%d %s moved past without %s finishing", st.Skipped, plural(int(st.Skipped), "place", "places"),
		plural(int(st.Skipped), "its task", "their tasks"))
	field("Redis key:", "%s", printable(st.RedisKey))
	writeOthers(p.w, all, shown, orderWords)
}

// findOrderNearby lists the ordered keys near key (see nearby), with one SCAN.
func findOrderNearby(ctx context.Context, seq *order.Sequencer, key string) (*nearby, error) {
	return nearKeys(key, func(yield func(keyOf, error) bool) {
		for st, err := range seq.List(ctx) {
			if !yield(keyOf{st.Key, st.Digested}, err) {
				return
			}
		}
	})
}

// orderSkip moves key past its next place if that is place n: as the workers do for
// a task that is gone, for a person who knows it will not come; also past a place
// the key halted at (HaltOnFailure), which the workers never move past.
func orderSkip(ctx context.Context, seq *order.Sequencer, key string, n int64, p *printer, stderr io.Writer) error {
	st, err := seq.Inspect(ctx, key)
	if err != nil {
		return err
	}
	if st.Epoch == "" || st.Next != n || st.Waiting() == 0 {
		fmt.Fprintf(stderr, "asynqmutex: nothing skipped: the next place of %s is not %d (next %d, last taken %d); 'asynqmutex order %s' shows it\n",
			quoteKey(key), n, st.Next, st.Last, taskArgs(key))
		return errReported
	}
	next, err := seq.Finish(ctx, key, order.Place{Epoch: st.Epoch, N: n}, order.Forced)
	if err != nil {
		return err
	}
	if next == 0 {
		fmt.Fprintf(stderr, "asynqmutex: nothing skipped: %s moved past place %d meanwhile; 'asynqmutex order %s' shows it\n",
			quoteKey(key), n, taskArgs(key))
		return errReported
	}
	if p.json {
		return p.encode(struct {
			Key     string `json:"key"`
			Skipped int64  `json:"skipped"`
			Next    int64  `json:"next"`
		}{key, n, next})
	}
	_, err = fmt.Fprintf(p.w, "Moved %s past place %d (task %s); its next place is %d.\n", quoteKey(key), n, printable(st.Holder.TaskID), next)
	return err
}
