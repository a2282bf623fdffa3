package image

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// Defaults for Options limits left at zero: the layer store's own, since
// what Unpack writes is sealed by it.
const (
	DefaultMaxBytes = 32 << 30
	DefaultMaxFiles = 2_000_000
)

// Options tune Unpack and Pull.
type Options struct {
	// Platform is "os/arch[/variant]" to pick from a multi-arch index;
	// "" is linux/amd64.
	Platform string
	// Name picks one image from an archive holding several: a `docker
	// save` RepoTag ("alpine:3.20") or an OCI layout's ref name annotation
	// ("3.20", or the full name containerd writes). Pull ignores it.
	Name string
	// SplitAt, when positive, puts layers [0, SplitAt) into the
	// destination as a plain tree and layers [SplitAt, n) into UpperDir as
	// an overlayfs upper directory over it, holding only their changes
	// (whiteouts as 0:0 character devices, opaque directories marked with
	// trusted.overlay.opaque="y"). Needs root for the trusted xattr.
	SplitAt  int
	UpperDir string
	// MergeUnder, when positive, cuts the image into runs of consecutive
	// layers whose sizes as stored (compressed in a registry) add up to at
	// most MergeUnder bytes, bottom first (GroupLayers; a larger layer is
	// a run alone). The first run goes into the destination as a plain
	// tree; each later run into a fresh directory under UpperDir as an
	// overlayfs upper directory over the runs below it. Every run's tree
	// but the last is handed to Sealed as soon as it is complete, and may
	// change once Sealed returns; the last is left in place and named by
	// Result.Top. Exclusive with SplitAt; needs root, as SplitAt does.
	MergeUnder int64
	Sealed     func(run, runs int, dir string) error
	// MaxBytes bounds the regular-file bytes written and MaxFiles the tar
	// entries read, over all layers; zero means DefaultMaxBytes and
	// DefaultMaxFiles. They stop decompression bombs cleanly.
	MaxBytes int64
	MaxFiles int
	// Progress, if set, receives a few human-readable lines per layer.
	Progress io.Writer
}

func (o *Options) check() error {
	switch {
	case o.SplitAt < 0:
		return errdefs.Invalid("split point %d is negative", o.SplitAt)
	case o.SplitAt > 0 && o.UpperDir == "":
		return errdefs.Invalid("a split point needs an upper directory")
	case o.SplitAt > 0 && o.MergeUnder != 0:
		return errdefs.Invalid("give a split point or a merge threshold, not both")
	case o.MergeUnder < 0:
		return errdefs.Invalid("merge threshold %d is negative", o.MergeUnder)
	case o.MergeUnder > 0 && (o.UpperDir == "" || o.Sealed == nil):
		return errdefs.Invalid("a merge threshold needs an upper directory and a Sealed function")
	case o.SplitAt == 0 && o.MergeUnder == 0 && o.UpperDir != "":
		return errdefs.Invalid("an upper directory needs a positive split point or a merge threshold")
	case o.MaxBytes < 0 || o.MaxFiles < 0:
		return errdefs.Invalid("negative limit")
	}
	if _, err := parsePlatform(o.Platform); err != nil {
		return err
	}
	if o.MaxBytes == 0 {
		o.MaxBytes = DefaultMaxBytes
	}
	if o.MaxFiles == 0 {
		o.MaxFiles = DefaultMaxFiles
	}
	return nil
}

// resolved is an image chosen and checked down to its layer list.
type resolved struct {
	digest   string // manifest digest; "" for docker save archives
	platform platform
	config   *imageConfig
	layers   []descriptor
}

// source is where an image's documents and blobs come from: an archive on
// disk or a registry.
type source interface {
	// manifest returns the manifest or index d, checked against d's
	// digest and size, and the media type the transport states ("" if
	// none).
	manifest(ctx context.Context, d descriptor) ([]byte, string, error)
	// config returns the config blob d, checked against d.
	config(ctx context.Context, d descriptor) ([]byte, error)
	// layer opens the layer blob d. Its digest is checked by the applier
	// as it reads.
	layer(ctx context.Context, d descriptor) (io.ReadCloser, error)
}

