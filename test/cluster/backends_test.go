package cluster

import (
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/dsecproject/dsec/api"
)

// TestBackendPlacement: each node advertises the backends it runs, and
// placement sends a sandbox only to a node that offers its backend (e1
// offers gvisor where runsc is installed; e2 and e3 run with --gvisor off).
func TestBackendPlacement(t *testing.T) {
	need(t)
	nodes, err := c.client.ListNodes(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	offers := map[string][]string{}
	for _, n := range nodes {
		offers[n.Name] = n.Backends
	}
	if !slices.Contains(offers["e1"], api.BackendGVisor) {
		t.Skipf("e1 offers %v, no gvisor (apt-get install runsc)", offers["e1"])
	}
	for _, n := range []string{"e2", "e3"} {
		if !slices.Equal(offers[n], []string{api.BackendContainer}) {
			t.Fatalf("%s offers %v, want [container] (--gvisor off)", n, offers[n])
		}
	}
	for range 3 {
		sb := newSandbox(t, api.SandboxSpec{Backend: api.BackendGVisor})
		if sb.Node != "e1" || sb.Backend != api.BackendGVisor {
			t.Fatalf("a gvisor sandbox went to %s as %s; only e1 offers gvisor", sb.Node, sb.Backend)
		}
		if out := mustExec(t, c.client, sb.ID, "uname -r"); strings.HasPrefix(out, "6.") {
			t.Fatalf("a gvisor sandbox runs on the host's kernel: %q", out)
		}
	}
	// No node both offers gvisor and carries zone=z2.
	_, err = c.client.CreateSandbox(ctx(t), api.SandboxSpec{Base: baseRef, Backend: api.BackendGVisor, NodeSelector: map[string]string{"zone": "z2"}})
	wantCode(t, err, "resource_exhausted")
	// A backend no node offers.
	_, err = c.client.CreateSandbox(ctx(t), api.SandboxSpec{Base: baseRef, Backend: api.BackendMicroVM})
	if err == nil {
		t.Fatal("a microvm sandbox was created")
	}
}

// TestNodeCapacity: each edge says what its sandboxes have together: the
// host's cores (the edges run on this host) and its memory less the
// reserve dsec keeps for the host.
func TestNodeCapacity(t *testing.T) {
	need(t)
	nodes, err := c.client.ListNodes(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	// MemTotal less the default reserve, the larger of 2 GiB and a 16th.
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		t.Fatal(err)
	}
	var kb int64
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "MemTotal:"); ok {
			kb, _ = strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
		}
	}
	total := kb << 10
	want := total
	if res := max(2<<30, total/16); total > res {
		want = total - res
	}
	for _, n := range nodes {
		if !strings.HasPrefix(n.Name, "e") || len(n.Name) != 2 {
			continue // a node another test added
		}
		if n.Capacity.CPU != float64(runtime.NumCPU()) || n.Capacity.MemoryMB != want>>20 {
			t.Errorf("%s: capacity %+v; want %d cores and %d MiB (the host's %d MiB less the reserve)", n.Name, n.Capacity, runtime.NumCPU(), want>>20, total>>20)
		}
	}
}
