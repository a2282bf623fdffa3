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
// second, independent wall. The runtime compiles it (libseccomp).

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
const (
	ioctlXFSSwapExt   = 0xC0C0586D // _IOWR('X', 109, struct xfs_swapext)
	ioctlFSSetFlags   = 0x40086602 // _IOW('f', 2, long): chattr +i/+a
	ioctlFSSetFlags32 = 0x40046602 // _IOW('f', 2, int)
	ioctlFSSetXattr   = 0x401C5820 // _IOW('X', 32, struct fsxattr)
)

var dangerousIoctls = []uint32{ioctlXFSSwapExt, ioctlFSSetFlags, ioctlFSSetFlags32, ioctlFSSetXattr}

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
	return &specs.LinuxSeccomp{
		DefaultAction: specs.ActAllow,
		Architectures: []specs.Arch{specs.ArchX86_64, specs.ArchX86, specs.ArchX32},
		Syscalls:      rules,
	}
}
