package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"

	"github.com/asynqmutex/asynqmutex"
	"github.com/asynqmutex/asynqmutex/internal/redistest"
	"github.com/asynqmutex/asynqmutex/mutex"
	"github.com/asynqmutex/asynqmutex/order"
	"github.com/asynqmutex/asynqmutex/ratelimit"
)

func TestMain(m *testing.M) {
	redistest.QuietRedisLogs()
	// run closes every client it opens; a goroutine left behind would be a leak in
	// a long-running caller too.
	goleak.VerifyTestMain(m)
}

// result is what one run of the command printed and returned.
type result struct {
	stdout, stderr string
	code           int
}

func (r result) String() string {
	return fmt.Sprintf("exit %d\nstdout:\n%s\nstderr:\n%s", r.code, r.stdout, r.stderr)
}

// cli runs the command with args and the environment env (nothing else of the
// process environment), bounded by 30s.
func cli(t *testing.T, env map[string]string, args ...string) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var stdout, stderr bytes.Buffer
	code := run(ctx, args, func(k string) string { return env[k] }, &stdout, &stderr)
	return result{stdout: stdout.String(), stderr: stderr.String(), code: code}
}

// mustRun runs the command and fails the test unless it exits 0.
func mustRun(t *testing.T, args ...string) result {
	t.Helper()
	r := cli(t, nil, args...)
	if r.code != 0 {
		t.Fatalf("asynqmutex %s: %v", strings.Join(args, " "), r)
	}
	return r
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func newLocks(t *testing.T, rdb redis.UniversalClient, opts ...mutex.Option) *mutex.Client {
	t.Helper()
	c := mutex.New(rdb, opts...)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func taskKeyOf(t *testing.T, typ string, values ...string) string {
	t.Helper()
	key, err := asynqmutex.Key(typ, values...)
	if err != nil {
		t.Fatal(err)
	}
	return key
}

func lock(t *testing.T, c *mutex.Client, key, name, id string) *mutex.Lock {
	t.Helper()
	l, err := c.TryLock(ctxT(t), key, time.Minute, mutex.HeldBy(name, id))
	if err != nil {
		t.Fatalf("TryLock(%s): %v", key, err)
	}
	t.Cleanup(func() { _ = l.Unlock(context.Background()) })
	return l
}

// waiter is a Lock call blocked on another goroutine.
type waiter struct {
	done chan struct{}
	lock *mutex.Lock
	err  error
}

// startWaiter calls Lock on key as HeldBy(name, id), with opts, and returns once Redis has it
// queued as waiter number n, and its Client listens for a hand-over.
func startWaiter(t *testing.T, rdb redis.UniversalClient, c *mutex.Client, key, name, id string, n int, opts ...mutex.LockOption) *waiter {
	t.Helper()
	before, err := rdb.PubSubChannels(ctxT(t), mutex.DefaultPrefix+"wake:*").Result()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	w := &waiter{done: make(chan struct{})}
	go func() {
		defer close(w.done)
		w.lock, w.err = c.Lock(ctx, key, time.Minute, append(opts, mutex.HeldBy(name, id))...)
	}()
	t.Cleanup(func() {
		cancel()
		<-w.done
		_ = w.lock.Unlock(context.Background())
	})
	for range 2000 {
		in, err := c.Inspect(ctxT(t), key)
		if err != nil {
			t.Fatal(err)
		}
		subs, err := rdb.PubSubChannels(ctxT(t), mutex.DefaultPrefix+"wake:*").Result()
		if err != nil {
			t.Fatal(err)
		}
		// c listens on a channel of its own: one that was not there before.
		if in.Waiting == n && len(subs) > len(before) {
			return w
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatalf("waiter %s for %s not queued as number %d within 10s", id, key, n)
	return nil
}

// untimed is show's output without the lines that change as time passes.
func untimed(out string) string {
	var keep []string
	for _, line := range strings.Split(out, "\n") {
		if !strings.HasPrefix(line, "Since:") && !strings.HasPrefix(line, "Lease left:") {
			keep = append(keep, line)
		}
	}
	return strings.Join(keep, "\n")
}

// holderLine is how Holder.String shows a holder in this test process.
func holderLine(t *testing.T, name, id string) string {
	t.Helper()
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "unknown"
	}
	return strings.TrimPrefix(fmt.Sprintf("%s %s on %s (pid %d)", name, id, host, os.Getpid()), " ")
}

// TestListAndShow takes a lock with two waiters and another lock, and reads them
// with list, show and their --json forms.
func TestListAndShow(t *testing.T) {
	t.Parallel()
	s := redistest.Start(t)
	rdb := s.Client(t)
	locks := newLocks(t, rdb)
	payKey := taskKeyOf(t, "payment:capture", `"c-42"`)
	reportKey := taskKeyOf(t, "report:daily")
	// Taken in the order that would list them unsorted.
	report := lock(t, locks, reportKey, "report:daily", "task-9")
	pay := lock(t, locks, payKey, "payment:capture", "task-1")
	startWaiter(t, rdb, newLocks(t, rdb), payKey, "payment:capture", "task-2", 1)
	startWaiter(t, rdb, newLocks(t, rdb), payKey, "payment:capture", "task-3", 2)
	uri := "--uri=" + s.Addr()

	t.Run("list", func(t *testing.T) {
		r := mustRun(t, "list", uri)
		lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
		if len(lines) != 3 {
			t.Fatalf("list printed %d lines, want a header and 2 locks:\n%s", len(lines), r.stdout)
		}
		for _, col := range []string{"KEY", "HOLDER", "HELD FOR", "LEASE", "FENCE", "WAITING"} {
			if !strings.Contains(lines[0], col) {
				t.Errorf("header %q lacks column %s", lines[0], col)
			}
		}
		want := []struct {
			key, holder string
			fence       int64
			waiters     string
		}{
			// Without the task type the key begins with.
			{payKey, "  " + holderLine(t, "", "task-1"), pay.Fence(), "2"},
			{reportKey, "  " + holderLine(t, "", "task-9"), report.Fence(), "0"},
		}
		for i, w := range want {
			line := lines[i+1]
			if !strings.HasPrefix(line, w.key+" ") || !strings.Contains(line, w.holder) ||
				!strings.Contains(line, " "+strconv.FormatInt(w.fence, 10)+" ") || !strings.HasSuffix(line, " "+w.waiters) {
				t.Errorf("list line %d = %q, want key %s, holder %q, fence %d, %s waiters", i+1, line, w.key, w.holder, w.fence, w.waiters)
			}
		}
	})

	t.Run("list --json", func(t *testing.T) {
		r := mustRun(t, "--json", "list", uri)
		var doc struct {
			Prefix string
			Locks  []lockJSON
		}
		if err := json.Unmarshal([]byte(r.stdout), &doc); err != nil {
			t.Fatalf("list --json is not one JSON document: %v\n%s", err, r.stdout)
		}
		if doc.Prefix != mutex.DefaultPrefix || len(doc.Locks) != 2 {
			t.Fatalf("list --json: prefix %q, %d locks, want %q and 2:\n%s", doc.Prefix, len(doc.Locks), mutex.DefaultPrefix, r.stdout)
		}
		got := doc.Locks[0]
		host, _ := os.Hostname()
		wantHolder := holderJSON{Name: "payment:capture", ID: "task-1", Host: host, PID: os.Getpid()}
		if got.Key != payKey || !got.Held || got.Holder == nil || *got.Holder != wantHolder || got.Fence != pay.Fence() ||
			got.Waiting != 2 || got.Waiters != nil {
			t.Errorf("first lock = %+v, want key %s held by %+v, fence %d, 2 waiting, no waiter list", got, payKey, wantHolder, pay.Fence())
		}
		if got.LeaseLeftMS == nil || *got.LeaseLeftMS <= 0 || *got.LeaseLeftMS > time.Minute.Milliseconds() {
			t.Errorf("lease_left_ms = %v, want in (0, 60000]", got.LeaseLeftMS)
		}
		if got.HeldForMS == nil || *got.HeldForMS < 0 {
			t.Errorf("held_for_ms = %v, want >= 0", got.HeldForMS)
		}
		if got.Since == nil {
			t.Error("since missing")
		} else if _, err := time.Parse(time.RFC3339, *got.Since); err != nil {
			t.Errorf("since %q is not RFC 3339: %v", *got.Since, err)
		}
		if doc.Locks[1].Key != reportKey {
			t.Errorf("second lock key = %s, want %s", doc.Locks[1].Key, reportKey)
		}
		for _, tok := range []string{pay.Token(), report.Token()} {
			if strings.Contains(r.stdout, tok) {
				t.Errorf("list --json prints a lock token:\n%s", r.stdout)
			}
		}
	})

	t.Run("show", func(t *testing.T) {
		want := []string{
			"Key:", payKey,
			"State:", "held",
			"Holder:", holderLine(t, "payment:capture", "task-1"),
			"Fence:", strconv.FormatInt(pay.Fence(), 10),
			"Waiting:", "2",
			"  1. " + holderLine(t, "payment:capture", "task-2"),
			"  2. " + holderLine(t, "payment:capture", "task-3"),
		}
		r := mustRun(t, uri, "show", payKey)
		at := 0
		for _, w := range want {
			i := strings.Index(r.stdout[at:], w)
			if i < 0 {
				t.Fatalf("show output lacks %q after byte %d (in this order: %q):\n%s", w, at, want, r.stdout)
			}
			at += i + len(w)
		}
		if strings.Contains(r.stdout, pay.Token()) {
			t.Errorf("show prints the lock token:\n%s", r.stdout)
		}
		// The --task forms name the same lock: c-42 is not JSON, so it is the string.
		for _, args := range [][]string{
			{"show", "--task", "payment:capture", "c-42", uri},
			{"show", "--task", "payment:capture", `"c-42"`, uri},
		} {
			if got := mustRun(t, args...); untimed(got.stdout) != untimed(r.stdout) {
				t.Errorf("asynqmutex %s printed\n%s\nwant what show KEY printed:\n%s", strings.Join(args, " "), got.stdout, r.stdout)
			}
		}
	})

	t.Run("show --json", func(t *testing.T) {
		r := mustRun(t, "show", "--json", "--task", "payment:capture", "c-42", uri)
		var got lockJSON
		if err := json.Unmarshal([]byte(r.stdout), &got); err != nil {
			t.Fatalf("show --json: %v\n%s", err, r.stdout)
		}
		var ids []string
		for _, w := range got.Waiters {
			ids = append(ids, w.ID)
		}
		if got.Key != payKey || got.Fence != pay.Fence() || got.Waiting != 2 || strings.Join(ids, ",") != "task-2,task-3" {
			t.Errorf("show --json = key %s fence %d waiting %d waiters %v, want %s, %d, 2, [task-2 task-3]", got.Key, got.Fence, got.Waiting, ids, payKey, pay.Fence())
		}
	})

	t.Run("show not held", func(t *testing.T) {
		r := cli(t, nil, "show", "--task", "payment:capture", "42", uri) // neither 42 nor "42" is held
		if r.code != exitFailure || !strings.Contains(r.stdout, "not held") || !strings.Contains(r.stderr, "not held: nobody holds ") {
			t.Errorf("show of a free key: %v\nwant exit 1, and not held said on stdout and stderr", r)
		}
		r = cli(t, nil, "show", "--json", `["nobody"]`, uri)
		var got lockJSON
		if err := json.Unmarshal([]byte(r.stdout), &got); err != nil || r.code != exitFailure || got.Held || got.Holder != nil {
			t.Errorf("show --json of a free key = %+v, %v (%v), want exit 1, held false and no holder", got, err, r)
		}
	})
}

// TestReleaseToNobody checks that release needs --force, and that a forced release
// with nobody waiting leaves the key free and the old holder without it.
func TestReleaseToNobody(t *testing.T) {
	t.Parallel()
	s := redistest.Start(t)
	locks := newLocks(t, s.Client(t))
	key := taskKeyOf(t, "payment:capture", `"c-7"`)
	old := lock(t, locks, key, "payment:capture", "task-1")
	ctx := ctxT(t)

	r := cli(t, nil, "release", key, "--uri", s.Addr())
	if r.code != exitUsage || !strings.Contains(r.stderr, "--force") {
		t.Errorf("release without --force: %v\nwant exit 2 and an explanation naming --force", r)
	}
	// Control for what follows: the refused release changed nothing.
	if err := old.Extend(ctx, time.Minute); err != nil {
		t.Fatalf("Extend after a refused release = %v, want nil", err)
	}

	r = mustRun(t, "release", "--force", key, "--uri", s.Addr())
	fence := strconv.FormatInt(old.Fence(), 10)
	for _, want := range []string{
		"Previous holder: " + holderLine(t, "payment:capture", "task-1") + ", fence " + fence,
		"Now free; the next holder's fence will be higher than " + fence,
		"can no longer extend or release it",
	} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("release --force printed:\n%s\nwant it to contain %q", r.stdout, want)
		}
	}
	if err := old.Extend(ctx, time.Minute); !errors.Is(err, mutex.ErrNotHeld) {
		t.Errorf("old Extend after release --force = %v, want ErrNotHeld", err)
	}
	if err := old.Unlock(ctx); !errors.Is(err, mutex.ErrNotHeld) {
		t.Errorf("old Unlock after release --force = %v, want ErrNotHeld", err)
	}
	next := lock(t, locks, key, "payment:capture", "task-2")
	if next.Fence() <= old.Fence() {
		t.Errorf("next holder's fence %d, want higher than the old %d", next.Fence(), old.Fence())
	}

	// Nothing left to release: status 1 and a message, and nothing changes.
	if err := next.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	r = cli(t, nil, "release", "--force", key, "--uri", s.Addr())
	if r.code != exitFailure || !strings.Contains(r.stderr, "nothing to release") {
		t.Errorf("release --force of a free key: %v\nwant exit 1 and \"nothing to release\"", r)
	}
	r = cli(t, nil, "release", "--force", "--json", key, "--uri", s.Addr())
	var doc releaseJSON
	if err := json.Unmarshal([]byte(r.stdout), &doc); err != nil || r.code != exitFailure || doc.Released || doc.HandedToFence != nil {
		t.Errorf("release --force --json of a free key: %v\nwant exit 1 and released false (%v)", r, err)
	}
}

// TestReleaseHandsOver checks a forced release that hands the lock to a waiter.
func TestReleaseHandsOver(t *testing.T) {
	t.Parallel()
	s := redistest.Start(t)
	rdb := s.Client(t)
	locks := newLocks(t, rdb)
	key := taskKeyOf(t, "payment:capture", `"c-8"`)
	old := lock(t, locks, key, "payment:capture", "task-1")
	w := startWaiter(t, rdb, newLocks(t, rdb), key, "payment:capture", "task-2", 1)

	r := mustRun(t, "--uri", s.Addr(), "release", "--force", "--json", "--task", "payment:capture", "c-8")
	var doc releaseJSON
	if err := json.Unmarshal([]byte(r.stdout), &doc); err != nil {
		t.Fatalf("release --json: %v\n%s", err, r.stdout)
	}
	if !doc.Released || doc.Free || doc.HandedToFence == nil || doc.Before.Fence != old.Fence() ||
		doc.Before.Holder == nil || doc.Before.Holder.ID != "task-1" ||
		doc.HandedTo == nil || doc.HandedTo.ID != "task-2" || doc.Before.Waiting != 1 {
		t.Fatalf("release --json = %s\nwant released, handed to task-2, before held by task-1 with fence %d and 1 waiter", r.stdout, old.Fence())
	}
	select {
	case <-w.done:
	case <-time.After(20 * time.Second):
		t.Fatal("the waiter did not get the lock within 20s of the hand-over")
	}
	if w.err != nil {
		t.Fatalf("waiter's Lock = %v, want the lock", w.err)
	}
	if got := w.lock.Fence(); got != *doc.HandedToFence || got <= old.Fence() {
		t.Errorf("waiter's fence %d, want handed_to_fence %d, higher than the old %d", got, *doc.HandedToFence, old.Fence())
	}
	ctx := ctxT(t)
	if err := old.Extend(ctx, time.Minute); !errors.Is(err, mutex.ErrNotHeld) {
		t.Errorf("old Extend = %v, want ErrNotHeld", err)
	}
	if err := old.Unlock(ctx); !errors.Is(err, mutex.ErrNotHeld) {
		t.Errorf("old Unlock = %v, want ErrNotHeld", err)
	}
	// The text form says so too.
	if err := w.lock.Extend(ctx, time.Minute); err != nil {
		t.Fatalf("new holder's Extend = %v", err)
	}
	startWaiter(t, rdb, newLocks(t, rdb), key, "payment:capture", "task-3", 1)
	r = mustRun(t, "--uri", s.Addr(), "release", "--force", key)
	if !strings.Contains(r.stdout, "Handed to the next waiter, payment:capture task-3 on ") {
		t.Errorf("release --force with a waiter printed:\n%s\nwant it to say it was handed over", r.stdout)
	}
}

func TestEmptyListAndPrefix(t *testing.T) {
	t.Parallel()
	s := redistest.Start(t)
	other := newLocks(t, s.Client(t), mutex.Prefix("billing:"))
	lock(t, other, `["invoice:send"]`, "invoice:send", "task-5")

	r := mustRun(t, "list", "--uri", s.Addr())
	if want := `no locks held under prefix "asynqmutex:"`; strings.TrimSpace(r.stdout) != want {
		t.Errorf("list with no locks under the default prefix printed %q, want %q", r.stdout, want)
	}
	r = mustRun(t, "list", "--uri", s.Addr(), "--prefix", "billing:")
	if !strings.Contains(r.stdout, `["invoice:send"]`) || !strings.Contains(r.stdout, "task-5") {
		t.Errorf("list --prefix billing: printed:\n%s\nwant the invoice lock", r.stdout)
	}
	r = mustRun(t, "list", "--uri", s.Addr(), "--json")
	if !strings.Contains(r.stdout, `"locks": []`) {
		t.Errorf("list --json with no locks printed:\n%s\nwant an empty locks array", r.stdout)
	}
}

// TestRedisURL checks that REDIS_URL is used without --uri, and that flags win.
func TestRedisURL(t *testing.T) {
	t.Parallel()
	s := redistest.Start(t, "--requirepass", "sekret")
	db3 := redis.NewClient(&redis.Options{Addr: s.Addr(), Password: "sekret", DB: 3})
	t.Cleanup(func() { _ = db3.Close() })
	lock(t, newLocks(t, db3), `["in-db-3"]`, "job", "task-3")

	env := map[string]string{"REDIS_URL": "redis://:sekret@" + s.Addr() + "/3"}
	if r := cli(t, env, "list"); r.code != 0 || !strings.Contains(r.stdout, `["in-db-3"]`) {
		t.Errorf("list with REDIS_URL: %v\nwant the lock in database 3", r)
	}
	if r := cli(t, env, "list", "--db", "0"); r.code != 0 || !strings.Contains(r.stdout, "no locks held") {
		t.Errorf("list with REDIS_URL and --db 0: %v\nwant no locks (the flag wins)", r)
	}
	if r := cli(t, nil, "list", "--uri", "redis://:sekret@"+s.Addr()+"/3"); r.code != 0 || !strings.Contains(r.stdout, `["in-db-3"]`) {
		t.Errorf("list with a redis:// --uri: %v\nwant the lock in database 3", r)
	}
	r := cli(t, env, "list", "--password", "wrong")
	if r.code != exitFailure || !strings.Contains(r.stderr, "refused the password") || strings.Contains(r.stderr, "wrong") {
		t.Errorf("list with a wrong --password: %v\nwant exit 1, \"refused the password\", no password echoed", r)
	}
	r = cli(t, nil, "list", "--uri", s.Addr())
	if r.code != exitFailure || !strings.Contains(r.stderr, "wants a password") {
		t.Errorf("list without a password: %v\nwant exit 1 and \"wants a password\"", r)
	}
	r = cli(t, map[string]string{"REDIS_URL": "http://:sekret@" + s.Addr()}, "list")
	if r.code != exitUsage || !strings.Contains(r.stderr, "REDIS_URL") || strings.Contains(r.stderr, "sekret") {
		t.Errorf("list with an http:// REDIS_URL: %v\nwant exit 2 naming REDIS_URL, no password echoed", r)
	}
}

func TestUnreachable(t *testing.T) {
	t.Parallel()
	port, err := redistest.FreePort() // nothing listens there
	if err != nil {
		t.Fatal(err)
	}
	addr := "127.0.0.1:" + strconv.Itoa(port)
	tests := []struct {
		name string
		env  map[string]string
		args []string
		want string
	}{
		{"--uri", nil, []string{"list", "--uri", addr}, "could not reach Redis at " + addr + " (--uri)"},
		{"REDIS_URL", map[string]string{"REDIS_URL": "redis://:sekret@" + addr}, []string{"show", `["k"]`}, "could not reach Redis at " + addr + " (REDIS_URL)"},
		{"--cluster", nil, []string{"list", "--cluster", "--cluster_addrs", addr}, "could not reach Redis at " + addr + " (--cluster_addrs)"},
		{"release", nil, []string{"release", "--force", `["k"]`, "-u", addr}, "could not reach Redis at " + addr},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			r := cli(t, tt.env, tt.args...)
			if r.code != exitFailure || !strings.Contains(r.stderr, tt.want) || r.stdout != "" {
				t.Errorf("%v\nwant exit 1, nothing on stdout, and %q on stderr", r, tt.want)
			}
			if strings.Contains(r.stderr, "sekret") {
				t.Errorf("the error echoes the password:\n%s", r.stderr)
			}
		})
	}
}

