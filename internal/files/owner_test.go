package files

import (
	"archive/tar"
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// TestSetOwnerOwnsWhatIsCreated: with SetOwner (a user-namespace sandbox),
// files, parent directories and tar entries the Root creates belong to the
// owner, and the setuid bit of a write survives the chown.
func TestSetOwnerOwnsWhatIsCreated(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: chowns to another user")
	}
	f := newFixture(t)
	f.r.SetOwner(Owner{UID: 4242, GID: 4343})
	if _, err := f.r.WriteFile("/new/dir/file", strings.NewReader("x"), 0o755|os.ModeSetuid, 0, nil); err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, h := range []*tar.Header{
		{Name: "t/implicit/", Typeflag: tar.TypeDir, Mode: 0o755},
		{Name: "t/implicit/a", Typeflag: tar.TypeReg, Mode: 0o644, Size: 1, Uid: 7, Gid: 7},
		{Name: "t/deep/er/link", Typeflag: tar.TypeSymlink, Linkname: "a"},
	} {
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if h.Size > 0 {
			tw.Write([]byte("a"))
		}
	}
	tw.Close()
	if _, err := f.r.ExtractTar("/x", &buf, TarOptions{}); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"new", "new/dir", "new/dir/file", "x", "x/t", "x/t/implicit", "x/t/implicit/a", "x/t/deep", "x/t/deep/er", "x/t/deep/er/link"} {
		var st syscall.Stat_t
		if err := syscall.Lstat(filepath.Join(f.root, p), &st); err != nil {
			t.Fatal(err)
		}
		if st.Uid != 4242 || st.Gid != 4343 {
			t.Errorf("%s owned by %d:%d, want 4242:4343", p, st.Uid, st.Gid)
		}
	}
	if fi, err := os.Stat(filepath.Join(f.root, "new/dir/file")); err != nil || fi.Mode()&os.ModeSetuid == 0 {
		t.Errorf("setuid bit lost: %v %v", fi.Mode(), err)
	}
}

// TestCallOwnerOwnsOnlyWhatTheCallCreates: a write, a mkdir or a tar
// extraction that names an owner gives it the file and the parent
// directories the call creates, and nothing else: existing parents, a
// directory already there, and whatever a hostile symlink at a parent
// points to keep their owners; the symlink is resolved inside the root.
func TestCallOwnerOwnsOnlyWhatTheCallCreates(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: chowns to another user")
	}
	f := newFixture(t)
	o := &Owner{UID: 4242, GID: 4343}
	f.write(t, "/home/user/old", "root's")
	f.write(t, "/etc/passwd", "root:x:0:0::/root:/bin/sh\n")
	// Links the sandbox planted at a target's parent: to the host's
	// outside dir by its absolute host path, and up by "..". Inside the
	// root they name directories of its own, which exist (a dangling
	// link at a parent is not followed to create its target).
	f.symlink(t, f.outside, "/home/user/abs")
	f.symlink(t, "../../../outside", "/home/user/up")
	must(t, os.MkdirAll(f.host(f.outside), 0o755))
	must(t, os.Mkdir(f.host("/outside"), 0o755))
	f.symlink(t, "/etc", "/home/user/etc")

	for _, p := range []string{"/home/user/a/b/f.txt", "/home/user/old", "/home/user/abs/dir/new", "/home/user/up/dir/new"} {
		if _, err := f.r.WriteFile(p, strings.NewReader("x"), 0o644, 0, o); err != nil {
			t.Fatalf("writing %s: %v", p, err)
		}
	}
	if _, err := f.r.Mkdir("/home/user/m/n", o); err != nil {
		t.Fatal(err)
	}
	_, err := f.r.Mkdir("/home/user/etc", o)
	wantClass(t, err, errdefs.ErrAlreadyExists)
	_, err = f.r.Mkdir("/home/user", o)
	wantClass(t, err, errdefs.ErrAlreadyExists)
	if _, err := f.r.ExtractTar("/home/user/t/u", bytes.NewReader(mkTar(t, file("x", "y"))), TarOptions{Owner: o}); err != nil {
		t.Fatal(err)
	}

	owned := func(host string, uid, gid uint32) {
		t.Helper()
		var st syscall.Stat_t
		if err := syscall.Lstat(host, &st); err != nil {
			t.Fatal(err)
		}
		if st.Uid != uid || st.Gid != gid {
			t.Errorf("%s owned by %d:%d, want %d:%d", host, st.Uid, st.Gid, uid, gid)
		}
	}
	for _, p := range []string{
		"/home/user/a", "/home/user/a/b", "/home/user/a/b/f.txt", "/home/user/old",
		"/home/user/m", "/home/user/m/n", "/home/user/t", "/home/user/t/u", "/home/user/t/u/x",
		// The links' targets, inside the root.
		f.outside + "/dir", f.outside + "/dir/new", "/outside/dir", "/outside/dir/new",
	} {
		owned(f.host(p), 4242, 4343)
	}
	for _, p := range []string{"/", "/home", "/home/user", "/home/user/abs", "/home/user/up", "/home/user/etc", "/etc", "/etc/passwd", f.outside, "/outside"} {
		owned(f.host(p), 0, 0)
	}
	// Outside the root nothing was written (checkOutside) nor chowned.
	for _, p := range []string{f.outside, filepath.Join(f.outside, "dir"), filepath.Join(f.outside, "dir", "passwd"), f.secret} {
		owned(p, 0, 0)
	}
	if _, err := os.Lstat(filepath.Join(f.outside, "dir", "new")); !os.IsNotExist(err) {
		t.Fatalf("a write through a link reached the host: %v", err)
	}
}

