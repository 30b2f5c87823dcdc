package store

import (
	"context"
	"sync"
	"sync/atomic"

	"github.com/redis/go-redis/v9"
)

// A Rider is a script call that travels in the round trip of another package's
// call: a step that must follow the caller's work and may go with its last Redis
// call (an ordered task's place, finished in the pipeline of its lock's release).
// Carry puts it in a context; once Board gave it its script and arguments, the next Run made
// with that context, or one derived from it, by a Runner on the same redis client,
// sends it first in one pipeline with its own script: one round trip for both.
// Result is its reply, and sends it alone when no call carried it.
//
// The two calls are not atomic together: other clients' commands may run between
// them, as between two calls. Each keeps the fallbacks of Run (a missing function
// or script is loaded and the call sent again, alone). A Rider is sent once. It is
// safe for concurrent use.
type Rider struct {
	run  *Runner
	keys []string

	call   atomic.Pointer[call] // set by Board
	taken  atomic.Bool          // a call carries it, or Result sends it
	done   chan struct{}        // closed once cmd is set
	cmd    *redis.Cmd
	finish sync.Once
}

// call is a Rider's script and arguments.
type call struct {
	s    *Script
	args []any
}

// NewRider returns a Rider that runs a script, which Board names, on keys (one hash
// slot), through r.
func (r *Runner) NewRider(keys []string) *Rider {
	return &Rider{run: r, keys: keys, done: make(chan struct{})}
}

type riderKey struct{}

// Carry returns a context derived from ctx that carries rd (see Rider).
func Carry(ctx context.Context, rd *Rider) context.Context {
	return context.WithValue(ctx, riderKey{}, rd)
}

// Board makes rd ready to go as a call of s with args: the next call that may carry
// it does. Only the first Board counts.
func (rd *Rider) Board(s *Script, args ...any) {
	rd.call.CompareAndSwap(nil, &call{s: s, args: args})
}

// Boarded reports whether rd boarded as a call of s.
func (rd *Rider) Boarded(s *Script) bool {
	c := rd.call.Load()
	return c != nil && c.s == s
}

// Result returns rd's reply: that of the call that carried it, or, when none did,
// of its own call, sent now with ctx. It returns nil if rd never boarded.
func (rd *Rider) Result(ctx context.Context) *redis.Cmd {
	c := rd.call.Load()
	if c == nil {
		return nil
	}
	if rd.taken.CompareAndSwap(false, true) {
		rd.set(rd.run.Run(ctx, c.s, rd.keys, c.args...))
	}
	<-rd.done
	return rd.cmd
}

func (rd *Rider) set(cmd *redis.Cmd) {
	rd.finish.Do(func() {
		rd.cmd = cmd
		close(rd.done)
	})
}

// riderFor returns the Rider that ctx carries, boarded and not sent, if r may
// carry it (it runs on r's redis client), and takes it; nil otherwise.
func (r *Runner) riderFor(ctx context.Context) (*Rider, *call) {
	rd, ok := ctx.Value(riderKey{}).(*Rider)
	if !ok || rd == nil || rd.run.c != r.c {
		return nil, nil
	}
	c := rd.call.Load()
	if c == nil || !rd.taken.CompareAndSwap(false, true) {
		return nil, nil
	}
	return rd, c
}

// runCarrying sends rd's call and then s's in one pipeline, and returns s's reply;
// rd's is kept for its Result. A call that failed for a missing function or
// script goes again alone, through Run and its fallbacks.
func (r *Runner) runCarrying(ctx context.Context, rd *Rider, c *call, s *Script, keys []string, args []any) *redis.Cmd {
	pipe := r.c.Pipeline()
	rc := rd.run.queue(ctx, pipe, c.s, rd.keys, c.args)
	mc := r.queue(ctx, pipe, s, keys, args)
	execPipe(ctx, pipe)
	if retryAlone(rc.Err()) {
		rc = rd.run.Run(ctx, c.s, rd.keys, c.args...)
	}
	rd.set(rc)
	if retryAlone(mc.Err()) {
		mc = r.Run(ctx, s, keys, args...) // rd is taken: it does not go again
	}
	return mc
}

// queue adds a call of s to pipe as Run would send it first.
func (r *Runner) queue(ctx context.Context, pipe redis.Pipeliner, s *Script, keys []string, args []any) *redis.Cmd {
	if s.lib != nil && !r.evalOnly.Load() {
		return pipe.FCall(ctx, s.fn, keys, args...)
	}
	return s.s.EvalSha(ctx, pipe, keys, args...)
}

// retryAlone reports whether err, a pipelined script call's, is one that Run's
// fallbacks answer: a function or a cached script missing, or functions
// unavailable.
func retryAlone(err error) bool {
	return functionMissing(err) || functionsUnavailable(err) || redis.HasErrorPrefix(err, "NOSCRIPT")
}
