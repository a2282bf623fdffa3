package files

import (
	"archive/tar"
	"bytes"
	"errors"
	"os"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// A VM's writable layer travels from its agent to the edge as a tar
// (WriteDiffTar, then ExtractTar with Diff). Root in the VM writes that
// tar: these tests give the extractor what such a root could send.

func needRootDiff(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: whiteouts are device nodes, opaque dirs trusted xattrs")
	}
}

func xattr(t *testing.T, p, name string) (string, error) {
	t.Helper()
	buf := make([]byte, 256)
	n, err := unix.Lgetxattr(p, name, buf)
	if err != nil {
		return "", err
	}
	return string(buf[:n]), nil
}

// TestDiffTarRoundTrip packs an overlay upper with WriteDiffTar and
// unpacks it with Diff: whiteouts, opaque dirs, owners, setuid bits and
// file capabilities come through.
func TestDiffTarRoundTrip(t *testing.T) {
	needRootDiff(t)
	f := newFixture(t)
	f.write(t, "/up/etc/new.conf", "x=1\n")
	f.write(t, "/up/bin/suid", "#!\n")
	must(t, os.Chown(f.host("/up/bin/suid"), 1000, 1001))
	must(t, unix.Chmod(f.host("/up/bin/suid"), 04755)) // after chown, which clears it
	must(t, unix.Mknod(f.host("/up/etc/gone"), unix.S_IFCHR, 0))
	must(t, os.Mkdir(f.host("/up/opaque"), 0o750))
	if err := unix.Setxattr(f.host("/up/opaque"), opaqueXattr, []byte("y"), 0); err != nil {
		t.Skipf("filesystem lacks trusted xattrs: %v", err)
	}
	// A capability xattr as setcap writes it (v2, cap_net_raw).
	capv := []byte{0, 0, 0, 2, 0, 0x20, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}
	must(t, unix.Setxattr(f.host("/up/bin/suid"), "security.capability", capv, 0))

	var buf bytes.Buffer
	must(t, f.r.WriteDiffTar("/up", &buf))
	// WriteTar, for the files API, never carries xattrs.
	var plain bytes.Buffer
	must(t, f.r.WriteTar("/up", &plain))
	if bytes.Contains(plain.Bytes(), []byte("trusted.overlay")) {
		t.Fatal("WriteTar carried trusted xattrs")
	}
	if _, err := f.r.ExtractTar("/dst", &buf, TarOptions{Diff: true}); err != nil {
		t.Fatal(err)
	}
	var st unix.Stat_t
	must(t, unix.Lstat(f.host("/dst/etc/gone"), &st))
	if st.Mode&unix.S_IFMT != unix.S_IFCHR || st.Rdev != 0 {
		t.Errorf("whiteout = mode %o rdev %d", st.Mode, st.Rdev)
	}
	if v, err := xattr(t, f.host("/dst/opaque"), opaqueXattr); err != nil || v != "y" {
		t.Errorf("opaque dir: %q %v", v, err)
	}
	must(t, unix.Lstat(f.host("/dst/bin/suid"), &st))
	if st.Mode&07777 != 04755 || st.Uid != 1000 || st.Gid != 1001 {
		t.Errorf("suid file = mode %o owner %d:%d", st.Mode&07777, st.Uid, st.Gid)
	}
	if v, err := xattr(t, f.host("/dst/bin/suid"), "security.capability"); err != nil || v != string(capv) {
		t.Errorf("file capability: %x %v", v, err)
	}
}

// TestDiffTarHostile: what a root in the VM could put in the stream is
// refused (devices, names out of the tree, links through symlinks) or
// dropped (xattrs that would steer the overlay or the host).
func TestDiffTarHostile(t *testing.T) {
	needRootDiff(t)
	for _, tc := range []struct {
		name string
		e    []tarEntry
	}{
		{"block device", []tarEntry{special(tar.TypeBlock, "sda", 8, 0)}},
		{"char device", []tarEntry{special(tar.TypeChar, "mem", 1, 1)}},
		{"char 0:1", []tarEntry{special(tar.TypeChar, "x", 0, 1)}},
		{"escaping name", []tarEntry{file("../../etc/x", "x")}},
		{"through a symlink", []tarEntry{symlink("l", "/etc"), file("l/passwd", "x")}},
		{"hard link out", []tarEntry{hardlink("h", "../../etc/shadow")}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			err := extract(t, f, "/dst", TarOptions{Diff: true}, tc.e...)
			if !errors.Is(err, errdefs.ErrInvalid) {
				t.Fatalf("got %v, want invalid", err)
			}
		})
	}
	t.Run("xattrs", func(t *testing.T) {
		f := newFixture(t)
		d := dir("d", 0o755)
		d.hdr.PAXRecords = map[string]string{
			"SCHILY.xattr.trusted.overlay.redirect": "/etc",
			"SCHILY.xattr.trusted.overlay.metacopy": "",
			"SCHILY.xattr.trusted.overlay.origin":   "xx",
			"SCHILY.xattr.security.selinux":         "system_u:object_r:shadow_t:s0",
			"SCHILY.xattr.user.kept":                "1",
		}
		o := dir("o", 0o755)
		o.hdr.PAXRecords = map[string]string{"SCHILY.xattr.trusted.overlay.opaque": "x"}
		must(t, extract(t, f, "/dst", TarOptions{Diff: true}, d, o))
		for _, x := range []string{"trusted.overlay.redirect", "trusted.overlay.metacopy", "trusted.overlay.origin", "security.selinux"} {
			if v, err := xattr(t, f.host("/dst/d"), x); err == nil {
				t.Errorf("%s applied: %q", x, v)
			}
		}
		if v, err := xattr(t, f.host("/dst/o"), opaqueXattr); err == nil {
			t.Errorf("opaque value other than y applied: %q", v)
		}
		if v, err := xattr(t, f.host("/dst/d"), "user.kept"); err != unix.ENOTSUP && v != "1" {
			t.Errorf("user xattr: %q %v", v, err)
		}
	})
}
