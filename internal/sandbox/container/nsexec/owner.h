// Becoming the owner of a sandbox's user namespace, shared by the holder
// (userns.c, for the runtime) and the launcher (launch.c): system calls
// only, safe in a task that shares the Go process's memory. The changes
// of credentials are raw system calls: glibc's setresuid and friends in a
// process it knows to have threads (the Go process's, whose memory the
// task shares) would take glibc's thread-list lock and mark every one of
// those threads for a credential change they are not part of.
#ifndef DSEC_OWNER_H
#define DSEC_OWNER_H

#include <errno.h>
#include <grp.h>
#include <linux/capability.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

// owner_caps leaves exactly caps permitted and effective (none
// inheritable).
static inline int owner_caps(uint64_t caps) {
	struct __user_cap_header_struct hdr = {.version = _LINUX_CAPABILITY_VERSION_3, .pid = 0};
	struct __user_cap_data_struct data[2];
	memset(data, 0, sizeof data);
	data[0].permitted = data[0].effective = (uint32_t)caps;
	data[1].permitted = data[1].effective = (uint32_t)(caps >> 32);
	return (int)syscall(SYS_capset, &hdr, data);
}

// become_owner turns the calling task, root, into host uid owner in a new
// user namespace (whose owner it then is) with no capability outside it.
// It returns NULL, or the step that failed with *err set.
//
// The kernel charges the per-user counts of a user namespace's processes
// (inotify instances and watches, pending signals, message queue bytes,
// processes, locked memory) to each user namespace up the chain, and at
// the host's level to the user that created the namespace: made by root,
// every sandbox would share root's counts.
//
// Steps: raise RLIMIT_NPROC as far as it goes (the new namespace takes its
// process limit from its creator; the sandbox's pids cgroup is what
// bounds it), become non-dumpable, leave every supplementary group, become
// the owner (gid and uid) keeping only CAP_SYS_ADMIN (a host that allows
// user namespaces only to it, kernel.unprivileged_userns_clone=0, still
// lets the task make one; the owner is the effective uid either way), set
// the parent-death signal again (the change of uid clears it), unshare,
// drop every capability.
static inline const char *become_owner(unsigned long owner, int *err) {
	// As high as it goes: unlimited, or the hard limit where root lacks
	// CAP_SYS_RESOURCE.
	struct rlimit rl = {.rlim_cur = RLIM_INFINITY, .rlim_max = RLIM_INFINITY};
	if (setrlimit(RLIMIT_NPROC, &rl) < 0) {
		if (getrlimit(RLIMIT_NPROC, &rl) < 0)
			goto fail_nproc;
		rl.rlim_cur = rl.rlim_max;
		if (setrlimit(RLIMIT_NPROC, &rl) < 0)
			goto fail_nproc;
	}
	// Nothing but root may look into it (a change of uid would clear this
	// too, unless fs.suid_dumpable says otherwise).
	if (prctl(PR_SET_DUMPABLE, 0) < 0)
		return *err = errno, "PR_SET_DUMPABLE";
	if (prctl(PR_SET_KEEPCAPS, 1) < 0)
		return *err = errno, "PR_SET_KEEPCAPS";
	if (syscall(SYS_setgroups, 0, NULL) < 0)
		return *err = errno, "setgroups";
	if (syscall(SYS_setresgid, (gid_t)owner, (gid_t)owner, (gid_t)owner) < 0)
		return *err = errno, "setresgid to the owner";
	if (syscall(SYS_setresuid, (uid_t)owner, (uid_t)owner, (uid_t)owner) < 0)
		return *err = errno, "setresuid to the owner";
	if (owner_caps(1ULL << CAP_SYS_ADMIN) < 0)
		return *err = errno, "capset";
	if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0)
		return *err = errno, "PR_SET_PDEATHSIG";
	if (unshare(CLONE_NEWUSER) < 0)
		return *err = errno, "unshare(CLONE_NEWUSER)";
	// No capability outside the new namespace from here on.
	if (owner_caps(0) < 0)
		return *err = errno, "capset";
	return NULL;
fail_nproc:
	*err = errno;
	return "raising RLIMIT_NPROC";
}

#endif
