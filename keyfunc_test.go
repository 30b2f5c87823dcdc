package asynqmutex

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/hibiken/asynq"

	"github.com/asynqmutex/asynqmutex/internal/jsonscan"
)

// keyOf derives the key of a task of type typ with payload p from fields.
func keyOf(typ string, p []byte, fields ...string) (string, error) {
	return fieldsKey(fields)(context.Background(), asynq.NewTask(typ, p))
}

func TestFieldsKey(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		typ     string
		payload string
		fields  []string
		want    string
	}{
		{"string", "payment:capture", `{"customer_id":"c-42","amount":10}`, []string{"customer_id"}, `["payment:capture","c-42"]`},
		{"nested", "t", `{"customer":{"id":7,"region":"eu"}}`, []string{"customer.id"}, `["t",7]`},
		{"shared prefix", "t", `{"customer":{"id":7,"region":"eu"}}`, []string{"customer.id", "customer.region"}, `["t",7,"eu"]`},
		{"fields order", "t", `{"customer":{"id":7,"region":"eu"}}`, []string{"customer.region", "customer.id"}, `["t","eu",7]`},
		{"deep shared prefix", "t", `{"a":{"b":{"c":1,"d":2},"x":3}}`, []string{"a.b.c", "a.x", "a.b.d"}, `["t",1,3,2]`},
		{"same field twice", "t", `{"a":1}`, []string{"a", "a"}, `["t",1,1]`},
		{"whitespace", "t", " \n{ \"a\" :\t1 , \"c\" : [ 1 , { } ] , \"b\" : \"x\" }\r\n", []string{"a", "b"}, `["t",1,"x"]`},
		{"number", "t", `{"a":1}`, []string{"a"}, `["t",1]`},
		{"number string", "t", `{"a":"1"}`, []string{"a"}, `["t","1"]`},
		{"number as written", "t", `{"a":1.0}`, []string{"a"}, `["t",1.0]`},
		{"exponent", "t", `{"a":-1.5E+3}`, []string{"a"}, `["t",-1.5E+3]`},
		{"big int", "t", `{"a":12345678901234567890}`, []string{"a"}, `["t",12345678901234567890]`},
		{"big int+1", "t", `{"a":12345678901234567891}`, []string{"a"}, `["t",12345678901234567891]`},
		{"null", "t", `{"a":null}`, []string{"a"}, `["t",null]`},
		{"true", "t", `{"a":true}`, []string{"a"}, `["t",true]`},
		{"false", "t", `{"a":false}`, []string{"a"}, `["t",false]`},
		{"colon", "t", `{"a":"x:y","b":"z"}`, []string{"a", "b"}, `["t","x:y","z"]`},
		{"escape", "t", `{"a":"\u0041"}`, []string{"a"}, `["t","A"]`},
		{"escaped key", "t", `{"\u0061":"A"}`, []string{"a"}, `["t","A"]`},
		{"key with a quote", "t", `{"a\"b":1,"a":2}`, []string{`a"b`}, `["t",1]`},
		{"solidus", "t", `{"a":"\/"}`, []string{"a"}, `["t","/"]`},
		{"non-ASCII escape", "t", `{"a":"\u00e9"}`, []string{"a"}, `["t","é"]`},
		{"surrogate pair", "t", `{"a":"\ud83d\ude00"}`, []string{"a"}, `["t","😀"]`},
		{"html", "t", `{"a":"<&>"}`, []string{"a"}, `["t","<&>"]`},
		{"html escaped", "t", `{"a":"\u003c\u0026\u003e"}`, []string{"a"}, `["t","<&>"]`},
		{"control", "t", `{"a":"\b\f\n\r\t\u0001\u001f\u007f"}`, []string{"a"}, "[\"t\",\"\\b\\f\\n\\r\\t\\u0001\\u001f\x7f\"]"},
		{"line separator", "t", "{\"a\":\"\u2028\\u2029\"}", []string{"a"}, "[\"t\",\"\u2028\u2029\"]"},
		{"quote and backslash", "t", `{"a":"\"\\"}`, []string{"a"}, `["t","\"\\"]`},
		{"braces", "t", `{"a":"{x}"}`, []string{"a"}, `["t","{x}"]`},
		{"U+FFFD", "t", `{"a":"\ufffd�"}`, []string{"a"}, `["t","��"]`},
		{"deep sibling", "t", `{"x":[[{"a":[1,{"}":"]"}]}]],"a":{"y":"\"}","a":"v"}}`, []string{"a.a"}, `["t","v"]`},
		{"number before brace", "t", `{"o":{"a":1},"b":2}`, []string{"o.a", "b"}, `["t",1,2]`},
		{"duplicate key", "t", `{"a":1,"a":2}`, []string{"a"}, `["t",2]`},
		{"duplicate object", "t", `{"o":{"a":1},"o":{"b":2}}`, []string{"o.b"}, `["t",2]`},
		{"empty string", "t", `{"q":""}`, []string{"q"}, `["t",""]`},
		{"type quoted", `a"b`, `{"a":"x"}`, []string{"a"}, `["a\"b","x"]`},
		{"type with control", "a\nb<", `{"a":"x"}`, []string{"a"}, `["a\nb<","x"]`},
		{"type invalid UTF-8", "a\xffb", `{"a":"x"}`, []string{"a"}, "[\"a\xffb\",\"x\"]"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got, err := keyOf(tt.typ, []byte(tt.payload), tt.fields...)
			if err != nil || got != tt.want {
				t.Errorf("key(%q, %q, %q) = %q, %v, want %q, nil", tt.typ, tt.payload, tt.fields, got, err, tt.want)
			}
		})
	}
}

