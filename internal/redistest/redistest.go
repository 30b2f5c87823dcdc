// Package redistest runs real redis-server processes, and fault-injecting TCP
// proxies in front of them, for tests and benchmarks.
//
// Tests call Start, which skips the test when no redis-server binary is
// installed, unless CI=true, where a missing server fails the test so a broken
// CI image cannot turn the whole integration suite into silent skips. Code
// outside tests (benchmarks under bench/) calls StartProcess and Close.
// StartCluster starts several servers in cluster mode and joins them.
//
// Every server listens on 127.0.0.1 only, on its own free port, with no
// persistence (no RDB snapshots, no AOF) and its own temporary --dir, so tests
// in different packages and processes can run in parallel without sharing
// state.
package redistest

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// ErrNoServer is returned by StartProcess when no redis-server binary can be
// found in $REDIS_SERVER_BIN or on $PATH. Match it with errors.Is.
var ErrNoServer = errors.New("redistest: redis-server not found")

// Bounds on waiting for a server. They are generous because a loaded CI
// machine running the race detector can be slow to fork and exec, and they
// are bounds, not expected durations: a healthy redis-server answers within
// milliseconds.
const (
	readyTimeout = 10 * time.Second
	pollInterval = 10 * time.Millisecond
	// stopTimeout is how long SIGTERM gets before SIGKILL. Without
	// persistence redis has nothing to flush, so it exits at once.
	stopTimeout = 5 * time.Second
	// bindAttempts bounds how often Start picks a new port after losing the
	// race for a port between choosing it and redis binding it.
	bindAttempts = 5
	// rebindTimeout bounds how long Restart retries binding the old port.
	rebindTimeout = 5 * time.Second
	// outputLimit is how much of the server's log is kept; only the tail
	// matters for explaining a failure.
	outputLimit = 64 << 10
	// tailLines is how many log lines failure messages quote.
	tailLines = 20
)

// Server is one redis-server child process listening on 127.0.0.1.
//
// Create it with Start (tests) or StartProcess (other code). Its methods are
// safe for concurrent use; Addr and Port do not change across Restart.
type Server struct {
	bin      string
	dir      string
	removeOK bool // dir was made by StartProcess, so Close removes it
	port     int
	args     []string
	password string

	mu   sync.Mutex
	proc *process // nil while stopped
}

// process is one run of redis-server. Restart replaces it; the port stays.
type process struct {
	cmd  *exec.Cmd
	out  *tailBuffer
	done chan struct{} // closed once cmd.Wait has returned
	err  error         // cmd.Wait's result; read only after done is closed
}

// Start starts a fresh redis-server for the test on a free 127.0.0.1 port and
// stops it in t.Cleanup. args are appended to the command line, after the
// defaults (--port, --bind 127.0.0.1, --save "", --appendonly no, --dir with
// a t.TempDir()), so they can add settings such as "--requirepass", "x" or
// override a default; a later setting wins in redis. Do not override --port
// or --bind: Addr would no longer name the server.
//
// Start returns once the new process answers on its port (or asks for a
// password it was not given), or fails the test with the tail of the
// server's log after 10s. When no
// redis-server binary is found it skips the test, except when the environment
// variable CI is "true", where it fails the test instead. Setting
// REDIS_SERVER_BIN to a path that does not exist always fails the test,
// because an explicit setting that is wrong should not look like a skip.
//
// Start is safe to call from parallel tests: each call gets its own process,
// port and directory.
func Start(t testing.TB, args ...string) *Server {
	t.Helper()
	bin, err := lookupServer()
	if err != nil {
		if os.Getenv("REDIS_SERVER_BIN") == "" && os.Getenv("CI") != "true" {
			t.Skipf("%v; install it to run this test: apt-get install -y redis-server (or set REDIS_SERVER_BIN to its path)", err)
		}
		t.Fatalf("%v; under CI a missing server is a failure: install it with apt-get install -y redis-server", err)
	}
	s, err := start(bin, t.TempDir(), false, args)
	if err != nil {
		t.Fatalf("redistest.Start: %v", err)
	}
	// Registered after t.TempDir, so it runs before the directory is
	// removed: redis must be gone before its --dir is.
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Errorf("redistest: stopping redis-server on %s: %v", s.Addr(), err)
		}
	})
	return s
}

