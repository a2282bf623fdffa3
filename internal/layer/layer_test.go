package layer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/mountinfo"
	"github.com/dsecproject/dsec/internal/store"
)

var fixedTime = time.Date(2024, 5, 6, 7, 8, 9, 123456789, time.UTC)

func needRootAndMkfs(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: mounts EROFS and overlayfs, chowns files")
	}
	if _, err := exec.LookPath("mkfs.erofs"); err != nil {
		t.Skip("needs mkfs.erofs in PATH: install erofs-utils")
	}
}

func newTestStore(t *testing.T) (*Store, string) {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "layers")
	s, err := NewStore(dir, store.NewMemory(), slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	return s, dir
}

// node is one entry of a test tree.
type node struct {
	path     string
	data     string // file content, or symlink target
	symlink  bool
	dir      bool
	mode     uint32 // raw permission bits, setuid included
	uid, gid int
}

// writeTree creates nodes under root in the given order and then gives
// every entry fixedTime as mtime, so that two trees with the same nodes are
// the same content.
func writeTree(t *testing.T, root string, nodes []node) {
	t.Helper()
	if err := os.MkdirAll(root, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, n := range nodes {
		p := filepath.Join(root, n.path)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		var err error
		switch {
		case n.symlink:
			err = os.Symlink(n.data, p)
		case n.dir:
			err = os.Mkdir(p, 0o700)
		default:
			err = os.WriteFile(p, []byte(n.data), 0o600)
		}
		if err != nil {
			t.Fatal(err)
		}
		if err := os.Lchown(p, n.uid, n.gid); err != nil {
			t.Fatal(err)
		}
		if !n.symlink {
			// After chown, which clears setuid.
			if err := unix.Chmod(p, n.mode); err != nil {
				t.Fatal(err)
			}
		}
	}
	setTimes(t, root)
}

func setTimes(t *testing.T, root string) {
	t.Helper()
	ts := []unix.Timespec{unix.NsecToTimespec(fixedTime.UnixNano()), unix.NsecToTimespec(fixedTime.UnixNano())}
	err := filepath.WalkDir(root, func(p string, _ os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		return unix.UtimesNanoAt(unix.AT_FDCWD, p, ts, unix.AT_SYMLINK_NOFOLLOW)
	})
	if err != nil {
		t.Fatal(err)
	}
}

var baseTree = []node{
	{path: "etc/os-release", data: "ID=base\n", mode: 0o644},
	{path: "etc/shadow", data: "root:*:1::::::\n", mode: 0o640, gid: 42},
	{path: "bin/tool", data: "#!/bin/sh\necho tool\n", mode: 0o755, uid: 1000, gid: 1000},
	{path: "bin/sudo-ish", data: "x", mode: 0o4755},
	{path: "home/user", dir: true, mode: 0o750, uid: 1000, gid: 1000},
	{path: "home/user/.profile", data: "PS1=$\n", mode: 0o600, uid: 1000, gid: 1000},
	{path: "os-release", data: "etc/os-release", symlink: true},
	{path: "shared.txt", data: "from base\n", mode: 0o644},
	{path: "remove-me.txt", data: "doomed\n", mode: 0o644},
}

var workspaceTree = []node{
	{path: "shared.txt", data: "from workspace\n", mode: 0o644},
	{path: "work/data.csv", data: "a,b\n1,2\n", mode: 0o644, uid: 1000, gid: 1000},
}

var toolkitTree = []node{
	{path: "shared.txt", data: "from toolkit\n", mode: 0o644},
	{path: "opt/harness/run.sh", data: "#!/bin/sh\n", mode: 0o755},
}

func mustRef(t *testing.T, s string) Ref {
	t.Helper()
	r, err := ParseRef(s)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func buildTree(t *testing.T, s *Store, ref string, nodes []node) (digest string) {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "src")
	writeTree(t, dir, nodes)
	start := time.Now()
	var progress strings.Builder
	l, err := s.BuildFromDir(context.Background(), mustRef(t, ref), dir, BuildOptions{}, &progress)
	if err != nil {
		t.Fatalf("BuildFromDir %s: %v", ref, err)
	}
	t.Logf("built %s in %s: %s", ref, time.Since(start).Round(time.Microsecond), strings.ReplaceAll(strings.TrimSpace(progress.String()), "\n", " | "))
	if l.Ref != ref || !IsDigest(l.Digest) || l.SizeBytes <= 0 || l.Kind != mustRef(t, ref).Kind {
		t.Fatalf("BuildFromDir %s = %+v", ref, l)
	}
	return l.Digest
}

func readFile(t *testing.T, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func mountCount(t *testing.T, mp string) int {
	t.Helper()
	mounts, err := mountinfo.Read()
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, m := range mounts {
		if m.MountPoint == mp {
			n++
		}
	}
	return n
}

// acquire mounts digest and registers its Release to run before the
// temporary directories are removed.
func acquire(t *testing.T, m *Mounter, digest string) string {
	t.Helper()
	start := time.Now()
	mp, err := m.Acquire(digest)
	if err != nil {
		t.Fatalf("Acquire %s: %v", digest, err)
	}
	t.Logf("mounted %s in %s", digest[:19], time.Since(start).Round(time.Microsecond))
	t.Cleanup(func() {
		if err := m.Release(digest); err != nil {
			t.Errorf("Release %s: %v", digest, err)
		}
	})
	return mp
}

func TestLayersComposeInOverlay(t *testing.T) {
	needRootAndMkfs(t)
	s, _ := newTestStore(t)
	base := buildTree(t, s, "base/test-os:1", baseTree)
	ws := buildTree(t, s, "workspace/team-a/repo:v1", workspaceTree)
	tk := buildTree(t, s, "toolkit/harness:v3", toolkitTree)

	sums := map[string]string{}
	for _, d := range []string{base, ws, tk} {
		sum, _, err := hashFile(s.BlobPath(d))
		if err != nil {
			t.Fatal(err)
		}
		if sum != d {
			t.Fatalf("blob %s hashes to %s", d, sum)
		}
		sums[d] = sum
	}

	tmp := t.TempDir()
	m := NewMounter(filepath.Join(tmp, "mnt"), s, nil)
	lowers := []string{acquire(t, m, tk), acquire(t, m, ws), acquire(t, m, base)}

	upper, work, target := filepath.Join(tmp, "upper"), filepath.Join(tmp, "work"), filepath.Join(tmp, "rootfs")
	for _, d := range []string{upper, work, target} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	start := time.Now()
	if err := MountOverlay(lowers, upper, work, target); err != nil {
		t.Fatal(err)
	}
	t.Logf("overlay of 3 layers mounted in %s", time.Since(start).Round(time.Microsecond))
	t.Cleanup(func() {
		if err := UnmountOverlay(target); err != nil {
			t.Error(err)
		}
	})

	// The top layer wins; lower layers show through where not shadowed.
	if got := readFile(t, filepath.Join(target, "shared.txt")); got != "from toolkit\n" {
		t.Errorf("shared.txt = %q, want the toolkit's", got)
	}
	for p, want := range map[string]string{"etc/os-release": "ID=base\n", "work/data.csv": "a,b\n1,2\n", "opt/harness/run.sh": "#!/bin/sh\n", "os-release": "ID=base\n"} {
		if got := readFile(t, filepath.Join(target, p)); got != want {
			t.Errorf("%s = %q, want %q", p, got, want)
		}
	}
	// Owners, modes, symlinks and mtimes survive the round trip.
	for _, n := range baseTree {
		var st unix.Stat_t
		if err := unix.Lstat(filepath.Join(target, n.path), &st); err != nil {
			t.Fatal(err)
		}
		if n.symlink {
			if got, _ := os.Readlink(filepath.Join(target, n.path)); got != n.data {
				t.Errorf("%s -> %q, want %q", n.path, got, n.data)
			}
		} else if st.Mode&0o7777 != n.mode {
			t.Errorf("%s mode %o, want %o", n.path, st.Mode&0o7777, n.mode)
		}
		if int(st.Uid) != n.uid || int(st.Gid) != n.gid {
			t.Errorf("%s owner %d:%d, want %d:%d", n.path, st.Uid, st.Gid, n.uid, n.gid)
		}
		if mt := time.Unix(st.Mtim.Unix()); !mt.Equal(fixedTime) {
			t.Errorf("%s mtime %s, want %s", n.path, mt, fixedTime)
		}
	}

	// Writes land in the upper only.
	if err := os.WriteFile(filepath.Join(target, "etc/os-release"), []byte("ID=changed\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(target, "new.txt"), []byte("new\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if got := readFile(t, filepath.Join(upper, "etc/os-release")); got != "ID=changed\n" {
		t.Errorf("upper etc/os-release = %q", got)
	}
	if got := readFile(t, filepath.Join(upper, "new.txt")); got != "new\n" {
		t.Errorf("upper new.txt = %q", got)
	}
	if got := readFile(t, filepath.Join(lowers[2], "etc/os-release")); got != "ID=base\n" {
		t.Errorf("base layer etc/os-release = %q after a write through the overlay", got)
	}

	// Deleting a lower file leaves a whiteout (0:0 char device) in upper.
	if err := os.Remove(filepath.Join(target, "remove-me.txt")); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(filepath.Join(target, "remove-me.txt")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("remove-me.txt still visible: %v", err)
	}
	var st unix.Stat_t
	if err := unix.Lstat(filepath.Join(upper, "remove-me.txt"), &st); err != nil {
		t.Fatalf("no whiteout in upper: %v", err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFCHR || st.Rdev != 0 {
		t.Errorf("upper remove-me.txt is mode %o rdev %d, want a 0:0 whiteout", st.Mode, st.Rdev)
	}
	if got := readFile(t, filepath.Join(lowers[2], "remove-me.txt")); got != "doomed\n" {
		t.Errorf("base layer lost remove-me.txt: %q", got)
	}

	// The layers themselves are untouched.
	for d, want := range sums {
		got, _, err := hashFile(s.BlobPath(d))
		if err != nil {
			t.Fatal(err)
		}
		if got != want {
			t.Errorf("blob %s changed to %s", d, got)
		}
	}
	if refs := m.Refs(); refs[base] != 1 || refs[ws] != 1 || refs[tk] != 1 || len(refs) != 3 {
		t.Errorf("Refs() = %v", refs)
	}
}

func TestConcurrentAcquireMountsOnce(t *testing.T) {
	needRootAndMkfs(t)
	s, _ := newTestStore(t)
	d := buildTree(t, s, "base/test-os:1", baseTree)
	m := NewMounter(filepath.Join(t.TempDir(), "mnt"), s, nil)
	mp := m.Mountpoint(d)

	const n = 32
	var wg sync.WaitGroup
	errs := make(chan error, n)
	start := time.Now()
	for range n {
		wg.Go(func() {
			got, err := m.Acquire(d)
			if err == nil && got != mp {
				err = fmt.Errorf("Acquire = %s, want %s", got, mp)
			}
			errs <- err
		})
	}
	wg.Wait()
	t.Logf("%d concurrent Acquire calls took %s", n, time.Since(start).Round(time.Microsecond))
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if c := mountCount(t, mp); c != 1 {
		t.Fatalf("%d mounts at %s, want 1", c, mp)
	}
	if got := m.Refs()[d]; got != n || !m.InUse(d) {
		t.Fatalf("refs = %d, InUse = %v; want %d, true", got, m.InUse(d), n)
	}
	if got := readFile(t, filepath.Join(mp, "etc/os-release")); got != "ID=base\n" {
		t.Fatalf("mounted layer reads %q", got)
	}

	for i := range n {
		wg.Go(func() {
			if err := m.Release(d); err != nil {
				t.Errorf("Release %d: %v", i, err)
			}
		})
	}
	wg.Wait()
	if c := mountCount(t, mp); c != 0 || m.InUse(d) {
		t.Fatalf("after all releases: %d mounts, InUse %v", c, m.InUse(d))
	}
	if _, err := os.Stat(mp); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("mountpoint left behind: %v", err)
	}
	if err := m.Release(d); !errors.Is(err, errdefs.ErrPrecondition) {
		t.Errorf("extra Release: %v, want ErrPrecondition", err)
	}

	// Acquire and Release racing on one digest never leak or stack mounts.
	for range n {
		wg.Go(func() {
			for range 5 {
				if _, err := m.Acquire(d); err != nil {
					t.Error(err)
					return
				}
				if err := m.Release(d); err != nil {
					t.Error(err)
				}
			}
		})
	}
	wg.Wait()
	if c := mountCount(t, mp); c != 0 || len(m.Refs()) != 0 {
		t.Fatalf("after churn: %d mounts, refs %v", c, m.Refs())
	}

	// A missing blob is NotFound, and a later Acquire may succeed.
	if _, err := m.Acquire("sha256:" + strings.Repeat("0", 64)); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Acquire of unknown digest: %v, want ErrNotFound", err)
	}
	if _, err := m.Acquire("nope"); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("Acquire of bad digest: %v, want ErrInvalid", err)
	}
}

func TestRecoverAdoptsAndReaps(t *testing.T) {
	needRootAndMkfs(t)
	s, _ := newTestStore(t)
	kept := buildTree(t, s, "base/test-os:1", baseTree)
	stray := buildTree(t, s, "workspace/repo:v1", workspaceTree)
	remount := buildTree(t, s, "toolkit/harness:v3", toolkitTree)
	mntDir := filepath.Join(t.TempDir(), "mnt")

	// A previous daemon left two mounts, a stacked duplicate and an
	// empty directory behind.
	old := NewMounter(mntDir, s, nil)
	for _, d := range []string{kept, stray} {
		if _, err := old.Acquire(d); err != nil {
			t.Fatal(err)
		}
	}
	if err := unix.Mount(s.BlobPath(stray), old.Mountpoint(stray), "erofs", unix.MS_RDONLY, ""); err != nil {
		t.Fatal(err)
	}
	emptyDir := filepath.Join(mntDir, strings.Repeat("e", 64))
	if err := os.Mkdir(emptyDir, 0o700); err != nil {
		t.Fatal(err)
	}

	src := &countingSource{Source: s, released: map[string]int{}}
	m := NewMounter(mntDir, src, nil)
	t.Cleanup(func() {
		for d, n := range m.Refs() {
			for range n {
				m.Release(d)
			}
		}
	})
	start := time.Now()
	if err := m.Recover(map[string]int{kept: 2, remount: 1}); err != nil {
		t.Fatal(err)
	}
	t.Logf("Recover took %s", time.Since(start).Round(time.Microsecond))
	if c := mountCount(t, m.Mountpoint(stray)); c != 0 {
		t.Errorf("stray layer still mounted %d times", c)
	}
	if _, err := os.Stat(m.Mountpoint(stray)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("stray mountpoint left: %v", err)
	}
	if _, err := os.Stat(emptyDir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("stray dir left: %v", err)
	}
	if c := mountCount(t, m.Mountpoint(kept)); c != 1 {
		t.Errorf("kept layer mounted %d times, want 1 (adopted)", c)
	}
	if c := mountCount(t, m.Mountpoint(remount)); c != 1 {
		t.Errorf("in-use layer without a mount is mounted %d times, want 1", c)
	}
	if refs := m.Refs(); refs[kept] != 2 || refs[remount] != 1 || len(refs) != 2 {
		t.Errorf("Refs() = %v", refs)
	}
	// Adopted references release like acquired ones.
	for range 2 {
		if err := m.Release(kept); err != nil {
			t.Fatal(err)
		}
	}
	if c := mountCount(t, m.Mountpoint(kept)); c != 0 {
		t.Errorf("kept layer still mounted after its last release")
	}
	// What the source opened for an adopted mount goes back with it.
	if src.releasedOf(kept) != 1 {
		t.Errorf("the adopted layer's image was released %d times, want 1", src.releasedOf(kept))
	}
}

// countingSource counts the releases of what it opens.
type countingSource struct {
	Source
	mu       sync.Mutex
	released map[string]int
}

func (c *countingSource) Open(ctx context.Context, digest string) (string, func(), error) {
	p, rel, err := c.Source.Open(ctx, digest)
	if err != nil {
		return "", nil, err
	}
	return p, func() {
		rel()
		c.mu.Lock()
		c.released[digest]++
		c.mu.Unlock()
	}, nil
}

func (c *countingSource) releasedOf(d string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.released[d]
}

func TestDeleteAndDedup(t *testing.T) {
	needRootAndMkfs(t)
	s, dir := newTestStore(t)
	a := buildTree(t, s, "base/a:1", baseTree)
	b := buildTree(t, s, "base/b:1", baseTree) // same content, separate tree
	if a != b {
		t.Fatalf("same content built twice: %s vs %s (mkfs.erofs not reproducible)", a, b)
	}
	c := buildTree(t, s, "workspace/c:1", workspaceTree)

	if _, err := s.BuildFromDir(context.Background(), mustRef(t, "base/a:1"), t.TempDir(), BuildOptions{}, nil); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Errorf("rebuilding base/a:1: %v, want ErrAlreadyExists", err)
	}

	if l, err := s.Get(a); err != nil || l.Ref != "base/a:1" {
		t.Errorf("Get(digest) = %+v, %v", l, err)
	}
	if _, err := s.Resolve("base/nope:1"); !errors.Is(err, errdefs.ErrNotFound) || !strings.Contains(err.Error(), "base/nope:1") {
		t.Errorf("Resolve missing: %v", err)
	}
	if _, err := s.Resolve("base/nope"); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("Resolve without tag: %v", err)
	}
	if ls, err := s.List("base"); err != nil || len(ls) != 2 || ls[0].Ref != "base/a:1" || ls[1].Ref != "base/b:1" {
		t.Errorf("List(base) = %+v, %v", ls, err)
	}
	if ls, err := s.List(""); err != nil || len(ls) != 3 {
		t.Errorf("List() = %+v, %v", ls, err)
	}
	if _, err := s.List("bogus"); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("List(bogus): %v", err)
	}

	err := s.Delete("base/a:1", func(d string) (bool, error) { return d == a, nil })
	if !errors.Is(err, errdefs.ErrPrecondition) {
		t.Fatalf("Delete in-use layer: %v, want ErrPrecondition", err)
	}
	t.Logf("refused: %v", err)
	if _, err := s.Resolve("base/a:1"); err != nil {
		t.Fatalf("refused Delete removed the ref: %v", err)
	}

	never := func(string) (bool, error) { return false, nil }
	if err := s.Delete("base/a:1", never); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(s.BlobPath(a)); err != nil {
		t.Fatalf("blob still named by base/b:1 was removed: %v", err)
	}
	if err := s.Delete("base/b:1", never); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(s.BlobPath(a)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("unreferenced blob kept: %v", err)
	}
	if err := s.Delete("base/b:1", never); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("second Delete: %v, want ErrNotFound", err)
	}

	// Replace re-points a ref; the old blob waits for GC.
	src := filepath.Join(t.TempDir(), "src")
	writeTree(t, src, toolkitTree)
	l, err := s.BuildFromDir(context.Background(), mustRef(t, "workspace/c:1"), src, BuildOptions{Replace: true, Compress: "lz4hc"}, nil)
	if err != nil || l.Digest == c {
		t.Fatalf("Replace build = %+v, %v", l, err)
	}
	removed, _, err := s.GC(func(d string) (bool, error) { return false, nil })
	if err != nil || len(removed) != 1 || removed[0] != c {
		t.Errorf("GC = %v, %v; want [%s]", removed, err, c)
	}
	if _, err := os.Stat(s.BlobPath(l.Digest)); err != nil {
		t.Errorf("GC removed a named blob: %v", err)
	}
	assertStagingClean(t, dir)
}

