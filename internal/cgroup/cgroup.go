// Package cgroup owns the host's control groups as dsec sees them: probing
// the host's cgroup layout (v1, hybrid or v2, read from mountinfo rather
// than guessed from paths), preparing a hybrid host so that crun accepts it,
// creating the parent cgroup sandboxes live under, recycling sandbox
// cgroups (Slots), and reading stats of, freezing and removing a
// sandbox's cgroup.
//
// The OCI runtime (crun or runc) creates each sandbox's own cgroup and
// writes its limits from the OCI spec; this package only sets limits back
// to the kernel's defaults when it takes a cgroup back for reuse.
//
// Importers: the edge (host preparation at startup, reaping leftovers,
// stats, cgroup slots) and the container backend (stats, freeze, removal once the runtime
// is gone). Other dsec packages should not read or write cgroupfs
// themselves.
package cgroup

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/mountinfo"
)

// Mode is the cgroup layout of a host.
type Mode int

// Layouts. The zero Mode is unknown.
const (
	// V1 has only cgroup v1 hierarchies.
	V1 Mode = iota + 1
	// Hybrid has v1 hierarchies and a cgroup2 tree beside them (usually
	// /sys/fs/cgroup/unified) that may hold some controllers.
	Hybrid
	// V2 has only the cgroup2 tree.
	V2
)

func (m Mode) String() string {
	switch m {
	case V1:
		return "v1"
	case Hybrid:
		return "hybrid"
	case V2:
		return "v2"
	}
	return "unknown"
}

// Info describes the cgroup layout of the host at the time of Detect.
// Methods other than PrepareForCrun only read it and are safe for
// concurrent use; PrepareForCrun refreshes it and must run before i is
// shared.
type Info struct {
	Mode Mode
	// V2Root is the mountpoint of the cgroup2 tree, or "" when there is none.
	V2Root string
	// V1 maps each v1 controller to the mountpoint of its hierarchy.
	// Co-mounted controllers (cpu,cpuacct) share a mountpoint; named
	// hierarchies appear under their mount option ("name=systemd").
	V1 map[string]string
	// UnifiedControllers are the controllers listed in the cgroup2 root's
	// cgroup.controllers (available there, i.e. not bound to v1).
	UnifiedControllers []string
	// SharedMemory, if set, is a parent cgroup whose children have no
	// memory cgroup of their own: they are charged to it (see
	// EnsureSharedMemoryParent). Set it before sharing Info.
	SharedMemory string
}

// Detect reads /proc/self/mountinfo and the cgroup2 root's
// cgroup.controllers to describe the host.
func Detect() (*Info, error) {
	info, _, err := detect()
	return info, err
}

// detect is Detect that also returns the mount table, which
// PrepareForCrun needs to avoid mounting over something.
func detect() (*Info, []mountinfo.Entry, error) {
	mounts, err := mountinfo.Read()
	if err != nil {
		return nil, nil, err
	}
	info, err := newInfo(mounts)
	if err != nil {
		return nil, nil, err
	}
	if info.V2Root != "" {
		info.UnifiedControllers, err = readList(filepath.Join(info.V2Root, "cgroup.controllers"))
		if err != nil {
			return nil, nil, fmt.Errorf("reading cgroup v2 controllers: %w", err)
		}
	}
	return info, mounts, nil
}

// v1Options are cgroup v1 mount options that are not controller names.
var v1Options = map[string]bool{
	"rw": true, "ro": true, "noprefix": true, "clone_children": true,
	"xattr": true, "cpuset_v2_mode": true, "favordynmods": true, "none": true,
	"all": true,
}

// newInfo classifies the cgroup mounts of a mount table. When a hierarchy
// is mounted more than once (bind mounts), the first mount wins.
func newInfo(mounts []mountinfo.Entry) (*Info, error) {
	info := &Info{V1: map[string]string{}}
	for _, m := range mounts {
		switch m.FSType {
		case "cgroup2":
			if info.V2Root == "" {
				info.V2Root = m.MountPoint
			}
		case "cgroup":
			for _, o := range m.SuperOptionList() {
				if v1Options[o] || strings.HasPrefix(o, "release_agent=") {
					continue
				}
				if _, seen := info.V1[o]; !seen {
					info.V1[o] = m.MountPoint
				}
			}
		}
	}
	switch {
	case len(info.V1) > 0 && info.V2Root != "":
		info.Mode = Hybrid
	case len(info.V1) > 0:
		info.Mode = V1
	case info.V2Root != "":
		info.Mode = V2
	default:
		return nil, errdefs.Precondition("no cgroup filesystem is mounted")
	}
	return info, nil
}

// v1Roots returns the distinct v1 hierarchy mountpoints, sorted.
func (i *Info) v1Roots() []string {
	var roots []string
	for _, mp := range i.V1 {
		if !slices.Contains(roots, mp) {
			roots = append(roots, mp)
		}
	}
	slices.Sort(roots)
	return roots
}

