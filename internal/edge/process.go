package edge

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/proctree"
	"github.com/dsecproject/dsec/internal/pty"
	"github.com/dsecproject/dsec/internal/sandbox"
)

// Processes (edgeapi.ProcessRequest) are commands the edge keeps in a table
// per sandbox while they run, so that callers can attach to their output,
// detach, attach again, send input, resize their terminal and signal
// them. A process's output goes to the streams attached to it at the
// time; with none attached it is dropped (nothing is buffered for later).
// A stream that stops reading holds the process back (its pipe fills, as
// a pipe to a slow reader would), for at most slowReader, after which
// the stream is cut and the process goes on: memory per process is
// bounded by subBuffer events per stream, whatever the clients do.
//
// Processes do not survive an edge restart: their pipes are the edge's.

const (
	// subBuffer is how many output events a stream may lag behind.
	subBuffer = 64
	// slowReader is how long a full stream may hold a process back.
	slowReader = 30 * time.Second
	// maxProcessInput bounds one ProcessInput call.
	maxProcessInput = 1 << 20
	// inputWait bounds how long an input write waits for a process that
	// does not read its stdin.
	inputWait = 5 * time.Second
	// endedRetention is how long an ended process still answers a
	// connect with its end, and endedKept how many of them a sandbox keeps.
	endedRetention = 60 * time.Second
	endedKept      = 64
	// maxProcessTimeoutMS bounds a process's timeout (30 days).
	maxProcessTimeoutMS = 30 * 24 * 3600 * 1000
	// syntheticPidBase numbers processes whose pid could not be read
	// (they ended at once): above any real pid (pid_max is at most 2^22).
	syntheticPidBase = 1 << 22
)

// LogProcessStart is the command log kind of a process start.
const LogProcessStart = "process.start"

// mproc is one process of the table.
type mproc struct {
	info edgeapi.ProcessInfo
	proc sandbox.Proc
	// pidfd is the command's own process (the exec helper's child), for
	// signals that must reach it and not its whole tree; nil if unknown.
	pidfd *os.File
	// inner: info.PID is the pid inside a sandbox of an InnerSignaler
	// backend, through which signals reach the command.
	inner bool
	// stdin is the write end of the process's stdin, tty the terminal's
	// master; nil when it has none (or stdin was closed).
	stdinMu sync.Mutex
	stdin   *os.File
	tty     *os.File

	mu   sync.Mutex
	subs map[*procSub]struct{}
	// done is closed once the process has exited and its output is
	// drained; end is its end then.
	done    chan struct{}
	end     edgeapi.ProcessEnd
	endedAt time.Time
	// killedBy says why the edge killed it ("timeout", "sandbox ended").
	killedBy string
	release  func()
}

// procSub is one stream attached to a process.
type procSub struct {
	ch chan edgeapi.ProcessEvent
	// gone is closed when the stream goes away (detach) or is cut (slow).
	gone     chan struct{}
	goneOnce sync.Once
	cut      bool
}

func (su *procSub) close() { su.goneOnce.Do(func() { close(su.gone) }) }

// subscribe attaches a stream; it reports false once the process has
// ended (its end is then final).
func (m *mproc) subscribe() (*procSub, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	select {
	case <-m.done:
		return nil, false
	default:
	}
	su := &procSub{ch: make(chan edgeapi.ProcessEvent, subBuffer), gone: make(chan struct{})}
	if m.subs == nil {
		m.subs = map[*procSub]struct{}{}
	}
	m.subs[su] = struct{}{}
	return su, true
}

func (m *mproc) unsubscribe(su *procSub) {
	m.mu.Lock()
	delete(m.subs, su)
	m.mu.Unlock()
	su.close()
}

// publish hands an output event to every attached stream, waiting for a
// full one at most slowReader before cutting it.
func (m *mproc) publish(ev edgeapi.ProcessEvent) {
	m.mu.Lock()
	subs := make([]*procSub, 0, len(m.subs))
	for su := range m.subs {
		subs = append(subs, su)
	}
	m.mu.Unlock()
	for _, su := range subs {
		select {
		case su.ch <- ev:
			continue
		case <-su.gone:
			continue
		default:
		}
		t := time.NewTimer(slowReader)
		select {
		case su.ch <- ev:
		case <-su.gone:
		case <-t.C:
			m.mu.Lock()
			delete(m.subs, su)
			su.cut = true
			m.mu.Unlock()
			su.close()
		}
		t.Stop()
	}
}

