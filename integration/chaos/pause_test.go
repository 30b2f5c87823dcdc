//go:build unix

package chaos

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/asynqmutex/asynqmutex/mutex"
)

func init() { registerWorkerMode("pause", pauseMode) }

// pauseMode takes Keys[0], offers a fenced write, tells the parent "holding
// <fence>", and waits to be paused and resumed (a gap of more than TTL/2 between its
// 2ms ticks). Once resumed it behaves like a holder whose write was already under way
// when the pause hit: it offers a fenced write at once, waits for its context to be
// cancelled, and offers one more (a holder that ignores the cancellation).
func pauseMode(ctx context.Context, p *Proc) error {
	key, ttl := p.Spec.Keys[0], p.Spec.TTL
	a := p.Rec.WithLock(ctx, p.Locks, key, ttl, func(fctx context.Context, l *mutex.Lock, a *Attempt) error {
		write := func(note string) error {
			ok, err := p.Ref.FencedWrite(ctx, key, l.Fence(), a.Writer())
			a.Writes = append(a.Writes, WriteResult{At: Now(), Accepted: ok, Note: note})
			return err
		}
		if err := write("before the pause"); err != nil {
			return err
		}
		if err := p.Event(ctx, "holding %d", l.Fence()); err != nil {
			return err
		}
		tick := time.NewTicker(2 * time.Millisecond)
		defer tick.Stop()
		last := Now()
		for resumed := false; !resumed; {
			select {
			case <-fctx.Done(): // lost before any pause was seen: the parent fails the round
				resumed = true
			case <-tick.C:
				now := Now()
				resumed = time.Duration(now-last) > ttl/2
				last = now
			}
		}
		if ctx.Err() != nil {
			return fmt.Errorf("lifetime ended before a pause")
		}
		p.Report.Notes["resumed"] = Now()
		if err := write("right after the resume"); err != nil {
			return err
		}
		select {
		case <-fctx.Done():
		case <-time.After(2 * ttl):
		}
		p.Report.Notes["cause-not-held"] = 0
		if errors.Is(context.Cause(fctx), mutex.ErrNotHeld) {
			p.Report.Notes["cause-not-held"] = 1
		}
		return write("after the cancellation")
	})
	if a.FnErr != "" {
		return errors.New(a.FnErr)
	}
	return nil
}

