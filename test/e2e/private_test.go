package e2e

import (
	"strings"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
)

// The agent of these tests is root inside the sandbox and hunts graders:
// every 20 ms it stops and kills every process whose command line carries
// the marker, and tries to read the stdin of every other process.
const hunter = `while :; do
  for p in /proc/[0-9]*; do
    case "$(tr '\0' ' ' < $p/cmdline 2>/dev/null)" in
      *GRADER-MARK*) kill -STOP ${p#/proc/} 2>/dev/null; kill -9 ${p#/proc/} 2>/dev/null; echo "hit ${p#/proc/}" >> /tmp/hunter.log ;;
    esac
  done
  sleep 0.02
done`

// TestPrivateExec: a private exec runs where root inside cannot see,
// signal or read it, with a working /proc of its own under the same
// masks, and its descendants end with it. The same command without it is
// found and killed (the attack works, so the test can fail).
func TestPrivateExec(t *testing.T) {
	needDaemon(t)
	cases := []struct {
		name string
		spec api.SandboxSpec
		need func(*testing.T)
	}{
		{"root", api.SandboxSpec{UserNS: new(false)}, nil},
		{"userns", api.SandboxSpec{UserNS: new(true)}, nil},
		{"gvisor", api.SandboxSpec{Backend: api.BackendGVisor}, needGVisor},
		{"microvm", api.SandboxSpec{Backend: api.BackendMicroVM}, needMicroVM},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if tc.need != nil {
				tc.need(t)
			}
			sb := newSandbox(t, tc.spec)
			c := ctx(t)
			if err := client.WriteFile(c, sb.ID, "/tmp/hunter.sh", strings.NewReader(hunter), 0o755); err != nil {
				t.Fatal(err)
			}
			if _, err := client.Exec(c, sb.ID, api.ExecRequest{Cmd: "sh /tmp/hunter.sh >/dev/null 2>&1 </dev/null & echo started"}); err != nil {
				t.Fatal(err)
			}
			grader := "sleep 1; echo GRADER-MARK done; cat /proc/self/status | grep -c ^Pid; ls /proc | grep -c '^[0-9]'; echo $$"
			// The attack works on an ordinary exec.
			res, err := client.Exec(c, sb.ID, api.ExecRequest{Argv: []string{"/bin/sh", "-c", grader, "GRADER-MARK"}, Timeout: 20})
			if err != nil {
				t.Fatal(err)
			}
			if res.ExitCode == 0 || strings.Contains(res.Stdout, "done") {
				t.Fatalf("an ordinary exec survived the hunter: exit %d %q; the test cannot tell", res.ExitCode, res.Stdout)
			}
			// A private one is out of its reach.
			res, err = client.Exec(c, sb.ID, api.ExecRequest{Argv: []string{"/bin/sh", "-c", grader, "GRADER-MARK"}, Timeout: 20, Private: true})
			if err != nil {
				t.Fatal(err)
			}
			lines := strings.Fields(strings.TrimSpace(res.Stdout))
			if res.ExitCode != 0 || len(lines) != 5 || lines[1] != "done" {
				t.Fatalf("private exec: exit %d, stdout %q, stderr %q", res.ExitCode, res.Stdout, res.Stderr)
			}
			// Its /proc is its own: /proc/self works, it is pid 1, and it
			// sees its own few processes, not the sandbox's.
			if lines[4] != "1" || lines[2] != "1" {
				t.Errorf("private exec: $$ = %s, /proc/self/status Pid lines %s; want pid 1 and a working /proc/self", lines[4], lines[2])
			}
			if n := lines[3]; n == "0" || len(n) > 1 {
				t.Errorf("private exec sees %s processes in /proc, want only its own few", n)
			}
			// The sandbox's masks hold in it too: the masked entries look
			// the same from an ordinary and from a private exec.
			probe := "for f in /proc/kcore /proc/keys /proc/timer_list /proc/sched_debug /proc/acpi /proc/scsi; do stat -c '%n %F %s' $f 2>&1; done; (echo x > /proc/sys/kernel/domainname) 2>/dev/null || echo refused"
			plain, err := client.Exec(c, sb.ID, api.ExecRequest{Cmd: probe})
			if err != nil {
				t.Fatal(err)
			}
			private, err := client.Exec(c, sb.ID, api.ExecRequest{Cmd: probe, Private: true})
			if err != nil {
				t.Fatal(err)
			}
			if plain.Stdout != private.Stdout || !strings.Contains(private.Stdout, "refused") {
				t.Errorf("masks differ in a private exec:\nordinary: %s\nprivate:  %s", plain.Stdout, private.Stdout)
			}
			// What it starts in the background ends with it: a loop that
			// counts every 100 ms stops writing.
			// (It waits until the loop has written, up to 10 s: under
			// QEMU's emulation 0.3 s was not always enough in CI.)
			if _, err := client.Exec(c, sb.ID, api.ExecRequest{Cmd: "(i=0; while :; do i=$((i+1)); echo $i > /tmp/alive; sleep 0.1; done) >/dev/null 2>&1 & n=0; while [ ! -s /tmp/alive ] && [ $n -lt 100 ]; do sleep 0.1; n=$((n+1)); done; sleep 0.2; echo started", Private: true}); err != nil {
				t.Fatal(err)
			}
			alive := func() string { return sh(t, sb.ID, "cat /tmp/alive").Stdout }
			first := alive()
			if first == "" {
				t.Fatal("the private exec's background loop never wrote: the check below proves nothing")
			}
			deadline := time.Now().Add(5 * time.Second)
			for {
				a := alive()
				time.Sleep(500 * time.Millisecond)
				if b := alive(); a == b {
					break
				}
				if time.Now().After(deadline) {
					t.Fatal("a private exec's background child outlived it")
				}
			}
			if log := sh(t, sb.ID, "cat /tmp/hunter.log 2>/dev/null | wc -l").Stdout; strings.TrimSpace(log) == "0" {
				t.Errorf("the hunter hit nothing: it did not run, so the test proves nothing")
			}
		})
	}
}
