package order

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

func TestTakeGivesPlacesInOrder(t *testing.T) {
	t.Parallel()
	s, ctx, key := New(sharedServer(t)), context.Background(), uniqueKey(t)
	var epoch string
	for i := int64(1); i <= 3; i++ {
		p, err := s.Take(ctx, key, "default", "task-"+strconv.FormatInt(i, 10))
		if err != nil || p.N != i || (epoch != "" && p.Epoch != epoch) {
			t.Fatalf("Take #%d = %+v, %v; want place %d of epoch %q", i, p, err, i, epoch)
		}
		epoch = p.Epoch
	}
	// A Take sent again for a task that holds a place gets that place.
	if p, err := s.Take(ctx, key, "default", "task-2"); err != nil || p.N != 2 {
		t.Fatalf("Take again for task-2 = %+v, %v; want place 2", p, err)
	}
	st, err := s.Inspect(ctx, key)
	if err != nil || st.Next != 1 || st.Last != 3 || st.Holder.TaskID != "task-1" || st.Holder.Queue != "default" || st.Waiting() != 3 {
		t.Fatalf("Inspect = %+v, %v; want next 1 held by task-1, last 3", st, err)
	}
}

func TestTakeConcurrentPlacesAreDistinct(t *testing.T) {
	t.Parallel()
	s, ctx, key := New(sharedServer(t)), context.Background(), uniqueKey(t)
	const n = 50
	var wg sync.WaitGroup
	got := make([]int64, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p, err := s.Take(ctx, key, "q", "t"+strconv.Itoa(i))
			if err != nil {
				t.Errorf("Take: %v", err)
			}
			got[i] = p.N
		}()
	}
	wg.Wait()
	seen := map[int64]bool{}
	for _, p := range got {
		if p < 1 || p > n || seen[p] {
			t.Fatalf("places %v: want each of 1..%d once", got, n)
		}
		seen[p] = true
	}
}

func TestEnterAndFinish(t *testing.T) {
	t.Parallel()
	s, ctx, key := New(sharedServer(t)), context.Background(), uniqueKey(t)
	p1, _ := s.Take(ctx, key, "default", "a")
	p2, _ := s.Take(ctx, key, "default", "b")
	p3, _ := s.Take(ctx, key, "default", "c")
	check := func(p Place, want TurnState, next int64) Turn {
		t.Helper()
		turn, err := s.Enter(ctx, key, p)
		if err != nil || turn.State != want || turn.Next != next {
			t.Fatalf("Enter(%v) = %+v, %v; want %v with next %d", p.N, turn, err, want, next)
		}
		return turn
	}
	check(p1, TurnNow, 1)
	if turn := check(p3, TurnWait, 1); turn.Holder.TaskID != "a" {
		t.Fatalf("Enter(3).Holder = %+v, want task a", turn.Holder)
	}
	// Finishing a place that is not next changes nothing.
	if n, err := s.Finish(ctx, key, p2, Done); err != nil || n != 0 {
		t.Fatalf("Finish(2) before 1 = %d, %v; want 0", n, err)
	}
	if n, err := s.Finish(ctx, key, p1, Done); err != nil || n != 2 {
		t.Fatalf("Finish(1) = %d, %v; want next 2", n, err)
	}
	// A Finish sent again finds its place finished.
	if n, err := s.Finish(ctx, key, p1, Done); err != nil || n != 0 {
		t.Fatalf("Finish(1) again = %d, %v; want 0", n, err)
	}
	check(p1, TurnPassed, 2)
	check(p2, TurnNow, 2)
	if n, err := s.Finish(ctx, key, p2, Skipped); err != nil || n != 3 {
		t.Fatalf("Finish(2, Skipped) = %d, %v; want next 3", n, err)
	}
	check(p3, TurnNow, 3)
	if _, err := s.Finish(ctx, key, p3, Done); err != nil {
		t.Fatal(err)
	}
	st, err := s.Inspect(ctx, key)
	if err != nil || st.Next != 4 || st.Last != 3 || st.Skipped != 1 || st.Waiting() != 0 {
		t.Fatalf("Inspect = %+v, %v; want next 4, last 3, 1 skipped", st, err)
	}
	// A task ID that finished may take a new place.
	if p, err := s.Take(ctx, key, "default", "a"); err != nil || p.N != 4 {
		t.Fatalf("Take(a) after its place finished = %+v, %v; want place 4", p, err)
	}
	if turn := check(Place{Epoch: "1", N: 1}, TurnUnknown, 0); turn.Holder != (Holder{}) {
		t.Fatalf("Enter of another epoch = %+v", turn)
	}
}

