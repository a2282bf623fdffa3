// The holder of a sandbox's user namespace: a process the edge starts as
// /proc/self/exe with argv[0] == "dsec-userns" and argv[1] the host uid
// that is to own the namespace. It runs as an ELF constructor, before the
// Go runtime starts a thread, so that unshare(CLONE_NEWUSER) is allowed.
//
// It becomes the owner in a new user namespace (become_owner, owner.h),
// writes one byte to stdout, and waits until stdin closes. The edge writes
// the namespace's ID maps once it reads the byte, has the runtime join
// /proc/<pid>/ns/user, then closes stdin. The holder dies with the edge
// (PR_SET_PDEATHSIG, and stdin's EOF: only the edge holds its other end).
// The launcher (launch.c) needs no holder: it makes the namespace from a
// task of its own.

#define _GNU_SOURCE
#include <errno.h>
#include <grp.h>
#include <linux/capability.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "owner.h"

static void holder_fail(const char *what, int err) {
	dprintf(2, "dsec-userns: %s: %s\n", what, strerror(err));
	_exit(125);
}

static void userns_holder(const char *arg) {
	char *end = NULL;
	errno = 0;
	unsigned long owner = strtoul(arg, &end, 10);
	if (errno != 0 || end == arg || *end != 0 || owner == 0 || owner >= 0xffffffffUL)
		holder_fail("owner uid", EINVAL);
	int err = 0;
	const char *step = become_owner(owner, &err);
	if (step)
		holder_fail(step, err);
	if (write(1, "1", 1) != 1)
		_exit(125);
	char b;
	while (read(0, &b, 1) > 0)
		;
	_exit(0);
}

// glibc passes argc, argv and envp to ELF constructors.
__attribute__((constructor)) static void dsec_userns_init(int argc, char **argv, char **envp) {
	(void)envp;
	if (argc != 2 || argv == NULL || argv[0] == NULL || strcmp(argv[0], "dsec-userns") != 0)
		return;
	userns_holder(argv[1]);
}
