package files

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"
)

// MaxRemoveFDs is the most descriptors RemoveAll holds at once, however
// deep the tree: one for the parent of the tree and one per directory on
// the path it is emptying.
const MaxRemoveFDs = maxRemoveDepth + 1

// maxRemoveDepth is how many directories of the tree RemoveAll keeps open
// on its way down.
const maxRemoveDepth = 16

// RemoveAll removes path and everything below it, as os.RemoveAll does,
// for a tree a sandbox wrote (a deleted sandbox's writable layer):
//
//   - it holds at most MaxRemoveFDs descriptors. os.RemoveAll holds one per
//     level, and a sandbox's 30,000-level tree ran the daemon out of them;
//     here a directory found below maxRemoveDepth open ones is renamed up
//     into the tree's top directory, where a later descent starts over from
//     the top, so the tree is flattened as it is removed;
//   - it never follows a symlink (a link is removed, its target is not
//     touched) and never descends into a mount point (RESOLVE_NO_XDEV: such
//     a tree is left in place with an error, rather than emptying whatever
//     is mounted there);
//   - it reads each directory in a fixed buffer, so memory stays bounded
//     however many entries a directory has;
//   - its error names at most one entry of the tree, quoted and cut short,
//     so a failure deep down does not become a log line of every name on
//     the way there.
//
// The components of path above the tree are the caller's and are trusted.
// A missing path is not an error. Nothing else may change the tree while
// it is removed: a sandbox's tree is removed once its processes are gone.
func RemoveAll(path string) error {
	if base := filepath.Base(path); base == "." || base == ".." || base == "/" {
		return fmt.Errorf("removing %s: refusing to remove a directory named %q", path, base)
	}
	dir, name := filepath.Split(filepath.Clean(path))
	if dir == "" {
		dir = "."
	}
	parent, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err == unix.ENOENT {
		return nil
	}
	if err != nil {
		return fmt.Errorf("removing %s: %w", path, err)
	}
	defer unix.Close(parent)
	if err := removeTree(parent, name); err != nil {
		return fmt.Errorf("removing %s: %w", path, err)
	}
	return nil
}

// removeTree removes name in parent and everything below it. It sweeps the
// tree until the top directory can be removed, or until a sweep removes
// nothing (some entries cannot be removed: the first failure is the
// error). One sweep is enough unless a directory listing skipped entries
// removed while it was read, which POSIX allows.
func removeTree(parent int, name string) error {
	switch err := unix.Unlinkat(parent, name, 0); err {
	case nil, unix.ENOENT:
		return nil
	case unix.EISDIR:
	default:
		return err
	}
	for {
		progress, serr := sweep(parent, name)
		if serr == errTopMounted {
			// Never rmdir it: from another mount namespace than the
			// mount's, that would detach it.
			return serr
		}
		err := unix.Unlinkat(parent, name, unix.AT_REMOVEDIR)
		switch {
		case err == nil || err == unix.ENOENT:
			return nil
		case err != unix.ENOTEMPTY && err != unix.EEXIST:
			return err
		case serr != nil && !progress:
			return serr
		case !progress:
			return errors.New("the directory keeps entries that cannot be listed")
		}
	}
}

var errTopMounted = errors.New("it is a mount point")

// dirFrame is one open directory on the path being emptied.
type dirFrame struct {
	fd    int
	name  string // in the frame above (or the tree's parent)
	names []string
	buf   []byte
	eof   bool
}

// next returns the next entry of the directory (not . or ..).
func (f *dirFrame) next() (string, bool, error) {
	for len(f.names) == 0 {
		if f.eof {
			return "", false, nil
		}
		n, err := unix.Getdents(f.fd, f.buf)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return "", false, err
		}
		if n <= 0 {
			f.eof = true
			continue
		}
		_, _, f.names = unix.ParseDirent(f.buf[:n], -1, f.names[:0])
	}
	name := f.names[0]
	f.names = f.names[1:]
	return name, true, nil
}

// rewind starts reading the directory again from its first entry.
func (f *dirFrame) rewind() error {
	if _, err := unix.Seek(f.fd, 0, 0); err != nil {
		return err
	}
	f.names, f.eof = f.names[:0], false
	return nil
}

// treeFailure is the first entry a sweep could not remove, and how many
// failed in all.
type treeFailure struct {
	err   error
	count int
}

func (t *treeFailure) add(op, name string, depth int, err error) {
	t.count++
	if t.err == nil {
		t.err = fmt.Errorf("%s %s at depth %d: %w", op, quoteName(name), depth, err)
	}
}

