package microvm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/sandbox/microvm/agent"
)

// VMConfig describes one VM.
type VMConfig struct {
	// QEMU is the VMM binary ("" = qemu-system-x86_64).
	QEMU  string
	Guest *Guest
	// Dir is the VM's private directory: the agent's and the monitor's
	// sockets and the VMM's log go there. (The guest's console is a ring
	// buffer in the VMM: root in the guest writes to it at will.)
	Dir      string
	MemoryMB int // 0 = 256
	CPUs     int // 0 = 1
	// Accel is QEMU's accelerator: "tcg" (software; the default) or "kvm"
	// where /dev/kvm boots ordinary guests (not this machine's, whose KVM
	// boots PVM guests only).
	Accel string
	// Disks are the guest's block devices, in this order.
	Disks []Disk
	// NIC, if set, is the MAC of a virtio-net interface backed by a tap
	// device (TapName) the VMM creates in its network namespace.
	NIC string
	// NetNSPath, if set, is a network namespace (a bound file) the VMM
	// runs in, where its tap is: the guest then has no way to the host's
	// network but what the edge attaches to that namespace.
	NetNSPath string
	// Incoming, if set, is a VM snapshot (SaveTo's file) the VM resumes
	// from instead of booting.
	Incoming string
	// BeforeRun, with Incoming, runs once the snapshot is read and before
	// the guest's vCPUs start, given the VMM's pid: what must be recorded
	// before the guest moves past its snapshot (that it runs, and that
	// the snapshot is gone) is recorded there. Its error stops the start.
	BeforeRun func(pid int) error
	// Reattach, with Incoming, is the client of the agent as it was when
	// the VM was saved (suspended, see DetachAgent): it goes on over the
	// new VMM's socket, connected before the guest runs again so that the
	// agent sees no new connection, and its calls (running commands) go
	// on. Without it the agent sees a new connection and ends what the
	// last one started.
	Reattach *agent.Client
	// Cgroup, if set, are cgroup.procs files the VMM joins.
	Cgroup []string
	// Balloon gives the guest a balloon device that reports the pages
	// it frees, which the VMM then gives back to the host: a guest's
	// memory is what it uses now, not the most it ever touched.
	Balloon bool
}

// MaxLayers is how many layer disks a guest takes: QEMU's microvm machine
// has 24 virtio-mmio transports (measured: a 23rd disk beside the agent's
// serial device and the balloon finds no bus), less the agent's serial
// device, the balloon, a NIC and the writable disk.
const MaxLayers = 24 - 4

// Disk is a virtio block device of the guest, named by its serial.
type Disk struct {
	Path     string
	Serial   string
	ReadOnly bool
}

// TapName is the VMM's tap device, in its network namespace.
const TapName = "tap0"

// VM is a running guest and its agent.
type VM struct {
	// Pid is the VMM's pid; pidf its pidfd, which signals it without
	// the risk of a reused pid and polls readable when it exits.
	Pid  int
	pidf *os.File
	done chan struct{}
	// Agent is the client of the guest's agent.
	Agent *agent.Client
	// Boot is how long the VM took from the VMM's start to its agent's
	// first answer.
	Boot time.Duration
	// Restarted says Adopt found the guest's vCPUs stopped (an edge died
	// while it saved the VM, or before it started a resumed one) and
	// started them.
	Restarted bool
	dir       string
}

// Paths in a VM's directory.
const (
	agentSock = "agent.sock"
	qmpSock   = "qmp.sock"
	vmmLog    = "vmm.log"
)

