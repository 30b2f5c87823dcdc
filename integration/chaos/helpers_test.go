//go:build unix

package chaos

// The harness of the battery, for every scenario (this file set and the network and
// asynq scenarios to come):
//
//   - Rig: the lock redis-server (the one faults hit), the Referee redis-server (never
//     faulted), and the parent's own clients.
//   - Referee / RefereeClient: the checked critical section (Section) and its
//     checkers: occupancy, lost updates, fenced writes; Tally reads their counts.
//   - Recorder / Attempt: the acquire/release history of WithLock calls, and
//     CheckLinearizable, which checks it with porcupine against a mutex model.
//   - WorkerSpec / StartWorker / Worker: this test binary re-executed as a worker
//     process running a registered mode (registerWorkerMode); RunLoop runs N workers
//     of the "loop" mode with an optional fault injected from the parent.
//   - Now: one monotonic clock shared by all processes on the machine, so that
//     histories from several processes can be merged.
//   - Count, Dist, Every: scale by mode, report distributions, bounded nemesis loops.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
	"github.com/redis/go-redis/v9"
	"golang.org/x/sys/unix"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
	"github.com/asynqmutex/asynqmutex/mutex"
)

// ---------------------------------------------------------------------------
// Mode and scale

// LongEnv, set to 1, runs the full counts; by default they are scaled down so that
// the battery fits in CI.
const LongEnv = "ASYNQMUTEX_CHAOS_LONG"

// Long reports whether the full counts were asked for.
func Long() bool { return os.Getenv(LongEnv) == "1" }

// Count returns def, or long in long mode, and says in the test output which one.
func Count(t testing.TB, what string, def, long int) int {
	t.Helper()
	if Long() {
		t.Logf("%s: %d (long mode)", what, long)
		return long
	}
	t.Logf("%s: %d (default mode, scaled down; %s=1 runs %d)", what, def, LongEnv, long)
	return def
}

// ---------------------------------------------------------------------------
// Clock

// Now is CLOCK_MONOTONIC in nanoseconds. Unlike time.Now's monotonic reading it means
// the same in every process on the machine, and unlike the wall clock it does not
// jump, so histories and fault times from the parent and the workers share a timeline.
func Now() int64 {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		panic(fmt.Sprintf("clock_gettime(CLOCK_MONOTONIC): %v", err))
	}
	return ts.Nano()
}

// Since is the time elapsed since t0, a Now value.
func Since(t0 int64) time.Duration { return time.Duration(Now() - t0) }

// ---------------------------------------------------------------------------
// Referee

// refereeTimeout bounds every referee command; the referee is never faulted, so a
// command that takes this long is a broken harness.
const refereeTimeout = 10 * time.Second

// Referee is the redis-server that judges critical sections. No fault ever hits it.
type Referee struct {
	*RefereeClient
	Server *redistest.Server
}

// StartReferee starts a referee redis-server for the test.
func StartReferee(t testing.TB) *Referee {
	t.Helper()
	s := redistest.Start(t)
	return &Referee{RefereeClient: NewRefereeClient(s.Client(t)), Server: s}
}

// Addr is the referee's address, for worker processes.
func (r *Referee) Addr() string { return r.Server.Addr() }

// RefereeClient runs the checked critical section and the fenced writes against a
// referee; workers and the parent each make one from their own redis client.
type RefereeClient struct{ rdb *redis.Client }

// NewRefereeClient wraps a client connected to the referee.
func NewRefereeClient(rdb *redis.Client) *RefereeClient { return &RefereeClient{rdb: rdb} }

// Redis returns the underlying client.
func (rc *RefereeClient) Redis() *redis.Client { return rc.rdb }

// Referee keys, per lock key k.
func occKey(k string) string      { return "occ:" + k }      // holders in the section now
func overlapsKey(k string) string { return "overlaps:" + k } // entries that found occ:k taken
func counterKey(k string) string  { return "cnt:" + k }      // the racy GET -> sleep -> SET counter
func doneKey(k string) string     { return "done:" + k }     // completed increments, counted atomically
func fenceKey(k string) string    { return "fence:" + k }    // hash {f: last accepted fence, w: its writer}
func acceptedKey(k string) string { return "accepted:" + k }
func staleKey(k string) string    { return "stale:" + k }
func eventsKey(worker int) string { return "events:" + strconv.Itoa(worker) }

const staleLogKey = "stalelog" // the last 1,000 rejected writes, for failure messages

// fencedWriteScript is the resource the fence protects: it accepts a write whose fence
// is higher than the last accepted one (or equal to it from the same writer, so that
// one holder may write several times) and rejects every other write as stale.
//
// KEYS[1] -> fence:<k>     hash {f, w}
// KEYS[2] -> accepted:<k>  counter
// KEYS[3] -> stale:<k>     counter
// KEYS[4] -> stalelog      list
// ARGV[1] -> fence, ARGV[2] -> writer, ARGV[3] -> k
// Returns 1 when accepted, 0 when rejected. Fences stay below 2^53, exact in Lua.
var fencedWriteScript = redis.NewScript(`
local last = redis.call('HMGET', KEYS[1], 'f', 'w')
local f = tonumber(ARGV[1])
local lf = tonumber(last[1] or '0')
if f > lf or (f == lf and last[2] == ARGV[2]) then
  redis.call('HSET', KEYS[1], 'f', ARGV[1], 'w', ARGV[2])
  redis.call('INCR', KEYS[2])
  return 1
end
redis.call('INCR', KEYS[3])
redis.call('RPUSH', KEYS[4], ARGV[3] .. ': writer ' .. ARGV[2] .. ' fence ' .. ARGV[1] .. ' < last ' .. (last[1] or '0') .. ' by ' .. (last[2] or '?'))
redis.call('LTRIM', KEYS[4], -1000, -1)
return 0
`)

func refCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), refereeTimeout)
}

// FencedWrite offers a write carrying fence on key k to the referee and reports
// whether it was accepted.
func (rc *RefereeClient) FencedWrite(ctx context.Context, k string, fence int64, writer string) (bool, error) {
	ctx, cancel := refCtx(ctx)
	defer cancel()
	n, err := fencedWriteScript.Run(ctx, rc.rdb, []string{fenceKey(k), acceptedKey(k), staleKey(k), staleLogKey},
		fence, writer, k).Int64()
	if err != nil {
		return false, fmt.Errorf("referee: fenced write on %s: %w", k, err)
	}
	return n == 1, nil
}

// SectionConfig shapes the checked critical section.
type SectionConfig struct {
	// GapMin and GapMax bound the sleep between the counter's GET and its SET; the
	// wider the gap, the likelier an overlap loses an update.
	GapMin, GapMax time.Duration
	// WriteAfterLoss makes a section whose context was cancelled (lease lost) still
	// offer its closing fenced write, as a holder with a write already in flight
	// would: the fence must stop it.
	WriteAfterLoss bool
}

// SectionResult is what one critical section saw.
type SectionResult struct {
	Entered, Left int64 // Now()
	Overlap       bool  // occ:k was already taken on entry
	Counted       bool  // the GET -> SET increment completed
	Interrupted   bool  // the context was cancelled before the SET
	Writes, Stale int   // fenced writes offered, and rejected
}

// Section is the checked critical section, run while holding the lock on k with
// fence. On entry it takes occupancy (INCR occ:k must return 1, else an overlap is
// counted) and offers a fenced write; it then increments a counter non-atomically
// (GET, sleep, SET) and counts the increment atomically in done:k, offers a second
// fenced write, and leaves (DECR occ:k). A cancelled ctx cuts the sleep short and
// skips the SET. Referee errors are returned: the referee is never faulted, so they
// are harness failures.
func (rc *RefereeClient) Section(ctx context.Context, k string, fence int64, writer string, cfg SectionConfig, rng *rand.Rand) (res SectionResult, err error) {
	rctx, cancel := refCtx(ctx)
	defer cancel()
	res.Entered = Now()
	n, err := rc.rdb.Incr(rctx, occKey(k)).Result()
	if err != nil {
		return res, fmt.Errorf("referee: enter %s: %w", k, err)
	}
	defer func() {
		if derr := rc.rdb.Decr(rctx, occKey(k)).Err(); derr != nil && err == nil {
			err = fmt.Errorf("referee: leave %s: %w", k, derr)
		}
		res.Left = Now()
	}()
	if n != 1 {
		res.Overlap = true
		if err := rc.rdb.Incr(rctx, overlapsKey(k)).Err(); err != nil {
			return res, fmt.Errorf("referee: count overlap on %s: %w", k, err)
		}
	}
	if err := rc.sectionWrite(rctx, &res, k, fence, writer); err != nil {
		return res, err
	}
	v, err := rc.rdb.Get(rctx, counterKey(k)).Int64()
	if err != nil && !errors.Is(err, redis.Nil) {
		return res, fmt.Errorf("referee: read counter %s: %w", k, err)
	}
	gap := cfg.GapMin
	if cfg.GapMax > cfg.GapMin {
		gap += time.Duration(rng.Int64N(int64(cfg.GapMax - cfg.GapMin)))
	}
	timer := time.NewTimer(gap)
	select {
	case <-timer.C:
	case <-ctx.Done():
		timer.Stop()
		res.Interrupted = true
	}
	if !res.Interrupted {
		_, err := rc.rdb.TxPipelined(rctx, func(p redis.Pipeliner) error {
			p.Set(rctx, counterKey(k), v+1, 0)
			p.Incr(rctx, doneKey(k))
			return nil
		})
		if err != nil {
			return res, fmt.Errorf("referee: write counter %s: %w", k, err)
		}
		res.Counted = true
	}
	if !res.Interrupted || cfg.WriteAfterLoss {
		if err := rc.sectionWrite(rctx, &res, k, fence, writer); err != nil {
			return res, err
		}
	}
	return res, nil
}

func (rc *RefereeClient) sectionWrite(ctx context.Context, res *SectionResult, k string, fence int64, writer string) error {
	ok, err := rc.FencedWrite(ctx, k, fence, writer)
	if err != nil {
		return err
	}
	res.Writes++
	if !ok {
		res.Stale++
	}
	return nil
}

// Event sends msg to the parent, which waits for it with WaitEvent.
func (rc *RefereeClient) Event(ctx context.Context, worker int, msg string) error {
	ctx, cancel := refCtx(ctx)
	defer cancel()
	return rc.rdb.RPush(ctx, eventsKey(worker), msg).Err()
}

// WaitEvent returns the next message of worker w (see Event), failing the test if
// none comes within timeout (rounded up to whole seconds) or w exits first.
func (r *Referee) WaitEvent(t testing.TB, w *Worker, timeout time.Duration) string {
	t.Helper()
	secs := max(time.Second, timeout.Round(time.Second))
	for i := time.Duration(0); i < secs; i += time.Second {
		res, err := r.rdb.BLPop(context.Background(), time.Second, eventsKey(w.Spec.ID)).Result()
		if err == nil {
			return res[1]
		}
		if !errors.Is(err, redis.Nil) {
			t.Fatalf("referee: waiting for an event of worker %d: %v", w.Spec.ID, err)
		}
		if w.Exited() {
			t.Fatalf("worker %d exited (%v) before sending an event; output:\n%s", w.Spec.ID, w.ExitErr(), w.Output())
		}
	}
	t.Fatalf("worker %d sent no event within %v; output:\n%s", w.Spec.ID, secs, w.Output())
	return ""
}

