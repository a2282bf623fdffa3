package nsexec

import (
	"fmt"
	"os"
	"strconv"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Mount is one step of a sandbox's mount program (see launch.h for the
// kinds). Targets are paths inside the rootfs; they resolve there whatever
// symlinks the rootfs holds.
type Mount struct {
	Kind       byte
	Target     string
	Arg1, Arg2 string
	Attr       uint32 // unix.MOUNT_ATTR_*
}

// Mount kinds.
const (
	MountFS       = 'F' // new filesystem Arg1 with parameters Arg2 on a directory
	MountBindDir  = 'D' // bind of host directory Arg1
	MountBindFile = 'f' // bind of host file Arg1
	// MountBindFileFollow is MountBindFile onto a target that may be a
	// symlink, which resolves inside the rootfs (/etc/resolv.conf).
	MountBindFileFollow = 'r'
	MountMask           = 'M' // bind of host path Arg1 over an existing target
	MountReadOnly       = 'R' // read-only rebind of an existing target
	MountSymlink        = 'L' // symlink Target -> Arg1
	MountDir            = 'P' // directory of mode Arg1 (octal), rebound onto itself
	MountTree           = 'T' // clone of the mount open at fd Arg1 (decimal)
)

// LaunchConfig describes a sandbox's init to Launch.
type LaunchConfig struct {
	// RootfsMount, if set, is a detached mount attached at Rootfs inside
	// the sandbox's mount namespace only; otherwise Rootfs is a mount.
	RootfsMount *os.File
	Rootfs      string
	Mounts      []Mount
	Hostname    string
	// CgroupProcs are the cgroup.procs files init joins, one per hierarchy.
	CgroupProcs []string
	// CgroupNS gives the sandbox a cgroup namespace rooted at its cgroup.
	CgroupNS bool
	// NetNS, if set, is the network namespace init joins instead of
	// making one: a fresh one with lo up, which init alone holds after
	// the launch (the caller closes its fd).
	NetNS *os.File
	// UserNS, if set, is the user namespace init joins as its root once
	// its mounts are made: its capabilities (Caps) then hold only there.
	// The launcher makes it, owned by UserNS.Owner. Init's other
	// namespaces belong to the host's user namespace.
	UserNS *IDMap
	// OwnerWait bounds the making of the user namespace (0: 10 s).
	OwnerWait time.Duration
	// Caps is the bounding, permitted and effective set.
	Caps   uint64
	NoFile uint64
	Filter []unix.SockFilter
	// Argv[0] is a path inside the rootfs.
	Argv, Env []string
	// Null is init's stdin, stdout and stderr: /dev/null opened through
	// a read-only mount (see ReadOnlyNull).
	Null *os.File
}

// IDMap is a user namespace's owner and its one ID range (uids and gids
// alike): IDs 0..Size-1 inside are host IDs HostID...
type IDMap struct {
	Owner, HostID, Size uint32
}

// LaunchError is a failed step of the launcher.
type LaunchError struct {
	Step  string
	Errno syscall.Errno
	// Killed: the launcher was killed from outside halfway; init may
	// still be running in the sandbox's cgroup.
	Killed bool
}

func (e *LaunchError) Error() string { return "sandbox launcher: " + e.Step }
func (e *LaunchError) Unwrap() error {
	if e.Errno == 0 {
		return nil
	}
	return e.Errno
}

// ReadOnlyNull opens the host's /dev/null through a read-only mount of its
// own (a detached clone), for stdio of what runs in sandboxes: root inside
// can reach its stdio's file through /proc/1/fd and, with the host's mount,
// chmod or chown the host's /dev/null (CAP_FOWNER, CAP_CHOWN); crun even
// chowns its stdio to a user namespace's root. Through a read-only mount
// both get EROFS, while reads and writes work as on /dev/null.
func ReadOnlyNull() (*os.File, error) {
	t, err := unix.OpenTree(unix.AT_FDCWD, "/dev/null", unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("cloning /dev/null: %w", err)
	}
	defer unix.Close(t)
	attr := unix.MountAttr{Attr_set: unix.MOUNT_ATTR_RDONLY | unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NOEXEC}
	if err := unix.MountSetattr(t, "", unix.AT_EMPTY_PATH, &attr); err != nil {
		return nil, fmt.Errorf("making /dev/null read-only: %w", err)
	}
	f, err := os.OpenFile("/proc/self/fd/"+strconv.Itoa(t), os.O_RDWR, 0)
	if err != nil {
		return nil, fmt.Errorf("opening read-only /dev/null: %w", err)
	}
	return f, nil
}
