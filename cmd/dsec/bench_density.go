package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/dsecproject/dsec/internal/cgroup"
	"github.com/dsecproject/dsec/internal/edge/host"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/mountinfo"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

// `dsec bench density` fills the node with idle sandboxes and measures
// what each one costs the host — memory from /proc/meminfo, tasks, the
// daemon's RSS and fds — and how exec latency holds up at that density,
// then tears them all down and checks nothing leaked. The baseline is the
// same number of bare runtime containers on the same EROFS blob.

// densitySettle is the pause before each memory reading, so that freed
// and deferred work (RCU, page cache of short-lived helpers) lands.
const densitySettle = 2 * time.Second

// densityProgressEvery is how often the long phases report on stderr.
const densityProgressEvery = 5 * time.Second

// hostLimits are the limits a fill can run into.
type hostLimits struct {
	MaxSandboxes int // the node's --max-sandboxes (0 = unknown)
	Live         int // sandboxes live on the node before the fill
	PidMax       int // kernel.pid_max
	ThreadsMax   int // kernel.threads-max
	Tasks        int // tasks (threads) on the host now
	MemAvailKiB  int64
}

// densityPrecheck refuses a fill of n that cannot fit: more than the node
// admits, or more tasks than the kernel allows at one task per sandbox
// (the least a sandbox costs: its init).
func densityPrecheck(n int, l hostLimits) error {
	if l.MaxSandboxes > 0 && l.Live+n > l.MaxSandboxes {
		return fmt.Errorf("--count %d exceeds the node's --max-sandboxes %d (%d live, room for %d): restart `dsec up` with a higher --max-sandboxes or lower --count",
			n, l.MaxSandboxes, l.Live, max(l.MaxSandboxes-l.Live, 0))
	}
	return densityProject(n, 0, 1, 0, 0, l)
}

// densityProject checks that the n-made sandboxes still to create fit,
// at perTasks tasks and perKiB of memory each (as measured on the first
// ones), under kernel.pid_max, kernel.threads-max and MemAvailable,
// keeping 5% of the task limits and 10% of the memory free.
func densityProject(n, made int, perTasks, perKiB float64, probe int, l hostLimits) error {
	rest := float64(n - made)
	perTasks = max(perTasks, 1)
	need := rest * perTasks
	how := "at least one task per sandbox"
	if probe > 0 {
		how = fmt.Sprintf("%.1f tasks per sandbox measured on the first %d", perTasks, probe)
	}
	if l.PidMax > 0 && float64(l.Tasks)+need > 0.95*float64(l.PidMax) {
		return fmt.Errorf("--count %d needs about %.0f more tasks (%s) but kernel.pid_max is %d with %d in use: raise it (sysctl -w kernel.pid_max=4194304) or lower --count",
			n, need, how, l.PidMax, l.Tasks)
	}
	if l.ThreadsMax > 0 && float64(l.Tasks)+need > 0.95*float64(l.ThreadsMax) {
		return fmt.Errorf("--count %d needs about %.0f more tasks (%s) but kernel.threads-max is %d with %d in use: raise it or lower --count",
			n, need, how, l.ThreadsMax, l.Tasks)
	}
	if perKiB > 0 && l.MemAvailKiB > 0 && rest*perKiB > 0.9*float64(l.MemAvailKiB) {
		return fmt.Errorf("--count %d needs about %s more memory (%.0f KiB per sandbox measured on the first %d) but MemAvailable is %s: lower --count",
			n, humanBytes(int64(rest*perKiB)<<10), perKiB, probe, humanBytes(l.MemAvailKiB<<10))
	}
	return nil
}

// memFloorKiB is the MemAvailable below which a fill stops: 10% of what
// was available when it began, at least 1 GiB.
func memFloorKiB(availKiB int64) int64 {
	return max(availKiB/10, 1<<20)
}

// memInfo is the part of /proc/meminfo the bench reads, in KiB.
type memInfo struct {
	AvailKiB, SlabKiB, SUnreclaimKiB int64
}

// parseMeminfo reads MemAvailable, Slab and SUnreclaim from /proc/meminfo.
func parseMeminfo(r io.Reader) (memInfo, error) {
	var m memInfo
	seen := 0
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 2 {
			continue
		}
		v, err := strconv.ParseInt(f[1], 10, 64)
		if err != nil {
			continue
		}
		switch f[0] {
		case "MemAvailable:":
			m.AvailKiB = v
		case "Slab:":
			m.SlabKiB = v
		case "SUnreclaim:":
			m.SUnreclaimKiB = v
		default:
			continue
		}
		seen++
	}
	if err := sc.Err(); err != nil {
		return m, err
	}
	if seen < 3 {
		return m, errors.New("meminfo: MemAvailable, Slab or SUnreclaim missing")
	}
	return m, nil
}

// parseLoadavgTasks returns the number of tasks (threads) on the host, the
// denominator of the fourth field of /proc/loadavg ("1/345").
func parseLoadavgTasks(s string) (int, error) {
	f := strings.Fields(s)
	if len(f) < 4 {
		return 0, fmt.Errorf("loadavg %q: want 5 fields", s)
	}
	_, total, ok := strings.Cut(f[3], "/")
	if !ok {
		return 0, fmt.Errorf("loadavg %q: want running/total", s)
	}
	return strconv.Atoi(total)
}

// parseMetrics returns the unlabelled samples of a Prometheus text
// exposition (process_open_fds 12 → {"process_open_fds": 12}).
func parseMetrics(text string) map[string]float64 {
	m := map[string]float64{}
	for _, line := range strings.Split(text, "\n") {
		if line == "" || line[0] == '#' || strings.ContainsRune(line, '{') {
			continue
		}
		f := strings.Fields(line)
		if len(f) < 2 {
			continue
		}
		if v, err := strconv.ParseFloat(f[1], 64); err == nil {
			m[f[0]] = v
		}
	}
	return m
}

