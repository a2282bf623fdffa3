// Package iam owns who may do what: principals (API keys), the project tree,
// project quotas as configured limits, permission checks and the audit log
// of management actions. It keeps its state in a store.Store and serves the
// hot questions (Authenticate, scope checks) from memory. The apiserver and
// `dsec up` import it; the edge never does (it trusts the apiserver).
//
// Scope rule: a principal acts on its own project and every project below it.
//
// Delegation rules: a principal grants only roles it holds; a key never
// outlives the key that created it; a principal changes or deletes only
// projects strictly below its own (no one raises its own quota), and the
// root project is never changed or deleted.
//
// Quota rules: a zero field sets no limit of its own. A project's effective
// limit is, per field, the smallest non-zero limit on its path to the root.
// Setting a quota (create or update) must fit the parent's effective limit,
// but siblings may together be given more than the parent (overcommit, as
// with cgroups): the apiserver's check at sandbox create counts usage
// against every ancestor. Lowering a quota below what its subprojects were
// given, or below what its subtree uses now, is allowed: it stops new
// sandboxes being created there and leaves running ones alone.
package iam

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
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
	bucketAudit    = "iam_audit"    // time-ordered key → JSON auditRecord
)

// maxDepth bounds the project tree: the deepest project is maxDepth levels
// below the root, so a lineage (a project and its ancestors, root included)
// has at most maxDepth+1 entries. It keeps the ancestor walk (done on every
// scoped check) short, and stops it if the store ever held a cycle.
const maxDepth = 64

// Principal is the identity behind one API key.
type Principal struct {
	ID        string     `json:"id"`
	Name      string     `json:"name,omitempty"`
	Project   string     `json:"project"`
	Role      Role       `json:"role"`
	CreatedAt time.Time  `json:"created_at"`
	ExpiresAt *time.Time `json:"expires_at,omitempty"` // nil: never
}

// Quota is a project's configured limits. A zero field sets no limit of its
// own: the project is bound by its nearest ancestor that sets one.
type Quota struct {
	Sandboxes int     `json:"sandboxes"`
	CPU       float64 `json:"cpu"`
	MemoryMB  int64   `json:"memory_mb"`
	DiskMB    int64   `json:"disk_mb"`
}

// Project is a node of the project tree. Its ID is its name: names are unique
// across the whole tree, so an ID alone addresses a project in the API. A
// project's parent never changes.
type Project struct {
	ID     string `json:"id"`
	Parent string `json:"parent,omitempty"` // empty only for RootProject
	Name   string `json:"name"`
	Quota  Quota  `json:"quota"`
	// DedicatedNodes asks placement to keep the project's sandboxes on
	// nodes reserved for it; IAM only records it.
	DedicatedNodes bool      `json:"dedicated_nodes,omitempty"`
	CreatedAt      time.Time `json:"created_at"`
}

// IAM answers authentication and authorization questions and manages keys,
// projects and the audit log. It is safe for concurrent use.
//
// Reads are served from memory in one of two ways. With a store that can
// be watched (etcd) and Watch called, both buckets are mirrored and every
// lookup reads the mirror, falling back to one store read for what it does
// not hold yet (written a moment ago on another apiserver). Otherwise
// projects are read from the store (the local bbolt file) and keys are
// cached for at most cacheTTL.
type IAM struct {
	st  store.Store
	now func() time.Time

	// mu guards what follows. It is never held across a store call: a
	// store may run watch callbacks, which take mu, under its own lock.
	mu sync.RWMutex
	// The mirror (see Watch): used while both buckets are synced.
	watching               bool
	projSynced, keysSynced bool
	tree                   *tree
	keys                   map[digest]Principal
	// cache serves keys while there is no mirror; it holds only keys
	// that existed when read.
	cache map[digest]cacheEntry
	// gen counts changes to the mirror and evictions from the cache. A
	// store read or write notes it first and puts its result in memory
	// only if it is unchanged, so that a result overtaken by a deletion
	// (a revocation) is never put back.
	gen uint64
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
	return &IAM{st: st, now: time.Now, cache: make(map[digest]cacheEntry)}, nil
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
	return m.inScope(p, project)
}

// GetProject returns project id, if p may read it.
func (m *IAM) GetProject(p Principal, id string) (Project, error) {
	if err := m.AuthorizeIn(p, ProjectRead, id); err != nil {
		return Project{}, err
	}
	return m.project(id)
}

// Lineage returns project id followed by its ancestors, the root last. The
// caller authorizes (the apiserver checks quota along it).
func (m *IAM) Lineage(id string) ([]Project, error) {
	return m.lineage(id)
}

// Path returns the lineage of project id from the root, "/"-separated
// ("root/team-a/job-7").
func (m *IAM) Path(id string) (string, error) {
	lineage, err := m.lineage(id)
	if err != nil {
		return "", err
	}
	ids := make([]string, len(lineage))
	for i, proj := range lineage {
		ids[len(lineage)-1-i] = proj.ID
	}
	return strings.Join(ids, "/"), nil
}

