package netpolicy

import (
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func claimer(t *testing.T, instance, pool string) *Manager {
	t.Helper()
	m, err := New(Config{Instance: instance, Pool: netip.MustParsePrefix(pool)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(m.Close)
	return m
}

// Pools of running instances that overlap are named, those that do not
// are not, and the claims of instances gone (closed, or a process that
// died) no longer count and are removed.
func TestClaimPool(t *testing.T) {
	dir := t.TempDir()
	a := claimer(t, "aaaaa", "10.240.0.0/20")
	if others, err := a.ClaimPool(dir, "node e1"); err != nil || len(others) != 0 {
		t.Fatalf("first claim: %v %v", others, err)
	}
	// Inside a's pool, and around it: both overlap.
	for _, tc := range []struct{ inst, pool string }{{"bbbbb", "10.240.4.0/24"}, {"ccccc", "10.240.0.0/16"}} {
		m := claimer(t, tc.inst, tc.pool)
		others, err := m.ClaimPool(dir, "node "+tc.inst)
		if err != nil || len(others) == 0 || !strings.Contains(others[0], "10.240.0.0/20 of node e1 (pid ") {
			t.Fatalf("%s: %v %v", tc.pool, others, err)
		}
		m.Close()
	}
	d := claimer(t, "ddddd", "10.240.16.0/20")
	if others, err := d.ClaimPool(dir, "node e2"); err != nil || len(others) != 0 {
		t.Fatalf("a pool beside a's: %v %v", others, err)
	}
	// Claims are root's (the process's) alone: nobody else can lock one
	// and keep it alive.
	if fi, err := os.Stat(filepath.Join(dir, "aaaaa")); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("a's claim: %v %v", fi, err)
	}
	// Claimed again by the same manager: replaced, not refused.
	if others, err := a.ClaimPool(dir, "node e1"); err != nil || len(others) != 0 {
		t.Fatalf("a second claim of a: %v %v", others, err)
	}
	// Closed: a's claim ends (its file gone, its lock released), and
	// another may take its pool.
	a.Close()
	if _, err := os.Stat(filepath.Join(dir, "aaaaa")); !os.IsNotExist(err) {
		t.Fatalf("a's claim is still there after Close: %v", err)
	}
	e := claimer(t, "eeeee", "10.240.0.0/20")
	if others, err := e.ClaimPool(dir, "node e3"); err != nil || len(others) != 0 {
		t.Fatalf("after the first closed: %v %v", others, err)
	}
	// A claim its process left without closing (killed) is nobody's: not
	// named, and removed.
	stale := filepath.Join(dir, "fffff")
	if err := os.WriteFile(stale, []byte("10.240.0.0/20 1 node gone\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	f := claimer(t, "12345", "10.240.0.0/20")
	others, err := f.ClaimPool(dir, "node e4")
	if err != nil || len(others) != 1 || !strings.Contains(others[0], "node e3") {
		t.Fatalf("with a stale claim: %v %v", others, err)
	}
	if _, err := os.Stat(stale); !os.IsNotExist(err) {
		t.Fatalf("the stale claim is still there: %v", err)
	}
}

// A claim held by another process counts; once that process is gone it
// does not.
func TestClaimPoolOfAnotherProcess(t *testing.T) {
	flock, err := exec.LookPath("flock")
	if err != nil {
		t.Skip("flock(1) not installed")
	}
	dir := t.TempDir()
	path := filepath.Join(dir, "0a0a0")
	if err := os.WriteFile(path, []byte("10.241.0.0/16 4242 node other\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	holder := exec.Command(flock, "-x", path, "sleep", "60")
	holder.SysProcAttr = &syscall.SysProcAttr{Setpgid: true} // its sleep holds the lock too
	if err := holder.Start(); err != nil {
		t.Fatal(err)
	}
	kill := func() { _ = syscall.Kill(-holder.Process.Pid, syscall.SIGKILL) }
	defer kill()
	waitHeld(t, path, true)
	m := claimer(t, "b0b0b", "10.241.8.0/24")
	others, err := m.ClaimPool(dir, "node mine")
	if err != nil || len(others) != 1 || others[0] != "10.241.0.0/16 of node other (pid 4242)" {
		t.Fatalf("held by another process: %v %v", others, err)
	}
	m.Close()
	kill()
	_ = holder.Wait()
	waitHeld(t, path, false) // its sleep may outlive it a moment
	m2 := claimer(t, "b0b0b", "10.241.8.0/24")
	if others, err := m2.ClaimPool(dir, "node mine"); err != nil || len(others) != 0 {
		t.Fatalf("its process gone: %v %v", others, err)
	}
}

// waitHeld waits until some process holds (or no process holds) path's
// lock.
func waitHeld(t *testing.T, path string, want bool) {
	t.Helper()
	for i := 0; ; i++ {
		fd, err := unix.Open(path, unix.O_RDONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		held := unix.Flock(fd, unix.LOCK_SH|unix.LOCK_NB) != nil
		unix.Close(fd)
		if held == want {
			return
		}
		if i > 500 {
			t.Fatalf("%s: held %v, want %v", path, held, want)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// The claims directory is trusted only when it and its parent are this
// user's and nobody else may write there: through a symlink, root would
// remove and create files where another user chose; in a directory others
// write to, they could hold claims that refuse every edge.
func TestClaimPoolRefusesADirectoryOthersControl(t *testing.T) {
	base := t.TempDir()
	elsewhere := filepath.Join(base, "elsewhere")
	if err := os.Mkdir(elsewhere, 0o755); err != nil {
		t.Fatal(err)
	}
	victim := filepath.Join(elsewhere, "abcde") // a name a sweep would take for a claim
	if err := os.WriteFile(victim, []byte("precious"), 0o644); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(base, "pools")
	if err := os.Symlink(elsewhere, link); err != nil {
		t.Fatal(err)
	}
	m := claimer(t, "12345", "10.242.0.0/20")
	if _, err := m.ClaimPool(link, "node e1"); err == nil || !strings.Contains(err.Error(), "not a directory") {
		t.Fatalf("a symlinked directory: %v", err)
	}
	if _, err := OverlappingPools(link, "12345", netip.MustParsePrefix("10.242.0.0/20")); err == nil {
		t.Fatal("a symlinked directory was looked in")
	}
	if b, err := os.ReadFile(victim); err != nil || string(b) != "precious" {
		t.Fatalf("the symlink's target was changed: %q %v", b, err)
	}
	if left, _ := os.ReadDir(elsewhere); len(left) != 1 {
		t.Fatalf("files made through the symlink: %v", left)
	}
	// A directory others may write to, and one below a parent others may
	// write to.
	open := filepath.Join(base, "open")
	if err := os.Mkdir(open, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(open, 0o777); err != nil {
		t.Fatal(err)
	}
	for _, dir := range []string{open, filepath.Join(open, "pools")} {
		if _, err := m.ClaimPool(dir, "node e1"); err == nil || !strings.Contains(err.Error(), "may be written by others") {
			t.Fatalf("%s: %v", dir, err)
		}
	}
	if os.Geteuid() != 0 {
		return
	}
	// A claim planted by another user (root's directory refuses them; one
	// made while it was open to others) and held by it counts for nothing.
	dir := filepath.Join(base, "ok")
	if _, err := m.ClaimPool(dir, "node e1"); err != nil {
		t.Fatal(err)
	}
	planted := filepath.Join(dir, "0b0b0")
	if err := os.WriteFile(planted, []byte("10.242.0.0/16 1 node fake\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(planted, 65534, 65534); err != nil {
		t.Fatal(err)
	}
	for _, d := range []string{filepath.Dir(base), base} { // for nobody to reach it
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	holder := exec.Command("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "flock", "-x", planted, "sleep", "60")
	holder.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := holder.Start(); err != nil {
		t.Skipf("setpriv: %v", err)
	}
	defer func() { _ = syscall.Kill(-holder.Process.Pid, syscall.SIGKILL); _ = holder.Wait() }()
	waitHeld(t, planted, true)
	if others, err := OverlappingPools(dir, "12345", netip.MustParsePrefix("10.242.0.0/20")); err != nil || len(others) != 0 {
		t.Fatalf("another user's claim counted: %v %v", others, err)
	}
}
