package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/dsecproject/dsec/internal/cluster"
	"github.com/dsecproject/dsec/internal/conns"
	"github.com/dsecproject/dsec/internal/edge"
	"github.com/dsecproject/dsec/internal/edge/host"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/layer"
	"github.com/dsecproject/dsec/internal/store"
)

// metricsConns bounds the connections of --metrics-listen.
const metricsConns = 64

type edgeCmdConfig struct {
	clusterFlags
	listen        string
	advertise     string
	metricsListen string
	maxConns      int
	node          nodeConfig
	hollow        hollowConfig
}

// parseEdge parses and checks `dsec edge`'s flags.
func parseEdge(args []string) (edgeCmdConfig, error) {
	c := edgeCmdConfig{node: nodeConfig{labels: kvListFlag{}}}
	f := newCmdFlags("edge", "--listen ADDR --etcd URLS --cluster DIR --layers DIR --node-name NAME --state-dir DIR [flags]",
		"Run the node daemon of a cluster: it holds this machine's sandboxes and\n"+
			"serves the internal API (mutual TLS, apiservers only) on --listen. Needs\n"+
			"root. Several edges on one host need their own --state-dir, --listen and\n"+
			"--sandbox-cidr. With --hollow, it runs hollow edges for load tests instead\n"+
			"(no root needed).")
	f.StringVar(&c.listen, "listen", "", "address of the internal API (required), e.g. 10.0.0.5:7071")
	f.StringVar(&c.advertise, "advertise", "", "address apiservers reach the internal API at (default: --listen, which must then name a host)")
	f.StringVar(&c.metricsListen, "metrics-listen", "", "also serve /metrics and /healthz without TLS on this address (e.g. 127.0.0.1:9101 for Prometheus)")
	f.IntVar(&c.maxConns, "max-connections", 0, "most connections the internal API keeps open at once (0 = a quarter of the open-files limit, 64 to 16384); at most half may be connections whose mutual-TLS handshake has not completed, and a new connection past that closes the oldest of those")
	f.StringVar(&c.node.stateDir, "state-dir", "", "state directory of this edge (required; one per edge)")
	f.StringVar(&c.node.nodeName, "node-name", "", "this node's name, unique in the cluster (required; part of every sandbox id)")
	f.Var(kvListFlag(c.node.labels), "node-labels", "labels of this node, `k=v,...` (node_selector matches them; pool=NAME names its pool)")
	c.node.register(f)
	c.clusterFlags.register(f)
	c.hollow.register(f)
	if _, err := f.parseN(args, 0, 0); err != nil {
		return c, err
	}
	if err := c.clusterFlags.check(); err != nil {
		return c, err
	}
	for _, r := range []struct{ name, v string }{{"--listen", c.listen}, {"--state-dir", c.node.stateDir}, {"--node-name", c.node.nodeName}} {
		if r.v == "" {
			return c, fmt.Errorf("%s is required", r.name)
		}
	}
	if err := c.node.check(); err != nil {
		return c, err
	}
	if err := checkMaxConns(c.maxConns); err != nil {
		return c, err
	}
	if err := checkHollow(c); err != nil {
		return c, err
	}
	if c.advertise == "" {
		host, _, err := net.SplitHostPort(c.listen)
		if err != nil {
			return c, fmt.Errorf("--listen %q: %w", c.listen, err)
		}
		if ip := net.ParseIP(host); host == "" || ip != nil && ip.IsUnspecified() {
			return c, fmt.Errorf("--listen %s names no host apiservers can reach: give --advertise HOST:PORT", c.listen)
		}
	}
	return c, nil
}

func runEdgeDaemon(args []string) error {
	c, err := parseEdge(args)
	if err != nil {
		return err
	}
	return daemon(c.logFormat, c.logLevel, func(ctx context.Context, log *slog.Logger) error { return runEdge(ctx, c, log) })
}

