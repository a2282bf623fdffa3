package agent

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sync"
	"time"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// Client is the host's side of a connection to an agent. The connection
// may outlive its transport: a VM saved to a file and resumed by a new
// VMM keeps its agent's state, and the Client, suspended while the VM is
// saved, goes on over the new VMM's socket (Suspend, Attach), its calls
// (running commands) with it.
type Client struct {
	wmu sync.Mutex
	c   io.ReadWriteCloser // the transport; replaced by Attach
	enc *json.Encoder

	mu    sync.Mutex
	calls map[uint64]*call
	next  uint64
	err   error // set once the connection is gone
	done  chan struct{}
	once  sync.Once
	// suspended: the transport is going (Suspend): its end fails
	// nothing, and sends wait for resumed (closed by Attach).
	suspended bool
	closed    bool
	resumed   chan struct{}
	// readerDone is closed when the current transport's reader ended;
	// cur is the transport (as c, for Close, which must not wait for a
	// write); tail is what a transport that went carried of a line it
	// did not end (the next transport carries the rest).
	readerDone chan struct{}
	cur        io.Closer
	tail       []byte

	// window says the agent keeps flow control (FeatureWindow); then
	// acks of written data are sent by one goroutine, coalesced. acked
	// holds each request's total, dirty those not sent since it grew.
	window bool
	// private says the agent runs private commands (FeaturePrivate).
	private bool
	ackMu   sync.Mutex
	acked   map[uint64]int64
	dirty   map[uint64]bool
	ackWake chan struct{}
}

// Window is the data (stdout, stderr, file data) the host takes for one
// request before the agent waits for it to be written out.
const Window = 1 << 20

// call is what waits for the answers to one request.
type call struct {
	reply          chan Msg // ok, error, started, or exit before a start
	exit           chan int // an exec's: its code, once
	exited         chan struct{}
	once           sync.Once
	stdout, stderr io.Writer
	// onExit, if set, is given the "exit" (a file operation's answer),
	// after the data before it.
	onExit func(Msg)
	// started: the agent answered "started" (or sent data): a request
	// under way, which a forget leaves in calls until its exit.
	started bool
	// dq, for a call with output, queues its data and exit for a
	// goroutine of its own that writes them out in order (deliver): a
	// slow writer holds up its own call, not the connection's reader.
	dq *delivery
}

// delivery is a call's queue of "stdout", "stderr" and "exit" messages.
type delivery struct {
	// delivered is closed when the deliverer is done: the call's writers
	// are written no more.
	delivered chan struct{}
	mu        sync.Mutex
	q         []Msg
	bytes     int64
	quit      bool          // the call was forgotten: no more waiting
	wake      chan struct{} // something queued, or quit
	room      chan struct{} // something taken off
}

// stop ends the deliverer once what is queued is dropped.
func (d *delivery) stop() {
	d.mu.Lock()
	d.quit = true
	d.mu.Unlock()
	notify(d.wake)
	notify(d.room)
}

// settleTime bounds how long a call that ends with its connection waits
// for a write to its writers under way (one that never returns, to a
// consumer that does not read, must not keep it).
const settleTime = 5 * time.Second

// settle waits until the deliverer writes no more (after the connection
// ended it writes nothing new), or settleTime.
func (d *delivery) settle() {
	select {
	case <-d.delivered:
	case <-time.After(settleTime):
	}
}

func newDelivery() *delivery {
	return &delivery{wake: make(chan struct{}, 1), room: make(chan struct{}, 1), delivered: make(chan struct{})}
}

