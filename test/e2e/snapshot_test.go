package e2e

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

func snapRef(name string) string {
	return fmt.Sprintf("snapshot/e2e-%s:%d", name, time.Now().UnixNano())
}

func TestSnapshotContentWhiteoutsAndScrub(t *testing.T) {
	needDaemon(t)
	src := newSandbox(t, api.SandboxSpec{Workspace: workspaceRef, Toolkits: []string{toolkitRef}, Labels: map[string]string{"role": "builder"}})
	sh(t, src.ID, `set -e
echo new > /repo/new.txt
echo changed > /repo/a.txt
rm /repo/ws-only /repo/base-only
mkdir -p /root/.cache && echo answer > /root/.cache/leak
mkdir -p /data && echo d > /data/d
(sleep 1000 &)`)
	ref := snapRef("content")
	l, err := client.Snapshot(ctx(t), src.ID, api.SnapshotRequest{Ref: ref, Exclude: []string{"/root/.cache"}})
	if err != nil {
		t.Fatal(err)
	}
	if l.Kind != api.KindSnapshot || l.Snapshot == nil || l.Snapshot.Sandbox != src.ID ||
		!slices.Equal(l.Snapshot.Exclude, []string{"/root/.cache"}) || len(l.Snapshot.Layers) != 3 {
		t.Fatalf("snapshot record: %+v", l)
	}
	// The source keeps running, processes included.
	if r := sh(t, src.ID, "ps -o comm | grep -c '^sleep'"); strings.TrimSpace(r.Stdout) != "1" {
		t.Fatalf("source after snapshot: %+v", r)
	}
	// A sandbox from the snapshot sees the changes, the deletions and not
	// the scrubbed path.
	sb := newSandbox(t, api.SandboxSpec{Snapshot: ref})
	if len(sb.Layers) != 4 || sb.Layers[3] != l.Digest || sb.Spec.Base != baseRef {
		t.Fatalf("layers of a sandbox from a snapshot: %v (spec %+v)", sb.Layers, sb.Spec)
	}
	r := sh(t, sb.ID, "cat /repo/new.txt /repo/a.txt /data/d; ls /repo; test -e /root/.cache/leak && echo LEAKED; /opt/tool/run.sh")
	want := "new\nchanged\nd\na.txt\nnew.txt\ntool ran\n"
	if r.Stdout != want {
		t.Fatalf("from snapshot: got %q want %q (stderr %q)", r.Stdout, want, r.Stderr)
	}
	// Layers are immutable: delete of the snapshot in use is refused.
	_, e, code := cli("layer", "delete", ref)
	if code == 0 || !strings.Contains(e, "used by") {
		t.Fatalf("delete of an in-use snapshot: %d %q", code, e)
	}
	// Include keeps only the named paths.
	ref2 := snapRef("include")
	if _, err := client.Snapshot(ctx(t), src.ID, api.SnapshotRequest{Ref: ref2, Include: []string{"/repo/new.txt"}}); err != nil {
		t.Fatal(err)
	}
	sb2 := newSandbox(t, api.SandboxSpec{Snapshot: ref2})
	r = sh(t, sb2.ID, "cat /repo/new.txt /repo/a.txt; test -e /data && echo HAS-DATA; test -e /repo/ws-only && echo HAS-WS-ONLY")
	if r.Stdout != "new\ntoolkit\nHAS-WS-ONLY\n" {
		t.Fatalf("include: %q", r.Stdout)
	}
	// Snapshot refs must be of kind snapshot; base must match if given.
	_, err = client.Snapshot(ctx(t), src.ID, api.SnapshotRequest{Ref: "base/x:1"})
	wantCode(t, err, "invalid_argument")
	_, err = client.CreateSandbox(ctx(t), api.SandboxSpec{Snapshot: ref, Base: "base/other:1"})
	wantCode(t, err, "invalid_argument")
}

// TestKeyedCreateWithEveryLabel: a create may carry as many labels as
// the policy allows (64) whether or not the SDK keys it: dsec's own
// dsec.idempotency, added after the caller's labels were checked, does
// not count against them when the edge checks the spec again.
func TestKeyedCreateWithEveryLabel(t *testing.T) {
	needDaemon(t)
	labels := map[string]string{}
	for i := range 64 {
		labels[fmt.Sprintf("l%02d", i)] = "v"
	}
	sb := newSandbox(t, api.SandboxSpec{Labels: labels})
	if len(sb.Labels) != 65 || sb.Labels["dsec.idempotency"] == "" {
		t.Fatalf("labels %v: want the 64 given and dsec.idempotency", sb.Labels)
	}
}

