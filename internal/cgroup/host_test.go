package cgroup

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/mountinfo"
)

func needRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: creates cgroups and moves processes into them")
	}
}

// statfsMode classifies the host the way runc and crun do, by filesystem
// type rather than mountinfo, as an independent check of Detect.
func statfsMode(t *testing.T) Mode {
	var st unix.Statfs_t
	if err := unix.Statfs("/sys/fs/cgroup", &st); err != nil {
		t.Skipf("needs /sys/fs/cgroup: %v", err)
	}
	if st.Type == unix.CGROUP2_SUPER_MAGIC {
		return V2
	}
	if unix.Statfs("/sys/fs/cgroup/unified", &st) == nil && st.Type == unix.CGROUP2_SUPER_MAGIC {
		return Hybrid
	}
	return V1
}

func TestDetectHost(t *testing.T) {
	want := statfsMode(t)
	info, err := Detect()
	if err != nil {
		t.Fatalf("Detect: %v", err)
	}
	t.Logf("host: mode=%v v2root=%q unified=%v v1=%v", info.Mode, info.V2Root, info.UnifiedControllers, info.V1)
	if info.Mode != want {
		t.Errorf("Detect: Mode = %v, statfs says %v", info.Mode, want)
	}
	if info.Mode != V1 && info.V2Root == "" {
		t.Errorf("Detect: no V2Root in mode %v", info.Mode)
	}
}

// TestPrepareForCrunIdempotent runs PrepareForCrun only on hosts that are
// already acceptable to crun: a test must not rebind controllers on the
// host, but calling it again must change nothing.
func TestPrepareForCrunIdempotent(t *testing.T) {
	needRoot(t)
	info, err := Detect()
	if err != nil {
		t.Fatal(err)
	}
	if ok, reason := info.CrunCompatible(); !ok {
		t.Skipf("host not prepared for crun (%s); not mounting hierarchies from a test", reason)
	}
	actions, err := info.PrepareForCrun()
	if err != nil || len(actions) != 0 {
		t.Fatalf("PrepareForCrun = %q, %v; want no actions", actions, err)
	}
	if info.Mode == Hybrid && len(info.UnifiedControllers) != 0 {
		t.Errorf("UnifiedControllers = %v after PrepareForCrun", info.UnifiedControllers)
	}
}

// TestLifecycle walks a sandbox's cgroup through its life on the host as
// detected: parent, child (created as a runtime would, by mkdir), stats,
// freeze, thaw, and removal with live, frozen processes inside.
func TestLifecycle(t *testing.T) {
	needRoot(t)
	info, err := Detect()
	if err != nil {
		t.Fatal(err)
	}
	lifecycle(t, info, true)
}

// TestLifecycleV2OnHybrid exercises the cgroup2 code paths (cgroup.kill,
// cgroup.freeze, cpu.stat) on a hybrid host by treating its cgroup2 tree as
// a pure v2 host. Its controllers are bound to v1, so EnsureParent's v2
// controller checks are skipped and memory and pids read as zero.
func TestLifecycleV2OnHybrid(t *testing.T) {
	needRoot(t)
	host, err := Detect()
	if err != nil {
		t.Fatal(err)
	}
	if host.Mode != Hybrid {
		t.Skipf("needs a hybrid host; this one is %v (TestLifecycle covers it)", host.Mode)
	}
	info := &Info{Mode: V2, V2Root: host.V2Root, V1: map[string]string{}, UnifiedControllers: host.UnifiedControllers}
	lifecycle(t, info, false)
}

