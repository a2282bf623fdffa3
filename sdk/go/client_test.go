package dsec

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
)

// fakeServer stands in for the apiserver: a ServeMux with Go 1.22 patterns,
// as the real one uses, so that escaping mistakes show up as 404s or wrong
// path values.
type fakeServer struct {
	*httptest.Server
	mux *http.ServeMux

	mu   sync.Mutex
	seen []*http.Request // every request, with its RequestURI
}

func newFakeServer(t *testing.T) (*fakeServer, *Client) {
	t.Helper()
	f := &fakeServer{mux: http.NewServeMux()}
	f.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		f.mu.Lock()
		f.seen = append(f.seen, r)
		f.mu.Unlock()
		f.mux.ServeHTTP(w, r)
	}))
	t.Cleanup(f.Close)
	c, err := New(WithEndpoint(f.URL), WithAPIKey("k-123"))
	if err != nil {
		t.Fatal(err)
	}
	return f, c
}

func (f *fakeServer) last() *http.Request {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.seen[len(f.seen)-1]
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func writeErr(w http.ResponseWriter, status int, code, msg string) {
	writeJSON(w, status, api.ErrorBody{Error: api.ErrorDetail{Code: code, Message: msg}})
}

func TestAuthHeaderAndCreate(t *testing.T) {
	f, c := newFakeServer(t)
	f.mux.HandleFunc("POST /v1/sandboxes", func(w http.ResponseWriter, r *http.Request) {
		if got := r.Header.Get("Authorization"); got != "Bearer k-123" {
			writeErr(w, 401, "unauthenticated", "bad key "+got)
			return
		}
		var spec api.SandboxSpec
		if err := json.NewDecoder(r.Body).Decode(&spec); err != nil {
			writeErr(w, 400, "invalid_argument", err.Error())
			return
		}
		writeJSON(w, 201, api.Sandbox{ID: "sb-e1-abc", State: api.StateRunning, Spec: spec})
	})
	sb, err := c.CreateSandbox(context.Background(), api.SandboxSpec{Base: "base/python:3.11", Labels: map[string]string{"job": "x"}})
	if err != nil {
		t.Fatal(err)
	}
	if sb.ID != "sb-e1-abc" || sb.Spec.Base != "base/python:3.11" || sb.Spec.Labels["job"] != "x" {
		t.Fatalf("unexpected sandbox %+v", sb)
	}
	if ct := f.last().Header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("Content-Type = %q", ct)
	}

	// Without a key no Authorization header is sent at all.
	c2, _ := New(WithEndpoint(f.URL))
	_, err = c2.CreateSandbox(context.Background(), api.SandboxSpec{Base: "b"})
	if !errors.Is(err, ErrUnauthenticated) {
		t.Fatalf("want ErrUnauthenticated, got %v", err)
	}
}

