package edge

import "sync"

// The node's sandboxes by label, so that a listing by label (a job's page;
// a takeover looking for what an attempt made; pause, resume and delete
// by label) looks at the sandboxes that carry it, not at every sandbox of
// the node: with a few thousand per node and a job's page asking each
// node again, the walk was most of a job listing's CPU.
//
// A sandbox is indexed under its labels while it is listed and not
// pooled (a pooled one is invisible, and its labels are set when it is
// claimed); recountLocked, which every such change calls, keeps it so.
// The index only narrows: a listing still matches each sandbox it finds.

// labelIndex maps a label to the sandboxes carrying it. Its lock is taken
// under s.mu and e.mu and nothing is taken under it.
type labelIndex struct {
	mu sync.Mutex
	by map[label]map[string]*sbx // label -> id -> sandbox
}

// label is one key and value.
type label struct{ k, v string }

func newLabelIndex() *labelIndex {
	return &labelIndex{by: map[label]map[string]*sbx{}}
}

// reindexLocked indexes s under its labels if it is listed and not
// pooled, and under none otherwise (s.mu held).
func (e *Edge) reindexLocked(s *sbx) {
	var want map[string]string
	if s.listed && !s.pooled {
		want = s.rec.Sandbox.Labels
	}
	if sameLabels(s.indexed, want) {
		return
	}
	id := s.rec.Sandbox.ID
	ix := e.labels
	ix.mu.Lock()
	defer ix.mu.Unlock()
	for _, l := range s.indexed {
		if set := ix.by[l]; set[id] == s {
			delete(set, id)
			if len(set) == 0 {
				delete(ix.by, l)
			}
		}
	}
	s.indexed = s.indexed[:0]
	for k, v := range want {
		l := label{k, v}
		set := ix.by[l]
		if set == nil {
			set = map[string]*sbx{}
			ix.by[l] = set
		}
		set[id] = s
		s.indexed = append(s.indexed, l)
	}
}

// sameLabels says whether the labels indexed are those of want.
func sameLabels(indexed []label, want map[string]string) bool {
	if len(indexed) != len(want) {
		return false
	}
	for _, l := range indexed {
		if v, ok := want[l.k]; !ok || v != l.v {
			return false
		}
	}
	return true
}

// candidates are the sandboxes that may match sel, with ids after after:
// those carrying sel's least common label. ok is false when sel is empty
// (every sandbox may match).
func (ix *labelIndex) candidates(sel map[string]string, after string) (out []entry, ok bool) {
	if len(sel) == 0 {
		return nil, false
	}
	ix.mu.Lock()
	defer ix.mu.Unlock()
	var least map[string]*sbx
	first := true
	for k, v := range sel {
		set := ix.by[label{k, v}]
		if first || len(set) < len(least) {
			least, first = set, false
		}
	}
	out = make([]entry, 0, len(least))
	for id, s := range least {
		if id > after {
			out = append(out, entry{id, s})
		}
	}
	return out, true
}

// entry is a sandbox of a listing and its id.
type entry struct {
	id string
	s  *sbx
}
