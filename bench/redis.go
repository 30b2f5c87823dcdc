package main

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"

	"github.com/redis/go-redis/v9"
)

// Commands a mutex.Client sends itself. INFO commandstats also counts the commands
// that scripts run (SET, DEL, PUBLISH...), which cannot be told apart from sent ones,
// but the lock never sends those directly.
var lockCommands = []string{"evalsha", "eval", "script", "subscribe", "unsubscribe", "ping"}

// Commands the raw SET NX/DEL floor sends.
var floorCommands = []string{"set", "del"}

// cmdStats is a sum over some commands of INFO commandstats: calls, and the
// microseconds the server spent running them (for a script, the whole script).
type cmdStats struct{ calls, usec int64 }

func (a cmdStats) sub(b cmdStats) cmdStats { return cmdStats{a.calls - b.calls, a.usec - b.usec} }

func commandStats(ctx context.Context, rdb *redis.Client, cmds []string) (cmdStats, error) {
	info, err := rdb.Info(ctx, "commandstats").Result()
	if err != nil {
		return cmdStats{}, err
	}
	var sum cmdStats
	for _, line := range strings.Split(info, "\n") {
		name, rest, ok := strings.Cut(strings.TrimSpace(line), ":")
		if !ok || !slices.Contains(cmds, strings.TrimPrefix(name, "cmdstat_")) {
			continue
		}
		for _, field := range strings.Split(rest, ",") {
			k, v, _ := strings.Cut(field, "=")
			var dst *int64
			switch k {
			case "calls":
				dst = &sum.calls
			case "usec":
				dst = &sum.usec
			default:
				continue
			}
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				return cmdStats{}, fmt.Errorf("commandstats line %q: %w", line, err)
			}
			*dst += n
		}
	}
	return sum, nil
}

// attemptCounter is a go-redis hook on a mutex.Client's connection pool that counts
// lock attempts, and those that found the key held. It recognises a lock attempt by
// its reply: lock.lua is the only script of package mutex that returns a pair
// {fence, 0} or {0, pttl}.
type attemptCounter struct{ attempts, failed atomic.Int64 }

var _ redis.Hook = (*attemptCounter)(nil)

func (h *attemptCounter) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *attemptCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *attemptCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if name := cmd.Name(); name != "evalsha" && name != "eval" {
			return err
		}
		c, ok := cmd.(*redis.Cmd)
		if !ok {
			return err
		}
		if res, rerr := c.Int64Slice(); rerr == nil && len(res) == 2 {
			h.attempts.Add(1)
			if res[0] == 0 {
				h.failed.Add(1)
			}
		}
		return err
	}
}
