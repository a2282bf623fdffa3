//go:build !linux || !cgo

package nsexec

import (
	"context"
	"errors"
	"os"
)

// Available reports whether this build has the helper: a build without
// cgo has no constructor to run, so callers fall back to the runtime.
const Available = false

// RunInMountNS needs the C launcher; callers check Available first.
func RunInMountNS(ctx context.Context, mount *os.File, target string, env []string, argv []string, null *os.File) error {
	return errors.New("this dsec was built without cgo: no rootfs launcher")
}

// Launch needs the C launcher; callers check Available first.
func Launch(cfg LaunchConfig) (pid, pidfd int, err error) {
	return 0, -1, errors.New("this dsec was built without cgo: no sandbox launcher")
}

// UserNS needs the C helper; callers check Available first.
func UserNS(owner, hostID, size uint32) (path string, release func(), err error) {
	return "", nil, errors.New("this dsec was built without cgo: no user namespace holder")
}
