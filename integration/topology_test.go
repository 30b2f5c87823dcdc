package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex"
	"github.com/asynqmutex/asynqmutex/internal/redistest"
)

// TestConnectionTypes builds the lock client from the very options the asynq server
// uses, opt.MakeRedisClient(), for a single node, a Sentinel-managed master and a
// three-master Cluster, and checks on each that the middleware serializes a duplicate.
func TestConnectionTypes(t *testing.T) {
	t.Parallel()

	t.Run("single node", func(t *testing.T) {
		t.Parallel()
		s := redistest.Start(t)
		checkSerializedOn(t, asynq.RedisClientOpt{Addr: s.Addr()})
	})

	t.Run("sentinel failover", func(t *testing.T) {
		t.Parallel()
		master := redistest.Start(t)
		sentinel := startSentinel(t, master.Port())
		opt := asynq.RedisFailoverClientOpt{MasterName: "mymaster", SentinelAddrs: []string{sentinel}}
		checkSerializedOn(t, opt)

		// The failover client really went through Sentinel to the master: a lock taken
		// through it is visible on the master itself.
		locks, _ := newLocks(t, opt)
		ctx := context.Background()
		key := lockKey(t, "sentinel", "probe")
		l, err := locks.TryLock(ctx, key, 10*time.Second)
		if err != nil {
			t.Fatalf("TryLock through Sentinel: %v", err)
		}
		defer l.Unlock(ctx)
		if n, err := master.Client(t).Exists(ctx, redisLockKey(t, key)).Result(); err != nil || n != 1 {
			t.Errorf("EXISTS %s on the master = %d, %v; want 1", redisLockKey(t, key), n, err)
		}
	})

	t.Run("cluster", func(t *testing.T) {
		t.Parallel()
		addrs := redistest.StartCluster(t, 3)
		opt := asynq.RedisClusterClientOpt{Addrs: addrs}
		checkSerializedOn(t, opt)

		// A key's line lives in its lock's slot: tasks park and are started in order.
		checkParkedOn(t, opt)

		// A lock and its wait queue share a hash slot, so plain_lock.lua may touch both.
		locks, rdb := newLocks(t, opt)
		ctx := context.Background()
		key := lockKey(t, "pay", "slot-check")
		l, err := locks.TryLock(ctx, key, 10*time.Second)
		if err != nil {
			t.Fatalf("TryLock on the cluster: %v", err)
		}
		defer l.Unlock(ctx)
		rkey := redisLockKey(t, key)
		qkey := rkey + ":wait"
		if n, err := rdb.Exists(ctx, rkey).Result(); err != nil || n != 1 {
			t.Errorf("EXISTS %s = %d, %v; want 1 (the key as documented)", rkey, n, err)
		}
		s1, err1 := rdb.ClusterKeySlot(ctx, rkey).Result()
		s2, err2 := rdb.ClusterKeySlot(ctx, qkey).Result()
		if err1 != nil || err2 != nil || s1 != s2 {
			t.Errorf("CLUSTER KEYSLOT %s = %d (%v), %s = %d (%v); want the same slot", rkey, s1, err1, qkey, s2, err2)
		}
		// Control: without the hash tag the two names would land in different slots.
		bare := mustSlot(t, rdb, strings.NewReplacer("{", "", "}", "").Replace(rkey))
		bareQueue := mustSlot(t, rdb, strings.NewReplacer("{", "", "}", "").Replace(qkey))
		if bare == bareQueue {
			t.Errorf("control: untagged names share slot %d too; pick another key to make the check meaningful", bare)
		}
	})
}

func mustSlot(t testing.TB, rdb redis.UniversalClient, key string) int64 {
	t.Helper()
	s, err := rdb.ClusterKeySlot(context.Background(), key).Result()
	if err != nil {
		t.Fatalf("CLUSTER KEYSLOT %s: %v", key, err)
	}
	return s
}

type span struct {
	start, end time.Time
	fence      int64
}

