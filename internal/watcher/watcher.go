// Package watcher keeps an apiserver's view of the nodes: it polls every
// edge about once a second (health, capacity, counts, mounted layers) and
// holds the answers as soft state, rebuilt from scratch by polling after a
// restart. Placement reads its snapshot; routing reads its name → edge map.
// Neither ever waits for a poll: the request path reads what the last poll
// left (the E2B orchestrator's node manager works the same way).
//
// Which edges exist comes from a Source: a fixed list for `dsec up`, the
// node registry in the store for a cluster. An edge the source stops
// listing (its registry lease is gone) is no longer placed on, but calls to
// its sandboxes are still routed while it answers polls: an edge cut off
// from etcd keeps serving the sandboxes it holds.
package watcher

import (
	"context"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/errdefs"
)

// Member is an edge a Source lists.
type Member struct {
	Edge edgeapi.Edge
	// Address is where its internal API listens ("" in-process).
	Address string
	// Hollow marks a simulated edge (load tests only).
	Hollow bool
}

// Source lists the edges that exist now, by name.
type Source interface {
	Members(ctx context.Context) (map[string]Member, error)
}

// Static is a Source of fixed edges (`dsec up`, tests).
type Static []edgeapi.Edge

// Members implements Source.
func (s Static) Members(context.Context) (map[string]Member, error) {
	out := make(map[string]Member, len(s))
	for _, e := range s {
		out[e.Name()] = Member{Edge: e}
	}
	return out, nil
}

// Config tunes a Watcher; zero fields take the defaults.
type Config struct {
	// Interval is how often each edge is polled (default 1 s).
	Interval time.Duration
	// Timeout bounds one poll (default 1 s).
	Timeout time.Duration
	// DownAfter is how long an edge may go without a good poll before it
	// is unhealthy (default 2.5 s: two missed polls).
	DownAfter time.Duration
	// ForgetAfter is how long an edge that the source no longer lists and
	// that no longer answers stays routable (default 1 min).
	ForgetAfter time.Duration
	// Parallel bounds the polls in flight (default 64).
	Parallel int
	Log      *slog.Logger
}

// Watcher polls edges; it is safe for concurrent use.
type Watcher struct {
	src Source
	cfg Config
	log *slog.Logger

	// syncMu serialises rounds (Run's ticks and Sync); refreshMu the
	// source's listings (rounds and routing misses), so that misses at
	// once share one listing and an older one is never merged last.
	syncMu, refreshMu sync.Mutex

	mu    sync.RWMutex
	nodes map[string]*node
	// ver counts the changes of nodes (under mu, which every change holds).
	ver uint64
	// lastRefresh is when Refresh last asked the source (rate limit).
	lastRefresh time.Time

	// snap is the last Snapshot, of version snapVer taken at snapAt:
	// every create reads it, so it is built again only when the view
	// changed in a way that matters now (membership, health) or
	// snapshotMaxAge passed (counts, and health depends on the time too).
	snapMu  sync.Mutex
	snap    []View
	snapVer uint64
	snapAt  time.Time
}

// snapshotMaxAge bounds how long a Snapshot is served again unchanged:
// a node's health turns on the time since its last good poll (seconds),
// so this may lag it by as much.
const snapshotMaxAge = 100 * time.Millisecond

// node is the watcher's state of one edge.
type node struct {
	member Member
	// listed says the source still lists it; unlistedAt is since when
	// it does not.
	listed     bool
	unlistedAt time.Time
	info       api.Node
	polled     bool      // at least one good poll
	polledAt   time.Time // start of the last good poll
	lastOK     time.Time
	lastErr    error
	fails      int
	// suspect is set by MarkFailed (a forward could not reach it) and
	// cleared by the next good poll.
	suspect error
}

