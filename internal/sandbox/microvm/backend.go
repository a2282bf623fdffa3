package microvm

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/cgroup"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/pty"
	"github.com/dsecproject/dsec/internal/sandbox"
	"github.com/dsecproject/dsec/internal/sandbox/container"
	"github.com/dsecproject/dsec/internal/sandbox/microvm/agent"
)

// Config configures the microvm backend.
type Config struct {
	// StateRoot holds a directory per VM (sockets, logs, snapshot, the
	// VMM's pid) and the guest (kernel and initramfs).
	StateRoot string
	// KernelCache is where the guest kernel package is downloaded once
	// and kept (shared by the node's edges).
	KernelCache string
	// Agent is the static dsec-agent binary.
	Agent string
	// QEMU is the VMM binary ("" = qemu-system-x86_64); Accel is "tcg",
	// "kvm", or "" to choose (DetectAccel).
	QEMU, Accel string
	// MemoryMB is a guest's memory when its spec sets none (0 = 512).
	MemoryMB int
	// DiskGB is the size of a guest's writable disk (sparse; 0 = 16):
	// where the sandbox has a disk of its own, that disk's size bounds
	// what the guest can write.
	DiskGB int
	// Cgroups, if set, puts each VMM in its sandbox's cgroup (CPU limit)
	// and removes that cgroup on Destroy.
	Cgroups *cgroup.Info
	Log     *slog.Logger
}

// Backend runs each sandbox as a VM: one VMM process per sandbox and the
// agent inside; the edge holds no other process for it.
type Backend struct {
	cfg   Config
	guest *Guest
	// seccomp is the filter of the sandbox's processes (Setup.Seccomp).
	seccomp []byte

	mu  sync.Mutex
	vms map[string]*vmSlot
}

// vmSlot is one sandbox's VM: running (vm set) or saved to its snapshot
// file (vm nil, saved true). mu serialises its lifecycle changes.
type vmSlot struct {
	mu    sync.Mutex
	vm    *VM
	saved bool
	// gone is set once Destroy removed the VM: a caller that took the
	// slot before finds nothing.
	gone bool
	meta meta
	// agent, while saved, is the client of the agent as it was when the
	// VM was saved (suspended): resumed, the VM goes on with it.
	agent *agent.Client
	// loaded says the slot was read saved from its meta, written by an
	// earlier edge, which may have left a VMM resuming it.
	loaded bool
}

// live reports whether the slot holds a VM, running or saved.
//
// Preconditions: s.mu is held.
func (s *vmSlot) live() bool { return !s.gone && (s.vm != nil || s.saved) }

// meta is what survives an edge restart of a VM, in its directory.
type meta struct {
	Pid    int    `json:"pid"`
	MAC    string `json:"mac,omitempty"`
	Cgroup string `json:"cgroup,omitempty"`
	// CPUQuotaUs is the cgroup's CPU limit.
	CPUQuotaUs int64 `json:"cpu_quota_us,omitempty"`
	// Saved says the VM is paused to its snapshot file (no VMM runs).
	Saved bool `json:"saved,omitempty"`
	// Saving says a save began and has not been recorded as done or
	// failed: an edge that finds it so, with the VMM gone and the
	// snapshot whole, takes the VM for saved (see slot).
	Saving bool `json:"saving,omitempty"`
	// Start is what the VMM was started with, to resume it the same way.
	Start startConfig `json:"start"`
}

// startConfig is the part of VMConfig that is the sandbox's.
type startConfig struct {
	MemoryMB int    `json:"memory_mb"`
	CPUs     int    `json:"cpus"`
	Disks    []Disk `json:"disks"`
	NIC      string `json:"nic,omitempty"`
	// Balloon: the VM has a balloon device reporting free pages (VMs
	// saved by an edge before it had one resume without).
	Balloon bool `json:"balloon,omitempty"`
}

var (
	_ sandbox.Backend       = (*Backend)(nil)
	_ sandbox.LayerImages   = (*Backend)(nil)
	_ sandbox.Pauser        = (*Backend)(nil)
	_ sandbox.InnerSignaler = (*Backend)(nil)
	_ sandbox.NetworkFirst  = (*Backend)(nil)
	_ sandbox.OwnKernel     = (*Backend)(nil)
	_ sandbox.FileServer    = (*Backend)(nil)
	_ sandbox.Resizer       = (*proc)(nil)
	_ sandbox.Files         = agent.Files{}
)

