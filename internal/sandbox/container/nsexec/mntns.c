// The rootfs launcher's C half. Like nsexec.c it runs as an ELF
// constructor, single-threaded, before the Go runtime starts: here in a
// process the container backend started as /proc/self/exe with
// argv[0] == "dsec-mntns", to run the OCI runtime in a mount namespace of
// its own in which the sandbox's rootfs is mounted.
//
// Why: the edge builds each sandbox's overlay as a detached mount (see
// layer.DetachedOverlay) instead of mounting it on the host. Attached here,
// in a private namespace that only the runtime and then the sandbox copy,
// it never appears in the host's mount table, which would otherwise grow by
// one entry per sandbox and make every later create slower (each new mount
// namespace copies that table; the runtime reads mountinfo several times).
//
// Protocol (see mntns.go):
//   argv[1]    where to attach the rootfs (an empty directory)
//   argv[2..]  the runtime's argv; argv[2] is its path; environment verbatim
//   fd 3       the detached mount
//   fd 4       error pipe: a setup failure writes its message here and
//              exits 125; it is close-on-exec, so a successful exec of the
//              runtime closes it and the backend reads EOF.
//
// Steps: unshare(CLONE_NEWNS); make every mount a slave, so that nothing
// mounted here propagates back to the host (mounts made on the host still
// arrive); move_mount the rootfs onto argv[1]; exec the runtime.

#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef MOVE_MOUNT_F_EMPTY_PATH
#define MOVE_MOUNT_F_EMPTY_PATH 0x00000004
#endif

enum { MNT_FD_MOUNT = 3, MNT_FD_ERR = 4 };

static void mnt_fail(const char *fmt, ...) {
	char buf[1024];
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(buf, sizeof buf, fmt, ap);
	va_end(ap);
	if (n > (int)sizeof buf - 1)
		n = sizeof buf - 1;
	if (n > 0 && write(MNT_FD_ERR, buf, n) < 0) {
		// Nothing more to say: the exit status tells the backend.
	}
	_exit(125);
}

static void mntns(int argc, char **argv) {
	if (fcntl(MNT_FD_ERR, F_SETFD, FD_CLOEXEC) < 0)
		_exit(125);
	if (argc < 3)
		mnt_fail("usage: dsec-mntns TARGET RUNTIME [ARGS...]");
	if (fcntl(MNT_FD_MOUNT, F_SETFD, FD_CLOEXEC) < 0)
		mnt_fail("rootfs mount fd: %s", strerror(errno));
	if (unshare(CLONE_NEWNS) < 0)
		mnt_fail("unshare(CLONE_NEWNS): %s", strerror(errno));
	if (mount(NULL, "/", NULL, MS_REC | MS_SLAVE, NULL) < 0)
		mnt_fail("making mounts slaves: %s", strerror(errno));
	if (syscall(SYS_move_mount, MNT_FD_MOUNT, "", AT_FDCWD, argv[1], MOVE_MOUNT_F_EMPTY_PATH) < 0)
		mnt_fail("attaching the rootfs at %s: %s", argv[1], strerror(errno));
	close(MNT_FD_MOUNT);
	execv(argv[2], argv + 2);
	mnt_fail("exec %s: %s", argv[2], strerror(errno));
}

__attribute__((constructor)) static void dsec_mntns_init(int argc, char **argv, char **envp) {
	(void)envp;
	if (argc < 1 || argv == NULL || argv[0] == NULL || strcmp(argv[0], "dsec-mntns") != 0)
		return;
	mntns(argc, argv);
}
