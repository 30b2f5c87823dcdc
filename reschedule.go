package asynqmutex

import (
	"context"
	_ "embed"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"strconv"
	"strings"
	"time"

	"github.com/asynqmutex/asynqmutex/internal/shortkey"
	"github.com/asynqmutex/asynqmutex/internal/store"
)

// MaxReschedules caps how many times RetryLater sends one task back for a busy key:
// the task's conflict after its n-th reschedule, and every one after that, fails as
// under Fail. It returns an ordinary error wrapping mutex.ErrNotObtained, so asynq
// spends one of the task's retries on it (with its usual backoff) and archives the
// task once they are used up; the error's text, asynq's LastErr, names the task, the
// key and the cap. A task that reached the cap and then used up its retries is
// archived at its next conflict, as under Fail, rather than wait LastTryWait.
//
// The count is kept in Redis, shared by every worker that uses the same lock Redis
// and prefix, and restarts when the task obtains its key (see RetryLater). Given
// with MaxRescheduleTime, whichever cap is reached first applies. The default is no
// cap: a task is sent back for as long as its key stays busy. A conflict Redis
// cannot count is not counted toward the cap (see RetryLater).
//
// MaxReschedules applies to RetryLater only; Middleware panics if it is given with
// Skip or Fail. MaxReschedules panics if n is less than 1: to never reschedule, use
// OnConflict(Fail).
func MaxReschedules(n int) Option {
	if n < 1 {
		panic(fmt.Sprintf("asynqmutex.MaxReschedules: %d is less than 1; leave it out for no cap, or use OnConflict(Fail) to never reschedule", n))
	}
	return optionFunc(func(c *config) { c.maxReschedules = n })
}

// MaxRescheduleTime caps how long RetryLater keeps sending one task back for a busy
// key: the task's first conflict d or more after its first one, and every one after
// that, fails as under Fail, as described for MaxReschedules. The time is measured
// on the Redis server's clock, from the first conflict that Redis counted, so
// workers whose clocks differ agree on it. As the cap is checked at a conflict, the
// task can stay busy up to one reschedule delay (at most 16·d of RetryLater(d))
// past it. The default is no cap; given with MaxReschedules, whichever cap is
// reached first applies.
//
// MaxRescheduleTime applies to RetryLater only; Middleware panics if it is given
// with Skip or Fail. MaxRescheduleTime panics if d is zero or negative.
func MaxRescheduleTime(d time.Duration) Option {
	if d <= 0 {
		panic(fmt.Sprintf("asynqmutex.MaxRescheduleTime: %v is not positive; leave it out for no cap", d))
	}
	return optionFunc(func(c *config) { c.maxRescheduleTime = d })
}

// rescheduleScript counts a task's conflicts; see reschedule.lua. It is a Redis
// function library of its own (see store.Runner.Run), as package mutex's scripts are
// theirs.
var (
	//go:embed reschedule.lua
	rescheduleLua    string
	rescheduleScript = store.NewScript("reschedule", rescheduleLua)
	_                = store.NewLibrary("asynqmutex_reschedule", rescheduleScript)
)

// The modes of rescheduleScript.
const (
	countConflict = "count" // count this conflict
	peekConflicts = "peek"  // read the record
)

// rescheduleInfix follows the mutex.Client's prefix in the key of a task's record.
const rescheduleInfix = "reschedule:"

// record is what Redis counted of a task's conflicts.
type record struct {
	n       int           // conflicts, the one just counted included; 0: none
	elapsed time.Duration // since the first, on the Redis server's clock
}

// queueEscaper makes the queue name end at the first ':' of a record's key, so
// that no two queue and task ID pairs share a key.
var queueEscaper = strings.NewReplacer("%", "%25", ":", "%3A")

// recordKey is the Redis key of the task's record: prefix + "reschedule:" +
// queue + ":" + task ID, with '%' and ':' in the queue escaped.
func (m *middleware) recordKey(meta taskMeta) string {
	return m.prefix + rescheduleInfix + queueEscaper.Replace(meta.queue) + ":" + meta.id
}