func TestAbandonedPlacesAreSkippedWhenTheirTurnComes(t *testing.T) {
	t.Parallel()
	s, ctx, key := New(sharedServer(t)), context.Background(), uniqueKey(t)
	var ps []Place
	for _, id := range []string{"a", "b", "c", "d"} {
		p, err := s.Take(ctx, key, "default", id)
		if err != nil {
			t.Fatal(err)
		}
		ps = append(ps, p)
	}
	// b and c could not be enqueued while a runs.
	for _, p := range ps[1:3] {
		if n, err := s.Finish(ctx, key, p, Abandoned); err != nil || n != 0 {
			t.Fatalf("Finish(%d, Abandoned) = %d, %v; want 0 (a is next)", p.N, n, err)
		}
	}
	if turn, _ := s.Enter(ctx, key, ps[3]); turn.State != TurnWait || turn.Holder.TaskID != "a" || turn.Holder.Abandoned {
		t.Fatalf("Enter(d) = %+v; want a wait for a", turn)
	}
	if n, err := s.Finish(ctx, key, ps[0], Done); err != nil || n != 4 {
		t.Fatalf("Finish(a) = %d, %v; want next 4, past the abandoned places", n, err)
	}
	if st, _ := s.Inspect(ctx, key); st.Skipped != 2 {
		t.Fatalf("Inspect().Skipped = %d, want 2", st.Skipped)
	}
	// The abandoned task IDs hold no place any more.
	if p, err := s.Take(ctx, key, "default", "b"); err != nil || p.N != 5 {
		t.Fatalf("Take(b) = %+v, %v; want place 5", p, err)
	}
}

func TestAwaitIsWokenByFinish(t *testing.T) {
	t.Parallel()
	s, ctx, key := New(sharedServer(t)), context.Background(), uniqueKey(t)
	p1, _ := s.Take(ctx, key, "default", "a")
	p2, _ := s.Take(ctx, key, "default", "b")
	p3, _ := s.Take(ctx, key, "default", "c")
	// The wait is long, so that a turn that comes quickly can only have been announced.
	const maxWait = time.Minute
	got := make(chan Turn, 1)
	go func() {
		// Await returns when the key's next place changes; a caller waits again for
		// the next one, at most once per place before its own.
		var turn Turn
		for range 3 {
			var err error
			if turn, err = s.Await(ctx, key, p3, maxWait); err != nil || turn.State != TurnWait {
				if err != nil {
					t.Errorf("Await: %v", err)
				}
				break
			}
		}
		got <- turn
	}()
	// Finish the places one by one.
	time.Sleep(50 * time.Millisecond) // let it subscribe; its answer does not depend on it
	start := time.Now()
	for _, p := range []Place{p1, p2} {
		if _, err := s.Finish(ctx, key, p, Done); err != nil {
			t.Fatal(err)
		}
	}
	select {
	case turn := <-got:
		if turn.State != TurnNow || turn.Next != 3 {
			t.Fatalf("Await = %+v; want its turn", turn)
		}
		if d := time.Since(start); d > maxWait/2 {
			t.Fatalf("Await took %v after the finish", d)
		}
	case <-time.After(maxWait / 2):
		t.Fatal("Await was not woken by Finish")
	}
}

func TestAwaitReturnsWhenTheNextPlaceChanges(t *testing.T) {
	t.Parallel()
	s, ctx, key := New(sharedServer(t)), context.Background(), uniqueKey(t)
	p1, _ := s.Take(ctx, key, "default", "a")
	_, _ = s.Take(ctx, key, "default", "b")
	p3, _ := s.Take(ctx, key, "default", "c")
	const maxWait = time.Minute
	got := make(chan Turn, 1)
	go func() {
		turn, err := s.Await(ctx, key, p3, maxWait)
		if err != nil {
			t.Errorf("Await: %v", err)
		}
		got <- turn
	}()
	time.Sleep(50 * time.Millisecond) // let it subscribe; its answer does not depend on it
	if _, err := s.Finish(ctx, key, p1, Done); err != nil {
		t.Fatal(err)
	}
	select {
	case turn := <-got:
		if turn.State != TurnWait || turn.Next != 2 || turn.Holder.TaskID != "b" {
			t.Fatalf("Await = %+v; want a wait for place 2, held by b", turn)
		}
	case <-time.After(maxWait / 2):
		t.Fatal("Await was not woken by Finish")
	}
}