// roots returns every hierarchy's mountpoint: the v1 ones, then the
// cgroup2 tree. In hybrid mode runtimes create the sandbox's cgroup in
// the cgroup2 tree too, so it counts as a hierarchy everywhere here.
func (i *Info) roots() []string {
	roots := i.v1Roots()
	if i.V2Root != "" {
		roots = append(roots, i.V2Root)
	}
	return roots
}

// MemoryShared reports whether rel is below SharedMemory: a cgroup
// without a memory cgroup of its own.
func (i *Info) MemoryShared(rel string) bool {
	return i.SharedMemory != "" && strings.HasPrefix(rel, i.SharedMemory+"/")
}

// rootsOf returns the hierarchies cgroup rel exists in: all of them, but
// the v1 memory hierarchy for a cgroup below SharedMemory.
func (i *Info) rootsOf(rel string) []string {
	roots := i.roots()
	if mem, ok := i.V1["memory"]; ok && i.MemoryShared(rel) {
		roots = slices.DeleteFunc(roots, func(r string) bool { return r == mem })
	}
	return roots
}

// Exists reports whether cgroup rel exists in any hierarchy.
func (i *Info) Exists(rel string) bool { return checkRel(rel) == nil && i.exists(rel) }

// exists reports whether rel exists in any hierarchy.
func (i *Info) exists(rel string) bool {
	for _, root := range i.rootsOf(rel) {
		if isDir(filepath.Join(root, rel)) {
			return true
		}
	}
	return false
}

// checkRel validates a cgroup path relative to the hierarchy roots:
// absolute, clean, and not the root itself.
func checkRel(rel string) error {
	if !strings.HasPrefix(rel, "/") || path.Clean(rel) != rel || rel == "/" {
		return errdefs.Invalid("cgroup path %q: want an absolute, clean path below the root, like /dsec", rel)
	}
	return nil
}

// levels returns "/a", "/a/b" for "/a/b".
func levels(rel string) []string {
	var out []string
	for j := 1; j <= len(rel); j++ {
		if j == len(rel) || rel[j] == '/' {
			out = append(out, rel[:j])
		}
	}
	return out
}

func isDir(p string) bool {
	st, err := os.Stat(p)
	return err == nil && st.IsDir()
}

// readList reads a space-separated list file (cgroup.controllers,
// cgroup.subtree_control).
func readList(p string) ([]string, error) {
	b, err := os.ReadFile(p)
	if err != nil {
		return nil, err
	}
	return strings.Fields(string(b)), nil
}

func readString(p string) (string, error) {
	b, err := os.ReadFile(p)
	return string(bytes.TrimSpace(b)), err
}

func readUint(p string) (uint64, error) {
	s, err := readString(p)
	if err != nil {
		return 0, err
	}
	v, err := strconv.ParseUint(s, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("parsing %s: %w", p, err)
	}
	return v, nil
}

// readKeyed reads "key value" lines (memory.stat, cpu.stat, cgroup.events).
func readKeyed(p string) (map[string]uint64, error) {
	b, err := os.ReadFile(p)
	if err != nil {
		return nil, err
	}
	out := map[string]uint64{}
	for _, line := range strings.Split(string(b), "\n") {
		k, v, ok := strings.Cut(line, " ")
		if !ok {
			continue
		}
		if n, err := strconv.ParseUint(strings.TrimSpace(v), 10, 64); err == nil {
			out[k] = n
		}
	}
	return out, nil
}

// readPids reads cgroup.procs or tasks.
func readPids(p string) ([]int, error) {
	b, err := os.ReadFile(p)
	if err != nil {
		return nil, err
	}
	var pids []int
	for _, f := range strings.Fields(string(b)) {
		pid, err := strconv.Atoi(f)
		if err != nil {
			return nil, fmt.Errorf("parsing %s: %w", p, err)
		}
		pids = append(pids, pid)
	}
	return pids, nil
}

// writeFile writes a cgroup control file, which must exist already
// (O_CREAT on cgroupfs would be refused anyway, but the error is clearer).
func writeFile(p, s string) error {
	f, err := os.OpenFile(p, os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	_, err = f.WriteString(s)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// subtree returns dir and all cgroup directories below it, parents
// before children. A missing dir gives nothing.
func subtree(dir string) ([]string, error) {
	out := []string{dir}
	for j := 0; j < len(out); j++ {
		ents, err := os.ReadDir(out[j])
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				if j == 0 {
					return nil, nil
				}
				continue // removed under us
			}
			return nil, fmt.Errorf("listing cgroup %s: %w", out[j], err)
		}
		for _, e := range ents {
			if e.IsDir() {
				out = append(out, filepath.Join(out[j], e.Name()))
			}
		}
	}
	return out, nil
}