// recordExpiry is how long a record outlives the conflict that last counted in it:
// twice the longest delay RetryLater asks for (16·d, plus jitter of up to a quarter
// of it), plus an hour for the task to wait in its queue behind others.
func recordExpiry(d time.Duration) time.Duration {
	longest := backoff(d, 5)
	if longest > (math.MaxInt64-time.Hour)/2 {
		return math.MaxInt64
	}
	return 2*longest + time.Hour
}

// cappedExpiry is how long the record of a task under a cap outlives a conflict: at
// least recordExpiry, and past the cap, as the task's failures are then retried
// after asynq's own backoff, longer than asynq's DefaultRetryDelayFunc can wait
// before its next retry (n⁴ + 15 + 30·(n+1) seconds after the n-th failure), plus
// the same hour, so that the count does not restart while the task waits.
func cappedExpiry(d time.Duration, meta taskMeta) time.Duration {
	e := recordExpiry(d)
	if !meta.counted {
		return e
	}
	n := int64(meta.retried) + 1 // the failure this conflict may be
	if n > 1000 {
		n = 1000 // past any real MaxRetry: 1000⁴ s is 31,000 years
	}
	wait := time.Duration(n*n*n*n+15+30*(n+1))*time.Second + time.Hour
	return max(e, wait)
}

// record runs rescheduleScript for the task in mode.
func (m *middleware) record(ctx context.Context, meta taskMeta, mode string) (record, error) {
	expiry := recordExpiry(time.Duration(m.policy))
	if m.capped() {
		expiry = cappedExpiry(time.Duration(m.policy), meta)
	}
	// A conflict's own id, so that a count go-redis sends again after a lost reply
	// is not counted twice.
	id := strconv.FormatUint(rand.Uint64(), 36)
	res, err := m.store.Run(ctx, rescheduleScript, []string{m.recordKey(meta)}, expiry.Milliseconds(), mode, id).Int64Slice()
	if err != nil {
		return record{}, err
	}
	if len(res) != 2 {
		return record{}, fmt.Errorf("reschedule script returned %d values, want 2", len(res))
	}
	return record{n: int(res[0]), elapsed: time.Duration(res[1]) * time.Millisecond}, nil
}

// capped reports whether a reschedule cap is set.
func (c *config) capped() bool { return c.maxReschedules > 0 || c.maxRescheduleTime > 0 }

// capsReached names the caps that r has reached, "" if none.
func (c *config) capsReached(r record) string {
	var caps []string
	if c.maxReschedules > 0 && r.n > c.maxReschedules {
		caps = append(caps, fmt.Sprintf("MaxReschedules(%d)", c.maxReschedules))
	}
	if c.maxRescheduleTime > 0 && r.elapsed >= c.maxRescheduleTime {
		caps = append(caps, fmt.Sprintf("MaxRescheduleTime(%v)", c.maxRescheduleTime))
	}
	return strings.Join(caps, " and ")
}

// clearRecord deletes the task's record once it has obtained its key. A failure
// leaves the record to expire: a later conflict of the same task within that time
// would count on from it.
func (m *middleware) clearRecord(ctx context.Context, meta taskMeta) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
	defer cancel()
	_ = m.store.Del(ctx, m.recordKey(meta))
}

// countFailed logs that Redis could not count a conflict, which leaves the task
// outside any reschedule cap for this conflict; shown is the key or keys, shortened.
func (m *middleware) countFailed(ctx context.Context, t, id, shown string, err error) {
	m.log().LogAttrs(ctx, slog.LevelWarn, "asynqmutex: could not count a conflict in Redis; the task is sent back as after a first conflict, and this conflict does not count toward a reschedule cap",
		slog.String("task_type", shortkey.Shorten(t)),
		slog.String("task_id", shortkey.Shorten(id)),
		slog.String("key", shown),
		slog.String("error", err.Error()))
}
