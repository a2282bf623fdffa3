package files

import (
	"os"
	"strings"
	"testing"

	"github.com/dsecproject/dsec/internal/errdefs"
)

func TestMkdir(t *testing.T) {
	f := newFixture(t)
	e, err := f.r.Mkdir("/a/b/c", nil)
	must(t, err)
	if e.Path != "/a/b/c" || e.Type != "dir" {
		t.Fatalf("Mkdir = %+v", e)
	}
	for _, p := range []string{"/a", "/a/b", "/a/b/c"} {
		if fi, err := os.Stat(f.host(p)); err != nil || !fi.IsDir() {
			t.Fatalf("%s not a directory: %v", p, err)
		}
	}
	_, err = f.r.Mkdir("/a/b/c", nil)
	wantClass(t, err, errdefs.ErrAlreadyExists)
	_, err = f.r.Mkdir("/", nil)
	wantClass(t, err, errdefs.ErrAlreadyExists)
	f.symlink(t, "/a/b", "/tob")
	_, err = f.r.Mkdir("/tob", nil)
	wantClass(t, err, errdefs.ErrAlreadyExists)
	f.write(t, "/file", "x")
	_, err = f.r.Mkdir("/file", nil)
	wantClass(t, err, errdefs.ErrInvalid)
	_, err = f.r.Mkdir("/file/sub", nil)
	wantClass(t, err, errdefs.ErrInvalid)
	f.symlink(t, "/nowhere", "/dangling")
	_, err = f.r.Mkdir("/dangling", nil)
	wantClass(t, err, errdefs.ErrInvalid)
	_, err = f.r.Mkdir("relative", nil)
	wantClass(t, err, errdefs.ErrInvalid)
}

func TestMkdirThroughLinksStaysInside(t *testing.T) {
	f := newFixture(t)
	plantLinks(t, f)
	for _, p := range []string{"/slash" + f.outside + "/x", "/abs/new", "/rel/new", "/deeprel/new/deeper", "/../../outside/y", "/magic/z"} {
		// Success or failure are both fine; the fixture checks that
		// nothing outside the root changed.
		_, _ = f.r.Mkdir(p, nil)
	}
	// "/abs" means root+outside (which "/slash"+outside made): the
	// directory is there, inside.
	if fi, err := os.Stat(f.host(f.outside + "/new")); err != nil || !fi.IsDir() {
		t.Fatalf("mkdir through /abs did not land at root+outside: %v", err)
	}
	if fi, err := os.Stat(f.host("/outside/y")); err != nil || !fi.IsDir() {
		t.Fatalf("/../../outside/y did not land at root/outside/y: %v", err)
	}
}

func TestRename(t *testing.T) {
	f := newFixture(t)
	f.write(t, "/a/f", "one")
	e, err := f.r.Rename("/a/f", "/b/c/g")
	must(t, err)
	if e.Path != "/b/c/g" || e.Type != "file" || e.Size != 3 {
		t.Fatalf("Rename = %+v", e)
	}
	if got, err := readAll(t, f.r, "/b/c/g"); err != nil || got != "one" {
		t.Fatalf("moved file reads %q, %v", got, err)
	}
	if _, err := os.Lstat(f.host("/a/f")); !os.IsNotExist(err) {
		t.Fatalf("source still there: %v", err)
	}
	// A file replaces a file.
	f.write(t, "/a/h", "two")
	_, err = f.r.Rename("/a/h", "/b/c/g")
	must(t, err)
	if got, _ := readAll(t, f.r, "/b/c/g"); got != "two" {
		t.Fatalf("replaced file reads %q", got)
	}
	// A directory moves with its contents.
	f.write(t, "/d/x", "x")
	_, err = f.r.Rename("/d", "/e/d2")
	must(t, err)
	if got, _ := readAll(t, f.r, "/e/d2/x"); got != "x" {
		t.Fatalf("moved directory's file reads %q", got)
	}

	_, err = f.r.Rename("/nope", "/x")
	wantClass(t, err, errdefs.ErrNotFound)
	_, err = f.r.Rename("/nodir/nope", "/x")
	wantClass(t, err, errdefs.ErrNotFound)
	for _, c := range [][2]string{{"/", "/x"}, {"/e", "/"}, {"/e", "/e/d2/inside"}, {"/b/c/g", "/e"}, {"/e", "/b/c/g"}, {"/b/c/g", "/b/c/g/under"}, {"rel", "/x"}} {
		_, err = f.r.Rename(c[0], c[1])
		wantClass(t, err, errdefs.ErrInvalid)
	}
	f.write(t, "/full/y", "y")
	must(t, os.Mkdir(f.host("/empty"), 0o755))
	_, err = f.r.Rename("/empty", "/full")
	wantClass(t, err, errdefs.ErrPrecondition)
	_, err = f.r.Rename("/full", "/empty")
	must(t, err)
}

