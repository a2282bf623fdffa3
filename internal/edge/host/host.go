// Package host prepares a machine to run sandboxes and returns what the
// edge needs of it: it probes cgroups (and prepares a hybrid host for
// crun), picks the OCI runtime, starts the container backend (dsec's
// launcher or the runtime's), sets up sandbox networking and the disk
// quota mode, and keeps the runtime's state on a tmpfs. `dsec up` and
// `dsec edge` both call it; an apiserver never does.
package host

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
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
	"unsafe"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/cgroup"
	"github.com/dsecproject/dsec/internal/edge"
	"github.com/dsecproject/dsec/internal/netpolicy"
	"github.com/dsecproject/dsec/internal/sandbox"
	"github.com/dsecproject/dsec/internal/sandbox/container"
	"github.com/dsecproject/dsec/internal/sandbox/gvisor"
	"github.com/dsecproject/dsec/internal/sandbox/microvm"
)

// Config is what the operator says about the host (the node flags of
// dsec up and dsec edge).
type Config struct {
	// StateDir holds the runtime's state, the pinned runtime binary and
	// mask files; NodeName names the instance's cgroups.
	StateDir, NodeName string
	MaxSandboxes       int
	// Runtime is auto, crun or runc; Launcher auto, dsec or runtime.
	Runtime, Launcher string
	RuntimeExec       bool
	DynMods           bool
	CgroupPool        int
	NetnsPool         int
	// Network is auto, on or off; SandboxCIDR the veth address pool;
	// DNSUpstream comma-separated servers; NetPresets a JSON file;
	// DNSAdmitPrivate comma-separated private prefixes DNS answers may
	// admit.
	Network, SandboxCIDR, DNSUpstream, NetPresets, DNSAdmitPrivate string
	// SandboxDeny are ranges no sandbox reaches, whatever its policy
	// (netpolicy.Config.Deny).
	SandboxDeny []netip.Prefix
	// RefusePoolOverlap: a sandbox address pool that overlaps the pool
	// of another running dsec on this host stops Open (dsec edge); else
	// it is a warning (dsec up, of which several may run without ever
	// needing a route out).
	RefusePoolOverlap bool
	// DiskQuota is auto, loop or off.
	DiskQuota string
	// GVisor is auto (offer the gvisor backend where runsc is
	// installed), on (fail without it) or off.
	GVisor string
	// MicroVM is auto (offer the microvm backend where QEMU and the guest
	// agent are installed and the guest kernel can be had), on (fail
	// without it) or off.
	MicroVM string
}

// Host is a prepared machine.
type Host struct {
	Cgroups *cgroup.Info
	// Runtime is the OCI runtime chosen (crun or runc).
	Runtime string
	Backend *container.Container
	// Others are the node's other backends (gvisor where it runs).
	Others []sandbox.Backend
	// Net runs sandbox networking; nil when it is off.
	Net *netpolicy.Manager
	// DiskQuota is edge.DiskLoop or edge.DiskOff.
	DiskQuota string
	// RunDir is <state>/runtime (on a tmpfs when runDirTmpfs).
	RunDir       string
	CgroupParent string
	runDirTmpfs  bool
	log          *slog.Logger
}