// procWriter is a process's stdout or stderr.
type procWriter struct {
	m      *mproc
	stderr bool
}

func (w procWriter) Write(p []byte) (int, error) {
	b := slices.Clone(p)
	ev := edgeapi.ProcessEvent{Stdout: b}
	if w.stderr {
		ev = edgeapi.ProcessEvent{Stderr: b}
	}
	w.m.publish(ev)
	return len(p), nil
}

// StartProcess starts a process and streams its events to emit: start
// (with its pid) first, then its output, then its end. If the caller
// goes away (ctx ends) or emit fails, the stream detaches and the
// process goes on; StartProcess then returns ctx's error or emit's.
func (e *Edge) StartProcess(ctx context.Context, id string, req edgeapi.ProcessRequest, emit func(edgeapi.ProcessEvent) error) (err error) {
	if err := validateProcess(&req); err != nil {
		return err
	}
	s, done, err := e.begin(ctx, id)
	if err != nil {
		return err
	}
	defer done()
	start := time.Now()
	m, su, err := e.startProcess(ctx, s, id, req)
	res := api.LogResult{}
	if m != nil {
		pid := m.info.PID
		res.PID = &pid
	}
	e.record(s, LogProcessStart, start, api.LogRequest{Argv: req.Argv, Cwd: req.Cwd, User: req.User, Tag: req.Tag}, res, err)
	if err != nil {
		return err
	}
	err = e.follow(ctx, m, su, emit)
	if req.EndWithStream {
		select {
		case <-m.done:
		default:
			// The stream ended first (its caller gone): so does the
			// process.
			m.kill("its stream ended")
		}
	}
	return err
}

func validateProcess(req *edgeapi.ProcessRequest) error {
	if len(req.Argv) == 0 || req.Argv[0] == "" {
		return errdefs.Invalid("argv must name a command")
	}
	if len(req.Argv) > 4096 {
		return errdefs.Invalid("argv has %d words, at most 4096", len(req.Argv))
	}
	for _, a := range req.Argv {
		if strings.IndexByte(a, 0) >= 0 {
			return errdefs.Invalid("argv holds a NUL byte")
		}
	}
	if req.Cwd != "" {
		// With CwdHome a relative cwd is taken from the user's home.
		if req.CwdHome && !strings.HasPrefix(req.Cwd, "/") {
			if err := sandbox.ValidateAbsPath("cwd", "/"+req.Cwd); err != nil {
				return err
			}
		} else if err := sandbox.ValidateAbsPath("cwd", req.Cwd); err != nil {
			return err
		}
	}
	if req.User != "" {
		if err := sandbox.ValidateUser(req.User); err != nil {
			return err
		}
	}
	if err := sandbox.ValidateEnv(req.Env, 1024); err != nil {
		return err
	}
	if len(req.Tag) > 256 || strings.IndexByte(req.Tag, 0) >= 0 {
		return errdefs.Invalid("tag must be at most 256 bytes, without NUL")
	}
	if req.TimeoutMS < 0 || req.TimeoutMS > maxProcessTimeoutMS {
		return errdefs.Invalid("timeout_ms must be 0 (none) to %d (30 days)", maxProcessTimeoutMS)
	}
	if p := req.PTY; p != nil {
		if p.Cols == 0 || p.Rows == 0 || p.Cols > 4096 || p.Rows > 4096 {
			return errdefs.Invalid("terminal size %dx%d: columns and rows must be 1..4096", p.Cols, p.Rows)
		}
	}
	return nil
}

