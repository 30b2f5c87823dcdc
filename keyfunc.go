package asynqmutex

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"unicode/utf16"
	"unicode/utf8"

	"github.com/hibiken/asynq"
)

// KeyFunc derives the lock key for a task. Tasks whose keys are equal never
// run at the same time; tasks with different keys do not wait for each other.
//
// A KeyFunc must be deterministic (the same task gives the same key in every
// worker process, on every machine, after every deploy) and safe for
// concurrent use: the middleware calls it from every worker goroutine. If it
// returns an error, the task does not run: the middleware wraps the error with
// asynq.SkipRetry, so asynq archives the task at once, where it can be
// inspected and run again.
//
// Keys of any length are fine: the lock package digests long keys and escapes
// the characters Redis Cluster gives meaning to, so a key may hold any bytes.
//
// The key On(fields...) derives is the compact JSON array text of the task
// type followed by each field's value, for example ["payment:capture","c-42"];
// without On or KeyBy the key is the task type alone, ["payment:capture"].
// Values compare as JSON text, not as what they mean to the program: 1, 1.0
// and "1" give three different keys, while "\u0041" and "A", or objects that
// differ only in key order, give one. Keys returned by a KeyBy function share
// this key space, so a custom key should not look like a JSON array, or it may
// contend with the tasks of another type that uses On.
type KeyFunc func(ctx context.Context, t *asynq.Task) (string, error)

// taskTypeKey is the key when neither On nor KeyBy is given: the task type
// alone, as the one-element JSON array ["type"].
func taskTypeKey(_ context.Context, t *asynq.Task) (string, error) {
	typ := t.Type()
	b := make([]byte, 0, len(typ)+4)
	b = append(b, '[')
	b = appendString(b, typ)
	b = append(b, ']')
	return string(b), nil
}

// validateFields panics if a field name given to fn (the exported function's full
// name, "asynqmutex.On") cannot name a payload field: an empty name, or a
// dotted path with an empty segment such as "a..b", ".a" or "a.". It is
// programmer error, caught when the middleware is built.
func validateFields(fn string, fields []string) {
	for _, f := range fields {
		if f == "" {
			panic(fn + ": empty field name")
		}
		if slices.Contains(strings.Split(f, "."), "") {
			panic(fmt.Sprintf("%s: field %q has an empty path segment", fn, f))
		}
	}
}

// fieldsKey returns the KeyFunc of On(fields...): the compact JSON array text
// [type, v1, v2, ...] where each vi is the canonical JSON text of the payload
// field fields[i] ("customer.id" is the field id of the object customer).
//
// The encoding is injective: a JSON array text parses one way only, so two
// tasks share a key exactly when their types are equal and each field's value
// is the same JSON value. "Same" means JSON identity: 1 and "1" differ, as do
// 1 and 1.0 (numbers keep the text they were written with, so integer IDs
// above 2^53 never collide); null, true and false are values like any other; a
// string's escapes do not matter ("\u0041" is "A"); an object's key order and
// whitespace do not matter. Strings that are not valid UTF-8 keep their bytes,
// so payloads differing only in invalid bytes never collide.
//
// The payload must be a JSON object and every field must be present (null is
// a value, a missing field is an error). A path segment cannot name a key that
// itself contains a dot. fields must have passed validateFields.
func fieldsKey(fields []string) KeyFunc {
	if len(fields) == 0 {
		return taskTypeKey
	}
	k := &fieldKeyer{fields: slices.Clone(fields)}
	prefixID := make(map[string]int)
	counts := make(map[string]int)
	for _, f := range k.fields {
		for i := range len(f) {
			if f[i] == '.' {
				counts[f[:i]]++
			}
		}
	}
	for _, f := range k.fields {
		p := fieldPath{segs: strings.Split(f, ".")}
		p.prefix = make([]int, len(p.segs)-1)
		for j := range p.prefix {
			pre := strings.Join(p.segs[:j+1], ".")
			if counts[pre] < 2 {
				p.prefix[j] = -1 // no other field passes through here: no cache
				continue
			}
			id, ok := prefixID[pre]
			if !ok {
				id = len(prefixID)
				prefixID[pre] = id
			}
			p.prefix[j] = id
		}
		k.paths = append(k.paths, p)
	}
	k.shared = len(prefixID)
	return k.key
}

