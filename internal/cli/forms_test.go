package cli

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
	"github.com/asynqmutex/asynqmutex/order"
	"github.com/asynqmutex/asynqmutex/ratelimit"
)

// TestNumberOrString: a --task value typed without quotes that JSON reads as a
// number names the key of the number, but a payload may hold the same digits as a
// string, which is another key. show, rate and order look both up, show the one
// Redis has and name the other; a key found in neither form exits 1.
func TestNumberOrString(t *testing.T) {
	t.Parallel()
	s := redistest.Start(t)
	rdb := s.Client(t)
	locks := newLocks(t, rdb)
	uri := "--uri=" + s.Addr()
	str, num := taskKeyOf(t, "payment:capture", `"12345"`), taskKeyOf(t, "payment:capture", "12345")
	lock(t, locks, str, "payment:capture", "task-1")

	r := mustRun(t, "show", "--task", "payment:capture", "12345", uri)
	for _, want := range []string{
		"Key:         " + str + " (12345 as a string)\n",
		"State:       held\n",
		"Holder:      " + holderLine(t, "payment:capture", "task-1") + "\n",
		"Other form:  " + num + " (12345 as a number): not held\n",
	} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("show --task payment:capture 12345, with the string held:\n%s\nwant it to contain %q", r.stdout, want)
		}
	}
	r = mustRun(t, "show", "--json", "--task", "payment:capture", "12345", uri)
	var doc showJSON
	if err := json.Unmarshal([]byte(r.stdout), &doc); err != nil || doc.Key != str || !doc.Held ||
		len(doc.OtherForms) != 1 || doc.OtherForms[0] != (otherFormJSON{Key: num, Found: false}) {
		t.Errorf("show --json --task payment:capture 12345 = %s (%v)\nwant the string's key held, the number's not", r.stdout, err)
	}
	// Quoted, the value is the string alone: no other form.
	if r := mustRun(t, "show", "--task", "payment:capture", `"12345"`, uri); strings.Contains(r.stdout, "Other form:") ||
		!strings.Contains(r.stdout, "Key:         "+str+"\n") {
		t.Errorf(`show --task payment:capture '"12345"':`+"\n%s\nwant the string's key and no other form", r.stdout)
	}

	// Both held: the number, as typed, is shown, and the string named with the
	// command that shows it.
	lock(t, locks, num, "payment:capture", "task-2")
	r = mustRun(t, "show", "--task", "payment:capture", "12345", uri)
	for _, want := range []string{
		"Key:         " + num + " (12345 as a number)\n",
		"Holder:      " + holderLine(t, "payment:capture", "task-2") + "\n",
		"Other form:  " + str + ` (12345 as a string): held too; asynqmutex show --task payment:capture '"12345"'` + "\n",
	} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("show --task payment:capture 12345, with both held:\n%s\nwant it to contain %q", r.stdout, want)
		}
	}

	// Neither held: exit 1, both forms named; true and 7 give four forms.
	r = cli(t, nil, "show", "--task", "payment:capture", "777", uri)
	if want := `asynqmutex: not held: nobody holds ["payment:capture",777] (777 as a number) or ["payment:capture","777"] (777 as a string) under prefix "asynqmutex:"`; r.code != exitFailure ||
		strings.TrimSpace(r.stderr) != want {
		t.Errorf("show of a number held in neither form: %v\nwant exit 1 and %q on stderr", r, want)
	}
	r = cli(t, nil, "show", "--json", "--task", "payment:capture", "true", "7", uri)
	if err := json.Unmarshal([]byte(r.stdout), &doc); err != nil || r.code != exitFailure || len(doc.OtherForms) != 3 ||
		doc.OtherForms[2].Key != `["payment:capture","true","7"]` {
		t.Errorf("show --json --task payment:capture true 7: %v (%v)\nwant exit 1 and 3 other forms", r, err)
	}

	// A rate limit's key, and an order's.
	rl := ratelimit.New(rdb)
	rstr, rnum := taskKeyOf(t, "email:send", `"42"`), taskKeyOf(t, "email:send", "42")
	allow(t, rl, rstr, ratelimit.PerMinute(1), 1)
	r = mustRun(t, "rate", "--task", "email:send", "42", uri)
	for _, want := range []string{
		"Key:         " + rstr + " (42 as a string)\n",
		"Remembered:  1 start: ",
		"Other form:  " + rnum + " (42 as a number): nothing remembered\n",
	} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("rate --task email:send 42, with the string limited:\n%s\nwant it to contain %q", r.stdout, want)
		}
	}
	if r := cli(t, nil, "rate", "--task", "email:send", "43", uri); r.code != exitFailure ||
		!strings.Contains(r.stderr, `no start and no pause of ["email:send",43] (43 as a number) or ["email:send","43"] (43 as a string)`) {
		t.Errorf("rate of a number limited in neither form: %v\nwant exit 1 naming both", r)
	}

	seq := order.New(rdb)
	ostr := taskKeyOf(t, "transfer", `"7"`)
	if _, err := seq.Take(ctxT(t), ostr, "transfers", "t-1"); err != nil {
		t.Fatal(err)
	}
	r = mustRun(t, "order", "--task", "transfer", "7", uri)
	for _, want := range []string{
		"Key:         " + ostr + " (7 as a string)\n",
		"Waits for:   task t-1 in queue transfers",
		"Other form:  " + taskKeyOf(t, "transfer", "7") + " (7 as a number): not ordered\n",
	} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("order --task transfer 7, with the string ordered:\n%s\nwant it to contain %q", r.stdout, want)
		}
	}
	var od orderJSON
	r = mustRun(t, "order", "--json", "--task", "transfer", "7", uri)
	if err := json.Unmarshal([]byte(r.stdout), &od); err != nil || od.Key != ostr || !od.Ordered || len(od.OtherForms) != 1 || od.OtherForms[0].Found {
		t.Errorf("order --json --task transfer 7 = %s (%v)\nwant the string's key ordered, one other form", r.stdout, err)
	}
}
