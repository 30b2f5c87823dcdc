package cli

import (
	"encoding/json"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
	"github.com/asynqmutex/asynqmutex/ratelimit"
)

// allow takes n starts of key under lim, each of which must be allowed.
func allow(t *testing.T, rl *ratelimit.Limiter, key string, lim ratelimit.Rate, n int) {
	t.Helper()
	for i := range n {
		r, err := rl.Allow(ctxT(t), key, lim)
		if err != nil || !r.Allowed {
			t.Fatalf("Allow #%d on %s = %+v, %v; want allowed", i+1, key, r, err)
		}
	}
}

// rateFixture is four limited keys on one server: one with starts left, one
// paused after a start, one paused without any, and one too long to keep whole.
type rateFixture struct {
	s                     *redistest.Server
	rl                    *ratelimit.Limiter
	pay, mail, sms, long  string
	uri                   string
	payLim, mailLim, slow ratelimit.Rate
}

// Limits of a minute per start, so that nothing the tests read moves while they run.
func newRateFixture(t *testing.T) *rateFixture {
	t.Helper()
	s := redistest.Start(t)
	f := &rateFixture{
		s: s, rl: ratelimit.New(s.Client(t)), uri: "--uri=" + s.Addr(),
		pay:     taskKeyOf(t, "payment:capture", `"c-42"`),
		mail:    taskKeyOf(t, "email:send", `"t-1"`),
		sms:     taskKeyOf(t, "sms:send", `"t-1"`),
		long:    taskKeyOf(t, "report:export", strconv.Quote(strings.Repeat("x", 400))),
		payLim:  ratelimit.Rate{N: 1, Per: time.Minute, Burst: 5},
		mailLim: ratelimit.Rate{N: 1, Per: time.Minute, Burst: 2},
		slow:    ratelimit.PerMinute(1),
	}
	allow(t, f.rl, f.pay, f.payLim, 3)
	allow(t, f.rl, f.mail, f.mailLim, 1)
	if _, err := f.rl.Pause(ctxT(t), f.mail, f.mailLim, time.Minute); err != nil {
		t.Fatal(err)
	}
	if _, err := f.rl.Pause(ctxT(t), f.sms, ratelimit.PerSecond(1), time.Minute); err != nil {
		t.Fatal(err)
	}
	allow(t, f.rl, f.long, f.slow, 1)
	return f
}

