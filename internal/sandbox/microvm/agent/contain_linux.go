package agent

import (
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/signal"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The sandbox's processes do not run in the guest's own namespaces, where
// the agent is. The agent starts the sandbox's init (the dsec-agent binary
// again, with SandboxInitArg) in a pid and a mount namespace of its own:
// the sandbox's root is the root of that mount namespace (the guest's
// initramfs, the agent's /proc and /dev are out of reach beneath it), its
// /proc shows only the sandbox's pid namespace, /proc/sys is read-only,
// and no process of it holds more than sandboxCaps (the container
// backend's set less CAP_MKNOD: no CAP_SYS_ADMIN, CAP_SYS_PTRACE,
// CAP_SYS_MODULE or CAP_NET_ADMIN). The init starts every ordinary command as its child, on
// the agent's request over a socket (spawnRequest), so all of them are in
// that namespace. A private run (Msg.Private) is started by the agent in a
// pid namespace beside it (PrivateArg), which no process of the sandbox
// can see, signal or trace.

// SandboxInitArg and PrivateArg are the first argument of the agent's
// binary run as the sandbox's init, and as a private run's pid 1.
const (
	SandboxInitArg = "-sandbox-init"
	PrivateArg     = "-private"
)

// sandboxCaps are the capabilities a sandbox's processes may hold: the
// container backend's (internal/sandbox/container's defaultCaps) but
// CAP_MKNOD. A container's devices cgroup keeps it from opening the nodes
// it makes; here they would be the guest's disks (under its mounted
// filesystems), the agent's port and /dev/kmsg.
var sandboxCaps = []uintptr{
	unix.CAP_CHOWN, unix.CAP_DAC_OVERRIDE, unix.CAP_FSETID, unix.CAP_FOWNER,
	unix.CAP_SETGID, unix.CAP_SETUID, unix.CAP_SETFCAP, unix.CAP_SETPCAP,
	unix.CAP_NET_BIND_SERVICE, unix.CAP_SYS_CHROOT, unix.CAP_KILL, unix.CAP_AUDIT_WRITE,
}

// enterSandboxRoot makes root this mount namespace's root (moved over the
// initramfs's, as switch_root does: pivot_root refuses the initramfs) and
// mounts a /proc of this pid namespace in it, /proc/sys read-only and
// /proc/sysrq-trigger masked.
func enterSandboxRoot(root string, masked, readOnly []string) error {
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("making mounts private: %w", err)
	}
	if err := unix.Chdir(root); err != nil {
		return err
	}
	if err := unix.Mount(".", "/", "", unix.MS_MOVE, ""); err != nil {
		return fmt.Errorf("moving the sandbox's root: %w", err)
	}
	if err := unix.Chroot("."); err != nil {
		return fmt.Errorf("entering the sandbox's root: %w", err)
	}
	if err := unix.Chdir("/"); err != nil {
		return err
	}
	if err := os.MkdirAll("/proc", 0o555); err != nil {
		return err
	}
	if err := unix.Mount("proc", "/proc", "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return fmt.Errorf("mounting /proc: %w", err)
	}
	// Writable sysctls would let root inside run a program outside the
	// namespace (kernel.core_pattern, kernel.modprobe): /proc/sys is
	// always among the read-only paths, and so is the sysrq trigger.
	for _, p := range append(readOnly, "/proc/sys", "/proc/sysrq-trigger") {
		if err := unix.Mount(p, p, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
			if errors.Is(err, unix.ENOENT) {
				continue
			}
			return fmt.Errorf("binding %s: %w", p, err)
		}
		if err := unix.Mount("", p, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
			return fmt.Errorf("making %s read-only: %w", p, err)
		}
	}
	// Kernel state and triggers: a file reads as /dev/null, a directory
	// as an empty read-only tmpfs.
	for _, p := range append(masked, "/proc/kcore") {
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			continue // not on this kernel
		}
		var err error
		if st.Mode&unix.S_IFMT == unix.S_IFDIR {
			err = unix.Mount("tmpfs", p, "tmpfs", unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "size=0,mode=0555")
		} else {
			err = unix.Mount("/dev/null", p, "", unix.MS_BIND, "")
		}
		if err != nil {
			return fmt.Errorf("masking %s: %w", p, err)
		}
	}
	return nil
}

