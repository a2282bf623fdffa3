package remote

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/cgroup"
)

// The test binary is also a layer daemon: run with DSEC_TEST_LAYERFS_DIR
// set (and the flags a Source adds), it serves that directory.
func TestMain(m *testing.M) {
	if dir := os.Getenv("DSEC_TEST_LAYERFS_DIR"); dir != "" {
		os.Exit(testDaemonMain(dir))
	}
	os.Exit(m.Run())
}

func testDaemonMain(dir string) int {
	cfg := DaemonConfig{Dir: dir, CacheBytes: 64 << 20, Policy: FetchPolicy{Timeout: 3 * time.Second, Attempts: 2},
		Log: slog.New(slog.NewTextHandler(os.Stderr, nil))}
	for i, a := range os.Args {
		switch a {
		case "--fuse-fd":
			cfg.FUSE = os.NewFile(3, "/dev/fuse")
			_ = i
		case "--reattach":
			cfg.Reattach = true
		}
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	if err := Serve(ctx, cfg); err != nil {
		cfg.Log.Error("layerfs", "err", err)
		return 1
	}
	return 0
}

func (w *lazyWorld) daemonCommand() func() *exec.Cmd {
	return func() *exec.Cmd {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), "DSEC_TEST_LAYERFS_DIR="+w.dir)
		return cmd
	}
}

// A layer daemon killed mid-run is taken over by the next one on the same
// FUSE connection (the edge holds it): a sandbox's EROFS mount of one of
// its images keeps reading, a read made while no daemon ran completes once
// one does, and an edge that restarted gets the descriptor from the
// running daemon so that the next death is survived too.
func TestDaemonTakeover(t *testing.T) {
	w := newLazyCatalog(t, FetchPolicy{Timeout: 3 * time.Second, Attempts: 2})
	w.src.Command = w.daemonCommand()
	// Whatever happens, no daemon or mount is left to hang the removal
	// of the test's directories.
	var edges []*Source
	t.Cleanup(func() {
		// Daemons killed and every descriptor closed: the connection
		// aborts, and a read still waiting on it fails instead of hanging.
		exec.Command("pkill", "-KILL", "-f", "DSEC_TEST_LAYERFS_DIR="+w.dir).Run()
		for _, e := range append(edges, w.src) {
			e.EdgeStopped()
			e.mu.Lock()
			if e.fuse != nil {
				e.fuse.Close()
				e.fuse = nil
			}
			e.mu.Unlock()
		}
		unix.Unmount(MountDir(w.dir), unix.MNT_DETACH)
	})
	ctx := context.Background()
	path, release, err := w.src.Open(ctx, w.layer.Digest)
	if err != nil {
		log, _ := os.ReadFile(filepath.Join(w.dir, "layerfs.log"))
		t.Fatalf("open: %v\n%s", err, log)
	}
	defer release()
	first := w.src.DaemonPid()
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/oom_score_adj", first)); err != nil || string(bytes.TrimSpace(b)) != daemonOOMScore {
		t.Errorf("the daemon's OOM score: %q %v, want %s", b, err, daemonOOMScore)
	}
	if env, _ := os.ReadFile(fmt.Sprintf("/proc/%d/environ", first)); !bytes.Contains(env, []byte("GOMEMLIMIT="+daemonMemLimit)) {
		t.Error("the daemon runs without its memory limit")
	}
	mnt := mountImage(t, path)
	defer w.src.EdgeStopped()
	want, err := os.ReadFile(filepath.Join(w.tree, "usr/lib/big.bin"))
	must(t, err)
	f, err := os.Open(filepath.Join(mnt, "usr/lib/big.bin"))
	must(t, err)
	defer f.Close()
	head := make([]byte, 1<<20)
	if _, err := f.ReadAt(head, 0); err != nil || !bytes.Equal(head, want[:1<<20]) {
		t.Fatalf("first MiB: %v", err)
	}

	killAndWait(t, first)
	if !fuseMounted(MountDir(w.dir)) {
		t.Fatal("the mount went with the daemon")
	}
	// A read made now waits for the next daemon, which the edge's
	// watchdog starts on the same mount.
	rest := make([]byte, len(want)-(1<<20))
	if err := readWithin(f, rest, 1<<20, 20*time.Second); err != nil || !bytes.Equal(rest, want[1<<20:]) {
		t.Fatalf("the read across the takeover: %v", err)
	}
	// The read may have found its pages cached; the watchdog replaces
	// the daemon all the same.
	second := w.src.DaemonPid()
	for deadline := time.Now().Add(20 * time.Second); second == first && time.Now().Before(deadline); second = w.src.DaemonPid() {
		time.Sleep(50 * time.Millisecond)
	}
	if second == first || second == 0 {
		t.Fatalf("no new daemon: %d, %d", first, second)
	}

	// An edge that restarted: a new source, no descriptor of its own.
	// Its log in the test's: a mount left behind says why.
	edge2 := &Source{Store: w.src.Store, Dir: w.dir, Command: w.daemonCommand(), Log: slog.New(slog.NewTextHandler(newTWriter(t), nil))}
	edges = append(edges, edge2)
	must(t, edge2.ensureDaemon(ctx))
	edge2.mu.Lock()
	held := edge2.fuse != nil
	edge2.mu.Unlock()
	if !held {
		t.Fatal("the restarted edge did not get the daemon's descriptor")
	}
	// The first edge is gone: only edge2 holds the connection now.
	w.src.mu.Lock()
	w.src.fuse.Close()
	w.src.fuse = nil
	w.src.mu.Unlock()
	w.src.EdgeStopped() // its watchdog: only edge2's runs now
	killAndWait(t, second)
	// Drop what the kernel cached, so the read goes to the new daemon.
	must(t, unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED))
	img, err := os.Open(path)
	must(t, err)
	must(t, unix.Fadvise(int(img.Fd()), 0, 0, unix.FADV_DONTNEED))
	img.Close()
	again := make([]byte, len(want))
	if err := readWithin(f, again, 0, 20*time.Second); err != nil || !bytes.Equal(again, want) {
		t.Fatalf("after the second takeover: %v", err)
	}
	f.Close()
	must(t, unix.Unmount(mnt, 0))
	edge2.EdgeStopped()
	if fuseMounted(MountDir(w.dir)) {
		t.Fatal("the mount is still there after the edge stopped with no image mounted")
	}
}

