package main

import (
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/url"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/iam"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

// seenCall is one request the IAM fake answered.
type seenCall struct {
	method, path string
	query        url.Values
	body         string
}

// iamAPI is a fake of the IAM endpoints that records every call.
type iamAPI struct {
	*http.ServeMux
	mu    sync.Mutex
	calls []seenCall
	// project is what GET, PATCH and the list answer with.
	project api.Project
}

func newIAMAPI() *iamAPI {
	f := &iamAPI{ServeMux: http.NewServeMux(), project: api.Project{ID: "team-a", Name: "team-a", Parent: "root", Path: "root/team-a",
		Quota: api.ProjectQuota{Sandboxes: 10, CPU: 8, MemoryMB: 16384},
		Usage: api.ProjectUsage{Sandboxes: 3, CPU: 1.5, MemoryMB: 2048, DiskMB: 512}}}
	f.HandleFunc("GET /v1/whoami", func(w http.ResponseWriter, r *http.Request) {
		jsonReply(w, 200, api.WhoAmI{Principal: "k-1", Project: "team-a", Role: "admin", Permissions: []string{"project:write", "sandbox:write"}})
	})
	f.HandleFunc("POST /v1/projects", func(w http.ResponseWriter, r *http.Request) {
		var req api.CreateProjectRequest
		json.Unmarshal([]byte(f.last().body), &req)
		if req.Name == "big" {
			jsonReply(w, 429, api.ErrorBody{Error: api.ErrorDetail{Code: "quota_exceeded", Message: "sandboxes 20 > 10 of root/team-a"}})
			return
		}
		jsonReply(w, 201, api.Project{ID: "p-" + req.Name, Name: req.Name, Parent: req.Parent, Quota: req.Quota})
	})
	f.HandleFunc("GET /v1/projects", func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("page_token") == "" {
			jsonReply(w, 200, api.ProjectList{Projects: []api.Project{f.project}, NextPageToken: "2"})
			return
		}
		jsonReply(w, 200, api.ProjectList{Projects: []api.Project{{ID: "job-7", Name: "job-7", Parent: "team-a"}}})
	})
	f.HandleFunc("GET /v1/projects/{id}", func(w http.ResponseWriter, r *http.Request) { jsonReply(w, 200, f.project) })
	f.HandleFunc("PATCH /v1/projects/{id}", func(w http.ResponseWriter, r *http.Request) {
		var req api.UpdateProjectRequest
		json.Unmarshal([]byte(f.last().body), &req)
		p := f.project
		if req.Quota != nil {
			p.Quota = *req.Quota
		}
		if req.DedicatedNodes != nil {
			p.DedicatedNodes = *req.DedicatedNodes
		}
		jsonReply(w, 200, p)
	})
	f.HandleFunc("DELETE /v1/projects/{id}", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(204) })
	f.HandleFunc("POST /v1/projects/{id}/keys", func(w http.ResponseWriter, r *http.Request) {
		var req api.CreateKeyRequest
		json.Unmarshal([]byte(f.last().body), &req)
		jsonReply(w, 201, api.APIKey{ID: "k-2", Key: "dsec_SECRET", Project: r.PathValue("id"), Role: req.Role, Name: req.Name})
	})
	exp := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	f.HandleFunc("GET /v1/projects/{id}/keys", func(w http.ResponseWriter, r *http.Request) {
		jsonReply(w, 200, api.KeyList{Keys: []api.APIKey{{ID: "k-1", Name: "ci", Role: "builder", Project: "team-a", CreatedAt: time.Now()},
			{ID: "k-2", Role: "viewer", Project: "team-a", ExpiresAt: &exp}}})
	})
	f.HandleFunc("DELETE /v1/projects/{id}/keys/{key}", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(204) })
	f.HandleFunc("GET /v1/audit", func(w http.ResponseWriter, r *http.Request) {
		jsonReply(w, 200, api.AuditList{Entries: []api.AuditEntry{{Time: time.Now(), Principal: "k-1", Project: "team-a", Action: "key.create", Target: "k-2", Detail: "role builder"}}})
	})
	return f
}

func (f *iamAPI) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	b, _ := io.ReadAll(r.Body)
	f.mu.Lock()
	f.calls = append(f.calls, seenCall{r.Method, r.URL.EscapedPath(), r.URL.Query(), string(b)})
	f.mu.Unlock()
	f.ServeMux.ServeHTTP(w, r)
}

func (f *iamAPI) last() seenCall {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls[len(f.calls)-1]
}

