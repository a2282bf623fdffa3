package quota

import (
	"errors"
	"fmt"
	"path/filepath"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// Set gives dir the project ID projectID with the PROJINHERIT flag, so that
// everything later created below it belongs to the project, and sets the
// project's hard limits to bytes (rounded up to 512) and inodes; zero means
// no limit. The directory's own inode and blocks count against the limits.
//
// Call it on an empty directory, before the overlay's upper and work
// directories are made inside it: files that already exist keep their
// project. Calling it again with the same arguments is harmless, and with
// other limits resizes the quota. If Set fails the project's previous
// limits are restored.
func (v *Volume) Set(dir string, projectID uint32, bytes, inodes uint64) error {
	if projectID == 0 {
		return errdefs.Invalid("setting quota on %s: project 0 is every untagged file's project", dir)
	}
	if !filepath.IsAbs(dir) {
		return errdefs.Invalid("setting quota: %q is not an absolute path", dir)
	}
	if err := v.usable(); err != nil {
		return fmt.Errorf("setting quota on %s: %w", dir, err)
	}
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("setting quota on %s: %w", dir, err)
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fmt.Errorf("setting quota on %s: %w", dir, err)
	}
	if st.Dev != v.dev {
		return errdefs.Invalid("setting quota on %s: not on the quota volume %s", dir, v.dir)
	}
	prev, err := v.get(fd, projectID)
	if err != nil {
		return fmt.Errorf("setting quota on %s: %w", dir, err)
	}
	if err := v.setLimits(fd, projectID, basicBlocks(bytes), inodes); err != nil {
		return fmt.Errorf("setting quota on %s: %w", dir, err)
	}
	if err := setProject(fd, projectID); err != nil {
		v.setLimits(fd, projectID, prev.BlkHardlimit, prev.InoHardlimit)
		return fmt.Errorf("setting quota on %s: %w", dir, err)
	}
	return nil
}

// setProject tags the directory fd with projectID and PROJINHERIT.
func setProject(fd int, projectID uint32) error {
	fa, err := getFsxattr(fd)
	if err != nil {
		return fmt.Errorf("FS_IOC_FSGETXATTR: %w", err)
	}
	fa.Projid = projectID
	fa.Xflags |= fsXflagProjinherit
	if err := setFsxattr(fd, &fa); err != nil {
		return fmt.Errorf("FS_IOC_FSSETXATTR: %w", err)
	}
	return nil
}

// Project returns the project ID of dir, which Set recorded there: an edge
// recovering its sandboxes can read their IDs back from their directories.
func (v *Volume) Project(dir string) (uint32, error) {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0, fmt.Errorf("reading project of %s: %w", dir, err)
	}
	defer unix.Close(fd)
	fa, err := getFsxattr(fd)
	if err != nil {
		return 0, fmt.Errorf("reading project of %s: FS_IOC_FSGETXATTR: %w", dir, err)
	}
	return fa.Projid, nil
}

// Usage returns what projectID uses and its limits. A project with nothing
// charged to it and no limits has a zero Usage (XFS keeps no record of it).
func (v *Volume) Usage(projectID uint32) (Usage, error) {
	if err := v.usable(); err != nil {
		return Usage{}, fmt.Errorf("reading quota of project %d: %w", projectID, err)
	}
	d, err := v.get(-1, projectID)
	if err != nil {
		return Usage{}, fmt.Errorf("reading quota of project %d: %w", projectID, err)
	}
	return usageOf(&d), nil
}

// Clear removes projectID's limits and forgets any reservation Allocate
// made. Remove the project's directory first: blocks and inodes still
// charged to the project keep InUse true, and XFS uncharges removed files
// in the background, so InUse may stay true for a moment after removal.
func (v *Volume) Clear(projectID uint32) error {
	if projectID == 0 {
		return errdefs.Invalid("clearing quota: project 0 is every untagged file's project")
	}
	if err := v.usable(); err != nil {
		return fmt.Errorf("clearing quota of project %d: %w", projectID, err)
	}
	if err := v.setLimits(-1, projectID, 0, 0); err != nil {
		return fmt.Errorf("clearing quota of project %d: %w", projectID, err)
	}
	v.mu.Lock()
	delete(v.reserved, projectID)
	v.mu.Unlock()
	return nil
}

