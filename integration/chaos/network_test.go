//go:build unix

package chaos

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/redis/go-redis/v9"
	"github.com/rs/zerolog"

	"github.com/asynqmutex/asynqmutex/mutex"
)

// Scenario 5: network faults between the workers and the lock Redis.
//
// Every worker reaches the lock Redis through one toxiproxy proxy run in the test
// process (github.com/Shopify/toxiproxy/v2, on 127.0.0.1:0); the referee is reached
// directly and never faulted, and so is the parent's own client of the lock Redis,
// which the leak sampler uses. A bounded chaos loop in the parent toggles toxics:
//
//   - latency 5ms ± 5ms in both directions for a while (resets happen on top of it);
//   - reset_peer bursts of 100-300ms, added and removed by the loop (toxiproxy rolls
//     a toxic's toxicity once per connection, so a burst is the way to hit a share
//     of the requests): downstream only (the request is applied, its reply lost and
//     the connection closed), upstream only (the request is lost), or both
//     directions at toxicity 0.5 (each connection rolls its own mix);
//   - reply drops: a timeout toxic on the downstream stream (timeout 0: replies are
//     swallowed, the connection stays open) removed after 150-400ms, which closes the
//     connections it held;
//   - two blackholes of 2s: timeout toxics on both streams, so no byte passes either
//     way (new connections are accepted by the proxy and then swallowed too); removing
//     them closes every connection they held.
//
// Workers run WithLock with TTL 1s (renewed every 333ms) on 4 keys; one section in
// 25 holds for 0.3-1.2s so that renewals run into the faults. Leases are lost in the
// blackholes: that is expected. The section checks its context before every referee
// write and aborts once the lease is lost on the holder's own clock; a holder that
// lost its lease then offers one "zombie" write with its old fence, as a write already
// in flight would, which the fence must stop whenever a newer holder has written.
//
// Pass:
//   - occupancy and lost updates counted by the referee are 0 (every entry and every
//     write was made while the writer's lease was valid on its own clock);
//   - no fenced write of a valid holder is rejected, and fences increase per key in
//     acquisition order;
//   - every error a worker sees from the library (WithLock's result and the cause of a
//     cancelled fn context) is ErrNotObtained, ErrNotHeld, or a Redis/network error
//     wrapped with the "mutex: " prefix; counts per class are logged;
//   - no leak: a lock key whose token no worker reports as held (HSET held:<key> while
//     in WithLock) is a leak once it has been seen so for more than leakGrace after the
//     network was last healthy (see leakSampler for the grace and why); a key whose
//     holder returned with an unconfirmed release must be gone by its lease's end;
//   - after the run, with every worker exited, no lock key is left in the lock Redis.
//
// Positive controls: a raw SET of a worker's lock key with a fake token in the quiet
// tail must be reported as a leak; the end-of-run check must see a key left behind;
// the error classifier must reject an unwrapped network error; and the section must
// register overlaps and lost updates when two run without a lock
// (TestNetworkFaultsControls).

const (
	netTTL      = time.Second
	netStopKey  = "net:stop"     // set by the parent: workers finish once they did their minimum
	overlapLog  = "net:overlaps" // details of every overlap the section saw
	leakGrace   = 250 * time.Millisecond
	sampleEvery = 20 * time.Millisecond
)

func heldKey(k string) string { return "held:" + k } // hash token -> "held" | "gone:<Now at return>"

func init() { registerWorkerMode("network", networkMode) }

// networkMode runs checked sections on random keys until the parent sets netStopKey
// and at least Spec.Sections have run.
func networkMode(ctx context.Context, p *Proc) error {
	ref := p.Ref.Redis()
	for i := 0; ; i++ {
		if ctx.Err() != nil {
			return fmt.Errorf("lifetime ended after %d sections", i)
		}
		if i >= p.Spec.Sections {
			rctx, cancel := refCtx(ctx)
			n, err := ref.Exists(rctx, netStopKey).Result()
			cancel()
			if err != nil {
				return fmt.Errorf("referee: %w", err)
			}
			if n == 1 {
				p.Report.Notes["sections"] = int64(i)
				return nil
			}
		}
		key := p.Spec.Keys[p.Rand.IntN(len(p.Spec.Keys))]
		gapMin, gapMax := p.Spec.Section.GapMin, p.Spec.Section.GapMax
		if p.Rand.IntN(25) == 0 {
			gapMin, gapMax = 300*time.Millisecond, 1200*time.Millisecond
		}
		var (
			fctx   context.Context
			token  string
			secErr error
		)
		a := p.Rec.WithLock(ctx, p.Locks, key, p.Spec.TTL, func(c context.Context, l *mutex.Lock, a *Attempt) error {
			fctx, token = c, l.Token()
			rctx, cancel := refCtx(ctx)
			err := ref.HSet(rctx, heldKey(key), token, "held").Err()
			cancel()
			if err != nil {
				secErr = fmt.Errorf("referee: publish held: %w", err)
				return secErr
			}
			secErr = netSection(c, p, key, l.Fence(), a, gapMin, gapMax)
			return secErr
		})
		if secErr != nil {
			return secErr
		}
		if token != "" {
			rctx, cancel := refCtx(ctx)
			var err error
			if a.Returned == nil {
				err = ref.HDel(rctx, heldKey(key), token).Err() // released, confirmed
			} else {
				// The worker no longer holds it, but the release is not confirmed:
				// the key may stay until its lease ends (see leakSampler).
				err = ref.HSet(rctx, heldKey(key), token, "gone:"+strconv.FormatInt(Now(), 10)).Err()
			}
			cancel()
			if err != nil {
				return fmt.Errorf("referee: publish release: %w", err)
			}
		}
		if a.Returned != nil {
			class, ok := classifyLibErr(a.Returned)
			if !ok {
				p.Report.Notes["unclassified: "+a.Returned.Error()]++
			}
			p.Report.Notes["err:"+class]++
		}
		if fctx != nil {
			if cause := context.Cause(fctx); cause != nil && !errors.Is(cause, context.Canceled) {
				class, ok := classifyLibErr(cause)
				if !ok {
					p.Report.Notes["unclassified cause: "+cause.Error()]++
				}
				p.Report.Notes["cause:"+class]++
			}
		}
	}
}

