package watcher

import (
	"context"
	"errors"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/edgeapi/edgetest"
	"github.com/dsecproject/dsec/internal/errdefs"
)

// registry is a Source the test edits.
type registry struct {
	mu    sync.Mutex
	m     map[string]Member
	err   error
	lists int           // Members calls
	slow  time.Duration // how long a listing takes
}

func (r *registry) Members(context.Context) (map[string]Member, error) {
	time.Sleep(r.slow)
	r.mu.Lock()
	defer r.mu.Unlock()
	r.lists++
	if r.err != nil {
		return nil, r.err
	}
	out := map[string]Member{}
	for k, v := range r.m {
		out[k] = v
	}
	return out, nil
}

func (r *registry) set(name string, m *Member) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if m == nil {
		delete(r.m, name)
		return
	}
	r.m[name] = *m
}

func served(t *testing.T, name string) (*edgeapi.Client, *httptest.Server) {
	t.Helper()
	srv := httptest.NewServer(edgeapi.NewServer(edgetest.NewFake(name), nil))
	t.Cleanup(srv.Close)
	return edgeapi.NewClient(name, srv.URL, srv.Client()), srv
}

func view(w *Watcher, name string) (View, bool) {
	for _, v := range w.Snapshot() {
		if v.Name == name {
			return v, true
		}
	}
	return View{}, false
}

func TestWatcherHealth(t *testing.T) {
	a, _ := served(t, "a")
	b, bsrv := served(t, "b")
	reg := &registry{m: map[string]Member{"a": {Edge: a, Address: "x"}, "b": {Edge: b}}}
	w := New(reg, Config{DownAfter: time.Hour, ForgetAfter: time.Hour})
	ctx := t.Context()

	if v, ok := view(w, "a"); ok {
		t.Fatalf("known before any round: %+v", v)
	}
	w.Sync(ctx)
	for _, n := range []string{"a", "b"} {
		if v, _ := view(w, n); !v.Healthy || v.LastSeen == nil || v.Counts == nil {
			t.Fatalf("%s after a round: %+v", n, v)
		}
	}
	if v, _ := view(w, "a"); v.Address != "x" {
		t.Fatalf("address %q", v.Address)
	}

	// b dies: two failed polls make it unhealthy, and a fan-out skips it.
	bsrv.Close()
	w.Sync(ctx)
	if v, _ := view(w, "b"); !v.Healthy {
		t.Fatalf("one missed poll is not enough: %+v", v)
	}
	w.Sync(ctx)
	if v, _ := view(w, "b"); v.Healthy || v.Unhealthy == "" {
		t.Fatalf("two missed polls: %+v", v)
	}
	for _, tg := range w.Edges() {
		if tg.Down != (tg.Name == "b") {
			t.Fatalf("fan-out target %s down=%v", tg.Name, tg.Down)
		}
	}

	// A call that could not reach a marks it at once; a good poll clears it.
	w.MarkFailed("a", errors.New("connection refused"))
	if v, _ := view(w, "a"); v.Healthy {
		t.Fatalf("marked failed but healthy")
	}
	w.Sync(ctx)
	if v, _ := view(w, "a"); !v.Healthy {
		t.Fatalf("a good poll did not clear the mark: %+v", v)
	}

	// a leaves the registry (its lease lapsed) but still answers: not
	// placed on, still routed.
	reg.set("a", nil)
	w.Sync(ctx)
	v, _ := view(w, "a")
	if v.Healthy {
		t.Fatalf("unlisted node placed on: %+v", v)
	}
	if e, err := w.Edge(ctx, "a"); err != nil || e != a {
		t.Fatalf("unlisted but alive node not routed: %v", err)
	}
	// The registry failing keeps the view as it was.
	reg.err = errdefs.Unavailable("etcd down")
	w.Sync(ctx)
	if _, ok := view(w, "b"); !ok {
		t.Fatalf("a failing registry emptied the view")
	}
}

