package cluster

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/edgeapi/edgetest"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/store"
)

func mustInit(t *testing.T) (*Trust, string) {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "cluster")
	if _, err := Init(dir, InitOptions{}); err != nil {
		t.Fatal(err)
	}
	tr, err := Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	return tr, dir
}

// serveEdge serves a fake edge's internal API over the edge TLS of tr,
// to the apiservers of tr's cluster, or of caller's if given.
func serveEdge(t *testing.T, tr *Trust, caller ...*Trust) string {
	t.Helper()
	cfg, err := tr.EdgeServerTLS()
	if err != nil {
		t.Fatal(err)
	}
	if len(caller) > 0 {
		cfg.ClientCAs = caller[0].pool
	}
	ln, err := tls.Listen("tcp", "127.0.0.1:0", cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: edgeapi.NewServer(edgetest.NewFake("n1"), nil), ErrorLog: nil}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { srv.Close() })
	return ln.Addr().String()
}

func client(cfg *tls.Config, addr string) *edgeapi.Client {
	return edgeapi.NewClient("n1", "https://"+addr, &http.Client{Transport: &http.Transport{TLSClientConfig: cfg}, Timeout: 5 * time.Second})
}

func TestInitRefusesAnExistingCluster(t *testing.T) {
	_, dir := mustInit(t)
	if _, err := Init(dir, InitOptions{}); err == nil || !strings.Contains(err.Error(), "already holds a cluster") {
		t.Fatalf("second init: %v", err)
	}
	for _, f := range []string{caKey, apiserverKey, edgeKey} {
		fi, err := os.Stat(filepath.Join(dir, f))
		if err != nil || fi.Mode().Perm() != 0o600 {
			t.Fatalf("%s: %v %v, want mode 0600", f, fi.Mode(), err)
		}
	}
	if _, err := Load(t.TempDir()); err == nil || !strings.Contains(err.Error(), "cluster init") {
		t.Fatalf("loading an empty dir: %v", err)
	}
	// A directory holding a role's directory is refused before anything
	// is written.
	half := t.TempDir()
	if err := os.Mkdir(filepath.Join(half, "edge"), 0o700); err != nil {
		t.Fatal(err)
	}
	if _, err := Init(half, InitOptions{}); err == nil || !strings.Contains(err.Error(), "edge/") {
		t.Fatalf("init over edge/: %v", err)
	}
	if ents, _ := os.ReadDir(half); len(ents) != 1 {
		t.Fatalf("the refused init wrote %d entries", len(ents))
	}
}

// TestRoleDirectories: Init writes a --cluster directory per role holding
// only what that role needs: an edge's has no apiserver key (which drives
// every edge) and nobody's has the CA's key; each works as --cluster.
func TestRoleDirectories(t *testing.T) {
	_, dir := mustInit(t)
	for role, want := range map[string][]string{
		"server": {"apiserver-key.pem", "apiserver.pem", "ca.pem", "cluster.json", "etcd-client-key.pem", "etcd-client.pem"},
		"edge":   {"ca.pem", "cluster.json", "edge-key.pem", "edge.pem", "etcd-client-key.pem", "etcd-client.pem"},
	} {
		ents, err := os.ReadDir(filepath.Join(dir, role))
		if err != nil {
			t.Fatal(err)
		}
		var got []string
		for _, e := range ents {
			got = append(got, e.Name())
		}
		if strings.Join(got, " ") != strings.Join(want, " ") {
			t.Fatalf("%s/ holds %v, want %v", role, got, want)
		}
		for _, f := range []string{apiserverKey, edgeKey, EtcdClientKey} {
			if fi, err := os.Stat(filepath.Join(dir, role, f)); err == nil && fi.Mode().Perm() != 0o600 {
				t.Fatalf("%s/%s: mode %v", role, f, fi.Mode())
			}
		}
	}
	server, err := Load(filepath.Join(dir, "server"))
	if err != nil {
		t.Fatal(err)
	}
	edge, err := Load(filepath.Join(dir, "edge"))
	if err != nil {
		t.Fatal(err)
	}
	good, err := server.APIServerClientTLS(false)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := client(good("n1"), serveEdge(t, edge)).Info(t.Context()); err != nil {
		t.Fatalf("an apiserver and an edge from their role directories: %v", err)
	}
	if _, err := edge.APIServerClientTLS(false); err == nil {
		t.Fatal("an edge's directory can act as an apiserver")
	}
	if _, err := server.EdgeServerTLS(); err == nil {
		t.Fatal("an apiserver's directory can act as an edge")
	}
}

