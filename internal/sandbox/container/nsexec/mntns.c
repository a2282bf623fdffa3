// The rootfs launcher: starts the OCI runtime in a mount namespace of its
// own in which the sandbox's rootfs is attached, from a vfork'd child of
// the edge itself (no helper binary is executed in between).
//
// Why: the edge builds each sandbox's overlay as a detached mount (see
// layer.DetachedOverlay) instead of mounting it on the host. Attached here,
// in a private namespace that only the runtime and then the sandbox copy,
// it never appears in the host's mount table, which would otherwise grow by
// one entry per sandbox and make every later create slower (each new mount
// namespace copies that table; the runtime reads mountinfo several times).
// Doing it in a vfork'd child instead of re-executing the dsec binary as a
// helper saves an exec of a 22 MB binary per create (~1 ms, and 6% of the
// node's CPU in a burst of creates).
//
// The child shares the edge's memory until it execs, so it only makes
// system calls on its own stack: no allocation, no stdio. All signals are
// blocked around the vfork, and the child sets every handled signal back
// to its default before it unblocks them, so no Go signal handler can run
// in it.
//
// Steps in the child: stdio to nullfd (or /dev/null when it is -1); unshare(CLONE_NEWNS); make every
// mount a slave, so that nothing mounted here propagates back to the host
// (mounts made on the host still arrive); move_mount the rootfs onto
// target; exec the runtime. A failure writes "step: errno N" to errfd (close-
// on-exec, so a successful exec closes it and the caller reads EOF) and
// exits 125.

#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "vforked.h"

#ifndef MOVE_MOUNT_F_EMPTY_PATH
#define MOVE_MOUNT_F_EMPTY_PATH 0x00000004
#endif

// spawn_fail reports what failed and the errno, with write(2) only.
static void spawn_fail(int errfd, const char *what, int err) {
	char buf[160];
	size_t n = 0;
	for (const char *p = what; *p && n < sizeof buf - 24; p++)
		buf[n++] = *p;
	const char *mid = ": errno ";
	for (const char *p = mid; *p; p++)
		buf[n++] = *p;
	char digits[12];
	int d = 0;
	unsigned v = err < 0 ? 0 : (unsigned)err;
	do {
		digits[d++] = (char)('0' + v % 10);
		v /= 10;
	} while (v && d < (int)sizeof digits);
	while (d > 0)
		buf[n++] = digits[--d];
	if (write(errfd, buf, n) < 0) {
		// The exit status says enough.
	}
	_exit(125);
}

// dsec_spawn_mntns starts path (argv, envp) as described above and returns
// its pid, or -errno when the vfork itself fails.
int dsec_spawn_mntns(int mntfd, const char *target, const char *path, char *const argv[], char *const envp[], int errfd, int nullfd) {
	sigset_t all, old;
	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &old);
	pid_t pid = vfork();
	if (pid == 0) {
		reset_handled_signals();
		int null = nullfd;
		if (null < 0 && (null = open("/dev/null", O_RDWR | O_CLOEXEC)) < 0)
			spawn_fail(errfd, "opening /dev/null", errno);
		for (int fd = 0; fd < 3; fd++)
			if (dup2(null, fd) < 0)
				spawn_fail(errfd, "redirecting stdio", errno);
		if (unshare(CLONE_NEWNS) < 0)
			spawn_fail(errfd, "unshare(CLONE_NEWNS)", errno);
		if (mount(NULL, "/", NULL, MS_REC | MS_SLAVE, NULL) < 0)
			spawn_fail(errfd, "making mounts slaves", errno);
		if (syscall(SYS_move_mount, mntfd, "", AT_FDCWD, target, MOVE_MOUNT_F_EMPTY_PATH) < 0)
			spawn_fail(errfd, "attaching the rootfs", errno);
		pthread_sigmask(SIG_SETMASK, &old, NULL);
		execve(path, argv, envp);
		spawn_fail(errfd, "exec of the runtime", errno);
	}
	int err = errno;
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (pid < 0)
		return -err;
	return pid;
}
