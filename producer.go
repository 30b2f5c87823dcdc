package asynqmutex

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynqmutex/asynqmutex/internal/shortkey"
	"github.com/asynqmutex/asynqmutex/mutex"
	"github.com/asynqmutex/asynqmutex/order"
)

// Producer enqueues tasks in their key's order, for a middleware with InOrder: give
// NewProducer the options the middleware gets, so that both derive the same key from
// a task. Most callers want Enqueue. A Producer is safe for concurrent use.
type Producer struct {
	client *asynq.Client
	seq    *order.Sequencer
	config
}

// NewProducer returns a Producer that enqueues with client, deriving keys as
// Middleware(locks, opts...) does (On, KeyBy, Scope, For) and taking places in the
// sequences beside locks' keys, where the middleware's InOrder looks for them: give
// it a mutex.Client on the workers' lock Redis with their prefix. Options that only a
// worker uses (TTL, MaxWait, OnConflict, Rate and the others) are accepted and
// ignored, so that one option list can serve both sides. NewProducer panics if locks
// or client is nil, if opts lack InOrder, or if they conflict as Middleware's would.
func NewProducer(locks *mutex.Client, client *asynq.Client, opts ...Option) *Producer {
	switch {
	case locks == nil:
		panic("asynqmutex.NewProducer: nil *mutex.Client")
	case client == nil:
		panic("asynqmutex.NewProducer: nil *asynq.Client")
	}
	p := &Producer{client: client, config: config{limit: 1, orderGrace: DefaultOrderGrace}}
	for _, o := range opts {
		o.apply(&p.config)
	}
	if !p.ordered {
		panic("asynqmutex.NewProducer: no InOrder among the options; the Producer takes places in its keys' order")
	}
	p.keyFuncs()
	p.checkRate()
	p.checkOrder(false)
	p.seq = sequencer(locks)
	return p
}

// Key returns the key the middleware derives for task t, as Enqueue does: an error
// (naming the task type and field) where the middleware would archive the task for
// its input. Safe for concurrent use.
func (p *Producer) Key(ctx context.Context, t *asynq.Task) (string, error) {
	key, err := p.key(ctx, t)
	if err == nil && key == "" {
		err = &keyError{taskType: t.Type(), msg: "KeyBy returned an empty key"}
	}
	return key, err
}

// Enqueue enqueues task t with asynq's options opts, as asynq.Client.EnqueueContext
// does, after giving it the next place in its key's order: one script call on the
// Sequencer's Redis, atomic with respect to every other producer, then the enqueue.
// The place travels in the task's PlaceHeader; the task ID is opts' asynq.TaskID, or
// a random one, recorded with the place so that workers can ask asynq about the
// task. A task of a type For leaves out is enqueued as it is.
//
// Options given to asynq.NewTask are not carried (asynq does not show them): give
// them to Enqueue. Tasks of one key must go to one queue, and ProcessIn, ProcessAt
// and a queue of lower priority delay every later task of the key along with the task
// (docs/order.md).
//
// Enqueue returns an error, and enqueues nothing, if the key cannot be derived or
// the place cannot be taken. If the enqueue fails, it gives the place up
// (order.Abandoned), so the key does not wait for it, and returns asynq's error;
// but for asynq.ErrTaskIDConflict: a task with that ID holds a place already, and
// Take gave Enqueue that place, which stays the task's. A producer that dies between
// the two steps leaves a place its key moves past after OrderGrace. Safe for
// concurrent use.
func (p *Producer) Enqueue(ctx context.Context, t *asynq.Task, opts ...asynq.Option) (*asynq.TaskInfo, error) {
	if p.types != nil && !p.types[t.Type()] {
		return p.client.EnqueueContext(ctx, t, opts...)
	}
	key, err := p.Key(ctx, t)
	if err != nil {
		var ke *keyError
		if !errors.As(err, &ke) {
			err = fmt.Errorf("asynqmutex: task %s: key: %w", shortkey.Quote(t.Type()), err)
		}
		return nil, err
	}
	queue, id := "default", ""
	for _, o := range opts {
		switch o.Type() {
		case asynq.QueueOpt:
			queue, _ = o.Value().(string)
		case asynq.TaskIDOpt:
			id, _ = o.Value().(string)
		}
	}
	if id == "" {
		id = newTaskID()
		opts = append(opts[:len(opts):len(opts)], asynq.TaskID(id))
	}
	place, err := p.seq.Take(ctx, key, queue, id)
	if err != nil {
		return nil, fmt.Errorf("asynqmutex: task %s: %w", shortkey.Quote(t.Type()), err)
	}
	headers := maps.Clone(t.Headers())
	if headers == nil {
		headers = make(map[string]string, 1)
	}
	headers[PlaceHeader] = order.FormatPlace(place)
	info, err := p.client.EnqueueContext(ctx, asynq.NewTaskWithHeaders(t.Type(), t.Payload(), headers), opts...)
	switch {
	case errors.Is(err, asynq.ErrTaskIDConflict):
		// A task with this ID is in asynq already, and holds the place Take returned
		// for its ID: the place stays its.
		return nil, err
	case err != nil:
		// The key moves past the place at once when it is the next, and reports it;
		// otherwise it is marked, and reported when the key reaches it.
		if next, ferr := p.seq.Finish(context.WithoutCancel(ctx), key, place, order.Abandoned); ferr == nil && next > 0 {
			p.emit(ctx, Event{Op: OpOrderSkipped, TaskType: t.Type(), TaskID: id, Key: key,
				Err: &GapError{Key: key, Place: place.N, TaskID: id, Queue: queue, Reason: "abandoned"}})
			p.abandonedPast(ctx, t.Type(), key, place.N, next)
		}
		return nil, err
	}
	return info, nil
}

// newTaskID is a task ID that sorts in the order of the clock: the microseconds
// since 1970 in 16 hex digits, a dash, and 64 random bits in hex. asynq moves tasks
// due in the same second to their queue in the order of their IDs, so tasks of a
// key sent back together return in the order they were enqueued.
func newTaskID() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return fmt.Sprintf("%016x-%s", time.Now().UnixMicro(), hex.EncodeToString(b[:]))
}
