package asynqmutex

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/hibiken/asynq"
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
		{"leaf and prefix", "t", `{"a":{"b":1}}`, []string{"a", "a.b"}, `["t",{"b":1},1]`},
		{"same field twice", "t", `{"a":1}`, []string{"a", "a"}, `["t",1,1]`},
		{"whitespace", "t", " \n{ \"a\" :\t1 , \"b\" : [ 1 , { } ] }\r\n", []string{"a", "b"}, `["t",1,[1,{}]]`},
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
		{"solidus", "t", `{"a":"\/"}`, []string{"a"}, `["t","/"]`},
		{"non-ASCII escape", "t", `{"a":"\u00e9"}`, []string{"a"}, `["t","é"]`},
		{"surrogate pair", "t", `{"a":"\ud83d\ude00"}`, []string{"a"}, `["t","😀"]`},
		{"html", "t", `{"a":"<&>"}`, []string{"a"}, `["t","\u003c\u0026\u003e"]`},
		{"control", "t", `{"a":"\b\f\n\r\t\u0001\u001f"}`, []string{"a"}, `["t","\b\f\n\r\t\u0001\u001f"]`},
		{"line separator", "t", "{\"a\":\"\u2028\u2029\"}", []string{"a"}, `["t","\u2028\u2029"]`},
		{"quote and backslash", "t", `{"a":"\"\\"}`, []string{"a"}, `["t","\"\\"]`},
		{"braces", "t", `{"a":"{x}"}`, []string{"a"}, `["t","{x}"]`},
		{"lone surrogate", "t", `{"a":"\ud800"}`, []string{"a"}, `["t","\ud800"]`},
		{"lone low surrogate", "t", `{"a":"x\uDC01y"}`, []string{"a"}, `["t","x\udc01y"]`},
		{"surrogate then escape", "t", `{"a":"\ud800\u0041"}`, []string{"a"}, `["t","\ud800A"]`},
		{"invalid UTF-8", "t", "{\"a\":\"\xff\"}", []string{"a"}, "[\"t\",\"\xff\"]"},
		{"invalid UTF-8 with escape", "t", "{\"a\":\"\xff\\u0041\"}", []string{"a"}, "[\"t\",\"\xffA\"]"},
		{"object", "t", `{"o":{"b":1,"a":[1, "x"]}}`, []string{"o"}, `["t",{"a":[1,"x"],"b":1}]`},
		{"object keys escaped", "t", `{"o":{"\u0062":1,"a":2}}`, []string{"o"}, `["t",{"a":2,"b":1}]`},
		{"duplicate key", "t", `{"a":1,"a":2}`, []string{"a"}, `["t",2]`},
		{"nested duplicate key", "t", `{"o":{"k":1,"j":0,"k":2}}`, []string{"o"}, `["t",{"j":0,"k":2}]`},
		{"empty containers", "t", `{"o":{},"p":[],"q":""}`, []string{"o", "p", "q"}, `["t",{},[],""]`},
		{"type quoted", `a"b`, `{"a":"x"}`, []string{"a"}, `["a\"b","x"]`},
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
		{"key order", `{"o":{"a":1,"b":{"x":true,"y":null}}}`, `{"o":{"b":{"y":null,"x":true},"a":1}}`, []string{"o"}},
		{"top-level order", `{"a":1,"b":2}`, `{"b":2,"a":1}`, []string{"a", "b"}},
		{"other fields", `{"a":1,"b":2}`, `{"a":1,"b":3,"c":[]}`, []string{"a"}},
		{"escapes", `{"a":"Aé😀"}`, `{"a":"\u0041\u00E9\uD83D\uDE00"}`, []string{"a"}},
		{"escaped lone surrogate", `{"a":"\ud800"}`, `{"a":"\uD800"}`, []string{"a"}},
		{"escapes in nested keys", `{"o":{"é":1}}`, `{"o":{"\u00e9":1}}`, []string{"o"}},
		{"whitespace", `{"a":[1,2]}`, "{ \"a\" : [ 1 ,\n2 ] }", []string{"a"}},
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
		{"t", `{"a":[],"b":1}`},
		{"t", `{"a":{},"b":1}`},
		{"t", `{"a":"","b":1}`},
		{"t", `{"a":[1,2],"b":1}`},
		{"t", `{"a":[2,1],"b":1}`},
		{"t", `{"a":"\u0041","b":1}`},
		{"t", `{"a":"\ud800","b":1}`},
		{"t", `{"a":"\ud801","b":1}`},
		{"t", `{"a":"\ufffd","b":1}`},
		{"t", "{\"a\":\"\xff\",\"b\":1}"},
		{"t", "{\"a\":\"\xfe\",\"b\":1}"},
		{"t", "{\"a\":\"\xff\xfe\",\"b\":1}"},
		{"t", `{"a":"\\ud800","b":1}`},
		{"t", `{"a":{"k":"\ud800"},"b":1}`},
		{"t", `{"a":{"k":"\ufffd"},"b":1}`},
		{"t", "{\"a\":{\"k\":\"\xff\"},\"b\":1}"},
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
		want := string(appendString([]byte("["), typ)) + "]"
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

