package agent

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/files"
)

// syncBuffer is a bytes.Buffer safe to read while output is written.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

func run(t *testing.T, c *Client, m Msg, stdin string) (int, string, string) {
	t.Helper()
	var out, errb syncBuffer
	var in *strings.Reader
	if stdin != "" {
		in = strings.NewReader(stdin)
	}
	var p *Process
	var err error
	if in != nil {
		p, err = c.Exec(context.Background(), m, in, &out, &errb)
	} else {
		p, err = c.Exec(context.Background(), m, nil, &out, &errb)
	}
	if err != nil {
		t.Fatalf("exec %v: %v", m.Args, err)
	}
	code, err := p.Wait()
	if err != nil {
		t.Fatalf("wait %v: %v", m.Args, err)
	}
	return code, out.String(), errb.String()
}

// TestServeOverAConnection runs the agent's server on one end of a pipe
// and the client on the other, as the agent runs without a sandbox root:
// real commands, streams, exit codes, concurrent commands, a kill that
// takes the tree, and requests the agent refuses.
func TestServeOverAConnection(t *testing.T) {
	a, b := net.Pipe()
	srv := NewServer()
	go srv.Serve(a)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := Connect(ctx, b)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	code, out, errs := run(t, c, Msg{Args: []string{"sh", "-c", `read x; echo "$x $FOO $(pwd)"; echo err >&2; exit 3`}, Env: []string{"FOO=bar"}, Cwd: "/tmp"}, "hi\n")
	if code != 3 || out != "hi bar /tmp\n" || errs != "err\n" {
		t.Fatalf("exec: %d %q %q", code, out, errs)
	}
	// Large output streams whole, in order.
	code, out, _ = run(t, c, Msg{Args: []string{"sh", "-c", "seq 1 200000"}}, "")
	if code != 0 || !strings.HasPrefix(out, "1\n2\n") || !strings.HasSuffix(out, "\n200000\n") || strings.Count(out, "\n") != 200000 {
		t.Fatalf("large output: %d, %d lines", code, strings.Count(out, "\n"))
	}
	// Output arrives while the command runs, and two run at once.
	var live syncBuffer
	slow, err := c.Exec(ctx, Msg{Args: []string{"sh", "-c", "echo first; sleep 30 & sleep 30; echo never"}}, nil, &live, &live)
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(5 * time.Second); live.String() != "first\n"; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("output did not stream: %q", live.String())
		}
	}
	if code, out, _ := run(t, c, Msg{Args: []string{"echo", "meanwhile"}}, ""); code != 0 || out != "meanwhile\n" {
		t.Fatalf("concurrent exec: %d %q", code, out)
	}
	if slow.Pid() <= 0 {
		t.Fatalf("pid %d", slow.Pid())
	}
	start := time.Now()
	if err := slow.Kill(); err != nil {
		t.Fatal(err)
	}
	if code, err := slow.Wait(); err != nil || code != 137 || time.Since(start) > 10*time.Second {
		t.Fatalf("killed: %d %v after %v", code, err, time.Since(start))
	}
	if descendants(slow.Pid()) != nil {
		t.Fatalf("children of a killed command survive: %v", descendants(slow.Pid()))
	}
	if err := slow.Kill(); err != nil {
		t.Fatalf("second kill: %v", err)
	}
	if code, _, errs := run(t, c, Msg{Args: []string{"/no/such/binary"}}, ""); code != 127 || !strings.Contains(errs, "not found") {
		t.Fatalf("missing binary: %d %q", code, errs)
	}
	if code, _, errs := run(t, c, Msg{Args: []string{"true"}, Cwd: "/no/such/dir"}, ""); code != 126 || !strings.Contains(errs, "/no/such/dir") {
		t.Fatalf("missing cwd: %d %q", code, errs)
	}
	if _, err := c.Exec(ctx, Msg{Args: []string{"true"}, User: "nosuchuser"}, nil, nil, nil); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("unknown user: %v", err)
	}
	if err := c.Call(ctx, Msg{Op: "format-disk"}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("unknown op: %v", err)
	}
	if err := c.Call(ctx, Msg{Op: "ping"}); err != nil {
		t.Fatal(err)
	}
}

