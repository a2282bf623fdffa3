package nsexec

import (
	"os"
	"syscall"

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
	// Caps is the bounding, permitted and effective set.
	Caps   uint64
	NoFile uint64
	Filter []unix.SockFilter
	// Argv[0] is a path inside the rootfs.
	Argv, Env []string
}

// LaunchError is a failed step of the launcher.
type LaunchError struct {
	Step  string
	Errno syscall.Errno
}

func (e *LaunchError) Error() string { return "sandbox launcher: " + e.Step }
func (e *LaunchError) Unwrap() error {
	if e.Errno == 0 {
		return nil
	}
	return e.Errno
}
