package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
)

// Issue 21, class 5: crash windows of freeze and thaw. A pause or a
// snapshot killed between its freeze and its record write (or its thaw)
// leaves a sandbox frozen while its record says running, which hangs every
// exec; a file write killed midway leaves its temporary file behind. The
// states are made here as the crash leaves them (the cgroup frozen by
// hand, a temporary written into the upper layer), then the daemon is
// killed with -9 and restarted, or left running for its liveness check.

// freezeByHand freezes a sandbox's cgroup behind the daemon's back.
func freezeByHand(t *testing.T, id string) {
	t.Helper()
	rel := sandboxCgroupRel(t, id)
	for _, m := range hostCgroupMounts() {
		if m.has("freezer") {
			if err := os.WriteFile(filepath.Join(m.root, rel, "freezer.state"), []byte("FROZEN"), 0o644); err != nil {
				t.Fatal(err)
			}
			return
		}
	}
	for _, m := range hostCgroupMounts() {
		if m.v2 {
			if err := os.WriteFile(filepath.Join(m.root, rel, "cgroup.freeze"), []byte("1"), 0o644); err != nil {
				t.Fatal(err)
			}
			return
		}
	}
	t.Skip("needs a cgroup freezer")
}

// execWithin runs echo in a sandbox and fails if it does not answer in d.
func execWithin(t *testing.T, id string, within time.Duration) {
	t.Helper()
	start := time.Now()
	res, err := client.Exec(ctx(t), id, api.ExecRequest{Cmd: "echo alive", Timeout: int64(within / time.Second)})
	if err != nil || res.Stdout != "alive\n" || time.Since(start) > within {
		t.Fatalf("exec in %s: %v %+v after %v; want an answer within %v", id, err, res, time.Since(start).Round(time.Millisecond), within)
	}
}

// thawedBy asserts that the daemon's log says which path thawed id (the
// liveness check would rescue the others too, given time). The line is
// written after the thaw, so a command the thaw released can answer
// before it is there: the log is read again for a few seconds.
func thawedBy(t *testing.T, id, why string) {
	t.Helper()
	loggedBy(t, id, "thawed a running sandbox left frozen", why)
}

// loggedBy asserts that the daemon logs msg for id with why (read again
// for a few seconds, as thawedBy).
func loggedBy(t *testing.T, id, msg, why string) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		for _, line := range strings.Split(logSince(0), "\n") {
			if strings.Contains(line, msg) && strings.Contains(line, id) && strings.Contains(line, why) {
				return
			}
		}
		if time.Now().After(deadline) {
			break
		}
	}
	t.Errorf("no log line says %s: %s %s", why, msg, id)
}

func TestRedteamFrozenRunningSandbox(t *testing.T) {
	needDaemon(t)
	restartDaemonOnCleanup(t)
	viaRestart := newSandbox(t, api.SandboxSpec{})
	viaResume := newSandbox(t, api.SandboxSpec{})
	viaCheck := newSandbox(t, api.SandboxSpec{})
	withTemp := newSandbox(t, api.SandboxSpec{})

	// A write killed midway: its temporary file, old, in the upper layer,
	// beside a file of the sandbox's own with a look-alike name and a
	// look-alike symlink to a host file, which must both stay.
	sh(t, withTemp.ID, "mkdir -p /work && echo mine > /work/.x.dsec-tmp-mine")
	upper := filepath.Join(d.stateDir, "edge", "sandboxes", withTemp.ID, "upper")
	temp := filepath.Join(upper, "work", ".big.bin.dsec-tmp-0123456789abcdef")
	if err := os.WriteFile(temp, make([]byte, 1<<20), 0o600); err != nil {
		t.Skipf("the sandbox's upper layer is not at %s: %v", upper, err)
	}
	old := time.Now().Add(-time.Hour)
	_ = os.Chtimes(temp, old, old)
	hostFile := filepath.Join(t.TempDir(), "host-file")
	_ = os.WriteFile(hostFile, []byte("host\n"), 0o644)
	link := filepath.Join(upper, "work", ".l.dsec-tmp-fedcba9876543210")
	if err := os.Symlink(hostFile, link); err != nil {
		t.Fatal(err)
	}

	freezeByHand(t, viaRestart.ID)
	d.kill9()
	if err := d.start(); err != nil {
		t.Fatal(err)
	}
	execWithin(t, viaRestart.ID, 10*time.Second)
	thawedBy(t, viaRestart.ID, "why=recovery")

	// Frozen while the daemon runs: resume of a "running" sandbox thaws it.
	freezeByHand(t, viaResume.ID)
	if _, err := client.Resume(ctx(t), viaResume.ID); err != nil {
		t.Fatal(err)
	}
	execWithin(t, viaResume.ID, 10*time.Second)
	thawedBy(t, viaResume.ID, "why=resume")

	// And with nobody asking, the liveness check thaws it.
	freezeByHand(t, viaCheck.ID)
	deadline := time.Now().Add(20 * time.Second)
	for {
		res, err := client.Exec(ctx(t), viaCheck.ID, api.ExecRequest{Cmd: "echo alive", Timeout: 2})
		if err == nil && res.Stdout == "alive\n" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("a running sandbox left frozen was not thawed within 20 s: %v %+v", err, res)
		}
	}
	thawedBy(t, viaCheck.ID, `why="liveness check"`)

	// The temporary went at the restart; the look-alikes stayed.
	deadline = time.Now().Add(10 * time.Second)
	for {
		if _, err := os.Stat(temp); os.IsNotExist(err) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the temporary file of an interrupted write is still there: %s", temp)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if r := sh(t, withTemp.ID, "cat /work/.x.dsec-tmp-mine; test -L /work/.l.dsec-tmp-fedcba9876543210 && echo link"); r.Stdout != "mine\nlink\n" {
		t.Errorf("the sandbox's own look-alike files: %q %q", r.Stdout, r.Stderr)
	}
	if b, err := os.ReadFile(hostFile); err != nil || string(b) != "host\n" {
		t.Errorf("the host file behind the symlink: %q %v", b, err)
	}
}

