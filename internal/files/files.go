// Package files performs file operations on a sandbox's root filesystem from
// the host side, confined to that root. The edge imports it to serve the
// files API (read, write, stat, list, remove, tar in and out, and for the
// E2B dialect mkdir, rename and directory watches); the layer
// builder imports it to extract archives into a staging directory.
//
// The sandbox's code is untrusted root: it can plant absolute and relative
// symlinks, FIFOs, device nodes and hard links, and it can swap a directory
// for a symlink while we work. So no operation re-joins strings into a host
// path. A Root holds a directory fd; every lookup of more than one component
// is done by openat2(2) relative to a directory fd with RESOLVE_IN_ROOT (so
// "/" and ".." clamp to the root) and RESOLVE_NO_MAGICLINKS, and every change
// is made by an *at syscall on a single name in a directory we hold open,
// never following a trailing symlink. Apart from directories, only regular
// files are ever opened for reading, and only files we just created are
// opened for writing, so an inode hard-linked elsewhere is never modified.
//
// One assumption carries the design: a directory fd inside the root stays
// inside it, because the sandbox cannot rename a directory out of its own
// root filesystem.
package files

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"path"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
)

// MaxPathLen bounds API paths; it is the kernel's PATH_MAX.
const MaxPathLen = 4096

// Default limits. They bound the host's work for one request, whatever the
// sandbox has put in its filesystem.
const (
	// DefaultMaxListEntries bounds a List result.
	DefaultMaxListEntries = 100000
	// DefaultMaxDirEntries bounds the names read from one directory.
	DefaultMaxDirEntries = 1 << 20
	// DefaultMaxNesting bounds how deep a walk descends; each level holds
	// one fd, and a hostile tree can be nested arbitrarily deep.
	DefaultMaxNesting = 512
)

// Root is an opened sandbox root directory. It is safe for concurrent use
// until Close.
type Root struct {
	fd   int    // O_PATH directory fd; all lookups start here
	path string // host path, for the operator's logs only: never in errors

	maxListEntries int
	maxDirEntries  int
	maxNesting     int
	removeBatch    int // names unlinked per directory read in recursive removal

	// owner, when set, owns what this Root creates (files, directories,
	// tar entries without PreserveOwner): a user-namespace sandbox's root.
	owner *Owner
	// idBase and idSize, when idSize > 0, map host IDs to the sandbox's:
	// host IDs idBase..idBase+idSize-1 are the user namespace's 0.., and
	// any other shows as nobody (NoID), as the sandbox itself sees it.
	idBase, idSize uint32

	// refMu guards refs (operations in flight) and closing (see Close).
	refMu   sync.Mutex
	refs    int
	closing bool
}

// Owner is a host uid and gid.
type Owner struct{ UID, GID int }

// SetOwner makes o the owner of everything r creates from now on that
// the call does not give an owner of its own, instead of the caller
// (root). A sandbox in a user namespace sees files owned by host root as
// nobody's, and its root could not change them.
func (r *Root) SetOwner(o Owner) { r.owner = &o }

// NoID is the ID a user namespace shows for host IDs it does not map.
const NoID = 65534

// SetIDMap makes the entries r describes carry the IDs a user-namespace
// sandbox sees: host IDs base..base+size-1 as 0..size-1, any other as
// NoID. Call it before the root is used.
func (r *Root) SetIDMap(base, size uint32) { r.idBase, r.idSize = base, size }

// sandboxID maps a host uid or gid to the sandbox's view of it.
func (r *Root) sandboxID(id uint32) uint32 {
	if r.idSize == 0 {
		return id
	}
	if id >= r.idBase && id-r.idBase < r.idSize {
		return id - r.idBase
	}
	return NoID
}

// HostOwner returns the host IDs that files owned by uid and gid, as the
// sandbox sees them, carry on disk: the same IDs, or with SetIDMap the
// user namespace's (base+uid). An ID the sandbox cannot have (outside
// its user namespace, or -1, which chown reads as "unchanged") is
// Invalid.
func (r *Root) HostOwner(uid, gid uint32) (Owner, error) {
	for _, id := range []uint32{uid, gid} {
		switch {
		case id == ^uint32(0):
			return Owner{}, errdefs.Invalid("ID %d is not a user or group ID", id)
		case r.idSize > 0 && id >= r.idSize:
			return Owner{}, errdefs.Invalid("ID %d is outside the sandbox's user namespace (0 to %d)", id, r.idSize-1)
		}
	}
	if r.idSize > 0 {
		uid, gid = uid+r.idBase, gid+r.idBase
	}
	return Owner{UID: int(uid), GID: int(gid)}, nil
}