// New prepares the guest (downloading Debian's kernel package into
// cfg.KernelCache the first time, logging it) and returns the backend.
func New(ctx context.Context, cfg Config) (*Backend, error) {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.QEMU == "" {
		cfg.QEMU = "qemu-system-x86_64"
	}
	why := "configured"
	if cfg.Accel == "" {
		cfg.Accel, why = DetectAccel("/dev/kvm", "/sys/module")
	}
	if cfg.MemoryMB == 0 {
		cfg.MemoryMB = 512
	}
	if cfg.DiskGB == 0 {
		cfg.DiskGB = 16
	}
	if _, err := exec.LookPath(cfg.QEMU); err != nil {
		return nil, fmt.Errorf("no VMM: %s not found (apt-get install qemu-system-x86)", cfg.QEMU)
	}
	for _, tool := range []string{"mkfs.ext4", "nsenter"} {
		if _, err := exec.LookPath(tool); err != nil {
			return nil, fmt.Errorf("%s not found (apt-get install e2fsprogs util-linux)", tool)
		}
	}
	if _, err := os.Stat(cfg.Agent); err != nil {
		return nil, fmt.Errorf("no guest agent (make build puts dsec-agent beside dsec): %w", err)
	}
	if err := os.MkdirAll(cfg.StateRoot, 0o700); err != nil {
		return nil, fmt.Errorf("creating microvm state dir: %w", err)
	}
	g, err := PrepareGuest(ctx, cfg.KernelCache, filepath.Join(cfg.StateRoot, "guest"), cfg.Agent, nil, logWriter{cfg.Log})
	if err != nil {
		return nil, fmt.Errorf("preparing the guest: %w", err)
	}
	cfg.Log.Info("microvm VMM chosen", "vmm", "qemu-microvm/"+cfg.Accel, "why", why)
	// The container backend's seccomp profile, for the sandbox's
	// processes in the guest (the agent installs it).
	f64, err := container.SeccompFilterBase64()
	if err != nil {
		return nil, fmt.Errorf("compiling the seccomp profile: %w", err)
	}
	filter, err := base64.StdEncoding.DecodeString(f64)
	if err != nil {
		return nil, err
	}
	return &Backend{cfg: cfg, guest: g, vms: map[string]*vmSlot{}, seccomp: filter}, nil
}

// DetectAccel chooses QEMU's accelerator from the host: "kvm" where KVM
// runs ordinary guests (its device exists and a hardware module, kvm_intel
// or kvm_amd, is loaded), else "tcg", with the reason. A KVM that only
// PVM backs (kvm_pvm, as on this project's reference machine) boots
// PVM-enabled guest kernels only, not Debian's: TCG there. dev is the KVM
// device and modules the kernel's module directory in sysfs.
func DetectAccel(dev, modules string) (accel, why string) {
	if _, err := os.Stat(dev); err != nil {
		return "tcg", "no " + dev + ": software emulation"
	}
	for _, m := range []string{"kvm_intel", "kvm_amd"} {
		if _, err := os.Stat(filepath.Join(modules, m)); err == nil {
			return "kvm", m + " is loaded"
		}
	}
	if _, err := os.Stat(filepath.Join(modules, "kvm_pvm")); err == nil {
		return "tcg", "KVM here is PVM's, which boots PVM guest kernels only: software emulation"
	}
	return "tcg", "no hardware KVM module (kvm_intel, kvm_amd): software emulation"
}

// Guest is what the backend's VMs boot.
func (b *Backend) Guest() *Guest { return b.guest }

// VMM names the VMM and accelerator the backend runs ("qemu-microvm/tcg").
func (b *Backend) VMM() string { return "qemu-microvm/" + b.cfg.Accel }

// Name implements sandbox.Backend.
func (b *Backend) Name() string { return "microvm" }

// TakesLayerImages implements sandbox.LayerImages: the layers are the
// guest's disks.
func (b *Backend) TakesLayerImages() bool { return true }

// NetworkFirst implements sandbox.NetworkFirst: the VMM's tap and the
// guest's address are made once, at start.
func (b *Backend) NetworkFirst() bool { return true }

// OwnKernel implements sandbox.OwnKernel.
func (b *Backend) OwnKernel() bool { return true }

func (b *Backend) dir(id string) string { return filepath.Join(b.cfg.StateRoot, "vm", id) }

