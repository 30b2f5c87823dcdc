//go:build unix

package chaos

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex/mutex"
)

func init() { registerWorkerMode("hold", holdMode) }

// holdMode takes Keys[0] with WithLock, tells the parent "holding <fence>", and holds
// it (renewing) until its lifetime ends or the parent kills it.
func holdMode(ctx context.Context, p *Proc) error {
	key := p.Spec.Keys[0]
	a := p.Rec.WithLock(ctx, p.Locks, key, p.Spec.TTL, func(ctx context.Context, l *mutex.Lock, a *Attempt) error {
		if err := p.Event(ctx, "holding %d", l.Fence()); err != nil {
			return err
		}
		<-ctx.Done()
		return nil
	})
	if a.Kind != KindOK {
		return fmt.Errorf("hold %s: %s", key, a.Err)
	}
	return nil
}

// keySample is one look at a lock key from the parent: GET and PTTL in one round trip.
type keySample struct {
	Sent, Recv int64 // Now() around the round trip
	Held       bool  // the key still held the watched holder's value
	PTTL       time.Duration
}

func (s keySample) mid() int64 { return s.Sent + (s.Recv-s.Sent)/2 }

// sampleKey samples rkey every period until it no longer holds a value starting with
// prefix (the holder's "<fence>:"), or until the deadline, and delivers the samples.
func sampleKey(rdb *redis.Client, rkey, prefix string, period time.Duration, deadline time.Time) <-chan []keySample {
	out := make(chan []keySample, 1)
	go func() {
		var ss []keySample
		defer func() { out <- ss }()
		tick := time.NewTicker(period)
		defer tick.Stop()
		for time.Now().Before(deadline) {
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			var get *redis.StringCmd
			var pttl *redis.DurationCmd
			s := keySample{Sent: Now()}
			_, err := rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
				get = p.Get(ctx, rkey)
				pttl = p.PTTL(ctx, rkey)
				return nil
			})
			s.Recv = Now()
			cancel()
			if err == nil || err == redis.Nil {
				v, _ := get.Result()
				s.Held = strings.HasPrefix(v, prefix)
				s.PTTL = pttl.Val()
				ss = append(ss, s)
				if !s.Held {
					return
				}
			}
			<-tick.C
		}
	}()
	return out
}

