package layer

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"slices"
	"strconv"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/files"
)

// opaqueXattr marks an overlayfs directory that hides whatever the layers
// below have at its path.
const opaqueXattr = "trusted.overlay.opaque"

// ApplyDiff applies the overlay diff tree at diff (an overlay upper, or a
// snapshot layer made from one) onto the directory dst in place, so that dst
// stacked on some layers shows what diff stacked on dst on those layers
// would. dst stays a diff itself: whiteouts and opaque directories are kept,
// so applying a chain of snapshot layers in order, bottom first, onto an
// empty directory flattens the chain into one layer.
//
// Per entry of diff: a whiteout (character device 0:0) replaces dst's entry
// with a whiteout; an opaque directory replaces dst's entry with a copy of
// it; any other directory is merged into dst's (created if missing, opaque
// if it replaces a non-directory or a whiteout, since that entry hid the
// layers below) and takes diff's metadata; anything else replaces dst's
// entry with a copy. Copies keep owner, mode, times and every xattr, and
// hard links between entries of diff; they never share data with diff,
// which may be a read-only mount that goes away.
//
// Symlinks are never followed: the walk goes through directory descriptors
// opened with O_NOFOLLOW and every other call is relative to one. It needs
// root (trusted.* xattrs, device nodes, chown).
func ApplyDiff(dst, diff string) error {
	return ApplyDiffExcluding(dst, diff, nil)
}

// ApplyDiffExcluding is ApplyDiff leaving out the given paths of diff
// (absolute as seen from its root, like BuildOptions.Exclude) with
// everything below them: dst keeps what it has there.
func ApplyDiffExcluding(dst, diff string, exclude []string) error {
	a := &applier{exclude: map[string]bool{}, links: map[fileID]string{}}
	for _, x := range exclude {
		a.exclude[path.Clean("/"+x)] = true
	}
	src, err := openDir(unix.AT_FDCWD, diff)
	if err != nil {
		return fmt.Errorf("applying diff %s: %w", diff, err)
	}
	defer src.Close()
	d, err := openDir(unix.AT_FDCWD, dst)
	if err != nil {
		return fmt.Errorf("applying diff onto %s: %w", dst, err)
	}
	defer d.Close()
	a.root = d
	if err := a.merge(d, src, "/"); err != nil {
		return fmt.Errorf("applying diff %s onto %s: %w", diff, dst, err)
	}
	// The root takes diff's metadata like any merged directory.
	if err := copyMeta(int(src.Fd()), ".", int(d.Fd()), ".", nil); err != nil {
		return fmt.Errorf("applying diff %s onto %s: /: %w", diff, dst, err)
	}
	return nil
}

type fileID struct{ dev, ino uint64 }

type applier struct {
	exclude map[string]bool
	// links maps a multiply-linked file of diff to its copy's path in dst
	// (relative to root), so its other names become links to the copy.
	// Safe because one diff names each path once: a copy made in this
	// application is never replaced later in it.
	links map[fileID]string
	root  *os.File
}

