package edgeapi_test

import (
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"io"
	"net"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/edgeapi/edgetest"
	"github.com/dsecproject/dsec/internal/errdefs"
)

// remote serves fake through the internal API and returns a client of it.
func remote(t *testing.T, fake *edgetest.Fake) (*edgeapi.Client, *httptest.Server) {
	t.Helper()
	srv := httptest.NewServer(edgeapi.NewServer(fake, nil))
	t.Cleanup(srv.Close)
	return edgeapi.NewClient(fake.Name(), srv.URL, srv.Client()), srv
}

func newSandbox(t *testing.T, c *edgeapi.Client) string {
	t.Helper()
	sb, err := c.Create(t.Context(), edgeapi.CreateRequest{Spec: api.SandboxSpec{Backend: "container", Labels: map[string]string{"job": "j"}},
		Digests: []string{"sha256:" + strings.Repeat("a", 64)}})
	if err != nil {
		t.Fatal(err)
	}
	return sb.ID
}

// TestErrorClassesCrossTheWire: what the edge classified, the apiserver
// sees classified the same way.
func TestErrorClassesCrossTheWire(t *testing.T) {
	fake := edgetest.NewFake("n1")
	c, _ := remote(t, fake)
	ctx := t.Context()
	if _, err := c.Get(ctx, "sb-n1-none"); !errors.Is(err, errdefs.ErrNotFound) || edgeapi.IsUnreachable(err) {
		t.Fatalf("get missing: %v, want not_found", err)
	}
	fake.Refuse = true
	if _, err := c.Create(ctx, edgeapi.CreateRequest{}); !errors.Is(err, errdefs.ErrExhausted) {
		t.Fatalf("create on a full node: %v, want resource_exhausted", err)
	}
	fake.Refuse = false
	id := newSandbox(t, c)
	fake.ExecErr = errors.New("runtime said: /var/lib/x boom")
	_, err := c.Exec(ctx, id, api.ExecRequest{Cmd: "x"}, nil)
	if err == nil || errdefs.Code(err) != "internal" || !strings.Contains(err.Error(), "boom") {
		t.Fatalf("internal error: %v", err)
	}
	fake.ExecErr = nil
	fake.PanicOn = id
	if _, err := c.Get(ctx, id); errdefs.Code(err) != "internal" {
		t.Fatalf("a panicking handler: %v, want internal", err)
	}
	// The server still serves after the panic.
	fake.PanicOn = ""
	if _, err := c.Get(ctx, id); err != nil {
		t.Fatalf("after a panic: %v", err)
	}
}

func TestCallsRoundTrip(t *testing.T) {
	fake := edgetest.NewFake("n1")
	c, _ := remote(t, fake)
	ctx := t.Context()
	id := newSandbox(t, c)
	other := newSandbox(t, c)
	if n, err := c.Info(ctx); err != nil || n.Name != "n1" || n.Counts["running"] != 2 {
		t.Fatalf("info %+v, %v", n, err)
	}
	if n, err := c.LayerUsers(ctx, "sha256:"+strings.Repeat("a", 64)); err != nil || n != 2 {
		t.Fatalf("layer users %d, %v", n, err)
	}
	l, err := c.List(ctx, edgeapi.ListFilter{Labels: map[string]string{"job": "j"}, After: id, Limit: 5})
	if err != nil || len(l) != 1 || l[0].ID != other {
		t.Fatalf("list after %s: %+v, %v", id, l, err)
	}
	if n, err := c.PauseByLabels(ctx, map[string]string{"job": "j"}); err != nil || n != 2 {
		t.Fatalf("pause by labels %d, %v", n, err)
	}
	res, err := c.RunInSession(ctx, id, "ss-1", api.SessionRunRequest{Command: "echo hi"})
	if err != nil || res.Stdout != "echo hi" {
		t.Fatalf("session run %+v, %v", res, err)
	}
	page, err := c.ReadLog(ctx, id, 1, 1)
	if err != nil || len(page.Entries) != 1 || page.Entries[0].Seq != 2 {
		t.Fatalf("log %+v, %v", page, err)
	}
	if n, err := c.DeleteByLabels(ctx, map[string]string{"job": "j"}); err != nil || n != 2 || fake.Len() != 0 {
		t.Fatalf("delete by labels %d, %v (left %d)", n, err, fake.Len())
	}
}

