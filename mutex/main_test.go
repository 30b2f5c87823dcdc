package mutex

import (
	"fmt"
	"os"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
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
