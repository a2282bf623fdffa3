package main

import (
	"archive/tar"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/dsecproject/dsec/api"
)

// runCLI runs one client command against handler, capturing stdout.
func runCLI(t *testing.T, handler http.Handler, args ...string) (stdout string, err error) {
	t.Helper()
	stdout, _, err = runCLIStderr(t, handler, args...)
	return stdout, err
}

// runCLIStderr is runCLI capturing stderr too.
func runCLIStderr(t *testing.T, handler http.Handler, args ...string) (stdout, stderr string, err error) {
	t.Helper()
	out, err := os.CreateTemp(t.TempDir(), "stdout")
	if err != nil {
		t.Fatal(err)
	}
	errf, err := os.CreateTemp(t.TempDir(), "stderr")
	if err != nil {
		t.Fatal(err)
	}
	err = runCLIOn(t, handler, out, errf, args...)
	b, _ := os.ReadFile(out.Name())
	e, _ := os.ReadFile(errf.Name())
	out.Close()
	errf.Close()
	return string(b), string(e), err
}

// runCLIOn runs one client command against handler with stdout and stderr
// going to out and errf.
func runCLIOn(t *testing.T, handler http.Handler, out, errf *os.File, args ...string) error {
	t.Helper()
	srv := httptest.NewServer(handler)
	defer srv.Close()
	t.Setenv("DSEC_ENDPOINT", srv.URL)
	t.Setenv("DSEC_API_KEY", "test-key")
	t.Setenv("DSEC_CONFIG", "")
	t.Setenv("HOME", t.TempDir())

	oldOut, oldErr := os.Stdout, os.Stderr
	os.Stdout, os.Stderr = out, errf
	handled, err := runCommand(args[0], args[1:])
	os.Stdout, os.Stderr = oldOut, oldErr
	if !handled {
		t.Fatalf("%s not handled", args[0])
	}
	return err
}

func jsonReply(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(v)
}

func TestCLIExecExitCode(t *testing.T) {
	var got api.ExecRequest
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/sandboxes/{id}/exec", func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer test-key" {
			jsonReply(w, 401, api.ErrorBody{Error: api.ErrorDetail{Code: "unauthenticated", Message: "no"}})
			return
		}
		got = api.ExecRequest{}
		json.NewDecoder(r.Body).Decode(&got)
		jsonReply(w, 200, api.ExecResult{ExitCode: 3, Stdout: "out\n", Stderr: "err\n"})
	})
	out, err := runCLI(t, mux, "exec", "--cwd", "/repo", "--env", "A=1", "sb-1", "--", "ls", "-la")
	var ec *exitCodeError
	if !errors.As(err, &ec) || ec.ExitCode() != 3 {
		t.Fatalf("want exit code 3, got %v", err)
	}
	if out != "out\n" {
		t.Errorf("stdout %q", out)
	}
	if !slices.Equal(got.Argv, []string{"ls", "-la"}) || got.Cwd != "/repo" || got.Env["A"] != "1" || got.Cmd != "" {
		t.Errorf("request %+v", got)
	}

	_, err = runCLI(t, mux, "exec", "sb-1", "--cmd", "echo hi | wc")
	if !errors.As(err, &ec) || got.Cmd != "echo hi | wc" || got.Argv != nil {
		t.Errorf("--cmd: err %v request %+v", err, got)
	}
	if _, err := runCLI(t, mux, "exec", "sb-1"); err == nil || errors.As(err, &ec) {
		t.Errorf("no command: got %v", err)
	}
}

