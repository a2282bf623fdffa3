package main

// `dsec bench control-plane`: the control plane at DSec's scale on one
// machine. It starts a real etcd, real `dsec server`s and one process of
// hollow edges (`dsec edge --hollow`: the real edge code over a simulated
// backend), fills the cluster with jobs of sandboxes created in bursts,
// holds the target create rate for a while (deleting as fast, so that
// concurrency holds), then times listing, pausing and deleting a whole
// job by label, and reports placement, CPU, memory and etcd figures. The
// data plane is not measured: the sandboxes are simulated.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"runtime/pprof"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/store/etcdtest"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

type cpOpts struct {
	edges, sandboxes, rate, apiservers int
	duration                           time.Duration
	jobs, jobSize, concurrency         int
	hollowProcs, execRate              int
	placementCompare, cloudEdges       int
	keys, jsonOut, keep, edgeDeath     bool
	apiserverDeath                     bool
	dir, latency, profile              string
}

func runBenchControlPlane(args []string) (err error) {
	var o cpOpts
	var durationS int
	f := newCmdFlags("bench control-plane", "[flags]", "Start etcd, apiservers and hollow edges (simulated sandboxes) on this machine, fill them\n"+
		"with jobs created in bursts, hold the create rate, and time listing, pausing and deleting a\n"+
		"job by label; report creates/s, create latency, placement, CPU, memory and etcd figures.\n"+
		"Needs etcd (apt-get install etcd-server) and mkfs.erofs for its one layer.")
	f.IntVar(&o.edges, "edges", 160, "hollow edges (in one process)")
	f.IntVar(&o.sandboxes, "sandboxes", 380000, "live sandboxes to fill to and hold")
	f.IntVar(&o.rate, "rate", 5000, "creates per second to aim at (the fill and the hold)")
	f.IntVar(&durationS, "duration", 60, "seconds to hold the rate at full concurrency (creating and deleting)")
	f.IntVar(&o.apiservers, "apiservers", 2, "apiservers (clients spread over all)")
	f.IntVar(&o.jobs, "jobs", 0, "jobs the fill creates, each in one burst (0: one per 32,000 sandboxes, at least one)")
	f.IntVar(&o.jobSize, "job-size", 0, "sandboxes per job (0: --sandboxes over --jobs)")
	f.IntVar(&o.concurrency, "concurrency", 256, "creates in flight at once")
	f.BoolVar(&o.keys, "idempotency-keys", false, "send an Idempotency-Key with every create (an etcd record each)")
	f.IntVar(&o.hollowProcs, "hollow-procs", 0, "processes the hollow edges are spread over (0: one per 10 edges); the edge-death test kills one")
	f.IntVar(&o.execRate, "exec-rate", 500, "execs per second into random live sandboxes during the hold (0: none)")
	f.StringVar(&o.latency, "hollow-latency", defaultHollowLatency, "the hollow edges' --hollow-latency")
	f.StringVar(&o.profile, "profile", "", "write CPU profiles of every daemon (and of this client) over the hold's middle to this directory")
	f.StringVar(&o.dir, "dir", "", "where the working directory is made (default: /dev/shm, else the temp dir); it is removed afterwards")
	f.BoolVar(&o.edgeDeath, "edge-death", true, "after the hold, kill one hollow process (--edges/--hollow-procs edges) a quarter of the way into a burst of creates, then restart it (needs 2 processes or more)")
	f.BoolVar(&o.apiserverDeath, "apiserver-death", true, "after the edge death, kill one apiserver a quarter of the way into a burst of keyed creates sent through clients that know every apiserver, then restart it (needs --apiservers 2 or more)")
	f.IntVar(&o.placementCompare, "placement-compare", -1, "after the teardown, a burst of this many creates from empty edges per placement strategy (power of 2 and least loaded, with and without the overlay, and random), each through apiservers of its own (-1: a tenth of --sandboxes, at most 40,000; 0: none)")
	f.IntVar(&o.cloudEdges, "cloud-edges", -1, "then, this many more hollow edges labelled pool=cloud, and a burst through apiservers with --overflow-pool cloud=T, T set so that the others pass it 60% of the way in (-1: a tenth of --edges; 0: none)")
	f.BoolVar(&o.keep, "keep", false, "keep the working directory and the daemons' logs")
	f.BoolVar(&o.jsonOut, "json", false, "print one JSON object instead of a table")
	if _, err := f.parseN(args, 0, 0); err != nil {
		return err
	}
	o.duration = time.Duration(durationS) * time.Second
	if err := o.check(); err != nil {
		return err
	}
	if _, err := parseLatency(o.latency); err != nil {
		return err
	}
	if _, err := etcdtest.Binary(); err != nil {
		return fmt.Errorf("bench control-plane needs etcd: %w", err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	w, err := startCPWorld(ctx, o)
	if w != nil {
		defer func() { w.close(o.keep, err != nil) }()
	}
	if err != nil {
		return err
	}
	rep, err := w.run(ctx, o)
	if err != nil {
		return err
	}
	if o.jsonOut {
		return printJSON(rep)
	}
	return printCPReport(rep)
}

func (o *cpOpts) check() error {
	switch {
	case o.edges < 1 || o.edges > maxHollowEdges:
		return fmt.Errorf("--edges %d: want 1 to %d", o.edges, maxHollowEdges)
	case o.sandboxes < 1 || o.sandboxes > 2_000_000:
		return fmt.Errorf("--sandboxes %d: want 1 to 2,000,000", o.sandboxes)
	case o.rate < 1 || o.rate > 1_000_000:
		return fmt.Errorf("--rate %d: want 1 to 1,000,000", o.rate)
	case o.duration < time.Second || o.duration > time.Hour:
		return errors.New("--duration: want 1 to 3600 seconds")
	case o.apiservers < 1 || o.apiservers > 16:
		return fmt.Errorf("--apiservers %d: want 1 to 16", o.apiservers)
	case o.jobs < 0 || o.jobSize < 0:
		return errors.New("--jobs and --job-size must be ≥ 0")
	case o.concurrency < 1 || o.concurrency > 4096:
		return fmt.Errorf("--concurrency %d: want 1 to 4096", o.concurrency)
	case o.hollowProcs < 0 || o.hollowProcs > o.edges:
		return fmt.Errorf("--hollow-procs %d: want 0 to --edges", o.hollowProcs)
	case o.execRate < 0 || o.execRate > 1_000_000:
		return fmt.Errorf("--exec-rate %d: want 0 to 1,000,000", o.execRate)
	}
	if o.hollowProcs == 0 {
		o.hollowProcs = max(1, o.edges/10)
	}
	if o.placementCompare < -1 || o.cloudEdges < -1 {
		return errors.New("--placement-compare and --cloud-edges: want -1 (the default), 0 (none) or more")
	}
	if o.placementCompare == -1 {
		o.placementCompare = min(max(o.sandboxes/10, 4*o.edges), 40000)
	}
	if o.cloudEdges == -1 {
		o.cloudEdges = max(1, o.edges/10)
	}
	if o.cloudEdges > maxHollowEdges {
		return fmt.Errorf("--cloud-edges %d: want at most %d", o.cloudEdges, maxHollowEdges)
	}
	switch {
	case o.jobs == 0 && o.jobSize > 0:
		o.jobs = (o.sandboxes + o.jobSize - 1) / o.jobSize
	case o.jobs == 0:
		// Two at least, so that the hold has an older job to delete.
		o.jobs = min(o.sandboxes, max(2, (o.sandboxes+31999)/32000))
	}
	if o.jobSize == 0 {
		o.jobSize = (o.sandboxes + o.jobs - 1) / o.jobs
	}
	if o.jobs > o.sandboxes {
		return fmt.Errorf("--jobs %d is more than --sandboxes %d", o.jobs, o.sandboxes)
	}
	return nil
}

// cpWorld is the cluster under test.
type cpWorld struct {
	benchWorld
	clients []*dsec.Client
	// servers are the apiservers' base URLs.
	servers []string
	// hollow[k] is the k-th hollow process's edge names and hollowProc[k]
	// the process (the
	// edge-death phase kills and restarts one).
	hollow     [][]string
	hollowProc []*benchProc
	ref        string
	label      string
	// hc is the clients' HTTP client (kept-alive connections).
	hc *http.Client
	// made counts the creates that succeeded: the hold's deletes follow
	// its creates, so that concurrency holds whatever rate is reached.
	made atomic.Int64
}

// clientsOf makes a client on each of the apiservers at urls, one
// endpoint each, without retries: what the bench measures is each
// apiserver's own answer.
func (w *cpWorld) clientsOf(o cpOpts, urls []string) ([]*dsec.Client, error) {
	var out []*dsec.Client
	for _, url := range urls {
		opts := []dsec.Option{dsec.WithEndpoint(url), dsec.WithAPIKey(benchKey), dsec.WithHTTPClient(w.hc), dsec.WithRetries(1)}
		if !o.keys {
			opts = append(opts, dsec.WithoutIdempotencyKeys())
		}
		c, err := dsec.New(opts...)
		if err != nil {
			return nil, err
		}
		out = append(out, c)
	}
	return out, nil
}

// daemonEnv is the environment a daemon of the bench starts with: a
// profiling listener of its own with --profile.
func (w *cpWorld) daemonEnv(o cpOpts, name string) ([]string, error) {
	return w.profEnv(o.profile != "", name)
}

func startCPWorld(ctx context.Context, o cpOpts) (*cpWorld, error) {
	bin, err := os.Executable()
	if err != nil {
		return nil, err
	}
	parent := o.dir
	if parent == "" {
		if st, err := os.Stat("/dev/shm"); err == nil && st.IsDir() {
			parent = "/dev/shm" // the hollow edges' records: many small files
		}
	} else if err := os.MkdirAll(parent, 0o700); err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp(parent, "dsec-bench-cp-")
	if err != nil {
		return nil, err
	}
	w := &cpWorld{benchWorld: benchWorld{dir: dir, bin: bin}, label: fmt.Sprintf("cp-%d", time.Now().UnixNano())}
	progress("starting etcd, %d apiserver(s) and %d hollow edges in %s", o.apiservers, o.edges, dir)
	_, servers, err := w.startControlPlane(ctx, o.apiservers, func(name string) ([]string, error) { return w.daemonEnv(o, name) })
	if err != nil {
		return w, err
	}
	w.servers = servers
	w.hc = &http.Client{Transport: &http.Transport{MaxIdleConns: 2 * o.concurrency, MaxIdleConnsPerHost: o.concurrency, IdleConnTimeout: time.Minute}}
	if w.clients, err = w.clientsOf(o, servers); err != nil {
		return w, err
	}
	for k := range o.hollowProcs {
		// Edges split as evenly as they go: the first processes take one
		// more.
		n := o.edges / o.hollowProcs
		if k < o.edges%o.hollowProcs {
			n++
		}
		names, p, err := w.startHollow(ctx, o, fmt.Sprintf("hollow%02d", k), n)
		if err != nil {
			return w, err
		}
		w.hollow, w.hollowProc = append(w.hollow, names), append(w.hollowProc, p)
	}
	deadline := time.Now().Add(120 * time.Second)
	for {
		nodes, err := w.clients[0].ListNodes(ctx)
		healthy := 0
		for _, n := range nodes {
			if n.Healthy && n.Hollow {
				healthy++
			}
		}
		if err == nil && healthy == o.edges {
			break
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return w, fmt.Errorf("%d of %d hollow edges healthy after 120 s (%v); logs in %s", healthy, o.edges, err, dir)
		}
		time.Sleep(200 * time.Millisecond)
	}
	if w.ref, _, err = benchBase(ctx, w.clients[0], ""); err != nil {
		return w, err
	}
	return w, nil
}

// perEdge is every hollow edge's --max-sandboxes: room for the hold's
// creates before their deletes.
func (w *cpWorld) perEdge(o cpOpts) int { return 2*((o.sandboxes+o.edges-1)/o.edges) + 100 }

// startHollow starts a process of n hollow edges named after name, with
// args added to its flags, and waits until they listen; it returns the
// edges' names.
func (w *cpWorld) startHollow(ctx context.Context, o cpOpts, name string, n int, args ...string) ([]string, *benchProc, error) {
	port, err := freePortRun("127.0.0.1", n)
	if err != nil {
		return nil, nil, err
	}
	var names []string
	for i := range n {
		names = append(names, hollowName(name, i, n))
	}
	env, err := w.daemonEnv(o, name)
	if err != nil {
		return nil, nil, err
	}
	args = append(append([]string{"edge", "--hollow", "--hollow-edges", fmt.Sprint(n),
		"--hollow-latency", o.latency, "--listen", fmt.Sprintf("127.0.0.1:%d", port), "--node-name", name,
		"--state-dir", filepath.Join(w.dir, name), "--max-sandboxes", fmt.Sprint(w.perEdge(o))}, w.edgeFlags...), args...)
	p, err := w.startEnv(name, env, args...)
	if err != nil {
		return nil, nil, err
	}
	// The next process's ports are looked for once these are taken.
	if err := waitPorts("127.0.0.1", port, n, 60*time.Second); err != nil {
		return nil, p, fmt.Errorf("%s: %w (log: %s)", name, err, filepath.Join(w.dir, name+".log"))
	}
	return names, p, nil
}

// waitPorts waits until n ports from port on host accept connections.
func waitPorts(host string, port, n int, limit time.Duration) error {
	deadline := time.Now().Add(limit)
	for p := port; p < port+n; p++ {
		for {
			c, err := net.DialTimeout("tcp", net.JoinHostPort(host, strconv.Itoa(p)), time.Second)
			if err == nil {
				c.Close()
				break
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("port %d not listening after %s", p, limit)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	return nil
}

// portFree reports whether host:port can be listened on now.
func portFree(host string, port int) bool {
	ln, err := net.Listen("tcp", net.JoinHostPort(host, strconv.Itoa(port)))
	if err != nil {
		return false
	}
	_ = ln.Close()
	return true
}

func progress(format string, a ...any) {
	fmt.Fprintf(os.Stderr, "bench control-plane: "+format+"\n", a...)
}

// freePortRun finds n consecutive free ports on host.
func freePortRun(host string, n int) (int, error) {
	for start := 20000; start+n < 60000; start += n + 7 {
		ok := true
		for p := start; p < start+n && ok; p++ {
			ok = portFree(host, p)
		}
		if ok {
			return start, nil
		}
	}
	return 0, fmt.Errorf("no %d consecutive free ports on %s", n, host)
}

func (w *cpWorld) close(keep, failed bool) {
	for _, p := range w.procs {
		if p.cmd != nil && p.cmd.Process != nil {
			_ = p.cmd.Process.Signal(syscall.SIGTERM)
		}
	}
	for _, p := range w.procs {
		if p.cmd != nil && p.cmd.Process != nil {
			done := make(chan struct{})
			go func() { _ = p.cmd.Wait(); close(done) }()
			select {
			case <-done:
			case <-time.After(15 * time.Second):
				_ = p.cmd.Process.Kill()
				<-done
			}
		}
	}
	if w.etcd != nil {
		w.etcd.Stop()
	}
	if keep {
		progress("kept %s", w.dir)
		return
	}
	if failed {
		// The daemons' logs say why; the rest (the hollow edges' records)
		// may be gigabytes of memory under /dev/shm.
		if logs, err := os.MkdirTemp("", "dsec-bench-cp-logs-"); err == nil {
			names, _ := filepath.Glob(filepath.Join(w.dir, "*.log"))
			for _, n := range names {
				if b, err := os.ReadFile(n); err == nil {
					_ = os.WriteFile(filepath.Join(logs, filepath.Base(n)), b, 0o600)
				}
			}
			progress("the daemons' logs are in %s", logs)
		}
	}
	_ = os.RemoveAll(w.dir)
}

// cpSample is one create: when it ended, how long it took, the live
// sandboxes when it started.
type cpSample struct {
	d    time.Duration
	live int
}

// cpPhase is what one phase of creates measured.
type cpPhase struct {
	samples []cpSample
	fails   int
	errs    map[string]int
	wall    time.Duration
	ids     []string
	// nodes[i] is the node of ids[i].
	nodes []string
}

// creates makes n sandboxes of job at up to rate per second with
// concurrency in flight, counting live as they come.
func (w *cpWorld) creates(ctx context.Context, o cpOpts, job string, n, rate int, live *atomic.Int64) cpPhase {
	return w.createsUntil(ctx, o, job, n, rate, time.Time{}, live)
}

// createsUntil is creates that starts none after until (zero: no bound):
// a hold lasts its duration even when the rate is out of reach.
func (w *cpWorld) createsUntil(ctx context.Context, o cpOpts, job string, n, rate int, until time.Time, live *atomic.Int64) cpPhase {
	return w.createsVia(ctx, o, w.clients, job, n, rate, until, live)
}

// createsVia is createsUntil through clients.
func (w *cpWorld) createsVia(ctx context.Context, o cpOpts, clients []*dsec.Client, job string, n, rate int, until time.Time, live *atomic.Int64) cpPhase {
	var ph cpPhase
	ph.errs = map[string]int{}
	var mu sync.Mutex
	inTime := func(int64) bool { return until.IsZero() || !time.Now().After(until) }
	ph.wall = w.paced(ctx, clients, o.concurrency, n, rate, inTime, func(c *dsec.Client, _ int64) {
		l := int(live.Load())
		t := time.Now()
		sb, err := c.CreateSandbox(ctx, api.SandboxSpec{Base: w.ref, TTL: 86400, Labels: map[string]string{"job": job, "bench": w.label}})
		d := time.Since(t)
		mu.Lock()
		defer mu.Unlock()
		if err != nil {
			ph.fails++
			ph.errs[errClass(err)]++
			return
		}
		live.Add(1)
		w.made.Add(1)
		ph.samples = append(ph.samples, cpSample{d: d, live: l})
		ph.ids = append(ph.ids, sb.ID)
		ph.nodes = append(ph.nodes, sb.Node)
	})
	return ph
}

// paced runs do(c, i) for i = 0, 1, ... below n on workers goroutines
// (each on one of clients, in turn), open loop: the i-th is due at start +
// i/rate whatever the earlier ones took. It stops at n, when ctx ends or
// when ok(i) says no (nil: never), and returns how long it ran.
func (w *cpWorld) paced(ctx context.Context, clients []*dsec.Client, workers, n, rate int, ok func(i int64) bool, do func(c *dsec.Client, i int64)) time.Duration {
	var next atomic.Int64
	start := time.Now()
	interval := time.Second / time.Duration(rate)
	var wg sync.WaitGroup
	for k := range min(workers, n) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := clients[k%len(clients)]
			for {
				i := next.Add(1) - 1
				if i >= int64(n) || ctx.Err() != nil || ok != nil && !ok(i) {
					return
				}
				if d := time.Until(start.Add(time.Duration(i) * interval)); d > 0 {
					select {
					case <-ctx.Done():
						return
					case <-time.After(d):
					}
				}
				do(c, i)
			}
		}()
	}
	wg.Wait()
	return time.Since(start)
}

func errClass(err error) string {
	s := err.Error()
	if len(s) > 80 {
		s = s[:80]
	}
	return s
}

// cpDeletes is what a run of deletes measured.
type cpDeletes struct {
	ok, failed int
	errs       map[string]int
	durs       []time.Duration
	wall       time.Duration
}

// deletes deletes ids at up to rate per second with the creates'
// concurrency in flight, the i-th once the i-th create since it began
// succeeded: after until, only those of the creates made by then.
func (w *cpWorld) deletes(ctx context.Context, o cpOpts, ids []string, rate int, until time.Time, live *atomic.Int64) cpDeletes {
	out := cpDeletes{errs: map[string]int{}}
	var mu sync.Mutex
	base := w.made.Load()
	// Delete i follows create i; once the hold is over, only the deletes
	// of creates made in it are left to do.
	followed := func(i int64) bool {
		for w.made.Load()-base <= i {
			if ctx.Err() != nil || time.Now().After(until) {
				return false
			}
			time.Sleep(time.Millisecond)
		}
		return true
	}
	out.wall = w.paced(ctx, w.clients, o.concurrency, len(ids), rate, followed, func(c *dsec.Client, i int64) {
		t := time.Now()
		err := c.DeleteSandbox(ctx, ids[i])
		d := time.Since(t)
		mu.Lock()
		defer mu.Unlock()
		if err != nil {
			out.failed++
			out.errs[errClass(err)]++
			return
		}
		out.ok++
		out.durs = append(out.durs, d)
		live.Add(-1)
	})
	return out
}

// cpExecs is what the exec traffic measured.
type cpExecs struct {
	failed int
	errs   map[string]int
	durs   []time.Duration
}

// execs runs `true` in sandboxes of ids, picked in turn, at --exec-rate
// until ctx ends.
func (w *cpWorld) execs(ctx context.Context, o cpOpts, ids []string) cpExecs {
	out := cpExecs{errs: map[string]int{}}
	if o.execRate == 0 || len(ids) == 0 {
		return out
	}
	var mu sync.Mutex
	w.paced(ctx, w.clients, min(64, max(1, o.concurrency/4)), math.MaxInt, o.execRate, nil, func(c *dsec.Client, i int64) {
		t := time.Now()
		res, err := c.Exec(ctx, ids[int(i)%len(ids)], api.ExecRequest{Argv: []string{"true"}})
		d := time.Since(t)
		if ctx.Err() != nil {
			return // cut off by the hold's end: not a failure
		}
		mu.Lock()
		defer mu.Unlock()
		switch {
		case err != nil:
			out.failed++
			out.errs[errClass(err)]++
		case res.ExitCode != 0:
			out.failed++
			out.errs[fmt.Sprintf("exit %d", res.ExitCode)]++
		default:
			out.durs = append(out.durs, d)
		}
	})
	return out
}

// cpViewSamples is the cluster's view sampled during the hold.
type cpViewSamples struct {
	spread []cpSpread
	maxAge float64
}

type cpSpread struct {
	AtSeconds   float64 `json:"at_seconds"`
	Live        int     `json:"live"`
	MaxOverMean float64 `json:"max_over_mean"`
	Stddev      float64 `json:"stddev"`
}

// sampleView takes placement's spread from GET /v1/nodes and the
// apiservers' watcher view age every period until ctx ends.
func (w *cpWorld) sampleView(ctx context.Context, period time.Duration) cpViewSamples {
	var out cpViewSamples
	start := time.Now()
	hc := &http.Client{Timeout: 2 * time.Second}
	for {
		select {
		case <-ctx.Done():
			return out
		case <-time.After(period):
		}
		if nodes, err := w.clients[0].ListNodes(ctx); err == nil {
			held := 0
			for _, n := range nodes {
				if n.Hollow {
					held += liveOn(n)
				}
			}
			m, sd := placementSpread(nodes)
			out.spread = append(out.spread, cpSpread{AtSeconds: time.Since(start).Seconds(), Live: held, MaxOverMean: m, Stddev: sd})
		}
		for _, u := range w.servers {
			if v, ok := promValue(hc, u+"/metrics", "dsec_watcher_view_age_seconds"); ok {
				out.maxAge = math.Max(out.maxAge, v)
			}
		}
	}
}

// promValue reads an unlabelled sample from a Prometheus text page.
func promValue(hc *http.Client, url, name string) (float64, bool) {
	m, err := promValues(hc, url)
	if err != nil {
		return 0, false
	}
	v, ok := m[name]
	return v, ok
}

// promValues reads the samples of a Prometheus text page: each labelled
// one under its series as written (`name{k="v"}`), and under its bare name
// the sum over its labels.
func promValues(hc *http.Client, url string) (map[string]float64, error) {
	resp, err := hc.Get(url)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		return nil, fmt.Errorf("%s: %s", url, resp.Status)
	}
	b, err := io.ReadAll(io.LimitReader(resp.Body, 32<<20))
	if err != nil {
		return nil, err
	}
	out := map[string]float64{}
	for _, line := range strings.Split(string(b), "\n") {
		if line == "" || line[0] == '#' {
			continue
		}
		name, rest, ok := strings.Cut(line, " ")
		if !ok {
			continue
		}
		series := ""
		if i := strings.IndexByte(name, '{'); i >= 0 {
			// A labelled sample: its labels may hold spaces.
			j := strings.LastIndexByte(line, '}')
			if j < 0 {
				continue
			}
			series, name, rest = line[:j+1], line[:i], strings.TrimSpace(line[j+1:])
		}
		f := strings.Fields(rest)
		if len(f) == 0 {
			continue
		}
		if v, err := strconv.ParseFloat(f[0], 64); err == nil {
			out[name] += v
			if series != "" {
				out[series] += v
			}
		}
	}
	return out, nil
}

// etcdFigures are what etcd's own metrics say.
type etcdFigures struct {
	// dbBytes is the database file; dbInUse what of it holds data (the
	// file does not shrink when history is compacted, only when it is
	// defragmented).
	writes, dbBytes, dbInUse, keys float64
}

// etcdMetrics reads etcd's /metrics on its client URL: the proposals
// committed so far (every write: each is a raft entry fsynced to the
// WAL), the database's size and its keys.
func etcdMetrics(c *etcdtest.Cluster) (*etcdFigures, error) {
	hc := c.HTTPClient()
	hc.Timeout = 5 * time.Second
	m, err := promValues(hc, strings.TrimSuffix(c.Endpoints()[0], "/")+"/metrics")
	if err != nil {
		return nil, err
	}
	return &etcdFigures{
		writes:  m["etcd_server_proposals_committed_total"],
		dbBytes: m["etcd_mvcc_db_total_size_in_bytes"],
		dbInUse: m["etcd_mvcc_db_total_size_in_use_in_bytes"],
		keys:    m["etcd_debugging_mvcc_keys_total"],
	}, nil
}

// profiles takes CPU profiles of every daemon, and of this process, over
// the middle of the hold into --profile.
func (w *cpWorld) profiles(ctx context.Context, o cpOpts) error {
	if err := os.MkdirAll(o.profile, 0o755); err != nil {
		return err
	}
	secs := max(1, min(30, int(o.duration.Seconds())/2))
	select {
	case <-ctx.Done():
		return nil
	case <-time.After(o.duration / 4):
	}
	f, err := os.Create(filepath.Join(o.profile, "bench.pprof"))
	if err != nil {
		return err
	}
	defer f.Close()
	if err := pprof.StartCPUProfile(f); err != nil {
		return err
	}
	err = w.profileDaemons(o.profile, "", nil, secs)
	pprof.StopCPUProfile()
	if err != nil {
		return err
	}
	progress("CPU profiles of %d s in %s (go tool pprof -top %s/NAME.pprof)", secs, o.profile, o.profile)
	return nil
}

// cpReport is what the bench prints (--json: as it is).
type cpReport struct {
	Time        time.Time `json:"time"`
	Edges       int       `json:"edges"`
	Apiservers  int       `json:"apiservers"`
	HollowProcs int       `json:"hollow_processes"`
	Target      struct {
		Sandboxes int     `json:"sandboxes"`
		Rate      int     `json:"rate"`
		Duration  float64 `json:"duration_seconds"`
		Jobs      int     `json:"jobs"`
		JobSize   int     `json:"job_size"`
		ExecRate  int     `json:"exec_rate"`
	} `json:"target"`
	// The hold: creates at the target rate (and as many deletes, and the
	// exec traffic) at full concurrency. FailedCreates counts every phase.
	CreatesPerSec float64        `json:"creates_per_sec"`
	DeletesPerSec float64        `json:"deletes_per_sec"`
	ExecsPerSec   float64        `json:"execs_per_sec"`
	FailedCreates int            `json:"failed_creates"`
	HoldFailed    int            `json:"hold_failed_creates"`
	HoldErrors    map[string]int `json:"hold_errors,omitempty"`
	FailedDeletes int            `json:"failed_deletes"`
	DeleteErrors  map[string]int `json:"delete_errors,omitempty"`
	FailedExecs   int            `json:"failed_execs"`
	ExecErrors    map[string]int `json:"exec_errors,omitempty"`
	CreateP50MS   float64        `json:"create_p50_ms"`
	CreateP99MS   float64        `json:"create_p99_ms"`
	CreateP999MS  float64        `json:"create_p999_ms"`
	DeleteP50MS   float64        `json:"delete_p50_ms"`
	DeleteP99MS   float64        `json:"delete_p99_ms"`
	ExecP50MS     float64        `json:"exec_p50_ms"`
	ExecP99MS     float64        `json:"exec_p99_ms"`
	// LiveSandboxes is what the clients hold after the hold; NodeSandboxes
	// what GET /v1/nodes counts on the hollow edges then (they must agree).
	LiveSandboxes int `json:"live_sandboxes"`
	NodeSandboxes int `json:"node_sandboxes"`
	// The fill, and how latency moved as concurrency grew (tenths of
	// the target).
	FillCreatesPerSec float64        `json:"fill_creates_per_sec"`
	FillFailed        int            `json:"fill_failed_creates"`
	FillErrors        map[string]int `json:"fill_errors,omitempty"`
	RefillFailed      int            `json:"refill_failed_creates"`
	ByConcurrency     []cpStep       `json:"create_latency_by_concurrency"`
	// Placement over the hollow edges: after the hold, and sampled during it.
	PlacementMaxOverMean float64    `json:"placement_max_over_mean"`
	PlacementStddev      float64    `json:"placement_stddev"`
	PlacementOverTime    []cpSpread `json:"placement_during_hold,omitempty"`
	ViewAgeMaxSeconds    float64    `json:"watcher_view_age_max_seconds"`
	// A whole job by label, at full concurrency.
	JobSize         int     `json:"job_sandboxes"`
	ListJobSeconds  float64 `json:"list_job_seconds"`
	PauseJobSeconds float64 `json:"pause_job_seconds"`
	ResumeJobSecs   float64 `json:"resume_job_seconds"`
	DeleteJobSecs   float64 `json:"delete_job_seconds"`
	// Every sandbox through every apiserver: how many gets and listed
	// sandboxes were checked, and how many one of them could not find.
	ReachChecked     int      `json:"reach_checked"`
	Unreachable      int      `json:"unreachable"`
	UnreachableNodes []string `json:"unreachable_nodes,omitempty"`
	// EdgeDeath is the edge-death phase (--edge-death), APIDeath the
	// apiserver-death phase (--apiserver-death).
	EdgeDeath *cpDeath    `json:"edge_death,omitempty"`
	APIDeath  *cpAPIDeath `json:"apiserver_death,omitempty"`
	// The teardown: everything deleted by label, and what the nodes still
	// count after it (must be 0).
	DeletedAll       int     `json:"deleted_all"`
	DeleteAllSeconds float64 `json:"delete_all_seconds"`
	LeftAfterDelete  int     `json:"left_after_delete"`
	// Processes: CPU seconds over the whole run, RSS at full concurrency.
	Procs []cpProc `json:"processes"`
	// What the hold cost in CPU, by process, and what the host's cores
	// spent over it (all processes, from /proc/stat): who is the limit,
	// and what a rate would need elsewhere (ApiserverCoresAtTarget: the
	// apiservers' CPU per create times the target rate).
	HostCores              int         `json:"host_cores"`
	HoldHostBusyCores      float64     `json:"hold_host_busy_cores"`
	HoldCPU                []cpHoldCPU `json:"hold_cpu"`
	ApiserverMSPerCreate   float64     `json:"apiserver_cpu_ms_per_create"`
	ApiserverCoresAtTarget float64     `json:"apiserver_cores_at_target"`
	// Control-plane memory per live sandbox (the largest apiserver's RSS
	// growth from empty to full, over the live sandboxes), and etcd's own
	// figures: its database, keys, and writes per second during the hold.
	ApiserverBytesPerSandbox float64 `json:"apiserver_bytes_per_sandbox"`
	EtcdDBBytes              int64   `json:"etcd_db_bytes"`
	EtcdDBInUseBytes         int64   `json:"etcd_db_in_use_bytes"`
	EtcdKeys                 int64   `json:"etcd_keys"`
	EtcdBytesPerSandbox      float64 `json:"etcd_bytes_per_sandbox"`
	EtcdWritesPerSec         float64 `json:"etcd_writes_per_sec"`
	// After the teardown, on empty edges: the same burst per placement
	// strategy (--placement-compare), then cloud bursting (--cloud-edges).
	Strategies []cpStrategy `json:"placement_strategies,omitempty"`
	CloudBurst *cpBurst     `json:"cloud_burst,omitempty"`
}

type cpStep struct {
	LiveFrom int     `json:"live_from"`
	N        int     `json:"n"`
	P50MS    float64 `json:"p50_ms"`
	P99MS    float64 `json:"p99_ms"`
	P999MS   float64 `json:"p999_ms"`
}

// cpHoldCPU is one process group's CPU over the hold: cores busy on
// average, and CPU milliseconds per create of the hold (which also
// carries a delete per create and the exec traffic).
type cpHoldCPU struct {
	Name        string  `json:"name"`
	Cores       float64 `json:"cores"`
	MSPerCreate float64 `json:"cpu_ms_per_create"`
}

// cpuGroup is a process group whose CPU the hold reports.
type cpuGroup struct {
	name      string
	apiserver bool // counts in the apiserver tier
	pids      func() []int
}

// cpuGroups are the hold's process groups, in the order reported: each
// apiserver (by exact name: server1, not server1-restarted), the hollow
// edges, etcd and this process (the clients).
func (w *cpWorld) cpuGroups() []cpuGroup {
	var groups []cpuGroup
	for i := range w.servers {
		name := fmt.Sprintf("server%d", i)
		groups = append(groups, cpuGroup{name, true, func() []int { return w.pidsNamed(name) }})
	}
	return append(groups,
		cpuGroup{"hollow edges", false, func() []int { return w.pids("hollow") }},
		cpuGroup{"etcd", false, w.etcd.Pids},
		cpuGroup{"bench (clients)", false, func() []int { return []int{os.Getpid()} }})
}

// cpuOf reads the CPU seconds each group has spent so far.
func cpuOf(groups []cpuGroup) []float64 {
	out := make([]float64, len(groups))
	for i, g := range groups {
		out[i] = cpuSeconds(g.pids())
	}
	return out
}

// pidsNamed returns the process ids of the daemons named exactly name.
func (w *cpWorld) pidsNamed(name string) []int {
	var out []int
	for _, p := range w.procs {
		if p.name == name && p.cmd != nil && p.cmd.Process != nil {
			out = append(out, p.cmd.Process.Pid)
		}
	}
	return out
}

// holdCPU fills the hold's CPU figures from two readings of cpuOf
// taken wall apart, over which creates creates were made. (A process
// that exited in between would make its group's reading go down: none
// does in the hold, and a negative figure is counted as none.)
func (r *cpReport) holdCPU(groups []cpuGroup, before, after []float64, wall time.Duration, creates int) {
	var apiserverS float64
	for i, g := range groups {
		d := max(after[i]-before[i], 0)
		c := cpHoldCPU{Name: g.name, Cores: d / wall.Seconds()}
		if creates > 0 {
			c.MSPerCreate = 1000 * d / float64(creates)
		}
		r.HoldCPU = append(r.HoldCPU, c)
		if g.apiserver {
			apiserverS += d
		}
	}
	if creates > 0 {
		r.ApiserverMSPerCreate = 1000 * apiserverS / float64(creates)
		r.ApiserverCoresAtTarget = r.ApiserverMSPerCreate * float64(r.Target.Rate) / 1000
	}
}

// hostBusySeconds is the CPU time every core of the host has spent
// working since boot, and how many cores it has, from /proc/stat.
func hostBusySeconds() (float64, int, error) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0, err
	}
	return parseProcStat(string(b))
}

