package container

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/mountinfo"
	"github.com/dsecproject/dsec/internal/sandbox"
	"github.com/dsecproject/dsec/internal/sandbox/container/nsexec"
	"github.com/dsecproject/dsec/internal/sandbox/sandboxtest"
)

func newNativeBackend(t *testing.T) *Container {
	t.Helper()
	if !nsexec.Available {
		t.Skip("needs a build with cgo: the launcher is C")
	}
	return newTestBackendWith(t, "runc", true, true, func(c *Config) { c.NetnsPool = 4 })
}

// nativeSandbox creates a sandbox from rootfs with the own launcher and
// registers its destroy.
func nativeSandbox(t *testing.T, c *Container, rootfs string, edit func(*sandbox.Config)) (sandbox.Config, error) {
	t.Helper()
	id := fmt.Sprintf("native-%d-%s", os.Getpid(), strings.ReplaceAll(t.Name(), "/", "-"))
	cfg := sandbox.Config{ID: id, Dir: t.TempDir(), Rootfs: rootfs, Hostname: "native",
		CgroupPath: filepath.Join("/dsec-test", id), Limits: sandbox.Limits{MemoryBytes: 96 << 20, Pids: 77, CPU: 0.5}}
	if edit != nil {
		edit(&cfg)
	}
	err := c.Create(context.Background(), cfg)
	t.Cleanup(func() {
		_ = c.Destroy(context.Background(), cfg.ID)
		_ = c.cfg.Cgroups.Remove(cfg.CgroupPath)
	})
	return cfg, err
}

func sh(t *testing.T, c *Container, id, script string) (int, string) {
	t.Helper()
	var out bytes.Buffer
	p, err := c.Exec(context.Background(), id, sandbox.Process{Args: []string{"/bin/sh", "-c", script}, Stdout: &out, Stderr: &out, Cwd: "/"})
	if err != nil {
		t.Fatalf("exec: %v", err)
	}
	code, err := p.Wait()
	if err != nil {
		t.Fatal(err)
	}
	return code, out.String()
}

