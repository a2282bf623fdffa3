package image

import (
	"archive/tar"
	"context"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// docSource serves fuzzed documents without checking digests, so that the
// fuzzer reaches the parsing and checks behind them: the top descriptor
// gets idx, any other manifest man, any config cfg, all with the media
// type the transport states.
type docSource struct {
	top            descriptor
	idx, man, cfg  []byte
	transportType  string
	manifestsAsked int
}

func (s *docSource) manifest(_ context.Context, d descriptor) ([]byte, string, error) {
	s.manifestsAsked++
	if d.Digest == s.top.Digest {
		return s.idx, s.transportType, nil
	}
	return s.man, s.transportType, nil
}

func (s *docSource) config(context.Context, descriptor) ([]byte, error) { return s.cfg, nil }

func (s *docSource) layer(context.Context, descriptor) (io.ReadCloser, error) {
	return nil, errdefs.Invalid("no layers here")
}

func wantClasses(t *testing.T, what string, err error, codes ...string) {
	t.Helper()
	if code := errdefs.Code(err); !slices.Contains(codes, code) {
		t.Fatalf("%s: error %q is %s, want one of %v", what, err, code, codes)
	}
}

// FuzzResolveImage resolves an image from a fuzzed top document (index or
// manifest), a fuzzed manifest for whatever it points to, and a fuzzed
// config, for a fuzzed platform. Nothing may panic and refusals are
// Invalid or NotFound. A resolved image has valid digests for its config,
// layers and diff_ids, one diff_id per layer, no negative sizes, and is
// for the platform asked; indexes nest at most twice.
func FuzzResolveImage(f *testing.F) {
	layers := [][]byte{[]byte("layer one"), []byte("layer two")}
	cfg := mustJSON(f, map[string]any{"os": "linux", "architecture": "amd64",
		"config": map[string]any{"Env": []string{"A=1"}, "User": "1000"},
		"rootfs": map[string]any{"type": "layers", "diff_ids": []string{sha(layers[0]), sha(layers[1])}}})
	var descs []descriptor
	for _, l := range layers {
		descs = append(descs, descriptor{MediaType: "application/vnd.oci.image.layer.v1.tar+gzip", Digest: sha(l), Size: int64(len(l))})
	}
	man := mustJSON(f, map[string]any{"schemaVersion": 2, "mediaType": mediaOCIManifest,
		"config": descriptor{Digest: sha(cfg), Size: int64(len(cfg))}, "layers": descs})
	idx := mustJSON(f, map[string]any{"schemaVersion": 2, "mediaType": mediaOCIIndex, "manifests": []descriptor{
		{Digest: sha([]byte("arm")), Size: 3, Platform: &platform{OS: "linux", Architecture: "arm", Variant: "v7"}},
		{Digest: sha([]byte("att")), Size: 3, Platform: &platform{OS: "unknown", Architecture: "unknown"}},
		{Digest: sha(man), Size: int64(len(man)), Platform: &platform{OS: "linux", Architecture: "amd64"}},
	}})
	f.Add(idx, man, cfg, "", "")
	f.Add(man, man, cfg, "linux/amd64", "")
	f.Add(idx, idx, cfg, "linux/arm/v7", mediaDockerList)
	f.Add([]byte(`{"schemaVersion":2,"manifests":[]}`), man, cfg, "linux/arm64/v8", "")
	f.Add([]byte(`{"schemaVersion":1,"fsLayers":[]}`), man, cfg, "", mediaDockerSigned)
	f.Add([]byte(`{"config":{"digest":"sha256:../../etc/passwd"},"layers":[{"digest":"md5:x","size":-1}]}`), man, cfg, "linux", "")
	f.Add(man, man, []byte(`{"os":"windows","architecture":"amd64","rootfs":{"diff_ids":["sha256:ABC"]}}`), "", "")
	f.Add([]byte(`{"mediaType":"text/plain"}`), []byte(`null`), []byte(`[]`), "/", mediaDockerV2)
	f.Fuzz(func(t *testing.T, idx, man, cfg []byte, plat, transportType string) {
		want, err := parsePlatform(plat)
		if err != nil {
			wantClasses(t, "parsing the platform", err, "invalid_argument")
			return
		}
		if again, err := parsePlatform(want.String()); err != nil || again != want {
			t.Fatalf("platform %q parses as %+v, written %q parses as %+v, %v", plat, want, want.String(), again, err)
		}
		src := &docSource{top: descriptor{Digest: sha(idx), Size: int64(len(idx))}, idx: idx, man: man, cfg: cfg, transportType: transportType}
		img, err := resolveImage(t.Context(), src, src.top, want)
		if src.manifestsAsked > 3 {
			t.Fatalf("%d manifests read: indexes nest more than twice", src.manifestsAsked)
		}
		if err != nil {
			wantClasses(t, "resolving", err, "invalid_argument", "not_found")
			return
		}
		if len(img.layers) != len(img.config.RootFS.DiffIDs) {
			t.Fatalf("resolved %d layers for %d diff_ids", len(img.layers), len(img.config.RootFS.DiffIDs))
		}
		for i, l := range img.layers {
			if checkDigest(l.Digest) != nil || l.Size < 0 || checkDigest(img.config.RootFS.DiffIDs[i]) != nil {
				t.Fatalf("resolved layer %+v, diff_id %q", l, img.config.RootFS.DiffIDs[i])
			}
		}
		c := img.config
		if img.platform != want || c.OS != "" && !want.matches(platform{OS: c.OS, Architecture: c.Architecture, Variant: c.Variant}) {
			t.Fatalf("resolved an image for %s/%s (%v), want %v", c.OS, c.Architecture, img.platform, want)
		}
	})
}

// FuzzParseReference parses a fuzzed registry reference. A parsed
// reference writes out to a string that parses back to itself; its parts
// are safe in URL paths (no empty, "." or ".." segments, no query or
// escape characters); it has a tag or a digest; and a Docker Hub
// repository has its namespace ("library/" for official images) whether
// or not the reference named the registry.
func FuzzParseReference(f *testing.F) {
	dg := "sha256:" + strings.Repeat("ab", 32)
	for _, s := range []string{
		"alpine", "alpine:3.20", "user/app:v1", "docker.io/alpine", "docker.io/library/alpine:3.20",
		"ghcr.io/org/app/sub:1.0", "127.0.0.1:5000/x:y", "localhost/x", "localhost:5000/a/b@" + dg,
		"r.io/a:t@" + dg, "r.io/my_app__x.y-z", "[::1]:5000/a", "r.io/../x", "r.io/a:b/c", "r.io/a%2f..",
		"r.io/a?x=1", "a b/c", "r.io/a@sha256:../../x", "r.io/a:",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		r, err := ParseReference(s)
		if err != nil {
			wantClasses(t, "parsing", err, "invalid_argument")
			return
		}
		if again, err := ParseReference(r.String()); err != nil || again != r {
			t.Fatalf("%q parses as %+v, written %q parses as %+v, %v", s, r, r.String(), again, err)
		}
		for _, seg := range strings.Split(r.Repository, "/") {
			if seg == "" || seg == "." || seg == ".." {
				t.Fatalf("%q: repository %q has segment %q", s, r.Repository, seg)
			}
		}
		if strings.ContainsAny(r.String(), "?#%\\ \t\n") {
			t.Fatalf("%q: reference %q is not safe in a URL path", s, r.String())
		}
		if r.Tag == "" && r.Digest == "" || r.Digest != "" && checkDigest(r.Digest) != nil {
			t.Fatalf("%q: tag %q, digest %q", s, r.Tag, r.Digest)
		}
		if r.Registry == dockerHub && !strings.Contains(r.Repository, "/") {
			t.Fatalf("%q: Docker Hub repository %q has no namespace", s, r.Repository)
		}
	})
}

