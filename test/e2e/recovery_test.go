package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

// cgroupMountInfo is one cgroup hierarchy of the host.
type cgroupMountInfo struct {
	root  string
	v2    bool
	ctrls []string // v1: the hierarchy's controllers; v2: cgroup.controllers
}

func (m cgroupMountInfo) has(ctrl string) bool { return slices.Contains(m.ctrls, ctrl) }

// hostCgroupMounts reads the cgroup hierarchies under /sys/fs/cgroup from
// mountinfo (v1 controllers, named hierarchies and the cgroup2 tree).
func hostCgroupMounts() []cgroupMountInfo {
	b, _ := os.ReadFile("/proc/self/mountinfo")
	var out []cgroupMountInfo
	seen := map[string]bool{}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		sep := slices.Index(f, "-")
		if sep < 0 || len(f) < sep+4 {
			continue
		}
		mp, fstype := f[4], f[sep+1]
		if (fstype != "cgroup" && fstype != "cgroup2") || !strings.HasPrefix(mp, "/sys/fs/cgroup") || seen[mp] {
			continue
		}
		seen[mp] = true
		m := cgroupMountInfo{root: mp, v2: fstype == "cgroup2"}
		if m.v2 {
			if c, err := os.ReadFile(filepath.Join(mp, "cgroup.controllers")); err == nil {
				m.ctrls = strings.Fields(string(c))
			}
		} else {
			m.ctrls = strings.Split(f[sep+3], ",")
		}
		out = append(out, m)
	}
	return out
}

// cgroupHierarchies returns the mountpoint of every cgroup hierarchy.
func cgroupHierarchies() []string {
	var out []string
	for _, m := range hostCgroupMounts() {
		out = append(out, m.root)
	}
	return out
}

// sandboxCgroupRel returns a sandbox's cgroup path relative to the
// hierarchy roots, as the edge recorded it in sandbox.json.
func sandboxCgroupRel(t *testing.T, id string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(d.stateDir, "edge", "sandboxes", id, "sandbox.json"))
	if err != nil {
		t.Fatalf("reading the record of %s: %v", id, err)
	}
	var rec struct {
		CgroupPath string `json:"cgroup_path"`
	}
	if err := json.Unmarshal(b, &rec); err != nil || !strings.HasPrefix(rec.CgroupPath, "/") {
		t.Fatalf("record of %s: cgroup_path %q, %v", id, rec.CgroupPath, err)
	}
	return rec.CgroupPath
}

// cgroupParentCache is the daemon's sandbox cgroup parent; it depends only
// on the state dir, so it survives restarts.
var cgroupParentCache string

// daemonCgroupParent returns the parent cgroup of the daemon's sandboxes
// (/dsec, or a per-instance child of it), learnt from a sandbox record;
// with no sandbox around it makes one to look.
func daemonCgroupParent(t *testing.T) string {
	t.Helper()
	if cgroupParentCache != "" {
		return cgroupParentCache
	}
	recs, _ := filepath.Glob(filepath.Join(d.stateDir, "edge", "sandboxes", "*", "sandbox.json"))
	for _, r := range recs {
		b, err := os.ReadFile(r)
		var rec struct {
			CgroupPath string `json:"cgroup_path"`
		}
		// Not a memory_cgroup "shared" sandbox's: those live in a sibling
		// tree, <parent>-shared.
		if err == nil && json.Unmarshal(b, &rec) == nil && strings.HasPrefix(rec.CgroupPath, "/dsec") && !strings.HasSuffix(filepath.Dir(rec.CgroupPath), "-shared") {
			cgroupParentCache = filepath.Dir(rec.CgroupPath)
			return cgroupParentCache
		}
	}
	sb, err := client.CreateSandbox(ctx(t), api.SandboxSpec{Base: baseRef})
	if err != nil {
		t.Fatalf("creating a sandbox to learn the cgroup parent: %v", err)
	}
	rel := sandboxCgroupRel(t, sb.ID)
	if err := client.DeleteSandbox(ctx(t), sb.ID); err != nil {
		t.Fatal(err)
	}
	cgroupParentCache = filepath.Dir(rel)
	return cgroupParentCache
}

