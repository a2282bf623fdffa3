package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/apiserver"
	"github.com/dsecproject/dsec/internal/cluster"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/iam"
	"github.com/dsecproject/dsec/internal/layer"
	"github.com/dsecproject/dsec/internal/placement"
	"github.com/dsecproject/dsec/internal/sandbox"
	"github.com/dsecproject/dsec/internal/store"
	"github.com/dsecproject/dsec/internal/watcher"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

// clusterFlags are what every process of a cluster is told.
type clusterFlags struct {
	etcd       string
	etcdPrefix string
	etcdTLS    cluster.EtcdTLSFiles
	clusterDir string
	layersDir  string
	logFormat  string
	logLevel   string
}

func (c *clusterFlags) register(f *cmdFlags) {
	c.registerEtcd(f)
	f.StringVar(&c.clusterDir, "cluster", "", "cluster directory made by `dsec cluster init` (required)")
	f.StringVar(&c.layersDir, "layers", "", "layer directory every server and edge of the cluster sees, e.g. a shared mount (required)")
	f.StringVar(&c.logFormat, "log-format", "text", "log format: text or json")
	f.StringVar(&c.logLevel, "log-level", "info", "log level: debug, info, warn, error")
}

// registerEtcd registers the flags that say how to reach etcd.
func (c *clusterFlags) registerEtcd(f *cmdFlags) {
	f.StringVar(&c.etcd, "etcd", "", "etcd client URLs, comma-separated (required)")
	f.StringVar(&c.etcdPrefix, "etcd-prefix", "/dsec/", "key prefix of this cluster in etcd (several clusters may share one etcd)")
	f.StringVar(&c.etcdTLS.CA, "etcd-ca", "", "CA certificate that https:// etcd endpoints are verified against (default: the cluster directory's ca.pem)")
	f.StringVar(&c.etcdTLS.Cert, "etcd-cert", "", "client certificate presented to etcd (default: the cluster directory's etcd-client.pem)")
	f.StringVar(&c.etcdTLS.Key, "etcd-key", "", "key of --etcd-cert")
}

func (c *clusterFlags) check() error {
	for _, r := range []struct{ name, v string }{{"--etcd", c.etcd}, {"--cluster", c.clusterDir}, {"--layers", c.layersDir}} {
		if r.v == "" {
			return fmt.Errorf("%s is required", r.name)
		}
	}
	_, err := etcdSecure(splitList(c.etcd), c.etcdTLS)
	return err
}

// join loads the cluster directory, connects to etcd and checks that etcd
// and the layer directory are this cluster's. before, if not nil, runs
// once etcd answers and before anything is written to it.
func (c *clusterFlags) join(ctx context.Context, log *slog.Logger, before func(store.Store) error) (*cluster.Trust, *store.Etcd, error) {
	trust, st, err := c.openEtcd(ctx, log)
	if err != nil {
		return nil, nil, err
	}
	if before != nil {
		if err := before(st); err != nil {
			_ = st.Close()
			return nil, nil, err
		}
	}
	if err := cluster.Join(st, trust, c.layersDir); err != nil {
		_ = st.Close()
		return nil, nil, err
	}
	return trust, st, nil
}

// openEtcd loads the cluster directory and connects to etcd with its
// credentials, checking that etcd answers.
func (c *clusterFlags) openEtcd(ctx context.Context, log *slog.Logger) (*cluster.Trust, *store.Etcd, error) {
	trust, err := cluster.Load(c.clusterDir)
	if err != nil {
		return nil, nil, err
	}
	endpoints := splitList(c.etcd)
	secure, err := etcdSecure(endpoints, c.etcdTLS)
	if err != nil {
		return nil, nil, err
	}
	cfg := store.EtcdConfig{Endpoints: endpoints, Prefix: c.etcdPrefix, Log: log}
	if secure {
		if cfg.TLS, err = trust.EtcdTLS(c.etcdTLS); err != nil {
			return nil, nil, err
		}
	}
	st, err := store.OpenEtcd(cfg)
	if err != nil {
		return nil, nil, err
	}
	if err := st.Ping(ctx); err != nil {
		_ = st.Close()
		return nil, nil, fmt.Errorf("etcd %s: %w%s%s", c.etcd, err, c.etcdHint(ctx, endpoints, cfg.TLS), nodeUserHint(trust, cfg.TLS, err))
	}
	return trust, st, nil
}