// Tally is what the checkers counted on the referee, for one key or in total.
type Tally struct {
	Overlaps  int64 // entries that found another holder in the section
	Completed int64 // increments completed (GET -> SET), counted atomically
	Counter   int64 // the racy counter's final value
	Lost      int64 // Completed - Counter: increments that another section overwrote
	Accepted  int64 // fenced writes accepted
	Stale     int64 // fenced writes rejected: a fence lower than one already accepted
	Occupied  int64 // occupancy left at the end (sections that never left: killed holders)
}

func (a *Tally) add(b Tally) {
	a.Overlaps += b.Overlaps
	a.Completed += b.Completed
	a.Counter += b.Counter
	a.Lost += b.Lost
	a.Accepted += b.Accepted
	a.Stale += b.Stale
	a.Occupied += b.Occupied
}

func (a Tally) String() string {
	return fmt.Sprintf("overlaps=%d completed=%d counter=%d lost-updates=%d fenced-writes accepted=%d stale(rejected)=%d occupied-at-end=%d",
		a.Overlaps, a.Completed, a.Counter, a.Lost, a.Accepted, a.Stale, a.Occupied)
}

// Tally reads the checkers' counts for keys.
func (r *Referee) Tally(t testing.TB, keys []string) (map[string]Tally, Tally) {
	t.Helper()
	ctx, cancel := refCtx(context.Background())
	defer cancel()
	per := make(map[string]Tally, len(keys))
	var total Tally
	for _, k := range keys {
		vals, err := r.rdb.MGet(ctx, overlapsKey(k), doneKey(k), counterKey(k), acceptedKey(k), staleKey(k), occKey(k)).Result()
		if err != nil {
			t.Fatalf("referee: tally %s: %v", k, err)
		}
		n := make([]int64, len(vals))
		for i, v := range vals {
			if s, ok := v.(string); ok {
				n[i], _ = strconv.ParseInt(s, 10, 64)
			}
		}
		tl := Tally{Overlaps: n[0], Completed: n[1], Counter: n[2], Accepted: n[3], Stale: n[4], Occupied: n[5]}
		tl.Lost = max(tl.Completed-tl.Counter, 0)
		per[k] = tl
		total.add(tl)
	}
	return per, total
}

// StaleLog returns the last rejected writes, for failure messages.
func (r *Referee) StaleLog(t testing.TB, n int) []string {
	t.Helper()
	ctx, cancel := refCtx(context.Background())
	defer cancel()
	out, err := r.rdb.LRange(ctx, staleLogKey, int64(-n), -1).Result()
	if err != nil {
		t.Fatalf("referee: stale log: %v", err)
	}
	return out
}

// ---------------------------------------------------------------------------
// History

// ErrKind classifies how a WithLock call ended.
type ErrKind string

const (
	KindOK          ErrKind = ""
	KindNotObtained ErrKind = "not-obtained" // the wait ended with another holder
	KindCancelled   ErrKind = "cancelled"    // the caller's context ended the wait
	KindNotHeld     ErrKind = "not-held"     // the lease was lost (ErrNotHeld)
	KindOther       ErrKind = "other"        // a Redis error: the outcome is unknown
)

// attemptSpan separates the attempt IDs of different workers: worker w numbers its
// attempts w*attemptSpan+1, +2, ...
const attemptSpan = 1_000_000_000

// Attempt is one recorded WithLock call. Times are Now() values, 0 when the event did
// not happen.
type Attempt struct {
	Worker int
	ID     int64 // unique across processes; also the writer name of its fenced writes
	Key    string
	Fence  int64

	Call     int64 // WithLock called
	Acquired int64 // fn started: the lock was obtained
	FnEnd    int64 // fn returned
	Return   int64 // WithLock returned
	LostAt   int64 // fn's context was cancelled with a cause wrapping ErrNotHeld

	Kind  ErrKind
	Err   string
	FnErr string

	Section *SectionResult `json:",omitempty"`
	Writes  []WriteResult  `json:",omitempty"` // fenced writes outside Section

	// Returned is the error WithLock returned, for errors.Is in the process that made
	// the call (Err is its text); it is not part of a worker's report.
	Returned error `json:"-"`
}

// WriteResult is one fenced write a mode made itself.
type WriteResult struct {
	At       int64
	Accepted bool
	Note     string
}

// Ran reports whether the lock was obtained and fn ran.
func (a Attempt) Ran() bool { return a.Acquired != 0 }

// Writer is the writer name of the attempt's fenced writes.
func (a Attempt) Writer() string { return strconv.FormatInt(a.ID, 10) }

// Recorder records the WithLock calls of one process. It is safe for concurrent use.
type Recorder struct {
	worker   int
	mu       sync.Mutex
	seq      int64
	attempts []*Attempt
}

// NewRecorder returns a recorder for worker (the parent is worker 0).
func NewRecorder(worker int) *Recorder { return &Recorder{worker: worker} }

// Rewind records fence as a's fence instead of the lock's, and returns it.
func (r *Recorder) Rewind(a *Attempt, fence int64) int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	a.Fence = fence
	return fence
}

