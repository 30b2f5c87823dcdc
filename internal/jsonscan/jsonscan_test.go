package jsonscan

import (
	"errors"
	"strings"
	"testing"
)

func TestMember(t *testing.T) {
	tests := []struct {
		obj, name, want string
		ok              bool
	}{
		{`{"a":1}`, "a", `1`, true},
		{`{ "a" : "x" , "b" : [1,{"a":2}] }`, "b", `[1,{"a":2}]`, true},
		{`{"a":1,"a":2}`, "a", `2`, true}, // the last one wins, as in encoding/json
		{`{"\u0061":true}`, "a", `true`, true},
		{`{"b":{"a":1}}`, "a", ``, false},
		{`{}`, "a", ``, false},
	}
	for _, tt := range tests {
		got, ok := Member([]byte(tt.obj), tt.name)
		if string(got) != tt.want || ok != tt.ok {
			t.Errorf("Member(%s, %q) = %q, %v, want %q, %v", tt.obj, tt.name, got, ok, tt.want, tt.ok)
		}
	}
}

func TestWriteCanonical(t *testing.T) {
	tests := []struct {
		tok, want string
		err       error
	}{
		{`"plain"`, `"plain"`, nil},
		{`"\u0041\n\/"`, `"A\n/"`, nil},
		{`"\ud83d\ude00"`, "\"\U0001F600\"", nil},
		{`"\ud800"`, ``, ErrLoneSurrogate},
		{`"\udc00\ud800"`, ``, ErrLoneSurrogate},
		{"\"\xff\"", ``, ErrNotUTF8},
	}
	for _, tt := range tests {
		var b strings.Builder
		err := WriteCanonical(&b, []byte(tt.tok))
		if b.String() != tt.want || !errors.Is(err, tt.err) {
			t.Errorf("WriteCanonical(%s) = %q, %v, want %q, %v", tt.tok, b.String(), err, tt.want, tt.err)
		}
	}
}

func TestWriteString(t *testing.T) {
	var b strings.Builder
	WriteString(&b, "a\"\\\x01\xff")
	if got, want := b.String(), "\"a\\\"\\\\\\u0001\xff\""; got != want {
		t.Errorf("WriteString = %q, want %q", got, want)
	}
}
