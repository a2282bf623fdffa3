package microvm

import (
	"bytes"
	"context"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dsecproject/dsec/internal/sandbox"
	"github.com/dsecproject/dsec/internal/sandbox/sandboxtest"
)

// testBackend makes a microvm backend over the cached guest kernel, or
// skips.
func testBackend(t *testing.T) *Backend {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: boots VMs with network namespaces and disks")
	}
	for _, bin := range []string{"qemu-system-x86_64", "dpkg-deb", "apt-get", "mkfs.erofs", "mkfs.ext4", "nsenter"} {
		if _, err := exec.LookPath(bin); err != nil {
			t.Skipf("needs %s (apt-get install qemu-system-x86 erofs-utils e2fsprogs util-linux)", bin)
		}
	}
	agentBin := filepath.Join(t.TempDir(), "dsec-agent")
	build := exec.Command("go", "build", "-o", agentBin, "github.com/dsecproject/dsec/cmd/dsec-agent")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("building the agent: %v\n%s", err, out)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	b, err := New(ctx, Config{StateRoot: t.TempDir(), KernelCache: guestCache, Agent: agentBin, DiskGB: 1})
	if err != nil {
		t.Fatal(err)
	}
	// A test that fails half-way leaves no VMM running.
	t.Cleanup(func() {
		ids, _ := b.List(context.Background())
		for _, id := range ids {
			_ = b.Destroy(context.Background(), id)
		}
	})
	return b
}

// busyboxImage is an EROFS image of sandboxtest's busybox rootfs.
var busyboxImage struct {
	once sync.Once
	path string
	err  error
}

func testImage(t *testing.T) string {
	t.Helper()
	root := sandboxtest.BusyboxRootfs(t)
	busyboxImage.once.Do(func() {
		dir, err := os.MkdirTemp("", "dsec-microvm-image-")
		if err != nil {
			busyboxImage.err = err
			return
		}
		busyboxImage.path = filepath.Join(dir, "busybox.erofs")
		out, err := exec.Command("mkfs.erofs", "--quiet", busyboxImage.path, root).CombinedOutput()
		if err != nil {
			busyboxImage.err = err
			t.Logf("mkfs.erofs: %s", out)
		}
	})
	if busyboxImage.err != nil {
		t.Fatal(busyboxImage.err)
	}
	return busyboxImage.path
}

func newConfig(t *testing.T, id string) sandbox.Config {
	return sandbox.Config{ID: id, Images: []string{testImage(t)}, Upper: t.TempDir(), Hostname: "sandbox"}
}

// TestConformance runs the backend conformance suite against microVMs
// (QEMU/TCG here: two guests boot, a few seconds each).
func TestConformance(t *testing.T) {
	b := testBackend(t)
	sandboxtest.Run(t, sandboxtest.Env{Backend: b, NewConfig: newConfig})
}

