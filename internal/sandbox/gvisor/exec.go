package gvisor

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/sandbox"
	"github.com/dsecproject/dsec/internal/sandbox/container"
	"github.com/dsecproject/dsec/internal/sandbox/container/nsexec"
)

var (
	_ sandbox.InnerSignaler = (*GVisor)(nil)
	_ sandbox.InnerProc     = (*gproc)(nil)
)

// Exec implements sandbox.Backend with runsc exec. The process profile
// (capabilities, no_new_privs, rlimits, user) goes as a process.json in a
// memfd. Stdio are always pipes (or the caller's terminal): a host file
// such as /dev/null handed to the Sentry could be changed through it.
func (g *GVisor) Exec(ctx context.Context, id string, p sandbox.Process) (sandbox.Proc, error) {
	if len(p.Args) == 0 {
		return nil, errors.New("exec: empty argv")
	}
	st, err := readState(g.cfg.StateRoot, id)
	if err != nil {
		return nil, err
	}
	if st.Status != "running" && st.Status != "paused" {
		return nil, errdefs.Precondition("gvisor sandbox %s is %s", id, st.Status)
	}
	if p.Private {
		return g.execPrivate(ctx, id, p)
	}
	proc := g.process(p)
	data, err := json.Marshal(proc)
	if err != nil {
		return nil, fmt.Errorf("encoding process spec: %w", err)
	}
	mf, err := nsexec.Memfd("process.json", data)
	if err != nil {
		return nil, err
	}
	defer mf.Close()
	pidFile, err := g.pidFile()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(g.runsc, append(g.flags(), "exec", "--process", "/proc/self/fd/3", "--internal-pid-file", pidFile, g.target(id))...)
	cmd.ExtraFiles = []*os.File{mf}
	cmd.Stdin, cmd.Stdout, cmd.Stderr = p.Stdin, p.Stdout, p.Stderr
	if p.TTY {
		// runsc exec leads a session on the terminal: what the terminal
		// raises (^C, ^Z, a hangup when it closes) goes to it, and it
		// forwards it to the command's foreground process group inside.
		cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Setctty: true, Ctty: 0}
	}
	if cmd.Stdin == nil {
		cmd.Stdin = bytes.NewReader(nil)
	}
	if cmd.Stdout == nil {
		cmd.Stdout = io.Discard
	}
	if cmd.Stderr == nil {
		cmd.Stderr = io.Discard
	}
	// Once the command has exited, its output is what has been written:
	// a background process it left holding stdout (inside the Sentry,
	// out of reach of the pipe's closing) must not hold the call.
	cmd.WaitDelay = time.Second
	if err := cmd.Start(); err != nil {
		os.Remove(pidFile)
		return nil, fmt.Errorf("starting runsc exec: %w", err)
	}
	return &gproc{g: g, id: id, cmd: cmd, pidFile: pidFile}, nil
}

// process is the OCI process that runs p. The helper installs the seccomp
// profile (runsc gives it to a container's init only) and takes
// DSEC_SECCOMP out of the environment before the command sees it.
func (g *GVisor) process(p sandbox.Process) *specs.Process {
	env := p.Env
	if !hasPath(env) {
		env = append([]string{container.DefaultPath}, env...)
	}
	cwd := p.Cwd
	if cwd == "" {
		cwd = "/"
	}
	return &specs.Process{
		Terminal:        p.TTY,
		Args:            append([]string{execHelperPath}, p.Args...),
		Env:             slices.Concat(env, []string{g.filter}),
		Cwd:             cwd,
		User:            specs.User{UID: p.UID, GID: p.GID, AdditionalGids: p.AdditionalGIDs},
		NoNewPrivileges: true,
		Capabilities:    container.Caps(p.UID),
		Rlimits:         container.Rlimits(),
	}
}

func hasPath(env []string) bool {
	for _, e := range env {
		if strings.HasPrefix(e, "PATH=") {
			return true
		}
	}
	return false
}

// pidFile returns a fresh path for runsc exec's --internal-pid-file.
func (g *GVisor) pidFile() (string, error) {
	dir := filepath.Join(g.cfg.StateRoot, "exec")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", fmt.Errorf("creating exec dir: %w", err)
	}
	f, err := os.CreateTemp(dir, "pid-")
	if err != nil {
		return "", fmt.Errorf("creating pid file: %w", err)
	}
	f.Close()
	return f.Name(), nil
}

// gproc is a process started by runsc exec.
type gproc struct {
	g       *GVisor
	id      string
	cmd     *exec.Cmd
	pidFile string

	once sync.Once
	code int
	err  error
}

// Wait implements sandbox.Proc: runsc exec exits with the process's status.
func (p *gproc) Wait() (int, error) {
	p.once.Do(func() {
		err := p.cmd.Wait()
		os.Remove(p.pidFile)
		var ee *exec.ExitError
		switch {
		case err == nil, errors.Is(err, exec.ErrWaitDelay): // exited 0; see WaitDelay
		case errors.As(err, &ee):
			ws, _ := ee.Sys().(syscall.WaitStatus)
			if ws.Signaled() {
				p.code = 128 + int(ws.Signal())
			} else {
				p.code = ee.ExitCode()
			}
		default:
			p.code, p.err = -1, err
		}
	})
	return p.code, p.err
}