// killAndWait kills pid (a daemon) with SIGKILL and waits until it is
// gone, reaping it if it is this process's child.
func killAndWait(t *testing.T, pid int) {
	t.Helper()
	must(t, syscall.Kill(pid, syscall.SIGKILL))
	for syscall.Kill(pid, 0) == nil {
		var ws syscall.WaitStatus
		syscall.Wait4(pid, &ws, syscall.WNOHANG, nil)
		time.Sleep(10 * time.Millisecond)
	}
}

// readWithin reads len(buf) bytes at off, or fails after d.
func readWithin(f *os.File, buf []byte, off int64, d time.Duration) error {
	done := make(chan error, 1)
	go func() {
		_, err := f.ReadAt(buf, off)
		done <- err
	}()
	select {
	case err := <-done:
		return err
	case <-time.After(d):
		return fmt.Errorf("read at %d still waiting after %v", off, d)
	}
}

// A read the daemon had taken from the kernel and not yet answered when it
// died (it waited on a stalled source) completes once the next daemon
// takes over: the kernel queues it again on the takeover's
// FUSE_NOTIFY_RESEND.
func TestReadInFlightAtDaemonDeath(t *testing.T) {
	w := newLazyCatalog(t, FetchPolicy{Timeout: 3 * time.Second, Attempts: 2})
	w.src.Command = w.daemonCommand()
	t.Cleanup(func() {
		w.reg.Resume()
		exec.Command("pkill", "-KILL", "-f", "DSEC_TEST_LAYERFS_DIR="+w.dir).Run()
		w.src.EdgeStopped()
		w.src.mu.Lock()
		if w.src.fuse != nil {
			w.src.fuse.Close()
			w.src.fuse = nil
		}
		w.src.mu.Unlock()
		unix.Unmount(MountDir(w.dir), unix.MNT_DETACH)
	})
	ctx := context.Background()
	path, release, err := w.src.Open(ctx, w.layer.Digest)
	must(t, err)
	defer release()
	mnt := mountImage(t, path)
	defer w.src.EdgeStopped()
	want, err := os.ReadFile(filepath.Join(w.tree, "usr/lib/big.bin"))
	must(t, err)
	f, err := os.Open(filepath.Join(mnt, "usr/lib/big.bin"))
	must(t, err)
	defer f.Close()
	head := make([]byte, 4096)
	if _, err := f.ReadAt(head, 0); err != nil || !bytes.Equal(head, want[:4096]) {
		t.Fatalf("first page: %v", err)
	}
	first := w.src.DaemonPid()

	// The source stalls; a read of what was never fetched reaches the
	// daemon, which waits on the source.
	w.reg.Pause()
	off := int64(len(want) / 2)
	rest := make([]byte, len(want)-int(off))
	done := make(chan error, 1)
	go func() {
		_, err := f.ReadAt(rest, off)
		done <- err
	}()
	select {
	case err := <-done:
		t.Fatalf("the read finished while the source stalled: %v", err)
	case <-time.After(time.Second):
	}
	killAndWait(t, first)
	w.reg.Resume()
	select {
	case err := <-done:
		if err != nil || !bytes.Equal(rest, want[off:]) {
			log, _ := os.ReadFile(filepath.Join(w.dir, "layerfs.log"))
			t.Fatalf("the read in flight at the daemon's death: %v (bytes right: %v)\n%s", err, bytes.Equal(rest, want[off:]), log)
		}
	case <-time.After(30 * time.Second):
		log, _ := os.ReadFile(filepath.Join(w.dir, "layerfs.log"))
		t.Fatalf("the read in flight at the daemon's death never completed (daemon now %d, was %d)\n%s", w.src.DaemonPid(), first, log)
	}
	if second := w.src.DaemonPid(); second == first || second == 0 {
		t.Fatalf("no new daemon: %d, %d", first, second)
	}
}

