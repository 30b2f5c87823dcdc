package mutex

import (
	"context"
	"errors"
	"fmt"
	"iter"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex/internal/shortkey"
)

// Holder is who holds, or waits for, a lock: what it recorded when it asked for it.
type Holder struct {
	// Name and ID are what HeldBy gave: for the asynqmutex middleware the task type
	// and the task ID. Empty without HeldBy.
	Name, ID string
	// Host is the holder's host name (os.Hostname), PID its process ID.
	Host string
	PID  int
}

// String describes h in one line, such as `payment:capture 3f2a… on web-1 (pid 812)`.
func (h Holder) String() string {
	var b strings.Builder
	b.WriteString(h.Name)
	if h.ID != "" {
		if b.Len() > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(h.ID)
	}
	if b.Len() > 0 {
		b.WriteByte(' ')
	}
	b.WriteString("on " + h.Host)
	if h.PID != 0 {
		b.WriteString(" (pid " + strconv.Itoa(h.PID) + ")")
	}
	return b.String()
}

// Info is the state of one lock, as Inspect, List and ForceRelease read it in one
// script call. It is a snapshot: the lock may have changed hands by the time it is read.
type Info struct {
	// Key is the caller's key, decoded from the Redis key. For a key longer than 256
	// bytes once escaped, the Redis key holds only its first 64 bytes and a digest,
	// and Key is those 64 bytes (Digested is then true): not a key to pass back.
	Key      string
	Digested bool
	// RedisKey is the Redis key of the lock; its queue of waiters is RedisKey + ":wait"
	// (RedisKey + ":slots" for a lock with Limit(n)).
	RedisKey string
	// Held reports whether anyone holds the lock. The fields below it describe the
	// holder. When the lock is not held, Fence and Since are those of the last holder
	// for 10 s after its release (0 and the zero time after that), and Holder is empty.
	Held bool
	// Foreign reports a value this package did not write (set by hand): the key counts
	// as held, but nothing else of it can be read.
	Foreign bool
	Holder  Holder
	// Since is when the holder got the lock, on the Redis server's clock, and HeldFor
	// how long ago that was when the lock was read, by the same clock.
	Since   time.Time
	HeldFor time.Duration
	// TTL is the lease left: how long until the lock frees itself unless renewed.
	// -1 means the key has no expiry (set by hand).
	TTL   time.Duration
	Fence int64
	// Waiting is how many waiters are queued, Waiters the first of them, oldest first
	// (Inspect fills it; List leaves it empty). A queued waiter whose process has died
	// stays listed until a release passes it over or the queue expires.
	Waiting int
	Waiters []Holder
	// Limit is n for a key held with Limit(n), n > 1, and 0 for a plain lock; Slots
	// then lists every holder, oldest fence first, and Holder, Fence, Since and
	// HeldFor describe the newest, while TTL is the longest lease left.
	Limit int
	Slots []Slot
}

// lockValue is a lock key's value read as common.lua documents it.
type lockValue struct {
	fence  int64
	state  byte // 'h', 'w' or 'r'
	since  int64
	id     string // identity: token length and token
	holder Holder
	prev   string
}

const (
	fenceEnd = 16               // bytes 1-16: the fence
	stateAt  = fenceEnd         // byte 17: the state, at index 16
	sinceEnd = stateAt + 1 + 16 // bytes 18-33: since, in microseconds
	idAt     = sinceEnd         // bytes 34-: identity, at index 33
)

// parseValue reads a lock value; ok is false for a value of another form.
func parseValue(v string) (lv lockValue, ok bool) {
	if len(v) < idAt+idLenDigits {
		return lv, false
	}
	var err1, err2 error
	lv.fence, err1 = strconv.ParseInt(v[:fenceEnd], 10, 64)
	lv.state = v[stateAt]
	lv.since, err2 = strconv.ParseInt(v[stateAt+1:sinceEnd], 10, 64)
	id, rest, ok := cutCounted(v[idAt:])
	if err1 != nil || err2 != nil || !ok || !strings.ContainsRune("hwr", rune(lv.state)) {
		return lockValue{}, false
	}
	lv.id = v[idAt : idAt+idLenDigits+len(id)]
	desc, prev, ok := cutCounted(rest)
	if !ok {
		return lockValue{}, false
	}
	lv.holder, lv.prev = parseDescription(desc), prev
	return lv, true
}

