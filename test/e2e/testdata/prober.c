/*
 * prober: tries, from inside a sandbox, the kernel operations an untrusted
 * root must not be able to perform (DSEC-FACTS.md §7, incidents 4 and 7), and
 * prints one line per attempt:
 *
 *   NAME ok [detail]
 *   NAME errno=<n> <strerror>
 *   NAME signal=<n> <strsignal>     (the attempt was killed, e.g. SIGSYS)
 *
 * Each attempt runs in its own forked child, so one that succeeds (a new
 * user namespace, say) cannot change the conditions of the next one.
 * Syscalls go through syscall(2) so that no libc wrapper hides or emulates
 * anything. Build: gcc -static -O1 -o prober prober.c
 *
 * Other modes:
 *   prober whoami        print the real/effective ids and CapEff, try setuid(0)
 *   prober setcap FILE   give FILE file capabilities (CAP_DAC_OVERRIDE,
 *                        CAP_SETUID, effective) through security.capability
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/time.h>
#include <sys/timex.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <sys/xattr.h>
#include <time.h>
#include <unistd.h>

/* ---- constants, defined here so that old headers do not matter ---- */
#define P_CLONE_NEWNS 0x00020000UL
#define P_CLONE_NEWUSER 0x10000000UL
#define P_MNT_DETACH 2
#define P_OPEN_TREE_CLONE 1
#define P_MOUNT_ATTR_NOSUID 0x00000002ULL
#define P_PTRACE_ATTACH 16
#define P_PTRACE_DETACH 17
#define P_KEYCTL_GET_KEYRING_ID 0
#define P_KEY_SPEC_PROCESS_KEYRING (-2)
#define P_KEY_SPEC_SESSION_KEYRING (-3)
#define P_UFFD_USER_MODE_ONLY 1
#define P_LINUX_REBOOT_MAGIC1 0xfee1deadUL
#define P_LINUX_REBOOT_MAGIC2 672274793UL
#define P_LINUX_REBOOT_CMD_CAD_OFF 0UL
#define P_SYSLOG_ACTION_READ_ALL 3
#define P_Q_SYNC 0x800001U
#define P_USRQUOTA 0
#define P_QCMD(cmd, type) (((cmd) << 8) | ((type)&0xff))
#define P_BPF_MAP_CREATE 0
#define P_BPF_PROG_LOAD 5
#define P_BPF_MAP_TYPE_ARRAY 2
#define P_BPF_PROG_TYPE_SOCKET_FILTER 1
#define P_PERF_TYPE_SOFTWARE 1
#define P_PERF_COUNT_SW_CPU_CLOCK 0
#define P_X32_SYSCALL_BIT 0x40000000L

/* Address families and netlink protocols (<linux/socket.h>, <linux/netlink.h>). */
#define P_AF_UNIX 1
#define P_AF_INET 2
#define P_AF_INET6 10
#define P_AF_KEY 15
#define P_AF_NETLINK 16
#define P_AF_PACKET 17
#define P_AF_ALG 38
#define P_AF_VSOCK 40
#define P_AF_XDP 44
#define P_NETLINK_ROUTE 0
#define P_NETLINK_SOCK_DIAG 4
#define P_NETLINK_XFRM 6
#define P_NETLINK_AUDIT 9
#define P_NETLINK_NETFILTER 12
#define P_NETLINK_KOBJECT_UEVENT 15
#define P_NETLINK_GENERIC 16
#define P_SOCK_STREAM 1
#define P_SOCK_DGRAM 2
#define P_SOCK_RAW 3
#define P_SOCK_SEQPACKET 5
#define P_SOCK_NONBLOCK 04000
#define P_SOCK_CLOEXEC 02000000
#define P_SYS_SOCKET 1 /* socketcall(2) call numbers */
/* An upper-half bit in an int argument: the kernel reads the low 32 bits. */
#define P_HIGH32 0x100000000L

#define P_FS_IMMUTABLE_FL 0x00000010
#define P_FS_NOATIME_FL 0x00000080
#define P_FS_XFLAG_IMMUTABLE 0x00000008
#define P_FS_XFLAG_NOATIME 0x00000040

#define P_IOC(dir, type, nr, size) \
	(((unsigned long)(dir) << 30) | ((unsigned long)(size) << 16) | ((unsigned long)(type) << 8) | (unsigned long)(nr))
#define P_IOW(type, nr, size) P_IOC(1, type, nr, size)
#define P_IOWR(type, nr, size) P_IOC(3, type, nr, size)

/* The kernel's struct xfs_bstat / xfs_swapext (fs/xfs/libxfs/xfs_fs.h);
 * <xfs/xfs_fs.h> is not installed here. */
struct p_xfs_bstime {
	long tv_sec;
	int32_t tv_nsec;
};
struct p_xfs_bstat {
	uint64_t bs_ino;
	uint16_t bs_mode, bs_nlink;
	uint32_t bs_uid, bs_gid, bs_rdev;
	int32_t bs_blksize;
	int64_t bs_size;
	struct p_xfs_bstime bs_atime, bs_mtime, bs_ctime;
	int64_t bs_blocks;
	uint32_t bs_xflags;
	int32_t bs_extsize, bs_extents;
	uint32_t bs_gen;
	uint16_t bs_projid_lo, bs_forkoff, bs_projid_hi, bs_sick, bs_checked;
	unsigned char bs_pad[2];
	uint32_t bs_cowextsize, bs_dmevmask;
	uint16_t bs_dmstate, bs_aextents;
};
struct p_xfs_swapext {
	int64_t sx_version, sx_fdtarget, sx_fdtmp, sx_offset, sx_length;
	char sx_pad[16];
	struct p_xfs_bstat sx_stat;
};
#define P_XFS_IOC_SWAPEXT P_IOWR('X', 109, sizeof(struct p_xfs_swapext))
_Static_assert(sizeof(struct p_xfs_swapext) == 192, "xfs_swapext layout");
_Static_assert(P_XFS_IOC_SWAPEXT == 0xc0c0586dUL, "XFS_IOC_SWAPEXT value");

struct p_fsxattr {
	uint32_t fsx_xflags, fsx_extsize, fsx_nextents, fsx_projid, fsx_cowextsize;
	unsigned char fsx_pad[8];
};
#define P_FS_IOC_SETFLAGS P_IOW('f', 2, sizeof(long))
#define P_FS_IOC32_SETFLAGS P_IOW('f', 2, sizeof(int))
#define P_FS_IOC_FSSETXATTR P_IOW('X', 32, sizeof(struct p_fsxattr))
_Static_assert(P_FS_IOC_SETFLAGS == 0x40086602UL, "FS_IOC_SETFLAGS value");
_Static_assert(P_FS_IOC_FSSETXATTR == 0x401c5820UL, "FS_IOC_FSSETXATTR value");

