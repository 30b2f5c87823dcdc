package order

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex/internal/rediskey"
	"github.com/asynqmutex/asynqmutex/internal/shortkey"
	"github.com/asynqmutex/asynqmutex/internal/store"
)

// Sequencer gives tasks their places in their keys' sequences and says whose turn
// it is, on one Redis deployment. Create it with New; it is safe for concurrent use,
// and one per process is enough. Sequencers with the same prefix on the same Redis
// share every key's sequence: producers and workers must use the same Redis and
// prefix.
type Sequencer struct {
	run    *store.Runner // every Redis call of the Sequencer goes through it
	prefix string
	listen *listener // the Awaits' shared subscription
	start  Starter   // StartWith's; nil: parked tasks come back by themselves
}

// Option configures a Sequencer in New.
type Option interface{ apply(*Sequencer) }

type optionFunc func(*Sequencer)

func (f optionFunc) apply(s *Sequencer) { f(s) }

// Prefix sets the prefix of the Redis keys and channels the Sequencer uses. The
// default is DefaultPrefix ("asynqmutex:"). Prefix panics if p contains '{' or '}',
// which would move a key out of its Redis Cluster hash slot.
func Prefix(p string) Option {
	rediskey.CheckPrefix("order.Prefix", p)
	return optionFunc(func(s *Sequencer) { s.prefix = p })
}

// Parked is a task that parked (Sequencer.Park) and whose turn has come, or is next
// (Ahead): what a Finish (or StartAhead) hands the Starter. A plain value, safe to
// share; the task may be gone meanwhile, which the Starter finds out.
type Parked struct {
	Key    string
	Place  Place
	Ticket string // as given to Park
	// Started is set when the task was started before, ahead of its turn: it may be
	// on its way, or waiting for its turn in a process.
	Started bool
	// Ahead is set when the place's turn has not come: the Finish that made the place
	// before it the key's next starts the task ahead, so that it waits for its turn in
	// a process (Turn.Ahead tells it) rather than in asynq's queue.
	Ahead bool
}

// A Starter starts a parked task whose turn has come (see StartWith). ctx ends after
// startTimeout. It must be safe for concurrent use.
type Starter func(ctx context.Context, p Parked)

// startTimeout bounds a Starter's call.
const startTimeout = 10 * time.Second

// StartWith has the Sequencer call s, in a goroutine of its own, for each parked task
// whose place a Finish of the Sequencer (or a Later's) made the key's next: the
// Finish drops the place's park mark and names its ticket in its reply. The same
// Finish names the parked task of the place after it, to be started ahead of its
// turn (Parked.Ahead). Without it,
// or when the Starter fails, the task comes back by itself (its caller's fallback).
// The default is none. StartWith panics if s is nil.
func StartWith(s Starter) Option {
	if s == nil {
		panic("order.StartWith: nil Starter")
	}
	return optionFunc(func(q *Sequencer) { q.start = s })
}

// New returns a Sequencer that keeps its sequences in client, a single-node, Sentinel
// failover or Cluster client. Its scripts are loaded on first use, so New does no
// I/O. New panics if client is nil.
func New(client redis.UniversalClient, opts ...Option) *Sequencer {
	if client == nil {
		panic("order.New: nil redis client")
	}
	run := store.New(client)
	s := &Sequencer{run: run, prefix: DefaultPrefix, listen: newListener(run)}
	for _, o := range opts {
		o.apply(s)
	}
	return s
}

// Place is a task's place in its key's sequence: the N-th place taken in the
// sequence that began at Epoch. The zero Place is no place.
type Place struct {
	Epoch string // the sequence's epoch, as Take returned it
	N     int64  // 1 for the sequence's first task
}

// String is the place as FormatPlace writes it.
func (p Place) String() string { return FormatPlace(p) }

// FormatPlace writes p as a task header carries it: "<epoch>:<n>".
func FormatPlace(p Place) string { return p.Epoch + ":" + strconv.FormatInt(p.N, 10) }