func TestUsage(t *testing.T) {
	t.Parallel()
	// Nothing listens here, so a usage error that got as far as connecting shows.
	port, err := redistest.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	uri := "--uri=127.0.0.1:" + strconv.Itoa(port)
	tests := []struct {
		args []string
		code int
		want string // on stdout for status 0, else on stderr
	}{
		{[]string{"help"}, 0, "Usage:"},
		{[]string{"-h"}, 0, "Examples:"},
		{[]string{"list", "--help"}, 0, "release --force"},
		{nil, 2, "Usage:"},
		{[]string{"lst"}, 2, `unknown command "lst"`},
		{[]string{"show", uri}, 2, "show needs a KEY"},
		{[]string{"release", "--force", uri}, 2, "release needs a KEY"},
		{[]string{"show", "a", "b", uri}, 2, "takes one KEY"},
		{[]string{"list", "extra", uri}, 2, "list takes no arguments"},
		{[]string{"list", "--task", "t", uri}, 2, "--task goes with show and release"},
		{[]string{"show", "--force", "k", uri}, 2, "--force goes with release only"},
		{[]string{"show", "--task", "", uri}, 2, "--task needs a task type"},
		{[]string{"show", "--task", "t", "[1]", uri}, 2, `--task value 1 is an array; On takes strings, numbers, booleans and null; to give the text "[1]" as a string, type it in double quotes: '"[1]"'`},
		{[]string{"release", `["k"]`, uri}, 2, "release needs --force"},
		{[]string{"list", "--no-such-flag"}, 2, "not defined: --no-such-flag"},
		{[]string{"list", "--db"}, 2, "needs an argument: --db"},
		{[]string{"list", "--db", "x"}, 2, `invalid value "x" for flag --db`},
		{[]string{"list", "-n", "x"}, 2, `invalid value "x" for flag -n`},
		{[]string{"list", "--cluster", "--db", "1"}, 2, "--db does not go with --cluster"},
		{[]string{"list", "--cluster", uri}, 2, "--uri does not go with --cluster"},
		{[]string{"list", "--cluster_addrs", "127.0.0.1:1"}, 2, "--cluster_addrs needs --cluster"},
		{[]string{"list", "--prefix", "a{b}", uri}, 2, "must not contain"},
		{[]string{"list", "--uri", "no-port"}, 2, "not host:port"},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			t.Parallel()
			r := cli(t, nil, tt.args...)
			out := r.stderr
			if tt.code == 0 {
				out = r.stdout
			}
			if r.code != tt.code || !strings.Contains(out, tt.want) {
				t.Errorf("%v\nwant exit %d and %q", r, tt.code, tt.want)
			}
		})
	}
}

