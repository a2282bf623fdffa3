package files

import (
	"path"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
)

// Mkdir creates the directory p (mode 0755 less the umask) and its missing
// parents, which are resolved as WriteFile resolves them: symlinks are
// followed inside the root, never out of it. It returns the new
// directory. A directory already at p, or a symlink to one, is
// AlreadyExists; anything else there is Invalid. owner, when not nil,
// owns the directory and the parents this call creates; nil gives them
// to the root's owner (SetOwner), if any.
func (r *Root) Mkdir(p string, owner *Owner) (api.FileEntry, error) {
	if err := r.hold(); err != nil {
		return api.FileEntry{}, err
	}
	defer r.release()
	clean, err := CleanPath(p)
	if err != nil {
		return api.FileEntry{}, err
	}
	if clean == "/" {
		return api.FileEntry{}, errdefs.AlreadyExists("creating directory /: it exists")
	}
	owner = r.ownerOr(owner)
	dir, base := path.Split(clean)
	dirfd, err := r.mkdirAll(relPath(path.Clean(dir)), owner)
	if err == unix.ENOTDIR {
		return api.FileEntry{}, errdefs.Invalid("creating directory %s: a parent is not a directory", clean)
	}
	if err != nil {
		return api.FileEntry{}, opErr("creating parents of", clean, err)
	}
	defer unix.Close(dirfd)
	err = unix.Mkdirat(dirfd, base, 0o755)
	if err == unix.EEXIST {
		// Whatever is there, seen the way the sandbox would see it: the
		// whole path again from the root, a trailing symlink followed.
		fd, err := openat2(r.fd, relPath(clean), unix.O_PATH|unix.O_DIRECTORY, 0, inRoot)
		switch err {
		case nil:
			unix.Close(fd)
			return api.FileEntry{}, errdefs.AlreadyExists("creating directory %s: it exists", clean)
		case unix.ENOTDIR, unix.ENOENT:
			// ENOENT: a symlink to nothing.
			return api.FileEntry{}, errdefs.Invalid("creating directory %s: something that is not a directory is there", clean)
		}
		return api.FileEntry{}, opErr("creating directory", clean, err)
	}
	if err == nil {
		err = chownNew(dirfd, base, owner)
	}
	if err != nil {
		return api.FileEntry{}, opErr("creating directory", clean, err)
	}
	e, err := r.statAt(dirfd, base, clean)
	if err != nil {
		return api.FileEntry{}, opErr("creating directory", clean, err)
	}
	return e, nil
}

// Rename moves src to dst with rename(2)'s meaning: a trailing symlink at
// src is moved itself (not its target), a file at dst is replaced by a
// file and an empty directory by a directory. dst's missing parents are
// created (0755), as E2B's envd does. It returns the moved entry at dst.
//
// Both parents are resolved inside the root (symlinks followed, "/" and
// ".." clamped, no mount crossed), so both directories we rename between
// are the root's own, and the rename itself is one renameat(2) of a
// single name in each. Neither name may have something mounted on it:
// from the host's mount namespace the kernel refuses to move or cover a
// mount point only for mounts of its own namespace, and a sandbox's
// /proc, /dev and bind-mounted files are mounts of the sandbox's.
//
// Errors: NotFound when src (or a parent of it) is missing; Invalid for
// "/", a mount point, a directory moved into itself or onto a
// non-directory and a non-directory onto a directory; Precondition for a
// non-empty directory at dst.
func (r *Root) Rename(src, dst string) (api.FileEntry, error) {
	if err := r.hold(); err != nil {
		return api.FileEntry{}, err
	}
	defer r.release()
	from, err := CleanPath(src)
	if err != nil {
		return api.FileEntry{}, err
	}
	to, err := CleanPath(dst)
	if err != nil {
		return api.FileEntry{}, err
	}
	if from == "/" || to == "/" {
		return api.FileEntry{}, errdefs.Invalid("moving %s to %s: the sandbox root cannot be moved or replaced", from, to)
	}
	srcfd, srcBase, err := r.resolveParent(from)
	if err != nil {
		return api.FileEntry{}, opErr("moving", from, err)
	}
	defer unix.Close(srcfd)
	var st unix.Stat_t
	if err := unix.Fstatat(srcfd, srcBase, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return api.FileEntry{}, opErr("moving", from, err)
	}
	if err := notMountPoint(srcfd, srcBase); err != nil {
		return api.FileEntry{}, errdefs.Invalid("moving %s: it is a mount point", from)
	}

	dir, dstBase := path.Split(to)
	dstfd, err := r.mkdirAll(relPath(path.Clean(dir)), r.owner)
	if err == unix.ENOTDIR {
		return api.FileEntry{}, errdefs.Invalid("moving %s to %s: a parent of the destination is not a directory", from, to)
	}
	if err != nil {
		return api.FileEntry{}, opErr("creating parents of", to, err)
	}
	defer unix.Close(dstfd)
	if err := notMountPoint(dstfd, dstBase); err != nil {
		return api.FileEntry{}, errdefs.Invalid("moving %s to %s: the destination is a mount point", from, to)
	}

	switch err := unix.Renameat(srcfd, srcBase, dstfd, dstBase); err {
	case nil:
	case unix.EISDIR:
		return api.FileEntry{}, errdefs.Invalid("moving %s to %s: the destination is a directory", from, to)
	case unix.ENOTDIR:
		return api.FileEntry{}, errdefs.Invalid("moving %s to %s: a directory cannot replace a non-directory", from, to)
	case unix.ENOTEMPTY, unix.EEXIST:
		return api.FileEntry{}, errdefs.Precondition("moving %s to %s: the destination is a directory that is not empty", from, to)
	case unix.EINVAL:
		return api.FileEntry{}, errdefs.Invalid("moving %s to %s: a directory cannot move into itself", from, to)
	default:
		return api.FileEntry{}, opErr("moving", from, err)
	}
	e, err := r.statAt(dstfd, dstBase, to)
	if err != nil {
		return api.FileEntry{}, opErr("moving", from, err)
	}
	return e, nil
}
