package layer

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// IDMap is a contiguous user and group ID mapping: IDs 0..Size-1 inside a
// sandbox are HostID..HostID+Size-1 on the host.
type IDMap struct {
	HostID uint32
	Size   uint32
}

// Contains reports whether the host ID id is inside the mapping.
func (m IDMap) Contains(id uint32) bool { return id >= m.HostID && id-m.HostID < m.Size }

// IDMapClone returns an idmapped view of the directory src as a detached
// mount (a file owned by ID k on disk appears owned by the namespace's
// host ID for k), which no mount namespace shows: an overlay takes it as
// a lower layer through /proc/self/fd/<fd> (kernels from 6.15 accept a
// detached mount as a layer). The caller closes it.
func IDMapClone(src string, userns *os.File) (*os.File, error) {
	tfd, err := unix.OpenTree(unix.AT_FDCWD, src, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("cloning mount %s: %w", src, err)
	}
	attr := unix.MountAttr{Attr_set: unix.MOUNT_ATTR_IDMAP, Userns_fd: uint64(userns.Fd())}
	if err := unix.MountSetattr(tfd, "", unix.AT_EMPTY_PATH, &attr); err != nil {
		unix.Close(tfd)
		return nil, fmt.Errorf("idmapping mount of %s (needs a filesystem that supports idmapped mounts): %w", src, err)
	}
	return os.NewFile(uintptr(tfd), "idmapped "+src), nil
}

// IDMapMount mounts an idmapped view of the directory src at dst (an
// existing directory): a file owned by ID k on disk appears owned by the
// namespace's host ID for k. src's own mount is left as it is.
func IDMapMount(src, dst string, userns *os.File) error {
	tfd, err := unix.OpenTree(unix.AT_FDCWD, src, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
	if err != nil {
		return fmt.Errorf("cloning mount %s: %w", src, err)
	}
	defer unix.Close(tfd)
	attr := unix.MountAttr{Attr_set: unix.MOUNT_ATTR_IDMAP, Userns_fd: uint64(userns.Fd())}
	if err := unix.MountSetattr(tfd, "", unix.AT_EMPTY_PATH, &attr); err != nil {
		return fmt.Errorf("idmapping mount of %s (needs a filesystem that supports idmapped mounts): %w", src, err)
	}
	if err := unix.MoveMount(tfd, "", unix.AT_FDCWD, dst, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("attaching idmapped mount at %s: %w", dst, err)
	}
	return nil
}