func TestCLISandboxCreateBatchAndList(t *testing.T) {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/sandboxes:batch", func(w http.ResponseWriter, r *http.Request) {
		var req api.BatchCreateRequest
		json.NewDecoder(r.Body).Decode(&req)
		if req.Spec.Base != "base/py:1" || req.Spec.Labels["job"] != "j" || !slices.Equal(req.Spec.Toolkits, []string{"toolkit/a:1", "toolkit/b:1"}) || req.Spec.TTL != 600 {
			jsonReply(w, 400, api.ErrorBody{Error: api.ErrorDetail{Code: "invalid_argument", Message: "bad spec"}})
			return
		}
		res := api.BatchResult{Errors: []api.BatchError{{Index: 2, Error: api.ErrorDetail{Code: "resource_exhausted", Message: "full"}}}}
		for i := 0; i < req.Count-1; i++ {
			res.Sandboxes = append(res.Sandboxes, api.Sandbox{ID: "sb-e-" + string(rune('a'+i))})
		}
		jsonReply(w, 200, res)
	})
	mux.HandleFunc("GET /v1/sandboxes", func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("page_token") == "" {
			jsonReply(w, 200, api.SandboxList{Sandboxes: []api.Sandbox{{ID: "sb-1", State: "running", Spec: api.SandboxSpec{Base: "base/py:1"}, Labels: map[string]string{"job": "j"}}}, NextPageToken: "2"})
			return
		}
		jsonReply(w, 200, api.SandboxList{Sandboxes: []api.Sandbox{{ID: "sb-2", State: "paused"}}})
	})
	out, err := runCLI(t, mux, "sandbox", "create", "--base", "base/py:1", "--label", "job=j",
		"--toolkit", "toolkit/a:1", "--toolkit", "toolkit/b:1", "--ttl", "10m", "--count", "3")
	if err == nil || !strings.Contains(err.Error(), "1 of 3") {
		t.Errorf("partial batch: got %v", err)
	}
	if out != "sb-e-a\nsb-e-b\n" {
		t.Errorf("stdout %q", out)
	}

	out, err = runCLI(t, mux, "sandbox", "list")
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 3 || !strings.HasPrefix(lines[0], "ID") || !strings.Contains(lines[1], "job=j") || !strings.HasPrefix(lines[2], "sb-2") {
		t.Errorf("table:\n%s", out)
	}
}

func TestCLILayerBuildDir(t *testing.T) {
	dir := t.TempDir()
	os.MkdirAll(filepath.Join(dir, "etc"), 0o755)
	os.WriteFile(filepath.Join(dir, "etc", "hello"), []byte("hello"), 0o600)
	os.Symlink("etc/hello", filepath.Join(dir, "hi"))

	var names []string
	var query string
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/layers", func(w http.ResponseWriter, r *http.Request) {
		query = r.URL.RawQuery
		tr := tar.NewReader(r.Body)
		for {
			h, err := tr.Next()
			if err != nil {
				break
			}
			names = append(names, h.Name)
		}
		io.Copy(io.Discard, r.Body)
		jsonReply(w, 201, api.Layer{Ref: "workspace/w:v1", Digest: "sha256:abc", SizeBytes: 4096})
	})
	out, err := runCLI(t, mux, "layer", "build", "--kind", "workspace", "--name", "w", dir, "--tag", "v1")
	if err != nil {
		t.Fatal(err)
	}
	if query != "kind=workspace&name=w&tag=v1" {
		t.Errorf("query %q", query)
	}
	if !slices.Equal(names, []string{"etc/", "etc/hello", "hi"}) {
		t.Errorf("entries %q", names)
	}
	if !strings.HasPrefix(out, "workspace/w:v1 sha256:abc") {
		t.Errorf("stdout %q", out)
	}

	// A refusal reaches the user even though the tar stream was cut.
	mux2 := http.NewServeMux()
	mux2.HandleFunc("POST /v1/layers", func(w http.ResponseWriter, r *http.Request) {
		jsonReply(w, 403, api.ErrorBody{Error: api.ErrorDetail{Code: "permission_denied", Message: "builders only"}})
	})
	if _, err := runCLI(t, mux2, "layer", "build", "--kind", "base", "--name", "x", "--tag", "v1", dir); err == nil || !strings.Contains(err.Error(), "builders only") {
		t.Errorf("refusal: got %v", err)
	}
	if _, err := runCLI(t, mux2, "layer", "build", "--kind", "nope", "--name", "x", "--tag", "v1", dir); err == nil {
		t.Error("bad kind accepted")
	}
	if _, err := runCLI(t, mux2, "layer", "build", "--kind", "base", "--name", "x", dir); err == nil || !strings.Contains(err.Error(), "--tag is required") {
		t.Errorf("missing tag: got %v", err)
	}
}