// TestFieldsKeySame checks that payloads that hold the same values give the
// same key, and TestFieldsKeyDistinct that different values never do.
func TestFieldsKeySame(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name   string
		p1, p2 string
		fields []string
	}{
		{"top-level order", `{"a":1,"b":2}`, `{"b":2,"a":1}`, []string{"a", "b"}},
		{"other fields", `{"a":1,"b":2}`, `{"a":1,"b":3,"c":[]}`, []string{"a"}},
		{"escapes", `{"a":"Aé😀<\u2028"}`, `{"a":"\u0041\u00E9\uD83D\uDE00\u003c\u2028"}`, []string{"a"}},
		{"escaped names", `{"o":{"é":1}}`, `{"\u006f":{"\u00e9":1}}`, []string{"o.é"}},
		{"whitespace", `{"o":{"a":"x"}}`, "{ \"o\" : {\n\"a\" :\t\"x\" } }", []string{"o.a"}},
		{"nested other fields", `{"o":{"a":1}}`, `{"o":{"z":[{"a":2}],"a":1,"b":{}}}`, []string{"o.a"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			k1, err1 := keyOf("t", []byte(tt.p1), tt.fields...)
			k2, err2 := keyOf("t", []byte(tt.p2), tt.fields...)
			if err1 != nil || err2 != nil || k1 != k2 {
				t.Errorf("key(%q) = %q, %v; key(%q) = %q, %v; want equal keys", tt.p1, k1, err1, tt.p2, k2, err2)
			}
		})
	}
}

func TestFieldsKeyDistinct(t *testing.T) {
	t.Parallel()
	type task struct{ typ, payload string }
	tasks := []task{
		{"t", `{"a":"x:y","b":"z"}`},
		{"t", `{"a":"x","b":"y:z"}`},
		{"t", `{"a":"x\",\"y","b":"z"}`},
		{"t", `{"a":"x","b":"\",\"y\",\"z"}`},
		{"t", `{"a":"{x}","b":"z"}`},
		{"t", `{"a":1,"b":1}`},
		{"t", `{"a":"1","b":1}`},
		{"t", `{"a":1.0,"b":1}`},
		{"t", `{"a":1e0,"b":1}`},
		{"t", `{"a":12345678901234567890,"b":1}`},
		{"t", `{"a":12345678901234567891,"b":1}`},
		{"t", `{"a":null,"b":1}`},
		{"t", `{"a":"null","b":1}`},
		{"t", `{"a":true,"b":1}`},
		{"t", `{"a":"true","b":1}`},
		{"t", `{"a":false,"b":1}`},
		{"t", `{"a":"","b":1}`},
		{"t", `{"a":"\u0041","b":1}`},
		{"t", `{"a":"\ufffd","b":1}`},
		{"t", `{"a":"\\ud800","b":1}`},
		{"t", `{"a":"<","b":1}`},
		{"t", `{"a":"\\u003c","b":1}`},
		{"t", `{"a":"\u2028","b":1}`},
		{"t", `{"a":"\\u2028","b":1}`},
		{"t", `{"a":"\n","b":1}`},
		{"t", `{"a":"\\n","b":1}`},
		{"t<", `{"a":1,"b":1}`},
		{"t\\u003c", `{"a":1,"b":1}`},
		{"t\n", `{"a":1,"b":1}`},
		{"t\\n", `{"a":1,"b":1}`},
		{"t,1", `{"a":1,"b":1}`},
		{"t\",1,\"", `{"a":1,"b":1}`},
		{"t\xff", `{"a":1,"b":1}`},
		{"t\xfe", `{"a":1,"b":1}`},
		{"t\ufffd", `{"a":1,"b":1}`},
	}
	seen := make(map[string]task)
	for _, tk := range tasks {
		k, err := keyOf(tk.typ, []byte(tk.payload), "a", "b")
		if err != nil {
			t.Fatalf("key(%q, %q) = %v", tk.typ, tk.payload, err)
		}
		if prev, ok := seen[k]; ok {
			t.Errorf("key(%q, %q) = key(%q, %q) = %q, want distinct keys", tk.typ, tk.payload, prev.typ, prev.payload, k)
		}
		seen[k] = tk
	}
}