// take returns the calls made since the last take and forgets them.
func (f *iamAPI) take() []seenCall {
	f.mu.Lock()
	defer f.mu.Unlock()
	c := f.calls
	f.calls = nil
	return c
}

// methodsPaths renders calls as "METHOD path?query" for comparisons.
func methodsPaths(calls []seenCall) []string {
	var out []string
	for _, c := range calls {
		s := c.method + " " + c.path
		if len(c.query) > 0 {
			s += "?" + c.query.Encode()
		}
		out = append(out, s)
	}
	return out
}

func TestCLIProjectCreate(t *testing.T) {
	f := newIAMAPI()
	out, err := runCLI(t, f, "project", "create", "job-7", "--parent", "team-a", "--sandboxes", "4", "--cpu", "2.5", "--memory-mb", "4096", "--disk-mb", "1024", "--dedicated-nodes")
	if err != nil {
		t.Fatal(err)
	}
	if out != "p-job-7\n" {
		t.Errorf("stdout %q", out)
	}
	calls := f.take()
	if got := methodsPaths(calls); !slices.Equal(got, []string{"POST /v1/projects"}) {
		t.Fatalf("calls %q", got)
	}
	want := `{"parent":"team-a","name":"job-7","quota":{"sandboxes":4,"cpu":2.5,"memory_mb":4096,"disk_mb":1024},"dedicated_nodes":true}`
	if calls[0].body != want {
		t.Errorf("body\n%s\nwant\n%s", calls[0].body, want)
	}

	// Without --parent the project goes below the key's own.
	if _, err := runCLI(t, f, "project", "create", "job-8"); err != nil {
		t.Fatal(err)
	}
	calls = f.take()
	if got := methodsPaths(calls); !slices.Equal(got, []string{"GET /v1/whoami", "POST /v1/projects"}) {
		t.Fatalf("calls %q", got)
	}
	if !strings.Contains(calls[1].body, `"parent":"team-a"`) {
		t.Errorf("body %s", calls[1].body)
	}

	// --json prints the project.
	out, err = runCLI(t, f, "project", "create", "job-9", "--parent", "root", "--json")
	var p api.Project
	if err != nil || json.Unmarshal([]byte(out), &p) != nil || p.ID != "p-job-9" || p.Parent != "root" {
		t.Errorf("--json: %v %q", err, out)
	}
	f.take()

	// A quota error reaches the user as the server said it.
	if _, err := runCLI(t, f, "project", "create", "big", "--parent", "root"); err == nil || !strings.Contains(err.Error(), "quota_exceeded: sandboxes 20 > 10") {
		t.Errorf("quota: %v", err)
	}
	f.take()

	// Bad input is refused before any call.
	for _, bad := range [][]string{
		{},
		{"a", "b"},
		{""},
		{"a", "--sandboxes", "-1"},
		{"a", "--cpu", "-0.5"},
		{"a", "--memory-mb", "x"},
	} {
		if _, err := runCLI(t, f, append([]string{"project", "create"}, bad...)...); err == nil {
			t.Errorf("project create %q: no error", bad)
		}
	}
	if calls := f.take(); len(calls) != 0 {
		t.Errorf("refused commands made calls: %q", methodsPaths(calls))
	}
}

func TestCLIProjectListShow(t *testing.T) {
	f := newIAMAPI()
	out, err := runCLI(t, f, "project", "list", "--parent", "team-a")
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"GET /v1/projects?parent=team-a", "GET /v1/projects?page_token=2&parent=team-a"}
	if got := methodsPaths(f.take()); !slices.Equal(got, want) {
		t.Errorf("calls %q, want %q", got, want)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 3 {
		t.Fatalf("table:\n%s", out)
	}
	for _, col := range []string{"ID", "PARENT", "SANDBOXES", "CPU", "MEMORY", "DISK"} {
		if !strings.Contains(lines[0], col) {
			t.Errorf("header %q lacks %s", lines[0], col)
		}
	}
	// used/quota, "-" for a limit the project does not set.
	if f := strings.Fields(lines[1]); !slices.Equal(f, []string{"team-a", "team-a", "root", "3/10", "1.5/8", "2.0", "GiB/16.0", "GiB", "512.0", "MiB/-"}) {
		t.Errorf("row %q", f)
	}
	if !strings.HasPrefix(lines[2], "job-7") || !strings.Contains(lines[2], "0/-") {
		t.Errorf("row %q", lines[2])
	}

	out, err = runCLI(t, f, "project", "list", "--json")
	var all []api.Project
	if err != nil || json.Unmarshal([]byte(out), &all) != nil || len(all) != 2 {
		t.Errorf("--json: %v %q", err, out)
	}
	if c := f.take(); len(c[0].query) != 0 {
		t.Errorf("no --parent sent %v", c[0].query)
	}

	out, err = runCLI(t, f, "project", "show", "team-a")
	if err != nil {
		t.Fatal(err)
	}
	if got := methodsPaths(f.take()); !slices.Equal(got, []string{"GET /v1/projects/team-a"}) {
		t.Errorf("calls %q", got)
	}
	for _, line := range []string{"Path:", "root/team-a", "Sandboxes:", "3/10", "Dedicated nodes:", "no", "Disk:", "512.0 MiB/-"} {
		if !strings.Contains(out, line) {
			t.Errorf("show lacks %q:\n%s", line, out)
		}
	}
	if _, err := runCLI(t, f, "project", "show"); err == nil {
		t.Error("show without an id: no error")
	}
	if _, err := runCLI(t, f, "project", "list", "extra"); err == nil {
		t.Error("list with an argument: no error")
	}
}