// netSection is the checked critical section of this scenario. It differs from
// Referee.Section in one way: it checks its context before every referee write and
// leaves as soon as the lease is lost, so every write it makes was made while the
// lease was valid on the holder's own clock. Its steps: enter (INCR occ:k, an overlap
// if not 1, logged to overlapLog), fenced write, GET cnt:k, sleep, SET cnt:k and INCR
// done:k, fenced write, leave (DECR occ:k). After an abort it offers one zombie write
// with its old fence. Fenced writes go to a.Writes with Note "valid" or "zombie";
// aborts are counted in the report's notes by stage.
func netSection(ctx context.Context, p *Proc, k string, fence int64, a *Attempt, gapMin, gapMax time.Duration) (err error) {
	ref := p.Ref.Redis()
	rctx, cancel := refCtx(ctx)
	defer cancel()
	res := &SectionResult{}
	a.Section = res
	aborted := ""
	alive := func(stage string) bool {
		if ctx.Err() != nil {
			aborted = stage
			return false
		}
		return true
	}
	write := func(note string) error {
		ok, err := p.Ref.FencedWrite(rctx, k, fence, a.Writer())
		if err != nil {
			return err
		}
		a.Writes = append(a.Writes, WriteResult{At: Now(), Accepted: ok, Note: note})
		if note == "valid" {
			res.Writes++
			if !ok {
				res.Stale++
			}
			if ctx.Err() != nil {
				p.Report.Notes["valid write answered after the lease ended"]++
			}
		}
		return nil
	}
	defer func() {
		if aborted == "" || err != nil {
			return
		}
		p.Report.Notes["abort:"+aborted]++
		res.Interrupted = true
		err = write("zombie")
	}()

	if !alive("before entering") {
		return nil
	}
	res.Entered = Now()
	n, err := ref.Incr(rctx, occKey(k)).Result()
	if err != nil {
		return fmt.Errorf("referee: enter %s: %w", k, err)
	}
	defer func() {
		if derr := ref.Decr(rctx, occKey(k)).Err(); derr != nil && err == nil {
			err = fmt.Errorf("referee: leave %s: %w", k, derr)
		}
		res.Left = Now()
	}()
	if n != 1 {
		res.Overlap = true
		msg := fmt.Sprintf("%s: writer %s fence %d entered with occ=%d at %d", k, a.Writer(), fence, n, Now())
		if err := ref.RPush(rctx, overlapLog, msg).Err(); err != nil {
			return fmt.Errorf("referee: %w", err)
		}
		if err := ref.Incr(rctx, overlapsKey(k)).Err(); err != nil {
			return fmt.Errorf("referee: count overlap on %s: %w", k, err)
		}
	}
	if !alive("before the first write") {
		return nil
	}
	if err := write("valid"); err != nil {
		return err
	}
	if !alive("before reading the counter") {
		return nil
	}
	v, err := ref.Get(rctx, counterKey(k)).Int64()
	if err != nil && !errors.Is(err, redis.Nil) {
		return fmt.Errorf("referee: read counter %s: %w", k, err)
	}
	gap := gapMin
	if gapMax > gapMin {
		gap += time.Duration(p.Rand.Int64N(int64(gapMax - gapMin)))
	}
	timer := time.NewTimer(gap)
	select {
	case <-timer.C:
	case <-ctx.Done():
		timer.Stop()
	}
	if !alive("in the gap or before the counter write") {
		return nil
	}
	if _, err := ref.TxPipelined(rctx, func(pl redis.Pipeliner) error {
		pl.Set(rctx, counterKey(k), v+1, 0)
		pl.Incr(rctx, doneKey(k))
		return nil
	}); err != nil {
		return fmt.Errorf("referee: write counter %s: %w", k, err)
	}
	res.Counted = true
	if !alive("before the second write") {
		return nil
	}
	return write("valid")
}

