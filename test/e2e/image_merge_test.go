package e2e

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/dsecproject/dsec/api"
)

// --merge-under cuts an image into runs of layers, each one EROFS layer:
// the base is the top run's, over the others (its lowers). Two task images
// sharing their bottom layers share the run those make; sandboxes see the
// whole image (whiteouts and opaque directories across runs included),
// snapshots and forks of them stack the lowers too, and the shared run's
// blob stays until the last base naming it goes.
func TestImageMergeUnder(t *testing.T) {
	needDaemon(t)
	dir := t.TempDir()
	i1 := newTestImage(t, true, imageLayers(t, "task-m1")...)
	i2 := newTestImage(t, true, imageLayers(t, "task-m2")...)
	if i1.Sizes[0] != i2.Sizes[0] || i1.Sizes[1] != i2.Sizes[1] {
		t.Fatalf("the two images do not share their bottom layers: %v %v", i1.Sizes, i2.Sizes)
	}
	// The base and app layers fit under the threshold, the task layer
	// does not: two runs.
	under := strconv.FormatInt(i1.Sizes[0]+i1.Sizes[1], 10)
	a1 := i1.OCILayout(t, filepath.Join(dir, "m1.tar"))
	a2 := i2.OCILayout(t, filepath.Join(dir, "m2.tar"))
	l1 := importCLI(t, a1, "--ref", "base/img-m1:v1", "--merge-under", under)
	l2 := importCLI(t, a2, "--ref", "base/img-m2:v1", "--merge-under", under)
	b1, b2 := l1["base/img-m1:v1"], l2["base/img-m2:v1"]
	if len(b1.Lowers) == 0 {
		t.Fatalf("base/img-m1:v1 has no lowers: %+v", b1)
	}
	shared := filepath.Join(d.stateDir, "layers", "blobs", "sha256", strings.TrimPrefix(b1.Lowers[0], "sha256:")+".erofs")
	// Cleanups run last first: this one after every sandbox is gone. The
	// shared run's blob goes with the last entry naming it.
	refs := []string{"base/img-m2:v1", "base/img-m1:v1", "base/img-m3:v1", "snapshot/img-m1:v2", "snapshot/img-m1:v1"}
	t.Cleanup(func() {
		for i, r := range refs {
			if err := client.DeleteLayer(ctx(t), r); err != nil {
				t.Errorf("deleting %s: %v", r, err)
			}
			_, err := os.Stat(shared)
			if last := i == len(refs)-1; last != os.IsNotExist(err) {
				t.Errorf("after deleting %s the shared run's blob: %v (want it gone only with the last entry naming it)", r, err)
			}
		}
	})
	if len(b1.Lowers) != 1 || len(b2.Lowers) != 1 || b1.Lowers[0] != b2.Lowers[0] || b1.LowersBytes <= 0 {
		t.Fatalf("lowers %v and %v: want one, shared", b1.Lowers, b2.Lowers)
	}
	if b1.Digest == b2.Digest {
		t.Fatalf("the two task runs have one digest")
	}
	if got, err := client.GetLayer(ctx(t), "base/img-m1:v1"); err != nil || len(got.Lowers) != 1 || got.Lowers[0] != b1.Lowers[0] {
		t.Fatalf("catalog entry %+v, %v", got, err)
	}
	if _, err := os.Stat(shared); err != nil {
		t.Fatalf("shared run's blob: %v", err)
	}
	checkImageSandbox(t, "base/img-m1:v1", "", "task-m1")
	checkImageSandbox(t, "base/img-m2:v1", "", "task-m2")

	// Every layer a run of its own: two lowers, the plain tree folded
	// between them.
	l3 := importCLI(t, a1, "--ref", "base/img-m3:v1", "--merge-under", "1")
	if b3 := l3["base/img-m3:v1"]; len(b3.Lowers) != 2 {
		t.Fatalf("one run per layer: lowers %v", b3.Lowers)
	}
	checkImageSandbox(t, "base/img-m3:v1", "", "task-m1")

	// A snapshot stacks the lowers below it; a sandbox from it and a fork
	// of it see the image and the change.
	sb := newSandbox(t, api.SandboxSpec{Base: "base/img-m1:v1", User: "root"})
	if res := sh(t, sb.ID, "echo changed > /app/hello.txt; rm /data/new"); res.ExitCode != 0 {
		t.Fatalf("change: %+v", res)
	}
	snap, err := client.Snapshot(ctx(t), sb.ID, api.SnapshotRequest{Ref: "snapshot/img-m1:v1"})
	if err != nil {
		t.Fatal(err)
	}
	if snap.Snapshot == nil || len(snap.Snapshot.Layers) != 2 || snap.Snapshot.Below != 2 {
		t.Fatalf("snapshot record %+v", snap.Snapshot)
	}
	const check = "cat /app/hello.txt /task/id; ls /data | tr '\\n' ' '"
	const want = "changed\ntask-m1\n"
	from := newSandbox(t, api.SandboxSpec{Base: "base/img-m1:v1", Snapshot: "snapshot/img-m1:v1", User: "root"})
	if res := sh(t, from.ID, check); res.Stdout != want {
		t.Errorf("sandbox from the snapshot: %q (stderr %q), want %q", res.Stdout, res.Stderr, want)
	}
	forks, err := client.Fork(ctx(t), sb.ID, 1, nil)
	if err != nil || len(forks.Sandboxes) != 1 {
		t.Fatalf("fork: %+v, %v", forks, err)
	}
	t.Cleanup(func() { client.DeleteSandbox(ctx(t), forks.Sandboxes[0].ID) })
	refs = append(refs, forks.Sandboxes[0].Spec.Snapshot) // the fork's own snapshot, also on the shared run
	if res := sh(t, forks.Sandboxes[0].ID, check); res.Stdout != want {
		t.Errorf("fork: %q (stderr %q), want %q", res.Stdout, res.Stderr, want)
	}
	// A snapshot of the sandbox from the snapshot counts its layers right:
	// base runs below, the first snapshot in its chain.
	snap2, err := client.Snapshot(ctx(t), from.ID, api.SnapshotRequest{Ref: "snapshot/img-m1:v2"})
	if err != nil {
		t.Fatal(err)
	}
	if snap2.Snapshot == nil || snap2.Snapshot.Below != 2 || len(snap2.Snapshot.Layers) < 2 {
		t.Fatalf("snapshot of a sandbox from a snapshot: %+v", snap2.Snapshot)
	}

	// An artifact holds one image: a base with lowers is not pushed.
	_, err = client.PushLayer(ctx(t), api.LayerPushRequest{Ref: "base/img-m2:v1", Target: "oci://127.0.0.1:1/e2e/m2:v1", Insecure: true})
	wantCode(t, err, "failed_precondition")

}
