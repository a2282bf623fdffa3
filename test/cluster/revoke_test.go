package cluster

import (
	"context"
	"errors"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/cluster"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

// TestRevokedNodeCert: dsec cluster revoke-edge takes e3's certificate
// back. Within seconds both apiservers refuse e3 (its sandboxes'
// calls answer unavailable, naming the revocation), an edge started with
// that certificate refuses to start, and once add-edge has issued e3 a new
// one and e3 restarts with it, its sandbox is reachable again.
func TestRevokedNodeCert(t *testing.T) {
	need(t)
	victim := edgeOf("e3")
	sb := newSandbox(t, api.SandboxSpec{NodeSelector: map[string]string{"zone": "z3"}})
	t.Cleanup(func() { _ = c.client.DeleteSandbox(context.Background(), sb.ID) })
	mustExec(t, c.client, sb.ID, "echo kept > /root/mark")

	cli := func(args ...string) (string, error) {
		out, err := exec.Command(c.bin, args...).CombinedOutput()
		return string(out), err
	}
	etcdFlags := []string{"--etcd", strings.Join(c.etcd.Endpoints(), ","), "--cluster", c.clusterDir()}
	out, err := cli(append([]string{"cluster", "revoke-edge", "--node-name", "e3"}, etcdFlags...)...)
	if err != nil || !strings.Contains(out, "revoked") {
		t.Fatalf("revoke-edge: %v\n%s", err, out)
	}
	// Whatever happens below, e3 ends with a new certificate, running.
	restored := false
	restore := func() {
		if restored {
			return
		}
		restored = true
		if out, err := cli("cluster", "add-edge", "--dir", c.clusterDir(), "--node-name", "e3"); err != nil {
			t.Fatalf("add-edge: %v\n%s", err, out)
		}
		// The new certificate's etcd user.
		if out, err := c.etcdAuth(); err != nil || !strings.Contains(out, "node e3: etcd user") {
			t.Fatalf("etcd-auth after add-edge: %v\n%s", err, out)
		}
		victim.kill9()
		if err := victim.start(c.bin); err != nil {
			t.Fatal(err)
		}
		if err := c.waitNodes(60*time.Second, "e1", "e2", "e3"); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(restore)

	for i, pc := range c.perServer {
		deadline := time.Now().Add(15 * time.Second)
		for {
			_, err := pc.Exec(ctx(t), sb.ID, api.ExecRequest{Argv: []string{"true"}})
			var ae *dsec.Error
			if errors.As(err, &ae) && ae.Code == "unavailable" && strings.Contains(ae.Message, "revoked") {
				t.Logf("apiserver %d refuses e3: %s", i, ae.Message)
				if strings.Contains(ae.Message, "retry later") {
					t.Errorf("apiserver %d tells to retry a call to a revoked node: %s", i, ae.Message)
				}
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("apiserver %d: e3's sandbox 15 s after its certificate was revoked: %v, want unavailable naming the revocation", i, err)
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
	// The revoked certificate cannot start an edge either.
	victim.kill9()
	revoked, _ := filepath.Glob(filepath.Join(c.clusterDir(), cluster.RevokedDir, "e3-*"))
	if len(revoked) != 1 {
		t.Fatalf("revoked directories %v, want e3's", revoked)
	}
	args := append([]string(nil), victim.args...)
	for i := range args {
		if args[i] == "--cluster" {
			args[i+1] = revoked[0]
		}
	}
	ectx, cancel := context.WithTimeout(ctx(t), 60*time.Second)
	defer cancel()
	out2, err := exec.CommandContext(ectx, c.bin, args...).CombinedOutput()
	if err == nil || !strings.Contains(string(out2), "revoked") {
		t.Fatalf("an edge with the revoked certificate: %v, want it refused\n%s", err, lastLines(string(out2), 10))
	}
	t.Logf("an edge with the revoked certificate: %s", lastLines(string(out2), 1))

	// A revoked edge that still runs keeps its registry entry alive with
	// its etcd pair (here, this test holds it).
	held := c.etcdAs(t, revoked[0])
	hctx, hcancel := context.WithCancel(ctx(t))
	defer hcancel()
	if _, err := held.Hold(hctx, "cluster_nodes", "e3", []byte(`{"name":"e3","address":"127.0.0.1:1"}`), cluster.LeaseTTL,
		func([]byte) bool { return true }); err != nil {
		t.Fatalf("holding e3's entry with the revoked pair: %v", err)
	}
	// etcd-auth run again deletes the revoked node's etcd user (its pair
	// then reaches nothing) and its registry entry, which the revoked
	// pair cannot write again.
	tr, err := cluster.Load(c.clusterDir())
	if err != nil {
		t.Fatal(err)
	}
	cur, rev, err := tr.NodeEtcdUsers()
	if err != nil || len(cur) != 2 || len(rev) != 1 || rev[0].Node != "e3" {
		t.Fatalf("node etcd users after the revocation: %+v, revoked %+v, %v", cur, rev, err)
	}
	out3, err := c.etcdAuth()
	if err != nil || !strings.Contains(out3, "deleted etcd user "+rev[0].User) || !strings.Contains(out3, "removed node e3's registry entry") {
		t.Fatalf("etcd-auth after the revocation: %v\n%s", err, out3)
	}
	if err := held.Ping(ctx(t)); err == nil {
		t.Fatal("the revoked node's etcd pair still reaches etcd")
	} else {
		t.Logf("the revoked node's etcd pair: %v", err)
	}
	// An edge started from the revoked directory now fails at etcd,
	// saying whose user etcd refused and why it may be gone.
	ectx2, cancel2 := context.WithTimeout(ctx(t), 60*time.Second)
	defer cancel2()
	out5, err := exec.CommandContext(ectx2, c.bin, args...).CombinedOutput()
	if err == nil || !strings.Contains(string(out5), "this directory's etcd user is "+rev[0].User) {
		t.Fatalf("an edge with the revoked directory after etcd-auth: %v, want etcd's refusal explained\n%s", err, lastLines(string(out5), 10))
	}
	server := c.etcdAs(t, filepath.Join(c.clusterDir(), "server"))
	time.Sleep(2 * cluster.LeaseTTL)
	if v, err := server.Get("cluster_nodes", "e3"); err == nil {
		t.Fatalf("e3's entry %s after etcd-auth, held with the revoked pair", v)
	}
	// Once more: nothing left to delete, and the live nodes keep theirs.
	if out4, err := c.etcdAuth(); err != nil || strings.Contains(out4, "deleted") || strings.Contains(out4, "removed") {
		t.Fatalf("etcd-auth once more: %v\n%s", err, out4)
	}

	restore()
	for i, pc := range c.perServer {
		deadline := time.Now().Add(30 * time.Second)
		for {
			res, err := pc.Exec(ctx(t), sb.ID, api.ExecRequest{Cmd: "cat /root/mark"})
			if err == nil && strings.TrimSpace(res.Stdout) == "kept" {
				t.Logf("apiserver %d reaches e3's sandbox again", i)
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("apiserver %d: e3's sandbox with e3's new certificate: %+v, %v", i, res, err)
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
}
