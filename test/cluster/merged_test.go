package cluster

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/image/imagetest"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

// TestMergedImageOnEveryNode: an image imported through one apiserver
// with --merge-under, one run per layer, is a base over two lowers in the
// shared layer directory; a sandbox on every edge sees the whole image
// (the top run's whiteout hides a file of the bottom one), and a snapshot
// taken on one edge runs on another with the lowers under it.
func TestMergedImageOnEveryNode(t *testing.T) {
	need(t)
	n := time.Now().UnixNano() % 1e9
	ref := fmt.Sprintf("base/cl-merged-%d:v1", n)
	base := imagetest.TreeLayer(t, filepath.Join(c.dir, "base"),
		imagetest.Entry{Name: "data/", Dir: true}, imagetest.Entry{Name: "data/gone", Body: "bottom\n"})
	app := imagetest.Layer(t, imagetest.Entry{Name: "app/", Dir: true}, imagetest.Entry{Name: "app/hello.txt", Body: "merged app\n"})
	task := imagetest.Layer(t, imagetest.Entry{Name: "data/", Dir: true}, imagetest.Entry{Name: "data/.wh.gone"},
		imagetest.Entry{Name: "data/new", Body: "top\n"})
	img := imagetest.New(t, true, imagetest.Config{Env: []string{"PATH=/usr/bin:/bin:/sbin"}}, base, app, task)
	f, err := os.Open(img.OCILayout(t, filepath.Join(t.TempDir(), "img.tar")))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	res, err := c.perServer[0].ImportImage(ctx(t), f, dsec.ImportOptions{Ref: ref, MergeUnder: 1}, nil)
	if err != nil {
		t.Fatalf("import: %v", err)
	}
	var top *api.Layer
	for i := range res.Layers {
		if res.Layers[i].Ref == ref {
			top = &res.Layers[i]
		}
	}
	if top == nil || len(top.Lowers) != 2 {
		t.Fatalf("import made %+v, want %s over two lowers", res.Layers, ref)
	}
	snapRef := fmt.Sprintf("snapshot/cl-merged-%d:v1", n)
	t.Cleanup(func() {
		for _, r := range []string{snapRef, ref} {
			var ae *dsec.Error
			if err := c.perServer[1].DeleteLayer(context.Background(), r); err != nil && !(errors.As(err, &ae) && ae.Code == "not_found" && t.Failed()) {
				t.Errorf("deleting %s: %v", r, err)
			}
		}
		for _, d := range append([]string{top.Digest}, top.Lowers...) {
			if _, err := os.Stat(filepath.Join(c.layersDir(), "blobs", "sha256", d[len("sha256:"):]+".erofs")); !os.IsNotExist(err) {
				t.Errorf("blob %s after its base went: %v", d, err)
			}
		}
	})
	if l, err := c.perServer[1].GetLayer(ctx(t), ref); err != nil || len(l.Lowers) != 2 {
		t.Fatalf("the other apiserver's catalog: %+v, %v", l, err)
	}
	const want = "merged app\nnew\n"
	var first *api.Sandbox
	for i := 1; i <= 3; i++ {
		sb := newSandbox(t, api.SandboxSpec{Base: ref, NodeSelector: map[string]string{"zone": fmt.Sprintf("z%d", i)}})
		if sb.Node != fmt.Sprintf("e%d", i) {
			t.Fatalf("zone z%d placed on %s", i, sb.Node)
		}
		if out := mustExec(t, c.client, sb.ID, "cat /app/hello.txt; ls /data"); out != want {
			t.Fatalf("on %s: %q, want %q", sb.Node, out, want)
		}
		if first == nil {
			first = sb
		}
	}
	mustExec(t, c.client, first.ID, "echo changed > /app/hello.txt")
	if _, err := c.perServer[1].Snapshot(ctx(t), first.ID, api.SnapshotRequest{Ref: snapRef}); err != nil {
		t.Fatalf("snapshot: %v", err)
	}
	sb := newSandbox(t, api.SandboxSpec{Snapshot: snapRef, NodeSelector: map[string]string{"zone": "z3"}})
	if sb.Node != "e3" || first.Node != "e1" {
		t.Fatalf("the snapshot taken on %s runs on %s, want e1 and e3", first.Node, sb.Node)
	}
	if out := mustExec(t, c.client, sb.ID, "cat /app/hello.txt; ls /data"); out != "changed\nnew\n" {
		t.Fatalf("from the snapshot on %s: %q", sb.Node, out)
	}
}
