// Package container is the default sandbox backend: an OCI bundle (built
// with the runtime-spec Go types) started by dsec's own launcher
// (native.go, nsexec/launch.c) or run by crun, or runc where crun cannot
// run. pid1 is catatonit bind-mounted read-only from the host at /dev/init;
// no dsec process runs inside a sandbox. The edge enters a sandbox for exec
// and sessions through its exec helper (package nsexec), or the runtime's
// own exec in builds without cgo.
package container

import (
	"bytes"
	"context"
	"debug/elf"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/cgroup"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/sandbox"
	"github.com/dsecproject/dsec/internal/sandbox/container/nsexec"
)

// Config configures the backend.
type Config struct {
	// Runtime is the OCI runtime binary (path or name of crun or runc).
	Runtime string
	// StateRoot is the runtime's --root: its per-container state lives
	// there, separate from any system-wide runtime state.
	StateRoot string
	// Init is the host path of a static init binary (catatonit) used as pid1.
	Init string
	// Shell is the host path of a static busybox, bind-mounted read-only at
	// PinnedShell in every sandbox ("" = look up busybox; none found = no
	// pinned shell).
	Shell string
	// CgroupNS gives each sandbox its own cgroup namespace.
	CgroupNS bool
	// Cgroups is the host's cgroup layout. With it, and a build with cgo,
	// commands enter sandboxes through the exec helper (package nsexec)
	// instead of the runtime's exec.
	Cgroups *cgroup.Info
	// KeepCgroups leaves a sandbox's cgroup to the caller: Destroy and a
	// failed Create stop its processes but do not remove the cgroup
	// (the edge recycles it, cgroup.Slots). The runtime's own delete,
	// the fallback when dsec cannot find init, removes it all the same.
	KeepCgroups bool
	// RuntimeExec forces the runtime's exec even where the helper works.
	RuntimeExec bool
	// MaskDir, if set, is an empty directory (the backend creates it,
	// mode 0555) bind-mounted read-only over the masked directories that
	// exist on this kernel (/proc/acpi, /sys/firmware, ...), instead of
	// letting the runtime mount a fresh tmpfs on each (see maskMounts).
	MaskDir string
	// MaxParallel bounds the runtime starts (creates) in flight at once,
	// and separately the destroys; 0 means 2 per CPU, at least 4. Past a
	// few per core, more only add contention (cgroup_mutex, CPU): in a
	// burst of 600 creates at concurrency 64 on 2 cores, 8 at a time gave
	// the same throughput as unbounded and half its p99 (see issue 7).
	MaxParallel int
	// Native starts sandboxes with dsec's own launcher (native.go) instead
	// of the runtime's run, where it can (root, cgo, Cgroups, MaskDir, the
	// exec helper); sandboxes in a user namespace still use the runtime.
	Native bool
	// PinPath is where to bind-mount the runtime binary read-only (a file
	// path outside StateRoot); "" runs the runtime from where it is
	// installed, letting it clone itself on every call (see pin.go).
	PinPath string
	// NetnsPool is how many fresh network namespaces the launcher keeps
	// ready (netpool.go); 0: each create makes its own.
	NetnsPool int
	// Log gets what goes wrong in the background (nil: slog.Default).
	Log *slog.Logger
}

