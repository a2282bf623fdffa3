package main

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/dsecproject/dsec/internal/edge"
	"github.com/dsecproject/dsec/internal/edge/host"
	"github.com/dsecproject/dsec/internal/layer"
	"github.com/dsecproject/dsec/internal/layer/remote"
	"github.com/dsecproject/dsec/internal/netpolicy"
	"github.com/dsecproject/dsec/internal/sandbox"
)

// nodeConfig is what `dsec up` and `dsec edge` are told about the node.
type nodeConfig struct {
	// refusePoolOverlap: dsec edge stops on a sandbox address pool that
	// overlaps another running dsec's (host.Config.RefusePoolOverlap).
	refusePoolOverlap bool
	stateDir          string
	nodeName          string
	runtime           string
	maxSandboxes      int
	maxPaused         time.Duration
	snapLabels        kvFlag
	snapDepth         int
	network           string
	sandboxCIDR       string
	dnsUpstream       string
	dnsPrivate        string
	netPresets        string
	diskQuota         string
	usernsBase        uint
	usernsDef         bool
	poolMax           int
	poolMin           int
	cgroupPool        int
	dynMods           bool
	runtimeExec       bool
	launcher          string
	gvisor            string
	microvm           string
	netnsPool         int
	sharedMemMB       int64
	outputMB          int64
	minFreeMB         int64
	defDiskMB         int64
	reserveMB         int64
	reservePids       int64
	pidMax            int64
	cleanupExit       bool
	maxSessions       int
	maxStreams        int
	labels            map[string]string
	// sandboxDeny is --sandbox-deny; deny, what check made of it (and
	// dsec edge adds to).
	sandboxDeny  string
	deny         []netip.Prefix
	layerCacheMB int64
	// registryConfig is a docker config.json whose auths the node's reads
	// of registry-backed layers use.
	registryConfig string
}

