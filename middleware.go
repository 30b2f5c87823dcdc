package asynqmutex

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynqmutex/asynqmutex/internal/keyset"
	"github.com/asynqmutex/asynqmutex/internal/shortkey"
	"github.com/asynqmutex/asynqmutex/internal/store"
	"github.com/asynqmutex/asynqmutex/mutex"
	"github.com/asynqmutex/asynqmutex/order"
	"github.com/asynqmutex/asynqmutex/ratelimit"
)

// DefaultTTL is the lease of a task's lock unless TTL says otherwise. It matches
// asynq's own lease on an active task, so a worker that dies frees its key about when
// asynq hands its task to another worker.
const DefaultTTL = 30 * time.Second

// DeadlineMargin is how long before a task's deadline (asynq's Timeout or Deadline
// option; 30 minutes by default) a wait for a busy key ends, however long MaxWait is.
// The policy's result must reach asynq before the deadline does: past it, asynq
// records "context deadline exceeded" as a failure, spends a retry, and archives the
// task once its retries are used up. A task with less than this left tries the key
// once.
const DeadlineMargin = 500 * time.Millisecond

// LastTryWait is how long at least a task with no retry left waits for a busy key
// under RetryLater: a task with MaxRetry(0), or whose retries real failures used up.
// asynq archives such a task for any error it returns, contention included, so it
// waits for the key instead, up to the longer of MaxWait and LastTryWait (which
// matches DefaultTTL, the longest a crashed holder keeps a key), ending
// DeadlineMargin before its deadline. If the key is still busy then, the task is
// archived with an error saying the key was busy and that it had no retry left,
// wrapping a *LockedError and asynq.SkipRetry; run it again from the archive
// (asynq.Inspector.RunTask) once the key is free.
const LastTryWait = 30 * time.Second

// Option configures Middleware. Options follow asynq's style: On("id"), TTL(d).
type Option interface{ apply(*config) }

type optionFunc func(*config)

func (f optionFunc) apply(c *config) { f(c) }

type config struct {
	key      KeyFunc  // one key per task
	keys     KeysFunc // several keys per task (OnEach, KeysBy); then key is nil
	keySetBy string   // the option that set key or keys: On, OnEach, KeyBy, KeysBy
	keyCall  string   // that option as called, On("id"), to name it when refusing a second
	fields   []string // On's or OnEach's fields: key or keys are made from them in Middleware
	scope    string   // Scope: the name in keys instead of the task type
	ttl      time.Duration
	maxWait  time.Duration
	policy   Policy
	hook     func(context.Context, *asynq.Task, error)
	logger   *slog.Logger // nil: slog.Default() at the time of logging

	maxReschedules    int           // 0: no cap
	maxRescheduleTime time.Duration // 0: no cap

	meta func(context.Context) taskMeta // what asynq says of the task; a seam for tests

	observe func(context.Context, Event) // nil: no observer (see Observe)

	limit int // tasks per key at once

	types   map[string]bool // For's task types; nil: every task
	forCall string          // For as called, to name it when refusing a second

	rateBy   string          // the option that set a rate limit: Rate, RateBy; "" for none
	rate     ratelimit.Limit // Rate's limit, with Burst's burst
	rateFunc func(context.Context, *asynq.Task) (ratelimit.Limit, error)
	burst    int  // Burst; 0 when not given
	noLock   bool // NoLock: no lock, only the rate gate

	seq        *order.Sequencer // InOrder's; nil without order
	tasks      TaskLookup       // InOrder's: asks asynq about a task a key waits for
	orderGrace time.Duration    // OrderGrace, or DefaultOrderGrace
	graceSet   bool             // OrderGrace was given
}

