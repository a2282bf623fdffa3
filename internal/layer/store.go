package layer

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/cleanup"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/store"
)

// catalogBucket holds ref string → JSON api.Layer.
const catalogBucket = "layers"

// Buckets are the store buckets of layers (the catalog, the indexes and
// blobs of layers read on demand). Edges of a cluster read them; the
// snapshots they pack are published by apiservers (Stage, Adopt).
var Buckets = []string{catalogBucket, indexBucket, blobsBucket}

// Defaults for BuildOptions limits left at zero.
const (
	DefaultMaxBytes = 32 << 30
	DefaultMaxFiles = 2_000_000
)

// Reproducibility knobs for mkfs.erofs 1.5. Without them two builds of the
// same tree differ in the superblock UUID and build time. A fixed UUID is
// harmless because file-backed mounts never look images up by UUID. The
// build time is fixed through SOURCE_DATE_EPOCH, which 1.5 treats as a
// clamp: mtimes newer than it are lowered to it. Clamping at 2100 fixes the
// build time while keeping every real file's mtime (with nanoseconds), which
// -T would have flattened — and flat mtimes make Python treat every .pyc as
// stale.
const (
	imageUUID        = "6473656c-6179-6572-0000-000000000000"
	defaultClampTime = 4102444800 // 2100-01-01T00:00:00Z
)

// unknownMTime replaces the mtimes a tar did not set (implicit parent
// directories, the staging root), so that the same tar yields the same
// digest. 1980-01-02 rather than 1970: zip (and so Python wheels) cannot
// store dates before 1980, in any time zone.
var unknownMTime = time.Date(1980, 1, 2, 0, 0, 0, 0, time.UTC)

// BuildOptions tune BuildFromDir and BuildFromTar.
type BuildOptions struct {
	// Compress is "" (none, the default: fastest to build and to read),
	// "lz4" or "lz4hc".
	Compress string
	// Replace lets a build re-point an existing ref; without it that is
	// errdefs.ErrAlreadyExists. The previous blob stays until GC.
	Replace bool
	// MayReplace, if set, is asked before an existing ref is re-pointed
	// (in the same compare-and-set as the write): an error refuses it.
	MayReplace func(old api.Layer) error
	// Project is recorded as the layer's owner (api.Layer.Project).
	Project string
	// MaxBytes and MaxFiles bound what a tar may extract to; zero means
	// DefaultMaxBytes and DefaultMaxFiles.
	MaxBytes int64
	MaxFiles int
	// SourceDateEpoch, if non-zero, clamps every mtime in the image to it
	// (seconds since 1970, the reproducible-builds convention). Zero keeps
	// mtimes as they are.
	SourceDateEpoch int64
	// Exclude lists paths of the tree (absolute, as seen from its root) to
	// leave out, with everything below them.
	Exclude []string
	// Snapshot is recorded in the catalog entry of a snapshot layer.
	Snapshot *api.SnapshotInfo
	// Image is recorded in the catalog entry of a base layer imported
	// from a container image (internal/image); sandboxes on the base take
	// their env, workdir and user defaults from it.
	Image *api.ImageConfig
	// Lowers are the digests of the layers a base layer sits on, bottom
	// first (api.Layer.Lowers): the runs of an image cut by a merge
	// threshold below its top run, each built with BuildBlob and pinned
	// by the caller until this build has named it.
	Lowers []string
	// LowersBytes is the size of the Lowers' images together, recorded
	// with them (api.Layer.LowersBytes).
	LowersBytes int64
}

// MaxLowers bounds BuildOptions.Lowers: with a workspace, toolkits and
// snapshots above, a sandbox's overlay must stay under the node's stack
// limit.
const MaxLowers = 31

// Store is the layer store: EROFS blobs named by digest under dir, and a
// catalog of refs in a store.Store. Several processes may share one dir
// and one store (the apiservers and edges of a cluster, the dir on a
// shared filesystem): each builds in a staging directory of its own, a
// blob is published by an atomic rename (content-addressed, so two
// publishers of one digest agree), and a blob is removed only under a
// mark in the store that no publisher holds a pin against (pins and
// marks are compare-and-set, like containerd's leases). Safe for
// concurrent use.
type Store struct {
	dir string
	st  store.Store
	log *slog.Logger
	// instance names this process's staging directory and its pins.
	instance string
	// stageRoot is where staging directories are: "staging", or
	// "outbox" for a node's store (NewNodeStore), which publishes
	// nothing.
	stageRoot string
	// stageLock holds the flock that tells other processes this
	// process's staging directory is in use.
	stageLock *os.File
	pinSeq    atomic.Uint64

	// mu serialises this process's publishing against its own Delete
	// and GC; across processes the blob records in the store do.
	mu sync.Mutex
	// cache holds the catalog when the store can be watched (nil: none).
	cache *catalogCache
}

// stageLockName is the lock file in a staging directory.
const stageLockName = ".lock"