// TestReconnectKillsWhatTheLastConnectionLeft: the host goes (an edge
// restart) while a command runs; the agent kills it, and serves the next
// connection.
func TestReconnectKillsWhatTheLastConnectionLeft(t *testing.T) {
	srv := NewServer()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	a, b := net.Pipe()
	served := make(chan error, 1)
	go func() { served <- srv.Serve(a) }()
	c, err := Connect(ctx, b)
	if err != nil {
		t.Fatal(err)
	}
	var out syncBuffer
	p, err := c.Exec(ctx, Msg{Args: []string{"sh", "-c", "echo up; sleep 60"}}, nil, &out, &out)
	if err != nil {
		t.Fatal(err)
	}
	for out.String() != "up\n" {
		time.Sleep(10 * time.Millisecond)
	}
	c.Close()
	a.Close()
	<-served
	if _, err := p.Wait(); !errors.Is(err, ErrGone) {
		t.Fatalf("wait on a closed connection: %v", err)
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if syscallKill0(p.Pid()) != nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the command of a closed connection still runs")
		}
	}
	a, b = net.Pipe()
	go srv.Serve(a)
	c, err = Connect(ctx, b)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if code, out, _ := run(t, c, Msg{Args: []string{"echo", "again"}}, ""); code != 0 || out != "again\n" {
		t.Fatalf("after reconnect: %d %q", code, out)
	}
}

func syscallKill0(pid int) error { return syscall.Kill(pid, 0) }

// fakeGuest answers the host's hello, then runs script on the rest of the
// connection: a guest whose root rewrote the agent.
func fakeGuest(t *testing.T, script func(conn net.Conn, r *bufio.Reader)) *Client {
	t.Helper()
	a, b := net.Pipe()
	go func() {
		r := bufio.NewReader(a)
		if _, err := a.Write([]byte(`{"op":"ready"}` + "\n")); err != nil {
			return
		}
		script(a, r)
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := Connect(ctx, b)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close(); a.Close() })
	return c
}

