package e2e

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
)

// The microvm backend through the whole stack: a VM per sandbox (QEMU,
// software-emulated on this machine: each boot takes seconds, so these
// tests boot few), created, used, paused to a snapshot file, resumed by a
// request, put on the edge's network policy, adopted after an edge
// restart and deleted without a trace.

// needMicroVM skips unless the daemon offers the microvm backend.
func needMicroVM(t *testing.T) {
	t.Helper()
	needBackend(t, api.BackendMicroVM, "apt-get install qemu-system-x86; the guest kernel comes from apt")
}

func vmSandbox(t *testing.T, spec api.SandboxSpec) *api.Sandbox {
	t.Helper()
	spec.Backend = api.BackendMicroVM
	return newSandbox(t, spec)
}

// vmmsOf lists the VMM processes of sandbox id.
func vmmsOf(t *testing.T, id string) []string {
	t.Helper()
	out, _ := exec.Command("ps", "-eo", "pid,args").Output()
	var vmms []string
	for _, line := range strings.Split(string(out), "\n") {
		if strings.Contains(line, "qemu") && strings.Contains(line, "/"+id+"/") {
			vmms = append(vmms, line)
		}
	}
	return vmms
}

func TestMicroVMLifecycleExecSessionsPause(t *testing.T) {
	needMicroVM(t)
	sb := vmSandbox(t, api.SandboxSpec{Env: map[string]string{"SPEC_VAR": "v"}, Workdir: "/tmp", MemoryMB: 256, Pids: 64})
	c := ctx(t)
	if len(vmmsOf(t, sb.ID)) != 1 {
		t.Fatalf("VMMs of %s: %v", sb.ID, vmmsOf(t, sb.ID))
	}
	// Its own kernel, its memory limit as the VM's memory.
	host, _ := os.ReadFile("/proc/sys/kernel/osrelease")
	r := sh(t, sb.ID, "uname -r; echo \"$SPEC_VAR $(pwd)\"; grep MemTotal /proc/meminfo; echo err >&2; exit 3")
	lines := strings.Split(r.Stdout, "\n")
	if r.ExitCode != 3 || r.Stderr != "err\n" || len(lines) < 3 || lines[0] == strings.TrimSpace(string(host)) || lines[1] != "v /tmp" {
		t.Fatalf("exec: %+v (host kernel %s)", r, host)
	}
	var memKB int
	if f := strings.Fields(lines[2]); len(f) > 1 {
		memKB, _ = strconv.Atoi(f[1])
	}
	if memKB < 150<<10 || memKB > 256<<10 {
		t.Fatalf("guest memory %d kB, want the sandbox's 256 MiB less the kernel's", memKB)
	}
	res, err := client.Exec(c, sb.ID, api.ExecRequest{Cmd: "id -u; pwd", User: "user", Cwd: "/home/user"})
	if err != nil || res.Stdout != "1000\n/home/user\n" {
		t.Fatalf("user: %+v %v", res, err)
	}
	res, err = client.Exec(c, sb.ID, api.ExecRequest{Cmd: "wc -c", Stdin: "hello"})
	if err != nil || strings.TrimSpace(res.Stdout) != "5" {
		t.Fatalf("stdin: %+v %v", res, err)
	}
	_, err = client.Exec(c, sb.ID, api.ExecRequest{Cmd: "true", User: "nosuchuser"})
	wantCode(t, err, "invalid_argument")
	res, err = client.Exec(c, sb.ID, api.ExecRequest{Argv: []string{"/no/such/binary"}})
	if err != nil || res.ExitCode != 127 {
		t.Fatalf("missing binary: %+v %v", res, err)
	}
	// A timeout kills the command's whole tree inside; pids bounds forks.
	start := time.Now()
	res, err = client.Exec(c, sb.ID, api.ExecRequest{Cmd: "sleep 300 & (sh -c 'sleep 300') & echo started; wait", Timeout: 1})
	if err != nil || !res.TimedOut || res.Stdout != "started\n" || time.Since(start) > 15*time.Second {
		t.Fatalf("timeout: %+v %v after %v", res, err, time.Since(start))
	}
	waitFor(t, func() bool {
		return strings.TrimSpace(sh(t, sb.ID, "ps -o comm | grep -c '^sleep' || true").Stdout) == "0"
	})
	if r := sh(t, sb.ID, "for i in $(seq 1 100); do sleep 5 & done 2>&1 | grep -c fork; true"); strings.TrimSpace(r.Stdout) == "0" {
		t.Fatalf("pids 64: 100 forks gave no error: %+v", r)
	}
	// Sessions keep state.
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
	// Files: served by the agent inside the guest, confined to the
	// sandbox's root (the agent's own root, with its /init, is above it).
	if err := client.WriteFile(c, sb.ID, "/tmp/dir/in", strings.NewReader("from-api"), 0o640); err != nil {
		t.Fatal(err)
	}
	if r := sh(t, sb.ID, "cat /tmp/dir/in; stat -c ' %a %U' /tmp/dir/in; echo from-inside > /root/out; ln -s /init /root/agent-init"); r.Stdout != "from-api 640 root\n" {
		t.Fatalf("file written by the API, read inside: %+v", r)
	}
	if b, err := client.ReadFile(c, sb.ID, "/root/out"); err != nil || string(b) != "from-inside\n" {
		t.Fatalf("file written inside, read by the API: %q %v", b, err)
	}
	big := strings.Repeat("0123456789abcdef", 1<<16) // 1 MiB: many chunks each way
	if err := client.WriteFile(c, sb.ID, "/root/big", strings.NewReader(big), 0o644); err != nil {
		t.Fatal(err)
	}
	if b, err := client.ReadFile(c, sb.ID, "/root/big"); err != nil || string(b) != big {
		t.Fatalf("1 MiB round trip: %d bytes, %v", len(b), err)
	}
	if fe, err := client.StatFile(c, sb.ID, "/root/big"); err != nil || fe.Size != int64(len(big)) || fe.Type != "file" {
		t.Fatalf("stat: %+v %v", fe, err)
	}
	if ents, err := client.ListFiles(c, sb.ID, "/tmp", 2); err != nil || len(ents) < 2 {
		t.Fatalf("list: %+v %v", ents, err)
	}
	for _, p := range []string{"/../../init", "/root/agent-init", "/../sandbox/../init"} {
		if b, err := client.ReadFile(c, sb.ID, p); err == nil {
			t.Fatalf("CONTAINMENT FAILURE: %s read %d bytes outside the sandbox's root", p, len(b))
		}
	}
	var tarball bytes.Buffer
	if _, err := client.DownloadTar(c, sb.ID, "/tmp/dir", &tarball); err != nil || tarball.Len() == 0 {
		t.Fatalf("tar out: %v", err)
	}
	if tr, err := client.UploadTar(c, sb.ID, "/srv/copy", &tarball); err != nil || tr.Files < 1 {
		t.Fatalf("tar in: %+v %v", tr, err)
	}
	if r := sh(t, sb.ID, "cat /srv/copy/in"); r.Stdout != "from-api" {
		t.Fatalf("tar round trip: %+v", r)
	}
	if err := client.DeleteFile(c, sb.ID, "/srv", true); err != nil {
		t.Fatal(err)
	}
	_, err = client.StatFile(c, sb.ID, "/srv")
	wantCode(t, err, "not_found")
	// A private run (TestPrivateExec has the attacks) works in a VM.
	if res, err := client.Exec(c, sb.ID, api.ExecRequest{Cmd: "echo $$", Private: true}); err != nil || res.Stdout != "1\n" {
		t.Fatalf("private run: %+v %v", res, err)
	}
	// Pause is a snapshot file: no VMM runs; any exec resumes it.
	sh(t, sb.ID, "echo kept > /root/kept; echo mem > /dev/shm/mem")
	p, err := client.Pause(c, sb.ID)
	if err != nil || p.Sandbox.State != api.StatePaused {
		t.Fatalf("pause: %+v %v", p, err)
	}
	// The VMM's memory is given back, and said so.
	if p.ReclaimMethod != "backend" || p.MemoryFreedBytes < 64<<20 {
		t.Fatalf("pause of a VM freed %d of %d bytes (%s), want its memory back", p.MemoryFreedBytes, p.MemoryBeforeBytes, p.ReclaimMethod)
	}
	t.Logf("pause freed %d MiB of %d MiB", p.MemoryFreedBytes>>20, p.MemoryBeforeBytes>>20)
	if v := vmmsOf(t, sb.ID); len(v) != 0 {
		t.Fatalf("a VMM runs while paused: %v", v)
	}
	snap := filepath.Join(d.stateDir, "microvm", "vm", sb.ID, "snapshot")
	if fi, err := os.Stat(snap); err != nil || fi.Size() == 0 {
		t.Fatalf("no snapshot file while paused: %v", err)
	}
	if r := sh(t, sb.ID, "cat /root/kept /dev/shm/mem"); r.Stdout != "kept\nmem\n" {
		t.Fatalf("after transparent resume: %+v", r)
	}
	if got, err := client.GetSandbox(c, sb.ID); err != nil || got.State != api.StateRunning {
		t.Fatalf("after resume: %+v %v", got, err)
	}
	// Delete leaves no VMM and no VM directory.
	if err := client.DeleteSandbox(c, sb.ID); err != nil {
		t.Fatal(err)
	}
	if v := vmmsOf(t, sb.ID); len(v) != 0 {
		t.Fatalf("VMM left after delete: %v", v)
	}
	if _, err := os.Stat(filepath.Dir(snap)); !os.IsNotExist(err) {
		t.Fatalf("VM dir left after delete: %v", err)
	}
}