func notify(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

// finish delivers an exec's exit code (the first one given).
func (cl *call) finish(code int) {
	cl.once.Do(func() {
		cl.exit <- code
		close(cl.exited)
	})
}

// MaxLine bounds a line from the agent: a guest (root inside it is not
// trusted) cannot make the host buffer more. A stdout chunk of ChunkSize
// is about 44 KiB of JSON.
const MaxLine = 1 << 20

var errLineTooLong = errors.New("a line from the agent is longer than 1 MiB")

// readLine reads one line of at most MaxLine bytes.
func readLine(r *bufio.Reader) ([]byte, error) {
	var line []byte
	for {
		frag, err := r.ReadSlice('\n')
		if len(line)+len(frag) > MaxLine {
			return nil, errLineTooLong
		}
		line = append(line, frag...)
		if err != bufio.ErrBufferFull {
			return line, err
		}
	}
}

// writeTimeout bounds a write to the agent: a guest that stops reading
// its port ends its connection instead of holding up the host.
const writeTimeout = 30 * time.Second

// ErrNoPrivate is a private run asked of an agent that does not offer
// them (a VM started by an older edge): it would run it as an ordinary
// command.
var ErrNoPrivate = errors.New("this VM's agent does not offer private runs (the VM was started by an older dsec: recreate it)")

// ErrGone is returned for calls on a connection that broke.
var ErrGone = errors.New("the agent's connection is gone")

// helloID is the id of the ping Connect sends.
const helloID = 1

// Connect waits for the agent to answer on conn, then serves calls on it.
// The agent says "ready" on a connection it sees as new; a host that
// reconnects at once may find the agent still serving what it takes for
// the old one, so Connect also pings, and either answer will do (what a
// previous connection left in flight is skipped). ctx bounds the wait; on
// error conn is closed.
func Connect(ctx context.Context, conn io.ReadWriteCloser) (*Client, error) {
	r := bufio.NewReaderSize(conn, 256<<10)
	ready := make(chan error, 1)
	var feats []string
	// (Written apart from the reading: the agent may write first. Calls
	// write after it.)
	hello := make(chan struct{})
	go func() {
		defer close(hello)
		// Bounded: a guest that reads nothing holds up no one.
		if dl, ok := conn.(interface{ SetWriteDeadline(time.Time) error }); ok {
			_ = dl.SetWriteDeadline(time.Now().Add(writeTimeout))
		}
		_ = json.NewEncoder(conn).Encode(Msg{ID: helloID, Op: "ping"})
	}()
	go func() {
		for {
			line, err := readLine(r)
			if err != nil {
				ready <- fmt.Errorf("reading from the agent: %w", err)
				return
			}
			var m Msg
			if json.Unmarshal(line, &m) == nil && (m.Op == "ready" || m.Op == "ok" && m.ID == helloID) {
				feats = m.Features
				ready <- nil
				return
			}
		}
	}()
	select {
	case err := <-ready:
		if err != nil {
			conn.Close()
			<-hello
			return nil, err
		}
	case <-ctx.Done():
		conn.Close()
		<-ready
		<-hello
		return nil, ctx.Err()
	}
	<-hello
	c := &Client{c: conn, enc: json.NewEncoder(conn), calls: map[uint64]*call{}, done: make(chan struct{}),
		// Ids differ from those of an earlier connection, whose late
		// answers are then ignored.
		next:  uint64(time.Now().UnixNano()),
		acked: map[uint64]int64{}, dirty: map[uint64]bool{}, ackWake: make(chan struct{}, 1),
		resumed: make(chan struct{}), readerDone: make(chan struct{}), cur: conn}
	close(c.resumed)
	for _, f := range feats {
		c.window = c.window || f == FeatureWindow
		c.private = c.private || f == FeaturePrivate
	}
	go c.read(r, conn, c.readerDone, false)
	if c.window {
		go c.acker()
	}
	return c, nil
}

// ack credits request id with n bytes written out (or dropped).
func (c *Client) ack(id uint64, n int) {
	if !c.window || n == 0 {
		return
	}
	c.mu.Lock()
	live := c.calls[id] != nil
	c.mu.Unlock()
	if !live {
		return // the request ended: no window to credit
	}
	c.ackMu.Lock()
	c.acked[id] += int64(n)
	c.dirty[id] = true
	c.ackMu.Unlock()
	notify(c.ackWake)
}

// ackDone forgets request id's total once the agent ended the request.
func (c *Client) ackDone(id uint64) {
	c.ackMu.Lock()
	delete(c.acked, id)
	delete(c.dirty, id)
	c.ackMu.Unlock()
}

// acker sends the acks, those that piled up while it wrote merged.
func (c *Client) acker() {
	for {
		select {
		case <-c.ackWake:
		case <-c.done:
			return
		}
		c.ackMu.Lock()
		var acks []Msg
		for id := range c.dirty {
			acks = append(acks, Msg{ID: id, Op: "ack", Acked: c.acked[id]})
		}
		c.dirty = map[uint64]bool{}
		c.ackMu.Unlock()
		for _, m := range acks {
			// A failure (a transport that went) is made good: Attach
			// sends the totals again.
			_ = c.send(context.Background(), m)
		}
	}
}

// enqueue queues m for cl's deliverer. An agent that keeps the window
// never has more than it queued; one that overruns it by far is broken
// or hostile, and its connection is closed. Without the window (an
// older agent) the reader waits for room, as it used to wait for the
// writer.
func (c *Client) enqueue(cl *call, m Msg) bool {
	d := cl.dq
	limit := int64(2*Window + 2*ChunkSize)
	for {
		d.mu.Lock()
		if d.quit || d.bytes+int64(len(m.Data)) <= limit || len(d.q) == 0 {
			if d.quit {
				d.mu.Unlock()
				if m.Op == "exit" {
					c.ackDone(m.ID)
				} else {
					c.ack(m.ID, len(m.Data)) // given up on: dropped
				}
				return true
			}
			d.q = append(d.q, m)
			d.bytes += int64(len(m.Data))
			d.mu.Unlock()
			notify(d.wake)
			return true
		}
		d.mu.Unlock()
		if c.window {
			return false
		}
		<-d.room
	}
}

// deliver writes cl's queued messages out in order until its exit (or
// the connection's end, or the call is forgotten), acking the data.
func (c *Client) deliver(id uint64, cl *call) {
	d := cl.dq
	defer close(d.delivered)
	for {
		d.mu.Lock()
		var m Msg
		have := len(d.q) > 0
		if have {
			m = d.q[0]
			d.q[0] = Msg{}
			d.q = d.q[1:]
			d.bytes -= int64(len(m.Data))
		}
		quit := d.quit
		d.mu.Unlock()
		if !have {
			if quit {
				return
			}
			select {
			case <-d.wake:
				continue
			case <-c.done:
				return
			}
		}
		notify(d.room)
		select {
		case <-c.done:
			// The caller has stopped waiting (ErrGone): nothing more
			// is written, and no exit is reported after data dropped.
			return
		default:
		}
		switch m.Op {
		case "stdout", "stderr":
			w := cl.stdout
			if m.Op == "stderr" {
				w = cl.stderr
			}
			if w != nil && !quit {
				_, _ = w.Write(m.Data)
			}
			c.ack(id, len(m.Data))
		case "exit":
			c.exited(cl, m)
			c.ackDone(id)
			return
		}
	}
}

// exited hands an exit to its call.
func (c *Client) exited(cl *call, m Msg) {
	if cl.onExit != nil {
		cl.onExit(m)
		return
	}
	select {
	case cl.reply <- m:
	default:
	}
	if cl.exit != nil {
		cl.finish(m.Code)
	}
}

// read serves the transport conn (its reader r) until it ends, then
// closes done; attached says it replaced an earlier transport, on which
// the agent must not begin anew.
func (c *Client) read(r *bufio.Reader, conn io.Closer, done chan struct{}, attached bool) {
	defer close(done)
	var err error
	var partial []byte
	fatal := false // the agent broke the protocol
	for {
		if err != nil {
			break // the agent broke the protocol
		}
		var line []byte
		line, err = readLine(r)
		if err != nil {
			if err == io.EOF {
				partial = line // the rest may come on the next transport
			}
			fatal = fatal || errors.Is(err, errLineTooLong)
			break
		}
		var m Msg
		if json.Unmarshal(line, &m) != nil {
			continue
		}
		if m.Op == "ready" && attached {
			// The agent took the new transport for a new connection,
			// and has killed what the old one started.
			err, fatal = errors.New("the agent began a new connection on a resumed one"), true
			break
		}
		c.mu.Lock()
		cl := c.calls[m.ID]
		// The last answer to a request: its exit, or a refusal (no exit
		// follows an "error"), or the "ok" of a request without one.
		final := m.Op == "exit" || m.Op == "error" || m.Op == "ok" && cl != nil && cl.exit == nil && cl.onExit == nil
		if cl != nil && final {
			delete(c.calls, m.ID)
		}
		if cl != nil && m.Op != "ok" && m.Op != "error" {
			cl.started = true
		}
		c.mu.Unlock()
		if cl == nil {
			// Not a request of the host's (or one that ended): dropped.
			// (A request the host gave up on stays in calls until its
			// exit, its data acked: see forget.)
			continue
		}
		if m.Op == "error" && cl.dq != nil {
			cl.dq.stop() // nothing more comes for it
			if cl.onExit != nil {
				cl.onExit(m) // a file operation's answer
				continue
			}
		}
		switch m.Op {
		case "stdout", "stderr", "exit":
			if cl.dq != nil {
				if !c.enqueue(cl, m) {
					err, fatal = fmt.Errorf("the agent sent request %d more data than its window", m.ID), true
				}
				break
			}
			w := cl.stdout
			if m.Op == "stderr" {
				w = cl.stderr
			}
			if m.Op == "exit" {
				c.exited(cl, m)
			} else if w != nil {
				_, _ = w.Write(m.Data)
			}
		default: // ok, error, started
			select {
			case cl.reply <- m:
			default:
			}
		}
	}
	conn.Close()
	c.mu.Lock()
	quiet := c.suspended && !c.closed && !fatal
	if quiet {
		c.tail = append([]byte(nil), partial...)
	}
	c.mu.Unlock()
	if quiet {
		return // a transport that was going: the calls wait for the next
	}
	c.shutdown(err)
}

// shutdown ends the connection: every call fails with ErrGone.
func (c *Client) shutdown(why error) {
	c.once.Do(func() {
		c.mu.Lock()
		c.err = fmt.Errorf("%w: %v", ErrGone, why)
		c.calls = map[uint64]*call{}
		c.mu.Unlock()
		close(c.done)
	})
}

// Suspend says the transport is about to go (its VM saved, its VMM
// ended): its end fails no call, and sends wait until Attach gives a new
// one (or Close).
func (c *Client) Suspend() {
	c.mu.Lock()
	if !c.suspended {
		c.suspended = true
		c.resumed = make(chan struct{})
	}
	c.mu.Unlock()
	// A write under way finishes first (the guest still runs and reads
	// it), then a ping's answer says the agent has read all before it:
	// nothing sent is left in the socket when the VM stops. Bounded: a
	// guest that reads nothing does not hold up its own pause.
	ctx, cancel := context.WithTimeout(context.Background(), suspendBarrier)
	defer cancel()
	for !c.wmu.TryLock() {
		select {
		case <-ctx.Done():
			return
		case <-time.After(5 * time.Millisecond):
		}
	}
	c.wmu.Unlock()
	cl := &call{reply: make(chan Msg, 1)}
	m := Msg{Op: "ping"}
	if c.register(&m, cl) != nil {
		return
	}
	defer c.forget(m.ID)
	if c.writeNow(m, suspendBarrier) != nil {
		return
	}
	select {
	case <-cl.reply:
	case <-ctx.Done():
	case <-c.done:
	}
}

// suspendBarrier bounds Suspend's wait for the agent to read what was
// sent.
const suspendBarrier = 2 * time.Second

// writeNow writes m on the transport, even while suspended, within d.
func (c *Client) writeNow(m Msg, d time.Duration) error {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if dl, ok := c.c.(interface{ SetWriteDeadline(time.Time) error }); ok {
		_ = dl.SetWriteDeadline(time.Now().Add(d))
	}
	return c.enc.Encode(m)
}

func (c *Client) isSuspended() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.suspended
}