// TestNativeInitAndCgroup: init runs with exactly the sandbox's
// capabilities, no_new_privs and a seccomp filter, in its cgroup with the
// limits written, and the host's mount table does not change.
func TestNativeInitAndCgroup(t *testing.T) {
	c := newNativeBackend(t)
	before, err := mountinfo.Read()
	if err != nil {
		t.Fatal(err)
	}
	rootfs := sandboxtest.BusyboxRootfs(t)
	mnt, target := detachedRootfs(t, rootfs)
	cfg, err := nativeSandbox(t, c, target, func(cfg *sandbox.Config) { cfg.RootfsMount = mnt })
	if err != nil {
		t.Fatal(err)
	}
	st, err := c.Status(context.Background(), cfg.ID)
	if err != nil || !st.Running {
		t.Fatalf("status %+v %v", st, err)
	}
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", st.Pid))
	if err != nil {
		t.Fatal(err)
	}
	want := fmt.Sprintf("%016x", capMask(defaultCaps))
	for _, line := range []string{"CapBnd:\t" + want, "CapEff:\t" + want, "CapPrm:\t" + want, "CapInh:\t0000000000000000", "CapAmb:\t0000000000000000", "NoNewPrivs:\t1", "Seccomp:\t2"} {
		if !strings.Contains(string(status), line+"\n") {
			t.Errorf("init lacks %q:\n%s", line, status)
		}
	}
	if comm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", st.Pid)); strings.TrimSpace(string(comm)) != "init" {
		t.Errorf("init is %q, want /dev/init (catatonit)", comm)
	}
	// Fields after the command: state, ppid, pgrp, session.
	stat, _ := os.ReadFile(fmt.Sprintf("/proc/%d/stat", st.Pid))
	f := strings.Fields(string(stat[bytes.LastIndexByte(stat, ')')+1:]))
	if len(f) < 4 || f[3] != fmt.Sprint(st.Pid) {
		t.Errorf("init is not the leader of a session of its own: %s", stat)
	}
	// Not the edge's child: the host's reaper has it, as after `crun run
	// -d`; a child of the edge dying on its own would stay a zombie.
	if len(f) < 2 || f[1] == fmt.Sprint(os.Getpid()) {
		t.Errorf("init's parent is the edge: %s", stat)
	}
	rel, err := c.cfg.Cgroups.RelOf(st.Pid)
	if err != nil || rel != cfg.CgroupPath {
		t.Fatalf("init in cgroup %q (%v), want %s", rel, err, cfg.CgroupPath)
	}
	if code, out := sh(t, c, cfg.ID, "hostname; echo $$; cat /sys/fs/cgroup/pids.max /sys/fs/cgroup/pids/pids.max 2>/dev/null; ls /dev"); code != 0 ||
		!strings.HasPrefix(out, "native\n") {
		t.Errorf("in the sandbox (%d): %s", code, out)
	}
	// Without a user namespace the uids inside are host uids: only root
	// may bind ports below 1024 (user-namespace sandboxes open them all).
	if code, out := sh(t, c, cfg.ID, "cat /proc/sys/net/ipv4/ip_unprivileged_port_start"); code != 0 || out != "1024\n" {
		t.Errorf("ip_unprivileged_port_start (%d): %q, want the kernel's 1024", code, out)
	}
	// Masks and read-only paths hold (a writable /proc/sys would reach
	// host-wide settings; hostname is per uts namespace, safe to try).
	if code, out := sh(t, c, cfg.ID, "head -c 16 /proc/kallsyms | wc -c; echo x 2>/dev/null > /proc/sys/kernel/hostname && echo WROTE; ls /proc/acpi 2>/dev/null | wc -l"); code != 0 ||
		out != "0\n0\n" {
		t.Errorf("masks (%d): %q, want 0 bytes of kallsyms, no write to /proc/sys, an empty /proc/acpi", code, out)
	}
	if cpu := c.cfg.Cgroups.V1["cpu"]; cpu != "" {
		b, _ := os.ReadFile(filepath.Join(cpu, cfg.CgroupPath, "cpu.cfs_quota_us"))
		if strings.TrimSpace(string(b)) != "50000" {
			t.Errorf("cpu quota %s, want 50000", b)
		}
	} else if v2 := c.cfg.Cgroups.V2Root; v2 != "" {
		b, _ := os.ReadFile(filepath.Join(v2, cfg.CgroupPath, "cpu.max"))
		if strings.TrimSpace(string(b)) != "50000 100000" {
			t.Errorf("cpu.max %s, want 50000 100000", b)
		}
	}
	if m := c.cfg.Cgroups.V1["memory"]; m != "" {
		b, _ := os.ReadFile(filepath.Join(m, cfg.CgroupPath, "memory.limit_in_bytes"))
		if strings.TrimSpace(string(b)) != fmt.Sprint(96<<20) {
			t.Errorf("memory limit %s", b)
		}
	}
	if p := c.cfg.Cgroups.V1["pids"]; p != "" {
		b, _ := os.ReadFile(filepath.Join(p, cfg.CgroupPath, "pids.max"))
		if strings.TrimSpace(string(b)) != "77" {
			t.Errorf("pids.max %s", b)
		}
	} else if v2 := c.cfg.Cgroups.V2Root; v2 != "" {
		b, _ := os.ReadFile(filepath.Join(v2, cfg.CgroupPath, "pids.max"))
		if strings.TrimSpace(string(b)) != "77" {
			t.Errorf("pids.max %s", b)
		}
	}
	if m := c.cfg.Cgroups.V1["memory"]; m == "" && c.cfg.Cgroups.V2Root != "" {
		b, _ := os.ReadFile(filepath.Join(c.cfg.Cgroups.V2Root, cfg.CgroupPath, "memory.max"))
		if strings.TrimSpace(string(b)) != fmt.Sprint(96<<20) {
			t.Errorf("memory.max %s", b)
		}
	}
	after, err := mountinfo.Read()
	if err != nil {
		t.Fatal(err)
	}
	if len(after) != len(before) {
		t.Errorf("host mount table went from %d to %d entries", len(before), len(after))
	}
}

// TestNativeDevicesUnusable: root inside may mknod, but no node it makes
// opens (every writable mount is nodev), while /dev's own nodes work. The
// null node is one the device cgroup allows: only nodev stops it.
func TestNativeDevicesUnusable(t *testing.T) {
	c := newNativeBackend(t)
	cfg, err := nativeSandbox(t, c, sandboxtest.BusyboxRootfs(t), nil)
	if err != nil {
		t.Fatal(err)
	}
	code, out := sh(t, c, cfg.ID, `echo x > /dev/null && head -c 4 /dev/zero | wc -c && head -c 4 /dev/urandom | wc -c || exit 9
for dir in /tmp /dev /dev/shm /; do
  for node in "mem c 1 1" "kmsg c 1 11" "disk b 7 0" "null c 1 3"; do
    set -- $node
    rm -f $dir/x-$1
    mknod $dir/x-$1 $2 $3 $4 2>/dev/null || continue
    if head -c 1 $dir/x-$1 >/dev/null 2>&1; then echo "OPENED $dir/x-$1"; fi
    rm -f $dir/x-$1
  done
done`)
	if code != 0 || strings.Contains(out, "OPENED") || !strings.HasPrefix(out, "4\n4\n") {
		t.Fatalf("exit %d:\n%s", code, out)
	}

	// The host's own nodes stay the host's: through /dev and through
	// init's stdio (/proc/1/fd), chmod and chown get EROFS. The modes
	// and owners tried are the ones the nodes have, so a failing check
	// changes nothing on the host.
	var before []unix.Stat_t
	for _, d := range append(deviceNodes, "null") {
		var st unix.Stat_t
		if err := unix.Stat("/dev/"+d, &st); err != nil {
			t.Fatal(err)
		}
		before = append(before, st)
	}
	code, out = sh(t, c, cfg.ID, `for f in /dev/null /dev/zero /dev/full /dev/random /dev/urandom /dev/tty /proc/1/fd/0 /proc/1/fd/2; do
  chmod 666 $f 2>/dev/null && echo "CHMOD $f"
  chown 0:0 $f 2>/dev/null && echo "CHOWN $f"
done; echo done`)
	if code != 0 || out != "done\n" {
		t.Errorf("host device nodes changeable from inside (%d):\n%s", code, out)
	}
	for i, d := range append(deviceNodes, "null") {
		var st unix.Stat_t
		if err := unix.Stat("/dev/"+d, &st); err != nil {
			t.Fatal(err)
		}
		if st.Ctim != before[i].Ctim {
			t.Errorf("host /dev/%s changed (ctime)", d)
		}
	}
}