func TestCLIFilesPull(t *testing.T) {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/sandboxes/{id}/files:tar", func(w http.ResponseWriter, r *http.Request) {
		tw := tar.NewWriter(w)
		name := "repo/a.txt"
		if r.URL.Query().Get("path") == "/evil" {
			name = "../escaped.txt"
		}
		tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: 2, Typeflag: tar.TypeReg})
		tw.Write([]byte("ok"))
		tw.Close()
	})
	mux.HandleFunc("GET /v1/sandboxes/{id}/files", func(w http.ResponseWriter, r *http.Request) {
		jsonReply(w, 404, api.ErrorBody{Error: api.ErrorDetail{Code: "not_found", Message: "no such file"}})
	})
	parent := t.TempDir()
	dst := filepath.Join(parent, "out")
	if _, err := runCLI(t, mux, "files", "pull", "sb-1", "/repo", dst); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(dst, "repo", "a.txt")); string(b) != "ok" {
		t.Errorf("pulled %q", b)
	}
	if _, err := runCLI(t, mux, "files", "pull", "sb-1", "/evil", dst); err == nil || !strings.Contains(err.Error(), "outside") {
		t.Errorf("escape: got %v", err)
	}
	if _, err := os.Stat(filepath.Join(parent, "escaped.txt")); err == nil {
		t.Error("file escaped the target directory")
	}
	// files get -o of a missing file leaves nothing behind.
	target := filepath.Join(parent, "got.txt")
	if _, err := runCLI(t, mux, "files", "get", "-o", target, "sb-1", "/missing"); err == nil || !strings.Contains(err.Error(), "no such file") {
		t.Errorf("get missing: %v", err)
	}
	if entries, _ := os.ReadDir(parent); len(entries) != 1 {
		t.Errorf("left behind: %v", entries)
	}
}

func TestRunCommandUnknown(t *testing.T) {
	if handled, _ := runCommand("server", nil); handled {
		t.Error("server must be left to main")
	}
}

func TestCLIExecStreamTimeout(t *testing.T) {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/sandboxes/{id}/exec", func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("stream") != "true" {
			jsonReply(w, 400, api.ErrorBody{Error: api.ErrorDetail{Code: "invalid_argument", Message: "want stream"}})
			return
		}
		io.WriteString(w, `{"stdout":"tick\n"}`+"\n"+`{"stderr":"warn\n"}`+"\n"+`{"stdout":"tock\n"}`+"\n")
		io.WriteString(w, `{"exit_code":-1,"timed_out":true,"duration_ms":1000}`+"\n")
	})
	out, err := runCLI(t, mux, "exec", "--stream", "--timeout", "1s", "sb-1", "--", "sleep", "9")
	var ec *exitCodeError
	if !errors.As(err, &ec) || ec.ExitCode() != exitTimedOut {
		t.Fatalf("want exit %d, got %v", exitTimedOut, err)
	}
	if out != "tick\ntock\n" {
		t.Errorf("stdout %q", out)
	}
}

