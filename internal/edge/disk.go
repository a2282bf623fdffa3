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

// createDisk gives the sandbox in dir its own disk of diskMB MiB.
func createDisk(dir string, diskMB int64) error {
	bytes := uint64(diskMB) << 20
	return quota.CreateDisk(filepath.Join(dir, "disk.img"), filepath.Join(dir, "vol"), bytes, quota.DiskInodes(bytes))
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