func TestAwaitEndsAfterMaxWait(t *testing.T) {
	t.Parallel()
	s, ctx, key := New(sharedServer(t)), context.Background(), uniqueKey(t)
	_, _ = s.Take(ctx, key, "default", "a")
	p2, _ := s.Take(ctx, key, "default", "b")
	const maxWait = 200 * time.Millisecond
	start := time.Now()
	turn, err := s.Await(ctx, key, p2, maxWait)
	if d := time.Since(start); err != nil || turn.State != TurnWait || d < maxWait || d > maxWait+2*time.Second {
		t.Fatalf("Await = %+v, %v after %v; want TurnWait after %v", turn, err, d, maxWait)
	}
	// The Turn it returns is as of its return: the holder's place is older by the
	// wait, so that a caller judging it against a grace does not wait the grace twice.
	if turn.Holder.TaskID != "a" || turn.Holder.Age < maxWait {
		t.Errorf("Await's Turn after its wait: holder %+v, want task a's place at least %v old", turn.Holder, maxWait)
	}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := s.Await(cctx, key, p2, maxWait); err == nil {
		t.Fatal("Await with an ended context = nil error")
	}
}

func TestPlaceFormat(t *testing.T) {
	p := Place{Epoch: "1764000000000000", N: 42}
	if got, ok := ParsePlace(FormatPlace(p)); !ok || got != p {
		t.Fatalf("ParsePlace(FormatPlace(%v)) = %v, %v", p, got, ok)
	}
	for _, bad := range []string{"", "1", ":1", "1:0", "1:x", "1:-3"} {
		if _, ok := ParsePlace(bad); ok {
			t.Errorf("ParsePlace(%q) ok, want not", bad)
		}
	}
}

func TestRecordRoundTrip(t *testing.T) {
	for _, r := range []record{{taken: 12, queue: "q", id: "a b c"}, {taken: 1, queue: "default", id: "x", abandoned: true}} {
		if got, ok := parseRecord(r.String()); !ok || got != r {
			t.Errorf("parseRecord(%q) = %+v, %v; want %+v", r.String(), got, ok, r)
		}
	}
}

// pipelines counts the pipelines a redis client sends.
type pipelines struct{ n atomic.Int64 }

func (h *pipelines) DialHook(next redis.DialHook) redis.DialHook          { return next }
func (h *pipelines) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }
func (h *pipelines) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		h.n.Add(1)
		return next(ctx, cmds)
	}
}

func TestFinishLater(t *testing.T) {
	t.Parallel()
	rdb := sharedServer(t)
	h := &pipelines{}
	rdb.AddHook(h)
	s, ctx, key := New(rdb), context.Background(), uniqueKey(t)
	p1, _ := s.Take(ctx, key, "q", "t1")
	p2, _ := s.Take(ctx, key, "q", "t2")

	// Carried by the next call made with the context, in one pipeline; here an Enter
	// of the next place, which the Finish before it in the pipeline lets in.
	lctx, later := s.FinishLater(ctx, key, p1)
	if err := later.Finish(How(9)); err == nil {
		t.Fatal("Finish(How(9)) = nil, want an error")
	}
	if err := later.Finish(Done); err != nil {
		t.Fatal(err)
	}
	before := h.n.Load()
	if turn, err := s.Enter(lctx, key, p2); err != nil || turn.State != TurnNow {
		t.Fatalf("Enter(place 2) carrying place 1's Finish = %+v, %v; want its turn", turn, err)
	}
	if got := h.n.Load() - before; got != 1 {
		t.Errorf("%d pipelines, want 1", got)
	}
	if next, err := later.Result(ctx); next != 2 || err != nil {
		t.Errorf("Result = %d, %v; want 2", next, err)
	}

	// Control: a Later whose Finish was never called finishes nothing.
	lctx, later = s.FinishLater(ctx, key, p2)
	if turn, err := s.Enter(lctx, key, p2); err != nil || turn.State != TurnNow {
		t.Fatalf("Enter(place 2) = %+v, %v; want its turn", turn, err)
	}
	if next, err := later.Result(ctx); next != 0 || err != nil {
		t.Errorf("Result without Finish = %d, %v; want 0, nil", next, err)
	}

	// A Sequencer on another client does not carry it: Result sends it.
	other := New(sharedServer(t))
	lctx, later = s.FinishLater(ctx, key, p2)
	_ = later.Finish(Done)
	if _, err := other.Enter(lctx, key, p2); err != nil {
		t.Fatal(err)
	}
	if next, err := later.Result(ctx); next != 3 || err != nil {
		t.Errorf("Result sent alone = %d, %v; want 3", next, err)
	}
}

