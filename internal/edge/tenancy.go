package edge

import (
	"github.com/dsecproject/dsec/internal/errdefs"
)

// Dedicated nodes (blast-radius isolation): a project that asks for them
// never shares a node with another project. The apiserver tells each
// create the path of the nearest project on its lineage that asks
// (CreateRequest.Dedicated, "" for none), and the node, which has the
// final say on admission, keeps its live sandboxes in one tenancy: all of
// one dedicated project's subtree, or all without one. Placement avoids
// nodes whose tenancy (api.Node.DedicatedTo) differs; this is what holds
// when two apiservers place at once. Pooled sandboxes are nobody's until
// claimed, and do not count.

// tenancyAdmitLocked takes one live sandbox of tenancy d, or refuses it
// as resource_exhausted (another node may take it). e.mu is held.
func (e *Edge) tenancyAdmitLocked(d string) error {
	// The refusals reach the caller: they name no other tenant's project.
	for k, n := range e.tenancy {
		if n > 0 && k != d {
			if k == "" {
				return errdefs.Exhausted("node %s holds sandboxes of other projects; %s asks for dedicated nodes", e.cfg.Name, d)
			}
			return errdefs.Exhausted("node %s is dedicated to another project", e.cfg.Name)
		}
	}
	e.tenancyAddLocked(d, 1)
	return nil
}

// tenancyAddLocked counts n more live sandboxes of tenancy d. e.mu is held.
func (e *Edge) tenancyAddLocked(d string, n int) {
	if e.tenancy == nil {
		e.tenancy = map[string]int{}
	}
	e.tenancy[d] += n
	if e.tenancy[d] <= 0 {
		delete(e.tenancy, d)
	}
}

// dedicatedToLocked is the dedicated project path the node holds
// sandboxes of ("" for none). e.mu is held (read).
func (e *Edge) dedicatedToLocked() string {
	for k, n := range e.tenancy {
		if n > 0 && k != "" {
			return k
		}
	}
	return ""
}
