package asynqmutex

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/asynqmutex/asynqmutex/internal/conflicts"
	"github.com/asynqmutex/asynqmutex/internal/redistest"
	"github.com/asynqmutex/asynqmutex/internal/store"
	"github.com/asynqmutex/asynqmutex/mutex"
)

// capACLRules are what a worker needs beyond the lock's worker rules (docs/operating.md,
// Redis ACL) for MaxReschedules and MaxRescheduleTime: the commands internal/conflicts/count.lua and
// clearRecord send that the lock's do not. docs/operating.md quotes them.
const capACLRules = "+hmget +hset +del"

// TestRescheduleRecordUnderWorkerACL counts, reads and clears a task's record as a
// Redis user that has the documented worker rules and capACLRules, and nothing else.
func TestRescheduleRecordUnderWorkerACL(t *testing.T) {
	srv := redistest.Start(t)
	admin := srv.Client(t)
	ctx := context.Background()
	rules := strings.Fields(workerRulesFromDocs(t) + " " + capACLRules)
	require.NoError(t, admin.Do(ctx, append([]any{"ACL", "SETUSER", "capworker", "on", ">capworker-secret"}, anys(rules)...)...).Err())
	mw := cappedMiddleware(t, &redis.Options{Addr: srv.Addr(), Username: "capworker", Password: "capworker-secret"})
	meta := taskMeta{id: "t-1", queue: "default"}
	for want := 1; want <= 2; want++ {
		r, err := mw.conflicts.Count(ctx, meta.queue, meta.id, mw.expiryOf(meta))
		require.NoError(t, err, "counting as the worker user")
		assert.Equal(t, want, r.N)
	}
	r, err := mw.conflicts.Peek(ctx, meta.queue, meta.id)
	require.NoError(t, err)
	assert.Equal(t, 2, r.N)
	mw.clearRecord(ctx, meta)
	n, err := admin.Exists(ctx, mw.conflicts.Key(meta.queue, meta.id)).Result()
	require.NoError(t, err)
	assert.Zero(t, n, "the worker user can clear the record")

	// Control: without capACLRules the same user is refused.
	require.NoError(t, admin.Do(ctx, "ACL", "SETUSER", "capworker", "-hmget").Err())
	_, err = mw.conflicts.Count(ctx, meta.queue, meta.id, mw.expiryOf(meta))
	assert.ErrorContains(t, err, "can't run this command", "the rules are what the script needs")
}

// workerRulesFromDocs is the worker's part of the ACL rules that docs/operating.md
// quotes and explains; package mutex's tests check them against what its scripts
// need.
func workerRulesFromDocs(t *testing.T) string {
	t.Helper()
	block := aclBlock(t, "docs/operating.md")
	require.Contains(t, block, "\n  "+capACLRules+"\n", "docs/operating.md quotes capACLRules")
	lines := strings.Split(block, "\n")
	// The rest of the first line and the next two: the rules of every worker (the
	// lines after them are for functions, Limit(n), reschedule caps and operators).
	return strings.TrimPrefix(lines[0], "ACL SETUSER locker on >password ") + " " + lines[1] + " " + lines[2]
}

// aclBlock is the ACL SETUSER command the Markdown file at path quotes, up to the end
// of its code block.
func aclBlock(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	text := string(b)
	i := strings.Index(text, "ACL SETUSER locker on >password ")
	require.GreaterOrEqual(t, i, 0, "%s quotes the ACL rules", path)
	end := strings.Index(text[i:], "```")
	require.Greater(t, end, 0, "%s: the ACL rules end their code block", path)
	return text[i : i+end]
}

func anys(s []string) []any {
	a := make([]any, len(s))
	for i, v := range s {
		a[i] = v
	}
	return a
}

// TestConflictCountedOnceAfterLostReply: the reply to a count is lost and go-redis
// sends it again; the conflict must count once, or a cap is reached early and the
// doubling skips a step.
func TestConflictCountedOnceAfterLostReply(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	p := redistest.NewProxy(t, srv.Addr())
	mw := cappedMiddleware(t, &redis.Options{Addr: p.Addr(), MaxRetries: 3, MinRetryBackoff: time.Millisecond})
	meta := taskMeta{id: "t-lost", queue: "default"}
	// Loaded, so that the dropped reply is the script's, not a NOSCRIPT.
	require.NoError(t, store.New(mw.locks.Redis()).Load(ctx, conflicts.Script))

	p.DropReplies(1)
	r, err := mw.conflicts.Count(ctx, meta.queue, meta.id, mw.expiryOf(meta))
	require.NoError(t, err, "go-redis sends the count again")
	assert.Equal(t, 1, p.Dropped(), "a reply was dropped")
	assert.Equal(t, 1, r.N, "one conflict, counted once")
	r, err = mw.conflicts.Count(ctx, meta.queue, meta.id, mw.expiryOf(meta))
	require.NoError(t, err)
	assert.Equal(t, 2, r.N, "the next conflict counts")
}

// cappedMiddleware is a middleware under MaxReschedules(2) and RetryLater(1s) whose
// locks, and conflict counts, go through a client with opt.
func cappedMiddleware(t *testing.T, opt *redis.Options) *middleware {
	rdb := redis.NewClient(opt)
	t.Cleanup(func() { rdb.Close() })
	locks := mutex.New(rdb)
	t.Cleanup(func() { locks.Close() })
	mw := &middleware{locks: locks, config: config{policy: Policy(time.Second), maxReschedules: 2}}
	mw.conflicts = conflicts.New(store.New(locks.Redis()), locks.Prefix())
	return mw
}
