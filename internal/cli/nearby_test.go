package cli

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
)

// TestNearMiss holds ["count:num",42] and asks for it the ways an operator gets
// it slightly wrong: a space inside the array finds it; the string "42" instead of
// the number is not held, and show and release say what is held of that task type
// instead of reading as free; the lock stays held throughout.
func TestNearMiss(t *testing.T) {
	t.Parallel()
	s := redistest.Start(t)
	locks := newLocks(t, s.Client(t))
	held := taskKeyOf(t, "count:num", "42")
	lock(t, locks, held, "count:num", "task-1")
	lock(t, locks, taskKeyOf(t, "other:type", `"x"`), "other:type", "task-2")
	uri := "--uri=" + s.Addr()

	r := mustRun(t, "show", uri, `["count:num", 42]`)
	if !strings.Contains(r.stdout, "State:       held\n") || !strings.Contains(r.stdout, `given as ["count:num", 42]`) {
		t.Errorf("show with a space in the key:\n%s\nwant the held lock, read as the middleware writes it", r.stdout)
	}

	nearMiss := []string{
		`Held nearby: 1 key of task type "count:num" (of 2 held under prefix "asynqmutex:")`,
		"  " + held + "    asynqmutex show --task count:num 42\n",
	}
	for _, args := range [][]string{
		{"show", "--task", "count:num", `"42"`},
		{"show", `["count:num","42"]`},
		{"show", "count:num"}, // the task type alone, as a key
	} {
		r := cli(t, nil, append(args, uri)...)
		if r.code != exitFailure || !strings.Contains(r.stdout, "not held") {
			t.Errorf("asynqmutex %s: %v\nwant exit 1 and not held", strings.Join(args, " "), r)
		}
		for _, want := range nearMiss {
			if !strings.Contains(r.stdout, want) {
				t.Errorf("asynqmutex %s:\n%s\nwant it to contain %q", strings.Join(args, " "), r.stdout, want)
			}
		}
	}

	r = cli(t, nil, "release", "--force", uri, "--task", "count:num", `"42"`)
	if r.code != exitFailure || !strings.Contains(r.stderr, "nothing to release") {
		t.Errorf("release --force of the near miss: %v\nwant exit 1 and nothing to release", r)
	}
	for _, want := range nearMiss {
		if !strings.Contains(r.stderr, want) {
			t.Errorf("release --force of the near miss:\n%s\nwant it to contain %q", r.stderr, want)
		}
	}
	r = cli(t, nil, "release", "--force", "--json", uri, `["count:num","42"]`)
	var rel releaseJSON
	if err := json.Unmarshal([]byte(r.stdout), &rel); err != nil || rel.Released || rel.Nearby == nil || len(rel.Nearby.Keys) != 1 || rel.Nearby.Keys[0] != held {
		t.Errorf("release --force --json of the near miss: %v\nwant released false and nearby %s (%v)", r, held, err)
	}
	if in, err := locks.Inspect(ctxT(t), held); err != nil || !in.Held {
		t.Fatalf("after the near misses %s held = %v (%v), want still held", held, in.Held, err)
	}

	r = cli(t, nil, "show", "--json", uri, "--task", "count:num", "43")
	var doc showJSON
	if err := json.Unmarshal([]byte(r.stdout), &doc); err != nil || r.code != exitFailure || doc.Held || doc.Nearby == nil ||
		doc.Nearby.TaskType != "count:num" || len(doc.Nearby.Keys) != 1 || doc.Nearby.Keys[0] != held || doc.Nearby.Held != 2 {
		t.Errorf("show --json of a near miss = %s (%v), want nearby holding %s of 2 held", r.stdout, err, held)
	}

	r = cli(t, nil, "show", uri, `["nobody:here"]`)
	if !strings.Contains(r.stdout, `No key of task type "nobody:here" is held; 2 other keys are held`) {
		t.Errorf("show of a task type nobody holds:\n%s\nwant the count of held keys", r.stdout)
	}

	// A key of KeyBy's that only looks like the middleware's is found as typed.
	custom := `["custom", 1]`
	lock(t, locks, custom, "custom", "task-3")
	if r := mustRun(t, "show", uri, custom); !strings.Contains(r.stdout, "State:       held\n") || !strings.Contains(r.stdout, "Key:         "+custom+"\n") {
		t.Errorf("show of a held key that looks like the middleware's:\n%s\nwant it held, as typed", r.stdout)
	}
	if r := mustRun(t, "release", "--force", uri, custom); !strings.Contains(r.stdout, "Released "+custom) {
		t.Errorf("release --force of a held key that looks like the middleware's:\n%s\nwant it released", r.stdout)
	}

	// A space inside the array finds the key to release too.
	r = mustRun(t, "release", "--force", uri, `[ "count:num" , 42 ]`)
	if !strings.Contains(r.stdout, "Released "+held) {
		t.Errorf("release --force with spaces in the key:\n%s\nwant %s released", r.stdout, held)
	}
}