// hostileBase is a first layer that plants links out of the image root:
// to the host directory by absolute path, to "/", climbing with "..",
// relative from a subdirectory, and through /proc.
func hostileBase(t testing.TB, f *fixture) []byte {
	return layerTar(t,
		symlink("etc", f.outside),
		symlink("root", "/"),
		symlink("up", strings.Repeat("../", 12)),
		dir("a"),
		symlink("a/b", "../../../../outside"),
		symlink("p", "/proc/self/root"),
		dir("d"),
		file("d/f", "inside"),
		hardlink("d/h", "d/f"),
	)
}

// unlockTree gives every directory below root its owner's permissions
// back, so that a non-root test can remove what a layer left unreadable.
func unlockTree(roots ...string) {
	for _, root := range roots {
		filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
			if d != nil && d.IsDir() {
				os.Chmod(p, 0o700)
			}
			return nil
		})
	}
}

// FuzzUnpackLayer unpacks an image whose first layer plants links out of
// the root and whose second layer is fuzzed, as a plain tree or (split)
// as an overlayfs upper directory over the first. Nothing may panic; a
// refusal is classified, never internal; and nothing outside the
// destination and upper directory changes, whatever the layer does
// through the links, whiteouts, opaque markers and hard links.
func FuzzUnpackLayer(f *testing.F) {
	for _, l := range [][]byte{
		layerTar(f, file("etc/secret", "pwned"), file("root/etc/passwd", "pwned"), file("up/x", "pwned")),
		layerTar(f, file("a/b/secret", "pwned"), file("p/etc/x", "pwned"), symlink("d/x", "../up"), file("d/x/y", "pwned")),
		layerTar(f, whiteoutEntry("etc/.wh.secret"), whiteoutEntry("d/.wh.f"), whiteoutEntry("root/.wh.etc"), file("etc/.wh..wh..opq", "")),
		layerTar(f, hardlink("l1", "etc/secret"), hardlink("l2", "d/h"), hardlink("l3", "root/etc/passwd"), hardlink("l4", "up/tmp")),
		layerTar(f, dir("etc"), file("root", "not a link now"), dir("d/f"), file("d/.wh..wh..opq", "")),
		layerTar(f, device(tar.TypeChar, "dev/null", 1, 3), device(tar.TypeFifo, "etc/fifo", 0, 0), device(tar.TypeBlock, "up/sda", 8, 0)),
		gz(f, layerTar(f, fileMode("d/suid", "x", 0o4755), dir("d"))),
		[]byte("\x28\xb5\x2f\xfd junk"),
		layerTar(f, file("big", strings.Repeat("x", 3000)))[:1536],
		nil,
	} {
		f.Add(l, false)
		f.Add(l, true)
	}
	f.Fuzz(func(t *testing.T, layer []byte, split bool) {
		if split && os.Geteuid() != 0 {
			return // an upper directory's opaque markers are trusted.* xattrs
		}
		fx := newFixture(t)
		t.Cleanup(func() { unlockTree(fx.dest, fx.upper) })
		img := buildImage(t, "amd64", false, hostileBase(t, fx), layer)
		p := ociLayout(t, filepath.Join(t.TempDir(), "image.tar"), img)
		opts := Options{MaxBytes: 1 << 20, MaxFiles: 256}
		if split {
			opts.SplitAt, opts.UpperDir = 1, fx.upper
		}
		if _, err := Unpack(t.Context(), p, fx.dest, opts); err != nil && errdefs.Code(err) == "internal" {
			t.Fatalf("unclassified error %q", err)
		}
		fx.checkOutside(t)
	})
}

