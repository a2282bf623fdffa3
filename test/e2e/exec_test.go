package e2e

import (
	"encoding/base64"
	"strings"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
)

func TestExecBasics(t *testing.T) {
	needDaemon(t)
	sb := newSandbox(t, api.SandboxSpec{Env: map[string]string{"SPEC_VAR": "from-spec"}, Workdir: "/tmp"})
	c := ctx(t)
	res, err := client.Exec(c, sb.ID, api.ExecRequest{Cmd: "echo out; echo err >&2; exit 3"})
	if err != nil || res.ExitCode != 3 || res.Stdout != "out\n" || res.Stderr != "err\n" || res.TimedOut || res.Truncated {
		t.Fatalf("cmd: %+v %v", res, err)
	}
	res, err = client.Exec(c, sb.ID, api.ExecRequest{Argv: []string{"/bin/sh", "-c", `echo "$1|$SPEC_VAR|$X|$(pwd)"`, "sh", "a b"}, Env: map[string]string{"X": "y"}})
	if err != nil || res.Stdout != "a b|from-spec|y|/tmp\n" {
		t.Fatalf("argv/env/workdir: %+v %v", res, err)
	}
	res, err = client.Exec(c, sb.ID, api.ExecRequest{Cmd: "pwd; id -u; id -g", Cwd: "/home/user", User: "user"})
	if err != nil || res.Stdout != "/home/user\n1000\n1000\n" {
		t.Fatalf("cwd/user: %+v %v", res, err)
	}
	res, err = client.Exec(c, sb.ID, api.ExecRequest{Cmd: "id -u", User: "1000:0"})
	if err != nil || res.Stdout != "1000\n" {
		t.Fatalf("uid:gid user: %+v %v", res, err)
	}
	res, err = client.Exec(c, sb.ID, api.ExecRequest{Cmd: "wc -c", Stdin: "hello"})
	if err != nil || strings.TrimSpace(res.Stdout) != "5" {
		t.Fatalf("stdin: %+v %v", res, err)
	}
	bin := []byte{0, 1, 2, 0xff, 0xfe, 'x'}
	res, err = client.Exec(c, sb.ID, api.ExecRequest{Cmd: "cat", StdinB64: base64.StdEncoding.EncodeToString(bin)})
	if err != nil || res.StdoutB64 != base64.StdEncoding.EncodeToString(bin) {
		t.Fatalf("binary stdin/stdout: %+v %v", res, err)
	}
	_, err = client.Exec(c, sb.ID, api.ExecRequest{Cmd: "true", User: "nosuchuser"})
	wantCode(t, err, "invalid_argument")
	res, err = client.Exec(c, sb.ID, api.ExecRequest{Argv: []string{"/no/such/binary"}})
	if err != nil || res.ExitCode == 0 {
		t.Fatalf("missing binary: %+v %v", res, err)
	}
}

