package e2e

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

// TestTenantsOnOneNode: two projects' member keys on the real daemon.
// Each sees, drives and deletes only its own sandboxes: the other's
// answers not found to every call and is left out of its lists; a member
// cannot snapshot, a builder can; a revoked key stops at once.
func TestTenantsOnOneNode(t *testing.T) {
	needDaemon(t)
	n := time.Now().UnixNano() % 1e9
	pa, pb := fmt.Sprintf("tenant-a-%d", n), fmt.Sprintf("tenant-b-%d", n)
	for _, p := range []string{pa, pb} {
		if _, err := client.CreateProject(ctx(t), api.CreateProjectRequest{Parent: "root", Name: p}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = client.DeleteProject(context.Background(), p, true) })
	}
	var secrets = map[*dsec.Client]string{}
	keyed := func(project, role string) (*dsec.Client, string) {
		t.Helper()
		k, err := client.CreateKey(ctx(t), project, api.CreateKeyRequest{Role: role})
		if err != nil {
			t.Fatal(err)
		}
		c, err := dsec.New(dsec.WithEndpoint("http://"+d.listen), dsec.WithAPIKey(k.Key))
		if err != nil {
			t.Fatal(err)
		}
		secrets[c] = k.Key
		return c, k.ID
	}
	ca, idA := keyed(pa, "member")
	cb, _ := keyed(pb, "member")
	builder, _ := keyed(pa, "builder")
	builderB, _ := keyed(pb, "builder")

	// Layers: a's toolkit is a's; b neither sees it nor re-points it.
	tk := tarOf(t, []*tar.Header{{Name: "tool.txt", Typeflag: tar.TypeReg, Mode: 0o644}}, map[string][]byte{"tool.txt": []byte("a's")})
	tname := fmt.Sprintf("ten-%d", n)
	tl, err := builder.BuildLayer(ctx(t), "toolkit", tname, "1", bytes.NewReader(tk))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = client.DeleteLayer(context.Background(), tl.Ref) })
	if tl.Project != pa {
		t.Fatalf("layer of project %q, want %s", tl.Project, pa)
	}
	_, err = builderB.GetLayer(ctx(t), tl.Ref)
	wantCode(t, err, "not_found")
	r := wireCallAuth(t, "POST", "/v1/layers?kind=toolkit&name="+tname+"&tag=1&replace=true", tk, "Bearer "+secrets[builderB])
	wireWantError(t, "another tenant re-pointing the ref", r, 403, "permission_denied")
	if got, err := builder.GetLayer(ctx(t), tl.Ref); err != nil || got.Digest != tl.Digest {
		t.Fatalf("after another tenant's replace: %v %v", got, err)
	}
	_, err = cb.CreateSandbox(ctx(t), api.SandboxSpec{Base: baseRef, Toolkits: []string{tl.Ref}})
	wantCode(t, err, "not_found")

	sb, err := ca.CreateSandbox(ctx(t), api.SandboxSpec{Base: baseRef, Labels: map[string]string{"tenant": "a"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = client.DeleteSandbox(context.Background(), sb.ID) })
	if sb.Project != pa {
		t.Fatalf("sandbox of project %q, want %s", sb.Project, pa)
	}
	if res, err := ca.Exec(ctx(t), sb.ID, api.ExecRequest{Cmd: "echo mine"}); err != nil || res.ExitCode != 0 {
		t.Fatalf("its owner cannot exec: %v %v", res, err)
	}
	_, err = cb.GetSandbox(ctx(t), sb.ID)
	wantCode(t, err, "not_found")
	_, err = cb.Exec(ctx(t), sb.ID, api.ExecRequest{Cmd: "echo theirs"})
	wantCode(t, err, "not_found")
	err = cb.WriteFile(ctx(t), sb.ID, "/tmp/x", strings.NewReader("x"), 0o644)
	wantCode(t, err, "not_found")
	if err := cb.DeleteSandbox(ctx(t), sb.ID); err != nil {
		t.Fatalf("a delete of another's sandbox: %v, want nothing done", err)
	}
	if _, err := ca.GetSandbox(ctx(t), sb.ID); err != nil {
		t.Fatalf("another tenant's delete removed it: %v", err)
	}
	if l, err := cb.ListSandboxes(ctx(t), dsec.ListOptions{}); err != nil || len(l.Sandboxes) != 0 {
		t.Fatalf("tenant b lists %v, %v", l, err)
	}
	if n, err := cb.DeleteSandboxes(ctx(t), map[string]string{"tenant": "a"}); err != nil || n != 0 {
		t.Fatalf("tenant b deleted %v by labels (%v)", n, err)
	}

	_, err = ca.Snapshot(ctx(t), sb.ID, api.SnapshotRequest{Ref: fmt.Sprintf("snapshot/t%d:1", n)})
	wantCode(t, err, "permission_denied")
	l, err := builder.Snapshot(ctx(t), sb.ID, api.SnapshotRequest{Ref: fmt.Sprintf("snapshot/t%d:1", n)})
	if err != nil {
		t.Fatalf("a builder's snapshot: %v", err)
	}
	t.Cleanup(func() { _ = client.DeleteLayer(context.Background(), l.Ref) })

	if err := client.RevokeKey(ctx(t), pa, idA); err != nil {
		t.Fatal(err)
	}
	_, err = ca.GetSandbox(ctx(t), sb.ID)
	wantCode(t, err, "unauthenticated")
}

// TestQuotaOnOneNode: a project allowing 3 sandboxes gets 3 of a burst of
// 20 on the real daemon, the rest refused with quota_exceeded; a batch
// past the quota is partly made.
func TestQuotaOnOneNode(t *testing.T) {
	needDaemon(t)
	p := fmt.Sprintf("quota-%d", time.Now().UnixNano()%1e9)
	if _, err := client.CreateProject(ctx(t), api.CreateProjectRequest{Parent: "root", Name: p, Quota: api.ProjectQuota{Sandboxes: 3}}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = client.DeleteProject(context.Background(), p, true) })
	made, refused := 0, 0
	for range 5 {
		_, err := client.CreateSandbox(ctx(t), api.SandboxSpec{Base: baseRef, Project: p})
		var e *dsec.Error
		switch {
		case err == nil:
			made++
		case errors.As(err, &e) && e.Code == "quota_exceeded":
			refused++
		default:
			t.Fatal(err)
		}
	}
	if made != 3 || refused != 2 {
		t.Fatalf("%d made, %d refused; want 3 and 2", made, refused)
	}
	pr, err := client.GetProject(ctx(t), p)
	if err != nil {
		t.Fatal(err)
	}
	if pr.Quota.Sandboxes != 3 {
		t.Fatalf("project view: %+v", pr)
	}
}
