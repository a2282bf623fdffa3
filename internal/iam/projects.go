package iam

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// Page sizes of ListProjects.
const (
	defaultPageSize = 100
	maxPageSize     = 1000
)

// maxDeleteRounds bounds DeleteProject's sweeps for projects created below
// the deleted ones while it ran.
const maxDeleteRounds = 8

// CreateProject creates a subproject of parent. p must be an admin over
// parent, the new project may be at most maxDepth levels below the root,
// and quota must fit within what parent's lineage allows (see the package
// comment). Names are unique across the whole tree.
func (m *IAM) CreateProject(p Principal, parent, name string, quota Quota, dedicated bool) (Project, error) {
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
	// lineage holds parent and its ancestors: the new project is
	// len(lineage) levels below the root.
	if len(lineage) > maxDepth {
		return Project{}, errdefs.Invalid("project %q is %d levels below the root; projects nest at most %d levels", parent, len(lineage)-1, maxDepth)
	}
	if err := quota.fits(effectiveQuota(lineage)); err != nil {
		return Project{}, err
	}
	proj := Project{ID: name, Parent: parent, Name: name, Quota: quota, DedicatedNodes: dedicated, CreatedAt: m.now().UTC()}
	val, err := json.Marshal(proj)
	if err != nil {
		return Project{}, err
	}
	gen := m.generation()
	if err := m.st.Create(bucketProjects, proj.ID, val); err != nil {
		if errors.Is(err, errdefs.ErrAlreadyExists) {
			return Project{}, errdefs.AlreadyExists("project %q already exists", name)
		}
		return Project{}, fmt.Errorf("storing project %s: %w", name, err)
	}
	// DeleteProject on another apiserver may have removed parent between
	// the check above and the write. It lists the store again after
	// deleting and removes what it finds below; this read, after the
	// write, sees the deletion in the case that listing may have missed.
	if _, err := m.readProject(parent); err != nil {
		if derr := m.st.Delete(bucketProjects, proj.ID); derr != nil {
			return Project{}, fmt.Errorf("withdrawing project %s: %w (after: %w)", name, derr, err)
		}
		return Project{}, err
	}
	m.learnProject(proj, gen)
	return proj, nil
}

// UpdateProject changes the quota and the dedicated-nodes flag of project
// id, each if not nil, and returns the project as stored. p must be an
// admin of a project strictly above id: no principal changes its own
// project (it would raise its own quota), and the root is never changed.
//
// The quota must fit the parent's effective limits. It may be lower than
// what subprojects were given or what the subtree uses: the effective
// limit is the minimum along the path, so new sandboxes are refused and
// running ones are left alone. The write is a compare-and-set on the
// stored project (store Update), so two apiservers changing the same
// project at once never lose either change.
func (m *IAM) UpdateProject(p Principal, id string, quota *Quota, dedicated *bool) (Project, error) {
	if quota != nil {
		if err := quota.validate(); err != nil {
			return Project{}, err
		}
	}
	if err := authorize(p, ProjectAdmin); err != nil {
		return Project{}, err
	}
	if id == RootProject {
		return Project{}, errdefs.Invalid("the root project cannot be changed: it is not bound by a quota; set quotas on the projects below it")
	}
	lineage, err := m.below(p, id)
	if err != nil {
		return Project{}, err
	}
	if quota != nil {
		if err := quota.fits(effectiveQuota(lineage[1:])); err != nil {
			return Project{}, err
		}
	}
	if quota == nil && dedicated == nil {
		return lineage[0], nil
	}
	var out Project
	gen := m.generation()
	err = m.st.Update(bucketProjects, id, func(old []byte) ([]byte, error) {
		if old == nil {
			return nil, errdefs.NotFound("project %q not found", id)
		}
		proj, err := decodeProject(id, old)
		if err != nil {
			return nil, err
		}
		if quota != nil {
			proj.Quota = *quota
		}
		if dedicated != nil {
			proj.DedicatedNodes = *dedicated
		}
		out = proj
		return json.Marshal(proj)
	})
	if errors.Is(err, errdefs.ErrNotFound) {
		return Project{}, err
	}
	if err != nil {
		return Project{}, fmt.Errorf("updating project %s: %w", id, err)
	}
	m.learnProject(out, gen)
	return out, nil
}

