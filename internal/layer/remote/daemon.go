package remote

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/image"
	"github.com/dsecproject/dsec/internal/layer"
)

// Descriptor tells the daemon where a layer's image lives.
type Descriptor struct {
	Digest    string `json:"digest"`
	Size      int64  `json:"size"`
	Source    string `json:"source"`
	Insecure  bool   `json:"insecure,omitempty"`
	Index     string `json:"index"`
	IndexSize int64  `json:"index_size"`
}

func (d Descriptor) check() error {
	if !layer.IsDigest(d.Digest) || !layer.IsDigest(d.Index) {
		return errdefs.Invalid("descriptor: bad digest")
	}
	if d.Size < 0 || d.IndexSize <= 0 || d.IndexSize > maxIndexBytes {
		return errdefs.Invalid("descriptor: bad sizes")
	}
	_, err := ParseSource(d.Source)
	return err
}

// Paths below a daemon's directory.
const (
	mntName    = "mnt"
	sockName   = "ctl.sock"
	descDir    = "layers"
	indexDir   = "index"
	cacheDir   = "cache"
	fsName     = "dsec-layerfs"
	fileSuffix = ".erofs"
)

// MountDir is where the daemon of dir serves images: <dir>/mnt/<hex>.erofs.
func MountDir(dir string) string { return filepath.Join(dir, mntName) }

// SocketPath is the daemon's control socket.
func SocketPath(dir string) string { return filepath.Join(dir, sockName) }

// DaemonConfig configures Serve.
type DaemonConfig struct {
	// Dir holds the mount point, control socket, descriptors, indexes
	// and the chunk cache.
	Dir        string
	CacheBytes int64
	Policy     FetchPolicy
	// Idle, if positive, ends the daemon after that long with no image
	// open and no request (the edge starts it again when needed).
	Idle time.Duration
	// DockerConfig supplies registry credentials (see image.PullOptions).
	DockerConfig string
	Log          *slog.Logger
}

// Daemon serves remote layer images as read-only files of a FUSE
// filesystem (one file per image, named by its digest's hex), read on
// demand through Readers, and answers registrations and statistics on a
// control socket. It runs in a process of its own (dsec layerfs) so that
// a restart of the edge keeps its mounts; Serve runs it.
type Daemon struct {
	cfg   DaemonConfig
	cache *Cache
	log   *slog.Logger

	open     atomic.Int64 // images open (a mounted EROFS holds one)
	lastUsed atomic.Int64 // unix nanos of the last request

	mu      sync.Mutex
	readers map[string]*Reader // by hex
}