// parseProcStat reads /proc/stat's text: the busy time of the "cpu" line
// (user, nice, system, irq, softirq; not idle, iowait or steal, and guest
// time is inside user) in seconds (USER_HZ is 100), and the "cpuN" lines.
func parseProcStat(text string) (float64, int, error) {
	busy, cores := -1.0, 0
	for _, line := range strings.Split(text, "\n") {
		f := strings.Fields(line)
		switch {
		case len(f) == 0 || !strings.HasPrefix(f[0], "cpu"):
		case f[0] == "cpu":
			if len(f) < 8 {
				return 0, 0, fmt.Errorf("/proc/stat: short cpu line %q", line)
			}
			busy = 0
			for _, i := range []int{1, 2, 3, 6, 7} { // user nice system irq softirq
				v, err := strconv.ParseFloat(f[i], 64)
				if err != nil {
					return 0, 0, fmt.Errorf("/proc/stat: %w", err)
				}
				busy += v
			}
		default:
			cores++
		}
	}
	if busy < 0 || cores == 0 {
		return 0, 0, fmt.Errorf("/proc/stat: no cpu lines")
	}
	return busy / 100, cores, nil
}

type cpProc struct {
	Name       string  `json:"name"`
	CPUSeconds float64 `json:"cpu_seconds"`
	RSSBytes   int64   `json:"rss_bytes"`
}

