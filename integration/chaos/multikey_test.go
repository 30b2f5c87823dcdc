//go:build unix

package chaos

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex/mutex"
)

// Several keys taken as one lock (WithLockKeys): worker processes take random,
// overlapping sets of keys in random order, some workers mixing in single-key
// WithLock calls on the same keys, and run the checked section on every key of the
// set. The checkers are the battery's, per key; a set's acquire and release are an
// acquire and a release on each of its keys, at the same times. A further checker
// bounds every call, so a deadlock shows as calls that end with their deadline.

// setCallBound is the deadline of each call in TestSetsUnderContention: generous, a
// thousand times a section's length, so that only a deadlock (or a machine stalled for
// seconds) reaches it.
const setCallBound = 10 * time.Second

// controlCallBound is the deadline of each call in the deadlock control: short, so
// the control is fast, yet hundreds of sections long.
const controlCallBound = 2 * time.Second

func init() {
	registerWorkerMode("sets", setMode(takeWithLockKeys, setCallBound, true, false))
	registerWorkerMode("sets-short", setMode(takeWithLockKeys, controlCallBound, false, false))
	registerWorkerMode("sets-unordered", setMode(takeUnordered, controlCallBound, false, true))
	registerWorkerMode("sets-first-only", setMode(takeFirstOnly, setCallBound, false, false))
}

// A setTaker holds keys (distinct) as one lock while fn runs and passes fn the
// fence of each key, in the order of keys. given is keys as the caller wrote them,
// possibly with repeats. It returns what WithLock would: the error of taking the
// lock, or fn's.
type setTaker func(ctx context.Context, p *Proc, given, keys []string, fn func(ctx context.Context, fences []int64) error) error

// takeWithLockKeys is the lock under test.
func takeWithLockKeys(ctx context.Context, p *Proc, given, keys []string, fn func(ctx context.Context, fences []int64) error) error {
	return p.Locks.WithLockKeys(ctx, given, p.Spec.TTL, func(ctx context.Context) error {
		l, ok := mutex.FromContext(ctx)
		if !ok {
			return errors.New("WithLockKeys: no lock in fn's context")
		}
		if got := l.Keys(); !slices.Equal(got, keys) {
			return fmt.Errorf("Keys() = %q for %q, want %q", got, given, keys)
		}
		return fn(ctx, l.Fences())
	})
}

// takeSingle is WithLock on the set's one key.
func takeSingle(ctx context.Context, p *Proc, _, keys []string, fn func(ctx context.Context, fences []int64) error) error {
	return p.Locks.WithLock(ctx, keys[0], p.Spec.TTL, func(ctx context.Context) error {
		l, _ := mutex.FromContext(ctx)
		return fn(ctx, []int64{l.Fence()})
	})
}

// takeUnordered is a deliberately broken lock of several keys, for the deadlock
// control: it takes the keys one at a time with Lock, in the order given, waiting for
// each while it holds the ones before. Two callers that want A and B in opposite
// orders each hold one and wait for the other until their deadlines.
func takeUnordered(ctx context.Context, p *Proc, _, keys []string, fn func(ctx context.Context, fences []int64) error) error {
	held := make([]*mutex.Lock, 0, len(keys))
	release := func() error {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		var errs []error
		for _, l := range held {
			errs = append(errs, l.Unlock(rctx))
		}
		return errors.Join(errs...)
	}
	fences := make([]int64, 0, len(keys))
	for _, k := range keys {
		l, err := p.Locks.Lock(ctx, k, p.Spec.TTL)
		if err != nil {
			return errors.Join(fmt.Errorf("waiting for %s while holding %d keys: %w", k, len(held), err), release())
		}
		held = append(held, l)
		fences = append(fences, l.Fence())
	}
	err := fn(ctx, fences)
	return errors.Join(err, release())
}

// takeFirstOnly is a deliberately broken lock of several keys, for the occupancy and
// linearizability control: it locks only the first key and hands fn its fence for
// every key.
func takeFirstOnly(ctx context.Context, p *Proc, _, keys []string, fn func(ctx context.Context, fences []int64) error) error {
	return p.Locks.WithLock(ctx, keys[0], p.Spec.TTL, func(ctx context.Context) error {
		l, _ := mutex.FromContext(ctx)
		fences := make([]int64, len(keys))
		for i := range fences {
			fences[i] = l.Fence()
		}
		return fn(ctx, fences)
	})
}