// TestHostAgainstAHostileGuest: what the guest's side of the
// protocol says cannot make the host buffer without bound, take an "ok"
// for a started process, or wait forever on a process it killed.
func TestHostAgainstAHostileGuest(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	t.Run("endless-line", func(t *testing.T) {
		c := fakeGuest(t, func(conn net.Conn, r *bufio.Reader) {
			go io.Copy(io.Discard, r)
			chunk := bytes.Repeat([]byte("x"), 64<<10)
			for i := 0; i < 64; i++ { // 4 MiB, no newline
				if _, err := conn.Write(chunk); err != nil {
					return
				}
			}
		})
		select {
		case <-c.Done():
		case <-time.After(10 * time.Second):
			t.Fatal("the connection survived a 4 MiB line")
		}
		if err := c.Call(ctx, Msg{Op: "ping"}); !errors.Is(err, ErrGone) {
			t.Fatalf("call after a too long line: %v", err)
		}
	})
	t.Run("ok-for-an-exec", func(t *testing.T) {
		c := fakeGuest(t, func(conn net.Conn, r *bufio.Reader) {
			readMsgs(r, func(m Msg) bool {
				if m.Op == "exec" {
					fmt.Fprintf(conn, `{"id":%d,"op":"ok"}`+"\n", m.ID)
				}
				return true
			})
		})
		p, err := c.Exec(ctx, Msg{Args: []string{"true"}}, nil, nil, nil)
		if err == nil || p != nil {
			t.Fatalf("exec answered ok: %v %v", p, err)
		}
	})
	t.Run("killed-but-never-exits", func(t *testing.T) {
		c := fakeGuest(t, func(conn net.Conn, r *bufio.Reader) {
			readMsgs(r, func(m Msg) bool {
				switch m.Op {
				case "exec":
					fmt.Fprintf(conn, `{"id":%d,"op":"started","pid":42}`+"\n", m.ID)
				case "kill":
					fmt.Fprintf(conn, `{"id":%d,"op":"ok"}`+"\n", m.ID)
				}
				return true
			})
		})
		p, err := c.Exec(ctx, Msg{Args: []string{"sleep", "1000"}}, nil, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		if err := p.Kill(); err != nil {
			t.Fatal(err)
		}
		code, err := p.Wait()
		if code != 137 || err != nil || time.Since(start) > killGrace+5*time.Second {
			t.Fatalf("wait after kill: %d %v after %v", code, err, time.Since(start))
		}
	})
}

// failingReader gives data, then fails: an upload cut short.
type failingReader struct{ n int }

func (f *failingReader) Read(p []byte) (int, error) {
	if f.n <= 0 {
		return 0, errors.New("client went away")
	}
	k := min(len(p), f.n)
	for i := range p[:k] {
		p[i] = 'x'
	}
	f.n -= k
	return k, nil
}

// TestFilesOverAConnection: the files API served by the agent (here on a
// temp dir as the sandbox's root): data both ways in many chunks, errors
// rebuilt with their class, confinement, and an upload cut short that
// leaves no file.
func TestFilesOverAConnection(t *testing.T) {
	root := t.TempDir()
	fr, err := files.Open(root)
	if err != nil {
		t.Fatal(err)
	}
	srv := NewServer()
	srv.files = fr
	a, b := net.Pipe()
	go srv.Serve(a)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := Connect(ctx, b)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	f := Files{C: c}
	big := strings.Repeat("0123456789abcdef", 40000) // 640 kB
	fe, err := f.WriteFile(ctx, "/d/big", strings.NewReader(big), 0o600, 0, "")
	if err != nil || fe.Size != int64(len(big)) {
		t.Fatalf("write: %+v %v", fe, err)
	}
	if b, _ := os.ReadFile(root + "/d/big"); string(b) != big {
		t.Fatalf("written: %d bytes", len(b))
	}
	rc, fe, err := f.ReadFile(ctx, "/d/big")
	if err != nil || fe.Size != int64(len(big)) {
		t.Fatalf("read: %+v %v", fe, err)
	}
	got, err := io.ReadAll(rc)
	rc.Close()
	if err != nil || string(got) != big {
		t.Fatalf("read back %d bytes, %v", len(got), err)
	}
	if _, _, err := f.ReadFile(ctx, "/nope"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("missing file: %v", err)
	}
	if _, _, err := f.ReadFile(ctx, "/../../etc/passwd"); err == nil {
		t.Fatal("a read left the root")
	}
	if _, err := f.Mkdir(ctx, "/d", ""); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Fatalf("mkdir of an existing dir: %v", err)
	}
	if _, err := f.Rename(ctx, "/d/big", "/e/moved"); err != nil {
		t.Fatal(err)
	}
	if ents, err := f.List(ctx, "/e", 1); err != nil || len(ents) != 1 || ents[0].Path != "/e/moved" {
		t.Fatalf("list: %+v %v", ents, err)
	}
	var tb bytes.Buffer
	if err := f.WriteTar(ctx, "/e", &tb); err != nil || tb.Len() == 0 {
		t.Fatalf("tar out: %v", err)
	}
	if tr, err := f.ExtractTar(ctx, "/copy", &tb, 0, 0, ""); err != nil || tr.Files < 1 {
		t.Fatalf("tar in: %+v %v", tr, err)
	}
	if _, err := f.Stat(ctx, "/copy/moved"); err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteFile(ctx, "/limited", strings.NewReader(big), 0o644, 1000, ""); err == nil {
		t.Fatal("a write past its limit succeeded")
	}
	if _, err := f.WriteFile(ctx, "/cut", &failingReader{n: 100000}, 0o644, 0, ""); err == nil {
		t.Fatal("an upload cut short succeeded")
	}
	if _, err := os.Stat(root + "/cut"); !os.IsNotExist(err) {
		t.Fatalf("an upload cut short left a file: %v", err)
	}
	if err := f.Remove(ctx, "/copy", true); err != nil {
		t.Fatal(err)
	}
	if _, err := f.Stat(ctx, "/copy"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("after remove: %v", err)
	}
}

