package remote

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/image/registrytest"
	"github.com/dsecproject/dsec/internal/layer"
	"github.com/dsecproject/dsec/internal/store"
)

// lazyWorld is a registry holding one pushed layer, a catalog that names
// it by reference only, and a layer daemon serving it.
type lazyWorld struct {
	reg    *registrytest.Registry
	layer  api.Layer // as added
	tree   string    // the tree the layer was built from
	src    *Source
	dir    string
	cancel context.CancelFunc
	done   chan error
}

func newLazyWorld(t *testing.T, cacheBytes int64, policy FetchPolicy) *lazyWorld {
	t.Helper()
	w := newLazyCatalog(t, policy)
	dctx, cancel := context.WithCancel(context.Background())
	w.cancel = cancel
	go func() { w.done <- Serve(dctx, DaemonConfig{Dir: w.dir, CacheBytes: cacheBytes, Policy: policy}) }()
	t.Cleanup(w.stop)
	deadline := time.Now().Add(10 * time.Second)
	for !w.src.healthy(context.Background()) {
		if time.Now().After(deadline) {
			t.Fatal("daemon did not come up")
		}
		time.Sleep(20 * time.Millisecond)
	}
	return w
}

// newLazyCatalog is a lazyWorld without a daemon.
func newLazyCatalog(t *testing.T, policy FetchPolicy) *lazyWorld {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: mounts FUSE and EROFS")
	}
	if _, err := os.Stat("/dev/fuse"); err != nil {
		t.Skip("needs /dev/fuse")
	}
	reg := registrytest.Start(t)
	st, l, tree := newLayerStore(t)
	ctx := context.Background()
	target := Scheme + reg.Addr + "/dsec/lazy:1"
	if _, err := Push(ctx, st, l.Ref, target, PushOptions{Insecure: true}); err != nil {
		t.Fatal(err)
	}
	cat, err := layer.NewStore(t.TempDir(), store.NewMemory(), nil)
	must(t, err)
	t.Cleanup(func() { cat.Close() })
	added, err := Add(ctx, cat, "base/lazy:1", target, AddOptions{Insecure: true})
	must(t, err)
	w := &lazyWorld{reg: reg, layer: added, tree: tree, dir: t.TempDir(), done: make(chan error, 1)}
	w.src = &Source{Store: cat, Dir: w.dir, PulledDir: filepath.Join(w.dir, "pulled"), Policy: policy}
	return w
}

func (w *lazyWorld) stop() {
	if w.cancel != nil {
		w.cancel()
		<-w.done
		w.cancel = nil
	}
}

func (w *lazyWorld) stats(t *testing.T) DaemonStats {
	t.Helper()
	resp, err := w.src.client().Get("http://layerfs/stats")
	must(t, err)
	defer resp.Body.Close()
	var s DaemonStats
	must(t, jsonDecode(resp, &s))
	return s
}

// mountImage mounts the EROFS image at path read-only and returns where.
func mountImage(t *testing.T, path string) string {
	t.Helper()
	mnt := t.TempDir()
	if err := unix.Mount(path, mnt, "erofs", unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV, ""); err != nil {
		t.Fatalf("mounting %s: %v", path, err)
	}
	t.Cleanup(func() { unix.Unmount(mnt, unix.MNT_DETACH) })
	return mnt
}

// sumTree maps each regular file below root to its sha256.
func sumTree(t *testing.T, root string) map[string][sha256.Size]byte {
	t.Helper()
	out := map[string][sha256.Size]byte{}
	must(t, filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return err
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		out[rel] = sha256.Sum256(b)
		return nil
	}))
	return out
}

