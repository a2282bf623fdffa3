// Package gvisor is the gVisor backend ("backend": "gvisor"): the same
// sandbox as the container backend (the overlay rootfs the edge composes,
// catatonit as pid1, dsec's capabilities, rlimits, cgroup limits and
// seccomp profile) run by runsc under gVisor's user-space kernel, so the
// sandbox's system calls reach the Sentry, not the host kernel.
//
// Flags, and why:
//   - --file-access=shared and --overlay2=none: the rootfs is the host's
//     overlay, served by the gofer and revalidated on every lookup, so what
//     the edge writes or reads on the host (the files API, snapshots of the
//     upper layer, forks) is what the sandbox sees. runsc's defaults (an
//     exclusive root, newer builds also an in-memory overlay) would let the
//     two views diverge and keep the sandbox's writes in the Sentry's memory.
//   - --oci-seccomp: the bundle's seccomp profile (dsec's, the container
//     backend's) is enforced by the Sentry on the sandboxed program too.
//   - --network=sandbox: gVisor's own network stack, configured from the
//     sandbox's network namespace when the sandbox starts; the edge attaches
//     the veth (and its host-side policy) between create and start
//     (sandbox.Config.AttachNetwork).
//
// The edge owns the process tree of none of the sandbox's programs: host
// pids are the Sentry's and the gofer's, so commands are started, listed
// and killed through runsc (exec, ps, kill).
//
// A sandbox is three kinds of container in one Sentry. The root container
// (named as the sandbox) holds the cgroup, the network and the Sentry's
// root pid namespace, and runs only the follower (seccomp_exec.csrc), which
// ends the sandbox when the sandbox's init is gone. The sandbox's own
// container ("w-" and the id) is a subcontainer in a pid namespace of its
// own, and every command runs in it. A private run (a grader's) is one more
// subcontainer ("p", a number, "-" and the id) on the same rootfs, in a pid
// namespace beside the sandbox's: gVisor makes each subcontainer's pid
// namespace a child of the root's, so the sandbox's processes cannot see or
// signal it, while the root, where nothing of the sandbox runs, could.
package gvisor

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/cgroup"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/sandbox"
	"github.com/dsecproject/dsec/internal/sandbox/container"
)

// Config configures the backend.
type Config struct {
	// Runsc is the runsc binary (path or name; "" = "runsc").
	Runsc string
	// StateRoot is runsc's --root: its per-sandbox state lives there.
	StateRoot string
	// Init is a static init binary shown at /dev/init as pid1 ("" =
	// catatonit); Shell a static busybox shown read-only at /dev/sh ("" =
	// busybox; none found = no pinned shell).
	Init, Shell string
	// Platform is runsc's --platform ("" = runsc's default, ptrace).
	Platform string
	// Cgroups, if set, is the host's cgroup layout: Destroy then removes
	// the sandbox's cgroup (killing what is left in it).
	Cgroups *cgroup.Info
	// Log gets what goes wrong in the background (nil: slog.Default).
	Log *slog.Logger
}

// GVisor runs sandboxes under runsc.
type GVisor struct {
	cfg     Config
	runsc   string
	seccomp *specs.LinuxSeccomp
	// helper is the host path of the exec helper (helper.go); filter the
	// profile it installs, as DSEC_SECCOMP.
	helper, filter string
	// hideNetSysctl: runsc's start refuses a network namespace it takes
	// for the host's (see startArgs); it then runs in a mount namespace
	// of its own in which /proc/sys/net is hidden.
	hideNetSysctl bool
	// pauseRoot is the root filesystem of every sandbox's root container:
	// empty but for its mount points, read-only.
	pauseRoot string
	log       *slog.Logger

	// sink is the write end of a pipe whose read end a goroutine drains
	// for as long as the process runs: the stdout and stderr of runsc
	// create and start, and so of every sandbox's init (sinkOnce makes it).
	sinkOnce sync.Once
	sink     *os.File
	sinkErr  error
}