// On makes the lock key the task type plus the values of these JSON payload fields,
// so tasks of one type with the same values run one at a time ("customer.id" names
// the field id inside the object customer). A value must be a string, a number, a
// boolean or null; see KeyFunc for the key's exact form. Without On or KeyBy the key
// is the task type alone: at most one task of each type runs at a time. Scope
// shares keys between task types.
//
// A task whose payload is not a JSON object, lacks a field, or holds an object, an
// array or a string that is not UTF-8 there, is archived at once with an error
// naming the field (see Middleware). That holds for every task the middleware
// wraps: under mux.Use, without For, it wraps every task type on the mux, and a task
// type whose payload lacks the field is archived without running. Name the task
// types with For, or wrap their handlers alone.
//
// On panics if no field is given or a name is empty. Give every field to one On:
// Middleware panics on a second key option (On, OnEach, KeyBy, KeysBy), naming both,
// rather than keep one of them.
func On(fields ...string) Option {
	if len(fields) == 0 {
		panic("asynqmutex.On: no field given")
	}
	validateFields("asynqmutex.On", fields)
	fields = append([]string(nil), fields...)
	call := callText("On", fields)
	return optionFunc(func(c *config) { c.setKey("On", call, nil, nil); c.fields = fields })
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

// KeyBy makes fn derive the lock key, for keys On cannot express. An error from fn,
// or an empty key, archives the task as a malformed payload does. KeyBy panics if fn
// is nil; Middleware panics if another key option (On, OnEach, KeyBy, KeysBy) is
// given too.
func KeyBy(fn KeyFunc) Option {
	if fn == nil {
		panic("asynqmutex.KeyBy: nil KeyFunc")
	}
	return optionFunc(func(c *config) { c.setKey("KeyBy", "KeyBy(fn)", fn, nil) })
}

// setKey records the key option by (called as call). A second key option panics,
// naming both: keeping either would drop fields or keys the caller asked for.
func (c *config) setKey(by, call string, one KeyFunc, several KeysFunc) {
	if c.keySetBy != "" {
		hint := "give one"
		if c.keySetBy == by && (by == "On" || by == "OnEach") {
			hint = "give every field to one " + by
		}
		panic("asynqmutex.Middleware: two key options, " + c.keyCall + " and " + call + "; " + hint)
	}
	c.key, c.keys, c.keySetBy, c.keyCall, c.fields = one, several, by, call, nil
}

// keyFuncs sets key or keys once all options are in: from On's or OnEach's fields,
// or the task type (or Scope's name) alone when no option set them.
func (c *config) keyFuncs() {
	if c.scope != "" && (c.keySetBy == "KeyBy" || c.keySetBy == "KeysBy") {
		panic("asynqmutex.Middleware: Scope names the keys of On, OnEach and the task type; " + c.keySetBy + " makes its own keys")
	}
	if c.limit > 1 && (c.keySetBy == "OnEach" || c.keySetBy == "KeysBy") {
		panic("asynqmutex.Middleware: Limit caps the tasks of one key; " + c.keySetBy + " gives a task several keys")
	}
	switch {
	case c.keySetBy == "On":
		c.key = newFieldKeyer(c.fields, c.scope).key
	case c.keySetBy == "OnEach":
		c.keys = newFieldKeyer(c.fields, c.scope).keys
	case c.keySetBy == "" && c.scope != "":
		c.key = scopeKey(c.scope)
	case c.keySetBy == "":
		c.key = taskTypeKey
	}
}

// Scope makes the lock keys begin with name instead of the task type, so that tasks
// of several types share them: with Scope("account"), a deposit under On("account")
// and a transfer under OnEach("from", "to") both lock ["account","A"] for account A,
// and never run on it at once. Without On or OnEach, all tasks given Scope(name)
// share the one key [name]. Key(name, values...) is the key of such a task. The
// default is the task type. Scope panics if name is empty; Middleware panics if it
// is combined with KeyBy or KeysBy, whose keys are their own.
func Scope(name string) Option {
	if name == "" {
		panic("asynqmutex.Scope: empty name")
	}
	return optionFunc(func(c *config) { c.scope = name })
}

// KeysFunc derives several lock keys for a task, for OnEach and KeysBy: the task runs
// only while it holds all of them, so it never runs at the same time as a task with
// any of the same keys, whatever its other keys. The rules of KeyFunc apply to each
// key: deterministic, safe for concurrent use, an error or an empty key (or no key)
// archives the task. The keys share KeyFunc's key space, so a task with keys
// {"a","b"} excludes a task whose KeyFunc gives "a". The order of the keys does not
// matter, and a key given twice counts once.
type KeysFunc func(ctx context.Context, t *asynq.Task) ([]string, error)

// OnEach gives a task one lock key per field, and runs it only while it holds all of
// them (mutex.Client.WithLockKeys): OnEach("from", "to") makes a transfer from A to B
// wait for every task on A or on B, while transfers that share no account run at
// once. Each key is the one On(field) would derive: the task type (or Scope's name)
// and the field's value, so a value in "from" and the same value in "to" are one
// key. The fields are read as On reads them; a payload that lacks one, or holds an
// object or an array there, is archived at once with an error naming the field.
// Taking the keys never deadlocks against tasks taking overlapping sets in another
// order (see mutex.Client.LockKeys); the price is that a task waiting for a busy key
// (MaxWait) keeps the keys before it meanwhile, so tasks on those meet a busy key.
// On Redis Cluster each key costs a round trip.
// OnEach panics if no field is given or a name is empty. Give every field to one
// OnEach: Middleware panics on a second key option (On, OnEach, KeyBy, KeysBy),
// naming both. As with On, give For when the middleware wraps other task types.
func OnEach(fields ...string) Option {
	if len(fields) == 0 {
		panic("asynqmutex.OnEach: no field given")
	}
	validateFields("asynqmutex.OnEach", fields)
	fields = append([]string(nil), fields...)
	call := callText("OnEach", fields)
	return optionFunc(func(c *config) { c.setKey("OnEach", call, nil, nil); c.fields = fields })
}

// KeysBy makes fn derive several lock keys per task, held all at once, for sets
// OnEach cannot express (see KeysFunc). An error from fn, no key, or an empty key
// archives the task as a malformed payload does. KeysBy panics if fn is nil;
// Middleware panics if another key option (On, OnEach, KeyBy, KeysBy) is given too.
func KeysBy(fn KeysFunc) Option {
	if fn == nil {
		panic("asynqmutex.KeysBy: nil KeysFunc")
	}
	return optionFunc(func(c *config) { c.setKey("KeysBy", "KeysBy(fn)", nil, fn) })
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
	return optionFunc(func(c *config) { c.ttl = d })
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
	return optionFunc(func(c *config) { c.maxWait = d })
}

// OnConflict sets what happens when the key stays busy: Skip, Fail or RetryLater(d).
// The default is RetryLater(DefaultRetryDelay). OnConflict panics on a Policy that
// none of those returned.
func OnConflict(p Policy) Option {
	if !p.valid() {
		panic(fmt.Sprintf("asynqmutex.OnConflict: invalid policy %d", p))
	}
	return optionFunc(func(c *config) { c.policy = p })
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
	return optionFunc(func(c *config) { c.limit = n })
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
	return optionFunc(func(c *config) { c.hook = fn })
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
	return optionFunc(func(c *config) { c.logger = l })
}

// Middleware returns asynq middleware that runs each task's handler under a Redis lock
// on the task's key (see On, OnEach, KeyBy, KeysBy and Scope), so tasks with equal
// keys never run at the same time (or no more than n at a time, with Limit) on any
// worker that shares the lock Redis, while tasks with other keys run in parallel. Use
// it on the handlers it is for, Middleware(...)(handler), or with mux.Use(...) and
// For naming their task types. It applies to every task it wraps unless For says
// otherwise: under mux.Use without For that is every task type on the mux, and a
// type whose payload lacks On's fields is archived without running.
//
// Per task: derive the key; take the lock, waiting up to MaxWait; run the handler
// while the lease is renewed every TTL/3; release; return the handler's result
// untouched. When the lease is lost while the handler runs (Redis lost the key, or
// could not be reached for a whole lease), the handler's context is cancelled and the
// loss is logged (see Logger). The handler's own result still decides: if it returns
// nil the task completes, since its work is done and a second run could not undo an
// overlap; if it returns an error, the task fails with an error wrapping both that
// error and mutex.ErrNotHeld. The handler's fencing token is available through Fence.
//
// When the lock is not obtained the handler does not run: a busy key is handled by the
// OnConflict policy and reported to AfterFailure; a Redis error is returned as an
// ordinary, retryable error; a key that cannot be derived (payload not JSON, a missing
// field, an object where On wants a scalar, a KeyBy error or empty key) returns an
// error naming the task and the field, wrapping
// asynq.SkipRetry, so the task goes to the archive where it can be inspected and run
// again, rather than retrying in a loop. A task is never run without its lock. No
// error text the middleware adds grows with the key or the payload: a key or task
// type longer than 100 bytes is shown shortened, with a digest.
//
// Each lock records the task type and task ID as its holder (mutex.HeldBy), which
// mutex.Client.Inspect and the asynqmutex command show. The lock's events go to the
// Client's observers (mutex.Observe); the middleware's own, a conflict with the
// policy applied and a task archived for its input, to Observe's.
//
// Middleware panics if locks is nil or the options conflict. The returned middleware
// is safe for concurrent use.
func Middleware(locks *mutex.Client, opts ...Option) asynq.MiddlewareFunc {
	if locks == nil {
		panic("asynqmutex.Middleware: nil *mutex.Client")
	}
	m := &middleware{
		locks:  locks,
		config: config{ttl: DefaultTTL, policy: Policy(DefaultRetryDelay), meta: asynqMeta, limit: 1, orderGrace: DefaultOrderGrace},
	}
	for _, o := range opts {
		o.apply(&m.config)
	}
	m.keyFuncs()
	m.checkRate()
	m.checkOrder(true)
	if m.capped() && (m.policy == Skip || m.policy == Fail) {
		panic(fmt.Sprintf("asynqmutex.Middleware: MaxReschedules and MaxRescheduleTime apply to RetryLater, not to %v", m.policy))
	}
	m.store, m.prefix = store.New(locks.Redis()), locks.Prefix()
	m.limitOpt = mutex.Limit(m.limit)
	if m.rateBy != "" {
		m.rates = ratelimit.New(locks.Redis(), ratelimit.Prefix(m.prefix))
	}
	return func(next asynq.Handler) asynq.Handler {
		if next == nil {
			panic("asynqmutex.Middleware: nil handler")
		}
		if m.types != nil {
			return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
				if !m.types[t.Type()] {
					return next.ProcessTask(ctx, t)
				}
				return m.process(ctx, t, next)
			})
		}
		return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
			return m.process(ctx, t, next)
		})
	}
}

