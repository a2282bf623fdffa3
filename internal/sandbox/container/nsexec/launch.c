// The sandbox launcher: starts a sandbox's init directly from the edge,
// without an OCI runtime process (launch.go has the Go half).
//
// The edge calls dsec_launch, which clones a middle process, which clones
// init: both share the edge's memory until they exec or exit
// (CLONE_VM|CLONE_VFORK), and init is created in new pid, mount, ipc, uts
// and network namespaces: it is pid 1 of its sandbox. The middle exits once
// init has exec'd, so init's parent is the host's reaper, not the edge.
// Both only make system calls, on stacks of their own: no allocation, no
// stdio, no locks. All signals stay blocked from before the clone until
// just before the exec, and every handled signal is set back to its
// default in the child, so no Go signal handler can run in it.
//
// Steps in the child:
//   1. a new session, umask 022, stdio to /dev/null; join the sandbox's cgroups (write "0" to each
//      cgroup.procs fd the edge opened); optionally a new cgroup namespace.
//   2. make every mount private; attach the rootfs (a detached mount, or
//      a recursive bind of the rootfs directory) at its host path; make
//      it nodev.
//   3. run the mount program (see struct op): new filesystems (fsopen/
//      fsmount), bind mounts (open_tree), read-only rebinds and symlinks.
//      Every target is resolved with openat2(RESOLVE_IN_ROOT): a symlink in
//      the rootfs (an image or a previous sandbox may plant any) resolves
//      inside the rootfs, never on the host. Mounts go onto the resolved
//      fd (move_mount), so no path is walked twice.
//   4. bring up lo; set the hostname; pivot_root into the rootfs and
//      detach the old root.
//   5. open-files limit; with a user namespace, join it and become its
//      root (join_userns); drop the bounding set and trim capabilities;
//      no_new_privs; mark every fd close-on-exec; install the seccomp
//      filter; restore the signal mask; execve init.
// A failure writes "step: errno N" into the caller's error buffer (shared
// memory) and exits 125; the caller reaps the child.

#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/mount.h>
#include <linux/openat2.h>
#include <linux/seccomp.h>
#include <net/if.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <poll.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "launch.h"
#include "owner.h"
#include "vforked.h"

#ifndef CLOSE_RANGE_CLOEXEC
#define CLOSE_RANGE_CLOEXEC (1U << 2)
#endif

// report writes "what: errno N" (or "what: detail") into l->err, with no
// library call that could allocate or lock.
static void put(char *buf, size_t *n, size_t cap, const char *s) {
	for (; *s && *n < cap - 1; s++)
		buf[(*n)++] = *s;
	buf[*n] = 0;
}

static void put_num(char *buf, size_t *n, size_t cap, unsigned v) {
	char d[12];
	int k = 0;
	do {
		d[k++] = (char)('0' + v % 10);
		v /= 10;
	} while (v && k < (int)sizeof d);
	while (k > 0 && *n < cap - 1)
		buf[(*n)++] = d[--k];
	buf[*n] = 0;
}

static void fail(struct dsec_launch *l, const char *what, const char *arg, int err) {
	size_t n = 0, cap = sizeof l->err;
	put(l->err, &n, cap, what);
	if (arg) {
		put(l->err, &n, cap, " ");
		put(l->err, &n, cap, arg);
	}
	put(l->err, &n, cap, ": errno ");
	put_num(l->err, &n, cap, err < 0 ? 0 : (unsigned)err);
	l->err_errno = err;
	_exit(125);
}

