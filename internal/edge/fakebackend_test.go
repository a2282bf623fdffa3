package edge

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/sandbox"
	"github.com/dsecproject/dsec/internal/sandbox/fake"
)

// testImages is a layer source over files named by digest, counting the
// images held open.
type testImages struct {
	dir  string
	mu   sync.Mutex
	open int
}

func (s *testImages) Open(ctx context.Context, digest string) (string, func(), error) {
	p := filepath.Join(s.dir, strings.TrimPrefix(digest, "sha256:"))
	if _, err := os.Stat(p); err != nil {
		return "", nil, errdefs.NotFound("image %s is missing", digest)
	}
	s.mu.Lock()
	s.open++
	s.mu.Unlock()
	var once sync.Once
	return p, func() {
		once.Do(func() {
			s.mu.Lock()
			s.open--
			s.mu.Unlock()
		})
	}, nil
}

func (s *testImages) held() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.open
}

// digests makes n layer images and returns their digests.
func (s *testImages) digests(t testing.TB, n int) []string {
	t.Helper()
	var out []string
	for i := range n {
		hex := strings.Repeat(string(rune('a'+i)), 64)
		if err := os.WriteFile(filepath.Join(s.dir, hex), []byte("image"), 0o600); err != nil {
			t.Fatal(err)
		}
		out = append(out, "sha256:"+hex)
	}
	return out
}

// fakeEdge starts an edge on state over the fake backend b: no root, no
// mounts, no processes.
func fakeEdge(t *testing.T, state string, b *fake.Backend, src *testImages) *Edge {
	t.Helper()
	return fakeEdgeWith(t, state, b, src, nil)
}

// fakeEdgeWith is fakeEdge with its Config changed by tune first.
func fakeEdgeWith(t *testing.T, state string, b *fake.Backend, src *testImages, tune func(*Config)) *Edge {
	t.Helper()
	cfg := Config{Name: "n1", StateDir: state, Policy: sandbox.DefaultPolicy()}
	if tune != nil {
		tune(&cfg)
	}
	e, err := New(cfg, Deps{Backend: b, Blobs: src})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	return e
}

func entries(t *testing.T, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	return out
}

