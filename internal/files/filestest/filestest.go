// Package filestest helps tests that attack tree walks and removals:
// directory chains deeper than PATH_MAX and a bounded descriptor budget.
// Only tests import it.
package filestest

import (
	"os"
	"strconv"
	"testing"

	"golang.org/x/sys/unix"
)

// WithFDHeadroom runs fn with the soft open-files limit set so that fn
// can open at most headroom descriptors at once, then restores the limit.
func WithFDHeadroom(t *testing.T, headroom int, fn func()) {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skipf("needs /proc/self/fd: %v", err)
	}
	// The limit is the lowest with exactly headroom free descriptors
	// below it (the kernel gives the lowest free number; there are gaps,
	// and the listing's own descriptor is closed by now).
	open := map[int]bool{}
	for _, e := range ents {
		n, err := strconv.Atoi(e.Name())
		if _, lerr := os.Readlink("/proc/self/fd/" + e.Name()); err == nil && lerr == nil {
			open[n] = true
		}
	}
	limit, free := 0, 0
	for ; free < headroom; limit++ {
		if !open[limit] {
			free++
		}
	}
	var old unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &old); err != nil {
		t.Fatal(err)
	}
	low := old
	low.Cur = uint64(limit)
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &low); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &old); err != nil {
			t.Fatal(err)
		}
	}()
	fn()
}

// DeepTree makes a chain of depth directories named d under dir, holding
// only two descriptors at a time (its paths are far past PATH_MAX), and
// calls at(level, fd) in each level's directory.
func DeepTree(t *testing.T, dir string, depth int, at func(level, fd int)) {
	t.Helper()
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	for level := 1; level <= depth; level++ {
		if err := unix.Mkdirat(fd, "d", 0o755); err != nil {
			t.Fatalf("level %d: %v", level, err)
		}
		next, err := unix.Openat(fd, "d", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		unix.Close(fd)
		if err != nil {
			t.Fatalf("level %d: %v", level, err)
		}
		fd = next
		if at != nil {
			at(level, fd)
		}
	}
	unix.Close(fd)
}
