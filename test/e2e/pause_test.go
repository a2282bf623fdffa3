package e2e

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
)

// upperFile reads a file of a sandbox's writable layer from the host,
// without going through the API (which would resume a paused sandbox).
func upperFile(t *testing.T, id, path string) string {
	t.Helper()
	b, _ := os.ReadFile(filepath.Join(d.stateDir, "edge", "sandboxes", id, "upper", path))
	return string(b)
}

// counterValue reads the counter the pause test's loop writes to
// /tmp/count. The loop's `echo > file` truncates before it writes, so an
// empty read means "caught in between": read again.
func counterValue(t *testing.T, id string) int {
	t.Helper()
	for range 50 {
		if n, err := strconv.Atoi(strings.TrimSpace(upperFile(t, id, "tmp/count"))); err == nil {
			return n
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("%s: /tmp/count holds no number for 500 ms", id)
	return 0
}

func waitState(t *testing.T, id, state string, within time.Duration) *api.Sandbox {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		sb, err := client.GetSandbox(ctx(t), id)
		if err != nil {
			t.Fatal(err)
		}
		if sb.State == state || time.Now().After(deadline) {
			return sb
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func TestPauseResumeKeepsEverything(t *testing.T) {
	needDaemon(t)
	sb := newSandbox(t, api.SandboxSpec{Labels: map[string]string{"pausetest": "a"}})
	c := ctx(t)
	// State to keep: a file, a page-cache-heavy file, a counter process, a
	// listening service, a session with cwd and variables.
	sh(t, sb.ID, "echo kept > /root/file; dd if=/dev/zero of=/root/big bs=1M count=32 2>/dev/null")
	sh(t, sb.ID, "mkdir -p /www && echo served > /www/index.html && httpd -p 127.0.0.1:8080 -h /www")
	sh(t, sb.ID, "(i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.1; done) >/dev/null 2>&1 &")
	sid, err := client.CreateSession(c, sb.ID, api.SessionRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := client.SessionRun(c, sb.ID, sid, api.SessionRunRequest{Command: "cd /root && export KEEP=me"}); err != nil {
		t.Fatal(err)
	}
	for cycle := 1; cycle <= 2; cycle++ {
		res, err := client.Pause(c, sb.ID)
		if err != nil {
			t.Fatalf("cycle %d: pause: %v", cycle, err)
		}
		if res.Sandbox.State != api.StatePaused || res.Sandbox.PausedAt == nil {
			t.Fatalf("cycle %d: pause answered %+v", cycle, res.Sandbox)
		}
		t.Logf("cycle %d: paused in %d ms, memory %d -> %d bytes (%s)", cycle, res.DurationMS,
			res.MemoryBeforeBytes, res.MemoryAfterBytes, res.ReclaimMethod)
		// Under memory pressure the host may have reclaimed /root/big's
		// page cache before the pause could (which then found less than
		// 32 MiB to start with): read it back in and pause again.
		for try := 2; cycle == 1 && res.MemoryFreedBytes < 16<<20 && res.MemoryBeforeBytes < 32<<20 && try <= 3; try++ {
			if _, err := client.Resume(c, sb.ID); err != nil {
				t.Fatal(err)
			}
			sh(t, sb.ID, "cat /root/big >/dev/null")
			if res, err = client.Pause(c, sb.ID); err != nil || res.Sandbox.State != api.StatePaused {
				t.Fatalf("cycle %d: pause, try %d: %+v %v", cycle, try, res, err)
			}
			t.Logf("cycle %d: try %d: paused in %d ms, memory %d -> %d bytes", cycle, try, res.DurationMS,
				res.MemoryBeforeBytes, res.MemoryAfterBytes)
		}
		if cycle == 1 && res.MemoryFreedBytes < 16<<20 {
			t.Errorf("pause freed %d bytes of %d, want the 32 MiB of page cache mostly back", res.MemoryFreedBytes, res.MemoryBeforeBytes)
		}
		// Frozen: the counter does not move. Stats do not wake it.
		before := upperFile(t, sb.ID, "tmp/count")
		time.Sleep(700 * time.Millisecond)
		if after := upperFile(t, sb.ID, "tmp/count"); after != before {
			t.Fatalf("cycle %d: counter moved while paused: %q -> %q", cycle, before, after)
		}
		if _, err := client.Stats(c, sb.ID); err != nil {
			t.Fatal(err)
		}
		if got := waitState(t, sb.ID, api.StatePaused, 0); got.State != api.StatePaused {
			t.Fatalf("stats resumed the sandbox: %s", got.State)
		}
		// Pausing again is a no-op.
		if res, err := client.Pause(c, sb.ID); err != nil || res.MemoryFreedBytes != 0 {
			t.Fatalf("second pause: %+v %v", res, err)
		}
		if cycle == 1 {
			// Any exec resumes transparently.
			r := sh(t, sb.ID, "cat /root/file; wget -qO- http://127.0.0.1:8080/")
			if r.Stdout != "kept\nserved\n" {
				t.Fatalf("after transparent resume: %+v", r)
			}
		} else {
			if _, err := client.Resume(c, sb.ID); err != nil {
				t.Fatal(err)
			}
		}
		if got := waitState(t, sb.ID, api.StateRunning, 0); got.State != api.StateRunning || got.PausedAt != nil {
			t.Fatalf("cycle %d: state after resume %s", cycle, got.State)
		}
		// The loop runs again: the counter moves (soon, but a busy host
		// may take a while to schedule it).
		n1 := counterValue(t, sb.ID)
		deadline := time.Now().Add(20 * time.Second)
		for n2 := n1; n2 <= n1; n2 = counterValue(t, sb.ID) {
			if time.Now().After(deadline) {
				t.Fatalf("cycle %d: counter stuck after resume: %d -> %d for 20 s", cycle, n1, n2)
			}
			time.Sleep(100 * time.Millisecond)
		}
		r, err := client.SessionRun(c, sb.ID, sid, api.SessionRunRequest{Command: "pwd; echo $KEEP"})
		if err != nil || r.Stdout != "/root\nme\n" {
			t.Fatalf("cycle %d: session after resume: %+v %v", cycle, r, err)
		}
	}
	// Resuming a running sandbox is a no-op.
	if sb2, err := client.Resume(c, sb.ID); err != nil || sb2.State != api.StateRunning {
		t.Fatalf("resume of a running sandbox: %+v %v", sb2, err)
	}
}

func TestPauseStopsTheTTLClock(t *testing.T) {
	needDaemon(t)
	// The TTL runs from the start of the create: 5 s leave room for a
	// slow one before the pause.
	sb := newSandbox(t, api.SandboxSpec{TTL: 5})
	paused, err := client.Pause(ctx(t), sb.ID)
	if err != nil || paused.Sandbox.PausedAt == nil {
		t.Fatalf("pause: %+v %v", paused, err)
	}
	// Paused past the expiry and a reaper tick or two.
	time.Sleep(time.Until(sb.ExpiresAt.Add(2 * time.Second)))
	got := waitState(t, sb.ID, api.StatePaused, 0)
	if got.State != api.StatePaused {
		t.Fatalf("a paused sandbox's ttl ran: %s (%s)", got.State, got.Error)
	}
	resumed := time.Now()
	res, err := client.Resume(ctx(t), sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	if moved := resumed.Sub(*paused.Sandbox.PausedAt); res.ExpiresAt.Before(sb.ExpiresAt.Add(moved)) {
		t.Fatalf("expires_at %v not moved past %v by the pause of %s", res.ExpiresAt, sb.ExpiresAt, moved)
	}
	// Once running, the rest of the ttl still applies.
	if got := waitState(t, sb.ID, api.StateStopped, time.Until(*res.ExpiresAt)+15*time.Second); got.State != api.StateStopped {
		t.Fatalf("ttl did not apply after resume: %s", got.State)
	}
}

func TestPauseByLabelsAndAcrossRestart(t *testing.T) {
	needDaemon(t)
	job := map[string]string{"job": "preempted-" + strconv.FormatInt(time.Now().UnixNano()%1e6, 10)}
	a := newSandbox(t, api.SandboxSpec{Labels: job})
	b := newSandbox(t, api.SandboxSpec{Labels: job})
	other := newSandbox(t, api.SandboxSpec{})
	sh(t, a.ID, "echo a > /root/mark")
	n, err := client.PauseSandboxes(ctx(t), job)
	if err != nil || n != 2 {
		t.Fatalf("pause by labels: %d %v", n, err)
	}
	if got := waitState(t, other.ID, api.StateRunning, 0); got.State != api.StateRunning {
		t.Fatalf("unlabelled sandbox was paused")
	}
	// The paused state survives an edge crash.
	d.kill9()
	if err := d.start(); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{a.ID, b.ID} {
		if got := waitState(t, id, api.StatePaused, 0); got.State != api.StatePaused {
			t.Fatalf("%s after restart: %s (%s)", id, got.State, got.Error)
		}
	}
	n, err = client.ResumeSandboxes(ctx(t), job)
	if err != nil || n != 2 {
		t.Fatalf("resume by labels: %d %v", n, err)
	}
	if r := sh(t, a.ID, "cat /root/mark"); r.Stdout != "a\n" {
		t.Fatalf("after resume: %+v", r)
	}
	// A paused sandbox deletes cleanly.
	if _, err := client.Pause(ctx(t), b.ID); err != nil {
		t.Fatal(err)
	}
	if err := client.DeleteSandbox(ctx(t), b.ID); err != nil {
		t.Fatal(err)
	}
	if m := anyMounts(b.ID); len(m) != 0 {
		t.Fatalf("deleted paused sandbox left mounts %v", m)
	}
	// Pausing what is not running is refused clearly.
	_, err = client.Pause(ctx(t), b.ID)
	wantCode(t, err, "not_found")
}
