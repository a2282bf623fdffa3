package container

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/dsecproject/dsec/internal/cgroup"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/sandbox"
	"github.com/dsecproject/dsec/internal/sandbox/container/nsexec"
	"github.com/dsecproject/dsec/internal/sandbox/sandboxtest"
)

func newTestBackend(t *testing.T, runtime string, helper bool) *Container {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: runs OCI containers")
	}
	if _, err := exec.LookPath(runtime); err != nil {
		t.Skipf("needs %s (apt-get install %s)", runtime, runtime)
	}
	if _, err := exec.LookPath("catatonit"); err != nil {
		t.Skip("needs catatonit (apt-get install catatonit)")
	}
	cfg := Config{Runtime: runtime, StateRoot: t.TempDir(), PinPath: filepath.Join(t.TempDir(), runtime)}
	if helper {
		if !nsexec.Available {
			t.Skip("needs a build with cgo: the exec helper is C")
		}
		cg, err := cgroup.Detect()
		if err != nil {
			t.Fatal(err)
		}
		cfg.Cgroups = cg
	}
	c, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	if pinned, err := c.Pinned(); !pinned {
		t.Fatalf("runtime binary not pinned: %v", err)
	}
	if want := map[bool]string{true: "helper", false: c.flavor}[helper]; c.ExecPath() != want {
		t.Fatalf("exec path %s, want %s", c.ExecPath(), want)
	}
	return c
}

func conformance(t *testing.T, runtime string, helper bool) {
	c := newTestBackend(t, runtime, helper)
	var procs func(string) ([]int, error)
	if c.cfg.Cgroups != nil {
		// Destroy runs without the runtime here: nothing may be left in
		// the sandbox's cgroup, and the cgroup itself must be gone.
		procs = func(rel string) ([]int, error) {
			pids, err := c.cfg.Cgroups.Procs(rel)
			if err == nil {
				return pids, nil
			}
			if !errors.Is(err, errdefs.ErrNotFound) {
				return nil, err
			}
			return nil, nil
		}
	}
	sandboxtest.Run(t, sandboxtest.Env{
		CgroupProcs: procs,
		Backend:     c,
		NewConfig: func(t *testing.T, id string) sandbox.Config {
			dir := t.TempDir()
			return sandbox.Config{
				ID: id, Dir: dir, Rootfs: sandboxtest.BusyboxRootfs(t),
				Hostname: id, CgroupPath: filepath.Join("/dsec-test", id),
				Limits: sandbox.Limits{MemoryBytes: 256 << 20, Pids: 256, CPU: 1},
			}
		},
	})
}

func TestConformanceRunc(t *testing.T) { conformance(t, "runc", false) }

// TestConformanceRuncHelper runs the suite with commands entering through
// the exec helper instead of `runc exec`.
func TestConformanceRuncHelper(t *testing.T) { conformance(t, "runc", true) }

func TestConformanceCrun(t *testing.T) {
	// crun refuses hybrid cgroups while the v2 tree holds a controller; the
	// edge prepares the host (cgroup.PrepareForCrun). Here we only probe.
	if os.Geteuid() == 0 {
		if b, err := os.ReadFile("/sys/fs/cgroup/unified/cgroup.controllers"); err == nil && len(b) > 1 {
			t.Skip("crun cannot run on this hybrid host until cgroup.PrepareForCrun has run (v2 tree has controllers)")
		}
	}
	conformance(t, "crun", false)
}
