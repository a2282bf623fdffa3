package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/apiserver"
	"github.com/dsecproject/dsec/internal/cluster"
	"github.com/dsecproject/dsec/internal/conns"
	"github.com/dsecproject/dsec/internal/edge"
	"github.com/dsecproject/dsec/internal/edge/host"
	"github.com/dsecproject/dsec/internal/iam"
	"github.com/dsecproject/dsec/internal/layer"
	"github.com/dsecproject/dsec/internal/sandbox"
	"github.com/dsecproject/dsec/internal/store"
	"github.com/dsecproject/dsec/internal/watcher"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

// upConfig is everything `dsec up` can be told.
type upConfig struct {
	listen     string
	apiKey     string
	configPath string
	logFormat  string
	logLevel   string
	maxConns   int
	node       nodeConfig
	// e2bDefaultTemplate is what the E2B API's template "base" stands
	// for when no alias of that name exists.
	e2bDefaultTemplate string
	// idemTTL is --idempotency-ttl.
	idemTTL time.Duration
}

// defaultE2BTemplate is the default of --e2b-default-template: the Debian
// base that `make run` bootstraps (and the README's example builds). dsec
// up imports no base of its own; without this layer in the catalog, or an
// alias named base, an E2B create of the default template is not found,
// with a message that names the flag.
const defaultE2BTemplate = "base/debian:12"

// e2bDefaultTemplateHelp describes --e2b-default-template, the same for
// dsec up and dsec server.
const e2bDefaultTemplateHelp = "layer `REF` or template alias that the E2B API's template \"base\" (the E2B SDK's default) stands for when there is no alias named base (\"\" for none)"

func runUp(args []string) error {
	var c upConfig
	f := newCmdFlags("up", "[flags]", "Run a single-node dsec: apiserver + edge + embedded bbolt store + local\n"+
		"layer directory. Needs root (it mounts layers and runs containers).\n"+
		"Writes the endpoint and an admin API key to ~/.config/dsec/config.json.")
	f.StringVar(&c.listen, "listen", "127.0.0.1:7070", "address to serve the API on")
	f.StringVar(&c.node.stateDir, "state-dir", "/var/lib/dsec", "state directory (store, layers, sandboxes)")
	f.StringVar(&c.apiKey, "api-key", os.Getenv(dsec.EnvAPIKey), "admin API key to accept (default: $DSEC_API_KEY, else generated once)")
	f.StringVar(&c.node.nodeName, "node-name", "local", "this node's name (part of every sandbox id)")
	f.IntVar(&c.maxConns, "max-connections", 0, maxConnsHelp)
	f.StringVar(&c.e2bDefaultTemplate, "e2b-default-template", defaultE2BTemplate, e2bDefaultTemplateHelp)
	f.DurationVar(&c.idemTTL, "idempotency-ttl", apiserver.DefaultIdempotencyTTL, idemTTLHelp)
	c.node.register(f)
	f.StringVar(&c.configPath, "config", "", "client config file to write (default ~/.config/dsec/config.json or $DSEC_CONFIG)")
	f.StringVar(&c.logFormat, "log-format", "text", "log format: text or json")
	f.StringVar(&c.logLevel, "log-level", "info", "log level: debug, info, warn, error")
	if _, err := f.parseN(args, 0, 0); err != nil {
		return err
	}
	if err := c.node.check(); err != nil {
		return err
	}
	if err := checkMaxConns(c.maxConns); err != nil {
		return err
	}
	if err := checkIdemTTL(c.idemTTL); err != nil {
		return err
	}
	return daemon(c.logFormat, c.logLevel, func(ctx context.Context, log *slog.Logger) error { return up(ctx, c, log) })
}

// daemon runs fn with the logger the flags ask for and a context that
// SIGINT and SIGTERM end: the start of dsec up, server and edge.
func daemon(logFormat, logLevel string, fn func(context.Context, *slog.Logger) error) error {
	log, err := newLogger(logFormat, logLevel)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	return fn(ctx, log)
}

// serving is one HTTP server of a daemon and what runs it (Serve on its
// listener).
type serving struct {
	srv *http.Server
	run func() error
}

// serveUntilDone runs the servers until ctx ends, then logs stopping and
// gives them 10 s to finish what they serve; a server that fails first
// ends them all with its error.
func serveUntilDone(ctx context.Context, log *slog.Logger, stopping string, servers ...serving) error {
	errc := make(chan error, len(servers))
	for _, s := range servers {
		go func() { errc <- s.run() }()
	}
	var err error
	select {
	case <-ctx.Done():
		log.Info(stopping)
	case err = <-errc:
		err = fmt.Errorf("serving: %w", err)
	}
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, s := range servers {
		_ = s.srv.Shutdown(sctx)
	}
	return err
}

