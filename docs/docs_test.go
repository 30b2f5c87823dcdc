// Package docs_test checks the Go code that README.md and docs/*.md show: every
// block must be code of this module that compiles, either a whole file (a complete
// program, such as examples/minimal/main.go) or lines of a function body (a godoc
// example, or one of the functions below that exist for that). Compiling the module
// compiles them; this test fails when a block is no longer among them, so a block
// cannot drift from code that compiles.
//
// A reader who copies lines of a function body must know what to put around them. So
// such a block is whole statements, and when it uses names it does not declare (the
// function's parameters, variables set before it, helpers of its file), its first
// line lists them, with their types, as a Go parameter list, followed by "; returns"
// and the results when the block returns a value:
//
//	// needs: ctx context.Context, locks *mutex.Client; returns error
//
// The test checks that list against the names the block's lines use, found in the
// function, and the types against the function's parameters and results.
package docs_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"go/types"
	"io/fs"
	"iter"
	"log"
	"os"
	"path/filepath"
	"regexp"
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

// fnBody is a function body of the module, for finding a block among its lines and
// the names those lines use.
type fnBody struct {
	fn    *ast.FuncDecl
	lines []string        // normalised
	spans [][2]token.Pos  // where each of lines begins and ends in its file
	pkg   map[string]bool // the names its package declares at top level
}

// TestCodeBlocksCompile: every Go block of the README and docs/*.md is a whole Go
// file of the module or a run of lines in one of its function bodies that says what
// it needs.
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
			if why := check(b.lines, files, bodies); why != "" {
				t.Errorf("%s: this Go block %s:\n%s", b.where, why, strings.Join(b.lines, "\n"))
			}
		}
	}
	if n < 5 {
		t.Errorf("found %d Go blocks in %v, want the README's and the docs' (at least 5)", n, docs)
	}

	// Controls: blocks changed in the ways a block goes wrong are caught.
	readme := goBlocks(t, filepath.Join(root, "README.md"))
	operating := goBlocks(t, "operating.md")
	for _, c := range []struct {
		name   string
		blocks []block
		with   string // a line of the block to change
		change func(lines []string, i int) []string
		// inPlace: check the changed lines where the block is, as if its function had
		// changed with it (a needs line is a line of the function too)
		inPlace bool
	}{
		{"a call renamed", readme, "asynqmutex.On(", func(l []string, i int) []string {
			l[i] = strings.Replace(l[i], "asynqmutex.On(", "asynqmutex.OnField(", 1)
			return l
		}, false},
		{"its needs line dropped", readme, "asynqmutex.InOrder(", func(l []string, _ int) []string {
			return l[1:]
		}, false},
		{"not whole statements", readme, "locks.WithLock(", func(l []string, _ int) []string {
			return l[:len(l)-1]
		}, false},
		{"a name listed, not used", readme, "asynqmutex.InOrder(", func(l []string, _ int) []string {
			l[0] += ", inspector *asynq.Inspector"
			return l
		}, true},
		{"a name used, not listed", readme, "asynqmutex.InOrder(", func(l []string, _ int) []string {
			l[0] = strings.Replace(l[0], ", payload []byte", "", 1)
			return l
		}, true},
		{"a type that is not the parameter's", readme, "locks.WithLock(", func(l []string, _ int) []string {
			l[0] = strings.Replace(l[0], "redis.UniversalClient", "*redis.Client", 1)
			return l
		}, true},
		{"its results not said", operating, "locks.List(ctx)", func(l []string, _ int) []string {
			l[0], _, _ = strings.Cut(l[0], "; returns")
			return l
		}, true},
		{"results said of lines that return nothing", readme, "asynqmutex.InOrder(", func(l []string, _ int) []string {
			l[0] += "; returns error"
			return l
		}, true},
	} {
		i, b := blockWith(c.blocks, c.with)
		if b == nil {
			t.Errorf("control %q: no block has a line with %q", c.name, c.with)
			continue
		}
		mutated := c.change(slices.Clone(b.lines), i)
		why := check(mutated, files, bodies)
		if c.inPlace {
			why = "not found"
			for body, span := range runs(b.lines, bodies) {
				if why = body.needs(mutated, span[0], span[1]); why == "" {
					break
				}
			}
		}
		if slices.Equal(mutated, b.lines) || why == "" {
			t.Errorf("control %q: %s, changed, still passes the check:\n%s", c.name, b.where, strings.Join(mutated, "\n"))
		}
	}

	// Control: a name of the package that a block uses, declared in its own file or in
	// another, is needed too; a local it declares itself is not.
	var pkg code
	for path, src := range map[string]string{
		"p/a.go": "package p\n\nfunc f() {\n\tx := g()\n\th(x)\n}\n\nfunc h(int) {}\n",
		"p/b.go": "package p\n\nfunc g() int { return 0 }\n",
	} {
		if err := pkg.add(path, []byte(src)); err != nil {
			t.Fatal(err)
		}
	}
	for lines, want := range map[string]string{
		"x := g()\nh(x)": "it uses g, h without declaring them",
		"h(x)":           "it uses h, x without declaring them",
	} {
		why := check(strings.Split(lines, "\n"), pkg.files, pkg.bodies)
		if !strings.Contains(why, want) {
			t.Errorf("control: %q in p/a.go: %s, want %q", lines, why, want)
		}
	}
}

