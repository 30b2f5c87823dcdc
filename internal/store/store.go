// Package store is the one seam between asynqmutex's packages and Redis: every script
// they run, every subscription and every scan goes through a Runner, so that how a
// script is sent (EVALSHA, loading it on NOSCRIPT), how keys of several Redis Cluster
// slots are split into calls, and what wraps a call happen in one place. The callers
// own their scripts, key names and stored formats; a Runner only carries them.
package store

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"sync"

	"github.com/redis/go-redis/v9"
)

// Script is a Lua script of a package, sent by a Runner. name says which it is in
// errors and traces.
type Script struct {
	name string
	src  string
	s    *redis.Script
}

// NewScript returns the script with source src, named name.
func NewScript(name, src string) *Script {
	return &Script{name: name, src: src, s: redis.NewScript(src)}
}

// Name returns the script's name.
func (s *Script) Name() string { return s.name }

// Hash returns the SHA-1 digest EVALSHA sends, and Source the source EVAL sends:
// what a test that watches commands looks for.
func (s *Script) Hash() string   { return s.s.Hash() }
func (s *Script) Source() string { return s.src }

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

// CountsSubscribers reports whether PUBLISH's answer counts every subscriber of a
// channel: false on Redis Cluster, where it counts those of one node.
func (r *Runner) CountsSubscribers() bool { return r.countsSubscribers }

// Run runs s with keys and args in one call. All keys must share a Redis Cluster hash
// slot.
func (r *Runner) Run(ctx context.Context, s *Script, keys []string, args ...any) *redis.Cmd {
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

// Load loads s into the script cache of the server that c reaches (every master of
// a Cluster), so that the next EVALSHA finds it.
func (r *Runner) Load(ctx context.Context, s *Script) error {
	return s.s.Load(ctx, r.c).Err()
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

// Scan runs s on every key that matches the glob match and, unless typ is "", is of
// Redis type typ (SCAN MATCH ... TYPE ...), on every master of a Cluster in turn, pipelining one
// call per key a SCAN batch at a time. keysOf gives the keys of s's call for a key
// found, args its arguments; fn gets the key and its reply, and stops the scan by
// returning false (Scan then returns nil). It returns the first error of the scan or
// of a call.
func (r *Runner) Scan(ctx context.Context, match, typ string, s *Script, keysOf func(key string) []string, args []any,
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
		if more, err := scanNode(ctx, node, match, typ, s, keysOf, args, fn); err != nil || !more {
			return err
		}
	}
	return nil
}

// scanNode is Scan on one node; more is false when fn stopped it.
func scanNode(ctx context.Context, node redis.UniversalClient, match, typ string, s *Script, keysOf func(string) []string, args []any,
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
			pipe := node.Pipeline()
			cmds := make([]*redis.Cmd, len(keys))
			for i, k := range keys {
				cmds[i] = s.s.EvalSha(ctx, pipe, keysOf(k), args...)
			}
			_, _ = pipe.Exec(ctx)
			if redis.HasErrorPrefix(cmds[0].Err(), "NOSCRIPT") {
				if err := s.s.Load(ctx, node).Err(); err != nil {
					return false, err
				}
				continue // the same cursor again, now that the script is loaded
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
