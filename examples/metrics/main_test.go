package main

import (
	"bytes"
	"context"
	"regexp"
	"strings"
	"testing"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
)

// TestRun runs the example on the embedded miniredis, as `go run` does without
// REDIS_ADDR, and on a real redis-server: it must pass its own check, and print the
// URL it served and the lines it scraped there.
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
			var out bytes.Buffer
			if err := run(context.Background(), &out, 0); err != nil {
				t.Fatalf("run: %v\noutput:\n%s", err, &out)
			}
			text := out.String()
			if !regexp.MustCompile(`(?m)^serving http://127\.0\.0\.1:\d+/metrics$`).MatchString(text) {
				t.Errorf("output does not name a loopback /metrics URL:\n%s", text)
			}
			for _, want := range []string{
				`asynqmutex_lock_wait_seconds_count{outcome="acquired",task_type="report:build"} 9`,
				`asynqmutex_lock_hold_seconds_count{task_type="report:build"} 9`,
				`asynqmutex_lock_waiters{task_type="report:build"} 0`,
				`asynqmutex_lock_contended_total{task_type="report:build"} `,
				"\nok: ",
			} {
				if !strings.Contains(text, want) {
					t.Errorf("output lacks %q:\n%s", want, text)
				}
			}
		})
	}
}