// classifyLibErr names the class of an error returned by package mutex, and reports
// whether it is one of the typed kinds: ErrNotObtained, ErrNotHeld, or a Redis or
// network error wrapped with the "mutex: " prefix (every component of a joined error).
func classifyLibErr(err error) (string, bool) {
	msg := err.Error()
	switch {
	case errors.Is(err, mutex.ErrNotObtained):
		return "not-obtained", strings.HasPrefix(msg, "mutex: ")
	case errors.Is(err, mutex.ErrNotHeld):
		sub := "other"
		switch {
		case strings.Contains(msg, "ran out before it could be renewed"):
			sub = "ran out on own clock"
		case strings.Contains(msg, "lost"):
			sub = "Redis said not ours"
		case strings.Contains(msg, "ended before the release"):
			sub = "release found the key gone"
		}
		return "not-held (" + sub + ")", strings.HasPrefix(msg, "mutex: ")
	}
	var classes []string
	for _, leaf := range joinedLeaves(err) {
		m := leaf.Error()
		if !strings.HasPrefix(m, "mutex: ") || errors.Unwrap(leaf) == nil {
			return "UNCLASSIFIED", false
		}
		op := strings.Fields(m)[1] // lock, unlock, extend, ...
		classes = append(classes, "redis/"+op+"/"+netCause(leaf))
	}
	if len(classes) == 0 {
		return "UNCLASSIFIED", false
	}
	return strings.Join(classes, "+"), true
}

func joinedLeaves(err error) []error {
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		var out []error
		for _, e := range j.Unwrap() {
			out = append(out, joinedLeaves(e)...)
		}
		return out
	}
	return []error{err}
}

func netCause(err error) string {
	var ne net.Error
	switch {
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return "EOF"
	case errors.Is(err, syscall.ECONNRESET):
		return "connection reset"
	case errors.Is(err, syscall.EPIPE):
		return "broken pipe"
	case errors.As(err, &ne) && ne.Timeout():
		return "timeout"
	}
	return "other"
}

// ---------------------------------------------------------------------------
// The proxy and the chaos loop

// toxics is the in-process toxiproxy proxy in front of the lock Redis, and a log of
// the fault windows it imposed.
type toxics struct {
	px *toxiproxy.Proxy

	mu      sync.Mutex
	active  int   // faults (not latency) in force
	lastEnd int64 // Now() when the last fault was lifted
	windows []faultWindow
}

type faultWindow struct {
	Kind       string
	Start, End int64
}

// startToxiproxy runs a toxiproxy proxy in this process on a free loopback port in
// front of upstream; t.Cleanup removes every toxic and stops it (closing every
// connection, so its goroutines end).
func startToxiproxy(t *testing.T, upstream string) *toxics {
	t.Helper()
	srv := toxiproxy.NewServer(toxiproxy.NewMetricsContainer(nil), zerolog.Nop())
	px := toxiproxy.NewProxy(srv, "lock-redis", "127.0.0.1:0", upstream)
	if err := px.Start(); err != nil {
		t.Fatalf("toxiproxy: %v", err)
	}
	t.Cleanup(func() {
		px.Toxics.ResetToxics(context.Background())
		px.Stop()
	})
	return &toxics{px: px}
}

func (tx *toxics) Addr() string { return tx.px.Listen }

// add adds a toxic; attrs is its JSON attributes.
func (tx *toxics) add(name, typ, stream string, toxicity float64, attrs string) error {
	js := fmt.Sprintf(`{"name":%q,"type":%q,"stream":%q,"toxicity":%g,"attributes":%s}`, name, typ, stream, toxicity, attrs)
	_, err := tx.px.Toxics.AddToxicJson(strings.NewReader(js))
	if err != nil {
		return fmt.Errorf("toxiproxy: add %s: %w", name, err)
	}
	return nil
}

func (tx *toxics) remove(name string) error {
	if err := tx.px.Toxics.RemoveToxic(context.Background(), name); err != nil {
		return fmt.Errorf("toxiproxy: remove %s: %w", name, err)
	}
	return nil
}

// fault adds toxics (name, type, stream, toxicity, attributes) for d, then removes
// them, and records the window. ctx ending cuts d short.
func (tx *toxics) fault(ctx context.Context, kind string, d time.Duration, specs ...[5]string) error {
	tx.mu.Lock()
	tx.active++
	tx.mu.Unlock()
	start := Now()
	var added []string
	var err error
	for _, x := range specs {
		tox, _ := strconv.ParseFloat(x[3], 64)
		if err = tx.add(x[0], x[1], x[2], tox, x[4]); err != nil {
			break
		}
		added = append(added, x[0])
	}
	if err == nil {
		sleepCtx(ctx, d)
	}
	for _, name := range added {
		if rerr := tx.remove(name); rerr != nil && err == nil {
			err = rerr
		}
	}
	end := Now()
	tx.mu.Lock()
	tx.active--
	tx.lastEnd = end
	tx.windows = append(tx.windows, faultWindow{kind, start, end})
	tx.mu.Unlock()
	return err
}