// TestEdgeLifecycleWithoutRoot: over a backend that makes the rootfs
// itself, the edge creates, counts, deletes and recovers sandboxes with no
// root and nothing mounted; a failed create leaves nothing; a sandbox that
// died while the edge was down is reported failed, an orphan the runtime
// kept is reaped, and the survivors are adopted with their images held.
func TestEdgeLifecycleWithoutRoot(t *testing.T) {
	ctx := context.Background()
	state := t.TempDir()
	src := &testImages{dir: t.TempDir()}
	layers := src.digests(t, 2)
	b := fake.New("container")
	e := fakeEdge(t, state, b, src)
	sandboxes := filepath.Join(state, "sandboxes")

	req := edgeapi.CreateRequest{Spec: api.SandboxSpec{Base: "base/x:1", Labels: map[string]string{"job": "j1"}}, Digests: layers}
	var ids []string
	for range 3 {
		sb, err := e.Create(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		if sb.State != api.StateRunning {
			t.Fatalf("created %s is %s, want running", sb.ID, sb.State)
		}
		ids = append(ids, sb.ID)
	}
	got, ok := b.Get(ids[0])
	if !ok || len(got.Config.Images) != 2 || got.Config.Rootfs != "" || got.Config.Upper == "" {
		t.Fatalf("backend got %+v, want two images, an upper and no rootfs", got.Config)
	}
	if !strings.HasSuffix(got.Config.Images[0], strings.TrimPrefix(layers[0], "sha256:")) {
		t.Fatalf("images %v are not bottom first (%v)", got.Config.Images, layers)
	}
	if n, err := e.Info(ctx); err != nil || n.Counts[api.StateRunning] != 3 || n.Jobs["j1"] != 3 {
		t.Fatalf("info %+v (%v), want 3 running in job j1", n, err)
	}
	if held := src.held(); held != 6 {
		t.Fatalf("%d images held, want 6 (two per sandbox)", held)
	}
	// Pause and resume go to the backend (there are no cgroups here).
	if n, err := e.PauseByLabels(ctx, map[string]string{"job": "j1"}); err != nil || n != 3 {
		t.Fatalf("pausing the job: %d, %v; want 3", n, err)
	}
	if got, _ := b.Get(ids[0]); !got.Paused {
		t.Fatal("the backend was not asked to pause")
	}
	if sb, _ := e.Get(ctx, ids[0]); sb.State != api.StatePaused {
		t.Fatalf("paused sandbox is %s", sb.State)
	}
	if n, err := e.ResumeByLabels(ctx, map[string]string{"job": "j1"}); err != nil || n != 3 {
		t.Fatalf("resuming the job: %d, %v; want 3", n, err)
	}
	if got, _ := b.Get(ids[0]); got.Paused {
		t.Fatal("the backend was not asked to resume")
	}
	// Commands go to the backend with the user unresolved: the node cannot
	// read the sandbox's /etc/passwd, the backend resolves it inside.
	res, err := e.Exec(ctx, ids[0], api.ExecRequest{Argv: []string{"true"}, User: "agent", Env: map[string]string{"A": "1"}}, nil)
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("exec: %+v, %v; want exit 0", res, err)
	}
	if got, _ := b.Get(ids[0]); got.Execs != 1 || got.LastExec.User != "agent" || got.LastExec.UID != 0 ||
		!slices.Contains(got.LastExec.Env, "A=1") || slices.ContainsFunc(got.LastExec.Env, func(v string) bool { return strings.HasPrefix(v, "HOME=") }) {
		t.Fatalf("the backend got %d execs, the last %+v; want one as user agent with A=1 and no HOME set by the node", got.Execs, got.LastExec)
	}
	// What the host cannot see of such a sandbox is refused, not faked.
	if _, _, err := e.ReadFile(ctx, ids[0], "/etc/hostname"); !errors.Is(err, errdefs.ErrPrecondition) {
		t.Fatalf("reading a file: %v, want failed_precondition", err)
	}

	// A create the backend refuses leaves no directory, count or image.
	b.FailNextCreate(errors.New("no room in the simulated runtime"))
	if _, err := e.Create(ctx, req); err == nil {
		t.Fatal("a create the backend refused succeeded")
	}
	if n := len(entries(t, sandboxes)); n != 3 {
		t.Fatalf("%d sandbox dirs after a failed create, want 3", n)
	}
	if held := src.held(); held != 6 {
		t.Fatalf("%d images held after a failed create, want 6", held)
	}

	if err := e.Delete(ctx, ids[2]); err != nil {
		t.Fatal(err)
	}
	if _, ok := b.Get(ids[2]); ok {
		t.Fatal("the backend still holds a deleted sandbox")
	}
	if held := src.held(); held != 4 {
		t.Fatalf("%d images held after a delete, want 4", held)
	}

	// The edge stops; meanwhile one sandbox dies and the runtime keeps an
	// orphan. The next edge adopts the survivor and says why the other
	// is gone.
	e.Close()
	b.Stop(ids[1])
	b.Adopt("sb-n1-orphanorphanorph")
	src2 := &testImages{dir: src.dir}
	e2 := fakeEdge(t, state, b, src2)
	defer e2.Close()
	if sb, err := e2.Get(ctx, ids[0]); err != nil || sb.State != api.StateRunning {
		t.Fatalf("survivor: %+v %v, want running", sb, err)
	}
	sb, err := e2.Get(ctx, ids[1])
	if err != nil || sb.State != api.StateFailed || !strings.Contains(sb.Error, "edge was down") {
		t.Fatalf("dead sandbox: %+v %v, want failed for having exited while the edge was down", sb, err)
	}
	if _, ok := b.Get("sb-n1-orphanorphanorph"); ok {
		t.Fatal("the orphan was not reaped")
	}
	if _, ok := b.Get(ids[1]); ok {
		t.Fatal("the dead sandbox's runtime state was not removed")
	}
	if left := entries(t, filepath.Join(sandboxes, ids[1])); len(left) != 1 || left[0] != recordFile {
		t.Fatalf("the dead sandbox's dir holds %v, want its record only", left)
	}
	if held := src2.held(); held != 2 {
		t.Fatalf("the adopted sandbox holds %d images, want 2", held)
	}
	if err := e2.Delete(ctx, ids[0]); err != nil {
		t.Fatal(err)
	}
	if held := src2.held(); held != 0 {
		t.Fatalf("%d images held with no sandbox, want 0", held)
	}
	if ids, _ := b.List(ctx); len(ids) != 0 {
		t.Fatalf("the backend still holds %v", ids)
	}
}