var (
	_ sandbox.Backend      = (*GVisor)(nil)
	_ sandbox.Pauser       = (*GVisor)(nil)
	_ sandbox.Pinner       = (*GVisor)(nil)
	_ sandbox.NetworkFirst = (*GVisor)(nil)
)

// New checks runsc and the init binary and returns the backend.
func New(cfg Config) (*GVisor, error) {
	if cfg.Runsc == "" {
		cfg.Runsc = "runsc"
	}
	rs, err := exec.LookPath(cfg.Runsc)
	if err != nil {
		return nil, fmt.Errorf("finding runsc %q (apt-get install runsc): %w", cfg.Runsc, err)
	}
	if cfg.Init == "" {
		cfg.Init = "catatonit"
	}
	if cfg.Init, err = exec.LookPath(cfg.Init); err != nil {
		return nil, fmt.Errorf("finding init binary (install catatonit): %w", err)
	}
	if cfg.Shell == "" {
		cfg.Shell = "busybox"
	}
	if sh, err := exec.LookPath(cfg.Shell); err == nil && container.IsStatic(sh) {
		cfg.Shell = sh
	} else {
		cfg.Shell = ""
	}
	if err := os.MkdirAll(cfg.StateRoot, 0o700); err != nil {
		return nil, fmt.Errorf("creating runsc state root: %w", err)
	}
	log := cfg.Log
	if log == nil {
		log = slog.Default()
	}
	helper, err := buildExecHelper(filepath.Join(cfg.StateRoot, "bin"))
	if err != nil {
		return nil, err
	}
	filter, err := container.SeccompFilterBase64()
	if err != nil {
		return nil, err
	}
	pauseRoot := filepath.Join(cfg.StateRoot, "pause-root")
	for _, d := range []string{"dev", "proc"} {
		if err := os.MkdirAll(filepath.Join(pauseRoot, d), 0o555); err != nil {
			return nil, fmt.Errorf("creating the root container's rootfs: %w", err)
		}
	}
	g := &GVisor{cfg: cfg, runsc: rs, seccomp: container.SeccompProfile(), helper: helper, filter: "DSEC_SECCOMP=" + filter,
		hideNetSysctl: netSysctlEverywhere(), pauseRoot: pauseRoot, log: log}
	g.removeOrphans(filepath.Join(cfg.StateRoot, "private"))
	return g, nil
}

// Name implements sandbox.Backend.
func (g *GVisor) Name() string { return "gvisor" }

// Version returns what runsc says of itself (its first line).
func (g *GVisor) Version() string {
	out, err := exec.Command(g.runsc, "--version").Output()
	if err != nil {
		return "unknown"
	}
	line, _, _ := strings.Cut(string(out), "\n")
	return strings.TrimSpace(line)
}

// PinnedShell implements sandbox.Pinner.
func (g *GVisor) PinnedShell() string {
	if g.cfg.Shell == "" {
		return ""
	}
	return container.PinnedShell
}

// NetworkFirst implements sandbox.NetworkFirst: gVisor's network stack
// copies the sandbox's interfaces once, when the sandbox starts.
func (g *GVisor) NetworkFirst() bool { return true }

// flags are runsc's global flags, the same on every call for a sandbox.
func (g *GVisor) flags() []string {
	f := []string{"--root", g.cfg.StateRoot, "--network=sandbox", "--file-access=shared", "--overlay2=none", "--oci-seccomp"}
	if g.cfg.Platform != "" {
		f = append(f, "--platform="+g.cfg.Platform)
	}
	return f
}

// command builds a runsc command with the global flags.
func (g *GVisor) command(ctx context.Context, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, g.runsc, append(g.flags(), args...)...)
	cmd.WaitDelay = 5 * time.Second
	return cmd
}

// run runs a runsc command that donates no stdio to the sandbox and
// returns its error with what it printed.
func (g *GVisor) run(ctx context.Context, args ...string) ([]byte, error) {
	cmd := g.command(ctx, args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return out, fmt.Errorf("runsc %s: %w: %s", args[0], err, clip(stderr.String()))
	}
	return out, nil
}

