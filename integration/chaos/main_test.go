//go:build unix

// Package chaos is the reliability battery of asynqmutex: it runs the lock across
// several worker processes (this test binary, re-executed in worker mode) against a
// real redis-server, injects faults (SIGKILL and SIGSTOP of a holder, a restart of the
// lock Redis without persistence), and checks every run with checkers that can fail:
// occupancy and lost updates on a "referee" redis-server that is never faulted,
// fenced writes the referee accepts only in fence order, and a porcupine
// linearizability check of the recorded acquire/release history. Every checker has
// a positive control that must trip it.
//
// Run it with
//
//	go test -race -count=1 ./integration/chaos/
//
// The default counts are scaled down to keep CI short; ASYNQMUTEX_CHAOS_LONG=1 runs
// the full counts (8 workers x 5,000 sections). See README.md for what each scenario
// shows and the figures of a run.
package chaos

import (
	"fmt"
	"os"
	"testing"

	"go.uber.org/goleak"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
)

func TestMain(m *testing.M) {
	// go-redis logs every connection a restarted or killed server breaks.
	redistest.QuietRedisLogs()
	if spec := os.Getenv(WorkerEnv); spec != "" {
		// A worker process: run the mode the parent asked for and exit, without
		// running any test.
		os.Exit(workerMain(spec))
	}
	code := m.Run()
	// toxiproxy v2.5.0's toxics send a chunk on with a plain channel send: the latency
	// toxic, interrupted while it delays a chunk, sends it regardless
	// (toxics/latency.go), and the noop toxic that carries a link's traffic between
	// toxics (toxics/noop.go) sends each chunk it read; either blocks for ever when
	// nothing reads its output any more, as when a link's destination closed under
	// traffic and its writer left. Those goroutines are the proxy's, not ours.
	// A middleware's due loop (due.go) may still wait, after its server stopped, to
	// look at a key whose holder's lease had not ended: it ends by itself then.
	if err := goleak.Find(
		goleak.IgnoreTopFunction("github.com/asynqmutex/asynqmutex.(*dueLoop).loop"),
		goleak.IgnoreTopFunction("github.com/Shopify/toxiproxy/v2/toxics.(*LatencyToxic).Pipe"),
		goleak.IgnoreTopFunction("github.com/Shopify/toxiproxy/v2/toxics.(*NoopToxic).Pipe"),
	); err != nil && code == 0 {
		fmt.Fprintf(os.Stderr, "goleak: %v\n", err)
		code = 1
	}
	os.Exit(code)
}
