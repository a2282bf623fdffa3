package edge

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/sandbox"
)

// hostBackend runs "sandbox" processes as plain host processes, each as
// the child of a /bin/sh (a session's shell must be a descendant of the
// process Exec returns, as in a real sandbox). It stands in for a backend
// where only the edge's own bookkeeping is under test: no sandbox, mount
// or namespace is made.
type hostBackend struct{}

func (hostBackend) Name() string                                 { return "host-test" }
func (hostBackend) Create(context.Context, sandbox.Config) error { return nil }
func (hostBackend) Destroy(context.Context, string) error        { return nil }
func (hostBackend) List(context.Context) ([]string, error)       { return nil, nil }
func (hostBackend) Status(context.Context, string) (sandbox.Status, error) {
	return sandbox.Status{}, errdefs.NotFound("no runtime state")
}

func (hostBackend) Exec(ctx context.Context, id string, p sandbox.Process) (sandbox.Proc, error) {
	cmd := exec.Command("/bin/sh", append([]string{"-c", `"$@"; exit $?`, "sh"}, p.Args...)...)
	cmd.Dir = "/"
	cmd.Stdin, cmd.Stdout, cmd.Stderr = p.Stdin, p.Stdout, p.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	return &hostProc{cmd: cmd}, nil
}

type hostProc struct{ cmd *exec.Cmd }

func (p *hostProc) Wait() (int, error) {
	err := p.cmd.Wait()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return ee.ExitCode(), nil
	}
	return 0, err
}

func (p *hostProc) Kill() error { return syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL) }
func (p *hostProc) Pid() int    { return p.cmd.Process.Pid }

// hostEdge is an edge over hostBackend with running "sandboxes" ids.
func hostEdge(t *testing.T, cfg Config, ids ...string) *Edge {
	t.Helper()
	if _, err := os.Stat("/bin/sh"); err != nil {
		t.Skip("needs /bin/sh")
	}
	cfg.Name, cfg.StateDir = "n1", t.TempDir()
	e, err := New(cfg, Deps{Backend: hostBackend{}})
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range ids {
		dir := filepath.Join(cfg.StateDir, "sandboxes", id)
		if err := os.MkdirAll(filepath.Join(dir, "rootfs"), 0o700); err != nil {
			t.Fatal(err)
		}
		e.sandboxes[id] = &sbx{dir: dir, rec: record{Sandbox: api.Sandbox{ID: id, State: api.StateRunning,
			Spec: api.SandboxSpec{User: "0", Workdir: "/"}}}}
	}
	t.Cleanup(func() {
		for _, s := range e.sandboxes {
			s.closeSessions()
		}
	})
	return e
}

func wantExhausted(t *testing.T, err error, flag string) {
	t.Helper()
	if !errors.Is(err, errdefs.ErrExhausted) || !strings.Contains(err.Error(), flag) {
		t.Fatalf("err %v, want resource_exhausted naming %s", err, flag)
	}
}

// TestSessionsNodeWide: sessions count against a node-wide limit across
// sandboxes as well as the per-sandbox one; a closed session, or a
// deleted sandbox's, gives its slot back; a refused open leaves nothing
// counted.
func TestSessionsNodeWide(t *testing.T) {
	e := hostEdge(t, Config{MaxSessionsTotal: 3}, "sb-n1-a", "sb-n1-b")
	ctx := context.Background()
	var a []string
	for range 2 {
		ss, err := e.OpenSession(ctx, "sb-n1-a", api.SessionRequest{})
		if err != nil {
			t.Fatal(err)
		}
		a = append(a, ss.SessionID)
	}
	if _, err := e.OpenSession(ctx, "sb-n1-b", api.SessionRequest{}); err != nil {
		t.Fatal(err)
	}
	_, err := e.OpenSession(ctx, "sb-n1-b", api.SessionRequest{})
	wantExhausted(t, err, "--max-sessions-total")
	if n := e.sessions.inUse(); n != 3 {
		t.Fatalf("%d slots in use after a refused open, want 3", n)
	}
	res, err := e.RunInSession(ctx, "sb-n1-a", a[0], api.SessionRunRequest{Command: "echo hi"})
	if err != nil || strings.TrimSpace(res.Stdout) != "hi" {
		t.Fatalf("run: %+v, %v", res, err)
	}
	if err := e.CloseSession(ctx, "sb-n1-a", a[0]); err != nil {
		t.Fatal(err)
	}
	if _, err := e.OpenSession(ctx, "sb-n1-b", api.SessionRequest{}); err != nil {
		t.Fatalf("open after a close: %v", err)
	}
	// A session whose shell exits gives its slot back.
	if _, err := e.RunInSession(ctx, "sb-n1-a", a[1], api.SessionRunRequest{Command: "exit 3"}); err != nil {
		t.Fatal(err)
	}
	if n := e.sessions.inUse(); n != 2 {
		t.Fatalf("%d slots in use after a shell exited, want 2", n)
	}
	e.sandboxes["sb-n1-b"].closeSessions() // what a delete does
	if n := e.sessions.inUse(); n != 0 {
		t.Fatalf("%d slots in use with no session open, want 0", n)
	}
}