// assertStagingClean fails if builds left anything in the staging
// directories of dir's stores (each live store keeps only its lock).
func assertStagingClean(t *testing.T, dir string) {
	t.Helper()
	root := filepath.Join(dir, "staging")
	procs, err := os.ReadDir(root)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range procs {
		if !p.IsDir() {
			t.Errorf("left behind in %s: %s", root, p.Name())
			continue
		}
		left, err := os.ReadDir(filepath.Join(root, p.Name()))
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range left {
			if e.Name() != stageLockName {
				t.Errorf("left behind in %s: %s", filepath.Join(root, p.Name()), e.Name())
			}
		}
	}
}

// assertEmpty fails if a build left anything in dir.
func assertEmpty(t *testing.T, dir string) {
	t.Helper()
	left, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range left {
		t.Errorf("left behind in %s: %s", dir, e.Name())
	}
}

func TestBuildFailureLeavesNothing(t *testing.T) {
	needRootAndMkfs(t)
	s, dir := newTestStore(t)
	src := filepath.Join(t.TempDir(), "src")
	writeTree(t, src, baseTree)

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := s.BuildFromDir(ctx, mustRef(t, "base/x:1"), src, BuildOptions{}, nil); !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled build: %v", err)
	}
	if _, err := s.BuildFromDir(context.Background(), mustRef(t, "base/x:1"), src, BuildOptions{Compress: "zstd"}, nil); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("bad compressor: %v", err)
	}
	if _, err := s.BuildFromDir(context.Background(), Ref{Kind: "base", Name: "x"}, src, BuildOptions{}, nil); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("ref without tag: %v", err)
	}
	if _, err := s.BuildFromDir(context.Background(), mustRef(t, "base/x:1"), filepath.Join(src, "etc/os-release"), BuildOptions{}, nil); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("file as source: %v", err)
	}
	assertStagingClean(t, dir)
	assertEmpty(t, filepath.Join(dir, "blobs", "sha256"))
	if ls, _ := s.List(""); len(ls) != 0 {
		t.Errorf("catalog has %v", ls)
	}

	// A new Store clears what a crashed build left.
	if err := os.MkdirAll(filepath.Join(dir, "staging", "build-123", "x"), 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := NewStore(dir, store.NewMemory(), nil); err != nil {
		t.Fatal(err)
	}
	assertStagingClean(t, dir)
}