func lifecycle(t *testing.T, info *Info, ensure bool) {
	parent := fmt.Sprintf("/dsec-test-%d-%08x", os.Getpid(), rand.Uint32())
	child := parent + "/box"
	t.Cleanup(func() {
		if err := info.Remove(parent); err != nil {
			t.Errorf("cleanup: Remove(%s): %v", parent, err)
		}
	})

	if ensure {
		for range 2 { // idempotent
			if err := info.EnsureParent(parent); err != nil {
				t.Fatalf("EnsureParent(%s): %v", parent, err)
			}
		}
		checkParent(t, info, parent)
	} else {
		for _, root := range info.roots() {
			if err := os.Mkdir(filepath.Join(root, parent), 0o755); err != nil {
				t.Fatal(err)
			}
		}
	}

	// Like a runtime: the child in every hierarchy, the process in all of
	// them but cpuset (whose child would need cpus and mems filled in).
	var procsFiles []string
	for _, root := range info.roots() {
		if err := os.Mkdir(filepath.Join(root, child), 0o755); err != nil {
			t.Fatalf("creating child cgroup: %v", err)
		}
		if root != info.V1["cpuset"] {
			procsFiles = append(procsFiles, filepath.Join(root, child, "cgroup.procs"))
		}
	}
	sleeper := startIn(t, procsFiles, "sleep", "600")
	spinner := startIn(t, procsFiles, "yes") // burns CPU: shows freezing

	procs, err := info.Procs(child)
	if err != nil {
		t.Fatalf("Procs(%s): %v", child, err)
	}
	if !slices.Contains(procs, sleeper.pid) || !slices.Contains(procs, spinner.pid) {
		t.Errorf("Procs(%s) = %v, want %d and %d", child, procs, sleeper.pid, spinner.pid)
	}
	if procs, err := info.Procs(parent); err != nil || len(procs) != 2 {
		t.Errorf("Procs(%s) = %v, %v; want the two of the child", parent, procs, err)
	}
	if names, err := info.Children(parent); err != nil || !slices.Equal(names, []string{"box"}) {
		t.Errorf("Children(%s) = %v, %v; want [box]", parent, names, err)
	}

	var st Stats
	waitFor(t, "cpu usage to show", func() bool {
		st, err = info.Stats(child)
		if err != nil {
			t.Fatalf("Stats(%s): %v", child, err)
		}
		return st.CPUUsageNS > 0
	})
	t.Logf("stats: %+v", st)
	if info.hasController("pids") && st.Pids < 2 {
		t.Errorf("Stats.Pids = %d, want >= 2", st.Pids)
	}
	if info.hasController("memory") && st.MemoryBytes == 0 {
		t.Errorf("Stats.MemoryBytes = 0, want > 0")
	}

	ctx := context.Background()
	if f, err := info.Frozen(child); err != nil || f {
		t.Fatalf("Frozen before Freeze = %v, %v", f, err)
	}
	if err := info.Freeze(ctx, child); err != nil {
		t.Fatalf("Freeze(%s): %v", child, err)
	}
	if f, err := info.Frozen(child); err != nil || !f {
		t.Fatalf("Frozen after Freeze = %v, %v", f, err)
	}
	if s := procState(t, spinner.pid); s == "R" {
		t.Errorf("spinner state %s after Freeze, want stopped", s)
	}
	t.Logf("frozen states: sleep %s, yes %s", procState(t, sleeper.pid), procState(t, spinner.pid))
	before := cpuTicks(t, spinner.pid)
	time.Sleep(300 * time.Millisecond)
	if after := cpuTicks(t, spinner.pid); after != before {
		t.Errorf("frozen spinner used CPU: %d -> %d ticks", before, after)
	}

	if err := info.Thaw(child); err != nil {
		t.Fatalf("Thaw(%s): %v", child, err)
	}
	if f, err := info.Frozen(child); err != nil || f {
		t.Fatalf("Frozen after Thaw = %v, %v", f, err)
	}
	waitFor(t, "spinner to run after Thaw", func() bool { return cpuTicks(t, spinner.pid) > before })

	// Remove must cope with frozen processes: SIGKILL waits for a v1 thaw.
	if err := info.Freeze(ctx, child); err != nil {
		t.Fatalf("Freeze(%s): %v", child, err)
	}
	if err := info.Remove(parent); err != nil {
		t.Fatalf("Remove(%s): %v", parent, err)
	}
	for _, p := range []*proc{sleeper, spinner} {
		if sig := p.waitSignal(t); sig != syscall.SIGKILL {
			t.Errorf("pid %d ended by %v, want SIGKILL", p.pid, sig)
		}
	}
	for _, root := range info.roots() {
		if _, err := os.Stat(filepath.Join(root, parent)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s still there after Remove (stat: %v)", filepath.Join(root, parent), err)
		}
	}

	if err := info.Remove(parent); err != nil {
		t.Errorf("second Remove(%s) = %v, want nil", parent, err)
	}
	if _, err := info.Stats(parent); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Stats after Remove = %v, want not found", err)
	}
	if _, err := info.Procs(parent); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Procs after Remove = %v, want not found", err)
	}
	if err := info.Freeze(ctx, parent); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Freeze after Remove = %v, want not found", err)
	}
	if names, err := info.Children(parent); err != nil || len(names) != 0 {
		t.Errorf("Children after Remove = %v, %v; want none", names, err)
	}
}