/* Where a file lies on the disk (struct fiemap is 32 bytes, struct
 * fsmap_head 192): the profile refuses all three. */
#define P_FS_IOC_FIEMAP P_IOWR('f', 11, 32)
#define P_FIBMAP 1UL
#define P_FS_IOC_GETFSMAP P_IOWR('X', 59, 192)
_Static_assert(P_FS_IOC_FIEMAP == 0xc020660bUL, "FS_IOC_FIEMAP value");
_Static_assert(P_FS_IOC_GETFSMAP == 0xc0c0583bUL, "FS_IOC_GETFSMAP value");

/* Upper 32 bits set: the kernel's ioctl takes `unsigned int cmd` and drops
 * them, a seccomp rule comparing all 64 bits does not. */
#define HIBITS 0xffffffff00000000UL

/* i386 syscall numbers, used through int $0x80 from this 64-bit process. */
#define I386_MOUNT 21
#define I386_PTRACE 26
#define I386_IOCTL 54
#define I386_UNSHARE 310
#define I386_SOCKETCALL 102
#define I386_SOCKET 359

/* ---- helpers ---- */

/* A probe returns 0 on success (detail may be filled) or -1 with errno. */
typedef int (*probe_fn)(char *detail, size_t n);

static volatile uint64_t g_word = 0x70726f6265720a00ULL; /* target of process_vm_* */
static unsigned int g_flags32;                        /* below 4 GiB: static, non-PIE */
static unsigned int g_sockargs[3];                    /* socketcall's arguments, likewise */

static void emit(const char *line)
{
	/* One write per line: lines stay whole even if something else writes. */
	size_t len = strlen(line);
	while (len > 0) {
		ssize_t w = write(1, line, len);
		if (w <= 0)
			return;
		line += w;
		len -= (size_t)w;
	}
}

static void run(const char *name, probe_fn fn)
{
	char line[512];
	fflush(stdout);
	pid_t pid = fork();
	if (pid < 0) {
		snprintf(line, sizeof line, "%s errno=%d fork: %s\n", name, errno, strerror(errno));
		emit(line);
		return;
	}
	if (pid == 0) {
		char detail[256] = "";
		alarm(10);
		errno = 0;
		int r = fn(detail, sizeof detail);
		if (r == 0)
			snprintf(line, sizeof line, "%s ok%s%s\n", name, detail[0] ? " " : "", detail);
		else
			snprintf(line, sizeof line, "%s errno=%d %s%s%s\n", name, errno, strerror(errno),
				 detail[0] ? " " : "", detail);
		emit(line);
		syscall(SYS_exit_group, 0);
	}
	int st;
	while (waitpid(pid, &st, __WALL) < 0 && errno == EINTR)
		;
	if (WIFSIGNALED(st)) {
		snprintf(line, sizeof line, "%s signal=%d %s\n", name, WTERMSIG(st), strsignal(WTERMSIG(st)));
		emit(line);
	}
}

/* sys wraps a raw syscall result: -1/errno on failure, 0 otherwise. */
static int sys(long r)
{
	return r < 0 ? -1 : 0;
}

/* A child that only waits to be killed: the target of the ptrace-family
 * probes (it runs this very binary, so g_word is at the same address). */
static pid_t sleeper(void)
{
	pid_t pid = fork();
	if (pid == 0) {
		for (;;)
			pause();
	}
	return pid;
}

static void reap(pid_t pid)
{
	if (pid > 0) {
		kill(pid, SIGKILL);
		waitpid(pid, NULL, __WALL);
	}
}

static long int80(long nr, long a, long b, long c)
{
	long ret;
	__asm__ volatile("int $0x80"
			 : "=a"(ret)
			 : "a"(nr), "b"(a), "c"(b), "d"(c)
			 : "memory", "r8", "r9", "r10", "r11");
	return ret;
}

/* int80ret turns an int $0x80 result (negative errno in eax) into -1/errno. */
static int int80ret(long r)
{
	int v = (int)r;
	if (v < 0 && v > -4096) {
		errno = -v;
		return -1;
	}
	return 0;
}

static int tmpfile_fd(void)
{
	char path[64];
	snprintf(path, sizeof path, "/tmp/prober-ioctl-%d", (int)getpid());
	int fd = open(path, O_CREAT | O_RDWR | O_TRUNC, 0644);
	if (fd >= 0)
		unlink(path);
	return fd;
}

/* ---- mount family ---- */

static int p_mount_tmpfs(char *d, size_t n)
{
	mkdir("/mnt", 0755);
	if (sys(syscall(SYS_mount, "none", "/mnt", "tmpfs", 0UL, NULL)) < 0)
		return -1;
	syscall(SYS_umount2, "/mnt", P_MNT_DETACH);
	return 0;
}

static int p_umount_kcore_mask(char *d, size_t n)
{
	return sys(syscall(SYS_umount2, "/proc/kcore", P_MNT_DETACH));
}

static int p_umount_proc(char *d, size_t n)
{
	return sys(syscall(SYS_umount2, "/proc", P_MNT_DETACH));
}

static int p_fsopen(char *d, size_t n)
{
	return sys(syscall(SYS_fsopen, "tmpfs", 0));
}

static int p_fsmount(char *d, size_t n)
{
	return sys(syscall(SYS_fsmount, -1, 0, 0));
}

static int p_move_mount(char *d, size_t n)
{
	mkdir("/mnt", 0755);
	return sys(syscall(SYS_move_mount, AT_FDCWD, "/tmp", AT_FDCWD, "/mnt", 0));
}

static int p_open_tree(char *d, size_t n)
{
	return sys(syscall(SYS_open_tree, AT_FDCWD, "/", P_OPEN_TREE_CLONE));
}

static int p_fspick(char *d, size_t n)
{
	return sys(syscall(SYS_fspick, AT_FDCWD, "/", 0));
}

static int p_mount_setattr(char *d, size_t n)
{
	uint64_t attr[4] = {P_MOUNT_ATTR_NOSUID, 0, 0, 0}; /* attr_set, attr_clr, propagation, userns_fd */
	return sys(syscall(SYS_mount_setattr, AT_FDCWD, "/tmp", 0, attr, sizeof attr));
}

/* ---- namespaces ---- */

static int p_unshare_newuser(char *d, size_t n)
{
	return sys(syscall(SYS_unshare, P_CLONE_NEWUSER));
}

static int p_unshare_newns(char *d, size_t n)
{
	return sys(syscall(SYS_unshare, P_CLONE_NEWNS));
}

/* The real prize of a user namespace: full capabilities over a new mount
 * namespace, i.e. every filesystem the kernel lets users mount. */
