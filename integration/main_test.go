// Package integration tests asynqmutex with a real asynq.Server and asynq.Client
// against real redis-server processes the tests start on free loopback ports: single
// node, Sentinel failover and Cluster. Run it with:
//
//	go test -race -count=1 ./integration/
//
// -short skips the crash test, which waits out asynq's own task lease (about a minute).
package integration

import (
	"flag"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"testing"

	"go.uber.org/goleak"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
)

func TestMain(m *testing.M) {
	flag.Parse()
	if os.Getenv(workerEnv) == "" && !flagSet("test.parallel") {
		// The tests spend their time waiting for asynq's timers and for locks, not on
		// the CPU; the crash test alone waits a minute. Running them all at once keeps
		// the package to about that minute even on 2 cores. An explicit -parallel wins.
		if err := flag.Set("test.parallel", strconv.Itoa(max(16, runtime.GOMAXPROCS(0)))); err != nil {
			fmt.Fprintf(os.Stderr, "setting -test.parallel: %v\n", err)
		}
	}
	// go-redis logs every Sentinel lookup and every pub/sub connection closed under
	// it by a test's cleanup; ASYNQMUTEX_TEST_LOG=1 shows them with asynq's logs.
	redistest.QuietRedisLogs()
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

func flagSet(name string) bool {
	set := false
	flag.Visit(func(f *flag.Flag) {
		if f.Name == name {
			set = true
		}
	})
	return set
}
