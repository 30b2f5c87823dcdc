package redistest

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"sync"

	"github.com/redis/go-redis/v9"
)

// LogEnv is the environment variable that, when set, keeps go-redis's own log
// lines (and asynq's, in the tests that route them) on stderr.
const LogEnv = "ASYNQMUTEX_TEST_LOG"

// QuietRedisLogs routes go-redis's own log lines away from test output unless
// LogEnv is set. go-redis logs every pub/sub connection a test's cleanup or a
// killed server breaks ("discarding bad PubSub connection"), dozens per test, which
// bury the one line of a failure. go-redis keeps a single logger per process, so
// call it from TestMain, before m.Run.
func QuietRedisLogs() {
	if os.Getenv(LogEnv) == "" {
		redis.SetLogger(discardLogger{})
		return
	}
	redis.SetLogger(stderrLogger{})
}

type discardLogger struct{}

func (discardLogger) Printf(context.Context, string, ...any) {}

type stderrLogger struct{}

func (stderrLogger) Printf(_ context.Context, format string, v ...any) {
	fmt.Fprintf(os.Stderr, "go-redis: "+format+"\n", v...)
}

// SyncBuffer is a bytes.Buffer that a logger may write to from several goroutines
// while a test reads it. The zero value is empty and ready to use.
type SyncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

// Write appends p.
func (s *SyncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

// String returns what was written so far.
func (s *SyncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
