package apiserver

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/iam"
	"github.com/dsecproject/dsec/internal/sandbox"
)

// e2bFixture is the fixture with an apiserver whose default E2B
// template is def ("" for none).
func e2bFixture(t *testing.T, wire bool, def string) *fixture {
	t.Helper()
	f := newFixture(t, wire)
	f.srv = f.apiserverWith(t, "a", func(d *Deps) { d.E2BDefaultTemplate = def })
	return f
}

// e2b sends an E2B control-plane request with key in X-API-KEY, as the
// E2B SDK does.
func (f *fixture) e2b(t *testing.T, key, method, path, body string) (*http.Response, []byte) {
	t.Helper()
	req, _ := http.NewRequest(method, f.srv.URL+path, strings.NewReader(body))
	if key != "" {
		req.Header.Set("X-API-KEY", key)
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, b
}

// wantE2BError checks an answer of status in E2B's error shape, and
// returns its message.
func wantE2BError(t *testing.T, resp *http.Response, body []byte, status int) string {
	t.Helper()
	var e struct {
		Code    int    `json:"code"`
		Message string `json:"message"`
	}
	if resp.StatusCode != status || json.Unmarshal(body, &e) != nil || e.Code != status || e.Message == "" {
		t.Fatalf("got %d %s, want %d in E2B's error shape", resp.StatusCode, body, status)
	}
	return e.Message
}

type e2bCreated struct {
	SandboxID       string `json:"sandboxID"`
	TemplateID      string `json:"templateID"`
	Alias           string `json:"alias"`
	ClientID        string `json:"clientID"`
	EnvdVersion     string `json:"envdVersion"`
	EnvdAccessToken string `json:"envdAccessToken"`
}

func (f *fixture) e2bCreate(t *testing.T, key, body string) e2bCreated {
	t.Helper()
	resp, b := f.e2b(t, key, "POST", "/v2/sandboxes", body)
	if resp.StatusCode != 201 {
		t.Fatalf("create %s: %d %s", body, resp.StatusCode, b)
	}
	var c e2bCreated
	if err := json.Unmarshal(b, &c); err != nil || c.SandboxID == "" {
		t.Fatalf("create answer %s", b)
	}
	return c
}

// stored is the edge's record of sandbox id.
func (f *fixture) stored(t *testing.T, id string) *api.Sandbox {
	t.Helper()
	sb, err := f.edge.Get(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	return sb
}

func TestE2BCreate(t *testing.T) {
	bothWays(t, func(t *testing.T, f *fixture) {
		// Fields dsec does not use (secure, mcp, autoResume) are no error.
		c := f.e2bCreate(t, f.admin, `{"templateID":"base/py:1","timeout":120,"metadata":{"job":"j1"},"envVars":{"A":"b"},
			"secure":true,"mcp":null,"autoResume":{"enabled":false},"allow_internet_access":true}`)
		if c.TemplateID != "base/py:1" || c.Alias != "" || c.ClientID != "n1" || c.EnvdVersion != e2bEnvdVersion {
			t.Fatalf("answer %+v", c)
		}
		want, err := New(Deps{IAM: f.iam, Layers: f.layers, Nodes: f.view, Store: f.st}).envdToken(c.SandboxID)
		if err != nil || c.EnvdAccessToken != want {
			t.Fatalf("envdAccessToken %q, want the sandbox's token %q (%v)", c.EnvdAccessToken, want, err)
		}
		sb := f.stored(t, c.SandboxID)
		spec := sb.Spec
		if spec.Base != "base/py:1" || spec.TTL != 120 || spec.Env["A"] != "b" {
			t.Fatalf("spec %+v", spec)
		}
		if sb.Labels["job"] != "j1" || sb.Labels[e2bTemplateLabel] != "base/py:1" {
			t.Fatalf("labels %v", sb.Labels)
		}
		if spec.Network == nil || !slices.Equal(spec.Network.Allow, []string{"0.0.0.0/0", "*"}) || len(spec.Network.Deny) != 0 {
			t.Fatalf("internet access: network %+v", spec.Network)
		}
		if exp := sb.ExpiresAt; exp == nil || exp.Sub(sb.CreatedAt) != 120*time.Second {
			t.Fatalf("expires %v, created %v", exp, sb.CreatedAt)
		}
		// Nothing said about the network: dsec's default, loopback only.
		c = f.e2bCreate(t, f.admin, `{"templateID":"base/py:1"}`)
		if sb := f.stored(t, c.SandboxID); sb.Spec.Network != nil || sb.Spec.TTL != sandbox.DefaultPolicy().DefaultTTL {
			t.Fatalf("defaults: network %+v, ttl %d", sb.Spec.Network, sb.Spec.TTL)
		}
		// As much metadata as fits beside the template's label (63 of 64),
		// and one entry more is a clear 400, not the edge's count of 65.
		metadata := func(n int) string {
			m := map[string]string{}
			for i := range n {
				m[fmt.Sprintf("m%02d", i)] = "v"
			}
			b, _ := json.Marshal(m)
			return string(b)
		}
		c = f.e2bCreate(t, f.admin, `{"templateID":"base/py:1","metadata":`+metadata(63)+`}`)
		if sb := f.stored(t, c.SandboxID); len(sb.Labels) != 64 {
			t.Fatalf("%d labels, want the 63 metadata and the template's", len(sb.Labels))
		}

		for _, tc := range []struct {
			body   string
			status int
			msg    string
		}{
			{`{"templateID":"nope"}`, 404, "template nope not found"},
			{`{"templateID":"base/nope:1"}`, 404, "template base/nope:1 not found"},
			{`{"templateID":"workspace/w:1"}`, 400, "is a workspace layer"},
			{`{"templateID":"base/py:1","metadata":{"bad key!":"x"}}`, 400, "label key"},
			{`{"templateID":"base/py:1","metadata":{"k":"two words"}}`, 400, "invalid value"},
			{`{"templateID":"base/py:1","metadata":{"e2b.template":"x"}}`, 400, "reserved"},
			{`{"templateID":"base/py:1","metadata":` + metadata(64) + `}`, 400, "at most 63 metadata entries"},
			{`{"templateID":"base/py:1","envVars":{"1A":"x"}}`, 400, "environment variable"},
			{`{"templateID":"base/py:1","timeout":-1}`, 400, "timeout"},
			{`{"templateID":"base/py:1","timeout":99999999}`, 400, "ttl"},
			{`{"templateID":"base/py:1","autoPause":true}`, 400, "autoPause"},
			{`{"templateID":"base/py:1","network":{"egressProxy":{"address":"p:1080"}}}`, 400, "egressProxy"},
			{`{"templateID":"base/py:1"`, 400, "malformed JSON"},
			{`[1]`, 400, "must be"},
			{``, 400, "empty"},
		} {
			resp, body := f.e2b(t, f.admin, "POST", "/v2/sandboxes", tc.body)
			if msg := wantE2BError(t, resp, body, tc.status); !strings.Contains(msg, tc.msg) {
				t.Errorf("%s: message %q, want it to say %q", tc.body, msg, tc.msg)
			}
		}
		if n := f.edge.Len(); n != 3 {
			t.Fatalf("the edge holds %d sandboxes, want the 3 good ones", n)
		}
	})
}

func TestE2BTemplates(t *testing.T) {
	// A snapshot layer in the catalog, on base/py:1.
	snapshot := func(f *fixture) {
		b, _ := json.Marshal(api.Layer{Digest: fmt.Sprintf("sha256:%064x", 9), Ref: "snapshot/s:1", Kind: api.KindSnapshot,
			Snapshot: &api.SnapshotInfo{Layers: []string{f.digests["base/py:1"]}, Spec: api.SandboxSpec{Base: "base/py:1"}}})
		if err := f.st.Put("layers", "snapshot/s:1", b); err != nil {
			t.Fatal(err)
		}
	}
	t.Run("alias", func(t *testing.T) {
		f := e2bFixture(t, false, "")
		resp, body := f.do(t, f.admin, "POST", "/v1/templates",
			`{"name":"py","base":"base/py:1","workspace":"workspace/w:1","toolkits":["toolkit/t:1"],"user":"nobody"}`)
		if resp.StatusCode != 201 {
			t.Fatalf("alias: %d %s", resp.StatusCode, body)
		}
		c := f.e2bCreate(t, f.admin, `{"templateID":"py"}`)
		if c.TemplateID != "py" || c.Alias != "py" {
			t.Fatalf("answer %+v", c)
		}
		sb := f.stored(t, c.SandboxID)
		if s := sb.Spec; s.Base != "base/py:1" || s.Workspace != "workspace/w:1" || !slices.Equal(s.Toolkits, []string{"toolkit/t:1"}) || s.User != "nobody" {
			t.Fatalf("spec %+v", s)
		}
		if len(sb.Layers) != 3 {
			t.Fatalf("layers %v", sb.Layers)
		}
		snapshot(f)
		c = f.e2bCreate(t, f.admin, `{"templateID":"snapshot/s:1"}`)
		if sb := f.stored(t, c.SandboxID); sb.Spec.Snapshot != "snapshot/s:1" || len(sb.Layers) != 2 {
			t.Fatalf("from a snapshot: %+v", sb)
		}
		resp, body = f.e2b(t, f.admin, "GET", "/templates/aliases/py", "")
		if resp.StatusCode != 200 || !strings.Contains(string(body), `"templateID":"py"`) {
			t.Fatalf("alias exists: %d %s", resp.StatusCode, body)
		}
		resp, body = f.e2b(t, f.admin, "GET", "/templates/aliases/nope", "")
		wantE2BError(t, resp, body, 404)
	})
	t.Run("no default", func(t *testing.T) {
		f := e2bFixture(t, false, "")
		resp, body := f.e2b(t, f.admin, "POST", "/v2/sandboxes", `{}`)
		if msg := wantE2BError(t, resp, body, 404); !strings.Contains(msg, "--e2b-default-template") || !strings.Contains(msg, "template base not found") {
			t.Fatalf("message %q", msg)
		}
	})
	t.Run("default", func(t *testing.T) {
		f := e2bFixture(t, true, "base/py:1")
		c := f.e2bCreate(t, f.admin, `{"templateID":"base"}`)
		if c.TemplateID != "base" || f.stored(t, c.SandboxID).Spec.Base != "base/py:1" {
			t.Fatalf("default template: %+v %+v", c, f.stored(t, c.SandboxID).Spec)
		}
		// An alias named base wins over the default.
		if resp, body := f.do(t, f.admin, "POST", "/v1/templates", `{"name":"base","base":"base/py:1","toolkits":["toolkit/t:1"]}`); resp.StatusCode != 201 {
			t.Fatalf("alias base: %d %s", resp.StatusCode, body)
		}
		c = f.e2bCreate(t, f.admin, `{}`)
		if s := f.stored(t, c.SandboxID).Spec; c.TemplateID != "base" || !slices.Equal(s.Toolkits, []string{"toolkit/t:1"}) {
			t.Fatalf("alias base: %+v %+v", c, s)
		}
	})
	t.Run("default missing", func(t *testing.T) {
		f := e2bFixture(t, false, "base/debian:12")
		resp, body := f.e2b(t, f.admin, "POST", "/v2/sandboxes", `{}`)
		if msg := wantE2BError(t, resp, body, 404); !strings.Contains(msg, "base/debian:12") || !strings.Contains(msg, "--e2b-default-template") {
			t.Fatalf("message %q", msg)
		}
	})
	t.Run("default is an alias", func(t *testing.T) {
		f := e2bFixture(t, false, "py")
		if resp, body := f.do(t, f.admin, "POST", "/v1/templates", `{"name":"py","base":"base/py:1","workspace":"workspace/w:1"}`); resp.StatusCode != 201 {
			t.Fatalf("alias: %d %s", resp.StatusCode, body)
		}
		c := f.e2bCreate(t, f.admin, `{}`)
		if s := f.stored(t, c.SandboxID).Spec; s.Workspace != "workspace/w:1" {
			t.Fatalf("spec %+v", s)
		}
	})
}

func TestTemplateAliases(t *testing.T) {
	bothWays(t, func(t *testing.T, f *fixture) {
		resp, body := f.do(t, f.admin, "POST", "/v1/templates", `{"name":"py","base":"base/py:1","toolkits":["toolkit/t:1"]}`)
		if resp.StatusCode != 201 {
			t.Fatalf("create: %d %s", resp.StatusCode, body)
		}
		var tpl api.Template
		if err := json.Unmarshal(body, &tpl); err != nil || tpl.Name != "py" || tpl.Project != "root" || tpl.CreatedAt.IsZero() {
			t.Fatalf("answer %s", body)
		}
		for _, tc := range []struct {
			body   string
			status int
			code   string
		}{
			{`{"name":"py","base":"base/py:1"}`, 409, "already_exists"},
			{`{"name":"Bad/Name","base":"base/py:1"}`, 400, "invalid_argument"},
			{`{"name":"-x","base":"base/py:1"}`, 400, "invalid_argument"},
			{`{"name":"x"}`, 400, "invalid_argument"},
			{`{"name":"x","base":"base/nope:1"}`, 404, "not_found"},
			{`{"name":"x","base":"workspace/w:1"}`, 400, "invalid_argument"},
			{`{"name":"x","base":"base/py:1","workspace":"toolkit/t:1"}`, 400, "invalid_argument"},
			{`{"name":"x","base":"base/py:1","user":"Bad User"}`, 400, "invalid_argument"},
			{`{"name":"x","base":"base/py:1","extra":1}`, 400, "invalid_argument"},
		} {
			resp, body := f.do(t, f.admin, "POST", "/v1/templates", tc.body)
			wantError(t, resp, body, tc.status, tc.code)
		}
		// A viewer reads aliases but makes and removes none.
		resp, body = f.do(t, f.viewer, "GET", "/v1/templates", "")
		var l api.TemplateList
		if resp.StatusCode != 200 || json.Unmarshal(body, &l) != nil || len(l.Templates) != 1 || l.Templates[0].Name != "py" {
			t.Fatalf("list: %d %s", resp.StatusCode, body)
		}
		if resp, body := f.do(t, f.viewer, "GET", "/v1/templates/py", ""); resp.StatusCode != 200 || !strings.Contains(string(body), `"toolkit/t:1"`) {
			t.Fatalf("get: %d %s", resp.StatusCode, body)
		}
		resp, body = f.do(t, f.viewer, "POST", "/v1/templates", `{"name":"v","base":"base/py:1"}`)
		wantError(t, resp, body, 403, "permission_denied")
		resp, body = f.do(t, f.viewer, "DELETE", "/v1/templates/py", "")
		wantError(t, resp, body, 403, "permission_denied")
		resp, body = f.do(t, f.admin, "GET", "/v1/templates/nope", "")
		wantError(t, resp, body, 404, "not_found")

		if resp, body := f.do(t, f.admin, "DELETE", "/v1/templates/py", ""); resp.StatusCode != 204 {
			t.Fatalf("delete: %d %s", resp.StatusCode, body)
		}
		resp, body = f.do(t, f.admin, "DELETE", "/v1/templates/py", "")
		wantError(t, resp, body, 404, "not_found")
		resp, body = f.e2b(t, f.admin, "POST", "/v2/sandboxes", `{"templateID":"py"}`)
		wantE2BError(t, resp, body, 404)
	})
}

// TestTemplateAliasesOfTenants: an alias is seen as a layer of its
// project is; another tenant can neither use it nor remove it.
func TestTemplateAliasesOfTenants(t *testing.T) {
	f := newFixture(t, false)
	f.mkProject(t, f.admin, "root", "team-a", "")
	f.mkProject(t, f.admin, "root", "team-b", "")
	builderA, _ := f.mkKey(t, f.admin, "team-a", "builder")
	memberA, _ := f.mkKey(t, f.admin, "team-a", "member")
	builderB, _ := f.mkKey(t, f.admin, "team-b", "builder")
	resp, body := f.do(t, memberA, "POST", "/v1/templates", `{"name":"ta","base":"base/py:1"}`)
	wantError(t, resp, body, 403, "permission_denied")
	if resp, body := f.do(t, builderA, "POST", "/v1/templates", `{"name":"ta","base":"base/py:1"}`); resp.StatusCode != 201 {
		t.Fatalf("create: %d %s", resp.StatusCode, body)
	}
	if resp, body := f.do(t, builderB, "GET", "/v1/templates", ""); resp.StatusCode != 200 || strings.Contains(string(body), `"ta"`) {
		t.Fatalf("team-b lists: %d %s", resp.StatusCode, body)
	}
	resp, body = f.do(t, builderB, "GET", "/v1/templates/ta", "")
	wantError(t, resp, body, 404, "not_found")
	resp, body = f.do(t, builderB, "DELETE", "/v1/templates/ta", "")
	wantError(t, resp, body, 404, "not_found")
	resp, body = f.e2b(t, builderB, "POST", "/v2/sandboxes", `{"templateID":"ta"}`)
	wantE2BError(t, resp, body, 404)
	// Its own project's members use it; the root's admin sees it.
	c := f.e2bCreate(t, memberA, `{"templateID":"ta"}`)
	if sb := f.stored(t, c.SandboxID); sb.Project != "team-a" {
		t.Fatalf("sandbox project %q", sb.Project)
	}
	if resp, body := f.do(t, f.admin, "GET", "/v1/templates/ta", ""); resp.StatusCode != 200 || !strings.Contains(string(body), `"project":"team-a"`) {
		t.Fatalf("admin get: %d %s", resp.StatusCode, body)
	}
}

// TestE2BFirstVersionCreateAndConnect: the create and connect that E2B's
// Python SDK and older JS SDKs call (without /v2) are the same calls.
func TestE2BFirstVersionCreateAndConnect(t *testing.T) {
	f := newFixture(t, false)
	resp, body := f.e2b(t, f.admin, "POST", "/sandboxes", `{"templateID":"base/py:1","timeout":120,"metadata":{"job":"j1"}}`)
	var c e2bCreated
	if resp.StatusCode != 201 || json.Unmarshal(body, &c) != nil || c.SandboxID == "" || c.TemplateID != "base/py:1" || c.EnvdAccessToken == "" {
		t.Fatalf("create: %d %s", resp.StatusCode, body)
	}
	if sb := f.stored(t, c.SandboxID); sb.Spec.TTL != 120 || sb.Labels["job"] != "j1" {
		t.Fatalf("created %+v, labels %v", sb.Spec, sb.Labels)
	}
	resp, body = f.e2b(t, f.admin, "POST", "/sandboxes", `{"templateID":"base/nope:1"}`)
	wantE2BError(t, resp, body, 404)
	resp, body = f.e2b(t, f.viewer, "POST", "/sandboxes", `{"templateID":"base/py:1"}`)
	wantE2BError(t, resp, body, 403)

	if resp, body := f.e2b(t, f.admin, "POST", "/sandboxes/"+c.SandboxID+"/pause", `{}`); resp.StatusCode != 204 {
		t.Fatalf("pause: %d %s", resp.StatusCode, body)
	}
	resp, body = f.e2b(t, f.admin, "POST", "/sandboxes/"+c.SandboxID+"/connect", `{"timeout":600}`)
	var got e2bCreated
	if resp.StatusCode != 201 || json.Unmarshal(body, &got) != nil || got.SandboxID != c.SandboxID || got.EnvdAccessToken != c.EnvdAccessToken {
		t.Fatalf("connect to the paused sandbox: %d %s", resp.StatusCode, body)
	}
	if st := f.stored(t, c.SandboxID).State; st != api.StateRunning {
		t.Fatalf("after connect: %s", st)
	}
	if resp, body := f.e2b(t, f.admin, "POST", "/sandboxes/"+c.SandboxID+"/connect", `{"timeout":600}`); resp.StatusCode != 200 {
		t.Fatalf("connect to the running sandbox: %d %s", resp.StatusCode, body)
	}
	resp, body = f.e2b(t, f.viewer, "POST", "/sandboxes/"+c.SandboxID+"/connect", `{}`)
	wantE2BError(t, resp, body, 403)
	resp, body = f.e2b(t, f.admin, "POST", "/sandboxes/sb-n1-nope/connect", `{}`)
	wantE2BError(t, resp, body, 404)
	if n := f.edge.Len(); n != 1 {
		t.Fatalf("the edge holds %d sandboxes, want 1", n)
	}
}

func TestE2BConnectPauseKill(t *testing.T) {
	bothWays(t, func(t *testing.T, f *fixture) {
		c := f.e2bCreate(t, f.admin, `{"templateID":"base/py:1","timeout":60}`)
		id := c.SandboxID
		if resp, body := f.e2b(t, f.admin, "POST", "/sandboxes/"+id+"/pause", `{}`); resp.StatusCode != 204 {
			t.Fatalf("pause: %d %s", resp.StatusCode, body)
		}
		if st := f.stored(t, id).State; st != api.StatePaused {
			t.Fatalf("state after pause %s", st)
		}
		resp, body := f.e2b(t, f.admin, "POST", "/sandboxes/"+id+"/pause", `{"memory":true}`)
		wantE2BError(t, resp, body, 409)

		// Connect resumes (201) and extends the timeout.
		resp, body = f.e2b(t, f.admin, "POST", "/v2/sandboxes/"+id+"/connect", `{"timeout":7200}`)
		var got e2bCreated
		if resp.StatusCode != 201 || json.Unmarshal(body, &got) != nil || got.SandboxID != id || got.EnvdAccessToken != c.EnvdAccessToken || got.EnvdVersion == "" {
			t.Fatalf("connect paused: %d %s", resp.StatusCode, body)
		}
		sb := f.stored(t, id)
		if sb.State != api.StateRunning || sb.ExpiresAt == nil || time.Until(*sb.ExpiresAt) < 7190*time.Second {
			t.Fatalf("after connect: state %s, expires %v", sb.State, sb.ExpiresAt)
		}
		// Connect to a running one is 200, and does not shorten its life.
		resp, body = f.e2b(t, f.admin, "POST", "/v2/sandboxes/"+id+"/connect", `{"timeout":10}`)
		if resp.StatusCode != 200 {
			t.Fatalf("connect running: %d %s", resp.StatusCode, body)
		}
		if exp := f.stored(t, id).ExpiresAt; time.Until(*exp) < 7190*time.Second {
			t.Fatalf("connect shortened the life to %v", exp)
		}
		if resp, body := f.e2b(t, f.admin, "POST", "/v2/sandboxes/"+id+"/connect", ""); resp.StatusCode != 200 {
			t.Fatalf("connect without a body: %d %s", resp.StatusCode, body)
		}

		// The older SDKs' resume: 409 while running, 201 from paused.
		resp, body = f.e2b(t, f.admin, "POST", "/sandboxes/"+id+"/resume", `{}`)
		wantE2BError(t, resp, body, 409)
		if resp, body := f.e2b(t, f.admin, "POST", "/sandboxes/"+id+"/pause", `{}`); resp.StatusCode != 204 {
			t.Fatalf("pause: %d %s", resp.StatusCode, body)
		}
		if resp, body := f.e2b(t, f.admin, "POST", "/sandboxes/"+id+"/resume", `{"timeout":7200}`); resp.StatusCode != 201 || f.stored(t, id).State != api.StateRunning {
			t.Fatalf("resume of a paused sandbox: %d %s", resp.StatusCode, body)
		}

		// setTimeout sets the life from now, shorter too.
		if resp, body := f.e2b(t, f.admin, "POST", "/sandboxes/"+id+"/timeout", `{"timeout":600}`); resp.StatusCode != 204 {
			t.Fatalf("timeout: %d %s", resp.StatusCode, body)
		}
		if left := time.Until(*f.stored(t, id).ExpiresAt); left > 600*time.Second || left < 590*time.Second {
			t.Fatalf("after setTimeout 600: %v left", left)
		}
		resp, body = f.e2b(t, f.admin, "POST", "/sandboxes/"+id+"/timeout", `{"timeout":0}`)
		wantE2BError(t, resp, body, 400)

		if resp, body := f.e2b(t, f.admin, "DELETE", "/sandboxes/"+id, ""); resp.StatusCode != 204 {
			t.Fatalf("kill: %d %s", resp.StatusCode, body)
		}
		for _, c := range []struct{ method, path, body string }{
			{"DELETE", "/sandboxes/" + id, ""},
			{"GET", "/sandboxes/" + id, ""},
			{"POST", "/v2/sandboxes/" + id + "/connect", `{}`},
			{"POST", "/sandboxes/" + id + "/pause", `{}`},
			{"POST", "/sandboxes/" + id + "/resume", `{}`},
			{"POST", "/sandboxes/" + id + "/timeout", `{"timeout":5}`},
			{"GET", "/sandboxes/" + id + "/metrics", ""},
			{"DELETE", "/sandboxes/sb-nonode-1", ""},
			{"DELETE", "/sandboxes/garbage", ""},
		} {
			resp, body := f.e2b(t, f.admin, c.method, c.path, c.body)
			wantE2BError(t, resp, body, 404)
		}
	})
}

// e2bListed is the part of a ListedSandbox or SandboxDetail the tests
// read, times as the raw strings.
type e2bListed struct {
	SandboxID       string            `json:"sandboxID"`
	TemplateID      string            `json:"templateID"`
	ClientID        string            `json:"clientID"`
	EnvdVersion     string            `json:"envdVersion"`
	EnvdAccessToken string            `json:"envdAccessToken"`
	StartedAt       string            `json:"startedAt"`
	EndAt           string            `json:"endAt"`
	State           string            `json:"state"`
	CPUCount        int               `json:"cpuCount"`
	MemoryMB        int64             `json:"memoryMB"`
	DiskSizeMB      *int64            `json:"diskSizeMB"`
	Metadata        map[string]string `json:"metadata"`
}

func TestE2BInfoAndMetrics(t *testing.T) {
	bothWays(t, func(t *testing.T, f *fixture) {
		c := f.e2bCreate(t, f.admin, `{"templateID":"base/py:1","timeout":300,"metadata":{"job":"j"}}`)
		resp, body := f.e2b(t, f.admin, "GET", "/sandboxes/"+c.SandboxID, "")
		var d e2bListed
		if resp.StatusCode != 200 || json.Unmarshal(body, &d) != nil {
			t.Fatalf("info: %d %s", resp.StatusCode, body)
		}
		if d.SandboxID != c.SandboxID || d.TemplateID != "base/py:1" || d.ClientID != "n1" || d.EnvdVersion != e2bEnvdVersion ||
			d.EnvdAccessToken != c.EnvdAccessToken || d.State != "running" || d.CPUCount < 1 || d.MemoryMB <= 0 || d.DiskSizeMB == nil {
			t.Fatalf("info %s", body)
		}
		if len(d.Metadata) != 1 || d.Metadata["job"] != "j" {
			t.Fatalf("metadata %v: want the caller's only", d.Metadata)
		}
		start, err1 := time.Parse(time.RFC3339, d.StartedAt)
		end, err2 := time.Parse(time.RFC3339, d.EndAt)
		if err1 != nil || err2 != nil || end.Sub(start).Round(time.Second) != 300*time.Second {
			t.Fatalf("times %q %q (%v %v)", d.StartedAt, d.EndAt, err1, err2)
		}

		resp, body = f.e2b(t, f.admin, "GET", "/sandboxes/"+c.SandboxID+"/metrics", "")
		var ms []map[string]any
		if resp.StatusCode != 200 || json.Unmarshal(body, &ms) != nil || len(ms) != 1 {
			t.Fatalf("metrics: %d %s", resp.StatusCode, body)
		}
		for _, k := range []string{"timestamp", "timestampUnix", "cpuCount", "cpuUsedPct", "memUsed", "memTotal", "memCache", "diskUsed", "diskTotal"} {
			if _, ok := ms[0][k]; !ok {
				t.Errorf("metric has no %s: %s", k, body)
			}
		}
		if ts, _ := ms[0]["timestamp"].(string); func() error { _, err := time.Parse(time.RFC3339, ts); return err }() != nil {
			t.Errorf("timestamp %q is not RFC 3339", ts)
		}
		now := time.Now().Unix()
		resp, body = f.e2b(t, f.admin, "GET", fmt.Sprintf("/sandboxes/%s/metrics?start=%d&end=%d", c.SandboxID, now-3600, now-600), "")
		if resp.StatusCode != 200 || strings.TrimSpace(string(body)) != "[]" {
			t.Fatalf("metrics of an hour ago: %d %s", resp.StatusCode, body)
		}
		resp, body = f.e2b(t, f.admin, "GET", "/sandboxes/"+c.SandboxID+"/metrics?start=yesterday", "")
		wantE2BError(t, resp, body, 400)
	})
}

func TestE2BSample(t *testing.T) {
	created := time.Now().Add(-10 * time.Second)
	sb := &api.Sandbox{Node: "n1", CreatedAt: created, Spec: api.SandboxSpec{CPU: 1.5, MemoryMB: 512, DiskMB: 1024}}
	m := e2bSample(sb, &api.Stats{CPUUsageNS: uint64(10 * time.Second), MemoryBytes: 100, DiskBytes: 7}, nil, created.Add(10*time.Second))
	if m.CPUCount != 2 || m.CPUUsedPct != 50 || m.MemUsed != 100 || m.MemTotal != 512<<20 || m.DiskTotal != 1024<<20 || m.DiskUsed != 7 {
		t.Fatalf("sample %+v", m)
	}
	sb.Spec.CPU = 0
	if n := e2bCPUCount(sb, map[string]float64{"n1": 7.5}); n != 8 {
		t.Fatalf("cores of an unlimited sandbox: %d, want the node's", n)
	}
	if n := e2bCPUCount(sb, nil); n != 1 {
		t.Fatalf("cores of an unlimited sandbox on an unknown node: %d", n)
	}
}

func TestE2BList(t *testing.T) {
	bothWays(t, func(t *testing.T, f *fixture) {
		var ids []string
		for i := range 5 {
			job := "a"
			if i >= 3 {
				job = "b"
			}
			ids = append(ids, f.e2bCreate(t, f.admin, fmt.Sprintf(`{"templateID":"base/py:1","metadata":{"job":%q,"i":"%d"}}`, job, i)).SandboxID)
		}
		if resp, body := f.e2b(t, f.admin, "POST", "/sandboxes/"+ids[0]+"/pause", ""); resp.StatusCode != 204 {
			t.Fatalf("pause: %d %s", resp.StatusCode, body)
		}
		list := func(query string) ([]e2bListed, string) {
			t.Helper()
			resp, body := f.e2b(t, f.admin, "GET", "/v2/sandboxes"+query, "")
			var l []e2bListed
			if resp.StatusCode != 200 || json.Unmarshal(body, &l) != nil {
				t.Fatalf("list %s: %d %s", query, resp.StatusCode, body)
			}
			return l, resp.Header.Get("X-Next-Token")
		}
		// The SDK's metadata filter: pairs URL-encoded, each key and value
		// once more.
		meta := func(kv ...string) string {
			v := url.Values{}
			for i := 0; i < len(kv); i += 2 {
				v.Set(url.QueryEscape(kv[i]), url.QueryEscape(kv[i+1]))
			}
			return "metadata=" + url.QueryEscape(v.Encode())
		}
		if l, next := list("?" + meta("job", "a")); len(l) != 3 || next != "" {
			t.Fatalf("job=a: %d sandboxes, next %q", len(l), next)
		}
		if l, _ := list("?" + meta("job", "a", "i", "1")); len(l) != 1 || l[0].SandboxID != ids[1] {
			t.Fatalf("job=a,i=1: %+v", l)
		}
		l, _ := list("?state=paused")
		if len(l) != 1 || l[0].SandboxID != ids[0] || l[0].State != "paused" {
			t.Fatalf("paused: %+v", l)
		}
		if l, _ := list("?state=running&" + meta("job", "a")); len(l) != 2 {
			t.Fatalf("running job=a: %+v", l)
		}
		if l, _ := list("?state=running,paused&template=base%2Fpy%3A1"); len(l) != 5 {
			t.Fatalf("by template: %d", len(l))
		}
		if l, _ := list("?template=other"); len(l) != 0 {
			t.Fatalf("another template: %d", len(l))
		}
		l, _ = list("")
		if len(l) != 5 {
			t.Fatalf("all: %d", len(l))
		}
		for _, x := range l {
			if _, err := time.Parse(time.RFC3339, x.StartedAt); err != nil || x.EnvdAccessToken != "" || x.TemplateID != "base/py:1" || x.Metadata[e2bTemplateLabel] != "" {
				t.Fatalf("listed %+v", x)
			}
		}
		// Pages of 2 through X-Next-Token: every sandbox once.
		var seen []string
		next := ""
		for pages := 0; ; pages++ {
			q := "?limit=2"
			if next != "" {
				q += "&nextToken=" + url.QueryEscape(next)
			}
			var page []e2bListed
			page, next = list(q)
			if len(page) > 2 || pages > 3 {
				t.Fatalf("page %d: %d sandboxes", pages, len(page))
			}
			for _, x := range page {
				seen = append(seen, x.SandboxID)
			}
			if next == "" {
				break
			}
		}
		if !slices.Equal(seen, ids) {
			t.Fatalf("paged %v, want %v", seen, ids)
		}
		// E2B's first list: running ones, in one answer.
		resp, body := f.e2b(t, f.admin, "GET", "/sandboxes", "")
		var v1 []e2bListed
		if resp.StatusCode != 200 || json.Unmarshal(body, &v1) != nil || len(v1) != 4 {
			t.Fatalf("GET /sandboxes: %d %s", resp.StatusCode, body)
		}
		for _, q := range []string{"?state=stopped", "?limit=0", "?nextToken=%25", "?metadata=" + url.QueryEscape("k=two words"), "?startedAfter=yesterday"} {
			resp, body := f.e2b(t, f.admin, "GET", "/v2/sandboxes"+q, "")
			wantE2BError(t, resp, body, 400)
		}
	})
}

func TestE2BMetadataQuery(t *testing.T) {
	var many []string
	for i := range sandbox.MaxSelectorLabels + 1 {
		many = append(many, fmt.Sprintf("k%d=v", i))
	}
	for in, want := range map[string]map[string]string{
		strings.Join(many, "&"): nil, // more than any sandbox has
		"":                      {},
		"a=b":                   {"a": "b"},
		"a=b&c=d":               {"a": "b", "c": "d"},
		"a=x%252By":             {"a": "x+y"}, // the SDK's encoding of "x+y"
		"k%252Fx=v%253A1":       {"k/x": "v:1"},
		"a=b%":                  nil,
		"a=two+words":           nil,
		"bad%2520key=value":     nil,
	} {
		got, err := e2bMetadataQuery(in)
		if want == nil {
			if err == nil {
				t.Errorf("%q: got %v, want an error", in, got)
			}
			continue
		}
		if err != nil || len(got) != len(want) {
			t.Errorf("%q: got %v, %v; want %v", in, got, err, want)
			continue
		}
		for k, v := range want {
			if got[k] != v {
				t.Errorf("%q: got %v, want %v", in, got, want)
			}
		}
	}
}

func TestE2BEgress(t *testing.T) {
	yes, no := true, false
	all := []string{"0.0.0.0/0", "*"}
	for _, tc := range []struct {
		name         string
		internet     *bool
		net          *e2bNetworkRequest
		allow, deny  []string
		none, failed bool
	}{
		{name: "nothing said", none: true},
		{name: "no internet", internet: &no, none: true},
		{name: "internet", internet: &yes, allow: all},
		{name: "internet less some", internet: &yes, net: &e2bNetworkRequest{DenyOut: []string{"10.0.0.0/8"}}, allow: all, deny: []string{"10.0.0.0/8"}},
		{name: "deny all but some", net: &e2bNetworkRequest{AllowOut: []string{"pypi.org", "1.2.3.4"}, DenyOut: []string{"0.0.0.0/0", "8.8.8.8"}},
			allow: []string{"pypi.org", "1.2.3.4"}},
		{name: "internet off wins", internet: &no, net: &e2bNetworkRequest{AllowOut: []string{"pypi.org"}, DenyOut: []string{"8.8.8.8"}},
			allow: []string{"pypi.org"}},
		{name: "internet on, deny all", internet: &yes, net: &e2bNetworkRequest{DenyOut: []string{"0.0.0.0/0"}}, none: true},
		{name: "lists only", net: &e2bNetworkRequest{AllowOut: []string{"pypi.org"}, DenyOut: []string{"1.1.1.1"}},
			allow: []string{"pypi.org"}, deny: []string{"1.1.1.1"}},
		{name: "proxy", net: &e2bNetworkRequest{EgressProxy: json.RawMessage(`{"address":"p:1"}`)}, failed: true},
		{name: "null proxy", net: &e2bNetworkRequest{EgressProxy: json.RawMessage(`null`)}, none: true},
		{name: "rules", net: &e2bNetworkRequest{Rules: map[string]json.RawMessage{"a.com": json.RawMessage(`[]`)}}, failed: true},
	} {
		np, err := e2bEgress(tc.internet, tc.net)
		switch {
		case tc.failed:
			if err == nil {
				t.Errorf("%s: no error", tc.name)
			}
		case err != nil:
			t.Errorf("%s: %v", tc.name, err)
		case tc.none:
			if np != nil {
				t.Errorf("%s: %+v, want dsec's default", tc.name, np)
			}
		case np == nil || !slices.Equal(np.Allow, tc.allow) || !slices.Equal(np.Deny, tc.deny):
			t.Errorf("%s: %+v, want allow %v deny %v", tc.name, np, tc.allow, tc.deny)
		}
	}
}

// TestE2BTenants: another project's key neither sees nor drives a
// sandbox, and it is told "not found", as for a missing one.
func TestE2BTenants(t *testing.T) {
	bothWays(t, func(t *testing.T, f *fixture) {
		f.mkProject(t, f.admin, "root", "team-a", "")
		f.mkProject(t, f.admin, "root", "team-b", "")
		keyA, _ := f.mkKey(t, f.admin, "team-a", "member")
		keyB, _ := f.mkKey(t, f.admin, "team-b", "member")
		id := f.e2bCreate(t, keyA, `{"templateID":"base/py:1"}`).SandboxID
		for _, c := range []struct{ method, path, body string }{
			{"GET", "/sandboxes/" + id, ""},
			{"DELETE", "/sandboxes/" + id, ""},
			{"POST", "/v2/sandboxes/" + id + "/connect", `{}`},
			{"POST", "/sandboxes/" + id + "/pause", `{}`},
			{"POST", "/sandboxes/" + id + "/resume", `{}`},
			{"POST", "/sandboxes/" + id + "/timeout", `{"timeout":5}`},
			{"GET", "/sandboxes/" + id + "/metrics", ""},
		} {
			resp, body := f.e2b(t, keyB, c.method, c.path, c.body)
			wantE2BError(t, resp, body, 404)
		}
		if f.edge.Len() != 1 || f.stored(t, id).State != api.StateRunning {
			t.Fatalf("another tenant's calls changed the sandbox")
		}
		count := func(key string) int {
			resp, body := f.e2b(t, key, "GET", "/v2/sandboxes", "")
			var l []e2bListed
			if resp.StatusCode != 200 || json.Unmarshal(body, &l) != nil {
				t.Fatalf("list: %d %s", resp.StatusCode, body)
			}
			return len(l)
		}
		if a, b, root := count(keyA), count(keyB), count(f.admin); a != 1 || b != 0 || root != 1 {
			t.Fatalf("lists: team-a %d, team-b %d, root %d", a, b, root)
		}
	})
}

func TestE2BAuth(t *testing.T) {
	f := newFixture(t, false)
	for _, key := range []string{"", "wrong-key"} {
		resp, body := f.e2b(t, key, "GET", "/v2/sandboxes", "")
		wantE2BError(t, resp, body, 401)
	}
	// A viewer lists, and creates nothing.
	if resp, body := f.e2b(t, f.viewer, "GET", "/v2/sandboxes", ""); resp.StatusCode != 200 {
		t.Fatalf("viewer list: %d %s", resp.StatusCode, body)
	}
	resp, body := f.e2b(t, f.viewer, "POST", "/v2/sandboxes", `{"templateID":"base/py:1"}`)
	wantE2BError(t, resp, body, 403)
	// A key's E2B spelling (what recent SDKs insist on) is that key: the
	// same role and project; a spelling of no key is 401. /v1 takes keys
	// as they are.
	c := f.e2bCreate(t, iam.E2BKey(f.admin), `{"templateID":"base/py:1"}`)
	if sb := f.stored(t, c.SandboxID); sb.Project != iam.RootProject {
		t.Fatalf("created by the spelt admin key in project %q", sb.Project)
	}
	if resp, body := f.e2b(t, iam.E2BKey(f.viewer), "GET", "/v2/sandboxes", ""); resp.StatusCode != 200 || !strings.Contains(string(body), c.SandboxID) {
		t.Fatalf("spelt viewer key list: %d %s", resp.StatusCode, body)
	}
	resp, body = f.e2b(t, iam.E2BKey(f.viewer), "POST", "/v2/sandboxes", `{"templateID":"base/py:1"}`)
	wantE2BError(t, resp, body, 403)
	resp, body = f.e2b(t, iam.E2BKey("not-a-key-of-anyone-0123"), "GET", "/v2/sandboxes", "")
	wantE2BError(t, resp, body, 401)
	if resp, body := f.do(t, iam.E2BKey(f.admin), "GET", "/v1/sandboxes", ""); resp.StatusCode != 401 {
		t.Fatalf("/v1 with a spelt key: %d %s", resp.StatusCode, body)
	}
	if n := f.edge.Len(); n != 1 {
		t.Fatalf("the edge holds %d sandboxes, want the admin's one", n)
	}
	// getInfo gives the envd access token (which runs commands and
	// writes files) only to a key that may drive the sandbox.
	for key, want := range map[string]bool{f.admin: true, f.viewer: false} {
		resp, body := f.e2b(t, key, "GET", "/sandboxes/"+c.SandboxID, "")
		var d e2bCreated
		if resp.StatusCode != 200 || json.Unmarshal(body, &d) != nil || (d.EnvdAccessToken == c.EnvdAccessToken) != want ||
			(!want && d.EnvdAccessToken != "") {
			t.Fatalf("getInfo by a key that may drive the sandbox: %v: %d %s", want, resp.StatusCode, body)
		}
	}

	// The rest of E2B's API answers in its shape.
	resp, body = f.e2b(t, f.admin, "POST", "/sandboxes/sb-n1-0001/fork", `{}`)
	if msg := wantE2BError(t, resp, body, 404); !strings.Contains(msg, "not part of dsec's E2B API") {
		t.Fatalf("fork: %q", msg)
	}
}

// TestE2BQuota: a create past the project's quota is 429 with an
// integer Retry-After, which the SDK waits for.
func TestE2BQuota(t *testing.T) {
	f := newFixture(t, false)
	f.mkProject(t, f.admin, "root", "q", `{"sandboxes":1}`)
	key, _ := f.mkKey(t, f.admin, "q", "member")
	f.e2bCreate(t, key, `{"templateID":"base/py:1"}`)
	resp, body := f.e2b(t, key, "POST", "/v2/sandboxes", `{"templateID":"base/py:1"}`)
	wantE2BError(t, resp, body, 429)
	if n, err := strconv.Atoi(resp.Header.Get("Retry-After")); err != nil || n < 1 {
		t.Fatalf("Retry-After %q", resp.Header.Get("Retry-After"))
	}
}