// Create boots the sandbox's VM: the layer images as read-only disks, a
// new ext4 disk in cfg.Upper for the writable layer, the network (a tap in
// the VMM's own network namespace, joined to what the edge attaches there)
// and then the agent makes the root filesystem inside.
func (b *Backend) Create(ctx context.Context, cfg sandbox.Config) (err error) {
	if len(cfg.Images) == 0 || cfg.Upper == "" {
		return errdefs.Invalid("microvm: a sandbox needs layer images and a writable layer dir")
	}
	if cfg.UserNS != nil {
		return errdefs.Precondition("microvm: user namespaces are a container feature; a VM has its own kernel")
	}
	if len(cfg.Images) > MaxLayers {
		return errdefs.Precondition("microvm: a VM stacks at most %d layers (one disk each), this sandbox has %d: import its image with a larger merge_under",
			MaxLayers, len(cfg.Images))
	}
	dir := b.dir(cfg.ID)
	if err := os.MkdirAll(filepath.Dir(dir), 0o700); err != nil {
		return fmt.Errorf("creating VM dir: %w", err)
	}
	if err := os.Mkdir(dir, 0o700); err != nil {
		return fmt.Errorf("creating VM dir: %w", err)
	}
	slot := &vmSlot{}
	slot.mu.Lock()
	defer slot.mu.Unlock()
	b.mu.Lock()
	b.vms[cfg.ID] = slot
	b.mu.Unlock()
	defer func() {
		if err != nil {
			b.destroy(slot, cfg.ID)
		}
	}()
	upper := filepath.Join(cfg.Upper, "disk.ext4")
	if err := makeExt4(ctx, upper, b.cfg.DiskGB); err != nil {
		return err
	}
	sc := startConfig{MemoryMB: b.cfg.MemoryMB, CPUs: 1, Balloon: true}
	if m := cfg.Limits.MemoryBytes >> 20; m > 0 {
		sc.MemoryMB = int(max(m, 128))
	}
	if cfg.Limits.CPU > 1 {
		sc.CPUs = int(math.Ceil(cfg.Limits.CPU))
	}
	setup := agent.Setup{Upper: "upper", Hostname: cfg.Hostname, Pids: cfg.Limits.Pids, Seccomp: b.seccomp,
		Masked: container.MaskedPaths(), ReadOnly: container.ReadonlyPaths()}
	for i, img := range cfg.Images {
		serial := "l" + strconv.Itoa(i)
		sc.Disks = append(sc.Disks, Disk{Path: img, Serial: serial, ReadOnly: true})
		setup.Layers = append(setup.Layers, serial)
	}
	sc.Disks = append(sc.Disks, Disk{Path: upper, Serial: "upper"})
	if cfg.AttachNetwork != nil {
		sc.NIC = randomMAC()
	}
	if cfg.ResolvConf != "" {
		if setup.ResolvConf, err = os.ReadFile(cfg.ResolvConf); err != nil {
			return fmt.Errorf("reading resolv.conf: %w", err)
		}
	}
	m := meta{MAC: sc.NIC, Cgroup: cfg.CgroupPath, Start: sc}
	if cfg.Limits.CPU > 0 {
		m.CPUQuotaUs = int64(cfg.Limits.CPU * 100000)
	}
	if err := makeNetns(filepath.Join(dir, "netns"), sc.NIC != ""); err != nil {
		return err
	}
	var procs []string
	if b.cfg.Cgroups != nil && cfg.CgroupPath != "" {
		if procs, err = b.cfg.Cgroups.MakeSandbox(cfg.CgroupPath, vmmLimits(m.CPUQuotaUs)); err != nil {
			return fmt.Errorf("making the VMM's cgroup: %w", err)
		}
	}
	// Saved before the VMM starts: a Destroy after a crash here finds the
	// cgroup (and the VMM by its command line).
	slot.meta = m
	if err := b.saveMeta(cfg.ID, m); err != nil {
		return err
	}
	vm, err := b.start(ctx, cfg.ID, sc, "", procs, nil, nil)
	if err != nil {
		return err
	}
	slot.vm = vm
	slot.meta.Pid = vm.Pid
	if err := b.saveMeta(cfg.ID, slot.meta); err != nil {
		return err
	}
	if cfg.AttachNetwork != nil {
		if err := cfg.AttachNetwork(vm.Pid); err != nil {
			return err
		}
		if setup.Net, err = joinTap(filepath.Join(dir, "netns"), sc.NIC); err != nil {
			return err
		}
	}
	if err := vm.Agent.Call(ctx, agent.Msg{Op: "setup", Setup: &setup}); err != nil {
		return fmt.Errorf("setting up the sandbox in the guest: %w (console: %s)", err, vm.Console(ctx))
	}
	b.cfg.Log.Debug("microvm booted", "sandbox_id", cfg.ID, "boot_ms", vm.Boot.Milliseconds(), "memory_mb", sc.MemoryMB, "cpus", sc.CPUs)
	return nil
}

// start starts the VMM for id (inside the VM's network namespace),
// resuming from snapshot when set.
func (b *Backend) start(ctx context.Context, id string, sc startConfig, snapshot string, procs []string, reattach *agent.Client, beforeRun func(pid int) error) (*VM, error) {
	dir := b.dir(id)
	return Start(ctx, VMConfig{
		QEMU: b.cfg.QEMU, Guest: b.guest, Dir: dir, Accel: b.cfg.Accel,
		MemoryMB: sc.MemoryMB, CPUs: sc.CPUs, Disks: sc.Disks, NIC: sc.NIC, Balloon: sc.Balloon,
		NetNSPath: filepath.Join(dir, "netns"), Incoming: snapshot, Cgroup: procs, Reattach: reattach,
		BeforeRun: beforeRun,
	})
}

