package remote

import (
	"context"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/image"
	"github.com/dsecproject/dsec/internal/layer"
	"github.com/dsecproject/dsec/internal/mountinfo"
)

// Descriptor tells the daemon where a layer's image lives.
type Descriptor struct {
	Digest    string `json:"digest"`
	Size      int64  `json:"size"`
	Source    string `json:"source"`
	Insecure  bool   `json:"insecure,omitempty"`
	Index     string `json:"index"`
	IndexSize int64  `json:"index_size"`
	// Meta and MetaSize name the image's metadata pack (metapack.go),
	// if its artifact has one.
	Meta     string `json:"meta,omitempty"`
	MetaSize int64  `json:"meta_size,omitempty"`
}

func (d Descriptor) check() error {
	if !layer.IsDigest(d.Digest) || !layer.IsDigest(d.Index) {
		return errdefs.Invalid("descriptor: bad digest")
	}
	if d.Size < 0 || d.IndexSize <= 0 || d.IndexSize > maxIndexBytes {
		return errdefs.Invalid("descriptor: bad sizes")
	}
	if d.Meta != "" && (!layer.IsDigest(d.Meta) || d.MetaSize <= 0 || d.MetaSize > metaBound(d.Size)) {
		return errdefs.Invalid("descriptor: bad metadata pack")
	}
	_, err := ParseSource(d.Source)
	return err
}

// Paths below a daemon's directory.
const (
	mntName    = "mnt"
	sockName   = "ctl.sock"
	descDir    = "layers"
	traceDir   = "trace"
	indexDir   = "index"
	cacheDir   = "cache"
	fsName     = "dsec-layerfs"
	pidName    = "layerfs.pid"
	fileSuffix = ".erofs"
)

// MountDir is where the daemon of dir serves images: <dir>/mnt/<hex>.erofs.
func MountDir(dir string) string { return filepath.Join(dir, mntName) }

// SocketPath is the daemon's control socket.
func SocketPath(dir string) string { return filepath.Join(dir, sockName) }

// fdSocketPath is where the daemon hands its FUSE descriptor to root (an
// edge that restarted, so that it can keep the mount if the daemon dies).
func fdSocketPath(dir string) string { return filepath.Join(dir, "fd.sock") }

