//go:build linux

package failover

// The node monitor: ROLE read from every redis-server of the group every 25 ms, so
// that a failover is dated by what the servers themselves said — when the promoted
// replica answered as a master, and until when another replica still followed the
// old master — and not by what a sentinel or a client was told, later. While a
// replica follows the old master after another was promoted, a WAIT on the old
// master counts it: the old master's grants and renewals are confirmed by a replica
// that will drop them (it syncs from the new master). That is the window.

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// roleEvery is the node monitor's sampling period; roleTimeout bounds one ROLE, so
// that a stopped server delays no other's samples.
const (
	roleEvery   = 25 * time.Millisecond
	roleTimeout = 100 * time.Millisecond
	// watchLimit bounds a monitor that nobody stops.
	watchLimit = 5 * time.Minute
)

// roleSample is one node's ROLE at one time (now()).
type roleSample struct {
	At   int64
	Role string // "master", "slave"; "" when the node did not answer
	// Master and Link: a replica's master (host:port) and the state of its link to it
	// ("connected" once it streams; "connect", "connecting", "sync" before).
	Master, Link string
	Replicas     int // a master's replicas
}

// follows reports whether s is a replica streaming from one of masters.
func (s roleSample) follows(masters map[string]bool) bool {
	return s.Role == "slave" && s.Link == "connected" && masters[s.Master]
}

// parseRole reads a ROLE reply.
func parseRole(res []any) roleSample {
	var s roleSample
	if len(res) == 0 {
		return s
	}
	s.Role, _ = res[0].(string)
	switch {
	case s.Role == "master" && len(res) > 2:
		if l, ok := res[2].([]any); ok {
			s.Replicas = len(l)
		}
	case s.Role == "slave" && len(res) > 3:
		host, _ := res[1].(string)
		port, _ := res[2].(int64)
		s.Master = net.JoinHostPort(host, strconv.FormatInt(port, 10))
		s.Link, _ = res[3].(string)
	}
	return s
}

// readRole is ROLE from c, or a sample with no role when c does not answer.
func readRole(c *redis.Client) roleSample {
	ctx, cancel := context.WithTimeout(context.Background(), roleTimeout)
	defer cancel()
	at := now()
	res, err := c.Do(ctx, "ROLE").Slice()
	if err != nil {
		return roleSample{At: at}
	}
	s := parseRole(res)
	s.At = at
	return s
}

// roleClient is a client for ROLE samples: short timeouts, no retries.
func roleClient(addr string) *redis.Client {
	return redis.NewClient(&redis.Options{Addr: addr, DialTimeout: roleTimeout, ReadTimeout: roleTimeout,
		WriteTimeout: roleTimeout, MaxRetries: -1, PoolSize: 1})
}

// role is the first element of ROLE from addr ("master", "slave"), or "" when the
// server does not answer within roleTimeout.
func role(addr string) string {
	c := roleClient(addr)
	defer c.Close()
	return readRole(c).Role
}

// watchNodes samples ROLE on every node of addrs every roleEvery, one goroutine per
// node, until the returned func is called (or watchLimit passed); the func returns
// every node's samples, in order.
func watchNodes(addrs []string) func() map[string][]roleSample {
	stop := make(chan struct{})
	var wg sync.WaitGroup
	samples := make(map[string][]roleSample, len(addrs))
	var mu sync.Mutex
	for _, addr := range addrs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := roleClient(addr)
			defer c.Close()
			var mine []roleSample
			defer func() { mu.Lock(); samples[addr] = mine; mu.Unlock() }()
			tick := time.NewTicker(roleEvery)
			defer tick.Stop()
			for end := time.Now().Add(watchLimit); time.Now().Before(end); {
				mine = append(mine, readRole(c))
				select {
				case <-stop:
					return
				case <-tick.C:
				}
			}
		}()
	}
	var once sync.Once
	return func() map[string][]roleSample {
		once.Do(func() { close(stop); wg.Wait() })
		return samples
	}
}

// nodeTimes are the times (now() values; 0 when not seen) the node monitor saw in a
// failover of the master old.
type nodeTimes struct {
	// Promoted: the first sample after the fault in which a node other than old
	// answered as a master.
	Promoted int64
	// Left: the first sample, from Promoted on, by which every other replica had
	// stopped streaming from old (0: one still did at the end). From Promoted to Left
	// a WAIT on old can be confirmed by a replica that will drop what it confirmed.
	Left int64
	// Alone: the first sample after the fault in which old answered as a master with
	// no replica; Demoted: the first in which it answered as anything else.
	Alone, Demoted int64
}

// readNodes reads the monitor's samples of a failover of old, which replicas may
// follow under other names (aliases: the proxy that stands for it) and which was
// faulted at faultAt.
func readNodes(samples map[string][]roleSample, old string, aliases []string, faultAt int64) nodeTimes {
	var nt nodeTimes
	oldNames := map[string]bool{old: true}
	for _, a := range aliases {
		oldNames[a] = true
	}
	promoted := ""
	for addr, ss := range samples {
		for _, s := range ss {
			if s.At <= faultAt {
				continue
			}
			switch {
			case addr == old && s.Role == "master" && s.Replicas == 0 && nt.Alone == 0:
				nt.Alone = s.At
			case addr == old && s.Role != "" && s.Role != "master" && nt.Demoted == 0:
				nt.Demoted = s.At
			case addr != old && s.Role == "master" && (nt.Promoted == 0 || s.At < nt.Promoted):
				nt.Promoted, promoted = s.At, addr
			}
		}
	}
	if nt.Promoted == 0 {
		return nt
	}
	nt.Left = nt.Promoted
	for addr, ss := range samples {
		if addr == old || addr == promoted {
			continue
		}
		left := int64(0)
		for _, s := range ss {
			if s.At < nt.Promoted {
				continue
			}
			if s.follows(oldNames) {
				left = 0
			} else if left == 0 {
				left = s.At
			}
		}
		if left == 0 {
			nt.Left = 0
			break
		}
		nt.Left = max(nt.Left, left)
	}
	return nt
}

// window is the time from Promoted to Left: how long the old master could have its
// writes confirmed by a replica after another was promoted; -1 when no promotion
// was seen or a replica followed the old master to the end.
func (nt nodeTimes) window() time.Duration {
	if nt.Promoted == 0 || nt.Left == 0 {
		return -1
	}
	return time.Duration(nt.Left - nt.Promoted)
}

func (nt nodeTimes) String() string {
	return fmt.Sprintf("promoted %d, left %d, alone %d, demoted %d", nt.Promoted, nt.Left, nt.Alone, nt.Demoted)
}
