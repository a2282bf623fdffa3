package files

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/errdefs"
)

type tarEntry struct {
	hdr  tar.Header
	body string
}

func file(name, body string) tarEntry {
	return tarEntry{hdr: tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: 0644, Size: int64(len(body))}, body: body}
}

func dir(name string, mode int64) tarEntry {
	return tarEntry{hdr: tar.Header{Typeflag: tar.TypeDir, Name: name, Mode: mode}}
}

func symlink(name, target string) tarEntry {
	return tarEntry{hdr: tar.Header{Typeflag: tar.TypeSymlink, Name: name, Linkname: target, Mode: 0777}}
}

func hardlink(name, target string) tarEntry {
	return tarEntry{hdr: tar.Header{Typeflag: tar.TypeLink, Name: name, Linkname: target}}
}

func special(typ byte, name string, major, minor int64) tarEntry {
	return tarEntry{hdr: tar.Header{Typeflag: typ, Name: name, Mode: 0666, Devmajor: major, Devminor: minor}}
}

func mkTar(t testing.TB, entries ...tarEntry) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		h := e.hdr
		must(t, tw.WriteHeader(&h))
		_, err := tw.Write([]byte(e.body))
		must(t, err)
	}
	must(t, tw.Close())
	return buf.Bytes()
}

func gz(t testing.TB, b []byte) []byte {
	t.Helper()
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	_, err := zw.Write(b)
	must(t, err)
	must(t, zw.Close())
	return buf.Bytes()
}

func extract(t *testing.T, f *fixture, p string, opts TarOptions, entries ...tarEntry) error {
	t.Helper()
	_, err := f.r.ExtractTar(p, bytes.NewReader(mkTar(t, entries...)), opts)
	return err
}

func TestExtractTarBasics(t *testing.T) {
	f := newFixture(t)
	mtime := time.Date(2020, 1, 2, 3, 4, 5, 0, time.UTC)
	entries := []tarEntry{
		dir("./", 0755),
		dir("ro/", 0555),
		file("ro/a.txt", "hello"),
		file("/abs/b.txt", "abs names land under p"),
		file("implicit/parents/c.txt", "c"),
		symlink("link", "ro/a.txt"),
		hardlink("hard", "ro/a.txt"),
		{hdr: tar.Header{Typeflag: tar.TypeReg, Name: "modes", Mode: 07755, Size: 1}, body: "m"},
	}
	for i := range entries {
		entries[i].hdr.ModTime = mtime
	}
	res, err := f.r.ExtractTar("/dst", bytes.NewReader(gz(t, mkTar(t, entries...))), TarOptions{})
	must(t, err)
	if res.Files != len(entries) || res.Bytes != 5+22+1+1 {
		t.Fatalf("result = %+v", res)
	}
	got, err := readAll(t, f.r, "/dst/abs/b.txt")
	if err != nil || got != "abs names land under p" {
		t.Fatalf("/dst/abs/b.txt = %q, %v", got, err)
	}
	if got, _ := readAll(t, f.r, "/dst/link"); got != "hello" {
		t.Fatalf("link reads %q", got)
	}
	var a, h unix.Stat_t
	must(t, unix.Lstat(f.host("/dst/ro/a.txt"), &a))
	must(t, unix.Lstat(f.host("/dst/hard"), &h))
	if a.Ino != h.Ino {
		t.Fatal("hard link is a copy")
	}
	// The read-only directory was filled, then got its mode and mtime.
	e, err := f.r.Stat("/dst/ro")
	must(t, err)
	if e.Mode != "0555" || !e.MTime.Equal(mtime) {
		t.Fatalf("ro dir = %+v, want 0555 at %v", e, mtime)
	}
	if e, _ := f.r.Stat("/dst/link"); !e.MTime.Equal(mtime) {
		t.Fatalf("symlink mtime = %v", e.MTime)
	}
	// setuid/setgid are dropped without PreserveOwner; sticky is kept.
	if e, _ := f.r.Stat("/dst/modes"); e.Mode != "1755" {
		t.Fatalf("modes = %s, want 1755", e.Mode)
	}
	must(t, os.Chmod(f.host("/dst/ro"), 0755)) // let t.TempDir clean up as non-root
}

