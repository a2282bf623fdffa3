package dsec

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"reflect"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
)

// decodeBody decodes a request's JSON body into v and returns the raw
// bytes, so that tests can check which fields were sent at all.
func decodeBody(t *testing.T, r *http.Request, v any) string {
	t.Helper()
	b, err := io.ReadAll(r.Body)
	if err != nil {
		t.Error(err)
	}
	if err := json.Unmarshal(b, v); err != nil {
		t.Errorf("decoding %s body %q: %v", r.URL.Path, b, err)
	}
	return string(b)
}

func TestCreateProject(t *testing.T) {
	f, c := newFakeServer(t)
	var got api.CreateProjectRequest
	f.mux.HandleFunc("POST /v1/projects", func(w http.ResponseWriter, r *http.Request) {
		decodeBody(t, r, &got)
		writeJSON(w, 201, api.Project{ID: "p-1", Name: got.Name, Parent: got.Parent, Path: "root/" + got.Name, Quota: got.Quota, DedicatedNodes: got.DedicatedNodes})
	})
	req := api.CreateProjectRequest{Parent: "root", Name: "team-a", Quota: api.ProjectQuota{Sandboxes: 10, CPU: 4, MemoryMB: 8192, DiskMB: 1024}, DedicatedNodes: true}
	p, err := c.CreateProject(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, req) {
		t.Errorf("server got %+v, want %+v", got, req)
	}
	if p.ID != "p-1" || p.Path != "root/team-a" || p.Quota.Sandboxes != 10 || !p.DedicatedNodes {
		t.Errorf("project %+v", p)
	}
	last := f.last()
	if ct := last.Header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("Content-Type %q", ct)
	}
	// No Idempotency-Key: the server would keep the answer (see CreateProject).
	if k := last.Header.Get(HeaderIdempotencyKey); k != "" {
		t.Errorf("Idempotency-Key %q sent", k)
	}
	if _, err := c.CreateProject(context.Background(), api.CreateProjectRequest{Parent: "root"}); !errors.Is(err, ErrInvalid) {
		t.Errorf("no name: %v", err)
	}
}

func TestGetUpdateDeleteProject(t *testing.T) {
	f, c := newFakeServer(t)
	var gotID, gotBody, gotCascade string
	var gotQuery map[string][]string
	f.mux.HandleFunc("GET /v1/projects/{id}", func(w http.ResponseWriter, r *http.Request) {
		gotID = r.PathValue("id")
		writeJSON(w, 200, api.Project{ID: gotID, Usage: api.ProjectUsage{Sandboxes: 3, CPU: 1.5}})
	})
	f.mux.HandleFunc("PATCH /v1/projects/{id}", func(w http.ResponseWriter, r *http.Request) {
		gotID = r.PathValue("id")
		var req api.UpdateProjectRequest
		gotBody = decodeBody(t, r, &req)
		p := api.Project{ID: gotID}
		if req.Quota != nil {
			p.Quota = *req.Quota
		}
		if req.DedicatedNodes != nil {
			p.DedicatedNodes = *req.DedicatedNodes
		}
		writeJSON(w, 200, p)
	})
	f.mux.HandleFunc("DELETE /v1/projects/{id}", func(w http.ResponseWriter, r *http.Request) {
		gotID, gotCascade, gotQuery = r.PathValue("id"), r.URL.Query().Get("cascade"), r.URL.Query()
		w.WriteHeader(204)
	})
	ctx := context.Background()

	p, err := c.GetProject(ctx, "team a/b")
	if err != nil {
		t.Fatal(err)
	}
	if gotID != "team a/b" || p.Usage.Sandboxes != 3 || p.Usage.CPU != 1.5 {
		t.Errorf("server saw id %q; project %+v", gotID, p)
	}
	if uri := f.last().RequestURI; uri != "/v1/projects/team%20a%2Fb" {
		t.Errorf("RequestURI %q", uri)
	}

	// Only the fields given are sent.
	off := false
	p, err = c.UpdateProject(ctx, "p-1", api.UpdateProjectRequest{DedicatedNodes: &off})
	if err != nil {
		t.Fatal(err)
	}
	if gotBody != `{"dedicated_nodes":false}` || p.DedicatedNodes {
		t.Errorf("body %s, project %+v", gotBody, p)
	}
	p, err = c.UpdateProject(ctx, "p-1", api.UpdateProjectRequest{Quota: &api.ProjectQuota{Sandboxes: 5}})
	if err != nil {
		t.Fatal(err)
	}
	if gotBody != `{"quota":{"sandboxes":5,"cpu":0,"memory_mb":0,"disk_mb":0}}` || p.Quota.Sandboxes != 5 {
		t.Errorf("body %s, project %+v", gotBody, p)
	}

	if err := c.DeleteProject(ctx, "p-1", false); err != nil {
		t.Fatal(err)
	}
	if gotID != "p-1" || len(gotQuery) != 0 {
		t.Errorf("delete: id %q query %v", gotID, gotQuery)
	}
	if err := c.DeleteProject(ctx, "p-2", true); err != nil {
		t.Fatal(err)
	}
	if gotID != "p-2" || gotCascade != "true" {
		t.Errorf("cascade delete: id %q cascade %q", gotID, gotCascade)
	}

	// An empty id would address the collection: refused before any call.
	sent := func() int {
		f.mu.Lock()
		defer f.mu.Unlock()
		return len(f.seen)
	}
	n := sent()
	if _, err := c.GetProject(ctx, ""); !errors.Is(err, ErrInvalid) {
		t.Errorf("get empty id: %v", err)
	}
	if err := c.DeleteProject(ctx, "", true); !errors.Is(err, ErrInvalid) {
		t.Errorf("delete empty id: %v", err)
	}
	if err := c.RevokeKey(ctx, "p-1", ""); !errors.Is(err, ErrInvalid) {
		t.Errorf("revoke empty key id: %v", err)
	}
	if sent() != n {
		t.Errorf("%d requests sent for empty ids", sent()-n)
	}
}