// countMounts counts the mounts of a mountinfo text under dir, and those
// of them with a path element in ids (a sandbox's rootfs, disk, ...).
func countMounts(text, dir string, ids map[string]bool) (total, ours int) {
	prefix := strings.TrimSuffix(dir, "/") + "/"
	for _, line := range strings.Split(text, "\n") {
		f := strings.Fields(line)
		if len(f) < 5 {
			continue
		}
		mp := mountinfo.Unescape(f[4])
		if !strings.HasPrefix(mp, prefix) {
			continue
		}
		total++
		for _, el := range strings.Split(mp[len(prefix):], "/") {
			if ids[el] {
				ours++
				break
			}
		}
	}
	return total, ours
}

// perSandbox is (a-b)/n, 0 when n is 0.
func perSandbox(a, b int64, n int) float64 {
	if n == 0 {
		return 0
	}
	return float64(a-b) / float64(n)
}

// memcgProbe measures the kernel memory one empty memory cgroup takes on
// this host: it makes 32 under the memory hierarchy's root, reads the
// growth of allocated slab objects (/proc/slabinfo: MemAvailable and the
// slab totals do not show it while freed objects of earlier cgroups are
// reused) and removes them. Most of it is the kernel's per-memcg shrinker
// state, sized by the most memcg-aware shrinkers (superblocks) the host
// has had at once since boot, so it differs between hosts and grows with
// history (docs/operating.md, "Density").
func memcgProbe() (float64, error) {
	info, err := cgroup.Detect()
	if err != nil {
		return 0, err
	}
	root := info.V1["memory"]
	if root == "" {
		root = info.V2Root
	}
	if root == "" {
		return 0, errors.New("no memory cgroup hierarchy")
	}
	const n = 32
	var dirs []string
	defer func() {
		for _, d := range dirs {
			_ = os.Remove(d)
		}
	}()
	before, err := slabObjectBytes()
	if err != nil {
		return 0, err
	}
	for i := range n {
		d := filepath.Join(root, fmt.Sprintf("dsec-bench-memcg-probe-%d-%d", os.Getpid(), i))
		if err := os.Mkdir(d, 0o755); err != nil {
			return 0, err
		}
		dirs = append(dirs, d)
	}
	after, err := slabObjectBytes()
	if err != nil {
		return 0, err
	}
	return float64(after-before) / 1024 / n, nil
}

// slabObjectBytes sums active objects × object size over /proc/slabinfo.
func slabObjectBytes() (int64, error) {
	b, err := os.ReadFile("/proc/slabinfo")
	if err != nil {
		return 0, err
	}
	return parseSlabinfo(string(b))
}

// parseSlabinfo sums active_objs × objsize over the caches of a
// /proc/slabinfo (version 2.1) text.
func parseSlabinfo(text string) (int64, error) {
	var total int64
	for _, line := range strings.Split(text, "\n") {
		f := strings.Fields(line)
		if len(f) < 4 || strings.HasPrefix(line, "#") || strings.HasPrefix(line, "slabinfo") {
			continue
		}
		active, err1 := strconv.ParseInt(f[1], 10, 64)
		size, err2 := strconv.ParseInt(f[3], 10, 64)
		if err1 != nil || err2 != nil {
			return 0, fmt.Errorf("parsing slabinfo line %q", line)
		}
		total += active * size
	}
	return total, nil
}

// hostSample is one reading of everything the density bench tracks.
type hostSample struct {
	mem         memInfo
	tasks       int
	metrics     map[string]float64 // the daemon's /metrics; nil for the baseline
	mounts      int
	ourMounts   int
	cgroups     int   // child cgroups of the parent, summed over hierarchies
	busyCgroups int   // those holding processes
	hierarchies int   // the parent cgroup's directories (one per hierarchy)
	cgroupPids  int64 // pids.current of the daemon's parent cgroup, -1 if unknown
	cgroupMem   int64 // memory charged to the parent cgroup in bytes, -1 if unknown
	ownSockets  int   // this process's sockets: each is a connection the daemon holds too
	sandboxes   int   // live on the node, by the API
	pooled      int   // waiting in the node's warm pools, by the API
	// heldMounts and heldBusyCgroups are the mounts and busy cgroups of
	// the sandboxes of sampleHost's held (0 without).
	heldMounts      int
	heldBusyCgroups int
	sampleError     error
}

// densityResult is one side's figures.
type densityResult struct {
	Sandboxes int `json:"sandboxes"`
	// StoppedLowMemory: the fill stopped short of --count at the
	// MemAvailable floor; Sandboxes is what it reached.
	StoppedLowMemory   bool    `json:"stopped_low_memory,omitempty"`
	MemAvailKiBPer     float64 `json:"mem_available_kib_per_sandbox"`
	SlabKiBPer         float64 `json:"slab_kib_per_sandbox"`
	SUnreclaimKiBPer   float64 `json:"sunreclaim_kib_per_sandbox"`
	HostTasksPer       float64 `json:"host_tasks_per_sandbox"`
	CgroupPidsPer      float64 `json:"cgroup_pids_per_sandbox,omitempty"`
	CgroupMemKiBPer    float64 `json:"cgroup_memory_kib_per_sandbox,omitempty"`
	DaemonRSSBeforeMiB float64 `json:"daemon_rss_before_mib,omitempty"`
	DaemonRSSAfterMiB  float64 `json:"daemon_rss_after_mib,omitempty"`
	DaemonRSSKiBPer    float64 `json:"daemon_rss_kib_per_sandbox,omitempty"`
	DaemonFDsBefore    int     `json:"daemon_fds_before,omitempty"`
	DaemonFDsAfter     int     `json:"daemon_fds_after,omitempty"`
	DaemonGoroutines   []int   `json:"daemon_goroutines_before_after,omitempty"`
	DaemonThreads      []int   `json:"daemon_threads_before_after,omitempty"`
	ResidualMemKiB     int64   `json:"mem_not_returned_kib,omitempty"`
	// CgroupsKept is how many more (empty) child cgroups the parent has
	// after the teardown than before, summed over hierarchies: the
	// edge's free slots (--cgroup-pool), part of ResidualMemKiB.
	CgroupsKept int `json:"cgroups_kept_for_reuse,omitempty"`
	// EmptyMemcgKiB is what one empty memory cgroup costs the kernel on
	// this host (memcgProbe), a cost every sandbox pays.
	EmptyMemcgKiB float64 `json:"empty_memcg_kib,omitempty"`
	// MemoryCgroup is the sandboxes' memory_cgroup (own or shared).
	MemoryCgroup        string   `json:"memory_cgroup,omitempty"`
	TornDown            bool     `json:"torn_down"`
	Leaks               []string `json:"leaks,omitempty"`
	PidMax              int      `json:"pid_max,omitempty"`
	MaxSandboxes        int      `json:"max_sandboxes,omitempty"`
	ExecSamples         int      `json:"exec_samples"`
	CreateFailures      int      `json:"create_failures"`
	CreateThroughputSec float64  `json:"create_per_sec"`
}

