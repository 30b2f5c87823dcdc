// Package ratelimit_test checks package ratelimit across worker processes (this test
// binary, re-executed with ASYNQMUTEX_RATE_WORKER set) against real redis-server
// processes on free loopback ports: a fleet hammering keys with Wait, a referee
// redis-server recording when each start begins on its own clock, and checkers that
// judge the record (starts per sliding window, throughput, a pause). Each checker has
// a positive control that must trip it. Run it with
//
//	go test -race -count=1 ./integration/ratelimit/
//
// Every time in these tests is a multiple of the limit under test (its Per, or its
// interval Per/N), never a guess at machine speed.
package ratelimit_test

import (
	"fmt"
	"os"
	"testing"

	"go.uber.org/goleak"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
)

func TestMain(m *testing.M) {
	redistest.QuietRedisLogs()
	if spec := os.Getenv(workerEnv); spec != "" {
		// A worker process: run what the parent asked for and exit, running no test.
		os.Exit(workerMain(spec))
	}
	code := m.Run()
	// A middleware's due loop (due.go) may still wait, after its server stopped, to
	// look at a key whose holder's lease had not ended, or to start a task parked
	// until a time: it ends by itself at its last due time, at most a lease or a
	// rate's hold away.
	if err := goleak.Find(goleak.IgnoreTopFunction("github.com/asynqmutex/asynqmutex.(*dueLoop).loop")); err != nil && code == 0 {
		fmt.Fprintf(os.Stderr, "goleak: %v\n", err)
		code = 1
	}
	os.Exit(code)
}