// nodeUserHint explains etcd's refusal of a node's own etcd user (dsec
// cluster add-edge's): etcd-auth has not made it yet, or deleted it.
func nodeUserHint(trust *cluster.Trust, cfg *tls.Config, err error) string {
	user := etcdClientUser(cfg)
	if !errors.Is(err, store.ErrEtcdRefused) || !strings.HasPrefix(user, cluster.EtcdNodeUserPrefix(trust.Info.ID)) {
		return ""
	}
	return fmt.Sprintf(" (this directory's etcd user is %s, a node's own: etcd knows it once dsec cluster etcd-auth runs with the cluster directory after dsec cluster add-edge, and forgets it once the node's certificate is revoked)", user)
}

// etcdSecure tells whether etcd is reached over TLS: every endpoint
// https://, or none. TLS files with http:// endpoints are refused rather
// than ignored (they would send the cluster's keys in clear).
func etcdSecure(endpoints []string, files cluster.EtcdTLSFiles) (bool, error) {
	var https, plain []string
	for _, ep := range endpoints {
		if strings.HasPrefix(strings.ToLower(ep), "https://") {
			https = append(https, ep)
		} else {
			plain = append(plain, ep)
		}
	}
	switch {
	case len(https) > 0 && len(plain) > 0:
		return false, fmt.Errorf("--etcd mixes https:// and other endpoints (%s): give every one as https://", strings.Join(plain, ","))
	case len(plain) > 0 && files != (cluster.EtcdTLSFiles{}):
		return false, fmt.Errorf("--etcd-ca, --etcd-cert and --etcd-key are for https:// endpoints, and --etcd gives %s", strings.Join(plain, ","))
	}
	return len(https) > 0, nil
}

// etcdHint says why etcd did not answer when TLS is the reason: the etcd
// client reports only a timeout. It shakes hands with the first endpoint
// as the client would (and, for a plain endpoint, over TLS, to tell one
// that serves TLS); "" when that tells nothing.
func (c *clusterFlags) etcdHint(ctx context.Context, endpoints []string, cfg *tls.Config) string {
	hostOf := func(ep string) string {
		if i := strings.Index(ep, "://"); i >= 0 {
			ep = ep[i+3:]
		}
		h, _, _ := strings.Cut(ep, "/")
		return h
	}
	// No endpoint takes a connection: say what each dial met (the
	// client's own error is only its deadline).
	var dialErrs []string
	for _, ep := range endpoints {
		conn, err := (&net.Dialer{Timeout: 2 * time.Second}).DialContext(ctx, "tcp", hostOf(ep))
		if err != nil {
			dialErrs = append(dialErrs, err.Error())
			continue
		}
		conn.Close()
	}
	if len(dialErrs) == len(endpoints) {
		return " (" + strings.Join(dialErrs, "; ") + ")"
	}
	host := hostOf(endpoints[0])
	probe := func(cfg *tls.Config, read bool) error {
		d := tls.Dialer{NetDialer: &net.Dialer{Timeout: 2 * time.Second}, Config: cfg}
		conn, err := d.DialContext(ctx, "tcp", host)
		if err != nil {
			return err
		}
		defer conn.Close()
		if !read {
			return nil
		}
		// Under TLS 1.3 a server refuses a client's certificate after
		// the client's side of the handshake: the refusal is read.
		_ = conn.SetReadDeadline(time.Now().Add(2 * time.Second))
		var b [1]byte
		if _, err := conn.Read(b[:]); err != nil && !errors.Is(err, os.ErrDeadlineExceeded) {
			return err
		}
		return nil
	}
	if cfg == nil {
		if probe(&tls.Config{InsecureSkipVerify: true}, false) == nil { // only asks whether it speaks TLS
			return fmt.Sprintf(" (%s serves TLS: give https:// endpoints)", host)
		}
		return ""
	}
	err := probe(cfg, true)
	var netErr *net.OpError
	if err == nil || (errors.As(err, &netErr) && netErr.Op == "dial") {
		return ""
	}
	hint := fmt.Sprintf(" (TLS with %s: %v", host, err)
	if len(cfg.Certificates) == 0 {
		hint += fmt.Sprintf("; no client certificate was presented: %s has no %s (directories made before dsec cluster init wrote one), give --etcd-cert and --etcd-key", c.clusterDir, cluster.EtcdClientCert)
	}
	return hint + ")"
}

