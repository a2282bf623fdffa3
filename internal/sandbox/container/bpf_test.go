package container

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"sort"
	"strings"
	"testing"
	"unsafe"

	specs "github.com/opencontainers/runtime-spec/specs-go"
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
	{"ioctl-fiemap", unix.EPERM},
	{"ioctl-fiemap-junk-high-bits", unix.EPERM},
	{"ioctl-fibmap", unix.EPERM},
	{"ioctl-getfsmap", unix.EPERM},
	{"ioctl-fionread", 0},
}

// socketProbes are socket(2) and socketpair(2) calls, printed like
// seccompProbes. want 0: the filter lets it through, and it must then give
// what it gives unfiltered.
var socketProbes = []struct {
	name               string
	pair               bool
	domain, typ, proto uint64
	want               unix.Errno
}{
	{"socket-unix", false, unix.AF_UNIX, unix.SOCK_STREAM | unix.SOCK_CLOEXEC, 0, 0},
	{"socket-inet", false, unix.AF_INET, unix.SOCK_DGRAM | unix.SOCK_NONBLOCK, 0, 0},
	{"socket-inet6", false, unix.AF_INET6, unix.SOCK_STREAM, 0, 0},
	{"socket-netlink-route", false, unix.AF_NETLINK, unix.SOCK_RAW | unix.SOCK_CLOEXEC, unix.NETLINK_ROUTE, 0},
	{"socket-netlink-sock-diag", false, unix.AF_NETLINK, unix.SOCK_DGRAM, unix.NETLINK_SOCK_DIAG, 0},
	{"socketpair-unix", true, unix.AF_UNIX, unix.SOCK_STREAM, 0, 0},
	{"socket-vsock", false, unix.AF_VSOCK, unix.SOCK_STREAM, 0, unix.EAFNOSUPPORT},
	{"socket-vsock-nonblock", false, unix.AF_VSOCK, unix.SOCK_STREAM | unix.SOCK_NONBLOCK | unix.SOCK_CLOEXEC, 0, unix.EAFNOSUPPORT},
	// The kernel reads the low 32 bits of the family: this is AF_VSOCK.
	{"socket-vsock-high-bits", false, 1<<32 | unix.AF_VSOCK, unix.SOCK_STREAM, 0, unix.EAFNOSUPPORT},
	// Stricter than the kernel, which would open AF_UNIX (seccomp.go's
	// refuseOutside says why).
	{"socket-unix-high-bits", false, 1<<32 | unix.AF_UNIX, unix.SOCK_STREAM, 0, unix.EAFNOSUPPORT},
	{"socket-unspec", false, unix.AF_UNSPEC, unix.SOCK_STREAM, 0, unix.EAFNOSUPPORT},
	{"socket-packet", false, unix.AF_PACKET, unix.SOCK_RAW, 0, unix.EAFNOSUPPORT},
	{"socket-alg", false, unix.AF_ALG, unix.SOCK_SEQPACKET, 0, unix.EAFNOSUPPORT},
	{"socket-xdp", false, unix.AF_XDP, unix.SOCK_RAW, 0, unix.EAFNOSUPPORT},
	{"socket-key", false, unix.AF_KEY, unix.SOCK_RAW, 2 /* PF_KEY_V2 */, unix.EAFNOSUPPORT},
	{"socket-tipc", false, unix.AF_TIPC, unix.SOCK_RDM, 0, unix.EAFNOSUPPORT},
	{"socket-family-max", false, unix.AF_MAX, unix.SOCK_STREAM, 0, unix.EAFNOSUPPORT},
	{"socket-netlink-uevent", false, unix.AF_NETLINK, unix.SOCK_DGRAM, unix.NETLINK_KOBJECT_UEVENT, unix.EPROTONOSUPPORT},
	{"socket-netlink-audit", false, unix.AF_NETLINK, unix.SOCK_RAW | unix.SOCK_CLOEXEC, unix.NETLINK_AUDIT, unix.EPROTONOSUPPORT},
	{"socket-netlink-generic", false, unix.AF_NETLINK, unix.SOCK_RAW, unix.NETLINK_GENERIC, unix.EPROTONOSUPPORT},
	{"socket-netlink-netfilter", false, unix.AF_NETLINK, unix.SOCK_RAW, unix.NETLINK_NETFILTER, unix.EPROTONOSUPPORT},
	{"socket-netlink-xfrm", false, unix.AF_NETLINK, unix.SOCK_RAW, unix.NETLINK_XFRM, unix.EPROTONOSUPPORT},
	{"socket-netlink-route-high-bits", false, unix.AF_NETLINK, unix.SOCK_RAW, 1<<32 | unix.NETLINK_ROUTE, unix.EPROTONOSUPPORT},
	{"socket-netlink-high-bits-uevent", false, 1<<32 | unix.AF_NETLINK, unix.SOCK_DGRAM, unix.NETLINK_KOBJECT_UEVENT, unix.EAFNOSUPPORT},
	{"socketpair-inet", true, unix.AF_INET, unix.SOCK_STREAM, 0, unix.EAFNOSUPPORT},
	{"socketpair-netlink", true, unix.AF_NETLINK, unix.SOCK_RAW, 0, unix.EAFNOSUPPORT},
	{"socketpair-unix-high-bits", true, 1<<32 | unix.AF_UNIX, unix.SOCK_STREAM, 0, unix.EAFNOSUPPORT},
}

