// Package mutex is a distributed lock on Redis: token-safe, idempotent under lost
// replies, one round trip per step, with fencing tokens and waiters that are woken
// when the holder releases instead of polling.
//
// Most callers want [Client.WithLock]: it takes the lock (waiting if asked), renews
// the lease while fn runs, cancels fn's context the moment the lease is lost, and
// always releases. [Client.TryLock] and [Client.Lock] return a [Lock] to manage by
// hand.
//
// A lock on a single Redis is an efficiency lock: it keeps two workers from doing the
// same job at once nearly always, but a process pause longer than the lease, a
// failover that loses the key, or a restart without persistence can let two holders
// overlap. Where overlap would corrupt data, pass [Lock.Fence] to the resource and
// have it reject any write carrying a fence lower than one it has seen.
//
// Fences: a fence is the larger of the previous fence of the key plus one and the
// Redis server's clock in microseconds, taken in the acquiring script. Fences
// therefore keep increasing across a restart without persistence, a restore from an
// older RDB or AOF snapshot and a replica's promotion, as long as the server's clock
// does not go back; no counter key is kept.
//
// Keys: the Redis key of a lock is prefix + "{" + encoded key + "}"; its queue of
// waiters is that plus ":wait", so both share one Redis Cluster hash slot. Each
// Client listens for hand-overs on the channel prefix + "wake:" + a random id. The
// encoding escapes '%', '{', '}' and '#' (braces in a key cannot move the slot) and
// replaces keys longer than 256 bytes after escaping by their first 64 bytes, '#' and
// a SHA-256 digest, so distinct keys never share a Redis key and every key is bounded.
package mutex

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex/internal/shortkey"
)

var (
	// ErrNotObtained means another holder has the lock: at once for TryLock, or for
	// the whole wait of Lock and WithLock. When the wait ended because the context was
	// done, the error returned is errors.Join(ErrNotObtained, ctx.Err()).
	ErrNotObtained = errors.New("mutex: not obtained")

	// ErrNotHeld means the lock is no longer ours: its lease expired or another token
	// holds the key. Unlock and Extend return it (wrapped) and change nothing; WithLock
	// returns it (wrapped) when the lease was lost while fn ran.
	ErrNotHeld = errors.New("mutex: not held")
)

const (
	// DefaultPrefix is the prefix of every Redis key and channel a Client uses unless
	// Prefix says otherwise.
	DefaultPrefix = "asynqmutex:"

	// MinTTL is the shortest lease a lock accepts. WithLock renews every ttl/3 and
	// allows 2ms and 1% for clock drift, so a shorter lease would leave a renewal too
	// little time to arrive before the lease ends.
	MinTTL = 20 * time.Millisecond

	// MaxTTL is the longest lease a lock accepts: seven days. Longer leases gain
	// nothing (WithLock renews while fn runs) and risk overflowing time arithmetic.
	MaxTTL = 7 * 24 * time.Hour

	// renewedHandOver is the lease a release hands a WithLock waiter: its renewal
	// lengthens it at once, and a waiter cut off from Redis as the lock is handed to
	// it (its process stopped, its network lost) holds the lock no longer than this.
	renewedHandOver = 250 * time.Millisecond

	// MaxTokenLen is the longest token the Token option accepts, in bytes.
	MaxTokenLen = 9999

	waitSuffix   = ":wait"
	channelInfix = "wake:" // a Client listens on prefix + "wake:" + its id

	// tombstoneMillis is how long, in milliseconds, a released lock's key stays as a
	// tombstone (see common.lua), so that a release repeated after a lost reply is
	// recognised: longer than go-redis's retries last.
	tombstoneMillis = 10_000

	// idLenDigits is how many decimal digits carry a token's length in the lock value;
	// MaxTokenLen follows from it.
	idLenDigits = 4

	maxKeyLen  = 256 // longer encoded keys are digested
	keepOfLong = 64  // bytes of a digested key kept readable
)

