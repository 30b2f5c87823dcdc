package cli

import (
	"encoding/json"
	"errors"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
	"github.com/asynqmutex/asynqmutex/mutex"
)

// parkedAges reads key's lock with Inspect, around f, and returns how long its oldest
// parked task had waited before and after f ran.
func parkedAges(t *testing.T, locks *mutex.Client, key string, f func()) (before, after time.Duration) {
	t.Helper()
	in, err := locks.Inspect(ctxT(t), key)
	if err != nil {
		t.Fatal(err)
	}
	f()
	out, err := locks.Inspect(ctxT(t), key)
	if err != nil {
		t.Fatal(err)
	}
	if in.Parked == 0 || out.Parked == 0 {
		t.Fatalf("Inspect(%s) counts %d and %d parked tasks, want some", key, in.Parked, out.Parked)
	}
	return in.ParkedFor, out.ParkedFor
}

// oldestText matches the waiting count list and show print for a line with parked
// tasks, capturing the oldest one's age.
var oldestText = regexp.MustCompile(`^3 \(2 parked, oldest ([0-9.]+(?:µs|ms|s|m[0-9]+s))\)$`)

// checkOldest checks the age text (human's, rounded below a second to the
// millisecond, below a minute to 100ms) against the ages read before and after.
func checkOldest(t *testing.T, what, text string, before, after time.Duration) {
	t.Helper()
	m := oldestText.FindStringSubmatch(text)
	if m == nil {
		t.Fatalf("%s: waiting %q, want %q", what, text, "3 (2 parked, oldest <age>)")
	}
	d, err := time.ParseDuration(m[1])
	if err != nil {
		t.Fatalf("%s: oldest %q: %v", what, m[1], err)
	}
	if round := 50 * time.Millisecond; d < before-round || d > after+round {
		t.Errorf("%s: oldest %v, want within [%v, %v] give or take its rounding", what, d, before, after)
	}
}

