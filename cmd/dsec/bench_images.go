package main

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/image"
	"github.com/dsecproject/dsec/internal/layer/remote"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

// `dsec bench images` is DSec's E1 (§9) on this machine: a burst of
// sandboxes from several multi-GB bases (Debian systems built with
// debootstrap, each with a different toolchain), each running a task that
// touches a realistic part of its image, with the images read three ways
// side by side: pulled whole before the first sandbox starts (eager),
// read on demand through the node's layer daemon (on-demand), and already
// on the node (pre-pulled). The images live in a registry the bench runs
// on loopback behind a proxy that counts what is served.

// benchImage is one base of the bench: the packages debootstrap adds and
// the task its sandboxes run.
type benchImage struct {
	name     string
	packages []string
	task     string
}

var benchImages = []benchImage{
	{"py", []string{"python3-numpy", "python3-scipy", "python3-pandas", "python3-matplotlib", "python3-sklearn", "ipython3", "git", "build-essential"},
		`python3 -c 'import numpy, scipy.linalg, pandas; print(numpy.linalg.det(numpy.eye(3)) + len(pandas.DataFrame({"a": [1, 2]})))'`},
	{"cpp", []string{"clang", "llvm", "lld", "cmake", "ninja-build", "libboost-dev", "g++", "git"},
		`printf 'int main(void){return 0;}\n' > /tmp/t.c && clang -O1 -c /tmp/t.c -o /tmp/t.o && cmake --version | head -1`},
	{"jvm", []string{"default-jdk-headless", "maven", "golang-go", "nodejs", "git"},
		`java -version 2>&1 | head -1 && go version && node -e 'console.log(1+1)'`},
}

// imageRun is one mode's figures.
type imageRun struct {
	Mode           string  `json:"mode"`
	ChunkKiB       int     `json:"chunk_kib"`
	Sandboxes      int     `json:"sandboxes"`
	Failed         int     `json:"failed"`
	RunningSeconds float64 `json:"running_seconds"`
	DoneSeconds    float64 `json:"done_seconds"`
	SourceBytes    int64   `json:"source_bytes"`
	SourceRequests int64   `json:"source_requests"`
	WrittenBytes   int64   `json:"written_bytes"`
	PeakWriteMBps  float64 `json:"peak_write_mb_per_sec"`
	ReadFraction   float64 `json:"read_fraction"`
	ImageBytes     int64   `json:"image_bytes"`
	FirstError     string  `json:"first_error,omitempty"`
	FlowP50Millis  float64 `json:"flow_p50_ms"` // one sandbox: create, then its task
	// The layer daemon's counts (on-demand runs): chunk reads served from
	// the node's cache and not, and the seconds its range requests took.
	CacheHits    int64   `json:"cache_hits,omitempty"`
	CacheMisses  int64   `json:"cache_misses,omitempty"`
	FetchSeconds float64 `json:"fetch_seconds,omitempty"`
	// MetaReads are reads served from the layers' metadata packs, and
	// MetaBytes the packs' size (counted in ReadFraction, which counts
	// once what a pack and the chunks read share). FromPackBytes are the
	// bytes of fetched chunks taken from the packs, not the source.
	MetaReads     int64 `json:"meta_reads,omitempty"`
	MetaBytes     int64 `json:"meta_bytes,omitempty"`
	FromPackBytes int64 `json:"from_pack_bytes,omitempty"`
}

type imagesReport struct {
	EagerSeconds     float64 `json:"eager_seconds"`
	OndemandSeconds  float64 `json:"ondemand_seconds"`
	PrepulledSeconds float64 `json:"prepulled_seconds"`
	TracedSeconds    float64 `json:"traced_seconds,omitempty"`
	// NoMeta*: on demand from artifacts without their metadata packs.
	NoMetaSeconds        float64           `json:"nometa_seconds,omitempty"`
	NoMetaSourceBytes    int64             `json:"nometa_source_bytes,omitempty"`
	OndemandReadFraction float64           `json:"ondemand_read_fraction"`
	OndemandWrittenBytes int64             `json:"ondemand_written_bytes"`
	EagerWrittenBytes    int64             `json:"eager_written_bytes"`
	Speedup              float64           `json:"ondemand_speedup_over_eager"`
	WrittenRatio         float64           `json:"ondemand_written_over_eager"`
	Images               map[string]int64  `json:"image_bytes"`
	Refs                 map[string]string `json:"sources"`
	Runs                 []imageRun        `json:"runs"`
	SourceMBps           float64           `json:"source_mb_per_sec,omitempty"`
	Device               string            `json:"device"`
}

