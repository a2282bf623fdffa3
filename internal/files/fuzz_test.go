package files

import (
	"archive/tar"
	"bytes"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// fuzzFixture is a fixture with the hostile links of plantLinks and a file
// of the sandbox's own. "OUTSIDE" in a fuzzed path stands for the host
// directory's absolute path, which changes from run to run.
func fuzzFixture(t *testing.T) (*fixture, func(string) string) {
	f := newFixture(t)
	plantLinks(t, f)
	f.write(t, "/dir/file", "inside")
	// A tar may leave directories without permissions; as a non-root user
	// the temp dir's removal would fail on them. (Cleanups run last first:
	// this one before the fixture's own checks and removal.)
	t.Cleanup(func() {
		filepath.WalkDir(f.root, func(p string, d fs.DirEntry, err error) error {
			if d != nil && d.IsDir() {
				os.Chmod(p, 0o700)
			}
			return nil
		})
	})
	return f, func(s string) string { return strings.ReplaceAll(s, "OUTSIDE", f.outside) }
}

// FuzzRootPaths runs the files API's operations on a fuzzed path in a root
// holding symlinks out of it (to "/", to the host's directory by absolute
// and climbing relative paths, through /proc/self/root) plus one whose
// target is fuzzed too. Whatever the path, nothing outside the root is
// read or changed (the fixture compares the host side before and after),
// Stat names the path it was given cleaned, List stays below the root, and
// what WriteFile wrote is what ReadFile then reads at the same path.
func FuzzRootPaths(f *testing.F) {
	for _, s := range [][2]string{
		{"/abs/secret", ""},
		{"/rel/secret", "/"},
		{"/fz/secret", "../outside"},
		{"/fz/dir/passwd", "../../../../../../../../OUTSIDE"},
		{"/fz", "/proc/self/root/OUTSIDE/secret"},
		{"/slash/../../OUTSIDE/secret", "x"},
		{"/deeprel/new/file", ""},
		{"/dir/up", "dir/up"},
		{"/fz/x", "fz"},
		{"/fz/new/deeper/file", "/tmp/dsec-fuzz"},
		{"//dir/./file/", "dir"},
		{"/", ""},
		{"/..", ".."},
		{"relative", "OUTSIDE"},
		{"/magic", ""},
		{"/dir/\x00", ""},
	} {
		f.Add(s[0], s[1])
	}
	f.Fuzz(func(t *testing.T, p, target string) {
		fx, sub := fuzzFixture(t)
		p, target = sub(p), sub(target)
		if target != "" && strings.IndexByte(target, 0) < 0 && len(target) < unix.PathMax {
			must(t, os.Symlink(target, fx.host("/fz")))
		}
		clean, cerr := CleanPath(p)
		if e, err := fx.r.Stat(p); err == nil && (cerr != nil || e.Path != clean) {
			t.Fatalf("Stat(%q) describes %q (CleanPath: %q, %v)", p, e.Path, clean, cerr)
		}
		if got, _ := readAll(t, fx.r, p); strings.Contains(got, secret) {
			t.Fatalf("ReadFile(%q) read the host's secret", p)
		}
		if es, err := fx.r.List(p, 4); err == nil {
			for _, e := range es {
				if !strings.HasPrefix(e.Path, "/") || path.Clean(e.Path) != e.Path || path.Base(e.Path) == "passwd" {
					t.Fatalf("List(%q) lists %q", p, e.Path)
				}
			}
		}
		if _, err := fx.r.WriteFile(p, strings.NewReader("pwned"), 0o644, 0, nil); err == nil {
			if got, err := readAll(t, fx.r, p); err != nil || got != "pwned" {
				t.Fatalf("WriteFile(%q) succeeded, then ReadFile reads %q, %v", p, got, err)
			}
		}
		// Not recursive: a removal that escaped would take one name, not
		// a host tree.
		fx.r.Remove(p, false)
	})
}

// FuzzExtractTar extracts a fuzzed archive (tar or tar.gz) with the API's
// options (no owners, no devices) into a fuzzed directory of a root
// holding symlinks out of it. Nothing may panic; a refusal is a classified
// error, never an internal one (the source cannot fail); nothing outside
// the root changes; the limits hold; and nothing extracted carries setuid
// or setgid bits, a foreign owner, or is a device, FIFO or socket.
func FuzzExtractTar(f *testing.F) {
	const maxBytes, maxFiles = 1 << 20, 64
	ok := mkTar(f, dir("d", 0o755), file("d/b", "data"), symlink("d/l", "b"), hardlink("d/h", "d/b"))
	for _, s := range []struct {
		tar []byte
		dst string
	}{
		{ok, "/dst"},
		{gz(f, ok), "/abs"},
		{ok, "OUTSIDE"},
		{mkTar(f, symlink("x", "/"), file("x/etc/passwd", "pwned")), "/"},
		{mkTar(f, symlink("x", "../../outside"), file("x/secret", "pwned")), "/dst"},
		{mkTar(f, hardlink("h", "../outside/secret")), "/"},
		{mkTar(f, hardlink("h", "absfile"), file("absfile", "replaced")), "/"},
		{mkTar(f, file("/abs/secret", "pwned"), file("dir/up", "replaced")), "/"},
		{mkTar(f, tarEntry{hdr: tar.Header{Typeflag: tar.TypeReg, Name: "suid", Mode: 0o6755}}), "/rel"},
		{mkTar(f, special(tar.TypeChar, "null", 1, 3), special(tar.TypeFifo, "fifo", 0, 0)), "/dst"},
		{mkTar(f, tarEntry{hdr: tar.Header{Typeflag: tar.TypeReg, Name: "x", PAXRecords: map[string]string{
			"SCHILY.xattr.user.a": "1", "SCHILY.xattr.security.capability": "\x01\x00\x00\x02", "SCHILY.xattr.trusted.overlay.opaque": "y",
		}}}), "/dst"},
		{mkTar(f, dir("./", 0), dir("ro", 0o500), file("ro/f", "x")), "/dst"},
		{mkTar(f, file("big", strings.Repeat("x", 4096)))[:1024], "/dst"},
		{make([]byte, 1024), "/dir/file"},
		{nil, "/dst"},
	} {
		f.Add(s.tar, s.dst)
	}
	f.Fuzz(func(t *testing.T, archive []byte, dst string) {
		fx, sub := fuzzFixture(t)
		dst = sub(dst)
		res, err := fx.r.ExtractTar(dst, bytes.NewReader(archive), TarOptions{MaxBytes: maxBytes, MaxFiles: maxFiles})
		if err != nil && errdefs.Code(err) == "internal" {
			t.Fatalf("ExtractTar into %q: unclassified error %q", dst, err)
		}
		if res.Files > maxFiles || res.Bytes > maxBytes {
			t.Fatalf("ExtractTar went past its limits: %+v", res)
		}
		uid, gid := uint32(os.Geteuid()), uint32(os.Getegid())
		err = filepath.WalkDir(fx.root, func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			var st unix.Stat_t
			if err := unix.Lstat(p, &st); err != nil {
				return err
			}
			switch {
			case st.Mode&(unix.S_ISUID|unix.S_ISGID) != 0:
				t.Errorf("%s has mode %o", p, st.Mode)
			case st.Uid != uid || st.Gid != gid:
				t.Errorf("%s is owned by %d:%d", p, st.Uid, st.Gid)
			}
			switch st.Mode & unix.S_IFMT {
			case unix.S_IFREG, unix.S_IFDIR, unix.S_IFLNK:
			default:
				t.Errorf("%s has type %o", p, st.Mode&unix.S_IFMT)
			}
			if d.IsDir() && st.Mode&0o700 != 0o700 {
				os.Chmod(p, 0o700) // to walk on into it as a non-root user
			}
			return nil
		})
		must(t, err)
	})
}
