// The exec helper's C half. It runs as an ELF constructor, before the Go
// runtime starts any thread, in a process the edge started as
// /proc/self/exe with argv[0] == "dsec-nsexec": single-threaded, so it can
// setns(2) into a mount namespace, which a Go process cannot.
//
// Protocol (see nsexec.go, which writes the config):
//   argv[1..]  the command; the environment is the command's, verbatim
//   fd 3       pidfd of the sandbox's init
//   fd 4       config (memfd, read from offset 0): see read_config
//   fd 5       error pipe: a setup failure writes "<kind>:<message>" here
//              and exits 125; on a successful execve it closes (CLOEXEC),
//              so the edge reads EOF and knows the command runs.
//
// The helper joins the sandbox's cgroups and namespaces, forks (a pid
// namespace applies to children), and waits for the child, exiting with
// its status (128+signal when killed). The child drops the bounding set,
// switches to the command's user and groups, trims its capabilities, sets
// its open-files limit, changes directory, sets no_new_privs, installs the
// seccomp filter and execs. It is non-dumpable until the exec, so processes
// already in the sandbox cannot look into it while it still holds host
// file descriptors and full capabilities.

#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/mount.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef CLOSE_RANGE_CLOEXEC
#define CLOSE_RANGE_CLOEXEC (1U << 2)
#endif

enum { FD_PIDFD = 3, FD_CONFIG = 4, FD_ERR = 5 };

// Config flags.
enum {
	// FLAG_TTY: stdin is a terminal; the command leads a new session with
	// it as the controlling terminal (an interactive shell's job control
	// needs that).
	FLAG_TTY = 1,
	// FLAG_PRIVATE: the command runs in a pid namespace of its own, a
	// sibling of the sandbox's (the sandbox's processes cannot see,
	// signal or trace it, nor read its descriptors through /proc), with a
	// mount namespace copied from the sandbox's in which /proc is that
	// pid namespace's, under the same masks. See private_proc.
	FLAG_PRIVATE = 2,
};

#define MAX_CONFIG (4 << 20)
#define MAX_GROUPS 256
#define MAX_CGROUPS 64

struct config {
	uint32_t uid, gid, ngroups;
	gid_t groups[MAX_GROUPS];
	uint32_t nsflags;
	uint64_t caps, bounding, nofile;
	uint32_t flags;
	uint32_t stdio_uid, stdio_gid; // host IDs; NO_OWNER: leave stdio be
	char *cwd;
	uint32_t ncgroups;
	char *cgroups[MAX_CGROUPS];
	uint32_t nfilter;
	struct sock_filter *filter;
};

// fail reports a setup failure on the error pipe and exits. kind tells the
// edge how to classify it ("cwd" is the caller's mistake, "setup" ours).
static void fail(const char *kind, const char *fmt, ...) {
	char msg[1024];
	int n = snprintf(msg, sizeof msg, "%s:", kind);
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg + n, sizeof msg - n, fmt, ap);
	va_end(ap);
	ssize_t w = write(FD_ERR, msg, strlen(msg));
	(void)w;
	_exit(125);
}

struct reader {
	const unsigned char *p, *end;
};

static uint32_t get32(struct reader *r) {
	if (r->end - r->p < 4)
		fail("setup", "config truncated");
	uint32_t v;
	memcpy(&v, r->p, 4);
	r->p += 4;
	return v;
}

static uint64_t get64(struct reader *r) {
	if (r->end - r->p < 8)
		fail("setup", "config truncated");
	uint64_t v;
	memcpy(&v, r->p, 8);
	r->p += 8;
	return v;
}

// getstr returns a NUL-terminated copy of a length-prefixed string.
static char *getstr(struct reader *r) {
	uint32_t n = get32(r);
	if ((size_t)(r->end - r->p) < n || n > 4096)
		fail("setup", "config string too long");
	char *s = malloc(n + 1);
	if (!s)
		fail("setup", "out of memory");
	memcpy(s, r->p, n);
	s[n] = 0;
	if (strlen(s) != n)
		fail("setup", "config string holds a NUL byte");
	r->p += n;
	return s;
}

#define NO_OWNER 0xffffffffu