// WithLock calls c.WithLock and records the call: when the lock was obtained, when fn
// returned, when (if ever) fn's context was cancelled because the lease was lost, and
// how the call ended. fn gets the lock and the attempt, to fill in Section or Writes.
func (r *Recorder) WithLock(ctx context.Context, c *mutex.Client, key string, ttl time.Duration,
	fn func(ctx context.Context, l *mutex.Lock, a *Attempt) error, opts ...mutex.LockOption) *Attempt {
	r.mu.Lock()
	r.seq++
	a := &Attempt{Worker: r.worker, ID: int64(r.worker)*attemptSpan + r.seq, Key: key}
	r.attempts = append(r.attempts, a)
	r.mu.Unlock()

	lost := make(chan int64, 1)
	ran := false
	var fnErr error
	call := Now()
	err := c.WithLock(ctx, key, ttl, func(fctx context.Context) error {
		acquired := Now()
		ran = true
		l, _ := mutex.FromContext(fctx)
		r.mu.Lock()
		a.Acquired, a.Fence = acquired, l.Fence()
		r.mu.Unlock()
		// WithLock always cancels fctx before it returns, so this always runs; it
		// notes the time only when the cause is a lost lease.
		context.AfterFunc(fctx, func() {
			var at int64
			if errors.Is(context.Cause(fctx), mutex.ErrNotHeld) {
				at = Now()
			}
			lost <- at
		})
		fnErr = fn(fctx, l, a)
		r.mu.Lock()
		a.FnEnd = Now()
		r.mu.Unlock()
		return fnErr
	}, opts...)
	ret := Now()
	var lostAt int64
	if ran {
		select {
		case lostAt = <-lost:
		case <-time.After(5 * time.Second):
			err = errors.Join(err, errors.New("chaos: fn's context was not cancelled when WithLock returned"))
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	a.Call, a.Return, a.LostAt = call, ret, lostAt
	if fnErr != nil {
		a.FnErr = fnErr.Error()
	}
	if err != nil {
		a.Err = err.Error()
	}
	a.Returned = err
	switch {
	case err == nil:
		a.Kind = KindOK
	case !ran && errors.Is(err, mutex.ErrNotObtained) && ctx.Err() != nil:
		a.Kind = KindCancelled
	case !ran && errors.Is(err, mutex.ErrNotObtained):
		a.Kind = KindNotObtained
	case errors.Is(err, mutex.ErrNotHeld):
		a.Kind = KindNotHeld
	default:
		a.Kind = KindOther
	}
	cp := *a
	return &cp
}

// Attempts returns copies of the recorded attempts.
func (r *Recorder) Attempts() []Attempt {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]Attempt, len(r.attempts))
	for i, a := range r.attempts {
		out[i] = *a
	}
	return out
}

// ---------------------------------------------------------------------------
// Linearizability

// The mutex model: per key, the holder (an attempt ID, 0 = free) and the last fence
// granted. acquire succeeds only if the lock is free, with a fence above every earlier
// one; "busy" is legal only while someone holds it; release by the holder frees it;
// "not held" is legal only if the caller does not hold it. Leases that run out are not
// part of the model, so any lease loss the history shows is a violation: scenarios
// without faults must show none. Operations whose outcome is unknown (a Redis error)
// stay pending until the end of the history and may have taken effect or not, as in
// etcd's robustness tests; an acquire with an unknown outcome gets a pending release
// of unknown outcome too, since the library abandons what it may have taken.

type lockOp uint8

const (
	opAcquire lockOp = iota
	opRelease
)

type outcome uint8

const (
	outOK outcome = iota
	outBusy
	outNotHeld
	outUnknown
)

type lockInput struct {
	Key string
	Op  lockOp
	ID  int64
}

type lockOutput struct {
	Out   outcome
	Fence int64
}

type lockState struct {
	Holder int64
	Fence  int64
}

// pending is the return time of an operation whose outcome is unknown.
const pending = math.MaxInt64

var lockModel = (&porcupine.NondeterministicModel{
	Partition: func(h []porcupine.Operation) [][]porcupine.Operation {
		by := map[string][]porcupine.Operation{}
		var keys []string
		for _, op := range h {
			k := op.Input.(lockInput).Key
			if _, ok := by[k]; !ok {
				keys = append(keys, k)
			}
			by[k] = append(by[k], op)
		}
		sort.Strings(keys)
		out := make([][]porcupine.Operation, 0, len(keys))
		for _, k := range keys {
			out = append(out, by[k])
		}
		return out
	},
	Init: func() []any { return []any{lockState{}} },
	Step: func(state, input, output any) []any {
		s, in, out := state.(lockState), input.(lockInput), output.(lockOutput)
		switch in.Op {
		case opAcquire:
			switch out.Out {
			case outOK:
				if s.Holder == 0 && out.Fence > s.Fence {
					return []any{lockState{Holder: in.ID, Fence: out.Fence}}
				}
			case outBusy:
				if s.Holder != 0 && s.Holder != in.ID {
					return []any{s}
				}
			case outUnknown:
				if s.Holder == 0 {
					return []any{s, lockState{Holder: in.ID, Fence: s.Fence}}
				}
				return []any{s}
			}
		case opRelease:
			switch out.Out {
			case outOK:
				if s.Holder == in.ID {
					return []any{lockState{Fence: s.Fence}}
				}
			case outNotHeld:
				if s.Holder != in.ID {
					return []any{s}
				}
			case outUnknown:
				if s.Holder == in.ID {
					return []any{s, lockState{Fence: s.Fence}}
				}
				return []any{s}
			}
		}
		return nil
	},
	Hash: func(state any) uint64 {
		s := state.(lockState)
		return uint64(s.Holder)*0x9E3779B97F4A7C15 ^ uint64(s.Fence)
	},
	DescribeOperation: func(input, output any) string {
		in, out := input.(lockInput), output.(lockOutput)
		op := "acquire"
		if in.Op == opRelease {
			op = "release"
		}
		res := [...]string{"ok", "busy", "not-held", "unknown"}[out.Out]
		if in.Op == opAcquire && out.Out == outOK {
			res += fmt.Sprintf(" fence=%d", out.Fence)
		}
		return fmt.Sprintf("%s(%s, #%d) -> %s", op, in.Key, in.ID, res)
	},
	DescribeState: func(state any) string {
		s := state.(lockState)
		if s.Holder == 0 {
			return fmt.Sprintf("free, fence %d", s.Fence)
		}
		return fmt.Sprintf("held by #%d, fence %d", s.Holder, s.Fence)
	},
}).ToModel()

