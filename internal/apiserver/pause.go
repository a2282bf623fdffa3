package apiserver

import (
	"context"
	"net/http"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/sandbox"
)

func (s *Server) pause(w http.ResponseWriter, r *http.Request) {
	s.forward(w, r, http.StatusOK, func(e EdgeClient, id string) (any, error) {
		return e.Pause(r.Context(), id)
	})
}

func (s *Server) resume(w http.ResponseWriter, r *http.Request) {
	s.forward(w, r, http.StatusOK, func(e EdgeClient, id string) (any, error) {
		return e.Resume(r.Context(), id)
	})
}

func (s *Server) pauseByLabels(w http.ResponseWriter, r *http.Request) {
	s.byLabels(w, r, EdgeClient.PauseByLabels, func(n int) any { return api.CountResult{Count: n} })
}

func (s *Server) resumeByLabels(w http.ResponseWriter, r *http.Request) {
	s.byLabels(w, r, EdgeClient.ResumeByLabels, func(n int) any { return api.CountResult{Count: n} })
}

// byLabels applies a by-labels edge call (delete, pause, resume) on every
// edge and answers result(total). A whole job is handled this way.
func (s *Server) byLabels(w http.ResponseWriter, r *http.Request, fn func(EdgeClient, context.Context, map[string]string) (int, error), result func(int) any) {
	var req api.LabelsRequest
	if err := decode(r, &req); err != nil {
		s.writeError(w, r, err)
		return
	}
	if len(req.Labels) == 0 {
		s.writeError(w, r, errdefs.Invalid("labels are required (refusing to act on every sandbox)"))
		return
	}
	for k, v := range req.Labels {
		if err := sandbox.ValidateLabel(k, v); err != nil {
			s.writeError(w, r, err)
			return
		}
	}
	total := 0
	for _, e := range s.deps.Edges {
		n, err := fn(e, r.Context(), req.Labels)
		total += n
		if err != nil {
			s.writeError(w, r, err)
			return
		}
	}
	writeJSON(w, http.StatusOK, result(total))
}