// Client takes locks on one Redis deployment. Create it with New; it is safe for
// concurrent use by many goroutines, and one Client per process is enough: its
// waiters share one subscription connection, opened while someone waits and closed
// 200ms after the last waiter leaves (see Close).
type Client struct {
	rdb      redis.UniversalClient
	prefix   string
	channels string // prefix + channelInfix: a Client listens on channels + its id
	hub      *hub

	// countsSubscribers is "1" unless rdb is a Cluster client: there PUBLISH counts only
	// the subscribers of the node it ran on, so zero does not mean nobody listens.
	countsSubscribers string

	// oneNode is true unless rdb spreads keys over several servers (Cluster, Ring):
	// then one script cannot reach the keys of several locks (see batch).
	oneNode bool

	self    string // "<host>\t<pid>\t": this process, recorded in every lock it takes (see Holder)
	desc    string // describe("", ""): the description of a holder without HeldBy
	observe func(context.Context, Event)
	logger  *slog.Logger // nil: slog.Default() when a record is logged
}

// Option configures a Client in New.
type Option interface{ apply(*Client) }

type optionFunc func(*Client)

func (f optionFunc) apply(c *Client) { f(c) }

// Prefix sets the prefix of the Redis keys and channels the Client uses. The default
// is DefaultPrefix ("asynqmutex:"). Clients that should exclude each other must use
// the same prefix. Prefix panics if p contains '{' or '}', which would break the hash
// slot shared by a lock and its fencing counter.
func Prefix(p string) Option {
	if strings.ContainsAny(p, "{}") {
		panic(fmt.Sprintf("mutex.Prefix: prefix %q must not contain '{' or '}'", p))
	}
	return optionFunc(func(c *Client) { c.prefix = p })
}

// New returns a Client that keeps its locks in rdb, which may be a single-node,
// Sentinel failover or Cluster client. The scripts are sent with EVALSHA and loaded on
// first use, so New does no I/O. New panics if rdb is nil.
func New(rdb redis.UniversalClient, opts ...Option) *Client {
	if rdb == nil {
		panic("mutex.New: nil redis client")
	}
	c := &Client{rdb: rdb, prefix: DefaultPrefix, countsSubscribers: "1", oneNode: true,
		self: hostname() + "\t" + strconv.Itoa(os.Getpid()) + "\t"}
	switch rdb.(type) {
	case *redis.ClusterClient:
		c.countsSubscribers, c.oneNode = "0", false
	case *redis.Ring:
		c.oneNode = false
	}
	for _, o := range opts {
		o.apply(c)
	}
	c.channels = c.prefix + channelInfix
	c.desc = c.describe("", "")
	c.hub = newHub(c)
	return c
}

// Redis returns the Redis client the Client keeps its locks in, as given to New. The
// asynqmutex middleware keeps its count of a task's conflicts there too.
func (c *Client) Redis() redis.UniversalClient { return c.rdb }

// Prefix returns the prefix of the Redis keys and channels the Client uses (see the
// Prefix option).
func (c *Client) Prefix() string { return c.prefix }

// Close closes the subscription connection the Client's waiters share, at once
// rather than 200ms after the last waiter left, so that the redis client can be closed
// next without go-redis logging a broken connection. Waiters still waiting fall back
// to trying again when the holder's lease runs out, and a later wait reopens the
// connection. Locks are not released. Close is optional, idempotent, and safe for
// concurrent use; it always returns nil.
func (c *Client) Close() error {
	c.hub.close()
	return nil
}

// LockOption configures one acquisition in TryLock, Lock and WithLock.
type LockOption interface{ applyLock(*lockConfig) }

type lockConfig struct {
	maxWait time.Duration // < 0: until the context is done
	token   string
	by      heldBy
	limit   int // holders at once; > 1: a semaphore (semaphore.go)
}

// heldBy is what a holder says about itself with HeldBy.
type heldBy struct{ name, id string }

type lockOptionFunc func(*lockConfig)

func (f lockOptionFunc) applyLock(c *lockConfig) { f(c) }

// MaxWait bounds how long Lock and WithLock wait for a busy key before they return
// ErrNotObtained. MaxWait(0) makes a single attempt, like TryLock. Without MaxWait
// they wait until the lock is obtained or the context is done. TryLock ignores it.
// A negative d is treated as 0.
func MaxWait(d time.Duration) LockOption {
	if d < 0 {
		d = 0
	}
	return lockOptionFunc(func(c *lockConfig) { c.maxWait = d })
}

