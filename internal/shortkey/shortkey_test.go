package shortkey

import (
	"strings"
	"testing"
)

func TestShorten(t *testing.T) {
	long := strings.Repeat("é", 80) // 160 bytes
	tests := []struct{ in, want string }{
		{"", ""},
		{`["pay","t1"]`, `["pay","t1"]`},
		{strings.Repeat("a", Max), strings.Repeat("a", Max)},
		{long, strings.Repeat("é", 32) + "…sha256:"},
		{strings.Repeat("a", 63) + long, strings.Repeat("a", 63) + "…sha256:"}, // cut before a character, not inside it
	}
	for _, tt := range tests {
		got := Shorten(tt.in)
		if len(tt.in) <= Max && got != tt.in || !strings.HasPrefix(got, tt.want) || len(got) > max(len(tt.in), 64+len("…sha256:")+12) {
			t.Errorf("Shorten(%.20q…) = %q, want %q + a 12-digit digest", tt.in, got, tt.want)
		}
	}
	if a, b := Shorten(strings.Repeat("a", 200)+"1"), Shorten(strings.Repeat("a", 200)+"2"); a == b {
		t.Errorf("Shorten gives %q for two different long keys, want the digest to tell them apart", a)
	}
	for in, want := range map[string]string{"a\nb": `"a\nb"`, "a\xffb": `"a\xffb"`, `["é"]`: `["é"]`} {
		if got := Show(in); got != want {
			t.Errorf("Show(%q) = %s, want %s", in, got, want)
		}
	}
	if got, want := Quote(`a"b`), `"a\"b"`; got != want {
		t.Errorf("Quote(%q) = %s, want %s", `a"b`, got, want)
	}
}