func clip(s string) string {
	s = strings.TrimSpace(s)
	if len(s) > 2000 {
		s = s[len(s)-2000:]
	}
	return s
}

// runLogged runs a runsc command whose stdio become the sandbox's (create,
// start): they get pipes of their own (below), and runsc's errors are read
// from its log.
func (g *GVisor) runLogged(ctx context.Context, logPath string, wrap []string, args ...string) error {
	full := append(append([]string{}, g.flags()...), append([]string{"--log", logPath, "--log-format", "json"}, args...)...)
	var cmd *exec.Cmd
	if len(wrap) > 0 {
		cmd = exec.CommandContext(ctx, wrap[0], append(append(wrap[1:], g.runsc), full...)...)
	} else {
		cmd = exec.CommandContext(ctx, g.runsc, full...)
	}
	cmd.WaitDelay = 5 * time.Second
	// Not the host's /dev/null, which os/exec would open for nil stdio:
	// runsc gives its stdio to the sandbox's user (fchown to nobody), and
	// the host's /dev/null became nobody's, writable by the Sentry's uid.
	// Pipes instead: stdin one whose other end is closed (EOF), stdout and
	// stderr the edge's sink, drained and dropped. (A pipe nobody reads
	// would kill runsc, a Go program, with SIGPIPE at its first warning;
	// after an edge restart the old sandboxes' writes fail with EPIPE.)
	in, err := eofPipe()
	if err != nil {
		return fmt.Errorf("runsc %s: %w", args[0], err)
	}
	out, err := g.drained()
	if err != nil {
		in.Close()
		return fmt.Errorf("runsc %s: %w", args[0], err)
	}
	cmd.Stdin, cmd.Stdout, cmd.Stderr = in, out, out
	err = cmd.Run()
	in.Close()
	if err != nil {
		return fmt.Errorf("runsc %s: %w: %s", args[0], err, logErrors(logPath))
	}
	return nil
}

// eofPipe returns the read end of a pipe whose write end is closed.
func eofPipe() (*os.File, error) {
	r, w, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	w.Close()
	return r, nil
}

// drained returns the write end of the sink (see GVisor.sink).
func (g *GVisor) drained() (*os.File, error) {
	g.sinkOnce.Do(func() {
		r, w, err := os.Pipe()
		if err != nil {
			g.sinkErr = err
			return
		}
		g.sink = w
		go func() { _, _ = io.Copy(io.Discard, r) }()
	})
	return g.sink, g.sinkErr
}

// logErrors returns the error lines of a runsc JSON log.
func logErrors(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	var msgs []string
	dec := json.NewDecoder(bytes.NewReader(b))
	for {
		var m struct{ Msg, Level string }
		if dec.Decode(&m) != nil {
			break
		}
		if m.Level == "error" || m.Level == "warning" && strings.Contains(m.Msg, "rror") {
			msgs = append(msgs, m.Msg)
		}
	}
	if len(msgs) == 0 {
		return clip(string(b))
	}
	return clip(strings.Join(msgs, "; "))
}

// runscTimeout bounds one create or start.
const runscTimeout = 2 * time.Minute