func TestExecTimeoutKillsProcessTree(t *testing.T) {
	needDaemon(t)
	sb := newSandbox(t, api.SandboxSpec{})
	start := time.Now()
	res, err := client.Exec(ctx(t), sb.ID, api.ExecRequest{
		Cmd:     "sleep 300 & sleep 300 & (sh -c 'sleep 300') & echo started; wait",
		Timeout: 1,
	})
	if err != nil {
		t.Fatal(err)
	}
	if !res.TimedOut || res.Stdout != "started\n" {
		t.Fatalf("got %+v, want timed_out with the output so far", res)
	}
	if el := time.Since(start); el > 10*time.Second {
		t.Fatalf("timeout of 1s took %v", el)
	}
	// Killed processes are reaped by the sandbox's init a moment later:
	// polled until none is left, zombie or not.
	left := ""
	for deadline := time.Now().Add(10 * time.Second); ; {
		left = strings.TrimSpace(sh(t, sb.ID, "ps -o comm | grep -c '^sleep' || true").Stdout)
		if left == "0" || time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if left != "0" {
		t.Fatalf("sleeps survived the timeout: %q", left)
	}
}

func TestExecOutputCap(t *testing.T) {
	needDaemon(t)
	sb := newSandbox(t, api.SandboxSpec{})
	// `yes` would print forever: the cap bounds what the edge keeps, the
	// timeout ends it.
	res, err := client.Exec(ctx(t), sb.ID, api.ExecRequest{Cmd: "yes", MaxOutputBytes: 1000, Timeout: 2})
	if err != nil {
		t.Fatal(err)
	}
	if !res.Truncated || len(res.Stdout) != 1000 || !res.TimedOut {
		t.Fatalf("got truncated=%v len=%d timed_out=%v", res.Truncated, len(res.Stdout), res.TimedOut)
	}
	res, err = client.Exec(ctx(t), sb.ID, api.ExecRequest{Cmd: "head -c 5000 /dev/zero | tr '\\0' a; echo done >&2", MaxOutputBytes: 100})
	if err != nil || !res.Truncated || len(res.Stdout) != 100 || res.Stderr != "done\n" || res.ExitCode != 0 {
		t.Fatalf("got %+v %v", res, err)
	}
}

func TestExecStream(t *testing.T) {
	needDaemon(t)
	sb := newSandbox(t, api.SandboxSpec{})
	var events []api.ExecEvent
	var at []time.Time // when each event arrived
	final, err := client.ExecStream(ctx(t), sb.ID, api.ExecRequest{Cmd: "echo one; sleep 1; echo two >&2; exit 4"}, func(ev api.ExecEvent) error {
		events = append(events, ev)
		at = append(at, time.Now())
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	var out, errs string
	for _, ev := range events {
		out += ev.Stdout
		errs += ev.Stderr
	}
	if out != "one\n" || errs != "two\n" || final == nil || final.ExitCode == nil || *final.ExitCode != 4 {
		t.Fatalf("stream: out=%q err=%q final=%+v", out, errs, final)
	}
	// Streamed: "one" arrives while the command sleeps, well before
	// "two", not with it at the end (how soon after the call depends on
	// the host's load).
	if spread := at[len(at)-1].Sub(at[0]); spread < 500*time.Millisecond {
		t.Fatalf("events arrived within %v of each other around a 1 s sleep: output is not streamed", spread)
	}
	// The CLI streams too and exits with the command's code.
	o, _, code := cli("exec", "--stream", sb.ID, "--", "sh", "-c", "echo cli; exit 5")
	if o != "cli\n" || code != 5 {
		t.Fatalf("cli stream: %q exit %d", o, code)
	}
}

func TestSessions(t *testing.T) {
	needDaemon(t)
	sb := newSandbox(t, api.SandboxSpec{})
	c := ctx(t)
	sid, err := client.CreateSession(c, sb.ID, api.SessionRequest{})
	if err != nil {
		t.Fatal(err)
	}
	run := func(sid, cmd string) *api.ExecResult {
		t.Helper()
		r, err := client.SessionRun(c, sb.ID, sid, api.SessionRunRequest{Command: cmd, Timeout: 10})
		if err != nil {
			t.Fatalf("session run %q: %v", cmd, err)
		}
		return r
	}
	run(sid, "cd /tmp && export FOO=bar && greet() { echo hello $1; }; UNEXPORTED=u")
	r := run(sid, "pwd; echo $FOO $UNEXPORTED; greet you; echo e >&2; false")
	if r.Stdout != "/tmp\nbar u\nhello you\n" || r.Stderr != "e\n" || r.ExitCode != 1 {
		t.Fatalf("state did not persist: %+v", r)
	}
	if r := run(sid, "echo $0"); !strings.Contains(r.Stdout, "bash") {
		t.Fatalf("default shell should be bash when the image has it: %q", r.Stdout)
	}
	// A command reading stdin must not swallow the session's next command.
	if r := run(sid, "cat; echo after"); r.Stdout != "after\n" {
		t.Fatalf("stdin: %+v", r)
	}
	// A second session is independent.
	sid2, err := client.CreateSession(c, sb.ID, api.SessionRequest{Cwd: "/repo"})
	if err != nil {
		t.Fatal(err)
	}
	if r := run(sid2, "pwd; echo ${FOO:-unset}"); r.Stdout != "/repo\nunset\n" {
		t.Fatalf("second session: %+v", r)
	}
	// Timeout: the command and the rest of its line are aborted, the
	// session survives with its state.
	r, err = client.SessionRun(c, sb.ID, sid, api.SessionRunRequest{Command: "sleep 300; echo SHOULD-NOT-RUN", Timeout: 1})
	if err != nil || !r.TimedOut || strings.Contains(r.Stdout, "SHOULD-NOT-RUN") {
		t.Fatalf("timeout: %+v %v", r, err)
	}
	if r := run(sid, "pwd; echo $FOO"); r.Stdout != "/tmp\nbar\n" {
		t.Fatalf("session after timeout: %+v", r)
	}
	// Closing a session kills what it started.
	run(sid2, "sleep 300 &")
	if err := client.CloseSession(c, sb.ID, sid2); err != nil {
		t.Fatal(err)
	}
	// Killed processes are reaped by the sandbox's init a moment later.
	left := ""
	for i := 0; i < 50; i++ {
		left = strings.TrimSpace(sh(t, sb.ID, "ps -o stat,comm | grep -v '^Z' | grep -c ' sleep$' || true").Stdout)
		if left == "0" {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if left != "0" {
		t.Fatalf("closed session left processes: %q", left)
	}
	_, err = client.SessionRun(c, sb.ID, sid2, api.SessionRunRequest{Command: "true"})
	wantCode(t, err, "not_found")
	// exit ends the session; the result says so and later runs get an error.
	r = run(sid, "exit 7")
	if r.ExitCode != 7 {
		t.Fatalf("exit: %+v", r)
	}
	_, err = client.SessionRun(c, sb.ID, sid, api.SessionRunRequest{Command: "true"})
	wantCode(t, err, "not_found")
	// Output cap applies to sessions too.
	sid3, err := client.CreateSession(c, sb.ID, api.SessionRequest{Shell: "/bin/sh"})
	if err != nil {
		t.Fatal(err)
	}
	r, err = client.SessionRun(c, sb.ID, sid3, api.SessionRunRequest{Command: "yes | head -c 100000; echo", MaxOutputBytes: 500})
	if err != nil || !r.Truncated || len(r.Stdout) != 500 {
		t.Fatalf("cap: truncated=%v len=%d err=%v", r.Truncated, len(r.Stdout), err)
	}
	if r := run(sid3, "echo ok"); r.Stdout != "ok\n" {
		t.Fatalf("sh session after cap: %+v", r)
	}
}
