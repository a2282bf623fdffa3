package apiserver

// Projects, keys, whoami and audit: the IAM management API. Rules (who
// may create, grant, update or delete what) are package iam's; this file
// maps them to HTTP, adds what only the apiserver knows (live usage from
// the edges, the sandboxes a deleted project still has) and records every
// management action in the audit log.

import (
	"context"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/iam"
)

// principal is the caller of an authenticated route.
func principal(ctx context.Context) iam.Principal {
	p, _ := ctx.Value(principalKey{}).(iam.Principal)
	return p
}

// pathOf returns the path of project id in the tree ("root/a/b").
// Projects never move, so a path once read is cached; a deleted project's
// stays until the process ends (its keys are revoked, and a sandbox still
// naming it keeps its place in the tree).
func (s *Server) pathOf(id string) (string, error) {
	if id == "" || id == iam.RootProject {
		return edgeapi.RootPath, nil
	}
	if v, ok := s.paths.Load(id); ok {
		return v.(string), nil
	}
	p, err := s.deps.IAM.Path(id)
	if err != nil {
		return "", err
	}
	s.paths.Store(id, p)
	return p, nil
}

// pathCache is the type of Server.paths.
type pathCache = sync.Map

// sandboxProject settles the project a new sandbox belongs to: the
// caller's own unless the spec names one the caller may create in (its
// project or one below). It returns the project's path. A project outside
// the caller's scope is not found, as its sandboxes are.
func (s *Server) sandboxProject(ctx context.Context, spec *api.SandboxSpec) (string, error) {
	p := principal(ctx)
	if spec.Project == "" {
		spec.Project = p.Project
	}
	if spec.Project == "" {
		spec.Project = iam.RootProject
	}
	if p.ID != "" && spec.Project != p.Project {
		if err := s.deps.IAM.AuthorizeIn(p, iam.SandboxCreate, spec.Project); err != nil {
			if errdefs.Code(err) == "permission_denied" || errdefs.Code(err) == "not_found" {
				return "", errdefs.NotFound("project %q not found", spec.Project)
			}
			return "", err
		}
	}
	return s.pathOf(spec.Project)
}

// usageByPath sums what the nodes report their live sandboxes hold, by
// project path (each project's own, not its descendants').
func (s *Server) usageByPath() map[string]api.ProjectUsage {
	out := map[string]api.ProjectUsage{}
	for _, v := range s.deps.Nodes.Snapshot() {
		for path, u := range v.Projects {
			t := out[path]
			t.Add(u)
			out[path] = t
		}
	}
	return out
}

// usageBelow is the usage of the project at path and all below it.
func usageBelow(byPath map[string]api.ProjectUsage, path string) api.ProjectUsage {
	var u api.ProjectUsage
	for p, pu := range byPath {
		if edgeapi.PathIn(p, path) {
			u.Add(pu)
		}
	}
	return u
}

// projectView is the API's view of proj, with its children and usage.
func (s *Server) projectView(p iam.Principal, proj iam.Project, byPath map[string]api.ProjectUsage) (api.Project, error) {
	path, err := s.pathOf(proj.ID)
	if err != nil {
		return api.Project{}, err
	}
	kids, err := s.deps.IAM.Children(p, proj.ID)
	if err != nil {
		return api.Project{}, err
	}
	children := make([]string, 0, len(kids))
	for _, k := range kids {
		children = append(children, k.ID)
	}
	return api.Project{
		ID: proj.ID, Name: proj.Name, Parent: proj.Parent, Path: path,
		Quota:          api.ProjectQuota(proj.Quota),
		Usage:          usageBelow(byPath, path),
		Children:       children,
		DedicatedNodes: proj.DedicatedNodes,
		CreatedAt:      proj.CreatedAt,
	}, nil
}

// audit records a management action of the caller of r. A failure to
// record is logged, not returned: the action is done.
func (s *Server) audit(r *http.Request, action, target, detail string) {
	p := principal(r.Context())
	e := iam.AuditEntry{Time: time.Now().UTC(), Principal: p.ID, Project: p.Project, Action: action, Target: target, Detail: detail}
	if err := s.deps.IAM.Audit(e); err != nil {
		s.log.Warn("recording an audit entry", "action", action, "target", target, "err", err)
	}
	s.log.Info("management action", "principal", p.ID, "project", p.Project, "action", action, "target", target, "detail", detail)
}

func (s *Server) createProject(w http.ResponseWriter, r *http.Request) {
	var req api.CreateProjectRequest
	if err := decode(r, &req); err != nil {
		s.writeError(w, r, err)
		return
	}
	p := principal(r.Context())
	parent := req.Parent
	if parent == "" {
		parent = p.Project
	}
	proj, err := s.deps.IAM.CreateProject(p, parent, req.Name, iam.Quota(req.Quota), req.DedicatedNodes)
	if err != nil {
		s.writeError(w, r, hideScope(err, parent))
		return
	}
	s.audit(r, "project.create", proj.ID, "parent="+proj.Parent+" "+quotaString(proj.Quota))
	v, err := s.projectView(p, proj, s.usageByPath())
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusCreated, v)
}

