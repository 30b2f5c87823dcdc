package order

import (
	"fmt"
	"os"
	"testing"

	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
)

func TestMain(m *testing.M) {
	redistest.QuietRedisLogs()
	code := m.Run()
	shared.Close()
	if err := goleak.Find(); err != nil && code == 0 {
		fmt.Fprintf(os.Stderr, "goleak: %v\n", err)
		code = 1
	}
	os.Exit(code)
}

// shared is the redis-server the package's tests share; each test uses keys of its
// own (uniqueKey).
var shared redistest.Shared

func sharedServer(t *testing.T) *redis.Client { return shared.Client(t) }

func uniqueKey(t *testing.T) string { return redistest.UniqueKey(t) }
