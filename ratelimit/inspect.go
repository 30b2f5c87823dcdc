package ratelimit

import (
	"context"
	"fmt"
	"iter"
	"time"

	"github.com/asynqmutex/asynqmutex/internal/store"
)

// State is what Redis holds for a limited key, for people (the asynqmutex command
// shows it). It is a snapshot: starts taken after it change it.
type State struct {
	Key      string // the key, decoded from its Redis key
	Digested bool   // Key holds only the first bytes of a long key (see mutex.Info)
	RedisKey string // the sorted set that holds the key's starts (docs/protocol.md)

	// Interval and Burst are the limit of the latest start (its N per Per is one start
	// every Interval); zero when no start is remembered.
	Interval time.Duration
	Burst    int
	// Remaining is how many starts could begin at once now under that limit; Next is
	// how long until one could (0 when Remaining > 0); Full is how long until the key
	// is idle again, every start of its burst available.
	Remaining  int
	Next, Full time.Duration
	// Paused is how long the key's pause still lasts, as read under the latest
	// start's limit (a pause is kept as the TAT it leaves the key with); 0 without
	// one.
	Paused time.Duration
	// Starts is the number of starts remembered: those of the last 10 to 20
	// seconds and those reserved ahead (with a mark for each start given back and
	// each Resume of that time, which the count includes).
	Starts int
	// Ahead is how many of Starts begin later than now: starts reserved for
	// callers that wait for them (tasks parked until their start, callers asleep
	// in Take), as read under the latest start's limit; LastDue is how long until
	// the last of them begins (0 without one).
	Ahead   int
	LastDue time.Duration
}

// Inspect returns key's state. A key never limited, or idle long enough to be
// forgotten, has a zero State but for Key. Safe for concurrent use.
func (l *Limiter) Inspect(ctx context.Context, key string) (State, error) {
	rkey := redisKey(l.prefix, key)
	res, err := l.run.Run(ctx, inspectScript, []string{rkey}).Slice()
	if err != nil {
		return State{}, fmt.Errorf("ratelimit: inspect %s: %w", show(key), err)
	}
	st, err := l.state(rkey, res)
	st.Key, st.Digested = key, false
	return st, err
}

// state reads inspect.lua's reply on the key at rkey.
func (l *Limiter) state(rkey string, res []any) (State, error) {
	st := State{RedisKey: rkey}
	st.Key, st.Digested = keyOf(l.prefix, rkey)
	if len(res) != 6 {
		return st, fmt.Errorf("ratelimit: inspect %s: unexpected reply %v", show(st.Key), res)
	}
	now, pause, score := number(res[0]), number(res[1]), number(res[3])
	latest, _ := res[2].(string)
	st.Starts, st.Ahead = int(number(res[4])), int(number(res[5]))
	interval, burst, ok := memberLimit(latest)
	if !ok { // no start remembered: the pause alone, read as under a burst of 1
		interval, burst = time.Microsecond, 1
	} else {
		st.Interval, st.Burst = interval, burst
	}
	iv := int64(interval / time.Microsecond)
	tau := int64(burst) * iv
	if ends := pause - tau + iv; ends > now {
		st.Paused = micros(ends - now)
	}
	tat := max(score, pause, now)
	st.Full = micros(tat - now)
	if st.Ahead > 0 {
		st.LastDue = micros(max(score-tau-now, 0))
	}
	if ok {
		st.Remaining = int(max((now+tau-tat)/iv, 0))
	}
	if st.Remaining == 0 && tat > now {
		st.Next = micros(tat + iv - tau - now)
	}
	return st, nil
}

// List yields the state of every limited key of the Limiter's prefix that Redis
// still remembers, in no particular order, reading them SCAN batch by batch with one
// pipelined script call per key (every master of a Cluster in turn). Iteration stops
// at the first error, which is yielded with a zero State. Safe for concurrent use.
func (l *Limiter) List(ctx context.Context) iter.Seq2[State, error] {
	return store.List(ctx, l.run, "ratelimit: list", store.EscapeGlob(l.prefix+rateInfix)+"{*}", "zset", inspectScript,
		func(rkey string) []string { return []string{rkey} }, nil,
		func(rkey string, reply []any) (State, bool, error) {
			st, err := l.state(rkey, reply)
			return st, err == nil, err
		})
}

func number(v any) int64 {
	switch n := v.(type) {
	case int64:
		return n
	case string:
		var x int64
		_, _ = fmt.Sscan(n, &x)
		return x
	}
	return 0
}
