package apiserver

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/dsecproject/dsec/api"
)

// mkProject makes project name under parent with the admin key.
func (f *fixture) mkProject(t *testing.T, key, parent, name, quota string) api.Project {
	t.Helper()
	if quota == "" {
		quota = "{}"
	}
	resp, body := f.do(t, key, "POST", "/v1/projects", fmt.Sprintf(`{"parent":%q,"name":%q,"quota":%s}`, parent, name, quota))
	if resp.StatusCode != 201 {
		t.Fatalf("creating project %s: %d %s", name, resp.StatusCode, body)
	}
	var p api.Project
	if err := json.Unmarshal(body, &p); err != nil {
		t.Fatal(err)
	}
	return p
}

// mkKey makes a key of role in project with key, and returns its secret
// and id.
func (f *fixture) mkKey(t *testing.T, key, project, role string) (string, string) {
	t.Helper()
	resp, body := f.do(t, key, "POST", "/v1/projects/"+project+"/keys", fmt.Sprintf(`{"role":%q,"name":"t"}`, role))
	if resp.StatusCode != 201 {
		t.Fatalf("creating a %s key in %s: %d %s", role, project, resp.StatusCode, body)
	}
	var k api.APIKey
	if err := json.Unmarshal(body, &k); err != nil || k.Key == "" || k.ID == "" {
		t.Fatalf("key answer: %s", body)
	}
	if resp.Header.Get("Cache-Control") != "no-store" {
		t.Errorf("a key's secret may be cached: Cache-Control %q", resp.Header.Get("Cache-Control"))
	}
	return k.Key, k.ID
}

// TestTenantsCannotSeeEachOther: two tenants' keys each see, drive and
// delete only their own project's sandboxes; another tenant's sandbox
// answers 404 to every call (no existence oracle) and is left out of
// lists and by-label calls; an ancestor's key sees both.
func TestTenantsCannotSeeEachOther(t *testing.T) {
	bothWays(t, func(t *testing.T, f *fixture) {
		f.mkProject(t, f.admin, "root", "team-a", "")
		f.mkProject(t, f.admin, "root", "team-b", "")
		keyA, _ := f.mkKey(t, f.admin, "team-a", "member")
		keyB, _ := f.mkKey(t, f.admin, "team-b", "member")

		resp, body := f.do(t, keyA, "POST", "/v1/sandboxes", `{"base":"base/py:1","labels":{"job":"j"}}`)
		if resp.StatusCode != 201 {
			t.Fatalf("create: %d %s", resp.StatusCode, body)
		}
		sbA := decodeSandbox(t, body)
		if sbA.Project != "team-a" {
			t.Fatalf("sandbox project %q, want team-a", sbA.Project)
		}
		for _, c := range []struct{ method, path, body string }{
			{"GET", "/v1/sandboxes/" + sbA.ID, ""},
			{"POST", "/v1/sandboxes/" + sbA.ID + "/exec", `{"argv":["true"]}`},
			{"POST", "/v1/sandboxes/" + sbA.ID + "/keepalive", `{}`},
			{"GET", "/v1/sandboxes/" + sbA.ID + "/stats", ""},
		} {
			resp, body := f.do(t, keyB, c.method, c.path, c.body)
			wantError(t, resp, body, 404, "not_found")
		}
		// A delete of another's sandbox is a no-op, as for a missing one.
		if resp, _ := f.do(t, keyB, "DELETE", "/v1/sandboxes/"+sbA.ID, ""); resp.StatusCode != 204 {
			t.Fatalf("delete by another tenant: %d", resp.StatusCode)
		}
		if resp, body := f.do(t, keyA, "GET", "/v1/sandboxes/"+sbA.ID, ""); resp.StatusCode != 200 {
			t.Fatalf("another tenant's delete removed it: %d %s", resp.StatusCode, body)
		}
		resp, body = f.do(t, keyB, "POST", "/v1/sandboxes:delete", `{"labels":{"job":"j"}}`)
		if resp.StatusCode != 200 || !strings.Contains(string(body), `"deleted":0`) {
			t.Fatalf("delete by labels by another tenant: %d %s", resp.StatusCode, body)
		}
		count := func(key string) int {
			t.Helper()
			resp, body := f.do(t, key, "GET", "/v1/sandboxes", "")
			var l api.SandboxList
			if resp.StatusCode != 200 || json.Unmarshal(body, &l) != nil {
				t.Fatalf("list: %d %s", resp.StatusCode, body)
			}
			return len(l.Sandboxes)
		}
		if n := count(keyB); n != 0 {
			t.Fatalf("team-b lists %d sandboxes", n)
		}
		if n := count(keyA); n != 1 {
			t.Fatalf("team-a lists %d sandboxes, want 1", n)
		}
		if n := count(f.admin); n != 1 {
			t.Fatalf("the root admin lists %d sandboxes, want 1", n)
		}
		// A key cannot place a sandbox in, or read, a project outside its scope.
		resp, body = f.do(t, keyA, "POST", "/v1/sandboxes", `{"base":"base/py:1","project":"team-b"}`)
		wantError(t, resp, body, 404, "not_found")
		resp, body = f.do(t, keyA, "GET", "/v1/projects/team-b", "")
		wantError(t, resp, body, 404, "not_found")
		// The root admin may place one in team-b; team-b then sees it.
		resp, body = f.do(t, f.admin, "POST", "/v1/sandboxes", `{"base":"base/py:1","project":"team-b"}`)
		if resp.StatusCode != 201 || decodeSandbox(t, body).Project != "team-b" {
			t.Fatalf("root admin creating in team-b: %d %s", resp.StatusCode, body)
		}
		if n := count(keyB); n != 1 {
			t.Fatalf("team-b lists %d sandboxes, want the one made for it", n)
		}
		// Usage is counted over the project and below.
		f.view.Sync(t.Context())
		resp, body = f.do(t, keyA, "GET", "/v1/projects/team-a", "")
		var pa api.Project
		if resp.StatusCode != 200 || json.Unmarshal(body, &pa) != nil || pa.Usage.Sandboxes != 1 || pa.Path != "root/team-a" {
			t.Fatalf("project view: %d %s", resp.StatusCode, body)
		}
	})
}

