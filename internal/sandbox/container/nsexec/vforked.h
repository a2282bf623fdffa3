// Helpers for a child that shares the Go process's memory until it execs
// (vfork, CLONE_VM): system calls only.
#ifndef DSEC_VFORKED_H
#define DSEC_VFORKED_H

#include <signal.h>
#include <string.h>

// reset_handled_signals sets every signal with a handler (the Go
// runtime's) back to its default, so that none can run in the child once
// it unblocks signals. Call it with every signal blocked.
static inline void reset_handled_signals(void) {
	for (int sig = 1; sig < NSIG; sig++) {
		struct sigaction cur;
		if (sig == SIGKILL || sig == SIGSTOP || sigaction(sig, NULL, &cur) < 0)
			continue;
		if (cur.sa_handler != SIG_DFL && cur.sa_handler != SIG_IGN) {
			struct sigaction dfl;
			memset(&dfl, 0, sizeof dfl);
			dfl.sa_handler = SIG_DFL;
			sigaction(sig, &dfl, NULL);
		}
	}
}

#endif