// sharedCgroupParent reports whether the daemon's sandboxes share their
// parent cgroup with other dsec instances (the plain /dsec layout).
func sharedCgroupParent(t *testing.T) bool { return daemonCgroupParent(t) == "/dsec" }

// nodeSnapshot is what the daemon holds on the host, read from the host.
type nodeSnapshot struct {
	dirs        []string            // <state>/edge/sandboxes/*
	runtime     []string            // <state>/runtime/<crun|runc>/* (container ids)
	overlays    []string            // rootfs of each sandbox with an overlay in any mount namespace
	hostRootfs  []string            // rootfs mountpoints on the host (there should be none)
	layerMounts []string            // mountpoints under <state>/edge/mnt/
	cgroups     map[string][]string // child of the cgroup parent → hierarchies holding it
}

func snapshotNode(t *testing.T) nodeSnapshot {
	t.Helper()
	var s nodeSnapshot
	ents, err := os.ReadDir(filepath.Join(d.stateDir, "edge", "sandboxes"))
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		s.dirs = append(s.dirs, e.Name())
	}
	rts, _ := filepath.Glob(filepath.Join(d.stateDir, "runtime", runtimeName(t), "*"))
	for _, p := range rts {
		if st, err := os.Stat(p); err == nil && st.IsDir() {
			s.runtime = append(s.runtime, filepath.Base(p))
		}
	}
	slices.Sort(s.runtime)
	s.overlays = sandboxOverlays()
	// A rootfs lives in its sandbox's mount namespace, never on the host.
	for _, m := range hostMounts(filepath.Join(d.stateDir, "edge", "sandboxes") + "/") {
		if strings.HasSuffix(m, "/rootfs") {
			s.hostRootfs = append(s.hostRootfs, m)
		}
	}
	s.layerMounts = hostMounts(filepath.Join(d.stateDir, "edge", "mnt") + "/")
	s.cgroups = map[string][]string{}
	parent := daemonCgroupParent(t)
	for _, root := range cgroupHierarchies() {
		kids, _ := os.ReadDir(filepath.Join(root, parent))
		for _, k := range kids {
			if k.IsDir() {
				s.cgroups[k.Name()] = append(s.cgroups[k.Name()], root)
			}
		}
	}
	return s
}

// freeCgroupSlots reads the edge's free cgroup slots from /metrics.
func freeCgroupSlots(t *testing.T) int {
	t.Helper()
	free, ok := metricValue(string(wireCallAuth(t, "GET", "/metrics", nil, wireAuthNone).Body), "dsec_cgroup_slots_free")
	if !ok {
		t.Fatalf("no dsec_cgroup_slots_free in /metrics")
	}
	return int(free)
}

// cgroupProcs returns the pids in a cgroup directory's cgroup.procs
// (none when it does not exist).
func cgroupProcs(dir string) []string {
	b, _ := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
	return strings.Fields(string(b))
}

// foreignDaemons returns the pids of other `dsec up` processes on the host.
// With the plain /dsec layout they share the cgroup parent, so its
// children may be theirs.
func foreignDaemons() []int {
	mine := 0
	if d.cmd != nil && d.cmd.Process != nil {
		mine = d.cmd.Process.Pid
	}
	var out []int
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range procs {
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		argv := strings.Split(strings.TrimRight(string(b), "\x00"), "\x00")
		if len(argv) < 2 || filepath.Base(argv[0]) != "dsec" || argv[1] != "up" {
			continue
		}
		pid, _ := strconv.Atoi(filepath.Base(filepath.Dir(p)))
		if pid != mine {
			out = append(out, pid)
		}
	}
	return out
}

// restartDaemonOnCleanup makes sure a test that kills the daemon leaves it
// running, with the same listen address and key, whatever happens.
func restartDaemonOnCleanup(t *testing.T) {
	t.Cleanup(func() {
		if d.cmd == nil {
			if err := d.start(); err != nil {
				t.Errorf("restarting the daemon: %v", err)
			}
		}
	})
}

// logSince returns what the daemon logged after offset.
func logSince(offset int64) string {
	b, _ := os.ReadFile(d.logPath)
	if int64(len(b)) < offset {
		return string(b)
	}
	return string(b[offset:])
}