// TestHolderKilled is scenario 2: a worker holding a key (TTL 2s, renewed every
// TTL/3) is killed with SIGKILL at a random point of its renewal cycle, 10 rounds.
//
// What is measured, on one monotonic clock shared by all processes:
//   - the key's last renewal, server side: the parent samples GET+PTTL of the key
//     every 2ms; the dead holder's lease ends at E = sample time + PTTL, and its last
//     renewal (or acquisition) was at E - TTL;
//   - when the key was free: the first sample that no longer shows the holder's value
//     (the precision is the sampling interval plus a round trip);
//   - when a waiter got it: mutex.Client.Lock with MaxWait(TTL+2s), started in the
//     parent right after the kill (after the process was reaped).
//
// Pass: in every round the key is free within TTL + 100ms of the last renewal (and so
// of the kill), the waiter gets it with a higher fence, and gets it within the retry
// jitter the library documents (pttl/8 + 1ms, at most TTL/8) + 100ms after it was free.
// A holder that crashed publishes no release, so the waiter comes back by its timer:
// the time from the kill to the waiter is reported, and how many rounds exceeded
// TTL + 100ms because of that jitter.
func TestHolderKilled(t *testing.T) {
	rounds := Count(t, "SIGKILL rounds", 10, 30)
	const ttl = 2 * time.Second
	const slack = 100 * time.Millisecond
	rig := NewRig(t)
	ctx := context.Background()
	var afterRenewal, afterKill, waiterAfterKill, waiterAfterFree, precision []time.Duration
	waiterLate := 0
	for r := range rounds {
		key := fmt.Sprintf("kill:%02d", r)
		w := StartWorker(t, WorkerSpec{
			Mode: "hold", ID: r + 1, LockAddr: rig.Lock.Addr(), RefereeAddr: rig.Referee.Addr(),
			Keys: []string{key}, TTL: ttl, Lifetime: time.Minute,
		})
		fence, err := strconv.ParseInt(strings.TrimPrefix(rig.Referee.WaitEvent(t, w, 30*time.Second), "holding "), 10, 64)
		if err != nil {
			t.Fatalf("round %d: bad event: %v", r, err)
		}
		samples := sampleKey(rig.LockRDB, RedisLockKey(key), FencePrefix(fence),
			2*time.Millisecond, time.Now().Add(ttl+10*time.Second))
		time.Sleep(rand.N(ttl)) // a random point of the renewal cycle

		killAt := Now()
		w.Kill(t)
		l, err := rig.Locks.Lock(ctx, key, ttl, mutex.MaxWait(ttl+2*time.Second))
		gotAt := Now()
		ss := <-samples
		if err != nil {
			t.Fatalf("round %d: Lock with MaxWait(TTL+2s) after the kill = %v, want the lock", r, err)
		}
		if l.Fence() <= fence {
			t.Errorf("round %d: fence after the kill %d, want > the dead holder's %d", r, l.Fence(), fence)
		}
		if err := l.Unlock(ctx); err != nil {
			t.Errorf("round %d: Unlock: %v", r, err)
		}

		last, free := -1, -1
		for i, s := range ss {
			if s.Held {
				last = i
			} else if free < 0 {
				free = i
			}
		}
		if last < 0 || free < 0 || ss[last].Sent < killAt {
			t.Fatalf("round %d: the samples do not bracket the kill and the release (%d samples, last held %d, first free %d)", r, len(ss), last, free)
		}
		expiry := ss[last].mid() + int64(ss[last].PTTL)
		renewal := expiry - int64(ttl)
		freedAt := ss[free].mid()
		d := struct{ renewal, kill, waiter, waiterFree, prec time.Duration }{
			time.Duration(freedAt - renewal), time.Duration(freedAt - killAt), time.Duration(gotAt - killAt),
			time.Duration(gotAt - freedAt), time.Duration(ss[free].Recv - ss[last].Sent),
		}
		afterRenewal, afterKill = append(afterRenewal, d.renewal), append(afterKill, d.kill)
		waiterAfterKill, waiterAfterFree = append(waiterAfterKill, d.waiter), append(waiterAfterFree, d.waiterFree)
		precision = append(precision, d.prec)
		t.Logf("round %d: killed %s after the last renewal; free %s after that renewal, %s after the kill; waiter got it %s after the kill, %s after it was free",
			r, Ms(time.Duration(killAt-renewal)), Ms(d.renewal), Ms(d.kill), Ms(d.waiter), Ms(d.waiterFree))
		if d.renewal > ttl+slack {
			t.Errorf("round %d: key free %v after the last renewal, want <= TTL + 100ms", r, d.renewal)
		}
		if d.kill > ttl+slack {
			t.Errorf("round %d: key free %v after the kill, want <= TTL + 100ms", r, d.kill)
		}
		if d.waiterFree > ttl/8+time.Millisecond+slack {
			t.Errorf("round %d: waiter got the key %v after it was free, want <= TTL/8 (jitter) + 100ms", r, d.waiterFree)
		}
		if d.waiter > ttl+slack {
			waiterLate++
		}
	}
	t.Logf("key free after the last renewal:  %s (bound TTL+100ms = %v)", Dist(afterRenewal), ttl+slack)
	t.Logf("key free after the SIGKILL:       %s", Dist(afterKill))
	t.Logf("waiter got it after the SIGKILL:  %s; %d of %d rounds above TTL+100ms (retry jitter up to TTL/8)", Dist(waiterAfterKill), waiterLate, rounds)
	t.Logf("waiter got it after it was free:  %s", Dist(waiterAfterFree))
	t.Logf("sampling precision (last held -> first free round trip): %s", Dist(precision))
}
