package apiserver

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/edgeapi/edgetest"
	"github.com/dsecproject/dsec/internal/iam"
	"github.com/dsecproject/dsec/internal/layer"
	"github.com/dsecproject/dsec/internal/sandbox"
	"github.com/dsecproject/dsec/internal/store"
	"github.com/dsecproject/dsec/internal/watcher"
)

type fixture struct {
	st      store.Store
	view    *watcher.Watcher
	aliveMu sync.Mutex
	alive   map[string]bool
	srv     *httptest.Server
	edge    *edgetest.Fake
	admin   string
	viewer  string
	iam     *iam.IAM
	layers  *layer.Store
	digests map[string]string
}

func newFixture(t testing.TB, wire bool) *fixture {
	t.Helper()
	st := store.NewMemory()
	ident, err := iam.New(st)
	if err != nil {
		t.Fatal(err)
	}
	admin, _, err := ident.EnsureAdminKey("")
	if err != nil {
		t.Fatal(err)
	}
	p, err := ident.Authenticate(admin)
	if err != nil {
		t.Fatal(err)
	}
	viewer, _, err := ident.CreateKey(p, iam.RootProject, iam.RoleViewer, "viewer", 0)
	if err != nil {
		t.Fatal(err)
	}
	layers, err := layer.NewStore(t.TempDir(), st, nil)
	if err != nil {
		t.Fatal(err)
	}
	// Catalog entries written directly: building EROFS needs mkfs.erofs
	// (covered by the layer package and the e2e tests).
	digests := map[string]string{}
	for i, ref := range []string{"base/py:1", "workspace/w:1", "toolkit/t:1"} {
		d := fmt.Sprintf("sha256:%064x", i+1)
		digests[ref] = d
		kind := strings.SplitN(ref, "/", 2)[0]
		b, _ := json.Marshal(api.Layer{Digest: d, Ref: ref, Kind: kind})
		if err := st.Put("layers", ref, b); err != nil {
			t.Fatal(err)
		}
	}
	fe := edgetest.NewFake("n1")
	var e edgeapi.Edge = fe
	if wire {
		es := httptest.NewServer(edgeapi.NewServer(fe, nil))
		t.Cleanup(es.Close)
		e = edgeapi.NewClient("n1", es.URL, es.Client())
	}
	view := watcher.New(watcher.Static{e}, watcher.Config{})
	view.Sync(t.Context())
	f := &fixture{edge: fe, admin: admin, viewer: viewer, iam: ident, layers: layers, digests: digests, st: st, view: view,
		alive: map[string]bool{"a": true}}
	f.srv = f.apiserver(t, "a")
	return f
}

// apiserver starts another apiserver named instance over the fixture's
// store, IAM and edge (a cluster's apiservers share etcd).
func (f *fixture) apiserver(t testing.TB, instance string) *httptest.Server {
	return f.apiserverWith(t, instance, nil)
}

// apiserverWith is apiserver with its Deps changed by tune first.
func (f *fixture) apiserverWith(t testing.TB, instance string, tune func(*Deps)) *httptest.Server {
	f.setAlive(instance, true)
	deps := Deps{IAM: f.iam, Layers: f.layers, Nodes: f.view, Policy: sandbox.DefaultPolicy(),
		Log: slog.New(slog.NewTextHandler(io.Discard, nil)), Store: f.st, QuotaStore: f.st, Instance: instance,
		Alive: func(other string) (bool, error) {
			f.aliveMu.Lock()
			defer f.aliveMu.Unlock()
			return f.alive[other], nil
		}}
	if tune != nil {
		tune(&deps)
	}
	s := New(deps)
	srv := httptest.NewServer(s.Handler())
	t.Cleanup(srv.Close)
	return srv
}

func (f *fixture) setAlive(instance string, v bool) {
	f.aliveMu.Lock()
	f.alive[instance] = v
	f.aliveMu.Unlock()
}

// bothWays runs fn against an apiserver that reaches its edge in process
// and against one that reaches it through the internal API.
func bothWays(t *testing.T, fn func(t *testing.T, f *fixture)) {
	t.Run("inproc", func(t *testing.T) { fn(t, newFixture(t, false)) })
	t.Run("wire", func(t *testing.T) { fn(t, newFixture(t, true)) })
}

func (f *fixture) do(t testing.TB, key, method, path, body string) (*http.Response, []byte) {
	t.Helper()
	return f.doAt(t, f.srv, key, "", method, path, body)
}