// densityReport is the summary of `bench density` in JSON.
type densityReport struct {
	Dsec     densityResult  `json:"dsec"`
	Baseline *densityResult `json:"baseline,omitempty"`
}

type densityOpts struct {
	benchOpts
	samples      int
	keep         bool
	memoryCgroup string
}

func runBenchDensity(args []string) error {
	var o densityOpts
	f := newCmdFlags("bench density", "[flags]",
		"Density: fill the node with --count idle sandboxes, measure host memory, tasks and the\n"+
			"daemon's RSS and fds per sandbox and exec latency at that density, then tear down\n"+
			"and check for leaks. Run it on the daemon's host (it reads /proc and /sys there).")
	f.IntVar(&o.count, "count", 1000, "idle sandboxes to create")
	f.IntVar(&o.concurrency, "concurrency", 16, "creates and deletes in flight at once")
	f.IntVar(&o.samples, "exec-samples", 200, "execs of `true` at density, round-robin over the sandboxes, one at a time")
	f.BoolVar(&o.keep, "keep", false, "leave the sandboxes running (no teardown or leak check)")
	f.Var(optBool{&o.userns}, "userns", "the sandboxes in user namespaces (--userns=false: none; left out: the node's default)")
	f.StringVar(&o.memoryCgroup, "memory-cgroup", api.MemoryCgroupOwn, "the sandboxes' memory_cgroup: own (a memory cgroup each) or shared (charged to one of the node's)")
	f.StringVar(&o.stateDir, "state-dir", "/var/lib/dsec", "the daemon's state dir (mounts are counted under it; the baseline reads the layer blob)")
	f.StringVar(&o.base, "base", "", "base layer ref to use (default: build base/bench:busybox from the host's busybox)")
	f.BoolVar(&o.jsonOut, "json", false, "print JSON instead of a table")
	f.BoolVar(&o.noBaseline, "no-baseline", false, "skip the bare-runtime baseline")
	if _, err := f.parseN(args, 0, 0); err != nil {
		return err
	}
	if o.count < 1 || o.concurrency < 1 || o.concurrency > 1024 || o.samples < 0 {
		return errors.New("bench: --count must be ≥ 1, --concurrency between 1 and 1024, --exec-samples ≥ 0")
	}
	if o.memoryCgroup != api.MemoryCgroupOwn && o.memoryCgroup != api.MemoryCgroupShared {
		return fmt.Errorf("bench: --memory-cgroup %q: want own or shared", o.memoryCgroup)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	c, err := newClient()
	if err != nil {
		return err
	}
	rt, node, err := benchNode(ctx, c)
	if err != nil {
		return err
	}
	ref, digest, err := benchBase(ctx, c, o.base)
	if err != nil {
		return err
	}
	lim, err := readHostLimits()
	if err != nil {
		return err
	}
	lim.MaxSandboxes, lim.Live = node.Capacity.MaxSandboxes, liveSandboxes(node.Counts)
	if err := densityPrecheck(o.count, lim); err != nil {
		return fmt.Errorf("bench density: %w", err)
	}
	if o.keep && !o.noBaseline {
		fmt.Fprintln(os.Stderr, "dsec: --keep: skipping the baseline (the kept sandboxes would skew it)")
		o.noBaseline = true
	}
	d := &densityRun{c: c, o: o, node: node, lim: lim}
	rows, res, err := d.runDsec(ctx, ref)
	if err != nil {
		return fmt.Errorf("bench density: %w", err)
	}
	rep := densityReport{Dsec: res}
	if !o.noBaseline {
		brows, bres, err := densityBaseline(ctx, o, digest, rt)
		if err != nil {
			return fmt.Errorf("baseline: %w (use --no-baseline to skip)", err)
		}
		names := []string{rt + " run -d"}
		if o.samples > 0 {
			names = append(names, rt+" exec")
		}
		names = append(names, rt+" delete -f")
		for i := range rows {
			if i < len(brows) {
				rows[i] = withBaseline(rows[i], brows[i], names[i])
			}
		}
		rep.Baseline = &bres
	}
	return printBenchSummary(rows, rep, densityLines(rep, rt), o.jsonOut)
}

// liveSandboxes sums the node's sandboxes that count against admission.
func liveSandboxes(counts map[string]int) int {
	return counts[api.StateCreating] + counts[api.StateRunning] + counts[api.StatePaused]
}

func readIntFile(path string) (int, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(strings.TrimSpace(string(b)))
}

func readHostLimits() (hostLimits, error) {
	var l hostLimits
	var err error
	if l.PidMax, err = readIntFile("/proc/sys/kernel/pid_max"); err != nil {
		return l, fmt.Errorf("reading kernel.pid_max: %w", err)
	}
	if l.ThreadsMax, err = readIntFile("/proc/sys/kernel/threads-max"); err != nil {
		return l, fmt.Errorf("reading kernel.threads-max: %w", err)
	}
	if l.Tasks, err = hostTasks(); err != nil {
		return l, err
	}
	m, err := readMeminfo()
	if err != nil {
		return l, err
	}
	l.MemAvailKiB = m.AvailKiB
	return l, nil
}

func readMeminfo() (memInfo, error) {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return memInfo{}, err
	}
	defer f.Close()
	return parseMeminfo(f)
}

