package apiserver

import (
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"io"
	"log/slog"
	"mime/multipart"
	"net/http"
	"net/textproto"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/e2b/filesystempb"
	"github.com/dsecproject/dsec/internal/e2b/filesystempb/filesystempbconnect"
	"github.com/dsecproject/dsec/internal/edgeapi"
)

// envdSandbox creates a sandbox (spec user "user") on the fixture's edge
// and returns its id and envd access token.
func (f *fixture) envdSandbox(t *testing.T) (string, string) {
	t.Helper()
	sb, err := f.edge.Create(t.Context(), edgeapi.CreateRequest{Spec: api.SandboxSpec{Backend: "container", User: "user"}})
	if err != nil {
		t.Fatal(err)
	}
	return sb.ID, f.envdTokenOf(t, sb.ID)
}

// envdTokenOf computes sandbox id's token as any apiserver over the
// fixture's store does.
func (f *fixture) envdTokenOf(t testing.TB, id string) string {
	t.Helper()
	s := New(Deps{IAM: f.iam, Nodes: f.view, Store: f.st, Log: slog.New(slog.DiscardHandler)})
	tok, err := s.envdToken(id)
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

// headers adds fixed headers to every request.
type headers struct {
	h  http.Header
	rt http.RoundTripper
}

func (h headers) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	for k, v := range h.h {
		r.Header[k] = v
	}
	return h.rt.RoundTrip(r)
}

// fsClient is the Connect client the E2B SDK amounts to: JSON, with the
// sandbox's headers.
func (f *fixture) fsClient(id, token string) filesystempbconnect.FilesystemClient {
	h := http.Header{"E2b-Sandbox-Id": {id}, "E2b-Sandbox-Port": {envdPort}}
	if token != "" {
		h.Set("X-Access-Token", token)
	}
	hc := &http.Client{Transport: headers{h: h, rt: http.DefaultTransport}}
	return filesystempbconnect.NewFilesystemClient(hc, f.srv.URL, connect.WithProtoJSON())
}

func asUser(req interface{ Header() http.Header }, user string) {
	req.Header().Set("Authorization", "Basic "+base64.StdEncoding.EncodeToString([]byte(user+":")))
}

func wantCode(t *testing.T, what string, err error, code connect.Code) {
	t.Helper()
	if connect.CodeOf(err) != code {
		t.Fatalf("%s: %v (code %v), want %v", what, err, connect.CodeOf(err), code)
	}
}

func TestEnvdFilesAuth(t *testing.T) {
	f := newFixture(t, false)
	id, tok := f.envdSandbox(t)
	_, otherTok := f.envdSandbox(t)
	before := f.edge.Tree(id)
	for name, c := range map[string]filesystempbconnect.FilesystemClient{
		"no token": f.fsClient(id, ""), "another sandbox's token": f.fsClient(id, otherTok), "a made-up token": f.fsClient(id, "x"+tok),
	} {
		_, err := c.MakeDir(t.Context(), connect.NewRequest(&filesystempb.MakeDirRequest{Path: "/made"}))
		wantCode(t, name+": MakeDir", err, connect.CodeUnauthenticated)
		stream, err := c.WatchDir(t.Context(), connect.NewRequest(&filesystempb.WatchDirRequest{Path: "/"}))
		if err == nil {
			if stream.Receive() {
				t.Fatalf("%s: a watch sent %v", name, stream.Msg())
			}
			err = stream.Err()
		}
		wantCode(t, name+": WatchDir", err, connect.CodeUnauthenticated)
		// The plain HTTP routes refuse in E2B's error shape.
		req, _ := http.NewRequest("POST", f.srv.URL+"/files?path=/made.txt", strings.NewReader("x"))
		req.Header.Set("Content-Type", "application/octet-stream")
		req.Header.Set("E2b-Sandbox-Id", id)
		if name != "no token" {
			req.Header.Set("X-Access-Token", map[string]string{"another sandbox's token": otherTok, "a made-up token": "x" + tok}[name])
		}
		resp, body := send(t, req)
		if resp.StatusCode != 401 || !strings.Contains(string(body), `"code":401`) {
			t.Fatalf("%s: upload answered %d %s", name, resp.StatusCode, body)
		}
	}
	if after := f.edge.Tree(id); !slices.Equal(before, after) {
		t.Fatalf("refused requests changed the sandbox: %v, then %v", before, after)
	}
	// No sandbox named at all: a Connect error too.
	_, err := f.fsClient("", "").Stat(t.Context(), connect.NewRequest(&filesystempb.StatRequest{Path: "/"}))
	wantCode(t, "no sandbox", err, connect.CodeInvalidArgument)
	// The right token works.
	if _, err := f.fsClient(id, tok).Stat(t.Context(), connect.NewRequest(&filesystempb.StatRequest{Path: "/"})); err != nil {
		t.Fatal(err)
	}
}

