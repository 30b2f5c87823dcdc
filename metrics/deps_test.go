package metrics_test

import (
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
)

// TestPrometheusOnlyThroughMetrics checks that the root package and mutex do not
// depend on Prometheus, so that only programs importing metrics compile it. The
// metrics package itself is the positive control: the same check must find
// client_golang among its dependencies.
func TestPrometheusOnlyThroughMetrics(t *testing.T) {
	t.Parallel()
	goCmd, err := exec.LookPath("go")
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("no go command on PATH: %v", err)
		}
		t.Skipf("no go command on PATH: %v", err)
	}
	deps := func(pkgs ...string) []string {
		t.Helper()
		out, err := exec.Command(goCmd, append([]string{"list", "-deps"}, pkgs...)...).Output()
		if err != nil {
			var stderr []byte
			if ee, ok := err.(*exec.ExitError); ok {
				stderr = ee.Stderr
			}
			t.Fatalf("go list -deps %s: %v\n%s", strings.Join(pkgs, " "), err, stderr)
		}
		return strings.Fields(string(out))
	}
	prometheus := func(pkgs []string) []string {
		return slices.DeleteFunc(slices.Clone(pkgs), func(p string) bool {
			return !strings.HasPrefix(p, "github.com/prometheus/")
		})
	}

	const prom = "github.com/prometheus/client_golang/prometheus"
	if got := deps("github.com/asynqmutex/asynqmutex/metrics"); !slices.Contains(got, prom) {
		t.Fatalf("go list -deps of metrics lacks %s: the check cannot see Prometheus (got %d packages)", prom, len(got))
	}
	core := deps("github.com/asynqmutex/asynqmutex", "github.com/asynqmutex/asynqmutex/mutex")
	if !slices.Contains(core, "github.com/asynqmutex/asynqmutex/mutex") {
		t.Fatalf("go list -deps of the root package and mutex lacks mutex itself: %q", core)
	}
	if p := prometheus(core); len(p) > 0 {
		t.Errorf("the root package or mutex depends on %q; only metrics may import Prometheus", p)
	}
}