// maxConnsHelp describes --max-connections, the same for every daemon.
const maxConnsHelp = "most connections the API keeps open at once (0 = a quarter of the open-files limit, 64 to 16384); at most half may be connections that have not yet carried an authenticated request, and a new connection past that closes the oldest of those"

// idemTTLHelp describes --idempotency-ttl, the same for dsec up and dsec
// server.
const idemTTLHelp = "how long a keyed call's record answers its repeats (1m to 720h); each keyed create keeps about 1.5 KiB in the store that long, so a cluster's etcd holds about rate × TTL × 1.5 KiB of them"

// checkIdemTTL checks --idempotency-ttl.
func checkIdemTTL(d time.Duration) error {
	if d < time.Minute || d > 720*time.Hour {
		return fmt.Errorf("--idempotency-ttl %s: want 1m to 720h", d)
	}
	return nil
}

func checkMaxConns(n int) error {
	if n != 0 && n < 16 {
		return fmt.Errorf("--max-connections %d: want 0 (the default) or at least 16", n)
	}
	return nil
}

// openFilesLimit is the process's soft RLIMIT_NOFILE (1024 if unknown).
func openFilesLimit() uint64 {
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		return 1024
	}
	return lim.Cur
}

// limitConns wraps a daemon's listener in its connection limits
// (internal/conns): maxConns, or a share of the open-files limit, half of
// them for connections not yet authenticated; the default timeouts; and
// the listener's gauges on reg, labelled name.
func limitConns(ln net.Listener, maxConns int, name string, log *slog.Logger, reg prometheus.Registerer) *conns.Listener {
	nofile := openFilesLimit()
	if maxConns == 0 {
		maxConns = conns.DefaultMax(nofile)
	}
	l := conns.Listen(ln, conns.Config{
		Max: maxConns, MaxUntrusted: maxConns / 2, WriteStall: conns.DefaultWriteStall,
		ReadHeaderTimeout: conns.DefaultReadHeaderTimeout, IdleTimeout: conns.DefaultIdleTimeout,
	})
	if reg != nil {
		labels := prometheus.Labels{"listener": name}
		reg.MustRegister(
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "dsec_connections_open", Help: "Connections open on the listener (bounded by --max-connections).", ConstLabels: labels},
				func() float64 { open, _, _ := l.Stats(); return float64(open) }),
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "dsec_connections_untrusted", Help: "Open connections that have not carried an authenticated request (at most half of --max-connections).", ConstLabels: labels},
				func() float64 { _, untrusted, _ := l.Stats(); return float64(untrusted) }),
			prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "dsec_connections_evicted_total", Help: "Unauthenticated connections closed to make room for new ones.", ConstLabels: labels},
				func() float64 { _, _, evicted := l.Stats(); return float64(evicted) }),
		)
	}
	log.Info("connection limits", "listener", name, "max_connections", maxConns, "max_unauthenticated", maxConns/2, "open_files_limit", nofile)
	return l
}

func newLogger(format, level string) (*slog.Logger, error) {
	var lv slog.Level
	if err := lv.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("--log-level %q: want debug, info, warn or error", level)
	}
	opts := &slog.HandlerOptions{Level: lv}
	switch format {
	case "text":
		return slog.New(slog.NewTextHandler(os.Stderr, opts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(os.Stderr, opts)), nil
	}
	return nil, fmt.Errorf("--log-format %q: want text or json", format)
}

// node is a wired single-node platform.
type node struct {
	layers *layer.Store
	edge   *edge.Edge
	host   *host.Host
	server *apiserver.Server
	store  store.Store
	idem   store.Store
	// unlock lets go of the state dir (host.LockStateDir).
	unlock func()
}

func (n *node) Close() {
	n.edge.Close()
	n.host.Close()
	_ = n.layers.Close()
	_ = n.idem.Close()
	_ = n.store.Close()
	n.unlock()
}

