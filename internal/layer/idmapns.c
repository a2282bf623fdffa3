// A user namespace with one ID range, made without starting a program:
// a task that shares this process's memory and fd table is cloned into a
// new user namespace (made by root, owned by root) and waits on a pipe;
// this thread writes its ID maps, opens the namespace and lets the task
// go. Idmapped mounts take the open namespace (idmap_cgo.go).

#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "idmapns.h"

#define IDMAP_STACK (64 << 10)

struct idmap_arg {
	int fd;       // the pipe's read end
	pid_t parent; // the process that cloned the task
};

// idmap_task waits for EOF on the pipe. System calls only: it shares the
// Go process's memory.
//
// It shares the fd table too, the pipe's write end and every descriptor
// of the process with it (the edge's listener among them): were the
// process killed before closing the write end, no EOF would ever come,
// and the task would hold them all for good (a restarted edge could not
// listen on its address). So it dies with the thread that cloned it,
// which waits for it.
static int idmap_task(void *arg) {
	struct idmap_arg *a = arg;
	if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0 || getppid() != a->parent)
		_exit(1); // the parent is already gone
	char b;
	while (read(a->fd, &b, 1) < 0 && errno == EINTR)
		;
	_exit(0);
}

static int write_id_map(pid_t pid, const char *file, unsigned host, unsigned size) {
	char path[64], m[64];
	snprintf(path, sizeof path, "/proc/%d/%s", (int)pid, file);
	int n = snprintf(m, sizeof m, "0 %u %u\n", host, size);
	int fd = open(path, O_WRONLY | O_CLOEXEC);
	if (fd < 0)
		return errno;
	int err = write(fd, m, n) == n ? 0 : errno;
	close(fd);
	return err;
}

int dsec_idmap_ns(unsigned host, unsigned size) {
	int p[2];
	if (pipe2(p, O_CLOEXEC) < 0)
		return -errno;
	void *stack = mmap(NULL, IDMAP_STACK, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
	if (stack == MAP_FAILED) {
		int err = errno;
		close(p[0]);
		close(p[1]);
		return -err;
	}
	// Every signal stays blocked in the task: no Go handler runs there.
	sigset_t all, old;
	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &old);
	struct idmap_arg arg = {.fd = p[0], .parent = getpid()};
	pid_t pid = clone(idmap_task, (char *)stack + IDMAP_STACK, CLONE_NEWUSER | CLONE_VM | CLONE_FILES | SIGCHLD, &arg);
	int err = errno;
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	int fd = -1;
	if (pid < 0) {
		fd = -err;
	} else if ((err = write_id_map(pid, "uid_map", host, size)) != 0 || (err = write_id_map(pid, "gid_map", host, size)) != 0) {
		fd = -err;
	} else {
		char path[64];
		snprintf(path, sizeof path, "/proc/%d/ns/user", (int)pid);
		fd = open(path, O_RDONLY | O_CLOEXEC);
		if (fd < 0)
			fd = -errno;
	}
	close(p[1]); // the task's EOF
	if (pid > 0)
		while (waitpid(pid, NULL, __WALL) < 0 && errno == EINTR)
			;
	close(p[0]);
	munmap(stack, IDMAP_STACK);
	return fd;
}
