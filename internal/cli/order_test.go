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
}