// startProcess starts req in sandbox s with a stream attached (so no
// output is missed) and enters it in the table.
func (e *Edge) startProcess(ctx context.Context, s *sbx, id string, req edgeapi.ProcessRequest) (*mproc, *procSub, error) {
	s.mu.Lock()
	if len(s.sessions)+s.opening+s.liveProcs() >= e.cfg.MaxSessions {
		s.mu.Unlock()
		return nil, nil, errdefs.Exhausted("sandbox %s already has %d sessions and processes, its limit", id, e.cfg.MaxSessions)
	}
	s.opening++
	s.mu.Unlock()
	release, ok := e.sessions.take()
	entered := false
	defer func() {
		s.mu.Lock()
		s.opening--
		s.mu.Unlock()
		if !entered && ok {
			release()
		}
	}()
	if !ok {
		return nil, nil, e.sessionsFull()
	}
	p, err := e.process(s, req.User, req.Cwd, req.Env)
	if err != nil {
		return nil, nil, err
	}
	p.Args = req.Argv
	if req.CwdHome && (req.Cwd == "" || !strings.HasPrefix(req.Cwd, "/")) {
		home := "/"
		if p.User != "" {
			// The backend resolves the user inside the sandbox: it
			// knows the home (sandbox.Process.Cwd's "~").
			home = "~"
		}
		for _, kv := range p.Env {
			if h, ok := strings.CutPrefix(kv, "HOME="); ok && strings.HasPrefix(h, "/") {
				home = h
			}
		}
		p.Cwd = filepath.Join(home, req.Cwd)
	}
	m := &mproc{done: make(chan struct{}), release: release,
		info: edgeapi.ProcessInfo{Tag: req.Tag, Argv: req.Argv, Env: req.Env, Cwd: p.Cwd, PTY: req.PTY != nil, StartedAt: time.Now().UTC()}}
	su, _ := m.subscribe()
	var closeAfter []*os.File
	defer func() {
		for _, f := range closeAfter {
			f.Close()
		}
	}()
	switch {
	case req.PTY != nil:
		master, slave, err := pty.Open("/dev/ptmx", req.PTY.Rows, req.PTY.Cols)
		if err != nil {
			return nil, nil, err
		}
		m.tty = master
		closeAfter = append(closeAfter, slave)
		p.Stdin, p.Stdout, p.Stderr, p.TTY = slave, slave, slave, true
	default:
		if req.Stdin {
			r, w, err := os.Pipe()
			if err != nil {
				return nil, nil, fmt.Errorf("creating stdin pipe: %w", err)
			}
			m.stdin = w
			closeAfter = append(closeAfter, r)
			p.Stdin = r
		}
		p.Stdout, p.Stderr = procWriter{m: m}, procWriter{m: m, stderr: true}
	}
	proc, err := e.backendOf(s).Exec(ctx, id, p)
	if err != nil {
		if m.tty != nil {
			m.tty.Close()
		}
		if m.stdin != nil {
			m.stdin.Close()
		}
		return nil, nil, fmt.Errorf("starting process: %w", err)
	}
	m.proc = proc
	hostPid, nsPid := commandPids(proc.Pid())
	if ip, ok := proc.(sandbox.InnerProc); ok {
		nsPid = ip.InnerPid() // a kernel of the backend's own: no host pid
		m.inner = nsPid > 0
	}
	if hostPid > 0 {
		if fd, err := unix.PidfdOpen(hostPid, 0); err == nil {
			m.pidfd = os.NewFile(uintptr(fd), "pidfd")
		}
	}
	s.mu.Lock()
	if nsPid <= 0 {
		s.procSeq++
		nsPid = syntheticPidBase + s.procSeq
	}
	m.info.PID = nsPid
	if s.procs == nil {
		s.procs = map[int]*mproc{}
	}
	s.procs[nsPid] = m
	s.pruneProcsLocked()
	s.mu.Unlock()
	entered = true
	var timer *time.Timer
	if req.TimeoutMS > 0 {
		timer = time.AfterFunc(time.Duration(req.TimeoutMS)*time.Millisecond, func() { m.kill("timeout") })
	}
	go e.reap(m, timer)
	return m, su, nil
}