// quiet reports whether no fault is in force, and since when.
func (tx *toxics) quiet() (bool, int64) {
	tx.mu.Lock()
	defer tx.mu.Unlock()
	return tx.active == 0, tx.lastEnd
}

func (tx *toxics) faultWindows() []faultWindow {
	tx.mu.Lock()
	defer tx.mu.Unlock()
	return slices.Clone(tx.windows)
}

func sleepCtx(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
}

func between(rng *rand.Rand, lo, hi time.Duration) time.Duration {
	return lo + time.Duration(rng.Int64N(int64(hi-lo)+1))
}

// chaosCycle is one round of every fault of the scenario (about 24s).
func chaosCycle(ctx context.Context, t *testing.T, tx *toxics, rng *rand.Rand, counts map[string]int) {
	fail := func(err error) bool {
		if err != nil {
			t.Errorf("chaos: %v", err)
			return true
		}
		return ctx.Err() != nil
	}
	// Latency with jitter, alone and then under the reset bursts.
	if fail(tx.add("lat_up", "latency", "upstream", 1, `{"latency":5,"jitter":5}`)) ||
		fail(tx.add("lat_down", "latency", "downstream", 1, `{"latency":5,"jitter":5}`)) {
		return
	}
	counts["latency phases"]++
	sleepCtx(ctx, 3*time.Second)
	for i := 0; i < 8 && ctx.Err() == nil; i++ {
		d := between(rng, 100*time.Millisecond, 300*time.Millisecond)
		var err error
		switch i % 3 {
		case 0:
			err = tx.fault(ctx, "reset downstream", d, [5]string{"rst_down", "reset_peer", "downstream", "1", `{"timeout":0}`})
		case 1:
			err = tx.fault(ctx, "reset upstream", d, [5]string{"rst_up", "reset_peer", "upstream", "1", `{"timeout":0}`})
		default:
			err = tx.fault(ctx, "reset both ways at 0.5", d,
				[5]string{"rst_down", "reset_peer", "downstream", "0.5", `{"timeout":0}`},
				[5]string{"rst_up", "reset_peer", "upstream", "0.5", `{"timeout":0}`})
		}
		if fail(err) {
			return
		}
		counts["reset bursts"]++
		sleepCtx(ctx, between(rng, 300*time.Millisecond, 800*time.Millisecond))
	}
	if fail(tx.remove("lat_up")) || fail(tx.remove("lat_down")) {
		return
	}
	// Reply drops: the request is applied, the reply swallowed until the toxic goes.
	for i := 0; i < 6 && ctx.Err() == nil; i++ {
		tox := "1"
		if i%2 == 1 {
			tox = "0.5"
		}
		d := between(rng, 150*time.Millisecond, 400*time.Millisecond)
		if fail(tx.fault(ctx, "reply drop", d, [5]string{"drop_down", "timeout", "downstream", tox, `{"timeout":0}`})) {
			return
		}
		counts["reply drops"]++
		sleepCtx(ctx, between(rng, 400*time.Millisecond, 800*time.Millisecond))
	}
	// Two blackholes of 2s: nothing passes either way.
	for i := 0; i < 2 && ctx.Err() == nil; i++ {
		sleepCtx(ctx, time.Second)
		if fail(tx.fault(ctx, "blackhole", 2*time.Second,
			[5]string{"bh_up", "timeout", "upstream", "1", `{"timeout":0}`},
			[5]string{"bh_down", "timeout", "downstream", "1", `{"timeout":0}`})) {
			return
		}
		counts["blackholes"]++
		sleepCtx(ctx, 1500*time.Millisecond)
	}
}

// ---------------------------------------------------------------------------
// Leak sampler

// leakSampler reads every lock key directly from the lock Redis (never through the
// proxy) every sampleEvery, and the holders the workers publish on the referee.
//
// A key whose token no worker reports is an orphan. Orphans are normal for an
// instant: between Redis granting a lock and the holder publishing it (one reply and
// one referee write: milliseconds, ~20ms with the latency toxic), and while a reply is
// lost in a fault, when go-redis is still waiting for it or retrying, or the library
// is abandoning the attempt. None of that can outlast the fault by much: removing a
// toxic closes the connections it held, go-redis retries within 8-40ms, and either the
// retry finds our token (the holder publishes it) or the attempt fails and the library
// releases what it may have taken. So an orphan is a leak when it is still there more
// than leakGrace (250ms, a quarter of the TTL) after the network was last healthy
// (no reset, reply drop or blackhole in force; latency alone counts as healthy) and
// after it was first seen, unless a worker reports its token held later: then a worker
// held it and was slow to say so (the sampler counts those). A key whose holder
// returned with an unconfirmed release
// ("gone:<t>") may stay until its lease runs out: it is a leak if still there after
// t + TTL + 200ms.
type leakSampler struct {
	lock, ref *redis.Client
	keys      []string
	tx        *toxics

	mu       sync.Mutex
	samples  int
	open     map[string]*orphan // key + " " + token
	episodes []*orphan
}