func TestTaskTypeKey(t *testing.T) {
	t.Parallel()
	for _, typ := range []string{"payment:capture", "", `a"b`, "<x>", "a\xffb"} {
		task := asynq.NewTask(typ, []byte("not even JSON"))
		got, err := taskTypeKey(context.Background(), task)
		var b strings.Builder
		b.WriteByte('[')
		jsonscan.WriteString(&b, typ)
		want := b.String() + "]"
		if err != nil || got != want {
			t.Errorf("taskTypeKey(%q) = %q, %v, want %q, nil", typ, got, err, want)
		}
		if got2, err := fieldsKey(nil)(context.Background(), task); err != nil || got2 != want {
			t.Errorf("fieldsKey(nil)(%q) = %q, %v, want %q, nil", typ, got2, err, want)
		}
	}
	if got, want := mustKeyOf(taskTypeKey(context.Background(), asynq.NewTask("payment:capture", nil))), `["payment:capture"]`; got != want {
		t.Errorf("taskTypeKey(payment:capture) = %q, want %q", got, want)
	}
}

func mustKeyOf(k string, err error) string {
	if err != nil {
		panic(err)
	}
	return k
}

const (
	scalarOnly = "On takes strings, numbers, booleans and null (derive other keys with KeyBy)"
	loneMsg    = `is a string with an unpaired surrogate escape such as \ud800; On takes strings of Unicode characters (derive other keys with KeyBy)`
)

