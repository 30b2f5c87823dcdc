package mutex

import (
	"fmt"
	"log/slog"
	"os"
	"testing"

	"go.uber.org/goleak"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
)

func TestMain(m *testing.M) {
	redistest.QuietRedisLogs()
	if os.Getenv(redistest.LogEnv) == "" {
		// The Client's own warnings (a subscription lost, a renewal unanswered) are
		// what many tests cause on purpose; those that check them set Logger.
		slog.SetDefault(slog.New(slog.DiscardHandler))
	}
	code := m.Run()
	if server != nil {
		_ = server.Close()
	}
	if certDir != "" {
		_ = os.RemoveAll(certDir)
	}
	if err := goleak.Find(); err != nil && code == 0 {
		fmt.Fprintf(os.Stderr, "goleak: %v\n", err)
		code = 1
	}
	os.Exit(code)
}
