package edge

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"path"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/proctree"
	"github.com/dsecproject/dsec/internal/sandbox"
)

// A session is a long-lived shell inside the sandbox, fed commands on its
// stdin by the edge. Each run is wrapped so the shell prints a marker with
// a per-run random nonce and the exit status on both streams when the
// command ends; the edge splits output at the markers. Commands run with
// `command eval` in the shell itself, so cwd, variables and functions
// persist and a syntax error does not end a POSIX shell, and with stdin
// from /dev/null, so a command cannot swallow the next one.
type session struct {
	id    string
	proc  sandbox.Proc
	stdin *os.File
	out   *markerCapture
	err   *markerCapture

	// exited is closed when the shell exits; code is its status after.
	exited chan struct{}
	code   int
	// kill kills what the shell started, and the shell itself with
	// self; usr1 sends the shell SIGUSR1. Both are set at start, once the
	// shell is found: by host pid, or by its pid inside through a backend
	// whose processes have no host pids (sandbox.InnerSignaler).
	kill func(self bool)
	usr1 func()
	// bash sessions survive a timeout (see bashSetup); others end.
	bash bool
	// release gives back the session's node-wide slot (slots.go).
	release func()

	runMu sync.Mutex // one run at a time
}

// markerCapture collects one stream of a session and finds the end marker.
type markerCapture struct {
	mu        sync.Mutex
	prefix    []byte // marker prefix of the current run; nil between runs
	win       []byte // bytes not yet committed (may hold a partial marker)
	buf       []byte
	max       int64
	truncated bool
	done      bool
	code      int
	notify    chan struct{}
}

func newCapture() *markerCapture { return &markerCapture{notify: make(chan struct{}, 1)} }

// maxWindow bounds the uncommitted bytes kept while looking for a marker.
const maxWindow = 64 << 10

func (c *markerCapture) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.prefix == nil || c.done {
		// Output between runs (background jobs): not part of any result.
		return len(p), nil
	}
	c.win = append(c.win, p...)
	if i := bytes.Index(c.win, c.prefix); i >= 0 {
		rest := c.win[i+len(c.prefix):]
		if j := bytes.Index(rest, []byte("\x1e\n")); j >= 0 {
			c.commit(c.win[:i])
			c.code, _ = strconv.Atoi(string(rest[:j]))
			c.done = true
			c.win = nil
			c.signal()
			return len(p), nil
		}
		if len(c.win) > maxWindow {
			c.commit(c.win[:i])
			c.win = append([]byte(nil), c.win[i:]...)
		}
		return len(p), nil
	}
	if keep := len(c.prefix) - 1; len(c.win) > keep {
		c.commit(c.win[:len(c.win)-keep])
		c.win = append([]byte(nil), c.win[len(c.win)-keep:]...)
	}
	return len(p), nil
}

// commit appends to the result within the cap.
// Preconditions: c.mu held.
func (c *markerCapture) commit(b []byte) {
	room := c.max - int64(len(c.buf))
	if int64(len(b)) > room {
		if room > 0 {
			c.buf = appendCapped(c.buf, b[:room], c.max)
		}
		c.truncated = true
		return
	}
	c.buf = appendCapped(c.buf, b, c.max)
}

func (c *markerCapture) signal() {
	select {
	case c.notify <- struct{}{}:
	default:
	}
}

func (c *markerCapture) arm(prefix []byte, max int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.prefix, c.win, c.buf, c.max, c.truncated, c.done, c.code = prefix, nil, nil, max, false, false, 0
	select {
	case <-c.notify:
	default:
	}
}

func (c *markerCapture) result() (buf []byte, truncated, done bool, code int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	b := c.buf
	if !c.done {
		// The run did not finish: what is in the window is output too.
		c.commit(c.win)
		b = c.buf
	}
	// The result owns the bytes now (its text aliases them): the capture
	// keeps no reference, so they go with the result.
	c.prefix, c.buf, c.win = nil, nil, nil
	return b, c.truncated, c.done, c.code
}