// ParsePlace reads what FormatPlace wrote; ok is false for anything else.
func ParsePlace(s string) (p Place, ok bool) {
	epoch, n, found := strings.Cut(s, ":")
	if !found || epoch == "" {
		return Place{}, false
	}
	v, err := strconv.ParseInt(n, 10, 64)
	if err != nil || v < 1 {
		return Place{}, false
	}
	return Place{Epoch: epoch, N: v}, true
}

// Take gives the task with ID id, to be enqueued on queue, the next place in key's
// sequence, and records the task as the place's holder, in one script call. The
// place is the task's until Finish: every later place of the key waits for it. A
// producer that cannot enqueue the task should give the place up with Finish(...,
// Abandoned). A Take go-redis sends again after a lost reply, or a second Take for
// an ID that holds a place not finished, returns that place. Take returns an error if
// id or queue is empty, queue holds a space, or Redis could not be reached; a reply
// lost for good may leave a place taken with no task, which the key moves past by
// the rules of the caller (see docs/order.md). Safe for concurrent use.
func (s *Sequencer) Take(ctx context.Context, key, queue, id string) (Place, error) {
	switch {
	case id == "":
		return Place{}, fmt.Errorf("order: key %s: empty task ID", show(key))
	case queue == "" || strings.Contains(queue, " "):
		return Place{}, fmt.Errorf("order: key %s: queue %s: empty, or holds a space", show(key), shortkey.Quote(queue))
	}
	res, err := s.run.Run(ctx, takeScript, []string{redisKey(s.prefix, key)}, queue, id).Slice()
	if err != nil {
		return Place{}, fmt.Errorf("order: key %s: take: %w", show(key), err)
	}
	if len(res) != 2 {
		return Place{}, fmt.Errorf("order: key %s: take: unexpected reply %v", show(key), res)
	}
	epoch, _ := res[0].(string)
	n, _ := res[1].(int64)
	if epoch == "" || n < 1 {
		return Place{}, fmt.Errorf("order: key %s: take: unexpected reply %v", show(key), res)
	}
	return Place{Epoch: epoch, N: n}, nil
}

// TurnState says where a place stands in its key's sequence.
type TurnState uint8

const (
	// TurnNow: every earlier place is finished; the place's task may run.
	TurnNow TurnState = iota + 1
	// TurnWait: an earlier place is not finished; Turn.Next is the first such.
	TurnWait
	// TurnPassed: the key moved past the place (it was finished, or skipped past).
	TurnPassed
	// TurnUnknown: the key has no sequence of the place's epoch: it was forgotten
	// (idle for IdleKeep) or the place is of another key.
	TurnUnknown
)

var turnNames = [...]string{TurnNow: "now", TurnWait: "wait", TurnPassed: "passed", TurnUnknown: "unknown"}

// String returns "now", "wait", "passed" or "unknown".
func (t TurnState) String() string {
	if int(t) < len(turnNames) && turnNames[t] != "" {
		return turnNames[t]
	}
	return "turn(" + strconv.Itoa(int(t)) + ")"
}

// Turn is the answer to Enter and Await.
type Turn struct {
	State TurnState
	// Next is the key's next place: the place whose turn it is (0 for TurnUnknown).
	Next int64
	// With TurnWait, Holder is the task that holds the next place, as its producer
	// recorded it; its Age is measured on the Redis server's clock.
	Holder Holder
	// Ahead is set, with TurnWait, when the place's task parked and was started ahead
	// of its turn (see StartWith): it is meant to wait for its turn in its process.
	// With TurnNow, it is set when the task of the place after it parked and was not
	// started ahead: StartAhead starts it.
	Ahead bool
}

