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

	"github.com/hibiken/asynq"

	"github.com/asynqmutex/asynqmutex/internal/jsonscan"
	"github.com/asynqmutex/asynqmutex/internal/keyset"
	"github.com/asynqmutex/asynqmutex/internal/shortkey"
)

// keyGate is the path's first gate: it derives the task's key (or keys) and passes
// the task on, or fails it as bad input when no key can be derived.
func (m *middleware) keyGate(ctx context.Context, tk *task, next func(context.Context) error) error {
	key, keys, err := m.keysOf(ctx, tk.Task)
	if err != nil {
		var ke *keyError
		if !errors.As(err, &ke) { // a KeyBy error need not name the task
			err = &wrapError{msg: fmt.Sprintf("asynqmutex: task %s: lock key: %s", shortkey.Quote(tk.Type()), oneLine(err)), err: err}
		}
		err = &wrapError{
			msg: fmt.Sprintf("%s; %s archived without running: %v", oneLine(err), taskRef(tk.meta.id), asynq.SkipRetry),
			err: errors.Join(err, asynq.SkipRetry),
		}
		m.emit(ctx, Event{Op: OpBadInput, TaskType: tk.Type(), TaskID: tk.meta.id, Err: err})
		return err
	}
	tk.key, tk.keys = key, keys
	return next(ctx)
}

// On makes the lock key the task type plus the values of these JSON payload fields,
// so tasks of one type with the same values run one at a time ("customer.id" names
// the field id inside the object customer). A value must be a string, a number, a
// boolean or null; see KeyFunc for the key's exact form. Without On or KeyBy the key
// is the task type alone: at most one task of each type runs at a time. Scope
// shares keys between task types.
//
// A task whose payload is not a JSON object, lacks a field, or holds an object, an
// array or a string that is not UTF-8 there, is archived at once with an error
// naming the field (see Middleware). That holds for every task the middleware
// wraps: under mux.Use, without For, it wraps every task type on the mux, and a task
// type whose payload lacks the field is archived without running. Name the task
// types with For, or wrap their handlers alone.
//
// On panics if no field is given or a name is empty. Give every field to one On:
// Middleware panics on a second key option (On, OnEach, KeyBy, KeysBy), naming both,
// rather than keep one of them.
func On(fields ...string) Option {
	if len(fields) == 0 {
		panic("asynqmutex.On: no field given")
	}
	validateFields("asynqmutex.On", fields)
	fields = append([]string(nil), fields...)
	call := callText("On", fields)
	return optionFunc(func(c *config) { c.setKey("On", call, nil, nil); c.fields = fields })
}

// KeyBy makes fn derive the lock key, for keys On cannot express. An error from fn,
// or an empty key, archives the task as a malformed payload does. KeyBy panics if fn
// is nil; Middleware panics if another key option (On, OnEach, KeyBy, KeysBy) is
// given too.
func KeyBy(fn KeyFunc) Option {
	if fn == nil {
		panic("asynqmutex.KeyBy: nil KeyFunc")
	}
	return optionFunc(func(c *config) { c.setKey("KeyBy", "KeyBy(fn)", fn, nil) })
}

// setKey records the key option by (called as call). A second key option panics,
// naming both: keeping either would drop fields or keys the caller asked for.
func (c *config) setKey(by, call string, one KeyFunc, several KeysFunc) {
	if c.keySetBy != "" {
		hint := "give one"
		if c.keySetBy == by && (by == "On" || by == "OnEach") {
			hint = "give every field to one " + by
		}
		panic("asynqmutex.Middleware: two key options, " + c.keyCall + " and " + call + "; " + hint)
	}
	c.key, c.keys, c.keySetBy, c.keyCall, c.fields = one, several, by, call, nil
}