func runEdge(ctx context.Context, c edgeCmdConfig, log *slog.Logger) error {
	if c.hollow.on {
		return runHollow(ctx, c, log)
	}
	if os.Geteuid() != 0 {
		return errors.New("dsec edge needs root: it mounts EROFS layers and overlayfs and runs OCI containers")
	}
	if err := checkNodeCert(c.clusterDir, c.node.nodeName); err != nil {
		return err
	}
	// Bind first: a taken port is reported before anything is touched.
	ln, err := net.Listen("tcp", c.listen)
	if err != nil {
		return fmt.Errorf("listening on %s: %w", c.listen, err)
	}
	defer ln.Close()
	// One edge per state dir, before its name is claimed: a second one
	// would take the registry entry from under the first.
	release, err := host.LockStateDir(c.node.stateDir)
	if err != nil {
		return err
	}
	defer release()
	advertise := c.advertise
	if advertise == "" {
		advertise = ln.Addr().String()
	}
	trust, st, err := c.join(ctx, log, nil)
	if err != nil {
		return err
	}
	defer st.Close()
	switch told, err := cluster.CheckNotRevoked(st, c.clusterDir); {
	case told && err != nil:
		return err
	case err != nil:
		// An etcd whose roles predate the revocations (dsec cluster
		// etcd-auth not run again since the upgrade): the apiservers
		// refuse a revoked certificate all the same.
		log.Warn("cannot tell whether this node's certificate is revoked", "err", err)
	}
	// etcd holds the cluster's keys and answers anyone who reaches it: no
	// sandbox of this node may, whatever its allow list says. (Before the
	// name is claimed: nothing past this point fails for it.)
	etcdDeny, unresolved := etcdAddrs(ctx, c.etcd)
	for _, err := range unresolved {
		log.Warn("an etcd endpoint's address is not known now: list its network in --sandbox-deny", "err", err)
	}
	c.node.deny = append(c.node.deny, etcdDeny...)
	c.node.refusePoolOverlap = true
	// Before the name is claimed: host.Open checks again as it claims
	// the pool.
	if err := host.CheckPoolFree(c.node.network, c.node.sandboxCIDR, c.node.stateDir); err != nil {
		return err
	}
	log.Info("sandboxes never reach these ranges", "deny", c.node.deny)
	tlsCfg, err := trust.EdgeServerTLS()
	if err != nil {
		return err
	}
	// The name is claimed before the host is: a second edge with a live
	// name stops here, having changed nothing.
	regCtx, unregister := context.WithCancel(context.Background())
	defer unregister()
	instance, known := cluster.StateInstance(c.node.stateDir)
	if err := cluster.RegisterNode(regCtx, st, cluster.NodeRecord{
		Name: c.node.nodeName, Address: advertise, Instance: instance, StartedAt: time.Now().UTC(),
	}, log); err != nil {
		return err
	}
	if !known {
		if err := cluster.SaveInstance(c.node.stateDir, instance); err != nil {
			return fmt.Errorf("writing the state dir's instance: %w", err)
		}
	}
	// The node reads layers and stages its snapshots; the apiservers
	// publish them.
	layers, err := layer.NewNodeStore(c.layersDir, st, log)
	if err != nil {
		return fmt.Errorf("opening layer store: %w", err)
	}
	defer layers.Close()
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	ed, h, err := startEdge(ctx, c.node, filepath.Join(c.node.stateDir, "edge"), layers, log, reg)
	if err != nil {
		return err
	}
	defer h.Close()
	defer ed.Close()
	defer cleanupOnExit(c.node, ed, log)
	defer dropAbandoned(st, c.node.nodeName, ed, log)()

	servers := []serving{internalAPI(ln, ed, fmt.Sprintf("{\"status\":\"ok\",\"node\":%q}", c.node.nodeName), c.maxConns, tlsCfg, log, reg, reg)}
	if c.metricsListen != "" {
		ms, err := metricsServer(c.metricsListen, reg)
		if err != nil {
			return err
		}
		servers = append(servers, ms)
	}
	log.Info("dsec edge: serving the internal API", "listen", ln.Addr().String(), "advertise", advertise, "cluster", trust.Info.ID)
	return serveUntilDone(ctx, log, "shutting down; sandboxes keep running and are re-adopted on the next start", servers...)
}

// dropAbandoned deletes the sandboxes whose creates were placed on another
// node while this edge was down (cluster.Abandon): once now, before the
// edge serves, then every cluster.AbandonedSweep until the returned stop.
func dropAbandoned(st store.Store, name string, ed *edge.Edge, log *slog.Logger) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	drop := func(tokens []string) []string { return ed.DropAbandoned(ctx, tokens) }
	if err := cluster.SweepAbandoned(st, name, drop, log); err != nil {
		log.Warn("looking for abandoned creates", "err", err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		cluster.SweepAbandonedLoop(ctx, st, name, drop, log)
	}()
	return func() {
		cancel()
		<-done
	}
}