// Container runs sandboxes as OCI containers.
type Container struct {
	cfg     Config
	runtime string // resolved binary path
	flavor  string // "crun" or "runc"
	// seccomp is built once: every bundle carries the same profile.
	seccomp *specs.LinuxSeccomp
	// masked are the paths the runtime masks; maskMounts the bind mounts
	// of Config.MaskDir that mask the others (directories).
	masked     []string
	maskMounts []specs.Mount
	// filter is the profile compiled for the exec helper; nil when
	// commands go through the runtime's exec.
	filter    []unix.SockFilter
	filterB64 string
	// creating and destroying hold one token per runtime start and per
	// destroy in flight (Config.MaxParallel).
	creating, destroying chan struct{}
	// pinned: runtime is a read-only bind mount of the binary (pin.go);
	// pinErr says why not.
	pinned bool
	pinErr error
	// native: sandboxes start through the own launcher (native.go), with
	// maskOps (built once) instead of maskMounts and masked; nativeWhy
	// says why not when it is off.
	native    bool
	nativeWhy string
	// launchDeadline bounds a launch: past it, the sandbox's cgroup is
	// killed (launchWatchdog).
	launchDeadline time.Duration
	// ownerWait bounds the making of a sandbox's user namespace (0: the
	// launcher's 10 s).
	ownerWait time.Duration
	maskOps   []nsexec.Mount
	// sysfs is the sysfs every sandbox of the launcher gets a clone of
	// (sharedSysfs); nil: a sysfs each.
	sysfs    *os.File
	sysfsErr error
	// netns keeps fresh network namespaces for the launcher; nil: none.
	netns *netnsPool
	// null is /dev/null through a read-only mount (nsexec.ReadOnlyNull),
	// the stdio of runtimes and inits; nil: the plain /dev/null.
	null *os.File
	// closing: Close waits for creates and execs using the backend's fds
	// (sysfs, null).
	closing sync.RWMutex
}

// Pinned reports whether the runtime runs from a read-only bind mount
// (skipping its per-call self-clone), and if not, why.
func (c *Container) Pinned() (bool, error) { return c.pinned, c.pinErr }

// Close unmounts the pinned runtime binary and lets go of the shared
// sysfs (sandboxes keep their clones).
func (c *Container) Close() {
	c.closing.Lock()
	defer c.closing.Unlock()
	if c.sysfs != nil {
		c.sysfs.Close()
		c.sysfs = nil
	}
	if c.netns != nil {
		c.netns.close() // left set: Destroy may still read it
	}
	if c.null != nil {
		c.null.Close()
		c.null = nil
	}
	if c.pinned {
		unpinRuntime(c.runtime)
	}
}

// command builds an exec.Cmd of the runtime.
func (c *Container) command(ctx context.Context, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, c.runtime, args...)
	if c.pinned {
		cmd.Env = append(os.Environ(), clonedBinaryEnv)
	}
	return cmd
}

var (
	_ sandbox.Backend        = (*Container)(nil)
	_ sandbox.Pinner         = (*Container)(nil)
	_ sandbox.DetachedRootfs = (*Container)(nil)
)

// New checks the runtime and init binaries and returns the backend.
func New(cfg Config) (*Container, error) {
	rt, err := exec.LookPath(cfg.Runtime)
	if err != nil {
		return nil, fmt.Errorf("finding OCI runtime %q: %w", cfg.Runtime, err)
	}
	if cfg.Init == "" {
		cfg.Init = "catatonit"
	}
	init, err := exec.LookPath(cfg.Init)
	if err != nil {
		return nil, fmt.Errorf("finding init binary %q (install catatonit): %w", cfg.Init, err)
	}
	cfg.Init = init
	if cfg.Shell == "" {
		cfg.Shell = "busybox"
	}
	// The pinned shell is optional: without a static busybox on the host,
	// sandboxes simply have none.
	if sh, err := exec.LookPath(cfg.Shell); err == nil && isStatic(sh) {
		cfg.Shell = sh
	} else {
		cfg.Shell = ""
	}
	if err := os.MkdirAll(cfg.StateRoot, 0o700); err != nil {
		return nil, fmt.Errorf("creating runtime state root: %w", err)
	}
	flavor := "runc"
	if strings.Contains(filepath.Base(rt), "crun") {
		flavor = "crun"
	}
	if cfg.MaxParallel <= 0 {
		cfg.MaxParallel = max(4, 2*runtime.NumCPU())
	}
	c := &Container{cfg: cfg, runtime: rt, flavor: flavor, seccomp: seccompProfile(), masked: maskedPaths,
		creating: make(chan struct{}, cfg.MaxParallel), destroying: make(chan struct{}, cfg.MaxParallel)}
	if cfg.MaskDir != "" {
		if err := emptyDir(cfg.MaskDir); err != nil {
			return nil, err
		}
		c.maskMounts, c.masked = maskMounts(cfg.MaskDir, maskedPaths, flavor)
	}
	if os.Geteuid() == 0 && cfg.PinPath != "" {
		if pinned, err := pinRuntime(rt, cfg.PinPath); err == nil {
			c.runtime, c.pinned = pinned, true
		} else {
			c.pinErr = err
		}
	}
	if nsexec.Available && cfg.Cgroups != nil && !cfg.RuntimeExec {
		if c.filter, err = seccompBPF(); err != nil {
			return nil, err
		}
		c.filterB64 = encodeFilter(c.filter)
	}
	if os.Geteuid() == 0 {
		if c.null, err = nsexec.ReadOnlyNull(); err != nil {
			return nil, err
		}
	}
	if c.native, c.nativeWhy = nativeLauncher(cfg, c.filter != nil); c.native {
		c.maskOps = maskOps(cfg.MaskDir)
		// Without it a sysfs per sandbox still works; it costs a
		// superblock each.
		c.sysfs, c.sysfsErr = sharedSysfs()
		if cfg.NetnsPool > 0 {
			log := cfg.Log
			if log == nil {
				log = slog.Default()
			}
			if c.netns, err = newNetnsPool(cfg.NetnsPool, log); err != nil {
				log.Warn("no netns pool: creates make their own network namespaces", "err", err)
			}
		}
	}
	return c, nil
}

