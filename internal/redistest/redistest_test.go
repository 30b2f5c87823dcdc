package redistest

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	QuietRedisLogs()
	// Every server, proxy and client must be gone when the tests end: a
	// leaked pump goroutine or reaper here would leak in every package that
	// uses redistest.
	goleak.VerifyTestMain(m)
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// eventually polls cond every 10ms for at most 5s. It exists for state that
// settles asynchronously (the proxy noticing a closed socket); it is not a
// timing assertion.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for range 500 {
		if cond() {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("%s: not true after 5s", what)
}

func TestStart(t *testing.T) {
	t.Parallel()
	s := Start(t)
	ctx := ctxT(t)

	if got, want := s.Addr(), net.JoinHostPort("127.0.0.1", strconv.Itoa(s.Port())); got != want {
		t.Errorf("Addr() = %q, want %q", got, want)
	}
	if s.Pid() <= 0 {
		t.Errorf("Pid() = %d, want > 0", s.Pid())
	}
	c := s.Client(t)
	if err := c.Ping(ctx).Err(); err != nil {
		t.Fatalf("PING: %v", err)
	}
	if err := c.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatalf("SET: %v", err)
	}
	if got, err := c.Get(ctx, "k").Result(); err != nil || got != "v" {
		t.Errorf("GET k = %q, %v, want \"v\", nil", got, err)
	}
	// The no-persistence defaults are what make Restart lose data.
	cfg, err := c.ConfigGet(ctx, "*").Result()
	if err != nil {
		t.Fatalf("CONFIG GET: %v", err)
	}
	for key, want := range map[string]string{"save": "", "appendonly": "no", "bind": "127.0.0.1"} {
		if cfg[key] != want {
			t.Errorf("config %s = %q, want %q", key, cfg[key], want)
		}
	}
}

func TestStartExtraArgs(t *testing.T) {
	t.Parallel()
	s := Start(t, "--requirepass", "sekret")
	ctx := ctxT(t)

	// Client picks the password up from the arguments.
	if err := s.Client(t).Ping(ctx).Err(); err != nil {
		t.Fatalf("PING with inferred password: %v", err)
	}
	// Positive control: the argument really reached the server.
	anon := redis.NewClient(&redis.Options{Addr: s.Addr(), MaxRetries: -1})
	t.Cleanup(func() { _ = anon.Close() })
	if err := anon.Ping(ctx).Err(); err == nil || !strings.Contains(err.Error(), "NOAUTH") {
		t.Errorf("PING without password = %v, want a NOAUTH error", err)
	}
}

func TestStartProcessBadArgsQuotesLog(t *testing.T) {
	t.Parallel()
	s, err := StartProcess("--no-such-directive", "x")
	if err == nil {
		_ = s.Close()
		t.Fatal("StartProcess with a bad directive succeeded, want an error")
	}
	// The server's own complaint must reach the failure message, or a
	// broken start is a guessing game.
	if !strings.Contains(err.Error(), "no-such-directive") {
		t.Errorf("StartProcess error = %v, want it to quote the server's log", err)
	}
}

func TestStartProcessClose(t *testing.T) {
	t.Parallel()
	s, err := StartProcess()
	if err != nil {
		if errors.Is(err, ErrNoServer) && os.Getenv("CI") != "true" {
			t.Skip(err)
		}
		t.Fatal(err)
	}
	if !answers(s.Addr(), "", s.Pid()) {
		t.Fatalf("server at %s does not answer after StartProcess", s.Addr())
	}
	dir := s.dir
	if err := s.Close(); err != nil {
		t.Fatalf("Close() = %v", err)
	}
	if err := s.Close(); err != nil {
		t.Errorf("second Close() = %v, want nil", err)
	}
	if s.Pid() != 0 {
		t.Errorf("Pid() after Close = %d, want 0", s.Pid())
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("stat %s after Close = %v, want not exist", dir, err)
	}
	if c, err := net.DialTimeout("tcp", s.Addr(), time.Second); err == nil {
		c.Close()
		t.Errorf("dial %s after Close succeeded, want refused", s.Addr())
	}
}

