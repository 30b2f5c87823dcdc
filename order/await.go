package order

import (
	"context"
	"time"
)

// Await is Enter, waiting up to maxWait while the answer is TurnWait with the same
// next place: it listens on the key's channel, where Finish announces each new next
// place with the record of its holder, and returns the first Turn that differs (no
// polling): p's turn, announced; a wait for a later place, so that the caller can
// judge the task that holds it; TurnPassed; or the Turn with Holder.Requeued set
// when the task ahead announced that it will run again later (Requeue). When maxWait
// ends first it returns the last Turn, its Holder's Age grown by the wait (on this
// process's clock). An announcement without a record makes it ask Enter again. The
// Awaits of a Sequencer share one pub/sub connection, open while any waits. When ctx
// ends, it returns ctx's error. When the connection breaks or falls silent (noticed
// within two seconds), it is dialled again and every Await asks again. Safe for
// concurrent use. A caller that waits again and again for one place, judging the
// task ahead in between, should use a Watch: it hears what is announced in between.
func (s *Sequencer) Await(ctx context.Context, key string, p Place, maxWait time.Duration) (Turn, error) {
	t, err := s.Enter(ctx, key, p)
	if err != nil || t.State != TurnWait || maxWait <= 0 {
		return t, err
	}
	w := &Watch{s: s, key: key, l: s.listen.join(redisKey(s.prefix, key), true)}
	defer w.Close()
	w.turn, w.asked, w.known = t, time.Now(), true
	return w.Await(ctx, p, t, maxWait)
}

// A Watch listens on a key's channel from Watch to Close, so that a caller that
// waits several times for one place (Await, then a look at the task ahead, then
// Await again) misses no announcement in between and asks Redis only when an
// announcement leaves it unsure. Its Awaits must not overlap; Close may be called
// from anywhere, once they are done.
type Watch struct {
	s     *Sequencer
	key   string
	l     *listen
	turn  Turn      // the last Turn known
	asked time.Time // when turn was current
	known bool
}

// Watch starts listening on key's channel, on the Sequencer's shared pub/sub
// connection. Close ends it.
func (s *Sequencer) Watch(key string) *Watch {
	return &Watch{s: s, key: key, l: s.listen.join(redisKey(s.prefix, key), false)}
}

// Close stops listening. It is safe to call more than once.
func (w *Watch) Close() {
	if w.l != nil {
		w.s.listen.leave(w.l)
		w.l = nil
	}
}

// Await is Sequencer.Await for place p, from the Turn the caller has (from Enter, or
// this Watch's last Await): it waits while the key's next place is the same. The first
// time it asks Enter (after it began to listen, so that nothing announced since is
// missed), and it returns at once what it knows that is newer than from: a next
// place moved on since, announced while the caller looked at the task ahead.
func (w *Watch) Await(ctx context.Context, p Place, from Turn, maxWait time.Duration) (Turn, error) {
	if !w.known {
		t, err := w.s.Enter(ctx, w.key, p)
		if err != nil {
			return t, err
		}
		w.turn, w.asked, w.known = t, time.Now(), true
	}
	// Places only move on: the later of the two next places is the news.
	if from.Next < w.turn.Next || w.turn.State != TurnWait {
		return w.turn, nil
	}
	w.turn, w.asked = from, time.Now()
	t, err := w.await(ctx, p, maxWait)
	w.turn, w.asked = t, time.Now()
	return t, err
}

// await waits from w.turn (see Sequencer.Await).
func (w *Watch) await(ctx context.Context, p Place, maxWait time.Duration) (Turn, error) {
	t, asked := w.turn, w.asked
	// aged is t as it stands now: its holder's place is older by the wait.
	aged := func() Turn {
		t.Holder.Age += time.Since(asked)
		return t
	}
	if t.State != TurnWait || maxWait <= 0 {
		return t, nil
	}
	timer := time.NewTimer(maxWait)
	defer timer.Stop()
	for {
		news, again, ok := w.l.next(ctx, timer.C)
		switch {
		case ctx.Err() != nil:
			return aged(), ctx.Err()
		case !ok:
			return aged(), nil // maxWait ended
		}
		for _, m := range news {
			a, ok := parseAnnouncement(m)
			if !ok || a.place.Epoch != p.Epoch {
				continue
			}
			switch {
			case a.requeued:
				if a.place.N == t.Next {
					nt := aged()
					nt.Holder.Requeued = true
					return nt, nil
				}
			case a.place.N == p.N: // its turn: the announcement says as much as Enter would
				return Turn{State: TurnNow, Next: p.N}, nil
			case a.place.N == t.Next: // no news
			case a.place.N > p.N:
				return Turn{State: TurnPassed, Next: a.place.N}, nil
			case a.holder != nil:
				return Turn{State: TurnWait, Next: a.place.N, Holder: *a.holder}, nil
			default:
				again = true
			}
		}
		if !again {
			continue
		}
		nt, err := w.s.Enter(ctx, w.key, p)
		if err != nil {
			return aged(), err
		}
		if nt.State != TurnWait || nt.Next != t.Next {
			return nt, nil
		}
		t, asked = nt, time.Now()
	}
}