// doAt sends a request to srv, with an Idempotency-Key if idem is set.
func (f *fixture) doAt(t testing.TB, srv *httptest.Server, key, idem, method, path, body string) (*http.Response, []byte) {
	t.Helper()
	req, _ := http.NewRequest(method, srv.URL+path, strings.NewReader(body))
	if idem != "" {
		req.Header.Set("Idempotency-Key", idem)
	}
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, b
}

func wantError(t *testing.T, resp *http.Response, body []byte, status int, code string) api.ErrorDetail {
	t.Helper()
	var e api.ErrorBody
	if resp.StatusCode != status || json.Unmarshal(body, &e) != nil || e.Error.Code != code || e.Error.Message == "" {
		t.Fatalf("got %d %s, want %d %s", resp.StatusCode, body, status, code)
	}
	return e.Error
}

func TestAuth(t *testing.T) {
	bothWays(t, func(t *testing.T, f *fixture) {
		resp, body := f.do(t, "", "GET", "/v1/sandboxes", "")
		wantError(t, resp, body, 401, "unauthenticated")
		if !strings.HasPrefix(resp.Header.Get("WWW-Authenticate"), "Bearer") {
			t.Fatalf("no WWW-Authenticate header")
		}
		resp, body = f.do(t, "wrong-key", "GET", "/v1/sandboxes", "")
		wantError(t, resp, body, 401, "unauthenticated")
		req, _ := http.NewRequest("GET", f.srv.URL+"/v1/sandboxes", nil)
		req.SetBasicAuth("admin", f.admin)
		r2, _ := http.DefaultClient.Do(req)
		r2.Body.Close()
		if r2.StatusCode != 401 {
			t.Fatalf("basic auth: %d", r2.StatusCode)
		}
		// A viewer may read but not create.
		if resp, _ := f.do(t, f.viewer, "GET", "/v1/sandboxes", ""); resp.StatusCode != 200 {
			t.Fatalf("viewer list: %d", resp.StatusCode)
		}
		resp, body = f.do(t, f.viewer, "POST", "/v1/sandboxes", `{"base":"base/py:1"}`)
		wantError(t, resp, body, 403, "permission_denied")
		if resp, _ := f.do(t, "", "GET", "/healthz", ""); resp.StatusCode != 200 {
			t.Fatalf("healthz needs no auth: %d", resp.StatusCode)
		}
	})
}

func TestCreateResolvesLayersInOrder(t *testing.T) {
	bothWays(t, func(t *testing.T, f *fixture) {
		resp, body := f.do(t, f.admin, "POST", "/v1/sandboxes",
			`{"base":"base/py:1","workspace":"workspace/w:1","toolkits":["toolkit/t:1"],"labels":{"job":"a"}}`)
		if resp.StatusCode != 201 {
			t.Fatalf("create: %d %s", resp.StatusCode, body)
		}
		var sb api.Sandbox
		_ = json.Unmarshal(body, &sb)
		want := []string{f.digests["base/py:1"], f.digests["workspace/w:1"], f.digests["toolkit/t:1"]}
		if strings.Join(sb.Layers, ",") != strings.Join(want, ",") {
			t.Fatalf("layers %v, want base, workspace, toolkit %v", sb.Layers, want)
		}
		if sb.Spec.TTL != 3600 || sb.Spec.Backend != "container" {
			t.Fatalf("defaults not applied: %+v", sb.Spec)
		}
	})
}

