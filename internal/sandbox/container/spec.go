package container

import (
	"errors"
	"fmt"
	"os"
	"strings"

	"golang.org/x/sys/unix"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/dsecproject/dsec/internal/sandbox"
)

// defaultCaps is the capability set of root inside a sandbox: what package
// managers and build tools need, without the ones that reach the kernel or
// the network stack (NET_RAW, NET_ADMIN, SYS_ADMIN, SYS_PTRACE, ...).
var defaultCaps = []string{
	"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD",
	"CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP",
	"CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
}

// capNumbers maps the capability names of defaultCaps to their numbers.
var capNumbers = map[string]uint{
	"CAP_CHOWN": unix.CAP_CHOWN, "CAP_DAC_OVERRIDE": unix.CAP_DAC_OVERRIDE, "CAP_FSETID": unix.CAP_FSETID,
	"CAP_FOWNER": unix.CAP_FOWNER, "CAP_MKNOD": unix.CAP_MKNOD, "CAP_SETGID": unix.CAP_SETGID,
	"CAP_SETUID": unix.CAP_SETUID, "CAP_SETFCAP": unix.CAP_SETFCAP, "CAP_SETPCAP": unix.CAP_SETPCAP,
	"CAP_NET_BIND_SERVICE": unix.CAP_NET_BIND_SERVICE, "CAP_SYS_CHROOT": unix.CAP_SYS_CHROOT,
	"CAP_KILL": unix.CAP_KILL, "CAP_AUDIT_WRITE": unix.CAP_AUDIT_WRITE,
}

// capMask returns the bit mask of named capabilities; a name it does not
// know panics (a test covers defaultCaps).
func capMask(names []string) uint64 {
	var m uint64
	for _, n := range names {
		bit, ok := capNumbers[n]
		if !ok {
			panic("unknown capability " + n)
		}
		m |= 1 << bit
	}
	return m
}

// maskedPaths hides kernel interfaces a sandbox has no business reading;
// /proc/kpage* are there because reading them has crashed kernels
// (DSEC-FACTS.md §7, incident 7).
//
// The second line is host-wide allocator and address-space state, which
// /proc does not namespace: slabinfo (object counts per slab cache),
// vmallocinfo (vmalloc areas and their callers), pagetypeinfo, zoneinfo
// and buddyinfo (free pages per order and zone) are what a kernel exploit
// reads to time and check its heap grooming, and what a side channel
// reads to watch other sandboxes allocate; iomem, ioports and mtrr are
// the machine's physical memory and I/O map. No tool a sandbox runs
// needs them: free, top, ps, vmstat and nproc read meminfo, stat,
// loadavg, vmstat and cpuinfo, which stay (docs/architecture.md, "What a
// sandbox can see of the host"). Each one missing on a kernel is skipped.
var maskedPaths = []string{
	"/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys",
	"/proc/latency_stats", "/proc/timer_list", "/proc/timer_stats",
	"/proc/sched_debug", "/proc/scsi", "/proc/kpagecgroup", "/proc/kpageflags",
	"/proc/kpagecount", "/proc/kallsyms",
	"/proc/slabinfo", "/proc/vmallocinfo", "/proc/pagetypeinfo", "/proc/zoneinfo",
	"/proc/buddyinfo", "/proc/iomem", "/proc/ioports", "/proc/mtrr",
	"/sys/firmware",
	"/sys/devices/virtual/powercap", "/sys/kernel/debug", "/sys/kernel/tracing",
}

// maskMounts splits masked into bind mounts of the empty directory dir,
// one per masked path that is a directory on this host's /proc or /sys
// (a sandbox's procfs and sysfs show the same kernel), and the rest, which
// the runtime masks itself (files with /dev/null, paths missing here).
// runc refuses mounts inside /proc (but for a few known files), so with
// runc only the /sys paths are bound.
//
// Why: runtimes mask a directory with a fresh read-only tmpfs, four per
// sandbox on this kernel, which made 11 superblocks per sandbox instead
// of 7. Each superblock registers a memcg-aware shrinker with two
// list_lrus, and the kernel pays for them per memory cgroup: every memcg
// holds shrinker state sized by the number of shrinkers (520 bytes per 64,
// kmalloc-1k), and removing a memcg walks every list_lru on the host
// under cgroup_mutex. Both grow with superblocks × live sandboxes: at
// 9,000 live sandboxes that walk was 46% of the node's CPU during
// teardown. A bind mount of one shared directory adds no superblock.
func maskMounts(dir string, masked []string, flavor string) ([]specs.Mount, []string) {
	var mounts []specs.Mount
	var rest []string
	for _, p := range masked {
		if flavor == "runc" && strings.HasPrefix(p, "/proc/") {
			rest = append(rest, p)
			continue
		}
		if st, err := os.Lstat(p); err == nil && st.IsDir() {
			mounts = append(mounts, specs.Mount{
				Destination: p, Type: "bind", Source: dir,
				Options: []string{"bind", "ro", "nosuid", "nodev", "noexec"},
			})
			continue
		}
		rest = append(rest, p)
	}
	return mounts, rest
}

