package image

import (
	"archive/tar"
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path"
	"slices"
	"strings"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// maxArchiveEntries bounds the entries of an image archive we index: a
// few per blob, and images have tens of layers.
const maxArchiveEntries = 100_000

// archive is an image archive on disk, indexed once so blobs can be read
// in any order straight from the file.
type archive struct {
	f       *os.File
	entries map[string]archiveEntry
}

type archiveEntry struct {
	off, size int64
	// link is the target of a symlink or hard link, as an archive path:
	// `docker save` stores a layer shared by two images once and links it.
	link   string
	sparse bool
}

// openArchive indexes the tar at p. Entry names only ever key the index;
// nothing of the archive itself is written to disk.
func openArchive(p string) (*archive, error) {
	f, err := os.Open(p)
	if err != nil {
		return nil, err
	}
	a := &archive{f: f, entries: map[string]archiveEntry{}}
	if err := a.index(); err != nil {
		f.Close()
		return nil, err
	}
	return a, nil
}

func (a *archive) Close() error { return a.f.Close() }

func (a *archive) index() error {
	var magic [2]byte
	if n, _ := a.f.ReadAt(magic[:], 0); n == 2 && magic[0] == 0x1f && magic[1] == 0x8b {
		return errdefs.Invalid("archive is gzip-compressed: decompress it first")
	}
	cr := &offsetReader{f: a.f}
	tr := tar.NewReader(cr)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil && err != tar.ErrInsecurePath {
			return errdefs.Invalid("reading archive: %v", err)
		}
		if len(a.entries) >= maxArchiveEntries {
			return errdefs.Invalid("archive has more than %d entries", maxArchiveEntries)
		}
		name := archivePath(hdr.Name)
		switch hdr.Typeflag {
		case tar.TypeReg, tar.TypeRegA, tar.TypeGNUSparse:
			sparse := hdr.Typeflag == tar.TypeGNUSparse
			for k := range hdr.PAXRecords {
				sparse = sparse || strings.HasPrefix(k, "GNU.sparse.")
			}
			a.entries[name] = archiveEntry{off: cr.off, size: hdr.Size, sparse: sparse}
		case tar.TypeSymlink:
			target := hdr.Linkname
			if !strings.HasPrefix(target, "/") {
				target = path.Join(path.Dir(name), target)
			}
			a.entries[name] = archiveEntry{link: archivePath(target)}
		case tar.TypeLink:
			a.entries[name] = archiveEntry{link: archivePath(hdr.Linkname)}
		}
	}
	return nil
}

// archivePath cleans an archive path; ".." cannot climb above the top.
func archivePath(p string) string {
	return strings.TrimPrefix(path.Clean("/"+p), "/")
}

// open returns the content of the archive file name, following links.
func (a *archive) open(name string) (*io.SectionReader, error) {
	name = archivePath(name)
	for range 16 {
		e, ok := a.entries[name]
		switch {
		case !ok:
			return nil, errdefs.Invalid("%s is missing from the archive", name)
		case e.link != "":
			name = e.link
		case e.sparse:
			return nil, errdefs.Invalid("%s is a sparse file, which image archives do not use", name)
		default:
			return io.NewSectionReader(a.f, e.off, e.size), nil
		}
	}
	return nil, errdefs.Invalid("%s: too many levels of links", name)
}

func (a *archive) has(name string) bool { _, ok := a.entries[name]; return ok }

func (a *archive) readSmall(name string) ([]byte, error) {
	r, err := a.open(name)
	if err != nil {
		return nil, err
	}
	if r.Size() > maxManifestBytes {
		return nil, errdefs.Invalid("%s is larger than %d bytes", name, maxManifestBytes)
	}
	return io.ReadAll(r)
}

// blob opens the blob d: by its path in a `docker save` archive, else at
// blobs/sha256/<hex>. The digest was checked, so it cannot climb.
func (a *archive) blob(d descriptor) (*io.SectionReader, error) {
	name := d.path
	if name == "" {
		if err := checkDigest(d.Digest); err != nil {
			return nil, err
		}
		name = "blobs/sha256/" + digestHex(d.Digest)
	}
	r, err := a.open(name)
	if err != nil {
		return nil, fmt.Errorf("blob %s: %w", d, err)
	}
	if r.Size() != d.Size {
		return nil, errdefs.Invalid("blob %s: %d bytes in the archive, descriptor says %d", d, r.Size(), d.Size)
	}
	return r, nil
}