static int p_unshare_userns_mount(char *d, size_t n)
{
	if (sys(syscall(SYS_unshare, P_CLONE_NEWUSER | P_CLONE_NEWNS)) < 0) {
		snprintf(d, n, "(unshare)");
		return -1;
	}
	if (sys(syscall(SYS_mount, "none", "/tmp", "tmpfs", 0UL, NULL)) < 0) {
		snprintf(d, n, "(unshare succeeded, mount failed)");
		return -1;
	}
	snprintf(d, n, "(unshare and tmpfs mount both succeeded)");
	return 0;
}

static int p_clone_newuser(char *d, size_t n)
{
	long pid = syscall(SYS_clone, P_CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0);
	if (pid < 0)
		return -1;
	if (pid == 0)
		syscall(SYS_exit_group, 0);
	waitpid((pid_t)pid, NULL, 0);
	return 0;
}

static int p_clone3_newuser(char *d, size_t n)
{
	/* struct clone_args, CLONE_ARGS_SIZE_VER0 (64 bytes) */
	uint64_t args[8] = {0};
	args[0] = P_CLONE_NEWUSER; /* flags */
	args[4] = SIGCHLD;         /* exit_signal */
	long pid = syscall(SYS_clone3, args, sizeof args);
	if (pid < 0)
		return -1;
	if (pid == 0)
		syscall(SYS_exit_group, 0);
	waitpid((pid_t)pid, NULL, 0);
	return 0;
}

static int p_setns_mnt(char *d, size_t n)
{
	int fd = open("/proc/1/ns/mnt", O_RDONLY);
	if (fd < 0) {
		snprintf(d, n, "(open /proc/1/ns/mnt)");
		return -1;
	}
	return sys(syscall(SYS_setns, fd, 0));
}

/* ---- ptrace family ---- */

static int p_ptrace_attach_init(char *d, size_t n)
{
	if (sys(syscall(SYS_ptrace, P_PTRACE_ATTACH, 1, 0, 0)) < 0)
		return -1;
	/* Do not leave the sandbox's init stopped. */
	waitpid(1, NULL, __WALL);
	syscall(SYS_ptrace, P_PTRACE_DETACH, 1, 0, 0);
	return 0;
}

/* Tracing one's own child needs no capability: only seccomp stops it. */
static int p_ptrace_attach_child(char *d, size_t n)
{
	pid_t c = sleeper();
	int r = sys(syscall(SYS_ptrace, P_PTRACE_ATTACH, c, 0, 0));
	int e = errno;
	reap(c);
	errno = e;
	return r;
}

static int p_process_vm_readv_init(char *d, size_t n)
{
	uint64_t buf = 0;
	struct iovec local = {&buf, sizeof buf}, remote = {(void *)&g_word, sizeof buf};
	return sys(syscall(SYS_process_vm_readv, 1, &local, 1, &remote, 1, 0));
}

static int p_process_vm_readv_child(char *d, size_t n)
{
	pid_t c = sleeper();
	uint64_t buf = 0;
	struct iovec local = {&buf, sizeof buf}, remote = {(void *)&g_word, sizeof buf};
	int r = sys(syscall(SYS_process_vm_readv, c, &local, 1, &remote, 1, 0));
	int e = errno;
	reap(c);
	errno = e;
	return r;
}

static int p_process_vm_writev_child(char *d, size_t n)
{
	pid_t c = sleeper();
	uint64_t buf = 1;
	struct iovec local = {&buf, sizeof buf}, remote = {(void *)&g_word, sizeof buf};
	int r = sys(syscall(SYS_process_vm_writev, c, &local, 1, &remote, 1, 0));
	int e = errno;
	reap(c);
	errno = e;
	return r;
}

/* ---- bpf, perf ---- */

static int p_bpf_map_create(char *d, size_t n)
{
	uint32_t attr[32] = {0}; /* union bpf_attr, map-create part */
	attr[0] = P_BPF_MAP_TYPE_ARRAY;
	attr[1] = 4; /* key_size */
	attr[2] = 4; /* value_size */
	attr[3] = 1; /* max_entries */
	return sys(syscall(SYS_bpf, P_BPF_MAP_CREATE, attr, sizeof attr));
}

static int p_bpf_prog_load(char *d, size_t n)
{
	/* r0 = 0; exit */
	static const uint64_t insns[2] = {0x00000000000000b7ULL, 0x0000000000000095ULL};
	static const char license[] = "GPL";
	uint64_t attr[16] = {0}; /* union bpf_attr, prog-load part */
	attr[0] = P_BPF_PROG_TYPE_SOCKET_FILTER | (2ULL << 32); /* prog_type, insn_cnt */
	attr[1] = (uint64_t)(uintptr_t)insns;
	attr[2] = (uint64_t)(uintptr_t)license;
	return sys(syscall(SYS_bpf, P_BPF_PROG_LOAD, attr, sizeof attr));
}

static int p_perf_event_open(char *d, size_t n)
{
	/* struct perf_event_attr, PERF_ATTR_SIZE_VER5 (112 bytes) */
	unsigned char attr[112] = {0};
	uint32_t type = P_PERF_TYPE_SOFTWARE, size = sizeof attr;
	uint64_t config = P_PERF_COUNT_SW_CPU_CLOCK;
	uint64_t bits = (1ULL << 0) /* disabled */ | (1ULL << 5) /* exclude_kernel */ | (1ULL << 6) /* exclude_hv */;
	memcpy(attr + 0, &type, 4);
	memcpy(attr + 4, &size, 4);
	memcpy(attr + 8, &config, 8);
	memcpy(attr + 40, &bits, 8);
	return sys(syscall(SYS_perf_event_open, attr, 0, -1, -1, 0));
}

/* ---- modules, kexec, reboot ---- */

static int p_init_module(char *d, size_t n)
{
	return sys(syscall(SYS_init_module, NULL, 0UL, ""));
}

static int p_finit_module(char *d, size_t n)
{
	return sys(syscall(SYS_finit_module, -1, "", 0));
}

static int p_delete_module(char *d, size_t n)
{
	return sys(syscall(SYS_delete_module, "x", 0));
}

static int p_kexec_load(char *d, size_t n)
{
	return sys(syscall(SYS_kexec_load, 0UL, 0UL, NULL, 0UL));
}

static int p_kexec_file_load(char *d, size_t n)
{
	return sys(syscall(SYS_kexec_file_load, -1, -1, 0UL, "", 0UL));
}

static int p_reboot_cad_off(char *d, size_t n)
{
	return sys(syscall(SYS_reboot, P_LINUX_REBOOT_MAGIC1, P_LINUX_REBOOT_MAGIC2, P_LINUX_REBOOT_CMD_CAD_OFF, NULL));
}

/* ---- keys ---- */

static int p_keyctl_get_session(char *d, size_t n)
{
	return sys(syscall(SYS_keyctl, P_KEYCTL_GET_KEYRING_ID, P_KEY_SPEC_SESSION_KEYRING, 0));
}

