package edge

import (
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/sandbox"
)

// TestPlacementInfoCachesCounts: placement's counts may be up to
// countsMaxAge old, Info's are exact.
func TestPlacementInfoCachesCounts(t *testing.T) {
	e, err := New(Config{Name: "n1", StateDir: t.TempDir()}, Deps{Backend: namedBackend{}})
	if err != nil {
		t.Fatal(err)
	}
	add := func(id string) {
		s := &sbx{}
		s.rec.Sandbox.ID, s.rec.Sandbox.State = id, api.StateRunning
		e.mu.Lock()
		e.sandboxes[id] = s
		e.mu.Unlock()
	}
	add("a")
	if n := e.PlacementInfo().Counts[api.StateRunning]; n != 1 {
		t.Fatalf("placement counts %d, want 1", n)
	}
	// Pinned fresh, then stale, rather than timed: a stalled test thread
	// must not make the cache look expired.
	setAge := func(age time.Duration) {
		e.countsMu.Lock()
		e.countsAt = time.Now().Add(-age)
		e.countsMu.Unlock()
	}
	add("b")
	setAge(0)
	if n := e.PlacementInfo().Counts[api.StateRunning]; n != 1 {
		t.Errorf("placement counts recomputed within %v: %d", countsMaxAge, n)
	}
	if n := e.Info().Counts[api.StateRunning]; n != 2 {
		t.Errorf("info counts %d, want 2", n)
	}
	setAge(countsMaxAge + time.Millisecond)
	if n := e.PlacementInfo().Counts[api.StateRunning]; n != 2 {
		t.Errorf("placement counts %d after %v, want 2", n, countsMaxAge)
	}
}

// namedBackend answers Name; nothing else is used.
type namedBackend struct{ sandbox.Backend }

func (namedBackend) Name() string { return "container" }
