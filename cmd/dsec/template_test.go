package main

import (
	"encoding/json"
	"net/http"
	"slices"
	"strings"
	"testing"

	"github.com/dsecproject/dsec/api"
)

func TestCLITemplate(t *testing.T) {
	var got api.Template
	var removed string
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/templates", func(w http.ResponseWriter, r *http.Request) {
		if err := json.NewDecoder(r.Body).Decode(&got); err != nil {
			t.Error(err)
		}
		if got.Name == "taken" {
			jsonReply(w, 409, api.ErrorBody{Error: api.ErrorDetail{Code: "already_exists", Message: "template taken exists"}})
			return
		}
		jsonReply(w, 201, got)
	})
	mux.HandleFunc("GET /v1/templates", func(w http.ResponseWriter, r *http.Request) {
		jsonReply(w, 200, api.TemplateList{Templates: []api.Template{
			{Name: "base", Base: "base/debian:12", Toolkits: []string{"toolkit/e2b:1"}, User: "user", Project: "root"}}})
	})
	mux.HandleFunc("DELETE /v1/templates/{name}", func(w http.ResponseWriter, r *http.Request) {
		removed = r.PathValue("name")
		w.WriteHeader(204)
	})

	out, err := runCLI(t, mux, "template", "alias", "py", "--base", "base/python:3.11", "--workspace", "workspace/w:1",
		"--toolkit", "toolkit/a:1", "--toolkit", "toolkit/b:1", "--user", "user")
	if err != nil {
		t.Fatal(err)
	}
	if got.Name != "py" || got.Base != "base/python:3.11" || got.Workspace != "workspace/w:1" ||
		!slices.Equal(got.Toolkits, []string{"toolkit/a:1", "toolkit/b:1"}) || got.User != "user" {
		t.Fatalf("server got %+v", got)
	}
	if out != "py -> base/python:3.11 + workspace/w:1 + toolkit/a:1 + toolkit/b:1\n" {
		t.Errorf("stdout %q", out)
	}
	if _, err := runCLI(t, mux, "template", "alias", "py"); err == nil || !strings.Contains(err.Error(), "--base is required") {
		t.Errorf("no base: %v", err)
	}
	if _, err := runCLI(t, mux, "template", "alias", "taken", "--base", "base/x:1"); err == nil || !strings.Contains(err.Error(), "exists") {
		t.Errorf("taken: %v", err)
	}
	out, err = runCLI(t, mux, "template", "list")
	if err != nil || !strings.Contains(out, "base/debian:12 + toolkit/e2b:1") || !strings.HasPrefix(out, "NAME") {
		t.Errorf("list %q, %v", out, err)
	}
	if out, err := runCLI(t, mux, "template", "list", "--json"); err != nil || !strings.Contains(out, `"name": "base"`) {
		t.Errorf("list --json %q, %v", out, err)
	}
	if _, err := runCLI(t, mux, "template", "rm", "py"); err != nil || removed != "py" {
		t.Errorf("rm: %q, %v", removed, err)
	}
}

func TestE2BDefaultTemplateFlag(t *testing.T) {
	base := []string{"--etcd", "http://127.0.0.1:2379", "--cluster", "/c", "--layers", "/l"}
	c, _, err := parseServer(base)
	if err != nil || c.e2bDefaultTemplate != defaultE2BTemplate {
		t.Fatalf("default %q, %v", c.e2bDefaultTemplate, err)
	}
	c, _, err = parseServer(append(base, "--e2b-default-template", "py"))
	if err != nil || c.e2bDefaultTemplate != "py" {
		t.Fatalf("set %q, %v", c.e2bDefaultTemplate, err)
	}
}
