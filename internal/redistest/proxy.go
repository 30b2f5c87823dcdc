package redistest

import (
	"bytes"
	"context"
	"net"
	"sync"
	"testing"
	"time"
)

// proxyBufSize is small so that one read is usually one RESP reply, which
// keeps DropReplies' unit (a chunk) close to "one reply" for the small
// commands lock tests send.
const proxyBufSize = 4 << 10

// proxyDialTimeout bounds the dial to the target; Close cancels it sooner.
const proxyDialTimeout = 5 * time.Second

// Proxy is a TCP proxy on 127.0.0.1 in front of a target address, with
// switches that inject the network faults a Redis client must survive: lost
// replies (DropReplies), a silent network (Blackhole) and resets (CloseAll).
//
// With no switch set it forwards bytes unchanged in both directions. Create
// it with NewProxy; all methods are safe for concurrent use, including with
// traffic in flight.
type Proxy struct {
	ln     net.Listener
	target string
	ctx    context.Context // cancelled by close, to abort dials in flight
	cancel context.CancelFunc
	wg     sync.WaitGroup // the accept loop and every connection goroutine

	mu        sync.Mutex
	closed    bool
	conns     map[*proxyConn]struct{}
	dropLeft  int // replies still to drop
	dropped   int
	blackhole bool
}

// proxyConn is one client connection and its connection to the target.
type proxyConn struct {
	client, server net.Conn
	once           sync.Once
	// tainted is set, under Proxy.mu, once the blackhole has swallowed bytes
	// of this connection: its streams are out of step, so it must not carry
	// traffic after the blackhole lifts.
	tainted bool
	// subscriber is set, under Proxy.mu, once the client sent a SUBSCRIBE on it;
	// frozen, by FreezeSubscribers, makes it swallow everything for good.
	subscriber, frozen bool
	// ready is set, under Proxy.mu, once the client sent a request that is not
	// part of go-redis's connection handshake (HELLO, CLIENT SETINFO): DropReplies
	// acts on ready connections only.
	ready bool
}

func (c *proxyConn) close() {
	c.once.Do(func() {
		_ = c.client.Close()
		_ = c.server.Close()
	})
}

// NewProxy starts a proxy on a free 127.0.0.1 port forwarding to target and
// closes it in t.Cleanup; when the test ends every connection is closed and
// every goroutine of the proxy has returned, so goleak stays quiet. The
// target is dialled once per client connection, when the client connects; a
// failed dial closes that client connection. NewProxy fails the test if it
// cannot listen.
func NewProxy(t testing.TB, target string) *Proxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("redistest.NewProxy: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &Proxy{
		ln:     ln,
		target: target,
		ctx:    ctx,
		cancel: cancel,
		conns:  make(map[*proxyConn]struct{}),
	}
	p.wg.Add(1)
	go p.acceptLoop()
	t.Cleanup(p.close)
	return p
}

// Addr returns the proxy's address, "127.0.0.1:<port>"; point clients here
// instead of at the target. It is safe for concurrent use.
func (p *Proxy) Addr() string {
	return p.ln.Addr().String()
}

// DropReplies makes the proxy lose the next n replies: for each of the next n
// chunks the target sends (one read from a target connection that returned
// bytes, usually one whole reply for small commands), the proxy discards the
// chunk and closes that client connection and its target connection. The
// request that caused the reply was delivered, so the target applied it but
// the client sees EOF instead of the answer; go-redis then retries on a new
// connection unless retries are off. Replies to go-redis's connection
// handshake (HELLO, CLIENT SETINFO) are never dropped: a connection's
// replies are dropped only once it sent another command, so that a loss
// always falls on a command, also when the connection a loss closed is
// replaced while the next loss is armed.
//
// Calls add to the pending count; n <= 0 cancels drops not yet made. It is
// safe for concurrent use.
func (p *Proxy) DropReplies(n int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if n <= 0 {
		p.dropLeft = 0
		return
	}
	p.dropLeft += n
}

// Blackhole switches the silent network on or off. While on, the proxy
// accepts connections and reads bytes in both directions but delivers
// nothing, and keeps connections open, so clients wait until their own
// timeouts. Turning it off closes the connections whose bytes were swallowed
// (their request and reply streams no longer match) and leaves untouched
// ones, and new connections, working normally. The default is off. It is
// safe for concurrent use.
func (p *Proxy) Blackhole(on bool) {
	p.mu.Lock()
	p.blackhole = on
	var victims []*proxyConn
	if !on {
		for c := range p.conns {
			if c.tainted {
				victims = append(victims, c)
			}
		}
	}
	p.mu.Unlock()
	for _, c := range victims {
		c.close()
	}
}