// TestCLIFnCall: the request carries the uploads by name, the fetch
// names, env and binary stdin; the answer's exact output bytes go out,
// fetched files land under --out by the names asked for only, and the
// command's status is dsec's.
func TestCLIFnCall(t *testing.T) {
	var got api.FnCallRequest
	reply := api.FnCallResult{ExitCode: 3, Stdout: "\uFFFDx", StdoutB64: "/3g=", Missing: []string{"nope"},
		Files: map[string]string{"out/r.txt": "cmVzCg==", "../evil": "eA==", "extra": "eA=="}}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/fncall", func(w http.ResponseWriter, r *http.Request) {
		if err := json.NewDecoder(r.Body).Decode(&got); err != nil {
			t.Error(err)
		}
		jsonReply(w, 200, reply)
	})
	dir := t.TempDir()
	src := filepath.Join(dir, "main.py")
	stdin := filepath.Join(dir, "stdin.bin")
	os.WriteFile(src, []byte("print(1)\n"), 0o644)
	os.WriteFile(stdin, []byte{0xff, 0}, 0o644)
	outDir := filepath.Join(dir, "results", "deep")
	out, errOut, err := runCLIStderr(t, mux, "fncall", "--file", src, "--file", "pkg/m.py="+src, "--fetch", "out/r.txt", "--fetch", "nope",
		"--fetch", "nope", "--out", outDir, "--env", "A=b", "--stdin", stdin, "--timeout", "2m", "base/x:1", "--", "python3", "main.py")
	var ec *exitCodeError
	if !errors.As(err, &ec) || ec.ExitCode() != 3 {
		t.Fatalf("want exit 3, got %v", err)
	}
	if out != "\xffx" {
		t.Errorf("stdout %q, want the exact bytes", out)
	}
	if errOut != "dsec: fncall: /work/nope was not a file when the command ended\n" {
		t.Errorf("stderr %q", errOut)
	}
	want := api.FnCallRequest{Base: "base/x:1", Argv: []string{"python3", "main.py"},
		Files:    map[string]string{"main.py": "cHJpbnQoMSkK", "pkg/m.py": "cHJpbnQoMSkK"},
		Env:      map[string]string{"A": "b"},
		StdinB64: "/wA=", Timeout: 120, FetchFiles: []string{"out/r.txt", "nope"}}
	if g, w := fmt.Sprintf("%+v", got), fmt.Sprintf("%+v", want); g != w {
		t.Errorf("request\n%s\nwant\n%s", g, w)
	}
	if b, err := os.ReadFile(filepath.Join(outDir, "out", "r.txt")); string(b) != "res\n" {
		t.Errorf("fetched file: %q %v", b, err)
	}
	// Only the names asked for are written, whatever the answer holds.
	for _, p := range []string{filepath.Join(dir, "results", "evil"), filepath.Join(outDir, "extra")} {
		if _, err := os.Stat(p); err == nil {
			t.Errorf("%s written though not asked for", p)
		}
	}

	// Links already in --out are replaced, not written through: a
	// symlinked directory pointing out is refused, a symlink or hard link
	// to a file is replaced by the fetched file. The other files are
	// still written, and a write failure is an error even when the
	// command succeeded.
	escDir, outside := filepath.Join(dir, "esc"), filepath.Join(dir, "outside")
	os.MkdirAll(escDir, 0o755)
	os.Mkdir(outside, 0o755)
	os.Symlink(outside, filepath.Join(escDir, "out"))
	victim := filepath.Join(outside, "victim")
	os.WriteFile(victim, []byte("keep"), 0o644)
	os.Symlink(victim, filepath.Join(escDir, "sym.txt"))
	os.Link(victim, filepath.Join(escDir, "hard.txt"))
	reply = api.FnCallResult{Files: map[string]string{"out/r.txt": "eA==", "sym.txt": "eA==", "hard.txt": "eA=="}}
	_, errOut, err = runCLIStderr(t, mux, "fncall", "--fetch", "out/r.txt", "--fetch", "sym.txt", "--fetch", "hard.txt", "--out", escDir, "base/x:1", "--cmd", "true")
	if err == nil || !strings.Contains(errOut, "writing "+filepath.Join(escDir, "out", "r.txt")) {
		t.Errorf("fetch through a symlink out of --out: %v %q", err, errOut)
	}
	if ents, _ := os.ReadDir(outside); len(ents) != 1 {
		t.Errorf("written outside --out: %v", ents)
	}
	if b, _ := os.ReadFile(victim); string(b) != "keep" {
		t.Errorf("a link in --out was written through: the file outside holds %q", b)
	}
	for _, n := range []string{"sym.txt", "hard.txt"} {
		if b, _ := os.ReadFile(filepath.Join(escDir, n)); string(b) != "x" {
			t.Errorf("%s: %q, want the fetched file in place of the link", n, b)
		}
	}
	// A failed command keeps its status when a file cannot be written.
	reply.ExitCode = 5
	if _, err := runCLI(t, mux, "fncall", "--fetch", "out/r.txt", "--out", escDir, "base/x:1", "--cmd", "true"); !errors.As(err, &ec) || ec.ExitCode() != 5 {
		t.Errorf("write failure after exit 5: %v", err)
	}
	if ents, _ := os.ReadDir(escDir); len(ents) != 3 {
		t.Errorf("temporary files left in --out: %v", ents)
	}

	// A local path with '=' in it is taken whole when it exists.
	eq := filepath.Join(dir, "a=b.txt")
	os.WriteFile(eq, []byte("eq"), 0o644)
	reply = api.FnCallResult{}
	if _, err := runCLI(t, mux, "fncall", "--file", eq, "base/x:1", "--cmd", "true"); err != nil || got.Files["a=b.txt"] != "ZXE=" {
		t.Errorf("--file %s: %v, files %v", eq, err, got.Files)
	}

	// Bad input is refused before any call.
	got = api.FnCallRequest{}
	for _, bad := range [][]string{
		{"base/x:1"},
		{"--cmd", "true", "base/x:1", "--", "true"},
		{"--fetch", "../x", "base/x:1", "--cmd", "true"},
		{"--fetch", "/etc/passwd", "base/x:1", "--cmd", "true"},
		{"--file", dir, "base/x:1", "--cmd", "true"},
		{"--file", filepath.Join(dir, "absent"), "base/x:1", "--cmd", "true"},
		{"--file", "a=" + src, "--file", "a=" + src, "base/x:1", "--cmd", "true"},
		{"--fetch", "x", "--out", src, "base/x:1", "--cmd", "true"},
		{"--fetch", ".", "base/x:1", "--cmd", "true"},
	} {
		if _, err := runCLI(t, mux, append([]string{"fncall"}, bad...)...); err == nil {
			t.Errorf("fncall %q: no error", bad)
		}
	}
	if got.Base != "" {
		t.Errorf("a refused call reached the server: %+v", got)
	}
}

