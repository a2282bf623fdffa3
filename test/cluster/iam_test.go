package cluster

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

// TestTenantsAcrossServers: two projects' keys through different
// apiservers cannot see each other's sandboxes on any node; a builder key
// can snapshot and a runtime key cannot; a key revoked through one
// apiserver stops working on the other within 2 s.
func TestTenantsAcrossServers(t *testing.T) {
	need(t)
	n := time.Now().UnixNano() % 1e9
	pa, pb := fmt.Sprintf("cl-a-%d", n), fmt.Sprintf("cl-b-%d", n)
	for _, p := range []string{pa, pb} {
		if _, err := c.perServer[0].CreateProject(ctx(t), api.CreateProjectRequest{Parent: "root", Name: p}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.client.DeleteProject(context.Background(), p, true) })
	}
	// keyed returns a client of a new key of role in project through
	// apiserver i only, and the key's id.
	keyed := func(i int, project, role string) (*dsec.Client, string) {
		t.Helper()
		k, err := c.perServer[0].CreateKey(ctx(t), project, api.CreateKeyRequest{Role: role})
		if err != nil {
			t.Fatal(err)
		}
		cl, err := dsec.New(dsec.WithEndpoint("http://"+c.servers[i].addr), dsec.WithAPIKey(k.Key), dsec.WithRetries(1))
		if err != nil {
			t.Fatal(err)
		}
		return cl, k.ID
	}
	a0, _ := keyed(0, pa, "member")
	b1, _ := keyed(1, pb, "member")
	builder1, _ := keyed(1, pa, "builder")

	// One sandbox of a on every node (spread by the job label).
	var mine []string
	for range 3 {
		sb, err := a0.CreateSandbox(ctx(t), api.SandboxSpec{Base: baseRef, Labels: map[string]string{"job": "tenant-" + pa}})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.client.DeleteSandbox(context.Background(), sb.ID) })
		mine = append(mine, sb.ID)
	}
	for _, id := range mine {
		_, err := b1.GetSandbox(ctx(t), id)
		wantCode(t, err, "not_found")
		_, err = b1.Exec(ctx(t), id, api.ExecRequest{Cmd: "true"})
		wantCode(t, err, "not_found")
	}
	if l, err := b1.ListSandboxes(ctx(t), dsec.ListOptions{}); err != nil || len(l.Sandboxes) != 0 {
		t.Fatalf("tenant b lists %d of others' sandboxes (%v)", len(l.Sandboxes), err)
	}
	if l, err := a0.ListSandboxes(ctx(t), dsec.ListOptions{}); err != nil || len(l.Sandboxes) != 3 {
		t.Fatalf("tenant a lists %v (%v), want its 3", l, err)
	}
	if k, err := b1.DeleteSandboxes(ctx(t), map[string]string{"job": "tenant-" + pa}); err != nil || k != 0 {
		t.Fatalf("tenant b deleted %d by labels (%v)", k, err)
	}

	_, err := a0.Snapshot(ctx(t), mine[0], api.SnapshotRequest{Ref: fmt.Sprintf("snapshot/cl%d:1", n)})
	wantCode(t, err, "permission_denied")
	l, err := builder1.Snapshot(ctx(t), mine[0], api.SnapshotRequest{Ref: fmt.Sprintf("snapshot/cl%d:1", n)})
	if err != nil {
		t.Fatalf("a builder's snapshot through the other apiserver: %v", err)
	}
	t.Cleanup(func() { _ = c.client.DeleteLayer(context.Background(), l.Ref) })

	// Revocation through s0 reaches s1, which has the key cached.
	victim, id := keyed(1, pa, "member")
	if _, err := victim.ListSandboxes(ctx(t), dsec.ListOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := c.perServer[0].RevokeKey(ctx(t), pa, id); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	for {
		_, err := victim.ListSandboxes(ctx(t), dsec.ListOptions{})
		if err != nil {
			wantCode(t, err, "unauthenticated")
			break
		}
		if time.Since(start) > 2*time.Second {
			t.Fatalf("a key revoked through s0 still works on s1 after %v", time.Since(start))
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("revocation seen by the other apiserver after %v", time.Since(start).Round(time.Millisecond))
}
