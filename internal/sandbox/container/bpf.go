package container

import (
	"encoding/base64"
	"encoding/binary"
	"fmt"
	"runtime"

	"golang.org/x/sys/unix"
)

// The seccomp profile of seccomp.go compiled to a classic BPF program, for
// processes the exec helper starts (the runtime compiles the same profile
// with libseccomp for the sandbox's init). Compiled once per edge.
//
// The program accepts only the native x86_64 ABI: an x32 syscall gets
// ENOSYS and a 32-bit (i386) syscall kills the process. The compat entry
// points are a large, separately maintained part of the kernel that agent
// workloads do not need; closing them is simpler and stricter than
// filtering a second syscall table.

// seccompData offsets (struct seccomp_data: nr, arch, ip, args[6]); the
// low 32 bits of args[i] are at argLow(i) on little-endian machines, the
// high 32 at argHigh(i).
const (
	offNr   = 0
	offArch = 4
)

func argLow(i int) uint32  { return 16 + 8*uint32(i) }
func argHigh(i int) uint32 { return argLow(i) + 4 }

// x32SyscallBit marks an x32 syscall number on x86_64.
const x32SyscallBit = 0x40000000

// syscallNumbers maps the profile's names to x86_64 numbers. Names the
// architecture does not have (umount, which x86_64 only has as umount2)
// are absent and skipped, as libseccomp does.
var syscallNumbers = map[string]uint32{
	"clone": unix.SYS_CLONE, "clone3": unix.SYS_CLONE3, "unshare": unix.SYS_UNSHARE,
	"ioctl": unix.SYS_IOCTL, "socket": unix.SYS_SOCKET, "socketpair": unix.SYS_SOCKETPAIR,
	"mount": unix.SYS_MOUNT, "umount2": unix.SYS_UMOUNT2, "pivot_root": unix.SYS_PIVOT_ROOT,
	"fsopen": unix.SYS_FSOPEN, "fsconfig": unix.SYS_FSCONFIG, "fsmount": unix.SYS_FSMOUNT,
	"move_mount": unix.SYS_MOVE_MOUNT, "open_tree": unix.SYS_OPEN_TREE, "fspick": unix.SYS_FSPICK,
	"mount_setattr": unix.SYS_MOUNT_SETATTR, "setns": unix.SYS_SETNS,
	"ptrace": unix.SYS_PTRACE, "process_vm_readv": unix.SYS_PROCESS_VM_READV,
	"process_vm_writev": unix.SYS_PROCESS_VM_WRITEV, "bpf": unix.SYS_BPF,
	"perf_event_open": unix.SYS_PERF_EVENT_OPEN, "lookup_dcookie": unix.SYS_LOOKUP_DCOOKIE,
	"syslog": unix.SYS_SYSLOG, "init_module": unix.SYS_INIT_MODULE,
	"finit_module": unix.SYS_FINIT_MODULE, "delete_module": unix.SYS_DELETE_MODULE,
	"kexec_load": unix.SYS_KEXEC_LOAD, "kexec_file_load": unix.SYS_KEXEC_FILE_LOAD,
	"keyctl": unix.SYS_KEYCTL, "add_key": unix.SYS_ADD_KEY, "request_key": unix.SYS_REQUEST_KEY,
	"open_by_handle_at": unix.SYS_OPEN_BY_HANDLE_AT, "name_to_handle_at": unix.SYS_NAME_TO_HANDLE_AT,
	"userfaultfd": unix.SYS_USERFAULTFD, "reboot": unix.SYS_REBOOT, "swapon": unix.SYS_SWAPON,
	"swapoff": unix.SYS_SWAPOFF, "acct": unix.SYS_ACCT, "settimeofday": unix.SYS_SETTIMEOFDAY,
	"clock_settime": unix.SYS_CLOCK_SETTIME, "clock_adjtime": unix.SYS_CLOCK_ADJTIME,
	"adjtimex": unix.SYS_ADJTIMEX, "iopl": unix.SYS_IOPL, "ioperm": unix.SYS_IOPERM,
	"quotactl": unix.SYS_QUOTACTL, "quotactl_fd": unix.SYS_QUOTACTL_FD, "vhangup": unix.SYS_VHANGUP,
	"nfsservctl": unix.SYS_NFSSERVCTL, "uselib": unix.SYS_USELIB,
	"io_uring_setup": unix.SYS_IO_URING_SETUP, "io_uring_enter": unix.SYS_IO_URING_ENTER,
	"io_uring_register": unix.SYS_IO_URING_REGISTER,
}

// bpfProgram is a classic BPF program under construction.
type bpfProgram []unix.SockFilter

func (p *bpfProgram) stmt(code uint16, k uint32) {
	*p = append(*p, unix.SockFilter{Code: code, K: k})
}

func (p *bpfProgram) jump(code uint16, k uint32, jt, jf uint8) {
	*p = append(*p, unix.SockFilter{Code: code, Jt: jt, Jf: jf, K: k})
}

func (p *bpfProgram) load(off uint32)   { p.stmt(unix.BPF_LD|unix.BPF_W|unix.BPF_ABS, off) }
func (p *bpfProgram) ret(action uint32) { p.stmt(unix.BPF_RET|unix.BPF_K, action) }

// skipUnlessEq: if A == k fall through, else skip the next n instructions.
func (p *bpfProgram) skipUnlessEq(k uint32, n int) {
	p.jump(unix.BPF_JMP|unix.BPF_JEQ|unix.BPF_K, k, 0, uint8(n))
}