// cutCounted splits s after a text preceded by its length in idLenDigits digits.
func cutCounted(s string) (text, rest string, ok bool) {
	if len(s) < idLenDigits {
		return "", "", false
	}
	n, err := strconv.Atoi(s[:idLenDigits])
	if err != nil || n < 0 || len(s) < idLenDigits+n {
		return "", "", false
	}
	return s[idLenDigits : idLenDigits+n], s[idLenDigits+n:], true
}

// parseDescription reads what describe wrote; anything else (a value of an older
// format, whose tail may be a token) describes nobody.
func parseDescription(d string) Holder {
	f := strings.SplitN(d, "\t", 4)
	if len(f) < 4 {
		return Holder{}
	}
	pid, _ := strconv.Atoi(f[1])
	return Holder{Host: f[0], PID: pid, Name: f[2], ID: f[3]}
}

// parseEntry reads a queue entry as lock.lua writes it: "<client>.<waiter> <lease ms>
// <identity><description>" (the lease "<ms>/<limit>" for Limit(n), sem_lock.lua).
func parseEntry(e string) Holder {
	_, rest, _ := strings.Cut(e, " ")
	_, rest, _ = strings.Cut(rest, " ")
	_, rest, ok := cutCounted(rest)
	if !ok {
		return Holder{}
	}
	desc, _, _ := cutCounted(rest)
	return parseDescription(desc)
}

// maxListedWaiters is how many waiters Inspect returns.
const maxListedWaiters = 100

// Inspect reads the lock on key and up to its first 100 waiters, changing nothing. A
// key nobody holds gives an Info with Held false (and no error). It returns a wrapped
// Redis error when Redis cannot be reached. Safe for concurrent use.
func (c *Client) Inspect(ctx context.Context, key string) (Info, error) {
	if key == "" {
		return Info{}, errors.New("mutex: empty key")
	}
	rkey := c.redisKey(key)
	res, err := inspectScript.Run(ctx, c.rdb, []string{rkey, rkey + waitSuffix}, maxListedWaiters).Slice()
	if isWrongType(err) {
		return c.semInspect(ctx, key) // held with Limit(n): semaphore.go
	}
	if err != nil {
		return Info{}, fmt.Errorf("mutex: inspect %s: %w", shortkey.Quote(key), err)
	}
	return c.info(rkey, res)
}

// info reads inspect.lua's reply about the lock at Redis key rkey.
func (c *Client) info(rkey string, res []any) (Info, error) {
	if len(res) < 5 {
		return Info{}, fmt.Errorf("mutex: inspect %s: unexpected reply %v", shortkey.Quote(rkey), res)
	}
	in := Info{RedisKey: rkey}
	in.Key, in.Digested = c.keyOf(rkey)
	v, _ := res[0].(string)
	pttl, _ := res[1].(int64)
	waiting, _ := res[2].(int64)
	in.Waiting = int(waiting)
	entries, _ := res[3].([]any)
	for _, e := range entries {
		s, _ := e.(string)
		in.Waiters = append(in.Waiters, parseEntry(s))
	}
	now := serverTime(res[4])
	if v == "" {
		return in, nil
	}
	in.TTL = time.Duration(pttl) * time.Millisecond
	if pttl < 0 {
		in.TTL = -1
	}
	lv, ok := parseValue(v)
	if !ok {
		in.Held, in.Foreign = true, true
		return in, nil
	}
	in.Held = lv.state != 'r'
	in.Fence, in.Holder, in.Since = lv.fence, lv.holder, time.UnixMicro(lv.since)
	if !now.IsZero() {
		in.HeldFor = max(now.Sub(in.Since), 0)
	}
	if !in.Held {
		in.TTL = 0 // the tombstone's own expiry is no lease
	}
	return in, nil
}

