// Package conflicts counts, in Redis, the conflicts of each task that the middleware
// sends back for a busy key, so that every worker sharing the Redis counts a task
// alike: the count behind RetryLater's doubling delay and the reschedule caps.
//
// A task's record is a hash under prefix + "reschedule:" + queue + ":" + task ID
// (see Counter.Key), with the fields n, first and last (count.lua says what each
// holds). It is written only by count.lua and deleted by Clear.
package conflicts

import (
	"context"
	_ "embed"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"time"

	"github.com/asynqmutex/asynqmutex/internal/store"
)

// script counts a task's conflicts; see count.lua. It is a Redis function library of
// its own (see store.Runner.Run), as package mutex's scripts are theirs; its names
// are those the conflict count has always had, so that servers of two releases share
// one library.
var (
	//go:embed count.lua
	countLua string
	// Script is the counting script, for tests that watch how it is sent.
	Script = store.NewScript("reschedule", countLua)
	_      = store.NewLibrary("asynqmutex_reschedule", Script)
)

// The modes of Script (ARGV[2]).
const (
	modeCount = "count" // count this conflict
	modePeek  = "peek"  // read the record
)

// Infix follows the prefix in the key of a task's record.
const Infix = "reschedule:"

// queueEscaper makes the queue name end at the first ':' of a record's key, so that
// no two queue and task ID pairs share a key.
var queueEscaper = strings.NewReplacer("%", "%25", ":", "%3A")

// Record is what Redis counted of a task's conflicts.
type Record struct {
	N       int           // conflicts, the one just counted included; 0: none
	Elapsed time.Duration // since the first, on the Redis server's clock
}

// Counter counts conflicts of tasks on one Redis under one key prefix. It is safe for
// concurrent use.
type Counter struct {
	run    *store.Runner
	prefix string
}

// New returns a Counter that keeps its records on run's Redis under prefix.
func New(run *store.Runner, prefix string) *Counter {
	return &Counter{run: run, prefix: prefix}
}

// Key is the Redis key of the record of task id in queue: the prefix, "reschedule:",
// the queue with '%' and ':' escaped, ':' and the task ID.
func (c *Counter) Key(queue, id string) string {
	return c.prefix + Infix + queueEscaper.Replace(queue) + ":" + id
}

// Count counts a conflict of task id in queue, and returns the record with it; the
// record expires expiry after this conflict. A count go-redis sends again after a
// lost reply counts once.
func (c *Counter) Count(ctx context.Context, queue, id string, expiry time.Duration) (Record, error) {
	return c.call(ctx, queue, id, expiry, modeCount)
}

// Peek returns the record of task id in queue, changing nothing; the zero Record
// when there is none.
func (c *Counter) Peek(ctx context.Context, queue, id string) (Record, error) {
	return c.call(ctx, queue, id, 0, modePeek)
}

// Clear deletes the record of task id in queue.
func (c *Counter) Clear(ctx context.Context, queue, id string) error {
	return c.run.Del(ctx, c.Key(queue, id))
}

func (c *Counter) call(ctx context.Context, queue, id string, expiry time.Duration, mode string) (Record, error) {
	// A conflict's own id, so that a count go-redis sends again after a lost reply
	// is not counted twice.
	once := strconv.FormatUint(rand.Uint64(), 36)
	res, err := c.run.Run(ctx, Script, []string{c.Key(queue, id)}, expiry.Milliseconds(), mode, once).Int64Slice()
	if err != nil {
		return Record{}, err
	}
	if len(res) != 2 {
		return Record{}, fmt.Errorf("reschedule script returned %d values, want 2", len(res))
	}
	return Record{N: int(res[0]), Elapsed: time.Duration(res[1]) * time.Millisecond}, nil
}