// TestMicroVMNetworkPolicy: the guest sits on the edge's network where a
// container's eth0 would, so the same host-side allowlist and DNS proxy
// decide what it reaches.
func TestMicroVMNetworkPolicy(t *testing.T) {
	needNet(t)
	needMicroVM(t)
	sb := vmSandbox(t, api.SandboxSpec{Toolkits: []string{probeRef}, Network: &api.NetworkPolicy{Allow: []string{"pypi"}}})
	mustReach(t, sb.ID, "hello from pypi", "get", "http://"+pypiName+"/")
	mustNotReach(t, sb.ID, "get", "http://"+npmName+"/")
	mustNotReach(t, sb.ID, "dial", npmAddr+":80")
	mustNotReach(t, sb.ID, "dial", pypiAddr+":9000")
	secret := "dm0tc2VjcmV0.exfil.e2e.test"
	mustNotReach(t, sb.ID, "resolve", secret)
	if upstreamSaw(secret) {
		t.Fatalf("CONTAINMENT FAILURE: upstream DNS was asked %s", secret)
	}
	if _, err := client.SetNetwork(ctx(t), sb.ID, api.NetworkPolicy{Allow: []string{"npm"}}); err != nil {
		t.Fatal(err)
	}
	mustReach(t, sb.ID, "hello from npm", "get", "http://"+npmName+"/")
	mustNotReach(t, sb.ID, "dial", pypiAddr+":80")
	// A pause ends the VMM; the network (its namespace) waits for the
	// resumed one.
	if _, err := client.Pause(ctx(t), sb.ID); err != nil {
		t.Fatal(err)
	}
	mustReach(t, sb.ID, "hello from npm", "get", "http://"+npmName+"/")
}

