package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"
	"unsafe"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/apiserver"
	"github.com/dsecproject/dsec/internal/cgroup"
	"github.com/dsecproject/dsec/internal/edge"
	"github.com/dsecproject/dsec/internal/iam"
	"github.com/dsecproject/dsec/internal/layer"
	"github.com/dsecproject/dsec/internal/netpolicy"
	"github.com/dsecproject/dsec/internal/sandbox"
	"github.com/dsecproject/dsec/internal/sandbox/container"
	"github.com/dsecproject/dsec/internal/store"
	"github.com/dsecproject/dsec/internal/watcher"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

// upConfig is everything `dsec up` can be told.
type upConfig struct {
	listen       string
	stateDir     string
	apiKey       string
	runtime      string
	nodeName     string
	maxSandboxes int
	maxPaused    time.Duration
	snapLabels   kvFlag
	snapDepth    int
	configPath   string
	logFormat    string
	logLevel     string
	network      string
	sandboxCIDR  string
	dnsUpstream  string
	netPresets   string
	diskQuota    string
	usernsBase   uint
	poolMax      int
	poolMin      int
	cgroupPool   int
	dynMods      bool
	runtimeExec  bool
	launcher     string
	netnsPool    int
	sharedMemMB  int64
}

func runUp(args []string) error {
	var c upConfig
	f := newCmdFlags("up", "[flags]", "Run a single-node dsec: apiserver + edge + embedded bbolt store + local\n"+
		"layer directory. Needs root (it mounts layers and runs containers).\n"+
		"Writes the endpoint and an admin API key to ~/.config/dsec/config.json.")
	f.StringVar(&c.listen, "listen", "127.0.0.1:7070", "address to serve the API on")
	f.StringVar(&c.stateDir, "state-dir", "/var/lib/dsec", "state directory (store, layers, sandboxes)")
	f.StringVar(&c.apiKey, "api-key", os.Getenv(dsec.EnvAPIKey), "admin API key to accept (default: $DSEC_API_KEY, else generated once)")
	f.StringVar(&c.runtime, "runtime", "auto", "OCI runtime: auto (crun, else runc), crun or runc")
	f.StringVar(&c.nodeName, "node-name", "local", "this node's name (part of every sandbox id)")
	f.IntVar(&c.maxSandboxes, "max-sandboxes", 4096, "admission limit of live sandboxes on this node")
	f.DurationVar(&c.maxPaused, "max-paused", 0, "stop sandboxes paused longer than this (e.g. 24h; 0 = never)")
	c.snapLabels = kvFlag{}
	f.Var(c.snapLabels, "snapshot-label", "allow snapshots only of sandboxes with label `k=v` (repeatable; builder/runtime separation)")
	f.IntVar(&c.snapDepth, "snapshot-depth", edge.DefaultSnapshotDepth, "snapshot layers that may stack under a sandbox; a deeper snapshot merges the chain into one layer")
	f.StringVar(&c.configPath, "config", "", "client config file to write (default ~/.config/dsec/config.json or $DSEC_CONFIG)")
	f.StringVar(&c.network, "network", "auto", "sandbox egress: auto (on where nft and nftables work), on, or off (every sandbox loopback-only)")
	f.StringVar(&c.sandboxCIDR, "sandbox-cidr", netpolicy.DefaultPool.String(), "address pool of sandbox veths (a /30 each; two edges on one host need two pools)")
	f.StringVar(&c.dnsUpstream, "dns-upstream", "", "DNS servers (host:port, comma-separated) the edge's DNS proxy asks for permitted names (default: the host's /etc/resolv.conf)")
	f.StringVar(&c.netPresets, "net-presets", "", "JSON file of network presets {\"name\": {\"domains\": [...], \"ports\": [\"443/tcp\"]}}, added to (and overriding) the built-in pypi, npm, github, debian, goproxy")
	f.StringVar(&c.diskQuota, "disk-quota", "auto", "how disk_mb is enforced: loop (a sparse ext4 disk per sandbox that asks for one), off (disk_mb refused), auto (loop where mkfs.ext4 and loop devices exist)")
	f.IntVar(&c.poolMax, "warm-pool-max", 8, "most ready sandboxes kept per environment class for fast creates and fncall (pools follow demand; 0 = no pools)")
	f.IntVar(&c.poolMin, "warm-pool-min", 0, "fewest ready sandboxes kept per environment class created in the last 5 minutes, whatever its demand (not above --warm-pool-max; each class then costs that many idle sandboxes)")
	f.IntVar(&c.cgroupPool, "cgroup-pool", 1024, "most emptied sandbox cgroups kept for reuse by the next sandboxes (creating and removing a cgroup costs more than resetting one; 0 = a new cgroup per sandbox)")
	f.BoolVar(&c.dynMods, "cgroup-favordynmods", true, "remount the cgroup tree with favordynmods so that moving a sandbox's processes into its cgroup does not wait for an RCU grace period (the setting outlives dsec; false leaves the host's mount as it is)")
	f.BoolVar(&c.runtimeExec, "runtime-exec", false, "enter sandboxes for exec and sessions through the OCI runtime's exec (~9 ms each) instead of dsec's own exec helper (~1 ms); builds without cgo always do")
	f.StringVar(&c.launcher, "launcher", "auto", "what starts sandboxes: dsec (its own launcher: the runtime's mounts, namespaces, cgroups and seccomp without a runtime process, ~2x cheaper per create), runtime (the OCI runtime's run), or auto (dsec where it can: root, cgo, the exec helper; user-namespace sandboxes always use the runtime)")
	f.IntVar(&c.netnsPool, "netns-pool", 1024, "fresh network namespaces dsec's launcher keeps ready (at most --max-sandboxes), made in the background once creates and deletes pause: a create joins one instead of making one (~1 ms of CPU each; ~150-190 KiB of kernel memory each while waiting; 0 = none)")
	f.Int64Var(&c.sharedMemMB, "shared-memory-mb", 0, "memory limit of all memory_cgroup \"shared\" sandboxes together, in MiB (they have none each; past it the kernel's OOM killer picks among them); 0 = no limit")
	f.UintVar(&c.usernsBase, "userns-base", 1_000_000_000, "first host uid/gid of user-namespace sandboxes (spec userns: true), which get 65536 ids from it; 0 refuses userns")
	f.StringVar(&c.logFormat, "log-format", "text", "log format: text or json")
	f.StringVar(&c.logLevel, "log-level", "info", "log level: debug, info, warn, error")
	if _, err := f.parseN(args, 0, 0); err != nil {
		return err
	}
	switch c.launcher {
	case "auto", "dsec", "runtime":
	default:
		return fmt.Errorf("--launcher %q: want auto, dsec or runtime", c.launcher)
	}
	if c.usernsBase > 1<<32-1-edge.UserNSSize {
		return fmt.Errorf("--userns-base %d: too large (the range must end below 2^32-1)", c.usernsBase)
	}
	if c.usernsBase != 0 && c.usernsBase < 1<<16 {
		return fmt.Errorf("--userns-base %d: must be 65536 or more, clear of the host's own users", c.usernsBase)
	}
	if c.netnsPool < 0 || c.netnsPool > 1<<16 {
		return fmt.Errorf("--netns-pool %d: want 0 to 65536", c.netnsPool)
	}
	if c.sharedMemMB < 0 || (c.sharedMemMB > 0 && c.sharedMemMB < 64) {
		return fmt.Errorf("--shared-memory-mb %d: want 0 (no limit) or at least 64", c.sharedMemMB)
	}
	if c.poolMax < 0 || c.poolMin < 0 || c.poolMin > c.poolMax {
		return fmt.Errorf("--warm-pool-min %d, --warm-pool-max %d: want 0 <= min <= max", c.poolMin, c.poolMax)
	}
	if c.cgroupPool < 0 {
		return fmt.Errorf("--cgroup-pool %d: want 0 or more", c.cgroupPool)
	}
	if c.snapDepth < 1 {
		return fmt.Errorf("--snapshot-depth %d: want at least 1", c.snapDepth)
	}
	log, err := newLogger(c.logFormat, c.logLevel)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	return up(ctx, c, log)
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
	layers  *layer.Store
	edge    *edge.Edge
	backend *container.Container
	server  *apiserver.Server
	store   store.Store
	runtime string
	// runDir is <state>/runtime, on a tmpfs when runDirTmpfs (rundir.go).
	runDir      string
	runDirTmpfs bool
	log         *slog.Logger
}

