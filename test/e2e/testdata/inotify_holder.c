// inotify_holder makes inotify instances until the kernel refuses one and
// prints how many it made; with an argument it then holds them until
// killed. The per-user count of inotify instances is the kernel's,
// charged up the chain of user namespaces to their owners.
#include <stdio.h>
#include <sys/inotify.h>
#include <unistd.h>

int main(int argc, char **argv) {
	(void)argv;
	int n = 0;
	while (inotify_init1(IN_CLOEXEC) >= 0)
		n++;
	printf("%d\n", n);
	fflush(stdout);
	if (argc > 1)
		for (;;)
			pause();
	return 0;
}
