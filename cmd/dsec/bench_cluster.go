package main

// `dsec bench cluster` prices the cluster's extra hop: it starts a `dsec
// up` and, beside it on the same machine, a cluster (etcd, apiservers,
// edges on loopback addresses of their own), and measures the same calls
// on both in one run, so that a noisy machine weighs on both alike:
// sequential create and exec latency (the two sides interleaved call by
// call), and a burst of creates spread over the edges against the same
// burst on the single node (the side going first alternating by round).

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/cluster"
	"github.com/dsecproject/dsec/internal/store/etcdtest"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

type benchClusterOpts struct {
	count      int
	burst      int
	burstConc  int
	bareBurst  bool
	edges      int
	apiservers int
	rounds     int
	dir        string
	profile    string
	keep       bool
	jsonOut    bool
}

// benchProc is a daemon the benchmark started.
type benchProc struct {
	name, log string
	cmd       *exec.Cmd
	// env and args are what it was started with (to start it again).
	env, args []string
}

func (p *benchProc) stop() {
	if p.cmd == nil || p.cmd.Process == nil {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { _ = p.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		_ = p.cmd.Process.Kill()
		<-done
	}
}

func runBenchCluster(args []string) error {
	var o benchClusterOpts
	f := newCmdFlags("bench cluster", "[flags]", "Start a dsec up and a cluster (etcd, apiservers, edges) side by side on this machine\n"+
		"and measure create and exec latency and a burst of creates on both in one run.\n"+
		"Needs root and etcd (apt-get install etcd-server).")
	f.IntVar(&o.count, "count", 100, "one-at-a-time creates (with and without idempotency keys) and execs per side and round; the cluster's go to its first edge")
	f.IntVar(&o.burst, "burst", 1000, "creates of the burst")
	f.IntVar(&o.burstConc, "burst-concurrency", 64, "creates of the burst in flight at once")
	f.IntVar(&o.edges, "edges", 3, "edges of the cluster")
	f.IntVar(&o.apiservers, "apiservers", 1, "apiservers of the cluster (clients use all)")
	f.IntVar(&o.rounds, "rounds", 2, "rounds of every measure, alternating dsec up and the cluster")
	f.StringVar(&o.dir, "dir", "", "working directory (default: a new one under /tmp, removed afterwards)")
	f.BoolVar(&o.keep, "keep", false, "keep the working directory and the daemons' logs")
	f.BoolVar(&o.bareBurst, "bare-burst", false, "also run each round's bursts without idempotency keys (rows \"..., no keys\"): what the keyed creates' claims cost")
	f.StringVar(&o.profile, "profile", "", "write CPU profiles of every daemon over each burst to this directory (ROUND-SIDE-NAME.pprof)")
	f.BoolVar(&o.jsonOut, "json", false, "print JSON instead of a table")
	if _, err := f.parseN(args, 0, 0); err != nil {
		return err
	}
	if o.count < 1 || o.burst < 1 || o.burstConc < 1 || o.edges < 1 || o.edges > 20 || o.apiservers < 1 || o.apiservers > 8 || o.rounds < 1 {
		return errors.New("bench cluster: --count, --burst, --burst-concurrency and --rounds must be ≥ 1, --edges 1-20, --apiservers 1-8")
	}
	if os.Geteuid() != 0 {
		return errors.New("bench cluster needs root: it starts dsec up and dsec edge")
	}
	if _, err := etcdtest.Binary(); err != nil {
		return fmt.Errorf("bench cluster: %w", err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	b, err := startBenchWorld(ctx, o)
	if b != nil {
		defer b.close(o.keep)
	}
	if err != nil {
		return err
	}
	rows, err := b.measure(ctx, o)
	if err != nil {
		return err
	}
	return printClusterBench(rows, o)
}

// benchWorld is the dsec up and the cluster under test.
type benchWorld struct {
	dir, bin string
	// metrics are the /metrics URLs of dsec up and every edge.
	metrics []string
	procs   []*benchProc
	etcd    *etcdtest.Cluster
	// edgeFlags are the flags a daemon of the cluster needs (etcd, the
	// cluster's certificates, the layers).
	edgeFlags []string
	// up and cluster send Idempotency-Keys as the SDK does by default;
	// the bare ones do not.
	up, upBare           *dsec.Client
	cluster, clusterBare *dsec.Client
	upRef                string
	clRef                string
	// pprof is the profiling address of each daemon by name, when the
	// bench profiles.
	pprof map[string]string
}

// profEnv is the environment of a daemon named name: a profiling
// listener of its own when on (b.pprof records where).
func (b *benchWorld) profEnv(on bool, name string) ([]string, error) {
	if !on {
		return nil, nil
	}
	port, err := benchPort("127.0.0.1")
	if err != nil {
		return nil, err
	}
	if b.pprof == nil {
		b.pprof = map[string]string{}
	}
	b.pprof[name] = "127.0.0.1:" + port
	return []string{profileEnv + "=127.0.0.1:" + port}, nil
}

// profileDaemons takes CPU profiles of secs seconds of the daemons names
// (all of them if nil) at once, into dir as PREFIXNAME.pprof. A profile
// counts CPU time only, so seconds past the work profiled add nothing.
func (b *benchWorld) profileDaemons(dir, prefix string, names []string, secs int) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	if names == nil {
		for name := range b.pprof {
			names = append(names, name)
		}
	}
	var wg sync.WaitGroup
	errs := make(chan error, len(names))
	for _, name := range names {
		addr, ok := b.pprof[name]
		if !ok {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			hc := &http.Client{Timeout: time.Duration(secs+30) * time.Second}
			resp, err := hc.Get(fmt.Sprintf("http://%s/debug/pprof/profile?seconds=%d", addr, secs))
			if err != nil {
				errs <- fmt.Errorf("profiling %s: %w", name, err)
				return
			}
			defer resp.Body.Close()
			out, err := os.Create(filepath.Join(dir, prefix+name+".pprof"))
			if err == nil {
				_, err = io.Copy(out, resp.Body)
				if cerr := out.Close(); err == nil {
					err = cerr
				}
			}
			if err != nil {
				errs <- fmt.Errorf("profiling %s: %w", name, err)
			}
		}()
	}
	wg.Wait()
	close(errs)
	return <-errs
}

const benchKey = "bench-cluster-key-0123456789abcdef"

func benchPort(host string) (string, error) { return etcdtest.FreePort(host) }

func (b *benchWorld) start(name string, args ...string) (*benchProc, error) {
	return b.startEnv(name, nil, args...)
}

// startEnv starts a daemon with env added to this process's environment.
func (b *benchWorld) startEnv(name string, env []string, args ...string) (*benchProc, error) {
	p := &benchProc{name: name, log: filepath.Join(b.dir, name+".log"), env: env, args: args}
	logf, err := os.Create(p.log)
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	p.cmd = exec.Command(b.bin, args...)
	p.cmd.Stdout, p.cmd.Stderr = logf, logf
	p.cmd.Env = append(append(os.Environ(), "DSEC_API_KEY="), env...)
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
	if err := p.cmd.Start(); err != nil {
		return nil, err
	}
	b.procs = append(b.procs, p)
	return p, nil
}

// startControlPlane writes a cluster's certificates, starts a one-member
// etcd (TLS) and starts n apiservers on loopback (the first with the
// bench's admin key), each with env(name) added to its environment (env
// may be nil), and waits until they answer. It returns the flags an edge
// of that cluster needs and the apiservers' URLs.
func (b *benchWorld) startControlPlane(ctx context.Context, n int, env func(name string) ([]string, error)) (edgeFlags, servers []string, err error) {
	// etcd as deploy/ runs it: TLS, client certificates required.
	cdir := filepath.Join(b.dir, "cluster")
	if out, err := exec.Command(b.bin, "cluster", "init", "--dir", cdir, "--etcd-hosts", "127.0.0.1").CombinedOutput(); err != nil {
		return nil, nil, fmt.Errorf("cluster init: %v: %s", err, out)
	}
	trust, err := cluster.Load(cdir)
	if err != nil {
		return nil, nil, err
	}
	client, err := trust.EtcdTLS(cluster.EtcdTLSFiles{})
	if err != nil {
		return nil, nil, err
	}
	ed := filepath.Join(cdir, cluster.EtcdDir)
	if b.etcd, err = etcdtest.StartTLS(filepath.Join(b.dir, "etcd"), 1, &etcdtest.TLS{
		CA: filepath.Join(ed, "ca.pem"), Cert: filepath.Join(ed, cluster.EtcdServerCert), Key: filepath.Join(ed, cluster.EtcdServerKey), Client: client}); err != nil {
		return nil, nil, err
	}
	b.edgeFlags = []string{"--etcd", strings.Join(b.etcd.Endpoints(), ","), "--cluster", filepath.Join(b.dir, "cluster"), "--layers", filepath.Join(b.dir, "layers"), "--log-level", "warn"}
	for i := range n {
		name := fmt.Sprintf("server%d", i)
		var extra, args []string
		if env != nil {
			if extra, err = env(name); err != nil {
				return nil, nil, err
			}
		}
		if i == 0 {
			args = []string{"--api-key", benchKey}
		}
		url, _, err := b.startServer(ctx, name, "", extra, args...)
		if err != nil {
			return nil, nil, err
		}
		servers = append(servers, url)
	}
	return b.edgeFlags, servers, nil
}

// startServer starts an apiserver of the cluster startControlPlane made on
// addr (""; a free loopback port), with env added to its environment and
// args to its flags, and waits until it answers; it returns its URL.
func (b *benchWorld) startServer(ctx context.Context, name, addr string, env []string, args ...string) (string, *benchProc, error) {
	if addr == "" {
		port, err := benchPort("127.0.0.1")
		if err != nil {
			return "", nil, err
		}
		addr = "127.0.0.1:" + port
	}
	// Benches on hollow edges place on them (harmless with real ones).
	args = append(append([]string{"server", "--listen", addr, "--place-on-hollow"}, b.edgeFlags...), args...)
	p, err := b.startEnv(name, env, args...)
	if err != nil {
		return "", nil, err
	}
	url := "http://" + addr
	if err := waitHealthz(ctx, url+"/healthz", p); err != nil {
		return "", p, err
	}
	return url, p, nil
}

func waitHealthz(ctx context.Context, url string, p *benchProc) error {
	hc := &http.Client{Timeout: time.Second}
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		if resp, err := hc.Get(url); err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return nil
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	b, _ := os.ReadFile(p.log)
	return fmt.Errorf("%s did not answer %s: %s", p.name, url, lastLinesOf(string(b), 10))
}

func lastLinesOf(s string, n int) string {
	l := strings.Split(strings.TrimSpace(s), "\n")
	if len(l) > n {
		l = l[len(l)-n:]
	}
	return strings.Join(l, "\n")
}

func startBenchWorld(ctx context.Context, o benchClusterOpts) (*benchWorld, error) {
	bin, err := os.Executable()
	if err != nil {
		return nil, err
	}
	dir := o.dir
	if dir == "" {
		if dir, err = os.MkdirTemp("", "dsec-bench-cluster-"); err != nil {
			return nil, err
		}
	} else if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	b := &benchWorld{dir: dir, bin: bin}
	common := []string{"--warm-pool-max", "0", "--max-sandboxes", fmt.Sprint(o.burst + 200), "--log-level", "warn"}
	fmt.Fprintf(os.Stderr, "bench cluster: starting dsec up, etcd, %d apiserver(s) and %d edges in %s\n", o.apiservers, o.edges, dir)

	upPort, err := benchPort("127.0.0.1")
	if err != nil {
		return b, err
	}
	b.metrics = append(b.metrics, "http://127.0.0.1:"+upPort+"/metrics")
	upEnv, err := b.profEnv(o.profile != "", "up")
	if err != nil {
		return b, err
	}
	up, err := b.startEnv("up", upEnv, append([]string{"up", "--listen", "127.0.0.1:" + upPort, "--state-dir", filepath.Join(dir, "up"),
		"--api-key", benchKey, "--config", filepath.Join(dir, "up-config.json"), "--sandbox-cidr", "10.254.0.0/20"}, common...)...)
	if err != nil {
		return b, err
	}
	cl, endpoints, err := b.startControlPlane(ctx, o.apiservers, func(name string) ([]string, error) { return b.profEnv(o.profile != "", name) })
	if err != nil {
		return b, err
	}
	for i := range o.edges {
		host := fmt.Sprintf("127.0.0.%d", 41+i)
		port, err := benchPort(host)
		if err != nil {
			return b, err
		}
		mport, err := benchPort("127.0.0.1")
		if err != nil {
			return b, err
		}
		b.metrics = append(b.metrics, "http://127.0.0.1:"+mport+"/metrics")
		args := append([]string{"edge", "--listen", host + ":" + port, "--node-name", fmt.Sprintf("bench%d", i+1),
			"--state-dir", filepath.Join(dir, fmt.Sprintf("edge%d", i+1)), "--sandbox-cidr", fmt.Sprintf("10.254.%d.0/20", 16*(i+1)),
			"--metrics-listen", "127.0.0.1:" + mport, "--node-labels", fmt.Sprintf("zone=bench%d", i+1)}, cl...)
		name := fmt.Sprintf("edge%d", i+1)
		env, err := b.profEnv(o.profile != "", name)
		if err != nil {
			return b, err
		}
		if _, err := b.startEnv(name, env, append(args, common...)...); err != nil {
			return b, err
		}
	}
	if err := waitHealthz(ctx, "http://127.0.0.1:"+upPort+"/healthz", up); err != nil {
		return b, err
	}
	if b.up, err = dsec.New(dsec.WithEndpoint("http://127.0.0.1:"+upPort), dsec.WithAPIKey(benchKey)); err != nil {
		return b, err
	}
	if b.cluster, err = dsec.New(dsec.WithEndpoint(strings.Join(endpoints, ",")), dsec.WithAPIKey(benchKey)); err != nil {
		return b, err
	}
	if b.upBare, err = dsec.New(dsec.WithEndpoint("http://127.0.0.1:"+upPort), dsec.WithAPIKey(benchKey), dsec.WithoutIdempotencyKeys()); err != nil {
		return b, err
	}
	if b.clusterBare, err = dsec.New(dsec.WithEndpoint(strings.Join(endpoints, ",")), dsec.WithAPIKey(benchKey), dsec.WithoutIdempotencyKeys()); err != nil {
		return b, err
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		nodes, err := b.cluster.ListNodes(ctx)
		healthy := 0
		for _, n := range nodes {
			if n.Healthy {
				healthy++
			}
		}
		if err == nil && healthy == o.edges {
			break
		}
		if time.Now().After(deadline) {
			return b, fmt.Errorf("the cluster has %d healthy edges of %d after 60 s (%v); logs in %s", healthy, o.edges, err, dir)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if b.upRef, _, err = benchBase(ctx, b.up, ""); err != nil {
		return b, err
	}
	if b.clRef, _, err = benchBase(ctx, b.cluster, ""); err != nil {
		return b, err
	}
	return b, nil
}

// cpuSeconds is the CPU time (user + system) of the processes pids.
func cpuSeconds(pids []int) float64 {
	var total float64
	for _, pid := range pids {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			continue
		}
		// Fields after the command name (which may hold spaces).
		f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))
		if len(f) < 13 {
			continue
		}
		var ut, st float64
		fmt.Sscan(f[11], &ut)
		fmt.Sscan(f[12], &st)
		total += (ut + st) / 100 // clock ticks (USER_HZ = 100)
	}
	return total
}

// pids returns the process ids of the named daemons.
func (b *benchWorld) pids(prefixes ...string) []int {
	var out []int
	for _, p := range b.procs {
		for _, pre := range prefixes {
			if strings.HasPrefix(p.name, pre) && p.cmd != nil && p.cmd.Process != nil {
				out = append(out, p.cmd.Process.Pid)
			}
		}
	}
	return out
}

// createSeconds sums dsec_sandbox_create_seconds (sum, count) over the
// metrics URLs given: the time edges spent in creates, apiserver excluded.
func createSeconds(urls []string) (float64, float64) {
	hc := &http.Client{Timeout: 2 * time.Second}
	var sum, n float64
	for _, u := range urls {
		resp, err := hc.Get(u)
		if err != nil {
			continue
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		for _, line := range strings.Split(string(body), "\n") {
			var v float64
			if x, ok := strings.CutPrefix(line, "dsec_sandbox_create_seconds_sum "); ok {
				fmt.Sscan(x, &v)
				sum += v
			} else if x, ok := strings.CutPrefix(line, "dsec_sandbox_create_seconds_count "); ok {
				fmt.Sscan(x, &v)
				n += v
			}
		}
	}
	return sum, n
}

// settle waits until every node's background work is done (the netns
// pools of dsec's launcher refill after creates and deletes pause: a
// measure beside a refill would time the refill's CPU), at most 2 minutes.
func (b *benchWorld) settle(ctx context.Context) {
	hc := &http.Client{Timeout: 2 * time.Second}
	free := func(url string) (float64, bool) {
		resp, err := hc.Get(url)
		if err != nil {
			return 0, false
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		for _, line := range strings.Split(string(body), "\n") {
			if v, ok := strings.CutPrefix(line, "dsec_netns_pool_free "); ok {
				var f float64
				fmt.Sscan(v, &f)
				return f, true
			}
		}
		return 0, false
	}
	deadline := time.Now().Add(2 * time.Minute)
	last := map[string]float64{}
	stable := 0
	busyPrev, _, _ := hostBusySeconds()
	atPrev := time.Now()
	for time.Now().Before(deadline) && ctx.Err() == nil {
		time.Sleep(500 * time.Millisecond)
		changed := false
		for _, u := range b.metrics {
			v, ok := free(u)
			if ok && v != last[u] {
				changed = true
			}
			last[u] = v
		}
		// The host quiet too: deleted sandboxes' files are removed in the
		// background (each node's trash), which would weigh on the next
		// side's measure.
		busy, cores, err := hostBusySeconds()
		at := time.Now()
		quiet := err == nil && (busy-busyPrev)/(at.Sub(atPrev).Seconds()*float64(cores)) < 0.15
		busyPrev, atPrev = busy, at
		if !changed && quiet {
			stable++
			if stable >= 4 { // 2 s of both
				return
			}
		} else {
			stable = 0
		}
	}
}

func (b *benchWorld) close(keep bool) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	for _, c := range []*dsec.Client{b.up, b.cluster} {
		if c == nil {
			continue
		}
		if all, err := c.ListAllSandboxes(ctx, dsec.ListOptions{}); err == nil {
			_, _, _, _ = runParallel(len(all), 32, func(i int) error { return c.DeleteSandbox(ctx, all[i].ID) })
		}
	}
	for i := len(b.procs) - 1; i >= 0; i-- {
		b.procs[i].stop()
	}
	if b.etcd != nil {
		b.etcd.Stop()
	}
	if keep {
		fmt.Fprintf(os.Stderr, "bench cluster: kept %s\n", b.dir)
		return
	}
	_ = os.RemoveAll(b.dir)
}

// clusterRow is one measure on both sides.
type clusterRow struct {
	Measure   string  `json:"measure"`
	Count     int     `json:"count"`
	Conc      int     `json:"concurrency"`
	UpP50     float64 `json:"up_p50_ms"`
	UpP99     float64 `json:"up_p99_ms"`
	UpRate    float64 `json:"up_per_sec"`
	UpFail    int     `json:"up_failures"`
	ClP50     float64 `json:"cluster_p50_ms"`
	ClP99     float64 `json:"cluster_p99_ms"`
	ClRate    float64 `json:"cluster_per_sec"`
	ClFail    int     `json:"cluster_failures"`
	ClNodes   int     `json:"cluster_nodes_used,omitempty"`
	Target    string  `json:"target"`
	TargetMet bool    `json:"target_met"`
}

type sample struct {
	durs  []time.Duration
	fails int
	wall  time.Duration
	n     int
	nodes map[string]bool
}

func (s *sample) add(d []time.Duration, fails int, wall time.Duration) {
	s.durs = append(s.durs, d...)
	s.fails += fails
	s.wall += wall
}

// benchSide is one of the two systems measured.
type benchSide struct {
	name string
	// c sends Idempotency-Keys as the SDK does by default; bare does not.
	c, bare *dsec.Client
	ref     string
	// pin places the one-at-a-time measures on one node: the hop to a
	// remote edge is what they price, not 3 edges sharing 2 cores.
	pin map[string]string
}

// profileSeconds is how long bench cluster --profile samples each burst:
// longer than a burst of 1,000 here (a profile counts CPU time only).
const profileSeconds = 10

// burstKind is one kind of burst bench cluster measures: its creates and
// deletes on each side, and the CPU seconds each side's daemons spent in
// its bursts, by role.
type burstKind struct {
	name       string // added to its rows' names
	bare       bool   // without idempotency keys
	burst, del [2]sample
	cpu        map[string]float64
}

func newBurstKind(name string, bare bool) *burstKind {
	k := &burstKind{name: name, bare: bare, cpu: map[string]float64{}}
	for i := range k.burst {
		k.burst[i].nodes = map[string]bool{}
	}
	return k
}

func (b *benchWorld) measure(ctx context.Context, o benchClusterOpts) ([]clusterRow, error) {
	sides := []benchSide{
		{name: "dsec up", c: b.up, bare: b.upBare, ref: b.upRef},
		{name: "cluster", c: b.cluster, bare: b.clusterBare, ref: b.clRef, pin: map[string]string{"zone": "bench1"}},
	}
	var create, createBare, exec [2]sample
	// The edge-side part of the one-at-a-time creates, per side.
	var edgeSum, edgeN [2]float64
	sideURLs := [2][]string{b.metrics[:1], b.metrics[1:2]}
	// seq measures one-at-a-time calls on both sides interleaved, call by
	// call, the side going first alternating: on a shared, noisy machine
	// the two are then measured over the same seconds (blocks of one
	// side's calls after the other's measured the noise as much as the
	// hop). call returns the sandbox it made, if any; they are deleted
	// after the measure.
	type seqCall struct {
		into *[2]sample
		call func(si int, side benchSide) (string, error)
	}
	seq := func(what string, calls ...seqCall) {
		b.settle(ctx)
		fmt.Fprintf(os.Stderr, "bench cluster: %d %s one at a time on each side, interleaved...\n", o.count, what)
		var ids [2][]string
		var firstErr [2]error
		var s0, n0 [2]float64
		for si := range sides {
			s0[si], n0[si] = createSeconds(sideURLs[si])
		}
		n := 2 * len(calls)
		for i := range o.count {
			for k := range n {
				// Every kind of call on every side takes every place in
				// the order in turn.
				j := (i + k) % n
				si, c := j%2, calls[j/2]
				t0 := time.Now()
				id, err := c.call(si, sides[si])
				d := time.Since(t0)
				c.into[si].wall += d
				if err != nil {
					c.into[si].fails++
					if firstErr[si] == nil {
						firstErr[si] = err
					}
					continue
				}
				c.into[si].durs = append(c.into[si].durs, d)
				if id != "" {
					ids[si] = append(ids[si], id)
				}
			}
		}
		for si, side := range sides {
			if firstErr[si] != nil {
				fmt.Fprintf(os.Stderr, "bench cluster: %s: first failure: %v\n", side.name, firstErr[si])
			}
			if len(ids[si]) > 0 {
				s1, n1 := createSeconds(sideURLs[si])
				edgeSum[si] += s1 - s0[si]
				edgeN[si] += n1 - n0[si]
			}
			_, _, _, _ = runParallel(len(ids[si]), 8, func(i int) error { return side.c.DeleteSandbox(ctx, ids[si][i]) })
		}
	}
	createWith := func(keyed bool) func(int, benchSide) (string, error) {
		return func(_ int, side benchSide) (string, error) {
			c := side.bare
			if keyed {
				c = side.c
			}
			sb, err := c.CreateSandbox(ctx, api.SandboxSpec{Base: side.ref, NodeSelector: side.pin, Labels: map[string]string{"bench": "seq"}})
			if err != nil {
				return "", err
			}
			return sb.ID, nil
		}
	}
	// A warm-up, not measured: a node recycles the cgroups of deleted
	// sandboxes, so the first creates on a fresh node make theirs and the
	// later ones do not; both sides start the measures with some.
	for _, side := range sides {
		fmt.Fprintf(os.Stderr, "bench cluster: %s: warming up...\n", side.name)
		ids := make([]string, o.count)
		_, _, _, _ = runParallel(o.count, 4, func(i int) error {
			sb, err := side.bare.CreateSandbox(ctx, api.SandboxSpec{Base: side.ref, NodeSelector: side.pin})
			if err == nil {
				ids[i] = sb.ID
			}
			return err
		})
		_, _, _, _ = runParallel(o.count, 8, func(i int) error {
			if ids[i] == "" {
				return nil
			}
			return side.bare.DeleteSandbox(ctx, ids[i])
		})
	}
	// A burst of o.burst creates on side si, keyed as the SDK does by
	// default or (kind.bare) not, with the CPU its daemons spend; then its
	// deletes.
	bursts := []*burstKind{newBurstKind("", false)}
	if o.bareBurst {
		bursts = append(bursts, newBurstKind(", no keys", true))
	}
	burstOn := func(r, si int, kind *burstKind) error {
		side := sides[si]
		c := side.c
		if kind.bare {
			c = side.bare
		}
		b.settle(ctx)
		fmt.Fprintf(os.Stderr, "bench cluster: round %d, %s: a burst of %d creates%s, %d at a time...\n", r+1, side.name, o.burst, kind.name, o.burstConc)
		ids := make([]string, o.burst)
		var mu sync.Mutex
		roles := map[string][]int{"up": b.pids("up")}
		if si == 1 {
			roles = map[string][]int{"apiserver": b.pids("server"), "edges": b.pids("edge"), "etcd": b.etcd.Pids()}
		}
		before := map[string]float64{}
		for role, pids := range roles {
			before[role] = cpuSeconds(pids)
		}
		profile := o.profile != "" && !kind.bare
		profDone := make(chan error, 1)
		if profile {
			var names []string
			for name := range b.pprof {
				if (name == "up") == (si == 0) {
					names = append(names, name)
				}
			}
			sideName := "up"
			if si == 1 {
				sideName = "cluster"
			}
			prefix := fmt.Sprintf("round%d-%s-", r+1, sideName)
			go func() { profDone <- b.profileDaemons(o.profile, prefix, names, profileSeconds) }()
			time.Sleep(100 * time.Millisecond) // the profiles start first
		}
		d, f, w, ferr := runParallel(o.burst, o.burstConc, func(i int) error {
			sb, err := c.CreateSandbox(ctx, api.SandboxSpec{Base: side.ref, Labels: map[string]string{"bench": "burst"}})
			if err == nil {
				ids[i] = sb.ID
				mu.Lock()
				kind.burst[si].nodes[sb.Node] = true
				mu.Unlock()
			}
			return err
		})
		if ferr != nil {
			fmt.Fprintf(os.Stderr, "bench cluster: %s: first burst failure: %v\n", side.name, ferr)
		}
		kind.burst[si].add(d, f, w)
		for role, pids := range roles {
			kind.cpu[role] += cpuSeconds(pids) - before[role]
		}
		if profile {
			// The deletes wait for the profiles to end: they would be
			// counted in them.
			if err := <-profDone; err != nil {
				return err
			}
		}
		d, f, w, _ = runParallel(o.burst, o.burstConc, func(i int) error {
			if ids[i] == "" {
				return nil
			}
			return c.DeleteSandbox(ctx, ids[i])
		})
		kind.del[si].add(d, f, w)
		return nil
	}
	for r := range o.rounds {
		// ABBA: each side goes first in every other round. A burst leaves
		// the host with state the next one pays for (a node keeps emptied
		// cgroups for reuse, each of which makes a new cpuset cgroup
		// costlier to create; deleted files weigh on ext4's inode
		// allocation), so the order alternates.
		order := []int{0, 1}
		if r%2 == 1 {
			order = []int{1, 0}
		}
		// Keyed and bare creates interleaved too: run in blocks, the
		// block that went first was 1-3 ms a create slower on both sides,
		// whichever it was.
		seq("creates with and without idempotency keys", seqCall{&create, createWith(true)}, seqCall{&createBare, createWith(false)})
		var execIn [2]string
		for si, side := range sides {
			sb, err := side.c.CreateSandbox(ctx, api.SandboxSpec{Base: side.ref, NodeSelector: side.pin})
			if err != nil {
				return nil, fmt.Errorf("%s: creating the exec sandbox: %w", side.name, err)
			}
			execIn[si] = sb.ID
		}
		seq("execs of true", seqCall{&exec, func(si int, side benchSide) (string, error) {
			res, err := side.c.Exec(ctx, execIn[si], api.ExecRequest{Argv: []string{"true"}})
			if err == nil && res.ExitCode != 0 {
				err = fmt.Errorf("exit %d", res.ExitCode)
			}
			return "", err
		}})
		for si, side := range sides {
			_ = side.c.DeleteSandbox(ctx, execIn[si])
		}
		// The kinds of burst alternate as well (a burst runs faster on
		// the cgroups the one before it emptied).
		kinds := slices.Clone(bursts)
		if r%2 == 1 {
			slices.Reverse(kinds)
		}
		for _, kind := range kinds {
			for _, si := range order {
				if err := burstOn(r, si, kind); err != nil {
					return nil, err
				}
			}
		}
	}
	mk := func(measure string, n, conc int, s [2]sample, target string, met func(clusterRow) bool) clusterRow {
		r := clusterRow{Measure: measure, Count: n, Conc: conc,
			UpP50: pct(s[0].durs, .5), UpP99: pct(s[0].durs, .99), UpRate: float64(len(s[0].durs)) / s[0].wall.Seconds(), UpFail: s[0].fails,
			ClP50: pct(s[1].durs, .5), ClP99: pct(s[1].durs, .99), ClRate: float64(len(s[1].durs)) / s[1].wall.Seconds(), ClFail: s[1].fails,
			ClNodes: len(s[1].nodes), Target: target}
		r.TargetMet = met(r)
		return r
	}
	none := func(clusterRow) bool { return false }
	rows := []clusterRow{
		mk("create, one at a time", o.count*o.rounds, 1, create, "cluster p50 ≤ up p50 + 2 ms", func(r clusterRow) bool { return r.ClFail == 0 && r.ClP50 <= r.UpP50+2 }),
		mk("create, one at a time, no keys", o.count*o.rounds, 1, createBare, "cluster p50 ≤ up p50 + 2 ms", func(r clusterRow) bool { return r.ClFail == 0 && r.ClP50 <= r.UpP50+2 }),
		mk("exec true, one at a time", o.count*o.rounds, 1, exec, "cluster p50 ≤ up p50 + 1 ms", func(r clusterRow) bool { return r.ClFail == 0 && r.ClP50 <= r.UpP50+1 }),
	}
	for _, kind := range bursts {
		// The target is the keyed burst's (the SDK's default); the
		// unkeyed one shows what the claims cost.
		target, met := "cluster rate ≥ 75% of up's, 0 failures", func(r clusterRow) bool {
			return r.ClFail == 0 && r.UpFail == 0 && r.ClRate >= 0.75*r.UpRate
		}
		if kind.bare {
			target, met = "-", none
		}
		rows = append(rows,
			mk(fmt.Sprintf("burst of %d%s", o.burst, kind.name), o.burst*o.rounds, o.burstConc, kind.burst, target, met),
			mk("delete of the burst"+kind.name, o.burst*o.rounds, o.burstConc, kind.del, "-", none))
		perCreate := func(role string) float64 { return 1000 * kind.cpu[role] / float64(o.burst*o.rounds) }
		rows = append(rows, clusterRow{Measure: "CPU ms per create in the burst" + kind.name, Count: o.burst * o.rounds, Conc: o.burstConc,
			UpP50: perCreate("up"), ClP50: perCreate("apiserver") + perCreate("edges") + perCreate("etcd"),
			Target: fmt.Sprintf("cluster: apiserver %.1f, edges %.1f, etcd %.1f", perCreate("apiserver"), perCreate("edges"), perCreate("etcd"))})
	}
	if edgeN[0] > 0 && edgeN[1] > 0 {
		rows = append(rows, clusterRow{Measure: "edge-side part of a create (mean)", Count: int(edgeN[1]), Conc: 1,
			UpP50: 1000 * edgeSum[0] / edgeN[0], ClP50: 1000 * edgeSum[1] / edgeN[1], Target: "-"})
	}
	return rows, nil
}

func printClusterBench(rows []clusterRow, o benchClusterOpts) error {
	if o.jsonOut {
		return printJSON(map[string]any{"time": time.Now().UTC(), "edges": o.edges, "apiservers": o.apiservers, "rounds": o.rounds, "results": rows})
	}
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0) // dsec's own numbers: nothing to escape
	fmt.Fprintln(tw, "MEASURE\tN\tCONC\tUP P50 ms\tUP P99 ms\tUP /s\tCLUSTER P50 ms\tCLUSTER P99 ms\tCLUSTER /s\tFAIL up/cl\tNODES\tTARGET\tMET")
	for _, r := range rows {
		met := "yes"
		if !r.TargetMet {
			met = "no"
		}
		if r.Target == "-" || strings.HasPrefix(r.Target, "cluster:") {
			met = "-"
		}
		nodes := "-"
		if r.ClNodes > 0 {
			nodes = fmt.Sprint(r.ClNodes)
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%.2f\t%.2f\t%.0f\t%.2f\t%.2f\t%.0f\t%d/%d\t%s\t%s\t%s\n", r.Measure, r.Count, r.Conc,
			r.UpP50, r.UpP99, r.UpRate, r.ClP50, r.ClP99, r.ClRate, r.UpFail, r.ClFail, nodes, r.Target, met)
	}
	return tw.Flush()
}