func errnoAction(e unix.Errno) uint32 {
	return unix.SECCOMP_RET_ERRNO | uint32(e)&unix.SECCOMP_RET_DATA
}

// refuseOutside returns errno e unless argument i is one of allowed, and
// falls through when it is. Like the profile's rules (seccomp.go's
// refuseOutside) it compares all 64 bits: an upper half that is not zero
// is refused.
func (p *bpfProgram) refuseOutside(i int, allowed []uint64, e unix.Errno) {
	n := len(allowed)
	p.load(argHigh(i))
	p.jump(unix.BPF_JMP|unix.BPF_JEQ|unix.BPF_K, 0, 0, uint8(n+1)) // to the ret
	p.load(argLow(i))
	for j, v := range allowed {
		p.jump(unix.BPF_JMP|unix.BPF_JEQ|unix.BPF_K, uint32(v), uint8(n-j), 0) // past the ret
	}
	p.ret(errnoAction(e))
}

// block appends body as the rules of syscall nr: skipped for any other
// syscall, and followed by a reload of the number for the next block.
func (p *bpfProgram) block(nr uint32, body bpfProgram) {
	p.skipUnlessEq(nr, len(body)+1)
	*p = append(*p, body...)
	p.load(offNr)
}

// seccompBPF compiles the profile. Each rule is a self-contained block that
// reloads what it tests, so blocks never jump more than a few instructions.
func seccompBPF() ([]unix.SockFilter, error) {
	if runtime.GOARCH != "amd64" {
		return nil, fmt.Errorf("seccomp BPF: only amd64 is supported, not %s", runtime.GOARCH)
	}
	eperm, enosys := errnoAction(unix.EPERM), errnoAction(unix.ENOSYS)
	var p bpfProgram
	p.load(offArch)
	p.skipUnlessEq(unix.AUDIT_ARCH_X86_64, 1)
	p.jump(unix.BPF_JMP|unix.BPF_JA, 1, 0, 0) // native: go on
	p.ret(unix.SECCOMP_RET_KILL_PROCESS)
	p.load(offNr)
	p.jump(unix.BPF_JMP|unix.BPF_JGE|unix.BPF_K, x32SyscallBit, 0, 1)
	p.ret(enosys)
	for _, name := range deniedSyscalls {
		nr, ok := syscallNumbers[name]
		if !ok {
			continue
		}
		p.skipUnlessEq(nr, 1)
		p.ret(eperm)
	}
	p.skipUnlessEq(unix.SYS_CLONE3, 1)
	p.ret(enosys)
	// clone: refuse a new user namespace (flags are argument 0).
	p.skipUnlessEq(unix.SYS_CLONE, 3)
	p.load(argLow(0))
	p.jump(unix.BPF_JMP|unix.BPF_JSET|unix.BPF_K, unix.CLONE_NEWUSER, 0, 1)
	p.ret(eperm)
	p.load(offNr)
	// unshare: refuse every namespace flag.
	var nsMask uint32
	for _, f := range namespaceFlags {
		nsMask |= uint32(f)
	}
	p.skipUnlessEq(unix.SYS_UNSHARE, 3)
	p.load(argLow(0))
	p.jump(unix.BPF_JMP|unix.BPF_JSET|unix.BPF_K, nsMask, 0, 1)
	p.ret(eperm)
	p.load(offNr)
	// ioctl: the kernel reads only the low 32 bits of the request.
	reqs := dangerousIoctls
	p.skipUnlessEq(unix.SYS_IOCTL, 2+2*len(reqs))
	p.load(argLow(1))
	for _, req := range reqs {
		p.skipUnlessEq(req, 1)
		p.ret(eperm)
	}
	p.load(offNr)
	// socket: an allowed family, and for netlink an allowed protocol
	// (argument 2); socketpair: an allowed family.
	var sock, netlink, pair bpfProgram
	netlink.refuseOutside(2, netlinkProtocols, errProtocol)
	sock.refuseOutside(0, socketFamilies, errFamily)
	sock.load(argLow(0))
	sock.skipUnlessEq(unix.AF_NETLINK, len(netlink))
	sock = append(sock, netlink...)
	p.block(unix.SYS_SOCKET, sock)
	pair.refuseOutside(0, socketpairFamilies, errFamily)
	p.block(unix.SYS_SOCKETPAIR, pair)
	p.ret(unix.SECCOMP_RET_ALLOW)
	return p, nil
}

// encodeFilter returns the program as base64 of its raw struct sock_filter
// array (little-endian), the form crun's run.oci.seccomp_bpf_data takes.
func encodeFilter(prog []unix.SockFilter) string {
	b := make([]byte, 0, 8*len(prog))
	for _, f := range prog {
		b = binary.LittleEndian.AppendUint16(b, f.Code)
		b = append(b, f.Jt, f.Jf)
		b = binary.LittleEndian.AppendUint32(b, f.K)
	}
	return base64.StdEncoding.EncodeToString(b)
}

// SeccompFilterBase64 returns the profile compiled to classic BPF, the
// raw sock_filter array base64-encoded (for a backend that installs it
// inside the sandbox itself).
func SeccompFilterBase64() (string, error) {
	prog, err := seccompBPF()
	if err != nil {
		return "", err
	}
	return encodeFilter(prog), nil
}
