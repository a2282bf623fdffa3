package cluster

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/dsecproject/dsec/internal/cluster"
	"github.com/dsecproject/dsec/internal/store"
)

// TestEtcdRoles: with etcd's authentication on (the harness ran dsec
// cluster etcd-auth), the certificate an edge's machine holds reaches its
// own buckets and nothing else of the cluster: not the API keys, not the
// idempotency records, not quotas; it reads the layer catalog but does
// not write it. The apiservers' reaches everything.
func TestEtcdRoles(t *testing.T) {
	need(t)
	open := func(role string) *store.Etcd { return c.etcdAs(t, filepath.Join(c.clusterDir(), role)) }
	edge, server := open("edge"), open("server")
	keys, err := server.List("iam_keys", "")
	if err != nil || len(keys) == 0 {
		t.Fatalf("the apiservers' user listing API keys: %d, %v", len(keys), err)
	}
	for _, bucket := range []string{"iam_keys", "iam_projects", "idempotency", "quota", "e2b", "cluster_servers"} {
		if kvs, err := edge.List(bucket, ""); err == nil {
			t.Errorf("an edge's user listed %s: %d keys", bucket, len(kvs))
		} else if !strings.Contains(err.Error(), "refused this process") {
			t.Errorf("an edge's user listing %s: %v, want etcd's refusal", bucket, err)
		}
	}
	if _, err := edge.Get("iam_keys", keys[0].Key); err == nil {
		t.Error("an edge's user read an API key's record")
	}
	if err := edge.Put("iam_keys", "forged", []byte(`{"project":"root","role":"admin"}`)); err == nil {
		t.Error("an edge's user wrote an API key")
	}
	if _, err := server.Get("iam_keys", "forged"); err == nil {
		t.Fatal("the forged key is in etcd")
	}
	if err := edge.Put("", "top", []byte("x")); err == nil {
		t.Error("an edge's user wrote outside the buckets")
	}
	// The cluster's identity: read, never rewritten by an edge (every
	// process would then refuse etcd at its next start).
	id, err := edge.Get("cluster", "id")
	if err != nil {
		t.Fatalf("an edge's user reading the cluster's id: %v", err)
	}
	if err := edge.Put("cluster", "id", []byte("forged")); err == nil {
		t.Error("an edge's user rewrote the cluster's id")
	}
	if got, err := server.Get("cluster", "id"); err != nil || string(got) != string(id) {
		t.Fatalf("the cluster's id after the attempt: %q %v", got, err)
	}
	// The revoked certificates: read (an edge checks its own at start),
	// never written (a revoked node would lift its revocation).
	if _, err := edge.List("cluster_revoked", ""); err != nil {
		t.Errorf("an edge's user listing the revoked certificates: %v", err)
	}
	if err := edge.Put("cluster_revoked", "ff", []byte(`{"serial":"ff","node":"e1"}`)); err == nil {
		t.Error("an edge's user wrote a revocation")
	}
	if err := edge.Delete("cluster_revoked", "ff"); err == nil {
		t.Error("an edge's user deleted a revocation")
	}
	// What an edge does use.
	if err := edge.Ping(t.Context()); err != nil {
		t.Errorf("an edge's user pinging: %v", err)
	}
	if nodes, err := edge.List("cluster_nodes", ""); err != nil || len(nodes) < 3 {
		t.Errorf("an edge's user listing the registry: %d, %v", len(nodes), err)
	}
	// The layer catalog and its blob and index records: read (an edge
	// resolves refs and mounts digests), never written (the apiservers
	// publish the snapshots edges stage). An edge that could write them
	// would re-point a ref, or mark a blob for removal, for every node.
	layers, err := edge.List("layers", "")
	if err != nil || len(layers) == 0 {
		t.Fatalf("an edge's user listing the layer catalog: %d, %v", len(layers), err)
	}
	if err := edge.Put("layers", layers[0].Key, []byte(`{"ref":"`+layers[0].Key+`","digest":"sha256:`+strings.Repeat("0", 64)+`"}`)); err == nil {
		t.Errorf("an edge's user re-pointed the layer %s", layers[0].Key)
	}
	if err := edge.Create("layers", "base/forged:1", []byte(`{}`)); err == nil {
		t.Error("an edge's user added a layer")
	}
	if err := edge.Delete("layers", layers[0].Key); err == nil {
		t.Errorf("an edge's user deleted the layer %s", layers[0].Key)
	}
	for _, bucket := range []string{"layer_blobs", "layer_indexes"} {
		if err := edge.Put(bucket, "sha256:"+strings.Repeat("0", 64), []byte(`{}`)); err == nil {
			t.Errorf("an edge's user wrote %s", bucket)
		}
	}
	if got, err := server.Get("layers", layers[0].Key); err != nil || string(got) != string(layers[0].Value) {
		t.Fatalf("the layer %s after the attempts: %s %v", layers[0].Key, got, err)
	}

	// A node's own user (its directory from add-edge): its own registry
	// entry and abandoned creates, nobody else's.
	e1 := open(filepath.Join(cluster.EdgesDir, "e1"))
	if nodes, err := e1.List("cluster_nodes", ""); err != nil || len(nodes) < 3 {
		t.Errorf("e1's user listing the registry: %d, %v", len(nodes), err)
	}
	e2rec, err := server.Get("cluster_nodes", "e2")
	if err != nil {
		t.Fatal(err)
	}
	if err := e1.Put("cluster_nodes", "e2", []byte(`{"name":"e2","address":"127.0.0.1:1"}`)); err == nil {
		t.Error("e1's user rewrote e2's registry entry")
	}
	if err := e1.Delete("cluster_nodes", "e2"); err == nil {
		t.Error("e1's user deleted e2's registry entry")
	}
	if err := e1.Put("cluster_nodes", "e1x", []byte(`{}`)); err == nil {
		t.Error("e1's user wrote the entry of a node named e1x")
	}
	if got, err := server.Get("cluster_nodes", "e2"); err != nil || string(got) != string(e2rec) {
		t.Fatalf("e2's entry after the attempts: %s %v", got, err)
	}
	for _, k := range []string{"e2/forged", "e1x/forged", "e1"} {
		if err := e1.Put("cluster_abandoned", k, []byte(`{}`)); err == nil {
			t.Errorf("e1's user wrote abandoned create %s", k)
		}
	}
	if err := e1.Put("cluster_abandoned", "e1/test-token", []byte(`{"at":"2026-01-01T00:00:00Z"}`)); err != nil {
		t.Errorf("e1's user writing its own abandoned create: %v", err)
	}
	if err := e1.Delete("cluster_abandoned", "e1/test-token"); err != nil {
		t.Errorf("e1's user deleting its own abandoned create: %v", err)
	}
	for _, bucket := range []string{"layers", "cluster_revoked", "cluster"} {
		if _, err := e1.List(bucket, ""); err != nil {
			t.Errorf("e1's user listing %s: %v", bucket, err)
		}
		if err := e1.Put(bucket, "forged", []byte(`{}`)); err == nil {
			t.Errorf("e1's user wrote %s", bucket)
		}
	}
	if _, err := e1.List("iam_keys", ""); err == nil {
		t.Error("e1's user listed API keys")
	}

	// The shared user deleted (every node has its own directory): the
	// shared pair reaches nothing, and a later run without the flag
	// keeps it so; the flag's true brings it back.
	t.Cleanup(func() { _, _ = c.etcdAuth("--shared-edge-user=true") })
	if out, err := c.etcdAuth("--shared-edge-user=false"); err != nil || !strings.Contains(out, "deleted etcd user "+cluster.EtcdEdgeUser(c.clusterID(t))) {
		t.Fatalf("etcd-auth --shared-edge-user=false: %v\n%s", err, out)
	}
	if err := edge.Ping(t.Context()); err == nil {
		t.Error("the shared pair reaches etcd after its user was deleted")
	}
	if out, err := c.etcdAuth(); err != nil || !strings.Contains(out, "only nodes' own users") {
		t.Fatalf("etcd-auth after --shared-edge-user=false: %v\n%s", err, out)
	}
	if err := edge.Ping(t.Context()); err == nil {
		t.Error("a run without the flag brought the shared user back")
	}
	if err := e1.Ping(t.Context()); err != nil {
		t.Errorf("e1's user without the shared one: %v", err)
	}
	if out, err := c.etcdAuth("--shared-edge-user=true"); err != nil || strings.Contains(out, "only nodes' own users") {
		t.Fatalf("etcd-auth --shared-edge-user=true: %v\n%s", err, out)
	}
	if err := edge.Ping(t.Context()); err != nil {
		t.Errorf("the shared pair after --shared-edge-user=true: %v", err)
	}

	// Run again: the roles are set anew, and root's password must match.
	args := []string{"cluster", "etcd-auth", "--etcd", strings.Join(c.etcd.Endpoints(), ","), "--cluster", c.clusterDir()}
	out, err := exec.Command(c.bin, append(args, "--root-password-file", c.rootPasswordFile())...).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "was on already") {
		t.Fatalf("etcd-auth again: %v %s", err, out)
	}
	wrong := filepath.Join(t.TempDir(), "pw")
	if err := os.WriteFile(wrong, []byte("not-the-root-password\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(c.bin, append(args, "--root-password-file", wrong)...).CombinedOutput(); err == nil || !strings.Contains(string(out), "authentication failed") {
		t.Fatalf("etcd-auth with a wrong root password: %v %s", err, out)
	}
	// An edge's directory cannot turn itself into an apiserver's user:
	// refused before etcd is asked, and, with its pair given as files
	// (past that check), by etcd.
	edgeDir := filepath.Join(c.clusterDir(), "edge")
	edgeArgs := []string{"cluster", "etcd-auth", "--etcd", strings.Join(c.etcd.Endpoints(), ","), "--cluster", edgeDir,
		"--root-password-file", filepath.Join(t.TempDir(), "new")}
	if out, err := exec.Command(c.bin, edgeArgs...).CombinedOutput(); err == nil || !strings.Contains(string(out), "holds the etcd pair of dsec-edge-") {
		t.Fatalf("etcd-auth from an edge's directory: %v %s", err, out)
	}
	edgeArgs = append(edgeArgs, "--etcd-cert", filepath.Join(edgeDir, cluster.EtcdClientCert), "--etcd-key", filepath.Join(edgeDir, cluster.EtcdClientKey))
	if out, err := exec.Command(c.bin, edgeArgs...).CombinedOutput(); err == nil || !strings.Contains(string(out), "logging in as root: etcdserver: authentication failed") {
		t.Fatalf("etcd-auth with an edge's pair and a new password: %v %s", err, out)
	}
	if _, err := os.Stat(edgeArgs[len(edgeArgs)-5]); err == nil {
		t.Error("a refused etcd-auth left the password it made")
	}
	if _, err := edge.List("iam_keys", ""); err == nil {
		t.Error("after the attempts, an edge's user lists API keys")
	}
}