func (n *node) Close() {
	n.edge.Close()
	n.backend.Close()
	if n.runDirTmpfs {
		unmountRunDir(n.runDir, filepath.Join(n.runDir, n.runtime), n.log)
	}
	_ = n.store.Close()
}

// chooseRuntime picks crun where it can run (preparing a hybrid cgroup host
// for it, which is logged), runc otherwise.
func chooseRuntime(want string, cg *cgroup.Info, log *slog.Logger) (string, error) {
	has := func(b string) bool { _, err := exec.LookPath(b); return err == nil }
	switch want {
	case "runc":
		if !has("runc") {
			return "", errors.New("runtime runc not found (apt-get install runc)")
		}
		return "runc", nil
	case "crun", "auto":
	default:
		return "", fmt.Errorf("--runtime %q: want auto, crun or runc", want)
	}
	if !has("crun") {
		if want == "crun" || !has("runc") {
			return "", errors.New("no OCI runtime found (apt-get install crun runc)")
		}
		log.Info("crun not installed; using runc")
		return "runc", nil
	}
	ok, why := cg.CrunCompatible()
	if !ok {
		log.Warn("crun cannot run on this cgroup layout as is; preparing the host", "reason", why)
		actions, err := cg.PrepareForCrun()
		for _, a := range actions {
			log.Warn("host preparation for crun", "action", a)
		}
		if err != nil {
			if want == "crun" || !has("runc") {
				return "", fmt.Errorf("preparing cgroups for crun: %w", err)
			}
			log.Warn("falling back to runc", "err", err)
			return "runc", nil
		}
		if ok, why = cg.CrunCompatible(); !ok {
			if want == "crun" || !has("runc") {
				return "", fmt.Errorf("crun still cannot run after host preparation: %s", why)
			}
			log.Warn("falling back to runc", "reason", why)
			return "runc", nil
		}
	}
	return "crun", nil
}