func TestOverlayManyLowersAndBusyUnmount(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: mounts overlayfs")
	}
	tmp := t.TempDir()
	// 40 lowers with 200-byte paths: ~8 KiB of lowerdir, twice what a
	// mount(2) option page holds.
	var lowers []string
	for i := range 40 {
		l := filepath.Join(tmp, fmt.Sprintf("%03d-%s", i, strings.Repeat("l", 190)))
		if err := os.MkdirAll(l, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(l, "who"), []byte(fmt.Sprint(i)), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(l, fmt.Sprintf("only-%d", i)), nil, 0o644); err != nil {
			t.Fatal(err)
		}
		lowers = append(lowers, l)
	}
	upper, work, target := filepath.Join(tmp, "u"), filepath.Join(tmp, "w"), filepath.Join(tmp, "t")
	for _, d := range []string{upper, work, target} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := MountOverlay(lowers, upper, work, target); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { UnmountOverlay(target) })
	if got := readFile(t, filepath.Join(target, "who")); got != "0" {
		t.Errorf("who = %q, want the first (topmost) lower's", got)
	}
	if _, err := os.Stat(filepath.Join(target, "only-39")); err != nil {
		t.Errorf("bottom layer not visible: %v", err)
	}

	// Busy: a held-open file forces the detach fallback.
	f, err := os.Open(filepath.Join(target, "who"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := UnmountOverlay(target); err != nil {
		t.Fatal(err)
	}
	if c := mountCount(t, target); c != 0 {
		t.Errorf("target still mounted %d times", c)
	}
	if err := UnmountOverlay(target); err != nil {
		t.Errorf("unmounting an unmounted target: %v", err)
	}

	if err := MountOverlay(nil, upper, work, target); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("no lowers: %v", err)
	}
	if err := MountOverlay([]string{"rel"}, upper, work, target); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("relative lower: %v", err)
	}
	if err := MountOverlay(lowers[:1], upper, upper, target); err == nil {
		UnmountOverlay(target)
		t.Errorf("workdir == upperdir accepted")
	} else {
		t.Logf("kernel refusal reads: %v", err)
	}
}