func (a *archive) manifest(_ context.Context, d descriptor) ([]byte, string, error) {
	r, err := a.blob(d)
	if err != nil {
		return nil, "", err
	}
	b, err := readVerified(r, d, maxManifestBytes)
	return b, "", err
}

func (a *archive) config(_ context.Context, d descriptor) ([]byte, error) {
	r, err := a.blob(d)
	if err != nil {
		return nil, err
	}
	return readVerified(r, d, maxManifestBytes)
}

func (a *archive) layer(_ context.Context, d descriptor) (io.ReadCloser, error) {
	r, err := a.blob(d)
	if err != nil {
		return nil, err
	}
	return io.NopCloser(r), nil
}

// verifyLayers checks every layer blob that has a digest before anything
// is written, so a tampered archive is refused without leaving a half-built
// tree. (The applier checks again as it reads; that costs one more hash.)
func (a *archive) verifyLayers(ctx context.Context, layers []descriptor) error {
	for _, d := range layers {
		r, err := a.blob(d)
		if err != nil {
			return err
		}
		if d.Digest == "" {
			continue
		}
		h := sha256.New()
		if _, err := io.Copy(h, &ctxReader{ctx: ctx, r: r}); err != nil {
			return fmt.Errorf("verifying layer %s: %w", d, err)
		}
		if got := sumString(h); got != d.Digest {
			return errdefs.Invalid("layer %s: blob has digest %s", d, got)
		}
	}
	return nil
}

// image picks the image to unpack: OCI layouts first (Docker 25+ writes
// both an OCI layout and a manifest.json, and the layout has digests).
func (a *archive) image(ctx context.Context, name string, want platform) (*resolved, error) {
	switch {
	case a.has("index.json"):
		return a.ociImage(ctx, name, want)
	case a.has("manifest.json"):
		return a.dockerImage(name, want)
	}
	return nil, errdefs.Invalid("neither an OCI image layout (no index.json) nor a docker save archive (no manifest.json)")
}

// Annotations naming an image in an OCI layout's index.json.
const (
	annotationRefName   = "org.opencontainers.image.ref.name"
	annotationImageName = "io.containerd.image.name"
)

func (a *archive) ociImage(ctx context.Context, name string, want platform) (*resolved, error) {
	if a.has("oci-layout") {
		b, err := a.readSmall("oci-layout")
		if err != nil {
			return nil, err
		}
		var layout struct {
			Version string `json:"imageLayoutVersion"`
		}
		if err := json.Unmarshal(b, &layout); err != nil {
			return nil, errdefs.Invalid("parsing oci-layout: %v", err)
		}
		if layout.Version != "1.0.0" {
			return nil, errdefs.Invalid("unsupported OCI layout version %q", layout.Version)
		}
	}
	b, err := a.readSmall("index.json")
	if err != nil {
		return nil, err
	}
	idx, err := parseManifest(b)
	if err != nil {
		return nil, fmt.Errorf("index.json: %w", err)
	}
	cands := idx.Manifests
	if name != "" {
		var names []string
		cands = nil
		for _, d := range idx.Manifests {
			ref, full := d.Annotations[annotationRefName], d.Annotations[annotationImageName]
			if ref == name || full == name {
				cands = append(cands, d)
			}
			if ref != "" {
				names = append(names, ref)
			}
		}
		if len(cands) == 0 {
			return nil, errdefs.NotFound("no image named %q in the archive; it has: %s", name, strings.Join(names, ", "))
		}
	}
	var d descriptor
	switch {
	case len(cands) == 0:
		return nil, errdefs.Invalid("index.json lists no images")
	case len(cands) == 1:
		d = cands[0]
	case slices.ContainsFunc(cands, func(d descriptor) bool { return d.Platform != nil }):
		// A multi-platform image copied to a layout lists its platforms
		// here, without a nested index.
		if d, err = selectPlatform(cands, want); err != nil {
			return nil, err
		}
	default:
		var names []string
		for _, d := range cands {
			names = append(names, d.Annotations[annotationRefName])
		}
		return nil, errdefs.Invalid("archive holds %d images; pick one by name: %q", len(cands), names)
	}
	return resolveImage(ctx, a, d, want)
}