func TestPathEscaping(t *testing.T) {
	f, c := newFakeServer(t)
	var gotRef, gotID, gotSID string
	f.mux.HandleFunc("GET /v1/layers/{ref}", func(w http.ResponseWriter, r *http.Request) {
		gotRef = r.PathValue("ref")
		writeJSON(w, 200, api.Layer{Ref: gotRef, Digest: "sha256:00"})
	})
	f.mux.HandleFunc("DELETE /v1/layers/{ref}", func(w http.ResponseWriter, r *http.Request) {
		gotRef = r.PathValue("ref")
		w.WriteHeader(204)
	})
	f.mux.HandleFunc("POST /v1/sandboxes/{id}/sessions/{sid}/run", func(w http.ResponseWriter, r *http.Request) {
		gotID, gotSID = r.PathValue("id"), r.PathValue("sid")
		writeJSON(w, 200, api.ExecResult{ExitCode: 3, Stdout: "hi"})
	})
	f.mux.HandleFunc("GET /v1/sandboxes/{id}/files:stat", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, 200, api.FileEntry{Path: r.URL.Query().Get("path"), Type: "file"})
	})
	ctx := context.Background()

	l, err := c.GetLayer(ctx, "base/python:3.11")
	if err != nil {
		t.Fatal(err)
	}
	if gotRef != "base/python:3.11" || l.Ref != gotRef {
		t.Fatalf("server saw ref %q", gotRef)
	}
	if uri := f.last().RequestURI; uri != "/v1/layers/base%2Fpython:3.11" {
		t.Errorf("RequestURI = %q", uri)
	}
	if _, err := c.GetLayer(ctx, "sha256:abcd"); err != nil || gotRef != "sha256:abcd" {
		t.Fatalf("digest lookup: %v, ref %q", err, gotRef)
	}
	if err := c.DeleteLayer(ctx, "workspace/a b?:v1"); err != nil || gotRef != "workspace/a b?:v1" {
		t.Fatalf("delete: %v, ref %q", err, gotRef)
	}

	res, err := c.SessionRun(ctx, "sb-e1/x", "s 1", api.SessionRunRequest{Command: "true"})
	if err != nil {
		t.Fatal(err)
	}
	if gotID != "sb-e1/x" || gotSID != "s 1" || res.ExitCode != 3 {
		t.Fatalf("id %q sid %q res %+v", gotID, gotSID, res)
	}

	e, err := c.StatFile(ctx, "sb-1", "/repo/a b&c=d.py")
	if err != nil {
		t.Fatal(err)
	}
	if e.Path != "/repo/a b&c=d.py" {
		t.Fatalf("server saw path %q", e.Path)
	}
}

func TestErrorMapping(t *testing.T) {
	f, c := newFakeServer(t)
	f.mux.HandleFunc("GET /v1/sandboxes/{id}", func(w http.ResponseWriter, r *http.Request) {
		switch r.PathValue("id") {
		case "gone":
			writeErr(w, 404, "not_found", "sandbox gone not found")
		case "full":
			writeErr(w, 503, "resource_exhausted", "no node can hold it")
		case "quota":
			writeErr(w, 429, "quota_exceeded", "project over quota")
		case "boom":
			writeErr(w, 500, "internal", "boom")
		case "html":
			w.Header().Set("Content-Type", "text/html")
			w.WriteHeader(502)
			io.WriteString(w, "<html>"+strings.Repeat("x", 1000)+"</html>")
		case "plain404":
			http.NotFound(w, r)
		}
	})
	ctx := context.Background()
	tests := []struct {
		id       string
		class    error
		status   int
		code     string
		contains string
	}{
		{"gone", ErrNotFound, 404, "not_found", "sandbox gone not found"},
		{"full", ErrExhausted, 503, "resource_exhausted", "no node"},
		{"quota", ErrQuota, 429, "quota_exceeded", "over quota"},
		{"boom", nil, 500, "internal", "boom"},
		{"html", ErrUnavailable, 502, "unavailable", "HTTP 502 Bad Gateway: <html>xxx"},
		{"plain404", ErrNotFound, 404, "not_found", "404 page not found"},
	}
	for _, tt := range tests {
		t.Run(tt.id, func(t *testing.T) {
			_, err := c.GetSandbox(ctx, tt.id)
			var de *Error
			if !errors.As(err, &de) {
				t.Fatalf("want *Error, got %T %v", err, err)
			}
			if de.Status != tt.status || de.Code != tt.code {
				t.Errorf("status %d code %q", de.Status, de.Code)
			}
			if !strings.Contains(err.Error(), tt.contains) {
				t.Errorf("message %q lacks %q", err.Error(), tt.contains)
			}
			if len(err.Error()) > 300 {
				t.Errorf("message not truncated: %d bytes", len(err.Error()))
			}
			if tt.class != nil && !errors.Is(err, tt.class) {
				t.Errorf("errors.Is(%v, %v) = false", err, tt.class)
			}
			for _, other := range []error{ErrNotFound, ErrExhausted, ErrQuota, ErrUnavailable} {
				if other != tt.class && errors.Is(err, other) {
					t.Errorf("error also matches %v", other)
				}
			}
		})
	}
}

