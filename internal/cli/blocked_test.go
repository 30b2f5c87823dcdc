package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynqmutex/asynqmutex"
	"github.com/asynqmutex/asynqmutex/internal/redistest"
	"github.com/asynqmutex/asynqmutex/order"
)

// asynqLogger drops asynq's logs unless redistest.LogEnv is set.
type asynqLogger struct{}

func (asynqLogger) log(level string, args ...any) {
	if os.Getenv(redistest.LogEnv) != "" {
		fmt.Fprintf(os.Stderr, "asynq %s: %s\n", level, fmt.Sprint(args...))
	}
}
func (l asynqLogger) Debug(args ...any) {}
func (l asynqLogger) Info(args ...any)  {}
func (l asynqLogger) Warn(args ...any)  { l.log("WARN", args...) }
func (l asynqLogger) Error(args ...any) { l.log("ERROR", args...) }
func (l asynqLogger) Fatal(args ...any) { l.log("FATAL", args...) }

// orderOpts are the options of the ordered transfers the tests enqueue.
func orderOpts(tasks asynqmutex.TaskLookup) []asynqmutex.Option {
	return []asynqmutex.Option{asynqmutex.For("transfer"), asynqmutex.On("account"), asynqmutex.InOrder(tasks)}
}

// enqueueTransfer enqueues a transfer of account through producer, to queue, and
// returns its task ID.
func enqueueTransfer(t *testing.T, producer *asynqmutex.Producer, account, queue string) string {
	t.Helper()
	info, err := producer.Enqueue(ctxT(t), asynq.NewTask("transfer", []byte(`{"account":"`+account+`"}`)), asynq.Queue(queue))
	if err != nil {
		t.Fatalf("Enqueue(%s, queue %s): %v", account, queue, err)
	}
	return info.ID
}

// columnGap is what separates a table's columns.
var columnGap = regexp.MustCompile(`\s{2,}`)

// blockedLines returns the table rows of order --blocked, by key: key, place,
// waiting, task, age, reason.
func blockedLines(out string) map[string][]string {
	rows := map[string][]string{}
	for _, l := range strings.Split(out, "\n") {
		if cols := columnGap.Split(l, 6); len(cols) == 6 && strings.HasPrefix(cols[0], "[") {
			rows[cols[0]] = cols
		}
	}
	return rows
}

