package e2e

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
)

// The gvisor backend through the whole stack: the API, the edge's
// lifecycle, files, sessions, network policy, pause, snapshots, restart
// recovery and the seccomp prober, each against sandboxes with
// "backend": "gvisor" (runsc, installed by make test's setup).

// needGVisor skips unless the daemon offers the gvisor backend.
func needGVisor(t *testing.T) {
	t.Helper()
	needBackend(t, api.BackendGVisor, "apt-get install runsc")
}

// needBackend skips unless the daemon offers backend (hint says how to
// get it).
func needBackend(t *testing.T, backend, hint string) {
	t.Helper()
	needDaemon(t)
	nodes, err := client.ListNodes(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range nodes {
		if slices.Contains(n.Backends, backend) {
			return
		}
	}
	t.Skipf("the daemon offers no %s backend (%s)", backend, hint)
}

func gvSandbox(t *testing.T, spec api.SandboxSpec) *api.Sandbox {
	t.Helper()
	spec.Backend = api.BackendGVisor
	return newSandbox(t, spec)
}

// runscState lists the sandboxes runsc keeps state for.
func runscState(t *testing.T) []string {
	t.Helper()
	ents, _ := os.ReadDir(filepath.Join(d.stateDir, "runsc"))
	var ids []string
	for _, e := range ents {
		if name, ok := strings.CutSuffix(e.Name(), ".state"); ok {
			ids = append(ids, name)
		}
	}
	return ids
}

func TestGVisorLifecycleExecFilesSessions(t *testing.T) {
	needGVisor(t)
	sb := gvSandbox(t, api.SandboxSpec{Env: map[string]string{"SPEC_VAR": "v"}, Workdir: "/tmp"})
	if sb.Backend != api.BackendGVisor {
		t.Fatalf("backend %q, want gvisor", sb.Backend)
	}
	c := ctx(t)
	// The kernel it runs on is gVisor's, not the host's.
	host, err := exec.Command("uname", "-r").Output()
	if err != nil {
		t.Fatal(err)
	}
	r := sh(t, sb.ID, "uname -r; echo \"$SPEC_VAR $(pwd)\"; echo err >&2; exit 3")
	if r.ExitCode != 3 || r.Stderr != "err\n" || !strings.HasSuffix(r.Stdout, "v /tmp\n") || strings.HasPrefix(r.Stdout, strings.TrimSpace(string(host))) {
		t.Fatalf("exec: %+v (host kernel %s)", r, host)
	}
	res, err := client.Exec(c, sb.ID, api.ExecRequest{Cmd: "id -u; pwd", User: "user", Cwd: "/home/user"})
	if err != nil || res.Stdout != "1000\n/home/user\n" {
		t.Fatalf("user: %+v %v", res, err)
	}
	res, err = client.Exec(c, sb.ID, api.ExecRequest{Cmd: "wc -c", Stdin: "hello"})
	if err != nil || strings.TrimSpace(res.Stdout) != "5" {
		t.Fatalf("stdin: %+v %v", res, err)
	}
	// Files: the host's view and the sandbox's are one.
	if err := client.WriteFile(c, sb.ID, "/tmp/in", strings.NewReader("from-api"), 0o644); err != nil {
		t.Fatal(err)
	}
	if r := sh(t, sb.ID, "cat /tmp/in; echo from-inside > /root/out"); r.Stdout != "from-api" {
		t.Fatalf("file written by the API, read inside: %+v", r)
	}
	if b, err := client.ReadFile(c, sb.ID, "/root/out"); err != nil || string(b) != "from-inside\n" {
		t.Fatalf("file written inside, read by the API: %q %v", b, err)
	}
	// A timeout kills the command's whole tree inside.
	start := time.Now()
	res, err = client.Exec(c, sb.ID, api.ExecRequest{Cmd: "sleep 300 & (sh -c 'sleep 300') & echo started; wait", Timeout: 1})
	if err != nil || !res.TimedOut || res.Stdout != "started\n" || time.Since(start) > 15*time.Second {
		t.Fatalf("timeout: %+v %v after %v", res, err, time.Since(start))
	}
	waitFor(t, func() bool {
		return strings.TrimSpace(sh(t, sb.ID, "ps -o comm | grep -c '^sleep' || true").Stdout) == "0"
	})
	// Sessions keep state; a timed-out command is killed (a bash session
	// survives it).
	sid, err := client.CreateSession(c, sb.ID, api.SessionRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := client.SessionRun(c, sb.ID, sid, api.SessionRunRequest{Command: "cd /root && export KEEP=me"}); err != nil {
		t.Fatal(err)
	}
	if r, err := client.SessionRun(c, sb.ID, sid, api.SessionRunRequest{Command: "pwd; echo $KEEP"}); err != nil || r.Stdout != "/root\nme\n" {
		t.Fatalf("session: %+v %v", r, err)
	}
	if r, err := client.SessionRun(c, sb.ID, sid, api.SessionRunRequest{Command: "sleep 300; echo not-killed", Timeout: 1}); err != nil || !r.TimedOut {
		t.Fatalf("session timeout: %+v %v", r, err)
	}
	waitFor(t, func() bool {
		return strings.TrimSpace(sh(t, sb.ID, "ps -o comm | grep -c '^sleep' || true").Stdout) == "0"
	})
	// Delete leaves no runsc state and no process behind.
	if err := client.DeleteSandbox(c, sb.ID); err != nil {
		t.Fatal(err)
	}
	if slices.Contains(runscState(t), sb.ID+"_sandbox:"+sb.ID) {
		t.Fatalf("runsc state of %s left after delete", sb.ID)
	}
	out, _ := exec.Command("ps", "-eo", "args").Output()
	for _, line := range strings.Split(string(out), "\n") {
		if strings.Contains(line, "runsc") && strings.Contains(line, sb.ID) {
			t.Fatalf("runsc process of %s left after delete: %s", sb.ID, line)
		}
	}
}

func TestGVisorRefusesWhatItCannotDo(t *testing.T) {
	needGVisor(t)
	_, err := client.CreateSandbox(ctx(t), api.SandboxSpec{Base: baseRef, Backend: api.BackendGVisor, UserNS: new(true)})
	wantCode(t, err, "failed_precondition")
}

func TestGVisorNetworkPolicy(t *testing.T) {
	needNet(t)
	needGVisor(t)
	lo := gvSandbox(t, api.SandboxSpec{Toolkits: []string{probeRef}})
	if r := sh(t, lo.ID, "ip -o link | grep -v ': lo:' | wc -l"); strings.TrimSpace(r.Stdout) != "0" {
		t.Fatalf("a gvisor sandbox without policy has interfaces besides lo: %q", r.Stdout)
	}
	mustNotReach(t, lo.ID, "dial", pypiAddr+":80")
	mustNotReach(t, lo.ID, "resolve", pypiName)
	// Its stack took its interfaces at start: network cannot be added
	// later, and saying so beats a policy that silently does nothing.
	_, err := client.SetNetwork(ctx(t), lo.ID, api.NetworkPolicy{Allow: []string{"pypi"}})
	wantCode(t, err, "failed_precondition")
	mustNotReach(t, lo.ID, "resolve", pypiName)

	sb := gvSandbox(t, api.SandboxSpec{Toolkits: []string{probeRef}, Network: &api.NetworkPolicy{Allow: []string{"pypi"}}})
	mustReach(t, sb.ID, "hello from pypi", "get", "http://"+pypiName+"/")
	mustNotReach(t, sb.ID, "get", "http://"+npmName+"/")
	mustNotReach(t, sb.ID, "dial", npmAddr+":80")
	mustNotReach(t, sb.ID, "dial", pypiAddr+":9000")
	secret := "Z3Zpc29yLXNlY3JldA.exfil.e2e.test"
	mustNotReach(t, sb.ID, "resolve", secret)
	if upstreamSaw(secret) {
		t.Fatalf("CONTAINMENT FAILURE: upstream DNS was asked %s", secret)
	}
	// Live change: the host-side rules apply to gVisor's stack as to a
	// container's.
	if _, err := client.SetNetwork(ctx(t), sb.ID, api.NetworkPolicy{Allow: []string{"npm"}}); err != nil {
		t.Fatal(err)
	}
	mustReach(t, sb.ID, "hello from npm", "get", "http://"+npmName+"/")
	mustNotReach(t, sb.ID, "dial", pypiAddr+":80")
}

func TestGVisorPauseSnapshotFork(t *testing.T) {
	needGVisor(t)
	sb := gvSandbox(t, api.SandboxSpec{Workspace: workspaceRef})
	c := ctx(t)
	sh(t, sb.ID, "echo kept > /repo/kept; (i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.1; done) >/dev/null 2>&1 &")
	waitFor(t, func() bool { return upperFile(t, sb.ID, "tmp/count") != "" })
	res, err := client.Pause(c, sb.ID)
	if err != nil || res.Sandbox.State != api.StatePaused {
		t.Fatalf("pause: %+v %v", res, err)
	}
	before := upperFile(t, sb.ID, "tmp/count")
	time.Sleep(700 * time.Millisecond)
	if after := upperFile(t, sb.ID, "tmp/count"); after != before {
		t.Fatalf("counter moved while paused: %q -> %q", before, after)
	}
	// Any exec resumes transparently.
	if r := sh(t, sb.ID, "cat /repo/kept"); r.Stdout != "kept\n" {
		t.Fatalf("after transparent resume: %+v", r)
	}
	n1 := counterValue(t, sb.ID)
	waitFor(t, func() bool { return counterValue(t, sb.ID) > n1 })

	ref := snapRef("gvisor")
	l, err := client.Snapshot(c, sb.ID, api.SnapshotRequest{Ref: ref})
	if err != nil {
		t.Fatal(err)
	}
	from := gvSandbox(t, api.SandboxSpec{Snapshot: ref})
	if r := sh(t, from.ID, "cat /repo/kept"); r.Stdout != "kept\n" || from.Layers[len(from.Layers)-1] != l.Digest {
		t.Fatalf("sandbox from a gvisor snapshot: %+v layers %v", r, from.Layers)
	}
	fr, err := client.Fork(c, sb.ID, 1, nil)
	if err != nil || len(fr.Sandboxes) != 1 {
		t.Fatalf("fork: %+v %v", fr, err)
	}
	fork := fr.Sandboxes[0]
	t.Cleanup(func() { _ = client.DeleteSandbox(ctx(t), fork.ID) })
	if fork.Backend != api.BackendGVisor {
		t.Fatalf("fork of a gvisor sandbox runs on %q", fork.Backend)
	}
	if r := sh(t, fork.ID, "cat /repo/kept; echo mine > /repo/kept"); r.Stdout != "kept\n" {
		t.Fatalf("fork: %+v", r)
	}
	if r := sh(t, sb.ID, "cat /repo/kept"); r.Stdout != "kept\n" {
		t.Fatalf("the fork's write reached its source: %+v", r)
	}
}

func TestGVisorSurvivesEdgeRestart(t *testing.T) {
	needGVisor(t)
	keep := gvSandbox(t, api.SandboxSpec{})
	sh(t, keep.ID, "echo before > /root/f")
	d.kill9()
	if err := d.start(); err != nil {
		t.Fatal(err)
	}
	if r := sh(t, keep.ID, "cat /root/f"); r.Stdout != "before\n" {
		t.Fatalf("gvisor sandbox after an edge restart: %+v", r)
	}
	got, err := client.GetSandbox(ctx(t), keep.ID)
	if err != nil || got.State != api.StateRunning || got.Backend != api.BackendGVisor {
		t.Fatalf("after restart: %+v %v", got, err)
	}
}

// TestGVisorSeccompProber runs the attack prober of the container backend
// against gVisor: dsec's profile is enforced on gVisor's processes too
// (init by runsc, exec'd commands by the backend's helper).
func TestGVisorSeccompProber(t *testing.T) {
	needGVisor(t)
	seccompAttack(t, api.BackendGVisor, gvisorProberDiffers)
}

// gvisorProberDiffers are the prober's verdicts that differ under gVisor,
// none of them a weaker wall: gVisor's /proc has no ns/mnt, so setns has
// nothing to open (the open fails before the filter is reached); and its
// netlink has no sock_diag (a feature it lacks: ss and similar tools do
// not work inside).
var gvisorProberDiffers = map[string]proberWant{
	"setns_mnt":                wantFail,
	"socket_netlink_sock_diag": wantInfo,
}

// TestGVisorSeccompFilterNotLeaked: the helper takes DSEC_SECCOMP out of
// the command's environment.
func TestGVisorSeccompFilterNotLeaked(t *testing.T) {
	needGVisor(t)
	sb := gvSandbox(t, api.SandboxSpec{})
	r := sh(t, sb.ID, "env; cat /proc/self/environ")
	if bytes.Contains([]byte(r.Stdout), []byte("DSEC_SECCOMP")) {
		t.Fatalf("the filter's variable reached the command: %q", r.Stdout)
	}
}
