package container

import (
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"
)

// The seccomp profile of every process in a sandbox: allow by default, and
// refuse with EPERM what reaches the kernel's attack surface or the host:
// mounts, new namespaces (user namespaces above all), ptrace, bpf, perf,
// module loading, kexec, keyrings, handle-based opens, userfaultfd, reboot,
// swap, the kernel log, the clock, raw I/O ports, quotas, and ioctls that
// swap file extents or set immutable flags (DSEC-FACTS.md §7: an agent used
// XFS_IOC_SWAPEXT to read protected data and corrupted XFS). Most of these
// also need capabilities the sandbox does not have; the filter is the
// second, independent wall. Sockets are the exception to "allow by
// default": socket(2) and socketpair(2) open only the families and netlink
// protocols on the allow lists below. The runtime compiles the profile
// (libseccomp); bpf.go compiles the same rules for dsec's own launcher and
// exec helper.

// deniedSyscalls are refused outright.
var deniedSyscalls = []string{
	// mounts, old and new API
	"mount", "umount", "umount2", "pivot_root", "fsopen", "fsconfig", "fsmount",
	"move_mount", "open_tree", "fspick", "mount_setattr",
	// entering other namespaces
	"setns",
	// other processes' memory
	"ptrace", "process_vm_readv", "process_vm_writev",
	// kernel programmability and observability
	"bpf", "perf_event_open", "lookup_dcookie", "syslog",
	// kernel code
	"init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
	// keyrings (not namespaced)
	"keyctl", "add_key", "request_key",
	// file handles bypass path checks
	"open_by_handle_at", "name_to_handle_at",
	"userfaultfd",
	// the machine itself
	"reboot", "swapon", "swapoff", "acct", "settimeofday", "clock_settime",
	"clock_adjtime", "adjtimex", "iopl", "ioperm", "quotactl", "quotactl_fd",
	"vhangup", "nfsservctl", "uselib",
	// io_uring bypasses this filter (its operations are not syscalls) and
	// has been a steady source of kernel exploits; programs fall back.
	"io_uring_setup", "io_uring_enter", "io_uring_register",
}

// Namespace flags of clone(2)/unshare(2).
var namespaceFlags = []uint64{
	unix.CLONE_NEWUSER, unix.CLONE_NEWNS, unix.CLONE_NEWPID, unix.CLONE_NEWNET,
	unix.CLONE_NEWIPC, unix.CLONE_NEWUTS, unix.CLONE_NEWCGROUP, unix.CLONE_NEWTIME,
}

// Dangerous ioctl requests (the request is argument 1).
//
// The last three tell where files lie on the host's disk: FIEMAP and
// FIBMAP map a file's extents or blocks to physical offsets (a sandbox's
// files are the host's, through the overlay's upper and the bind mounts),
// and GETFSMAP maps the whole filesystem, every owner's extents. That is
// the host's layout, and the map a rowhammer or disk-side attack needs.
// FIBMAP also needs CAP_SYS_RAWIO, which sandboxes lack; its request, 1,
// is refused on every fd, and no device a sandbox opens uses it for
// anything else. cp (coreutils before 9.0) tries FIEMAP for sparse files
// and copies plainly when it fails; filefrag and xfs_io fiemap fail.
const (
	ioctlXFSSwapExt   = 0xC0C0586D // _IOWR('X', 109, struct xfs_swapext)
	ioctlFSSetFlags   = 0x40086602 // _IOW('f', 2, long): chattr +i/+a
	ioctlFSSetFlags32 = 0x40046602 // _IOW('f', 2, int)
	ioctlFSSetXattr   = 0x401C5820 // _IOW('X', 32, struct fsxattr)
	ioctlFIEMAP       = 0xC020660B // _IOWR('f', 11, struct fiemap)
	ioctlFIBMAP       = 0x00000001 // _IO(0x00, 1)
	ioctlGetFSMap     = 0xC0C0583B // _IOWR('X', 59, struct fsmap_head)
)

var dangerousIoctls = []uint32{
	ioctlXFSSwapExt, ioctlFSSetFlags, ioctlFSSetFlags32, ioctlFSSetXattr,
	ioctlFIEMAP, ioctlFIBMAP, ioctlGetFSMap,
}

// What a sandbox may open sockets of: an allow list, because each address
// family and netlink protocol is kernel code that socket(2) reaches, and
// several are not confined by the network namespace: AF_VSOCK binds ports
// in the host's one vsock space and reaches the hypervisor, the uevent
// protocol carries the host's device events (to sandboxes without a user
// namespace), and NETLINK_AUDIT writes records into the host's audit log
// (sandboxes hold CAP_AUDIT_WRITE). A sandbox needs Unix, IPv4 and IPv6
// sockets, and netlink's routing protocol (getifaddrs, getaddrinfo's
// AI_ADDRCONFIG, ip) and sock_diag (ss). Each list is sorted ascending, as
// refuseOutside needs.
var (
	socketFamilies     = []uint64{unix.AF_UNIX, unix.AF_INET, unix.AF_INET6, unix.AF_NETLINK}
	netlinkProtocols   = []uint64{unix.NETLINK_ROUTE, unix.NETLINK_SOCK_DIAG}
	socketpairFamilies = []uint64{unix.AF_UNIX}
)