func TestDeleteSandbox(t *testing.T) {
	f, c := newFakeServer(t)
	var ids []string
	f.mux.HandleFunc("DELETE /v1/sandboxes/{id}", func(w http.ResponseWriter, r *http.Request) {
		ids = append(ids, r.PathValue("id"))
		w.WriteHeader(204)
	})
	f.mux.HandleFunc("POST /v1/sandboxes:delete", func(w http.ResponseWriter, r *http.Request) {
		var req api.LabelsRequest
		json.NewDecoder(r.Body).Decode(&req)
		writeJSON(w, 200, api.DeleteResult{Deleted: len(req.Labels) * 10})
	})
	ctx := context.Background()
	if err := c.DeleteSandbox(ctx, "sb-e1-unknown"); err != nil {
		t.Fatal(err)
	}
	if len(ids) != 1 || ids[0] != "sb-e1-unknown" {
		t.Fatalf("ids %v", ids)
	}
	n, err := c.DeleteSandboxes(ctx, map[string]string{"job": "a", "task": "b"})
	if err != nil || n != 20 {
		t.Fatalf("delete by labels: %d, %v", n, err)
	}
	if _, err := c.DeleteSandboxes(ctx, nil); !errors.Is(err, ErrInvalid) {
		t.Fatalf("empty labels: want ErrInvalid, got %v", err)
	}
}

// A call by labels that could not ask some nodes left their sandboxes as
// they were: the caller gets the count of the others and an unavailable
// error naming the nodes, not a success.
func TestByLabelsNamesUnreachableNodes(t *testing.T) {
	f, c := newFakeServer(t)
	f.mux.HandleFunc("POST /v1/sandboxes:delete", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, 200, api.DeleteResult{Deleted: 3, UnreachableNodes: []string{"e2"}})
	})
	for _, p := range []string{"pause", "resume"} {
		f.mux.HandleFunc("POST /v1/sandboxes:"+p, func(w http.ResponseWriter, r *http.Request) {
			writeJSON(w, 200, api.CountResult{Count: 4, UnreachableNodes: []string{"e1", "e3"}})
		})
	}
	ctx, job := context.Background(), map[string]string{"job": "j"}
	for _, tc := range []struct {
		call  func(context.Context, map[string]string) (int, error)
		n     int
		done  string
		nodes string
	}{
		{c.DeleteSandboxes, 3, "deleted", "e2"},
		{c.PauseSandboxes, 4, "paused", "e1,e3"},
		{c.ResumeSandboxes, 4, "resumed", "e1,e3"},
	} {
		n, err := tc.call(ctx, job)
		var nu *NodesUnreachableError
		if n != tc.n || !errors.As(err, &nu) || !errors.Is(err, ErrUnavailable) {
			t.Fatalf("%s: %d, %v", tc.done, n, err)
		}
		if nu.Done != tc.done || nu.Count != tc.n || strings.Join(nu.Nodes, ",") != tc.nodes || !strings.Contains(err.Error(), strings.ReplaceAll(tc.nodes, ",", ", ")) {
			t.Fatalf("%s: %+v: %v", tc.done, nu, err)
		}
	}
}