func TestCLIProjectUpdate(t *testing.T) {
	f := newIAMAPI()
	// A quota flag: the project is read, and its quota sent with only
	// the given limit changed.
	out, err := runCLI(t, f, "project", "update", "team-a", "--sandboxes", "20")
	if err != nil {
		t.Fatal(err)
	}
	calls := f.take()
	if got := methodsPaths(calls); !slices.Equal(got, []string{"GET /v1/projects/team-a", "PATCH /v1/projects/team-a"}) {
		t.Fatalf("calls %q", got)
	}
	if want := `{"quota":{"sandboxes":20,"cpu":8,"memory_mb":16384,"disk_mb":0}}`; calls[1].body != want {
		t.Errorf("body %s, want %s", calls[1].body, want)
	}
	if !strings.Contains(out, "sandboxes 3/20") {
		t.Errorf("stdout %q", out)
	}

	// Only --dedicated-nodes: nothing read, only that field sent.
	if _, err := runCLI(t, f, "project", "update", "--dedicated-nodes=false", "team-a"); err != nil {
		t.Fatal(err)
	}
	calls = f.take()
	if got := methodsPaths(calls); !slices.Equal(got, []string{"PATCH /v1/projects/team-a"}) || calls[0].body != `{"dedicated_nodes":false}` {
		t.Errorf("calls %q body %s", got, calls[0].body)
	}
	if _, err := runCLI(t, f, "project", "update", "team-a", "--dedicated-nodes", "--cpu", "0", "--disk-mb", "100"); err != nil {
		t.Fatal(err)
	}
	calls = f.take()
	if want := `{"quota":{"sandboxes":10,"cpu":0,"memory_mb":16384,"disk_mb":100},"dedicated_nodes":true}`; len(calls) != 2 || calls[1].body != want {
		t.Errorf("body %s, want %s", calls[len(calls)-1].body, want)
	}

	for _, bad := range [][]string{
		{"team-a"},
		{},
		{"team-a", "--sandboxes", "-2"},
		{"team-a", "--dedicated-nodes", "false"}, // a bool flag takes its value with =
	} {
		if _, err := runCLI(t, f, append([]string{"project", "update"}, bad...)...); err == nil {
			t.Errorf("project update %q: no error", bad)
		}
	}
	if calls := f.take(); len(calls) != 0 {
		t.Errorf("refused commands made calls: %q", methodsPaths(calls))
	}
}

func TestCLIProjectDelete(t *testing.T) {
	f := newIAMAPI()
	out, err := runCLI(t, f, "project", "delete", "job 7")
	if err != nil || out != "job 7\n" {
		t.Fatalf("%v %q", err, out)
	}
	if _, err := runCLI(t, f, "project", "delete", "--cascade", "team-a"); err != nil {
		t.Fatal(err)
	}
	want := []string{"DELETE /v1/projects/job%207", "DELETE /v1/projects/team-a?cascade=true"}
	if got := methodsPaths(f.take()); !slices.Equal(got, want) {
		t.Errorf("calls %q, want %q", got, want)
	}
	if _, err := runCLI(t, f, "project", "delete"); err == nil {
		t.Error("no id: no error")
	}
}

