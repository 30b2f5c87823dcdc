package mutex

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/asynqmutex/asynqmutex/internal/shortkey"
)

var (
	// ErrNotObtained means another holder has the lock: at once for TryLock, or for
	// the whole wait of Lock and WithLock. When the wait ended because the context was
	// done, the error returned wraps both ErrNotObtained and ctx.Err(), as
	// errors.Join does, with its text on one line.
	ErrNotObtained = errors.New("mutex: not obtained")

	// ErrNotHeld means the lock is no longer ours: its lease expired or another token
	// holds the key. Unlock and Extend return it (wrapped) and change nothing; WithLock
	// returns it (wrapped) when the lease was lost while fn ran.
	ErrNotHeld = errors.New("mutex: not held")
)

// ErrLineFull is joined with ErrNotObtained when an acquisition with MaxLine found
// its key busy and its line full: it neither waits nor parks, and nothing changed in
// the line.
var ErrLineFull = errors.New("mutex: the key's line is full")

// lineFullError is ErrNotObtained joined with ErrLineFull, naming the key and the
// cap.
type lineFullError struct {
	key string
	n   int
}

func (e *lineFullError) Error() string {
	return fmt.Sprintf("mutex: not obtained: lock %s is busy and its line holds %d or more (MaxLine)", show(e.key), e.n)
}

func (e *lineFullError) Unwrap() []error { return []error{ErrNotObtained, ErrLineFull} }

// errForced is why an Unlock finds the lock gone when ForceRelease took it.
var errForced = errors.New("the lock was released by force (ForceRelease) while held")

// LimitError is the error of an acquisition that asked for a key with another limit
// than the one its holders use (see Limit). Nothing changed in Redis. A plain lock
// counts as Limit(1).
type LimitError struct {
	Key   string // the key as the caller gave it
	Held  int    // the limit of the key's holders
	Asked int    // the limit asked for
}

// Error names the key (shortened past 100 bytes) and both limits.
func (e *LimitError) Error() string {
	return fmt.Sprintf("mutex: lock %s: held with %s, asked with %s; every holder of a key must use the same limit while it is held",
		show(e.Key), limitText(e.Held), limitText(e.Asked))
}

func limitText(n int) string {
	if n <= 1 {
		return "no Limit (a plain lock)"
	}
	return "Limit(" + strconv.Itoa(n) + ")"
}

// BusyKey returns the key another holder had when TryLockKeys, LockKeys or
// WithLockKeys returned err, an error wrapping ErrNotObtained: of the keys found
// busy, the first in the order they are taken. It reports false for any other
// error, and for an acquisition of one key, whose key the caller knows.
func BusyKey(err error) (key string, ok bool) {
	var be *busyError
	if errors.As(err, &be) {
		return be.key, true
	}
	return "", false
}

// busyError is ErrNotObtained (joined with the context's error, if any) from an
// acquisition of several keys, naming the key that was busy.
type busyError struct {
	key string
	err error
}

func (e *busyError) Error() string {
	if e.err == ErrNotObtained {
		return "mutex: not obtained: key " + show(e.key) + " is held"
	}
	return "mutex: not obtained, key " + show(e.key) + " being held: " + oneLine(e.err)
}

func (e *busyError) Unwrap() error { return e.err }

// LeaseLeft returns, for err from an acquisition that parked (an error wrapping
// ErrParked, see Park), how long the lease of the key's holder had left when it
// parked: with Limit(n), of the holder whose lease ends first. It is negative when
// the key has no expiry (set by hand). Whoever knows that no attempt will come
// meanwhile calls Serve when it has passed. It reports false for any other error,
// nil included. A pure function: safe for concurrent use.
func LeaseLeft(err error) (time.Duration, bool) {
	var pe *parkedError
	if errors.As(err, &pe) {
		return pe.left, true
	}
	return 0, false
}

// parkedError is ErrNotObtained joined with ErrParked, from an acquisition that
// parked, with the lease left of the holder it parked behind.
type parkedError struct{ left time.Duration }

func (e *parkedError) Error() string   { return ErrNotObtained.Error() + "; " + ErrParked.Error() }
func (e *parkedError) Unwrap() []error { return []error{ErrNotObtained, ErrParked} }

// show is a key as errors show it: as it is up to 100 bytes, shortened with a digest
// past that, and quoted only when it holds characters that are not printable, so that
// a key built from JSON reads as it was written, not escaped twice.
func show(key string) string { return shortkey.Show(key) }

// showKeys is key, or keys when there are several, as errors show them.
func showKeys(key string, keys []string) string {
	if keys == nil {
		return show(key)
	}
	q := make([]string, len(keys))
	for i, k := range keys {
		q[i] = show(k)
	}
	return "keys " + strings.Join(q, ", ")
}

// oneLine is err's text on one line: errors.Join puts its errors on lines of their
// own, which a log line or asynq's LastErr would carry as they are.
func oneLine(err error) string { return strings.ReplaceAll(err.Error(), "\n", "; ") }

// join is errors.Join with its text on one line, the errors separated by "; ".
func join(errs ...error) error {
	j := errors.Join(errs...)
	if j == nil {
		return nil
	}
	return &joinError{errs: j.(interface{ Unwrap() []error }).Unwrap()}
}

type joinError struct{ errs []error }

func (e *joinError) Error() string {
	s := make([]string, len(e.errs))
	for i, err := range e.errs {
		s[i] = oneLine(err)
	}
	return strings.Join(s, "; ")
}

func (e *joinError) Unwrap() []error { return e.errs }