// commandPids finds the command an exec helper (host pid helper) started:
// its host pid and its pid inside the sandbox (0, 0 if it is gone).
func commandPids(helper int) (host, ns int) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(helper) + "/task/" + strconv.Itoa(helper) + "/children")
	if err != nil {
		return 0, 0
	}
	f := strings.Fields(string(b))
	if len(f) != 1 {
		return 0, 0
	}
	host, err = strconv.Atoi(f[0])
	if err != nil {
		return 0, 0
	}
	ns, ok := proctree.NSPid(host)
	if !ok {
		return 0, 0
	}
	return host, ns
}

// reap waits for the process, drains its output and ends its streams.
func (e *Edge) reap(m *mproc, timer *time.Timer) {
	drained := make(chan struct{})
	if m.tty != nil {
		go func() {
			defer close(drained)
			buf := make([]byte, 32<<10)
			for {
				n, err := m.tty.Read(buf)
				if n > 0 {
					m.publish(edgeapi.ProcessEvent{PTY: slices.Clone(buf[:n])})
				}
				if err != nil {
					// EIO once no process holds the terminal.
					return
				}
			}
		}()
	} else {
		close(drained)
	}
	code, err := m.proc.Wait()
	if timer != nil {
		timer.Stop()
	}
	if m.tty != nil {
		// What the process wrote before it exited is read; a background
		// process still holding the terminal loses it (and gets SIGHUP)
		// when the master closes.
		select {
		case <-drained:
		case <-time.After(200 * time.Millisecond):
		}
		m.stdinMu.Lock()
		m.tty.Close()
		m.stdinMu.Unlock()
		<-drained
	}
	m.stdinMu.Lock()
	if m.stdin != nil {
		m.stdin.Close()
		m.stdin = nil
	}
	m.stdinMu.Unlock()
	if m.pidfd != nil {
		m.pidfd.Close()
	}
	end := edgeapi.ProcessEnd{ExitCode: code, Exited: code < 128, Status: "exit status " + strconv.Itoa(code)}
	if code >= 128 {
		end.Status = "signal: " + unix.SignalName(syscall.Signal(code-128))
	}
	m.mu.Lock()
	if m.killedBy != "" {
		end.Exited = false
		end.Status = "killed: " + m.killedBy
	}
	if err != nil {
		end.Error = err.Error()
	}
	m.end, m.endedAt = end, time.Now()
	subs := m.subs
	m.subs = nil
	close(m.done)
	m.mu.Unlock()
	for su := range subs {
		close(su.ch)
	}
	m.release()
}

// kill kills the process's tree, saying why.
func (m *mproc) kill(why string) {
	m.mu.Lock()
	if m.killedBy == "" {
		m.killedBy = why
	}
	m.mu.Unlock()
	_ = m.proc.Kill()
}