// keyFuncs sets key or keys once all options are in: from On's or OnEach's fields,
// or the task type (or Scope's name) alone when no option set them.
func (c *config) keyFuncs() {
	if c.scope != "" && (c.keySetBy == "KeyBy" || c.keySetBy == "KeysBy") {
		panic("asynqmutex.Middleware: Scope names the keys of On, OnEach and the task type; " + c.keySetBy + " makes its own keys")
	}
	if c.limit > 1 && (c.keySetBy == "OnEach" || c.keySetBy == "KeysBy") {
		panic("asynqmutex.Middleware: Limit caps the tasks of one key; " + c.keySetBy + " gives a task several keys")
	}
	switch {
	case c.keySetBy == "On":
		c.key = newFieldKeyer(c.fields, c.scope).key
	case c.keySetBy == "OnEach":
		c.keys = newFieldKeyer(c.fields, c.scope).keys
	case c.keySetBy == "" && c.scope != "":
		c.key = scopeKey(c.scope)
	case c.keySetBy == "":
		c.key = taskTypeKey
	}
}

// Scope makes the lock keys begin with name instead of the task type, so that tasks
// of several types share them: with Scope("account"), a deposit under On("account")
// and a transfer under OnEach("from", "to") both lock ["account","A"] for account A,
// and never run on it at once. Without On or OnEach, all tasks given Scope(name)
// share the one key [name]. Key(name, values...) is the key of such a task. The
// default is the task type. Scope panics if name is empty; Middleware panics if it
// is combined with KeyBy or KeysBy, whose keys are their own.
func Scope(name string) Option {
	if name == "" {
		panic("asynqmutex.Scope: empty name")
	}
	return once("Scope", callText("Scope", []string{name}), func(c *config) { c.scope = name })
}

// KeysFunc derives several lock keys for a task, for OnEach and KeysBy: the task runs
// only while it holds all of them, so it never runs at the same time as a task with
// any of the same keys, whatever its other keys. The rules of KeyFunc apply to each
// key: deterministic, safe for concurrent use, an error or an empty key (or no key)
// archives the task. The keys share KeyFunc's key space, so a task with keys
// {"a","b"} excludes a task whose KeyFunc gives "a". The order of the keys does not
// matter, and a key given twice counts once.
type KeysFunc func(ctx context.Context, t *asynq.Task) ([]string, error)

// OnEach gives a task one lock key per field, and runs it only while it holds all of
// them (mutex.Client.WithLockKeys): OnEach("from", "to") makes a transfer from A to B
// wait for every task on A or on B, while transfers that share no account run at
// once. Each key is the one On(field) would derive: the task type (or Scope's name)
// and the field's value, so a value in "from" and the same value in "to" are one
// key. The fields are read as On reads them; a payload that lacks one, or holds an
// object or an array there, is archived at once with an error naming the field.
// Taking the keys never deadlocks against tasks taking overlapping sets in another
// order (see mutex.Client.LockKeys); the price is that a task waiting for a busy key
// (MaxWait) keeps the keys before it meanwhile, so tasks on those meet a busy key.
// On Redis Cluster each key costs a round trip.
// OnEach panics if no field is given or a name is empty. Give every field to one
// OnEach: Middleware panics on a second key option (On, OnEach, KeyBy, KeysBy),
// naming both. As with On, give For when the middleware wraps other task types.
func OnEach(fields ...string) Option {
	if len(fields) == 0 {
		panic("asynqmutex.OnEach: no field given")
	}
	validateFields("asynqmutex.OnEach", fields)
	fields = append([]string(nil), fields...)
	call := callText("OnEach", fields)
	return optionFunc(func(c *config) { c.setKey("OnEach", call, nil, nil); c.fields = fields })
}

// KeysBy makes fn derive several lock keys per task, held all at once, for sets
// OnEach cannot express (see KeysFunc). An error from fn, no key, or an empty key
// archives the task as a malformed payload does. KeysBy panics if fn is nil;
// Middleware panics if another key option (On, OnEach, KeyBy, KeysBy) is given too.
func KeysBy(fn KeysFunc) Option {
	if fn == nil {
		panic("asynqmutex.KeysBy: nil KeysFunc")
	}
	return optionFunc(func(c *config) { c.setKey("KeysBy", "KeysBy(fn)", nil, fn) })
}

