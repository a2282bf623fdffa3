package container

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/proctree"
	"github.com/dsecproject/dsec/internal/sandbox"
	"github.com/dsecproject/dsec/internal/sandbox/container/nsexec"
)

// Exec implements sandbox.Backend. The process profile (capabilities,
// no_new_privs, rlimits, user) is passed to the runtime as a process.json
// held in a memfd, so nothing is written to disk per exec.
func (c *Container) Exec(ctx context.Context, id string, p sandbox.Process) (sandbox.Proc, error) {
	if len(p.Args) == 0 {
		return nil, errors.New("exec: empty argv")
	}
	env := p.Env
	hasPath := false
	for _, e := range env {
		hasPath = hasPath || strings.HasPrefix(e, "PATH=")
	}
	if !hasPath {
		env = append([]string{defaultPath}, env...)
	}
	cwd := p.Cwd
	if cwd == "" {
		cwd = "/"
	}
	// No stream: the read-only /dev/null, not the host's own (os/exec's
	// default), which root inside could chmod through /proc/self/fd/0.
	c.closing.RLock()
	defer c.closing.RUnlock()
	if c.null != nil {
		if p.Stdin == nil {
			p.Stdin = c.null
		}
		if p.Stdout == nil {
			p.Stdout = c.null
		}
		if p.Stderr == nil {
			p.Stderr = c.null
		}
	}
	if c.filter != nil {
		return c.execHelper(id, p, env, cwd)
	}
	if p.TTY || p.Private {
		return nil, errdefs.Precondition("terminals and private runs need the exec helper, which this node runs without")
	}
	proc := specs.Process{
		Args:            p.Args,
		Env:             env,
		Cwd:             cwd,
		User:            specs.User{UID: p.UID, GID: p.GID, AdditionalGids: p.AdditionalGIDs},
		NoNewPrivileges: true,
		OOMScoreAdj:     &sandboxOOMScoreAdj,
		Capabilities:    caps(p.UID),
		Rlimits:         rlimits(),
	}
	data, err := json.Marshal(&proc)
	if err != nil {
		return nil, fmt.Errorf("encoding process spec: %w", err)
	}
	mf, err := nsexec.Memfd("process.json", data)
	if err != nil {
		return nil, fmt.Errorf("passing process spec: %w", err)
	}
	defer mf.Close()
	// The runtime is not bound to ctx: the caller owns the process's life
	// through Kill, so that a cancelled request can still collect output.
	cmd := c.command(context.Background(), "--root", c.cfg.StateRoot, "exec", "--process", "/proc/self/fd/3", id)
	cmd.ExtraFiles = []*os.File{mf}
	cmd.Stdin, cmd.Stdout, cmd.Stderr = p.Stdin, p.Stdout, p.Stderr
	// Own process group, so a signal to the edge's group never reaches it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.WaitDelay = 2 * time.Second
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting %s exec: %w", c.flavor, err)
	}
	return &runtimeProc{cmd: cmd}, nil
}

