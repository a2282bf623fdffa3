package apiserver

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http/httptest"
	"reflect"
	"slices"
	"sort"
	"sync"
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

// TestSandboxListWrittenAsEncoded: a listing written from its edges'
// JSON is, byte for byte, what encoding the api.SandboxList would give;
// and api.SandboxList has no field writeSandboxList does not write.
func TestSandboxListWrittenAsEncoded(t *testing.T) {
	if n := reflect.TypeFor[api.SandboxList]().NumField(); n != 3 {
		t.Fatalf("api.SandboxList has %d fields; writeSandboxList writes 3", n)
	}
	now := time.Date(2026, 12, 6, 1, 2, 3, 0, time.UTC)
	sbs := []api.Sandbox{
		{ID: "sb-n1-a", State: api.StateRunning, Labels: map[string]string{"job": "j", "q": `"<&>\` + "\t\n"}, CreatedAt: now},
		{ID: "sb-n2-b", State: api.StatePaused, Node: "n2", CreatedAt: now},
	}
	raw, err := edgeapi.EncodeRaw(sbs)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		page    []api.Sandbox
		next    string
		skipped []string
	}{
		{page: []api.Sandbox{}},
		{page: sbs},
		{page: sbs, next: pageToken("sb-n2-b")},
		{page: sbs[:1], skipped: []string{"n3", `n"4`}},
		{page: sbs, next: "x", skipped: []string{"n3"}},
	} {
		rec := httptest.NewRecorder()
		writeSandboxList(rec, raw[:len(c.page)], c.next, c.skipped)
		var want bytes.Buffer
		if err := json.NewEncoder(&want).Encode(api.SandboxList{Sandboxes: c.page, NextPageToken: c.next, UnreachableNodes: c.skipped}); err != nil {
			t.Fatal(err)
		}
		if rec.Body.String() != want.String() {
			t.Fatalf("written:\n%s\nencoded:\n%s", rec.Body, want.String())
		}
		if ct := rec.Header().Get("Content-Type"); ct != "application/json" {
			t.Fatalf("content type %q", ct)
		}
	}
}

// wavesEdge counts the waves of List calls a listing makes: a call that
// starts while no other is in flight starts a wave (a wave's calls start
// together and each takes listPause, and the next wave starts only once
// the last one's calls are all back).
type wavesEdge struct {
	edgeapi.Edge
	c *waveCount
}

type waveCount struct {
	mu              sync.Mutex
	inFlight, waves int
}

func (e wavesEdge) List(ctx context.Context, f edgeapi.ListFilter) ([]api.Sandbox, error) {
	e.c.mu.Lock()
	if e.c.inFlight == 0 {
		e.c.waves++
	}
	e.c.inFlight++
	e.c.mu.Unlock()
	time.Sleep(listPause)
	e.c.mu.Lock()
	e.c.inFlight--
	e.c.mu.Unlock()
	return e.Edge.List(ctx, f)
}

const listPause = 100 * time.Millisecond

// jobView is a view whose nodes report the job counts given (stale or
// wrong ones too).
type jobView struct {
	*watcher.Watcher
	jobs func(node string) map[string]int
}

func (v jobView) Snapshot() []watcher.View {
	out := slices.Clone(v.Watcher.Snapshot())
	for i := range out {
		out[i].Jobs = v.jobs(out[i].Name)
	}
	return out
}

// TestListPagesSizedByJobCounts: a job's page asks, in one wave, the
// nodes the view's job counts say hold it, where without counts it takes
// two waves; counts that are wrong (too low, too high, none) change how
// many nodes are asked, never what is listed.
func TestListPagesSizedByJobCounts(t *testing.T) {
	const nodes, per, limit = 20, 25, 100
	count := &waveCount{}
	var targets watcher.Static
	var want []string
	for i := range nodes {
		fe := edgetest.NewFake(fmt.Sprintf("n%02d", i))
		for range per {
			sb, err := fe.Create(t.Context(), edgeapi.CreateRequest{Spec: api.SandboxSpec{Base: "base/py:1", Labels: map[string]string{"job": "j"}}})
			if err != nil {
				t.Fatal(err)
			}
			want = append(want, sb.ID)
		}
		targets = append(targets, wavesEdge{fe, count})
	}
	sort.Strings(want)
	view := watcher.New(targets, watcher.Config{DownAfter: time.Hour})
	view.Sync(t.Context())
	f := newFixture(t, false)
	list := func(jobs func(string) map[string]int, query string) (pages, waves int) {
		t.Helper()
		srv := f.apiserverWith(t, "b", func(d *Deps) { d.Nodes = jobView{view, jobs} })
		count.mu.Lock()
		count.waves = 0
		count.mu.Unlock()
		var got []string
		for token := ""; ; {
			resp, body := f.doAt(t, srv, f.admin, "", "GET", fmt.Sprintf("/v1/sandboxes?label=job=j&limit=%d&page_token=%s%s", limit, token, query), "")
			var l api.SandboxList
			if resp.StatusCode != 200 || json.Unmarshal(body, &l) != nil {
				t.Fatalf("list: %s %s", resp.Status, body)
			}
			pages++
			for _, sb := range l.Sandboxes {
				got = append(got, sb.ID)
			}
			if l.NextPageToken == "" {
				break
			}
			token = l.NextPageToken
		}
		if !slices.Equal(got, want) {
			t.Fatalf("listed %d sandboxes:\n%v\nwant %d:\n%v", len(got), got, len(want), want)
		}
		count.mu.Lock()
		defer count.mu.Unlock()
		return pages, count.waves
	}
	counts := func(n int) func(string) map[string]int {
		return func(string) map[string]int { return map[string]int{"j": n, "other": 1000} }
	}
	pages, waves := list(counts(per), "")
	if pages != nodes*per/limit+1 && pages != nodes*per/limit {
		t.Fatalf("%d pages of %d for %d sandboxes", pages, limit, nodes*per)
	}
	if waves > pages {
		t.Fatalf("with the job's counts, %d pages took %d waves, want one each", pages, waves)
	}
	_, without := list(func(string) map[string]int { return nil }, "")
	if without < pages*3/2 {
		t.Fatalf("without counts, %d pages took %d waves: the test does not tell waves apart", pages, without)
	}
	// Wrong counts change the waves, never the listing: too low, too high
	// (given up after a wave that gave far less), only some nodes'.
	list(counts(3), "")
	if _, w := list(counts(20*per), ""); w > without {
		t.Fatalf("with counts 20 times too high, %d waves; without counts %d", w, without)
	}
	list(func(node string) map[string]int {
		if node < "n10" {
			return nil
		}
		return map[string]int{"j": per}
	}, "")
	// Counts are of creating, running and paused sandboxes: they size a
	// listing of those, and not one of others.
	if _, w := list(counts(per), "&state=running"); w > pages {
		t.Fatalf("running: %d waves for %d pages", w, pages)
	}
	srv := &Server{deps: Deps{Nodes: jobView{view, counts(per)}}}
	for _, st := range []string{api.StateStopped, api.StateFailed} {
		if c := srv.jobCounts(map[string]string{"job": "j"}, []string{api.StateRunning, st}); c != nil {
			t.Fatalf("job counts used for a listing of %s sandboxes: %v", st, c)
		}
	}
	if c := srv.jobCounts(map[string]string{"job": "j"}, []string{""}); c["n00"] != per {
		t.Fatalf("job counts for any state: %v", c)
	}
}

// TestDecodePageLeavesOutWhatDoesNotDecode: a sandbox an edge listed that
// does not decode (a field of another type) is left out of a decoded page
// and its node named, as a node that could not be asked is.
func TestDecodePageLeavesOutWhatDoesNotDecode(t *testing.T) {
	good, err := edgeapi.EncodeRaw([]api.Sandbox{{ID: "sb-n1-a", State: api.StateRunning}, {ID: "sb-n3-c", State: api.StatePaused}})
	if err != nil {
		t.Fatal(err)
	}
	page := []edgeapi.RawSandbox{good[0], {ID: "sb-n2-b", JSON: []byte(`{"id":"sb-n2-b","created_at":"yesterday"}`)}, good[1]}
	s := &Server{log: slog.New(slog.DiscardHandler)}
	out, bad := s.decodePage(page)
	if len(out) != 2 || out[0].ID != "sb-n1-a" || out[1].ID != "sb-n3-c" || out[1].State != api.StatePaused || !slices.Equal(bad, []string{"n2"}) {
		t.Fatalf("decoded %+v, bad nodes %v", out, bad)
	}
}
