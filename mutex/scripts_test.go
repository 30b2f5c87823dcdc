package mutex

import (
	"context"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestScriptsLibraryPreludeNamesOnce: the library runs the shared parts of every
// script in one scope (layout, common.lua, plain.lua, slots.lua), where EVAL runs a
// script's own parts only; a local defined twice there would shadow the first for
// the scripts that come after it.
func TestScriptsLibraryPreludeNamesOnce(t *testing.T) {
	src := scriptsLibrary.Source()
	prelude := src[:strings.Index(src, "\nredis.register_function")]
	names, twice := topLocals(prelude)
	assert.Empty(t, twice, "locals defined twice in the library's prelude")
	assert.Less(t, len(names), 200, "Lua allows 200 locals per function")
	// Controls: the checker finds the layout's constants and the shared functions,
	// and a local defined twice.
	for _, name := range []string{"FENCE_DIGITS", "SLOT_HOLDER", "NO_DESCRIPTION", "ours", "handOver", "slotsStore"} {
		assert.Contains(t, names, name)
	}
	_, twice = topLocals(prelude + "\nlocal SLOTS_FENCE, other = 1, 2\nlocal function ours() end\n")
	assert.Equal(t, []string{"SLOTS_FENCE", "ours"}, twice)
}

// topLocals are the names of the locals that src defines outside functions, in
// order, and those it defines more than once.
func topLocals(src string) (names, twice []string) {
	local := regexp.MustCompile(`(?m)^local (?:function )?([A-Za-z_][A-Za-z0-9_, ]*)`)
	seen := map[string]bool{}
	for _, m := range local.FindAllStringSubmatch(src, -1) {
		for _, name := range strings.Split(m[1], ",") {
			name = strings.TrimSpace(name)
			if seen[name] {
				twice = append(twice, name)
			}
			seen[name] = true
			names = append(names, name)
		}
	}
	return names, twice
}

// TestScriptsAsFunctions: on a real redis-server every step goes by FCALL, as a
// function of scriptsLibrary, and on miniredis by EVALSHA; the contract tests (each)
// run them both ways.
func TestScriptsAsFunctions(t *testing.T) {
	for _, tc := range []struct {
		backend string
		rdb     func(t *testing.T) *redis.Client
		want    string
	}{
		{"redis-server", sharedServer, "fcall"},
		{"miniredis", func(t *testing.T) *redis.Client {
			rdb := redis.NewClient(&redis.Options{Addr: miniredis.RunT(t).Addr()})
			t.Cleanup(func() { _ = rdb.Close() })
			return rdb
		}, "evalsha"},
	} {
		t.Run(tc.backend, func(t *testing.T) {
			rdb := tc.rdb(t)
			sent := &rgHook{}
			var names []string
			sent.process = func(ctx context.Context, cmd redis.Cmder, next redis.ProcessHook) error {
				if rgIsScript(cmd) {
					names = append(names, cmd.Name())
				}
				return next(ctx, cmd)
			}
			rdb.AddHook(sent)
			c := New(rdb)
			defer c.Close()
			ctx := context.Background()
			key := uniqueKey(t)
			l, err := c.TryLock(ctx, key, time.Minute)
			require.NoError(t, err)
			_, err = l.TTL(ctx)
			require.NoError(t, err)
			require.NoError(t, l.Extend(ctx, time.Minute))
			_, err = c.Inspect(ctx, key)
			require.NoError(t, err)
			require.NoError(t, l.Unlock(ctx))
			s, err := c.TryLock(ctx, key, time.Minute, Limit(2))
			require.NoError(t, err)
			require.NoError(t, s.Extend(ctx, time.Minute))
			_, err = s.TTL(ctx)
			require.NoError(t, err)
			require.NoError(t, s.Unlock(ctx))

			require.GreaterOrEqual(t, len(names), 9, "%v", names)
			if tc.want == "evalsha" {
				// One FCALL finds no functions; then EVALSHA for good, and EVAL the
				// first time each script is missing.
				assert.Equal(t, "fcall", names[0])
				for i, name := range names[1:] {
					assert.Contains(t, []string{"evalsha", "eval"}, name, "call %d of %v", i+1, names)
				}
			} else {
				for i, name := range names {
					assert.Equal(t, "fcall", name, "call %d of %v", i, names)
				}
				lib, err := rdb.FunctionList(ctx, redis.FunctionListQuery{LibraryNamePattern: scriptsLibrary.Name()}).Result()
				require.NoError(t, err)
				require.Len(t, lib, 1, "the library is loaded")
				assert.Len(t, lib[0].Functions, 12, "a function per step")
			}
		})
	}
}
