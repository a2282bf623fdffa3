package edge

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/sandbox/fake"
)

// TestCreateTokenMakesOneSandbox: a create sent again with its token makes
// no second sandbox, whether the first is under way, done, or adopted by a
// restarted edge; a repeat of a failed create tries again, and a token
// outlives its sandbox by nothing.
func TestCreateTokenMakesOneSandbox(t *testing.T) {
	ctx := context.Background()
	state := t.TempDir()
	src := &testImages{dir: t.TempDir()}
	layers := src.digests(t, 1)
	// Creates take 20 ms, so that concurrent repeats overlap the first.
	b := fake.NewWithLatency("container", fake.Latency{Create: fake.Dist{Median: 20 * time.Millisecond}})
	e := fakeEdge(t, state, b, src)
	req := func(tok string) edgeapi.CreateRequest {
		return edgeapi.CreateRequest{Spec: api.SandboxSpec{Base: "base/x:1"}, Digests: layers, Token: tok}
	}
	held := func() int {
		ids, err := b.List(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return len(ids)
	}

	// Eight at once with one token: one sandbox, the same answer to all.
	var wg sync.WaitGroup
	ids := make([]string, 8)
	errs := make([]error, 8)
	for i := range ids {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sb, err := e.Create(ctx, req("tok-a"))
			if err == nil {
				ids[i] = sb.ID
			}
			errs[i] = err
		}()
	}
	wg.Wait()
	for i := range ids {
		if errs[i] != nil || ids[i] != ids[0] {
			t.Fatalf("concurrent creates of one token answered %v / %v, want one id for all", ids, errs)
		}
	}
	if n := held(); n != 1 {
		t.Fatalf("eight creates of one token made %d sandboxes, want 1", n)
	}
	// Sent again once it is done: the same sandbox, as it is now.
	if _, err := e.Pause(ctx, ids[0]); err != nil {
		t.Fatal(err)
	}
	sb, err := e.Create(ctx, req("tok-a"))
	if err != nil || sb.ID != ids[0] || sb.State != api.StatePaused {
		t.Fatalf("a repeat after the create: %+v %v, want %s as it is now (paused)", sb, err, ids[0])
	}
	// Another token, or none, is another sandbox.
	other, err := e.Create(ctx, req("tok-b"))
	if err != nil || other.ID == ids[0] {
		t.Fatalf("another token: %+v %v, want a sandbox of its own", other, err)
	}
	if _, err := e.Create(ctx, req("")); err != nil {
		t.Fatal(err)
	}
	if n := held(); n != 3 {
		t.Fatalf("%d sandboxes, want 3", n)
	}

	// A create that failed is tried again by its repeat.
	b.FailNextCreate(errors.New("no room"))
	if _, err := e.Create(ctx, req("tok-c")); err == nil {
		t.Fatal("a create the backend refused succeeded")
	}
	if sb, err := e.Create(ctx, req("tok-c")); err != nil || sb.State != api.StateRunning {
		t.Fatalf("the repeat of a failed create: %+v %v, want a running sandbox", sb, err)
	}

	// So is a repeat that waited on a create that then failed.
	b.FailNextCreate(errors.New("no room"))
	first := make(chan error, 1)
	go func() {
		_, err := e.Create(ctx, req("tok-d"))
		first <- err
	}()
	time.Sleep(5 * time.Millisecond)
	waited, err := e.Create(ctx, req("tok-d"))
	if ferr := <-first; ferr == nil || err != nil || waited.State != api.StateRunning {
		t.Fatalf("a failed create and its repeat: %v, then %+v %v; want the first refused and the repeat running", ferr, waited, err)
	}
	if err := e.Delete(ctx, waited.ID); err != nil {
		t.Fatal(err)
	}

	// A token is bounded.
	if _, err := e.Create(ctx, req(strings.Repeat("x", edgeapi.MaxTokenLen+1))); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("an oversized token: %v, want invalid_argument", err)
	}

	// Deleted, the sandbox takes its token with it.
	if err := e.Delete(ctx, other.ID); err != nil {
		t.Fatal(err)
	}
	if sb, err := e.Create(ctx, req("tok-b")); err != nil || sb.ID == other.ID {
		t.Fatalf("a token whose sandbox was deleted: %+v %v, want a new sandbox", sb, err)
	}
	e.tokMu.Lock()
	tokens := len(e.tokens)
	e.tokMu.Unlock()
	if tokens != 3 {
		t.Fatalf("%d tokens held, want 3 (a, b and c)", tokens)
	}

	// A create placed on another node while this one was down: the
	// sandbox this node made for it goes; an unknown token is handled too.
	ab, err := e.Create(ctx, req("tok-abandoned"))
	if err != nil {
		t.Fatal(err)
	}
	if got := e.DropAbandoned(ctx, []string{"tok-abandoned", "tok-never"}); len(got) != 2 {
		t.Fatalf("DropAbandoned handled %q, want both tokens", got)
	}
	if _, err := e.Get(ctx, ab.ID); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("the sandbox of an abandoned create: %v, want it deleted", err)
	}

	// A restarted edge knows the tokens of the sandboxes it adopts.
	e.Close()
	e2 := fakeEdge(t, state, b, &testImages{dir: src.dir})
	defer e2.Close()
	before := held()
	if sb, err := e2.Create(ctx, req("tok-a")); err != nil || sb.ID != ids[0] {
		t.Fatalf("a repeat after a restart: %+v %v, want the adopted %s", sb, err, ids[0])
	}
	if n := held(); n != before {
		t.Fatalf("a repeat after a restart made a sandbox (%d, was %d)", n, before)
	}
	// ... and drops an adopted one whose create was placed elsewhere.
	if got := e2.DropAbandoned(ctx, []string{"tok-a"}); len(got) != 1 {
		t.Fatalf("DropAbandoned after a restart handled %q", got)
	}
	if _, err := e2.Get(ctx, ids[0]); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("an adopted sandbox of an abandoned create: %v, want it deleted", err)
	}
}