static int p_add_key(char *d, size_t n)
{
	return sys(syscall(SYS_add_key, "user", "x", "y", 1UL, P_KEY_SPEC_PROCESS_KEYRING));
}

static int p_request_key(char *d, size_t n)
{
	return sys(syscall(SYS_request_key, "user", "x", NULL, 0));
}

/* ---- handles, userfaultfd ---- */

static int p_name_to_handle_at(char *d, size_t n)
{
	struct {
		uint32_t handle_bytes;
		int32_t handle_type;
		unsigned char f_handle[128];
	} fh = {128, 0, {0}};
	int mount_id;
	return sys(syscall(SYS_name_to_handle_at, AT_FDCWD, "/", &fh, &mount_id, 0));
}

static int p_open_by_handle_at(char *d, size_t n)
{
	struct {
		uint32_t handle_bytes;
		int32_t handle_type;
		unsigned char f_handle[8];
	} fh = {8, 1, {0}};
	int root = open("/", O_RDONLY | O_DIRECTORY);
	if (root < 0) {
		snprintf(d, n, "(open /)");
		return -1;
	}
	return sys(syscall(SYS_open_by_handle_at, root, &fh, O_RDONLY));
}

static int p_userfaultfd(char *d, size_t n)
{
	return sys(syscall(SYS_userfaultfd, 0));
}

/* UFFD_USER_MODE_ONLY needs no capability: only seccomp stops it. */
static int p_userfaultfd_usermode(char *d, size_t n)
{
	return sys(syscall(SYS_userfaultfd, P_UFFD_USER_MODE_ONLY));
}

/* ---- swap, syslog, acct, time, io ports, quota ---- */

static int p_swapon(char *d, size_t n)
{
	return sys(syscall(SYS_swapon, "/nonexistent", 0));
}

static int p_swapoff(char *d, size_t n)
{
	return sys(syscall(SYS_swapoff, "/nonexistent"));
}

static int p_syslog_read_all(char *d, size_t n)
{
	static char buf[4096];
	long r = syscall(SYS_syslog, P_SYSLOG_ACTION_READ_ALL, buf, (long)sizeof buf);
	if (r < 0)
		return -1;
	snprintf(d, n, "bytes=%ld", r);
	return 0;
}

static int p_acct(char *d, size_t n)
{
	return sys(syscall(SYS_acct, NULL));
}

static int p_settimeofday_now(char *d, size_t n)
{
	struct timeval tv;
	gettimeofday(&tv, NULL);
	return sys(syscall(SYS_settimeofday, &tv, NULL));
}

static int p_clock_settime_now(char *d, size_t n)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return sys(syscall(SYS_clock_settime, CLOCK_REALTIME, &ts));
}

/* modes = 0 only reads the clock state: allowed without CAP_SYS_TIME. */
static int p_adjtimex_read(char *d, size_t n)
{
	struct timex tx;
	memset(&tx, 0, sizeof tx);
	return sys(syscall(SYS_adjtimex, &tx));
}

static int p_clock_adjtime_read(char *d, size_t n)
{
	struct timex tx;
	memset(&tx, 0, sizeof tx);
	return sys(syscall(SYS_clock_adjtime, CLOCK_REALTIME, &tx));
}

static int p_iopl(char *d, size_t n)
{
	return sys(syscall(SYS_iopl, 3));
}

static int p_ioperm(char *d, size_t n)
{
	return sys(syscall(SYS_ioperm, 0x80UL, 1UL, 1));
}

/* Q_SYNC without a device syncs every quota-enabled filesystem and needs no
 * capability. */
static int p_quotactl_sync(char *d, size_t n)
{
	return sys(syscall(SYS_quotactl, P_QCMD(P_Q_SYNC, P_USRQUOTA), NULL, 0, NULL));
}

static int p_quotactl_fd_sync(char *d, size_t n)
{
	int fd = open("/", O_RDONLY | O_DIRECTORY);
	return sys(syscall(443 /* quotactl_fd */, fd, P_QCMD(P_Q_SYNC, P_USRQUOTA), 0, NULL));
}

static int p_io_uring_setup(char *d, size_t n)
{
	unsigned char params[120] = {0}; /* struct io_uring_params */
	return sys(syscall(SYS_io_uring_setup, 1, params));
}

/* ---- ioctls (incident 4) ---- */

static int p_ioctl_xfs_swapext(char *d, size_t n)
{
	struct p_xfs_swapext sx;
	memset(&sx, 0, sizeof sx);
	int fd = tmpfile_fd();
	if (fd < 0)
		return -1;
	return sys(syscall(SYS_ioctl, fd, P_XFS_IOC_SWAPEXT, &sx));
}

static int p_ioctl_xfs_swapext_hibits(char *d, size_t n)
{
	struct p_xfs_swapext sx;
	memset(&sx, 0, sizeof sx);
	int fd = tmpfile_fd();
	if (fd < 0)
		return -1;
	return sys(syscall(SYS_ioctl, fd, HIBITS | P_XFS_IOC_SWAPEXT, &sx));
}

static int setflags(unsigned long cmd, long flags)
{
	int fd = tmpfile_fd();
	if (fd < 0)
		return -1;
	long f = flags;
	int r = sys(syscall(SYS_ioctl, fd, cmd, &f));
	if (r == 0 && (flags & P_FS_IMMUTABLE_FL)) {
		f = 0;
		syscall(SYS_ioctl, fd, P_FS_IOC_SETFLAGS, &f);
	}
	return r;
}

static int p_ioctl_setflags_immutable(char *d, size_t n)
{
	return setflags(P_FS_IOC_SETFLAGS, P_FS_IMMUTABLE_FL);
}

/* Setting NOATIME needs no capability: only seccomp stops it. */
static int p_ioctl_setflags_noatime(char *d, size_t n)
{
	return setflags(P_FS_IOC_SETFLAGS, P_FS_NOATIME_FL);
}

static int p_ioctl_setflags_noatime_hibits(char *d, size_t n)
{
	return setflags(HIBITS | P_FS_IOC_SETFLAGS, P_FS_NOATIME_FL);
}

static int p_ioctl_setflags32_noatime(char *d, size_t n)
{
	return setflags(P_FS_IOC32_SETFLAGS, P_FS_NOATIME_FL);
}

static int fssetxattr(uint32_t xflags)
{
	int fd = tmpfile_fd();
	if (fd < 0)
		return -1;
	struct p_fsxattr fa;
	memset(&fa, 0, sizeof fa);
	fa.fsx_xflags = xflags;
	int r = sys(syscall(SYS_ioctl, fd, P_FS_IOC_FSSETXATTR, &fa));
	if (r == 0 && (xflags & P_FS_XFLAG_IMMUTABLE)) {
		fa.fsx_xflags = 0;
		syscall(SYS_ioctl, fd, P_FS_IOC_FSSETXATTR, &fa);
	}
	return r;
}

