package e2e

// Attack cases of issue 5 not covered elsewhere; each runs inside a real
// sandbox as root and checks containment and the absence of collateral
// damage (a neighbour's files and processes, the host, the daemon). The
// full list of cases and where each lives is in docs/operating.md
// ("Attack suite").

import (
	"net/http"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
)

// bystander is a neighbour sandbox with a file and a process, and a check
// that both are intact and that the daemon still answers quickly.
type bystander struct{ id string }

func newBystander(t *testing.T) bystander {
	t.Helper()
	sb := newSandbox(t, api.SandboxSpec{})
	sh(t, sb.ID, "echo intact > /root/marker; sleep 100000 >/dev/null 2>&1 &")
	return bystander{sb.ID}
}

func (b bystander) check(t *testing.T) {
	t.Helper()
	start := time.Now()
	resp, err := http.Get("http://" + d.listen + "/healthz")
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("COLLATERAL: daemon /healthz: %v %v", resp, err)
	}
	resp.Body.Close()
	// Generous: the host is busy with the attack, and CI with more.
	if el := time.Since(start); el > 10*time.Second {
		t.Errorf("COLLATERAL: /healthz took %v", el)
	}
	r := sh(t, b.id, "cat /root/marker; ps -o comm,args | grep -q '^sleep *sleep 100000' && echo sleeping")
	if r.Stdout != "intact\nsleeping\n" {
		t.Fatalf("COLLATERAL: neighbour sandbox: %q %q", r.Stdout, r.Stderr)
	}
}

// TestRedteamYesFlood: `yes` without end, through exec and through a
// session (DSEC-FACTS.md §7: tens of GB of output). The caller gets a
// capped, truncated result at the timeout; the daemon's memory stays
// bounded; the session survives.
func TestRedteamYesFlood(t *testing.T) {
	needDaemon(t)
	by := newBystander(t)
	sb := newSandbox(t, api.SandboxSpec{})
	rssBefore := daemonRSS(t)
	start := time.Now()
	res, err := client.Exec(ctx(t), sb.ID, api.ExecRequest{Cmd: "yes", Timeout: 3})
	if err != nil {
		t.Fatal(err)
	}
	if !res.TimedOut || !res.Truncated || len(res.Stdout) != 1<<20 {
		t.Fatalf("exec yes: timed_out=%v truncated=%v stdout=%d bytes", res.TimedOut, res.Truncated, len(res.Stdout))
	}
	t.Logf("exec yes: %d bytes returned after %v (truncated)", len(res.Stdout), time.Since(start).Round(time.Millisecond))
	// The same to /dev/stdout explicitly, and to stderr, streamed.
	n := 0
	_, err = client.ExecStream(ctx(t), sb.ID, api.ExecRequest{Cmd: "yes > /dev/stdout & yes >&2", Timeout: 2},
		func(ev api.ExecEvent) error { n += len(ev.Stdout) + len(ev.Stderr); return nil })
	if err != nil {
		t.Fatal(err)
	}
	if n > 3<<20 {
		t.Fatalf("streamed yes delivered %d bytes, more than the caps", n)
	}
	sid, err := client.CreateSession(ctx(t), sb.ID, api.SessionRequest{Shell: "/bin/bash"})
	if err != nil {
		t.Fatal(err)
	}
	sres, err := client.SessionRun(ctx(t), sb.ID, sid, api.SessionRunRequest{Command: "export KEEP=1; yes", Timeout: 3})
	if err != nil {
		t.Fatal(err)
	}
	if !sres.TimedOut || !sres.Truncated {
		t.Fatalf("session yes: %+v", sres.ExitCode)
	}
	sres, err = client.SessionRun(ctx(t), sb.ID, sid, api.SessionRunRequest{Command: "echo $KEEP"})
	if err != nil || sres.Stdout != "1\n" {
		t.Fatalf("session after the flood: %v %+v", err, sres)
	}
	if r := sh(t, sb.ID, "ps -o comm | grep -c '^yes$' "); strings.TrimSpace(r.Stdout) != "0" {
		t.Fatalf("yes processes left running: %s", r.Stdout)
	}
	if grow := daemonRSS(t) - rssBefore; grow > 200<<20 {
		t.Errorf("daemon RSS grew by %d MiB during the floods", grow>>20)
	}
	by.check(t)
}

