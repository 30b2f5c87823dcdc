//go:build linux

package failover

// The deployments the battery fails over, all on 127.0.0.1: a Sentinel-managed
// master with two replicas and three sentinels (quorum 2), and a Cluster of three
// masters with one replica each. Every timing here is the deployment's own failure
// detection (down-after-milliseconds, cluster-node-timeout), set by the test.

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
)

const masterName = "mymaster"

// downAfter is how long sentinels wait before they call a silent master down
// (down-after-milliseconds), and the cluster's node timeout: the time a failover
// takes to start. Every wait for a failover below is a multiple of it.
const downAfter = time.Second

// topoTimeout bounds waiting for a deployment to form or settle after a fault.
const topoTimeout = 30 * time.Second

// sentinelTopo is a master, its replicas, and the sentinels watching them.
type sentinelTopo struct {
	master    *redistest.Server
	replicas  []*redistest.Server
	sentinels []string // addresses
	// proxy, when the topology was started for partitions, stands between the master
	// and everyone else but the clients that connect to the master directly: the
	// replicas replicate through it and the sentinels watch the master through it.
	proxy *redistest.Proxy
}

// sentinelConfig shapes a sentinel deployment.
type sentinelConfig struct {
	// ServerArgs are added to every redis-server's command line (the replicas' too:
	// one of them becomes the master).
	ServerArgs []string
	// ViaProxy puts a proxy between the master and its replicas and sentinels.
	ViaProxy bool
	// Debug are SENTINEL DEBUG parameters and values set on every sentinel.
	Debug []string
}

// startSentinelTopo starts a master, two replicas and three sentinels and returns
// once every sentinel knows both replicas and the two other sentinels, so that a
// failover can be agreed.
func startSentinelTopo(t testing.TB, cfg sentinelConfig) *sentinelTopo {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), topoTimeout)
	defer cancel()
	// The first master serves the replicas' first sync at once rather than after the
	// default 5 s wait for more replicas; the servers that may serve a sync after a
	// failover keep the configuration under test.
	st := &sentinelTopo{master: redistest.Start(t, append([]string{"--repl-diskless-sync-delay", "0"}, cfg.ServerArgs...)...)}
	watched := st.master.Addr()
	if cfg.ViaProxy {
		st.proxy = redistest.NewProxy(t, st.master.Addr())
		watched = st.proxy.Addr()
	}
	host, port, _ := net.SplitHostPort(watched)
	for range 2 {
		args := append([]string{"--replicaof", host, port}, cfg.ServerArgs...)
		st.replicas = append(st.replicas, redistest.Start(t, args...))
	}
	mc := st.master.Client(t)
	waitFor(t, ctx, "the master sees both replicas online", func() (bool, string) {
		info, err := mc.Info(ctx, "replication").Result()
		return err == nil && strings.Count(info, "state=online") == 2, fmt.Sprint(info, err)
	})
	for range 3 {
		st.sentinels = append(st.sentinels, startSentinel(t, host, port))
	}
	for _, addr := range st.sentinels {
		c := sentinelClient(t, addr)
		if len(cfg.Debug) > 0 {
			dc := redis.NewClient(&redis.Options{Addr: addr})
			err := dc.Do(ctx, append([]any{"SENTINEL", "DEBUG"}, toAny(cfg.Debug)...)...).Err()
			_ = dc.Close()
			if err != nil {
				t.Fatalf("SENTINEL DEBUG %v on %s: %v", cfg.Debug, addr, err)
			}
		}
		waitFor(t, ctx, "sentinel "+addr+" knows the replicas and the other sentinels", func() (bool, string) {
			m, err := c.Master(ctx, masterName).Result()
			return err == nil && m["num-slaves"] == "2" && m["num-other-sentinels"] == "2", fmt.Sprint(m, err)
		})
	}
	return st
}

