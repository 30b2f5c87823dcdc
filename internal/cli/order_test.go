package cli

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
	"github.com/asynqmutex/asynqmutex/order"
)

// TestOrder: order shows a key's next place, the task that holds it, and the places
// skipped; a key without an order says so, and is no error.
func TestOrder(t *testing.T) {
	t.Parallel()
	s := redistest.Start(t)
	seq, uri := order.New(s.Client(t)), "--uri="+s.Addr()
	key := taskKeyOf(t, "transfer", `"acct-7"`)
	var places []order.Place
	for _, id := range []string{"t-1", "t-2", "t-3"} {
		p, err := seq.Take(ctxT(t), key, "transfers", id)
		if err != nil {
			t.Fatal(err)
		}
		places = append(places, p)
	}
	if _, err := seq.Finish(ctxT(t), key, places[0], order.Skipped); err != nil {
		t.Fatal(err)
	}
	if _, err := seq.Park(ctxT(t), key, places[2], "a-ticket"); err != nil {
		t.Fatal(err)
	}

	r := mustRun(t, "order", "--task", "transfer", "acct-7", uri)
	for _, want := range []string{
		"Next place:  2 of 3 taken: 2 places not finished, 1 parked",
		`Waits for:   task t-2 in queue transfers, which took its place`,
		"Skipped:     1 place moved past without its task finishing\n",
	} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("order's output lacks %q:\n%s", want, r.stdout)
		}
	}

	r = mustRun(t, "order", key, "--json", uri)
	var doc orderJSON
	if err := json.Unmarshal([]byte(r.stdout), &doc); err != nil {
		t.Fatalf("order --json: %v\n%s", err, r.stdout)
	}
	if !doc.Ordered || doc.Next != 2 || doc.Last != 3 || doc.Waiting != 2 || doc.Skipped != 1 || doc.Parked != 1 ||
		doc.Holder == nil || doc.Holder.TaskID != "t-2" || doc.Holder.Queue != "transfers" {
		t.Errorf("order --json = %+v (holder %+v)", doc, doc.Holder)
	}

	// A key without an order: exit 1, and the ordered keys of its task type.
	r = cli(t, nil, "order", "--task", "transfer", "acct-8", uri)
	if r.code != exitFailure || !strings.Contains(r.stdout, "not ordered") ||
		!strings.Contains(r.stderr, `not found: no order is kept for ["transfer","acct-8"] under prefix "asynqmutex:"`) {
		t.Errorf("order of a key without one: %v\nwant exit 1 and not ordered", r)
	}
	for _, want := range []string{
		`Ordered nearby: 1 key of task type "transfer" (of 1 ordered under prefix "asynqmutex:"); is one of them meant?`,
		"  " + key + "    asynqmutex order --task transfer acct-7\n",
	} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("order of a near miss:\n%s\nwant it to contain %q", r.stdout, want)
		}
	}
	r = cli(t, nil, "order", "--json", `["nobody:here"]`, uri)
	var miss orderJSON
	if err := json.Unmarshal([]byte(r.stdout), &miss); err != nil || r.code != exitFailure || miss.Ordered || miss.Nearby == nil ||
		miss.Nearby.TaskType != "nobody:here" || len(miss.Nearby.Keys) != 0 || miss.Nearby.Ordered != 1 {
		t.Errorf("order --json of a key of no ordered type: %v (%v)\nwant exit 1, nearby with no keys, of 1 ordered", r, err)
	}
	if r := cli(t, nil, "order", `["nobody:here"]`, uri); !strings.Contains(r.stdout,
		`No key of task type "nobody:here" is ordered; 1 other key is ordered under prefix "asynqmutex:".`+"\n") {
		t.Errorf("order of a task type nobody orders:\n%s\nwant the count of ordered keys", r.stdout)
	}

	// --skip moves the key past its next place, and only past the one named.
	if r := cli(t, nil, "order", "--skip", "3", "--task", "transfer", "acct-7", uri); r.code != exitFailure || !strings.Contains(r.stderr, "nothing skipped") {
		t.Errorf("order --skip 3 while the next place is 2: %v", r)
	}
	r = mustRun(t, "order", "--skip", "2", "--task", "transfer", "acct-7", uri)
	if !strings.Contains(r.stdout, "past place 2 (task t-2); its next place is 3") {
		t.Errorf("order --skip 2:\n%s", r.stdout)
	}
	if st, err := seq.Inspect(ctxT(t), key); err != nil || st.Next != 3 || st.Skipped != 2 {
		t.Errorf("after --skip 2: %+v, %v; want next 3, 2 skipped", st, err)
	}
	if r := cli(t, nil, "list", "--skip", "2", uri); r.code != exitUsage {
		t.Errorf("list --skip: %v", r)
	}
}

