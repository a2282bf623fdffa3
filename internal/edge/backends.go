package edge

import (
	"context"

	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/sandbox"
)

// A node may offer several backends (Deps.Backend, Deps.Others); each
// sandbox runs on the one its spec names, recorded in its record. The edge
// asks the sandbox's backend what it can do (the optional interfaces of
// package sandbox), never another's.

// backend returns the backend named name ("" is the default's), or nil
// if the node has none of that name.
func (e *Edge) backend(name string) sandbox.Backend {
	if e.deps.Backend == nil {
		return nil
	}
	if name == "" || name == e.deps.Backend.Name() {
		return e.deps.Backend
	}
	for _, b := range e.deps.Others {
		if b.Name() == name {
			return b
		}
	}
	return nil
}

// backends returns every backend of the node, the default first.
func (e *Edge) backends() []sandbox.Backend {
	if e.deps.Backend == nil {
		return nil
	}
	return append([]sandbox.Backend{e.deps.Backend}, e.deps.Others...)
}

// backendOf returns the backend that runs sandbox s (for a record naming
// one this node no longer has, a stand-in whose calls fail as for a
// sandbox the runtime does not know).
//
// Preconditions: s.mu is not held (backendFor(&s.rec) is for callers
// holding it).
func (e *Edge) backendOf(s *sbx) sandbox.Backend {
	s.mu.Lock()
	name := s.rec.Sandbox.Backend
	s.mu.Unlock()
	if b := e.backend(name); b != nil {
		return b
	}
	return missingBackend{name}
}

// backendByID is backendOf for a sandbox known by id only (the default
// backend for one the edge does not list).
func (e *Edge) backendByID(id string) sandbox.Backend {
	e.mu.RLock()
	s := e.sandboxes[id]
	e.mu.RUnlock()
	if s == nil {
		if b := e.backend(""); b != nil {
			return b
		}
		return missingBackend{"default"}
	}
	return e.backendOf(s)
}

// backendFor is backendOf for a record (one read from disk, or s.rec
// with s.mu held).
func (e *Edge) backendFor(rec *record) sandbox.Backend {
	if b := e.backend(rec.Sandbox.Backend); b != nil {
		return b
	}
	return missingBackend{rec.Sandbox.Backend}
}

// missingBackend stands for a backend a record names and the node no
// longer offers (the edge restarted without it): the sandbox is not
// running as far as the node can tell.
type missingBackend struct{ name string }

func (m missingBackend) err(id string) error {
	return errdefs.NotFound("sandbox %s runs on the %s backend, which this node no longer offers", id, m.name)
}

func (m missingBackend) Name() string { return m.name }
func (m missingBackend) Create(ctx context.Context, cfg sandbox.Config) error {
	return m.err(cfg.ID)
}
func (m missingBackend) Exec(ctx context.Context, id string, p sandbox.Process) (sandbox.Proc, error) {
	return nil, m.err(id)
}
func (m missingBackend) Destroy(ctx context.Context, id string) error { return nil }
func (m missingBackend) Status(ctx context.Context, id string) (sandbox.Status, error) {
	return sandbox.Status{}, m.err(id)
}
func (m missingBackend) List(ctx context.Context) ([]string, error) { return nil, nil }