// TestRedteamPausedRunningGVisor: the same crash window for a backend
// that pauses by itself. gVisor's pause stops the Sentry's tasks (runsc
// pause), not the host's freezer: a pause killed after runsc's and before
// the record's leaves the sandbox paused while reported running. Made
// here with runsc pause behind the daemon's back; recovery, resume and
// the liveness check each resume it.
func TestRedteamPausedRunningGVisor(t *testing.T) {
	needGVisor(t)
	restartDaemonOnCleanup(t)
	pauseByHand := func(id string) {
		t.Helper()
		if out, err := exec.Command("runsc", "--root", filepath.Join(d.stateDir, "runsc"), "pause", id).CombinedOutput(); err != nil {
			t.Fatalf("runsc pause %s: %v %s", id, err, out)
		}
	}
	const msg = "resumed a running sandbox left paused"
	viaRestart := gvSandbox(t, api.SandboxSpec{})
	viaResume := gvSandbox(t, api.SandboxSpec{})
	viaCheck := gvSandbox(t, api.SandboxSpec{})

	pauseByHand(viaRestart.ID)
	d.kill9()
	if err := d.start(); err != nil {
		t.Fatal(err)
	}
	execWithin(t, viaRestart.ID, 10*time.Second)
	loggedBy(t, viaRestart.ID, msg, "why=recovery")

	pauseByHand(viaResume.ID)
	if _, err := client.Resume(ctx(t), viaResume.ID); err != nil {
		t.Fatal(err)
	}
	execWithin(t, viaResume.ID, 10*time.Second)
	loggedBy(t, viaResume.ID, msg, "why=resume")

	pauseByHand(viaCheck.ID)
	deadline := time.Now().Add(25 * time.Second)
	for {
		res, err := client.Exec(ctx(t), viaCheck.ID, api.ExecRequest{Cmd: "echo alive", Timeout: 2})
		if err == nil && res.Stdout == "alive\n" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("a running gvisor sandbox left paused was not resumed within 25 s: %v %+v", err, res)
		}
	}
	loggedBy(t, viaCheck.ID, msg, `why="liveness check"`)
}

