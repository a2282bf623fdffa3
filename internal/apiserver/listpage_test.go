package apiserver

import (
	"context"
	"encoding/json"
	"fmt"
	"sort"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/edgeapi/edgetest"
	"github.com/dsecproject/dsec/internal/watcher"
)

// countingEdge counts the List calls an edge gets.
type countingEdge struct {
	edgeapi.Edge
	lists *atomic.Int64
}

func (c countingEdge) List(ctx context.Context, f edgeapi.ListFilter) ([]api.Sandbox, error) {
	c.lists.Add(1)
	return c.Edge.List(ctx, f)
}

// TestListPagesAcrossManyNodes: paging a label over many nodes returns
// every sandbox once, in id order, whatever the page size, including
// with node names that are prefixes of others (whose ids interleave);
// and a page of a job spread over every node asks a few of them, not
// all.
func TestListPagesAcrossManyNodes(t *testing.T) {
	// ("a-0"'s ids sort inside "a"'s range, before "a"'s own.)
	names := []string{"a", "a-0", "a-00", "a-b", "a-b-c", "ab", "b", "b.1", "b1", "z"}
	for i := range 40 {
		names = append(names, fmt.Sprintf("n%02d", i))
	}
	var lists atomic.Int64
	var targets watcher.Static
	var want []string
	for i, name := range names {
		fe := edgetest.NewFake(name)
		for k := range 3 + i%5 {
			labels := map[string]string{"job": "j"}
			if k == 0 {
				labels["job"] = "other"
			}
			sb, err := fe.Create(t.Context(), edgeapi.CreateRequest{Spec: api.SandboxSpec{Base: "base/py:1", Labels: labels}})
			if err != nil {
				t.Fatal(err)
			}
			if k > 0 {
				want = append(want, sb.ID)
			}
		}
		targets = append(targets, countingEdge{fe, &lists})
	}
	sort.Strings(want)
	// The fixture's IAM and store, over these nodes, polled once: no node
	// may count as down while the test runs.
	view := watcher.New(targets, watcher.Config{DownAfter: time.Hour})
	view.Sync(t.Context())
	f := newFixture(t, false)
	srv := f.apiserverWith(t, "b", func(d *Deps) { d.Nodes = view })
	page := func(limit int, token string) api.SandboxList {
		resp, body := f.doAt(t, srv, f.admin, "", "GET", fmt.Sprintf("/v1/sandboxes?label=job=j&limit=%d&page_token=%s", limit, token), "")
		var l api.SandboxList
		if resp.StatusCode != 200 || json.Unmarshal(body, &l) != nil {
			t.Fatalf("list: %s %s", resp.Status, body)
		}
		return l
	}
	defer func(w int) { pageWave = w }(pageWave)
	for _, wave := range []int{1, 2, 8, 64} {
		pageWave = wave
		for _, limit := range []int{1, 2, 3, 7, 50, 1000} {
			lists.Store(0)
			var got []string
			pages := 0
			for token := ""; ; pages++ {
				l := page(limit, token)
				for _, sb := range l.Sandboxes {
					got = append(got, sb.ID)
				}
				if l.NextPageToken == "" {
					break
				}
				if len(l.Sandboxes) != limit {
					t.Fatalf("limit %d: a page of %d before the last", limit, len(l.Sandboxes))
				}
				token = l.NextPageToken
			}
			if fmt.Sprint(got) != fmt.Sprint(want) {
				t.Fatalf("wave %d, limit %d: listed\n%v\nwant\n%v", wave, limit, got, want)
			}
			if perPage := float64(lists.Load()) / float64(pages+1); wave <= 8 && limit <= 7 && perPage > float64(len(names))/3 {
				t.Fatalf("limit %d: %.1f edges asked per page, want at most a third of the %d", limit, perPage, len(names))
			}
		}
	}
}
