package main

// `dsec edge --hollow`: edges for load tests of the control plane, as
// Kubernetes proves its own with kubemark's hollow nodes. Each hollow
// edge is the real edge (internal API over mutual TLS, admission,
// records, counts, TTL, pause state, labels, the registry lease and what
// the watcher polls) over the fake backend, which runs nothing: no root,
// mount, cgroup or network is touched, and one process can hold many of
// them. A hollow edge says so in the registry, so `GET /v1/nodes` and
// the edges' metrics label it; it is never the default, and no benchmark
// of the data plane may use one.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/dsecproject/dsec/internal/cluster"
	"github.com/dsecproject/dsec/internal/edge"
	"github.com/dsecproject/dsec/internal/layer"
	"github.com/dsecproject/dsec/internal/sandbox"
	"github.com/dsecproject/dsec/internal/sandbox/fake"
)

// maxHollowEdges bounds --hollow-edges.
const maxHollowEdges = 1024

// defaultHollowLatency is what a real edge's backend took on the reference
// machine (2 cores; dsec up, base of busybox, 2026-12-02): 200 creates
// (composing the rootfs and starting the sandbox: the part a hollow edge
// does not do), execs of `true` (the edge's own duration_ms), destroys,
// and 60 pauses and resumes, one at a time. docs/operating.md says how
// to measure it again.
const defaultHollowLatency = "create=4.9ms/13.7ms,exec=4.4ms/11.5ms,delete=3.2ms/21.4ms,pause=3.2ms/20.5ms,resume=2.6ms/7ms"

// hollowConfig is what --hollow adds to `dsec edge`.
type hollowConfig struct {
	on      bool
	edges   int
	latency string
}

func (h *hollowConfig) register(f *cmdFlags) {
	f.BoolVar(&h.on, "hollow", false, "run hollow edges for load tests of the control plane: the real edge over a simulated backend that runs\n"+
		"nothing (no root, mounts, cgroups or network; labelled hollow in GET /v1/nodes and in metrics). Never for serving sandboxes")
	f.IntVar(&h.edges, "hollow-edges", 1, "with --hollow: how many edges this process runs, named NODE-NAME-1.. (one: NODE-NAME), listening on\n"+
		"--listen's port and the ones after it (port 0: any free ones), each with a state dir under --state-dir and a registry lease")
	f.StringVar(&h.latency, "hollow-latency", defaultHollowLatency, "with --hollow: what each simulated operation takes, `op=MEDIAN/P99,...` (a log-normal per op; ops create, exec,\n"+
		"delete, pause, resume; a missing op takes no time; \"none\": nothing takes time). The default was measured on a real edge")
}

// parseLatency reads --hollow-latency.
func parseLatency(s string) (fake.Latency, error) {
	var l fake.Latency
	s = strings.TrimSpace(s)
	if s == "none" || s == "" {
		return l, nil
	}
	seen := map[string]bool{}
	for _, part := range strings.Split(s, ",") {
		op, v, ok := strings.Cut(strings.TrimSpace(part), "=")
		med, p99, ok2 := strings.Cut(v, "/")
		if !ok || !ok2 {
			return l, fmt.Errorf("--hollow-latency: %q: want op=MEDIAN/P99, e.g. create=5ms/15ms", part)
		}
		m, err := time.ParseDuration(med)
		if err != nil || m < 0 {
			return l, fmt.Errorf("--hollow-latency: %q: median %q is not a duration ≥ 0", part, med)
		}
		p, err := time.ParseDuration(p99)
		if err != nil || p < m {
			return l, fmt.Errorf("--hollow-latency: %q: p99 %q is not a duration ≥ the median", part, p99)
		}
		if m > time.Minute || p > 10*time.Minute {
			return l, fmt.Errorf("--hollow-latency: %q: at most a minute's median and ten minutes' p99", part)
		}
		if seen[op] {
			return l, fmt.Errorf("--hollow-latency: %s given twice", op)
		}
		seen[op] = true
		d := fake.Dist{Median: m, P99: p}
		switch op {
		case "create":
			l.Create = d
		case "exec":
			l.Exec = d
		case "delete":
			l.Destroy = d
		case "pause":
			l.Pause = d
		case "resume":
			l.Resume = d
		default:
			return l, fmt.Errorf("--hollow-latency: unknown op %q (want create, exec, delete, pause or resume)", op)
		}
	}
	return l, nil
}

// hollowName is the name of the i-th (from 0) of n hollow edges.
func hollowName(base string, i, n int) string {
	if n == 1 {
		return base
	}
	return base + "-" + strconv.Itoa(i+1)
}

// checkHollow checks the hollow flags against the rest of `dsec edge`'s.
func checkHollow(c edgeCmdConfig) error {
	h := c.hollow
	if !h.on {
		if h.edges != 1 || h.latency != defaultHollowLatency {
			return errors.New("--hollow-edges and --hollow-latency need --hollow")
		}
		return nil
	}
	if h.edges < 1 || h.edges > maxHollowEdges {
		return fmt.Errorf("--hollow-edges %d: want 1 to %d", h.edges, maxHollowEdges)
	}
	if _, err := parseLatency(h.latency); err != nil {
		return err
	}
	if err := edge.CheckName(hollowName(c.node.nodeName, h.edges-1, h.edges)); err != nil {
		return fmt.Errorf("--node-name with --hollow-edges %d: %w", h.edges, err)
	}
	if h.edges > 1 && c.advertise != "" {
		return errors.New("--advertise names one address: with --hollow-edges > 1 the edges advertise their --listen addresses")
	}
	return nil
}