func TestStreamedExec(t *testing.T) {
	fake := edgetest.NewFake("n1")
	c, _ := remote(t, fake)
	id := newSandbox(t, c)
	var got []string
	res, err := c.Exec(t.Context(), id, api.ExecRequest{Cmd: "x"}, func(ev api.ExecEvent) error {
		got = append(got, ev.Stdout)
		return nil
	})
	if err != nil || res.ExitCode != 3 || strings.Join(got, ",") != "streamed" {
		t.Fatalf("stream: %v, %+v, events %q", err, res, got)
	}
	// An error after output began still arrives classified.
	got = nil
	_, err = c.Exec(t.Context(), id, api.ExecRequest{Cmd: "fail-after-output"}, func(ev api.ExecEvent) error {
		got = append(got, ev.Stdout)
		return nil
	})
	if !errors.Is(err, errdefs.ErrPrecondition) || len(got) != 1 {
		t.Fatalf("stream that fails: %v, events %q", err, got)
	}
	// Before any output, an error is a status.
	if _, err := c.Exec(t.Context(), "sb-n1-none", api.ExecRequest{Cmd: "x"}, func(api.ExecEvent) error { return nil }); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("stream to a missing sandbox: %v", err)
	}
}

func TestFilesAndTarsStream(t *testing.T) {
	fake := edgetest.NewFake("n1")
	c, _ := remote(t, fake)
	ctx := t.Context()
	id := newSandbox(t, c)
	fake.File = []byte("hello \x00 world\n")
	rc, fe, err := c.ReadFile(ctx, id, "/a/b")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(rc)
	rc.Close()
	if !bytes.Equal(b, fake.File) || fe.Size != int64(len(fake.File)) || fe.Path != "/a/b" {
		t.Fatalf("read %q %+v", b, fe)
	}
	fe, err = c.WriteFile(ctx, id, "/x", strings.NewReader("payload"), 0o4755, "")
	if err != nil || string(fake.Written) != "payload" || fe.Mode != "0755" {
		t.Fatalf("write: %+v %v (edge got %q)", fe, err, fake.Written)
	}
	// The owner crosses the wire; one the sandbox lacks stays invalid.
	if fe, err := c.WriteFile(ctx, id, "/owned", strings.NewReader("x"), 0o644, "user"); err != nil || fe.UID != 1000 || fe.GID != 1000 {
		t.Fatalf("write as user: %+v %v", fe, err)
	}
	if _, err := c.WriteFile(ctx, id, "/ghost", strings.NewReader("x"), 0o644, "ghost"); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("write as a user the sandbox lacks: %v, want invalid", err)
	}
	if _, err := c.ExtractTar(ctx, id, "/ghost", bytes.NewReader(make([]byte, 1024)), "ghost"); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("tar as a user the sandbox lacks: %v, want invalid", err)
	}
	var out bytes.Buffer
	if err := c.WriteTar(ctx, id, "/", &out); err != nil || !bytes.Equal(out.Bytes(), fake.File) {
		t.Fatalf("tar: %v, %q", err, out.Bytes())
	}
	out.Reset()
	if err := c.WriteTar(ctx, id, "/nope", &out); !errors.Is(err, errdefs.ErrNotFound) || out.Len() != 0 {
		t.Fatalf("tar of a missing path: %v (%d bytes)", err, out.Len())
	}
	// An error after the archive began: the bytes came, then the error.
	out.Reset()
	if err := c.WriteTar(ctx, id, "/broken", &out); !errors.Is(err, errdefs.ErrPrecondition) || out.Len() != 10 {
		t.Fatalf("broken tar: %v (%d bytes)", err, out.Len())
	}
	tr, err := c.ExtractTar(ctx, id, "/repo", bytes.NewReader(make([]byte, 3000)), "")
	if err != nil || tr.Bytes != 3000 || len(fake.Written) != 3000 {
		t.Fatalf("extract: %+v %v", tr, err)
	}
}

// TestPortConnection: a port connection carries bytes both ways, and
// the caller sees the close of the sandbox's side.
func TestPortConnection(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer conn.Close()
				buf := make([]byte, 5)
				if _, err := io.ReadFull(conn, buf); err != nil {
					return
				}
				_, _ = conn.Write(bytes.ToUpper(buf))
			}()
		}
	}()
	fake := edgetest.NewFake("n1")
	fake.PortAddr = ln.Addr().String()
	c, _ := remote(t, fake)
	id := newSandbox(t, c)
	conn, done, err := c.DialPort(t.Context(), id, 8080)
	if err != nil {
		t.Fatal(err)
	}
	defer done()
	defer conn.Close()
	if _, err := conn.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(conn)
	if err != nil || string(got) != "HELLO" {
		t.Fatalf("echo: %q, %v", got, err)
	}
	if _, _, err := c.DialPort(t.Context(), "sb-n1-none", 8080); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("port of a missing sandbox: %v", err)
	}
}

