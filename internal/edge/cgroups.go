package edge

import (
	"fmt"
	"path"
	"sync"

	"github.com/dsecproject/dsec/internal/cgroup"
	"github.com/dsecproject/dsec/internal/errdefs"
)

// A cgroupTree is a parent cgroup of sandboxes and its recycled slots.
// An edge has two: Config.CgroupParent for sandboxes with a memory cgroup
// of their own, and a sibling "<CgroupParent>-shared" for sandboxes of
// memory_cgroup "shared", which are charged to it (cgroup.Info's
// SharedMemory). A memory cgroup costs kernel memory that grows with the
// number of superblocks on the host (per-cgroup shrinker state, see
// docs/operating.md "Density"): ~1.6 MiB of the ~2.2 MiB an idle sandbox
// cost here.
type cgroupTree struct {
	parent string
	// slots recycles the tree's cgroups (nil: a new cgroup per sandbox,
	// removed after it).
	slots *cgroup.Slots
	// shared: the tree's cgroups have no memory cgroup of their own. Its
	// parent is made on first use (ready), so a node that never runs
	// such a sandbox has no extra cgroup.
	shared bool
	mu     sync.Mutex
	ready  bool
}

// newCgroupTrees sets up the edge's two trees.
func (e *Edge) newCgroupTrees() error {
	if e.deps.Cgroups == nil {
		return nil
	}
	e.own = &cgroupTree{parent: e.cfg.CgroupParent}
	e.shared = &cgroupTree{parent: e.cfg.CgroupParent + "-shared", shared: true}
	switch cg := e.deps.Cgroups; cg.SharedMemory {
	case "":
		cg.SharedMemory = e.shared.parent
	case e.shared.parent:
	default:
		return fmt.Errorf("the host's cgroups already have shared memory parent %s, not %s", cg.SharedMemory, e.shared.parent)
	}
	if e.cfg.CgroupPool > 0 {
		for _, t := range e.cgroupTrees() {
			slots, err := e.deps.Cgroups.NewSlots(t.parent, e.cfg.CgroupPool)
			if err != nil {
				return err
			}
			t.slots = slots
		}
	}
	return nil
}

// cgroupTrees returns the edge's trees (none without cgroups).
func (e *Edge) cgroupTrees() []*cgroupTree {
	if e.own == nil {
		return nil
	}
	return []*cgroupTree{e.own, e.shared}
}

// treeOf returns the tree cgroup rel is a child of, or nil.
func (e *Edge) treeOf(rel string) *cgroupTree {
	for _, t := range e.cgroupTrees() {
		if path.Dir(rel) == t.parent {
			return t
		}
	}
	return nil
}

// cgroupFor picks the cgroup of a new sandbox: a recycled slot, or one
// named after the sandbox when slots are off; with shared, in the tree
// without memory cgroups. cpuBase is the CPU time the cgroup counted
// before (see record.CgroupCPUBase).
func (e *Edge) cgroupFor(id string, shared bool) (rel string, cpuBase uint64, err error) {
	t := e.own
	if shared {
		if e.shared == nil {
			return "", 0, errdefs.Precondition("memory_cgroup shared needs cgroups, and this node runs without")
		}
		if l := e.deps.Launcher; l != "" && l != "dsec" {
			return "", 0, errdefs.Precondition("memory_cgroup shared needs dsec's launcher; this node starts sandboxes with %s", l)
		}
		t = e.shared
		if err := t.ensure(e.deps.Cgroups, e.cfg.SharedMemoryMB<<20); err != nil {
			return "", 0, err
		}
	}
	if t == nil {
		return e.cfg.CgroupParent + "/" + id, 0, nil
	}
	if t.slots != nil {
		rel, cpuBase = t.slots.Get(id)
		return rel, cpuBase, nil
	}
	return t.parent + "/" + id, 0, nil
}

// ensureSharedAtStart applies the node's settings to a shared parent an
// earlier run left (with sandboxes in it, or it would be gone): the limit
// of --shared-memory-mb is the one this run was started with.
func (e *Edge) ensureSharedAtStart() error {
	if e.shared == nil || !e.deps.Cgroups.Exists(e.shared.parent) {
		return nil
	}
	return e.shared.ensure(e.deps.Cgroups, e.cfg.SharedMemoryMB<<20)
}

// ensure makes a shared tree's parent the first time it is needed, with
// memory limit limit (0: none).
func (t *cgroupTree) ensure(cg *cgroup.Info, limit int64) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.ready {
		return nil
	}
	if err := cg.EnsureSharedMemoryParent(); err != nil {
		return fmt.Errorf("preparing the shared memory cgroup %s: %w", t.parent, err)
	}
	if err := cg.SetSharedMemoryLimit(limit); err != nil {
		return err
	}
	t.ready = true
	return nil
}

// releaseCgroup gives sandbox id's cgroup back to its tree's slots (only
// if id still holds it), or removes it when slots are off. The sandbox's
// processes must be gone. Best effort: errors are logged.
func (e *Edge) releaseCgroup(id, cgroupPath string) {
	if e.deps.Cgroups == nil || cgroupPath == "" {
		return
	}
	var err error
	if t := e.treeOf(cgroupPath); t != nil && t.slots != nil {
		err = t.slots.Put(cgroupPath, id)
	} else {
		err = e.deps.Cgroups.Remove(cgroupPath)
	}
	if err != nil {
		e.log.Warn("releasing sandbox cgroup", "sandbox_id", id, "cgroup", cgroupPath, "err", err)
	}
}

// claimCgroup marks rel, named by live sandbox id's record, as id's (see
// cgroup.Slots.Claim); false: another sandbox holds it, or it is free.
func (e *Edge) claimCgroup(rel, id string) bool {
	if t := e.treeOf(rel); t != nil && t.slots != nil {
		return t.slots.Claim(rel, id)
	}
	return true
}

// freeCgroupSlots counts the free slots of both trees.
func (e *Edge) freeCgroupSlots() int {
	n := 0
	for _, t := range e.cgroupTrees() {
		if t.slots != nil {
			n += t.slots.Free()
		}
	}
	return n
}
