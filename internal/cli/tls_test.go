package cli

import (
	"net"
	"strconv"
	"strings"
	"testing"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
)

// startTLS starts a redis-server that speaks plain TCP on its Addr and TLS on the
// returned address, with a certificate for 127.0.0.1 that no system trusts.
func startTLS(t *testing.T) (s *redistest.Server, tlsAddr string) {
	t.Helper()
	dir := t.TempDir()
	if _, err := redistest.WriteCerts(dir); err != nil {
		t.Fatal(err)
	}
	port, err := redistest.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	s = redistest.Start(t, redistest.TLSArgs(dir, port)...)
	return s, net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
}

func TestTLS(t *testing.T) {
	t.Parallel()
	s, tlsAddr := startTLS(t)
	lock(t, newLocks(t, s.Client(t)), `["over-tls"]`, "job", "task-1")

	ok := []struct {
		name string
		env  map[string]string
		args []string
	}{
		{"--tls --insecure", nil, []string{"--tls", "--insecure", "--uri", tlsAddr}},
		{"--tls_server --insecure", nil, []string{"--tls_server", "127.0.0.1", "--insecure", "--uri", tlsAddr}},
		{"rediss:// --insecure", map[string]string{"REDIS_URL": "rediss://" + tlsAddr}, []string{"--insecure"}},
		{"rediss:// skip_verify", map[string]string{"REDIS_URL": "rediss://" + tlsAddr + "?skip_verify=true"}, nil},
	}
	for _, tt := range ok {
		r := cli(t, tt.env, append([]string{"list"}, tt.args...)...)
		if r.code != 0 || !strings.Contains(r.stdout, `["over-tls"]`) {
			t.Errorf("%s: %v\nwant the lock listed", tt.name, r)
		}
	}
	fail := []struct {
		name string
		args []string
		want string
	}{
		{"unverified certificate", []string{"--tls", "--uri", tlsAddr}, "--insecure"},
		{"TLS to a plain port", []string{"--tls", "--insecure", "--uri", s.Addr()}, "without --tls"},
		{"plain to a TLS port", []string{"--uri", tlsAddr}, "add --tls"},
	}
	for _, tt := range fail {
		r := cli(t, nil, append([]string{"list"}, tt.args...)...)
		if r.code != exitFailure || !strings.Contains(r.stderr, tt.want) {
			t.Errorf("%s: %v\nwant exit 1 and %q", tt.name, r, tt.want)
		}
	}
}