type orphan struct {
	key, token, state string
	first, last       int64
	maxQuietAge       time.Duration // longest age past the network's recovery
	leak              string        // why it is a leak, or ""
	reportedLate      bool          // a worker reported it held after it was seen an orphan
}

func (o *orphan) control() bool { return strings.HasPrefix(o.token, "control-") }

func (s *leakSampler) run(ctx context.Context, t *testing.T) {
	tick := time.NewTicker(sampleEvery)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			s.close()
			return
		case <-tick.C:
		}
		if err := s.sample(ctx); err != nil && ctx.Err() == nil {
			t.Errorf("leak sampler: %v", err)
			return
		}
	}
}

func (s *leakSampler) sample(ctx context.Context) error {
	rkeys := make([]string, len(s.keys))
	for i, k := range s.keys {
		rkeys[i] = RedisLockKey(k)
	}
	vals, err := s.lock.MGet(ctx, rkeys...).Result()
	if err != nil {
		return fmt.Errorf("lock Redis: %w", err)
	}
	type seen struct{ key, token string }
	var found []seen
	for i, v := range vals {
		str, ok := v.(string)
		tok, held := HolderOf(str)
		if !ok || !held { // free, or a released lock's tombstone
			continue
		}
		found = append(found, seen{s.keys[i], tok})
	}
	states := make([]*redis.StringCmd, len(found))
	if len(found) > 0 {
		_, err = s.ref.Pipelined(ctx, func(p redis.Pipeliner) error {
			for i, f := range found {
				states[i] = p.HGet(ctx, heldKey(f.key), f.token)
			}
			return nil
		})
		if err != nil && !errors.Is(err, redis.Nil) {
			return fmt.Errorf("referee: %w", err)
		}
	}
	now := Now()
	quiet, since := s.tx.quiet()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.samples++
	still := map[string]bool{}
	for i, f := range found {
		state := states[i].Val() // "" when no worker reports it
		id := f.key + " " + f.token
		if state == "held" {
			// A worker reports it after all: it held the key, and was slow to say so
			// (a process the loaded machine did not run for a while). No leak.
			if o := s.open[id]; o != nil {
				o.reportedLate, o.leak = true, ""
			}
			continue
		}
		still[id] = true
		o := s.open[id]
		if o == nil {
			o = &orphan{key: f.key, token: f.token, first: now}
			s.open[id] = o
		}
		o.last, o.state = now, state
		if o.leak != "" {
			continue
		}
		if gone, ok := strings.CutPrefix(state, "gone:"); ok {
			at, _ := strconv.ParseInt(gone, 10, 64)
			if over := time.Duration(now-at) - netTTL - 200*time.Millisecond; over > 0 {
				o.leak = fmt.Sprintf("its holder returned without confirming the release %v earlier, and the key outlived the lease", Ms(time.Duration(now-at)))
			}
			continue
		}
		if !quiet {
			continue
		}
		age := time.Duration(now - max(o.first, since))
		o.maxQuietAge = max(o.maxQuietAge, age)
		if age > leakGrace {
			o.leak = fmt.Sprintf("no worker holds it, %v after the network recovered and %v after it was first seen", Ms(time.Duration(now-since)), Ms(time.Duration(now-o.first)))
		}
	}
	for id, o := range s.open {
		if !still[id] {
			delete(s.open, id)
			s.episodes = append(s.episodes, o)
		}
	}
	return nil
}

func (s *leakSampler) close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for id, o := range s.open {
		delete(s.open, id)
		s.episodes = append(s.episodes, o)
	}
}

// leftLockKeys returns the held lock keys (not wait queues, or the tombstones that a
// release leaves for a while) in the lock Redis.
func leftLockKeys(ctx context.Context, rdb *redis.Client) ([]string, error) {
	var out []string
	iter := rdb.Scan(ctx, 0, mutex.DefaultPrefix+"*", 100).Iterator()
	for iter.Next(ctx) {
		k := iter.Val()
		if !strings.HasSuffix(k, "}") {
			continue
		}
		v, err := rdb.Get(ctx, k).Result()
		if errors.Is(err, redis.Nil) {
			continue
		}
		if err != nil {
			return nil, err
		}
		if _, held := HolderOf(v); held {
			out = append(out, k)
		}
	}
	return out, iter.Err()
}

// ---------------------------------------------------------------------------
// The test