// Serve runs a daemon until ctx ends or it has been idle for cfg.Idle,
// then unmounts its filesystem.
func Serve(ctx context.Context, cfg DaemonConfig) error {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.CacheBytes <= 0 {
		return errdefs.Invalid("layerfs: the chunk cache needs a positive bound")
	}
	for _, sub := range []string{mntName, descDir, indexDir} {
		if err := os.MkdirAll(filepath.Join(cfg.Dir, sub), 0o700); err != nil {
			return fmt.Errorf("layerfs: %w", err)
		}
	}
	cache, err := OpenCache(filepath.Join(cfg.Dir, cacheDir), cfg.CacheBytes)
	if err != nil {
		return err
	}
	ctx, stop := context.WithCancel(ctx)
	defer stop()
	d := &Daemon{cfg: cfg, cache: cache, log: cfg.Log, readers: map[string]*Reader{}}
	d.lastUsed.Store(time.Now().UnixNano())

	// A daemon that died left its mount behind, dead (ENOTCONN): take it
	// off before mounting again.
	mnt := MountDir(cfg.Dir)
	_ = unix.Unmount(mnt, unix.MNT_DETACH)
	long := time.Hour
	server, err := gofs.Mount(mnt, &rootNode{d: d}, &gofs.Options{
		EntryTimeout: &long, AttrTimeout: &long,
		MountOptions: fuse.MountOptions{
			FsName: fsName, Name: fsName, DirectMount: true, AllowOther: true,
			MaxWrite: 1 << 20, DisableXAttrs: true,
			// Passthrough makes the kernel count FUSE as a stacked
			// filesystem, and EROFS refuses file-backed mounts of files
			// on stacked filesystems ("cannot be applied to stacked
			// fses"); the images are served by reads, so it is not used.
			DisabledCapabilities: fuse.CAP_PASSTHROUGH,
		},
	})
	if err != nil {
		return fmt.Errorf("layerfs: mounting %s: %w", mnt, err)
	}
	defer func() {
		if err := server.Unmount(); err != nil {
			_ = unix.Unmount(mnt, unix.MNT_DETACH)
		}
	}()

	sock := SocketPath(cfg.Dir)
	os.Remove(sock)
	ln, err := net.Listen("unix", sock)
	if err != nil {
		return fmt.Errorf("layerfs: %w", err)
	}
	os.Chmod(sock, 0o600)
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) { w.Write([]byte("ok\n")) })
	mux.HandleFunc("POST /layers", d.register)
	mux.HandleFunc("GET /stats", d.stats)
	mux.HandleFunc("POST /exit-if-idle", func(w http.ResponseWriter, r *http.Request) {
		if n := d.open.Load(); n > 0 {
			http.Error(w, fmt.Sprintf("%d image(s) open", n), http.StatusConflict)
			return
		}
		d.log.Info("layerfs asked to exit with no image open")
		w.Write([]byte("exiting\n"))
		stop()
	})
	hs := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go hs.Serve(ln)
	defer func() {
		hs.Close()
		os.Remove(sock)
	}()
	d.log.Info("layerfs serving", "mount", mnt, "cache_bytes", cfg.CacheBytes, "cached", cache.Size())

	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
			if cfg.Idle > 0 && d.open.Load() == 0 && time.Since(time.Unix(0, d.lastUsed.Load())) > cfg.Idle {
				d.log.Info("layerfs idle; exiting")
				return nil
			}
		}
	}
}

func (d *Daemon) used() { d.lastUsed.Store(time.Now().UnixNano()) }

// register records a layer's descriptor, loads its index and fetches its
// first chunk (the superblock and the start of the metadata), so that a
// source that cannot be reached refuses the create that asked for the
// layer instead of failing the sandbox's first read.
func (d *Daemon) register(w http.ResponseWriter, r *http.Request) {
	d.used()
	var desc Descriptor
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<20)).Decode(&desc); err != nil {
		http.Error(w, "bad descriptor: "+err.Error(), http.StatusBadRequest)
		return
	}
	if err := desc.check(); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	hex := strings.TrimPrefix(desc.Digest, "sha256:")
	b, _ := json.Marshal(desc)
	if err := writeAtomic(filepath.Join(d.cfg.Dir, descDir, hex+".json"), b); err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	rd, err := d.reader(r.Context(), hex)
	if err == nil && rd.Size() > 0 {
		buf := make([]byte, rd.ix.ChunkLen(0))
		_, err = rd.ReadAt(r.Context(), buf, 0)
	}
	if err != nil {
		status := http.StatusServiceUnavailable
		if errors.Is(err, errdefs.ErrInvalid) {
			status = http.StatusBadGateway
		}
		http.Error(w, err.Error(), status)
		return
	}
	json.NewEncoder(w).Encode(map[string]string{"path": filepath.Join(MountDir(d.cfg.Dir), hex+fileSuffix)})
}

