// Shared between launch.c and launch.go: what the edge hands the sandbox
// launcher.
#ifndef DSEC_LAUNCH_H
#define DSEC_LAUNCH_H

#include <signal.h>
#include <stdint.h>

// dsec_op is one step of the mount program, run in order inside the
// rootfs. kind:
//   'F' new filesystem of type arg1 with parameters arg2 ("k=v,flag")
//       on directory target (created if missing)
//   'D' bind mount of host directory arg1 onto directory target
//   'f' bind mount of host file arg1 onto file target (created empty)
//   'r' 'f' onto a target that may be a symlink, resolved inside the rootfs
//   'M' bind mount of host path arg1 onto existing target (masking a kernel
//       file or directory)
//   'R' read-only rebind of existing target onto itself
// Targets of all but 'r' must not involve a symlink: the launcher refuses
// one (ELOOP).
//   'L' symlink target -> arg1
//   'P' directory target (created if missing) set to mode arg1 (octal)
//       and rebound onto itself: a mount point with its own flags that
//       adds no filesystem
//   'T' clone of the mount tree open at fd arg1 (decimal) onto directory
//       target
// attr is the MOUNT_ATTR_* set of the new mount.
struct dsec_op {
	int kind;
	const char *target, *arg1, *arg2;
	unsigned attr;
};

struct dsec_launch {
	int rootfs_mnt;     // detached rootfs mount, or -1 (already mounted)
	const char *rootfs; // host path of the rootfs mount point
	const struct dsec_op *ops;
	int nops;
	const char *hostname;
	const int *cgroup_fds; // cgroup.procs of each hierarchy, O_WRONLY
	int ncgroups;
	int cgroupns;
	int netns_fd; // network namespace to join (fresh, lo up), or -1: a new one
	// A user namespace for init to join last, made by userns_owner (0:
	// none) with IDs 0..userns_size-1 mapped to host IDs userns_host..
	unsigned userns_owner, userns_host, userns_size;
	int userns_fd;          // the namespace, once made (launch.c), or -1
	int owner_wait_ms;      // how long the owner task may take to make it
	// The owner task's pipes (ready read and write ends, go read and
	// write ends) and pidfd while it runs, -1 once closed; the middle's
	// pid (launch.c).
	int uns_fds[5];
	int middle_pid;
	uint64_t caps; // effective = permitted = bounding
	int last_cap;
	uint64_t nofile;
	const void *filter; // struct sock_filter[nfilter]
	unsigned short nfilter;
	char *const *argv;
	char *const *envp;
	sigset_t oldmask;
	int null_fd; // stdio of init
	void *stack; // of the middle process and init, until they exec
	int pid;     // init's pid, set by the middle process
	int pidfd;   // init's pidfd, in the caller's fd table (-1: none)
	int leaked;  // the middle was killed: this memory may still be in use
	int err_errno;
	char err[512];
};

int dsec_launch(struct dsec_launch *l);

#endif