// register defines the node flags on f (state dir and node name are the
// caller's: their defaults differ).
func (c *nodeConfig) register(f *cmdFlags) {
	f.StringVar(&c.runtime, "runtime", "auto", "OCI runtime: auto (crun, else runc), crun or runc")
	f.IntVar(&c.maxSandboxes, "max-sandboxes", 4096, "admission limit of live sandboxes on this node")
	f.DurationVar(&c.maxPaused, "max-paused", 0, "stop sandboxes paused longer than this (e.g. 24h; 0 = never)")
	c.snapLabels = kvFlag{}
	f.Var(c.snapLabels, "snapshot-label", "allow snapshots only of sandboxes with label `k=v` (repeatable; builder/runtime separation)")
	f.IntVar(&c.snapDepth, "snapshot-depth", edge.DefaultSnapshotDepth, "snapshot layers that may stack under a sandbox; a deeper snapshot merges the chain into one layer")
	f.StringVar(&c.network, "network", "auto", "sandbox egress: auto (on where nft and nftables work), on, or off (every sandbox loopback-only)")
	f.StringVar(&c.sandboxCIDR, "sandbox-cidr", netpolicy.DefaultPool.String(), "address pool of sandbox veths (a /30 each; two edges on one host need two pools)")
	f.StringVar(&c.dnsUpstream, "dns-upstream", "", "DNS servers (host:port, comma-separated) the edge's DNS proxy asks for permitted names (default: the host's /etc/resolv.conf)")
	f.StringVar(&c.dnsPrivate, "dns-admit-private", "", "private IPv4 ranges (comma-separated, inside 10/8, 172.16/12, 192.168/16 or 100.64/10) whose addresses an answer for a permitted name may admit, e.g. an internal mirror's network (default: none, only globally routable addresses; sandbox pools and the host's own addresses never)")
	f.StringVar(&c.sandboxDeny, "sandbox-deny", "", "IPv4 ranges (comma-separated) no sandbox on this node reaches, whatever its allow list: the control plane's networks (apiservers, load balancers, other nodes' internal API) and anything else off limits; an allow entry inside one is refused; dsec edge adds its --etcd endpoints' addresses itself")
	f.StringVar(&c.netPresets, "net-presets", "", "JSON file of network presets {\"name\": {\"domains\": [...], \"ports\": [\"443/tcp\"]}}, added to (and overriding) the built-in pypi, npm, github, debian, goproxy")
	f.StringVar(&c.diskQuota, "disk-quota", "auto", "how disk_mb is enforced: loop (a sparse ext4 disk per sandbox that asks for one), off (disk_mb refused), auto (loop where mkfs.ext4 and loop devices exist)")
	f.IntVar(&c.poolMax, "warm-pool-max", 8, "most ready sandboxes kept per environment class for fast creates and fncall (pools follow demand; 0 = no pools)")
	f.IntVar(&c.poolMin, "warm-pool-min", 0, "fewest ready sandboxes kept per environment class created in the last 5 minutes, whatever its demand (not above --warm-pool-max; each class then costs that many idle sandboxes)")
	f.IntVar(&c.cgroupPool, "cgroup-pool", 1024, "most emptied sandbox cgroups kept for reuse by the next sandboxes (creating and removing a cgroup costs more than resetting one; 0 = a new cgroup per sandbox)")
	f.BoolVar(&c.dynMods, "cgroup-favordynmods", true, "remount the cgroup tree with favordynmods so that moving a sandbox's processes into its cgroup does not wait for an RCU grace period (the setting outlives dsec; false leaves the host's mount as it is)")
	f.BoolVar(&c.runtimeExec, "runtime-exec", false, "enter sandboxes for exec and sessions through the OCI runtime's exec instead of dsec's own exec helper (docs/operating.md has the costs); builds without cgo always do")
	f.StringVar(&c.launcher, "launcher", "auto", "what starts sandboxes: dsec (its own launcher: the runtime's mounts, namespaces, cgroups and seccomp without a runtime process), runtime (the OCI runtime's run), or auto (dsec where it can: root, cgo, the exec helper; user-namespace sandboxes always use the runtime)")
	f.StringVar(&c.gvisor, "gvisor", "auto", "the gvisor backend (spec backend \"gvisor\": runsc, gVisor's user-space kernel): auto (offered where runsc is installed), on (fail without it) or off")
	f.StringVar(&c.microvm, "microvm", "auto", "the microvm backend (spec backend \"microvm\": a VM per sandbox under QEMU, software-emulated where /dev/kvm cannot boot ordinary guests): auto (offered where qemu-system-x86_64 and dsec-agent, beside dsec, are installed; the guest kernel is downloaded with apt-get once), on (fail without it) or off")
	f.IntVar(&c.netnsPool, "netns-pool", 1024, "fresh network namespaces dsec's launcher keeps ready (at most --max-sandboxes), made in the background once creates and deletes pause: a create joins one instead of making one (0 = none)")
	f.Int64Var(&c.sharedMemMB, "shared-memory-mb", 0, "memory limit of all memory_cgroup \"shared\" sandboxes together, in MiB (they have none each; past it the kernel's OOM killer picks among them); 0 = no limit")
	f.Int64Var(&c.outputMB, "output-buffer-mb", 0, "output that one-shot execs, session runs and fncalls may buffer on this node at once, in MiB: each call holds 2 × its max_output_bytes while it runs, and one that does not fit is refused with resource_exhausted before it starts (streamed execs hold none); 0 = an eighth of the host's memory, 256 MiB to 8 GiB")
	f.Int64Var(&c.defDiskMB, "default-disk-mb", 0, "disk_mb of a sandbox whose spec has none, in MiB (a disk of its own, as disk_mb makes: about 30 ms more per create here, docs/operating.md, Disk); 0 = none: such a sandbox writes to the state filesystem, which --min-free-disk-mb guards")
	f.Int64Var(&c.minFreeMB, "min-free-disk-mb", -1, "floor of free space on the state filesystem, in MiB: below it creates and file uploads are refused with resource_exhausted (a sandbox without disk_mb writes to that filesystem); -1 = 2% of it, 1 to 20 GiB; 0 = no floor")
	f.Int64Var(&c.reserveMB, "host-reserve-mb", -1, "memory the host keeps whatever sandboxes do, in MiB: the top dsec cgroup (every instance's sandboxes) is limited to the rest, so a sandbox without a memory limit is OOM-killed inside it rather than the host running out; -1 = the larger of 2 GiB and 1/16 of the host's memory; 0 = no limit")
	f.Int64Var(&c.pidMax, "pid-max", edge.DefaultPidMax, "raise kernel.pid_max to this at start if it is lower (a host setting that outlives dsec; the kernel's usual 32768 is eight default sandboxes); 0 leaves it as it is")
	f.Int64Var(&c.reservePids, "host-reserve-pids", -1, "pids the host keeps whatever sandboxes do: the top dsec cgroup is limited to kernel.pid_max less this; -1 = the larger of 4096 and 1/8 of kernel.pid_max; 0 = no limit")
	f.IntVar(&c.maxSessions, "max-sessions-total", 0, "sessions open on this node at once, across its sandboxes (each holds a shell and ~4 descriptors of the daemon's); past it an open is refused with resource_exhausted; 0 = a sixteenth of the open-files limit, 64 to 16384")
	f.IntVar(&c.maxStreams, "max-streams", 0, "commands (exec, streamed or not, and fncall) and port connections running on this node at once (each holds pipes or a socket of the daemon's); past it a call is refused with resource_exhausted before it starts; 0 = a sixteenth of the open-files limit, 64 to 16384")
	f.BoolVar(&c.cleanupExit, "cleanup-on-exit", false, "on shutdown, delete every sandbox of this node first, so that the daemon leaves nothing on the host (mounts, cgroups, veths, nft table, DNS address); without it sandboxes keep running and the next start adopts them")
	f.Int64Var(&c.layerCacheMB, "layer-cache-mb", defaultLayerCacheMB, "bound of this node's cache of chunks of registry-backed layers (dsec layer add), in MiB, shared by every sandbox on the node and kept across restarts; the images of --pull full layers no sandbox uses are kept within the same bound, separately")
	f.StringVar(&c.registryConfig, "registry-config", "", "docker config.json whose auths this node uses to read registry-backed layers (on demand and --pull full; credential helpers are not run); default: none, anonymous reads")
	f.UintVar(&c.usernsBase, "userns-base", 1_000_000_000, "first host uid/gid of dsec's for user-namespace sandboxes: a shared range of 65536 ids, 65536 owner uids (one per sandbox), then a range of 65536 ids per sandbox started by dsec's launcher, as many as fit below 2^32-1; 0 refuses userns")
	f.BoolVar(&c.usernsDef, "userns-default", true, "a container sandbox whose spec leaves userns out gets a user namespace where dsec's launcher starts it and the node can (see --userns-base); false: only those asking for one")
}

