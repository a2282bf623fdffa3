package agent

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sync"
	"time"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// Client is the host's side of one connection to an agent.
type Client struct {
	c io.ReadWriteCloser

	wmu sync.Mutex
	enc *json.Encoder

	mu    sync.Mutex
	calls map[uint64]*call
	next  uint64
	err   error // set once the connection is gone
	done  chan struct{}
}

// call is what waits for the answers to one request.
type call struct {
	reply          chan Msg // ok, error, started, or exit before a start
	exit           chan int // an exec's: its code, once
	exited         chan struct{}
	once           sync.Once
	stdout, stderr io.Writer
	// onExit, if set, is given the "exit" (a file operation's answer),
	// from the connection's reader, after the data before it.
	onExit func(Msg)
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
		next: uint64(time.Now().UnixNano())}
	go c.read(r)
	return c, nil
}

func (c *Client) read(r *bufio.Reader) {
	var err error
	for {
		var line []byte
		line, err = readLine(r)
		if err != nil {
			break
		}
		var m Msg
		if json.Unmarshal(line, &m) != nil {
			continue
		}
		c.mu.Lock()
		cl := c.calls[m.ID]
		if m.Op == "exit" || (m.Op != "started" && m.Op != "stdout" && m.Op != "stderr" && cl != nil && cl.exit == nil) {
			delete(c.calls, m.ID)
		}
		c.mu.Unlock()
		if cl == nil {
			continue
		}
		switch m.Op {
		case "stdout":
			if cl.stdout != nil {
				_, _ = cl.stdout.Write(m.Data)
			}
		case "stderr":
			if cl.stderr != nil {
				_, _ = cl.stderr.Write(m.Data)
			}
		case "exit":
			if cl.onExit != nil {
				cl.onExit(m)
				break
			}
			select {
			case cl.reply <- m:
			default:
			}
			if cl.exit != nil {
				cl.finish(m.Code)
			}
		default: // ok, error, started
			select {
			case cl.reply <- m:
			default:
			}
		}
	}
	c.c.Close()
	c.mu.Lock()
	c.err = fmt.Errorf("%w: %v", ErrGone, err)
	c.calls = map[uint64]*call{}
	c.mu.Unlock()
	close(c.done)
}

// send writes m, within writeTimeout where the connection has deadlines.
// A failed write may have left part of a line: the connection is closed.
func (c *Client) send(m Msg) error {
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
	return nil
}

func (c *Client) forget(id uint64) {
	c.mu.Lock()
	delete(c.calls, id)
	c.mu.Unlock()
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
	if err := c.send(m); err != nil {
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
// once; an io.Closer is closed once the command exits), and its output written to stdout and stderr (as it comes, from
// the connection's reader: a slow writer holds up every stream). It
// returns once the command started (or could not: then Wait gives 127 or
// 126 and stderr says why).
func (c *Client) Exec(ctx context.Context, m Msg, stdin io.Reader, stdout, stderr io.Writer) (*Process, error) {
	m.Op = "exec"
	cl := &call{reply: make(chan Msg, 1), exit: make(chan int, 1), exited: make(chan struct{}), stdout: stdout, stderr: stderr}
	if err := c.register(&m, cl); err != nil {
		return nil, err
	}
	closeStdin := func() {
		if sc, ok := stdin.(io.Closer); ok {
			sc.Close()
		}
	}
	if err := c.send(m); err != nil {
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
			go c.send(Msg{Op: "kill", Of: m.ID})
			return nil, fmt.Errorf("%w: the agent answered %q to an exec", ErrGone, r.Op)
		}
	case <-c.done:
		return nil, c.gone()
	case <-ctx.Done():
		// It may start all the same: it is killed.
		c.forget(m.ID)
		go c.send(Msg{Op: "kill", Of: m.ID})
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
				if c.send(Msg{ID: id, Op: "stdin", Data: append([]byte(nil), buf[:n]...)}) != nil {
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
	_ = c.send(Msg{ID: id, Op: end})
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

// Close closes the connection.
func (c *Client) Close() error { return c.c.Close() }

// Done is closed when the connection is gone.
func (c *Client) Done() <-chan struct{} { return c.done }