// socketCall makes a socketProbes call and closes what it opened.
func socketCall(pair bool, domain, typ, proto uint64) unix.Errno {
	if pair {
		var fds [2]int32
		_, _, e := unix.Syscall6(unix.SYS_SOCKETPAIR, uintptr(domain), uintptr(typ), uintptr(proto), uintptr(unsafe.Pointer(&fds)), 0, 0)
		if e == 0 {
			unix.Close(int(fds[0]))
			unix.Close(int(fds[1]))
		}
		return e
	}
	fd, _, e := unix.Syscall(unix.SYS_SOCKET, uintptr(domain), uintptr(typ), uintptr(proto))
	if e == 0 {
		unix.Close(int(fd))
	}
	return e
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
	// Headers asking for nothing (fm_extent_count, fmh_count 0): were
	// the filter to let them through, the kernel would only count.
	var fiemap [32]byte
	var fsmap [192]byte
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
		"ioctl-fiemap":                  sys(unix.SYS_IOCTL, fd, ioctlFIEMAP, uintptr(unsafe.Pointer(&fiemap))),
		"ioctl-fiemap-junk-high-bits":   sys(unix.SYS_IOCTL, fd, 0xffff_ffff_0000_0000|ioctlFIEMAP, uintptr(unsafe.Pointer(&fiemap))),
		"ioctl-fibmap":                  sys(unix.SYS_IOCTL, fd, ioctlFIBMAP, uintptr(unsafe.Pointer(&flags))),
		"ioctl-getfsmap":                sys(unix.SYS_IOCTL, fd, ioctlGetFSMap, uintptr(unsafe.Pointer(&fsmap))),
		"ioctl-fionread":                sys(unix.SYS_IOCTL, fd, unix.TIOCINQ, uintptr(unsafe.Pointer(&flags))),
	}
	for _, p := range socketProbes {
		results[p.name] = socketCall(p.pair, p.domain, p.typ, p.proto)
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
	for _, p := range socketProbes {
		want := p.want
		if want == 0 {
			// Only the allowed calls run unfiltered: a refused family
			// could load a kernel module.
			if want = socketCall(p.pair, p.domain, p.typ, p.proto); want != 0 {
				t.Logf("%s: fails unfiltered too (%v), so it tells nothing here", p.name, want)
				continue
			}
		}
		if got[p.name] != fmt.Sprint(int(want)) {
			t.Errorf("%s: errno %q, want %d (%v)", p.name, got[p.name], int(want), want)
		}
	}
}