// FreezeSubscribers makes every connection on which the client has sent a
// SUBSCRIBE die silently: from now on it swallows all bytes in both directions
// and stays open, as a connection does whose peer vanished without a reset, so
// the server keeps counting the subscriber while nothing reaches it. Other and
// later connections are not affected. It returns how many were frozen.
func (p *Proxy) FreezeSubscribers() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for c := range p.conns {
		if c.subscriber && !c.frozen {
			c.frozen = true
			n++
		}
	}
	return n
}

// CloseAll resets every current connection, as a network failure or a proxy
// restart would; the proxy keeps accepting new ones. It is safe for
// concurrent use.
func (p *Proxy) CloseAll() {
	p.mu.Lock()
	victims := make([]*proxyConn, 0, len(p.conns))
	for c := range p.conns {
		victims = append(victims, c)
	}
	p.mu.Unlock()
	for _, c := range victims {
		c.close()
	}
}

// Conns returns how many client connections the proxy holds open now. A
// connection leaves the count once both of its goroutines have seen it
// closed, so right after a close it may still be counted briefly. It is
// safe for concurrent use.
func (p *Proxy) Conns() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.conns)
}

// Dropped returns how many replies DropReplies has discarded so far. It is
// safe for concurrent use.
func (p *Proxy) Dropped() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.dropped
}

// close stops accepting, resets every connection and waits for every
// goroutine. It is idempotent.
func (p *Proxy) close() {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	p.cancel()
	_ = p.ln.Close()
	p.CloseAll()
	p.wg.Wait()
}

func (p *Proxy) acceptLoop() {
	defer p.wg.Done()
	for {
		client, err := p.ln.Accept()
		if err != nil {
			// Temporary errors (EMFILE) would spin here; a test proxy that
			// cannot accept is better dead, and only close is expected.
			return
		}
		p.wg.Add(1)
		go p.serve(client)
	}
}

func (p *Proxy) serve(client net.Conn) {
	defer p.wg.Done()
	ctx, cancel := context.WithTimeout(p.ctx, proxyDialTimeout)
	var d net.Dialer
	server, err := d.DialContext(ctx, "tcp", p.target)
	cancel()
	if err != nil {
		_ = client.Close()
		return
	}
	c := &proxyConn{client: client, server: server}
	p.mu.Lock()
	if p.closed {
		// close has already swept p.conns; this one would be missed.
		p.mu.Unlock()
		c.close()
		return
	}
	p.conns[c] = struct{}{}
	p.mu.Unlock()

	done := make(chan struct{})
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		defer close(done)
		p.pump(c, c.client, c.server, false)
	}()
	p.pump(c, c.server, c.client, true)
	<-done

	p.mu.Lock()
	delete(p.conns, c)
	p.mu.Unlock()
}

// pump copies src to dst until either fails, then closes the pair so the
// other direction ends too. reply marks the target-to-client direction,
// the only one DropReplies acts on.
func (p *Proxy) pump(c *proxyConn, src, dst net.Conn, reply bool) {
	defer c.close()
	buf := make([]byte, proxyBufSize)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			switch p.verdict(c, reply, buf[:n]) {
			case forward:
				if _, werr := dst.Write(buf[:n]); werr != nil {
					return
				}
			case swallow:
			case drop:
				return
			}
		}
		if err != nil {
			// EOF, a reset or our own close: the deferred close ends the
			// other direction too, as a real connection would end.
			return
		}
	}
}

type verdict int

const (
	forward verdict = iota
	swallow         // blackhole: discard, keep the connection
	drop            // DropReplies: discard and close the connection
)

// verdict decides, under the lock so that switches apply to the very next
// chunk, what happens to a chunk just read.
func (p *Proxy) verdict(c *proxyConn, reply bool, chunk []byte) verdict {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !reply {
		lower := bytes.ToLower(chunk)
		if !c.subscriber && bytes.Contains(lower, []byte("subscribe")) {
			c.subscriber = true
		}
		if !c.ready && !bytes.Contains(lower, []byte("hello")) && !bytes.Contains(lower, []byte("setinfo")) {
			c.ready = true
		}
	}
	if c.frozen {
		return swallow
	}
	if p.blackhole {
		c.tainted = true
		return swallow
	}
	if reply && p.dropLeft > 0 && c.ready {
		p.dropLeft--
		p.dropped++
		return drop
	}
	return forward
}
