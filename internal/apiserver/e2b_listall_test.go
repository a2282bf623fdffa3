package apiserver

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"sort"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/edgeapi/edgetest"
	"github.com/dsecproject/dsec/internal/watcher"
)

// failingEdge answers its first ok Lists, then fails every one with err.
type failingEdge struct {
	edgeapi.Edge
	ok    int64
	calls *atomic.Int64
	err   error
}

func (f failingEdge) List(ctx context.Context, l edgeapi.ListFilter) ([]api.Sandbox, error) {
	if f.calls.Add(1) > f.ok {
		return nil, f.err
	}
	return f.Edge.List(ctx, l)
}

// boundedEdge records whether any List asked it for more than max.
type boundedEdge struct {
	edgeapi.Edge
	max  int
	over *atomic.Bool
}

func (b boundedEdge) List(ctx context.Context, l edgeapi.ListFilter) ([]api.Sandbox, error) {
	if l.Limit <= 0 || l.Limit > b.max {
		b.over.Store(true)
	}
	return b.Edge.List(ctx, l)
}

// TestE2BListAllStreamsPages: E2B's first list (GET /sandboxes) answers
// every running sandbox of every node in one JSON array, fetched a page
// at a time (a page smaller than the nodes' sandboxes here); a node that
// cannot be reached is named in the X-Dsec-Unreachable-Nodes trailer; a
// page that fails after the answer started cuts the answer off instead
// of ending it as if complete; a failure on the first page is an E2B
// error.
func TestE2BListAllStreamsPages(t *testing.T) {
	defer func(n int) { e2bStreamPage = n }(e2bStreamPage)
	e2bStreamPage = 3
	f := newFixture(t, false)
	type node struct {
		name string
		wrap func(edgeapi.Edge) edgeapi.Edge
	}
	var want []string
	build := func(nodes []node) *httptest.Server {
		var targets watcher.Static
		want = nil
		for i, n := range nodes {
			fe := edgetest.NewFake(n.name)
			for k := range 2 + i%3 {
				sb, err := fe.Create(t.Context(), edgeapi.CreateRequest{Spec: api.SandboxSpec{Base: "base/py:1"}})
				if err != nil {
					t.Fatal(err)
				}
				if k == 0 {
					if _, err := fe.Pause(t.Context(), sb.ID); err != nil {
						t.Fatal(err)
					}
					continue
				}
				want = append(want, sb.ID)
			}
			var e edgeapi.Edge = fe
			if n.wrap != nil {
				e = n.wrap(fe)
			}
			targets = append(targets, e)
		}
		sort.Strings(want)
		view := watcher.New(targets, watcher.Config{DownAfter: time.Hour})
		view.Sync(t.Context())
		return f.apiserverWith(t, fmt.Sprint(len(nodes)), func(d *Deps) { d.Nodes = view })
	}
	get := func(srv *httptest.Server) (*http.Response, []byte, error) {
		t.Helper()
		req, _ := http.NewRequest("GET", srv.URL+"/sandboxes", nil)
		req.Header.Set("X-API-KEY", f.admin)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return nil, nil, err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		return resp, b, err
	}
	ids := func(b []byte) []string {
		t.Helper()
		var l []e2bListed
		if err := json.Unmarshal(b, &l); err != nil {
			t.Fatalf("not a JSON list: %v: %s", err, b)
		}
		var out []string
		for _, x := range l {
			if x.State != "running" {
				t.Fatalf("listed %+v", x)
			}
			out = append(out, x.SandboxID)
		}
		return out
	}
	// Every node is asked for a page's worth at most (and one more, to
	// tell whether there is more).
	var over atomic.Bool
	var names []node
	for i := range 7 {
		names = append(names, node{name: fmt.Sprintf("n%d", i), wrap: func(e edgeapi.Edge) edgeapi.Edge {
			return boundedEdge{Edge: e, max: e2bStreamPage + 1, over: &over}
		}})
	}
	resp, b, err := get(build(names))
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("list: %d %v %s", resp.StatusCode, err, b)
	}
	if got := ids(b); !slices.Equal(got, want) || len(want) <= 2*e2bStreamPage {
		t.Fatalf("listed %v, want %v (more than two pages)", got, want)
	}
	if v := resp.Trailer.Get("X-Dsec-Unreachable-Nodes") + resp.Header.Get("X-Dsec-Unreachable-Nodes"); v != "" {
		t.Fatalf("unreachable nodes %q, want none", v)
	}
	if over.Load() {
		t.Fatalf("a node was asked for more than a page (%d)", e2bStreamPage)
	}

	// A node that cannot be reached: the others' sandboxes, and its name
	// in the trailer.
	var calls atomic.Int64
	down := append(slices.Clone(names), node{name: "zz", wrap: func(e edgeapi.Edge) edgeapi.Edge {
		return failingEdge{Edge: e, calls: &calls, err: &edgeapi.Unreachable{Node: "zz", Err: errors.New("connection refused")}}
	}})
	resp, b, err = get(build(down))
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("list with a node down: %d %v %s", resp.StatusCode, err, b)
	}
	got := ids(b)
	if v := resp.Trailer.Get("X-Dsec-Unreachable-Nodes"); v != "zz" || len(got) == 0 || slices.ContainsFunc(got, func(id string) bool { n, _ := edgeapi.NodeOf(id); return n == "zz" }) {
		t.Fatalf("with zz down: unreachable %q, listed %v", v, got)
	}

	// A node that fails (not unreachable) on the second page: the answer
	// is cut off, never a shorter list that parses.
	calls.Store(0)
	broken := append(slices.Clone(names), node{name: "n9", wrap: func(e edgeapi.Edge) edgeapi.Edge {
		return failingEdge{Edge: e, ok: 1, calls: &calls, err: errors.New("boom")}
	}})
	resp, b, err = get(build(broken))
	var l []e2bListed
	if err == nil || resp != nil && (resp.StatusCode != 200 || json.Unmarshal(b, &l) == nil) {
		t.Fatalf("a later page failed: %v, %s, read error %v: want a broken answer", resp, b, err)
	}
	// On the first page (a node whose ids sort first): an E2B error.
	calls.Store(0)
	first := append(slices.Clone(names), node{name: "a0", wrap: func(e edgeapi.Edge) edgeapi.Edge {
		return failingEdge{Edge: e, calls: &calls, err: errors.New("boom")}
	}})
	resp, b, _ = get(build(first))
	wantE2BError(t, resp, b, 500)
}