func TestRestartLosesData(t *testing.T) {
	t.Parallel()
	s := Start(t)
	ctx := ctxT(t)
	c := s.Client(t)
	if err := c.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatal(err)
	}
	addr, pid := s.Addr(), s.Pid()

	s.Restart(t)

	if s.Addr() != addr {
		t.Errorf("Addr() after Restart = %q, want %q", s.Addr(), addr)
	}
	if s.Pid() == pid || s.Pid() <= 0 {
		t.Errorf("Pid() after Restart = %d, want a new process (was %d)", s.Pid(), pid)
	}
	// The old client reconnects on its own; a command may fail once on a
	// pooled connection the restart closed, so allow one retry round.
	var got string
	var err error
	for range 3 {
		got, err = c.Get(ctx, "k").Result()
		if err == nil || errors.Is(err, redis.Nil) {
			break
		}
	}
	if !errors.Is(err, redis.Nil) {
		t.Errorf("GET k after Restart = %q, %v, want redis.Nil (data lost)", got, err)
	}
	if err := c.Set(ctx, "k", "v2", 0).Err(); err != nil {
		t.Errorf("SET after Restart: %v", err)
	}
}

func TestStopIsIdempotent(t *testing.T) {
	t.Parallel()
	s := Start(t)
	s.Stop(t)
	s.Stop(t)
	if s.Pid() != 0 {
		t.Errorf("Pid() after Stop = %d, want 0", s.Pid())
	}
	if c, err := net.DialTimeout("tcp", s.Addr(), time.Second); err == nil {
		c.Close()
		t.Errorf("dial %s after Stop succeeded, want refused", s.Addr())
	}
	// Restart brings a stopped server back on its port.
	s.Restart(t)
	if err := s.Client(t).Ping(ctxT(t)).Err(); err != nil {
		t.Errorf("PING after Stop and Restart: %v", err)
	}
}

// fakeTB records how Start gives up. Skipf and Fatalf end the calling
// goroutine as the real ones do, so Start's code after them never runs.
type fakeTB struct {
	testing.TB
	mu          sync.Mutex
	skip, fatal bool
	msg         string
}

func (f *fakeTB) Helper() {}

func (f *fakeTB) Skipf(format string, args ...any) {
	f.record(&f.skip, format, args)
	runtime.Goexit()
}

func (f *fakeTB) Fatalf(format string, args ...any) {
	f.record(&f.fatal, format, args)
	runtime.Goexit()
}

func (f *fakeTB) record(flag *bool, format string, args []any) {
	f.mu.Lock()
	defer f.mu.Unlock()
	*flag = true
	f.msg = fmt.Sprintf(format, args...)
}

func TestStartWithoutServer(t *testing.T) {
	// Not parallel: it changes PATH and CI for the whole process.
	empty := t.TempDir()
	tests := []struct {
		name, ci, bin string
		wantFatal     bool
		wantMsg       string
	}{
		{name: "local skips", ci: "", wantMsg: "apt-get install -y redis-server"},
		{name: "CI fails", ci: "true", wantFatal: true, wantMsg: "under CI a missing server is a failure"},
		{name: "bad REDIS_SERVER_BIN fails", bin: filepath.Join(empty, "redis-server"), wantFatal: true, wantMsg: "not found"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Setenv("PATH", empty)
			t.Setenv("CI", tt.ci)
			t.Setenv("REDIS_SERVER_BIN", tt.bin)

			if _, err := StartProcess(); !errors.Is(err, ErrNoServer) {
				t.Errorf("StartProcess() error = %v, want ErrNoServer", err)
			}
			f := &fakeTB{TB: t}
			done := make(chan struct{})
			go func() {
				defer close(done)
				Start(f)
			}()
			<-done
			f.mu.Lock()
			defer f.mu.Unlock()
			if f.skip == f.fatal {
				t.Fatalf("Start: skip=%v fatal=%v, want exactly one", f.skip, f.fatal)
			}
			if f.fatal != tt.wantFatal {
				t.Errorf("Start: fatal=%v, want %v (msg %q)", f.fatal, tt.wantFatal, f.msg)
			}
			if !strings.Contains(f.msg, tt.wantMsg) {
				t.Errorf("Start message = %q, want it to contain %q", f.msg, tt.wantMsg)
			}
		})
	}
}

// proxied starts a server and a proxy in front of it and returns a direct
// client (to check what the server really holds) and a proxied client with
// the given options. PoolSize 1 keeps the proxied client on one connection,
// which the tests warm before arming a fault, so the fault hits the command
// under test rather than go-redis's connection handshake.
func proxied(t *testing.T, opt redis.Options) (p *Proxy, direct, viaProxy *redis.Client) {
	t.Helper()
	s := Start(t)
	p = NewProxy(t, s.Addr())
	opt.Addr = p.Addr()
	opt.PoolSize = 1
	viaProxy = redis.NewClient(&opt)
	t.Cleanup(func() { _ = viaProxy.Close() })
	if err := viaProxy.Ping(ctxT(t)).Err(); err != nil {
		t.Fatalf("PING through proxy: %v", err)
	}
	return p, s.Client(t), viaProxy
}

