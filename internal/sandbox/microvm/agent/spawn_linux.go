package agent

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// spawner is the agent's side of the sandbox's init (RunSandboxInit).
type spawner struct {
	conn *net.UnixConn
	// pid is the init's pid in the guest's namespace; pidNS its pid
	// namespace's identity (readlink of /proc/PID/ns/pid).
	pid   int
	pidNS string

	wmu sync.Mutex // one request at a time

	mu      sync.Mutex
	seq     uint64
	pending map[uint64]*spawnWait
	gone    error
}

type spawnWait struct {
	reply chan spawnReply
	pidfd int
	exit  chan syscall.WaitStatus
}

// errInitGone is a command of a sandbox whose init has ended: its pid
// namespace, and every process in it, ended with it.
var errInitGone = errors.New("the sandbox's init has exited (its processes ended with it)")

// startSpawner starts the sandbox's init over root, in the guest cgroup
// cgfd (-1: the agent's), and waits for it to be ready.
func (s *Server) startSpawner(root string, cgfd int, filter, masks string) (*spawner, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	ours := os.NewFile(uintptr(fds[0]), "init")
	theirs := os.NewFile(uintptr(fds[1]), "agent")
	defer theirs.Close()
	c, err := net.FileConn(ours)
	ours.Close()
	if err != nil {
		return nil, err
	}
	conn := c.(*net.UnixConn)
	if rc, err := conn.SyscallConn(); err == nil {
		_ = rc.Control(func(fd uintptr) {
			_ = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_SNDBUFFORCE, maxSpawnMessage)
		})
	}
	sys := &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID | syscall.CLONE_NEWNS | syscall.CLONE_NEWCGROUP, Setsid: true}
	if cgfd >= 0 {
		sys.UseCgroupFD, sys.CgroupFD = true, cgfd
	}
	null, err := os.OpenFile("/dev/null", os.O_RDWR, 0)
	if err != nil {
		conn.Close()
		return nil, err
	}
	defer null.Close()
	attr := &syscall.ProcAttr{Files: []uintptr{null.Fd(), os.Stderr.Fd(), os.Stderr.Fd(), theirs.Fd()}, Sys: sys}
	pid, _, err := s.reaper.start(func() (int, error) {
		return syscall.ForkExec("/proc/self/exe", []string{"dsec-agent", SandboxInitArg, root, filter, masks}, attr)
	})
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("starting the sandbox's init: %w", err)
	}
	sp := &spawner{conn: conn, pid: pid, pending: map[uint64]*spawnWait{}}
	sp.pidNS, err = os.Readlink(fmt.Sprintf("/proc/%d/ns/pid", pid))
	if err == nil {
		_ = conn.SetReadDeadline(time.Now().Add(30 * time.Second))
		var r spawnReply
		var fd int
		r, fd, err = sp.read()
		if fd >= 0 {
			unix.Close(fd)
		}
		_ = conn.SetReadDeadline(time.Time{})
		if err == nil && !r.Ready {
			err = errors.New(r.Error)
		}
	}
	if err != nil {
		_ = syscall.Kill(pid, syscall.SIGKILL)
		conn.Close()
		return nil, fmt.Errorf("the sandbox's init: %w", err)
	}
	go sp.loop()
	return sp, nil
}

// read reads one message of the init, with the descriptor it carries
// (-1: none).
func (sp *spawner) read() (spawnReply, int, error) {
	buf := make([]byte, 4096)
	oob := make([]byte, unix.CmsgSpace(4))
	n, oobn, _, _, err := sp.conn.ReadMsgUnix(buf, oob)
	if err != nil {
		return spawnReply{}, -1, err
	}
	if n == 0 {
		return spawnReply{}, -1, errInitGone
	}
	fd := -1
	if msgs, err := unix.ParseSocketControlMessage(oob[:oobn]); err == nil {
		for _, m := range msgs {
			if fds, err := unix.ParseUnixRights(&m); err == nil {
				for _, f := range fds {
					if fd < 0 {
						fd = f
					} else {
						unix.Close(f)
					}
				}
			}
		}
	}
	var r spawnReply
	if err := json.Unmarshal(buf[:n], &r); err != nil {
		if fd >= 0 {
			unix.Close(fd)
		}
		return r, -1, fmt.Errorf("bad message from the sandbox's init: %w", err)
	}
	return r, fd, nil
}

// loop hands the init's answers and exits to their waiters until the
// init is gone; then every waiter hears its process was killed.
func (sp *spawner) loop() {
	for {
		r, fd, err := sp.read()
		if err != nil {
			sp.mu.Lock()
			sp.gone = errInitGone
			for seq, w := range sp.pending {
				select {
				case w.reply <- spawnReply{Seq: seq, Error: errInitGone.Error()}:
				default:
				}
				w.exit <- syscall.WaitStatus(syscall.SIGKILL)
				delete(sp.pending, seq)
			}
			sp.mu.Unlock()
			sp.conn.Close()
			return
		}
		sp.mu.Lock()
		w := sp.pending[r.Seq]
		if w != nil && r.Exited {
			w.exit <- syscall.WaitStatus(r.Status)
			delete(sp.pending, r.Seq)
		}
		sp.mu.Unlock()
		if w == nil || r.Exited {
			if fd >= 0 {
				unix.Close(fd)
			}
			continue
		}
		// One answer per request: a second is dropped, never waited on.
		w.pidfd = fd
		select {
		case w.reply <- r:
		default:
			if fd >= 0 {
				unix.Close(fd)
			}
		}
	}
}