func hostTasks() (int, error) {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return 0, err
	}
	return parseLoadavgTasks(string(b))
}

// densityRun is the dsec side of one density run.
type densityRun struct {
	c    *dsec.Client
	o    densityOpts
	node api.Node
	lim  hostLimits
	ids  map[string]bool // the sandboxes made, for the leak check
}

// sample reads the host, the daemon's /metrics and, through the API, the
// node's sandbox count.
func (d *densityRun) sample(ctx context.Context) hostSample {
	parent := host.CgroupParent(d.node.Name, d.o.stateDir)
	if d.o.memoryCgroup == api.MemoryCgroupShared {
		parent += "-shared" // edge/cgroups.go
	}
	return sampleHost(ctx, d.c, d.o.stateDir, parent, d.ids, heldSet{})
}

// heldSet names what the sandboxes a node holds at a reading hold: their
// ids (a path element of their mounts) and the names of their cgroups.
// bench soak counts only what none of them holds; density passes none.
type heldSet struct {
	ids     map[string]bool
	cgroups map[string]bool
}

// sampleHost reads the host (memory, tasks, the mounts under stateDir and
// the children of the parent cgroup), the daemon's /metrics and, through
// the API, the node's sandbox count. ids are the bench's sandboxes
// (ourMounts); the mounts and busy cgroups of held are counted apart.
func sampleHost(ctx context.Context, c *dsec.Client, stateDir, parent string, ids map[string]bool, held heldSet) hostSample {
	var s hostSample
	var err error
	if s.mem, err = readMeminfo(); err != nil {
		s.sampleError = err
	}
	if s.tasks, err = hostTasks(); err != nil {
		s.sampleError = err
	}
	s.metrics = daemonMetrics(ctx, c.Endpoint())
	s.ownSockets = ownSockets()
	if mi, err := os.ReadFile("/proc/self/mountinfo"); err == nil {
		abs, _ := filepath.Abs(stateDir)
		s.mounts, s.ourMounts = countMounts(string(mi), abs, ids)
		if len(held.ids) > 0 {
			_, s.heldMounts = countMounts(string(mi), abs, held.ids)
		}
	}
	s.cgroups, s.busyCgroups, s.heldBusyCgroups = countCgroupsHeld(parent, held.cgroups)
	s.hierarchies = len(cgroupParentDirs(parent))
	s.cgroupPids = cgroupValue(parent, "pids.current")
	s.cgroupMem = cgroupValue(parent, "memory.usage_in_bytes", "memory.current")
	if nodes, err := c.ListNodes(ctx); err == nil && len(nodes) > 0 {
		s.sandboxes = liveSandboxes(nodes[0].Counts)
		s.pooled = nodes[0].Counts["pooled"]
	}
	return s
}

// daemonMetrics fetches /metrics (served without auth); nil when the
// daemon does not serve it.
func daemonMetrics(ctx context.Context, endpoint string) map[string]float64 {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimSuffix(endpoint, "/")+"/metrics", nil)
	if err != nil {
		return nil
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil
	}
	b, err := io.ReadAll(io.LimitReader(resp.Body, 8<<20))
	if err != nil {
		return nil
	}
	return parseMetrics(string(b))
}

// cgroupParentDirs lists the parent cgroup's directory in every mounted
// hierarchy: one on cgroup v2, one per controller on v1.
func cgroupParentDirs(parent string) []string {
	var dirs []string
	cands, _ := filepath.Glob(filepath.Join("/sys/fs/cgroup", "*", parent))
	cands = append(cands, filepath.Join("/sys/fs/cgroup", parent))
	for _, d := range cands {
		if fi, err := os.Stat(d); err == nil && fi.IsDir() {
			dirs = append(dirs, d)
		}
	}
	return dirs
}

// countCgroups counts the children of the parent cgroup over every
// hierarchy, and those holding processes. The edge keeps emptied cgroups
// of deleted sandboxes for reuse, so only a busy one is a leak.
func countCgroups(parent string) (total, busy int) {
	total, busy, _ = countCgroupsHeld(parent, nil)
	return total, busy
}

// countCgroupsHeld is countCgroups that also counts the busy children
// named in held.
func countCgroupsHeld(parent string, held map[string]bool) (total, busy, heldBusy int) {
	for _, d := range cgroupParentDirs(parent) {
		ents, _ := os.ReadDir(d)
		for _, e := range ents {
			if !e.IsDir() {
				continue
			}
			total++
			if b, _ := os.ReadFile(filepath.Join(d, e.Name(), "cgroup.procs")); len(bytes.TrimSpace(b)) > 0 {
				busy++
				if held[e.Name()] {
					heldBusy++
				}
			}
		}
	}
	return total, busy, heldBusy
}

// cgroupValue reads the first of files found in the parent cgroup's
// directories (pids.current; memory.usage_in_bytes on v1, memory.current
// on v2 — all hierarchical), -1 when there is none.
func cgroupValue(parent string, files ...string) int64 {
	for _, d := range cgroupParentDirs(parent) {
		for _, f := range files {
			b, err := os.ReadFile(filepath.Join(d, f))
			if err != nil {
				continue
			}
			if v, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64); err == nil {
				return v
			}
		}
	}
	return -1
}

// ownSockets counts this process's socket fds. The client keeps idle
// keep-alive connections to the daemon, which hold a daemon fd each and
// must not count as the daemon's leak.
func ownSockets() int {
	ents, _ := os.ReadDir("/proc/self/fd")
	n := 0
	for _, e := range ents {
		if l, err := os.Readlink(filepath.Join("/proc/self/fd", e.Name())); err == nil && strings.HasPrefix(l, "socket:") {
			n++
		}
	}
	return n
}

func settle(ctx context.Context) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(densitySettle):
		return nil
	}
}