// A sandbox's view of a registry-backed layer is the tree it was built
// from, read through a cache smaller than the image: the cache stays in
// its bound, and the figures say what was fetched.
func TestLazyLayerReadsTheRightBytes(t *testing.T) {
	w := newLazyWorld(t, 1<<20, FetchPolicy{Timeout: 5 * time.Second, Attempts: 2})
	path, release, err := w.src.Open(context.Background(), w.layer.Digest)
	must(t, err)
	defer release()
	if !strings.HasPrefix(path, MountDir(w.dir)) {
		t.Fatalf("lazy layer opened at %s, not on the layer daemon's mount", path)
	}
	mnt := mountImage(t, path)
	want, got := sumTree(t, w.tree), sumTree(t, mnt)
	if len(want) != len(got) {
		t.Fatalf("files: want %d, got %d", len(want), len(got))
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s differs", k)
		}
	}
	s := w.stats(t)
	if s.CacheBytes > 1<<20 || s.CacheBytes == 0 {
		t.Errorf("cache holds %d bytes, bound %d", s.CacheBytes, 1<<20)
	}
	if len(s.Layers) != 1 || s.Layers[0].BytesFetched < 3<<20 || s.Layers[0].ReadFraction <= 0.5 || s.Layers[0].BadChunks != 0 {
		t.Errorf("stats: %+v", s.Layers)
	}
	if s.OpenImages != 1 {
		t.Errorf("open images: %d, want 1 (the mount)", s.OpenImages)
	}
	// The same figures as the edge's metrics.
	reg := prometheus.NewRegistry()
	reg.MustRegister(NewCollector(w.src))
	mfs, err := reg.Gather()
	must(t, err)
	byName := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.Metric {
			switch {
			case m.Counter != nil:
				byName[mf.GetName()] += m.Counter.GetValue()
			case m.Gauge != nil:
				byName[mf.GetName()] += m.Gauge.GetValue()
			}
		}
	}
	if byName["dsec_layer_fetched_bytes_total"] != float64(s.Layers[0].BytesFetched) || byName["dsec_layer_images_mounted"] != 1 ||
		byName["dsec_layer_cache_misses_total"] == 0 || byName["dsec_layer_read_fraction"] != s.Layers[0].ReadFraction {
		t.Errorf("metrics: %v", byName)
	}
	// The image is read-only on the daemon's mount.
	if f, err := os.OpenFile(path, os.O_WRONLY, 0); err == nil {
		f.Close()
		t.Error("the image opened for writing")
	}
	// Unmounted, nothing holds it open: the daemon may go.
	must(t, unix.Unmount(mnt, 0))
	deadline := time.Now().Add(5 * time.Second)
	for w.stats(t).OpenImages != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("open images after unmount: %d", w.stats(t).OpenImages)
		}
		time.Sleep(20 * time.Millisecond)
	}
	w.src.EdgeStopped()
	select {
	case err := <-w.done:
		w.cancel = nil
		must(t, err)
	case <-time.After(5 * time.Second):
		t.Fatal("the daemon did not exit when the edge stopped with no image open")
	}
	if fuseMounted(MountDir(w.dir)) {
		t.Fatal("the daemon left its mount")
	}
}

// A chunk the source changed is refused with EIO, never passed on; the
// chunks around it read.
func TestLazyLayerRefusesACorruptedChunk(t *testing.T) {
	w := newLazyWorld(t, 64<<20, FetchPolicy{Timeout: 5 * time.Second, Attempts: 2})
	cs := int64(w.layer.Remote.ChunkSize)
	corrupt(t, w.reg.BlobPath(w.layer.Digest), 5*cs+7)
	path, release, err := w.src.Open(context.Background(), w.layer.Digest)
	must(t, err)
	defer release()
	f, err := os.Open(path)
	must(t, err)
	defer f.Close()
	buf := make([]byte, 4096)
	if _, err := f.ReadAt(buf, 4*cs); err != nil {
		t.Fatalf("chunk 4: %v", err)
	}
	if _, err := f.ReadAt(buf, 5*cs); !errors.Is(err, syscall.EIO) {
		t.Fatalf("corrupted chunk 5: %v, want EIO", err)
	}
	if s := w.stats(t); s.Layers[0].BadChunks == 0 {
		t.Fatalf("bad chunk not counted: %+v", s.Layers[0])
	}
}

