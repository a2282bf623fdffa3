package e2e

import (
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/dsecproject/dsec/api"
)

// loopsBackedBy lists loop devices whose backing file is under dir.
func loopsBackedBy(dir string) []string {
	var out []string
	files, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err == nil && strings.HasPrefix(strings.TrimSpace(string(b)), dir) {
			out = append(out, f)
		}
	}
	return out
}

func TestDiskQuotaContainsDiskAndInodeFill(t *testing.T) {
	needDaemon(t)
	sb := newSandbox(t, api.SandboxSpec{DiskMB: 32})
	neighbour := newSandbox(t, api.SandboxSpec{})
	sdir := filepath.Join(d.stateDir, "edge", "sandboxes", sb.ID)

	// Disk fill: a 64 MiB write into a 32 MiB disk stops at ENOSPC.
	res := sh(t, sb.ID, "dd if=/dev/zero of=/tmp/big bs=1M count=64 2>&1; echo rc=$?")
	if !strings.Contains(res.Stdout, "No space left") || strings.Contains(res.Stdout, "rc=0") {
		t.Fatalf("CONTAINMENT FAILURE: 64 MiB write into a 32 MiB disk: %q", res.Stdout)
	}
	st, err := client.Stats(ctx(t), sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	if st.DiskLimitBytes < 28<<20 || st.DiskLimitBytes > 32<<20 || st.DiskBytes > st.DiskLimitBytes || st.DiskBytes < 24<<20 {
		t.Fatalf("stats after the fill: %+v", st)
	}
	// The image on the host is no bigger than the disk.
	if fi, err := os.Stat(filepath.Join(sdir, "disk.img")); err != nil || fi.Size() != 32<<20 {
		t.Fatalf("disk image: %v %v", fi, err)
	}
	// The neighbour and the daemon are unaffected.
	if r := sh(t, neighbour.ID, "dd if=/dev/zero of=/tmp/x bs=1M count=40 2>/dev/null && echo ok"); strings.TrimSpace(r.Stdout) != "ok" {
		t.Fatalf("neighbour cannot write: %q", r.Stdout)
	}
	// Freeing space makes the disk usable again.
	if r := sh(t, sb.ID, "rm /tmp/big && echo hi > /tmp/small && cat /tmp/small"); strings.TrimSpace(r.Stdout) != "hi" {
		t.Fatalf("after freeing: %q %q", r.Stdout, r.Stderr)
	}
	// Inode fill: creating empty files stops at the disk's inode count.
	res = sh(t, sb.ID, "mkdir /tmp/many && cd /tmp/many && i=0; while touch f$i 2>/dev/null; do i=$((i+1)); done; echo $i")
	n, _ := strconv.Atoi(strings.TrimSpace(res.Stdout))
	st, _ = client.Stats(ctx(t), sb.ID)
	if n < 1000 || uint64(n) > st.InodeLimit || st.InodeLimit != 4096 {
		t.Fatalf("CONTAINMENT FAILURE: %d files created, inode limit %d: %q %q", n, st.InodeLimit, res.Stdout, res.Stderr)
	}
	t.Logf("inode fill stopped after %d files (limit %d, used %d)", n, st.InodeLimit, st.Inodes)

	// Snapshot and fork work from a sandbox with its own disk; the fork
	// gets a disk of its own.
	if _, err := client.Snapshot(ctx(t), sb.ID, api.SnapshotRequest{Ref: "snapshot/disk-e2e:v1", Exclude: []string{"/tmp/many"}}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli("layer", "delete", "snapshot/disk-e2e:v1") })
	fk, err := client.Fork(ctx(t), sb.ID, 1, nil)
	if err != nil || len(fk.Sandboxes) != 1 {
		t.Fatalf("fork: %v %+v", err, fk)
	}
	child := fk.Sandboxes[0].ID
	t.Cleanup(func() { _ = client.DeleteSandbox(ctx(t), child) })
	// A fork starts from the current state (the inode fill included).
	if r := sh(t, child, "cat /tmp/small; ls /tmp/many | head -1"); r.Stdout != "hi\nf0\n" {
		t.Fatalf("fork content: %q", r.Stdout)
	}
	if cst, _ := client.Stats(ctx(t), child); cst.DiskLimitBytes == 0 {
		t.Fatalf("fork has no disk limit: %+v", cst)
	}

	// Delete leaves no mount, no loop device, no image.
	if err := client.DeleteSandbox(ctx(t), sb.ID); err != nil {
		t.Fatal(err)
	}
	if m := anyMounts(sb.ID); len(m) > 0 {
		t.Fatalf("mounts left: %v", m)
	}
	if l := loopsBackedBy(sdir); len(l) > 0 {
		t.Fatalf("loop devices left: %v", l)
	}
	if _, err := os.Stat(sdir); !os.IsNotExist(err) {
		t.Fatalf("sandbox dir left: %v", err)
	}
}

