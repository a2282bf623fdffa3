package quota

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/mountinfo"
)

// testImageSize is small but above mkfs.xfs's minimum; the image is sparse.
const testImageSize = 512 << 20

// needXFSLoop skips t unless it can mount XFS on a loop device.
func needXFSLoop(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: mounts XFS on a loop device")
	}
	if _, err := exec.LookPath("mkfs.xfs"); err != nil {
		t.Skip("needs mkfs.xfs: install xfsprogs")
	}
	if _, err := os.Stat("/dev/loop-control"); err != nil {
		t.Skipf("needs loop devices: %v", err)
	}
	fs, err := os.ReadFile("/proc/filesystems")
	if err != nil || !bytes.Contains(fs, []byte("\txfs\n")) {
		t.Skip("needs XFS in the kernel (modprobe xfs)")
	}
}

// needXFSQuota skips t unless XFS can also enforce project quotas.
func needXFSQuota(t testing.TB) {
	t.Helper()
	needXFSLoop(t)
	if xfsQuotaBuiltIn() == no {
		t.Skip("needs XFS project quotas: this kernel was built without CONFIG_XFS_QUOTA (no /proc/fs/xfs/xqm)")
	}
}

// plainXFS mounts a fresh XFS image without quotas and returns its root.
// Project IDs, PROJINHERIT and the cross-project link and rename checks
// work without quota support, so these tests run on every kernel with XFS.
func plainXFS(t testing.TB) (dir, image string) {
	t.Helper()
	needXFSLoop(t)
	o := loopOptions(t)
	mkdir(t, o.Dir)
	if err := mountImage(o.Dir, o.Image, o.ImageSize, ""); err != nil {
		t.Fatalf("mounting plain XFS: %v", err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(o.Dir, 0); err != nil {
			t.Errorf("unmounting %s: %v", o.Dir, err)
		}
	})
	return o.Dir, o.Image
}

// tag gives dir a project ID with PROJINHERIT, the first half of Set.
func tag(t testing.TB, dir string, id uint32) {
	t.Helper()
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if err := setProject(fd, id); err != nil {
		t.Fatalf("tagging %s with project %d: %v", dir, id, err)
	}
}

// loopOptions returns ModeLoop options in a fresh temporary directory and
// registers a cleanup that, whatever the test did, unmounts the data
// directory and detaches every loop device bound to the image before the
// directory is removed.
func loopOptions(t testing.TB) Options {
	t.Helper()
	base, err := filepath.EvalSymlinks(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	o := Options{Dir: filepath.Join(base, "data"), Mode: ModeLoop, Image: filepath.Join(base, "data.xfs"), ImageSize: testImageSize}
	t.Cleanup(func() { forceRelease(t, o) })
	return o
}

func forceRelease(t testing.TB, o Options) {
	entries, err := mountinfo.Read()
	if err != nil {
		t.Errorf("cleanup: %v", err)
		return
	}
	mounts := mountinfo.Under(entries, filepath.Dir(o.Dir))
	for i := len(mounts) - 1; i >= 0; i-- {
		if err := unix.Unmount(mounts[i].MountPoint, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) {
			t.Errorf("cleanup: unmounting %s: %v", mounts[i].MountPoint, err)
		}
	}
	for _, dev := range loopsBacking(t, o.Image) {
		fd, err := unix.Open(dev, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			t.Errorf("cleanup: %v", err)
			continue
		}
		if err := unix.IoctlSetInt(fd, unix.LOOP_CLR_FD, 0); err != nil && !errors.Is(err, unix.ENXIO) {
			t.Errorf("cleanup: detaching %s: %v", dev, err)
		}
		unix.Close(fd)
	}
}

// loopsBacking lists the loop devices whose backing file is image, as
// /sys/block/loop*/loop/backing_file shows it.
func loopsBacking(t testing.TB, image string) []string {
	t.Helper()
	files, err := filepath.Glob("/sys/block/loop*/loop/backing_file")
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			continue // detached between Glob and ReadFile
		}
		if strings.TrimSuffix(strings.TrimSpace(string(b)), " (deleted)") == image {
			out = append(out, "/dev/"+filepath.Base(filepath.Dir(filepath.Dir(f))))
		}
	}
	return out
}