func TestWatcherDownAfterAndForget(t *testing.T) {
	a, asrv := served(t, "a")
	reg := &registry{m: map[string]Member{"a": {Edge: a}}}
	w := New(reg, Config{DownAfter: 50 * time.Millisecond, ForgetAfter: 100 * time.Millisecond})
	ctx := t.Context()
	w.Sync(ctx)
	time.Sleep(80 * time.Millisecond)
	if v, _ := view(w, "a"); v.Healthy {
		t.Fatalf("no good poll for longer than DownAfter, still healthy: %+v", v)
	}
	asrv.Close()
	reg.set("a", nil)
	w.Sync(ctx)
	time.Sleep(150 * time.Millisecond)
	w.Sync(ctx)
	if _, ok := view(w, "a"); ok {
		t.Fatalf("an unlisted node that does not answer was not forgotten")
	}
	if _, err := w.Edge(ctx, "a"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("routing to a forgotten node: %v", err)
	}
}

// TestWatcherRoutesANewEdge: an edge that joined since the last round is
// found by the routing lookup itself.
func TestWatcherRoutesANewEdge(t *testing.T) {
	reg := &registry{m: map[string]Member{}}
	w := New(reg, Config{})
	w.Sync(t.Context())
	c, _ := served(t, "late")
	reg.set("late", &Member{Edge: c})
	time.Sleep(2 * refreshEvery)
	if e, err := w.Edge(t.Context(), "late"); err != nil || e != c {
		t.Fatalf("new edge not routed: %v", err)
	}
}

// TestWatcherMissesShareAListing: many calls at once for IDs of a node
// nobody knows (a flood of bad IDs, or a node long gone) make one listing
// of the registry, not one each, and all get not_found.
func TestWatcherMissesShareAListing(t *testing.T) {
	reg := &registry{m: map[string]Member{}, slow: 50 * time.Millisecond}
	w := New(reg, Config{})
	w.Sync(t.Context())
	time.Sleep(2 * refreshEvery)
	reg.mu.Lock()
	before := reg.lists
	reg.mu.Unlock()
	var wg sync.WaitGroup
	for range 50 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := w.Edge(t.Context(), "gone"); !errors.Is(err, errdefs.ErrNotFound) {
				t.Errorf("unknown node: %v, want not_found", err)
			}
		}()
	}
	wg.Wait()
	reg.mu.Lock()
	defer reg.mu.Unlock()
	if n := reg.lists - before; n != 1 {
		t.Fatalf("50 misses at once listed the registry %d times, want 1", n)
	}
}

// TestWatcherWrongName: an address now answered by another edge is not
// taken for the registered one.
func TestWatcherWrongName(t *testing.T) {
	imposter, _ := served(t, "other")
	reg := &registry{m: map[string]Member{"a": {Edge: imposter}}}
	w := New(reg, Config{})
	w.Sync(t.Context())
	if v, _ := view(w, "a"); v.Healthy {
		t.Fatalf("an edge answering with another name is healthy: %+v", v)
	}
}

// TestSnapshotKeptAcrossPolls: a poll that only changes a healthy node's
// counts leaves the snapshot as it is until snapshotMaxAge (placements
// would otherwise rebuild it for nearly every create); a failure makes
// the next one new at once.
func TestSnapshotKeptAcrossPolls(t *testing.T) {
	ctx := context.Background()
	fe := edgetest.NewFake("n1")
	w := New(Static{fe}, Config{DownAfter: time.Hour})
	w.Sync(ctx)
	s1 := w.Snapshot()
	if _, err := fe.Create(ctx, edgeapi.CreateRequest{Spec: api.SandboxSpec{Base: "base/x:1"}}); err != nil {
		t.Fatal(err)
	}
	w.poll(ctx, "n1", fe)
	if s2 := w.Snapshot(); &s2[0] != &s1[0] {
		t.Fatal("a poll of a healthy node rebuilt the snapshot at once")
	}
	time.Sleep(snapshotMaxAge + 10*time.Millisecond)
	if s3 := w.Snapshot(); s3[0].Counts[api.StateRunning] != 1 {
		t.Fatalf("after snapshotMaxAge the snapshot counts %v, want the poll's 1 running", s3[0].Counts)
	}
	s4 := w.Snapshot()
	w.MarkFailed("n1", errors.New("connection refused"))
	if s5 := w.Snapshot(); &s5[0] == &s4[0] || s5[0].Healthy {
		t.Fatal("a node marked failed is still healthy in the next snapshot")
	}
}
