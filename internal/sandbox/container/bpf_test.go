package container

import (
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// TestMain lets the seccomp test re-execute the test binary as a child that
// installs the filter and reports what the kernel then answers.
func TestMain(m *testing.M) {
	if os.Getenv("DSEC_SECCOMP_CHILD") == "1" {
		seccompChild()
		return
	}
	os.Exit(m.Run())
}

// seccompProbes are attempts a sandboxed process might make, each printed
// as "name=errno" by the child.
var seccompProbes = []struct {
	name string
	want unix.Errno // 0: allowed
}{
	{"getpid", 0},
	{"mount", unix.EPERM},
	{"umount2", unix.EPERM},
	{"unshare-user", unix.EPERM},
	{"unshare-net", unix.EPERM},
	{"unshare-mnt-in-high-bits", unix.EPERM},
	{"unshare-files", 0},
	{"setns", unix.EPERM},
	{"clone3", unix.ENOSYS},
	{"ptrace", unix.EPERM},
	{"bpf", unix.EPERM},
	{"perf_event_open", unix.EPERM},
	{"keyctl", unix.EPERM},
	{"open_by_handle_at", unix.EPERM},
	{"userfaultfd", unix.EPERM},
	{"io_uring_setup", unix.EPERM},
	{"kexec_load", unix.EPERM},
	{"init_module", unix.EPERM},
	{"fsopen", unix.EPERM},
	{"swapon", unix.EPERM},
	{"x32-getpid", unix.ENOSYS},
	{"ioctl-xfs-swapext", unix.EPERM},
	{"ioctl-setflags", unix.EPERM},
	{"ioctl-setflags-junk-high-bits", unix.EPERM},
	{"ioctl-fsxattr", unix.EPERM},
	{"ioctl-fionread", 0},
}

func seccompChild() {
	runtime.LockOSThread()
	prog, err := seccompBPF()
	if err != nil {
		fmt.Println("compile:", err)
		os.Exit(2)
	}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		fmt.Println("nnp:", err)
		os.Exit(2)
	}
	fprog := unix.SockFprog{Len: uint16(len(prog)), Filter: &prog[0]}
	// TSYNC: every thread of the Go runtime gets the filter.
	if _, _, e := unix.Syscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, unix.SECCOMP_FILTER_FLAG_TSYNC, uintptr(unsafe.Pointer(&fprog))); e != 0 {
		fmt.Println("seccomp:", e)
		os.Exit(2)
	}
	f, err := os.CreateTemp("", "seccomp-ioctl")
	if err != nil {
		fmt.Println("temp:", err)
		os.Exit(2)
	}
	defer os.Remove(f.Name())
	fd := f.Fd()
	var flags int
	sys := func(nr uintptr, a ...uintptr) unix.Errno {
		var args [6]uintptr
		copy(args[:], a)
		_, _, e := unix.Syscall6(nr, args[0], args[1], args[2], args[3], args[4], args[5])
		return e
	}
	results := map[string]unix.Errno{
		"getpid":                        sys(unix.SYS_GETPID),
		"mount":                         sys(unix.SYS_MOUNT, 0, 0, 0, 0, 0),
		"umount2":                       sys(unix.SYS_UMOUNT2, 0, 0),
		"unshare-user":                  sys(unix.SYS_UNSHARE, unix.CLONE_NEWUSER),
		"unshare-net":                   sys(unix.SYS_UNSHARE, unix.CLONE_NEWNET),
		"unshare-mnt-in-high-bits":      sys(unix.SYS_UNSHARE, 0xdead_0000_0000|unix.CLONE_NEWNS),
		"unshare-files":                 sys(unix.SYS_UNSHARE, unix.CLONE_FILES),
		"setns":                         sys(unix.SYS_SETNS, ^uintptr(0), 0),
		"clone3":                        sys(unix.SYS_CLONE3, 0, 0),
		"ptrace":                        sys(unix.SYS_PTRACE, unix.PTRACE_TRACEME),
		"bpf":                           sys(unix.SYS_BPF, 0, 0, 0),
		"perf_event_open":               sys(unix.SYS_PERF_EVENT_OPEN, 0, 0, 0, 0, 0),
		"keyctl":                        sys(unix.SYS_KEYCTL, 0),
		"open_by_handle_at":             sys(unix.SYS_OPEN_BY_HANDLE_AT, 0, 0, 0),
		"userfaultfd":                   sys(unix.SYS_USERFAULTFD, 0),
		"io_uring_setup":                sys(unix.SYS_IO_URING_SETUP, 0, 0),
		"kexec_load":                    sys(unix.SYS_KEXEC_LOAD, 0, 0, 0, 0),
		"init_module":                   sys(unix.SYS_INIT_MODULE, 0, 0, 0),
		"fsopen":                        sys(unix.SYS_FSOPEN, 0, 0),
		"swapon":                        sys(unix.SYS_SWAPON, 0, 0),
		"x32-getpid":                    sys(x32SyscallBit | unix.SYS_GETPID),
		"ioctl-xfs-swapext":             sys(unix.SYS_IOCTL, fd, ioctlXFSSwapExt, 0),
		"ioctl-setflags":                sys(unix.SYS_IOCTL, fd, ioctlFSSetFlags, uintptr(unsafe.Pointer(&flags))),
		"ioctl-setflags-junk-high-bits": sys(unix.SYS_IOCTL, fd, 0xffff_ffff_0000_0000|ioctlFSSetFlags, uintptr(unsafe.Pointer(&flags))),
		"ioctl-fsxattr":                 sys(unix.SYS_IOCTL, fd, ioctlFSSetXattr, 0),
		"ioctl-fionread":                sys(unix.SYS_IOCTL, fd, unix.TIOCINQ, uintptr(unsafe.Pointer(&flags))),
	}
	for name, e := range results {
		fmt.Printf("%s=%d\n", name, int(e))
	}
}