// TestHolderPaused is scenario 3 (F1): a holder (TTL 2s) is stopped with SIGSTOP
// past its lease; meanwhile another holder (the parent, standing in for a second
// worker) takes the key and writes with its fence; then the first is resumed with
// SIGCONT and offers writes with its old fence.
//
// Pass, every round: the second holder's fence is higher and its write is accepted;
// every write the resumed holder offers is rejected as stale (at least one per round,
// so the check is not vacuous); its context is cancelled with a cause wrapping
// ErrNotHeld within one renewal interval (TTL/3) of SIGCONT, measured from just before
// kill(SIGCONT) to when the holder's context.AfterFunc ran, on the shared monotonic
// clock; WithLock returns ErrNotHeld; and the resumed holder's release does not free
// the second holder's lock.
func TestHolderPaused(t *testing.T) {
	rounds := Count(t, "SIGSTOP rounds", 5, 10)
	const ttl = 2 * time.Second
	rig := NewRig(t)
	ctx := context.Background()
	var cancelLatency, takeover []time.Duration
	stale := 0
	for r := range rounds {
		key := fmt.Sprintf("pause:%02d", r)
		w := StartWorker(t, WorkerSpec{
			Mode: "pause", ID: r + 1, LockAddr: rig.Lock.Addr(), RefereeAddr: rig.Referee.Addr(),
			Keys: []string{key}, TTL: ttl, Lifetime: time.Minute,
		})
		fence, err := strconv.ParseInt(strings.TrimPrefix(rig.Referee.WaitEvent(t, w, 30*time.Second), "holding "), 10, 64)
		if err != nil {
			t.Fatalf("round %d: bad event: %v", r, err)
		}
		time.Sleep(rand.N(ttl / 3)) // a random point of the renewal cycle
		if err := w.Signal(syscall.SIGSTOP); err != nil {
			t.Fatalf("SIGSTOP: %v", err)
		}
		stopAt := Now()
		t.Cleanup(func() { _ = w.Signal(syscall.SIGCONT) })

		// The second holder: no renewal, so a lease long enough for the whole round.
		l, err := rig.Locks.Lock(ctx, key, 10*ttl, mutex.MaxWait(ttl+2*time.Second))
		if err != nil {
			t.Fatalf("round %d: Lock while the holder is stopped = %v, want the lock once its lease ran out", r, err)
		}
		takeover = append(takeover, Since(stopAt))
		if l.Fence() <= fence {
			t.Errorf("round %d: second holder's fence %d, want > the paused holder's %d", r, l.Fence(), fence)
		}
		if ok, err := rig.Referee.FencedWrite(ctx, key, l.Fence(), "second"); err != nil || !ok {
			t.Errorf("round %d: the second holder's fenced write accepted = %v (%v), want true", r, ok, err)
		}

		contAt := Now()
		if err := w.Signal(syscall.SIGCONT); err != nil {
			t.Fatalf("SIGCONT: %v", err)
		}
		rep := w.Wait(t, 3*ttl+10*time.Second)
		if err := l.Unlock(ctx); err != nil {
			t.Errorf("round %d: second holder's Unlock = %v, want nil: the resumed holder must not have released it", r, err)
		}

		if len(rep.Attempts) != 1 {
			t.Fatalf("round %d: %d attempts recorded, want 1", r, len(rep.Attempts))
		}
		a := rep.Attempts[0]
		if a.Kind != KindNotHeld {
			t.Errorf("round %d: the resumed holder's WithLock returned %q (%s), want ErrNotHeld", r, a.Err, a.Kind)
		}
		if a.LostAt == 0 || rep.Notes["cause-not-held"] != 1 {
			t.Errorf("round %d: the resumed holder's context was not cancelled with a cause wrapping ErrNotHeld", r)
		}
		if a.LostAt != 0 {
			lat := time.Duration(a.LostAt - contAt)
			cancelLatency = append(cancelLatency, lat)
			if a.LostAt < stopAt {
				t.Errorf("round %d: the holder lost its lease %v before it was stopped", r, time.Duration(stopAt-a.LostAt))
			} else if lat > ttl/3 {
				t.Errorf("round %d: context cancelled %v after SIGCONT, want <= TTL/3 = %v", r, lat, ttl/3)
			}
		}
		rejected := 0
		for i, wr := range a.Writes {
			switch {
			case i == 0 && !wr.Accepted:
				t.Errorf("round %d: the holder's write before the pause was rejected", r)
			case i > 0 && wr.Accepted:
				t.Errorf("round %d: the resumed holder's write %q with fence %d was ACCEPTED after the second holder wrote with %d",
					r, wr.Note, a.Fence, l.Fence())
			case i > 0:
				rejected++
			}
		}
		if rejected < 1 {
			t.Errorf("round %d: the resumed holder offered no stale write (%d writes): the fence check is vacuous", r, len(a.Writes))
		}
		per, _ := rig.Referee.Tally(t, []string{key})
		if per[key].Stale != int64(rejected) {
			t.Errorf("round %d: referee counted %d stale writes, the holder saw %d rejected", r, per[key].Stale, rejected)
		}
		stale += rejected
		t.Logf("round %d: stopped; second holder got the key %s later (fence %d > %d); resumed holder: %d stale writes rejected, context cancelled %s after SIGCONT",
			r, Ms(takeover[len(takeover)-1]), l.Fence(), fence, rejected, Ms(time.Duration(a.LostAt-contAt)))
	}
	t.Logf("stale writes offered after SIGCONT: %d, all rejected (%d rounds)", stale, rounds)
	t.Logf("context cancelled after SIGCONT: %s (bound TTL/3 = %v)", Dist(cancelLatency), ttl/3)
	t.Logf("second holder got the key after SIGSTOP: %s", Dist(takeover))
}
