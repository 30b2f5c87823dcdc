package cli

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynqmutex/asynqmutex"
	"github.com/asynqmutex/asynqmutex/internal/shortkey"
	"github.com/asynqmutex/asynqmutex/order"
)

// order --blocked lists the ordered keys (InOrder) whose next place's task is not
// running, with why, as asynq tells it. A task that nobody will run (enqueued to a
// queue no server reads) holds its key's every later task back: each goes back to
// its queue, again and again, without a retry spent and without a log line, and
// only this list names the task it waits for.

// blockedJSON is one key of order --blocked's --json array.
type blockedJSON struct {
	Key      string `json:"key"`
	Digested bool   `json:"digested"` // key is only the first 64 bytes of a longer key
	RedisKey string `json:"redis_key"`
	Place    int64  `json:"place"`   // the key's next place, whose task is not running
	Waiting  int64  `json:"waiting"` // places taken and not finished, place included
	TaskID   string `json:"task_id"` // the place's task, as its producer recorded it
	Queue    string `json:"queue"`
	AgeMS    int64  `json:"age_ms"` // since the place was taken, on the Redis server's clock
	// State is asynq's state of the task (pending, scheduled, retry, aggregating,
	// active, archived, completed), or not_in_asynq, abandoned (its producer could
	// not enqueue it), no_task (no task recorded for the place) or halted (the key
	// halted at it: it failed for good under HaltOnFailure).
	State string `json:"state"`
	// Due: scheduled and retry, when asynq is to run the task (RFC 3339).
	Due string `json:"due,omitempty"`
	// QueueServed: a running asynq server reads the task's queue.
	QueueServed bool `json:"queue_served"`
	// Stuck: nothing moves the key on but a person: the task is still to run and no
	// server reads its queue, or the key halted at it.
	Stuck  bool   `json:"stuck"`
	Reason string `json:"reason"` // the same, for a person
}

// blockage is why a key's next place's task is not running.
type blockage struct {
	state  string    // see blockedJSON.State
	due    time.Time // scheduled, retry: when asynq is to run the task
	served bool      // a running asynq server reads the task's queue
	stuck  bool      // see blockedJSON.Stuck
	reason string
}

// blockedKey is one key order --blocked lists.
type blockedKey struct {
	order.State
	blockage
}

// asynqError is an error of asynq's Redis, which execute explains in the terms of
// the connection that reaches it (--asynq_uri).
type asynqError struct{ err error }

func (e *asynqError) Error() string { return e.err.Error() }
func (e *asynqError) Unwrap() error { return e.err }

// orderBlocked runs order --blocked: on the Redis of the locks (c) and asynq's
// (tasks, which may be c), it prints every ordered key whose next place's task is
// not running, sorted by key. Keys that nothing moves on but a person make it a
// failure, told on stderr after the report.
func orderBlocked(ctx context.Context, c, tasks *conn, p *printer, stderr io.Writer) error {
	if tasks != c {
		if err := tasks.rdb.Ping(ctx).Err(); err != nil {
			return tasks.explain(err)
		}
	}
	blocked, err := findBlocked(ctx, c.orders, &asynqView{tasks: asynq.NewInspectorFromRedisClient(tasks.rdb)})
	if ae := (*asynqError)(nil); errors.As(err, &ae) {
		return tasks.explain(ae.err)
	}
	if err != nil {
		return c.explain(err)
	}
	if p.json {
		err = p.encode(blockedJSONOf(blocked))
	} else {
		err = p.blockedText(blocked)
	}
	if err != nil {
		return err
	}
	if n := countStuck(blocked); n > 0 {
		fmt.Fprintf(stderr, "asynqmutex: %d ordered %s will not move on by %s: no asynq server reads the queue of the task %s for, or %s halted (see REASON)\n",
			n, plural(n, "key", "keys"), plural(n, "itself", "themselves"), plural(n, "it waits", "they wait"), plural(n, "it", "they"))
		return errReported
	}
	return nil
}