// TestNativeHostileRootfs: an image or an earlier sandbox (through a
// snapshot) can plant any symlink where the launcher mounts. A kernel
// filesystem mount point that is a symlink is refused, as runc and crun
// refuse it: wherever it pointed (the host, or elsewhere in the rootfs,
// where /proc would escape its masks and read-only paths), nothing is
// mounted or created outside the rootfs. /etc/resolv.conf may be a symlink
// (images point it at systemd's stub): it resolves inside the rootfs.
func TestNativeHostileRootfs(t *testing.T) {
	c := newNativeBackend(t)
	victim := t.TempDir()
	resolv := filepath.Join(t.TempDir(), "resolv.conf")
	if err := os.WriteFile(resolv, []byte("nameserver 127.0.0.1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	plant := func(t *testing.T, links map[string]string, dirs ...string) string {
		rootfs := sandboxtest.BusyboxRootfs(t)
		for _, d := range dirs {
			if err := os.MkdirAll(filepath.Join(rootfs, d), 0o755); err != nil {
				t.Fatal(err)
			}
		}
		for name, to := range links {
			p := filepath.Join(rootfs, name)
			if err := os.RemoveAll(p); err != nil {
				t.Fatal(err)
			}
			if err := os.Symlink(to, p); err != nil {
				t.Fatal(err)
			}
		}
		return rootfs
	}
	checkHost := func(t *testing.T) {
		if ents, _ := os.ReadDir(victim); len(ents) != 0 {
			t.Errorf("create wrote on the host: %v", ents)
		}
		if b, _ := os.ReadFile(resolv); string(b) != "nameserver 127.0.0.1\n" {
			t.Errorf("host resolv.conf changed: %q", b)
		}
	}
	escape := "../../../../../../" + strings.TrimPrefix(victim, "/")
	// A followed /etc/resolv.conf stays on the rootfs's mount: onto
	// /dev or /proc it would cover a device or a kernel file.
	for name, to := range map[string]string{"resolv-onto-dev": "/dev/urandom", "resolv-onto-proc": "/proc/sys/kernel/hostname", "resolv-onto-init": "/dev/init"} {
		t.Run(name, func(t *testing.T) {
			rootfs := plant(t, map[string]string{"etc/resolv.conf": to}, "etc")
			_, err := nativeSandbox(t, c, rootfs, func(cfg *sandbox.Config) { cfg.ResolvConf = resolv })
			if !errors.Is(err, unix.EXDEV) {
				t.Fatalf("create: %v, want it refused (EXDEV)", err)
			}
			checkHost(t)
		})
	}
	refused := map[string]map[string]string{
		"proc-to-host":         {"proc": filepath.Join(victim, "proc")},
		"proc-relative-out":    {"proc": escape + "/proc"},
		"proc-moved-in-root":   {"proc": "/dev/p", "dev/p": "/y"}, // masks would miss it
		"dev-moved-in-root":    {"dev": "/x"},                     // /dev/sh could be replaced
		"sys-to-host":          {"sys": filepath.Join(victim, "sys")},
		"dev-parent-symlink":   {"dev": "/etc"},
		"proc-dangling":        {"proc": "/nowhere"},
		"sys-relative-in-root": {"sys": "tmp"},
	}
	for name, links := range refused {
		t.Run(name, func(t *testing.T) {
			rootfs := plant(t, links, "y", "x")
			cfg, err := nativeSandbox(t, c, rootfs, func(cfg *sandbox.Config) { cfg.ResolvConf = resolv })
			if err == nil || !errors.Is(err, unix.ELOOP) {
				t.Fatalf("create: %v, want it refused (ELOOP)", err)
			}
			if pids, err := c.cfg.Cgroups.Procs(cfg.CgroupPath); !errors.Is(err, errdefs.ErrNotFound) {
				t.Errorf("cgroup left (processes %v, %v)", pids, err)
			}
			checkHost(t)
		})
	}
	t.Run("resolv-conf-symlinks-resolve-in-root", func(t *testing.T) {
		rootfs := plant(t, map[string]string{"etc": victim, "run": escape})
		cfg, err := nativeSandbox(t, c, rootfs, func(cfg *sandbox.Config) { cfg.ResolvConf = resolv })
		if err != nil {
			t.Fatalf("create: %v", err)
		}
		if code, out := sh(t, c, cfg.ID, "cat /etc/resolv.conf && test -e /proc/self/status && test -c /dev/null"); code != 0 || out != "nameserver 127.0.0.1\n" {
			t.Errorf("sandbox (%d): %s", code, out)
		}
		checkHost(t)
	})
	t.Run("resolv-conf-dangling", func(t *testing.T) {
		rootfs := plant(t, map[string]string{"etc/resolv.conf": "../run/systemd/resolve/stub-resolv.conf"}, "etc")
		cfg, err := nativeSandbox(t, c, rootfs, func(cfg *sandbox.Config) { cfg.ResolvConf = resolv })
		if err != nil {
			t.Fatalf("create: %v", err)
		}
		if code, out := sh(t, c, cfg.ID, "cat /etc/resolv.conf"); code != 0 || out != "nameserver 127.0.0.1\n" {
			t.Errorf("sandbox (%d): %s", code, out)
		}
		checkHost(t)
	})
}

// TestNativeFailureLeavesNothing: a launch that fails halfway (a rootfs
// whose /dev is a file) reports the step and leaves no process, state or
// cgroup.
func TestNativeFailureLeavesNothing(t *testing.T) {
	c := newNativeBackend(t)
	rootfs := sandboxtest.BusyboxRootfs(t)
	if err := os.Remove(filepath.Join(rootfs, "dev")); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(rootfs, "dev"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	cfg, err := nativeSandbox(t, c, rootfs, nil)
	var le *nsexec.LaunchError
	if !errors.As(err, &le) || !strings.Contains(err.Error(), "/dev") {
		t.Fatalf("create: %v, want the launcher's error naming /dev", err)
	}
	if _, err := os.Stat(filepath.Join(c.cfg.StateRoot, cfg.ID)); err == nil {
		t.Error("state left")
	}
	if pids, err := c.cfg.Cgroups.Procs(cfg.CgroupPath); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("cgroup left (processes %v, %v)", pids, err)
	}
}

// TestNativeSuperblocks: a sandbox of the launcher has one tmpfs (/dev,
// with /dev/shm in it), no mqueue mount, and the shared sysfs, which two
// sandboxes see as the same superblock; /dev/shm still takes writes and
// runs nothing.
func TestNativeSuperblocks(t *testing.T) {
	c := newNativeBackend(t)
	if err := c.SharedSysfsErr(); err != nil {
		t.Skipf("no shared sysfs on this kernel (each sandbox mounts its own): %v", err)
	}
	sysDev := map[string]bool{}
	for i := range 2 {
		cfg, err := nativeSandbox(t, c, sandboxtest.BusyboxRootfs(t), func(cfg *sandbox.Config) { cfg.ID += fmt.Sprint(i) })
		if err != nil {
			t.Fatal(err)
		}
		code, out := sh(t, c, cfg.ID, "cat /proc/self/mountinfo")
		if code != 0 {
			t.Fatal(out)
		}
		types := map[string][]string{} // fstype -> "dev mountpoint"
		for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
			f := strings.Fields(line)
			sep := slices.Index(f, "-")
			if sep < 0 || sep+1 >= len(f) {
				t.Fatalf("mountinfo line %q", line)
			}
			types[f[sep+1]] = append(types[f[sep+1]], f[2]+" "+f[4])
		}
		if len(types["tmpfs"]) != 2 || len(types["mqueue"]) != 0 || len(types["sysfs"]) != 1 {
			t.Errorf("tmpfs %v (want /dev and its /dev/shm rebind), mqueue %v, sysfs %v", types["tmpfs"], types["mqueue"], types["sysfs"])
		}
		if tm := types["tmpfs"]; len(tm) == 2 && strings.Fields(tm[0])[0] != strings.Fields(tm[1])[0] {
			t.Errorf("/dev/shm is a tmpfs of its own: %v", tm)
		}
		if s := types["sysfs"]; len(s) == 1 {
			sysDev[strings.Fields(s[0])[0]] = true
		}
		_, out = sh(t, c, cfg.ID, `stat -c %a /dev/shm; echo x > /dev/shm/f; cat /dev/shm/f; cp /bin/busybox /dev/shm/bb; chmod +x /dev/shm/bb; /dev/shm/bb true && echo RAN`)
		if !strings.HasPrefix(out, "1777\nx\n") || strings.Contains(out, "RAN") {
			t.Errorf("/dev/shm (%d): %s", code, out)
		}
	}
	if len(sysDev) != 1 {
		t.Errorf("sandboxes' sysfs superblocks %v, want one shared", sysDev)
	}
}

