package edge

import (
	"context"
	"errors"
	"os"
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/sandbox/fake"
)

// walkCounts sums the node's counts over every sandbox, as Info did before
// the counts were kept as sandboxes change: the reference they must match.
func walkCounts(e *Edge) api.Node {
	n := api.Node{Counts: map[string]int{}}
	e.mu.RLock()
	defer e.mu.RUnlock()
	for _, s := range e.sandboxes {
		s.mu.Lock()
		if s.pooled {
			n.Counts["pooled"]++
			s.mu.Unlock()
			continue
		}
		st := s.rec.Sandbox.State
		n.Counts[st]++
		if holdsResources(st) {
			if n.BackendCounts == nil {
				n.BackendCounts = map[string]int{}
			}
			n.BackendCounts[s.rec.Sandbox.Backend]++
			path := s.rec.ProjectPath
			if path == "" {
				path = edgeapi.RootPath
			}
			if n.Projects == nil {
				n.Projects = map[string]api.ProjectUsage{}
			}
			u := n.Projects[path]
			sp := s.rec.Sandbox.Spec
			u.Add(api.ProjectUsage{Sandboxes: 1, CPU: sp.CPU, MemoryMB: sp.MemoryMB, DiskMB: sp.DiskMB})
			n.Projects[path] = u
			if job := s.rec.Sandbox.Labels[api.JobLabel]; job != "" {
				if n.Jobs == nil {
					n.Jobs = map[string]int{}
				}
				n.Jobs[job]++
			}
		}
		s.mu.Unlock()
	}
	return n
}

// walkByBackend counts the sandboxes not pooled by backend and state
// over every sandbox: the reference of countsByBackend.
func walkByBackend(e *Edge) map[[2]string]int {
	c := map[[2]string]int{}
	e.mu.RLock()
	defer e.mu.RUnlock()
	for _, s := range e.sandboxes {
		s.mu.Lock()
		if !s.pooled {
			b := s.rec.Sandbox.Backend
			if b == "" {
				b = e.deps.Backend.Name()
			}
			c[[2]string{b, s.rec.Sandbox.State}]++
		}
		s.mu.Unlock()
	}
	return c
}

// walkLabels is what the label index should hold: "k=v" to the ids of
// the listed sandboxes not pooled that carry it.
func walkLabels(e *Edge) map[string][]string {
	out := map[string][]string{}
	e.mu.RLock()
	defer e.mu.RUnlock()
	for id, s := range e.sandboxes {
		s.mu.Lock()
		if !s.pooled {
			for k, v := range s.rec.Sandbox.Labels {
				out[k+"="+v] = append(out[k+"="+v], id)
			}
		}
		s.mu.Unlock()
	}
	for _, ids := range out {
		slices.Sort(ids)
	}
	return out
}

// indexedLabels is what the label index holds, as walkLabels gives it.
func indexedLabels(e *Edge) map[string][]string {
	out := map[string][]string{}
	held := map[string]*sbx{}
	e.labels.mu.Lock()
	for l, set := range e.labels.by {
		kv := l.k + "=" + l.v
		for id, s := range set {
			out[kv] = append(out[kv], id)
			held[id] = s
		}
		slices.Sort(out[kv])
	}
	e.labels.mu.Unlock()
	e.mu.RLock()
	defer e.mu.RUnlock()
	for id, s := range held {
		if e.sandboxes[id] != s {
			out["(not the node's) "+id] = nil
		}
	}
	return out
}