type fieldKeyer struct {
	fields []string
	paths  []fieldPath
	shared int // number of object prefixes that several fields pass through
}

type fieldPath struct {
	segs []string
	// prefix[j] is the cache slot of the object segs[:j+1] names, or -1
	// when only this field goes through it.
	prefix []int
}

func (k *fieldKeyer) key(_ context.Context, t *asynq.Task) (string, error) {
	typ := t.Type()
	payload := t.Payload()

	root, err := decodeObject(payload)
	if err != nil {
		return "", &keyError{taskType: typ, unread: k.fields, msg: err.Error(), err: err}
	}
	var cache []map[string]json.RawMessage
	if k.shared > 0 {
		cache = make([]map[string]json.RawMessage, k.shared)
	}

	b := make([]byte, 0, len(typ)+16*len(k.paths)+8)
	b = append(b, '[')
	b = appendString(b, typ)
	for i, p := range k.paths {
		obj := root
		for j, seg := range p.segs[:len(p.segs)-1] {
			if id := p.prefix[j]; id >= 0 && cache[id] != nil {
				obj = cache[id]
				continue
			}
			raw, ok := obj[seg]
			if !ok {
				return "", k.missing(typ, i)
			}
			if kind := kindOf(raw); kind != "object" {
				return "", &keyError{
					taskType: typ, field: k.fields[i],
					msg: fmt.Sprintf("%q is %s, not an object", strings.Join(p.segs[:j+1], "."), describeKind(kind)),
				}
			}
			next, err := decodeObject(raw)
			if err != nil { // cannot happen: the payload was checked whole
				return "", &keyError{taskType: typ, field: k.fields[i], msg: err.Error(), err: err}
			}
			if id := p.prefix[j]; id >= 0 {
				cache[id] = next
			}
			obj = next
		}
		raw, ok := obj[p.segs[len(p.segs)-1]]
		if !ok {
			return "", k.missing(typ, i)
		}
		b = append(b, ',')
		b, err = appendValue(b, raw)
		if err != nil { // cannot happen: the payload was checked whole
			return "", &keyError{taskType: typ, field: k.fields[i], msg: err.Error(), err: err}
		}
	}
	b = append(b, ']')
	return string(b), nil
}

func (k *fieldKeyer) missing(typ string, i int) error {
	return &keyError{taskType: typ, field: k.fields[i], missing: true}
}

// keyError is why a key could not be derived from a task. It never quotes
// the payload, which may be large or hold secrets.
type keyError struct {
	taskType string
	field    string   // the field as given to On; empty if the payload as a whole is at fault
	unread   []string // when the payload as a whole is at fault: the fields it should have held
	missing  bool     // the field is not in the payload
	msg      string
	err      error // the encoding/json error, if any
}

func (e *keyError) Error() string {
	if e.field == "" {
		if len(e.unread) == 0 {
			return fmt.Sprintf("asynqmutex: task %q: %s", e.taskType, e.msg)
		}
		quoted := make([]string, len(e.unread))
		for i, f := range e.unread {
			quoted[i] = strconv.Quote(f)
		}
		noun := "field"
		if len(quoted) > 1 {
			noun = "fields"
		}
		return fmt.Sprintf("asynqmutex: task %q: %s %s not readable: %s", e.taskType, noun, strings.Join(quoted, ", "), e.msg)
	}
	if e.missing {
		return fmt.Sprintf("asynqmutex: task %q: field %q missing from payload", e.taskType, e.field)
	}
	return fmt.Sprintf("asynqmutex: task %q: field %q: %s", e.taskType, e.field, e.msg)
}

func (e *keyError) Unwrap() error { return e.err }

