package cgroup

import (
	"errors"
	"fmt"
	"path/filepath"
	"strconv"
	"syscall"
)

// Reclaimed reports what Reclaim achieved: the cgroup's charged memory
// (page cache included) before and after.
type Reclaimed struct {
	BeforeBytes uint64
	AfterBytes  uint64
	// Method names the interface used: "memory.reclaim" (v2) or
	// "memory.force_empty" (v1), or says why there was none.
	Method string
}

// Freed is the memory the reclaim gave back.
func (r Reclaimed) Freed() uint64 {
	if r.AfterBytes >= r.BeforeBytes {
		return 0
	}
	return r.BeforeBytes - r.AfterBytes
}

// Reclaim asks the kernel to reclaim as much of cgroup rel's memory as it
// can: memory.reclaim on cgroup v2; on v1, which has no such interface,
// memory.force_empty, which reclaims page cache and — with swap — anonymous
// memory while tasks stay in the group. Without swap, anonymous memory
// stays resident either way. Meant for a frozen cgroup (pause), where
// nothing faults pages back in meanwhile.
func (i *Info) Reclaim(rel string) (Reclaimed, error) {
	if err := checkRel(rel); err != nil {
		return Reclaimed{}, err
	}
	if i.MemoryShared(rel) {
		// Its memory is charged to SharedMemory, with every other
		// sandbox's there: nothing to reclaim for this one alone.
		return Reclaimed{Method: "none (shared memory cgroup)"}, nil
	}
	if root, ok := i.V1["memory"]; ok {
		dir := filepath.Join(root, rel)
		before, err := readUint(filepath.Join(dir, "memory.usage_in_bytes"))
		if err != nil {
			return Reclaimed{}, fmt.Errorf("reading memory of cgroup %s: %w", rel, err)
		}
		// EBUSY means it could not reclaim everything: not an error here.
		if err := writeFile(filepath.Join(dir, "memory.force_empty"), "0"); err != nil && !errors.Is(err, syscall.EBUSY) {
			return Reclaimed{}, fmt.Errorf("reclaiming memory of cgroup %s: %w", rel, err)
		}
		after, err := readUint(filepath.Join(dir, "memory.usage_in_bytes"))
		if err != nil {
			return Reclaimed{}, fmt.Errorf("reading memory of cgroup %s: %w", rel, err)
		}
		return Reclaimed{BeforeBytes: before, AfterBytes: after, Method: "memory.force_empty"}, nil
	}
	if i.V2Root == "" {
		return Reclaimed{}, errors.New("no memory controller on this host")
	}
	dir := filepath.Join(i.V2Root, rel)
	before, err := readUint(filepath.Join(dir, "memory.current"))
	if err != nil {
		return Reclaimed{}, fmt.Errorf("reading memory of cgroup %s: %w", rel, err)
	}
	// Ask for everything; EAGAIN means the kernel reclaimed less.
	if before > 0 {
		err = writeFile(filepath.Join(dir, "memory.reclaim"), strconv.FormatUint(before, 10))
		if err != nil && !errors.Is(err, syscall.EAGAIN) {
			return Reclaimed{}, fmt.Errorf("reclaiming memory of cgroup %s: %w", rel, err)
		}
	}
	after, err := readUint(filepath.Join(dir, "memory.current"))
	if err != nil {
		return Reclaimed{}, fmt.Errorf("reading memory of cgroup %s: %w", rel, err)
	}
	return Reclaimed{BeforeBytes: before, AfterBytes: after, Method: "memory.reclaim"}, nil
}
