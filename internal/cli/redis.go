package cli

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex/mutex"
	"github.com/asynqmutex/asynqmutex/order"
	"github.com/asynqmutex/asynqmutex/ratelimit"
)

// dialTimeout bounds each connection attempt: a command-line tool should say soon
// that it cannot reach Redis rather than wait out go-redis's 5s default.
const dialTimeout = 3 * time.Second

// conn is the Redis connection a command runs on, and what it needs to explain
// Redis's errors in the terms of the command line.
type conn struct {
	rdb     redis.UniversalClient
	locks   *mutex.Client
	rates   *ratelimit.Limiter
	orders  *order.Sequencer
	cluster bool
	tls     bool
	where   string // the address(es), for messages; never a password
	from    string // which flag or variable gave them
	db      int    // the database number asked for
	dbFrom  string // which flag or variable gave it
}

// connect builds the Redis client the flags and environment describe. It does no I/O.
func connect(inv *invocation, env func(string) string) (*conn, error) {
	c := &conn{cluster: inv.cluster}
	var tlsConf *tls.Config
	if inv.tls || inv.tlsServer != "" || inv.insecure {
		// An empty ServerName makes crypto/tls verify the host each node is dialled at.
		tlsConf = &tls.Config{ServerName: inv.tlsServer, InsecureSkipVerify: inv.insecure, MinVersion: tls.VersionTLS12}
	}
	if inv.cluster {
		var addrs []string
		for _, a := range strings.Split(inv.clusterAddrs, ",") {
			if a = strings.TrimSpace(a); a != "" {
				addrs = append(addrs, a)
			}
		}
		if len(addrs) == 0 {
			return nil, usagef("--cluster_addrs names no address")
		}
		c.where, c.from = strings.Join(addrs, ","), "--cluster_addrs"
		if !inv.set["cluster_addrs"] {
			c.from = "the default --cluster_addrs"
		}
		c.tls = tlsConf != nil
		c.rdb = redis.NewClusterClient(&redis.ClusterOptions{
			Addrs: addrs, Password: inv.password, TLSConfig: tlsConf, DialTimeout: dialTimeout,
		})
	} else {
		opt, err := singleOptions(inv, env, c)
		if err != nil {
			return nil, err
		}
		if inv.set["db"] {
			opt.DB = inv.db
		}
		c.db, c.dbFrom = opt.DB, "--db"
		if !inv.set["db"] {
			c.dbFrom = c.from
		}
		if inv.set["password"] {
			opt.Password = inv.password
		}
		if tlsConf != nil {
			if opt.TLSConfig != nil && !inv.set["tls_server"] {
				tlsConf.ServerName = opt.TLSConfig.ServerName // rediss:// named the host
			}
			opt.TLSConfig = tlsConf
		}
		c.tls = opt.TLSConfig != nil
		if opt.DialTimeout == 0 { // a URL's dial_timeout wins
			opt.DialTimeout = dialTimeout
		}
		c.where = opt.Addr
		c.rdb = redis.NewClient(opt)
	}
	c.locks = mutex.New(c.rdb, mutex.Prefix(inv.prefix))
	c.rates = ratelimit.New(c.rdb, ratelimit.Prefix(inv.prefix))
	c.orders = order.New(c.rdb, order.Prefix(inv.prefix))
	return c, nil
}

// singleOptions reads the address of a single node from --uri, else REDIS_URL, else
// the default, and notes in c where it came from.
func singleOptions(inv *invocation, env func(string) string, c *conn) (*redis.Options, error) {
	uri, from := inv.uri, "--uri"
	if !inv.set["uri"] {
		if u := env("REDIS_URL"); u != "" {
			uri, from = u, "REDIS_URL"
		} else {
			from = "the default; set --uri or REDIS_URL"
		}
	}
	c.from = from
	return parseAddr(uri, from)
}

// parseAddr reads uri, host:port or a redis://, rediss:// or unix:// URL, that from
// (a flag or variable, for messages) gave.
func parseAddr(uri, from string) (*redis.Options, error) {
	if !strings.Contains(uri, "://") {
		if _, _, err := net.SplitHostPort(uri); err != nil {
			return nil, usagef("%s: %s is not host:port or a redis:// URL", from, uri)
		}
		return &redis.Options{Addr: uri}, nil
	}
	opt, err := redis.ParseURL(uri)
	if err != nil {
		// url.Error quotes the whole URL, password included.
		if ue := (*url.Error)(nil); errors.As(err, &ue) {
			err = ue.Err
		}
		return nil, usagef("%s is not a Redis URL (redis://[user:password@]host:port[/db], rediss:// or unix://): %v", from, err)
	}
	return opt, nil
}

// connectAsynq returns the connection to asynq's Redis that --asynq_uri names, a
// single node, or c itself without the flag: asynq's queues in the Redis of the
// locks. It does no I/O.
func (c *conn) connectAsynq(inv *invocation) (*conn, error) {
	if !inv.set["asynq_uri"] {
		return c, nil
	}
	opt, err := parseAddr(inv.asynqURI, "--asynq_uri")
	if err != nil {
		return nil, err
	}
	if opt.DialTimeout == 0 {
		opt.DialTimeout = dialTimeout
	}
	return &conn{rdb: redis.NewClient(opt), tls: opt.TLSConfig != nil, where: opt.Addr, from: "--asynq_uri",
		db: opt.DB, dbFrom: "--asynq_uri"}, nil
}

