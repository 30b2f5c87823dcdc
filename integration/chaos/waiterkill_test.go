//go:build unix

package chaos

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex/mutex"
)

func init() { registerWorkerMode("wait", waitMode) }

// waitMode tells the parent "waiting", then waits for Keys[0] with Lock (MaxWait of
// its lifetime); the parent kills it while it waits.
func waitMode(ctx context.Context, p *Proc) error {
	key := p.Spec.Keys[0]
	if err := p.Event(ctx, "waiting"); err != nil {
		return err
	}
	l, err := p.Locks.Lock(ctx, key, p.Spec.TTL)
	if err != nil {
		return fmt.Errorf("wait for %s: %w", key, err)
	}
	return l.Unlock(context.WithoutCancel(ctx))
}

// TestWaiterKilled is a variant of F7: a process killed while it waits for a key must
// not delay the waiters that are still alive. A holder releases the key while two
// waiters are queued, one of which was killed with SIGKILL; the live waiter should
// get the key at once (the holder released it; nothing crashed that it waits for),
// not when the holder's lease would have run out. Both queue orders are tried, since
// a release wakes one waiter chosen by queue position.
//
// Pass: the live waiter gets the key within 100ms of the release, every round.
//
// Finding (see README.md): when the killed waiter is the one the release picks, its
// wake-up is published to a channel nobody listens on, and the live waiter sleeps
// until the holder's lease would have ended (about TTL).
func TestWaiterKilled(t *testing.T) {
	for _, killedFirst := range []bool{false, true} {
		name := "killed waiter queued last"
		if killedFirst {
			name = "killed waiter queued first"
		}
		t.Run(name, func(t *testing.T) { testWaiterKilled(t, killedFirst) })
	}
}

func testWaiterKilled(t *testing.T, killedFirst bool) {
	rounds := Count(t, "killed-waiter rounds", 2, 10)
	const ttl = 4 * time.Second
	rig := NewRig(t)
	ctx := context.Background()
	// The live waiter is a second Client, as in another process.
	otherRDB := redis.NewClient(&redis.Options{Addr: rig.Lock.Addr()})
	t.Cleanup(func() { _ = otherRDB.Close() })
	other := mutex.New(otherRDB)
	t.Cleanup(func() { _ = other.Close() })

	var delays []time.Duration
	for r := range rounds {
		key := fmt.Sprintf("waiterkill:%02d", r)
		queue := RedisLockKey(key) + ":wait" // the wait queue plain_lock.lua documents
		queued := func(n int64) {
			t.Helper()
			for i := 0; i < 500; i++ {
				if c, _ := rig.LockRDB.LLen(ctx, queue).Result(); c >= n {
					return
				}
				time.Sleep(10 * time.Millisecond)
			}
			t.Fatalf("round %d: fewer than %d waiters queued on %s after 5s", r, n, key)
		}
		held, err := rig.Locks.TryLock(ctx, key, ttl)
		if err != nil {
			t.Fatalf("round %d: TryLock: %v", r, err)
		}
		type result struct {
			l  *mutex.Lock
			at int64
			e  error
		}
		got := make(chan result, 1)
		live := func() {
			go func() {
				l, err := other.Lock(ctx, key, ttl, mutex.MaxWait(2*ttl))
				got <- result{l, Now(), err}
			}()
		}
		var w *Worker
		doomed := func() {
			w = StartWorker(t, WorkerSpec{
				Mode: "wait", ID: r + 1, LockAddr: rig.Lock.Addr(), RefereeAddr: rig.Referee.Addr(),
				Keys: []string{key}, TTL: ttl, Lifetime: time.Minute,
			})
			rig.Referee.WaitEvent(t, w, 30*time.Second)
		}
		first, second := live, doomed
		if killedFirst {
			first, second = doomed, live
		}
		first()
		queued(1)
		time.Sleep(50 * time.Millisecond)
		second()
		queued(2)
		w.Kill(t)

		releaseAt := Now()
		if err := held.Unlock(ctx); err != nil {
			t.Fatalf("round %d: Unlock: %v", r, err)
		}
		res := <-got
		if res.e != nil {
			t.Fatalf("round %d: the live waiter's Lock = %v, want the lock", r, res.e)
		}
		_ = res.l.Unlock(ctx)
		d := time.Duration(res.at - releaseAt)
		delays = append(delays, d)
		t.Logf("round %d: the live waiter got the key %s after the release", r, Ms(d))
		if d > 100*time.Millisecond {
			t.Errorf("round %d: the live waiter got the key %v after the release, want <= 100ms: the release's wake-up went to the killed waiter (plain_release.lua publishes to one waiter even when nobody receives it)", r, d)
		}
	}
	t.Logf("live waiter got the key after the release: %s (holder's lease %v)", Dist(delays), ttl)
}

// TestWakeOrder checks what Client.Lock documents: "a release wakes the
// longest-queued waiter of any Client". Two live waiters queue 50ms apart while the
// holder's lease runs down; the holder releases; the first to get the key must be the
// one that queued first.
//
// Finding (see README.md): the wait queue is ordered by claim deadline, now +
// 1.25*pttl + 1s (plain_lock.lua), and pttl shrinks as the lease runs down, so a later
// waiter has an earlier deadline and is woken first.
func TestWakeOrder(t *testing.T) {
	const ttl = 4 * time.Second
	rig := NewRig(t)
	ctx := context.Background()
	key := "wakeorder"
	held, err := rig.Locks.TryLock(ctx, key, ttl)
	if err != nil {
		t.Fatal(err)
	}
	type result struct {
		who int
		l   *mutex.Lock
		err error
	}
	got := make(chan result, 2)
	for who := 1; who <= 2; who++ {
		rdb := redis.NewClient(&redis.Options{Addr: rig.Lock.Addr()})
		c := mutex.New(rdb)
		t.Cleanup(func() { _ = c.Close(); _ = rdb.Close() })
		go func() {
			l, err := c.Lock(ctx, key, ttl, mutex.MaxWait(3*ttl))
			got <- result{who, l, err}
		}()
		for i := 0; i < 500; i++ {
			if n, _ := rig.LockRDB.LLen(ctx, RedisLockKey(key)+":wait").Result(); n >= int64(who) {
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err := held.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	firstRes := <-got
	if firstRes.err != nil {
		t.Fatalf("waiter %d: %v", firstRes.who, firstRes.err)
	}
	if firstRes.who != 1 {
		t.Errorf("after the release waiter %d got the key first, want waiter 1, which queued 50ms earlier (mutex/acquire.go: \"a release wakes the longest-queued waiter\")", firstRes.who)
	}
	_ = firstRes.l.Unlock(ctx)
	secondRes := <-got // woken by that release
	if secondRes.err != nil {
		t.Fatalf("waiter %d: %v", secondRes.who, secondRes.err)
	}
	_ = secondRes.l.Unlock(ctx)
}