// startProgress reports done/total and the rate on stderr every few
// seconds until the returned function is called.
func startProgress(what string, total int, done *atomic.Int64) func() {
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		start := time.Now()
		t := time.NewTicker(densityProgressEvery)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-t.C:
				n := done.Load()
				fmt.Fprintf(os.Stderr, "%s: %d/%d (%.1f/s)\n", what, n, total, float64(n)/time.Since(start).Seconds())
			}
		}
	}()
	return func() { close(stop); wg.Wait() }
}

// responsiveness times the calls that look at the whole node or at one
// sandbox among many, one at a time, at density: stats (samples of them,
// round-robin), listing every bench sandbox (all pages), the node's
// counts and a /metrics scrape (a tenth of samples each, at least 3).
func (d *densityRun) responsiveness(ctx context.Context, live []string, label string, samples int) []benchRow {
	few := max(3, samples/10)
	n := len(live)
	type probe struct {
		name  string
		count int
		call  func(j int) error
	}
	probes := []probe{
		{fmt.Sprintf("stats at %d", n), samples, func(j int) error {
			_, err := d.c.Stats(ctx, live[j%n])
			return err
		}},
		{fmt.Sprintf("list all %d (paged)", n), few, func(int) error {
			got, err := d.c.ListAllSandboxes(ctx, dsec.ListOptions{Labels: map[string]string{"bench": label}})
			if err == nil && len(got) != n {
				err = fmt.Errorf("listed %d sandboxes, want %d", len(got), n)
			}
			return err
		}},
		{fmt.Sprintf("node counts at %d", n), few, func(int) error {
			_, err := d.c.ListNodes(ctx)
			return err
		}},
		{fmt.Sprintf("metrics scrape at %d", n), few, func(int) error {
			if daemonMetrics(ctx, d.c.Endpoint()) == nil {
				return errors.New("no /metrics")
			}
			return nil
		}},
	}
	var rows []benchRow
	for _, p := range probes {
		fmt.Fprintf(os.Stderr, "dsec: %s ×%d...\n", p.name, p.count)
		durs, fails, wall, err := runParallel(p.count, 1, p.call)
		if err != nil {
			fmt.Fprintf(os.Stderr, "first %s failure: %v\n", p.name, err)
		}
		rows = append(rows, row(p.name, p.count, 1, durs, fails, wall))
	}
	return rows
}

