package redistest

import (
	"crypto/rand"
	"encoding/hex"
	"strings"
	"sync"
	"testing"

	"github.com/redis/go-redis/v9"
)

// Shared is a redis-server that the tests of one package share, started on the
// first Client call: tests that need only a clean key space use keys of their own
// (UniqueKey) instead of a process each. A package's TestMain calls Close after its
// tests. The zero Shared is ready to use; it is safe for concurrent use.
type Shared struct {
	once sync.Once
	srv  *Server
	err  error
}

// Client returns a client of the shared server, closed when t ends. A missing
// server is reported as Start reports it: a skip, or a failure under CI.
func (s *Shared) Client(t testing.TB) *redis.Client {
	t.Helper()
	s.once.Do(func() { s.srv, s.err = StartProcess() })
	if s.err != nil {
		Start(t) // reports a missing server as Start does: skip, or fail under CI
		t.Fatalf("redis-server: %v", s.err)
	}
	rdb := redis.NewClient(&redis.Options{Addr: s.srv.Addr()})
	t.Cleanup(func() { _ = rdb.Close() })
	return rdb
}

// Close stops the server if it was started.
func (s *Shared) Close() {
	if s.srv != nil {
		_ = s.srv.Close()
	}
}

// UniqueKey is a key no other test uses: the test's name and a random suffix.
func UniqueKey(t testing.TB) string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return strings.ReplaceAll(t.Name(), "/", ":") + ":" + hex.EncodeToString(b[:])
}
