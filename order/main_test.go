package order

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"

	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
)

func TestMain(m *testing.M) {
	redistest.QuietRedisLogs()
	code := m.Run()
	if server != nil {
		_ = server.Close()
	}
	if err := goleak.Find(); err != nil && code == 0 {
		fmt.Fprintf(os.Stderr, "goleak: %v\n", err)
		code = 1
	}
	os.Exit(code)
}

var (
	serverOnce sync.Once
	server     *redistest.Server
	serverErr  error
)

// sharedServer is a client of the redis-server the package's tests share, started
// on first use; each test uses keys of its own (uniqueKey).
func sharedServer(t *testing.T) *redis.Client {
	t.Helper()
	serverOnce.Do(func() { server, serverErr = redistest.StartProcess() })
	if serverErr != nil {
		redistest.Start(t) // reports a missing server as Start does: skip, or fail under CI
		t.Fatalf("redis-server: %v", serverErr)
	}
	rdb := redis.NewClient(&redis.Options{Addr: server.Addr()})
	t.Cleanup(func() { rdb.Close() })
	return rdb
}

func uniqueKey(t *testing.T) string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return strings.ReplaceAll(t.Name(), "/", ":") + ":" + hex.EncodeToString(b[:])
}