func TestListPagination(t *testing.T) {
	f, c := newFakeServer(t)
	f.mux.HandleFunc("GET /v1/sandboxes", func(w http.ResponseWriter, r *http.Request) {
		q := r.URL.Query()
		if got := q["label"]; len(got) != 2 || got[0] != "job=grpo-42" || got[1] != "task=a=b" {
			writeErr(w, 400, "invalid_argument", "labels "+strings.Join(got, ","))
			return
		}
		if q.Get("state") != "running" {
			writeErr(w, 400, "invalid_argument", "state")
			return
		}
		switch q.Get("page_token") {
		case "":
			writeJSON(w, 200, api.SandboxList{Sandboxes: []api.Sandbox{{ID: "a"}, {ID: "b"}}, NextPageToken: "p2"})
		case "p2":
			writeJSON(w, 200, api.SandboxList{Sandboxes: []api.Sandbox{{ID: "c"}}})
		}
	})
	all, err := c.ListAllSandboxes(context.Background(), ListOptions{
		State:  "running",
		Labels: map[string]string{"task": "a=b", "job": "grpo-42"},
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(all) != 3 || all[2].ID != "c" {
		t.Fatalf("got %+v", all)
	}
}

// ListAll keeps what every page said of nodes it could not ask: a caller
// must be able to tell a short list from a complete one.
func TestListAllKeepsUnreachableNodes(t *testing.T) {
	f, c := newFakeServer(t)
	f.mux.HandleFunc("GET /v1/sandboxes", func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Query().Get("page_token") {
		case "":
			writeJSON(w, 200, api.SandboxList{Sandboxes: []api.Sandbox{{ID: "a"}}, UnreachableNodes: []string{"e3", "e1"}, NextPageToken: "p2"})
		case "p2":
			writeJSON(w, 200, api.SandboxList{Sandboxes: []api.Sandbox{{ID: "b"}}, UnreachableNodes: []string{"e1", "e2"}})
		}
	})
	l, err := c.ListAll(context.Background(), ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(l.Sandboxes) != 2 || l.NextPageToken != "" || strings.Join(l.UnreachableNodes, ",") != "e1,e2,e3" {
		t.Fatalf("got %+v", l)
	}
	all, err := c.ListAllSandboxes(context.Background(), ListOptions{})
	if err != nil || len(all) != 2 {
		t.Fatalf("ListAllSandboxes: %v %+v", err, all)
	}
}

func TestListPaginationLoop(t *testing.T) {
	f, c := newFakeServer(t)
	f.mux.HandleFunc("GET /v1/sandboxes", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, 200, api.SandboxList{Sandboxes: []api.Sandbox{{ID: "a"}}, NextPageToken: "same"})
	})
	if _, err := c.ListAllSandboxes(context.Background(), ListOptions{}); err == nil {
		t.Fatal("want an error for a repeating page token")
	}
}