func TestFieldsKeyErrors(t *testing.T) {
	t.Parallel()
	const typ = "payment:capture"
	tests := []struct {
		name    string
		payload string
		fields  []string
		field   string // the field the error names, "" for the payload
		want    string
	}{
		{"not JSON", `not JSON`, []string{"a"}, "", `asynqmutex: task "payment:capture": field "a" not readable: payload is not a JSON object: invalid character 'o' in literal null (expecting 'u')`},
		{"truncated", `{"a":`, []string{"a"}, "", `asynqmutex: task "payment:capture": field "a" not readable: payload is not a JSON object: unexpected end of JSON input`},
		{"trailing data", `{"a":1} {}`, []string{"a"}, "", `asynqmutex: task "payment:capture": field "a" not readable: payload is not a JSON object: invalid character '{' after top-level value`},
		{"empty", ``, []string{"a"}, "", `asynqmutex: task "payment:capture": field "a" not readable: payload is empty, not a JSON object`},
		{"blank", " \n", []string{"a"}, "", `asynqmutex: task "payment:capture": field "a" not readable: payload is empty, not a JSON object`},
		{"array", `[{"a":1}]`, []string{"a"}, "", `asynqmutex: task "payment:capture": field "a" not readable: payload is an array, not a JSON object`},
		{"string", `"a"`, []string{"a"}, "", `asynqmutex: task "payment:capture": field "a" not readable: payload is a string, not a JSON object`},
		{"number", ` 1 `, []string{"a"}, "", `asynqmutex: task "payment:capture": field "a" not readable: payload is a number, not a JSON object`},
		{"null", `null`, []string{"a"}, "", `asynqmutex: task "payment:capture": field "a" not readable: payload is null, not a JSON object`},
		{"missing", `{"b":1}`, []string{"a"}, "a", `asynqmutex: task "payment:capture": field "a" missing from payload`},
		{"missing nested", `{"customer":{"name":"x"}}`, []string{"customer.id"}, "customer.id", `asynqmutex: task "payment:capture": field "customer.id" missing from payload`},
		{"missing parent", `{"b":1}`, []string{"customer.id"}, "customer.id", `asynqmutex: task "payment:capture": field "customer.id" missing from payload`},
		{"first failing field", `{"a":1}`, []string{"a", "b", "c"}, "b", `asynqmutex: task "payment:capture": field "b" missing from payload`},
		{"missing with shared prefix", `{"c":{"id":1}}`, []string{"c.id", "c.region"}, "c.region", `asynqmutex: task "payment:capture": field "c.region" missing from payload`},
		{"through string", `{"customer":"c-42"}`, []string{"customer.id"}, "customer.id", `asynqmutex: task "payment:capture": field "customer.id": "customer" is a string, not an object`},
		{"through null", `{"customer":null}`, []string{"customer.id"}, "customer.id", `asynqmutex: task "payment:capture": field "customer.id": "customer" is null, not an object`},
		{"through array", `{"customer":[{"id":1}]}`, []string{"customer.id"}, "customer.id", `asynqmutex: task "payment:capture": field "customer.id": "customer" is an array, not an object`},
		{"through number", `{"a":{"b":5}}`, []string{"a.b.c"}, "a.b.c", `asynqmutex: task "payment:capture": field "a.b.c": "a.b" is a number, not an object`},
		{"through bool", `{"a":{"b":true,"x":1}}`, []string{"a.x", "a.b.c"}, "a.b.c", `asynqmutex: task "payment:capture": field "a.b.c": "a.b" is a boolean, not an object`},
		{"object", `{"o":{"b":1}}`, []string{"o"}, "o", `asynqmutex: task "payment:capture": field "o" is an object; ` + scalarOnly},
		{"array", `{"o":[1]}`, []string{"o"}, "o", `asynqmutex: task "payment:capture": field "o" is an array; ` + scalarOnly},
		{"nested array", `{"a":{"o":[]}}`, []string{"a.o"}, "a.o", `asynqmutex: task "payment:capture": field "a.o" is an array; ` + scalarOnly},
		{"invalid UTF-8", "{\"a\":\"x\xff\"}", []string{"a"}, "a", `asynqmutex: task "payment:capture": field "a" is a string that is not valid UTF-8; On takes UTF-8 strings (derive other keys with KeyBy)`},
		{"invalid UTF-8 with escape", "{\"a\":\"\\n\xff\"}", []string{"a"}, "a", `asynqmutex: task "payment:capture": field "a" is a string that is not valid UTF-8; On takes UTF-8 strings (derive other keys with KeyBy)`},
		{"lone surrogate", `{"a":"\ud800"}`, []string{"a"}, "a", `asynqmutex: task "payment:capture": field "a" ` + loneMsg},
		{"lone low surrogate", `{"a":"x\uDC01y"}`, []string{"a"}, "a", `asynqmutex: task "payment:capture": field "a" ` + loneMsg},
		{"surrogate then escape", `{"a":"\ud800\u0041"}`, []string{"a"}, "a", `asynqmutex: task "payment:capture": field "a" ` + loneMsg},
		{"surrogate then char", `{"a":"\ud800A"}`, []string{"a"}, "a", `asynqmutex: task "payment:capture": field "a" ` + loneMsg},
		{"two high surrogates", `{"a":"\ud800\ud800\udc00"}`, []string{"a"}, "a", `asynqmutex: task "payment:capture": field "a" ` + loneMsg},
		{"surrogate at end", `{"a":"\ud83d\ude00\ud83d"}`, []string{"a"}, "a", `asynqmutex: task "payment:capture": field "a" ` + loneMsg},
		{"encoded surrogate", "{\"a\":\"\xed\xa0\x80\"}", []string{"a"}, "a", `asynqmutex: task "payment:capture": field "a" is a string that is not valid UTF-8; On takes UTF-8 strings (derive other keys with KeyBy)`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got, err := keyOf(typ, []byte(tt.payload), tt.fields...)
			if err == nil || err.Error() != tt.want {
				t.Fatalf("key(%q, %q) = %q, %v, want error %q", tt.payload, tt.fields, got, err, tt.want)
			}
			var ke *keyError
			if !errors.As(err, &ke) || ke.taskType != typ || ke.field != tt.field {
				t.Errorf("key(%q, %q) error = %#v, want *keyError with task type %q, field %q", tt.payload, tt.fields, err, typ, tt.field)
			}
		})
	}
}