// TestPortConnectionQuietService: a caller that hangs up on a service
// that ignores the close (reads nothing more, writes nothing, never
// closes) does not hold the port connection open: it is released within
// the grace.
func TestPortConnectionQuietService(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	var held []net.Conn
	var mu sync.Mutex
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			held = append(held, conn) // kept open, never read
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		mu.Lock()
		defer mu.Unlock()
		for _, c := range held {
			c.Close()
		}
	})
	fake := edgetest.NewFake("n1")
	fake.PortAddr = ln.Addr().String()
	c, _ := remote(t, fake)
	id := newSandbox(t, c)
	conn, done, err := c.DialPort(t.Context(), id, 8080)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Write([]byte("hi")); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(time.Second)
	for fake.OpenPorts() != 1 {
		if time.Now().After(deadline) {
			t.Fatalf("%d ports open, want 1", fake.OpenPorts())
		}
		time.Sleep(10 * time.Millisecond)
	}
	conn.Close()
	done()
	deadline = time.Now().Add(10 * time.Second)
	for fake.OpenPorts() != 0 {
		if time.Now().After(deadline) {
			t.Fatal("the port connection is still held 10 s after the caller hung up")
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestUnreachable: an edge that is gone is an unavailable error that says
// the request never left, quickly.
func TestUnreachable(t *testing.T) {
	c, srv := remote(t, edgetest.NewFake("n1"))
	srv.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 5e9)
	defer cancel()
	_, err := c.Get(ctx, "sb-n1-x")
	var u *edgeapi.Unreachable
	if !errors.Is(err, errdefs.ErrUnavailable) || !errors.As(err, &u) || !u.NotSent || u.Node != "n1" {
		t.Fatalf("closed edge: %v", err)
	}
}

// TestExecOutputCrossesExactly: a one-shot result carrying output a
// sandbox chose (NULs that JSON would escape to six bytes each, bytes
// that are not UTF-8, a multi-byte rune cut in half) crosses the internal
// API as an output frame, byte for byte, in both streams.
func TestExecOutputCrossesExactly(t *testing.T) {
	fake := edgetest.NewFake("n1")
	c, srv := remote(t, fake)
	id := newSandbox(t, c)
	for _, out := range [][]byte{
		nil, []byte("plain\n"), bytes.Repeat([]byte{0}, 1<<20), []byte("\xff\xfe\x00 not utf-8 \xe2\x82"),
		[]byte("\x1b]52;c;aGk=\x07 \u2028 <&>"), bytes.Repeat([]byte("é\xc3"), 1000),
	} {
		res, err := c.Exec(t.Context(), id, api.ExecRequest{StdinB64: base64.StdEncoding.EncodeToString(out)}, nil)
		if err != nil {
			t.Fatal(err)
		}
		rev := slices.Clone(out)
		slices.Reverse(rev)
		for _, s := range []struct {
			name      string
			text, b64 string
			want      []byte
		}{{"stdout", res.Stdout, res.StdoutB64, out}, {"stderr", res.Stderr, res.StderrB64, rev}} {
			got := []byte(s.text)
			if s.b64 != "" {
				if got, err = base64.StdEncoding.DecodeString(s.b64); err != nil {
					t.Fatal(err)
				}
			}
			if !bytes.Equal(got, s.want) || (s.b64 != "") == utf8.Valid(s.want) {
				t.Fatalf("%s of %d bytes came back as %d bytes (b64 %v)", s.name, len(s.want), len(got), s.b64 != "")
			}
		}
		if res.ExitCode != 3 {
			t.Fatalf("exit code %d", res.ExitCode)
		}
	}
	// It is a frame, not JSON: 1 MiB of NULs costs 1 MiB on the wire.
	resp, err := srv.Client().Post(srv.URL+"/internal/v1/sandboxes/"+id+"/exec", "application/json",
		strings.NewReader(`{"stdin_b64":"`+base64.StdEncoding.EncodeToString(make([]byte, 1<<20))+`"}`))
	if err != nil {
		t.Fatal(err)
	}
	n, _ := io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if ct := resp.Header.Get("Content-Type"); ct != "application/vnd.dsec.output-frame" || n > 2<<20+4096 {
		t.Fatalf("answer: Content-Type %q, %d bytes for 2 MiB of output", ct, n)
	}
}

// TestScopeCrossesTheWire: the scope of a call reaches the edge behind
// the internal API, so a remote node hides other tenants' sandboxes as
// an in-process one does.
func TestScopeCrossesTheWire(t *testing.T) {
	fake := edgetest.NewFake("n1")
	c, _ := remote(t, fake)
	a := edgeapi.WithScope(t.Context(), "root/team-a")
	b := edgeapi.WithScope(t.Context(), "root/team-b")
	sb, err := c.Create(a, edgeapi.CreateRequest{Spec: api.SandboxSpec{Backend: "container", Project: "team-a"},
		Digests: []string{"sha256:" + strings.Repeat("a", 64)}, ProjectPath: "root/team-a"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Get(a, sb.ID); err != nil {
		t.Fatalf("its tenant cannot see it: %v", err)
	}
	if _, err := c.Get(b, sb.ID); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("another tenant's Get over the wire: %v, want not found", err)
	}
	if _, err := c.Exec(b, sb.ID, api.ExecRequest{Argv: []string{"true"}}, nil); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("another tenant's Exec over the wire: %v, want not found", err)
	}
	if l, err := c.List(b, edgeapi.ListFilter{}); err != nil || len(l) != 0 {
		t.Fatalf("another tenant's List over the wire: %v, %v", l, err)
	}
	if _, err := c.Get(t.Context(), sb.ID); err != nil {
		t.Fatalf("an unscoped (control plane) call: %v", err)
	}
}

// TestDirsMovesAndWatchesCrossTheWire: MakeDir, MoveFile and a streamed
// WatchDir behave over the internal API as on the fake itself: classes
// kept, the start event first, each event arriving as it happens (not
// when the stream ends), and the watch ending on the edge when the caller
// goes away.
func TestDirsMovesAndWatchesCrossTheWire(t *testing.T) {
	fake := edgetest.NewFake("n1")
	c, _ := remote(t, fake)
	ctx := t.Context()
	id := newSandbox(t, c)
	if fe, err := c.MakeDir(ctx, id, "/w/sub", ""); err != nil || fe.Type != "dir" || fe.Path != "/w/sub" {
		t.Fatalf("mkdir: %+v, %v", fe, err)
	}
	if _, err := c.MakeDir(ctx, id, "/w/sub", ""); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Fatalf("mkdir twice: %v, want already exists", err)
	}
	if fe, err := c.MakeDir(ctx, id, "/w/mine", "user"); err != nil || fe.UID != 1000 {
		t.Fatalf("mkdir as user: %+v, %v", fe, err)
	}
	if _, err := c.MakeDir(ctx, id, "/w/ghost", "ghost"); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("mkdir as a user the sandbox lacks: %v, want invalid", err)
	}
	if _, err := c.MoveFile(ctx, id, "/none", "/x"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("move of nothing: %v, want not found", err)
	}
	if err := c.WatchDir(ctx, "sb-n1-none", "/w", false, nil); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("watch in a missing sandbox: %v, want not found", err)
	}
	if err := c.WatchDir(ctx, id, "/absent", false, func(api.FileEvent) error { return nil }); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("watch of a missing directory: %v, want not found", err)
	}

	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	evs := make(chan api.FileEvent, 10)
	done := make(chan error, 1)
	go func() {
		done <- c.WatchDir(wctx, id, "/w", false, func(ev api.FileEvent) error {
			evs <- ev
			return nil
		})
	}()
	next := func() api.FileEvent {
		select {
		case ev := <-evs:
			return ev
		case <-time.After(10 * time.Second):
			t.Fatal("no watch event within 10 s")
		}
		return api.FileEvent{}
	}
	if ev := next(); ev.Type != api.FileEventStart {
		t.Fatalf("first event %+v, want start", ev)
	}
	if _, err := c.WriteFile(ctx, id, "/w/f", strings.NewReader("x"), 0o644, ""); err != nil {
		t.Fatal(err)
	}
	if ev := next(); ev.Type != api.FileEventCreate || ev.Name != "f" || ev.Entry == nil || ev.Entry.Path != "/w/f" {
		t.Fatalf("after a write: %+v", ev)
	}
	if ev := next(); ev.Type != api.FileEventWrite {
		t.Fatalf("then %+v, want write", ev)
	}
	fe, err := c.MoveFile(ctx, id, "/w/f", "/w/g")
	if err != nil || fe.Path != "/w/g" {
		t.Fatalf("move: %+v, %v", fe, err)
	}
	if ev := next(); ev.Type != api.FileEventRename || ev.Name != "f" {
		t.Fatalf("after a move: %+v, want rename f", ev)
	}
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("watch ended with %v, want canceled", err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for fake.Watches() != 0 {
		if time.Now().After(deadline) {
			t.Fatal("the edge still runs the watch its caller left")
		}
		time.Sleep(10 * time.Millisecond)
	}
}