// TestParkedTasksShown parks two tasks behind a waiter in a key's line, and reads the
// key with list, show and their --json forms: each says how many wait parked, and
// how long the oldest has; a key without parked tasks says nothing of them.
func TestParkedTasksShown(t *testing.T) {
	t.Parallel()
	s := redistest.Start(t)
	rdb := s.Client(t)
	locks := newLocks(t, rdb)
	payKey := taskKeyOf(t, "payment:capture", `"c-7"`)
	reportKey := taskKeyOf(t, "report:daily")
	lock(t, locks, payKey, "payment:capture", "task-1")
	lock(t, locks, reportKey, "report:daily", "task-9")
	startWaiter(t, rdb, newLocks(t, rdb), payKey, "payment:capture", "task-2", 1)
	for _, id := range []string{"task-5", "task-6"} {
		_, err := locks.Lock(ctxT(t), payKey, time.Minute, mutex.Park(id, 5*time.Second, mutex.ParkAfterWait),
			mutex.MaxWait(time.Millisecond), mutex.HeldBy("payment:capture", id))
		if !errors.Is(err, mutex.ErrParked) {
			t.Fatalf("Lock with Park(%s) = %v, want ErrParked", id, err)
		}
	}
	uri := "--uri=" + s.Addr()

	t.Run("list", func(t *testing.T) {
		var r result
		before, after := parkedAges(t, locks, payKey, func() { r = mustRun(t, "list", uri) })
		lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
		if len(lines) != 3 || !strings.HasPrefix(lines[1], payKey+" ") || !strings.HasPrefix(lines[2], reportKey+" ") {
			t.Fatalf("list printed\n%s\nwant a header, %s and %s", r.stdout, payKey, reportKey)
		}
		// The last column, WAITING.
		at := strings.Index(lines[0], "WAITING")
		checkOldest(t, "list", lines[1][at:], before, after)
		if got := lines[2][at:]; got != "0" {
			t.Errorf("list: waiting for %s = %q, want 0", reportKey, got)
		}
	})

	t.Run("list --json", func(t *testing.T) {
		var r result
		before, after := parkedAges(t, locks, payKey, func() { r = mustRun(t, "--json", "list", uri) })
		var doc struct{ Locks []lockJSON }
		if err := json.Unmarshal([]byte(r.stdout), &doc); err != nil || len(doc.Locks) != 2 {
			t.Fatalf("list --json: %v, want 2 locks:\n%s", err, r.stdout)
		}
		pay, report := doc.Locks[0], doc.Locks[1]
		if pay.Waiting != 3 || pay.Parked == nil || *pay.Parked != 2 || pay.ParkedForMS == nil ||
			*pay.ParkedForMS < before.Milliseconds() || *pay.ParkedForMS > after.Milliseconds() {
			t.Errorf("list --json: %s = %s\nwant waiting 3, parked 2, parked_for_ms in [%d, %d]", payKey, r.stdout, before.Milliseconds(), after.Milliseconds())
		}
		if report.Parked == nil || *report.Parked != 0 || report.ParkedForMS != nil {
			t.Errorf("list --json: %s = %s\nwant parked 0, parked_for_ms null", reportKey, r.stdout)
		}
	})

	t.Run("show", func(t *testing.T) {
		var r result
		before, after := parkedAges(t, locks, payKey, func() { r = mustRun(t, uri, "show", payKey) })
		var waiting string
		for _, line := range strings.Split(r.stdout, "\n") {
			if v, ok := strings.CutPrefix(line, "Waiting:"); ok {
				waiting = strings.TrimSpace(v)
			}
		}
		checkOldest(t, "show", waiting, before, after)
		// In the order they are served; a parked task is named by its task alone.
		want := "  1. " + holderLine(t, "payment:capture", "task-2") + "\n  2. payment:capture task-5\n  3. payment:capture task-6\n"
		if !strings.Contains(r.stdout, want) {
			t.Errorf("show printed\n%s\nwant its waiters listed as\n%s", r.stdout, want)
		}
		r = mustRun(t, uri, "show", reportKey)
		if !strings.Contains(r.stdout, "\nWaiting:     0\n") {
			t.Errorf("show of a key without waiters printed\n%s\nwant Waiting: 0", r.stdout)
		}
	})

	t.Run("show --json", func(t *testing.T) {
		var r result
		before, after := parkedAges(t, locks, payKey, func() { r = mustRun(t, uri, "--json", "show", payKey) })
		var got lockJSON
		if err := json.Unmarshal([]byte(r.stdout), &got); err != nil {
			t.Fatalf("show --json: %v\n%s", err, r.stdout)
		}
		var ids []string
		for _, w := range got.Waiters {
			ids = append(ids, w.ID)
		}
		if got.Waiting != 3 || got.Parked == nil || *got.Parked != 2 || got.ParkedForMS == nil ||
			*got.ParkedForMS < before.Milliseconds() || *got.ParkedForMS > after.Milliseconds() ||
			strings.Join(ids, ",") != "task-2,task-5,task-6" {
			t.Errorf("show --json = %s\nwant waiting 3, parked 2, parked_for_ms in [%d, %d], waiters task-2, task-5, task-6",
				r.stdout, before.Milliseconds(), after.Milliseconds())
		}
		r = mustRun(t, uri, "--json", "show", reportKey)
		if err := json.Unmarshal([]byte(r.stdout), &got); err != nil || got.Parked == nil || *got.Parked != 0 || got.ParkedForMS != nil {
			t.Errorf("show --json of a key without waiters = %s\nwant parked 0, parked_for_ms null (%v)", r.stdout, err)
		}
	})

	t.Run("release --json", func(t *testing.T) {
		// ForceRelease does not count parked tasks: before says it does not know.
		r := mustRun(t, uri, "--json", "release", "--force", reportKey)
		var doc releaseJSON
		if err := json.Unmarshal([]byte(r.stdout), &doc); err != nil || !doc.Released || doc.Before.Parked != nil || doc.Before.ParkedForMS != nil {
			t.Errorf("release --json = %s\nwant released, before's parked and parked_for_ms null (%v)", r.stdout, err)
		}
	})
}
