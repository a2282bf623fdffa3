//go:build linux && cgo

package nsexec

import (
	"os"
	"strings"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The namespace UserNS makes belongs to the owner given (the kernel
// charges its processes' per-user counts there), maps the IDs asked, and
// its holder goes on release.
func TestUserNSOwner(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: makes a user namespace as another uid and writes its ID maps")
	}
	const owner, base, size = 1_000_131_071, 1_000_000_000, 65536 // owner: the last of the owners' range
	path, release, err := UserNS(owner, base, size)
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		release()
		t.Fatal(err)
	}
	defer f.Close()
	var uid uint32
	const nsGetOwnerUID = 0xb704 // _IO(0xb7, 0x4)
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), nsGetOwnerUID, uintptr(unsafe.Pointer(&uid))); errno != 0 {
		release()
		t.Fatalf("NS_GET_OWNER_UID: %v", errno)
	}
	if uid != owner {
		t.Errorf("the namespace belongs to uid %d, want %d", uid, owner)
	}
	pid := strings.TrimSuffix(strings.TrimPrefix(path, "/proc/"), "/ns/user")
	for _, m := range []string{"uid_map", "gid_map"} {
		b, err := os.ReadFile("/proc/" + pid + "/" + m)
		if err != nil || strings.Join(strings.Fields(string(b)), " ") != "0 1000000000 65536" {
			t.Errorf("%s: %q %v", m, b, err)
		}
	}
	// The holder runs as the owner, with no capability left.
	st, err := os.ReadFile("/proc/" + pid + "/status")
	if err != nil || !strings.Contains(string(st), "\nUid:\t1000131071\t1000131071\t1000131071\t1000131071\n") ||
		!strings.Contains(string(st), "\nCapEff:\t0000000000000000\n") || !strings.Contains(string(st), "\nCapPrm:\t0000000000000000\n") {
		t.Errorf("the holder's status (%v):\n%s", err, st)
	}
	var held unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &held); err != nil {
		t.Fatal(err)
	}
	release()
	// Its pid may be another process's by now, but not with this
	// namespace.
	var now unix.Stat_t
	if err := unix.Stat("/proc/"+pid+"/ns/user", &now); err == nil && now.Ino == held.Ino {
		t.Error("the holder still runs after release")
	}
	if _, _, err := UserNS(0, base, size); err == nil {
		t.Error("a namespace owned by root was made")
	}
}