func TestNetworkFaults(t *testing.T) {
	workers := Count(t, "workers", 6, 8)
	minSections := Count(t, "sections per worker (minimum; they go on until the chaos is over)", 250, 1000)
	cycles := Count(t, "fault cycles (each: latency, 8 reset bursts, 6 reply drops, 2 blackholes of 2s)", 1, 3)
	lifetime := 3 * time.Minute
	if Long() {
		lifetime = 10 * time.Minute
	}
	rig := NewRig(t)
	tx := startToxiproxy(t, rig.Lock.Addr())
	keys := Keys("net", 4)
	ref := rig.Referee.Redis()
	start := Now()

	sampler := &leakSampler{lock: rig.LockRDB, ref: ref, keys: keys, tx: tx, open: map[string]*orphan{}}
	sctx, stopSampler := context.WithCancel(context.Background())
	sampled := make(chan struct{})
	go func() { defer close(sampled); sampler.run(sctx, t) }()
	defer func() { stopSampler(); <-sampled }()

	ws := make([]*Worker, workers)
	for i := range ws {
		ws[i] = StartWorker(t, WorkerSpec{
			Mode: "network", ID: i + 1, LockAddr: tx.Addr(), RefereeAddr: rig.Referee.Addr(),
			Keys: keys, TTL: netTTL, Sections: minSections, Lifetime: lifetime,
			Section: SectionConfig{GapMin: 200 * time.Microsecond, GapMax: 2 * time.Millisecond},
		})
	}

	// The chaos loop, bounded: it ends early only if a worker exits first.
	cctx, stopChaos := context.WithCancel(context.Background())
	go func() {
		for _, w := range ws {
			<-w.done
		}
		stopChaos()
	}()
	rng := rand.New(rand.NewPCG(uint64(start), 5))
	counts := map[string]int{}
	sleepCtx(cctx, time.Second)
	for c := 0; c < cycles && cctx.Err() == nil; c++ {
		chaosCycle(cctx, t, tx, rng, counts)
	}
	chaosEnd := Now()
	if cctx.Err() != nil {
		t.Errorf("a worker exited during the chaos")
	}

	// Quiet tail, with the leak checker's positive control: a raw SET of a worker's
	// key with a fake token, which no worker will ever publish.
	controlToken := "control-" + strconv.FormatInt(Now(), 36)
	var controlSet int64
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline) && controlSet == 0; {
		// Set it only while the lock is free: absent, or a released lock's tombstone.
		ok, err := rig.LockRDB.Eval(context.Background(), `local v = redis.call('GET', KEYS[1])
if v and string.byte(v, 17) ~= 114 then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1`, []string{RedisLockKey(keys[0])}, HeldValue(1, controlToken), 700).Bool()
		if err != nil {
			t.Fatalf("control: %v", err)
		}
		if ok {
			controlSet = Now()
		} else {
			time.Sleep(2 * time.Millisecond)
		}
	}
	if controlSet == 0 {
		t.Errorf("control: could not SET %s for 5s", keys[0])
	}
	time.Sleep(2 * time.Second)
	if err := ref.Set(context.Background(), netStopKey, 1, 0).Err(); err != nil {
		t.Fatalf("referee: %v", err)
	}
	var reports []*WorkerReport
	for _, w := range ws {
		reports = append(reports, w.Wait(t, lifetime+30*time.Second))
	}
	elapsed := Since(start)
	stopSampler()
	<-sampled

	// After the run: no lock key left (positive control: a key left behind is seen).
	ctx := context.Background()
	left, err := leftLockKeys(ctx, rig.LockRDB)
	if err != nil {
		t.Fatalf("lock Redis: %v", err)
	}
	if len(left) != 0 {
		t.Errorf("%d lock keys left after every worker exited: %v", len(left), left)
	}
	ctl := RedisLockKey("net:control")
	if err := rig.LockRDB.Set(ctx, ctl, "1:control-left", 0).Err(); err != nil {
		t.Fatal(err)
	}
	if got, _ := leftLockKeys(ctx, rig.LockRDB); !slices.Contains(got, ctl) {
		t.Errorf("control: the end-of-run check did not see a key left behind: %v", got)
	}
	rig.LockRDB.Del(ctx, ctl)

	// Gather.
	var attempts []Attempt
	notes := map[string]int64{}
	for _, rep := range reports {
		attempts = append(attempts, rep.Attempts...)
		for k, v := range rep.Notes {
			notes[k] += v
		}
	}
	per, total := rig.Referee.Tally(t, keys)
	_ = per
	kinds := map[ErrKind]int{}
	sections, completed, lostLeases, afterChaos := 0, 0, 0, 0
	validWrites, validRejected, zombies, zombiesRejected := 0, 0, 0, 0
	byKey := map[string][]Attempt{}
	for _, a := range attempts {
		kinds[a.Kind]++
		if !a.Ran() {
			continue
		}
		sections++
		byKey[a.Key] = append(byKey[a.Key], a)
		if a.Section != nil && a.Section.Counted && !a.Section.Interrupted {
			completed++
		}
		if a.LostAt != 0 || a.Kind == KindNotHeld {
			lostLeases++
		}
		if a.Acquired > chaosEnd && a.Kind == KindOK {
			afterChaos++
		}
		for _, w := range a.Writes {
			switch w.Note {
			case "valid":
				validWrites++
				if !w.Accepted {
					validRejected++
					t.Errorf("a valid holder's fenced write was rejected: attempt %d on %s, fence %d", a.ID, a.Key, a.Fence)
				}
			case "zombie":
				zombies++
				if !w.Accepted {
					zombiesRejected++
				}
			}
		}
	}
	for k, as := range byKey {
		sort.Slice(as, func(i, j int) bool { return as[i].Acquired < as[j].Acquired })
		for i := 1; i < len(as); i++ {
			if as[i].Fence <= as[i-1].Fence {
				t.Errorf("%s: fence %d (attempt %d) acquired after fence %d (attempt %d)", k, as[i].Fence, as[i].ID, as[i-1].Fence, as[i-1].ID)
			}
		}
	}

	// Leaks.
	sampler.mu.Lock()
	episodes := slices.Clone(sampler.episodes)
	samples := sampler.samples
	sampler.mu.Unlock()
	var leaks, controlLeaks []*orphan
	var orphanAges, quietAges, lateAges []time.Duration
	for _, o := range episodes {
		if o.reportedLate {
			lateAges = append(lateAges, time.Duration(o.last-o.first))
		}
		if o.control() {
			if o.leak != "" {
				controlLeaks = append(controlLeaks, o)
			}
			continue
		}
		orphanAges = append(orphanAges, time.Duration(o.last-o.first))
		if o.maxQuietAge > 0 {
			quietAges = append(quietAges, o.maxQuietAge)
		}
		if o.leak != "" {
			leaks = append(leaks, o)
		}
	}

	if dir := os.Getenv(ArtifactsEnv); dir != "" {
		b, _ := json.Marshal(map[string]any{"start": start, "chaosEnd": chaosEnd, "faults": tx.faultWindows(), "attempts": attempts})
		path := filepath.Join(dir, "network-faults.json")
		if err := os.WriteFile(path, b, 0o644); err != nil {
			t.Logf("artifacts: %v", err)
		} else {
			t.Logf("attempts and fault windows written to %s", path)
		}
	}

	// Report.
	var fw []string
	for _, w := range tx.faultWindows() {
		fw = append(fw, fmt.Sprintf("%s@%.1fs+%s", w.Kind, float64(w.Start-start)/1e9, Ms(time.Duration(w.End-w.Start))))
	}
	t.Logf("%d workers, %d keys, TTL %v, in %v (chaos %v): faults %v", workers, len(keys), netTTL,
		elapsed.Round(time.Millisecond), time.Duration(chaosEnd-start).Round(time.Millisecond), counts)
	t.Logf("fault windows: %s", strings.Join(fw, ", "))
	t.Logf("WithLock calls %d: %d sections ran, %d completed their increment, %d ran after the chaos; outcomes %v",
		len(attempts), sections, completed, afterChaos, kinds)
	t.Logf("leases lost: %d; sections aborted by stage: %v", lostLeases, filterNotes(notes, "abort:"))
	t.Logf("checkers: %v", total)
	t.Logf("fenced writes: %d valid (%d rejected), %d zombie writes after a lost lease (%d rejected as stale, %d accepted: no newer holder had written)",
		validWrites, validRejected, zombies, zombiesRejected, zombies-zombiesRejected)
	t.Logf("library errors by class (WithLock results): %v", filterNotes(notes, "err:"))
	t.Logf("causes of cancelled fn contexts: %v", filterNotes(notes, "cause:"))
	if n := notes["valid write answered after the lease ended"]; n > 0 {
		t.Logf("valid writes whose lease ended while they were in flight: %d", n)
	}
	t.Logf("leak sampler: %d samples; %d orphan episodes (key held by a token no worker reports), lifetime %s; age past the network's recovery %s (grace %v); reported held late by a worker: %d, lifetime %s",
		samples, len(orphanAges), Dist(orphanAges), Dist(quietAges), leakGrace, len(lateAges), Dist(lateAges))
	t.Logf("positive control: fake token SET at %.1fs, reported as a leak: %d", float64(controlSet-start)/1e9, len(controlLeaks))

	// Judge.
	if total.Overlaps != 0 {
		log, _ := ref.LRange(ctx, overlapLog, -10, -1).Result()
		t.Errorf("occupancy: %d overlaps among holders whose lease was valid on their own clock, want 0; last: %q", total.Overlaps, log)
	}
	if total.Lost != 0 {
		t.Errorf("lost updates: %d, want 0", total.Lost)
	}
	if total.Occupied != 0 {
		t.Errorf("occupancy left at the end: %d", total.Occupied)
	}
	for k, v := range notes {
		if strings.HasPrefix(k, "unclassified") {
			t.Errorf("untyped library error (%d times): %s", v, k)
		}
	}
	for _, o := range leaks {
		t.Errorf("leak: %s held by token %s (state %q) for %v: %s", o.key, o.token, o.state, Ms(time.Duration(o.last-o.first)), o.leak)
	}
	if controlSet != 0 && len(controlLeaks) == 0 {
		t.Errorf("control: the fake token on %s was not reported as a leak: the leak checker is broken", keys[0])
	}
	if lostLeases == 0 {
		t.Errorf("no lease was lost: the blackholes did not hit any holder")
	}
	if afterChaos == 0 {
		t.Errorf("no section completed after the chaos: service did not resume")
	}
}

