package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"iter"
	"slices"
	"strconv"
	"strings"

	"github.com/asynqmutex/asynqmutex"
	"github.com/asynqmutex/asynqmutex/mutex"
)

// normalKey returns key as the middleware writes it when key is a JSON array of a
// task type and scalar values written another way ('["count:num", 42]', with a
// space, or a string with escapes): the form an operator types is then the one
// Redis holds. Any other key, or one that is not such an array, comes back as given.
// show and release fall back to the key as given when nobody holds its normal form,
// for a KeyBy key that only looks like the middleware's.
func normalKey(key string) string {
	typ, values, ok := splitKey(key)
	if !ok {
		return key
	}
	k, err := asynqmutex.Key(typ, values...)
	if err != nil {
		return key
	}
	return k
}

// splitKey reads key as the middleware's JSON array: a task type (or Scope) and the
// JSON texts of the values after it.
func splitKey(key string) (typ string, values []string, ok bool) {
	trimmed := bytes.TrimSpace([]byte(key))
	if len(trimmed) == 0 || trimmed[0] != '[' {
		return "", nil, false
	}
	var elems []json.RawMessage
	if json.Unmarshal(trimmed, &elems) != nil || len(elems) == 0 || json.Unmarshal(elems[0], &typ) != nil {
		return "", nil, false
	}
	for _, e := range elems[1:] {
		values = append(values, string(e))
	}
	return typ, values, true
}

// nearby is what is held close to a key nobody holds: the held keys of the same
// task type, and how many keys are held in all, so that a mistyped key (a string
// where the payload has a number, or the other way round) is not read as free.
// The rate commands use it for limited keys the same way (see rateNearby).
type nearby struct {
	TaskType string   `json:"task_type"` // the key's task type, or the key itself when it is no JSON array
	Keys     []string `json:"keys"`      // held keys of that task type, sorted, at most maxNearby
	More     int      `json:"more"`      // further held keys of that task type
	Held     int      `json:"held"`      // every held key under the prefix
}

// maxNearby bounds the keys a near miss lists.
const maxNearby = 10

// keyOf is a key as List reads it back: whole, or only its first bytes (digested).
type keyOf struct {
	key      string
	digested bool
}

// findNearby lists the held keys near key (see nearby), with one SCAN of the prefix.
func findNearby(ctx context.Context, locks *mutex.Client, key string) (*nearby, error) {
	return nearKeys(key, func(yield func(keyOf, error) bool) {
		for in, err := range locks.List(ctx) {
			if !yield(keyOf{in.Key, in.Digested}, err) {
				return
			}
		}
	})
}

// nearKeys finds the keys of all near key (see nearby). A digested key is counted
// but not suggested: its first bytes do not name it.
func nearKeys(key string, all iter.Seq2[keyOf, error]) (*nearby, error) {
	typ, _, ok := splitKey(key)
	if !ok {
		typ = key // perhaps the task type alone, as someone would type it
	}
	name, err := asynqmutex.Key(typ)
	if err != nil {
		return nil, err
	}
	whole, start := name, strings.TrimSuffix(name, "]")+","
	n := &nearby{TaskType: typ, Keys: []string{}}
	for k, err := range all {
		if err != nil {
			return nil, err
		}
		n.Held++
		if k.key == key || k.digested || (k.key != whole && !strings.HasPrefix(k.key, start)) {
			continue
		}
		n.Keys = append(n.Keys, k.key)
	}
	slices.Sort(n.Keys)
	if len(n.Keys) > maxNearby {
		n.More, n.Keys = len(n.Keys)-maxNearby, n.Keys[:maxNearby]
	}
	return n, nil
}

// nearWords are the words a near miss is told in: of held locks, of limited keys,
// or of ordered keys.
type nearWords struct {
	held, Held string // "held", or "limited"
	list, show string // the commands that list every key ("" for none) and show one
	// found and notFound say what Redis has of one form of a key; none, of keys
	// (%s), that it has nothing.
	found, notFound, none string
}

var (
	lockWords = nearWords{held: "held", Held: "Held", list: "list", show: "show",
		found: "held", notFound: "not held", none: "not held: nobody holds %s"}
	rateWords = nearWords{held: "limited", Held: "Limited", list: "rates", show: "rate",
		found: "remembered", notFound: "nothing remembered", none: "not found: Redis remembers no start and no pause of %s"}
	orderWords = nearWords{held: "ordered", Held: "Ordered", show: "order",
		found: "ordered", notFound: "not ordered", none: "not found: no order is kept for %s"}
)

// write says what is held near the key, for a person.
func (n *nearby) write(w io.Writer, prefix string) { n.writeAs(w, prefix, lockWords) }

// writeAs says what is near the key in words.
func (n *nearby) writeAs(w io.Writer, prefix string, words nearWords) {
	switch {
	case n.Held == 0:
		fmt.Fprintf(w, "No key at all is %s under prefix %s.\n", words.held, strconv.Quote(prefix))
		return
	case len(n.Keys) == 0:
		fmt.Fprintf(w, "No key of task type %s is %s; %d other %s %s under prefix %s%s.\n",
			printable(strconv.Quote(n.TaskType)), words.held, n.Held, plural(n.Held, "key is", "keys are"), words.held,
			strconv.Quote(prefix), words.run(": "))
		return
	}
	fmt.Fprintf(w, "%s nearby: %d %s of task type %s (of %d %s under prefix %s); is one of them meant?\n",
		words.Held, len(n.Keys)+n.More, plural(len(n.Keys)+n.More, "key", "keys"), printable(strconv.Quote(n.TaskType)),
		n.Held, words.held, strconv.Quote(prefix))
	for _, k := range n.Keys {
		fmt.Fprintf(w, "  %s    asynqmutex %s %s\n", printable(k), words.show, taskArgs(k))
	}
	if n.More > 0 {
		fmt.Fprintf(w, "  … and %d more%s\n", n.More, words.run(": "))
	}
}

// run is the advice to run the command that lists every key, after sep, or "" when
// there is none.
func (words nearWords) run(sep string) string {
	if words.list == "" {
		return ""
	}
	return sep + "run 'asynqmutex " + words.list + "'"
}

func plural(n int, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}

// taskArgs is how to name key on the command line: --task TYPE VALUE... for a key
// the middleware wrote, else the key quoted for a shell.
func taskArgs(key string) string {
	typ, values, ok := splitKey(key)
	if !ok || normalKey(key) != key {
		return shellQuote(key)
	}
	args := []string{"--task", shellQuote(typ)}
	dashes := false
	for _, v := range values {
		var s string
		if strings.HasPrefix(v, `"`) && json.Unmarshal([]byte(v), &s) == nil && !json.Valid([]byte(s)) {
			v = s // a string that is not JSON text is taken as that string
		}
		if strings.HasPrefix(v, "-") && !dashes {
			args, dashes = append(args, "--"), true
		}
		args = append(args, shellQuote(v))
	}
	return strings.Join(args, " ")
}

// shellQuote quotes s for a POSIX shell, unless it needs no quotes.
func shellQuote(s string) string {
	safe := s != ""
	for _, r := range s {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("-_.:/@%+=,", r)) {
			safe = false
			break
		}
	}
	if safe {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