// merge applies the entries of the diff directory src (at rel) onto the dst
// directory.
func (a *applier) merge(dst, src *os.File, rel string) error {
	names, err := src.Readdirnames(-1)
	if err != nil {
		return fmt.Errorf("%s: %w", rel, err)
	}
	slices.Sort(names)
	sfd, dfd := int(src.Fd()), int(dst.Fd())
	for _, name := range names {
		p := path.Join(rel, name)
		if a.exclude[p] {
			continue
		}
		var st unix.Stat_t
		if err := unix.Fstatat(sfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
		if st.Mode&unix.S_IFMT != unix.S_IFDIR {
			if err := removeAt(dfd, name); err != nil {
				return fmt.Errorf("%s: %w", p, err)
			}
			if err := a.copy(sfd, dfd, name, p, &st); err != nil {
				return err
			}
			continue
		}
		opaque, err := getXattr(sfd, name, opaqueXattr)
		if err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
		if string(opaque) == "y" {
			if err := removeAt(dfd, name); err != nil {
				return fmt.Errorf("%s: %w", p, err)
			}
			if err := a.copy(sfd, dfd, name, p, &st); err != nil {
				return err
			}
			continue
		}
		if err := a.mergeDir(sfd, dfd, name, p); err != nil {
			return err
		}
	}
	return nil
}

// mergeDir merges the non-opaque diff directory name into dst's entry.
func (a *applier) mergeDir(sfd, dfd int, name, p string) error {
	// The directory must stay opaque if dst's was, and become opaque if
	// it replaces a non-directory or a whiteout: either hid the layers
	// below dst at this path, and a plain directory would let them through.
	keepOpaque := false
	var dt unix.Stat_t
	switch err := unix.Fstatat(dfd, name, &dt, unix.AT_SYMLINK_NOFOLLOW); {
	case errors.Is(err, unix.ENOENT):
		if err := unix.Mkdirat(dfd, name, 0o700); err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
	case err != nil:
		return fmt.Errorf("%s: %w", p, err)
	case dt.Mode&unix.S_IFMT == unix.S_IFDIR:
		v, err := getXattr(dfd, name, opaqueXattr)
		if err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
		keepOpaque = string(v) == "y"
	default:
		if err := unix.Unlinkat(dfd, name, 0); err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
		if err := unix.Mkdirat(dfd, name, 0o700); err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
		keepOpaque = true
	}
	sub, err := openDir(sfd, name)
	if err != nil {
		return fmt.Errorf("%s: %w", p, err)
	}
	defer sub.Close()
	dsub, err := openDir(dfd, name)
	if err != nil {
		return fmt.Errorf("%s: %w", p, err)
	}
	defer dsub.Close()
	if err := a.merge(dsub, sub, p); err != nil {
		return err
	}
	var keep map[string][]byte
	if keepOpaque {
		keep = map[string][]byte{opaqueXattr: []byte("y")}
	}
	if err := copyMeta(sfd, name, dfd, name, keep); err != nil {
		return fmt.Errorf("%s: %w", p, err)
	}
	return nil
}

// copy copies the entry name (at p, with stat st) of the src directory into
// the dst directory, where nothing of that name exists.
func (a *applier) copy(sfd, dfd int, name, p string, st *unix.Stat_t) error {
	id := fileID{uint64(st.Dev), st.Ino}
	if st.Mode&unix.S_IFMT == unix.S_IFREG && st.Nlink > 1 {
		if first, ok := a.links[id]; ok {
			if err := unix.Linkat(int(a.root.Fd()), first, dfd, name, 0); err != nil {
				return fmt.Errorf("%s: linking to %s: %w", p, first, err)
			}
			return nil
		}
		a.links[id] = p[1:]
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
		if err := copyData(sfd, dfd, name, st); err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
	case unix.S_IFDIR:
		if err := unix.Mkdirat(dfd, name, 0o700); err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
		if err := a.copyDir(sfd, dfd, name, p); err != nil {
			return err
		}
	case unix.S_IFLNK:
		target, err := readlinkAt(sfd, name)
		if err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
		if err := unix.Symlinkat(target, dfd, name); err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
	default: // whiteouts and other devices, fifos, sockets
		if err := unix.Mknodat(dfd, name, st.Mode, int(st.Rdev)); err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
	}
	if err := copyMeta(sfd, name, dfd, name, nil); err != nil {
		return fmt.Errorf("%s: %w", p, err)
	}
	return nil
}

// copyDir copies the children of the directory name of src into the new,
// empty directory of the same name in dst.
func (a *applier) copyDir(sfd, dfd int, name, p string) error {
	sub, err := openDir(sfd, name)
	if err != nil {
		return fmt.Errorf("%s: %w", p, err)
	}
	defer sub.Close()
	dsub, err := openDir(dfd, name)
	if err != nil {
		return fmt.Errorf("%s: %w", p, err)
	}
	defer dsub.Close()
	names, err := sub.Readdirnames(-1)
	if err != nil {
		return fmt.Errorf("%s: %w", p, err)
	}
	slices.Sort(names)
	for _, n := range names {
		cp := path.Join(p, n)
		if a.exclude[cp] {
			continue
		}
		var st unix.Stat_t
		if err := unix.Fstatat(int(sub.Fd()), n, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return fmt.Errorf("%s: %w", cp, err)
		}
		if err := a.copy(int(sub.Fd()), int(dsub.Fd()), n, cp, &st); err != nil {
			return err
		}
	}
	return nil
}

// copyData copies the regular file name of src to a new file in dst.
func copyData(sfd, dfd int, name string, st *unix.Stat_t) error {
	// O_NONBLOCK: should the entry have been swapped for a fifo, the
	// open must not hang; the inode check below then refuses it.
	in, err := openAt(sfd, name, unix.O_RDONLY|unix.O_NOCTTY|unix.O_NONBLOCK)
	if err != nil {
		return err
	}
	defer in.Close()
	var fst unix.Stat_t
	if err := unix.Fstat(int(in.Fd()), &fst); err != nil {
		return err
	}
	if fst.Ino != st.Ino || fst.Dev != st.Dev {
		return errors.New("file changed while being copied")
	}
	ofd, err := unix.Openat(dfd, name, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return err
	}
	out := os.NewFile(uintptr(ofd), name)
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// copyMeta gives dst's entry dname the owner, mode, xattrs and times of
// src's entry sname; xattrs dst has and src lacks are removed, except those
// in keep, which are set to the given values. The order matters: chown
// clears setuid bits and file capabilities, and every other change but the
// times moves the ctime only.
func copyMeta(sfd int, sname string, dfd int, dname string, keep map[string][]byte) error {
	var st unix.Stat_t
	if err := unix.Fstatat(sfd, sname, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return err
	}
	if err := unix.Fchownat(dfd, dname, int(st.Uid), int(st.Gid), unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("chown: %w", err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFLNK { // symlinks have no mode of their own
		// fchmodat2 (Linux 6.6, below the 6.12 dsec needs) takes
		// AT_SYMLINK_NOFOLLOW.
		if err := unix.Fchmodat(dfd, dname, st.Mode&0o7777, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return fmt.Errorf("chmod: %w", err)
		}
	}
	if err := copyXattrs(sfd, sname, dfd, dname, keep); err != nil {
		return err
	}
	ts := []unix.Timespec{st.Atim, st.Mtim}
	if err := unix.UtimesNanoAt(dfd, dname, ts, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("setting times: %w", err)
	}
	return nil
}

func copyXattrs(sfd int, sname string, dfd int, dname string, keep map[string][]byte) error {
	want, err := listXattrs(sfd, sname)
	if err != nil {
		return err
	}
	have, err := listXattrs(dfd, dname)
	if err != nil {
		return err
	}
	for _, n := range have {
		if slices.Contains(want, n) || keep[n] != nil {
			continue
		}
		if err := unix.Lremovexattr(procPath(dfd, dname), n); err != nil {
			return fmt.Errorf("removing xattr %s: %w", n, err)
		}
	}
	for _, n := range want {
		if keep[n] != nil {
			continue
		}
		v, err := getXattr(sfd, sname, n)
		if err != nil {
			return err
		}
		if err := unix.Lsetxattr(procPath(dfd, dname), n, v, 0); err != nil {
			return fmt.Errorf("setting xattr %s: %w", n, err)
		}
	}
	for n, v := range keep {
		if err := unix.Lsetxattr(procPath(dfd, dname), n, v, 0); err != nil {
			return fmt.Errorf("setting xattr %s: %w", n, err)
		}
	}
	return nil
}

// procPath names the entry name of the directory open as dirfd. The
// xattr calls take only paths; through /proc/self/fd they resolve the
// directory by descriptor, and their l-variants never follow name itself.
func procPath(dirfd int, name string) string {
	if dirfd == unix.AT_FDCWD {
		return name
	}
	return "/proc/self/fd/" + strconv.Itoa(dirfd) + "/" + name
}

func listXattrs(dirfd int, name string) ([]string, error) {
	names, err := files.ListXattrs(procPath(dirfd, name))
	if err != nil {
		return nil, fmt.Errorf("listing xattrs: %w", err)
	}
	return names, nil
}

// getXattr returns the value of xattr attr of entry name, nil if unset.
func getXattr(dirfd int, name, attr string) ([]byte, error) {
	v, err := files.GetXattr(procPath(dirfd, name), attr)
	if err != nil {
		return nil, fmt.Errorf("reading xattr %s: %w", attr, err)
	}
	return v, nil
}

func readlinkAt(dirfd int, name string) (string, error) {
	for size := 256; ; size *= 2 {
		buf := make([]byte, size)
		n, err := unix.Readlinkat(dirfd, name, buf)
		if err != nil {
			return "", err
		}
		if n < size {
			return string(buf[:n]), nil
		}
	}
}

// removeAt removes the entry name of the directory open as dirfd, with
// everything below it; a missing entry is not an error. os.RemoveAll walks
// with openat and O_NOFOLLOW, and reaches the parent by descriptor here.
func removeAt(dirfd int, name string) error {
	return os.RemoveAll(procPath(dirfd, name))
}

func openDir(dirfd int, name string) (*os.File, error) {
	return openAt(dirfd, name, unix.O_RDONLY|unix.O_DIRECTORY)
}

func openAt(dirfd int, name string, flags int) (*os.File, error) {
	fd, err := unix.Openat(dirfd, name, flags|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	return os.NewFile(uintptr(fd), name), nil
}