type middleware struct {
	locks *mutex.Client
	config
	store    *store.Runner      // the locks' Redis, where conflicts are counted
	prefix   string             // the locks' key prefix
	limitOpt mutex.LockOption   // mutex.Limit(limit)
	rates    *ratelimit.Limiter // with Rate or RateBy: on the locks' Redis and prefix
}

func (m *middleware) process(ctx context.Context, t *asynq.Task, next asynq.Handler) error {
	meta := m.meta(ctx)
	id := meta.id
	key, keys, err := m.keysOf(ctx, t)
	if err != nil {
		var ke *keyError
		if !errors.As(err, &ke) { // a KeyBy error need not name the task
			err = &wrapError{msg: fmt.Sprintf("asynqmutex: task %s: lock key: %s", shortkey.Quote(t.Type()), oneLine(err)), err: err}
		}
		err = &wrapError{
			msg: fmt.Sprintf("%s; %s archived without running: %v", oneLine(err), taskRef(id), asynq.SkipRetry),
			err: errors.Join(err, asynq.SkipRetry),
		}
		m.emit(ctx, Event{Op: OpBadInput, TaskType: t.Type(), TaskID: id, Err: err})
		m.failed(ctx, t, err)
		return err
	}
	if m.seq != nil {
		return m.inOrder(ctx, t, meta, key, next)
	}
	return m.gated(ctx, t, meta, key, keys, next, 0)
}