// TestCanonicalMatchesEncodingJSON pins the promise that, for payloads that
// encoding/json decodes without loss, a field's canonical text is what
// json.Marshal gives for it.
func TestCanonicalMatchesEncodingJSON(t *testing.T) {
	t.Parallel()
	values := []string{
		`"plain"`, `"\u0041\u00e9\ud83d\ude00"`, `"<a href=\"x\">&amp;</a>"`, `"\u2028\u2029\u007f\u0000\u001f"`,
		`"\b\f\n\r\t\/\\"`, `"\ufffd"`, `"é😀"`, `-0.5e-7`, `0`, `true`, `null`,
		`{"z":1,"a":{"y":[1,"x",{"b":null,"a":false}],"x":{}}, "é":2, "e":3, "\u00e9":4}`,
		`[ ]`, `[{}, [], "", 0]`,
	}
	for _, v := range values {
		got, err := keyOf("t", []byte(`{"v":`+v+`}`), "v")
		want := marshalKey(t, "t", v)
		if err != nil || got != want {
			t.Errorf("key(%s) = %q, %v, want %q (json.Marshal)", v, got, err, want)
		}
	}
}

// marshalKey is the key encoding/json would give for the JSON value v.
func marshalKey(t testing.TB, typ, v string) string {
	t.Helper()
	d := json.NewDecoder(strings.NewReader(v))
	d.UseNumber()
	var x any
	if err := d.Decode(&x); err != nil {
		t.Fatalf("decoding %q: %v", v, err)
	}
	b, err := json.Marshal([]any{typ, x})
	if err != nil {
		t.Fatalf("json.Marshal(%q): %v", v, err)
	}
	return string(b)
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
	f.Fuzz(func(t *testing.T, typ1, a1, b1, typ2, a2, b2 string) {
		type values struct{ A, B string }
		fields := []string{"a", "b"}
		// decoded is what encoding/json reads from the payload p.
		decoded := func(p []byte) values {
			var v struct {
				A string `json:"a"`
				B string `json:"b"`
			}
			if err := json.Unmarshal(p, &v); err != nil {
				t.Fatalf("payload %q: %v", p, err)
			}
			return values{v.A, v.B}
		}
		check := func(variant string, p1, p2 []byte, same bool) {
			t.Helper()
			k1, err1 := keyOf(typ1, p1, fields...)
			k2, err2 := keyOf(typ2, p2, fields...)
			if err1 != nil || err2 != nil {
				t.Fatalf("%s: key(%q, %q) = %v; key(%q, %q) = %v", variant, typ1, p1, err1, typ2, p2, err2)
			}
			if (k1 == k2) != same {
				t.Errorf("%s: key(%q, %q) = %q, key(%q, %q) = %q, want equal %v", variant, typ1, p1, k1, typ2, p2, k2, same)
			}
			if utf8.ValidString(typ1) && utf8.Valid(p1) {
				var got []string
				if err := json.Unmarshal([]byte(k1), &got); err != nil {
					t.Errorf("%s: key %q is valid UTF-8 but not a JSON array of strings: %v", variant, k1, err)
				} else if v := decoded(p1); len(got) != 3 || got[0] != typ1 || got[1] != v.A || got[2] != v.B {
					t.Errorf("%s: key %q decodes to %q, want [%q %q %q]", variant, k1, got, typ1, v.A, v.B)
				}
			}
		}

		// Payloads written by json.Marshal: invalid UTF-8 becomes U+FFFD.
		p1, _ := json.Marshal(map[string]string{"a": a1, "b": b1})
		p2, _ := json.Marshal(map[string]string{"a": a2, "b": b2})
		check("marshal", p1, p2, typ1 == typ2 && decoded(p1) == decoded(p2))

		// The same values with every character escaped.
		e1 := []byte(`{"b":` + escapeAll(b1) + `,"a":` + escapeAll(a1) + `}`)
		check("escaped", e1, p2, typ1 == typ2 && decoded(e1) == decoded(p2))

		// Raw bytes, which may not be UTF-8: they are the value.
		if rawOK(a1) && rawOK(b1) && rawOK(a2) && rawOK(b2) {
			r1 := []byte(`{"a":"` + a1 + `","b":"` + b1 + `"}`)
			r2 := []byte(`{"a":"` + a2 + `","b":"` + b2 + `"}`)
			check("raw", r1, r2, typ1 == typ2 && a1 == a2 && b1 == b2)
		}
	})
}

