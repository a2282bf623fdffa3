package files

import (
	"bytes"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
)

const secret = "TOP SECRET host content"

// fixture is a sandbox root next to an "outside" directory standing for the
// host: a secret file the sandbox must never reach, plus the whole temp dir
// to check that nothing appears outside the root.
type fixture struct {
	r       *Root
	tmp     string // parent of root and outside
	root    string // host path of the sandbox root
	outside string // host directory outside the root
	secret  string // host path of the secret file
	before  map[string]string
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	tmp := t.TempDir()
	f := &fixture{
		tmp:     tmp,
		root:    filepath.Join(tmp, "root"),
		outside: filepath.Join(tmp, "outside"),
	}
	f.secret = filepath.Join(f.outside, "secret")
	must(t, os.Mkdir(f.root, 0755))
	must(t, os.Mkdir(f.outside, 0755))
	must(t, os.WriteFile(f.secret, []byte(secret), 0600))
	must(t, os.Mkdir(filepath.Join(f.outside, "dir"), 0755))
	must(t, os.WriteFile(filepath.Join(f.outside, "dir", "passwd"), []byte(secret), 0644))
	r, err := Open(f.root)
	must(t, err)
	t.Cleanup(func() { r.Close() })
	f.r = r
	f.before = f.snapshotOutside(t)
	t.Cleanup(func() { f.checkOutside(t) })
	return f
}

// snapshotOutside records everything under tmp except the root: names,
// types, modes, sizes, mtimes and contents.
func (f *fixture) snapshotOutside(t *testing.T) map[string]string {
	t.Helper()
	snap := map[string]string{}
	err := filepath.WalkDir(f.tmp, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if p == f.root {
			return filepath.SkipDir
		}
		fi, err := os.Lstat(p)
		if err != nil {
			return err
		}
		desc := fi.Mode().String() + " " + fi.ModTime().String()
		if fi.Mode().IsRegular() {
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			desc += " " + string(b)
		}
		snap[p] = desc
		return nil
	})
	must(t, err)
	return snap
}

// checkOutside fails the test if anything outside the root changed.
func (f *fixture) checkOutside(t *testing.T) {
	t.Helper()
	after := f.snapshotOutside(t)
	if !reflect.DeepEqual(f.before, after) {
		t.Errorf("outside the root changed:\nbefore %v\nafter  %v", f.before, after)
	}
}

// host returns the host path of a sandbox path.
func (f *fixture) host(p string) string { return filepath.Join(f.root, p) }

func (f *fixture) write(t *testing.T, p, content string) {
	t.Helper()
	must(t, os.MkdirAll(filepath.Dir(f.host(p)), 0755))
	must(t, os.WriteFile(f.host(p), []byte(content), 0644))
}

