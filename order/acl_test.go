package order

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
)

// orderACLRules are what producers and workers need beyond the lock's worker rules
// for order; docs/operating.md quotes them.
const orderACLRules = "+hget +hmget +hset +hdel +hincrby +persist"

// TestACLSuffices: a user with the worker rules (and the function rules) and the order
// rules that docs/operating.md gives, and nothing else, takes places, waits, is woken,
// requeues, finishes and inspects; without the order rules it is refused (the control).
func TestACLSuffices(t *testing.T) {
	t.Parallel()
	acl := redistest.ReadDocACL(t, "../docs/operating.md")
	acl.Quotes(t, orderACLRules)
	worker, functions := acl.Worker, acl.Functions
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
			rdb := srv.User(t, admin, tt.user, tt.rules)
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
			if ok, err := s.Requeue(ctx, key, p2); err != nil || !ok {
				t.Fatalf("Requeue as %s = %v, %v; want it announced", tt.user, ok, err)
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