func send(t *testing.T, req *http.Request) (*http.Response, []byte) {
	t.Helper()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, b
}

func TestEnvdFilesystem(t *testing.T) {
	bothWays(t, func(t *testing.T, f *fixture) {
		ctx := t.Context()
		id, tok := f.envdSandbox(t)
		c := f.fsClient(id, tok)

		mk := connect.NewRequest(&filesystempb.MakeDirRequest{Path: "proj/src"})
		asUser(mk, "user")
		res, err := c.MakeDir(ctx, mk)
		if err != nil {
			t.Fatal(err)
		}
		// The directory is the user's (the fake's "user" is 1000).
		if e := res.Msg.Entry; e.Path != "/home/user/proj/src" || e.Name != "src" || e.Type != filesystempb.FileType_FILE_TYPE_DIRECTORY || e.Permissions != "drwxr-xr-x" || e.Mode != 0o755 ||
			e.Owner != "1000" || e.Group != "1000" {
			t.Fatalf("MakeDir = %v", e)
		}
		_, err = c.MakeDir(ctx, mk)
		wantCode(t, "MakeDir twice", err, connect.CodeAlreadyExists)
		// No user named: the sandbox's own (its spec's "user"), who owns
		// the directory; root's home is /root; "~" is the home.
		if res, err := c.MakeDir(ctx, connect.NewRequest(&filesystempb.MakeDirRequest{Path: "default"})); err != nil || res.Msg.Entry.Path != "/home/user/default" || res.Msg.Entry.Owner != "1000" {
			t.Fatalf("MakeDir as the default user: %v, %v", res, err)
		}
		asRoot := connect.NewRequest(&filesystempb.MakeDirRequest{Path: "~/r"})
		asUser(asRoot, "root")
		if res, err := c.MakeDir(ctx, asRoot); err != nil || res.Msg.Entry.Path != "/root/r" || res.Msg.Entry.Owner != "root" {
			t.Fatalf("MakeDir as root: %v, %v", res, err)
		}
		bad := connect.NewRequest(&filesystempb.MakeDirRequest{Path: "x"})
		asUser(bad, "../../etc")
		_, err = c.MakeDir(ctx, bad)
		wantCode(t, "a user name that is a path", err, connect.CodeUnauthenticated)
		// A user the sandbox does not have: invalid_argument (the
		// edge's), and no directory.
		before := f.edge.Tree(id)
		ghost := connect.NewRequest(&filesystempb.MakeDirRequest{Path: "/tmp/ghost/dir"})
		asUser(ghost, "ghost")
		_, err = c.MakeDir(ctx, ghost)
		wantCode(t, "MakeDir as a user the sandbox lacks", err, connect.CodeInvalidArgument)
		if after := f.edge.Tree(id); !slices.Equal(before, after) {
			t.Fatalf("a refused MakeDir changed the sandbox: %v, then %v", before, after)
		}

		if _, err := f.edge.WriteFile(ctx, id, "/home/user/proj/src/main.py", strings.NewReader("print(1)\n"), 0o644, "user"); err != nil {
			t.Fatal(err)
		}
		st, err := c.Stat(ctx, connect.NewRequest(&filesystempb.StatRequest{Path: "/home/user/proj/src/main.py"}))
		if err != nil {
			t.Fatal(err)
		}
		if e := st.Msg.Entry; e.Name != "main.py" || e.Type != filesystempb.FileType_FILE_TYPE_FILE || e.Size != 9 || e.Permissions != "-rw-r--r--" ||
			e.Owner != "1000" || e.Group != "1000" || e.ModifiedTime == nil || e.SymlinkTarget != nil {
			t.Fatalf("Stat = %v", e)
		}
		_, err = c.Stat(ctx, connect.NewRequest(&filesystempb.StatRequest{Path: "/home/user/nope"}))
		wantCode(t, "Stat of nothing", err, connect.CodeNotFound)

		ls, err := c.ListDir(ctx, connect.NewRequest(&filesystempb.ListDirRequest{Path: "/home/user/proj"}))
		if err != nil || len(ls.Msg.Entries) != 1 || ls.Msg.Entries[0].Path != "/home/user/proj/src" {
			t.Fatalf("ListDir depth 1: %v, %v", ls, err)
		}
		ls, err = c.ListDir(ctx, connect.NewRequest(&filesystempb.ListDirRequest{Path: "/home/user/proj", Depth: 2}))
		if err != nil || len(ls.Msg.Entries) != 2 || ls.Msg.Entries[1].Name != "main.py" {
			t.Fatalf("ListDir depth 2: %v, %v", ls, err)
		}
		_, err = c.ListDir(ctx, connect.NewRequest(&filesystempb.ListDirRequest{Path: "/none"}))
		wantCode(t, "ListDir of nothing", err, connect.CodeNotFound)
		_, err = c.ListDir(ctx, connect.NewRequest(&filesystempb.ListDirRequest{Path: "/", Depth: 1000}))
		wantCode(t, "ListDir too deep", err, connect.CodeInvalidArgument)

		mv, err := c.Move(ctx, connect.NewRequest(&filesystempb.MoveRequest{Source: "/home/user/proj/src/main.py", Destination: "/home/user/out/app.py"}))
		if err != nil || mv.Msg.Entry.Path != "/home/user/out/app.py" || mv.Msg.Entry.Size != 9 {
			t.Fatalf("Move: %v, %v", mv, err)
		}
		_, err = c.Move(ctx, connect.NewRequest(&filesystempb.MoveRequest{Source: "/home/user/proj/src/main.py", Destination: "/x"}))
		wantCode(t, "Move of nothing", err, connect.CodeNotFound)

		if _, err := c.Remove(ctx, connect.NewRequest(&filesystempb.RemoveRequest{Path: "/home/user/proj"})); err != nil {
			t.Fatal(err)
		}
		// Gone already: no error, as envd's.
		if _, err := c.Remove(ctx, connect.NewRequest(&filesystempb.RemoveRequest{Path: "/home/user/proj"})); err != nil {
			t.Fatalf("Remove of nothing: %v", err)
		}
		_, err = c.Stat(ctx, connect.NewRequest(&filesystempb.StatRequest{Path: "/home/user/proj/src"}))
		wantCode(t, "Stat after Remove", err, connect.CodeNotFound)

		_, err = c.CreateWatcher(ctx, connect.NewRequest(&filesystempb.CreateWatcherRequest{Path: "/"}))
		wantCode(t, "CreateWatcher", err, connect.CodeUnimplemented)

		// A sandbox that is gone: unavailable, not a missing file.
		if err := f.edge.Delete(ctx, id); err != nil {
			t.Fatal(err)
		}
		_, err = c.Stat(ctx, connect.NewRequest(&filesystempb.StatRequest{Path: "/home/user/out/app.py"}))
		wantCode(t, "Stat in a deleted sandbox", err, connect.CodeUnavailable)
		_, err = c.MakeDir(ctx, connect.NewRequest(&filesystempb.MakeDirRequest{Path: "relative"}))
		wantCode(t, "MakeDir in a deleted sandbox", err, connect.CodeUnavailable)
	})
}

