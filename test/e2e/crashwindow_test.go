package e2e

import (
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
