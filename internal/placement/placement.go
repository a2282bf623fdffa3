// Package placement chooses the node for a new sandbox. It is a pure
// function over a snapshot of nodes (no I/O): filter (healthy, offers the
// backend, carries the labels the spec selects, has room, not an overflow
// pool while the others have room), then power-of-k-choices: sample k
// eligible nodes and take the best, so that many apiservers placing at once
// do not herd onto one node. "Best" spreads a job (fewest sandboxes of the
// same job label), then prefers little load, counting a layer the node has
// not mounted as a little more load. The apiserver calls it with the
// watcher's snapshot plus its own placements that the snapshot does not
// show yet.
package placement

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"sort"
	"strings"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
)

// DefaultK is how many eligible nodes are sampled per decision.
const DefaultK = 2

// AllNodes as K compares every eligible node: least loaded (from the
// view, which may be a poll old). With K 1 placement is random.
const AllNodes = math.MaxInt

// PoolLabel is the node label that names a node's pool.
const PoolLabel = "pool"

// LayerPenalty is the load a missing layer counts as: a node that would
// have to mount it loses to one that has it unless it is this much less
// loaded. Small, so that layer affinity never herds a burst.
const LayerPenalty = 2

// Config is the placement policy of an apiserver.
type Config struct {
	// K is the number of choices (0: DefaultK).
	K int
	// Overflow maps a pool name (the node label pool=NAME) to a
	// utilization from 0 to 1: its nodes are used only while every other
	// eligible node is at least that full, as DSec bursts to the cloud
	// above 80% on-premises utilization.
	Overflow map[string]float64
	// NoOverlay makes the apiserver place from the view alone, without
	// its own placements the view does not show yet. Only for measuring
	// what the overlay is worth (bench control-plane): without it, a
	// burst herds onto the nodes that were least loaded at the last poll.
	NoOverlay bool
	// Hollow lets hollow edges (simulated, running nothing: load tests of
	// the control plane) take sandboxes; otherwise they take none.
	Hollow bool
}

// Candidate is a node as placement sees it: the watcher's view and the
// placements this apiserver made since that view was polled.
type Candidate struct {
	// *api.Node: the watcher's shared view, read only (a copy per node
	// for every create would cost more than the pick).
	*api.Node
	InFlight int
	// InFlightJob is how many of InFlight carry the request's job label.
	InFlightJob int
	// InFlightOther is how many of InFlight belong to another tenancy
	// than the request's (Request.Dedicated).
	InFlightOther int
}

// Request is what placement needs to know about a sandbox.
type Request struct {
	Backend string
	// Selector must match the node's labels (spec.node_selector).
	Selector map[string]string
	// Layers are the digests the sandbox stacks.
	Layers []string
	// Job is the value of the sandbox's job label ("" for none).
	Job string
	// Exclude lists nodes already tried (they refused or failed).
	Exclude map[string]bool
	// IgnoreCapacity keeps nodes the view shows as full: the view may be
	// up to a poll old, and the edge has the final say.
	IgnoreCapacity bool
	// Dedicated is the path of the project with dedicated nodes the
	// sandbox belongs to ("" for none): it goes only to a node that holds
	// that project's sandboxes or nothing, and a sandbox of no such
	// project never goes to a node that holds one's.
	Dedicated string
}

// Load is the number of sandboxes holding resources on n, as the view has
// it (pooled sandboxes give way to real ones, so they do not count).
func Load(n *api.Node) int {
	return n.Counts[api.StateRunning] + n.Counts[api.StatePaused] + n.Counts[api.StateCreating]
}

func (c *Candidate) load() int { return Load(c.Node) + c.InFlight }

// utilization is load over capacity, 0 for a node without a limit.
func (c *Candidate) utilization() float64 {
	if c.Capacity.MaxSandboxes <= 0 {
		return 0
	}
	return float64(c.load()) / float64(c.Capacity.MaxSandboxes)
}

// NoNode is the error of a Pick that found no eligible node; it is an
// errdefs.ErrExhausted and counts why each node was left out.
type NoNode struct {
	Backend string
	Known   int
	Reasons map[string]int // reason → nodes
}

func (e *NoNode) Error() string {
	if e.Known == 0 {
		return "no node can hold the sandbox: no nodes are registered"
	}
	var parts []string
	for r, n := range e.Reasons {
		parts = append(parts, fmt.Sprintf("%d %s", n, r))
	}
	sort.Strings(parts)
	return fmt.Sprintf("no node can hold a %s sandbox right now (%d known: %s)", e.Backend, e.Known, strings.Join(parts, ", "))
}

// Is makes a NoNode an errdefs.ErrExhausted.
func (e *NoNode) Is(target error) bool { return target == errdefs.ErrExhausted }

// OnlyFull reports whether every node left out was left out for being
// full by the view.
func (e *NoNode) OnlyFull() bool {
	return e.Known > 0 && e.Reasons[ReasonFull] == e.Known
}

