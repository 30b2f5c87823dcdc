package ratelimit

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex/internal/rediskey"
	"github.com/asynqmutex/asynqmutex/internal/shortkey"
	"github.com/asynqmutex/asynqmutex/internal/store"
)

// Limiter decides, per key, whether a start may begin, on one Redis deployment.
// Create it with New; it is safe for concurrent use, and one per process is enough.
// Limiters with the same prefix on the same Redis share every key's limit.
type Limiter struct {
	run    *store.Runner // every Redis call of the Limiter goes through it
	prefix string
}

// Option configures a Limiter in New.
type Option interface{ apply(*Limiter) }

type optionFunc func(*Limiter)

func (f optionFunc) apply(l *Limiter) { f(l) }

// Prefix sets the prefix of the Redis keys the Limiter uses. The default is
// DefaultPrefix ("asynqmutex:"). Prefix panics if p contains '{' or '}', which would
// move a key out of its Redis Cluster hash slot.
func Prefix(p string) Option {
	rediskey.CheckPrefix("ratelimit.Prefix", p)
	return optionFunc(func(l *Limiter) { l.prefix = p })
}

// New returns a Limiter that keeps its keys in client, a single-node, Sentinel
// failover or Cluster client. Its scripts are loaded on first use (as a function
// library called with FCALL where the server and the ACL allow, EVALSHA elsewhere),
// so New does no I/O. New panics if client is nil.
func New(client redis.UniversalClient, opts ...Option) *Limiter {
	if client == nil {
		panic("ratelimit.New: nil redis client")
	}
	l := &Limiter{run: store.New(client), prefix: DefaultPrefix}
	for _, o := range opts {
		o.apply(l)
	}
	return l
}

// Result is the answer to Allow, Reserve or Take.
type Result struct {
	// Allowed is true when the start was taken: it may begin after Delay.
	Allowed bool
	// Delay is, when Allowed, how long from the answer the start must wait before it
	// begins: 0 from Allow, up to Reserve's maxWait from Reserve; from Take, how long
	// Take slept for it. When Held (TakeAs), how long until the start held is due.
	// Otherwise it is how long until a start could be taken, as far as the starts
	// taken so far and a pause say: what Reserve's maxWait would have to be, and what
	// a task sent back should wait.
	Delay time.Duration
	// Remaining is how many more starts (of cost 1, see Rate.Cost) could begin at
	// once now.
	Remaining int
	// Paused is how long the key's pause (see Pause) still holds it back; 0
	// without one, or when starts taken since hold it back longer.
	Paused time.Duration
	// Held is true, from TakeAs, when the start was taken and kept for the caller
	// to come back for (Allowed is then false, and Delay says when it is due); the
	// start lapses unused if nobody comes back for it. False on any error.
	Held bool
	// Found is true, from TakeAs, when the call found a start an earlier call held
	// for its id (honoured, or given up as too late); Late is then how long after
	// that start was due the call came, on the Redis server's clock (negative when
	// it came early): how late a caller that parked until its start arrives.
	Found bool
	Late  time.Duration

	member string // the start taken, for Cancel
}

// Allow takes a start of key under lim if it may begin now. It is shorthand for
// Reserve(ctx, key, lim, 0). On error nothing was taken, unless the error came after
// Redis applied the call (a lost reply), in which case the start lapses unused.
func (l *Limiter) Allow(ctx context.Context, key string, lim Rate) (Result, error) {
	return l.Reserve(ctx, key, lim, 0)
}

// Reserve takes a start of key under lim if it may begin within maxWait: the Result
// is Allowed and its Delay says when. A start that will not begin after all should be
// given back with Cancel. When the next start comes later than maxWait, nothing is
// taken and Delay says how long until it could. A pause counts as a start that
// comes when it ends.
//
// The call is one script on the Redis server, decided by the server's clock. A call
// go-redis sends again after a lost reply finds the start its first run took and
// reports it, up to 10 seconds later. On error (Redis could not be reached, lim is
// invalid, maxWait is negative) nothing was taken, except that a reply lost for good
// may leave a start taken and unused. Reserve is safe for concurrent use.
func (l *Limiter) Reserve(ctx context.Context, key string, lim Rate, maxWait time.Duration) (Result, error) {
	if err := lim.Validate(); err != nil {
		return Result{}, err
	}
	if maxWait < 0 {
		return Result{}, fmt.Errorf("ratelimit: key %s: negative wait %v", show(key), maxWait)
	}
	return l.reserve(ctx, key, lim, member(newID(), lim), maxWait, 0)
}