func (c *conn) close() {
	if c.locks != nil {
		_ = c.locks.Close()
	}
	_ = c.rdb.Close()
}

// check makes the first contact: it reports an unreachable server, a refused
// password, and a topology the flags do not match (a cluster node reached without
// --cluster would be listed only in part) as plain advice.
func (c *conn) check(ctx context.Context) error {
	if !c.cluster {
		info, err := c.rdb.Info(ctx, "cluster").Result()
		var reply redis.Error
		if err != nil && !errors.As(err, &reply) {
			return c.explain(err)
		}
		if err != nil && !redis.HasErrorPrefix(err, "NOPERM") {
			// The server answered but has no cluster section (an embedded Redis
			// such as miniredis): it is no cluster node. A refused password is
			// still reported.
			if err := c.rdb.Ping(ctx).Err(); err != nil {
				return c.explain(err)
			}
		}
		if strings.Contains(info, "cluster_enabled:1") {
			return fmt.Errorf("%s is a Redis Cluster node, and without --cluster the tool would see only its keys:\n"+
				"run it with --cluster --cluster_addrs %s (one or more nodes, comma-separated)", c.where, c.where)
		}
	} else if err := c.rdb.Ping(ctx).Err(); err != nil {
		return c.explain(err)
	}
	return nil
}

// explain turns errors whose cause is the connection or the topology into advice.
func (c *conn) explain(err error) error {
	if err == nil || errors.Is(err, errReported) {
		return err
	}
	var ne net.Error
	var oe *net.OpError
	var ve *tls.CertificateVerificationError
	switch {
	case errors.Is(err, context.Canceled):
		return errors.New("interrupted")
	case strings.Contains(err.Error(), "cluster support disabled"):
		return fmt.Errorf("%s is not a Redis Cluster node (cluster support disabled):\n"+
			"run it without --cluster, giving the address with --uri", c.where)
	case !c.cluster && (strings.Contains(err.Error(), "MOVED ") || strings.Contains(err.Error(), "CROSSSLOT") || strings.Contains(err.Error(), "CLUSTERDOWN")):
		return fmt.Errorf("%s is a Redis Cluster node: run it with --cluster --cluster_addrs %s", c.where, c.where)
	case strings.Contains(err.Error(), "NOAUTH"):
		return fmt.Errorf("the server at %s wants a password: give --password, or a REDIS_URL with one", c.where)
	case strings.Contains(err.Error(), "WRONGPASS") || strings.Contains(err.Error(), "invalid password"):
		return fmt.Errorf("the server at %s refused the password (check --password or REDIS_URL; an ACL user goes in\n"+
			"the URL: redis://user:password@host:port)", c.where)
	case errors.As(err, &ve):
		return fmt.Errorf("the TLS certificate of the server at %s could not be verified (%v):\n"+
			"give the name it was issued for with --tls_server, or skip verification with --insecure", c.where, ve.Err)
	case errors.As(err, &oe) && oe.Op == "dial", errors.As(err, &ne) && ne.Timeout(), errors.Is(err, context.DeadlineExceeded):
		if c.tls {
			// A server without TLS never answers the TLS handshake: it waits for a
			// command line, and the handshake times out.
			return fmt.Errorf("could not reach Redis at %s (%s) over TLS: %v; if the server does not use TLS,\n"+
				"run it without --tls, --tls_server and --insecure", c.where, c.from, cause(err))
		}
		return fmt.Errorf("could not reach Redis at %s (%s): %v", c.where, c.from, cause(err))
	case strings.Contains(err.Error(), "first record does not look like a TLS handshake"):
		return fmt.Errorf("the server at %s does not speak TLS: run it without --tls, --tls_server and --insecure", c.where)
	case strings.Contains(err.Error(), "DB index is out of range"):
		return fmt.Errorf("the server at %s has no database %d (%s); Redis has databases 0 to 15 unless its 'databases' setting says otherwise",
			c.where, c.db, c.dbFrom)
	case notRedis(err):
		return fmt.Errorf("the server at %s (%s) is not Redis: it answered %s; check the address and port", c.where, c.from, replyOf(err))
	case errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || strings.Contains(err.Error(), "connection reset"):
		return fmt.Errorf("the server at %s closed the connection (%v); if it requires TLS, add --tls", c.where, cause(err))
	}
	return err
}

// refusedByACL reports whether err is Redis refusing the user a command: NOPERM,
// or "can't run this command" from a script or function.
func refusedByACL(err error) bool {
	var re redis.Error
	if !errors.As(err, &re) {
		return false
	}
	return strings.Contains(re.Error(), "NOPERM") || strings.Contains(re.Error(), "can't run this command")
}

// notRedis reports whether err is go-redis failing to read a reply: the server
// answered, but not in Redis's protocol (an HTTP server, say).
func notRedis(err error) bool {
	msg := err.Error()
	return strings.Contains(msg, "redis: invalid reply") || strings.Contains(msg, "can't parse") ||
		strings.Contains(msg, "redis: unexpected")
}

// replyOf is the start of what a server that is not Redis answered, as go-redis
// quotes it in err, or err itself.
func replyOf(err error) string {
	msg := err.Error()
	if i := strings.IndexByte(msg, '"'); i >= 0 {
		return msg[i:]
	}
	return msg
}

// cause strips the wrapping mutex and ratelimit add, which repeats the key, from a network error.
func cause(err error) error {
	var oe *net.OpError
	if errors.As(err, &oe) {
		return oe
	}
	return err
}
