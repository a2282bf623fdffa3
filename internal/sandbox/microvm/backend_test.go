package microvm

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/files"
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
	// A command that runs across the pauses: it waits for its stdin.
	in, inw := io.Pipe()
	var live syncBuf
	running, err := b.Exec(ctx, cfg.ID, sandbox.Process{Args: []string{"/bin/sh", "-c", `echo started; read x; echo "got $x"`}, Stdin: in, Stdout: &live, Stderr: &live})
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); live.String() != "started\n"; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("no output: %q", live.String())
		}
	}
	exited := make(chan int, 1)
	go func() { code, _ := running.Wait(); exited <- code }()
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
		select {
		case code := <-exited:
			t.Fatalf("round %d: the command that waits for stdin ended (%d) across the pause", round, code)
		default:
		}
	}
	inw.Write([]byte("after\n"))
	select {
	case code := <-exited:
		if code != 0 || live.String() != "started\ngot after\n" {
			t.Fatalf("the command across two pauses: %d %q", code, live.String())
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the command across two pauses does not end")
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

// TestExportDiff: the writable layer comes out as the overlay keeps it
// (a deleted lower file a whiteout, a replaced lower directory opaque),
// with the disk frozen only while it is read (a writer running meanwhile
// goes on after), and from a paused VM, which stays paused.
func TestExportDiff(t *testing.T) {
	b := testBackend(t)
	b.cfg.Log = slog.New(slog.NewTextHandler(tWriter{t}, nil))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	top := t.TempDir()
	for _, f := range []string{"opt/a/x", "opt/b/y"} {
		os.MkdirAll(filepath.Join(top, filepath.Dir(f)), 0o755)
		os.WriteFile(filepath.Join(top, f), []byte("lower\n"), 0o644)
	}
	topImg := filepath.Join(t.TempDir(), "top.erofs")
	if out, err := exec.Command("mkfs.erofs", "--quiet", topImg, top).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.erofs: %v %s", err, out)
	}
	cfg := newConfig(t, "diff")
	cfg.Images = append(cfg.Images, topImg)
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
	sh("rm /opt/a/x && rm -rf /opt/b && mkdir /opt/b && echo z > /opt/b/z && echo new > /root/new && ln -s new /root/link && mkfifo /root/fifo")
	// A writer that never stops: the export freezes it and lets it go.
	bg, err := b.Exec(ctx, cfg.ID, sandbox.Process{Args: []string{"/bin/sh", "-c", "while :; do echo x >> /root/grow; done"}})
	if err != nil {
		t.Fatal(err)
	}
	defer bg.Kill()
	export := func() string {
		dir := t.TempDir()
		r, err := files.Open(dir)
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		pr, pw := io.Pipe()
		go func() { pw.CloseWithError(b.ExportDiff(ctx, cfg.ID, pw)) }()
		start := time.Now()
		res, err := r.ExtractTar("/", pr, files.TarOptions{Diff: true})
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("exported %d files, %d bytes in %v", res.Files, res.Bytes, time.Since(start))
		return dir
	}
	dir := export()
	var st unix.Stat_t
	if err := unix.Lstat(filepath.Join(dir, "opt/a/x"), &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFCHR || st.Rdev != 0 {
		t.Errorf("deleted lower file: %+v %v, want a whiteout", st, err)
	}
	buf := make([]byte, 8)
	if n, err := unix.Lgetxattr(filepath.Join(dir, "opt/b"), "trusted.overlay.opaque", buf); err != nil || string(buf[:n]) != "y" {
		t.Errorf("replaced lower directory: opaque %q %v", buf[:max(n, 0)], err)
	}
	if _, err := os.Lstat(filepath.Join(dir, "opt/b/y")); !os.IsNotExist(err) {
		t.Errorf("opt/b/y in the diff: %v", err)
	}
	for f, want := range map[string]string{"opt/b/z": "z\n", "root/new": "new\n"} {
		if got, err := os.ReadFile(filepath.Join(dir, f)); err != nil || string(got) != want {
			t.Errorf("%s = %q %v", f, got, err)
		}
	}
	if l, err := os.Readlink(filepath.Join(dir, "root/link")); err != nil || l != "new" {
		t.Errorf("link = %q %v", l, err)
	}
	if err := unix.Lstat(filepath.Join(dir, "root/fifo"), &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFIFO {
		t.Errorf("fifo: %v", err)
	}
	// The disk is thawed: the writer goes on.
	size := func() string { return sh("wc -c < /root/grow") }
	before := size()
	time.Sleep(500 * time.Millisecond)
	if after := size(); after == before {
		t.Fatalf("the writer stopped after the export (%s bytes)", strings.TrimSpace(after))
	}
	bg.Kill()
	// A directory watch runs in the guest: it sees what the sandbox does.
	fs, err := b.Files(ctx, cfg.ID)
	if err != nil {
		t.Fatal(err)
	}
	w, err := fs.Watch(ctx, "/opt", 2, 100)
	if err != nil {
		t.Fatal(err)
	}
	sh("echo 2 > /opt/b/z2; rm /opt/b/z")
	evs, err := w.Poll(ctx)
	if err != nil || len(evs) != 3 || evs[0].Name != "b/z" || evs[0].Type != api.FileEventRemove || evs[1].Name != "b/z2" {
		t.Fatalf("watch in the guest: %+v %v", evs, err)
	}
	w.Close()
	sh("echo paused > /root/p")
	if err := b.Pause(ctx, cfg.ID); err != nil {
		t.Fatal(err)
	}
	dir = export()
	if got, err := os.ReadFile(filepath.Join(dir, "root/p")); err != nil || string(got) != "paused\n" {
		t.Errorf("export of a paused VM: root/p = %q %v", got, err)
	}
	if st, err := b.Status(ctx, cfg.ID); err != nil || st.Pid != 0 {
		t.Fatalf("after the export of a paused VM: %+v %v, want it paused", st, err)
	}
}

// TestFreedMemoryGoesBack: the balloon reports what the guest frees, and
// the VMM gives it back to the host: a guest that filled 200 MiB and
// freed it does not keep holding it.
func TestFreedMemoryGoesBack(t *testing.T) {
	b := testBackend(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cfg := newConfig(t, "balloon")
	cfg.Limits.MemoryBytes = 512 << 20
	if err := b.Create(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	defer b.Destroy(ctx, cfg.ID)
	sh := func(script string) {
		var out bytes.Buffer
		p, err := b.Exec(ctx, cfg.ID, sandbox.Process{Args: []string{"/bin/sh", "-c", script}, Stdout: &out, Stderr: &out})
		if err != nil {
			t.Fatal(err)
		}
		if code, err := p.Wait(); code != 0 || err != nil {
			t.Fatalf("%s: %d %v %s", script, code, err, out.String())
		}
	}
	st, err := b.Status(ctx, cfg.ID)
	if err != nil {
		t.Fatal(err)
	}
	rss := func() int64 {
		data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", st.Pid))
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(string(data), "\n") {
			if f := strings.Fields(line); len(f) >= 2 && f[0] == "VmRSS:" {
				kb, _ := strconv.ParseInt(f[1], 10, 64)
				return kb << 10
			}
		}
		t.Fatal("no VmRSS")
		return 0
	}
	idle := rss()
	sh("dd if=/dev/zero of=/dev/shm/fill bs=1M count=200 2>/dev/null")
	full := rss()
	sh("rm /dev/shm/fill")
	// The guest reports free pages in 2 MiB blocks a couple of seconds
	// after they are freed.
	var after int64
	for i := 0; i < 30; i++ {
		time.Sleep(time.Second)
		if after = rss(); full-after > 150<<20 {
			break
		}
	}
	t.Logf("VMM RSS: idle %d MiB, filled %d MiB, after the free %d MiB", idle>>20, full>>20, after>>20)
	if full-idle < 150<<20 {
		t.Fatalf("filling 200 MiB grew the VMM by %d MiB only", (full-idle)>>20)
	}
	if full-after < 150<<20 {
		t.Fatalf("the guest freed 200 MiB and the VMM gave back %d MiB", (full-after)>>20)
	}
}

// syncBuf is a buffer safe for a writer and a reader at once.
type syncBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuf) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuf) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
