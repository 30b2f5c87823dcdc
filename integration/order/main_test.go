// Package order_test checks ordered tasks (asynqmutex.InOrder and Producer) across
// processes: asynq worker processes and producer processes (this test binary,
// re-executed with procEnv set) against real redis-server processes on free loopback
// ports. An asynq Redis holds the tasks, the locks and the keys' sequences; a referee
// redis-server, which nothing under test uses, records on its own clock what every
// producer enqueued and what every handler saw, and checkers judge the record. Each
// checker has a positive control that must trip it. Run it with
//
//	go test -race -count=1 ./integration/order/
//
// Every time in these tests is a multiple of what it tests (OrderGrace, MaxWait),
// never a guess at machine speed; every loop is bounded in count and time.
package order_test

import (
	"fmt"
	"os"
	"testing"

	"go.uber.org/goleak"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
)

func TestMain(m *testing.M) {
	redistest.QuietRedisLogs()
	if spec := os.Getenv(procEnv); spec != "" {
		// A worker or producer process: run what the parent asked for and exit,
		// running no test.
		os.Exit(procMain(spec))
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
