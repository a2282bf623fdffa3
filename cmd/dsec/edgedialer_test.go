package main

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/dsecproject/dsec/internal/cluster"
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
	dir := filepath.Join(t.TempDir(), "c")
	if _, err := cluster.Init(dir, cluster.InitOptions{}); err != nil {
		t.Fatal(err)
	}
	n1, err := cluster.AddEdge(dir, "n1")
	if err != nil {
		t.Fatal(err)
	}
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

func mustLoad(t *testing.T, dir string) *cluster.Trust {
	t.Helper()
	tr, err := cluster.Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	return tr
}
