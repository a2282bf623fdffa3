package gvisor

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/dsecproject/dsec/internal/cgroup"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/sandbox"
	"github.com/dsecproject/dsec/internal/sandbox/sandboxtest"
)

// newTestBackend returns a backend over a temp state root, or skips.
func newTestBackend(t *testing.T) *GVisor {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: runsc runs sandboxes as root")
	}
	for _, bin := range []string{"runsc", "catatonit"} {
		if _, err := exec.LookPath(bin); err != nil {
			t.Skipf("needs %s (apt-get install %s)", bin, bin)
		}
	}
	g, err := New(Config{StateRoot: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	return g
}

func TestConformance(t *testing.T) {
	g := newTestBackend(t)
	cg, err := cgroup.Detect()
	if err != nil {
		t.Fatal(err)
	}
	g.cfg.Cgroups = cg
	if err := cg.EnsureParent("/dsec-gvisor-test"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = cg.RemoveParent("/dsec-gvisor-test") })
	sandboxtest.Run(t, sandboxtest.Env{
		Backend: g,
		CgroupProcs: func(rel string) ([]int, error) {
			pids, err := cg.Procs(rel)
			if errors.Is(err, errdefs.ErrNotFound) {
				return nil, nil
			}
			return pids, err
		},
		NewConfig: func(t *testing.T, id string) sandbox.Config {
			return sandbox.Config{
				ID: id, Dir: t.TempDir(), Rootfs: sandboxtest.BusyboxRootfs(t),
				Hostname: id, CgroupPath: filepath.Join("/dsec-gvisor-test", id),
				Limits: sandbox.Limits{MemoryBytes: 256 << 20, Pids: 256, CPU: 1},
			}
		},
	})
}

func TestParsePS(t *testing.T) {
	out := []byte("UID       PID       PPID      C         TTY       STIME     TIME      CMD\n0         1         0         0         ?         11:43     0s        catatonit\n0 7 1 0 ? 11:43 0s sh\n0 9 7 0 ? 11:43 0s sleep\n0 10 9 0 ? 11:43 0s sleep\n0 11 1 0 ? 11:43 0s other\n")
	procs := parsePS(out)
	if len(procs) != 5 {
		t.Fatalf("parsed %v", procs)
	}
	if want := (psEntry{pid: 10, ppid: 9}); procs[3] != want {
		t.Fatalf("line 4 parsed as %+v, want %+v", procs[3], want)
	}
}

// TestStaleStateKillsNobody: runsc's state files outlive a reboot and name
// pids that may be anyone's by then. Status must not take such a process
// for the Sentry, nor Destroy kill it; the stale state goes.
func TestStaleStateKillsNobody(t *testing.T) {
	root := t.TempDir()
	g := &GVisor{cfg: Config{StateRoot: root}}
	other := exec.Command("sleep", "60")
	if err := other.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = other.Process.Kill(); _ = other.Wait() })
	state := `{"id":"ghost","status":"running","goferPid":` + strconv.Itoa(other.Process.Pid) + `,"sandbox":{"id":"ghost","pid":` + strconv.Itoa(other.Process.Pid) + `}}`
	if err := os.WriteFile(statePath(root, "ghost"), []byte(state), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(root, "exec"), 0o700); err != nil {
		t.Fatal(err)
	}
	ids, err := g.List(context.Background())
	if err != nil || !slices.Equal(ids, []string{"ghost"}) {
		t.Fatalf("list = %v, %v; want [ghost]", ids, err)
	}
	st, err := g.Status(context.Background(), "ghost")
	if err != nil || st.Running {
		t.Fatalf("status of a stale state = %+v, %v; want not running", st, err)
	}
	if err := g.Destroy(context.Background(), "ghost"); err != nil {
		t.Fatal(err)
	}
	if err := other.Process.Signal(syscall.Signal(0)); err != nil {
		t.Fatalf("destroying a stale sandbox killed pid %d, which was not its Sentry: %v", other.Process.Pid, err)
	}
	if _, err := os.Stat(statePath(root, "ghost")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("stale state left: %v", err)
	}
	if _, err := g.Status(context.Background(), "ghost"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("status after destroy: %v, want not found", err)
	}
}

// TestInitExitEndsSandbox: the sandbox's init runs in a subcontainer under
// a root container that does nothing of the sandbox's; when the init dies
// the sandbox must end (the root's follower exits, and with it the
// Sentry), as it would with one container, not linger as running. The
// sandbox's commands, a private run's and the root's processes live in
// three pid namespaces; a private run sees only its own.
func TestInitExitEndsSandbox(t *testing.T) {
	g := newTestBackend(t)
	ctx := context.Background()
	id := "init-exit-" + strconv.Itoa(os.Getpid())
	if err := g.Create(ctx, sandbox.Config{ID: id, Dir: t.TempDir(), Rootfs: sandboxtest.BusyboxRootfs(t), Hostname: id, Limits: sandbox.Limits{Pids: 64}}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = g.Destroy(ctx, id) })
	run := func(private bool, cmd string) string {
		t.Helper()
		var out strings.Builder
		p, err := g.Exec(ctx, id, sandbox.Process{Args: []string{"/bin/sh", "-c", cmd}, Stdout: &out, Stderr: &out, Private: private})
		if err != nil {
			t.Fatal(err)
		}
		if code, err := p.Wait(); code != 0 || err != nil {
			t.Fatalf("%q (private %v): exit %d, %v: %s", cmd, private, code, err, out.String())
		}
		return strings.TrimSpace(out.String())
	}
	// The shell lists /proc itself (a glob): a pipeline's second command
	// may not be forked yet when its first reads /proc.
	if got := run(true, "echo $$; set -- /proc/[0-9]*; echo $#"); got != "1\n1" {
		t.Fatalf("a private run sees pid %q, want itself as 1 and no other process", got)
	}
	// A private run is held to the sandbox's limits (pids: RLIMIT_NPROC).
	if got := run(true, "ulimit -u"); got != "64" {
		t.Fatalf("a private run's RLIMIT_NPROC is %q, want the sandbox's 64", got)
	}
	if got := run(false, "cat /proc/1/cmdline | tr '\\0' ' '"); got != "/dev/init -P" {
		t.Fatalf("the sandbox's pid 1 is %q, want its init", got)
	}
	if _, err := g.run(ctx, "kill", workloadID(id), "9"); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		st, err := g.Status(ctx, id)
		if err == nil && !st.Running {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("10 s after its init was killed the sandbox is %+v, %v; want not running", st, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err := g.Destroy(ctx, id); err != nil {
		t.Fatal(err)
	}
	if left, _ := filepath.Glob(filepath.Join(g.cfg.StateRoot, "*"+id+"*")); len(left) != 0 {
		t.Fatalf("left after destroy: %v", left)
	}
	if left, _ := filepath.Glob(filepath.Join(g.cfg.StateRoot, "dsec", "*"+id+"*")); len(left) != 0 {
		t.Fatalf("left after destroy: %v", left)
	}
}
