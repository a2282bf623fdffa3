package apiserver

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"net/http"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/layer"
	"github.com/dsecproject/dsec/internal/sandbox"
	"github.com/dsecproject/dsec/internal/watcher"
)

// maxBatch bounds one batch create.
const maxBatch = 1000

// batchConcurrency is how many creates of one batch run at once.
const batchConcurrency = 16

func (s *Server) createSandbox(w http.ResponseWriter, r *http.Request) {
	var spec api.SandboxSpec
	if err := decode(r, &spec); err != nil {
		s.writeError(w, r, err)
		return
	}
	if err := sandbox.ValidateCallerLabels(spec.Labels); err != nil {
		s.writeError(w, r, err)
		return
	}
	sb, err := s.create(r.Context(), spec)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusCreated, sb)
}

// prepare validates a spec and resolves its layer refs to digests, bottom
// first. A spec with a snapshot takes its layers from the snapshot's
// record (base, workspace, toolkits and earlier snapshots) and stacks the
// snapshot on top; base, workspace and toolkits may then be omitted, and
// must match the snapshot's if given.
//
// It also settles the sandbox's project (sandboxProject): the caller's,
// or one below it that the spec names.
func (s *Server) prepare(ctx context.Context, spec *api.SandboxSpec) (layerStack, error) {
	if _, err := s.sandboxProject(ctx, spec); err != nil {
		return layerStack{}, err
	}
	resolve := s.memoResolve(ctx)
	var snap *api.Layer
	if spec.Snapshot != "" {
		l, err := resolve(spec.Snapshot)
		if err != nil {
			return layerStack{}, err
		}
		if l.Kind != api.KindSnapshot || l.Snapshot == nil {
			return layerStack{}, errdefs.Invalid("snapshot %s is a %s layer, want a snapshot", spec.Snapshot, l.Kind)
		}
		// Layer fields may be omitted (taken from the snapshot) but not
		// contradict it: the snapshot's diff only makes sense on its stack.
		from := l.Snapshot.Spec
		base := spec.Base
		if base == "" {
			base = spec.Image
		}
		if base != "" && base != from.Base || spec.Workspace != "" && spec.Workspace != from.Workspace ||
			len(spec.Toolkits) > 0 && strings.Join(spec.Toolkits, ",") != strings.Join(from.Toolkits, ",") {
			return layerStack{}, errdefs.Invalid("snapshot %s was taken on base %s, workspace %q, toolkits %v; omit those fields or give the same",
				spec.Snapshot, from.Base, from.Workspace, from.Toolkits)
		}
		spec.Base, spec.Image, spec.Workspace, spec.Toolkits = from.Base, "", from.Workspace, from.Toolkits
		snap = &l
	}
	s.applyImageDefaults(spec, resolve) // before Normalize fills user and workdir
	if err := sandbox.Normalize(spec, s.deps.Policy); err != nil {
		return layerStack{}, err
	}
	if snap != nil {
		below := edgeapi.StackBelow(snap.Snapshot.Below, snap.Snapshot.Spec)
		if below > len(snap.Snapshot.Layers) {
			return layerStack{}, errdefs.Precondition("snapshot %s: its record stacks %d layers below it, %d of them base, workspace and toolkits: it cannot be used",
				spec.Snapshot, len(snap.Snapshot.Layers), below)
		}
		return layerStack{digests: append(append([]string(nil), snap.Snapshot.Layers...), snap.Digest), below: below}, nil
	}
	var digests []string
	add := func(field, ref, kind string) error {
		l, err := resolve(ref)
		if err != nil {
			return err
		}
		if l.Kind != kind {
			return errdefs.Invalid("%s %s is a %s layer, want a %s layer", field, ref, l.Kind, kind)
		}
		digests = append(append(digests, l.Lowers...), l.Digest)
		return nil
	}
	if err := add("base", spec.Base, api.KindBase); err != nil {
		return layerStack{}, err
	}
	if spec.Workspace != "" {
		if err := add("workspace", spec.Workspace, api.KindWorkspace); err != nil {
			return layerStack{}, err
		}
	}
	for _, t := range spec.Toolkits {
		if err := add("toolkit", t, api.KindToolkit); err != nil {
			return layerStack{}, err
		}
	}
	st := layerStack{digests: digests}
	if len(digests) != edgeapi.StackBelow(0, *spec) {
		st.below = len(digests) // a base with lowers: an older edge would count one
	}
	return st, nil
}

// layerStack is a sandbox's layers as prepare resolved them: digests,
// bottom first, of which the first are base (with its lowers), workspace
// and toolkits and the rest snapshot layers; below counts the former when
// that is not one layer each (edgeapi.CreateRequest.Below).
type layerStack struct {
	digests []string
	below   int
}