// Start boots a VM (or resumes one from cfg.Incoming) and waits until its
// agent serves. On error nothing of it runs.
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
	sock := filepath.Join(cfg.Dir, agentSock)
	qmp := filepath.Join(cfg.Dir, qmpSock)
	os.Remove(sock)
	os.Remove(qmp)
	// ACPI describes the virtio-mmio devices to the kernel: Debian's
	// kernel finds them no other way (it lacks
	// CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES).
	accel := cfg.Accel
	if accel == "tcg" {
		// One thread: multi-threaded TCG of QEMU 7.2 raced the kernel's
		// live code patching on this machine (scripts/cgroupv2-vm.sh).
		// A 64 MiB translation cache instead of the 1 GiB default bounds
		// what the VMM itself takes.
		accel = "tcg,thread=single,tb-size=64"
	}
	args := []string{
		"-M", "microvm", "-accel", accel, "-cpu", "max",
		"-m", strconv.Itoa(cfg.MemoryMB), "-smp", strconv.Itoa(cfg.CPUs),
		"-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
		"-kernel", cfg.Guest.Kernel, "-initrd", cfg.Guest.Initrd,
		"-append", "console=ttyS0 quiet panic=-1 rdinit=/init" + tscParams(cfg.Accel),
		"-chardev", "ringbuf,id=console,size=65536", "-serial", "chardev:console",
		// The VMM listens: an edge that restarts connects again.
		"-chardev", "socket,path=" + sock + ",id=agent,server=on,wait=off",
		"-device", "virtio-serial-device",
		"-device", "virtserialport,chardev=agent,name=" + agent.PortName,
		"-qmp", "unix:" + qmp + ",server=on,wait=off",
	}
	for i, d := range cfg.Disks {
		ro := "off"
		if d.ReadOnly {
			ro = "on"
		}
		args = append(args,
			"-drive", fmt.Sprintf("file=%s,if=none,id=d%d,format=raw,readonly=%s,cache=writeback,aio=threads", qemuEscape(d.Path), i, ro),
			"-device", fmt.Sprintf("virtio-blk-device,drive=d%d,serial=%s", i, d.Serial))
	}
	if cfg.NIC != "" {
		args = append(args,
			"-netdev", "tap,id=n0,ifname="+TapName+",script=no,downscript=no,vhost=off",
			"-device", "virtio-net-device,netdev=n0,mac="+cfg.NIC)
	}
	if cfg.Balloon {
		// deflate-on-oom: a balloon the host inflated gives way before
		// the guest's OOM killer takes a process.
		args = append(args, "-device", "virtio-balloon-device,free-page-reporting=on,deflate-on-oom=on")
	}
	if cfg.Incoming != "" {
		args = append(args, "-incoming", "exec:cat "+shellQuote(cfg.Incoming))
	}
	logf, err := os.OpenFile(filepath.Join(cfg.Dir, vmmLog), os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("creating the VMM's log: %w", err)
	}
	defer logf.Close()
	cmd := exec.Command(qemu, args...)
	if cfg.NetNSPath != "" {
		// nsenter enters the namespace and execs the VMM (same pid).
		cmd = exec.Command("nsenter", append([]string{"--net=" + cfg.NetNSPath, "--", qemu}, args...)...)
	}
	// Its own process group, and no pipe to the edge: it outlives an edge
	// restart, which adopts it again.
	pidfd := -1
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, PidFD: &pidfd}
	cmd.Stdout, cmd.Stderr = logf, logf
	start := time.Now()
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting %s: %w", qemu, err)
	}
	v := &VM{Pid: cmd.Process.Pid, done: make(chan struct{}), dir: cfg.Dir}
	if pidfd >= 0 {
		v.pidf = os.NewFile(uintptr(pidfd), "vmm-pidfd")
	}
	go func() { _ = cmd.Wait(); close(v.done) }()
	fail := func(err error) (*VM, error) {
		console := v.Console(context.Background())
		v.Stop()
		return nil, fmt.Errorf("booting the VM: %w (VMM: %s; console: %s)", err, tail(filepath.Join(cfg.Dir, vmmLog), 2000), console)
	}
	for _, procs := range cfg.Cgroup {
		if err := os.WriteFile(procs, []byte(strconv.Itoa(v.Pid)), 0); err != nil {
			return fail(fmt.Errorf("moving the VMM into its cgroup: %w", err))
		}
	}
	if cfg.Incoming != "" && cfg.Reattach != nil {
		if err := v.resumeAttached(ctx, cfg.Reattach, cfg.BeforeRun); err != nil {
			return fail(err)
		}
		v.Boot = time.Since(start)
		return v, nil
	}
	if cfg.Incoming != "" {
		if err := v.continueIncoming(ctx, cfg.BeforeRun); err != nil {
			return fail(err)
		}
	}
	if err := v.connect(ctx, 5*time.Minute); err != nil {
		return fail(err)
	}
	v.Boot = time.Since(start)
	return v, nil
}

