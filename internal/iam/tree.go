package iam

import (
	"slices"
	"sort"
)

// tree indexes the project bucket for the questions that span more than
// one project: children in ID order, subtrees, pages. The mirror keeps one
// current (see Watch); without a mirror one is built from a listing of the
// store when such a question is asked.
//
// Every walk over it is bounded, so that a corrupt store (a cycle, a
// dangling parent) ends a walk instead of looping.
type tree struct {
	byID     map[string]Project
	children map[string][]string // parent ID → child IDs, sorted
	ids      []string            // every project ID, sorted
}

func newTree() *tree {
	return &tree{byID: map[string]Project{}, children: map[string][]string{}}
}

// treeOf indexes projects. Given in ID order (as a store lists them), each
// insertion is an append.
func treeOf(projects []Project) *tree {
	t := newTree()
	for _, proj := range projects {
		t.put(proj)
	}
	return t
}

// put adds or replaces proj.
func (t *tree) put(proj Project) {
	if old, ok := t.byID[proj.ID]; ok {
		if old.Parent != proj.Parent { // never done by this package; a store edited by hand
			t.children[old.Parent] = removeSorted(t.children[old.Parent], proj.ID)
			t.children[proj.Parent] = insertSorted(t.children[proj.Parent], proj.ID)
		}
	} else {
		t.ids = insertSorted(t.ids, proj.ID)
		t.children[proj.Parent] = insertSorted(t.children[proj.Parent], proj.ID)
	}
	t.byID[proj.ID] = proj
}

// del removes project id, if present. Its children stay indexed under it.
func (t *tree) del(id string) {
	old, ok := t.byID[id]
	if !ok {
		return
	}
	delete(t.byID, id)
	t.ids = removeSorted(t.ids, id)
	if kids := removeSorted(t.children[old.Parent], id); len(kids) > 0 {
		t.children[old.Parent] = kids
	} else {
		delete(t.children, old.Parent)
	}
}

// within reports whether project id is scope or below it. It walks at most
// maxDepth+1 projects.
func (t *tree) within(id, scope string) bool {
	for range maxDepth + 1 {
		if id == scope {
			return true
		}
		proj, ok := t.byID[id]
		if !ok || proj.Parent == "" {
			return false
		}
		id = proj.Parent
	}
	return false
}

// subtree returns id and the IDs of every project below it, in ID order.
// The visited set keeps a cycle from looping.
func (t *tree) subtree(id string) []string {
	seen := map[string]bool{id: true}
	out := []string{id}
	for i := 0; i < len(out); i++ {
		for _, kid := range t.children[out[i]] {
			if !seen[kid] {
				seen[kid] = true
				out = append(out, kid)
			}
		}
	}
	slices.Sort(out)
	return out
}

// depthsBelow returns, for id and every project below it, its distance
// from id.
func (t *tree) depthsBelow(id string) map[string]int {
	depth := map[string]int{id: 0}
	queue := []string{id}
	for len(queue) > 0 {
		cur := queue[0]
		queue = queue[1:]
		for _, kid := range t.children[cur] {
			if _, seen := depth[kid]; !seen {
				depth[kid] = depth[cur] + 1
				queue = append(queue, kid)
			}
		}
	}
	return depth
}

// pageWithin returns up to limit IDs after after, in ID order, of the
// projects within scope. It suits a scope that holds most of the tree (the
// root): a page costs about limit walks up the tree.
func (t *tree) pageWithin(scope, after string, limit int) (ids []string, next string) {
	for i := firstAfter(t.ids, after); i < len(t.ids); i++ {
		if !t.within(t.ids[i], scope) {
			continue
		}
		if len(ids) == limit {
			return ids, ids[len(ids)-1]
		}
		ids = append(ids, t.ids[i])
	}
	return ids, ""
}

// projects returns copies of the projects named by ids that exist.
func (t *tree) projects(ids []string) []Project {
	out := make([]Project, 0, len(ids))
	for _, id := range ids {
		if proj, ok := t.byID[id]; ok {
			out = append(out, proj)
		}
	}
	return out
}

// pageAfter returns up to limit IDs of sorted that come after after, and
// the last of them if more follow ("" at the end). The page aliases sorted.
func pageAfter(sorted []string, after string, limit int) (page []string, next string) {
	i := firstAfter(sorted, after)
	if len(sorted)-i <= limit {
		return sorted[i:], ""
	}
	page = sorted[i : i+limit]
	return page, page[len(page)-1]
}

// firstAfter returns the index of the first element of sorted greater than
// after.
func firstAfter(sorted []string, after string) int {
	return sort.Search(len(sorted), func(i int) bool { return sorted[i] > after })
}

func insertSorted(s []string, v string) []string {
	i, found := slices.BinarySearch(s, v)
	if found {
		return s
	}
	return slices.Insert(s, i, v)
}

func removeSorted(s []string, v string) []string {
	i, found := slices.BinarySearch(s, v)
	if !found {
		return s
	}
	return slices.Delete(s, i, i+1)
}