// resolveImage follows d (a manifest, or an index to pick want from) to
// an image and reads its config. Everything is checked against its
// digest, and the config's diff_ids against the layer count, before any
// layer is touched.
func resolveImage(ctx context.Context, src source, d descriptor, want platform) (*resolved, error) {
	for depth := 0; ; depth++ {
		if depth > 2 {
			return nil, errdefs.Invalid("indexes nested more than twice")
		}
		if err := checkDigest(d.Digest); err != nil {
			return nil, err
		}
		b, transportType, err := src.manifest(ctx, d)
		if err != nil {
			return nil, fmt.Errorf("reading manifest %s: %w", d.Digest, err)
		}
		m, err := parseManifest(b)
		if err != nil {
			return nil, err
		}
		mt := d.MediaType
		if mt == "" {
			mt = transportType
		}
		isIndex, err := m.isIndex(mt)
		if err != nil {
			return nil, err
		}
		if isIndex {
			if d, err = selectPlatform(m.Manifests, want); err != nil {
				return nil, err
			}
			continue
		}
		if err := checkDigest(m.Config.Digest); err != nil {
			return nil, fmt.Errorf("reading manifest %s: config: %w", d.Digest, err)
		}
		for _, l := range m.Layers {
			if err := checkDigest(l.Digest); err != nil {
				return nil, fmt.Errorf("reading manifest %s: layer: %w", d.Digest, err)
			}
			if l.Size < 0 {
				return nil, errdefs.Invalid("reading manifest %s: layer %s has negative size", d.Digest, l.Digest)
			}
		}
		cb, err := src.config(ctx, m.Config)
		if err != nil {
			return nil, fmt.Errorf("reading config %s: %w", m.Config.Digest, err)
		}
		cfg, err := parseConfig(cb)
		if err != nil {
			return nil, err
		}
		img := &resolved{digest: d.Digest, platform: want, config: cfg, layers: m.Layers}
		if err := img.check(); err != nil {
			return nil, err
		}
		return img, nil
	}
}

// check compares the config with the layer list and the wanted platform.
func (img *resolved) check() error {
	cfg := img.config
	if cfg.OS != "" && !img.platform.matches(platform{OS: cfg.OS, Architecture: cfg.Architecture, Variant: cfg.Variant}) {
		return errdefs.NotFound("image is for %s/%s, not %s", cfg.OS, cfg.Architecture, img.platform)
	}
	if len(cfg.RootFS.DiffIDs) != len(img.layers) {
		return errdefs.Invalid("config lists %d diff_ids for %d layers", len(cfg.RootFS.DiffIDs), len(img.layers))
	}
	for _, id := range cfg.RootFS.DiffIDs {
		if err := checkDigest(id); err != nil {
			return fmt.Errorf("config diff_ids: %w", err)
		}
	}
	return nil
}

// Unpack unpacks the image in the archive at path — an OCI image layout
// tar (oci-layout, index.json, blobs/sha256/...) or a `docker save` tar
// (manifest.json) — into dest, an existing empty directory that becomes
// the image's root. See Options for picking an image and platform and for
// splitting it into a base tree and an overlay upper.
//
// Every manifest, config and layer blob is checked against its digest
// before dest is touched; each layer's uncompressed stream is checked
// against the config's diff_id as it is applied. A hostile or damaged
// image is errdefs.ErrInvalid (a missing platform ErrNotFound); on any
// error dest (and UpperDir) are left partial and the caller discards them.
// Needs root unless every file of the image is owned by the caller.
func Unpack(ctx context.Context, path, dest string, opts Options) (*Result, error) {
	if err := opts.check(); err != nil {
		return nil, fmt.Errorf("unpacking %s: %w", path, err)
	}
	want, _ := parsePlatform(opts.Platform)
	a, err := openArchive(path)
	if err != nil {
		return nil, fmt.Errorf("unpacking %s: %w", path, err)
	}
	defer a.Close()
	img, err := a.image(ctx, opts.Name, want)
	if err != nil {
		return nil, fmt.Errorf("unpacking %s: %w", path, err)
	}
	if err := a.verifyLayers(ctx, img.layers); err != nil {
		return nil, fmt.Errorf("unpacking %s: %w", path, err)
	}
	res, err := applyImage(ctx, img, a, dest, opts)
	if err != nil {
		return nil, fmt.Errorf("unpacking %s: %w", path, err)
	}
	return res, nil
}

// runs is how opts cut img's layers: one run of all of them, the two of
// a split point, or the runs of a merge threshold.
func (o *Options) runs(layers []descriptor) []Group {
	n := len(layers)
	switch {
	case o.MergeUnder > 0 && n > 0:
		sizes := make([]int64, n)
		for i, d := range layers {
			sizes[i] = d.Size
		}
		return GroupLayers(sizes, o.MergeUnder)
	case o.SplitAt > 0 && o.SplitAt < n:
		return []Group{{Start: 0, End: o.SplitAt}, {Start: o.SplitAt, End: n}}
	}
	return []Group{{Start: 0, End: n}}
}