// mountAt returns the topmost mount whose mount point is exactly dir.
func mountAt(t testing.TB, dir string) (mountinfo.Entry, bool) {
	t.Helper()
	entries, err := mountinfo.Read()
	if err != nil {
		t.Fatal(err)
	}
	m, ok := containingMount(entries, dir)
	return m, ok && m.MountPoint == dir
}

// newVolume prepares a fresh loop-mounted volume closed at cleanup.
func newVolume(t testing.TB) *Volume {
	t.Helper()
	needXFSQuota(t)
	v, err := Prepare(loopOptions(t))
	if err != nil {
		t.Fatalf("Prepare: %v", err)
	}
	t.Cleanup(func() {
		if err := v.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return v
}

func TestPrepareDirectRefusesNonXFS(t *testing.T) {
	dir := t.TempDir()
	var sfs unix.Statfs_t
	if err := unix.Statfs(dir, &sfs); err != nil {
		t.Fatal(err)
	}
	if sfs.Type == unix.XFS_SUPER_MAGIC {
		t.Skip("needs a temporary directory that is not on XFS")
	}
	_, err := Prepare(Options{Dir: dir, Mode: ModeDirect})
	if !errors.Is(err, errdefs.ErrPrecondition) {
		t.Fatalf("Prepare on %s = %v, want a precondition error", fsName(int64(sfs.Type)), err)
	}
	for _, want := range []string{"not XFS", "prjquota", "loop"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %q", err, want)
		}
	}
}

func TestPrepareLoopRefusesNonEmptyDir(t *testing.T) {
	o := Options{Dir: t.TempDir(), Mode: ModeLoop, Image: filepath.Join(t.TempDir(), "data.xfs"), ImageSize: testImageSize}
	if err := os.WriteFile(filepath.Join(o.Dir, "old-upper"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := Prepare(o)
	if !errors.Is(err, errdefs.ErrPrecondition) || !strings.Contains(err.Error(), "old-upper") {
		t.Fatalf("Prepare over a non-empty dir = %v, want a precondition naming old-upper", err)
	}
	if _, err := os.Stat(o.Image); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("image created although Prepare failed: %v", err)
	}
}

func TestPrepareLoopMountsReusesAndCloses(t *testing.T) {
	needXFSQuota(t)
	o := loopOptions(t)
	v, err := Prepare(o)
	if err != nil {
		t.Fatalf("Prepare: %v", err)
	}
	if !v.Loop() {
		t.Fatalf("fresh volume does not own its loop mount")
	}
	m, ok := mountAt(t, o.Dir)
	if !ok || m.FSType != "xfs" || m.Source != v.Device() || !strings.Contains(m.SuperOptions, "prjquota") {
		t.Fatalf("mount at %s = %+v (found %v), want xfs from %s with prjquota", o.Dir, m, ok, v.Device())
	}
	if loops := loopsBacking(t, o.Image); len(loops) != 1 || loops[0] != v.Device() {
		t.Fatalf("loop devices backing the image = %v, want [%s]", loops, v.Device())
	}
	var st unix.Stat_t
	if err := unix.Stat(o.Image, &st); err != nil {
		t.Fatal(err)
	}
	if st.Size != testImageSize || st.Blocks*512*4 > st.Size {
		t.Errorf("image is %d bytes with %d allocated, want %d sparse", st.Size, st.Blocks*512, testImageSize)
	}
	marker := filepath.Join(o.Dir, "marker")
	if err := os.WriteFile(marker, []byte("kept"), 0o600); err != nil {
		t.Fatal(err)
	}

	// Simulated kill -9: v is dropped without Close, its mount stays.
	v2, err := Prepare(o)
	if err != nil {
		t.Fatalf("Prepare after crash: %v", err)
	}
	if !v2.Loop() || v2.Device() != v.Device() {
		t.Fatalf("Prepare after crash: loop %v device %s, want adoption of %s", v2.Loop(), v2.Device(), v.Device())
	}
	if loops := loopsBacking(t, o.Image); len(loops) != 1 {
		t.Fatalf("loop devices backing the image after re-Prepare = %v, want one", loops)
	}
	if entries, _ := mountinfo.Read(); len(mountinfo.Under(entries, o.Dir)) != 1 {
		t.Fatalf("re-Prepare stacked a second mount at %s", o.Dir)
	}

	if err := v2.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if loops := loopsBacking(t, o.Image); len(loops) != 0 {
		t.Fatalf("loop devices still backing the image after Close: %v", loops)
	}
	if _, ok := mountAt(t, o.Dir); ok {
		t.Fatalf("%s still mounted after Close", o.Dir)
	}
	if err := v2.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if err := v2.Set(o.Dir, 5, 0, 0); !errors.Is(err, errdefs.ErrPrecondition) {
		t.Fatalf("Set on a closed volume = %v, want a precondition error", err)
	}

	// A clean restart mounts the existing image without formatting it.
	v3, err := Prepare(o)
	if err != nil {
		t.Fatalf("Prepare of existing image: %v", err)
	}
	defer v3.Close()
	if b, err := os.ReadFile(marker); err != nil || string(b) != "kept" {
		t.Fatalf("marker after remount = %q, %v; the image was reformatted or not mounted", b, err)
	}
}

func TestPrepareDirectUsesPrjquotaMount(t *testing.T) {
	v := newVolume(t)
	sub := filepath.Join(v.Dir(), "uppers")
	d, err := Prepare(Options{Dir: sub, Mode: ModeDirect})
	if err != nil {
		t.Fatalf("Prepare on a prjquota XFS: %v", err)
	}
	if d.Loop() {
		t.Fatalf("direct volume claims the loop mount")
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	if _, ok := mountAt(t, v.Dir()); !ok {
		t.Fatalf("Close of a direct volume unmounted the filesystem")
	}
	// Loop mode on a directory of the operator's own prjquota XFS uses it
	// and does not claim it either.
	l, err := Prepare(Options{Dir: sub, Mode: ModeLoop, Image: filepath.Join(t.TempDir(), "x.xfs"), ImageSize: testImageSize})
	if err != nil || l.Loop() {
		t.Fatalf("Prepare(loop) on a prjquota XFS = loop %v, %v; want it used directly", l != nil && l.Loop(), err)
	}
}

func TestPrepareRefusesXFSWithoutPrjquota(t *testing.T) {
	dir, image := plainXFS(t)
	want := "without prjquota"
	if xfsQuotaBuiltIn() == no {
		want = "CONFIG_XFS_QUOTA"
	}
	_, err := Prepare(Options{Dir: dir, Mode: ModeDirect})
	if !errors.Is(err, errdefs.ErrPrecondition) || !strings.Contains(err.Error(), want) {
		t.Fatalf("Prepare(direct) on XFS without prjquota = %v, want a precondition saying %q", err, want)
	}
	_, err = Prepare(Options{Dir: dir, Mode: ModeLoop, Image: image, ImageSize: testImageSize})
	if !errors.Is(err, errdefs.ErrPrecondition) || !strings.Contains(err.Error(), "already a mount point") {
		t.Fatalf("Prepare(loop) on XFS without prjquota = %v, want a precondition", err)
	}
	if loops := loopsBacking(t, image); len(loops) != 1 {
		t.Fatalf("refused Prepare changed the loop devices backing the image: %v", loops)
	}
}

// TestPrepareLoopWithoutXFSQuota runs the whole ModeLoop path (sparse image,
// mkfs, loop device, mount) on a kernel whose XFS has no quota support, and
// checks that the refusal explains itself and leaves nothing behind.
func TestPrepareLoopWithoutXFSQuota(t *testing.T) {
	needXFSLoop(t)
	if xfsQuotaBuiltIn() != no {
		t.Skip("needs a kernel built without CONFIG_XFS_QUOTA")
	}
	o := loopOptions(t)
	_, err := Prepare(o)
	if !errors.Is(err, errdefs.ErrPrecondition) || !strings.Contains(err.Error(), "CONFIG_XFS_QUOTA") {
		t.Fatalf("Prepare(loop) = %v, want a precondition naming CONFIG_XFS_QUOTA", err)
	}
	t.Logf("operator sees: %v", err)
	if loops := loopsBacking(t, o.Image); len(loops) != 0 {
		t.Errorf("failed Prepare left loop devices %v", loops)
	}
	if _, ok := mountAt(t, o.Dir); ok {
		t.Errorf("failed Prepare left %s mounted", o.Dir)
	}
	if _, err := os.Stat(o.Image); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("failed Prepare left the image it created: %v", err)
	}
	if _, err := os.Stat(o.Image + ".tmp"); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("failed Prepare left the temporary image: %v", err)
	}
}

// TestLoopLifecycle covers what Prepare and Close do with the image and the
// loop device, with mount options any XFS accepts: create and format once,
// refuse to stack a second mount, adopt a mount left by a killed process,
// and detach the device on Close.
func TestLoopLifecycle(t *testing.T) {
	needXFSLoop(t)
	o := loopOptions(t)
	mkdir(t, o.Dir)
	if err := mountImage(o.Dir, o.Image, o.ImageSize, ""); err != nil {
		t.Fatalf("mountImage: %v", err)
	}
	m, ok := mountAt(t, o.Dir)
	if !ok || m.FSType != "xfs" || !strings.HasPrefix(m.Source, "/dev/loop") {
		t.Fatalf("mount at %s = %+v (found %v), want xfs from a loop device", o.Dir, m, ok)
	}
	if loops := loopsBacking(t, o.Image); len(loops) != 1 || loops[0] != m.Source {
		t.Fatalf("loop devices backing the image = %v, want [%s]", loops, m.Source)
	}
	if b, err := os.ReadFile("/sys/block/" + filepath.Base(m.Source) + "/loop/autoclear"); err != nil || strings.TrimSpace(string(b)) != "1" {
		t.Errorf("autoclear of %s = %q, %v; want 1", m.Source, b, err)
	}
	var st unix.Stat_t
	if err := unix.Stat(o.Image, &st); err != nil {
		t.Fatal(err)
	}
	if st.Size != testImageSize || st.Blocks*512*4 > st.Size {
		t.Errorf("image is %d bytes with %d allocated, want %d sparse", st.Size, st.Blocks*512, testImageSize)
	}
	marker := filepath.Join(o.Dir, "marker")
	if err := os.WriteFile(marker, []byte("kept"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := mountImage(o.Dir, o.Image, o.ImageSize, ""); err == nil || !strings.Contains(err.Error(), "already a mount point") {
		t.Fatalf("second mountImage = %v, want a refusal to stack", err)
	}
	if loops := loopsBacking(t, o.Image); len(loops) != 1 {
		t.Fatalf("refused mountImage attached a loop device: %v", loops)
	}

	// A restarted process adopts the mount of its image, and only that.
	other := filepath.Join(filepath.Dir(o.Image), "other.xfs")
	if err := os.WriteFile(other, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, img := range []string{other, o.Image + ".missing"} {
		v := &Volume{dir: o.Dir}
		if err := v.adopt(img); err != nil || v.Loop() {
			t.Fatalf("adopt(%s) = loop %v, %v; want not adopted", img, v.Loop(), err)
		}
	}
	v := &Volume{dir: o.Dir, source: m.Source}
	if err := v.adopt(o.Image); err != nil || v.loop != m.Source {
		t.Fatalf("adopt(%s) = loop %q, %v; want %s", o.Image, v.loop, err, m.Source)
	}
	if err := v.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if loops := loopsBacking(t, o.Image); len(loops) != 0 {
		t.Fatalf("loop devices still backing the image after Close: %v", loops)
	}
	if _, ok := mountAt(t, o.Dir); ok {
		t.Fatalf("%s still mounted after Close", o.Dir)
	}
	if err := v.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}

	// The image is mounted again as it is, not reformatted.
	if err := mountImage(o.Dir, o.Image, o.ImageSize, ""); err != nil {
		t.Fatalf("mountImage of the existing image: %v", err)
	}
	if b, err := os.ReadFile(marker); err != nil || string(b) != "kept" {
		t.Fatalf("marker after remount = %q, %v; the image was reformatted", b, err)
	}
	if err := unix.Unmount(o.Dir, 0); err != nil {
		t.Fatal(err)
	}
}

func TestSetEnforcesBytes(t *testing.T) {
	v := newVolume(t)
	dir := filepath.Join(v.Dir(), "sb")
	mkdir(t, dir)
	const limit = 8 << 20
	if err := v.Set(dir, 100, limit, 0); err != nil {
		t.Fatalf("Set: %v", err)
	}
	n, err := fill(filepath.Join(dir, "f"), 2*limit)
	// XFS reports project quota exhaustion as ENOSPC, not EDQUOT, so that
	// a directory tree with a project quota looks like a full disk.
	if !errors.Is(err, unix.ENOSPC) {
		t.Fatalf("writing %d bytes under a %d-byte quota: wrote %d, err %v; want ENOSPC", 2*limit, limit, n, err)
	}
	if n > limit || n < limit-1<<20 {
		t.Errorf("wrote %d bytes before ENOSPC, want just under %d", n, limit)
	}
	u, err := v.Usage(100)
	if err != nil {
		t.Fatal(err)
	}
	if u.Bytes > limit || u.Bytes < uint64(n) || u.ByteLimit != limit {
		t.Errorf("Usage = %+v after writing %d bytes under a %d limit", u, n, limit)
	}
	// Raising the limit (Set again) lets the write go on.
	if err := v.Set(dir, 100, 2*limit, 0); err != nil {
		t.Fatalf("Set to resize: %v", err)
	}
	if _, err := fill(filepath.Join(dir, "g"), limit/2); err != nil {
		t.Fatalf("write after raising the limit: %v", err)
	}
}

func TestSetEnforcesInodes(t *testing.T) {
	v := newVolume(t)
	dir := filepath.Join(v.Dir(), "sb")
	mkdir(t, dir)
	if err := v.Set(dir, 101, 0, 10); err != nil {
		t.Fatalf("Set: %v", err)
	}
	created := 0
	var err error
	for ; created < 100; created++ {
		var f *os.File
		if f, err = os.Create(filepath.Join(dir, "f"+strconv.Itoa(created))); err != nil {
			break
		}
		f.Close()
	}
	// The directory itself is one of the ten inodes.
	if created != 9 || !errors.Is(err, unix.ENOSPC) {
		t.Fatalf("created %d files under a 10-inode quota, then %v; want 9 then ENOSPC", created, err)
	}
	if err := os.Mkdir(filepath.Join(dir, "d"), 0o700); !errors.Is(err, unix.ENOSPC) {
		t.Fatalf("mkdir past the inode limit = %v, want ENOSPC", err)
	}
	if u, err := v.Usage(101); err != nil || u.Inodes != 10 || u.InodeLimit != 10 {
		t.Fatalf("Usage = %+v, %v; want 10 of 10 inodes", u, err)
	}
}

func TestUsageAndClear(t *testing.T) {
	v := newVolume(t)
	dir := filepath.Join(v.Dir(), "sb")
	mkdir(t, dir)
	const id = 102
	if u, err := v.Usage(id); err != nil || u != (Usage{}) {
		t.Fatalf("Usage of an unused project = %+v, %v; want zero", u, err)
	}
	if err := v.Set(dir, id, 64<<20, 1000); err != nil {
		t.Fatalf("Set: %v", err)
	}
	mkdir(t, filepath.Join(dir, "a", "b"))
	const written = 3 << 20
	if _, err := fill(filepath.Join(dir, "a", "f"), written); err != nil {
		t.Fatal(err)
	}
	u, err := v.Usage(id)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("after writing %d bytes in 1 file and 3 dirs: %+v", written, u)
	if u.Bytes < written || u.Bytes > written+256<<10 {
		t.Errorf("Usage.Bytes = %d, want about %d", u.Bytes, written)
	}
	if u.Inodes != 4 || u.ByteLimit != 64<<20 || u.InodeLimit != 1000 {
		t.Errorf("Usage = %+v, want 4 inodes, limits 64 MiB and 1000", u)
	}
	if err := v.Clear(id); err != nil {
		t.Fatalf("Clear: %v", err)
	}
	if u, err := v.Usage(id); err != nil || u.ByteLimit != 0 || u.InodeLimit != 0 || u.Inodes != 4 {
		t.Fatalf("Usage after Clear = %+v, %v; want usage without limits", u, err)
	}
	if used, err := v.InUse(id); err != nil || !used {
		t.Fatalf("InUse with files left = %v, %v; want true", used, err)
	}
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	waitNotInUse(t, v, id)
	if err := v.Clear(id); err != nil {
		t.Fatalf("second Clear: %v", err)
	}
}

func TestProjectInheritance(t *testing.T) {
	root, _ := plainXFS(t)
	v := &Volume{dir: root}
	dir := filepath.Join(root, "sb")
	mkdir(t, dir)
	tag(t, dir, 103)
	deep := filepath.Join(dir, "upper", "usr", "lib")
	mkdir(t, deep)
	file := filepath.Join(deep, "x.so")
	if err := os.WriteFile(file, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{dir, filepath.Join(dir, "upper"), deep, file} {
		if id, err := v.Project(p); err != nil || id != 103 {
			t.Errorf("Project(%s) = %d, %v; want 103", p, id, err)
		}
	}
	for _, p := range []string{dir, deep} {
		if fa := fsxattrOf(t, p); fa.Xflags&fsXflagProjinherit == 0 {
			t.Errorf("%s lacks PROJINHERIT (xflags %#x)", p, fa.Xflags)
		}
	}
	if id, err := v.Project(root); err != nil || id != 0 {
		t.Errorf("volume root has project %d, %v; want 0", id, err)
	}
}

func TestSetRefusesBadArguments(t *testing.T) {
	v := newVolume(t)
	dir := filepath.Join(v.Dir(), "sb")
	mkdir(t, dir)
	tests := []struct {
		name string
		dir  string
		id   uint32
	}{
		{"project 0", dir, 0},
		{"relative", "sb", 7},
		{"other filesystem", t.TempDir(), 7},
	}
	for _, tt := range tests {
		if err := v.Set(tt.dir, tt.id, 1<<20, 10); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("%s: Set = %v, want invalid", tt.name, err)
		}
	}
	if err := v.Set(filepath.Join(dir, "missing"), 7, 0, 0); !errors.Is(err, unix.ENOENT) {
		t.Errorf("Set on a missing dir = %v, want ENOENT", err)
	}
	if used, err := v.InUse(7); err != nil || used {
		t.Errorf("refused Sets left project 7 in use (%v, %v)", used, err)
	}
}

// TestCrossProjectLinkRename checks that a file cannot be moved or linked
// into a quota'd directory from outside it, where it would be charged to the
// wrong project.
func TestCrossProjectLinkRename(t *testing.T) {
	root, _ := plainXFS(t)
	a, b := filepath.Join(root, "a"), filepath.Join(root, "b")
	mkdir(t, a)
	mkdir(t, b)
	tag(t, a, 104)
	tag(t, b, 105)
	outside := filepath.Join(root, "outside") // project 0
	inB := filepath.Join(b, "f")              // project 105
	for _, p := range []string{outside, inB} {
		if err := os.WriteFile(p, []byte("data"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	for _, src := range []string{outside, inB} {
		dst := filepath.Join(a, "moved")
		if err := unix.Link(src, dst); !errors.Is(err, unix.EXDEV) {
			t.Errorf("link %s -> %s = %v, want EXDEV", src, dst, err)
		}
		if err := unix.Rename(src, dst); !errors.Is(err, unix.EXDEV) {
			t.Errorf("rename %s -> %s = %v, want EXDEV", src, dst, err)
		}
	}
	// Inside one project, both work.
	if err := unix.Link(inB, filepath.Join(b, "l")); err != nil {
		t.Errorf("link within a project: %v", err)
	}
	if err := unix.Rename(inB, filepath.Join(b, "r")); err != nil {
		t.Errorf("rename within a project: %v", err)
	}
}

// TestOverlayEnforcesQuota mounts an overlay whose upper and work dirs are
// in a quota'd directory, as the edge does for a sandbox root, and writes
// through it.
func TestOverlayEnforcesQuota(t *testing.T) {
	v := newVolume(t)
	lower, merged := t.TempDir(), t.TempDir()
	const limit = 8 << 20
	if _, err := fill(filepath.Join(lower, "big"), limit+limit/2); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(lower, "small"), []byte("lower"), 0o644); err != nil {
		t.Fatal(err)
	}
	sb := filepath.Join(v.Dir(), "sb")
	mkdir(t, sb)
	if err := v.Set(sb, 106, limit, 0); err != nil {
		t.Fatal(err)
	}
	upper, work := filepath.Join(sb, "upper"), filepath.Join(sb, "work")
	mkdir(t, upper)
	mkdir(t, work)
	opts := "lowerdir=" + lower + ",upperdir=" + upper + ",workdir=" + work + ",index=off,redirect_dir=off,metacopy=off"
	if err := unix.Mount("overlay", merged, "overlay", 0, opts); err != nil {
		t.Fatalf("mounting overlay: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(merged, unix.MNT_DETACH) })

	// Close refuses while the overlay pins the volume.
	if v.Loop() {
		if err := v.Close(); !errors.Is(err, errdefs.ErrPrecondition) {
			t.Fatalf("Close with an overlay mounted = %v, want a precondition error", err)
		}
	}

	if err := os.WriteFile(filepath.Join(merged, "small"), []byte("upper"), 0o644); err != nil {
		t.Fatalf("copy-up of a small file: %v", err)
	}
	// Copying up a lower file larger than the quota fails.
	f, err := os.OpenFile(filepath.Join(merged, "big"), os.O_WRONLY|os.O_APPEND, 0)
	if err == nil {
		f.Close()
	}
	if !errors.Is(err, unix.ENOSPC) {
		t.Fatalf("copy-up of a %d-byte file under a %d-byte quota = %v, want ENOSPC", limit+limit/2, limit, err)
	}
	n, err := fill(filepath.Join(merged, "new"), 2*limit)
	if !errors.Is(err, unix.ENOSPC) {
		t.Fatalf("writing %d bytes through the overlay: wrote %d, err %v; want ENOSPC", 2*limit, n, err)
	}
	if n > limit {
		t.Fatalf("wrote %d bytes through the overlay under a %d-byte quota", n, limit)
	}
	u, err := v.Usage(106)
	if err != nil {
		t.Fatal(err)
	}
	if u.Bytes < uint64(n) || u.Bytes > limit {
		t.Errorf("Usage = %+v after %d bytes through the overlay", u, n)
	}
	if fi, err := os.Stat(filepath.Join(upper, "new")); err != nil || fi.Size() != int64(n) {
		t.Errorf("upper/new = %v, %v; want the %d bytes written", fi, err, n)
	}
	if err := unix.Unmount(merged, 0); err != nil {
		t.Fatalf("unmounting overlay: %v", err)
	}
}

func TestAllocate(t *testing.T) {
	v := newVolume(t)
	id, err := v.Allocate("sb-1")
	if err != nil || id != ProjectID("sb-1") {
		t.Fatalf("Allocate(sb-1) = %d, %v; want %d", id, err, ProjectID("sb-1"))
	}
	// The same name again (a collision in miniature) gets the next probe.
	id2, err := v.Allocate("sb-1")
	if err != nil || id2 != ProjectIDAttempt("sb-1", 1) {
		t.Fatalf("second Allocate(sb-1) = %d, %v; want %d", id2, err, ProjectIDAttempt("sb-1", 1))
	}
	dir := filepath.Join(v.Dir(), "sb-1")
	mkdir(t, dir)
	if err := v.Set(dir, id, 1<<20, 100); err != nil {
		t.Fatal(err)
	}
	// A restarted edge has no reservations but sees the project on disk.
	again, err := Prepare(Options{Dir: v.Dir(), Mode: ModeDirect})
	if err != nil {
		t.Fatal(err)
	}
	if got, err := again.Allocate("sb-1"); err != nil || got != id2 {
		t.Fatalf("Allocate after restart = %d, %v; want %d (attempt 0 is on disk)", got, err, id2)
	}
	if got, err := again.Project(dir); err != nil || got != id {
		t.Fatalf("Project(%s) = %d, %v; want %d", dir, got, err, id)
	}
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	if err := v.Clear(id); err != nil {
		t.Fatal(err)
	}
	waitNotInUse(t, v, id)
}

// waitNotInUse waits for id to be free. XFS inactivates unlinked inodes in
// the background (inodegc) and only then uncharges their project, and
// Q_XGETQUOTA flushes that work only when asked about ID 0.
func waitNotInUse(t testing.TB, v *Volume, id uint32) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		used, err := v.InUse(id)
		if err != nil {
			t.Fatal(err)
		}
		if !used {
			return
		}
		if time.Now().After(deadline) {
			u, _ := v.Usage(id)
			t.Fatalf("project %d still in use 5s after its files were removed: %+v", id, u)
		}
	}
}

// TestQuotactlByDevice runs Set and Usage through quotactl(2) on the block
// device, the path taken on kernels without quotactl_fd.
func TestQuotactlByDevice(t *testing.T) {
	v := newVolume(t)
	v.useDev = true
	dir := filepath.Join(v.Dir(), "sb")
	mkdir(t, dir)
	if err := v.Set(dir, 107, 1<<20, 50); err != nil {
		t.Fatalf("Set via %s: %v", v.Device(), err)
	}
	if u, err := v.Usage(107); err != nil || u.ByteLimit != 1<<20 || u.InodeLimit != 50 || u.Inodes != 1 {
		t.Fatalf("Usage via %s = %+v, %v", v.Device(), u, err)
	}
}

func mkdir(t testing.TB, dir string) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
}

// fill writes up to n bytes to path in 256 KiB chunks and fsyncs, returning
// how many bytes were accepted and the first error.
func fill(path string, n int) (int, error) {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	buf := bytes.Repeat([]byte{0xa5}, 256<<10)
	done := 0
	for done < n {
		k, err := f.Write(buf[:min(len(buf), n-done)])
		done += k
		if err != nil {
			return done, err
		}
	}
	return done, f.Sync()
}

func fsxattrOf(t testing.TB, path string) fsxattr {
	t.Helper()
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	fa, err := getFsxattr(fd)
	if err != nil {
		t.Fatal(err)
	}
	return fa
}