// checkParent verifies what EnsureParent promises beyond the directories.
func checkParent(t *testing.T, info *Info, parent string) {
	t.Helper()
	for _, root := range info.roots() {
		if !isDir(filepath.Join(root, parent)) {
			t.Errorf("EnsureParent: %s missing", filepath.Join(root, parent))
		}
	}
	if root, ok := info.V1["cpuset"]; ok {
		for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
			if v, err := readString(filepath.Join(root, parent, f)); err != nil || v == "" {
				t.Errorf("EnsureParent: %s = %q, %v; want copied from the parent", f, v, err)
			}
		}
		// A child made by mkdir alone has cpus and mems, with no write
		// that would rebuild the scheduler domains.
		probe := filepath.Join(root, parent, "clone-probe")
		if err := os.Mkdir(probe, 0o755); err != nil {
			t.Fatal(err)
		}
		defer os.Remove(probe)
		for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
			if v, err := readString(filepath.Join(probe, f)); err != nil || v == "" {
				t.Errorf("a new child of the parent: %s = %q, %v; want the parent's (cgroup.clone_children)", f, v, err)
			}
		}
	}
	if info.Mode == V2 {
		for _, dir := range []string{info.V2Root, filepath.Join(info.V2Root, parent)} {
			have, err := readList(filepath.Join(dir, "cgroup.subtree_control"))
			if err != nil {
				t.Fatal(err)
			}
			for _, c := range v2Required {
				if !slices.Contains(have, c) {
					t.Errorf("EnsureParent: %s not enabled in %s (have %v)", c, dir, have)
				}
			}
		}
	}
}

func (i *Info) hasController(c string) bool {
	_, ok := i.V1[c]
	return ok || (i.Mode == V2 && slices.Contains(i.UnifiedControllers, c))
}

type proc struct {
	pid  int
	cmd  *exec.Cmd
	done chan struct{}
	err  error
}

// startIn starts argv after its shell has joined the cgroups whose
// cgroup.procs files are given, and returns once argv is running (so its
// memory is charged to the new cgroups, not the test's).
func startIn(t *testing.T, procsFiles []string, argv ...string) *proc {
	t.Helper()
	script := `for f in $DSEC_TEST_PROCS; do echo $$ > "$f" || exit 1; done; exec "$@"`
	cmd := exec.Command("sh", append([]string{"-c", script, "sh"}, argv...)...)
	cmd.Env = append(os.Environ(), "DSEC_TEST_PROCS="+strings.Join(procsFiles, " "))
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting %s: %v", argv[0], err)
	}
	p := &proc{pid: cmd.Process.Pid, cmd: cmd, done: make(chan struct{})}
	go func() { p.err = cmd.Wait(); close(p.done) }()
	t.Cleanup(func() {
		cmd.Process.Kill()
		<-p.done
	})
	name := filepath.Base(argv[0])
	waitFor(t, name+" to start", func() bool {
		select {
		case <-p.done:
			t.Fatalf("%s exited early: %v", name, p.err)
		default:
		}
		comm, _ := readString(fmt.Sprintf("/proc/%d/comm", p.pid))
		return comm == name
	})
	return p
}

func (p *proc) waitSignal(t *testing.T) syscall.Signal {
	t.Helper()
	select {
	case <-p.done:
	case <-time.After(30 * time.Second):
		t.Fatalf("pid %d still running after Remove", p.pid)
	}
	ws, ok := p.cmd.ProcessState.Sys().(syscall.WaitStatus)
	if !ok || !ws.Signaled() {
		return 0
	}
	return ws.Signal()
}

// procState returns the one-letter state from /proc/<pid>/status.
func procState(t *testing.T, pid int) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "State:"); ok {
			return strings.Fields(v)[0]
		}
	}
	t.Fatalf("no State in /proc/%d/status", pid)
	return ""
}