// decodeObject decodes one level of a JSON object. encoding/json checks the
// whole text first, so nested values are valid JSON afterwards.
func decodeObject(data []byte) (map[string]json.RawMessage, error) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(data, &m); err != nil {
		if len(bytes.TrimLeft(data, " \t\r\n")) == 0 {
			return nil, errors.New("payload is empty, not a JSON object")
		}
		var ute *json.UnmarshalTypeError
		if errors.As(err, &ute) && json.Valid(data) {
			return nil, fmt.Errorf("payload is %s, not a JSON object", describeKind(kindOf(data)))
		}
		return nil, fmt.Errorf("payload is not a JSON object: %w", err)
	}
	if m == nil { // the payload was null, which Unmarshal accepts as a nil map
		return nil, errors.New("payload is null, not a JSON object")
	}
	return m, nil
}

// kindOf names the kind of the valid JSON value data holds.
func kindOf(data []byte) string {
	data = skipSpace(data)
	if len(data) == 0 {
		return "empty value"
	}
	switch data[0] {
	case '{':
		return "object"
	case '[':
		return "array"
	case '"':
		return "string"
	case 't', 'f':
		return "boolean"
	case 'n':
		return "null"
	default:
		return "number"
	}
}

// describeKind gives kind with its article: "a string", "an array", "null".
func describeKind(kind string) string {
	switch kind {
	case "null":
		return kind
	case "array", "object", "empty value":
		return "an " + kind
	}
	return "a " + kind
}

var errMalformed = errors.New("malformed JSON value")

func skipSpace(data []byte) []byte {
	for len(data) > 0 && (data[0] == ' ' || data[0] == '\t' || data[0] == '\n' || data[0] == '\r') {
		data = data[1:]
	}
	return data
}

// appendValue appends the canonical text of the JSON value data holds.
//
// The canonical text is what json.Marshal gives for the value decoded with
// json.Decoder.UseNumber, as of Go 1.24: compact, object keys sorted by their
// bytes with the last of duplicate keys winning, numbers as written, strings
// escaped as appendString does. It is produced here rather than by
// encoding/json so that keys do not change with the Go version, and so that
// strings holding invalid UTF-8 or unpaired UTF-16 surrogates, which
// encoding/json turns into U+FFFD, keep what makes them distinct.
//
// The value is parsed into a tree first and written out after, so that the
// work stays linear in its size however deeply objects nest.
func appendValue(dst, data []byte) ([]byte, error) {
	n, rest, err := parseValue(data, 0)
	if err != nil {
		return dst, err
	}
	if len(skipSpace(rest)) != 0 {
		return dst, errMalformed
	}
	return n.append(dst), nil
}

// maxDepth matches the nesting limit of encoding/json, which has already
// accepted the text; it only keeps a malformed input from recursing without end.
const maxDepth = 10000

// jsonNode is a parsed JSON value.
type jsonNode struct {
	// kind is '{' for an object, '[' an array, '"' a string to escape, 0 text
	// that is already canonical. In ASCII, '{'+2 is '}' and '['+2 is ']'.
	kind byte
	text []byte     // kind 0: the canonical text; '"': the decoded string, as unquoteJSON gives it
	key  string     // the decoded key of an object member
	kids []jsonNode // the elements of an array, the members of an object in canonical order
}

func (n *jsonNode) append(dst []byte) []byte {
	switch n.kind {
	case '"':
		return appendString(dst, n.text)
	case '[', '{':
		dst = append(dst, n.kind)
		for i := range n.kids {
			if i > 0 {
				dst = append(dst, ',')
			}
			if n.kind == '{' {
				dst = appendString(dst, n.kids[i].key)
				dst = append(dst, ':')
			}
			dst = n.kids[i].append(dst)
		}
		return append(dst, n.kind+2) // ']' or '}'
	}
	return append(dst, n.text...)
}

