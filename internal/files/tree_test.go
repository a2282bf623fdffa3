package files

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/files/filestest"
)

// outsideDir is a directory with a file, which symlinks in a removed tree
// point at: it must survive.
func outsideDir(t *testing.T) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), "outside")
	if err := os.MkdirAll(filepath.Join(out, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(out, "sub", "keep"), []byte("keep"), 0o644); err != nil {
		t.Fatal(err)
	}
	return out
}

func checkOutside(t *testing.T, out string) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(out, "sub", "keep"))
	if err != nil || string(b) != "keep" {
		t.Fatalf("the directory a symlink in the tree pointed at was touched: %q, %v", b, err)
	}
}

// TestRemoveAllDeepTree: a 30,000-level tree (what a sandbox can write in
// its upper dir) is removed with at most MaxRemoveFDs descriptors, while
// the process could open only a few more than that: os.RemoveAll holds one
// per level and fails here with EMFILE. Along the way the tree has
// symlinks to a directory and a file outside (both survive), directories
// of mode 000 (as root), names with a newline, and files.
func TestRemoveAllDeepTree(t *testing.T) {
	const depth = 30000
	root := os.Geteuid() == 0
	out := outsideDir(t)
	tree := filepath.Join(t.TempDir(), "tree")
	if err := os.Mkdir(tree, 0o755); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	filestest.DeepTree(t, tree, depth, func(level, fd int) {
		if level%997 == 0 || level == maxRemoveDepth || level == maxRemoveDepth+1 {
			must(t, unix.Symlinkat(out, fd, "to-outside"))
			must(t, unix.Symlinkat(filepath.Join(out, "sub", "keep"), fd, "to-file"))
			must(t, unix.Mkdirat(fd, "new\nline\x1b[2J", 0o755))
			f, err := unix.Openat(fd, "new\nline\x1b[2J/f", unix.O_CREAT|unix.O_WRONLY|unix.O_CLOEXEC, 0o644)
			must(t, err)
			unix.Close(f)
		}
		if root && level%1009 == 0 {
			must(t, unix.Mkdirat(fd, "locked", 0o755))
			f, err := unix.Openat(fd, "locked/f", unix.O_CREAT|unix.O_WRONLY|unix.O_CLOEXEC, 0o644)
			must(t, err)
			unix.Close(f)
			must(t, unix.Fchmodat(fd, "locked", 0, 0))
		}
	})
	if root {
		// The top of the chain locked too.
		must(t, os.Chmod(filepath.Join(tree, "d"), 0))
	}
	t.Logf("made %d levels in %v", depth, time.Since(start))
	start = time.Now()
	var err error
	filestest.WithFDHeadroom(t, MaxRemoveFDs, func() { err = RemoveAll(tree) })
	if err != nil {
		t.Fatalf("RemoveAll: %.512v", err)
	}
	t.Logf("removed %d levels in %v with at most %d descriptors", depth, time.Since(start), MaxRemoveFDs)
	if _, err := os.Lstat(tree); !os.IsNotExist(err) {
		t.Fatalf("tree still there: %v", err)
	}
	checkOutside(t, out)
}

// TestRemoveAllWide: directories of many entries are read in a fixed
// buffer and removed in one call.
func TestRemoveAllWide(t *testing.T) {
	tree := filepath.Join(t.TempDir(), "tree")
	for i := range 10 {
		if err := os.MkdirAll(filepath.Join(tree, "sub", strconv.Itoa(i)), 0o755); err != nil {
			t.Fatal(err)
		}
		for j := range 100 {
			must(t, os.WriteFile(filepath.Join(tree, "sub", strconv.Itoa(i), strconv.Itoa(j)), nil, 0o644))
		}
	}
	for i := range 5000 {
		must(t, os.WriteFile(filepath.Join(tree, strings.Repeat("n", 200)+strconv.Itoa(i)), nil, 0o644))
	}
	var err error
	filestest.WithFDHeadroom(t, MaxRemoveFDs, func() { err = RemoveAll(tree) })
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(tree); !os.IsNotExist(err) {
		t.Fatalf("tree still there: %v", err)
	}
}

// TestRemoveAllLinks: a path that is itself a symlink loses the link, not
// the target; a file is removed; a missing path is not an error.
func TestRemoveAllLinks(t *testing.T) {
	out := outsideDir(t)
	dir := t.TempDir()
	link := filepath.Join(dir, "link")
	must(t, os.Symlink(out, link))
	must(t, RemoveAll(link))
	if _, err := os.Lstat(link); !os.IsNotExist(err) {
		t.Fatalf("link still there: %v", err)
	}
	checkOutside(t, out)
	file := filepath.Join(dir, "file")
	must(t, os.WriteFile(file, nil, 0o644))
	must(t, RemoveAll(file))
	must(t, RemoveAll(filepath.Join(dir, "missing")))
	must(t, RemoveAll(filepath.Join(dir, "missing", "below")))
	if err := RemoveAll(dir + "/."); err == nil {
		t.Fatal("RemoveAll of a path ending in . succeeded")
	}
}

// TestRemoveAllStopsAtMounts: a directory with something mounted on it is
// not entered, from the mount's own namespace or from another (where an
// rmdir would detach it): the mounted files survive, the rest of the tree
// goes, and the error names the entry, not the path to it.
func TestRemoveAllStopsAtMounts(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: makes a bind mount in a mount namespace")
	}
	out := outsideDir(t)
	tree := filepath.Join(t.TempDir(), "tree")
	must(t, os.MkdirAll(filepath.Join(tree, "a", "mnt"), 0o755))
	must(t, os.MkdirAll(filepath.Join(tree, "b"), 0o755))
	must(t, os.WriteFile(filepath.Join(tree, "b", "f"), nil, 0o644))
	child := exec.Command("unshare", "-m", "--propagation", "private", "sh", "-c",
		`mount --bind "$1" "$2" && echo ready && exec sleep 120`, "sh", out, filepath.Join(tree, "a", "mnt"))
	stdout, err := child.StdoutPipe()
	must(t, err)
	child.Stderr = os.Stderr
	if err := child.Start(); err != nil {
		t.Skipf("needs unshare(1): %v", err)
	}
	t.Cleanup(func() { _ = child.Process.Kill(); _ = child.Wait() })
	line := make([]byte, 6)
	if _, err := io.ReadFull(stdout, line); err != nil || string(line) != "ready\n" {
		t.Fatalf("child mount namespace not ready: %q %v", line, err)
	}
	inChild := fmt.Sprintf("/proc/%d/root%s", child.Process.Pid, tree)
	err = RemoveAll(inChild)
	if err == nil || !strings.Contains(err.Error(), `"mnt" at depth 2`) || !strings.Contains(err.Error(), "mount point") {
		t.Fatalf("RemoveAll through a mount: %v, want an error naming the mount point", err)
	}
	checkOutside(t, out)
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", child.Process.Pid))
	must(t, err)
	if !bytes.Contains(b, []byte(" "+filepath.Join(tree, "a", "mnt")+" ")) {
		t.Fatal("the mount is gone from its namespace")
	}
	if _, err := os.Lstat(filepath.Join(tree, "b")); !os.IsNotExist(err) {
		t.Fatalf("the rest of the tree was not removed: %v", err)
	}
	// The mount point itself as the tree.
	if err := RemoveAll(inChild + "/a/mnt"); err == nil {
		t.Fatal("RemoveAll of a mount point succeeded")
	}
	checkOutside(t, out)
}
