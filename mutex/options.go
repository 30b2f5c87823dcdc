package mutex

import (
	"fmt"
	"time"

	"github.com/asynqmutex/asynqmutex/internal/shortkey"
)

const (
	// MinTTL is the shortest lease a lock accepts. WithLock renews every ttl/3 and
	// allows 2ms and 1% for clock drift, so a shorter lease would leave a renewal too
	// little time to arrive before the lease ends.
	MinTTL = 20 * time.Millisecond

	// MaxTTL is the longest lease a lock accepts: seven days. Longer leases gain
	// nothing (WithLock renews while fn runs) and risk overflowing time arithmetic.
	MaxTTL = 7 * 24 * time.Hour

	// MaxLimit is the largest n Limit accepts. Every step of a lock with Limit(n) reads
	// all its holders in one script, so its Redis time grows with n (bench/README.md
	// has the figures).
	MaxLimit = 1000
)

// checkTTL rejects a lease outside [MinTTL, MaxTTL].
func checkTTL(ttl time.Duration) error {
	if ttl < MinTTL || ttl > MaxTTL {
		return fmt.Errorf("ttl %v outside [%v, %v] (MinTTL, MaxTTL)", ttl, MinTTL, MaxTTL)
	}
	return nil
}

// LockOption configures one acquisition in TryLock, Lock and WithLock (and their
// forms for several keys).
type LockOption interface{ applyLock(*lockConfig) }

type lockConfig struct {
	maxWait time.Duration // < 0: until the context is done
	token   string
	by      heldBy
	limit   int      // holders at once; > 1: slots (slots.go)
	park    *parking // Park: nil for none
	maxLine int      // MaxLine's n: 0 for no cap
	replace bool     // MaxLine's replace
	starter Starter  // StartWith: nil for none
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

// Limit lets up to n holders hold the lock on a key at once: a counting semaphore,
// for example at most 5 tasks of one tenant at a time. TryLock, Lock and WithLock
// take it; a set of keys takes plain locks only. Limit(1), like no Limit, is the plain
// lock. The default is 1.
//
// Each holder has a slot of its own: its own token, lease, renewal, HeldBy
// description and fence; fences increase across all holders of the key. Unlock frees
// the holder's slot and hands it to the waiter queued longest, as a plain lock's
// release hands over the lock, and lost replies are handled as for a plain lock.
//
// The limit belongs to the key while anyone holds it. An acquisition asking for
// another limit (a plain lock, or Limit(m) with m != n) fails with a *LimitError
// naming both limits, not ErrNotObtained; when nobody holds the key, the limit asked
// for becomes the key's. Inspect and List show every holder (Info.Slots);
// ForceRelease refuses a key held with Limit(n), n > 1.
//
// Every step reads all holders of the key in one script, so its Redis time grows
// with n. Limit panics if n is below 1 or above MaxLimit.
func Limit(n int) LockOption {
	if n < 1 || n > MaxLimit {
		panic(fmt.Sprintf("mutex.Limit: limit %d outside [1, %d] (MaxLimit)", n, MaxLimit))
	}
	return lockOptionFunc(func(c *lockConfig) { c.limit = n })
}