// openat2_in_root opens path as O_PATH inside the rootfs. With follow, a
// symlink on the way resolves inside the rootfs; without, any symlink on
// the way is refused (ELOOP), as runtimes refuse a /proc, /sys or /dev
// that is not a plain directory: a kernel filesystem mounted elsewhere
// would leave its masks and read-only paths to miss.
static int openat2_in_root(int rootfd, const char *path, int flags, int follow) {
	struct open_how how;
	memset(&how, 0, sizeof how);
	how.flags = O_PATH | O_CLOEXEC | flags;
	// A followed symlink must also stay on the rootfs's own mount: it
	// may not lead onto /proc, /sys or /dev (already mounted) and cover
	// a kernel file, a device or /dev/init.
	how.resolve = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | (follow ? RESOLVE_NO_XDEV : RESOLVE_NO_SYMLINKS);
	return (int)syscall(SYS_openat2, rootfd, path, &how, sizeof how);
}

#define MAX_TARGET 256
#define MAX_DEPTH 16

// ensure returns an O_PATH fd of path inside the rootfs, creating it (a
// directory when dir, else an empty file) and its missing parents. Paths
// resolve inside the rootfs (openat2_in_root). With follow, a name that
// exists but does not resolve (a dangling symlink) is replaced: it is the
// sandbox's own tree, and the mount that follows covers it anyway.
static int ensure(int rootfd, const char *path, int dir, int follow, int depth) {
	int fd = openat2_in_root(rootfd, path, dir ? O_DIRECTORY : 0, follow);
	if (fd >= 0 || errno != ENOENT || depth > MAX_DEPTH)
		return fd;
	char buf[MAX_TARGET];
	size_t len = strlen(path);
	if (len >= sizeof buf) {
		errno = ENAMETOOLONG;
		return -1;
	}
	memcpy(buf, path, len + 1);
	while (len > 1 && buf[len - 1] == '/')
		buf[--len] = 0;
	char *slash = strrchr(buf, '/');
	if (!slash || slash[1] == 0) {
		errno = EINVAL;
		return -1;
	}
	*slash = 0;
	const char *name = slash + 1;
	if (strcmp(name, ".") == 0 || strcmp(name, "..") == 0) {
		errno = EINVAL;
		return -1;
	}
	int pfd = ensure(rootfd, buf[0] ? buf : "/", 1, follow, depth + 1);
	if (pfd < 0)
		return -1;
	for (int attempt = 0; attempt < 2; attempt++) {
		int r;
		if (dir) {
			r = mkdirat(pfd, name, 0755);
		} else {
			r = openat(pfd, name, O_CREAT | O_EXCL | O_WRONLY | O_NOFOLLOW | O_CLOEXEC, 0644);
			if (r >= 0)
				close(r);
		}
		if (r >= 0 || errno != EEXIST || attempt > 0 || !follow)
			break;
		struct stat st;
		if (fstatat(pfd, name, &st, AT_SYMLINK_NOFOLLOW) < 0 || !S_ISLNK(st.st_mode))
			break;
		if (unlinkat(pfd, name, 0) < 0)
			break;
	}
	fd = openat(pfd, name, O_PATH | O_NOFOLLOW | O_CLOEXEC | (dir ? O_DIRECTORY : 0));
	int saved = errno;
	close(pfd);
	errno = saved;
	return fd;
}

static int mount_setattr_fd(int fd, unsigned attr) {
	if (!attr)
		return 0;
	struct mount_attr a;
	memset(&a, 0, sizeof a);
	a.attr_set = attr;
	if (attr & MOUNT_ATTR__ATIME)
		a.attr_clr = MOUNT_ATTR__ATIME;
	return (int)syscall(SYS_mount_setattr, fd, "", AT_EMPTY_PATH, &a, sizeof a);
}

static int move_onto(int mfd, int target) {
	return (int)syscall(SYS_move_mount, mfd, "", target, "", MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH);
}

