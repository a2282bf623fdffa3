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
// what bounds it), become non-dumpable, leave every supplementary group,
// become the owner (gid and uid) keeping only CAP_SYS_ADMIN, make the user
// namespace, drop every capability, write one byte to stdout, and wait
// until stdin closes. The edge writes the namespace's ID maps once it
// reads the byte, has the runtime join /proc/<pid>/ns/user, then closes
// stdin. The holder dies with the edge (PR_SET_PDEATHSIG, and stdin's EOF:
// only the edge holds its other end).

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

static void holder_fail(const char *what, int err) {
	dprintf(2, "dsec-userns: %s: %s\n", what, strerror(err));
	_exit(125);
}

// set_holder_caps leaves exactly caps permitted and effective (none
// inheritable).
static void set_holder_caps(uint64_t caps) {
	struct __user_cap_header_struct hdr = {.version = _LINUX_CAPABILITY_VERSION_3, .pid = 0};
	struct __user_cap_data_struct data[2];
	memset(data, 0, sizeof data);
	data[0].permitted = data[0].effective = (uint32_t)caps;
	data[1].permitted = data[1].effective = (uint32_t)(caps >> 32);
	if (syscall(SYS_capset, &hdr, data) < 0)
		holder_fail("capset", errno);
}

static void userns_holder(const char *arg) {
	char *end = NULL;
	errno = 0;
	unsigned long owner = strtoul(arg, &end, 10);
	if (errno != 0 || end == arg || *end != 0 || owner == 0 || owner >= 0xffffffffUL)
		holder_fail("owner uid", EINVAL);
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
	// Nothing but root may look into it or write its maps (a change of
	// uid would clear this too, unless fs.suid_dumpable says otherwise).
	if (prctl(PR_SET_DUMPABLE, 0) < 0)
		holder_fail("PR_SET_DUMPABLE", errno);
	// CAP_SYS_ADMIN is kept through the change of uid: a host that allows
	// user namespaces only to it (kernel.unprivileged_userns_clone=0)
	// still lets the holder make one. The owner is the effective uid
	// either way.
	if (prctl(PR_SET_KEEPCAPS, 1) < 0)
		holder_fail("PR_SET_KEEPCAPS", errno);
	if (setgroups(0, NULL) < 0)
		holder_fail("setgroups", errno);
	if (setresgid((gid_t)owner, (gid_t)owner, (gid_t)owner) < 0)
		holder_fail("setresgid", errno);
	if (setresuid((uid_t)owner, (uid_t)owner, (uid_t)owner) < 0)
		holder_fail("setresuid", errno);
	set_holder_caps(1ULL << CAP_SYS_ADMIN);
	// A change of credentials clears the parent-death signal: set again,
	// so that the holder dies with the edge.
	if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0)
		holder_fail("PR_SET_PDEATHSIG", errno);
	if (unshare(CLONE_NEWUSER) < 0)
		holder_fail("unshare(CLONE_NEWUSER)", errno);
	// No capability outside the new namespace from here on.
	set_holder_caps(0);
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
