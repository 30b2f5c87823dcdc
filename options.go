package asynqmutex

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynqmutex/asynqmutex/internal/shortkey"
	"github.com/asynqmutex/asynqmutex/mutex"
	"github.com/asynqmutex/asynqmutex/ratelimit"
)

// DefaultTTL is the lease of a task's lock unless TTL says otherwise. It matches
// asynq's own lease on an active task, so a worker that dies frees its key about when
// asynq hands its task to another worker.
const DefaultTTL = 30 * time.Second

// Option configures Middleware. Options follow asynq's style: On("id"), TTL(d). Each
// is given at most once: Middleware (and NewProducer) panics on an option given
// twice, naming both calls, rather than keep either silently; Observe alone may be
// given several times, and calls every function it was given.
type Option interface{ apply(*config) }

type optionFunc func(*config)

func (f optionFunc) apply(c *config) { f(c) }

// once is the option name, called as call, that sets what set sets: given twice to
// one Middleware (or NewProducer), it panics naming both calls, since keeping either
// would silently drop what the caller asked for. Options that share a setting
// (On, OnEach, KeyBy and KeysBy; Rate and RateBy) refuse each other likewise.
func once(name, call string, set func(*config)) Option {
	return optionFunc(func(c *config) {
		if prev, ok := c.given[name]; ok {
			panic("asynqmutex.Middleware: " + prev + " and " + call + " both given; give " + name + " once")
		}
		if c.given == nil {
			c.given = make(map[string]string)
		}
		c.given[name] = call
		set(c)
	})
}

type config struct {
	given map[string]string // the options given, by name, as called (see once)

	key       KeyFunc  // one key per task
	keys      KeysFunc // several keys per task (OnEach, KeysBy); then key is nil
	keySetBy  string   // the option that set key or keys: On, OnEach, KeyBy, KeysBy
	keyCall   string   // that option as called, On("id"), to name it when refusing a second
	fields    []string // On's or OnEach's fields: key or keys are made from them in Middleware
	scope     string   // Scope: the name in keys instead of the task type
	ttl       time.Duration
	maxWait   time.Duration
	policy    Policy
	inspector *asynq.Inspector // Inspector: nil for one on the lock Redis
	hook      func(context.Context, *asynq.Task, error)
	logger    *slog.Logger // nil: slog.Default() at the time of logging

	maxReschedules    int           // 0: no cap
	maxRescheduleTime time.Duration // 0: no cap

	meta func(context.Context) taskMeta // what asynq says of the task; a seam for tests

	observe func(context.Context, Event) // nil: no observer (see Observe)

	limit int // tasks per key at once

	types   map[string]bool // For's task types; nil: every task
	forCall string          // For as called, to name it when refusing a second

	rateBy   string         // the option that set a rate limit: Rate, RateBy; "" for none
	rate     ratelimit.Rate // Rate's limit, with Burst's burst
	rateFunc func(context.Context, *asynq.Task) (ratelimit.Rate, error)
	burst    int  // Burst; 0 when not given
	noLock   bool // NoLock: no lock, only the rate gate

	ordered    bool          // InOrder was given
	tasks      TaskLookup    // InOrder's: asks asynq about a task a key waits for
	orderGrace time.Duration // OrderGrace, or DefaultOrderGrace
	halt       bool          // HaltOnFailure: a failed ordered task halts its key
	graceSet   bool          // OrderGrace was given

	backlog  int      // MaxBacklog's n: 0 for no cap
	overflow Overflow // MaxBacklog's full
}

// For makes the middleware apply to tasks of these types only: a task of any other
// type goes straight to the next handler, untouched, at the cost of a map lookup and
// no Redis command. It is what makes mux.Use safe on a mux that serves other task
// types, whose payloads need not hold On's fields:
//
//	mux.Use(asynqmutex.Middleware(locks, asynqmutex.For("payment:capture"), asynqmutex.On("transaction_id")))
//
// The default is every task the middleware wraps. For panics if no type is given or
// a type is empty; Middleware panics if For is given twice, naming both: list every
// type in one For.
func For(taskTypes ...string) Option {
	if len(taskTypes) == 0 {
		panic("asynqmutex.For: no task type given")
	}
	types := make(map[string]bool, len(taskTypes))
	for _, typ := range taskTypes {
		if typ == "" {
			panic("asynqmutex.For: empty task type")
		}
		types[typ] = true
	}
	call := callText("For", taskTypes)
	return optionFunc(func(c *config) {
		if c.forCall != "" {
			panic("asynqmutex.Middleware: " + c.forCall + " and " + call + " both given; list every task type in one For")
		}
		c.types, c.forCall = types, call
	})
}

// callText is an option as it was called, For("a", "b"), for panics that name it.
func callText(name string, args []string) string {
	quoted := make([]string, len(args))
	for i, a := range args {
		quoted[i] = shortkey.Quote(a)
	}
	return name + "(" + strings.Join(quoted, ", ") + ")"
}