// blockWith returns the first of blocks with a line containing s, and that line.
func blockWith(blocks []block, s string) (int, *block) {
	for _, b := range blocks {
		for i, line := range b.lines {
			if strings.Contains(line, s) {
				return i, &b
			}
		}
	}
	return 0, nil
}

// TestSetUpCommands: the README keeps the commands that set everything up on a fresh
// clone, each naming a directory of the module, and CI runs the README's test command.
func TestSetUpCommands(t *testing.T) {
	readme, err := os.ReadFile(filepath.Join(root, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	ci, err := os.ReadFile(filepath.Join(root, ".ci", "run"))
	if err != nil {
		t.Fatal(err)
	}
	for _, cmd := range []string{"go run ./examples/quickstart", "go install ./cmd/asynqmutex", "go test -race ./..."} {
		if !strings.Contains(string(readme), "\n"+cmd+" ") {
			t.Errorf("the README lacks the line %q", cmd)
		}
		if dir := strings.Fields(cmd)[len(strings.Fields(cmd))-1]; dir != "./..." {
			if main, err := filepath.Glob(filepath.Join(root, dir, "*.go")); err != nil || len(main) == 0 {
				t.Errorf("the README's %q names no Go package of the module", cmd)
			}
		}
	}
	if !strings.Contains(string(ci), "\ngo test -race ./... ") {
		t.Errorf(".ci/run does not run the README's test command, go test -race ./...")
	}
}

// TestSafetyReferences: the README cites a fault of its safety table (F2) before the
// table only as a link to it, so that a reader who meets it first can look it up.
func TestSafetyReferences(t *testing.T) {
	src, err := os.ReadFile(filepath.Join(root, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	uncited := func(readme string) (bad []string) {
		table := strings.Index(readme, "\n| F1 |")
		if table < 0 {
			return []string{"no safety table (a row | F1 |)"}
		}
		for _, m := range regexp.MustCompile(`\bF[1-9]\b`).FindAllStringIndex(readme[:table], -1) {
			if !strings.HasPrefix(readme[m[1]:], "](#safety)") || readme[m[0]-1] != '[' {
				line := strings.Count(readme[:m[0]], "\n") + 1
				bad = append(bad, fmt.Sprintf("README.md:%d: %s", line, readme[m[0]:m[1]]))
			}
		}
		return bad
	}
	for _, b := range uncited(string(src)) {
		t.Errorf("%s is cited before the safety table defines it: link it, [%s](#safety)", b, b[strings.LastIndex(b, " ")+1:])
	}
	// Control: the same citation unlinked is caught.
	if bad := uncited(strings.Replace(string(src), "[F2](#safety)", "F2", 1)); len(bad) == 0 {
		t.Errorf("control: an F2 cited before the table without a link passes")
	}
}

// check returns "" if lines are a whole file of files, or a run of lines of one of
// bodies that keeps the rule of the package comment; else what is wrong with them.
func check(lines []string, files [][]string, bodies []fnBody) string {
	for _, f := range files {
		if slices.Equal(f, lines) {
			return ""
		}
	}
	why := "is neither a Go file of the module nor lines of a function in one, so nothing checks that it " +
		"compiles: put it in an example, or in docs/docs_test.go, as it is shown"
	for b, span := range runs(lines, bodies) {
		if why = b.needs(lines, span[0], span[1]); why == "" {
			return ""
		}
	}
	return why
}

// runs yields each body of bodies that lines are a run of lines of, and where the
// run begins and ends in its file.
func runs(lines []string, bodies []fnBody) iter.Seq2[fnBody, [2]token.Pos] {
	return func(yield func(fnBody, [2]token.Pos) bool) {
		for _, b := range bodies {
			for i := 0; i+len(lines) <= len(b.lines); i++ {
				if slices.Equal(b.lines[i:i+len(lines)], lines) &&
					!yield(b, [2]token.Pos{b.spans[i][0], b.spans[i+len(lines)-1][1]}) {
					return
				}
			}
		}
	}
}

// needs returns "" if lines, found in b from from to to, are whole statements whose
// first line lists what they need (see the package comment); else what is wrong.
func (b fnBody) needs(lines []string, from, to token.Pos) string {
	in := fmt.Sprintf("is lines of %s, but ", b.fn.Name.Name)
	alone, err := parser.ParseFile(token.NewFileSet(), "", "package p\nfunc _() {\n"+strings.Join(lines, "\n")+"\n}\n", 0)
	if err != nil {
		return in + fmt.Sprintf("not whole statements (%v): show whole statements", err)
	}
	want, results, err := needsLine(lines[0])
	if err != nil {
		return in + err.Error()
	}

	// The names the lines use that are declared outside them, with their types
	// where they are the function's parameters.
	used := map[string]ast.Expr{}
	notUses := map[*ast.Ident]bool{} // a field's or method's name, a struct literal's key
	ast.Inspect(b.fn, func(n ast.Node) bool {
		switch n := n.(type) {
		case *ast.SelectorExpr:
			notUses[n.Sel] = true
		case *ast.CompositeLit:
			if _, isMap := n.Type.(*ast.MapType); !isMap {
				for _, e := range n.Elts {
					if kv, ok := e.(*ast.KeyValueExpr); ok {
						if id, ok := kv.Key.(*ast.Ident); ok {
							notUses[id] = true
						}
					}
				}
			}
		case *ast.Ident:
			if notUses[n] || n.Name == "_" || n.Pos() < from || n.End() > to {
				break
			}
			if n.Obj == nil { // a package, a predeclared name or one of another file of the package
				if b.pkg[n.Name] {
					used[n.Name] = nil
				}
				break
			}
			if d, _ := n.Obj.Decl.(ast.Node); d == nil || d.Pos() < from || d.Pos() > to {
				field, _ := d.(*ast.Field)
				used[n.Name] = nil
				if field != nil {
					used[n.Name] = field.Type
				}
			}
		}
		return true
	})
	var missing, unused, mistyped []string
	for name, typ := range used {
		if w, ok := want[name]; !ok {
			missing = append(missing, name)
		} else if typ != nil && types.ExprString(typ) != w {
			mistyped = append(mistyped, fmt.Sprintf("%s %s, not %s", name, types.ExprString(typ), w))
		}
	}
	for name := range want {
		if _, ok := used[name]; !ok {
			unused = append(unused, name)
		}
	}
	slices.Sort(missing)
	slices.Sort(unused)
	slices.Sort(mistyped)
	switch {
	case len(missing) > 0:
		return in + fmt.Sprintf("it uses %s without declaring them: list them, with their types, in a first line "+
			"\"// needs: name Type, ...\"", strings.Join(missing, ", "))
	case len(unused) > 0:
		return in + fmt.Sprintf("its needs line lists %s, which it does not use", strings.Join(unused, ", "))
	case len(mistyped) > 0:
		return in + fmt.Sprintf("its needs line gives %s", strings.Join(mistyped, "; "))
	}

	returns := false // a value, from the lines themselves rather than a function literal of theirs
	ast.Inspect(alone, func(n ast.Node) bool {
		if r, ok := n.(*ast.ReturnStmt); ok && len(r.Results) > 0 {
			returns = true
		}
		_, lit := n.(*ast.FuncLit)
		return !lit
	})
	if got := fieldTypes(b.fn.Type.Results); returns && results != got {
		return in + fmt.Sprintf("it returns a value: end its needs line with \"; returns %s\"", got)
	}
	if !returns && results != "" {
		return in + "its needs line says it returns " + results + ", which it does not"
	}
	return ""
}

// needsLine parses a block's first line, "// needs: a A, b B" and perhaps
// "; returns R": each name it lists with its type, and the types of R. A first line
// that is no needs line lists nothing.
func needsLine(line string) (params map[string]string, results string, err error) {
	text, ok := strings.CutPrefix(line, "// needs:")
	if !ok {
		return nil, "", nil
	}
	text, results, _ = strings.Cut(text, "; returns ")
	e, err := parser.ParseExpr("func(" + text + ") (" + results + ")")
	if err != nil {
		return nil, "", fmt.Errorf("its needs line is not a Go parameter list, with results after \"; returns\": %v", err)
	}
	ft := e.(*ast.FuncType)
	params = map[string]string{}
	for _, f := range ft.Params.List {
		if len(f.Names) == 0 {
			return nil, "", fmt.Errorf("its needs line gives %s no name", types.ExprString(f.Type))
		}
		for _, n := range f.Names {
			params[n.Name] = types.ExprString(f.Type)
		}
	}
	return params, fieldTypes(ft.Results), nil
}

// fieldTypes is the types of a parameter or result list, each as often as it has names.
func fieldTypes(list *ast.FieldList) string {
	if list == nil {
		return ""
	}
	var ts []string
	for _, f := range list.List {
		for range max(1, len(f.Names)) {
			ts = append(ts, types.ExprString(f.Type))
		}
	}
	return strings.Join(ts, ", ")
}

// moduleCode returns every Go file of the module (bench/, a module of its own,
// aside), normalised, and every function body in them.
func moduleCode(t *testing.T) (files [][]string, bodies []fnBody) {
	t.Helper()
	var c code
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
		return c.add(path, src)
	})
	if err != nil {
		t.Fatal(err)
	}
	return c.files, c.bodies
}

// code is the Go files read so far, normalised, and their function bodies.
type code struct {
	fset   *token.FileSet
	files  [][]string
	bodies []fnBody
	pkgs   map[string]map[string]bool // by directory and package name: its top-level names
}

// add reads the Go file path, whose text is src.
func (c *code) add(path string, src []byte) error {
	if c.fset == nil {
		c.fset, c.pkgs = token.NewFileSet(), map[string]map[string]bool{}
	}
	c.files = append(c.files, normalise(string(src)))
	f, err := parser.ParseFile(c.fset, path, src, parser.ParseComments)
	if err != nil {
		return err
	}
	pkg := filepath.Dir(path) + " " + f.Name.Name
	if c.pkgs[pkg] == nil {
		c.pkgs[pkg] = map[string]bool{}
	}
	for name := range f.Scope.Objects {
		c.pkgs[pkg][name] = true
	}
	file := c.fset.File(f.Pos())
	for _, decl := range f.Decls {
		if fn, ok := decl.(*ast.FuncDecl); ok && fn.Body != nil {
			from, to := file.Offset(fn.Body.Lbrace)+1, file.Offset(fn.Body.Rbrace)
			lines, spans := normaliseAt(string(src[from:to]))
			body := fnBody{fn: fn, lines: lines, pkg: c.pkgs[pkg]}
			for _, s := range spans {
				body.spans = append(body.spans, [2]token.Pos{file.Pos(from + s[0]), file.Pos(from + s[1])})
			}
			c.bodies = append(c.bodies, body)
		}
	}
	return nil
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
	lines, _ := normaliseAt(src)
	return lines
}

// normaliseAt is normalise, with where each line begins and ends in src.
func normaliseAt(src string) (lines []string, spans [][2]int) {
	at := 0
	for _, line := range strings.SplitAfter(src, "\n") {
		if n := strings.Join(strings.Fields(line), " "); n != "" {
			lines = append(lines, n)
			spans = append(spans, [2]int{at, at + len(strings.TrimRight(line, "\n"))})
		}
		at += len(line)
	}
	return lines, spans
}

// The functions below hold the blocks of the README and docs/*.md that are not a
// godoc example's. They are compiled, never run. Each takes what its block needs as
// parameters, so that the test checks the types its needs line gives.

// README, the opening lines.
func readmeOpening(mux *asynq.ServeMux, locks *mutex.Client) {
	// needs: mux *asynq.ServeMux, locks *mutex.Client
	mux.Use(asynqmutex.Middleware(locks, asynqmutex.For("payment:capture"), asynqmutex.On("transaction_id")))
}

// README, "Rate limits".
func readmeRateLimits(mux *asynq.ServeMux, locks *mutex.Client) {
	// needs: mux *asynq.ServeMux, locks *mutex.Client
	mux.Use(asynqmutex.Middleware(locks, asynqmutex.For("email:send"), asynqmutex.On("tenant_id"),
		asynqmutex.Rate(10, time.Second), asynqmutex.NoLock(), asynqmutex.MaxWait(5*time.Second)))
}

// README, "Order per key".
func readmeOrderPerKey(ctx context.Context, redisOpt asynq.RedisClientOpt, payload []byte) error {
	// needs: ctx context.Context, redisOpt asynq.RedisClientOpt, payload []byte
	locks := mutex.New(redisOpt.MakeRedisClient().(redis.UniversalClient))
	opts := []asynqmutex.Option{asynqmutex.For("transfer"), asynqmutex.On("account_id"),
		asynqmutex.InOrder(asynq.NewInspector(redisOpt)), asynqmutex.MaxWait(10 * time.Second)}

	// Producer: takes the task's place in its account's order, then enqueues it.
	producer := asynqmutex.NewProducer(locks, asynq.NewClient(redisOpt), opts...)
	_, err := producer.Enqueue(ctx, asynq.NewTask("transfer", payload), asynq.Queue("transfers"))

	// Worker: runs a transfer when every earlier one of its account has finished.
	mux := asynq.NewServeMux()
	mux.Use(asynqmutex.Middleware(locks, opts...))
	return errors.Join(err, asynq.NewServer(redisOpt, asynqmutex.Configure(asynq.Config{})).Run(mux))
}

// README, "The lock on its own".
func readmeLockOnItsOwn(ctx context.Context, rdb redis.UniversalClient, build func(context.Context) error) error {
	// needs: ctx context.Context, rdb redis.UniversalClient, build func(context.Context) error
	locks := mutex.New(rdb) // any redis.UniversalClient: single node, Sentinel, Cluster

	err := locks.WithLock(ctx, "report:2026-11", 30*time.Second, func(ctx context.Context) error {
		// held here; renewed every 10s; ctx is cancelled at once if the lease is lost
		return build(ctx)
	}, mutex.MaxWait(time.Minute))
	return err
}

// docs/conflicts.md, "Reschedule caps".
func conflictsRescheduleCaps(mux *asynq.ServeMux, locks *mutex.Client) {
	// needs: mux *asynq.ServeMux, locks *mutex.Client
	mux.Use(asynqmutex.Middleware(locks, asynqmutex.For("payment:capture"), asynqmutex.On("transaction_id"),
		asynqmutex.OnConflict(asynqmutex.RetryLater(10*time.Second)),
		asynqmutex.MaxReschedules(20),           // at most 20 reschedules, and/or
		asynqmutex.MaxRescheduleTime(time.Hour), // none once an hour has passed since the first conflict
	))
}

// docs/operating.md, "The same from Go".
func operatingFromGo(ctx context.Context, locks *mutex.Client) error {
	// needs: ctx context.Context, locks *mutex.Client; returns error
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
	// needs: mux *asynq.ServeMux, locks *mutex.Client
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
func migratingRemoteLock(ctx context.Context, locks *mutex.Client, b struct{ ID, PropertyID string }, book func(context.Context) error) error {
	// needs: ctx context.Context, locks *mutex.Client, b struct{ ID, PropertyID string }, book func(context.Context) error
	err := locks.WithLockKeys(ctx, []string{"property:" + b.PropertyID, "booking:" + b.ID},
		30*time.Second, book, mutex.MaxWait(5*time.Second))
	return err
}

var (
	_ = readmeOpening
	_ = readmeRateLimits
	_ = readmeOrderPerKey
	_ = readmeLockOnItsOwn
	_ = conflictsRescheduleCaps
	_ = operatingFromGo
	_ = migratingRedisMutex
	_ = migratingRemoteLock
)

// TestDocsAnswerWhatUsersMet: what users met and the docs now say stays said, where
// they will look: how many starts a handler may see in one interval, where Rate is
// introduced; that asynq delivers at least once, beside F6.
func TestDocsAnswerWhatUsersMet(t *testing.T) {
	for _, tc := range []struct {
		file, near, want string
	}{
		{"README.md", "| `Rate(n, per)` |", "n + 1"},
		{"docs/ratelimit.md", "## Headroom", "below"},
		{"README.md", "| F6 |", "at least once"},
		{"docs/order.md", "## What breaks order", "appendfsync"},
	} {
		src, err := os.ReadFile(filepath.Join(root, tc.file))
		if err != nil {
			t.Fatal(err)
		}
		if !saysNear(string(src), tc.near, tc.want) {
			t.Errorf("%s: nothing within a screen of %q says %q", tc.file, tc.near, tc.want)
		}
	}
	// Control: text that says it elsewhere does not pass.
	if saysNear("Rate(10, time.Second)"+strings.Repeat("\n", 40)+"n + 1", "Rate(", "n + 1") {
		t.Error("control: a phrase forty lines away counts as near")
	}
}

// saysNear reports whether want stands in the 30 lines from the first line that
// holds near.
func saysNear(text, near, want string) bool {
	i := strings.Index(text, near)
	if i < 0 {
		return false
	}
	lines := strings.SplitN(text[i:], "\n", 31)
	return strings.Contains(strings.Join(lines[:min(len(lines), 30)], "\n"), want)
}