// serveFD sends fuse to every root peer that connects.
func serveFD(ln net.Listener, fuse *os.File, log *slog.Logger) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		uc := c.(*net.UnixConn)
		raw, err := uc.SyscallConn()
		var cred *unix.Ucred
		if err == nil {
			raw.Control(func(fd uintptr) { cred, err = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED) })
		}
		if err != nil || cred == nil || cred.Uid != 0 {
			log.Warn("refused the FUSE descriptor to a peer that is not root")
			c.Close()
			continue
		}
		if _, _, err := uc.WriteMsgUnix([]byte{0}, unix.UnixRights(int(fuse.Fd())), nil); err != nil {
			log.Warn("sending the FUSE descriptor", "err", err)
		}
		c.Close()
	}
}

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
	// FUSE, if set, is a /dev/fuse descriptor already mounted at
	// MountDir(Dir) by the caller (the edge, which keeps a copy so that
	// the mount outlives this process); otherwise Serve mounts itself.
	// Reattach says the connection was served by an earlier daemon: no
	// INIT will come, and requests that one read but never answered are
	// asked of the kernel again (FUSE_NOTIFY_RESEND).
	FUSE     *os.File
	Reattach bool
	// Prefetch, when a layer is first read, fetches in the background
	// the chunks an earlier run read, in their order (a trace kept per
	// layer under Dir/trace).
	Prefetch bool
	Log      *slog.Logger
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

	lastUsed atomic.Int64 // unix nanos of the last request

	mu      sync.Mutex
	readers map[string]*Reader  // by hex
	loads   map[string]*loading // readers being made, by hex
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
	cfg.Dir = resolveDir(cfg.Dir)
	// The mount point is left alone when the edge mounted it: a stat of
	// it would wait for this very daemon to answer.
	subs := []string{descDir, indexDir, traceDir}
	if cfg.FUSE == nil {
		subs = append(subs, mntName)
	}
	for _, sub := range subs {
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
	d := &Daemon{cfg: cfg, cache: cache, log: cfg.Log, readers: map[string]*Reader{}, loads: map[string]*loading{}}
	d.lastUsed.Store(time.Now().UnixNano())

	mnt := MountDir(cfg.Dir)
	opts := &fuse.MountOptions{
		FsName: fsName, Name: fsName, AllowOther: true, MaxWrite: 1 << 20, DisableXAttrs: true,
		// Passthrough makes the kernel count FUSE as a stacked
		// filesystem, and EROFS refuses file-backed mounts of files on
		// stacked filesystems ("cannot be applied to stacked fses"); the
		// images are served by reads, so it is not used.
		DisabledCapabilities: fuse.CAP_PASSTHROUGH,
		DirectMount:          true,
	}
	rfs := &rawFS{RawFileSystem: fuse.NewDefaultRawFileSystem(), d: d}
	switch {
	case cfg.FUSE == nil:
		// A daemon that died left its mount behind, dead (ENOTCONN):
		// take it off before mounting again.
		_ = unix.Unmount(mnt, unix.MNT_DETACH)
		server, err := fuse.NewServer(rfs, mnt, opts)
		if err != nil {
			return fmt.Errorf("layerfs: mounting %s: %w", mnt, err)
		}
		go server.Serve()
		if err := server.WaitMount(); err != nil {
			return fmt.Errorf("layerfs: mounting %s: %w", mnt, err)
		}
		defer func() {
			if err := server.Unmount(); err != nil {
				_ = unix.Unmount(mnt, unix.MNT_DETACH)
			}
		}()
	case !cfg.Reattach:
		// The edge mounted; the kernel's INIT waits on the descriptor.
		opts.DirectMount = false // else go-fuse would mount on /dev/fd/N
		server, err := fuse.NewServer(rfs, fmt.Sprintf("/dev/fd/%d", cfg.FUSE.Fd()), opts)
		if err != nil {
			return fmt.Errorf("layerfs: serving %s: %w", mnt, err)
		}
		go server.Serve()
	default:
		// Taking over: no INIT comes, and go-fuse's server handles the
		// first request, whatever it is, before it returns; requests
		// the dead daemon read are queued again first.
		opts.DirectMount = false
		if err := notifyResend(cfg.FUSE); err != nil {
			d.log.Warn("asking the kernel to resend requests in flight", "err", err)
		}
		go func() {
			server, err := fuse.NewServer(rfs, fmt.Sprintf("/dev/fd/%d", cfg.FUSE.Fd()), opts)
			if err != nil {
				d.log.Error("layerfs: taking over the mount", "err", err)
				stop()
				return
			}
			server.Serve()
		}()
	}

	if err := writeAtomic(filepath.Join(cfg.Dir, pidName), []byte(strconv.Itoa(os.Getpid())+"\n")); err != nil {
		return fmt.Errorf("layerfs: %w", err)
	}
	sock := SocketPath(cfg.Dir)
	os.Remove(sock)
	os.Remove(fdSocketPath(cfg.Dir))
	ln, err := net.Listen("unix", sock)
	if err != nil {
		return fmt.Errorf("layerfs: %w", err)
	}
	os.Chmod(sock, 0o600)
	unlinkOwn := ownSocket(ln, sock)
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) { w.Write([]byte("ok\n")) })
	mux.HandleFunc("POST /layers", d.register)
	mux.HandleFunc("GET /stats", d.stats)
	mux.HandleFunc("POST /drop-cache", func(w http.ResponseWriter, r *http.Request) {
		if n := d.mounted(); n > 0 {
			http.Error(w, fmt.Sprintf("%d image(s) mounted", n), http.StatusConflict)
			return
		}
		// A registration or a read in the last moments may be a mount
		// under way (not in the mount table yet): not idle.
		if time.Since(time.Unix(0, d.lastUsed.Load())) < 2*time.Second {
			http.Error(w, "in use in the last 2 s", http.StatusConflict)
			return
		}
		d.saveTraces()
		if r.URL.Query().Get("traces") == "1" {
			os.RemoveAll(filepath.Join(d.cfg.Dir, traceDir))
			os.MkdirAll(filepath.Join(d.cfg.Dir, traceDir), 0o700)
		}
		d.mu.Lock()
		d.readers = map[string]*Reader{}
		d.mu.Unlock()
		// The kept packs go with the chunks. The old readers' mappings
		// are not unmapped: a read that slipped past the checks above
		// still finds its pages (address space only, per reset).
		if packs, err := filepath.Glob(filepath.Join(d.cfg.Dir, indexDir, "*.meta")); err == nil {
			for _, p := range packs {
				os.Remove(p)
			}
		}
		// The kept descriptors only serve mounted images (a daemon that
		// takes over); with none mounted, the node forgets which artifact
		// each digest came from, and the next registration may name
		// another (another chunk size, or no metadata pack).
		if descs, err := filepath.Glob(filepath.Join(d.cfg.Dir, descDir, "*.json")); err == nil {
			for _, p := range descs {
				os.Remove(p)
			}
		}
		d.cache.Clear()
		w.Write([]byte("dropped\n"))
	})
	mux.HandleFunc("POST /exit-if-idle", func(w http.ResponseWriter, r *http.Request) {
		if n := d.mounted(); n > 0 {
			http.Error(w, fmt.Sprintf("%d image(s) mounted", n), http.StatusConflict)
			return
		}
		d.log.Info("layerfs asked to exit with no image open")
		w.Write([]byte("exiting\n"))
		stop()
	})
	hs := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: time.Minute}
	go hs.Serve(ln)
	if cfg.FUSE != nil {
		fdln, err := net.Listen("unix", fdSocketPath(cfg.Dir))
		if err == nil {
			os.Chmod(fdSocketPath(cfg.Dir), 0o600)
			unlinkFD := ownSocket(fdln, fdSocketPath(cfg.Dir))
			go serveFD(fdln, cfg.FUSE, d.log)
			defer func() {
				fdln.Close()
				unlinkFD()
			}()
		} else {
			d.log.Warn("serving the FUSE descriptor", "err", err)
		}
	}
	defer func() {
		hs.Close()
		unlinkOwn()
	}()
	d.log.Info("layerfs serving", "mount", mnt, "cache_bytes", cfg.CacheBytes, "cached", cache.Size())

	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	defer d.saveTraces()
	for n := 0; ; n++ {
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
			if n%5 == 0 {
				d.saveTraces()
			}
			if cfg.Idle > 0 && time.Since(time.Unix(0, d.lastUsed.Load())) > cfg.Idle && d.mounted() == 0 {
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
// layer instead of failing the sandbox's first read. The descriptor is
// kept (for a daemon that takes over, or a restart) only once that
// worked, and a descriptor that disagrees with one already kept for the
// image, or whose node id another image has, is refused.
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
	if err := d.checkClaim(hex, desc); err != nil {
		http.Error(w, err.Error(), http.StatusConflict)
		return
	}
	rd, err := d.load(r.Context(), hex, &desc)
	if err == nil && rd.Size() > 0 {
		buf := make([]byte, rd.ix.ChunkLen(0))
		_, err = rd.ReadAt(r.Context(), buf, 0)
	}
	if err == nil {
		b, _ := json.Marshal(desc)
		err = writeAtomic(filepath.Join(d.cfg.Dir, descDir, hex+".json"), b)
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

// checkClaim refuses a descriptor of image hex that another kept one
// contradicts: the same image from another index (other bytes under one
// name), or another image with the same node id.
func (d *Daemon) checkClaim(hex string, desc Descriptor) error {
	names, _ := os.ReadDir(filepath.Join(d.cfg.Dir, descDir))
	for _, e := range names {
		other, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok || !layer.IsDigest("sha256:"+other) {
			continue
		}
		if other == hex {
			old, err := readDescriptor(filepath.Join(d.cfg.Dir, descDir, e.Name()))
			if err == nil && (old.Index != desc.Index || old.Meta != desc.Meta) {
				return errdefs.Precondition("image %s is registered on this node with another chunk index or metadata pack (%s)", short(desc.Digest), old.Source)
			}
			continue
		}
		if nodeID(other) == nodeID(hex) {
			return errdefs.Precondition("image %s shares its node id with image %s on this node", short(desc.Digest), other[:16])
		}
	}
	return nil
}

func readDescriptor(path string) (Descriptor, error) {
	var desc Descriptor
	b, err := os.ReadFile(path)
	if err != nil {
		return desc, err
	}
	if err := json.Unmarshal(b, &desc); err != nil {
		return desc, fmt.Errorf("descriptor %s: %w", filepath.Base(path), err)
	}
	return desc, desc.check()
}

// loading is a reader being made; waiters share its result.
type loading struct {
	done chan struct{}
	rd   *Reader
	err  error
}

// reader returns the reader of the image hex, from its kept descriptor.
func (d *Daemon) reader(ctx context.Context, hex string) (*Reader, error) {
	return d.load(ctx, hex, nil)
}

// load returns the reader of the image hex, made once from desc (nil: the
// kept descriptor) and its index (kept on disk after the first fetch,
// checked by digest). No lock is held while the index is fetched: a slow
// source stalls only the reads of its own images.
func (d *Daemon) load(ctx context.Context, hex string, desc *Descriptor) (*Reader, error) {
	if !layer.IsDigest("sha256:" + hex) {
		return nil, errdefs.NotFound("no image %q", hex)
	}
	d.mu.Lock()
	if rd, ok := d.readers[hex]; ok {
		d.mu.Unlock()
		return rd, nil
	}
	if l, ok := d.loads[hex]; ok {
		d.mu.Unlock()
		select {
		case <-l.done:
			return l.rd, l.err
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	l := &loading{done: make(chan struct{})}
	d.loads[hex] = l
	d.mu.Unlock()
	l.rd, l.err = d.make(ctx, hex, desc)
	d.mu.Lock()
	delete(d.loads, hex)
	if l.err == nil {
		d.readers[hex] = l.rd
	}
	d.mu.Unlock()
	close(l.done)
	if l.err == nil && d.cfg.Prefetch {
		if trace := readTrace(filepath.Join(d.cfg.Dir, traceDir, l.rd.traceKey)); len(trace) > 0 {
			d.log.Info("prefetching a layer's recorded trace", "layer", short(l.rd.digest), "chunks", len(trace))
			go l.rd.Prefetch(context.Background(), trace, 4)
		}
	}
	return l.rd, l.err
}

func (d *Daemon) make(ctx context.Context, hex string, given *Descriptor) (*Reader, error) {
	var desc Descriptor
	if given != nil {
		desc = *given
	} else {
		var err error
		desc, err = readDescriptor(filepath.Join(d.cfg.Dir, descDir, hex+".json"))
		if errors.Is(err, fs.ErrNotExist) {
			return nil, errdefs.NotFound("image %s is not registered", hex)
		}
		if err != nil {
			return nil, err
		}
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
	rd.traceKey = strings.TrimPrefix(desc.Index, "sha256:")
	if desc.Meta != "" {
		if rd.meta, err = d.metaPack(ctx, repo, desc, rd); err != nil {
			return nil, err
		}
	}
	return rd, nil
}

// metaPack returns the metadata pack of desc: kept beside the indexes,
// or fetched whole (and kept), checked against its digest either way,
// and mapped from its file.
func (d *Daemon) metaPack(ctx context.Context, repo *image.Repo, desc Descriptor, rd *Reader) (*MetaPack, error) {
	p := filepath.Join(d.cfg.Dir, indexDir, strings.TrimPrefix(desc.Meta, "sha256:")+".meta")
	if m, err := openMetaPack(p, desc.Meta, desc.Size); err == nil {
		return m, nil
	}
	start := time.Now()
	fctx, cancel := context.WithTimeout(ctx, 4*d.cfg.Policy.withDefaults().Timeout)
	err := fetchMetaPack(fctx, repo, desc.Meta, desc.MetaSize, desc.Size, p)
	cancel()
	rd.Stats.Requests.Add(1)
	rd.Stats.FetchNanos.Add(int64(time.Since(start)))
	if err != nil {
		rd.Stats.FetchErrors.Add(1)
		return nil, fmt.Errorf("fetching the metadata of %s: %w", short(desc.Digest), err)
	}
	rd.Stats.BytesFetched.Add(desc.MetaSize)
	d.log.Info("fetched a layer's metadata", "layer", short(desc.Digest), "bytes", desc.MetaSize, "ms", time.Since(start).Milliseconds())
	m, err := openMetaPack(p, desc.Meta, desc.Size)
	if err != nil {
		return nil, fmt.Errorf("metadata of %s: %w", short(desc.Digest), err)
	}
	return m, nil
}

// saveTraces keeps each layer's trace: the chunks the earlier trace had,
// in its order, then those read for the first time since.
func (d *Daemon) saveTraces() {
	d.mu.Lock()
	readers := make(map[string]*Reader, len(d.readers))
	for k, v := range d.readers {
		readers[k] = v
	}
	d.mu.Unlock()
	for _, rd := range readers {
		now := rd.Trace()
		if len(now) == 0 || rd.traceKey == "" {
			continue
		}
		p := filepath.Join(d.cfg.Dir, traceDir, rd.traceKey)
		old := readTrace(p)
		seen := make(map[int]bool, len(old))
		for _, i := range old {
			seen[i] = true
		}
		merged := old
		for _, i := range now {
			if !seen[i] {
				merged = append(merged, i)
			}
		}
		if len(merged) == len(old) {
			continue
		}
		b := make([]byte, 4*len(merged))
		for k, i := range merged {
			binary.LittleEndian.PutUint32(b[4*k:], uint32(i))
		}
		if err := writeAtomic(p, b); err != nil {
			d.log.Warn("keeping a layer's trace", "err", err)
		}
	}
}

// readTrace reads a trace file (chunk numbers, u32 little-endian).
func readTrace(p string) []int {
	b, err := os.ReadFile(p)
	if err != nil || len(b)%4 != 0 {
		return nil
	}
	out := make([]int, len(b)/4)
	for k := range out {
		out[k] = int(binary.LittleEndian.Uint32(b[4*k:]))
	}
	return out
}

// LayerStats are one image's figures in the daemon's statistics.
type LayerStats struct {
	Digest        string  `json:"digest"`
	SizeBytes     int64   `json:"size_bytes"`
	ChunkSize     int     `json:"chunk_size"`
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
	// MetaReads counts reads served from the metadata pack, MetaBytes
	// its size (0: the artifact has none).
	MetaReads int64 `json:"meta_reads"`
	MetaBytes int64 `json:"meta_bytes"`
	// FromPackBytes counts the bytes of fetched chunks taken from the
	// pack instead of the source; ReadBytes is how much of the image
	// the node has read (pack and chunks, what they share once).
	FromPackBytes int64 `json:"from_pack_bytes"`
	ReadBytes     int64 `json:"read_bytes"`
	// PackMismatches counts chunks completed from the pack that failed
	// their digest while the source's bytes passed: the pack is wrong,
	// and no longer used.
	PackMismatches int64 `json:"pack_mismatches"`
}

// DaemonStats answer GET /stats.
type DaemonStats struct {
	CacheBytes    int64 `json:"cache_bytes"`
	CacheMaxBytes int64 `json:"cache_max_bytes"`
	// OpenImages counts the images mounted on the node (EROFS mounts of
	// the daemon's files in its mount namespace).
	OpenImages int64        `json:"open_images"`
	Layers     []LayerStats `json:"layers"`
	// DockerConfig is the registry config the daemon reads with (its
	// --docker-config; a path, never its content).
	DockerConfig string `json:"docker_config,omitempty"`
}

func (d *Daemon) stats(w http.ResponseWriter, r *http.Request) {
	out := DaemonStats{CacheBytes: d.cache.Size(), CacheMaxBytes: d.cfg.CacheBytes, OpenImages: int64(d.mounted()), Layers: []LayerStats{},
		DockerConfig: d.cfg.DockerConfig}
	// The readers are copied out: every FUSE call takes d.mu, and a
	// reader's figures take its own lock.
	d.mu.Lock()
	readers := make([]*Reader, 0, len(d.readers))
	for _, rd := range d.readers {
		readers = append(readers, rd)
	}
	d.mu.Unlock()
	for _, rd := range readers {
		s := &rd.Stats
		ls := LayerStats{Digest: rd.digest, SizeBytes: rd.ix.Size, ChunkSize: rd.ix.ChunkSize, Chunks: rd.ix.Chunks(), ChunksTouched: s.ChunksTouched.Load(),
			BytesFetched: s.BytesFetched.Load(), Requests: s.Requests.Load(), FetchErrors: s.FetchErrors.Load(),
			FetchSeconds: time.Duration(s.FetchNanos.Load()).Seconds(), CacheHits: s.CacheHits.Load(),
			CacheMisses: s.CacheMisses.Load(), BadChunks: s.BadChunks.Load(), MetaReads: s.MetaReads.Load(),
			FromPackBytes: s.FromPack.Load(), ReadBytes: rd.ReadBytes(), PackMismatches: s.PackMismatches.Load()}
		if rd.meta != nil {
			ls.MetaBytes = rd.meta.Bytes()
		}
		if ls.Chunks > 0 {
			ls.ReadFraction = float64(ls.ChunksTouched) / float64(ls.Chunks)
		}
		out.Layers = append(out.Layers, ls)
	}
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

// mounted counts the EROFS mounts of this daemon's images in its mount
// namespace (the edge's). It is read from the mount table rather than
// counted from opens, so a daemon that took over from another knows it.
func (d *Daemon) mounted() int { return mountedImages(d.cfg.Dir) }

// mountedImages counts the EROFS mounts of the images of the daemon of
// dir in this mount namespace.
func mountedImages(dir string) int {
	entries, err := mountinfo.Read()
	if err != nil {
		return 1 // unknown: say busy
	}
	prefix := MountDir(dir) + "/"
	n := 0
	for _, e := range entries {
		if e.FSType == "erofs" && strings.HasPrefix(e.Source, prefix) {
			n++
		}
	}
	return n
}

// notifyResend asks the kernel to send again the requests an earlier
// daemon read and never answered (FUSE_NOTIFY_RESEND, Linux 6.9): their
// callers would otherwise wait forever.
func notifyResend(f *os.File) error {
	const notifyResend = 7
	var hdr [16]byte // fuse_out_header: len, error (the notify code), unique 0
	binary.LittleEndian.PutUint32(hdr[0:], 16)
	binary.LittleEndian.PutUint32(hdr[4:], notifyResend)
	_, err := unix.Write(int(f.Fd()), hdr[:])
	return err
}

// Node ids are a function of the image's digest, so that a daemon taking
// over a mount from another answers for the ids the kernel already holds.
const rootID = 1

func nodeID(hexDigest string) uint64 {
	b, err := hex.DecodeString(hexDigest[:16])
	if err != nil || len(b) != 8 {
		return 0
	}
	return binary.BigEndian.Uint64(b) | 1<<63
}

// rawFS is the daemon's filesystem: a root directory of one read-only
// file per registered image. It keeps no per-node state of the kernel's:
// a node id names its image, and file handles are not used.
type rawFS struct {
	fuse.RawFileSystem
	d *Daemon
}

func (f *rawFS) String() string { return fsName }

const attrTTL = time.Hour

func (f *rawFS) fillRoot(a *fuse.Attr) {
	a.Ino = rootID
	a.Mode = fuse.S_IFDIR | 0o555
	a.Nlink = 2
}

func fillImage(a *fuse.Attr, id uint64, size int64) {
	a.Ino = id
	a.Mode = fuse.S_IFREG | 0o444
	a.Nlink = 1
	a.Size = uint64(size)
	a.Blocks = (a.Size + 511) / 512
	a.Blksize = 4096
}

// byID finds the reader of node id: among the loaded readers, else among
// the descriptors on disk (a daemon that took over).
func (f *rawFS) byID(id uint64) (*Reader, syscall.Errno) {
	f.d.mu.Lock()
	for hx, rd := range f.d.readers {
		if nodeID(hx) == id {
			f.d.mu.Unlock()
			return rd, 0
		}
	}
	f.d.mu.Unlock()
	names, _ := os.ReadDir(filepath.Join(f.d.cfg.Dir, descDir))
	for _, e := range names {
		hx, ok := strings.CutSuffix(e.Name(), ".json")
		if ok && layer.IsDigest("sha256:"+hx) && nodeID(hx) == id {
			rd, err := f.d.reader(context.Background(), hx)
			if err != nil {
				f.d.log.Warn("loading a layer image", "image", hx, "err", err)
				return nil, syscall.EIO
			}
			return rd, 0
		}
	}
	return nil, syscall.ENOENT
}

func (f *rawFS) Lookup(cancel <-chan struct{}, header *fuse.InHeader, name string, out *fuse.EntryOut) fuse.Status {
	f.d.used()
	if header.NodeId != rootID {
		return fuse.ENOTDIR
	}
	hx, ok := strings.CutSuffix(name, fileSuffix)
	if !ok {
		return fuse.ENOENT
	}
	rd, err := f.d.reader(context.Background(), hx)
	if errors.Is(err, errdefs.ErrNotFound) {
		return fuse.ENOENT
	}
	if err != nil {
		f.d.log.Warn("looking up a layer image", "image", hx, "err", err)
		return fuse.EIO
	}
	out.NodeId, out.Generation = nodeID(hx), 1
	fillImage(&out.Attr, out.NodeId, rd.Size())
	out.SetEntryTimeout(attrTTL)
	out.SetAttrTimeout(attrTTL)
	return fuse.OK
}

func (f *rawFS) Forget(nodeid, nlookup uint64) {}

func (f *rawFS) GetAttr(cancel <-chan struct{}, in *fuse.GetAttrIn, out *fuse.AttrOut) fuse.Status {
	if in.NodeId == rootID {
		f.fillRoot(&out.Attr)
	} else {
		rd, errno := f.byID(in.NodeId)
		if errno != 0 {
			return fuse.Status(errno)
		}
		fillImage(&out.Attr, in.NodeId, rd.Size())
	}
	out.SetTimeout(attrTTL)
	return fuse.OK
}

func (f *rawFS) Access(cancel <-chan struct{}, in *fuse.AccessIn) fuse.Status {
	if in.Mask&unix.W_OK != 0 {
		return fuse.Status(syscall.EROFS)
	}
	return fuse.OK
}

func (f *rawFS) Open(cancel <-chan struct{}, in *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	f.d.used()
	if in.Flags&(syscall.O_WRONLY|syscall.O_RDWR|syscall.O_TRUNC|syscall.O_APPEND) != 0 {
		return fuse.Status(syscall.EROFS)
	}
	if _, errno := f.byID(in.NodeId); errno != 0 {
		return fuse.Status(errno)
	}
	// The image never changes: what the kernel has cached stays valid.
	out.OpenFlags = fuse.FOPEN_KEEP_CACHE
	return fuse.OK
}

func (f *rawFS) Read(cancel <-chan struct{}, in *fuse.ReadIn, buf []byte) (fuse.ReadResult, fuse.Status) {
	rd, errno := f.byID(in.NodeId)
	if errno != 0 {
		return nil, fuse.Status(errno)
	}
	off := int64(in.Offset)
	if off >= rd.Size() {
		return fuse.ReadResultData(nil), fuse.OK
	}
	n := min(int(in.Size), len(buf))
	got, err := rd.ReadAt(context.Background(), buf[:n], off)
	if err != nil && got == 0 {
		f.d.log.Warn("reading a layer image", "digest", rd.digest, "offset", off, "err", err)
		return nil, fuse.EIO
	}
	return fuse.ReadResultData(buf[:got]), fuse.OK
}

func (f *rawFS) Release(cancel <-chan struct{}, in *fuse.ReleaseIn) {}

func (f *rawFS) OpenDir(cancel <-chan struct{}, in *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	if in.NodeId != rootID {
		return fuse.ENOTDIR
	}
	return fuse.OK
}

func (f *rawFS) ReadDir(cancel <-chan struct{}, in *fuse.ReadIn, out *fuse.DirEntryList) fuse.Status {
	names, _ := os.ReadDir(filepath.Join(f.d.cfg.Dir, descDir))
	var es []fuse.DirEntry
	for _, e := range names {
		if hx, ok := strings.CutSuffix(e.Name(), ".json"); ok && layer.IsDigest("sha256:"+hx) {
			es = append(es, fuse.DirEntry{Name: hx + fileSuffix, Mode: fuse.S_IFREG, Ino: nodeID(hx)})
		}
	}
	sort.Slice(es, func(i, j int) bool { return es[i].Name < es[j].Name })
	for i := int(in.Offset); i < len(es); i++ {
		es[i].Off = uint64(i + 1)
		if !out.AddDirEntry(es[i]) {
			break
		}
	}
	return fuse.OK
}

func (f *rawFS) ReleaseDir(in *fuse.ReleaseIn) {}

func (f *rawFS) StatFs(cancel <-chan struct{}, in *fuse.InHeader, out *fuse.StatfsOut) fuse.Status {
	out.Bsize, out.Frsize, out.NameLen = 4096, 4096, 255
	return fuse.OK
}

// ownSocket keeps ln (listening on the socket file path) from removing
// the file when it closes, and returns what removes it only if it is
// still this listener's: a daemon that exits must not take away the
// socket of the one that replaced it (same path, a newer file), which
// would leave that one running and unreachable.
func ownSocket(ln net.Listener, path string) (unlink func()) {
	if ul, ok := ln.(*net.UnixListener); ok {
		ul.SetUnlinkOnClose(false)
	}
	var mine unix.Stat_t
	if err := unix.Stat(path, &mine); err != nil {
		return func() {}
	}
	return func() {
		var now unix.Stat_t
		if unix.Stat(path, &now) == nil && now.Ino == mine.Ino && now.Dev == mine.Dev {
			os.Remove(path)
		}
	}
}
