package agent

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/files"
	"github.com/dsecproject/dsec/internal/pty"
)

// Server is the agent's state across connections: the sandbox once set
// up, and the processes it runs.
type Server struct {
	reaper *reaper

	mu sync.Mutex
	// root is the sandbox's root ("" until setup: the agent's own).
	root string
	// cgroupFD is the sandbox's cgroup in the guest (-1: none).
	cgroupFD int
	// files serves the files API on root (nil until setup).
	files *files.Root
	// upper is the overlay's writable layer (nil until setup), on the
	// filesystem mounted at upperFS, which a snapshot freezes ("": none
	// to freeze, as in tests).
	upper   *files.Root
	upperFS string
	procs   map[uint64]*proc
	// spawner starts the sandbox's commands in its namespaces (nil until
	// setup: the agent's own, as in tests); filter is the seccomp filter
	// they run under (Setup.Seccomp, base64; "": none).
	spawner *spawner
	filter  string
	// masks are the paths of /proc and /sys hidden and read-only
	// (contain_linux.go's masks, JSON).
	masks string
}

// NewServer returns a server that starts reaping its children (as the
// guest's init it reaps every orphan too).
func NewServer() *Server {
	reaperOnce.Do(func() {
		theReaper = newReaper()
		go theReaper.loop()
	})
	return &Server{reaper: theReaper, cgroupFD: -1, procs: map[uint64]*proc{}}
}

// theReaper is the process's one reaper: it waits for any child, so two
// would take each other's.
var (
	reaperOnce sync.Once
	theReaper  *reaper
)

// conn is one connection's writer: Msgs from every goroutine, one at a
// time.
type conn struct {
	mu  sync.Mutex
	enc *json.Encoder
	err error

	// wmu guards watches, the directory watches this connection
	// started, and windows, the host's credit for each request's data
	// (Msg.Window), by request id; both end with the connection.
	wmu     sync.Mutex
	watches map[uint64]*watch
	windows map[uint64]*window
}