func nonce() string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// shellQuote quotes s for POSIX sh as one single-quoted word.
func shellQuote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// bashSetup prepares a bash session so that a timed-out command can be
// aborted without killing the shell: SIGUSR1 sets an abort flag, and a
// DEBUG trap (with extdebug, inherited into functions by set -T) skips every
// further command while it is set, except the session's own __dsec_ ones.
// The edge sends SIGUSR1 and then kills the command's processes, so the
// rest of the command line does not run and the shell stays usable.
const bashSetup = `__dsec_abort=0
trap '__dsec_abort=1' USR1
shopt -s extdebug
set -T
trap '[[ $__dsec_abort = 0 || $BASH_COMMAND == __dsec_* ]]' DEBUG
__dsec_end() { __dsec_abort=0; printf '\036DSEC:%s:%d\036\n' "$1" "$2"; printf '\036DSEC:%s:%d\036\n' "$1" "$2" >&2; }
`

// runScript wraps a command for the session's shell.
func runScript(cmd, n string, bash bool) string {
	if bash {
		return "command eval " + shellQuote(cmd) + " </dev/null\n__dsec_end " + n + " $?\n"
	}
	return "command eval " + shellQuote(cmd) + " </dev/null\n" +
		"__dsec_rc=$?\n" +
		"printf '\\036DSEC:%s:%d\\036\\n' " + n + " \"$__dsec_rc\"\n" +
		"printf '\\036DSEC:%s:%d\\036\\n' " + n + " \"$__dsec_rc\" >&2\n"
}

func markerPrefix(n string) []byte { return []byte("\x1eDSEC:" + n + ":") }

// OpenSession starts a shell in the sandbox. The call goes in the command
// log.
func (e *Edge) OpenSession(ctx context.Context, id string, req api.SessionRequest) (out *api.Session, err error) {
	s, done, err := e.begin(ctx, id)
	if err != nil {
		return nil, err
	}
	defer done()
	start := time.Now()
	defer func() {
		var res api.LogResult
		if out != nil {
			res.SessionID = out.SessionID
		}
		e.record(s, api.LogSessionOpen, start, api.LogRequest{Shell: req.Shell, Cwd: req.Cwd, User: req.User}, res, err)
	}()
	if req.Shell != "" {
		if err := sandbox.ValidateAbsPath("shell", req.Shell); err != nil {
			return nil, err
		}
	}
	if req.Cwd != "" {
		if err := sandbox.ValidateAbsPath("cwd", req.Cwd); err != nil {
			return nil, err
		}
	}
	if req.User != "" {
		if err := sandbox.ValidateUser(req.User); err != nil {
			return nil, err
		}
	}
	if err := sandbox.ValidateEnv(req.Env, 1024); err != nil {
		return nil, err
	}
	// Through the files API's view: a VM's files are its agent's to look at.
	fs, err := e.filesOf(ctx, s)
	if err != nil {
		return nil, err
	}
	shell := req.Shell
	if shell == "" {
		shell = "/bin/sh"
		if _, err := fs.Stat(ctx, "/bin/bash"); err == nil {
			shell = "/bin/bash"
		}
	} else if !e.isPinnedShell(e.backendOf(s), shell) {
		if _, err := fs.Stat(ctx, shell); err != nil {
			return nil, errdefs.Invalid("shell %s does not exist in the sandbox", shell)
		}
	}
	s.mu.Lock()
	if len(s.sessions)+s.opening >= e.cfg.MaxSessions {
		s.mu.Unlock()
		return nil, errdefs.Exhausted("sandbox %s already has %d sessions", id, e.cfg.MaxSessions)
	}
	// The open counts against both limits from here, before its shell
	// starts: a burst of opens cannot pass them together.
	s.opening++
	s.mu.Unlock()
	release, ok := e.sessions.take()
	opened := false
	defer func() {
		if opened {
			return
		}
		s.mu.Lock()
		s.opening--
		s.mu.Unlock()
		if ok {
			release()
		}
	}()
	if !ok {
		return nil, e.sessionsFull()
	}

	p, err := e.process(s, req.User, req.Cwd, req.Env)
	if err != nil {
		return nil, err
	}
	p.Args = []string{shell}
	r, w, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("creating session pipe: %w", err)
	}
	se := &session{id: "ss-" + nonce()[:16], stdin: w, out: newCapture(), err: newCapture(),
		exited: make(chan struct{}), bash: strings.Contains(path.Base(shell), "bash"), release: release}
	p.Stdin, p.Stdout, p.Stderr = r, se.out, se.err
	proc, err := e.backendOf(s).Exec(ctx, id, p)
	r.Close()
	if err != nil {
		w.Close()
		return nil, fmt.Errorf("starting session shell: %w", err)
	}
	se.proc = proc
	go func() {
		se.code, _ = proc.Wait()
		close(se.exited)
		se.out.signal()
		se.err.signal()
	}()
	// Learn the shell's pid (inside the sandbox, then on the host) so a
	// timed-out command can be killed without killing the shell.
	probe := "echo $$"
	if se.bash {
		if _, err := se.stdin.Write([]byte(bashSetup)); err != nil {
			se.close()
			return nil, fmt.Errorf("starting session shell: %w", err)
		}
	}
	res, err := se.run(ctx, probe, 10*time.Second, 64)
	if err == nil && res.ExitCode == 0 {
		if nsPid, perr := strconv.Atoi(strings.TrimSpace(res.Stdout)); perr == nil {
			se.findShell(e.backendOf(s), id, proc, nsPid)
		}
	}
	if se.kill == nil {
		se.close()
		msg := ""
		if res != nil {
			msg = strings.TrimSpace(res.Stderr)
		}
		return nil, fmt.Errorf("starting session shell %s: shell did not answer (%v) %s", shell, err, msg)
	}
	s.mu.Lock()
	if s.sessions == nil {
		s.sessions = map[string]*session{}
	}
	s.sessions[se.id] = se
	s.opening--
	opened = true
	s.mu.Unlock()
	return &api.Session{SessionID: se.id}, nil
}

