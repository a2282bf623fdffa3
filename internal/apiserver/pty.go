package apiserver

// Terminals: GET /v1/sandboxes/{id}/pty upgrades to a WebSocket over an
// edge process run under a pseudo-terminal (the edge's processes, as for
// E2B's pty). Binary frames carry terminal bytes both ways; a text frame
// {"resize": {"cols", "rows"}} resizes; when the shell ends the server
// sends a text frame {"exit_code", "status"} and closes normally. Closing
// the socket, or a text frame that is not a resize, kills the shell's
// tree (the latter closes with 1008 and says why). ?cmd= runs that
// command under /bin/sh -c instead of a login shell, ?shell= another
// shell, ?user= as another user.

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"strconv"
	"time"

	"github.com/coder/websocket"
	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/sandbox"
)

// ptyMessage is a text frame of a terminal's socket.
type ptyMessage struct {
	Resize *edgeapi.PTYSize `json:"resize,omitempty"`
}

// ptyExit is the server's last text frame.
type ptyExit struct {
	ExitCode int    `json:"exit_code"`
	Status   string `json:"status"`
}

// ptyShell is what runs when the request names no shell: bash if the
// sandbox has it, else sh, as a login shell.
var ptyShell = []string{"/bin/sh", "-c", `if [ -x /bin/bash ]; then exec /bin/bash -l; fi; exec /bin/sh -l`}

// ptyWriteWait bounds one write to the client; a client that does not
// read for that long is hung up on (the shell is killed).
const ptyWriteWait = 30 * time.Second

func (s *Server) pty(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	size := edgeapi.PTYSize{Cols: 80, Rows: 24}
	for name, dst := range map[string]*uint16{"cols": &size.Cols, "rows": &size.Rows} {
		if v := q.Get(name); v != "" {
			n, err := strconv.ParseUint(v, 10, 16)
			if err != nil || n == 0 || n > 4096 {
				s.writeError(w, r, badQuery(name, v, "want 1..4096"))
				return
			}
			*dst = uint16(n)
		}
	}
	argv := ptyShell
	if cmd := q.Get("cmd"); cmd != "" {
		argv = []string{"/bin/sh", "-c", cmd}
	} else if sh := q.Get("shell"); sh != "" {
		if err := sandbox.ValidateAbsPath("shell", sh); err != nil {
			s.writeError(w, r, err)
			return
		}
		argv = []string{sh}
	}
	id := r.PathValue("id")
	e, err := s.edgeOf(r.Context(), id)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	// The sandbox must exist for this caller before the upgrade, so that
	// a wrong id is a plain 404.
	if _, err := e.Get(r.Context(), id); err != nil {
		s.writeError(w, r, err)
		return
	}
	c, err := websocket.Accept(w, r, nil)
	if err != nil {
		return // Accept has answered
	}
	c.SetReadLimit(1 << 20)
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	// Ended with its stream: should this apiserver die, the node ends the
	// shell itself (kill, below, needs this process).
	req := edgeapi.ProcessRequest{Argv: argv, PTY: &size, Env: map[string]string{"TERM": "xterm-256color"}, User: q.Get("user"), EndWithStream: true}
	started := make(chan int, 1)
	done := make(chan error, 1)
	var end *edgeapi.ProcessEnd
	go func() {
		done <- e.StartProcess(ctx, id, req, func(ev edgeapi.ProcessEvent) error {
			switch {
			case ev.Start != nil:
				started <- ev.Start.PID
			case ev.End != nil:
				end = ev.End
			case ev.PTY != nil:
				wctx, wcancel := context.WithTimeout(ctx, ptyWriteWait)
				defer wcancel()
				return c.Write(wctx, websocket.MessageBinary, ev.PTY)
			}
			return nil
		})
	}()
	var pid int
	select {
	case pid = <-started:
	case err := <-done:
		if err == nil {
			err = errors.New("the shell ended before it started")
		}
		c.Close(websocket.StatusInternalError, truncateReason(errdefs.Code(err)+": "+err.Error()))
		return
	}
	sel := edgeapi.ProcessSelector{PID: pid}
	// Only the control plane may end the shell once the caller is gone.
	kill := func() {
		kctx, kcancel := context.WithTimeout(context.WithoutCancel(r.Context()), 10*time.Second)
		defer kcancel()
		_ = e.SignalProcess(kctx, id, sel, int(unix.SIGKILL))
	}
	input := make(chan error, 1)
	go func() {
		for {
			typ, b, err := c.Read(ctx)
			if err != nil {
				input <- err
				return
			}
			if typ == websocket.MessageBinary {
				if err := e.ProcessInput(ctx, id, sel, b); err != nil {
					input <- err
					return
				}
				continue
			}
			var m ptyMessage
			if err := json.Unmarshal(b, &m); err != nil || m.Resize == nil {
				input <- errdefs.Invalid(`a text frame must be {"resize": {"cols": N, "rows": N}}`)
				return
			}
			if err := e.ResizeProcess(ctx, id, sel, *m.Resize); err != nil {
				input <- err
				return
			}
		}
	}()
	select {
	case err := <-done:
		if end != nil {
			b, _ := json.Marshal(ptyExit{ExitCode: end.ExitCode, Status: end.Status})
			wctx, wcancel := context.WithTimeout(ctx, 5*time.Second)
			_ = c.Write(wctx, websocket.MessageText, b)
			wcancel()
			c.Close(websocket.StatusNormalClosure, "")
			return
		}
		kill()
		reason := "the terminal's stream ended"
		if err != nil {
			reason = errdefs.Code(err) + ": " + err.Error()
		}
		c.Close(websocket.StatusInternalError, truncateReason(reason))
	case err := <-input:
		kill()
		switch {
		case errdefs.Code(err) == "invalid_argument":
			c.Close(websocket.StatusPolicyViolation, truncateReason(err.Error()))
		case websocket.CloseStatus(err) != -1:
			// The client closed.
		default:
			if ce := errdefs.Code(err); ce != "internal" {
				c.Close(websocket.StatusInternalError, truncateReason(ce+": "+err.Error()))
			}
		}
		cancel()
		<-done
	}
}

// truncateReason fits a close reason in a control frame (123 bytes).
func truncateReason(s string) string {
	if len(s) > 120 {
		return s[:120]
	}
	return s
}
