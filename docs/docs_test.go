// Package docs_test checks the Go code that README.md and docs/*.md show: every
// block must be code of this module that compiles, either a whole file (a complete
// program, such as examples/minimal/main.go) or lines of a function body (a godoc
// example, or one of the functions below that exist for that). Compiling the module
// compiles them; this test fails when a block is no longer among them, so a block
// cannot drift from code that compiles.
package docs_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"log"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex"
	"github.com/asynqmutex/asynqmutex/mutex"
)

// root is the module's root, seen from this package's directory.
const root = ".."

// block is a Go code block of a Markdown file.
type block struct {
	where string   // file:line of its opening fence
	lines []string // normalised (see normalise)
}

// TestCodeBlocksCompile: every Go block of the README and docs/*.md is a whole Go
// file of the module or a run of lines in one of its function bodies.
func TestCodeBlocksCompile(t *testing.T) {
	files, bodies := moduleCode(t)
	docs, err := filepath.Glob("*.md")
	if err != nil {
		t.Fatal(err)
	}
	docs = append([]string{filepath.Join(root, "README.md")}, docs...)
	n := 0
	for _, doc := range docs {
		for _, b := range goBlocks(t, doc) {
			n++
			if !found(b.lines, files, bodies) {
				t.Errorf("%s: this Go block is neither a Go file of the module nor lines of a function in one, so nothing "+
					"checks that it compiles: put it in an example, or in docs/docs_test.go, as it is shown:\n%s",
					b.where, strings.Join(b.lines, "\n"))
			}
		}
	}
	if n < 5 {
		t.Errorf("found %d Go blocks in %v, want the README's and the docs' (at least 5)", n, docs)
	}

	// Control: a block that no longer compiles (here, a call renamed) is caught.
	readme := goBlocks(t, filepath.Join(root, "README.md"))
	mutated := slices.Clone(readme[0].lines)
	mutated[0] = strings.Replace(mutated[0], "asynqmutex.On(", "asynqmutex.OnField(", 1)
	if mutated[0] == readme[0].lines[0] || found(mutated, files, bodies) {
		t.Errorf("control: the README's first block, changed to %q, still passes the check", mutated[0])
	}
}