// TestNativeInitDiesAlone: an init that dies on its own (OOM, a kill from
// the host) is reaped by the host's reaper, not left a zombie of the edge
// holding its pid and its charge in the (recycled) cgroup.
func TestNativeInitDiesAlone(t *testing.T) {
	c := newNativeBackend(t)
	cfg, err := nativeSandbox(t, c, sandboxtest.BusyboxRootfs(t), nil)
	if err != nil {
		t.Fatal(err)
	}
	st, err := c.Status(context.Background(), cfg.ID)
	if err != nil || !st.Running {
		t.Fatalf("status %+v %v", st, err)
	}
	if err := unix.Kill(st.Pid, unix.SIGKILL); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		_, err := os.Stat(fmt.Sprintf("/proc/%d", st.Pid))
		if errors.Is(err, os.ErrNotExist) {
			break
		}
		if time.Now().After(deadline) {
			stat, _ := os.ReadFile(fmt.Sprintf("/proc/%d/stat", st.Pid))
			t.Fatalf("init %d not reaped 30 s after it died: %s", st.Pid, stat)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if st, err := c.Status(context.Background(), cfg.ID); err != nil || st.Running {
		t.Errorf("status after init died: %+v %v", st, err)
	}
	if p := c.cfg.Cgroups.V1["pids"]; p != "" {
		b, _ := os.ReadFile(filepath.Join(p, cfg.CgroupPath, "pids.current"))
		if strings.TrimSpace(string(b)) != "0" {
			t.Errorf("pids.current %s after init was reaped", b)
		}
	}
	if err := c.Destroy(context.Background(), cfg.ID); err != nil {
		t.Fatal(err)
	}
}

// TestNativeNetnsPool: init joins a namespace from the pool (one only
// its sandbox gets), keeps no fd of it or of any other namespace, and a
// create with the pool empty makes its own.
func TestNativeNetnsPool(t *testing.T) {
	c := newNativeBackend(t)
	// A pool that does not refill for an hour, so that the fifth create
	// finds it empty however slow the machine (no launch runs yet).
	c.netns.close()
	c.netns = newTestPool(t, 4, time.Hour, time.Hour)
	waitFree(t, c.netns, 4)
	// Peek at the pool's namespaces: take them all, note them, put them
	// back (the filler waits netnsQuiet after a take, and the pool is
	// full, so it adds none meanwhile).
	pooled := map[uint64]bool{}
	var fs []*os.File
	for range 4 {
		f := c.netns.take()
		pooled[nsIno(t, f)] = true
		fs = append(fs, f)
	}
	for _, f := range fs {
		c.netns.put(t, f)
	}
	inos := map[uint64]bool{}
	for i := range 5 {
		if i == 4 && c.netns.Free() != 0 {
			t.Fatalf("pool refilled during the creates: %d", c.netns.Free())
		}
		cfg, err := nativeSandbox(t, c, sandboxtest.BusyboxRootfs(t), func(cfg *sandbox.Config) { cfg.ID += fmt.Sprint(i) })
		if err != nil {
			t.Fatal(err)
		}
		st, err := c.Status(context.Background(), cfg.ID)
		if err != nil {
			t.Fatal(err)
		}
		var ns unix.Stat_t
		if err := unix.Stat(fmt.Sprintf("/proc/%d/ns/net", st.Pid), &ns); err != nil {
			t.Fatal(err)
		}
		if inos[ns.Ino] {
			t.Errorf("sandbox %d shares a network namespace with an earlier one", i)
		}
		inos[ns.Ino] = true
		if from := pooled[ns.Ino]; from != (i < 4) {
			t.Errorf("sandbox %d: namespace from the pool %v, want %v", i, from, i < 4)
		}
		ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", st.Pid))
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range ents {
			l, _ := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", st.Pid, e.Name()))
			if kind, _, ok := strings.Cut(l, ":["); ok && slices.Contains([]string{"net", "mnt", "pid", "ipc", "uts", "user", "cgroup", "time"}, kind) {
				t.Errorf("init holds fd %s -> %s", e.Name(), l)
			}
		}
		if code, out := sh(t, c, cfg.ID, "busybox ip -o link | wc -l; busybox ip -o link show lo"); code != 0 || !strings.HasPrefix(out, "1\n") || !strings.Contains(out, "<LOOPBACK,UP") {
			t.Errorf("sandbox %d network (%d): %s", i, code, out)
		}
	}
}

// TestNativeSharedMemory: a sandbox whose cgroup is below the shared
// memory parent runs with init charged to that parent and no memory
// cgroup of its own; the runtime, which would make one, refuses it.
func TestNativeSharedMemory(t *testing.T) {
	c := newNativeBackend(t)
	cg := c.cfg.Cgroups
	cg.SharedMemory = fmt.Sprintf("/dsec-test-shm-%d", os.Getpid())
	if err := cg.EnsureSharedMemoryParent(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cg.Remove(cg.SharedMemory) })
	cfg, err := nativeSandbox(t, c, sandboxtest.BusyboxRootfs(t), func(cfg *sandbox.Config) {
		cfg.CgroupPath = cg.SharedMemory + "/" + cfg.ID
		cfg.Limits.MemoryBytes = 0
	})
	if err != nil {
		t.Fatal(err)
	}
	st, err := c.Status(context.Background(), cfg.ID)
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", st.Pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		f := strings.SplitN(line, ":", 3)
		want := cfg.CgroupPath
		if strings.Contains(","+f[1]+",", ",memory,") {
			want = cg.SharedMemory
		}
		if f[2] != want {
			t.Errorf("init in %s, want %s", line, want)
		}
	}
	if code, out := sh(t, c, cfg.ID, "echo ok"); code != 0 || out != "ok\n" {
		t.Errorf("exec (%d): %q", code, out)
	}

	rt := newTestBackendWith(t, "runc", true, false)
	rt.cfg.Cgroups.SharedMemory = cg.SharedMemory
	_, err = nativeSandbox(t, rt, sandboxtest.BusyboxRootfs(t), func(cfg *sandbox.Config) {
		cfg.ID += "-rt"
		cfg.CgroupPath = cg.SharedMemory + "/" + cfg.ID
		cfg.Limits.MemoryBytes = 0
	})
	if !errors.Is(err, errdefs.ErrPrecondition) {
		t.Errorf("runtime create below the shared memory parent: %v, want a precondition error", err)
	}
}