// Open prepares the host. It needs root. On failure it leaves nothing of
// its own behind (the host preparations it logs stay: they are the
// host's settings, such as a cgroup remount).
func Open(c Config, log *slog.Logger, reg prometheus.Registerer) (*Host, error) {
	if os.Geteuid() != 0 {
		return nil, errors.New("needs root: it mounts EROFS layers and overlayfs and runs OCI containers")
	}
	switch c.Launcher {
	case "auto", "dsec", "runtime":
	default:
		return nil, fmt.Errorf("--launcher %q: want auto, dsec or runtime", c.Launcher)
	}
	switch c.GVisor {
	case "", "auto", "on", "off":
	default:
		return nil, fmt.Errorf("--gvisor %q: want auto, on or off", c.GVisor)
	}
	switch c.MicroVM {
	case "", "auto", "on", "off":
	default:
		return nil, fmt.Errorf("--microvm %q: want auto, on or off", c.MicroVM)
	}
	raiseNoFile(log)
	shieldFromOOM(log)
	logCoreScheduling(log)
	if err := os.MkdirAll(c.StateDir, 0o700); err != nil {
		return nil, fmt.Errorf("creating state dir: %w", err)
	}
	cg, err := cgroup.Detect()
	if err != nil {
		return nil, fmt.Errorf("probing cgroups: %w", err)
	}
	log.Info("cgroups", "mode", cg.Mode.String(), "v2_controllers", strings.Join(cg.UnifiedControllers, ","))
	if c.DynMods {
		switch changed, err := cg.FavorDynMods(); {
		case err != nil:
			log.Warn("could not turn on cgroup favordynmods; creates and execs wait for RCU grace periods", "err", err)
		case changed:
			log.Info("remounted the cgroup tree with favordynmods (cgroup migrations no longer wait for RCU; it stays after dsec exits)")
		}
	}
	rt, err := chooseRuntime(c.Runtime, cg, log)
	if err != nil {
		return nil, err
	}
	h := &Host{Cgroups: cg, Runtime: rt, RunDir: filepath.Join(c.StateDir, "runtime"),
		CgroupParent: CgroupParent(c.NodeName, c.StateDir), log: log}
	h.runDirTmpfs, err = mountRunDir(h.RunDir, runDirSize(c.MaxSandboxes), log)
	if err != nil {
		return nil, err
	}
	ok := false
	defer func() {
		if !ok {
			h.Close()
		}
	}()
	// CgroupNS on every layout, v1 and hybrid too: the kernel roots each
	// hierarchy, v1 ones included, at the cgroup the process is in when
	// it unshares, and the launcher (launch.c), runc and crun all unshare
	// after joining the sandbox's cgroups. Without it /proc/self/cgroup
	// shows the host's cgroup paths on v1 and hybrid hosts.
	h.Backend, err = container.New(container.Config{
		Runtime:     rt,
		StateRoot:   filepath.Join(h.RunDir, rt),
		PinPath:     filepath.Join(c.StateDir, "bin", rt),
		MaskDir:     filepath.Join(c.StateDir, "mask"),
		CgroupNS:    true,
		Cgroups:     cg,
		KeepCgroups: c.CgroupPool > 0,
		RuntimeExec: c.RuntimeExec,
		Native:      c.Launcher != "runtime",
		NetnsPool:   min(c.NetnsPool, c.MaxSandboxes),
		Log:         log,
	})
	if err != nil {
		return nil, err
	}
	log.Info("exec path", "via", h.Backend.ExecPath())
	switch launcher, why := h.Backend.LauncherWhy(); {
	case launcher == "dsec":
		log.Info("sandbox launcher", "via", launcher, "netns_pool", min(c.NetnsPool, c.MaxSandboxes))
		if reg != nil {
			b := h.Backend
			reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
				Name: "dsec_netns_pool_free",
				Help: "Fresh network namespaces ready for dsec's launcher (--netns-pool).",
			}, func() float64 {
				free, _ := b.NetnsPool()
				return float64(free)
			}))
		}
		if err := h.Backend.SharedSysfsErr(); err != nil {
			log.Warn("no shared sysfs: every sandbox mounts a sysfs of its own (one more superblock each)", "err", err)
		}
	case c.Launcher == "dsec":
		return nil, fmt.Errorf("--launcher dsec: dsec's launcher cannot run here: %s", why)
	default:
		log.Info("sandbox launcher", "via", launcher, "not_dsec_because", why)
	}
	if pinned, err := h.Backend.Pinned(); !pinned {
		log.Warn("runtime binary not pinned read-only; the runtime clones itself on every call (~3-5 ms)", "err", err)
	}
	if c.GVisor != "off" {
		// Its state is on disk, not on the run dir's tmpfs: Close
		// unmounts that when the container runtime keeps nothing there.
		g, err := gvisor.New(gvisor.Config{StateRoot: filepath.Join(c.StateDir, "runsc"), Cgroups: cg, Log: log})
		switch {
		case err == nil:
			h.Others = append(h.Others, g)
			log.Info("backend gvisor", "runsc", g.Version())
		case c.GVisor == "on":
			return nil, fmt.Errorf("--gvisor on: %w", err)
		default:
			log.Info("no gvisor backend", "reason", err)
		}
	}
	if c.MicroVM != "off" {
		// Bounded: the first start on a host downloads the guest kernel.
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
		m, err := microvm.New(ctx, microvm.Config{
			StateRoot: filepath.Join(c.StateDir, "microvm"), KernelCache: MicroVMKernelCache,
			Agent: agentPath(), Cgroups: cg, Log: log,
		})
		cancel()
		switch {
		case err == nil:
			h.Others = append(h.Others, m)
			log.Info("backend microvm", "vmm", m.VMM(), "guest_kernel", m.Guest().KernelPackage)
		case c.MicroVM == "on":
			return nil, fmt.Errorf("--microvm on: %w", err)
		default:
			log.Info("no microvm backend", "reason", err)
		}
	}
	// The probe first: networking, once up, is the edge's to close.
	if h.DiskQuota, err = diskQuotaMode(c.DiskQuota, log); err != nil {
		return nil, err
	}
	if h.Net, err = newNetwork(c, log); err != nil {
		return nil, err
	}
	ok = true
	return h, nil
}