// daemonRSS is the daemon's resident memory in bytes.
func daemonRSS(t *testing.T) int64 {
	t.Helper()
	b, err := os.ReadFile("/proc/" + itoa(d.cmd.Process.Pid) + "/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) >= 2 && f[0] == "VmRSS:" {
			return int64(atoi(f[1])) << 10
		}
	}
	return 0
}

func itoa(n int) string { return strconv.Itoa(n) }

// TestRedteamKillPid1: root inside tries to kill the sandbox's init.
// SIGKILL to a namespace's init from inside is ignored by the kernel;
// SIGTERM ends the sandbox, which is then reported failed, with nothing
// left on the host.
func TestRedteamKillPid1(t *testing.T) {
	needDaemon(t)
	by := newBystander(t)
	sb := newSandbox(t, api.SandboxSpec{})
	r := sh(t, sb.ID, "kill -9 1; sleep 0.2; echo still here")
	if r.Stdout != "still here\n" {
		t.Fatalf("after kill -9 1: %+v", r)
	}
	_, _ = client.Exec(ctx(t), sb.ID, api.ExecRequest{Cmd: "kill -TERM 1; sleep 5"})
	deadline := time.Now().Add(15 * time.Second)
	for {
		got, err := client.GetSandbox(ctx(t), sb.ID)
		if err != nil {
			t.Fatal(err)
		}
		if got.State == api.StateFailed {
			t.Logf("after kill -TERM 1: %s (%s)", got.State, got.Error)
			break
		}
		if got.State == api.StateRunning {
			if res, err := client.Exec(ctx(t), sb.ID, api.ExecRequest{Cmd: "echo up"}); err == nil && res.Stdout == "up\n" && time.Now().After(deadline) {
				t.Logf("init ignored SIGTERM; the sandbox keeps running")
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("sandbox neither failed nor answering: %+v", got)
		}
		time.Sleep(200 * time.Millisecond)
	}
	by.check(t)
}

// TestRedteamCannotSeeThePlatform: the agent-log incident (an agent read
// the platform's logs for answers) and forged calls to an in-sandbox agent.
// Nothing of the platform lives in a sandbox: no agent process, no edge
// files, no host processes, no API on its loopback.
func TestRedteamCannotSeeThePlatform(t *testing.T) {
	needDaemon(t)
	sb := newSandbox(t, api.SandboxSpec{})
	sh(t, sb.ID, "echo the-answer-is-42 > /tmp/graded")
	r := sh(t, sb.ID, `ps -o pid,comm | tail -n +2 | awk '{print $2}' | sort | uniq | tr '\n' ' '; echo;
		find / -xdev \( -name 'cmdlog.jsonl' -o -name 'sandbox.json' -o -name 'dsec.db' -o -name 'admin.key' \) 2>/dev/null | head;
		grep -l dsec /proc/*/cmdline 2>/dev/null | head; cat /proc/1/cmdline | tr '\0' ' '; echo;
		nc -w 1 127.0.0.1 `+strings.Split(d.listen, ":")[1]+` </dev/null && echo API-REACHABLE`)
	out := r.Stdout
	for _, bad := range []string{"cmdlog.jsonl", "sandbox.json", "dsec.db", "admin.key", "API-REACHABLE", "dsec up", "crun", "runc"} {
		if strings.Contains(out, bad) {
			t.Fatalf("CONTAINMENT FAILURE: the sandbox sees %q:\n%s", bad, out)
		}
	}
	if !strings.Contains(out, "/dev/init") {
		t.Fatalf("pid 1 is not the sandbox's own init:\n%s", out)
	}
	// The command log exists, outside the sandbox.
	page, err := client.ReadLog(ctx(t), sb.ID, 0, 10)
	if err != nil || len(page.Entries) == 0 {
		t.Fatalf("command log: %v %+v", err, page)
	}
}

// TestRedteamForkBomb: a real fork bomb under the default pids limit stays
// inside; the sandbox recovers once it is killed.
func TestRedteamForkBomb(t *testing.T) {
	needDaemon(t)
	by := newBystander(t)
	sb := newSandbox(t, api.SandboxSpec{Pids: 256})
	res, err := client.Exec(ctx(t), sb.ID, api.ExecRequest{Cmd: "b(){ b|b& }; b", Timeout: 5})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("fork bomb: exit %d timed_out %v", res.ExitCode, res.TimedOut)
	by.check(t)
	// Kill what is left and check the sandbox answers again.
	deadline := time.Now().Add(30 * time.Second)
	for {
		_, _ = client.Exec(ctx(t), sb.ID, api.ExecRequest{Cmd: "kill -9 -1", Timeout: 5})
		r, err := client.Exec(ctx(t), sb.ID, api.ExecRequest{Cmd: "echo alive", Timeout: 5})
		if err == nil && r.Stdout == "alive\n" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("sandbox does not recover after the fork bomb: %v %+v", err, r)
		}
		time.Sleep(500 * time.Millisecond)
	}
}