// ExecPath says how commands enter sandboxes: "helper" (package nsexec) or
// the runtime's name.
func (c *Container) ExecPath() string {
	if c.filter != nil {
		return "helper"
	}
	return c.flavor
}

// IsStatic reports whether the ELF file at path has no program
// interpreter (a static binary runs in any rootfs).
func IsStatic(path string) bool { return isStatic(path) }

// isStatic reports whether the ELF file at path has no program interpreter
// (a static binary runs in any rootfs).
func isStatic(path string) bool {
	f, err := elf.Open(path)
	if err != nil {
		return false
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			return false
		}
	}
	return true
}

// PinnedShell returns the in-sandbox path of the read-only shell, or "" if
// this backend has none.
func (c *Container) PinnedShell() string {
	if c.cfg.Shell == "" {
		return ""
	}
	return PinnedShell
}

// TakesDetachedRootfs implements sandbox.DetachedRootfs: the runtime is
// started in a private mount namespace in which the rootfs is attached
// (nsexec.RunInMountNS), which needs the C launcher and root.
func (c *Container) TakesDetachedRootfs() bool {
	return nsexec.Available && os.Geteuid() == 0
}

// Name implements sandbox.Backend.
func (c *Container) Name() string { return "container" }

// Runtime returns the runtime flavour in use ("crun" or "runc").
func (c *Container) Runtime() string { return c.flavor }

func (c *Container) cmd(ctx context.Context, args ...string) *exec.Cmd {
	full := append([]string{"--root", c.cfg.StateRoot}, args...)
	cmd := c.command(ctx, full...)
	cmd.WaitDelay = 5 * time.Second
	return cmd
}

func (c *Container) run(ctx context.Context, args ...string) error {
	cmd := c.cmd(ctx, args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		msg := strings.TrimSpace(out.String())
		if len(msg) > 2000 {
			msg = msg[:2000]
		}
		return fmt.Errorf("%s %s: %w: %s", c.flavor, args[0], err, msg)
	}
	return nil
}

// OwnsUserNS reports whether a user-namespace sandbox's namespace is made
// by its sandbox.IDMap.Owner (a helper of this binary, joined by the
// launcher or crun): runc before 1.2 cannot join a user namespace without
// the ID maps in the spec, so with runc as the launcher (or without cgo)
// the runtime makes it, as root.
func (c *Container) OwnsUserNS() bool {
	return nsexec.Available && (c.launchesUserNS() || c.flavor == "crun")
}