func TestFieldsKeyErrorUnwraps(t *testing.T) {
	t.Parallel()
	_, err := keyOf("t", []byte(`{"a"}`), "a")
	var se *json.SyntaxError
	if !errors.As(err, &se) {
		t.Errorf("key(bad JSON) error = %v, want it to wrap a *json.SyntaxError", err)
	}
}

// TestFieldsKeyErrorHidesPayload checks that no error quotes the payload,
// which may be large or secret.
func TestFieldsKeyErrorHidesPayload(t *testing.T) {
	t.Parallel()
	const secret = "hunter2-s3cr3t"
	big := strings.Repeat("x", 1<<20)
	payloads := []string{
		`{"password":"` + secret + `"}`,
		`{"password":"` + secret + `" oops}`,
		`{"password":"` + secret + `","customer":"` + secret + `"}`,
		`["` + secret + `"]`,
		`"` + secret + `"`,
		`{"password":"` + secret + "\x01" + `"}`,
		`{"` + big + `":1}`,
		`{"a":"` + big + `"`,
	}
	for _, p := range payloads {
		_, err := keyOf("t", []byte(p), "customer.id")
		if err == nil {
			t.Fatalf("key(%.40q) = nil error, want an error", p)
		}
		if msg := err.Error(); strings.Contains(msg, secret) || len(msg) > 200 {
			t.Errorf("key(%.40q) error = %.300q, want no payload in it", p, msg)
		}
	}
}

func TestValidateFields(t *testing.T) {
	t.Parallel()
	tests := []struct {
		fn     string
		fields []string
		want   string // the panic; "" for none
	}{
		{"asynqmutex.On", []string{"a", "customer.id", " ", "a b.c-d"}, ""},
		{"asynqmutex.On", nil, ""},
		{"asynqmutex.On", []string{""}, "asynqmutex.On: empty field name"},
		{"asynqmutex.On", []string{"a", ""}, "asynqmutex.On: empty field name"},
		{"asynqmutex.On", []string{"a..b"}, `asynqmutex.On: field "a..b" has an empty path segment`},
		{"asynqmutex.On", []string{".a"}, `asynqmutex.On: field ".a" has an empty path segment`},
		{"asynqmutex.Other", []string{"a."}, `asynqmutex.Other: field "a." has an empty path segment`},
		{"asynqmutex.On", []string{"."}, `asynqmutex.On: field "." has an empty path segment`},
	}
	for _, tt := range tests {
		t.Run(fmt.Sprint(tt.fn, tt.fields), func(t *testing.T) {
			t.Parallel()
			got := func() (msg string) {
				defer func() {
					if r := recover(); r != nil {
						msg = fmt.Sprint(r)
					}
				}()
				validateFields(tt.fn, tt.fields)
				return ""
			}()
			if got != tt.want {
				t.Errorf("validateFields(%q, %q) panics with %q, want %q", tt.fn, tt.fields, got, tt.want)
			}
		})
	}
}

// decodeKey reads a key back as encoding/json reads it: an array of the task
// type and the field values, numbers as written.
func decodeKey(t testing.TB, k string) []any {
	t.Helper()
	d := json.NewDecoder(strings.NewReader(k))
	d.UseNumber()
	var got []any
	if err := d.Decode(&got); err != nil || d.More() {
		t.Fatalf("key %q is not a JSON array: %v", k, err)
	}
	return got
}