// qmpByHand runs one QMP command (a name, or a whole JSON request) on the
// VMM of microVM sandbox id, behind the daemon's back, and returns the
// reply line.
func qmpByHand(t *testing.T, id, command string) string {
	t.Helper()
	conn, err := net.Dial("unix", filepath.Join(d.stateDir, "microvm", "vm", id, "qmp.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	r := bufio.NewReader(conn)
	if _, err := r.ReadString('\n'); err != nil { // the greeting
		t.Fatal(err)
	}
	for _, cmd := range []string{"qmp_capabilities", command} {
		req := cmd
		if !strings.HasPrefix(cmd, "{") {
			req = fmt.Sprintf("{\"execute\":%q}", cmd)
		}
		if _, err := fmt.Fprintln(conn, req); err != nil {
			t.Fatal(err)
		}
		for {
			line, err := r.ReadString('\n')
			if err != nil {
				t.Fatalf("qmp %s: %v", cmd, err)
			}
			if strings.Contains(line, `"return"`) || strings.Contains(line, `"error"`) {
				if cmd == command {
					return line
				}
				break
			}
		}
	}
	return ""
}

// TestRedteamPausedRunningMicroVM is class 5 for microVMs, whose pause
// saves the VM to a file and ends its VMM: an edge killed during it leaves
// a VMM whose guest is stopped (mid-migration, or done and waiting for the
// quit that never came) while the record and the backend's meta say
// running, or a VMM gone with a whole snapshot the meta does not know of.
// One VM is stopped by hand (QMP stop), one has its pause cut by kill -9,
// and one is saved by hand while the daemon is down, its VMM quit and its
// meta left saying a save began (as an edge killed between the VMM's quit
// and its record leaves it); after the restart all three answer, and what
// ran in them runs on.
func TestRedteamPausedRunningMicroVM(t *testing.T) {
	needMicroVM(t)
	restartDaemonOnCleanup(t)
	byHand := vmSandbox(t, api.SandboxSpec{})
	midPause := vmSandbox(t, api.SandboxSpec{})
	afterQuit := vmSandbox(t, api.SandboxSpec{})
	all := []*api.Sandbox{byHand, midPause, afterQuit}
	for _, sb := range all {
		sh(t, sb.ID, "sleep 1000 >/dev/null 2>&1 </dev/null & echo $! > /root/bg")
	}
	if r := qmpByHand(t, byHand.ID, "stop"); !strings.Contains(r, "return") {
		t.Fatalf("qmp stop: %s", r)
	}
	// The attack works: a stopped guest answers nothing. (Not even the
	// exec's own timeout: the agent cannot be told to kill the command,
	// so the call is given up on here.)
	sctx, cancel := context.WithTimeout(ctx(t), 5*time.Second)
	res, err := client.Exec(sctx, byHand.ID, api.ExecRequest{Cmd: "echo alive", Timeout: 2})
	cancel()
	if err == nil && res.Stdout == "alive\n" {
		t.Fatal("a VM stopped by hand still answers: the test cannot tell")
	}
	go func() { _, _ = client.Pause(context.Background(), midPause.ID) }()
	time.Sleep(300 * time.Millisecond)
	d.kill9()
	saveByHand(t, afterQuit.ID)
	if err := d.start(); err != nil {
		t.Fatal(err)
	}
	for _, sb := range all {
		execWithin(t, sb.ID, 60*time.Second)
		if r := sh(t, sb.ID, "kill -0 $(cat /root/bg) && echo running"); r.Stdout != "running\n" {
			t.Fatalf("%s: the background command is gone after the restart: %+v", sb.ID, r)
		}
		if got, err := client.GetSandbox(ctx(t), sb.ID); err != nil || got.State != api.StateRunning {
			t.Fatalf("%s after the restart: %+v %v", sb.ID, got, err)
		}
	}
	loggedBy(t, byHand.ID, "resumed a running sandbox left paused", "why=adoption")
	loggedBy(t, afterQuit.ID, "saved by an edge that died before recording it", "")
	loggedBy(t, afterQuit.ID, "resumed a running sandbox left paused", "why=recovery")
	for _, line := range strings.Split(logSince(0), "\n") {
		if strings.Contains(line, midPause.ID) && (strings.Contains(line, "resumed") || strings.Contains(line, "saved by an edge") || strings.Contains(line, "adopted")) {
			t.Logf("the VM whose pause was cut: %s", line)
		}
	}
}

// saveByHand saves microVM sandbox id to its snapshot file and quits its
// VMM, as the backend's pause does, and leaves its meta saying a save
// began (the daemon must be down).
func saveByHand(t *testing.T, id string) {
	t.Helper()
	dir := filepath.Join(d.stateDir, "microvm", "vm", id)
	qmpByHand(t, id, "stop")
	if r := qmpByHand(t, id, `{"execute":"migrate","arguments":{"uri":"exec:cat > `+filepath.Join(dir, "snapshot")+`"}}`); !strings.Contains(r, "return") {
		t.Fatalf("qmp migrate: %s", r)
	}
	for deadline := time.Now().Add(60 * time.Second); !strings.Contains(qmpByHand(t, id, "query-migrate"), `"completed"`); time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the migration to the snapshot did not complete within 60 s")
		}
	}
	pids := vmmsOf(t, id)
	qmpByHand(t, id, "quit")
	for deadline := time.Now().Add(10 * time.Second); len(vmmsOf(t, id)) != 0; time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the VMM did not quit: %v", pids)
		}
	}
	var m map[string]any
	b, err := os.ReadFile(filepath.Join(dir, "meta.json"))
	if err == nil {
		err = json.Unmarshal(b, &m)
	}
	if err != nil {
		t.Fatal(err)
	}
	m["saving"] = true
	if b, err = json.Marshal(m); err == nil {
		err = os.WriteFile(filepath.Join(dir, "meta.json"), b, 0o600)
	}
	if err != nil {
		t.Fatal(err)
	}
}

