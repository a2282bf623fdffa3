package dsec

import (
	"context"
	"errors"
	"net/http"
	"reflect"
	"testing"

	"github.com/dsecproject/dsec/api"
)

func TestTemplates(t *testing.T) {
	f, c := newFakeServer(t)
	ctx := context.Background()
	var got api.Template
	var gotBody, gotName, deleted string
	f.mux.HandleFunc("POST /v1/templates", func(w http.ResponseWriter, r *http.Request) {
		gotBody = decodeBody(t, r, &got)
		if got.Name == "taken" {
			writeErr(w, 409, "already_exists", "template taken exists")
			return
		}
		out := got
		out.Project = "root"
		writeJSON(w, 201, out)
	})
	f.mux.HandleFunc("GET /v1/templates", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, 200, api.TemplateList{Templates: []api.Template{{Name: "base", Base: "base/debian:12"}}})
	})
	f.mux.HandleFunc("GET /v1/templates/{name}", func(w http.ResponseWriter, r *http.Request) {
		gotName = r.PathValue("name")
		writeJSON(w, 200, api.Template{Name: gotName, Base: "base/debian:12"})
	})
	f.mux.HandleFunc("DELETE /v1/templates/{name}", func(w http.ResponseWriter, r *http.Request) {
		deleted = r.PathValue("name")
		w.WriteHeader(204)
	})

	want := api.Template{Name: "py", Base: "base/python:3.11", Workspace: "workspace/w:1", Toolkits: []string{"toolkit/t:1"}, User: "user"}
	// Project and CreatedAt are the server's: not sent.
	in := want
	in.Project = "elsewhere"
	tpl, err := c.CreateTemplate(ctx, in)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, want) || tpl.Project != "root" {
		t.Fatalf("server got %+v (%s), answer %+v", got, gotBody, tpl)
	}
	if _, err := c.CreateTemplate(ctx, api.Template{Name: "taken", Base: "base/x:1"}); !errors.Is(err, ErrAlreadyExists) {
		t.Fatalf("taken: %v", err)
	}
	if _, err := c.CreateTemplate(ctx, api.Template{Name: "x"}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("no base: %v", err)
	}
	l, err := c.ListTemplates(ctx)
	if err != nil || len(l) != 1 || l[0].Name != "base" {
		t.Fatalf("list %+v, %v", l, err)
	}
	if g, err := c.GetTemplate(ctx, "base"); err != nil || g.Base != "base/debian:12" || gotName != "base" {
		t.Fatalf("get %+v, %v", g, err)
	}
	if err := c.DeleteTemplate(ctx, "py"); err != nil || deleted != "py" {
		t.Fatalf("delete %q, %v", deleted, err)
	}
	if err := c.DeleteTemplate(ctx, ""); !errors.Is(err, ErrInvalid) {
		t.Fatalf("empty name: %v", err)
	}
}