func TestExecStream(t *testing.T) {
	f, c := newFakeServer(t)
	f.mux.HandleFunc("POST /v1/sandboxes/{id}/exec", func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("stream") != "true" {
			writeErr(w, 400, "invalid_argument", "not streaming")
			return
		}
		var req api.ExecRequest
		json.NewDecoder(r.Body).Decode(&req)
		w.Header().Set("Content-Type", "application/x-ndjson")
		fl := w.(http.Flusher)
		switch req.Cmd {
		case "ok":
			io.WriteString(w, `{"stdout":"hel"}`+"\n")
			fl.Flush()
			io.WriteString(w, `{"stderr":"warn\n"}`+"\n"+`{"stdout_b64":"/w=="}`+"\n")
			io.WriteString(w, `{"exit_code":0}`+"\n")
			io.WriteString(w, `{"stdout":"after final, ignored"}`+"\n")
		case "fail":
			io.WriteString(w, `{"stdout":"x"}`+"\n"+`{"exit_code":7,"timed_out":true,"duration_ms":12}`) // no trailing newline
		case "cut":
			io.WriteString(w, `{"stdout":"x"}`+"\n")
		case "err":
			io.WriteString(w, `{"error":{"code":"not_found","message":"sandbox vanished"}}`+"\n")
		}
	})
	ctx := context.Background()

	var out, errb bytes.Buffer
	collect := func(ev api.ExecEvent) error {
		out.Write(OutputBytes(ev.Stdout, ev.StdoutB64))
		errb.Write(OutputBytes(ev.Stderr, ev.StderrB64))
		return nil
	}
	final, err := c.ExecStream(ctx, "sb-1", api.ExecRequest{Cmd: "ok"}, collect)
	if err != nil {
		t.Fatal(err)
	}
	if final.ExitCode == nil || *final.ExitCode != 0 {
		t.Fatalf("final %+v", final)
	}
	if out.String() != "hel\xff" || errb.String() != "warn\n" {
		t.Fatalf("stdout %q stderr %q", out.String(), errb.String())
	}

	final, err = c.ExecStream(ctx, "sb-1", api.ExecRequest{Cmd: "fail"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if *final.ExitCode != 7 || !final.TimedOut || final.DurationMS != 12 {
		t.Fatalf("final %+v", final)
	}

	// Cut short: unavailable (the command's fate is unknown), saying so.
	if _, err := c.ExecStream(ctx, "sb-1", api.ExecRequest{Cmd: "cut"}, nil); !errors.Is(err, io.ErrUnexpectedEOF) || !errors.Is(err, ErrUnavailable) ||
		!strings.Contains(err.Error(), "connection to the API server broke") {
		t.Fatalf("cut stream: want ErrUnexpectedEOF and ErrUnavailable, got %v", err)
	}
	if _, err := c.ExecStream(ctx, "sb-1", api.ExecRequest{Cmd: "err"}, nil); !errors.Is(err, ErrNotFound) {
		t.Fatalf("error event: want ErrNotFound, got %v", err)
	}
	stop := errors.New("stop")
	_, err = c.ExecStream(ctx, "sb-1", api.ExecRequest{Cmd: "ok"}, func(api.ExecEvent) error { return stop })
	if !errors.Is(err, stop) {
		t.Fatalf("callback error: got %v", err)
	}
}

func TestFiles(t *testing.T) {
	f, c := newFakeServer(t)
	var stored []byte
	var storedMode, storedCT string
	f.mux.HandleFunc("PUT /v1/sandboxes/{id}/files", func(w http.ResponseWriter, r *http.Request) {
		stored, _ = io.ReadAll(r.Body)
		storedMode = r.URL.Query().Get("mode")
		w.WriteHeader(204)
	})
	f.mux.HandleFunc("GET /v1/sandboxes/{id}/files", func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("path") != "/a" {
			writeErr(w, 404, "not_found", "no such file")
			return
		}
		w.Write(stored)
	})
	f.mux.HandleFunc("DELETE /v1/sandboxes/{id}/files", func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("recursive") != "true" {
			writeErr(w, 409, "failed_precondition", "directory not empty")
			return
		}
		w.WriteHeader(204)
	})
	f.mux.HandleFunc("GET /v1/sandboxes/{id}/files:list", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, 200, api.FileList{Entries: []api.FileEntry{{Path: "/repo/x", Type: "file", Mode: "0644"}, {Path: "depth=" + r.URL.Query().Get("depth")}}})
	})
	f.mux.HandleFunc("PUT /v1/sandboxes/{id}/files:tar", func(w http.ResponseWriter, r *http.Request) {
		storedCT = r.Header.Get("Content-Type")
		n, _ := io.Copy(io.Discard, r.Body)
		writeJSON(w, 200, api.TarResult{Files: 1, Bytes: n})
	})
	f.mux.HandleFunc("GET /v1/sandboxes/{id}/files:tar", func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "TARDATA:"+r.URL.Query().Get("path"))
	})
	ctx := context.Background()

	if err := c.WriteFile(ctx, "sb-1", "/a", strings.NewReader("\x00bin\xff"), 0o755|os.ModeSetuid); err != nil {
		t.Fatal(err)
	}
	if storedMode != "4755" {
		t.Errorf("mode = %q", storedMode)
	}
	got, err := c.ReadFile(ctx, "sb-1", "/a")
	if err != nil || string(got) != "\x00bin\xff" {
		t.Fatalf("ReadFile = %q, %v", got, err)
	}
	if err := c.WriteFile(ctx, "sb-1", "/b", strings.NewReader(""), 0); err != nil || storedMode != "" {
		t.Fatalf("mode 0 sent %q (%v)", storedMode, err)
	}
	if _, err := c.ReadFile(ctx, "sb-1", "/missing"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("want ErrNotFound, got %v", err)
	}
	if err := c.DeleteFile(ctx, "sb-1", "/d", false); !errors.Is(err, ErrPrecondition) {
		t.Fatalf("want ErrPrecondition, got %v", err)
	}
	if err := c.DeleteFile(ctx, "sb-1", "/d", true); err != nil {
		t.Fatal(err)
	}
	entries, err := c.ListFiles(ctx, "sb-1", "/repo", 3)
	if err != nil || len(entries) != 2 || entries[1].Path != "depth=3" {
		t.Fatalf("ListFiles = %+v, %v", entries, err)
	}

	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	zw.Write([]byte("tar"))
	zw.Close()
	res, err := c.UploadTar(ctx, "sb-1", "/repo", bytes.NewReader(gz.Bytes()))
	if err != nil || res.Bytes != int64(gz.Len()) || storedCT != "application/gzip" {
		t.Fatalf("UploadTar = %+v, %v, content type %q", res, err, storedCT)
	}
	if _, err := c.UploadTar(ctx, "sb-1", "/repo", strings.NewReader("plain")); err != nil || storedCT != "application/x-tar" {
		t.Fatalf("plain tar: %v, content type %q", err, storedCT)
	}
	var dl bytes.Buffer
	if n, err := c.DownloadTar(ctx, "sb-1", "/repo", &dl); err != nil || n != int64(dl.Len()) || dl.String() != "TARDATA:/repo" {
		t.Fatalf("DownloadTar = %d %q %v", n, dl.String(), err)
	}
}