// A refused family gets EAFNOSUPPORT and a refused netlink protocol
// EPROTONOSUPPORT: what the kernel answers when it is built without them
// (__sock_create, netlink_create), which programs already take as "not
// here" and go on. EPERM would not do: shadow's useradd, usermod and
// passwd (and libuser) ignore an audit_open() that fails with EINVAL,
// EPROTONOSUPPORT or EAFNOSUPPORT and abort on any other errno.
const (
	errFamily   = unix.EAFNOSUPPORT
	errProtocol = unix.EPROTONOSUPPORT
)

// refuseOutside returns the rules refusing syscall name, with errno e,
// when argument i is not one of allowed (sorted ascending, not empty): an
// OpEqualTo rule per value in a gap of the list and an OpGreaterThan rule
// above its last value, each rule also holding the comparisons of also.
// One comparison of argument i per rule, because runc and crun AND the
// comparisons of a rule only when they are on different arguments: two on
// the same argument become two rules, ORed, so "x > 2 && x < 10" cannot be
// written as one.
//
// The comparisons are on all 64 bits, and the kernel reads only the low 32
// of these int arguments, so the OpGreaterThan rule refuses any value with
// an upper bit set, even one whose low half is allowed. Refusing
// 0x1_0000_0001 (AF_UNIX to the kernel) is stricter than needed; matching
// the kernel exactly would take masked rules for each upper bit (libseccomp
// has no 32-bit ranges), about a hundred of them. Compilers and libcs
// pass these ints zero-extended in practice, and a negative one,
// sign-extended, is a family or protocol the kernel refuses with the same
// errno.
func refuseOutside(name string, i uint, allowed []uint64, e unix.Errno, also ...specs.LinuxSeccompArg) []specs.LinuxSyscall {
	errno := uint(e)
	rule := func(a specs.LinuxSeccompArg) specs.LinuxSyscall {
		return specs.LinuxSyscall{Names: []string{name}, Action: specs.ActErrno, ErrnoRet: &errno,
			Args: append(append([]specs.LinuxSeccompArg(nil), also...), a)}
	}
	var rules []specs.LinuxSyscall
	next := uint64(0)
	for _, v := range allowed {
		for ; next < v; next++ {
			rules = append(rules, rule(specs.LinuxSeccompArg{Index: i, Value: next, Op: specs.OpEqualTo}))
		}
		next = v + 1
	}
	return append(rules, rule(specs.LinuxSeccompArg{Index: i, Value: next - 1, Op: specs.OpGreaterThan}))
}

// socketRules: socket's family is argument 0 and its protocol argument 2
// (argument 1, the type, may carry SOCK_NONBLOCK|SOCK_CLOEXEC and is not
// looked at); socketpair's family is argument 0.
func socketRules() []specs.LinuxSyscall {
	rules := refuseOutside("socket", 0, socketFamilies, errFamily)
	rules = append(rules, refuseOutside("socket", 2, netlinkProtocols, errProtocol,
		specs.LinuxSeccompArg{Index: 0, Value: unix.AF_NETLINK, Op: specs.OpEqualTo})...)
	return append(rules, refuseOutside("socketpair", 0, socketpairFamilies, errFamily)...)
}

func seccompProfile() *specs.LinuxSeccomp {
	eperm := uint(unix.EPERM)
	enosys := uint(unix.ENOSYS)
	rules := []specs.LinuxSyscall{
		{Names: deniedSyscalls, Action: specs.ActErrno, ErrnoRet: &eperm},
		// clone3 passes its flags in memory the filter cannot read: make
		// libc fall back to clone, whose flags it can.
		{Names: []string{"clone3"}, Action: specs.ActErrno, ErrnoRet: &enosys},
		// A user namespace would give root-like capabilities over new
		// namespaces (mounts, networks): refuse it in clone; unshare may
		// create no namespace at all.
		{Names: []string{"clone"}, Action: specs.ActErrno, ErrnoRet: &eperm,
			Args: []specs.LinuxSeccompArg{{Index: 0, Value: unix.CLONE_NEWUSER, ValueTwo: unix.CLONE_NEWUSER, Op: specs.OpMaskedEqual}}},
	}
	for _, f := range namespaceFlags {
		rules = append(rules, specs.LinuxSyscall{Names: []string{"unshare"}, Action: specs.ActErrno, ErrnoRet: &eperm,
			Args: []specs.LinuxSeccompArg{{Index: 0, Value: f, ValueTwo: f, Op: specs.OpMaskedEqual}}})
	}
	// The kernel keeps only the low 32 bits of an ioctl request, so the
	// comparison must too: with OpEqualTo a request with junk in the high
	// bits would pass the filter and still reach the ioctl.
	for _, req := range dangerousIoctls {
		rules = append(rules, specs.LinuxSyscall{Names: []string{"ioctl"}, Action: specs.ActErrno, ErrnoRet: &eperm,
			Args: []specs.LinuxSeccompArg{{Index: 1, Value: 0xFFFFFFFF, ValueTwo: uint64(req), Op: specs.OpMaskedEqual}}})
	}
	rules = append(rules, socketRules()...)
	return &specs.LinuxSeccomp{
		DefaultAction: specs.ActAllow,
		Architectures: []specs.Arch{specs.ArchX86_64, specs.ArchX86, specs.ArchX32},
		Syscalls:      rules,
	}
}