// ownerOr is the owner of what one call creates: o when the call names
// one, else the root's own (SetOwner), else nil (the caller, root).
func (r *Root) ownerOr(o *Owner) *Owner {
	if o != nil {
		return o
	}
	return r.owner
}

// chownNew gives the directory name in dirfd, which the call just
// created, to o (nil: nothing to do). It is chowned through an fd opened
// O_DIRECTORY|O_NOFOLLOW, not by name: if the sandbox swapped the name
// in between for a symlink, or for a hard link to a file it could not
// chown itself, the open fails and nothing changes hands.
func chownNew(dirfd int, name string, o *Owner) error {
	if o == nil {
		return nil
	}
	fd, err := openat2(dirfd, name, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW, 0, noSymlinks)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return unix.Fchownat(fd, "", o.UID, o.GID, unix.AT_EMPTY_PATH|unix.AT_SYMLINK_NOFOLLOW)
}

// Open opens the directory at the host path as a sandbox root.
func Open(path string) (*Root, error) {
	fd, err := unix.Open(path, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("opening sandbox root: %w", classify(err))
	}
	// Probe openat2 once so an old kernel fails here, loudly, rather than on
	// the first request.
	probe, err := openat2(fd, ".", unix.O_PATH, 0, inRoot)
	if err != nil {
		unix.Close(fd)
		if err == unix.ENOSYS {
			return nil, errdefs.Unavailable("opening sandbox root: kernel lacks openat2 (Linux 5.6+ required)")
		}
		return nil, fmt.Errorf("opening sandbox root: %w", classify(err))
	}
	unix.Close(probe)
	return &Root{
		fd:             fd,
		path:           path,
		maxListEntries: DefaultMaxListEntries,
		maxDirEntries:  DefaultMaxDirEntries,
		maxNesting:     DefaultMaxNesting,
		removeBatch:    4096,
	}, nil
}

// Path returns the host path the root was opened at.
func (r *Root) Path() string { return r.path }

// Statfs describes the filesystem the root is on.
func (r *Root) Statfs() (unix.Statfs_t, error) {
	var st unix.Statfs_t
	if err := r.hold(); err != nil {
		return st, err
	}
	defer r.release()
	err := unix.Fstatfs(r.fd, &st)
	return st, err
}

// Close releases the root's fd once no operation uses it any more, and
// refuses new operations at once. An operation in flight (a long tar, say)
// keeps the fd open until it ends: closing it under the operation would
// let it run on whatever the kernel gives the fd number to next, another
// sandbox's root included.
func (r *Root) Close() error {
	r.refMu.Lock()
	defer r.refMu.Unlock()
	if r.closing {
		return nil
	}
	r.closing = true
	if r.refs > 0 {
		return nil // the last release closes it
	}
	return r.closeFD()
}

// hold marks an operation in flight on r, or fails if r is closed; the
// operation calls release when it no longer uses r.fd.
func (r *Root) hold() error {
	r.refMu.Lock()
	defer r.refMu.Unlock()
	if r.closing {
		return errdefs.Precondition("the sandbox's root is closed: the sandbox is being stopped or deleted")
	}
	r.refs++
	return nil
}

func (r *Root) release() {
	r.refMu.Lock()
	defer r.refMu.Unlock()
	r.refs--
	if r.refs == 0 && r.closing {
		_ = r.closeFD()
	}
}

// closeFD closes r.fd. Preconditions: r.refMu held, no operation in flight.
func (r *Root) closeFD() error {
	if r.fd < 0 {
		return nil
	}
	err := unix.Close(r.fd)
	r.fd = -1
	return err
}

// CleanPath validates and cleans an API path: it must be absolute, free of
// NUL bytes and at most MaxPathLen long. ".." is resolved lexically and
// cannot climb above "/", so "/../etc" is "/etc" inside the sandbox; the
// kernel-side RESOLVE_IN_ROOT gives symlinks the same meaning.
func CleanPath(p string) (string, error) {
	switch {
	case p == "":
		return "", errdefs.Invalid("path is empty")
	case len(p) > MaxPathLen:
		return "", errdefs.Invalid("path longer than %d bytes", MaxPathLen)
	case strings.IndexByte(p, 0) >= 0:
		return "", errdefs.Invalid("path contains a NUL byte")
	case p[0] != '/':
		return "", errdefs.Invalid("path %q is not absolute", p)
	}
	return path.Clean(p), nil
}