func TestProxyForwards(t *testing.T) {
	t.Parallel()
	p, direct, c := proxied(t, redis.Options{})
	ctx := ctxT(t)

	if err := c.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatalf("SET through proxy: %v", err)
	}
	if got, err := direct.Get(ctx, "k").Result(); err != nil || got != "v" {
		t.Errorf("direct GET k = %q, %v, want \"v\", nil", got, err)
	}
	if got := p.Conns(); got != 1 {
		t.Errorf("Conns() = %d, want 1", got)
	}
	if got := p.Dropped(); got != 0 {
		t.Errorf("Dropped() = %d, want 0", got)
	}

	p.CloseAll()
	eventually(t, "Conns() == 0 after CloseAll", func() bool { return p.Conns() == 0 })
	// go-redis notices the reset and reconnects (default retries).
	if got, err := c.Get(ctx, "k").Result(); err != nil || got != "v" {
		t.Errorf("GET k after CloseAll = %q, %v, want \"v\", nil", got, err)
	}
}

func TestDropRepliesWithoutRetries(t *testing.T) {
	t.Parallel()
	p, direct, c := proxied(t, redis.Options{MaxRetries: -1})
	ctx := ctxT(t)

	// Positive control: unarmed, the same command succeeds.
	if err := c.Set(ctx, "control", "v", 0).Err(); err != nil {
		t.Fatalf("SET control: %v", err)
	}

	p.DropReplies(1)
	if err := c.Set(ctx, "k", "v", 0).Err(); err == nil {
		t.Fatal("SET k with its reply dropped succeeded, want an error")
	}
	if got := p.Dropped(); got != 1 {
		t.Errorf("Dropped() = %d, want 1", got)
	}
	// The client saw a failure, yet the write landed.
	if got, err := direct.Get(ctx, "k").Result(); err != nil || got != "v" {
		t.Errorf("direct GET k = %q, %v, want \"v\", nil: the server should have applied the SET", got, err)
	}
}

// TestDropRepliesRetriedSetNX documents the failure a Redis lock must handle:
// go-redis retries a command whose reply was lost, and the retried SET NX
// finds the key its own first attempt wrote, so the caller is told "not
// acquired" while it in fact holds the key.
func TestDropRepliesRetriedSetNX(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		// setNX returns whether the client reports the key as set.
		setNX func(ctx context.Context, c *redis.Client, key string) (bool, error)
	}{
		{"SetNX", func(ctx context.Context, c *redis.Client, key string) (bool, error) {
			return c.SetNX(ctx, key, "token", time.Minute).Result()
		}},
		{"SetArgs NX", func(ctx context.Context, c *redis.Client, key string) (bool, error) {
			err := c.SetArgs(ctx, key, "token", redis.SetArgs{Mode: "NX", TTL: time.Minute}).Err()
			if errors.Is(err, redis.Nil) {
				return false, nil
			}
			return err == nil, err
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			p, direct, c := proxied(t, redis.Options{}) // default retries
			ctx := ctxT(t)

			// Positive control: unarmed, SET NX on a fresh key reports set.
			if ok, err := tt.setNX(ctx, c, "control"); err != nil || !ok {
				t.Fatalf("control SET NX = %v, %v, want true, nil", ok, err)
			}

			p.DropReplies(1)
			ok, err := tt.setNX(ctx, c, "lock")
			if err != nil || ok {
				t.Errorf("retried SET NX = %v, %v, want false, nil (the retry found the first attempt's key)", ok, err)
			}
			if got := p.Dropped(); got != 1 {
				t.Errorf("Dropped() = %d, want 1", got)
			}
			if got, err := direct.Get(ctx, "lock").Result(); err != nil || got != "token" {
				t.Errorf("direct GET lock = %q, %v, want \"token\", nil: the first attempt's write should have landed", got, err)
			}
		})
	}
}

func TestBlackhole(t *testing.T) {
	t.Parallel()
	p, direct, c := proxied(t, redis.Options{MaxRetries: -1, ReadTimeout: 200 * time.Millisecond})
	ctx := ctxT(t)

	// Positive control: before the blackhole the same command succeeds.
	if err := c.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatalf("SET before blackhole: %v", err)
	}

	p.Blackhole(true)
	err := c.Set(ctx, "k", "v2", 0).Err()
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() {
		t.Fatalf("SET during blackhole = %v, want a timeout error", err)
	}
	// Nothing was delivered.
	if got, err := direct.Get(ctx, "k").Result(); err != nil || got != "v" {
		t.Errorf("direct GET k = %q, %v, want \"v\", nil: the blackholed SET must not arrive", got, err)
	}

	p.Blackhole(false)
	if err := c.Set(ctx, "k", "v3", 0).Err(); err != nil {
		t.Errorf("SET after blackhole lifted: %v", err)
	}
	if got, err := direct.Get(ctx, "k").Result(); err != nil || got != "v3" {
		t.Errorf("direct GET k = %q, %v, want \"v3\", nil", got, err)
	}
}

