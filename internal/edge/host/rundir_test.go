package host

import (
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

func isTmpfs(t *testing.T, dir string) bool {
	t.Helper()
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		t.Fatal(err)
	}
	return st.Type == unix.TMPFS_MAGIC
}

// mountsAt counts the mounts whose mount point is dir.
func mountsAt(t *testing.T, dir string) int {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 4 && f[4] == dir {
			n++
		}
	}
	return n
}

// TestRunDir: the run dir goes on a tmpfs once, stays mounted while the
// runtime keeps a container's state in it, is unmounted when it keeps
// none, and is never mounted over files an earlier dsec left on disk.
func TestRunDir(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: mounts a tmpfs")
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	base := t.TempDir()
	dir := filepath.Join(base, "runtime")
	root := filepath.Join(dir, "crun")
	t.Cleanup(func() {
		for unix.Unmount(dir, unix.MNT_DETACH) == nil {
		}
	})

	on, err := mountRunDir(dir, 64<<20, log)
	if err != nil || !on || !isTmpfs(t, dir) {
		t.Fatalf("mountRunDir on a new dir: %v %v, tmpfs %v", on, err, isTmpfs(t, dir))
	}
	// A second start finds the tmpfs and does not stack another.
	if on, err := mountRunDir(dir, 64<<20, log); err != nil || !on || mountsAt(t, dir) != 1 {
		t.Fatalf("second mountRunDir: %v %v, %d mounts at %s", on, err, mountsAt(t, dir), dir)
	}
	// A container's state keeps it mounted at stop.
	if err := os.MkdirAll(filepath.Join(root, "sb-1"), 0o700); err != nil {
		t.Fatal(err)
	}
	unmountRunDir(dir, root, log)
	if !isTmpfs(t, dir) {
		t.Fatal("run dir unmounted with a container's state in it")
	}
	if err := os.RemoveAll(filepath.Join(root, "sb-1")); err != nil {
		t.Fatal(err)
	}
	unmountRunDir(dir, root, log)
	if isTmpfs(t, dir) || mountsAt(t, dir) != 0 {
		t.Fatal("run dir still mounted with no container state left")
	}

	// State on disk from an earlier dsec: not hidden under a tmpfs.
	if err := os.MkdirAll(filepath.Join(root, "sb-2"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "sb-2", "status"), []byte("{}"), 0o600); err != nil {
		t.Fatal(err)
	}
	if on, err := mountRunDir(dir, 64<<20, log); err != nil || on || isTmpfs(t, dir) {
		t.Fatalf("mountRunDir over state on disk: %v %v, tmpfs %v", on, err, isTmpfs(t, dir))
	}
	if _, err := os.Stat(filepath.Join(root, "sb-2", "status")); err != nil {
		t.Fatalf("state on disk: %v", err)
	}
	// Empty directories alone are no state.
	if err := os.Remove(filepath.Join(root, "sb-2", "status")); err != nil {
		t.Fatal(err)
	}
	if on, err := mountRunDir(dir, 64<<20, log); err != nil || !on || !isTmpfs(t, dir) {
		t.Fatalf("mountRunDir over empty dirs: %v %v", on, err)
	}
	unmountRunDir(dir, root, log)

	// A state dir on a tmpfs already: nothing mounted, nothing to unmount.
	shm := filepath.Join(base, "shm")
	if err := os.Mkdir(shm, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", shm, "tmpfs", 0, "size=16m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(shm, unix.MNT_DETACH) })
	inner := filepath.Join(shm, "runtime")
	if on, err := mountRunDir(inner, 64<<20, log); err != nil || on || mountsAt(t, inner) != 0 {
		t.Fatalf("mountRunDir in a tmpfs state dir: %v %v, %d mounts", on, err, mountsAt(t, inner))
	}
}