// TestLayerImagesBackendRefusesHostOnlyFeatures: what needs the host's view
// of the rootfs (userns's idmapped layers, snapshots) is refused with the
// reason for a backend that makes the rootfs itself.
func TestLayerImagesBackendRefusesHostOnlyFeatures(t *testing.T) {
	ctx := context.Background()
	src := &testImages{dir: t.TempDir()}
	b := fake.New("container")
	e, err := New(Config{Name: "n1", StateDir: t.TempDir(), Policy: sandbox.DefaultPolicy(), UserNSBase: 1 << 30}, Deps{Backend: b, Blobs: src})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.Start(ctx); err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	layers := src.digests(t, 1)
	_, err = e.Create(ctx, edgeapi.CreateRequest{Spec: api.SandboxSpec{Base: "base/x:1", UserNS: new(true)}, Digests: layers})
	if !errors.Is(err, errdefs.ErrPrecondition) || !strings.Contains(err.Error(), "userns") {
		t.Fatalf("userns: %v, want failed_precondition naming userns", err)
	}
	sb, err := e.Create(ctx, edgeapi.CreateRequest{Spec: api.SandboxSpec{Base: "base/x:1"}, Digests: layers})
	if err != nil {
		t.Fatal(err)
	}
	_, err = e.Snapshot(ctx, sb.ID, edgeapi.SnapshotOptions{Request: api.SnapshotRequest{Ref: "snapshot/s:1"}})
	if !errors.Is(err, errdefs.ErrPrecondition) {
		t.Fatalf("snapshot: %v, want failed_precondition", err)
	}
}

// TestRecoveryReleasesDeadSandboxesTogether: an edge back from an outage
// during which many of its sandboxes died releases them many at a time,
// not one after another, and reports every one failed.
func TestRecoveryReleasesDeadSandboxesTogether(t *testing.T) {
	ctx := context.Background()
	state := t.TempDir()
	src := &testImages{dir: t.TempDir()}
	layers := src.digests(t, 1)
	b := fake.NewWithLatency("container", fake.Latency{Destroy: fake.Dist{Median: 20 * time.Millisecond}})
	e := fakeEdge(t, state, b, src)
	const n = 48
	var ids []string
	for range n {
		sb, err := e.Create(ctx, edgeapi.CreateRequest{Spec: api.SandboxSpec{Base: "base/x:1"}, Digests: layers})
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, sb.ID)
	}
	e.Close()
	for _, id := range ids {
		b.Stop(id)
	}
	start := time.Now()
	e2 := fakeEdge(t, state, b, &testImages{dir: src.dir})
	defer e2.Close()
	took := time.Since(start)
	for _, id := range ids {
		if sb, err := e2.Get(ctx, id); err != nil || sb.State != api.StateFailed {
			t.Fatalf("%s after the restart: %+v %v, want failed", id, sb, err)
		}
		if _, ok := b.Get(id); ok {
			t.Fatalf("%s: the runtime still holds it", id)
		}
	}
	if m := b.MaxConcurrentDestroys(); m < 2 {
		t.Fatalf("recovery destroyed %d dead sandboxes one at a time (%v), want several at once", n, took)
	}
	t.Logf("%d dead sandboxes released in %v, at most %d at once", n, took, b.MaxConcurrentDestroys())
}