type serverConfig struct {
	clusterFlags
	listen     string
	apiKey     string
	placementK string
	overflow   kvListFlag
	maxConns   int
	// e2bDefaultTemplate is --e2b-default-template (up.go).
	e2bDefaultTemplate string
	// idemTTL is --idempotency-ttl (up.go).
	idemTTL time.Duration
	// requireNodeCerts is --require-node-certs.
	requireNodeCerts bool
}

// parseServer parses and checks `dsec server`'s flags.
func parseServer(args []string) (serverConfig, placement.Config, error) {
	c := serverConfig{overflow: kvListFlag{}}
	f := newCmdFlags("server", "--listen ADDR --etcd URLS --cluster DIR --layers DIR [flags]",
		"Run a stateless apiserver of a cluster: IAM, placement, the watcher of the\n"+
			"edges and routing, with its state in etcd. Run any number behind a load\n"+
			"balancer; clients may list them all in DSEC_ENDPOINT to fail over.")
	f.StringVar(&c.listen, "listen", "127.0.0.1:7070", "address to serve the public API on")
	f.StringVar(&c.apiKey, "api-key", os.Getenv(dsec.EnvAPIKey), "admin API key to register in etcd (default: $DSEC_API_KEY; the first server of a cluster needs one; idempotent)")
	f.StringVar(&c.placementK, "placement-k", strconv.Itoa(placement.DefaultK), "`K` nodes sampled per placement (power of K choices): 1 is random, all is least loaded from the watcher's view")
	overlay := f.Bool("placement-overlay", true, "count this apiserver's placements that the watcher's view does not show yet as load (false only to measure what that is worth: bursts herd)")
	f.IntVar(&c.maxConns, "max-connections", 0, maxConnsHelp)
	f.StringVar(&c.e2bDefaultTemplate, "e2b-default-template", defaultE2BTemplate, e2bDefaultTemplateHelp)
	f.DurationVar(&c.idemTTL, "idempotency-ttl", apiserver.DefaultIdempotencyTTL, idemTTLHelp)
	f.BoolVar(&c.requireNodeCerts, "require-node-certs", false, "take an edge only with a certificate of its own node (dsec cluster add-edge), never the edges' shared one from DIR/edge: then no edge host can answer for another node")
	hollow := f.Bool("place-on-hollow", false, "let placement choose hollow edges (dsec edge --hollow: simulated, running nothing), for load tests of the control plane; without it they take no sandbox")
	f.Var(c.overflow, "overflow-pool", "`pool=utilization` (repeatable or comma-separated): nodes labelled pool=NAME take sandboxes only once every other node is at least that full, e.g. cloud=0.8")
	c.clusterFlags.register(f)
	if _, err := f.parseN(args, 0, 0); err != nil {
		return c, placement.Config{}, err
	}
	if err := c.clusterFlags.check(); err != nil {
		return c, placement.Config{}, err
	}
	k, err := parsePlacementK(c.placementK)
	if err != nil {
		return c, placement.Config{}, err
	}
	if err := checkMaxConns(c.maxConns); err != nil {
		return c, placement.Config{}, err
	}
	if err := checkIdemTTL(c.idemTTL); err != nil {
		return c, placement.Config{}, err
	}
	overflow := map[string]float64{}
	for pool, v := range c.overflow {
		u, err := strconv.ParseFloat(v, 64)
		if err != nil || u <= 0 || u > 1 {
			return c, placement.Config{}, fmt.Errorf("--overflow-pool %s=%s: want a utilization above 0 and at most 1", pool, v)
		}
		overflow[pool] = u
	}
	return c, placement.Config{K: k, Overflow: overflow, NoOverlay: !*overlay, Hollow: *hollow}, nil
}

// parsePlacementK parses --placement-k: a number of nodes from 1, or all.
func parsePlacementK(s string) (int, error) {
	if s == "all" {
		return placement.AllNodes, nil
	}
	k, err := strconv.Atoi(s)
	if err != nil || k < 1 {
		return 0, fmt.Errorf("--placement-k %s: want a number of nodes from 1, or all", s)
	}
	return k, nil
}