// execHelper starts p through the exec helper: the sandbox's init is found
// from the runtime's state file and pinned with a pidfd (so a recycled pid
// cannot send the command elsewhere), its cgroups from /proc.
func (c *Container) execHelper(id string, p sandbox.Process, env []string, cwd string) (sandbox.Proc, error) {
	pid, start, ok := readStateFile(filepath.Join(c.cfg.StateRoot, id))
	if !ok {
		return nil, errdefs.NotFound("container %s does not exist", id)
	}
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil || !alive(pid, start) {
		if err == nil {
			unix.Close(pidfd)
		}
		return nil, errdefs.Precondition("container %s is not running", id)
	}
	pf := os.NewFile(uintptr(pidfd), "pidfd")
	defer pf.Close()
	procs, err := c.cfg.Cgroups.ProcsFilesOf(pid)
	if err != nil {
		return nil, err
	}
	flags := uint32(unix.CLONE_NEWNS | unix.CLONE_NEWPID | unix.CLONE_NEWNET | unix.CLONE_NEWIPC | unix.CLONE_NEWUTS)
	for _, ns := range []struct {
		name string
		flag uint32
	}{{"cgroup", unix.CLONE_NEWCGROUP}, {"user", unix.CLONE_NEWUSER}} {
		if !sameNamespace(pid, ns.name) {
			flags |= ns.flag
		}
	}
	var stdioOwner *[2]uint32
	if flags&unix.CLONE_NEWUSER != 0 {
		uid, uok := hostID(pid, "uid_map", p.UID)
		gid, gok := hostID(pid, "gid_map", p.GID)
		if uok && gok {
			stdioOwner = &[2]uint32{uid, gid}
		}
	}
	capSet := capMask(defaultCaps)
	var nofile uint64
	if rl := rlimits(); len(rl) > 0 {
		nofile = rl[0].Hard
	}
	cmd, err := nsexec.Start(nsexec.Config{
		Pidfd: pf, NSFlags: flags, CgroupProcs: procs,
		UID: p.UID, GID: p.GID, Groups: p.AdditionalGIDs,
		Caps: capSet, Bounding: capSet, NoFile: nofile, TTY: p.TTY, Private: p.Private, Cwd: cwd, Filter: c.filter,
		StdioOwner: stdioOwner,
	}, p.Args, env, p.Stdin, p.Stdout, p.Stderr)
	if err != nil {
		return nil, err
	}
	return &runtimeProc{cmd: cmd}, nil
}

// hostID maps id inside pid's user namespace to the host's, through its
// uid_map or gid_map; false if the map does not cover it.
func hostID(pid int, file string, id uint32) (uint32, bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/" + file)
	if err != nil {
		return 0, false
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) != 3 {
			continue
		}
		in, err1 := strconv.ParseUint(f[0], 10, 32)
		out, err2 := strconv.ParseUint(f[1], 10, 32)
		n, err3 := strconv.ParseUint(f[2], 10, 32)
		if err1 != nil || err2 != nil || err3 != nil {
			continue
		}
		if uint64(id) >= in && uint64(id)-in < n {
			return uint32(out + uint64(id) - in), true
		}
	}
	return 0, false
}

// sameNamespace reports whether pid is in the edge's own namespace of the
// given kind (joining one's own user namespace is an error).
func sameNamespace(pid int, kind string) bool {
	var a, b unix.Stat_t
	if unix.Stat("/proc/"+strconv.Itoa(pid)+"/ns/"+kind, &a) != nil || unix.Stat("/proc/self/ns/"+kind, &b) != nil {
		return false
	}
	return a.Ino == b.Ino && a.Dev == b.Dev
}

// runtimeProc is a process started through the runtime's exec or the exec
// helper.
type runtimeProc struct {
	cmd      *exec.Cmd
	killOnce sync.Once
	mu       sync.Mutex
	exited   bool
}

func (p *runtimeProc) Pid() int { return p.cmd.Process.Pid }

func (p *runtimeProc) Wait() (int, error) {
	err := p.cmd.Wait()
	p.mu.Lock()
	p.exited = true
	p.mu.Unlock()
	var ee *exec.ExitError
	switch {
	case err == nil:
		return 0, nil
	case errors.As(err, &ee):
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			return 128 + int(ws.Signal()), nil
		}
		return ee.ExitCode(), nil
	case errors.Is(err, exec.ErrWaitDelay):
		return p.cmd.ProcessState.ExitCode(), nil
	}
	return -1, err
}

// Kill stops and kills the whole tree under the runtime's exec process (its
// helper inside the sandbox and everything the command started that is
// still a descendant), then the runtime process itself. Processes are
// stopped before any is killed, so none can be reparented to the sandbox's
// init and escape between the walk and the kill.
func (p *runtimeProc) Kill() error {
	p.mu.Lock()
	exited := p.exited
	p.mu.Unlock()
	if exited {
		return nil
	}
	proctree.Kill(p.cmd.Process.Pid, true)
	return nil
}