// The daemon runs in the cgroup the edge gives it (with its limits), and
// the cgroup goes once the edge stopped and the daemon with it.
func TestDaemonInItsCgroup(t *testing.T) {
	w := newLazyCatalog(t, FetchPolicy{Timeout: 3 * time.Second, Attempts: 2})
	w.src.Command = w.daemonCommand()
	cg, err := cgroup.Detect()
	if err != nil {
		t.Skipf("no cgroups: %v", err)
	}
	rel := fmt.Sprintf("/dsec-test-layerfs-%d", os.Getpid())
	t.Cleanup(func() {
		exec.Command("pkill", "-KILL", "-f", "DSEC_TEST_LAYERFS_DIR="+w.dir).Run()
		unix.Unmount(MountDir(w.dir), unix.MNT_DETACH)
		cg.Remove(rel)
	})
	const limit = 256 << 20
	w.src.Cgroup = &DaemonCgroup{
		Join: func() ([]string, error) {
			return cg.MakeSandbox(rel, cgroup.Limits{MemoryBytes: limit, Pids: 128, Devices: []string{"c 10:229 rwm"}})
		},
		Remove: func() error { return cg.RemoveIdle(rel) },
	}
	path, release, err := w.src.Open(context.Background(), w.layer.Digest)
	must(t, err)
	pid := w.src.DaemonPid()
	if got, err := cg.RelOf(pid); err != nil || got != rel {
		release()
		t.Fatalf("the daemon (%d) is in cgroup %q (%v), want %q", pid, got, err, rel)
	}
	memFile := filepath.Join(cg.V2Root, rel, "memory.max")
	if mem, ok := cg.V1["memory"]; ok {
		memFile = filepath.Join(mem, rel, "memory.limit_in_bytes")
	}
	if b, err := os.ReadFile(memFile); err != nil || strings.TrimSpace(string(b)) != strconv.Itoa(limit) {
		t.Errorf("the daemon's memory limit: %q %v, want %d", b, err, limit)
	}
	// Its images still read right from within it.
	mnt := mountImage(t, path)
	want, err := os.ReadFile(filepath.Join(w.tree, "usr/lib/big.bin"))
	must(t, err)
	if got, err := os.ReadFile(filepath.Join(mnt, "usr/lib/big.bin")); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("reading through the daemon in its cgroup: %v", err)
	}
	must(t, unix.Unmount(mnt, 0))
	release()
	w.src.EdgeStopped()
	if cg.Exists(rel) {
		t.Error("the daemon's cgroup is still there after the edge stopped and the daemon exited")
	}
}

// tWriter writes log lines into a test's log while the test runs (the
// source's goroutines may log after it ended, which t.Log refuses).
type tWriter struct {
	mu   sync.Mutex
	t    *testing.T
	done bool
}

func newTWriter(t *testing.T) *tWriter {
	w := &tWriter{t: t}
	t.Cleanup(func() {
		w.mu.Lock()
		w.done = true
		w.mu.Unlock()
	})
	return w
}

func (w *tWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.done {
		w.t.Log(strings.TrimRight(string(p), "\n"))
	}
	return len(p), nil
}