// follow streams m's events to emit until it ends or the caller goes.
func (e *Edge) follow(ctx context.Context, m *mproc, su *procSub, emit func(edgeapi.ProcessEvent) error) error {
	if err := emit(edgeapi.ProcessEvent{Start: &edgeapi.ProcessStarted{PID: m.info.PID}}); err != nil {
		if su != nil {
			m.unsubscribe(su)
		}
		return err
	}
	if su == nil {
		// It had ended already.
		<-m.done
		end := m.end
		return emit(edgeapi.ProcessEvent{End: &end})
	}
	defer m.unsubscribe(su)
	for {
		select {
		case ev, ok := <-su.ch:
			if !ok {
				end := m.end
				return emit(edgeapi.ProcessEvent{End: &end})
			}
			if err := emit(ev); err != nil {
				return err
			}
		case <-su.gone:
			if su.cut {
				return errdefs.Exhausted("the stream was cut: it did not read the process's output for %v", slowReader)
			}
			return ctx.Err()
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// ConnectProcess attaches a stream to a running process (or, within
// endedRetention of its end, to an ended one): start, then its output
// from now on, then its end.
func (e *Edge) ConnectProcess(ctx context.Context, id string, sel edgeapi.ProcessSelector, emit func(edgeapi.ProcessEvent) error) error {
	s, done, err := e.begin(ctx, id)
	if err != nil {
		return err
	}
	defer done()
	m, err := s.findProc(id, sel, true)
	if err != nil {
		return err
	}
	su, _ := m.subscribe()
	return e.follow(ctx, m, su, emit)
}

// ListProcesses lists the sandbox's running processes by pid.
func (e *Edge) ListProcesses(ctx context.Context, id string) ([]edgeapi.ProcessInfo, error) {
	s, done, err := e.beginNoWake(ctx, id)
	if err != nil {
		return nil, err
	}
	defer done()
	s.mu.Lock()
	defer s.mu.Unlock()
	out := []edgeapi.ProcessInfo{}
	for _, m := range s.procs {
		select {
		case <-m.done:
			continue
		default:
		}
		out = append(out, m.info)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].PID < out[j].PID })
	return out, nil
}

// ProcessInput writes to a process's terminal or stdin.
func (e *Edge) ProcessInput(ctx context.Context, id string, sel edgeapi.ProcessSelector, data []byte) error {
	if len(data) > maxProcessInput {
		return errdefs.Invalid("input of %d bytes: at most %d per call", len(data), maxProcessInput)
	}
	return e.onProc(ctx, id, sel, true, func(m *mproc) error {
		m.stdinMu.Lock()
		defer m.stdinMu.Unlock()
		w := m.tty
		if w == nil {
			w = m.stdin
		}
		if w == nil {
			return errdefs.Precondition("process %d takes no input (started without stdin, or its stdin was closed)", m.info.PID)
		}
		_ = w.SetWriteDeadline(time.Now().Add(inputWait))
		_, err := w.Write(data)
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return errdefs.Exhausted("process %d did not read its input for %v", m.info.PID, inputWait)
		}
		if err != nil {
			return errdefs.Precondition("process %d: writing input: %v", m.info.PID, err)
		}
		return nil
	})
}

// CloseProcessStdin closes a process's stdin (EOF); on a terminal it
// sends the end-of-file character instead.
func (e *Edge) CloseProcessStdin(ctx context.Context, id string, sel edgeapi.ProcessSelector) error {
	return e.onProc(ctx, id, sel, true, func(m *mproc) error {
		m.stdinMu.Lock()
		defer m.stdinMu.Unlock()
		if m.tty != nil {
			_ = m.tty.SetWriteDeadline(time.Now().Add(inputWait))
			_, err := m.tty.Write([]byte{4})
			return err
		}
		if m.stdin != nil {
			err := m.stdin.Close()
			m.stdin = nil
			return err
		}
		return nil
	})
}

// signals a caller may send, by number.
var processSignals = map[int]bool{
	int(unix.SIGHUP): true, int(unix.SIGINT): true, int(unix.SIGQUIT): true, int(unix.SIGKILL): true,
	int(unix.SIGUSR1): true, int(unix.SIGUSR2): true, int(unix.SIGTERM): true, int(unix.SIGCONT): true,
	int(unix.SIGSTOP): true, int(unix.SIGWINCH): true,
}

// SignalProcess sends a signal to a process. SIGKILL kills its whole
// tree (what it started that is still its descendant), as a killed exec
// does; other signals go to the process alone.
func (e *Edge) SignalProcess(ctx context.Context, id string, sel edgeapi.ProcessSelector, sig int) error {
	if !processSignals[sig] {
		return errdefs.Invalid("signal %d is not one a process may be sent (HUP, INT, QUIT, KILL, USR1, USR2, TERM, CONT, STOP, WINCH)", sig)
	}
	return e.onProc(ctx, id, sel, true, func(m *mproc) error {
		if sig == int(unix.SIGKILL) {
			m.kill("signal")
			return nil
		}
		if in, ok := e.backendByID(id).(sandbox.InnerSignaler); ok && m.inner {
			return in.Signal(ctx, id, m.info.PID, syscall.Signal(sig), true, false)
		}
		if m.pidfd == nil {
			return errdefs.Precondition("process %d cannot be signalled", m.info.PID)
		}
		rc, err := m.pidfd.SyscallConn()
		if err != nil {
			return err
		}
		var serr error
		if err := rc.Control(func(fd uintptr) { serr = unix.PidfdSendSignal(int(fd), syscall.Signal(sig), nil, 0) }); err != nil {
			return err
		}
		if errors.Is(serr, unix.ESRCH) {
			return errdefs.NotFound("process %d has ended", m.info.PID)
		}
		return serr
	})
}

