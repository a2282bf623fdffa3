package image

import (
	"archive/tar"
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// Every test here attacks the applier with a crafted image and then checks
// the sentinel tree next to the destination (fixture.checkOutside): the
// attack must be refused with ErrInvalid or contained inside dest.

func TestHostileNamesRefused(t *testing.T) {
	for _, name := range []string{
		"../evil",
		"a/../../evil",
		"./../evil",
		"a/b/../../../evil",
	} {
		t.Run(name, func(t *testing.T) {
			f := newFixture(t)
			_, err := f.unpackLayers(t, Options{}, layerTar(t, file(name, "pwned")))
			wantClass(t, err, errdefs.ErrInvalid)
			f.checkOutside(t)
		})
	}
}

func TestHostileAbsoluteNamesContained(t *testing.T) {
	f := newFixture(t)
	_, err := f.unpackLayers(t, Options{}, layerTar(t,
		file("/abs", "inside"),
		file(f.secret, "inside too"),
		dir("//etc/"),
		file("/etc/passwd", "root:x:0:0:image"),
	))
	must(t, err)
	if readFile(t, f.path("abs")) != "inside" || readFile(t, f.path(f.secret)) != "inside too" {
		t.Error("absolute names were not placed under dest")
	}
	f.checkOutside(t)
}

// A symlink planted by one layer (or earlier in the same layer) must not
// carry a later entry out of the tree: it resolves as the image's own
// filesystem would, clamped at the image root.
func TestHostileSymlinkEscapes(t *testing.T) {
	cases := []struct {
		name   string
		link   func(f *fixture) entry
		write  string
		landed string // where the write must land, relative to dest
	}{
		{"absolute to host dir", func(f *fixture) entry { return symlink("etc", f.outside) }, "etc/secret", "OUTSIDE/secret"},
		{"absolute to host root", func(f *fixture) entry { return symlink("root", "/") }, "root/OUTSIDE/secret", "OUTSIDE/secret"},
		{"dotdot climb", func(f *fixture) entry { return symlink("up", strings.Repeat("../", 30)) }, "up/OUTSIDE/secret", "OUTSIDE/secret"},
		{"dangling to /host/etc", func(f *fixture) entry { return symlink("etc", "/host/etc") }, "etc/passwd", "host/etc/passwd"},
		{"relative dotdot in subdir", func(f *fixture) entry { return symlink("a/b", "../../../../outside") }, "a/b/secret", "outside/secret"},
		{"chain of links", func(f *fixture) entry { return symlink("l1", "l2/../../../") }, "l1/x", "x"},
		{"proc magic link", func(f *fixture) entry { return symlink("p", "/proc/self/root") }, "p/OUTSIDE/secret", "proc/self/root/OUTSIDE/secret"},
	}
	for _, tc := range cases {
		for _, sameLayer := range []bool{false, true} {
			name := tc.name + map[bool]string{false: "/two layers", true: "/one layer"}[sameLayer]
			t.Run(name, func(t *testing.T) {
				f := newFixture(t)
				write := strings.ReplaceAll(tc.write, "OUTSIDE", strings.TrimPrefix(f.outside, "/"))
				landed := strings.ReplaceAll(tc.landed, "OUTSIDE", strings.TrimPrefix(f.outside, "/"))
				extra := []entry{symlink("l2", "sub/..")} // for the chain case
				var layers [][]byte
				if sameLayer {
					layers = [][]byte{layerTar(t, append(extra, tc.link(f), file(write, "pwned"))...)}
				} else {
					layers = [][]byte{layerTar(t, append(extra, tc.link(f))...), layerTar(t, file(write, "pwned"))}
				}
				_, err := f.unpackLayers(t, Options{}, layers...)
				if err != nil {
					// Refusing is acceptable too, but only as ErrInvalid.
					wantClass(t, err, errdefs.ErrInvalid)
				} else if got := readFile(t, f.path(landed)); got != "pwned" {
					t.Errorf("write landed elsewhere: %s = %q", landed, got)
				}
				if got := readFile(t, f.secret); got != secretContent {
					t.Fatalf("host secret overwritten: %q", got)
				}
				f.checkOutside(t)
			})
		}
	}
}

func TestHostileHardLinks(t *testing.T) {
	t.Run("relative outside", func(t *testing.T) {
		f := newFixture(t)
		_, err := f.unpackLayers(t, Options{}, layerTar(t, hardlink("l", "../../outside/secret")))
		wantClass(t, err, errdefs.ErrInvalid)
		f.checkOutside(t)
	})
	t.Run("absolute host path", func(t *testing.T) {
		f := newFixture(t)
		_, err := f.unpackLayers(t, Options{}, layerTar(t, hardlink("l", f.secret)))
		wantClass(t, err, errdefs.ErrInvalid) // no such file inside the image
		f.checkOutside(t)
	})
	t.Run("through a symlinked directory", func(t *testing.T) {
		f := newFixture(t)
		_, err := f.unpackLayers(t, Options{},
			layerTar(t, symlink("host", f.outside)),
			layerTar(t, hardlink("l", "host/secret")))
		wantClass(t, err, errdefs.ErrInvalid) // host/secret resolves inside, where it is missing
		f.checkOutside(t)
	})
	t.Run("to a symlink pointing outside", func(t *testing.T) {
		f := newFixture(t)
		_, err := f.unpackLayers(t, Options{},
			layerTar(t, symlink("s", f.secret), hardlink("l", "s")),
			// Writing over the link's name must replace it, not write
			// through it to the host.
			layerTar(t, file("l", "pwned")))
		must(t, err)
		if target, err := os.Readlink(f.path("s")); err != nil || target != f.secret {
			t.Errorf("s -> %q, %v", target, err)
		}
		if readFile(t, f.path("l")) != "pwned" {
			t.Error("l was not replaced")
		}
		f.checkOutside(t)
	})
	t.Run("kept as a link to the symlink", func(t *testing.T) {
		f := newFixture(t)
		_, err := f.unpackLayers(t, Options{}, layerTar(t, symlink("s", f.secret), hardlink("l", "s")))
		must(t, err)
		fi, err := os.Lstat(f.path("l"))
		must(t, err)
		if fi.Mode()&os.ModeSymlink == 0 {
			t.Errorf("l is %v, want the symlink itself", fi.Mode())
		}
		f.checkOutside(t)
	})
	t.Run("to a directory", func(t *testing.T) {
		f := newFixture(t)
		_, err := f.unpackLayers(t, Options{}, layerTar(t, dir("d/"), hardlink("l", "d")))
		wantClass(t, err, errdefs.ErrInvalid)
	})
}

func TestHostileWhiteouts(t *testing.T) {
	for _, name := range []string{".wh..", ".wh...", "a/.wh..", "a/.wh...", "../.wh.x", ".wh."} {
		t.Run(name, func(t *testing.T) {
			f := newFixture(t)
			_, err := f.unpackLayers(t, Options{},
				layerTar(t, file("a/keep", "keep"), file("keep", "keep")),
				layerTar(t, whiteoutEntry(name)))
			wantClass(t, err, errdefs.ErrInvalid)
			f.checkOutside(t)
		})
	}
	t.Run("whiteout through a symlink to the host", func(t *testing.T) {
		f := newFixture(t)
		_, err := f.unpackLayers(t, Options{},
			layerTar(t, symlink("host", f.outside), symlink("up", "../../../../..")),
			layerTar(t,
				whiteoutEntry("host/.wh.secret"),
				whiteoutEntry("host/.wh.etc"),
				whiteoutEntry("up/"+strings.TrimPrefix(f.outside, "/")+"/.wh.secret"),
				file("host/.wh..wh..opq", "")))
		must(t, err)
		f.checkOutside(t)
	})
	t.Run("whiteout of a symlink deletes the link only", func(t *testing.T) {
		f := newFixture(t)
		_, err := f.unpackLayers(t, Options{},
			layerTar(t, symlink("host", f.outside)),
			layerTar(t, whiteoutEntry(".wh.host")))
		must(t, err)
		if _, err := os.Lstat(f.path("host")); !os.IsNotExist(err) {
			t.Errorf("host link still there: %v", err)
		}
		f.checkOutside(t)
	})
	t.Run("opaque marker at the root", func(t *testing.T) {
		f := newFixture(t)
		_, err := f.unpackLayers(t, Options{},
			layerTar(t, file("old", "old"), symlink("host", f.outside)),
			layerTar(t, file(".wh..wh..opq", ""), file("new", "new")))
		must(t, err)
		if _, err := os.Lstat(f.path("old")); !os.IsNotExist(err) {
			t.Errorf("old survived the opaque root: %v", err)
		}
		f.checkOutside(t)
	})
}

func TestHostileDevicesStayInside(t *testing.T) {
	needRoot(t, "creates device nodes")
	f := newFixture(t)
	_, err := f.unpackLayers(t, Options{},
		layerTar(t, symlink("dev", f.outside)),
		layerTar(t, device(tar.TypeChar, "dev/null", 1, 3), device(tar.TypeBlock, "dev/sda", 8, 0)))
	must(t, err)
	inside := f.path(filepath.Join(f.outside, "null"))
	if fi, err := os.Lstat(inside); err != nil || fi.Mode()&os.ModeCharDevice == 0 {
		t.Errorf("device not created inside at %s: %v %v", inside, fi, err)
	}
	f.checkOutside(t)
}

func TestHostileHugeHeaderSize(t *testing.T) {
	f := newFixture(t)
	// A header claiming a terabyte, followed by nothing: refused by the
	// limit before a byte is written, not by running out of disk.
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	h := own(tar.Header{Typeflag: tar.TypeReg, Name: "huge", Mode: 0o644, Size: 1 << 40})
	must(t, tw.WriteHeader(&h))
	raw := buf.Bytes() // no data, no end marker
	_, err := f.unpackLayers(t, Options{MaxBytes: 1 << 30}, raw)
	wantClass(t, err, errdefs.ErrInvalid)
	if _, err := os.Lstat(f.path("huge")); !os.IsNotExist(err) {
		t.Errorf("huge was created: %v", err)
	}
	f.checkOutside(t)
}

func TestHostileTruncatedLastEntry(t *testing.T) {
	f := newFixture(t)
	full := layerTar(t, file("a", "complete"), file("b", strings.Repeat("b", 4096)))
	// Cut inside b's data. The image's digests are computed over the cut
	// stream, so only the tar reader can notice.
	cut := full[:512+512+512+1000]
	_, err := f.unpackLayers(t, Options{}, cut)
	wantClass(t, err, errdefs.ErrInvalid)
	if !strings.Contains(err.Error(), "truncated") {
		t.Errorf("error does not say truncated: %v", err)
	}
	f.checkOutside(t)
}

// Archive-level attacks: the blobs and documents, not the layer contents.

func TestHostileBlobDigestMismatch(t *testing.T) {
	f := newFixture(t)
	img := buildImage(t, "amd64", false, layerTar(t, file("a", "good")))
	// Same name and size, different content.
	d := sha(img.layers[0])
	evil := layerTar(t, file("a", "evil"))
	if len(evil) != len(img.layers[0]) {
		t.Fatalf("test needs equal sizes: %d vs %d", len(evil), len(img.layers[0]))
	}
	img.blobs[d] = evil
	p := ociLayout(t, filepath.Join(t.TempDir(), "image.tar"), img)
	_, err := Unpack(t.Context(), p, f.dest, Options{})
	wantClass(t, err, errdefs.ErrInvalid)
	if names, _ := os.ReadDir(f.dest); len(names) != 0 {
		t.Errorf("dest touched before the digest check: %v", names)
	}
	f.checkOutside(t)
}

func TestHostileDiffIDMismatch(t *testing.T) {
	f := newFixture(t)
	img := buildImage(t, "amd64", true, layerTar(t, file("a", "good")))
	var cfg map[string]any
	must(t, json.Unmarshal(img.config, &cfg))
	cfg["rootfs"] = map[string]any{"type": "layers", "diff_ids": []string{sha([]byte("something else"))}}
	img = rebuildWithConfig(t, img, mustJSON(t, cfg))
	p := ociLayout(t, filepath.Join(t.TempDir(), "image.tar"), img)
	_, err := Unpack(t.Context(), p, f.dest, Options{})
	wantClass(t, err, errdefs.ErrInvalid)
	if !strings.Contains(err.Error(), "diff_id") {
		t.Errorf("error does not mention the diff_id: %v", err)
	}
}

// rebuildWithConfig swaps img's config blob and rewrites its manifest.
func rebuildWithConfig(t *testing.T, img *testImage, cfg []byte) *testImage {
	t.Helper()
	var m manifest
	must(t, json.Unmarshal(img.blobs[img.manifest.Digest], &m))
	delete(img.blobs, img.manifest.Digest)
	delete(img.blobs, sha(img.config))
	img.config = cfg
	img.blobs[sha(cfg)] = cfg
	m.Config.Digest, m.Config.Size = sha(cfg), int64(len(cfg))
	m.MediaType = mediaOCIManifest
	mb := mustJSON(t, m)
	img.blobs[sha(mb)] = mb
	img.manifest = descriptor{MediaType: mediaOCIManifest, Digest: sha(mb), Size: int64(len(mb)), Platform: img.manifest.Platform}
	img.top = img.manifest
	return img
}

func TestHostileMissingBlob(t *testing.T) {
	for _, which := range []string{"layer", "config", "manifest"} {
		t.Run(which, func(t *testing.T) {
			f := newFixture(t)
			img := buildImage(t, "amd64", true, layerTar(t, file("a", "a")))
			switch which {
			case "layer":
				delete(img.blobs, sha(img.layers[0]))
			case "config":
				delete(img.blobs, sha(img.config))
			case "manifest":
				delete(img.blobs, img.manifest.Digest)
			}
			p := ociLayout(t, filepath.Join(t.TempDir(), "image.tar"), img)
			_, err := Unpack(t.Context(), p, f.dest, Options{})
			wantClass(t, err, errdefs.ErrInvalid)
			if !strings.Contains(err.Error(), "missing") {
				t.Errorf("error does not say missing: %v", err)
			}
			f.checkOutside(t)
		})
	}
}

func TestHostileDigestTraversal(t *testing.T) {
	for _, bad := range []string{"sha256:../../x", "sha256:../../../../etc/passwd", "sha512:" + strings.Repeat("a", 128), "sha256:" + strings.Repeat("A", 64), "../x"} {
		t.Run(bad, func(t *testing.T) {
			f := newFixture(t)
			// The index points at the bad digest; put a file at the path it
			// would reach, so following it would find something.
			files := []archiveFile{
				{"oci-layout", []byte(`{"imageLayoutVersion":"1.0.0"}`)},
				{"index.json", mustJSON(t, map[string]any{"schemaVersion": 2, "manifests": []descriptor{{MediaType: mediaOCIManifest, Digest: bad, Size: 2}}})},
				{"x", []byte("{}")},
				{"etc/passwd", []byte("{}")},
			}
			p := writeArchive(t, filepath.Join(t.TempDir(), "image.tar"), files)
			_, err := Unpack(t.Context(), p, f.dest, Options{})
			wantClass(t, err, errdefs.ErrInvalid)
			f.checkOutside(t)
		})
	}
	t.Run("layer digest", func(t *testing.T) {
		img := buildImage(t, "amd64", true, layerTar(t, file("a", "a")))
		var m manifest
		must(t, json.Unmarshal(img.blobs[img.manifest.Digest], &m))
		m.Layers[0].Digest = "sha256:../../../x"
		m.MediaType = mediaOCIManifest
		mb := mustJSON(t, m)
		img.blobs[sha(mb)] = mb
		img.top = descriptor{MediaType: mediaOCIManifest, Digest: sha(mb), Size: int64(len(mb))}
		p := ociLayout(t, filepath.Join(t.TempDir(), "image.tar"), img)
		_, err := Unpack(t.Context(), p, t.TempDir(), Options{})
		wantClass(t, err, errdefs.ErrInvalid)
	})
}

func TestHostileTruncatedArchive(t *testing.T) {
	img := buildImage(t, "amd64", false, layerTar(t, file("a", strings.Repeat("a", 10000))))
	layer := img.layers[0]
	files := []archiveFile{
		{"oci-layout", []byte(`{"imageLayoutVersion":"1.0.0"}`)},
		{"index.json", mustJSON(t, map[string]any{"schemaVersion": 2, "manifests": []descriptor{img.top}})},
		{"blobs/sha256/" + digestHex(img.manifest.Digest), img.blobs[img.manifest.Digest]},
		{"blobs/sha256/" + digestHex(sha(img.config)), img.config},
		{"blobs/sha256/" + digestHex(sha(layer)), layer}, // last, to be cut
	}
	p := writeArchive(t, filepath.Join(t.TempDir(), "image.tar"), files)
	b, err := os.ReadFile(p)
	must(t, err)
	// Cut the outer archive in the middle of the layer blob.
	must(t, os.WriteFile(p, b[:len(b)-1024-len(layer)/2], 0o600))
	_, err = Unpack(t.Context(), p, t.TempDir(), Options{})
	wantClass(t, err, errdefs.ErrInvalid)
}

func TestHostileNotAnArchive(t *testing.T) {
	p := filepath.Join(t.TempDir(), "x.tar")
	must(t, os.WriteFile(p, bytes.Repeat([]byte("junk"), 1000), 0o600))
	_, err := Unpack(t.Context(), p, t.TempDir(), Options{})
	wantClass(t, err, errdefs.ErrInvalid)
	q := writeArchive(t, filepath.Join(t.TempDir(), "y.tar"), []archiveFile{{"hello", []byte("hi")}})
	_, err = Unpack(t.Context(), q, t.TempDir(), Options{})
	wantClass(t, err, errdefs.ErrInvalid)
}