// keysOf derives the task's lock key, or its keys when it has several (then key is
// the first of them), or an error saying why it cannot.
func (m *middleware) keysOf(ctx context.Context, t *asynq.Task) (key string, keys []string, err error) {
	if m.keys == nil {
		key, err = m.key(ctx, t)
		if err == nil && key == "" {
			err = &keyError{taskType: t.Type(), msg: "KeyBy returned an empty key"}
		}
		return key, nil, err
	}
	keys, err = m.keys(ctx, t)
	switch {
	case err != nil:
		return "", nil, err
	case len(keys) == 0:
		return "", nil, &keyError{taskType: t.Type(), msg: "KeysBy returned no key"}
	case slices.Contains(keys, ""):
		return "", nil, &keyError{taskType: t.Type(), msg: "KeysBy returned an empty key"}
	}
	distinct := keyset.Distinct(keys)
	if len(distinct) == 1 {
		return distinct[0], nil, nil
	}
	return distinct[0], distinct, nil
}

// KeyFunc derives the lock key for a task. Tasks whose keys are equal never
// run at the same time; tasks with different keys do not wait for each other.
//
// A KeyFunc must be deterministic (the same task gives the same key in every
// worker process, on every machine, after every deploy) and safe for
// concurrent use: the middleware calls it from every worker goroutine. If it
// returns an error, or an empty key, the task does not run: the middleware
// wraps the error with asynq.SkipRetry, so asynq archives the task at once,
// where it can be inspected and run again.
//
// Keys of any length are fine: the lock package digests long keys and escapes
// the characters Redis Cluster gives meaning to, so a key may hold any bytes.
// Error texts and logs show a key longer than 100 bytes shortened, with a
// digest.
//
// The key On(fields...) derives is the compact JSON array text of the task type
// followed by each field's value, for example ["payment:capture","c-42"]; without On
// or KeyBy the key is the task type alone, ["payment:capture"]. Scope(name) puts name
// where the task type would be. Keys returned by a KeyBy function share this key
// space, so a custom key should not look like a JSON array, or it may contend with the
// tasks of another type that uses On.
type KeyFunc func(ctx context.Context, t *asynq.Task) (string, error)

// Key returns the lock key that On derives for a task of type taskType (or under
// Scope(taskType); OnEach derives one such key per field) whose fields
// hold values, in On's order, each given as the JSON text the payload holds: `"c-42"`
// for a string, `42`, `true` or `null`. A number's text is kept as written, so 1 and
// 1.0 are different keys, as they are for On. With no values it is the key of a task
// type without On or KeyBy. Use it with mutex.Client.Inspect, Locked or
// ForceRelease, and the asynqmutex command's --task flag, to find a task's lock. It
// returns an error naming the value when one is not a JSON string, number, boolean
// or null.
func Key(taskType string, values ...string) (string, error) {
	if len(values) == 0 {
		return taskTypeKey(context.Background(), asynq.NewTask(taskType, nil))
	}
	var payload bytes.Buffer
	fields := make([]string, len(values))
	payload.WriteByte('{')
	for i, v := range values {
		if !json.Valid([]byte(v)) {
			return "", fmt.Errorf("asynqmutex.Key: value %d (%s) is not JSON text; write a string with its quotes", i+1, shortkey.Quote(v))
		}
		if kind := jsonscan.KindOf(jsonscan.SkipSpace([]byte(v))); kind == "object" || kind == "array" {
			return "", fmt.Errorf("asynqmutex.Key: value %d is %s; On takes strings, numbers, booleans and null", i+1, jsonscan.DescribeKind(kind))
		}
		fields[i] = "v" + strconv.Itoa(i)
		if i > 0 {
			payload.WriteByte(',')
		}
		payload.WriteString(`"` + fields[i] + `":` + v)
	}
	payload.WriteByte('}')
	key, err := fieldsKey(fields)(context.Background(), asynq.NewTask(taskType, payload.Bytes()))
	if ke := (*keyError)(nil); errors.As(err, &ke) && ke.field != "" {
		n, _ := strconv.Atoi(ke.field[1:])
		return "", fmt.Errorf("asynqmutex.Key: value %d%s", n+1, ke.msg)
	}
	if err != nil {
		return "", fmt.Errorf("asynqmutex.Key: %w", err)
	}
	return key, nil
}