func TestBadInput(t *testing.T) {
	// Selectors longer than any sandbox's labels: refused before they go
	// to every edge.
	var bigQuery, bigBody []string
	for i := range sandbox.MaxSelectorLabels + 1 {
		bigQuery = append(bigQuery, fmt.Sprintf("label=k%d=v", i))
		bigBody = append(bigBody, fmt.Sprintf(`"k%d":"v"`, i))
	}
	bothWays(t, func(t *testing.T, f *fixture) {
		cases := []struct {
			method, path, body string
			status             int
			code, mention      string
		}{
			{"GET", "/v1/sandboxes?" + strings.Join(bigQuery, "&"), ``, 400, "invalid_argument", "at most 128 pairs"},
			{"POST", "/v1/sandboxes:delete", `{"labels":{` + strings.Join(bigBody, ",") + `}}`, 400, "invalid_argument", "at most 128 pairs"},
			{"POST", "/v1/sandboxes:pause", `{"labels":{` + strings.Join(bigBody, ",") + `}}`, 400, "invalid_argument", "at most 128 pairs"},
			{"POST", "/v1/sandboxes", `{"base":`, 400, "invalid_argument", "malformed"},
			{"POST", "/v1/sandboxes", `{"base":"base/py:1","memory_mb":"lots"}`, 400, "invalid_argument", "memory_mb"},
			{"POST", "/v1/sandboxes", `{"base":"base/py:1","memroy_mb":5}`, 400, "invalid_argument", "memroy_mb"},
			{"POST", "/v1/sandboxes", `{"base":"base/py:1"} trailing`, 400, "invalid_argument", "after"},
			{"POST", "/v1/sandboxes", ``, 400, "invalid_argument", "empty"},
			{"POST", "/v1/sandboxes", `{"base":"base/nope:1"}`, 404, "not_found", "base/nope:1"},
			{"POST", "/v1/sandboxes", `{"base":"workspace/w:1"}`, 400, "invalid_argument", "workspace"},
			{"POST", "/v1/sandboxes", `{"base":"base/py"}`, 400, "invalid_argument", ""},
			{"POST", "/v1/sandboxes", `{"base":"base/py:1","cpu":-1}`, 400, "invalid_argument", "cpu"},
			{"POST", "/v1/sandboxes", `{"base":"base/py:1","backend":"microvm"}`, 409, "failed_precondition", "microvm"},
			{"POST", "/v1/sandboxes", `{"base":"base/py:1","snapshot":"snapshot/s:1"}`, 404, "not_found", "snapshot/s:1"},
			{"POST", "/v1/sandboxes", `{"snapshot":"toolkit/t:1"}`, 400, "invalid_argument", "snapshot"},
			{"POST", "/v1/sandboxes/sb-n1-0001/fork", `{"count":0}`, 400, "invalid_argument", "count"},
			// dsec's own labels: a caller may select by them, not set them.
			{"POST", "/v1/sandboxes", `{"base":"base/py:1","labels":{"dsec.idempotency":"0123456789abcdef0123456789abcdef"}}`, 400, "invalid_argument", "reserved"},
			{"POST", "/v1/sandboxes:batch", `{"count":2,"spec":{"base":"base/py:1","labels":{"job":"j","dsec.fncall":"true"}}}`, 400, "invalid_argument", "dsec.fncall"},
			{"POST", "/v1/sandboxes/sb-n1-0001/fork", `{"count":1,"labels":{"dsec.x":"y"}}`, 400, "invalid_argument", "reserved"},
			{"POST", "/v1/sandboxes/sb-n1-0001/snapshot", `{}`, 400, "invalid_argument", "ref"},
			{"POST", "/v1/sandboxes:batch", `{"count":0,"spec":{"base":"base/py:1"}}`, 400, "invalid_argument", "count"},
			{"POST", "/v1/sandboxes:delete", `{"labels":{}}`, 400, "invalid_argument", "labels"},
			{"GET", "/v1/sandboxes?limit=0", ``, 400, "invalid_argument", "limit"},
			{"GET", "/v1/sandboxes?state=zombie", ``, 400, "invalid_argument", "state"},
			{"GET", "/v1/sandboxes?page_token=!!!", ``, 400, "invalid_argument", ""},
			{"GET", "/v1/sandboxes?label=novalue", ``, 400, "invalid_argument", "novalue"},
			{"GET", "/v1/sandboxes/not-an-id", ``, 404, "not_found", ""},
			{"GET", "/v1/sandboxes/sb-othernode-abc", ``, 404, "not_found", ""},
			{"POST", "/v1/sandboxes/sb-n1-0001/exec?stream=maybe", `{"cmd":"x"}`, 400, "invalid_argument", "stream"},
			{"GET", "/v1/sandboxes/sb-n1-0001/files", ``, 400, "invalid_argument", "path"},
			{"PUT", "/v1/sandboxes/sb-n1-0001/files?path=/a&mode=999", ``, 400, "invalid_argument", "mode"},
			{"GET", "/v1/sandboxes/sb-n1-0001/files:list?path=/&depth=0", ``, 400, "invalid_argument", "depth"},
			{"POST", "/v1/layers?kind=base&name=x", ``, 400, "invalid_argument", "tag"},
			{"GET", "/v1/layers?kind=weird", ``, 400, "invalid_argument", "kind"},
			{"GET", "/v1/no/such/thing", ``, 404, "not_found", "no such endpoint"},
		}
		for _, c := range cases {
			resp, body := f.do(t, f.admin, c.method, c.path, c.body)
			e := wantError(t, resp, body, c.status, c.code)
			if !strings.Contains(e.Message, c.mention) {
				t.Errorf("%s %s: message %q does not mention %q", c.method, c.path, e.Message, c.mention)
			}
		}
		if n := f.edge.Len(); n != 0 {
			t.Fatalf("bad input created %d sandboxes", n)
		}
	})
}