func runBenchImages(args []string) error {
	f := newCmdFlags("bench images", "[flags]",
		"DSec's E1: a burst of sandboxes from several multi-GB Debian bases (built once\n"+
			"with debootstrap and kept in a registry the bench runs on loopback), each running a\n"+
			"task that uses its image, with the images pulled whole first (eager), read on\n"+
			"demand (ondemand) and already local (prepulled), in one run. Reports time to all\n"+
			"running and all done, bytes served by the source, bytes written to the state\n"+
			"disk (/proc/diskstats) and its peak rate, and the fraction of each image read.\n"+
			"Needs root, a running dsec up (DSEC_ENDPOINT) and its --state-dir.")
	perImage := f.Int("per-image", 8, "sandboxes per image in the burst")
	conc := f.Int("concurrency", 8, "creates in flight at once")
	nImages := f.Int("images", len(benchImages), "how many of the bases to use (py, cpp, jvm)")
	dir := f.String("dir", "/var/lib/dsec-bench-images", "the bench's directory: the registry's storage and the apt cache (kept: a rerun builds nothing)")
	stateDir := f.String("state-dir", "/var/lib/dsec", "the daemon's state dir (its disk is the one measured; its layer daemon is reset between modes)")
	mbps := f.Float64("source-mbps", 0, "pace everything the source serves through one link of this many MB/s, as a node's link to shared storage (0 = loopback speed)")
	modesFlag := f.String("modes", "eager,nometa,ondemand,traced,prepulled", "modes to run, in order (nometa: on demand from an artifact without its metadata pack; traced: on demand again, with the trace the ondemand run left prefetched)")
	chunksFlag := f.String("chunk-kib", "256", "chunk sizes (KiB, comma-separated) to run the on-demand mode with, each in a run of its own; the first is the one reported as ondemand")
	asJSON := f.Bool("json", false, "print one JSON object")
	if _, err := f.parseN(args, 0, 0); err != nil {
		return err
	}
	if *perImage < 1 || *conc < 1 || *nImages < 1 || *nImages > len(benchImages) {
		return fmt.Errorf("bench images: --per-image and --concurrency ≥ 1, --images 1-%d", len(benchImages))
	}
	if os.Geteuid() != 0 {
		return errors.New("bench images: needs root (debootstrap, dropping the page cache, the layer daemon's socket)")
	}
	modes := strings.Split(*modesFlag, ",")
	for _, m := range modes {
		if !slices.Contains([]string{"eager", "nometa", "ondemand", "traced", "prepulled"}, m) {
			return fmt.Errorf("bench images: mode %q: want eager, nometa, ondemand, traced or prepulled", m)
		}
	}
	var chunks []int
	for _, v := range strings.Split(*chunksFlag, ",") {
		k, err := strconv.Atoi(strings.TrimSpace(v))
		if err != nil || k < 4 || k > 16384 || k%4 != 0 {
			return fmt.Errorf("bench images: --chunk-kib %q: want multiples of 4 from 4 to 16384", v)
		}
		chunks = append(chunks, k)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	c, err := newClient()
	if err != nil {
		return err
	}
	b := &imagesBench{c: c, dir: *dir, stateDir: *stateDir, images: benchImages[:*nImages], perImage: *perImage, conc: *conc, chunks: chunks}
	if err := b.startRegistry(ctx, *mbps); err != nil {
		return err
	}
	defer b.stopRegistry()
	if err := b.prepare(ctx); err != nil {
		return err
	}
	rep := imagesReport{Images: map[string]int64{}, Refs: map[string]string{}, SourceMBps: *mbps, Device: b.device}
	for _, im := range b.images {
		rep.Images[im.name] = b.sizes[im.name]
		rep.Refs[im.name] = b.source(im)
	}
	for _, m := range modes {
		sizes := []int{remote.DefaultChunkSize >> 10}
		if m == "ondemand" {
			sizes = chunks
		}
		for i, kib := range sizes {
			r, err := b.run(ctx, m, kib)
			if err != nil {
				return fmt.Errorf("bench images: %s: %w", m, err)
			}
			rep.Runs = append(rep.Runs, r)
			switch {
			case m == "eager":
				rep.EagerSeconds, rep.EagerWrittenBytes = r.DoneSeconds, r.WrittenBytes
			case m == "ondemand" && i == 0:
				rep.OndemandSeconds, rep.OndemandWrittenBytes, rep.OndemandReadFraction = r.DoneSeconds, r.WrittenBytes, r.ReadFraction
			case m == "prepulled":
				rep.PrepulledSeconds = r.DoneSeconds
			case m == "traced":
				rep.TracedSeconds = r.DoneSeconds
			case m == "nometa":
				rep.NoMetaSeconds, rep.NoMetaSourceBytes = r.DoneSeconds, r.SourceBytes
			}
		}
	}
	if rep.OndemandSeconds > 0 && rep.EagerSeconds > 0 {
		rep.Speedup = rep.EagerSeconds / rep.OndemandSeconds
	}
	if rep.EagerWrittenBytes > 0 {
		rep.WrittenRatio = float64(rep.OndemandWrittenBytes) / float64(rep.EagerWrittenBytes)
	}
	if *asJSON {
		return json.NewEncoder(os.Stdout).Encode(rep)
	}
	printImagesReport(rep)
	return nil
}

type imagesBench struct {
	c        *dsec.Client
	dir      string
	stateDir string
	images   []benchImage
	perImage int
	conc     int
	chunks   []int // KiB

	regCmd   *exec.Cmd
	regAddr  string // the registry itself
	proxy    *http.Server
	addr     string // what sources name: the counting proxy
	served   atomic.Int64
	requests atomic.Int64
	device   string
	sizes    map[string]int64
	tags     map[string]string
}

// imageLayout is the layout layer images are built with (mkfs.erofs
// -E noinline_data, layer.Store.seal).
const imageLayout = "noinline"

// tag names a base by what it holds and how layers are laid out
// (imageLayout): a registry filled by an older dsec is filled again.
func (b *imagesBench) tag(im benchImage) string {
	h := sha256.Sum256([]byte("bookworm\x00" + imageLayout + "\x00" + strings.Join(im.packages, ",")))
	return hex.EncodeToString(h[:6])
}

func (b *imagesBench) source(im benchImage) string {
	return remote.Scheme + b.addr + "/bench/" + im.name + ":" + b.tags[im.name]
}

// sourceWith names the artifact indexed in chunks of kib KiB.
func (b *imagesBench) sourceWith(im benchImage, kib int) string {
	if kib == remote.DefaultChunkSize>>10 {
		return b.source(im)
	}
	return fmt.Sprintf("%s-c%dk", b.source(im), kib)
}

// startRegistry runs Debian's docker-registry on loopback with its storage
// in the bench's directory, behind a proxy that counts the bytes it serves
// (and, with mbps, paces them).
func (b *imagesBench) startRegistry(ctx context.Context, mbps float64) error {
	bin, err := exec.LookPath("docker-registry")
	if err != nil {
		return errors.New("bench images: needs docker-registry (apt-get install docker-registry)")
	}
	if err := os.MkdirAll(b.dir, 0o700); err != nil {
		return err
	}
	b.regAddr, b.addr = freeLoopbackAddr(), freeLoopbackAddr()
	cfg := fmt.Sprintf("version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\nstorage:\n  filesystem:\n    rootdirectory: %s\nhttp:\n  addr: %s\n",
		filepath.Join(b.dir, "registry"), b.regAddr)
	cfgPath := filepath.Join(b.dir, "registry.yml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		return err
	}
	b.regCmd = exec.Command(bin, "serve", cfgPath)
	logf, err := os.Create(filepath.Join(b.dir, "registry.log"))
	if err != nil {
		return err
	}
	b.regCmd.Stdout, b.regCmd.Stderr = logf, logf
	if err := b.regCmd.Start(); err != nil {
		return err
	}
	target, _ := url.Parse("http://" + b.regAddr)
	rp := httputil.NewSingleHostReverseProxy(target)
	var shared *link
	if mbps > 0 {
		shared = &link{rate: mbps * 1e6}
	}
	rp.ModifyResponse = func(resp *http.Response) error {
		b.requests.Add(1)
		resp.Body = &countingBody{ReadCloser: resp.Body, n: &b.served, link: shared}
		return nil
	}
	ln, err := net.Listen("tcp", b.addr)
	if err != nil {
		return err
	}
	b.proxy = &http.Server{Handler: rp}
	go b.proxy.Serve(ln)
	// Wait for the registry itself: asked through the proxy, a registry
	// not listening yet makes the proxy log an error per try.
	deadline := time.Now().Add(15 * time.Second)
	for {
		resp, err := http.Get("http://" + b.regAddr + "/v2/")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("bench images: the registry did not come up (see %s)", filepath.Join(b.dir, "registry.log"))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (b *imagesBench) stopRegistry() {
	if b.proxy != nil {
		b.proxy.Close()
	}
	if b.regCmd != nil && b.regCmd.Process != nil {
		b.regCmd.Process.Kill()
		b.regCmd.Wait()
	}
}

// countingBody counts what the source serves and, with a link, paces it.
type countingBody struct {
	io.ReadCloser
	n    *atomic.Int64
	link *link
}

func (c *countingBody) Read(p []byte) (int, error) {
	if c.link != nil && len(p) > 64<<10 {
		p = p[:64<<10]
	}
	n, err := c.ReadCloser.Read(p)
	c.n.Add(int64(n))
	if c.link != nil && n > 0 {
		c.link.take(n)
	}
	return n, err
}

// link is one shared link of a given rate: every byte any response sends
// takes its time on it, as on a node's network link to shared storage.
type link struct {
	rate float64 // bytes per second
	mu   sync.Mutex
	next time.Time
}

func (l *link) take(n int) {
	l.mu.Lock()
	now := time.Now()
	if l.next.Before(now) {
		l.next = now
	}
	l.next = l.next.Add(time.Duration(float64(n) / l.rate * float64(time.Second)))
	wait := time.Until(l.next)
	l.mu.Unlock()
	if wait > 0 {
		time.Sleep(wait)
	}
}

// prepare makes sure every base is in the registry, building and pushing
// the missing ones (debootstrap through `dsec image bootstrap`; the local
// ref is deleted after the push, so the node holds no copy of the image).
func (b *imagesBench) prepare(ctx context.Context) error {
	b.sizes, b.tags = map[string]int64{}, map[string]string{}
	dev, err := deviceOf(b.stateDir)
	if err != nil {
		return err
	}
	b.device = dev
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	for _, im := range b.images {
		b.tags[im.name] = b.tag(im)
		src := b.source(im)
		probe := "base/bench-img-probe-" + im.name + ":" + b.tags[im.name]
		_ = b.c.DeleteLayer(ctx, probe)
		if l, err := b.c.AddLayer(ctx, api.LayerAddRequest{Ref: probe, Source: src, Insecure: true}); err == nil {
			b.sizes[im.name] = l.SizeBytes
			_ = b.c.DeleteLayer(ctx, probe)
			fmt.Fprintf(os.Stderr, "bench images: %s is in the registry (%s)\n", im.name, humanBytes(l.SizeBytes))
			continue
		}
		local := "base/bench-img-" + im.name + ":" + b.tags[im.name]
		fmt.Fprintf(os.Stderr, "bench images: building %s with debootstrap (+%s); this takes minutes, once\n", local, strings.Join(im.packages, ","))
		cmd := exec.CommandContext(ctx, exe, "image", "bootstrap", "--suite", "bookworm", "--ref", local,
			"--packages", strings.Join(im.packages, ","), "--keep-cache", filepath.Join(b.dir, "apt-cache"))
		cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("bench images: bootstrapping %s: %w", local, err)
		}
		res, err := b.c.PushLayer(ctx, api.LayerPushRequest{Ref: local, Target: src, Insecure: true})
		if err != nil {
			return fmt.Errorf("bench images: pushing %s: %w", local, err)
		}
		b.sizes[im.name] = res.SizeBytes
		if err := b.c.DeleteLayer(ctx, local); err != nil {
			return fmt.Errorf("bench images: deleting the local %s: %w", local, err)
		}
		fmt.Fprintf(os.Stderr, "bench images: %s pushed (%s)\n", im.name, humanBytes(res.SizeBytes))
	}
	for _, im := range b.images {
		// The same artifact without its metadata pack: what on demand
		// costs when lookups fetch chunks.
		if _, err := remote.WithoutMeta(ctx, b.source(im), b.source(im)+"-nometa", image.RepoOptions{Insecure: true}); err != nil {
			return fmt.Errorf("bench images: %s without its metadata pack: %w", im.name, err)
		}
		for _, kib := range b.chunks {
			if kib == remote.DefaultChunkSize>>10 {
				continue
			}
			if _, err := remote.Reindex(ctx, b.source(im), b.sourceWith(im, kib), kib<<10, image.RepoOptions{Insecure: true}); err != nil {
				return fmt.Errorf("bench images: indexing %s in %d KiB chunks: %w", im.name, kib, err)
			}
		}
	}
	return nil
}

// run runs the burst in one mode from a cold node: no image mounted, the
// layer daemon and its cache reset, the page cache dropped.
func (b *imagesBench) run(ctx context.Context, mode string, kib int) (imageRun, error) {
	r := imageRun{Mode: mode, ChunkKiB: kib}
	pull := api.PullFull
	if mode == "ondemand" || mode == "traced" || mode == "nometa" {
		pull = api.PullLazy
	}
	refs := map[string]string{}
	for _, im := range b.images {
		ref := "base/bench-img-" + mode + "-" + im.name + ":" + b.tags[im.name]
		_ = b.c.DeleteLayer(ctx, ref)
		src := b.sourceWith(im, kib)
		if mode == "nometa" {
			src = b.source(im) + "-nometa"
		}
		if _, err := b.c.AddLayer(ctx, api.LayerAddRequest{Ref: ref, Source: src, Insecure: true, Pull: pull}); err != nil {
			return r, err
		}
		refs[im.name] = ref
		r.ImageBytes += b.sizes[im.name]
	}
	defer func() {
		for _, ref := range refs {
			_ = b.c.DeleteLayer(context.Background(), ref)
		}
	}()
	// Traces go at every reset but the traced run's: a trace the
	// on-demand run before it leaves is what it prefetches.
	if err := b.resetNode(ctx, mode == "traced"); err != nil {
		return r, err
	}
	// Pre-pulled: one sandbox per image holds the pulled image on the
	// node while the burst runs; its pull is not timed.
	var holders []string
	if mode == "prepulled" {
		for _, im := range b.images {
			sb, err := b.c.CreateSandbox(ctx, api.SandboxSpec{Base: refs[im.name], TTL: 3600})
			if err != nil {
				return r, fmt.Errorf("pre-pulling %s: %w", im.name, err)
			}
			holders = append(holders, sb.ID)
		}
		dropPageCache()
	}
	defer func() {
		for _, id := range holders {
			_ = b.c.DeleteSandbox(context.Background(), id)
		}
	}()
	served0, req0 := b.served.Load(), b.requests.Load()
	written0, err := sectorsWritten(b.device)
	if err != nil {
		return r, err
	}
	stopSample, sampled := make(chan struct{}), make(chan struct{})
	var peak atomic.Int64 // bytes per second, the largest over 250 ms
	go func() {
		defer close(sampled)
		last, t := written0, time.Now()
		tick := time.NewTicker(250 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-stopSample:
				return
			case <-tick.C:
				w, err := sectorsWritten(b.device)
				if err != nil {
					continue
				}
				rate := int64(float64(w-last) / time.Since(t).Seconds())
				if rate > peak.Load() {
					peak.Store(rate)
				}
				last, t = w, time.Now()
			}
		}
	}()

	n := len(b.images) * b.perImage
	r.Sandboxes = n
	ids := make([]string, n)
	var mu sync.Mutex
	var running time.Duration
	start := time.Now()
	flows, fails, _, firstErr := runParallel(n, b.conc, func(i int) error {
		im := b.images[i%len(b.images)]
		sb, err := b.c.CreateSandbox(ctx, api.SandboxSpec{Base: refs[im.name], TTL: 3600})
		if err != nil {
			return err
		}
		ids[i] = sb.ID
		mu.Lock()
		running = max(running, time.Since(start))
		mu.Unlock()
		res, err := b.c.Exec(ctx, sb.ID, api.ExecRequest{Cmd: im.task, Timeout: 600})
		if err != nil {
			return err
		}
		if res.ExitCode != 0 {
			return fmt.Errorf("task on %s: exit %d: %s", im.name, res.ExitCode, strings.TrimSpace(res.Stderr))
		}
		return nil
	})
	r.DoneSeconds = time.Since(start).Seconds()
	r.RunningSeconds = running.Seconds()
	close(stopSample)
	<-sampled
	r.Failed = fails
	if firstErr != nil {
		r.FirstError = firstErr.Error()
	}
	r.FlowP50Millis = pct(flows, .5)
	// What the run wrote may still sit in the page cache: flush it so
	// that the disk's counters show it.
	unix.Sync()
	written1, _ := sectorsWritten(b.device)
	r.WrittenBytes = written1 - written0
	r.PeakWriteMBps = float64(peak.Load()) / 1e6
	r.SourceBytes, r.SourceRequests = b.served.Load()-served0, b.requests.Load()-req0
	switch mode {
	case "ondemand", "traced", "nometa":
		if st, err := b.layerfs().Stats(ctx); err == nil {
			var touched, total int64
			for _, l := range st.Layers {
				if l.ReadBytes > 0 || l.ChunksTouched == 0 {
					touched += l.ReadBytes
				} else { // a layer daemon from before read_bytes
					touched += l.ChunksTouched*int64(l.ChunkSize) + l.MetaBytes
				}
				total += l.SizeBytes
				r.MetaReads += l.MetaReads
				r.MetaBytes += l.MetaBytes
				r.FromPackBytes += l.FromPackBytes
				r.CacheHits += l.CacheHits
				r.CacheMisses += l.CacheMisses
				r.FetchSeconds += l.FetchSeconds
			}
			if total > 0 {
				r.ReadFraction = float64(min(touched, total)) / float64(total)
			}
		}
	default:
		r.ReadFraction = 1
	}
	for _, id := range ids {
		if id != "" {
			_ = b.c.DeleteSandbox(context.Background(), id)
		}
	}
	fmt.Fprintf(os.Stderr, "bench images: %s: %d sandboxes, all done in %.1f s, %s from the source, %s written\n",
		mode, n, r.DoneSeconds, humanBytes(r.SourceBytes), humanBytes(r.WrittenBytes))
	return r, nil
}

// resetNode makes the node cold: the layer daemon's chunk cache emptied
// (it refuses while any of its images is mounted), no pulled image left,
// the page cache dropped.
func (b *imagesBench) resetNode(ctx context.Context, keepTraces bool) error {
	// A warm pool's sandboxes hold their layers mounted, and the modes
	// share image digests: one mode's pool would serve the next.
	if n, err := pooledNow(ctx, b.c); err != nil {
		return err
	} else if n > 0 {
		return fmt.Errorf("the node keeps %d warm-pool sandbox(es), which hold their layers mounted and would serve the next mode: run dsec up with --warm-pool-max 0 for this bench", n)
	}
	if !keepTraces {
		// Also when no daemon runs now: the next one would prefetch
		// what earlier runs left.
		traces := filepath.Join(b.stateDir, "edge", "layerfs", "trace")
		entries, _ := os.ReadDir(traces)
		for _, e := range entries {
			if err := os.Remove(filepath.Join(traces, e.Name())); err != nil {
				return fmt.Errorf("removing layer traces: %w", err)
			}
		}
	}
	// The daemon refuses while it was used in the last moments (a mount
	// may be under way): the burst's deletes have just ended.
	var dropped bool
	var err error
	for deadline := time.Now().Add(15 * time.Second); ; {
		dropped, err = b.layerfs().DropCache(ctx, !keepTraces)
		if err == nil || time.Now().After(deadline) {
			break
		}
		time.Sleep(500 * time.Millisecond)
	}
	if err != nil {
		return err
	}
	if !dropped {
		// No daemon runs: empty the cache it will open (chunks of other
		// runs would be hits in this one).
		if err := os.RemoveAll(filepath.Join(b.stateDir, "edge", "layerfs", "cache")); err != nil {
			return fmt.Errorf("emptying the chunk cache: %w", err)
		}
	}
	// Pulled images no sandbox uses are kept for the next one: not in a
	// cold node. Nothing is mounted now (the sandboxes are gone).
	pulled := filepath.Join(b.stateDir, "edge", "pulled")
	entries, _ := os.ReadDir(pulled)
	for _, e := range entries {
		if err := os.Remove(filepath.Join(pulled, e.Name())); err != nil {
			return fmt.Errorf("removing a pulled image: %w", err)
		}
	}
	dropPageCache()
	return nil
}

// layerfs is a client of the node's layer daemon.
func (b *imagesBench) layerfs() *remote.Source {
	return &remote.Source{Dir: filepath.Join(b.stateDir, "edge", "layerfs")}
}

func dropPageCache() {
	unix.Sync()
	_ = os.WriteFile("/proc/sys/vm/drop_caches", []byte("3\n"), 0o200)
}

// deviceOf names the block device (as in /proc/diskstats) that holds dir.
func deviceOf(dir string) (string, error) {
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		return "", fmt.Errorf("bench images: --state-dir: %w", err)
	}
	maj, mnr := unix.Major(st.Dev), unix.Minor(st.Dev)
	f, err := os.Open("/proc/diskstats")
	if err != nil {
		return "", err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fs := strings.Fields(sc.Text())
		if len(fs) > 3 && fs[0] == strconv.Itoa(int(maj)) && fs[1] == strconv.Itoa(int(mnr)) {
			return fs[2], nil
		}
	}
	return "", fmt.Errorf("bench images: no /proc/diskstats line for %d:%d (the state dir's filesystem)", maj, mnr)
}