// new_fs creates a filesystem of type with the comma-separated parameters
// params ("key=value" or a flag) and mounts it onto target.
static void new_fs(struct dsec_launch *l, const struct dsec_op *op, int target) {
	int fs = (int)syscall(SYS_fsopen, op->arg1, FSOPEN_CLOEXEC);
	if (fs < 0)
		fail(l, "fsopen", op->arg1, errno);
	char buf[256];
	size_t len = strlen(op->arg2);
	if (len >= sizeof buf)
		fail(l, "mount options too long for", op->target, E2BIG);
	memcpy(buf, op->arg2, len + 1);
	char *p = buf;
	while (p && *p) {
		char *next = strchr(p, ',');
		if (next)
			*next++ = 0;
		char *eq = strchr(p, '=');
		int r;
		if (eq) {
			*eq = 0;
			r = (int)syscall(SYS_fsconfig, fs, FSCONFIG_SET_STRING, p, eq + 1, 0);
		} else {
			r = (int)syscall(SYS_fsconfig, fs, FSCONFIG_SET_FLAG, p, NULL, 0);
		}
		if (r < 0)
			fail(l, "mount option", p, errno);
		p = next;
	}
	if (syscall(SYS_fsconfig, fs, FSCONFIG_CMD_CREATE, NULL, NULL, 0) < 0)
		fail(l, "creating filesystem for", op->target, errno);
	int mfd = (int)syscall(SYS_fsmount, fs, FSMOUNT_CLOEXEC, op->attr);
	if (mfd < 0)
		fail(l, "fsmount", op->target, errno);
	if (move_onto(mfd, target) < 0)
		fail(l, "mounting", op->target, errno);
	close(mfd);
	close(fs);
}

// bind clones the tree at (dirfd, path) and mounts it onto target with attr.
static void bind_tree(struct dsec_launch *l, const struct dsec_op *op, int dirfd, const char *path, int target) {
	int flags = OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | (path[0] ? 0 : AT_EMPTY_PATH);
	int t = (int)syscall(SYS_open_tree, dirfd, path, flags);
	if (t < 0)
		fail(l, "open_tree", path[0] ? path : op->target, errno);
	if (mount_setattr_fd(t, op->attr) < 0)
		fail(l, "setting mount flags of", op->target, errno);
	if (move_onto(t, target) < 0)
		fail(l, "mounting", op->target, errno);
	close(t);
}

static void symlink_op(struct dsec_launch *l, int rootfd, const struct dsec_op *op) {
	char buf[MAX_TARGET];
	size_t len = strlen(op->target);
	if (len >= sizeof buf)
		fail(l, "path too long", op->target, ENAMETOOLONG);
	memcpy(buf, op->target, len + 1);
	char *slash = strrchr(buf, '/');
	if (!slash)
		fail(l, "symlink", op->target, EINVAL);
	*slash = 0;
	int pfd = ensure(rootfd, buf[0] ? buf : "/", 1, 0, 0);
	if (pfd < 0)
		fail(l, "creating parent of", op->target, errno);
	if (symlinkat(op->arg1, pfd, slash + 1) < 0 && errno != EEXIST)
		fail(l, "symlink", op->target, errno);
	close(pfd);
}