// lastTry reports whether a conflict would archive the task: under RetryLater with
// no retry left.
func (m *middleware) lastTry(meta taskMeta) bool {
	return m.policy != Skip && m.policy != Fail && meta.noRetryLeft()
}

// gated runs task t, whose key is key (or keys), through the lock and the rate gate
// to its handler, and returns the task's result. It has waited already (for its
// turn, under InOrder) what it may wait no longer.
func (m *middleware) gated(ctx context.Context, t *asynq.Task, meta taskMeta, key string, keys []string, next asynq.Handler, waited time.Duration) error {
	id := meta.id
	var err error
	lastTry := m.lastTry(meta)
	// pastCap holds the record of a task that reached a reschedule cap on an earlier
	// run and has no retry left since: a conflict now fails as under Fail (asynq
	// archives it) instead of waiting LastTryWait. Only a task that has spent a retry
	// can be one, so an uncontended task costs no Redis command here, unless it is on
	// its last retry with a cap set.
	var pastCap *record
	if lastTry && m.capped() && meta.retried > 0 && id != "" {
		if r, err := m.record(ctx, meta, peekConflicts); err == nil && m.capsReached(r) != "" {
			lastTry, pastCap = false, &r
		} // on an error, the last try waits as any other: Redis will say more when it answers
	}
	wait := max(m.wait(ctx, lastTry)-waited, 0)

	var (
		ran        bool
		handlerErr error
		lim        ratelimit.Limit
	)
	start := time.Now()
	fn := func(ctx context.Context) error {
		if m.rates != nil {
			var err error
			if lim, err = m.limitOf(ctx, t, id); err != nil {
				return &gateError{err: err, named: true}
			}
			if err := m.rateGate(ctx, t, id, key, lim, wait-time.Since(start)); err != nil {
				return err
			}
		}
		ran = true
		handlerErr = next.ProcessTask(ctx, t)
		return nil // kept apart, so that err is only about the gates
	}
	switch {
	case m.noLock:
		err = fn(ctx)
	case keys != nil:
		err = m.locks.WithLockKeys(ctx, keys, m.ttl, fn, mutex.MaxWait(wait), mutex.HeldBy(t.Type(), id))
	default:
		err = m.locks.WithLock(ctx, key, m.ttl, fn, mutex.MaxWait(wait), mutex.HeldBy(t.Type(), id), m.limitOpt)
	}

	if ran {
		if m.capped() && id != "" { // caps come with RetryLater only (see Middleware)
			// The conflicts are over: a later one starts a new count. Without a cap the
			// record is left to expire, so that an uncontended task costs no Redis
			// command beyond its lock's (see RetryLater).
			m.clearRecord(ctx, meta)
		}
		var pe *PauseError
		if errors.As(handlerErr, &pe) {
			handlerErr = m.paused(ctx, t, id, key, lim, pe)
		}
		if !errors.Is(err, mutex.ErrNotHeld) {
			// A release Redis could not confirm needs no retry of the task: the key frees
			// itself when its lease runs out.
			return handlerErr
		}
		shown := showKeys(key, keys)
		m.leaseLost(ctx, t, id, shown, err, handlerErr)
		if handlerErr == nil {
			// The work is done: running it again would add a second run, not undo the
			// overlap.
			return nil
		}
		return &wrapError{
			msg: fmt.Sprintf("asynqmutex: task %s%s: lock%s lost while the handler ran, so another worker may have run concurrently: %s; the handler returned: %s",
				shortkey.Quote(t.Type()), idSuffix(id), unlessNamed(err, key, keys), oneLine(err), oneLine(handlerErr)),
			err: errors.Join(err, handlerErr),
		}
	}

	le := &LockedError{Key: key, Keys: keys, taskType: t.Type(), taskID: id}
	var (
		limited *limitedError
		gate    *gateError
	)
	switch {
	case errors.As(err, &limited):
		le.limited = limited
		return m.conflict(ctx, t, meta, le, conflictInfo{op: OpLimited, start: start, wait: wait, lastTry: lastTry, pastCap: pastCap})
	case errors.As(err, &gate):
		err = &wrapError{msg: gate.describe(t.Type(), id, key), err: err}
		m.failed(ctx, t, err)
		return err
	case !errors.Is(err, mutex.ErrNotObtained) || ctx.Err() != nil:
		err = &wrapError{
			msg: fmt.Sprintf("asynqmutex: task %s%s: taking lock%s: %s", shortkey.Quote(t.Type()), idSuffix(id), unlessNamed(err, key, keys), oneLine(err)),
			err: err,
		}
		m.failed(ctx, t, err)
		return err
	}
	if busy, ok := mutex.BusyKey(err); ok {
		le.Key = busy
	}
	return m.conflict(ctx, t, meta, le, conflictInfo{op: OpConflict, start: start, wait: wait, lastTry: lastTry, pastCap: pastCap})
}