func logSize() int64 {
	st, err := os.Stat(d.logPath)
	if err != nil {
		return 0
	}
	return st.Size()
}

// assertNodeConsistent checks that the host holds exactly what the API
// lists: a dir per listed sandbox, an overlay mount, runtime state and a
// cgroup per running one, and layer mounts only for layers in use.
// candidates are ids the test has reason to suspect (its own sandboxes,
// interrupted creations); their cgroups are checked even when other dsec
// daemons on the host share the cgroup parent. It returns the running and
// the listed ids.
func assertNodeConsistent(t *testing.T, candidates []string) (running, listed []string) {
	t.Helper()
	return checkNodeConsistent(t, candidates, t.Errorf)
}

// nodeConsistent reports whether assertNodeConsistent would find nothing
// wrong now.
func nodeConsistent(t *testing.T, candidates []string) bool {
	t.Helper()
	ok := true
	checkNodeConsistent(t, candidates, func(string, ...any) { ok = false })
	return ok
}

// checkNodeConsistent is assertNodeConsistent reporting what it finds
// wrong to errorf.
func checkNodeConsistent(t *testing.T, candidates []string, errorf func(string, ...any)) (running, listed []string) {
	t.Helper()
	all, err := client.ListAllSandboxes(ctx(t), dsec.ListOptions{})
	if err != nil {
		t.Fatalf("list: %v", err)
	}
	freeBefore := freeCgroupSlots(t)
	s := snapshotNode(t)
	freeAfter := freeCgroupSlots(t)
	digests := map[string]bool{}
	for _, sb := range all {
		listed = append(listed, sb.ID)
		if sb.State == api.StateRunning || sb.State == api.StatePaused {
			running = append(running, sb.ID)
			for _, dg := range sb.Layers {
				digests[dg] = true
			}
		}
	}
	slices.Sort(listed)
	slices.Sort(running)
	if dirs := slices.Sorted(slices.Values(s.dirs)); !slices.Equal(dirs, listed) {
		errorf("sandbox dirs %v, API lists %v", dirs, listed)
	}
	var wantOverlays []string
	for _, id := range running {
		wantOverlays = append(wantOverlays, filepath.Join(d.stateDir, "edge", "sandboxes", id, "rootfs"))
	}
	if got := slices.Sorted(slices.Values(s.overlays)); !slices.Equal(got, wantOverlays) {
		errorf("overlays of sandboxes %v, want the rootfs of each running sandbox %v", got, wantOverlays)
	}
	if len(s.hostRootfs) > 0 {
		errorf("rootfs mounted on the host: %v", s.hostRootfs)
	}
	if !slices.Equal(s.runtime, running) {
		errorf("runtime state dirs %v, running sandboxes %v", s.runtime, running)
	}
	if len(s.layerMounts) != len(digests) {
		errorf("layer mounts %v, want one per layer in use (%d)", s.layerMounts, len(digests))
	}
	// Each running sandbox has the cgroup its record names, in every
	// hierarchy; no two share one. No cgroup is named after a sandbox that
	// is not running.
	parent := daemonCgroupParent(t)
	owner := map[string]string{} // cgroup name → running sandbox
	for _, id := range running {
		name := filepath.Base(sandboxCgroupRel(t, id))
		if other, dup := owner[name]; dup {
			errorf("sandboxes %s and %s share cgroup %s", other, id, name)
		}
		owner[name] = id
		if len(s.cgroups[name]) != len(cgroupHierarchies()) {
			errorf("running %s: cgroup %s/%s in %v, want every hierarchy", id, parent, name, s.cgroups[name])
		}
	}
	for _, id := range append(slices.Clone(candidates), listed...) {
		if _, has := s.cgroups[id]; has && !slices.Contains(running, id) {
			errorf("cgroup %s/%s of a sandbox that is not running (in %v)", parent, id, s.cgroups[id])
		}
	}
	if f := foreignDaemons(); len(f) == 0 || !sharedCgroupParent(t) {
		// The other children are emptied cgroups kept for reuse: no
		// process in any hierarchy, and no more of them than the edge
		// says it keeps (plus one the reaper may be removing).
		spare := 0
		for name, roots := range s.cgroups {
			if owner[name] != "" {
				continue
			}
			spare++
			for _, root := range roots {
				if procs := cgroupProcs(filepath.Join(root, parent, name)); len(procs) > 0 {
					errorf("cgroup %s/%s belongs to no running sandbox but holds processes %v", root, name, procs)
				}
			}
		}
		// Read before and after the snapshot: a delete finishing or the
		// reaper trimming meanwhile moves the count one way or the other.
		if free := max(freeBefore, freeAfter); spare > free+1 {
			errorf("%d cgroups under %s belong to no running sandbox, but the edge keeps %d free: the rest are lost", spare, parent, free)
		}
	} else {
		t.Logf("other dsec daemons share /dsec on this host (pids %v): checked the cgroups of running sandboxes only", f)
	}
	return running, listed
}