// runDsec fills, measures, samples execs and tears down through the API.
func (d *densityRun) runDsec(ctx context.Context, ref string) ([]benchRow, densityResult, error) {
	o := d.o
	n := o.count
	res := densityResult{PidMax: d.lim.PidMax, MaxSandboxes: d.lim.MaxSandboxes, ExecSamples: o.samples, MemoryCgroup: o.memoryCgroup}
	label := fmt.Sprintf("bench-density-%d", time.Now().UnixNano())
	torn := false
	defer func() {
		if !o.keep && !torn {
			fmt.Fprintf(os.Stderr, "dsec: deleting the bench's sandboxes (label bench=%s)...\n", label)
			_, _ = d.c.DeleteSandboxes(context.Background(), map[string]string{"bench": label})
		}
	}()
	d.ids = map[string]bool{}
	fmt.Fprintf(os.Stderr, "dsec: settling %s before the first reading...\n", densitySettle)
	if err := settle(ctx); err != nil {
		return nil, res, err
	}
	if v, err := memcgProbe(); err == nil {
		res.EmptyMemcgKiB = v
	} else {
		fmt.Fprintf(os.Stderr, "dsec: memory cgroup probe: %v\n", err)
	}
	before := d.sample(ctx)
	if before.sampleError != nil {
		return nil, res, before.sampleError
	}

	// Fill in two steps: a probe, whose cost per sandbox is projected to n
	// against the kernel's and the host's limits, then the rest.
	ids := make([]string, n)
	var mu sync.Mutex
	var refused error
	fillCtx, cancelFill := context.WithCancel(ctx)
	defer cancelFill()
	var done atomic.Int64
	// The projection after the probe can be too hopeful (memory per
	// sandbox grows with density), so the fill also watches MemAvailable
	// and stops at the floor, measuring the density it reached instead of
	// letting the host run out of memory.
	floor := memFloorKiB(before.mem.AvailKiB)
	var lowMem atomic.Int64
	stopWatch := make(chan struct{})
	watchStopped := sync.OnceFunc(func() { close(stopWatch) })
	defer watchStopped()
	go func() {
		for {
			select {
			case <-stopWatch:
				return
			case <-time.After(250 * time.Millisecond):
			}
			if m, err := readMeminfo(); err == nil && m.AvailKiB < floor {
				lowMem.Store(m.AvailKiB)
				cancelFill()
				return
			}
		}
	}()
	var canceled atomic.Int64 // creates not made because the fill stopped
	create := func(off int) func(int) error {
		return func(i int) error {
			if err := fillCtx.Err(); err != nil {
				canceled.Add(1)
				return err
			}
			sb, err := d.c.CreateSandbox(fillCtx, api.SandboxSpec{Base: ref, Labels: map[string]string{"bench": label}, MemoryCgroup: o.memoryCgroup, UserNS: o.userns})
			if err != nil && fillCtx.Err() != nil {
				canceled.Add(1)
			}
			if err != nil {
				if errors.Is(err, dsec.ErrExhausted) || errors.Is(err, dsec.ErrQuota) {
					mu.Lock()
					if refused == nil {
						refused = err
					}
					mu.Unlock()
					cancelFill()
				}
				return err
			}
			ids[off+i] = sb.ID
			done.Add(1)
			return nil
		}
	}
	probe := min(n, max(10, n/20))
	fmt.Fprintf(os.Stderr, "dsec: creating %d idle sandboxes, %d at a time...\n", n, o.concurrency)
	stopProgress := startProgress("dsec: created", n, &done)
	durs, fails, wall, ferr := runParallel(probe, o.concurrency, create(0))
	if refused == nil && ctx.Err() == nil && probe < n {
		now := d.sample(ctx)
		made := int(done.Load())
		lim := d.lim
		lim.Tasks, lim.MemAvailKiB = now.tasks, now.mem.AvailKiB
		if err := densityProject(n, made, perSandbox(int64(now.tasks), int64(before.tasks), made),
			perSandbox(before.mem.AvailKiB, now.mem.AvailKiB, made), made, lim); err != nil {
			stopProgress()
			return nil, res, err
		}
		d2, f2, w2, e2 := runParallel(n-probe, o.concurrency, create(probe))
		durs, fails, wall = append(durs, d2...), fails+f2, wall+w2
		if ferr == nil {
			ferr = e2
		}
	}
	stopProgress()
	watchStopped()
	for _, id := range ids {
		if id != "" {
			d.ids[id] = true
		}
	}
	made := len(d.ids)
	if low := lowMem.Load(); low > 0 && made < n && ctx.Err() == nil {
		fmt.Fprintf(os.Stderr, "dsec: stopped the fill at %d of %d sandboxes: MemAvailable %s fell below the floor of %s; measuring at %d\n",
			made, n, humanBytes(low<<10), humanBytes(floor<<10), made)
		res.StoppedLowMemory = true
		n, ferr = made, nil
		fails = max(0, fails-int(canceled.Load()))
	}
	if refused != nil {
		return nil, res, fmt.Errorf("the node refused a create after %d sandboxes (%d live before; its --max-sandboxes is %d, kernel.pid_max %d): %w",
			made, d.lim.Live, d.lim.MaxSandboxes, d.lim.PidMax, refused)
	}
	if err := ctx.Err(); err != nil {
		return nil, res, err
	}
	if ferr != nil {
		fmt.Fprintf(os.Stderr, "first create failure: %v\n", ferr)
	}
	fill := row(fmt.Sprintf("create (fill to %d)", n), n, o.concurrency, durs, fails, wall)
	res.Sandboxes, res.CreateFailures, res.CreateThroughputSec = made, fails, fill.PerSec
	if made == 0 {
		return nil, res, fmt.Errorf("no sandbox could be created: %v", ferr)
	}

	fmt.Fprintf(os.Stderr, "dsec: %d sandboxes up; settling %s...\n", made, densitySettle)
	if err := settle(ctx); err != nil {
		return nil, res, err
	}
	after := d.sample(ctx)
	fillResult(&res, before, after, made)

	live := make([]string, 0, made)
	for _, id := range ids {
		if id != "" {
			live = append(live, id)
		}
	}
	rows := []benchRow{fill}
	if o.samples > 0 {
		fmt.Fprintf(os.Stderr, "dsec: exec `true` ×%d round-robin over %d sandboxes...\n", o.samples, made)
		var edone atomic.Int64
		stopProgress := startProgress("dsec: execs", o.samples, &edone)
		ed, ef, ew, eerr := runParallel(o.samples, 1, func(j int) error {
			defer edone.Add(1)
			r, err := d.c.Exec(ctx, live[j%len(live)], api.ExecRequest{Argv: []string{"/bin/true"}})
			if err == nil && r.ExitCode != 0 {
				err = fmt.Errorf("exit %d: %s", r.ExitCode, r.Stderr)
			}
			return err
		})
		stopProgress()
		if eerr != nil {
			fmt.Fprintf(os.Stderr, "first exec failure: %v\n", eerr)
		}
		rows = append(rows, row(fmt.Sprintf("exec true at %d", made), o.samples, 1, ed, ef, ew))
	}
	// Listed after the teardown: the rows before it pair with the
	// baseline's by position.
	var atDensity []benchRow
	if o.samples > 0 {
		atDensity = d.responsiveness(ctx, live, label, o.samples)
	}
	if o.keep {
		fmt.Fprintf(os.Stderr, "dsec: --keep: %d sandboxes left running; delete them with `dsec sandbox delete --label bench=%s`\n", made, label)
		return append(rows, atDensity...), res, nil
	}

	fmt.Fprintf(os.Stderr, "dsec: deleting %d sandboxes, %d at a time...\n", made, o.concurrency)
	var ddone atomic.Int64
	stopProgress = startProgress("dsec: deleted", made, &ddone)
	dd, df, dw, derr := runParallel(made, o.concurrency, func(i int) error {
		defer ddone.Add(1)
		return d.c.DeleteSandbox(context.Background(), live[i])
	})
	stopProgress()
	torn = df == 0
	res.TornDown = torn
	if derr != nil {
		fmt.Fprintf(os.Stderr, "first delete failure: %v\n", derr)
	}
	rows = append(rows, row("delete (teardown)", made, o.concurrency, dd, df, dw))
	rows = append(rows, atDensity...)
	if res.StoppedLowMemory {
		// Creates that were in flight when the fill stopped had their
		// answer cut off, but the node may have finished them: those are
		// the bench's too, and a delete by label waits for them.
		if n, err := d.c.DeleteSandboxes(context.Background(), map[string]string{"bench": label}); err != nil {
			fmt.Fprintf(os.Stderr, "deleting creates cut off by the stop: %v\n", err)
		} else if n > 0 {
			fmt.Fprintf(os.Stderr, "dsec: deleted %d more whose create was cut off when the fill stopped\n", n)
		}
	}
	_ = settle(context.Background())
	end := d.sample(context.Background())
	res.ResidualMemKiB = before.mem.AvailKiB - end.mem.AvailKiB
	res.Leaks = leaks(before, end)
	res.CgroupsKept = max(0, end.cgroups-before.cgroups)
	if left, err := d.c.ListAllSandboxes(context.Background(), dsec.ListOptions{Labels: map[string]string{"bench": label}}); err == nil && len(left) > 0 {
		res.Leaks = append(res.Leaks, fmt.Sprintf("%d sandboxes still listed", len(left)))
	}
	return rows, res, nil
}