// DeleteProject deletes project id and every key of it, and returns the IDs
// of the projects deleted, deepest first. p must be an admin of a project
// strictly above id; the root is never deleted. A project with subprojects
// is refused (errdefs.ErrPrecondition) unless cascade, which deletes the
// whole subtree with all its keys. The caller makes sure no sandbox is
// left in what it deletes.
//
// The plan is made from a listing of the store, not the mirror, so that a
// subproject or key created a moment ago on another apiserver is not
// missed. For each round, keys go first, then projects from the deepest
// up, so that a failure half-way leaves a tree without orphans and no key
// of a deleted project (such a key would be valid again for a project
// created later under the same name). Projects and keys created below the
// deleted ones while this runs are swept too (CreateProject and CreateKey
// withdraw their own write if they see the deletion): the result may then
// name projects the caller did not see. On error, it returns what it
// deleted so far.
func (m *IAM) DeleteProject(p Principal, id string, cascade bool) ([]string, error) {
	if err := authorize(p, ProjectAdmin); err != nil {
		return nil, err
	}
	if id == RootProject {
		return nil, errdefs.Invalid("the root project cannot be deleted")
	}
	if _, err := m.below(p, id); err != nil {
		return nil, err
	}
	t, err := m.storeTree()
	if err != nil {
		return nil, err
	}
	if _, ok := t.byID[id]; !ok {
		return nil, errdefs.NotFound("project %q not found", id)
	}
	plan := t.depthsBelow(id) // project ID → levels below id
	if len(plan) > 1 && !cascade {
		kids := t.children[id]
		return nil, errdefs.Precondition("project %q has %d subprojects (%s): delete them first, or delete with cascade", id, len(plan)-1, listSome(kids, 3))
	}
	gone := map[string]int{} // planned for deletion, by depth
	done := map[string]int{} // deleted
	for round := 0; len(plan) > 0; round++ {
		if round == maxDeleteRounds {
			return deepestFirst(done), errdefs.Precondition("projects keep being created below %q while it is deleted; delete it again", id)
		}
		for pid, depth := range plan {
			gone[pid] = depth
		}
		if err := m.deleteKeysOf(gone); err != nil {
			return deepestFirst(done), err
		}
		for _, pid := range deepestFirst(plan) {
			gen := m.generation()
			if err := m.st.Delete(bucketProjects, pid); err != nil {
				return deepestFirst(done), fmt.Errorf("deleting project %s: %w", pid, err)
			}
			m.forgetProject(pid, gen)
			done[pid] = plan[pid]
		}
		if t, err = m.storeTree(); err != nil {
			return deepestFirst(done), err
		}
		plan = t.orphansOf(gone)
	}
	// Keys created in a deleted project while it was being deleted.
	if err := m.deleteKeysOf(gone); err != nil {
		return deepestFirst(done), err
	}
	return deepestFirst(done), nil
}

// orphansOf returns the projects whose parent chain reaches a project of
// gone that no longer exists, with their depth below the deleted project
// (gone holds depths too).
func (t *tree) orphansOf(gone map[string]int) map[string]int {
	out := map[string]int{}
	for id, proj := range t.byID {
		anc := proj.Parent
		for steps := 1; steps <= maxDepth+1 && anc != ""; steps++ {
			if parent, ok := t.byID[anc]; ok {
				anc = parent.Parent
				continue
			}
			if depth, ok := gone[anc]; ok {
				out[id] = depth + steps
			}
			break
		}
	}
	return out
}

// deepestFirst returns the IDs of depths ordered by depth, deepest first,
// then by ID.
func deepestFirst(depths map[string]int) []string {
	ids := make([]string, 0, len(depths))
	for id := range depths {
		ids = append(ids, id)
	}
	slices.SortFunc(ids, func(a, b string) int {
		if depths[a] != depths[b] {
			return depths[b] - depths[a]
		}
		return strings.Compare(a, b)
	})
	return ids
}

// listSome names up to n of ids, for an error message.
func listSome(ids []string, n int) string {
	if len(ids) <= n {
		return strings.Join(ids, ", ")
	}
	return strings.Join(ids[:n], ", ") + ", …"
}

// ListProjects returns one page of projects in ID order: with parent empty,
// every project in p's scope (its own and all below); otherwise the direct
// children of parent, which must be in p's scope. A page holds the projects
// after after (the last ID of the previous page), at most limit of them (0:
// 100; at most 1000); next is the last ID of the page when more follow,
// and empty at the end.
//
// With the mirror a page costs about limit steps (a binary search into
// sorted indexes), whatever the number of projects, except for a scope
// other than the root with parent empty, which collects the scope's
// subtree. Without a mirror each call lists the store.
func (m *IAM) ListProjects(p Principal, parent, after string, limit int) ([]Project, string, error) {
	switch {
	case limit < 0:
		return nil, "", errdefs.Invalid("page size %d: want 0 (default %d) to %d", limit, defaultPageSize, maxPageSize)
	case limit == 0:
		limit = defaultPageSize
	case limit > maxPageSize:
		limit = maxPageSize
	}
	scope := parent
	if scope == "" {
		scope = p.Project
	}
	if err := m.AuthorizeIn(p, ProjectRead, scope); err != nil {
		return nil, "", err
	}
	var out []Project
	var next string
	err := m.withTree(func(t *tree) {
		var ids []string
		switch {
		case parent != "":
			ids, next = pageAfter(t.children[parent], after, limit)
		case p.Project == RootProject:
			ids, next = t.pageWithin(RootProject, after, limit)
		default:
			ids, next = pageAfter(t.subtree(p.Project), after, limit)
		}
		out = t.projects(ids)
	})
	if err != nil {
		return nil, "", err
	}
	return out, next, nil
}

// Children returns every direct subproject of id in ID order, if p may read
// id.
func (m *IAM) Children(p Principal, id string) ([]Project, error) {
	if err := m.AuthorizeIn(p, ProjectRead, id); err != nil {
		return nil, err
	}
	var out []Project
	err := m.withTree(func(t *tree) { out = t.projects(t.children[id]) })
	return out, err
}

// SubtreeIDs returns id and the IDs of every project below it, in ID order
// (the set a project's usage is summed over). The caller authorizes.
func (m *IAM) SubtreeIDs(id string) ([]string, error) {
	if _, err := m.project(id); err != nil {
		return nil, err
	}
	var out []string
	err := m.withTree(func(t *tree) { out = t.subtree(id) })
	return out, err
}
