package store

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
)

// The test library: a prelude of a constant and a local function, a step that writes
// with them and one that reads. Its functions' replies say which way they ran: the
// prelude is the same either way, but only a function sees KEYS as its parameter.
var (
	testPrelude = "local GREETING = 'hello'\nlocal function greet(who)\n  return GREETING .. ' ' .. who\nend"
	testSet     = NewScript("set", testPrelude, "redis.call('SET', KEYS[1], greet(ARGV[1]))\nreturn greet(ARGV[1])")
	testGet     = NewScript("get", testPrelude, "return redis.call('GET', KEYS[1])").Flag(NoWrites)
	testLibrary = NewLibrary("storetest", testSet, testGet)
)

// cmdstats are INFO commandstats: calls and rejected calls per lower-case command.
type cmdstats map[string]struct{ calls, rejected int64 }

func readStats(t *testing.T, admin *redis.Client) cmdstats {
	t.Helper()
	info, err := admin.Info(context.Background(), "commandstats").Result()
	require.NoError(t, err)
	st := make(cmdstats)
	for _, line := range strings.Split(info, "\n") {
		name, rest, ok := strings.Cut(strings.TrimSpace(line), ":")
		if !ok || !strings.HasPrefix(name, "cmdstat_") {
			continue
		}
		var e struct{ calls, rejected int64 }
		for _, f := range strings.Split(rest, ",") {
			k, v, _ := strings.Cut(f, "=")
			n, _ := strconv.ParseInt(v, 10, 64)
			switch k {
			case "calls":
				e.calls = n
			case "rejected_calls":
				e.rejected = n
			}
		}
		st[strings.TrimPrefix(name, "cmdstat_")] = e
	}
	return st
}

// sentBy is how the calls of f reached the server: the FCALLs and EVALSHA/EVALs it
// ran, and the FCALLs it refused (ACL).
type sentBy struct{ fcall, eval, refusedFCall int64 }

func (s sentBy) String() string {
	return fmt.Sprintf("%d FCALL, %d EVALSHA/EVAL, %d FCALL refused", s.fcall, s.eval, s.refusedFCall)
}

func measure(t *testing.T, admin *redis.Client, f func()) sentBy {
	t.Helper()
	before := readStats(t, admin)
	f()
	after := readStats(t, admin)
	d := func(cmd string) int64 { return after[cmd].calls - before[cmd].calls }
	return sentBy{fcall: d("fcall"), eval: d("evalsha") + d("eval"),
		refusedFCall: after["fcall"].rejected - before["fcall"].rejected}
}

// byFunctions is the checker: n calls went as n FCALLs and nothing by EVALSHA; the
// first may have found the library missing (counted, then loaded and sent again).
func byFunctions(s sentBy, n int64) bool {
	return s.eval == 0 && (s.fcall == n || s.fcall == n+1)
}

// byEval is the other checker: n calls went by EVALSHA (and an EVAL besides for each
// of the two test scripts the server had not cached), no FCALL ran, and at most one
// was refused.
func byEval(s sentBy, n int64) bool {
	return s.fcall == 0 && s.eval >= n && s.eval <= n+2 && s.refusedFCall <= 1
}

// roundTrip runs both steps n times on r and checks their replies.
func roundTrip(t *testing.T, r *Runner, n int) {
	t.Helper()
	ctx := context.Background()
	key := "storetest:" + strings.ReplaceAll(t.Name(), "/", ":")
	for i := range n {
		who := strconv.Itoa(i)
		got, err := r.Run(ctx, testSet, []string{key}, who).Text()
		require.NoError(t, err)
		require.Equal(t, "hello "+who, got)
		got, err = r.Run(ctx, testGet, []string{key}).Text()
		require.NoError(t, err)
		require.Equal(t, "hello "+who, got)
	}
}