// TestOverlayLegacyFallback exercises the mount(2) path used on kernels
// without fsopen lowerdir+.
func TestOverlayLegacyFallback(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: mounts overlayfs")
	}
	tmp := t.TempDir()
	var lowers []string
	for _, name := range []string{"top", "bottom"} {
		l := filepath.Join(tmp, name)
		if err := os.Mkdir(l, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(l, "who"), []byte(name), 0o644); err != nil {
			t.Fatal(err)
		}
		lowers = append(lowers, l)
	}
	upper, work, target := filepath.Join(tmp, "u"), filepath.Join(tmp, "w"), filepath.Join(tmp, "t")
	for _, d := range []string{upper, work, target} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := mountOverlayLegacy(lowers, upper, work, target); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { UnmountOverlay(target) })
	if got := readFile(t, filepath.Join(target, "who")); got != "top" {
		t.Errorf("who = %q, want top", got)
	}
	if err := UnmountOverlay(target); err != nil {
		t.Fatal(err)
	}

	long := make([]string, 30)
	for i := range long {
		long[i] = "/" + strings.Repeat("x", 200)
	}
	if err := mountOverlayLegacy(long, upper, work, target); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("8 KiB of lowerdir: %v, want ErrInvalid", err)
	}
	if err := mountOverlayLegacy([]string{"/a:b"}, upper, work, target); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("colon in lower: %v, want ErrInvalid", err)
	}
}

