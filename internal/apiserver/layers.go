package apiserver

import (
	"io"
	"net/http"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/layer"
)

func (s *Server) buildLayer(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	for _, k := range []string{"kind", "name", "tag"} {
		if q.Get(k) == "" {
			s.writeError(w, r, errdefs.Invalid("query parameter %s is required", k))
			return
		}
	}
	ref, err := layer.ParseRef(q.Get("kind") + "/" + q.Get("name") + ":" + q.Get("tag"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	replace, err := boolQuery(r, "replace")
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	l, err := s.deps.Layers.BuildFromTar(r.Context(), ref, r.Body, layer.BuildOptions{Replace: replace, MaxBytes: s.deps.MaxLayerBytes}, nil)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusCreated, l)
}

func (s *Server) listLayers(w http.ResponseWriter, r *http.Request) {
	kind := r.URL.Query().Get("kind")
	switch kind {
	case "", api.KindBase, api.KindWorkspace, api.KindToolkit, api.KindSnapshot:
	default:
		s.writeError(w, r, badQuery("kind", kind, "want base, workspace, toolkit or snapshot"))
		return
	}
	ls, err := s.deps.Layers.List(kind)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	if ls == nil {
		ls = []api.Layer{}
	}
	writeJSON(w, http.StatusOK, api.LayerList{Layers: ls})
}

func (s *Server) getLayer(w http.ResponseWriter, r *http.Request) {
	l, err := s.resolve(r.PathValue("ref"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, l)
}

func (s *Server) deleteLayer(w http.ResponseWriter, r *http.Request) {
	if err := s.deps.Layers.Delete(r.PathValue("ref"), func(d string) (bool, error) { return s.inUse(r.Context(), d) }); err != nil {
		s.writeError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// copyBuffer copies with a 256 KiB buffer (files are often large).
func copyBuffer(w io.Writer, r io.Reader) (int64, error) {
	return io.CopyBuffer(w, r, make([]byte, 256<<10))
}