// slotOf returns id's slot, put in the map empty if there is none.
func (b *Backend) slotOf(id string) *vmSlot {
	b.mu.Lock()
	defer b.mu.Unlock()
	s := b.vms[id]
	if s == nil {
		s = &vmSlot{}
		b.vms[id] = s
	}
	return s
}

// slot returns id's VM, adopting a VMM an earlier edge started (or a VM
// it saved) when the backend has none in memory. Nil: no such sandbox.
func (b *Backend) slot(ctx context.Context, id string) *vmSlot {
	s := b.slotOf(id)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.gone {
		return nil
	}
	if s.vm != nil || s.saved {
		return s
	}
	m, err := b.loadMeta(id)
	if err == nil && m.Saved {
		s.meta, s.saved, s.loaded = m, true, true
		return s
	}
	if err == nil && m.Pid > 0 {
		// A snapshot the guest is about to move past must be gone, and
		// the mark with it, before it runs: an edge that died after
		// would otherwise resume the snapshot onto a newer disk.
		vm, err := Adopt(ctx, b.dir(id), m.Pid, func() error {
			if err := b.dropSave(id, &m); err != nil {
				return fmt.Errorf("before starting the stopped guest: %w", err)
			}
			return nil
		})
		if err == nil {
			s.meta, s.vm = m, vm
			b.cfg.Log.Info("microvm adopted", "sandbox_id", id, "vmm_pid", m.Pid)
			if vm.Restarted {
				b.cfg.Log.Warn("resumed a running sandbox left paused", "sandbox_id", id, "why", "adoption", "detail", "its VMM was adopted with the guest's vCPUs stopped (an edge died saving or resuming it)")
			}
			_ = b.dropSave(id, &s.meta)
			return s
		}
		b.cfg.Log.Warn("adopting a microvm", "sandbox_id", id, "vmm_pid", m.Pid, "err", err)
		snap := filepath.Join(b.dir(id), "snapshot")
		if _, serr := os.Stat(snap); serr == nil && m.Saving && len(vmmPids(b.dir(id))) == 0 {
			// Saved whole, and the VMM quit, before an edge that died
			// could record it: the VM is paused.
			m.Saved, m.Saving, m.Pid = true, false, 0
			if err := b.saveMeta(id, m); err == nil {
				s.meta, s.saved, s.loaded = m, true, true
				b.cfg.Log.Warn("a microvm saved by an edge that died before recording it is kept paused", "sandbox_id", id)
				return s
			}
		}
	}
	b.mu.Lock()
	if b.vms[id] == s {
		delete(b.vms, id)
	}
	b.mu.Unlock()
	return nil
}

// dropSave removes id's snapshot files and clears m's saving mark (saved
// when it was set): what a save left, whole or not, once the VM runs on.
func (b *Backend) dropSave(id string, m *meta) error {
	snap := filepath.Join(b.dir(id), "snapshot")
	for _, p := range []string{snap + ".part", snap} {
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			return err
		}
	}
	if !m.Saving {
		return nil
	}
	m.Saving = false
	if err := b.saveMeta(id, *m); err != nil {
		m.Saving = true
		return err
	}
	return nil
}

// lockedSlot returns id's slot, locked, holding a VM (running or saved);
// NotFound if it has none (or it was destroyed since slot found it).
func (b *Backend) lockedSlot(ctx context.Context, id string) (*vmSlot, error) {
	s := b.slot(ctx, id)
	if s == nil {
		return nil, errdefs.NotFound("sandbox %s has no VM", id)
	}
	s.mu.Lock()
	if !s.live() {
		s.mu.Unlock()
		return nil, errdefs.NotFound("sandbox %s has no VM", id)
	}
	return s, nil
}

// running returns the client of id's running VM's agent, resuming the
// VM when saved. (The client, read under the slot's lock: a pause may
// take it from the VM as soon as the lock is released.)
func (b *Backend) running(ctx context.Context, id string) (*agent.Client, error) {
	s, err := b.lockedSlot(ctx, id)
	if err != nil {
		return nil, err
	}
	defer s.mu.Unlock()
	if s.vm == nil {
		if err := b.resumeLocked(ctx, id, s); err != nil {
			return nil, err
		}
	}
	select {
	case <-s.vm.Done():
		return nil, errdefs.Precondition("sandbox %s: its VM has stopped (VMM log: %s)", id, tail(filepath.Join(b.dir(id), vmmLog), 500))
	default:
	}
	select {
	case <-s.vm.Agent.Done():
		// The connection broke while the VM runs: a new one (the agent
		// ends what the old one started, whose calls have failed).
		b.cfg.Log.Warn("microvm: reconnecting to the agent", "sandbox_id", id, "err", s.vm.Agent.Err())
		if err := s.vm.connect(ctx, 30*time.Second); err != nil {
			return nil, errdefs.Precondition("sandbox %s: its VM's agent does not answer: %v", id, err)
		}
	default:
	}
	return s.vm.Agent, nil
}

