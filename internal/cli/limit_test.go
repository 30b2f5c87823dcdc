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

// TestLimitKeys: a key held with Limit(n) is listed once, with every holder, and
// release refuses it with an error that says why.
func TestLimitKeys(t *testing.T) {
	t.Parallel()
	s := redistest.Start(t)
	rdb := s.Client(t)
	locks := newLocks(t, rdb)
	key := taskKeyOf(t, "report:export", `"tenant-7"`)
	var fences []int64
	for _, id := range []string{"task-1", "task-2"} {
		l, err := locks.TryLock(ctxT(t), key, time.Minute, mutex.Limit(3), mutex.HeldBy("report:export", id))
		if err != nil {
			t.Fatal(err)
		}
		fences = append(fences, l.Fence())
	}
	uri := "--uri=" + s.Addr()

	r := mustRun(t, "list", uri)
	lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
	if len(lines) != 2 || !strings.Contains(lines[1], holderLine(t, "report:export", "task-2")+" and 1 more (Limit 3)") ||
		!strings.Contains(lines[1], " "+strconv.FormatInt(fences[1], 10)+" ") {
		t.Errorf("list = %q, want one line naming the newest holder, 1 more and Limit 3, fence %d", r.stdout, fences[1])
	}

	r = mustRun(t, "show", uri, key)
	for _, want := range []string{"Limit:", "3 holders at once; 2 hold it", holderLine(t, "report:export", "task-1"), strconv.FormatInt(fences[0], 10)} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("show lacks %q:\n%s", want, r.stdout)
		}
	}

	r = mustRun(t, "--json", "show", uri, key)
	var doc lockJSON
	if err := json.Unmarshal([]byte(r.stdout), &doc); err != nil {
		t.Fatal(err)
	}
	if doc.Limit != 3 || len(doc.Holders) != 2 || doc.Holders[0].Fence != fences[0] || doc.Holders[1].Holder.ID != "task-2" || doc.Holders[0].LeaseLeftMS <= 0 {
		t.Errorf("show --json = %+v, want limit 3 and both holders", doc)
	}

	r = cli(t, nil, "release", "--force", uri, key)
	if r.code == 0 || !strings.Contains(r.stderr, "held with Limit(3) by 2 holders") {
		t.Errorf("release of a key held with Limit(3) = %v, want a failure saying so", r)
	}
}
