// Package store is the one seam between asynqmutex's packages and Redis: every script
// they run, every subscription and every scan goes through a Runner, so that how a
// script is sent (FCALL of a function library, loaded where it is missing; EVALSHA
// where functions are unavailable, loading the script on NOSCRIPT), how keys of
// several Redis Cluster slots are split into calls, and what wraps a call happen in
// one place. The callers own their scripts, key names and stored formats; a Runner
// only carries them.
package store

import (
	"context"
	"errors"
	"fmt"
	"io"
	"iter"
	"net"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex/internal/shortkey"
)

// Runner runs scripts on one Redis deployment. It is safe for concurrent use.
type Runner struct {
	c redis.UniversalClient

	// oneNode is true unless c spreads keys over several servers (Cluster, Ring):
	// then one script cannot reach the keys of several hash slots (see Each).
	oneNode bool
	// countsSubscribers is true unless c is a Cluster client: there PUBLISH counts
	// only the subscribers of the node it ran on, so zero does not mean nobody
	// listens.
	countsSubscribers bool
	// evalOnly is set, for good, once the server showed that this Runner cannot use
	// functions (see Run); then every script goes by EVALSHA.
	evalOnly atomic.Bool
}

// New returns a Runner on c, a single-node, Sentinel failover, Cluster or Ring client.
func New(c redis.UniversalClient) *Runner {
	r := &Runner{c: c, oneNode: true, countsSubscribers: true}
	switch c.(type) {
	case *redis.ClusterClient:
		r.oneNode, r.countsSubscribers = false, false
	case *redis.Ring:
		r.oneNode = false
	}
	return r
}

// OneNode reports whether every key lives on one server, so that one call of a
// script reaches keys of several hash slots: false on Redis Cluster and Ring (see
// Each).
func (r *Runner) OneNode() bool { return r.oneNode }

// CountsSubscribers reports whether PUBLISH's answer counts every subscriber of a
// channel: false on Redis Cluster, where it counts those of one node.
func (r *Runner) CountsSubscribers() bool { return r.countsSubscribers }

// Run runs s with keys and args in one call. All keys must share a Redis Cluster hash
// slot.
//
// A script of a library goes by FCALL. When the server answers that the function is
// missing (it restarted without persistence, its functions were flushed, it is a new
// node), Run loads the library (on every master of a Cluster) and calls again. When
// the server has no functions (Redis before 7, or a server that does not implement
// them), or the user may not call or load them (ACL), or the library cannot be loaded
// otherwise, the Runner sends every script by EVALSHA from then on. EVALSHA sends the
// script itself (EVAL) when the server has not cached it.
//
// When ctx carries a boarded Rider of a Runner on the same redis client, Run sends
// it first, in one pipeline with s (see Rider).
func (r *Runner) Run(ctx context.Context, s *Script, keys []string, args ...any) *redis.Cmd {
	if rd, c := r.riderFor(ctx); rd != nil {
		return r.runCarrying(ctx, rd, c, s, keys, args)
	}
	if s.lib == nil || r.evalOnly.Load() {
		return s.s.Run(ctx, r.c, keys, args...)
	}
	cmd := r.c.FCall(ctx, s.fn, keys, args...)
	switch err := cmd.Err(); {
	case functionMissing(err):
		lerr := r.loadLibrary(ctx, s.lib)
		if lerr == nil {
			return r.c.FCall(ctx, s.fn, keys, args...)
		}
		if !r.refused(lerr) {
			cmd.SetErr(lerr)
			return cmd
		}
	case functionsUnavailable(err):
		r.evalOnly.Store(true)
	default:
		return cmd
	}
	return s.s.Run(ctx, r.c, keys, args...)
}