// TestSeccompBPFCoversProfile checks that every syscall the profile names
// has an x86_64 number (a name added to deniedSyscalls without one would
// silently not be filtered), that the program fits the kernel's limit, and
// that the program answers native calls as the runtimes' libseccomp filter
// of the profile does. The calls tried, per syscall, vary every argument
// either side compares (the profile's rules name them; the program's are
// found by running it) over small values (0-70: every address family and
// netlink protocol) and values at, around and beyond every constant either
// side compares that argument with, with and without upper bits.
func TestSeccompBPFCoversProfile(t *testing.T) {
	prof := seccompProfile()
	var names []string
	for _, r := range prof.Syscalls {
		for _, name := range r.Names {
			if slices.Contains(names, name) {
				continue
			}
			names = append(names, name)
			if _, ok := syscallNumbers[name]; !ok && name != "umount" {
				t.Errorf("syscall %s of the profile has no x86_64 number in syscallNumbers", name)
			}
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
	unlisted := map[string]uint32{"getpid": unix.SYS_GETPID, "read": unix.SYS_READ} // allowed
	names = append(names, "getpid", "read")
	calls, mismatches := 0, 0
	for _, name := range names {
		nr, ok := syscallNumbers[name]
		if !ok {
			if nr, ok = unlisted[name]; !ok {
				continue // umount
			}
		}
		values := argValues{}
		for _, r := range prof.Syscalls {
			if slices.Contains(r.Names, name) {
				for _, a := range r.Args {
					values.add(a.Index, a.Value)
					values.add(a.Index, a.ValueTwo)
				}
			}
		}
		// What the program compares, and then what it compares on the
		// paths those values open, until nothing new turns up.
		for grew := true; grew; {
			grew = false
			for _, args := range values.vectors() {
				_, err := runFilter(prog, nr, args, func(off, k uint32) {
					if off < argLow(0) {
						return // nr, arch
					}
					c := uint64(k)
					if (off-argLow(0))%8 == 4 {
						c <<= 32 // the upper half
					}
					grew = values.add(uint((off-argLow(0))/8), c) || grew
				})
				if err != nil {
					t.Fatalf("%s%#x: %v", name, args, err)
				}
			}
		}
		for _, args := range values.vectors() {
			calls++
			want, err := profileAction(prof, name, args)
			if err != nil {
				t.Fatal(err)
			}
			got, err := runFilter(prog, nr, args, nil)
			if err != nil {
				t.Fatalf("%s%#x: %v", name, args, err)
			}
			if got != want {
				if mismatches++; mismatches <= 10 {
					t.Errorf("%s%#x: program answers %#x, profile %#x", name, args, got, want)
				}
			}
		}
	}
	if mismatches > 10 {
		t.Errorf("... %d mismatches in all", mismatches)
	}
	t.Logf("%d calls compared", calls)
}

// argValues holds, per argument index, the values worth trying.
type argValues map[uint]map[uint64]bool

// add records the values around constant c for argument i and reports
// whether any was new.
func (av argValues) add(i uint, c uint64) bool {
	vs := av[i]
	grew := false
	if vs == nil {
		vs = map[uint64]bool{}
		for v := uint64(0); v <= 70; v++ {
			vs[v] = true
		}
		av[i], grew = vs, true
	}
	for _, v := range []uint64{c, c - 1, c + 1, ^c} {
		for _, high := range []uint64{0, 1 << 32, 0xffffffff << 32} {
			for _, w := range []uint64{v&0xffffffff | high, v | high} {
				if !vs[w] {
					vs[w], grew = true, true
				}
			}
		}
	}
	return grew
}

// vectors returns every combination of the values; other arguments are 0.
func (av argValues) vectors() [][6]uint64 {
	vectors := [][6]uint64{{}}
	for i := uint(0); i < 6; i++ {
		if av[i] == nil {
			continue
		}
		var sorted []uint64
		for v := range av[i] {
			sorted = append(sorted, v)
		}
		sort.Slice(sorted, func(a, b int) bool { return sorted[a] < sorted[b] })
		var next [][6]uint64
		for _, vec := range vectors {
			for _, v := range sorted {
				vec[i] = v
				next = append(next, vec)
			}
		}
		vectors = next
	}
	return vectors
}

// profileAction is what a libseccomp filter compiled from prof by runc or
// crun answers a native call of name with args. Both AND the comparisons of
// a rule unless two are on the same argument, and then add each as a rule
// of its own (matchCall in runc's libcontainer/seccomp, crun's
// make_seccomp_rules); libseccomp compares unsigned, on all 64 bits. The
// profile must not let two rules with different actions match one call:
// which wins is libseccomp's business, not something to rely on.
func profileAction(prof *specs.LinuxSeccomp, name string, args [6]uint64) (uint32, error) {
	if prof.DefaultAction != specs.ActAllow {
		return 0, fmt.Errorf("default action %s: only %s is modelled", prof.DefaultAction, specs.ActAllow)
	}
	action, matched := uint32(unix.SECCOMP_RET_ALLOW), false
	for _, r := range prof.Syscalls {
		if !slices.Contains(r.Names, name) {
			continue
		}
		ok, err := ruleMatches(r.Args, args)
		if err != nil {
			return 0, fmt.Errorf("%s: %w", name, err)
		}
		if !ok {
			continue
		}
		if r.Action != specs.ActErrno {
			return 0, fmt.Errorf("%s: action %s is not modelled", name, r.Action)
		}
		a := errnoAction(unix.EPERM)
		if r.ErrnoRet != nil {
			a = errnoAction(unix.Errno(*r.ErrnoRet))
		}
		if matched && a != action {
			return 0, fmt.Errorf("%s%#x: rules with actions %#x and %#x both match", name, args, action, a)
		}
		action, matched = a, true
	}
	return action, nil
}

func ruleMatches(conds []specs.LinuxSeccompArg, args [6]uint64) (bool, error) {
	var perArg [6]int
	for _, c := range conds {
		if c.Index >= 6 {
			return false, fmt.Errorf("argument index %d", c.Index)
		}
		perArg[c.Index]++
	}
	split := slices.ContainsFunc(perArg[:], func(n int) bool { return n > 1 })
	all, some := true, false
	for _, c := range conds {
		a := args[c.Index]
		var m bool
		switch c.Op {
		case specs.OpEqualTo:
			m = a == c.Value
		case specs.OpNotEqual:
			m = a != c.Value
		case specs.OpLessThan:
			m = a < c.Value
		case specs.OpLessEqual:
			m = a <= c.Value
		case specs.OpGreaterThan:
			m = a > c.Value
		case specs.OpGreaterEqual:
			m = a >= c.Value
		case specs.OpMaskedEqual:
			m = a&c.Value == c.ValueTwo
		default:
			return false, fmt.Errorf("operator %s", c.Op)
		}
		all, some = all && m, some || m
	}
	if split {
		return some, nil
	}
	return all, nil
}

// runFilter runs prog, as the kernel would, on a native x86_64 call; it
// knows only the instructions seccompBPF emits. compared, if not nil, is
// told of each conditional jump: the offset last loaded and the constant.
func runFilter(prog []unix.SockFilter, nr uint32, args [6]uint64, compared func(off, k uint32)) (uint32, error) {
	var data [64]byte // struct seccomp_data
	binary.LittleEndian.PutUint32(data[offNr:], nr)
	binary.LittleEndian.PutUint32(data[offArch:], unix.AUDIT_ARCH_X86_64)
	for i, a := range args {
		binary.LittleEndian.PutUint64(data[argLow(i):], a)
	}
	var acc, loaded uint32
	for pc := 0; pc < len(prog); pc++ {
		f := prog[pc]
		switch f.Code {
		case unix.BPF_LD | unix.BPF_W | unix.BPF_ABS:
			if f.K%4 != 0 || f.K >= uint32(len(data)) {
				return 0, fmt.Errorf("pc %d: load at %d", pc, f.K)
			}
			acc, loaded = binary.LittleEndian.Uint32(data[f.K:]), f.K
		case unix.BPF_JMP | unix.BPF_JA:
			pc += int(f.K)
		case unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, unix.BPF_JMP | unix.BPF_JGT | unix.BPF_K,
			unix.BPF_JMP | unix.BPF_JGE | unix.BPF_K, unix.BPF_JMP | unix.BPF_JSET | unix.BPF_K:
			if compared != nil {
				compared(loaded, f.K)
			}
			var m bool
			switch f.Code &^ (unix.BPF_JMP | unix.BPF_K) {
			case unix.BPF_JEQ:
				m = acc == f.K
			case unix.BPF_JGT:
				m = acc > f.K
			case unix.BPF_JGE:
				m = acc >= f.K
			case unix.BPF_JSET:
				m = acc&f.K != 0
			}
			if m {
				pc += int(f.Jt)
			} else {
				pc += int(f.Jf)
			}
		case unix.BPF_RET | unix.BPF_K:
			return f.K, nil
		default:
			return 0, fmt.Errorf("pc %d: instruction %#x", pc, f.Code)
		}
	}
	return 0, errors.New("ran past the end")
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