func TestParseArgs(t *testing.T) {
	t.Parallel()
	inv, err := parseArgs([]string{"--json", "show", "--task", "t", "-5", "x", "--prefix=p:", "--", "--y"})
	if err != nil {
		t.Fatal(err)
	}
	if inv.cmd != "show" || inv.task != "t" || !inv.json || inv.prefix != "p:" || strings.Join(inv.args, " ") != "-5 x --y" {
		t.Errorf("parseArgs = cmd %q task %q json %v prefix %q args %q, want show, t, true, p:, [-5 x --y]", inv.cmd, inv.task, inv.json, inv.prefix, inv.args)
	}
	if !inv.set["task"] || !inv.set["prefix"] || inv.set["uri"] {
		t.Errorf("set = %v, want task and prefix, not uri", inv.set)
	}
	inv, err = parseArgs([]string{"-u", "h:1", "-n", "2", "-p", "pw", "list"})
	if err != nil || inv.uri != "h:1" || inv.db != 2 || inv.password != "pw" || !inv.set["uri"] || !inv.set["db"] || !inv.set["password"] {
		t.Errorf("short flags: %+v, %v", inv, err)
	}
}

func TestTaskKey(t *testing.T) {
	t.Parallel()
	tests := []struct {
		values []string
		want   string
	}{
		{nil, `["payment:capture"]`},
		{[]string{"c-42"}, `["payment:capture","c-42"]`},
		{[]string{`"c-42"`}, `["payment:capture","c-42"]`},
		{[]string{"42"}, `["payment:capture",42]`},
		{[]string{`"42"`}, `["payment:capture","42"]`},
		{[]string{"-5", "true", "null"}, `["payment:capture",-5,true,null]`},
		{[]string{"a<b&c", ""}, `["payment:capture","a<b&c",""]`},
	}
	for _, tt := range tests {
		got, err := taskKey("payment:capture", tt.values)
		if err != nil || got != tt.want {
			t.Errorf("taskKey(payment:capture, %q) = %s, %v, want %s", tt.values, got, err, tt.want)
		}
	}
}