// conflictInfo is what conflict needs to know of a task that did not run.
type conflictInfo struct {
	op      Op            // OpConflict: its key was busy; OpLimited: at its rate limit
	start   time.Time     // when it began to try
	wait    time.Duration // how long it could wait
	lastTry bool          // under RetryLater with no retry left
	pastCap *record       // past a reschedule cap with no retry left
}

// conflict applies the OnConflict policy to task t, which did not run because its
// key was busy or at its rate limit (le says which), reports it, and returns the
// task's result.
func (m *middleware) conflict(ctx context.Context, t *asynq.Task, meta taskMeta, le *LockedError, c conflictInfo) error {
	id := meta.id
	report := func(policy string) {
		m.emit(ctx, Event{Op: c.op, TaskType: t.Type(), TaskID: id, Key: le.Key, Keys: le.Keys, Wait: time.Since(c.start), Policy: policy, Err: le})
		m.failed(ctx, t, le)
	}
	switch m.policy {
	case Skip:
		report("skip")
		return nil
	case Fail:
		report("fail")
		return fmt.Errorf("%s: %w", le.Error(), mutex.ErrNotObtained)
	}
	if c.lastTry {
		le.waited, le.archived = c.wait, true
		report("archive")
		return &wrapError{msg: le.Error(), err: errors.Join(le, asynq.SkipRetry)}
	}

	if c.pastCap != nil {
		// Past its cap and out of retries: asynq archives the task for this error,
		// and its count ends here.
		m.clearRecord(ctx, meta)
		le.caps, le.conflicts, le.since, le.archived = m.capsReached(*c.pastCap), c.pastCap.n+1, c.pastCap.elapsed, true
		report("archive")
		return fmt.Errorf("%s: %w", le.Error(), mutex.ErrNotObtained)
	}
	r := record{n: 1} // a conflict Redis did not count is taken as a first one
	if id != "" {
		if got, err := m.record(ctx, meta, countConflict); err != nil {
			m.countFailed(ctx, t.Type(), id, showKeys(le.Key, le.Keys), err)
		} else {
			r = got
		}
	}
	if caps := m.capsReached(r); caps != "" {
		le.caps, le.conflicts, le.since = caps, r.n, r.elapsed
		report("fail")
		return fmt.Errorf("%s: %w", le.Error(), mutex.ErrNotObtained)
	}
	switch {
	case le.limited != nil:
		// The time until a start is free, not a backoff: waiting longer leaves the
		// key's starts unused.
		le.RetryIn = wholeSeconds(le.limited.delay)
	case le.turn != nil:
		// No backoff either: the task waits for one task to finish, not for a
		// contended key to calm down, and each doubling would delay the key's tail.
		// A task waiting for one that is due later comes back a second after it, so
		// as to find it queued ahead of itself.
		le.RetryIn = time.Duration(m.policy)
		if due := time.Until(le.turn.due); due > 0 {
			le.RetryIn = max(le.RetryIn, wholeSeconds(due)+time.Second)
		}
	default:
		le.RetryIn = backoff(time.Duration(m.policy), r.n)
	}
	report("retry")
	return le
}