// New returns a Watcher over src. Call Run to start polling.
func New(src Source, cfg Config) *Watcher {
	if cfg.Interval <= 0 {
		cfg.Interval = time.Second
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = time.Second
	}
	if cfg.DownAfter <= 0 {
		cfg.DownAfter = 2500 * time.Millisecond
	}
	if cfg.ForgetAfter <= 0 {
		cfg.ForgetAfter = time.Minute
	}
	if cfg.Parallel <= 0 {
		cfg.Parallel = 64
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	return &Watcher{src: src, cfg: cfg, log: cfg.Log, nodes: map[string]*node{}}
}

// Run polls until ctx ends. It does one round at once, so a fresh
// apiserver has a view within one poll of starting.
func (w *Watcher) Run(ctx context.Context) {
	t := time.NewTicker(w.cfg.Interval)
	defer t.Stop()
	for {
		w.Sync(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// Sync does one round now: it asks the source for its members, then polls
// every known edge.
func (w *Watcher) Sync(ctx context.Context) {
	w.syncMu.Lock()
	defer w.syncMu.Unlock()
	w.refreshMu.Lock()
	w.refresh(ctx)
	w.refreshMu.Unlock()
	w.pollAll(ctx)
	// What Sync polled is in the next Snapshot, counts included.
	w.mu.Lock()
	w.ver++
	w.mu.Unlock()
}

// refresh merges the source's members into the view. A failing source
// (etcd unreachable) leaves the view as it was.
// Preconditions: w.refreshMu held.
func (w *Watcher) refresh(ctx context.Context) {
	members, err := w.src.Members(ctx)
	now := time.Now()
	w.mu.Lock()
	defer w.mu.Unlock()
	w.ver++
	w.lastRefresh = now
	if err != nil {
		w.log.Warn("listing edges failed; keeping the last known ones", "err", err)
		return
	}
	for name, m := range members {
		n := w.nodes[name]
		if n == nil {
			n = &node{}
			w.nodes[name] = n
			w.log.Info("edge joined", "node", name, "address", m.Address)
		}
		if n.member.Address != m.Address && n.member.Edge != nil {
			w.log.Info("edge moved", "node", name, "from", n.member.Address, "to", m.Address)
			n.polled = false
		}
		n.member = m
		n.listed = true
	}
	for name, n := range w.nodes {
		if _, ok := members[name]; ok {
			continue
		}
		if n.listed {
			n.listed, n.unlistedAt = false, now
			w.log.Warn("edge left the registry (its lease is gone); no longer placed on", "node", name)
		}
		if now.Sub(n.unlistedAt) > w.cfg.ForgetAfter && now.Sub(n.lastOK) > w.cfg.ForgetAfter {
			delete(w.nodes, name)
			w.log.Info("edge forgotten", "node", name)
		}
	}
}

func (w *Watcher) pollAll(ctx context.Context) {
	w.mu.RLock()
	targets := make(map[string]edgeapi.Edge, len(w.nodes))
	for name, n := range w.nodes {
		targets[name] = n.member.Edge
	}
	w.mu.RUnlock()
	sem := make(chan struct{}, w.cfg.Parallel)
	var wg sync.WaitGroup
	for name, e := range targets {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			w.poll(ctx, name, e)
		}()
	}
	wg.Wait()
}

func (w *Watcher) poll(ctx context.Context, name string, e edgeapi.Edge) {
	start := time.Now()
	pctx, cancel := context.WithTimeout(ctx, w.cfg.Timeout)
	info, err := e.Info(pctx)
	cancel()
	if err == nil && info.Name != name {
		err = errdefs.Unavailable("the edge at this address is %q, not %q", info.Name, name)
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	n := w.nodes[name]
	if n == nil || n.member.Edge != e {
		return // replaced meanwhile
	}
	// A poll that changes only a healthy node's counts leaves the
	// snapshot to its age (snapshotMaxAge; placement's in-flight overlay
	// covers what the snapshot's older polls miss): every node polled
	// every second would rebuild it for nearly every create. One that may
	// change a node's health makes the next Snapshot new.
	if err != nil || !n.polled || n.fails > 0 || n.suspect != nil {
		w.ver++
	}
	if err != nil {
		if n.fails == 0 && n.polled {
			w.log.Warn("edge poll failed", "node", name, "err", err)
		}
		n.lastErr = err
		n.fails++
		return
	}
	if n.fails > 0 && n.polled {
		w.log.Info("edge answers again", "node", name, "failed_polls", n.fails)
	}
	n.info, n.polled, n.polledAt, n.lastOK = info, true, start, time.Now()
	n.lastErr, n.fails, n.suspect = nil, 0, nil
}

// MarkFailed records that a call could not reach the edge: placement
// avoids it until a poll succeeds again.
func (w *Watcher) MarkFailed(name string, err error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.ver++
	if n := w.nodes[name]; n != nil && n.suspect == nil {
		n.suspect = err
		w.log.Warn("edge unreachable from a request; not placing on it until it answers a poll", "node", name, "err", err)
	}
}

// View is a node as the watcher sees it.
type View struct {
	api.Node
	// PolledAt is when the poll that gave these counts started: a
	// placement made after it is not in them.
	PolledAt time.Time
}

// Snapshot returns every known node, sorted by name, with Healthy saying
// whether placement may use it now (as of at most snapshotMaxAge ago).
// The slice and its views are shared between callers: read them, never
// change them.
func (w *Watcher) Snapshot() []View {
	now := time.Now()
	w.mu.RLock()
	ver := w.ver
	w.mu.RUnlock()
	w.snapMu.Lock()
	defer w.snapMu.Unlock()
	if w.snap != nil && w.snapVer == ver && now.Sub(w.snapAt) < snapshotMaxAge {
		return w.snap
	}
	w.snap, w.snapVer = w.build(now)
	w.snapAt = now
	return w.snap
}

// build makes a Snapshot as of now, and says which version of the view
// it is.
func (w *Watcher) build(now time.Time) ([]View, uint64) {
	w.mu.RLock()
	ver := w.ver
	out := make([]View, 0, len(w.nodes))
	for name, n := range w.nodes {
		v := View{Node: n.info, PolledAt: n.polledAt}
		v.Name = name
		v.Address = n.member.Address
		v.Hollow = n.member.Hollow
		v.Counts = maps.Clone(n.info.Counts)
		if v.Counts == nil {
			v.Counts = map[string]int{}
		}
		if v.Backends == nil {
			v.Backends = []string{}
		}
		if n.polled {
			seen := n.lastOK.UTC()
			v.LastSeen = &seen
		}
		v.Unhealthy = w.unhealthy(n, now)
		v.Healthy = v.Unhealthy == ""
		out = append(out, v)
	}
	w.mu.RUnlock()
	slices.SortFunc(out, func(a, b View) int { return strings.Compare(a.Name, b.Name) })
	return out, ver
}

// unhealthy says why placement must not use n now ("" if it may).
// Preconditions: w.mu held.
func (w *Watcher) unhealthy(n *node, now time.Time) string {
	switch {
	case !n.listed:
		return "not in the node registry (lease lost)"
	case !n.polled && n.lastErr != nil:
		return "never answered a poll: " + n.lastErr.Error()
	case !n.polled:
		return "not polled yet"
	case n.suspect != nil:
		return "unreachable: " + n.suspect.Error()
	case w.missed(n, now):
		msg := "no answer since " + n.lastOK.UTC().Format(time.RFC3339)
		if n.lastErr != nil {
			msg += ": " + n.lastErr.Error()
		}
		return msg
	case !n.info.Healthy:
		return "the edge reports itself unhealthy"
	}
	return ""
}

// refreshEvery bounds how often a routing miss may ask the source.
const refreshEvery = 200 * time.Millisecond

// Edge returns the edge named name for routing. A name the view does not
// know makes it ask the source once (an edge that joined since the last
// round), at most every refreshEvery.
func (w *Watcher) Edge(ctx context.Context, name string) (edgeapi.Edge, error) {
	if e := w.edge(name); e != nil {
		return e, nil
	}
	// A miss waits for a listing in flight and makes one only if that
	// is older than refreshEvery.
	w.refreshMu.Lock()
	w.mu.RLock()
	stale := time.Since(w.lastRefresh) > refreshEvery
	w.mu.RUnlock()
	if stale {
		w.refresh(ctx)
	}
	w.refreshMu.Unlock()
	if e := w.edge(name); e != nil {
		return e, nil
	}
	return nil, errdefs.NotFound("unknown node %s", name)
}

// edge reads name's client under the lock (refresh replaces members).
func (w *Watcher) edge(name string) edgeapi.Edge {
	w.mu.RLock()
	defer w.mu.RUnlock()
	if n := w.nodes[name]; n != nil {
		return n.member.Edge
	}
	return nil
}

// Edges returns every known edge (for calls that span nodes), with
// whether the watcher counts it as up.
func (w *Watcher) Edges() []Target {
	now := time.Now()
	w.mu.RLock()
	defer w.mu.RUnlock()
	out := make([]Target, 0, len(w.nodes))
	for name, n := range w.nodes {
		out = append(out, Target{Name: name, Edge: n.member.Edge, Down: w.down(n, now)})
	}
	slices.SortFunc(out, func(a, b Target) int { return strings.Compare(a.Name, b.Name) })
	return out
}

// down says whether n failed its recent polls (whatever the registry
// says): a fan-out skips it instead of waiting on it.
// Preconditions: w.mu held.
func (w *Watcher) down(n *node, now time.Time) bool {
	if !n.polled {
		return n.lastErr != nil
	}
	return w.missed(n, now)
}

// missed says whether a node that answered before has failed its last
// two polls or not answered for DownAfter.
// Preconditions: w.mu held.
func (w *Watcher) missed(n *node, now time.Time) bool {
	return n.fails >= 2 || now.Sub(n.lastOK) > w.cfg.DownAfter
}

// Target is one edge of a fan-out.
type Target struct {
	Name string
	Edge edgeapi.Edge
	// Down: recent polls failed; the fan-out reports it unreachable
	// rather than wait for it.
	Down bool
}
