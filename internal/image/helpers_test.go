package image

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// testTime dates the test images' entries.
var testTime = time.Date(2021, 3, 4, 5, 6, 7, 0, time.UTC)

type entry struct {
	hdr  tar.Header
	body string
}

// Entries are owned by the test's own uid and gid, so that tests not
// about ownership run without root too.
func own(h tar.Header) tar.Header {
	h.Uid, h.Gid = os.Getuid(), os.Getgid()
	if h.ModTime.IsZero() {
		h.ModTime = testTime
	}
	h.Format = tar.FormatPAX
	return h
}

func file(name, body string) entry {
	return entry{hdr: own(tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: 0o644, Size: int64(len(body))}), body: body}
}

func fileMode(name, body string, mode int64) entry {
	e := file(name, body)
	e.hdr.Mode = mode
	return e
}

func dir(name string) entry {
	return entry{hdr: own(tar.Header{Typeflag: tar.TypeDir, Name: name, Mode: 0o755})}
}

func symlink(name, target string) entry {
	return entry{hdr: own(tar.Header{Typeflag: tar.TypeSymlink, Name: name, Linkname: target, Mode: 0o777})}
}

func hardlink(name, target string) entry {
	return entry{hdr: own(tar.Header{Typeflag: tar.TypeLink, Name: name, Linkname: target, Mode: 0o644})}
}

func device(typ byte, name string, major, minor int64) entry {
	return entry{hdr: own(tar.Header{Typeflag: typ, Name: name, Mode: 0o666, Devmajor: major, Devminor: minor})}
}

// whiteoutEntry is how layer tars spell a deletion: an empty file.
func whiteoutEntry(name string) entry { return file(name, "") }

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func layerTar(t testing.TB, entries ...entry) []byte {
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

func sha(b []byte) string {
	s := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(s[:])
}

// testImage is an image built in memory: blobs by digest plus the
// descriptor of its top manifest (or index).
type testImage struct {
	blobs    map[string][]byte
	top      descriptor
	manifest descriptor // the linux/amd64 manifest
	// manifests lists the manifests below an index, to push before it.
	manifests []descriptor
	config    []byte
	layers    [][]byte // blobs, in order
	diffIDs   []string
}

var testConfig = Config{
	Env:        []string{"PATH=/usr/bin:/bin", "LANG=C.UTF-8"},
	WorkingDir: "/work",
	User:       "1000:1000",
	Entrypoint: []string{"/bin/sh", "-c"},
	Cmd:        []string{"echo hi"},
	Labels:     map[string]string{"org.example": "yes"},
}

// buildImage builds a one-platform image from uncompressed layer tars,
// gzipping them when compress is set.
func buildImage(t testing.TB, arch string, compress bool, tars ...[]byte) *testImage {
	t.Helper()
	img := &testImage{blobs: map[string][]byte{}}
	var layerDescs []descriptor
	for _, raw := range tars {
		blob, mt := raw, "application/vnd.oci.image.layer.v1.tar"
		if compress {
			blob, mt = gz(t, raw), "application/vnd.oci.image.layer.v1.tar+gzip"
		}
		img.layers = append(img.layers, blob)
		img.diffIDs = append(img.diffIDs, sha(raw))
		img.blobs[sha(blob)] = blob
		layerDescs = append(layerDescs, descriptor{MediaType: mt, Digest: sha(blob), Size: int64(len(blob))})
	}
	cfg := map[string]any{
		"architecture": arch,
		"os":           "linux",
		"config": map[string]any{
			"Env": testConfig.Env, "WorkingDir": testConfig.WorkingDir, "User": testConfig.User,
			"Entrypoint": testConfig.Entrypoint, "Cmd": testConfig.Cmd, "Labels": testConfig.Labels,
		},
		"rootfs": map[string]any{"type": "layers", "diff_ids": img.diffIDs},
	}
	img.config = mustJSON(t, cfg)
	img.blobs[sha(img.config)] = img.config
	m := map[string]any{
		"schemaVersion": 2,
		"mediaType":     mediaOCIManifest,
		"config":        descriptor{MediaType: "application/vnd.oci.image.config.v1+json", Digest: sha(img.config), Size: int64(len(img.config))},
		"layers":        layerDescs,
	}
	mb := mustJSON(t, m)
	img.blobs[sha(mb)] = mb
	img.manifest = descriptor{MediaType: mediaOCIManifest, Digest: sha(mb), Size: int64(len(mb)),
		Platform: &platform{OS: "linux", Architecture: arch}}
	img.top = img.manifest
	return img
}

// multiArch builds an index over an arm64 image (of other) and img.
func multiArch(t testing.TB, img, other *testImage) *testImage {
	t.Helper()
	out := &testImage{blobs: map[string][]byte{}, manifest: img.manifest, config: img.config, layers: img.layers, diffIDs: img.diffIDs}
	for _, src := range []*testImage{img, other} {
		for d, b := range src.blobs {
			out.blobs[d] = b
		}
	}
	idx := mustJSON(t, map[string]any{
		"schemaVersion": 2,
		"mediaType":     mediaOCIIndex,
		"manifests":     []descriptor{other.manifest, img.manifest},
	})
	out.blobs[sha(idx)] = idx
	out.top = descriptor{MediaType: mediaOCIIndex, Digest: sha(idx), Size: int64(len(idx))}
	out.manifests = []descriptor{other.manifest, img.manifest}
	return out
}

func mustJSON(t testing.TB, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	must(t, err)
	return b
}

// archiveFile is one file of an image archive.
type archiveFile struct {
	name string
	data []byte
}

func writeArchive(t testing.TB, p string, files []archiveFile) string {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, f := range files {
		must(t, tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: f.name, Mode: 0o644, Size: int64(len(f.data)), ModTime: testTime}))
		_, err := tw.Write(f.data)
		must(t, err)
	}
	must(t, tw.Close())
	must(t, os.WriteFile(p, buf.Bytes(), 0o600))
	return p
}