// TestRatesList lists the four keys as a table and as JSON.
func TestRatesList(t *testing.T) {
	t.Parallel()
	f := newRateFixture(t)
	// A task parks until a start of the long key, reserved a minute from now.
	if r, err := f.rl.TakeAs(ctxT(t), f.long, f.slow, "parked-task", 0, time.Hour); err != nil || !r.Held {
		t.Fatalf("TakeAs = %+v, %v; want a start held ahead", r, err)
	}

	r := mustRun(t, "rates", f.uri)
	t.Logf("asynqmutex rates:\n%s", r.stdout)
	lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
	if len(lines) != 5 {
		t.Fatalf("rates printed %d lines, want a header and 4 keys:\n%s", len(lines), r.stdout)
	}
	if got := strings.Join(strings.Fields(lines[0]), " "); got != "KEY EVERY BURST REMAINING NEXT RESET PAUSED STARTS AHEAD" {
		t.Errorf("header = %q", got)
	}
	// Sorted by key; the long key by its first 64 bytes, marked.
	longShown := f.long[:64] + "…"
	want := []struct {
		key, every, burst, remaining string
		next, reset, paused          func(string) bool
		starts, ahead                string
	}{
		{`["email:send","t-1"]`, "1m", "2", "0", about(time.Minute), about(2 * time.Minute), about(time.Minute), "1", "0"},
		{`["payment:capture","c-42"]`, "1m", "5", "2", is("now"), about(3 * time.Minute), is("-"), "3", "0"},
		{longShown, "1m", "1", "0", about(2 * time.Minute), about(2 * time.Minute), is("-"), "2", "1"},
		{`["sms:send","t-1"]`, "-", "-", "0", about(time.Minute), about(time.Minute), about(time.Minute), "0", "0"},
	}
	for i, w := range want {
		got := strings.Fields(lines[i+1])
		if len(got) != 9 || got[0] != w.key || got[1] != w.every || got[2] != w.burst || got[3] != w.remaining ||
			!w.next(got[4]) || !w.reset(got[5]) || !w.paused(got[6]) || got[7] != w.starts || got[8] != w.ahead {
			t.Errorf("rates line %d = %q, want key %s, every %s, burst %s, %s remaining, %s starts, %s ahead and the times about right",
				i+1, lines[i+1], w.key, w.every, w.burst, w.remaining, w.starts, w.ahead)
		}
	}

	r = mustRun(t, "rates", "--json", f.uri)
	var doc ratesJSON
	if err := json.Unmarshal([]byte(r.stdout), &doc); err != nil {
		t.Fatalf("rates --json is not one JSON document: %v\n%s", err, r.stdout)
	}
	if doc.Prefix != ratelimit.DefaultPrefix || len(doc.Rates) != 4 {
		t.Fatalf("rates --json: prefix %q, %d keys; want %q and 4:\n%s", doc.Prefix, len(doc.Rates), ratelimit.DefaultPrefix, r.stdout)
	}
	mail, pay, long, sms := doc.Rates[0], doc.Rates[1], doc.Rates[2], doc.Rates[3]
	if mail.Key != f.mail || mail.IntervalMS != 60000 || mail.Burst != 2 || mail.Remaining != 0 || !aboutMS(mail.PausedMS, time.Minute) ||
		!aboutMS(mail.NextMS, time.Minute) || !aboutMS(mail.ResetMS, 2*time.Minute) || mail.Starts != 1 {
		t.Errorf("rates --json, paused key = %+v", mail)
	}
	if pay.Key != f.pay || pay.Digested || pay.IntervalMS != 60000 || pay.Burst != 5 || pay.Remaining != 2 || pay.NextMS != 0 ||
		!aboutMS(pay.ResetMS, 3*time.Minute) || pay.PausedMS != 0 || pay.Starts != 3 {
		t.Errorf("rates --json, key with starts left = %+v", pay)
	}
	if long.Key != f.long[:64] || !long.Digested || long.Starts != 2 || long.Ahead != 1 || !aboutMS(long.LastDueMS, time.Minute) {
		t.Errorf("rates --json, long key = %+v; want its first 64 bytes, digested, one start of two ahead, due in a minute", long)
	}
	if sms.Key != f.sms || sms.IntervalMS != 0 || sms.Burst != 0 || !aboutMS(sms.PausedMS, time.Minute) || sms.Starts != 0 {
		t.Errorf("rates --json, key paused without a start = %+v", sms)
	}
	// The document's field names are the interface scripts read.
	for _, name := range []string{`"prefix"`, `"rates"`, `"key"`, `"digested"`, `"interval_ms"`, `"burst"`, `"remaining"`,
		`"next_ms"`, `"reset_ms"`, `"paused_ms"`, `"starts"`, `"ahead"`, `"last_due_ms"`} {
		if !strings.Contains(r.stdout, name+":") {
			t.Errorf("rates --json lacks %s:\n%s", name, r.stdout)
		}
	}

	// Rate keys are not listed as locks, nor locks as rate keys.
	if r := mustRun(t, "list", f.uri); !strings.Contains(r.stdout, "no locks held") {
		t.Errorf("list with only rate keys:\n%s\nwant no locks", r.stdout)
	}
	// Another prefix, with nothing under it.
	lock(t, newLocks(t, f.s.Client(t)), f.pay, "payment:capture", "task-1")
	r = mustRun(t, "rates", f.uri, "--prefix", "billing:")
	if want := `no rate-limited keys under prefix "billing:"`; strings.TrimSpace(r.stdout) != want {
		t.Errorf("rates --prefix billing: printed %q, want %q", r.stdout, want)
	}
	r = mustRun(t, "rates", f.uri, "--prefix", "billing:", "--json")
	if !strings.Contains(r.stdout, `"rates": []`) {
		t.Errorf("rates --json with no keys printed:\n%s\nwant an empty rates array", r.stdout)
	}
	if r := mustRun(t, "rates", f.uri); strings.Count(r.stdout, "\n") != 5 {
		t.Errorf("rates with a lock held too:\n%s\nwant the 4 rate keys only", r.stdout)
	}
}

