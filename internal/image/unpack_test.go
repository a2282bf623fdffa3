package image

import (
	"archive/tar"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// baseLayers is a small image exercising what layers do: files, a
// symlink, a hard link, a setuid file, xattrs, then a layer deleting,
// replacing and making a directory opaque.
func baseLayers(t *testing.T) [][]byte {
	t.Helper()
	x := file("etc/xattr", "x")
	x.hdr.PAXRecords = map[string]string{
		"SCHILY.xattr.user.origin":            "test",
		"SCHILY.xattr.trusted.overlay.opaque": "y", // must be dropped
	}
	l1 := layerTar(t,
		dir("./"),
		dir("etc/"),
		file("etc/hostname", "base\n"),
		file("etc/gone", "deleted later"),
		x,
		dir("opq/"),
		file("opq/old", "hidden later"),
		dir("opq/sub/"),
		file("opq/sub/deep", "hidden later"),
		dir("usr/"),
		dir("usr/bin/"),
		fileMode("usr/bin/su", "#!setuid", 0o4755),
		hardlink("usr/bin/su-link", "usr/bin/su"),
		symlink("bin", "usr/bin"),
		dir("tmp/"),
	)
	// Entries older than their directory are fine; the dir header is
	// applied last and keeps its own mtime.
	sticky := dir("tmp/")
	sticky.hdr.Mode = 0o1777
	l2 := layerTar(t,
		whiteoutEntry("etc/.wh.gone"),
		file("opq/.wh..wh..opq", ""),
		file("opq/new", "fresh"),
		file("bin/via-link", "written through the bin symlink"),
		sticky,
		file("etc/hostname", "top\n"),
	)
	return [][]byte{l1, l2}
}

func checkBaseTree(t *testing.T, root string) {
	t.Helper()
	p := func(s string) string { return filepath.Join(root, s) }
	if got := readFile(t, p("etc/hostname")); got != "top\n" {
		t.Errorf("etc/hostname = %q, want the upper layer's", got)
	}
	for _, gone := range []string{"etc/gone", "opq/old", "opq/sub"} {
		if _, err := os.Lstat(p(gone)); !os.IsNotExist(err) {
			t.Errorf("%s should have been deleted: %v", gone, err)
		}
	}
	if got := readFile(t, p("opq/new")); got != "fresh" {
		t.Errorf("opq/new = %q", got)
	}
	if got := readFile(t, p("usr/bin/via-link")); got != "written through the bin symlink" {
		t.Errorf("usr/bin/via-link = %q", got)
	}
	if target, err := os.Readlink(p("bin")); err != nil || target != "usr/bin" {
		t.Errorf("bin -> %q, %v", target, err)
	}
	var su, link unix.Stat_t
	must(t, unix.Lstat(p("usr/bin/su"), &su))
	must(t, unix.Lstat(p("usr/bin/su-link"), &link))
	if su.Mode&0o7777 != 0o4755 {
		t.Errorf("su mode = %o, want setuid 4755", su.Mode&0o7777)
	}
	if su.Ino != link.Ino {
		t.Error("su-link is not a hard link of su")
	}
	if su.Mtim.Sec != testTime.Unix() {
		t.Errorf("su mtime = %d, want %d", su.Mtim.Sec, testTime.Unix())
	}
	if int(su.Uid) != os.Getuid() {
		t.Errorf("su uid = %d, want %d", su.Uid, os.Getuid())
	}
	var tmp unix.Stat_t
	must(t, unix.Lstat(p("tmp"), &tmp))
	if tmp.Mode&0o7777 != 0o1777 {
		t.Errorf("tmp mode = %o, want sticky 1777", tmp.Mode&0o7777)
	}
	if v, _ := getXattr(p("etc/xattr"), "user.origin"); string(v) != "test" {
		t.Errorf("user.origin = %q, want test", v)
	}
	if names, _ := listXattrs(p("etc/xattr")); strings.Contains(strings.Join(names, ","), "trusted.") {
		t.Errorf("trusted xattr applied: %v", names)
	}
	var etc unix.Stat_t
	must(t, unix.Lstat(p("etc"), &etc))
	if etc.Mtim.Sec != testTime.Unix() {
		t.Errorf("etc mtime = %v, want the header's %v despite the upper layer's changes", time.Unix(etc.Mtim.Sec, 0), testTime)
	}
}

func TestUnpackOCILayoutMultiArch(t *testing.T) {
	f := newFixture(t)
	img := multiArch(t, buildImage(t, "amd64", true, baseLayers(t)...),
		buildImage(t, "arm64", true, layerTar(t, file("arm", "arm64 only"))))
	p := ociLayout(t, filepath.Join(t.TempDir(), "image.tar"), img)
	res, err := Unpack(t.Context(), p, f.dest, Options{})
	must(t, err)
	checkBaseTree(t, f.dest)
	if _, err := os.Lstat(f.path("arm")); !os.IsNotExist(err) {
		t.Error("the arm64 image was unpacked")
	}
	if !reflect.DeepEqual(res.Config, testConfig) {
		t.Errorf("config = %+v, want %+v", res.Config, testConfig)
	}
	if res.Digest != img.manifest.Digest || res.Platform != "linux/amd64" {
		t.Errorf("digest, platform = %s, %s; want %s, linux/amd64", res.Digest, res.Platform, img.manifest.Digest)
	}
	if len(res.Layers) != 2 {
		t.Fatalf("layers = %+v", res.Layers)
	}
	for i, l := range res.Layers {
		if l.Digest != sha(img.layers[i]) || l.DiffID != img.diffIDs[i] || l.Size != int64(len(img.layers[i])) || l.UnpackedSize == 0 {
			t.Errorf("layer %d = %+v", i, l)
		}
	}
	f.checkOutside(t)

	// Asking for a platform the index lacks names what it has.
	_, err = Unpack(t.Context(), p, t.TempDir(), Options{Platform: "linux/s390x"})
	wantClass(t, err, errdefs.ErrNotFound)
	if !strings.Contains(err.Error(), "linux/arm64") || !strings.Contains(err.Error(), "linux/amd64") {
		t.Errorf("error does not list the platforms: %v", err)
	}
	// And the arm64 one is there for the asking.
	arm := t.TempDir()
	_, err = Unpack(t.Context(), p, arm, Options{Platform: "linux/arm64"})
	must(t, err)
	if readFile(t, filepath.Join(arm, "arm")) != "arm64 only" {
		t.Error("arm64 image not unpacked")
	}
}

func TestUnpackDockerSave(t *testing.T) {
	f := newFixture(t)
	img := buildImage(t, "amd64", false, baseLayers(t)...)
	p := dockerSave(t, filepath.Join(t.TempDir(), "save.tar"), img)
	res, err := Unpack(t.Context(), p, f.dest, Options{})
	must(t, err)
	checkBaseTree(t, f.dest)
	if res.Digest != "" || !reflect.DeepEqual(res.Config, testConfig) || len(res.Layers) != 2 {
		t.Errorf("result = %+v", res)
	}
	if res.Layers[1].Digest != img.diffIDs[1] {
		t.Errorf("uncompressed layer digest = %s, want its diff_id %s", res.Layers[1].Digest, img.diffIDs[1])
	}
	// A tag the archive lacks is not found, and the error lists what it has.
	_, err = Unpack(t.Context(), p, t.TempDir(), Options{Name: "other:2"})
	wantClass(t, err, errdefs.ErrNotFound)
	if !strings.Contains(err.Error(), "example.com/test:1") {
		t.Errorf("error does not list the tags: %v", err)
	}
	f.checkOutside(t)
}

func TestUnpackRefusesWrongArchitecture(t *testing.T) {
	img := buildImage(t, "arm64", true, layerTar(t, file("a", "a")))
	p := ociLayout(t, filepath.Join(t.TempDir(), "image.tar"), img)
	_, err := Unpack(t.Context(), p, t.TempDir(), Options{})
	wantClass(t, err, errdefs.ErrNotFound)
}

func TestUnpackNeedsEmptyDestination(t *testing.T) {
	dest := t.TempDir()
	must(t, os.WriteFile(filepath.Join(dest, "x"), nil, 0o644))
	img := buildImage(t, "amd64", true, layerTar(t, file("a", "a")))
	p := ociLayout(t, filepath.Join(t.TempDir(), "image.tar"), img)
	_, err := Unpack(t.Context(), p, dest, Options{})
	wantClass(t, err, errdefs.ErrPrecondition)
}

func TestUnpackOptionsChecked(t *testing.T) {
	for _, o := range []Options{
		{SplitAt: -1},
		{SplitAt: 1},
		{UpperDir: "/x"},
		{Platform: "linux"},
		{MaxBytes: -1},
	} {
		_, err := Unpack(t.Context(), "/nonexistent", t.TempDir(), o)
		wantClass(t, err, errdefs.ErrInvalid)
	}
}

func TestUnpackDuplicateEntriesLaterWins(t *testing.T) {
	f := newFixture(t)
	_, err := f.unpackLayers(t, Options{}, layerTar(t,
		file("a", "one"),
		file("a", "two"),
		file("d", "a file first"),
		dir("d/"),
		file("d/x", "x"),
		dir("e/"),
		file("e/inner", "gone with the dir"),
		file("e", "a file now"),
		symlink("s", f.secret),
		file("s", "replaces the link, not written through it"),
	))
	must(t, err)
	for p, want := range map[string]string{
		"a": "two", "d/x": "x", "e": "a file now", "s": "replaces the link, not written through it",
	} {
		if got := readFile(t, f.path(p)); got != want {
			t.Errorf("%s = %q, want %q", p, got, want)
		}
	}
	if fi, err := os.Lstat(f.path("s")); err != nil || !fi.Mode().IsRegular() {
		t.Errorf("s should be a regular file: %v %v", fi, err)
	}
	f.checkOutside(t)
}

func TestUnpackLimits(t *testing.T) {
	t.Run("bytes", func(t *testing.T) {
		f := newFixture(t)
		big := strings.Repeat("\x00", 4<<20) // gzips to a few KiB
		_, err := f.unpackLayers(t, Options{MaxBytes: 1 << 20}, layerTar(t, file("bomb", big)))
		wantClass(t, err, errdefs.ErrInvalid)
		if fi, err := os.Stat(f.path("bomb")); err == nil {
			t.Errorf("bomb was written (%d bytes)", fi.Size())
		}
		f.checkOutside(t)
	})
	t.Run("bytes over layers", func(t *testing.T) {
		f := newFixture(t)
		half := strings.Repeat("y", 600<<10)
		_, err := f.unpackLayers(t, Options{MaxBytes: 1 << 20},
			layerTar(t, file("a", half)), layerTar(t, file("b", half)))
		wantClass(t, err, errdefs.ErrInvalid)
	})
	t.Run("files", func(t *testing.T) {
		f := newFixture(t)
		var es []entry
		for i := range 50 {
			es = append(es, file("f"+strings.Repeat("x", i), ""))
		}
		_, err := f.unpackLayers(t, Options{MaxFiles: 20}, layerTar(t, es...))
		wantClass(t, err, errdefs.ErrInvalid)
	})
}

func TestUnpackRefusesZstd(t *testing.T) {
	raw := layerTar(t, file("a", "a"))
	img := buildImage(t, "amd64", false, raw)
	// Swap the layer for bytes starting with zstd's magic; the digests
	// match, so only the format check can refuse it.
	zstd := append([]byte{0x28, 0xb5, 0x2f, 0xfd}, raw...)
	delete(img.blobs, sha(raw))
	img.blobs[sha(zstd)] = zstd
	var m manifest
	must(t, json.Unmarshal(img.blobs[img.manifest.Digest], &m))
	m.MediaType = mediaOCIManifest
	m.Layers[0] = descriptor{MediaType: "application/vnd.oci.image.layer.v1.tar+zstd", Digest: sha(zstd), Size: int64(len(zstd))}
	mb := mustJSON(t, m)
	delete(img.blobs, img.manifest.Digest)
	img.blobs[sha(mb)] = mb
	img.top = descriptor{MediaType: mediaOCIManifest, Digest: sha(mb), Size: int64(len(mb))}
	p := ociLayout(t, filepath.Join(t.TempDir(), "image.tar"), img)
	_, err := Unpack(t.Context(), p, t.TempDir(), Options{})
	wantClass(t, err, errdefs.ErrInvalid)
	if !strings.Contains(err.Error(), "zstd") {
		t.Errorf("error does not say zstd: %v", err)
	}
}

func TestUnpackContextCancelled(t *testing.T) {
	img := buildImage(t, "amd64", true, layerTar(t, file("a", "a")))
	p := ociLayout(t, filepath.Join(t.TempDir(), "image.tar"), img)
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	_, err := Unpack(ctx, p, t.TempDir(), Options{})
	if err == nil || !strings.Contains(err.Error(), "context canceled") {
		t.Fatalf("error = %v, want context canceled", err)
	}
}

func TestUnpackDevicesAndOwners(t *testing.T) {
	needRoot(t, "creates device nodes, chowns to other users, sets security.capability")
	f := newFixture(t)
	owned := file("home/user/file", "mine")
	owned.hdr.Uid, owned.hdr.Gid = 1234, 5678
	capped := fileMode("usr/bin/ping", "ping", 0o755)
	// v2 capability blob granting cap_net_raw (bit 13) permitted+effective.
	capped.hdr.PAXRecords = map[string]string{"SCHILY.xattr.security.capability": "\x01\x00\x00\x02\x00\x20\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00"}
	_, err := f.unpackLayers(t, Options{}, layerTar(t,
		device(tar.TypeChar, "dev/null", 1, 3),
		device(tar.TypeBlock, "dev/loop0", 7, 0),
		device(tar.TypeFifo, "run/fifo", 0, 0),
		owned,
		capped,
	))
	must(t, err)
	var st unix.Stat_t
	must(t, unix.Lstat(f.path("dev/null"), &st))
	if st.Mode&unix.S_IFMT != unix.S_IFCHR || unix.Major(st.Rdev) != 1 || unix.Minor(st.Rdev) != 3 {
		t.Errorf("dev/null: mode %o rdev %d:%d", st.Mode, unix.Major(st.Rdev), unix.Minor(st.Rdev))
	}
	must(t, unix.Lstat(f.path("dev/loop0"), &st))
	if st.Mode&unix.S_IFMT != unix.S_IFBLK || unix.Major(st.Rdev) != 7 {
		t.Errorf("dev/loop0: mode %o", st.Mode)
	}
	must(t, unix.Lstat(f.path("run/fifo"), &st))
	if st.Mode&unix.S_IFMT != unix.S_IFIFO {
		t.Errorf("run/fifo: mode %o", st.Mode)
	}
	must(t, unix.Lstat(f.path("home/user/file"), &st))
	if st.Uid != 1234 || st.Gid != 5678 {
		t.Errorf("owner = %d:%d, want 1234:5678", st.Uid, st.Gid)
	}
	if v, _ := getXattr(f.path("usr/bin/ping"), "security.capability"); len(v) != 20 {
		t.Errorf("security.capability = %x", v)
	}
	// Implicit parents are root's, 0755, and dated like the layer store's.
	must(t, unix.Lstat(f.path("home"), &st))
	if st.Uid != 0 || st.Mode&0o7777 != 0o755 || st.Mtim.Sec != unknownMTime.Unix() {
		t.Errorf("implicit dir: uid %d mode %o mtime %d", st.Uid, st.Mode&0o7777, st.Mtim.Sec)
	}
	f.checkOutside(t)
}
