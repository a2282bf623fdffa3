package e2e

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/api"
)

const usernsBase = 1_000_000_000 // dsec up's default --userns-base

// TestUserNamespaceSandbox: with userns, root inside is uid 1e9 on the host;
// the image's files still look like the image's inside; writes by the
// sandbox and by the files API are the sandbox's root's; snapshots hold the
// sandbox's IDs, not the host's.
func TestUserNamespaceSandbox(t *testing.T) {
	needDaemon(t)
	var null syscall.Stat_t
	if err := syscall.Stat("/dev/null", &null); err != nil {
		t.Fatal(err)
	}
	sb := newSandbox(t, api.SandboxSpec{UserNS: true, Workspace: workspaceRef})
	// crun chowns its stdio to the sandbox's root; it must not reach the
	// host's /dev/null (it then belonged to the sandbox's root, which
	// could chmod it for the whole host).
	var after syscall.Stat_t
	if err := syscall.Stat("/dev/null", &after); err != nil || after.Uid != null.Uid || after.Ctim != null.Ctim {
		t.Errorf("host /dev/null changed by a userns create: owner %d, was %d (%v)", after.Uid, null.Uid, err)
	}

	// Inside: root, with the image's ownership.
	r := sh(t, sb.ID, "id -u; cat /proc/self/uid_map | tr -s ' '; stat -c '%u %g' /bin/busybox /repo/a.txt /")
	want := "0\n 0 1000000000 65536\n0 0\n0 0\n0 0\n"
	if r.Stdout != want {
		t.Fatalf("inside: %q, want %q (stderr %q)", r.Stdout, want, r.Stderr)
	}
	// On the host: the sandbox's processes run as the mapped uid.
	st, err := os.ReadFile("/proc/" + itoa(initPid(t, sb.ID)) + "/status")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(st), "Uid:\t1000000000\t1000000000\t1000000000\t1000000000") {
		t.Fatalf("init's host credentials:\n%s", st)
	}
	// Root inside can change the image's files (copy-up) and make new ones.
	r = sh(t, sb.ID, "echo changed >> /repo/a.txt && mkdir -p /work/x && echo new > /work/x/f && chown 1000:1000 /work/x/f && stat -c '%u' /work/x/f")
	if r.ExitCode != 0 || r.Stdout != "1000\n" {
		t.Fatalf("writes inside: %+v", r)
	}
	upper := filepath.Join(d.stateDir, "edge", "sandboxes", sb.ID, "upper")
	var fst syscall.Stat_t
	if err := syscall.Lstat(filepath.Join(upper, "work", "x", "f"), &fst); err != nil || fst.Uid != usernsBase+1000 {
		t.Fatalf("on disk the file is owned by %d (%v), want %d", fst.Uid, err, usernsBase+1000)
	}
	// Files written through the API belong to the sandbox's root.
	if err := client.WriteFile(ctx(t), sb.ID, "/api/dir/put.txt", strings.NewReader("from api"), 0o600); err != nil {
		t.Fatal(err)
	}
	r = sh(t, sb.ID, "stat -c '%u %g' /api/dir /api/dir/put.txt && echo more >> /api/dir/put.txt && cat /api/dir/put.txt")
	if r.Stdout != "0 0\n0 0\nfrom apimore\n" {
		t.Fatalf("API-written file inside: %+v", r)
	}

	// Root inside has no power over host-owned things it can see: the
	// host's busybox at /dev/sh and catatonit at /dev/init are nobody's.
	r = sh(t, sb.ID, "stat -c '%u' /dev/sh; chmod 777 /dev/sh 2>&1; touch /proc/sysrq-trigger 2>&1; echo done")
	if !strings.HasPrefix(r.Stdout, "65534\n") || !strings.Contains(r.Stdout, "done") {
		t.Fatalf("host-owned files inside: %q", r.Stdout)
	}

	// A snapshot holds the sandbox's IDs; a plain sandbox from it sees them.
	if _, err := client.Snapshot(ctx(t), sb.ID, api.SnapshotRequest{Ref: "snapshot/userns-e2e:v1"}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli("layer", "delete", "snapshot/userns-e2e:v1") })
	plain := newSandbox(t, api.SandboxSpec{Snapshot: "snapshot/userns-e2e:v1"})
	r = sh(t, plain.ID, "stat -c '%u %g' /work/x/f /api/dir/put.txt /; cat /repo/a.txt")
	if r.Stdout != "1000 1000\n0 0\n0 0\nworkspace\nchanged\n" {
		t.Fatalf("snapshot of a userns sandbox, seen from a plain one: %q", r.Stdout)
	}
	// And a userns fork sees it as its own.
	fk, err := client.Fork(ctx(t), sb.ID, 1, nil)
	if err != nil || len(fk.Sandboxes) != 1 {
		t.Fatalf("fork: %v %+v", err, fk)
	}
	t.Cleanup(func() { _ = client.DeleteSandbox(ctx(t), fk.Sandboxes[0].ID) })
	if r := sh(t, fk.Sandboxes[0].ID, "id -u; stat -c '%u' /work/x/f"); r.Stdout != "0\n1000\n" {
		t.Fatalf("fork: %q", r.Stdout)
	}

	// Delete leaves no idmapped mount behind.
	if err := client.DeleteSandbox(ctx(t), sb.ID); err != nil {
		t.Fatal(err)
	}
	if m := anyMounts(sb.ID); len(m) > 0 {
		t.Fatalf("mounts left: %v", m)
	}
}

