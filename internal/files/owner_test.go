package files

import (
	"archive/tar"
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
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
	if _, err := f.r.WriteFile("/new/dir/file", strings.NewReader("x"), 0o755|os.ModeSetuid, 0); err != nil {
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
