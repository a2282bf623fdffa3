package container

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/dsecproject/dsec/internal/cgroup"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/layer"
	"github.com/dsecproject/dsec/internal/sandbox"
	"github.com/dsecproject/dsec/internal/sandbox/container/nsexec"
	"github.com/dsecproject/dsec/internal/sandbox/sandboxtest"
)

func newTestBackend(t *testing.T, runtime string, helper bool) *Container {
	t.Helper()
	return newTestBackendWith(t, runtime, helper, false)
}

// newTestBackendWith is newTestBackend that, with native, starts
// sandboxes through dsec's own launcher (which needs the helper).
func newTestBackendWith(t *testing.T, runtime string, helper, native bool, edits ...func(*Config)) *Container {
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
	cfg := Config{Runtime: runtime, StateRoot: t.TempDir(), PinPath: filepath.Join(t.TempDir(), runtime), MaskDir: filepath.Join(t.TempDir(), "mask"), Native: native}
	if helper {
		if !nsexec.Available {
			t.Skip("needs a build with cgo: the exec helper is C")
		}
		cg, err := cgroup.Detect()
		if err != nil {
			t.Fatal(err)
		}
		cfg.Cgroups = cg
		// The parent of the tests' sandbox cgroups, as the edge makes
		// its own (dsec's launcher needs it; a runtime makes it too).
		if err := cg.EnsureParent("/dsec-test"); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _, _ = cg.RemoveParent("/dsec-test") })
	}
	for _, edit := range edits {
		edit(&cfg)
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
	if native && c.Launcher() != "dsec" {
		t.Fatalf("own launcher off: %s", c.nativeWhy)
	}
	return c
}

func conformance(t *testing.T, runtime string, helper bool) {
	conformanceRootfs(t, runtime, helper, false, false)
}

// conformanceRootfs runs the suite; with detached, every sandbox's rootfs
// is an overlay handed over as a detached mount (sandbox.Config.RootfsMount)
// instead of a directory on the host.
func conformanceRootfs(t *testing.T, runtime string, helper, detached, native bool, edits ...func(*Config)) {
	c := newTestBackendWith(t, runtime, helper, native, edits...)
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
			cfg := sandbox.Config{
				ID: id, Dir: dir, Rootfs: sandboxtest.BusyboxRootfs(t),
				Hostname: id, CgroupPath: filepath.Join("/dsec-test", id),
				Limits: sandbox.Limits{MemoryBytes: 256 << 20, Pids: 256, CPU: 1},
			}
			if detached {
				cfg.RootfsMount, cfg.Rootfs = detachedRootfs(t, cfg.Rootfs)
			}
			return cfg
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

// TestConformanceDetachedRootfs runs the suite with the rootfs attached
// only inside each sandbox's mount namespace (the edge's default).
func TestConformanceDetachedRootfs(t *testing.T) {
	if !nsexec.Available {
		t.Skip("needs a build with cgo: the rootfs launcher is C")
	}
	conformanceRootfs(t, "runc", true, true, false)
}

// TestConformanceNative runs the suite with sandboxes started by dsec's
// own launcher, on a rootfs mounted on the host and on a detached one, the
// latter (as the edge runs it) with network namespaces from the pool.
func TestConformanceNative(t *testing.T) {
	if !nsexec.Available {
		t.Skip("needs a build with cgo: the launcher is C")
	}
	t.Run("host-rootfs", func(t *testing.T) { conformanceRootfs(t, "runc", true, false, true) })
	t.Run("detached-rootfs", func(t *testing.T) {
		conformanceRootfs(t, "runc", true, true, true, func(c *Config) { c.NetnsPool = 4 })
	})
}

// detachedRootfs builds an overlay of lower as a detached mount and an
// empty directory to attach it at.
func detachedRootfs(t *testing.T, lower string) (*os.File, string) {
	t.Helper()
	d := t.TempDir()
	upper, work, target := filepath.Join(d, "upper"), filepath.Join(d, "work"), filepath.Join(d, "rootfs")
	for _, p := range []string{upper, work, target} {
		if err := os.Mkdir(p, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	mnt, err := layer.DetachedOverlay([]string{lower}, upper, work)
	if errors.Is(err, layer.ErrNoDetachedMount) {
		t.Skip(err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mnt.Close() })
	return mnt, target
}

func TestMaskMounts(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "file")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	missing := filepath.Join(dir, "missing")
	masked := []string{dir, file, missing, "/proc/sys"}
	mounts, rest := maskMounts("/mask", masked, "crun")
	if len(mounts) != 2 || mounts[0].Destination != dir || mounts[1].Destination != "/proc/sys" {
		t.Fatalf("crun: mounts %+v", mounts)
	}
	for _, m := range mounts {
		if m.Source != "/mask" || m.Type != "bind" || !slices.Contains(m.Options, "ro") {
			t.Errorf("mask mount %+v: want a read-only bind of /mask", m)
		}
	}
	if !slices.Equal(rest, []string{file, missing}) {
		t.Errorf("crun: left to the runtime %v", rest)
	}
	// runc refuses mounts inside /proc: those stay with the runtime.
	mounts, rest = maskMounts("/mask", masked, "runc")
	if len(mounts) != 1 || mounts[0].Destination != dir || !slices.Equal(rest, []string{file, missing, "/proc/sys"}) {
		t.Errorf("runc: mounts %+v, rest %v", mounts, rest)
	}

	// The mask dir must be empty: one with entries would show in every
	// sandbox.
	md := filepath.Join(t.TempDir(), "mask")
	if err := emptyDir(md); err != nil {
		t.Fatal(err)
	}
	if st, err := os.Stat(md); err != nil || st.Mode().Perm() != 0o555 {
		t.Fatalf("mask dir %v %v, want mode 0555", st, err)
	}
	if err := os.Chmod(md, 0o755); err != nil { // 0555 stops a non-root test user
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(md, "planted"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := emptyDir(md); err == nil {
		t.Error("a mask dir with an entry was accepted")
	}
}

// TestCreateCancelledLeavesNothing: a create whose context ends while the
// runtime runs either succeeds or leaves nothing behind: no process in the
// sandbox's cgroup, no cgroup, no runtime state. Killing the runtime
// halfway used to leave the sandbox's init running, found by nothing.
func TestCreateCancelledLeavesNothing(t *testing.T) {
	c := newTestBackend(t, "runc", true)
	rootfs := sandboxtest.BusyboxRootfs(t)
	var made, cancelled int
	for i := range 16 {
		id := fmt.Sprintf("cancel-%d-%d", os.Getpid(), i)
		cg := filepath.Join("/dsec-test", id)
		cfg := sandbox.Config{ID: id, Dir: t.TempDir(), Rootfs: rootfs, Hostname: id, CgroupPath: cg,
			Limits: sandbox.Limits{MemoryBytes: 64 << 20, Pids: 64}}
		ctx, cancel := context.WithTimeout(context.Background(), time.Duration(i*3)*time.Millisecond)
		createErr := c.Create(ctx, cfg)
		cancel()
		if createErr == nil {
			made++
			if err := c.Destroy(context.Background(), id); err != nil {
				t.Fatal(err)
			}
		} else {
			cancelled++
		}
		if pids, err := c.cfg.Cgroups.Procs(cg); err == nil || !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("%s (create: %v): cgroup still there, processes %v (%v)", id, createErr, pids, err)
		}
		if _, err := os.Stat(filepath.Join(c.cfg.StateRoot, id)); err == nil {
			t.Errorf("%s: runtime state left", id)
		}
	}
	t.Logf("%d created, %d refused or rolled back", made, cancelled)
}