func TestExtractTarReplacesWithoutFollowing(t *testing.T) {
	f := newFixture(t)
	f.symlink(t, f.secret, "/dst/s")
	f.symlink(t, f.outside, "/dst/d")
	f.write(t, "/dst/old", "old")
	must(t, os.MkdirAll(f.host("/dst/full/x"), 0755))
	must(t, extract(t, f, "/dst", TarOptions{}, file("s", "new"), dir("d", 0755), file("old", "new")))
	for _, p := range []string{"/dst/s", "/dst/old"} {
		if got, _ := readAll(t, f.r, p); got != "new" {
			t.Fatalf("%s = %q", p, got)
		}
	}
	if e, _ := f.r.Stat("/dst/d"); e.Type != "dir" {
		t.Fatalf("/dst/d is %s, want the link replaced by a dir", e.Type)
	}
	err := extract(t, f, "/dst", TarOptions{}, file("full", "x"))
	wantClass(t, err, errdefs.ErrInvalid)
}

// Each archive tries to reach outside p (or the root). All must be refused
// with Invalid; the fixture checks nothing outside the root changed.
func TestExtractTarHostileEntries(t *testing.T) {
	f := newFixture(t)
	deep := strings.Repeat("../", 20) + f.outside[1:]
	tests := []struct {
		name    string
		entries []tarEntry
		opts    TarOptions
	}{
		{"dotdot", []tarEntry{file("../escape", "x")}, TarOptions{}},
		{"dotdot after abs", []tarEntry{file("/../escape", "x")}, TarOptions{}},
		{"climbing clean", []tarEntry{file("a/../../b", "x")}, TarOptions{}},
		{"deep climb", []tarEntry{file("a/b/../../../../outside/secret", "x")}, TarOptions{}},
		{"symlink abs then write", []tarEntry{symlink("x", f.outside+"/dir"), file("x/passwd", "pwned")}, TarOptions{}},
		{"symlink rel then write", []tarEntry{symlink("x", "../../outside"), file("x/secret", "pwned")}, TarOptions{}},
		{"symlink deep then write", []tarEntry{symlink("x", deep), file("x/secret", "pwned")}, TarOptions{}},
		{"symlink slash then write", []tarEntry{symlink("x", "/"), file("x"+f.secret, "pwned")}, TarOptions{}},
		{"symlink then mkdir", []tarEntry{symlink("x", f.outside), dir("x/newdir", 0755)}, TarOptions{}},
		{"symlink then symlink", []tarEntry{symlink("x", f.outside), symlink("x/evil", "/")}, TarOptions{}},
		{"symlink then hardlink into", []tarEntry{symlink("x", f.outside), file("y", "y"), hardlink("x/y", "y")}, TarOptions{}},
		{"hardlink /etc/passwd", []tarEntry{hardlink("pw", "/etc/passwd")}, TarOptions{}},
		{"hardlink outside", []tarEntry{hardlink("pw", "../outside/secret")}, TarOptions{}},
		{"hardlink deep outside", []tarEntry{hardlink("pw", deep+"/secret")}, TarOptions{}},
		{"hardlink through symlink", []tarEntry{symlink("l", f.outside), hardlink("h", "l/secret")}, TarOptions{}},
		{"hardlink through rel symlink", []tarEntry{symlink("l", "../../outside"), hardlink("h", "l/secret")}, TarOptions{}},
		{"char device", []tarEntry{special(tar.TypeChar, "mem", 1, 1)}, TarOptions{}},
		{"block device", []tarEntry{special(tar.TypeBlock, "sda", 8, 0)}, TarOptions{}},
		{"fifo", []tarEntry{special(tar.TypeFifo, "fifo", 0, 0)}, TarOptions{}},
		{"file as dest", []tarEntry{file(".", "x")}, TarOptions{}},
		{"too many files", []tarEntry{file("a", "1"), file("b", "2"), file("c", "3")}, TarOptions{MaxFiles: 2}},
		{"too many bytes", []tarEntry{file("a", "123456"), file("b", "123456")}, TarOptions{MaxBytes: 10}},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dst := "/dst" + strings.Repeat("x", i) // fresh, so earlier cases cannot help
			_, err := f.r.ExtractTar(dst, bytes.NewReader(mkTar(t, tt.entries...)), tt.opts)
			wantClass(t, err, errdefs.ErrInvalid)
			if strings.HasPrefix(tt.name, "too many") && !strings.Contains(err.Error(), "limit") {
				t.Errorf("error %q does not mention the limit", err)
			}
		})
	}
	// The planted-by-the-sandbox variant: a symlink already inside p.
	f.symlink(t, f.outside, "/planted/x")
	err := extract(t, f, "/planted", TarOptions{}, file("x/secret", "pwned"))
	wantClass(t, err, errdefs.ErrInvalid)

	var st unix.Stat_t
	if unix.Stat("/etc/passwd", &st) == nil && st.Nlink != 1 {
		t.Errorf("/etc/passwd has %d links", st.Nlink)
	}
}