// findShell sets se.kill and se.usr1 for the shell whose pid inside the
// sandbox is nsPid, or leaves them nil if it cannot be found.
func (se *session) findShell(be sandbox.Backend, id string, proc sandbox.Proc, nsPid int) {
	if in, ok := be.(sandbox.InnerSignaler); ok {
		// The backend's pid for the shell, where it has one: in a gvisor
		// sandbox it counts in the Sentry's root pid namespace, not in
		// the sandbox's, where $$ counts.
		if ip, ok := proc.(sandbox.InnerProc); ok {
			if pid := ip.InnerPid(); pid > 0 {
				nsPid = pid
			}
		}
		ctx := context.Background()
		se.kill = func(self bool) { _ = in.Signal(ctx, id, nsPid, unix.SIGKILL, self, true) }
		se.usr1 = func() { _ = in.Signal(ctx, id, nsPid, unix.SIGUSR1, true, false) }
		return
	}
	host, _ := proctree.FindByNSPid(proc.Pid(), nsPid)
	if host == 0 {
		return
	}
	se.kill = func(self bool) { proctree.Kill(host, self) }
	se.usr1 = func() { _ = unix.Kill(host, unix.SIGUSR1) }
}

// isPinnedShell reports whether shell is the backend's read-only shell,
// which lives in the sandbox's /dev, not in its root filesystem.
func (e *Edge) isPinnedShell(be sandbox.Backend, shell string) bool {
	p, ok := be.(sandbox.Pinner)
	return ok && p.PinnedShell() != "" && shell == p.PinnedShell()
}

// RunInSession runs one command in a session's shell. The call goes in the
// command log.
func (e *Edge) RunInSession(ctx context.Context, id, sid string, req api.SessionRunRequest) (res *api.ExecResult, err error) {
	if err := sandbox.NormalizeRun(&req); err != nil {
		return nil, err
	}
	s, done, err := e.begin(ctx, id)
	if err != nil {
		return nil, err
	}
	defer done()
	start := time.Now()
	ended := false
	defer func() {
		e.record(s, api.LogSessionRun, start, api.LogRequest{SessionID: sid, Command: req.Command, Timeout: req.Timeout},
			sessionRunLog(res, ended), err)
	}()
	s.mu.Lock()
	se := s.sessions[sid]
	s.mu.Unlock()
	if se == nil {
		return nil, errdefs.NotFound("session %s not found in sandbox %s", sid, id)
	}
	release, err := e.output.take(2 * req.MaxOutputBytes)
	if err != nil {
		return nil, err
	}
	defer release()
	res, err = se.run(ctx, req.Command, time.Duration(req.Timeout)*time.Second, req.MaxOutputBytes)
	if err != nil {
		return nil, err
	}
	select {
	case <-se.exited:
		// The command ended the shell (exit, exec): the session is over.
		s.mu.Lock()
		delete(s.sessions, sid)
		s.mu.Unlock()
		se.close()
		ended = true
	default:
	}
	e.metrics.execSeconds.Observe(time.Since(start).Seconds())
	return res, nil
}