func TestLibrarySource(t *testing.T) {
	src := testLibrary.Source()
	name := testLibrary.Name()
	assert.Regexp(t, `^storetest_[0-9a-f]{16}$`, name)
	assert.True(t, strings.HasPrefix(src, "#!lua name="+name+"\n"), "FUNCTION LOAD reads the name from the first line")
	assert.Equal(t, 1, strings.Count(src, "local function greet"), "a prelude the scripts share is in the library once")
	assert.Equal(t, name+"_set", testSet.Function())
	assert.Contains(t, src, "function_name = '"+name+"_get', flags = {'no-writes'}")
	assert.Equal(t, testPrelude+"\n"+"return redis.call('GET', KEYS[1])", testGet.Source(), "EVAL sends prelude and body")

	// Another version of the code is another library, under other function names.
	other := NewLibrary("storetest", NewScript("set", testPrelude, "return 2"))
	assert.NotEqual(t, name, other.Name())
	assert.Equal(t, "", NewScript("alone", "return 1").Function(), "a script of no library has no function")

	assert.PanicsWithValue(t, `store.NewLibrary: library name "a-b": only ASCII letters, digits and '_'`,
		func() { NewLibrary("a-b") })
	assert.Panics(t, func() { NewLibrary("again", testSet) }, "a script is in one library")
	assert.Panics(t, func() { testSet.Flag(NoWrites) }, "flags are set before the library is made")
}