func TestEnvdWatchDir(t *testing.T) {
	bothWays(t, func(t *testing.T, f *fixture) {
		ctx := t.Context()
		id, tok := f.envdSandbox(t)
		c := f.fsClient(id, tok)
		if _, err := f.edge.MakeDir(ctx, id, "/home/user/w", ""); err != nil {
			t.Fatal(err)
		}

		// A directory that is not there: the stream's error, before any frame.
		stream, err := c.WatchDir(ctx, connect.NewRequest(&filesystempb.WatchDirRequest{Path: "/home/user/none"}))
		if err != nil {
			t.Fatal(err)
		}
		if stream.Receive() {
			t.Fatalf("a failed watch sent %v", stream.Msg())
		}
		wantCode(t, "watch of nothing", stream.Err(), connect.CodeNotFound)

		wctx, cancel := context.WithCancel(ctx)
		defer cancel()
		req := connect.NewRequest(&filesystempb.WatchDirRequest{Path: "w", IncludeEntry: true})
		asUser(req, "user")
		req.Header().Set("Keepalive-Ping-Interval", "1")
		stream, err = c.WatchDir(wctx, req)
		if err != nil {
			t.Fatal(err)
		}
		next := func() *filesystempb.WatchDirResponse {
			t.Helper()
			if !stream.Receive() {
				t.Fatalf("stream ended: %v", stream.Err())
			}
			return stream.Msg()
		}
		if m := next(); m.GetStart() == nil {
			t.Fatalf("first frame %v, want start", m)
		}
		if _, err := f.edge.WriteFile(ctx, id, "/home/user/w/a.txt", strings.NewReader("hi"), 0o644, ""); err != nil {
			t.Fatal(err)
		}
		ev := next().GetFilesystem()
		if ev == nil || ev.Name != "a.txt" || ev.Type != filesystempb.EventType_EVENT_TYPE_CREATE || ev.Entry == nil || ev.Entry.Path != "/home/user/w/a.txt" {
			t.Fatalf("after a write: %v, want create a.txt with its entry", ev)
		}
		if ev := next().GetFilesystem(); ev == nil || ev.Type != filesystempb.EventType_EVENT_TYPE_WRITE {
			t.Fatalf("then %v, want write", ev)
		}
		// Silence: a keepalive within about the interval asked for.
		start := time.Now()
		if m := next(); m.GetKeepalive() == nil || time.Since(start) > 5*time.Second {
			t.Fatalf("after %s of silence: %v, want a keepalive", time.Since(start), m)
		}
		cancel()
		deadline := time.Now().Add(5 * time.Second)
		for f.edge.Watches() != 0 {
			if time.Now().After(deadline) {
				t.Fatal("the edge still watches for a client that left")
			}
			time.Sleep(10 * time.Millisecond)
		}

		// Without include_entry, events name only.
		stream, err = c.WatchDir(ctx, connect.NewRequest(&filesystempb.WatchDirRequest{Path: "/home/user/w"}))
		if err != nil {
			t.Fatal(err)
		}
		if m := next(); m.GetStart() == nil {
			t.Fatalf("first frame %v, want start", m)
		}
		if err := f.edge.RemoveFile(ctx, id, "/home/user/w/a.txt", false); err != nil {
			t.Fatal(err)
		}
		if ev := next().GetFilesystem(); ev == nil || ev.Type != filesystempb.EventType_EVENT_TYPE_REMOVE || ev.Entry != nil {
			t.Fatalf("after a remove: %v", ev)
		}
		_ = stream.Close()
	})
}

