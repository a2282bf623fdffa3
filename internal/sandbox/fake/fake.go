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
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/sandbox"
)

// Backend is the fake backend. Its zero value is not usable: use New.
type Backend struct {
	name    string
	latency Latency

	mu        sync.Mutex
	sandboxes map[string]*Sandbox
	failNext  error
	// destroying counts destroys under way, maxDestroying the most at once.
	destroying, maxDestroying int
}

// Sandbox is what the backend holds of one sandbox.
type Sandbox struct {
	Config  sandbox.Config
	Running bool
	Paused  bool
	// Execs counts the processes started in it; LastExec is the latest
	// (its streams dropped).
	Execs    int
	LastExec sandbox.Process
}

// Latency is how long each operation takes, as a real runtime's would.
// The zero value takes no time.
type Latency struct {
	Create, Exec, Destroy, Pause, Resume Dist
}

// Dist is a log-normal distribution of durations given by its median and
// its 99th percentile (P99 ≤ Median: always the median). The zero value
// is no time.
type Dist struct {
	Median, P99 time.Duration
}

// z99 is the standard normal's 99th percentile.
const z99 = 2.3263

// Sample draws one duration.
func (d Dist) Sample() time.Duration {
	if d.Median <= 0 {
		return 0
	}
	if d.P99 <= d.Median {
		return d.Median
	}
	sigma := math.Log(float64(d.P99)/float64(d.Median)) / z99
	return time.Duration(float64(d.Median) * math.Exp(sigma*rand.NormFloat64()))
}

// wait takes a sample of d, or less if ctx ends first.
func wait(ctx context.Context, d Dist) error {
	t := d.Sample()
	if t <= 0 {
		return ctx.Err()
	}
	timer := time.NewTimer(t)
	defer timer.Stop()
	select {
	case <-timer.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// New returns an empty backend that calls itself name (the API's backend
// name it stands in for, e.g. "container") and takes no time.
func New(name string) *Backend { return NewWithLatency(name, Latency{}) }

// NewWithLatency is New with operations that take time drawn from l.
func NewWithLatency(name string, l Latency) *Backend {
	return &Backend{name: name, latency: l, sandboxes: map[string]*Sandbox{}}
}

var (
	_ sandbox.Backend     = (*Backend)(nil)
	_ sandbox.LayerImages = (*Backend)(nil)
	_ sandbox.Pauser      = (*Backend)(nil)
)

// Name implements sandbox.Backend.
func (b *Backend) Name() string { return b.name }

// TakesLayerImages implements sandbox.LayerImages.
func (b *Backend) TakesLayerImages() bool { return true }

// Create implements sandbox.Backend. The layer images must exist and the
// writable layer's directory too, as a backend that used them would need.
func (b *Backend) Create(ctx context.Context, cfg sandbox.Config) error {
	if err := wait(ctx, b.latency.Create); err != nil {
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
	if len(p.Args) == 0 {
		return nil, errdefs.Invalid("no command")
	}
	b.mu.Lock()
	s, ok := b.sandboxes[id]
	running := ok && s.Running && !s.Paused
	if running {
		s.Execs++
		s.LastExec = p
		s.LastExec.Stdin, s.LastExec.Stdout, s.LastExec.Stderr = nil, nil, nil
	}
	b.mu.Unlock()
	if !running {
		return nil, errdefs.Precondition("sandbox %s is not running", id)
	}
	return &proc{d: b.latency.Exec.Sample(), done: make(chan struct{})}, nil
}

// proc is a simulated process: it exits 0 after its duration, or 137
// when killed.
type proc struct {
	d    time.Duration
	once sync.Once
	done chan struct{}
	code int
}

func (p *proc) Wait() (int, error) {
	t := time.NewTimer(p.d)
	defer t.Stop()
	select {
	case <-t.C:
		p.once.Do(func() { close(p.done) })
	case <-p.done:
	}
	return p.code, nil
}

func (p *proc) Kill() error {
	p.once.Do(func() { p.code = 137; close(p.done) })
	return nil
}

func (p *proc) Pid() int { return 0 }

// Pause implements sandbox.Pauser.
func (b *Backend) Pause(ctx context.Context, id string) error {
	return b.setPaused(ctx, id, true, b.latency.Pause)
}

// Resume implements sandbox.Pauser.
func (b *Backend) Resume(ctx context.Context, id string) error {
	return b.setPaused(ctx, id, false, b.latency.Resume)
}

func (b *Backend) setPaused(ctx context.Context, id string, paused bool, d Dist) error {
	if err := wait(ctx, d); err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	s, ok := b.sandboxes[id]
	if !ok || !s.Running {
		return errdefs.Precondition("sandbox %s is not running", id)
	}
	s.Paused = paused
	return nil
}

// Destroy implements sandbox.Backend.
func (b *Backend) Destroy(ctx context.Context, id string) error {
	b.mu.Lock()
	_, ok := b.sandboxes[id]
	b.destroying++
	b.maxDestroying = max(b.maxDestroying, b.destroying)
	b.mu.Unlock()
	if ok {
		// Not cut short: a destroy that was asked for happens. (One of
		// a sandbox the runtime does not hold, as a restarted edge asks
		// for every sandbox that died with it, finds nothing at once.)
		_ = wait(context.Background(), b.latency.Destroy)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.destroying--
	delete(b.sandboxes, id)
	return nil
}

// MaxConcurrentDestroys is the most destroys that were under way at once.
func (b *Backend) MaxConcurrentDestroys() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.maxDestroying
}

// Status implements sandbox.Backend.
func (b *Backend) Status(ctx context.Context, id string) (sandbox.Status, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	s, ok := b.sandboxes[id]
	if !ok {
		return sandbox.Status{}, errdefs.NotFound("no runtime state for %s", id)
	}
	return sandbox.Status{Running: s.Running, Paused: s.Running && s.Paused}, nil
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

// Adopt gives the backend a running sandbox the edge knows nothing of (an
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