func TestHuman(t *testing.T) {
	t.Parallel()
	tests := []struct {
		d    time.Duration
		want string
	}{
		{0, "0s"},
		{1234567 * time.Nanosecond, "1ms"},
		{350 * time.Millisecond, "350ms"},
		{2345 * time.Millisecond, "2.3s"},
		{(2*60 + 3) * time.Second, "2m3s"},
		{3*time.Hour + 5*time.Minute + 20*time.Second, "3h5m"},
		{2*time.Hour + 10*time.Second, "2h0m"},
		{50*time.Hour + 40*time.Minute, "2d3h"},
		{24 * time.Hour, "1d"},
	}
	for _, tt := range tests {
		if got := human(tt.d); got != tt.want {
			t.Errorf("human(%v) = %q, want %q", tt.d, got, tt.want)
		}
	}
}

// TestCluster reads locks spread over a three-master cluster, and checks the advice
// given when the flags do not match the server.
func TestCluster(t *testing.T) {
	t.Parallel()
	addrs := redistest.StartCluster(t, 3)
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs})
	t.Cleanup(func() { _ = cc.Close() })
	locks := newLocks(t, cc)
	ctx := ctxT(t)

	var keys []string
	nodes := map[string]bool{}
	for i := range 12 {
		key := taskKeyOf(t, "payment:capture", strconv.Quote("c-"+strconv.Itoa(i)))
		lock(t, locks, key, "payment:capture", "task-"+strconv.Itoa(i))
		keys = append(keys, key)
		in, err := locks.Inspect(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		node, err := cc.MasterForKey(ctx, in.RedisKey)
		if err != nil {
			t.Fatal(err)
		}
		nodes[node.Options().Addr] = true
	}
	if len(nodes) < 2 {
		t.Fatalf("control: the keys landed on %d master(s), want them spread over several", len(nodes))
	}
	cluster := []string{"--cluster", "--cluster_addrs", strings.Join(addrs, ",")}

	r := mustRun(t, append([]string{"list", "--json"}, cluster...)...)
	var doc listJSON
	if err := json.Unmarshal([]byte(r.stdout), &doc); err != nil {
		t.Fatalf("list --json: %v\n%s", err, r.stdout)
	}
	var got []string
	for _, l := range doc.Locks {
		got = append(got, l.Key)
	}
	sorted := append([]string(nil), keys...)
	slices.Sort(sorted)
	if strings.Join(got, "\n") != strings.Join(sorted, "\n") {
		t.Errorf("list on the cluster = %q, want every key, sorted: %q", got, sorted)
	}
	r = mustRun(t, append([]string{"list"}, cluster...)...)
	if n := strings.Count(r.stdout, "  task-"); n != len(keys) {
		t.Errorf("list table on the cluster shows %d holders, want %d:\n%s", n, len(keys), r.stdout)
	}

	// One node is enough to find the others.
	r = mustRun(t, "show", "--task", "payment:capture", "c-5", "--cluster", "--cluster_addrs", addrs[0])
	if !strings.Contains(r.stdout, holderLine(t, "payment:capture", "task-5")) {
		t.Errorf("show on the cluster printed:\n%s\nwant task-5 as holder", r.stdout)
	}

	// Single-node flags against a cluster node: plain advice, not a MOVED error or
	// a list of one node's keys.
	for _, args := range [][]string{{"list"}, {"show", keys[0]}, {"release", "--force", keys[0]}} {
		r := cli(t, nil, append(args, "--uri", addrs[0])...)
		if r.code != exitFailure || !strings.Contains(r.stderr, "is a Redis Cluster node") || !strings.Contains(r.stderr, "--cluster --cluster_addrs "+addrs[0]) {
			t.Errorf("%s with --uri on a cluster node: %v\nwant exit 1 and advice to use --cluster", args[0], r)
		}
	}
	if in, err := locks.Inspect(ctx, keys[0]); err != nil || !in.Held {
		t.Errorf("after the refused release %s is held = %v (%v), want still held", keys[0], in.Held, err)
	}

	// Rate-limited keys too are read from every master.
	rl := ratelimit.New(cc)
	var rateKeys []string
	for i := range 8 {
		key := taskKeyOf(t, "email:send", strconv.Quote("t-"+strconv.Itoa(i)))
		allow(t, rl, key, ratelimit.PerMinute(1), 1)
		rateKeys = append(rateKeys, key)
	}
	r = mustRun(t, append([]string{"rates", "--json"}, cluster...)...)
	var rdoc ratesJSON
	if err := json.Unmarshal([]byte(r.stdout), &rdoc); err != nil {
		t.Fatalf("rates --json: %v\n%s", err, r.stdout)
	}
	got = got[:0]
	for _, st := range rdoc.Rates {
		got = append(got, st.Key)
	}
	if strings.Join(got, "\n") != strings.Join(rateKeys, "\n") {
		t.Errorf("rates on the cluster = %q, want every key, sorted: %q", got, rateKeys)
	}
	r = mustRun(t, append([]string{"pause", "--for", "1m", rateKeys[3]}, cluster...)...)
	if st, err := rl.Inspect(ctx, rateKeys[3]); err != nil || st.Paused < 59*time.Second || !strings.Contains(r.stdout, "Paused") {
		t.Errorf("pause on the cluster: %s; then %+v, %v; want paused a minute", r.stdout, st, err)
	}

	// Ordered keys too, for the keys near one without an order.
	seq := order.New(cc)
	for i := range 8 {
		if _, err := seq.Take(ctx, taskKeyOf(t, "transfer", strconv.Quote("a-"+strconv.Itoa(i))), "q", "t-"+strconv.Itoa(i)); err != nil {
			t.Fatal(err)
		}
	}
	r = cli(t, nil, append([]string{"order", "--json", "--task", "transfer", "b-1"}, cluster...)...)
	var odoc orderJSON
	if err := json.Unmarshal([]byte(r.stdout), &odoc); err != nil || r.code != exitFailure || odoc.Nearby == nil ||
		len(odoc.Nearby.Keys) != 8 || odoc.Nearby.Ordered != 8 {
		t.Errorf("order of a key without one on the cluster: %v (%v)\nwant exit 1 and the 8 ordered keys nearby", r, err)
	}

	// --cluster against a single node.
	s := redistest.Start(t)
	r = cli(t, nil, "list", "--cluster", "--cluster_addrs", s.Addr())
	if r.code != exitFailure || !strings.Contains(r.stderr, "not a Redis Cluster node") || !strings.Contains(r.stderr, "without --cluster") {
		t.Errorf("--cluster against a single node: %v\nwant exit 1 and advice to drop --cluster", r)
	}
}
