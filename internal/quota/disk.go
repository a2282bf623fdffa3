package quota

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/cleanup"
	"github.com/dsecproject/dsec/internal/layer"
)

// A per-sandbox disk is the fallback where no filesystem with project
// quotas is at hand (kernels built without CONFIG_XFS_QUOTA, hosts whose
// data disk is not XFS): the sandbox's upper and work directories live on
// an ext4 filesystem of its own, in a sparse image file attached to a loop
// device. The filesystem's size caps the bytes and its inode count caps the
// files; a full disk is ENOSPC inside the sandbox and touches nothing else.
// The image is sparse, so only what is written takes room on the host, and
// the loop device uses direct I/O where the host filesystem allows it, so
// data is cached once (in the sandbox's filesystem), not twice.

// MinDiskBytes is the smallest per-sandbox disk (ext4 needs some room for
// its own metadata).
const MinDiskBytes = 16 << 20

// DiskInodes is the inode count given to a disk of bytes: one per 16 KiB
// (mke2fs's default ratio), at least 4096.
func DiskInodes(bytes uint64) uint64 {
	return max(bytes/16384, 4096)
}

// CreateDisk creates a sparse image of bytes at image, formats it as ext4
// with inodes inodes, and mounts it at dir (an existing empty directory). On
// error nothing is left: no mount, no loop device, no image.
func CreateDisk(image, dir string, bytes, inodes uint64) error {
	if bytes < MinDiskBytes {
		return fmt.Errorf("creating disk: %d bytes is below the minimum of %d", bytes, MinDiskBytes)
	}
	mkfs, err := exec.LookPath("mkfs.ext4")
	if err != nil {
		return fmt.Errorf("creating disk: mkfs.ext4 not found (apt-get install e2fsprogs): %w", err)
	}
	var undo cleanup.Stack
	defer undo.Run()
	f, err := os.OpenFile(image, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("creating disk: %w", err)
	}
	undo.Add(func() { os.Remove(image) })
	err = f.Truncate(int64(bytes))
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("creating disk image: %w", err)
	}
	// No journal: a sandbox's processes do not survive a host crash, so
	// neither needs its scratch filesystem; without one, formatting is a
	// few milliseconds and a small disk keeps its room. No reserved blocks:
	// the sandbox gets all of what it asked for.
	args := []string{"-q", "-F", "-t", "ext4", "-m", "0", "-N", strconv.FormatUint(inodes, 10),
		"-O", "^has_journal", "-E", "nodiscard,root_owner=0:0", image}
	if out, err := exec.Command(mkfs, args...).CombinedOutput(); err != nil {
		return fmt.Errorf("formatting disk image: %w: %s", err, strings.TrimSpace(string(out)))
	}
	loop, err := attachLoopDirect(image)
	if err != nil {
		return err
	}
	// Autoclear detaches the device at unmount (or now, if mount fails).
	defer loop.Close()
	if err := unix.Mount(loop.Name(), dir, "ext4", unix.MS_NOATIME, ""); err != nil {
		return fmt.Errorf("mounting disk %s at %s: %w", loop.Name(), dir, err)
	}
	undo.Release()
	return nil
}

// RemoveDisk unmounts a disk (its loop device then detaches itself) and
// deletes its image. Both steps tolerate what is already gone.
func RemoveDisk(image, dir string) error {
	if err := layer.UnmountOverlay(dir); err != nil { // any mount type
		return fmt.Errorf("unmounting disk: %w", err)
	}
	if err := os.Remove(image); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("removing disk image: %w", err)
	}
	return nil
}

// DiskUsage reports what is used of the filesystem mounted at dir.
func DiskUsage(dir string) (Usage, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return Usage{}, fmt.Errorf("reading disk usage: %w", err)
	}
	bs := uint64(st.Bsize)
	return Usage{
		Bytes: (st.Blocks - st.Bfree) * bs, ByteLimit: st.Blocks * bs,
		Inodes: st.Files - st.Ffree, InodeLimit: st.Files,
	}, nil
}

// attachLoopDirect is attachLoop with direct I/O turned on afterwards when
// the backing filesystem supports it (it is an optimisation: the disk works
// without it).
func attachLoopDirect(image string) (*os.File, error) {
	dev, err := attachLoop(image)
	if err != nil {
		return nil, err
	}
	_ = unix.IoctlSetInt(int(dev.Fd()), unix.LOOP_SET_DIRECT_IO, 1)
	return dev, nil
}