func TestMicroVMSurvivesEdgeRestart(t *testing.T) {
	needMicroVM(t)
	keep := vmSandbox(t, api.SandboxSpec{})
	sh(t, keep.ID, "echo before > /root/f")
	before := vmmsOf(t, keep.ID)
	d.kill9()
	if err := d.start(); err != nil {
		t.Fatal(err)
	}
	if r := sh(t, keep.ID, "cat /root/f"); r.Stdout != "before\n" {
		t.Fatalf("microvm sandbox after an edge restart: %+v", r)
	}
	if after := vmmsOf(t, keep.ID); !slices.Equal(before, after) || len(after) != 1 {
		t.Fatalf("VMM before the restart %v, after %v: want the same one adopted", before, after)
	}
	got, err := client.GetSandbox(ctx(t), keep.ID)
	if err != nil || got.State != api.StateRunning || got.Backend != api.BackendMicroVM {
		t.Fatalf("after restart: %+v %v", got, err)
	}
}

// TestMicroVMSnapshotAndFork: a VM's changes (a new file, a deleted file
// of its base, a replaced directory) become a snapshot layer like a
// container's: a container started from it and a fork of the VM (taken
// while it is paused, which it stays) see the same files.
func TestMicroVMSnapshotAndFork(t *testing.T) {
	needMicroVM(t)
	c := ctx(t)
	sb := vmSandbox(t, api.SandboxSpec{})
	sh(t, sb.ID, "echo kept > /root/f && echo no > /root/secret && rm /etc/group && rm -rf /home/user && mkdir /home/user && echo h > /home/user/h")
	const ref = "snapshot/vm-e2e:v1"
	l, err := client.Snapshot(c, sb.ID, api.SnapshotRequest{Ref: ref, Exclude: []string{"/root/secret"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli("layer", "delete", ref) })
	t.Logf("snapshot of a VM: %d bytes", l.SizeBytes)
	const check = "cat /root/f /home/user/h; ls /etc/group /root/secret 2>&1 | wc -l; ls /home/user"
	const want = "kept\nh\n2\nh\n"
	ct := newSandbox(t, api.SandboxSpec{Snapshot: ref})
	if ct.Backend != api.BackendContainer {
		t.Fatalf("sandbox from the snapshot runs on %s", ct.Backend)
	}
	if r := sh(t, ct.ID, check+"; ls /etc/group 2>&1 | grep -c 'No such'"); r.Stdout != want+"1\n" {
		t.Fatalf("a container from a VM's snapshot: %q", r.Stdout)
	}
	if _, err := client.Pause(c, sb.ID); err != nil {
		t.Fatal(err)
	}
	fk, err := client.Fork(c, sb.ID, 1, nil)
	if err != nil || len(fk.Sandboxes) != 1 {
		t.Fatalf("fork: %v %+v", err, fk)
	}
	child := fk.Sandboxes[0]
	t.Cleanup(func() { _ = client.DeleteSandbox(ctx(t), child.ID) })
	if child.Backend != api.BackendMicroVM {
		t.Fatalf("the fork runs on %s", child.Backend)
	}
	if got, err := client.GetSandbox(c, sb.ID); err != nil || got.State != api.StatePaused {
		t.Fatalf("the forked VM after the fork: %+v %v, want it paused", got, err)
	}
	if v := vmmsOf(t, sb.ID); len(v) != 0 {
		t.Fatalf("a VMM runs for the paused VM after its fork: %v", v)
	}
	// The fork has everything (no excludes): /root/secret too.
	if r := sh(t, child.ID, "cat /root/f /home/user/h /root/secret; ls /etc/group 2>&1 | grep -c 'No such'"); r.Stdout != "kept\nh\nno\n1\n" {
		t.Fatalf("fork of a VM: %+v", r)
	}
}

// TestMicroVMContainment (issue 21): inside the guest, the sandbox's root
// is a container's root, not the guest's. It holds no descriptor of the
// agent's (the init's socket would let it forge exits and pids), cannot
// end the sandbox's init with a catchable signal, make a device node (the
// guest's disks, the agent's port), make a user namespace, or read the
// masked kernel state, and its /proc shows the sandbox's processes only.
func TestMicroVMContainment(t *testing.T) {
	needMicroVM(t)
	sb := vmSandbox(t, api.SandboxSpec{})
	probe := `ls -l /proc/self/fd | grep -c socket
for s in HUP INT TERM QUIT USR1 USR2 PIPE ALRM; do kill -$s 1; done; sleep 0.2; echo signalled
mknod /tmp/disk b 254 0 2>/dev/null && echo mknod-ok || echo mknod-refused
unshare -U true 2>/dev/null && echo userns-ok || echo userns-refused
wc -c < /proc/keys; wc -c < /proc/timer_list
cat /proc/1/cmdline | tr '\0' ' '; echo
grep -E '^CapBnd' /proc/self/status`
	r := sh(t, sb.ID, probe)
	lines := strings.Split(strings.TrimSpace(r.Stdout), "\n")
	want := []string{"0", "signalled", "mknod-refused", "userns-refused", "0", "0"}
	if len(lines) < len(want)+2 {
		t.Fatalf("probe: %+v", r)
	}
	for i, w := range want {
		if strings.TrimSpace(lines[i]) != w {
			t.Errorf("probe line %d: %q, want %q (all: %q)", i, lines[i], w, r.Stdout)
		}
	}
	if !strings.Contains(lines[6], "sandbox-init") {
		t.Errorf("pid 1 of the sandbox is %q, want the sandbox's init", lines[6])
	}
	// CAP_MKNOD (27), CAP_SYS_ADMIN (21), CAP_SYS_PTRACE (19), CAP_SYS_MODULE (16) are out.
	if f := strings.Fields(lines[7]); len(f) == 2 {
		bnd, _ := strconv.ParseUint(f[1], 16, 64)
		for _, c := range []uint{27, 21, 19, 16, 12, 17} {
			if bnd&(1<<c) != 0 {
				t.Errorf("the bounding set %s holds capability %d", f[1], c)
			}
		}
	} else {
		t.Errorf("no CapBnd line: %q", lines[7])
	}
	// What the init drops it does not pass on ignored (^C must reach a
	// terminal's command).
	sig, err := client.Exec(ctx(t), sb.ID, api.ExecRequest{Argv: []string{"grep", "^SigIgn", "/proc/self/status"}})
	if err != nil || sig.Stdout != "SigIgn:\t0000000000000000\n" {
		t.Errorf("a command starts with signals ignored: %+v %v", sig, err)
	}
	// The init lived through the signals: commands still run.
	if r := sh(t, sb.ID, "echo still"); r.Stdout != "still\n" {
		t.Fatalf("after signals to pid 1: %+v", r)
	}
}

// TestMicroVMSeccomp: the sandbox's processes in a VM run under the
// container backend's seccomp profile and masks (installed by the
// sandbox's init in the guest), so the prober's attacks get the answers
// they get in a container, but where the guest is not the host
// (microvmProberDiffers).
func TestMicroVMSeccomp(t *testing.T) {
	needMicroVM(t)
	seccompAttack(t, api.BackendMicroVM, microvmProberDiffers)
}

// microvmProberDiffers are the probes whose answer in a VM differs from a
// container's, and why.
var microvmProberDiffers = map[string]proberWant{
	// The sandbox's init is not dumpable: its /proc/1/ns is not open to
	// root inside (EACCES before setns is tried).
	"setns_mnt": wantFail,
	// No host file is bound into a VM.
	"ioctl_fiemap_host_bind": wantFail,
}
