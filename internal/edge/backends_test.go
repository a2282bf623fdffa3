package edge

import (
	"context"
	"errors"
	"slices"
	"testing"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/sandbox"
	"github.com/dsecproject/dsec/internal/sandbox/fake"
)

// TestBackendPerSandbox: a node with two backends runs each sandbox on the
// one its spec names, and only there: exec, pause and delete reach that
// backend; the node advertises both; a backend it lacks is refused before
// anything is made; recovery adopts each sandbox from its own backend,
// reaps orphans from every backend, and fails a sandbox whose backend the
// node no longer offers.
func TestBackendPerSandbox(t *testing.T) {
	ctx := context.Background()
	state := t.TempDir()
	src := &testImages{dir: t.TempDir()}
	layers := src.digests(t, 1)
	ctr, gv := fake.New("container"), fake.New("gvisor")
	start := func(others ...sandbox.Backend) *Edge {
		e, err := New(Config{Name: "n1", StateDir: state, Policy: sandbox.DefaultPolicy()}, Deps{Backend: ctr, Others: others, Blobs: src})
		if err != nil {
			t.Fatal(err)
		}
		if err := e.Start(ctx); err != nil {
			t.Fatal(err)
		}
		return e
	}
	e := start(gv)
	info, err := e.Info(ctx)
	if err != nil || !slices.Equal(info.Backends, []string{"container", "gvisor"}) {
		t.Fatalf("node backends %v, %v; want [container gvisor]", info.Backends, err)
	}
	create := func(e *Edge, backend string) (*api.Sandbox, error) {
		return e.Create(ctx, edgeapi.CreateRequest{Spec: api.SandboxSpec{Base: "base/x:1", Backend: backend}, Digests: layers})
	}
	c, err := create(e, "")
	if err != nil {
		t.Fatal(err)
	}
	g, err := create(e, "gvisor")
	if err != nil {
		t.Fatal(err)
	}
	if c.Backend != "container" || g.Backend != "gvisor" {
		t.Fatalf("backends %q and %q, want container and gvisor", c.Backend, g.Backend)
	}
	if _, ok := ctr.Get(g.ID); ok {
		t.Fatal("the gvisor sandbox is on the container backend")
	}
	if _, ok := gv.Get(c.ID); ok {
		t.Fatal("the container sandbox is on the gvisor backend")
	}
	if _, err := e.Exec(ctx, g.ID, api.ExecRequest{Argv: []string{"true"}}, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Pause(ctx, g.ID); err != nil {
		t.Fatal(err)
	}
	if s, _ := gv.Get(g.ID); s.Execs != 1 || !s.Paused {
		t.Fatalf("gvisor backend's view %+v; want one exec and paused", s)
	}
	if s, _ := ctr.Get(c.ID); s.Execs != 0 || s.Paused {
		t.Fatalf("container backend's view %+v; want untouched", s)
	}
	if got := e.countsByBackend(); got[[2]string{"gvisor", "paused"}] != 1 || got[[2]string{"container", "running"}] != 1 || len(got) != 2 {
		t.Fatalf("counts by backend and state %v; want one paused gvisor, one running container", got)
	}
	if _, err := create(e, "microvm"); !errors.Is(err, errdefs.ErrPrecondition) {
		t.Fatalf("create on a backend the node lacks: %v, want failed_precondition", err)
	}
	ids, _ := gv.List(ctx)
	if len(ids) != 1 {
		t.Fatalf("gvisor backend holds %v after a refused create", ids)
	}

	// Restart with both: each sandbox adopted, an orphan of the second
	// backend reaped.
	e.Close()
	gv.Adopt("sb-n1-gvisororphanorpha")
	e = start(gv)
	if sb, err := e.Get(ctx, g.ID); err != nil || sb.State != api.StatePaused || sb.Backend != "gvisor" {
		t.Fatalf("gvisor sandbox after restart: %+v %v", sb, err)
	}
	if _, ok := gv.Get("sb-n1-gvisororphanorpha"); ok {
		t.Fatal("the gvisor backend's orphan was not reaped")
	}
	// Restart without the second backend: its sandbox is failed, the
	// container's adopted.
	e.Close()
	e = start()
	defer e.Close()
	if sb, err := e.Get(ctx, g.ID); err != nil || sb.State != api.StateFailed {
		t.Fatalf("sandbox of a backend the node dropped: %+v %v, want failed", sb, err)
	}
	if sb, err := e.Get(ctx, c.ID); err != nil || sb.State != api.StateRunning {
		t.Fatalf("container sandbox: %+v %v, want running", sb, err)
	}
	if err := e.Delete(ctx, g.ID); err != nil {
		t.Fatal(err)
	}
	if err := e.Delete(ctx, c.ID); err != nil {
		t.Fatal(err)
	}
	if ids, _ := ctr.List(ctx); len(ids) != 0 {
		t.Fatalf("container backend still holds %v", ids)
	}
}
