package order

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
)

// orderACLRules are what producers and workers need beyond the lock's worker rules
// for order; docs/operating.md quotes them.
const orderACLRules = "+hget +hmget +hset +hdel +hincrby +persist"

// TestACLSuffices: a user with the worker rules (and the function rules) and the order
// rules that docs/operating.md gives, and nothing else, takes places, waits, is woken,
// finishes and inspects; without the order rules it is refused (the control).
func TestACLSuffices(t *testing.T) {
	t.Parallel()
	b, err := os.ReadFile("../docs/operating.md")
	if err != nil {
		t.Fatal(err)
	}
	text := string(b)
	i := strings.Index(text, "ACL SETUSER locker on >password ")
	if i < 0 {
		t.Fatal("docs/operating.md quotes no ACL rules")
	}
	lines := strings.Split(text[i:i+strings.Index(text[i:], "```")], "\n")
	var worker, functions string
	found := false
	for j, line := range lines {
		line = strings.TrimSpace(line)
		switch {
		case j == 0:
			worker = strings.TrimPrefix(line, "ACL SETUSER locker on >password ")
		case j <= 2:
			worker += " " + line
		case strings.HasPrefix(line, "+fcall"):
			functions = line
		case line == orderACLRules:
			found = true
		}
	}
	if !found {
		t.Fatalf("docs/operating.md does not quote %q", orderACLRules)
	}

	srv := redistest.Start(t)
	admin := srv.Client(t)
	ctx := context.Background()
	for _, tt := range []struct {
		user, rules string
		ok          bool
	}{
		{"orderer", worker + " " + orderACLRules, true},
		{"orderfn", worker + " " + functions + " " + orderACLRules, true},
		{"noorder", worker + " " + functions, false},
	} {
		t.Run(tt.user, func(t *testing.T) {
			args := []any{"ACL", "SETUSER", tt.user, "on", ">" + tt.user + "-secret"}
			for _, r := range strings.Fields(tt.rules) {
				args = append(args, r)
			}
			if err := admin.Do(ctx, args...).Err(); err != nil {
				t.Fatal(err)
			}
			rdb := redis.NewClient(&redis.Options{Addr: srv.Addr(), Username: tt.user, Password: tt.user + "-secret"})
			t.Cleanup(func() { rdb.Close() })
			s, key := New(rdb), uniqueKey(t)
			p1, err := s.Take(ctx, key, "default", "a")
			if !tt.ok {
				if err == nil || !strings.Contains(err.Error(), "can't run this command") {
					t.Fatalf("Take as %s = %v, want a refusal", tt.user, err)
				}
				return
			}
			if err != nil {
				t.Fatalf("Take as %s: %v", tt.user, err)
			}
			p2, err := s.Take(ctx, key, "default", "b")
			if err != nil {
				t.Fatalf("Take as %s: %v", tt.user, err)
			}
			got := make(chan error, 1)
			go func() {
				turn, err := s.Await(ctx, key, p2, time.Minute)
				if err == nil && turn.State != TurnNow {
					err = errorString("Await = " + turn.State.String())
				}
				got <- err
			}()
			time.Sleep(20 * time.Millisecond) // let it subscribe; its answer does not depend on it
			if _, err := s.Finish(ctx, key, p1, Done); err != nil {
				t.Fatalf("Finish as %s: %v", tt.user, err)
			}
			select {
			case err := <-got:
				if err != nil {
					t.Fatalf("as %s: %v", tt.user, err)
				}
			case <-time.After(30 * time.Second):
				t.Fatalf("as %s: Await not woken", tt.user)
			}
			if _, err := s.Finish(ctx, key, p2, Skipped); err != nil {
				t.Fatalf("Finish as %s: %v", tt.user, err)
			}
			if _, err := s.Inspect(ctx, key); err != nil {
				t.Fatalf("Inspect as %s: %v", tt.user, err)
			}
		})
	}
}

type errorString string

func (e errorString) Error() string { return string(e) }