// TestTerminal: a process on a terminal the agent makes: it is a
// terminal of the size asked for, a resize reaches it, and its input is
// the terminal's (echoed by it).
func TestTerminal(t *testing.T) {
	a, b := net.Pipe()
	go NewServer().Serve(a)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := Connect(ctx, b)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	inR, inW := io.Pipe()
	var out syncBuffer
	p, err := c.Exec(ctx, Msg{Args: []string{"sh", "-c", "[ -t 0 ] && echo is-a-terminal; stty size; read x; stty size; echo got=$x"}, TTY: true, Rows: 30, Cols: 100}, inR, &out, &out)
	if err != nil {
		t.Fatal(err)
	}
	waitOut := func(want string) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); !strings.Contains(out.String(), want); time.Sleep(10 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("want %q in %q", want, out.String())
			}
		}
	}
	waitOut("30 100")
	if err := p.Resize(ctx, 43, 132); err != nil {
		t.Fatal(err)
	}
	inW.Write([]byte("hello\n"))
	if code, err := p.Wait(); code != 0 || err != nil {
		t.Fatalf("exit %d %v: %q", code, err, out.String())
	}
	waitOut("43 132")
	if s := out.String(); !strings.Contains(s, "is-a-terminal") || !strings.Contains(s, "hello\r\n") || !strings.Contains(s, "got=hello") {
		t.Fatalf("terminal output %q: want the test, the echo of the input (CRLF) and its value", s)
	}
	if err := c.Call(ctx, Msg{Op: "resize", Of: 12345, Rows: 1, Cols: 1}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("resize of no terminal: %v", err)
	}
}

// TestWatchOverAConnection: a directory watch kept by the agent reports
// changes poll by poll; it cannot see outside the root; a stopped watch
// is gone; watches are bounded per connection, and end with it.
func TestWatchOverAConnection(t *testing.T) {
	root := t.TempDir()
	fr, err := files.Open(root)
	if err != nil {
		t.Fatal(err)
	}
	srv := NewServer()
	srv.files = fr
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	connect := func() *Client {
		a, b := net.Pipe()
		go srv.Serve(a)
		c, err := Connect(ctx, b)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	c := connect()
	f := Files{C: c}
	os.MkdirAll(filepath.Join(root, "w"), 0o755)
	os.WriteFile(filepath.Join(filepath.Dir(root), "outside"), []byte("x"), 0o644)
	if w, err := f.Watch(ctx, "/../..", 1, 100); err == nil {
		// Clamped at the root: it sees the root's names, none of its parent's.
		os.WriteFile(filepath.Join(filepath.Dir(root), "outside2"), []byte("x"), 0o644)
		if evs, err := w.Poll(ctx); err != nil || len(evs) != 0 {
			t.Fatalf("a watch of /../.. saw %+v %v", evs, err)
		}
		w.Close()
	}
	w, err := f.Watch(ctx, "/w", 2, 100)
	if err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(root, "w", "new"), []byte("x"), 0o644)
	evs, err := w.Poll(ctx)
	if err != nil || len(evs) == 0 || evs[0].Name != "new" || evs[0].Type != api.FileEventCreate {
		t.Fatalf("poll: %+v %v", evs, err)
	}
	if evs, err := w.Poll(ctx); err != nil || len(evs) != 0 {
		t.Fatalf("poll without changes: %+v %v", evs, err)
	}
	os.Remove(filepath.Join(root, "w", "new"))
	if evs, err := w.Poll(ctx); err != nil || len(evs) != 1 || evs[0].Type != api.FileEventRemove {
		t.Fatalf("poll after remove: %+v %v", evs, err)
	}
	w.Close()
	if _, err := w.Poll(ctx); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("poll of a stopped watch: %v", err)
	}
	for i := 0; ; i++ {
		_, err := f.Watch(ctx, "/w", 1, 100)
		if errors.Is(err, errdefs.ErrExhausted) {
			if i > MaxWatches {
				t.Fatalf("%d watches before the bound", i)
			}
			break
		}
		if err != nil || i > MaxWatches {
			t.Fatalf("watch %d: %v", i, err)
		}
	}
	// A new connection (an edge restart) starts with none.
	c.Close()
	c2 := connect()
	defer c2.Close()
	if _, err := (&Watch{c: c2, id: w.(*Watch).id}).Poll(ctx); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("a watch of the last connection: %v", err)
	}
	if _, err := (Files{C: c2}).Watch(ctx, "/w", 1, 100); err != nil {
		t.Fatalf("a watch after the last connection's ended: %v", err)
	}
}

