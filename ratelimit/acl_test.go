package ratelimit

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
)

// rateACLRules are what a worker needs beyond the lock's worker rules for rate limits;
// docs/operating.md quotes them.
const rateACLRules = "+zrange +zadd +zscore +zmscore +zrem +zremrangebyscore +pexpireat +zcount"

// TestACLSuffices: a user with the worker rules, the function rules and the rate rules
// that docs/operating.md gives, and nothing else, takes, waits for, cancels, pauses,
// resumes, resets and inspects, and with the operator's rules lists; without the rate rules
// it is refused (the control).
func TestACLSuffices(t *testing.T) {
	t.Parallel()
	acl := redistest.ReadDocACL(t, "../docs/operating.md")
	acl.Quotes(t, rateACLRules)
	worker, functions, operator := acl.Worker, acl.Functions, acl.Operator
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
			rdb := srv.User(t, admin, tt.user, tt.rules)
			l, key := New(rdb), uniqueKey(t)
			lim := Rate{N: 1, Per: 50 * time.Millisecond}
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
				{"Reset", func() error { _, err := l.Reset(ctx, key); return err }},
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
