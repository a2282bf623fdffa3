package apiserver

import (
	"context"
	"fmt"
	"net/http"
	"sort"
	"strings"
	"sync/atomic"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/sandbox"
)

func (s *Server) pause(w http.ResponseWriter, r *http.Request) {
	s.forward(w, r, http.StatusOK, func(e edgeapi.Edge, id string) (any, error) {
		return e.Pause(r.Context(), id)
	})
}

func (s *Server) resume(w http.ResponseWriter, r *http.Request) {
	s.forward(w, r, http.StatusOK, func(e edgeapi.Edge, id string) (any, error) {
		return e.Resume(r.Context(), id)
	})
}

func (s *Server) pauseByLabels(w http.ResponseWriter, r *http.Request) {
	s.byLabels(w, r, edgeapi.Edge.PauseByLabels, func(n int, skipped []string) any { return api.CountResult{Count: n, UnreachableNodes: skipped} })
}

func (s *Server) resumeByLabels(w http.ResponseWriter, r *http.Request) {
	s.byLabels(w, r, edgeapi.Edge.ResumeByLabels, func(n int, skipped []string) any { return api.CountResult{Count: n, UnreachableNodes: skipped} })
}

// byLabels applies a by-labels edge call (delete, pause, resume) on every
// edge at once and answers result(total, nodes it could not reach). A
// whole job is handled this way.
func (s *Server) byLabels(w http.ResponseWriter, r *http.Request, fn func(edgeapi.Edge, context.Context, map[string]string) (int, error), result func(int, []string) any) {
	var req api.LabelsRequest
	if err := decode(r, &req); err != nil {
		s.writeError(w, r, err)
		return
	}
	if len(req.Labels) == 0 {
		s.writeError(w, r, errdefs.Invalid("labels are required (refusing to act on every sandbox)"))
		return
	}
	if err := sandbox.ValidateSelector(req.Labels); err != nil {
		s.writeError(w, r, err)
		return
	}
	var total atomic.Int64
	skipped, err := s.fanOut(r.Context(), func(ctx context.Context, e edgeapi.Edge) error {
		n, err := fn(e, ctx, req.Labels)
		total.Add(int64(n))
		return err
	})
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	s.audit(r, "sandboxes"+strings.TrimPrefix(r.URL.Path, "/v1/sandboxes"), formatLabels(req.Labels),
		fmt.Sprintf("count=%d unreachable=%s", total.Load(), strings.Join(skipped, ",")))
	writeJSON(w, http.StatusOK, result(int(total.Load()), skipped))
}

// formatLabels renders a selector as k=v,k=v in key order.
func formatLabels(l map[string]string) string {
	keys := make([]string, 0, len(l))
	for k := range l {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for i, k := range keys {
		keys[i] = k + "=" + l[k]
	}
	return strings.Join(keys, ",")
}
