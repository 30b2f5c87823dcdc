//go:build unix

package chaos

// The semaphore scenarios: a key taken with mutex.Limit(3) by 16 workers spread over
// 4 processes. Two checkers judge occupancy:
//
//   - at most 3: every section INCRs a counter on the referee on entry and DECRs it on
//     exit; the highest value it reached must be 3 (and must reach 3: the test also
//     shows the limit was used);
//   - never fewer than 3 while others wait: a sampler in the parent reads, in one
//     script on the lock Redis, the slots whose lease is running and the length of
//     the key's queue; a sample with waiters queued and fewer than 3 live slots is a
//     slot left idle, which a release that hands over in the same script never
//     leaves. It is read on the Redis side because an application-level count has
//     gaps between a holder's exit and its release.
//
// Fences must all differ. Positive controls: workers that ask for Limit(4) (a limit
// of 4 enforced where 3 is checked) trip both "at most 3" checks; workers that free
// their slot with a raw HDEL instead of the release script (a release that does not
// hand over) trip the idle-slot check. A holder killed with SIGKILL must free its slot
// within its lease plus the waiter's jitter; its control is a holder whose lease is
// longer than the bound assumes.

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex/mutex"
)

const (
	semChecked    = 3 // the limit the checkers hold the workers to
	semGoroutines = 4 // workers per process
)

func init() {
	registerWorkerMode("sem:limit3", func(ctx context.Context, p *Proc) error { return semMode(ctx, p, 3, false) })
	registerWorkerMode("sem:limit4", func(ctx context.Context, p *Proc) error { return semMode(ctx, p, 4, false) })
	registerWorkerMode("sem:limit3:no-handover", func(ctx context.Context, p *Proc) error { return semMode(ctx, p, 3, true) })
	registerWorkerMode("sem:hold", semHoldMode)
}

// Referee keys of the semaphore scenarios, per lock key k.
func semOccKey(k string) string    { return "semocc:" + k }    // holders in the section now
func semMaxKey(k string) string    { return "semmax:" + k }    // the most there ever were
func semOverKey(k string) string   { return "semover:" + k }   // entries that found semChecked inside
func semFencesKey(k string) string { return "semfences:" + k } // every fence a section ran under

// semEnterScript counts a holder into the section and returns how many are inside.
var semEnterScript = redis.NewScript(`
local v = redis.call('INCR', KEYS[1])
if v > tonumber(redis.call('GET', KEYS[2]) or '0') then
  redis.call('SET', KEYS[2], v)
end
if v > tonumber(ARGV[1]) then
  redis.call('INCR', KEYS[3])
end
redis.call('SADD', KEYS[4], ARGV[2])
return v`)

// semSection is one checked section under a slot with fence f: enter, hold for a
// random time in [cfg.GapMin, cfg.GapMax), leave.
func semSection(ctx context.Context, ref *RefereeClient, key string, f int64, cfg SectionConfig, rng *rand.Rand) error {
	rctx, cancel := refCtx(ctx)
	defer cancel()
	keys := []string{semOccKey(key), semMaxKey(key), semOverKey(key), semFencesKey(key)}
	if err := semEnterScript.Run(rctx, ref.Redis(), keys, semChecked, f).Err(); err != nil {
		return fmt.Errorf("referee: enter %s: %w", key, err)
	}
	hold := cfg.GapMin
	if cfg.GapMax > cfg.GapMin {
		hold += time.Duration(rng.Int64N(int64(cfg.GapMax - cfg.GapMin)))
	}
	time.Sleep(hold)
	if err := ref.Redis().Decr(rctx, semOccKey(key)).Err(); err != nil {
		return fmt.Errorf("referee: leave %s: %w", key, err)
	}
	return nil
}

