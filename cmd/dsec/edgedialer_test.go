package main

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/dsecproject/dsec/internal/cluster"
	"github.com/dsecproject/dsec/internal/edgeapi"
)

// TestEdgeDialer: one transport per node, kept while its address stays,
// replaced when it changes, dropped when the node leaves; each checks the
// certificate against its own node.
func TestEdgeDialer(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "c")
	if _, err := cluster.Init(dir, cluster.InitOptions{}); err != nil {
		t.Fatal(err)
	}
	d, err := newEdgeDialer(mustLoad(t, filepath.Join(dir, "server")), true)
	if err != nil {
		t.Fatal(err)
	}
	d.dial(cluster.NodeRecord{Name: "n1", Address: "127.0.0.1:1"})
	first := d.by["n1"].hc
	d.dial(cluster.NodeRecord{Name: "n1", Address: "127.0.0.1:1"})
	d.dial(cluster.NodeRecord{Name: "n2", Address: "127.0.0.1:1"})
	if d.by["n1"].hc != first || d.by["n2"].hc == first || len(d.by) != 2 {
		t.Fatalf("transports: %+v", d.by)
	}
	d.dial(cluster.NodeRecord{Name: "n1", Address: "127.0.0.1:2"})
	if d.by["n1"].hc == first || d.by["n1"].addr != "127.0.0.1:2" {
		t.Fatal("n1's transport kept across an address change")
	}
	d.forget("n2")
	d.forget("n9")
	if _, ok := d.by["n2"]; ok || len(d.by) != 1 {
		t.Fatalf("after forgetting n2: %+v", d.by)
	}
	if _, err := newEdgeDialer(mustLoad(t, filepath.Join(dir, "edge")), false); err == nil {
		t.Fatal("an edge's directory made an apiserver's dialer")
	}
}

// TestCheckNodeCert: an edge starts from its own node's directory or the
// shared one, never from another node's.
func TestCheckNodeCert(t *testing.T) {
	dir, n1 := clusterWithN1(t)
	if err := checkNodeCert(n1, "n1"); err != nil {
		t.Fatalf("n1 from its own directory: %v", err)
	}
	if err := checkNodeCert(filepath.Join(dir, "edge"), "n2"); err != nil {
		t.Fatalf("n2 from the shared directory: %v", err)
	}
	if err := checkNodeCert(n1, "n2"); err == nil || !strings.Contains(err.Error(), "holds node n1's certificate, not n2's") {
		t.Fatalf("n2 from n1's directory: %v", err)
	}
}

// clusterWithN1 makes a cluster directory and node n1's (add-edge).
func clusterWithN1(t *testing.T) (dir, n1 string) {
	t.Helper()
	dir = filepath.Join(t.TempDir(), "c")
	if _, err := cluster.Init(dir, cluster.InitOptions{}); err != nil {
		t.Fatal(err)
	}
	n1, err := cluster.AddEdge(dir, "n1")
	if err != nil {
		t.Fatal(err)
	}
	return dir, n1
}

func mustLoad(t *testing.T, dir string) *cluster.Trust {
	t.Helper()
	tr, err := cluster.Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	return tr
}

// TestEdgeDialerCutClosesCallsUnderWay: when a node's certificate is
// revoked (cut), its calls under way end at once, not only its idle
// connections; a node that left the registry (forget) keeps them.
func TestEdgeDialerCutClosesCallsUnderWay(t *testing.T) {
	dir, n1 := clusterWithN1(t)
	srvTLS, err := mustLoad(t, n1).EdgeServerTLS()
	if err != nil {
		t.Fatal(err)
	}
	entered := make(chan struct{}, 4)
	release := make(chan struct{})
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		entered <- struct{}{}
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	srv.TLS = srvTLS
	srv.StartTLS()
	defer srv.Close()
	defer close(release) // before Close, which waits for the handlers
	d, err := newEdgeDialer(mustLoad(t, filepath.Join(dir, "server")), true)
	if err != nil {
		t.Fatal(err)
	}
	call := func() chan error {
		e := d.dial(cluster.NodeRecord{Name: "n1", Address: srv.Listener.Addr().String()})
		done := make(chan error, 1)
		go func() {
			_, err := e.Info(context.Background())
			done <- err
		}()
		select {
		case <-entered:
		case err := <-done:
			t.Fatalf("the call ended before the edge had it: %v", err)
		case <-time.After(5 * time.Second):
			t.Fatal("the call never reached the edge")
		}
		return done
	}
	done := call()
	d.forget("n1")
	select {
	case err := <-done:
		t.Fatalf("a call under way ended when its node left the registry: %v", err)
	case <-time.After(200 * time.Millisecond):
	}
	release <- struct{}{}
	if err := <-done; err == nil {
		// The test edge answers no JSON: any answer is an error; what
		// matters is that it came.
		t.Log("answered")
	}
	e := d.dial(cluster.NodeRecord{Name: "n1", Address: srv.Listener.Addr().String()})
	done = call()
	d.cut("n1")
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("a cut call succeeded")
		}
	case <-time.After(2 * time.Second):
		t.Fatal("a call under way went on after its node's certificate was revoked")
	}
	// A client made before the cut says why, and not to retry.
	_, err = e.Info(context.Background())
	if !edgeapi.IsUnreachable(err) || !errors.Is(err, edgeapi.ErrRevoked) || strings.Contains(err.Error(), "retry later") {
		t.Fatalf("a call after the cut: %v", err)
	}
	t.Log(err)
}