static int p_ioctl_fssetxattr_immutable(char *d, size_t n)
{
	return fssetxattr(P_FS_XFLAG_IMMUTABLE);
}

static int p_ioctl_fssetxattr_noatime(char *d, size_t n)
{
	return fssetxattr(P_FS_XFLAG_NOATIME);
}

/* A file with one written, synced block: unfiltered, FIEMAP would map it
 * to its physical offset on the host's disk. */
static int written_fd(void)
{
	int fd = tmpfile_fd();
	if (fd >= 0 && (write(fd, "prober\n", 7) != 7 || fsync(fd) < 0)) {
		close(fd);
		return -1;
	}
	return fd;
}

static int fiemap(int fd, unsigned long cmd)
{
	/* fm_start 0, fm_length ~0, no extents asked: the kernel would count. */
	uint64_t fm[4] = {0, ~0ULL, 0, 0};
	if (fd < 0)
		return -1;
	return sys(syscall(SYS_ioctl, fd, cmd, fm));
}

static int p_ioctl_fiemap(char *d, size_t n) { return fiemap(written_fd(), P_FS_IOC_FIEMAP); }
static int p_ioctl_fiemap_hibits(char *d, size_t n) { return fiemap(written_fd(), HIBITS | P_FS_IOC_FIEMAP); }

/* The pinned shell is a bind mount of a host file. */
static int p_ioctl_fiemap_host_bind(char *d, size_t n)
{
	return fiemap(open("/dev/sh", O_RDONLY), P_FS_IOC_FIEMAP);
}

static int p_ioctl_fibmap(char *d, size_t n)
{
	int fd = written_fd();
	int block = 0;
	if (fd < 0)
		return -1;
	return sys(syscall(SYS_ioctl, fd, P_FIBMAP, &block));
}

static int p_ioctl_getfsmap(char *d, size_t n)
{
	/* A zeroed head (fmh_count 0): the kernel would count the records. */
	static unsigned char head[192];
	int fd = written_fd();
	if (fd < 0)
		return -1;
	return sys(syscall(SYS_ioctl, fd, P_FS_IOC_GETFSMAP, head));
}

/* ---- sockets: only the allowed families and netlink protocols open ---- */

static int sock(long domain, long type, long proto)
{
	long fd = syscall(SYS_socket, domain, type, proto);
	if (fd < 0)
		return -1;
	close((int)fd);
	return 0;
}

static int sockpair(long domain, long type)
{
	int sv[2];
	if (syscall(SYS_socketpair, domain, type, 0L, sv) < 0)
		return -1;
	close(sv[0]);
	close(sv[1]);
	return 0;
}

static int p_socket_unix(char *d, size_t n) { return sock(P_AF_UNIX, P_SOCK_STREAM | P_SOCK_CLOEXEC, 0); }
static int p_socket_inet(char *d, size_t n) { return sock(P_AF_INET, P_SOCK_DGRAM | P_SOCK_NONBLOCK, 0); }
static int p_socket_inet6(char *d, size_t n) { return sock(P_AF_INET6, P_SOCK_STREAM, 0); }
static int p_socket_netlink_route(char *d, size_t n) { return sock(P_AF_NETLINK, P_SOCK_RAW | P_SOCK_CLOEXEC, P_NETLINK_ROUTE); }
static int p_socket_netlink_sock_diag(char *d, size_t n) { return sock(P_AF_NETLINK, P_SOCK_DGRAM, P_NETLINK_SOCK_DIAG); }
static int p_socketpair_unix(char *d, size_t n) { return sockpair(P_AF_UNIX, P_SOCK_STREAM); }
static int p_socket_vsock(char *d, size_t n) { return sock(P_AF_VSOCK, P_SOCK_STREAM, 0); }
static int p_socket_vsock_hibits(char *d, size_t n) { return sock(P_HIGH32 | P_AF_VSOCK, P_SOCK_STREAM, 0); }
static int p_socket_packet(char *d, size_t n) { return sock(P_AF_PACKET, P_SOCK_RAW, 0); }
static int p_socket_alg(char *d, size_t n) { return sock(P_AF_ALG, P_SOCK_SEQPACKET, 0); }
static int p_socket_xdp(char *d, size_t n) { return sock(P_AF_XDP, P_SOCK_RAW, 0); }
static int p_socket_key(char *d, size_t n) { return sock(P_AF_KEY, P_SOCK_RAW, 2 /* PF_KEY_V2 */); }
static int p_socket_netlink_uevent(char *d, size_t n) { return sock(P_AF_NETLINK, P_SOCK_DGRAM, P_NETLINK_KOBJECT_UEVENT); }
static int p_socket_netlink_audit(char *d, size_t n) { return sock(P_AF_NETLINK, P_SOCK_RAW, P_NETLINK_AUDIT); }
static int p_socket_netlink_generic(char *d, size_t n) { return sock(P_AF_NETLINK, P_SOCK_RAW, P_NETLINK_GENERIC); }
static int p_socket_netlink_netfilter(char *d, size_t n) { return sock(P_AF_NETLINK, P_SOCK_RAW, P_NETLINK_NETFILTER); }
static int p_socket_netlink_xfrm(char *d, size_t n) { return sock(P_AF_NETLINK, P_SOCK_RAW, P_NETLINK_XFRM); }
static int p_socket_netlink_route_hibits(char *d, size_t n) { return sock(P_AF_NETLINK, P_SOCK_RAW, P_HIGH32 | P_NETLINK_ROUTE); }
static int p_socketpair_inet(char *d, size_t n) { return sockpair(P_AF_INET, P_SOCK_STREAM); }
static int p_socketpair_netlink(char *d, size_t n) { return sockpair(P_AF_NETLINK, P_SOCK_RAW); }

/* ---- other ABIs: a filter written for x86_64 numbers only ---- */

static int p_i386_unshare_newuser(char *d, size_t n)
{
	return int80ret(int80(I386_UNSHARE, (long)P_CLONE_NEWUSER, 0, 0));
}

static int p_i386_mount_tmpfs(char *d, size_t n)
{
	static const char src[] = "none", dst[] = "/mnt", typ[] = "tmpfs";
	mkdir("/mnt", 0755);
	/* mount(2) has 5 args; the 4th and 5th (esi, edi) stay whatever they
	 * are: flags garbage is harmless next to a failing call, and the
	 * point is only whether the call is let through. */
	long ret;
	__asm__ volatile("int $0x80"
			 : "=a"(ret)
			 : "a"((long)I386_MOUNT), "b"((long)(uintptr_t)src), "c"((long)(uintptr_t)dst),
			   "d"((long)(uintptr_t)typ), "S"(0L), "D"(0L)
			 : "memory", "r8", "r9", "r10", "r11");
	return int80ret(ret);
}