// TTL sets the lease of a task's lock. The middleware renews it every d/3 while the
// handler runs, so d bounds how long a key stays locked after its worker died, not how
// long a handler may run. The default is DefaultTTL (30 s). TTL panics if d lies
// outside [mutex.MinTTL, mutex.MaxTTL] (20ms to 7 days): a shorter lease cannot be
// renewed reliably, and every task would fail to lock.
func TTL(d time.Duration) Option {
	if d < mutex.MinTTL || d > mutex.MaxTTL {
		panic(fmt.Sprintf("asynqmutex.TTL: lease %v outside [%v, %v] (mutex.MinTTL, mutex.MaxTTL)", d, mutex.MinTTL, mutex.MaxTTL))
	}
	return once("TTL", fmt.Sprintf("TTL(%v)", d), func(c *config) { c.ttl = d })
}

// MaxWait makes a task whose key is busy wait up to d for it, woken the moment the
// holder releases it, before the OnConflict policy applies. The default is 0: the
// policy applies at once. A waiting task occupies one of the server's worker slots,
// so MaxWait suits keys held briefly; RetryLater suits keys held long. The wait ends
// DeadlineMargin before the task's own deadline (asynq's Timeout or Deadline) if that
// comes first, so that the policy, not the deadline, decides what happens to the
// task. MaxWait panics if d is negative.
func MaxWait(d time.Duration) Option {
	if d < 0 {
		panic(fmt.Sprintf("asynqmutex.MaxWait: negative wait %v", d))
	}
	return once("MaxWait", fmt.Sprintf("MaxWait(%v)", d), func(c *config) { c.maxWait = d })
}

// OnConflict sets what happens when the key stays busy: Park, Skip, Fail or
// RetryLater(d). The default is Park. OnConflict panics on a Policy that none of those
// returned.
func OnConflict(p Policy) Option {
	if !p.valid() {
		panic(fmt.Sprintf("asynqmutex.OnConflict: invalid policy %d", p))
	}
	return once("OnConflict", fmt.Sprintf("OnConflict(%v)", p), func(c *config) { c.policy = p })
}

// Inspector is the asynq Inspector through which Park starts parked tasks: one of
// the Redis asynq's servers use. The default is one on the lock Client's Redis
// (asynq.NewInspectorFromRedisClient), right when tasks and locks share a Redis; give
// this when they do not. With the wrong one, parked tasks are not found, which is
// logged at Error once, and they come back only by their fallback. Inspector panics
// if i is nil.
func Inspector(i *asynq.Inspector) Option {
	if i == nil {
		panic("asynqmutex.Inspector: nil *asynq.Inspector")
	}
	return once("Inspector", "Inspector(...)", func(c *config) { c.inspector = i })
}

// Limit lets up to n tasks with the same key run at once, on every worker that
// shares the lock Redis, instead of one: with On("tenant_id") and Limit(5), at most
// five tasks of each tenant run at a time; with Limit alone, at most n tasks of the
// type run in the whole fleet. A task beyond the limit is handled as one whose key is
// busy: it waits up to MaxWait, woken when a running task of its key finishes, and
// then the OnConflict policy applies. Each running task has its own lease and fence
// (see mutex.Limit). With Scope, the tasks of several types share the n slots. The
// default is 1.
//
// Every middleware that takes a key must use the same n while tasks hold it: a task
// that meets another limit (a rolling deploy that changes n, say) fails with an
// ordinary, retryable error wrapping *mutex.LimitError, and AfterFailure is called.
// Limit panics if n is below 1 or above mutex.MaxLimit; Middleware panics if
// Limit(n > 1) is given with OnEach or KeysBy, whose tasks hold several keys.
func Limit(n int) Option {
	if n < 1 || n > mutex.MaxLimit {
		panic(fmt.Sprintf("asynqmutex.Limit: limit %d outside [1, %d] (mutex.MaxLimit)", n, mutex.MaxLimit))
	}
	return once("Limit", fmt.Sprintf("Limit(%d)", n), func(c *config) { c.limit = n })
}

// AfterFailure calls fn each time a task runs without its handler because the lock
// was not obtained: the key was busy (err is a *LockedError), Redis could not be
// reached, or no key could be derived from the task. It is not called for a lease lost
// while the handler ran: the handler did run, and Logger hears of that. It runs on the
// worker goroutine before the middleware returns, so it should be quick; it must be
// safe for concurrent use. By default nothing is called. AfterFailure panics if fn is
// nil.
func AfterFailure(fn func(ctx context.Context, t *asynq.Task, err error)) Option {
	if fn == nil {
		panic("asynqmutex.AfterFailure: nil function")
	}
	return once("AfterFailure", "AfterFailure(fn)", func(c *config) { c.hook = fn })
}

// Logger sets where the middleware logs what needs a person's attention: a lock lost
// while its handler ran, at level Warn, which means another worker may have run a
// task with the same key at the same time. A record names the task type and ID, the
// key (shortened past 100 bytes, with a digest), whether the task completed, and
// why the lock was lost; never a token or the payload. The default is slog.Default(),
// looked up when a record is logged. l must be safe for concurrent use, as every
// *slog.Logger is. Logger panics if l is nil.
func Logger(l *slog.Logger) Option {
	if l == nil {
		panic("asynqmutex.Logger: nil *slog.Logger")
	}
	return once("Logger", "Logger(l)", func(c *config) { c.logger = l })
}
