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
	if err := goleak.Find(); err != nil && code == 0 {
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