func durs(s []cpSample) []time.Duration {
	out := make([]time.Duration, len(s))
	for i, v := range s {
		out[i] = v.d
	}
	return out
}

func (w *cpWorld) run(ctx context.Context, o cpOpts) (*cpReport, error) {
	rep := &cpReport{Time: time.Now().UTC(), Edges: o.edges, Apiservers: o.apiservers, HollowProcs: o.hollowProcs}
	rep.Target.Sandboxes, rep.Target.Rate, rep.Target.Duration, rep.Target.Jobs, rep.Target.JobSize = o.sandboxes, o.rate, o.duration.Seconds(), o.jobs, o.jobSize
	rep.Target.ExecRate = o.execRate
	rssEmpty := map[string]int64{}
	for i := range w.servers {
		name := fmt.Sprintf("server%d", i)
		rssEmpty[name] = w.rss(name)
	}
	var live atomic.Int64
	// The fill: job after job, each a burst at the target rate.
	var fill cpPhase
	fill.errs = map[string]int{}
	jobIDs := map[string][]string{}
	var order []string // jobs, oldest first
	left := o.sandboxes
	start := time.Now()
	for j := 0; left > 0 && ctx.Err() == nil; j++ {
		// What does not make a whole job goes first (the hold deletes the
		// oldest): the newest, timed by label, is a whole one.
		n := min(o.jobSize, left)
		if j == 0 && left%o.jobSize != 0 {
			n = left % o.jobSize
		}
		job := fmt.Sprintf("job-%d", j)
		progress("fill: %s, %d creates (live %d of %d)", job, n, live.Load(), o.sandboxes)
		ph := w.creates(ctx, o, job, n, o.rate, &live)
		fill.add(ph)
		jobIDs[job] = ph.ids
		order = append(order, job)
		left -= n
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	fill.wall = time.Since(start)
	rep.FillCreatesPerSec = float64(len(fill.samples)) / fill.wall.Seconds()
	rep.FillFailed, rep.FillErrors = fill.fails, fill.errs
	rep.ByConcurrency = byConcurrency(fill.samples, o.sandboxes)

	// A whole job by label at full concurrency (the newest): list, pause,
	// resume and delete it, then a new job of the same size takes its
	// place in one burst.
	job := order[len(order)-1]
	if err := w.jobByLabel(ctx, rep, job, jobIDs[job], &live); err != nil {
		return nil, err
	}
	order = order[:len(order)-1]
	delete(jobIDs, job)
	// (Named after the fill's jobs, which it must not take the name of:
	// the hold deletes the older jobs by name.)
	job = fmt.Sprintf("job-%d", len(order)+1)
	progress("refill: %s, %d creates", job, rep.JobSize)
	refill := w.creates(ctx, o, job, rep.JobSize, o.rate, &live)
	jobIDs[job], order = refill.ids, append(order, job)
	rep.RefillFailed = refill.fails

	// The hold: new creates at the target rate, the oldest jobs' sandboxes
	// deleted as fast (so that concurrency holds), execs into the newest
	// job, and the view sampled as it goes.
	total := o.rate * int(o.duration.Seconds())
	var old []string
	for _, j := range order[:len(order)-1] {
		if len(old) >= total {
			break
		}
		old = append(old, jobIDs[j]...)
	}
	old = old[:min(len(old), total)]
	progress("hold: %d creates/s, %d deletes/s and %d execs/s for %s at %d live", o.rate, len(old)/int(o.duration.Seconds()), o.execRate, o.duration, live.Load())
	etcd0, err := etcdMetrics(w.etcd)
	if err != nil {
		progress("etcd's metrics: %v (its figures are left out)", err)
	}
	groups := w.cpuGroups()
	cpu0 := cpuOf(groups)
	busy0, _, busyErr0 := hostBusySeconds()
	holdCtx, endHold := context.WithCancel(ctx)
	var wg sync.WaitGroup
	var del cpDeletes
	var ex cpExecs
	var samples cpViewSamples
	wg.Add(3)
	holdStart := time.Now()
	until := holdStart.Add(o.duration)
	go func() { defer wg.Done(); del = w.deletes(ctx, o, old, o.rate, until, &live) }()
	go func() { defer wg.Done(); ex = w.execs(holdCtx, o, refill.ids) }()
	go func() { defer wg.Done(); samples = w.sampleView(holdCtx, 2*time.Second) }()
	var profErr error
	if o.profile != "" {
		wg.Add(1)
		go func() { defer wg.Done(); profErr = w.profiles(holdCtx, o) }()
	}
	hold := w.createsUntil(ctx, o, "hold", total, o.rate, until, &live)
	holdWall := time.Since(holdStart)
	cpu1 := cpuOf(groups)
	busy1, cores, busyErr := hostBusySeconds()
	endHold()
	wg.Wait()
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if profErr != nil {
		return nil, profErr
	}
	etcd1, err := etcdMetrics(w.etcd)
	if err != nil {
		progress("etcd's metrics: %v (its figures are left out)", err)
	}
	rep.CreatesPerSec = float64(len(hold.samples)) / holdWall.Seconds()
	rep.DeletesPerSec = float64(del.ok) / max(holdWall, del.wall).Seconds()
	rep.FailedCreates = fill.fails + refill.fails + hold.fails
	rep.HoldFailed, rep.HoldErrors = hold.fails, hold.errs
	rep.FailedDeletes, rep.DeleteErrors = del.failed, del.errs
	d := durs(hold.samples)
	rep.CreateP50MS, rep.CreateP99MS, rep.CreateP999MS = pct(d, .5), pct(d, .99), pct(d, .999)
	rep.DeleteP50MS, rep.DeleteP99MS = pct(del.durs, .5), pct(del.durs, .99)
	rep.ExecsPerSec = float64(len(ex.durs)) / holdWall.Seconds()
	rep.FailedExecs, rep.ExecErrors = ex.failed, ex.errs
	rep.ExecP50MS, rep.ExecP99MS = pct(ex.durs, .5), pct(ex.durs, .99)
	rep.LiveSandboxes = int(live.Load())
	rep.holdCPU(groups, cpu0, cpu1, holdWall, len(hold.samples))
	if busyErr0 == nil && busyErr == nil {
		rep.HostCores, rep.HoldHostBusyCores = cores, (busy1-busy0)/holdWall.Seconds()
	}
	rep.PlacementOverTime = samples.spread
	rep.ViewAgeMaxSeconds = samples.maxAge
	if etcd1 != nil && etcd0 != nil {
		rep.EtcdWritesPerSec = (etcd1.writes - etcd0.writes) / holdWall.Seconds()
		rep.EtcdDBBytes = int64(etcd1.dbBytes)
		rep.EtcdDBInUseBytes = int64(etcd1.dbInUse)
		rep.EtcdKeys = int64(etcd1.keys)
	}

	// The view once the hold is over: placement, the nodes' counts against
	// what the clients hold, and every sandbox's reachability.
	if err := w.settle(ctx, rep); err != nil {
		return nil, err
	}
	for i := range w.servers {
		name := fmt.Sprintf("server%d", i)
		rss := w.rss(name)
		rep.Procs = append(rep.Procs, cpProc{Name: name, RSSBytes: rss})
		if grown := rss - rssEmpty[name]; rep.LiveSandboxes > 0 && grown > 0 {
			rep.ApiserverBytesPerSandbox = max(rep.ApiserverBytesPerSandbox, float64(grown)/float64(rep.LiveSandboxes))
		}
	}
	rep.Procs = append(rep.Procs, cpProc{Name: "hollow (all)", RSSBytes: w.rss("hollow")})
	if rep.LiveSandboxes > 0 {
		rep.EtcdBytesPerSandbox = float64(rep.EtcdDBInUseBytes) / float64(rep.LiveSandboxes)
	}
	if err := w.reach(ctx, rep, jobIDs[job], hold.ids); err != nil {
		return nil, err
	}
	if o.edgeDeath && len(w.hollow) > 1 {
		d, err := w.edgeDeath(ctx, o, &live)
		if err != nil {
			return nil, fmt.Errorf("edge death: %w", err)
		}
		rep.EdgeDeath = d
		rep.FailedCreates += d.FailedCreates
	}
	if o.apiserverDeath && len(w.servers) > 1 {
		d, err := w.apiserverDeath(ctx, o, &live)
		if err != nil {
			return nil, fmt.Errorf("apiserver death: %w", err)
		}
		rep.APIDeath = d
		rep.FailedCreates += d.FailedCreates
	}

	// Everything the bench made, deleted by label; nothing may be left.
	t := time.Now()
	n, err := w.clients[0].DeleteSandboxes(ctx, map[string]string{"bench": w.label})
	rep.DeleteAllSeconds, rep.DeletedAll = time.Since(t).Seconds(), n
	if nodesUnreachable(err) {
		// What those nodes hold is counted next, as left.
		fmt.Fprintf(os.Stderr, "bench control-plane: %v\n", err)
	} else if err != nil {
		return nil, fmt.Errorf("deleting the bench's sandboxes: %d deleted: %w", n, err)
	}
	if rep.LeftAfterDelete, err = w.nodesHolding(ctx, 0); err != nil {
		return nil, err
	}
	// (What was deleted includes the killed edges' failed records, which
	// live no longer counted: what the nodes hold now is what is live.)
	live.Store(int64(rep.LeftAfterDelete))
	for i := range rep.Procs {
		prefix := rep.Procs[i].Name
		if prefix == "hollow (all)" {
			prefix = "hollow"
		}
		rep.Procs[i].CPUSeconds = cpuSeconds(w.pids(prefix))
	}
	rep.Procs = append(rep.Procs, cpProc{Name: "etcd", CPUSeconds: cpuSeconds(w.etcd.Pids()), RSSBytes: rssOf(w.etcd.Pids())})
	rep.Procs = append(rep.Procs, cpProc{Name: "bench (clients)", CPUSeconds: cpuSeconds([]int{os.Getpid()}), RSSBytes: rssOf([]int{os.Getpid()})})

	if o.placementCompare > 0 {
		if rep.Strategies, err = w.comparePlacement(ctx, o, o.placementCompare, &live); err != nil {
			return nil, fmt.Errorf("placement strategies: %w", err)
		}
		for _, s := range rep.Strategies {
			rep.FailedCreates += s.FailedCreates
		}
	}
	if o.cloudEdges > 0 {
		n := o.placementCompare
		if n <= 0 {
			n = min(max(o.sandboxes/10, 4*o.edges), 40000)
		}
		if rep.CloudBurst, err = w.cloudBurst(ctx, o, n, &live); err != nil {
			return nil, fmt.Errorf("cloud bursting: %w", err)
		}
		rep.FailedCreates += rep.CloudBurst.FailedCreates
	}
	return rep, nil
}

func (p *cpPhase) add(q cpPhase) {
	p.samples = append(p.samples, q.samples...)
	p.fails += q.fails
	for k, v := range q.errs {
		p.errs[k] += v
	}
}

// jobByLabel lists, pauses, resumes and deletes the job by its label.
func (w *cpWorld) jobByLabel(ctx context.Context, rep *cpReport, job string, ids []string, live *atomic.Int64) error {
	rep.JobSize = len(ids)
	sel := map[string]string{"job": job, "bench": w.label}
	c := w.clients[0]
	progress("%s of %d by label: list, pause, resume, delete", job, rep.JobSize)
	t := time.Now()
	listed, skipped, err := listAll(ctx, c, sel)
	if err != nil {
		return fmt.Errorf("listing %s: %w", job, err)
	}
	rep.ListJobSeconds = time.Since(t).Seconds()
	if len(listed) != rep.JobSize {
		return fmt.Errorf("listing %s found %d sandboxes, want %d (nodes left out as unreachable: %v)", job, len(listed), rep.JobSize, skipped)
	}
	t = time.Now()
	if n, err := c.PauseSandboxes(ctx, sel); err != nil || n != rep.JobSize {
		return fmt.Errorf("pausing %s: %d of %d paused: %v", job, n, rep.JobSize, err)
	}
	rep.PauseJobSeconds = time.Since(t).Seconds()
	t = time.Now()
	if n, err := c.ResumeSandboxes(ctx, sel); err != nil || n != rep.JobSize {
		return fmt.Errorf("resuming %s: %d of %d resumed: %v", job, n, rep.JobSize, err)
	}
	rep.ResumeJobSecs = time.Since(t).Seconds()
	t = time.Now()
	n, err := c.DeleteSandboxes(ctx, sel)
	if err != nil || n != rep.JobSize {
		return fmt.Errorf("deleting %s: %d of %d deleted: %v", job, n, rep.JobSize, err)
	}
	rep.DeleteJobSecs = time.Since(t).Seconds()
	live.Add(-int64(n))
	return nil
}

// listAll lists every sandbox whose labels hold sel, page by page (of
// 1,000), with the nodes any page left out as unreachable.
func listAll(ctx context.Context, c *dsec.Client, sel map[string]string) ([]api.Sandbox, []string, error) {
	var all []api.Sandbox
	var skipped []string
	opts := dsec.ListOptions{Labels: sel, Limit: 1000}
	for {
		page, err := c.ListSandboxes(ctx, opts)
		if err != nil {
			return nil, nil, err
		}
		all = append(all, page.Sandboxes...)
		for _, n := range page.UnreachableNodes {
			if !slices.Contains(skipped, n) {
				skipped = append(skipped, n)
			}
		}
		if page.NextPageToken == "" || page.NextPageToken == opts.PageToken {
			return all, skipped, nil
		}
		opts.PageToken = page.NextPageToken
	}
}

// settle waits (up to 30 s: the watcher polls) until the nodes' counts
// add up to the live sandboxes the clients hold, then takes placement's
// spread.
func (w *cpWorld) settle(ctx context.Context, rep *cpReport) error {
	held, err := w.nodesHolding(ctx, rep.LiveSandboxes)
	rep.NodeSandboxes = held
	if err != nil {
		return err
	}
	nodes, err := w.clients[0].ListNodes(ctx)
	if err != nil {
		return err
	}
	rep.PlacementMaxOverMean, rep.PlacementStddev = placementSpread(nodes)
	return nil
}

// nodesHolding waits up to 30 s for GET /v1/nodes to count want live
// sandboxes on the hollow edges, and returns the last count.
func (w *cpWorld) nodesHolding(ctx context.Context, want int) (int, error) {
	deadline := time.Now().Add(30 * time.Second)
	for {
		nodes, err := w.clients[0].ListNodes(ctx)
		if err != nil {
			return 0, err
		}
		held := 0
		for _, n := range nodes {
			if n.Hollow {
				held += liveOn(n)
			}
		}
		if held == want || time.Now().After(deadline) {
			return held, nil
		}
		select {
		case <-ctx.Done():
			return held, ctx.Err()
		case <-time.After(250 * time.Millisecond):
		}
	}
}

func liveOn(n api.Node) int {
	return n.Counts[api.StateRunning] + n.Counts[api.StatePaused] + n.Counts[api.StateCreating]
}

// reach gets sandboxes through every apiserver: the whole job (listed by
// label through each), and up to 500 of the hold's one by one through
// each. What one of them cannot find is counted unreachable.
func (w *cpWorld) reach(ctx context.Context, rep *cpReport, job, sample []string) error {
	if len(job) > 0 {
		want := map[string]bool{}
		for _, id := range job {
			want[id] = true
		}
		sb, err := w.clients[0].GetSandbox(ctx, job[0])
		if err != nil {
			return fmt.Errorf("getting %s: %w", job[0], err)
		}
		for i, c := range w.clients {
			listed, skipped, err := listAll(ctx, c, map[string]string{"job": sb.Labels["job"], "bench": w.label})
			if err != nil {
				return fmt.Errorf("listing through apiserver %d: %w", i, err)
			}
			rep.UnreachableNodes = append(rep.UnreachableNodes, skipped...)
			seen := 0
			for _, s := range listed {
				if want[s.ID] {
					seen++
				}
			}
			rep.Unreachable += len(job) - seen
		}
	}
	step := max(1, len(sample)/500)
	for i := 0; i < len(sample); i += step {
		for _, c := range w.clients {
			if _, err := c.GetSandbox(ctx, sample[i]); err != nil {
				rep.Unreachable++
			}
		}
		rep.ReachChecked++
	}
	rep.ReachChecked = rep.ReachChecked*len(w.clients) + len(job)*len(w.clients)
	return nil
}

// byConcurrency splits creates by the live count when they started, in
// tenths of target.
func byConcurrency(s []cpSample, target int) []cpStep {
	step := max(1, target/10)
	buckets := map[int][]time.Duration{}
	for _, v := range s {
		buckets[v.live/step] = append(buckets[v.live/step], v.d)
	}
	var keys []int
	for k := range buckets {
		keys = append(keys, k)
	}
	sort.Ints(keys)
	var out []cpStep
	for _, k := range keys {
		b := buckets[k]
		out = append(out, cpStep{LiveFrom: k * step, N: len(b), P50MS: pct(b, .5), P99MS: pct(b, .99), P999MS: pct(b, .999)})
	}
	return out
}

// placementSpread is max/mean and the standard deviation of live
// sandboxes per hollow edge.
func placementSpread(nodes []api.Node) (float64, float64) {
	var loads []float64
	for _, n := range nodes {
		if !n.Hollow {
			continue
		}
		loads = append(loads, float64(liveOn(n)))
	}
	mx, mean := maxMean(loads)
	if mean == 0 {
		return 0, 0
	}
	var v float64
	for _, l := range loads {
		v += (l - mean) * (l - mean)
	}
	return mx / mean, math.Sqrt(v / float64(len(loads)))
}

// rss is the summed resident memory of the named daemons.
func (w *cpWorld) rss(prefix string) int64 { return rssOf(w.pids(prefix)) }

func rssOf(pids []int) int64 {
	var total int64
	for _, pid := range pids {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/statm", pid))
		if err != nil {
			continue
		}
		var size, res int64
		fmt.Sscan(string(b), &size, &res)
		total += res * int64(os.Getpagesize())
	}
	return total
}

func printCPReport(r *cpReport) error {
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0) // dsec's own numbers: nothing to escape
	fmt.Fprintf(tw, "target\t%d hollow edges in %d processes, %d apiserver(s), %d live, %d creates/s for %.0f s, %d jobs of %d, %d execs/s\n",
		r.Edges, r.HollowProcs, r.Apiservers, r.Target.Sandboxes, r.Target.Rate, r.Target.Duration, r.Target.Jobs, r.Target.JobSize, r.Target.ExecRate)
	fmt.Fprintf(tw, "fill\t%.0f creates/s, %d failed\n", r.FillCreatesPerSec, r.FillFailed)
	for _, s := range r.ByConcurrency {
		fmt.Fprintf(tw, "  live from %d\tcreate p50 %.1f ms, p99 %.1f ms, p99.9 %.1f ms (%d)\n", s.LiveFrom, s.P50MS, s.P99MS, s.P999MS, s.N)
	}
	fmt.Fprintf(tw, "job of %d by label\tlist %.2f s, pause %.2f s, resume %.2f s, delete %.2f s (then a new job of as many: %d failed)\n",
		r.JobSize, r.ListJobSeconds, r.PauseJobSeconds, r.ResumeJobSecs, r.DeleteJobSecs, r.RefillFailed)
	fmt.Fprintf(tw, "hold\t%.0f creates/s, %.0f deletes/s, %.0f execs/s; failed: %d creates (all phases), %d deletes, %d execs\n",
		r.CreatesPerSec, r.DeletesPerSec, r.ExecsPerSec, r.FailedCreates, r.FailedDeletes, r.FailedExecs)
	fmt.Fprintf(tw, "  create\tp50 %.1f ms, p99 %.1f ms, p99.9 %.1f ms\n", r.CreateP50MS, r.CreateP99MS, r.CreateP999MS)
	fmt.Fprintf(tw, "  delete\tp50 %.1f ms, p99 %.1f ms\n", r.DeleteP50MS, r.DeleteP99MS)
	fmt.Fprintf(tw, "  exec\tp50 %.1f ms, p99 %.1f ms\n", r.ExecP50MS, r.ExecP99MS)
	fmt.Fprintf(tw, "live sandboxes\t%d held by the clients, %d counted by GET /v1/nodes\n", r.LiveSandboxes, r.NodeSandboxes)
	worst := 0.0
	for _, s := range r.PlacementOverTime {
		worst = math.Max(worst, s.MaxOverMean)
	}
	fmt.Fprintf(tw, "placement\tmax/mean %.3f, stddev %.1f per edge (worst during the hold %.3f)\n", r.PlacementMaxOverMean, r.PlacementStddev, worst)
	fmt.Fprintf(tw, "watcher view age\tat most %.2f s\n", r.ViewAgeMaxSeconds)
	fmt.Fprintf(tw, "reachability\t%d checked through every apiserver, %d not found\n", r.ReachChecked, r.Unreachable)
	if d := r.EdgeDeath; d != nil {
		fmt.Fprintf(tw, "edge death\t%s killed (%d edges, %d sandboxes with them) after %d of a burst of %d creates: %d failed (%v); %d sent to a dead edge, %d resent after a lost answer\n",
			d.Process, d.EdgesKilled, d.SandboxesLost, d.KilledAfter, d.BurstCreates, d.FailedCreates, d.Errors, d.SentToDead, d.Resent)
		fmt.Fprintf(tw, "  \tunhealthy in every view %.2f s after the kill; create p50 %.1f ms, p99 %.1f ms; restarted, healthy in %.1f s; %d live, %d counted by GET /v1/nodes\n",
			d.UnhealthySeconds, d.CreateP50MS, d.CreateP99MS, d.RestartSeconds, d.LiveAfter, d.NodeSandboxes)
	}
	if d := r.APIDeath; d != nil {
		fmt.Fprintf(tw, "apiserver death\t%s killed after %d of a burst of %d keyed creates (clients know every apiserver): %d failed (%v), %d made twice\n",
			d.Server, d.KilledAfter, d.BurstCreates, d.FailedCreates, d.Errors, d.Duplicates)
		fmt.Fprintf(tw, "  \tcreate p50 %.1f ms, p99 %.1f ms, max %.0f ms; restarted, serving in %.1f s\n", d.CreateP50MS, d.CreateP99MS, d.CreateMaxMS, d.RestartSeconds)
	}
	fmt.Fprintf(tw, "teardown\t%d deleted by label in %.2f s, %d left\n", r.DeletedAll, r.DeleteAllSeconds, r.LeftAfterDelete)
	for _, p := range r.Procs {
		fmt.Fprintf(tw, "%s\tCPU %.1f s, RSS %.0f MiB\n", p.Name, p.CPUSeconds, float64(p.RSSBytes)/(1<<20))
	}
	if len(r.HoldCPU) > 0 {
		var parts []string
		for _, c := range r.HoldCPU {
			parts = append(parts, fmt.Sprintf("%s %.2f (%.2f ms per create)", c.Name, c.Cores, c.MSPerCreate))
		}
		fmt.Fprintf(tw, "hold CPU, cores\thost %.2f of %d busy; %s\n", r.HoldHostBusyCores, r.HostCores, strings.Join(parts, ", "))
		fmt.Fprintf(tw, "  apiserver tier\t%.2f ms of CPU per create (with %.2f deletes and %.2f execs per create); times %d creates/s: %.1f cores (a linear estimate, fixed costs included)\n",
			r.ApiserverMSPerCreate, r.DeletesPerSec/math.Max(r.CreatesPerSec, 1), r.ExecsPerSec/math.Max(r.CreatesPerSec, 1), r.Target.Rate, r.ApiserverCoresAtTarget)
	}
	if r.EtcdDBBytes == 0 { // a database file is never empty: etcd's metrics were not read
		fmt.Fprintf(tw, "control-plane memory\tapiserver %.0f B per live sandbox; etcd not measured\n", r.ApiserverBytesPerSandbox)
	} else {
		fmt.Fprintf(tw, "control-plane memory\tapiserver %.0f B per live sandbox; etcd %.1f MiB in use of a %.1f MiB file, %d keys (%.0f B in use per live sandbox), %.0f writes/s in the hold\n",
			r.ApiserverBytesPerSandbox, float64(r.EtcdDBInUseBytes)/(1<<20), float64(r.EtcdDBBytes)/(1<<20), r.EtcdKeys, r.EtcdBytesPerSandbox, r.EtcdWritesPerSec)
	}
	for i, s := range r.Strategies {
		if i == 0 {
			fmt.Fprintf(tw, "placement strategies\t%d creates each from empty edges, through apiservers of their own\n", s.Creates)
		}
		ov := map[bool]string{true: "overlay", false: "no overlay"}[s.Overlay]
		fmt.Fprintf(tw, "  %s (k %s), %s\tmax/mean %.3f at the end (stddev %.1f), worst %.3f during; a job's max/mean %.3f; %.0f creates/s, %d failed %v\n",
			s.Strategy, s.PlacementK, ov, s.MaxOverMean, s.Stddev, s.WorstDuring, s.JobMaxOverMean, s.CreatesPerSec, s.FailedCreates, s.Errors)
	}
	if b := r.CloudBurst; b != nil {
		fmt.Fprintf(tw, "cloud bursting\t%d cloud edges, threshold %.4f (%d per edge, reached after %d creates on average); %d creates, %d failed %v\n",
			b.CloudEdges, b.Threshold, b.ThresholdAt, b.ThresholdCreates, b.Creates, b.FailedCreates, b.Errors)
		fmt.Fprintf(tw, "  \t%d to the cloud pool, the first after %d creates, %d before the threshold; %.1f%% of the creates after it (the pool is %.1f%% of the edges); regular edges hold at least %d\n",
			b.ToCloud, b.FirstToCloud, b.BeforeThreshold, 100*b.ShareAfter, 100*b.CloudShareOfEdges, b.RegularMin)
	}
	return tw.Flush()
}