// resolveParent opens the parent directory of the cleaned path p
// (following symlinks inside the root) as an O_PATH fd. base is "" and no fd
// is returned when p is "/".
func (r *Root) resolveParent(clean string) (dirfd int, base string, err error) {
	if clean == "/" {
		return -1, "", nil
	}
	dir, base := path.Split(clean)
	dirfd, err = openat2(r.fd, relPath(path.Clean(dir)), unix.O_PATH|unix.O_DIRECTORY, 0, inRoot)
	return dirfd, base, err
}

// Stat describes p without following a trailing symlink.
func (r *Root) Stat(p string) (api.FileEntry, error) {
	if err := r.hold(); err != nil {
		return api.FileEntry{}, err
	}
	defer r.release()
	clean, err := CleanPath(p)
	if err != nil {
		return api.FileEntry{}, err
	}
	dirfd, base, err := r.resolveParent(clean)
	if err != nil {
		return api.FileEntry{}, opErr("stating", clean, err)
	}
	if base == "" {
		var st unix.Stat_t
		if err := unix.Fstat(r.fd, &st); err != nil {
			return api.FileEntry{}, opErr("stating", clean, err)
		}
		return r.fileEntry(clean, &st, ""), nil
	}
	defer unix.Close(dirfd)
	e, err := r.statAt(dirfd, base, clean)
	if err != nil {
		return api.FileEntry{}, opErr("stating", clean, err)
	}
	return e, nil
}

// statAt lstats name in dirfd and describes it as the sandbox path apiPath.
func (r *Root) statAt(dirfd int, name, apiPath string) (api.FileEntry, error) {
	var st unix.Stat_t
	if err := unix.Fstatat(dirfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return api.FileEntry{}, err
	}
	var target string
	if st.Mode&unix.S_IFMT == unix.S_IFLNK {
		t, err := readlinkat(dirfd, name)
		if err != nil {
			return api.FileEntry{}, err
		}
		target = t
	}
	return r.fileEntry(apiPath, &st, target), nil
}

func (r *Root) fileEntry(apiPath string, st *unix.Stat_t, target string) api.FileEntry {
	return api.FileEntry{
		Path:       apiPath,
		Type:       fileType(st.Mode),
		Size:       st.Size,
		Mode:       fmt.Sprintf("%04o", st.Mode&07777),
		MTime:      time.Unix(st.Mtim.Sec, st.Mtim.Nsec).UTC(),
		LinkTarget: target,
		UID:        r.sandboxID(st.Uid),
		GID:        r.sandboxID(st.Gid),
	}
}

// ReadFile opens the regular file at p for reading, following symlinks
// inside the root (as a read inside the sandbox would). It refuses
// directories and anything that is not a regular file with Invalid.
func (r *Root) ReadFile(p string) (io.ReadCloser, api.FileEntry, error) {
	if err := r.hold(); err != nil {
		return nil, api.FileEntry{}, err
	}
	defer r.release()
	clean, err := CleanPath(p)
	if err != nil {
		return nil, api.FileEntry{}, err
	}
	f, st, err := openRegular(r.fd, relPath(clean), 0, inRoot, clean)
	switch {
	case err == unix.EISDIR:
		return nil, api.FileEntry{}, errdefs.Invalid("reading %s: is a directory", clean)
	case err == errNotRegular:
		return nil, api.FileEntry{}, errdefs.Invalid("reading %s: not a regular file", clean)
	case err != nil:
		return nil, api.FileEntry{}, opErr("reading", clean, err)
	}
	return f, r.fileEntry(clean, &st, ""), nil
}