// emptyDir makes dir an empty directory of mode 0555, creating it if
// needed; one with entries is refused (they would show in every sandbox).
func emptyDir(dir string) error {
	if err := os.Mkdir(dir, 0o555); err != nil && !errors.Is(err, os.ErrExist) {
		return fmt.Errorf("creating mask dir: %w", err)
	}
	st, err := os.Lstat(dir)
	if err != nil || !st.IsDir() {
		return fmt.Errorf("mask dir %s is not a directory", dir)
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("reading mask dir: %w", err)
	}
	if len(ents) > 0 {
		return fmt.Errorf("mask dir %s is not empty", dir)
	}
	if err := os.Chmod(dir, 0o555); err != nil {
		return fmt.Errorf("mask dir: %w", err)
	}
	return nil
}

var readonlyPaths = []string{
	"/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger",
}

// MaskedPaths and ReadonlyPaths return the masks of every container
// sandbox's /proc and /sys, for a backend that applies them itself (a VM's
// agent).
func MaskedPaths() []string   { return append([]string(nil), maskedPaths...) }
func ReadonlyPaths() []string { return append([]string(nil), readonlyPaths...) }

// initPath is where the host's init binary appears inside the sandbox. /dev
// is a tmpfs set up by the runtime, so the bind mount leaves no trace in the
// sandbox's writable layer.
const initPath = "/dev/init"

// PinnedShell is where the host's static busybox appears inside every
// sandbox, read-only: a shell for sessions and grading that the sandbox
// cannot replace, whatever it does to /bin/sh or /bin/bash. It is a mount
// point directly in /dev (a tmpfs the runtime owns), so it can be neither
// written, unlinked, renamed nor shadowed by renaming a parent directory;
// busybox picks its applet from the name, "sh".
const PinnedShell = "/dev/sh"

const defaultPath = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// spec is the OCI spec of the sandbox cfg. With cfg.UserNS, userns is the
// path of a user namespace made for it (ID maps written) for the runtime
// to join, or "" for the runtime to make one with the maps.
func (c *Container) spec(cfg sandbox.Config, userns string) *specs.Spec {
	ns := []specs.LinuxNamespace{
		{Type: specs.PIDNamespace}, {Type: specs.IPCNamespace}, {Type: specs.UTSNamespace},
		{Type: specs.MountNamespace}, {Type: specs.NetworkNamespace},
	}
	if c.cfg.CgroupNS {
		ns = append(ns, specs.LinuxNamespace{Type: specs.CgroupNamespace})
	}
	var uidMap, gidMap []specs.LinuxIDMapping
	switch m := cfg.UserNS; {
	case m != nil && userns != "":
		// Joined: its ID maps are written already.
		ns = append(ns, specs.LinuxNamespace{Type: specs.UserNamespace, Path: userns})
	case m != nil:
		ns = append(ns, specs.LinuxNamespace{Type: specs.UserNamespace})
		uidMap = []specs.LinuxIDMapping{{ContainerID: 0, HostID: m.HostID, Size: m.Size}}
		gidMap = uidMap
	}
	mounts := []specs.Mount{
		{Destination: "/proc", Type: "proc", Source: "proc", Options: []string{"nosuid", "noexec", "nodev"}},
		{Destination: "/dev", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "strictatime", "mode=755", "size=65536k"}},
		{Destination: "/dev/pts", Type: "devpts", Source: "devpts", Options: []string{"nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"}},
		{Destination: "/dev/shm", Type: "tmpfs", Source: "shm", Options: []string{"nosuid", "noexec", "nodev", "mode=1777", "size=65536k"}},
		{Destination: "/dev/mqueue", Type: "mqueue", Source: "mqueue", Options: []string{"nosuid", "noexec", "nodev"}},
		{Destination: "/sys", Type: "sysfs", Source: "sysfs", Options: []string{"nosuid", "noexec", "nodev", "ro"}},
		{Destination: initPath, Type: "bind", Source: c.cfg.Init, Options: []string{"bind", "ro", "nosuid", "nodev"}},
	}
	mounts = append(mounts, c.maskMounts...)
	if cfg.ResolvConf != "" {
		mounts = append(mounts, specs.Mount{Destination: "/etc/resolv.conf", Type: "bind", Source: cfg.ResolvConf, Options: []string{"bind", "ro", "nosuid", "nodev", "noexec"}})
	}
	if c.cfg.Shell != "" {
		mounts = append(mounts, specs.Mount{Destination: PinnedShell, Type: "bind", Source: c.cfg.Shell, Options: []string{"bind", "ro", "nosuid", "nodev"}})
	}
	var annotations map[string]string
	if c.flavor == "crun" && c.filter != nil {
		// crun loads this program as is instead of compiling the profile
		// with libseccomp on every create: the same filter as exec'd
		// commands get.
		annotations = map[string]string{"run.oci.seccomp_bpf_data": c.filterB64}
	}
	return &specs.Spec{
		Version:     ociVersion,
		Annotations: annotations,
		Hostname:    cfg.Hostname,
		Root:        &specs.Root{Path: cfg.Rootfs},
		Process: &specs.Process{
			Args:            []string{initPath, "-P"},
			Env:             []string{defaultPath},
			Cwd:             "/",
			NoNewPrivileges: true,
			OOMScoreAdj:     &sandboxOOMScoreAdj,
			Capabilities:    caps(0),
			Rlimits:         rlimits(),
		},
		Mounts: mounts,
		Linux: &specs.Linux{
			CgroupsPath:   cfg.CgroupPath,
			Namespaces:    ns,
			UIDMappings:   uidMap,
			GIDMappings:   gidMap,
			Resources:     resources(cfg.Limits),
			MaskedPaths:   c.masked,
			ReadonlyPaths: readonlyPaths,
			Seccomp:       c.seccomp,
		},
	}
}