// Operations turns attempts into a porcupine history for lockModel.
func Operations(attempts []Attempt) []porcupine.Operation {
	ops := make([]porcupine.Operation, 0, 2*len(attempts))
	add := func(a Attempt, op lockOp, call, ret int64, out lockOutput) {
		ops = append(ops, porcupine.Operation{
			ClientId: a.Worker,
			Input:    lockInput{Key: a.Key, Op: op, ID: a.ID},
			Call:     call,
			Output:   out,
			Return:   ret,
		})
	}
	for _, a := range attempts {
		if a.Return == 0 {
			continue // still running when recorded
		}
		if !a.Ran() {
			if a.Kind == KindNotObtained {
				add(a, opAcquire, a.Call, a.Return, lockOutput{Out: outBusy})
			} else {
				add(a, opAcquire, a.Call, pending, lockOutput{Out: outUnknown})
				add(a, opRelease, a.Call, pending, lockOutput{Out: outUnknown})
			}
			continue
		}
		add(a, opAcquire, a.Call, a.Acquired, lockOutput{Out: outOK, Fence: a.Fence})
		switch {
		case a.Kind == KindOK:
			add(a, opRelease, a.FnEnd, a.Return, lockOutput{Out: outOK})
		case a.Kind == KindNotHeld:
			add(a, opRelease, a.FnEnd, a.Return, lockOutput{Out: outNotHeld})
		default:
			add(a, opRelease, a.FnEnd, pending, lockOutput{Out: outUnknown})
		}
	}
	return ops
}

// ArtifactsEnv names a directory where a failed linearizability check leaves its
// porcupine visualization (an HTML file per check).
const ArtifactsEnv = "ASYNQMUTEX_CHAOS_ARTIFACTS"

// CheckLinearizable checks the attempts against the mutex model and returns porcupine's
// verdict (Ok, Illegal, or Unknown when the check timed out) and, when it is not Ok,
// the keys whose own history is not Ok.
func CheckLinearizable(t testing.TB, name string, attempts []Attempt, timeout time.Duration) (porcupine.CheckResult, []string) {
	t.Helper()
	ops := Operations(attempts)
	res := porcupine.CheckOperationsTimeout(lockModel, ops, timeout)
	if res == porcupine.Ok {
		return res, nil
	}
	var bad []string
	for _, part := range lockModel.Partition(ops) {
		if porcupine.CheckOperationsTimeout(lockModel, part, timeout/4+time.Second) != porcupine.Ok {
			bad = append(bad, part[0].Input.(lockInput).Key)
		}
	}
	if dir := os.Getenv(ArtifactsEnv); dir != "" {
		_, info := porcupine.CheckOperationsVerbose(lockModel, ops, timeout)
		path := filepath.Join(dir, strings.NewReplacer("/", "_", " ", "_").Replace(t.Name()+"-"+name)+".html")
		if err := porcupine.VisualizePath(lockModel, info, path); err != nil {
			t.Logf("porcupine visualization: %v", err)
		} else {
			t.Logf("porcupine visualization written to %s", path)
		}
	}
	return res, bad
}

func verdict(r porcupine.CheckResult) string {
	switch r {
	case porcupine.Ok:
		return "Ok"
	case porcupine.Illegal:
		return "Illegal"
	default:
		return "Unknown (timed out)"
	}
}

// ---------------------------------------------------------------------------
// Worker processes

// WorkerEnv carries a worker's JSON WorkerSpec; when set, TestMain runs the worker
// instead of the tests.
const WorkerEnv = "ASYNQMUTEX_CHAOS_WORKER"

// WorkerSpec tells a worker process what to do.
type WorkerSpec struct {
	Mode        string // a name given to registerWorkerMode
	ID          int    // 1, 2, ...; the parent is 0
	LockAddr    string // the lock Redis (or a proxy in front of it)
	RefereeAddr string
	Keys        []string
	TTL         time.Duration
	Sections    int
	Section     SectionConfig
	RoundRobin  bool // loop: section i takes Keys[(ID+i) % len(Keys)] instead of a random key
	// RewindFences makes a loop worker a deliberately broken lock for positive
	// controls: every other section it uses and records a fence far below the one
	// the lock gave it.
	RewindFences bool
	Lifetime     time.Duration // the worker gives up and exits after this long
	Seed         uint64
	Report       string // path of the JSON report; set by StartWorker
}

// WorkerReport is what a worker leaves behind when it exits by itself.
type WorkerReport struct {
	ID       int
	Attempts []Attempt
	Error    string
	Notes    map[string]int64 `json:",omitempty"`
}

// Proc is a worker's view of itself, passed to its mode.
type Proc struct {
	Spec   WorkerSpec
	Locks  *mutex.Client
	Lock   *redis.Client // raw client of the lock Redis
	Ref    *RefereeClient
	Rec    *Recorder
	Rand   *rand.Rand
	Report *WorkerReport
}

