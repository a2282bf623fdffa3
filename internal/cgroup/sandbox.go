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
// to join. A new cgroup gets its parent's cpuset and, on a v1 devices
// hierarchy, the device allow-list v1Devices. On error, directories it
// created are removed again.
//
// This is what an OCI runtime does for a sandbox's cgroup; dsec's own
// launcher (sandbox/container) relies on it instead.
func (i *Info) MakeSandbox(rel string, l Limits) ([]string, error) {
	if err := checkRel(rel); err != nil {
		return nil, err
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
	for _, root := range i.roots() {
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
// new or reset cgroup has.
func (i *Info) writeLimits(rel string, l Limits) error {
	v2 := i.V2Root
	write := func(root, file, value string) error {
		if err := writeFile(filepath.Join(root, rel, file), value); err != nil {
			return fmt.Errorf("setting %s of %s to %s: %w", file, rel, value, err)
		}
		return nil
	}
	if l.MemoryBytes > 0 {
		v := strconv.FormatInt(l.MemoryBytes, 10)
		if root, ok := i.V1["memory"]; ok {
			if err := write(root, "memory.limit_in_bytes", v); err != nil {
				return err
			}
		} else if v2 != "" {
			if err := write(v2, "memory.max", v); err != nil {
				return err
			}
		}
	}
	if l.CPUQuotaUs > 0 {
		if root, ok := i.V1["cpu"]; ok {
			if err := write(root, "cpu.cfs_quota_us", strconv.FormatInt(l.CPUQuotaUs, 10)); err != nil {
				return err
			}
		} else if v2 != "" {
			if err := write(v2, "cpu.max", fmt.Sprintf("%d %d", l.CPUQuotaUs, cpuPeriodUs)); err != nil {
				return err
			}
		}
	}
	if l.LowWeight {
		if root, ok := i.V1["cpu"]; ok {
			if err := write(root, "cpu.shares", "2"); err != nil {
				return err
			}
		} else if v2 != "" {
			if err := write(v2, "cpu.weight", "1"); err != nil {
				return err
			}
		}
	}
	if l.Pids > 0 {
		v := strconv.FormatInt(l.Pids, 10)
		if root, ok := i.V1["pids"]; ok {
			if err := write(root, "pids.max", v); err != nil {
				return err
			}
		} else if v2 != "" {
			if err := write(v2, "pids.max", v); err != nil {
				return err
			}
		}
	}
	return nil
}
