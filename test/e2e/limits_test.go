package e2e

import (
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
)

// sandboxCgroupFile returns the path of a control file of sandbox id's
// cgroup (the one its record names) in the hierarchy holding ctrl: the v1 hierarchy of that controller
// when there is one, else the cgroup2 tree. It skips the test when the
// host has the controller nowhere.
func sandboxCgroupFile(t *testing.T, ctrl, id, v1name, v2name string) (string, bool) {
	t.Helper()
	rel := sandboxCgroupRel(t, id)
	for _, m := range hostCgroupMounts() {
		if !m.v2 && m.has(ctrl) {
			return filepath.Join(m.root, rel, v1name), false
		}
	}
	for _, m := range hostCgroupMounts() {
		if m.v2 && m.has(ctrl) {
			return filepath.Join(m.root, rel, v2name), true
		}
	}
	t.Skipf("host has no %s cgroup controller in a v1 hierarchy or the cgroup2 tree", ctrl)
	return "", false
}

func readTrim(t *testing.T, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatalf("reading cgroup file: %v", err)
	}
	return strings.TrimSpace(string(b))
}

// keyedValue returns the value of "key N" in a flat keyed cgroup file.
func keyedValue(t *testing.T, p, key string) (uint64, bool) {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		return 0, false
	}
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, " "); ok && k == key {
			n, err := strconv.ParseUint(strings.TrimSpace(v), 10, 64)
			return n, err == nil
		}
	}
	return 0, false
}

func TestLimitsMemoryOOMStaysInside(t *testing.T) {
	needDaemon(t)
	sb := newSandbox(t, api.SandboxSpec{MemoryMB: 64})
	neighbour := newSandbox(t, api.SandboxSpec{})
	if r := sh(t, neighbour.ID, "echo before > /n"); r.ExitCode != 0 {
		t.Fatalf("neighbour: %+v", r)
	}

	limitFile, v2 := sandboxCgroupFile(t, "memory", sb.ID, "memory.limit_in_bytes", "memory.max")
	if got := readTrim(t, limitFile); got != strconv.Itoa(64<<20) {
		t.Fatalf("%s = %s, want %d", limitFile, got, 64<<20)
	}
	st, err := client.Stats(ctx(t), sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	if st.MemoryMaxBytes != 64<<20 {
		t.Errorf("stats memory_limit_bytes = %d, want %d", st.MemoryMaxBytes, 64<<20)
	}

	// The kernel counts the OOM kill in the sandbox's own cgroup, which
	// may have counted kills of an earlier sandbox that had it.
	eventsFile := filepath.Join(filepath.Dir(limitFile), "memory.oom_control")
	if v2 {
		eventsFile = filepath.Join(filepath.Dir(limitFile), "memory.events")
	}
	killsBefore, _ := keyedValue(t, eventsFile, "oom_kill")

	// tail buffers its last 10 lines; /dev/zero has no newline, so it
	// tries to hold all 300 MiB.
	start := time.Now()
	r := sh(t, sb.ID, "head -c 300m /dev/zero | tail > /dev/null")
	t.Logf("memory hog: exit %d after %s, stderr %q", r.ExitCode, time.Since(start).Round(time.Millisecond), r.Stderr)
	if r.ExitCode == 0 {
		t.Fatalf("a 300 MiB hog in a 64 MiB sandbox succeeded: %+v", r)
	}
	if r.ExitCode != 137 {
		t.Logf("hog exit code %d (137 expected for a SIGKILLed tail)", r.ExitCode)
	}
	if n, ok := keyedValue(t, eventsFile, "oom_kill"); ok && n == killsBefore {
		t.Errorf("%s: oom_kill still %d after the hog", eventsFile, n)
	} else if !ok {
		t.Logf("%s has no oom_kill counter on this kernel", eventsFile)
	}

	// The sandbox, the daemon and the neighbour are fine.
	if r := sh(t, sb.ID, "echo alive"); r.ExitCode != 0 || r.Stdout != "alive\n" {
		t.Errorf("sandbox after OOM: %+v", r)
	}
	if got, err := client.GetSandbox(ctx(t), sb.ID); err != nil || got.State != api.StateRunning {
		t.Errorf("sandbox state after OOM: %+v %v", got, err)
	}
	resp, err := http.Get("http://" + d.listen + "/healthz")
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("daemon /healthz after OOM: %v %v", resp, err)
	}
	resp.Body.Close()
	// The neighbour has no limit: the same hog at 100 MiB completes.
	r = sh(t, neighbour.ID, "cat /n; head -c 100m /dev/zero | tail | wc -c")
	if r.ExitCode != 0 || r.Stdout != "before\n104857600\n" {
		t.Errorf("neighbour after OOM: %+v", r)
	}
}