// pubsubClients counts the server's pub/sub connections.
func pubsubClients(t *testing.T, rdb *redis.Client) int {
	t.Helper()
	list, err := rdb.ClientList(context.Background()).Result()
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, line := range strings.Split(list, "\n") {
		if strings.Contains(line, " flags=P ") {
			n++
		}
	}
	return n
}

func TestAwaitsShareOneConnection(t *testing.T) {
	// Not parallel: it counts the server's pub/sub connections.
	rdb := sharedServer(t)
	ctx := context.Background()
	base := pubsubClients(t, rdb)
	const keys, perKey = 5, 4
	seqs := []*Sequencer{New(rdb), New(sharedServer(t))}
	type waiting struct {
		key   string
		first Place
		turn  chan Turn
	}
	var all []waiting
	for i := range keys {
		key := uniqueKey(t) + strconv.Itoa(i)
		first, _ := seqs[0].Take(ctx, key, "q", "first")
		w := waiting{key: key, first: first, turn: make(chan Turn, perKey)}
		for j := range perKey {
			p, _ := seqs[0].Take(ctx, key, "q", "t"+strconv.Itoa(j))
			go func() {
				turn, err := seqs[j%2].Await(ctx, key, p, time.Minute)
				if err != nil {
					t.Errorf("Await: %v", err)
				}
				w.turn <- turn
			}()
		}
		all = append(all, w)
	}
	// Every Await subscribes; the two Sequencers hold one connection each (the
	// control: a second Sequencer is a second connection).
	subscribed := func() bool {
		for _, w := range all {
			if n := rdb.PubSubNumSub(ctx, redisKey(DefaultPrefix, w.key)).Val()[redisKey(DefaultPrefix, w.key)]; n < 2 {
				return false
			}
		}
		return true
	}
	waitUntil(t, 10*time.Second, subscribed, func() string { return "the Awaits did not all subscribe" })
	if n := pubsubClients(t, rdb); n != base+2 {
		t.Fatalf("%d pub/sub connections for %d waiting Awaits of 2 Sequencers, want %d", n-base, keys*perKey, 2)
	}
	// Each key's first place finishes: each of its Awaits returns (its next place
	// changed), and when none waits the connections close.
	for _, w := range all {
		if _, err := seqs[0].Finish(ctx, w.key, w.first, Done); err != nil {
			t.Fatal(err)
		}
	}
	for _, w := range all {
		for range perKey {
			select {
			case turn := <-w.turn:
				if turn.Next != 2 {
					t.Errorf("Await of %s = %+v, want next place 2", w.key, turn)
				}
			case <-time.After(30 * time.Second):
				t.Fatalf("an Await of %s was not woken", w.key)
			}
		}
	}
	waitUntil(t, 10*time.Second, func() bool { return pubsubClients(t, rdb) == base },
		func() string {
			return fmt.Sprintf("%d pub/sub connections left open, want 0", pubsubClients(t, rdb)-base)
		})
}