// TestListPlaces: list shows a lock held by the task whose turn it is in its key's
// order by its task type and place, not by its ID, which Producer begins with the
// time; a lock held by another task keeps its ID. An operator whose ACL rules leave
// out order's (docs/operating.md) sees the IDs.
func TestListPlaces(t *testing.T) {
	t.Parallel()
	s := redistest.Start(t)
	admin := s.Client(t)
	locks, seq := newLocks(t, admin), order.New(admin)
	// IDs as Producer makes them: alike in their first 16 characters.
	const id1, id2, id3 = "00064a1b2c3d4e5f-0102030405060708", "00064a1b2c3d4e60-1112131415161718", "00064a1b2c3d4e61-2122232425262728"
	a, b := taskKeyOf(t, "transfer", `"acct-1"`), taskKeyOf(t, "transfer", `"acct-2"`)
	if _, err := seq.Take(ctxT(t), a, "transfers", id1); err != nil {
		t.Fatal(err)
	}
	first, err := seq.Take(ctxT(t), b, "transfers", id2)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := seq.Take(ctxT(t), b, "transfers", id3); err != nil {
		t.Fatal(err)
	}
	if _, err := seq.Finish(ctxT(t), b, first, order.Done); err != nil {
		t.Fatal(err)
	}
	lock(t, locks, a, "transfer", id1)
	lock(t, locks, b, "transfer", id3)
	other := taskKeyOf(t, "transfer", `"acct-3"`) // a task without a place
	lock(t, locks, other, "transfer", id2)

	r := mustRun(t, "list", "--uri="+s.Addr())
	t.Logf("asynqmutex list:\n%s", r.stdout)
	for _, want := range []string{
		a + "  " + holderLine(t, "transfer", "place 1") + "  ",
		b + "  " + holderLine(t, "transfer", "place 2") + "  ",
		other + "  " + holderLine(t, "", id2[:8]+"…") + "  ",
	} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("list:\n%s\nwant it to contain %q", r.stdout, want)
		}
	}
	r = mustRun(t, "list", "--json", "--uri="+s.Addr())
	var doc listJSON
	if err := json.Unmarshal([]byte(r.stdout), &doc); err != nil || len(doc.Locks) != 3 ||
		doc.Locks[0].Place != 1 || doc.Locks[1].Place != 2 || doc.Locks[2].Place != 0 || doc.Locks[1].Holder.ID != id3 {
		t.Errorf("list --json = %s (%v)\nwant places 1, 2 and none, the IDs whole", r.stdout, err)
	}

	acl := redistest.ReadDocACL(t, "../../docs/operating.md")
	for _, tt := range []struct {
		user, rules, want string
	}{
		{"operator", acl.Worker + " " + acl.Functions + " " + acl.Operator, holderLine(t, "", id1[:8]+"…")},
		// The control: the same user with order's rules sees the place.
		{"orderop", acl.Worker + " " + acl.Functions + " " + acl.Operator + " +hget +hmget", holderLine(t, "transfer", "place 1")},
	} {
		s.User(t, admin, tt.user, tt.rules)
		env := map[string]string{"REDIS_URL": "redis://" + tt.user + ":" + tt.user + "-secret@" + s.Addr()}
		if r := cli(t, env, "list"); r.code != 0 || !strings.Contains(r.stdout, a+"  "+tt.want+"  ") {
			t.Errorf("list as %s: %v\nwant %s held by %s", tt.user, r, a, tt.want)
		}
	}
}

// TestOrderHalted: a key halted at its next place (HaltOnFailure) is shown halted,
// with how to go on; order --blocked lists it as stuck (exit 1); --skip moves the key
// past it, which no worker does.
func TestOrderHalted(t *testing.T) {
	t.Parallel()
	s := redistest.Start(t)
	seq, uri := order.New(s.Client(t)), "--uri="+s.Addr()
	key := taskKeyOf(t, "ledger", `"acct-1"`)
	var places []order.Place
	for _, id := range []string{"t-1", "t-2"} {
		p, err := seq.Take(ctxT(t), key, "ledgers", id)
		if err != nil {
			t.Fatal(err)
		}
		places = append(places, p)
	}
	if _, err := seq.Finish(ctxT(t), key, places[0], order.Halted); err != nil {
		t.Fatal(err)
	}

	r := mustRun(t, "order", "--task", "ledger", "acct-1", uri)
	for _, want := range []string{
		"Waits for:   task t-1 in queue ledgers, which failed for good ",
		"the key HALTED there (HaltOnFailure)",
		"To go on:    run the task again from asynq's archive (it finishes its place when it completes), or move the key past it: asynqmutex order --skip 1 --task ledger acct-1",
	} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("order of a halted key lacks %q:\n%s", want, r.stdout)
		}
	}
	r = mustRun(t, "order", key, "--json", uri)
	var doc orderJSON
	if err := json.Unmarshal([]byte(r.stdout), &doc); err != nil || doc.Halted != 1 || doc.Next != 1 {
		t.Errorf("order --json of a halted key = %s (%v); want halted 1", r.stdout, err)
	}

	r = cli(t, nil, "order", "--blocked", uri)
	t.Logf("asynqmutex order --blocked:\n%s%s", r.stdout, r.stderr)
	if r.code != exitFailure || !strings.Contains(r.stdout, "HALTED at it (HaltOnFailure)") ||
		!strings.Contains(r.stdout, "asynqmutex order --skip 1 --task ledger acct-1") || !strings.Contains(r.stderr, "1 ordered key will not move on by itself") {
		t.Errorf("order --blocked with a halted key: %v\nwant it listed as stuck, exit 1", r)
	}

	r = mustRun(t, "order", "--skip", "1", "--task", "ledger", "acct-1", uri)
	if !strings.Contains(r.stdout, "past place 1 (task t-1); its next place is 2") {
		t.Errorf("order --skip 1 of the halted place:\n%s", r.stdout)
	}
	if st, err := seq.Inspect(ctxT(t), key); err != nil || st.Next != 2 || st.Halted != 0 {
		t.Errorf("after --skip 1: %+v, %v; want next 2, no halt", st, err)
	}
}
