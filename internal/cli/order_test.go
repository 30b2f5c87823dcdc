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

	r := mustRun(t, "order", "--task", "transfer", "acct-7", uri)
	for _, want := range []string{
		"Next place:  2 of 3 taken: 2 places not finished",
		`Waits for:   task t-2 in queue transfers, which took its place`,
		"Skipped:     1 place moved past without their task finishing",
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
	if !doc.Ordered || doc.Next != 2 || doc.Last != 3 || doc.Waiting != 2 || doc.Skipped != 1 ||
		doc.Holder == nil || doc.Holder.TaskID != "t-2" || doc.Holder.Queue != "transfers" {
		t.Errorf("order --json = %+v (holder %+v)", doc, doc.Holder)
	}

	r = mustRun(t, "order", "--task", "transfer", "acct-8", uri)
	if !strings.Contains(r.stdout, "not ordered") {
		t.Errorf("order of a key without one:\n%s", r.stdout)
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