// newNode wires store, IAM, layer store, backend, edge and apiserver.
func newNode(ctx context.Context, c upConfig, log *slog.Logger, reg *prometheus.Registry) (*node, *iam.IAM, error) {
	if os.Geteuid() != 0 {
		return nil, nil, errors.New("dsec up needs root: it mounts EROFS layers and overlayfs and runs OCI containers")
	}
	raiseNoFile(log)
	logCoreScheduling(log)
	if err := os.MkdirAll(c.stateDir, 0o700); err != nil {
		return nil, nil, fmt.Errorf("creating state dir: %w", err)
	}
	cg, err := cgroup.Detect()
	if err != nil {
		return nil, nil, fmt.Errorf("probing cgroups: %w", err)
	}
	log.Info("cgroups", "mode", cg.Mode.String(), "v2_controllers", strings.Join(cg.UnifiedControllers, ","))
	if c.dynMods {
		switch changed, err := cg.FavorDynMods(); {
		case err != nil:
			log.Warn("could not turn on cgroup favordynmods; creates and execs wait for RCU grace periods", "err", err)
		case changed:
			log.Info("remounted the cgroup tree with favordynmods (cgroup migrations no longer wait for RCU; it stays after dsec exits)")
		}
	}
	rt, err := chooseRuntime(c.runtime, cg, log)
	if err != nil {
		return nil, nil, err
	}
	st, err := store.OpenBolt(filepath.Join(c.stateDir, "dsec.db"))
	if err != nil {
		return nil, nil, err
	}
	fail := func(err error) (*node, *iam.IAM, error) {
		_ = st.Close()
		return nil, nil, err
	}
	ident, err := iam.New(st)
	if err != nil {
		return fail(fmt.Errorf("opening IAM: %w", err))
	}
	layers, err := layer.NewStore(filepath.Join(c.stateDir, "layers"), st, log)
	if err != nil {
		return fail(fmt.Errorf("opening layer store: %w", err))
	}
	runDir := filepath.Join(c.stateDir, "runtime")
	runDirTmpfs, err := mountRunDir(runDir, runDirSize(c.maxSandboxes), log)
	if err != nil {
		return fail(err)
	}
	if runDirTmpfs {
		fail = func(err error) (*node, *iam.IAM, error) {
			unmountRunDir(runDir, filepath.Join(runDir, rt), log)
			_ = st.Close()
			return nil, nil, err
		}
	}
	backend, err := container.New(container.Config{
		Runtime:     rt,
		StateRoot:   filepath.Join(runDir, rt),
		PinPath:     filepath.Join(c.stateDir, "bin", rt),
		MaskDir:     filepath.Join(c.stateDir, "mask"),
		CgroupNS:    cg.Mode == cgroup.V2,
		Cgroups:     cg,
		KeepCgroups: c.cgroupPool > 0,
		RuntimeExec: c.runtimeExec,
		Native:      c.launcher != "runtime",
		NetnsPool:   min(c.netnsPool, c.maxSandboxes),
		Log:         log,
	})
	if err != nil {
		return fail(err)
	}
	fail = func(err error) (*node, *iam.IAM, error) {
		backend.Close()
		if runDirTmpfs {
			unmountRunDir(runDir, filepath.Join(runDir, rt), log)
		}
		_ = st.Close()
		return nil, nil, err
	}
	log.Info("exec path", "via", backend.ExecPath())
	switch launcher, why := backend.LauncherWhy(); {
	case launcher == "dsec":
		log.Info("sandbox launcher", "via", launcher, "netns_pool", min(c.netnsPool, c.maxSandboxes))
		reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "dsec_netns_pool_free",
			Help: "Fresh network namespaces ready for dsec's launcher (--netns-pool).",
		}, func() float64 {
			free, _ := backend.NetnsPool()
			return float64(free)
		}))
		if err := backend.SharedSysfsErr(); err != nil {
			log.Warn("no shared sysfs: every sandbox mounts a sysfs of its own (one more superblock each)", "err", err)
		}
	case c.launcher == "dsec":
		return fail(fmt.Errorf("--launcher dsec: dsec's launcher cannot run here: %s", why))
	default:
		log.Info("sandbox launcher", "via", launcher, "not_dsec_because", why)
	}
	if pinned, err := backend.Pinned(); !pinned {
		log.Warn("runtime binary not pinned read-only; the runtime clones itself on every call (~3-5 ms)", "err", err)
	}
	policy := sandbox.DefaultPolicy()
	netm, err := newNetwork(c, log)
	if err != nil {
		return fail(err)
	}
	disk, err := diskQuotaMode(c.diskQuota, log)
	if err != nil {
		return fail(err)
	}
	ed, err := edge.New(edge.Config{
		Name: c.nodeName, StateDir: filepath.Join(c.stateDir, "edge"),
		MaxSandboxes: c.maxSandboxes, Policy: policy,
		CgroupParent: cgroupParent(c.nodeName, c.stateDir), MaxPaused: c.maxPaused,
		SnapshotLabels: c.snapLabels, MaxSnapshotDepth: c.snapDepth, DiskQuota: disk,
		UserNSBase: uint32(c.usernsBase), PoolMax: c.poolMax, PoolMin: c.poolMin, CgroupPool: c.cgroupPool, SharedMemoryMB: c.sharedMemMB,
		BundleDir: filepath.Join(runDir, "bundles"),
	}, edge.Deps{
		Backend: backend, BlobPath: layers.BlobPath, Cgroups: cg, Log: log,
		Metrics: edge.NewMetrics(reg), Runtime: rt, Launcher: backend.Launcher(), Layers: layers, Net: netm,
	})
	if err != nil {
		return fail(err)
	}
	if err := ed.Start(ctx); err != nil {
		return fail(err)
	}
	// The watcher polls the in-process edge as it polls remote ones; its
	// first round runs now, so placement has a view before the first
	// request.
	view := watcher.New(watcher.Static{ed}, watcher.Config{Log: log})
	view.Sync(ctx)
	go view.Run(ctx)
	srv := apiserver.New(apiserver.Deps{
		IAM: ident, Layers: layers, Nodes: view, Log: log,
		Registry: reg, Gatherer: reg, Policy: policy, MaxLayerBytes: 64 << 30,
	})
	log.Info("edge ready", "node", c.nodeName, "runtime", rt, "state_dir", c.stateDir,
		"cgroup_parent", cgroupParent(c.nodeName, c.stateDir))
	return &node{layers: layers, edge: ed, backend: backend, server: srv, store: st, runtime: rt,
		runDir: runDir, runDirTmpfs: runDirTmpfs, log: log}, ident, nil
}