// Create implements sandbox.Backend.
func (c *Container) Create(ctx context.Context, cfg sandbox.Config) error {
	if cfg.RootfsMount != nil && !c.TakesDetachedRootfs() {
		return errdefs.Precondition("this backend cannot attach a detached rootfs (needs root and a build with cgo)")
	}
	if c.launchable(cfg) {
		return c.launch(ctx, cfg)
	}
	if c.cfg.Cgroups != nil && c.cfg.Cgroups.MemoryShared(cfg.CgroupPath) {
		// A runtime makes the cgroup in every hierarchy, memory included.
		return errdefs.Precondition("memory_cgroup shared needs dsec's launcher; this node starts sandboxes with %s (%s)", c.flavor, c.nativeWhy)
	}
	release, err := acquire(ctx, c.creating)
	if err != nil {
		return fmt.Errorf("starting container: %w", err)
	}
	defer release()
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("starting container: %w", err)
	}
	userns := "" // a user namespace made here for the runtime to join
	if m := cfg.UserNS; m != nil && m.Owner != 0 && c.OwnsUserNS() {
		// Made by the sandbox's own uid; the runtime would make one as
		// root.
		path, let, err := nsexec.UserNS(m.Owner, m.HostID, m.Size)
		if err != nil {
			return fmt.Errorf("starting container: %w", err)
		}
		defer let() // the sandbox's processes hold it from the run on
		userns = path
	}
	data, err := json.Marshal(c.spec(cfg, userns))
	if err != nil {
		return fmt.Errorf("encoding OCI spec: %w", err)
	}
	if err := os.MkdirAll(cfg.Dir, 0o700); err != nil {
		return fmt.Errorf("creating bundle dir: %w", err)
	}
	if err := os.WriteFile(filepath.Join(cfg.Dir, "config.json"), data, 0o600); err != nil {
		return fmt.Errorf("writing OCI spec: %w", err)
	}
	// The sandbox's init inherits the runtime's stdio, so the runtime gets
	// /dev/null (a pipe would stay open for the sandbox's lifetime),
	// through a read-only mount (c.null), and reports errors through a
	// log file instead.
	logPath := filepath.Join(cfg.Dir, "runtime.log")
	// --no-new-keyring: no session keyring per sandbox. The seccomp
	// profile refuses keyctl, add_key and request_key inside, and
	// commands exec'd by the helper already share the edge's.
	args := []string{"--root", c.cfg.StateRoot, "--log", logPath, "run", "-d", "--no-new-keyring", "--bundle", cfg.Dir, cfg.ID}
	// Once started, the runtime is not killed when ctx ends: killed
	// halfway, it can leave the sandbox's init running with no state file
	// to find it by. It finishes (within runtimeTimeout), then the sandbox
	// is destroyed if the caller has gone.
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), runtimeTimeout)
	defer cancel()
	if cfg.RootfsMount != nil {
		env := os.Environ()
		if c.pinned {
			env = append(env, clonedBinaryEnv)
		}
		err = nsexec.RunInMountNS(rctx, cfg.RootfsMount, cfg.Rootfs, env, append([]string{c.runtime}, args...), c.null)
	} else {
		cmd := c.command(rctx, args...)
		if c.null != nil {
			cmd.Stdin, cmd.Stdout, cmd.Stderr = c.null, c.null, c.null
		}
		err = cmd.Run()
	}
	if err == nil && ctx.Err() != nil {
		err = ctx.Err()
	}
	if err != nil {
		msg, _ := os.ReadFile(logPath)
		if len(msg) > 2000 {
			msg = msg[len(msg)-2000:]
		}
		err = fmt.Errorf("%s run: %w: %s", c.flavor, err, strings.TrimSpace(string(msg)))
		// The runtime may have left state, a process or a cgroup behind.
		_ = c.Destroy(context.Background(), cfg.ID)
		if c.cfg.Cgroups != nil && cfg.CgroupPath != "" && !c.cfg.KeepCgroups {
			_ = c.cfg.Cgroups.Remove(cfg.CgroupPath)
		}
		return fmt.Errorf("starting container: %w", err)
	}
	return nil
}

