package container

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// Pinning the runtime binary.
//
// crun and runc defend against a container overwriting the host's runtime
// through /proc/self/exe (CVE-2019-5736) by cloning themselves on every
// start: crun bind-mounts its own binary read-only to a temp file and
// re-executes it, loading its ten shared libraries a second time, ~3-5 ms
// of each create here. Both skip the clone when the environment says
// _LIBCONTAINER_CLONED_BINARY=1 and the binary they run from is on a
// read-only mount, which is the same protection (a write through
// /proc/PID/exe gets EROFS). So the backend does the bind mount once: the
// runtime is run from Config.PinPath, a read-only bind mount of the
// installed binary made at start (and remade at every start, so an
// upgraded runtime is picked up), unmounted by Close.

const clonedBinaryEnv = "_LIBCONTAINER_CLONED_BINARY=1"

// pinRuntime bind-mounts bin read-only at target and returns target.
func pinRuntime(bin, target string) (string, error) {
	// A mount left by a previous run (killed before Close) may pin an
	// older binary: replace it.
	for unix.Unmount(target, unix.MNT_DETACH) == nil {
	}
	if err := os.MkdirAll(filepath.Dir(target), 0o700); err != nil {
		return "", fmt.Errorf("creating %s: %w", filepath.Dir(target), err)
	}
	f, err := os.OpenFile(target, os.O_CREATE|os.O_RDONLY, 0o500)
	if err != nil {
		return "", fmt.Errorf("creating %s: %w", target, err)
	}
	f.Close()
	if err := unix.Mount(bin, target, "", unix.MS_BIND, ""); err != nil {
		os.Remove(target)
		return "", fmt.Errorf("bind-mounting %s: %w", bin, err)
	}
	flags := uintptr(unix.MS_BIND | unix.MS_REMOUNT | unix.MS_RDONLY | unix.MS_NOSUID | unix.MS_NODEV)
	if err := unix.Mount("", target, "", flags, ""); err != nil {
		unpinRuntime(target)
		return "", fmt.Errorf("making %s read-only: %w", target, err)
	}
	var st unix.Statfs_t
	if err := unix.Statfs(target, &st); err != nil || st.Flags&unix.ST_RDONLY == 0 {
		unpinRuntime(target)
		return "", errors.New("the pinned runtime binary is not on a read-only mount")
	}
	return target, nil
}

func unpinRuntime(target string) {
	for unix.Unmount(target, unix.MNT_DETACH) == nil {
	}
	os.Remove(target)
}