// semMode runs semGoroutines workers, each performing Spec.Sections checked sections
// on Keys[0] with mutex.Limit(limit). With rawRelease, a worker takes its slot with
// Lock and frees it with a raw HDEL of its holder field, which hands nothing over,
// then pauses 20ms before it asks again: a deliberately broken release.
func semMode(ctx context.Context, p *Proc, limit int, rawRelease bool) error {
	key := p.Spec.Keys[0]
	rkey := RedisLockKey(key)
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		first error
	)
	fail := func(err error) {
		mu.Lock()
		if first == nil {
			first = err
		}
		mu.Unlock()
	}
	for g := range semGoroutines {
		rng := rand.New(rand.NewPCG(p.Spec.Seed, uint64(p.Spec.ID*100+g)))
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < p.Spec.Sections; i++ {
				if ctx.Err() != nil {
					fail(fmt.Errorf("lifetime ended after %d of %d sections", i, p.Spec.Sections))
					return
				}
				if rawRelease {
					l, err := p.Locks.Lock(ctx, key, p.Spec.TTL, mutex.Limit(limit))
					if err != nil {
						fail(err)
						return
					}
					if err := semSection(ctx, p.Ref, key, l.Fence(), p.Spec.Section, rng); err != nil {
						fail(err)
						return
					}
					field := fmt.Sprintf("h%04d%s", len(l.Token()), l.Token())
					if err := p.Lock.HDel(ctx, rkey, field).Err(); err != nil {
						fail(err)
						return
					}
					time.Sleep(20 * time.Millisecond)
					continue
				}
				err := p.Locks.WithLock(ctx, key, p.Spec.TTL, func(ctx context.Context) error {
					l, _ := mutex.FromContext(ctx)
					return semSection(ctx, p.Ref, key, l.Fence(), p.Spec.Section, rng)
				}, mutex.Limit(limit))
				if err != nil {
					fail(fmt.Errorf("section %d: %w", i, err))
					return
				}
			}
		}()
	}
	wg.Wait()
	return first
}

// semSampleScript reads, atomically, the slots of a Limit(n) lock whose lease is
// running (its fields "h…" hold "<lease end ms> …", see mutex/layout.go) and the
// length of its queue.
var semSampleScript = redis.NewScript(`
local t = redis.call('TIME')
local ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local live = 0
local ty = redis.call('TYPE', KEYS[1])
if (type(ty) == 'table' and ty.ok or ty) == 'hash' then
  local all = redis.call('HGETALL', KEYS[1])
  for i = 1, #all, 2 do
    if string.byte(all[i], 1) == 104 and (tonumber(string.match(all[i + 1], '^%d+')) or 0) > ms then
      live = live + 1
    end
  end
end
return {live, redis.call('LLEN', KEYS[2])}`)

// semSamples is what the sampler saw.
type semSamples struct {
	N        int // samples taken
	Queued   int // samples with waiters queued
	Full     int // samples with waiters queued and semChecked slots live
	Idle     int // samples with waiters queued and fewer than semChecked slots live: a violation
	MostLive int64
	Example  string // the first idle sample
}

// sampleSemaphore samples key every 500µs until ctx is done (at most 10 minutes).
func sampleSemaphore(ctx context.Context, rdb *redis.Client, key string) (semSamples, error) {
	var s semSamples
	keys := []string{RedisLockKey(key), RedisLockKey(key) + ":slots"} // the queue of Limit(n)
	tick := time.NewTicker(500 * time.Microsecond)
	defer tick.Stop()
	limit := time.After(10 * time.Minute)
	for {
		select {
		case <-ctx.Done():
			return s, nil
		case <-limit:
			return s, nil
		case <-tick.C:
		}
		rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		r, err := semSampleScript.Run(rctx, rdb, keys).Int64Slice()
		cancel()
		if err != nil {
			if ctx.Err() != nil {
				return s, nil
			}
			return s, fmt.Errorf("sampler: %w", err)
		}
		live, queued := r[0], r[1]
		s.N++
		s.MostLive = max(s.MostLive, live)
		if queued > 0 {
			s.Queued++
			if live >= semChecked {
				s.Full++
			} else {
				s.Idle++
				if s.Example == "" {
					s.Example = fmt.Sprintf("%d waiters queued, %d of %d slots live", queued, live, semChecked)
				}
			}
		}
	}
}

