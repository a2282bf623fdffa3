package dsec

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/dsecproject/dsec/api"
)

// recorder is an apiserver stand-in that records what reached it.
type recorder struct {
	*httptest.Server
	mu   sync.Mutex
	keys []string
	hits int
}

func newRecorder(t *testing.T, h func(w http.ResponseWriter, r *http.Request)) *recorder {
	rec := &recorder{}
	rec.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rec.mu.Lock()
		rec.hits++
		rec.keys = append(rec.keys, r.Header.Get(HeaderIdempotencyKey))
		rec.mu.Unlock()
		h(w, r)
	}))
	t.Cleanup(rec.Close)
	return rec
}

func deadEndpoint(t *testing.T) string {
	srv := httptest.NewServer(http.NotFoundHandler())
	u := srv.URL
	srv.Close()
	return u
}

func TestFailoverToTheNextEndpoint(t *testing.T) {
	good := newRecorder(t, func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, 201, api.Sandbox{ID: "sb-e1-x"})
	})
	dead := deadEndpoint(t)
	c, err := New(WithEndpoint(dead + "," + good.URL))
	if err != nil {
		t.Fatal(err)
	}
	if got := c.Endpoints(); len(got) != 2 {
		t.Fatalf("endpoints %v", got)
	}
	sb, err := c.CreateSandbox(context.Background(), api.SandboxSpec{Base: "base/x:1"})
	if err != nil || sb.ID != "sb-e1-x" {
		t.Fatalf("create with the first endpoint down: %v, %v", sb, err)
	}
	// A create carries a key, the same on every attempt.
	if len(good.keys) != 1 || !strings.HasPrefix(good.keys[0], "dsec-") {
		t.Fatalf("keys seen: %q", good.keys)
	}
	// The client stays with the endpoint that answered.
	if c.Endpoint() != good.URL {
		t.Fatalf("current endpoint %s, want %s", c.Endpoint(), good.URL)
	}
	// A caller's own key is sent as given.
	ctx := WithIdempotencyKey(context.Background(), "my-key")
	if _, err := c.CreateSandbox(ctx, api.SandboxSpec{Base: "base/x:1"}); err != nil {
		t.Fatal(err)
	}
	if good.keys[1] != "my-key" {
		t.Fatalf("key %q, want my-key", good.keys[1])
	}
}

// TestFailoverOnlyWhenSafe: a POST without a key (pause) or a body that
// cannot be sent twice is not retried; a dsec error (even a 503) is the
// cluster's answer, not a reason to fail over; a gateway's 502 is.
func TestFailoverOnlyWhenSafe(t *testing.T) {
	dead := deadEndpoint(t)
	unavailable := newRecorder(t, func(w http.ResponseWriter, r *http.Request) {
		writeErr(w, 503, "unavailable", "node e1 cannot be reached now")
	})
	gateway := newRecorder(t, func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(502)
	})
	ok := newRecorder(t, func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, 200, api.PauseResult{})
	})
	// An unkeyed POST that reached an apiserver which then hung up is not
	// sent again (it may have run); one that could not connect at all is.
	hangup := newRecorder(t, func(w http.ResponseWriter, r *http.Request) {
		conn, _, _ := http.NewResponseController(w).Hijack()
		conn.Close()
	})
	c, _ := New(WithEndpoint(hangup.URL + "," + ok.URL))
	if _, err := c.Pause(context.Background(), "sb-e1-x"); err == nil || ok.hits != 0 {
		t.Fatalf("unkeyed POST was retried elsewhere after it was sent: %v (hits %d)", err, ok.hits)
	}
	c, _ = New(WithEndpoint(dead + "," + ok.URL))
	if _, err := c.Pause(context.Background(), "sb-e1-x"); err != nil || ok.hits != 1 {
		t.Fatalf("unkeyed POST that never left was not sent elsewhere: %v (hits %d)", err, ok.hits)
	}
	ok.hits = 0
	// A streamed upload cannot be sent twice.
	c, _ = New(WithEndpoint(dead + "," + ok.URL))
	if err := c.WriteFile(context.Background(), "sb-e1-x", "/f", onlyReader{strings.NewReader("data")}, 0); err == nil || ok.hits != 0 {
		t.Fatalf("a one-shot body was sent again: %v (hits %d)", err, ok.hits)
	}
	// A seekable one can.
	if err := c.WriteFile(context.Background(), "sb-e1-x", "/f", bytes.NewReader([]byte("data")), 0); err != nil || ok.hits != 1 {
		t.Fatalf("seekable body: %v (hits %d)", err, ok.hits)
	}
	c, _ = New(WithEndpoint(unavailable.URL + "," + ok.URL))
	_, err := c.GetSandbox(context.Background(), "sb-e1-x")
	if !errors.Is(err, ErrUnavailable) || ok.hits != 1 {
		t.Fatalf("a dsec 503 failed over: %v (hits %d)", err, ok.hits)
	}
	c, _ = New(WithEndpoint(gateway.URL + "," + ok.URL))
	if _, err := c.Pause(context.Background(), "x"); err == nil {
		t.Fatal("unkeyed POST through a gateway error was retried")
	}
	if _, err := c.Stats(context.Background(), "sb-e1-x"); err != nil || ok.hits != 2 {
		t.Fatalf("GET after a 502 did not fail over: %v (hits %d)", err, ok.hits)
	}
}

type onlyReader struct{ r *strings.Reader }

func (o onlyReader) Read(p []byte) (int, error) { return o.r.Read(p) }

func TestEndpointListParsing(t *testing.T) {
	c, err := New(WithEndpoint("a:1, http://b:2/ ,"))
	if err != nil || strings.Join(c.Endpoints(), ",") != "http://a:1,http://b:2" {
		t.Fatalf("%v %v", c.Endpoints(), err)
	}
	if _, err := New(WithEndpoint(" , ")); err == nil {
		t.Fatal("an empty list was accepted")
	}
	if _, err := New(WithEndpoint("a:1,ftp://b")); err == nil {
		t.Fatal("a bad endpoint in the list was accepted")
	}
}

func TestWithoutIdempotencyKeys(t *testing.T) {
	rec := newRecorder(t, func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, 201, api.Sandbox{ID: "sb-e1-x"})
	})
	c, _ := New(WithEndpoint(deadEndpoint(t)+","+rec.URL), WithoutIdempotencyKeys())
	// Without a key, a create is not sent twice... but a dial failure is
	// a request that never left: the next endpoint gets it, keyless.
	if _, err := c.CreateSandbox(context.Background(), api.SandboxSpec{Base: "base/x:1"}); err != nil {
		t.Fatal(err)
	}
	if rec.keys[0] != "" {
		t.Fatalf("key %q sent by a client without keys", rec.keys[0])
	}
	if _, err := c.CreateSandbox(WithIdempotencyKey(context.Background(), "mine"), api.SandboxSpec{Base: "base/x:1"}); err != nil || rec.keys[1] != "mine" {
		t.Fatalf("a chosen key: %q %v", rec.keys[1], err)
	}
}