// CloseSession kills a session's shell and everything it started. A close
// goes in the command log; closing an unknown session does not.
func (e *Edge) CloseSession(ctx context.Context, id, sid string) error {
	s, err := e.get(ctx, id)
	if err != nil {
		return err
	}
	s.mu.Lock()
	se := s.sessions[sid]
	delete(s.sessions, sid)
	s.mu.Unlock()
	if se == nil {
		return errdefs.NotFound("session %s not found in sandbox %s", sid, id)
	}
	start := time.Now()
	se.close()
	e.record(s, api.LogSessionClose, start, api.LogRequest{SessionID: sid}, api.LogResult{}, nil)
	return nil
}

func (se *session) close() {
	// Kill before closing stdin: on EOF the shell exits at once, its
	// background jobs are reparented to the sandbox's init and the tree
	// walk no longer finds them.
	_ = se.proc.Kill()
	_ = se.stdin.Close()
	select {
	case <-se.exited:
	case <-time.After(5 * time.Second):
	}
	se.release()
}

// run sends one command and waits for its markers.
func (se *session) run(ctx context.Context, cmd string, timeout time.Duration, maxOut int64) (*api.ExecResult, error) {
	se.runMu.Lock()
	defer se.runMu.Unlock()
	select {
	case <-se.exited:
		return nil, errdefs.Precondition("session %s has ended", se.id)
	default:
	}
	start := time.Now()
	n := nonce()
	se.out.arm(markerPrefix(n), maxOut)
	se.err.arm(markerPrefix(n), maxOut)
	script := runScript(cmd, n, se.bash)
	wrote := make(chan error, 1)
	go func() {
		_, err := se.stdin.Write([]byte(script))
		wrote <- err
	}()
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	timedOut := false
	finished := func() bool {
		_, _, d1, _ := se.peek(se.out)
		_, _, d2, _ := se.peek(se.err)
		return d1 && d2
	}
wait:
	for !finished() {
		select {
		case <-se.out.notify:
		case <-se.err.notify:
		case <-se.exited:
			// Give the pipes a moment to drain.
			time.Sleep(20 * time.Millisecond)
			break wait
		case err := <-wrote:
			if err != nil {
				break wait
			}
			wrote = nil
		case <-timer.C:
			timedOut = true
			break wait
		case <-ctx.Done():
			timedOut = true
			break wait
		}
	}
	if timedOut && se.kill != nil && !se.bash {
		// Other shells cannot abort the rest of a command line: the session
		// ends rather than run what followed the timed-out command.
		se.kill(true)
		_ = se.stdin.Close()
		select {
		case <-se.exited:
		case <-time.After(5 * time.Second):
		}
	}
	if timedOut && se.kill != nil && se.bash {
		// Flag the abort, then kill what the command started but keep the
		// shell: it skips the rest of the command, prints the markers and
		// the session stays usable.
		se.usr1()
		se.kill(false)
		grace := time.After(5 * time.Second)
	drain:
		for !finished() {
			select {
			case <-se.out.notify:
			case <-se.err.notify:
			case <-se.exited:
				break drain
			case <-grace:
				break drain
			}
		}
	}
	ob, ot, od, code := se.out.result()
	eb, et, ed, _ := se.err.result()
	res := &api.ExecResult{ExitCode: code, Truncated: ot || et, DurationMS: time.Since(start).Milliseconds()}
	res.Stdout, res.StdoutB64 = textFields(ob)
	res.Stderr, res.StderrB64 = textFields(eb)
	switch {
	case timedOut:
		res.TimedOut, res.ExitCode = true, 124
	case !od || !ed:
		// The shell exited during the command (exit, exec, killed).
		res.ExitCode = -1
		select {
		case <-se.exited:
			res.ExitCode = se.code
		default:
		}
	}
	return res, nil
}

func (se *session) peek(c *markerCapture) ([]byte, bool, bool, int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return nil, c.truncated, c.done, c.code
}