// The source stopped mid-run: chunks in the node's cache still read
// (after the kernel's page cache is dropped), uncached ones fail with
// EIO within the fetch policy's bound instead of hanging, and a layer
// not yet opened is refused with a clear error.
func TestLazyLayerSourceDown(t *testing.T) {
	pol := FetchPolicy{Timeout: time.Second, Attempts: 2}
	w := newLazyWorld(t, 64<<20, pol)
	cs := int64(w.layer.Remote.ChunkSize)
	path, release, err := w.src.Open(context.Background(), w.layer.Digest)
	must(t, err)
	defer release()
	f, err := os.Open(path)
	must(t, err)
	defer f.Close()
	first := make([]byte, 2*cs)
	if _, err := f.ReadAt(first, 0); err != nil {
		t.Fatal(err)
	}
	w.reg.Stop()
	must(t, unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED))
	again := make([]byte, 2*cs)
	if _, err := f.ReadAt(again, 0); err != nil || !bytes.Equal(first, again) {
		t.Fatalf("cached chunks with the source down: %v", err)
	}
	start := time.Now()
	buf := make([]byte, 4096)
	if _, err := f.ReadAt(buf, 8*cs); !errors.Is(err, syscall.EIO) {
		t.Fatalf("uncached chunk with the source down: %v, want EIO", err)
	}
	if took := time.Since(start); took > 10*time.Second {
		t.Fatalf("the failed read took %v", took)
	}
	// Another layer of the same source is refused at open.
	other := w.layer
	other.Digest = "sha256:" + strings.Repeat("ab", 32)
	other.Ref = "base/lazy-other:1"
	other.Remote = &api.LayerRemote{}
	*other.Remote = *w.layer.Remote
	other.Remote.Index = "sha256:" + strings.Repeat("cd", 32) // nothing of it cached
	_, err = w.src.openLazy(context.Background(), other)
	if !errors.Is(err, errdefs.ErrUnavailable) || !strings.Contains(err.Error(), "cannot be read") {
		t.Fatalf("open with the source down: %v", err)
	}
	// Back up, the uncached chunk reads.
	w.reg.Restart()
	if _, err := f.ReadAt(buf, 8*cs); err != nil {
		t.Fatalf("after the source came back: %v", err)
	}
}

// A pull-full layer is fetched whole, checked, and removed on release.
func TestFullPull(t *testing.T) {
	w := newLazyWorld(t, 1<<20, FetchPolicy{Timeout: 5 * time.Second, Attempts: 2})
	l := w.layer
	l.Remote = &api.LayerRemote{}
	*l.Remote = *w.layer.Remote
	l.Remote.Pull = api.PullFull
	path, release, err := w.src.pull(context.Background(), l)
	must(t, err)
	b, err := os.ReadFile(path)
	must(t, err)
	if digestOf(b) != l.Digest {
		t.Fatal("pulled image has another digest")
	}
	release()
	if fileExists(path) {
		t.Fatal("release left the pulled image with nothing to keep it in (PulledKeepBytes 0)")
	}

	// With room to keep it, a released image stays for the next use,
	// which then needs no source; an image held is never dropped.
	w.src.PulledKeepBytes = l.SizeBytes
	path, release, err = w.src.pull(context.Background(), l)
	must(t, err)
	_, release2, err := w.src.pull(context.Background(), l)
	must(t, err)
	release()
	w.src.PulledKeepBytes = 0
	w.src.trimPulled()
	if !fileExists(path) {
		t.Fatal("an image still held was dropped")
	}
	w.src.PulledKeepBytes = l.SizeBytes
	release2()
	release2() // twice: counted once
	if !fileExists(path) {
		t.Fatal("the released image was not kept within the bound")
	}
	w.reg.Stop()
	again, release3, err := w.src.pull(context.Background(), l)
	if err != nil || again != path {
		t.Fatalf("the kept image with the source stopped: %s, %v", again, err)
	}
	release3()
	w.src.PulledKeepBytes = l.SizeBytes - 1
	w.src.trimPulled()
	if fileExists(path) {
		t.Fatal("an unheld image past the bound was kept")
	}
	w.reg.Restart()
	// A source whose image is not the layer's is refused.
	corrupt(t, w.reg.BlobPath(l.Digest), 10)
	if _, _, err := w.src.pull(context.Background(), l); err == nil || !strings.Contains(err.Error(), "is not the layer's") {
		t.Fatalf("pull of a corrupted image: %v", err)
	}
}

func jsonDecode(resp *http.Response, v any) error {
	return jsonNewDecoder(resp).Decode(v)
}

func jsonNewDecoder(resp *http.Response) *json.Decoder { return json.NewDecoder(resp.Body) }