// Token sets the token that identifies this acquisition instead of a random 128-bit
// one. An acquisition whose token already holds the key succeeds at once and returns
// the original fence, so a process that restarts with the same token (for example a
// job ID) reclaims its own lock rather than waiting out the lease. Two holders using
// the same token at the same time both "hold" the lock: a token must identify one
// holder. Token panics if s is empty or longer than MaxTokenLen bytes.
func Token(s string) LockOption {
	if s == "" {
		panic("mutex.Token: empty token")
	}
	if len(s) > MaxTokenLen {
		panic(fmt.Sprintf("mutex.Token: token of %d bytes is longer than MaxTokenLen (%d)", len(s), MaxTokenLen))
	}
	return lockOptionFunc(func(c *lockConfig) { c.token = s })
}

// HeldBy records what takes the lock, for people: name says what kind of work it is
// and id which one (the asynqmutex middleware passes the task type and the task ID).
// They are stored in the lock's value with the host name and process ID, shown by
// Inspect and the asynqmutex command, and passed in every Event of the acquisition.
// Each is cut to 100 bytes (with a digest past 64); tabs and newlines become spaces,
// bytes that are not UTF-8 U+FFFD.
// Without HeldBy a lock records only host and process. They cost no extra round trip.
func HeldBy(name, id string) LockOption {
	b := heldBy{name: shortkey.Field(name), id: shortkey.Field(id)}
	return lockOptionFunc(func(c *lockConfig) { c.by = b })
}

// Lock is a held lock. Its methods are safe for concurrent use; Unlock and the other
// methods are safe on a nil *Lock, which holds nothing.
type Lock struct {
	c      *Client
	key    string   // the caller's key (the first, of several)
	given  []string // several keys: all of them, as the caller gave them; nil for one
	keys   []string // the Redis keys: each lock and its wait queue, in the order taken
	locks  []string // the Redis keys of the locks alone
	id     string   // the identity scripts compare: the token's length in 4 digits, then the token
	fence  int64    // of key
	fences []int64  // of given, in its order; nil for one key
	by     heldBy
	taken  time.Time // when the attempt that took it was sent, on our clock
	limit  int       // > 1: a slot of a semaphore (semaphore.go)

	mu    sync.Mutex
	until time.Time // lease end on our own monotonic clock, conservatively
	ended bool      // OpReleased or OpLeaseLost was reported
}

// Key returns the key the lock was taken on, as the caller gave it.
func (l *Lock) Key() string {
	if l == nil {
		return ""
	}
	return l.key
}

// Token returns the token of this acquisition: the one given with the Token option,
// or a random one. It is a secret of the holder: whoever knows it can release the lock.
func (l *Lock) Token() string {
	if l == nil {
		return ""
	}
	return l.id[idLenDigits:]
}

// Fence returns the fencing token of this acquisition: strictly greater than the
// fence of every earlier acquisition of the same key (see the package doc for the
// limits). Pass it to the resource you protect and have it reject lower fences.
func (l *Lock) Fence() int64 {
	if l == nil {
		return 0
	}
	return l.fence
}

// TTL returns the remaining lease as Redis sees it. It returns an error wrapping
// ErrNotHeld when the lock is no longer ours, and a wrapped Redis error when Redis
// cannot be reached.
func (l *Lock) TTL(ctx context.Context) (time.Duration, error) {
	if l == nil {
		return 0, ErrNotHeld
	}
	if l.limit > 1 {
		return l.semTTL(ctx)
	}
	least := int64(-1)
	for i := 0; ; i++ {
		b, ok := l.c.batch(l.locks, 1, i)
		if !ok {
			break
		}
		n, err := pttlScript.Run(ctx, l.c.rdb, b, l.id).Int64()
		switch {
		case err != nil:
			return 0, fmt.Errorf("mutex: ttl of %s: %w", l.what(), err)
		case n == -3:
			return 0, fmt.Errorf("mutex: ttl of %s: %w", l.what(), ErrNotHeld)
		case n >= 0 && (least < 0 || n < least):
			least = n
		}
	}
	if least < 0 {
		return -1, nil // no expiry: someone removed it by hand
	}
	return time.Duration(least) * time.Millisecond, nil
}

// Extend replaces the remaining lease with ttl if the lock is still ours. It returns
// an error wrapping ErrNotHeld (and changes nothing) when the lease expired or another
// token holds the key, and a wrapped Redis error when Redis cannot be reached; it is
// safe to repeat. ttl is rounded down to whole milliseconds and must lie between
// MinTTL and MaxTTL.
func (l *Lock) Extend(ctx context.Context, ttl time.Duration) error {
	if l == nil {
		return ErrNotHeld
	}
	err := l.extend(ctx, ttl)
	if errors.Is(err, ErrNotHeld) {
		l.emit(ctx, OpLeaseLost, err)
	}
	return err
}