func TestAwaitRidesOutAKilledConnection(t *testing.T) {
	rdb := sharedServer(t)
	s, ctx, key := New(rdb), context.Background(), uniqueKey(t)
	p1, _ := s.Take(ctx, key, "q", "a")
	p2, _ := s.Take(ctx, key, "q", "b")
	got := make(chan Turn, 1)
	go func() {
		turn, err := s.Await(ctx, key, p2, time.Minute)
		if err != nil {
			t.Errorf("Await: %v", err)
		}
		got <- turn
	}()
	base := 0
	waitUntil(t, 10*time.Second, func() bool { base = pubsubClients(t, rdb); return base > 0 },
		func() string { return "no pub/sub connection" })
	// Kill it and finish at once: the announcement may fall in the gap, and the Await
	// asks again once it is subscribed again.
	if err := rdb.Do(ctx, "CLIENT", "KILL", "TYPE", "pubsub").Err(); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Finish(ctx, key, p1, Done); err != nil {
		t.Fatal(err)
	}
	select {
	case turn := <-got:
		if turn.State != TurnNow {
			t.Fatalf("Await = %+v, want its turn", turn)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Await was not woken after its connection was killed")
	}
}

// waitUntil polls cond, a check of the server's state, until it holds or within
// passes.
func waitUntil(t *testing.T, within time.Duration, cond func() bool, say func() string) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal(say())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestRequeueEndsTheWaitsForAPlace(t *testing.T) {
	t.Parallel()
	s, ctx, key := New(sharedServer(t)), context.Background(), uniqueKey(t)
	p1, _ := s.Take(ctx, key, "default", "a")
	p2, _ := s.Take(ctx, key, "default", "b")
	got := make(chan Turn, 1)
	go func() {
		turn, err := s.Await(ctx, key, p2, time.Minute)
		if err != nil {
			t.Errorf("Await: %v", err)
		}
		got <- turn
	}()
	waitUntil(t, 10*time.Second, func() bool {
		return sharedServer(t).PubSubNumSub(ctx, redisKey(DefaultPrefix, key)).Val()[redisKey(DefaultPrefix, key)] == 1
	}, func() string { return "Await did not subscribe" })
	// Control: a place that is not the key's next announces nothing.
	if ok, err := s.Requeue(ctx, key, p2); ok || err != nil {
		t.Fatalf("Requeue(place 2) = %v, %v; want false: place 1 is next", ok, err)
	}
	select {
	case turn := <-got:
		t.Fatalf("Await returned %+v on a Requeue of another place", turn)
	case <-time.After(100 * time.Millisecond):
	}
	if ok, err := s.Requeue(ctx, key, p1); !ok || err != nil {
		t.Fatalf("Requeue(place 1) = %v, %v; want true", ok, err)
	}
	select {
	case turn := <-got:
		if turn.State != TurnWait || turn.Next != 1 || !turn.Holder.Requeued || turn.Holder.TaskID != "a" {
			t.Fatalf("Await after place 1's Requeue = %+v; want a wait for place 1, its holder requeued", turn)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Await was not ended by place 1's Requeue")
	}
	// Nothing changed: place 1 is next still.
	if turn, err := s.Enter(ctx, key, p2); err != nil || turn.State != TurnWait || turn.Next != 1 || turn.Holder.Requeued {
		t.Fatalf("Enter(place 2) after a Requeue = %+v, %v; want a wait for place 1", turn, err)
	}
}

// calls counts the script calls a redis client sent alone (not in pipelines) and got
// answered: the Sequencer's steps, not a connection's HELLO or a subscription.
type calls struct{ n atomic.Int64 }

func (h *calls) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *calls) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		switch cmd.Name() {
		case "fcall", "fcall_ro", "evalsha", "eval":
			h.n.Add(1)
		}
		return err
	}
}
func (h *calls) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// TestWatchHearsWhatIsAnnouncedBetweenAwaits: a Watch waits, returns on a new next
// place with its holder named by the announcement (no question to Redis), misses
// nothing announced while its caller looks at that holder, and returns its turn from
// the announcement alone. TestWatchReturnsWhatTheCallerHasNotSeen covers a next
// place that moved on before the first Await asked.
func TestWatchHearsWhatIsAnnouncedBetweenAwaits(t *testing.T) {
	t.Parallel()
	rdb := sharedServer(t)
	h := &calls{}
	rdb.AddHook(h)
	waiter, finisher := New(rdb), New(sharedServer(t))
	ctx, key := context.Background(), uniqueKey(t)
	p1, _ := finisher.Take(ctx, key, "q", "a")
	p2, _ := finisher.Take(ctx, key, "q", "b")
	p3, _ := finisher.Take(ctx, key, "q", "c")
	// The scripts loaded first, so that the count below sees only the Await's Enter.
	last, err := waiter.Enter(ctx, key, p3)
	if err != nil {
		t.Fatal(err)
	}
	h.n.Store(0)
	w := waiter.Watch(key)
	defer w.Close()
	got := make(chan Turn)
	await := func() {
		go func() {
			turn, err := w.Await(ctx, p3, last, time.Minute)
			if err != nil {
				t.Errorf("Await: %v", err)
			}
			got <- turn
		}()
	}
	await()
	// Its first Enter answered (place 1 next) and its subscription is in place, before
	// place 1 finishes.
	waitUntil(t, 10*time.Second, func() bool { return h.n.Load() >= 1 }, func() string { return "the first Await did not ask Enter" })
	waitUntil(t, 10*time.Second, func() bool {
		return rdb.PubSubNumSub(ctx, redisKey(DefaultPrefix, key)).Val()[redisKey(DefaultPrefix, key)] == 1
	}, func() string { return "the Watch did not subscribe" })
	if _, err := finisher.Finish(ctx, key, p1, Done); err != nil {
		t.Fatal(err)
	}
	turn := <-got
	if turn.State != TurnWait || turn.Next != 2 || turn.Holder.TaskID != "b" || turn.Holder.Queue != "q" {
		t.Fatalf("Await after place 1 finished = %+v; want a wait for place 2, held by b in q", turn)
	}
	last = turn
	// Counted from here: the subscription's confirmation came before the
	// announcement, on the same connection, and any question it raised is answered.
	before := h.n.Load()
	// Place 2 finishes while nobody awaits: the Watch heard it.
	if _, err := finisher.Finish(ctx, key, p2, Done); err != nil {
		t.Fatal(err)
	}
	await()
	if turn := <-got; turn.State != TurnNow || turn.Next != 3 {
		t.Fatalf("Await after place 2 finished between Awaits = %+v; want its turn", turn)
	}
	if n := h.n.Load() - before; n != 0 {
		t.Errorf("the waiter sent %d commands for the second wait, want 0: the announcement said it all", n)
	}
}