// formFile is one part of a multipart upload.
type formFile struct{ field, filename, content string }

func multipartBody(t *testing.T, parts ...formFile) (string, *bytes.Buffer) {
	t.Helper()
	var b bytes.Buffer
	mw := multipart.NewWriter(&b)
	for _, p := range parts {
		h := textproto.MIMEHeader{}
		h.Set("Content-Disposition", `form-data; name="`+p.field+`"; filename="`+p.filename+`"`)
		h.Set("Content-Type", "application/octet-stream")
		w, err := mw.CreatePart(h)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.WriteString(w, p.content)
	}
	if err := mw.Close(); err != nil {
		t.Fatal(err)
	}
	return mw.FormDataContentType(), &b
}

func (f *fixture) envdHTTP(t *testing.T, id, tok, method, target, ctype string, body io.Reader) (*http.Response, []byte) {
	t.Helper()
	req, err := http.NewRequest(method, f.srv.URL+target, body)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("E2b-Sandbox-Id", id)
	req.Header.Set("X-Access-Token", tok)
	if ctype != "" {
		req.Header.Set("Content-Type", ctype)
	}
	return send(t, req)
}

func TestEnvdFilesHTTP(t *testing.T) {
	bothWays(t, func(t *testing.T, f *fixture) {
		id, tok := f.envdSandbox(t)

		// Several files in one form, their targets in the file names:
		// relative (from the user's home, ".." included) and absolute.
		ctype, body := multipartBody(t,
			formFile{"file", "notes/a.txt", "alpha"},
			formFile{"file", "/tmp/b.txt", "beta"},
			formFile{"other", "/ignored", "not a file field"},
			formFile{"file", "../../etc/x", "gamma"},
		)
		resp, out := f.envdHTTP(t, id, tok, "POST", "/files?username=user", ctype, body)
		if resp.StatusCode != 200 {
			t.Fatalf("multipart upload: %d %s", resp.StatusCode, out)
		}
		var got []uploaded
		if err := json.Unmarshal(out, &got); err != nil {
			t.Fatal(err)
		}
		want := []uploaded{{"a.txt", "file", "/home/user/notes/a.txt"}, {"b.txt", "file", "/tmp/b.txt"}, {"x", "file", "/etc/x"}}
		if !slices.Equal(got, want) {
			t.Fatalf("uploaded %+v, want %+v", got, want)
		}
		for p, content := range map[string]string{"/home/user/notes/a.txt": "alpha", "/tmp/b.txt": "beta", "/etc/x": "gamma"} {
			if b, ok := f.edge.Content(id, p); !ok || string(b) != content {
				t.Fatalf("%s holds %q (%v), want %q", p, b, ok, content)
			}
		}
		if _, ok := f.edge.Content(id, "/ignored"); ok {
			t.Fatal("a part that is not a file field was written")
		}
		// What an upload creates is the user's: the files and the
		// parents the edge made for them.
		owned := func(p string, uid uint32) {
			t.Helper()
			fe, err := f.edge.StatFile(t.Context(), id, p)
			if err != nil || fe.UID != uid || fe.GID != uid {
				t.Fatalf("%s: %+v, %v; want owned by %d", p, fe, err, uid)
			}
		}
		owned("/home/user/notes/a.txt", 1000)
		owned("/home/user/notes", 1000)
		owned("/etc/x", 1000)

		// A name that climbs above the sandbox's / is refused, whether
		// relative or absolute; nothing of it is written.
		before := f.edge.Tree(id)
		for _, name := range []string{"../../../../x", "/../etc/y", "~/../../../z"} {
			ctype, body = multipartBody(t, formFile{"file", name, "pwned"})
			resp, out = f.envdHTTP(t, id, tok, "POST", "/files?username=user", ctype, body)
			if resp.StatusCode != 400 || !strings.Contains(string(out), `"code":400`) {
				t.Fatalf("upload to %q: %d %s", name, resp.StatusCode, out)
			}
		}
		if after := f.edge.Tree(id); !slices.Equal(before, after) {
			t.Fatalf("refused uploads changed the sandbox: %v, then %v", before, after)
		}

		// The path parameter names the target of a single file. No user
		// named: the sandbox's own ("user") owns it.
		ctype, body = multipartBody(t, formFile{"file", "ignored-name", "delta"})
		resp, out = f.envdHTTP(t, id, tok, "POST", "/files?path=/data/d.bin", ctype, body)
		if resp.StatusCode != 200 || !strings.Contains(string(out), `"path":"/data/d.bin"`) {
			t.Fatalf("upload with a path: %d %s", resp.StatusCode, out)
		}
		owned("/data/d.bin", 1000)
		// As root: root's.
		if resp, out = f.envdHTTP(t, id, tok, "POST", "/files?path=/srv/r.txt&username=root", "application/octet-stream", strings.NewReader("r")); resp.StatusCode != 200 {
			t.Fatalf("upload as root: %d %s", resp.StatusCode, out)
		}
		owned("/srv/r.txt", 0)
		// As a user the sandbox does not have: 400, and nothing written,
		// raw or multipart.
		before = f.edge.Tree(id)
		if resp, out = f.envdHTTP(t, id, tok, "POST", "/files?path=/ghost/g.txt&username=ghost", "application/octet-stream", strings.NewReader("g")); resp.StatusCode != 400 || !strings.Contains(string(out), `"code":400`) {
			t.Fatalf("upload as a user the sandbox lacks: %d %s", resp.StatusCode, out)
		}
		ctype, body = multipartBody(t, formFile{"file", "/ghost/a", "1"}, formFile{"file", "/ghost/b", "2"})
		if resp, out = f.envdHTTP(t, id, tok, "POST", "/files?username=ghost", ctype, body); resp.StatusCode != 400 {
			t.Fatalf("multipart upload as a user the sandbox lacks: %d %s", resp.StatusCode, out)
		}
		if after := f.edge.Tree(id); !slices.Equal(before, after) {
			t.Fatalf("uploads as a user the sandbox lacks changed it: %v, then %v", before, after)
		}
		// Two files for one target: refused.
		ctype, body = multipartBody(t, formFile{"file", "a", "1"}, formFile{"file", "b", "2"})
		if resp, out = f.envdHTTP(t, id, tok, "POST", "/files?path=/same", ctype, body); resp.StatusCode != 400 {
			t.Fatalf("two files to one path: %d %s", resp.StatusCode, out)
		}

		// A raw body, plain and gzip'd.
		resp, out = f.envdHTTP(t, id, tok, "POST", "/files?path=raw.txt&username=user", "application/octet-stream", strings.NewReader("raw bytes"))
		if resp.StatusCode != 200 || !strings.Contains(string(out), `"path":"/home/user/raw.txt"`) {
			t.Fatalf("raw upload: %d %s", resp.StatusCode, out)
		}
		var gz bytes.Buffer
		zw := gzip.NewWriter(&gz)
		_, _ = zw.Write([]byte("unzipped"))
		_ = zw.Close()
		req, _ := http.NewRequest("POST", f.srv.URL+"/files?path=/z.txt", &gz)
		req.Header.Set("E2b-Sandbox-Id", id)
		req.Header.Set("X-Access-Token", tok)
		req.Header.Set("Content-Type", "application/octet-stream")
		req.Header.Set("Content-Encoding", "gzip")
		if resp, out := send(t, req); resp.StatusCode != 200 {
			t.Fatalf("gzip upload: %d %s", resp.StatusCode, out)
		}
		if b, _ := f.edge.Content(id, "/z.txt"); string(b) != "unzipped" {
			t.Fatalf("gzip upload wrote %q", b)
		}
		if resp, out = f.envdHTTP(t, id, tok, "POST", "/files", "application/octet-stream", strings.NewReader("x")); resp.StatusCode != 400 {
			t.Fatalf("raw upload without a path: %d %s", resp.StatusCode, out)
		}
		if resp, out = f.envdHTTP(t, id, tok, "POST", "/files?path=/x", "text/plain", strings.NewReader("x")); resp.StatusCode != 400 {
			t.Fatalf("upload as text/plain: %d %s", resp.StatusCode, out)
		}
		// A truncated multipart body: a 400, not an edge failure.
		ctype, body = multipartBody(t, formFile{"file", "/cut", "some content"})
		cut := body.Bytes()[:body.Len()-20]
		if resp, out = f.envdHTTP(t, id, tok, "POST", "/files", ctype, bytes.NewReader(cut)); resp.StatusCode != 400 {
			t.Fatalf("truncated multipart: %d %s", resp.StatusCode, out)
		}
		// A full disk: 507, as envd answers.
		resp, out = f.envdHTTP(t, id, tok, "POST", "/files?path=/full/f", "application/octet-stream", strings.NewReader("x"))
		if resp.StatusCode != 507 || !strings.Contains(string(out), `"code":507`) {
			t.Fatalf("upload to a full disk: %d %s", resp.StatusCode, out)
		}

		// Download.
		resp, out = f.envdHTTP(t, id, tok, "GET", "/files?path=notes/a.txt&username=user", "", nil)
		if resp.StatusCode != 200 || string(out) != "alpha" || resp.Header.Get("Content-Length") != "5" {
			t.Fatalf("download: %d %q %v", resp.StatusCode, out, resp.Header)
		}
		resp, out = f.envdHTTP(t, id, tok, "GET", "/files?path=/nope/x", "", nil)
		if resp.StatusCode != 404 || !strings.Contains(string(out), `"code":404`) {
			t.Fatalf("download of nothing: %d %s", resp.StatusCode, out)
		}
		resp, out = f.envdHTTP(t, id, tok, "GET", "/files?path=/home/user/notes", "", nil)
		if resp.StatusCode != 400 {
			t.Fatalf("download of a directory: %d %s", resp.StatusCode, out)
		}

		// Health: 204 for anyone; the token's holder learns of a sandbox
		// that is gone (502).
		resp, _ = f.envdHTTP(t, id, tok, "GET", "/health", "", nil)
		if resp.StatusCode != 204 {
			t.Fatalf("health: %d", resp.StatusCode)
		}
		if err := f.edge.Delete(t.Context(), id); err != nil {
			t.Fatal(err)
		}
		if resp, _ = f.envdHTTP(t, id, "", "GET", "/health", "", nil); resp.StatusCode != 204 {
			t.Fatalf("health without a token: %d", resp.StatusCode)
		}
		if resp, out = f.envdHTTP(t, id, tok, "GET", "/health", "", nil); resp.StatusCode != 502 {
			t.Fatalf("health of a deleted sandbox: %d %s", resp.StatusCode, out)
		}
		if resp, out = f.envdHTTP(t, id, tok, "GET", "/files?path=/tmp/b.txt", "", nil); resp.StatusCode != 502 || !strings.Contains(string(out), `"code":502`) {
			t.Fatalf("download from a deleted sandbox: %d %s", resp.StatusCode, out)
		}
	})
}