// chmod_dir sets the mode (octal, arg1) of directory target.
static void chmod_dir(struct dsec_launch *l, const struct dsec_op *op, int target) {
	unsigned mode = 0;
	for (const char *p = op->arg1; *p; p++) {
		if (*p < '0' || *p > '7')
			fail(l, "bad mode for", op->target, EINVAL);
		mode = mode * 8 + (unsigned)(*p - '0');
	}
	int fd = openat(target, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (fd < 0 || fchmod(fd, mode & 07777) < 0)
		fail(l, "chmod", op->target, errno);
	close(fd);
}

// parse_fd reads the decimal fd number in arg1.
static int parse_fd(struct dsec_launch *l, const struct dsec_op *op) {
	int fd = 0;
	for (const char *p = op->arg1; *p; p++) {
		if (*p < '0' || *p > '9' || fd > 1 << 20)
			fail(l, "bad fd for", op->target, EINVAL);
		fd = fd * 10 + (*p - '0');
	}
	return fd;
}

static void run_op(struct dsec_launch *l, int rootfd, const struct dsec_op *op) {
	int target;
	switch (op->kind) {
	case 'F':
	case 'D':
	case 'T':
		target = ensure(rootfd, op->target, 1, 0, 0);
		break;
	case 'f':
		target = ensure(rootfd, op->target, 0, 0, 0);
		break;
	case 'r':
		target = ensure(rootfd, op->target, 0, 1, 0);
		break;
	case 'M':
	case 'R':
		// Only paths this kernel has are sent, and /proc and /sys are
		// plain directories (above): a mask that does not resolve is an
		// error, never skipped.
		target = openat2_in_root(rootfd, op->target, 0, 0);
		break;
	case 'L':
		symlink_op(l, rootfd, op);
		return;
	case 'P':
		target = ensure(rootfd, op->target, 1, 0, 0);
		if (target >= 0)
			chmod_dir(l, op, target);
		break;
	default:
		fail(l, "unknown mount op", op->target, EINVAL);
	}
	if (target < 0)
		fail(l, "creating mount point", op->target, errno);
	switch (op->kind) {
	case 'F':
		new_fs(l, op, target);
		break;
	case 'D':
	case 'f':
	case 'r':
	case 'M':
		bind_tree(l, op, AT_FDCWD, op->arg1, target);
		break;
	case 'R':
	case 'P':
		bind_tree(l, op, target, "", target);
		break;
	case 'T':
		bind_tree(l, op, parse_fd(l, op), "", target);
		break;
	}
	close(target);
}

static void loopback_up(struct dsec_launch *l) {
	int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	if (s < 0)
		fail(l, "socket for lo", NULL, errno);
	struct ifreq ifr;
	memset(&ifr, 0, sizeof ifr);
	memcpy(ifr.ifr_name, "lo", 3);
	if (ioctl(s, SIOCGIFFLAGS, &ifr) < 0)
		fail(l, "reading lo flags", NULL, errno);
	ifr.ifr_flags |= IFF_UP;
	if (ioctl(s, SIOCSIFFLAGS, &ifr) < 0)
		fail(l, "bringing up lo", NULL, errno);
	close(s);
}

// write_zero writes "0" into the kernel file path (name in errors).
static void write_zero(struct dsec_launch *l, const char *path, const char *name) {
	int fd = open(path, O_WRONLY | O_CLOEXEC);
	if (fd < 0)
		fail(l, "opening", name, errno);
	if (write(fd, "0", 1) != 1)
		fail(l, "writing", name, errno);
	close(fd);
}

// reset_oom_score gives the sandbox the default OOM score adjustment (0),
// not the daemon's -999 it inherited: the daemon is shielded from the OOM
// killer, its sandboxes are not. Written while CAP_SYS_RESOURCE is still
// held, it is also the floor: the sandbox (without that capability)
// cannot lower it again.
static void reset_oom_score(struct dsec_launch *l) { write_zero(l, "/proc/self/oom_score_adj", "oom_score_adj"); }

// open_ports lets every user of a user-namespace sandbox's network
// namespace bind any port (net.ipv4.ip_unprivileged_port_start, which
// covers IPv6 as well). The namespace belongs to the host's user
// namespace, over which the sandbox's root holds no CAP_NET_BIND_SERVICE:
// without this, its web server could not listen on port 80. (In a sandbox
// without one, the uids inside are host uids, and only root may.) Written
// through the host's /proc before the pivot: /proc/sys/net is the
// writer's network namespace's.
static void open_ports(struct dsec_launch *l) {
	write_zero(l, "/proc/sys/net/ipv4/ip_unprivileged_port_start", "ip_unprivileged_port_start");
}

// join_userns moves init, its setup done as host root, into the sandbox's
// user namespace (ID maps written, owned by the sandbox's owner uid) as
// its root: from here on it holds capabilities only there. Its other
// namespaces, made before, stay the host's: root inside cannot mount,
// unmount or set the hostname in them, whatever capabilities it is given.
//
// The change of credentials sets the dumpable flag of the memory it
// shares with the edge (CLONE_VM) to fs.suid_dumpable: Launch makes the
// edge non-dumpable itself before the first such launch, and the backend
// launches none where that setting is 1 (native.go, launchesUserNS).
static void join_userns(struct dsec_launch *l) {
	if (setns(l->userns_fd, CLONE_NEWUSER) < 0)
		fail(l, "joining the user namespace", NULL, errno);
	// Raw system calls, not glibc's wrappers (owner.h says why).
	if (syscall(SYS_setgroups, 0, NULL) < 0)
		fail(l, "setgroups in the user namespace", NULL, errno);
	if (syscall(SYS_setresgid, 0, 0, 0) < 0)
		fail(l, "setresgid in the user namespace", NULL, errno);
	if (syscall(SYS_setresuid, 0, 0, 0) < 0)
		fail(l, "setresuid in the user namespace", NULL, errno);
}

static void drop_caps(struct dsec_launch *l) {
	for (int cap = 0; cap <= l->last_cap; cap++) {
		if (cap < 64 && (l->caps & (1ULL << cap)))
			continue;
		if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0 && errno != EINVAL)
			fail(l, "dropping capability from the bounding set", NULL, errno);
	}
	struct __user_cap_header_struct hdr = {.version = _LINUX_CAPABILITY_VERSION_3, .pid = 0};
	struct __user_cap_data_struct data[2];
	memset(data, 0, sizeof data);
	data[0].effective = data[0].permitted = (uint32_t)l->caps;
	data[1].effective = data[1].permitted = (uint32_t)(l->caps >> 32);
	if (syscall(SYS_capset, &hdr, data) < 0)
		fail(l, "capset", NULL, errno);
	if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0 && errno != EINVAL)
		fail(l, "clearing ambient capabilities", NULL, errno);
}

