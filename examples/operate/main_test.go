package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
)

// TestRun runs the example on the embedded miniredis, as `go run` does without
// REDIS_ADDR, and on a real redis-server: it checks itself and must pass.
func TestRun(t *testing.T) {
	for _, tc := range []struct {
		name  string
		redis func(t *testing.T) string // REDIS_ADDR
	}{
		{"miniredis", func(*testing.T) string { return "" }},
		{"redis-server", func(t *testing.T) string { return redistest.Start(t).Addr() }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("REDIS_ADDR", tc.redis(t))
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			var out strings.Builder
			if err := run(ctx, &out); err != nil {
				t.Fatalf("run: %v\noutput:\n%s", err, out.String())
			}
			if !strings.Contains(out.String(), "\nok: ") {
				t.Errorf("output lacks its verdict:\n%s", out.String())
			}
		})
	}
}
