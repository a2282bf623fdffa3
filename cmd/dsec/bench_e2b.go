package main

// `dsec bench e2b` prices the E2B dialect: the flow create → run `echo hi`
// → kill through the real E2B JS SDK, through libdsec (sdk/python) and
// through dsec's own REST API (from the Go SDK, and from node's fetch in
// the E2B SDK's process, so that one comparison holds the runtime
// still), in one run, one flow at a time, the four interleaved flow by flow with the order turning every
// round, so that a noisy machine weighs on all four alike.
//
// The two SDKs run in one long-lived process each (node, python3), fed
// one "flow" line at a time, and time each flow themselves with their
// own clocks: node's and python's start-up, and loading the SDK, are not
// part of any flow, so the comparison with the Go side is one of clients,
// not of interpreters starting.

import (
	"bufio"
	"context"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/hostfs"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

//go:embed benchscripts/e2b_flow.mjs
var e2bFlowScript []byte

//go:embed benchscripts/libdsec_flow.py
var libdsecFlowScript string

// e2bSDKVersion is the E2B JS SDK the bench drives, pinned so that runs
// on different days measure the same client.
const e2bSDKVersion = "2.51.0"

// e2bTarget is what the E2B path may cost at most: its flow's p50 over
// the native flow's.
const e2bTarget = 1.5

// Bounds on the SDK processes: the ready line (node loading the SDK,
// python importing libdsec) and one flow.
const (
	driverReadyTimeout = time.Minute
	flowTimeout        = 2 * time.Minute
)

type benchE2BOpts struct {
	count    int
	warmup   int
	template string
	sdkDir   string
	libdsec  string
	jsonOut  bool
}

func runBenchE2B(args []string) error {
	var o benchE2BOpts
	f := newCmdFlags("bench e2b", "[flags]", "The flow create → run `echo hi` → kill through the E2B JS SDK (e2b@"+e2bSDKVersion+" on node),\n"+
		"through libdsec (python3) and through dsec's REST API (the Go SDK, and node's fetch), interleaved one flow\n"+
		"at a time. Prints p50/p99/mean of the flow and of each step per client, and the flow's\n"+
		"p50 ratios to the native one (target: E2B at most 1.5×). Needs node and npm, python3 3.10+.")
	f.IntVar(&o.count, "count", 100, "flows per client")
	f.IntVar(&o.warmup, "warmup", 1, "flows per client run first and not counted (connections, the SDKs' lazy set-up)")
	f.StringVar(&o.template, "template", "", "base layer ref: the E2B templateID and the other two's base (default: build base/bench:bash\n"+
		"from the host's busybox and bash; commands.run needs /bin/bash)")
	f.StringVar(&o.sdkDir, "sdk-dir", "", "where the E2B SDK is installed with npm, if missing (default: $XDG_CACHE_HOME/dsec/e2b-"+e2bSDKVersion+",\n"+
		"else ~/.cache/dsec/e2b-"+e2bSDKVersion+")")
	f.StringVar(&o.libdsec, "libdsec", "", "directory holding the libdsec package (default: sdk/python/src of the source tree,\n"+
		"found from the binary's or the working directory's path, else an installed libdsec)")
	f.BoolVar(&o.jsonOut, "json", false, "print one JSON object instead of a table")
	if _, err := f.parseN(args, 0, 0); err != nil {
		return err
	}
	if o.count < 1 || o.warmup < 0 {
		return errors.New("bench e2b: --count must be ≥ 1 and --warmup ≥ 0")
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	// One endpoint and one key for all four clients: the first of a
	// cluster's list, as the E2B SDK takes only one.
	cfg, err := dsec.ResolveConfig()
	if err != nil {
		return err
	}
	c, err := dsec.New(dsec.WithEndpoint(cfg.Endpoint), dsec.WithAPIKey(cfg.APIKey))
	if err != nil {
		return err
	}
	endpoint := c.Endpoint()
	if c, err = dsec.New(dsec.WithEndpoint(endpoint), dsec.WithAPIKey(cfg.APIKey)); err != nil {
		return err
	}
	ref, _, err := benchBaseOf(ctx, c, o.template, "bash", hostfs.Options{Bash: true})
	if err != nil {
		return err
	}

	sdkDir := o.sdkDir
	if sdkDir == "" {
		if sdkDir, err = e2bSDKDir(os.Getenv("XDG_CACHE_HOME"), os.UserHomeDir); err != nil {
			return err
		}
	}
	if err := ensureE2BSDK(ctx, sdkDir); err != nil {
		return err
	}
	py, pypath, err := findLibdsec(o.libdsec)
	if err != nil {
		return err
	}

	label := fmt.Sprintf("bench-e2b-%d", time.Now().UnixNano())
	// What a failed or interrupted flow left behind; the flows delete
	// their own sandboxes.
	defer func() {
		if n, err := c.DeleteSandboxes(context.Background(), map[string]string{"bench": label}); err != nil {
			fmt.Fprintf(os.Stderr, "bench e2b: deleting leftovers (label bench=%s): %v\n", label, err)
		} else if n > 0 {
			fmt.Fprintf(os.Stderr, "bench e2b: deleted %d sandboxes failed flows left behind\n", n)
		}
	}()

	script := filepath.Join(sdkDir, "dsec-bench-flow.mjs")
	if err := os.WriteFile(script, e2bFlowScript, 0o644); err != nil {
		return fmt.Errorf("writing the E2B flow script: %w", err)
	}
	node := exec.CommandContext(ctx, "node", script, ref, label)
	node.Dir = sdkDir
	node.Env = envWith(os.Environ(), []string{"E2B_"},
		"E2B_API_URL="+endpoint, "E2B_SANDBOX_URL="+endpoint, "E2B_API_KEY="+cfg.APIKey)
	e2b, err := startFlowDriver(ctx, "node (E2B SDK)", node)
	if err != nil {
		return err
	}
	defer e2b.close()

	python := exec.CommandContext(ctx, py, "-u", "-c", libdsecFlowScript, ref, label)
	penv := []string{"DSEC_ENDPOINT=" + endpoint, "DSEC_API_KEY=" + cfg.APIKey, "PYTHONDONTWRITEBYTECODE=1"}
	drop := []string{"DSEC_ENDPOINT=", "DSEC_API_KEY=", "PYTHONDONTWRITEBYTECODE="}
	if pypath != "" {
		penv = append(penv, "PYTHONPATH="+pypath)
		drop = append(drop, "PYTHONPATH=")
	}
	python.Env = envWith(os.Environ(), drop, penv...)
	lib, err := startFlowDriver(ctx, "python3 (libdsec)", python)
	if err != nil {
		return err
	}
	defer lib.close()

	clients := []e2bClient{
		{key: "e2b", name: "E2B JS SDK", via: "e2b@" + e2bSDKVersion + ", node " + e2b.version, run: e2b.flow},
		{key: "libdsec", name: "libdsec", via: lib.version, run: lib.flow},
		{key: "rest", name: "REST (Go SDK)", via: "sdk/go " + dsec.UserAgent, run: (&restFlow{c: c, ref: ref, label: label}).flow},
		{key: "rest-node", name: "REST (node fetch)", via: "node " + e2b.version + " fetch", run: e2b.rest},
	}
	samples := make([]flowSamples, len(clients))
	fmt.Fprintf(os.Stderr, "bench e2b: %d flows per client on %s (after %d warm-up), %s, one at a time, interleaved...\n",
		o.count, ref, o.warmup, endpoint)
	every := max(1, o.count/10)
	for i := range o.warmup + o.count {
		for k := range clients {
			ci := (i + k) % len(clients)
			t, err := clients[ci].run(ctx)
			var failed flowFailed
			if err != nil && !errors.As(err, &failed) {
				return fmt.Errorf("bench e2b: %s: %w", clients[ci].name, err)
			}
			if i < o.warmup {
				if err != nil {
					fmt.Fprintf(os.Stderr, "bench e2b: %s: warm-up flow failed: %v\n", clients[ci].name, err)
				}
				continue
			}
			samples[ci].add(t, err)
			if err != nil && samples[ci].fails == 1 {
				fmt.Fprintf(os.Stderr, "bench e2b: %s: first failure: %v\n", clients[ci].name, err)
			}
		}
		if n := i + 1 - o.warmup; n > 0 && n%every == 0 {
			fmt.Fprintf(os.Stderr, "bench e2b: %d/%d rounds\n", n, o.count)
		}
	}
	rep := e2bReport{Time: time.Now().UTC(), Endpoint: endpoint, Template: ref, Count: o.count, Warmup: o.warmup}
	for ci, cl := range clients {
		rep.Clients = append(rep.Clients, samples[ci].result(cl))
	}
	rep.judge()
	if o.jsonOut {
		return printJSON(rep)
	}
	return printE2BBench(rep)
}

// e2bClient is one of the four ways of running the flow.
type e2bClient struct {
	key, name, via string
	run            func(ctx context.Context) (flowTimes, error)
}

// flowTimes are one flow's timings.
type flowTimes struct {
	create, run, kill, flow time.Duration
}

// flowFailed is a flow that failed (a create refused, an exec that did not
// print hi): counted, and the bench goes on. Any other error of a flow
// (an SDK process gone, an answer that is not one, Ctrl-C) ends it.
type flowFailed struct{ msg string }

func (f flowFailed) Error() string { return f.msg }

// flowLine is an SDK process's answer: the ready line first, then one per
// flow.
type flowLine struct {
	Ready    bool     `json:"ready"`
	Version  string   `json:"version"`
	Error    *string  `json:"error"`
	CreateMS *float64 `json:"create_ms"`
	RunMS    *float64 `json:"run_ms"`
	KillMS   *float64 `json:"kill_ms"`
	FlowMS   *float64 `json:"flow_ms"`
}

// parseReadyLine reads the first line of an SDK process: its version.
func parseReadyLine(b []byte) (string, error) {
	var l flowLine
	if err := json.Unmarshal(b, &l); err != nil {
		return "", fmt.Errorf("not a JSON line: %q", b)
	}
	if l.Error != nil {
		return "", errors.New(*l.Error)
	}
	if !l.Ready {
		return "", fmt.Errorf("expected the ready line, got %q", b)
	}
	return l.Version, nil
}

// parseFlowLine reads the answer to one "flow": its timings, or the
// flowFailed the process reported.
func parseFlowLine(b []byte) (flowTimes, error) {
	var l flowLine
	if err := json.Unmarshal(b, &l); err != nil {
		return flowTimes{}, fmt.Errorf("not a JSON line: %q", b)
	}
	if l.Error != nil {
		return flowTimes{}, flowFailed{strings.TrimSpace(*l.Error)}
	}
	ms := []*float64{l.CreateMS, l.RunMS, l.KillMS, l.FlowMS}
	var d [4]time.Duration
	for i, v := range ms {
		if v == nil || *v < 0 {
			return flowTimes{}, fmt.Errorf("expected create_ms, run_ms, kill_ms and flow_ms (≥ 0), got %q", b)
		}
		d[i] = time.Duration(*v * float64(time.Millisecond))
	}
	// The flow is the three steps and the little between them.
	if d[0]+d[1]+d[2] > d[3]+time.Millisecond {
		return flowTimes{}, fmt.Errorf("the steps add up to more than the flow: %q", b)
	}
	return flowTimes{create: d[0], run: d[1], kill: d[2], flow: d[3]}, nil
}

// flowDriver is an SDK process answering "flow" lines.
type flowDriver struct {
	name    string
	version string
	cmd     *exec.Cmd
	stdin   io.WriteCloser
	// lines are the process's answers; closed when its stdout ends.
	lines chan []byte
	// done stops the reader when the driver is closed.
	done chan struct{}
}

// startFlowDriver starts cmd and waits for its ready line. The process's
// stderr goes to ours, so that what it says about a failure is seen.
func startFlowDriver(ctx context.Context, name string, cmd *exec.Cmd) (*flowDriver, error) {
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	cmd.Stderr = os.Stderr
	// It dies with the bench, whatever happens to the bench.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting %s: %w", name, err)
	}
	d := &flowDriver{name: name, cmd: cmd, stdin: stdin, lines: make(chan []byte), done: make(chan struct{})}
	go d.read(stdout)
	b, err := d.next(ctx, driverReadyTimeout)
	if err == nil {
		d.version, err = parseReadyLine(b)
	}
	if err != nil {
		d.close()
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	return d, nil
}

// read passes the process's stdout on line by line until it ends or the
// driver is closed.
func (d *flowDriver) read(r io.Reader) {
	defer close(d.lines)
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 4<<20) // an error's stack trace can be long
	for sc.Scan() {
		b := append([]byte(nil), sc.Bytes()...)
		select {
		case d.lines <- b:
		case <-d.done:
			return
		}
	}
}

func (d *flowDriver) next(ctx context.Context, timeout time.Duration) ([]byte, error) {
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case b, ok := <-d.lines:
		if !ok {
			return nil, errors.New("the process ended (its output is above)")
		}
		return b, nil
	case <-t.C:
		return nil, fmt.Errorf("no answer in %s", timeout)
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// flow runs one flow in the process.
func (d *flowDriver) flow(ctx context.Context) (flowTimes, error) { return d.do(ctx, "flow") }

// rest runs the native flow in the process (the node one has it).
func (d *flowDriver) rest(ctx context.Context) (flowTimes, error) { return d.do(ctx, "rest") }

func (d *flowDriver) do(ctx context.Context, command string) (flowTimes, error) {
	if _, err := io.WriteString(d.stdin, command+"\n"); err != nil {
		return flowTimes{}, fmt.Errorf("%s: %w", d.name, err)
	}
	b, err := d.next(ctx, flowTimeout)
	if err != nil {
		return flowTimes{}, err
	}
	return parseFlowLine(b)
}

// close ends the process: stdin closed, it exits at EOF; killed if it has
// not after a while.
func (d *flowDriver) close() {
	_ = d.stdin.Close()
	close(d.done)
	exited := make(chan struct{})
	go func() { _ = d.cmd.Wait(); close(exited) }()
	select {
	case <-exited:
	case <-time.After(10 * time.Second):
		_ = d.cmd.Process.Kill()
		<-exited
	}
}

// restFlow is the native flow: the Go SDK on dsec's REST API.
type restFlow struct {
	c          *dsec.Client
	ref, label string
}

func (r *restFlow) flow(ctx context.Context) (flowTimes, error) {
	fail := func(step string, err error) (flowTimes, error) {
		if ctx.Err() != nil {
			return flowTimes{}, ctx.Err()
		}
		return flowTimes{}, flowFailed{step + ": " + err.Error()}
	}
	t0 := time.Now()
	sb, err := r.c.CreateSandbox(ctx, api.SandboxSpec{Base: r.ref, Labels: map[string]string{"bench": r.label}})
	if err != nil {
		return fail("create", err)
	}
	t1 := time.Now()
	// What the E2B SDK runs for commands.run, so that the four run the
	// same process and differ only by their path to it.
	res, err := r.c.Exec(ctx, sb.ID, api.ExecRequest{Argv: []string{"/bin/bash", "-l", "-c", "echo hi"}})
	if err == nil && (res.ExitCode != 0 || res.Stdout != "hi\n") {
		err = fmt.Errorf("echo hi: exit %d, stdout %q, stderr %q", res.ExitCode, res.Stdout, res.Stderr)
	}
	if err != nil {
		_ = r.c.DeleteSandbox(context.Background(), sb.ID)
		return fail("exec", err)
	}
	t2 := time.Now()
	if err := r.c.DeleteSandbox(ctx, sb.ID); err != nil {
		return fail("delete", err)
	}
	t3 := time.Now()
	return flowTimes{create: t1.Sub(t0), run: t2.Sub(t1), kill: t3.Sub(t2), flow: t3.Sub(t0)}, nil
}

// flowSamples are one client's measured flows.
type flowSamples struct {
	create, run, kill, flow []time.Duration
	fails                   int
}

func (s *flowSamples) add(t flowTimes, err error) {
	if err != nil {
		s.fails++
		return
	}
	s.create = append(s.create, t.create)
	s.run = append(s.run, t.run)
	s.kill = append(s.kill, t.kill)
	s.flow = append(s.flow, t.flow)
}

// stepStats summarize one step's (or the flow's) timings.
type stepStats struct {
	N      int     `json:"n"`
	P50MS  float64 `json:"p50_ms"`
	P99MS  float64 `json:"p99_ms"`
	MeanMS float64 `json:"mean_ms"`
}

func summarize(d []time.Duration) stepStats {
	s := stepStats{N: len(d), P50MS: pct(d, .5), P99MS: pct(d, .99)}
	if len(d) > 0 {
		var sum time.Duration
		for _, v := range d {
			sum += v
		}
		s.MeanMS = float64(sum.Microseconds()) / 1000 / float64(len(d))
	}
	return s
}

// e2bClientResult is one client's row of the report.
type e2bClientResult struct {
	Client   string    `json:"client"`
	Name     string    `json:"name"`
	Via      string    `json:"via"`
	Failures int       `json:"failures"`
	Flow     stepStats `json:"flow"`
	Create   stepStats `json:"create"`
	Run      stepStats `json:"run"`
	Kill     stepStats `json:"kill"`
}

func (s *flowSamples) result(cl e2bClient) e2bClientResult {
	return e2bClientResult{Client: cl.key, Name: cl.name, Via: cl.via, Failures: s.fails,
		Flow: summarize(s.flow), Create: summarize(s.create), Run: summarize(s.run), Kill: summarize(s.kill)}
}

// e2bReport is what `dsec bench e2b` prints (--json: as it is).
type e2bReport struct {
	Time     time.Time         `json:"time"`
	Endpoint string            `json:"endpoint"`
	Template string            `json:"template"`
	Count    int               `json:"count"`
	Warmup   int               `json:"warmup"`
	Clients  []e2bClientResult `json:"clients"`
	// The flow's p50 of the E2B SDK and of libdsec over the native one's
	// (the Go SDK's), and of the E2B SDK over the native flow from node
	// (0 when a side has no flow).
	E2BRatio     float64 `json:"e2b_native_p50_ratio"`
	LibdsecRatio float64 `json:"libdsec_native_p50_ratio"`
	E2BNodeRatio float64 `json:"e2b_native_node_p50_ratio"`
	Target       string  `json:"target"`
	TargetMet    bool    `json:"target_met"`
}

func (r *e2bReport) client(key string) e2bClientResult {
	for _, c := range r.Clients {
		if c.Client == key {
			return c
		}
	}
	return e2bClientResult{}
}

// judge fills in the ratios and whether the target is met: every E2B and
// native flow succeeded, and the E2B flow's p50 is at most e2bTarget
// times the native one's.
func (r *e2bReport) judge() {
	e2b, lib, rest, node := r.client("e2b"), r.client("libdsec"), r.client("rest"), r.client("rest-node")
	ratio := func(a, b stepStats) float64 {
		if a.N == 0 || b.N == 0 || b.P50MS <= 0 {
			return 0
		}
		return a.P50MS / b.P50MS
	}
	r.E2BRatio, r.LibdsecRatio, r.E2BNodeRatio = ratio(e2b.Flow, rest.Flow), ratio(lib.Flow, rest.Flow), ratio(e2b.Flow, node.Flow)
	r.Target = fmt.Sprintf("E2B flow p50 ≤ %.1f× native", e2bTarget)
	r.TargetMet = e2b.Failures == 0 && rest.Failures == 0 && r.E2BRatio > 0 && r.E2BRatio <= e2bTarget
}

func printE2BBench(r e2bReport) error {
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0) // dsec's own numbers and the SDKs' versions: nothing to escape
	fmt.Fprintln(tw, "CLIENT\tSTEP\tN\tP50 ms\tP99 ms\tMEAN ms\tFAIL")
	for _, c := range r.Clients {
		for i, st := range []struct {
			name string
			s    stepStats
		}{{"flow", c.Flow}, {"create", c.Create}, {"run", c.Run}, {"kill", c.Kill}} {
			name, fails := "", ""
			if i == 0 {
				name, fails = c.Name, fmt.Sprint(c.Failures)
			}
			figs := "-\t-\t-"
			if st.s.N > 0 {
				figs = fmt.Sprintf("%.2f\t%.2f\t%.2f", st.s.P50MS, st.s.P99MS, st.s.MeanMS)
			}
			fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\n", name, st.name, st.s.N, figs, fails)
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	met := "not met"
	if r.TargetMet {
		met = "met"
	}
	for _, c := range r.Clients {
		fmt.Printf("%s: %s\n", c.Name, c.Via)
	}
	fmt.Printf("run is /bin/bash -l -c 'echo hi' on all four (what commands.run sends); kill is kill, delete.\n")
	fmt.Printf("flow p50, E2B / native (Go):     %s  (target: at most %.1f×, %s)\n", times(r.E2BRatio), e2bTarget, met)
	fmt.Printf("flow p50, libdsec / native (Go): %s\n", times(r.LibdsecRatio))
	fmt.Printf("flow p50, E2B / native (node):   %s  (the same runtime on both sides: what the E2B path itself costs)\n", times(r.E2BNodeRatio))
	return nil
}

// times prints a ratio, "-" when there is none (a side without flows).
func times(r float64) string {
	if r <= 0 {
		return "-"
	}
	return fmt.Sprintf("%.2f×", r)
}

// e2bSDKDir is where the E2B SDK goes by default: under $XDG_CACHE_HOME
// when it is set (an absolute path, as the XDG spec wants), else under
// ~/.cache.
func e2bSDKDir(xdgCache string, home func() (string, error)) (string, error) {
	sub := filepath.Join("dsec", "e2b-"+e2bSDKVersion)
	if filepath.IsAbs(xdgCache) {
		return filepath.Join(xdgCache, sub), nil
	}
	h, err := home()
	if err != nil {
		return "", fmt.Errorf("finding the E2B SDK's directory (give --sdk-dir): %w", err)
	}
	return filepath.Join(h, ".cache", sub), nil
}

// installedVersion is the version of the e2b package under dir, "" if
// there is none.
func installedVersion(dir string) string {
	b, err := os.ReadFile(filepath.Join(dir, "node_modules", "e2b", "package.json"))
	if err != nil {
		return ""
	}
	var p struct {
		Version string `json:"version"`
	}
	if json.Unmarshal(b, &p) != nil {
		return ""
	}
	return p.Version
}

// ensureE2BSDK installs e2b@e2bSDKVersion under dir unless it is there.
func ensureE2BSDK(ctx context.Context, dir string) error {
	for _, tool := range []string{"node", "npm"} {
		if _, err := exec.LookPath(tool); err != nil {
			return fmt.Errorf("bench e2b runs the E2B JS SDK, which needs node and npm (Node.js 20.18.1+ or 22+; "+
				"e.g. apt-get install nodejs npm): %w", err)
		}
	}
	if v := installedVersion(dir); v == e2bSDKVersion {
		return nil
	} else if v != "" {
		fmt.Fprintf(os.Stderr, "bench e2b: %s holds e2b@%s, not %s\n", dir, v, e2bSDKVersion)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("making the E2B SDK's directory: %w", err)
	}
	fmt.Fprintf(os.Stderr, "bench e2b: installing e2b@%s into %s: npm install --prefix %s e2b@%s\n", e2bSDKVersion, dir, dir, e2bSDKVersion)
	start := time.Now()
	cmd := exec.CommandContext(ctx, "npm", "install", "--prefix", dir, "--no-audit", "--no-fund", "e2b@"+e2bSDKVersion)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("npm install --prefix %s e2b@%s: %w", dir, e2bSDKVersion, err)
	}
	if v := installedVersion(dir); v != e2bSDKVersion {
		return fmt.Errorf("npm install --prefix %s e2b@%s left e2b@%q there", dir, e2bSDKVersion, v)
	}
	fmt.Fprintf(os.Stderr, "bench e2b: e2b@%s installed in %s\n", e2bSDKVersion, time.Since(start).Round(100*time.Millisecond))
	return nil
}

// findLibdsec returns python3 and the PYTHONPATH that makes libdsec
// importable: dir when given, else sdk/python/src of the source tree the
// binary sits in (bin/dsec) or of the working directory, else "" when
// python3 imports an installed libdsec.
func findLibdsec(dir string) (py, pypath string, err error) {
	py, err = exec.LookPath("python3")
	if err != nil {
		return "", "", fmt.Errorf("bench e2b runs libdsec, which needs python3 (3.10 or later): %w", err)
	}
	if out, err := exec.Command(py, "-c", "import sys; sys.exit(sys.version_info < (3, 10))").CombinedOutput(); err != nil {
		return "", "", fmt.Errorf("bench e2b runs libdsec, which needs python3 3.10 or later: %v %s", err, out)
	}
	has := func(d string) bool {
		_, err := os.Stat(filepath.Join(d, "libdsec", "__init__.py"))
		return err == nil
	}
	if dir != "" {
		if !has(dir) {
			return "", "", fmt.Errorf("bench e2b: --libdsec %s: no libdsec/__init__.py there", dir)
		}
		d, err := filepath.Abs(dir)
		return py, d, err
	}
	var cands []string
	if exe, err := os.Executable(); err == nil {
		if exe, err = filepath.EvalSymlinks(exe); err == nil {
			cands = append(cands, filepath.Join(filepath.Dir(exe), "..", "sdk", "python", "src"))
		}
	}
	if wd, err := os.Getwd(); err == nil {
		cands = append(cands, filepath.Join(wd, "sdk", "python", "src"))
	}
	for _, d := range cands {
		if has(d) {
			return py, filepath.Clean(d), nil
		}
	}
	if exec.Command(py, "-c", "import libdsec").Run() == nil {
		return py, "", nil
	}
	return "", "", errors.New("bench e2b: libdsec not found: give --libdsec DIR (sdk/python/src of a dsec source tree) or install it (pip install sdk/python)")
}

// envWith is env without the variables whose "NAME=" starts with one of
// drop, and with add.
func envWith(env, drop []string, add ...string) []string {
	out := make([]string, 0, len(env)+len(add))
	for _, kv := range env {
		keep := true
		for _, p := range drop {
			if strings.HasPrefix(kv, p) {
				keep = false
				break
			}
		}
		if keep {
			out = append(out, kv)
		}
	}
	return append(out, add...)
}