// Create implements sandbox.Backend: runsc create, then cfg.AttachNetwork
// with the Sentry's pid (whose network namespace is the sandbox's), then
// runsc start. On error nothing of it is left.
func (g *GVisor) Create(ctx context.Context, cfg sandbox.Config) (err error) {
	switch {
	case cfg.RootfsMount != nil || cfg.Rootfs == "":
		return errdefs.Precondition("the gvisor backend needs the rootfs mounted on the host")
	case cfg.UserNS != nil:
		return errdefs.Precondition("the gvisor backend does not run sandboxes in a host user namespace (root inside is the Sentry's, not the host's); omit userns")
	}
	workload := filepath.Join(cfg.Dir, "workload")
	if err := os.MkdirAll(workload, 0o700); err != nil {
		return fmt.Errorf("creating bundle dir: %w", err)
	}
	// /tmp is the rootfs's own (as in a container): without a mount there,
	// runsc would put a tmpfs on it that the host cannot see.
	if err := ensureTmp(cfg.Rootfs); err != nil {
		return err
	}
	if err := writeSpec(cfg.Dir, g.rootSpec(cfg)); err != nil {
		return err
	}
	// The bundle goes once the sandbox runs; private runs start from the
	// copy kept with the backend's state.
	wspec, err := json.Marshal(subcontainer(g.spec(cfg), cfg.ID))
	if err != nil {
		return fmt.Errorf("encoding OCI spec: %w", err)
	}
	if err := os.WriteFile(filepath.Join(workload, "config.json"), wspec, 0o600); err != nil {
		return fmt.Errorf("writing OCI spec: %w", err)
	}
	// Once started, runsc is not killed when ctx ends (half a create can
	// leave a Sentry with no state to find it by); the sandbox is
	// destroyed after, if the caller has gone.
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), runscTimeout)
	defer cancel()
	defer func() {
		if err == nil && ctx.Err() != nil {
			err = ctx.Err()
		}
		if err != nil {
			_ = g.Destroy(context.Background(), cfg.ID)
			err = fmt.Errorf("starting gvisor sandbox: %w", err)
		}
	}()
	// First: a failed create's cgroup is found by it.
	if err := g.saveMeta(cfg.ID, meta{Pids: cfg.Limits.Pids, Cgroup: cfg.CgroupPath, Split: true}); err != nil {
		return err
	}
	if err := os.WriteFile(g.specPath(cfg.ID), wspec, 0o600); err != nil {
		return fmt.Errorf("saving sandbox spec: %w", err)
	}
	logPath := filepath.Join(cfg.Dir, "runsc.log")
	if err := g.runLogged(rctx, logPath, nil, "create", "--bundle", cfg.Dir, cfg.ID); err != nil {
		return err
	}
	st, err := readState(g.cfg.StateRoot, cfg.ID)
	if err != nil {
		return err
	}
	// The network stack copies only interfaces that are up: a fresh
	// namespace's lo is down.
	if err := loUp(st.Sandbox.Pid); err != nil {
		return err
	}
	if cfg.AttachNetwork != nil {
		if err := cfg.AttachNetwork(st.Sandbox.Pid); err != nil {
			return fmt.Errorf("attaching network: %w", err)
		}
	}
	if err := g.runLogged(rctx, logPath, g.startWrap(), "start", cfg.ID); err != nil {
		return err
	}
	if err := g.runLogged(rctx, logPath, nil, "create", "--bundle", workload, workloadID(cfg.ID)); err != nil {
		return err
	}
	return g.runLogged(rctx, logPath, nil, "start", workloadID(cfg.ID))
}

// workloadID is the container id of sandbox id's own container.
func workloadID(id string) string { return "w-" + id }

// target is the container id commands of sandbox id run in: its own
// container, or for a sandbox made before the root was split from it, the
// one container it has.
func (g *GVisor) target(id string) string {
	if g.meta(id).Split {
		return workloadID(id)
	}
	return id
}

// writeSpec writes spec as dir's config.json.
func writeSpec(dir string, spec *specs.Spec) error {
	data, err := json.Marshal(spec)
	if err != nil {
		return fmt.Errorf("encoding OCI spec: %w", err)
	}
	if err := os.WriteFile(filepath.Join(dir, "config.json"), data, 0o600); err != nil {
		return fmt.Errorf("writing OCI spec: %w", err)
	}
	return nil
}

// subcontainer makes spec that of a container in sandbox id's Sentry: its
// cgroup and limits are the root container's (runsc would otherwise apply
// them again, and remove the cgroup when the subcontainer goes).
func subcontainer(spec *specs.Spec, id string) *specs.Spec {
	spec.Annotations = map[string]string{
		"io.kubernetes.cri.container-type": "container",
		"io.kubernetes.cri.sandbox-id":     id,
	}
	spec.Linux.CgroupsPath = ""
	spec.Linux.Resources = nil
	return spec
}

