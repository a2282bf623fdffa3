package e2e

import (
	"archive/tar"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

// `dsec layer gc` removes the blobs no ref names: the one a replace left
// behind stays while a sandbox uses it and goes after, the ref's current
// blob stays, and only a key of the root project collects.
func TestLayerGC(t *testing.T) {
	needDaemon(t)
	n := time.Now().UnixNano() % 1e9
	name := fmt.Sprintf("gc-%d", n)
	tk := func(content string) []byte {
		return tarOf(t, []*tar.Header{{Name: "gc.txt", Typeflag: tar.TypeReg, Mode: 0o644}}, map[string][]byte{"gc.txt": []byte(content)})
	}
	blob := func(digest string) string {
		return filepath.Join(d.stateDir, "layers", "blobs", "sha256", strings.TrimPrefix(digest, "sha256:")+".erofs")
	}
	gc := func() api.LayerGCResult {
		t.Helper()
		out, errOut, code := cli("layer", "gc", "--json")
		if code != 0 {
			t.Fatalf("layer gc: exit %d: %s", code, errOut)
		}
		var res api.LayerGCResult
		if err := json.Unmarshal([]byte(out), &res); err != nil {
			t.Fatalf("layer gc output %q: %v", out, err)
		}
		return res
	}
	l1, err := client.BuildLayer(ctx(t), "toolkit", name, "1", bytes.NewReader(tk("first")))
	if err != nil {
		t.Fatal(err)
	}
	ref := l1.Ref
	t.Cleanup(func() { _ = client.DeleteLayer(context.Background(), ref) })
	sb := newSandbox(t, api.SandboxSpec{Base: baseRef, Toolkits: []string{ref}})
	r := wireCall(t, "POST", "/v1/layers?kind=toolkit&name="+name+"&tag=1&replace=true", tk("second"))
	if r.Status != 201 {
		t.Fatalf("replace: %d %s", r.Status, r.Body)
	}
	l2, err := client.GetLayer(ctx(t), ref)
	if err != nil || l2.Digest == l1.Digest {
		t.Fatalf("after replace: %+v, %v", l2, err)
	}

	// In use by the sandbox: kept.
	res := gc()
	if slices.Contains(res.Removed, l1.Digest) || slices.Contains(res.Removed, l2.Digest) {
		t.Fatalf("gc removed %v while a sandbox uses %s and a ref names %s", res.Removed, l1.Digest, l2.Digest)
	}
	if out := sh(t, sb.ID, "cat /gc.txt"); strings.TrimSpace(out.Stdout) != "first" {
		t.Fatalf("the sandbox reads %q", out.Stdout)
	}
	if _, err := os.Stat(blob(l1.Digest)); err != nil {
		t.Fatalf("the replaced blob: %v", err)
	}

	// A key of another project may not collect.
	p := fmt.Sprintf("gc-%d", n)
	if _, err := client.CreateProject(ctx(t), api.CreateProjectRequest{Parent: "root", Name: p}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = client.DeleteProject(context.Background(), p, true) })
	k, err := client.CreateKey(ctx(t), p, api.CreateKeyRequest{Role: "admin"})
	if err != nil {
		t.Fatal(err)
	}
	other, err := dsec.New(dsec.WithEndpoint("http://"+d.listen), dsec.WithAPIKey(k.Key))
	if err != nil {
		t.Fatal(err)
	}
	_, err = other.GCLayers(ctx(t))
	wantCode(t, err, "permission_denied")

	// The sandbox gone, a dry run lists the replaced blob and removes
	// nothing; then it goes, and the current one stays.
	if err := client.DeleteSandbox(ctx(t), sb.ID); err != nil {
		t.Fatal(err)
	}
	out, errOut, code := cli("layer", "gc", "--dry-run")
	if code != 0 || !strings.Contains(out, "would remove "+l1.Digest) || strings.Contains(out, l2.Digest) {
		t.Fatalf("layer gc --dry-run: exit %d: %s %s", code, out, errOut)
	}
	if _, err := os.Stat(blob(l1.Digest)); err != nil {
		t.Fatalf("a dry run removed the blob: %v", err)
	}
	if dry, err := client.UnusedLayers(ctx(t)); err != nil || !dry.DryRun || !slices.Contains(dry.Removed, l1.Digest) || dry.RemovedBytes < l1.SizeBytes {
		t.Fatalf("dry run through the SDK: %+v, %v", dry, err)
	}
	res = gc()
	if !slices.Contains(res.Removed, l1.Digest) || res.RemovedBytes < l1.SizeBytes {
		t.Fatalf("gc after the sandbox went: %+v, want %s among the removed (%d bytes at least)", res, l1.Digest, l1.SizeBytes)
	}
	if _, err := os.Stat(blob(l1.Digest)); !os.IsNotExist(err) {
		t.Fatalf("the collected blob: %v", err)
	}
	if _, err := os.Stat(blob(l2.Digest)); err != nil {
		t.Fatalf("the named blob: %v", err)
	}
	if res := gc(); slices.Contains(res.Removed, l2.Digest) {
		t.Fatalf("a second gc removed the named blob: %+v", res)
	}
}
