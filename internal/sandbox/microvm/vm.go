package microvm

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/dsecproject/dsec/internal/sandbox/microvm/agent"
)

// VMConfig describes one VM.
type VMConfig struct {
	// QEMU is the VMM binary ("" = qemu-system-x86_64).
	QEMU  string
	Guest *Guest
	// Dir is the VM's private directory: the agent's socket and the
	// guest's console log go there.
	Dir      string
	MemoryMB int // 0 = 256
	CPUs     int // 0 = 1
	// Accel is QEMU's accelerator: "tcg" (software; the default) or "kvm"
	// where /dev/kvm boots ordinary guests (not this machine's, whose KVM
	// boots PVM guests only).
	Accel string
}

// VM is a running guest and its agent.
type VM struct {
	cmd  *exec.Cmd
	done chan struct{}
	// Agent is the client of the guest's agent.
	Agent *agent.Client
	// Console is the guest's console log.
	Console string
	// Boot is how long the VM took from the VMM's start to its agent's
	// first line.
	Boot time.Duration
}

// Start boots a VM and waits until its agent serves. On error nothing of
// it runs.
func Start(ctx context.Context, cfg VMConfig) (*VM, error) {
	if cfg.Guest == nil {
		return nil, errors.New("microvm: no guest")
	}
	if cfg.QEMU == "" {
		cfg.QEMU = "qemu-system-x86_64"
	}
	qemu, err := exec.LookPath(cfg.QEMU)
	if err != nil {
		return nil, fmt.Errorf("finding the VMM (apt-get install qemu-system-x86): %w", err)
	}
	if cfg.MemoryMB == 0 {
		cfg.MemoryMB = 256
	}
	if cfg.CPUs == 0 {
		cfg.CPUs = 1
	}
	if cfg.Accel == "" {
		cfg.Accel = "tcg"
	}
	if err := os.MkdirAll(cfg.Dir, 0o700); err != nil {
		return nil, fmt.Errorf("creating VM dir: %w", err)
	}
	sock := filepath.Join(cfg.Dir, "agent.sock")
	os.Remove(sock)
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("listening for the VM's agent: %w", err)
	}
	defer ln.Close()
	console := filepath.Join(cfg.Dir, "console.log")
	// ACPI describes the virtio-mmio devices to the kernel: Debian's
	// kernel finds them no other way (it lacks
	// CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES).
	accel := cfg.Accel
	if accel == "tcg" {
		// One thread: multi-threaded TCG of QEMU 7.2 raced the kernel's
		// live code patching on this machine (scripts/cgroupv2-vm.sh).
		accel = "tcg,thread=single"
	}
	args := []string{
		"-M", "microvm", "-accel", accel, "-cpu", "max",
		"-m", strconv.Itoa(cfg.MemoryMB), "-smp", strconv.Itoa(cfg.CPUs),
		"-nodefaults", "-no-user-config", "-display", "none", "-monitor", "none", "-no-reboot",
		"-kernel", cfg.Guest.Kernel, "-initrd", cfg.Guest.Initrd,
		"-append", "console=ttyS0 panic=-1 rdinit=/init" + tscParams(cfg.Accel),
		"-serial", "file:" + console,
		"-device", "virtio-serial-device",
		"-chardev", "socket,path=" + sock + ",id=agent",
		"-device", "virtserialport,chardev=agent,name=" + agent.PortName,
	}
	cmd := exec.Command(qemu, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	var stderr limitedBuffer
	cmd.Stderr = &stderr
	start := time.Now()
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting %s: %w", qemu, err)
	}
	v := &VM{cmd: cmd, done: make(chan struct{}), Console: console}
	go func() { _ = cmd.Wait(); close(v.done) }()
	fail := func(err error) (*VM, error) {
		v.Stop()
		return nil, fmt.Errorf("booting the VM: %w (VMM: %s; console: %s)", err, stderr.String(), tail(console, 2000))
	}
	// The VMM connects as soon as it starts.
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			close(accepted)
			return
		}
		accepted <- c
	}()
	var conn net.Conn
	select {
	case conn = <-accepted:
	case <-v.done:
		return fail(errors.New("the VMM exited"))
	case <-time.After(30 * time.Second):
		return fail(errors.New("the VMM did not connect to the agent's socket within 30 s"))
	case <-ctx.Done():
		return fail(ctx.Err())
	}
	if conn == nil {
		return fail(errors.New("accepting the VMM's connection failed"))
	}
	v.Agent = agent.NewClient(conn)
	rctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	ready := make(chan error, 1)
	go func() { ready <- v.Agent.WaitReady(rctx) }()
	select {
	case err := <-ready:
		if err != nil {
			return fail(err)
		}
	case <-v.done:
		return fail(errors.New("the guest ended before its agent served"))
	}
	v.Boot = time.Since(start)
	return v, nil
}

// Stop kills the VMM and waits for it.
func (v *VM) Stop() {
	if v.Agent != nil {
		v.Agent.Close()
	}
	_ = syscall.Kill(-v.cmd.Process.Pid, syscall.SIGKILL)
	<-v.done
}

// Done is closed when the VMM has exited.
func (v *VM) Done() <-chan struct{} { return v.done }

// tscParams tells a TCG guest its TSC's frequency. Under TCG the guest's
// TSC is the host's, and the microvm machine has no HPET or ACPI PM timer:
// the guest calibrates its TSC against the PIT alone, a loop too
// timing-sensitive for an emulated CPU on a busy host. When it failed
// (about one boot in ten here) the kernel marked the TSC unstable and
// hung before init. The host's frequency is read from /proc/cpuinfo where
// the host says its TSC is constant and its frequency known.
func tscParams(accel string) string {
	if accel != "tcg" {
		return ""
	}
	b, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return ""
	}
	info := string(b)
	if !strings.Contains(info, " constant_tsc") || !strings.Contains(info, " tsc_known_freq") {
		return ""
	}
	for _, line := range strings.Split(info, "\n") {
		k, v, ok := strings.Cut(line, ":")
		if ok && strings.TrimSpace(k) == "cpu MHz" {
			mhz, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err != nil || mhz < 100 {
				return ""
			}
			return fmt.Sprintf(" tsc_early_khz=%d tsc=reliable", int64(mhz*1000))
		}
	}
	return ""
}

// limitedBuffer keeps the first 4 KiB written to it.
type limitedBuffer struct{ b []byte }

func (l *limitedBuffer) Write(p []byte) (int, error) {
	if room := 4096 - len(l.b); room > 0 {
		l.b = append(l.b, p[:min(room, len(p))]...)
	}
	return len(p), nil
}

func (l *limitedBuffer) String() string { return string(l.b) }

// tail returns the last n bytes of a file.
func tail(path string, n int) string {
	b, _ := os.ReadFile(path)
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}
