package mutex

import (
	"crypto/rand"
	"crypto/sha1"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/asynqmutex/asynqmutex/internal/rediskey"
)

// This file is the one authority on what package mutex keeps in Redis: key names,
// the value of a lock, the hash of a lock with Limit(n), queue entries and the
// wake-up message. The Lua scripts (lua/) read and write the same layouts through the
// constants of luaLayout, which is generated from the ones below and starts every
// script; docs/protocol.md is the map for people.

// Key names. A lock's Redis key is prefix + "{" + rediskey.Encode(key) + "}"; everything
// else of the lock starts with it, so that it shares the lock's Redis Cluster slot.
const (
	// DefaultPrefix is the prefix of every Redis key and channel a Client uses unless
	// the Prefix option says otherwise.
	DefaultPrefix = "asynqmutex:"

	// waitSuffix names a plain lock's queue of waiters: a list of entries (below).
	waitSuffix = ":wait"
	// slotsSuffix names the queue of a lock with Limit(n). It is not a plain lock's,
	// so that a release of one kind never hands the key to a waiter of the other.
	slotsSuffix = ":slots"
	// releasedInfix names the key that marks, for tombstoneMillis, that an identity
	// released what it held of a lock and the lock then passed to another holder
	// (plain: a hand-over, or a new holder taking the releaser's tombstone; Limit(n):
	// every release): <lock> + releasedInfix + the hex SHA-1 of the identity, which a
	// script can compute (redis.sha1hex) and which shows no token. Its value is the
	// fence of what was released, so that the release, repeated after a lost reply,
	// is recognised however often the key changed hands since.
	releasedInfix = ":released:"
	// channelInfix: a Client listens for hand-overs on prefix + channelInfix + its
	// id, where id is base64url (no '.').
	channelInfix = "wake:"
)

// redisKey is the Redis key of the lock on key under prefix.
func redisKey(prefix, key string) string {
	return prefix + "{" + rediskey.Encode(key) + "}"
}

// releasedKey is the key that marks that identity id released what it held of the
// lock at rkey.
func releasedKey(rkey, id string) string {
	sum := sha1.Sum([]byte(id))
	return rkey + releasedInfix + hex.EncodeToString(sum[:])
}

// keyOf decodes the caller's key from a lock's Redis key under prefix.
func keyOf(prefix, rkey string) (key string, digested bool) {
	return rediskey.Decode(strings.TrimSuffix(strings.TrimPrefix(rkey, prefix+"{"), "}"))
}

// Counted texts. An identity (what scripts compare to tell holders apart) is a
// token's length in lenDigits decimal digits, then the token; a description (what a
// holder says of itself for people) is "<host>\t<pid>\t<name>\t<id>" counted the same
// way. Counting makes "our identity holds it" one comparison of a prefix, and keeps
// an identity from being read as a longer one.
const (
	lenDigits = 4

	// MaxTokenLen is the longest token the Token option accepts, in bytes: the
	// longest that lenDigits digits can count.
	MaxTokenLen = 9999
)

// counted is s preceded by its length in lenDigits decimal digits.
func counted(s string) string {
	n := strconv.Itoa(len(s))
	return strings.Repeat("0", lenDigits-len(n)) + n + s
}

// newToken is a random token: 128 bits, base64url (no '.').
func newToken() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // never fails: crypto/rand panics rather than return an error
	return base64.RawURLEncoding.EncodeToString(b[:])
}

// identity is how scripts name the holder of token.
func identity(token string) string { return counted(token) }

// describe is a holder's description: host and process (self, "<host>\t<pid>\t"),
// then HeldBy's name and id.
func describe(self, name, id string) string { return counted(self + name + "\t" + id) }