// InUse reports whether projectID has limits or owns blocks or inodes on
// the volume, or was handed out by Allocate and not cleared since. Because
// it asks the filesystem, it sees the projects of sandboxes created before
// a restart.
func (v *Volume) InUse(projectID uint32) (bool, error) {
	v.mu.Lock()
	reserved := v.reserved[projectID]
	v.mu.Unlock()
	if reserved {
		return true, nil
	}
	u, err := v.Usage(projectID)
	if err != nil {
		return false, err
	}
	return u != Usage{}, nil
}

// maxAttempts bounds Allocate's probing; with a billion IDs, needing more
// means the volume is full of projects or something is wrong.
const maxAttempts = 16

// Allocate returns the first of sandboxID's candidate IDs
// (ProjectIDAttempt 0, 1, ...) that is not InUse, and reserves it until
// Clear. Without collisions it returns ProjectID(sandboxID). The caller
// should persist the result (or read it back with Project): after a
// collision, ProjectID alone no longer finds it.
func (v *Volume) Allocate(sandboxID string) (uint32, error) {
	for i := range maxAttempts {
		id := ProjectIDAttempt(sandboxID, i)
		v.mu.Lock()
		taken := v.reserved[id]
		v.mu.Unlock()
		if taken {
			continue
		}
		used, err := v.InUse(id)
		if err != nil {
			return 0, fmt.Errorf("allocating project ID for %s: %w", sandboxID, err)
		}
		if used {
			continue
		}
		v.mu.Lock()
		if v.reserved[id] { // lost a race with another Allocate
			v.mu.Unlock()
			continue
		}
		v.reserved[id] = true
		v.mu.Unlock()
		return id, nil
	}
	return 0, errdefs.Exhausted("allocating project ID for %s: %d candidates all in use", sandboxID, maxAttempts)
}

func (v *Volume) usable() error {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.closed {
		return errdefs.Precondition("quota volume %s is closed", v.dir)
	}
	return nil
}

// get reads projectID's record; a project XFS has no record of reads as
// zero.
func (v *Volume) get(fd int, projectID uint32) (fsDiskQuota, error) {
	var d fsDiskQuota
	err := v.quotactl(fd, qXGetQuota, projectID, unsafe.Pointer(&d))
	if errors.Is(err, unix.ENOENT) {
		return fsDiskQuota{}, nil
	}
	if err != nil {
		return fsDiskQuota{}, fmt.Errorf("Q_XGETQUOTA: %w", err)
	}
	return d, nil
}

// setLimits sets projectID's hard limits (blocks in basic blocks) and clears
// its soft limits, which would otherwise start grace timers nobody watches.
func (v *Volume) setLimits(fd int, projectID uint32, blocks, inodes uint64) error {
	d := fsDiskQuota{
		Version:      fsDquotVersion,
		Flags:        fsProjQuota,
		Fieldmask:    fsDqBHard | fsDqBSoft | fsDqIHard | fsDqISoft,
		ID:           projectID,
		BlkHardlimit: blocks,
		InoHardlimit: inodes,
	}
	if err := v.quotactl(fd, qXSetQLim, projectID, unsafe.Pointer(&d)); err != nil {
		return fmt.Errorf("Q_XSETQLIM: %w", err)
	}
	return nil
}

// quotactl runs a project-quota command on the volume's filesystem, named
// by fd (any open file on it) or, when fd < 0, by the volume directory.
func (v *Volume) quotactl(fd int, cmd, id uint32, addr unsafe.Pointer) error {
	cmd = qcmd(cmd, prjQuota)
	if v.useDev {
		return quotactlDev(v.source, cmd, id, addr)
	}
	if fd < 0 {
		var err error
		fd, err = unix.Open(v.dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
	}
	return quotactlFd(fd, cmd, id, addr)
}
