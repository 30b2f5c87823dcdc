package cli

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
)

// startTLS starts a redis-server that speaks plain TCP on its Addr and TLS on the
// returned address, with a self-signed certificate for 127.0.0.1 that no system
// trusts.
func startTLS(t *testing.T) (s *redistest.Server, tlsAddr string) {
	t.Helper()
	dir := t.TempDir()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	cert := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "127.0.0.1"},
		IPAddresses:           []net.IP{net.ParseIP("127.0.0.1")},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		IsCA:                  true,
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, cert, cert, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	for name, block := range map[string]*pem.Block{
		"cert.pem": {Type: "CERTIFICATE", Bytes: der},
		"key.pem":  {Type: "EC PRIVATE KEY", Bytes: keyDER},
	} {
		if err := os.WriteFile(filepath.Join(dir, name), pem.EncodeToMemory(block), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	port, err := redistest.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	s = redistest.Start(t,
		"--tls-port", strconv.Itoa(port),
		"--tls-cert-file", filepath.Join(dir, "cert.pem"),
		"--tls-key-file", filepath.Join(dir, "key.pem"),
		"--tls-ca-cert-file", filepath.Join(dir, "cert.pem"),
		"--tls-auth-clients", "no")
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
