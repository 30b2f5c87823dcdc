// Package rediskey is how asynqmutex's packages put a caller's key into a Redis key
// name: Encode maps every key to a distinct, brace-free string of bounded length, which
// each package places between "{" and "}" after its prefix, so that everything kept for
// one key shares a Redis Cluster hash slot; Decode reads the key back. Each package
// defines its own key names around it (mutex/layout.go, ratelimit/layout.go).
package rediskey

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strings"
)

const (
	// MaxLen is the longest Encode's result is without a digest: longer encoded keys
	// are digested.
	MaxLen = 256
	// KeepOfLong is the number of bytes of a digested key kept readable.
	KeepOfLong = 64
)

// Encode maps every key to a distinct brace-free string of bounded length: '%', '{',
// '}' and '#' are percent-escaped, and an escaped key longer than MaxLen is cut to
// KeepOfLong bytes followed by '#' and the hex SHA-256 of the whole key. Only digested
// keys contain a raw '#', so the two forms never meet.
func Encode(key string) string {
	esc := key
	if strings.ContainsAny(key, "%{}#") {
		var b strings.Builder
		b.Grow(len(key) + 16)
		for i := 0; i < len(key); i++ {
			switch ch := key[i]; ch {
			case '%', '{', '}', '#':
				b.WriteString(escapes[ch])
			default:
				b.WriteByte(ch)
			}
		}
		esc = b.String()
	}
	if len(esc) <= MaxLen {
		return esc
	}
	head := esc[:KeepOfLong]
	if i := strings.LastIndexByte(head[len(head)-2:], '%'); i >= 0 {
		head = head[:len(head)-2+i] // do not cut an escape in half
	}
	sum := sha256.Sum256([]byte(key))
	return head + "#" + hex.EncodeToString(sum[:])
}

var escapes = map[byte]string{'%': "%25", '{': "%7B", '}': "%7D", '#': "%23"}

// unescaper undoes escapes in one pass from left to right, so that an escaped '%' is
// never read as the start of another escape.
var unescaper = strings.NewReplacer("%25", "%", "%7B", "{", "%7D", "}", "%23", "#")

// Decode returns the key whose Encode is enc; digested reports that enc held only the
// first bytes of a long key, which is then all that key holds.
func Decode(enc string) (key string, digested bool) {
	if i := strings.IndexByte(enc, '#'); i >= 0 {
		enc, digested = enc[:i], true
	}
	return unescaper.Replace(enc), digested
}

// CheckPrefix panics, naming fn, if prefix p holds '{' or '}': a brace in it would
// move the keys after it out of the hash slot they share. It is the programmer's
// error a Prefix option refuses at construction.
func CheckPrefix(fn, p string) {
	if strings.ContainsAny(p, "{}") {
		panic(fmt.Sprintf("%s: prefix %q must not contain '{' or '}'", fn, p))
	}
}