// StartProcess is Start for code that has no testing.TB, such as benchmarks
// in a main package. It returns ErrNoServer (wrapped) when no binary is
// found, and otherwise an error quoting the tail of the server's log if the
// server does not answer within 10s. The caller must call Close, which also
// removes the server's temporary directory.
//
// StartProcess is safe for concurrent use.
func StartProcess(args ...string) (*Server, error) {
	bin, err := lookupServer()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "redistest-")
	if err != nil {
		return nil, fmt.Errorf("redistest: %w", err)
	}
	s, err := start(bin, dir, true, args)
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	return s, nil
}

// lookupServer honours REDIS_SERVER_BIN so a machine can test against a
// redis-server that is not on PATH (a source build, another version).
func lookupServer() (string, error) {
	name := "redis-server"
	if env := os.Getenv("REDIS_SERVER_BIN"); env != "" {
		name = env
	}
	bin, err := exec.LookPath(name)
	if err != nil {
		return "", fmt.Errorf("%w (looked for %q: %v)", ErrNoServer, name, err)
	}
	return bin, nil
}

func start(bin, dir string, removeOK bool, args []string) (*Server, error) {
	s := &Server{
		bin:      bin,
		dir:      dir,
		removeOK: removeOK,
		args:     append([]string(nil), args...),
		password: passwordFrom(args),
	}
	var lastErr error
	for range bindAttempts {
		port, err := FreePort()
		if err != nil {
			return nil, err
		}
		s.port = port
		p, err := s.launch(time.Now().Add(readyTimeout))
		if err == nil {
			s.proc = p
			return s, nil
		}
		lastErr = err
		// Another process may have taken the port between FreePort closing
		// its listener and redis binding, or a cluster node's bus port; only
		// that is worth another port.
		if !errors.Is(err, errBind) {
			return nil, err
		}
	}
	return nil, fmt.Errorf("redistest: no free port after %d attempts: %w", bindAttempts, lastErr)
}