// TestUserNSKernelCountsAreTheSandboxs: the kernel's per-user counts of a
// user-namespace sandbox's processes are charged to a host uid of that
// sandbox's own (the owner of its namespace), not to host root's: a
// sandbox that takes every inotify instance its count allows leaves host
// root and a neighbour sandbox theirs. (A namespace the runtime made as
// root charged everything to root: host root and every neighbour then got
// EMFILE.)
func TestUserNSKernelCountsAreTheSandboxs(t *testing.T) {
	needDaemon(t)
	holder := buildStatic(t, "inotify_holder")
	b, err := os.ReadFile("/proc/sys/fs/inotify/max_user_instances")
	if err != nil {
		t.Fatal(err)
	}
	max := strings.TrimSpace(string(b))
	a := newSandbox(t, api.SandboxSpec{UserNS: true})
	nb := newSandbox(t, api.SandboxSpec{UserNS: true})
	uploadBinary(t, a.ID, holder, "/tmp/holder")
	uploadBinary(t, nb.ID, holder, "/tmp/holder")
	// A takes all it can and holds them.
	if r := sh(t, a.ID, "setsid /tmp/holder hold </dev/null >/tmp/n 2>&1 & for i in $(seq 100); do [ -s /tmp/n ] && break; sleep 0.1; done; cat /tmp/n"); r.Stdout != max+"\n" {
		t.Fatalf("the holder in A made %q instances (%q), want the per-user limit %s", r.Stdout, r.Stderr, max)
	}
	// Host root still gets one.
	fd, err := unix.InotifyInit1(unix.IN_CLOEXEC)
	if err != nil {
		t.Fatalf("host root's inotify_init1 while A holds its instances: %v", err)
	}
	unix.Close(fd)
	// The neighbour gets its own, all of them.
	if r := sh(t, nb.ID, "/tmp/holder"); r.Stdout != max+"\n" {
		t.Fatalf("the neighbour made %q instances (%q) while A holds its own, want %s", r.Stdout, r.Stderr, max)
	}
	// Each namespace has an owner of its own, neither host root.
	owner := func(id string) uint32 {
		t.Helper()
		f, err := os.Open("/proc/" + itoa(initPid(t, id)) + "/ns/user")
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		var uid uint32
		const nsGetOwnerUID = 0xb704 // _IO(0xb7, 0x4)
		if _, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), nsGetOwnerUID, uintptr(unsafe.Pointer(&uid))); errno != 0 {
			t.Fatalf("NS_GET_OWNER_UID: %v", errno)
		}
		return uid
	}
	oa, ob := owner(a.ID), owner(nb.ID)
	if oa == 0 || ob == 0 || oa == ob || oa < usernsBase+65536 || ob < usernsBase+65536 {
		t.Fatalf("namespace owners %d and %d: want two distinct uids from %d on", oa, ob, usernsBase+65536)
	}
}