// extend is Extend without the event of a lost lease: WithLock reports that itself.
func (l *Lock) extend(ctx context.Context, ttl time.Duration) error {
	if l.limit > 1 {
		return l.semExtend(ctx, ttl)
	}
	if err := checkTTL(ttl); err != nil {
		return fmt.Errorf("mutex: extend %s: %w", l.what(), err)
	}
	sent := time.Now()
	for i := 0; ; i++ {
		b, ok := l.c.batch(l.locks, 1, i)
		if !ok {
			break
		}
		n, err := extendScript.Run(ctx, l.c.rdb, b, l.id, ttl.Milliseconds()).Int64()
		if err != nil {
			return fmt.Errorf("mutex: extend %s: %w", l.what(), err)
		}
		if n == 0 {
			return fmt.Errorf("mutex: extend %s: %w", l.what(), ErrNotHeld)
		}
	}
	l.mu.Lock()
	l.until = leaseEnd(sent, ttl)
	l.mu.Unlock()
	return nil
}

// Unlock releases the lock, handing it to the waiter, of any Client, queued longest.
// It returns an error wrapping ErrNotHeld when the lease had expired, another token
// holds the key, or ForceRelease took it (then nothing changes), and a wrapped Redis
// error when Redis cannot be reached (then the key frees itself when the lease runs
// out).
//
// Repeating an Unlock that succeeded returns nil while the key is free (for 10s) or
// held by the waiter it was handed to, or by whoever took it next: that is how a
// release whose reply was lost, and which go-redis sent again, is told apart from a
// lost lease. Only when the key has changed hands twice more before the repeat
// arrives does it return ErrNotHeld; WithLock does not count that as a lost lease.
// Unlock on a nil *Lock returns ErrNotHeld, so `defer l.Unlock(ctx)` is always safe.
func (l *Lock) Unlock(ctx context.Context) error {
	if l == nil {
		return ErrNotHeld
	}
	err := l.unlock(ctx)
	switch {
	case err == nil:
		l.emit(ctx, OpReleased, nil)
	case errors.Is(err, ErrNotHeld):
		l.emit(ctx, OpLeaseLost, err)
	default:
		l.emit(ctx, OpReleaseFailed, err)
	}
	return err
}

// emit reports op on l to the Client's observers, with how long l has been held.
// Of OpReleased and OpLeaseLost only the first is reported: a lock ends once,
// however many calls find out.
func (l *Lock) emit(ctx context.Context, op Op, err error) {
	if l.c.observe == nil {
		return
	}
	if op == OpReleased || op == OpLeaseLost {
		l.mu.Lock()
		again := l.ended
		l.ended = true
		l.mu.Unlock()
		if again {
			return
		}
	}
	l.c.observe(ctx, Event{Op: op, Key: l.key, Keys: l.given, Name: l.by.name, ID: l.by.id, Fence: l.fence, Held: time.Since(l.taken), Err: err})
}

// unlock is Unlock without events: WithLock decides what its result means.
func (l *Lock) unlock(ctx context.Context) error {
	if l.limit > 1 {
		return l.semUnlock(ctx)
	}
	n, err := l.c.release(ctx, l.keys, l.id, "")
	if err != nil {
		return fmt.Errorf("mutex: unlock %s: %w", l.what(), err)
	}
	switch n {
	case 0:
		return fmt.Errorf("mutex: unlock %s: %w", l.what(), ErrNotHeld)
	case 2:
		return fmt.Errorf("mutex: unlock %s: %w: %w", l.what(), errForced, ErrNotHeld)
	}
	return nil
}

// errForced is why an Unlock finds the lock gone when ForceRelease took it.
var errForced = errors.New("the lock was released by force (ForceRelease) while held")

// validUntil is when the lease ends on our own clock, allowing for drift between
// our clock and Redis's.
func (l *Lock) validUntil() time.Time {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.until
}

// leaseEnd is the conservative end of a lease granted by a command sent at sent:
// Redis started counting after that, and its clock may run up to 1% faster than ours
// (the drift allowance of the Redlock analysis, plus 2ms).
func leaseEnd(sent time.Time, ttl time.Duration) time.Time {
	return sent.Add(ttl - ttl/100 - 2*time.Millisecond)
}

