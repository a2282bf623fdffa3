package iam

import (
	"fmt"
	"slices"
	"strings"
	"testing"
)

func TestPageAfter(t *testing.T) {
	ids := []string{"a", "b", "c", "d", "e"}
	tests := []struct {
		after    string
		limit    int
		want     string
		wantNext string
	}{
		{"", 2, "a,b", "b"},
		{"b", 2, "c,d", "d"},
		{"d", 2, "e", ""},
		{"e", 2, "", ""},
		{"", 5, "a,b,c,d,e", ""},
		{"", 4, "a,b,c,d", "d"},
		{"bb", 2, "c,d", "d"}, // after need not exist
		{"0", 1, "a", "a"},
		{"z", 3, "", ""},
	}
	for _, tc := range tests {
		page, next := pageAfter(ids, tc.after, tc.limit)
		if got := strings.Join(page, ","); got != tc.want || next != tc.wantNext {
			t.Errorf("pageAfter(after %q, limit %d) = %q, next %q; want %q, next %q", tc.after, tc.limit, got, next, tc.want, tc.wantNext)
		}
	}
	if page, next := pageAfter(nil, "", 10); len(page) != 0 || next != "" {
		t.Errorf("pageAfter(nil) = %v, %q", page, next)
	}
}

func TestTreeIndex(t *testing.T) {
	tr := treeOf([]Project{
		{ID: "a", Parent: RootProject}, {ID: "a1", Parent: "a"}, {ID: "a2", Parent: "a"},
		{ID: "b", Parent: RootProject}, {ID: RootProject},
	})
	tr.put(Project{ID: "a0", Parent: "a"}) // out of order: inserted in place
	if got := strings.Join(tr.children["a"], ","); got != "a0,a1,a2" {
		t.Errorf("children(a) = %s", got)
	}
	if got := strings.Join(tr.ids, ","); got != "a,a0,a1,a2,b,root" {
		t.Errorf("ids = %s", got)
	}
	tr.put(Project{ID: "a1", Parent: "a", Quota: Quota{CPU: 1}}) // replace
	if len(tr.children["a"]) != 3 || tr.byID["a1"].Quota.CPU != 1 {
		t.Errorf("replace changed the index: %v", tr.children["a"])
	}
	tr.put(Project{ID: "a2", Parent: "b"}) // moved by hand in the store
	if got := strings.Join(tr.children["b"], ","); got != "a2" || slices.Contains(tr.children["a"], "a2") {
		t.Errorf("moved project: children(b) = %s, children(a) = %v", got, tr.children["a"])
	}
	tr.del("a0")
	tr.del("nope")
	if got := strings.Join(tr.subtree(RootProject), ","); got != "a,a1,a2,b,root" {
		t.Errorf("subtree(root) = %s", got)
	}
	if !tr.within("a1", "a") || !tr.within("a1", RootProject) || tr.within("a1", "b") || !tr.within("a", "a") || tr.within("nope", RootProject) {
		t.Error("within answers wrongly")
	}
	if d := tr.depthsBelow("a"); len(d) != 2 || d["a"] != 0 || d["a1"] != 1 {
		t.Errorf("depthsBelow(a) = %v", d)
	}
	ids, next := tr.pageWithin(RootProject, "a", 2)
	if strings.Join(ids, ",") != "a1,a2" || next != "a2" {
		t.Errorf("pageWithin(root, after a, 2) = %v, %q", ids, next)
	}
	ids, next = tr.pageWithin(RootProject, "a2", 2)
	if strings.Join(ids, ",") != "b,root" || next != "" {
		t.Errorf("pageWithin(root, after a2, 2) = %v, %q", ids, next)
	}
}

// TestTreeCorrupt: every walk over a tree holding cycles ends.
func TestTreeCorrupt(t *testing.T) {
	tr := treeOf([]Project{
		{ID: RootProject},
		{ID: "x", Parent: "y"}, {ID: "y", Parent: "x"}, // a cycle off the tree
		{ID: "self", Parent: "self"},
		{ID: "kid", Parent: "x"},
	})
	if tr.within("kid", RootProject) || tr.within("self", RootProject) || !tr.within("kid", "y") {
		t.Error("within through a cycle")
	}
	if got := strings.Join(tr.subtree("x"), ","); got != "kid,x,y" {
		t.Errorf("subtree(x) = %s", got)
	}
	if got := strings.Join(tr.subtree("self"), ","); got != "self" {
		t.Errorf("subtree(self) = %s", got)
	}
	ids, _ := tr.pageWithin(RootProject, "", 100)
	if strings.Join(ids, ",") != RootProject {
		t.Errorf("pageWithin(root) listed projects off the tree: %v", ids)
	}
	if got := tr.orphansOf(map[string]int{"gone": 0}); len(got) != 0 {
		t.Errorf("orphansOf through a cycle = %v", got)
	}
}

func TestOrphansOf(t *testing.T) {
	// "a" (depth 1 below the deleted "top") was deleted; b under a and c
	// under b were created meanwhile; d sits elsewhere.
	tr := treeOf([]Project{
		{ID: RootProject}, {ID: "b", Parent: "a"}, {ID: "c", Parent: "b"}, {ID: "d", Parent: RootProject},
		{ID: "lost", Parent: "unrelated"},
	})
	got := tr.orphansOf(map[string]int{"top": 0, "a": 1})
	if fmt.Sprint(got) != "map[b:2 c:3]" {
		t.Errorf("orphansOf = %v, want b at 2, c at 3", got)
	}
	if order := deepestFirst(map[string]int{"a": 1, "b": 2, "c": 3, "top": 0, "a2": 1}); strings.Join(order, ",") != "c,b,a,a2,top" {
		t.Errorf("deepestFirst = %v", order)
	}
}
