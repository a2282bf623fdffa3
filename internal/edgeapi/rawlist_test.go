package edgeapi_test

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/edgeapi/edgetest"
)

// TestListRawIsTheListing: a listing read as lines holds the same
// sandboxes, in the same order and with the same fields, as List's.
func TestListRawIsTheListing(t *testing.T) {
	fake := edgetest.NewFake("n1")
	inner := edgeapi.NewServer(fake, nil)
	var types []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		inner.ServeHTTP(w, r)
		if strings.HasSuffix(r.URL.Path, ":list") {
			types = append(types, w.Header().Get("Content-Type"))
		}
	}))
	t.Cleanup(srv.Close)
	c := edgeapi.NewClient("n1", srv.URL, srv.Client())
	ctx := t.Context()
	for range 5 {
		newSandbox(t, c)
	}
	f := edgeapi.ListFilter{Labels: map[string]string{"job": "j"}, Limit: 4}
	want, err := c.List(ctx, f)
	if err != nil || len(want) != 4 {
		t.Fatalf("list: %d, %v", len(want), err)
	}
	raw, err := c.ListRaw(ctx, f)
	if err != nil {
		t.Fatal(err)
	}
	if got := decodeRaw(t, raw); !reflect.DeepEqual(got, want) {
		t.Fatalf("lines decode to\n%+v\nwant\n%+v", got, want)
	}
	if len(types) != 2 || types[0] != "application/json" || types[1] != edgeapi.ListLinesType {
		t.Fatalf("the edge answered List and ListRaw as %q, want JSON then lines", types)
	}
	// An in-process edge lists the same through ListRaw.
	local, err := edgeapi.ListRaw(ctx, fake, f)
	if err != nil {
		t.Fatal(err)
	}
	if got := decodeRaw(t, local); !reflect.DeepEqual(got, want) {
		t.Fatalf("in-process ListRaw decodes to %+v, want %+v", got, want)
	}
	// An empty listing is no line at all.
	if raw, err := c.ListRaw(ctx, edgeapi.ListFilter{Labels: map[string]string{"job": "none"}}); err != nil || len(raw) != 0 {
		t.Fatalf("empty listing: %d, %v", len(raw), err)
	}
}

func decodeRaw(t *testing.T, raw []edgeapi.RawSandbox) []api.Sandbox {
	t.Helper()
	out := make([]api.Sandbox, len(raw))
	for i, r := range raw {
		if err := json.Unmarshal(r.JSON, &out[i]); err != nil {
			t.Fatalf("line %d (%s): %v", i, r.ID, err)
		}
		if out[i].ID != r.ID {
			t.Fatalf("line %d names %s, its JSON %s", i, r.ID, out[i].ID)
		}
	}
	return out
}

// TestListRawFromAnOlderEdge: an edge that answers the JSON listing
// whatever was asked is read all the same.
func TestListRawFromAnOlderEdge(t *testing.T) {
	fake := edgetest.NewFake("n1")
	inner := edgeapi.NewServer(fake, nil)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		r.Header.Del("Accept")
		inner.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	c := edgeapi.NewClient("n1", srv.URL, srv.Client())
	a, b := newSandbox(t, c), newSandbox(t, c)
	raw, err := c.ListRaw(t.Context(), edgeapi.ListFilter{})
	if err != nil {
		t.Fatal(err)
	}
	got := decodeRaw(t, raw)
	if len(got) != 2 || got[0].ID != min(a, b) || got[1].ID != max(a, b) {
		t.Fatalf("older edge's listing: %+v", got)
	}
}

// TestListRawRefusesAMalformedListing: what an apiserver passes on
// unread must be sandboxes; an answer that is not is the node's failure,
// not a page with garbage in it.
func TestListRawRefusesAMalformedListing(t *testing.T) {
	good := `sb-n1-aaaa` + "\t" + `{"id":"sb-n1-aaaa","state":"running"}` + "\n"
	for name, body := range map[string]string{
		"no newline":        strings.TrimSuffix(good, "\n"),
		"no id":             `{"id":"sb-n1-aaaa"}` + "\n",
		"not an id":         "../etc\t{}\n",
		"not JSON":          "sb-n1-aaaa\t{\"id\":\n",
		"two values":        "sb-n1-aaaa\t{}{}\n",
		"an array":          "sb-n1-aaaa\t[]\n",
		"breaks the array":  "sb-n1-aaaa\t{}],\"x\":[{}\n",
		"empty JSON":        "sb-n1-aaaa\t\n",
		"good then garbage": good + "sb-n1-bbbb\tnull\n",
		"another id":        "sb-n1-bbbb\t" + `{"id":"sb-n1-aaaa"}` + "\n",
		"id not first":      "sb-n1-aaaa\t" + `{"state":"x","id":"sb-n1-aaaa"}` + "\n",
		"id prefix only":    "sb-n1-aa\t" + `{"id":"sb-n1-aaaa"}` + "\n",
		"not UTF-8":         "sb-n1-aaaa\t" + `{"id":"sb-n1-aaaa","x":"` + "\xff" + `"}` + "\n",
	} {
		t.Run(name, func(t *testing.T) {
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Type", edgeapi.ListLinesType)
				_, _ = w.Write([]byte(body))
			}))
			t.Cleanup(srv.Close)
			c := edgeapi.NewClient("n1", srv.URL, srv.Client())
			l, err := c.ListRaw(t.Context(), edgeapi.ListFilter{})
			if err == nil || !edgeapi.IsUnreachable(err) {
				t.Fatalf("%q: %d sandboxes, %v; want the node's failure", body, len(l), err)
			}
		})
	}
	// The well-formed one is read.
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", edgeapi.ListLinesType+"; charset=utf-8")
		_, _ = w.Write([]byte(good))
	}))
	t.Cleanup(srv.Close)
	l, err := edgeapi.NewClient("n1", srv.URL, srv.Client()).ListRaw(t.Context(), edgeapi.ListFilter{})
	if err != nil || len(l) != 1 || l[0].ID != "sb-n1-aaaa" || string(l[0].JSON) != `{"id":"sb-n1-aaaa","state":"running"}` {
		t.Fatalf("good listing: %+v, %v", l, err)
	}
}
