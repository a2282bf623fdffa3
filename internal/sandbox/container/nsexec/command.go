package nsexec

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// Config is what the helper applies before exec'ing the command.
type Config struct {
	// Pidfd refers to the sandbox's init; the helper joins its namespaces.
	Pidfd *os.File
	// NSFlags are the CLONE_NEW* namespaces to join (CLONE_NEWUSER only
	// when the sandbox has a user namespace of its own).
	NSFlags uint32
	// CgroupProcs are the host paths of the sandbox's cgroup.procs files,
	// one per hierarchy, joined before the namespaces.
	CgroupProcs []string
	UID, GID    uint32
	Groups      []uint32
	// Caps is root's effective and permitted set; Bounding the bounding
	// set of any user.
	Caps, Bounding uint64
	// NoFile is the open-files limit, soft and hard (0 = inherit).
	NoFile uint64
	// TTY says stdin is a terminal: the command leads a new session with
	// it as its controlling terminal.
	TTY bool
	// Private runs the command in a pid namespace of its own beside the
	// sandbox's, with its own /proc (nsexec.c, FLAG_PRIVATE): the
	// sandbox's processes cannot see, signal or trace it.
	Private bool
	Cwd     string
	// StdioOwner, if set, is the host uid and gid the command's stdio
	// pipes, sockets and terminal are given to before it starts (a
	// command in a user namespace: host root's would be nobody's inside).
	StdioOwner *[2]uint32
	// Filter is the seccomp program, installed last before exec.
	Filter []unix.SockFilter
}

// noOwner in the config leaves stdio's owner be (nsexec.c, NO_OWNER).
const noOwner = 0xffffffff

// encode writes the config in the layout read_config in nsexec.c parses.
func (c *Config) encode() ([]byte, error) {
	if len(c.Groups) > 256 || len(c.CgroupProcs) > 64 {
		return nil, fmt.Errorf("%d groups, %d cgroups: too many", len(c.Groups), len(c.CgroupProcs))
	}
	if len(c.Filter) == 0 || len(c.Filter) > 4096 {
		return nil, fmt.Errorf("seccomp filter of %d instructions", len(c.Filter))
	}
	var b bytes.Buffer
	le := binary.LittleEndian
	u32 := func(v uint32) { b.Write(le.AppendUint32(nil, v)) }
	u64 := func(v uint64) { b.Write(le.AppendUint64(nil, v)) }
	str := func(s string) error {
		if len(s) > 4096 || strings.IndexByte(s, 0) >= 0 {
			return fmt.Errorf("invalid path %q", s)
		}
		u32(uint32(len(s)))
		b.WriteString(s)
		return nil
	}
	b.WriteString("DSX3")
	u32(c.UID)
	u32(c.GID)
	u32(uint32(len(c.Groups)))
	for _, g := range c.Groups {
		u32(g)
	}
	u32(c.NSFlags)
	u64(c.Caps)
	u64(c.Bounding)
	u64(c.NoFile)
	var flags uint32
	if c.TTY {
		flags |= 1 // FLAG_TTY
	}
	if c.Private {
		flags |= 2 // FLAG_PRIVATE
	}
	u32(flags)
	if o := c.StdioOwner; o != nil {
		u32(o[0])
		u32(o[1])
	} else {
		u32(noOwner)
		u32(noOwner)
	}
	if err := str(c.Cwd); err != nil {
		return nil, err
	}
	u32(uint32(len(c.CgroupProcs)))
	for _, p := range c.CgroupProcs {
		if err := str(p); err != nil {
			return nil, err
		}
	}
	u32(uint32(len(c.Filter)))
	for _, f := range c.Filter {
		b.Write(le.AppendUint16(nil, f.Code))
		b.WriteByte(f.Jt)
		b.WriteByte(f.Jf)
		u32(f.K)
	}
	return b.Bytes(), nil
}

// Memfd returns a close-on-exec memory file holding data, for passing
// configuration to a child as an extra file (nothing touches the disk).
func Memfd(name string, data []byte) (*os.File, error) {
	fd, err := unix.MemfdCreate("dsec-"+name, unix.MFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("creating memfd: %w", err)
	}
	f := os.NewFile(uintptr(fd), name)
	if _, err := f.Write(data); err != nil {
		f.Close()
		return nil, fmt.Errorf("writing memfd: %w", err)
	}
	return f, nil
}

// setupTimeout bounds the wait for the helper to reach exec. Joining a
// frozen cgroup, for one, would freeze the helper.
const setupTimeout = 10 * time.Second

// Start starts argv (searched in env's PATH inside the sandbox) with env
// and the given stdio through the helper, and returns once the command has
// been exec'd or setup failed. The returned Cmd's process is the helper,
// which exits with the command's status (128+signal when it was killed).
// A command that does not exist is not an error here: like a shell, the
// helper prints why on the command's stderr and exits 127 (126 when it
// exists but cannot be executed). A working directory that cannot be
// entered is errdefs.Invalid.
func Start(cfg Config, argv, env []string, stdin io.Reader, stdout, stderr io.Writer) (*exec.Cmd, error) {
	if !Available {
		return nil, errors.New("this dsec was built without cgo: no exec helper")
	}
	if len(argv) == 0 {
		return nil, errors.New("exec: empty argv")
	}
	data, err := cfg.encode()
	if err != nil {
		return nil, fmt.Errorf("encoding exec config: %w", err)
	}
	mf, err := Memfd("nsexec-config", data)
	if err != nil {
		return nil, fmt.Errorf("passing exec config: %w", err)
	}
	defer mf.Close()
	// The helper writes a setup failure to this pipe; it is close-on-exec
	// there, so a successful exec of the command reads as EOF.
	errR, errW, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("creating error pipe: %w", err)
	}
	defer errR.Close()
	cmd := &exec.Cmd{
		Path:        "/proc/self/exe",
		Args:        append([]string{"dsec-nsexec"}, argv...),
		Env:         env,
		Stdin:       stdin,
		Stdout:      stdout,
		Stderr:      stderr,
		ExtraFiles:  []*os.File{cfg.Pidfd, mf, errW},
		SysProcAttr: &syscall.SysProcAttr{Setpgid: true},
		WaitDelay:   2 * time.Second,
	}
	if cmd.Env == nil {
		cmd.Env = []string{}
	}
	err = cmd.Start()
	errW.Close()
	if err != nil {
		return nil, fmt.Errorf("starting exec helper: %w", err)
	}
	_ = errR.SetReadDeadline(time.Now().Add(setupTimeout))
	msg, rerr := io.ReadAll(io.LimitReader(errR, 4096))
	if rerr == nil && len(msg) == 0 {
		return cmd, nil
	}
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	if rerr != nil {
		return nil, fmt.Errorf("exec helper did not reach exec within %v: %w", setupTimeout, rerr)
	}
	kind, text, _ := strings.Cut(string(msg), ":")
	if kind == "cwd" {
		return nil, errdefs.Invalid("%s", text)
	}
	return nil, fmt.Errorf("exec helper: %s", text)
}
