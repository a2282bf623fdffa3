package apiserver

import (
	"context"
	"errors"
	"net/http"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/watcher"
)

// Nodes is the apiserver's view of the edges: *watcher.Watcher.
type Nodes interface {
	// Edge returns the edge named name, for routing.
	Edge(ctx context.Context, name string) (edgeapi.Edge, error)
	// Edges returns every known edge, for calls that span nodes.
	Edges() []watcher.Target
	// Snapshot is the polled view of every node, for placement.
	Snapshot() []watcher.View
	// MarkFailed says a call could not reach the node.
	MarkFailed(name string, err error)
}

// edgeOf returns the edge that owns sandbox id: the id names it, so no
// lookup is needed beyond the view's name → edge map.
func (s *Server) edgeOf(ctx context.Context, id string) (edgeapi.Edge, error) {
	node, ok := edgeapi.NodeOf(id)
	if !ok {
		return nil, errdefs.NotFound("sandbox %s not found (malformed id)", id)
	}
	e, err := s.deps.Nodes.Edge(ctx, node)
	if errors.Is(err, errdefs.ErrNotFound) {
		return nil, errdefs.NotFound("sandbox %s not found (unknown node %s)", id, node)
	}
	if err != nil {
		return nil, err
	}
	return e, nil
}

// forward serves a per-sandbox call: it finds the edge that owns the
// sandbox named in the path and writes fn's result as JSON with status, or
// the error. A nil result with no error answers 204.
func (s *Server) forward(w http.ResponseWriter, r *http.Request, status int, fn func(e edgeapi.Edge, id string) (any, error)) {
	id := r.PathValue("id")
	e, err := s.edgeOf(r.Context(), id)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	start := time.Now()
	v, err := fn(e, id)
	s.metrics.forwardSeconds.Observe(time.Since(start).Seconds())
	switch {
	case err != nil:
		s.writeError(w, r, err)
	case v == nil:
		w.WriteHeader(http.StatusNoContent)
	default:
		writeJSON(w, status, v)
	}
}

// fanOutParallel bounds the edges one spanning call talks to at once.
const fanOutParallel = 32

// fanOut calls fn on every known edge, fanOutParallel at a time. Edges the
// view counts as down are not called, and edges that cannot be reached
// now are not an error: both are returned in skipped (sorted), so that
// the caller can say what its answer leaves out. Any other error of fn is
// returned (the first one).
func (s *Server) fanOut(ctx context.Context, fn func(ctx context.Context, e edgeapi.Edge) error) (skipped []string, err error) {
	return s.fanOutTo(ctx, s.deps.Nodes.Edges(), fn)
}

// fanOutTo is fanOut over the edges given.
func (s *Server) fanOutTo(ctx context.Context, targets []watcher.Target, fn func(ctx context.Context, e edgeapi.Edge) error) (skipped []string, err error) {
	var mu sync.Mutex
	var first error
	sem := make(chan struct{}, fanOutParallel)
	var wg sync.WaitGroup
	for _, t := range targets {
		if t.Down {
			skipped = append(skipped, t.Name)
			continue
		}
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			err := fn(ctx, t.Edge)
			if err == nil {
				return
			}
			mu.Lock()
			defer mu.Unlock()
			if edgeapi.IsUnreachable(err) {
				s.deps.Nodes.MarkFailed(t.Name, err)
				skipped = append(skipped, t.Name)
				return
			}
			if first == nil {
				first = err
			}
		}()
	}
	wg.Wait()
	sort.Strings(skipped)
	return skipped, first
}

// inUse reports whether any edge has a sandbox using the layer digest. An
// edge that cannot be asked makes it an error: a layer is deleted only
// when every node has said it does not use it.
func (s *Server) inUse(ctx context.Context, digest string) (bool, error) {
	var mu sync.Mutex
	used := false
	skipped, err := s.fanOut(ctx, func(ctx context.Context, e edgeapi.Edge) error {
		n, err := e.LayerUsers(ctx, digest)
		if n > 0 {
			mu.Lock()
			used = true
			mu.Unlock()
		}
		return err
	})
	if err != nil {
		return false, err
	}
	if used {
		return true, nil
	}
	if len(skipped) > 0 {
		return false, errdefs.Unavailable("cannot tell whether node %s uses layer %s: it does not answer now; retry later", strings.Join(skipped, ", "), digest)
	}
	return false, nil
}

// nodes is GET /v1/nodes: the watcher's view.
func (s *Server) nodes() []api.Node {
	snap := s.deps.Nodes.Snapshot()
	out := make([]api.Node, 0, len(snap))
	for _, v := range snap {
		out = append(out, v.Node)
	}
	return out
}