// fillResult fills the per-sandbox figures from the readings before and
// after the fill.
func fillResult(r *densityResult, before, after hostSample, n int) {
	r.MemAvailKiBPer = perSandbox(before.mem.AvailKiB, after.mem.AvailKiB, n)
	r.SlabKiBPer = perSandbox(after.mem.SlabKiB, before.mem.SlabKiB, n)
	r.SUnreclaimKiBPer = perSandbox(after.mem.SUnreclaimKiB, before.mem.SUnreclaimKiB, n)
	r.HostTasksPer = perSandbox(int64(after.tasks), int64(before.tasks), n)
	if before.cgroupPids >= 0 && after.cgroupPids >= 0 {
		r.CgroupPidsPer = perSandbox(after.cgroupPids, before.cgroupPids, n)
	}
	if before.cgroupMem >= 0 && after.cgroupMem >= 0 {
		r.CgroupMemKiBPer = perSandbox(after.cgroupMem, before.cgroupMem, n) / 1024
	}
	if before.metrics != nil && after.metrics != nil {
		rb, ra := before.metrics["process_resident_memory_bytes"], after.metrics["process_resident_memory_bytes"]
		r.DaemonRSSBeforeMiB, r.DaemonRSSAfterMiB = rb/(1<<20), ra/(1<<20)
		r.DaemonRSSKiBPer = (ra - rb) / 1024 / float64(n)
		// Net of this client's connections, which hold a daemon fd each.
		r.DaemonFDsBefore = int(before.metrics["process_open_fds"]) - before.ownSockets
		r.DaemonFDsAfter = int(after.metrics["process_open_fds"]) - after.ownSockets
		r.DaemonGoroutines = []int{int(before.metrics["go_goroutines"]), int(after.metrics["go_goroutines"])}
		r.DaemonThreads = []int{int(before.metrics["go_threads"]), int(after.metrics["go_threads"])}
	}
}

// leaks compares the readings before the fill and after the teardown.
func leaks(before, end hostSample) []string {
	var out []string
	// More than before is a leak; fewer is another client's sandboxes
	// ending meanwhile (a TTL), not the bench's.
	if end.sandboxes > before.sandboxes {
		out = append(out, fmt.Sprintf("live sandboxes %d, %d before", end.sandboxes, before.sandboxes))
	}
	if end.ourMounts > 0 {
		out = append(out, fmt.Sprintf("%d mounts of deleted sandboxes under the state dir", end.ourMounts))
	}
	if end.mounts > before.mounts {
		out = append(out, fmt.Sprintf("mounts under the state dir %d, %d before", end.mounts, before.mounts))
	}
	if end.busyCgroups > before.busyCgroups {
		out = append(out, fmt.Sprintf("cgroups under the parent holding processes %d, %d before", end.busyCgroups, before.busyCgroups))
	}
	if idle, most, ok := emptyCgroups(end); ok && idle > most {
		out = append(out, fmt.Sprintf("%d empty cgroups under the parent over %d hierarchies, but the edge keeps %.0f free slots", idle, end.hierarchies, end.metrics["dsec_cgroup_slots_free"]))
	}
	fb, okb := daemonFDs(before)
	fe, oke := daemonFDs(end)
	if okb && oke && fe > fb+daemonFDSlack {
		out = append(out, fmt.Sprintf("daemon fds %.0f, %.0f before (not counting this client's connections)", fe, fb))
	}
	return out
}

// daemonFDSlack is how many more fds than before the daemon may hold
// after a teardown: descriptors the runtime opens and closes meanwhile.
const daemonFDSlack = 4

// emptyCgroups returns the children of the parent cgroup holding no
// process and the most there may be: the edge's free slots in every
// hierarchy, plus at most one the reaper is removing; more is a leak (a
// slot the edge lost track of). ok is false without the metric.
func emptyCgroups(s hostSample) (idle, most int, ok bool) {
	free, ok := s.metrics["dsec_cgroup_slots_free"]
	if !ok || s.hierarchies == 0 {
		return 0, 0, false
	}
	return s.cgroups - s.busyCgroups, (int(free) + 1) * s.hierarchies, true
}

// daemonFDs returns the daemon's open fds net of the connections this
// client holds open to it; ok is false without /metrics.
func daemonFDs(s hostSample) (float64, bool) {
	if s.metrics == nil {
		return 0, false
	}
	return s.metrics["process_open_fds"] - float64(s.ownSockets), true
}

// densityBaseline is the same fill with the bare runtime: `run -d` on an
// overlay of the same EROFS blob per container, exec at density, delete.
func densityBaseline(ctx context.Context, o densityOpts, digest, rt string) ([]benchRow, densityResult, error) {
	res := densityResult{ExecSamples: o.samples}
	b, err := newBaseline(o.stateDir, digest, rt)
	if err != nil {
		return nil, res, err
	}
	defer b.close()
	fmt.Fprintf(os.Stderr, "baseline: settling %s...\n", densitySettle)
	if err := settle(ctx); err != nil {
		return nil, res, err
	}
	var before, after, end hostSample
	read := func(s *hostSample) {
		s.mem, _ = readMeminfo()
		s.tasks, _ = hostTasks()
	}
	read(&before)
	names := make([]string, o.count)
	var done atomic.Int64
	fmt.Fprintf(os.Stderr, "baseline: %s run -d ×%d, %d at a time...\n", rt, o.count, o.concurrency)
	stopProgress := startProgress("baseline: created", o.count, &done)
	cd, cf, cw, cerr := runParallel(o.count, o.concurrency, func(i int) error {
		if err := ctx.Err(); err != nil {
			return err
		}
		name, err := b.run(i)
		if err == nil {
			names[i] = name
			done.Add(1)
		}
		return err
	})
	stopProgress()
	if err := ctx.Err(); err != nil {
		return nil, res, err
	}
	if cerr != nil {
		fmt.Fprintf(os.Stderr, "first baseline failure: %v\n", cerr)
	}
	var live []string
	for _, nm := range names {
		if nm != "" {
			live = append(live, nm)
		}
	}
	if len(live) == 0 {
		return nil, res, fmt.Errorf("no container could be started: %v", cerr)
	}
	rows := []benchRow{row("run -d", o.count, o.concurrency, cd, cf, cw)}
	res.Sandboxes, res.CreateFailures, res.CreateThroughputSec = len(live), cf, rows[0].PerSec
	if err := settle(ctx); err != nil {
		return nil, res, err
	}
	read(&after)
	after.cgroupPids, before.cgroupPids, after.cgroupMem, before.cgroupMem = -1, -1, -1, -1
	fillResult(&res, before, after, len(live))
	if o.samples > 0 {
		var edone atomic.Int64
		stopProgress := startProgress("baseline: execs", o.samples, &edone)
		ed, ef, ew, eerr := runParallel(o.samples, 1, func(j int) error {
			defer edone.Add(1)
			return b.exec(live[j%len(live)])
		})
		stopProgress()
		if eerr != nil {
			fmt.Fprintf(os.Stderr, "first baseline exec failure: %v\n", eerr)
		}
		rows = append(rows, row("exec", o.samples, 1, ed, ef, ew))
	}
	var ddone atomic.Int64
	stopProgress = startProgress("baseline: deleted", len(live), &ddone)
	dd, df, dw, _ := runParallel(len(live), o.concurrency, func(i int) error {
		defer ddone.Add(1)
		return b.remove(live[i])
	})
	stopProgress()
	rows = append(rows, row("delete", len(live), o.concurrency, dd, df, dw))
	res.TornDown = df == 0
	_ = settle(context.Background())
	read(&end)
	res.ResidualMemKiB = before.mem.AvailKiB - end.mem.AvailKiB
	return rows, res, nil
}