func quotaString(q iam.Quota) string {
	return "sandboxes=" + strconv.Itoa(q.Sandboxes) + " cpu=" + strconv.FormatFloat(q.CPU, 'g', -1, 64) +
		" memory_mb=" + strconv.FormatInt(q.MemoryMB, 10) + " disk_mb=" + strconv.FormatInt(q.DiskMB, 10)
}

func (s *Server) getProject(w http.ResponseWriter, r *http.Request) {
	p := principal(r.Context())
	proj, err := s.deps.IAM.GetProject(p, r.PathValue("id"))
	if err != nil {
		s.writeError(w, r, hideScope(err, r.PathValue("id")))
		return
	}
	v, err := s.projectView(p, proj, s.usageByPath())
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, v)
}

// hideScope turns "outside your scope" into "not found", so that a
// project's existence is no more visible than its sandboxes'.
func hideScope(err error, id string) error {
	if errdefs.Code(err) == "permission_denied" && strings.Contains(err.Error(), "scope") {
		return errdefs.NotFound("project %q not found", id)
	}
	return err
}

func (s *Server) listProjects(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	limit, err := pageLimit(r)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	p := principal(r.Context())
	projs, next, err := s.deps.IAM.ListProjects(p, q.Get("parent"), q.Get("page_token"), limit)
	if err != nil {
		s.writeError(w, r, hideScope(err, q.Get("parent")))
		return
	}
	byPath := s.usageByPath()
	out := api.ProjectList{Projects: make([]api.Project, 0, len(projs)), NextPageToken: next}
	for _, proj := range projs {
		v, err := s.projectView(p, proj, byPath)
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		out.Projects = append(out.Projects, v)
	}
	writeJSON(w, http.StatusOK, out)
}

func (s *Server) updateProject(w http.ResponseWriter, r *http.Request) {
	var req api.UpdateProjectRequest
	if err := decode(r, &req); err != nil {
		s.writeError(w, r, err)
		return
	}
	if req.Quota == nil && req.DedicatedNodes == nil {
		s.writeError(w, r, errdefs.Invalid("nothing to change: give quota or dedicated_nodes"))
		return
	}
	p := principal(r.Context())
	id := r.PathValue("id")
	var quota *iam.Quota
	if req.Quota != nil {
		q := iam.Quota(*req.Quota)
		quota = &q
	}
	proj, err := s.deps.IAM.UpdateProject(p, id, quota, req.DedicatedNodes)
	if err != nil {
		s.writeError(w, r, hideScope(err, id))
		return
	}
	detail := quotaString(proj.Quota) + " dedicated_nodes=" + strconv.FormatBool(proj.DedicatedNodes)
	s.audit(r, "project.update", id, detail)
	v, err := s.projectView(p, proj, s.usageByPath())
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, v)
}

// deleteProject deletes a project, refused while it (or, with cascade,
// its subtree) has sandboxes unless cascade, which deletes them first.
func (s *Server) deleteProject(w http.ResponseWriter, r *http.Request) {
	p := principal(r.Context())
	id := r.PathValue("id")
	cascade := r.URL.Query().Get("cascade") == "true"
	proj, err := s.deps.IAM.GetProject(p, id)
	if err != nil {
		s.writeError(w, r, hideScope(err, id))
		return
	}
	// What DeleteProject would refuse is refused before any sandbox goes.
	if proj.ID == iam.RootProject || proj.ID == p.Project {
		s.writeError(w, r, errdefs.PermissionDenied("project %s can be deleted only by an admin of a project above it", id))
		return
	}
	if err := s.deps.IAM.AuthorizeIn(p, iam.ProjectAdmin, proj.ID); err != nil {
		s.writeError(w, r, err)
		return
	}
	path, err := s.pathOf(proj.ID)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	// The sandboxes of the project and below, on every node: every node
	// must answer, or some may be left behind with no project.
	ctx := edgeapi.WithScope(r.Context(), path)
	var mu sync.Mutex
	var ids []string
	skipped, err := s.fanOut(ctx, func(ctx context.Context, e edgeapi.Edge) error {
		l, err := e.List(ctx, edgeapi.ListFilter{})
		mu.Lock()
		for _, sb := range l {
			if holdsResources(sb.State) || sb.State == api.StateStopped || sb.State == api.StateFailed {
				ids = append(ids, sb.ID)
			}
		}
		mu.Unlock()
		return err
	})
	if err == nil && len(skipped) > 0 {
		err = errdefs.Unavailable("cannot tell whether project %s has sandboxes: node %s does not answer; retry later", id, strings.Join(skipped, ", "))
	}
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	if len(ids) > 0 && !cascade {
		s.writeError(w, r, errdefs.Precondition("project %s (or a project below it) has %d sandboxes; delete them first or use ?cascade=true", id, len(ids)))
		return
	}
	if cascade {
		if _, _, _, err := s.deleteAll(ctx, ids); err != nil {
			s.writeError(w, r, err)
			return
		}
	}
	gone, err := s.deps.IAM.DeleteProject(p, id, cascade)
	if err != nil {
		s.writeError(w, r, hideScope(err, id))
		return
	}
	s.audit(r, "project.delete", id, "projects="+strings.Join(gone, ",")+" sandboxes="+strconv.Itoa(len(ids)))
	w.WriteHeader(http.StatusNoContent)
}