// TestNativeUserNS: a sandbox with a user namespace starts through the
// launcher in the namespace its owner uid made: init runs as host uid
// HostID with the sandbox's capabilities held there only, what it writes
// lands with the mapped IDs, and root inside may listen on port 80 in a
// network namespace its user namespace does not own, pooled or not.
func TestNativeUserNS(t *testing.T) {
	const base = 1_000_000_000
	// An owner of this run's own: the test looks for processes left
	// running as it, which another run's would be.
	owner := uint32(1_000_065_537 + os.Getpid()%60000)
	for _, pooled := range []bool{true, false} {
		t.Run(map[bool]string{true: "pooled", false: "fresh"}[pooled], func(t *testing.T) {
			c := newNativeBackend(t)
			if pooled {
				waitFree(t, c.netns, 4)
			} else {
				c.netns.close()
				c.netns = nil
			}
			rootfs := sandboxtest.BusyboxRootfs(t)
			if err := os.Symlink("busybox", filepath.Join(rootfs, "bin/nc")); err != nil {
				t.Fatal(err)
			}
			// The rootfs shows files with the mapped IDs, as the edge's
			// idmapped layers do.
			if err := filepath.Walk(rootfs, func(p string, _ os.FileInfo, err error) error {
				if err != nil {
					return err
				}
				return os.Lchown(p, base, base)
			}); err != nil {
				t.Fatal(err)
			}
			cfg, err := nativeSandbox(t, c, rootfs, func(cfg *sandbox.Config) {
				cfg.UserNS = &sandbox.IDMap{HostID: base, Size: 65536, Owner: owner}
			})
			if err != nil {
				t.Fatal(err)
			}
			if pooled && c.netns.Free() != 3 {
				t.Errorf("the create took no namespace from the pool (%d left of 4)", c.netns.Free())
			}
			st, err := c.Status(context.Background(), cfg.ID)
			if err != nil || !st.Running {
				t.Fatalf("status %+v %v", st, err)
			}
			// The launch returns once init's exec has replaced its memory,
			// which may be before the kernel has set its arguments.
			var l []byte
			for deadline := time.Now().Add(time.Second); len(l) == 0 && time.Now().Before(deadline); time.Sleep(time.Millisecond) {
				l, _ = os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", st.Pid))
			}
			if !bytes.HasPrefix(l, []byte(initPath)) {
				t.Errorf("init is %q, not started by the launcher", l)
			}
			status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", st.Pid))
			if err != nil {
				t.Fatal(err)
			}
			want := fmt.Sprintf("%016x", capMask(defaultCaps))
			for _, line := range []string{"Uid:\t1000000000\t1000000000\t1000000000\t1000000000", "Gid:\t1000000000\t1000000000\t1000000000\t1000000000",
				"Groups:\t ", "CapEff:\t" + want, "NoNewPrivs:\t1", "Seccomp:\t2"} {
				if !strings.Contains(string(status), "\n"+line+"\n") {
					t.Errorf("init lacks %q:\n%s", line, status)
				}
			}
			f, err := os.Open(fmt.Sprintf("/proc/%d/ns/user", st.Pid))
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			var uid uint32
			const nsGetOwnerUID = 0xb704 // _IO(0xb7, 0x4)
			if _, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), nsGetOwnerUID, uintptr(unsafe.Pointer(&uid))); errno != 0 || uid != owner {
				t.Errorf("the sandbox's user namespace belongs to uid %d (%v), want %d", uid, errno, owner)
			}
			// The other namespaces are the host's user namespace's: an
			// NS_GET_USERNS of the mount namespace gives the host's.
			var hostUserNS, mntOwner unix.Stat_t
			if err := unix.Stat("/proc/self/ns/user", &hostUserNS); err != nil {
				t.Fatal(err)
			}
			m, err := os.Open(fmt.Sprintf("/proc/%d/ns/mnt", st.Pid))
			if err != nil {
				t.Fatal(err)
			}
			const nsGetUserNS = 0xb701 // _IO(0xb7, 0x1)
			ufd, _, errno := unix.Syscall(unix.SYS_IOCTL, m.Fd(), nsGetUserNS, 0)
			m.Close()
			if errno != 0 {
				t.Fatalf("NS_GET_USERNS: %v", errno)
			}
			err = unix.Fstat(int(ufd), &mntOwner)
			unix.Close(int(ufd))
			if err != nil || mntOwner.Ino != hostUserNS.Ino {
				t.Errorf("the sandbox's mount namespace is not the host user namespace's (%v)", err)
			}
			// Its root holds nothing over the namespaces the host's user
			// namespace owns: no mount, unmount, hostname or sysctl.
			if code, out := sh(t, c, cfg.ID, "mount -t tmpfs x /tmp && echo MOUNTED; umount /proc/kcore && echo UNMOUNTED; busybox hostname x && echo RENAMED; echo 1024 > /proc/sys/net/ipv4/ip_unprivileged_port_start && echo WROTE; true"); code != 0 ||
				strings.ContainsAny(out, "MUWR") && (strings.Contains(out, "MOUNTED") || strings.Contains(out, "RENAMED") || strings.Contains(out, "WROTE")) {
				t.Errorf("root inside changed what it must not (%d): %s", code, out)
			}
			script := "id -u; cat /proc/self/uid_map; touch /tmp/made; nc -l -p 80 </dev/null >/dev/null 2>&1 & sleep 0.3; netstat -ltn | grep -c ':80 '; kill $!"
			if code, out := sh(t, c, cfg.ID, script); code != 0 || strings.Join(strings.Fields(out), " ") != "0 0 1000000000 65536 1" {
				t.Errorf("in the sandbox (%d): %q, want root, the map and a listener on port 80", code, out)
			}
			var made unix.Stat_t
			if err := unix.Stat(filepath.Join(rootfs, "tmp/made"), &made); err != nil || made.Uid != base || made.Gid != base {
				t.Errorf("a file root inside made is owned by %d:%d on the host (%v), want %d", made.Uid, made.Gid, err, base)
			}
			// A command's stdio pipes are its user's: it can open
			// /dev/stdin again (host root's pipe would be nobody's).
			var out bytes.Buffer
			pr, err := c.Exec(context.Background(), cfg.ID, sandbox.Process{Args: []string{"/bin/sh", "-c", "cat /dev/stdin; echo; echo reopened >/dev/stdout"},
				Stdin: strings.NewReader("from stdin"), Stdout: &out, Stderr: &out, Cwd: "/"})
			if err != nil {
				t.Fatal(err)
			}
			if code, err := pr.Wait(); code != 0 || err != nil || out.String() != "from stdin\nreopened\n" {
				t.Errorf("reopening stdio (%d, %v): %q", code, err, out.String())
			}
			// The task that made the namespace is gone: nothing runs as
			// the owner.
			if pids := pidsOfUID(t, owner); len(pids) > 0 {
				t.Errorf("processes %v run as the owner uid after the create", pids)
			}
		})
	}
	// A namespace whose ID maps the kernel refuses (a range past 2^32)
	// fails the create with the step named, and leaves no state, cgroup,
	// process or fd behind.
	t.Run("refused map", func(t *testing.T) {
		c := newNativeBackend(t)
		c.netns.close() // its fds come and go
		c.netns = nil
		fds := openFDs(t)
		cfg, err := nativeSandbox(t, c, sandboxtest.BusyboxRootfs(t), func(cfg *sandbox.Config) {
			cfg.UserNS = &sandbox.IDMap{HostID: 1<<32 - 1000, Size: 65536, Owner: owner}
		})
		var le *nsexec.LaunchError
		if !errors.As(err, &le) || !strings.Contains(err.Error(), "uid_map") {
			t.Fatalf("create: %v, want the launcher's error naming uid_map", err)
		}
		if _, err := os.Stat(filepath.Join(c.cfg.StateRoot, cfg.ID)); err == nil {
			t.Error("state left")
		}
		if pids, err := c.cfg.Cgroups.Procs(cfg.CgroupPath); !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("cgroup left (processes %v, %v)", pids, err)
		}
		nothingLeft(t, owner, fds)
	})
}