// runtimeTimeout bounds one `run -d` of the runtime.
const runtimeTimeout = 2 * time.Minute

// Destroy implements sandbox.Backend. With the host's cgroup layout known
// (Config.Cgroups), the backend does what `<runtime> delete -f` does
// without running it: SIGKILL to the sandbox's init through a pidfd (the
// kernel then kills everything in its pid namespace), wait for it to die,
// remove the sandbox's cgroups (killing any straggler; with KeepCgroups
// that is the caller's) and the runtime's state directory. That saves a
// runtime process per delete, which bounds teardown rate on a small node.
// Without the layout, it runs the runtime.
func (c *Container) Destroy(ctx context.Context, id string) error {
	dir := filepath.Join(c.cfg.StateRoot, id)
	if _, err := os.Stat(dir); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	// A destroy waits for its slot whatever its context says: giving up
	// here would leave the sandbox's processes running.
	release, _ := acquire(context.Background(), c.destroying)
	defer release()
	if c.netns != nil {
		c.netns.busy()
	}
	if c.cfg.Cgroups != nil {
		if done, err := c.destroyDirect(ctx, dir); done || err != nil {
			return err
		}
	}
	err := c.run(ctx, "delete", "-f", id)
	if err != nil && strings.Contains(err.Error(), "does not exist") {
		err = nil
	}
	if err != nil {
		return fmt.Errorf("deleting container: %w", err)
	}
	// runc keeps nothing after delete; crun may leave an empty dir on error paths.
	_ = os.RemoveAll(dir)
	return nil
}

// acquire takes a token of sem, waiting for one at most until ctx ends,
// and returns its release. A free token is taken even if ctx has ended.
func acquire(ctx context.Context, sem chan struct{}) (func(), error) {
	release := func() { <-sem }
	select {
	case sem <- struct{}{}:
		return release, nil
	default:
	}
	select {
	case sem <- struct{}{}:
		return release, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// destroyDirect is Destroy without the runtime. It reports false (and
// does nothing) when the state file does not say which process is init,
// so the caller falls back to the runtime.
func (c *Container) destroyDirect(ctx context.Context, dir string) (bool, error) {
	pid, start, ok := readStateFile(dir)
	if !ok {
		return false, nil
	}
	if alive(pid, start) {
		rel := "" // the cgroup to remove once init is dead
		if !c.cfg.KeepCgroups {
			if r, err := c.cfg.Cgroups.RelOf(pid); err == nil && r != "/" {
				rel = r
			}
		}
		pidfd, err := unix.PidfdOpen(pid, 0)
		if err == nil && alive(pid, start) {
			err = unix.PidfdSendSignal(pidfd, unix.SIGKILL, nil, 0)
			if err == nil {
				err = waitPidfd(ctx, pidfd)
			}
		}
		if pidfd >= 0 {
			unix.Close(pidfd)
		}
		if err != nil && !errors.Is(err, unix.ESRCH) {
			return true, fmt.Errorf("killing sandbox init %d: %w", pid, err)
		}
		if rel != "" {
			if err := c.cfg.Cgroups.Remove(rel); err != nil {
				return true, fmt.Errorf("removing sandbox cgroup: %w", err)
			}
		}
	}
	if err := os.RemoveAll(dir); err != nil {
		return true, fmt.Errorf("removing runtime state: %w", err)
	}
	return true, nil
}

// WaitPidfd is waitPidfd, for other backends that kill their sandboxes'
// processes through a pidfd.
func WaitPidfd(ctx context.Context, pidfd int) error { return waitPidfd(ctx, pidfd) }

// Running reports whether pid runs and is not a zombie.
func Running(pid int) bool { return alive(pid, 0) }

// waitPidfd waits until the process behind pidfd has exited (the pidfd
// turns readable), for at most 10 s or until ctx ends.
func waitPidfd(ctx context.Context, pidfd int) error {
	deadline := time.Now().Add(10 * time.Second)
	for {
		fds := []unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}}
		n, err := unix.Poll(fds, 100)
		if err != nil && !errors.Is(err, unix.EINTR) {
			return err
		}
		if n > 0 {
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if time.Now().After(deadline) {
			return errors.New("still alive 10 s after SIGKILL")
		}
	}
}

// Status implements sandbox.Backend. It reads the runtime's own state file
// (crun: status, runc: state.json) and /proc instead of exec'ing the
// runtime, so the edge can check every sandbox's liveness cheaply; it
// falls back to `state` for a layout it does not know.
func (c *Container) Status(ctx context.Context, id string) (sandbox.Status, error) {
	dir := filepath.Join(c.cfg.StateRoot, id)
	if _, err := os.Stat(dir); errors.Is(err, os.ErrNotExist) {
		return sandbox.Status{}, errdefs.NotFound("container %s does not exist", id)
	}
	if pid, start, ok := readStateFile(dir); ok {
		return sandbox.Status{Running: alive(pid, start), Pid: pid}, nil
	}
	cmd := c.cmd(ctx, "state", id)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		if strings.Contains(stderr.String(), "does not exist") {
			return sandbox.Status{}, errdefs.NotFound("container %s does not exist", id)
		}
		return sandbox.Status{}, fmt.Errorf("%s state: %w: %s", c.flavor, err, strings.TrimSpace(stderr.String()))
	}
	var st specs.State
	if err := json.Unmarshal(out, &st); err != nil {
		return sandbox.Status{}, fmt.Errorf("decoding %s state: %w", c.flavor, err)
	}
	running := st.Status == specs.StateRunning && st.Pid > 0 && alive(st.Pid, 0)
	return sandbox.Status{Running: running, Pid: st.Pid}, nil
}