// rootSpec is the root container's: the sandbox's cgroup, limits, hostname
// and namespaces, the follower as its only process, no capabilities.
func (g *GVisor) rootSpec(cfg sandbox.Config) *specs.Spec {
	spec := g.spec(cfg)
	spec.Root = &specs.Root{Path: g.pauseRoot, Readonly: true}
	spec.Mounts = []specs.Mount{
		{Destination: "/proc", Type: "proc", Source: "proc", Options: []string{"nosuid", "noexec", "nodev"}},
		{Destination: "/dev", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "noexec", "mode=755", "size=64k"}},
		{Destination: execHelperPath, Type: "bind", Source: g.helper, Options: []string{"bind", "ro", "nosuid", "nodev"}},
	}
	spec.Process = &specs.Process{
		Args:            []string{execHelperPath, "--dsec-follow"},
		Env:             []string{container.DefaultPath},
		Cwd:             "/",
		NoNewPrivileges: true,
		OOMScoreAdj:     container.OOMScoreAdj(),
		Capabilities:    &specs.LinuxCapabilities{},
	}
	return spec
}

// startWrap is the command runsc start runs under, if any.
//
// Why: runsc (this Debian build) takes a network namespace for the host's
// when /proc/sys/net/core/rmem_default exists in it, which was true only
// of the initial namespace on older kernels; newer kernels (this one,
// 6.18) show it in every namespace, so runsc refuses to start any sandbox
// with networking. Hiding /proc/sys/net in a private mount namespace for
// that one command makes the check see what it meant to see. Nothing else
// runsc start does reads /proc/sys/net.
func (g *GVisor) startWrap() []string {
	if !g.hideNetSysctl {
		return nil
	}
	return []string{"unshare", "--mount", "--propagation", "private", "--", "sh", "-c", `mount -t tmpfs -o size=4k,mode=0555 none /proc/sys/net && exec "$@"`, "runsc-start"}
}

// netSysctlEverywhere reports whether a fresh network namespace shows
// net.core.rmem_default (see startWrap).
func netSysctlEverywhere() bool {
	out, err := exec.Command("unshare", "--net", "--", "sh", "-c", "test -e /proc/sys/net/core/rmem_default && echo yes").Output()
	return err == nil && strings.TrimSpace(string(out)) == "yes"
}

// ensureTmp makes the rootfs's /tmp if it has none.
func ensureTmp(rootfs string) error {
	p := filepath.Join(rootfs, "tmp")
	st, err := os.Lstat(p)
	switch {
	case err == nil && st.IsDir():
		return nil
	case err == nil:
		return errdefs.Precondition("the image's /tmp is not a directory")
	case !errors.Is(err, os.ErrNotExist):
		return fmt.Errorf("checking rootfs /tmp: %w", err)
	}
	if err := os.Mkdir(p, 0o1777); err != nil {
		return fmt.Errorf("creating rootfs /tmp: %w", err)
	}
	return os.Chmod(p, 0o1777|os.ModeSticky)
}