// A layer's trace (the chunks read, in order) outlives the daemon's
// reader; the next time the layer is opened they are fetched in the
// background, so the workload's reads find them cached.
func TestTracePrefetch(t *testing.T) {
	pol := FetchPolicy{Timeout: 5 * time.Second, Attempts: 2}
	w := newLazyCatalog(t, pol)
	dctx, cancel := context.WithCancel(context.Background())
	w.cancel = cancel
	go func() {
		w.done <- Serve(dctx, DaemonConfig{Dir: w.dir, CacheBytes: 64 << 20, Policy: pol, Prefetch: true})
	}()
	t.Cleanup(w.stop)
	for !w.src.healthy(context.Background()) {
		time.Sleep(20 * time.Millisecond)
	}
	ctx := context.Background()
	cs := int64(w.layer.Remote.ChunkSize)
	path, _, err := w.src.Open(ctx, w.layer.Digest)
	must(t, err)
	read := func() {
		t.Helper()
		f, err := os.Open(path)
		must(t, err)
		defer f.Close()
		must(t, unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED))
		buf := make([]byte, 4096)
		for _, i := range []int64{9, 3, 4} {
			if _, err := f.ReadAt(buf, i*cs); err != nil {
				t.Fatal(err)
			}
		}
	}
	read()
	// Refused while the daemon was just used (a mount may be under way).
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		ok, err := w.src.DropCache(ctx, false)
		if ok && err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("drop-cache: %v %v", ok, err)
		}
	}
	if tr := readTrace(filepath.Join(w.dir, traceDir, strings.TrimPrefix(w.layer.Remote.Index, "sha256:"))); len(tr) != 4 || tr[0] != 0 || tr[1] != 9 {
		t.Fatalf("trace: %v, want [0 9 3 4] (chunk 0 read at registration)", tr)
	}
	// Opened again: the trace is prefetched.
	_, _, err = w.src.Open(ctx, w.layer.Digest)
	must(t, err)
	deadline := time.Now().Add(10 * time.Second)
	for {
		s := w.stats(t)
		if len(s.Layers) == 1 && s.Layers[0].BytesFetched >= 4*cs {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("trace not prefetched: %+v", s.Layers)
		}
		time.Sleep(20 * time.Millisecond)
	}
	before := w.stats(t).Layers[0].Requests
	read()
	if after := w.stats(t).Layers[0].Requests; after != before {
		t.Fatalf("the workload's reads made %d requests after the prefetch", after-before)
	}
}

// A walk of a registry-backed layer's tree (names, modes, sizes, links:
// no file read) is served from the metadata pack fetched at registration:
// no chunk beyond the first, which registration reads to check the
// source. Without the pack the same walk fetches most of the image,
// since mkfs.erofs interleaves metadata with file data.
func TestMetadataWalkFetchesNoChunk(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: mounts FUSE and EROFS")
	}
	if _, err := os.Stat("/dev/fuse"); err != nil {
		t.Skip("needs /dev/fuse")
	}
	img := mkfsImage(t, 16, 24, 40000)
	reg := registrytest.Start(t)
	st, err := layer.NewStore(t.TempDir(), store.NewMemory(), nil)
	must(t, err)
	t.Cleanup(func() { st.Close() })
	ctx := context.Background()
	// The tree as the kernel shows it: the image mounted directly.
	want := walkTree(t, mountImage(t, img))

	ref, _ := layer.ParseRef("base/meta-walk:1")
	l, err := st.BuildFromDir(ctx, ref, mountImage(t, img), layer.BuildOptions{}, nil)
	must(t, err)
	target := Scheme + reg.Addr + "/dsec/meta-walk:1"
	_, err = Push(ctx, st, l.Ref, target, PushOptions{Insecure: true, ChunkSize: 64 << 10})
	must(t, err)

	walk := func(withPack bool) LayerStats {
		cat, err := layer.NewStore(t.TempDir(), store.NewMemory(), nil)
		must(t, err)
		t.Cleanup(func() { cat.Close() })
		added, err := Add(ctx, cat, "base/meta-walk:1", target, AddOptions{Insecure: true})
		must(t, err)
		if added.Remote.Meta == "" || added.Remote.MetaSize <= 0 {
			t.Fatalf("added layer names no metadata pack: %+v", added.Remote)
		}
		if !withPack {
			// One pack per digest in a catalog: the entry goes first.
			must(t, cat.Delete(added.Ref, nil))
			added.Remote.Meta, added.Remote.MetaSize = "", 0
			added, err = cat.AddRemote(added, layer.BuildOptions{})
			must(t, err)
		}
		dir := t.TempDir()
		src := &Source{Store: cat, Dir: dir, PulledDir: filepath.Join(dir, "pulled")}
		dctx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- Serve(dctx, DaemonConfig{Dir: dir, CacheBytes: 64 << 20}) }()
		w := &lazyWorld{src: src, cancel: cancel, done: done}
		t.Cleanup(w.stop)
		for deadline := time.Now().Add(10 * time.Second); !src.healthy(ctx); {
			if time.Now().After(deadline) {
				t.Fatal("daemon did not come up")
			}
			time.Sleep(20 * time.Millisecond)
		}
		path, release, err := src.Open(ctx, added.Digest)
		must(t, err)
		t.Cleanup(release)
		mnt := mountImage(t, path)
		if got := walkTree(t, mnt); len(got) != len(want) {
			t.Fatalf("walk found %d entries, the image has %d", len(got), len(want))
		} else {
			for k, v := range want {
				if got[k] != v {
					t.Fatalf("%s: %s, want %s", k, got[k], v)
				}
			}
		}
		s := w.stats(t)
		if len(s.Layers) != 1 {
			t.Fatalf("stats: %+v", s)
		}
		unix.Unmount(mnt, unix.MNT_DETACH)
		// A cold node for the next measure: the kept pack goes with the
		// chunks.
		// Refused while just used (a mount may be under way), then done.
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(200 * time.Millisecond) {
			ok, err := src.DropCache(ctx, false)
			if ok && err == nil {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("drop cache: %v %v", ok, err)
			}
		}
		if packs, _ := filepath.Glob(filepath.Join(dir, indexDir, "*.meta")); len(packs) != 0 {
			t.Errorf("kept packs after dropping the cache: %v", packs)
		}
		if descs, _ := filepath.Glob(filepath.Join(dir, descDir, "*.json")); len(descs) != 0 {
			t.Errorf("kept descriptors after dropping the cache with nothing mounted: %v", descs)
		}
		return s.Layers[0]
	}
	with, without := walk(true), walk(false)
	t.Logf("walk of %d entries, %d chunks of 64 KiB: with the pack (%d KiB) %d chunks touched, %d reads from it, %d KiB fetched; without %d chunks, %d KiB",
		len(want), with.Chunks, with.MetaBytes>>10, with.ChunksTouched, with.MetaReads, with.BytesFetched>>10, without.ChunksTouched, without.BytesFetched>>10)
	if with.ChunksTouched > 1 || with.MetaReads == 0 || with.MetaBytes == 0 {
		t.Errorf("with the pack: %+v (want at most the first chunk touched)", with)
	}
	if without.ChunksTouched < 4*max(with.ChunksTouched, 1) {
		t.Errorf("without the pack the walk touched %d chunks: the comparison shows nothing", without.ChunksTouched)
	}
}