// maxSpawnMessage bounds a spawnRequest: the command and its environment
// (ARG_MAX, 2 MiB, and more).
const maxSpawnMessage = 4 << 20

// limitCaps leaves every thread of this process sandboxCaps at most, in
// its bounding set and in its own sets, so neither it nor a program it
// starts holds more.
func limitCaps() error {
	if err := dropBounding(); err != nil {
		return err
	}
	var mask [2]uint32
	for _, c := range sandboxCaps {
		mask[c/32] |= 1 << (c % 32)
	}
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	data := [2]unix.CapUserData{
		{Effective: mask[0], Permitted: mask[0]},
		{Effective: mask[1], Permitted: mask[1]},
	}
	if _, _, e := syscall.AllThreadsSyscall(unix.SYS_CAPSET, uintptr(unsafe.Pointer(&hdr)), uintptr(unsafe.Pointer(&data[0])), 0); e != 0 {
		return fmt.Errorf("limiting capabilities: %w", e)
	}
	return nil
}

// installFilter installs prog (Setup.Seccomp, base64) on every thread of
// this process, and so on everything it starts. It runs while the caller
// still holds CAP_SYS_ADMIN (no no_new_privs needed).
func installFilter(b64 string) error {
	if b64 == "" {
		return nil
	}
	raw, err := base64.StdEncoding.DecodeString(b64)
	if err != nil || len(raw) == 0 || len(raw)%8 != 0 || len(raw)/8 > 4096 {
		return fmt.Errorf("malformed seccomp filter (%d bytes): %v", len(raw), err)
	}
	prog := make([]unix.SockFilter, len(raw)/8)
	for i := range prog {
		b := raw[8*i:]
		prog[i] = unix.SockFilter{Code: binary.LittleEndian.Uint16(b), Jt: b[2], Jf: b[3], K: binary.LittleEndian.Uint32(b[4:])}
	}
	fprog := unix.SockFprog{Len: uint16(len(prog)), Filter: &prog[0]}
	if _, _, e := syscall.RawSyscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, unix.SECCOMP_FILTER_FLAG_TSYNC, uintptr(unsafe.Pointer(&fprog))); e != 0 {
		return fmt.Errorf("installing the seccomp filter: %w", e)
	}
	runtime.KeepAlive(prog)
	return nil
}

// dropBounding takes every capability but sandboxCaps out of the bounding
// set of every thread, so no program this process starts holds more.
func dropBounding() error {
	keep := map[uintptr]bool{}
	for _, c := range sandboxCaps {
		keep[c] = true
	}
	for c := uintptr(0); c <= unix.CAP_LAST_CAP; c++ {
		if keep[c] {
			continue
		}
		if _, _, e := syscall.AllThreadsSyscall(syscall.SYS_PRCTL, unix.PR_CAPBSET_DROP, c, 0); e != 0 {
			if e == syscall.EINVAL {
				continue // a capability this kernel does not have
			}
			return fmt.Errorf("dropping capability %d: %w", c, e)
		}
	}
	return nil
}

// command is a command to start in the sandbox: its path there, argv,
// environment, directory and ids.
type command struct {
	Path string   `json:"path"`
	Args []string `json:"args"`
	Env  []string `json:"env"`
	Dir  string   `json:"dir"`
	UID  uint32   `json:"uid"`
	GID  uint32   `json:"gid"`
}

// spawnRequest is what the agent asks the sandbox's init to start, with
// the command's stdin, stdout and stderr as the message's descriptors.
type spawnRequest struct {
	Seq uint64 `json:"seq"`
	command
	// TTY makes stdin the controlling terminal.
	TTY bool `json:"tty,omitempty"`
}