// reserve runs the take script for the start m of key under lim, taken if it may
// begin within window; stale is 0 for a random member, and for a named one (see
// TakeAs) how late after its start was due the member's start is kept.
func (l *Limiter) reserve(ctx context.Context, key string, lim Rate, m string, window, stale time.Duration) (Result, error) {
	res, err := l.run.Run(ctx, takeScript, []string{redisKey(l.prefix, key)},
		m, lim.interval(), lim.burst(), int64(window/time.Microsecond), int64(stale/time.Microsecond), lim.cost()).Int64Slice()
	if err != nil {
		return Result{}, fmt.Errorf("ratelimit: key %s: %w", show(key), err)
	}
	if len(res) != 6 {
		return Result{}, fmt.Errorf("ratelimit: key %s: unexpected reply %v", show(key), res)
	}
	r := Result{Allowed: res[0] == 1, Delay: micros(res[1]), Remaining: int(res[2]), Paused: micros(res[3]), Found: res[4] == 1, Late: micros(res[5])}
	if r.Allowed {
		r.member = m
	}
	return r, nil
}

// Take takes a start of key under lim if it may begin within maxWait, and sleeps
// until it may: the Result is Allowed, and its Delay how long Take slept for it. When the
// next start comes later than maxWait, Take returns at once a Result that is not
// Allowed, whose Delay says how long until it could. A start taken ahead is
// confirmed when it is due: if a Pause began meanwhile, Take gives it back and takes
// one after the pause, within what is left of maxWait (so a pause stops the starts
// already waiting too). When ctx ends while Take sleeps, the start is given back
// (see Cancel) and ctx's error returned. Safe for concurrent use.
func (l *Limiter) Take(ctx context.Context, key string, lim Rate, maxWait time.Duration) (Result, error) {
	return l.take(ctx, key, lim, maxWait, 0, "")
}

// TakeAs is Take for a caller that can come back for its start, named by id (a task
// that leaves its worker while it waits, say): a start that comes later than maxWait
// but within hold is taken all the same, kept for id, and TakeAs returns at once a
// Result that is Held, not Allowed, whose Delay says when the start is due. A later
// TakeAs with the same id, key and limit finds that start rather than taking
// another, and treats it as Take treats a new one: it begins at once when due,
// after a sleep when due within maxWait, and is Held again when due later. A start
// the caller comes back for late, more than one interval after it was due, is
// given up and another taken, as is one that a pause begun since holds back: so a
// late caller does not begin in a window the key's later starts fill (a start
// honoured late by up to an interval puts at most one more in a window, as a
// handler that begins late does). A start nobody comes back for lapses unused (the
// limit is an upper bound); one is remembered at least 10 seconds past that
// lateness. A call
// go-redis sends again after a lost reply finds the start as any later call would.
//
// id may be any string; the Limiter keeps a 66-bit digest of it in the start's
// member, so ids need be unique only among the key's starts of the last minutes.
// TakeAs returns an error as Take does, and on one hold is 0 and nothing is held.
// It is safe for concurrent use.
func (l *Limiter) TakeAs(ctx context.Context, key string, lim Rate, id string, maxWait, hold time.Duration) (Result, error) {
	if hold < 0 {
		return Result{}, fmt.Errorf("ratelimit: key %s: negative hold %v", show(key), hold)
	}
	return l.take(ctx, key, lim, maxWait, hold, id)
}

// take is Take, and with an id TakeAs.
func (l *Limiter) take(ctx context.Context, key string, lim Rate, maxWait, hold time.Duration, id string) (Result, error) {
	if err := lim.Validate(); err != nil {
		return Result{}, err
	}
	if maxWait < 0 {
		return Result{}, fmt.Errorf("ratelimit: key %s: negative wait %v", show(key), maxWait)
	}
	start := time.Now()
	var slept time.Duration
	for range maxConfirms {
		left := max(maxWait-time.Since(start), 0)
		m, window, stale := member(newID(), lim), left, time.Duration(0)
		if id != "" {
			m, window, stale = namedMember(id, lim), max(left, hold), lim.stale()
		}
		r, err := l.reserve(ctx, key, lim, m, window, stale)
		switch {
		case err != nil || !r.Allowed:
			return r, err
		case id != "" && r.Delay > left:
			r.Allowed, r.Held = false, true
			return r, nil
		case r.Delay == 0:
			r.Delay = slept
			return r, nil
		}
		if err := sleep(ctx, r.Delay); err != nil {
			_, _ = l.Cancel(context.WithoutCancel(ctx), key, r)
			return Result{}, err
		}
		slept += r.Delay
		held, err := l.run.Run(ctx, confirmScript, []string{redisKey(l.prefix, key)}, r.member, lim.interval(), lim.burst()).Int64()
		if err != nil {
			return Result{}, fmt.Errorf("ratelimit: key %s: confirm: %w", show(key), err)
		}
		if held == 0 {
			r.Delay = slept
			return r, nil
		}
	}
	return Result{}, fmt.Errorf("ratelimit: key %s: paused %d times while a start waited", show(key), maxConfirms)
}

// maxConfirms bounds how often Take takes a start again after pauses.
const maxConfirms = 8

