package cgroup

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// Stats is the resource usage of one cgroup, including its descendants.
// A counter whose controller is not available for the cgroup reads as
// zero (for example pids on a v2 tree where pids is not enabled).
type Stats struct {
	// MemoryBytes is the working set: memory usage minus inactive file
	// cache, the figure the kernel would not give back without pressure
	// (as kubelet and cAdvisor count it). Page cache charged before a
	// process moved into the cgroup is not counted; charges do not move.
	MemoryBytes uint64
	// MemoryLimitBytes is the hard memory limit; 0 means unlimited.
	MemoryLimitBytes uint64
	// CPUUsageNS is the CPU time used, user plus system, in nanoseconds.
	CPUUsageNS uint64
	// Pids is the number of tasks (threads, not just processes).
	Pids uint64
	// MemoryFromRSS: the cgroup has no memory cgroup of its own (below
	// Info.SharedMemory), so MemoryBytes is the sum of its processes'
	// resident sets (of the first 1,024): pages two of them share count
	// twice; page cache they do not map, memory of a memfd they do not
	// map, pipe and socket buffers and kernel memory not at all.
	MemoryFromRSS bool
}

// v1 reports "no limit" as the largest page-aligned counter value
// (0x7FFFFFFFFFFFF000 with 4 KiB pages); anything this large is unlimited.
const v1Unlimited = 1 << 62

// Stats reads the usage of cgroup rel. It returns errdefs.ErrNotFound when
// rel exists in no hierarchy.
func (i *Info) Stats(rel string) (Stats, error) {
	if err := checkRel(rel); err != nil {
		return Stats{}, err
	}
	if !i.exists(rel) {
		return Stats{}, errdefs.NotFound("cgroup %s not found", rel)
	}
	var s Stats
	var err error
	if i.MemoryShared(rel) {
		s.MemoryFromRSS = true
		s.MemoryBytes, err = i.rss(rel)
	} else if root, ok := i.V1["memory"]; ok {
		s.MemoryBytes, s.MemoryLimitBytes, err = memoryV1(filepath.Join(root, rel))
	} else if i.V2Root != "" {
		s.MemoryBytes, s.MemoryLimitBytes, err = memoryV2(filepath.Join(i.V2Root, rel))
	}
	if err != nil {
		return Stats{}, fmt.Errorf("reading memory of cgroup %s: %w", rel, err)
	}

	if root, ok := i.V1["cpuacct"]; ok {
		s.CPUUsageNS, err = optional(readUint(filepath.Join(root, rel, "cpuacct.usage")))
	} else if i.V2Root != "" {
		// cpu.stat's usage_usec is a core file of cgroup2: present even
		// when the cpu controller is not enabled.
		var st map[string]uint64
		st, err = optional(readKeyed(filepath.Join(i.V2Root, rel, "cpu.stat")))
		s.CPUUsageNS = st["usage_usec"] * 1000
	}
	if err != nil {
		return Stats{}, fmt.Errorf("reading cpu usage of cgroup %s: %w", rel, err)
	}

	root, ok := i.V1["pids"]
	if !ok {
		root = i.V2Root
	}
	if root != "" {
		s.Pids, err = optional(readUint(filepath.Join(root, rel, "pids.current")))
		if err != nil {
			return Stats{}, fmt.Errorf("reading pids of cgroup %s: %w", rel, err)
		}
	}
	return s, nil
}

func memoryV1(dir string) (usage, limit uint64, err error) {
	usage, err = optional(readUint(filepath.Join(dir, "memory.usage_in_bytes")))
	if err != nil {
		return 0, 0, err
	}
	st, err := optional(readKeyed(filepath.Join(dir, "memory.stat")))
	if err != nil {
		return 0, 0, err
	}
	// total_ is the hierarchical figure, matching usage_in_bytes.
	usage -= min(usage, st["total_inactive_file"])
	limit, err = optional(readUint(filepath.Join(dir, "memory.limit_in_bytes")))
	if limit >= v1Unlimited {
		limit = 0
	}
	return usage, limit, err
}

func memoryV2(dir string) (usage, limit uint64, err error) {
	usage, err = optional(readUint(filepath.Join(dir, "memory.current")))
	if err != nil {
		return 0, 0, err
	}
	st, err := optional(readKeyed(filepath.Join(dir, "memory.stat")))
	if err != nil {
		return 0, 0, err
	}
	usage -= min(usage, st["inactive_file"])
	raw, err := optional(readString(filepath.Join(dir, "memory.max")))
	if err != nil || raw == "" || raw == "max" {
		return usage, 0, err
	}
	limit, err = strconv.ParseUint(raw, 10, 64)
	if err != nil {
		return 0, 0, fmt.Errorf("parsing memory.max: %w", err)
	}
	return usage, limit, nil
}

// rssMaxProcs bounds the /proc reads of one rss: a sandbox may hold
// thousands of processes, and each stats call would read them all.
const rssMaxProcs = 1024

// rss sums the resident set sizes of the processes in rel (of the first
// rssMaxProcs of them).
func (i *Info) rss(rel string) (uint64, error) {
	pids, err := i.Procs(rel)
	if err != nil {
		return 0, err
	}
	pids = pids[:min(len(pids), rssMaxProcs)]
	var sum uint64
	for _, pid := range pids {
		b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/statm")
		if err != nil {
			continue // exited meanwhile
		}
		// size resident shared text lib data dt, in pages.
		f := strings.Fields(string(b))
		if len(f) < 2 {
			continue
		}
		if n, err := strconv.ParseUint(f[1], 10, 64); err == nil {
			sum += n * uint64(os.Getpagesize())
		}
	}
	return sum, nil
}

// optional turns a missing file into the zero value.
func optional[T any](v T, err error) (T, error) {
	if errors.Is(err, fs.ErrNotExist) {
		var zero T
		return zero, nil
	}
	return v, err
}

// Procs lists the host pids of the processes in cgroup rel and its
// descendants, sorted. On v1 it reads the pids hierarchy (else memory,
// else any); on V2 the cgroup2 tree. It returns errdefs.ErrNotFound when
// rel does not exist there.
func (i *Info) Procs(rel string) ([]int, error) {
	if err := checkRel(rel); err != nil {
		return nil, err
	}
	root := i.procsRoot(rel)
	dirs, err := subtree(filepath.Join(root, rel))
	if err != nil {
		return nil, err
	}
	if len(dirs) == 0 {
		return nil, errdefs.NotFound("cgroup %s not found in %s", rel, root)
	}
	var all []int
	for _, d := range dirs {
		pids, err := readPids(filepath.Join(d, "cgroup.procs"))
		if errors.Is(err, fs.ErrNotExist) {
			continue // removed under us
		}
		if err != nil {
			return nil, fmt.Errorf("reading processes of cgroup %s: %w", d, err)
		}
		all = append(all, pids...)
	}
	slices.Sort(all)
	return slices.Compact(all), nil
}

// procsRoot is the hierarchy Procs reads for rel: on v1, pids, else
// memory (not for a cgroup below SharedMemory, which has none there), else
// any.
func (i *Info) procsRoot(rel string) string {
	if i.Mode == V2 {
		return i.V2Root
	}
	for _, c := range []string{"pids", "memory"} {
		if root, ok := i.V1[c]; ok && !(c == "memory" && i.MemoryShared(rel)) {
			return root
		}
	}
	if roots := i.rootsOf(rel); len(roots) > 0 {
		return roots[0]
	}
	return i.V2Root
}