// FreePort asks the kernel for an unused port on 127.0.0.1. The port is free only
// until someone else takes it, which is why Start retries; an address built from it
// is also a handy "nothing listens here" for tests of an unreachable Redis. It is
// safe for concurrent use.
func FreePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("redistest: finding a free port: %w", err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// passwordFrom lets Client authenticate when the test started the server
// with --requirepass, so callers need not repeat the password.
func passwordFrom(args []string) string {
	pw := ""
	for i := 0; i+1 < len(args); i++ {
		if args[i] == "--requirepass" {
			pw = args[i+1] // the last one wins, as in redis
		}
	}
	return pw
}

// errBind marks a start that failed because of the port it was given: taken, or
// (for a cluster node) too high to leave room for the cluster bus port.
var errBind = errors.New("port in use")

// launch runs redis-server on s.port and waits until it answers or deadline
// passes. It does not touch s.proc, so callers decide under which lock to
// publish the result.
func (s *Server) launch(deadline time.Time) (*process, error) {
	argv := []string{
		"--port", strconv.Itoa(s.port),
		"--bind", "127.0.0.1",
		"--save", "",
		"--appendonly", "no",
		"--dir", s.dir,
		"--daemonize", "no",
		"--logfile", "", // log to stdout, which we capture
	}
	argv = append(argv, s.args...)
	out := &tailBuffer{}
	cmd := exec.Command(s.bin, argv...)
	cmd.SysProcAttr = dieWithParent()
	cmd.Dir = s.dir
	cmd.Stdout = out
	cmd.Stderr = out
	// A child that inherited the output pipe (a BGSAVE fork a test
	// triggered) must not keep Wait, and so the test, hanging.
	cmd.WaitDelay = time.Second
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("redistest: starting %s: %w", s.bin, err)
	}
	p := &process{cmd: cmd, out: out, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()

	addr := s.Addr()
	for {
		select {
		case <-p.done:
			err := fmt.Errorf("redistest: redis-server on %s exited before answering (%v); log tail:\n%s", addr, p.err, out.Tail(tailLines))
			// A cluster node also binds port+10000 for its bus, which may be taken or,
			// for a port above 55535, beyond the last port: another port will do.
			if out.Contains("Address already in use") || out.Contains("port number too high") {
				err = fmt.Errorf("%w: %w", errBind, err)
			}
			return nil, err
		default:
		}
		if answers(addr, s.password, cmd.Process.Pid) {
			return p, nil
		}
		if time.Now().After(deadline) {
			stopErr := p.stop()
			return nil, fmt.Errorf("redistest: redis-server on %s did not answer PING within %v (stop: %v); log tail:\n%s", addr, readyTimeout, stopErr, out.Tail(tailLines))
		}
		time.Sleep(pollInterval)
	}
}

// answers reports whether the redis-server with process id pid accepts
// connections at addr. It asks for INFO rather than just PING because the
// port was free only when FreePort checked: if a stranger's redis took it,
// its PONG must not pass for ours, and our own process is about to exit with
// "Address already in use". When the server demands a password we do not know
// (ACL arguments), -NOAUTH is taken as "up", since identity cannot be checked.
// -LOADING is not "up": the server cannot serve commands yet.
func answers(addr, password string, pid int) bool {
	c, err := net.DialTimeout("tcp", addr, 200*time.Millisecond)
	if err != nil {
		return false
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(time.Second))
	r := bufio.NewReader(c)
	if password != "" {
		if _, err := c.Write(resp("AUTH", password)); err != nil {
			return false
		}
		if line, err := r.ReadString('\n'); err != nil || !strings.HasPrefix(line, "+OK") {
			return false
		}
	}
	if _, err := c.Write(resp("INFO", "server")); err != nil {
		return false
	}
	line, err := r.ReadString('\n')
	if err != nil {
		return false
	}
	if strings.HasPrefix(line, "-NOAUTH") {
		return true
	}
	if !strings.HasPrefix(line, "$") {
		return false
	}
	n, err := strconv.Atoi(strings.TrimSpace(line[1:]))
	if err != nil || n < 0 || n > 1<<20 {
		return false
	}
	body := make([]byte, n+2)
	if _, err := io.ReadFull(r, body); err != nil {
		return false
	}
	return strings.Contains(string(body), "\r\nprocess_id:"+strconv.Itoa(pid)+"\r\n")
}

// resp encodes a command as a RESP array of bulk strings.
func resp(args ...string) []byte {
	var b strings.Builder
	fmt.Fprintf(&b, "*%d\r\n", len(args))
	for _, a := range args {
		fmt.Fprintf(&b, "$%d\r\n%s\r\n", len(a), a)
	}
	return []byte(b.String())
}

// stop sends SIGTERM, then SIGKILL if the process is still alive after
// stopTimeout, and waits until it has been reaped. It returns nil when the
// process exited in response to SIGTERM, whatever its status, and an error
// if it had to be killed or could not be reaped.
func (p *process) stop() error {
	select {
	case <-p.done:
		return nil // exited already; the caller has no use for the status
	default:
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
		return nil
	case <-time.After(stopTimeout):
	}
	_ = p.cmd.Process.Kill()
	select {
	case <-p.done:
		return fmt.Errorf("redis-server ignored SIGTERM for %v and was killed; log tail:\n%s", stopTimeout, p.out.Tail(tailLines))
	case <-time.After(stopTimeout):
		return fmt.Errorf("redis-server pid %d survived SIGKILL for %v", p.cmd.Process.Pid, stopTimeout)
	}
}

// Addr returns the server's address, "127.0.0.1:<port>". It is the same
// before and after Restart, and is safe for concurrent use.
func (s *Server) Addr() string {
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port))
}