func TestLimitsPids(t *testing.T) {
	needDaemon(t)
	sb := newSandbox(t, api.SandboxSpec{Pids: 32})
	maxFile, _ := sandboxCgroupFile(t, "pids", sb.ID, "pids.max", "pids.max")
	if got := readTrim(t, maxFile); got != "32" {
		t.Fatalf("%s = %s, want 32", maxFile, got)
	}
	// Short sleeps, so that the pids come back on their own.
	r := sh(t, sb.ID, `i=0; while [ $i -lt 64 ]; do sleep 2 & i=$((i+1)); done; echo spawned $i`)
	t.Logf("fork loop: exit %d stdout %q stderr %q", r.ExitCode, r.Stdout, r.Stderr)
	if r.Stdout == "spawned 64\n" && r.ExitCode == 0 {
		t.Fatalf("64 processes forked under pids=32: %+v", r)
	}
	if !strings.Contains(r.Stderr, "can't fork") && !strings.Contains(r.Stderr, "Resource temporarily unavailable") {
		t.Errorf("fork loop stderr %q, want EAGAIN (can't fork / Resource temporarily unavailable)", r.Stderr)
	}
	if n, ok := keyedValue(t, filepath.Join(filepath.Dir(maxFile), "pids.events"), "max"); ok && n == 0 {
		t.Errorf("pids.events max = 0 after the fork loop")
	}
	// Once the sleeps are gone the sandbox answers again.
	deadline := time.Now().Add(15 * time.Second)
	for {
		res, err := client.Exec(ctx(t), sb.ID, api.ExecRequest{Cmd: "echo alive"})
		if err == nil && res.ExitCode == 0 && res.Stdout == "alive\n" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("sandbox does not answer after the fork loop: %+v %v", res, err)
		}
		time.Sleep(250 * time.Millisecond)
	}
	if got, err := client.GetSandbox(ctx(t), sb.ID); err != nil || got.State != api.StateRunning {
		t.Fatalf("state after fork loop: %+v %v", got, err)
	}
}