// hollowListen opens the i-th hollow edge's listener: port+i of --listen
// (any free port when --listen's is 0).
func hollowListen(listen string, i int) (net.Listener, error) {
	host, port, err := net.SplitHostPort(listen)
	if err != nil {
		return nil, fmt.Errorf("--listen %q: %w", listen, err)
	}
	p, err := strconv.Atoi(port)
	if err != nil || p < 0 || p+i > 65535 {
		return nil, fmt.Errorf("--listen %q: no port %d after it", listen, i)
	}
	if p != 0 {
		p += i
	}
	addr := net.JoinHostPort(host, strconv.Itoa(p))
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("listening on %s: %w", addr, err)
	}
	return ln, nil
}

// runHollow runs c.hollow.edges hollow edges until ctx ends.
func runHollow(ctx context.Context, c edgeCmdConfig, log *slog.Logger) error {
	lat, err := parseLatency(c.hollow.latency)
	if err != nil {
		return err
	}
	n := c.hollow.edges
	// Bind first: a taken port is reported before anything is touched.
	lns := make([]net.Listener, 0, n)
	defer func() {
		for _, ln := range lns {
			_ = ln.Close()
		}
	}()
	for i := range n {
		ln, err := hollowListen(c.listen, i)
		if err != nil {
			return err
		}
		lns = append(lns, ln)
	}
	if named, err := nodeCertOf(c.clusterDir); err != nil {
		return err
	} else if named != "" {
		return fmt.Errorf("--cluster %s holds node %s's certificate: hollow edges serve many node names, with the edges' shared directory (DIR/edge; apiservers must then run without --require-node-certs)", c.clusterDir, named)
	}
	trust, st, err := c.join(ctx, log, nil)
	if err != nil {
		return err
	}
	defer st.Close()
	tlsCfg, err := trust.EdgeServerTLS()
	if err != nil {
		return err
	}
	// One layer store for all: a hollow edge only checks that the layers
	// it is asked for exist.
	layers, err := layer.NewStore(c.layersDir, st, log)
	if err != nil {
		return fmt.Errorf("opening layer store: %w", err)
	}
	defer layers.Close()
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	regCtx, unregister := context.WithCancel(context.Background())
	defer unregister()
	var servers []serving
	for i, ln := range lns {
		name := hollowName(c.node.nodeName, i, n)
		advertise := c.advertise
		if advertise == "" {
			advertise = ln.Addr().String()
		}
		stateDir := filepath.Join(c.node.stateDir, name)
		instance, known := cluster.StateInstance(stateDir)
		if err := cluster.RegisterNode(regCtx, st, cluster.NodeRecord{
			Name: name, Address: advertise, Instance: instance, StartedAt: time.Now().UTC(), Hollow: true,
		}, log); err != nil {
			return err
		}
		if !known {
			if err := cluster.SaveInstance(stateDir, instance); err != nil {
				return fmt.Errorf("writing the state dir's instance: %w", err)
			}
		}
		elog := log.With("node", name, "hollow", true)
		ereg := prometheus.WrapRegistererWith(prometheus.Labels{"node": name, "hollow": "true"}, reg)
		ed, err := edge.New(edge.Config{
			Name: name, StateDir: filepath.Join(stateDir, "edge"), Labels: c.node.labels,
			MaxSandboxes: c.node.maxSandboxes, Policy: sandbox.DefaultPolicy(),
			MaxSessionsTotal: c.node.maxSessions, MaxStreams: c.node.maxStreams,
		}, edge.Deps{
			Backend: fake.NewWithLatency("container", lat), Blobs: layers, Log: elog,
			Metrics: edge.NewMetrics(ereg), Runtime: "hollow", Launcher: "hollow",
		})
		if err == nil {
			err = ed.Start(ctx)
		}
		if err != nil {
			return fmt.Errorf("hollow edge %s: %w", name, err)
		}
		defer ed.Close()
		defer dropAbandoned(st, name, ed, elog)()
		servers = append(servers, internalAPI(ln, ed, fmt.Sprintf("{\"status\":\"ok\",\"node\":%q,\"hollow\":true}", name), c.maxConns, tlsCfg, elog, ereg, reg))
	}
	if c.metricsListen != "" {
		ms, err := metricsServer(c.metricsListen, reg)
		if err != nil {
			return err
		}
		servers = append(servers, ms)
	}
	log.Info("dsec edge: serving hollow edges (simulated sandboxes, for load tests only)", "edges", n,
		"first", lns[0].Addr().String(), "cluster", trust.Info.ID)
	return serveUntilDone(ctx, log, "shutting down the hollow edges", servers...)
}