// spawn starts req's command in the sandbox with stdio as its stdin,
// stdout and stderr, and returns its pid in the guest's namespace and in
// the sandbox's, and the channel of its status.
func (sp *spawner) spawn(req spawnRequest, stdio [3]*os.File) (outer, inner int, exit chan syscall.WaitStatus, err error) {
	w := &spawnWait{reply: make(chan spawnReply, 1), exit: make(chan syscall.WaitStatus, 1), pidfd: -1}
	sp.mu.Lock()
	if sp.gone != nil {
		sp.mu.Unlock()
		return 0, 0, nil, sp.gone
	}
	sp.seq++
	req.Seq = sp.seq
	sp.pending[req.Seq] = w
	sp.mu.Unlock()
	b, err := json.Marshal(req)
	if err == nil {
		rights := unix.UnixRights(int(stdio[0].Fd()), int(stdio[1].Fd()), int(stdio[2].Fd()))
		sp.wmu.Lock()
		_, _, err = sp.conn.WriteMsgUnix(b, rights, nil)
		sp.wmu.Unlock()
	}
	if err != nil {
		sp.mu.Lock()
		delete(sp.pending, req.Seq)
		sp.mu.Unlock()
		return 0, 0, nil, fmt.Errorf("asking the sandbox's init: %w", err)
	}
	var r spawnReply
	select {
	case r = <-w.reply:
	case <-time.After(spawnWaitLimit):
		r.Error = fmt.Sprintf("the sandbox's init did not answer within %s", spawnWaitLimit)
	}
	if r.Error != "" {
		sp.mu.Lock()
		delete(sp.pending, req.Seq)
		sp.mu.Unlock()
		return 0, 0, nil, errors.New(r.Error)
	}
	// The guest's pid of the command comes from its pidfd alone; one
	// already reaped has none (-1), and then nothing is to be killed.
	if w.pidfd >= 0 {
		outer = pidOfPidfd(w.pidfd)
		unix.Close(w.pidfd)
	}
	return max(outer, 0), r.Pid, w.exit, nil
}

// spawnWaitLimit bounds the wait for the init's answer to a spawn: the
// agent's connection reader waits for it.
const spawnWaitLimit = 10 * time.Second

// pidOfPidfd is the pid, in this process's namespace, of the process
// pidfd refers to: -1 if it is gone, 0 if pidfd is not a pidfd.
func pidOfPidfd(pidfd int) int {
	b, err := os.ReadFile(fmt.Sprintf("/proc/self/fdinfo/%d", pidfd))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "Pid:"); ok {
			n, _ := strconv.Atoi(strings.TrimSpace(v))
			return n
		}
	}
	return 0
}

// outerPid is the pid in the guest's namespace of the process that is
// inner in the sandbox's (0 if there is none).
func (sp *spawner) outerPid(inner int) int {
	ents, _ := os.ReadDir("/proc")
	want := strconv.Itoa(inner)
	for _, e := range ents {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		f, err := os.Open("/proc/" + e.Name() + "/status")
		if err != nil {
			continue
		}
		sc := bufio.NewScanner(f)
		match := false
		for sc.Scan() {
			if v, ok := strings.CutPrefix(sc.Text(), "NSpid:"); ok {
				ids := strings.Fields(v)
				match = len(ids) == 2 && ids[1] == want
				break
			}
		}
		f.Close()
		if !match {
			continue
		}
		if ns, _ := os.Readlink("/proc/" + e.Name() + "/ns/pid"); ns == sp.pidNS && sp.pidNS != "" {
			n, _ := strconv.Atoi(e.Name())
			return n
		}
	}
	return 0
}

// startPrivate starts a private run (RunPrivate) of sp with stdio, on a
// terminal of its own with tty, and returns its pid and the channel of
// its status.
func (s *Server) startPrivate(root string, cgfd int, sp command, tty bool, stdio [3]*os.File) (int, chan syscall.WaitStatus, error) {
	s.mu.Lock()
	filter, masks := s.filter, s.masks
	s.mu.Unlock()
	b, err := json.Marshal(sp)
	if err != nil {
		return 0, nil, err
	}
	sys := &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID | syscall.CLONE_NEWNS | syscall.CLONE_NEWCGROUP, Setsid: true, Setctty: tty, Ctty: 0}
	if cgfd >= 0 {
		sys.UseCgroupFD, sys.CgroupFD = true, cgfd
	}
	attr := &syscall.ProcAttr{Files: []uintptr{stdio[0].Fd(), stdio[1].Fd(), stdio[2].Fd()}, Sys: sys}
	return s.reaper.start(func() (int, error) {
		return syscall.ForkExec("/proc/self/exe", []string{"dsec-agent", PrivateArg, root, string(b), filter, masks}, attr)
	})
}