func (t *treeFailure) result() error {
	switch {
	case t.err == nil:
		return nil
	case t.count > 1:
		return fmt.Errorf("%w (and %d more entries)", t.err, t.count-1)
	}
	return t.err
}

// quoteName quotes an entry name for an error, cut to 64 bytes: names are
// the sandbox's, and may hold newlines and terminal escapes.
func quoteName(name string) string {
	if len(name) > 64 {
		return strconv.Quote(name[:64]) + "..."
	}
	return strconv.Quote(name)
}

// openTreeDir opens name in dirfd as a directory without following a
// symlink or crossing a mount (EXDEV).
func openTreeDir(dirfd int, name string) (int, error) {
	return openat2(dirfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW, 0,
		unix.RESOLVE_BENEATH|unix.RESOLVE_NO_SYMLINKS|unix.RESOLVE_NO_MAGICLINKS|unix.RESOLVE_NO_XDEV)
}

// sweep walks the tree at name in parent depth first, removing every
// entry it can, with at most maxRemoveDepth of its directories open. A
// directory met below the deepest open one is renamed into the top
// directory (under a fresh name) instead of opened; the top directory is
// read again whenever that happened, so one sweep reaches the whole tree.
// It reports whether it removed or moved anything, and the first failure.
func sweep(parent int, name string) (progress bool, err error) {
	var fail treeFailure
	top, err := openTreeDir(parent, name)
	switch err {
	case nil:
	case unix.ENOENT:
		return false, nil
	case unix.EXDEV:
		return false, errTopMounted
	default:
		return false, err
	}
	stack := make([]*dirFrame, 0, maxRemoveDepth)
	bufs := make([][]byte, maxRemoveDepth)
	push := func(fd int, name string) {
		d := len(stack)
		if bufs[d] == nil {
			bufs[d] = make([]byte, 16<<10)
		}
		stack = append(stack, &dirFrame{fd: fd, name: name, buf: bufs[d]})
	}
	push(top, name)
	defer func() {
		for _, f := range stack {
			unix.Close(f.fd)
		}
	}()
	movedUp := false
	for len(stack) > 0 {
		f := stack[len(stack)-1]
		depth := len(stack)
		child, ok, err := f.next()
		if err != nil {
			fail.add("reading", f.name, depth-1, err)
			ok = false
		}
		if !ok {
			if depth == 1 {
				if movedUp && err == nil {
					// Subtrees were moved up into the top: read it again.
					movedUp = false
					if err := f.rewind(); err == nil {
						continue
					}
				}
				break // the caller removes the top directory
			}
			unix.Close(f.fd)
			stack = stack[:depth-1]
			switch err := unix.Unlinkat(stack[depth-2].fd, f.name, unix.AT_REMOVEDIR); err {
			case nil:
				progress = true
			case unix.ENOENT, unix.ENOTEMPTY, unix.EEXIST:
				// Left for the next sweep: an entry it kept is
				// counted where it failed, or the listing skipped one.
			default:
				fail.add("removing directory", f.name, depth-1, err)
			}
			continue
		}
		switch err := unix.Unlinkat(f.fd, child, 0); err {
		case nil:
			progress = true
			continue
		case unix.ENOENT:
			continue
		case unix.EISDIR:
		default:
			fail.add("removing", child, depth, err)
			continue
		}
		if depth < maxRemoveDepth {
			switch fd, err := openTreeDir(f.fd, child); err {
			case nil:
				push(fd, child)
			case unix.ENOENT:
			case unix.EXDEV:
				fail.add("descending into", child, depth, errors.New("a mount point"))
			default:
				fail.add("opening", child, depth, err)
			}
			continue
		}
		if err := moveUp(f.fd, child, top); err != nil {
			fail.add("moving up", child, depth, err)
			continue
		}
		progress, movedUp = true, true
	}
	return progress, fail.result()
}

// moveUp renames the directory name in dirfd into top under a name that is
// not taken.
func moveUp(dirfd int, name string, top int) error {
	var err error
	for range 8 {
		tmp := ".dsec-rm-" + strconv.FormatUint(rand.Uint64(), 36)
		err = unix.Renameat2(dirfd, name, top, tmp, unix.RENAME_NOREPLACE)
		if err == unix.EINVAL || err == unix.ENOSYS {
			// A filesystem without RENAME_NOREPLACE: nothing else
			// changes the tree, so a name that is free now stays free.
			var st unix.Stat_t
			if serr := unix.Fstatat(top, tmp, &st, unix.AT_SYMLINK_NOFOLLOW); serr != unix.ENOENT {
				continue
			}
			err = unix.Renameat(dirfd, name, top, tmp)
		}
		if err != unix.EEXIST {
			return err
		}
	}
	return err
}
