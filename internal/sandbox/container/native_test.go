package container

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

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
	return newTestBackendWith(t, "runc", true, true)
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
	rel, err := c.cfg.Cgroups.RelOf(st.Pid)
	if err != nil || rel != cfg.CgroupPath {
		t.Fatalf("init in cgroup %q (%v), want %s", rel, err, cfg.CgroupPath)
	}
	if code, out := sh(t, c, cfg.ID, "hostname; echo $$; cat /sys/fs/cgroup/pids.max /sys/fs/cgroup/pids/pids.max 2>/dev/null; ls /dev"); code != 0 ||
		!strings.HasPrefix(out, "native\n") {
		t.Errorf("in the sandbox (%d): %s", code, out)
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
}

// TestNativeHostileRootfs: symlinks an image or an earlier sandbox can
// plant where the launcher mounts must resolve inside the rootfs; nothing
// may appear on the host.
func TestNativeHostileRootfs(t *testing.T) {
	c := newNativeBackend(t)
	victim := t.TempDir()
	resolv := filepath.Join(t.TempDir(), "resolv.conf")
	if err := os.WriteFile(resolv, []byte("nameserver 127.0.0.1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	rootfs := sandboxtest.BusyboxRootfs(t)
	for _, d := range []string{"proc", "dev", "sys", "etc"} {
		if err := os.RemoveAll(filepath.Join(rootfs, d)); err != nil {
			t.Fatal(err)
		}
	}
	links := map[string]string{
		"proc": filepath.Join(victim, "proc"), // absolute, to a host path
		"dev":  "../../../../../../" + strings.TrimPrefix(victim, "/") + "/dev",
		"sys":  filepath.Join(victim, "sys"),
		"etc":  victim, // resolv.conf would land in victim
	}
	for name, to := range links {
		if err := os.Symlink(to, filepath.Join(rootfs, name)); err != nil {
			t.Fatal(err)
		}
	}
	cfg, err := nativeSandbox(t, c, rootfs, func(cfg *sandbox.Config) { cfg.ResolvConf = resolv })
	// Resolved inside the rootfs, these are ordinary (if odd) mount
	// points: the sandbox works, with its mounts in its own tree.
	if err != nil {
		t.Errorf("create: %v", err)
	} else if code, out := sh(t, c, cfg.ID, "cat /etc/resolv.conf && test -e /proc/self/status && test -c /dev/null && ls /sys/kernel >/dev/null"); code != 0 {
		t.Errorf("sandbox with symlinked mount points (%d): %s", code, out)
	}
	if ents, _ := os.ReadDir(victim); len(ents) != 0 {
		t.Errorf("create (err %v) wrote on the host: %v", err, ents)
	}
	if b, _ := os.ReadFile(resolv); string(b) != "nameserver 127.0.0.1\n" {
		t.Errorf("host resolv.conf changed: %q", b)
	}
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
		t.Fatalf("no shared sysfs: %v", err)
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