static int child(void *arg) {
	struct dsec_launch *l = arg;
	reset_handled_signals();
	// A session of its own, as a runtime gives init: in the edge's, a
	// Ctrl-C on the terminal that started dsec would reach every sandbox.
	if (setsid() < 0)
		fail(l, "setsid", NULL, errno);
	// Still on the host's /proc here.
	reset_oom_score(l);
	umask(022);
	// stdio is the edge's read-only /dev/null (launch.go): through a
	// read-only mount, so that root inside cannot chmod or chown the
	// host's node through /proc/1/fd/0.
	for (int fd = 0; fd < 3; fd++)
		if (dup2(l->null_fd, fd) < 0)
			fail(l, "redirecting stdio", NULL, errno);
	for (int i = 0; i < l->ncgroups; i++)
		if (write(l->cgroup_fds[i], "0", 1) < 0)
			fail(l, "joining cgroup", NULL, errno);
	if (l->cgroupns && unshare(CLONE_NEWCGROUP) < 0)
		fail(l, "unshare(CLONE_NEWCGROUP)", NULL, errno);
	if (l->netns_fd >= 0 && setns(l->netns_fd, CLONE_NEWNET) < 0)
		fail(l, "joining the network namespace", NULL, errno);
	if (l->userns_fd >= 0)
		open_ports(l);

	if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
		fail(l, "making mounts private", NULL, errno);
	// A rootfs that is only a directory (or a mount with others under
	// it) becomes a mount of its own: a recursive bind onto itself.
	int rootmnt = l->rootfs_mnt;
	if (rootmnt < 0) {
		rootmnt = (int)syscall(SYS_open_tree, AT_FDCWD, l->rootfs, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE);
		if (rootmnt < 0)
			fail(l, "binding the rootfs", NULL, errno);
	}
	if (syscall(SYS_move_mount, rootmnt, "", AT_FDCWD, l->rootfs, MOVE_MOUNT_F_EMPTY_PATH) < 0)
		fail(l, "attaching the rootfs", NULL, errno);
	int rootfd = open(l->rootfs, O_PATH | O_DIRECTORY | O_CLOEXEC);
	if (rootfd < 0)
		fail(l, "opening the rootfs", NULL, errno);
	// No device node in the rootfs works, nor in any mount under it:
	// root inside may mknod any.
	struct mount_attr nodev;
	memset(&nodev, 0, sizeof nodev);
	nodev.attr_set = MOUNT_ATTR_NODEV;
	if (syscall(SYS_mount_setattr, rootfd, "", AT_EMPTY_PATH | AT_RECURSIVE, &nodev, sizeof nodev) < 0)
		fail(l, "making the rootfs nodev", NULL, errno);
	for (int i = 0; i < l->nops; i++)
		run_op(l, rootfd, &l->ops[i]);

	if (l->netns_fd < 0)
		loopback_up(l);
	if (l->hostname[0] && sethostname(l->hostname, strlen(l->hostname)) < 0)
		fail(l, "sethostname", NULL, errno);
	if (fchdir(rootfd) < 0)
		fail(l, "entering the rootfs", NULL, errno);
	if (syscall(SYS_pivot_root, ".", ".") < 0)
		fail(l, "pivot_root", NULL, errno);
	if (umount2(".", MNT_DETACH) < 0)
		fail(l, "detaching the old root", NULL, errno);
	if (chdir("/") < 0)
		fail(l, "chdir /", NULL, errno);
	close(rootfd);

	struct rlimit rl = {.rlim_cur = l->nofile, .rlim_max = l->nofile};
	if (l->nofile && setrlimit(RLIMIT_NOFILE, &rl) < 0)
		fail(l, "setting the open-files limit", NULL, errno);
	if (l->userns_fd >= 0)
		join_userns(l);
	drop_caps(l);
	if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
		fail(l, "no_new_privs", NULL, errno);
	if (syscall(SYS_close_range, 3, ~0U, CLOSE_RANGE_CLOEXEC) < 0)
		fail(l, "close_range", NULL, errno);
	if (l->nfilter) {
		struct sock_fprog prog = {.len = l->nfilter, .filter = (struct sock_filter *)l->filter};
		if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog) < 0)
			fail(l, "installing the seccomp filter", NULL, errno);
	}
	sigprocmask(SIG_SETMASK, &l->oldmask, NULL);
	execve(l->argv[0], l->argv, l->envp);
	fail(l, "exec of", l->argv[0], errno);
	return 0;
}