// setMode returns a worker mode that makes Spec.Sections calls, each taking a random
// set of 2 to 4 of Spec.Keys in random order with take under a deadline of bound,
// and running the checked section on every key of the set. With singles, workers 1
// and 2 make every other call a WithLock on one key. With stopAtTimeout a worker
// stops after its first call that reaches its deadline (a control needs only one);
// otherwise such calls are recorded and the worker goes on.
func setMode(take setTaker, bound time.Duration, singles, stopAtTimeout bool) func(ctx context.Context, p *Proc) error {
	return func(ctx context.Context, p *Proc) error {
		for i := 0; i < p.Spec.Sections; i++ {
			if ctx.Err() != nil {
				return fmt.Errorf("lifetime ended after %d of %d calls", i, p.Spec.Sections)
			}
			given, keys, taker := p.pickSet(take, singles && p.Spec.ID <= 2 && i%2 == 1)
			cctx, cancel := context.WithTimeout(ctx, bound)
			var secErr error
			p.Rec.WithSet(cctx, p, given, keys, taker, func(ctx context.Context, fences []int64, writer string) ([]SectionResult, error) {
				res, err := p.Ref.SetSection(ctx, keys, fences, writer, p.Spec.Section, p.Rand)
				secErr = err
				return res, err
			})
			timedOut := cctx.Err() != nil
			cancel()
			if secErr != nil {
				return secErr
			}
			if timedOut && stopAtTimeout {
				return nil
			}
		}
		return nil
	}
}

// pickSet picks the keys of the next call: one key for WithLock when single,
// otherwise 2 to 4 distinct keys in random order, written with a repeat one time in
// eight in the "sets" mode (a key given twice is locked once).
func (p *Proc) pickSet(take setTaker, single bool) (given, keys []string, taker setTaker) {
	pool := p.Spec.Keys
	if single {
		k := pool[p.Rand.IntN(len(pool))]
		return []string{k}, []string{k}, takeSingle
	}
	n := 2 + p.Rand.IntN(min(4, len(pool))-1)
	for _, j := range p.Rand.Perm(len(pool))[:n] {
		keys = append(keys, pool[j])
	}
	given = keys
	if p.Spec.Mode == "sets" && p.Rand.IntN(8) == 0 {
		given = append(slices.Clone(keys), keys[p.Rand.IntN(n)])
	}
	return given, keys, take
}

// WithSet calls take and records the call as one Attempt per key of keys, all with
// one ID and the same times: the set's acquire is an acquire of each key, its
// release a release of each. fn's results are the sections of keys, in order.
func (r *Recorder) WithSet(ctx context.Context, p *Proc, given, keys []string, take setTaker,
	fn func(ctx context.Context, fences []int64, writer string) ([]SectionResult, error)) []Attempt {
	r.mu.Lock()
	r.seq++
	id := int64(r.worker)*attemptSpan + r.seq
	as := make([]*Attempt, len(keys))
	for i, k := range keys {
		as[i] = &Attempt{Worker: r.worker, ID: id, Key: k}
	}
	r.attempts = append(r.attempts, as...)
	r.mu.Unlock()

	lost := make(chan int64, 1)
	stop := func() bool { return true }
	ran := false
	var fnErr error
	call := Now()
	err := take(ctx, p, given, keys, func(fctx context.Context, fences []int64) error {
		acquired := Now()
		ran = true
		if len(fences) != len(keys) {
			fnErr = fmt.Errorf("%d fences for %d keys", len(fences), len(keys))
			return fnErr
		}
		r.mu.Lock()
		for i, a := range as {
			a.Acquired, a.Fence = acquired, fences[i]
		}
		r.mu.Unlock()
		// Notes when fn's context is cancelled because a lease was lost.
		stop = context.AfterFunc(fctx, func() {
			var at int64
			if errors.Is(context.Cause(fctx), mutex.ErrNotHeld) {
				at = Now()
			}
			lost <- at
		})
		res, err := fn(fctx, fences, strconv.FormatInt(id, 10))
		fnErr = err
		end := Now()
		r.mu.Lock()
		for i, a := range as {
			a.FnEnd = end
			if i < len(res) {
				a.Section = &res[i]
			}
		}
		r.mu.Unlock()
		return err
	})
	ret := Now()
	var lostAt int64
	if !stop() {
		lostAt = <-lost
	}
	kind := KindOther
	switch {
	case err == nil:
		kind = KindOK
	case !ran && errors.Is(err, mutex.ErrNotObtained) && ctx.Err() != nil:
		kind = KindCancelled
	case !ran && errors.Is(err, mutex.ErrNotObtained):
		kind = KindNotObtained
	case errors.Is(err, mutex.ErrNotHeld):
		kind = KindNotHeld
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]Attempt, len(as))
	for i, a := range as {
		a.Call, a.Return, a.LostAt, a.Kind, a.Returned = call, ret, lostAt, kind, err
		if fnErr != nil {
			a.FnErr = fnErr.Error()
		}
		if err != nil {
			a.Err = err.Error()
		}
		out[i] = *a
	}
	return out
}