func runServer(args []string) error {
	c, pc, err := parseServer(args)
	if err != nil {
		return err
	}
	return daemon(c.logFormat, c.logLevel, func(ctx context.Context, log *slog.Logger) error { return serve(ctx, c, pc, log) })
}

// edgeDialer makes an apiserver's clients of the edges: the cluster's
// mutual TLS, checked against the node dialed (Trust.APIServerClientTLS),
// many idle connections per edge (bursts of creates and execs), and no
// overall timeout (exec and streams last as long as their command). Each
// node has its own transport, its TLS knowing which node it is for; a
// node's transport is dropped when its address changes.
type edgeDialer struct {
	tls func(node string) *tls.Config
	mu  sync.Mutex
	by  map[string]edgeTransport
}

type edgeTransport struct {
	addr  string
	hc    *http.Client
	conns *connSet
}

// connSet holds the connections a node's transport opened and has not
// closed: when the node's certificate is revoked, those in use (a call
// under way, a port tunnel) and those it would keep for reuse are closed
// too, not only the idle ones.
type connSet struct {
	mu     sync.Mutex
	open   map[*trackedConn]bool
	closed bool
}

type trackedConn struct {
	net.Conn
	set  *connSet
	once sync.Once
}

func (c *trackedConn) Close() error {
	c.once.Do(func() {
		c.set.mu.Lock()
		delete(c.set.open, c)
		c.set.mu.Unlock()
	})
	return c.Conn.Close()
}

// track adds c to the set; a set closed already closes it.
func (s *connSet) track(c net.Conn) (net.Conn, error) {
	tc := &trackedConn{Conn: c, set: s}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		_ = c.Close()
		return nil, fmt.Errorf("the node's connections were closed: its certificate was revoked (%w)", edgeapi.ErrRevoked)
	}
	s.open[tc] = true
	return tc, nil
}

// closeAll closes every connection of the set, and every one opened later.
func (s *connSet) closeAll() {
	s.mu.Lock()
	s.closed = true
	open := s.open
	s.open = map[*trackedConn]bool{}
	s.mu.Unlock()
	for c := range open {
		_ = c.Conn.Close()
	}
}

func newEdgeDialer(trust *cluster.Trust, requireNode bool) (*edgeDialer, error) {
	cfg, err := trust.APIServerClientTLS(requireNode)
	if err != nil {
		return nil, err
	}
	return &edgeDialer{tls: cfg, by: map[string]edgeTransport{}}, nil
}

// dial is the client of rec's edge.
func (d *edgeDialer) dial(rec cluster.NodeRecord) edgeapi.Edge {
	d.mu.Lock()
	defer d.mu.Unlock()
	t, ok := d.by[rec.Name]
	if !ok || t.addr != rec.Address {
		if ok {
			t.hc.CloseIdleConnections()
		}
		conns := &connSet{open: map[*trackedConn]bool{}}
		dialer := &net.Dialer{Timeout: 2 * time.Second, KeepAlive: 15 * time.Second}
		t = edgeTransport{addr: rec.Address, conns: conns, hc: &http.Client{Transport: &http.Transport{
			TLSClientConfig: d.tls(rec.Name),
			DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
				c, err := dialer.DialContext(ctx, network, addr)
				if err != nil {
					return nil, err
				}
				return conns.track(c)
			},
			TLSHandshakeTimeout: 3 * time.Second,
			MaxIdleConns:        256,
			MaxIdleConnsPerHost: 256,
			IdleConnTimeout:     90 * time.Second,
			ForceAttemptHTTP2:   false,
		}}}
		d.by[rec.Name] = t
	}
	return edgeapi.NewClient(rec.Name, "https://"+rec.Address, t.hc)
}

// forget drops the transport of a node that left the registry: its
// idle connections close; calls under way (a long exec to an edge only
// cut off from etcd) run on.
func (d *edgeDialer) forget(node string) { d.drop(node, false) }

// cut drops the transport of a node whose certificate was revoked ("":
// of every node, when the revocations were read anew) and closes all its
// connections, those in use too: its next call makes a new one, with a
// new handshake, which is refused.
func (d *edgeDialer) cut(node string) { d.drop(node, true) }

