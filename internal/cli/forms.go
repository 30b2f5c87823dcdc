package cli

import (
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"strings"
)

// The forms of a key. A --task value typed without quotes that JSON reads as a
// number, a boolean or null (12345) makes another key than the same text as a
// string ("12345"), and a payload may hold either: the commands that read one key
// (show, rate, order) look both forms up, show the one Redis has, and name the
// other. A KEY written otherwise than the middleware writes it has two forms too:
// its normal form first, then the key as typed, for a KeyBy key that only looks
// like the middleware's.

// form is one key the command line may mean.
type form struct {
	key string
	// note says how the form reads the values typed ("12345 as a number"), or ""
	// when the command line names one key. A form noted typed is said only when
	// found.
	note  string
	typed bool
}

// maxAmbiguous bounds the --task values whose forms are looked up, in every
// combination: 2^3 keys at most.
const maxAmbiguous = 3

// forms returns the keys the command line may mean, key (the one it builds) first.
func (inv *invocation) forms(key string) ([]form, error) {
	if !inv.set["task"] {
		given := inv.givenKey()
		if given == "" || given == key {
			return []form{{key: key}}, nil
		}
		return []form{{key: key, note: "read as the middleware writes it"}, {key: given, note: "as typed", typed: true}}, nil
	}
	var ambiguous []int
	for i, v := range inv.args {
		if bare(v) && len(ambiguous) < maxAmbiguous {
			ambiguous = append(ambiguous, i)
		}
	}
	if len(ambiguous) == 0 {
		return []form{{key: key}}, nil
	}
	var all []form
	for mask := range 1 << len(ambiguous) {
		values := append([]string(nil), inv.args...)
		var notes []string
		for j, i := range ambiguous {
			v := strings.TrimSpace(inv.args[i])
			if mask&(1<<j) == 0 {
				notes = append(notes, v+" as "+kindOf(v))
				continue
			}
			values[i] = jsonString(v)
			notes = append(notes, v+" as a string")
		}
		k, err := taskKey(inv.task, values)
		if err != nil {
			return nil, usagef("%v", err)
		}
		all = append(all, form{key: k, note: strings.Join(notes, ", ")})
	}
	return all, nil
}

// bare reports whether v, a --task value, is JSON text that is no string: a number,
// a boolean or null, which a payload may hold as a string as well.
func bare(v string) bool {
	t := strings.TrimSpace(v)
	return json.Valid([]byte(t)) && !strings.ContainsRune(`"{[`, rune(t[0]))
}

// kindOf names the kind of v, JSON text that bare accepts, with its article.
func kindOf(v string) string {
	switch v[0] {
	case 't', 'f':
		return "a boolean"
	case 'n':
		return "null"
	}
	return "a number"
}

// found is what a command read of one form of its key.
type found[T any] struct {
	form
	v  T
	ok bool // Redis has the key: held, remembered, ordered
}

// lookUp reads every form with read, which also says whether Redis has the key,
// and returns what it read and which form to show: the first found, or the first.
func lookUp[T any](forms []form, read func(key string) (T, bool, error)) ([]found[T], int, error) {
	all := make([]found[T], 0, len(forms))
	shown := -1
	for i, f := range forms {
		v, ok, err := read(f.key)
		if err != nil {
			return nil, 0, err
		}
		all = append(all, found[T]{form: f, v: v, ok: ok})
		if ok && shown < 0 {
			shown = i
		}
	}
	return all, max(shown, 0), nil
}

// otherFormJSON is a form of the key other than the one a document is of: the key,
// and whether Redis has it.
type otherFormJSON struct {
	Key   string `json:"key"`
	Found bool   `json:"found"`
}

// othersJSON lists the forms other than all[shown], or nil when there are none.
func othersJSON[T any](all []found[T], shown int) []otherFormJSON {
	var out []otherFormJSON
	for i, f := range all {
		if i != shown {
			out = append(out, otherFormJSON{Key: f.key, Found: f.ok})
		}
	}
	return out
}

// keyLine is the Key line of a command that shows one key, f, as text: the key, and
// how it was read from what was typed (given, the KEY; "" with --task).
func keyLine(text string, f form, given string) string {
	switch {
	case f.typed:
		return text
	case given != "" && given != f.key:
		return fmt.Sprintf("%s (given as %s, read as the middleware writes it)", text, printable(given))
	case f.note != "":
		return fmt.Sprintf("%s (%s)", text, f.note)
	}
	return text
}

// writeOthers says, for a person, what Redis has of the forms not shown, with the
// command that shows one it has: every --task form, and a KEY as typed when found.
func writeOthers[T any](w io.Writer, all []found[T], shown int, words nearWords) {
	for i, f := range all {
		if i == shown || (f.typed && !f.ok) {
			continue
		}
		if f.ok {
			fmt.Fprintf(w, "%-13s%s (%s): %s too; asynqmutex %s %s\n", "Other form:", printable(f.key), f.note, words.found,
				words.show, taskArgs(f.key))
		} else {
			fmt.Fprintf(w, "%-13s%s (%s): %s\n", "Other form:", printable(f.key), f.note, words.notFound)
		}
	}
}

// notFound tells stderr that Redis has none of the forms of the key, for the exit
// status it explains, and returns errReported.
func notFound[T any](stderr io.Writer, all []found[T], prefix string, words nearWords) error {
	keys := make([]string, len(all))
	for i, f := range all {
		keys[i] = quoteKey(f.key)
		if len(all) > 1 {
			keys[i] += " (" + f.note + ")"
		}
	}
	fmt.Fprintf(stderr, "asynqmutex: %s under prefix %s\n", fmt.Sprintf(words.none, strings.Join(keys, " or ")), strconv.Quote(prefix))
	return errReported
}