// cpuTicks returns utime+stime of pid in clock ticks.
func cpuTicks(t *testing.T, pid int) uint64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		t.Fatal(err)
	}
	// Fields after the parenthesised command name; utime and stime are
	// fields 14 and 15 of the whole line.
	s := string(b)
	fields := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	utime, _ := strconv.ParseUint(fields[11], 10, 64)
	stime, _ := strconv.ParseUint(fields[12], 10, 64)
	return utime + stime
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestPrefetchAdvisesFileMappings(t *testing.T) {
	needRoot(t)
	info, err := Detect()
	if err != nil {
		t.Fatal(err)
	}
	// Our own process has file mappings (the test binary, libc if any):
	// prefetching them must be accepted by the kernel.
	if got := prefetchPid(os.Getpid()); got == 0 {
		t.Fatalf("prefetchPid(self) advised no ranges; mappings: %d", len(fileMappings(os.Getpid())))
	}
	if _, err := info.Prefetch("/dsec-no-such-cgroup"); err == nil {
		t.Fatal("Prefetch of a missing cgroup succeeded")
	}
}

func TestFavorDynModsHost(t *testing.T) {
	needRoot(t)
	info, err := Detect()
	if err != nil {
		t.Fatal(err)
	}
	options := func() (string, []string) {
		mounts, err := mountinfo.Read()
		if err != nil {
			t.Fatal(err)
		}
		target, opts, ok := dynModsTarget(info, mounts)
		if !ok {
			t.Fatalf("no cgroup mount to remount on a %v host", info.Mode)
		}
		return target, opts
	}
	_, before := options()
	changed, err := info.FavorDynMods()
	if err != nil {
		t.Fatalf("FavorDynMods: %v", err)
	}
	target, after := options()
	if !slices.Contains(after, "favordynmods") {
		t.Fatalf("after FavorDynMods (changed=%v) %s has options %v", changed, target, after)
	}
	for _, o := range before {
		if !slices.Contains(after, o) {
			t.Errorf("remount lost option %s: before %v, after %v", o, before, after)
		}
	}
	if changed, err := info.FavorDynMods(); err != nil || changed {
		t.Fatalf("second FavorDynMods: changed=%v err=%v", changed, err)
	}
}

func TestRemoveParentHost(t *testing.T) {
	needRoot(t)
	info, err := Detect()
	if err != nil {
		t.Fatal(err)
	}
	parent := fmt.Sprintf("/dsec-test-rm-%d", rand.IntN(1e9))
	if err := info.EnsureParent(parent + "/inst"); err != nil {
		t.Fatal(err)
	}
	defer info.RemoveParent(parent)
	// A child cgroup keeps the parent.
	child := filepath.Join(info.roots()[0], parent, "inst", "sb")
	if err := os.Mkdir(child, 0o755); err != nil {
		t.Fatal(err)
	}
	if gone, err := info.RemoveParent(parent + "/inst"); err != nil || gone {
		t.Fatalf("RemoveParent with a child: gone=%v err=%v, want kept", gone, err)
	}
	if err := os.Remove(child); err != nil {
		t.Fatal(err)
	}
	if gone, err := info.RemoveParent(parent + "/inst"); err != nil || !gone {
		t.Fatalf("RemoveParent: gone=%v err=%v", gone, err)
	}
	if info.exists(parent + "/inst") {
		t.Fatal("parent still exists")
	}
	if gone, err := info.RemoveParent(parent + "/inst"); err != nil || !gone {
		t.Fatalf("RemoveParent again: gone=%v err=%v", gone, err)
	}
	if _, err := info.RemoveParent("../x"); err == nil {
		t.Fatal("RemoveParent accepted a relative path")
	}
}

// TestRelOfTheRootCgroup: a process in the root cgroup of every hierarchy
// is in "/" (callers refuse to remove that), not "/cgroup.procs".
func TestRelOfTheRootCgroup(t *testing.T) {
	needRoot(t)
	info, err := Detect()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("sleep", "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	pid := strconv.Itoa(cmd.Process.Pid)
	for _, root := range info.roots() {
		if err := os.WriteFile(filepath.Join(root, "cgroup.procs"), []byte(pid), 0); err != nil {
			t.Fatalf("moving pid %s to %s: %v", pid, root, err)
		}
	}
	if rel, err := info.RelOf(cmd.Process.Pid); err != nil || rel != "/" {
		t.Fatalf("RelOf of a process in the root cgroup = %q, %v; want /", rel, err)
	}
}