// Exec implements sandbox.Backend: the agent starts the process.
func (b *Backend) Exec(ctx context.Context, id string, p sandbox.Process) (_ sandbox.Proc, err error) {
	if len(p.Args) == 0 {
		return nil, errdefs.Invalid("exec: no command")
	}
	ag, err := b.running(ctx, id)
	if err != nil {
		return nil, err
	}
	user := p.User
	if user == "" {
		// Resolved by the edge (the sandbox's default user, kept from
		// its first exec): the agent looks nothing up.
		user = fmt.Sprintf("%d:%d", p.UID, p.GID)
	}
	stdout, stderr := p.Stdout, p.Stderr
	if stdout == nil {
		stdout = io.Discard
	}
	if stderr == nil {
		stderr = io.Discard
	}
	msg := agent.Msg{Args: p.Args, Env: p.Env, Cwd: p.Cwd, User: user, Private: p.Private}
	stdin := p.Stdin
	if f, ok := stdin.(*os.File); ok {
		// The caller may close its file once Exec returns (a runtime's
		// child holds its own copy): the agent's client reads a copy.
		dup, err := dupFile(f)
		if err != nil {
			return nil, err
		}
		defer func() {
			if err != nil {
				dup.Close()
			}
		}()
		stdin = dup
		if p.TTY {
			// The edge's terminal is joined to one the agent makes in
			// the guest (which does the terminal's work: echo, ^C, job
			// control): the edge's side passes bytes as they are.
			if msg.Rows, msg.Cols, err = rawTerminal(dup); err != nil {
				return nil, err
			}
			msg.TTY = true
			stdout, stderr = dup, dup
		}
	} else if p.TTY {
		return nil, errdefs.Invalid("microvm: a terminal process needs the terminal as a file")
	}
	ap, err := ag.Exec(ctx, msg, stdin, stdout, stderr)
	if err != nil {
		if errors.Is(err, agent.ErrGone) {
			return nil, errdefs.Precondition("sandbox %s: its VM's agent is gone: %v", id, err)
		}
		if errors.Is(err, agent.ErrNoPrivate) {
			return nil, errdefs.Precondition("sandbox %s: %v", id, err)
		}
		return nil, err
	}
	return &proc{p: ap}, nil
}

// Files implements sandbox.FileServer: the agent serves the files API
// inside the guest (resuming a paused VM, as any request does).
func (b *Backend) Files(ctx context.Context, id string) (sandbox.Files, error) {
	ag, err := b.running(ctx, id)
	if err != nil {
		return nil, err
	}
	return agent.Files{C: ag}, nil
}

// proc is a process in a VM: it has no host pid.
type proc struct{ p *agent.Process }

func (p *proc) Wait() (int, error) { return p.p.Wait() }
func (p *proc) Kill() error        { return p.p.Kill() }
func (p *proc) Pid() int           { return 0 }
func (p *proc) InnerPid() int      { return p.p.Pid() }

// Resize implements sandbox.Resizer.
func (p *proc) Resize(ctx context.Context, rows, cols uint16) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	return p.p.Resize(ctx, rows, cols)
}

// dupFile is a pollable copy of f's descriptor.
func dupFile(f *os.File) (*os.File, error) {
	rc, err := f.SyscallConn()
	if err != nil {
		return nil, err
	}
	fd := -1
	var derr error
	_ = rc.Control(func(ofd uintptr) { fd, derr = unix.FcntlInt(ofd, unix.F_DUPFD_CLOEXEC, 0) })
	if derr != nil {
		return nil, fmt.Errorf("duplicating stdin: %w", derr)
	}
	// Pollable, so that closing it ends a read in progress.
	_ = unix.SetNonblock(fd, true)
	return os.NewFile(uintptr(fd), f.Name()), nil
}

// rawTerminal puts the terminal f in raw mode and returns its size.
func rawTerminal(f *os.File) (rows, cols uint16, err error) {
	rc, err := f.SyscallConn()
	if err != nil {
		return 0, 0, err
	}
	var terr error
	_ = rc.Control(func(fd uintptr) {
		if _, terr = pty.MakeRaw(int(fd)); terr != nil {
			return
		}
		if ws, err := unix.IoctlGetWinsize(int(fd), unix.TIOCGWINSZ); err == nil {
			rows, cols = ws.Row, ws.Col
		}
	})
	if terr != nil {
		return 0, 0, fmt.Errorf("setting up the terminal: %w", terr)
	}
	return rows, cols, nil
}