// check validates the node flags before anything is touched.
func (c *nodeConfig) check() error {
	if err := edge.CheckName(c.nodeName); err != nil {
		return fmt.Errorf("--node-name: %v", err)
	}
	switch c.launcher {
	case "auto", "dsec", "runtime":
	default:
		return fmt.Errorf("--launcher %q: want auto, dsec or runtime", c.launcher)
	}
	switch c.gvisor {
	case "auto", "on", "off":
	default:
		return fmt.Errorf("--gvisor %q: want auto, on or off", c.gvisor)
	}
	switch c.microvm {
	case "auto", "on", "off":
	default:
		return fmt.Errorf("--microvm %q: want auto, on or off", c.microvm)
	}
	if c.usernsBase > 1<<32-1-edge.UserNSReserved {
		return fmt.Errorf("--userns-base %d: too large (the %d ids from it must end below 2^32-1)", c.usernsBase, edge.UserNSReserved)
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
	if c.pidMax < 0 || c.pidMax > edge.DefaultPidMax {
		return fmt.Errorf("--pid-max %d: want 0 (leave kernel.pid_max alone) to %d", c.pidMax, edge.DefaultPidMax)
	}
	if c.reserveMB < -1 || c.reservePids < -1 {
		return fmt.Errorf("--host-reserve-mb %d, --host-reserve-pids %d: want -1 (the default), 0 (no limit) or more", c.reserveMB, c.reservePids)
	}
	if c.minFreeMB < -1 {
		return fmt.Errorf("--min-free-disk-mb %d: want -1 (2%% of the filesystem), 0 (no floor) or more", c.minFreeMB)
	}
	if c.outputMB < 0 || (c.outputMB > 0 && c.outputMB < 16) {
		return fmt.Errorf("--output-buffer-mb %d: want 0 (the default) or at least 16", c.outputMB)
	}
	if c.poolMax < 0 || c.poolMin < 0 || c.poolMin > c.poolMax {
		return fmt.Errorf("--warm-pool-min %d, --warm-pool-max %d: want 0 <= min <= max", c.poolMin, c.poolMax)
	}
	if c.maxSessions < 0 || c.maxStreams < 0 {
		return fmt.Errorf("--max-sessions-total %d, --max-streams %d: want 0 (the default) or more", c.maxSessions, c.maxStreams)
	}
	if c.cgroupPool < 0 {
		return fmt.Errorf("--cgroup-pool %d: want 0 or more", c.cgroupPool)
	}
	if c.snapDepth < 1 {
		return fmt.Errorf("--snapshot-depth %d: want at least 1", c.snapDepth)
	}
	if c.layerCacheMB < 1 {
		return fmt.Errorf("--layer-cache-mb %d: want at least 1", c.layerCacheMB)
	}
	if c.registryConfig != "" {
		abs, err := filepath.Abs(c.registryConfig)
		if err != nil {
			return fmt.Errorf("--registry-config: %w", err)
		}
		if fi, err := os.Stat(abs); err != nil || !fi.Mode().IsRegular() {
			return fmt.Errorf("--registry-config %s: want a docker config.json file (%v)", c.registryConfig, err)
		}
		c.registryConfig = abs // the layer daemon runs elsewhere
	}
	if c.maxSandboxes < 1 {
		return fmt.Errorf("--max-sandboxes %d: want at least 1", c.maxSandboxes)
	}
	for k, v := range c.labels {
		if err := sandbox.ValidateLabel(k, v); err != nil {
			return fmt.Errorf("--node-labels: %v", err)
		}
	}
	deny, err := netpolicy.ParsePrefixes(c.sandboxDeny)
	if err != nil {
		return fmt.Errorf("--sandbox-deny %v", err)
	}
	for _, p := range deny {
		if err := netpolicy.CheckDeny(p); err != nil {
			return fmt.Errorf("--sandbox-deny: %v", err)
		}
	}
	c.deny = deny
	return nil
}

// startEdge prepares the host and starts an edge on it with edgeDir as its
// state directory, taking layers from layers (which also builds its
// snapshots). On failure nothing of it is left running.
func startEdge(ctx context.Context, c nodeConfig, edgeDir string, layers *layer.Store, log *slog.Logger, reg prometheus.Registerer) (*edge.Edge, *host.Host, error) {
	h, err := host.Open(host.Config{
		StateDir: c.stateDir, NodeName: c.nodeName, MaxSandboxes: c.maxSandboxes,
		Runtime: c.runtime, Launcher: c.launcher, RuntimeExec: c.runtimeExec, DynMods: c.dynMods,
		CgroupPool: c.cgroupPool, NetnsPool: c.netnsPool,
		Network: c.network, SandboxCIDR: c.sandboxCIDR, DNSUpstream: c.dnsUpstream, NetPresets: c.netPresets,
		DNSAdmitPrivate: c.dnsPrivate, SandboxDeny: c.deny, RefusePoolOverlap: c.refusePoolOverlap,
		DiskQuota: c.diskQuota, GVisor: c.gvisor, MicroVM: c.microvm,
	}, log, reg)
	if err != nil {
		return nil, nil, err
	}
	// host.Open raised the open-files limit: the defaults are shares of
	// what it got.
	nofile := openFilesLimit()
	maxSessions, maxStreams := c.maxSessions, c.maxStreams
	if maxSessions == 0 {
		maxSessions = edge.DefaultMaxSessionsTotal(nofile)
	}
	if maxStreams == 0 {
		maxStreams = edge.DefaultMaxStreams(nofile)
	}
	blobs := layerSource(layers, edgeDir, c.layerCacheMB, c.registryConfig, h.Cgroups, h.CgroupParent, log)
	if err := reg.Register(remote.NewCollector(blobs)); err != nil {
		if h.Net != nil {
			h.Net.Close()
		}
		h.Close()
		return nil, nil, fmt.Errorf("registering layer metrics: %w", err)
	}
	ed, err := edge.New(edge.Config{
		Name: c.nodeName, StateDir: edgeDir, Labels: c.labels,
		MaxSandboxes: c.maxSandboxes, Policy: sandbox.DefaultPolicy(),
		CgroupParent: h.CgroupParent, MaxPaused: c.maxPaused,
		SnapshotLabels: c.snapLabels, MaxSnapshotDepth: c.snapDepth, DiskQuota: h.DiskQuota,
		UserNSBase: uint32(c.usernsBase), UserNSDefault: c.usernsDef, PoolMax: c.poolMax, PoolMin: c.poolMin, CgroupPool: c.cgroupPool, SharedMemoryMB: c.sharedMemMB,
		OutputBufferMB: c.outputMB, MinFreeDiskMB: c.minFreeMB, DefaultDiskMB: c.defDiskMB, BundleDir: h.BundleDir(),
		MaxSessionsTotal: maxSessions, MaxStreams: maxStreams,
		HostReserveMB: c.reserveMB, HostReservePids: c.reservePids, PidMax: c.pidMax,
	}, edge.Deps{
		Backend: h.Backend, Others: h.Others, Blobs: blobs, Cgroups: h.Cgroups, Log: log,
		Metrics: edge.NewMetrics(reg), Runtime: h.Runtime, Launcher: h.Backend.Launcher(), Layers: layers, Net: h.Net,
	})
	if err == nil {
		err = ed.Start(ctx)
	}
	if err != nil {
		// The edge closes the network when it closes; it never got that far.
		if h.Net != nil {
			h.Net.Close()
		}
		h.Close()
		return nil, nil, err
	}
	log.Info("edge ready", "node", c.nodeName, "runtime", h.Runtime, "state_dir", c.stateDir, "cgroup_parent", h.CgroupParent,
		"open_files_limit", nofile, "max_sessions_total", maxSessions, "max_streams", maxStreams)
	return ed, h, nil
}

// cleanupOnExit deletes every sandbox of ed when c asks for it, before the
// edge closes (which then removes what the instance put on the host).
func cleanupOnExit(c nodeConfig, ed *edge.Edge, log *slog.Logger) {
	if !c.cleanupExit {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	log.Info("deleting every sandbox before exiting (--cleanup-on-exit)")
	n, err := ed.DeleteAll(ctx)
	if err != nil {
		log.Warn("deleting sandboxes before exiting", "deleted", n, "err", err)
		return
	}
	log.Info("deleted every sandbox", "deleted", n)
}