// internalAPI serves an edge's internal API on ln (with /metrics from
// gather, and /healthz answering health), over the cluster's mutual TLS.
// Only the cluster's apiservers get past the handshake (a client
// certificate of the cluster's CA is required): every request that
// reaches the mux is trusted. reg takes the listener's metrics.
func internalAPI(ln net.Listener, ed edgeapi.Edge, health string, maxConns int, tlsCfg *tls.Config, log *slog.Logger, reg prometheus.Registerer, gather prometheus.Gatherer) serving {
	mux := http.NewServeMux()
	mux.Handle(edgeapi.Prefix+"/", edgeapi.NewServer(ed, log))
	mux.Handle("GET /metrics", promhttp.HandlerFor(gather, promhttp.HandlerOpts{}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintln(w, health)
	})
	lim := limitConns(ln, maxConns, "internal", log, reg)
	hs := lim.Server(conns.Trusting(mux))
	hs.TLSConfig = tlsCfg
	hs.ErrorLog = slog.NewLogLogger(log.Handler(), slog.LevelDebug)
	return serving{hs, func() error { return hs.Serve(tls.NewListener(lim, tlsCfg)) }}
}

// metricsServer serves /metrics from gather and /healthz over plain HTTP
// on addr (--metrics-listen). Nobody authenticates there: a few
// connections, the oldest closed for a new one, so a flood costs the
// daemon 64 descriptors at most. Its listener closes with the server.
func metricsServer(addr string, gather prometheus.Gatherer) (serving, error) {
	mln, err := net.Listen("tcp", addr)
	if err != nil {
		return serving{}, fmt.Errorf("listening on %s: %w", addr, err)
	}
	mmux := http.NewServeMux()
	mmux.Handle("GET /metrics", promhttp.HandlerFor(gather, promhttp.HandlerOpts{}))
	mmux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) { fmt.Fprintln(w, `{"status":"ok"}`) })
	ml := conns.Listen(mln, conns.Config{Max: metricsConns, MaxUntrusted: metricsConns, WriteStall: conns.DefaultWriteStall,
		ReadHeaderTimeout: conns.DefaultReadHeaderTimeout, IdleTimeout: conns.DefaultIdleTimeout})
	ms := ml.Server(mmux)
	return serving{ms, func() error { return ms.Serve(ml) }}, nil
}

// etcdAddrs are the IPv4 addresses of the etcd endpoints urls
// (comma-separated URLs or host:port, as the etcd client takes them), host
// names resolved now, each as a /32; and what could not be resolved. Unix
// socket endpoints have no address.
func etcdAddrs(ctx context.Context, urls string) ([]netip.Prefix, []error) {
	var out []netip.Prefix
	var unresolved []error
	for _, u := range strings.Split(urls, ",") {
		if u = strings.TrimSpace(u); u == "" || strings.HasPrefix(u, "unix:") || strings.HasPrefix(u, "unixs:") {
			continue
		}
		hostname := ""
		if pu, err := url.Parse(u); err == nil && pu.Scheme != "" && pu.Host != "" {
			hostname = pu.Hostname()
		} else if h, _, err := net.SplitHostPort(u); err == nil {
			hostname = h
		}
		if hostname == "" {
			unresolved = append(unresolved, fmt.Errorf("--etcd %q: no host in it", u))
			continue
		}
		var addrs []netip.Addr
		if a, err := netip.ParseAddr(hostname); err == nil {
			addrs = []netip.Addr{a}
		} else {
			lctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			addrs, err = net.DefaultResolver.LookupNetIP(lctx, "ip4", hostname)
			cancel()
			if err != nil {
				unresolved = append(unresolved, fmt.Errorf("--etcd %s: resolving %s: %w", u, hostname, err))
				continue
			}
		}
		for _, a := range addrs {
			if a = a.Unmap(); a.Is4() {
				out = append(out, netip.PrefixFrom(a, 32))
			}
		}
	}
	slices.SortFunc(out, func(a, b netip.Prefix) int { return a.Addr().Compare(b.Addr()) })
	return slices.Compact(out), unresolved
}

// checkNodeCert refuses to run node from a --cluster directory whose
// certificate is another node's (dsec cluster add-edge): apiservers
// would refuse it. The edges' shared certificate serves any node.
func checkNodeCert(dir, node string) error {
	switch named, err := nodeCertOf(dir); {
	case err != nil:
		return err
	case named != "" && named != node:
		return fmt.Errorf("--cluster %s holds node %s's certificate, not %s's: give --node-name %s, or the directory dsec cluster add-edge --node-name %s writes", dir, named, node, named, node)
	}
	return nil
}

// nodeCertOf is the node the --cluster directory dir's edge certificate
// names ("" for the edges' shared one).
func nodeCertOf(dir string) (string, error) {
	tr, err := cluster.Load(dir)
	if err != nil {
		return "", err
	}
	return tr.NodeName()
}
