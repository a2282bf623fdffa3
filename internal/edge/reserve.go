package edge

import (
	"bufio"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/cgroup"
)

// What the host keeps for itself. Without a limit above the sandboxes, one
// sandbox without a memory limit could run the whole host out of memory
// (a global OOM kills whatever it picks, the daemon included), and eight
// default sandboxes (4,096 pids each) exhausted a host's 32,768 pids. So
// the top dsec cgroup (the first level of Config.CgroupParent: every
// instance's sandboxes, both trees, are below it) gets the host's memory
// and pids less a reserve as its limits: past them the kernel refuses
// forks and OOM-kills inside the sandboxes, and the daemon (outside that
// cgroup) and the rest of the host keep theirs.
//
// The defaults: memory, the larger of 2 GiB and 1/16 of the host's; pids,
// the larger of 4,096 and 1/8 of kernel.pid_max.
func reserveDefaults(memTotal, pidMax int64) (memReserve, pidsReserve int64) {
	return max(2<<30, memTotal/16), max(4096, pidMax/8)
}

// DefaultPidMax is what dsec raises kernel.pid_max to: the largest the
// kernel takes on 64-bit hosts.
const DefaultPidMax = 1 << 22

// raisePidMax raises kernel.pid_max to Config.PidMax if it is lower (a
// host setting: it outlives the daemon). Best effort, logged.
func (e *Edge) raisePidMax() {
	want := e.cfg.PidMax
	if want <= 0 {
		return
	}
	have := hostPidMax()
	if have >= want {
		return
	}
	if err := os.WriteFile("/proc/sys/kernel/pid_max", []byte(strconv.FormatInt(want, 10)), 0o644); err != nil {
		e.log.Warn("could not raise kernel.pid_max", "from", have, "to", want, "err", err)
		return
	}
	e.log.Info("raised kernel.pid_max", "from", have, "to", want)
}

// repairDevNull gives the host's /dev/null back to root. Earlier gVisor
// backends handed it to runsc as the sandbox's stdio, and runsc gave it to
// the sandbox's user (nobody): any process of that uid could then change
// the mode of a node every program on the host writes to.
func (e *Edge) repairDevNull() {
	var st unix.Stat_t
	if err := unix.Stat("/dev/null", &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFCHR || st.Rdev != unix.Mkdev(1, 3) {
		return
	}
	if st.Uid == 0 && st.Gid == 0 && st.Mode&0o7777 == 0o666 {
		return
	}
	if err := unix.Chown("/dev/null", 0, 0); err != nil {
		e.log.Warn("the host's /dev/null is not root's; could not give it back", "owner", fmt.Sprintf("%d:%d", st.Uid, st.Gid), "err", err)
		return
	}
	if err := unix.Chmod("/dev/null", 0o666); err != nil {
		e.log.Warn("could not reset the mode of the host's /dev/null", "mode", fmt.Sprintf("%o", st.Mode&0o7777), "err", err)
	}
	e.log.Warn("gave the host's /dev/null back to root (an earlier dsec's gVisor backend had given it to the sandbox's user)",
		"owner_was", fmt.Sprintf("%d:%d", st.Uid, st.Gid), "mode_was", fmt.Sprintf("%o", st.Mode&0o7777))
}

// sandboxLimits are the limits of the top dsec cgroup on a host with
// memTotal bytes of memory and pidMax pids: the host's less the reserve
// (0: no limit).
func (e *Edge) sandboxLimits(memTotal, pidMax int64) cgroup.Limits {
	memRes, pidsRes := reserveDefaults(memTotal, pidMax)
	if e.cfg.HostReserveMB >= 0 {
		memRes = e.cfg.HostReserveMB << 20
	}
	if e.cfg.HostReservePids >= 0 {
		pidsRes = e.cfg.HostReservePids
	}
	var l cgroup.Limits
	if memRes > 0 && memTotal > memRes {
		l.MemoryBytes = memTotal - memRes
	}
	if pidsRes > 0 && pidMax > pidsRes {
		l.Pids = pidMax - pidsRes
	}
	return l
}

// capacity is what the node's sandboxes have together, for the watcher:
// the cores this process may run on and the host's memory less its
// reserve (all of it where nothing is reserved).
func (e *Edge) capacity() api.Capacity {
	memTotal := hostMemTotal()
	mem := memTotal
	if e.reserveTop() != "" {
		if l := e.sandboxLimits(memTotal, hostPidMax()); l.MemoryBytes > 0 {
			mem = l.MemoryBytes
		}
	}
	return api.Capacity{MaxSandboxes: e.cfg.MaxSandboxes, CPU: float64(runtime.NumCPU()), MemoryMB: mem >> 20}
}

// reserveTop is the cgroup the reserve limits (the first level of the
// cgroup parent), "" where there is none (no cgroups, a parent at the
// root).
func (e *Edge) reserveTop() string {
	if e.deps.Cgroups == nil {
		return ""
	}
	top := "/" + strings.SplitN(strings.TrimPrefix(e.cfg.CgroupParent, "/"), "/", 2)[0]
	if top == "/" {
		return ""
	}
	return top
}

// reserveForHost applies the reserve to the top dsec cgroup. Best effort:
// a limit the kernel refuses (usage above it already) is logged.
func (e *Edge) reserveForHost() {
	top := e.reserveTop()
	if top == "" {
		return
	}
	l := e.sandboxLimits(hostMemTotal(), hostPidMax())
	if l.MemoryBytes == 0 && l.Pids == 0 {
		return
	}
	if err := e.deps.Cgroups.SetLimits(top, l); err != nil {
		e.log.Warn("could not keep a reserve for the host", "cgroup", top, "err", err)
		return
	}
	e.log.Info("host reserve", "cgroup", top, "sandbox_memory_limit_mib", l.MemoryBytes>>20, "sandbox_pids_limit", l.Pids)
}

// hostMemTotal is /proc/meminfo's MemTotal in bytes (0 if unknown).
func hostMemTotal() int64 {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "MemTotal:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return kb << 10
		}
	}
	return 0
}

// hostPidMax is kernel.pid_max (0 if unknown).
func hostPidMax() int64 {
	b, err := os.ReadFile("/proc/sys/kernel/pid_max")
	if err != nil {
		return 0
	}
	n, _ := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	return n
}
