// counts_holder takes one per-user kernel resource until the kernel
// refuses more and prints how many it took; with "hold" it then keeps
// them until killed. The kernel charges these per user, up the chain of
// user namespaces to each namespace's owner:
//   inotify    inotify instances (fs.inotify.max_user_instances)
//   sigpending queued real-time signals (RLIMIT_SIGPENDING)
//   mqueue     POSIX message queues of 8 x 1 KiB (RLIMIT_MSGQUEUE bytes)
//   procs      processes, with RLIMIT_NPROC set to 64 first (the count is
//              the user's, all its processes; host root is exempt from
//              the limit: do not run this one there). The children wait
//              and die with the holder.
// and one the kernel keeps per host uid, whatever the namespace:
//   pipes      pipes of 1 MiB until a new pipe gets less than the default
//              64 KiB (fs.pipe-user-pages-soft; host root, with
//              CAP_SYS_ADMIN, is exempt: do not run this one there)
// Usage: counts_holder RESOURCE [hold]
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <mqueue.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

static int take_inotify(void) {
	int n = 0;
	while (inotify_init1(IN_CLOEXEC) >= 0)
		n++;
	return n;
}

static int take_sigpending(void) {
	sigset_t set;
	sigemptyset(&set);
	sigaddset(&set, SIGRTMIN);
	sigprocmask(SIG_BLOCK, &set, NULL);
	int n = 0;
	for (;;) {
		siginfo_t si;
		memset(&si, 0, sizeof si);
		si.si_signo = SIGRTMIN;
		si.si_code = SI_QUEUE;
		si.si_pid = getpid();
		si.si_uid = getuid();
		if (syscall(SYS_rt_sigqueueinfo, getpid(), SIGRTMIN, &si) < 0)
			break;
		n++;
	}
	return n;
}

static int take_mqueue(void) {
	struct mq_attr a;
	memset(&a, 0, sizeof a);
	a.mq_maxmsg = 8;
	a.mq_msgsize = 1024;
	int n = 0;
	for (;;) {
		char name[64];
		snprintf(name, sizeof name, "/counts-holder-%d-%d", getpid(), n);
		mqd_t q = mq_open(name, O_CREAT | O_EXCL | O_RDWR, 0600, &a);
		if (q == (mqd_t)-1)
			break;
		mq_unlink(name); // held by q alone; gone with the process
		n++;
	}
	return n;
}

static int take_procs(void) {
	struct rlimit rl = {64, 64};
	if (setrlimit(RLIMIT_NPROC, &rl) < 0)
		return -1;
	int n = 0;
	while (n < 4096) {
		pid_t pid = fork();
		if (pid < 0)
			break;
		if (pid == 0) {
			prctl(PR_SET_PDEATHSIG, SIGKILL);
			for (;;)
				pause();
		}
		n++;
	}
	return n;
}

static int take_pipes(void) {
	int n = 0;
	while (n < 4096) {
		int p[2];
		if (pipe(p) < 0)
			break;
		if (fcntl(p[1], F_GETPIPE_SZ) < 65536) {
			close(p[0]);
			close(p[1]);
			break;
		}
		fcntl(p[1], F_SETPIPE_SZ, 1 << 20); // refused past the limit
		n++;
	}
	return n;
}

int main(int argc, char **argv) {
	if (argc < 2) {
		fprintf(stderr, "usage: counts_holder inotify|sigpending|mqueue|pipes|procs [hold]\n");
		return 2;
	}
	int n;
	if (strcmp(argv[1], "inotify") == 0)
		n = take_inotify();
	else if (strcmp(argv[1], "sigpending") == 0)
		n = take_sigpending();
	else if (strcmp(argv[1], "mqueue") == 0)
		n = take_mqueue();
	else if (strcmp(argv[1], "pipes") == 0)
		n = take_pipes();
	else if (strcmp(argv[1], "procs") == 0)
		n = take_procs();
	else {
		fprintf(stderr, "unknown resource %s\n", argv[1]);
		return 2;
	}
	printf("%d\n", n);
	fflush(stdout);
	if (argc > 2)
		for (;;)
			pause();
	return 0;
}