// connect dials the VMM's agent socket (waiting for the VMM to make it)
// and waits for the agent to answer, up to within.
func (v *VM) connect(ctx context.Context, within time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, within)
	defer cancel()
	sock := filepath.Join(v.dir, agentSock)
	var conn net.Conn
	for {
		var err error
		conn, err = net.Dial("unix", sock)
		if err == nil {
			break
		}
		select {
		case <-v.done:
			return errors.New("the VMM exited")
		case <-ctx.Done():
			return fmt.Errorf("connecting to the VMM: %w", err)
		case <-time.After(5 * time.Millisecond):
		}
	}
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	go func() {
		select {
		case <-v.done:
			conn.Close()
		case <-ctx.Done():
		}
	}()
	c, err := agent.Connect(ctx, conn)
	if err != nil {
		select {
		case <-v.done:
			return errors.New("the guest ended before its agent served")
		default:
		}
		return fmt.Errorf("waiting for the guest's agent: %w", err)
	}
	v.Agent = c
	return nil
}

// Adopt takes over a VM an earlier process started: the VMM pid (checked
// to be a VMM whose agent socket is in dir) and a new connection to its
// agent.
//
// beforeRun, if set, runs before a stopped guest is started (see
// runStopped); its error leaves the guest stopped and fails the adoption.
func Adopt(ctx context.Context, dir string, pid int, beforeRun func() error) (*VM, error) {
	if !isVMM(pid, dir) {
		return nil, fmt.Errorf("pid %d is not the VMM of %s", pid, dir)
	}
	fd, err := unix.PidfdOpen(pid, unix.PIDFD_NONBLOCK)
	if err != nil {
		return nil, fmt.Errorf("opening the VMM: %w", err)
	}
	if !isVMM(pid, dir) { // the pid was not reused before the pidfd
		unix.Close(fd)
		return nil, fmt.Errorf("pid %d is not the VMM of %s", pid, dir)
	}
	v := &VM{Pid: pid, pidf: os.NewFile(uintptr(fd), "vmm-pidfd"), done: make(chan struct{}), dir: dir}
	rc, err := v.pidf.SyscallConn()
	if err != nil {
		v.pidf.Close()
		return nil, err
	}
	go func() {
		// Through the runtime's poller: no thread waits per VM. Ends
		// when the VMM exits, or with an error once pidf is closed.
		first := true
		_ = rc.Read(func(uintptr) bool {
			if first {
				first = false
				return false
			}
			return true
		})
		close(v.done)
	}()
	// The agent answers only a running guest.
	if v.Restarted, err = v.runStopped(ctx, beforeRun); err != nil {
		v.release()
		return nil, err
	}
	if err := v.connect(ctx, 30*time.Second); err != nil {
		// Not this VM's fault: it keeps running, for a later adoption.
		v.release()
		return nil, err
	}
	return v, nil
}

// runStopped starts the guest's vCPUs if they are stopped, and reports
// whether they were. An adopted VMM is one its meta says runs: one whose
// guest is stopped was left so by an edge that died mid-save (a
// migration to its snapshot, finished or not: called off, the guest goes
// on from where it was) or mid-resume (a snapshot read, not yet
// continued). A guest that failed (an internal or I/O error, a panic, a
// shutdown) is left as it is.
func (v *VM) runStopped(ctx context.Context, beforeRun func() error) (bool, error) {
	q := filepath.Join(v.dir, qmpSock)
	st, err := v.runState(ctx)
	if err != nil || st == "running" {
		return false, err
	}
	if st == "inmigrate" {
		if st, err = v.snapshotRead(ctx); err != nil || st == "running" {
			return false, err
		}
	}
	// A migration still writing is called off; cont refuses to run
	// while one finishes.
	_, _ = qmpRun(ctx, q, "migrate_cancel", nil)
	for deadline := time.Now().Add(10 * time.Second); ; {
		if st, err = v.runState(ctx); err != nil {
			return false, err
		}
		if st != "finish-migrate" && st != "save-vm" {
			break
		}
		if time.Now().After(deadline) {
			return false, fmt.Errorf("the VMM stays in %s", st)
		}
		time.Sleep(20 * time.Millisecond)
	}
	switch st {
	case "running":
		return false, nil
	case "paused", "postmigrate", "prelaunch", "suspended":
		if beforeRun != nil {
			if err := beforeRun(); err != nil {
				return false, err
			}
		}
		if _, err := qmpRun(ctx, q, "cont", nil); err != nil {
			return false, fmt.Errorf("starting the stopped guest: %w", err)
		}
		return true, nil
	}
	return false, fmt.Errorf("the guest is %s", st)
}