// ResizeProcess sets the size of a process's terminal.
func (e *Edge) ResizeProcess(ctx context.Context, id string, sel edgeapi.ProcessSelector, size edgeapi.PTYSize) error {
	if size.Cols == 0 || size.Rows == 0 || size.Cols > 4096 || size.Rows > 4096 {
		return errdefs.Invalid("terminal size %dx%d: columns and rows must be 1..4096", size.Cols, size.Rows)
	}
	return e.onProc(ctx, id, sel, false, func(m *mproc) error {
		m.stdinMu.Lock()
		defer m.stdinMu.Unlock()
		if m.tty == nil {
			return errdefs.Precondition("process %d has no terminal", m.info.PID)
		}
		if err := pty.SetSize(m.tty, size.Rows, size.Cols); err != nil {
			return err
		}
		if r, ok := m.proc.(sandbox.Resizer); ok {
			return r.Resize(ctx, size.Rows, size.Cols)
		}
		return nil
	})
}

// onProc runs fn on a running process of sandbox id, as an operation on
// the sandbox (wake: a paused sandbox is resumed first).
func (e *Edge) onProc(ctx context.Context, id string, sel edgeapi.ProcessSelector, wake bool, fn func(m *mproc) error) error {
	s, done, err := e.admit(ctx, id, wake)
	if err != nil {
		return err
	}
	defer done()
	m, err := s.findProc(id, sel, false)
	if err != nil {
		return err
	}
	return fn(m)
}

// findProc finds a process by pid or tag; ended ones only if ended.
func (s *sbx) findProc(id string, sel edgeapi.ProcessSelector, ended bool) (*mproc, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var m *mproc
	switch {
	case sel.PID > 0:
		m = s.procs[sel.PID]
	case sel.Tag != "":
		for _, c := range s.procs {
			if c.info.Tag != sel.Tag {
				continue
			}
			// A running one wins over an ended one of the same tag.
			if m == nil || !isDone(c) {
				m = c
			}
		}
	default:
		return nil, errdefs.Invalid("name a process by pid or tag")
	}
	if m == nil || isDone(m) && (!ended || time.Since(m.endedAt) > endedRetention) {
		what := "pid " + strconv.Itoa(sel.PID)
		if sel.PID <= 0 {
			what = "tag " + strconv.Quote(sel.Tag)
		}
		return nil, errdefs.NotFound("no running process with %s in sandbox %s", what, id)
	}
	return m, nil
}

func isDone(m *mproc) bool {
	select {
	case <-m.done:
		return true
	default:
		return false
	}
}

// liveProcs counts the sandbox's running processes.
// Preconditions: s.mu held.
func (s *sbx) liveProcs() int {
	n := 0
	for _, m := range s.procs {
		if !isDone(m) {
			n++
		}
	}
	return n
}

// pruneProcsLocked forgets ended processes past their retention, and the
// oldest ended ones past endedKept.
// Preconditions: s.mu held.
func (s *sbx) pruneProcsLocked() {
	var ended []int
	for pid, m := range s.procs {
		if !isDone(m) {
			continue
		}
		if time.Since(m.endedAt) > endedRetention {
			delete(s.procs, pid)
			continue
		}
		ended = append(ended, pid)
	}
	if len(ended) <= endedKept {
		return
	}
	sort.Slice(ended, func(i, j int) bool { return s.procs[ended[i]].endedAt.Before(s.procs[ended[j]].endedAt) })
	for _, pid := range ended[:len(ended)-endedKept] {
		delete(s.procs, pid)
	}
}

// killProcs kills every process of a sandbox that is going away and
// waits (boundedly) for their ends.
func (s *sbx) killProcs() {
	s.mu.Lock()
	ps := s.procs
	s.procs = nil
	s.mu.Unlock()
	for _, m := range ps {
		if !isDone(m) {
			m.kill("sandbox ended")
		}
	}
	deadline := time.After(5 * time.Second)
	for _, m := range ps {
		select {
		case <-m.done:
		case <-deadline:
			return
		}
	}
}

var _ io.Writer = procWriter{}