func TestRecoveryKill9KeepsSandboxes(t *testing.T) {
	needDaemon(t)
	restartDaemonOnCleanup(t)
	lbl := testLabel(t)
	labels := map[string]string{"suite": lbl}
	// The TTL covers the creates, execs, kill, restart and recovery below,
	// however slow the host.
	withTTL := newSandbox(t, api.SandboxSpec{TTL: 25, Labels: labels})
	withTTLCgroup := sandboxCgroupRel(t, withTTL.ID)
	b := newSandbox(t, api.SandboxSpec{Labels: labels})
	c := newSandbox(t, api.SandboxSpec{Labels: labels})
	if err := client.WriteFile(ctx(t), withTTL.ID, "/data/hello.txt", strings.NewReader("persisted\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	sh(t, b.ID, "echo b > /b; sleep 3600 &")
	before := sh(t, b.ID, "pidof sleep").Stdout

	off := logSize()
	d.kill9()
	t0 := time.Now()
	if err := d.start(); err != nil {
		t.Fatal(err)
	}
	t.Logf("daemon back after %s", time.Since(t0).Round(time.Millisecond))
	for _, sb := range []*api.Sandbox{withTTL, b, c} {
		got, err := client.GetSandbox(ctx(t), sb.ID)
		if err != nil || got.State != api.StateRunning {
			t.Fatalf("after restart %s: %+v %v", sb.ID, got, err)
		}
		if r := sh(t, sb.ID, "echo ok"); r.ExitCode != 0 || r.Stdout != "ok\n" {
			t.Fatalf("exec after restart in %s: %+v%s", sb.ID, r, deadHint(r))
		}
	}
	data, err := client.ReadFile(ctx(t), withTTL.ID, "/data/hello.txt")
	if err != nil || string(data) != "persisted\n" {
		t.Fatalf("file after restart: %q %v", data, err)
	}
	// The sandbox's processes lived through the restart.
	if r := sh(t, b.ID, "cat /b; pidof sleep"); r.Stdout != "b\n"+before {
		t.Errorf("after restart: %q, want %q", r.Stdout, "b\n"+before)
	}
	if m := regexp.MustCompile(`msg="recovery done".* adopted=(\d+)`).FindStringSubmatch(logSince(off)); m == nil {
		t.Errorf("no recovery summary in the log")
	} else if n, _ := strconv.Atoi(m[1]); n < 3 {
		t.Errorf("recovery adopted %d sandboxes, want at least 3", n)
	}
	// The TTL is still enforced, not before its time, by the new daemon.
	got := waitSandboxState(t, withTTL.ID, api.StateStopped, time.Until(*withTTL.ExpiresAt)+15*time.Second)
	if now := time.Now(); now.Before(*withTTL.ExpiresAt) {
		t.Errorf("stopped at %v, before its expiry %v", now, withTTL.ExpiresAt)
	}
	if !strings.Contains(got.Error, "ttl") {
		t.Errorf("error = %q, want ttl", got.Error)
	}
	assertReleased(t, withTTL.ID, withTTLCgroup)
	for _, sb := range []*api.Sandbox{b, c} {
		if r := sh(t, sb.ID, "echo ok"); r.Stdout != "ok\n" {
			t.Errorf("%s after the ttl stop of another: %+v", sb.ID, r)
		}
	}
}

// runtimeName returns the OCI runtime the daemon uses, from its state dir.
func runtimeName(t *testing.T) string {
	t.Helper()
	ents, _ := os.ReadDir(filepath.Join(d.stateDir, "runtime"))
	for _, e := range ents {
		if e.IsDir() && (e.Name() == "crun" || e.Name() == "runc") {
			return e.Name()
		}
	}
	return ""
}

// startStrayContainer runs a container with the daemon's runtime and
// --root, in cgroup <parent>/<id>, as a crashed edge could have left it.
// It returns the container's init pid.
func startStrayContainer(t *testing.T, rt, parent, id string) int {
	t.Helper()
	root := filepath.Join(d.stateDir, "runtime", rt)
	bundle := t.TempDir()
	bb, err := exec.LookPath("busybox")
	if err != nil {
		t.Skip("needs busybox for the stray container")
	}
	if err := os.MkdirAll(filepath.Join(bundle, "rootfs", "bin"), 0o755); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("cp", bb, filepath.Join(bundle, "rootfs", "bin", "busybox")).CombinedOutput(); err != nil {
		t.Fatalf("copying busybox: %v %s", err, out)
	}
	spec := exec.Command(rt, "spec")
	spec.Dir = bundle
	if out, err := spec.CombinedOutput(); err != nil {
		t.Fatalf("%s spec: %v %s", rt, err, out)
	}
	var cfg map[string]any
	raw, err := os.ReadFile(filepath.Join(bundle, "config.json"))
	if err != nil || json.Unmarshal(raw, &cfg) != nil {
		t.Fatalf("reading generated spec: %v", err)
	}
	proc := cfg["process"].(map[string]any)
	proc["terminal"] = false
	proc["args"] = []string{"/bin/busybox", "sleep", "3600"}
	cfg["linux"].(map[string]any)["cgroupsPath"] = parent + "/" + id
	raw, _ = json.Marshal(cfg)
	if err := os.WriteFile(filepath.Join(bundle, "config.json"), raw, 0o600); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = exec.Command(rt, "--root", root, "delete", "-f", id).Run()
		for _, h := range cgroupHierarchies() {
			_ = os.Remove(filepath.Join(h, parent, id))
		}
	})
	// The container inherits the runtime's stdio: a pipe would keep
	// CombinedOutput waiting for as long as the container lives.
	outFile, err := os.Create(filepath.Join(t.TempDir(), "run.out"))
	if err != nil {
		t.Fatal(err)
	}
	defer outFile.Close()
	run := exec.Command(rt, "--root", root, "run", "-d", "--bundle", bundle, id)
	run.Stdout, run.Stderr = outFile, outFile
	if err := run.Run(); err != nil {
		msg, _ := os.ReadFile(outFile.Name())
		t.Fatalf("%s run of the stray container: %v %s", rt, err, msg)
	}
	out, err := exec.Command(rt, "--root", root, "state", id).Output()
	var st struct {
		Pid    int    `json:"pid"`
		Status string `json:"status"`
	}
	if err != nil || json.Unmarshal(out, &st) != nil || st.Pid <= 0 || st.Status != "running" {
		t.Fatalf("%s state of the stray container: %s %v", rt, out, err)
	}
	return st.Pid
}