// inScope checks the scope rule for p and project without building the
// lineage: it stops at p's project. It walks at most maxDepth+1 projects.
func (m *IAM) inScope(p Principal, project string) error {
	if project == "" {
		return errdefs.Invalid("empty project ID")
	}
	id := project
	for depth := 0; depth <= maxDepth; depth++ {
		proj, err := m.project(id)
		if err != nil {
			if depth > 0 && errors.Is(err, errdefs.ErrNotFound) {
				return fmt.Errorf("project %q: ancestor %q missing (corrupt store?)", project, id)
			}
			return err
		}
		if id == p.Project {
			return nil
		}
		if proj.Parent == "" {
			return errdefs.PermissionDenied("project %q is outside the scope of project %q", project, p.Project)
		}
		id = proj.Parent
	}
	return fmt.Errorf("project %q: ancestry deeper than %d (corrupt store?)", project, maxDepth)
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

// below returns the lineage of project if it is strictly below p's project:
// the rule for changing and deleting a project.
func (m *IAM) below(p Principal, project string) ([]Project, error) {
	lineage, err := m.scoped(p, project)
	if err != nil {
		return nil, err
	}
	if project == p.Project {
		return nil, errdefs.PermissionDenied("project %q is the caller's own project: only an admin of a project above it may change or delete it", project)
	}
	return lineage, nil
}

// lineage returns project followed by its ancestors up to the root.
func (m *IAM) lineage(project string) ([]Project, error) {
	return walkLineage(project, m.project)
}

// walkLineage returns project followed by its ancestors, reading each with
// get. It fails, rather than loops or answers wrongly, on a corrupt store:
// a cycle or a chain longer than maxDepth, a missing ancestor, or a chain
// that ends elsewhere than at the root.
func walkLineage(project string, get func(id string) (Project, error)) ([]Project, error) {
	if project == "" {
		return nil, errdefs.Invalid("empty project ID")
	}
	out := make([]Project, 0, 8)
	for id := project; id != ""; {
		if len(out) > maxDepth {
			return nil, fmt.Errorf("project %q: ancestry deeper than %d (corrupt store?)", project, maxDepth)
		}
		proj, err := get(id)
		if err != nil {
			if len(out) > 0 && errors.Is(err, errdefs.ErrNotFound) {
				return nil, fmt.Errorf("project %q: ancestor %q missing (corrupt store?)", project, id)
			}
			return nil, err
		}
		out = append(out, proj)
		id = proj.Parent
	}
	if top := out[len(out)-1].ID; top != RootProject {
		return nil, fmt.Errorf("project %q: ancestry ends at %q, not at the root (corrupt store?)", project, top)
	}
	return out, nil
}

// project returns project id from the mirror, or from the store when the
// mirror is off or does not hold it yet.
func (m *IAM) project(id string) (Project, error) {
	m.mu.RLock()
	if m.mirrored() {
		proj, ok := m.tree.byID[id]
		gen := m.gen
		m.mu.RUnlock()
		if ok {
			return proj, nil
		}
		proj, err := m.readProject(id)
		if err != nil {
			return Project{}, err
		}
		m.learnProject(proj, gen)
		return proj, nil
	}
	m.mu.RUnlock()
	return m.readProject(id)
}

// readProject reads project id from the store.
func (m *IAM) readProject(id string) (Project, error) {
	if id == "" {
		return Project{}, errdefs.Invalid("empty project ID")
	}
	val, err := m.st.Get(bucketProjects, id)
	if errors.Is(err, errdefs.ErrNotFound) {
		return Project{}, errdefs.NotFound("project %q not found", id)
	}
	if err != nil {
		return Project{}, fmt.Errorf("reading project %s: %w", id, err)
	}
	return decodeProject(id, val)
}

func decodeProject(key string, val []byte) (Project, error) {
	var proj Project
	if err := json.Unmarshal(val, &proj); err != nil {
		return Project{}, fmt.Errorf("decoding project %s: %w", key, err)
	}
	if proj.ID != key {
		return Project{}, fmt.Errorf("decoding project %s: it names itself %q (corrupt store?)", key, proj.ID)
	}
	return proj, nil
}

// storeTree indexes every project in the store. Like the mirror, it leaves
// out records that do not decode: reading one fails, and one must not make
// every listing fail.
func (m *IAM) storeTree() (*tree, error) {
	kvs, err := m.st.List(bucketProjects, "")
	if err != nil {
		return nil, fmt.Errorf("listing projects: %w", err)
	}
	projects := make([]Project, 0, len(kvs))
	for _, kv := range kvs {
		if proj, err := decodeProject(kv.Key, kv.Value); err == nil {
			projects = append(projects, proj)
		}
	}
	return treeOf(projects), nil
}

// withTree runs fn over the mirror's tree, under the read lock, while the
// mirror is synced, and otherwise over a tree built from a listing of the
// store (without a mirror the store is the local bbolt file: cheap).
//
// Preconditions: fn does not call the store or take m.mu.
func (m *IAM) withTree(fn func(*tree)) error {
	m.mu.RLock()
	if m.mirrored() {
		defer m.mu.RUnlock()
		fn(m.tree)
		return nil
	}
	m.mu.RUnlock()
	t, err := m.storeTree()
	if err != nil {
		return err
	}
	fn(t)
	return nil
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

// sortedByID sorts principals by ID.
func sortedByID(ps []Principal) []Principal {
	slices.SortFunc(ps, func(a, b Principal) int { return strings.Compare(a.ID, b.ID) })
	return ps
}