// Port returns the server's TCP port. It is the same before and after
// Restart, and is safe for concurrent use.
func (s *Server) Port() int {
	return s.port
}

// Pid returns the process id of the running redis-server, or 0 after Stop or
// Close. Restart changes it. It is safe for concurrent use.
func (s *Server) Pid() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc == nil {
		return 0
	}
	return s.proc.cmd.Process.Pid
}

// Client returns a new go-redis client for the server with default options
// (and the --requirepass password, if one was given), closed in t.Cleanup.
// The client survives Restart: go-redis replaces its broken connections, though
// commands in flight across a restart fail. It is safe for concurrent use.
func (s *Server) Client(t testing.TB) *redis.Client {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: s.Addr(), Password: s.password})
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// Restart stops the server and starts a new one on the same port with the
// same arguments. Because the server keeps no persistence, every key is lost,
// which is how tests simulate "Redis restarted without persistence". Clients
// see their open connections closed. Restart after Stop starts the server
// again.
//
// On failure (for example, another process took the port while it was free)
// Restart fails the test with the tail of the server's log, after retrying
// the bind for up to 5s. It is safe for concurrent use; concurrent calls are
// serialised.
func (s *Server) Restart(t testing.TB) {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc != nil {
		err := s.proc.stop()
		s.proc = nil
		if err != nil {
			t.Fatalf("redistest.Restart: stopping %s: %v", s.Addr(), err)
		}
	}
	deadline := time.Now().Add(rebindTimeout)
	for {
		p, err := s.launch(time.Now().Add(readyTimeout))
		if err == nil {
			s.proc = p
			return
		}
		// A port in TIME_WAIT does not stop redis (it sets SO_REUSEADDR),
		// but a stranger that grabbed the port might let go soon.
		if !errors.Is(err, errBind) || time.Now().After(deadline) {
			t.Fatalf("redistest.Restart: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Stop stops the server now: SIGTERM, then SIGKILL after 5s, then reaping the
// process. It is idempotent, and Restart may start the server again. A server
// that had to be killed fails the test. It is safe for concurrent use.
func (s *Server) Stop(t testing.TB) {
	t.Helper()
	if err := s.stop(); err != nil {
		t.Errorf("redistest.Stop: %s: %v", s.Addr(), err)
	}
}

func (s *Server) stop() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc == nil {
		return nil
	}
	err := s.proc.stop()
	s.proc = nil
	return err
}

// Close stops the server as Stop does and, for a server from StartProcess,
// removes its temporary directory. It returns an error if the server had to
// be killed or the directory could not be removed. Close is idempotent and
// safe for concurrent use; servers from Start are closed by t.Cleanup.
func (s *Server) Close() error {
	err := s.stop()
	if s.removeOK {
		if rmErr := os.RemoveAll(s.dir); rmErr != nil {
			err = errors.Join(err, rmErr)
		}
	}
	return err
}

// tailBuffer keeps the last outputLimit bytes written to it. exec.Cmd writes
// to it from its own goroutine while failure paths read it, hence the lock.
type tailBuffer struct {
	mu  sync.Mutex
	buf []byte
}

func (b *tailBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf = append(b.buf, p...)
	if over := len(b.buf) - outputLimit; over > 0 {
		b.buf = append(b.buf[:0], b.buf[over:]...)
	}
	return len(p), nil
}

// Contains reports whether the kept output contains s.
func (b *tailBuffer) Contains(s string) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return strings.Contains(string(b.buf), s)
}

// Tail returns the last n lines of the kept output.
func (b *tailBuffer) Tail(n int) string {
	b.mu.Lock()
	defer b.mu.Unlock()
	lines := strings.Split(strings.TrimRight(string(b.buf), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
