// Package shortkey shows lock keys and task types in error texts and logs: whole
// up to Max bytes, longer ones cut with a digest, so that an error's size does not
// grow with a payload and payload values are not repeated at length in logs.
package shortkey

import (
	"crypto/sha256"
	"encoding/hex"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Max is the length up to which a key or task type is shown whole.
const Max = 100

// Shorten returns s whole up to Max bytes; longer, its first 64 bytes (cut at a
// character boundary), "…sha256:" and the first 12 hex digits of its SHA-256, so
// that long keys stay told apart.
func Shorten(s string) string {
	if len(s) <= Max {
		return s
	}
	sum := sha256.Sum256([]byte(s))
	cut := 64
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "…sha256:" + hex.EncodeToString(sum[:6])
}

// Quote is Shorten(s) quoted as a Go string.
func Quote(s string) string { return strconv.Quote(Shorten(s)) }

// Show is Shorten(s) as it is when it holds only printable characters (as keys
// built from payload fields do), quoted otherwise.
func Show(s string) string {
	short := Shorten(s)
	for _, r := range short {
		if r == utf8.RuneError || !unicode.IsPrint(r) {
			return strconv.Quote(short)
		}
	}
	return short
}

// Field makes s fit a holder's description, a log field or a metric label: valid
// UTF-8 (other bytes become U+FFFD), no tab or line break (they become spaces), at
// most Max bytes (longer, shortened as Shorten does).
func Field(s string) string {
	c := strings.Map(func(r rune) rune {
		if r == '\t' || r == '\n' || r == '\r' {
			return ' '
		}
		return r
	}, Shorten(s))
	if len(c) > Max { // invalid bytes grew into three-byte U+FFFDs
		c = Shorten(c)
	}
	return c
}
