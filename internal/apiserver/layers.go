package apiserver

import (
	"context"
	"errors"
	"io"
	"net/http"
	"strings"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/iam"
	"github.com/dsecproject/dsec/internal/image"
	"github.com/dsecproject/dsec/internal/layer"
	"github.com/dsecproject/dsec/internal/layer/remote"
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
	l, err := s.deps.Layers.BuildFromTar(r.Context(), ref, r.Body, layer.BuildOptions{Replace: replace, MaxBytes: s.deps.MaxLayerBytes,
		Project: s.callerProject(r.Context()), MayReplace: s.mayReplace(r.Context())}, nil)
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
	all, err := s.deps.Layers.List(kind)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	ls := []api.Layer{}
	for _, l := range all {
		if s.layerVisible(r.Context(), l) {
			ls = append(ls, l)
		}
	}
	writeJSON(w, http.StatusOK, api.LayerList{Layers: ls})
}

func (s *Server) getLayer(w http.ResponseWriter, r *http.Request) {
	l, err := s.resolveFor(r.Context(), r.PathValue("ref"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, l)
}

func (s *Server) deleteLayer(w http.ResponseWriter, r *http.Request) {
	l, err := s.resolveFor(r.Context(), r.PathValue("ref"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	if err := s.mayReplace(r.Context())(l); err != nil {
		s.writeError(w, r, err)
		return
	}
	if err := s.deps.Layers.Delete(r.PathValue("ref"), func(d string) (bool, error) { return s.inUse(r.Context(), d) }); err != nil {
		s.writeError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// gcLayers removes the layer blobs no ref names and no sandbox uses. The
// blob directory is every project's: only root's keys collect it.
func (s *Server) gcLayers(w http.ResponseWriter, r *http.Request) {
	if s.callerProject(r.Context()) != iam.RootProject {
		s.writeError(w, r, errdefs.PermissionDenied("collecting layer blobs concerns every project's layers: it takes a key of the root project"))
		return
	}
	dry, err := boolQuery(r, "dry_run")
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	inUse := func(d string) (bool, error) { return s.inUse(r.Context(), d) }
	gc := s.deps.Layers.GC
	if dry {
		gc = s.deps.Layers.Unused
	}
	removed, n, err := gc(inUse)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	if removed == nil {
		removed = []string{}
	}
	writeJSON(w, http.StatusOK, api.LayerGCResult{Removed: removed, RemovedBytes: n, DryRun: dry})
}

// copyBuffer copies with a 256 KiB buffer (files are often large).
func copyBuffer(w io.Writer, r io.Reader) (int64, error) {
	return io.CopyBuffer(w, r, make([]byte, 256<<10))
}

// Layers belong to the project of the key that published them. A key sees
// the layers of its project, of the projects above it (the images it
// inherits: root's are everyone's) and of the projects below it; it may
// re-point or delete only those of its project and below. Refs are one
// namespace for the whole tree: a ref another tenant holds is taken.

// callerProject is the project of the caller of ctx (root without one).
func (s *Server) callerProject(ctx context.Context) string {
	if p := principal(ctx).Project; p != "" {
		return p
	}
	return iam.RootProject
}

// ownerPath is the path of project, the owner of a layer or template
// alias. A project deleted since is placed right below the root, where
// only root's keys see it.
func (s *Server) ownerPath(project string) string {
	p, err := s.pathOf(project)
	if err != nil {
		return edgeapi.RootPath + "/" + project
	}
	return p
}

// visibleTo reports whether the caller of ctx may see what project owns
// (its project, those above it and those below it).
func (s *Server) visibleTo(ctx context.Context, project string) bool {
	caller, err := s.pathOf(s.callerProject(ctx))
	if err != nil {
		return false
	}
	op := s.ownerPath(project)
	return edgeapi.PathIn(caller, op) || edgeapi.PathIn(op, caller)
}

// mayChange refuses to re-point or delete what belongs to a project
// outside the caller's (what is named what, for the message).
func (s *Server) mayChange(ctx context.Context, project, what string) error {
	caller, err := s.pathOf(s.callerProject(ctx))
	if err != nil {
		return err
	}
	if op := s.ownerPath(project); !edgeapi.PathIn(op, caller) {
		return errdefs.PermissionDenied("%s belongs to project %s, which is not yours or below yours", what, strings.TrimPrefix(op, edgeapi.RootPath+"/"))
	}
	return nil
}

// layerVisible reports whether the caller of ctx may see l.
func (s *Server) layerVisible(ctx context.Context, l api.Layer) bool {
	return s.visibleTo(ctx, l.Project)
}

// mayReplace refuses to re-point or delete a layer of a project outside
// the caller's.
func (s *Server) mayReplace(ctx context.Context) func(api.Layer) error {
	return func(l api.Layer) error {
		return s.mayChange(ctx, l.Project, "layer "+l.Ref)
	}
}

// pushLayer stores a layer the caller can see in an OCI registry. A push
// sends the layer's content out of dsec, so it needs layer write, not
// just read; whether the registry takes it is the registry's business.
func (s *Server) pushLayer(w http.ResponseWriter, r *http.Request) {
	var req api.LayerPushRequest
	if err := decode(r, &req); err != nil {
		s.writeError(w, r, err)
		return
	}
	if req.Ref == "" || req.Target == "" {
		s.writeError(w, r, errdefs.Invalid("ref and target (oci://HOST/REPO:TAG) are required"))
		return
	}
	l, err := s.resolveFor(r.Context(), req.Ref)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	if len(l.Lowers) > 0 {
		s.writeError(w, r, errdefs.Precondition("layer %s sits on %d lower layers (an image merged into runs with merge_under); an artifact holds one image: import the image without merge_under to push it",
			l.Ref, len(l.Lowers)))
		return
	}
	res, err := remote.Push(r.Context(), s.deps.Layers, l.Ref, req.Target, remote.PushOptions{Insecure: req.Insecure, ChunkSize: req.ChunkSize,
		Repo: image.RepoOptions{Username: req.Username, Password: req.Password}})
	if err != nil {
		s.writeError(w, r, registryRefusal(err))
		return
	}
	s.log.Info("layer pushed", "ref", l.Ref, "target", req.Target, "manifest", res.Manifest, "uploaded", res.Uploaded)
	writeJSON(w, http.StatusOK, res)
}

// addLayer registers a registry-backed layer in the catalog.
func (s *Server) addLayer(w http.ResponseWriter, r *http.Request) {
	var req api.LayerAddRequest
	if err := decode(r, &req); err != nil {
		s.writeError(w, r, err)
		return
	}
	if req.Ref == "" || req.Source == "" {
		s.writeError(w, r, errdefs.Invalid("ref and source (oci://HOST/REPO:TAG) are required"))
		return
	}
	l, err := remote.Add(r.Context(), s.deps.Layers, req.Ref, req.Source, remote.AddOptions{
		Insecure: req.Insecure, Pull: req.Pull, Replace: req.Replace,
		MayReplace: s.mayReplace(r.Context()), Project: s.callerProject(r.Context()),
		Repo: image.RepoOptions{Username: req.Username, Password: req.Password},
	})
	if err != nil {
		s.writeError(w, r, registryRefusal(err))
		return
	}
	writeJSON(w, http.StatusCreated, l)
}

// registryRefusal makes a registry's refusal of its own credentials a
// bad request: it is not about the caller's dsec key (never 401/403).
func registryRefusal(err error) error {
	if errors.Is(err, errdefs.ErrUnauthenticated) || errors.Is(err, errdefs.ErrPermissionDenied) {
		return errdefs.Invalid("registry refused access: %v", err)
	}
	return err
}