func TestLimitsCPUQuota(t *testing.T) {
	needDaemon(t)
	sb := newSandbox(t, api.SandboxSpec{CPU: 0.5})
	quotaFile, v2 := sandboxCgroupFile(t, "cpu", sb.ID, "cpu.cfs_quota_us", "cpu.max")
	if v2 {
		if got := readTrim(t, quotaFile); got != "50000 100000" {
			t.Fatalf("%s = %q, want \"50000 100000\"", quotaFile, got)
		}
	} else {
		if got := readTrim(t, quotaFile); got != "50000" {
			t.Fatalf("%s = %s, want 50000", quotaFile, got)
		}
		period := filepath.Join(filepath.Dir(quotaFile), "cpu.cfs_period_us")
		if got := readTrim(t, period); got != "100000" {
			t.Fatalf("%s = %s, want 100000", period, got)
		}
	}
	// A busy loop for 2 s of wall time gets about 1 s of CPU.
	before, err := client.Stats(ctx(t), sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	r := sh(t, sb.ID, `timeout 2 sh -c 'while :; do :; done'; true`)
	if r.ExitCode != 0 {
		t.Fatalf("busy loop: %+v", r)
	}
	after, err := client.Stats(ctx(t), sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	used := time.Duration(after.CPUUsageNS - before.CPUUsageNS)
	t.Logf("busy loop used %s of CPU in 2 s at cpu=0.5", used.Round(time.Millisecond))
	// The floor only proves the loop ran: on a busy host it gets less.
	if used > 1400*time.Millisecond || used < 50*time.Millisecond {
		t.Errorf("busy loop used %s of CPU in 2 s, want about 1 s under a 0.5 CPU quota", used)
	}
}

func TestSandboxStats(t *testing.T) {
	needDaemon(t)
	sb := newSandbox(t, api.SandboxSpec{})
	if r := sh(t, sb.ID, "head -c 1000000 /dev/urandom > /blob; (sleep 30 &) ; true"); r.ExitCode != 0 {
		t.Fatalf("exec: %+v", r)
	}
	st, err := client.Stats(ctx(t), sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("stats: %+v", st)
	if st.MemoryBytes == 0 {
		t.Errorf("memory_bytes = 0")
	}
	if st.Pids < 2 {
		t.Errorf("pids = %d, want >= 2 (init and a sleep)", st.Pids)
	}
	if st.CPUUsageNS == 0 {
		t.Errorf("cpu_usage_ns = 0 after an exec")
	}
	if st.DiskBytes < 1000000 {
		t.Errorf("disk_bytes = %d after writing 1 MB", st.DiskBytes)
	}
	if st.MemoryMaxBytes != 4096<<20 {
		t.Errorf("memory_limit_bytes = %d for a spec without memory_mb, want the default 4 GiB", st.MemoryMaxBytes)
	}
	// The raw wire names of the contract.
	code, body := rawAPI(t, "GET", "/v1/sandboxes/"+sb.ID+"/stats", nil)
	if code != 200 || !strings.Contains(string(body), `"memory_bytes"`) || !strings.Contains(string(body), `"pids"`) {
		t.Errorf("GET stats: %d %s", code, body)
	}
	if code, _ := rawAPI(t, "GET", "/v1/sandboxes/sb-local-nosuchsandbox00/stats", nil); code != 404 {
		t.Errorf("stats of unknown sandbox: %d, want 404", code)
	}
}

func TestQoSBestEffortYieldsToLatencySensitive(t *testing.T) {
	needDaemon(t)
	ls := newSandbox(t, api.SandboxSpec{QoS: "ls"})
	be := newSandbox(t, api.SandboxSpec{QoS: "be"})
	for _, c := range []struct {
		id, idle, shares string
	}{{ls.ID, "0", "1024"}, {be.ID, "1", "3"}} { // an idle group's shares read 3 (WEIGHT_IDLEPRIO)
		idle, _ := sandboxCgroupFile(t, "cpu", c.id, "cpu.idle", "cpu.idle")
		if got := readTrim(t, idle); got != c.idle {
			t.Fatalf("%s = %s, want %s", idle, got, c.idle)
		}
		shares, v2 := sandboxCgroupFile(t, "cpu", c.id, "cpu.shares", "cpu.weight")
		if !v2 {
			if got := readTrim(t, shares); got != c.shares {
				t.Fatalf("%s = %s, want %s", shares, got, c.shares)
			}
		}
	}
	// Both spin on CPU 0: the best-effort one gets what the
	// latency-sensitive one leaves, which is almost nothing. Only the
	// stretch in which both spin is measured, not their start-up.
	cpu := func(id string) uint64 {
		st, err := client.Stats(ctx(t), id)
		if err != nil {
			t.Fatal(err)
		}
		return st.CPUUsageNS
	}
	spin := `taskset -c 0 sh -c 'while :; do :; done' >/dev/null 2>&1 & echo $! > /tmp/spin.pid`
	stop := func(id string) {
		// Fails if the spinner is not running any more: it spun all along.
		if r := sh(t, id, "kill $(cat /tmp/spin.pid)"); r.ExitCode != 0 {
			t.Fatalf("%s: the spinner was not running to the end: %+v", id, r)
		}
	}
	for _, id := range []string{be.ID, ls.ID} {
		if r := sh(t, id, spin); r.ExitCode != 0 {
			t.Fatalf("starting the spinner: %+v", r)
		}
	}
	l0, b0 := cpu(ls.ID), cpu(be.ID)
	time.Sleep(1500 * time.Millisecond)
	l, b := cpu(ls.ID)-l0, cpu(be.ID)-b0
	stop(ls.ID)
	stop(be.ID)
	t.Logf("CPU in 1.5 s while both spun on one core: ls %d ms, be %d ms", l/1e6, b/1e6)
	// ls's floor only proves it ran: other load on CPU 0 takes its share.
	if l < 100e6 || b*10 > l {
		t.Fatalf("best effort was not starved by latency sensitive: ls %d ms, be %d ms", l/1e6, b/1e6)
	}
}

// TestReusedCgroupStartsClean: the edge hands a deleted sandbox's emptied
// cgroup to the next sandbox. Nothing of the first may show in the second:
// not its limits (memory, CPU quota, pids, best-effort weight and
// cpu.idle), not its CPU time, not its processes.
func TestReusedCgroupStartsClean(t *testing.T) {
	needDaemon(t)
	a := newSandbox(t, api.SandboxSpec{MemoryMB: 64, CPU: 0.5, Pids: 64, QoS: "be"})
	relA := sandboxCgroupRel(t, a.ID)
	if r := sh(t, a.ID, "i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done; sleep 600 & echo spun"); r.Stdout != "spun\n" {
		t.Fatalf("a: %+v", r)
	}
	stA, err := client.Stats(ctx(t), a.ID)
	if err != nil {
		t.Fatal(err)
	}
	if stA.CPUUsageNS < 100e6 {
		t.Fatalf("a used %d ns of CPU, want at least 100 ms to tell it from b's", stA.CPUUsageNS)
	}
	limited := map[string]string{}
	for _, f := range [][4]string{
		{"memory", "memory.limit_in_bytes", "memory.max"},
		{"cpu", "cpu.cfs_quota_us", "cpu.max"},
		{"cpu", "cpu.shares", "cpu.weight"},
		{"pids", "pids.max", "pids.max"},
	} {
		p, _ := sandboxCgroupFile(t, f[0], a.ID, f[1], f[2])
		limited[p] = readTrim(t, p)
	}
	if err := client.DeleteSandbox(ctx(t), a.ID); err != nil {
		t.Fatal(err)
	}

	b := newSandbox(t, api.SandboxSpec{})
	relB := sandboxCgroupRel(t, b.ID)
	if relB != relA {
		t.Fatalf("b got cgroup %s, not a's emptied %s: reuse is off or not last-in first-out", relB, relA)
	}
	for p, was := range limited {
		now := readTrim(t, p)
		t.Logf("%s: %s under a, %s under b", filepath.Base(p), was, now)
		if now == was {
			t.Errorf("%s still %s, a's setting", p, now)
		}
	}
	for _, f := range [][4]string{
		{"memory", "memory.limit_in_bytes", "memory.max", "4294967296"}, // the policy's default, 4 GiB
		{"cpu", "cpu.cfs_quota_us", "cpu.max", "unlimited"},
		{"cpu", "cpu.shares", "cpu.weight", "default"},
		{"cpu", "cpu.idle", "cpu.idle", "0"},
		{"pids", "pids.max", "pids.max", "4096"}, // the policy's default
	} {
		p, v2 := sandboxCgroupFile(t, f[0], b.ID, f[1], f[2])
		got, err := os.ReadFile(p)
		if os.IsNotExist(err) && f[1] == "cpu.idle" {
			continue // kernel before 5.15
		}
		v := strings.TrimSpace(string(got))
		var ok bool
		switch f[3] {
		case "unlimited":
			n, perr := strconv.ParseUint(v, 10, 64)
			ok = v == "-1" || v == "max" || strings.HasPrefix(v, "max ") || (perr == nil && n >= 1<<62)
		case "default":
			ok = (!v2 && v == "1024") || (v2 && v == "100")
		default:
			ok = v == f[3]
		}
		if !ok {
			t.Errorf("b's %s = %q, want %s", p, v, f[3])
		}
	}
	stB, err := client.Stats(ctx(t), b.ID)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("cpu: a %d ns, b %d ns; memory: a %d, b %d bytes", stA.CPUUsageNS, stB.CPUUsageNS, stA.MemoryBytes, stB.MemoryBytes)
	if stB.CPUUsageNS >= stA.CPUUsageNS/2 {
		t.Errorf("b's cpu usage %d ns counts a's %d", stB.CPUUsageNS, stA.CPUUsageNS)
	}
	if stB.MemoryMaxBytes != 4096<<20 {
		t.Errorf("b's memory limit %d, want the default 4 GiB (not a's)", stB.MemoryMaxBytes)
	}
	if stB.MemoryBytes > 16<<20 {
		t.Errorf("b's memory %d bytes right after creation: a's charges left?", stB.MemoryBytes)
	}
	// b's processes are its init and what it runs: a's sleep is gone.
	if r := sh(t, b.ID, "ps -o comm | grep -c '^sleep' || true"); r.Stdout != "0\n" {
		t.Errorf("sleep processes in b: %+v", r)
	}
	for _, root := range cgroupHierarchies() {
		for _, pid := range cgroupProcs(filepath.Join(root, relB)) {
			comm, _ := os.ReadFile("/proc/" + pid + "/comm")
			if strings.TrimSpace(string(comm)) == "sleep" {
				t.Errorf("a's sleep (pid %s) is in b's cgroup %s", pid, filepath.Join(root, relB))
			}
		}
	}
}

// TestSharedMemoryCgroup: a memory_cgroup "shared" sandbox has every
// cgroup of its own but memory, which is its tree's parent, shared with
// the other such sandboxes; it refuses memory_mb, reports memory as a
// resident set, pauses and resumes, survives an edge restart, and its
// cgroup is recycled for the next one.
func TestSharedMemoryCgroup(t *testing.T) {
	needDaemon(t)
	restartDaemonOnCleanup(t)
	nodes, err := client.ListNodes(ctx(t))
	if err != nil || len(nodes) != 1 {
		t.Fatalf("nodes %+v, %v", nodes, err)
	}
	if nodes[0].Launcher != "dsec" {
		t.Skipf("the node starts sandboxes with %q; memory_cgroup shared needs dsec's launcher", nodes[0].Launcher)
	}
	_, err = client.CreateSandbox(ctx(t), api.SandboxSpec{Base: baseRef, MemoryCgroup: api.MemoryCgroupShared, MemoryMB: 64})
	wantCode(t, err, "invalid_argument")

	a := newSandbox(t, api.SandboxSpec{MemoryCgroup: api.MemoryCgroupShared})
	rel := sandboxCgroupRel(t, a.ID)
	shared := filepath.Dir(rel)
	if want := daemonCgroupParent(t) + "-shared"; shared != want {
		t.Fatalf("cgroup %s: want one under %s", rel, want)
	}
	pidsOf := func(dir string) []string { return cgroupProcs(dir) }
	var init string
	for _, m := range hostCgroupMounts() {
		if m.v2 || !slices.Contains(m.ctrls, "pids") {
			continue
		}
		if p := pidsOf(filepath.Join(m.root, rel)); len(p) == 1 {
			init = p[0]
		}
	}
	for _, m := range hostCgroupMounts() {
		if m.v2 && init == "" {
			if p := pidsOf(filepath.Join(m.root, rel)); len(p) == 1 {
				init = p[0]
			}
		}
	}
	if init == "" {
		t.Fatalf("no single init in cgroup %s", rel)
	}
	for _, m := range hostCgroupMounts() {
		memory := slices.Contains(m.ctrls, "memory")
		switch {
		case memory && !m.v2:
			if _, err := os.Stat(filepath.Join(m.root, rel)); err == nil {
				t.Errorf("%s has a memory cgroup of its own in %s", a.ID, m.root)
			}
			if !slices.Contains(pidsOf(filepath.Join(m.root, shared)), init) {
				t.Errorf("init %s is not charged to %s%s", init, m.root, shared)
			}
		case m.v2 && memory:
			if _, err := os.Stat(filepath.Join(m.root, rel, "memory.max")); err == nil {
				t.Errorf("%s has memory files of its own in %s", a.ID, m.root)
			}
			fallthrough
		default:
			if _, err := os.Stat(filepath.Join(m.root, rel)); err != nil {
				t.Errorf("%s has no cgroup in %s: %v", a.ID, m.root, err)
			}
		}
	}
	if r := sh(t, a.ID, "head -c 20000000 /dev/zero | tail -c 1 | wc -c"); r.ExitCode != 0 || r.Stdout != "1\n" {
		t.Fatalf("exec: %+v", r)
	}
	st, err := client.Stats(ctx(t), a.ID)
	if err != nil || st.MemorySource != "rss" || st.MemoryBytes == 0 || st.MemoryMaxBytes != 0 {
		t.Fatalf("stats %+v, %v: want a resident set and no limit", st, err)
	}
	if res, err := client.Pause(ctx(t), a.ID); err != nil || res.Sandbox.State != api.StatePaused {
		t.Fatalf("pause: %+v, %v", res, err)
	}
	if _, err := client.Resume(ctx(t), a.ID); err != nil {
		t.Fatal(err)
	}

	d.kill9()
	if err := d.start(); err != nil {
		t.Fatal(err)
	}
	if r := sh(t, a.ID, "echo alive"); r.Stdout != "alive\n" {
		t.Fatalf("after restart: %+v", r)
	}
	if got := sandboxCgroupRel(t, a.ID); got != rel {
		t.Fatalf("after restart the record names %s, was %s", got, rel)
	}
	if err := client.DeleteSandbox(ctx(t), a.ID); err != nil {
		t.Fatal(err)
	}
	b := newSandbox(t, api.SandboxSpec{MemoryCgroup: api.MemoryCgroupShared})
	if got := sandboxCgroupRel(t, b.ID); got != rel {
		t.Errorf("b got cgroup %s, not a's emptied %s", got, rel)
	}
	if err := client.DeleteSandbox(ctx(t), b.ID); err != nil {
		t.Fatal(err)
	}
	assertNodeConsistent(t, []string{a.ID, b.ID})
}

// dsecTopFile returns the path of file (v1 name, v2 name) of the top dsec
// cgroup in the hierarchy holding ctrl.
func dsecTopFile(t *testing.T, ctrl, v1File, v2File string) string {
	t.Helper()
	for _, m := range hostCgroupMounts() {
		if !m.v2 && m.has(ctrl) {
			return filepath.Join(m.root, "dsec", v1File)
		}
	}
	for _, m := range hostCgroupMounts() {
		if m.v2 && m.has(ctrl) {
			return filepath.Join(m.root, "dsec", v2File)
		}
	}
	t.Skipf("no %s controller", ctrl)
	return ""
}

func readInt(t *testing.T, path string) int64 {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil {
		t.Fatalf("%s: %q", path, b)
	}
	return n
}

// TestRedteamHostReserve (issue 21, class 8): the host keeps memory and
// pids whatever the sandboxes do. By default the top dsec cgroup is
// limited to the host's memory less 2 GiB (or 1/16) and kernel.pid_max
// less 4,096 (or 1/8). With the reserve raised so that sandboxes have
// only ~400 MiB more than they use now, a sandbox with the default limit
// (4 GiB) that asks for 1 GiB is OOM-killed inside the top cgroup: the
// daemon and a neighbour live on. And kernel.pid_max was raised from the
// kernel's 32,768.
func TestRedteamHostReserve(t *testing.T) {
	needDaemon(t)
	memLimit := dsecTopFile(t, "memory", "memory.limit_in_bytes", "memory.max")
	pidsLimit := dsecTopFile(t, "pids", "pids.max", "pids.max")
	var memTotal int64
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "MemTotal:"); ok {
				kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
				memTotal = kb << 10
			}
		}
	}
	pidMax := readInt(t, "/proc/sys/kernel/pid_max")
	if pidMax < 1<<22 {
		t.Errorf("kernel.pid_max is %d: the daemon raises it to %d at start (--pid-max)", pidMax, 1<<22)
	}
	wantMem := memTotal - max(2<<30, memTotal/16)
	if got := readInt(t, memLimit); got > wantMem || got < wantMem-(1<<20) {
		t.Errorf("default memory limit of the top dsec cgroup: %d, want %d (page-rounded)", got, wantMem)
	}
	if got := readInt(t, pidsLimit); got != pidMax-max(4096, pidMax/8) {
		t.Errorf("default pids limit of the top dsec cgroup: %d, want %d", got, pidMax-max(4096, pidMax/8))
	}

	usage := readInt(t, strings.Replace(strings.Replace(memLimit, "limit_in_bytes", "usage_in_bytes", 1), "memory.max", "memory.current", 1))
	reserveMB := (memTotal - usage - 400<<20) >> 20
	withPoolFlags(t, "--host-reserve-mb", strconv.FormatInt(reserveMB, 10))
	by := newBystander(t)
	sb := newSandbox(t, api.SandboxSpec{})
	res, err := client.Exec(ctx(t), sb.ID, api.ExecRequest{Cmd: "dd if=/dev/zero of=/dev/null bs=1024M count=1 2>&1; echo survived", Timeout: 60})
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(res.Stdout, "1+0 records") {
		t.Fatalf("a 1 GiB buffer fitted in a ~400 MiB reserve: %q", res.Stdout)
	}
	t.Logf("1 GiB under the reserve: exit %d, %q", res.ExitCode, res.Stdout)
	by.check(t)
}