// TestKeyDecodesToValues pins the promise that makes keys injective: a key
// reads back, with encoding/json, as exactly the task type and the field values.
func TestKeyDecodesToValues(t *testing.T) {
	t.Parallel()
	values := []string{
		`"plain"`, `"\u0041\u00e9\ud83d\ude00"`, `"<a href=\"x\">&amp;</a>"`, `"\u2028\u2029\u007f\u0000\u001f"`,
		`"\b\f\n\r\t\/\\"`, `"\ufffd"`, `"é😀"`, `-0.5e-7`, `0`, `1.0`, `12345678901234567890`, `true`, `false`, `null`,
	}
	for _, v := range values {
		k, err := keyOf("t<\n", []byte(`{"v":`+v+`}`), "v")
		if err != nil {
			t.Errorf("key(%s) = %v", v, err)
			continue
		}
		got := decodeKey(t, k)
		want := decodeKey(t, `["t<\n",`+v+`]`)
		if fmt.Sprint(got) != fmt.Sprint(want) || fmt.Sprintf("%T", got[1]) != fmt.Sprintf("%T", want[1]) {
			t.Errorf("key(%s) = %q, reads back as %#v, want %#v", v, k, got, want)
		}
	}
}

// TestFieldsKeyAllocs checks that deriving a key costs at most 3 times the
// payload's size in allocated bytes, for payloads of several MB: the value
// itself as big as the payload, with and without escapes, and a payload whose
// size is in a million small members the key does not use. It measures
// allocated bytes, not time.
func TestFieldsKeyAllocs(t *testing.T) {
	for _, p := range bigPayloads() {
		t.Run(p.name, func(t *testing.T) {
			task := asynq.NewTask("payment:capture", p.payload)
			kf := fieldsKey(p.fields)
			if _, err := kf(context.Background(), task); err != nil {
				t.Fatal(err)
			}
			ratio := allocRatio(func() { _, _ = kf(context.Background(), task) }, len(p.payload))
			if ratio > 3 {
				t.Errorf("key of a %d-byte payload allocated %.2f times its size, want at most 3", len(p.payload), ratio)
			}
			t.Logf("%.2f bytes allocated per payload byte", ratio)
		})
	}
}

// allocRatio returns the bytes f allocates, averaged over a few runs, per byte
// of size.
func allocRatio(f func(), size int) float64 {
	const runs = 3
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	for range runs {
		f()
	}
	runtime.ReadMemStats(&after)
	return float64(after.TotalAlloc-before.TotalAlloc) / runs / float64(size)
}

type bigPayload struct {
	name    string
	payload []byte
	fields  []string
}

// bigPayloads are 9 MB payloads, each hard in its own way.
func bigPayloads() []bigPayload {
	const size = 9 << 20
	plain := strings.Repeat("x", size)
	escaped := strings.Repeat(`\u00e9\n<`, size/9)
	var members strings.Builder
	members.WriteString(`{"o":{`)
	for i := 0; members.Len() < size; i++ {
		fmt.Fprintf(&members, `"k%d":"v",`, i)
	}
	members.WriteString(`"id":7},"id":"c-42"}`)
	return []bigPayload{
		{"plain string", []byte(`{"id":"` + plain + `","n":1}`), []string{"id", "n"}},
		{"escaped string", []byte(`{"id":"` + escaped + `"}`), []string{"id"}},
		{"many members", []byte(members.String()), []string{"o.id", "id"}},
		{"deep", []byte(`{"a":` + strings.Repeat(`[{"b":`, 4000) + `"` + plain + `"` + strings.Repeat(`}]`, 4000) + `,"id":1}`), []string{"id"}},
	}
}