// FuzzUnpackArchive unpacks a fuzzed image archive (OCI layout or docker
// save tar) and picks a fuzzed name from it. Nothing may panic, a refusal
// is classified, never internal, and nothing outside the destination
// changes.
func FuzzUnpackArchive(f *testing.F) {
	tmp := f.TempDir()
	img := buildImage(f, "amd64", false,
		layerTar(f, dir("etc"), file("etc/hostname", "box"), symlink("l", "/")),
		layerTar(f, file("l/etc/x", "y"), whiteoutEntry("etc/.wh.hostname")))
	other := buildImage(f, "arm64", true, layerTar(f, file("arm", "x")))
	for i, p := range []string{
		ociLayout(f, filepath.Join(tmp, "oci.tar"), img),
		ociLayout(f, filepath.Join(tmp, "multi.tar"), multiArch(f, img, other)),
		dockerSave(f, filepath.Join(tmp, "docker.tar"), img),
	} {
		b, err := os.ReadFile(p)
		must(f, err)
		f.Add(b, []string{"", "test", "example.com/test:1"}[i])
	}
	f.Add([]byte("\x1f\x8b"), "")
	f.Add(make([]byte, 1024), "")
	f.Fuzz(func(t *testing.T, archive []byte, name string) {
		fx := newFixture(t)
		t.Cleanup(func() { unlockTree(fx.dest) })
		p := filepath.Join(t.TempDir(), "image.tar")
		must(t, os.WriteFile(p, archive, 0o600))
		if _, err := Unpack(t.Context(), p, fx.dest, Options{Name: name, MaxBytes: 1 << 20, MaxFiles: 256}); err != nil && errdefs.Code(err) == "internal" {
			t.Fatalf("unclassified error %q", err)
		}
		fx.checkOutside(t)
	})
}