func TestRenameThroughLinksStaysInside(t *testing.T) {
	f := newFixture(t)
	plantLinks(t, f)
	// Sources that only exist outside the root are not found: each
	// resolves to a missing name inside it.
	for _, p := range []string{"/abs/secret", "/rel/secret", "/deeprel/secret", "/dir/up/x", "/slash" + f.secret, "/../.." + f.secret, "/abs/dir"} {
		_, err := f.r.Rename(p, "/stolen")
		if err == nil {
			t.Fatalf("Rename(%q) succeeded; nothing is there inside the root", p)
		}
	}
	if _, err := os.Lstat(f.host("/stolen")); !os.IsNotExist(err) {
		t.Fatal("something was moved to /stolen")
	}
	// Destinations through links land inside the root ("/abs" names
	// root+outside, made here so that the link leads somewhere).
	must(t, os.MkdirAll(f.host(f.outside), 0o755))
	f.write(t, "/f1", "1")
	_, err := f.r.Rename("/f1", "/abs/pwned")
	must(t, err)
	if got, _ := os.ReadFile(f.host(f.outside + "/pwned")); string(got) != "1" {
		t.Fatalf("rename through /abs went to %q; want root+outside/pwned", got)
	}
	f.write(t, "/f2", "2")
	_, _ = f.r.Rename("/f2", "/rel/pwned")
	f.write(t, "/f3", "3")
	_, err = f.r.Rename("/f3", "/../../../outside/pwned")
	must(t, err)
	if got, _ := os.ReadFile(f.host("/outside/pwned")); string(got) != "3" {
		t.Fatalf("/../../../outside/pwned went to %q; want root/outside/pwned", got)
	}
	// A trailing symlink moves itself; its target stays where it is.
	e, err := f.r.Rename("/absfile", "/moved")
	must(t, err)
	if e.Type != "symlink" || e.LinkTarget != f.secret {
		t.Fatalf("moved link = %+v", e)
	}
	// A symlink at the destination is replaced, not written through.
	f.write(t, "/f4", "4")
	_, err = f.r.Rename("/f4", "/moved")
	must(t, err)
	if e, _ := f.r.Stat("/moved"); e.Type != "file" {
		t.Fatalf("/moved is %q after a rename onto it, want the file", e.Type)
	}
	// A symlinked parent of the destination is followed inside the root.
	f.write(t, "/f5", "5")
	_, err = f.r.Rename("/f5", "/slash/tmp/f5")
	must(t, err)
	if got, _ := os.ReadFile(f.host("/tmp/f5")); string(got) != "5" {
		t.Fatalf("rename through /slash went to %q; want root/tmp/f5", got)
	}
	_, err = f.r.Rename("/tmp/f5", "/a\x00b")
	wantClass(t, err, errdefs.ErrInvalid)
	_, err = f.r.Rename("/tmp/f5", "/"+strings.Repeat("x/", MaxPathLen))
	wantClass(t, err, errdefs.ErrInvalid)
}