// hasSurrogateEscape reports whether a key may hold an unpaired surrogate
// escape, which encoding/json cannot give.
func hasSurrogateEscape(k string) bool {
	for i := 0; i+3 < len(k); i++ {
		if k[i] == '\\' && k[i+1] == 'u' && (k[i+2] == 'd' || k[i+2] == 'D') && strings.IndexByte("89abcdefABCDEF", k[i+3]) >= 0 {
			return true
		}
	}
	return false
}

func FuzzFieldsKeyNoPanic(f *testing.F) {
	f.Add([]byte(`{"a":"x:y","b":"z"}`), "a")
	f.Add([]byte(`{"customer":{"id":12345678901234567890,"region":"eu"}}`), "customer.id")
	f.Add([]byte(`{"customer":"c"}`), "customer.id")
	f.Add([]byte(`{"a":"\u0041","o":{"b":[1,{"c":null}],"a":true}}`), "o")
	f.Add([]byte(`{"a":"\ud800\udc00\udc00\ud800"}`), "a")
	f.Add([]byte("{\"a\":\"\xed\xa0\x80\xff\"}"), "a")
	f.Add([]byte(`{"a":{"\ud800":1,"\udbff":2}}`), "a")
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
			if len(err.Error()) > 200+10*len(field) {
				t.Errorf("key(%q, %q) error is %d bytes long, want it short", payload, field, len(err.Error()))
			}
			return
		}
		if !json.Valid(payload) {
			t.Fatalf("key(%q, %q) = %q, nil for invalid JSON", payload, field, k)
		}
		if !utf8.ValidString(k) || hasSurrogateEscape(k) {
			return // encoding/json would have lost something
		}
		// Oracle: encoding/json finds the same value and writes the same text.
		d := json.NewDecoder(bytes.NewReader(payload))
		d.UseNumber()
		var v any
		if err := d.Decode(&v); err != nil {
			t.Fatalf("decoding %q: %v", payload, err)
		}
		for _, seg := range strings.Split(field, ".") {
			v = v.(map[string]any)[seg]
		}
		want, err := json.Marshal([]any{"t", v})
		if err != nil {
			t.Fatalf("json.Marshal: %v", err)
		}
		if k != string(want) {
			t.Errorf("key(%q, %q) = %q, want %q (encoding/json)", payload, field, k, want)
		}
	})
}

func BenchmarkFieldsKey(b *testing.B) {
	ctx := context.Background()
	for _, bb := range []struct {
		name    string
		payload string
		fields  []string
	}{
		{"one field", `{"customer_id":"c-42","amount":1250,"currency":"EUR"}`, []string{"customer_id"}},
		{"nested", `{"customer":{"id":12345678901234567890,"region":"eu"},"amount":1250}`, []string{"customer.id", "customer.region"}},
	} {
		b.Run(bb.name, func(b *testing.B) {
			task := asynq.NewTask("payment:capture", []byte(bb.payload))
			kf := fieldsKey(bb.fields)
			b.ReportAllocs()
			for b.Loop() {
				if _, err := kf(ctx, task); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
