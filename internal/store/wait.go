package store

import (
	"context"
	"time"

	"github.com/redis/go-redis/v9"
)

// Replicas asks a Runner to wait, after a script's writes, until N replicas have
// acknowledged them (WAIT N Timeout); N 0 asks for no wait.
type Replicas struct {
	N       int
	Timeout time.Duration
}

// Waited is what the WAIT after a script answered: Acked replicas acknowledged the
// script's writes, or Err says why the WAIT got no answer.
type Waited struct {
	Acked int
	Err   error
}

// Confirmed reports whether at least want.N replicas acknowledged the writes.
func (w Waited) Confirmed(want Replicas) bool { return w.Err == nil && w.Acked >= want.N }

// RunWait is Run followed by WAIT want.N want.Timeout on the same connection, in one
// pipeline: WAIT counts the replicas that acknowledged every write of its own
// connection, so it must follow the script there. On Redis Cluster the pipeline goes
// to the master of keys[0]'s slot (a WAIT without keys would be routed to any node);
// a MOVED or ASK answer makes the Runner reload the slots and send it again. The
// fallbacks of Run hold: a missing function is loaded, functions unavailable turn the
// Runner to EVALSHA, a script missing from the cache is loaded; each sends the
// pipeline again, at most three times in all. With want.N 0 it is Run.
//
// want.Timeout must be positive and below the redis client's ReadTimeout, which
// bounds the whole pipeline.
func (r *Runner) RunWait(ctx context.Context, s *Script, want Replicas, keys []string, args ...any) (*redis.Cmd, Waited) {
	if want.N <= 0 {
		return r.Run(ctx, s, keys, args...), Waited{}
	}
	var (
		cmd  *redis.Cmd
		wait *redis.IntCmd
	)
	for attempt := 0; ; attempt++ {
		node, err := r.nodeFor(ctx, keys)
		if err != nil {
			cmd = redis.NewCmd(ctx)
			cmd.SetErr(err)
			return cmd, Waited{Err: err}
		}
		fcall := s.lib != nil && !r.evalOnly.Load()
		pipe := node.Pipeline()
		if fcall {
			cmd = pipe.FCall(ctx, s.fn, keys, args...)
		} else {
			cmd = s.s.EvalSha(ctx, pipe, keys, args...)
		}
		wait = redis.NewIntCmd(ctx, "wait", want.N, want.Timeout.Milliseconds())
		_ = pipe.Process(ctx, wait)
		execPipe(ctx, pipe)
		err = cmd.Err()
		if attempt == 2 {
			break
		}
		switch {
		case fcall && functionMissing(err):
			if lerr := r.loadLibrary(ctx, s.lib); lerr != nil && !r.refused(lerr) {
				cmd.SetErr(lerr)
				return cmd, Waited{Err: lerr}
			}
			continue
		case fcall && functionsUnavailable(err):
			r.evalOnly.Store(true)
			continue
		case !fcall && redis.HasErrorPrefix(err, "NOSCRIPT"):
			if lerr := s.s.Load(ctx, node).Err(); lerr != nil {
				cmd.SetErr(lerr)
				return cmd, Waited{Err: lerr}
			}
			continue
		case redis.HasErrorPrefix(err, "MOVED") || redis.HasErrorPrefix(err, "ASK"):
			if cc, ok := r.c.(*redis.ClusterClient); ok {
				cc.ReloadState(ctx)
				continue
			}
		}
		break
	}
	n, err := wait.Result()
	return cmd, Waited{Acked: int(n), Err: err}
}

// nodeFor is the client of the server that keys live on: the master of their slot on
// Redis Cluster, else the Runner's own client. (A Ring does not say which shard a
// key is on; the caller of RunWait must not use one: see SupportsWait.)
func (r *Runner) nodeFor(ctx context.Context, keys []string) (redis.Cmdable, error) {
	if len(keys) == 0 {
		return r.c, nil
	}
	switch c := r.c.(type) {
	case *redis.ClusterClient:
		return c.MasterForKey(ctx, keys[0])
	}
	return r.c, nil
}

// SupportsWait reports whether RunWait can reach the server a script ran on: false
// for a Ring, which routes a command without keys, such as WAIT, to any shard.
func (r *Runner) SupportsWait() bool {
	_, ring := r.c.(*redis.Ring)
	return !ring
}

// EachWait is Each with RunWait for every call: fn also gets what each call's WAIT
// answered.
func (r *Runner) EachWait(ctx context.Context, s *Script, want Replicas, keys []string, per int, args []any,
	fn func(keys []string, cmd *redis.Cmd, w Waited) bool) {
	if r.oneNode || len(keys) <= per {
		cmd, w := r.RunWait(ctx, s, want, keys, args...)
		fn(keys, cmd, w)
		return
	}
	for i := 0; i+per <= len(keys); i += per {
		b := keys[i : i+per]
		if cmd, w := r.RunWait(ctx, s, want, b, args...); !fn(b, cmd, w) {
			return
		}
	}
}