// TestEnvdConnectMalformed: requests that are not well-formed Connect get
// a Connect error, and the server goes on serving.
func TestEnvdConnectMalformed(t *testing.T) {
	f := newFixture(t, false)
	id, tok := f.envdSandbox(t)
	post := func(proc, ctype string, body []byte) (*http.Response, []byte) {
		t.Helper()
		return f.envdHTTP(t, id, tok, "POST", proc, ctype, bytes.NewReader(body))
	}
	wantUnary := func(what string, resp *http.Response, body []byte, status int, code string) {
		t.Helper()
		var e struct{ Code, Message string }
		if resp.StatusCode != status || json.Unmarshal(body, &e) != nil || e.Code != code {
			t.Fatalf("%s: %d %s, want %d with code %s", what, resp.StatusCode, body, status, code)
		}
	}
	stat := "/" + filesystempbconnect.FilesystemName + "/Stat"
	watch := "/" + filesystempbconnect.FilesystemName + "/WatchDir"
	resp, body := post(stat, "application/json", []byte(`{"path": `))
	wantUnary("truncated JSON", resp, body, 400, "invalid_argument")
	resp, body = post(stat, "application/json", []byte(`{"path": 7}`))
	wantUnary("a number for a string", resp, body, 400, "invalid_argument")
	resp, body = post(stat, "application/json", []byte(`{"path": "`+strings.Repeat("a", 2<<20)+`"}`))
	wantUnary("an oversized message", resp, body, 429, "resource_exhausted")
	resp, body = post(stat, "application/json", []byte(`{"path": "/"}`))
	if resp.StatusCode != 200 {
		t.Fatalf("a good request after the bad ones: %d %s", resp.StatusCode, body)
	}

	// Streams: a short envelope, an envelope longer than its body, and
	// JSON that is not the message. Each gets an end-of-stream frame
	// carrying the error (connect calls the broken envelopes internal,
	// the wrong JSON invalid_argument).
	for _, b := range [][]byte{{0, 0, 0}, {0, 0, 0, 0, 100, '{'}, append([]byte{0, 0, 0, 0, 3}, "[1]"...)} {
		resp, body = post(watch, "application/connect+json", b)
		if resp.StatusCode != 200 || len(body) < 5 || body[0]&2 == 0 || !bytes.Contains(body, []byte(`{"error":{"code":"`)) {
			t.Fatalf("malformed stream %q: %d %q", b, resp.StatusCode, body)
		}
	}
	// A content type or method the Connect protocol does not have: a
	// Connect error too (connect itself would answer a bare 415 or 405).
	resp, body = post(stat, "text/plain", []byte(`{"path": "/"}`))
	wantUnary("text/plain", resp, body, 400, "invalid_argument")
	resp, body = f.envdHTTP(t, id, tok, "GET", stat, "", nil)
	wantUnary("GET", resp, body, 400, "invalid_argument")
	// Unknown methods: unimplemented (404 in the Connect protocol).
	resp, body = post("/"+filesystempbconnect.FilesystemName+"/Chmod", "application/json", []byte(`{}`))
	if resp.StatusCode != 404 {
		t.Fatalf("an unknown method: %d %s", resp.StatusCode, body)
	}
	if _, err := f.fsClient(id, tok).Stat(t.Context(), connect.NewRequest(&filesystempb.StatRequest{Path: "/"})); err != nil {
		t.Fatalf("after malformed requests: %v", err)
	}
}