#define STACK_SIZE (128 << 10)

// One region holds the stacks of the middle, init and the owner task.
#define STACKS 3


// The owner task's fds in l->uns_fds.
enum { UNS_READY_R, UNS_READY_W, UNS_GO_R, UNS_GO_W, UNS_PIDFD };

// owner_task becomes the sandbox's owner uid in a new user namespace
// (become_owner, owner.h), says so on the ready pipe, and waits to be
// killed (or for EOF on the go pipe) once the middle has written the
// namespace's ID maps and opened it. It shares the edge's memory and fd
// table. Its parent-death signal is set in become_owner: if the middle
// died before that, it exits at once.
static int owner_task(void *arg) {
	struct dsec_launch *l = arg;
	int err = 0;
	const char *step = become_owner(l->userns_owner, &err);
	if (step)
		fail(l, step, NULL, err);
	if (getppid() != l->middle_pid)
		_exit(125);
	if (write(l->uns_fds[UNS_READY_W], "1", 1) != 1)
		fail(l, "reporting the user namespace", NULL, errno);
	char b;
	while (read(l->uns_fds[UNS_GO_R], &b, 1) < 0 && errno == EINTR)
		;
	_exit(0);
}

// close_uns closes what the owner task left open: it is killed first
// (through its pidfd, stopped or not), then every pipe end.
static void close_uns(struct dsec_launch *l) {
	if (l->uns_fds[UNS_PIDFD] >= 0)
		syscall(SYS_pidfd_send_signal, l->uns_fds[UNS_PIDFD], SIGKILL, NULL, 0);
	for (int i = 0; i < 5; i++) {
		// Forgotten before it is closed: a middle killed in between
		// leaks it rather than have the edge close a reused number.
		int fd = l->uns_fds[i];
		l->uns_fds[i] = -1;
		if (fd >= 0)
			close(fd);
	}
}