// parseValue parses the JSON value at the start of data and returns the text
// after it.
func parseValue(data []byte, depth int) (jsonNode, []byte, error) {
	data = skipSpace(data)
	if len(data) == 0 || depth > maxDepth {
		return jsonNode{}, nil, errMalformed
	}
	switch c := data[0]; {
	case c == '{' || c == '[':
		return parseContainer(c, data[1:], depth)
	case c == '"':
		tok, rest, err := scanString(data)
		if err != nil {
			return jsonNode{}, nil, err
		}
		if plainString(tok) { // the common case: already canonical
			return jsonNode{text: data[:len(tok)+2]}, rest, nil
		}
		return jsonNode{kind: '"', text: unquoteJSON(tok)}, rest, nil
	case c == 't':
		return parseLiteral(data, "true")
	case c == 'f':
		return parseLiteral(data, "false")
	case c == 'n':
		return parseLiteral(data, "null")
	case c == '-' || '0' <= c && c <= '9':
		n := 1
		for n < len(data) && strings.IndexByte("0123456789.eE+-", data[n]) >= 0 {
			n++
		}
		return jsonNode{text: data[:n]}, data[n:], nil
	}
	return jsonNode{}, nil, errMalformed
}

func parseLiteral(data []byte, lit string) (jsonNode, []byte, error) {
	if !bytes.HasPrefix(data, []byte(lit)) {
		return jsonNode{}, nil, errMalformed
	}
	return jsonNode{text: data[:len(lit)]}, data[len(lit):], nil
}

// parseContainer parses the object or array whose opening kind was just read.
func parseContainer(kind byte, data []byte, depth int) (jsonNode, []byte, error) {
	n := jsonNode{kind: kind}
	data = skipSpace(data)
	if len(data) > 0 && data[0] == kind+2 {
		return n, data[1:], nil
	}
	for {
		var key string
		if kind == '{' {
			tok, rest, err := scanString(skipSpace(data))
			if err != nil {
				return jsonNode{}, nil, err
			}
			rest = skipSpace(rest)
			if len(rest) == 0 || rest[0] != ':' {
				return jsonNode{}, nil, errMalformed
			}
			key, data = string(unquoteJSON(tok)), rest[1:]
		}
		kid, rest, err := parseValue(data, depth+1)
		if err != nil {
			return jsonNode{}, nil, err
		}
		kid.key = key
		n.kids = append(n.kids, kid)
		rest = skipSpace(rest)
		if len(rest) == 0 {
			return jsonNode{}, nil, errMalformed
		}
		data = rest[1:]
		if rest[0] == kind+2 {
			break
		}
		if rest[0] != ',' {
			return jsonNode{}, nil, errMalformed
		}
	}
	if kind == '{' {
		// Stable, so that of equal keys the last one written stays last,
		// and wins, as in encoding/json.
		slices.SortStableFunc(n.kids, func(a, b jsonNode) int { return strings.Compare(a.key, b.key) })
		kids := n.kids[:0]
		for i, kid := range n.kids {
			if i+1 < len(n.kids) && n.kids[i+1].key == kid.key {
				continue
			}
			kids = append(kids, kid)
		}
		n.kids = kids
	}
	return n, data, nil
}

// scanString splits a JSON string at the start of data into the text between
// its quotes and the rest.
func scanString(data []byte) (tok, rest []byte, err error) {
	if len(data) == 0 || data[0] != '"' {
		return nil, nil, errMalformed
	}
	for i := 1; i < len(data); i++ {
		switch data[i] {
		case '\\':
			i++
		case '"':
			return data[1:i], data[i+1:], nil
		}
	}
	return nil, nil, errMalformed
}

// plainString reports whether the string text tok needs no escape and no decoding:
// then it is its own canonical text.
func plainString(tok []byte) bool {
	for _, c := range tok {
		if c < 0x20 || c >= utf8.RuneSelf || c == '"' || c == '\\' || c == '<' || c == '>' || c == '&' {
			return false
		}
	}
	return true
}