// TestFunctions runs the test library on a real redis-server (7 or later): by FCALL
// from the first call on, loaded again where the server lost it, and by EVALSHA for a
// user whose ACL allows no functions. Every check has its control.
func TestFunctions(t *testing.T) {
	srv := redistest.Start(t)
	admin := srv.Client(t)
	ctx := context.Background()
	userClient := func(t *testing.T, name string, rules ...string) *redis.Client {
		t.Helper()
		args := []any{"ACL", "SETUSER", name, "reset", "on", ">secret", "~storetest:*", "-@all",
			"+evalsha", "+eval", "+script|load", "+ping", "+hello", "+get", "+set"}
		for _, r := range rules {
			args = append(args, r)
		}
		require.NoError(t, admin.Do(ctx, args...).Err())
		c := redis.NewClient(&redis.Options{Addr: srv.Addr(), Username: name, Password: "secret"})
		t.Cleanup(func() { _ = c.Close() })
		return c
	}

	t.Run("FCALL after the first call", func(t *testing.T) {
		r := New(srv.Client(t))
		s := measure(t, admin, func() { roundTrip(t, r, 5) })
		assert.True(t, byFunctions(s, 10), "10 calls: %v", s)
		assert.False(t, byEval(s, 10), "the other checker does not pass it: %v", s)
		n, err := admin.FunctionList(ctx, redis.FunctionListQuery{LibraryNamePattern: testLibrary.Name()}).Result()
		require.NoError(t, err)
		assert.Len(t, n, 1, "the library is loaded")
	})

	t.Run("loaded again after FUNCTION FLUSH", func(t *testing.T) {
		r := New(srv.Client(t))
		roundTrip(t, r, 1)
		require.NoError(t, admin.FunctionFlush(ctx).Err())
		// Control: the flush took the function away.
		err := admin.FCall(ctx, testGet.Function(), []string{"storetest:x"}).Err()
		require.True(t, functionMissing(err), "FCALL after FUNCTION FLUSH: %v", err)
		s := measure(t, admin, func() { roundTrip(t, r, 3) })
		assert.True(t, byFunctions(s, 6), "after the flush, still by FCALL: %v", s)
		assert.Equal(t, int64(7), s.fcall, "one FCALL found the function missing")
	})

	t.Run("loaded again after a restart without persistence", func(t *testing.T) {
		r := New(srv.Client(t))
		roundTrip(t, r, 1)
		srv.Restart(t)
		n, err := admin.FunctionList(ctx, redis.FunctionListQuery{}).Result()
		require.NoError(t, err)
		require.Empty(t, n, "control: the restart lost every function")
		// The first call after a restart may meet the connection the restart closed;
		// go-redis sends it again on a new one.
		s := measure(t, admin, func() { roundTrip(t, r, 3) })
		assert.True(t, byFunctions(s, 6), "after the restart, still by FCALL: %v", s)
	})

	t.Run("EVALSHA for a user who may not call functions", func(t *testing.T) {
		r := New(userClient(t, "nofcall"))
		s := measure(t, admin, func() { roundTrip(t, r, 5) })
		assert.True(t, byEval(s, 10), "10 calls: %v", s)
		assert.Equal(t, int64(1), s.refusedFCall, "one FCALL refused, then EVALSHA for good")
		assert.False(t, byFunctions(s, 10), "the other checker does not pass it: %v", s)
	})

	t.Run("EVALSHA for a user who may call functions but not load them", func(t *testing.T) {
		require.NoError(t, admin.FunctionFlush(ctx).Err())
		r := New(userClient(t, "noload", "+fcall"))
		s := measure(t, admin, func() { roundTrip(t, r, 5) })
		assert.True(t, s.eval >= 10 && s.eval <= 12, "by EVALSHA, the library missing: %v", s)
		assert.LessOrEqual(t, s.fcall, int64(1), "one FCALL found the function missing, then EVALSHA: %v", s)
	})

	t.Run("FCALL for a user who may call functions another loaded", func(t *testing.T) {
		r := New(userClient(t, "fcallonly", "+fcall"))
		require.NoError(t, New(admin).Load(ctx, testSet))
		s := measure(t, admin, func() { roundTrip(t, r, 5) })
		assert.True(t, byFunctions(s, 10), "10 calls: %v", s)
	})

	t.Run("FCALL for a user with +fcall +function|load", func(t *testing.T) {
		require.NoError(t, admin.FunctionFlush(ctx).Err())
		r := New(userClient(t, "loader", "+fcall", "+function|load"))
		s := measure(t, admin, func() { roundTrip(t, r, 5) })
		assert.True(t, byFunctions(s, 10), "10 calls: %v", s)
	})

	t.Run("a key the user may not touch leaves FCALL on", func(t *testing.T) {
		r := New(userClient(t, "keys", "+fcall", "+function|load"))
		err := r.Run(ctx, testGet, []string{"elsewhere:x"}).Err()
		require.ErrorContains(t, err, "NOPERM", "control: the key is refused")
		assert.False(t, functionsUnavailable(err), "a key's NOPERM says nothing about functions: %v", err)
		s := measure(t, admin, func() { roundTrip(t, r, 2) })
		assert.True(t, byFunctions(s, 4), "still by FCALL: %v", s)
	})

	t.Run("an error of the script's own leaves FCALL on", func(t *testing.T) {
		r := New(srv.Client(t))
		bad := NewScript("bad", "return redis.call('NOSUCHCOMMAND')")
		NewLibrary("storetest_bad", bad)
		err := r.Run(ctx, bad, nil).Err()
		require.Error(t, err)
		assert.False(t, functionsUnavailable(err) || functionMissing(err), "%v", err)
		s := measure(t, admin, func() { roundTrip(t, r, 2) })
		assert.True(t, byFunctions(s, 4), "still by FCALL: %v", s)
	})

	t.Run("scan by FCALL, loaded again after FUNCTION FLUSH", func(t *testing.T) {
		r := New(srv.Client(t))
		keys := []string{"storetest:scan:a", "storetest:scan:b", "storetest:scan:c"}
		for _, k := range keys {
			require.NoError(t, admin.Set(ctx, k, "hello "+k, 0).Err())
		}
		scan := func() []string {
			var got []string
			require.NoError(t, r.scan(ctx, "storetest:scan:*", "string", testGet, func(k string) []string { return []string{k} }, nil,
				func(k string, cmd *redis.Cmd) bool {
					v, err := cmd.Text()
					require.NoError(t, err)
					assert.Equal(t, "hello "+k, v)
					got = append(got, k)
					return true
				}))
			return got
		}
		require.NoError(t, admin.FunctionFlush(ctx).Err())
		var got []string
		s := measure(t, admin, func() { got = scan() })
		assert.ElementsMatch(t, keys, got)
		assert.True(t, s.eval == 0 && s.fcall == 6, "a pipeline that found the library missing, then one more: %v", s)
	})

	t.Run("scan by EVALSHA for a user who may not call functions", func(t *testing.T) {
		r := New(userClient(t, "scanner", "+scan"))
		var n int
		s := measure(t, admin, func() {
			require.NoError(t, r.scan(ctx, "storetest:scan:*", "", testGet, func(k string) []string { return []string{k} }, nil,
				func(string, *redis.Cmd) bool { n++; return true }))
		})
		assert.Equal(t, 3, n)
		assert.True(t, s.fcall == 0 && s.eval >= 3 && s.refusedFCall == 3, "a refused pipeline, then EVALSHA: %v", s)
	})

	// The rules docs/operating.md gives an operator allow EVALSHA and EVAL, not SCRIPT
	// LOAD: a scan that finds its script not cached sends the source.
	t.Run("scan by EVAL for a user who may not load scripts", func(t *testing.T) {
		require.NoError(t, admin.Do(ctx, "ACL", "SETUSER", "lister", "reset", "on", ">secret", "~storetest:*", "-@all",
			"+evalsha", "+eval", "+ping", "+hello", "+get", "+scan").Err())
		c := redis.NewClient(&redis.Options{Addr: srv.Addr(), Username: "lister", Password: "secret"})
		t.Cleanup(func() { _ = c.Close() })
		require.NoError(t, admin.ScriptFlush(ctx).Err())
		r := New(c)
		var n int
		require.NoError(t, r.scan(ctx, "storetest:scan:*", "", testGet, func(k string) []string { return []string{k} }, nil,
			func(_ string, cmd *redis.Cmd) bool {
				if assert.NoError(t, cmd.Err()) {
					n++
				}
				return true
			}))
		assert.Equal(t, 3, n, "every key read")
		// Control: the user may not load the script, as the scan would have it do.
		assert.ErrorContains(t, testGet.s.Load(ctx, c).Err(), "NOPERM")
	})
}