// TestSetUpCommands: the README keeps the two commands that set everything up on a
// fresh clone, and CI runs the README's test command.
func TestSetUpCommands(t *testing.T) {
	readme, err := os.ReadFile(filepath.Join(root, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	ci, err := os.ReadFile(filepath.Join(root, ".ci", "run"))
	if err != nil {
		t.Fatal(err)
	}
	for _, cmd := range []string{"go run ./examples/quickstart", "go test -race ./..."} {
		if !strings.Contains(string(readme), "\n"+cmd+" ") {
			t.Errorf("the README lacks the line %q", cmd)
		}
	}
	if !strings.Contains(string(ci), "\ngo test -race ./... ") {
		t.Errorf(".ci/run does not run the README's test command, go test -race ./...")
	}
}

// found reports whether lines are a whole file of files or a run of lines of one of
// bodies.
func found(lines []string, files, bodies [][]string) bool {
	for _, f := range files {
		if slices.Equal(f, lines) {
			return true
		}
	}
	for _, body := range bodies {
		for i := 0; i+len(lines) <= len(body); i++ {
			if slices.Equal(body[i:i+len(lines)], lines) {
				return true
			}
		}
	}
	return false
}

// moduleCode returns every Go file of the module (bench/, a module of its own,
// aside) and every function body in them, normalised.
func moduleCode(t *testing.T) (files, bodies [][]string) {
	t.Helper()
	fset := token.NewFileSet()
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if path != root && (strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata" || d.Name() == "bench") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") {
			return nil
		}
		src, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		files = append(files, normalise(string(src)))
		f, err := parser.ParseFile(fset, path, src, parser.ParseComments)
		if err != nil {
			return err
		}
		for _, decl := range f.Decls {
			if fn, ok := decl.(*ast.FuncDecl); ok && fn.Body != nil {
				from, to := fset.Position(fn.Body.Lbrace).Offset+1, fset.Position(fn.Body.Rbrace).Offset
				bodies = append(bodies, normalise(string(src[from:to])))
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return files, bodies
}

// goBlocks returns the Go code blocks of the Markdown file path.
func goBlocks(t *testing.T, path string) []block {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var (
		blocks []block
		cur    *block
		text   []string
	)
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		switch {
		case cur == nil && line == "```go":
			cur, text = &block{where: fmt.Sprintf("%s:%d", path, n)}, nil
		case cur != nil && line == "```":
			cur.lines = normalise(strings.Join(text, "\n"))
			blocks = append(blocks, *cur)
			cur = nil
		case cur != nil:
			text = append(text, sc.Text())
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	if cur != nil {
		t.Fatalf("%s: a Go block is not closed", cur.where)
	}
	return blocks
}

// normalise is src's lines without blank ones, each with its runs of white space
// made one space: indentation and gofmt's alignment of comments do not matter.
func normalise(src string) []string {
	var lines []string
	for _, line := range strings.Split(src, "\n") {
		if line = strings.Join(strings.Fields(line), " "); line != "" {
			lines = append(lines, line)
		}
	}
	return lines
}

// The functions below hold the blocks of the README and docs/*.md that are not a
// godoc example's. They are compiled, never run.

// README, "The lock on its own".
func readmeLockOnItsOwn(ctx context.Context, rdb redis.UniversalClient) error {
	locks := mutex.New(rdb) // any redis.UniversalClient: single node, Sentinel, Cluster

	err := locks.WithLock(ctx, "report:2026-11", 30*time.Second, func(ctx context.Context) error {
		// held here; renewed every 10s; ctx is cancelled at once if the lease is lost
		return build(ctx)
	}, mutex.MaxWait(time.Minute))
	return err
}

func build(context.Context) error { return nil }

// docs/operating.md, "The same from Go".
func operatingFromGo(ctx context.Context, locks *mutex.Client) error {
	key, _ := asynqmutex.Key("payment:capture", `"tx-42"`) // the key On("transaction_id") builds
	in, _ := locks.Inspect(ctx, key)
	fmt.Println(in.Held, in.Holder, in.Since, in.TTL, in.Fence, in.Waiting, in.Waiters)
	for in, err := range locks.List(ctx) { // every held key (SCAN; every master of a Cluster)
		if err != nil {
			return err
		}
		fmt.Println(in.Key, in.Holder)
	}
	r, err := locks.ForceRelease(ctx, key) // r.Before; r.HandedTo and r.Fence when a waiter got it
	fmt.Println(r.Before, r.HandedTo, r.Fence)
	return err
}

// docs/migrating.md, "redis-mutex (Ruby)".
func migratingRedisMutex(mux *asynq.ServeMux, locks *mutex.Client) {
	// auto_mutex :perform, on: [:transaction_id], block: 1, after_failure: ...
	mux.Use(asynqmutex.Middleware(locks,
		asynqmutex.For("payment:capture"), // the class whose perform is locked
		asynqmutex.On("transaction_id"),
		asynqmutex.MaxWait(time.Second),        // block: 1, woken on release: no sleep:
		asynqmutex.OnConflict(asynqmutex.Skip), // as redis-mutex: a busy job ends unrun
		asynqmutex.AfterFailure(func(ctx context.Context, t *asynq.Task, err error) {
			var le *asynqmutex.LockedError // err may also be a Redis or payload error
			if errors.As(err, &le) {
				log.Printf("%s busy", t.Type())
			}
		}),
	))
}

// docs/migrating.md, "remote_lock and mega_mutex (Ruby)".
func migratingRemoteLock(ctx context.Context, locks *mutex.Client, b booking) error {
	err := locks.WithLockKeys(ctx, []string{"property:" + b.PropertyID, "booking:" + b.ID},
		30*time.Second, book, mutex.MaxWait(5*time.Second))
	return err
}

type booking struct{ ID, PropertyID string }

func book(context.Context) error { return nil }

var (
	_ = readmeLockOnItsOwn
	_ = operatingFromGo
	_ = migratingRedisMutex
	_ = migratingRemoteLock
)
