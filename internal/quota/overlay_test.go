package quota

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// mountOverlay mounts an overlay of lower under sb/upper (with sb/work) at a
// fresh directory, with the options the edge uses, and returns the merged
// directory.
func mountOverlay(t testing.TB, lower, sb string) (merged, upper string) {
	t.Helper()
	merged = t.TempDir()
	upper, work := filepath.Join(sb, "upper"), filepath.Join(sb, "work")
	mkdir(t, upper)
	mkdir(t, work)
	opts := "lowerdir=" + lower + ",upperdir=" + upper + ",workdir=" + work + ",index=off,redirect_dir=off,metacopy=off"
	if err := unix.Mount("overlay", merged, "overlay", 0, opts); err != nil {
		t.Fatalf("mounting overlay: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(merged, unix.MNT_DETACH) })
	return merged, upper
}

// TestOverlayUpperInheritsProject checks that what a sandbox writes through
// its overlay, new files and copied-up ones alike, lands in the upper with
// the sandbox's project ID, so the quota applies to it.
func TestOverlayUpperInheritsProject(t *testing.T) {
	root, _ := plainXFS(t)
	v := &Volume{dir: root}
	lower := t.TempDir()
	if err := os.WriteFile(filepath.Join(lower, "etc-file"), []byte("lower"), 0o644); err != nil {
		t.Fatal(err)
	}
	mkdir(t, filepath.Join(lower, "usr", "lib"))
	sb := filepath.Join(root, "sb")
	mkdir(t, sb)
	tag(t, sb, 106)
	merged, upper := mountOverlay(t, lower, sb)

	if err := os.WriteFile(filepath.Join(merged, "etc-file"), []byte("changed"), 0o644); err != nil {
		t.Fatalf("copy-up: %v", err)
	}
	if err := os.WriteFile(filepath.Join(merged, "usr", "lib", "new.so"), []byte("new"), 0o644); err != nil {
		t.Fatalf("write below a lower directory: %v", err)
	}
	mkdir(t, filepath.Join(merged, "home", "agent"))
	for _, p := range []string{"etc-file", "usr", "usr/lib", "usr/lib/new.so", "home/agent"} {
		if id, err := v.Project(filepath.Join(upper, p)); err != nil || id != 106 {
			t.Errorf("upper/%s has project %d, %v; want 106", p, id, err)
		}
	}
}

// chprojHelperEnv makes the test binary, re-executed in a new user
// namespace, try to move a file to project 0 and print the outcome.
const chprojHelperEnv = "DSEC_QUOTA_TEST_CHPROJ"

func TestMain(m *testing.M) {
	if path := os.Getenv(chprojHelperEnv); path != "" {
		os.Stdout.WriteString(errName(chproj(path, 0)))
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func chproj(path string, id uint32) error {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return chprojFd(fd, id)
}

func chprojFd(fd int, id uint32) error {
	fa, err := getFsxattr(fd)
	if err != nil {
		return err
	}
	fa.Projid = id
	return setFsxattr(fd, &fa)
}

func errName(err error) string {
	var errno unix.Errno
	switch {
	case err == nil:
		return "ok"
	case errors.As(err, &errno):
		return unix.ErrnoName(errno)
	}
	return err.Error()
}

// asUser runs fn on a thread whose uids and gids are all uid, which drops
// every capability. The thread is never unlocked, so the runtime discards
// it when fn returns.
func asUser(uid int, fn func() error) error {
	done := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		if _, _, e := unix.RawSyscall(unix.SYS_SETGROUPS, 0, 0, 0); e != 0 {
			done <- e
			return
		}
		if _, _, e := unix.RawSyscall(unix.SYS_SETRESGID, uintptr(uid), uintptr(uid), uintptr(uid)); e != 0 {
			done <- e
			return
		}
		if _, _, e := unix.RawSyscall(unix.SYS_SETRESUID, uintptr(uid), uintptr(uid), uintptr(uid)); e != 0 {
			done <- e
			return
		}
		done <- fn()
	}()
	return <-done
}

// asUserOn opens path as root (the test's directories are not searchable by
// others) and, as uid, asks the kernel to move it to project id.
func asUserOn(t testing.TB, path string, uid int, id uint32) error {
	t.Helper()
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	return asUser(uid, func() error { return chprojFd(fd, id) })
}

// TestProjectChangeByFileOwner pins down who may take a file out of its
// project, which is how a sandbox would escape its disk quota. The kernel
// (fileattr_set_prepare) lets a file's owner change its project ID through
// FS_IOC_FSSETXATTR with no capability at all, as long as the caller is in
// the initial user namespace, and through an overlay as well, since the
// overlay applies the change to the upper with the mounter's credentials.
// Only a caller inside a user namespace is refused (EINVAL). So a sandbox
// without a user namespace must have FS_IOC_FSSETXATTR denied by seccomp.
func TestProjectChangeByFileOwner(t *testing.T) {
	root, _ := plainXFS(t)
	const nobody = 65534
	sb := filepath.Join(root, "sb")
	mkdir(t, sb)
	tag(t, sb, 107)
	lower := t.TempDir()
	merged, upper := mountOverlay(t, lower, sb)

	direct := filepath.Join(sb, "direct")
	viaOverlay := filepath.Join(merged, "via-overlay")
	for _, p := range []string{direct, viaOverlay} {
		if err := os.WriteFile(p, []byte("x"), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(p, nobody, nobody); err != nil {
			t.Fatal(err)
		}
	}
	v := &Volume{dir: root}
	for _, tt := range []struct{ name, path, check string }{
		{"on the upper filesystem", direct, direct},
		{"through the overlay", viaOverlay, filepath.Join(upper, "via-overlay")},
	} {
		err := asUserOn(t, tt.path, nobody, 0)
		id, perr := v.Project(tt.check)
		if err != nil || perr != nil || id != 0 {
			t.Errorf("%s: uid %d without capabilities moving its own file to project 0: %v; project now %d (%v); want the kernel to allow it", tt.name, nobody, err, id, perr)
		}
	}

	// Someone else's file: refused.
	rootsFile := filepath.Join(sb, "roots")
	if err := os.WriteFile(rootsFile, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := asUserOn(t, rootsFile, nobody, 0); !errors.Is(err, unix.EPERM) {
		t.Errorf("uid %d changing the project of root's file = %v, want EPERM", nobody, err)
	}

	// Root of a user namespace, owning the file: refused with EINVAL.
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), chprojHelperEnv+"="+rootsFile)
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags:  syscall.CLONE_NEWUSER,
		UidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: 0, Size: 1}},
		GidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: 0, Size: 1}},
	}
	out, err := cmd.Output()
	if err != nil {
		t.Skipf("cannot run a helper in a new user namespace: %v", err)
	}
	if got := strings.TrimSpace(string(out)); got != "EINVAL" {
		t.Errorf("root of a user namespace changing the project of its file = %s, want EINVAL", got)
	}
	if id, err := v.Project(rootsFile); err != nil || id != 107 {
		t.Errorf("project of %s = %d, %v; want 107", rootsFile, id, err)
	}
}