// spawnReply answers a spawnRequest (with the child's pidfd as the
// message's descriptor) or reports its end (Exited, with Status as
// wait(2) gives it).
type spawnReply struct {
	Seq    uint64 `json:"seq"`
	Pid    int    `json:"pid,omitempty"`
	Error  string `json:"error,omitempty"`
	Exited bool   `json:"exited,omitempty"`
	Status uint32 `json:"status,omitempty"`
	Ready  bool   `json:"ready,omitempty"`
}

// RunSandboxInit is the sandbox's init: pid 1 of its pid namespace, in a
// mount namespace of its own, with its socket to the agent on fd 3. It
// enters root, drops the capabilities sandboxes do not get, reports
// ready, then starts what the agent asks and reaps every process of the
// namespace. It returns when the agent's end closes.
func RunSandboxInit(root, filter, masks string) error {
	// Nothing the sandbox runs may hold the agent's socket: FileConn
	// keeps a close-on-exec copy, and fd 3 itself goes now.
	f3 := os.NewFile(3, "agent")
	conn, err := net.FileConn(f3)
	f3.Close()
	if err != nil {
		return err
	}
	uc, ok := conn.(*net.UnixConn)
	if !ok {
		return errors.New("fd 3 is not a unix socket")
	}
	send := func(r spawnReply, rights []byte) error {
		b, _ := json.Marshal(r)
		_, _, err := uc.WriteMsgUnix(b, rights, nil)
		return err
	}
	setup := func() error {
		m, err := parseMasks(masks)
		if err != nil {
			return err
		}
		if err := enterSandboxRoot(root, m.Masked, m.ReadOnly); err != nil {
			return err
		}
		// Not traceable, and its /proc entries not readable, by the
		// sandbox's root: it holds the agent's socket.
		if err := unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0); err != nil {
			return err
		}
		if err := installFilter(filter); err != nil {
			return err
		}
		return limitCaps()
	}
	if err := setup(); err != nil {
		_ = send(spawnReply{Error: err.Error()}, nil)
		return err
	}
	// As a pid namespace's init it gets only the signals it handles, and
	// the Go runtime handles them all, most by exiting: root inside
	// could end the sandbox with kill -HUP 1. They are caught and
	// dropped, not ignored: an ignored signal stays ignored in what the
	// init starts (^C would not reach a terminal's command), a caught
	// one is back to its default there.
	var caught []os.Signal
	for sig := syscall.Signal(1); sig <= 31; sig++ {
		switch sig {
		case syscall.SIGKILL, syscall.SIGSTOP, syscall.SIGCHLD, syscall.SIGURG,
			syscall.SIGSEGV, syscall.SIGBUS, syscall.SIGFPE, syscall.SIGILL, syscall.SIGTRAP, syscall.SIGSYS:
			// Not catchable, reaped, the runtime's own, or faults (sent
			// with kill(2), the runtime drops these).
		default:
			caught = append(caught, sig)
		}
	}
	dropped := make(chan os.Signal, 16)
	signal.Notify(dropped, caught...)
	go func() {
		for range dropped {
		}
	}()
	var mu sync.Mutex
	children := map[int]uint64{}
	// Reap every process of the namespace; report those the agent
	// started.
	go func() {
		sigs := make(chan os.Signal, 64)
		signal.Notify(sigs, syscall.SIGCHLD)
		for range sigs {
			for {
				mu.Lock()
				var ws syscall.WaitStatus
				pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
				if pid <= 0 || err != nil {
					mu.Unlock()
					break
				}
				seq, ok := children[pid]
				delete(children, pid)
				if ok {
					_ = send(spawnReply{Seq: seq, Exited: true, Status: uint32(ws)}, nil)
				}
				mu.Unlock()
			}
		}
	}()
	if err := send(spawnReply{Ready: true}, nil); err != nil {
		return err
	}
	buf := make([]byte, maxSpawnMessage)
	oob := make([]byte, unix.CmsgSpace(3*4))
	for {
		n, oobn, _, _, err := uc.ReadMsgUnix(buf, oob)
		if err != nil || n == 0 {
			return err
		}
		var fds []int
		if msgs, err := unix.ParseSocketControlMessage(oob[:oobn]); err == nil {
			for _, m := range msgs {
				if f, err := unix.ParseUnixRights(&m); err == nil {
					fds = append(fds, f...)
				}
			}
		}
		var req spawnRequest
		if err := json.Unmarshal(buf[:n], &req); err != nil || len(fds) != 3 || len(req.Args) == 0 {
			for _, fd := range fds {
				unix.Close(fd)
			}
			_ = send(spawnReply{Seq: req.Seq, Error: "malformed request"}, nil)
			continue
		}
		pidfd := -1
		sys := &syscall.SysProcAttr{
			Setsid: true, Setctty: req.TTY, Ctty: 0, PidFD: &pidfd,
			Credential: &syscall.Credential{Uid: req.UID, Gid: req.GID, Groups: []uint32{}},
		}
		attr := &syscall.ProcAttr{Dir: req.Dir, Env: req.Env, Files: []uintptr{uintptr(fds[0]), uintptr(fds[1]), uintptr(fds[2])}, Sys: sys}
		mu.Lock()
		pid, err := syscall.ForkExec(req.Path, req.Args, attr)
		for _, fd := range fds {
			unix.Close(fd)
		}
		if err != nil {
			mu.Unlock()
			_ = send(spawnReply{Seq: req.Seq, Error: err.Error()}, nil)
			continue
		}
		children[pid] = req.Seq
		_ = send(spawnReply{Seq: req.Seq, Pid: pid}, unix.UnixRights(pidfd))
		mu.Unlock()
		unix.Close(pidfd)
	}
}

