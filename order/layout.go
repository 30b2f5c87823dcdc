package order

import (
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/asynqmutex/asynqmutex/internal/rediskey"
)

// This file is the one authority on what package order keeps in Redis. The Lua
// scripts (lua/) read the same layout through the constants of luaLayout, generated
// from the ones below, which starts every script; docs/protocol.md is the map for
// people.
//
// A key's sequence is one hash, prefix + "order:{" + rediskey.Encode(key) + "}", whose
// fields are:
//   - fieldEpoch: the server's time, in microseconds, when the sequence began; a
//     place carries it, so that a place of a forgotten sequence is not read as one of
//     a new sequence of the same key.
//   - fieldLast: the last place taken (0 before the first).
//   - fieldNext: the lowest place not finished: the place whose turn it is.
//   - fieldSkipped: how many places the key moved past without their task finishing.
//   - the place n, in decimal, for each place taken and not finished: its record,
//     "<µs taken> <queue> <task id>", or abandonedMark followed by a space and that
//     record when its producer could not enqueue the task.
//   - idPrefix followed by a task ID, for each such place: the place, so that a Take
//     that go-redis sends again after a lost reply finds the place its first run took.
//   - parkPrefix followed by a place, in decimal, for each place whose task parked
//     (Park) and was not started since: the ticket its caller gave, which the Finish
//     that makes the place the key's next returns, to be started; after startedMark
//     once a Finish (or StartAhead) returned it to be started, for its turn or ahead
//     of it: the mark stays until the place finishes, so that a Finish sent again
//     names it again.
//   - fieldParked: how many places have such a mark not flagged started.
//   - fieldHalted: "<place> <µs>", when the key halted at that place, its next: its
//     task failed for good under a key that halts (Finish with Halted). A gap rule
//     does not move past it (Skipped); its task's own finish (run again, it
//     completed) or a person's (Forced) does, and drops the field.
//
// The same name is the pub/sub channel on which Finish announces the key's new next
// place, as FormatPlace writes it, followed, when the place is taken, by " <µs now>
// <record>" (its holder, for waiters to judge without asking); and Requeue that the
// next place's task will run again later: the place as FormatPlace writes it, then
// requeuedSuffix. A sequence
// whose places are all finished expires after IdleKeep.
const (
	// DefaultPrefix is the prefix of every Redis key a Sequencer uses unless the
	// Prefix option says otherwise. It is the lock's (mutex.DefaultPrefix): a key's
	// sequence and its lock share a Redis Cluster slot.
	DefaultPrefix = "asynqmutex:"

	// IdleKeep is how long a key's sequence is kept once every place taken is
	// finished.
	IdleKeep = 24 * time.Hour

	orderInfix    = "order:"
	fieldEpoch    = "epoch"
	fieldLast     = "last"
	fieldNext     = "next"
	fieldSkipped  = "skipped"
	idPrefix      = "id:"
	parkPrefix    = "park:"
	fieldParked   = "parked"
	fieldHalted   = "halted"
	startedMark   = "^"
	abandonedMark = "-"
	// requeuedSuffix ends Requeue's announcement.
	requeuedSuffix = " requeued"
)

// luaLayout defines the layout's constants for the scripts.
var luaLayout = fmt.Sprintf("local EPOCH, LAST, NEXT, SKIPPED, IDP, PARKP, PARKED, HALTED, STARTED, ABANDONED, REQUEUED = %q, %q, %q, %q, %q, %q, %q, %q, %q, %q, %q\nlocal KEEP_MS = %d\n",
	fieldEpoch, fieldLast, fieldNext, fieldSkipped, idPrefix, parkPrefix, fieldParked, fieldHalted, startedMark, abandonedMark, requeuedSuffix, IdleKeep.Milliseconds())

// redisKey is the Redis key (and channel) of key's sequence under prefix.
func redisKey(prefix, key string) string {
	return prefix + orderInfix + "{" + rediskey.Encode(key) + "}"
}

// keyOf decodes the key from the Redis key of its sequence under prefix.
func keyOf(prefix, rkey string) (key string, digested bool) {
	return rediskey.Decode(strings.TrimSuffix(strings.TrimPrefix(rkey, prefix+orderInfix+"{"), "}"))
}

// record is what a place's field holds: when it was taken, and the task that holds it.
type record struct {
	taken     int64 // µs of server time
	queue, id string
	abandoned bool
}

// parseRecord reads a place's field; ok is false for an empty or malformed one.
func parseRecord(s string) (r record, ok bool) {
	if rest, cut := strings.CutPrefix(s, abandonedMark+" "); cut {
		r.abandoned, s = true, rest
	}
	f := strings.SplitN(s, " ", 3)
	if len(f) != 3 {
		return record{}, false
	}
	us, err := strconv.ParseInt(f[0], 10, 64)
	if err != nil {
		return record{}, false
	}
	r.taken, r.queue, r.id = us, f[1], f[2]
	return r, true
}

// String is the record as the place's field holds it.
func (r record) String() string {
	s := strconv.FormatInt(r.taken, 10) + " " + r.queue + " " + r.id
	if r.abandoned {
		s = abandonedMark + " " + s
	}
	return s
}

// announcement is what Finish and Requeue publish on a key's channel (layout.go).
type announcement struct {
	place    Place   // the key's new next place; or, requeued, the place whose task will run again
	requeued bool    // Requeue's
	holder   *Holder // the new next place's holder, when Finish named it
}

// parseAnnouncement reads an announcement; ok is false for anything else.
func parseAnnouncement(m string) (a announcement, ok bool) {
	head, rest, _ := strings.Cut(m, " ")
	if a.place, ok = ParsePlace(head); !ok {
		return a, false
	}
	switch {
	case rest == strings.TrimPrefix(requeuedSuffix, " "):
		a.requeued = true
	case rest != "":
		now, rec, _ := strings.Cut(rest, " ")
		if h := holder(rec, number(now)); h.TaskID != "" {
			a.holder = &h
		}
	}
	return a, true
}
