package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/dsecproject/dsec/internal/cluster"
)

// TestRootPassword: etcd's root password is read from its file, or made
// and written there (0600) when there is none; a short one is refused.
func TestRootPassword(t *testing.T) {
	path := filepath.Join(t.TempDir(), "pw")
	pw, made, err := rootPassword(path)
	if err != nil || !made || len(pw) < 32 {
		t.Fatalf("new: %q %v %v", pw, made, err)
	}
	if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("written: %v %v", fi, err)
	}
	again, made, err := rootPassword(path)
	if err != nil || made || again != pw {
		t.Fatalf("read back: %q %v %v, want %q", again, made, err, pw)
	}
	short := filepath.Join(t.TempDir(), "short")
	if err := os.WriteFile(short, []byte("abc\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, _, err := rootPassword(short); err == nil || !strings.Contains(err.Error(), "at least 12") {
		t.Fatalf("short: %v", err)
	}
}

// TestEtcdUsers: apiservers get the whole prefix; edges only their
// buckets, never IAM's, idempotency's or quotas'.
func TestEtcdUsers(t *testing.T) {
	if users := etcdUsers("c1", nil, false); len(users) != 1 || users[0].Name != "dsec-server-c1" {
		t.Fatalf("without the shared edge user: %+v", users)
	}
	users := etcdUsers("c1", []cluster.NodeEtcdUser{{Node: "n1", User: "dsec-edge-c1-n1-ab"}}, true)
	if len(users) != 3 || users[0].Name != cluster.EtcdServerUser("c1") || !users[0].All || users[0].Name != "dsec-server-c1" {
		t.Fatalf("users %+v", users)
	}
	edge := users[1]
	if edge.Name != cluster.EtcdEdgeUser("c1") || edge.All {
		t.Fatalf("edge user %+v", edge)
	}
	have, writes := map[string]bool{}, map[string]bool{}
	for _, g := range edge.Grants {
		have[g.Bucket+g.Key] = true
		writes[g.Bucket+g.Key] = g.Write
	}
	for _, b := range []string{"cluster_nodes", "cluster_abandoned", "cluster", "layers", "ping"} {
		if !have[b] {
			t.Errorf("edges may not use %s", b)
		}
	}
	for _, b := range []string{"cluster", "ping"} {
		if writes[b] {
			t.Errorf("edges may write %s", b)
		}
	}
	for _, b := range []string{"iam_keys", "iam_projects", "iam_audit", "idempotency", "quota", "e2b", "cluster_servers"} {
		if have[b] {
			t.Errorf("edges may use %s", b)
		}
	}
	for _, b := range []string{"layers", "layer_blobs", "layer_indexes"} {
		if writes[b] {
			t.Errorf("edges may write %s", b)
		}
	}
	// A node's own user: what the shared one reads, and writes only of
	// its own.
	node := users[2]
	if node.Name != "dsec-edge-c1-n1-ab" || node.All {
		t.Fatalf("node user %+v", node)
	}
	var nodeWrites []string
	nodeReads := map[string]bool{}
	for _, g := range node.Grants {
		if g.Write {
			nodeWrites = append(nodeWrites, g.Bucket+"|"+g.Key+"|"+g.Prefix)
		} else {
			nodeReads[g.Bucket+g.Key] = true
		}
	}
	if fmt.Sprint(nodeWrites) != "[|cluster_nodes/n1| ||cluster_abandoned/n1/]" {
		t.Errorf("a node's user writes %v", nodeWrites)
	}
	for _, b := range []string{"cluster_nodes", "cluster", "cluster_revoked", "layers", "ping"} {
		if !nodeReads[b] {
			t.Errorf("a node's user may not read %s", b)
		}
	}
}

// TestRevokeEdgeBadInput: revoke-edge says what is missing before it
// reaches etcd.
func TestRevokeEdgeBadInput(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{nil, "--etcd is required"},
		{[]string{"--etcd", "http://127.0.0.1:1"}, "--cluster is required"},
		{[]string{"--etcd", "http://127.0.0.1:1", "--cluster", t.TempDir()}, "--node-name is required"},
		{[]string{"--etcd", "http://127.0.0.1:1", "--cluster", t.TempDir(), "--node-name", "n1"}, "cluster.json"},
	} {
		if err := runCluster(append([]string{"revoke-edge"}, c.args...)); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("revoke-edge %v: %v, want %q", c.args, err, c.want)
		}
	}
}
