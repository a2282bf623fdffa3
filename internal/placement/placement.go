// Package placement chooses the node for a new sandbox. It is a pure
// function over a snapshot of nodes (no I/O): filter (healthy, offers the
// backend, has room), then power-of-k-choices on load, so that many
// apiservers placing at once do not herd onto one node. The apiserver calls it.
package placement

import (
	"math/rand/v2"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
)

// K is how many eligible nodes are sampled per decision.
const K = 2

// Request is what placement needs to know about a sandbox.
type Request struct {
	Backend string
	// Exclude lists nodes already tried (they rejected the request).
	Exclude map[string]bool
}

// load is the number of sandboxes holding resources on n.
func load(n api.Node) int {
	return n.Counts[api.StateRunning] + n.Counts[api.StatePaused] + n.Counts[api.StateCreating]
}

// Pick returns the name of the chosen node. rng may be nil (default source).
func Pick(nodes []api.Node, req Request, rng *rand.Rand) (string, error) {
	var eligible []api.Node
	for _, n := range nodes {
		if !n.Healthy || req.Exclude[n.Name] || !offers(n, req.Backend) {
			continue
		}
		if n.Capacity.MaxSandboxes > 0 && load(n) >= n.Capacity.MaxSandboxes {
			continue
		}
		eligible = append(eligible, n)
	}
	if len(eligible) == 0 {
		return "", errdefs.Exhausted("no node can hold a %s sandbox right now (%d nodes known)", req.Backend, len(nodes))
	}
	intn := rand.IntN
	if rng != nil {
		intn = rng.IntN
	}
	best := eligible[intn(len(eligible))]
	for i := 1; i < K && len(eligible) > 1; i++ {
		c := eligible[intn(len(eligible))]
		if load(c) < load(best) {
			best = c
		}
	}
	return best.Name, nil
}

func offers(n api.Node, backend string) bool {
	for _, b := range n.Backends {
		if b == backend {
			return true
		}
	}
	return false
}