// Each runs s on keys, which come in groups of per keys that share a hash slot
// (a lock and its queue, say): in one call on a single Redis, and one call per group,
// in order, where keys live on several servers. It gives fn each call's keys and its
// reply, and stops when fn returns false.
func (r *Runner) Each(ctx context.Context, s *Script, keys []string, per int, args []any, fn func(keys []string, cmd *redis.Cmd) bool) {
	if r.oneNode || len(keys) <= per {
		fn(keys, r.Run(ctx, s, keys, args...))
		return
	}
	for i := 0; i+per <= len(keys); i += per {
		b := keys[i : i+per]
		if !fn(b, r.Run(ctx, s, b, args...)) {
			return
		}
	}
}

// Load loads s where the Runner's next call of it will look: its library on the
// server (every master of a Cluster), or, where the Runner uses EVALSHA (see Run), s
// into the script cache of every server.
func (r *Runner) Load(ctx context.Context, s *Script) error {
	if s.lib != nil && !r.evalOnly.Load() {
		err := r.loadLibrary(ctx, s.lib)
		if err == nil || !r.refused(err) {
			return err
		}
	}
	return s.s.Load(ctx, r.c).Err()
}

// loadLibrary loads lib on the server (every master of a Cluster, every shard of a
// Ring); a library already there counts as loaded.
func (r *Runner) loadLibrary(ctx context.Context, lib *Library) error {
	load := func(ctx context.Context, node *redis.Client) error { return loadOn(ctx, node, lib) }
	switch c := r.c.(type) {
	case *redis.ClusterClient:
		return c.ForEachMaster(ctx, load)
	case *redis.Ring:
		return c.ForEachShard(ctx, load)
	}
	return loadOn(ctx, r.c, lib)
}

// loadOn loads lib on the server of c. Without REPLACE: a library of this name holds
// this source (its name carries the source's digest), so "already exists" means that
// another client loaded it first.
func loadOn(ctx context.Context, c redis.Cmdable, lib *Library) error {
	err := c.FunctionLoad(ctx, lib.src).Err()
	if msg, ok := reply(err); ok && strings.HasPrefix(msg, "Library ") && strings.HasSuffix(msg, " already exists") {
		return nil
	}
	return err
}

// refused reports whether err, a failed FUNCTION LOAD, is the server's lasting answer
// (no such command, no permission, a library it cannot compile, no memory for it)
// rather than a connection's or a passing state's (see Transient); then the Runner
// sends scripts by EVALSHA from now on.
func (r *Runner) refused(err error) bool {
	if _, ok := reply(err); !ok || Transient(err) {
		return false
	}
	r.evalOnly.Store(true)
	return true
}

// functionMissing reports whether err is the server's answer to an FCALL of a
// function it does not have.
func functionMissing(err error) bool {
	msg, ok := reply(err)
	return ok && strings.HasPrefix(msg, "Function not found")
}

// functionsUnavailable reports whether err is the server's answer to an FCALL or a
// FUNCTION command it does not know (Redis before 7: "unknown command"), or that the
// user may not run (NOPERM naming the command; a NOPERM for a key or a channel says
// nothing about functions). An error of the function's own code never says either.
func functionsUnavailable(err error) bool {
	msg, ok := reply(err)
	switch {
	case !ok:
		return false
	case strings.HasPrefix(msg, "unknown command"), strings.HasPrefix(msg, "unknown subcommand"):
		return true
	case strings.HasPrefix(msg, "NOPERM"):
		return strings.Contains(msg, "'fcall'") || strings.Contains(msg, "'function")
	}
	return false
}

// reply is the text of err when it is an error reply of the server, without the
// "ERR " that starts most.
func reply(err error) (string, bool) {
	var re redis.Error
	if !errors.As(err, &re) {
		return "", false
	}
	return strings.TrimPrefix(re.Error(), "ERR "), true
}

// Del deletes key.
func (r *Runner) Del(ctx context.Context, key string) error {
	return r.c.Del(ctx, key).Err()
}

// Subscribe returns a pub/sub connection that subscribes to nothing yet, dialled on
// first use (see redis.PubSub).
func (r *Runner) Subscribe(ctx context.Context) *redis.PubSub {
	return r.c.Subscribe(ctx)
}