// processGone reports whether pid has exited (zombies count as gone).
func processGone(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return true
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i > 0 && len(s) > i+2 && s[i+2] == 'Z'
}

func TestRecoveryReapsOrphans(t *testing.T) {
	needDaemon(t)
	restartDaemonOnCleanup(t)
	const (
		garbageID = "sb-local-orphan1"
		cgroupID  = "sb-local-orphan2"
		strayID   = "sb-local-orphan3"
		halfID    = "sb-local-orphan4"
	)
	live := newSandbox(t, api.SandboxSpec{})
	sh(t, live.ID, "echo keep > /keep")
	parent := daemonCgroupParent(t)
	d.kill9()

	// A sandbox dir whose record is garbage.
	sbDir := filepath.Join(d.stateDir, "edge", "sandboxes")
	if err := os.MkdirAll(filepath.Join(sbDir, garbageID, "upper"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(sbDir, garbageID, "sandbox.json"), []byte("{not json\x00"), 0o600); err != nil {
		t.Fatal(err)
	}
	// A dir with no record at all (killed between mkdir and the first write).
	if err := os.MkdirAll(filepath.Join(sbDir, halfID, "rootfs"), 0o700); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = os.RemoveAll(filepath.Join(sbDir, garbageID))
		_ = os.RemoveAll(filepath.Join(sbDir, halfID))
	})
	// A stray cgroup in the pids and memory hierarchies (and the cgroup2 tree).
	var planted []string
	for _, m := range hostCgroupMounts() {
		if m.has("pids") || m.has("memory") || m.v2 {
			p := filepath.Join(m.root, parent, cgroupID)
			if err := os.Mkdir(p, 0o755); err != nil {
				t.Fatalf("planting cgroup: %v", err)
			}
			planted = append(planted, p)
		}
	}
	t.Cleanup(func() {
		for _, p := range planted {
			_ = os.Remove(p)
		}
	})
	if len(planted) == 0 {
		t.Fatal("no pids or memory cgroup hierarchy to plant an orphan in")
	}
	// A container the runtime runs under the daemon's --root, with no sandbox.
	strayPid := 0
	rt := runtimeName(t)
	if rt != "" {
		strayPid = startStrayContainer(t, rt, parent, strayID)
	} else {
		t.Log("no runtime state dir yet: skipping the stray container")
	}

	off := logSize()
	if err := d.start(); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{garbageID, halfID} {
		if _, err := os.Stat(filepath.Join(sbDir, id)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("orphan dir %s not reaped: %v", id, err)
		}
	}
	for _, p := range planted {
		if _, err := os.Stat(p); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("orphan cgroup %s not reaped", p)
		}
	}
	if strayPid > 0 {
		if _, err := os.Stat(filepath.Join(d.stateDir, "runtime", rt, strayID)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("stray container's runtime state not reaped: %v", err)
		}
		deadline := time.Now().Add(30 * time.Second)
		for !processGone(strayPid) && time.Now().Before(deadline) {
			time.Sleep(50 * time.Millisecond)
		}
		if !processGone(strayPid) {
			t.Errorf("stray container's process %d still alive", strayPid)
		}
		for _, h := range cgroupHierarchies() {
			if _, err := os.Stat(filepath.Join(h, parent, strayID)); err == nil {
				t.Errorf("stray container's cgroup left in %s", h)
			}
		}
	}
	logged := logSince(off)
	if !strings.Contains(logged, "reaping") {
		t.Errorf("the daemon log says nothing about reaping:\n%s", logged)
	}
	for _, id := range []string{garbageID, halfID, cgroupID} {
		if !strings.Contains(logged, id) {
			t.Errorf("the daemon log does not name reaped %s", id)
		}
	}
	if strayPid > 0 && !strings.Contains(logged, strayID) {
		t.Errorf("the daemon log does not name reaped %s", strayID)
	}
	// The live sandbox was adopted, not reaped.
	if r := sh(t, live.ID, "cat /keep"); r.Stdout != "keep\n" {
		t.Errorf("live sandbox after the reaping restart: %+v", r)
	}
	if _, err := client.GetSandbox(ctx(t), garbageID); err == nil {
		t.Errorf("reaped %s is listed by the API", garbageID)
	}
}