// Pid implements sandbox.Proc: the process has no host pid of its own.
func (p *gproc) Pid() int { return 0 }

// InnerPid implements sandbox.InnerProc: the pid runsc exec writes once
// the command runs, waited for (at most 2 s) while runsc exec runs.
func (p *gproc) InnerPid() int {
	for deadline := time.Now().Add(2 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if pid := p.innerPid(); pid > 0 {
			return pid
		}
		if p.cmd.Process.Signal(syscall.Signal(0)) != nil {
			break
		}
	}
	return p.innerPid()
}

// innerPid is the process's pid in the sandbox, once runsc has said it.
func (p *gproc) innerPid() int {
	b, err := os.ReadFile(p.pidFile)
	if err != nil {
		return 0
	}
	n, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	return n
}

// Kill implements sandbox.Proc: SIGKILL to the process and every
// descendant of it in the sandbox, then to runsc exec.
func (p *gproc) Kill() error {
	if p.cmd.ProcessState != nil {
		return nil
	}
	pid := 0
	for deadline := time.Now().Add(2 * time.Second); pid == 0 && time.Now().Before(deadline); {
		if pid = p.innerPid(); pid == 0 {
			if p.cmd.ProcessState != nil || p.cmd.Process.Signal(syscall.Signal(0)) != nil {
				return nil
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	p.g.log.Debug("killing a gvisor command", "sandbox_id", p.id, "pid", pid)
	if pid > 0 {
		if err := p.g.Signal(context.Background(), p.id, pid, unix.SIGKILL, true, true); err != nil && !errors.Is(err, errdefs.ErrNotFound) {
			return err
		}
	}
	_ = p.cmd.Process.Kill()
	return nil
}

// Signal implements sandbox.InnerSignaler: sig to process pid of the
// sandbox (with self) and to its descendants (with tree), found with
// runsc ps and sent with runsc kill. For a tree, every member is stopped
// first, walk after walk until a walk finds no new one (a stopped process
// cannot fork, and none can be reparented away between a walk and its
// signal), then all of them get sig and, after a stop, SIGCONT.
func (g *GVisor) Signal(ctx context.Context, id string, pid int, sig syscall.Signal, self, tree bool) error {
	if !tree {
		return g.kill(ctx, id, pid, sig)
	}
	members := map[int]bool{pid: true}
	stopped := map[int]bool{}
	for round := 0; round < 32; round++ {
		procs, err := g.ps(ctx, id)
		if err != nil {
			return err
		}
		grew := false
		for changed := true; changed; {
			changed = false
			for _, p := range procs {
				if !members[p.pid] && members[p.ppid] {
					members[p.pid], changed, grew = true, true, true
				}
			}
		}
		n := 0
		for m := range members {
			if !stopped[m] && (m != pid || self) {
				_ = g.kill(ctx, id, m, syscall.SIGSTOP)
				stopped[m] = true
				n++
			}
		}
		if !grew && n == 0 {
			break
		}
	}
	var firstErr error
	for m := range members {
		if m == pid && !self {
			continue
		}
		if err := g.kill(ctx, id, m, sig); err != nil && firstErr == nil {
			firstErr = err
		}
		if sig != syscall.SIGKILL {
			_ = g.kill(ctx, id, m, syscall.SIGCONT)
		}
	}
	return firstErr
}

// kill sends sig to process pid of sandbox id; one that has ended is no
// error.
func (g *GVisor) kill(ctx context.Context, id string, pid int, sig syscall.Signal) error {
	_, err := g.run(ctx, "kill", "--pid", strconv.Itoa(pid), g.target(id), strconv.Itoa(int(sig)))
	g.log.Debug("signalling a gvisor sandbox's process", "sandbox_id", id, "pid", pid, "signal", int(sig), "err", err)
	if err != nil && strings.Contains(err.Error(), "no such process") {
		return nil
	}
	return err
}

// psEntry is one line of runsc ps.
type psEntry struct{ pid, ppid int }

// ps lists the sandbox's processes.
func (g *GVisor) ps(ctx context.Context, id string) ([]psEntry, error) {
	out, err := g.run(ctx, "ps", g.target(id))
	if err != nil {
		if _, serr := readState(g.cfg.StateRoot, id); errors.Is(serr, errdefs.ErrNotFound) {
			return nil, serr
		}
		return nil, err
	}
	return parsePS(out), nil
}

// parsePS reads runsc ps's table (UID PID PPID ...).
func parsePS(out []byte) []psEntry {
	var procs []psEntry
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) < 3 {
			continue
		}
		pid, err1 := strconv.Atoi(f[1])
		ppid, err2 := strconv.Atoi(f[2])
		if err1 == nil && err2 == nil {
			procs = append(procs, psEntry{pid, ppid})
		}
	}
	return procs
}