// reader returns the reader of the image hex, loading its descriptor and
// index (kept on disk after the first fetch, checked by digest) once.
func (d *Daemon) reader(ctx context.Context, hex string) (*Reader, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if rd, ok := d.readers[hex]; ok {
		return rd, nil
	}
	if !layer.IsDigest("sha256:" + hex) {
		return nil, errdefs.NotFound("no image %q", hex)
	}
	b, err := os.ReadFile(filepath.Join(d.cfg.Dir, descDir, hex+".json"))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, errdefs.NotFound("image %s is not registered", hex)
	}
	if err != nil {
		return nil, err
	}
	var desc Descriptor
	if err := json.Unmarshal(b, &desc); err != nil {
		return nil, fmt.Errorf("descriptor of %s: %w", hex, err)
	}
	if err := desc.check(); err != nil {
		return nil, err
	}
	ref, _ := ParseSource(desc.Source)
	repo, err := image.OpenRepo(ref, image.RepoOptions{Insecure: desc.Insecure, DockerConfig: d.cfg.DockerConfig})
	if err != nil {
		return nil, err
	}
	ixPath := filepath.Join(d.cfg.Dir, indexDir, strings.TrimPrefix(desc.Index, "sha256:"))
	ib, err := os.ReadFile(ixPath)
	if err != nil || digestOf(ib) != desc.Index {
		fctx, cancel := context.WithTimeout(ctx, d.cfg.Policy.withDefaults().Timeout)
		ib, err = repo.Blob(fctx, desc.Index, desc.IndexSize, maxIndexBytes)
		cancel()
		if err != nil {
			return nil, fmt.Errorf("fetching the chunk index of %s: %w", short(desc.Digest), err)
		}
		if err := writeAtomic(ixPath, ib); err != nil {
			d.log.Warn("keeping a chunk index", "err", err)
		}
	}
	ix, err := UnmarshalIndex(ib)
	if err != nil {
		return nil, err
	}
	if ix.Size != desc.Size {
		return nil, errdefs.Invalid("chunk index of %s covers %d bytes, not %d", short(desc.Digest), ix.Size, desc.Size)
	}
	rd := NewReader(desc.Digest, ix, repo, d.cache, d.cfg.Policy, d.log.With("layer", short(desc.Digest)))
	d.readers[hex] = rd
	return rd, nil
}

// LayerStats are one image's figures in the daemon's statistics.
type LayerStats struct {
	Digest        string  `json:"digest"`
	SizeBytes     int64   `json:"size_bytes"`
	Chunks        int     `json:"chunks"`
	ChunksTouched int64   `json:"chunks_touched"`
	ReadFraction  float64 `json:"read_fraction"`
	BytesFetched  int64   `json:"bytes_fetched"`
	Requests      int64   `json:"requests"`
	FetchErrors   int64   `json:"fetch_errors"`
	FetchSeconds  float64 `json:"fetch_seconds"`
	CacheHits     int64   `json:"cache_hits"`
	CacheMisses   int64   `json:"cache_misses"`
	BadChunks     int64   `json:"bad_chunks"`
}

// DaemonStats answer GET /stats.
type DaemonStats struct {
	CacheBytes    int64        `json:"cache_bytes"`
	CacheMaxBytes int64        `json:"cache_max_bytes"`
	OpenImages    int64        `json:"open_images"`
	Layers        []LayerStats `json:"layers"`
}

func (d *Daemon) stats(w http.ResponseWriter, r *http.Request) {
	out := DaemonStats{CacheBytes: d.cache.Size(), CacheMaxBytes: d.cfg.CacheBytes, OpenImages: d.open.Load(), Layers: []LayerStats{}}
	d.mu.Lock()
	for _, rd := range d.readers {
		s := &rd.Stats
		ls := LayerStats{Digest: rd.digest, SizeBytes: rd.ix.Size, Chunks: rd.ix.Chunks(), ChunksTouched: s.ChunksTouched.Load(),
			BytesFetched: s.BytesFetched.Load(), Requests: s.Requests.Load(), FetchErrors: s.FetchErrors.Load(),
			FetchSeconds: time.Duration(s.FetchNanos.Load()).Seconds(), CacheHits: s.CacheHits.Load(),
			CacheMisses: s.CacheMisses.Load(), BadChunks: s.BadChunks.Load()}
		if ls.Chunks > 0 {
			ls.ReadFraction = float64(ls.ChunksTouched) / float64(ls.Chunks)
		}
		out.Layers = append(out.Layers, ls)
	}
	d.mu.Unlock()
	sort.Slice(out.Layers, func(i, j int) bool { return out.Layers[i].Digest < out.Layers[j].Digest })
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(out)
}

