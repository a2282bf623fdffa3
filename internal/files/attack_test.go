package files

import (
	"archive/tar"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// plantLinks plants the symlinks a hostile sandbox would: to "/", to the
// host's secret by absolute path, and relative ones climbing with "..".
func plantLinks(t *testing.T, f *fixture) {
	t.Helper()
	f.symlink(t, "/", "/slash")
	f.symlink(t, f.outside, "/abs")
	f.symlink(t, f.secret, "/absfile")
	f.symlink(t, "../outside", "/rel")
	f.symlink(t, strings.Repeat("../", 20)+f.outside[1:], "/deeprel")
	f.symlink(t, "../../outside/secret", "/dir/up")
	f.symlink(t, "/proc/self/root"+f.secret, "/magic")
}

func TestSymlinksCannotReadOutside(t *testing.T) {
	f := newFixture(t)
	plantLinks(t, f)
	for _, p := range []string{
		"/absfile", "/abs/secret", "/rel/secret", "/deeprel/secret", "/dir/up",
		"/slash" + f.secret, "/slash/../../.." + f.secret, "/../.." + f.secret, "/magic",
		"/abs/dir/passwd", "/rel/dir/passwd",
	} {
		got, err := readAll(t, f.r, p)
		if strings.Contains(got, secret) {
			t.Fatalf("ReadFile(%q) read the host's secret", p)
		}
		if err == nil {
			t.Fatalf("ReadFile(%q) = %q, want an error (nothing at the clamped path)", p, got)
		}
	}

	// The same links resolve inside the root: "/abs" means root+outside.
	f.write(t, f.secret, "decoy")
	for _, p := range []string{"/abs/secret", "/absfile", "/deeprel/secret", "/slash" + f.secret} {
		got, err := readAll(t, f.r, p)
		if err != nil || got != "decoy" {
			t.Fatalf("ReadFile(%q) = %q, %v; want the in-root decoy", p, got, err)
		}
	}

	// Stat reports the link itself, and List does not descend it.
	e, err := f.r.Stat("/absfile")
	must(t, err)
	if e.Type != "symlink" || e.LinkTarget != f.secret {
		t.Fatalf("Stat(/absfile) = %+v", e)
	}
	es, err := f.r.List("/", 100)
	must(t, err)
	for _, e := range es {
		if strings.Contains(e.Path, "passwd") {
			t.Fatalf("List descended a symlink: %+v", e)
		}
	}
	var buf bytes.Buffer
	must(t, f.r.WriteTar("/", &buf))
	if bytes.Contains(buf.Bytes(), []byte(secret)) {
		t.Fatal("WriteTar archived the host's secret")
	}
}

func TestSymlinksCannotWriteOutside(t *testing.T) {
	f := newFixture(t)
	plantLinks(t, f)
	for _, p := range []string{
		"/absfile", "/abs/secret", "/abs/new", "/rel/secret", "/rel/newdir/x", "/deeprel/secret",
		"/dir/up", "/slash" + f.secret, "/magic", "/abs/dir/passwd",
		"/../../outside/secret", "/..",
	} {
		// Success or failure are both fine; the fixture checks that
		// nothing outside the root changed.
		f.r.WriteFile(p, strings.NewReader("pwned"), 0644, 0, nil)
	}
	// Writes through "/abs" landed at root+outside.
	if b, err := os.ReadFile(f.host(f.secret)); err != nil || string(b) != "pwned" {
		t.Fatalf("write through /abs went to %q, %v; want root+outside", b, err)
	}
	// A trailing symlink is replaced, not written through.
	e, err := f.r.Stat("/absfile")
	must(t, err)
	if e.Type != "file" {
		t.Fatalf("/absfile is %q after WriteFile, want a file replacing the link", e.Type)
	}
	_, err = f.r.WriteFile("/a\x00b", strings.NewReader("x"), 0644, 0, nil)
	wantClass(t, err, errdefs.ErrInvalid)
}

func TestSymlinksCannotRemoveOutside(t *testing.T) {
	f := newFixture(t)
	plantLinks(t, f)
	f.write(t, "/tree/file", "x")
	f.symlink(t, f.outside, "/tree/abs")
	f.symlink(t, "../../outside", "/tree/sub/rel")
	f.symlink(t, "/", "/tree/sub/slash")

	for _, p := range []string{"/abs/secret", "/rel/secret", "/dir/up/x", "/slash" + f.secret, "/abs/dir"} {
		if err := f.r.Remove(p, true); err == nil {
			t.Fatalf("Remove(%q) succeeded; nothing is there inside the root", p)
		}
	}
	must(t, f.r.Remove("/tree", true))
	// Removing a link to "/" removes the link, not the root.
	must(t, f.r.Remove("/slash", true))
	must(t, f.r.Remove("/abs", true))
	if _, err := os.Lstat(f.host("/rel")); err != nil {
		t.Fatalf("unrelated link gone: %v", err)
	}
}

func TestListThroughLinks(t *testing.T) {
	f := newFixture(t)
	plantLinks(t, f)
	_, err := f.r.List("/abs", 1)
	wantClass(t, err, errdefs.ErrNotFound)
	_, err = f.r.List("/slash", 1)
	must(t, err)
	_, err = f.r.List("/a\x00", 1)
	wantClass(t, err, errdefs.ErrInvalid)
}

// A FIFO would block an open forever; a device node opened by host root
// would reach host hardware. ReadFile must refuse both without opening them.
func TestReadFileRefusesFIFO(t *testing.T) {
	f := newFixture(t)
	must(t, unix.Mkfifo(f.host("/fifo"), 0666))
	f.symlink(t, "/fifo", "/to-fifo")
	done := make(chan error, 2)
	go func() {
		_, _, err := f.r.ReadFile("/fifo")
		done <- err
		_, _, err = f.r.ReadFile("/to-fifo")
		done <- err
	}()
	for range 2 {
		select {
		case err := <-done:
			wantClass(t, err, errdefs.ErrInvalid)
		case <-time.After(30 * time.Second):
			t.Fatal("ReadFile blocked on a FIFO")
		}
	}
	// Archiving stores the FIFO as a header and does not open it either.
	go func() { done <- f.r.WriteTar("/", io.Discard) }()
	select {
	case err := <-done:
		must(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("WriteTar blocked on a FIFO")
	}
}

func TestReadFileRefusesDevice(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: creates a device node")
	}
	f := newFixture(t)
	// 1:5 is /dev/zero: harmless, and reading it would "succeed".
	if err := unix.Mknod(f.host("/zero"), unix.S_IFCHR|0666, int(unix.Mkdev(1, 5))); err != nil {
		t.Skipf("needs CAP_MKNOD: %v", err)
	}
	_, _, err := f.r.ReadFile("/zero")
	wantClass(t, err, errdefs.ErrInvalid)
	var buf bytes.Buffer
	must(t, f.r.WriteTar("/", &buf))
	if buf.Len() > 4096 {
		t.Fatalf("archive of a device node is %d bytes: its content was read", buf.Len())
	}
}

func TestDotDotInAPIPathsStaysInside(t *testing.T) {
	f := newFixture(t)
	_, err := f.r.WriteFile("/../../../outside/new", strings.NewReader("x"), 0644, 0, nil)
	must(t, err)
	if _, err := os.Stat(f.host("/outside/new")); err != nil {
		t.Fatalf("/../../../outside/new did not land at root/outside/new: %v", err)
	}
	_, err = f.r.ExtractTar("/../..", bytes.NewReader(mkTar(t, file("x", "y"))), TarOptions{})
	must(t, err)
	if _, err := os.Stat(f.host("/x")); err != nil {
		t.Fatal(err)
	}
}

// TestMountsInsideTheRootAreNotEntered: a sandbox's root opened in its own
// mount namespace (/proc/PID/root) has the kernel's and the platform's
// mounts below it (/proc, /dev, a host file bound over /etc/resolv.conf).
// Here a child process in a mount namespace of its own binds the outside
// directory into the root, once as a directory and once over a file, and
// the root is opened through the child's /proc/PID/root, as the edge does.
// No operation may read, write, list, archive, remove or replace through
// either mount. The kernel itself refuses an rmdir of a mount point only
// in the caller's own namespace, so this is the case that matters.
func TestMountsInsideTheRootAreNotEntered(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: makes bind mounts in a mount namespace")
	}
	f := newFixture(t)
	must(t, os.Mkdir(f.host("/mnt"), 0o755))
	f.write(t, "/etc/resolv.conf", "sandbox's own")
	plantLinks(t, f)
	f.symlink(t, "/mnt/secret", "/tomount")
	f.before = f.snapshotOutside(t)

	child := exec.Command("unshare", "-m", "--propagation", "private", "sh", "-c",
		`mount --bind "$1" "$2" && mount --bind "$3" "$4" && echo ready && exec sleep 120`, "sh",
		f.outside, f.host("/mnt"), f.secret, f.host("/etc/resolv.conf"))
	out, err := child.StdoutPipe()
	must(t, err)
	child.Stderr = os.Stderr
	if err := child.Start(); err != nil {
		t.Skipf("needs unshare(1): %v", err)
	}
	t.Cleanup(func() { _ = child.Process.Kill(); _ = child.Wait() })
	line := make([]byte, 6)
	if _, err := io.ReadFull(out, line); err != nil || string(line) != "ready\n" {
		t.Fatalf("child mount namespace not ready: %q %v", line, err)
	}
	r, err := Open(fmt.Sprintf("/proc/%d/root%s", child.Process.Pid, f.root))
	must(t, err)
	defer r.Close()
	mountsLeft := func(when string) {
		t.Helper()
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", child.Process.Pid))
		must(t, err)
		for _, p := range []string{f.host("/mnt"), f.host("/etc/resolv.conf")} {
			if !bytes.Contains(b, []byte(" "+p+" ")) {
				t.Fatalf("%s: the mount at %s is gone from the sandbox's namespace", when, p)
			}
		}
	}
	mountsLeft("before")

	for _, p := range []string{"/mnt/secret", "/etc/resolv.conf", "/tomount", "/mnt/dir/passwd", "/slash/mnt/secret"} {
		if rc, _, err := r.ReadFile(p); err == nil {
			b, _ := io.ReadAll(rc)
			rc.Close()
			t.Errorf("read %s through a mount: %q", p, b)
		} else if !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("read %s: %v, want invalid_argument", p, err)
		}
	}
	if _, err := r.Stat("/mnt/secret"); err == nil {
		t.Error("stat /mnt/secret through a mount succeeded")
	}
	for _, p := range []string{"/mnt/new", "/mnt/secret", "/etc/resolv.conf", "/mnt/dir/x", "/slash/mnt/x", "/mnt"} {
		if _, err := r.WriteFile(p, strings.NewReader("pwned"), 0o644, 1<<20, nil); err == nil {
			t.Errorf("write %s through or over a mount succeeded", p)
		}
	}
	for _, p := range []string{"/mnt/dir", "/mnt/secret", "/mnt", "/etc/resolv.conf", "/etc"} {
		for _, recursive := range []bool{false, true} {
			if err := r.Remove(p, recursive); err == nil {
				t.Errorf("remove %s (recursive %v) through or of a mount succeeded", p, recursive)
			}
		}
	}
	for _, p := range []string{"/mnt/newdir", "/mnt/dir/x", "/slash/mnt/y", "/etc/resolv.conf/z"} {
		if _, err := r.Mkdir(p, nil); err == nil {
			t.Errorf("mkdir %s through a mount succeeded", p)
		}
	}
	f.write(t, "/movable", "m")
	for _, c := range [][2]string{
		{"/mnt", "/mnt2"}, {"/etc/resolv.conf", "/resolv"}, {"/mnt/secret", "/stolen"}, {"/mnt/dir", "/stolen"},
		{"/movable", "/mnt"}, {"/movable", "/etc/resolv.conf"}, {"/movable", "/mnt/new"}, {"/movable", "/slash/mnt/new"},
	} {
		if _, err := r.Rename(c[0], c[1]); err == nil {
			t.Errorf("rename %s to %s, out of, onto or into a mount, succeeded", c[0], c[1])
		}
	}
	mountsLeft("after writes, removes, mkdirs and renames")
	for _, name := range []string{"mnt", "etc/resolv.conf"} {
		var tb bytes.Buffer
		tw := tar.NewWriter(&tb)
		must(t, tw.WriteHeader(&tar.Header{Name: name, Typeflag: tar.TypeReg, Mode: 0o644, Size: 5}))
		_, _ = tw.Write([]byte("pwned"))
		must(t, tw.Close())
		if _, err := r.ExtractTar("/", &tb, TarOptions{}); err == nil {
			t.Errorf("tar entry %s over a mount point extracted", name)
		}
	}
	mountsLeft("after tar in")
	if err := r.Remove("/tomount", false); err != nil {
		t.Errorf("removing the link itself: %v", err)
	}
	ents, err := r.List("/", 3)
	must(t, err)
	var sawMnt bool
	for _, e := range ents {
		if e.Path == "/mnt" {
			sawMnt = true
		}
		if strings.HasPrefix(e.Path, "/mnt/") {
			t.Errorf("list entered the mount: %s", e.Path)
		}
	}
	if !sawMnt {
		t.Error("list does not name the mount point /mnt")
	}
	if _, err := r.List("/mnt", 1); err == nil {
		t.Error("list /mnt entered the mount")
	}
	var tb bytes.Buffer
	must(t, r.WriteTar("/", &tb))
	for tr := tar.NewReader(&tb); ; {
		h, err := tr.Next()
		if err != nil {
			break
		}
		if (strings.HasPrefix(h.Name, "mnt/") && h.Name != "mnt/") || h.Name == "etc/resolv.conf" {
			t.Errorf("tar of / holds %s, below or at a mount", h.Name)
		}
	}
	if err := r.WriteTar("/mnt", io.Discard); err == nil {
		t.Error("tar of /mnt entered the mount")
	}
	f.checkOutside(t)
	if _, err := os.Stat(f.host("/mnt")); err != nil {
		t.Errorf("the mount point itself was removed: %v", err)
	}
}
