//go:build linux

// Package failover is the failover battery of asynqmutex: it runs the lock in several
// worker processes (this test binary, re-executed in worker mode) against a Redis
// deployment with replicas that the tests start on loopback — a Sentinel-managed
// master with two replicas and three sentinels, and a Cluster of three masters with a
// replica each — fails the master over (SIGKILL, SIGSTOP past the failure-detection
// time, a graceful failover, a partition of the old master from its replicas and the
// sentinels), and reports what the referee's checkers saw: overlapping sections, lost
// updates, fenced writes rejected as stale, and how long locking was unavailable.
// Every checker has a positive control that must trip it.
//
// Run it with
//
//	go test -race -count=1 -v ./integration/failover/
//
// The default counts are scaled down to keep CI short; ASYNQMUTEX_FAILOVER_LONG=1 runs
// the full counts. See README.md for what each test shows and the figures of a run.
package failover

import (
	"os"
	"testing"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
)

func TestMain(m *testing.M) {
	// go-redis logs every connection a killed or demoted server breaks.
	redistest.QuietRedisLogs()
	if spec := os.Getenv(workerEnv); spec != "" {
		// A worker process: run what the parent asked for and exit, without running
		// any test.
		os.Exit(workerMain(spec))
	}
	os.Exit(m.Run())
}