// TryLock makes one attempt to take the lock on key for ttl. It returns
// ErrNotObtained when another holder has it, and a wrapped Redis error when Redis
// cannot be reached; in that case it first tries to release the key in case the
// server applied the attempt but its reply was lost, so no lock leaks for a whole
// lease. ttl is rounded down to whole milliseconds and must lie between MinTTL and
// MaxTTL; key must not be empty.
func (c *Client) TryLock(ctx context.Context, key string, ttl time.Duration, opts ...LockOption) (*Lock, error) {
	a, err := c.newAcquisition(key, ttl, opts)
	if err != nil {
		return nil, err
	}
	a.maxWait = 0
	return c.acquire(ctx, a)
}

// Locked reports whether anyone holds the lock on key. The answer may be stale by the
// time it returns; use it for monitoring, not to decide whether to lock.
func (c *Client) Locked(ctx context.Context, key string) (bool, error) {
	if key == "" {
		return false, errors.New("mutex: empty key")
	}
	n, err := lockedScript.Run(ctx, c.rdb, []string{c.redisKey(key)}).Int64()
	if isWrongType(err) {
		return c.semLocked(ctx, key) // held with Limit(n): semaphore.go
	}
	if err != nil {
		return false, fmt.Errorf("mutex: locked %s: %w", shortkey.Quote(key), err)
	}
	return n == 1, nil
}

// acquisition is one call of TryLock, Lock or WithLock (or of their several-keys
// forms): several attempts share its token.
type acquisition struct {
	c         *Client
	renewed   bool // WithLock renews the lease: a hand-over may give a short one
	contended bool // an attempt found another holder: OpContended was reported
	kept      int  // several keys: how many the last attempt kept before a busy one
	busy      int  // several keys: the index in keys' order of the last busy one
	start     time.Time
	id        string   // identity(token)
	desc      string   // what the holder says about itself, as scripts store it (see describe)
	key       string   // the caller's key (the first, of several)
	given     []string // several keys: all of them, in the caller's order; nil for one
	keys      []string // each lock's Redis key and its wait queue, in the order to take them
	locks     []string // the Redis keys of the locks alone, in that order
	order     []int    // several keys: where each of given is in keys' order
	ttl       time.Duration
	lockConfig
}

// checkTTL rejects a lease outside [MinTTL, MaxTTL].
func checkTTL(ttl time.Duration) error {
	if ttl < MinTTL || ttl > MaxTTL {
		return fmt.Errorf("ttl %v outside [%v, %v] (MinTTL, MaxTTL)", ttl, MinTTL, MaxTTL)
	}
	return nil
}

func (c *Client) newAcquisition(key string, ttl time.Duration, opts []LockOption) (*acquisition, error) {
	if key == "" {
		return nil, errors.New("mutex: empty key")
	}
	if err := checkTTL(ttl); err != nil {
		return nil, fmt.Errorf("mutex: lock %s: %w", shortkey.Quote(key), err)
	}
	rkey := c.redisKey(key)
	keys := []string{rkey, rkey + waitSuffix}
	a := &acquisition{c: c, start: time.Now(), key: key, keys: keys, locks: keys[:1], ttl: ttl, lockConfig: lockConfig{maxWait: -1}}
	c.configure(a, opts)
	if a.limit > 1 {
		a.keys = []string{rkey, rkey + semWaitSuffix}
		a.locks = a.keys[:1]
	}
	return a, nil
}

// configure applies opts to a and sets what follows from them.
func (c *Client) configure(a *acquisition, opts []LockOption) {
	for _, o := range opts {
		o.applyLock(&a.lockConfig)
	}
	if a.token == "" {
		a.token = newToken()
	}
	a.id = identity(a.token)
	a.desc = c.desc
	if a.by != (heldBy{}) {
		a.desc = c.describe(a.by.name, a.by.id)
	}
}

