package cgroup

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
)

// Limits are what a sandbox's cgroup enforces. Zero means the kernel's
// default (no limit, default weight).
type Limits struct {
	MemoryBytes int64
	// CPUQuotaUs is the CPU time allowed per 100 ms period.
	CPUQuotaUs int64
	// Idle weight: the lowest CPU share (best-effort sandboxes).
	LowWeight bool
	Pids      int64
	// Devices are device rules ("c 10:200 rwm") allowed beyond
	// v1Devices on a v1 devices hierarchy (a VMM's /dev/net/tun and
	// /dev/kvm). A v2 cgroup has no device rules of its own here.
	Devices []string
}

// cpuPeriodUs is the CFS period dsec uses, the kernel's default.
const cpuPeriodUs = 100000

// v1Devices is the device allow-list of a sandbox cgroup on a v1 devices
// hierarchy, written after denying all: the nodes every sandbox's /dev
// holds, the pty devices, and mknod of anything (a node made inside is of
// no use: every writable mount in a sandbox is nodev).
var v1Devices = []string{
	"c 1:3 rwm", "c 1:5 rwm", "c 1:7 rwm", "c 1:8 rwm", "c 1:9 rwm",
	"c 5:0 rwm", "c 5:2 rwm", "c 136:* rwm", "c *:* m", "b *:* m",
}

// MakeSandbox creates the cgroup rel in every hierarchy (its parent must
// exist: EnsureParent), or takes it as it is where it exists already (a
// recycled slot, at the kernel defaults: Slots), and writes l. It returns
// the cgroup.procs file of each hierarchy, which a process writes "0" into
// to join. Below SharedMemory, rel has no memory cgroup: l must set no
// memory limit, and on a v1 memory hierarchy the file returned is
// SharedMemory's. A new cgroup gets its parent's cpuset and, on a v1 devices
// hierarchy, the device allow-list v1Devices. On error, directories it
// created are removed again.
//
// This is what an OCI runtime does for a sandbox's cgroup; dsec's own
// launcher (sandbox/container) relies on it instead.
func (i *Info) MakeSandbox(rel string, l Limits) ([]string, error) {
	if err := checkRel(rel); err != nil {
		return nil, err
	}
	if i.MemoryShared(rel) && l.MemoryBytes > 0 {
		return nil, fmt.Errorf("cgroup %s: a memory limit needs a memory cgroup of its own", rel)
	}
	var created, procs []string
	ok := false
	defer func() {
		if !ok {
			for _, d := range created {
				os.Remove(d)
			}
		}
	}()
	if mem, has := i.V1["memory"]; has && i.MemoryShared(rel) {
		procs = append(procs, filepath.Join(mem, i.SharedMemory, "cgroup.procs"))
	}
	for _, root := range i.rootsOf(rel) {
		dir := filepath.Join(root, rel)
		err := os.Mkdir(dir, 0o755)
		switch {
		case err == nil:
			created = append(created, dir)
			if err := i.initNew(root, dir); err != nil {
				return nil, err
			}
		case !errors.Is(err, fs.ErrExist):
			return nil, fmt.Errorf("creating cgroup %s: %w", dir, err)
		}
		procs = append(procs, filepath.Join(dir, "cgroup.procs"))
	}
	if err := i.writeLimits(rel, l); err != nil {
		return nil, err
	}
	if dev, has := i.V1["devices"]; has {
		for _, d := range l.Devices {
			if err := writeFile(filepath.Join(dev, rel, "devices.allow"), d); err != nil {
				return nil, fmt.Errorf("allowing device %q in %s: %w", d, rel, err)
			}
		}
	}
	ok = true
	return procs, nil
}

// initNew sets up a just-created cgroup dir of hierarchy root.
func (i *Info) initNew(root, dir string) error {
	switch root {
	case i.V1["cpuset"]:
		return inheritCpuset(root, dir)
	case i.V1["devices"]:
		if err := writeFile(filepath.Join(dir, "devices.deny"), "a"); err != nil {
			return fmt.Errorf("denying devices in %s: %w", dir, err)
		}
		for _, d := range v1Devices {
			if err := writeFile(filepath.Join(dir, "devices.allow"), d); err != nil {
				return fmt.Errorf("allowing device %q in %s: %w", d, dir, err)
			}
		}
	}
	return nil
}

// writeLimits writes the limits l sets; the rest stay at the defaults a
// new or reset cgroup has. Each goes to its controller's v1 hierarchy, or
// else to the cgroup2 tree.
func (i *Info) writeLimits(rel string, l Limits) error {
	set := func(ctrl, v1File, v1Value, v2File, v2Value string) error {
		root, file, value := i.V1[ctrl], v1File, v1Value
		if root == "" {
			root, file, value = i.V2Root, v2File, v2Value
		}
		if root == "" {
			return nil
		}
		if err := writeFile(filepath.Join(root, rel, file), value); err != nil {
			return fmt.Errorf("setting %s of %s to %s: %w", file, rel, value, err)
		}
		return nil
	}
	if l.MemoryBytes > 0 {
		v := strconv.FormatInt(l.MemoryBytes, 10)
		if err := set("memory", "memory.limit_in_bytes", v, "memory.max", v); err != nil {
			return err
		}
	}
	if l.CPUQuotaUs > 0 {
		// v1's period is the default already; cgroup2 takes both.
		q := strconv.FormatInt(l.CPUQuotaUs, 10)
		if err := set("cpu", "cpu.cfs_quota_us", q, "cpu.max", fmt.Sprintf("%s %d", q, cpuPeriodUs)); err != nil {
			return err
		}
	}
	if l.LowWeight {
		if err := set("cpu", "cpu.shares", "2", "cpu.weight", "1"); err != nil {
			return err
		}
	}
	if l.Pids > 0 {
		v := strconv.FormatInt(l.Pids, 10)
		if err := set("pids", "pids.max", v, "pids.max", v); err != nil {
			return err
		}
	}
	return nil
}