func (c *conn) send(m Msg) {
	if m.Op == "exit" || m.Op == "error" && m.ID != 0 {
		// The request's data went before: its window is done.
		c.wmu.Lock()
		w := c.windows[m.ID]
		delete(c.windows, m.ID)
		c.wmu.Unlock()
		if w != nil {
			w.close()
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err == nil {
		c.err = c.enc.Encode(m)
	}
}

// sendData sends a chunk of request id's output (op stdout or stderr),
// once the host has room for it if the request has a window; false if
// the host cancelled the request (the chunk is not sent).
func (c *conn) sendData(id uint64, op string, data []byte) bool {
	c.wmu.Lock()
	w := c.windows[id]
	c.wmu.Unlock()
	if w != nil && !w.take(int64(len(data))) {
		return false
	}
	c.send(Msg{ID: id, Op: op, Data: data})
	return true
}

// window is the host's credit for one request's data: at most size
// bytes sent and not yet acked. Acks are cumulative (the bytes the host
// has written out in all), so one lost with a connection (a VM saved
// and resumed) is made good by the next. A chunk goes out while the
// window has any room (it may overdraw by one chunk, so a window smaller
// than a chunk still moves).
type window struct {
	mu                sync.Mutex
	size, sent, acked int64
	// cancelled: the host gave up on the request (a "kill" of an fs
	// request): its data is no longer sent.
	closed, cancelled bool
	wake              chan struct{}
	ended             chan struct{} // closed by close: every waiter goes
}

func newWindow(n int64) *window {
	return &window{size: n, wake: make(chan struct{}, 1), ended: make(chan struct{})}
}

// take waits for room (or the window's end) and counts n sent; false if
// the request was cancelled.
func (w *window) take(n int64) bool {
	for {
		w.mu.Lock()
		if w.closed || w.sent-w.acked < w.size {
			w.sent += n
			ok := !w.cancelled
			w.mu.Unlock()
			return ok
		}
		w.mu.Unlock()
		select {
		case <-w.wake:
		case <-w.ended:
		}
	}
}

// cancel ends the request's data.
func (w *window) cancel() {
	w.mu.Lock()
	w.cancelled = true
	w.mu.Unlock()
	w.close()
}

// give records that the host has written out total bytes in all.
func (w *window) give(total int64) {
	w.mu.Lock()
	if total > w.acked {
		w.acked = total
	}
	w.mu.Unlock()
	w.signal()
}

// close ends the waiting for good (the request ended, or the connection).
func (w *window) close() {
	w.mu.Lock()
	if !w.closed {
		w.closed = true
		close(w.ended)
	}
	w.mu.Unlock()
}

func (w *window) signal() {
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

// failed reports whether a write to the host failed.
func (c *conn) failed() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err != nil
}

// Serve answers the host on rw until it reads EOF or fails, then kills
// the processes this connection started that still run. It writes "ready"
// first.
func (s *Server) Serve(rw io.ReadWriter) error {
	c := &conn{enc: json.NewEncoder(rw), watches: map[uint64]*watch{}, windows: map[uint64]*window{}}
	c.send(Msg{Op: "ready", Features: features})
	if c.err != nil {
		return c.err
	}
	started := map[uint64]bool{}
	defer func() {
		// Nothing waits for credit from a host that is gone.
		c.wmu.Lock()
		for id, w := range c.windows {
			w.close()
			delete(c.windows, id)
		}
		c.wmu.Unlock()
		s.mu.Lock()
		var left []*proc
		for id := range started {
			if p := s.procs[id]; p != nil {
				left = append(left, p)
			}
		}
		s.mu.Unlock()
		for _, p := range left {
			if p.pid > 0 {
				killTree(p.pid, syscall.SIGKILL, true, true)
			}
			p.abort()
		}
	}()
	r := bufio.NewReaderSize(rw, 256<<10)
	for {
		line, err := r.ReadBytes('\n')
		if len(bytes.TrimSpace(line)) > 0 {
			var m Msg
			if jerr := json.Unmarshal(line, &m); jerr != nil {
				c.send(Msg{Op: "error", Error: "bad message: " + jerr.Error()})
			} else {
				if m.Op == "exec" || m.Op == "fs" {
					started[m.ID] = true
					if m.Window > 0 {
						c.wmu.Lock()
						if _, ok := c.windows[m.ID]; !ok {
							c.windows[m.ID] = newWindow(m.Window)
						}
						c.wmu.Unlock()
					}
				}
				s.handle(c, m)
			}
		}
		if err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
		if c.failed() {
			c.mu.Lock()
			defer c.mu.Unlock()
			return c.err
		}
	}
}

func (s *Server) handle(c *conn, m Msg) {
	reply := func(err error) {
		if err == nil {
			c.send(Msg{ID: m.ID, Op: "ok"})
			return
		}
		kind := ""
		if errors.Is(err, errInvalid) {
			kind = "invalid"
		}
		c.send(Msg{ID: m.ID, Op: "error", Error: err.Error(), Kind: kind})
	}
	switch m.Op {
	case "ping":
		c.send(Msg{ID: m.ID, Op: "ok", Features: features})
	case "ack":
		c.wmu.Lock()
		w := c.windows[m.ID]
		c.wmu.Unlock()
		if w != nil && m.Acked > 0 {
			w.give(m.Acked)
		}
	case "exec":
		if err := s.exec(c, m); err != nil {
			reply(err)
		}
	case "stdin", "stdin_close", "stdin_abort":
		s.mu.Lock()
		p := s.procs[m.ID]
		s.mu.Unlock()
		switch {
		case p == nil:
		case m.Op == "stdin_abort":
			p.abort()
		default:
			p.input(m.Op == "stdin_close", m.Data)
		}
	case "fs":
		if m.FS == nil {
			reply(fmt.Errorf("%w: fs without a request", errInvalid))
			return
		}
		s.fs(c, m)
	case "kill":
		s.mu.Lock()
		p := s.procs[m.Of]
		s.mu.Unlock()
		if p != nil && p.pid > 0 {
			killTree(p.pid, syscall.SIGKILL, true, true)
		} else {
			// A file operation: its data stops (and an upload's
			// stdin is given up).
			c.wmu.Lock()
			w := c.windows[m.Of]
			c.wmu.Unlock()
			if w != nil {
				w.cancel()
			}
			if p != nil {
				p.abort()
			}
		}
		reply(nil)
	case "resize":
		s.mu.Lock()
		p := s.procs[m.Of]
		s.mu.Unlock()
		if p == nil || p.tty == nil {
			reply(fmt.Errorf("%w: request %d has no terminal", errInvalid, m.Of))
			return
		}
		reply(pty.SetSize(p.tty, m.Rows, m.Cols))
	case "signal":
		if m.Pid <= 1 || m.Signal <= 0 {
			reply(fmt.Errorf("%w: signal %d to pid %d", errInvalid, m.Signal, m.Pid))
			return
		}
		pid := m.Pid
		s.mu.Lock()
		sp := s.spawner
		s.mu.Unlock()
		if sp != nil {
			// The host names the pid the sandbox sees.
			if pid = sp.outerPid(m.Pid); pid == 0 {
				reply(nil) // gone: as kill(2) of an exited process the caller does not learn of
				return
			}
		}
		killTree(pid, syscall.Signal(m.Signal), m.Self, m.Tree)
		reply(nil)
	case "setup":
		if m.Setup == nil {
			reply(fmt.Errorf("%w: setup without a setup", errInvalid))
			return
		}
		reply(s.setup(*m.Setup))
	default:
		reply(fmt.Errorf("%w: unknown op %q", errInvalid, m.Op))
	}
}

var errInvalid = errors.New("invalid")

// features are what this agent tells the host it does beyond the base
// protocol.
var features = []string{FeatureWindow, FeaturePrivate}

// proc is a process the agent started for the host.
type proc struct {
	pid int // 0 for a file operation's data
	// tty is the master of the process's terminal, if it has one.
	tty *os.File

	mu      sync.Mutex
	queue   [][]byte // stdin the process has not read yet
	closed  bool     // stdin_close came (or the process ended)
	aborted bool     // the host gave up on the data
	wake    chan struct{}
}

// errAborted ends an upload the host gave up on.
var errAborted = errors.New("the upload was cut short")

// abort ends stdin as given up: a file operation reading it fails.
func (p *proc) abort() {
	p.mu.Lock()
	p.aborted = true
	p.mu.Unlock()
	p.input(true, nil)
}

// input queues stdin data (or its end) for the process. It never blocks:
// a process that does not read its stdin must not hold up the
// connection's reader (kills and signals come that way). The queue is
// what the host sent and the process has not read; the host bounds what
// it sends.
func (p *proc) input(closing bool, data []byte) {
	p.mu.Lock()
	if closing {
		p.closed = true
	} else if !p.closed {
		p.queue = append(p.queue, data)
	}
	p.mu.Unlock()
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

// feed writes the queued stdin to w until stdin is closed, then closes w
// (with errAborted when aborted, where w takes an error).
func (p *proc) feed(w io.WriteCloser) {
	defer func() {
		p.mu.Lock()
		aborted := p.aborted
		p.mu.Unlock()
		if pw, ok := w.(*io.PipeWriter); ok && aborted {
			pw.CloseWithError(errAborted)
			return
		}
		w.Close()
	}()
	for {
		p.mu.Lock()
		q, closed := p.queue, p.closed
		p.queue = nil
		p.mu.Unlock()
		for _, data := range q {
			if _, err := w.Write(data); err != nil {
				p.input(true, nil)
				return
			}
		}
		if closed && len(q) == 0 {
			return
		}
		if len(q) == 0 {
			<-p.wake
		}
	}
}

// exec starts m's command; the rest of it is reported on c. An error is a
// request the agent refuses; a command that cannot start is exit 127
// (not found) or 126, with why on its stderr, as a shell does.
func (s *Server) exec(c *conn, m Msg) error {
	if len(m.Args) == 0 {
		return fmt.Errorf("%w: exec without a command", errInvalid)
	}
	s.mu.Lock()
	root, cgfd, sp := s.root, s.cgroupFD, s.spawner
	_, dup := s.procs[m.ID]
	s.mu.Unlock()
	if m.Private && root == "" {
		return fmt.Errorf("%w: a private run needs a sandbox (setup first)", errInvalid)
	}
	if m.Private && m.TTY {
		// Its terminal would be on the sandbox's devpts, in reach of
		// the sandbox's root.
		return fmt.Errorf("%w: a private run has no terminal", errInvalid)
	}
	if dup {
		return fmt.Errorf("%w: request %d already runs", errInvalid, m.ID)
	}
	cred, env, err := resolveUser(root, m.User, m.Env)
	if err != nil {
		return err
	}
	failed := func(code int, why string) error {
		c.send(Msg{ID: m.ID, Op: "stderr", Data: []byte("dsec: " + why + "\n")})
		c.send(Msg{ID: m.ID, Op: "exit", Code: code})
		return nil
	}
	path, err := lookPath(root, m.Args[0], env)
	if err != nil {
		return failed(127, err.Error())
	}
	cwd := m.Cwd
	if cwd == "" {
		cwd = "/"
	}
	if cwd == "~" || strings.HasPrefix(cwd, "~/") {
		// The user's home, as resolveUser found it (or the caller set).
		home := "/"
		for _, kv := range env {
			if h, ok := strings.CutPrefix(kv, "HOME="); ok && strings.HasPrefix(h, "/") {
				home = h
			}
		}
		cwd = filepath.Join(home, strings.TrimPrefix(cwd, "~"))
	}
	var inR, inW, outR, outW, errR, errW *os.File
	var tty *os.File
	if m.TTY {
		ptmx := "/dev/ptmx"
		if root != "" {
			ptmx = filepath.Join(root, "dev/pts/ptmx")
		}
		master, slave, err := pty.Open(ptmx, m.Rows, m.Cols)
		if err != nil {
			return failed(126, err.Error())
		}
		tty = master
		inR, outW, errW = slave, slave, slave
		// The master carries both ways; stdin never closes it (that
		// would hang up the terminal).
		inW, outR = nil, master
	} else {
		if inR, inW, err = os.Pipe(); err != nil {
			return err
		}
		if outR, outW, err = os.Pipe(); err != nil {
			inR.Close()
			inW.Close()
			return err
		}
		if errR, errW, err = os.Pipe(); err != nil {
			inR.Close()
			inW.Close()
			outR.Close()
			outW.Close()
			return err
		}
	}
	p := &proc{wake: make(chan struct{}, 1), tty: tty}
	var (
		pid, innerPid int
		wait          chan syscall.WaitStatus
	)
	cmd := command{Path: path, Args: m.Args, Env: env, Dir: cwd, UID: cred.Uid, GID: cred.Gid}
	switch {
	case m.Private:
		pid, wait, err = s.startPrivate(root, cgfd, cmd, m.TTY, [3]*os.File{inR, outW, errW})
	case sp != nil:
		pid, innerPid, wait, err = sp.spawn(spawnRequest{command: cmd, TTY: m.TTY}, [3]*os.File{inR, outW, errW})
	default:
		sys := &syscall.SysProcAttr{Setsid: true, Credential: cred, Setctty: m.TTY}
		if root != "" {
			sys.Chroot = root
		}
		if cgfd >= 0 {
			sys.UseCgroupFD, sys.CgroupFD = true, cgfd
		}
		attr := &syscall.ProcAttr{Dir: cwd, Env: env, Files: []uintptr{inR.Fd(), outW.Fd(), errW.Fd()}, Sys: sys}
		pid, wait, err = s.reaper.start(func() (int, error) { return syscall.ForkExec(path, m.Args, attr) })
		innerPid = pid
	}
	inR.Close()
	if !m.TTY {
		outW.Close()
		errW.Close()
	}
	if err != nil {
		closeAll(inW, outR, errR)
		code := 126
		if errors.Is(err, syscall.ENOENT) && m.Cwd == "" {
			code = 127
		}
		return failed(code, fmt.Sprintf("starting %s in %s: %v", m.Args[0], cwd, err))
	}
	p.pid = pid
	s.mu.Lock()
	s.procs[m.ID] = p
	s.mu.Unlock()
	c.send(Msg{ID: m.ID, Op: "started", Pid: innerPid})
	if m.TTY {
		go p.feed(noClose{tty})
	} else {
		go p.feed(inW)
	}
	var pumps sync.WaitGroup
	pump := func(r *os.File, op string) {
		defer pumps.Done()
		defer r.Close()
		buf := make([]byte, ChunkSize)
		emit := func(b []byte) { c.sendData(m.ID, op, append([]byte(nil), b...)) }
		for {
			n, err := r.Read(buf)
			if n > 0 {
				emit(buf[:n])
			}
			if errors.Is(err, os.ErrDeadlineExceeded) {
				// A deadline fails a read before it looks at the pipe:
				// what was written before the process ended is read now.
				drainNow(r, buf, emit)
				return
			}
			if err != nil {
				return
			}
		}
	}
	pumps.Add(1)
	go pump(outR, "stdout")
	if errR != nil {
		pumps.Add(1)
		go pump(errR, "stderr")
	}
	go func() {
		ws := <-wait
		// What the process wrote is in the pipes; a child it left behind
		// may hold them open: give the output a moment, then go.
		drained := make(chan struct{})
		go func() { pumps.Wait(); close(drained) }()
		select {
		case <-drained:
		case <-time.After(200 * time.Millisecond):
			// Stop waiting for more; what is in the pipes now is still
			// read (drainNow) before the exit is reported.
			_ = outR.SetReadDeadline(time.Now())
			if errR != nil {
				_ = errR.SetReadDeadline(time.Now())
			}
			<-drained
		}
		p.input(true, nil)
		s.mu.Lock()
		delete(s.procs, m.ID)
		s.mu.Unlock()
		code := ws.ExitStatus()
		if ws.Signaled() {
			code = 128 + int(ws.Signal())
		}
		c.send(Msg{ID: m.ID, Op: "exit", Code: code})
	}()
	return nil
}

// noClose is a terminal's master as stdin's writer: the end of stdin
// does not close it.
type noClose struct{ *os.File }

func (noClose) Close() error { return nil }

// closeAll closes the files that are set.
func closeAll(fs ...*os.File) {
	for _, f := range fs {
		if f != nil {
			f.Close()
		}
	}
}

// drainNow reads what r holds now, without waiting for more.
func drainNow(r *os.File, buf []byte, emit func([]byte)) {
	_ = r.SetReadDeadline(time.Time{})
	rc, err := r.SyscallConn()
	if err != nil {
		return
	}
	_ = rc.Read(func(fd uintptr) bool {
		for {
			n, err := syscall.Read(int(fd), buf)
			if n <= 0 || err != nil {
				return true // empty (EAGAIN), closed or failed: done
			}
			emit(buf[:n])
		}
	})
}

// reaper waits for every child of the agent (as pid 1, orphans too) and
// hands the statuses of the processes it started to their waiters.
type reaper struct {
	mu      sync.Mutex
	waiting map[int]chan syscall.WaitStatus
}

func newReaper() *reaper { return &reaper{waiting: map[int]chan syscall.WaitStatus{}} }

// start runs fork (which starts a child and returns its pid) and returns a
// channel for the child's status. The lock held across fork and
// registration makes a child that exits at once wait for its waiter.
func (r *reaper) start(fork func() (int, error)) (int, chan syscall.WaitStatus, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	pid, err := fork()
	if err != nil {
		return 0, nil, err
	}
	ch := make(chan syscall.WaitStatus, 1)
	r.waiting[pid] = ch
	return pid, ch, nil
}

func (r *reaper) loop() {
	sigs := make(chan os.Signal, 64)
	signal.Notify(sigs, syscall.SIGCHLD)
	tick := time.NewTicker(time.Second) // a SIGCHLD is never lost, but cheap insurance
	defer tick.Stop()
	for {
		select {
		case <-sigs:
		case <-tick.C:
		}
		for {
			var ws syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
			r.mu.Lock()
			if ch := r.waiting[pid]; ch != nil {
				ch <- ws
				delete(r.waiting, pid)
			}
			r.mu.Unlock()
		}
	}
}

// killTree sends sig to pid (with self) and every descendant of it (with
// tree), found through /proc's parent links. The descendants are stopped
// first, found again until no new one appears, then signalled: a process
// forking as fast as it can cannot outrun the walk.
func killTree(pid int, sig syscall.Signal, self, tree bool) {
	if !tree {
		if self {
			_ = syscall.Kill(pid, sig)
		}
		return
	}
	// The process first, so it forks no more while its tree is walked.
	_ = syscall.Kill(pid, syscall.SIGSTOP)
	stopped := map[int]bool{}
	for round := 0; round < 50; round++ {
		found := false
		for _, d := range descendants(pid) {
			if !stopped[d] {
				stopped[d] = true
				found = true
				_ = syscall.Kill(d, syscall.SIGSTOP)
			}
		}
		if !found {
			break
		}
	}
	if self {
		_ = syscall.Kill(pid, sig)
	}
	if !self || (sig != syscall.SIGKILL && sig != syscall.SIGSTOP) {
		_ = syscall.Kill(pid, syscall.SIGCONT)
	}
	for d := range stopped {
		_ = syscall.Kill(d, sig)
		if sig != syscall.SIGKILL && sig != syscall.SIGSTOP {
			_ = syscall.Kill(d, syscall.SIGCONT)
		}
	}
}

// descendants lists the processes below pid.
func descendants(pid int) []int {
	ents, _ := os.ReadDir("/proc")
	parent := map[int]int{}
	for _, e := range ents {
		p, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		// pid (comm) state ppid ...: comm may hold spaces and parens.
		i := bytes.LastIndexByte(b, ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(string(b[i+1:]))
		if len(f) < 2 {
			continue
		}
		pp, _ := strconv.Atoi(f[1])
		parent[p] = pp
	}
	var out []int
	for p := range parent {
		for q := parent[p]; q > 1; q = parent[q] {
			if q == pid {
				out = append(out, p)
				break
			}
		}
	}
	return out
}

// lookPath finds the command name in root ("" for the agent's own) the way
// a shell does: a name with a slash as is, else through PATH in env. The
// path returned is the one to exec after chroot to root. Symlinks resolve
// inside root.
func lookPath(root, name string, env []string) (string, error) {
	rootDir := root
	if rootDir == "" {
		rootDir = "/"
	}
	executable := func(p string) bool {
		fd, err := openInRoot(rootDir, p)
		if err != nil {
			return false
		}
		defer unix.Close(fd)
		var st unix.Stat_t
		return unix.Fstat(fd, &st) == nil && st.Mode&unix.S_IFMT == unix.S_IFREG && st.Mode&0o111 != 0
	}
	if strings.Contains(name, "/") {
		if !executable(name) {
			return "", fmt.Errorf("%s: not found or not executable", name)
		}
		return name, nil
	}
	path := "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, "PATH="); ok {
			path = v
		}
	}
	for _, dir := range filepath.SplitList(path) {
		if dir == "" || !filepath.IsAbs(dir) {
			continue
		}
		if p := filepath.Join(dir, name); executable(p) {
			return p, nil
		}
	}
	return "", fmt.Errorf("%s: command not found", name)
}

// openInRoot opens p (O_PATH) resolving it, and every symlink on the way,
// inside root.
func openInRoot(root, p string) (int, error) {
	rfd, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	defer unix.Close(rfd)
	return unix.Openat2(rfd, strings.TrimPrefix(p, "/"), &unix.OpenHow{Flags: unix.O_PATH | unix.O_CLOEXEC, Resolve: unix.RESOLVE_IN_ROOT})
}

// readDB reads a database file of the sandbox's (such as /etc/passwd): a
// regular file only (a FIFO would hold the agent), its first 4 MiB.
func readDB(root, p string) []byte {
	fd, err := openInRoot(root, p)
	if err != nil {
		return nil
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if unix.Fstat(fd, &st) != nil || st.Mode&unix.S_IFMT != unix.S_IFREG {
		return nil
	}
	f, err := os.OpenFile(fmt.Sprintf("/proc/self/fd/%d", fd), os.O_RDONLY|unix.O_NONBLOCK, 0)
	if err != nil {
		return nil
	}
	defer f.Close()
	b, _ := io.ReadAll(io.LimitReader(f, 4<<20))
	return b
}

// resolveUser finds user in root's /etc/passwd (a name, a uid, or
// uid:gid) and returns its credential and env with HOME and USER set
// unless env has them. "" is root.
func resolveUser(root, user string, env []string) (*syscall.Credential, []string, error) {
	has := func(k string) bool {
		for _, kv := range env {
			if strings.HasPrefix(kv, k+"=") {
				return true
			}
		}
		return false
	}
	env = append([]string(nil), env...)
	if !has("PATH") {
		env = append(env, "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
	}
	if user == "" {
		user = "0"
	}
	name, group, hasGroup := strings.Cut(user, ":")
	uid, gid, home, uname := -1, -1, "/", ""
	if n, err := strconv.Atoi(name); err == nil && n >= 0 {
		uid, gid = n, n
	}
	var passwd []byte
	if root != "" && (uid < 0 || !has("HOME")) {
		// Ids given with their HOME (the edge's, resolved once) need no
		// lookup in a file the sandbox may have made hostile.
		passwd = readDB(root, "/etc/passwd")
	}
	for _, line := range strings.Split(string(passwd), "\n") {
		f := strings.Split(line, ":")
		if len(f) < 7 {
			continue
		}
		u, _ := strconv.Atoi(f[2])
		if f[0] == name || (uid >= 0 && u == uid && f[2] != "") {
			uid = u
			gid, _ = strconv.Atoi(f[3])
			home, uname = f[5], f[0]
			break
		}
	}
	if uid < 0 {
		return nil, nil, fmt.Errorf("%w: user %q is not in the sandbox's /etc/passwd", errInvalid, name)
	}
	if hasGroup {
		g, err := strconv.Atoi(group)
		if err != nil || g < 0 {
			return nil, nil, fmt.Errorf("%w: group %q: want a number", errInvalid, group)
		}
		gid = g
	}
	if !has("HOME") {
		env = append(env, "HOME="+home)
	}
	if uname != "" && !has("USER") {
		env = append(env, "USER="+uname)
	}
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), Groups: []uint32{}}, env, nil
}