func TestForkIsolationAndChains(t *testing.T) {
	needDaemon(t)
	src := newSandbox(t, api.SandboxSpec{Labels: map[string]string{"tree": "root"}})
	sh(t, src.ID, "echo step1 > /root/state")
	res, err := client.Fork(ctx(t), src.ID, 3, map[string]string{"branch": "yes"})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Sandboxes) != 3 || len(res.Errors) != 0 {
		t.Fatalf("fork: %+v", res)
	}
	for _, f := range res.Sandboxes {
		t.Cleanup(func() { _ = client.DeleteSandbox(ctx(t), f.ID) })
		if f.Labels["tree"] != "root" || f.Labels["branch"] != "yes" {
			t.Fatalf("fork labels %v", f.Labels)
		}
	}
	// The source's dsec.idempotency (the SDK sent a key) names the create
	// that made it, not its forks: a fork without a key of its own
	// carries none (a retry of that create would take it for its own).
	if src.Labels["dsec.idempotency"] == "" {
		t.Fatalf("the source has no dsec.idempotency label: %v", src.Labels)
	}
	for _, f := range res.Sandboxes { // the fork call was keyed: its own label
		if l := f.Labels["dsec.idempotency"]; l == "" || l == src.Labels["dsec.idempotency"] {
			t.Fatalf("keyed fork's dsec.idempotency %q, the source's %q: want the fork call's own", l, src.Labels["dsec.idempotency"])
		}
	}
	bare, err := dsec.New(dsec.WithEndpoint("http://"+d.listen), dsec.WithAPIKey(d.key), dsec.WithoutIdempotencyKeys())
	if err != nil {
		t.Fatal(err)
	}
	unkeyed, err := bare.Fork(ctx(t), src.ID, 1, nil)
	if err != nil || len(unkeyed.Sandboxes) != 1 {
		t.Fatalf("unkeyed fork: %+v, %v", unkeyed, err)
	}
	t.Cleanup(func() { _ = client.DeleteSandbox(ctx(t), unkeyed.Sandboxes[0].ID) })
	if l := unkeyed.Sandboxes[0].Labels; l["tree"] != "root" || l["dsec.idempotency"] != "" {
		t.Fatalf("unkeyed fork labels %v: want the source's own, without dsec.idempotency", l)
	}
	// Nor may a caller set dsec's labels.
	_, err = client.Fork(ctx(t), src.ID, 1, map[string]string{"dsec.idempotency": src.Labels["dsec.idempotency"]})
	wantCode(t, err, "invalid_argument")
	for i, f := range res.Sandboxes {
		sh(t, f.ID, fmt.Sprintf("echo fork%d >> /root/state", i))
	}
	sh(t, src.ID, "echo source >> /root/state")
	for i, f := range res.Sandboxes {
		if r := sh(t, f.ID, "cat /root/state"); r.Stdout != fmt.Sprintf("step1\nfork%d\n", i) {
			t.Fatalf("fork %d sees %q: forks are not isolated", i, r.Stdout)
		}
	}
	if r := sh(t, src.ID, "cat /root/state"); r.Stdout != "step1\nsource\n" {
		t.Fatalf("source sees %q", r.Stdout)
	}
	// Chain: a snapshot of a sandbox started from a snapshot stacks on it.
	child := res.Sandboxes[0]
	sh(t, child.ID, "echo deeper > /root/deeper; rm /root/state")
	ref := snapRef("chain")
	l, err := client.Snapshot(ctx(t), child.ID, api.SnapshotRequest{Ref: ref})
	if err != nil {
		t.Fatal(err)
	}
	if len(l.Snapshot.Layers) != 2 {
		t.Fatalf("chained snapshot sits on %v, want base + first snapshot", l.Snapshot.Layers)
	}
	g := newSandbox(t, api.SandboxSpec{Snapshot: ref})
	if r := sh(t, g.ID, "cat /root/deeper; test -e /root/state && echo STATE-BACK"); r.Stdout != "deeper\n" {
		t.Fatalf("grandchild: %q", r.Stdout)
	}
	// A paused sandbox can be snapshotted and stays paused.
	if _, err := client.Pause(ctx(t), src.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := client.Snapshot(ctx(t), src.ID, api.SnapshotRequest{Ref: snapRef("paused")}); err != nil {
		t.Fatal(err)
	}
	if got := waitState(t, src.ID, api.StatePaused, 0); got.State != api.StatePaused {
		t.Fatalf("snapshot resumed a paused sandbox: %s", got.State)
	}
}