// WriteFile writes data to p, creating missing parents (0755). It writes a
// temporary file next to the target and renames it over the target, so
// readers see the old or the new content, never a mix. A trailing symlink at
// p is replaced, not written through (rename semantics). With maxBytes > 0,
// longer data is refused with Invalid and nothing is left behind; at most
// maxBytes bytes ever reach the disk. mode applies exactly (permission and
// setuid/setgid/sticky bits; 0 gives 0000), regardless of umask. owner,
// when not nil, owns the file and the parents this call creates (host
// IDs: see HostOwner); nil gives them to the root's owner (SetOwner), if
// any. Existing parents keep theirs. It returns the number of bytes
// written.
func (r *Root) WriteFile(p string, data io.Reader, mode os.FileMode, maxBytes int64, owner *Owner) (int64, error) {
	if err := r.hold(); err != nil {
		return 0, err
	}
	defer r.release()
	clean, err := CleanPath(p)
	if err != nil {
		return 0, err
	}
	if clean == "/" {
		return 0, errdefs.Invalid("writing /: is a directory")
	}
	owner = r.ownerOr(owner)
	dir, base := path.Split(clean)
	dirfd, err := r.mkdirAll(relPath(path.Clean(dir)), owner)
	if err == unix.ENOTDIR {
		return 0, errdefs.Invalid("writing %s: a parent is not a directory", clean)
	}
	if err != nil {
		return 0, opErr("creating parents of", clean, err)
	}
	defer unix.Close(dirfd)

	var st unix.Stat_t
	if err := unix.Fstatat(dirfd, base, &st, unix.AT_SYMLINK_NOFOLLOW); err == nil && isDir(&st) {
		return 0, errdefs.Invalid("writing %s: is a directory", clean)
	}

	tmp, fd, err := createTemp(dirfd, base)
	if err != nil {
		return 0, opErr("writing", clean, err)
	}
	f := os.NewFile(uintptr(fd), clean)
	committed := false
	defer func() {
		f.Close()
		if !committed {
			unlinkat(dirfd, tmp, 0)
		}
	}()

	src := data
	if maxBytes > 0 {
		src = io.LimitReader(data, maxBytes)
	}
	n, err := io.Copy(f, src)
	if err != nil {
		return n, opErr("writing", clean, err)
	}
	if maxBytes > 0 {
		// One more byte means the body is over the limit; probing after the
		// copy keeps what we write to disk within maxBytes.
		var one [1]byte
		if k, _ := io.ReadFull(data, one[:]); k > 0 {
			return 0, errdefs.Invalid("writing %s: content exceeds limit of %d bytes", clean, maxBytes)
		}
	}
	if owner != nil {
		// fchown of the file we created, before the chmod: chown clears
		// setuid and setgid bits.
		if err := f.Chown(owner.UID, owner.GID); err != nil {
			return n, opErr("writing", clean, err)
		}
	}
	// The mode is applied as given, special bits included: the caller is
	// the API's authenticated principal, who could chmod inside the sandbox
	// anyway. fchmod (not the umask of create) makes it exact.
	if err := f.Chmod(mode & (os.ModePerm | os.ModeSetuid | os.ModeSetgid | os.ModeSticky)); err != nil {
		return n, opErr("writing", clean, err)
	}
	// renameat fails with EISDIR if a directory appeared at the target since
	// the check above, so the refusal holds under races too.
	if err := notMountPoint(dirfd, base); err != nil {
		return n, opErr("writing", clean, err)
	}
	if err := unix.Renameat(dirfd, tmp, dirfd, base); err != nil {
		return n, opErr("writing", clean, err)
	}
	committed = true
	return n, nil
}

// createTemp creates a fresh file beside base in dirfd. O_EXCL with a
// single-component name never follows or reuses anything the sandbox made.
func createTemp(dirfd int, base string) (string, int, error) {
	for range 16 {
		var b [8]byte
		rand.Read(b[:])
		name := ".dsec-tmp-" + hex.EncodeToString(b[:])
		if len(base) < 200 {
			name = "." + base + name
		}
		fd, err := openat2(dirfd, name, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW, 0600, noSymlinks)
		if err == unix.EEXIST {
			continue
		}
		return name, fd, err
	}
	return "", -1, unix.EEXIST
}

