package edgeapi_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/edgeapi/edgetest"
)

// TestDeleteSurvivesAClosedKeptAliveConnection: a delete sent on a
// kept-alive connection that the edge closes without an answer is sent
// again on a new one (a delete is idempotent), so the caller sees it
// succeed instead of unavailable; the marker header is not sent.
func TestDeleteSurvivesAClosedKeptAliveConnection(t *testing.T) {
	ctx := context.Background()
	fe := edgetest.NewFake("n1")
	inner := edgeapi.NewServer(fe, nil)
	var dropped atomic.Bool
	var sawKey atomic.Bool
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, ok := r.Header["Idempotency-Key"]; ok && r.Method == "DELETE" {
			sawKey.Store(true)
		}
		if r.Method == "DELETE" && dropped.CompareAndSwap(false, true) {
			if conn, _, err := w.(http.Hijacker).Hijack(); err == nil {
				_ = conn.Close()
			}
			return
		}
		inner.ServeHTTP(w, r)
	}))
	defer srv.Close()
	c := edgeapi.NewClient("n1", srv.URL, srv.Client())
	sb, err := c.Create(ctx, edgeapi.CreateRequest{Spec: api.SandboxSpec{Base: "base/x:1"}})
	if err != nil {
		t.Fatal(err)
	}
	// The create's connection is kept alive; the delete reuses it.
	if err := c.Delete(ctx, sb.ID); err != nil {
		t.Fatalf("a delete whose kept-alive connection closed: %v, want it sent again and done", err)
	}
	if !dropped.Load() {
		t.Fatal("the first delete was not dropped")
	}
	if _, err := fe.Get(ctx, sb.ID); err == nil {
		t.Fatal("the sandbox is still there")
	}
	if sawKey.Load() {
		t.Fatal("the marker Idempotency-Key went on the wire")
	}
}