func TestListPagination(t *testing.T) {
	bothWays(t, func(t *testing.T, f *fixture) {
		for i := 0; i < 5; i++ {
			f.do(t, f.admin, "POST", "/v1/sandboxes", `{"base":"base/py:1","labels":{"p":"x"}}`)
		}
		f.do(t, f.admin, "POST", "/v1/sandboxes", `{"base":"base/py:1","labels":{"p":"other"}}`)
		seen := map[string]bool{}
		token := ""
		for pages := 0; pages < 10; pages++ {
			_, body := f.do(t, f.admin, "GET", "/v1/sandboxes?label=p=x&limit=2&page_token="+token, "")
			var l api.SandboxList
			if err := json.Unmarshal(body, &l); err != nil {
				t.Fatal(err)
			}
			for _, s := range l.Sandboxes {
				if seen[s.ID] {
					t.Fatalf("%s on two pages", s.ID)
				}
				seen[s.ID] = true
			}
			if l.NextPageToken == "" {
				break
			}
			token = l.NextPageToken
		}
		if len(seen) != 5 {
			t.Fatalf("saw %d sandboxes, want 5", len(seen))
		}
	})
}

func TestDeleteIsIdempotent(t *testing.T) {
	bothWays(t, func(t *testing.T, f *fixture) {
		for _, id := range []string{"sb-n1-0001", "garbage", "sb-unknown-x"} {
			if resp, body := f.do(t, f.admin, "DELETE", "/v1/sandboxes/"+id, ""); resp.StatusCode != 204 {
				t.Fatalf("delete %s: %d %s", id, resp.StatusCode, body)
			}
		}
	})
}

func TestInternalErrorsHideDetailAndPanicsAre500(t *testing.T) {
	bothWays(t, func(t *testing.T, f *fixture) {
		f.do(t, f.admin, "POST", "/v1/sandboxes", `{"base":"base/py:1"}`)
		f.edge.ExecErr = errors.New("crun exec: /var/lib/dsec/secret/path: boom")
		resp, body := f.do(t, f.admin, "POST", "/v1/sandboxes/sb-n1-0001/exec", `{"cmd":"x"}`)
		e := wantError(t, resp, body, 500, "internal")
		if strings.Contains(e.Message, "/var/lib") || !strings.Contains(e.Message, "ref ") {
			t.Fatalf("internal error message %q leaks detail or lacks a ref", e.Message)
		}
		f.edge.PanicOn = "sb-n1-0001"
		resp, body = f.do(t, f.admin, "GET", "/v1/sandboxes/sb-n1-0001", "")
		wantError(t, resp, body, 500, "internal")
		// The server is still serving.
		if resp, _ := f.do(t, "", "GET", "/healthz", ""); resp.StatusCode != 200 {
			t.Fatal("server down after a panic")
		}
	})
}

func TestExecStreamAndDownloadErrors(t *testing.T) {
	bothWays(t, func(t *testing.T, f *fixture) {
		f.do(t, f.admin, "POST", "/v1/sandboxes", `{"base":"base/py:1"}`)
		resp, body := f.do(t, f.admin, "POST", "/v1/sandboxes/sb-n1-0001/exec?stream=true", `{"cmd":"x"}`)
		lines := strings.Split(strings.TrimSpace(string(body)), "\n")
		if resp.Header.Get("Content-Type") != "application/x-ndjson" || len(lines) != 2 {
			t.Fatalf("stream: %s %q", resp.Header.Get("Content-Type"), body)
		}
		var last api.ExecEvent
		if err := json.Unmarshal([]byte(lines[1]), &last); err != nil || last.ExitCode == nil || *last.ExitCode != 3 {
			t.Fatalf("final event %q", lines[1])
		}
		// A tar of a missing path is a 404, not a broken stream.
		resp, body = f.do(t, f.admin, "GET", "/v1/sandboxes/sb-n1-0001/files:tar?path=/nope", "")
		wantError(t, resp, body, 404, "not_found")
	})
}

