package store

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strings"

	"github.com/redis/go-redis/v9"
)

// Script is a Lua script of a package, sent by a Runner: as a function of its library
// (NewLibrary) with FCALL where the server has Redis functions, and otherwise, or when
// it belongs to no library, with EVALSHA (EVAL when the server lacks it). name says
// which it is in errors and traces.
//
// Its source is a prelude, code it shares with other scripts (local constants and
// functions, defined in its parts), followed by its body, which reads KEYS and ARGV
// and returns the reply. EVAL runs the whole source on every call; a library runs the
// preludes of its scripts once, when the server loads it, and each call only a body.
type Script struct {
	name    string
	prelude []string
	body    string
	src     string
	s       *redis.Script
	flags   []Flag

	// Set once by NewLibrary, before any call.
	lib *Library
	fn  string // the function's name in lib
}

// NewScript returns the script named name whose source is parts joined by newlines:
// every part but the last is a prelude (see Script), the last its body. A part that
// several scripts of one library share must be the same string in each.
func NewScript(name string, parts ...string) *Script {
	if len(parts) == 0 {
		panic("store.NewScript: script " + name + " has no source")
	}
	src := strings.Join(parts, "\n")
	n := len(parts) - 1
	return &Script{name: name, prelude: parts[:n:n], body: parts[n], src: src, s: redis.NewScript(src)}
}

// Flag is a flag of a Redis function (see Script.Flag).
type Flag string

const (
	// NoWrites: the script writes nothing. Its function runs, as EVALSHA does, when
	// the server is out of memory (maxmemory reached, without eviction).
	NoWrites Flag = "no-writes"
	// AllowOOM: the script writes only with commands that Redis allows beyond
	// maxmemory (PEXPIRE, DEL), so that its function runs then as EVALSHA does. Redis
	// would let a function so flagged run any command beyond maxmemory: a script
	// that writes more must not have it.
	AllowOOM Flag = "allow-oom"
)

// Flag registers s's function with flags, and returns s. Without flags a function is
// refused once the server is out of memory, before it runs, where EVALSHA would run
// until its first write that is refused then. It panics after NewLibrary.
func (s *Script) Flag(flags ...Flag) *Script {
	if s.lib != nil {
		panic("store.Script.Flag: script " + s.name + " is in library " + s.lib.name + " already")
	}
	s.flags = append(s.flags, flags...)
	return s
}

// Hash returns the SHA-1 digest EVALSHA sends: what a test that watches commands
// looks for.
func (s *Script) Hash() string { return s.s.Hash() }

// Source returns the source EVAL sends.
func (s *Script) Source() string { return s.src }

// Function returns the name FCALL sends, "" for a script of no library.
func (s *Script) Function() string { return s.fn }

// Library is scripts sent as one Redis function library (Redis 7 and later): loaded
// once per server, with FUNCTION LOAD, which runs the preludes of its scripts once;
// each script is then a function that FCALL calls. A Runner loads it where a call
// finds it missing, and uses EVALSHA where the server has no functions or the user may
// not call or load them.
//
// Its name, and those of its functions, end with a digest of its source, so that two
// versions of a package that share a Redis never call each other's functions (and
// never replace them: function names are global to a server).
type Library struct {
	name string
	src  string
}

// NewLibrary returns the library of scripts, named base followed by "_" and the
// digest of its source. Its prelude is the preludes of scripts, each part once, in the
// order the scripts give them; its functions are named after the library and their
// script (base_<digest>_<script name>). Parts the scripts share must define each local
// name once, and run at load time without the Lua libraries (string, math, tonumber
// and the others exist only when a function is called): constants and local
// functions. A script can be in one library. NewLibrary panics on a name that Redis
// would refuse (only ASCII letters, digits and '_'), or on a script in a library
// already.
func NewLibrary(base string, scripts ...*Script) *Library {
	if !validName(base) {
		panic(fmt.Sprintf("store.NewLibrary: library name %q: only ASCII letters, digits and '_'", base))
	}
	for _, s := range scripts {
		if !validName(s.name) {
			panic(fmt.Sprintf("store.NewLibrary: script name %q: only ASCII letters, digits and '_'", s.name))
		}
		if s.lib != nil {
			panic("store.NewLibrary: script " + s.name + " is in library " + s.lib.name + " already")
		}
	}
	sum := sha256.Sum256([]byte(librarySource(base, scripts)))
	l := &Library{name: base + "_" + hex.EncodeToString(sum[:8])}
	l.src = librarySource(l.name, scripts)
	for _, s := range scripts {
		s.lib, s.fn = l, l.name+"_"+s.name
	}
	return l
}

// Name returns the library's name, digest included.
func (l *Library) Name() string { return l.name }

// Source returns what FUNCTION LOAD sends.
func (l *Library) Source() string { return l.src }

// librarySource is the source of the library named name of scripts: each body becomes
// a function's callback, whose parameters KEYS and ARGV are what EVAL would set.
func librarySource(name string, scripts []*Script) string {
	var b strings.Builder
	fmt.Fprintf(&b, "#!lua name=%s\n", name)
	seen := make(map[string]bool)
	for _, s := range scripts {
		for _, p := range s.prelude {
			if !seen[p] {
				seen[p] = true
				b.WriteString(p)
				b.WriteString("\n")
			}
		}
	}
	for _, s := range scripts {
		fmt.Fprintf(&b, "\n-- %s\nredis.register_function{function_name = '%s_%s', flags = {", s.name, name, s.name)
		for i, f := range s.flags {
			if i > 0 {
				b.WriteString(", ")
			}
			fmt.Fprintf(&b, "'%s'", f)
		}
		fmt.Fprintf(&b, "}, callback = function(KEYS, ARGV)\n%s\nend}\n", s.body)
	}
	return b.String()
}

func validName(s string) bool {
	if s == "" {
		return false
	}
	for _, c := range []byte(s) {
		if !(c == '_' || '0' <= c && c <= '9' || 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z') {
			return false
		}
	}
	return true
}