// TestRedteamResumeCutMicroVM is class 5 for a microVM's resume: the new
// VMM reads the snapshot, the guest runs on, and only then did the edge
// record it running and remove the snapshot. An edge killed in between
// left a guest running (writing its disk) under a meta saying saved: the
// next edge reported it paused, and its resume killed that VMM and loaded
// the old snapshot onto the newer disk. The daemon is killed at several
// moments just after a VMM has read the snapshot of a VM the earlier
// daemon saved (so the resume also reconnects to its agent); after each
// restart, a sandbox reported paused must have no guest running, and one
// reported running must answer, with what ran in it still running.
func TestRedteamResumeCutMicroVM(t *testing.T) {
	needMicroVM(t)
	restartDaemonOnCleanup(t)
	sb := vmSandbox(t, api.SandboxSpec{})
	sh(t, sb.ID, "(while :; do echo x >> /root/ticks; sleep 0.05; done) >/dev/null 2>&1 </dev/null & echo $! > /root/bg")
	snapshot := filepath.Join(d.stateDir, "microvm", "vm", sb.ID, "snapshot")
	for _, after := range []time.Duration{0, 20 * time.Millisecond, 60 * time.Millisecond, 150 * time.Millisecond} {
		if _, err := client.Pause(ctx(t), sb.ID); err != nil {
			t.Fatal(err)
		}
		// A new edge resumes it: no agent client carried over.
		d.kill9()
		if err := d.start(); err != nil {
			t.Fatal(err)
		}
		go func() { _, _ = client.Resume(context.Background(), sb.ID) }()
		// The snapshot is read by a cat the VMM runs; once it is gone,
		// the VMM is past reading.
		for deadline := time.Now().Add(60 * time.Second); len(vmmsOf(t, sb.ID)) == 0; time.Sleep(2 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatal("no VMM started to resume the VM within 60 s")
			}
		}
		seen := false
		for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(2 * time.Millisecond) {
			out, _ := exec.Command("pgrep", "-f", "^cat "+snapshot).Output()
			reading := len(out) > 0
			if seen && !reading {
				break
			}
			seen = seen || reading
			if time.Now().After(deadline) {
				t.Fatalf("the VMM did not read the snapshot within 60 s (seen reading: %v)", seen)
			}
		}
		time.Sleep(after)
		d.kill9()
		if err := d.start(); err != nil {
			t.Fatal(err)
		}
		got, err := client.GetSandbox(ctx(t), sb.ID)
		if err != nil {
			t.Fatal(err)
		}
		if got.State == api.StatePaused {
			for _, vmm := range vmmsOf(t, sb.ID) {
				if r := qmpByHand(t, sb.ID, "query-status"); strings.Contains(r, `"status": "running"`) {
					t.Fatalf("killed %v after the snapshot was read: reported paused while its guest runs (%s): %s", after, vmm, r)
				}
			}
			if _, err := client.Resume(ctx(t), sb.ID); err != nil {
				t.Fatalf("killed %v after the snapshot was read: resume: %v", after, err)
			}
		} else if got.State != api.StateRunning {
			t.Fatalf("killed %v after the snapshot was read: %+v", after, got)
		}
		execWithin(t, sb.ID, 60*time.Second)
		if r := sh(t, sb.ID, "kill -0 $(cat /root/bg) && echo running"); r.Stdout != "running\n" {
			t.Fatalf("killed %v after the snapshot was read: the background command is gone: %+v", after, r)
		}
		t.Logf("killed %v after the snapshot was read: %s after the restart", after, got.State)
	}
}