func FuzzFieldsKeyInjective(f *testing.F) {
	f.Add("t", "x:y", "z", "t", "x", "y:z")
	f.Add("t", "x", "y", "t", "x", "y")
	f.Add("t", `x","y`, "z", "t", "x", `y","z`)
	f.Add("t", "{a}", "}", "t", "{a", "}}")
	f.Add("t", "\\u0041", "", "t", "A", "")
	f.Add("t", "A", "", "t", "A", "")
	f.Add("t", "\xff", "", "t", "\xfe", "")
	f.Add("t", "\xff", "", "t", "\ufffd", "")
	f.Add("t", "\xed\xa0\x80", "", "t", "\ufffd", "")
	f.Add("t\xff", "a", "b", "t\xfe", "a", "b")
	f.Add(`t","a`, "b", "c", "t", "a", "b")
	f.Add("t", "<&>\u2028", "😀", "t", "<&>\u2028", "😀")
	f.Add("t", "\n", "\x01", "t", `\n`, `\u0001`)
	f.Fuzz(func(t *testing.T, typ1, a1, b1, typ2, a2, b2 string) {
		fields := []string{"a", "b"}
		// key derives the key of a payload with the values a and b, written
		// with every character escaped when escape is set, or returns false
		// when the key is refused: only for values that are not UTF-8.
		key := func(typ, a, b string, escape bool) (string, bool) {
			t.Helper()
			var p []byte
			if escape {
				p = []byte(`{"b":` + escapeAll(b) + `,"a":` + escapeAll(a) + `}`)
			} else {
				p, _ = json.Marshal(map[string]string{"a": a, "b": b}) // not UTF-8 becomes U+FFFD
			}
			k, err := keyOf(typ, p, fields...)
			if err != nil {
				if utf8.ValidString(a) && utf8.ValidString(b) {
					t.Fatalf("key(%q, %q) = %v", typ, p, err)
				}
				return "", false
			}
			if utf8.ValidString(typ) {
				got := decodeKey(t, k)
				var v struct{ A, B string }
				_ = json.Unmarshal(p, &v)
				if len(got) != 3 || got[0] != typ || got[1] != v.A || got[2] != v.B {
					t.Errorf("key %q of %q reads back as %q, want [%q %q %q]", k, p, got, typ, v.A, v.B)
				}
			}
			return k, true
		}
		same := typ1 == typ2 && a1 == a2 && b1 == b2
		for _, e := range []bool{false, true} {
			k1, ok1 := key(typ1, a1, b1, e)
			k2, ok2 := key(typ2, a2, b2, e)
			if ok1 && ok2 && utf8.ValidString(a1+b1+a2+b2) && (k1 == k2) != same {
				t.Errorf("escaped %v: key(%q, %q, %q) = %q, key(%q, %q, %q) = %q, want equal %v", e, typ1, a1, b1, k1, typ2, a2, b2, k2, same)
			}
		}
		if k1, ok := key(typ1, a1, b1, false); ok {
			if k2, ok := key(typ1, a1, b1, true); ok && k1 != k2 {
				t.Errorf("key(%q, %q, %q) = %q written plainly, %q escaped, want equal", typ1, a1, b1, k1, k2)
			}
		}
		// Raw bytes that are not UTF-8 are refused, never read as U+FFFD.
		if rawOK(a1) && rawOK(b1) && !utf8.ValidString(a1+b1) {
			p := []byte(`{"a":"` + a1 + `","b":"` + b1 + `"}`)
			if k, err := keyOf(typ1, p, fields...); err == nil {
				t.Errorf("key(%q, %q) = %q, want an error: the values are not UTF-8", typ1, p, k)
			}
		}
	})
}

// escapeAll writes s as a JSON string with every character escaped.
func escapeAll(s string) string {
	var b strings.Builder
	b.WriteByte('"')
	for _, r := range s { // a byte that is not UTF-8 reads as U+FFFD, as json.Marshal writes it
		if r > 0xFFFF {
			r -= 0x10000
			fmt.Fprintf(&b, `\u%04X\u%04x`, 0xD800+(r>>10), 0xDC00+(r&0x3FF))
			continue
		}
		fmt.Fprintf(&b, `\u%04x`, r)
	}
	b.WriteByte('"')
	return b.String()
}

// rawOK reports whether s can be put between quotes in JSON text as it is.
func rawOK(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 || s[i] == '"' || s[i] == '\\' {
			return false
		}
	}
	return true
}

