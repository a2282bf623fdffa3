package layer

import (
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// TestNewIDMapNS: a view through the namespace NewIDMapNS makes shows a
// file owned by k on disk as owned by HostID+k, and making one leaves no
// fd or process of its own behind.
func TestNewIDMapNS(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: mounts a tmpfs and makes idmapped mounts")
	}
	src := t.TempDir()
	if err := unix.Mount("tmpfs", src, "tmpfs", 0, ""); err != nil {
		t.Fatal(err)
	}
	defer unix.Unmount(src, unix.MNT_DETACH)
	for name, uid := range map[string]int{"root": 0, "seven": 7, "outside": 70000} {
		if err := os.WriteFile(filepath.Join(src, name), nil, 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(filepath.Join(src, name), uid, uid); err != nil {
			t.Fatal(err)
		}
	}
	fds := func() int {
		ents, err := os.ReadDir("/proc/self/fd")
		if err != nil {
			t.Fatal(err)
		}
		return len(ents)
	}
	before := fds()
	const host = 1_000_131_072
	ns, err := NewIDMapNS(IDMap{HostID: host, Size: 65536})
	if err != nil {
		t.Fatal(err)
	}
	if now := fds(); now != before+1 {
		t.Errorf("%d fds open with the namespace, %d before", now, before)
	}
	view, err := IDMapClone(src, ns)
	ns.Close()
	if err != nil {
		t.Fatal(err)
	}
	defer view.Close()
	for name, want := range map[string]uint32{"root": host, "seven": host + 7, "outside": 65534} {
		var st unix.Stat_t
		if err := unix.Fstatat(int(view.Fd()), name, &st, 0); err != nil {
			t.Fatal(err)
		}
		if st.Uid != want || st.Gid != want {
			t.Errorf("%s is owned by %d:%d through the view, want %d", name, st.Uid, st.Gid, want)
		}
	}
	// The task that made it was reaped: no child of this process is left.
	if _, err := unix.Wait4(-1, nil, unix.WNOHANG|unix.WALL, nil); err != unix.ECHILD {
		t.Errorf("a child is left behind (wait4: %v)", err)
	}
}