// ociLayout writes img as an OCI image layout tar.
func ociLayout(t testing.TB, p string, img *testImage) string {
	t.Helper()
	top := img.top
	top.Annotations = map[string]string{annotationRefName: "test"}
	files := []archiveFile{
		{"oci-layout", []byte(`{"imageLayoutVersion":"1.0.0"}`)},
		{"index.json", mustJSON(t, map[string]any{"schemaVersion": 2, "manifests": []descriptor{top}})},
	}
	digests := make([]string, 0, len(img.blobs))
	for d := range img.blobs {
		digests = append(digests, d)
	}
	slices.Sort(digests)
	for _, d := range digests {
		files = append(files, archiveFile{"blobs/sha256/" + digestHex(d), img.blobs[d]})
	}
	return writeArchive(t, p, files)
}

// dockerSave writes img (uncompressed layers) as the classic `docker save`
// tar: <hex>.json config, <n>/layer.tar layers, manifest.json.
func dockerSave(t testing.TB, p string, img *testImage) string {
	t.Helper()
	cfgName := digestHex(sha(img.config)) + ".json"
	files := []archiveFile{{cfgName, img.config}}
	var layers []string
	for i, l := range img.layers {
		name := fmt.Sprintf("%064d/layer.tar", i)
		files = append(files, archiveFile{name, l})
		layers = append(layers, name)
	}
	files = append(files, archiveFile{"manifest.json", mustJSON(t, []map[string]any{
		{"Config": cfgName, "RepoTags": []string{"example.com/test:1"}, "Layers": layers},
	})})
	return writeArchive(t, p, files)
}

// fixture is a destination next to a sentinel tree standing for the host:
// after an attack, nothing outside dest (and upper) may have changed.
type fixture struct {
	tmp     string
	dest    string
	upper   string
	outside string // host directory with a secret
	secret  string
	before  map[string]string
}

const secretContent = "TOP SECRET host content"

func newFixture(t *testing.T) *fixture {
	t.Helper()
	tmp := t.TempDir()
	parent := filepath.Join(tmp, "parent")
	must(t, os.Mkdir(parent, 0o700))
	f := &fixture{
		tmp:     tmp,
		dest:    filepath.Join(parent, "root"),
		upper:   filepath.Join(parent, "upper"),
		outside: filepath.Join(tmp, "outside"),
	}
	must(t, os.Mkdir(f.dest, 0o755))
	must(t, os.Mkdir(f.upper, 0o755))
	must(t, os.MkdirAll(filepath.Join(f.outside, "etc"), 0o755))
	f.secret = filepath.Join(f.outside, "secret")
	must(t, os.WriteFile(f.secret, []byte(secretContent), 0o644))
	must(t, os.WriteFile(filepath.Join(f.outside, "etc", "passwd"), []byte("root:x:0:0"), 0o644))
	must(t, os.Symlink("/", filepath.Join(f.outside, "slash")))
	f.before = f.snapshot(t)
	return f
}

