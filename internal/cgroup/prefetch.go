package cgroup

import (
	"bufio"
	"bytes"
	"os"
	"strconv"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"
)

// maxIOV is the most ranges one process_madvise call takes (UIO_MAXIOV).
const maxIOV = 1024

// remoteIovec is struct iovec for addresses in another process: they are
// numbers here, never Go pointers.
type remoteIovec struct {
	base uintptr
	len  uint64
}

// Prefetch asks the kernel to read back, asynchronously, the file-backed
// memory of every process in cgroup rel (process_madvise MADV_WILLNEED on
// each readable file mapping), so that a resumed sandbox does not fault
// its working set in page by page. Anonymous memory is not touched: without
// swap it was never reclaimed. Best effort: it returns the number of
// ranges advised; processes that exit meanwhile are skipped.
func (i *Info) Prefetch(rel string) (int, error) {
	pids, err := i.Procs(rel)
	if err != nil {
		return 0, err
	}
	n := 0
	for _, pid := range pids {
		n += prefetchPid(pid)
	}
	return n, nil
}

func prefetchPid(pid int) int {
	ranges := fileMappings(pid)
	if len(ranges) == 0 {
		return 0
	}
	fd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return 0
	}
	defer unix.Close(fd)
	done := 0
	for len(ranges) > 0 {
		batch := ranges[:min(len(ranges), maxIOV)]
		ranges = ranges[len(batch):]
		_, _, errno := unix.Syscall6(unix.SYS_PROCESS_MADVISE, uintptr(fd),
			uintptr(unsafe.Pointer(&batch[0])), uintptr(len(batch)), unix.MADV_WILLNEED, 0, 0)
		if errno != 0 {
			break
		}
		done += len(batch)
	}
	return done
}

// fileMappings returns the readable, file-backed mappings of pid from
// /proc/PID/maps.
func fileMappings(pid int) []remoteIovec {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/maps")
	if err != nil {
		return nil
	}
	var out []remoteIovec
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		// address perms offset dev inode path
		if len(f) < 6 || f[1][0] != 'r' || f[4] == "0" || !strings.HasPrefix(f[5], "/") {
			continue
		}
		lo, hi, ok := strings.Cut(f[0], "-")
		if !ok {
			continue
		}
		start, err1 := strconv.ParseUint(lo, 16, 64)
		end, err2 := strconv.ParseUint(hi, 16, 64)
		if err1 != nil || err2 != nil || end <= start {
			continue
		}
		out = append(out, remoteIovec{base: uintptr(start), len: end - start})
	}
	return out
}
