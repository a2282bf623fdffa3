package edge

import (
	"os"
	"path/filepath"
	"slices"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/mountinfo"
)

// makeSandboxDir fills a sandbox directory with every part of the layout.
func makeSandboxDir(t *testing.T, dir string) {
	t.Helper()
	for _, d := range []string{"rootfs", "upper/etc", "work/work", "lower/0", "lower/1", "vol/upper", "bundle"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, f := range []string{recordFile, cmdLogFile, "disk.img", "upper/etc/hostname"} {
		if err := os.WriteFile(filepath.Join(dir, f), []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
}

func names(t *testing.T, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	slices.Sort(out)
	return out
}

// TestClearRuntimeKeepsRecordAndLog: what outlives a sandbox's runtime is
// its record and its command log, and nothing else of the layout.
func TestClearRuntimeKeepsRecordAndLog(t *testing.T) {
	e, err := New(Config{Name: "n1", StateDir: t.TempDir()}, Deps{})
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "sb-n1-x")
	makeSandboxDir(t, dir)
	if err := releaseHost(dir); err != nil {
		t.Fatalf("releasing a directory that holds no mounts: %v", err)
	}
	e.clearRuntime(dir)
	if got, want := names(t, dir), []string{cmdLogFile, recordFile}; !slices.Equal(got, want) {
		t.Fatalf("left %v, want %v", got, want)
	}
	// Again, and on a directory that is gone: nothing to do is no error.
	if err := releaseHost(dir); err != nil {
		t.Fatal(err)
	}
	e.clearRuntime(dir)
	if err := releaseHost(filepath.Join(t.TempDir(), "absent")); err != nil {
		t.Fatalf("releasing a directory that does not exist: %v", err)
	}
}

// TestReleaseHostUnmountsEveryPart: releaseHost takes down every mount
// the layout has (the overlay's place, the idmapped layer views, the
// disk), whatever is mounted there, and is idempotent.
func TestReleaseHostUnmountsEveryPart(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: mounts tmpfs in the layout's places")
	}
	dir := filepath.Join(t.TempDir(), "sb-n1-y")
	makeSandboxDir(t, dir)
	places := []string{"lower/0", "lower/1", "vol", "rootfs"} // the overlay over the others, as in a create
	for _, p := range places {
		if err := unix.Mount("tmpfs", filepath.Join(dir, p), "tmpfs", 0, "size=1m"); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		for _, p := range places {
			_ = unix.Unmount(filepath.Join(dir, p), unix.MNT_DETACH)
		}
	})
	// A process with its working directory in the rootfs keeps it busy:
	// it goes all the same (detached), as a sandbox's leftover would.
	busy, err := os.Open(filepath.Join(dir, "rootfs"))
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	for i := range 2 {
		if err := releaseHost(dir); err != nil {
			t.Fatalf("release %d: %v", i+1, err)
		}
		entries, err := mountinfo.Read()
		if err != nil {
			t.Fatal(err)
		}
		if left := mountinfo.Under(entries, dir); len(left) > 0 {
			t.Fatalf("release %d left mounts: %v", i+1, left)
		}
		if _, err := os.Stat(filepath.Join(dir, "disk.img")); !os.IsNotExist(err) {
			t.Fatalf("release %d left the disk image: %v", i+1, err)
		}
	}
}