// Event sends msg to the parent (see Referee.WaitEvent).
func (p *Proc) Event(ctx context.Context, format string, args ...any) error {
	return p.Ref.Event(ctx, p.Spec.ID, fmt.Sprintf(format, args...))
}

// workerModes maps mode names to their code; filled by init functions only.
var workerModes = map[string]func(ctx context.Context, p *Proc) error{}

// registerWorkerMode makes a mode available to WorkerSpec.Mode. Call it from init.
func registerWorkerMode(name string, fn func(ctx context.Context, p *Proc) error) {
	if _, dup := workerModes[name]; dup {
		panic("registerWorkerMode: duplicate mode " + name)
	}
	workerModes[name] = fn
}

// workerMain runs in a worker process and returns its exit code.
func workerMain(raw string) int {
	var spec WorkerSpec
	if err := json.Unmarshal([]byte(raw), &spec); err != nil {
		fmt.Fprintf(os.Stderr, "worker: bad spec: %v\n", err)
		return 2
	}
	mode, ok := workerModes[spec.Mode]
	if !ok {
		fmt.Fprintf(os.Stderr, "worker %d: unknown mode %q\n", spec.ID, spec.Mode)
		return 2
	}
	ctx, cancel := context.WithTimeout(context.Background(), spec.Lifetime)
	defer cancel()
	lockRDB := redis.NewClient(&redis.Options{Addr: spec.LockAddr})
	refRDB := redis.NewClient(&redis.Options{Addr: spec.RefereeAddr})
	p := &Proc{
		Spec:   spec,
		Locks:  mutex.New(lockRDB),
		Lock:   lockRDB,
		Ref:    NewRefereeClient(refRDB),
		Rec:    NewRecorder(spec.ID),
		Rand:   rand.New(rand.NewPCG(spec.Seed, uint64(spec.ID))),
		Report: &WorkerReport{ID: spec.ID, Notes: map[string]int64{}},
	}
	err := mode(ctx, p)
	if err == nil && ctx.Err() != nil {
		err = fmt.Errorf("lifetime of %v ran out", spec.Lifetime)
	}
	_ = p.Locks.Close()
	_ = lockRDB.Close()
	_ = refRDB.Close()
	p.Report.Attempts = p.Rec.Attempts()
	if err != nil {
		p.Report.Error = err.Error()
	}
	b, jerr := json.Marshal(p.Report)
	if jerr == nil {
		jerr = os.WriteFile(spec.Report, b, 0o600)
	}
	if jerr != nil {
		fmt.Fprintf(os.Stderr, "worker %d: writing report: %v\n", spec.ID, jerr)
		return 1
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "worker %d: %v\n", spec.ID, err)
		return 1
	}
	return 0
}

// Worker is a worker process started by StartWorker.
type Worker struct {
	Spec WorkerSpec
	cmd  *exec.Cmd
	out  *syncBuffer
	done chan struct{}
	err  error // cmd.Wait's result, once done is closed
}

// StartWorker re-executes the test binary as a worker running spec, and kills it in
// t.Cleanup if it is still running.
func StartWorker(t testing.TB, spec WorkerSpec) *Worker {
	t.Helper()
	if spec.Lifetime <= 0 {
		spec.Lifetime = time.Minute
	}
	if spec.Seed == 0 {
		spec.Seed = rand.Uint64()
	}
	spec.Report = filepath.Join(t.TempDir(), fmt.Sprintf("worker-%d.json", spec.ID))
	raw, err := json.Marshal(spec)
	if err != nil {
		t.Fatalf("worker spec: %v", err)
	}
	w := &Worker{Spec: spec, out: &syncBuffer{}, done: make(chan struct{})}
	w.cmd = exec.Command(os.Args[0])
	w.cmd.Env = append(os.Environ(), WorkerEnv+"="+string(raw))
	w.cmd.Stdout, w.cmd.Stderr = w.out, w.out
	if err := w.cmd.Start(); err != nil {
		t.Fatalf("starting worker %d: %v", spec.ID, err)
	}
	go func() {
		w.err = w.cmd.Wait()
		close(w.done)
	}()
	t.Cleanup(func() {
		if !w.Exited() {
			_ = w.cmd.Process.Kill()
		}
		select {
		case <-w.done:
		case <-time.After(10 * time.Second):
			t.Errorf("worker %d (pid %d) not reaped 10s after SIGKILL", spec.ID, w.Pid())
		}
		if strings.Contains(w.Output(), "DATA RACE") {
			t.Errorf("worker %d reported a data race:\n%s", spec.ID, w.Output())
		}
	})
	return w
}

// Pid is the worker's process id.
func (w *Worker) Pid() int { return w.cmd.Process.Pid }

// Signal sends sig to the worker.
func (w *Worker) Signal(sig syscall.Signal) error { return w.cmd.Process.Signal(sig) }

// Exited reports whether the worker process has exited and been reaped.
func (w *Worker) Exited() bool {
	select {
	case <-w.done:
		return true
	default:
		return false
	}
}

// ExitErr is the process's exit status, once it has exited.
func (w *Worker) ExitErr() error {
	if !w.Exited() {
		return nil
	}
	return w.err
}

// Output is what the worker printed.
func (w *Worker) Output() string { return w.out.String() }

// Kill sends SIGKILL and waits until the process is reaped, failing the test if that
// takes longer than 10s.
func (w *Worker) Kill(t testing.TB) {
	t.Helper()
	if err := w.cmd.Process.Kill(); err != nil && !w.Exited() {
		t.Fatalf("SIGKILL worker %d: %v", w.Spec.ID, err)
	}
	select {
	case <-w.done:
	case <-time.After(10 * time.Second):
		t.Fatalf("worker %d not reaped 10s after SIGKILL", w.Spec.ID)
	}
}