// readStateFile reads the init pid and its start time (clock ticks after
// boot, as in /proc/PID/stat) from crun's or runc's state file.
func readStateFile(dir string) (pid int, start uint64, ok bool) {
	if b, err := os.ReadFile(filepath.Join(dir, "status")); err == nil {
		var st struct {
			Pid   int    `json:"pid"`
			Start uint64 `json:"process-start-time"`
		}
		if json.Unmarshal(b, &st) == nil && st.Pid > 0 {
			return st.Pid, st.Start, true
		}
	}
	if b, err := os.ReadFile(filepath.Join(dir, "state.json")); err == nil {
		var st struct {
			Pid   int    `json:"init_process_pid"`
			Start uint64 `json:"init_process_start"`
		}
		if json.Unmarshal(b, &st) == nil && st.Pid > 0 {
			return st.Pid, st.Start, true
		}
	}
	return 0, 0, false
}

// alive reports whether pid runs and is not a zombie; with start non-zero,
// also that it is the same process (pids are reused).
func alive(pid int, start uint64) bool {
	got, running, err := procStart(pid)
	return err == nil && running && (start == 0 || got == start)
}

// procStart reads a process's start time (clock ticks after boot) from
// /proc/PID/stat, and whether it runs (is not a zombie or dead).
func procStart(pid int) (start uint64, running bool, err error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, false, err
	}
	// Fields after the command name, which is in parentheses and may hold
	// spaces: state is the first, starttime the 20th.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, false, errors.New("unreadable /proc/PID/stat")
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 20 {
		return 0, false, errors.New("short /proc/PID/stat")
	}
	start, err = strconv.ParseUint(f[19], 10, 64)
	return start, f[0] != "Z" && f[0] != "X", err
}

// List implements sandbox.Backend. Both crun and runc keep one directory
// per container under --root, which is cheaper to read than `list`.
func (c *Container) List(ctx context.Context) ([]string, error) {
	ents, err := os.ReadDir(c.cfg.StateRoot)
	if err != nil {
		return nil, fmt.Errorf("listing runtime state: %w", err)
	}
	var ids []string
	for _, e := range ents {
		if e.IsDir() {
			ids = append(ids, e.Name())
		}
	}
	return ids, nil
}