func TestCLIKeys(t *testing.T) {
	f := newIAMAPI()
	out, errOut, err := runCLIStderr(t, f, "key", "create", "team-a", "--role", "builder", "--name", "ci", "--expires-in", "720h")
	if err != nil {
		t.Fatal(err)
	}
	// The key alone on stdout, for KEY=$(dsec key create ...); the
	// warning that it is shown once on stderr.
	if out != "dsec_SECRET\n" {
		t.Errorf("stdout %q", out)
	}
	if !strings.Contains(errOut, "shown only this once") || !strings.Contains(errOut, "k-2") || strings.Contains(errOut, "SECRET") {
		t.Errorf("stderr %q", errOut)
	}
	calls := f.take()
	if got := methodsPaths(calls); !slices.Equal(got, []string{"POST /v1/projects/team-a/keys"}) {
		t.Fatalf("calls %q", got)
	}
	if want := `{"role":"builder","name":"ci","expires_in":2592000}`; calls[0].body != want {
		t.Errorf("body %s, want %s", calls[0].body, want)
	}
	out, errOut, err = runCLIStderr(t, f, "key", "create", "team-a", "--role", "viewer", "--json")
	var k api.APIKey
	if err != nil || json.Unmarshal([]byte(out), &k) != nil || k.Key != "dsec_SECRET" || !strings.Contains(errOut, "shown only this once") {
		t.Errorf("--json: %v %q %q", err, out, errOut)
	}
	if c := f.take(); c[0].body != `{"role":"viewer"}` {
		t.Errorf("body %s", c[0].body)
	}
	for _, bad := range [][]string{
		{"team-a"},
		{"--role", "member"},
		{"team-a", "--role", "member", "--expires-in", "-1h"},
		{"team-a", "--role", "member", "--expires-in", "soon"},
	} {
		if _, err := runCLI(t, f, append([]string{"key", "create"}, bad...)...); err == nil {
			t.Errorf("key create %q: no error", bad)
		}
	}
	if calls := f.take(); len(calls) != 0 {
		t.Errorf("refused commands made calls: %q", methodsPaths(calls))
	}

	out, err = runCLI(t, f, "key", "list", "team-a")
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 3 || !strings.HasPrefix(lines[0], "ID") || !strings.Contains(lines[1], "builder") || !strings.Contains(lines[1], "never") ||
		!strings.Contains(lines[2], time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC).Local().Format(time.RFC3339)) {
		t.Errorf("table:\n%s", out)
	}
	if strings.Contains(out, "SECRET") {
		t.Error("a listing shows a secret")
	}
	out, err = runCLI(t, f, "key", "revoke", "team-a", "k-1")
	if err != nil || out != "k-1\n" {
		t.Errorf("revoke: %v %q", err, out)
	}
	want := []string{"GET /v1/projects/team-a/keys", "DELETE /v1/projects/team-a/keys/k-1"}
	if got := methodsPaths(f.take()); !slices.Equal(got, want) {
		t.Errorf("calls %q, want %q", got, want)
	}
	if _, err := runCLI(t, f, "key", "revoke", "team-a"); err == nil {
		t.Error("revoke without a key id: no error")
	}
	if _, err := runCLI(t, f, "key", "list"); err == nil {
		t.Error("list without a project: no error")
	}
}

func TestCLIWhoAmIAndAudit(t *testing.T) {
	f := newIAMAPI()
	out, err := runCLI(t, f, "whoami")
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{"Principal:", "k-1", "Project:", "team-a", "Role:", "admin", "project:write, sandbox:write"} {
		if !strings.Contains(out, s) {
			t.Errorf("whoami lacks %q:\n%s", s, out)
		}
	}
	f.take()

	before := time.Now()
	out, err = runCLI(t, f, "audit", "--since", "1h", "--limit", "20")
	if err != nil {
		t.Fatal(err)
	}
	calls := f.take()
	if len(calls) != 1 || calls[0].path != "/v1/audit" || calls[0].query.Get("limit") != "20" {
		t.Fatalf("calls %q", methodsPaths(calls))
	}
	since, err := time.Parse(time.RFC3339, calls[0].query.Get("since"))
	if err != nil {
		t.Fatal(err)
	}
	if d := before.Add(-time.Hour).Sub(since); d < -time.Minute || d > time.Minute {
		t.Errorf("--since 1h sent %s, %s off", since, d)
	}
	if lines := strings.Split(strings.TrimSpace(out), "\n"); len(lines) != 2 || !strings.Contains(lines[1], "key.create") || !strings.Contains(lines[1], "role builder") {
		t.Errorf("table:\n%s", out)
	}

	if _, err := runCLI(t, f, "audit", "--since", "2026-05-01T10:00:00+02:00"); err != nil {
		t.Fatal(err)
	}
	if q := f.take()[0].query; q.Get("since") != "2026-05-01T08:00:00Z" || q.Has("limit") {
		t.Errorf("query %v", q)
	}
	for _, bad := range [][]string{
		{"--since", "yesterday"},
		{"--since", "-1h"},
		{"--limit", "-1"},
		{"extra"},
	} {
		if _, err := runCLI(t, f, append([]string{"audit"}, bad...)...); err == nil {
			t.Errorf("audit %q: no error", bad)
		}
	}
	if calls := f.take(); len(calls) != 0 {
		t.Errorf("refused commands made calls: %q", methodsPaths(calls))
	}
}