// spec is the container backend's bundle, with gVisor's mounts.
func (g *GVisor) spec(cfg sandbox.Config) *specs.Spec {
	mounts := []specs.Mount{
		{Destination: "/proc", Type: "proc", Source: "proc", Options: []string{"nosuid", "noexec", "nodev"}},
		{Destination: "/dev", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "strictatime", "mode=755", "size=65536k"}},
		{Destination: "/dev/pts", Type: "devpts", Source: "devpts", Options: []string{"nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"}},
		{Destination: "/dev/shm", Type: "tmpfs", Source: "shm", Options: []string{"nosuid", "noexec", "nodev", "mode=1777", "size=65536k"}},
		{Destination: "/sys", Type: "sysfs", Source: "sysfs", Options: []string{"nosuid", "noexec", "nodev", "ro"}},
		{Destination: "/tmp", Type: "bind", Source: filepath.Join(cfg.Rootfs, "tmp"), Options: []string{"rbind", "rw", "nosuid", "nodev"}},
		{Destination: container.InitPath, Type: "bind", Source: g.cfg.Init, Options: []string{"bind", "ro", "nosuid", "nodev"}},
		{Destination: execHelperPath, Type: "bind", Source: g.helper, Options: []string{"bind", "ro", "nosuid", "nodev"}},
	}
	if cfg.ResolvConf != "" {
		mounts = append(mounts, specs.Mount{Destination: "/etc/resolv.conf", Type: "bind", Source: cfg.ResolvConf, Options: []string{"bind", "ro", "nosuid", "nodev", "noexec"}})
	}
	if g.cfg.Shell != "" {
		mounts = append(mounts, specs.Mount{Destination: container.PinnedShell, Type: "bind", Source: g.cfg.Shell, Options: []string{"bind", "ro", "nosuid", "nodev"}})
	}
	// pids: the host's pids controller would count the Sentry's threads,
	// not the sandbox's processes, so the limit is RLIMIT_NPROC, which the
	// Sentry enforces on fork (per user inside the sandbox; root inside
	// lacks CAP_SYS_RESOURCE and CAP_SYS_ADMIN, so it applies to root too).
	res := container.Resources(cfg.Limits)
	res.Pids = nil
	return &specs.Spec{
		Version:  container.OCIVersion,
		Hostname: cfg.Hostname,
		Root:     &specs.Root{Path: cfg.Rootfs},
		Process: &specs.Process{
			Args:            []string{container.InitPath, "-P"},
			Env:             []string{container.DefaultPath},
			Cwd:             "/",
			NoNewPrivileges: true,
			OOMScoreAdj:     container.OOMScoreAdj(),
			Capabilities:    container.Caps(0),
			Rlimits:         rlimits(cfg.Limits.Pids),
		},
		Mounts: mounts,
		Linux: &specs.Linux{
			CgroupsPath: cfg.CgroupPath,
			Namespaces: []specs.LinuxNamespace{
				{Type: specs.PIDNamespace}, {Type: specs.IPCNamespace}, {Type: specs.UTSNamespace},
				{Type: specs.MountNamespace}, {Type: specs.NetworkNamespace},
			},
			Resources: res,
			Seccomp:   g.seccomp,
		},
	}
}

// rlimits are the container backend's, with RLIMIT_NPROC set to pids.
func rlimits(pids int64) []specs.POSIXRlimit {
	r := container.Rlimits()
	if pids > 0 {
		r = append(r, specs.POSIXRlimit{Type: "RLIMIT_NPROC", Hard: uint64(pids), Soft: uint64(pids)})
	}
	return r
}

// meta is what the backend keeps of a sandbox besides runsc's state:
// its pids limit (for the processes exec starts) and its cgroup.
type meta struct {
	Pids   int64  `json:"pids,omitempty"`
	Cgroup string `json:"cgroup,omitempty"`
	// Split says the sandbox's own container is a subcontainer, whose
	// spec (specPath) private runs start from; false for a sandbox whose
	// one container is both root and its own (made by an older dsec: no
	// private runs).
	Split bool `json:"split,omitempty"`
}

func (g *GVisor) metaPath(id string) string {
	return filepath.Join(g.cfg.StateRoot, "dsec", id+".json")
}

func (g *GVisor) saveMeta(id string, m meta) error {
	if err := os.MkdirAll(filepath.Dir(g.metaPath(id)), 0o700); err != nil {
		return fmt.Errorf("saving sandbox meta: %w", err)
	}
	b, _ := json.Marshal(m)
	if err := os.WriteFile(g.metaPath(id), b, 0o600); err != nil {
		return fmt.Errorf("saving sandbox meta: %w", err)
	}
	return nil
}