// attempt runs lock.lua once, in one call for all of a's locks, or one call per lock
// where they live on several servers. It returns the lock, or nil and the remaining
// lease of the first lock another holder has (-1: none), or an error. A non-nil w is
// queued in Redis on that lock, atomically with the failed attempt, so no release
// after it can miss w, and the locks before it stay taken (a.kept); with a nil w
// (TryLock) nothing stays taken.
func (c *Client) attempt(ctx context.Context, a *acquisition, w *waiter) (*Lock, time.Duration, error) {
	if a.limit > 1 {
		return c.semAttempt(ctx, a, w)
	}
	if err := ctx.Err(); err != nil {
		return nil, 0, errors.Join(ErrNotObtained, err)
	}
	id := ""
	var queued, all any = "0", "1" // constants in an interface cost no allocation
	if w != nil {
		id, all = w.head, "0"
		if w.queued {
			queued = "1"
		}
	}
	sent := time.Now()
	var (
		fences []int64
		pttl   int64
		busy   bool
		err    error
	)
	for i := 0; ; i++ {
		b, ok := c.batch(a.keys, 2, i)
		if !ok {
			break
		}
		var res []int64
		res, err = lockScript.Run(ctx, c.rdb, b,
			a.id, a.ttl.Milliseconds(), id, queued, a.desc, all).Int64Slice()
		if isWrongType(err) {
			if a.given == nil {
				return c.semLimitHeld(ctx, a, w) // the key is held with Limit(n): semaphore.go
			}
			err = errors.New("a key of the set is held with Limit(n), which sets of keys do not take: " + err.Error())
		}
		switch {
		case err != nil:
		case len(res) == 3 && res[0] == 0 && res[2] >= 1 && int(res[2]) <= len(b)/2:
			busy, pttl = true, res[1]
			a.busy = len(fences) + int(res[2]) - 1
			if w != nil { // the locks before the busy one were taken, and kept
				fences = append(fences, make([]int64, res[2]-1)...)
			}
		case len(res) == len(b)/2 && res[0] > 0:
			if fences == nil {
				fences = res
			} else {
				fences = append(fences, res...)
			}
			continue
		default:
			err = fmt.Errorf("unexpected reply %v", res)
		}
		break
	}
	if err := c.attempted(ctx, a, w, sent, err); err != nil {
		return nil, 0, err
	}
	if busy {
		switch {
		case w == nil && len(fences) > 0:
			// One lock per call (several servers): give back those taken before the
			// busy one, so that TryLock takes all or nothing.
			c.abandon(ctx, a)
		case w != nil && len(fences) < a.kept && 2*(len(fences)+1) < len(a.keys):
			// A kept lock was lost (its lease ran out while we did not come back, and
			// someone took it): the locks after it that we still hold, or that a
			// release hands us from the queues we were in, must not wait with us for
			// it, or a set that holds it could wait for them. Give them back, and
			// leave those queues.
			c.giveBack(ctx, a, a.keys[2*(len(fences)+1):], w.entry)
		}
		a.kept = 0
		if w != nil {
			a.kept = len(fences)
		}
		c.contended(ctx, a)
		return nil, time.Duration(pttl) * time.Millisecond, nil
	}
	return a.lock(fences, sent, a.ttl), 0, nil
}

// attempted records that an attempt for waiter w (nil for none) was sent at sent,
// and turns its error, if any, into attempt's: after releasing whatever the attempt
// may have taken, ErrNotObtained with the context's error when that ended it, or a
// wrapped Redis error.
func (c *Client) attempted(ctx context.Context, a *acquisition, w *waiter, sent time.Time, err error) error {
	if w != nil {
		w.queued = true // even after an error: the server may have queued it
		w.sent = sent
	}
	if err == nil {
		return nil
	}
	c.abandon(ctx, a)
	if ctx.Err() != nil {
		return errors.Join(ErrNotObtained, ctx.Err())
	}
	return fmt.Errorf("mutex: lock %s: %w", a.what(), err)
}

// contended reports OpContended the first time an attempt of a finds the lock busy.
func (c *Client) contended(ctx context.Context, a *acquisition) {
	if !a.contended {
		a.contended = true
		c.emit(ctx, Event{Op: OpContended, Key: a.key, Keys: a.given, Name: a.by.name, ID: a.by.id})
	}
}

// lock is the Lock this acquisition holds with fences f (in the order of a.keys),
// granted for lease by a command sent at sent or later.
func (a *acquisition) lock(f []int64, sent time.Time, lease time.Duration) *Lock {
	l := &Lock{c: a.c, key: a.key, given: a.given, keys: a.keys, locks: a.locks, id: a.id,
		fence: f[0], by: a.by, taken: sent, until: leaseEnd(sent, lease), limit: a.limit}
	if a.order != nil {
		l.fences = make([]int64, len(a.order))
		for i, j := range a.order {
			l.fences[i] = f[j]
		}
		l.fence = l.fences[0]
	}
	return l
}