// densityLines renders the per-sandbox figures as a second table.
func densityLines(rep densityReport, rt string) []string {
	var sb strings.Builder
	tw := tabwriter.NewWriter(&sb, 0, 4, 2, ' ', 0)
	bl := rep.Baseline
	base := func(f func(*densityResult) string) string {
		if bl == nil {
			return "-"
		}
		return f(bl)
	}
	d := rep.Dsec
	kib := func(v float64) string { return fmt.Sprintf("%.0f KiB", v) }
	fmt.Fprintf(tw, "\nPER SANDBOX AT %d\tDSEC\t%s\n", d.Sandboxes, strings.ToUpper(rt)+" BASELINE")
	fmt.Fprintf(tw, "host memory (MemAvailable drop)\t%s\t%s\n", kib(d.MemAvailKiBPer), base(func(r *densityResult) string { return kib(r.MemAvailKiBPer) }))
	fmt.Fprintf(tw, "slab\t%s\t%s\n", kib(d.SlabKiBPer), base(func(r *densityResult) string { return kib(r.SlabKiBPer) }))
	fmt.Fprintf(tw, "slab unreclaimable\t%s\t%s\n", kib(d.SUnreclaimKiBPer), base(func(r *densityResult) string { return kib(r.SUnreclaimKiBPer) }))
	fmt.Fprintf(tw, "host tasks\t%.2f\t%s\n", d.HostTasksPer, base(func(r *densityResult) string { return fmt.Sprintf("%.2f", r.HostTasksPer) }))
	if d.CgroupMemKiBPer > 0 {
		fmt.Fprintf(tw, "memory charged to sandbox cgroups\t%s\t-\n", kib(d.CgroupMemKiBPer))
	}
	if d.CgroupPidsPer > 0 {
		fmt.Fprintf(tw, "pids in sandbox cgroups\t%.2f\t-\n", d.CgroupPidsPer)
	}
	if d.DaemonRSSAfterMiB > 0 {
		fmt.Fprintf(tw, "daemon RSS\t%.1f KiB (%.1f → %.1f MiB)\t-\n", d.DaemonRSSKiBPer, d.DaemonRSSBeforeMiB, d.DaemonRSSAfterMiB)
		fmt.Fprintf(tw, "daemon fds (not counting the bench's connections)\t%.2f (%d → %d)\t-\n", float64(d.DaemonFDsAfter-d.DaemonFDsBefore)/float64(max(d.Sandboxes, 1)), d.DaemonFDsBefore, d.DaemonFDsAfter)
		fmt.Fprintf(tw, "daemon goroutines, threads\t%d → %d, %d → %d\t-\n", d.DaemonGoroutines[0], d.DaemonGoroutines[1], d.DaemonThreads[0], d.DaemonThreads[1])
	}
	switch {
	case d.EmptyMemcgKiB > 0 && d.MemoryCgroup == api.MemoryCgroupShared:
		fmt.Fprintf(tw, "not paid (memory_cgroup shared): an empty memory cgroup (probe)\t%s\t-\n", kib(d.EmptyMemcgKiB))
	case d.EmptyMemcgKiB > 0:
		fmt.Fprintf(tw, "of which an empty memory cgroup (probe)\t%s\t-\n", kib(d.EmptyMemcgKiB))
	}
	if d.TornDown || (bl != nil && bl.TornDown) {
		fmt.Fprintf(tw, "memory not back after teardown (total)\t%s\t%s\n", kib(float64(d.ResidualMemKiB)), base(func(r *densityResult) string { return kib(float64(r.ResidualMemKiB)) }))
		fmt.Fprintf(tw, "empty cgroups kept for reuse (all hierarchies)\t%d\t-\n", d.CgroupsKept)
	}
	_ = tw.Flush()
	lines := strings.Split(strings.TrimSuffix(sb.String(), "\n"), "\n")
	switch {
	case !d.TornDown:
		lines = append(lines, "leak check: skipped (sandboxes kept or not all deleted)")
	case len(d.Leaks) == 0:
		lines = append(lines, "leak check: ok (sandbox count, mounts under the state dir and cgroups holding processes back to where they were; empty cgroups no more than the edge's free slots)")
	default:
		lines = append(lines, "leak check: FAILED: "+strings.Join(d.Leaks, "; "))
	}
	lines = append(lines, "(memory, slab and tasks are host-wide readings: anything else running on the host shows up in them)",
		fmt.Sprintf("limits: node --max-sandboxes %d, kernel.pid_max %d", d.MaxSandboxes, d.PidMax))
	return lines
}
