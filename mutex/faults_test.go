package mutex

import (
	"context"
	"errors"
	"io"
	"net"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
	"github.com/asynqmutex/asynqmutex/internal/store"
)

// unreachable is a client for an address where nothing listens.
func unreachable(t *testing.T) *redis.Client {
	port, err := redistest.FreePort()
	require.NoError(t, err)
	rdb := redis.NewClient(&redis.Options{Addr: net.JoinHostPort("127.0.0.1", strconv.Itoa(port)), MaxRetries: -1, DialTimeout: 50 * time.Millisecond})
	t.Cleanup(func() { rdb.Close() })
	return rdb
}

// loseReply is a go-redis hook that lets the next n lock scripts reach the server and
// then reports a network error, as when a reply is lost after the server applied it.
type loseReply struct{ n atomic.Int32 }

func (h *loseReply) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *loseReply) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *loseReply) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if isLockScript(cmd) && err == nil && h.n.Add(-1) >= 0 {
			cmd.SetErr(io.ErrUnexpectedEOF)
			return io.ErrUnexpectedEOF
		}
		return err
	}
}

var _ redis.Hook = (*loseReply)(nil)

func isLockScript(cmd redis.Cmder) bool {
	args := cmd.Args()
	return len(args) > 1 && (args[1] == plainLockScript.Function() || args[1] == plainLockScript.Hash() || args[1] == plainLockScript.Source())
}

func TestLostReplyDoesNotLeak(t *testing.T) {
	each(t, func(t *testing.T, b backend) {
		hook := &loseReply{}
		b.rdb.AddHook(hook)
		c := New(b.rdb)
		ctx := context.Background()
		key := uniqueKey(t)

		hook.n.Store(1)
		_, err := c.TryLock(ctx, key, time.Hour)
		require.Error(t, err)
		assert.NotErrorIs(t, err, ErrNotObtained, "an unknown outcome is an error, not a verdict")
		locked, lerr := c.Locked(ctx, key)
		require.NoError(t, lerr)
		assert.False(t, locked, "the attempt whose reply was lost must not hold the key for its hour")

		// Positive control: without the clean-up the key would stay held.
		hook.n.Store(1)
		a, err := c.newAcquisition(key, time.Hour, nil)
		require.NoError(t, err)
		_, err = store.New(b.rdb).Run(ctx, plainLockScript, a.keys,
			a.id, a.ttl.Milliseconds(), "", "0", a.desc).Result()
		require.Error(t, err)
		locked, lerr = c.Locked(ctx, key)
		require.NoError(t, lerr)
		assert.True(t, locked, "control: the hook lets the write through and hides the reply")
	})
}

func TestLostReplyRetriedThroughProxy(t *testing.T) {
	// A real reply lost on the wire: the proxy forwards the script, drops Redis's
	// answer and resets the connection; go-redis retries on a new connection. The
	// retry must find our own token and succeed, not report "not obtained".
	rdb, p, via, c := throughProxy(t)
	ctx := context.Background()
	key := uniqueKey(t)

	p.DropReplies(1)
	l, err := c.TryLock(ctx, key, time.Minute)
	require.NoError(t, err, "the retried attempt must find its own token")
	assert.Equal(t, 1, p.Dropped(), "a reply was dropped")
	val, err := rdb.Get(ctx, c.redisKey(key)).Result()
	require.NoError(t, err)
	assert.True(t, strings.HasPrefix(val[idAt:], identity(l.Token())), "our token holds the key: %q", val)
	require.NoError(t, l.Unlock(ctx))

	// Positive control: the same fault breaks a plain SET NX, which reports "not set"
	// while its own first write holds the key.
	p.DropReplies(1)
	ok, err := via.SetNX(ctx, key+":naive", "tok", time.Minute).Result()
	if err == nil {
		assert.False(t, ok, "control: plain SET NX after a lost reply reports not set")
	} else {
		assert.True(t, errors.Is(err, io.EOF) || err != nil)
	}
	assert.Equal(t, "tok", rdb.Get(ctx, key+":naive").Val(), "control: the naive write landed")
}

func TestLostReleaseReplyIsNotALostLease(t *testing.T) {
	// Redis applies the release, the reply is lost, go-redis sends it again on a new
	// connection: the repeat must be recognised, not reported as ErrNotHeld.
	_, p, _, c := throughProxy(t)
	ctx := context.Background()
	key := uniqueKey(t)

	l, err := c.TryLock(ctx, key, time.Minute)
	require.NoError(t, err)
	p.DropReplies(1)
	require.NoError(t, l.Unlock(ctx), "the repeated release finds its own tombstone")
	assert.Equal(t, 1, p.Dropped(), "a reply was dropped")
	locked, err := c.Locked(ctx, key)
	require.NoError(t, err)
	assert.False(t, locked)

	err = c.WithLock(ctx, key, time.Minute, func(context.Context) error {
		p.DropReplies(1) // the release's reply, after fn returns
		return nil
	})
	require.NoError(t, err, "WithLock must not report a lost lease")
	assert.Equal(t, 2, p.Dropped())
}

// throughProxy is a Client on the shared server through a fault proxy, with its
// scripts loaded, so that the next reply the proxy drops is a script's answer. It
// also returns a direct admin client and the proxied redis client.
func throughProxy(t *testing.T) (*redis.Client, *redistest.Proxy, *redis.Client, *Client) {
	rdb := sharedServer(t)
	p := redistest.NewProxy(t, rdb.Options().Addr)
	via := redis.NewClient(&redis.Options{Addr: p.Addr(), MaxRetries: 3, MinRetryBackoff: time.Millisecond})
	t.Cleanup(func() { via.Close() })
	c := New(via)
	ctx := context.Background()
	warm, err := c.TryLock(ctx, uniqueKey(t)+":warm", time.Minute)
	require.NoError(t, err)
	require.NoError(t, warm.Unlock(ctx))
	return rdb, p, via, c
}