func TestBuildLayerClosesBody(t *testing.T) {
	f, c := newFakeServer(t)
	f.mux.HandleFunc("POST /v1/layers", func(w http.ResponseWriter, r *http.Request) {
		q := r.URL.Query()
		n, _ := io.Copy(io.Discard, r.Body)
		writeJSON(w, 201, api.Layer{Ref: q.Get("kind") + "/" + q.Get("name") + ":" + q.Get("tag"), SizeBytes: n})
	})
	pr, pw := io.Pipe()
	go func() {
		pw.Write([]byte("some tar bytes"))
		pw.Close()
	}()
	l, err := c.BuildLayer(context.Background(), "workspace", "sphinx", "v1", pr)
	if err != nil {
		t.Fatal(err)
	}
	if l.Ref != "workspace/sphinx:v1" || l.SizeBytes != 14 {
		t.Fatalf("layer %+v", l)
	}
}

// An early error answer must not leave a producer writing into a pipe
// nobody reads: the body is closed when the request is done.
func TestEarlyErrorUnblocksPipe(t *testing.T) {
	f, c := newFakeServer(t)
	f.mux.HandleFunc("POST /v1/layers", func(w http.ResponseWriter, r *http.Request) {
		writeErr(w, 403, "permission_denied", "builders only")
	})
	pr, pw := io.Pipe()
	done := make(chan error, 1)
	go func() {
		chunk := make([]byte, 64<<10)
		for {
			if _, err := pw.Write(chunk); err != nil {
				done <- err
				return
			}
		}
	}()
	_, err := c.BuildLayer(context.Background(), "base", "x", "1", pr)
	if !errors.Is(err, ErrPermissionDenied) {
		t.Fatalf("want ErrPermissionDenied, got %v", err)
	}
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("producer still blocked on the pipe")
	}
}

func TestHealth(t *testing.T) {
	f, c := newFakeServer(t)
	f.mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
	if err := c.Health(context.Background()); err != nil {
		t.Fatal(err)
	}
	c2, _ := New(WithEndpoint("http://127.0.0.1:1"))
	if err := c2.Health(context.Background()); err == nil {
		t.Fatal("want an error from a closed port")
	}
}

func TestEndpointNormalization(t *testing.T) {
	tests := []struct{ in, want string }{
		{"http://h:7070/", "http://h:7070"},
		{"h:7070", "http://h:7070"},
		{"https://h/prefix/", "https://h/prefix"},
		{"ftp://h", ""},
		{"", ""},
		{"http://h?x=1", ""},
	}
	for _, tt := range tests {
		got, err := normalizeEndpoint(tt.in)
		if tt.want == "" {
			if err == nil {
				t.Errorf("%q: want error, got %q", tt.in, got)
			}
			continue
		}
		if err != nil || got != tt.want {
			t.Errorf("%q: got %q, %v; want %q", tt.in, got, err, tt.want)
		}
	}
}