// meta returns what saveMeta kept of id (zero if nothing).
func (g *GVisor) meta(id string) meta {
	var m meta
	if b, err := os.ReadFile(g.metaPath(id)); err == nil {
		_ = json.Unmarshal(b, &m)
	}
	return m
}

// specPath is where the spec of sandbox id's own container is kept.
func (g *GVisor) specPath(id string) string {
	return filepath.Join(g.cfg.StateRoot, "dsec", id+".spec.json")
}

func (g *GVisor) forget(id string) {
	_ = os.Remove(g.specPath(id))
	_ = os.Remove(g.metaPath(id))
}

// loUp sets lo up in the network namespace of pid.
func loUp(pid int) error {
	ns, err := netns.GetFromPid(pid)
	if err != nil {
		return fmt.Errorf("opening sandbox network namespace: %w", err)
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		return fmt.Errorf("opening sandbox netlink: %w", err)
	}
	defer h.Close()
	lo, err := h.LinkByName("lo")
	if err == nil {
		err = h.LinkSetUp(lo)
	}
	if err != nil {
		return fmt.Errorf("setting sandbox lo up: %w", err)
	}
	return nil
}

// state is what runsc keeps of a sandbox (the fields dsec reads).
type state struct {
	Status   string `json:"status"`
	GoferPid int    `json:"goferPid"`
	Sandbox  struct {
		Pid int `json:"pid"`
	} `json:"sandbox"`
}

// statePath is runsc's state file of container id in sandbox id (dsec
// runs one container per sandbox, named alike).
func statePath(root, id string) string {
	return filepath.Join(root, id+"_sandbox:"+id+".state")
}

func readState(root, id string) (*state, error) {
	b, err := os.ReadFile(statePath(root, id))
	if errors.Is(err, os.ErrNotExist) {
		return nil, errdefs.NotFound("gvisor sandbox %s does not exist", id)
	}
	if err != nil {
		return nil, fmt.Errorf("reading runsc state: %w", err)
	}
	var st state
	if err := json.Unmarshal(b, &st); err != nil {
		return nil, fmt.Errorf("decoding runsc state of %s: %w", id, err)
	}
	return &st, nil
}

// Status implements sandbox.Backend from runsc's state file and /proc,
// without running runsc. Pid is the Sentry's.
func (g *GVisor) Status(ctx context.Context, id string) (sandbox.Status, error) {
	st, err := readState(g.cfg.StateRoot, id)
	if err != nil {
		return sandbox.Status{}, err
	}
	pid := st.Sandbox.Pid
	running := (st.Status == "running" || st.Status == "paused") && isSentry(pid, id)
	return sandbox.Status{Running: running, Pid: pid, Paused: running && st.Status == "paused"}, nil
}

// isSentry reports whether pid is the running Sentry of sandbox id (runsc
// names it runsc-sandbox, the id last). State files outlive a reboot, and
// their pids can be anyone's by then.
func isSentry(pid int, id string) bool {
	if pid <= 0 || !container.Running(pid) {
		return false
	}
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
	if err != nil {
		return false
	}
	args := strings.Split(strings.TrimRight(string(b), "\x00"), "\x00")
	return len(args) > 1 && args[0] == "runsc-sandbox" && args[len(args)-1] == id
}

// List implements sandbox.Backend from runsc's state files.
func (g *GVisor) List(ctx context.Context) ([]string, error) {
	ents, err := os.ReadDir(g.cfg.StateRoot)
	if err != nil {
		return nil, fmt.Errorf("listing runsc state: %w", err)
	}
	var ids []string
	for _, e := range ents {
		name, ok := strings.CutSuffix(e.Name(), ".state")
		if !ok {
			continue
		}
		if sb, ctr, ok := strings.Cut(name, "_sandbox:"); ok && sb == ctr {
			ids = append(ids, sb)
		}
	}
	return ids, nil
}