// read_config parses, in little-endian: "DSX3", uid, gid, ngroups,
// groups[ngroups], nsflags (u32); caps, bounding, nofile (u64); flags,
// stdio_uid, stdio_gid (u32); cwd
// (u32 length + bytes); ncgroups (u32) and each cgroup.procs path; nfilter
// (u32) and nfilter struct sock_filter (8 bytes each).
static void read_config(struct config *c) {
	unsigned char *buf = malloc(MAX_CONFIG);
	if (!buf)
		fail("setup", "out of memory");
	size_t len = 0;
	for (;;) {
		ssize_t n = pread(FD_CONFIG, buf + len, MAX_CONFIG - len, len);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0)
			fail("setup", "reading config: %s", strerror(errno));
		if (n == 0)
			break;
		len += n;
		if (len == MAX_CONFIG)
			fail("setup", "config too large");
	}
	close(FD_CONFIG);
	struct reader r = {buf, buf + len};
	if (len < 4 || memcmp(buf, "DSX3", 4) != 0)
		fail("setup", "config: bad magic");
	r.p += 4;
	c->uid = get32(&r);
	c->gid = get32(&r);
	c->ngroups = get32(&r);
	if (c->ngroups > MAX_GROUPS)
		fail("setup", "config: %u groups", c->ngroups);
	for (uint32_t i = 0; i < c->ngroups; i++)
		c->groups[i] = get32(&r);
	c->nsflags = get32(&r);
	c->caps = get64(&r);
	c->bounding = get64(&r);
	c->nofile = get64(&r);
	c->flags = get32(&r);
	c->stdio_uid = get32(&r);
	c->stdio_gid = get32(&r);
	c->cwd = getstr(&r);
	c->ncgroups = get32(&r);
	if (c->ncgroups > MAX_CGROUPS)
		fail("setup", "config: %u cgroups", c->ncgroups);
	for (uint32_t i = 0; i < c->ncgroups; i++)
		c->cgroups[i] = getstr(&r);
	c->nfilter = get32(&r);
	if (c->nfilter == 0 || c->nfilter > BPF_MAXINSNS || (size_t)(r.end - r.p) != (size_t)c->nfilter * sizeof(struct sock_filter))
		fail("setup", "config: bad seccomp filter (%u instructions)", c->nfilter);
	c->filter = (struct sock_filter *)r.p;
}

// own_stdio gives the command's stdio, where it is a pipe, a socket or a
// terminal made for it, to the user it runs as, seen from the host: in a
// user namespace, host root's pipe is nobody's inside, and the command
// could not open /dev/stdin (/proc/self/fd/0) again, as shells do for
// `sh /dev/stdin`. Done while the helper is still host root; anything
// else (the host's /dev/null, through a read-only mount) is left be.
static void own_stdio(struct config *c) {
	if (c->stdio_uid == NO_OWNER)
		return;
	for (int fd = 0; fd < 3; fd++) {
		struct stat st;
		if (fstat(fd, &st) < 0)
			fail("setup", "stdio %d: %s", fd, strerror(errno));
		unsigned maj = major(st.st_rdev);
		int pty = S_ISCHR(st.st_mode) && maj >= 136 && maj <= 143; // a devpts slave
		if (!S_ISFIFO(st.st_mode) && !S_ISSOCK(st.st_mode) && !pty)
			continue;
		if (fchown(fd, c->stdio_uid, c->stdio_gid) < 0)
			fail("setup", "giving stdio %d to the command's user: %s", fd, strerror(errno));
	}
}

static void join_cgroups(struct config *c) {
	for (uint32_t i = 0; i < c->ncgroups; i++) {
		int fd = open(c->cgroups[i], O_WRONLY | O_CLOEXEC);
		if (fd < 0)
			fail("setup", "opening %s: %s", c->cgroups[i], strerror(errno));
		if (write(fd, "0", 1) != 1)
			fail("setup", "joining %s: %s", c->cgroups[i], strerror(errno));
		close(fd);
	}
}

static void drop_bounding(uint64_t keep) {
	for (int cap = 0; cap < 64; cap++) {
		if (keep & (1ULL << cap))
			continue;
		if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0) {
			if (errno == EINVAL)
				break; // past the kernel's last capability
			fail("setup", "dropping capability %d: %s", cap, strerror(errno));
		}
	}
}