// TestMiniredisFallsBack: miniredis has no functions; every call goes by EVALSHA.
func TestMiniredisFallsBack(t *testing.T) {
	m := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	t.Cleanup(func() { _ = rdb.Close() })
	ctx := context.Background()
	// Control: miniredis refuses FCALL as Redis before 7 does.
	err := rdb.FCall(ctx, testGet.Function(), []string{"storetest:x"}).Err()
	require.True(t, functionsUnavailable(err), "FCALL on miniredis: %v", err)

	sent := &namesSent{}
	rdb.AddHook(sent)
	r := New(rdb)
	require.NoError(t, r.Load(ctx, testSet))
	roundTrip(t, r, 3)
	count := func(name string) int {
		n := 0
		for _, s := range sent.names {
			if s == name {
				n++
			}
		}
		return n
	}
	assert.Equal(t, []string{"function", "script"}, sent.names[:2], "Load found no FUNCTION command, and loaded the script")
	assert.Zero(t, count("fcall"), "then EVALSHA for good: %v", sent.names)
	assert.Equal(t, 6, count("evalsha"), "%v", sent.names)
}

// namesSent is a go-redis hook that records the name of every command sent.
type namesSent struct{ names []string }

func (h *namesSent) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *namesSent) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *namesSent) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.names = append(h.names, cmd.Name())
		return next(ctx, cmd)
	}
}

// TestErrorsThatSayFunctionsAreUnavailable: the replies that turn a Runner to EVALSHA,
// as Redis 6 and 7 and miniredis give them, and some that must not.
func TestErrorsThatSayFunctionsAreUnavailable(t *testing.T) {
	for _, tc := range []struct {
		reply string
		want  bool
	}{
		{"ERR unknown command 'fcall', with args beginning with: 'x' '0' ", true},   // Redis 7 with FCALL renamed away
		{"ERR unknown command `FCALL`, with args beginning with: `x`, `0`, ", true}, // Redis 6.2
		{"ERR unknown command `fcall`, with args beginning with: ", true},           // miniredis
		{"NOPERM this user has no permissions to run the 'fcall' command", true},    // Redis 7.0
		{"NOPERM User w has no permissions to run the 'function|load' command", true},
		{"NOPERM this user has no permissions to access one of the keys used as arguments", false},
		{"ERR Unknown Redis command called from script script: x_f, on @user_function:2.", false},
		{"ERR The user executing the script can't run this command or subcommand script: x_f, on @user_function:2.", false},
		{"ERR Function not found", false},
	} {
		if got := functionsUnavailable(proto(tc.reply)); got != tc.want {
			t.Errorf("functionsUnavailable(%q) = %v, want %v", tc.reply, got, tc.want)
		}
	}
	assert.False(t, functionsUnavailable(fmt.Errorf("dial tcp: connection refused")), "not a reply")
	assert.True(t, functionMissing(proto("ERR Function not found")))
}

