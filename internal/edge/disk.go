package edge

import (
	"path/filepath"

	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/mountinfo"
	"github.com/dsecproject/dsec/internal/quota"
)

// A sandbox with disk_mb has its writable layer on a disk of its own
// (quota.CreateDisk): an ext4 image <dir>/disk.img mounted at <dir>/vol,
// holding vol/upper and vol/work. Without disk_mb they are <dir>/upper and
// <dir>/work on the state dir's filesystem.

// DiskLoop and DiskOff are the values of Config.DiskQuota.
const (
	DiskLoop = "loop"
	DiskOff  = "off"
)

func layerDirs(dir string, disk bool) (upper, work string) {
	if disk {
		return filepath.Join(dir, "vol", "upper"), filepath.Join(dir, "vol", "work")
	}
	return filepath.Join(dir, "upper"), filepath.Join(dir, "work")
}

func (s *sbx) upperDir() string {
	s.mu.Lock()
	disk := s.rec.Disk
	s.mu.Unlock()
	u, _ := layerDirs(s.dir, disk)
	return u
}

// checkDisk refuses disk_mb on a node without disk limits.
func (e *Edge) checkDisk(diskMB int64) error {
	if diskMB > 0 && e.cfg.DiskQuota != DiskLoop {
		return errdefs.Precondition("node %s does not enforce disk_mb (dsec up --disk-quota off); omit it", e.cfg.Name)
	}
	return nil
}

// createDisk gives the sandbox in dir its own disk of diskMB MiB, copied
// from the formatted image of that size kept in <state>/disk-templates.
func (e *Edge) createDisk(dir string, diskMB int64) error {
	bytes := uint64(diskMB) << 20
	return quota.CreateDisk(filepath.Join(dir, "disk.img"), filepath.Join(dir, "vol"), bytes, quota.DiskInodes(bytes), filepath.Join(e.cfg.StateDir, "disk-templates"))
}

// removeDisk unmounts and deletes a sandbox's disk, if it has one mounted
// or an image left.
func removeDisk(dir string) error {
	return quota.RemoveDisk(filepath.Join(dir, "disk.img"), filepath.Join(dir, "vol"))
}

// hasDiskMount reports whether <dir>/vol is a mount point.
func hasDiskMount(dir string) bool {
	entries, err := mountinfo.Read()
	if err != nil {
		return false
	}
	vol := filepath.Join(dir, "vol")
	for _, m := range entries {
		if m.MountPoint == vol {
			return true
		}
	}
	return false
}

// checkDiskFloor refuses, with resource_exhausted, an operation that would
// write to the state filesystem (a create, a file or tar upload) while it
// has less free than the node's floor (Config.MinFreeDiskMB): a sandbox
// without a disk of its own writes to that filesystem, and a full one
// stops every sandbox's writes and the daemon's records alike. What a
// running sandbox writes itself is bounded by disk_mb, or held at the
// floor by the disk guard (diskguard.go).
func (e *Edge) checkDiskFloor() error {
	free, floor, ok := e.stateFree()
	if !ok {
		return nil // no floor; or the write itself will say what is wrong
	}
	if free < floor {
		return errdefs.Exhausted("node %s: its state filesystem has %d MiB free, below the floor of %d MiB (--min-free-disk-mb): creates and file uploads are refused until sandboxes free space", e.cfg.Name, free>>20, floor>>20)
	}
	return nil
}