// Holder is the task that took a place.
type Holder struct {
	TaskID, Queue string
	// Age is how long ago the place was taken.
	Age time.Duration
	// Abandoned is true when the producer gave the place up (its task was never
	// enqueued): the key moves past it when its turn comes.
	Abandoned bool
	// Requeued is true, in a Turn that Await returns, when the task announced
	// (Requeue) while Await waited that it stopped and will run again later: it is
	// not running, though asynq may still say so for a moment.
	Requeued bool
	// Halted is true when the key halted at the place (Finish with Halted): its
	// task failed for good, and the key waits there until it is run again and
	// completes, or a person moves the key past it (Forced).
	Halted bool
}

// Enter says whether place p of key may run: its Turn, in one read-only script call.
// On error, the Turn is zero. Safe for concurrent use.
func (s *Sequencer) Enter(ctx context.Context, key string, p Place) (Turn, error) {
	return turnOf(key, p, s.run.Run(ctx, enterScript, []string{redisKey(s.prefix, key)}, p.Epoch, p.N))
}

// turnOf reads the reply of enterScript or parkScript about place p of key.
func turnOf(key string, p Place, cmd *redis.Cmd) (Turn, error) {
	res, err := cmd.Slice()
	if err != nil {
		return Turn{}, fmt.Errorf("order: key %s: place %v: %w", show(key), p.N, err)
	}
	if len(res) != 6 {
		return Turn{}, fmt.Errorf("order: key %s: place %v: unexpected reply %v", show(key), p.N, res)
	}
	state, _ := res[0].(string)
	next, _ := res[1].(int64)
	rec, _ := res[2].(string)
	t := Turn{Next: next}
	switch state {
	case "wait":
		t.State = TurnWait
		t.Holder = holder(rec, number(res[3]))
		t.Holder.Halted = number(res[5]) == 1
		t.Ahead = number(res[4]) == 1
	case "turn":
		t.State = TurnNow
		t.Ahead = number(res[4]) == 1
	case "passed":
		t.State = TurnPassed
	default:
		t.State = TurnUnknown
	}
	return t, nil
}

func holder(rec string, now int64) Holder {
	r, ok := parseRecord(rec)
	if !ok {
		return Holder{}
	}
	return Holder{TaskID: r.id, Queue: r.queue, Age: time.Duration(max(now-r.taken, 0)) * time.Microsecond, Abandoned: r.abandoned}
}

// Park is Enter, and also, when an earlier place is not finished (TurnWait), marks
// place p parked for ticket, in one script call: the task waits in no process, and
// the Finish that makes p the key's next drops the mark and has the Sequencer's
// Starter (StartWith) start the task. Call it when the task leaves to wait
// elsewhere; any other Turn marks nothing, and its task should go on as Enter's
// would. A place marked again keeps one mark, with the new ticket. ticket must be
// non-empty and must not begin with "^"; Park returns an error otherwise, or when
// Redis could not be reached. Safe for concurrent use.
func (s *Sequencer) Park(ctx context.Context, key string, p Place, ticket string) (Turn, error) {
	if ticket == "" || strings.HasPrefix(ticket, startedMark) {
		return Turn{}, fmt.Errorf("order: key %s: place %v: park: ticket %s is empty or begins with %q", show(key), p.N, shortkey.Quote(ticket), startedMark)
	}
	return turnOf(key, p, s.run.Run(ctx, parkScript, []string{redisKey(s.prefix, key)}, p.Epoch, p.N, ticket))
}

// StartAhead has the Sequencer's Starter (StartWith) start the parked task of the
// place after p, ahead of its turn, when p's turn has come (Enter said so, with
// Turn.Ahead set), as a Finish does for the place after the one it makes the key's
// next: so that the task waits for its turn in a process, and starts the moment p
// finishes, rather than be started then and wait for asynq's dispatch. It marks the
// place's mark started, in one script call, and does nothing when p is not the key's
// next or the place after it has no mark, or one started already. Safe for
// concurrent use.
func (s *Sequencer) StartAhead(ctx context.Context, key string, p Place) error {
	mark, err := s.run.Run(ctx, aheadScript, []string{redisKey(s.prefix, key)}, p.Epoch, p.N).Text()
	if err != nil {
		return fmt.Errorf("order: key %s: start ahead of place %v: %w", show(key), p.N, err)
	}
	if mark != "" && s.start != nil {
		go s.starting([]Parked{{Key: key, Place: Place{Epoch: p.Epoch, N: p.N + 1}, Ticket: mark, Ahead: true}})
	}
	return nil
}