// serverTime reads the reply of Redis's TIME, or returns the zero time.
func serverTime(reply any) time.Time {
	t, _ := reply.([]any)
	if len(t) != 2 {
		return time.Time{}
	}
	sec, err1 := strconv.ParseInt(fmt.Sprint(t[0]), 10, 64)
	usec, err2 := strconv.ParseInt(fmt.Sprint(t[1]), 10, 64)
	if err1 != nil || err2 != nil {
		return time.Time{}
	}
	return time.Unix(sec, usec*1000)
}

// keyOf decodes the caller's key from a Redis key of this Client (see encodeKey).
func (c *Client) keyOf(rkey string) (key string, digested bool) {
	enc := strings.TrimSuffix(strings.TrimPrefix(rkey, c.prefix+"{"), "}")
	if i := strings.IndexByte(enc, '#'); i >= 0 {
		enc, digested = enc[:i], true
	}
	return keyUnescaper.Replace(enc), digested
}

// keyUnescaper undoes keyEscapes in one pass from left to right, so that an escaped
// '%' is never read as the start of another escape.
var keyUnescaper = strings.NewReplacer("%25", "%", "%7B", "{", "%7D", "}", "%23", "#")

// List yields every lock key of the Client's prefix that is held, in no particular
// order, reading them SCAN batch by batch with one pipelined script call per batch
// (with a Cluster client, every master is scanned in turn; a single-node client
// pointed at one Cluster node sees that node's keys only). Waiters holds no entries;
// Waiting counts them. A lock taken or released while List runs may or may not be
// yielded. Iteration stops at the first error, which is yielded with a zero Info. Safe
// for concurrent use.
func (c *Client) List(ctx context.Context) iter.Seq2[Info, error] {
	return func(yield func(Info, error) bool) {
		scan := func(ctx context.Context, rdb redis.UniversalClient) error {
			if err := c.scan(ctx, rdb, "string", waitSuffix, inspectScript, c.info, yield); err != nil {
				return err
			}
			return c.scan(ctx, rdb, "hash", semWaitSuffix, semInspectScript, c.semInfo, yield) // keys held with Limit(n): semaphore.go
		}
		nodes := []redis.UniversalClient{c.rdb}
		var err error
		if cc, ok := c.rdb.(*redis.ClusterClient); ok {
			// ForEachMaster runs its function on every master at once; yield must not
			// be called concurrently, so collect the masters and scan them in turn.
			var mu sync.Mutex
			nodes = nodes[:0]
			err = cc.ForEachMaster(ctx, func(_ context.Context, node *redis.Client) error {
				mu.Lock()
				nodes = append(nodes, node)
				mu.Unlock()
				return nil
			})
		}
		for _, node := range nodes {
			if err != nil {
				break
			}
			err = scan(ctx, node)
		}
		if err != nil && !errors.Is(err, errStopList) {
			yield(Info{}, fmt.Errorf("mutex: list: %w", err))
		}
	}
}

var errStopList = errors.New("mutex: list stopped")

// scan is List's scan of the keys of Redis type typ (a plain lock's string, or the
// hash of a lock with Limit(n)) on one node: script reads each of them with its queue
// (the key + wait), and info makes its Info.
func (c *Client) scan(ctx context.Context, rdb redis.UniversalClient, typ, wait string, script *redis.Script,
	info func(rkey string, res []any) (Info, error), yield func(Info, error) bool) error {
	match := escapeGlob(c.prefix) + "{*}"
	var cursor uint64
	for {
		keys, next, err := rdb.ScanType(ctx, cursor, match, 200, typ).Result()
		if err != nil {
			return err
		}
		if len(keys) > 0 {
			pipe := rdb.Pipeline()
			cmds := make([]*redis.Cmd, len(keys))
			for i, k := range keys {
				cmds[i] = script.EvalSha(ctx, pipe, []string{k, k + wait}, 0)
			}
			_, _ = pipe.Exec(ctx)
			if redis.HasErrorPrefix(cmds[0].Err(), "NOSCRIPT") {
				if err := script.Load(ctx, rdb).Err(); err != nil {
					return err
				}
				continue // the same cursor again, now that the script is loaded
			}
			for i, cmd := range cmds {
				res, err := cmd.Slice()
				if err != nil {
					return fmt.Errorf("%s: %w", shortkey.Quote(keys[i]), err)
				}
				in, err := info(keys[i], res)
				if err != nil {
					return err
				}
				if in.Held && !yield(in, nil) {
					return errStopList
				}
			}
		}
		if cursor = next; cursor == 0 {
			return nil
		}
	}
}