// isVMM reports whether pid is a QEMU whose command line names dir's agent
// socket.
func isVMM(pid int, dir string) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
	if err != nil {
		return false
	}
	args := strings.Split(string(b), "\x00")
	return len(args) > 0 && strings.Contains(filepath.Base(args[0]), "qemu") &&
		strings.Contains(string(b), "path="+filepath.Join(dir, agentSock)+",")
}

// Stop kills the VMM (and what it started: its process group, while it
// has not exited) and waits for it.
func (v *VM) Stop() {
	if v.Agent != nil {
		v.Agent.Close()
	}
	select {
	case <-v.done:
	default:
		if v.pidf != nil {
			if rc, err := v.pidf.SyscallConn(); err == nil {
				_ = rc.Control(func(fd uintptr) { _ = unix.PidfdSendSignal(int(fd), unix.SIGKILL, nil, 0) })
			}
		}
		// The group (a snapshot's writer): the VMM is not reaped yet, so
		// its pid, the group's id, is not reused.
		_ = syscall.Kill(-v.Pid, syscall.SIGKILL)
		if v.pidf == nil {
			_ = syscall.Kill(v.Pid, syscall.SIGKILL)
		}
	}
	<-v.done
	v.release()
}

// release lets go of the VM without stopping it: its agent connection and
// its pidfd.
func (v *VM) release() {
	if v.Agent != nil {
		v.Agent.Close()
	}
	if v.pidf != nil {
		v.pidf.Close()
		v.pidf = nil
	}
}

// Console returns what the guest last wrote to its console (up to 4 KiB,
// read from the VMM's ring buffer; "" once the VMM is gone).
func (v *VM) Console(ctx context.Context) string {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	r, err := qmpRun(ctx, filepath.Join(v.dir, qmpSock), "ringbuf-read", map[string]any{"device": "console", "size": 4096, "format": "utf8"})
	if err != nil {
		return ""
	}
	var s string
	_ = json.Unmarshal(r, &s)
	return s
}

// Done is closed when the VMM has exited.
func (v *VM) Done() <-chan struct{} { return v.done }

// runState is the guest's run state as the VMM says it (QMP
// query-status: "running", "paused", "inmigrate", "postmigrate", ...).
func (v *VM) runState(ctx context.Context) (string, error) {
	r, err := qmpRun(ctx, filepath.Join(v.dir, qmpSock), "query-status", nil)
	if err != nil {
		return "", err
	}
	var st struct {
		Status string `json:"status"`
	}
	err = json.Unmarshal(r, &st)
	return st.Status, err
}

// continueIncoming waits for the VMM to have read its snapshot and starts
// the guest's vCPUs: the snapshot was taken stopped, and a VMM resumes a
// snapshot in the run state it was saved in. beforeRun (if set) runs
// first, also when the guest runs already (then it has written nothing
// that matters since: the VMM read its snapshot a moment ago).
func (v *VM) continueIncoming(ctx context.Context, beforeRun func(pid int) error) error {
	st, err := v.snapshotRead(ctx)
	if err != nil {
		return err
	}
	if beforeRun != nil {
		if err := beforeRun(v.Pid); err != nil {
			return err
		}
	}
	if st == "running" {
		return nil
	}
	_, err = qmpRun(ctx, filepath.Join(v.dir, qmpSock), "cont", nil)
	return err
}

