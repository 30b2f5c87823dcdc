package rediskey

import (
	"crypto/sha256"
	"encoding/hex"
	"strings"
	"testing"
)

func TestEncode(t *testing.T) {
	long := strings.Repeat("x", 300)
	tests := []struct{ key, want string }{
		{"payment", "payment"},
		{`["pay","txn_1"]`, `["pay","txn_1"]`},
		{"a{b}c", "a%7Bb%7Dc"},
		{"50%", "50%25"},
		{"#1", "%231"},
		{long, strings.Repeat("x", 64) + "#" + sha256hex(long)},
	}
	for _, tt := range tests {
		t.Run(tt.key[:min(len(tt.key), 20)], func(t *testing.T) {
			got := Encode(tt.key)
			if got != tt.want {
				t.Errorf("Encode(%q) = %q, want %q", tt.key, got, tt.want)
			}
			key, digested := Decode(got)
			if want := tt.key; len(tt.want) > MaxLen+64 || digested {
				want = tt.key[:KeepOfLong]
				if !digested {
					t.Errorf("Decode(%q) not digested", got)
				}
				if key != want {
					t.Errorf("Decode(%q) = %q, want %q", got, key, want)
				}
			} else if key != want {
				t.Errorf("Decode(%q) = %q, want %q", got, key, want)
			}
		})
	}
}

func TestEncodeBoundedAndBraceFree(t *testing.T) {
	keys := []string{
		strings.Repeat("{", 1000),
		strings.Repeat("}{%#", 5000),
		strings.Repeat("a", 62) + "{" + strings.Repeat("b", 300),
		"\xff\xfe{}" + strings.Repeat("\x00", 1<<20),
	}
	seen := map[string]string{}
	for _, k := range keys {
		e := Encode(k)
		if len(e) > KeepOfLong+1+64 {
			t.Errorf("len(Encode(%.20q)) = %d, want at most %d", k, len(e), KeepOfLong+1+64)
		}
		if strings.ContainsAny(e, "{}") {
			t.Errorf("Encode(%.20q) = %.80q has a brace", k, e)
		}
		if prev, ok := seen[e]; ok {
			t.Errorf("Encode(%.20q) = Encode(%.20q)", k, prev)
		}
		seen[e] = k
	}
	// Escaped and digested forms cannot meet: only a digest has a raw '#'.
	if Encode(Encode(keys[1])) == Encode(keys[1]) {
		t.Error("an escaped digest encodes to itself")
	}
}

func FuzzEncode(f *testing.F) {
	f.Add("a", "b")
	f.Add("a{b", "a%7Bb")
	f.Add(strings.Repeat("x", 300), strings.Repeat("x", 64)+"#")
	f.Fuzz(func(t *testing.T, a, b string) {
		ea, eb := Encode(a), Encode(b)
		if (ea == eb) != (a == b) {
			t.Fatalf("Encode(%q) = %q, Encode(%q) = %q", a, ea, b, eb)
		}
		if strings.ContainsAny(ea, "{}") || len(ea) > MaxLen+64 {
			t.Fatalf("Encode(%q) = %q: brace or too long", a, ea)
		}
		if key, digested := Decode(ea); !digested && key != a {
			t.Fatalf("Decode(Encode(%q)) = %q", a, key)
		}
	})
}

func sha256hex(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:])
}

func TestCheckPrefix(t *testing.T) {
	CheckPrefix("x.Prefix", "app:locks:") // no panic
	for _, p := range []string{"a{b", "a}b", "{}"} {
		func() {
			defer func() {
				want := "x.Prefix: prefix \"" + p + "\" must not contain '{' or '}'"
				if r := recover(); r != want {
					t.Errorf("CheckPrefix(%q) panicked with %v, want %q", p, r, want)
				}
			}()
			CheckPrefix("x.Prefix", p)
		}()
	}
}