// semRun is what a run of semaphore workers produced.
type semRun struct {
	Samples                  semSamples
	MaxOcc, Over, Fences     int64
	Elapsed                  time.Duration
	WorkersDone, WorkersFail int
}

// runSemaphore runs procs worker processes of mode on key with the sampler alongside,
// and reads the referee's counts.
func runSemaphore(t *testing.T, rig *Rig, mode, key string, procs, sections int, ttl time.Duration, hold SectionConfig) semRun {
	t.Helper()
	start := Now()
	workers := make([]*Worker, procs)
	for i := range workers {
		workers[i] = StartWorker(t, WorkerSpec{
			Mode: mode, ID: i + 1, LockAddr: rig.Lock.Addr(), RefereeAddr: rig.Referee.Addr(),
			Keys: []string{key}, TTL: ttl, Sections: sections, Section: hold, Lifetime: 90 * time.Second,
		})
	}
	ctx, stop := context.WithCancel(context.Background())
	var (
		samples semSamples
		serr    error
		done    = make(chan struct{})
	)
	go func() {
		defer close(done)
		samples, serr = sampleSemaphore(ctx, rig.LockRDB, key)
	}()
	for _, w := range workers {
		w.Wait(t, 2*time.Minute)
	}
	stop()
	<-done
	if serr != nil {
		t.Fatal(serr)
	}
	res := semRun{Samples: samples, Elapsed: Since(start)}
	rctx, cancel := refCtx(context.Background())
	defer cancel()
	ref := rig.Referee.Redis()
	res.MaxOcc, _ = ref.Get(rctx, semMaxKey(key)).Int64()
	res.Over, _ = ref.Get(rctx, semOverKey(key)).Int64()
	res.Fences, _ = ref.SCard(rctx, semFencesKey(key)).Result()
	t.Logf("%s: %d processes x %d workers x %d sections in %v: most in the section at once %d, entries beyond %d: %d, distinct fences %d",
		mode, procs, semGoroutines, sections, res.Elapsed.Round(time.Millisecond), res.MaxOcc, semChecked, res.Over, res.Fences)
	t.Logf("sampler: %d samples, %d with waiters queued (%d with every slot live, %d with a slot idle%s), most live slots %d",
		samples.N, samples.Queued, samples.Full, samples.Idle, exampleText(samples.Example), samples.MostLive)
	return res
}

func exampleText(e string) string {
	if e == "" {
		return ""
	}
	return ": first " + e
}

// TestSemaphoreUnderContention: 16 workers (4 processes x 4) take one key with
// Limit(3), TTL 2s, no faults. Pass: every section runs; never more than 3 in the
// section (referee) or live in Redis (sampler), and 3 is reached; no sample shows
// waiters queued while a slot is idle, and many show waiters queued; all fences
// differ. Controls: TestSemaphoreCheckersTrip.
func TestSemaphoreUnderContention(t *testing.T) {
	sections := Count(t, "sections per worker", 40, 400)
	rig := NewRig(t)
	key := "sem-contention"
	res := runSemaphore(t, rig, "sem:limit3", key, 4, sections, 2*time.Second,
		SectionConfig{GapMin: time.Millisecond, GapMax: 4 * time.Millisecond})
	total := int64(4 * semGoroutines * sections)
	if res.MaxOcc != semChecked || res.Over != 0 {
		t.Errorf("occupancy: at most %d at once (%d entries beyond %d), want exactly %d", res.MaxOcc, res.Over, semChecked, semChecked)
	}
	if res.Samples.MostLive > semChecked {
		t.Errorf("sampler: %d live slots at once, want at most %d", res.Samples.MostLive, semChecked)
	}
	if res.Samples.Idle != 0 {
		t.Errorf("sampler: %d samples with waiters queued and a slot idle (%s), want 0", res.Samples.Idle, res.Samples.Example)
	}
	if res.Samples.Full < 10 {
		t.Errorf("sampler: only %d samples with waiters queued: the idle-slot check was not exercised", res.Samples.Full)
	}
	if res.Fences != total {
		t.Errorf("fences: %d distinct over %d sections, want one per section", res.Fences, total)
	}
}

