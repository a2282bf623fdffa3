package layer

import (
	"errors"
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/mountinfo"
)

// isMountRoot reports whether path is the root of a mount. statx's
// STATX_ATTR_MOUNT_ROOT answers with one syscall, which matters on an edge
// whose mountinfo has thousands of lines; mountinfo is the fallback for
// filesystems or kernels that do not report the attribute.
func isMountRoot(path string) (bool, error) {
	var stx unix.Statx_t
	err := unix.Statx(unix.AT_FDCWD, path, unix.AT_SYMLINK_NOFOLLOW|unix.AT_NO_AUTOMOUNT, unix.STATX_TYPE, &stx)
	if errors.Is(err, unix.ENOENT) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("checking mount %s: %w", path, err)
	}
	if stx.Attributes_mask&unix.STATX_ATTR_MOUNT_ROOT != 0 {
		return stx.Attributes&unix.STATX_ATTR_MOUNT_ROOT != 0, nil
	}
	mounts, err := mountinfo.Read()
	if err != nil {
		return false, err
	}
	for _, m := range mounts {
		if m.MountPoint == path {
			return true, nil
		}
	}
	return false, nil
}
