package apiserver

import (
	"context"
	"net/http"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/sandbox"
)

// fncall runs a short stateless job in a fresh sandbox on some node and
// answers with its result; the sandbox is gone afterwards.
func (s *Server) fncall(w http.ResponseWriter, r *http.Request) {
	var req api.FnCallRequest
	if err := decode(r, &req); err != nil {
		s.writeError(w, r, err)
		return
	}
	if err := sandbox.CheckFnCall(&req); err != nil {
		s.writeError(w, r, err)
		return
	}
	spec := api.SandboxSpec{Base: req.Base, MemoryMB: req.MemoryMB, Labels: map[string]string{"dsec.fncall": "true"}}
	st, err := s.prepare(r.Context(), &spec)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	path, err := s.pathOf(spec.Project)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	lineage, err := s.deps.IAM.Lineage(spec.Project)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	dedicated, err := s.dedicatedOf(lineage)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	t, err := s.quotas.admit(r.Context(), spec, lineage)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	var res *api.FnCallResult
	err = s.onSomeNode(r.Context(), spec, st.digests, dedicated, "", func(ctx context.Context, e edgeapi.Edge) error {
		var err error
		res, err = e.FnCall(ctx, req, edgeapi.CreateRequest{Spec: spec, Digests: st.digests, Below: st.below, ProjectPath: path, Dedicated: dedicated})
		return err
	})
	// The call's sandbox is gone once it answers.
	settle(t, nil, err)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, res)
}