// snapshot describes everything under tmp but dest and upper.
func (f *fixture) snapshot(t *testing.T) map[string]string {
	t.Helper()
	out := map[string]string{}
	err := filepath.WalkDir(f.tmp, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if p == f.dest || p == f.upper {
			return filepath.SkipDir
		}
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return err
		}
		desc := fmt.Sprintf("mode=%o uid=%d gid=%d size=%d", st.Mode, st.Uid, st.Gid, st.Size)
		if !d.IsDir() {
			desc += fmt.Sprintf(" mtime=%d.%d nlink=%d", st.Mtim.Sec, st.Mtim.Nsec, st.Nlink)
		}
		switch {
		case d.Type()&fs.ModeSymlink != 0:
			target, _ := os.Readlink(p)
			desc += " -> " + target
		case d.Type().IsRegular():
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			desc += " " + sha(b)
		}
		out[p] = desc
		return nil
	})
	must(t, err)
	return out
}

// checkOutside fails the test if anything outside dest changed.
func (f *fixture) checkOutside(t *testing.T) {
	t.Helper()
	after := f.snapshot(t)
	for p, d := range after {
		if b, ok := f.before[p]; !ok {
			t.Errorf("created outside the destination: %s (%s)", p, d)
		} else if b != d {
			t.Errorf("changed outside the destination: %s: %s -> %s", p, b, d)
		}
	}
	for p := range f.before {
		if _, ok := after[p]; !ok {
			t.Errorf("removed outside the destination: %s", p)
		}
	}
}

func (f *fixture) path(p string) string { return filepath.Join(f.dest, p) }

func wantClass(t *testing.T, err, class error) {
	t.Helper()
	if !errors.Is(err, class) {
		t.Fatalf("error = %v, want class %v", err, class)
	}
}

func readFile(t *testing.T, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	must(t, err)
	return string(b)
}

func needRoot(t *testing.T, why string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: " + why)
	}
}

// unpackLayers unpacks an OCI layout of the given uncompressed layers into
// f.dest.
func (f *fixture) unpackLayers(t *testing.T, opts Options, tars ...[]byte) (*Result, error) {
	t.Helper()
	img := buildImage(t, "amd64", true, tars...)
	p := ociLayout(t, filepath.Join(t.TempDir(), "image.tar"), img)
	return Unpack(t.Context(), p, f.dest, opts)
}

// describeTree lists every entry under root with its type, mode, owner,
// size, content, link target, device and user xattrs, one line each, for
// comparing trees.
func describeTree(t *testing.T, root string, withDirMtime bool) []string {
	t.Helper()
	var out []string
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return err
		}
		line := fmt.Sprintf("%s mode=%o uid=%d gid=%d", rel, st.Mode, st.Uid, st.Gid)
		if !d.IsDir() || withDirMtime {
			line += fmt.Sprintf(" mtime=%d", st.Mtim.Sec)
		}
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFREG:
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			line += fmt.Sprintf(" size=%d %s", st.Size, strings.TrimPrefix(sha(b), "sha256:")[:12])
		case unix.S_IFLNK:
			target, _ := os.Readlink(p)
			line += " -> " + target
		case unix.S_IFCHR, unix.S_IFBLK:
			line += fmt.Sprintf(" dev=%d:%d", unix.Major(st.Rdev), unix.Minor(st.Rdev))
		}
		if st.Mode&unix.S_IFMT != unix.S_IFLNK {
			names, _ := listXattrs(p)
			slices.Sort(names)
			for _, n := range names {
				if strings.HasPrefix(n, "trusted.") {
					continue
				}
				v, _ := getXattr(p, n)
				line += fmt.Sprintf(" %s=%q", n, v)
			}
		}
		out = append(out, line)
		return nil
	})
	must(t, err)
	return out
}

// readerFunc adapts a function to io.Reader.
type readerFunc func([]byte) (int, error)

func (f readerFunc) Read(b []byte) (int, error) { return f(b) }

var _ io.Reader = readerFunc(nil)

func isInvalid(err error) bool { return errors.Is(err, errdefs.ErrInvalid) }