// gateWriter blocks every write until open is closed, then counts.
type gateWriter struct {
	open chan struct{}
	mu   sync.Mutex
	n    int
}

func (g *gateWriter) Write(p []byte) (int, error) {
	<-g.open
	g.mu.Lock()
	g.n += len(p)
	g.mu.Unlock()
	return len(p), nil
}

// TestSlowReaderHoldsUpOnlyItsOwnCommand: a command whose output nobody
// reads stops at the window (its pipe fills, as a container's would),
// while other commands and file calls on the connection go on; the host
// holds no more than the window for it; once read, all of it arrives.
func TestSlowReaderHoldsUpOnlyItsOwnCommand(t *testing.T) {
	root := t.TempDir()
	fr, err := files.Open(root)
	if err != nil {
		t.Fatal(err)
	}
	a, b := net.Pipe()
	srv := NewServer()
	srv.files = fr
	go srv.Serve(a)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	c, err := Connect(ctx, b)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if !c.window {
		t.Fatal("the agent does not offer flow control")
	}
	const size = 8 << 20
	g := &gateWriter{open: make(chan struct{})}
	big, err := c.Exec(ctx, Msg{Args: []string{"head", "-c", fmt.Sprint(size), "/dev/zero"}}, nil, g, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond) // let it fill what it may
	start := time.Now()
	if code, out, _ := run(t, c, Msg{Args: []string{"echo", "meanwhile"}}, ""); code != 0 || out != "meanwhile\n" {
		t.Fatalf("exec beside an unread one: %d %q", code, out)
	}
	if _, err := (Files{C: c}).WriteFile(ctx, "/f", strings.NewReader("x"), 0o644, 0, ""); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("an exec and a write beside an unread command took %v", d)
	}
	big.cl.dq.mu.Lock()
	queued := big.cl.dq.bytes
	big.cl.dq.mu.Unlock()
	if queued > Window+ChunkSize {
		t.Fatalf("the host holds %d bytes of the unread command's output, more than its window", queued)
	}
	close(g.open)
	if code, err := big.Wait(); code != 0 || err != nil {
		t.Fatalf("unread command: %d %v", code, err)
	}
	if g.n != size {
		t.Fatalf("read %d of %d bytes", g.n, size)
	}
}

