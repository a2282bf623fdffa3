// Package iam owns who may do what: principals (API keys), the project tree,
// project quotas as configured limits, and permission checks. It keeps its
// state in a store.Store and caches key lookups in memory. The apiserver and
// `dsec up` import it; the edge never does (it trusts the apiserver).
//
// Scope rule: a principal acts on its own project and every project below it.
// Delegation rule: a principal grants only roles it holds, and a subproject's
// quota never exceeds what its ancestors allow.
package iam

import (
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/store"
)

// RootProject is the ID of the project at the top of the tree. It exists
// from the first start and has no quota.
const RootProject = "root"

// Store buckets.
const (
	bucketProjects = "iam_projects" // project ID → JSON Project
	bucketKeys     = "iam_keys"     // hex SHA-256 of an API key → JSON Principal
)

// maxDepth bounds the project tree. It keeps the ancestor walk (done on every
// scoped check) short, and stops it if the store ever held a cycle.
const maxDepth = 16

// Principal is the identity behind one API key.
type Principal struct {
	ID        string    `json:"id"`
	Project   string    `json:"project"`
	Role      Role      `json:"role"`
	CreatedAt time.Time `json:"created_at"`
}

// Quota is a project's configured limits. A zero field sets no limit of its
// own: the project is bound by its nearest ancestor that sets one.
type Quota struct {
	Sandboxes int     `json:"sandboxes"`
	CPU       float64 `json:"cpu"`
	MemoryMB  int64   `json:"memory_mb"`
}

// Project is a node of the project tree. Its ID is its name: names are unique
// across the whole tree, so an ID alone addresses a project in the API.
type Project struct {
	ID     string `json:"id"`
	Parent string `json:"parent,omitempty"` // empty only for RootProject
	Name   string `json:"name"`
	Quota  Quota  `json:"quota"`
}

// cacheTTL bounds how long a cached key stays valid without a store read.
// Revocation through this IAM evicts at once; the TTL covers a key revoked
// by another apiserver sharing the same etcd.
const cacheTTL = 30 * time.Second

type cacheEntry struct {
	p       Principal
	expires time.Time
}

// IAM answers authentication and authorization questions and manages keys
// and projects. It is safe for concurrent use.
type IAM struct {
	st  store.Store
	now func() time.Time

	mu    sync.RWMutex
	cache map[string]cacheEntry // by key hash; only keys that exist
	gen   uint64                // bumped by every eviction
}

// New returns an IAM over st, creating the root project if it is missing.
func New(st store.Store) (*IAM, error) {
	root, err := json.Marshal(Project{ID: RootProject, Name: RootProject})
	if err != nil {
		return nil, err
	}
	err = st.Create(bucketProjects, RootProject, root)
	if err != nil && !errors.Is(err, errdefs.ErrAlreadyExists) {
		return nil, fmt.Errorf("creating root project: %w", err)
	}
	return &IAM{st: st, now: time.Now, cache: make(map[string]cacheEntry)}, nil
}

// Authorize reports whether p's role permits action, as an
// errdefs.ErrPermissionDenied error if not. It looks at the role only; use
// AuthorizeIn when the action targets a project's resources.
func (m *IAM) Authorize(p Principal, action Action) error {
	return authorize(p, action)
}

// AuthorizeIn is Authorize plus the scope rule: project must be p's own
// project or one below it. A missing project yields errdefs.ErrNotFound.
func (m *IAM) AuthorizeIn(p Principal, action Action, project string) error {
	if err := authorize(p, action); err != nil {
		return err
	}
	_, err := m.scoped(p, project)
	return err
}