func TestExtractTarNULName(t *testing.T) {
	f := newFixture(t)
	// archive/tar will not write a NUL, so patch one into a PAX path record
	// (PAX data is not checksummed).
	long := strings.Repeat("n", 120) + "MARK"
	b := mkTar(t, file(long, "x"))
	i := bytes.Index(b, []byte("MARK"))
	b[i+1] = 0
	_, err := f.r.ExtractTar("/dst", bytes.NewReader(b), TarOptions{})
	wantClass(t, err, errdefs.ErrInvalid)
}

func TestExtractTarHardlinkToSymlinkStaysALink(t *testing.T) {
	f := newFixture(t)
	must(t, extract(t, f, "/dst", TarOptions{}, symlink("s", f.secret), hardlink("h", "s")))
	e, err := f.r.Stat("/dst/h")
	must(t, err)
	if e.Type != "symlink" {
		t.Fatalf("hard link to a symlink is a %s", e.Type)
	}
	if got, _ := readAll(t, f.r, "/dst/h"); strings.Contains(got, secret) {
		t.Fatal("read the host's secret through a hard-linked symlink")
	}
}

func TestExtractTarFIFOAllowed(t *testing.T) {
	f := newFixture(t)
	must(t, extract(t, f, "/dst", TarOptions{AllowDevices: true}, special(tar.TypeFifo, "fifo", 0, 0)))
	var st unix.Stat_t
	must(t, unix.Lstat(f.host("/dst/fifo"), &st))
	if st.Mode&unix.S_IFMT != unix.S_IFIFO || st.Mode&0777 != 0666 {
		t.Fatalf("fifo mode = %o, want fifo 0666 despite umask", st.Mode)
	}
}

func TestExtractTarLimitsWriteNoMore(t *testing.T) {
	f := newFixture(t)
	var entries []tarEntry
	for i := range 10 {
		entries = append(entries, file(strings.Repeat("f", i+1), strings.Repeat("x", 1000)))
	}
	res, err := f.r.ExtractTar("/dst", bytes.NewReader(mkTar(t, entries...)), TarOptions{MaxBytes: 3500})
	wantClass(t, err, errdefs.ErrInvalid)
	var total int64
	es, _ := f.r.List("/dst", 1)
	for _, e := range es {
		total += e.Size
	}
	if total > 3500 || res.Bytes > 3500 {
		t.Fatalf("wrote %d bytes (result %d) with a 3500 byte limit", total, res.Bytes)
	}
}

// A gzip stream that inflates to a 1 GiB file must be stopped by its header
// against MaxBytes, quickly, having written nothing.
func TestExtractTarGzipBomb(t *testing.T) {
	f := newFixture(t)
	pr, pw := io.Pipe()
	produced := make(chan int64, 1)
	go func() {
		zw, _ := gzip.NewWriterLevel(pw, gzip.BestSpeed)
		tw := tar.NewWriter(zw)
		var n int64
		err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: "zeros", Mode: 0644, Size: 1 << 30})
		zero := make([]byte, 1<<20)
		for err == nil && n < 1<<30 {
			var k int
			k, err = tw.Write(zero)
			n += int64(k)
		}
		if err == nil {
			tw.Close()
			zw.Close()
		}
		pw.CloseWithError(err)
		produced <- n
	}()
	start := time.Now()
	_, err := f.r.ExtractTar("/dst", pr, TarOptions{MaxBytes: 10 << 20})
	pr.CloseWithError(errors.New("extractor gave up"))
	elapsed := time.Since(start)
	wantClass(t, err, errdefs.ErrInvalid)
	if !strings.Contains(err.Error(), "limit") {
		t.Errorf("error %q does not mention the limit", err)
	}
	if elapsed > 30*time.Second {
		t.Fatalf("took %v to refuse", elapsed)
	}
	if n := <-produced; n >= 1<<30 {
		t.Fatalf("the whole bomb was read (%d bytes)", n)
	}
	if es, _ := f.r.List("/dst", 1); len(es) != 0 {
		t.Fatalf("left %v behind", es)
	}
}

