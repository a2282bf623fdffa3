// Package fake is a sandbox.Backend that runs nothing: it keeps its
// sandboxes in memory, as a runtime keeps its state, so that the edge's
// own code (admission, records, recovery, teardown, counts) can be run
// without root, mounts or processes. It takes layer images
// (sandbox.LayerImages), so the edge mounts nothing for it either.
//
// A sandbox's "processes" are simulated: Exec checks the sandbox runs and
// answers an exit code without starting anything. It is for tests of the
// edge and for load tests of the control plane, never for serving
// sandboxes.
package fake

import (
	"context"
	"fmt"
	"os"
	"slices"
	"sync"

	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/sandbox"
)

// Backend is the fake backend. Its zero value is not usable: use New.
type Backend struct {
	name string

	mu        sync.Mutex
	sandboxes map[string]*Sandbox
	failNext  error
}

// Sandbox is what the backend holds of one sandbox.
type Sandbox struct {
	Config  sandbox.Config
	Running bool
}

// New returns an empty backend that calls itself name (the API's backend
// name it stands in for, e.g. "container").
func New(name string) *Backend {
	return &Backend{name: name, sandboxes: map[string]*Sandbox{}}
}

var (
	_ sandbox.Backend     = (*Backend)(nil)
	_ sandbox.LayerImages = (*Backend)(nil)
)

// Name implements sandbox.Backend.
func (b *Backend) Name() string { return b.name }

// TakesLayerImages implements sandbox.LayerImages.
func (b *Backend) TakesLayerImages() bool { return true }

// Create implements sandbox.Backend. The layer images must exist and the
// writable layer's directory too, as a backend that used them would need.
func (b *Backend) Create(ctx context.Context, cfg sandbox.Config) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if err := b.failNext; err != nil {
		b.failNext = nil
		return err
	}
	if _, ok := b.sandboxes[cfg.ID]; ok {
		return errdefs.AlreadyExists("sandbox %s exists", cfg.ID)
	}
	if len(cfg.Images) == 0 || cfg.Rootfs != "" || cfg.RootfsMount != nil {
		return errdefs.Invalid("sandbox %s: the fake backend takes layer images, not a rootfs", cfg.ID)
	}
	for _, p := range append(slices.Clone(cfg.Images), cfg.Upper) {
		if _, err := os.Stat(p); err != nil {
			return fmt.Errorf("sandbox %s: %w", cfg.ID, err)
		}
	}
	b.sandboxes[cfg.ID] = &Sandbox{Config: cfg, Running: true}
	return nil
}

// Exec implements sandbox.Backend: nothing runs; the "process" exits 0
// at once with no output.
func (b *Backend) Exec(ctx context.Context, id string, p sandbox.Process) (sandbox.Proc, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	s, ok := b.sandboxes[id]
	if !ok || !s.Running {
		return nil, errdefs.NotFound("sandbox %s is not running", id)
	}
	if len(p.Args) == 0 {
		return nil, errdefs.Invalid("no command")
	}
	return done{}, nil
}

type done struct{}

func (done) Wait() (int, error) { return 0, nil }
func (done) Kill() error        { return nil }
func (done) Pid() int           { return 0 }

// Destroy implements sandbox.Backend.
func (b *Backend) Destroy(ctx context.Context, id string) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	delete(b.sandboxes, id)
	return nil
}

// Status implements sandbox.Backend.
func (b *Backend) Status(ctx context.Context, id string) (sandbox.Status, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	s, ok := b.sandboxes[id]
	if !ok {
		return sandbox.Status{}, errdefs.NotFound("no runtime state for %s", id)
	}
	return sandbox.Status{Running: s.Running}, nil
}

// List implements sandbox.Backend.
func (b *Backend) List(ctx context.Context) ([]string, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	ids := make([]string, 0, len(b.sandboxes))
	for id := range b.sandboxes {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	return ids, nil
}

// Get returns a copy of what the backend holds of id.
func (b *Backend) Get(id string) (Sandbox, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	s, ok := b.sandboxes[id]
	if !ok {
		return Sandbox{}, false
	}
	return *s, true
}

// Stop makes id's sandbox stop running, as a sandbox whose init died (its
// state stays until Destroy).
func (b *Backend) Stop(id string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if s, ok := b.sandboxes[id]; ok {
		s.Running = false
	}
}

// Adopt records a sandbox the backend knows nothing of the edge about (an
// orphan a crashed edge left in the runtime).
func (b *Backend) Adopt(id string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.sandboxes[id] = &Sandbox{Config: sandbox.Config{ID: id}, Running: true}
}

// FailNextCreate makes the next Create fail with err.
func (b *Backend) FailNextCreate(err error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.failNext = err
}
