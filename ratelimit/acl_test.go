package ratelimit

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
)

// rateACLRules are what a worker needs beyond the lock's worker rules for rate limits;
// docs/operating.md quotes them.
const rateACLRules = "+zrange +zadd +zscore +zmscore +zrem +zremrangebyscore +pexpireat +zcount"

// TestACLSuffices: a user with the worker rules, the function rules and the rate rules
// that docs/operating.md gives, and nothing else, takes, waits for, cancels, pauses,
// resumes and inspects, and with the operator's rules lists; without the rate rules
// it is refused (the control).
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
	var worker, functions, operator string
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
		case line == rateACLRules:
			found = true
		case strings.HasPrefix(line, "+lrange"):
			operator = line
		}
	}
	if !found {
		t.Fatalf("docs/operating.md does not quote %q", rateACLRules)
	}

	srv := redistest.Start(t)
	admin := srv.Client(t)
	ctx := context.Background()
	for _, tt := range []struct {
		user, rules string
		ok, list    bool
	}{
		{"rater", worker + " " + rateACLRules, true, false},
		{"ratefn", worker + " " + functions + " " + rateACLRules, true, false},
		{"rateop", worker + " " + rateACLRules + " " + operator, true, true},
		{"norate", worker + " " + functions, false, false},
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
			l, key := New(rdb), uniqueKey(t)
			lim := Limit{N: 1, Per: 50 * time.Millisecond}
			steps := []struct {
				name string
				f    func() error
			}{
				{"Allow", func() error { _, err := l.Allow(ctx, key, lim); return err }},
				{"Take", func() error { _, err := l.Take(ctx, key, lim, time.Second); return err }},
				{"Cancel", func() error {
					r, err := l.Reserve(ctx, key, lim, time.Second)
					if err == nil {
						_, err = l.Cancel(ctx, key, r)
					}
					return err
				}},
				{"Pause", func() error { _, err := l.Pause(ctx, key, lim, time.Second); return err }},
				{"Take after Pause", func() error { _, err := l.Take(ctx, key, lim, 0); return err }},
				{"Resume", func() error { _, err := l.Resume(ctx, key); return err }},
				{"Inspect", func() error { _, err := l.Inspect(ctx, key); return err }},
				{"List", func() error {
					for _, err := range l.List(ctx) {
						if err != nil {
							return err
						}
					}
					return nil
				}},
			}
			for _, s := range steps {
				if s.name == "List" && !tt.list {
					continue // an operator's: it needs SCAN
				}
				err := s.f()
				if tt.ok && err != nil {
					t.Errorf("%s as %s: %v", s.name, tt.user, err)
				}
				if !tt.ok && s.name == "Allow" && (err == nil || !strings.Contains(err.Error(), "can't run this command")) {
					t.Errorf("%s as %s = %v, want a refusal", s.name, tt.user, err)
				}
			}
		})
	}
}
