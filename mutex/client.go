package mutex

import (
	"context"
	"log/slog"
	"os"
	"strconv"

	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex/internal/rediskey"
	"github.com/asynqmutex/asynqmutex/internal/shortkey"
	"github.com/asynqmutex/asynqmutex/internal/store"
)

// Client takes locks on one Redis deployment. Create it with New; it is safe for
// concurrent use by many goroutines, and one Client per process is enough: its
// waiters share one subscription connection, opened while someone waits and closed
// 200ms after the last waiter leaves (see Close).
type Client struct {
	rdb      redis.UniversalClient
	run      *store.Runner // every Redis call of the Client goes through it
	prefix   string
	channels string // prefix + channelInfix: a Client listens on channels + its id
	hub      *hub
	plain    plainKind // the kinds of lock (kind.go)
	slots    slotsKind

	// countsSubscribers is "1" unless PUBLISH counts only the subscribers of one node
	// (Redis Cluster): then zero does not mean nobody listens.
	countsSubscribers string

	self    string // "<host>\t<pid>\t": this process, recorded in every lock it takes (see Holder)
	desc    string // the description of a holder without HeldBy
	observe func(ctx context.Context, e Event)
	logger  *slog.Logger // nil: slog.Default() when a record is logged

	// replicas is the wait for replicas after every grant and renewal (WaitReplicas);
	// N 0: none.
	replicas store.Replicas
}

// Option configures a Client in New.
type Option interface{ apply(*Client) }

type optionFunc func(*Client)

func (f optionFunc) apply(c *Client) { f(c) }

// Prefix sets the prefix of the Redis keys and channels the Client uses. The default
// is DefaultPrefix ("asynqmutex:"). Clients that should exclude each other must use
// the same prefix. Prefix panics if p contains '{' or '}', which would move a lock's
// keys out of the Redis Cluster hash slot they share.
func Prefix(p string) Option {
	rediskey.CheckPrefix("mutex.Prefix", p)
	return optionFunc(func(c *Client) { c.prefix = p })
}

// New returns a Client that keeps its locks in client, which may be a single-node,
// Sentinel failover or Cluster client. The scripts are loaded on first use, as one
// function library called with FCALL where the server (Redis 7 and later) and the
// user's ACL allow, and otherwise sent with EVALSHA, so New does no I/O. New panics if
// client is nil.
func New(client redis.UniversalClient, opts ...Option) *Client {
	if client == nil {
		panic("mutex.New: nil redis client")
	}
	c := &Client{rdb: client, run: store.New(client), prefix: DefaultPrefix,
		self: hostname() + "\t" + strconv.Itoa(os.Getpid()) + "\t"}
	c.countsSubscribers = "0"
	if c.run.CountsSubscribers() {
		c.countsSubscribers = "1"
	}
	for _, o := range opts {
		o.apply(c)
	}
	c.checkReplicas()
	c.channels = c.prefix + channelInfix
	c.desc = describe(c.self, "", "")
	c.plain, c.slots = plainKind{c}, slotsKind{c}
	c.hub = newHub(c)
	return c
}

// Redis returns the Redis client the Client keeps its locks in, as given to New. The
// asynqmutex middleware keeps its count of a task's conflicts there too.
func (c *Client) Redis() redis.UniversalClient { return c.rdb }

// Prefix returns the prefix of the Redis keys and channels the Client uses (see the
// Prefix option).
func (c *Client) Prefix() string { return c.prefix }

// Close closes the subscription connection the Client's waiters share, at once
// rather than 200ms after the last waiter left, so that the redis client can be closed
// next without go-redis logging a broken connection. Waiters still waiting fall back
// to trying again when the holder's lease runs out, and a later wait reopens the
// connection. Locks are not released. Close is optional, idempotent, and safe for
// concurrent use; it always returns nil.
func (c *Client) Close() error {
	c.hub.close()
	return nil
}

// redisKey is the Redis key of the lock on key.
func (c *Client) redisKey(key string) string { return redisKey(c.prefix, key) }

// describe is what a holder with HeldBy's name and id says about itself.
func (c *Client) describe(by heldBy) string {
	if by == (heldBy{}) {
		return c.desc
	}
	return describe(c.self, by.name, by.id)
}

func hostname() string {
	h, err := os.Hostname()
	if err != nil || h == "" {
		return "unknown"
	}
	return shortkey.Field(h)
}