func (d *edgeDialer) drop(node string, all bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for name, t := range d.by {
		if node == "" || name == node {
			t.hc.CloseIdleConnections()
			if all {
				t.conns.closeAll()
			}
			delete(d.by, name)
		}
	}
}

func serve(ctx context.Context, c serverConfig, pc placement.Config, log *slog.Logger) error {
	ln, err := net.Listen("tcp", c.listen)
	if err != nil {
		return fmt.Errorf("listening on %s: %w", c.listen, err)
	}
	defer ln.Close()
	trust, st, err := c.join(ctx, log, func(st store.Store) error {
		if c.apiKey != "" {
			return nil
		}
		switch ok, err := iam.AdminKeyExists(st); {
		case err != nil:
			return err
		case !ok:
			return errors.New("etcd holds no admin key for this cluster: start the first server with --api-key KEY")
		}
		return nil
	})
	if err != nil {
		return err
	}
	defer st.Close()
	ident, err := iam.New(st)
	if err != nil {
		return fmt.Errorf("opening IAM: %w", err)
	}
	if c.apiKey != "" {
		if _, created, err := ident.EnsureAdminKey(c.apiKey); err != nil {
			return fmt.Errorf("registering the admin key: %w", err)
		} else if created {
			log.Info("registered the admin API key in etcd")
		}
	}
	layers, err := layer.NewStore(c.layersDir, st, log)
	if err != nil {
		return fmt.Errorf("opening layer store: %w", err)
	}
	defer layers.Close()
	// Creates resolve refs from memory, kept current by an etcd watch;
	// keys and projects too (a key revoked through another apiserver
	// stops working here as soon as the watch says so).
	layers.WatchCatalog(ctx)
	ident.Watch(ctx)
	edges, err := newEdgeDialer(trust, c.requireNodeCerts)
	if err != nil {
		return err
	}
	src := cluster.NewSource(st, edges.dial)
	src.Forget = edges.forget
	// Revoked node certificates are known before any edge is dialed; a
	// node whose certificate is revoked later loses its connections and
	// client (the view dials it anew within a poll, and is refused).
	trust.WatchRevoked(ctx, st, func(node string) {
		edges.cut(node)
		src.Redial(node)
	})
	view := watcher.New(src, watcher.Config{Log: log})
	view.Sync(ctx)
	go view.Run(ctx)
	instance := cluster.NewInstance()
	if err := cluster.RegisterServer(ctx, st, cluster.ServerRecord{Instance: instance, Address: ln.Addr().String(), StartedAt: time.Now().UTC()}, log); err != nil {
		return err
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	srv := apiserver.New(apiserver.Deps{
		IAM: ident, Layers: layers, PublishSnapshots: true, Nodes: view, Placement: pc, Log: log.With("apiserver", instance),
		Registry: reg, Gatherer: reg, Policy: clusterPolicy(), MaxLayerBytes: 64 << 30,
		Store: st, QuotaStore: st, Instance: instance, E2BDefaultTemplate: c.e2bDefaultTemplate, IdempotencyTTL: c.idemTTL,
		Alive: func(other string) (bool, error) { return cluster.ServerAlive(st, other) },
	})
	go srv.Run(ctx)
	lim := limitConns(ln, c.maxConns, "api", log, reg)
	hs := lim.Server(srv.Handler())
	hs.ErrorLog = slog.NewLogLogger(log.Handler(), slog.LevelDebug)
	nodes := len(view.Snapshot())
	log.Info("dsec server: serving", "endpoint", "http://"+ln.Addr().String(), "cluster", trust.Info.ID, "instance", instance, "nodes", nodes)
	err = serveUntilDone(ctx, log, "shutting down", serving{hs, func() error { return hs.Serve(lim) }})
	srv.Settle(5 * time.Second)
	return err
}

// clusterPolicy is an apiserver's policy: every backend some edge may
// offer passes validation, and placement finds a node that offers it.
func clusterPolicy() sandbox.Policy {
	p := sandbox.DefaultPolicy()
	p.Backends = []string{api.BackendContainer, api.BackendGVisor, api.BackendMicroVM}
	return p
}
