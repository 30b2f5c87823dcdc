package main

import (
	"os"
	"testing"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
)

func TestMain(m *testing.M) {
	redistest.QuietRedisLogs()
	os.Exit(m.Run())
}