func FuzzFieldsKeyNoPanic(f *testing.F) {
	f.Add([]byte(`{"a":"x:y","b":"z"}`), "a")
	f.Add([]byte(`{"customer":{"id":12345678901234567890,"region":"eu"}}`), "customer.id")
	f.Add([]byte(`{"customer":"c"}`), "customer.id")
	f.Add([]byte(`{"a":"\u0041","o":{"b":[1,{"c":null}],"a":true}}`), "o.a")
	f.Add([]byte(`{"a":"\ud800\udc00\udc00\ud800"}`), "a")
	f.Add([]byte("{\"a\":\"\xed\xa0\x80\xff\"}"), "a")
	f.Add([]byte(`{"a":{"\ud800":1,"\udbff":2}}`), "a.\ufffd")
	f.Add([]byte(`{"x":[{"a":"}"}],"a":{"b":"]"}}`), "a.b")
	f.Add([]byte(`[1]`), "a")
	f.Add([]byte(`null`), "a")
	f.Add([]byte(``), "a")
	f.Add([]byte(`{"a":1,"a":{"b":2}}`), "a.b")
	f.Fuzz(func(t *testing.T, payload []byte, field string) {
		defer func() {
			if r := recover(); r != nil && !strings.HasPrefix(fmt.Sprint(r), "asynqmutex.On: ") {
				t.Fatalf("panic: %v", r)
			}
		}()
		validateFields("asynqmutex.On", []string{field})
		fields := []string{field}
		k, err := keyOf("t", payload, fields...)
		k2, err2 := keyOf("t", payload, fields...)
		if k != k2 || fmt.Sprint(err) != fmt.Sprint(err2) {
			t.Fatalf("key(%q, %q) = %q, %v, then %q, %v, want the same", payload, field, k, err, k2, err2)
		}
		if _, err := keyOf("t", payload, field, "a", field+".x", "a.b"); err != nil && !errors.As(err, new(*keyError)) {
			t.Errorf("key(%q, several fields) error = %#v, want a *keyError", payload, err)
		}
		if err != nil {
			if !errors.As(err, new(*keyError)) {
				t.Errorf("key(%q, %q) error = %#v, want a *keyError", payload, field, err)
			}
			if len(err.Error()) > 250+10*len(field) {
				t.Errorf("key(%q, %q) error is %d bytes long, want it short", payload, field, len(err.Error()))
			}
			return
		}
		if !json.Valid(payload) {
			t.Fatalf("key(%q, %q) = %q, nil for invalid JSON", payload, field, k)
		}
		// Oracle: encoding/json finds the same value.
		d := json.NewDecoder(bytes.NewReader(payload))
		d.UseNumber()
		var v any
		if err := d.Decode(&v); err != nil {
			t.Fatalf("decoding %q: %v", payload, err)
		}
		for _, seg := range strings.Split(field, ".") {
			v = v.(map[string]any)[seg]
		}
		if got := decodeKey(t, k); len(got) != 2 || got[0] != "t" || got[1] != v {
			t.Errorf("key(%q, %q) = %q, reads back as %#v, want [t %#v] (encoding/json)", payload, field, k, got, v)
		}
	})
}

func BenchmarkFieldsKey(b *testing.B) {
	ctx := context.Background()
	cases := []bigPayload{
		{"one field", []byte(`{"customer_id":"c-42","amount":1250,"currency":"EUR"}`), []string{"customer_id"}},
		{"nested", []byte(`{"customer":{"id":12345678901234567890,"region":"eu"},"amount":1250}`), []string{"customer.id", "customer.region"}},
	}
	for _, p := range bigPayloads() {
		p.name = "9MB " + p.name
		cases = append(cases, p)
	}
	for _, bb := range cases {
		b.Run(bb.name, func(b *testing.B) {
			task := asynq.NewTask("payment:capture", bb.payload)
			kf := fieldsKey(bb.fields)
			b.ReportAllocs()
			b.SetBytes(int64(len(bb.payload)))
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			for b.Loop() {
				if _, err := kf(ctx, task); err != nil {
					b.Fatal(err)
				}
			}
			runtime.ReadMemStats(&after)
			b.ReportMetric(float64(after.TotalAlloc-before.TotalAlloc)/float64(b.N)/float64(len(bb.payload)), "alloc/payload-byte")
		})
	}
}

func TestKeyMatchesOn(t *testing.T) {
	want, err := keyOf("pay", []byte(`{"id":"c-42","n":1.0,"ok":true,"none":null,"esc":"\u0041\n"}`), "id", "n", "ok", "none", "esc")
	if err != nil {
		t.Fatal(err)
	}
	if got, err := Key("pay", `"c-42"`, `1.0`, `true`, `null`, `"\u0041\n"`); err != nil || got != want {
		t.Errorf("Key = %q, %v; On derives %q", got, err, want)
	}
	if got, err := Key("pay"); err != nil || got != `["pay"]` {
		t.Errorf("Key without values = %q, %v", got, err)
	}
	for v, msg := range map[string]string{
		`c-42`:     `value 1 ("c-42") is not JSON text; write a string with its quotes`,
		`{"a":1}`:  "value 1 is an object",
		`"\ud800"`: "value 1 is a string with an unpaired surrogate",
	} {
		if _, err := Key("pay", v); err == nil || !strings.Contains(err.Error(), msg) {
			t.Errorf("Key(%q): error %v, want one containing %q", v, err, msg)
		}
	}
}
