package ratelimit

import (
	"crypto/sha256"
	"encoding/base64"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/asynqmutex/asynqmutex/internal/rediskey"
)

// This file is the one authority on what package ratelimit keeps in Redis. The Lua
// scripts (lua/) read the same layout through the constants of luaLayout, which is
// generated from the ones below and starts every script; docs/protocol.md is the map
// for people.
//
// A limited key is one sorted set, prefix + "rate:{" + rediskey.Encode(key) + "}",
// whose members are:
//   - a start taken: its member is "<identity> <interval µs> <burst>", the call's
//     random identity (its first idChars characters), or for a named caller
//     (TakeAs) its name's digest (namedMember), and the limit it was taken under; its score is minus the key's theoretical arrival time (GCRA's TAT)
//     after it, in microseconds of server time. TATs rise with every start, so the
//     lowest score is minus the key's TAT, and a call sent again finds its own
//     member. A start is kept keepMicros after its TAT has passed.
//   - pauseMember, whose score is minus the TAT a pause leaves the key with, in
//     microseconds of server time.
//   - marks, with positive scores, so that no decision reads them as a TAT:
//     cancelledPrefix + a start's member, for a start given back (Cancel), and
//     resumedPrefix + a call's identity + " 0" or " 1", for a Resume and its answer,
//     each scored with the time it was made, in microseconds, so that a call
//     go-redis sends again after a lost reply answers as its first run did. A mark
//     is kept keepMicros, and the next mark forgets the older ones.
//
// Scores are negated so that the latest start is the set's first entry: Redis keeps a
// small sorted set as a listpack, in order, which ZADD scans from its head for the
// place of a new entry, and ZRANGE 0 0 reads the head. The set expires keepMicros
// after its last start's TAT or its pause's end.

const (
	// DefaultPrefix is the prefix of every Redis key a Limiter uses unless the
	// Prefix option says otherwise. It is the lock's (mutex.DefaultPrefix): a rate
	// key and a lock of one key share a Redis Cluster slot.
	DefaultPrefix = "asynqmutex:"

	rateInfix       = "rate:"
	pauseMember     = "~pause"
	cancelledPrefix = "~cancelled "
	resumedPrefix   = "~resumed "
	keepMicros      = int64(10 * time.Second / time.Microsecond)
)

// luaLayout defines the layout's constants for the scripts.
var luaLayout = fmt.Sprintf("local PAUSE = %q\nlocal CANCELLED = %q\nlocal RESUMED = %q\nlocal KEEP = %d\n",
	pauseMember, cancelledPrefix, resumedPrefix, keepMicros)

// redisKey is the Redis key of the limit on key under prefix.
func redisKey(prefix, key string) string {
	return prefix + rateInfix + "{" + rediskey.Encode(key) + "}"
}

// keyOf decodes the caller's key from a rate key under prefix.
func keyOf(prefix, rkey string) (key string, digested bool) {
	return rediskey.Decode(strings.TrimSuffix(strings.TrimPrefix(rkey, prefix+rateInfix+"{"), "}"))
}

// idChars is how much of a call's identity its member keeps: 11 base64 characters,
// 66 random bits. A member only tells apart the starts one key remembers (those of
// its last 10 to 20 seconds): the chance that two of 100,000 share one is under
// 10^-10, and if they do, the second is taken for a resend of the first, one start
// let through uncounted. A shorter member is cheaper for Redis to hash, copy and
// compare on every decision, and smaller to keep.
const idChars = 11

// member is the member of a start taken by the call with identity id under lim.
func member(id string, lim Rate) string {
	if len(id) > idChars {
		id = id[:idChars]
	}
	return id + " " + strconv.FormatInt(lim.interval(), 10) + " " + strconv.FormatInt(lim.burst(), 10)
}

// namedMember is the member of a start taken for the caller named id (TakeAs):
// id's SHA-256 digest, base64url, cut to idChars as a random identity is, so that
// ids that share a beginning (tickets of one queue) still differ.
func namedMember(id string, lim Rate) string {
	sum := sha256.Sum256([]byte(id))
	return member(base64.RawURLEncoding.EncodeToString(sum[:]), lim)
}

// memberLimit reads the spacing and burst of a start's member.
func memberLimit(m string) (interval time.Duration, burst int, ok bool) {
	f := strings.Fields(m)
	if len(f) != 3 {
		return 0, 0, false
	}
	us, err1 := strconv.ParseInt(f[1], 10, 64)
	b, err2 := strconv.Atoi(f[2])
	if err1 != nil || err2 != nil || us < 1 || b < 1 {
		return 0, 0, false
	}
	return time.Duration(us) * time.Microsecond, b, true
}