// caps returns the capability sets for a process running as uid. A non-root
// user keeps only the bounding set, as it would after a real login.
func caps(uid uint32) *specs.LinuxCapabilities {
	if uid != 0 {
		return &specs.LinuxCapabilities{Bounding: defaultCaps}
	}
	return &specs.LinuxCapabilities{
		Bounding: defaultCaps, Effective: defaultCaps, Permitted: defaultCaps,
	}
}

// ociVersion is the runtime-spec version written into bundles: the oldest
// that has every field we use, so that older runtimes (crun 1.8 rejects
// "1.3.0") accept it.
const ociVersion = "1.0.2"

// maxNoFile is the open-files limit inside sandboxes.
const maxNoFile = 65536

func rlimits() []specs.POSIXRlimit {
	// A sandbox cannot get more than the edge's own hard limit: the runtime
	// sets rlimits without CAP_SYS_RESOURCE.
	n := uint64(maxNoFile)
	var cur unix.Rlimit
	if unix.Getrlimit(unix.RLIMIT_NOFILE, &cur) == nil && cur.Max < n {
		n = cur.Max
	}
	return []specs.POSIXRlimit{{Type: "RLIMIT_NOFILE", Hard: n, Soft: n}}
}

// sandboxOOMScoreAdj is every sandbox process's OOM score adjustment: the
// default, not the daemon's (host.Open shields the daemon with -999).
var sandboxOOMScoreAdj = 0

func resources(l sandbox.Limits) *specs.LinuxResources {
	r := &specs.LinuxResources{
		Devices: []specs.LinuxDeviceCgroup{{Allow: false, Access: "rwm"}},
	}
	if l.MemoryBytes > 0 {
		m := l.MemoryBytes
		r.Memory = &specs.LinuxMemory{Limit: &m}
	}
	cpu := &specs.LinuxCPU{}
	if l.CPU > 0 {
		period := uint64(100000)
		quota := int64(l.CPU * float64(period))
		cpu.Period, cpu.Quota = &period, &quota
	}
	// Weight: LS sandboxes get the default share; BE ones the minimum, so
	// they only run when LS work leaves the CPU idle.
	shares := uint64(1024)
	if l.BestEffort {
		shares = 2
	}
	cpu.Shares = &shares
	r.CPU = cpu
	if l.Pids > 0 {
		pids := l.Pids
		r.Pids = &specs.LinuxPids{Limit: &pids}
	}
	return r
}

// The pieces of a sandbox's bundle that every backend running an OCI
// bundle shares (gVisor runs the same bundle under its own kernel): the
// profile root and other users get, the rlimits, the cgroup resources,
// the seccomp profile, and where init and the pinned shell appear.

// InitPath is where the host's init binary (catatonit) appears inside.
const InitPath = initPath

// DefaultPath is the PATH a process gets when it brings none.
const DefaultPath = defaultPath

// OCIVersion is the runtime-spec version written into bundles.
const OCIVersion = ociVersion

// Caps returns the capability sets of a process running as uid.
func Caps(uid uint32) *specs.LinuxCapabilities { return caps(uid) }

// Rlimits returns the rlimits of every sandbox process.
func Rlimits() []specs.POSIXRlimit { return rlimits() }

// Resources returns the cgroup resources of a sandbox with limits l.
func Resources(l sandbox.Limits) *specs.LinuxResources { return resources(l) }

// SeccompProfile returns the seccomp profile of every sandbox process.
func SeccompProfile() *specs.LinuxSeccomp { return seccompProfile() }

// OOMScoreAdj returns the OOM score adjustment of sandbox processes.
func OOMScoreAdj() *int { v := sandboxOOMScoreAdj; return &v }