// TestWriteFileOwner: a /v1 write is root's unless owner= names a user of
// the sandbox; one it does not have is a 400 and nothing is written, for
// a file and for a tar.
func TestWriteFileOwner(t *testing.T) {
	bothWays(t, func(t *testing.T, f *fixture) {
		f.do(t, f.admin, "POST", "/v1/sandboxes", `{"base":"base/py:1"}`)
		var fe api.FileEntry
		resp, body := f.do(t, f.admin, "PUT", "/v1/sandboxes/sb-n1-0001/files?path=/a", "x")
		if resp.StatusCode != 200 || json.Unmarshal(body, &fe) != nil || fe.UID != 0 {
			t.Fatalf("write: %d %s", resp.StatusCode, body)
		}
		resp, body = f.do(t, f.admin, "PUT", "/v1/sandboxes/sb-n1-0001/files?path=/home/user/b&owner=user", "x")
		if resp.StatusCode != 200 || json.Unmarshal(body, &fe) != nil || fe.UID != 1000 || fe.GID != 1000 {
			t.Fatalf("write as user: %d %s", resp.StatusCode, body)
		}
		before := f.edge.Tree("sb-n1-0001")
		resp, body = f.do(t, f.admin, "PUT", "/v1/sandboxes/sb-n1-0001/files?path=/ghost/c&owner=ghost", "x")
		wantError(t, resp, body, 400, "invalid_argument")
		resp, body = f.do(t, f.admin, "PUT", "/v1/sandboxes/sb-n1-0001/files:tar?path=/ghost&owner=ghost", strings.Repeat("\x00", 1024))
		wantError(t, resp, body, 400, "invalid_argument")
		if after := f.edge.Tree("sb-n1-0001"); !slices.Equal(before, after) {
			t.Fatalf("refused writes changed the sandbox: %v, then %v", before, after)
		}
	})
}

// TestPortProxyDropsCredentials: a service in a sandbox sees none of the
// caller's credentials (API key, cookies, tokens), and nothing it answers
// can set a cookie or other origin-wide state on the API's origin, which
// every sandbox's ports share.
func TestPortProxyDropsCredentials(t *testing.T) {
	bothWays(t, func(t *testing.T, f *fixture) {
		var seen http.Header
		svc := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			seen = r.Header.Clone()
			for _, h := range []string{"Set-Cookie", "Set-Cookie2", "Strict-Transport-Security", "Alt-Svc",
				"Clear-Site-Data", "Service-Worker-Allowed", "WWW-Authenticate"} {
				w.Header().Set(h, "from-the-sandbox")
			}
			w.Header().Set("X-App", "kept")
			_, _ = io.WriteString(w, "hello from "+r.URL.Path)
		}))
		t.Cleanup(svc.Close)
		f.edge.PortAddr = svc.Listener.Addr().String()
		resp, body := f.do(t, f.admin, "POST", "/v1/sandboxes", `{"base":"base/py:1"}`)
		if resp.StatusCode != 201 {
			t.Fatalf("create: %d %s", resp.StatusCode, body)
		}
		var sb api.Sandbox
		_ = json.Unmarshal(body, &sb)
		req, _ := http.NewRequest("GET", f.srv.URL+"/v1/sandboxes/"+sb.ID+"/ports/8080/app/x", nil)
		req.Header.Set("Authorization", "Bearer "+f.admin)
		for _, h := range proxyDropRequest[1:] {
			req.Header.Set(h, "secret-"+h)
		}
		req.Header.Set("X-Trace", "kept")
		r, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		got, _ := io.ReadAll(r.Body)
		r.Body.Close()
		if r.StatusCode != 200 || string(got) != "hello from /app/x" {
			t.Fatalf("proxied: %d %q", r.StatusCode, got)
		}
		for name, v := range seen {
			for _, x := range v {
				if strings.Contains(x, "secret-") || strings.Contains(x, f.admin) {
					t.Errorf("the sandbox's service saw %s: %s", name, x)
				}
			}
		}
		if seen.Get("X-Trace") != "kept" {
			t.Errorf("an ordinary header was dropped: %v", seen)
		}
		for name := range r.Header {
			if r.Header.Get(name) == "from-the-sandbox" {
				t.Errorf("the sandbox set %s on the API's origin", name)
			}
		}
		if r.Header.Get("X-App") != "kept" {
			t.Errorf("an ordinary response header was dropped: %v", r.Header)
		}
	})
}