// Delete, pause and resume by labels that could not ask a node print what
// they did and fail, naming the node: its sandboxes were left.
func TestCLIByLabelsNamesUnreachableNodes(t *testing.T) {
	mux := http.NewServeMux()
	down := true
	mux.HandleFunc("POST /v1/sandboxes:delete", func(w http.ResponseWriter, r *http.Request) {
		res := api.DeleteResult{Deleted: 2}
		if down {
			res.UnreachableNodes = []string{"e1"}
		}
		jsonReply(w, 200, res)
	})
	for _, verb := range []string{"pause", "resume"} {
		mux.HandleFunc("POST /v1/sandboxes:"+verb, func(w http.ResponseWriter, r *http.Request) {
			jsonReply(w, 200, api.CountResult{Count: 3, UnreachableNodes: []string{"e1"}})
		})
	}
	for _, tc := range []struct{ verb, out string }{{"delete", "deleted 2 sandboxes\n"}, {"pause", "paused 3 sandboxes\n"}, {"resume", "resumed 3 sandboxes\n"}} {
		out, err := runCLI(t, mux, "sandbox", tc.verb, "--label", "job=j")
		if out != tc.out || err == nil || !strings.Contains(err.Error(), "could not be asked") || !strings.Contains(err.Error(), "e1") {
			t.Errorf("%s: stdout %q, err %v", tc.verb, out, err)
		}
	}
	down = false
	if out, err := runCLI(t, mux, "sandbox", "delete", "--label", "job=j"); out != "deleted 2 sandboxes\n" || err != nil {
		t.Errorf("every node asked: stdout %q, err %v", out, err)
	}
}

// dsec nodes shows capacity and, under the table, why a node is down.
func TestCLINodes(t *testing.T) {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/nodes", func(w http.ResponseWriter, r *http.Request) {
		jsonReply(w, 200, api.NodeList{Nodes: []api.Node{
			{Name: "e1", Healthy: true, Backends: []string{"container"}, Capacity: api.Capacity{MaxSandboxes: 100, CPU: 2, MemoryMB: 22057}, Counts: map[string]int{"running": 3}},
			{Name: "e2", Unhealthy: "not in the node registry (lease lost)", Capacity: api.Capacity{MaxSandboxes: 50}},
		}})
	})
	out, err := runCLI(t, mux, "nodes")
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 4 || !strings.Contains(lines[1], "healthy") || !strings.Contains(lines[1], "21.5 GiB") || !strings.Contains(lines[2], "unhealthy") ||
		lines[3] != "e2: not in the node registry (lease lost)" {
		t.Errorf("nodes:\n%s", out)
	}
}
