package e2e

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/hostfs"
)

// TestCleanupOnExit (issue 21, class 9): `dsec up --cleanup-on-exit`
// deletes its sandboxes when it stops, networked and running ones
// included, and leaves nothing on the host: no mount under its state
// dir, no nft table, no DNS address on lo, no cgroup, no sandbox dir.
func TestCleanupOnExit(t *testing.T) {
	needDaemon(t)
	if netw.skip != "" {
		t.Skip(netw.skip)
	}
	in := startInstance(t, "--cleanup-on-exit", "--sandbox-cidr", "10.213.0.0/16", "--warm-pool-max", "0")
	buildInstanceBase(t, in)
	var ids []string
	for range 2 {
		sb, err := in.client.CreateSandbox(ctx(t), api.SandboxSpec{Base: "base/c:v1"})
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, sb.ID)
		if _, err := in.client.Exec(ctx(t), sb.ID, api.ExecRequest{Cmd: "sleep 100000 >/dev/null 2>&1 &"}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := in.client.SetNetwork(ctx(t), ids[0], api.NetworkPolicy{Allow: []string{"192.0.2.1/32"}}); err != nil {
		t.Fatal(err)
	}
	table := instanceNetworkUp(t, in, "10.213.")
	in.stop()

	instanceLeftNothing(t, in, table, "10.213.")
	if left, _ := os.ReadDir(filepath.Join(in.state, "edge", "sandboxes")); len(left) > 0 {
		t.Errorf("sandbox dirs left: %d", len(left))
	}
	b, _ := os.ReadFile(in.logPath)
	if !strings.Contains(string(b), "deleted every sandbox") {
		t.Errorf("the log does not say the sandboxes were deleted")
	}
}

// TestEmptyNodeStopLeavesNothing (issue 21, class 9): a node stopped
// without --cleanup-on-exit once its last sandbox is gone removes its nft
// table, its DNS address on lo and its cgroups, so another instance can
// take the same pool; its layers stay mounted only while it runs.
func TestEmptyNodeStopLeavesNothing(t *testing.T) {
	needDaemon(t)
	if netw.skip != "" {
		t.Skip(netw.skip)
	}
	in := startInstance(t, "--sandbox-cidr", "10.214.0.0/16", "--warm-pool-max", "0")
	buildInstanceBase(t, in)
	sb, err := in.client.CreateSandbox(ctx(t), api.SandboxSpec{Base: "base/c:v1", Network: &api.NetworkPolicy{Allow: []string{"192.0.2.1/32"}}})
	if err != nil {
		t.Fatal(err)
	}
	table := instanceNetworkUp(t, in, "10.214.")
	if err := in.client.DeleteSandbox(ctx(t), sb.ID); err != nil {
		t.Fatal(err)
	}
	in.stop()
	instanceLeftNothing(t, in, table, "10.214.")
	// A second instance takes the same pool.
	again := startInstance(t, "--sandbox-cidr", "10.214.0.0/16", "--warm-pool-max", "0")
	again.stop()
}

// buildInstanceBase builds the base layer base/c:v1 on instance in.
func buildInstanceBase(t *testing.T, in *instance) {
	t.Helper()
	base := filepath.Join(in.dir, "base")
	if err := hostfs.Build(base, hostfs.Options{}); err != nil {
		t.Fatal(err)
	}
	if out, errOut, err := in.cli("layer", "build", "--kind", "base", "--name", "c", "--tag", "v1", base); err != nil {
		t.Fatalf("layer build: %v: %s %s", err, out, errOut)
	}
}

// instanceNetworkUp returns the nft table of instance in (named in its
// log: other daemons on the host may add and remove theirs meanwhile),
// failing unless the table and its DNS address (lo, prefix) are up.
func instanceNetworkUp(t *testing.T, in *instance, prefix string) string {
	t.Helper()
	logged, _ := os.ReadFile(in.logPath)
	m := regexp.MustCompile(`table="inet (dsec_[0-9a-f]+)"`).FindSubmatch(logged)
	if m == nil {
		t.Fatalf("the instance's log names no nft table")
	}
	table := "table inet " + string(m[1])
	if !slices.Contains(nftTableLines(t), table) || !loHas(t, prefix) {
		t.Fatalf("the instance's networking is not up: tables %v, lo %v", nftTableLines(t), loHas(t, prefix))
	}
	return table
}

// instanceLeftNothing checks that the stopped instance in left no nft
// table, no DNS address on lo (prefix), no cgroup and no mount under its
// directory.
func instanceLeftNothing(t *testing.T, in *instance, table, prefix string) {
	t.Helper()
	if slices.Contains(nftTableLines(t), table) {
		t.Errorf("%s is still there", table)
	}
	if loHas(t, prefix) {
		t.Errorf("the DNS address is still on lo")
	}
	for _, root := range cgroupHierarchies() {
		if _, err := os.Stat(filepath.Join(root, in.cgroupParent())); err == nil {
			t.Errorf("cgroup left: %s", filepath.Join(root, in.cgroupParent()))
		}
	}
	if m := hostMounts(in.dir + "/"); len(m) > 0 {
		t.Errorf("mounts left under the state dir: %v", m)
	}
}

func nftTableLines(t *testing.T) []string {
	t.Helper()
	out, err := exec.Command("nft", "list", "tables").Output()
	if err != nil {
		t.Fatal(err)
	}
	return strings.Split(strings.TrimSpace(string(out)), "\n")
}

func loHas(t *testing.T, prefix string) bool {
	t.Helper()
	out, err := exec.Command("ip", "-4", "-o", "addr", "show", "dev", "lo").Output()
	if err != nil {
		t.Fatal(err)
	}
	return strings.Contains(string(out), "inet "+prefix)
}
