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
	exit           chan int
	exited         chan struct{} // closed on exit
	stdout, stderr io.Writer
}

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
		_ = json.NewEncoder(conn).Encode(Msg{ID: helloID, Op: "ping"})
	}()
	go func() {
		for {
			line, err := r.ReadBytes('\n')
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
		line, err = r.ReadBytes('\n')
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
			select {
			case cl.reply <- m:
			default:
			}
			if cl.exit != nil {
				cl.exit <- m.Code
			}
			if cl.exited != nil {
				close(cl.exited)
			}
		default: // ok, error, started
			select {
			case cl.reply <- m:
			default:
			}
		}
	}
	c.mu.Lock()
	c.err = fmt.Errorf("%w: %v", ErrGone, err)
	calls := c.calls
	c.calls = map[uint64]*call{}
	c.mu.Unlock()
	close(c.done)
	_ = calls
}

func (c *Client) send(m Msg) error {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if err := c.enc.Encode(m); err != nil {
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
	c      *Client
	id     uint64
	pid    int
	exit   chan int
	exited chan struct{}
	code   int
	done   bool
	mu     sync.Mutex
}

// Exec starts a command (m.Op "exec"): stdin is sent to it (nil: closed at
// once; an io.Closer is closed once the command exits), and its output written to stdout and stderr (as it comes, from
// the connection's reader: a slow writer holds up every stream). It
// returns once the command started (or could not: then Wait gives 127 or
// 126 and stderr says why).
func (c *Client) Exec(ctx context.Context, m Msg, stdin io.Reader, stdout, stderr io.Writer) (*Process, error) {
	m.Op = "exec"
	cl := &call{reply: make(chan Msg, 1), exit: make(chan int, 1), stdout: stdout, stderr: stderr}
	if err := c.register(&m, cl); err != nil {
		return nil, err
	}
	if err := c.send(m); err != nil {
		c.forget(m.ID)
		return nil, err
	}
	p := &Process{c: c, id: m.ID, exit: cl.exit, exited: make(chan struct{})}
	cl.exited = p.exited
	select {
	case r := <-cl.reply:
		switch r.Op {
		case "started":
			p.pid = r.Pid
		case "exit":
			p.done, p.code = true, r.Code
			if cl, ok := stdin.(io.Closer); ok {
				cl.Close()
			}
			return p, nil
		default:
			c.forget(m.ID)
			return nil, replyErr(r)
		}
	case <-c.done:
		return nil, c.gone()
	case <-ctx.Done():
		c.forget(m.ID)
		return nil, ctx.Err()
	}
	if cl, ok := stdin.(io.Closer); ok {
		// Ends a pump blocked reading once the process is gone.
		go func() {
			select {
			case <-p.exited:
			case <-c.done:
			}
			cl.Close()
		}()
	}
	go func() {
		if stdin != nil {
			buf := make([]byte, ChunkSize)
			for {
				n, err := stdin.Read(buf)
				if n > 0 {
					if c.send(Msg{ID: m.ID, Op: "stdin", Data: append([]byte(nil), buf[:n]...)}) != nil {
						return
					}
				}
				if err != nil {
					break
				}
			}
		}
		_ = c.send(Msg{ID: m.ID, Op: "stdin_close"})
	}()
	return p, nil
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
	case code := <-p.exit:
		p.done, p.code = true, code
		return code, nil
	case <-p.c.done:
		// The exit may have come just before the connection went.
		select {
		case code := <-p.exit:
			p.done, p.code = true, code
			return code, nil
		default:
		}
		return -1, p.c.gone()
	}
}

// Kill kills the process and its descendants.
func (p *Process) Kill() error {
	if p.pid == 0 {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := p.c.Call(ctx, Msg{Op: "kill", Of: p.id})
	if errors.Is(err, ErrGone) {
		return nil // the guest is gone, and its processes with it
	}
	return err
}

// Close closes the connection.
func (c *Client) Close() error { return c.c.Close() }

// Done is closed when the connection is gone.
func (c *Client) Done() <-chan struct{} { return c.done }