// How says how a place was finished, for Finish.
type How uint8

const (
	// Done: the place's task finished: it completed, or will never run again.
	Done How = iota + 1
	// Skipped: the key moves past the place without its task (a gap rule, or a
	// person's decision).
	Skipped
	// Abandoned: the producer could not enqueue the place's task. If an earlier
	// place is not finished, the place is marked, and the key moves past it when its
	// turn comes.
	Abandoned
	// Halted: the place's task failed for good, and its key halts there rather than
	// move on (River's sequences do so): nothing is finished, the key is marked
	// halted at the place (State.Halted, Holder.Halted), and its waiters are told as
	// by Requeue. Skipped does not move the key past a halted place; Done (its task,
	// run again, completed) and Forced do.
	Halted
	// Forced: a person moves the key past the place, halted or not (the asynqmutex
	// command's order --skip). It counts as skipped.
	Forced
)

var howArgs = [...]string{Done: "done", Skipped: "skip", Abandoned: "abandon", Halted: "halt", Forced: "force"}

// Finish marks place p of key finished, if it is the key's next, and wakes the key's
// waiters (Await), in one script call. It reports the key's next place after it, or
// 0 when p was not the key's next (another call finished it, or, for Abandoned, an
// earlier place is not finished), the key has no sequence of p's epoch, or the key
// halted at p and how is Skipped: then nothing changed, but for Abandoned's mark. For
// Halted it reports p when the call halted the key, and 0 when it was halted there
// already or p is not its next. Places after p that were abandoned are finished
// with it. Finish returns an error if how is not one of the Hows, or Redis could not
// be reached; a call go-redis sends again finds the place
// finished and returns 0. When the new next place's task parked (Park), the
// Sequencer's Starter is called for it (StartWith). Safe for concurrent use.
func (s *Sequencer) Finish(ctx context.Context, key string, p Place, how How) (int64, error) {
	if err := checkHow(key, p, how); err != nil {
		return 0, err
	}
	return s.finished(key, p, s.run.Run(ctx, finishScript, []string{redisKey(s.prefix, key)}, p.Epoch, p.N, howArgs[how]))
}

func checkHow(key string, p Place, how How) error {
	if how < Done || how > Forced {
		return fmt.Errorf("order: key %s: place %v: invalid How %d", show(key), p.N, how)
	}
	return nil
}

// finished reads the reply of finishScript about place p of key, and has the
// Starter start the task of the new next place when the reply names its ticket.
func (s *Sequencer) finished(key string, p Place, cmd *redis.Cmd) (int64, error) {
	res, err := cmd.Slice()
	if err != nil {
		return 0, fmt.Errorf("order: key %s: finish place %v: %w", show(key), p.N, err)
	}
	if len(res) != 4 {
		return 0, fmt.Errorf("order: key %s: finish place %v: unexpected reply %v", show(key), p.N, res)
	}
	next, at := number(res[0]), number(res[3])
	var parked []Parked
	for i, ahead := range []bool{false, true} {
		if mark, _ := res[1+i].(string); mark != "" {
			ticket, started := strings.CutPrefix(mark, startedMark)
			parked = append(parked, Parked{Key: key, Place: Place{Epoch: p.Epoch, N: at + int64(i)}, Ticket: ticket, Started: started, Ahead: ahead})
		}
	}
	if len(parked) > 0 && s.start != nil {
		go s.starting(parked)
	}
	return next, nil
}