func TestRecoveryRestartMidCreate(t *testing.T) {
	needDaemon(t)
	restartDaemonOnCleanup(t)
	lbl := testLabel(t)
	labels := map[string]string{"suite": lbl}

	var (
		mu      sync.Mutex
		created []string
		failed  int
		wg      sync.WaitGroup
	)
	for range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			sb, err := client.CreateSandbox(c, api.SandboxSpec{Base: baseRef, Labels: labels})
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				failed++
				return
			}
			created = append(created, sb.ID)
		}()
	}
	delay := time.Duration(100+rand.IntN(200)) * time.Millisecond
	time.Sleep(delay)
	d.kill9()
	wg.Wait()
	t.Cleanup(func() {
		for _, id := range created {
			_ = client.DeleteSandbox(context.Background(), id)
		}
	})
	pre := snapshotNode(t)
	candidates := slices.Clone(created)
	candidates = append(candidates, pre.dirs...)
	candidates = append(candidates, pre.runtime...)
	t.Logf("killed after %s: %d creates answered, %d failed; on disk %d sandbox dirs, %d runtime states, %d overlays",
		delay, len(created), failed, len(pre.dirs), len(pre.runtime), len(pre.overlays))

	if err := d.start(); err != nil {
		t.Fatal(err)
	}
	running, _ := assertNodeConsistent(t, candidates)
	for _, id := range created {
		if !slices.Contains(running, id) {
			t.Errorf("sandbox %s was created (201) before the kill but is not running after the restart", id)
		}
	}
	for _, id := range running {
		if r := sh(t, id, "echo ok"); r.ExitCode != 0 || r.Stdout != "ok\n" {
			t.Errorf("running sandbox %s: %+v%s", id, r, deadHint(r))
		}
	}
	// Runtimes started just before the kill may still be finishing: look
	// again once they have had time to, 3 s, or on a busy host up to 30 s
	// for what they leave to settle.
	time.Sleep(3 * time.Second)
	for deadline := time.Now().Add(30 * time.Second); !nodeConsistent(t, candidates) && time.Now().Before(deadline); {
		time.Sleep(500 * time.Millisecond)
	}
	t.Log("second look, after the restart's runtimes settled")
	assertNodeConsistent(t, candidates)

	n, err := client.DeleteSandboxes(ctx(t), labels)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("deleted %d of the test's sandboxes", n)
	_, left := assertNodeConsistent(t, candidates)
	if all, _ := client.ListAllSandboxes(ctx(t), dsec.ListOptions{Labels: labels}); len(all) != 0 {
		t.Errorf("after delete by label: %d sandboxes listed", len(all))
	}
	s := snapshotNode(t)
	if len(left) == 0 {
		if len(s.dirs)+len(s.runtime)+len(s.overlays)+len(s.layerMounts) != 0 {
			t.Errorf("with no sandbox left: dirs %v runtime %v overlays %v layer mounts %v", s.dirs, s.runtime, s.overlays, s.layerMounts)
		}
	} else {
		t.Logf("sandboxes of other tests still listed: %v", left)
	}
}