// keysOf derives the task's lock key, or its keys when it has several (then key is
// the first of them), or an error saying why it cannot.
func (m *middleware) keysOf(ctx context.Context, t *asynq.Task) (key string, keys []string, err error) {
	if m.keys == nil {
		key, err = m.key(ctx, t)
		if err == nil && key == "" {
			err = &keyError{taskType: t.Type(), msg: "KeyBy returned an empty key"}
		}
		return key, nil, err
	}
	keys, err = m.keys(ctx, t)
	switch {
	case err != nil:
		return "", nil, err
	case len(keys) == 0:
		return "", nil, &keyError{taskType: t.Type(), msg: "KeysBy returned no key"}
	case slices.Contains(keys, ""):
		return "", nil, &keyError{taskType: t.Type(), msg: "KeysBy returned an empty key"}
	}
	distinct := keyset.Distinct(keys)
	if len(distinct) == 1 {
		return distinct[0], nil, nil
	}
	return distinct[0], distinct, nil
}

// showKeys is key, or keys when there are several, each shown shortened.
func showKeys(key string, keys []string) string {
	if keys == nil {
		return shortkey.Show(key)
	}
	shown := make([]string, len(keys))
	for i, k := range keys {
		shown[i] = shortkey.Show(k)
	}
	return strings.Join(shown, " and ")
}

// unlessNamed is " " and the keys shown, for an error about them that wraps err,
// from package mutex, unless err already names one of them, as mutex's errors
// mostly do: an error names its key once.
func unlessNamed(err error, key string, keys []string) string {
	text := " " + err.Error() + " "
	all := keys
	if all == nil {
		all = []string{key}
	}
	for _, k := range all {
		shown := shortkey.Show(k)
		if strings.Contains(text, " "+shown+" ") || strings.Contains(text, " "+shown+":") {
			return ""
		}
	}
	return " " + showKeys(key, keys)
}