// checkSerializedOn runs two tasks with one key and one with another on a server and
// lock client both built from opt: the duplicates run one after the other.
func checkSerializedOn(t *testing.T, opt asynq.RedisConnOpt) {
	t.Helper()
	locks, _ := newLocks(t, opt)
	cli := newClient(t, opt)
	insp := newInspector(t, opt)

	var mu sync.Mutex
	spans := map[string][]span{}
	mw := asynqmutex.Middleware(locks, asynqmutex.On("id"), asynqmutex.MaxWait(20*time.Second), asynqmutex.TTL(2*time.Second))
	startServer(t, opt, asynqmutex.Configure(asynq.Config{Concurrency: 4}), mw(asynq.HandlerFunc(
		func(ctx context.Context, task *asynq.Task) error {
			var p struct{ ID string }
			if err := json.Unmarshal(task.Payload(), &p); err != nil {
				return err
			}
			fence, _ := asynqmutex.Fence(ctx)
			s := span{start: time.Now(), fence: fence}
			time.Sleep(300 * time.Millisecond)
			s.end = time.Now()
			mu.Lock()
			spans[p.ID] = append(spans[p.ID], s)
			mu.Unlock()
			return nil
		})))

	var ids []string
	for _, id := range []string{"dup", "dup", "other"} {
		info, err := cli.Enqueue(asynq.NewTask("pay", payload(t, map[string]string{"id": id})), asynq.Retention(time.Hour))
		if err != nil {
			t.Fatalf("Enqueue: %v", err)
		}
		ids = append(ids, info.ID)
	}
	for _, id := range ids {
		info := waitState(t, insp, "default", id, asynq.TaskStateCompleted, 30*time.Second)
		if info.Retried != 0 {
			t.Errorf("task %s: %s; want completed without retry", id, describeTask(info))
		}
	}
	mu.Lock()
	defer mu.Unlock()
	dup := spans["dup"]
	if len(dup) != 2 {
		t.Fatalf("the duplicate key ran %d times, want 2", len(dup))
	}
	first, second := dup[0], dup[1]
	if second.start.Before(first.end) {
		t.Errorf("duplicates overlapped: first ran %v-%v, second started at %v", first.start.Format(time.StampMicro), first.end.Format(time.StampMicro), second.start.Format(time.StampMicro))
	}
	if first.fence <= 0 || second.fence <= first.fence {
		t.Errorf("fences %d then %d, want positive and increasing", first.fence, second.fence)
	}
	if len(spans["other"]) != 1 {
		t.Errorf("the other key ran %d times, want 1", len(spans["other"]))
	}
}

func isDone(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

func redisBin(t testing.TB) string {
	t.Helper()
	name := "redis-server"
	if env := os.Getenv("REDIS_SERVER_BIN"); env != "" {
		name = env
	}
	bin, err := exec.LookPath(name)
	if err != nil {
		t.Skipf("no redis-server (%v)", err)
	}
	return bin
}

func freePort(t testing.TB) int {
	t.Helper()
	port, err := redistest.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	return port
}

// startSentinel starts a redis-server in Sentinel mode on a free loopback port,
// monitoring the master on masterPort as "mymaster", and returns its address once it
// reports the master. Sentinel insists on a writable config file, so redistest, which
// configures servers on the command line, cannot start it.
func startSentinel(t testing.TB, masterPort int) string {
	t.Helper()
	bin := redisBin(t)
	dir := t.TempDir()
	var lastErr error
	for range 5 {
		port := freePort(t)
		conf := filepath.Join(dir, fmt.Sprintf("sentinel-%d.conf", port))
		text := fmt.Sprintf("port %d\nbind 127.0.0.1\ndir %s\nlogfile \"\"\n"+
			"sentinel monitor mymaster 127.0.0.1 %d 1\nsentinel down-after-milliseconds mymaster 5000\n", port, dir, masterPort)
		if err := os.WriteFile(conf, []byte(text), 0o600); err != nil {
			t.Fatalf("writing %s: %v", conf, err)
		}
		out := &syncBuffer{}
		cmd := exec.Command(bin, conf, "--sentinel")
		cmd.Dir, cmd.Stdout, cmd.Stderr = dir, out, out
		cmd.WaitDelay = time.Second
		if err := cmd.Start(); err != nil {
			t.Fatalf("starting sentinel: %v", err)
		}
		exited := make(chan struct{})
		go func() { _ = cmd.Wait(); close(exited) }()
		stop := func() {
			_ = cmd.Process.Signal(syscall.SIGTERM)
			select {
			case <-exited:
			case <-time.After(5 * time.Second):
				_ = cmd.Process.Kill()
				<-exited
			}
		}
		addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
		c := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1, DialTimeout: 200 * time.Millisecond})
		ready := false
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(pollEvery) {
			if isDone(exited) {
				lastErr = fmt.Errorf("sentinel on %s exited; output:\n%s", addr, out.String())
				break
			}
			res, err := c.Do(context.Background(), "SENTINEL", "get-master-addr-by-name", "mymaster").StringSlice()
			if err == nil && len(res) == 2 && res[1] == strconv.Itoa(masterPort) {
				ready = true
				break
			}
			lastErr = fmt.Errorf("sentinel on %s: get-master-addr-by-name = %v, %v", addr, res, err)
		}
		_ = c.Close()
		if ready {
			t.Cleanup(stop)
			return addr
		}
		stop()
		if !strings.Contains(out.String(), "Address already in use") {
			break
		}
	}
	t.Fatalf("starting Sentinel: %v", lastErr)
	return ""
}