// Unsuspend undoes Suspend while the transport still serves (a save that
// failed, its VM running on).
func (c *Client) Unsuspend() {
	c.mu.Lock()
	if c.suspended {
		c.suspended = false
		close(c.resumed)
	}
	rd := c.readerDone
	c.mu.Unlock()
	select {
	case <-rd: // the transport went meanwhile, its end taken as planned
		c.shutdown(errors.New("the transport ended while suspended"))
	default:
	}
}

// Attach goes on over conn, the socket of the VMM that resumed the
// agent's VM, once what the old transport carried is read: the agent
// sees no new connection, and its commands and their streams go on. The
// totals of the acks are sent again, as one may have been lost with the
// old transport.
func (c *Client) Attach(ctx context.Context, conn io.ReadWriteCloser) error {
	c.mu.Lock()
	if c.err != nil || c.closed {
		c.mu.Unlock()
		conn.Close()
		return ErrGone
	}
	old := c.readerDone
	c.mu.Unlock()
	select {
	case <-old:
	case <-ctx.Done():
		conn.Close()
		return ctx.Err()
	}
	c.wmu.Lock()
	c.c, c.enc = conn, json.NewEncoder(conn)
	c.wmu.Unlock()
	rd := make(chan struct{})
	c.mu.Lock()
	if c.err != nil || c.closed {
		c.mu.Unlock()
		conn.Close()
		return ErrGone
	}
	c.readerDone, c.cur = rd, conn
	tail := c.tail
	c.tail = nil
	if c.suspended {
		c.suspended = false
		close(c.resumed)
	}
	c.mu.Unlock()
	go c.read(bufio.NewReaderSize(io.MultiReader(bytes.NewReader(tail), conn), 256<<10), conn, rd, true)
	c.ackMu.Lock()
	for id := range c.acked {
		c.dirty[id] = true
	}
	c.ackMu.Unlock()
	notify(c.ackWake)
	return nil
}