/* tracer_of is the TracerPid /proc says pid has (-1: unknown). */
static long tracer_of(pid_t pid)
{
	char path[64], line[256];
	snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
	FILE *f = fopen(path, "r");
	if (!f)
		return -1;
	long t = -1;
	while (fgets(line, sizeof line, f))
		if (sscanf(line, "TracerPid: %ld", &t) == 1)
			break;
	fclose(f);
	return t;
}

static int p_i386_ptrace_attach_child(char *d, size_t n)
{
	pid_t c = sleeper();
	int r = int80ret(int80(I386_PTRACE, P_PTRACE_ATTACH, c, 0));
	int e = errno;
	/* A 0 from a call that did not attach was another call (a sandbox
	 * that takes int $0x80 as a 64-bit call runs msync for 26). */
	if (r == 0) {
		usleep(10000);
		long t = tracer_of(c);
		if (t != (long)getpid()) {
			snprintf(d, n, "(int $0x80 returned 0, but the child's TracerPid is %ld: another call ran)", t);
			r = -1;
			e = ENOSYS;
		}
	}
	reap(c);
	errno = e;
	return r;
}

static int p_i386_ioctl_setflags32_noatime(char *d, size_t n)
{
	int fd = tmpfile_fd();
	if (fd < 0)
		return -1;
	if ((uintptr_t)&g_flags32 > 0xffffffffUL) {
		snprintf(d, n, "(binary above 4GiB: not testable)");
		errno = EFAULT;
		return -1;
	}
	g_flags32 = P_FS_NOATIME_FL;
	return int80ret(int80(I386_IOCTL, fd, (long)P_FS_IOC32_SETFLAGS, (long)(uintptr_t)&g_flags32));
}

static int p_x32_unshare_newuser(char *d, size_t n)
{
	return sys(syscall(P_X32_SYSCALL_BIT | SYS_unshare, P_CLONE_NEWUSER));
}

/* i386 has socket(2) itself (since Linux 4.3) and the older socketcall(2),
 * whose arguments are in memory where seccomp cannot read them. */
/* i386_sock_ret: r from an i386 socket call for an AF_VSOCK socket. A
 * result that is not such a socket was another call (a kernel or sandbox
 * that takes int $0x80 as a 64-bit call runs the 64-bit call of that
 * number: getuid for socketcall), and counts as refused. */
static int i386_sock_ret(long r, char *d, size_t n)
{
	if (int80ret(r) < 0)
		return -1;
	int domain = -1;
	socklen_t len = sizeof domain;
	if (getsockopt((int)r, SOL_SOCKET, SO_DOMAIN, &domain, &len) < 0 || domain != P_AF_VSOCK) {
		snprintf(d, n, "(int $0x80 returned %ld, not a vsock socket: another call ran)", r);
		errno = ENOSYS;
		return -1;
	}
	close((int)r);
	return 0;
}

static int p_i386_socket_vsock(char *d, size_t n)
{
	return i386_sock_ret(int80(I386_SOCKET, P_AF_VSOCK, P_SOCK_STREAM, 0), d, n);
}

static int p_i386_socketcall_vsock(char *d, size_t n)
{
	if ((uintptr_t)g_sockargs > 0xffffffffUL) {
		snprintf(d, n, "(binary above 4GiB: not testable)");
		errno = EFAULT;
		return -1;
	}
	g_sockargs[0] = P_AF_VSOCK;
	g_sockargs[1] = P_SOCK_STREAM;
	g_sockargs[2] = 0;
	return i386_sock_ret(int80(I386_SOCKETCALL, P_SYS_SOCKET, (long)(uintptr_t)g_sockargs, 0), d, n);
}

static int p_x32_socket_vsock(char *d, size_t n)
{
	long fd = syscall(P_X32_SYSCALL_BIT | SYS_socket, P_AF_VSOCK, P_SOCK_STREAM, 0);
	if (fd < 0)
		return -1;
	close((int)fd);
	return 0;
}

/* ---- devices (CAP_MKNOD is granted; the device cgroup must stop opens) ---- */

static int open_dev(char type, unsigned maj, unsigned min, char *d, size_t n)
{
	char path[64];
	snprintf(path, sizeof path, "/tmp/prober-dev-%d", (int)getpid());
	unlink(path);
	if (mknod(path, (type == 'b' ? S_IFBLK : S_IFCHR) | 0600, makedev(maj, min)) < 0) {
		snprintf(d, n, "(mknod %c %u:%u)", type, maj, min);
		return -1;
	}
	int fd = open(path, O_RDONLY);
	int e = errno;
	unlink(path);
	snprintf(d, n, "(%c %u:%u)", type, maj, min);
	if (fd < 0) {
		errno = e;
		return -1;
	}
	char buf[8];
	ssize_t r = read(fd, buf, sizeof buf);
	snprintf(d, n, "(%c %u:%u) read=%zd", type, maj, min, r);
	return 0;
}

static int p_open_blockdev(char *d, size_t n)
{
	unsigned maj = 0, min = 0;
	DIR *dir = opendir("/sys/dev/block");
	struct dirent *e;
	while (dir && (e = readdir(dir)) != NULL) {
		if (sscanf(e->d_name, "%u:%u", &maj, &min) == 2 && maj != 7 /* loop */)
			break;
		maj = 0;
	}
	if (maj == 0) {
		maj = 8; /* sda */
		min = 0;
	}
	return open_dev('b', maj, min, d, n);
}

static int p_open_devmem(char *d, size_t n)
{
	return open_dev('c', 1, 1, d, n);
}

/* ---- masked reads (incident 7), read-only writes ---- */

static int readn(const char *path, size_t want, char *d, size_t n)
{
	char buf[64];
	int fd = open(path, O_RDONLY);
	if (fd < 0)
		return -1;
	ssize_t r = read(fd, buf, want < sizeof buf ? want : sizeof buf);
	if (r < 0)
		return -1;
	snprintf(d, n, "bytes=%zd", r);
	return 0;
}

