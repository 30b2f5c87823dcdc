// Package jsonscan reads scalar members out of valid JSON text without decoding the
// rest, and writes strings in their canonical form (RFC 8785): what the middleware's
// keys are made of. Every function expects text encoding/json has found valid; none
// allocates beyond what it returns.
package jsonscan

import (
	"bytes"
	"encoding/json"
	"errors"
	"strings"
	"unicode/utf8"
)

// Member returns the JSON text of the value of the last member called name in
// obj, the text of a valid JSON object.
func Member(obj []byte, name string) (val []byte, ok bool) {
	i := 1 // after '{'
	for {
		i = skipSpaceAt(obj, i)
		if obj[i] == '}' {
			return val, ok
		}
		end := endOfValue(obj, i)
		key := obj[i:end]
		i = skipSpaceAt(obj, end) + 1 // after ':'
		i = skipSpaceAt(obj, i)
		end = endOfValue(obj, i)
		if keyIs(key, name) {
			val, ok = obj[i:end], true
		}
		i = skipSpaceAt(obj, end)
		if obj[i] == '}' {
			return val, ok
		}
		i++ // after ','
	}
}

// keyIs reports whether the JSON string text key names name.
func keyIs(key []byte, name string) bool {
	raw := key[1 : len(key)-1]
	if bytes.IndexByte(raw, '\\') < 0 {
		return string(raw) == name
	}
	var s string
	return json.Unmarshal(key, &s) == nil && s == name
}

// endOfValue returns the index just after the JSON value that starts at
// data[i], in valid JSON text. It walks nested values without recursion, so
// its cost is linear however deep they go.
func endOfValue(data []byte, i int) int {
	depth := 0
	for ; i < len(data); i++ {
		switch data[i] {
		case '"':
			for i++; data[i] != '"'; i++ {
				if data[i] == '\\' {
					i++
				}
			}
			if depth == 0 {
				return i + 1
			}
		case '{', '[':
			depth++
		case '}', ']':
			if depth == 0 {
				return i // the end of the object or array around a number or literal
			}
			depth--
			if depth == 0 {
				return i + 1
			}
		case ',', ' ', '\t', '\r', '\n':
			if depth == 0 {
				return i
			}
		}
	}
	return i
}

// skipSpaceAt is the index of the first byte at or after i in data that is not JSON
// white space.
func skipSpaceAt(data []byte, i int) int {
	for i < len(data) && (data[i] == ' ' || data[i] == '\t' || data[i] == '\n' || data[i] == '\r') {
		i++
	}
	return i
}

// SkipSpace is data without the JSON white space it starts with.
func SkipSpace(data []byte) []byte { return data[skipSpaceAt(data, 0):] }

// KindOf names the kind of the valid JSON value data starts with.
func KindOf(data []byte) string {
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

// DescribeKind gives kind with its article: "a string", "an array", "null".
func DescribeKind(kind string) string {
	switch kind {
	case "null":
		return kind
	case "array", "object", "empty value":
		return "an " + kind
	}
	return "a " + kind
}

// WriteCanonical writes the canonical text of tok, the text of a JSON string in
// valid JSON, as RFC 8785 writes it (see WriteString), or returns ErrNotUTF8 or
// ErrLoneSurrogate and writes nothing: such a string has no text of its own, since
// encoding/json would read it as U+FFFD, as it does a real U+FFFD.
func WriteCanonical(b *strings.Builder, tok []byte) error {
	if !utf8.Valid(tok) {
		return ErrNotUTF8
	}
	raw := tok[1 : len(tok)-1]
	if bytes.IndexByte(raw, '\\') < 0 {
		b.Write(tok) // no escapes, and JSON allows no control characters: canonical as it is
		return nil
	}
	if loneSurrogate(raw) {
		return ErrLoneSurrogate
	}
	var s string
	if err := json.Unmarshal(tok, &s); err != nil {
		return err // cannot happen: tok is valid JSON
	}
	WriteString(b, s)
	return nil
}

// The strings WriteCanonical refuses.
var (
	ErrNotUTF8       = errors.New("a string that is not valid UTF-8")
	ErrLoneSurrogate = errors.New(`a string with an unpaired surrogate escape such as \ud800`)
)

// loneSurrogate reports whether the text between a JSON string's quotes holds a
// \u escape of a UTF-16 surrogate that is not part of a pair.
func loneSurrogate(raw []byte) bool {
	high := false // the previous escape was a high surrogate
	for i := 0; i < len(raw); i++ {
		if raw[i] != '\\' {
			if high {
				return true
			}
			continue
		}
		i++
		if raw[i] != 'u' {
			if high {
				return true
			}
			continue
		}
		var r rune
		for _, c := range raw[i+1 : i+5] { // valid JSON: four hex digits
			r <<= 4
			switch {
			case c <= '9':
				r |= rune(c - '0')
			default:
				r |= rune((c|0x20)-'a') + 10
			}
		}
		i += 4
		switch {
		case r >= 0xD800 && r < 0xDC00:
			if high {
				return true
			}
			high = true
		case r >= 0xDC00 && r < 0xE000:
			if !high {
				return true
			}
			high = false
		default:
			if high {
				return true
			}
		}
	}
	return high
}

const hexDigits = "0123456789abcdef"

// WriteString writes s as a JSON string the way RFC 8785 does: '"' and '\\'
// escaped with a backslash, control characters as \b, \t, \n, \f, \r or
// \u00xx, everything else as it is, including bytes that are not UTF-8. Every
// escape decodes to the byte it replaced, so distinct strings give distinct
// texts.
func WriteString(b *strings.Builder, s string) {
	b.WriteByte('"')
	start := 0
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c >= 0x20 && c != '"' && c != '\\' {
			continue
		}
		b.WriteString(s[start:i])
		switch c {
		case '"', '\\':
			b.WriteByte('\\')
			b.WriteByte(c)
		case '\b':
			b.WriteString(`\b`)
		case '\f':
			b.WriteString(`\f`)
		case '\n':
			b.WriteString(`\n`)
		case '\r':
			b.WriteString(`\r`)
		case '\t':
			b.WriteString(`\t`)
		default:
			b.WriteString(`\u00`)
			b.WriteByte(hexDigits[c>>4])
			b.WriteByte(hexDigits[c&0xF])
		}
		start = i + 1
	}
	b.WriteString(s[start:])
	b.WriteByte('"')
}
