//go:build linux && cgo

package nsexec

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// detachedTmpfs returns a detached tmpfs mount (in no mount namespace).
func detachedTmpfs(t *testing.T) *os.File {
	t.Helper()
	fsfd, err := unix.Fsopen("tmpfs", unix.FSOPEN_CLOEXEC)
	if err != nil {
		t.Skipf("fsopen: %v", err)
	}
	defer unix.Close(fsfd)
	if err := unix.FsconfigCreate(fsfd); err != nil {
		t.Fatal(err)
	}
	mfd, err := unix.Fsmount(fsfd, unix.FSMOUNT_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(mfd), "tmpfs")
	t.Cleanup(func() { f.Close() })
	return f
}

// readIn reads name at the root of the detached mount.
func readIn(t *testing.T, mnt *os.File, name string) string {
	t.Helper()
	fd, err := unix.Openat(int(mnt.Fd()), name, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatalf("opening %s in the mount: %v", name, err)
	}
	f := os.NewFile(uintptr(fd), name)
	defer f.Close()
	b, err := io.ReadAll(f)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestRunInMountNS(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: unshares a mount namespace and attaches a mount")
	}
	sh, err := exec.LookPath("sh")
	if err != nil {
		t.Skip("no sh")
	}
	ctx := context.Background()
	mnt := detachedTmpfs(t)
	target := t.TempDir()

	// The mount is there for the command, at target, and not on the host
	// before or after.
	script := `set -e; test -d "$1"; grep -q " $1 " /proc/self/mountinfo
		echo here > "$1/status"`
	if err := RunInMountNS(ctx, mnt, target, []string{"PATH=/usr/bin:/bin"}, []string{sh, "-c", script, "sh", target}, nil); err != nil {
		t.Fatalf("RunInMountNS: %v", err)
	}
	if b, _ := os.ReadFile("/proc/self/mountinfo"); strings.Contains(string(b), " "+target+" ") {
		t.Errorf("%s is mounted on the host", target)
	}
	if _, err := os.Stat(filepath.Join(target, "status")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the command's file shows in the host's %s: %v", target, err)
	}
	if got := readIn(t, mnt, "status"); got != "here\n" {
		t.Errorf("file written in the mount: %q", got)
	}

	// The command's exit status comes back as an *exec.ExitError. (A
	// detached mount can be attached once: a new one per run.)
	err = RunInMountNS(ctx, detachedTmpfs(t), target, nil, []string{sh, "-c", "exit 3"}, nil)
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 3 {
		t.Errorf("exit 3: %v, want an ExitError with code 3", err)
	}

	// Setup failures name the step.
	err = RunInMountNS(ctx, detachedTmpfs(t), filepath.Join(target, "missing"), nil, []string{sh, "-c", "true"}, nil)
	if err == nil || !strings.Contains(err.Error(), "attaching the rootfs: errno 2") {
		t.Errorf("missing target: %v", err)
	}
	err = RunInMountNS(ctx, detachedTmpfs(t), target, nil, []string{filepath.Join(target, "no-such-runtime")}, nil)
	if err == nil || !strings.Contains(err.Error(), "exec of the runtime: errno 2") {
		t.Errorf("missing runtime: %v", err)
	}

	// Its stdio is /dev/null, no signal is blocked or caught in it (sleep
	// runs directly: a shell would reset its mask), and the end of ctx
	// kills it.
	sleep, err := exec.LookPath("sleep")
	if err != nil {
		t.Skip("no sleep")
	}
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		done <- RunInMountNS(cctx, detachedTmpfs(t), target, nil, []string{sleep, "61"}, nil)
	}()
	pid := 0
	for deadline := time.Now().Add(30 * time.Second); pid == 0 && time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
		for _, p := range procs {
			if b, _ := os.ReadFile(p); string(b) == sleep+"\x0061\x00" {
				fmt.Sscanf(strings.Split(p, "/")[2], "%d", &pid)
			}
		}
	}
	if pid == 0 {
		t.Fatal("the launched sleep did not show up")
	}
	for fd := 0; fd < 3; fd++ {
		if l, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%d", pid, fd)); l != "/dev/null" {
			t.Errorf("fd %d of the launched command: %q %v, want /dev/null", fd, l, err)
		}
	}
	status, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	for _, line := range strings.Split(string(status), "\n") {
		k, v, _ := strings.Cut(line, ":")
		if (k == "SigBlk" || k == "SigCgt") && strings.Trim(strings.TrimSpace(v), "0") != "" {
			t.Errorf("%s %s in the launched command, want none", k, strings.TrimSpace(v))
		}
	}
	start := time.Now()
	cancel()
	select {
	case err := <-done:
		if err == nil {
			t.Errorf("cancelled run returned no error")
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("cancelled run still going after %s", time.Since(start))
	}
}