func TestListProjectsPages(t *testing.T) {
	f, c := newFakeServer(t)
	var queries []string
	f.mux.HandleFunc("GET /v1/projects", func(w http.ResponseWriter, r *http.Request) {
		queries = append(queries, r.URL.RawQuery)
		if r.URL.Query().Get("parent") == "loop" {
			writeJSON(w, 200, api.ProjectList{Projects: []api.Project{{ID: "x"}}, NextPageToken: "same"})
			return
		}
		switch r.URL.Query().Get("page_token") {
		case "":
			writeJSON(w, 200, api.ProjectList{Projects: []api.Project{{ID: "a"}, {ID: "b"}}, NextPageToken: "t2"})
		case "t2":
			writeJSON(w, 200, api.ProjectList{Projects: []api.Project{{ID: "c"}}, NextPageToken: "t3"})
		case "t3":
			writeJSON(w, 200, api.ProjectList{Projects: []api.Project{{ID: "d"}}})
		}
	})
	ctx := context.Background()

	page, err := c.ListProjects(ctx, ProjectListOptions{Parent: "root", Limit: 2, PageToken: "t2"})
	if err != nil {
		t.Fatal(err)
	}
	if len(page.Projects) != 1 || page.NextPageToken != "t3" || queries[0] != "limit=2&page_token=t2&parent=root" {
		t.Errorf("page %+v, query %q", page, queries[0])
	}

	queries = nil
	all, err := c.ListAllProjects(ctx, "team-a")
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, p := range all {
		ids = append(ids, p.ID)
	}
	if strings.Join(ids, ",") != "a,b,c,d" {
		t.Errorf("ids %v", ids)
	}
	want := []string{"parent=team-a", "page_token=t2&parent=team-a", "page_token=t3&parent=team-a"}
	if !reflect.DeepEqual(queries, want) {
		t.Errorf("queries %q, want %q", queries, want)
	}

	// No parent: every project the caller can see, no parent parameter.
	queries = nil
	if _, err := c.ListAllProjects(ctx, ""); err != nil {
		t.Fatal(err)
	}
	if queries[0] != "" {
		t.Errorf("first query %q", queries[0])
	}

	// A server repeating its token is an error, not a loop.
	if _, err := c.ListAllProjects(ctx, "loop"); !errors.Is(err, ErrPrecondition) {
		t.Errorf("repeated token: %v", err)
	}
}