// send writes m, within writeTimeout where the connection has deadlines.
// A failed write may have left part of a line: the connection is closed.
func (c *Client) send(ctx context.Context, m Msg) error {
	for {
		c.mu.Lock()
		err, resumed := c.err, c.resumed
		c.mu.Unlock()
		if err != nil {
			return err
		}
		select {
		case <-resumed:
		default:
			select { // suspended: wait for the next transport
			case <-resumed:
				continue
			case <-c.done:
				return c.gone()
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		break
	}
	c.wmu.Lock()
	defer c.wmu.Unlock()
	dl, hasDeadline := c.c.(interface{ SetWriteDeadline(time.Time) error })
	if hasDeadline {
		_ = dl.SetWriteDeadline(time.Now().Add(writeTimeout))
	}
	if err := c.enc.Encode(m); err != nil {
		c.c.Close()
		return fmt.Errorf("%w: writing: %v", ErrGone, err)
	}
	return nil
}

// register gives m a fresh id and a call to wait on.
func (c *Client) register(m *Msg, cl *call) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err != nil {
		return c.err
	}
	c.next++
	m.ID = c.next
	c.calls[m.ID] = cl
	if cl.stdout != nil || cl.stderr != nil || cl.onExit != nil || cl.exit != nil {
		cl.dq = newDelivery()
		if c.window {
			m.Window = Window
		}
		go c.deliver(m.ID, cl)
	}
	return nil
}

// forget drops call id: what comes for it is dropped (and acked), and its
// deliverer, once what is queued is acked, ends.
func (c *Client) forget(id uint64) {
	c.mu.Lock()
	cl := c.calls[id]
	if cl == nil || cl.dq == nil || !cl.started {
		delete(c.calls, id)
	}
	// A request under way with a stream stays until its exit, so that
	// what the agent still sends for it is acked (and its window does
	// not stall the agent), while data for ids the host never issued (or
	// that ended) is dropped.
	c.mu.Unlock()
	if cl != nil && cl.dq != nil {
		cl.dq.stop()
	}
}

func (c *Client) gone() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

// Call sends a request that is answered ok or error (setup, signal,
// ping) and waits for the answer.
func (c *Client) Call(ctx context.Context, m Msg) error {
	cl := &call{reply: make(chan Msg, 1)}
	if err := c.register(&m, cl); err != nil {
		return err
	}
	defer c.forget(m.ID)
	if err := c.send(ctx, m); err != nil {
		return err
	}
	select {
	case r := <-cl.reply:
		return replyErr(r)
	case <-c.done:
		return c.gone()
	case <-ctx.Done():
		return ctx.Err()
	}
}

func replyErr(r Msg) error {
	switch {
	case r.Op == "ok":
		return nil
	case r.Op == "error" && r.Kind == "invalid":
		return errdefs.Invalid("%s", r.Error)
	case r.Op == "error":
		return fmt.Errorf("the agent: %s", r.Error)
	}
	return fmt.Errorf("the agent answered %q", r.Op)
}

// Process is a command the agent runs.
type Process struct {
	c    *Client
	id   uint64
	pid  int
	cl   *call
	mu   sync.Mutex
	code int
	done bool
}

// Exec starts a command (m.Op "exec"): stdin is sent to it (nil: closed at
// once; an io.Closer is closed once the command exits), and its output
// written to stdout and stderr as it comes, by a goroutine of the call's
// own: with an agent that keeps the window, a slow writer holds up this
// command alone (its output waits in the guest). It returns once the command started (or could not: then Wait gives 127 or
// 126 and stderr says why).
func (c *Client) Exec(ctx context.Context, m Msg, stdin io.Reader, stdout, stderr io.Writer) (*Process, error) {
	m.Op = "exec"
	if m.Private && !c.private {
		return nil, ErrNoPrivate
	}
	cl := &call{reply: make(chan Msg, 1), exit: make(chan int, 1), exited: make(chan struct{}), stdout: stdout, stderr: stderr}
	if err := c.register(&m, cl); err != nil {
		return nil, err
	}
	closeStdin := func() {
		if sc, ok := stdin.(io.Closer); ok {
			sc.Close()
		}
	}
	if err := c.send(ctx, m); err != nil {
		c.forget(m.ID)
		return nil, err
	}
	p := &Process{c: c, id: m.ID, cl: cl}
	select {
	case r := <-cl.reply:
		switch r.Op {
		case "started":
			p.pid = r.Pid
		case "exit":
			p.done, p.code = true, r.Code
			closeStdin()
			return p, nil
		case "error":
			c.forget(m.ID)
			return nil, replyErr(r)
		default:
			c.forget(m.ID)
			go c.send(context.Background(), Msg{Op: "kill", Of: m.ID})
			return nil, fmt.Errorf("%w: the agent answered %q to an exec", ErrGone, r.Op)
		}
	case <-c.done:
		return nil, c.gone()
	case <-ctx.Done():
		// It may start all the same: it is killed.
		c.forget(m.ID)
		go c.send(context.Background(), Msg{Op: "kill", Of: m.ID})
		cl.dq.settle() // nothing is written to stdout or stderr after
		return nil, ctx.Err()
	}
	if stdin != nil {
		if _, ok := stdin.(io.Closer); ok {
			// Ends a pump blocked reading once the process is gone.
			go func() {
				select {
				case <-cl.exited:
				case <-c.done:
				}
				closeStdin()
			}()
		}
	}
	go c.pump(m.ID, stdin)
	return p, nil
}

// pump sends in (nil: nothing) as request id's stdin, then its end:
// stdin_close at EOF, stdin_abort when in fails (an upload cut short must
// not land as a shorter file).
func (c *Client) pump(id uint64, in io.Reader) {
	end := "stdin_close"
	if in != nil {
		buf := make([]byte, ChunkSize)
		for {
			n, err := in.Read(buf)
			if n > 0 {
				if c.send(context.Background(), Msg{ID: id, Op: "stdin", Data: append([]byte(nil), buf[:n]...)}) != nil {
					return
				}
			}
			if err != nil {
				if err != io.EOF {
					end = "stdin_abort"
				}
				break
			}
		}
	}
	_ = c.send(context.Background(), Msg{ID: id, Op: end})
}

// Pid is the process's pid inside the guest (0 if it did not start).
func (p *Process) Pid() int { return p.pid }

// Wait waits for the process to exit and its output to be written, and
// returns its exit code (128+signal when killed).
func (p *Process) Wait() (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.done {
		return p.code, nil
	}
	select {
	case code := <-p.cl.exit:
		p.done, p.code = true, code
		return code, nil
	case <-p.c.done:
		// The exit may have come just before the connection went.
		select {
		case code := <-p.cl.exit:
			p.done, p.code = true, code
			return code, nil
		default:
		}
		if p.cl.dq != nil {
			p.cl.dq.settle()
		}
		return -1, p.c.gone()
	}
}

// killGrace is how long a killed process may take to be reported gone
// before Wait says so itself.
const killGrace = 10 * time.Second

// Kill kills the process and its descendants. Should the agent not report
// its exit within killGrace, Wait returns 137 all the same (a guest
// cannot keep a caller waiting on a process it was told to kill).
func (p *Process) Kill() error {
	if p.pid == 0 {
		return nil
	}
	select {
	case <-p.cl.exited:
		return nil
	default:
	}
	if p.c.isSuspended() {
		// Its VM is saved: the kill goes when it runs again (or not at
		// all if it is destroyed); the caller does not wait for that.
		go p.c.send(context.Background(), Msg{Op: "kill", Of: p.id})
		p.c.forget(p.id)
		p.cl.dq.settle()
		p.cl.finish(137)
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), killGrace)
	defer cancel()
	err := p.c.Call(ctx, Msg{Op: "kill", Of: p.id})
	go func() {
		select {
		case <-p.cl.exited:
		case <-p.c.done:
		case <-time.After(killGrace):
			p.c.forget(p.id)
			p.cl.finish(137)
		}
	}()
	if errors.Is(err, ErrGone) || errors.Is(err, context.DeadlineExceeded) {
		return nil // the guest is gone (its processes with it) or not answering
	}
	return err
}

// Resize sets the size of the process's terminal.
func (p *Process) Resize(ctx context.Context, rows, cols uint16) error {
	return p.c.Call(ctx, Msg{Op: "resize", Of: p.id, Rows: rows, Cols: cols})
}

// Close ends the connection: every call fails with ErrGone.
func (c *Client) Close() error {
	c.mu.Lock()
	c.closed = true
	cur := c.cur
	c.mu.Unlock()
	err := cur.Close() // not under wmu: a write the guest does not read ends with it
	c.shutdown(errors.New("closed"))
	return err
}

// Err is why the connection is gone (nil while it serves).
func (c *Client) Err() error { return c.gone() }

// Done is closed when the connection is gone.
func (c *Client) Done() <-chan struct{} { return c.done }