// escapeGlob escapes the characters SCAN's MATCH gives meaning to.
func escapeGlob(s string) string {
	var b strings.Builder
	for _, r := range s {
		if strings.ContainsRune(`*?[]\`, r) {
			b.WriteByte('\\')
		}
		b.WriteRune(r)
	}
	return b.String()
}

// Released is what ForceRelease did.
type Released struct {
	// Before is the lock as it was, its waiters counted but not listed. Before.Held
	// is false when nobody held it: then nothing changed.
	Before Info
	// Fence is the fence of the waiter the lock was handed to, HandedTo what that
	// waiter recorded about itself; 0 and empty when the lock became free.
	Fence    int64
	HandedTo Holder
	// Repeated reports that Redis had already applied this call: its reply was lost
	// and go-redis sent it again. Then Before, Fence and HandedTo are not known (Before
	// is zero but for its keys), and the repeat changed nothing.
	Repeated bool
}

// ForceRelease frees the lock on key whoever holds it, for an operator unsticking a
// key whose holder hangs while renewing. It hands the lock to the longest-queued
// waiter, as a release does, or leaves it free. Afterwards the old holder's token
// holds nothing: its Extend and Unlock return ErrNotHeld, WithLock cancels its fn at
// its next renewal (within ttl/3), and every later holder's fence is higher than
// its own, so a resource that checks fences rejects its late writes. A value not of
// this package's form (set by hand) is deleted. One exception: a key that a waiting
// set of keys keeps (see LockKeys) is taken again by that waiter's next attempt,
// within a third of its lease, as nothing of the set has run yet; to free it for
// good, stop the waiting task, or free the key it waits for. A key held with
// Limit(n), n > 1, is refused with an error naming the limit and its holders while
// any lease runs (a key whose every lease ended is freed).
//
// A wrapped Redis error means nothing is known. A call whose reply was lost and that
// go-redis sent again recognises its own release (Repeated) and changes nothing more:
// it never takes the lock from the waiter it was handed to. Safe for
// concurrent use.
func (c *Client) ForceRelease(ctx context.Context, key string) (Released, error) {
	if key == "" {
		return Released{}, errors.New("mutex: empty key")
	}
	return c.forceRelease(ctx, key, true)
}

// forceRelease is ForceRelease; sem says whether a key held with Limit(n) is to be
// looked at (once: semForceRelease calls it again without).
func (c *Client) forceRelease(ctx context.Context, key string, sem bool) (Released, error) {
	rkey := c.redisKey(key)
	res, err := forceScript.Run(ctx, c.rdb, []string{rkey, rkey + waitSuffix},
		identity("force:"+newToken()), c.channels, c.countsSubscribers, tombstoneMillis).Slice()
	if isWrongType(err) && sem {
		return c.semForceRelease(ctx, key) // held with Limit(n): semaphore.go
	}
	if err == nil && len(res) != 7 {
		err = fmt.Errorf("unexpected reply %v", res)
	}
	if err != nil {
		return Released{}, fmt.Errorf("mutex: force release %s: %w", shortkey.Quote(key), err)
	}
	var r Released
	r.Repeated = res[6] == int64(1)
	if r.Before, err = c.info(rkey, res); err != nil {
		return Released{}, err
	}
	if after, ok := res[5].(string); ok {
		if lv, ok := parseValue(after); ok {
			r.Fence, r.HandedTo = lv.fence, lv.holder
		}
	}
	return r, nil
}