// memoResolve is resolve for one request: each ref is read from the
// catalog once (the base is looked at for its image defaults and for its
// digest; with etcd each read is a round trip).
func (s *Server) memoResolve(ctx context.Context) func(string) (api.Layer, error) {
	type res struct {
		l   api.Layer
		err error
	}
	seen := map[string]res{}
	return func(ref string) (api.Layer, error) {
		if r, ok := seen[ref]; ok {
			return r.l, r.err
		}
		l, err := s.resolveFor(ctx, ref)
		seen[ref] = res{l, err}
		return l, err
	}
}

// resolveFor is resolve for the caller of ctx: a layer it may not see is
// not found.
func (s *Server) resolveFor(ctx context.Context, ref string) (api.Layer, error) {
	l, err := s.resolve(ref)
	if err != nil {
		return l, err
	}
	if !s.layerVisible(ctx, l) {
		return api.Layer{}, errdefs.NotFound("layer %s not found", ref)
	}
	return l, nil
}

// resolve finds a layer by ref (kind/name:tag) or digest.
func (s *Server) resolve(ref string) (api.Layer, error) {
	if layer.IsDigest(ref) {
		return s.deps.Layers.Get(ref)
	}
	if _, err := layer.ParseRef(ref); err != nil {
		return api.Layer{}, err
	}
	return s.deps.Layers.Resolve(ref)
}

// create places a prepared sandbox, retrying on other nodes when an edge
// rejects it for capacity.
func (s *Server) create(ctx context.Context, spec api.SandboxSpec) (*api.Sandbox, error) {
	st, err := s.prepare(ctx, &spec)
	if err != nil {
		return nil, err
	}
	if ic := idemFrom(ctx); ic != nil {
		spec.Labels = withLabel(spec.Labels, IdempotencyLabel, ic.label)
		if ic.takeover {
			made, err := s.madeBefore(ctx, ic.label, spec.Project)
			if err != nil {
				return nil, err
			}
			if len(made) > 0 {
				return &made[0], nil
			}
		}
	}
	return s.place(ctx, spec, st)
}

func withLabel(l map[string]string, k, v string) map[string]string {
	out := make(map[string]string, len(l)+1)
	for a, b := range l {
		out[a] = b
	}
	out[k] = v
	return out
}

// madeBefore lists the sandboxes an earlier attempt of a keyed call made
// (they carry its label, and are in the call's project). Every node must
// answer: a node that cannot be asked may hold some, and creating them
// again could make two. A node that does not answer (or that the view has
// down: under load it may be only slow) is asked again, madeBeforeTries
// times in all. A sandbox of it still "creating" (its node still making
// it, or about to undo a failed create) is waited for, up to
// madeBeforeCreating: answered as it was made, it could be gone a moment
// later.
func (s *Server) madeBefore(ctx context.Context, label, project string) ([]api.Sandbox, error) {
	// One still being made is waited for: its create may yet fail (the
	// node undoes it) or succeed.
	deadline := time.Now().Add(madeBeforeCreating)
	for {
		made, err := s.madeBeforeOnce(ctx, label, project)
		if err != nil {
			return nil, err
		}
		creating := ""
		for _, sb := range made {
			if sb.State == api.StateCreating {
				creating = sb.ID
			}
		}
		if creating == "" {
			return made, nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return nil, errdefs.Unavailable("an earlier attempt of this request is still making sandbox %s; retry later", creating)
		}
		select {
		case <-ctx.Done():
		case <-time.After(madeBeforePause / 5):
		}
	}
}

// madeBeforeOnce is one look of madeBefore.
func (s *Server) madeBeforeOnce(ctx context.Context, label, project string) ([]api.Sandbox, error) {
	var mu sync.Mutex
	var made []api.Sandbox
	list := func(ctx context.Context, e edgeapi.Edge) error {
		l, err := e.List(ctx, edgeapi.ListFilter{Labels: map[string]string{IdempotencyLabel: label}})
		if err != nil {
			return err
		}
		mu.Lock()
		for _, sb := range l {
			// Callers cannot set dsec's labels, but sandboxes made
			// before they were refused may carry any: another
			// project's is never this call's.
			if sb.Project == project {
				made = append(made, sb)
			}
		}
		mu.Unlock()
		return nil
	}
	targets := s.deps.Nodes.Edges()
	for try := 1; ; try++ {
		skipped, err := s.fanOutTo(ctx, targets, list)
		if err != nil {
			return nil, err
		}
		if len(skipped) == 0 {
			break
		}
		if try == madeBeforeTries || ctx.Err() != nil {
			return nil, errdefs.Unavailable("cannot tell what an earlier attempt of this request made: node %s does not answer; retry later", strings.Join(skipped, ", "))
		}
		again := map[string]bool{}
		for _, n := range skipped {
			again[n] = true
		}
		var next []watcher.Target
		for _, t := range s.deps.Nodes.Edges() {
			if again[t.Name] && t.Edge != nil {
				t.Down = false
				next = append(next, t)
			}
		}
		targets = next
		select {
		case <-ctx.Done():
		case <-time.After(time.Duration(try) * madeBeforePause):
		}
	}
	sort.Slice(made, func(i, j int) bool { return made[i].ID < made[j].ID })
	return made, nil
}

