package e2e

import (
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/api"
)

// stateFreeMiB is the free space of the daemon's state filesystem.
func stateFreeMiB(t *testing.T) int64 {
	t.Helper()
	var st unix.Statfs_t
	if err := unix.Statfs(d.stateDir, &st); err != nil {
		t.Fatal(err)
	}
	return int64(st.Bavail) * st.Bsize >> 20
}

// TestDiskGuard (issue 21, class 8): a sandbox without disk_mb writes to
// the state filesystem, which admission alone cannot bound. The floor is
// put 300 MiB below what is free now and a sandbox writes 4 GiB as fast
// as it can: the node must pause it (pause_reason disk_pressure) before it
// has written it all and no more than 2 GiB past the floor (what is
// written in a look and a freeze at a few GB/s), while a neighbour that
// does not write runs on. Resumed, it gets the time to remove what it
// wrote, and runs on. For each backend whose writable layer is on the
// state filesystem (container, gvisor), and for a write to a file removed
// while open, which the writable layer does not show.
func TestDiskGuard(t *testing.T) {
	needDaemon(t)
	const (
		file    = "dd if=/dev/zero of=/fill bs=1M count=4096 >/dev/null 2>&1 </dev/null & echo started"
		removed = "exec 3>/fill; rm /fill; dd if=/dev/zero bs=1M count=4096 >&3 2>/dev/null </dev/null & echo started"
	)
	for _, c := range []struct{ name, backend, write string }{
		{"container", api.BackendContainer, file},
		{"gvisor", api.BackendGVisor, file},
		{"container-removed-file", api.BackendContainer, removed},
	} {
		t.Run(c.name, func(t *testing.T) {
			if c.backend == api.BackendGVisor {
				needBackend(t, c.backend, "apt-get install runsc")
			}
			diskGuard(t, c.backend, c.write, c.write == removed)
		})
	}
}

func diskGuard(t *testing.T, backend, write string, removed bool) {
	neighbour := newSandbox(t, api.SandboxSpec{Backend: backend})
	writer := newSandbox(t, api.SandboxSpec{Backend: backend})
	sh(t, neighbour.ID, "echo intact > /root/marker")
	floor := stateFreeMiB(t) - 300
	withPoolFlags(t, "--min-free-disk-mb", strconv.FormatInt(floor, 10))
	r := sh(t, writer.ID, write)
	if r.Stdout != "started\n" {
		t.Fatalf("starting the writer: %+v", r)
	}
	var got *api.Sandbox
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		var err error
		if got, err = client.GetSandbox(ctx(t), writer.ID); err != nil {
			t.Fatal(err)
		}
		if got.State == api.StatePaused {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the writer was not paused within 60 s: %+v (free %d MiB, floor %d MiB)", got, stateFreeMiB(t), floor)
		}
	}
	if got.PauseReason != api.PauseReasonDiskPressure {
		t.Errorf("pause_reason %q, want %q", got.PauseReason, api.PauseReasonDiskPressure)
	}
	fill := filepath.Join(d.stateDir, "edge", "sandboxes", writer.ID, "upper", "fill")
	free := stateFreeMiB(t)
	if !removed {
		st, err := os.Stat(fill)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("paused with %d MiB written; %d MiB free against a floor of %d MiB", st.Size()>>20, free, floor)
		if st.Size() >= 4096<<20 {
			t.Errorf("the writer wrote all %d MiB before it was paused", st.Size()>>20)
		}
	} else {
		t.Logf("paused; %d MiB free against a floor of %d MiB", free, floor)
	}
	if free < floor-2048 {
		t.Errorf("%d MiB free: more than 2 GiB past the floor of %d MiB", free, floor)
	}
	if n, err := client.GetSandbox(ctx(t), neighbour.ID); err != nil || n.State != api.StateRunning {
		t.Fatalf("the neighbour, which writes nothing: %+v %v", n, err)
	}
	if r := sh(t, neighbour.ID, "cat /root/marker"); r.Stdout != "intact\n" {
		t.Errorf("the neighbour: %+v", r)
	}
	// The writer's owner resumes it and removes what it wrote; it is
	// given the time (whatever else this shared machine's disk holds
	// meanwhile), and runs on.
	if _, err := client.Resume(ctx(t), writer.ID); err != nil {
		t.Fatal(err)
	}
	if r := sh(t, writer.ID, "pkill dd; rm -f /fill; sync; echo cleaned"); r.Stdout != "cleaned\n" {
		t.Fatalf("cleaning up: %+v", r)
	}
	time.Sleep(time.Second)
	got, err := client.GetSandbox(ctx(t), writer.ID)
	if err != nil || got.State != api.StateRunning || got.PauseReason != "" {
		t.Fatalf("the writer after cleaning up: %+v %v", got, err)
	}
	if _, err := os.Stat(fill); !os.IsNotExist(err) {
		t.Errorf("the writer's file after the clean-up: %v", err)
	}
}
