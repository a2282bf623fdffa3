package apiserver

import (
	"net/http"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edge"
	"github.com/dsecproject/dsec/internal/placement"
)

// fncall runs a short stateless job in a fresh sandbox on some node and
// answers with its result; the sandbox is gone afterwards.
func (s *Server) fncall(w http.ResponseWriter, r *http.Request) {
	var req api.FnCallRequest
	if err := decode(r, &req); err != nil {
		s.writeError(w, r, err)
		return
	}
	if err := edge.CheckFnCall(&req); err != nil {
		s.writeError(w, r, err)
		return
	}
	spec := api.SandboxSpec{Base: req.Base, MemoryMB: req.MemoryMB, Labels: map[string]string{"dsec.fncall": "true"}}
	digests, err := s.prepare(&spec)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	node, err := placement.Pick(s.placementNodes(), placement.Request{Backend: spec.Backend}, nil)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	res, err := s.edges[node].FnCall(r.Context(), req, edge.CreateRequest{Spec: spec, Digests: digests})
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, res)
}