// Wait waits up to timeout for the worker to exit by itself and returns its report;
// it fails the test if the worker does not exit in time, exits non-zero, or leaves no
// report.
func (w *Worker) Wait(t testing.TB, timeout time.Duration) *WorkerReport {
	t.Helper()
	select {
	case <-w.done:
	case <-time.After(timeout):
		_ = w.cmd.Process.Kill()
		<-w.done
		t.Fatalf("worker %d did not exit within %v; output:\n%s", w.Spec.ID, timeout, w.Output())
	}
	b, err := os.ReadFile(w.Spec.Report)
	if err != nil {
		t.Fatalf("worker %d exited (%v) without a report: %v; output:\n%s", w.Spec.ID, w.err, err, w.Output())
	}
	var rep WorkerReport
	if err := json.Unmarshal(b, &rep); err != nil {
		t.Fatalf("worker %d report: %v", w.Spec.ID, err)
	}
	if w.err != nil || rep.Error != "" {
		t.Fatalf("worker %d failed: exit %v, error %q; output:\n%s", w.Spec.ID, w.err, rep.Error, w.Output())
	}
	return &rep
}

// syncBuffer is a bytes.Buffer safe for exec's copying goroutine.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.b.Len() > 1<<20 {
		return len(p), nil // keep the first megabyte
	}
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// ---------------------------------------------------------------------------
// Rig and the loop run

// Rig is the lock Redis (the one faults hit), the referee, and the parent's clients.
type Rig struct {
	Lock    *redistest.Server
	LockRDB *redis.Client // the parent's raw client of the lock Redis
	Locks   *mutex.Client // the parent's lock client (worker 0)
	Rec     *Recorder     // records the parent's WithLock calls
	Referee *Referee
}

// NewRig starts a lock redis-server and a referee for the test.
func NewRig(t testing.TB) *Rig {
	t.Helper()
	lock := redistest.Start(t)
	rdb := lock.Client(t)
	locks := mutex.New(rdb)
	t.Cleanup(func() { _ = locks.Close() }) // runs before the client's own cleanup closes it
	return &Rig{Lock: lock, LockRDB: rdb, Locks: locks, Rec: NewRecorder(0), Referee: StartReferee(t)}
}

// RedisLockKey is the lock Redis key of a lock key, as package mutex documents it.
// The keys this battery uses need no escaping.
func RedisLockKey(key string) string { return mutex.DefaultPrefix + "{" + key + "}" }

// HolderOf reads a lock key's value as mutex/layout.go documents it (16 digits of
// fence, a state byte, 16 digits of the time it was taken, then the holder's token
// length in 4 digits and the token) and returns the holder's token. held is false
// only for a released lock's tombstone (state "r"); a value of another form counts
// as held, by the whole value, as the library's scripts count it.
func HolderOf(v string) (token string, held bool) {
	const idAt = 16 + 1 + 16
	if len(v) < idAt+4 {
		return v, true
	}
	n, err := strconv.Atoi(v[idAt : idAt+4])
	if err != nil || idAt+4+n > len(v) {
		return v, true
	}
	return v[idAt+4 : idAt+4+n], v[16] != 'r'
}

// HeldValue is a lock value held with fence f by token, with no description, as
// mutex/layout.go documents it.
func HeldValue(f int64, token string) string {
	return fmt.Sprintf("%016dh%016d%04d%s0000", f, f, len(token), token)
}

// FencePrefix is how a lock value held with fence f begins.
func FencePrefix(f int64) string { return fmt.Sprintf("%016d", f) }

// Keys returns n lock keys named after prefix.
func Keys(prefix string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s:%02d", prefix, i)
	}
	return out
}

// LoopConfig describes a run of loop workers: each performs Sections checked
// critical sections under WithLock (no MaxWait), on keys picked at random.
type LoopConfig struct {
	Workers, Sections int
	Keys              []string
	TTL               time.Duration
	Section           SectionConfig
	RoundRobin        bool          // see WorkerSpec.RoundRobin
	RewindFences      bool          // see WorkerSpec.RewindFences
	LockAddr          string        // defaults to the rig's lock Redis
	Lifetime          time.Duration // per worker; default 2 minutes
	Mode              string        // the workers' mode; default "loop"
	// During, if set, runs in the parent while the workers run (a nemesis, a
	// fault); its context ends when every worker has exited.
	During func(ctx context.Context)
	// PorcupineTimeout bounds the linearizability check; default 2 minutes.
	PorcupineTimeout time.Duration
}

// LoopResult is what a loop run produced.
type LoopResult struct {
	Attempts   []Attempt
	PerKey     map[string]Tally
	Total      Tally
	Verdict    porcupine.CheckResult
	BadKeys    []string // keys whose history is not linearizable
	Sections   int      // sections that ran (fn ran)
	Errors     map[ErrKind]int
	Elapsed    time.Duration
	StaleLog   []string
	DuringDone time.Duration // how long During ran
}

func init() { registerWorkerMode("loop", loopMode) }

