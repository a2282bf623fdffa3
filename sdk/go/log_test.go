package dsec

import (
	"context"
	"errors"
	"net/http"
	"strconv"
	"testing"

	"github.com/dsecproject/dsec/api"
)

func TestReadLog(t *testing.T) {
	f, c := newFakeServer(t)
	f.mux.HandleFunc("GET /v1/sandboxes/{id}/log", func(w http.ResponseWriter, r *http.Request) {
		if r.PathValue("id") != "sb-e1-a" {
			writeErr(w, 404, "not_found", "no such sandbox")
			return
		}
		since, _ := strconv.ParseInt(r.URL.Query().Get("since_seq"), 10, 64)
		limit := 2
		if v := r.URL.Query().Get("limit"); v != "" {
			limit, _ = strconv.Atoi(v)
		}
		page := api.LogPage{Entries: []api.LogEntry{}, NextSeq: since}
		for seq := since + 1; seq <= 5 && len(page.Entries) < limit; seq++ {
			page.Entries = append(page.Entries, api.LogEntry{Seq: seq, Kind: api.LogExec})
			page.NextSeq = seq
		}
		writeJSON(w, 200, page)
	})
	ctx := context.Background()
	page, err := c.ReadLog(ctx, "sb-e1-a", 3, 1)
	if err != nil {
		t.Fatal(err)
	}
	if q := f.last().URL.Query(); q.Get("since_seq") != "3" || q.Get("limit") != "1" {
		t.Fatalf("query %v", q)
	}
	if len(page.Entries) != 1 || page.Entries[0].Seq != 4 || page.NextSeq != 4 {
		t.Fatalf("page %+v", page)
	}
	// Zero values are left to the server's defaults.
	if _, err := c.ReadLog(ctx, "sb-e1-a", 0, 0); err != nil {
		t.Fatal(err)
	}
	if q := f.last().URL.RawQuery; q != "" {
		t.Fatalf("query %q, want none", q)
	}
	all, err := c.ReadAllLog(ctx, "sb-e1-a", 1)
	if err != nil {
		t.Fatal(err)
	}
	if len(all) != 4 || all[0].Seq != 2 || all[3].Seq != 5 {
		t.Fatalf("all %+v", all)
	}
	if _, err := c.ReadLog(ctx, "sb-e1-b", 0, 0); !errors.Is(err, ErrNotFound) {
		t.Fatalf("unknown sandbox: %v", err)
	}
}

func TestReadAllLogStuckServer(t *testing.T) {
	f, c := newFakeServer(t)
	f.mux.HandleFunc("GET /v1/sandboxes/{id}/log", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, 200, api.LogPage{Entries: []api.LogEntry{{Seq: 1}}, NextSeq: 0})
	})
	if _, err := c.ReadAllLog(context.Background(), "sb-e1-a", 0); err == nil {
		t.Fatal("want an error for a server that does not move forward")
	}
}