// TestRateShow inspects one key, by KEY and by --task, as text and JSON, and a key
// Redis remembers nothing of, which lists the limited keys near it.
func TestRateShow(t *testing.T) {
	t.Parallel()
	f := newRateFixture(t)

	r := mustRun(t, "rate", f.uri, f.pay)
	t.Logf("asynqmutex rate %s:\n%s", f.pay, r.stdout)
	for _, want := range []string{
		"Key:         " + f.pay + "\n",
		"Limit:       one start every 1m, burst 5 (the limit of its latest start)\n",
		"Remaining:   2 starts may begin now\n",
		"Next start:  now\n",
		"Reset in:    ",
		"(then all 5 starts are free again)\n",
		"Paused:      no\n",
		"Remembered:  3 starts: those begun in the last 10 to 20 s, and those reserved ahead\n",
		"Ahead:       no start reserved: no task waits for one\n",
		"Redis key:   asynqmutex:rate:{" + f.pay + "}\n",
	} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("rate %s:\n%s\nwant it to contain %q", f.pay, r.stdout, want)
		}
	}

	r = mustRun(t, "rate", f.uri, "--task", "email:send", "t-1")
	for _, want := range []string{"Key:         " + f.mail + "\n", "Remaining:   0 starts may begin now\n",
		"left; 'asynqmutex resume --task email:send t-1' ends it\n"} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("rate --task email:send t-1:\n%s\nwant it to contain %q", r.stdout, want)
		}
	}
	r = mustRun(t, "rate", f.uri, f.sms)
	if !strings.Contains(r.stdout, "Limit:       not known: no start is remembered, only a pause\n") || strings.Contains(r.stdout, "Reset in:") {
		t.Errorf("rate of a key paused without a start:\n%s\nwant the limit not known, and no reset", r.stdout)
	}
	// A space inside the array finds the key, as show does for locks.
	r = mustRun(t, "rate", f.uri, `["payment:capture", "c-42"]`)
	if !strings.Contains(r.stdout, `given as ["payment:capture", "c-42"]`) || !strings.Contains(r.stdout, "Remembered:  3 starts") {
		t.Errorf("rate with a space in the key:\n%s\nwant the key read as the middleware writes it", r.stdout)
	}
	// A burst of one is its one start, not "all 1 start".
	if r := mustRun(t, "rate", f.uri, f.long); !strings.Contains(r.stdout, "(then its one start is free again)\n") ||
		!strings.Contains(r.stdout, "Remembered:  1 start: ") {
		t.Errorf("rate of a key with a burst of 1:\n%s\nwant its one start free again, 1 start remembered", r.stdout)
	}
	r = mustRun(t, "rate", f.uri, "--json", f.long)
	var long rateShowJSON
	if err := json.Unmarshal([]byte(r.stdout), &long); err != nil || long.Key != f.long || long.Digested ||
		long.IntervalMS != 60000 || long.Starts != 1 || long.Nearby != nil {
		t.Errorf("rate --json of the long key = %s (%v); want the whole key, 1 start, no nearby", r.stdout, err)
	}

	// A near miss: the string "c-43" where "c-42" is limited. Redis remembers
	// nothing of it: idle, if it is limited at all, and exit status 1.
	r = cli(t, nil, "rate", f.uri, "--task", "payment:capture", "c-43")
	if r.code != exitFailure || !strings.Contains(r.stderr, `not found: Redis remembers no start and no pause of ["payment:capture","c-43"]`) {
		t.Errorf("rate of a near miss: %v\nwant exit 1 and not found", r)
	}
	for _, want := range []string{
		"State:       idle: next start free now; Redis remembers no start and no pause of this key under prefix \"asynqmutex:\"\n",
		`Limited nearby: 1 key of task type "payment:capture" (of 4 limited under prefix "asynqmutex:"); is one of them meant?`,
		"  " + f.pay + "    asynqmutex rate --task payment:capture c-42\n",
	} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("rate of a near miss:\n%s\nwant it to contain %q", r.stdout, want)
		}
	}
	r = cli(t, nil, "rate", f.uri, "--json", `["nobody:here"]`)
	var doc rateShowJSON
	if err := json.Unmarshal([]byte(r.stdout), &doc); err != nil || r.code != exitFailure || doc.Starts != 0 || doc.Nearby == nil ||
		doc.Nearby.TaskType != "nobody:here" || len(doc.Nearby.Keys) != 0 || doc.Nearby.Limited != 4 {
		t.Errorf("rate --json of a key of no limited type = %s (%v); want nearby with no keys, of 4 limited", r.stdout, err)
	}
	if !strings.Contains(r.stdout, `"limited": 4`) {
		t.Errorf("rate --json's nearby counts limited keys as \"limited\":\n%s", r.stdout)
	}
	r = cli(t, nil, "rate", f.uri, `["nobody:here"]`)
	if !strings.Contains(r.stdout, `No key of task type "nobody:here" is limited; 4 other keys are limited under prefix "asynqmutex:": run 'asynqmutex rates'.`) {
		t.Errorf("rate of a task type nobody limits:\n%s\nwant the count of limited keys", r.stdout)
	}
	// Two tasks park until their starts, reserved one and two minutes from now.
	busy := taskKeyOf(t, "push:send", `"u-9"`)
	allow(t, f.rl, busy, f.slow, 1)
	for _, id := range []string{"parked-1", "parked-2"} {
		if _, err := f.rl.TakeAs(ctxT(t), busy, f.slow, id, 0, time.Hour); err != nil {
			t.Fatal(err)
		}
	}
	r = mustRun(t, "rate", f.uri, busy)
	if want := "Ahead:       2 starts reserved for tasks that wait for them (parked until their start, or in their worker); the last begins in 2m"; !strings.Contains(r.stdout, want) {
		t.Errorf("rate of a key with two starts reserved:\n%s\nwant it to contain %q", r.stdout, want)
	}
}