func TestExtractTarCorrupt(t *testing.T) {
	f := newFixture(t)
	good := mkTar(t, file("a", strings.Repeat("a", 1000)), file("b", "b"))
	zgood := gz(t, good)
	corruptGz := bytes.Clone(zgood)
	corruptGz[len(corruptGz)/2] ^= 0xff
	garbage := bytes.Repeat([]byte("not a tar "), 200)
	tests := map[string][]byte{
		"truncated in data":   good[:700],
		"truncated in header": good[:300],
		"truncated gzip":      zgood[:len(zgood)/2],
		"corrupt gzip":        corruptGz,
		"gzip header only":    zgood[:5],
		"garbage":             garbage,
		"short garbage":       []byte("hello"),
	}
	for name, b := range tests {
		t.Run(name, func(t *testing.T) {
			_, err := f.r.ExtractTar("/"+strings.ReplaceAll(name, " ", "-"), bytes.NewReader(b), TarOptions{})
			wantClass(t, err, errdefs.ErrInvalid)
		})
	}
	// The partly written file of a truncated entry is removed.
	if _, err := os.Lstat(f.host("/truncated-in-data/a")); !os.IsNotExist(err) {
		t.Fatalf("partial file left: %v", err)
	}
}

type failingReader struct{ err error }

func (r failingReader) Read([]byte) (int, error) { return 0, r.err }

func TestExtractTarSourceErrorIsNotInvalid(t *testing.T) {
	f := newFixture(t)
	boom := errors.New("connection reset")
	good := mkTar(t, file("a", strings.Repeat("a", 1000)))
	_, err := f.r.ExtractTar("/dst", io.MultiReader(bytes.NewReader(good[:700]), failingReader{boom}), TarOptions{})
	if !errors.Is(err, boom) || errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("error = %v, want the reader's error unclassified", err)
	}
}

func TestExtractTarXattrs(t *testing.T) {
	f := newFixture(t)
	e := file("a", "x")
	e.hdr.PAXRecords = map[string]string{
		"SCHILY.xattr.user.dsec":       "kept",
		"SCHILY.xattr.trusted.overlay": "dropped without PreserveOwner",
	}
	must(t, extract(t, f, "/dst", TarOptions{}, e))
	buf := make([]byte, 64)
	n, err := unix.Getxattr(f.host("/dst/a"), "user.dsec", buf)
	if err == unix.ENOTSUP || err == unix.ENODATA {
		t.Skipf("filesystem lacks user xattrs: %v", err)
	}
	must(t, err)
	if string(buf[:n]) != "kept" {
		t.Fatalf("user.dsec = %q", buf[:n])
	}
	if _, err := unix.Getxattr(f.host("/dst/a"), "trusted.overlay", buf); err != unix.ENODATA && err != unix.ENOTSUP && err != unix.EPERM {
		t.Fatalf("trusted xattr applied without PreserveOwner: %v", err)
	}
}

func TestExtractTarPreserveOwnerAndDevices(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: chowns entries and creates device nodes")
	}
	f := newFixture(t)
	owned := func(e tarEntry) tarEntry { e.hdr.Uid, e.hdr.Gid = 1234, 5678; return e }
	suid := file("suid", "x")
	suid.hdr.Mode = 04755
	opaque := dir("d", 0750)
	opaque.hdr.PAXRecords = map[string]string{"SCHILY.xattr.trusted.overlay.opaque": "y"}
	err := extract(t, f, "/dst", TarOptions{PreserveOwner: true, AllowDevices: true},
		owned(opaque), owned(suid), owned(symlink("l", "suid")),
		owned(special(tar.TypeChar, "null", 1, 3)), owned(special(tar.TypeFifo, "fifo", 0, 0)))
	if errors.Is(err, errdefs.ErrPermissionDenied) {
		t.Skipf("needs CAP_MKNOD and CAP_CHOWN: %v", err)
	}
	must(t, err)
	for _, p := range []string{"/dst/d", "/dst/suid", "/dst/l", "/dst/null", "/dst/fifo"} {
		var st unix.Stat_t
		must(t, unix.Lstat(f.host(p), &st))
		if st.Uid != 1234 || st.Gid != 5678 {
			t.Errorf("%s owned by %d:%d", p, st.Uid, st.Gid)
		}
	}
	var st unix.Stat_t
	must(t, unix.Lstat(f.host("/dst/suid"), &st))
	if st.Mode&07777 != 04755 {
		t.Errorf("suid mode = %o, want 4755 with PreserveOwner", st.Mode&07777)
	}
	buf := make([]byte, 8)
	n, err := unix.Getxattr(f.host("/dst/d"), "trusted.overlay.opaque", buf)
	if err != unix.ENOTSUP && (err != nil || string(buf[:n]) != "y") {
		t.Errorf("trusted xattr with PreserveOwner: %q, %v", buf[:max(n, 0)], err)
	}
	must(t, unix.Lstat(f.host("/dst/null"), &st))
	if st.Mode&unix.S_IFMT != unix.S_IFCHR || st.Rdev != unix.Mkdev(1, 3) || st.Mode&0777 != 0666 {
		t.Errorf("null = mode %o rdev %d", st.Mode, st.Rdev)
	}
}