// TestRolesOnRoutes: members cannot manage projects or keys or publish
// layers, builders can publish but not manage, viewers only read; whoami
// says who one is.
func TestRolesOnRoutes(t *testing.T) {
	f := newFixture(t, false)
	f.mkProject(t, f.admin, "root", "job", "")
	member, _ := f.mkKey(t, f.admin, "job", "member")
	builder, _ := f.mkKey(t, f.admin, "job", "builder")
	viewer, _ := f.mkKey(t, f.admin, "job", "viewer")
	jobAdmin, _ := f.mkKey(t, f.admin, "job", "admin")

	resp, body := f.do(t, member, "GET", "/v1/whoami", "")
	var who api.WhoAmI
	if resp.StatusCode != 200 || json.Unmarshal(body, &who) != nil || who.Project != "job" || who.Role != "member" || len(who.Permissions) == 0 {
		t.Fatalf("whoami: %d %s", resp.StatusCode, body)
	}
	for _, c := range []struct {
		key, method, path, body string
		status                  int
	}{
		{member, "POST", "/v1/projects", `{"parent":"job","name":"sub"}`, 403},
		{member, "POST", "/v1/projects/job/keys", `{"role":"viewer"}`, 403},
		{member, "POST", "/v1/layers?ref=base/x:1", ``, 403},
		{builder, "POST", "/v1/projects/job/keys", `{"role":"viewer"}`, 403},
		{viewer, "POST", "/v1/sandboxes", `{"base":"base/py:1"}`, 403},
		{viewer, "GET", "/v1/sandboxes", ``, 200},
		{member, "GET", "/v1/audit", ``, 403},
		// An admin of job manages below it, not job itself or above.
		{jobAdmin, "POST", "/v1/projects/job/keys", `{"role":"admin"}`, 201},
		{jobAdmin, "PATCH", "/v1/projects/job", `{"quota":{"sandboxes":100000}}`, 403},
		{jobAdmin, "POST", "/v1/projects", `{"parent":"root","name":"sibling"}`, 404},
		{jobAdmin, "DELETE", "/v1/projects/job", ``, 403},
		{jobAdmin, "GET", "/v1/audit", ``, 200},
	} {
		resp, body := f.do(t, c.key, c.method, c.path, c.body)
		if resp.StatusCode != c.status {
			t.Errorf("%s %s as %s: %d %s, want %d", c.method, c.path, roleOf(t, f, c.key), resp.StatusCode, body, c.status)
		}
	}
	// A builder's snapshot passes the role check (the fake edge then
	// answers whatever it does); a member's does not.
	_, body = f.do(t, member, "POST", "/v1/sandboxes", `{"base":"base/py:1"}`)
	id := decodeSandbox(t, body).ID
	resp, body = f.do(t, member, "POST", "/v1/sandboxes/"+id+"/snapshot", `{"ref":"snapshot/s:1"}`)
	wantError(t, resp, body, 403, "permission_denied")
	if resp, body := f.do(t, builder, "POST", "/v1/sandboxes/"+id+"/snapshot", `{"ref":"snapshot/s:1"}`); resp.StatusCode == 403 {
		t.Fatalf("a builder may not snapshot: %s", body)
	}
}