// NewStore opens the layer store rooted at dir, creating its directories,
// and removes the staging directories that no live process holds (what
// interrupted builds left).
func NewStore(dir string, st store.Store, log *slog.Logger) (*Store, error) {
	return openStore(dir, st, log, stagingRoot)
}

// NewNodeStore opens the layer store of an edge of a cluster: it reads
// the catalog and the blobs, and stages the snapshots it packs (Stage)
// for an apiserver to publish (Adopt) in a directory of its own under
// outbox/, the only part of the layer directory it writes. It publishes
// and removes nothing (ErrNodeStore).
func NewNodeStore(dir string, st store.Store, log *slog.Logger) (*Store, error) {
	return openStore(dir, st, log, outboxRoot)
}

// The roots of the staging directories: of processes that publish, and
// of nodes (NewNodeStore).
const (
	stagingRoot = "staging"
	outboxRoot  = "outbox"
)

// ErrNodeStore is what a node's store answers a call that would publish
// or remove.
var ErrNodeStore = errdefs.Precondition("this node's layer store publishes nothing: an apiserver publishes the layers nodes stage")

// mayPublish refuses, for a node's store, what publishes or removes.
func (s *Store) mayPublish() error {
	if s.stageRoot == outboxRoot {
		return ErrNodeStore
	}
	return nil
}

func openStore(dir string, st store.Store, log *slog.Logger, stageRoot string) (*Store, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	dir, err := filepath.Abs(dir)
	if err != nil {
		return nil, fmt.Errorf("opening layer store: %w", err)
	}
	s := &Store{dir: dir, st: st, log: log, stageRoot: stageRoot}
	if err := os.MkdirAll(s.blobDir(), 0o755); err != nil {
		return nil, fmt.Errorf("opening layer store: %w", err)
	}
	// Staging holds extracted trees with setuid files and device nodes
	// before they are sealed into an image: nobody but root may enter.
	root := filepath.Join(s.dir, stageRoot)
	if err := os.MkdirAll(root, 0o700); err != nil {
		return nil, fmt.Errorf("opening layer store: %w", err)
	}
	if err := os.Chmod(root, 0o700); err != nil {
		return nil, fmt.Errorf("opening layer store: %w", err)
	}
	if n, err := sweepStaging(root); err != nil {
		return nil, fmt.Errorf("clearing stale staging: %w", err)
	} else if n > 0 {
		log.Info("cleared interrupted layer builds", "count", n)
	}
	if s.instance, s.stageLock, err = claimStaging(root); err != nil {
		return nil, fmt.Errorf("opening layer store: locking staging: %w", err)
	}
	return s, nil
}

// claimStaging makes this process's staging directory under root and
// returns its name with the held lock.
//
// Every process on a shared layer directory sweeps the staging root when
// it starts, so another one may remove the new directory between its
// mkdir and its lock (or take the lock first, to sweep it): the claim
// holds only when, with the lock taken, the lock file is still the one
// at the path. A lost race is retried under a new name.
func claimStaging(root string) (string, *os.File, error) {
	var lastErr error
	for range 8 {
		var idb [6]byte
		_, _ = rand.Read(idb[:])
		instance := hex.EncodeToString(idb[:])
		dir := filepath.Join(root, instance)
		if err := os.Mkdir(dir, 0o700); err != nil {
			if errors.Is(err, fs.ErrExist) {
				lastErr = err
				continue
			}
			return "", nil, err
		}
		lockPath := filepath.Join(dir, stageLockName)
		lock, err := os.OpenFile(lockPath, os.O_CREATE|os.O_RDWR, 0o600)
		if errors.Is(err, fs.ErrNotExist) {
			lastErr = err // swept before the lock was made
			continue
		}
		if err != nil {
			return "", nil, err
		}
		// Blocking: nobody else uses this fresh name, so only a sweeper
		// can hold the lock, and only while it removes the directory.
		if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil {
			lock.Close()
			return "", nil, err
		}
		if sameFile(lock, lockPath) {
			return instance, lock, nil
		}
		lock.Close()
		lastErr = fmt.Errorf("%s was removed by another process's sweep", dir)
	}
	return "", nil, fmt.Errorf("no staging directory could be claimed: %w", lastErr)
}

// sameFile reports whether path names the file f has open.
func sameFile(f *os.File, path string) bool {
	a, err := f.Stat()
	if err != nil {
		return false
	}
	b, err := os.Lstat(path)
	return err == nil && os.SameFile(a, b)
}

