package cluster

import (
	"encoding/json"
	"errors"
	"path/filepath"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/cluster"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

// TestNodeCertBindsAddress: an edge host may rewrite another node's
// address in the registry (its etcd user writes the registry), but it
// cannot answer for that node: each edge has a certificate of its own
// node (dsec cluster add-edge) and the apiservers (--require-node-certs)
// take at a node's address only that node's. With e1's address pointed
// at e2, calls to e1's sandboxes fail as unavailable, naming e2's
// certificate, and never reach e2; with the address back, they work.
func TestNodeCertBindsAddress(t *testing.T) {
	need(t)
	sb := newSandbox(t, api.SandboxSpec{NodeSelector: map[string]string{"zone": "z1"}})
	defer c.client.DeleteSandbox(ctx(t), sb.ID)
	mustExec(t, c.client, sb.ID, "true")

	// The registry as an edge host's etcd user sees and writes it.
	tr, err := cluster.Load(filepath.Join(c.clusterDir(), "edge"))
	if err != nil {
		t.Fatal(err)
	}
	tlsCfg, err := tr.EtcdTLS(cluster.EtcdTLSFiles{})
	if err != nil {
		t.Fatal(err)
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: c.etcd.Endpoints(), TLS: tlsCfg, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	key := func(node string) string { return "/dsec/cluster_nodes/" + node }
	get := func(node string) (cluster.NodeRecord, clientv3.LeaseID) {
		t.Helper()
		r, err := cli.Get(ctx(t), key(node))
		if err != nil || len(r.Kvs) != 1 {
			t.Fatalf("reading %s's record: %v", node, err)
		}
		var rec cluster.NodeRecord
		if err := json.Unmarshal(r.Kvs[0].Value, &rec); err != nil {
			t.Fatal(err)
		}
		return rec, clientv3.LeaseID(r.Kvs[0].Lease)
	}
	put := func(rec cluster.NodeRecord, lease clientv3.LeaseID) {
		t.Helper()
		b, _ := json.Marshal(rec)
		if _, err := cli.Put(ctx(t), key(rec.Name), string(b), clientv3.WithLease(lease)); err != nil {
			t.Fatalf("writing %s's record: %v", rec.Name, err)
		}
	}
	e1, lease := get("e1")
	e2, _ := get("e2")
	forged := e1
	forged.Address = e2.Address
	put(forged, lease)
	restored := false
	restore := func() {
		if !restored {
			restored = true
			put(e1, lease)
		}
	}
	defer restore()

	// Every apiserver, once it has read the new address, refuses e2's
	// certificate there.
	for i, pc := range c.perServer {
		deadline := time.Now().Add(15 * time.Second)
		for {
			_, err := pc.Exec(ctx(t), sb.ID, api.ExecRequest{Argv: []string{"true"}})
			if err != nil {
				var ae *dsec.Error
				if !errors.As(err, &ae) || ae.Code != "unavailable" || !strings.Contains(ae.Message, "node e2's") {
					t.Fatalf("apiserver %d, e1's address pointed at e2: %v, want unavailable naming e2's certificate", i, err)
				}
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("apiserver %d: e1's sandbox still answers 15 s after its address was pointed at e2", i)
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
	restore()
	if err := c.waitNodes(30*time.Second, "e1", "e2", "e3"); err != nil {
		t.Fatal(err)
	}
	for i, pc := range c.perServer {
		deadline := time.Now().Add(15 * time.Second)
		for {
			_, err := pc.Exec(ctx(t), sb.ID, api.ExecRequest{Argv: []string{"true"}})
			if err == nil {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("apiserver %d: e1's sandbox unreachable 15 s after its address was restored: %v", i, err)
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
}
