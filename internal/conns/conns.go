// Package conns bounds what network peers can hold of a daemon: how many
// connections it keeps open, how many of those have not carried an
// authenticated request, and how long one write may wait for a peer that
// does not read. cmd/dsec wraps the listener of each daemon's HTTP server
// in a Listener and builds the server with Listener.Server; the apiserver
// calls Trust once a request on a connection has authenticated, and the
// edge's mutual-TLS API trusts every request that reaches it (Trusting).
// It imports only the standard library.
//
// Without it, 20,000 idle connections that never authenticated took the
// daemon's descriptors, and every exec on the node failed. The design:
//
//   - At most Max connections are open. A connection is untrusted from
//     its accept until a request on it authenticates; then it is trusted
//     until it closes.
//   - At most MaxUntrusted of them are untrusted. A new connection that
//     would pass that, or Max, closes the oldest untrusted one instead of
//     waiting: an attacker's connections push out each other, never an
//     authenticated one, and a new client's connection is the last to go,
//     time enough for its first request. The rest (Max - MaxUntrusted) is
//     kept for authenticated ones.
//   - When all Max are trusted, Accept waits until one closes, as
//     x/net/netutil.LimitListener does (new connections wait in the
//     kernel's backlog).
//   - Every write on a connection gets WriteStall to finish a chunk of at
//     most maxStallChunk bytes (a peer that stops reading is cut off, a
//     slow one is not), which holds for streamed responses and hijacked
//     connections (ports, WebSocket) too, where a whole-response
//     http.Server.WriteTimeout would cut legitimate long streams.
//   - The server's ReadHeaderTimeout bounds a request's headers and
//     IdleTimeout a kept-alive connection between requests. There is no
//     ReadTimeout: uploads (layers, tars) last as long as they last.
package conns