// findBlocked reads every ordered key with a place not finished, sorted by key, and
// returns those whose next place's task is not running, with why.
func findBlocked(ctx context.Context, seq *order.Sequencer, v *asynqView) ([]blockedKey, error) {
	var waiting []order.State
	for st, err := range seq.List(ctx) {
		if err != nil {
			return nil, err
		}
		if st.Waiting() > 0 {
			waiting = append(waiting, st)
		}
	}
	slices.SortFunc(waiting, func(a, b order.State) int {
		return cmp.Or(strings.Compare(a.Key, b.Key), strings.Compare(a.RedisKey, b.RedisKey))
	})
	var blocked []blockedKey
	for _, st := range waiting {
		b, ok, err := v.judge(st.Holder)
		if err != nil {
			return nil, err
		}
		if ok {
			blocked = append(blocked, blockedKey{st, b})
		}
	}
	return blocked, nil
}

// asynqView is what order --blocked asks asynq: about the tasks ordered keys wait
// for, and which queues its servers read (asked once).
type asynqView struct {
	tasks  *asynq.Inspector
	read   map[string]int  // per queue, the running servers that read it
	listed map[string]bool // the queues of every server, those shutting down included
}

// servers reads the servers' queues, once.
func (v *asynqView) servers() error {
	if v.read != nil {
		return nil
	}
	all, err := v.tasks.Servers()
	if err != nil {
		return &asynqError{fmt.Errorf("listing asynq's servers: %w", err)}
	}
	v.read, v.listed = map[string]int{}, map[string]bool{}
	for _, s := range all {
		for q := range s.Queues {
			v.listed[q] = true
			if s.Status == "active" { // a server that stopped fetching says "stopped"
				v.read[q]++
			}
		}
	}
	return nil
}

// judge says why h, the task that holds a key's next place, is not running, or
// returns ok false when it is: asynq holds it active, in a queue some server lists
// (a server shutting down still runs its tasks). A place whose task asynq does not
// hold is read by the middleware's rule, with DefaultOrderGrace.
func (v *asynqView) judge(h order.Holder) (b blockage, ok bool, err error) {
	const movedPast = "the key moves past it when its next task asks"
	q := shortkey.Quote(h.Queue)
	switch {
	case h.Halted:
		return blockage{state: "halted", stuck: true,
			reason: fmt.Sprintf("HALTED at it (HaltOnFailure): it failed for good; run it again from asynq's archive (queue %s), or move the key past it", q)}, true, nil
	case h.Abandoned:
		return blockage{state: "abandoned", reason: "abandoned: its producer could not enqueue it; " + movedPast}, true, nil
	case h.TaskID == "":
		return blockage{state: "no_task", reason: "no task recorded for the place; " + movedPast}, true, nil
	}
	if err := v.servers(); err != nil {
		return b, false, err
	}
	b.served = v.read[h.Queue] > 0
	info, err := v.tasks.GetTaskInfo(h.Queue, h.TaskID)
	switch {
	case errors.Is(err, asynq.ErrTaskNotFound), errors.Is(err, asynq.ErrQueueNotFound):
		b.state = "not_in_asynq"
		grace := human(asynqmutex.DefaultOrderGrace)
		if h.Age < asynqmutex.DefaultOrderGrace {
			b.reason = fmt.Sprintf("not in asynq (queue %s) yet: its producer may be enqueuing it; the key waits for it until its place is OrderGrace old (%s by default)", q, grace)
		} else {
			b.reason = fmt.Sprintf("not in asynq (queue %s): deleted, or never enqueued; %s, its place being older than OrderGrace (%s by default)", q, movedPast, grace)
		}
		return b, true, nil
	case err != nil:
		return b, false, &asynqError{fmt.Errorf("asking asynq about task %s in queue %s: %w", shortkey.Quote(h.TaskID), q, err)}
	}
	b.state = info.State.String()
	switch info.State {
	case asynq.TaskStateActive:
		if v.listed[h.Queue] {
			return b, false, nil
		}
		b.stuck = true
		b.reason = fmt.Sprintf("active in queue %s, which no server reads: its worker is gone, and asynq puts it back only once a server reads the queue", q)
	case asynq.TaskStateArchived:
		b.reason = fmt.Sprintf("archived in queue %s; %s", q, movedPast)
	case asynq.TaskStateCompleted:
		b.reason = fmt.Sprintf("completed in queue %s, its place not finished; %s", q, movedPast)
	default: // pending, scheduled, retry, aggregating: to run once a server takes it
		b.stuck = !b.served
		what := b.state
		switch info.State {
		case asynq.TaskStateScheduled:
			b.due = info.NextProcessAt
		case asynq.TaskStateRetry:
			what, b.due = "waiting for a retry", info.NextProcessAt
		case asynq.TaskStateAggregating:
			what = "aggregating in group " + shortkey.Quote(info.Group)
		}
		switch n := v.read[h.Queue]; {
		case n == 0:
			b.reason = fmt.Sprintf("%s in queue %s, which no server reads", what, q)
		case !b.due.IsZero():
			b.reason = fmt.Sprintf("%s in queue %s, due %s", what, q, dueText(time.Until(b.due)))
		default:
			b.reason = fmt.Sprintf("%s in queue %s, which %d %s: behind its other tasks, or the queue is paused", what, q, n,
				plural(n, "server reads", "servers read"))
		}
	}
	return b, true, nil
}