// TestBlackholeOffClosesSwallowedConns checks that lifting the blackhole
// closes exactly the connections whose bytes it swallowed: their request and
// reply streams no longer match, while an idle connection is still sound.
func TestBlackholeOffClosesSwallowedConns(t *testing.T) {
	t.Parallel()
	s := Start(t)
	p := NewProxy(t, s.Addr())
	dial := func() (net.Conn, *bufio.Reader) {
		c, err := net.DialTimeout("tcp", p.Addr(), time.Second)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Close() })
		return c, bufio.NewReader(c)
	}
	ping := func(c net.Conn, r *bufio.Reader) (string, error) {
		_ = c.SetDeadline(time.Now().Add(2 * time.Second))
		if _, err := c.Write(resp("PING")); err != nil {
			return "", err
		}
		return r.ReadString('\n')
	}
	swallowed, swallowedR := dial()
	idle, idleR := dial()
	eventually(t, "Conns() == 2", func() bool { return p.Conns() == 2 })

	p.Blackhole(true)
	if _, err := swallowed.Write(resp("PING")); err != nil {
		t.Fatal(err)
	}
	// The write is swallowed only once the proxy has read it; wait for that
	// rather than for a guessed duration.
	eventually(t, "proxy swallowed the PING", func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		for c := range p.conns {
			if c.tainted {
				return true
			}
		}
		return false
	})
	p.Blackhole(false)

	if line, err := ping(swallowed, swallowedR); err == nil {
		t.Errorf("PING on a swallowed connection after the blackhole = %q, want the connection closed", line)
	}
	if line, err := ping(idle, idleR); err != nil || line != "+PONG\r\n" {
		t.Errorf("PING on an idle connection after the blackhole = %q, %v, want +PONG", line, err)
	}
}

func TestStartCluster(t *testing.T) {
	t.Parallel()
	for _, n := range []int{1, 3} {
		t.Run(strconv.Itoa(n), func(t *testing.T) {
			t.Parallel()
			addrs := StartCluster(t, n)
			if len(addrs) != n {
				t.Fatalf("StartCluster(%d) returned %d addresses, want %d", n, len(addrs), n)
			}
			ctx := ctxT(t)
			cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs})
			t.Cleanup(func() { _ = cc.Close() })
			var mu sync.Mutex
			masters := map[string]bool{}
			err := cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error {
				mu.Lock()
				defer mu.Unlock()
				masters[c.Options().Addr] = true
				return nil
			})
			if err != nil || len(masters) != n {
				t.Fatalf("ForEachMaster saw %d masters (%v), want %d", len(masters), err, n)
			}
			// Every slot is served: keys spread over all slots can be written.
			for i := range 50 {
				if err := cc.Set(ctx, "k"+strconv.Itoa(i), "v", 0).Err(); err != nil {
					t.Fatalf("SET k%d on the cluster: %v", i, err)
				}
			}
		})
	}
}

// TestLaunchHighPortIsRetryable checks that a cluster node given a port too high
// for its bus port (port+10000) fails with errBind, so start picks another port.
func TestLaunchHighPortIsRetryable(t *testing.T) {
	t.Parallel()
	bin, err := lookupServer()
	if err != nil {
		t.Skip(err)
	}
	// FreePort rarely returns such a port on Linux (bind picks from the lower
	// half of the ephemeral range), so look for a free one up there.
	port := 0
	for p := 65535 - 9000; p < 65535 && port == 0; p += 97 {
		if ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p))); err == nil {
			ln.Close()
			port = p
		}
	}
	if port == 0 {
		t.Skip("no free port above 55535")
	}
	dir := t.TempDir()
	cluster := []string{"--cluster-enabled", "yes", "--cluster-config-file", filepath.Join(dir, "nodes.conf")}
	s := &Server{bin: bin, dir: dir, port: port, args: cluster}
	if p, err := s.launch(time.Now().Add(readyTimeout)); !errors.Is(err, errBind) {
		if err == nil {
			_ = p.stop()
		}
		t.Errorf("launch of a cluster node on port %d = %v, want errBind", port, err)
	}
	// Control: the same port without cluster mode starts.
	s.args = nil
	p, err := s.launch(time.Now().Add(readyTimeout))
	if err != nil {
		t.Fatalf("control: launch on port %d without cluster mode: %v", port, err)
	}
	if err := p.stop(); err != nil {
		t.Error(err)
	}
}