// TestNativeUserNSOwnerStopped: anything running as the owner uid can
// signal the task that makes the namespace (the same uid) and the
// sandbox's init (the owner holds every capability over its namespace).
// With one stopping every process of that uid over and over, every create
// still ends within a bound (the owner task's answer within 10 s, the
// launch within its deadline), and nothing is left running as the owner
// or holding the test's fds.
func TestNativeUserNSOwnerStopped(t *testing.T) {
	c := newNativeBackend(t)
	c.netns.close()
	c.netns = nil
	c.launchDeadline, c.ownerWait = 2*time.Second, 500*time.Millisecond
	owner := uint32(1_000_065_537 + (os.Getpid()+1)%60000)
	rootfs := sandboxtest.BusyboxRootfs(t) // before the stopper: it skips without busybox
	fds := openFDs(t)
	// A shell running as the owner stops every other process of its uid
	// (kill -1 from the shell itself spares the shell).
	stopper := exec.Command("busybox", "sh", "-c", "while :; do kill -STOP -1 2>/dev/null; done")
	stopper.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: owner, Gid: owner}}
	if err := stopper.Start(); err != nil {
		t.Fatal(err)
	}
	failed := 0
	const creates = 8
	for i := range creates {
		start := time.Now()
		cfg, err := nativeSandbox(t, c, rootfs, func(cfg *sandbox.Config) {
			cfg.ID += fmt.Sprint(i)
			cfg.UserNS = &sandbox.IDMap{HostID: 1_000_000_000, Size: 65536, Owner: owner}
		})
		if took := time.Since(start); took > 10*time.Second {
			t.Errorf("create %d took %v (%v)", i, took, err)
		}
		if err != nil {
			failed++
			if !strings.Contains(err.Error(), "did not answer in time") && !strings.Contains(err.Error(), "did not start") && !strings.Contains(err.Error(), "died") {
				t.Errorf("create %d: %v", i, err)
			}
			if _, serr := os.Stat(filepath.Join(c.cfg.StateRoot, cfg.ID)); serr == nil {
				t.Errorf("create %d failed and left its state", i)
			}
		} else {
			_ = c.Destroy(context.Background(), cfg.ID)
		}
	}
	_ = stopper.Process.Kill()
	_ = stopper.Wait()
	t.Logf("%d of %d creates failed with their owner task or init stopped", failed, creates)
	nothingLeft(t, owner, fds)
}