// TestResume ends a pause, and reports a key with none, exit status 1.
func TestResume(t *testing.T) {
	t.Parallel()
	f := newRateFixture(t)
	ctx := ctxT(t)

	r := mustRun(t, "resume", f.uri, "--task", "email:send", "t-1")
	t.Logf("asynqmutex resume --task email:send t-1:\n%s", r.stdout)
	if !strings.Contains(r.stdout, "Resumed "+f.mail+": its pause had ") || !strings.Contains(r.stdout, "Its starts may begin now (1 remaining).") {
		t.Errorf("resume:\n%s\nwant the pause ended and a start free", r.stdout)
	}
	if st, err := f.rl.Inspect(ctx, f.mail); err != nil || st.Paused != 0 || st.Starts != 1 {
		t.Errorf("after resume: %+v, %v; want no pause, the start kept", st, err)
	}
	allow(t, f.rl, f.mail, f.mailLim, 1) // workers may start again

	r = cli(t, nil, "resume", f.uri, f.mail)
	if r.code != exitFailure || r.stdout != "" || !strings.Contains(r.stderr, "nothing to resume: "+f.mail+` is not paused under prefix "asynqmutex:"`) {
		t.Errorf("resume of a key no longer paused: %v\nwant exit 1 and not paused", r)
	}
	// A pause that has run out but is still kept is no pause to resume.
	if _, err := f.rl.Pause(ctx, f.pay, f.payLim, 50*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	for st, _ := f.rl.Inspect(ctx, f.pay); st.Paused > 0; st, _ = f.rl.Inspect(ctx, f.pay) {
		time.Sleep(10 * time.Millisecond)
	}
	r = cli(t, nil, "resume", f.uri, f.pay)
	if r.code != exitFailure || !strings.Contains(r.stderr, "nothing to resume: the pause of "+f.pay+" had already ended") {
		t.Errorf("resume of a pause that ended: %v\nwant exit 1 and already ended", r)
	}

	// A key paused before any start has no limit to count its starts under.
	bare := taskKeyOf(t, "sms:send", `"t-2"`)
	if _, err := f.rl.Pause(ctx, bare, ratelimit.PerSecond(1), time.Minute); err != nil {
		t.Fatal(err)
	}
	r = mustRun(t, "resume", f.uri, bare)
	if !strings.Contains(r.stdout, "Resumed "+bare+": its pause had ") || !strings.HasSuffix(r.stdout, "\nIts starts may begin now.\n") {
		t.Errorf("resume of a key paused before any start:\n%s\nwant its starts free, no count", r.stdout)
	}

	r = mustRun(t, "resume", f.uri, "--json", f.sms)
	var doc resumeJSON
	if err := json.Unmarshal([]byte(r.stdout), &doc); err != nil || !doc.Resumed || doc.Key != f.sms ||
		!aboutMS(doc.PausedLeftMS, time.Minute) || doc.State.PausedMS != 0 || doc.State.NextMS != 0 || doc.Nearby != nil {
		t.Errorf("resume --json = %s (%v); want resumed, a minute left before, none after", r.stdout, err)
	}

	// A near miss: nothing changes, status 1, and what is limited of that type.
	r = cli(t, nil, "resume", f.uri, "--task", "email:send", `"t-2"`)
	if r.code != exitFailure || !strings.Contains(r.stderr, "is not paused") ||
		!strings.Contains(r.stderr, "  "+f.mail+"    asynqmutex rate --task email:send t-1\n") {
		t.Errorf("resume of a near miss: %v\nwant exit 1 and the limited key of that type", r)
	}
	r = cli(t, nil, "resume", f.uri, "--json", `["email:send","t-2"]`)
	var miss resumeJSON
	if err := json.Unmarshal([]byte(r.stdout), &miss); err != nil || r.code != exitFailure || miss.Resumed ||
		miss.Nearby == nil || len(miss.Nearby.Keys) != 1 || miss.Nearby.Keys[0] != f.mail {
		t.Errorf("resume --json of a near miss: %v\nwant exit 1, resumed false and nearby %s (%v)", r, f.mail, err)
	}
}

// TestPause pauses keys by hand: under the limit Redis remembers, under one given,
// not shorter than a longer hold, and not at all without a limit to keep it under.
func TestPause(t *testing.T) {
	t.Parallel()
	f := newRateFixture(t)
	ctx := ctxT(t)

	r := mustRun(t, "pause", "--for", "30s", f.uri, "--task", "payment:capture", "c-42")
	t.Logf("asynqmutex pause --for 30s --task payment:capture c-42:\n%s", r.stdout)
	if !strings.Contains(r.stdout, "Paused "+f.pay+" for 30s") || !strings.Contains(r.stdout, "one every 1m, one at a time") ||
		!strings.Contains(r.stdout, "End it early with: asynqmutex resume --task payment:capture c-42") || r.stderr != "" {
		t.Errorf("pause under the remembered limit: %v", r)
	}
	st, err := f.rl.Inspect(ctx, f.pay)
	if err != nil || st.Paused > 30*time.Second || st.Paused < 29*time.Second || st.Interval != time.Minute || st.Burst != 5 {
		t.Errorf("after pause --for 30s: %+v, %v; want paused about 30s, the limit unchanged", st, err)
	}
	if r, err := f.rl.Allow(ctx, f.pay, f.payLim); err != nil || r.Allowed {
		t.Errorf("Allow while paused = %+v, %v; want limited", r, err)
	}

	r = mustRun(t, "pause", "--for", "1s", f.uri, f.pay)
	if !strings.Contains(r.stdout, "is already held back for ") || !strings.Contains(r.stdout, "longer than --for 1s: nothing changed") {
		t.Errorf("a shorter pause:\n%s\nwant nothing changed", r.stdout)
	}

	// A key Redis remembers nothing of needs the limit its tasks use.
	fresh := taskKeyOf(t, "push:send", `"u-1"`)
	r = cli(t, nil, "pause", "--for", "10s", f.uri, fresh)
	if r.code != exitUsage || !strings.Contains(r.stderr, "Redis remembers no start of "+fresh) || !strings.Contains(r.stderr, "--every") {
		t.Errorf("pause of a fresh key without --every: %v\nwant exit 2 asking for --every", r)
	}
	r = mustRun(t, "pause", "--for", "10s", "--every", "250us", "--burst", "3", "--json", f.uri, fresh)
	var doc pauseJSON
	if err := json.Unmarshal([]byte(r.stdout), &doc); err != nil || !doc.Paused || doc.Key != fresh || doc.IntervalMS != 0.25 ||
		doc.Burst != 3 || doc.HeldBackMS != 10000 {
		t.Errorf("pause --json = %s (%v); want paused 10000 ms under 0.25 ms, burst 3", r.stdout, err)
	}
	// The first start comes when the pause ends, then one every 250µs.
	lim := limitEvery(250*time.Microsecond, 3)
	if a, err := f.rl.Reserve(ctx, fresh, lim, time.Minute); err != nil || !a.Allowed || a.Delay > 10*time.Second || a.Delay < 9*time.Second {
		t.Errorf("Reserve after pause --for 10s = %+v, %v; want a start in about 10s", a, err)
	}

	// A limit that differs from the one the key's starts use is noted.
	r = mustRun(t, "pause", "--for", "5m", "--every", "2s", f.uri, f.long)
	if !strings.Contains(r.stderr, "note: the latest start of "+f.long[:64]) || !strings.Contains(r.stderr, "one start every 1m, burst 1") {
		t.Errorf("pause under another limit: %v\nwant a note naming the key's own limit", r)
	}
}

func TestRateUsage(t *testing.T) {
	t.Parallel()
	port, err := redistest.FreePort() // nothing listens: a usage error must come first
	if err != nil {
		t.Fatal(err)
	}
	uri := "--uri=127.0.0.1:" + strconv.Itoa(port)
	tests := []struct {
		args []string
		want string
	}{
		{[]string{"rates", "k", uri}, "rates takes no arguments, got \"k\"; to see one key, run 'asynqmutex rate KEY'"},
		{[]string{"rates", "--task", "t", uri}, "--task goes with rate, pause, resume and reset, not rates"},
		{[]string{"rate", uri}, "rate needs a KEY, or --task TYPE [VALUE...]; 'asynqmutex rates' lists every limited key"},
		{[]string{"resume", uri}, "resume needs a KEY"},
		{[]string{"resume", "a", "b", uri}, "takes one KEY"},
		{[]string{"pause", "k", uri}, "pause needs --for DURATION"},
		{[]string{"pause", "--for", "0s", "k", uri}, "--for 0s is outside"},
		{[]string{"pause", "--for", "1s", "--every", "0s", "k", uri}, "--every 0s is outside"},
		{[]string{"pause", "--for", "1s", "--burst", "0", "k", uri}, "--burst 0 is outside"},
		{[]string{"pause", "--for", "1s", "--force", "k", uri}, "--force goes with release only"},
		{[]string{"rate", "--for", "1s", "k", uri}, "--for goes with pause only"},
		{[]string{"show", "--every", "1s", "k", uri}, "--every goes with pause only"},
		{[]string{"ratez"}, "the commands are list, show, release, rates, rate, pause, resume, reset and order"},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			t.Parallel()
			r := cli(t, nil, tt.args...)
			if r.code != exitUsage || !strings.Contains(r.stderr, tt.want) {
				t.Errorf("%v\nwant exit 2 and %q", r, tt.want)
			}
		})
	}
	if r := cli(t, nil, "help"); !strings.Contains(r.stdout, "asynqmutex [flags] rates") || !strings.Contains(r.stdout, "pause --for") {
		t.Errorf("help does not show the rate commands:\n%s", r.stdout)
	}
}