func TestKeys(t *testing.T) {
	f, c := newFakeServer(t)
	var got api.CreateKeyRequest
	var gotProject, gotKey string
	exp := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	f.mux.HandleFunc("POST /v1/projects/{id}/keys", func(w http.ResponseWriter, r *http.Request) {
		gotProject = r.PathValue("id")
		decodeBody(t, r, &got)
		writeJSON(w, 201, api.APIKey{ID: "k-1", Key: "dsec_SECRET", Project: gotProject, Role: got.Role, Name: got.Name, ExpiresAt: &exp})
	})
	f.mux.HandleFunc("GET /v1/projects/{id}/keys", func(w http.ResponseWriter, r *http.Request) {
		gotProject = r.PathValue("id")
		writeJSON(w, 200, api.KeyList{Keys: []api.APIKey{{ID: "k-1", Role: "member"}, {ID: "k-2", Role: "viewer"}}})
	})
	f.mux.HandleFunc("DELETE /v1/projects/{id}/keys/{key}", func(w http.ResponseWriter, r *http.Request) {
		gotProject, gotKey = r.PathValue("id"), r.PathValue("key")
		w.WriteHeader(204)
	})
	ctx := context.Background()

	k, err := c.CreateKey(ctx, "team-a", api.CreateKeyRequest{Role: "builder", Name: "ci", ExpiresIn: 3600})
	if err != nil {
		t.Fatal(err)
	}
	if gotProject != "team-a" || got != (api.CreateKeyRequest{Role: "builder", Name: "ci", ExpiresIn: 3600}) {
		t.Errorf("server saw project %q request %+v", gotProject, got)
	}
	if k.Key != "dsec_SECRET" || k.Role != "builder" || !k.ExpiresAt.Equal(exp) {
		t.Errorf("key %+v", k)
	}
	// No Idempotency-Key: a record would keep the secret.
	if h := f.last().Header.Get(HeaderIdempotencyKey); h != "" {
		t.Errorf("Idempotency-Key %q sent", h)
	}
	for _, bad := range []api.CreateKeyRequest{{}, {Role: "member", ExpiresIn: -1}} {
		if _, err := c.CreateKey(ctx, "team-a", bad); !errors.Is(err, ErrInvalid) {
			t.Errorf("CreateKey(%+v): %v", bad, err)
		}
	}

	keys, err := c.ListKeys(ctx, "team/a")
	if err != nil {
		t.Fatal(err)
	}
	if gotProject != "team/a" || len(keys) != 2 || keys[1].ID != "k-2" {
		t.Errorf("project %q keys %+v", gotProject, keys)
	}
	if err := c.RevokeKey(ctx, "team-a", "k/1"); err != nil {
		t.Fatal(err)
	}
	if gotProject != "team-a" || gotKey != "k/1" {
		t.Errorf("revoke: project %q key %q", gotProject, gotKey)
	}
	if uri := f.last().RequestURI; uri != "/v1/projects/team-a/keys/k%2F1" {
		t.Errorf("RequestURI %q", uri)
	}
}

func TestWhoAmIAndAudit(t *testing.T) {
	f, c := newFakeServer(t)
	var auditQuery string
	f.mux.HandleFunc("GET /v1/whoami", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, 200, api.WhoAmI{Principal: "k-1", Project: "team-a", Role: "member", Permissions: []string{"sandbox:read", "sandbox:write"}})
	})
	t0 := time.Date(2026, 5, 6, 7, 8, 9, 0, time.UTC)
	f.mux.HandleFunc("GET /v1/audit", func(w http.ResponseWriter, r *http.Request) {
		auditQuery = r.URL.RawQuery
		writeJSON(w, 200, api.AuditList{Entries: []api.AuditEntry{{Time: t0, Principal: "k-1", Project: "team-a", Action: "key.create", Target: "k-2"}}})
	})
	ctx := context.Background()

	who, err := c.WhoAmI(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if who.Project != "team-a" || who.Role != "member" || len(who.Permissions) != 2 {
		t.Errorf("whoami %+v", who)
	}

	since := time.Date(2026, 5, 6, 9, 8, 9, 700e6, time.FixedZone("x", 2*3600))
	entries, err := c.ListAudit(ctx, since, 50)
	if err != nil {
		t.Fatal(err)
	}
	// UTC, whole seconds rounded down: no entry after since is missed.
	if auditQuery != "limit=50&since=2026-05-06T07%3A08%3A09Z" {
		t.Errorf("query %q", auditQuery)
	}
	if len(entries) != 1 || entries[0].Action != "key.create" || !entries[0].Time.Equal(t0) {
		t.Errorf("entries %+v", entries)
	}
	if _, err := c.ListAudit(ctx, time.Time{}, 0); err != nil {
		t.Fatal(err)
	}
	if auditQuery != "" {
		t.Errorf("zero since and limit: query %q", auditQuery)
	}
}