// CreateProject creates a subproject of parent. p must be an admin over
// parent, and quota must fit within what parent's lineage allows.
func (m *IAM) CreateProject(p Principal, parent, name string, quota Quota) (Project, error) {
	if err := validName(name); err != nil {
		return Project{}, err
	}
	if err := quota.validate(); err != nil {
		return Project{}, err
	}
	if err := authorize(p, ProjectAdmin); err != nil {
		return Project{}, err
	}
	lineage, err := m.scoped(p, parent)
	if err != nil {
		return Project{}, err
	}
	if len(lineage) >= maxDepth {
		return Project{}, errdefs.Invalid("project %q is %d levels deep; no deeper nesting allowed", parent, len(lineage))
	}
	if err := quota.fits(effectiveQuota(lineage)); err != nil {
		return Project{}, err
	}
	proj := Project{ID: name, Parent: parent, Name: name, Quota: quota}
	val, err := json.Marshal(proj)
	if err != nil {
		return Project{}, err
	}
	if err := m.st.Create(bucketProjects, proj.ID, val); err != nil {
		if errors.Is(err, errdefs.ErrAlreadyExists) {
			return Project{}, errdefs.AlreadyExists("project %q already exists", name)
		}
		return Project{}, fmt.Errorf("storing project %s: %w", name, err)
	}
	return proj, nil
}

// GetProject returns project id, if p may read it.
func (m *IAM) GetProject(p Principal, id string) (Project, error) {
	if err := authorize(p, ProjectRead); err != nil {
		return Project{}, err
	}
	lineage, err := m.scoped(p, id)
	if err != nil {
		return Project{}, err
	}
	return lineage[0], nil
}

// Children returns the direct subprojects of id in ID order, if p may read id.
func (m *IAM) Children(p Principal, id string) ([]Project, error) {
	if err := m.AuthorizeIn(p, ProjectRead, id); err != nil {
		return nil, err
	}
	kvs, err := m.st.List(bucketProjects, "")
	if err != nil {
		return nil, fmt.Errorf("listing projects: %w", err)
	}
	var out []Project
	for _, kv := range kvs {
		var proj Project
		if err := json.Unmarshal(kv.Value, &proj); err != nil {
			return nil, fmt.Errorf("decoding project %s: %w", kv.Key, err)
		}
		if proj.Parent == id {
			out = append(out, proj)
		}
	}
	return out, nil
}

// scoped returns the lineage of project (see lineage) if p's project is in
// it, and an errdefs.ErrPermissionDenied error otherwise.
func (m *IAM) scoped(p Principal, project string) ([]Project, error) {
	lineage, err := m.lineage(project)
	if err != nil {
		return nil, err
	}
	for _, proj := range lineage {
		if proj.ID == p.Project {
			return lineage, nil
		}
	}
	return nil, errdefs.PermissionDenied("project %q is outside the scope of project %q", project, p.Project)
}

// lineage returns project followed by its ancestors up to the root.
func (m *IAM) lineage(project string) ([]Project, error) {
	if project == "" {
		return nil, errdefs.Invalid("empty project ID")
	}
	var out []Project
	for id := project; id != ""; {
		if len(out) >= maxDepth {
			return nil, fmt.Errorf("project %q: ancestry deeper than %d (corrupt store?)", project, maxDepth)
		}
		proj, err := m.project(id)
		if err != nil {
			return nil, err
		}
		out = append(out, proj)
		id = proj.Parent
	}
	return out, nil
}

func (m *IAM) project(id string) (Project, error) {
	val, err := m.st.Get(bucketProjects, id)
	if errors.Is(err, errdefs.ErrNotFound) {
		return Project{}, errdefs.NotFound("project %q not found", id)
	}
	if err != nil {
		return Project{}, fmt.Errorf("reading project %s: %w", id, err)
	}
	var proj Project
	if err := json.Unmarshal(val, &proj); err != nil {
		return Project{}, fmt.Errorf("decoding project %s: %w", id, err)
	}
	return proj, nil
}

// validName accepts DNS-label-like names (lower-case letters, digits and
// inner hyphens, at most 63), which are safe in URL paths, store keys and
// cgroup names.
func validName(name string) error {
	bad := len(name) == 0 || len(name) > 63 || name[0] == '-' || name[len(name)-1] == '-'
	for _, c := range []byte(name) {
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-') {
			bad = true
		}
	}
	if bad {
		return errdefs.Invalid("project name %q: want 1-63 lower-case letters, digits and inner hyphens", name)
	}
	return nil
}
