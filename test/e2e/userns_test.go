package e2e

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
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
	sb := newSandbox(t, api.SandboxSpec{UserNS: new(true), Workspace: workspaceRef})
	// crun chowns its stdio to the sandbox's root; it must not reach the
	// host's /dev/null (it then belonged to the sandbox's root, which
	// could chmod it for the whole host).
	var after syscall.Stat_t
	if err := syscall.Stat("/dev/null", &after); err != nil || after.Uid != null.Uid || after.Ctim != null.Ctim {
		t.Errorf("host /dev/null changed by a userns create: owner %d, was %d (%v)", after.Uid, null.Uid, err)
	}

	// Nothing of it is mounted on the host: its overlay and the idmapped
	// views of its layers are detached mounts that only its own mount
	// namespace holds (one host mount per layer per sandbox otherwise).
	if b, err := os.ReadFile("/proc/self/mountinfo"); err != nil || strings.Contains(string(b), sb.ID) {
		t.Errorf("the host's mount table shows the sandbox's mounts (%v):\n%s", err, grepLines(string(b), sb.ID))
	}

	// Its IDs are a range of its own, after the node's shared one and the
	// owners' (dsec up's launcher gives each sandbox one).
	host := hostRange(t, sb.ID)
	if host < usernsBase+2*65536 || (host-usernsBase)%65536 != 0 {
		t.Fatalf("the sandbox's IDs start at host %d: want a range of its own from %d on", host, usernsBase+2*65536)
	}
	// Inside: root, with the image's ownership.
	r := sh(t, sb.ID, "id -u; cat /proc/self/uid_map | tr -s ' '; stat -c '%u %g' /bin/busybox /repo/a.txt /")
	want := fmt.Sprintf("0\n 0 %d 65536\n0 0\n0 0\n0 0\n", host)
	if r.Stdout != want {
		t.Fatalf("inside: %q, want %q (stderr %q)", r.Stdout, want, r.Stderr)
	}
	// On the host: the sandbox's processes run as the mapped uid.
	st, err := os.ReadFile("/proc/" + itoa(initPid(t, sb.ID)) + "/status")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(st), fmt.Sprintf("Uid:\t%d\t%d\t%d\t%d", host, host, host, host)) {
		t.Fatalf("init's host credentials:\n%s", st)
	}
	// Root inside can change the image's files (copy-up) and make new ones.
	r = sh(t, sb.ID, "echo changed >> /repo/a.txt && mkdir -p /work/x && echo new > /work/x/f && chown 1000:1000 /work/x/f && stat -c '%u' /work/x/f")
	if r.ExitCode != 0 || r.Stdout != "1000\n" {
		t.Fatalf("writes inside: %+v", r)
	}
	upper := filepath.Join(d.stateDir, "edge", "sandboxes", sb.ID, "upper")
	var fst syscall.Stat_t
	if err := syscall.Lstat(filepath.Join(upper, "work", "x", "f"), &fst); err != nil || fst.Uid != host+1000 {
		t.Fatalf("on disk the file is owned by %d (%v), want %d", fst.Uid, err, host+1000)
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
// default sandbox's processes are charged to a host uid of that sandbox's
// own (the owner of its user namespace), not to host root's: a sandbox
// that takes every inotify instance, queued signal or message queue byte
// its count allows leaves host root and a neighbour sandbox theirs. (A
// sandbox whose root is host root, or a namespace made by root, charged
// everything to root: host root and every neighbour then got none.) The
// processes counted against RLIMIT_NPROC are its own too (a neighbour
// with the same limit starts as many while it holds all of its). The
// counts kept per host uid (pipe buffer pages) are the sandbox's too: its
// IDs are a range of its own (with one range for all, the neighbour's
// new pipes were cut to a few pages).
func TestUserNSKernelCountsAreTheSandboxs(t *testing.T) {
	needDaemon(t)
	holder := buildStatic(t, "counts_holder")
	// Default specs: container sandboxes get a user namespace unless
	// they say otherwise.
	a := newSandbox(t, api.SandboxSpec{})
	nb := newSandbox(t, api.SandboxSpec{})
	for _, sb := range []*api.Sandbox{a, nb} {
		if !sb.Spec.InUserNS() {
			t.Fatalf("a default sandbox's record says userns %v, want true", sb.Spec.UserNS)
		}
		uploadBinary(t, sb.ID, holder, "/tmp/holder")
	}
	// Counts the kernel keeps per host uid are theirs too: their IDs are
	// ranges of their own.
	if ra, rb := hostRange(t, a.ID), hostRange(t, nb.ID); ra == rb {
		t.Fatalf("both sandboxes' IDs start at host %d", ra)
	}
	host := func(res string) int {
		t.Helper()
		out, err := exec.Command(holder, res).Output()
		n, cerr := strconv.Atoi(strings.TrimSpace(string(out)))
		if err != nil || cerr != nil {
			t.Fatalf("the holder on the host (%s): %q %v", res, out, err)
		}
		return n
	}
	for _, res := range []string{"inotify", "sigpending", "mqueue", "pipes", "procs"} {
		t.Run(res, func(t *testing.T) {
			// Host root is exempt from the pipe pages' and the processes'
			// limits.
			onHost := res != "pipes" && res != "procs"
			var before int
			if onHost {
				before = host(res)
			}
			// A takes all it can and holds them.
			r := sh(t, a.ID, "setsid /tmp/holder "+res+" hold </dev/null >/tmp/n-"+res+" 2>&1 & echo $! >/tmp/pid-"+res+
				"; for i in $(seq 300); do [ -s /tmp/n-"+res+" ] && break; sleep 0.1; done; cat /tmp/n-"+res)
			na, err := strconv.Atoi(strings.TrimSpace(r.Stdout))
			if err != nil || na <= 0 {
				t.Fatalf("the holder in A took %q (%q)", r.Stdout, r.Stderr)
			}
			defer sh(t, a.ID, "kill -9 $(cat /tmp/pid-"+res+")")
			// Host root still gets its share, not what A left of it.
			if onHost {
				if after := host(res); after < 1 || after < before/2 {
					t.Errorf("host root took %d while A holds %d, %d before", after, na, before)
				}
			}
			// The neighbour gets its own, about as many as A (sharing A's
			// count it would get none). Not exactly: A's shell makes
			// pipes of its own while its holder runs, and a pipe near
			// the limit keeps its default size, which moves the count.
			r = sh(t, nb.ID, "/tmp/holder "+res)
			if nn, err := strconv.Atoi(strings.TrimSpace(r.Stdout)); err != nil || nn < na*3/4 {
				t.Errorf("the neighbour took %q (%q) while A holds %d, want about as many", r.Stdout, r.Stderr, na)
			}
		})
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

// hostRange returns the first host ID of sandbox id's user namespace, from
// its init's uid_map.
func hostRange(t *testing.T, id string) uint32 {
	t.Helper()
	b, err := os.ReadFile("/proc/" + itoa(initPid(t, id)) + "/uid_map")
	if err != nil {
		t.Fatal(err)
	}
	f := strings.Fields(string(b))
	if len(f) != 3 || f[0] != "0" || f[2] != "65536" {
		t.Fatalf("sandbox %s's uid_map: %q", id, b)
	}
	n, err := strconv.ParseUint(f[1], 10, 32)
	if err != nil {
		t.Fatal(err)
	}
	return uint32(n)
}