// sectorsWritten is the bytes written to dev so far.
func sectorsWritten(dev string) (int64, error) {
	b, err := os.ReadFile("/proc/diskstats")
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		fs := strings.Fields(line)
		if len(fs) > 9 && fs[2] == dev {
			n, err := strconv.ParseInt(fs[9], 10, 64)
			return n * 512, err
		}
	}
	return 0, fmt.Errorf("no diskstats for %s", dev)
}

func freeLoopbackAddr() string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "127.0.0.1:0"
	}
	defer l.Close()
	return l.Addr().String()
}

// OndemandSourceBytes is what the first on-demand run took from the source.
func (r imagesReport) OndemandSourceBytes() int64 {
	for _, run := range r.Runs {
		if run.Mode == "ondemand" {
			return run.SourceBytes
		}
	}
	return 0
}

func printImagesReport(r imagesReport) {
	tw := newTable()
	tw.printf("MODE\tCHUNK\tSANDBOXES\tFAILED\tALL RUNNING\tALL DONE\tFROM SOURCE\tREQUESTS\tWRITTEN\tPEAK WRITE\tREAD\n")
	for _, run := range r.Runs {
		tw.printf("%s\t%d KiB\t%d\t%d\t%.1f s\t%.1f s\t%s\t%d\t%s\t%.0f MB/s\t%.1f%%\n", run.Mode, run.ChunkKiB, run.Sandboxes, run.Failed,
			run.RunningSeconds, run.DoneSeconds, humanBytes(run.SourceBytes), run.SourceRequests, humanBytes(run.WrittenBytes),
			run.PeakWriteMBps, 100*run.ReadFraction)
	}
	tw.Flush()
	for _, run := range r.Runs {
		if run.FirstError != "" {
			fmt.Printf("%s: first error: %s\n", run.Mode, run.FirstError)
		}
	}
	var total int64
	for _, v := range r.Images {
		total += v
	}
	fmt.Printf("images: %d, %s in all (device %s", len(r.Images), humanBytes(total), r.Device)
	if r.SourceMBps > 0 {
		fmt.Printf(", source paced to %.0f MB/s", r.SourceMBps)
	}
	fmt.Println(")")
	if r.Speedup > 0 {
		fmt.Printf("on demand: %.2f× faster than eager to all done (DSec E1: 1.71×; target ≥ 1.7×)\n", r.Speedup)
	}
	if r.NoMetaSeconds > 0 && r.OndemandSeconds > 0 {
		fmt.Printf("metadata packs: on demand %.1f s against %.1f s without them (%.2f×), %s from the source against %s\n",
			r.OndemandSeconds, r.NoMetaSeconds, r.NoMetaSeconds/r.OndemandSeconds, humanBytes(r.OndemandSourceBytes()), humanBytes(r.NoMetaSourceBytes))
		for _, run := range r.Runs {
			if run.Mode == "ondemand" && run.MetaBytes > 0 {
				fmt.Printf("  packs %s; chunk fetches took %s from them instead of the source\n", humanBytes(run.MetaBytes), humanBytes(run.FromPackBytes))
				break
			}
		}
	}
	if r.TracedSeconds > 0 && r.OndemandSeconds > 0 {
		fmt.Printf("a recorded trace prefetched: %.1f s against %.1f s without (%.2f×)\n", r.TracedSeconds, r.OndemandSeconds, r.OndemandSeconds/r.TracedSeconds)
	}
	if r.WrittenRatio > 0 {
		fmt.Printf("on demand wrote %.0f%% of eager's bytes (DSec: 43%%; target ≤ 45%%); read %.1f%% of the images (target ≤ 15%%)\n",
			100*r.WrittenRatio, 100*r.OndemandReadFraction)
	}
}