// MicroVMKernelCache is where the microvm backend keeps the guest kernel
// package it downloads (once per host).
const MicroVMKernelCache = "/var/cache/dsec/microvm"

// agentPath is the guest agent beside the running binary (make build puts
// bin/dsec-agent beside bin/dsec).
func agentPath() string {
	exe, err := os.Executable()
	if err != nil {
		return "dsec-agent"
	}
	return filepath.Join(filepath.Dir(exe), "dsec-agent")
}

// BundleDir is where bundles wait for the runtime (on the run dir's tmpfs).
func (h *Host) BundleDir() string { return filepath.Join(h.RunDir, "bundles") }

// Close stops the backend and unmounts the run dir's tmpfs when no
// sandbox keeps state in it. Close the edge first.
func (h *Host) Close() {
	if h.Backend != nil {
		h.Backend.Close()
	}
	if h.runDirTmpfs {
		unmountRunDir(h.RunDir, filepath.Join(h.RunDir, h.Runtime), h.log)
	}
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

// CgroupParent names this instance's parent cgroup. It is unique per state
// dir, because recovery reaps every child of the parent that is not one of
// its own sandboxes: two daemons on one host (tests, several edges) must
// never share one.
func CgroupParent(node, stateDir string) string {
	abs, err := filepath.Abs(stateDir)
	if err != nil {
		abs = stateDir
	}
	sum := sha256.Sum256([]byte(abs))
	return "/dsec/" + node + "-" + hex.EncodeToString(sum[:4])
}

// newNetwork sets up sandbox egress, or returns nil (loopback-only
// sandboxes) when it is off or, in auto mode, unavailable.
func newNetwork(c Config, log *slog.Logger) (*netpolicy.Manager, error) {
	switch c.Network {
	case "off":
		log.Info("sandbox networking off: every sandbox is loopback-only")
		return nil, nil
	case "auto", "on":
	default:
		return nil, fmt.Errorf("--network %q: want auto, on or off", c.Network)
	}
	if _, err := exec.LookPath("nft"); err != nil {
		if c.Network == "on" {
			return nil, errors.New("--network on: nft not found (apt-get install nftables)")
		}
		log.Warn("sandbox networking unavailable: nft not found (apt-get install nftables); sandboxes are loopback-only")
		return nil, nil
	}
	pool, err := netip.ParsePrefix(c.SandboxCIDR)
	if err != nil {
		return nil, fmt.Errorf("--sandbox-cidr %q: %w", c.SandboxCIDR, err)
	}
	presets := netpolicy.DefaultPresets()
	if c.NetPresets != "" {
		b, err := os.ReadFile(c.NetPresets)
		if err != nil {
			return nil, fmt.Errorf("--net-presets: %w", err)
		}
		var extra map[string]netpolicy.Preset
		if err := json.Unmarshal(b, &extra); err != nil {
			return nil, fmt.Errorf("--net-presets %s: %w", c.NetPresets, err)
		}
		maps.Copy(presets, extra)
	}
	var ups []string
	if c.DNSUpstream != "" {
		for _, u := range strings.Split(c.DNSUpstream, ",") {
			u = strings.TrimSpace(u)
			if _, _, err := net.SplitHostPort(u); err != nil {
				u = net.JoinHostPort(u, "53")
			}
			ups = append(ups, u)
		}
	} else {
		ups = netpolicy.UpstreamsFromResolvConf("/etc/resolv.conf")
	}
	admit, err := netpolicy.ParsePrefixes(c.DNSAdmitPrivate)
	if err != nil {
		return nil, fmt.Errorf("--dns-admit-private %w", err)
	}
	m, err := netpolicy.New(netpolicy.Config{
		Instance: InstanceID(c.StateDir), Pool: pool, Upstreams: ups, AdmitPrivate: admit, Deny: c.SandboxDeny, Presets: presets, Log: log,
	})
	if err != nil {
		return nil, err
	}
	if err := claimPool(m, c, pool, log); err != nil {
		return nil, err
	}
	return m, nil
}

// CheckPoolFree refuses a sandbox address pool (--network, --sandbox-cidr)
// that overlaps the pool of another dsec running on this host, without
// claiming anything: for a process to check before it claims its name.
// What it cannot tell (no claims yet) is not an error.
func CheckPoolFree(network, cidr, stateDir string) error {
	if network == "off" {
		return nil
	}
	if _, err := exec.LookPath("nft"); err != nil && network == "auto" {
		return nil // no networking here (newNetwork)
	}
	pool, err := netip.ParsePrefix(cidr)
	if err != nil {
		return fmt.Errorf("--sandbox-cidr %q: %w", cidr, err)
	}
	others, err := netpolicy.OverlappingPools(netpolicy.PoolClaimsDir, InstanceID(stateDir), pool)
	if err != nil || len(others) == 0 {
		return nil
	}
	return poolOverlap(pool, others)
}

func poolOverlap(pool netip.Prefix, others []string) error {
	return fmt.Errorf("--sandbox-cidr %s overlaps the pool of another dsec running on this host: %s; give each a pool of its own", pool.Masked(), strings.Join(others, "; "))
}

// claimPool notes the sandbox address pool on the host and says (or,
// with RefusePoolOverlap, refuses) when another running dsec has one that
// overlaps it: sandboxes given a route out would fail on one of them.
func claimPool(m *netpolicy.Manager, c Config, pool netip.Prefix, log *slog.Logger) error {
	owner := "dsec with state dir " + c.StateDir
	if abs, err := filepath.Abs(c.StateDir); err == nil {
		owner = "dsec with state dir " + abs
	}
	if c.NodeName != "" {
		owner = "node " + c.NodeName + ", " + owner
	}
	others, err := m.ClaimPool(netpolicy.PoolClaimsDir, owner)
	switch {
	case err != nil:
		log.Warn("could not note the sandbox address pool on the host; a pool another dsec uses shows only when a sandbox needs a route out", "err", err)
	case len(others) > 0 && c.RefusePoolOverlap:
		m.Close()
		return poolOverlap(pool, others)
	case len(others) > 0:
		log.Warn("the sandbox address pool overlaps the pool of another dsec running on this host: sandboxes with a route out will fail on one of them; give each a pool of its own (--sandbox-cidr)",
			"pool", pool.String(), "others", strings.Join(others, "; "))
	}
	return nil
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

// InstanceID tells this instance's host-wide objects (nftables table, veth
// names) from another instance's: derived from the state dir, like the
// cgroup parent.
func InstanceID(stateDir string) string {
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
// daemonOOMScoreAdj keeps the kernel's OOM killer off the node daemon: a
// sandbox running the host out of memory must lose its own processes, not
// the daemon that serves every sandbox (and would leave them unmanaged).
// Not -1000 (never): a daemon leaking memory should still be stoppable.
// The sandboxes' processes are set back to 0 as they start (the launcher,
// the exec helper and the OCI spec's oomScoreAdj).
const daemonOOMScoreAdj = "-999"

func shieldFromOOM(log *slog.Logger) {
	if err := os.WriteFile("/proc/self/oom_score_adj", []byte(daemonOOMScoreAdj), 0); err != nil {
		log.Warn("could not shield the daemon from the OOM killer", "err", err)
		return
	}
	log.Debug("oom_score_adj", "value", daemonOOMScoreAdj)
}

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