// RunPrivate becomes a private run's command: pid 1 of a new pid
// namespace, in a mount namespace of its own over the sandbox's root, so
// that what it starts in the background ends with it. It returns only if
// that fails.
func RunPrivate(root, specJSON, filter, masks string) error {
	var sp command
	if err := json.Unmarshal([]byte(specJSON), &sp); err != nil || len(sp.Args) == 0 {
		return fmt.Errorf("malformed private run: %v", err)
	}
	m, err := parseMasks(masks)
	if err != nil {
		return err
	}
	if err := enterSandboxRoot(root, m.Masked, m.ReadOnly); err != nil {
		return err
	}
	if err := installFilter(filter); err != nil {
		return err
	}
	if err := dropBounding(); err != nil {
		return err
	}
	if err := syscall.Setgroups(nil); err != nil {
		return err
	}
	if err := syscall.Setgid(int(sp.GID)); err != nil {
		return err
	}
	if err := syscall.Setuid(int(sp.UID)); err != nil {
		return err
	}
	if err := unix.Chdir(sp.Dir); err != nil {
		return fmt.Errorf("%s: %w", sp.Dir, err)
	}
	err = syscall.Exec(sp.Path, sp.Args, sp.Env)
	return fmt.Errorf("starting %s: %w", strings.Join(sp.Args[:1], ""), err)
}

// masks are Setup.Masked and Setup.ReadOnly, as the agent passes them to
// the init and to private runs (JSON).
type masks struct {
	Masked   []string `json:"masked,omitempty"`
	ReadOnly []string `json:"read_only,omitempty"`
}

func parseMasks(s string) (masks, error) {
	var m masks
	if s == "" {
		return m, nil
	}
	if err := json.Unmarshal([]byte(s), &m); err != nil {
		return m, fmt.Errorf("malformed masks: %w", err)
	}
	for _, p := range append(append([]string(nil), m.Masked...), m.ReadOnly...) {
		if !strings.HasPrefix(p, "/proc/") && !strings.HasPrefix(p, "/sys/") || strings.Contains(p, "..") {
			return m, fmt.Errorf("mask %q: not below /proc or /sys", p)
		}
	}
	return m, nil
}