// sleep waits d, or until ctx ends, returning ctx's error then.
func sleep(ctx context.Context, d time.Duration) error {
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-timer.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Wait takes a start of key under lim and sleeps until it may begin, as Take does,
// waiting at most until ctx's deadline: when the next start comes after it, Wait
// returns at once an error wrapping ErrLimited that says when it comes. Without a
// deadline Wait accepts any delay. Safe for concurrent use.
func (l *Limiter) Wait(ctx context.Context, key string, lim Rate) error {
	maxWait := time.Duration(1<<63 - 1)
	if d, ok := ctx.Deadline(); ok {
		maxWait = max(time.Until(d), 0)
	}
	r, err := l.Take(ctx, key, lim, maxWait)
	if err == nil && !r.Allowed {
		err = fmt.Errorf("%w: key %s: next start in %v, after the context's deadline", ErrLimited, show(key), r.Delay)
	}
	return err
}

// Cancel gives back the start r took (r from Reserve, Allow or Take, Allowed, or from
// TakeAs, Allowed or Held), for one that will not begin: the key is then as if it had never been taken. It reports false,
// and leaves the start taken, when another start was taken after it (the spacing of
// later starts already counts it) or a pause began since, or when r took nothing.
// Cancel does not check that r's start has not begun: give back only starts that
// have not. A Cancel go-redis sends again after a lost reply answers as its first
// run did. Safe for concurrent use.
func (l *Limiter) Cancel(ctx context.Context, key string, r Result) (bool, error) {
	if r.member == "" {
		return false, nil
	}
	n, err := l.run.Run(ctx, cancelScript, []string{redisKey(l.prefix, key)}, r.member).Int64()
	if err != nil {
		return false, fmt.Errorf("ratelimit: key %s: cancel: %w", show(key), err)
	}
	return n == 1, nil
}

// Pause lets no start of key begin for d from now, on every Limiter that shares the
// Redis: for an API that answered 429 with a Retry-After. lim is the key's limit:
// the first start after the pause begins when it ends, the next ones at lim's
// spacing, with no burst. A pause, or starts already taken, that hold the key back
// longer stay; starts taken ahead that fall within the pause are held back all the
// same (given up when their callers come for them, and taken again after the key's
// last), also when later ones reach past it. Pause returns how long the key is held
// back from now. It returns an
// error if lim is invalid, d is outside (0, MaxPer], or Redis could not be reached.
// Safe for concurrent use.
func (l *Limiter) Pause(ctx context.Context, key string, lim Rate, d time.Duration) (time.Duration, error) {
	if err := lim.Validate(); err != nil {
		return 0, err
	}
	if d <= 0 || d > MaxPer {
		return 0, fmt.Errorf("ratelimit: key %s: pause %v outside (0, %v]", show(key), d, MaxPer)
	}
	left, err := l.run.Run(ctx, pauseScript, []string{redisKey(l.prefix, key)},
		int64(d/time.Microsecond), lim.interval(), lim.burst()).Int64()
	if err != nil {
		return 0, fmt.Errorf("ratelimit: key %s: pause: %w", show(key), err)
	}
	return micros(left), nil
}

// Resume ends key's pause at once, and reports whether it had one that still held
// it back (a pause that ended is stored a little longer, to be forgotten as starts
// are; with a burst above 1 one that ended within (burst-1) intervals counts as
// holding). Starts taken meanwhile keep their times. A Resume go-redis sends again
// after a lost reply answers as its first run did. Safe for concurrent use.
func (l *Limiter) Resume(ctx context.Context, key string) (bool, error) {
	n, err := l.run.Run(ctx, resumeScript, []string{redisKey(l.prefix, key)}, newID()).Int64()
	if err != nil {
		return false, fmt.Errorf("ratelimit: key %s: resume: %w", show(key), err)
	}
	return n == 1, nil
}

// Reset forgets every start of key, those taken ahead (Reserve, Take, TakeAs) too,
// so that the key may start its whole burst at once, and returns how many it forgot.
// A pause stays: Resume ends it. A start taken ahead and forgotten still begins when
// its caller sleeps until it (Take) or comes back for it (TakeAs, which then takes a
// new one); the limit counts it no more. A Reset go-redis sends again after a lost
// reply forgets nothing more and returns 0. Safe for concurrent use.
func (l *Limiter) Reset(ctx context.Context, key string) (int, error) {
	n, err := l.run.Run(ctx, resetScript, []string{redisKey(l.prefix, key)}).Int64()
	if err != nil {
		return 0, fmt.Errorf("ratelimit: key %s: reset: %w", show(key), err)
	}
	return int(n), nil
}

func micros(us int64) time.Duration { return time.Duration(us) * time.Microsecond }

// newID is a call's random identity: 128 bits, base64url.
func newID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return base64.RawURLEncoding.EncodeToString(b[:])
}

// show is key for errors: quoted, shortened past 100 bytes.
func show(key string) string { return shortkey.Show(key) }