func TestDiskSurvivesEdgeRestart(t *testing.T) {
	needDaemon(t)
	sb := newSandbox(t, api.SandboxSpec{DiskMB: 64})
	sh(t, sb.ID, "echo kept > /root/kept")
	d.kill9()
	if err := d.start(); err != nil {
		t.Fatal(err)
	}
	if r := sh(t, sb.ID, "cat /root/kept; dd if=/dev/zero of=/tmp/f bs=1M count=100 2>&1 | grep -c 'No space'"); r.Stdout != "kept\n1\n" {
		t.Fatalf("after restart: %q", r.Stdout)
	}
	sdir := filepath.Join(d.stateDir, "edge", "sandboxes", sb.ID)
	if err := client.DeleteSandbox(ctx(t), sb.ID); err != nil {
		t.Fatal(err)
	}
	if l := loopsBackedBy(sdir); len(l) > 0 {
		t.Fatalf("loop devices left: %v", l)
	}
}

// TestDefaultDisk: with --default-disk-mb a sandbox whose spec asks for no
// disk gets one of that size (and says so in its spec), so it cannot fill
// the state filesystem; one that asks keeps its own size.
func TestDefaultDisk(t *testing.T) {
	needDaemon(t)
	withPoolFlags(t, "--default-disk-mb", "32")
	sb := newSandbox(t, api.SandboxSpec{})
	if sb.Spec.DiskMB != 32 {
		t.Fatalf("a spec without disk_mb got disk_mb %d, want the node's default 32", sb.Spec.DiskMB)
	}
	res := sh(t, sb.ID, "dd if=/dev/zero of=/root/big bs=1M count=64 2>&1; echo rc=$?")
	if !strings.Contains(res.Stdout, "No space left") || strings.Contains(res.Stdout, "rc=0") {
		t.Fatalf("CONTAINMENT FAILURE: 64 MiB written under a default disk of 32 MiB: %q", res.Stdout)
	}
	if _, err := os.Stat(filepath.Join(d.stateDir, "edge", "sandboxes", sb.ID, "disk.img")); err != nil {
		t.Fatalf("no disk image for the default disk: %v", err)
	}
	own := newSandbox(t, api.SandboxSpec{DiskMB: 64})
	if own.Spec.DiskMB != 64 {
		t.Fatalf("a spec with disk_mb 64 got %d", own.Spec.DiskMB)
	}
	// A VM's writable disk is a file of a fixed size already: no host
	// disk under it.
	nodes, err := client.ListNodes(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	if len(nodes) > 0 && slices.Contains(nodes[0].Backends, api.BackendMicroVM) {
		if vm := vmSandbox(t, api.SandboxSpec{}); vm.Spec.DiskMB != 0 {
			t.Fatalf("a microvm sandbox got the default disk_mb %d", vm.Spec.DiskMB)
		}
	}
}