// sweepStaging removes the entries of the staging root that no live
// process holds: a directory whose lock can be taken, and anything else
// (what builds of earlier versions left). It counts those that held a
// build's files.
func sweepStaging(root string) (int, error) {
	left, err := os.ReadDir(root)
	if err != nil {
		return 0, err
	}
	n := 0
	for _, e := range left {
		p := filepath.Join(root, e.Name())
		if e.IsDir() {
			// The lock is taken (made, if the directory has none yet: its
			// owner may be between its mkdir and its lock) and held while
			// the directory is removed, so its owner, which checks the
			// lock file is still there once it holds the lock, knows.
			f, err := os.OpenFile(filepath.Join(p, stageLockName), os.O_CREATE|os.O_RDWR, 0o600)
			if errors.Is(err, fs.ErrNotExist) {
				continue // removed meanwhile by another sweep
			}
			if err != nil {
				return n, err
			}
			err = unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
			if errors.Is(err, unix.EWOULDBLOCK) {
				f.Close()
				continue // a live process builds there
			}
			// Only a directory holding more than its lock was a build
			// cut short; an idle process's, killed, held nothing.
			built := false
			if ents, rerr := os.ReadDir(p); rerr == nil {
				built = len(ents) > 1 || len(ents) == 1 && ents[0].Name() != stageLockName
			}
			if err == nil {
				err = os.RemoveAll(p)
			}
			f.Close()
			// ENOTEMPTY: another sweep made the lock file again in the
			// middle of this removal; that one removes the rest.
			if err != nil && !errors.Is(err, fs.ErrNotExist) && !errors.Is(err, unix.ENOTEMPTY) {
				return n, err
			}
			if built {
				n++
			}
			continue
		}
		if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return n, err
		}
		n++
	}
	return n, nil
}

// Close releases the staging directory (and removes it).
func (s *Store) Close() error {
	if s.stageLock == nil {
		return nil
	}
	err := os.RemoveAll(s.stagingDir())
	s.stageLock.Close()
	s.stageLock = nil
	return err
}

func (s *Store) blobDir() string    { return filepath.Join(s.dir, "blobs", "sha256") }
func (s *Store) stagingDir() string { return filepath.Join(s.dir, s.stageRoot, s.instance) }

// StagingDir is this process's root-only directory (0700) where builds
// keep their temporary files; whatever an interrupted build leaves there
// is removed at the next start of any process on the store. Importers
// stage there too.
func (s *Store) StagingDir() string { return s.stagingDir() }

// Staged lists what this process's staging directory holds besides its
// lock: builds and imports in progress, or what a failed one left (a bug).
func (s *Store) Staged() ([]string, error) {
	es, err := os.ReadDir(s.stagingDir())
	if err != nil {
		return nil, err
	}
	var out []string
	for _, e := range es {
		if e.Name() != stageLockName {
			out = append(out, e.Name())
		}
	}
	return out, nil
}

// Dir is the store's root directory. Importers may keep caches in
// subdirectories of their own (the image importer's "image-cache").
func (s *Store) Dir() string { return s.dir }

// BlobPath returns where the image with the given digest lives, or "" if
// digest is not a sha256 digest (so a caller cannot be steered outside the
// blob directory).
func (s *Store) BlobPath(digest string) string {
	if !IsDigest(digest) {
		return ""
	}
	return filepath.Join(s.blobDir(), strings.TrimPrefix(digest, "sha256:")+".erofs")
}

// Open implements Source: the image is the blob in the layer directory,
// which needs nothing released.
func (s *Store) Open(ctx context.Context, digest string) (string, func(), error) {
	blob := s.BlobPath(digest)
	if blob == "" {
		return "", nil, errdefs.Invalid("no blob path for %q", digest)
	}
	if _, err := os.Stat(blob); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return "", nil, errdefs.NotFound("blob %s is missing", blob)
		}
		return "", nil, err
	}
	return blob, func() {}, nil
}

var _ Source = (*Store)(nil)

// BuildFromDir seals the tree at dir into an EROFS image and registers it as
// ref. Owners, modes, xattrs, device nodes and mtimes are kept as found.
// Progress lines go to progress if it is not nil.
func (s *Store) BuildFromDir(ctx context.Context, ref Ref, dir string, opts BuildOptions, progress io.Writer) (api.Layer, error) {
	if err := s.mayPublish(); err != nil {
		return api.Layer{}, err
	}
	if err := checkBuild(ref, opts); err != nil {
		return api.Layer{}, err
	}
	fi, err := os.Stat(dir)
	if err != nil {
		return api.Layer{}, errdefs.Invalid("building layer %s: %v", ref, err)
	}
	if !fi.IsDir() {
		return api.Layer{}, errdefs.Invalid("building layer %s: %s is not a directory", ref, dir)
	}
	if err := s.checkFree(ref, opts); err != nil {
		return api.Layer{}, err
	}
	var cl cleanup.Stack
	defer cl.Run() // staging is temporary: undone on success too
	return s.build(ctx, ref, dir, opts, progress, &cl)
}