// TestNetworkFaultsControls are the positive controls of this scenario's own parts:
// the error classifier must reject an error that is not one of the typed kinds, and
// netSection must register overlaps and lost updates when two run without a lock.
func TestNetworkFaultsControls(t *testing.T) {
	for _, err := range []error{io.EOF, errors.New("dial tcp: connection refused"), fmt.Errorf("lock: %w", io.EOF),
		errors.Join(fmt.Errorf("mutex: unlock \"k\": %w", io.EOF), io.EOF)} {
		if class, ok := classifyLibErr(err); ok {
			t.Errorf("classifier accepted %q as %s", err, class)
		}
	}
	for _, err := range []error{fmt.Errorf("mutex: lock \"k\": %w", io.EOF), fmt.Errorf("mutex: x: %w", mutex.ErrNotHeld), mutex.ErrNotObtained} {
		if class, ok := classifyLibErr(err); !ok {
			t.Errorf("classifier rejected %q (%s)", err, class)
		}
	}

	ref := StartReferee(t)
	var wg sync.WaitGroup
	for i := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			time.Sleep(time.Duration(i) * 50 * time.Millisecond)
			p := &Proc{Ref: ref.RefereeClient, Rand: rand.New(rand.NewPCG(1, uint64(i))), Report: &WorkerReport{Notes: map[string]int64{}}}
			a := &Attempt{ID: int64(i + 1)}
			if err := netSection(context.Background(), p, "ctl", int64(10+i), a, 200*time.Millisecond, 200*time.Millisecond); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	if _, tl := ref.Tally(t, []string{"ctl"}); tl.Overlaps != 1 || tl.Lost != 1 {
		t.Errorf("two unlocked sections: %v; want overlaps=1 lost-updates=1", tl)
	}
}