// TestSemaphoreCheckersTrip is the positive control of TestSemaphoreUnderContention:
// each checker must report the fault it exists to catch.
func TestSemaphoreCheckersTrip(t *testing.T) {
	t.Run("limit 4 where 3 is checked", func(t *testing.T) {
		rig := NewRig(t)
		res := runSemaphore(t, rig, "sem:limit4", "sem-limit4", 4, 20, 2*time.Second,
			SectionConfig{GapMin: 2 * time.Millisecond, GapMax: 5 * time.Millisecond})
		if res.MaxOcc <= semChecked || res.Over == 0 {
			t.Errorf("occupancy checker: at most %d at once, %d entries beyond %d, although workers asked for Limit(4): the checker is broken", res.MaxOcc, res.Over, semChecked)
		}
		if res.Samples.MostLive <= semChecked {
			t.Errorf("sampler: at most %d live slots although workers asked for Limit(4): the sampler is broken", res.Samples.MostLive)
		}
	})
	t.Run("release that does not hand over", func(t *testing.T) {
		rig := NewRig(t)
		res := runSemaphore(t, rig, "sem:limit3:no-handover", "sem-nohandover", 4, 4, 500*time.Millisecond,
			SectionConfig{GapMin: 2 * time.Millisecond, GapMax: 5 * time.Millisecond})
		if res.Samples.Idle == 0 {
			t.Errorf("idle-slot checker: no sample with waiters queued and a slot idle, although releases handed nothing over: the checker is broken")
		}
	})
}

// semHoldMode takes a slot of Keys[0] with WithLock and Limit(semChecked), tells the
// parent "holding <fence> <token>", and holds it (renewing) until killed or its
// lifetime ends.
func semHoldMode(ctx context.Context, p *Proc) error {
	key := p.Spec.Keys[0]
	return p.Locks.WithLock(ctx, key, p.Spec.TTL, func(ctx context.Context) error {
		l, _ := mutex.FromContext(ctx)
		if err := p.Event(ctx, "holding %d %s", l.Fence(), l.Token()); err != nil {
			return err
		}
		<-ctx.Done()
		return nil
	}, mutex.Limit(semChecked))
}

// semKillBound is how soon after the SIGKILL a queued waiter must get a killed
// holder's slot: the slot frees when its lease ends (at most ttl after the kill), and
// the waiter comes back on its timer within its jitter, 1/8 of the lease it saw plus
// 1ms, plus 100ms for scheduling.
func semKillBound(ttl time.Duration) time.Duration {
	return ttl + ttl/8 + time.Millisecond + 100*time.Millisecond
}