// madeBefore's patience with nodes that do not answer. Variables for tests.
var (
	madeBeforeTries = 3
	madeBeforePause = 500 * time.Millisecond
	// madeBeforeCreating bounds the wait for a sandbox still being made.
	madeBeforeCreating = 30 * time.Second
)

func (s *Server) batchCreate(w http.ResponseWriter, r *http.Request) {
	var req api.BatchCreateRequest
	if err := decode(r, &req); err != nil {
		s.writeError(w, r, err)
		return
	}
	if req.Count < 1 || req.Count > maxBatch {
		s.writeError(w, r, errdefs.Invalid("count must be between 1 and %d, got %d", maxBatch, req.Count))
		return
	}
	if err := sandbox.ValidateCallerLabels(req.Spec.Labels); err != nil {
		s.writeError(w, r, err)
		return
	}
	spec := req.Spec
	st, err := s.prepare(r.Context(), &spec)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, s.createMany(r, req.Count, spec, st))
}

func (s *Server) getSandbox(w http.ResponseWriter, r *http.Request) {
	s.forward(w, r, http.StatusOK, func(e edgeapi.Edge, id string) (any, error) {
		return e.Get(r.Context(), id)
	})
}

// Pagination: results are ordered by id; the page token is the last id of
// the previous page, opaque to clients.
const (
	defaultPageSize = 100
	maxPageSize     = 1000
)