// TestProjectErrors: the IAM calls' errors are classified like every
// other call's, a 429 quota_exceeded included.
func TestProjectErrors(t *testing.T) {
	f, c := newFakeServer(t)
	f.mux.HandleFunc("POST /v1/projects", func(w http.ResponseWriter, r *http.Request) {
		var req api.CreateProjectRequest
		decodeBody(t, r, &req)
		switch req.Name {
		case "big":
			writeErr(w, 429, "quota_exceeded", "project root/team-a: sandboxes 20 > 10")
		case "dup":
			writeErr(w, 409, "already_exists", "project dup exists")
		case "bare429":
			w.WriteHeader(429)
		}
	})
	f.mux.HandleFunc("GET /v1/projects/{id}", func(w http.ResponseWriter, r *http.Request) {
		writeErr(w, 404, "not_found", "project "+r.PathValue("id")+" not found")
	})
	f.mux.HandleFunc("POST /v1/projects/{id}/keys", func(w http.ResponseWriter, r *http.Request) {
		writeErr(w, 403, "permission_denied", "role member may not grant admin")
	})
	f.mux.HandleFunc("GET /v1/whoami", func(w http.ResponseWriter, r *http.Request) {
		writeErr(w, 401, "unauthenticated", "unknown key")
	})
	ctx := context.Background()
	create := func(name string) error {
		_, err := c.CreateProject(ctx, api.CreateProjectRequest{Parent: "root", Name: name})
		return err
	}
	tests := []struct {
		name   string
		err    error
		class  error
		status int
	}{
		{"quota", create("big"), ErrQuota, 429},
		{"quota without body", create("bare429"), ErrQuota, 429},
		{"exists", create("dup"), ErrAlreadyExists, 409},
		{"not found", func() error { _, err := c.GetProject(ctx, "nope"); return err }(), ErrNotFound, 404},
		{"denied", func() error {
			_, err := c.CreateKey(ctx, "team-a", api.CreateKeyRequest{Role: "admin"})
			return err
		}(), ErrPermissionDenied, 403},
		{"unauthenticated", func() error { _, err := c.WhoAmI(ctx); return err }(), ErrUnauthenticated, 401},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if !errors.Is(tt.err, tt.class) {
				t.Errorf("%v is not %v", tt.err, tt.class)
			}
			var de *Error
			if !errors.As(tt.err, &de) || de.Status != tt.status {
				t.Errorf("want *Error with status %d, got %T %v", tt.status, tt.err, tt.err)
			}
		})
	}
	var de *Error
	if !errors.As(tests[0].err, &de) || de.Code != "quota_exceeded" || !strings.Contains(de.Message, "sandboxes 20 > 10") {
		t.Errorf("quota error %v", tests[0].err)
	}
}

// TestProjectCreateNotResent: a create that reached a server which then
// failed is not sent again (it carries no Idempotency-Key), while a read
// is retried.
func TestProjectCreateNotResent(t *testing.T) {
	f, c := newFakeServer(t)
	var creates, gets atomic.Int32
	f.mux.HandleFunc("POST /v1/projects", func(w http.ResponseWriter, r *http.Request) {
		creates.Add(1)
		w.WriteHeader(502) // a gateway's answer: worth another try only if safe
	})
	f.mux.HandleFunc("GET /v1/projects/{id}", func(w http.ResponseWriter, r *http.Request) {
		if gets.Add(1) == 1 {
			w.WriteHeader(502)
			return
		}
		writeJSON(w, 200, api.Project{ID: r.PathValue("id")})
	})
	ctx := context.Background()
	if _, err := c.CreateProject(ctx, api.CreateProjectRequest{Parent: "root", Name: "a"}); !errors.Is(err, ErrUnavailable) {
		t.Errorf("create: %v", err)
	}
	if n := creates.Load(); n != 1 {
		t.Errorf("create sent %d times", n)
	}
	if _, err := c.GetProject(ctx, "a"); err != nil || gets.Load() != 2 {
		t.Errorf("get: %v after %d attempts", err, gets.Load())
	}
}