// TestRedteamPasswdReplaced (issue 21, class 11): an agent replaces
// /etc/passwd with a FIFO, a symlink to an endless file, or an entry that
// gives the default user's name uid 0. The default user keeps the
// identity its first exec found: exec goes on working, as that uid and
// home, never as another; a lookup of another name is refused cleanly.
func TestRedteamPasswdReplaced(t *testing.T) {
	needDaemon(t)
	t.Run("container", func(t *testing.T) { passwdReplaced(t, api.SandboxSpec{User: "user"}) })
	t.Run("microvm", func(t *testing.T) {
		needMicroVM(t)
		passwdReplaced(t, api.SandboxSpec{User: "user", Backend: api.BackendMicroVM})
	})
}

func passwdReplaced(t *testing.T, spec api.SandboxSpec) {
	sb := newSandbox(t, spec)
	// The uid from /proc: id(1) would read /etc/passwd itself, and block
	// on the FIFO in the sandbox (that much is the agent's own doing).
	const whoami = "awk '/^Uid:/{print $2}' /proc/self/status; echo $HOME"
	if r := sh(t, sb.ID, whoami); r.Stdout != "1000\n/home/user\n" {
		t.Fatalf("default user before: %q %q", r.Stdout, r.Stderr)
	}
	asRoot := func(cmd string) {
		t.Helper()
		// By number: after the first swap "root" cannot be looked up.
		res, err := client.Exec(ctx(t), sb.ID, api.ExecRequest{Cmd: cmd, User: "0"})
		if err != nil || res.ExitCode != 0 {
			t.Fatalf("as root %q: %v %+v", cmd, err, res)
		}
	}
	for _, swap := range []string{
		"rm /etc/passwd && mkfifo /etc/passwd",
		"rm -f /etc/passwd && ln -s /dev/zero /etc/passwd",
		"rm -f /etc/passwd && printf 'user:x:0:0::/root:/bin/sh\\nroot:x:0:0::/root:/bin/sh\\n' > /etc/passwd",
	} {
		asRoot(swap)
		start := time.Now()
		r, err := client.Exec(ctx(t), sb.ID, api.ExecRequest{Cmd: whoami})
		if err != nil || r.Stdout != "1000\n/home/user\n" {
			t.Fatalf("after %q: default user exec: %v %+v", swap, err, r)
		}
		if el := time.Since(start); el > 5*time.Second {
			t.Fatalf("after %q: exec took %v", swap, el)
		}
		_, err = client.Exec(ctx(t), sb.ID, api.ExecRequest{Cmd: "true", User: "nobody-here"})
		wantCode(t, err, "invalid_argument")
	}
	// As a number, root needs no lookup at all.
	if res, err := client.Exec(ctx(t), sb.ID, api.ExecRequest{Cmd: "awk '/^Uid:/{print $2}' /proc/self/status", User: "0"}); err != nil || res.Stdout != "0\n" {
		t.Fatalf("as uid 0: %v %+v", err, res)
	}
}

