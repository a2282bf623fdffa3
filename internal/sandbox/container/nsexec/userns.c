// The holder of a sandbox's user namespace: a process the edge starts as
// /proc/self/exe with argv[0] == "dsec-userns" and argv[1] the host uid
// that is to own the namespace. It runs as an ELF constructor, before the
// Go runtime starts a thread, so that unshare(CLONE_NEWUSER) is allowed.
//
// The kernel charges the per-user counts of a user namespace's processes
// (inotify instances and watches, pending signals, message queue bytes,
// processes, locked memory) to each user namespace up the chain, and at
// the host's level to the user that created the namespace. A namespace
// made by the runtime belongs to host root, so every sandbox would share
// root's counts; one made here belongs to the sandbox's own uid.
//
// Steps: as root, raise RLIMIT_NPROC as far as it goes (the new namespace
// takes its process limit from its creator; the sandbox's pids cgroup is
// what bounds it),
// leave every supplementary group, become the owner (gid and uid), make
// the user namespace, write one byte to stdout, and wait until stdin
// closes. The edge writes the namespace's ID maps once it reads the byte,
// has the runtime join /proc/<pid>/ns/user, then closes stdin. The holder
// dies with the edge (PR_SET_PDEATHSIG) and holds no capability outside
// its namespace once it changed uid.

#define _GNU_SOURCE
#include <errno.h>
#include <grp.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <unistd.h>

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
	if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0)
		holder_fail("PR_SET_PDEATHSIG", errno);
	if (getppid() == 1)
		_exit(125); // the edge is gone already
	// As high as it goes: unlimited, or the hard limit where root lacks
	// CAP_SYS_RESOURCE.
	struct rlimit rl = {.rlim_cur = RLIM_INFINITY, .rlim_max = RLIM_INFINITY};
	if (setrlimit(RLIMIT_NPROC, &rl) < 0) {
		if (getrlimit(RLIMIT_NPROC, &rl) < 0)
			holder_fail("reading RLIMIT_NPROC", errno);
		rl.rlim_cur = rl.rlim_max;
		if (setrlimit(RLIMIT_NPROC, &rl) < 0)
			holder_fail("raising RLIMIT_NPROC", errno);
	}
	if (setgroups(0, NULL) < 0)
		holder_fail("setgroups", errno);
	if (setresgid((gid_t)owner, (gid_t)owner, (gid_t)owner) < 0)
		holder_fail("setresgid", errno);
	if (setresuid((uid_t)owner, (uid_t)owner, (uid_t)owner) < 0)
		holder_fail("setresuid", errno);
	if (unshare(CLONE_NEWUSER) < 0)
		holder_fail("unshare(CLONE_NEWUSER)", errno);
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