// proto is err as go-redis returns an error reply.
type proto string

func (e proto) Error() string { return string(e) }
func (proto) RedisError()     {}

// TestFunctionsOnCluster: on Redis Cluster each call goes to the master of its key's
// slot; a call that finds the library missing there loads it on every master, and
// Scan loads it on the master it scans.
func TestFunctionsOnCluster(t *testing.T) {
	addrs := redistest.StartCluster(t, 3)
	ctx := context.Background()
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs})
	t.Cleanup(func() { _ = rdb.Close() })
	masters := make([]*redis.Client, len(addrs))
	for i, a := range addrs {
		masters[i] = redis.NewClient(&redis.Options{Addr: a})
		t.Cleanup(func() { _ = masters[i].Close() })
	}
	loadedOn := func() (n int) {
		for _, m := range masters {
			libs, err := m.FunctionList(ctx, redis.FunctionListQuery{LibraryNamePattern: testLibrary.Name()}).Result()
			require.NoError(t, err)
			n += len(libs)
		}
		return n
	}
	// Keys on every master: hash tags spread over the slots.
	var keys []string
	for i := range 12 {
		keys = append(keys, fmt.Sprintf("storetest:{%d}", i))
	}
	slotsHit := map[string]bool{}
	for _, k := range keys {
		addr, err := rdb.MasterForKey(ctx, k)
		require.NoError(t, err)
		slotsHit[addr.Options().Addr] = true
	}
	require.Len(t, slotsHit, len(addrs), "control: the keys live on every master")

	r := New(rdb)
	run := func() sentBy {
		var total sentBy
		before := make([]cmdstats, len(masters))
		for i, m := range masters {
			before[i] = readStats(t, m)
		}
		for _, k := range keys {
			got, err := r.Run(ctx, testSet, []string{k}, k).Text()
			require.NoError(t, err)
			require.Equal(t, "hello "+k, got)
		}
		for i, m := range masters {
			after := readStats(t, m)
			total.fcall += after["fcall"].calls - before[i]["fcall"].calls
			total.eval += after["evalsha"].calls + after["eval"].calls - before[i]["evalsha"].calls - before[i]["eval"].calls
		}
		return total
	}
	require.Zero(t, loadedOn(), "control: a new cluster has no functions")
	s := run()
	assert.Equal(t, len(addrs), loadedOn(), "the first call loaded the library on every master")
	assert.True(t, byFunctions(s, int64(len(keys))), "%v", s)

	require.NoError(t, masters[1].FunctionFlush(ctx).Err())
	require.Equal(t, len(addrs)-1, loadedOn(), "control: one master lost the library")
	s = run()
	assert.Equal(t, len(addrs), loadedOn(), "loaded again")
	assert.True(t, byFunctions(s, int64(len(keys))), "%v", s)

	for _, m := range masters {
		require.NoError(t, m.FunctionFlush(ctx).Err())
	}
	n := 0
	require.NoError(t, r.scan(ctx, "storetest:*", "", testGet, func(k string) []string { return []string{k} }, nil,
		func(k string, cmd *redis.Cmd) bool {
			v, err := cmd.Text()
			require.NoError(t, err)
			assert.Equal(t, "hello "+k, v)
			n++
			return true
		}))
	assert.Equal(t, len(keys), n)
	assert.Equal(t, len(addrs), loadedOn(), "Scan loaded the library on every master it scanned")
}