// applyImage applies img's layers from src onto dest (and under
// opts.UpperDir), run by run (Options.runs).
//
// Run k > 0 is an upper directory over the plain tree of runs [0, k), so
// with more than two runs the plain tree must grow run by run: once run k's
// upper is sealed, its layers are applied again onto the plain tree (read
// twice from src, verified twice), which is then the lower of run k+1.
func applyImage(ctx context.Context, img *resolved, src source, dest string, opts Options) (*Result, error) {
	res := &Result{Digest: img.digest, Platform: img.platform.String(), Config: img.config.public(), Top: dest}
	root, err := openEmptyDir(dest)
	if err != nil {
		return nil, err
	}
	defer unix.Close(root)
	// dest becomes the image's root: a root directory's mode, and the
	// fixed date of undescribed directories, unless a layer says otherwise.
	if err := initRoot(root); err != nil {
		return nil, err
	}
	runs := opts.runs(img.layers)
	res.Runs = runs
	a := &applier{root: root, lower: -1, maxBytes: opts.MaxBytes, maxFiles: opts.MaxFiles}
	for i := runs[0].Start; i < runs[0].End; i++ {
		if err := applyOne(ctx, a, src, img, i, res, opts.Progress); err != nil {
			return nil, err
		}
	}
	last := a
	for k := 1; k < len(runs); k++ {
		if err := seal(opts, k-1, len(runs), res.Top); err != nil {
			return nil, err
		}
		if k > 1 {
			// Run k-1's upper is sealed: fold its layers into the plain
			// tree, the lower of run k, and drop the upper.
			for i := runs[k-1].Start; i < runs[k-1].End; i++ {
				if err := applyOne(ctx, a, src, img, i, nil, opts.Progress); err != nil {
					return nil, err
				}
			}
			if err := os.RemoveAll(res.Top); err != nil {
				return nil, fmt.Errorf("removing sealed run: %w", err)
			}
		}
		dir := opts.UpperDir
		if opts.MergeUnder > 0 {
			dir = filepath.Join(opts.UpperDir, "run-"+strconv.Itoa(k))
			if err := os.Mkdir(dir, 0o700); err != nil {
				return nil, fmt.Errorf("preparing upper directory: %w", err)
			}
		}
		upper, err := openEmptyDir(dir)
		if err != nil {
			return nil, err
		}
		// The upper's root overrides the lower's in the overlay: it starts
		// as a copy, which upper layers may change like any directory.
		if _, err := copyMeta(root, ".", upper, "."); err != nil {
			unix.Close(upper)
			return nil, fmt.Errorf("preparing upper directory: %w", err)
		}
		up := &applier{root: upper, lower: root, maxBytes: opts.MaxBytes, maxFiles: opts.MaxFiles,
			files: a.files, bytes: a.bytes}
		for i := runs[k].Start; i < runs[k].End; i++ {
			if err := applyOne(ctx, up, src, img, i, res, opts.Progress); err != nil {
				unix.Close(upper)
				return nil, err
			}
		}
		unix.Close(upper)
		res.Top, last = dir, up
	}
	res.Files, res.Bytes = last.files, last.bytes
	return res, nil
}

// seal hands run's finished tree to opts.Sealed, if the runs are merged.
func seal(opts Options, run, runs int, dir string) error {
	if opts.Sealed == nil {
		return nil
	}
	return opts.Sealed(run, runs, dir)
}

// applyOne applies layer i of img with a and checks its digests; res, if
// not nil, records it (nil: a layer applied again, see applyImage).
func applyOne(ctx context.Context, a *applier, src source, img *resolved, i int, res *Result, progress io.Writer) error {
	d := img.layers[i]
	start := time.Now()
	verb := "applying"
	if res == nil {
		verb = "folding into the tree below the next run:"
	}
	printf(progress, "%s layer %d/%d %s (%s)\n", verb, i+1, len(img.layers), d, humanBytes(d.Size))
	rc, err := src.layer(ctx, d)
	if err != nil {
		return fmt.Errorf("reading layer %s: %w", d, err)
	}
	digest, diffID, n, err := a.applyLayer(ctx, rc)
	rc.Close()
	if err != nil {
		return fmt.Errorf("applying layer %s: %w", d, err)
	}
	if d.Digest != "" && digest != d.Digest {
		return errdefs.Invalid("applying layer %s: blob has digest %s", d, digest)
	}
	if want := img.config.RootFS.DiffIDs[i]; diffID != want {
		return errdefs.Invalid("applying layer %s: uncompressed stream has digest %s, config's diff_id is %s", d, diffID, want)
	}
	if res == nil {
		return nil
	}
	res.Layers = append(res.Layers, Layer{Digest: digest, DiffID: diffID, MediaType: d.MediaType, Size: d.Size, UnpackedSize: n})
	printf(progress, "applied layer %d/%d: %s uncompressed in %s\n", i+1, len(img.layers), humanBytes(n), time.Since(start).Round(time.Millisecond))
	return nil
}

// openEmptyDir opens the directory at p, which must be empty.
func openEmptyDir(p string) (int, error) {
	fd, err := unix.Open(p, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("opening destination %s: %w", p, err)
	}
	names, err := readDirNames(fd)
	if err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("opening destination %s: %w", p, err)
	}
	if len(names) > 0 {
		unix.Close(fd)
		return -1, errdefs.Precondition("destination %s is not empty", p)
	}
	return fd, nil
}

func initRoot(fd int) error {
	if err := unix.Fchmodat(fd, ".", 0o755, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("preparing destination: %w", err)
	}
	ts := unix.NsecToTimespec(unknownMTime.UnixNano())
	if err := unix.UtimesNanoAt(fd, ".", []unix.Timespec{ts, ts}, 0); err != nil {
		return fmt.Errorf("preparing destination: %w", err)
	}
	return nil
}

func printf(w io.Writer, format string, args ...any) {
	if w != nil {
		fmt.Fprintf(w, format, args...)
	}
}

func humanBytes(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}
