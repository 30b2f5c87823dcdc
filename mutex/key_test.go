package mutex

import (
	"crypto/sha256"
	"encoding/hex"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestEncodeKey(t *testing.T) {
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
			if got := encodeKey(tt.key); got != tt.want {
				t.Errorf("encodeKey(%q) = %q, want %q", tt.key, got, tt.want)
			}
		})
	}
}

func TestEncodeKeyBoundedAndBraceFree(t *testing.T) {
	keys := []string{
		strings.Repeat("{", 1000),
		strings.Repeat("}{%#", 5000),
		strings.Repeat("a", 62) + "{" + strings.Repeat("b", 300),
		"\xff\xfe{}" + strings.Repeat("\x00", 1<<20),
	}
	seen := map[string]string{}
	for _, k := range keys {
		e := encodeKey(k)
		assert.LessOrEqual(t, len(e), keepOfLong+1+64)
		assert.False(t, strings.ContainsAny(e, "{}"), "encodeKey(%.20q) = %.80q has a brace", k, e)
		if prev, ok := seen[e]; ok {
			t.Errorf("encodeKey(%.20q) = encodeKey(%.20q)", k, prev)
		}
		seen[e] = k
	}
	// Escaped and digested forms cannot meet: only a digest has a raw '#'.
	assert.NotEqual(t, encodeKey(encodeKey(keys[1])), encodeKey(keys[1]))
}

func FuzzEncodeKey(f *testing.F) {
	f.Add("a", "b")
	f.Add("a{b", "a%7Bb")
	f.Add(strings.Repeat("x", 300), strings.Repeat("x", 64)+"#")
	f.Fuzz(func(t *testing.T, a, b string) {
		ea, eb := encodeKey(a), encodeKey(b)
		if (ea == eb) != (a == b) {
			t.Fatalf("encodeKey(%q) = %q, encodeKey(%q) = %q", a, ea, b, eb)
		}
		if strings.ContainsAny(ea, "{}") || len(ea) > maxKeyLen+64 {
			t.Fatalf("encodeKey(%q) = %q: brace or too long", a, ea)
		}
		if a == "" {
			return
		}
		// Every key of one lock hashes by the same tag, so one Cluster slot.
		c := &Client{prefix: DefaultPrefix}
		rkey := c.redisKey(a)
		for _, k := range []string{rkey, rkey + waitSuffix} {
			if tag := hashTag(k); tag != ea {
				t.Fatalf("hash tag of %q = %q, want %q", k, tag, ea)
			}
		}
	})
}

func sha256hex(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:])
}

// hashTag is the part of a key Redis Cluster hashes: the text between the first '{'
// and the next '}' when that is not empty, else the whole key.
func hashTag(key string) string {
	i := strings.IndexByte(key, '{')
	if i < 0 {
		return key
	}
	j := strings.IndexByte(key[i+1:], '}')
	if j <= 0 {
		return key
	}
	return key[i+1 : i+1+j]
}