// TestCreateTokenOverTheWire: the internal client sends the token as
// Idempotency-Key (so its transport may resend the create on a reused
// connection that failed), and a create whose answer was lost, sent again,
// answers the sandbox the first made.
func TestCreateTokenOverTheWire(t *testing.T) {
	ctx := context.Background()
	src := &testImages{dir: t.TempDir()}
	layers := src.digests(t, 1)
	b := fake.New("container")
	e := fakeEdge(t, t.TempDir(), b, src)
	defer e.Close()
	inner := edgeapi.NewServer(e, nil)
	var mu sync.Mutex
	var keys []string
	drop := true
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		if r.Method == "POST" && strings.HasSuffix(r.URL.Path, "/sandboxes") {
			keys = append(keys, r.Header.Get("Idempotency-Key"))
		}
		lose := drop && r.Method == "POST"
		drop = drop && !lose
		mu.Unlock()
		if !lose {
			inner.ServeHTTP(w, r)
			return
		}
		// The edge makes the sandbox; its answer is lost with the
		// connection.
		rec := httptest.NewRecorder()
		inner.ServeHTTP(rec, r)
		conn, _, err := w.(http.Hijacker).Hijack()
		if err == nil {
			_ = conn.(*net.TCPConn).SetLinger(0)
			_ = conn.Close()
		}
	}))
	defer srv.Close()
	c := edgeapi.NewClient("n1", srv.URL, srv.Client())
	cr := edgeapi.CreateRequest{Spec: api.SandboxSpec{Base: "base/x:1"}, Digests: layers, Token: "tok-wire"}
	_, err := c.Create(ctx, cr)
	var u *edgeapi.Unreachable
	if !errors.As(err, &u) || u.NotSent {
		t.Fatalf("a create whose answer was dropped: %v, want unreachable, sent", err)
	}
	sb, err := c.Create(ctx, cr)
	if err != nil {
		t.Fatal(err)
	}
	ids, _ := b.List(ctx)
	if len(ids) != 1 || ids[0] != sb.ID {
		t.Fatalf("the backend holds %v after a lost answer and a resend, want only %s", ids, sb.ID)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(keys) != 2 || keys[0] != "tok-wire" || keys[1] != "tok-wire" {
		t.Fatalf("Idempotency-Key headers %q, want the token on both", keys)
	}
}

// TestCreateSentThenRefusedCountsAsSent: a create written on a kept-alive
// connection that the edge then closed is resent by the transport (it
// carries Idempotency-Key); when that resend cannot even connect (the
// edge is gone), the create still counts as sent: the edge may have made
// it, and the apiserver must not treat the node as never asked.
func TestCreateSentThenRefusedCountsAsSent(t *testing.T) {
	ctx := context.Background()
	src := &testImages{dir: t.TempDir()}
	layers := src.digests(t, 1)
	b := fake.New("container")
	e := fakeEdge(t, t.TempDir(), b, src)
	defer e.Close()
	inner := edgeapi.NewServer(e, nil)
	var srv *httptest.Server
	srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != "POST" {
			inner.ServeHTTP(w, r)
			return
		}
		// The edge makes it, then dies: its listener and the
		// connection close before an answer.
		inner.ServeHTTP(httptest.NewRecorder(), r)
		_ = srv.Listener.Close()
		if conn, _, err := w.(http.Hijacker).Hijack(); err == nil {
			_ = conn.Close()
		}
	}))
	defer srv.Close()
	c := edgeapi.NewClient("n1", srv.URL, srv.Client())
	// A first call leaves a kept-alive connection for the create to reuse.
	if _, err := c.Info(ctx); err != nil {
		t.Fatal(err)
	}
	_, err := c.Create(ctx, edgeapi.CreateRequest{Spec: api.SandboxSpec{Base: "base/x:1"}, Digests: layers, Token: "tok-refused"})
	var u *edgeapi.Unreachable
	if !errors.As(err, &u) || u.NotSent {
		t.Fatalf("a create written, then refused on its resend: %v (%+v), want unreachable and sent", err, u)
	}
	if ids, _ := b.List(ctx); len(ids) != 1 {
		t.Fatalf("the edge holds %v, want the one sandbox it made", ids)
	}
}