// startSentinel starts `redis-server --sentinel` watching the master at host:port and
// stops it in t.Cleanup.
func startSentinel(t testing.TB, host, port string) string {
	t.Helper()
	bin := os.Getenv("REDIS_SERVER_BIN")
	if bin == "" {
		bin = "redis-server"
	}
	path, err := exec.LookPath(bin)
	if err != nil {
		if os.Getenv("CI") == "true" || os.Getenv("REDIS_SERVER_BIN") != "" {
			t.Fatalf("no redis-server for sentinels (%v); under CI a missing server is a failure", err)
		}
		t.Skipf("no redis-server for sentinels: %v", err)
	}
	dir := t.TempDir()
	for range 5 {
		p, err := redistest.FreePort()
		if err != nil {
			t.Fatal(err)
		}
		conf := filepath.Join(dir, "sentinel-"+strconv.Itoa(p)+".conf")
		text := fmt.Sprintf("port %d\nbind 127.0.0.1\ndir %s\nlogfile \"\"\n"+
			"sentinel monitor %s %s %s 2\n"+
			"sentinel down-after-milliseconds %s %d\n"+
			"sentinel failover-timeout %s %d\n",
			p, dir, masterName, host, port, masterName, downAfter.Milliseconds(), masterName, (10 * downAfter).Milliseconds())
		if err := os.WriteFile(conf, []byte(text), 0o600); err != nil {
			t.Fatal(err)
		}
		out := &syncBuffer{}
		cmd := exec.Command(path, conf, "--sentinel")
		cmd.Dir, cmd.Stdout, cmd.Stderr = dir, out, out
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		cmd.WaitDelay = time.Second
		if err := cmd.Start(); err != nil {
			t.Fatalf("starting sentinel: %v", err)
		}
		exited := make(chan struct{})
		go func() { _ = cmd.Wait(); close(exited) }()
		t.Cleanup(func() {
			_ = cmd.Process.Signal(syscall.SIGTERM)
			select {
			case <-exited:
			case <-time.After(5 * time.Second):
				_ = cmd.Process.Kill()
				<-exited
			}
		})
		addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(p))
		c := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1, DialTimeout: 200 * time.Millisecond})
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
			if c.Ping(context.Background()).Err() == nil {
				_ = c.Close()
				return addr
			}
			select {
			case <-exited:
				deadline = time.Time{}
			default:
			}
		}
		_ = c.Close()
		if !strings.Contains(out.String(), "Address already in use") {
			t.Fatalf("sentinel on %s did not answer; output:\n%s", addr, out.String())
		}
	}
	t.Fatalf("no free port for a sentinel after 5 attempts")
	return ""
}

func sentinelClient(t testing.TB, addr string) *redis.SentinelClient {
	t.Helper()
	c := redis.NewSentinelClient(&redis.Options{Addr: addr, DialTimeout: time.Second})
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// masterAddr is the master's address according to the sentinel at addr.
func (st *sentinelTopo) masterAddr(ctx context.Context, c *redis.SentinelClient) string {
	res, err := c.GetMasterAddrByName(ctx, masterName).Result()
	if err != nil || len(res) != 2 {
		return ""
	}
	return net.JoinHostPort(res[0], res[1])
}

// nodes are the addresses of the master and its replicas.
func (st *sentinelTopo) nodes() []string {
	out := []string{st.master.Addr()}
	for _, r := range st.replicas {
		out = append(out, r.Addr())
	}
	return out
}

func toAny(ss []string) []any {
	out := make([]any, len(ss))
	for i, s := range ss {
		out[i] = s
	}
	return out
}

// conn is how clients reach this deployment.
func (st *sentinelTopo) conn(tuned bool) connSpec {
	return connSpec{Kind: "sentinel", Addrs: st.sentinels, MasterName: masterName, Tuned: tuned}
}

// signal sends sig to the redis-server s.
func signal(t testing.TB, s *redistest.Server, sig syscall.Signal) {
	t.Helper()
	if err := syscall.Kill(s.Pid(), sig); err != nil {
		t.Fatalf("%v to redis-server %s: %v", sig, s.Addr(), err)
	}
}

// waitFor polls cond every 10 ms until it holds, failing the test with what cond
// last said when ctx ends.
func waitFor(t testing.TB, ctx context.Context, what string, cond func() (bool, string)) {
	t.Helper()
	var last string
	for {
		ok, s := cond()
		if ok {
			return
		}
		last = s
		select {
		case <-ctx.Done():
			t.Fatalf("waiting until %s: %v; last seen: %s", what, ctx.Err(), last)
		case <-time.After(10 * time.Millisecond):
		}
	}
}
