package order

import (
	"context"
	"fmt"
	"iter"
	"strconv"
	"strings"
	"time"

	"github.com/asynqmutex/asynqmutex/internal/store"
)

// State is what Redis holds for a key's sequence, for people: a snapshot.
type State struct {
	Key      string // the key
	Digested bool   // List only: Key holds only the first bytes of a long key (see mutex.Info)
	RedisKey string // the hash that holds the sequence, and its channel (docs/protocol.md)
	Epoch    string // when the sequence began, in µs of server time; "" for a key without one
	// Next is the place whose turn it is, Last the last place taken: Last-Next+1
	// places are taken and not finished (none when Next > Last).
	Next, Last int64
	// Skipped is how many places the key moved past without their task finishing.
	Skipped int64
	// Holder is the task that holds Next, while Next <= Last.
	Holder Holder
	// Parked is how many of the places waiting have their task parked (Park): in no
	// process, to be started when its turn comes.
	Parked int64
	// Halted is the place the key halted at (Finish with Halted: its task failed
	// for good), 0 when it did not; HaltedFor is how long ago it halted.
	Halted    int64
	HaltedFor time.Duration
}

// Waiting is how many places are taken and not finished.
func (st State) Waiting() int64 { return max(st.Last-st.Next+1, 0) }

// Inspect returns key's sequence, in one read-only script call. A key without one (never
// given a place, or forgotten after IdleKeep) has a zero State but for Key and
// RedisKey. Safe for concurrent use.
func (s *Sequencer) Inspect(ctx context.Context, key string) (State, error) {
	rkey := redisKey(s.prefix, key)
	res, err := s.run.Run(ctx, inspectScript, []string{rkey}).Slice()
	if err != nil {
		return State{Key: key, RedisKey: rkey}, fmt.Errorf("order: inspect %s: %w", show(key), err)
	}
	st, err := state(rkey, res)
	st.Key = key
	return st, err
}

// List yields the sequence of every key of the Sequencer's prefix that has one, in no
// particular order, reading them SCAN batch by batch with one pipelined script call
// per key (every master of a Cluster in turn). A key longer than 256 bytes once
// escaped is yielded by its first 64 bytes, Digested. Iteration stops at the first
// error, which is yielded with a zero State. Safe for concurrent use.
func (s *Sequencer) List(ctx context.Context) iter.Seq2[State, error] {
	return store.List(ctx, s.run, "order: list", store.EscapeGlob(s.prefix+orderInfix)+"{*}", "hash", inspectScript,
		func(rkey string) []string { return []string{rkey} }, nil,
		func(rkey string, reply []any) (State, bool, error) {
			st, err := state(rkey, reply)
			st.Key, st.Digested = keyOf(s.prefix, rkey)
			return st, err == nil && st.Epoch != "", err
		})
}

// state reads inspect.lua's reply about the sequence at Redis key rkey.
func state(rkey string, res []any) (State, error) {
	st := State{RedisKey: rkey}
	if len(res) != 8 {
		return st, fmt.Errorf("order: inspect %s: unexpected reply %v", show(rkey), res)
	}
	st.Epoch, _ = res[0].(string)
	st.Next, st.Last, st.Skipped, st.Parked = number(res[1]), number(res[2]), number(res[3]), number(res[6])
	now := number(res[5])
	if rec, _ := res[4].(string); rec != "" {
		st.Holder = holder(rec, now)
	}
	if h, _ := res[7].(string); h != "" {
		place, at, _ := strings.Cut(h, " ")
		st.Halted, _ = strconv.ParseInt(place, 10, 64)
		if us, err := strconv.ParseInt(at, 10, 64); err == nil {
			st.HaltedFor = time.Duration(max(now-us, 0)) * time.Microsecond
		}
		st.Holder.Halted = st.Halted == st.Next
	}
	return st, nil
}