// TestInternalAPITrust: the apiserver of the cluster reaches the edge;
// nobody else does, and the apiserver trusts no edge but the cluster's.
func TestInternalAPITrust(t *testing.T) {
	tr, _ := mustInit(t)
	addr := serveEdge(t, tr)
	tlsFor, err := tr.APIServerClientTLS(false)
	if err != nil {
		t.Fatal(err)
	}
	good := tlsFor("n1")
	if _, err := client(good, addr).Info(t.Context()); err != nil {
		t.Fatalf("the cluster's apiserver: %v", err)
	}

	// No client certificate: the handshake fails, nothing is served.
	noCert := good.Clone()
	noCert.Certificates = nil
	if _, err := client(noCert, addr).Info(t.Context()); err == nil {
		t.Fatal("served a caller without a certificate")
	}
	// A certificate of another cluster's CA.
	other, _ := mustInit(t)
	otherFor, _ := other.APIServerClientTLS(false)
	foreign := otherFor("n1")
	foreign.VerifyConnection = nil // it even trusts our edge (it takes any: InsecureSkipVerify)
	if _, err := client(foreign, addr).Info(t.Context()); err == nil {
		t.Fatal("served an apiserver of another cluster")
	}
	// The edge's own certificate, presented as a client: refused (an
	// edge never drives another edge).
	edgePair, _ := tr.pair(edgeCert, edgeKey)
	asEdge := good.Clone()
	asEdge.Certificates = []tls.Certificate{edgePair}
	if _, err := client(asEdge, addr).Info(t.Context()); err == nil {
		t.Fatal("served a caller with an edge certificate")
	}
	// Plain HTTP to the TLS port gets nothing.
	resp, err := http.Get("http://" + addr + edgeapi.Prefix + "/info")
	if err == nil {
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if strings.Contains(string(b), "n1") {
			t.Fatalf("plain HTTP was served: %s", b)
		}
	}
	// A forged edge (another CA's edge certificate): the apiserver refuses it.
	forged := serveEdge(t, other)
	if _, err := client(good, forged).Info(t.Context()); err == nil {
		t.Fatal("the apiserver trusted an edge of another cluster")
	}
}

func TestJoin(t *testing.T) {
	tr, _ := mustInit(t)
	st := store.NewMemory()
	layers := t.TempDir()
	if err := Join(st, tr, layers); err != nil {
		t.Fatalf("first process: %v", err)
	}
	if err := Join(st, tr, layers); err != nil {
		t.Fatalf("second process, same dirs: %v", err)
	}
	// Another directory (not the shared mount): refused.
	if err := Join(st, tr, t.TempDir()); !errors.Is(err, errdefs.ErrPrecondition) || !strings.Contains(err.Error(), "not the cluster's layer directory") {
		t.Fatalf("a different layer dir: %v", err)
	}
	// A layer dir of another cluster.
	other, _ := mustInit(t)
	otherSt := store.NewMemory()
	otherLayers := t.TempDir()
	if err := Join(otherSt, other, otherLayers); err != nil {
		t.Fatal(err)
	}
	if err := Join(st, tr, otherLayers); !errors.Is(err, errdefs.ErrPrecondition) {
		t.Fatalf("another cluster's layer dir: %v", err)
	}
	// This etcd given to another cluster's process.
	if err := Join(st, other, layers); !errors.Is(err, errdefs.ErrPrecondition) || !strings.Contains(err.Error(), "etcd belongs to cluster") {
		t.Fatalf("another cluster's etcd: %v", err)
	}
}