// cgroupParent names this instance's parent cgroup. It is unique per state
// dir, because recovery reaps every child of the parent that is not one of
// its own sandboxes: two daemons on one host (tests, several edges) must
// never share one.
func cgroupParent(node, stateDir string) string {
	abs, err := filepath.Abs(stateDir)
	if err != nil {
		abs = stateDir
	}
	sum := sha256.Sum256([]byte(abs))
	return "/dsec/" + node + "-" + hex.EncodeToString(sum[:4])
}

// newNetwork sets up sandbox egress, or returns nil (loopback-only
// sandboxes) when it is off or, in auto mode, unavailable.
func newNetwork(c upConfig, log *slog.Logger) (*netpolicy.Manager, error) {
	switch c.network {
	case "off":
		log.Info("sandbox networking off: every sandbox is loopback-only")
		return nil, nil
	case "auto", "on":
	default:
		return nil, fmt.Errorf("--network %q: want auto, on or off", c.network)
	}
	if _, err := exec.LookPath("nft"); err != nil {
		if c.network == "on" {
			return nil, errors.New("--network on: nft not found (apt-get install nftables)")
		}
		log.Warn("sandbox networking unavailable: nft not found (apt-get install nftables); sandboxes are loopback-only")
		return nil, nil
	}
	pool, err := netip.ParsePrefix(c.sandboxCIDR)
	if err != nil {
		return nil, fmt.Errorf("--sandbox-cidr %q: %w", c.sandboxCIDR, err)
	}
	presets := netpolicy.DefaultPresets()
	if c.netPresets != "" {
		b, err := os.ReadFile(c.netPresets)
		if err != nil {
			return nil, fmt.Errorf("--net-presets: %w", err)
		}
		var extra map[string]netpolicy.Preset
		if err := json.Unmarshal(b, &extra); err != nil {
			return nil, fmt.Errorf("--net-presets %s: %w", c.netPresets, err)
		}
		maps.Copy(presets, extra)
	}
	var ups []string
	if c.dnsUpstream != "" {
		for _, u := range strings.Split(c.dnsUpstream, ",") {
			u = strings.TrimSpace(u)
			if _, _, err := net.SplitHostPort(u); err != nil {
				u = net.JoinHostPort(u, "53")
			}
			ups = append(ups, u)
		}
	} else {
		ups = netpolicy.UpstreamsFromResolvConf("/etc/resolv.conf")
	}
	m, err := netpolicy.New(netpolicy.Config{
		Instance: instanceID(c.stateDir), Pool: pool, Upstreams: ups, Presets: presets, Log: log,
	})
	if err != nil {
		return nil, err
	}
	return m, nil
}