// Destroy implements sandbox.Backend without runsc: SIGKILL to the
// Sentry (the gofer and every exec'd runsc follow it), a wait for it to
// die, then its cgroup (with Config.Cgroups) and runsc's state files go.
//
// Why not runsc delete: it waits until the Sentry's pid stops answering
// signal 0, and a killed Sentry is a zombie until whoever inherited it
// (init) reaps it; that made every delete take 1.2-2 s on this machine.
func (g *GVisor) Destroy(ctx context.Context, id string) error {
	st, err := readState(g.cfg.StateRoot, id)
	if errors.Is(err, errdefs.ErrNotFound) {
		if err := g.removeState(id); err != nil {
			return err
		}
		g.forget(id)
		return nil
	}
	if err == nil {
		if err := killWait(st.Sandbox.Pid, id); err != nil {
			return fmt.Errorf("destroying gvisor sandbox: %w", err)
		}
		// The gofer exits when the Sentry's end of its connection
		// closes; it is not waited for (it holds no sandbox process).
	}
	if m := g.meta(id); g.cfg.Cgroups != nil && m.Cgroup != "" {
		if err := g.cfg.Cgroups.Remove(m.Cgroup); err != nil && !errors.Is(err, errdefs.ErrNotFound) {
			return fmt.Errorf("removing sandbox cgroup: %w", err)
		}
	}
	if err := g.removeState(id); err != nil {
		return err
	}
	g.forget(id)
	return nil
}

// removeState removes the bundles of sandbox id's private runs (left by an
// edge that died while they ran), then the state and lock files of every
// container of it: the root's last, as List finds a sandbox by them.
func (g *GVisor) removeState(id string) error {
	bundles, _ := filepath.Glob(filepath.Join(g.cfg.StateRoot, "private", "p????????????-"+id))
	for _, b := range bundles {
		if err := os.RemoveAll(b); err != nil {
			return fmt.Errorf("removing a private run's bundle: %w", err)
		}
	}
	var files []string
	for _, ext := range []string{".lock", ".state"} {
		subs, _ := filepath.Glob(filepath.Join(g.cfg.StateRoot, "*_sandbox:"+id+ext))
		for _, f := range subs {
			if filepath.Base(f) != id+"_sandbox:"+id+ext {
				files = append(files, f)
			}
		}
	}
	files = append(files, filepath.Join(g.cfg.StateRoot, id+"_sandbox:"+id+".lock"), statePath(g.cfg.StateRoot, id))
	for _, p := range files {
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("removing runsc state: %w", err)
		}
	}
	return nil
}

// killWait SIGKILLs the Sentry of sandbox id through a pidfd and waits
// (at most 10 s) until it has exited. A pid that is not that Sentry (any
// more) is left alone.
func killWait(pid int, id string) error {
	if !isSentry(pid, id) {
		return nil
	}
	fd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return nil // gone
	}
	defer unix.Close(fd)
	if !isSentry(pid, id) { // the pidfd is the Sentry's, checked after it was taken
		return nil
	}
	if err := unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0); err != nil && !errors.Is(err, unix.ESRCH) {
		return fmt.Errorf("killing the Sentry %d: %w", pid, err)
	}
	if err := container.WaitPidfd(context.Background(), fd); err != nil {
		return fmt.Errorf("waiting for the Sentry %d: %w", pid, err)
	}
	return nil
}

// Pause implements sandbox.Pauser: the Sentry stops every task of the
// sandbox (runsc pause).
func (g *GVisor) Pause(ctx context.Context, id string) error {
	return g.setPaused(ctx, id, true)
}

// Resume implements sandbox.Pauser.
func (g *GVisor) Resume(ctx context.Context, id string) error {
	return g.setPaused(ctx, id, false)
}

func (g *GVisor) setPaused(ctx context.Context, id string, pause bool) error {
	st, err := readState(g.cfg.StateRoot, id)
	if err != nil {
		return err
	}
	if (st.Status == "paused") == pause {
		return nil
	}
	verb := "resume"
	if pause {
		verb = "pause"
	}
	_, err = g.run(ctx, verb, id)
	return err
}