// proc_path writes "/proc/<pid>/<file>" into buf.
static void proc_path(char *buf, size_t cap, pid_t pid, const char *file) {
	size_t n = 0;
	put(buf, &n, cap, "/proc/");
	put_num(buf, &n, cap, (unsigned)pid);
	put(buf, &n, cap, "/");
	put(buf, &n, cap, file);
}

// write_map writes "0 host size" into /proc/<pid>/<file>, returning 0 or
// an errno.
static int write_map(struct dsec_launch *l, pid_t pid, const char *file) {
	char path[64], m[64];
	size_t k = 0;
	proc_path(path, sizeof path, pid, file);
	put(m, &k, sizeof m, "0 ");
	put_num(m, &k, sizeof m, l->userns_host);
	put(m, &k, sizeof m, " ");
	put_num(m, &k, sizeof m, l->userns_size);
	put(m, &k, sizeof m, "\n");
	int fd = open(path, O_WRONLY | O_CLOEXEC);
	if (fd < 0)
		return errno;
	int err = write(fd, m, k) == (ssize_t)k ? 0 : errno;
	close(fd);
	return err;
}

// make_userns makes the sandbox's user namespace, owned by its owner uid
// rather than root (the kernel's per-user counts, owner.h), through a task
// that shares this memory instead of a holder process to exec; writes its
// ID maps as host root; and leaves it open at l->userns_fd for init to
// join. On failure it exits the middle, with nothing of its own left.
static void make_userns(struct dsec_launch *l) {
	int p[2] = {-1, -1}, q[2] = {-1, -1}, pidfd = -1, err = 0;
	pid_t pid = -1;
	const char *step = NULL, *arg = NULL;
	l->middle_pid = getpid();
	if (pipe2(p, O_CLOEXEC) < 0 || pipe2(q, O_CLOEXEC) < 0) {
		step = "pipe for the user namespace's owner", err = errno;
		goto out;
	}
	l->uns_fds[UNS_READY_R] = p[0];
	l->uns_fds[UNS_READY_W] = p[1];
	l->uns_fds[UNS_GO_R] = q[0];
	l->uns_fds[UNS_GO_W] = q[1];
	pid = clone(owner_task, (char *)l->stack + 3 * STACK_SIZE, CLONE_VM | CLONE_FILES | CLONE_PIDFD | SIGCHLD, l,
		    &pidfd);
	if (pid < 0) {
		step = "clone of the user namespace's owner", err = errno;
		goto out;
	}
	l->uns_fds[UNS_PIDFD] = pidfd;
	// Ready, or gone: its pidfd turns readable when it exits (having
	// written why into l->err, unless killed). Or neither within
	// l->owner_wait_ms: a task stopped or held by anything that runs as the
	// owner uid (nothing should) would otherwise hold the launch, and
	// its create slot, forever.
	struct pollfd fds[2] = {{.fd = p[0], .events = POLLIN}, {.fd = pidfd, .events = POLLIN}};
	int n;
	while ((n = poll(fds, 2, l->owner_wait_ms)) < 0 && errno == EINTR)
		;
	char b = 0;
	if (n == 0) {
		step = "the user namespace's owner task did not answer in time", err = ETIMEDOUT;
		goto out;
	}
	if (!(fds[0].revents & POLLIN) || read(p[0], &b, 1) != 1 || b != '1') {
		step = "the user namespace's owner task died", err = 0;
		goto out;
	}
	if ((err = write_map(l, pid, "uid_map")) != 0) {
		step = "writing the user namespace's", arg = "uid_map";
		goto out;
	}
	if ((err = write_map(l, pid, "gid_map")) != 0) {
		step = "writing the user namespace's", arg = "gid_map";
		goto out;
	}
	char path[64];
	proc_path(path, sizeof path, pid, "ns/user");
	l->userns_fd = open(path, O_RDONLY | O_CLOEXEC);
	if (l->userns_fd < 0)
		step = "opening the user namespace", err = errno;
out:
	// Killed, not asked to go: a task stopped after its ready byte
	// would not read the EOF, and the reap below would wait for good.
	close_uns(l);
	if (pid > 0)
		while (waitpid(pid, NULL, __WALL) < 0 && errno == EINTR)
			;
	if (step && !l->err[0])
		fail(l, step, arg, err);
	if (step)
		_exit(125);
}