// dueText says when something due d from now is.
func dueText(d time.Duration) string {
	if d < 0 {
		return human(-d) + " ago"
	}
	return "in " + human(d)
}

func countStuck(blocked []blockedKey) int {
	n := 0
	for _, k := range blocked {
		if k.stuck {
			n++
		}
	}
	return n
}

func blockedJSONOf(blocked []blockedKey) []blockedJSON {
	doc := make([]blockedJSON, 0, len(blocked))
	for _, k := range blocked {
		j := blockedJSON{Key: k.Key, Digested: k.Digested, RedisKey: k.RedisKey, Place: k.Next, Waiting: k.Waiting(),
			TaskID: k.Holder.TaskID, Queue: k.Holder.Queue, AgeMS: k.Holder.Age.Milliseconds(), State: k.state,
			QueueServed: k.served, Stuck: k.stuck, Reason: k.reason}
		if !k.due.IsZero() {
			j.Due = k.due.UTC().Format(time.RFC3339Nano)
		}
		doc = append(doc, j)
	}
	return doc
}

// blockedText is order --blocked's table for a person, and what to do about the
// keys that will not move on by themselves.
func (p *printer) blockedText(blocked []blockedKey) error {
	if len(blocked) == 0 {
		_, err := fmt.Fprintf(p.w, "no ordered key under prefix %s waits for a task that is not running\n", strconv.Quote(p.prefix))
		return err
	}
	tw := tabwriter.NewWriter(p.w, 0, 8, 2, ' ', 0)
	fmt.Fprintln(tw, "KEY\tPLACE\tWAITING\tTASK\tAGE\tREASON")
	for _, k := range blocked {
		key := shortkey.Show(k.Key)
		if k.Digested {
			key += "…"
		}
		task := "-"
		if k.Holder.TaskID != "" {
			task = printable(k.Holder.TaskID)
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%s\t%s\t%s\n", key, k.Next, k.Waiting(), task, human(k.Holder.Age), k.reason)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	n := countStuck(blocked)
	if n == 0 {
		return nil
	}
	fmt.Fprintf(p.w, "\n%d %s will not move on by %s: start an asynq server that reads the queue (or, for a key that\n"+
		"halted, run its failed task again), or move the key past the place (its task then runs outside the order,\n"+
		"should it ever run):\n", n, plural(n, "key", "keys"), plural(n, "itself", "themselves"))
	for _, k := range blocked {
		switch {
		case !k.stuck:
		case k.Digested:
			fmt.Fprintf(p.w, "  asynqmutex order --skip %d KEY    (%s…: a longer key, of which Redis keeps the first 64 bytes)\n", k.Next, printable(k.Key))
		default:
			fmt.Fprintf(p.w, "  asynqmutex order --skip %d %s\n", k.Next, taskArgs(k.Key))
		}
	}
	return nil
}