// dockerImage reads a `docker save` archive: manifest.json names a config
// file and layer files by path. Paths of the form blobs/sha256/<hex>
// (Docker 25+) or <hex>.json (older configs) give digests to check; other
// layers are checked through the config's diff_ids alone, which is what
// Docker itself does on load.
func (a *archive) dockerImage(name string, want platform) (*resolved, error) {
	b, err := a.readSmall("manifest.json")
	if err != nil {
		return nil, err
	}
	var images []struct {
		Config   string
		RepoTags []string
		Layers   []string
	}
	if err := json.Unmarshal(b, &images); err != nil {
		return nil, errdefs.Invalid("parsing manifest.json: %v", err)
	}
	var picked []int
	var tags []string
	for i, im := range images {
		tags = append(tags, im.RepoTags...)
		if name == "" || slices.Contains(im.RepoTags, name) {
			picked = append(picked, i)
		}
	}
	switch {
	case len(images) == 0:
		return nil, errdefs.Invalid("manifest.json lists no images")
	case len(picked) == 0:
		return nil, errdefs.NotFound("no image tagged %q in the archive; it has: %s", name, strings.Join(tags, ", "))
	case len(picked) > 1:
		return nil, errdefs.Invalid("archive holds %d images; pick one by tag: %s", len(picked), strings.Join(tags, ", "))
	}
	im := images[picked[0]]

	cfgDesc, err := a.pathDescriptor(im.Config)
	if err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	if cfgDesc.Digest == "" {
		if hexPart, ok := strings.CutSuffix(path.Base(cfgDesc.path), ".json"); ok && checkDigest("sha256:"+hexPart) == nil {
			cfgDesc.Digest = "sha256:" + hexPart
		}
	}
	cb, err := a.config(context.Background(), cfgDesc)
	if err != nil {
		return nil, fmt.Errorf("reading config %s: %w", cfgDesc, err)
	}
	cfg, err := parseConfig(cb)
	if err != nil {
		return nil, err
	}
	img := &resolved{platform: want, config: cfg}
	for _, l := range im.Layers {
		d, err := a.pathDescriptor(l)
		if err != nil {
			return nil, fmt.Errorf("layer: %w", err)
		}
		img.layers = append(img.layers, d)
	}
	if err := img.check(); err != nil {
		return nil, err
	}
	return img, nil
}

// pathDescriptor describes the archive file p, with its digest when the
// path is blobs/sha256/<hex>.
func (a *archive) pathDescriptor(p string) (descriptor, error) {
	p = archivePath(p)
	r, err := a.open(p)
	if err != nil {
		return descriptor{}, err
	}
	d := descriptor{path: p, Size: r.Size()}
	if hexPart, ok := strings.CutPrefix(p, "blobs/sha256/"); ok {
		if err := checkDigest("sha256:" + hexPart); err != nil {
			return descriptor{}, err
		}
		d.Digest = "sha256:" + hexPart
	}
	return d, nil
}

// offsetReader tracks the offset archive/tar has reached in the file, which
// is where an entry's data starts once Next returns its header: archive/tar
// reads exactly what it decodes. Seek lets it skip data without reading.
type offsetReader struct {
	f   *os.File
	off int64
}

func (o *offsetReader) Read(b []byte) (int, error) {
	n, err := o.f.ReadAt(b, o.off)
	o.off += int64(n)
	if err == io.EOF && n > 0 {
		err = nil
	}
	return n, err
}

func (o *offsetReader) Seek(offset int64, whence int) (int64, error) {
	switch whence {
	case io.SeekCurrent:
		offset += o.off
	case io.SeekEnd:
		fi, err := o.f.Stat()
		if err != nil {
			return 0, err
		}
		offset += fi.Size()
	}
	if offset < 0 {
		return 0, errdefs.Invalid("seeking before the start of the archive")
	}
	o.off = offset
	return offset, nil
}