func roleOf(t *testing.T, f *fixture, key string) string {
	p, err := f.iam.Authenticate(key)
	if err != nil {
		return "?"
	}
	return string(p.Role) + "@" + p.Project
}

// TestKeyRevocationAndProjectDelete: a revoked key stops working; a
// project with sandboxes is not deleted unless cascade, which deletes
// them and revokes the project's keys; every step is in the audit log.
func TestKeyRevocationAndProjectDelete(t *testing.T) {
	f := newFixture(t, true)
	f.mkProject(t, f.admin, "root", "team", `{"sandboxes":10}`)
	k1, id1 := f.mkKey(t, f.admin, "team", "member")
	k2, _ := f.mkKey(t, f.admin, "team", "member")
	if resp, _ := f.do(t, f.admin, "DELETE", "/v1/projects/team/keys/"+id1, ""); resp.StatusCode != 204 {
		t.Fatalf("revoke: %d", resp.StatusCode)
	}
	resp, body := f.do(t, k1, "GET", "/v1/sandboxes", "")
	wantError(t, resp, body, 401, "unauthenticated")
	resp, body = f.do(t, f.admin, "DELETE", "/v1/projects/other/keys/"+id1, "")
	if resp.StatusCode != 404 {
		t.Fatalf("revoking in a missing project: %d %s", resp.StatusCode, body)
	}

	_, body = f.do(t, k2, "POST", "/v1/sandboxes", `{"base":"base/py:1"}`)
	sb := decodeSandbox(t, body)
	resp, body = f.do(t, f.admin, "DELETE", "/v1/projects/team", "")
	wantError(t, resp, body, 409, "failed_precondition")
	if resp, body := f.do(t, f.admin, "DELETE", "/v1/projects/team?cascade=true", ""); resp.StatusCode != 204 {
		t.Fatalf("cascade delete: %d %s", resp.StatusCode, body)
	}
	if resp, _ := f.do(t, f.admin, "GET", "/v1/sandboxes/"+sb.ID, ""); resp.StatusCode != 404 {
		t.Fatalf("the project's sandbox survived its cascade delete: %d", resp.StatusCode)
	}
	resp, body = f.do(t, k2, "GET", "/v1/whoami", "")
	wantError(t, resp, body, 401, "unauthenticated")

	f.do(t, f.admin, "POST", "/v1/sandboxes:delete", `{"labels":{"job":"x"}}`)
	resp, body = f.do(t, f.admin, "GET", "/v1/audit", "")
	var al api.AuditList
	if resp.StatusCode != http.StatusOK || json.Unmarshal(body, &al) != nil {
		t.Fatalf("audit: %d %s", resp.StatusCode, body)
	}
	var actions []string
	for _, e := range al.Entries {
		actions = append(actions, e.Action+":"+e.Target)
	}
	got := strings.Join(actions, " ")
	for _, want := range []string{"project.create:team", "key.create:" + id1, "key.revoke:" + id1, "project.delete:team", "sandboxes:delete:job=x"} {
		if !strings.Contains(got, want) {
			t.Errorf("audit log %q lacks %s", got, want)
		}
	}
}