// Reasons a node is left out.
const (
	ReasonUnhealthy = "unhealthy"
	ReasonBackend   = "without the backend"
	ReasonSelector  = "not matching node_selector"
	ReasonFull      = "full"
	ReasonTried     = "already tried"
	ReasonOverflow  = "in an overflow pool the others leave unused"
	ReasonTenancy   = "holding another tenant's sandboxes (dedicated nodes)"
	ReasonHollow    = "hollow (simulated; only apiservers with --place-on-hollow place on them)"
)

// Pick returns the name of the chosen node. rng may be nil (default source).
func Pick(nodes []Candidate, req Request, cfg Config, rng *rand.Rand) (string, error) {
	k := cfg.K
	if k <= 0 {
		k = DefaultK
	}
	why := map[string]int{}
	// Pointers into nodes: a Candidate is large, and this runs for every
	// create over every node.
	var regular, overflow []*Candidate
	for i := range nodes {
		n := &nodes[i]
		r := leftOut(n, req, cfg)
		if r != "" {
			why[r]++
			continue
		}
		if _, ok := cfg.Overflow[n.Labels[PoolLabel]]; ok {
			overflow = append(overflow, n)
		} else {
			regular = append(regular, n)
		}
	}
	eligible := regular
	if len(overflow) > 0 {
		// The overflow pools join only once every regular node is at or
		// above the pool's threshold (with no regular node, at once).
		least := math.Inf(1)
		for _, n := range regular {
			least = min(least, n.utilization())
		}
		for _, n := range overflow {
			if least < cfg.Overflow[n.Labels[PoolLabel]] {
				why[ReasonOverflow]++
				continue
			}
			eligible = append(eligible, n)
		}
	}
	if len(eligible) == 0 {
		return "", &NoNode{Backend: req.Backend, Known: len(nodes), Reasons: why}
	}
	intn := rand.IntN
	if rng != nil {
		intn = rng.IntN
	}
	// Sample k distinct nodes (a partial shuffle of the eligible ones):
	// with few nodes, sampling with replacement would often compare a
	// node with itself.
	k = min(k, len(eligible))
	best := -1
	for i := range k {
		j := i + intn(len(eligible)-i)
		eligible[i], eligible[j] = eligible[j], eligible[i]
		if best < 0 || better(eligible[i], eligible[best], req) {
			best = i
		}
	}
	return eligible[best].Name, nil
}

// leftOut says why n cannot take req ("" if it can).
func leftOut(n *Candidate, req Request, cfg Config) string {
	switch {
	case req.Exclude[n.Name]:
		return ReasonTried
	case !n.Healthy:
		return ReasonUnhealthy
	case n.Hollow && !cfg.Hollow:
		return ReasonHollow
	case !slices.Contains(n.Backends, req.Backend):
		return ReasonBackend
	case !selects(req.Selector, n.Labels):
		return ReasonSelector
	case !req.IgnoreCapacity && n.Capacity.MaxSandboxes > 0 && n.load() >= n.Capacity.MaxSandboxes:
		return ReasonFull
	case !tenancyFits(n, req):
		return ReasonTenancy
	}
	return ""
}

// tenancyFits reports whether n may take a sandbox of req's tenancy
// (dedicated nodes): the node holds and is being given sandboxes of that
// tenancy only, or, for a dedicated project, nothing at all.
func tenancyFits(n *Candidate, req Request) bool {
	if n.InFlightOther > 0 {
		return false
	}
	if req.Dedicated == "" {
		return n.DedicatedTo == ""
	}
	return n.DedicatedTo == req.Dedicated || n.DedicatedTo == "" && Load(n.Node) == 0
}

func selects(sel, labels map[string]string) bool {
	for k, v := range sel {
		if labels[k] != v {
			return false
		}
	}
	return true
}

// better reports whether a should win over b for req.
func better(a, b *Candidate, req Request) bool {
	// A dedicated project fills the nodes it holds before it takes an
	// empty one: every node it takes is lost to everyone else.
	if req.Dedicated != "" {
		// Its own: the view says so, or this apiserver placed some of it
		// there since.
		oa := a.DedicatedTo == req.Dedicated || a.InFlight > a.InFlightOther
		ob := b.DedicatedTo == req.Dedicated || b.InFlight > b.InFlightOther
		if oa != ob {
			return oa
		}
	}
	if req.Job != "" {
		ja, jb := a.Jobs[req.Job]+a.InFlightJob, b.Jobs[req.Job]+b.InFlightJob
		if ja != jb {
			return ja < jb
		}
	}
	return cost(a, req) < cost(b, req)
}

// cost is a node's load plus LayerPenalty for each layer it would have to
// mount.
func cost(n *Candidate, req Request) int {
	c := n.load()
	for _, d := range req.Layers {
		if !slices.Contains(n.Layers, d) {
			c += LayerPenalty
		}
	}
	return c
}