// mkdirAll opens the directory rel (relative to the root, symlinks followed
// inside it) as an O_PATH fd, creating missing components with mode 0755,
// owned by owner when it is not nil. Each prefix is resolved afresh from
// the root, and each mkdir is done in the directory fd resolved for the
// previous prefix, so a symlink planted at any point is followed the way
// the sandbox itself would, and never out of it.
func (r *Root) mkdirAll(rel string, owner *Owner) (int, error) {
	fd, err := openat2(r.fd, rel, unix.O_PATH|unix.O_DIRECTORY, 0, inRoot)
	if err != unix.ENOENT {
		return fd, err
	}
	cur, err := unix.Dup(r.fd)
	if err != nil {
		return -1, err
	}
	comps := strings.Split(rel, "/")
	for i, c := range comps {
		prefix := strings.Join(comps[:i+1], "/")
		next, err := openat2(r.fd, prefix, unix.O_PATH|unix.O_DIRECTORY, 0, inRoot)
		if err == unix.ENOENT {
			merr := unix.Mkdirat(cur, c, 0755)
			if merr == nil {
				merr = chownNew(cur, c, owner)
			}
			if merr != nil && merr != unix.EEXIST {
				unix.Close(cur)
				return -1, merr
			}
			next, err = openat2(r.fd, prefix, unix.O_PATH|unix.O_DIRECTORY, 0, inRoot)
		}
		unix.Close(cur)
		if err != nil {
			return -1, err
		}
		cur = next
	}
	return cur, nil
}

// List describes the entries under the directory p (followed if it is a
// symlink inside the root), depth levels deep (1 = its children), in
// pre-order with names sorted. It never follows a symlink while descending.
// Entries carry absolute sandbox paths. More than the entry limit is Invalid.
func (r *Root) List(p string, depth int) ([]api.FileEntry, error) {
	if err := r.hold(); err != nil {
		return nil, err
	}
	defer r.release()
	clean, err := CleanPath(p)
	if err != nil {
		return nil, err
	}
	if depth < 1 {
		return nil, errdefs.Invalid("listing %s: depth must be at least 1", clean)
	}
	fd, err := r.openDir(clean)
	if err != nil {
		return nil, err
	}
	defer unix.Close(fd)
	var out []api.FileEntry
	if err := r.list(fd, clean, depth, 1, &out); err != nil {
		return nil, err
	}
	return out, nil
}

// openDir opens the directory at an API path for reading its entries,
// following symlinks inside the root; a non-directory is Invalid.
func (r *Root) openDir(clean string) (int, error) {
	// O_DIRECTORY makes the kernel refuse anything else before opening it,
	// so a planted FIFO or device is never opened.
	fd, err := openat2(r.fd, relPath(clean), unix.O_RDONLY|unix.O_DIRECTORY, 0, inRoot)
	if err == unix.ENOTDIR {
		// Tell "a component is a file" (not found) from "p is a file".
		if pfd, err2 := openat2(r.fd, relPath(clean), unix.O_PATH, 0, inRoot); err2 == nil {
			unix.Close(pfd)
			return -1, errdefs.Invalid("listing %s: not a directory", clean)
		}
	}
	if err != nil {
		return -1, opErr("opening", clean, err)
	}
	return fd, nil
}

func (r *Root) list(dirfd int, dirPath string, depth, level int, out *[]api.FileEntry) error {
	if level > r.maxNesting {
		return errdefs.Invalid("listing %s: tree nested deeper than %d levels", dirPath, r.maxNesting)
	}
	names, err := readNames(dirfd, min(r.maxDirEntries, r.maxListEntries))
	if err == errTooMany {
		return errdefs.Invalid("listing %s: more than %d entries; use a smaller depth", dirPath, r.maxListEntries)
	}
	if err != nil {
		return opErr("listing", dirPath, err)
	}
	for _, name := range names {
		child := path.Join(dirPath, name)
		e, err := r.statAt(dirfd, name, child)
		if err == unix.ENOENT {
			continue // removed since we read the directory
		}
		if err != nil {
			return opErr("listing", child, err)
		}
		if len(*out) >= r.maxListEntries {
			return errdefs.Invalid("listing %s: more than %d entries; use a smaller depth", dirPath, r.maxListEntries)
		}
		*out = append(*out, e)
		if e.Type != "dir" || level >= depth {
			continue
		}
		// The name may have become a symlink since the stat; noSymlinks
		// with O_NOFOLLOW refuses it, and we simply do not descend.
		fd, err := openat2(dirfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW, 0, noSymlinks)
		if err != nil {
			if err == unix.ENOENT || err == unix.ELOOP || err == unix.ENOTDIR || err == unix.EXDEV {
				continue // EXDEV: a mount point, listed but not entered
			}
			return opErr("listing", child, err)
		}
		err = r.list(fd, child, depth, level+1, out)
		unix.Close(fd)
		if err != nil {
			return err
		}
	}
	return nil
}

