package dsec

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"sync"

	"github.com/coder/websocket"
)

// TerminalOptions configure a terminal (GET /v1/sandboxes/{id}/pty).
type TerminalOptions struct {
	Cols, Rows int
	// Cmd runs this command under /bin/sh -c instead of a login shell;
	// Shell runs another shell. At most one is given.
	Cmd   string
	Shell string
	User  string
}

// Terminal is an interactive terminal in a sandbox: Read gives what the
// terminal shows, Write types into it. Read returns io.EOF once the
// shell has ended; ExitCode then tells how.
type Terminal struct {
	conn *websocket.Conn
	ctx  context.Context

	mu       sync.Mutex
	pending  []byte
	exitCode int
	status   string
	ended    bool
}

// Terminal opens a terminal in sandbox id. Closing it kills the shell's
// processes.
func (c *Client) Terminal(ctx context.Context, id string, o TerminalOptions) (*Terminal, error) {
	q := url.Values{}
	if o.Cols > 0 {
		q.Set("cols", strconv.Itoa(o.Cols))
	}
	if o.Rows > 0 {
		q.Set("rows", strconv.Itoa(o.Rows))
	}
	for k, v := range map[string]string{"cmd": o.Cmd, "shell": o.Shell, "user": o.User} {
		if v != "" {
			q.Set(k, v)
		}
	}
	h := http.Header{}
	if c.apiKey != "" {
		h.Set("Authorization", "Bearer "+c.apiKey)
	}
	if c.userAgent != "" {
		h.Set("User-Agent", c.userAgent)
	}
	var lastErr error
	start := int(c.cur.Load())
	for i := range len(c.endpoints) {
		ep := c.endpoints[(start+i)%len(c.endpoints)]
		u := ep + "/v1/sandboxes/" + url.PathEscape(id) + "/pty?" + q.Encode()
		conn, resp, err := websocket.Dial(ctx, u, &websocket.DialOptions{HTTPClient: c.http, HTTPHeader: h})
		if err == nil {
			conn.SetReadLimit(4 << 20)
			return &Terminal{conn: conn, ctx: context.WithoutCancel(ctx)}, nil
		}
		if resp != nil && resp.StatusCode != http.StatusSwitchingProtocols {
			// The server answered: its error is the answer.
			return nil, errorFromResponse(resp)
		}
		lastErr = err
	}
	return nil, fmt.Errorf("opening a terminal: %w", lastErr)
}

// Read reads terminal output.
func (t *Terminal) Read(p []byte) (int, error) {
	t.mu.Lock()
	if len(t.pending) > 0 {
		n := copy(p, t.pending)
		t.pending = t.pending[n:]
		t.mu.Unlock()
		return n, nil
	}
	ended := t.ended
	t.mu.Unlock()
	if ended {
		return 0, io.EOF
	}
	for {
		typ, b, err := t.conn.Read(t.ctx)
		if err != nil {
			t.mu.Lock()
			defer t.mu.Unlock()
			if t.ended || websocket.CloseStatus(err) == websocket.StatusNormalClosure {
				t.ended = true
				return 0, io.EOF
			}
			return 0, err
		}
		if typ == websocket.MessageText {
			var ex struct {
				ExitCode int    `json:"exit_code"`
				Status   string `json:"status"`
			}
			if json.Unmarshal(b, &ex) == nil {
				t.mu.Lock()
				t.exitCode, t.status, t.ended = ex.ExitCode, ex.Status, true
				t.mu.Unlock()
			}
			continue
		}
		n := copy(p, b)
		if n < len(b) {
			t.mu.Lock()
			t.pending = append(t.pending, b[n:]...)
			t.mu.Unlock()
		}
		return n, nil
	}
}

// Write types p into the terminal.
func (t *Terminal) Write(p []byte) (int, error) {
	if err := t.conn.Write(t.ctx, websocket.MessageBinary, p); err != nil {
		return 0, err
	}
	return len(p), nil
}

// Resize sets the terminal's size.
func (t *Terminal) Resize(cols, rows int) error {
	if cols <= 0 || rows <= 0 {
		return errors.New("resize: columns and rows must be positive")
	}
	b, _ := json.Marshal(map[string]any{"resize": map[string]int{"cols": cols, "rows": rows}})
	return t.conn.Write(t.ctx, websocket.MessageText, b)
}

// ExitCode returns the shell's exit status once Read has returned io.EOF.
func (t *Terminal) ExitCode() (code int, status string, ended bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.exitCode, t.status, t.ended
}

// Close closes the terminal, killing the shell's processes.
func (t *Terminal) Close() error {
	return t.conn.Close(websocket.StatusNormalClosure, "")
}