// checkCounts fails unless Info's counts are what a walk over every
// sandbox finds (CPU compared to a millionth: the walk adds floats).
func checkCounts(t *testing.T, e *Edge, step string) api.Node {
	t.Helper()
	got, err := e.Info(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	want := walkCounts(e)
	for p, u := range want.Projects {
		g, ok := got.Projects[p]
		if ok && g.CPU-u.CPU < 1e-6 && u.CPU-g.CPU < 1e-6 {
			g.CPU = u.CPU
			got.Projects[p] = g
		}
	}
	if !reflect.DeepEqual(got.Counts, want.Counts) || !reflect.DeepEqual(got.BackendCounts, want.BackendCounts) ||
		!reflect.DeepEqual(got.Projects, want.Projects) || !reflect.DeepEqual(got.Jobs, want.Jobs) {
		t.Fatalf("%s: info counts %v backends %v projects %v jobs %v;\n a walk finds %v %v %v %v",
			step, got.Counts, got.BackendCounts, got.Projects, got.Jobs, want.Counts, want.BackendCounts, want.Projects, want.Jobs)
	}
	if got, want := indexedLabels(e), walkLabels(e); !reflect.DeepEqual(got, want) {
		t.Fatalf("%s: the label index holds %v; a walk finds %v", step, got, want)
	}
	if got, want := e.countsByBackend(), walkByBackend(e); !reflect.DeepEqual(got, want) {
		t.Fatalf("%s: counts by backend and state %v; a walk finds %v", step, got, want)
	}
	return got
}

// TestCountsFollowEveryChange drives a node through every change of what it
// counts (create, a refused create, pause, resume, a pause undone, pool
// fill and claim, TTL stop, forgetting, delete, restart with a dead
// sandbox) and checks after each that the counts kept as sandboxes change
// are the ones a walk over every sandbox finds.
func TestCountsFollowEveryChange(t *testing.T) {
	ctx := context.Background()
	state := t.TempDir()
	src := &testImages{dir: t.TempDir()}
	layers := src.digests(t, 1)
	b := fake.New("container")
	e := fakeEdgeWith(t, state, b, src, func(c *Config) { c.ReapInterval = time.Hour })
	// Pools on, with no pool loop: the test refills by hand, so nothing
	// changes between Info and the walk.
	e.cfg.PoolMax, e.cfg.PoolMin = 1, 1
	checkCounts(t, e, "empty")

	mk := func(job, project string, cpu float64, mem int64) string {
		t.Helper()
		sb, err := e.Create(ctx, edgeapi.CreateRequest{
			Spec:        api.SandboxSpec{Base: "base/x:1", Labels: map[string]string{"job": job}, CPU: cpu, MemoryMB: mem, TTL: 3600},
			Digests:     layers,
			ProjectPath: project,
		})
		if err != nil {
			t.Fatal(err)
		}
		return sb.ID
	}
	var ids []string
	for i := range 6 {
		ids = append(ids, mk([]string{"a", "b"}[i%2], []string{"", "root/p1", "root/p2"}[i%3], 0.1*float64(i+1), 256))
	}
	n := checkCounts(t, e, "six created")
	if n.Counts[api.StateRunning] != 6 || n.Jobs["a"] != 3 || n.Projects["root/p1"].Sandboxes != 2 || n.Projects["root/p1"].MemoryMB != 512 {
		t.Fatalf("after six creates: %+v", n)
	}

	b.FailNextCreate(errors.New("refused"))
	if _, err := e.Create(ctx, edgeapi.CreateRequest{Spec: api.SandboxSpec{Base: "base/x:1"}, Digests: layers}); err == nil {
		t.Fatal("a refused create succeeded")
	}
	checkCounts(t, e, "a refused create")

	if k, err := e.PauseByLabels(ctx, map[string]string{"job": "a"}); err != nil || k != 3 {
		t.Fatalf("pausing job a: %d %v", k, err)
	}
	n = checkCounts(t, e, "job a paused")
	if n.Counts[api.StatePaused] != 3 || n.Jobs["a"] != 3 {
		t.Fatalf("after pausing job a: %+v", n)
	}
	// A pause whose record cannot be written is undone.
	dir := e.sandboxDir(ids[1])
	if err := os.Rename(dir, dir+".away"); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Pause(ctx, ids[1]); err == nil {
		t.Fatal("a pause that could not write its record succeeded")
	}
	if err := os.Rename(dir+".away", dir); err != nil {
		t.Fatal(err)
	}
	n = checkCounts(t, e, "a pause undone")
	if n.Counts[api.StatePaused] != 3 {
		t.Fatalf("after an undone pause: %+v, want 3 paused", n)
	}
	if k, err := e.ResumeByLabels(ctx, map[string]string{"job": "a"}); err != nil || k != 3 {
		t.Fatalf("resuming job a: %d %v", k, err)
	}
	checkCounts(t, e, "job a resumed")

	// A pool fills behind the class a create used, and the next create of
	// that class takes a pooled sandbox: counted as pooled, then as its
	// claimant's.
	if !e.refillOne() {
		t.Fatal("no pool class to refill")
	}
	n = checkCounts(t, e, "pool filled")
	if n.Counts["pooled"] != 1 {
		t.Fatalf("after a refill: %+v, want one pooled", n)
	}
	var class api.SandboxSpec
	e.pool.mu.Lock()
	for k, ready := range e.pool.ready {
		if len(ready) > 0 {
			class = e.pool.template[k].Spec
		}
	}
	e.pool.mu.Unlock()
	claimed := mk("c", "root/p1", class.CPU, class.MemoryMB)
	n = checkCounts(t, e, "pooled claimed")
	if n.Counts["pooled"] != 0 || n.Jobs["c"] != 1 {
		t.Fatalf("after a claim: %+v, want none pooled and one in job c", n)
	}

	// Past the TTL the reaper stops them (kept as stopped); past the
	// retention it forgets them.
	e.reapOnce(time.Now().Add(2*time.Hour), false)
	n = checkCounts(t, e, "ttl expired")
	if n.Counts[api.StateStopped] != 7 || n.Jobs != nil || n.Projects != nil {
		t.Fatalf("after the TTL: %+v, want 7 stopped and nothing held", n)
	}
	if err := e.Delete(ctx, claimed); err != nil {
		t.Fatal(err)
	}
	checkCounts(t, e, "a stopped one deleted")
	e.reapOnce(time.Now().Add(3*time.Hour), false)
	n = checkCounts(t, e, "stopped forgotten")
	if len(n.Counts) != 0 {
		t.Fatalf("after the retention: %+v, want nothing", n)
	}

	ids = ids[:0]
	for i := range 4 {
		ids = append(ids, mk("d", "root/p3", 1, int64(100*(i+1))))
	}
	if err := e.Delete(ctx, ids[0]); err != nil {
		t.Fatal(err)
	}
	checkCounts(t, e, "deleted")

	// Restart: the survivors are adopted and counted again, the one that
	// died while the edge was down is counted as failed.
	e.Close()
	b.Stop(ids[1])
	e2 := fakeEdgeWith(t, state, b, &testImages{dir: src.dir}, func(c *Config) { c.ReapInterval = time.Hour })
	defer e2.Close()
	n = checkCounts(t, e2, "restarted")
	if n.Counts[api.StateRunning] != 2 || n.Counts[api.StateFailed] != 1 || n.Projects["root/p3"].MemoryMB != 700 {
		t.Fatalf("after a restart: %+v, want 2 running (700 MB) and 1 failed", n)
	}
}