// TestLayersUpperAndAdoption: a sandbox's root is its layers under an
// overlay whose writes land on its own disk; an upper layer's file hides a
// lower one's; a new backend (an edge restart) adopts the running VM and
// its processes' files are still there; Destroy leaves no VMM.
func TestLayersUpperAndAdoption(t *testing.T) {
	b := testBackend(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	top := t.TempDir()
	if err := os.MkdirAll(filepath.Join(top, "etc"), 0o755); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(top, "etc", "motd"), []byte("from the top layer\n"), 0o644)
	topImg := filepath.Join(t.TempDir(), "top.erofs")
	if out, err := exec.Command("mkfs.erofs", "--quiet", topImg, top).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.erofs: %v %s", err, out)
	}
	cfg := newConfig(t, "layers")
	cfg.Images = append(cfg.Images, topImg)
	if err := b.Create(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	defer b.Destroy(ctx, cfg.ID)
	sh := func(b *Backend, script string) string {
		var out bytes.Buffer
		p, err := b.Exec(ctx, cfg.ID, sandbox.Process{Args: []string{"/bin/sh", "-c", script}, Stdout: &out, Stderr: &out})
		if err != nil {
			t.Fatal(err)
		}
		if code, err := p.Wait(); code != 0 || err != nil {
			t.Fatalf("%s: %d %v %s", script, code, err, out.String())
		}
		return out.String()
	}
	out := sh(b, "cat /etc/motd; id -un; hostname; echo written > /root/f; sync; mount | grep -c ' on / type overlay'")
	if out != "from the top layer\nroot\nsandbox\n1\n" {
		t.Fatalf("sandbox root: %q", out)
	}
	st, err := b.Status(ctx, cfg.ID)
	if err != nil || !st.Running || st.Pid <= 0 {
		t.Fatalf("status %+v %v", st, err)
	}
	// The write is on the sandbox's own disk, not in a layer.
	disk := filepath.Join(cfg.Upper, "disk.ext4")
	if fi, err := os.Stat(disk); err != nil || fi.Size() != 1<<30 {
		t.Fatalf("writable disk: %v %v", fi, err)
	}
	// An edge restart (the old one's connection goes with it): a new
	// backend adopts the VMM.
	b.vms[cfg.ID].vm.Agent.Close()
	b2 := &Backend{cfg: b.cfg, guest: b.guest, vms: map[string]*vmSlot{}}
	b2.cfg.Log = slog.New(slog.NewTextHandler(tWriter{t}, nil))
	if out := sh(b2, "cat /root/f"); out != "written\n" {
		t.Fatalf("after adoption: %q", out)
	}
	if st2, err := b2.Status(ctx, cfg.ID); err != nil || st2.Pid != st.Pid {
		t.Fatalf("adopted status %+v %v, want pid %d", st2, err, st.Pid)
	}
	if err := b2.Destroy(ctx, cfg.ID); err != nil {
		t.Fatal(err)
	}
	if isVMM(st.Pid, b.dir(cfg.ID)) {
		t.Fatal("the VMM runs after Destroy")
	}
	if _, err := os.Stat(b.dir(cfg.ID)); !os.IsNotExist(err) {
		t.Fatalf("VM dir left: %v", err)
	}
	if strings.Contains(readMounts(t), b.dir(cfg.ID)) {
		t.Fatal("the VM's network namespace is still mounted")
	}
}

type tWriter struct{ t *testing.T }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

func readMounts(t *testing.T) string {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestPauseIsASnapshot: a paused VM is a file, not a process (its VMM
// exits and gives its memory back); an exec resumes it transparently, a
// second pause and resume work the same, and a paused VM is destroyed.
func TestPauseIsASnapshot(t *testing.T) {
	b := testBackend(t)
	b.cfg.Log = slog.New(slog.NewTextHandler(tWriter{t}, nil))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cfg := newConfig(t, "pause")
	if err := b.Create(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	defer b.Destroy(ctx, cfg.ID)
	sh := func(script string) string {
		var out bytes.Buffer
		p, err := b.Exec(ctx, cfg.ID, sandbox.Process{Args: []string{"/bin/sh", "-c", script}, Stdout: &out, Stderr: &out})
		if err != nil {
			t.Fatal(err)
		}
		if code, err := p.Wait(); code != 0 || err != nil {
			t.Fatalf("%s: %d %v %s", script, code, err, out.String())
		}
		return out.String()
	}
	sh("echo kept > /tmp/mem; echo 1 > /root/disk")
	for round := 1; round <= 2; round++ {
		st, _ := b.Status(ctx, cfg.ID)
		start := time.Now()
		if err := b.Pause(ctx, cfg.ID); err != nil {
			t.Fatal(err)
		}
		t.Logf("round %d: pause took %v", round, time.Since(start))
		if isVMM(st.Pid, b.dir(cfg.ID)) {
			t.Fatal("the VMM runs while paused")
		}
		fi, err := os.Stat(filepath.Join(b.dir(cfg.ID), "snapshot"))
		if err != nil || fi.Size() == 0 {
			t.Fatalf("snapshot file: %v %v", fi, err)
		}
		t.Logf("round %d: snapshot of %d MiB", round, fi.Size()>>20)
		if st, err := b.Status(ctx, cfg.ID); err != nil || !st.Running || st.Pid != 0 {
			t.Fatalf("paused status %+v %v", st, err)
		}
		start = time.Now()
		if round == 1 {
			if out := sh("cat /tmp/mem /root/disk"); out != "kept\n1\n" {
				t.Fatalf("after resume by exec: %q", out)
			}
		} else if err := b.Resume(ctx, cfg.ID); err != nil {
			t.Fatal(err)
		}
		t.Logf("round %d: resume took %v", round, time.Since(start))
		if out := sh("cat /tmp/mem"); out != "kept\n" {
			t.Fatalf("after resume: %q", out)
		}
	}
	if err := b.Pause(ctx, cfg.ID); err != nil {
		t.Fatal(err)
	}
	if err := b.Destroy(ctx, cfg.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(b.dir(cfg.ID)); !os.IsNotExist(err) {
		t.Fatalf("VM dir left: %v", err)
	}
}