static void set_caps(uint64_t caps) {
	struct __user_cap_header_struct hdr = {_LINUX_CAPABILITY_VERSION_3, 0};
	struct __user_cap_data_struct data[2] = {
	    {(uint32_t)caps, (uint32_t)caps, 0},
	    {(uint32_t)(caps >> 32), (uint32_t)(caps >> 32), 0},
	};
	if (syscall(SYS_capset, &hdr, data) < 0)
		fail("setup", "setting capabilities: %s", strerror(errno));
	if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0 && errno != EINVAL)
		fail("setup", "clearing ambient capabilities: %s", strerror(errno));
}

// reset_oom_score: the command gets the default OOM score adjustment (0),
// not the daemon's -999, written while CAP_SYS_RESOURCE is held so that
// the sandbox cannot lower it again.
static void reset_oom_score(void) {
	int fd = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
	if (fd < 0 || write(fd, "0", 1) != 1)
		fail("setup", "resetting oom_score_adj: %s", strerror(errno));
	close(fd);
}

#define MAX_PROC_MOUNTS 256

// private_proc gives the command, pid 1 of a new pid namespace, a mount
// namespace of its own (a copy of the sandbox's, propagating nothing back)
// whose /proc is a new procfs of that namespace. The sandbox's masks on
// /proc (binds over /proc/kcore, read-only /proc/sys, ...) are cloned
// before the new procfs covers them and attached again on top of it, so
// the command sees what any process of the sandbox sees, and only itself.
// Runs while the helper still holds the host's privileges; a sandbox with
// a user namespace is joined after (join_userns), so the new mounts belong
// to the host and are locked against the sandbox.
static void private_proc(void) {
	if (unshare(CLONE_NEWNS) < 0)
		fail("setup", "private mount namespace: %s", strerror(errno));
	if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
		fail("setup", "making mounts private: %s", strerror(errno));
	// The sandbox's /proc, held before the new one covers it: its masks
	// are cloned through it. (It cannot be read for mountinfo: this
	// process is not in its pid namespace, so its /proc/self is absent.)
	int old = open("/proc", O_PATH | O_DIRECTORY | O_CLOEXEC);
	if (old < 0)
		fail("setup", "opening /proc: %s", strerror(errno));
	if (mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0)
		fail("setup", "mounting a private /proc: %s", strerror(errno));
	static char *paths[MAX_PROC_MOUNTS];
	int n = 0;
	FILE *mi = fopen("/proc/self/mountinfo", "re");
	if (!mi)
		fail("setup", "reading mountinfo: %s", strerror(errno));
	char line[8192];
	while (fgets(line, sizeof line, mi)) {
		// id parent major:minor root mountpoint ...
		char *f = line;
		for (int i = 0; i < 4 && f; i++) {
			f = strchr(f, ' ');
			if (f)
				f++;
		}
		if (!f)
			continue;
		char *end = strchr(f, ' ');
		if (!end)
			continue;
		*end = 0;
		if (strncmp(f, "/proc/", 6) != 0 || strchr(f, '\\'))
			continue; // not under /proc, or an escaped (odd) name
		int seen = 0;
		for (int i = 0; i < n && !seen; i++)
			seen = strcmp(paths[i], f) == 0;
		if (seen)
			continue;
		if (n == MAX_PROC_MOUNTS)
			fail("setup", "more than %d mounts under /proc", MAX_PROC_MOUNTS);
		paths[n] = strdup(f);
		if (!paths[n])
			fail("setup", "out of memory");
		n++;
	}
	fclose(mi);
	// Mountinfo lists parents before children: /proc/sys is attached
	// before anything under it.
	for (int i = 0; i < n; i++) {
		int fd = (int)syscall(SYS_open_tree, old, paths[i] + 6, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
		if (fd < 0)
			fail("setup", "cloning the mask on %s: %s", paths[i], strerror(errno));
		if (syscall(SYS_move_mount, fd, "", AT_FDCWD, paths[i], MOVE_MOUNT_F_EMPTY_PATH) < 0) {
			// A mask of an entry the new procfs does not have (a pid's)
			// masks nothing; any other failure would leave it unmasked.
			if (errno != ENOENT)
				fail("setup", "masking %s: %s", paths[i], strerror(errno));
		}
		close(fd);
	}
	close(old);
}

static void child(struct config *c, char **argv) {
	if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) < 0)
		fail("setup", "prctl dumpable: %s", strerror(errno));
	if (c->flags & FLAG_PRIVATE) {
		private_proc();
		if (c->nsflags & CLONE_NEWUSER) {
			if (setns(FD_PIDFD, CLONE_NEWUSER) < 0)
				fail("setup", "entering the sandbox's user namespace: %s", strerror(errno));
		}
	}
	close(FD_PIDFD);
	reset_oom_score();
	drop_bounding(c->bounding);
	if (setgroups(c->ngroups, c->groups) < 0)
		fail("setup", "setgroups: %s", strerror(errno));
	if (setresgid(c->gid, c->gid, c->gid) < 0)
		fail("setup", "setting gid %u: %s", c->gid, strerror(errno));
	if (setresuid(c->uid, c->uid, c->uid) < 0)
		fail("setup", "setting uid %u: %s", c->uid, strerror(errno));
	// A non-root user lost its permitted set with setresuid; root keeps
	// exactly the sandbox's set.
	set_caps(c->uid == 0 ? c->caps : 0);
	struct rlimit rl = {c->nofile, c->nofile};
	if (c->nofile && setrlimit(RLIMIT_NOFILE, &rl) < 0)
		fail("setup", "setting open files limit: %s", strerror(errno));
	// The helper leads its own process group, so its child may start a
	// session; the terminal is attached before the user changes, while
	// the capability to steal it is not needed (it is no one's yet).
	if (c->flags & FLAG_TTY) {
		if (setsid() < 0)
			fail("setup", "setsid: %s", strerror(errno));
		if (ioctl(0, TIOCSCTTY, 0) < 0)
			fail("setup", "attaching the terminal: %s", strerror(errno));
	}
	if (chdir(c->cwd) < 0)
		fail("cwd", "working directory %s: %s", c->cwd, strerror(errno));
	umask(022);
	if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
		fail("setup", "no_new_privs: %s", strerror(errno));
	// Every descriptor but stdio closes on exec, the error pipe included.
	if (syscall(SYS_close_range, 3, ~0U, CLOSE_RANGE_CLOEXEC) < 0)
		fail("setup", "close_range: %s", strerror(errno));
	struct sock_fprog prog = {(unsigned short)c->nfilter, c->filter};
	if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog) < 0)
		fail("setup", "installing seccomp filter: %s", strerror(errno));
	execvpe(argv[0], argv, environ);
	// Like a shell: 127 when nothing by that name exists, 126 otherwise.
	int err = errno;
	dprintf(2, "dsec: exec %s: %s\n", argv[0], strerror(err));
	_exit(err == ENOENT || err == ENOTDIR ? 127 : 126);
}