// snapshotRead waits until the VMM has read its snapshot (its status is
// no longer "inmigrate") and returns the status.
func (v *VM) snapshotRead(ctx context.Context) (string, error) {
	for {
		if st, err := v.runState(ctx); err == nil && st != "inmigrate" {
			return st, nil
		}
		select {
		case <-v.done:
			return "", errors.New("the VMM exited reading the snapshot")
		case <-ctx.Done():
			return "", ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// resumeAttached resumes a VM from its snapshot with ag, the client of its
// agent when it was saved: once the snapshot is read, ag's new socket is
// connected, then the guest runs again, so that the agent's port finds
// its host connected as it was when saved. beforeRun (if set) runs just
// before the guest does.
func (v *VM) resumeAttached(ctx context.Context, ag *agent.Client, beforeRun func(pid int) error) error {
	q := filepath.Join(v.dir, qmpSock)
	if _, err := v.snapshotRead(ctx); err != nil {
		return err
	}
	conn, err := net.Dial("unix", filepath.Join(v.dir, agentSock))
	if err != nil {
		return fmt.Errorf("connecting to the VMM: %w", err)
	}
	// The VMM takes the connection in its own time: the guest must not
	// run before it has (it would see its host gone, then back).
	for {
		r, err := qmpRun(ctx, q, "query-chardev", nil)
		if err != nil {
			conn.Close()
			return err
		}
		var devs []struct {
			Label    string `json:"label"`
			Filename string `json:"filename"`
		}
		_ = json.Unmarshal(r, &devs)
		connected := false
		for _, d := range devs {
			connected = connected || d.Label == "agent" && !strings.HasPrefix(d.Filename, "disconnected")
		}
		if connected {
			break
		}
		select {
		case <-v.done:
			conn.Close()
			return errors.New("the VMM exited reading the snapshot")
		case <-ctx.Done():
			conn.Close()
			return ctx.Err()
		case <-time.After(5 * time.Millisecond):
		}
	}
	go func() {
		<-v.done
		// The VMM's end gives the reader EOF (what was sent before
		// it read whole); the close after is for the record.
		time.Sleep(2 * time.Second)
		conn.Close()
	}()
	if err := ag.Attach(ctx, conn); err != nil {
		return fmt.Errorf("attaching to the guest's agent: %w", err)
	}
	if beforeRun != nil {
		if err := beforeRun(v.Pid); err != nil {
			return err
		}
	}
	if _, err := qmpRun(ctx, q, "cont", nil); err != nil {
		return err
	}
	v.Agent = ag
	return nil
}

// DetachAgent takes the agent's client from the VM (which then no longer
// closes it): a VM about to be saved hands it, suspended, to the VM that
// will resume it (VMConfig.Reattach).
func (v *VM) DetachAgent() *agent.Client {
	ag := v.Agent
	v.Agent = nil
	return ag
}

// SaveTo writes the VM's memory and device state to file (the guest
// stopped first), and ends the VMM: Start with Incoming resumes it.
func (v *VM) SaveTo(ctx context.Context, file string) error {
	q := filepath.Join(v.dir, qmpSock)
	if _, err := qmpRun(ctx, q, "stop", nil); err != nil {
		return err
	}
	// The file gets its name once whole: a snapshot by that name is one
	// to resume (an edge that dies after the VMM quit finds it so).
	part := file + ".part"
	os.Remove(file)
	os.Remove(part)
	if _, err := qmpRun(ctx, q, "migrate", map[string]any{"uri": "exec:cat > " + shellQuote(part)}); err != nil {
		return err
	}
	for {
		r, err := qmpRun(ctx, q, "query-migrate", nil)
		if err != nil {
			return err
		}
		var st struct {
			Status    string `json:"status"`
			ErrorDesc string `json:"error-desc"`
		}
		_ = json.Unmarshal(r, &st)
		switch st.Status {
		case "completed":
			if err := os.Rename(part, file); err != nil {
				return fmt.Errorf("saving the VM: %w", err)
			}
			if v.Agent != nil {
				v.Agent.Close()
			}
			_, _ = qmpRun(ctx, q, "quit", nil)
			select {
			case <-v.done:
				v.release()
			case <-time.After(10 * time.Second):
				v.Stop()
			}
			return nil
		case "failed", "cancelled":
			return fmt.Errorf("saving the VM: migration %s: %s", st.Status, st.ErrorDesc)
		}
		select {
		case <-ctx.Done():
			// Not half-saved: the migration is called off (the caller
			// starts the vCPUs again).
			cctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			_, _ = qmpRun(cctx, q, "migrate_cancel", nil)
			cancel()
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

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

// qemuEscape doubles the commas of a path in a QEMU option value.
func qemuEscape(s string) string { return strings.ReplaceAll(s, ",", ",,") }

// shellQuote quotes s for sh.
func shellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }

// tail returns the last n bytes of a file (only those are read).
func tail(path string, n int64) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	if fi, err := f.Stat(); err == nil && fi.Size() > n {
		_, _ = f.Seek(-n, io.SeekEnd)
	}
	b, _ := io.ReadAll(io.LimitReader(f, n))
	return string(b)
}