// SetSection is the checked critical section (see Section) on every key of keys at
// once, run while holding them all, writing to each key's resource with that key's
// fence: it enters every key (occupancy), offers a fenced write on each, reads every
// counter, sleeps once, writes every counter and counts the increments, offers a
// second fenced write on each, and leaves every key. It returns one result per key.
func (rc *RefereeClient) SetSection(ctx context.Context, keys []string, fences []int64, writer string, cfg SectionConfig, rng *rand.Rand) (res []SectionResult, err error) {
	rctx, cancel := refCtx(ctx)
	defer cancel()
	res = make([]SectionResult, len(keys))
	entered := 0
	defer func() {
		for i := range entered {
			if derr := rc.rdb.Decr(rctx, occKey(keys[i])).Err(); derr != nil && err == nil {
				err = fmt.Errorf("referee: leave %s: %w", keys[i], derr)
			}
			res[i].Left = Now()
		}
	}()
	for i, k := range keys {
		res[i].Entered = Now()
		n, err := rc.rdb.Incr(rctx, occKey(k)).Result()
		if err != nil {
			return res, fmt.Errorf("referee: enter %s: %w", k, err)
		}
		entered++
		if n != 1 {
			res[i].Overlap = true
			if err := rc.rdb.Incr(rctx, overlapsKey(k)).Err(); err != nil {
				return res, fmt.Errorf("referee: count overlap on %s: %w", k, err)
			}
		}
	}
	writeAll := func() error {
		for i, k := range keys {
			if err := rc.sectionWrite(rctx, &res[i], k, fences[i], writer); err != nil {
				return err
			}
		}
		return nil
	}
	if err := writeAll(); err != nil {
		return res, err
	}
	vals := make([]int64, len(keys))
	for i, k := range keys {
		v, err := rc.rdb.Get(rctx, counterKey(k)).Int64()
		if err != nil && !errors.Is(err, redis.Nil) {
			return res, fmt.Errorf("referee: read counter %s: %w", k, err)
		}
		vals[i] = v
	}
	gap := cfg.GapMin
	if cfg.GapMax > cfg.GapMin {
		gap += time.Duration(rng.Int64N(int64(cfg.GapMax - cfg.GapMin)))
	}
	timer := time.NewTimer(gap)
	interrupted := false
	select {
	case <-timer.C:
	case <-ctx.Done():
		timer.Stop()
		interrupted = true
	}
	for i, k := range keys {
		res[i].Interrupted = interrupted
		if interrupted {
			continue
		}
		_, err := rc.rdb.TxPipelined(rctx, func(p redis.Pipeliner) error {
			p.Set(rctx, counterKey(k), vals[i]+1, 0)
			p.Incr(rctx, doneKey(k))
			return nil
		})
		if err != nil {
			return res, fmt.Errorf("referee: write counter %s: %w", k, err)
		}
		res[i].Counted = true
	}
	if !interrupted || cfg.WriteAfterLoss {
		if err := writeAll(); err != nil {
			return res, err
		}
	}
	return res, nil
}