// TestAgentOverrunningItsWindowIsCutOff: a guest that says it keeps the
// window and then floods the host ends its connection; the host does not
// buffer it.
func TestAgentOverrunningItsWindowIsCutOff(t *testing.T) {
	a, b := net.Pipe()
	go func() {
		enc := json.NewEncoder(a)
		enc.Encode(Msg{Op: "ready", Features: []string{FeatureWindow}})
		r := bufio.NewReader(a)
		readMsgs(r, func(m Msg) bool {
			if m.Op != "exec" {
				return true
			}
			enc.Encode(Msg{ID: m.ID, Op: "started", Pid: 42})
			chunk := make([]byte, ChunkSize)
			go func() {
				for enc.Encode(Msg{ID: m.ID, Op: "stdout", Data: chunk}) == nil {
				}
			}()
			return true
		})
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := Connect(ctx, b)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	g := &gateWriter{open: make(chan struct{})} // never read
	p, err := c.Exec(ctx, Msg{Args: []string{"x"}}, nil, g, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-c.Done():
	case <-ctx.Done():
		t.Fatal("a flooding agent kept its connection")
	}
	if _, err := p.Wait(); !errors.Is(err, ErrGone) {
		t.Fatalf("wait: %v", err)
	}
	close(g.open)
}

// relay stands for a VMM between the agent and the host: the agent's
// side is one stream for the agent's whole life, while the host's side is
// a socket of the current VMM, replaced when the VM is saved and resumed
// by another. Nothing the agent wrote is lost in the swap (a VM's device
// state keeps what the old VMM had not passed on).
type relay struct {
	agent net.Conn
	mu    sync.Mutex
	host  net.Conn
	next  chan struct{}
}

func newRelay(agentSide net.Conn) *relay {
	r := &relay{agent: agentSide, next: make(chan struct{})}
	go func() {
		buf := make([]byte, 64<<10)
		for {
			n, err := r.agent.Read(buf)
			data := buf[:n]
			for len(data) > 0 {
				r.mu.Lock()
				h, next := r.host, r.next
				r.mu.Unlock()
				if h == nil {
					<-next
					continue
				}
				k, werr := h.Write(data)
				data = data[k:]
				if werr != nil {
					<-next
				}
			}
			if err != nil {
				return
			}
		}
	}()
	return r
}

// vmm gives the host a new socket to the agent (a new VMM's).
func (r *relay) vmm() net.Conn {
	hostEnd, relayEnd := net.Pipe()
	r.mu.Lock()
	r.host = relayEnd
	close(r.next)
	r.next = make(chan struct{})
	r.mu.Unlock()
	go io.Copy(r.agent, relayEnd)
	return hostEnd
}

// stop ends the current VMM's socket.
func (r *relay) stop() {
	r.mu.Lock()
	h := r.host
	r.host = nil
	r.mu.Unlock()
	h.Close()
}

// TestCommandsGoOnAcrossAResume: a client suspended while its VM is
// saved and attached to the next VMM's socket keeps its calls: a command
// started before waits (no ErrGone), takes stdin sent while suspended,
// and ends with its output whole; an agent that takes the new socket for
// a new connection (and so killed the command) fails the calls instead of
// leaving them hanging.
func TestCommandsGoOnAcrossAResume(t *testing.T) {
	agentEnd, relayEnd := net.Pipe()
	srv := NewServer()
	go srv.Serve(agentEnd)
	r := newRelay(relayEnd)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := Connect(ctx, r.vmm())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	in, inw := io.Pipe()
	var out syncBuffer
	p, err := c.Exec(ctx, Msg{Args: []string{"sh", "-c", `echo before; read x; echo "got $x"; head -c 3000000 /dev/zero | wc -c`}}, in, &out, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(5 * time.Second); out.String() != "before\n"; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("no output: %q", out.String())
		}
	}
	c.Suspend()
	r.stop()
	// Stdin sent while the VM is saved waits for the next VMM.
	go inw.Write([]byte("resumed\n"))
	time.Sleep(200 * time.Millisecond)
	select {
	case <-c.Done():
		t.Fatal("the end of a suspended transport failed the connection")
	default:
	}
	if err := c.Attach(ctx, r.vmm()); err != nil {
		t.Fatal(err)
	}
	code, err := p.Wait()
	if code != 0 || err != nil || out.String() != "before\ngot resumed\n3000000\n" {
		t.Fatalf("across the resume: %d %v %q", code, err, out.String())
	}
	if err := c.Call(ctx, Msg{Op: "ping"}); err != nil {
		t.Fatalf("a call after the resume: %v", err)
	}
	inw.Close()

	// The same, but the agent sees a new connection on the new socket
	// (its own Serve again): the command it killed is reported gone.
	p2, err := c.Exec(ctx, Msg{Args: []string{"sleep", "30"}}, nil, io.Discard, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	c.Suspend()
	r.stop()
	agentEnd.Close()
	a2, b2 := net.Pipe()
	go srv.Serve(a2)
	if err := c.Attach(ctx, b2); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { _, err := p2.Wait(); done <- err }()
	select {
	case err := <-done:
		if !errors.Is(err, ErrGone) {
			t.Fatalf("a command the agent killed: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a command the agent killed is still waited for")
	}
}

// TestCwdInHome: a cwd of "~" or "~/x" is taken in the user's home.
func TestCwdInHome(t *testing.T) {
	a, b := net.Pipe()
	go NewServer().Serve(a)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := Connect(ctx, b)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	home := t.TempDir()
	os.Mkdir(filepath.Join(home, "sub"), 0o755)
	for cwd, want := range map[string]string{"~": home, "~/sub": home + "/sub", "/tmp": "/tmp"} {
		if code, out, _ := run(t, c, Msg{Args: []string{"pwd"}, Cwd: cwd, Env: []string{"HOME=" + home}}, ""); code != 0 || strings.TrimSpace(out) != want {
			t.Errorf("cwd %s: %d %q, want %s", cwd, code, out, want)
		}
	}
}

// fakeAgent answers Connect with ready (with flow control) and hands the
// rest of the stream to serve.
// readMsgs decodes the host's messages from r and hands each to fn until
// the connection ends or fn returns false; a line that is not a message
// is skipped.
func readMsgs(r *bufio.Reader, fn func(m Msg) bool) {
	for {
		line, err := r.ReadBytes('\n')
		if err != nil {
			return
		}
		var m Msg
		if json.Unmarshal(line, &m) != nil {
			continue
		}
		if !fn(m) {
			return
		}
	}
}

func fakeAgent(t *testing.T, serve func(enc *json.Encoder, r *bufio.Reader)) *Client {
	t.Helper()
	a, b := net.Pipe()
	go func() {
		enc := json.NewEncoder(a)
		enc.Encode(Msg{Op: "ready", Features: []string{FeatureWindow}})
		serve(enc, bufio.NewReader(a))
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := Connect(ctx, b)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// TestDataForIDsTheHostNeverIssuedIsDropped: a guest that sends output
// for requests that do not exist gets no acks and grows nothing on the
// host.
func TestDataForIDsTheHostNeverIssuedIsDropped(t *testing.T) {
	acks := make(chan Msg, 16)
	c := fakeAgent(t, func(enc *json.Encoder, r *bufio.Reader) {
		go readMsgs(r, func(m Msg) bool {
			if m.Op == "ack" {
				select {
				case acks <- m:
				default:
				}
			}
			return true
		})
		for id := uint64(1); id < 20000; id++ {
			if enc.Encode(Msg{ID: id * 7919, Op: "stdout", Data: []byte("A")}) != nil {
				return
			}
		}
		enc.Encode(Msg{ID: 3, Op: "exit"})
	})
	time.Sleep(500 * time.Millisecond)
	c.ackMu.Lock()
	n := len(c.acked)
	c.ackMu.Unlock()
	if n != 0 {
		t.Fatalf("the host keeps %d ack totals for ids it never issued", n)
	}
	select {
	case m := <-acks:
		t.Fatalf("the host acked data it never asked for: %+v", m)
	default:
	}
}

// TestKillOfACommandOfASavedVM: killing a command while its VM is saved
// (a delete of a paused sandbox) does not wait for the VM.
func TestKillOfACommandOfASavedVM(t *testing.T) {
	c := fakeAgent(t, func(enc *json.Encoder, r *bufio.Reader) {
		readMsgs(r, func(m Msg) bool {
			if m.Op == "exec" {
				enc.Encode(Msg{ID: m.ID, Op: "started", Pid: 7})
			}
			return true
		})
	})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	p, err := c.Exec(ctx, Msg{Args: []string{"sleep", "100"}}, nil, io.Discard, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	c.Suspend()
	start := time.Now()
	if err := p.Kill(); err != nil {
		t.Fatal(err)
	}
	if code, err := p.Wait(); code != 137 || err != nil || time.Since(start) > 2*time.Second {
		t.Fatalf("kill of a saved VM's command: %d %v after %v", code, err, time.Since(start))
	}
	callCtx, cancel2 := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel2()
	if err := c.Call(callCtx, Msg{Op: "ping"}); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a call to a saved VM: %v, want its context's end", err)
	}
}

// TestALineSplitByTheResumeArrivesWhole: a message the old VMM passed
// on in part is completed by the new VMM's socket.
func TestALineSplitByTheResumeArrivesWhole(t *testing.T) {
	a, b := net.Pipe()
	lines := make(chan []byte, 1)
	saving := make(chan struct{})
	go func() {
		enc := json.NewEncoder(a)
		enc.Encode(Msg{Op: "ready", Features: []string{FeatureWindow}})
		r := bufio.NewReader(a)
		var m Msg
		for m.Op != "exec" { // (Connect's ping first)
			l, err := r.ReadBytes('\n')
			if err != nil {
				return
			}
			json.Unmarshal(l, &m)
		}
		go io.Copy(io.Discard, r)
		enc.Encode(Msg{ID: m.ID, Op: "started", Pid: 7})
		line, _ := json.Marshal(Msg{ID: m.ID, Op: "stdout", Data: []byte("HELLO")})
		lines <- line
		<-saving
		a.Write(line[:10]) // then the VM is saved
		a.Close()
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := Connect(ctx, b)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	var out syncBuffer
	p, err := c.Exec(ctx, Msg{Args: []string{"x"}}, nil, &out, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	c.Suspend()
	close(saving)
	time.Sleep(100 * time.Millisecond) // the old transport ends
	line := <-lines
	a2, b2 := net.Pipe()
	go func() {
		a2.Write(line[10:])
		a2.Write([]byte("\n"))
		json.NewEncoder(a2).Encode(Msg{ID: p.id, Op: "exit"})
		io.Copy(io.Discard, a2)
	}()
	if err := c.Attach(ctx, b2); err != nil {
		t.Fatal(err)
	}
	if code, err := p.Wait(); code != 0 || err != nil || out.String() != "HELLO" {
		t.Fatalf("after the resume: %d %v %q", code, err, out.String())
	}
}

// slowWriter takes a while over each write.
type slowWriter struct{ syncBuffer }

func (w *slowWriter) Write(p []byte) (int, error) {
	time.Sleep(50 * time.Millisecond)
	return w.syncBuffer.Write(p)
}

// TestNoCleanExitWithOutputCut: a connection that ends while a command's
// output and exit are still queued reports the connection gone, never a
// clean exit with part of the output.
func TestNoCleanExitWithOutputCut(t *testing.T) {
	for i := 0; i < 5; i++ {
		c := fakeAgent(t, func(enc *json.Encoder, r *bufio.Reader) {
			readMsgs(r, func(m Msg) bool {
				if m.Op != "exec" {
					return true
				}
				enc.Encode(Msg{ID: m.ID, Op: "started", Pid: 7})
				enc.Encode(Msg{ID: m.ID, Op: "stdout", Data: []byte("A")})
				enc.Encode(Msg{ID: m.ID, Op: "stdout", Data: []byte("B")})
				enc.Encode(Msg{ID: m.ID, Op: "exit"})
				return false // the connection ends
			})
		})
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		w := &slowWriter{}
		p, err := c.Exec(ctx, Msg{Args: []string{"x"}}, nil, w, io.Discard)
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		c.Close()
		time.Sleep(300 * time.Millisecond) // all that is queued is dealt with
		code, err := p.Wait()
		if err == nil && (code != 0 || w.String() != "AB") {
			t.Fatalf("a clean exit %d with output %q", code, w.String())
		}
	}
}

// TestRefusedRequestsLeaveNothing: execs the agent refuses, and calls
// given up on before they were answered, leave no entry behind.
func TestRefusedRequestsLeaveNothing(t *testing.T) {
	a, b := net.Pipe()
	go NewServer().Serve(a)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := Connect(ctx, b)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for i := 0; i < 20; i++ {
		if _, err := c.Exec(ctx, Msg{Args: []string{"true"}, User: "nosuchuser"}, nil, io.Discard, io.Discard); err == nil {
			t.Fatal("an exec as a missing user ran")
		}
	}
	c.Suspend()
	for i := 0; i < 20; i++ {
		short, cancel := context.WithTimeout(ctx, 10*time.Millisecond)
		_, err := c.Exec(short, Msg{Args: []string{"true"}}, nil, io.Discard, io.Discard)
		cancel()
		if err == nil {
			t.Fatal("an exec ran while suspended")
		}
	}
	c.Unsuspend()
	time.Sleep(100 * time.Millisecond)
	c.mu.Lock()
	n := len(c.calls)
	c.mu.Unlock()
	if n != 0 {
		t.Fatalf("%d calls left behind", n)
	}
}