// handOverLease is the lease a release hands this acquisition's waiter.
func (a *acquisition) handOverLease() time.Duration {
	if a.renewed {
		return min(a.ttl, renewedHandOver)
	}
	return a.ttl
}

// giveBack releases a's hold of the locks in keys (each followed by its queue), if
// any, handing each to its next waiter, and takes entry (a waiter that gives up, or
// "") out of their queues. It tries for at most a second, and never past the lease,
// after which the locks are free anyway.
func (c *Client) giveBack(ctx context.Context, a *acquisition, keys []string, entry string) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), min(a.ttl, time.Second))
	defer cancel()
	if a.limit > 1 {
		_, _ = c.semRelease(ctx, keys, a.id, entry, 0)
		return
	}
	_, _ = c.release(ctx, keys, a.id, entry)
}

// abandon releases whatever an attempt that ended in an error may have taken: the
// server may have applied it and lost the reply.
func (c *Client) abandon(ctx context.Context, a *acquisition) { c.giveBack(ctx, a, a.keys, "") }

// release runs release.lua: it unlocks the hold of identity id on the locks in keys
// (each followed by its queue) and hands each to its next waiter. A non-empty entry
// (a waiter that gives up) is first taken out of the queues, and a lock that had been
// handed to it is passed on. It returns 2 if any lock was released by force, else 0
// if any was not ours, else 1; where the locks live on several servers, one call per
// lock, all of them tried.
func (c *Client) release(ctx context.Context, keys []string, id, entry string) (int64, error) {
	res := int64(1)
	var errs error
	for i := 0; ; i++ {
		b, ok := c.batch(keys, 2, i)
		if !ok {
			break
		}
		r, err := releaseScript.Run(ctx, c.rdb, b,
			id, entry, c.channels, c.countsSubscribers, tombstoneMillis).Int64()
		switch {
		case err != nil:
			errs = errors.Join(errs, err)
		case r == 2 || (r == 0 && res == 1):
			res = r
		}
	}
	return res, errs
}

// describe is what a holder says about itself in the lock's value: host, process ID,
// HeldBy's name and id, separated by tabs, preceded by the text's length in
// idLenDigits decimal digits (see common.lua).
func (c *Client) describe(name, id string) string {
	return identity(c.self + name + "\t" + id)
}

func hostname() string {
	h, err := os.Hostname()
	if err != nil || h == "" {
		return "unknown"
	}
	return shortkey.Field(h)
}

// identity is how scripts name the holder of token: its length in idLenDigits
// decimal digits, then the token (see common.lua).
func identity(token string) string {
	n := strconv.Itoa(len(token))
	return strings.Repeat("0", idLenDigits-len(n)) + n + token
}

func (c *Client) redisKey(key string) string {
	return c.prefix + "{" + encodeKey(key) + "}"
}

// encodeKey maps every key to a distinct brace-free string of bounded length: '%',
// '{', '}' and '#' are percent-escaped, and an escaped key longer than maxKeyLen is
// cut to keepOfLong bytes followed by '#' and the hex SHA-256 of the whole key. Only
// digested keys contain a raw '#', so the two forms never meet.
func encodeKey(key string) string {
	esc := key
	if strings.ContainsAny(key, "%{}#") {
		var b strings.Builder
		b.Grow(len(key) + 16)
		for i := 0; i < len(key); i++ {
			switch ch := key[i]; ch {
			case '%', '{', '}', '#':
				b.WriteString(keyEscapes[ch])
			default:
				b.WriteByte(ch)
			}
		}
		esc = b.String()
	}
	if len(esc) <= maxKeyLen {
		return esc
	}
	head := esc[:keepOfLong]
	if i := strings.LastIndexByte(head[len(head)-2:], '%'); i >= 0 {
		head = head[:len(head)-2+i] // do not cut an escape in half
	}
	sum := sha256.Sum256([]byte(key))
	return head + "#" + hex.EncodeToString(sum[:])
}

var keyEscapes = map[byte]string{'%': "%25", '{': "%7B", '}': "%7D", '#': "%23"}

func newToken() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // never fails: crypto/rand panics rather than return an error
	return base64.RawURLEncoding.EncodeToString(b[:])
}
