package edge

import (
	"math"
	"sync"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
)

// The node's counts (Info: by state, by backend, by project and by job)
// are kept as sandboxes change instead of being summed over every sandbox
// on every poll: with thousands of sandboxes per node and every apiserver
// polling every node each second, the walk was most of an idle edge's CPU.
//
// Each sandbox remembers the share it last added (sbx.share); every change
// to what a share is made of (listing, state, pooled, the claim of a
// pooled sandbox) calls recountLocked, which moves the sandbox's share
// from the old key to the new one.

// share is what one sandbox adds to the node's counts. The zero share
// adds nothing (a sandbox not in e.sandboxes).
type share struct {
	listed  bool
	pooled  bool
	state   string
	backend string // every sandbox not pooled (as recorded: "" for old records)
	// project, job and the resources: holding ones only.
	project string
	job     string
	// cpu is in millionths of a CPU, so that adding and taking away is
	// exact.
	cpu    int64
	memMB  int64
	diskMB int64
}

// shareLocked is the share s adds now (s.mu held).
func (s *sbx) shareLocked() share {
	if !s.listed {
		return share{}
	}
	if s.pooled {
		return share{listed: true, pooled: true}
	}
	sh := share{listed: true, state: s.rec.Sandbox.State, backend: s.rec.Sandbox.Backend}
	if !holdsResources(sh.state) {
		return sh
	}
	sp := &s.rec.Sandbox.Spec
	sh.project = s.rec.ProjectPath
	if sh.project == "" {
		sh.project = edgeapi.RootPath
	}
	sh.job = s.rec.Sandbox.Labels[api.JobLabel]
	sh.cpu = int64(math.Round(sp.CPU * 1e6))
	sh.memMB, sh.diskMB = sp.MemoryMB, sp.DiskMB
	return sh
}

// recountLocked brings the node's counts and label index in line with s,
// and queues it for the reaper (due.go) (s.mu held).
func (e *Edge) recountLocked(s *sbx) {
	// What moves the counts may move the reaper's next look too.
	e.scheduleLocked(s)
	e.reindexLocked(s)
	want := s.shareLocked()
	if want == s.share {
		return
	}
	e.tally.move(s.share, want)
	s.share = want
}

// listLocked adds s to the node's sandboxes (e.mu held, s.mu not), and
// its share, create token and user-namespace owner with it.
func (e *Edge) listLocked(id string, s *sbx) {
	e.sandboxes[id] = s
	s.mu.Lock()
	if o := s.rec.UserNSOwner; o != 0 {
		e.holdOwnerLocked(o)
	}
	s.listed = true
	e.recountLocked(s)
	e.noteTokenLocked(s)
	s.mu.Unlock()
}

// unlistLocked takes s out of the node's sandboxes (e.mu held, s.mu not),
// and its share, create token and user-namespace owner with it.
func (e *Edge) unlistLocked(id string, s *sbx) {
	if e.sandboxes[id] == s {
		delete(e.sandboxes, id)
	}
	s.mu.Lock()
	if o := s.rec.UserNSOwner; o != 0 && s.listed {
		delete(e.owners, o)
	}
	s.listed = false
	e.recountLocked(s)
	e.forgetTokenLocked(s)
	s.mu.Unlock()
}

// usage is a project's holding sandboxes and their resources.
type usage struct {
	sandboxes          int
	cpu, memMB, diskMB int64
}

// tally holds the node's counts; its lock is taken under s.mu and e.mu
// and nothing is taken under it.
type tally struct {
	mu       sync.Mutex
	states   map[string]int
	backends map[string]int
	// byBackend counts the sandboxes not pooled by backend and state.
	byBackend map[[2]string]int
	projects  map[string]usage
	jobs      map[string]int
}

func newTally() *tally {
	return &tally{states: map[string]int{}, backends: map[string]int{}, byBackend: map[[2]string]int{}, projects: map[string]usage{}, jobs: map[string]int{}}
}

// move takes the old share away and adds the new one.
func (t *tally) move(old, new share) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.add(old, -1)
	t.add(new, 1)
}

func (t *tally) add(sh share, d int) {
	if !sh.listed {
		return
	}
	if sh.pooled {
		bump(t.states, "pooled", d)
		return
	}
	bump(t.states, sh.state, d)
	k := [2]string{sh.backend, sh.state}
	if v := t.byBackend[k] + d; v != 0 {
		t.byBackend[k] = v
	} else {
		delete(t.byBackend, k)
	}
	if !holdsResources(sh.state) {
		return
	}
	bump(t.backends, sh.backend, d)
	if sh.job != "" {
		bump(t.jobs, sh.job, d)
	}
	u := t.projects[sh.project]
	u.sandboxes += d
	u.cpu += int64(d) * sh.cpu
	u.memMB += int64(d) * sh.memMB
	u.diskMB += int64(d) * sh.diskMB
	if u.sandboxes == 0 {
		delete(t.projects, sh.project)
	} else {
		t.projects[sh.project] = u
	}
}

// bump adds d to m[k], dropping keys that reach 0.
func bump(m map[string]int, k string, d int) {
	if v := m[k] + d; v != 0 {
		m[k] = v
	} else {
		delete(m, k)
	}
}

// fill copies the counts into n, in Info's shape: Counts always set, the
// other maps only when they have entries.
func (t *tally) fill(n *api.Node) {
	t.mu.Lock()
	defer t.mu.Unlock()
	n.Counts = make(map[string]int, len(t.states))
	for k, v := range t.states {
		n.Counts[k] = v
	}
	if len(t.backends) > 0 {
		n.BackendCounts = make(map[string]int, len(t.backends))
		for k, v := range t.backends {
			n.BackendCounts[k] = v
		}
	}
	if len(t.projects) > 0 {
		n.Projects = make(map[string]api.ProjectUsage, len(t.projects))
		for k, u := range t.projects {
			n.Projects[k] = api.ProjectUsage{Sandboxes: u.sandboxes, CPU: float64(u.cpu) / 1e6, MemoryMB: u.memMB, DiskMB: u.diskMB}
		}
	}
	if len(t.jobs) > 0 {
		n.Jobs = make(map[string]int, len(t.jobs))
		for k, v := range t.jobs {
			n.Jobs[k] = v
		}
	}
}

// byBackendState copies the counts of sandboxes not pooled by backend
// ("" for records that name none) and state.
func (t *tally) byBackendState() map[[2]string]int {
	t.mu.Lock()
	defer t.mu.Unlock()
	m := make(map[[2]string]int, len(t.byBackend))
	for k, v := range t.byBackend {
		m[k] = v
	}
	return m
}