// TestWatchReturnsWhatTheCallerHasNotSeen: the caller judged place 1's holder; by the
// time its Watch's first Await asks, place 1 is finished. The Await returns the new
// next place at once, for the caller to judge, instead of waiting on it unseen.
func TestWatchReturnsWhatTheCallerHasNotSeen(t *testing.T) {
	t.Parallel()
	s, ctx, key := New(sharedServer(t)), context.Background(), uniqueKey(t)
	p1, _ := s.Take(ctx, key, "q", "a")
	_, _ = s.Take(ctx, key, "q", "b")
	p3, _ := s.Take(ctx, key, "q", "c")
	judged, err := s.Enter(ctx, key, p3)
	if err != nil || judged.Next != 1 {
		t.Fatalf("Enter = %+v, %v; want a wait for place 1", judged, err)
	}
	if _, err := s.Finish(ctx, key, p1, Done); err != nil {
		t.Fatal(err)
	}
	w := s.Watch(key)
	defer w.Close()
	start := time.Now()
	const maxWait = time.Minute
	turn, err := w.Await(ctx, p3, judged, maxWait)
	if err != nil || turn.State != TurnWait || turn.Next != 2 || turn.Holder.TaskID != "b" {
		t.Fatalf("Await = %+v, %v; want a wait for place 2, held by b", turn, err)
	}
	if d := time.Since(start); d > maxWait/2 {
		t.Fatalf("Await returned after %v: it waited on a next place its caller had not judged", d)
	}
	// And a Turn newer than the Watch's is the caller's to wait from.
	if _, err := s.Finish(ctx, key, Place{Epoch: p1.Epoch, N: 2}, Done); err != nil {
		t.Fatal(err)
	}
	if turn, err = w.Await(ctx, p3, turn, maxWait); err != nil || turn.State != TurnNow {
		t.Fatalf("Await after place 2 finished = %+v, %v; want its turn", turn, err)
	}
}