// TestSessionsConcurrentOpens: opens racing each other cannot pass either
// limit (the per-sandbox one was checked before the shell started and
// counted only after, so a burst of opens passed it together).
func TestSessionsConcurrentOpens(t *testing.T) {
	for _, c := range []struct {
		name string
		cfg  Config
		want int
	}{
		{"per-sandbox", Config{MaxSessions: 2, MaxSessionsTotal: 100}, 2},
		{"node-wide", Config{MaxSessions: 64, MaxSessionsTotal: 3}, 3},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := hostEdge(t, c.cfg, "sb-n1-a")
			var wg sync.WaitGroup
			var mu sync.Mutex
			opened, refused := 0, 0
			for range 12 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					_, err := e.OpenSession(context.Background(), "sb-n1-a", api.SessionRequest{})
					mu.Lock()
					defer mu.Unlock()
					switch {
					case err == nil:
						opened++
					case errors.Is(err, errdefs.ErrExhausted):
						refused++
					default:
						t.Error(err)
					}
				}()
			}
			wg.Wait()
			if opened != c.want || refused != 12-c.want {
				t.Fatalf("%d opened, %d refused; want %d opened", opened, refused, c.want)
			}
		})
	}
}

// TestStreamsNodeWide: running commands and port connections share one
// node-wide limit; a call past it is refused before anything starts, and
// finished or failed calls give their slots back.
func TestStreamsNodeWide(t *testing.T) {
	e := hostEdge(t, Config{MaxStreams: 2}, "sb-n1-a", "sb-n1-b")
	ctx := context.Background()
	var wg sync.WaitGroup
	for _, id := range []string{"sb-n1-a", "sb-n1-b"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			emit := func(api.ExecEvent) error { return nil }
			if _, err := e.Exec(ctx, id, api.ExecRequest{Cmd: "sleep 2"}, emit); err != nil {
				t.Error(err)
			}
		}()
	}
	deadline := time.Now().Add(10 * time.Second)
	for e.streams.inUse() < 2 {
		if time.Now().After(deadline) {
			t.Fatal("the two commands never ran together")
		}
		time.Sleep(5 * time.Millisecond)
	}
	start := time.Now()
	_, err := e.Exec(ctx, "sb-n1-a", api.ExecRequest{Cmd: "echo no"}, nil)
	wantExhausted(t, err, "--max-streams")
	_, _, err = e.DialPort(ctx, "sb-n1-a", 8080)
	wantExhausted(t, err, "--max-streams")
	if time.Since(start) > time.Second {
		t.Fatalf("refusals took %v: they must not wait", time.Since(start))
	}
	wg.Wait()
	if n := e.streams.inUse(); n != 0 {
		t.Fatalf("%d slots in use after the commands ended", n)
	}
	res, err := e.Exec(ctx, "sb-n1-a", api.ExecRequest{Cmd: "echo yes"}, nil)
	if err != nil || strings.TrimSpace(res.Stdout) != "yes" {
		t.Fatalf("exec after the others ended: %+v, %v", res, err)
	}
	// A port connection that fails gives its slot back.
	if _, _, err := e.DialPort(ctx, "sb-n1-a", 8080); err == nil {
		t.Fatal("DialPort succeeded without a runtime")
	}
	if n := e.streams.inUse(); n != 0 {
		t.Fatalf("%d slots in use after a failed port connection", n)
	}
}

func TestDefaultNodeBounds(t *testing.T) {
	for _, c := range []struct {
		nofile uint64
		want   int
	}{{1024, 64}, {20000, 1250}, {65536, 4096}, {1 << 20, 16384}} {
		if got := DefaultMaxSessionsTotal(c.nofile); got != c.want {
			t.Errorf("DefaultMaxSessionsTotal(%d) = %d, want %d", c.nofile, got, c.want)
		}
		if got := DefaultMaxStreams(c.nofile); got != c.want {
			t.Errorf("DefaultMaxStreams(%d) = %d, want %d", c.nofile, got, c.want)
		}
	}
}