// Signal implements sandbox.InnerSignaler.
func (b *Backend) Signal(ctx context.Context, id string, pid int, sig syscall.Signal, self, tree bool) error {
	// Bounded: callers may hold no deadline of their own, and the guest's
	// agent is not trusted to answer.
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	ag, err := b.running(ctx, id)
	if err != nil {
		return err
	}
	return ag.Call(ctx, agent.Msg{Op: "signal", Pid: pid, Signal: int(sig), Self: self, Tree: tree})
}

// Pause implements sandbox.Pauser: the VM's memory and device state go to
// a snapshot file in its directory and the VMM exits, so a paused sandbox
// holds no memory and no process.
func (b *Backend) Pause(ctx context.Context, id string) error {
	s, err := b.lockedSlot(ctx, id)
	if err != nil {
		return err
	}
	defer s.mu.Unlock()
	if s.saved {
		return nil
	}
	return b.saveLocked(ctx, id, s)
}

// saveLocked saves s's running VM to its snapshot file and stops it.
// Preconditions: s.mu is held; s.vm is set.
func (b *Backend) saveLocked(ctx context.Context, id string, s *vmSlot) error {
	snap := filepath.Join(b.dir(id), "snapshot")
	// A request that goes away does not cut a save short: saving a VM
	// takes as long as its memory takes to write.
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Minute)
	defer cancel()
	// The agent's client outlives this VMM: its calls (commands that
	// run on) wait for the VM's next one.
	s.meta.Saving = true
	if err := b.saveMeta(id, s.meta); err != nil {
		return err
	}
	ag := s.vm.DetachAgent()
	ag.Suspend()
	if err := s.vm.SaveTo(sctx, snap); err != nil {
		// The VM may be stopped, or still migrating (its state could not
		// be read): called off and started again.
		_, _ = s.vm.runStopped(context.Background(), nil)
		ag.Unsuspend()
		s.vm.Agent = ag
		_ = b.dropSave(id, &s.meta)
		return fmt.Errorf("pausing the VM: %w", err)
	}
	select {
	case <-ag.Done(): // no connection to go on with: the resume makes one
		ag = nil
	default:
	}
	s.vm, s.agent = nil, ag
	s.saved = true
	s.meta.Saved, s.meta.Saving, s.meta.Pid = true, false, 0
	return b.saveMeta(id, s.meta)
}

// ExportDiff implements sandbox.DiffExporter: the agent streams the
// writable layer, its disk frozen meanwhile. A paused VM is resumed for
// it and saved again after.
func (b *Backend) ExportDiff(ctx context.Context, id string, w io.Writer) error {
	s, err := b.lockedSlot(ctx, id)
	if err != nil {
		return err
	}
	defer s.mu.Unlock()
	if s.saved {
		if err := b.resumeLocked(ctx, id, s); err != nil {
			return err
		}
		defer func() {
			if serr := b.saveLocked(ctx, id, s); serr != nil {
				b.cfg.Log.Warn("pausing the VM again after its snapshot", "sandbox_id", id, "err", serr)
			}
		}()
	}
	// Whatever the VM sends is bounded by what its disk can hold: twice
	// its size leaves room for the archive's headers, while a sparse
	// file, which the archive spells out, cannot fill the node's disk.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	// Over the bound, the agent is told to stop (its disk is frozen
	// while it sends).
	lw := &limitWriter{w: w, left: 2 * int64(b.cfg.DiskGB) << 30, over: cancel}
	if err := (agent.Files{C: s.vm.Agent}).WriteDiff(ctx, lw); err != nil {
		if lw.err != nil {
			return lw.err
		}
		if errors.Is(err, agent.ErrGone) {
			return errdefs.Precondition("sandbox %s: its VM's agent is gone: %v", id, err)
		}
		return err
	}
	return lw.err
}

// limitWriter passes at most left bytes to w and fails after; err is
// the first failure (the agent's client, which
// writes to it, does not look).
type limitWriter struct {
	w    io.Writer
	left int64
	err  error
	over func()
}

func (l *limitWriter) Write(p []byte) (int, error) {
	if l.err != nil {
		return 0, l.err
	}
	if int64(len(p)) > l.left {
		l.err = errdefs.Invalid("the VM's writable layer archive is larger than twice its disk (sparse files are archived whole)")
		l.over()
		return 0, l.err
	}
	l.left -= int64(len(p))
	n, err := l.w.Write(p)
	if err != nil {
		l.err = err
	}
	return n, err
}