// Completion is what the bounded-completion checker found: every call, set or
// single, must return before its deadline.
type Completion struct {
	Sets, Singles int // calls, by number of keys
	TimedOut      int // calls that ended with their deadline: still waiting, or cut short in fn
	Durations     []time.Duration
	FirstTimeout  string // the first timed-out call, for the report
}

// CheckCompletion groups attempts into calls (one per ID) and counts the calls that
// reached bound, their deadline: those that ended waiting with their context done,
// those whose section was cut short (in a run without faults only the deadline cuts
// it), and any that lasted bound or longer.
func CheckCompletion(attempts []Attempt, bound time.Duration) Completion {
	var c Completion
	seen := map[int64]int{}
	for _, a := range attempts {
		seen[a.ID]++
	}
	for _, a := range attempts {
		n, first := seen[a.ID]
		if !first || n == 0 {
			continue
		}
		delete(seen, a.ID)
		if n == 1 {
			c.Singles++
		} else {
			c.Sets++
		}
		d := time.Duration(a.Return - a.Call)
		c.Durations = append(c.Durations, d)
		if a.Kind == KindCancelled || d >= bound || (a.Section != nil && a.Section.Interrupted) {
			c.TimedOut++
			if c.FirstTimeout == "" {
				c.FirstTimeout = fmt.Sprintf("worker %d, %d keys, %v: %s", a.Worker, n, d.Round(time.Millisecond), a.Err)
			}
		}
	}
	return c
}

func (c Completion) String() string {
	return fmt.Sprintf("%d set calls and %d single-key calls, %d reached their deadline; call durations %s",
		c.Sets, c.Singles, c.TimedOut, Dist(c.Durations))
}

// TestSetsUnderContention is the several-keys scenario: 8 worker processes take
// random overlapping sets of 2-4 of 6 keys, in random order, with WithLockKeys (TTL
// 2s, no faults); workers 1 and 2 make every other call a single-key WithLock on one
// of the same keys. Every call has a deadline of setCallBound. Pass: every call
// completes well within it (no deadlock) and runs its section; per key 0 overlaps,
// 0 lost updates, 0 stale fenced writes; porcupine Ok on every key's history. Its
// positive controls are TestCheckersTripOnUnorderedSets (deadlock) and
// TestCheckersTripOnFirstKeyOnly (exclusion).
func TestSetsUnderContention(t *testing.T) {
	workers := Count(t, "workers", 8, 8)
	calls := Count(t, "calls per worker", 300, 2000)
	lifetime := 3 * time.Minute
	if Long() {
		lifetime = 15 * time.Minute
	}
	t.Logf("each call's deadline: %v; each worker's lifetime: %v", setCallBound, lifetime)
	rig := NewRig(t)
	res := rig.RunLoop(t, LoopConfig{
		Mode: "sets", Workers: workers, Sections: calls, Keys: Keys("sets", 6), TTL: 2 * time.Second,
		Section:  SectionConfig{GapMin: 200 * time.Microsecond, GapMax: time.Millisecond},
		Lifetime: lifetime, PorcupineTimeout: 3 * time.Minute,
	})
	c := CheckCompletion(res.Attempts, setCallBound)
	t.Logf("completion: %v", c)
	if c.TimedOut > 0 {
		t.Errorf("%d calls reached their %v deadline (a deadlock, or a stall that long); first: %s", c.TimedOut, setCallBound, c.FirstTimeout)
	}
	if c.Sets+c.Singles != workers*calls || len(res.Errors) > 0 {
		t.Errorf("%d of %d calls recorded; errors: %v", c.Sets+c.Singles, workers*calls, res.Errors)
	}
	if c.Singles == 0 || c.Sets == 0 {
		t.Errorf("%d set calls and %d single-key calls; the scenario needs both", c.Sets, c.Singles)
	}
	want := int64(res.Sections) // one per key of each call
	if res.Total.Overlaps != 0 {
		t.Errorf("occupancy: %d overlaps, want 0", res.Total.Overlaps)
	}
	if res.Total.Lost != 0 || res.Total.Completed != want || res.Total.Counter != want {
		t.Errorf("lost updates: counter %d after %d completed increments (%d key sections), want both %d",
			res.Total.Counter, res.Total.Completed, res.Sections, want)
	}
	if res.Total.Stale != 0 || res.Total.Accepted != 2*want {
		t.Errorf("fenced writes: %d stale, %d accepted; want 0 and %d. Last rejected: %q",
			res.Total.Stale, res.Total.Accepted, 2*want, res.StaleLog)
	}
	if res.Verdict != porcupine.Ok {
		t.Errorf("porcupine: %s%s, want Ok", verdict(res.Verdict), badKeys(res.BadKeys))
	}
}