// newNode wires store, IAM, layer store, host, edge and apiserver.
func newNode(ctx context.Context, c upConfig, log *slog.Logger, reg *prometheus.Registry) (*node, *iam.IAM, error) {
	if os.Geteuid() != 0 {
		return nil, nil, errors.New("dsec up needs root: it mounts EROFS layers and overlayfs and runs OCI containers")
	}
	// One dsec per state dir (which this makes): a second would manage
	// the same sandboxes.
	unlock, err := host.LockStateDir(c.node.stateDir)
	if err != nil {
		return nil, nil, err
	}
	st, err := store.OpenBolt(filepath.Join(c.node.stateDir, "dsec.db"))
	if err != nil {
		unlock()
		return nil, nil, err
	}
	var layers *layer.Store
	fail := func(err error) (*node, *iam.IAM, error) {
		if layers != nil {
			_ = layers.Close()
		}
		_ = st.Close()
		unlock()
		return nil, nil, err
	}
	ident, err := iam.New(st)
	if err != nil {
		return fail(fmt.Errorf("opening IAM: %w", err))
	}
	// Keys and projects from memory: the bbolt file tells of its writes.
	ident.Watch(ctx)
	if layers, err = layer.NewStore(filepath.Join(c.node.stateDir, "layers"), st, log); err != nil {
		return fail(fmt.Errorf("opening layer store: %w", err))
	}
	// Idempotency records are written twice per keyed call: they go to a
	// file of their own that is not fsynced (a crash of dsec up keeps
	// them; a crash of the host may lose the last ones).
	idem, err := store.OpenBoltNoSync(filepath.Join(c.node.stateDir, "idempotency.db"))
	if err != nil {
		return fail(err)
	}
	ed, h, err := startEdge(ctx, c.node, filepath.Join(c.node.stateDir, "edge"), layers, log, reg)
	if err != nil {
		_ = idem.Close()
		return fail(err)
	}
	// The watcher polls the in-process edge as it polls remote ones; its
	// first round runs now, so placement has a view before the first
	// request.
	view := watcher.New(watcher.Static{ed}, watcher.Config{Log: log})
	view.Sync(ctx)
	go view.Run(ctx)
	// The one node's backends are what this instance offers.
	policy := sandbox.DefaultPolicy()
	policy.Backends = []string{h.Backend.Name()}
	for _, b := range h.Others {
		policy.Backends = append(policy.Backends, b.Name())
	}
	srv := apiserver.New(apiserver.Deps{
		IAM: ident, Layers: layers, Nodes: view, Log: log,
		Registry: reg, Gatherer: reg, Policy: policy, MaxLayerBytes: 64 << 30,
		Store: idem, StateStore: st, Instance: cluster.NewInstance(), E2BDefaultTemplate: c.e2bDefaultTemplate,
		IdempotencyTTL: c.idemTTL,
	})
	go srv.Run(ctx)
	return &node{layers: layers, edge: ed, host: h, server: srv, store: st, idem: idem, unlock: unlock}, ident, nil
}

func up(ctx context.Context, c upConfig, log *slog.Logger) error {
	// Bind first: a taken port is reported before recovery touches anything.
	ln, err := net.Listen("tcp", c.listen)
	if err != nil {
		return fmt.Errorf("listening on %s: %w", c.listen, err)
	}
	defer ln.Close()
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	n, ident, err := newNode(ctx, c, log, reg)
	if err != nil {
		return err
	}
	defer n.Close()
	defer cleanupOnExit(c.node, n.edge, log)

	key, created, err := ident.EnsureAdminKey(c.apiKey)
	if err != nil {
		return fmt.Errorf("setting up the admin key: %w", err)
	}
	keyFile := filepath.Join(c.node.stateDir, "admin.key")
	switch {
	case created && c.apiKey == "":
		// Kept root-only in the state dir so the client config can be
		// rewritten after it is lost; only its hash is in the store.
		if err := os.WriteFile(keyFile, []byte(key+"\n"), 0o600); err != nil {
			return fmt.Errorf("saving admin key: %w", err)
		}
		log.Info("created admin API key", "key_file", keyFile)
	case c.apiKey != "":
		key = c.apiKey
	default:
		b, err := os.ReadFile(keyFile)
		if err == nil {
			key = strings.TrimSpace(string(b))
		} else {
			key = ""
			log.Warn("an admin key exists but its plaintext is not in the state dir; pass --api-key to write the client config", "key_file", keyFile)
		}
	}

	endpoint := "http://" + ln.Addr().String()
	if key != "" {
		cfgPath := c.configPath
		if cfgPath == "" {
			if cfgPath, err = dsec.DefaultConfigPath(); err != nil {
				return err
			}
		}
		if err := dsec.SaveConfig(cfgPath, dsec.Config{Endpoint: endpoint, APIKey: key}); err != nil {
			return err
		}
		log.Info("wrote client config", "path", cfgPath)
	}
	// Wrapped once the edge has raised the open-files limit the default
	// is a share of.
	lim := limitConns(ln, c.maxConns, "api", log, reg)
	hs := lim.Server(n.server.Handler())
	hs.ErrorLog = slog.NewLogLogger(log.Handler(), slog.LevelDebug)
	log.Info("dsec up: serving", "endpoint", endpoint)
	err = serveUntilDone(ctx, log, "shutting down; sandboxes keep running and are re-adopted on the next start",
		serving{hs, func() error { return hs.Serve(lim) }})
	n.server.Settle(5 * time.Second)
	return err
}