// presign makes a presigned /files URL query as the E2B SDK does.
func presign(path, op, user, tok string, exp int64) url.Values {
	raw := path + ":" + op + ":" + user + ":" + tok
	q := url.Values{"path": {path}}
	if user != "" {
		q.Set("username", user)
	}
	if exp != 0 {
		raw += ":" + strconv.FormatInt(exp, 10)
		q.Set("signature_expiration", strconv.FormatInt(exp, 10))
	}
	sum := sha256.Sum256([]byte(raw))
	q.Set("signature", "v1_"+strings.TrimRight(base64.StdEncoding.EncodeToString(sum[:]), "="))
	return q
}

func TestEnvdPresignedURLs(t *testing.T) {
	f := newFixture(t, false)
	id, tok := f.envdSandbox(t)
	other, otherTok := f.envdSandbox(t)
	get := func(q url.Values, sandbox string) int {
		t.Helper()
		q.Set("sandbox", sandbox)
		resp, err := http.Get(f.srv.URL + "/files?" + q.Encode())
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	future := time.Now().Add(time.Minute).Unix()
	for _, tc := range []struct {
		name    string
		q       url.Values
		sandbox string
		want    int
	}{
		{"signed read", presign("/etc/hostname", "read", "", tok, 0), id, 200},
		{"signed read with user and expiry", presign("/etc/hostname", "read", "user", tok, future), id, 200},
		{"expired", presign("/etc/hostname", "read", "", tok, time.Now().Add(-time.Minute).Unix()), id, 401},
		{"signed for write", presign("/etc/hostname", "write", "", tok, 0), id, 401},
		{"another sandbox's token", presign("/etc/hostname", "read", "", otherTok, 0), id, 401},
		{"for another sandbox", presign("/etc/hostname", "read", "", tok, 0), other, 401},
	} {
		if got := get(tc.q, tc.sandbox); got != tc.want {
			t.Errorf("%s: %d, want %d", tc.name, got, tc.want)
		}
	}
	// A signature does not carry over to another path or user.
	q := presign("/etc/hostname", "read", "", tok, 0)
	q.Set("path", "/etc/passwd")
	if got := get(q, id); got != 401 {
		t.Errorf("path changed after signing: %d", got)
	}
	q = presign("/etc/hostname", "read", "user", tok, future)
	q.Set("username", "root")
	if got := get(q, id); got != 401 {
		t.Errorf("user changed after signing: %d", got)
	}

	// A URL signed for the sandbox's own user (no username, as the SDK
	// makes them) acts as that user whatever Authorization its holder
	// adds: a relative path stays in that user's home.
	for _, p := range []string{"/home/user/notes.txt", "/root/notes.txt"} {
		w := url.Values{"path": {p}, "username": {"root"}}
		if r, out := f.envdHTTP(t, id, tok, "POST", "/files?"+w.Encode(), "application/octet-stream", strings.NewReader("in "+p)); r.StatusCode != 200 {
			t.Fatalf("writing %s: %d %s", p, r.StatusCode, out)
		}
	}
	q = presign("notes.txt", "read", "", tok, 0)
	q.Set("sandbox", id)
	for _, auth := range []string{"", "root", "user"} {
		req, _ := http.NewRequest("GET", f.srv.URL+"/files?"+q.Encode(), nil)
		if auth != "" {
			req.Header.Set("Authorization", "Basic "+base64.StdEncoding.EncodeToString([]byte(auth+":")))
		}
		if resp, out := send(t, req); resp.StatusCode != 200 || string(out) != "in /home/user/notes.txt" {
			t.Errorf("signed read of notes.txt with Authorization for %q: %d %q", auth, resp.StatusCode, out)
		}
	}
}