func TestEveryText(t *testing.T) {
	t.Parallel()
	for d, want := range map[time.Duration]string{
		16667 * time.Microsecond:           "16.667ms",
		250 * time.Microsecond:             "250µs",
		2 * time.Second:                    "2s",
		time.Minute:                        "1m",
		90 * time.Minute:                   "1h30m",
		2 * time.Hour:                      "2h",
		time.Hour + 30*time.Second:         "1h0m30s",
		8571429 * time.Microsecond:         "8.571429s",
		time.Minute + 500*time.Millisecond: "1m0.5s",
	} {
		if got := everyText(d); got != want {
			t.Errorf("everyText(%v) = %q, want %q", d, got, want)
		}
	}
	for _, tt := range []struct {
		every    time.Duration
		interval time.Duration
	}{{250 * time.Microsecond, 250 * time.Microsecond}, {time.Second, time.Second}, {16667 * time.Microsecond, 16667 * time.Microsecond}} {
		lim := limitEvery(tt.every, 2)
		if err := lim.Validate(); err != nil || lim.Per/time.Duration(lim.N) != tt.interval {
			t.Errorf("limitEvery(%v) = %v (%v), want one start every %v", tt.every, lim, err, tt.interval)
		}
	}
}

// about reports whether a table cell reads as a duration within 2s below d.
func about(d time.Duration) func(string) bool {
	return func(s string) bool {
		got, err := time.ParseDuration(s)
		return err == nil && got <= d && got >= d-2*time.Second
	}
}