// TestSharedStoreStagingAndBlobs: two processes on one layer directory and
// one store (a cluster's apiservers and edges): neither clears the
// other's builds, and a blob one is publishing is not removed by the
// other's delete.
func TestSharedStoreStagingAndBlobs(t *testing.T) {
	needRootAndMkfs(t)
	dir := filepath.Join(t.TempDir(), "layers")
	st := store.NewMemory()
	a, err := NewStore(dir, st, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	inBuild := filepath.Join(a.StagingDir(), "build-1")
	if err := os.MkdirAll(inBuild, 0o700); err != nil {
		t.Fatal(err)
	}
	stale := filepath.Join(dir, "staging", "crashed")
	if err := os.MkdirAll(stale, 0o700); err != nil {
		t.Fatal(err)
	}
	b, err := NewStore(dir, st, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if _, err := os.Stat(inBuild); err != nil {
		t.Fatalf("a second store cleared a live store's build: %v", err)
	}
	if _, err := os.Stat(stale); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("a staging dir nobody holds was kept: %v", err)
	}

	src := filepath.Join(t.TempDir(), "src")
	writeTree(t, src, baseTree)
	l, err := a.BuildFromDir(context.Background(), mustRef(t, "base/shared:1"), src, BuildOptions{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.Resolve("base/shared:1"); err != nil {
		t.Fatalf("a layer built by one store is not in the other's catalog: %v", err)
	}
	// a is about to name the blob again (a second ref, same content) and
	// holds a pin; b's delete of the first ref must keep the blob.
	unpin, err := a.pin(l.Digest)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Delete("base/shared:1", nil); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(b.BlobPath(l.Digest)); err != nil {
		t.Fatalf("a pinned blob was removed: %v", err)
	}
	unpin()
	removed, _, err := b.GC(nil)
	if err != nil || len(removed) != 1 || removed[0] != l.Digest {
		t.Fatalf("GC after the pin: %v, %v", removed, err)
	}
	if _, err := os.Stat(b.BlobPath(l.Digest)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("unpinned unnamed blob kept: %v", err)
	}
	// While one process removes a blob, another's pin waits for it.
	if err := st.Put(blobsBucket, l.Digest, []byte(`{"collecting":"`+time.Now().UTC().Format(time.RFC3339Nano)+`"}`)); err != nil {
		t.Fatal(err)
	}
	go func() {
		time.Sleep(200 * time.Millisecond)
		_ = st.Delete(blobsBucket, l.Digest)
	}()
	start := time.Now()
	unpin, err = a.pin(l.Digest)
	if err != nil || time.Since(start) < 150*time.Millisecond {
		t.Fatalf("pin during a removal: %v after %v, want it to wait", err, time.Since(start))
	}
	unpin()
}

// TestCatalogCache: with a watchable store, a process resolves refs from
// memory, sees other processes' writes and deletes, and reads the store
// for a ref its cache does not know yet.
func TestCatalogCache(t *testing.T) {
	st := store.NewMemory()
	a, err := NewStore(t.TempDir(), st, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	put := func(ref, digest string) {
		b, _ := json.Marshal(api.Layer{Ref: ref, Digest: digest, Kind: "base"})
		if err := st.Put(catalogBucket, ref, b); err != nil {
			t.Fatal(err)
		}
	}
	put("base/old:1", "sha256:"+strings.Repeat("1", 64))
	a.WatchCatalog(t.Context())
	if l, err := a.Resolve("base/old:1"); err != nil || l.Digest[7] != '1' {
		t.Fatalf("resolve from the listing: %+v %v", l, err)
	}
	// Another process re-points and deletes refs: the cache follows.
	put("base/old:1", "sha256:"+strings.Repeat("2", 64))
	if l, _ := a.Resolve("base/old:1"); l.Digest[7] != '2' {
		t.Fatalf("re-pointed ref still resolves to %s", l.Digest)
	}
	if err := st.Delete(catalogBucket, "base/old:1"); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Resolve("base/old:1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("deleted ref: %v", err)
	}
	// The cache is what answers: a value the store no longer has but the
	// cache holds is served from memory (no store read per resolve).
	a.cache.put(api.Layer{Ref: "base/mem:1", Digest: "sha256:" + strings.Repeat("3", 64)})
	if l, err := a.Resolve("base/mem:1"); err != nil || l.Digest[7] != '3' {
		t.Fatalf("resolve from memory: %+v %v", l, err)
	}
}

// TestStoresStartingTogether: processes that start at once on one layer
// directory (a cluster's edges and apiservers) sweep each other's staging
// directories as they make their own; every one must come up holding a
// staging directory that still exists, whichever order their steps run in.
func TestStoresStartingTogether(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "layers")
	st := store.NewMemory()
	const workers, rounds = 12, 25
	var wg sync.WaitGroup
	errs := make(chan error, workers*rounds)
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range rounds {
				s, err := NewStore(dir, st, nil)
				if err != nil {
					errs <- err
					return
				}
				// Another store's sweep may run now: the claimed directory
				// and its lock must survive it.
				if _, err := os.Stat(filepath.Join(s.StagingDir(), stageLockName)); err != nil {
					errs <- fmt.Errorf("a started store's staging lock is gone: %w", err)
				} else if err := os.WriteFile(filepath.Join(s.StagingDir(), "build"), nil, 0o600); err != nil {
					errs <- fmt.Errorf("a started store cannot stage: %w", err)
				}
				_ = os.Remove(filepath.Join(s.StagingDir(), "build"))
				s.Close()
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}