// semKillRound runs one round: the parent holds two slots of a fresh key for a
// minute, a worker the third with a lease of holderTTL, and a waiter in the parent
// queues for a slot; the worker is killed at a random point of its renewal cycle. It
// returns the time from the kill to the waiter's slot, and from the dead holder's
// lease end (as Redis recorded it before the kill) to the waiter's slot.
func semKillRound(t *testing.T, rig *Rig, round int, holderTTL time.Duration) (afterKill, afterLeaseEnd time.Duration) {
	t.Helper()
	ctx := context.Background()
	key := fmt.Sprintf("semkill:%s:%02d", strings.ReplaceAll(t.Name(), "/", ":"), round)
	var mine []*mutex.Lock
	for range 2 {
		l, err := rig.Locks.TryLock(ctx, key, time.Minute, mutex.Limit(semChecked))
		if err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		mine = append(mine, l)
	}
	w := StartWorker(t, WorkerSpec{
		Mode: "sem:hold", ID: 100 + round, LockAddr: rig.Lock.Addr(), RefereeAddr: rig.Referee.Addr(),
		Keys: []string{key}, TTL: holderTTL, Lifetime: time.Minute,
	})
	f := strings.Fields(rig.Referee.WaitEvent(t, w, 30*time.Second))
	if len(f) != 3 {
		t.Fatalf("round %d: bad event %q", round, f)
	}
	fence, _ := strconv.ParseInt(f[1], 10, 64)
	field := fmt.Sprintf("h%04d%s", len(f[2]), f[2])

	type got struct {
		l  *mutex.Lock
		at int64
		e  error
	}
	waiter := make(chan got, 1)
	go func() {
		l, err := rig.Locks.Lock(ctx, key, time.Minute, mutex.Limit(semChecked), mutex.MaxWait(holderTTL+5*time.Second))
		waiter <- got{l, Now(), err}
	}()
	time.Sleep(rand.N(holderTTL)) // a random point of the renewal cycle

	killAt := Now()
	killServer := serverMillis(t, rig.LockRDB)
	w.Kill(t)
	v, err := rig.LockRDB.HGet(ctx, RedisLockKey(key), field).Result()
	if err != nil {
		t.Fatalf("round %d: the killed holder's slot is gone before its lease ended: %v", round, err)
	}
	leaseEnd, _ := strconv.ParseInt(strings.Fields(v)[0], 10, 64)
	g := <-waiter
	if g.e != nil {
		t.Fatalf("round %d: waiter: %v", round, g.e)
	}
	gotServer := serverMillis(t, rig.LockRDB)
	if g.l.Fence() <= fence {
		t.Errorf("round %d: waiter's fence %d, want > the killed holder's %d", round, g.l.Fence(), fence)
	}
	for _, l := range append(mine, g.l) {
		if err := l.Unlock(ctx); err != nil {
			t.Errorf("round %d: Unlock: %v", round, err)
		}
	}
	afterKill = time.Duration(g.at - killAt)
	afterLeaseEnd = time.Duration(gotServer-leaseEnd) * time.Millisecond
	t.Logf("round %d: killed %s before its lease end; waiter got the slot %s after the kill, %s after the lease end",
		round, Ms(time.Duration(leaseEnd-killServer)*time.Millisecond), Ms(afterKill), Ms(afterLeaseEnd))
	return afterKill, afterLeaseEnd
}

// serverMillis is the lock Redis's clock in milliseconds.
func serverMillis(t *testing.T, rdb *redis.Client) int64 {
	t.Helper()
	tm, err := rdb.Time(context.Background()).Result()
	if err != nil {
		t.Fatal(err)
	}
	return tm.UnixMilli()
}

// TestSemaphoreHolderKilled: a holder of one of 3 slots (TTL 1s, renewed every TTL/3)
// is killed with SIGKILL while a waiter is queued. Pass: in every round the waiter gets
// the slot, with a higher fence, within semKillBound(TTL) of the kill: a crashed
// holder publishes no release, so its slot frees when its lease ends and the waiter
// comes back on its timer.
func TestSemaphoreHolderKilled(t *testing.T) {
	rounds := Count(t, "SIGKILL rounds", 3, 10)
	const ttl = time.Second
	rig := NewRig(t)
	var afterKill, afterEnd []time.Duration
	for r := range rounds {
		k, e := semKillRound(t, rig, r, ttl)
		afterKill, afterEnd = append(afterKill, k), append(afterEnd, e)
		if k > semKillBound(ttl) {
			t.Errorf("round %d: waiter got the killed holder's slot %v after the kill, want <= %v", r, k, semKillBound(ttl))
		}
	}
	t.Logf("waiter got the slot after the SIGKILL:   %s (bound TTL + TTL/8 + 101ms = %v)", Dist(afterKill), semKillBound(ttl))
	t.Logf("waiter got the slot after its lease end: %s", Dist(afterEnd))
}

// TestSemaphoreKillCheckerTrips is the control of TestSemaphoreHolderKilled: a holder
// whose lease is 2.5s, where the bound assumes 1s, keeps its slot past the bound
// after the kill (the kill comes at a random point of its renewal cycle, so at least
// 2.5s·2/3 before its lease ends), and the check must see it.
func TestSemaphoreKillCheckerTrips(t *testing.T) {
	rig := NewRig(t)
	k, _ := semKillRound(t, rig, 0, 2500*time.Millisecond)
	if k <= semKillBound(time.Second) {
		t.Errorf("waiter got the slot %v after the kill of a holder with a 2.5s lease: within the 1s bound %v, so the check cannot fail", k, semKillBound(time.Second))
	}
}