// diskQuotaMode resolves --disk-quota.
func diskQuotaMode(want string, log *slog.Logger) (string, error) {
	_, mkfsErr := exec.LookPath("mkfs.ext4")
	_, loopErr := os.Stat("/dev/loop-control")
	switch want {
	case "off":
		return edge.DiskOff, nil
	case "loop", "auto":
		if mkfsErr == nil && loopErr == nil {
			return edge.DiskLoop, nil
		}
		why := "mkfs.ext4 not found (apt-get install e2fsprogs)"
		if loopErr != nil {
			why = "no /dev/loop-control (modprobe loop)"
		}
		if want == "loop" {
			return "", fmt.Errorf("--disk-quota loop: %s", why)
		}
		log.Warn("disk_mb unavailable: "+why+"; sandboxes asking for it are refused", "disk_quota", "off")
		return edge.DiskOff, nil
	}
	return "", fmt.Errorf("--disk-quota %q: want auto, loop or off", want)
}

// instanceID tells this instance's host-wide objects (nftables table, veth
// names) from another instance's: derived from the state dir, like the
// cgroup parent.
func instanceID(stateDir string) string {
	abs, err := filepath.Abs(stateDir)
	if err != nil {
		abs = stateDir
	}
	sum := sha256.Sum256([]byte(abs))
	return hex.EncodeToString(sum[:3])[:5]
}

