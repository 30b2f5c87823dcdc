package cli

import (
	"encoding/json"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
	"github.com/asynqmutex/asynqmutex/mutex"
)

// TestLimitKeys: a key held with Limit(n) is listed once, with every holder, shown
// with its waiters apart from its holders, and release refuses it with an error that
// says why.
func TestLimitKeys(t *testing.T) {
	t.Parallel()
	s := redistest.Start(t)
	rdb := s.Client(t)
	locks := newLocks(t, rdb)
	key := taskKeyOf(t, "report:export", `"tenant-7"`)
	var fences []int64
	for _, id := range []string{"task-1", "task-2", "task-3"} {
		l, err := locks.TryLock(ctxT(t), key, time.Minute, mutex.Limit(3), mutex.HeldBy("report:export", id))
		if err != nil {
			t.Fatal(err)
		}
		fences = append(fences, l.Fence())
	}
	startWaiter(t, rdb, newLocks(t, rdb), key, "report:export", "task-4", 1, mutex.Limit(3))
	uri := "--uri=" + s.Addr()

	r := mustRun(t, "list", uri)
	lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
	if len(lines) != 2 || !strings.Contains(lines[1], holderLine(t, "", "task-3")+" +2 (Limit 3)") ||
		!strings.Contains(lines[1], " "+strconv.FormatInt(fences[2], 10)+" ") {
		t.Errorf("list = %q, want one line naming the newest holder, +2 and Limit 3, fence %d", r.stdout, fences[2])
	}

	// In order: the state, the waiters under Waiting, then the holders under their
	// own heading, with nothing between the heading and them.
	r = mustRun(t, "show", uri, key)
	want := []string{
		"State:", "held by 3 holders, at most 3 at once (Limit 3)",
		"Waiting:", "1",
		"  1. " + holderLine(t, "report:export", "task-4"),
		"\nHolders:\n  HOLDER",
		"\n  " + holderLine(t, "report:export", "task-1"), strconv.FormatInt(fences[0], 10),
		"\n  " + holderLine(t, "report:export", "task-2"), strconv.FormatInt(fences[1], 10),
		"\n  " + holderLine(t, "report:export", "task-3"), strconv.FormatInt(fences[2], 10),
	}
	at := 0
	for _, w := range want {
		i := strings.Index(r.stdout[at:], w)
		if i < 0 {
			t.Fatalf("show output lacks %q after byte %d (in this order: %q):\n%s", w, at, want, r.stdout)
		}
		at += i + len(w)
	}
	if holders := r.stdout[strings.Index(r.stdout, "Holders:"):]; strings.Contains(holders, "Waiting") || strings.Contains(holders, "task-4") {
		t.Errorf("show lists a waiter among the holders:\n%s", r.stdout)
	}

	r = mustRun(t, "--json", "show", uri, key)
	var doc lockJSON
	if err := json.Unmarshal([]byte(r.stdout), &doc); err != nil {
		t.Fatal(err)
	}
	if doc.Limit != 3 || len(doc.Holders) != 3 || doc.Holders[0].Fence != fences[0] || doc.Holders[1].Holder.ID != "task-2" ||
		doc.Holders[0].LeaseLeftMS <= 0 || doc.Waiting != 1 || len(doc.Waiters) != 1 || doc.Waiters[0].ID != "task-4" {
		t.Errorf("show --json = %+v, want limit 3, the three holders and the waiter", doc)
	}

	r = cli(t, nil, "release", "--force", uri, key)
	if r.code == 0 || !strings.Contains(r.stderr, "held with Limit(3) by 3 holders") {
		t.Errorf("release of a key held with Limit(3) = %v, want a failure saying so", r)
	}
}