// TestSeccompBPFRefuses installs the compiled filter in a child process
// (no root needed: no_new_privs suffices) and makes the calls a hostile
// process would: each denied one must come back with the profile's errno
// before the kernel looks at its arguments, and ordinary ones must work.
func TestSeccompBPFRefuses(t *testing.T) {
	if runtime.GOARCH != "amd64" {
		t.Skip("the compiled filter is amd64-only")
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), "DSEC_SECCOMP_CHILD=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
	got := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		if k, v, ok := strings.Cut(line, "="); ok {
			got[k] = v
		}
	}
	for _, p := range seccompProbes {
		want := fmt.Sprint(int(p.want))
		if p.want == 0 {
			// Allowed calls may still fail in the kernel, just not with
			// the filter's errors.
			if got[p.name] == fmt.Sprint(int(unix.EPERM)) || got[p.name] == fmt.Sprint(int(unix.ENOSYS)) {
				t.Errorf("%s: errno %s, want it allowed", p.name, got[p.name])
			}
			continue
		}
		if got[p.name] != want {
			t.Errorf("%s: errno %q, want %s (%v)", p.name, got[p.name], want, p.want)
		}
	}
}

// TestSeccompBPFCoversProfile checks that every syscall the profile denies
// has an x86_64 number (a name added to deniedSyscalls without one would
// silently not be filtered), and that the program fits the kernel's limit.
func TestSeccompBPFCoversProfile(t *testing.T) {
	for _, name := range deniedSyscalls {
		if _, ok := syscallNumbers[name]; !ok && name != "umount" {
			t.Errorf("denied syscall %s has no x86_64 number in syscallNumbers", name)
		}
	}
	if runtime.GOARCH != "amd64" {
		return
	}
	prog, err := seccompBPF()
	if err != nil {
		t.Fatal(err)
	}
	if len(prog) > 4096 {
		t.Errorf("program has %d instructions, the kernel takes 4096", len(prog))
	}
}

func TestCapMask(t *testing.T) {
	m := capMask(defaultCaps)
	if got := popcount(m); got != len(defaultCaps) {
		t.Errorf("mask %#x has %d bits, want %d", m, got, len(defaultCaps))
	}
	if m&(1<<unix.CAP_SYS_ADMIN) != 0 || m&(1<<unix.CAP_NET_RAW) != 0 {
		t.Errorf("mask %#x holds SYS_ADMIN or NET_RAW", m)
	}
}

func popcount(m uint64) int {
	n := 0
	for ; m != 0; m &= m - 1 {
		n++
	}
	return n
}