// TestEveryRouteDeclaresItsPermission: a route registered without a
// permission would let any key call it. Only the documented exceptions
// (the API description, whoami, the JSON 404 for unknown paths) may.
func TestEveryRouteDeclaresItsPermission(t *testing.T) {
	f := newFixture(t, false)
	s := New(Deps{IAM: f.iam, Layers: f.layers, Nodes: f.view})
	open := map[string]bool{"GET /v1/openapi.yaml": true, "GET /v1/whoami": true, "/v1/": true}
	if len(s.actions) < 40 {
		t.Fatalf("only %d routes recorded", len(s.actions))
	}
	for pattern, action := range s.actions {
		if action == "" && !open[pattern] {
			t.Errorf("route %s has no permission", pattern)
		}
	}
}

// TestLayersOfTenants: a key sees the layers of its project, of those
// above it (root's base is everyone's) and below it, and no other
// tenant's: not in lists, not by ref, not as a layer of a new sandbox;
// it may delete only its own project's (and below).
func TestLayersOfTenants(t *testing.T) {
	f := newFixture(t, false)
	f.mkProject(t, f.admin, "root", "team-a", "")
	f.mkProject(t, f.admin, "root", "team-b", "")
	for _, l := range []api.Layer{
		{Digest: fmt.Sprintf("sha256:%064x", 11), Ref: "toolkit/a:1", Kind: "toolkit", Project: "team-a"},
		{Digest: fmt.Sprintf("sha256:%064x", 12), Ref: "toolkit/b:1", Kind: "toolkit", Project: "team-b"},
	} {
		b, _ := json.Marshal(l)
		if err := f.st.Put("layers", l.Ref, b); err != nil {
			t.Fatal(err)
		}
	}
	a, _ := f.mkKey(t, f.admin, "team-a", "builder")
	refs := func(key string) string {
		t.Helper()
		resp, body := f.do(t, key, "GET", "/v1/layers", "")
		var l api.LayerList
		if resp.StatusCode != 200 || json.Unmarshal(body, &l) != nil {
			t.Fatalf("list layers: %d %s", resp.StatusCode, body)
		}
		var out []string
		for _, x := range l.Layers {
			out = append(out, x.Ref)
		}
		return strings.Join(out, ",")
	}
	if got := refs(a); strings.Contains(got, "toolkit/b:1") || !strings.Contains(got, "toolkit/a:1") || !strings.Contains(got, "base/py:1") {
		t.Fatalf("team-a sees layers %s", got)
	}
	if got := refs(f.admin); !strings.Contains(got, "toolkit/b:1") || !strings.Contains(got, "toolkit/a:1") {
		t.Fatalf("the root admin sees layers %s", got)
	}
	resp, body := f.do(t, a, "GET", "/v1/layers/toolkit/b:1", "")
	wantError(t, resp, body, 404, "not_found")
	resp, body = f.do(t, a, "POST", "/v1/sandboxes", `{"base":"base/py:1","toolkits":["toolkit/b:1"]}`)
	wantError(t, resp, body, 404, "not_found")
	if resp, body := f.do(t, a, "POST", "/v1/sandboxes", `{"base":"base/py:1","toolkits":["toolkit/a:1"]}`); resp.StatusCode != 201 {
		t.Fatalf("a sandbox on its own toolkit: %d %s", resp.StatusCode, body)
	}
	resp, body = f.do(t, a, "DELETE", "/v1/layers/toolkit/b:1", "")
	wantError(t, resp, body, 404, "not_found")
	resp, body = f.do(t, a, "DELETE", "/v1/layers/base/py:1", "")
	wantError(t, resp, body, 403, "permission_denied")
}

