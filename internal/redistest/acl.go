package redistest

import (
	"context"
	"os"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"
)

// DocACL is the ACL rules docs/operating.md quotes, in the block that begins "ACL
// SETUSER locker on >password": the worker's rules (its first three lines), the
// function rules (the line beginning "+fcall"), the operator's (the line beginning
// "+lrange"), and every line, for a package to find the rules it adds.
type DocACL struct {
	Worker, Functions, Operator string
	Lines                       []string
}

// ReadDocACL reads the rules from the docs/operating.md at path, failing t when it
// quotes none.
func ReadDocACL(t testing.TB, path string) DocACL {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	const head = "ACL SETUSER locker on >password "
	text := string(b)
	i := strings.Index(text, head)
	if i < 0 {
		t.Fatalf("%s quotes no ACL rules", path)
	}
	var d DocACL
	for j, line := range strings.Split(text[i:i+strings.Index(text[i:], "```")], "\n") {
		line = strings.TrimSpace(line)
		d.Lines = append(d.Lines, line)
		switch {
		case j == 0:
			d.Worker = strings.TrimPrefix(line, head)
		case j <= 2:
			d.Worker += " " + line
		case strings.HasPrefix(line, "+fcall"):
			d.Functions = line
		case strings.HasPrefix(line, "+lrange"):
			d.Operator = line
		}
	}
	return d
}

// Quotes fails t unless rules are one of the lines quoted.
func (d DocACL) Quotes(t testing.TB, rules string) {
	t.Helper()
	for _, l := range d.Lines {
		if l == rules {
			return
		}
	}
	t.Fatalf("docs/operating.md does not quote %q", rules)
}

// User creates the ACL user name with rules (space-separated) on s through admin,
// and returns a client logged in as it, closed when t ends.
func (s *Server) User(t testing.TB, admin *redis.Client, name, rules string) *redis.Client {
	t.Helper()
	args := []any{"ACL", "SETUSER", name, "on", ">" + name + "-secret"}
	for _, r := range strings.Fields(rules) {
		args = append(args, r)
	}
	if err := admin.Do(context.Background(), args...).Err(); err != nil {
		t.Fatal(err)
	}
	rdb := redis.NewClient(&redis.Options{Addr: s.Addr(), Username: name, Password: name + "-secret"})
	t.Cleanup(func() { _ = rdb.Close() })
	return rdb
}