func TestLeakCreateDelete200(t *testing.T) {
	needDaemon(t)
	lbl := testLabel(t)
	labels := map[string]string{"suite": lbl}
	var all []string
	t.Cleanup(func() {
		for _, id := range all {
			_ = client.DeleteSandbox(context.Background(), id)
		}
	})
	start := time.Now()
	for b := range 4 {
		t0 := time.Now()
		res, err := client.CreateSandboxes(ctx(t), 50, api.SandboxSpec{Base: baseRef, Labels: labels})
		if err != nil {
			t.Fatalf("batch %d: %v", b, err)
		}
		for _, sb := range res.Sandboxes {
			all = append(all, sb.ID)
		}
		if len(res.Errors) > 0 {
			t.Errorf("batch %d: %d errors, first %+v", b, len(res.Errors), res.Errors[0])
		}
		t.Logf("batch %d: 50 creates in %s (%s per create)", b, time.Since(t0).Round(time.Millisecond), (time.Since(t0) / 50).Round(time.Microsecond))
	}
	createTime := time.Since(start)
	if len(all) != 200 {
		t.Fatalf("created %d sandboxes, want 200", len(all))
	}
	if s := snapshotNode(t); len(s.overlays) < 200 || len(s.runtime) < 200 {
		t.Fatalf("with 200 sandboxes: %d overlays, %d runtime states", len(s.overlays), len(s.runtime))
	}
	for _, i := range []int{0, 77, 199} {
		if r := sh(t, all[i], "echo ok"); r.Stdout != "ok\n" {
			t.Errorf("sandbox %d: %+v", i, r)
		}
	}

	// Delete concurrently, one request per sandbox, like a busy client.
	start = time.Now()
	var wg sync.WaitGroup
	var mu sync.Mutex
	var lat time.Duration
	sem := make(chan struct{}, 16)
	for _, id := range all {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			t0 := time.Now()
			if err := client.DeleteSandbox(context.Background(), id); err != nil {
				t.Errorf("delete %s: %v", id, err)
			}
			mu.Lock()
			lat += time.Since(t0)
			mu.Unlock()
		}()
	}
	wg.Wait()
	deleteTime := time.Since(start)
	t.Logf("200 creates in %s: %s per create (batches of 50); 200 deletes in %s: %s per delete (16 at a time, mean latency %s)",
		createTime.Round(time.Millisecond), (createTime / 200).Round(time.Microsecond),
		deleteTime.Round(time.Millisecond), (deleteTime / 200).Round(time.Microsecond), (lat / 200).Round(time.Microsecond))

	if n, err := client.DeleteSandboxes(ctx(t), labels); err != nil || n != 0 {
		t.Errorf("delete by label after deleting all: %d %v, want 0", n, err)
	}
	_, left := assertNodeConsistent(t, all)
	s := snapshotNode(t)
	for _, id := range all {
		if slices.Contains(s.dirs, id) || slices.Contains(s.runtime, id) || len(s.cgroups[id]) > 0 {
			t.Errorf("%s leaked: dir %v runtime %v cgroups %v", id, slices.Contains(s.dirs, id), slices.Contains(s.runtime, id), s.cgroups[id])
		}
	}
	if len(left) == 0 {
		if len(s.overlays) != 0 || len(s.layerMounts) != 0 || len(s.runtime) != 0 || len(s.dirs) != 0 {
			t.Errorf("no sandbox exists but: overlays %v, layer mounts %v, runtime %v, dirs %v", s.overlays, s.layerMounts, s.runtime, s.dirs)
		}
	} else {
		t.Logf("%d sandboxes of other tests still exist: %v", len(left), left)
	}
	// Leftover cgroups of this test's sandboxes in any hierarchy, by glob
	// as an operator would look.
	for _, pat := range []string{"/sys/fs/cgroup/*/dsec/sb-*", "/sys/fs/cgroup/*/dsec/*/sb-*",
		"/sys/fs/cgroup/unified/dsec/sb-*", "/sys/fs/cgroup/unified/dsec/*/sb-*"} {
		m, _ := filepath.Glob(pat)
		for _, p := range m {
			if slices.Contains(all, filepath.Base(p)) {
				t.Errorf("leaked cgroup %s", p)
			}
		}
	}
}

