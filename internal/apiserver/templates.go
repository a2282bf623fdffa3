package apiserver

// Template aliases (docs/e2b.md "Templates"): names the E2B API's
// templateID may give for a stack of layers and a user. They live in the
// control-plane store, bucket e2bBucket, key templatePrefix+name, one
// JSON api.Template each. Like layer refs, names are one namespace for
// the whole project tree, and an alias belongs to the project of the key
// that made it: it is seen, and re-pointed or removed, as a layer of that
// project would be (layers.go).

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"regexp"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/store"
)

// templatePrefix is the store key prefix of template aliases.
const templatePrefix = "template/"

// templateNameRE is the rule for alias names. A name has no "/", so it
// can never be read as a layer ref (kind/name:tag).
var templateNameRE = regexp.MustCompile(`^[a-z0-9][a-z0-9._-]{0,63}$`)

func checkTemplateName(name string) error {
	if !templateNameRE.MatchString(name) {
		return errdefs.Invalid("template name %q is invalid (1-64 chars of [a-z0-9._-], starting with a letter or digit)", name)
	}
	return nil
}

func (s *Server) templateStore() (store.Store, error) {
	st := s.stateStore()
	if st == nil {
		return nil, errdefs.Precondition("template aliases need a control-plane store")
	}
	return st, nil
}

func (s *Server) createTemplate(w http.ResponseWriter, r *http.Request) {
	var t api.Template
	if err := decode(r, &t); err != nil {
		s.writeError(w, r, err)
		return
	}
	if err := s.checkTemplate(r.Context(), t); err != nil {
		s.writeError(w, r, err)
		return
	}
	st, err := s.templateStore()
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	t.Project, t.CreatedAt = s.callerProject(r.Context()), time.Now().UTC()
	b, err := json.Marshal(t)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	if err := st.Create(e2bBucket, templatePrefix+t.Name, b); err != nil {
		if errors.Is(err, errdefs.ErrAlreadyExists) {
			err = errdefs.AlreadyExists("template %s exists (remove it first: dsec template rm %s)", t.Name, t.Name)
		}
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusCreated, t)
}

// checkTemplate validates an alias as its caller gives it: a valid name,
// and layers and a user a sandbox of the caller could be created from.
func (s *Server) checkTemplate(ctx context.Context, t api.Template) error {
	if err := checkTemplateName(t.Name); err != nil {
		return err
	}
	if t.Base == "" {
		return errdefs.Invalid("base is required (a base layer ref, e.g. base/debian:12)")
	}
	// The checks of a create, on a copy: refs resolve to layers of the
	// right kind that the caller may see, and the user is well formed.
	spec := api.SandboxSpec{Base: t.Base, Workspace: t.Workspace, Toolkits: t.Toolkits, User: t.User, Backend: t.Backend}
	if _, err := s.prepare(ctx, &spec); err != nil {
		return err
	}
	return nil
}

// template reads alias name as the caller of ctx sees it: one it may not
// see is not found.
func (s *Server) template(ctx context.Context, name string) (api.Template, error) {
	var t api.Template
	if checkTemplateName(name) != nil {
		return t, errdefs.NotFound("template %s not found", name)
	}
	st, err := s.templateStore()
	if err != nil {
		return t, err
	}
	b, err := st.Get(e2bBucket, templatePrefix+name)
	if errors.Is(err, errdefs.ErrNotFound) {
		return t, errdefs.NotFound("template %s not found", name)
	}
	if err != nil {
		return t, err
	}
	if err := json.Unmarshal(b, &t); err != nil {
		return t, err
	}
	if !s.visibleTo(ctx, t.Project) {
		return api.Template{}, errdefs.NotFound("template %s not found", name)
	}
	return t, nil
}

func (s *Server) listTemplates(w http.ResponseWriter, r *http.Request) {
	st, err := s.templateStore()
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	kvs, err := st.List(e2bBucket, templatePrefix)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	out := api.TemplateList{Templates: []api.Template{}}
	for _, kv := range kvs {
		var t api.Template
		if err := json.Unmarshal(kv.Value, &t); err != nil {
			s.log.Warn("skipping an unreadable template alias", "key", kv.Key, "err", err)
			continue
		}
		if s.visibleTo(r.Context(), t.Project) {
			out.Templates = append(out.Templates, t)
		}
	}
	writeJSON(w, http.StatusOK, out)
}

func (s *Server) getTemplate(w http.ResponseWriter, r *http.Request) {
	t, err := s.template(r.Context(), r.PathValue("name"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, t)
}

// deleteTemplate removes an alias. Sandboxes made from it keep running:
// they hold their layers, not the alias.
func (s *Server) deleteTemplate(w http.ResponseWriter, r *http.Request) {
	t, err := s.template(r.Context(), r.PathValue("name"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	if err := s.mayChange(r.Context(), t.Project, "template "+t.Name); err != nil {
		s.writeError(w, r, err)
		return
	}
	if err := s.stateStore().Delete(e2bBucket, templatePrefix+t.Name); err != nil {
		s.writeError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}