// TestNetworkFaultsLostReleaseReply is a finding (it fails until the library changes):
// when the reply to a release is lost after Redis applied it, go-redis retries the
// release on a new connection, plain_release.lua finds the key gone and returns 0, and the
// library reports ErrNotHeld: Unlock says the lease had expired, and WithLock says
// "lease ... ended before the release", which the middleware turns into a failed task
// ("another worker may have run concurrently") that asynq runs again, although the
// lock was held throughout and released exactly once. DESIGN.md: "release/extend are
// safe to repeat"; they are safe, but a repeated release is misreported.
func TestNetworkFaultsLostReleaseReply(t *testing.T) {
	rig := NewRig(t)
	tx := startToxiproxy(t, rig.Lock.Addr())
	rdb := redis.NewClient(&redis.Options{Addr: tx.Addr()})
	defer rdb.Close()
	locks := mutex.New(rdb)
	defer locks.Close()
	ctx := context.Background()
	// Load the scripts, so that the next release is one EVALSHA that Redis applies.
	warm, err := locks.TryLock(ctx, "net:warm", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := warm.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	// Swallow replies (the downstream stream) for 200ms, then lift the fault, which
	// closes the connection that waits for the reply.
	dropReplies := func() {
		if err := tx.add("drop_down", "timeout", "downstream", 1, `{"timeout":0}`); err != nil {
			t.Fatal(err)
		}
		time.AfterFunc(200*time.Millisecond, func() {
			if err := tx.remove("drop_down"); err != nil {
				t.Error(err)
			}
		})
	}
	held := func(key string) bool {
		locked, err := mutex.New(rig.LockRDB).Locked(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		return locked
	}

	t.Run("Unlock", func(t *testing.T) {
		l, err := locks.TryLock(ctx, "net:unlock", 10*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		dropReplies()
		err = l.Unlock(ctx)
		if held("net:unlock") {
			t.Fatalf("the key is still held: the release was not applied (%v)", err)
		}
		if err != nil {
			t.Errorf("Unlock of a lock held throughout, whose release Redis applied = %v, want nil (errors.Is ErrNotHeld: %v)", err, errors.Is(err, mutex.ErrNotHeld))
		}
	})
	t.Run("WithLock", func(t *testing.T) {
		err := locks.WithLock(ctx, "net:withlock", 10*time.Second, func(context.Context) error {
			dropReplies()
			return nil
		})
		if held("net:withlock") {
			t.Fatalf("the key is still held: the release was not applied (%v)", err)
		}
		if err != nil {
			t.Errorf("WithLock whose lease never lapsed = %v, want nil (errors.Is ErrNotHeld: %v)", err, errors.Is(err, mutex.ErrNotHeld))
		}
	})
	time.Sleep(300 * time.Millisecond) // the last AfterFunc
}

func filterNotes(notes map[string]int64, prefix string) map[string]int64 {
	out := map[string]int64{}
	for k, v := range notes {
		if s, ok := strings.CutPrefix(k, prefix); ok {
			out[s] = v
		}
	}
	return out
}