// EscapeGlob escapes the characters SCAN's MATCH gives meaning to, so that a prefix
// matches itself.
func EscapeGlob(s string) string {
	var b strings.Builder
	for _, r := range s {
		if strings.ContainsRune(`*?[]\`, r) {
			b.WriteByte('\\')
		}
		b.WriteRune(r)
	}
	return b.String()
}

// List yields what decode makes of every key that matches the glob match and,
// unless typ is "", is of Redis type typ (SCAN MATCH ... TYPE ...): s runs on each key
// found, one pipelined call per key a SCAN batch at a time, on every master of a
// Cluster in turn; keysOf gives the keys of s's call for a key found, args its
// arguments; decode gets the key and the call's reply, and skips the key by returning
// ok false. Iteration stops at the first error, which is yielded with a zero T and
// what before its text ("mutex: list: ...").
func List[T any](ctx context.Context, r *Runner, what, match, typ string, s *Script, keysOf func(key string) []string, args []any,
	decode func(key string, reply []any) (v T, ok bool, err error)) iter.Seq2[T, error] {
	return func(yield func(T, error) bool) {
		var stop error
		stopped := false
		err := r.scan(ctx, match, typ, s, keysOf, args, func(key string, cmd *redis.Cmd) bool {
			reply, err := cmd.Slice()
			if err != nil {
				stop = fmt.Errorf("%s: %w", shortkey.Show(key), err)
				return false
			}
			v, ok, err := decode(key, reply)
			switch {
			case err != nil:
				stop = err
				return false
			case ok && !yield(v, nil):
				stopped = true
				return false
			}
			return true
		})
		if err == nil {
			err = stop
		}
		if err != nil && !stopped {
			var zero T
			yield(zero, fmt.Errorf("%s: %w", what, err))
		}
	}
}

// scan runs s on every key that matches match and typ (see List), calling fn with
// each key and its reply until fn returns false; it returns the first error of the
// scan or of a call.
func (r *Runner) scan(ctx context.Context, match, typ string, s *Script, keysOf func(key string) []string, args []any,
	fn func(key string, cmd *redis.Cmd) bool) error {
	nodes := []redis.UniversalClient{r.c}
	if cc, ok := r.c.(*redis.ClusterClient); ok {
		// ForEachMaster runs its function on every master at once; fn must not be
		// called concurrently, so collect the masters and scan them in turn.
		var mu sync.Mutex
		nodes = nodes[:0]
		err := cc.ForEachMaster(ctx, func(_ context.Context, node *redis.Client) error {
			mu.Lock()
			nodes = append(nodes, node)
			mu.Unlock()
			return nil
		})
		if err != nil {
			return err
		}
	}
	for _, node := range nodes {
		if more, err := r.scanNode(ctx, node, match, typ, s, keysOf, args, fn); err != nil || !more {
			return err
		}
	}
	return nil
}

// scanNode is scan on one node; more is false when fn stopped it. Its calls follow
// Run's rules: FCALL, loading the library on the node where it is missing, or EVALSHA,
// loading the script on NOSCRIPT (see scanCalls).
func (r *Runner) scanNode(ctx context.Context, node redis.UniversalClient, match, typ string, s *Script, keysOf func(string) []string, args []any,
	fn func(string, *redis.Cmd) bool) (more bool, err error) {
	var cursor uint64
	for {
		var sc *redis.ScanCmd
		if typ == "" {
			sc = node.Scan(ctx, cursor, match, 200)
		} else {
			sc = node.ScanType(ctx, cursor, match, 200, typ)
		}
		keys, next, err := sc.Result()
		if err != nil {
			return false, err
		}
		if len(keys) > 0 {
			cmds, err := r.scanCalls(ctx, node, keys, s, keysOf, args)
			if err != nil {
				return false, err
			}
			for i, cmd := range cmds {
				if !fn(keys[i], cmd) {
					return false, nil
				}
			}
		}
		if cursor = next; cursor == 0 {
			return true, nil
		}
	}
}

// scanCalls runs s on each of keys, found by a SCAN of node, in one pipeline. When
// the first call found the function missing, or functions unavailable, or the script
// not cached, it loads the library or turns to EVALSHA, or sends the script's source
// by EVAL (which caches it, as Run's EVALSHA does: a user whose ACL allows EVAL but
// not SCRIPT LOAD may scan too), and sends the pipeline again: at most twice (FCALL,
// then EVALSHA, then EVAL).
func (r *Runner) scanCalls(ctx context.Context, node redis.UniversalClient, keys []string, s *Script, keysOf func(string) []string, args []any) ([]*redis.Cmd, error) {
	cmds := make([]*redis.Cmd, len(keys))
	eval := false // send the source: the script was not cached
	for attempt := 0; ; attempt++ {
		fcall := s.lib != nil && !r.evalOnly.Load()
		pipe := node.Pipeline()
		for i, k := range keys {
			switch {
			case eval:
				cmds[i] = s.s.Eval(ctx, pipe, keysOf(k), args...)
			case fcall:
				cmds[i] = pipe.FCall(ctx, s.fn, keysOf(k), args...)
			default:
				cmds[i] = s.s.EvalSha(ctx, pipe, keysOf(k), args...)
			}
		}
		execPipe(ctx, pipe)
		err := cmds[0].Err()
		switch {
		case attempt == 2 || eval:
			return cmds, nil
		case fcall && functionMissing(err):
			if lerr := loadOn(ctx, node, s.lib); lerr != nil && !r.refused(lerr) {
				return nil, lerr
			}
		case fcall && functionsUnavailable(err):
			r.evalOnly.Store(true)
		case !fcall && redis.HasErrorPrefix(err, "NOSCRIPT"):
			eval = true
		default:
			return cmds, nil
		}
	}
}

// execPipe sends pipe and leaves on each of its commands the error it failed with.
// go-redis gives every command the error of a connection that failed, except when it
// tried again until its retries ran out and the last try got no connection (the dial
// was refused): then only Exec returns the error, and the commands carry none and no
// reply, which their callers would read as an empty answer ("redis: unexpected
// type=<nil> for Slice"). execPipe gives that error to each command without one, as
// go-redis does when it stops trying for any other reason; a Redis error reply is
// left to the command it answered.
func execPipe(ctx context.Context, pipe redis.Pipeliner) {
	cmds, err := pipe.Exec(ctx)
	var re redis.Error
	if err == nil || errors.As(err, &re) {
		return
	}
	for _, c := range cmds {
		if c.Err() == nil {
			c.SetErr(err)
		}
	}
}

// Transient reports whether err, from a call of a Runner, says that Redis could not
// be reached or could not serve the call for a while, so that the same call may
// succeed later: the connection failed or timed out, go-redis's pool had no
// connection, or the server answered that it is loading, read-only, without its
// master, or a Cluster slot is moving. An error that Redis gives for the call itself
// (a script error, a command the user may not run) is not transient, and neither is
// a closed client or an ended context.
func Transient(err error) bool {
	var re redis.Error
	var ne net.Error
	switch {
	case err == nil, errors.Is(err, redis.ErrClosed),
		errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return false
	case errors.As(err, &re):
		for _, p := range transientReplies {
			if strings.HasPrefix(re.Error(), p) {
				return true
			}
		}
		return false
	case errors.As(err, &ne), errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF),
		errors.Is(err, redis.ErrPoolTimeout):
		return true
	}
	return false
}

// transientReplies begin the error replies of a server that cannot serve a call for a
// while.
var transientReplies = []string{"LOADING ", "READONLY ", "MASTERDOWN ", "TRYAGAIN ", "CLUSTERDOWN ", "BUSY ", "ERR max number of clients"}