// loopMode performs Spec.Sections checked sections on random keys.
func loopMode(ctx context.Context, p *Proc) error {
	for i := 0; i < p.Spec.Sections; i++ {
		if ctx.Err() != nil {
			return fmt.Errorf("lifetime ended after %d of %d sections", i, p.Spec.Sections)
		}
		key := p.Spec.Keys[p.Rand.IntN(len(p.Spec.Keys))]
		if p.Spec.RoundRobin {
			key = p.Spec.Keys[(p.Spec.ID+i)%len(p.Spec.Keys)]
		}
		var secErr error
		p.Rec.WithLock(ctx, p.Locks, key, p.Spec.TTL, func(ctx context.Context, l *mutex.Lock, a *Attempt) error {
			fence := l.Fence()
			if p.Spec.RewindFences && i%2 == 1 {
				fence = p.Rec.Rewind(a, fence/2)
			}
			res, err := p.Ref.Section(ctx, key, fence, a.Writer(), p.Spec.Section, p.Rand)
			a.Section = &res
			secErr = err
			return err
		})
		if secErr != nil {
			return secErr
		}
	}
	return nil
}

// RunLoop runs cfg.Workers loop workers to completion, with cfg.During alongside, and
// returns what the checkers found. It fails the test if a worker fails (a referee
// error, its lifetime ran out); it does not judge the checkers' counts.
func (rig *Rig) RunLoop(t testing.TB, cfg LoopConfig) LoopResult {
	t.Helper()
	if cfg.LockAddr == "" {
		cfg.LockAddr = rig.Lock.Addr()
	}
	if cfg.Lifetime == 0 {
		cfg.Lifetime = 2 * time.Minute
	}
	if cfg.PorcupineTimeout == 0 {
		cfg.PorcupineTimeout = 2 * time.Minute
	}
	if cfg.Mode == "" {
		cfg.Mode = "loop"
	}
	start := Now()
	workers := make([]*Worker, cfg.Workers)
	for i := range workers {
		workers[i] = StartWorker(t, WorkerSpec{
			Mode: cfg.Mode, ID: i + 1, LockAddr: cfg.LockAddr, RefereeAddr: rig.Referee.Addr(),
			Keys: cfg.Keys, TTL: cfg.TTL, Sections: cfg.Sections, Section: cfg.Section, RoundRobin: cfg.RoundRobin,
			RewindFences: cfg.RewindFences, Lifetime: cfg.Lifetime,
		})
	}
	var res LoopResult
	deadline := time.Now().Add(cfg.Lifetime + 30*time.Second)
	if cfg.During != nil {
		// During runs here, in the test goroutine, so that it may fail the test; its
		// context ends once every worker has exited.
		ctx, stop := context.WithCancel(context.Background())
		watched := make(chan struct{})
		go func() {
			defer close(watched)
			defer stop()
			limit := time.NewTimer(time.Until(deadline))
			defer limit.Stop()
			for _, w := range workers {
				select {
				case <-w.done:
				case <-limit.C:
					return
				case <-ctx.Done(): // RunLoop is returning early (a failure)
					return
				}
			}
		}()
		t0 := Now()
		cfg.During(ctx)
		res.DuringDone = Since(t0)
		defer func() { stop(); <-watched }()
	}
	var reports []*WorkerReport
	for _, w := range workers {
		reports = append(reports, w.Wait(t, time.Until(deadline)))
	}
	res.Elapsed = Since(start)
	res.Errors = map[ErrKind]int{}
	for _, rep := range reports {
		for _, a := range rep.Attempts {
			res.Attempts = append(res.Attempts, a)
			if a.Ran() {
				res.Sections++
			}
			if a.Kind != KindOK {
				res.Errors[a.Kind]++
			}
		}
	}
	res.PerKey, res.Total = rig.Referee.Tally(t, cfg.Keys)
	res.Verdict, res.BadKeys = CheckLinearizable(t, "loop", res.Attempts, cfg.PorcupineTimeout)
	if res.Total.Stale > 0 {
		res.StaleLog = rig.Referee.StaleLog(t, 5)
	}
	t.Logf("%d workers x %d sections on %d keys in %v: %d sections ran; WithLock errors %v",
		cfg.Workers, cfg.Sections, len(cfg.Keys), res.Elapsed.Round(time.Millisecond), res.Sections, res.Errors)
	t.Logf("checkers: %v; porcupine: %s (%d operations)%s", res.Total, verdict(res.Verdict), 2*len(res.Attempts), badKeys(res.BadKeys))
	return res
}

func badKeys(keys []string) string {
	if len(keys) == 0 {
		return ""
	}
	return fmt.Sprintf(", not linearizable on %d keys %v", len(keys), keys)
}

// ---------------------------------------------------------------------------
// Small tools

// Every runs fault every period until ctx is done or it has run limit times, and
// returns how many times it ran and the first error.
func Every(ctx context.Context, period time.Duration, limit int, fault func(ctx context.Context) error) (int, error) {
	t := time.NewTicker(period)
	defer t.Stop()
	var first error
	for n := 0; n < limit; n++ {
		select {
		case <-ctx.Done():
			return n, first
		case <-t.C:
		}
		if err := fault(ctx); err != nil && first == nil && ctx.Err() == nil {
			first = err
		}
	}
	return limit, first
}

// Dist summarises durations: count, min, median, 90th percentile, max.
func Dist(ds []time.Duration) string {
	if len(ds) == 0 {
		return "n=0"
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	q := func(p float64) time.Duration { return s[int(math.Ceil(p*float64(len(s))))-1] }
	r := func(d time.Duration) time.Duration { return d.Round(100 * time.Microsecond) }
	return fmt.Sprintf("n=%d min=%v p50=%v p90=%v max=%v", len(s), r(s[0]), r(q(0.5)), r(q(0.9)), r(s[len(s)-1]))
}

// Ms formats a duration in milliseconds with one decimal.
func Ms(d time.Duration) string { return fmt.Sprintf("%.1fms", float64(d)/float64(time.Millisecond)) }