func (f *fixture) symlink(t *testing.T, target, p string) {
	t.Helper()
	must(t, os.MkdirAll(filepath.Dir(f.host(p)), 0755))
	must(t, os.Symlink(target, f.host(p)))
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func wantClass(t *testing.T, err, class error) {
	t.Helper()
	if !errors.Is(err, class) {
		t.Fatalf("error = %v, want class %v", err, class)
	}
}

func readAll(t *testing.T, r *Root, p string) (string, error) {
	t.Helper()
	rc, _, err := r.ReadFile(p)
	if err != nil {
		return "", err
	}
	defer rc.Close()
	b, err := io.ReadAll(rc)
	return string(b), err
}

func TestOpenRejectsMissingRoot(t *testing.T) {
	_, err := Open(filepath.Join(t.TempDir(), "nope"))
	wantClass(t, err, errdefs.ErrNotFound)
}

func TestWriteReadStat(t *testing.T) {
	f := newFixture(t)
	n, err := f.r.WriteFile("/repo/sub/a.py", strings.NewReader("print(1)\n"), 0750, 0, nil)
	must(t, err)
	if n != 9 {
		t.Fatalf("wrote %d bytes, want 9", n)
	}
	got, err := readAll(t, f.r, "/repo/sub/a.py")
	must(t, err)
	if got != "print(1)\n" {
		t.Fatalf("read %q", got)
	}
	e, err := f.r.Stat("/repo/sub/a.py")
	must(t, err)
	if e.Path != "/repo/sub/a.py" || e.Type != "file" || e.Size != 9 || e.Mode != "0750" {
		t.Fatalf("stat = %+v", e)
	}
	d, err := f.r.Stat("/repo/sub")
	must(t, err)
	if d.Type != "dir" || d.Mode != "0755" {
		t.Fatalf("parent created as %+v, want dir 0755", d)
	}
	if _, err := f.r.Stat("/"); err != nil {
		t.Fatal(err)
	}

	// Overwrite is atomic replacement, and leaves no temp files behind.
	// The mode is exact: special bits kept, 0 means no permissions.
	_, err = f.r.WriteFile("/repo/sub/a.py", strings.NewReader("x"), 0o644|os.ModeSetuid|os.ModeSticky, 0, nil)
	must(t, err)
	got, _ = readAll(t, f.r, "/repo/sub/a.py")
	if e, _ := f.r.Stat("/repo/sub/a.py"); got != "x" || e.Mode != "5644" {
		t.Fatalf("after overwrite: %q, mode %s, want x and 5644", got, e.Mode)
	}
	// (Content is not read back here: without root, mode 0 hides it.)
	_, err = f.r.WriteFile("/repo/sub/a.py", strings.NewReader("y"), 0, 0, nil)
	must(t, err)
	if e, _ = f.r.Stat("/repo/sub/a.py"); e.Mode != "0000" || e.Size != 1 {
		t.Fatalf("mode 0: %+v", e)
	}
	names, _ := os.ReadDir(f.host("/repo/sub"))
	if len(names) != 1 {
		t.Fatalf("directory holds %v, want only a.py", names)
	}
}

func TestReadFileErrors(t *testing.T) {
	f := newFixture(t)
	f.write(t, "/file", "x")
	must(t, os.Mkdir(f.host("/dir"), 0755))
	_, _, err := f.r.ReadFile("/absent")
	wantClass(t, err, errdefs.ErrNotFound)
	_, _, err = f.r.ReadFile("/file/below")
	wantClass(t, err, errdefs.ErrNotFound)
	_, _, err = f.r.ReadFile("/dir")
	wantClass(t, err, errdefs.ErrInvalid)
	_, _, err = f.r.ReadFile("relative")
	wantClass(t, err, errdefs.ErrInvalid)
}

func TestWriteFileLimitLeavesNothing(t *testing.T) {
	f := newFixture(t)
	f.write(t, "/keep", "old")
	_, err := f.r.WriteFile("/keep", strings.NewReader(strings.Repeat("a", 11)), 0644, 10, nil)
	wantClass(t, err, errdefs.ErrInvalid)
	if !strings.Contains(err.Error(), "limit") {
		t.Errorf("error %q does not mention the limit", err)
	}
	got, _ := readAll(t, f.r, "/keep")
	if got != "old" {
		t.Fatalf("target changed to %q", got)
	}
	names, _ := os.ReadDir(f.root)
	if len(names) != 1 {
		t.Fatalf("root holds %v, want only keep", names)
	}
	// Exactly at the limit is fine.
	_, err = f.r.WriteFile("/keep", strings.NewReader(strings.Repeat("a", 10)), 0644, 10, nil)
	must(t, err)
}

func TestWriteFileRefusesDirectory(t *testing.T) {
	f := newFixture(t)
	must(t, os.MkdirAll(f.host("/d/x"), 0755))
	_, err := f.r.WriteFile("/d", strings.NewReader("x"), 0644, 0, nil)
	wantClass(t, err, errdefs.ErrInvalid)
	_, err = f.r.WriteFile("/", strings.NewReader("x"), 0644, 0, nil)
	wantClass(t, err, errdefs.ErrInvalid)
	f.write(t, "/file", "x")
	_, err = f.r.WriteFile("/file/below", strings.NewReader("x"), 0644, 0, nil)
	wantClass(t, err, errdefs.ErrInvalid)
}

func TestList(t *testing.T) {
	f := newFixture(t)
	f.write(t, "/repo/a.py", "aa")
	f.write(t, "/repo/pkg/b.py", "b")
	f.write(t, "/repo/pkg/deep/c.py", "c")
	f.symlink(t, "pkg", "/repo/link")

	paths := func(es []api.FileEntry) []string {
		var out []string
		for _, e := range es {
			out = append(out, e.Path+":"+e.Type)
		}
		return out
	}
	es, err := f.r.List("/repo", 1)
	must(t, err)
	want := []string{"/repo/a.py:file", "/repo/link:symlink", "/repo/pkg:dir"}
	if !reflect.DeepEqual(paths(es), want) {
		t.Fatalf("depth 1 = %v, want %v", paths(es), want)
	}
	es, err = f.r.List("/repo", 2)
	must(t, err)
	want = []string{"/repo/a.py:file", "/repo/link:symlink", "/repo/pkg:dir", "/repo/pkg/b.py:file", "/repo/pkg/deep:dir"}
	if !reflect.DeepEqual(paths(es), want) {
		t.Fatalf("depth 2 = %v, want %v", paths(es), want)
	}
	if es[1].LinkTarget != "pkg" {
		t.Fatalf("link target = %q", es[1].LinkTarget)
	}

	_, err = f.r.List("/repo", 0)
	wantClass(t, err, errdefs.ErrInvalid)
	_, err = f.r.List("/repo/a.py", 1)
	wantClass(t, err, errdefs.ErrInvalid)
	_, err = f.r.List("/nope", 1)
	wantClass(t, err, errdefs.ErrNotFound)

	f.r.maxListEntries = 3
	_, err = f.r.List("/repo", 5)
	wantClass(t, err, errdefs.ErrInvalid)
}

func TestListNestingBound(t *testing.T) {
	f := newFixture(t)
	must(t, os.MkdirAll(f.host("/a/a/a/a/a/a"), 0755))
	f.r.maxNesting = 3
	_, err := f.r.List("/", 100)
	wantClass(t, err, errdefs.ErrInvalid)
	_, err = f.r.List("/", 3)
	must(t, err)
}

func TestRemove(t *testing.T) {
	f := newFixture(t)
	f.write(t, "/a/b/c", "x")
	f.write(t, "/file", "x")
	must(t, os.Mkdir(f.host("/empty"), 0755))

	wantClass(t, f.r.Remove("/absent", false), errdefs.ErrNotFound)
	wantClass(t, f.r.Remove("/absent", true), errdefs.ErrNotFound)
	wantClass(t, f.r.Remove("/", true), errdefs.ErrInvalid)
	wantClass(t, f.r.Remove("/..", true), errdefs.ErrInvalid)
	wantClass(t, f.r.Remove("/a", false), errdefs.ErrPrecondition)

	must(t, f.r.Remove("/file", false))
	must(t, f.r.Remove("/empty", false))
	must(t, f.r.Remove("/a", true))
	names, _ := os.ReadDir(f.root)
	if len(names) != 0 {
		t.Fatalf("root still holds %v", names)
	}
	wantClass(t, f.r.Remove("/file", false), errdefs.ErrNotFound)
}

func TestRemoveLargeDirectory(t *testing.T) {
	f := newFixture(t)
	must(t, os.MkdirAll(f.host("/big/sub/deeper"), 0755))
	f.write(t, "/big/sub/deeper/x", "x")
	// A small batch makes removal re-read the directory many times, as it
	// would for a directory of millions of names.
	f.r.removeBatch = 7
	for i := range 100 {
		must(t, os.WriteFile(filepath.Join(f.host("/big"), "f"+strings.Repeat("x", i%50)+strconv.Itoa(i)), nil, 0644))
	}
	must(t, f.r.Remove("/big", true))
	if _, err := os.Lstat(f.host("/big")); !os.IsNotExist(err) {
		t.Fatalf("big still there: %v", err)
	}
}

// TestCloseWaitsForOperationsInFlight: Close while an operation holds the
// root must not close the fd under it (the number could be reused for
// another sandbox's root before the operation's next lookup); it refuses
// new operations at once and closes when the last one ends.
func TestCloseWaitsForOperationsInFlight(t *testing.T) {
	f := newFixture(t)
	f.write(t, "/a", "x")
	r := f.r
	if err := r.hold(); err != nil { // an operation in flight
		t.Fatal(err)
	}
	fd := r.fd
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0); err != nil || r.fd != fd {
		t.Fatalf("root fd closed under an operation in flight: %v", err)
	}
	// The held fd still resolves inside the root.
	if pfd, err := openat2(fd, "a", unix.O_PATH, 0, inRoot); err != nil {
		t.Fatalf("lookup through the held root: %v", err)
	} else {
		unix.Close(pfd)
	}
	if _, err := r.Stat("/a"); !errors.Is(err, errdefs.ErrPrecondition) {
		t.Errorf("Stat after Close: %v, want failed_precondition", err)
	}
	var buf bytes.Buffer
	if err := r.WriteTar("/", &buf); !errors.Is(err, errdefs.ErrPrecondition) {
		t.Errorf("WriteTar after Close: %v, want failed_precondition", err)
	}
	r.release()
	if r.fd != -1 {
		t.Errorf("fd %d still open after the last operation ended", r.fd)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0); err == nil {
		// The number may have been reused by now by something else in
		// this process; only say so if it still names our directory.
		var a, b unix.Stat_t
		if unix.Fstat(fd, &a) == nil && unix.Stat(f.root, &b) == nil && a.Ino == b.Ino && a.Dev == b.Dev {
			t.Error("root fd still open after the last release")
		}
	}
	if err := r.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}
