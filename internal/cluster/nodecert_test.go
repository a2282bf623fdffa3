package cluster

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/dsecproject/dsec/internal/edgeapi"
)

// TestNodeCertificates: a node's own certificate (AddEdge) is taken for
// that node only; the edges' shared one for any node unless the
// apiserver requires node certificates; nothing else for any: another
// node's, another cluster's (even for the same node name), a certificate
// not for serving.
func TestNodeCertificates(t *testing.T) {
	tr, dir := mustInit(t)
	load := func(d string) *Trust { return mustLoad(t, d) }
	add := func(dir, node string) *Trust {
		t.Helper()
		out, err := AddEdge(dir, node)
		if err != nil {
			t.Fatal(err)
		}
		if out != filepath.Join(dir, EdgesDir, node) {
			t.Fatalf("node %s written to %s", node, out)
		}
		return load(out)
	}
	n1, n2 := add(dir, "n1"), add(dir, "n2.rack-3")
	for tr, want := range map[*Trust]string{n1: "n1", n2: "n2.rack-3", load(filepath.Join(dir, "edge")): ""} {
		if got, err := tr.NodeName(); err != nil || got != want {
			t.Fatalf("%s: node %q, %v; want %q", tr.dir, got, err, want)
		}
	}
	// A node's directory holds what DIR/edge does, no CA key, keys 0600.
	ents, _ := os.ReadDir(filepath.Join(dir, EdgesDir, "n1"))
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
		if strings.HasSuffix(e.Name(), "-key.pem") {
			if fi, _ := e.Info(); fi.Mode().Perm() != 0o600 {
				t.Fatalf("%s: mode %v", e.Name(), fi.Mode())
			}
		}
	}
	if got := strings.Join(names, " "); got != "ca.pem cluster.json edge-key.pem edge.pem etcd-client-key.pem etcd-client.pem" {
		t.Fatalf("edges/n1 holds %s", got)
	}
	// Each node's etcd pair is its own (a user of its own), valid for the
	// cluster's etcd; NodeEtcdUsers lists them.
	users, revokedUsers, err := tr.NodeEtcdUsers()
	if err != nil || len(users) != 2 || len(revokedUsers) != 0 {
		t.Fatalf("node etcd users %+v %v", users, err)
	}
	for _, u := range users {
		rest, ok := strings.CutPrefix(u.User, EtcdNodeUserPrefix(tr.Info.ID)+u.Node+"-")
		if !ok || len(rest) != 12 {
			t.Fatalf("node %s's etcd user %q", u.Node, u.User)
		}
		cfg, err := load(filepath.Join(dir, EdgesDir, u.Node)).EtcdTLS(EtcdTLSFiles{})
		if err != nil || len(cfg.Certificates) != 1 {
			t.Fatalf("node %s's etcd pair: %v", u.Node, err)
		}
		leaf, _ := x509.ParseCertificate(cfg.Certificates[0].Certificate[0])
		if _, verr := leaf.Verify(x509.VerifyOptions{Roots: tr.pool, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); leaf.Subject.CommonName != u.User || verr != nil {
			t.Fatalf("node %s's etcd certificate: %q", u.Node, leaf.Subject.CommonName)
		}
	}
	// A node directory of an earlier release (the shared pair) is not
	// listed; one whose pair names another node is refused.
	old := filepath.Join(dir, EdgesDir, "old")
	if err := os.MkdirAll(old, 0o700); err != nil {
		t.Fatal(err)
	}
	sharedPair, _ := os.ReadFile(filepath.Join(dir, "edge", EtcdClientCert))
	if err := os.WriteFile(filepath.Join(old, EtcdClientCert), sharedPair, 0o644); err != nil {
		t.Fatal(err)
	}
	if users, _, err := tr.NodeEtcdUsers(); err != nil || len(users) != 2 {
		t.Fatalf("with an older node directory: %+v %v", users, err)
	}
	n1Pair, _ := os.ReadFile(filepath.Join(dir, EdgesDir, "n1", EtcdClientCert))
	if err := os.WriteFile(filepath.Join(old, EtcdClientCert), n1Pair, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, _, err := tr.NodeEtcdUsers(); err == nil || !strings.Contains(err.Error(), "not one of node old") {
		t.Fatalf("a node directory holding n1's etcd pair: %v", err)
	}
	os.RemoveAll(old)

	lenient, err := tr.APIServerClientTLS(false)
	if err != nil {
		t.Fatal(err)
	}
	strict, err := tr.APIServerClientTLS(true)
	if err != nil {
		t.Fatal(err)
	}
	shared := serveEdge(t, tr)
	at1, at2 := serveEdge(t, n1), serveEdge(t, n2)
	// Edges of another cluster that would serve this one's apiservers:
	// only the apiserver's own check can refuse them.
	other, otherDir := mustInit(t)
	foreign1 := serveEdge(t, add(otherDir, "n1"), tr)
	for _, c := range []struct {
		what string
		cfg  *tls.Config
		addr string
		why  string // "" for taken
	}{
		{"n1's own certificate", strict("n1"), at1, ""},
		{"n1's own certificate, lenient", lenient("n1"), at1, ""},
		{"a dotted node name", strict("n2.rack-3"), at2, ""},
		{"n2's certificate at n1's address", strict("n1"), at2, "node n2.rack-3's"},
		{"n2's certificate at n1's address, lenient", lenient("n1"), at2, "node n2.rack-3's"},
		{"the shared certificate", lenient("n1"), shared, ""},
		{"the shared certificate to a strict apiserver", strict("n1"), shared, "requires node certificates"},
		{"another cluster's n1", lenient("n1"), foreign1, "unknown authority"},
		{"another cluster's shared edge", lenient("n1"), serveEdge(t, other, tr), "unknown authority"},
	} {
		_, err := client(c.cfg, c.addr).Info(t.Context())
		switch {
		case c.why == "" && err != nil:
			t.Errorf("%s: %v, want it taken", c.what, err)
		case c.why != "" && (err == nil || !strings.Contains(err.Error(), c.why)):
			t.Errorf("%s: %v, want refused for %q", c.what, err, c.why)
		case c.why != "":
			// Refused in the handshake: the request was never sent, so
			// a create may go to another node.
			var u *edgeapi.Unreachable
			if !errors.As(err, &u) || !u.NotSent {
				t.Errorf("%s: %#v, want unreachable and not sent", c.what, err)
			}
		}
	}
	// The apiserver's own certificate (client use only) served as an
	// edge's: refused.
	pair, _ := tr.pair(apiserverCert, apiserverKey)
	srv, _ := tr.EdgeServerTLS()
	srv.Certificates = []tls.Certificate{pair}
	ln, err := tls.Listen("tcp", "127.0.0.1:0", srv)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { _ = c.(*tls.Conn).Handshake(); c.Close() }()
		}
	}()
	if _, err := client(lenient("n1"), ln.Addr().String()).Info(t.Context()); err == nil || !strings.Contains(err.Error(), "incompatible key usage") {
		t.Errorf("an apiserver certificate served as an edge's: %v", err)
	}
	// The URI names a node only for this cluster and only in its form.
	if x, _ := url.Parse(NodeURI(tr.Info.ID, "n1")); x == nil {
		t.Fatal("NodeURI does not parse")
	} else if node, ok := tr.nodeOf(x); !ok || node != "n1" {
		t.Fatalf("NodeURI names %q, %v", node, ok)
	}
	for _, u := range []string{NodeURI(other.Info.ID, "n1"), "dsec://" + tr.Info.ID + "/edge/N1", "dsec://" + tr.Info.ID + "/edge/n1?x=1",
		"https://" + tr.Info.ID + "/edge/n1", "dsec://" + tr.Info.ID + "/edge/n1/x", "dsec://" + tr.Info.ID + "/node/n1"} {
		x, err := url.Parse(u)
		if err != nil {
			t.Fatal(err)
		}
		if node, ok := tr.nodeOf(x); ok {
			t.Errorf("%s names node %q", u, node)
		}
	}

	// What a killed run left for a node goes when it is issued; another
	// node's (a name it is a prefix of) stays.
	for _, left := range []string{".n3.123", ".n3.x.456"} {
		if err := os.MkdirAll(filepath.Join(dir, EdgesDir, left), 0o700); err != nil {
			t.Fatal(err)
		}
	}
	add(dir, "n3")
	if _, err := os.Stat(filepath.Join(dir, EdgesDir, ".n3.123")); err == nil {
		t.Error("n3's leftover is still there")
	}
	if _, err := os.Stat(filepath.Join(dir, EdgesDir, ".n3.x.456")); err != nil {
		t.Errorf("n3.x's leftover was removed: %v", err)
	}
	_ = os.Remove(filepath.Join(dir, EdgesDir, ".n3.x.456"))

	// Refused: a node twice, a bad name, a role directory (no CA key);
	// none leaves a directory behind.
	if _, err := AddEdge(dir, "n1"); err == nil || !strings.Contains(err.Error(), "exists") {
		t.Errorf("n1 again: %v", err)
	}
	for _, bad := range []string{"", "../x", "N1", "a/b", ".x"} {
		if _, err := AddEdge(dir, bad); err == nil {
			t.Errorf("node %q: accepted", bad)
		}
	}
	if _, err := AddEdge(filepath.Join(dir, "edge"), "n3"); err == nil || !strings.Contains(err.Error(), "ca-key.pem") {
		t.Errorf("from a role directory: %v", err)
	}
	ents, _ = os.ReadDir(filepath.Join(dir, EdgesDir))
	if len(ents) != 3 {
		t.Errorf("edges/ holds %d entries, want 3", len(ents))
	}
}