// middle runs between the edge and init, so that init is not the edge's
// child: it clones init (child, above) and exits once init has exec'd,
// leaving init to the host's reaper, as `crun run -d` does. An init that
// were the edge's child would stay a zombie, holding its pid (and its
// pids-cgroup charge), whenever it died on its own.
static int middle(void *arg) {
	struct dsec_launch *l = arg;
	if (l->userns_owner)
		make_userns(l);
	int flags = CLONE_VM | CLONE_VFORK | CLONE_PIDFD | CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS |
		    SIGCHLD;
	if (l->netns_fd < 0)
		flags |= CLONE_NEWNET;
	int pidfd = -1;
	pid_t pid = clone(child, (char *)l->stack + 2 * STACK_SIZE, flags, l, &pidfd);
	if (pid < 0)
		fail(l, "clone", NULL, errno);
	if (l->err[0]) {
		waitpid(pid, NULL, 0);
		close(pidfd);
		_exit(125);
	}
	// The pidfd lands in the edge's fd table (the middle shares it): the
	// edge checks through it that init runs, with no pid to be reused.
	l->pidfd = pidfd;
	l->pid = pid;
	_exit(0);
}

int dsec_launch(struct dsec_launch *l) {
	l->err[0] = 0;
	l->pid = 0;
	l->pidfd = -1;
	l->leaked = 0;
	l->userns_fd = -1;
	for (int i = 0; i < 5; i++)
		l->uns_fds[i] = -1;
	l->stack = mmap(NULL, STACKS * STACK_SIZE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
	if (l->stack == MAP_FAILED)
		return -errno;
	sigset_t all;
	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &l->oldmask);
	pid_t mid = clone(middle, (char *)l->stack + STACK_SIZE, CLONE_VM | CLONE_VFORK | CLONE_FILES | SIGCHLD, l);
	int err = errno;
	pthread_sigmask(SIG_SETMASK, &l->oldmask, NULL);
	if (mid < 0) {
		munmap(l->stack, STACKS * STACK_SIZE);
		return -err;
	}
	// middle has exited (after init exec'd or failed): reap it.
	int status = 0;
	while (waitpid(mid, &status, __WALL) < 0 && errno == EINTR)
		;
	if (!WIFEXITED(status)) {
		// Killed from outside: init may still be running its setup on
		// the shared stack and memory. Leave both be (leaked) and let
		// the caller kill what is in the sandbox's cgroup.
		l->leaked = 1;
		if (l->userns_fd >= 0)
			close(l->userns_fd); // init, if started, has its own
		close_uns(l);        // the middle died waiting for the owner task
		size_t n = 0;
		put(l->err, &n, sizeof l->err, "launcher killed before init started: wait status ");
		put_num(l->err, &n, sizeof l->err, (unsigned)status);
		return 0;
	}
	munmap(l->stack, STACKS * STACK_SIZE);
	if (l->userns_fd >= 0)
		close(l->userns_fd); // init has its own, or failed
	if (l->err[0])
		return 0;
	if (WEXITSTATUS(status) != 0 || l->pid <= 0 || l->pidfd < 0) {
		size_t n = 0;
		put(l->err, &n, sizeof l->err, "launcher failed before init started: exit status ");
		put_num(l->err, &n, sizeof l->err, (unsigned)WEXITSTATUS(status));
		return 0;
	}
	return l->pid;
}