// A second dsec instance on the same host (another state dir, another
// port) must not touch this one's sandboxes when it starts and reaps.
func TestRecoveryLeavesOtherInstancesAlone(t *testing.T) {
	needDaemon(t)
	sb := newSandbox(t, api.SandboxSpec{})
	sh(t, sb.ID, "echo mine > /mine")

	dir := t.TempDir()
	logPath := filepath.Join(dir, "other.log")
	logf, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	other := exec.Command(d.bin, "up", "--listen", freeAddr(), "--state-dir", filepath.Join(dir, "state"),
		"--api-key", "other-instance-key-0123456789", "--config", filepath.Join(dir, "config.json"))
	other.Stdout, other.Stderr = logf, logf
	if err := other.Start(); err != nil {
		t.Fatal(err)
	}
	stopped := false
	stop := func() {
		if stopped {
			return
		}
		stopped = true
		_ = other.Process.Signal(os.Interrupt)
		done := make(chan struct{})
		go func() { _ = other.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			_ = other.Process.Kill()
			<-done
		}
	}
	t.Cleanup(stop)
	deadline := time.Now().Add(30 * time.Second)
	for {
		b, _ := os.ReadFile(logPath)
		if strings.Contains(string(b), "recovery done") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("second instance did not finish recovery:\n%s", b)
		}
		time.Sleep(50 * time.Millisecond)
	}
	stop()
	b, _ := os.ReadFile(logPath)
	if strings.Contains(string(b), sb.ID) {
		t.Errorf("the second instance (state dir %s) acted on this instance's sandbox %s:\n%s", filepath.Join(dir, "state"), sb.ID, grepLines(string(b), sb.ID))
	}
	res, err := client.Exec(ctx(t), sb.ID, api.ExecRequest{Cmd: "cat /mine"})
	if err != nil || res.ExitCode != 0 || res.Stdout != "mine\n" {
		t.Fatalf("sandbox after another instance started: %+v %v", res, err)
	}
}

func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