// holdsResources reports whether a sandbox in state counts against its
// node's and its project's limits.
func holdsResources(state string) bool {
	return state == api.StateCreating || state == api.StateRunning || state == api.StatePaused
}

// deleteAll deletes the sandboxes ids, a few at a time, and returns how
// many went, how many failed and the first error.
func (s *Server) deleteAll(ctx context.Context, ids []string) (deleted, failed int, skipped []string, err error) {
	var mu sync.Mutex
	sem := make(chan struct{}, fanOutParallel)
	var wg sync.WaitGroup
	for _, id := range ids {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			e, derr := s.edgeOf(ctx, id)
			if derr == nil {
				derr = e.Delete(ctx, id)
			}
			mu.Lock()
			defer mu.Unlock()
			if derr != nil {
				failed++
				if err == nil {
					err = derr
				}
				return
			}
			deleted++
		}()
	}
	wg.Wait()
	return deleted, failed, nil, err
}

func keyView(k iam.Principal) api.APIKey {
	return api.APIKey{ID: k.ID, Name: k.Name, Project: k.Project, Role: string(k.Role), CreatedAt: k.CreatedAt, ExpiresAt: k.ExpiresAt}
}

func (s *Server) createKey(w http.ResponseWriter, r *http.Request) {
	var req api.CreateKeyRequest
	if err := decode(r, &req); err != nil {
		s.writeError(w, r, err)
		return
	}
	if req.ExpiresIn < 0 || req.ExpiresIn > 10*365*24*3600 {
		s.writeError(w, r, errdefs.Invalid("expires_in must be between 0 (never) and 315360000 seconds, got %d", req.ExpiresIn))
		return
	}
	role, err := iam.ParseRole(req.Role)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	p := principal(r.Context())
	project := r.PathValue("id")
	key, k, err := s.deps.IAM.CreateKey(p, project, role, req.Name, time.Duration(req.ExpiresIn)*time.Second)
	if err != nil {
		s.writeError(w, r, hideScope(err, project))
		return
	}
	s.audit(r, "key.create", k.ID, "project="+project+" role="+string(k.Role)+" name="+k.Name)
	v := keyView(k)
	v.Key = key
	w.Header().Set("Cache-Control", "no-store")
	writeJSON(w, http.StatusCreated, v)
}

func (s *Server) listKeys(w http.ResponseWriter, r *http.Request) {
	project := r.PathValue("id")
	keys, err := s.deps.IAM.ListKeys(principal(r.Context()), project)
	if err != nil {
		s.writeError(w, r, hideScope(err, project))
		return
	}
	out := api.KeyList{Keys: make([]api.APIKey, 0, len(keys))}
	for _, k := range keys {
		out.Keys = append(out.Keys, keyView(k))
	}
	writeJSON(w, http.StatusOK, out)
}

func (s *Server) revokeKey(w http.ResponseWriter, r *http.Request) {
	project, id := r.PathValue("id"), r.PathValue("key_id")
	if err := s.deps.IAM.RevokeKey(principal(r.Context()), project, id); err != nil {
		s.writeError(w, r, hideScope(err, project))
		return
	}
	s.audit(r, "key.revoke", id, "project="+project)
	w.WriteHeader(http.StatusNoContent)
}

// pageLimit is the ?limit= of a paged list of projects or audit entries:
// 1 to 1000, 0 when absent (the default page).
func pageLimit(r *http.Request) (int, error) {
	v := r.URL.Query().Get("limit")
	if v == "" {
		return 0, nil
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 || n > 1000 {
		return 0, errdefs.Invalid("limit must be between 1 and 1000, got %q", v)
	}
	return n, nil
}

func (s *Server) whoami(w http.ResponseWriter, r *http.Request) {
	p := principal(r.Context())
	writeJSON(w, http.StatusOK, api.WhoAmI{Principal: p.ID, Project: p.Project, Role: string(p.Role), Permissions: iam.Permissions(p.Role)})
}

func (s *Server) listAudit(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	var since time.Time
	if v := q.Get("since"); v != "" {
		t, err := time.Parse(time.RFC3339, v)
		if err != nil {
			s.writeError(w, r, errdefs.Invalid("since must be an RFC 3339 time, got %q", v))
			return
		}
		since = t
	}
	limit, err := pageLimit(r)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	entries, err := s.deps.IAM.ListAudit(principal(r.Context()), since, limit)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	out := api.AuditList{Entries: make([]api.AuditEntry, 0, len(entries))}
	for _, e := range entries {
		out.Entries = append(out.Entries, api.AuditEntry(e))
	}
	writeJSON(w, http.StatusOK, out)
}