func TestTarRoundTrip(t *testing.T) {
	f := newFixture(t)
	mtime := time.Date(2021, 6, 7, 8, 9, 10, 0, time.UTC)
	f.write(t, "/src/a.txt", "alpha")
	f.write(t, "/src/sub/b.sh", "#!/bin/sh\n")
	must(t, os.Chmod(f.host("/src/sub/b.sh"), 0755))
	must(t, os.Link(f.host("/src/a.txt"), f.host("/src/sub/a-hard")))
	f.symlink(t, "../a.txt", "/src/sub/rel")
	f.symlink(t, f.secret, "/src/sub/abs")
	f.symlink(t, f.outside, "/src/sub/absdir")
	must(t, os.Mkdir(f.host("/src/empty"), 0700))
	must(t, unix.Mkfifo(f.host("/src/fifo"), 0640))
	for _, p := range []string{"/src/a.txt", "/src/sub/b.sh", "/src/empty", "/src/sub", "/src"} {
		must(t, os.Chtimes(f.host(p), mtime, mtime))
	}

	var buf bytes.Buffer
	must(t, f.r.WriteTar("/src", &buf))
	if bytes.Contains(buf.Bytes(), []byte(secret)) {
		t.Fatal("archive holds the host's secret")
	}
	var names []string
	tr := tar.NewReader(bytes.NewReader(buf.Bytes()))
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		must(t, err)
		names = append(names, h.Name)
	}
	want := "./ a.txt empty/ fifo sub/ sub/a-hard sub/abs sub/absdir sub/b.sh sub/rel"
	if strings.Join(names, " ") != want {
		t.Fatalf("names = %v, want %s", names, want)
	}

	_, err := f.r.ExtractTar("/dst", &buf, TarOptions{AllowDevices: true})
	must(t, err)
	src, dst := describeTree(t, f.host("/src")), describeTree(t, f.host("/dst"))
	if strings.Join(src, "\n") != strings.Join(dst, "\n") {
		t.Fatalf("round trip differs:\nsrc %v\ndst %v", src, dst)
	}
	var a, h unix.Stat_t
	must(t, unix.Lstat(f.host("/dst/a.txt"), &a))
	must(t, unix.Lstat(f.host("/dst/sub/a-hard"), &h))
	if a.Ino != h.Ino {
		t.Fatal("hard link not kept")
	}

	// A single file archives as one entry named after it.
	buf.Reset()
	must(t, f.r.WriteTar("/src/a.txt", &buf))
	tr = tar.NewReader(&buf)
	hdr, err := tr.Next()
	must(t, err)
	body, _ := io.ReadAll(tr)
	if hdr.Name != "a.txt" || string(body) != "alpha" || !hdr.ModTime.Equal(mtime) {
		t.Fatalf("single file entry %q %q %v", hdr.Name, body, hdr.ModTime)
	}
	if _, err := tr.Next(); err != io.EOF {
		t.Fatalf("more than one entry: %v", err)
	}
	wantClass(t, f.r.WriteTar("/nope", io.Discard), errdefs.ErrNotFound)
}

// describeTree lists a host tree as comparable lines: name, type, mode,
// size, mtime (dirs and files), link target and content.
func describeTree(t *testing.T, root string) []string {
	t.Helper()
	var out []string
	err := filepath.Walk(root, func(p string, fi os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		line := rel + " " + fi.Mode().String()
		switch {
		case fi.Mode().IsRegular():
			b, _ := os.ReadFile(p)
			line += " " + fi.ModTime().UTC().String() + " " + string(b)
		case fi.IsDir():
			line += " " + fi.ModTime().UTC().String()
		case fi.Mode()&os.ModeSymlink != 0:
			target, _ := os.Readlink(p)
			line += " -> " + target
		}
		out = append(out, line)
		return nil
	})
	must(t, err)
	return out
}
