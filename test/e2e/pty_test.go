package e2e

import (
	"bytes"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/coder/websocket"

	"github.com/dsecproject/dsec/api"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

// termOutput collects a terminal's output in the background, so that a
// test waiting for text can give up (a Read blocks).
type termOutput struct {
	mu   sync.Mutex
	buf  bytes.Buffer
	done chan struct{}
	err  error
}

func collect(term *dsec.Terminal) *termOutput {
	o := &termOutput{done: make(chan struct{})}
	go func() {
		defer close(o.done)
		b := make([]byte, 4096)
		for {
			n, err := term.Read(b)
			o.mu.Lock()
			o.buf.Write(b[:n])
			o.mu.Unlock()
			if err != nil {
				o.err = err
				return
			}
		}
	}()
	return o
}

func (o *termOutput) String() string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.buf.String()
}

// waitFor waits until the terminal has shown want.
func (o *termOutput) waitFor(t *testing.T, want string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !strings.Contains(o.String(), want) {
		select {
		case <-o.done:
			if !strings.Contains(o.String(), want) {
				t.Fatalf("terminal ended (%v) without showing %q; it showed %q", o.err, want, o.String())
			}
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("terminal never showed %q; it showed %q", want, o.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func sessionsOpen(t *testing.T) float64 {
	t.Helper()
	r := wireCallAuth(t, "GET", "/metrics", nil, wireAuthNone)
	v, _ := metricValue(string(r.Body), "dsec_sessions_open")
	return v
}

func TestTerminal(t *testing.T) {
	needDaemon(t)
	terminalCase(t, api.BackendContainer)
}

func TestGVisorTerminal(t *testing.T) {
	needGVisor(t)
	terminalCase(t, api.BackendGVisor)
}

func TestMicroVMTerminal(t *testing.T) {
	needMicroVM(t)
	terminalCase(t, api.BackendMicroVM)
}

// terminalCase drives a terminal in a sandbox of backend: size, resize,
// ^C, exit status, and what closing the socket kills.
func terminalCase(t *testing.T, backend string) {
	before := sessionsOpen(t)
	sb := newSandbox(t, api.SandboxSpec{Backend: backend})
	c := ctx(t)
	term, err := client.Terminal(c, sb.ID, dsec.TerminalOptions{Cols: 100, Rows: 30})
	if err != nil {
		t.Fatal(err)
	}
	out := collect(term)
	// An interactive login shell with job control, its terminal's size.
	if _, err := term.Write([]byte("stty size; echo sum=$((40+2)); [ -t 0 ] && echo is-a-terminal\n")); err != nil {
		t.Fatal(err)
	}
	out.waitFor(t, "30 100")
	out.waitFor(t, "sum=42")
	out.waitFor(t, "is-a-terminal")
	if err := term.Resize(132, 43); err != nil {
		t.Fatal(err)
	}
	// A resize travels apart from the keystrokes (a control message
	// the server applies through its own call): a command typed right
	// after may run before it lands, so the size is asked again.
	for i := 0; i < 40 && !strings.Contains(out.String(), "43 132"); i++ {
		term.Write([]byte("stty size\n"))
		time.Sleep(500 * time.Millisecond)
	}
	out.waitFor(t, "43 132")
	// ^C reaches the foreground job, not the shell.
	term.Write([]byte("sleep 600\n"))
	time.Sleep(300 * time.Millisecond)
	term.Write([]byte{3})
	term.Write([]byte("echo after-interrupt\n"))
	out.waitFor(t, "after-interrupt")
	term.Write([]byte("exit 7\n"))
	select {
	case <-out.done:
	case <-time.After(20 * time.Second):
		t.Fatal("the terminal did not end after exit")
	}
	if out.err != io.EOF {
		t.Fatal(out.err)
	}
	if code, status, ended := term.ExitCode(); !ended || code != 7 {
		t.Fatalf("exit: %d %q ended=%v, want 7", code, status, ended)
	}
	term.Close()

	// Closing the socket kills what the shell started.
	term, err = client.Terminal(c, sb.ID, dsec.TerminalOptions{})
	if err != nil {
		t.Fatal(err)
	}
	out = collect(term)
	term.Write([]byte("sleep 1001 & sleep 1002 & echo started\n"))
	out.waitFor(t, "started")
	term.Close()
	waitGone := func(what string) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for {
			res := sh(t, sb.ID, "ps -o args | grep -c '^sleep 100[12]' || true")
			if strings.TrimSpace(res.Stdout) == "0" {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: sleeps still run: %s", what, sh(t, sb.ID, "ps -o pid,args").Stdout)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	waitGone("after close")

	// A text frame that is not a resize closes the terminal (1008) and
	// kills the shell; so does a malformed resize.
	for _, garbage := range []string{"garbage", `{"resize": {"cols": 0, "rows": 0}}`, `{"resize": "x"}`} {
		h := http.Header{"Authorization": {"Bearer " + d.key}}
		conn, _, err := websocket.Dial(c, "http://"+d.listen+"/v1/sandboxes/"+sb.ID+"/pty", &websocket.DialOptions{HTTPHeader: h})
		if err != nil {
			t.Fatal(err)
		}
		conn.Write(c, websocket.MessageBinary, []byte("sleep 1001\n"))
		time.Sleep(200 * time.Millisecond)
		conn.Write(c, websocket.MessageText, []byte(garbage))
		var readErr error
		for readErr == nil {
			_, _, readErr = conn.Read(c)
		}
		if st := websocket.CloseStatus(readErr); garbage != `{"resize": {"cols": 0, "rows": 0}}` && st != websocket.StatusPolicyViolation {
			t.Errorf("after %q: %v, want close 1008", garbage, readErr)
		}
		waitGone("after " + garbage)
	}

	// A sandbox that does not exist is a plain 404 before any upgrade.
	_, err = client.Terminal(c, "sb-local-nosuchsandbox", dsec.TerminalOptions{})
	wantCode(t, err, "not_found")
	// Bad sizes are refused before the upgrade too.
	r := wireCallAuth(t, "GET", "/v1/sandboxes/"+sb.ID+"/pty?cols=0", nil, "Bearer "+d.key)
	if r.Status != 400 {
		t.Errorf("cols=0: %d %s", r.Status, r.Body)
	}

	// Every terminal gave its slot back.
	deadline := time.Now().Add(10 * time.Second)
	for sessionsOpen(t) != before {
		if time.Now().After(deadline) {
			t.Fatalf("dsec_sessions_open %v, was %v before: a terminal leaked", sessionsOpen(t), before)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