static int p_read_proc_kcore(char *d, size_t n) { return readn("/proc/kcore", 8, d, n); }
static int p_read_proc_kpagecgroup(char *d, size_t n) { return readn("/proc/kpagecgroup", 8, d, n); }
static int p_read_proc_kpageflags(char *d, size_t n) { return readn("/proc/kpageflags", 8, d, n); }
static int p_read_proc_kpagecount(char *d, size_t n) { return readn("/proc/kpagecount", 8, d, n); }
static int p_read_proc_timer_list(char *d, size_t n) { return readn("/proc/timer_list", 8, d, n); }
static int p_read_proc_sched_debug(char *d, size_t n) { return readn("/proc/sched_debug", 8, d, n); }
static int p_read_proc_keys(char *d, size_t n) { return readn("/proc/keys", 8, d, n); }
static int p_read_proc_kallsyms(char *d, size_t n) { return readn("/proc/kallsyms", 8, d, n); }
static int p_read_proc_slabinfo(char *d, size_t n) { return readn("/proc/slabinfo", 8, d, n); }
static int p_read_proc_vmallocinfo(char *d, size_t n) { return readn("/proc/vmallocinfo", 8, d, n); }
static int p_read_proc_pagetypeinfo(char *d, size_t n) { return readn("/proc/pagetypeinfo", 8, d, n); }
static int p_read_proc_zoneinfo(char *d, size_t n) { return readn("/proc/zoneinfo", 8, d, n); }
static int p_read_proc_buddyinfo(char *d, size_t n) { return readn("/proc/buddyinfo", 8, d, n); }
static int p_read_proc_iomem(char *d, size_t n) { return readn("/proc/iomem", 8, d, n); }
static int p_read_proc_ioports(char *d, size_t n) { return readn("/proc/ioports", 8, d, n); }
static int p_read_proc_mtrr(char *d, size_t n) { return readn("/proc/mtrr", 8, d, n); }

/* What tools read must stay: 0 bytes (a /dev/null mask) is ENODATA. */
static int readkept(const char *path, char *d, size_t n)
{
	if (readn(path, 8, d, n) < 0)
		return -1;
	if (strcmp(d, "bytes=0") == 0) {
		errno = ENODATA;
		return -1;
	}
	return 0;
}

static int p_read_proc_meminfo(char *d, size_t n) { return readkept("/proc/meminfo", d, n); }
static int p_read_proc_cpuinfo(char *d, size_t n) { return readkept("/proc/cpuinfo", d, n); }
static int p_read_proc_stat(char *d, size_t n) { return readkept("/proc/stat", d, n); }
static int p_read_proc_loadavg(char *d, size_t n) { return readkept("/proc/loadavg", d, n); }

/* /proc/self/cgroup names the sandbox's cgroup as "/" in every hierarchy
 * (a cgroup namespace), not the host's path: ENOTRECOVERABLE otherwise,
 * with the first line that names one. */
static int p_proc_self_cgroup_root(char *d, size_t n)
{
	char line[512];
	FILE *f = fopen("/proc/self/cgroup", "r");
	if (!f)
		return -1;
	int lines = 0;
	while (fgets(line, sizeof line, f)) {
		line[strcspn(line, "\n")] = 0;
		char *path = strchr(line, ':');
		path = path ? strchr(path + 1, ':') : NULL;
		if (!path || strcmp(path + 1, "/") != 0) {
			snprintf(d, n, "line=%s", line);
			fclose(f);
			errno = ENOTRECOVERABLE;
			return -1;
		}
		lines++;
	}
	fclose(f);
	snprintf(d, n, "lines=%d", lines);
	return 0;
}

static int p_list_sys_firmware(char *d, size_t n)
{
	DIR *dir = opendir("/sys/firmware");
	if (!dir)
		return -1;
	int count = 0;
	struct dirent *e;
	while ((e = readdir(dir)) != NULL)
		if (strcmp(e->d_name, ".") && strcmp(e->d_name, ".."))
			count++;
	snprintf(d, n, "bytes=%d", count); /* entries, reported like a read */
	return 0;
}

static int writes(const char *path, const char *data)
{
	int fd = open(path, O_WRONLY);
	if (fd < 0)
		return -1;
	ssize_t w = write(fd, data, strlen(data));
	return w < 0 ? -1 : 0;
}

static int p_write_sysrq_trigger(char *d, size_t n)
{
	return writes("/proc/sysrq-trigger", "h");
}

static int p_write_proc_sys_hostname(char *d, size_t n)
{
	return writes("/proc/sys/kernel/hostname", "dsec-pwned\n");
}

/* Writes the current value back: harmless even if it were let through. */
static int p_write_proc_sys_core_pattern(char *d, size_t n)
{
	char cur[256] = "";
	int fd = open("/proc/sys/kernel/core_pattern", O_RDONLY);
	if (fd >= 0) {
		ssize_t r = read(fd, cur, sizeof cur - 1);
		cur[r > 0 ? r : 0] = 0;
		close(fd);
	}
	if (!cur[0])
		strcpy(cur, "core\n");
	return writes("/proc/sys/kernel/core_pattern", cur);
}

/* ---- other modes ---- */

static int whoami(void)
{
	char capeff[64] = "?";
	FILE *f = fopen("/proc/self/status", "r");
	char line[256];
	while (f && fgets(line, sizeof line, f))
		if (sscanf(line, "CapEff: %63s", capeff) == 1)
			break;
	printf("uid=%d euid=%d gid=%d egid=%d capeff=%s\n", (int)getuid(), (int)geteuid(), (int)getgid(),
	       (int)getegid(), capeff);
	if (syscall(SYS_setuid, 0) == 0)
		printf("setuid0 ok\n");
	else
		printf("setuid0 errno=%d %s\n", errno, strerror(errno));
	return 0;
}

static int setcap(const char *path)
{
	/* struct vfs_cap_data, VFS_CAP_REVISION_2 with the effective flag:
	 * permitted = CAP_DAC_OVERRIDE (1) | CAP_SETUID (7). */
	uint32_t data[5] = {0x02000000 | 0x000001, (1u << 1) | (1u << 7), 0, 0, 0};
	if (setxattr(path, "security.capability", data, sizeof data, 0) < 0) {
		printf("setcap errno=%d %s\n", errno, strerror(errno));
		return 1;
	}
	printf("setcap ok\n");
	return 0;
}

struct probe {
	const char *name;
	probe_fn fn;
};