// TestTaskArgs: the --task form a near miss suggests builds the key it names.
func TestTaskArgs(t *testing.T) {
	t.Parallel()
	for key, want := range map[string]string{
		`["count:num",42]`:             "--task count:num 42",
		`["pay","c-42"]`:               "--task pay c-42",
		`["pay","42"]`:                 `--task pay '"42"'`,
		`["pay","it's",true,null]`:     `--task pay 'it'\''s' true null`,
		`["pay","-x"]`:                 "--task pay -- -x",
		`["a b"]`:                      "--task 'a b'",
		`plain key`:                    "'plain key'",
		`["pay", 1]`:                   `'["pay", 1]'`, // not as the middleware writes it
		`["pay","` + "\u00e9" + `"]`:   "--task pay '\u00e9'",
		`["report:export","tenant-7"]`: "--task report:export tenant-7",
	} {
		if got := taskArgs(key); got != want {
			t.Errorf("taskArgs(%s) = %s, want %s", key, got, want)
			continue
		}
		if !strings.HasPrefix(want, "--task") {
			continue
		}
		args := shellSplit(t, want)
		inv, err := parseArgs(append([]string{"show"}, args...))
		if err != nil {
			t.Fatal(err)
		}
		if got, err := inv.targetKey(); err != nil || got != key {
			t.Errorf("show %s builds %s, %v; want %s", want, got, err, key)
		}
	}
}

// shellSplit splits what shellQuote writes: words, and single-quoted words with
// '\” for a quote.
func shellSplit(t *testing.T, s string) []string {
	t.Helper()
	var words []string
	var cur strings.Builder
	inQuote, inWord := false, false
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case inQuote && c == '\'':
			inQuote = false
		case inQuote:
			cur.WriteByte(c)
		case c == '\'':
			inQuote, inWord = true, true
		case c == '\\' && i+1 < len(s):
			i++
			cur.WriteByte(s[i])
		case c == ' ':
			if inWord {
				words, inWord = append(words, cur.String()), false
				cur.Reset()
			}
		default:
			cur.WriteByte(c)
			inWord = true
		}
	}
	if inWord {
		words = append(words, cur.String())
	}
	return words
}

// TestListWidth: list keeps a line within a terminal's width, showing task IDs cut
// to 8 characters, as the README shows them.
func TestListWidth(t *testing.T) {
	t.Parallel()
	s := redistest.Start(t)
	locks := newLocks(t, s.Client(t))
	const id = "0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0" // asynq's task IDs are UUIDs
	lock(t, locks, taskKeyOf(t, "payment:capture", `"c-42"`), "payment:capture", id)
	r := mustRun(t, "list", "--uri="+s.Addr())
	if strings.Contains(r.stdout, id) || !strings.Contains(r.stdout, " 0b1c2d3e… on ") {
		t.Errorf("list:\n%s\nwant the task ID cut to 0b1c2d3e…", r.stdout)
	}
	host, _ := os.Hostname()
	for _, line := range strings.Split(strings.TrimSpace(r.stdout), "\n") {
		if n := utf8.RuneCountInString(line) - len(host); n > 100 {
			t.Errorf("list line is %d characters besides the host name, want at most 100:\n%s", n, line)
		}
	}
}

// TestNotRedis: a server that answers, but not as Redis (an HTTP server), a
// database the server does not have: both said plainly, with the address.
func TestNotRedis(t *testing.T) {
	t.Parallel()
	web := httptest.NewServer(http.NotFoundHandler())
	t.Cleanup(web.Close)
	addr := strings.TrimPrefix(web.URL, "http://")
	for _, args := range [][]string{{"list"}, {"show", `["k"]`}} {
		r := cli(t, nil, append(args, "--uri", addr)...)
		if r.code != exitFailure || !strings.Contains(r.stderr, "the server at "+addr+" (--uri) is not Redis: it answered ") ||
			strings.Count(strings.TrimSpace(r.stderr), "\n") != 0 {
			t.Errorf("%s against an HTTP server: %v\nwant exit 1 and one line saying %s is not Redis", args[0], r, addr)
		}
	}

	s := redistest.Start(t)
	r := cli(t, nil, "list", "--uri", s.Addr(), "--db", "99")
	if r.code != exitFailure || !strings.Contains(r.stderr, "the server at "+s.Addr()+" has no database 99 (--db)") {
		t.Errorf("list --db 99: %v\nwant exit 1 and the missing database named", r)
	}
	r = cli(t, map[string]string{"REDIS_URL": "redis://" + s.Addr() + "/42"}, "list")
	if r.code != exitFailure || !strings.Contains(r.stderr, "has no database 42 (REDIS_URL)") {
		t.Errorf("list with REDIS_URL .../42: %v\nwant exit 1 and the missing database named", r)
	}
}

// TestNearKeysSkipsDigested: a key of the same task type that Redis keeps only the
// first bytes of is counted, but not suggested, since those bytes do not name it.
func TestNearKeysSkipsDigested(t *testing.T) {
	t.Parallel()
	digested := `["pay","` + strings.Repeat("x", 56) // begins as a key of type pay does
	all := func(yield func(keyOf, error) bool) {
		for _, k := range []keyOf{{`["pay","a"]`, false}, {digested, true}, {`["other"]`, false}} {
			if !yield(k, nil) {
				return
			}
		}
	}
	n, err := nearKeys(`["pay","b"]`, all)
	if err != nil || n.Held != 3 || len(n.Keys) != 1 || n.Keys[0] != `["pay","a"]` {
		t.Errorf("nearKeys = %+v, %v; want 3 counted and only [\"pay\",\"a\"] suggested", n, err)
	}
}