func writeAtomic(path string, b []byte) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// rootNode is the filesystem's root: one file per registered image.
type rootNode struct {
	gofs.Inode
	d *Daemon
}

var (
	_ gofs.NodeLookuper  = (*rootNode)(nil)
	_ gofs.NodeReaddirer = (*rootNode)(nil)
)

func (n *rootNode) Lookup(ctx context.Context, name string, out *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	n.d.used()
	hex, ok := strings.CutSuffix(name, fileSuffix)
	if !ok {
		return nil, syscall.ENOENT
	}
	rd, err := n.d.reader(ctx, hex)
	if errors.Is(err, errdefs.ErrNotFound) {
		return nil, syscall.ENOENT
	}
	if err != nil {
		n.d.log.Warn("looking up a layer image", "image", hex, "err", err)
		return nil, syscall.EIO
	}
	h := fnv.New64a()
	h.Write([]byte(hex))
	f := &imageNode{d: n.d, rd: rd}
	out.Attr.Mode = fuse.S_IFREG | 0o444
	out.Attr.Size = uint64(rd.Size())
	return n.NewInode(ctx, f, gofs.StableAttr{Mode: fuse.S_IFREG, Ino: h.Sum64() | 1<<63}), 0
}

func (n *rootNode) Readdir(ctx context.Context) (gofs.DirStream, syscall.Errno) {
	n.d.mu.Lock()
	var es []fuse.DirEntry
	for hex := range n.d.readers {
		es = append(es, fuse.DirEntry{Name: hex + fileSuffix, Mode: fuse.S_IFREG})
	}
	n.d.mu.Unlock()
	sort.Slice(es, func(i, j int) bool { return es[i].Name < es[j].Name })
	return gofs.NewListDirStream(es), 0
}

// imageNode is one image, read-only, its bytes fetched on demand.
type imageNode struct {
	gofs.Inode
	d  *Daemon
	rd *Reader
}

var (
	_ gofs.NodeGetattrer = (*imageNode)(nil)
	_ gofs.NodeOpener    = (*imageNode)(nil)
	_ gofs.NodeReader    = (*imageNode)(nil)
	_ gofs.FileReleaser  = (*imageHandle)(nil)
)

// imageHandle is an open image; the daemon counts them (go-fuse tells a
// node of a release only for a handle that is not nil).
type imageHandle struct{ d *Daemon }

func (h *imageHandle) Release(ctx context.Context) syscall.Errno {
	h.d.open.Add(-1)
	h.d.used()
	return 0
}

func (n *imageNode) Getattr(ctx context.Context, fh gofs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	out.Mode = fuse.S_IFREG | 0o444
	out.Size = uint64(n.rd.Size())
	out.Blocks = (out.Size + 511) / 512
	return 0
}

func (n *imageNode) Open(ctx context.Context, flags uint32) (gofs.FileHandle, uint32, syscall.Errno) {
	if flags&(syscall.O_WRONLY|syscall.O_RDWR|syscall.O_TRUNC|syscall.O_APPEND) != 0 {
		return nil, 0, syscall.EROFS
	}
	n.d.open.Add(1)
	n.d.used()
	// The image never changes: what the kernel has cached stays valid.
	return &imageHandle{d: n.d}, fuse.FOPEN_KEEP_CACHE, 0
}

func (n *imageNode) Read(ctx context.Context, fh gofs.FileHandle, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	got, err := n.rd.ReadAt(ctx, dest, off)
	if err != nil && got == 0 {
		if off >= n.rd.Size() {
			return fuse.ReadResultData(nil), 0
		}
		n.d.log.Warn("reading a layer image", "digest", n.rd.digest, "offset", off, "err", err)
		return nil, syscall.EIO
	}
	return fuse.ReadResultData(dest[:got]), 0
}