func TestRegistry(t *testing.T) {
	st := store.NewMemory()
	ctx, cancel := context.WithCancel(t.Context())
	rec := NodeRecord{Name: "n1", Address: "127.0.0.1:1", StartedAt: time.Now(), Instance: "0123456789abcdef"}
	if err := RegisterNode(ctx, st, rec, nil); err != nil {
		t.Fatal(err)
	}
	// A second edge with the live name is refused and told where it is,
	// not the holder's instance (which would let it take the name over).
	err := RegisterNode(t.Context(), st, NodeRecord{Name: "n1", Address: "127.0.0.1:2"}, nil)
	if !errors.Is(err, errdefs.ErrAlreadyExists) || !strings.Contains(err.Error(), "127.0.0.1:1") || strings.Contains(err.Error(), rec.Instance) {
		t.Fatalf("duplicate name: %v", err)
	}
	dialed := 0
	src := NewSource(st, func(r NodeRecord) edgeapi.Edge {
		dialed++
		return edgeapi.NewClient(r.Name, "https://"+r.Address, http.DefaultClient)
	})
	var forgot []string
	src.Forget = func(name string) { forgot = append(forgot, name) }
	m, err := src.Members(t.Context())
	if err != nil || len(m) != 1 || m["n1"].Address != "127.0.0.1:1" {
		t.Fatalf("members %+v, %v", m, err)
	}
	if _, err := src.Members(t.Context()); err != nil || dialed != 1 {
		t.Fatalf("a client per node is kept: dialed %d", dialed)
	}
	cancel()
	deadline := time.Now().Add(5 * time.Second)
	for {
		if m, _ := src.Members(t.Context()); len(m) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the entry outlived its holder")
		}
		time.Sleep(20 * time.Millisecond)
	}
	// Its client is forgotten with it (once), and made anew if it comes back.
	if len(src.known) != 0 || strings.Join(forgot, " ") != "n1" {
		t.Fatalf("a node gone from the registry: known %v, forgotten %v", src.known, forgot)
	}
	if err := RegisterNode(t.Context(), st, NodeRecord{Name: "n1", Address: "127.0.0.1:2"}, nil); err != nil {
		t.Fatalf("the name is free again: %v", err)
	}
	// An edge restarting on its state dir (same instance) takes over the
	// entry its dead predecessor still holds; another instance may not.
	dead, kill := context.WithCancel(t.Context())
	defer kill()
	st2 := store.NewMemory()
	if err := RegisterNode(dead, st2, NodeRecord{Name: "n2", Address: "a:1", Instance: "inst-1"}, nil); err != nil {
		t.Fatal(err)
	}
	if err := RegisterNode(t.Context(), st2, NodeRecord{Name: "n2", Address: "a:1", Instance: "inst-2"}, nil); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Fatalf("another instance took the name: %v", err)
	}
	// The takeover never shows the name as free: a watch of the registry
	// sees the new entry replace the old, and the predecessor's end (its
	// lease lapsing) leaves the new entry in place.
	var mu sync.Mutex
	var seen []string
	wctx, wcancel := context.WithCancel(t.Context())
	defer wcancel()
	st2.(store.Watcher).WatchBucket(wctx, bucketNodes, func([]store.KV) {}, func(key string, val []byte) {
		mu.Lock()
		defer mu.Unlock()
		seen = append(seen, fmt.Sprintf("%s:%t", key, val != nil))
	})
	if err := RegisterNode(t.Context(), st2, NodeRecord{Name: "n2", Address: "a:2", Instance: "inst-1"}, nil); err != nil {
		t.Fatalf("the same instance restarting: %v", err)
	}
	kill()
	time.Sleep(50 * time.Millisecond)
	if m, err := NewSource(st2, func(r NodeRecord) edgeapi.Edge { return nil }).Members(t.Context()); err != nil || m["n2"].Address != "a:2" {
		t.Fatalf("after the takeover and the predecessor's end: %+v, %v", m, err)
	}
	wcancel()
	mu.Lock()
	defer mu.Unlock()
	if got := strings.Join(seen, " "); got != "n2:true" {
		t.Fatalf("the registry changed as %q during the takeover, want one write", got)
	}
	dir := t.TempDir()
	id, known := StateInstance(dir)
	if known || id == "" {
		t.Fatalf("a fresh state dir has an instance: %q %v", id, known)
	}
	if err := SaveInstance(dir, id); err != nil {
		t.Fatal(err)
	}
	if again, known := StateInstance(dir); !known || again != id {
		t.Fatalf("instance not kept: %q %v", again, known)
	}

	// Liveness of apiservers.
	if err := RegisterServer(t.Context(), st, ServerRecord{Instance: "abc"}, nil); err != nil {
		t.Fatal(err)
	}
	if ok, err := ServerAlive(st, "abc"); !ok || err != nil {
		t.Fatalf("alive: %v %v", ok, err)
	}
	if ok, err := ServerAlive(st, "gone"); ok || err != nil {
		t.Fatalf("unknown instance alive: %v %v", ok, err)
	}
}