// TestCheckersTripOnUnorderedSets is the positive control of the bounded-completion
// checker: workers that take their keys one at a time in the order they were given
// (a lock of several keys without a global order, takeUnordered) deadlock, so calls
// must reach their deadline. The same load on WithLockKeys, with the same short
// deadline, must not: what differs is the order.
func TestCheckersTripOnUnorderedSets(t *testing.T) {
	keys := Keys("unordered", 3)
	cfg := LoopConfig{
		Workers: 8, Sections: 40, Keys: keys, TTL: 30 * time.Second, // no lease ends during a deadline
		Section:  SectionConfig{GapMin: time.Millisecond, GapMax: 3 * time.Millisecond},
		Lifetime: time.Minute,
	}
	t.Run("unordered", func(t *testing.T) {
		cfg := cfg
		cfg.Mode = "sets-unordered"
		// Each worker stops at its first deadlock, so more calls cost nothing when
		// they deadlock, and make sure workers that start late still meet others.
		cfg.Sections = 200
		res := NewRig(t).RunLoop(t, cfg)
		c := CheckCompletion(res.Attempts, controlCallBound)
		t.Logf("completion: %v; first: %s", c, c.FirstTimeout)
		if c.TimedOut == 0 {
			t.Errorf("no call reached its %v deadline although keys were taken in no common order: the checker is broken", controlCallBound)
		}
	})
	t.Run("ordered", func(t *testing.T) {
		cfg := cfg
		cfg.Mode = "sets-short"
		res := NewRig(t).RunLoop(t, cfg)
		c := CheckCompletion(res.Attempts, controlCallBound)
		t.Logf("completion: %v", c)
		if c.TimedOut > 0 || len(res.Errors) > 0 {
			t.Errorf("WithLockKeys under the control's load: %d calls reached the %v deadline (first: %s); errors %v",
				c.TimedOut, controlCallBound, c.FirstTimeout, res.Errors)
		}
	})
}

// TestCheckersTripOnFirstKeyOnly is the positive control of the per-key checkers for
// sets: workers use a deliberately broken lock of several keys that takes only the
// first key of each set (takeFirstOnly). Occupancy must count overlaps on the other
// keys, the counters must lose updates, and porcupine must find their histories not
// linearizable.
func TestCheckersTripOnFirstKeyOnly(t *testing.T) {
	rig := NewRig(t)
	res := rig.RunLoop(t, LoopConfig{
		Mode: "sets-first-only", Workers: 8, Sections: 40, Keys: Keys("first-only", 4), TTL: 2 * time.Second,
		Section:  SectionConfig{GapMin: time.Millisecond, GapMax: 3 * time.Millisecond},
		Lifetime: time.Minute,
	})
	if res.Total.Overlaps == 0 {
		t.Errorf("occupancy checker saw no overlap although only the first key of each set was locked: the checker is broken")
	}
	if res.Total.Lost == 0 {
		t.Errorf("lost-update checker saw no lost update although only the first key of each set was locked: the checker is broken")
	}
	if res.Verdict != porcupine.Illegal {
		t.Errorf("porcupine = %s on sets of which only the first key was locked, want Illegal", verdict(res.Verdict))
	}
	t.Logf("stale fenced writes: %d (not required: another key's fence may happen to rise)", res.Total.Stale)
}
