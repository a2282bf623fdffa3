package cluster

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/store"
)

// TestRevokeEdge: a revoked node certificate is refused at its node's
// address by an apiserver that watches the revocations (and the node is
// named to drop its connections); the other nodes' are still taken; the
// node's directory moves aside so that a new one can be issued, which is
// taken; an edge started from the revoked directory is told so.
func TestRevokeEdge(t *testing.T) {
	tr, dir := mustInit(t)
	st := store.NewMemory()
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	var mu sync.Mutex
	var told []string
	tr.WatchRevoked(ctx, st, func(node string) {
		mu.Lock()
		told = append(told, node)
		mu.Unlock()
	})
	if _, err := AddEdge(dir, "n1"); err != nil {
		t.Fatal(err)
	}
	if _, err := AddEdge(dir, "n2"); err != nil {
		t.Fatal(err)
	}
	load := func(d string) *Trust { return mustLoad(t, d) }
	n1, n2 := load(filepath.Join(dir, EdgesDir, "n1")), load(filepath.Join(dir, EdgesDir, "n2"))
	strict, err := tr.APIServerClientTLS(true)
	if err != nil {
		t.Fatal(err)
	}
	at1, at2 := serveEdge(t, n1), serveEdge(t, n2)
	if _, err := client(strict("n1"), at1).Info(t.Context()); err != nil {
		t.Fatalf("n1 before its revocation: %v", err)
	}
	if ok, err := CheckNotRevoked(st, filepath.Join(dir, EdgesDir, "n1")); !ok || err != nil {
		t.Fatalf("n1 before its revocation: %v, %v", ok, err)
	}

	r, err := RevokeEdge(st, dir, "n1")
	if err != nil || r.Node != "n1" || r.Serial == "" {
		t.Fatalf("revoke: %+v, %v", r, err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		_, err := client(strict("n1"), at1).Info(t.Context())
		if err != nil && strings.Contains(err.Error(), "revoked") && strings.Contains(err.Error(), r.Serial) {
			// Refused in the handshake, and said so: not "retry later".
			if !errors.Is(err, edgeapi.ErrRevoked) || strings.Contains(err.Error(), "retry later") {
				t.Errorf("n1's refusal: %v", err)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("n1 after its revocation: %v, want refused as revoked", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	mu.Lock()
	if !strings.Contains(strings.Join(told, ","), "n1") {
		t.Errorf("the watch named %q, want n1", told)
	}
	mu.Unlock()
	if _, err := client(strict("n2"), at2).Info(t.Context()); err != nil {
		t.Fatalf("n2 after n1's revocation: %v", err)
	}
	// Its etcd user is now a revoked directory's, for etcd-auth to delete.
	if cur, rev, err := tr.NodeEtcdUsers(); err != nil || len(rev) != 1 || rev[0].Node != "n1" || slices.ContainsFunc(cur, func(u NodeEtcdUser) bool { return u.Node == "n1" }) {
		t.Fatalf("node etcd users after the revocation: %+v, revoked %+v, %v", cur, rev, err)
	}
	moved := filepath.Join(dir, RevokedDir, "n1-"+r.Serial)
	if ok, err := CheckNotRevoked(st, moved); !ok || err == nil || !strings.Contains(err.Error(), "revoked") {
		t.Fatalf("an edge from the revoked directory: %v, %v, want refused", ok, err)
	}
	if _, err := os.Stat(filepath.Join(dir, EdgesDir, "n1")); !os.IsNotExist(err) {
		t.Fatalf("n1's directory after revocation: %v, want moved to %s", err, moved)
	}
	// Not a node name: nothing read, moved or recorded.
	for _, bad := range []string{"", "..", "../server", "n2/../n2", "N2"} {
		if _, err := RevokeEdge(st, dir, bad); err == nil {
			t.Errorf("revoking %q: accepted", bad)
		}
	}
	if kvs, _ := st.List(bucketRevoked, ""); len(kvs) != 1 {
		t.Errorf("%d revocations recorded, want n1's", len(kvs))
	}
	// Not again: nothing to revoke.
	if _, err := RevokeEdge(st, dir, "n1"); err == nil || !strings.Contains(err.Error(), "does not exist") {
		t.Fatalf("revoking n1 again: %v", err)
	}
	// A new certificate for n1 is taken.
	if _, err := AddEdge(dir, "n1"); err != nil {
		t.Fatal(err)
	}
	again := filepath.Join(dir, EdgesDir, "n1")
	if ok, err := CheckNotRevoked(st, again); !ok || err != nil {
		t.Fatalf("n1's new certificate: %v, %v", ok, err)
	}
	if _, err := client(strict("n1"), serveEdge(t, load(again))).Info(t.Context()); err != nil {
		t.Fatalf("n1's new certificate: %v", err)
	}
	// An apiserver that starts later reads the revocations before it
	// dials.
	late := load(filepath.Join(dir, "server"))
	late.WatchRevoked(ctx, st, nil)
	lateTLS, err := late.APIServerClientTLS(true)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := client(lateTLS("n1"), at1).Info(t.Context()); err == nil || !strings.Contains(err.Error(), "revoked") {
		t.Fatalf("a later apiserver, n1's revoked certificate: %v", err)
	}
}

// mustLoad is Load of dir, or the test's end.
func mustLoad(t *testing.T, dir string) *Trust {
	t.Helper()
	x, err := Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	return x
}

// TestRevokedReadAnew: reading the revocations whole again (after a break
// in the watch) names only the nodes whose revocation is new, so that a
// break does not drop every node's connections; a record that does not
// decode still revokes its serial.
func TestRevokedReadAnew(t *testing.T) {
	tr, _ := mustInit(t)
	rec := func(serial, node string) store.KV {
		return store.KV{Key: serial, Value: []byte(`{"serial":"` + serial + `","node":"` + node + `"}`)}
	}
	if got := tr.setRevoked([]store.KV{rec("a1", "n1")}); strings.Join(got, ",") != "n1" {
		t.Fatalf("first read named %v, want n1", got)
	}
	if got := tr.setRevoked([]store.KV{rec("a1", "n1"), rec("b2", "n2")}); strings.Join(got, ",") != "n2" {
		t.Fatalf("read again named %v, want only n2", got)
	}
	tr.setRevoked([]store.KV{rec("a1", "n1"), {Key: "c3", Value: []byte("not json")}})
	m := *tr.revoked.Load()
	if _, ok := m["c3"]; !ok || len(m) != 2 {
		t.Fatalf("revoked after a record that does not decode: %v", m)
	}
	if r := tr.revokeOne("d4", []byte("{")); r.Serial != "d4" {
		t.Fatalf("a change that does not decode: %+v", r)
	}
	if _, ok := (*tr.revoked.Load())["d4"]; !ok {
		t.Fatal("a change that does not decode did not revoke its serial")
	}
}