// TestCallOwnerWithIDMap: in a user-namespace root, a call's owner is
// given in host IDs (HostOwner shifts them); without one, what is
// created goes to the root's owner as before.
func TestCallOwnerWithIDMap(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: chowns to another user")
	}
	const base = 1_000_000_000
	f := newFixture(t)
	f.r.SetOwner(Owner{UID: base, GID: base})
	f.r.SetIDMap(base, 65536)
	o, err := f.r.HostOwner(1000, 1001)
	must(t, err)
	for p, owner := range map[string]*Owner{"/u/f": &o, "/r/f": nil} {
		if _, err := f.r.WriteFile(p, strings.NewReader("x"), 0o644, 0, owner); err != nil {
			t.Fatal(err)
		}
	}
	for p, want := range map[string][2]uint32{
		"/u": {base + 1000, base + 1001}, "/u/f": {base + 1000, base + 1001},
		"/r": {base, base}, "/r/f": {base, base},
	} {
		e, err := f.r.Stat(p)
		must(t, err)
		var st syscall.Stat_t
		must(t, syscall.Lstat(f.host(p), &st))
		if st.Uid != want[0] || st.Gid != want[1] {
			t.Errorf("%s owned by %d:%d on disk, want %d:%d", p, st.Uid, st.Gid, want[0], want[1])
		}
		if e.UID != want[0]-base || e.GID != want[1]-base {
			t.Errorf("%s shows as %d:%d, want %d:%d", p, e.UID, e.GID, want[0]-base, want[1]-base)
		}
	}
}

// TestHostOwner maps the sandbox's IDs to the host's.
func TestHostOwner(t *testing.T) {
	plain, mapped := &Root{}, &Root{}
	mapped.SetIDMap(1_000_000_000, 65536)
	for _, c := range []struct {
		r        *Root
		uid, gid uint32
		want     Owner
		ok       bool
	}{
		{plain, 0, 0, Owner{0, 0}, true},
		{plain, 1000, 1001, Owner{1000, 1001}, true},
		{plain, 70000, 70000, Owner{70000, 70000}, true},
		{plain, ^uint32(0), 0, Owner{}, false},
		{plain, 0, ^uint32(0), Owner{}, false},
		{mapped, 0, 0, Owner{1_000_000_000, 1_000_000_000}, true},
		{mapped, 1000, 1001, Owner{1_000_001_000, 1_000_001_001}, true},
		{mapped, 65535, 65535, Owner{1_000_065_535, 1_000_065_535}, true},
		{mapped, 65536, 0, Owner{}, false},
		{mapped, 0, 65536, Owner{}, false},
	} {
		got, err := c.r.HostOwner(c.uid, c.gid)
		if (err == nil) != c.ok || got != c.want {
			t.Errorf("HostOwner(%d, %d) with map %d = %v, %v; want %v, ok=%v", c.uid, c.gid, c.r.idSize, got, err, c.want, c.ok)
		}
		if err != nil && !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("HostOwner(%d, %d): %v, want invalid", c.uid, c.gid, err)
		}
	}
}