func TestParseSince(t *testing.T) {
	now := time.Date(2026, 5, 1, 12, 0, 0, 0, time.UTC)
	for _, tt := range []struct {
		in   string
		want time.Time
		bad  bool
	}{
		{in: "", want: time.Time{}},
		{in: "90m", want: now.Add(-90 * time.Minute)},
		{in: "0s", want: now},
		{in: "2026-04-30T00:00:00Z", want: time.Date(2026, 4, 30, 0, 0, 0, 0, time.UTC)},
		{in: "-5m", bad: true},
		{in: "2026-04-30", bad: true},
		{in: "1d", bad: true},
	} {
		got, err := parseSince(tt.in, now)
		if tt.bad {
			if err == nil {
				t.Errorf("%q: want error, got %s", tt.in, got)
			}
			continue
		}
		if err != nil || !got.Equal(tt.want) {
			t.Errorf("%q: got %s, %v; want %s", tt.in, got, err, tt.want)
		}
	}
}

func TestCLISandboxCreateProject(t *testing.T) {
	var got api.SandboxSpec
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/sandboxes", func(w http.ResponseWriter, r *http.Request) {
		json.NewDecoder(r.Body).Decode(&got)
		jsonReply(w, 201, api.Sandbox{ID: "sb-1", Project: got.Project, Spec: got})
	})
	mux.HandleFunc("GET /v1/sandboxes/{id}", func(w http.ResponseWriter, r *http.Request) {
		jsonReply(w, 200, api.Sandbox{ID: "sb-1", Project: "job-7", State: "running"})
	})
	if _, err := runCLI(t, mux, "sandbox", "create", "--base", "base/x:1", "--project", "job-7"); err != nil {
		t.Fatal(err)
	}
	if got.Project != "job-7" {
		t.Errorf("spec %+v", got)
	}
	out, err := runCLI(t, mux, "sandbox", "get", "sb-1")
	if err != nil || !strings.Contains(out, "Project:") || !strings.Contains(out, "job-7") {
		t.Errorf("sandbox get: %v\n%s", err, out)
	}
}

// TestKeyE2B: key e2b spells the configured key, or one read from stdin,
// as E2B's SDKs want it, and the spelling stands for that key.
func TestKeyE2B(t *testing.T) {
	const key = "dsec_abcdefghijklmnopqrstuvwxyz234567abcdefghijklmnopqrstu"
	conf := func(k string) func() (dsec.Config, error) {
		return func() (dsec.Config, error) { return dsec.Config{APIKey: k}, nil }
	}
	for _, tc := range []struct {
		name  string
		pos   []string
		stdin string
		conf  func() (dsec.Config, error)
		want  string // the key spelt; "" for an error
		err   string
	}{
		{"configured", nil, "", conf(key), key, ""},
		{"stdin", []string{"-"}, key + "\n", conf("other-key-0123456789"), key, ""},
		{"already E2B's shape", nil, "", conf("e2b_985895e32046e1404d05adfb33614a3026de2cb6"), "", ""},
		{"as an argument", []string{key}, "", conf(""), "", "standard input"},
		{"empty stdin", []string{"-"}, " \n", conf(key), "", "no key on standard input"},
		{"none configured", nil, "", conf(""), "", "DSEC_API_KEY"},
		{"not a key", []string{"-"}, "short", conf(""), "", "not a dsec key"},
		{"config error", nil, "", func() (dsec.Config, error) { return dsec.Config{}, errors.New("bad config") }, "", "bad config"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := e2bSpelling(tc.pos, strings.NewReader(tc.stdin), tc.conf)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("got %q, %v; want an error saying %q", got, err, tc.err)
				}
				return
			}
			if err != nil || !regexp.MustCompile(`^e2b_[0-9a-f]+$`).MatchString(got) {
				t.Fatalf("got %q, %v", got, err)
			}
			if tc.want == "" {
				if cfg, _ := tc.conf(); got != cfg.APIKey {
					t.Fatalf("an E2B-shaped key became %q", got)
				}
				return
			}
			if k, ok := iam.FromE2BKey(got); !ok || k != tc.want {
				t.Fatalf("%q spells %q (%v), want %q", got, k, ok, tc.want)
			}
		})
	}
}
