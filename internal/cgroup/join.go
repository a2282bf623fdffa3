package cgroup

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// ProcsFilesOf returns, for every mounted hierarchy, the host path of the
// cgroup.procs file of the cgroup process pid is in: what a process must
// write itself into to join pid's cgroups (the exec helper does, before it
// enters the sandbox's namespaces). It reads /proc/PID/cgroup, whose paths
// are relative to the reader's cgroup namespace: the edge's, the host's.
// Hierarchies without a mountpoint here (net_cls when not mounted) are
// skipped.
func (i *Info) ProcsFilesOf(pid int) ([]string, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cgroup")
	if err != nil {
		return nil, fmt.Errorf("reading cgroups of pid %d: %w", pid, err)
	}
	return i.procsFiles(b)
}

func (i *Info) procsFiles(procCgroup []byte) ([]string, error) {
	var out []string
	sc := bufio.NewScanner(bytes.NewReader(procCgroup))
	for sc.Scan() {
		// hierarchy-id:controller,list:path
		f := strings.SplitN(sc.Text(), ":", 3)
		if len(f) != 3 {
			continue
		}
		ctrls, rel := f[1], f[2]
		if rel == "" || !strings.HasPrefix(rel, "/") || strings.Contains(rel, "/../") || strings.HasSuffix(rel, "/..") {
			return nil, fmt.Errorf("unexpected cgroup path %q", rel)
		}
		var root string
		if f[0] == "0" && ctrls == "" {
			root = i.V2Root
		} else {
			for _, c := range strings.Split(ctrls, ",") {
				if r, ok := i.V1[c]; ok {
					root = r
					break
				}
			}
		}
		if root == "" {
			continue
		}
		out = append(out, filepath.Join(root, rel, "cgroup.procs"))
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("no mounted cgroup hierarchy in %q", procCgroup)
	}
	return out, nil
}

// RelOf returns the cgroup process pid is in, relative to the hierarchy
// roots (the path runtimes are given as cgroupsPath), read from the first
// mounted hierarchy in /proc/PID/cgroup other than a v1 memory one (where
// a sandbox below SharedMemory is in SharedMemory itself).
func (i *Info) RelOf(pid int) (string, error) {
	files, err := i.ProcsFilesOf(pid)
	if err != nil {
		return "", err
	}
	mem, hasMem := i.V1["memory"]
	for _, f := range files {
		if hasMem && len(files) > 1 && strings.HasPrefix(f, mem+"/") {
			continue
		}
		for _, root := range i.roots() {
			if strings.HasPrefix(f, root+"/") {
				// "/cgroup.procs" is the root cgroup's: "/".
				return filepath.Dir(f[len(root):]), nil
			}
		}
		return "", fmt.Errorf("cgroup file %s is under no known hierarchy", f)
	}
	return "", fmt.Errorf("cgroup file %s is under no known hierarchy", files[0])
}