// unquoteJSON decodes the text between a JSON string's quotes. Unlike
// encoding/json it loses nothing: bytes that are not UTF-8 are kept as they
// are, and an unpaired surrogate escape becomes the three bytes UTF-8 would
// give it if it were allowed (as in WTF-8), which appendString turns back
// into the escape.
func unquoteJSON(tok []byte) []byte {
	out := make([]byte, 0, len(tok))
	for i := 0; i < len(tok); {
		c := tok[i]
		if c != '\\' {
			out = append(out, c)
			i++
			continue
		}
		if i+1 >= len(tok) {
			return append(out, tok[i:]...) // cannot happen in valid JSON
		}
		switch e := tok[i+1]; e {
		case 'b':
			out = append(out, '\b')
		case 'f':
			out = append(out, '\f')
		case 'n':
			out = append(out, '\n')
		case 'r':
			out = append(out, '\r')
		case 't':
			out = append(out, '\t')
		case 'u':
			r, ok := hex4(tok[i+2:])
			if !ok {
				return append(out, tok[i:]...) // cannot happen in valid JSON
			}
			i += 6
			if !utf16.IsSurrogate(r) {
				out = utf8.AppendRune(out, r)
				continue
			}
			if r < 0xDC00 && i+1 < len(tok) && tok[i] == '\\' && tok[i+1] == 'u' {
				if r2, ok := hex4(tok[i+2:]); ok && 0xDC00 <= r2 && r2 < 0xE000 {
					out = utf8.AppendRune(out, utf16.DecodeRune(r, r2))
					i += 6
					continue
				}
			}
			out = append(out, 0xE0|byte(r>>12), 0x80|byte(r>>6)&0x3F, 0x80|byte(r)&0x3F)
			continue
		default: // '"', '\\', '/'
			out = append(out, e)
		}
		i += 2
	}
	return out
}

func hex4(b []byte) (rune, bool) {
	if len(b) < 4 {
		return 0, false
	}
	var r rune
	for _, c := range b[:4] {
		switch {
		case '0' <= c && c <= '9':
			c -= '0'
		case 'a' <= c && c <= 'f':
			c -= 'a' - 10
		case 'A' <= c && c <= 'F':
			c -= 'A' - 10
		default:
			return 0, false
		}
		r = r<<4 | rune(c)
	}
	return r, true
}

const hexDigits = "0123456789abcdef"

// appendString appends s as a JSON string the way json.Marshal did as of Go
// 1.24 (HTML-safe escapes, U+2028 and U+2029 escaped), except that bytes that
// are not UTF-8 are kept as they are instead of becoming \ufffd, and the
// three-byte form of a surrogate becomes its \uXXXX escape. Every output byte
// that is not valid UTF-8 thus comes from the same byte of s, so distinct
// strings give distinct texts.
func appendString[S ~string | ~[]byte](dst []byte, s S) []byte {
	dst = append(dst, '"')
	start := 0
	for i := 0; i < len(s); {
		if c := s[i]; c < utf8.RuneSelf {
			if c >= 0x20 && c != '"' && c != '\\' && c != '<' && c != '>' && c != '&' {
				i++
				continue
			}
			dst = append(dst, s[start:i]...)
			switch c {
			case '"', '\\':
				dst = append(dst, '\\', c)
			case '\b':
				dst = append(dst, '\\', 'b')
			case '\f':
				dst = append(dst, '\\', 'f')
			case '\n':
				dst = append(dst, '\\', 'n')
			case '\r':
				dst = append(dst, '\\', 'r')
			case '\t':
				dst = append(dst, '\\', 't')
			default:
				dst = append(dst, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xF])
			}
			i++
			start = i
			continue
		}
		n := min(len(s)-i, utf8.UTFMax)
		r, size := utf8.DecodeRuneInString(string(s[i : i+n]))
		if r == utf8.RuneError && size == 1 {
			if i+2 < len(s) && s[i] == 0xED && s[i+1]&0xE0 == 0xA0 && s[i+2]&0xC0 == 0x80 {
				dst = append(dst, s[start:i]...)
				sur := 0xD000 | rune(s[i+1]&0x3F)<<6 | rune(s[i+2]&0x3F)
				dst = append(dst, '\\', 'u', 'd', hexDigits[sur>>8&0xF], hexDigits[sur>>4&0xF], hexDigits[sur&0xF])
				i += 3
				start = i
				continue
			}
			i++ // kept as is
			continue
		}
		if r == '\u2028' || r == '\u2029' {
			dst = append(dst, s[start:i]...)
			dst = append(dst, '\\', 'u', '2', '0', '2', hexDigits[r&0xF])
			i += size
			start = i
			continue
		}
		i += size
	}
	dst = append(dst, s[start:]...)
	return append(dst, '"')
}
