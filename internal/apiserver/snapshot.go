package apiserver

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/iam"
	"github.com/dsecproject/dsec/internal/sandbox"
)

// maxFork bounds one fork call.
const maxFork = 1000

func principalID(r *http.Request) string {
	if p, ok := r.Context().Value(principalKey{}).(iam.Principal); ok {
		return p.ID
	}
	return ""
}

func (s *Server) snapshot(w http.ResponseWriter, r *http.Request) {
	var req api.SnapshotRequest
	if err := decode(r, &req); err != nil {
		s.writeError(w, r, err)
		return
	}
	if req.Ref == "" {
		s.writeError(w, r, errdefs.Invalid("ref is required (snapshot/NAME:TAG)"))
		return
	}
	s.forward(w, r, http.StatusCreated, func(e edgeapi.Edge, id string) (any, error) {
		return s.takeSnapshot(r.Context(), e, id, edgeapi.SnapshotOptions{Request: req, Principal: principalID(r), Project: s.callerProject(r.Context())})
	})
}

// takeSnapshot has e snapshot sandbox id and returns the layer,
// published. With Deps.PublishSnapshots the edge only stages the image
// and this apiserver publishes it (layer.Store.Adopt): from the edge it
// takes what the image is (its digest and size, checked against its
// bytes, and what the snapshot records of the sandbox), never the name,
// owner or author, which it knows itself.
func (s *Server) takeSnapshot(ctx context.Context, e edgeapi.Edge, id string, o edgeapi.SnapshotOptions) (*api.Layer, error) {
	o.Stage = s.deps.PublishSnapshots
	res, err := e.Snapshot(ctx, id, o)
	switch {
	case err != nil:
		return nil, err
	case res.Staged == nil && !o.Stage:
		// dsec up's edge, this process, published it.
		if res.Snapshot == nil {
			return nil, fmt.Errorf("the node of sandbox %s answered a snapshot without its record", id)
		}
		return &res.Layer, nil
	case res.Staged == nil:
		// An edge of an earlier version published it itself: what
		// counts is what the catalog says, not its answer.
		l, err := s.deps.Layers.Resolve(o.Request.Ref)
		if err != nil || l.Snapshot == nil || l.Snapshot.Sandbox != id {
			return nil, fmt.Errorf("the node of sandbox %s answered snapshot %s published, and the catalog does not have it so (%v)", id, o.Request.Ref, err)
		}
		return &l, nil
	case !o.Stage:
		return nil, fmt.Errorf("the node of sandbox %s staged a snapshot it was asked to publish", id)
	case res.Snapshot == nil:
		return nil, fmt.Errorf("the node of sandbox %s staged a snapshot without its record", id)
	}
	l := res.Layer
	info := *l.Snapshot
	info.Sandbox, info.CreatedBy = id, o.Principal
	info.Include, info.Exclude = o.Request.Include, o.Request.Exclude
	l.Snapshot, l.Ref, l.Project, l.CreatedAt = &info, o.Request.Ref, o.Project, time.Now().UTC()
	l.Image, l.Remote, l.Lowers, l.LowersBytes = nil, nil, nil, 0
	pl, err := s.deps.Layers.Adopt(ctx, *res.Staged, l)
	if err != nil {
		return nil, err
	}
	return &pl, nil
}

// fork snapshots a sandbox's current state and starts count sandboxes from
// it, with the source's spec (labels merged with the request's).
func (s *Server) fork(w http.ResponseWriter, r *http.Request) {
	var req api.ForkRequest
	if err := decode(r, &req); err != nil {
		s.writeError(w, r, err)
		return
	}
	if req.Count < 1 || req.Count > maxFork {
		s.writeError(w, r, errdefs.Invalid("count must be between 1 and %d, got %d", maxFork, req.Count))
		return
	}
	if err := sandbox.ValidateCallerLabels(req.Labels); err != nil {
		s.writeError(w, r, err)
		return
	}
	id := r.PathValue("id")
	e, err := s.edgeOf(r.Context(), id)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	// The fork's snapshot is an ordinary catalogued layer: forks keep it in
	// use, and it can be forked from again or deleted once unused.
	ref := fmt.Sprintf("snapshot/fork-%s:%d", strings.ToLower(strings.TrimPrefix(id, "sb-")), time.Now().UnixNano())
	l, err := s.takeSnapshot(r.Context(), e, id, edgeapi.SnapshotOptions{Request: api.SnapshotRequest{Ref: ref}, Principal: principalID(r), Project: s.callerProject(r.Context())})
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	spec := l.Snapshot.Spec
	spec.Snapshot = l.Ref
	// Not dsec's own labels: the source's dsec.idempotency names the
	// attempt that made the source, and a retry of that attempt would
	// take the forks for what it made.
	labels := sandbox.WithoutReservedLabels(spec.Labels)
	for k, v := range req.Labels {
		labels[k] = v
	}
	spec.Labels = labels
	st, err := s.prepare(r.Context(), &spec)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, s.createMany(r, req.Count, spec, st))
}

// createMany places count sandboxes of one prepared spec, a few at a time,
// and reports each outcome (partial success allowed).
func (s *Server) createMany(r *http.Request, count int, spec api.SandboxSpec, st layerStack) api.BatchResult {
	res := api.BatchResult{Sandboxes: []api.Sandbox{}, Errors: []api.BatchError{}}
	if ic := idemFrom(r.Context()); ic != nil {
		spec.Labels = withLabel(spec.Labels, IdempotencyLabel, ic.label)
		if ic.takeover {
			// What the first attempt made counts; only the rest is made.
			made, err := s.madeBefore(r.Context(), ic.label, spec.Project)
			if err != nil {
				for i := range count {
					res.Errors = append(res.Errors, api.BatchError{Index: i, Error: api.ErrorDetail{Code: errdefs.Code(err), Message: err.Error()}})
				}
				return res
			}
			made = made[:min(len(made), count)]
			res.Sandboxes = append(res.Sandboxes, made...)
			count -= len(made)
		}
	}
	made := make([]*api.Sandbox, count)
	errs := make([]error, count)
	var wg sync.WaitGroup
	sem := make(chan struct{}, batchConcurrency)
	for i := range count {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			made[i], errs[i] = s.place(r.Context(), spec, st)
		}()
	}
	wg.Wait()
	base := len(res.Sandboxes)
	for i := range count {
		if errs[i] != nil {
			res.Errors = append(res.Errors, api.BatchError{Index: base + i, Error: api.ErrorDetail{Code: errdefs.Code(errs[i]), Message: errs[i].Error()}})
			continue
		}
		res.Sandboxes = append(res.Sandboxes, *made[i])
	}
	return res
}