// Remove deletes p; a trailing symlink is removed itself, not its target.
// An absent p is NotFound, a non-empty directory without recursive is
// Precondition, and "/" is refused with Invalid. Recursive removal descends
// only real directories on the same mount, so it cannot follow a symlink or
// a mount out of the tree.
func (r *Root) Remove(p string, recursive bool) error {
	if err := r.hold(); err != nil {
		return err
	}
	defer r.release()
	clean, err := CleanPath(p)
	if err != nil {
		return err
	}
	dirfd, base, err := r.resolveParent(clean)
	if err != nil {
		return opErr("removing", clean, err)
	}
	if base == "" {
		return errdefs.Invalid("removing /: refusing to remove the sandbox root")
	}
	defer unix.Close(dirfd)
	var st unix.Stat_t
	if err := unix.Fstatat(dirfd, base, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return opErr("removing", clean, err)
	}
	if !isDir(&st) {
		err := unlinkat(dirfd, base, 0)
		if err == nil {
			return nil
		}
		if err != unix.EISDIR {
			return opErr("removing", clean, err)
		}
	}
	err = unlinkat(dirfd, base, unix.AT_REMOVEDIR)
	if err == unix.ENOTEMPTY || err == unix.EEXIST {
		if !recursive {
			return errdefs.Precondition("removing %s: directory not empty", clean)
		}
		return r.removeAll(dirfd, base, clean, 1)
	}
	if err != nil {
		return opErr("removing", clean, err)
	}
	return nil
}

// removeAll deletes name in parent and everything below it. It reads names
// in batches and unlinks them, re-reading from the start, so memory stays
// bounded however large the directory; the batch count is bounded too, so a
// sandbox that creates files as fast as we delete them cannot keep us here.
// Errors come back wrapped with the sandbox path they concern.
func (r *Root) removeAll(parent int, name, apiPath string, level int) error {
	if level > r.maxNesting {
		return errdefs.Invalid("removing %s: tree nested deeper than %d levels", apiPath, r.maxNesting)
	}
	fd, err := openat2(parent, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW, 0,
		noSymlinks)
	switch err {
	case nil:
	case unix.ENOENT:
		return nil
	case unix.ELOOP, unix.ENOTDIR:
		// Swapped for a symlink or file since we looked: remove the name,
		// never what it points to.
		if err := unlinkat(parent, name, 0); err != nil && err != unix.ENOENT {
			return opErr("removing", apiPath, err)
		}
		return nil
	default:
		return opErr("removing", apiPath, err)
	}
	defer unix.Close(fd)
	for range 1024 {
		names, err := readNamesBatch(fd, r.removeBatch)
		if err != nil {
			return opErr("removing", apiPath, err)
		}
		if len(names) == 0 {
			return removeName(parent, name, apiPath)
		}
		for _, n := range names {
			child := path.Join(apiPath, n)
			err := unlinkat(fd, n, 0)
			switch err {
			case nil, unix.ENOENT:
			case unix.EISDIR:
				if err := r.removeAll(fd, n, child, level+1); err != nil {
					return err
				}
			default:
				return opErr("removing", child, err)
			}
		}
	}
	return errdefs.Precondition("removing %s: directory keeps refilling", apiPath)
}

// removeName removes the (emptied) directory name in parent. If the sandbox
// keeps swapping it with a symlink, whatever is at the name is removed: the
// name is what we were asked to remove. A few rounds, then we give up.
func removeName(parent int, name, apiPath string) error {
	var err error
	for range 8 {
		err = unlinkat(parent, name, unix.AT_REMOVEDIR)
		if err == unix.ENOTDIR {
			err = unlinkat(parent, name, 0)
		}
		switch err {
		case nil, unix.ENOENT:
			return nil
		case unix.EISDIR, unix.ENOTDIR:
			continue
		}
		break
	}
	return opErr("removing", apiPath, err)
}

// readNamesBatch reads up to about max names (not "." or "..") from the start
// of the directory at fd.
func readNamesBatch(fd int, max int) ([]string, error) {
	if _, err := unix.Seek(fd, 0, 0); err != nil {
		return nil, err
	}
	buf := make([]byte, 32<<10)
	var names []string
	for len(names) < max {
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
	}
	return names, nil
}