// TestPageLimits: a list's limit is 1 to 1000; anything else is refused
// before anything is read.
func TestPageLimits(t *testing.T) {
	f := newFixture(t, false)
	for _, path := range []string{"/v1/projects?limit=0", "/v1/projects?limit=1001", "/v1/projects?limit=x", "/v1/audit?limit=-1", "/v1/audit?limit=5000"} {
		resp, body := f.do(t, f.admin, "GET", path, "")
		wantError(t, resp, body, 400, "invalid_argument")
	}
	for _, path := range []string{"/v1/projects?limit=1", "/v1/audit?limit=1000"} {
		if resp, body := f.do(t, f.admin, "GET", path, ""); resp.StatusCode != 200 {
			t.Errorf("%s: %d %s", path, resp.StatusCode, body)
		}
	}
}

// TestNodesShowOnlyTheCallersTenancy: GET /v1/nodes tells a key below the
// root its own subtree's usage and nothing of other tenants (projects,
// jobs, dedicated projects, layers, the internal address); the root's
// keys see it all.
func TestNodesShowOnlyTheCallersTenancy(t *testing.T) {
	f := newFixture(t, false)
	f.mkProject(t, f.admin, "root", "team-a", "")
	f.mkProject(t, f.admin, "root", "team-b", "")
	keyA, _ := f.mkKey(t, f.admin, "team-a", "viewer")
	keyB, _ := f.mkKey(t, f.admin, "team-b", "member")
	if resp, body := f.do(t, keyB, "POST", "/v1/sandboxes", `{"base":"base/py:1"}`); resp.StatusCode != 201 {
		t.Fatalf("create: %d %s", resp.StatusCode, body)
	}
	f.view.Sync(t.Context())
	projects := func(key string) map[string]api.ProjectUsage {
		resp, body := f.do(t, key, "GET", "/v1/nodes", "")
		var l api.NodeList
		if resp.StatusCode != 200 || json.Unmarshal(body, &l) != nil || len(l.Nodes) != 1 {
			t.Fatalf("nodes: %d %s", resp.StatusCode, body)
		}
		return l.Nodes[0].Projects
	}
	if p := projects(f.admin); p["root/team-b"].Sandboxes != 1 {
		t.Fatalf("the root's admin sees %v", p)
	}
	if p := projects(keyA); len(p) != 0 {
		t.Fatalf("team-a sees %v", p)
	}
	if p := projects(keyB); len(p) != 1 || p["root/team-b"].Sandboxes != 1 {
		t.Fatalf("team-b sees %v", p)
	}

	n := api.Node{Name: "n1", Healthy: true, Capacity: api.Capacity{MaxSandboxes: 9}, Counts: map[string]int{"running": 4},
		Projects: map[string]api.ProjectUsage{"root": {Sandboxes: 1}, "root/team-a": {Sandboxes: 1},
			"root/team-a/x": {Sandboxes: 1}, "root/team-ab": {Sandboxes: 1}},
		Jobs: map[string]int{"secret-job": 1}, Layers: []string{"sha256:aa"}, Address: "10.0.0.21:7071", DedicatedTo: "root/team-ab"}
	v := tenantView(n, "root/team-a")
	if len(v.Projects) != 2 || v.Projects["root/team-a/x"].Sandboxes != 1 || v.Projects["root/team-a"].Sandboxes != 1 ||
		v.Jobs != nil || v.Layers != nil || v.Address != "" || v.DedicatedTo != "" || v.Capacity.MaxSandboxes != 9 || v.Counts["running"] != 4 {
		t.Fatalf("team-a's view %+v", v)
	}
	n.DedicatedTo = "root/team-a/x"
	if v := tenantView(n, "root/team-a"); v.DedicatedTo != "root/team-a/x" {
		t.Fatalf("a node dedicated to team-a's subtree: %+v", v)
	}
}
