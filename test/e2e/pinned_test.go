package e2e

import (
	"strings"
	"testing"

	"github.com/dsecproject/dsec/api"
)

// DSEC-FACTS.md §7, incident 3: an agent overwrote /bin/bash so that the
// platform's later commands ran its code. The pinned shell (/dev/sh, the
// host's static busybox mounted read-only) cannot be replaced.
func TestPinnedShellSurvivesHijackedShells(t *testing.T) {
	needDaemon(t)
	sb := newSandbox(t, api.SandboxSpec{Workspace: workspaceRef})
	// The agent, as root, replaces both shells with traps and tries every
	// way to reach the pinned one.
	r := sh(t, sb.ID, `
printf '#!/dev/sh\necho HIJACKED >> /tmp/trap; exit 0\n' > /tmp/evil; chmod +x /tmp/evil
cp /tmp/evil /bin/bash
echo x > /dev/sh 2>/dev/null && echo WROTE
rm -f /dev/sh 2>/dev/null; test -e /dev/sh || echo REMOVED
mv /dev/sh /dev/sh2 2>/dev/null && echo MOVED
mount --bind /tmp/evil /dev/sh 2>/dev/null && echo MOUNTED
ln -sf /tmp/evil /dev/sh 2>/dev/null; test -L /dev/sh && echo LINKED
rm -f /bin/sh; cp /tmp/evil /bin/sh
echo done`)
	if r.Stdout != "done\n" {
		t.Fatalf("the sandbox got at the pinned shell: %q (stderr %q)", r.Stdout, r.Stderr)
	}
	// The hijacked /bin/sh now catches ordinary `cmd` execs...
	if r := sh(t, sb.ID, "echo normal"); r.Stdout == "normal\n" {
		t.Fatalf("test setup: /bin/sh was not replaced")
	}
	// ...but not sessions and graders that use the pinned shell.
	sid, err := client.CreateSession(ctx(t), sb.ID, api.SessionRequest{Shell: "/dev/sh"})
	if err != nil {
		t.Fatal(err)
	}
	run, err := client.SessionRun(ctx(t), sb.ID, sid, api.SessionRunRequest{Command: "cd /repo && cat a.txt && echo $0"})
	if err != nil || run.Stdout != "workspace\n/dev/sh\n" || run.ExitCode != 0 {
		t.Fatalf("pinned session: %+v %v", run, err)
	}
	res, err := client.Exec(ctx(t), sb.ID, api.ExecRequest{Argv: []string{"/dev/sh", "-c", "cat /repo/a.txt; test -e /tmp/trap && cat /tmp/trap"}})
	if err != nil || strings.Contains(res.Stdout, "HIJACKED") && !strings.HasPrefix(res.Stdout, "workspace\n") {
		t.Fatalf("pinned grader: %+v %v", res, err)
	}
	// The only trap hits are from the ordinary exec above, none from the
	// pinned session or grader.
	trap, _ := client.Exec(ctx(t), sb.ID, api.ExecRequest{Argv: []string{"/dev/sh", "-c", "cat /tmp/trap 2>/dev/null | wc -l"}})
	if strings.TrimSpace(trap.Stdout) != "1" {
		t.Fatalf("trap fired %q times, want once (the unpinned exec)", strings.TrimSpace(trap.Stdout))
	}
}