// oneLine is err's text on one line: errors.Join puts each error on a line of its
// own, which a log line or asynq's LastErr would carry as it is.
func oneLine(err error) string {
	return strings.ReplaceAll(err.Error(), "\n", "; ")
}

// wait returns how long the task may wait for a busy key: MaxWait, or at least
// LastTryWait on a last try under RetryLater (lastTry), and in any case ending
// DeadlineMargin before the task's deadline.
func (m *middleware) wait(ctx context.Context, lastTry bool) time.Duration {
	wait := m.maxWait
	if lastTry {
		wait = max(wait, LastTryWait)
	}
	if deadline, ok := ctx.Deadline(); ok {
		wait = min(wait, time.Until(deadline)-DeadlineMargin)
	}
	return max(wait, 0)
}

// backoff is d doubled for each conflict after the first, up to 16·d, and never
// past the largest Duration.
func backoff(d time.Duration, conflicts int) time.Duration {
	for range min(conflicts-1, 4) {
		if d > math.MaxInt64/2 {
			return math.MaxInt64
		}
		d *= 2
	}
	return d
}

// leaseLost logs that the lock was lost while the handler ran: the one event that
// needs a person, since another worker may have run a task with the same key
// meanwhile, and AfterFailure is only for tasks whose handler did not run.
func (m *middleware) leaseLost(ctx context.Context, t *asynq.Task, id, shown string, err, handlerErr error) {
	outcome := "completed: the handler returned nil"
	if handlerErr != nil {
		outcome = "failed: the handler returned an error"
	}
	m.log().LogAttrs(ctx, slog.LevelWarn, "asynqmutex: lock lost while the handler ran; another worker may have run a task with the same key at the same time",
		slog.String("task_type", shortkey.Shorten(t.Type())),
		slog.String("task_id", shortkey.Shorten(id)),
		slog.String("key", shown),
		slog.String("task", outcome),
		slog.String("error", oneLine(err)))
}

// wrapError is an error with the text msg that wraps err.
type wrapError struct {
	msg string
	err error
}

func (e *wrapError) Error() string { return e.msg }
func (e *wrapError) Unwrap() error { return e.err }

// taskRef and idSuffix name a task by its ID in errors, when asynq gave one.
func taskRef(id string) string {
	if id == "" {
		return "the task is"
	}
	return "task " + id + " is"
}

func idSuffix(id string) string {
	if id == "" {
		return ""
	}
	return " (id " + id + ")"
}

func (m *middleware) log() *slog.Logger {
	if m.logger != nil {
		return m.logger
	}
	return slog.Default()
}

func (m *middleware) failed(ctx context.Context, t *asynq.Task, err error) {
	if m.hook != nil {
		m.hook(ctx, t, err)
	}
}

// taskMeta is what asynq tells a handler about its task.
type taskMeta struct {
	id, queue         string // "" when not run by an asynq server
	retried, maxRetry int
	counted           bool // retried and maxRetry are known
}

func asynqMeta(ctx context.Context) taskMeta {
	id, _ := asynq.GetTaskID(ctx)
	queue, _ := asynq.GetQueueName(ctx)
	retried, ok1 := asynq.GetRetryCount(ctx)
	maxRetry, ok2 := asynq.GetMaxRetry(ctx)
	return taskMeta{id: id, queue: queue, retried: retried, maxRetry: maxRetry, counted: ok1 && ok2}
}

// noRetryLeft reports whether asynq would archive the task for any error it returns
// now: asynq compares the retry count with MaxRetry before it asks IsFailure.
func (t taskMeta) noRetryLeft() bool { return t.counted && t.retried >= t.maxRetry }

// Fence returns the fencing token of the lock the handler runs under: strictly
// greater than that of any earlier holder of the same key. Pass it to the resource you
// write to and have it reject writes with a lower fence; that, not the lock alone,
// keeps a paused or partitioned worker from overwriting newer data. It reports false
// outside a handler run by Middleware (or mutex.Client.WithLock).
func Fence(ctx context.Context) (int64, bool) {
	l, ok := mutex.FromContext(ctx)
	if !ok {
		return 0, false
	}
	return l.Fence(), true
}