static void nsexec(char **argv) {
	struct config c = {0};
	read_config(&c);
	own_stdio(&c);
	join_cgroups(&c);
	uint32_t join = c.nsflags;
	if (c.flags & FLAG_PRIVATE)
		join &= ~(uint32_t)(CLONE_NEWPID | CLONE_NEWUSER); // see private_proc
	if (setns(FD_PIDFD, join) < 0)
		fail("setup", "entering the sandbox's namespaces: %s", strerror(errno));
	if (c.flags & FLAG_PRIVATE) {
		if (unshare(CLONE_NEWPID) < 0)
			fail("setup", "private pid namespace: %s", strerror(errno));
	}
	pid_t pid = fork();
	if (pid != 0)
		close(FD_PIDFD);
	if (pid < 0)
		fail("setup", "fork: %s", strerror(errno));
	if (pid == 0)
		child(&c, argv);
	close(FD_ERR);
	int status;
	while (waitpid(pid, &status, 0) < 0) {
		if (errno != EINTR)
			_exit(125);
	}
	if (WIFSIGNALED(status))
		_exit(128 + WTERMSIG(status));
	_exit(WEXITSTATUS(status));
}

// glibc passes argc, argv and envp to ELF constructors.
__attribute__((constructor)) static void dsec_nsexec_init(int argc, char **argv, char **envp) {
	(void)envp;
	if (argc < 2 || argv == NULL || argv[0] == NULL || strcmp(argv[0], "dsec-nsexec") != 0)
		return;
	nsexec(argv + 1);
}