func checkBuild(ref Ref, opts BuildOptions) error {
	if _, err := ParseRef(ref.String()); err != nil {
		return err
	}
	switch opts.Compress {
	case "", "lz4", "lz4hc":
	default:
		return errdefs.Invalid("building layer %s: compression %q is not one of lz4, lz4hc", ref, opts.Compress)
	}
	if opts.MaxBytes < 0 || opts.MaxFiles < 0 || opts.SourceDateEpoch < 0 {
		return errdefs.Invalid("building layer %s: negative limit", ref)
	}
	for _, x := range opts.Exclude {
		if !strings.HasPrefix(x, "/") || strings.ContainsRune(x, 0) || path.Clean(x) == "/" || len(x) > 4096 {
			return errdefs.Invalid("building layer %s: exclude path %q must be an absolute path below /", ref, x)
		}
	}
	if (ref.Kind == api.KindSnapshot) != (opts.Snapshot != nil) {
		return errdefs.Invalid("building layer %s: snapshot layers are made from sandboxes (POST /v1/sandboxes/{id}/snapshot)", ref)
	}
	if opts.Image != nil && ref.Kind != api.KindBase {
		return errdefs.Invalid("building layer %s: only base layers carry an image configuration", ref)
	}
	if len(opts.Lowers) > 0 && ref.Kind != api.KindBase {
		return errdefs.Invalid("building layer %s: only base layers sit on lower layers", ref)
	}
	if len(opts.Lowers) > MaxLowers {
		return errdefs.Invalid("building layer %s: %d lower layers, at most %d", ref, len(opts.Lowers), MaxLowers)
	}
	seen := map[string]bool{}
	for _, d := range opts.Lowers {
		if !IsDigest(d) {
			return errdefs.Invalid("building layer %s: lower layer %q is not a sha256 digest", ref, d)
		}
		if seen[d] {
			// The node mounts a digest once: an overlay cannot stack it twice.
			return errdefs.Invalid("building layer %s: lower layer %s is listed twice", ref, d)
		}
		seen[d] = true
	}
	return nil
}

// checkFree fails early, before any expensive work, when ref is taken and
// opts.Replace is not set. The catalog write at the end is what decides.
func (s *Store) checkFree(ref Ref, opts BuildOptions) error {
	if opts.Replace {
		return nil
	}
	_, err := s.st.Get(catalogBucket, ref.String())
	switch {
	case err == nil:
		return errdefs.AlreadyExists("layer %s already exists (rebuild with replace to re-point it)", ref)
	case errors.Is(err, errdefs.ErrNotFound):
		return nil
	default:
		return fmt.Errorf("reading layer catalog: %w", err)
	}
}

// build runs mkfs.erofs on src, hashes the image and publishes it. Every
// temporary file is pushed on cl.
func (s *Store) build(ctx context.Context, ref Ref, src string, opts BuildOptions, progress io.Writer, cl *cleanup.Stack) (api.Layer, error) {
	what := "building layer " + ref.String()
	tmpPath, digest, size, err := s.seal(ctx, what, src, opts, progress, cl)
	if err != nil {
		return api.Layer{}, err
	}
	if slices.Contains(opts.Lowers, digest) {
		return api.Layer{}, errdefs.Invalid("%s: its tree has the content of one of its lower layers (%s), and a node mounts a digest once", what, digest)
	}
	l := api.Layer{Digest: digest, Ref: ref.String(), Kind: ref.Kind, SizeBytes: size, CreatedAt: time.Now().UTC(),
		Snapshot: opts.Snapshot, Image: opts.Image, Project: opts.Project, Lowers: opts.Lowers}
	if len(opts.Lowers) > 0 {
		l.LowersBytes = opts.LowersBytes
	}
	deduped, err := s.publish(tmpPath, l, opts.Replace, opts.MayReplace)
	if err != nil {
		return api.Layer{}, err
	}
	note := ""
	if deduped {
		note = " (content already stored)"
	}
	printf(progress, "layer %s %s %s%s\n", l.Ref, l.Digest, humanBytes(l.SizeBytes), note)
	s.log.Info("layer built", "ref", l.Ref, "digest", l.Digest, "size_bytes", l.SizeBytes, "lowers", len(l.Lowers), "deduplicated", deduped)
	return l, nil
}