// Resume implements sandbox.Pauser: a new VMM resumes the snapshot.
func (b *Backend) Resume(ctx context.Context, id string) error {
	s, err := b.lockedSlot(ctx, id)
	if err != nil {
		return err
	}
	defer s.mu.Unlock()
	if !s.saved {
		return nil
	}
	return b.resumeLocked(ctx, id, s)
}

// Preconditions: s.mu is held; s.saved.
func (b *Backend) resumeLocked(ctx context.Context, id string, s *vmSlot) error {
	var procs []string
	if b.cfg.Cgroups != nil && s.meta.Cgroup != "" {
		var err error
		// The cgroup stays while paused: taken as it is.
		if procs, err = b.cfg.Cgroups.MakeSandbox(s.meta.Cgroup, vmmLimits(s.meta.CPUQuotaUs)); err != nil {
			return fmt.Errorf("resuming the VM: %w", err)
		}
	}
	snap := filepath.Join(b.dir(id), "snapshot")
	// No VMM may run on the disks already: one an edge that died started
	// from the snapshot (before it recorded it) is stopped first.
	if s.loaded {
		killVMMs(b.dir(id))
		s.loaded = false
	}
	// Before the guest runs past its snapshot, the meta says it runs
	// (and which VMM) and the snapshot is gone: an edge that died just
	// after would otherwise find it saved, and resume the old snapshot
	// onto the disk the guest has written since.
	beforeRun := func(pid int) error {
		m := s.meta
		m.Saved, m.Saving, m.Pid = false, false, pid
		if err := b.saveMeta(id, m); err != nil {
			return err
		}
		if err := os.Remove(snap); err != nil && !errors.Is(err, os.ErrNotExist) {
			if rerr := b.saveMeta(id, s.meta); rerr != nil {
				return fmt.Errorf("%w (and restoring the VM's state: %v)", err, rerr)
			}
			return err
		}
		s.meta = m
		return nil
	}
	// With the agent's client of the VM when it was saved, the commands
	// it ran go on; a VM an earlier edge saved starts a new connection.
	// A caller that goes away does not cut the resume short: past
	// beforeRun the snapshot is gone, and a VMM stopped then would take
	// the VM's memory with it.
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Minute)
	defer cancel()
	vm, err := b.start(rctx, id, s.meta.Start, snap, procs, s.agent, beforeRun)
	if err != nil {
		if s.agent != nil {
			select {
			case <-s.agent.Done():
				s.agent = nil // gone with the attempt: the next one starts anew
			default:
			}
		}
		if !s.meta.Saved {
			// beforeRun ran: the snapshot is gone and the VMM that read
			// it with it. Adoption finds nothing to resume now.
			s.saved = false
			return fmt.Errorf("resuming the VM: %w (its memory was lost with the VMM that read it)", err)
		}
		return fmt.Errorf("resuming the VM: %w", err)
	}
	s.vm, s.saved, s.agent = vm, false, nil
	return nil
}

// Destroy implements sandbox.Backend.
func (b *Backend) Destroy(ctx context.Context, id string) error {
	// The slot goes in the map (if none is there), so that no adoption
	// starts on the VM being destroyed.
	s := b.slotOf(id)
	s.mu.Lock()
	defer s.mu.Unlock()
	return b.destroy(s, id)
}

// destroy stops id's VMM (the one in memory, the one its meta names, or
// one whose command line names its directory) and removes its network
// namespace, cgroup and directory.
//
// Preconditions: s.mu is held.
func (b *Backend) destroy(s *vmSlot, id string) error {
	dir := b.dir(id)
	if s.vm != nil {
		s.vm.Stop()
		s.vm = nil
	}
	if s.agent != nil {
		s.agent.Close() // the calls of a saved VM end with it
		s.agent = nil
	}
	m, _ := b.loadMeta(id)
	if m.Cgroup == "" {
		m.Cgroup = s.meta.Cgroup
	}
	killVMMs(dir)
	if err := removeNetns(filepath.Join(dir, "netns")); err != nil {
		return err
	}
	if b.cfg.Cgroups != nil && m.Cgroup != "" {
		if err := b.cfg.Cgroups.Remove(m.Cgroup); err != nil && !errors.Is(err, errdefs.ErrNotFound) {
			return fmt.Errorf("removing the VM's cgroup: %w", err)
		}
	}
	if err := os.RemoveAll(dir); err != nil {
		return fmt.Errorf("removing VM dir: %w", err)
	}
	s.saved, s.gone = false, true
	b.mu.Lock()
	if b.vms[id] == s {
		delete(b.vms, id)
	}
	b.mu.Unlock()
	return nil
}