import (
	"container/list"
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// Defaults of a daemon's HTTP server.
const (
	// DefaultReadHeaderTimeout bounds the headers of a request.
	DefaultReadHeaderTimeout = 10 * time.Second
	// DefaultIdleTimeout bounds a kept-alive connection between requests:
	// longer than the clients' own idle timeouts (the Go SDK and the
	// apiserver's edge transport keep 90 s, the Python SDK 30 s), so a
	// client is the one to close an idle connection and never sends on
	// one the server is closing.
	DefaultIdleTimeout = 120 * time.Second
	// DefaultWriteStall bounds one chunk of a write.
	DefaultWriteStall = 60 * time.Second
)

// maxStallChunk is the most bytes one write may need WriteStall for: a
// larger write is split, each part with its own deadline, so a slow peer
// that keeps reading (at least 4 KiB/s) is never cut off.
const maxStallChunk = 256 << 10

// Config bounds a Listener's connections.
type Config struct {
	// Max bounds the connections open at once (0: DefaultMax(1024)).
	Max int
	// MaxUntrusted bounds those that have not carried an authenticated
	// request (0: Max/2). At most Max.
	MaxUntrusted int
	// WriteStall bounds one chunk of a write (0: none).
	WriteStall time.Duration
	// ReadHeaderTimeout and IdleTimeout are the server's (Server).
	ReadHeaderTimeout, IdleTimeout time.Duration
}

// DefaultMax is the default connection limit of a daemon that may hold
// nofile descriptors: a quarter of them (the rest are for sandboxes,
// sessions and commands), at least 64 and at most 16,384 (each costs the
// daemon some 20-60 KiB of memory too).
func DefaultMax(nofile uint64) int { return int(min(max(nofile/4, 64), 16384)) }

// Listener is a net.Listener that bounds its connections (package doc).
type Listener struct {
	inner net.Listener
	cfg   Config

	mu   sync.Mutex
	cond *sync.Cond
	// open counts the connections accepted and not yet closed.
	open int
	// untrusted holds the untrusted connections, oldest first.
	untrusted list.List
	closed    bool

	evicted atomic.Uint64
}

// Listen wraps inner.
func Listen(inner net.Listener, cfg Config) *Listener {
	if cfg.Max <= 0 {
		cfg.Max = DefaultMax(1024)
	}
	if cfg.MaxUntrusted <= 0 || cfg.MaxUntrusted > cfg.Max {
		cfg.MaxUntrusted = max(cfg.Max/2, 1)
	}
	l := &Listener{inner: inner, cfg: cfg}
	l.cond = sync.NewCond(&l.mu)
	return l
}

// Server returns an HTTP server for h with the listener's timeouts, whose
// requests can be marked trusted (Trust). Serve it on l (or on a TLS
// listener over l).
func (l *Listener) Server(h http.Handler) *http.Server {
	return &http.Server{
		Handler:           h,
		ReadHeaderTimeout: l.cfg.ReadHeaderTimeout,
		IdleTimeout:       l.cfg.IdleTimeout,
		ConnContext:       connContext,
	}
}

// Accept waits for a connection and admits it as untrusted, closing the
// oldest untrusted connection when the untrusted ones or all of them are
// at their bound.
func (l *Listener) Accept() (net.Conn, error) {
	for {
		l.mu.Lock()
		for l.open >= l.cfg.Max && l.untrusted.Len() == 0 && !l.closed {
			l.cond.Wait()
		}
		closed := l.closed
		l.mu.Unlock()
		if closed {
			return nil, net.ErrClosed
		}
		c, err := l.inner.Accept()
		if err != nil {
			return nil, err
		}
		if tc := l.admit(c); tc != nil {
			return tc, nil
		}
		// Every connection became trusted while this one was accepted.
		_ = c.Close()
	}
}

// admit counts c in, and closes the connection it displaces.
func (l *Listener) admit(c net.Conn) *Conn {
	l.mu.Lock()
	var victim *Conn
	if l.open >= l.cfg.Max || l.untrusted.Len() >= l.cfg.MaxUntrusted {
		front := l.untrusted.Front()
		if front == nil {
			l.mu.Unlock()
			return nil
		}
		victim = front.Value.(*Conn)
		l.dropLocked(victim)
	}
	tc := &Conn{Conn: c, l: l, stall: l.cfg.WriteStall}
	tc.elem = l.untrusted.PushBack(tc)
	l.open++
	l.mu.Unlock()
	if victim != nil {
		l.evicted.Add(1)
		_ = victim.Conn.Close()
	}
	return tc
}

// dropLocked stops counting c. Preconditions: l.mu held.
func (l *Listener) dropLocked(c *Conn) {
	if c.dropped {
		return
	}
	c.dropped = true
	if c.elem != nil {
		l.untrusted.Remove(c.elem)
		c.elem = nil
	}
	l.open--
	l.cond.Signal()
}

// Close closes the listener; connections already accepted stay open.
func (l *Listener) Close() error {
	l.mu.Lock()
	l.closed = true
	l.cond.Broadcast()
	l.mu.Unlock()
	return l.inner.Close()
}

// Addr is the inner listener's address.
func (l *Listener) Addr() net.Addr { return l.inner.Addr() }

// Stats reports the connections open now, how many of them are
// untrusted, and how many untrusted ones were closed to make room since
// the listener started.
func (l *Listener) Stats() (open, untrusted int, evicted uint64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.open, l.untrusted.Len(), l.evicted.Load()
}

// Conn is a connection a Listener accepted.
type Conn struct {
	net.Conn
	l     *Listener
	stall time.Duration
	// elem is c's place in l.untrusted (nil once trusted or dropped);
	// dropped is set once c no longer counts. Both guarded by l.mu.
	elem    *list.Element
	dropped bool

	// wdl is the write deadline the connection's user asked for (zero:
	// none); each write's own stall deadline never goes past it.
	wmu sync.Mutex
	wdl time.Time
}

// trust moves c out of the untrusted pool.
func (c *Conn) trust() {
	c.l.mu.Lock()
	if c.elem != nil {
		c.l.untrusted.Remove(c.elem)
		c.elem = nil
	}
	c.l.mu.Unlock()
}

// Close closes the connection and stops counting it.
func (c *Conn) Close() error {
	err := c.Conn.Close()
	c.l.mu.Lock()
	c.l.dropLocked(c)
	c.l.mu.Unlock()
	return err
}

// Write writes p in chunks of at most maxStallChunk, each with WriteStall
// to finish.
func (c *Conn) Write(p []byte) (int, error) {
	if c.stall <= 0 || len(p) == 0 {
		return c.Conn.Write(p)
	}
	n := 0
	for n < len(p) {
		if err := c.Conn.SetWriteDeadline(c.deadline()); err != nil {
			return n, err
		}
		m, err := c.Conn.Write(p[n:min(len(p), n+maxStallChunk)])
		n += m
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// ReadFrom keeps the inner connection's sendfile and splice (a file read
// is sent without a copy through user space), in chunks with their own
// deadlines as Write does.
func (c *Conn) ReadFrom(r io.Reader) (int64, error) {
	rf, ok := c.Conn.(io.ReaderFrom)
	if !ok || c.stall <= 0 {
		if ok {
			return rf.ReadFrom(r)
		}
		return io.Copy(writerOnly{c}, r)
	}
	var total int64
	for {
		if err := c.Conn.SetWriteDeadline(c.deadline()); err != nil {
			return total, err
		}
		n, err := rf.ReadFrom(&io.LimitedReader{R: r, N: maxStallChunk})
		total += n
		if err != nil || n < maxStallChunk {
			return total, err
		}
	}
}

type writerOnly struct{ io.Writer }

// deadline is the deadline of the next chunk of a write.
func (c *Conn) deadline() time.Time {
	d := time.Now().Add(c.stall)
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if !c.wdl.IsZero() && c.wdl.Before(d) {
		return c.wdl
	}
	return d
}

// SetDeadline sets the read and write deadlines.
func (c *Conn) SetDeadline(t time.Time) error {
	c.wmu.Lock()
	c.wdl = t
	c.wmu.Unlock()
	return c.Conn.SetDeadline(t)
}

// SetWriteDeadline sets the write deadline; each chunk of a write still
// gets at most WriteStall.
func (c *Conn) SetWriteDeadline(t time.Time) error {
	c.wmu.Lock()
	c.wdl = t
	c.wmu.Unlock()
	return c.Conn.SetWriteDeadline(t)
}

// CloseWrite shuts down the writing side, where the inner connection can
// (a port connection's splice half-closes).
func (c *Conn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return errors.ErrUnsupported
}

type connKey struct{}

// connContext puts the request's *Conn in its context (http.Server's
// ConnContext), under TLS too.
func connContext(ctx context.Context, c net.Conn) context.Context {
	for {
		switch v := c.(type) {
		case *Conn:
			return context.WithValue(ctx, connKey{}, v)
		case *tls.Conn:
			c = v.NetConn()
		default:
			return ctx
		}
	}
}

// Trust marks the connection carrying the request of ctx as trusted: a
// request on it has authenticated. It is no longer closed to make room,
// and counts against Max only. A context of no Listener's connection is
// ignored.
func Trust(ctx context.Context) {
	if c, ok := ctx.Value(connKey{}).(*Conn); ok {
		c.trust()
	}
}

// Trusting trusts every request that reaches h: for a server whose
// listener authenticates its peers (mutual TLS).
func Trusting(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		Trust(r.Context())
		h.ServeHTTP(w, r)
	})
}