func (s *Server) listSandboxes(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	sel, err := sandbox.ParseSelector(q["label"])
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	state := q.Get("state")
	switch state {
	case "", api.StateCreating, api.StateRunning, api.StatePaused, api.StateStopped, api.StateFailed:
	default:
		s.writeError(w, r, badQuery("state", state, "want creating, running, paused, stopped or failed"))
		return
	}
	limit := defaultPageSize
	if v := q.Get("limit"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > maxPageSize {
			s.writeError(w, r, badQuery("limit", v, "want an integer from 1 to 1000"))
			return
		}
		limit = n
	}
	after, err := pageAfter("page_token", q.Get("page_token"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	page, more, skipped, err := s.listPage(r.Context(), []string{state}, sel, after, limit)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	next := ""
	if more {
		next = pageToken(page[len(page)-1].ID)
	}
	writeSandboxList(w, page, next, skipped)
}

// writeSandboxList answers an api.SandboxList whose sandboxes are page,
// as their edges wrote them: a page of 1,000 is not decoded and encoded
// again. It writes what json.Encoder writes of the struct.
func writeSandboxList(w http.ResponseWriter, page []edgeapi.RawSandbox, next string, skipped []string) {
	n := len(`{"sandboxes":[],"next_page_token":"","unreachable_nodes":[]}`) + len(next) + 2
	for _, sb := range page {
		n += len(sb.JSON) + 1
	}
	for _, node := range skipped {
		n += len(node) + 3
	}
	b := make([]byte, 0, n)
	b = append(b, `{"sandboxes":[`...)
	for i, sb := range page {
		if i > 0 {
			b = append(b, ',')
		}
		b = append(b, sb.JSON...)
	}
	b = append(b, ']')
	if next != "" {
		b = append(b, `,"next_page_token":`...)
		b = appendJSON(b, next)
	}
	if len(skipped) > 0 {
		b = append(b, `,"unreachable_nodes":`...)
		b = appendJSON(b, skipped)
	}
	b = append(b, "}\n"...)
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(b)
}

// appendJSON appends the JSON of v (a string or strings: it cannot fail).
func appendJSON(b []byte, v any) []byte {
	j, _ := json.Marshal(v)
	return append(b, j...)
}

// decodePage decodes the sandboxes of a page. One that does not decode
// is left out and its node named in bad, as a node that could not be
// asked is.
func (s *Server) decodePage(page []edgeapi.RawSandbox) (out []api.Sandbox, bad []string) {
	out = make([]api.Sandbox, 0, len(page))
	for _, sb := range page {
		var v api.Sandbox
		if err := json.Unmarshal(sb.JSON, &v); err != nil {
			node, _ := edgeapi.NodeOf(sb.ID)
			s.log.Warn("a node listed a sandbox that does not decode", "node", node, "sandbox_id", sb.ID, "err", err)
			if !slices.Contains(bad, node) {
				bad = append(bad, node)
			}
			continue
		}
		out = append(out, v)
	}
	return out, bad
}

// pageToken is the token of the page after the sandbox id.
func pageToken(id string) string { return base64.RawURLEncoding.EncodeToString([]byte(id)) }

// pageAfter reads the page token tok of query parameter name: the id the
// page starts after ("" for the first page).
func pageAfter(name, tok string) (string, error) {
	b, err := base64.RawURLEncoding.DecodeString(tok)
	if err != nil {
		return "", badQuery(name, tok, "not a token returned by this API")
	}
	return string(b), nil
}

// listPage is one page of the sandboxes of every edge: those in any of
// states ("" = any state) whose labels hold sel, ordered by id, after the
// id after, at most limit of them (0: all). more says whether another
// page follows; skipped are the nodes that could not be asked (their
// sandboxes are left out).
//
// An id names its node (sb-NODE-RANDOM, and the apiserver routes by it),
// so a node's ids all sort at or after "sb-NODE-": a page is filled from
// the nodes in that order, a wave of them at a time, and the nodes whose
// ids all sort after a full page's last are not asked. A wave is as many
// nodes as the view's counts of the selected job say hold what the page
// still needs, and one more; without counts that add up, the first is
// pageWave nodes and the next as many as the rate the nodes asked so far
// gave says. A job spread over
// every node is then listed a few nodes per page, not all of them (each
// sending a page's worth) for every page.
func (s *Server) listPage(ctx context.Context, states []string, sel map[string]string, after string, limit int) (page []edgeapi.RawSandbox, more bool, skipped []string, err error) {
	// Each edge asked returns its first limit+1 after the token, per
	// state: enough to fill the page and to tell whether there is more.
	// The token is an id, so it pages the same on any apiserver.
	n := 0
	if limit > 0 {
		n = limit + 1
	}
	var mu sync.Mutex
	var all []edgeapi.RawSandbox
	list := func(ctx context.Context, e edgeapi.Edge) error {
		for _, st := range states {
			l, err := edgeapi.ListRaw(ctx, e, edgeapi.ListFilter{State: st, Labels: sel, After: after, Limit: n})
			mu.Lock()
			all = append(all, l...)
			mu.Unlock()
			if err != nil {
				return err
			}
		}
		return nil
	}
	targets := s.deps.Nodes.Edges()
	if limit == 0 {
		if skipped, err = s.fanOutTo(ctx, targets, list); err != nil {
			return nil, false, nil, err
		}
	} else {
		// In the order of the ids they can hold; those whose ids all sort
		// before the token have nothing for this page.
		type ranged struct {
			t      watcher.Target
			lo, hi string
		}
		var order []ranged
		for _, t := range targets {
			lo := "sb-" + t.Name + "-"
			if hi := lo + "\x7f"; hi > after { // id characters are ASCII
				order = append(order, ranged{t, lo, hi})
			}
		}
		sort.Slice(order, func(i, j int) bool { return order[i].lo < order[j].lo })
		// A job's counts per node, from the view, size the waves (a
		// hint: what the nodes answer decides).
		jobs := s.jobCounts(sel, states)
		cover := func(need int) (int, bool) {
			if jobs == nil {
				return 0, false
			}
			sum := 0
			for i, r := range order {
				if sum += jobs[r.t.Name]; sum >= need {
					return min(i+2, len(order)), true
				}
			}
			// Fewer than the view counts: not counted (stopped ones are
			// not), or the view is behind; the nodes' answers size it.
			return 0, false
		}
		wave, asked := pageWave, 0
		if n, ok := cover(limit + 1); ok {
			wave = n
		}
		for len(order) > 0 {
			w := order[:min(wave, len(order))]
			order = order[len(w):]
			ts := make([]watcher.Target, len(w))
			for i, r := range w {
				ts[i] = r.t
			}
			before := len(all)
			sk, err := s.fanOutTo(ctx, ts, list)
			skipped = append(skipped, sk...)
			if err != nil {
				return nil, false, nil, err
			}
			if len(order) == 0 {
				break
			}
			sort.Slice(all, func(i, j int) bool { return all[i].ID < all[j].ID })
			start := sort.Search(len(all), func(i int) bool { return all[i].ID > after })
			if len(all)-start > limit && all[start+limit].ID < order[0].lo {
				break // the page and the next one's first are known: no node left can change them
			}
			// The next wave: as many nodes as the ones asked so far say
			// the rest of the page needs, and one more.
			asked += len(w)
			if jobs != nil {
				// Counts that promised far more than the nodes gave
				// (other labels or projects narrow the job, or the
				// view is behind) size no more waves.
				promised := 0
				for _, r := range w {
					promised += jobs[r.t.Name]
				}
				if 2*(len(all)-before) < promised {
					jobs = nil
				}
			}
			have := len(all) - start
			if n, ok := cover(limit + 1 - have); ok {
				wave = n
			} else if have > 0 {
				wave = max(1, (limit+1-have)*asked/have+1)
			} else {
				wave *= 4
			}
		}
		sort.Strings(skipped)
	}
	sort.Slice(all, func(i, j int) bool { return all[i].ID < all[j].ID })
	// An edge client that ignores After still pages right.
	start := sort.Search(len(all), func(i int) bool { return all[i].ID > after })
	page = append([]edgeapi.RawSandbox{}, all[start:]...)
	if limit > 0 && len(page) > limit {
		page, more = page[:limit], true
	}
	return page, more, skipped, nil
}

// pageWave is how many nodes a page of a listing asks first when the view
// cannot tell how many hold the page. A variable for tests.
var pageWave = 2

// jobCounts is, by node, how many sandboxes of the job sel selects (by
// api.JobLabel) the view last saw there (creating, running or paused
// ones); nil when sel names no job or states asks for others.
func (s *Server) jobCounts(sel map[string]string, states []string) map[string]int {
	job, ok := sel[api.JobLabel]
	if !ok {
		return nil
	}
	for _, st := range states {
		switch st {
		case "", api.StateCreating, api.StateRunning, api.StatePaused:
		default:
			return nil // not counted
		}
	}
	out := map[string]int{}
	for _, v := range s.deps.Nodes.Snapshot() {
		if n := v.Jobs[job]; n > 0 {
			out[v.Name] = n
		}
	}
	return out
}

func (s *Server) deleteSandbox(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	e, err := s.edgeOf(r.Context(), id)
	if err != nil {
		// Idempotent: an id no edge could own is already gone.
		w.WriteHeader(http.StatusNoContent)
		return
	}
	if err := e.Delete(r.Context(), id); err != nil {
		s.writeError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (s *Server) deleteByLabels(w http.ResponseWriter, r *http.Request) {
	s.byLabels(w, r, edgeapi.Edge.DeleteByLabels, func(n int, skipped []string) any { return api.DeleteResult{Deleted: n, UnreachableNodes: skipped} })
}

func (s *Server) keepalive(w http.ResponseWriter, r *http.Request) {
	var req api.KeepaliveRequest
	if err := decodeOptional(r, &req); err != nil {
		s.writeError(w, r, err)
		return
	}
	s.forward(w, r, http.StatusOK, func(e edgeapi.Edge, id string) (any, error) {
		return e.Keepalive(r.Context(), id, req.TTL)
	})
}

func (s *Server) stats(w http.ResponseWriter, r *http.Request) {
	s.forward(w, r, http.StatusOK, func(e edgeapi.Edge, id string) (any, error) {
		return e.Stats(r.Context(), id)
	})
}

func (s *Server) listNodes(w http.ResponseWriter, r *http.Request) {
	nodes := s.nodes()
	if scope := edgeapi.ScopeOf(r.Context()); scope != "" && scope != edgeapi.RootPath {
		for i := range nodes {
			nodes[i] = tenantView(nodes[i], scope)
		}
	}
	writeJSON(w, http.StatusOK, api.NodeList{Nodes: nodes})
}

// tenantView is what a key of a project below the root (scope) sees of a
// node: its own subtree's usage, and nothing that tells other tenants'
// projects, jobs or images, nor where the internal API listens. What
// placement goes by (health, capacity, counts by state and backend,
// labels) stays.
func tenantView(n api.Node, scope string) api.Node {
	var own map[string]api.ProjectUsage
	for path, u := range n.Projects {
		if edgeapi.PathIn(path, scope) {
			if own == nil {
				own = map[string]api.ProjectUsage{}
			}
			own[path] = u
		}
	}
	n.Projects = own
	if !edgeapi.PathIn(n.DedicatedTo, scope) {
		n.DedicatedTo = ""
	}
	n.Jobs, n.Layers, n.Address = nil, nil, ""
	return n
}