// nothingLeft checks that no process runs as owner and that the test holds
// no more than fds open fds.
func nothingLeft(t *testing.T, owner uint32, fds int) {
	t.Helper()
	if pids := pidsOfUID(t, owner); len(pids) > 0 {
		t.Errorf("processes %v run as the owner uid", pids)
	}
	if now := openFDs(t); now > fds {
		t.Errorf("%d fds open, %d before", now, fds)
	}
}

// TestNativeUserNSNotWhereDumpable: where fs.suid_dumpable is 1 the
// launcher starts no user-namespace sandbox (its tasks' credential changes
// would leave the edge's memory open to ptrace by the owner uid): they go
// to the runtime, and none gets a user namespace by default or an ID
// range of its own.
func TestNativeUserNSNotWhereDumpable(t *testing.T) {
	c := newNativeBackend(t)
	cfg := sandbox.Config{UserNS: &sandbox.IDMap{HostID: 1_000_000_000, Size: 65536, Owner: 1_000_065_536}}
	if !c.launchable(cfg) || !c.UserNSByDefault() || !c.IDRangePerSandbox() {
		t.Fatal("the launcher refuses user namespaces with fs.suid_dumpable at the host's value")
	}
	saved := suidDumpable
	t.Cleanup(func() { suidDumpable = saved })
	suidDumpable = func() string { return "1" }
	if c.launchable(cfg) || c.UserNSByDefault() || c.IDRangePerSandbox() {
		t.Error("with fs.suid_dumpable 1 the launcher still takes user-namespace sandboxes")
	}
	if !c.launchable(sandbox.Config{}) {
		t.Error("with fs.suid_dumpable 1 the launcher refuses sandboxes without a user namespace")
	}
}

// pidsOfUID lists the processes whose real uid is uid.
func pidsOfUID(t *testing.T, uid uint32) []string {
	t.Helper()
	ents, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		st, err := os.ReadFile("/proc/" + e.Name() + "/status")
		if err == nil && strings.Contains(string(st), fmt.Sprintf("\nUid:\t%d\t", uid)) {
			out = append(out, e.Name())
		}
	}
	return out
}

// openFDs counts the test process's open fds.
func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}