// vmmLimits is the cgroup of a VMM: its CPU limit, and the devices it
// opens (tun for its tap, kvm where it accelerates).
func vmmLimits(cpuQuotaUs int64) cgroup.Limits {
	return cgroup.Limits{CPUQuotaUs: cpuQuotaUs, Devices: []string{"c 10:200 rwm", "c 10:232 rwm"}}
}

// killVMMs SIGKILLs every VMM of dir and waits (up to 5 s each) for it
// to be gone.
func killVMMs(dir string) {
	for _, pid := range vmmPids(dir) {
		_ = syscall.Kill(pid, syscall.SIGKILL)
		for i := 0; i < 500 && isVMM(pid, dir); i++ {
			time.Sleep(10 * time.Millisecond)
		}
	}
}

// vmmPids finds the VMMs whose command line names dir's agent socket.
func vmmPids(dir string) []int {
	ents, _ := os.ReadDir("/proc")
	var out []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err == nil && isVMM(pid, dir) {
			out = append(out, pid)
		}
	}
	return out
}

// Status implements sandbox.Backend. A VM paused to its snapshot runs
// (for the edge) with no pid.
func (b *Backend) Status(ctx context.Context, id string) (sandbox.Status, error) {
	s := b.slot(ctx, id)
	if s == nil {
		if _, err := os.Stat(b.dir(id)); err == nil {
			return sandbox.Status{}, nil
		}
		return sandbox.Status{}, errdefs.NotFound("sandbox %s has no VM", id)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.live() {
		return sandbox.Status{}, errdefs.NotFound("sandbox %s has no VM", id)
	}
	if s.saved {
		return sandbox.Status{Running: true, Paused: true}, nil
	}
	select {
	case <-s.vm.Done():
		return sandbox.Status{}, nil
	default:
		return sandbox.Status{Running: true, Pid: s.vm.Pid}, nil
	}
}

// List implements sandbox.Backend.
func (b *Backend) List(ctx context.Context) ([]string, error) {
	ents, err := os.ReadDir(filepath.Join(b.cfg.StateRoot, "vm"))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	ids := make([]string, 0, len(ents))
	for _, e := range ents {
		if e.IsDir() {
			ids = append(ids, e.Name())
		}
	}
	return ids, nil
}

func (b *Backend) saveMeta(id string, m meta) error {
	data, _ := json.Marshal(m)
	p := filepath.Join(b.dir(id), "meta.json")
	if err := os.WriteFile(p+".tmp", data, 0o600); err != nil {
		return fmt.Errorf("saving VM state: %w", err)
	}
	if err := os.Rename(p+".tmp", p); err != nil {
		return fmt.Errorf("saving VM state: %w", err)
	}
	return nil
}

func (b *Backend) loadMeta(id string) (meta, error) {
	var m meta
	data, err := os.ReadFile(filepath.Join(b.dir(id), "meta.json"))
	if err != nil {
		return m, err
	}
	return m, json.Unmarshal(data, &m)
}

// makeExt4 makes an empty ext4 file system of sizeGB (sparse) at path.
func makeExt4(ctx context.Context, path string, sizeGB int) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return fmt.Errorf("creating the writable disk: %w", err)
	}
	err = f.Truncate(int64(sizeGB) << 30)
	f.Close()
	if err != nil {
		return fmt.Errorf("sizing the writable disk: %w", err)
	}
	// No discard pass over the sparse file, inode tables and journal
	// zeroed lazily by the guest's kernel: a few ms instead of seconds.
	out, err := exec.CommandContext(ctx, "mkfs.ext4", "-q", "-F", "-m", "0",
		"-E", "nodiscard,lazy_itable_init=1,lazy_journal_init=1", path).CombinedOutput()
	if err != nil {
		return fmt.Errorf("formatting the writable disk: %w: %s", err, out)
	}
	return nil
}

// randomMAC is a locally administered unicast MAC.
func randomMAC() string {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	b[0] = b[0]&0xfc | 0x02
	return net.HardwareAddr(b).String()
}

// logWriter logs each write (the guest preparation's progress).
type logWriter struct{ log *slog.Logger }

func (w logWriter) Write(p []byte) (int, error) {
	w.log.Info(string(trimNL(p)))
	return len(p), nil
}

func trimNL(p []byte) []byte {
	for len(p) > 0 && (p[len(p)-1] == '\n' || p[len(p)-1] == '\r') {
		p = p[:len(p)-1]
	}
	return p
}

// lockDir takes an exclusive lock on dir (made if missing), held until
// the returned func: edges of one host share the kernel cache.
func lockDir(dir string) (func(), error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("creating %s: %w", dir, err)
	}
	f, err := os.OpenFile(filepath.Join(dir, ".lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, err
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
		f.Close()
		return nil, fmt.Errorf("locking %s: %w", dir, err)
	}
	return func() { f.Close() }, nil
}
