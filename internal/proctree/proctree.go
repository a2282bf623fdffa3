// Package proctree finds and kills trees of host processes through /proc.
// The edge uses it to end everything a command started inside a sandbox
// (timeouts, closed sessions) without relying on process groups, which
// commands can leave and runtimes set up differently.
package proctree

import (
	"bufio"
	"bytes"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// maxTree bounds a walk, so a runaway fork bomb cannot make it unbounded.
const maxTree = 1 << 16

// Descendants lists the pids below pid (children first, breadth-first),
// using /proc/PID/task/TID/children.
func Descendants(pid int) []int {
	var out []int
	queue := []int{pid}
	for len(queue) > 0 && len(out) < maxTree {
		cur := queue[0]
		queue = queue[1:]
		dir := "/proc/" + strconv.Itoa(cur) + "/task"
		tasks, _ := os.ReadDir(dir)
		for _, t := range tasks {
			b, err := os.ReadFile(dir + "/" + t.Name() + "/children")
			if err != nil {
				continue
			}
			for _, f := range strings.Fields(string(b)) {
				if c, err := strconv.Atoi(f); err == nil {
					out = append(out, c)
					queue = append(queue, c)
				}
			}
		}
	}
	return out
}

// Kill SIGSTOPs every descendant of pid, repeating the walk until it finds
// no new process (stopped processes cannot fork, so a fork bomb cannot
// outrun it, and none can be reparented away between walk and kill), then
// SIGKILLs them all, and pid itself when withRoot is set.
func Kill(pid int, withRoot bool) {
	seen := map[int]bool{}
	for round := 0; round < 100; round++ {
		found := false
		for _, d := range Descendants(pid) {
			if !seen[d] {
				seen[d] = true
				found = true
				_ = unix.Kill(d, unix.SIGSTOP)
			}
		}
		if !found {
			break
		}
	}
	for d := range seen {
		_ = unix.Kill(d, unix.SIGKILL)
	}
	if withRoot {
		_ = unix.Kill(pid, unix.SIGKILL)
	}
}

// NSPid returns the pid of host process pid as seen in its own (innermost)
// pid namespace, from the NSpid line of /proc/PID/status.
func NSPid(pid int) (int, bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return 0, false
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		line := sc.Text()
		if rest, ok := strings.CutPrefix(line, "NSpid:"); ok {
			f := strings.Fields(rest)
			if len(f) == 0 {
				return 0, false
			}
			n, err := strconv.Atoi(f[len(f)-1])
			return n, err == nil
		}
	}
	return 0, false
}

// FindByNSPid finds, among the descendants of root, the host pid whose
// innermost pid is nsPid.
func FindByNSPid(root, nsPid int) (int, bool) {
	for _, d := range Descendants(root) {
		if n, ok := NSPid(d); ok && n == nsPid {
			return d, true
		}
	}
	return 0, false
}