// walkTree describes every entry below root: type, mode, size, link
// target; no file is opened.
func walkTree(t *testing.T, root string) map[string]string {
	t.Helper()
	out := map[string]string{}
	must(t, filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		fi, err := os.Lstat(p)
		if err != nil {
			return err
		}
		desc := fmt.Sprintf("%v %d", fi.Mode(), fi.Size())
		if fi.Mode()&os.ModeSymlink != 0 {
			l, err := os.Readlink(p)
			if err != nil {
				return err
			}
			desc += " -> " + l
		}
		rel, _ := filepath.Rel(root, p)
		out[rel] = desc
		return nil
	}))
	return out
}

// A node's full pull sends the credentials of its registry config
// (dsec up/edge --registry-config); without them the registry refuses.
func TestFullPullWithRegistryConfig(t *testing.T) {
	w := newLazyCatalog(t, FetchPolicy{Timeout: 5 * time.Second, Attempts: 1})
	u, _ := url.Parse("http://" + w.reg.Addr)
	rp := httputil.NewSingleHostReverseProxy(u)
	srv := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if u, p, ok := r.BasicAuth(); !ok || u != "node" || p != "pw" {
			rw.Header().Set("Www-Authenticate", `Basic realm="t"`)
			http.Error(rw, `{"errors":[{"code":"UNAUTHORIZED"}]}`, http.StatusUnauthorized)
			return
		}
		rp.ServeHTTP(rw, r)
	}))
	defer srv.Close()
	host := strings.TrimPrefix(srv.URL, "http://")
	l := w.layer
	l.Remote = &api.LayerRemote{}
	*l.Remote = *w.layer.Remote
	l.Remote.Pull = api.PullFull
	l.Remote.Source = strings.Replace(l.Remote.Source, w.reg.Addr, host, 1)
	if _, _, err := w.src.pull(context.Background(), l); err == nil {
		t.Fatal("pulled without credentials through a registry that wants them")
	}
	cfg := filepath.Join(t.TempDir(), "config.json")
	must(t, os.WriteFile(cfg, []byte(fmt.Sprintf(`{"auths":{"%s":{"auth":%q}}}`, host, base64.StdEncoding.EncodeToString([]byte("node:pw")))), 0o600))
	w.src.DockerConfig = cfg
	path, release, err := w.src.pull(context.Background(), l)
	must(t, err)
	defer release()
	b, err := os.ReadFile(path)
	must(t, err)
	if digestOf(b) != l.Digest {
		t.Fatal("pulled image has another digest")
	}
}