static const struct probe probes[] = {
	{"mount_tmpfs", p_mount_tmpfs},
	{"umount_kcore_mask", p_umount_kcore_mask},
	{"fsopen", p_fsopen},
	{"fsmount", p_fsmount},
	{"move_mount", p_move_mount},
	{"open_tree", p_open_tree},
	{"fspick", p_fspick},
	{"mount_setattr", p_mount_setattr},
	{"unshare_newuser", p_unshare_newuser},
	{"unshare_newns", p_unshare_newns},
	{"unshare_userns_mount", p_unshare_userns_mount},
	{"clone_newuser", p_clone_newuser},
	{"clone3_newuser", p_clone3_newuser},
	{"setns_mnt", p_setns_mnt},
	{"ptrace_attach_init", p_ptrace_attach_init},
	{"ptrace_attach_child", p_ptrace_attach_child},
	{"process_vm_readv_init", p_process_vm_readv_init},
	{"process_vm_readv_child", p_process_vm_readv_child},
	{"process_vm_writev_child", p_process_vm_writev_child},
	{"bpf_map_create", p_bpf_map_create},
	{"bpf_prog_load", p_bpf_prog_load},
	{"perf_event_open", p_perf_event_open},
	{"init_module", p_init_module},
	{"finit_module", p_finit_module},
	{"delete_module", p_delete_module},
	{"kexec_load", p_kexec_load},
	{"kexec_file_load", p_kexec_file_load},
	{"reboot_cad_off", p_reboot_cad_off},
	{"keyctl_get_session", p_keyctl_get_session},
	{"add_key", p_add_key},
	{"request_key", p_request_key},
	{"name_to_handle_at", p_name_to_handle_at},
	{"open_by_handle_at", p_open_by_handle_at},
	{"userfaultfd", p_userfaultfd},
	{"userfaultfd_usermode", p_userfaultfd_usermode},
	{"swapon", p_swapon},
	{"swapoff", p_swapoff},
	{"syslog_read_all", p_syslog_read_all},
	{"acct", p_acct},
	{"settimeofday_now", p_settimeofday_now},
	{"clock_settime_now", p_clock_settime_now},
	{"adjtimex_read", p_adjtimex_read},
	{"clock_adjtime_read", p_clock_adjtime_read},
	{"iopl", p_iopl},
	{"ioperm", p_ioperm},
	{"quotactl_sync", p_quotactl_sync},
	{"quotactl_fd_sync", p_quotactl_fd_sync},
	{"io_uring_setup", p_io_uring_setup},
	{"ioctl_xfs_swapext", p_ioctl_xfs_swapext},
	{"ioctl_xfs_swapext_hibits", p_ioctl_xfs_swapext_hibits},
	{"ioctl_setflags_immutable", p_ioctl_setflags_immutable},
	{"ioctl_setflags_noatime", p_ioctl_setflags_noatime},
	{"ioctl_setflags_noatime_hibits", p_ioctl_setflags_noatime_hibits},
	{"ioctl_setflags32_noatime", p_ioctl_setflags32_noatime},
	{"ioctl_fssetxattr_immutable", p_ioctl_fssetxattr_immutable},
	{"ioctl_fssetxattr_noatime", p_ioctl_fssetxattr_noatime},
	{"ioctl_fiemap", p_ioctl_fiemap},
	{"ioctl_fiemap_hibits", p_ioctl_fiemap_hibits},
	{"ioctl_fiemap_host_bind", p_ioctl_fiemap_host_bind},
	{"ioctl_fibmap", p_ioctl_fibmap},
	{"ioctl_getfsmap", p_ioctl_getfsmap},
	{"i386_unshare_newuser", p_i386_unshare_newuser},
	{"i386_mount_tmpfs", p_i386_mount_tmpfs},
	{"i386_ptrace_attach_child", p_i386_ptrace_attach_child},
	{"i386_ioctl_setflags32_noatime", p_i386_ioctl_setflags32_noatime},
	{"x32_unshare_newuser", p_x32_unshare_newuser},
	{"socket_unix", p_socket_unix},
	{"socket_inet", p_socket_inet},
	{"socket_inet6", p_socket_inet6},
	{"socket_netlink_route", p_socket_netlink_route},
	{"socket_netlink_sock_diag", p_socket_netlink_sock_diag},
	{"socketpair_unix", p_socketpair_unix},
	{"socket_vsock", p_socket_vsock},
	{"socket_vsock_hibits", p_socket_vsock_hibits},
	{"socket_packet", p_socket_packet},
	{"socket_alg", p_socket_alg},
	{"socket_xdp", p_socket_xdp},
	{"socket_key", p_socket_key},
	{"socket_netlink_uevent", p_socket_netlink_uevent},
	{"socket_netlink_audit", p_socket_netlink_audit},
	{"socket_netlink_generic", p_socket_netlink_generic},
	{"socket_netlink_netfilter", p_socket_netlink_netfilter},
	{"socket_netlink_xfrm", p_socket_netlink_xfrm},
	{"socket_netlink_route_hibits", p_socket_netlink_route_hibits},
	{"socketpair_inet", p_socketpair_inet},
	{"socketpair_netlink", p_socketpair_netlink},
	{"i386_socket_vsock", p_i386_socket_vsock},
	{"i386_socketcall_vsock", p_i386_socketcall_vsock},
	{"x32_socket_vsock", p_x32_socket_vsock},
	{"open_blockdev", p_open_blockdev},
	{"open_devmem", p_open_devmem},
	{"read_proc_kcore", p_read_proc_kcore},
	{"read_proc_kpagecgroup", p_read_proc_kpagecgroup},
	{"read_proc_kpageflags", p_read_proc_kpageflags},
	{"read_proc_kpagecount", p_read_proc_kpagecount},
	{"read_proc_timer_list", p_read_proc_timer_list},
	{"read_proc_sched_debug", p_read_proc_sched_debug},
	{"read_proc_keys", p_read_proc_keys},
	{"read_proc_kallsyms", p_read_proc_kallsyms},
	{"read_proc_slabinfo", p_read_proc_slabinfo},
	{"read_proc_vmallocinfo", p_read_proc_vmallocinfo},
	{"read_proc_pagetypeinfo", p_read_proc_pagetypeinfo},
	{"read_proc_zoneinfo", p_read_proc_zoneinfo},
	{"read_proc_buddyinfo", p_read_proc_buddyinfo},
	{"read_proc_iomem", p_read_proc_iomem},
	{"read_proc_ioports", p_read_proc_ioports},
	{"read_proc_mtrr", p_read_proc_mtrr},
	{"read_proc_meminfo", p_read_proc_meminfo},
	{"read_proc_cpuinfo", p_read_proc_cpuinfo},
	{"read_proc_stat", p_read_proc_stat},
	{"read_proc_loadavg", p_read_proc_loadavg},
	{"proc_self_cgroup_root", p_proc_self_cgroup_root},
	{"list_sys_firmware", p_list_sys_firmware},
	{"write_sysrq_trigger", p_write_sysrq_trigger},
	{"write_proc_sys_hostname", p_write_proc_sys_hostname},
	{"write_proc_sys_core_pattern", p_write_proc_sys_core_pattern},
	/* Last: if it went through, /proc is gone for everything after it. */
	{"umount_proc", p_umount_proc},
};

int main(int argc, char **argv)
{
	setvbuf(stdout, NULL, _IONBF, 0);
	if (argc > 1 && strcmp(argv[1], "whoami") == 0)
		return whoami();
	if (argc > 2 && strcmp(argv[1], "setcap") == 0)
		return setcap(argv[2]);
	if (argc > 1) {
		fprintf(stderr, "usage: prober [whoami | setcap FILE]\n");
		return 2;
	}
	for (size_t i = 0; i < sizeof probes / sizeof probes[0]; i++)
		run(probes[i].name, probes[i].fn);
	printf("done\n");
	return 0;
}
