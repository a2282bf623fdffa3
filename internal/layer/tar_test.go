package layer

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"errors"
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
	data string
}

func makeTar(t *testing.T, entries []tarEntry, gz bool) []byte {
	t.Helper()
	var buf bytes.Buffer
	var w *tar.Writer
	var zw *gzip.Writer
	if gz {
		zw = gzip.NewWriter(&buf)
		w = tar.NewWriter(zw)
	} else {
		w = tar.NewWriter(&buf)
	}
	for _, e := range entries {
		h := e.hdr
		h.Size = int64(len(e.data))
		if h.ModTime.IsZero() {
			h.ModTime = fixedTime
		}
		h.Format = tar.FormatPAX
		if err := w.WriteHeader(&h); err != nil {
			t.Fatal(err)
		}
		if _, err := w.Write([]byte(e.data)); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if zw != nil {
		if err := zw.Close(); err != nil {
			t.Fatal(err)
		}
	}
	return buf.Bytes()
}

// A rootfs-like archive without entries for "./" or "usr/", so the builder
// must date those itself.
var rootfsTar = []tarEntry{
	{hdr: tar.Header{Name: "etc/", Typeflag: tar.TypeDir, Mode: 0o755}},
	{hdr: tar.Header{Name: "etc/hostname", Typeflag: tar.TypeReg, Mode: 0o644}, data: "sandbox\n"},
	{hdr: tar.Header{Name: "usr/bin/su", Typeflag: tar.TypeReg, Mode: 0o4755}, data: "ELF"},
	{hdr: tar.Header{Name: "usr/bin/ping", Typeflag: tar.TypeReg, Mode: 0o755,
		PAXRecords: map[string]string{"SCHILY.xattr.security.capability": "\x01\x00\x00\x02\x00\x20\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00"}}, data: "ELF"},
	{hdr: tar.Header{Name: "usr/bin/sh", Typeflag: tar.TypeSymlink, Linkname: "busybox"}},
	{hdr: tar.Header{Name: "usr/bin/busybox", Typeflag: tar.TypeReg, Mode: 0o755}, data: "BB"},
	{hdr: tar.Header{Name: "usr/bin/ls", Typeflag: tar.TypeLink, Linkname: "usr/bin/busybox"}},
	{hdr: tar.Header{Name: "home/dev/", Typeflag: tar.TypeDir, Mode: 0o700, Uid: 1000, Gid: 1000}},
	{hdr: tar.Header{Name: "home/dev/notes", Typeflag: tar.TypeReg, Mode: 0o600, Uid: 1000, Gid: 1000}, data: "hi"},
	{hdr: tar.Header{Name: "dev/null", Typeflag: tar.TypeChar, Mode: 0o666, Devmajor: 1, Devminor: 3}},
	{hdr: tar.Header{Name: "run/fifo", Typeflag: tar.TypeFifo, Mode: 0o600}},
}

func TestBuildFromTar(t *testing.T) {
	needRootAndMkfs(t)
	s, dir := newTestStore(t)
	ctx := context.Background()

	var progress strings.Builder
	start := time.Now()
	l, err := s.BuildFromTar(ctx, mustRef(t, "base/tiny:1"), bytes.NewReader(makeTar(t, rootfsTar, false)), BuildOptions{}, &progress)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("built from tar in %s: %s", time.Since(start).Round(time.Microsecond), strings.ReplaceAll(strings.TrimSpace(progress.String()), "\n", " | "))

	// The same archive, gzip'd and a second later, is the same content.
	time.Sleep(1100 * time.Millisecond)
	l2, err := s.BuildFromTar(ctx, mustRef(t, "base/tiny-gz:1"), bytes.NewReader(makeTar(t, rootfsTar, true)), BuildOptions{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if l2.Digest != l.Digest {
		t.Errorf("same tar built twice: %s vs %s", l.Digest, l2.Digest)
	}
	assertStagingClean(t, dir)

	m := NewMounter(filepath.Join(t.TempDir(), "mnt"), s, nil)
	mp := acquire(t, m, l.Digest)
	check := func(p string, mode uint32, uid, gid uint32) unix.Stat_t {
		t.Helper()
		var st unix.Stat_t
		if err := unix.Lstat(filepath.Join(mp, p), &st); err != nil {
			t.Fatal(err)
		}
		if st.Mode != mode || st.Uid != uid || st.Gid != gid {
			t.Errorf("%s: mode %o owner %d:%d, want %o %d:%d", p, st.Mode, st.Uid, st.Gid, mode, uid, gid)
		}
		return st
	}
	check("", unix.S_IFDIR|0o755, 0, 0)
	check("usr/bin/su", unix.S_IFREG|0o4755, 0, 0)
	check("home/dev", unix.S_IFDIR|0o700, 1000, 1000)
	check("home/dev/notes", unix.S_IFREG|0o600, 1000, 1000)
	check("run/fifo", unix.S_IFIFO|0o600, 0, 0)
	if st := check("dev/null", unix.S_IFCHR|0o666, 0, 0); st.Rdev != unix.Mkdev(1, 3) {
		t.Errorf("dev/null rdev %x", st.Rdev)
	}
	if st := check("usr/bin/ls", unix.S_IFREG|0o755, 0, 0); st.Nlink != 2 {
		t.Errorf("hard link has nlink %d", st.Nlink)
	}
	if target, _ := os.Readlink(filepath.Join(mp, "usr/bin/sh")); target != "busybox" {
		t.Errorf("usr/bin/sh -> %q", target)
	}
	if _, err := unix.Lgetxattr(filepath.Join(mp, "usr/bin/ping"), "security.capability", make([]byte, 64)); err != nil {
		t.Errorf("file capability lost: %v", err)
	}
	var st unix.Stat_t
	if err := unix.Lstat(filepath.Join(mp, "etc/hostname"), &st); err != nil || !time.Unix(st.Mtim.Unix()).Equal(fixedTime) {
		t.Errorf("etc/hostname mtime %v (%v), want the archive's", time.Unix(st.Mtim.Unix()), err)
	}
	if err := unix.Lstat(filepath.Join(mp, "usr"), &st); err != nil || !time.Unix(st.Mtim.Unix()).Equal(unknownMTime) {
		t.Errorf("implicit dir usr mtime %v (%v), want %v", time.Unix(st.Mtim.Unix()), err, unknownMTime)
	}
}

func TestBuildFromHostileTar(t *testing.T) {
	needRootAndMkfs(t)
	s, dir := newTestStore(t)
	ctx := context.Background()

	tests := []struct {
		name    string
		entries []tarEntry
		opts    BuildOptions
	}{
		{"dotdot", []tarEntry{
			{hdr: tar.Header{Name: "ok.txt", Typeflag: tar.TypeReg, Mode: 0o644}, data: "fine"},
			{hdr: tar.Header{Name: "../escaped.txt", Typeflag: tar.TypeReg, Mode: 0o644}, data: "evil"},
		}, BuildOptions{}},
		{"nested dotdot", []tarEntry{
			{hdr: tar.Header{Name: "a/../../escaped.txt", Typeflag: tar.TypeReg, Mode: 0o644}, data: "evil"},
		}, BuildOptions{}},
		{"through symlink", []tarEntry{
			{hdr: tar.Header{Name: "x", Typeflag: tar.TypeSymlink, Linkname: ".."}},
			{hdr: tar.Header{Name: "x/escaped.txt", Typeflag: tar.TypeReg, Mode: 0o644}, data: "evil"},
		}, BuildOptions{}},
		{"hard link out", []tarEntry{
			{hdr: tar.Header{Name: "passwd", Typeflag: tar.TypeLink, Linkname: "../../../../etc/passwd"}},
		}, BuildOptions{}},
		{"too big", []tarEntry{
			{hdr: tar.Header{Name: "big", Typeflag: tar.TypeReg, Mode: 0o644}, data: strings.Repeat("x", 2048)},
		}, BuildOptions{MaxBytes: 1024}},
		{"too many", []tarEntry{
			{hdr: tar.Header{Name: "a", Typeflag: tar.TypeReg, Mode: 0o644}},
			{hdr: tar.Header{Name: "b", Typeflag: tar.TypeReg, Mode: 0o644}},
		}, BuildOptions{MaxFiles: 1}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ref := mustRef(t, "workspace/hostile:1")
			_, err := s.BuildFromTar(ctx, ref, bytes.NewReader(makeTar(t, tt.entries, false)), tt.opts, nil)
			if !errors.Is(err, errdefs.ErrInvalid) {
				t.Fatalf("BuildFromTar: %v, want ErrInvalid", err)
			}
			t.Logf("refused: %v", err)
			assertStagingClean(t, dir)
			if _, err := os.Stat(filepath.Join(dir, "escaped.txt")); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("entry escaped the staging dir")
			}
			if _, err := s.Resolve(ref.String()); !errors.Is(err, errdefs.ErrNotFound) {
				t.Errorf("catalog entry after failed build: %v", err)
			}
		})
	}
	assertEmpty(t, filepath.Join(dir, "blobs", "sha256"))

	// A truncated upload and a cancelled one leave nothing either.
	// (Cut inside file data: archive/tar reports a cut on a block boundary
	// or inside a PAX record as a clean end of archive.)
	big := makeTar(t, []tarEntry{{hdr: tar.Header{Name: "big", Typeflag: tar.TypeReg, Mode: 0o644}, data: strings.Repeat("x", 10000)}}, false)
	if _, err := s.BuildFromTar(ctx, mustRef(t, "base/trunc:1"), bytes.NewReader(big[:5000]), BuildOptions{}, nil); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("truncated tar: %v, want ErrInvalid", err)
	}
	good := makeTar(t, rootfsTar, false)
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := s.BuildFromTar(cctx, mustRef(t, "base/cancel:1"), bytes.NewReader(good), BuildOptions{}, nil); !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled build: %v", err)
	}
	assertStagingClean(t, dir)
	if ls, _ := s.List(""); len(ls) != 0 {
		t.Errorf("catalog has %v", ls)
	}
}