// TestRedteamOOMScores (issue 21, class 8): the OOM killer spares the
// daemon (-999), not the sandboxes: their processes start at 0, through
// exec and sessions alike, and root inside cannot lower its own score to
// hide from the killer.
func TestRedteamOOMScores(t *testing.T) {
	needDaemon(t)
	b, err := os.ReadFile("/proc/" + itoa(d.cmd.Process.Pid) + "/oom_score_adj")
	switch {
	case !haveCapSysResource():
		// Lowering a score needs CAP_SYS_RESOURCE, which root lacks on
		// some hosts (this kind of VM): the daemon says so in its log.
		t.Logf("this host's root lacks CAP_SYS_RESOURCE: the daemon's oom_score_adj stays %s", strings.TrimSpace(string(b)))
	case err != nil || strings.TrimSpace(string(b)) != "-999":
		t.Errorf("daemon oom_score_adj %q, %v; want -999", b, err)
	}
	// Whatever the daemon's score, its sandboxes start at 0: with the
	// daemon raised to 500 (no capability needed), a new sandbox's init,
	// its execs and its sessions must not inherit it.
	daemonAdj := "/proc/" + itoa(d.cmd.Process.Pid) + "/oom_score_adj"
	prev, _ := os.ReadFile(daemonAdj)
	if err := os.WriteFile(daemonAdj, []byte("500"), 0); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.WriteFile(daemonAdj, prev, 0) })
	sb := newSandbox(t, api.SandboxSpec{})
	if r := sh(t, sb.ID, "cat /proc/1/oom_score_adj /proc/self/oom_score_adj"); r.Stdout != "0\n0\n" {
		t.Errorf("sandbox init and exec oom_score_adj: %q %q; want 0 and 0", r.Stdout, r.Stderr)
	}
	sid, err := client.CreateSession(ctx(t), sb.ID, api.SessionRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if r, err := client.SessionRun(ctx(t), sb.ID, sid, api.SessionRunRequest{Command: "cat /proc/self/oom_score_adj"}); err != nil || r.Stdout != "0\n" {
		t.Errorf("session oom_score_adj: %v %+v", err, r)
	}
	if r := sh(t, sb.ID, "echo -1000 > /proc/self/oom_score_adj 2>/dev/null && echo lowered; echo -5 > /proc/1/oom_score_adj 2>/dev/null && echo lowered; cat /proc/1/oom_score_adj"); r.Stdout != "0\n" {
		t.Errorf("root inside lowered an OOM score: %q", r.Stdout)
	}
}

// TestDiskFloor (issue 21, class 8): below the state filesystem's floor,
// creates and file uploads are refused with resource_exhausted, before
// anything is written; exec and reads go on.
func TestDiskFloor(t *testing.T) {
	needDaemon(t)
	sb := newSandbox(t, api.SandboxSpec{})
	withPoolFlags(t, "--min-free-disk-mb", "1000000000") // 1 PB: more than any disk here has free
	_, err := client.CreateSandbox(ctx(t), api.SandboxSpec{Base: baseRef})
	wantCode(t, err, "resource_exhausted")
	if err != nil && !strings.Contains(err.Error(), "--min-free-disk-mb") {
		t.Errorf("the refusal does not name the flag: %v", err)
	}
	err = client.WriteFile(ctx(t), sb.ID, "/root/f", strings.NewReader("x"), 0o644)
	wantCode(t, err, "resource_exhausted")
	if r := sh(t, sb.ID, "test -e /root/f || echo absent"); r.Stdout != "absent\n" {
		t.Errorf("a refused upload left %q", r.Stdout)
	}
}

// haveCapSysResource reports whether this process holds CAP_SYS_RESOURCE.
func haveCapSysResource() bool {
	b, _ := os.ReadFile("/proc/self/status")
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "CapEff:"); ok {
			n, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			return err == nil && n&(1<<24) != 0
		}
	}
	return false
}