// TestOrderBlocked: order --blocked lists the ordered keys whose next task is not
// running, with why, as a real asynq server and its Redis say: a task enqueued to a
// queue no server reads (stuck: exit 1, and how to move the key on), a task pending
// behind a busy worker in a queue a server reads (not stuck), an archived task. A
// key whose task is running on that server is left out, though it has a place not
// finished, also once the server stopped fetching, whose queue no server reads then.
// Once the stuck key is moved past its place, the command exits 0.
func TestOrderBlocked(t *testing.T) {
	t.Parallel()
	s := redistest.Start(t)
	rdb := s.Client(t)
	locks, seq := newLocks(t, rdb), order.New(rdb)
	opt := asynq.RedisClientOpt{Addr: s.Addr()}
	client := asynq.NewClient(opt)
	t.Cleanup(func() { _ = client.Close() })
	inspector := asynq.NewInspector(opt)
	t.Cleanup(func() { _ = inspector.Close() })
	producer := asynqmutex.NewProducer(locks, client, orderOpts(nil)...)

	// One worker, reading "work", its handler held until the test ends.
	started := make(chan string, 4)
	base, release := context.WithCancel(context.Background())
	mux := asynq.NewServeMux()
	mux.Use(asynqmutex.Middleware(locks, orderOpts(inspector)...))
	mux.HandleFunc("transfer", func(ctx context.Context, task *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		started <- id
		<-ctx.Done() // base's end
		return nil
	})
	srv := asynq.NewServer(opt, asynqmutex.Configure(asynq.Config{
		Concurrency: 1, Queues: map[string]int{"work": 1}, BaseContext: func() context.Context { return base },
		ShutdownTimeout: 5 * time.Second, Logger: asynqLogger{}, LogLevel: asynq.WarnLevel,
	}))
	if err := srv.Start(mux); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		release()
		srv.Shutdown()
	})

	running := enqueueTransfer(t, producer, "acct-run", "work")
	select {
	case id := <-started:
		if id != running {
			t.Fatalf("the handler runs task %s, want %s", id, running)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the server did not start the first transfer within 30s")
	}
	backlog := enqueueTransfer(t, producer, "acct-backlog", "work") // behind the busy worker
	stuck := enqueueTransfer(t, producer, "acct-stuck", "critical")
	archived := enqueueTransfer(t, producer, "acct-archived", "cold")
	later, err := producer.Enqueue(ctxT(t), asynq.NewTask("transfer", []byte(`{"account":"acct-later"}`)), asynq.Queue("work"),
		asynq.ProcessIn(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	if err := inspector.ArchiveTask("cold", archived); err != nil {
		t.Fatal(err)
	}
	waitServer(t, inspector, "active")
	// The control for the running key: it has a place not finished, held by its task.
	runKey := taskKeyOf(t, "transfer", `"acct-run"`)
	if st, err := seq.Inspect(ctxT(t), runKey); err != nil || st.Waiting() != 1 || st.Holder.TaskID != running {
		t.Fatalf("order of %s = %+v, %v; want its place 1 held by %s", runKey, st, err, running)
	}

	uri := "--uri=" + s.Addr()
	r := cli(t, nil, "order", "--blocked", uri)
	t.Logf("asynqmutex order --blocked:\n%s%s", r.stdout, r.stderr)
	if r.code != exitFailure || !strings.Contains(r.stderr, "1 ordered key will not move on by itself") {
		t.Errorf("order --blocked with a stuck key: exit %d, stderr %q; want exit 1 naming 1 stuck key", r.code, r.stderr)
	}
	lines := blockedLines(r.stdout)
	stuckKey, backlogKey, archivedKey := taskKeyOf(t, "transfer", `"acct-stuck"`), taskKeyOf(t, "transfer", `"acct-backlog"`), taskKeyOf(t, "transfer", `"acct-archived"`)
	laterKey := taskKeyOf(t, "transfer", `"acct-later"`)
	for _, tt := range []struct {
		key, task, want string
		prefix          bool // want is the reason's start
	}{
		{stuckKey, stuck, `pending in queue "critical", which no server reads`, false},
		// The control for the reason: pending in a queue a server reads is not stuck.
		{backlogKey, backlog, `pending in queue "work", which 1 server reads: behind its other tasks, or the queue is paused`, false},
		{archivedKey, archived, `archived in queue "cold"; the key moves past it when its next task asks`, false},
		{laterKey, later.ID, `scheduled in queue "work", due in `, true},
	} {
		row, ok := lines[tt.key]
		switch {
		case !ok:
			t.Errorf("order --blocked does not list %s", tt.key)
		case row[1] != "1" || row[2] != "1" || row[3] != tt.task || row[5] != tt.want && !(tt.prefix && strings.HasPrefix(row[5], tt.want)):
			t.Errorf("order --blocked lists %s as %q; want place 1, 1 waiting, task %s, and %q", tt.key, row, tt.task, tt.want)
		}
	}
	if row, ok := lines[runKey]; ok || len(lines) != 4 {
		t.Errorf("order --blocked lists %d keys, the running one as %q; want 4, not the running one", len(lines), row)
	}
	if want := "  asynqmutex order --skip 1 --task transfer acct-stuck\n"; !strings.Contains(r.stdout, want) ||
		strings.Count(r.stdout, "asynqmutex order --skip") != 1 {
		t.Errorf("order --blocked:\n%s\nwant the one line %q", r.stdout, want)
	}

	r = cli(t, nil, "order", "--blocked", "--json", uri)
	var doc []blockedJSON
	if err := json.Unmarshal([]byte(r.stdout), &doc); err != nil || r.code != exitFailure || len(doc) != 4 {
		t.Fatalf("order --blocked --json: %v (%v)\nwant exit 1 and 4 keys", r, err)
	}
	byKey := map[string]blockedJSON{}
	for _, k := range doc {
		byKey[k.Key] = k
	}
	if k := byKey[stuckKey]; k.TaskID != stuck || k.Queue != "critical" || k.Place != 1 || k.Waiting != 1 || k.State != "pending" ||
		k.QueueServed || !k.Stuck || k.Reason != `pending in queue "critical", which no server reads` {
		t.Errorf("order --blocked --json, the stuck key: %+v", k)
	}
	if k := byKey[backlogKey]; k.TaskID != backlog || k.Queue != "work" || k.State != "pending" || !k.QueueServed || k.Stuck {
		t.Errorf("order --blocked --json, the backlog key: %+v; want pending, served, not stuck", k)
	}
	if k := byKey[archivedKey]; k.TaskID != archived || k.State != "archived" || k.Stuck {
		t.Errorf("order --blocked --json, the archived key: %+v; want archived, not stuck", k)
	}
	due := later.NextProcessAt.Truncate(time.Second).UTC().Format(time.RFC3339Nano) // asynq keeps seconds
	if k := byKey[laterKey]; k.State != "scheduled" || k.Due != due || !k.QueueServed || k.Stuck {
		t.Errorf("order --blocked --json, the scheduled key: %+v; want scheduled, due %s, not stuck", k, due)
	}

	// Moved past its place, the stuck key is no longer listed: exit 0.
	mustRun(t, "order", "--skip", "1", "--task", "transfer", "acct-stuck", uri)
	r = cli(t, nil, "order", "--blocked", uri)
	if lines := blockedLines(r.stdout); r.code != 0 || r.stderr != "" || len(lines) != 3 || lines[stuckKey] != nil {
		t.Errorf("order --blocked after the stuck key's place was skipped: %v\nwant exit 0 and the other three keys", r)
	}

	// A server that stopped fetching (its shutdown under way) runs its task still,
	// and reads its queue no more: the backlog is stuck now.
	srv.Stop()
	waitServer(t, inspector, "stopped")
	r = cli(t, nil, "order", "--blocked", uri)
	if lines := blockedLines(r.stdout); r.code != exitFailure || len(lines) != 3 || lines[runKey] != nil ||
		lines[backlogKey][5] != `pending in queue "work", which no server reads` || lines[laterKey][5] != `scheduled in queue "work", which no server reads` ||
		!strings.Contains(r.stderr, "2 ordered keys will not move on by themselves") {
		t.Errorf("order --blocked once the server stopped: %v\nwant exit 1, the backlog and the scheduled task in a queue no server reads, the running task left out", r)
	}
}

// waitServer waits until asynq lists one server, reading "work", in status.
func waitServer(t *testing.T, inspector *asynq.Inspector, status string) {
	t.Helper()
	// A server writes its state at its start and every 5s.
	for i := 0; ; i++ {
		servers, err := inspector.Servers()
		if err != nil {
			t.Fatal(err)
		}
		if len(servers) == 1 && servers[0].Queues["work"] == 1 && servers[0].Status == status {
			return
		}
		if i == 300 {
			t.Fatalf("asynq lists servers %+v, want one reading \"work\", %s", servers, status)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestOrderBlockedAsynqURI: asynq's queues in another Redis than the locks' are
// asked through --asynq_uri; without it, the task is not found in the locks' Redis.
// With no key blocked, the command says so and exits 0.
func TestOrderBlockedAsynqURI(t *testing.T) {
	t.Parallel()
	lockRedis, asynqRedis := redistest.Start(t), redistest.Start(t)
	locks := newLocks(t, lockRedis.Client(t))
	client := asynq.NewClient(asynq.RedisClientOpt{Addr: asynqRedis.Addr()})
	t.Cleanup(func() { _ = client.Close() })
	producer := asynqmutex.NewProducer(locks, client, orderOpts(nil)...)
	uri, asynqURI := "--uri="+lockRedis.Addr(), "--asynq_uri=redis://"+asynqRedis.Addr()

	r := mustRun(t, "order", "--blocked", uri, asynqURI)
	if r.stdout != `no ordered key under prefix "asynqmutex:" waits for a task that is not running`+"\n" {
		t.Errorf("order --blocked with no ordered key:\n%s", r.stdout)
	}
	if r := mustRun(t, "order", "--blocked", "--json", uri); strings.TrimSpace(r.stdout) != "[]" {
		t.Errorf("order --blocked --json with no ordered key:\n%s\nwant []", r.stdout)
	}

	id := enqueueTransfer(t, producer, "acct-9", "critical")
	key := taskKeyOf(t, "transfer", `"acct-9"`)
	r = cli(t, nil, "order", "--blocked", uri, asynqURI)
	if row := blockedLines(r.stdout)[key]; r.code != exitFailure || len(row) != 6 || row[3] != id ||
		row[5] != `pending in queue "critical", which no server reads` {
		t.Errorf("order --blocked --asynq_uri: %v\nwant exit 1 and task %s pending in a queue no server reads", r, id)
	}
	// The control: asked in the locks' Redis, asynq does not hold the task.
	r = cli(t, nil, "order", "--blocked", "--json", uri)
	var doc []blockedJSON
	if err := json.Unmarshal([]byte(r.stdout), &doc); err != nil || r.code != 0 || len(doc) != 1 ||
		doc[0].State != "not_in_asynq" || doc[0].Stuck {
		t.Errorf("order --blocked --json without --asynq_uri: %v (%v)\nwant exit 0, the task not in asynq, not stuck", r, err)
	}

	port, err := redistest.FreePort() // nothing listens there
	if err != nil {
		t.Fatal(err)
	}
	addr := "127.0.0.1:" + strconv.Itoa(port)
	r = cli(t, nil, "order", "--blocked", uri, "--asynq_uri", addr)
	if want := "could not reach Redis at " + addr + " (--asynq_uri)"; r.code != exitFailure || !strings.Contains(r.stderr, want) || r.stdout != "" {
		t.Errorf("order --blocked with an unreachable --asynq_uri: %v\nwant exit 1 and %q", r, want)
	}
}

// TestOrderBlockedUsage: --blocked lists keys, and takes none.
func TestOrderBlockedUsage(t *testing.T) {
	t.Parallel()
	port, err := redistest.FreePort() // nothing listens: a usage error must come first
	if err != nil {
		t.Fatal(err)
	}
	uri := "--uri=127.0.0.1:" + strconv.Itoa(port)
	for _, tt := range []struct {
		args []string
		want string
	}{
		{[]string{"list", "--blocked", uri}, "--blocked goes with order only"},
		{[]string{"order", "--blocked", `["k"]`, uri}, "takes no KEY or --task"},
		{[]string{"order", "--blocked", "--task", "transfer", uri}, "takes no KEY or --task"},
		{[]string{"order", "--blocked", "--skip", "1", uri}, "give one of them"},
		{[]string{"order", "--asynq_uri", "127.0.0.1:1", `["k"]`, uri}, "--asynq_uri goes with order --blocked only"},
		{[]string{"order", "--blocked", "--asynq_uri", "no-port", uri}, "--asynq_uri: no-port is not host:port"},
	} {
		if r := cli(t, nil, tt.args...); r.code != exitUsage || !strings.Contains(r.stderr, tt.want) {
			t.Errorf("asynqmutex %s: %v\nwant exit 2 and %q", strings.Join(tt.args, " "), r, tt.want)
		}
	}
}