func TestConfigPrecedence(t *testing.T) {
	home := t.TempDir()
	t.Setenv("HOME", home)
	t.Setenv(EnvConfig, "")
	t.Setenv(EnvEndpoint, "")
	t.Setenv(EnvAPIKey, "")

	// Nothing anywhere: the default endpoint, no key.
	cfg, err := ResolveConfig()
	if err != nil || cfg.Endpoint != DefaultEndpoint || cfg.APIKey != "" {
		t.Fatalf("defaults: %+v, %v", cfg, err)
	}

	// The default file.
	def := filepath.Join(home, ".config", "dsec", "config.json")
	if err := SaveConfig(def, Config{Endpoint: "http://file:1", APIKey: "file-key"}); err != nil {
		t.Fatal(err)
	}
	cfg, err = ResolveConfig()
	if err != nil || cfg.Endpoint != "http://file:1" || cfg.APIKey != "file-key" {
		t.Fatalf("file: %+v, %v", cfg, err)
	}

	// Environment wins, field by field.
	t.Setenv(EnvEndpoint, "http://env:2")
	cfg, _ = ResolveConfig()
	if cfg.Endpoint != "http://env:2" || cfg.APIKey != "file-key" {
		t.Fatalf("env endpoint: %+v", cfg)
	}
	t.Setenv(EnvAPIKey, "env-key")
	c, err := FromEnv()
	if err != nil || c.Endpoint() != "http://env:2" || c.apiKey != "env-key" {
		t.Fatalf("env both: %v %v", c, err)
	}
	// Options given to FromEnv win over everything.
	c, err = FromEnv(WithEndpoint("http://opt:3"))
	if err != nil || c.Endpoint() != "http://opt:3" {
		t.Fatalf("option: %v %v", c, err)
	}

	// DSEC_CONFIG moves the file; a missing explicit file is an error.
	t.Setenv(EnvEndpoint, "")
	t.Setenv(EnvAPIKey, "")
	other := filepath.Join(t.TempDir(), "c.json")
	if err := os.WriteFile(other, []byte(`{"endpoint":"http://other:4","api_key":"o"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv(EnvConfig, other)
	cfg, err = ResolveConfig()
	if err != nil || cfg.Endpoint != "http://other:4" || cfg.APIKey != "o" {
		t.Fatalf("DSEC_CONFIG: %+v, %v", cfg, err)
	}
	t.Setenv(EnvConfig, filepath.Join(home, "nope.json"))
	if _, err := ResolveConfig(); err == nil {
		t.Fatal("missing DSEC_CONFIG file: want error")
	}

	// A malformed file is reported, not ignored.
	bad := filepath.Join(home, "bad.json")
	os.WriteFile(bad, []byte("{"), 0o600)
	t.Setenv(EnvConfig, bad)
	if _, err := FromEnv(); err == nil {
		t.Fatal("malformed config: want error")
	}
}

func TestSaveConfigPermissions(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "a", "dsec")
	path := filepath.Join(dir, "config.json")
	if err := SaveConfig(path, Config{Endpoint: "http://x:7070", APIKey: "secret"}); err != nil {
		t.Fatal(err)
	}
	// Overwriting keeps 0600 even if someone loosened the old file.
	os.Chmod(path, 0o644)
	if err := SaveConfig(path, Config{Endpoint: "http://y:7070", APIKey: "secret2"}); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Errorf("file mode %v", fi.Mode().Perm())
	}
	di, _ := os.Stat(dir)
	if di.Mode().Perm() != 0o700 {
		t.Errorf("dir mode %v", di.Mode().Perm())
	}
	cfg, err := LoadConfig(path)
	if err != nil || cfg.APIKey != "secret2" || cfg.Endpoint != "http://y:7070" {
		t.Fatalf("LoadConfig = %+v, %v", cfg, err)
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 1 {
		t.Errorf("temp files left behind: %v", entries)
	}
}

func TestConcurrentRequestsReuseConnections(t *testing.T) {
	var mu sync.Mutex
	conns := map[string]bool{}
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		conns[r.RemoteAddr] = true
		mu.Unlock()
		writeJSON(w, 200, api.Sandbox{ID: "x"})
	}))
	srv.Start()
	defer srv.Close()
	c, _ := New(WithEndpoint(srv.URL))
	const workers, rounds = 50, 10
	var wg sync.WaitGroup
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range rounds {
				if _, err := c.GetSandbox(context.Background(), "x"); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	// With the default 2 idle connections per host this would be hundreds.
	if len(conns) > 2*workers {
		t.Errorf("%d connections for %d workers", len(conns), workers)
	}
}