// taskTypeKey is the key when neither On nor KeyBy is given: the task type
// alone, as the one-element JSON array ["type"].
func taskTypeKey(_ context.Context, t *asynq.Task) (string, error) {
	return nameKey(t.Type()), nil
}

// nameKey is the one-element JSON array [name].
func nameKey(name string) string {
	var b strings.Builder
	b.Grow(len(name) + 4)
	b.WriteByte('[')
	jsonscan.WriteString(&b, name)
	b.WriteByte(']')
	return b.String()
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
// [type, v1, v2, ...] where each vi is the canonical text of the payload field
// fields[i] ("customer.id" is the field id of the object customer).
//
// A field's value must be a scalar: a string, a number, true, false or null.
// Strings are written as RFC 8785 (JSON Canonicalization Scheme) writes them:
// only '"', '\\' and control characters are escaped, so "\u0041" and "A" are
// one value. Numbers keep the text they were written with, so 1 and 1.0 differ
// and integer IDs above 2^53 never collide; 1 and "1" differ too. The task type
// is written the same way, except that bytes that are not UTF-8 are kept as
// they are.
//
// The encoding is injective: the key parses as a JSON array whose elements are
// exactly the type and the field values. To keep it so, a string that is not
// valid UTF-8 or holds an unpaired surrogate escape such as "\ud800" is
// refused, since encoding/json would read it as U+FFFD, as it does a real
// U+FFFD. Objects and arrays are refused too: KeyBy can derive keys from them.
//
// The work is linear in the payload's size, and the memory it takes is under
// three times the size of the field values' JSON text (the key, and for a string
// with escapes encoding/json's unescaped copy), whatever else the payload holds:
// encoding/json checks the payload, and only the objects on the fields' paths
// are walked. The payload must be a JSON object and every field must be
// present; for duplicate names the last one wins, as in encoding/json. A path
// segment cannot name a member whose name itself contains a dot. fields must
// have passed validateFields.
func fieldsKey(fields []string) KeyFunc {
	if len(fields) == 0 {
		return taskTypeKey
	}
	return newFieldKeyer(fields, "").key
}

// scopeKey is the key of a task without On or KeyBy under Scope(scope): the
// one-element JSON array [scope].
func scopeKey(scope string) KeyFunc {
	key := nameKey(scope)
	return func(context.Context, *asynq.Task) (string, error) { return key, nil }
}

func newFieldKeyer(fields []string, scope string) *fieldKeyer {
	k := &fieldKeyer{fields: slices.Clone(fields), scope: scope}
	for _, f := range k.fields {
		k.paths = append(k.paths, strings.Split(f, "."))
	}
	return k
}

type fieldKeyer struct {
	fields []string
	paths  [][]string
	scope  string // Scope's name, written instead of the task type; "" for the type
}

func (k *fieldKeyer) key(_ context.Context, t *asynq.Task) (string, error) {
	var stack [4][]byte
	values, err := k.read(t, stack[:0])
	if err != nil {
		return "", err
	}
	return k.write(t, values, 0)
}

// keys is the KeysFunc of OnEach: one key per field, each the key On(field) would
// derive.
func (k *fieldKeyer) keys(_ context.Context, t *asynq.Task) ([]string, error) {
	var stack [4][]byte
	values, err := k.read(t, stack[:0])
	if err != nil {
		return nil, err
	}
	keys := make([]string, len(values))
	for i := range values {
		if keys[i], err = k.write(t, values[i:i+1], i); err != nil {
			return nil, err
		}
	}
	return keys, nil
}

// read appends to values the JSON text of each field of t's payload, or returns an
// error saying why one cannot be read.
func (k *fieldKeyer) read(t *asynq.Task, values [][]byte) ([][]byte, error) {
	typ, payload := t.Type(), t.Payload()
	if !json.Valid(payload) {
		msg, err := invalidPayload(payload)
		return nil, &keyError{taskType: typ, unread: k.fields, msg: msg, err: err}
	}
	root := jsonscan.SkipSpace(payload)
	if kind := jsonscan.KindOf(root); kind != "object" {
		return nil, &keyError{taskType: typ, unread: k.fields, msg: "payload is " + jsonscan.DescribeKind(kind) + ", not a JSON object"}
	}
	for i := range k.paths {
		v, err := k.lookup(typ, root, i)
		if err != nil {
			return nil, err
		}
		values = append(values, v)
	}
	return values, nil
}

// write is the key of task t whose fields, from the first-th on, hold values (read
// by read): the JSON array of the task type (or the scope) and the values'
// canonical texts.
func (k *fieldKeyer) write(t *asynq.Task, values [][]byte, first int) (string, error) {
	name := k.scope
	if name == "" {
		name = t.Type()
	}
	size := len(name) + 4 // the brackets and quotes; a name that needs escapes grows b
	for _, v := range values {
		size += 1 + len(v) // a value's canonical text is never longer than its JSON text
	}
	var b strings.Builder
	b.Grow(size)
	b.WriteByte('[')
	jsonscan.WriteString(&b, name)
	for i, v := range values {
		b.WriteByte(',')
		if v[0] != '"' {
			b.Write(v) // a number as written, true, false or null
			continue
		}
		if err := jsonscan.WriteCanonical(&b, v); err != nil {
			return "", &keyError{taskType: t.Type(), field: k.fields[first+i], msg: refusedString(err)}
		}
	}
	b.WriteByte(']')
	return b.String(), nil
}

// lookup returns the JSON text of field i in the object obj, a valid JSON
// object, or an error if it is missing or not a scalar.
func (k *fieldKeyer) lookup(typ string, obj []byte, i int) ([]byte, error) {
	segs := k.paths[i]
	v := obj
	for j, seg := range segs {
		if j > 0 {
			if kind := jsonscan.KindOf(v); kind != "object" {
				return nil, &keyError{
					taskType: typ, field: k.fields[i],
					msg: fmt.Sprintf(": %q is %s, not an object", strings.Join(segs[:j], "."), jsonscan.DescribeKind(kind)),
				}
			}
		}
		var ok bool
		if v, ok = jsonscan.Member(v, seg); !ok {
			return nil, &keyError{taskType: typ, field: k.fields[i], missing: true}
		}
	}
	switch kind := jsonscan.KindOf(v); kind {
	case "object", "array":
		return nil, &keyError{
			taskType: typ, field: k.fields[i],
			msg: " is " + jsonscan.DescribeKind(kind) + "; On takes strings, numbers, booleans and null (derive other keys with KeyBy)",
		}
	}
	return v, nil
}

// invalidPayload says what is wrong with data, which is not valid JSON, and
// returns encoding/json's error for it.
func invalidPayload(data []byte) (string, error) {
	var v struct{}
	err := json.Unmarshal(data, &v)
	if len(jsonscan.SkipSpace(data)) == 0 {
		return "payload is empty, not a JSON object", err
	}
	return "payload is not a JSON object: " + err.Error(), err
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
	typ := shortkey.Quote(e.taskType)
	if e.field == "" {
		if len(e.unread) == 0 {
			return fmt.Sprintf("asynqmutex: task %s: %s", typ, e.msg)
		}
		quoted := make([]string, len(e.unread))
		for i, f := range e.unread {
			quoted[i] = strconv.Quote(f)
		}
		noun := "field"
		if len(quoted) > 1 {
			noun = "fields"
		}
		return fmt.Sprintf("asynqmutex: task %s: %s %s not readable: %s", typ, noun, strings.Join(quoted, ", "), e.msg)
	}
	if e.missing {
		return fmt.Sprintf("asynqmutex: task %s: field %q missing from payload", typ, e.field)
	}
	return fmt.Sprintf("asynqmutex: task %s: field %q%s", typ, e.field, e.msg)
}

func (e *keyError) Unwrap() error { return e.err }

// refusedString is what follows a field's name in the error about a string value
// that jsonscan.WriteCanonical refused.
func refusedString(err error) string {
	switch {
	case errors.Is(err, jsonscan.ErrNotUTF8):
		return " is a string that is not valid UTF-8; On takes UTF-8 strings (derive other keys with KeyBy)"
	case errors.Is(err, jsonscan.ErrLoneSurrogate):
		return ` is a string with an unpaired surrogate escape such as \ud800; On takes strings of Unicode characters (derive other keys with KeyBy)`
	}
	return ": " + err.Error()
}