// BuildBlob seals the tree at dir into an EROFS image and stores it by
// digest without a catalog entry: a layer below another of one image
// (BuildOptions.Lowers). The blob stays pinned until unpin is called,
// which the caller does once an entry names it (or it gives up): until
// then no delete or collection of the digest removes it. A blob that
// nothing names after unpin goes with Collect. opts.Compress, MaxBytes,
// SourceDateEpoch and Exclude apply; the rest concern entries.
func (s *Store) BuildBlob(ctx context.Context, dir string, opts BuildOptions, progress io.Writer) (digest string, size int64, unpin func(), err error) {
	if err := s.mayPublish(); err != nil {
		return "", 0, nil, err
	}
	fi, err := os.Stat(dir)
	if err != nil || !fi.IsDir() {
		return "", 0, nil, errdefs.Invalid("building a lower layer: %s is not a directory (%v)", dir, err)
	}
	if err := checkBuild(Ref{Kind: api.KindBase, Name: "lower", Tag: "lower"}, BuildOptions{Compress: opts.Compress,
		MaxBytes: opts.MaxBytes, MaxFiles: opts.MaxFiles, SourceDateEpoch: opts.SourceDateEpoch, Exclude: opts.Exclude}); err != nil {
		return "", 0, nil, err
	}
	var cl cleanup.Stack
	defer cl.Run()
	tmpPath, digest, size, err := s.seal(ctx, "building a lower layer", dir, opts, progress, &cl)
	if err != nil {
		return "", 0, nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	unpin, err = s.pin(digest)
	if err != nil {
		return "", 0, nil, fmt.Errorf("publishing lower layer %s: %w", digest, err)
	}
	deduped, err := s.place(tmpPath, digest)
	if err != nil {
		unpin()
		return "", 0, nil, fmt.Errorf("publishing lower layer %s: %w", digest, err)
	}
	note := ""
	if deduped {
		note = " (content already stored)"
	}
	printf(progress, "lower layer %s %s%s\n", digest, humanBytes(size), note)
	s.log.Info("lower layer built", "digest", digest, "size_bytes", size, "deduplicated", deduped)
	return digest, size, unpin, nil
}

// Collect removes the blob of digest if nothing names it and nothing pins
// it (a lower layer BuildBlob made for a build that then failed), and
// reports whether it did.
func (s *Store) Collect(digest string) (bool, error) {
	if err := s.mayPublish(); err != nil {
		return false, err
	}
	if !IsDigest(digest) {
		return false, errdefs.Invalid("collecting %q: not a sha256 digest", digest)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.collect(digest)
}

// seal runs mkfs.erofs on src into a staging file, pushed on cl, and
// hashes it.
func (s *Store) seal(ctx context.Context, what, src string, opts BuildOptions, progress io.Writer, cl *cleanup.Stack) (tmpPath, digest string, size int64, err error) {
	mkfs, err := exec.LookPath("mkfs.erofs")
	if err != nil {
		return "", "", 0, errdefs.Unavailable("%s: mkfs.erofs not found in PATH (install erofs-utils)", what)
	}
	tmp, err := os.CreateTemp(s.stagingDir(), "image-*.erofs")
	if err != nil {
		return "", "", 0, fmt.Errorf("%s: %w", what, err)
	}
	name := tmp.Name()
	cl.Add(func() { os.Remove(name) })
	tmp.Close()
	tmpPath = name

	// noinline_data keeps file data (small files' and tails) out of the
	// inode area: the image's metadata is then compact, which is what a
	// node fetches eagerly when it reads the image on demand (its
	// metadata pack). Measured with bench images on three Debian bases:
	// packs of 10.7 MiB instead of 161, 28% fewer bytes from the source,
	// 10.2% of the images read instead of 15.2%, for images 6% larger
	// (docs/operating.md, "Layers from a registry").
	args := []string{"--quiet", "-U", imageUUID, "-E", "noinline_data"}
	if opts.Compress != "" {
		args = append(args, "-z"+opts.Compress)
	}
	for _, x := range opts.Exclude {
		// mkfs.erofs matches literal paths relative to the source root.
		args = append(args, "--exclude-path="+strings.TrimPrefix(path.Clean(x), "/"))
	}
	args = append(args, tmpPath, src)
	epoch := int64(defaultClampTime)
	if opts.SourceDateEpoch != 0 {
		epoch = opts.SourceDateEpoch
	}
	cmd := exec.CommandContext(ctx, mkfs, args...)
	// A fixed environment: an inherited SOURCE_DATE_EPOCH or locale must
	// not change the image.
	cmd.Env = []string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL=C", fmt.Sprintf("SOURCE_DATE_EPOCH=%d", epoch)}
	start := time.Now()
	out, err := cmd.CombinedOutput()
	if err != nil {
		if ctx.Err() != nil {
			return "", "", 0, fmt.Errorf("%s: %w", what, ctx.Err())
		}
		return "", "", 0, fmt.Errorf("%s: running mkfs.erofs: %w: %s", what, err, lastLines(out, 5))
	}
	mkfsTime := time.Since(start)
	digest, size, err = hashFile(tmpPath)
	if err != nil {
		return "", "", 0, fmt.Errorf("%s: %w", what, err)
	}
	printf(progress, "mkfs.erofs: %s, image %s\n", mkfsTime.Round(time.Millisecond), humanBytes(size))
	return tmpPath, digest, size, nil
}

// publish moves the image at tmpPath to its blob path (unless that content
// is already stored) and then writes the catalog entry: the catalog never
// names a blob that is not in place. A pin in the store keeps any process
// from removing the blob between the two.
func (s *Store) publish(tmpPath string, l api.Layer, replace bool, mayReplace func(api.Layer) error) (deduped bool, err error) {
	if err := s.mayPublish(); err != nil {
		return false, err
	}
	val, err := json.Marshal(l)
	if err != nil {
		return false, fmt.Errorf("encoding layer %s: %w", l.Ref, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	unpin, err := s.pin(l.Digest)
	if err != nil {
		return false, fmt.Errorf("publishing layer %s: %w", l.Ref, err)
	}
	defer unpin()
	// The lowers' blobs are pinned here too, from before the check that
	// they are in place until the entry names them: the caller's pins may
	// be stale by now (a long import), and a stale pin does not hold.
	for _, d := range l.Lowers {
		unpinLower, err := s.pin(d)
		if err != nil {
			return false, fmt.Errorf("publishing layer %s: %w", l.Ref, err)
		}
		defer unpinLower()
		if _, err := os.Lstat(s.BlobPath(d)); err != nil {
			return false, fmt.Errorf("publishing layer %s: lower layer %s is gone: %w", l.Ref, d, err)
		}
	}
	if deduped, err = s.place(tmpPath, l.Digest); err != nil {
		return false, fmt.Errorf("publishing layer %s: %w", l.Ref, err)
	}

	err = s.writeEntry(l, val, replace, mayReplace)
	if err != nil {
		// A blob this made and nobody names goes with the next GC or
		// delete of its digest: another process may have named it
		// meanwhile, which only a collection under the store's mark
		// can tell.
		if errors.Is(err, errdefs.ErrAlreadyExists) {
			return false, errdefs.AlreadyExists("layer %s already exists (rebuild with replace to re-point it)", l.Ref)
		}
		return false, fmt.Errorf("writing layer catalog: %w", err)
	}
	s.cache.put(l)
	return deduped, nil
}

// place moves the image at tmpPath to the blob path of digest, unless
// that content is stored already (deduped). The caller holds a pin on
// digest.
func (s *Store) place(tmpPath, digest string) (deduped bool, err error) {
	blob := s.BlobPath(digest)
	switch _, err := os.Lstat(blob); {
	case err == nil:
		return true, nil
	case errors.Is(err, fs.ErrNotExist):
		if err := os.Chmod(tmpPath, 0o444); err != nil {
			return false, err
		}
		if err := os.Rename(tmpPath, blob); err != nil {
			return false, err
		}
		return false, syncDir(s.blobDir())
	default:
		return false, err
	}
}

// AddRemote records l, whose image lives elsewhere (l.Remote), in the
// catalog without a blob: edges fetch it from its source. opts.Replace and
// opts.MayReplace mean what they mean for builds.
func (s *Store) AddRemote(l api.Layer, opts BuildOptions) (api.Layer, error) {
	if err := s.mayPublish(); err != nil {
		return api.Layer{}, err
	}
	r, err := ParseRef(l.Ref)
	if err != nil {
		return api.Layer{}, err
	}
	if l.Remote == nil || !IsDigest(l.Digest) {
		return api.Layer{}, errdefs.Invalid("layer %s: a remote layer needs a source and a digest", r)
	}
	l.Ref, l.Kind = r.String(), r.Kind
	val, err := json.Marshal(l)
	if err != nil {
		return api.Layer{}, fmt.Errorf("encoding layer %s: %w", r, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.claimIndex(l.Digest, claimOf(l.Remote)); err != nil {
		return api.Layer{}, fmt.Errorf("adding layer %s: %w", r, err)
	}
	err = s.writeEntry(l, val, opts.Replace, opts.MayReplace)
	if err != nil {
		s.dropIndex(l.Digest) // not named after all, unless by another ref
	}
	if errors.Is(err, errdefs.ErrAlreadyExists) {
		return api.Layer{}, errdefs.AlreadyExists("layer %s already exists (add with replace to re-point it)", r)
	}
	if err != nil {
		return api.Layer{}, fmt.Errorf("writing layer catalog: %w", err)
	}
	s.cache.put(l)
	return l, nil
}

// writeEntry writes l's catalog entry (val): a new ref, or with replace
// over the ref's entry if mayReplace (may be nil) allows it. A digest
// that the entry replaced and nothing names any more gives up its chunk
// index, if it had one (s.mu held).
func (s *Store) writeEntry(l api.Layer, val []byte, replace bool, mayReplace func(api.Layer) error) error {
	if !replace {
		return s.st.Create(catalogBucket, l.Ref, val)
	}
	var prev *api.Layer
	err := s.st.Update(catalogBucket, l.Ref, func(old []byte) ([]byte, error) {
		prev = nil
		if old == nil {
			return val, nil
		}
		var p api.Layer
		if err := json.Unmarshal(old, &p); err != nil {
			if mayReplace == nil {
				return val, nil // nothing to ask: replaced unread
			}
			return nil, fmt.Errorf("decoding layer %s: %w", l.Ref, err)
		}
		if mayReplace != nil {
			if err := mayReplace(p); err != nil {
				return nil, err
			}
		}
		prev = &p
		return val, nil
	})
	if err == nil && prev != nil && prev.Digest != l.Digest {
		s.dropIndex(prev.Digest)
	}
	return err
}

// Get returns the layer named by a ref or, for a digest, the first ref (in
// key order) that points at it.
func (s *Store) Get(refOrDigest string) (api.Layer, error) {
	if !IsDigest(refOrDigest) {
		return s.Resolve(refOrDigest)
	}
	all, err := s.List("")
	if err != nil {
		return api.Layer{}, err
	}
	var found *api.Layer
	for i, l := range all {
		if l.Digest != refOrDigest {
			continue
		}
		if found == nil {
			found = &all[i]
			continue
		}
		// A base's own image is a diff over its lowers: one digest on
		// two stacks is two filesystems, which a digest cannot choose.
		if !slices.Equal(found.Lowers, l.Lowers) {
			return api.Layer{}, errdefs.Precondition("%s is the top of layers on different lower layers (%s, %s): name one by its ref", refOrDigest, found.Ref, l.Ref)
		}
	}
	if found == nil {
		return api.Layer{}, errdefs.NotFound("no layer ref points at %s", refOrDigest)
	}
	return *found, nil
}

// Resolve returns the catalog entry of ref.
func (s *Store) Resolve(ref string) (api.Layer, error) {
	r, err := ParseRef(ref)
	if err != nil {
		return api.Layer{}, err
	}
	if l, ok := s.cache.get(r.String()); ok {
		return l, nil
	}
	val, err := s.st.Get(catalogBucket, r.String())
	if errors.Is(err, errdefs.ErrNotFound) {
		return api.Layer{}, errdefs.NotFound("layer %s not found", r)
	}
	if err != nil {
		return api.Layer{}, fmt.Errorf("reading layer catalog: %w", err)
	}
	var l api.Layer
	if err := json.Unmarshal(val, &l); err != nil {
		return api.Layer{}, fmt.Errorf("decoding layer %s: %w", r, err)
	}
	return l, nil
}

// List returns the layers of one kind, or of every kind if kind is "", in
// ref order.
func (s *Store) List(kind string) ([]api.Layer, error) {
	prefix := ""
	if kind != "" {
		if !validKind(kind) {
			return nil, errdefs.Invalid("layer kind %q is not one of base, workspace, toolkit, snapshot", kind)
		}
		prefix = kind + "/"
	}
	kvs, err := s.st.List(catalogBucket, prefix)
	if err != nil {
		return nil, fmt.Errorf("listing layer catalog: %w", err)
	}
	out := make([]api.Layer, 0, len(kvs))
	for _, kv := range kvs {
		var l api.Layer
		if err := json.Unmarshal(kv.Value, &l); err != nil {
			return nil, fmt.Errorf("decoding layer %s: %w", kv.Key, err)
		}
		out = append(out, l)
	}
	return out, nil
}

// Delete removes ref from the catalog, and its blob when no other ref
// points at the same digest. inUse (may be nil) reports whether sandboxes
// use a digest; a layer in use is refused with errdefs.ErrPrecondition.
// inUse is called with the store's publish lock held, so builds wait for it.
func (s *Store) Delete(ref string, inUse func(digest string) (bool, error)) error {
	if err := s.mayPublish(); err != nil {
		return err
	}
	r, err := ParseRef(ref)
	if err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	l, err := s.Resolve(r.String())
	if err != nil {
		return err
	}
	if inUse != nil {
		used, err := inUse(l.Digest)
		if err != nil {
			return fmt.Errorf("deleting layer %s: %w", r, err)
		}
		if used {
			return errdefs.Precondition("layer %s (%s) is used by sandboxes; delete them first", r, l.Digest)
		}
	}
	if err := s.st.Delete(catalogBucket, r.String()); err != nil {
		return fmt.Errorf("deleting layer %s: %w", r, err)
	}
	s.cache.del(r.String())
	s.dropIndex(l.Digest)
	removed, err := s.collect(l.Digest)
	if err != nil {
		return fmt.Errorf("deleting layer %s: %w", r, err)
	}
	// The layers below it may be named by it alone.
	below := 0
	for _, d := range stackOf(l) {
		s.dropIndex(d)
		gone, err := s.collect(d)
		if err != nil {
			return fmt.Errorf("deleting layer %s: %w", r, err)
		}
		if gone {
			below++
		}
	}
	s.log.Info("layer deleted", "ref", r.String(), "digest", l.Digest, "blob_kept", !removed, "blobs_below_removed", below)
	return nil
}

// GC removes blobs that no ref names (as its image or below it) and that
// inUse (may be nil) does not claim, and returns their digests and how
// many bytes they held. Blobs a publisher has pinned stay; so do those a
// crashed one pinned, until the pin is stale (staleAfter). What GC finds:
// the blobs of refs re-pointed with replace, and what an interrupted
// publish or merged import left. inUse is asked without the store's
// publish lock (it may ask every node); each removal then checks again,
// under the lock and the blob's mark, that no ref names the blob.
func (s *Store) GC(inUse func(digest string) (bool, error)) (removed []string, bytes int64, err error) {
	if err := s.mayPublish(); err != nil {
		return nil, 0, err
	}
	cands, sizes, err := s.unused(inUse)
	if err != nil {
		return nil, 0, fmt.Errorf("collecting layer blobs: %w", err)
	}
	for k, digest := range cands {
		gone, err := s.Collect(digest)
		if err != nil {
			return removed, bytes, fmt.Errorf("collecting layer blobs: %w", err)
		}
		if gone {
			removed = append(removed, digest)
			bytes += sizes[k]
		}
	}
	if len(removed) > 0 {
		s.log.Info("layer blobs collected", "count", len(removed), "bytes", bytes)
	}
	return removed, bytes, nil
}

// Unused is what GC would remove now, removing nothing: the blobs no ref
// names and inUse (may be nil) does not claim, with the bytes they hold.
// A blob a publisher pins meanwhile would still be kept.
func (s *Store) Unused(inUse func(digest string) (bool, error)) (digests []string, bytes int64, err error) {
	cands, sizes, err := s.unused(inUse)
	if err != nil {
		return nil, 0, fmt.Errorf("listing unused layer blobs: %w", err)
	}
	for _, n := range sizes {
		bytes += n
	}
	return cands, bytes, nil
}

// unused lists the blobs no entry names and inUse (may be nil) does not
// claim, with their sizes.
func (s *Store) unused(inUse func(digest string) (bool, error)) (digests []string, sizes []int64, err error) {
	cands, all, err := s.unnamed()
	if err != nil || inUse == nil {
		return cands, all, err
	}
	for k, digest := range cands {
		used, err := inUse(digest)
		if err != nil {
			return nil, nil, err
		}
		if !used {
			digests = append(digests, digest)
			sizes = append(sizes, all[k])
		}
	}
	return digests, sizes, nil
}

// unnamed lists the blobs in the layer directory that no entry names, as
// its image or below it, with their sizes.
func (s *Store) unnamed() (digests []string, sizes []int64, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	all, err := s.List("")
	if err != nil {
		return nil, nil, err
	}
	named := make(map[string]bool, len(all))
	for _, l := range all {
		named[l.Digest] = true
		for _, d := range stackOf(l) {
			named[d] = true
		}
	}
	entries, err := os.ReadDir(s.blobDir())
	if err != nil {
		return nil, nil, err
	}
	for _, e := range entries {
		hex, ok := strings.CutSuffix(e.Name(), ".erofs")
		digest := "sha256:" + hex
		if !ok || !IsDigest(digest) || named[digest] {
			continue
		}
		var size int64
		if fi, err := e.Info(); err == nil {
			size = fi.Size()
		}
		digests = append(digests, digest)
		sizes = append(sizes, size)
	}
	return digests, sizes, nil
}

// referenced reports whether any ref points at digest.
func (s *Store) referenced(digest string) (bool, error) {
	all, err := s.List("")
	if err != nil {
		return false, err
	}
	for _, l := range all {
		if l.Digest == digest || slices.Contains(stackOf(l), digest) {
			return true, nil
		}
	}
	return false, nil
}

// stackOf is what l's entry names below its own image: the layers of its
// image below it, or the layers a snapshot was taken on. Their blobs stay
// while the entry does.
func stackOf(l api.Layer) []string {
	if l.Snapshot != nil {
		return append(append([]string(nil), l.Lowers...), l.Snapshot.Layers...)
	}
	return l.Lowers
}

// hashFile returns the sha256 digest and size of the file at path, after
// flushing it to disk: it is about to become a content-addressed blob.
func hashFile(path string) (digest string, size int64, err error) {
	f, err := os.Open(path)
	if err != nil {
		return "", 0, fmt.Errorf("hashing image: %w", err)
	}
	defer f.Close()
	h := sha256.New()
	size, err = io.Copy(h, f)
	if err != nil {
		return "", 0, fmt.Errorf("hashing image: %w", err)
	}
	if err := f.Sync(); err != nil {
		return "", 0, fmt.Errorf("syncing image: %w", err)
	}
	return "sha256:" + hex.EncodeToString(h.Sum(nil)), size, nil
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

func printf(w io.Writer, format string, args ...any) {
	if w != nil {
		fmt.Fprintf(w, format, args...)
	}
}

// HumanBytes formats a byte count for progress lines ("1.3 GiB").
func HumanBytes(n int64) string { return humanBytes(n) }

func humanBytes(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.1f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}

// lastLines keeps the end of a tool's output for an error message.
func lastLines(out []byte, n int) string {
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "; ")
}