// logCoreScheduling says whether LS sandboxes could get core scheduling
// (SMT siblings never shared with another sandbox). dsec does not apply it
// yet; on a kernel without CONFIG_SCHED_CORE there is nothing to apply.
func logCoreScheduling(log *slog.Logger) {
	var cookie uint64
	// PR_SCHED_CORE_GET on ourselves: EINVAL when the kernel lacks it.
	err := unix.Prctl(unix.PR_SCHED_CORE, unix.PR_SCHED_CORE_GET, 0, 0 /* PIDTYPE_PID */, uintptr(unsafe.Pointer(&cookie)))
	if err != nil {
		log.Info("core scheduling unavailable on this kernel (CONFIG_SCHED_CORE); qos ls sandboxes may share SMT siblings with be ones", "err", err)
		return
	}
	log.Info("core scheduling available but not applied by this release")
}

// raiseNoFile lifts the soft open-files limit to the hard one: the edge
// holds pipes and fds for many sandboxes at once.
func raiseNoFile(log *slog.Logger) {
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		return
	}
	want := lim
	if b, err := os.ReadFile("/proc/sys/fs/nr_open"); err == nil {
		var n uint64
		if _, err := fmt.Sscan(string(b), &n); err == nil && n > want.Max {
			want.Max = n
		}
	}
	want.Cur = want.Max
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &want); err != nil {
		want.Max = lim.Max
		want.Cur = lim.Max
		_ = unix.Setrlimit(unix.RLIMIT_NOFILE, &want)
	}
	log.Debug("open files limit", "limit", want.Cur)
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

	key, created, err := ident.EnsureAdminKey(c.apiKey)
	if err != nil {
		return fmt.Errorf("setting up the admin key: %w", err)
	}
	keyFile := filepath.Join(c.stateDir, "admin.key")
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
	hs := &http.Server{Handler: n.server.Handler(), ReadHeaderTimeout: 10 * time.Second}
	errc := make(chan error, 1)
	go func() { errc <- hs.Serve(ln) }()
	log.Info("dsec up: serving", "endpoint", endpoint)
	select {
	case <-ctx.Done():
		log.Info("shutting down; sandboxes keep running and are re-adopted on the next start")
	case err := <-errc:
		return fmt.Errorf("serving: %w", err)
	}
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_ = hs.Shutdown(sctx)
	return nil
}
