package files

import (
	"errors"
	"fmt"
	"os"
	"sort"
	"strconv"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// Resolution modes. Every lookup that takes more than one component goes
// through openat2 with one of these; single components are handled by the
// *at syscalls, none of which follow a trailing symlink the way we call them.
//
// Both stay on the root's mount (RESOLVE_NO_XDEV, EXDEV otherwise): a
// sandbox's root may be opened inside its own mount namespace
// (/proc/PID/root), where /proc, /sys, /dev and bind mounts of host files
// sit below it. Those are the kernel's and the platform's, not the
// sandbox's files, and host root must not write to them on a client's
// behalf. Walks list such a mount point but do not descend into it.
const (
	// inRoot is how API paths are resolved: symlinks are followed, but "/"
	// and ".." are clamped to the root, so whatever the sandbox planted, the
	// walk cannot leave it.
	inRoot = unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV
	// noSymlinks is how tar entries and descents are resolved: any symlink
	// on the way is refused (ELOOP), so an archive cannot write through a
	// link it just planted and a walk never leaves the tree it started in.
	noSymlinks = unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV
)

// openat2 retries the transient failures: EAGAIN is what RESOLVE_IN_ROOT
// returns when a rename raced a ".." step, EINTR is the Go runtime's signals.
func openat2(dirfd int, rel string, flags int, mode uint32, resolve uint64) (int, error) {
	how := unix.OpenHow{
		Flags:   uint64(flags | unix.O_CLOEXEC),
		Mode:    uint64(mode),
		Resolve: resolve,
	}
	for range 128 {
		fd, err := unix.Openat2(dirfd, rel, &how)
		if err == unix.EAGAIN || err == unix.EINTR {
			continue
		}
		return fd, err
	}
	return -1, unix.EAGAIN
}

// unlinkat is unix.Unlinkat for a name in the sandbox, refused with EXDEV
// when something is mounted on the name. The kernel refuses that itself
// (EBUSY) only for mounts of the caller's own mount namespace, and the
// sandbox's /dev, /proc, /sys and bind-mounted files are mounts of the
// sandbox's namespace: from the edge, rmdir("dev") would succeed and
// detach the sandbox's /dev. Mount points inside a sandbox are fixed when
// it starts (nothing in it may mount), so checking first is not racy.
func unlinkat(dirfd int, name string, flags int) error {
	if err := notMountPoint(dirfd, name); err != nil {
		return err
	}
	return unix.Unlinkat(dirfd, name, flags)
}

// notMountPoint returns EXDEV if name in dirfd has something mounted on it
// (reaching it crosses a mount); any other outcome is left to the caller's
// own operation to report.
func notMountPoint(dirfd int, name string) error {
	fd, err := openat2(dirfd, name, unix.O_PATH|unix.O_NOFOLLOW, 0, noSymlinks)
	if err == unix.EXDEV {
		return err
	}
	if err == nil {
		unix.Close(fd)
	}
	return nil
}

// relPath turns a cleaned API path into a path relative to the root fd.
func relPath(clean string) string {
	if clean == "/" {
		return "."
	}
	return clean[1:]
}

// classify turns an errno into an errdefs class so the apiserver can map it.
// Messages never name host paths: they reach API clients.
func classify(err error) error {
	var errno syscall.Errno
	if !errors.As(err, &errno) {
		return err
	}
	switch errno {
	case unix.ENOENT, unix.ENOTDIR:
		return errdefs.NotFound("%v", errno)
	case unix.ELOOP:
		return errdefs.Invalid("symbolic link refused or too many levels of symbolic links")
	case unix.EXDEV:
		return errdefs.Invalid("path crosses a mount point")
	case unix.ENAMETOOLONG, unix.EISDIR, unix.EINVAL:
		return errdefs.Invalid("%v", errno)
	case unix.ENOTEMPTY, unix.EEXIST, unix.EBUSY, unix.EROFS, unix.ETXTBSY:
		return errdefs.Precondition("%v", errno)
	case unix.EACCES, unix.EPERM:
		return errdefs.PermissionDenied("%v", errno)
	case unix.ENOSPC, unix.EDQUOT, unix.EMFILE, unix.ENFILE:
		return errdefs.Exhausted("%v", errno)
	}
	return err
}

// opErr wraps err with a gerund and the sandbox path, classified.
func opErr(op, p string, err error) error {
	return fmt.Errorf("%s %s: %w", op, p, classify(err))
}

// fdPath names an open fd through /proc. Reopening it follows the magic link
// to exactly the inode we hold, which is how an O_PATH fd is upgraded to a
// readable one, and how chmod/setxattr reach an inode without a name lookup.
func fdPath(fd int) string {
	return "/proc/self/fd/" + strconv.Itoa(fd)
}

// openRegular opens rel (relative to dirfd, resolved with resolve) for
// reading, but only if it is a regular file. The sandbox may plant FIFOs
// (an open would hang us) or device nodes (an open as host root would reach
// the host's hardware, and some opens have side effects), so the name is
// first opened O_PATH, which never opens the inode itself, then checked, then
// reopened through /proc so a swap between check and open is impossible.
func openRegular(dirfd int, rel string, flags int, resolve uint64, name string) (*os.File, unix.Stat_t, error) {
	var st unix.Stat_t
	pfd, err := openat2(dirfd, rel, unix.O_PATH|flags, 0, resolve)
	if err != nil {
		return nil, st, err
	}
	defer unix.Close(pfd)
	if err := unix.Fstat(pfd, &st); err != nil {
		return nil, st, err
	}
	if st.Mode&unix.S_IFMT == unix.S_IFDIR {
		return nil, st, unix.EISDIR
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return nil, st, errNotRegular
	}
	fd, err := unix.Open(fdPath(pfd), unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NOCTTY, 0)
	if err != nil {
		return nil, st, err
	}
	return os.NewFile(uintptr(fd), name), st, nil
}

var errNotRegular = errors.New("not a regular file")

// chmodFd sets mode on the inode behind fd, which may be an O_PATH fd.
// fchmodat2 (Linux 6.6) does it directly; older kernels go through /proc.
func chmodFd(fd int, mode uint32) error {
	err := unix.Fchmodat(fd, "", mode, unix.AT_EMPTY_PATH)
	if err == unix.EOPNOTSUPP || err == unix.ENOSYS || err == unix.EINVAL {
		err = unix.Chmod(fdPath(fd), mode)
	}
	return err
}

// readNames returns the names in the directory open at fd, sorted, at most
// limit of them (an error beyond), so a hostile directory with millions of
// entries cannot exhaust memory.
func readNames(fd int, limit int) ([]string, error) {
	if _, err := unix.Seek(fd, 0, 0); err != nil {
		return nil, err
	}
	buf := make([]byte, 32<<10)
	var names []string
	for {
		n, err := unix.Getdents(fd, buf)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return nil, err
		}
		if n <= 0 {
			break
		}
		_, _, names = unix.ParseDirent(buf[:n], -1, names)
		if len(names) > limit {
			return nil, errTooMany
		}
	}
	sort.Strings(names)
	return names, nil
}

var errTooMany = errors.New("too many entries")

// fileType is the API's name for a file type.
func fileType(mode uint32) string {
	switch mode & unix.S_IFMT {
	case unix.S_IFREG:
		return "file"
	case unix.S_IFDIR:
		return "dir"
	case unix.S_IFLNK:
		return "symlink"
	}
	return "other"
}

func isDir(st *unix.Stat_t) bool { return st.Mode&unix.S_IFMT == unix.S_IFDIR }

// readlinkat reads a symlink's target without following it.
func readlinkat(dirfd int, name string) (string, error) {
	buf := make([]byte, unix.PathMax)
	n, err := unix.Readlinkat(dirfd, name, buf)
	if err != nil {
		return "", err
	}
	return string(buf[:n]), nil
}
