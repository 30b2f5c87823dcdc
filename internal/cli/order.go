package cli

import (
	"context"
	"fmt"
	"strconv"

	"github.com/asynqmutex/asynqmutex/order"
)

// The order command shows a key's order: what package order keeps for the
// middleware's InOrder, through its Sequencer.

// orderJSON is order's --json document.
type orderJSON struct {
	Key      string           `json:"key"`
	RedisKey string           `json:"redis_key"`
	Ordered  bool             `json:"ordered"` // the key has a sequence
	Epoch    string           `json:"epoch,omitempty"`
	Next     int64            `json:"next"`
	Last     int64            `json:"last"`
	Waiting  int64            `json:"waiting"` // places taken and not finished
	Skipped  int64            `json:"skipped"`
	Holder   *orderHolderJSON `json:"holder,omitempty"`
}

type orderHolderJSON struct {
	TaskID    string `json:"task_id"`
	Queue     string `json:"queue"`
	AgeMS     int64  `json:"age_ms"`
	Abandoned bool   `json:"abandoned,omitempty"`
}

// orderShow prints key's order: its next place and the task that holds it.
func orderShow(ctx context.Context, seq *order.Sequencer, key, given string, p *printer) error {
	st, err := seq.Inspect(ctx, key)
	if err != nil {
		return err
	}
	if p.json {
		doc := orderJSON{Key: key, RedisKey: st.RedisKey, Ordered: st.Epoch != "", Epoch: st.Epoch,
			Next: st.Next, Last: st.Last, Waiting: st.Waiting(), Skipped: st.Skipped}
		if st.Waiting() > 0 && st.Holder.TaskID != "" {
			doc.Holder = &orderHolderJSON{TaskID: st.Holder.TaskID, Queue: st.Holder.Queue,
				AgeMS: st.Holder.Age.Milliseconds(), Abandoned: st.Holder.Abandoned}
		}
		return p.encode(doc)
	}
	field := func(label, format string, args ...any) {
		fmt.Fprintf(p.w, "%-13s"+format+"\n", append([]any{label}, args...)...)
	}
	if given != "" && given != key {
		field("Key:", "%s (given as %s, read as the middleware writes it)", printable(key), printable(given))
	} else {
		field("Key:", "%s", printable(key))
	}
	if st.Epoch == "" {
		field("State:", "not ordered: no task of this key took a place under prefix %s (or its order was idle for %s and forgotten)",
			strconv.Quote(p.prefix), human(order.IdleKeep))
		return nil
	}
	switch w := st.Waiting(); {
	case w == 0:
		field("Next place:", "%d; every place taken is finished", st.Next)
	default:
		field("Next place:", "%d of %d taken: %d %s not finished", st.Next, st.Last, w, plural(int(w), "place", "places"))
		h := st.Holder
		switch {
		case h.TaskID == "":
			field("Waits for:", "no task recorded for the place")
		case h.Abandoned:
			field("Waits for:", "task %s in queue %s, never enqueued (its producer gave the place up); the key moves past it",
				printable(h.TaskID), printable(h.Queue))
		default:
			field("Waits for:", "task %s in queue %s, which took its place %s ago", printable(h.TaskID), printable(h.Queue), human(h.Age))
		}
	}
	field("Skipped:", "%d %s moved past without their task finishing", st.Skipped, plural(int(st.Skipped), "place", "places"))
	field("Redis key:", "%s", printable(st.RedisKey))
	return nil
}