// starting calls the Starter for each of parked, in turn, bounded by startTimeout.
func (s *Sequencer) starting(parked []Parked) {
	ctx, cancel := context.WithTimeout(context.Background(), startTimeout)
	defer cancel()
	for _, pk := range parked {
		s.start(ctx, pk)
	}
}

// Requeue announces that the task of place p of key stopped and will run again
// later (asynq retries it, or puts it back at a shutdown), if p is the key's next
// place, so that the Awaits waiting for it return (Holder.Requeued) and their callers
// judge it again. It changes nothing in Redis, and reports whether it announced.
// One script call; safe for concurrent use.
func (s *Sequencer) Requeue(ctx context.Context, key string, p Place) (bool, error) {
	n, err := s.run.Run(ctx, requeueScript, []string{redisKey(s.prefix, key)}, p.Epoch, p.N).Int64()
	if err != nil {
		return false, fmt.Errorf("order: key %s: requeue place %v: %w", show(key), p.N, err)
	}
	return n == 1, nil
}

// Later is a Finish that travels in the round trip of another call: an ordered
// task's place finished in the pipeline of its lock's release, so that order costs
// the release no round trip of its own. Create it with FinishLater.
type Later struct {
	s   *Sequencer
	key string
	p   Place
	rd  *store.Rider
}

// FinishLater returns a Later for place p of key, and a context derived from ctx
// that carries it. Once Later.Finish has named how, the next script call made with
// that context (or one derived from it) by a mutex.Client, ratelimit.Limiter or
// Sequencer on the same redis client as s sends the Finish first, in one pipeline
// with its own call: give the context to mutex.Client.WithLock, and call
// Later.Finish in fn, as its last step, to have the place finished in the round trip
// of the lock's release. The two are not atomic together. Later.Result reports the
// Finish's outcome, and sends it alone when no call carried it (clients that
// differ, say). Safe for concurrent use.
func (s *Sequencer) FinishLater(ctx context.Context, key string, p Place) (context.Context, *Later) {
	l := &Later{s: s, key: key, p: p, rd: s.run.NewRider([]string{redisKey(s.prefix, key)})}
	return store.Carry(ctx, l.rd), l
}

// Finish readies the Finish of l's place with how (see Sequencer.Finish); the next
// call that may carry it does. Only the first Finish or Requeue counts. It returns
// an error, and readies nothing, if how is not Done, Skipped or Abandoned.
func (l *Later) Finish(how How) error {
	if err := checkHow(l.key, l.p, how); err != nil {
		return err
	}
	l.rd.Board(finishScript, l.p.Epoch, l.p.N, howArgs[how])
	return nil
}

// Requeue readies a Sequencer.Requeue of l's place instead of a Finish: its task
// will run again later. Only the first Finish or Requeue counts.
func (l *Later) Requeue() {
	l.rd.Board(requeueScript, l.p.Epoch, l.p.N)
}

// Result returns what Sequencer.Finish would: from the call that carried the Finish,
// or, when none did, from sending it now with ctx. It returns 0 and nil when Finish
// was not called: the place is not finished; for a Requeue, 0 and its error.
func (l *Later) Result(ctx context.Context) (int64, error) {
	cmd := l.rd.Result(ctx)
	switch {
	case cmd == nil:
		return 0, nil
	case l.rd.Boarded(requeueScript):
		if err := cmd.Err(); err != nil {
			return 0, fmt.Errorf("order: key %s: requeue place %v: %w", show(l.key), l.p.N, err)
		}
		return 0, nil
	}
	return l.s.finished(l.key, l.p, cmd)
}

func number(v any) int64 {
	switch n := v.(type) {
	case int64:
		return n
	case string:
		x, _ := strconv.ParseInt(n, 10, 64)
		return x
	}
	return 0
}

// show is key for errors: quoted, shortened past 100 bytes.
func show(key string) string { return shortkey.Show(key) }