// cutCounted splits s after a counted text.
func cutCounted(s string) (text, rest string, ok bool) {
	if len(s) < lenDigits {
		return "", "", false
	}
	n, err := strconv.Atoi(s[:lenDigits])
	if err != nil || n < 0 || len(s) < lenDigits+n {
		return "", "", false
	}
	return s[lenDigits : lenDigits+n], s[lenDigits+n:], true
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

// The value of a plain lock is read at fixed places, so that scripts compare rather
// than parse (0-based offsets; the Lua ones are 1-based):
//
//	[0, 16)     the fence of the acquisition, fenceDigits decimal digits;
//	16          the state: held, held with waiters maybe queued (a release must
//	            look at the queue), or released: a tombstone kept tombstoneMillis
//	            so that a release repeated after a lost reply is recognised; every
//	            script treats a tombstone as a free lock;
//	[17, 33)    when the holder got the lock: server time in µs, 16 digits;
//	33...       the holder's identity (the releaser's, in a tombstone);
//	then        the holder's description; scripts never read it;
//	the rest    the identity of the holder that handed the lock over, or nothing, so
//	            that its release, repeated after a lost reply, is recognised; or
//	            forcedMark, the old holder's identity and the force release's (see
//	            ForceRelease), kept by the next holders too, so that the old holder's
//	            release learns what happened.
//
// A value of another form (set by hand) is held by nobody this package knows.
const (
	fenceDigits = 16
	stateAt     = fenceDigits
	sinceAt     = stateAt + 1
	idAt        = sinceAt + fenceDigits

	stateHeld     = 'h'
	stateWaited   = 'w'
	stateReleased = 'r'
	forcedMark    = '!'

	// tombstoneMillis is how long, in milliseconds, a released lock's tombstone and a
	// slot's release mark stay: longer than go-redis's retries of a lost reply last.
	tombstoneMillis = 10_000
)

// lockValue is a plain lock's value, read.
type lockValue struct {
	fence  int64
	state  byte
	since  int64 // server time in µs
	id     string
	holder Holder
	prev   string
}

// parseValue reads a lock value; ok is false for a value of another form.
func parseValue(v string) (lv lockValue, ok bool) {
	if len(v) < idAt+lenDigits {
		return lv, false
	}
	var err1, err2 error
	lv.fence, err1 = strconv.ParseInt(v[:fenceDigits], 10, 64)
	lv.state = v[stateAt]
	lv.since, err2 = strconv.ParseInt(v[sinceAt:idAt], 10, 64)
	id, rest, ok := cutCounted(v[idAt:])
	if err1 != nil || err2 != nil || !ok || !strings.ContainsRune("hwr", rune(lv.state)) {
		return lockValue{}, false
	}
	lv.id = v[idAt : idAt+lenDigits+len(id)]
	desc, prev, ok := cutCounted(rest)
	if !ok {
		return lockValue{}, false
	}
	lv.holder, lv.prev = parseDescription(desc), prev
	return lv, true
}

// A lock with Limit(n), n > 1, is a Redis HASH at the key a plain lock would use, so
// that the two kinds cannot be mixed unnoticed:
//
//	slotsLimit      n, the holders it admits at once;
//	slotsFence      the last fence issued;
//	slotHolder+id   one field per holder: "<lease end, server ms> <fence> <since,
//	                server µs> <description>".
//
// The hash expires with its longest lease; a holder whose lease ended is dropped by
// the next script that reads the hash. When the last holder leaves, the hash becomes a
// plain lock's tombstone, free to both kinds.
const (
	slotsLimit = "limit"
	slotsFence = "fence"
	slotHolder = "h"
)

// slotValue is a holder's field of a lock with Limit(n), read.
type slotValue struct {
	Slot
	end time.Time // lease end, on the server's clock
}

// parseSlot reads a holder's field value.
func parseSlot(v string) (slotValue, bool) {
	f := strings.SplitN(v, " ", 4)
	if len(f) < 4 {
		return slotValue{}, false
	}
	end, err1 := strconv.ParseInt(f[0], 10, 64)
	fence, err2 := strconv.ParseInt(f[1], 10, 64)
	since, err3 := strconv.ParseInt(f[2], 10, 64)
	if err1 != nil || err2 != nil || err3 != nil {
		return slotValue{}, false
	}
	s := slotValue{Slot: Slot{Fence: fence, Since: time.UnixMicro(since)}, end: time.UnixMilli(end)}
	if desc, _, ok := cutCounted(f[3]); ok {
		s.Holder = parseDescription(desc)
	}
	return s, true
}

// A queue entry is "<client>.<waiter> <lease> <identity><description>": the Client
// whose channel hears the hand-over, the waiter's id there, the lease in ms that a
// release hands it ("<ms>/<n>" in the queue of a lock with Limit(n)), and who it is.
// The head, up to the lease, is what an attempt passes to queue the waiter.

// entryHead is the head of a waiter's queue entry.
func entryHead(client, waiter string, lease time.Duration, limit int) string {
	h := client + "." + waiter + " " + strconv.FormatInt(lease.Milliseconds(), 10)
	if limit > 1 {
		h += "/" + strconv.Itoa(limit)
	}
	return h
}

// A parked entry stands in a lock's queue (a plain lock's, or the slots' queue of a
// lock with Limit(n)) for a task that waits in no process (Park): "<mark>.<ticket>
// <claim> <since> <identity><description>". The mark is
// parkedMark while the task waits and startedMark once a Starter was asked to start
// it ahead of its turn; ticket is what Park was given (no space); claim is the lease
// in ms a hand-over gives it, for its task to arrive and claim the lock; since is
// the server time in ms it parked; identity is parkedIdentity(ticket), which the lock
// holds while it is handed to the ticket, and description names the task (with no
// host or process: it runs nowhere yet). No Client id starts with a mark, so the
// scripts tell a parked entry from a waiter's by its first byte. The scripts write
// parked entries; Go passes the ticket, the claim and who it is.
const (
	parkedMark  = '~'
	startedMark = '^'
)

// replacedMark marks, in a script's reply, never in a queue, the ticket of a parked
// entry that left its line to make room for the caller (MaxLine with replace):
// "<i> <replacedMark><ticket>", among the tickets to start.
const replacedMark = '-'

// parkedIdentity is the identity a lock (or a slot: its field, slotHolder + the
// identity) holds while it is handed to ticket.
func parkedIdentity(ticket string) string { return identity(string(parkedMark) + ticket) }

// parkedDescription is the description of a parked entry, and of the lock handed to
// it: HeldBy's name and id, with no host or process.
func parkedDescription(by heldBy) string { return describe("\t\t", by.name, by.id) }

// parsedEntry is what a queue entry says, read.
type parsedEntry struct {
	Holder
	parked  bool      // a parked entry, started or not
	started bool      // a parked entry whose task was asked to start
	since   time.Time // with parked: when it parked, server time
	ticket  string    // with parked
}

// readEntry reads a queue entry, a waiter's or a parked one.
func readEntry(e string) parsedEntry {
	head, rest, _ := strings.Cut(e, " ")
	_, rest, _ = strings.Cut(rest, " ") // the lease
	var p parsedEntry
	if len(head) > 1 && (head[0] == parkedMark || head[0] == startedMark) && head[1] == '.' {
		p.parked, p.started, p.ticket = true, head[0] == startedMark, head[2:]
		var since string
		since, rest, _ = strings.Cut(rest, " ")
		if ms, err := strconv.ParseInt(since, 10, 64); err == nil {
			p.since = time.UnixMilli(ms)
		}
	}
	_, rest, ok := cutCounted(rest)
	if !ok {
		return p
	}
	desc, _, _ := cutCounted(rest)
	p.Holder = parseDescription(desc)
	return p
}

// The wake-up message, published on a Client's channel, is "<waiter> <fence>": the
// lock (or a slot) is that waiter's now, with that fence; or "<waiter> retry": the
// waiter was taken out of the queue without it, and should try again at once (it
// waited under another limit than the key's now).
const wakeRetry = "retry"

// parseWake reads a wake-up message: fence is 0 for wakeRetry.
func parseWake(payload string) (waiter string, fence int64, ok bool) {
	waiter, f, ok := strings.Cut(payload, " ")
	if !ok {
		return "", 0, false
	}
	if f == wakeRetry {
		return waiter, 0, true
	}
	fence, err := strconv.ParseInt(f, 10, 64)
	return waiter, fence, err == nil && fence > 0
}

// luaLayout declares the layout above to the Lua scripts, with 1-based offsets and
// bytes as string.byte gives them.
var luaLayout = fmt.Sprintf(`-- generated from layout.go: the layouts of lock values, hashes, entries and wake-ups
local FENCE_DIGITS = %d
local STATE_AT = %d
local SINCE_AT = %d
local ID_AT = %d
local LEN_DIGITS = %d
local NO_DESCRIPTION = %q -- a counted empty text
local HELD, WAITED, RELEASED, FORCED = %d, %d, %d, %d
local SLOTS_LIMIT, SLOTS_FENCE, SLOT_HOLDER = %q, %q, %q
local RELEASED_INFIX, TOMBSTONE_MILLIS = %q, %d
local WAKE_RETRY = %q
local PARKED, STARTED, REPLACED = %q, %q, %q
`, fenceDigits, stateAt+1, sinceAt+1, idAt+1, lenDigits, counted(""),
	stateHeld, stateWaited, stateReleased, forcedMark,
	slotsLimit, slotsFence, slotHolder,
	releasedInfix, tombstoneMillis, wakeRetry, string(parkedMark), string(startedMark), string(replacedMark))