func is(want string) func(string) bool { return func(s string) bool { return s == want } }

func aboutMS(ms int64, d time.Duration) bool {
	got := time.Duration(ms) * time.Millisecond
	return got <= d+time.Millisecond && got >= d-2*time.Second
}

// TestReset forgets a key's starts, keeps a pause, and finds nothing to reset in a
// key Redis remembers no start of.
func TestReset(t *testing.T) {
	t.Parallel()
	f := newRateFixture(t)
	ctx := ctxT(t)

	r := mustRun(t, "reset", f.uri, "--task", "payment:capture", "c-42")
	t.Logf("asynqmutex reset --task payment:capture c-42:\n%s", r.stdout)
	if r.stdout != "Reset "+f.pay+": forgot 3 starts.\nIts starts may begin now.\n" || r.stderr != "" {
		t.Errorf("reset: %v\nwant 3 starts forgotten", r)
	}
	if st, err := f.rl.Inspect(ctx, f.pay); err != nil || st.Starts != 0 {
		t.Errorf("after reset: %+v, %v; want no start remembered", st, err)
	}
	allow(t, f.rl, f.pay, f.payLim, 5) // the whole burst again

	r = mustRun(t, "reset", "--json", f.uri, f.mail)
	var doc resetJSON
	if err := json.Unmarshal([]byte(r.stdout), &doc); err != nil || doc.Key != f.mail || doc.Forgotten != 1 || doc.State.PausedMS < 59000 {
		t.Errorf("reset --json of a paused key = %s (%v); want 1 forgotten, the pause kept", r.stdout, err)
	}
	r = mustRun(t, "reset", f.uri, f.long)
	if !strings.Contains(r.stdout, "forgot 1 start.") {
		t.Errorf("reset of one start:\n%s", r.stdout)
	}

	r = cli(t, nil, "reset", f.uri, f.sms) // paused before any start: no start to forget
	if r.code != exitFailure || r.stdout != "" || !strings.Contains(r.stderr, "nothing to reset: Redis remembers no start of "+f.sms) {
		t.Errorf("reset of a key with no start: %v\nwant exit 1 and nothing to reset", r)
	}
	if st, err := f.rl.Inspect(ctx, f.sms); err != nil || st.Paused < 59*time.Second {
		t.Errorf("the pause of %s after reset: %+v, %v; want kept", f.sms, st, err)
	}
}
