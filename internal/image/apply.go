package image

import (
	"archive/tar"
	"bufio"
	"compress/flate"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// OCI whiteout names, and the overlayfs xattr an opaque directory carries.
const (
	whiteoutPrefix = ".wh."
	opaqueMarker   = ".wh..wh..opq"
	opaqueXattr    = "trusted.overlay.opaque"
)

const (
	// noSymlinks is how every directory the applier writes into is opened:
	// the path handed to openat2 has been resolved already (see resolve),
	// so meeting a symlink means something is wrong and the kernel refuses
	// it; RESOLVE_IN_ROOT clamps ".." even so.
	noSymlinks = unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS
	// maxSymlinks is the kernel's own bound on links followed in one lookup.
	maxSymlinks = 40
	// maxTrailing bounds what may follow the end-of-archive marker of a
	// layer. Tar writers pad to a 10 KiB record; anything longer is junk the
	// diff_id must still cover, and would otherwise be read without limit.
	maxTrailing = 1 << 20
)

// unknownMTime dates directories no tar header describes (implicit
// parents), as the layer store does, so one image always yields the same
// tree and so the same EROFS digest.
var unknownMTime = time.Date(1980, 1, 2, 0, 0, 0, 0, time.UTC)

// applier applies layer tar streams, in order, onto the tree open at root.
//
// With lower < 0 the tree is a plain root filesystem: whiteouts delete.
// With lower >= 0 the tree is an overlayfs upper directory over the plain
// tree open at lower, and keeps the layers' changes as a diff: a deletion
// becomes a whiteout (0:0 character device), an opaque directory gets
// trusted.overlay.opaque="y", and directories a layer writes into are first
// copied up from lower with their metadata, as overlayfs itself would.
// Paths are then resolved in the merged view, so that an upper layer
// writing through a symlink of a lower layer lands where it would have in a
// plain tree.
//
// Paths inside the applier are clean, relative and symlink-free ("." for
// the root): "canonical" below.
type applier struct {
	root  int
	lower int

	maxBytes int64
	maxFiles int
	files    int
	bytes    int64

	// Per layer. touched holds the paths this layer created and their
	// ancestors: an opaque marker hides everything else in its directory.
	// dirs holds the layer's directory headers, applied when it ends so a
	// read-only directory can still be filled and children do not move its
	// mtime. mtimes holds the mtime to put back on directories the layer
	// changed without describing them.
	touched map[string]bool
	dirs    map[string]*tar.Header
	mtimes  map[string]unix.Timespec
}

func (a *applier) upper() bool { return a.lower >= 0 }

// applyLayer applies one layer blob (gzip-compressed or not, told by its
// magic bytes) and returns the blob's digest, the uncompressed stream's
// digest (its diff_id) and length. The caller compares them with what the
// manifest and config claim.
func (a *applier) applyLayer(ctx context.Context, blob io.Reader) (digest, diffID string, unpacked int64, err error) {
	a.touched = map[string]bool{}
	a.dirs = map[string]*tar.Header{}
	a.mtimes = map[string]unix.Timespec{}

	comp := newHashingReader(&ctxReader{ctx: ctx, r: blob})
	br := bufio.NewReaderSize(comp, 64<<10)
	in, err := decompress(br)
	if err != nil {
		return "", "", 0, err
	}
	raw := newHashingReader(in)
	tr := tar.NewReader(raw)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		// ErrInsecurePath comes with a usable header; cleanName is our
		// own, stricter, judge of names.
		if err != nil && err != tar.ErrInsecurePath {
			return "", "", 0, streamErr(ctx, err)
		}
		if hdr.Typeflag == tar.TypeXGlobalHeader {
			continue
		}
		if a.maxFiles > 0 && a.files >= a.maxFiles {
			return "", "", 0, errdefs.Invalid("image exceeds limit of %d entries", a.maxFiles)
		}
		a.files++
		if err := a.entry(hdr, tr); err != nil {
			if ctx.Err() != nil {
				return "", "", 0, ctx.Err()
			}
			return "", "", 0, fmt.Errorf("extracting %q: %w", hdr.Name, classify(streamErr(ctx, err)))
		}
	}
	if err := a.finishLayer(); err != nil {
		return "", "", 0, err
	}
	// The diff_id covers the whole stream, padding after the marker too.
	n, err := io.Copy(io.Discard, io.LimitReader(raw, maxTrailing+1))
	if err != nil {
		return "", "", 0, streamErr(ctx, err)
	}
	if n > maxTrailing {
		return "", "", 0, errdefs.Invalid("layer has more than %d bytes after the end of its archive", maxTrailing)
	}
	if _, err := io.Copy(io.Discard, io.LimitReader(br, maxTrailing)); err != nil {
		return "", "", 0, streamErr(ctx, err)
	}
	return comp.digest(), raw.digest(), raw.n, nil
}

// decompress picks the decompressor by magic bytes: registries and tools
// do not always label layers truthfully (Docker's media type says gzip for
// uncompressed layers of `docker save`), and the bytes cannot lie.
func decompress(br *bufio.Reader) (io.Reader, error) {
	magic, _ := br.Peek(6)
	switch {
	case len(magic) >= 2 && magic[0] == 0x1f && magic[1] == 0x8b:
		zr, err := gzip.NewReader(br)
		if err != nil {
			return nil, errdefs.Invalid("reading gzip layer: %v", err)
		}
		return zr, nil
	case len(magic) >= 4 && string(magic[:4]) == "\x28\xb5\x2f\xfd":
		return nil, errdefs.Invalid("layer is zstd-compressed, which is not supported: " +
			"re-push the image with gzip layers (e.g. `skopeo copy --dest-compress-format gzip`)")
	case len(magic) >= 6 && string(magic) == "\xfd7zXZ\x00":
		return nil, errdefs.Invalid("layer is xz-compressed, which is not supported")
	case len(magic) >= 3 && string(magic[:3]) == "BZh":
		return nil, errdefs.Invalid("layer is bzip2-compressed, which is not supported")
	}
	return br, nil
}

// streamErr classifies an error met while decoding a layer: a damaged or
// truncated stream is the image's fault (Invalid); cancellation and read
// errors of the source pass through.
func streamErr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	var corrupt flate.CorruptInputError
	switch {
	case errors.Is(err, io.ErrUnexpectedEOF):
		return errdefs.Invalid("layer is truncated")
	case errors.Is(err, tar.ErrHeader), errors.Is(err, tar.ErrFieldTooLong),
		errors.Is(err, gzip.ErrHeader), errors.Is(err, gzip.ErrChecksum), errors.As(err, &corrupt):
		return errdefs.Invalid("layer is corrupt: %v", err)
	}
	return err
}

// classify turns the errnos an archive's content can provoke into errdefs
// classes; anything else (a full disk, an I/O error) is the host's and keeps
// its errno.
func classify(err error) error {
	var errno syscall.Errno
	if !errors.As(err, &errno) {
		return err
	}
	switch errno {
	case unix.ELOOP:
		return errdefs.Invalid("path crosses a symbolic link")
	case unix.ENOTDIR:
		return errdefs.Invalid("a parent is not a directory")
	case unix.ENOENT:
		return errdefs.Invalid("a path it needs does not exist")
	case unix.EEXIST, unix.ENOTEMPTY, unix.EISDIR, unix.ENAMETOOLONG, unix.EINVAL, unix.EXDEV, unix.EMLINK:
		return errdefs.Invalid("%v", errno)
	case unix.EPERM, unix.EACCES:
		return errdefs.PermissionDenied("%v (applying image layers needs root unless every file belongs to the caller)", errno)
	case unix.ENOSPC, unix.EDQUOT:
		return errdefs.Exhausted("%v", errno)
	}
	return err
}

// cleanName turns a tar entry (or hard link target) name into a canonical
// candidate: leading slashes are dropped ("/etc" is the image's etc), the
// result is cleaned, and names that climb out ("../x", "a/../../x") or hold
// a NUL byte are refused.
func cleanName(name string) (string, error) {
	if name == "" {
		return "", errdefs.Invalid("empty entry name")
	}
	if strings.IndexByte(name, 0) >= 0 {
		return "", errdefs.Invalid("entry name %q contains a NUL byte", name)
	}
	rel := strings.TrimLeft(name, "/")
	if rel == "" {
		return ".", nil
	}
	c := path.Clean(rel)
	if c == ".." || strings.HasPrefix(c, "../") {
		return "", errdefs.Invalid("entry name %q escapes the image root", name)
	}
	return c, nil
}

func splitPath(p string) (dir, base string) {
	i := strings.LastIndexByte(p, '/')
	if i < 0 {
		return ".", p
	}
	return p[:i], p[i+1:]
}

func joinPath(dir, base string) string {
	if dir == "." {
		return base
	}
	return dir + "/" + base
}

// entry applies one tar entry, whose data is r.
func (a *applier) entry(hdr *tar.Header, r io.Reader) error {
	name, err := cleanName(hdr.Name)
	if err != nil {
		return err
	}
	dir, base := splitPath(name)
	if base == opaqueMarker {
		return a.opaque(dir)
	}
	if strings.HasPrefix(base, whiteoutPrefix+whiteoutPrefix) {
		return nil // aufs bookkeeping (.wh..wh.plnk and the like), as Docker ignores it
	}
	if hidden, ok := strings.CutPrefix(base, whiteoutPrefix); ok {
		return a.whiteout(dir, hidden)
	}
	if err := checkHeader(hdr); err != nil {
		return err
	}
	if name == "." {
		if hdr.Typeflag != tar.TypeDir {
			return errdefs.Invalid("the image root must be a directory")
		}
		a.dirs["."] = hdr
		return nil
	}
	parent, pdir, err := a.parent(dir)
	if err != nil {
		return err
	}
	defer unix.Close(parent)
	p := joinPath(pdir, base)
	a.touch(p)

	switch hdr.Typeflag {
	case tar.TypeDir:
		return a.mkdir(parent, base, p, hdr)
	case tar.TypeReg, tar.TypeRegA, tar.TypeGNUSparse:
		return a.regular(parent, base, hdr, r)
	case tar.TypeSymlink:
		if strings.IndexByte(hdr.Linkname, 0) >= 0 || hdr.Linkname == "" {
			return errdefs.Invalid("bad symlink target %q", hdr.Linkname)
		}
		if err := replace(parent, base); err != nil {
			return err
		}
		if err := unix.Symlinkat(hdr.Linkname, parent, base); err != nil {
			return err
		}
		return setMeta(parent, base, hdr, true)
	case tar.TypeLink:
		return a.link(parent, base, p, hdr)
	case tar.TypeChar, tar.TypeBlock, tar.TypeFifo:
		mode := map[byte]uint32{tar.TypeChar: unix.S_IFCHR, tar.TypeBlock: unix.S_IFBLK, tar.TypeFifo: unix.S_IFIFO}[hdr.Typeflag]
		if err := replace(parent, base); err != nil {
			return err
		}
		dev := unix.Mkdev(uint32(hdr.Devmajor), uint32(hdr.Devminor))
		if err := unix.Mknodat(parent, base, mode|0o600, int(dev)); err != nil {
			return err
		}
		return setMeta(parent, base, hdr, false)
	}
	return errdefs.Invalid("unsupported entry type %q", hdr.Typeflag)
}

// checkHeader refuses header fields the kernel would misread.
func checkHeader(h *tar.Header) error {
	switch {
	case h.Uid < 0 || h.Gid < 0 || int64(h.Uid) > 1<<32-2 || int64(h.Gid) > 1<<32-2:
		return errdefs.Invalid("bad owner %d:%d", h.Uid, h.Gid)
	case h.Size < 0:
		return errdefs.Invalid("negative size")
	case h.Devmajor < 0 || h.Devminor < 0 || h.Devmajor > 1<<12-1 || h.Devminor > 1<<20-1:
		return errdefs.Invalid("bad device number %d:%d", h.Devmajor, h.Devminor)
	}
	return nil
}

// touch records that this layer created p, and so its ancestors.
func (a *applier) touch(p string) {
	for !a.touched[p] {
		a.touched[p] = true
		if p == "." {
			return
		}
		p, _ = splitPath(p)
	}
}

// noteDir records the mtime of the directory p (open as fd) before this
// layer first changes its entries, to be put back when the layer ends.
func (a *applier) noteDir(fd int, p string) error {
	if _, ok := a.mtimes[p]; ok {
		return nil
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return err
	}
	a.mtimes[p] = st.Mtim
	return nil
}

// parent opens the directory an entry goes into, creating what is missing,
// and returns it with its canonical path. Most entries' parents exist in
// the tree without symlinks on the way, and one openat2 settles it.
func (a *applier) parent(dir string) (int, string, error) {
	fd, err := openDir(a.root, dir)
	if err == nil {
		return fd, dir, a.noteDir(fd, dir)
	}
	if err != unix.ENOENT && err != unix.ELOOP && err != unix.ENOTDIR {
		return -1, "", err
	}
	canon, err := a.resolve(dir)
	if err != nil {
		return -1, "", err
	}
	fd, err = a.mkdirAll(canon)
	if err != nil {
		return -1, "", err
	}
	if err := a.noteDir(fd, canon); err != nil {
		unix.Close(fd)
		return -1, "", err
	}
	return fd, canon, nil
}

// mkdirAll opens the canonical directory p, creating missing components.
// In an upper, a created component copies the lower directory the merged
// view showed there; a whiteout in the way becomes an opaque directory.
func (a *applier) mkdirAll(p string) (int, error) {
	cur, err := openDir(a.root, ".")
	if err != nil || p == "." {
		return cur, err
	}
	prefix := "."
	for _, c := range strings.Split(p, "/") {
		cp := joinPath(prefix, c)
		var st unix.Stat_t
		err := unix.Fstatat(cur, c, &st, unix.AT_SYMLINK_NOFOLLOW)
		switch {
		case err == unix.ENOENT:
			err = a.createDir(cur, prefix, c, cp, false)
		case err != nil:
		case a.upper() && isWhiteout(&st):
			if err = a.noteDir(cur, prefix); err == nil {
				if err = unix.Unlinkat(cur, c, 0); err == nil {
					err = a.createDir(cur, prefix, c, cp, true)
				}
			}
		case st.Mode&unix.S_IFMT != unix.S_IFDIR:
			err = unix.ENOTDIR
		}
		if err != nil {
			unix.Close(cur)
			return -1, err
		}
		next, err := openDir(cur, c)
		unix.Close(cur)
		if err != nil {
			return -1, err
		}
		cur, prefix = next, cp
	}
	return cur, nil
}

// createDir makes the missing directory name (canonical path p) in the
// directory dirfd (canonical path dir). In an upper over a lower directory
// it is a copy-up, taking the lower's owner, mode, xattrs and times so the
// merged view does not change; otherwise it is a 0755 directory of the
// caller's, dated unknownMTime, or an opaque one hiding a deletion.
func (a *applier) createDir(dirfd int, dir, name, p string, opaque bool) error {
	copyUp := false
	if a.upper() && !opaque {
		v, err := a.lookup(p)
		if err != nil {
			return err
		}
		copyUp = v.mode == unix.S_IFDIR && !v.inUpper
	}
	if err := a.noteDir(dirfd, dir); err != nil {
		return err
	}
	if err := unix.Mkdirat(dirfd, name, 0o700); err != nil {
		return err
	}
	if copyUp {
		ldir, lbase := splitPath(p)
		lfd, err := openDir(a.lower, ldir)
		if err != nil {
			return err
		}
		defer unix.Close(lfd)
		mtime, err := copyMeta(lfd, lbase, dirfd, name)
		if err != nil {
			return err
		}
		a.mtimes[p] = mtime
		return nil
	}
	if err := unix.Fchmodat(dirfd, name, 0o755, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return err
	}
	if opaque {
		if err := unix.Lsetxattr(procPath(dirfd, name), opaqueXattr, []byte("y"), 0); err != nil {
			return fmt.Errorf("setting %s: %w", opaqueXattr, err)
		}
	}
	a.mtimes[p] = unix.NsecToTimespec(unknownMTime.UnixNano())
	return nil
}

// mkdir applies a directory entry at p: an existing directory is kept (a
// layer's directory entry merges with what is below), anything else is
// replaced. In an upper, a directory replacing a non-directory is made
// opaque: what it replaced hid the lower's directory, and must keep hiding
// its contents.
func (a *applier) mkdir(parent int, base, p string, hdr *tar.Header) error {
	var st unix.Stat_t
	err := unix.Fstatat(parent, base, &st, unix.AT_SYMLINK_NOFOLLOW)
	switch {
	case err == unix.ENOENT:
		if err := unix.Mkdirat(parent, base, 0o700); err != nil {
			return err
		}
	case err != nil:
		return err
	case st.Mode&unix.S_IFMT == unix.S_IFDIR:
	default:
		if err := unix.Unlinkat(parent, base, 0); err != nil {
			return err
		}
		if err := unix.Mkdirat(parent, base, 0o700); err != nil {
			return err
		}
		if a.upper() {
			if err := unix.Lsetxattr(procPath(parent, base), opaqueXattr, []byte("y"), 0); err != nil {
				return fmt.Errorf("setting %s: %w", opaqueXattr, err)
			}
		}
	}
	a.dirs[p] = hdr
	return nil
}

// regular writes a regular file. The file is created exclusively after
// whatever was at its name is removed, so an earlier entry's hard link or
// symlink there is never written through.
func (a *applier) regular(parent int, base string, hdr *tar.Header, r io.Reader) error {
	if a.maxBytes > 0 && hdr.Size > a.maxBytes-a.bytes {
		return errdefs.Invalid("image exceeds limit of %d bytes of file data (entry claims %d bytes)", a.maxBytes, hdr.Size)
	}
	if err := replace(parent, base); err != nil {
		return err
	}
	fd, err := unix.Openat(parent, base, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return err
	}
	f := os.NewFile(uintptr(fd), base)
	n, err := io.CopyN(f, r, hdr.Size)
	a.bytes += n
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == io.EOF {
		err = io.ErrUnexpectedEOF
	}
	if err != nil {
		return err
	}
	return setMeta(parent, base, hdr, false)
}

// link makes a hard link. The target is resolved like any entry name, its
// last component not followed: a link to a symlink links the symlink
// itself. In an upper, a target only the lower has is copied up first, as
// overlayfs does when link(2) is called on a lower file.
func (a *applier) link(parent int, base, p string, hdr *tar.Header) error {
	target, err := cleanName(hdr.Linkname)
	if err != nil {
		return err
	}
	if target == "." {
		return errdefs.Invalid("hard link to the image root")
	}
	tdir, tbase := splitPath(target)
	tcanon, err := a.locate(tdir)
	if err != nil {
		return err
	}
	tp := joinPath(tcanon, tbase)
	if tp == p {
		return errdefs.Invalid("hard link to itself")
	}
	v, err := a.lookup(tp)
	if err != nil {
		return err
	}
	switch {
	case v.mode == 0:
		return errdefs.Invalid("hard link target %q does not exist", hdr.Linkname)
	case v.mode == unix.S_IFDIR:
		return errdefs.Invalid("hard link target %q is a directory", hdr.Linkname)
	case !v.inUpper:
		if err := a.copyUp(tp); err != nil {
			return err
		}
	}
	tfd, err := openDir(a.root, tcanon)
	if err != nil {
		return err
	}
	defer unix.Close(tfd)
	if err := replace(parent, base); err != nil {
		return err
	}
	return unix.Linkat(tfd, tbase, parent, base, 0)
}

// copyUp copies the non-directory p from the lower into the upper.
func (a *applier) copyUp(p string) error {
	dir, base := splitPath(p)
	fd, err := a.mkdirAll(dir)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if err := a.noteDir(fd, dir); err != nil {
		return err
	}
	lfd, err := openDir(a.lower, dir)
	if err != nil {
		return err
	}
	defer unix.Close(lfd)
	var st unix.Stat_t
	if err := unix.Fstatat(lfd, base, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return err
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
		// What a copy-up writes counts like an entry's data: an upper
		// run of tiny links to a lower's big files must not write
		// them again without limit.
		if a.maxBytes > 0 && st.Size > a.maxBytes-a.bytes {
			return errdefs.Invalid("image exceeds limit of %d bytes of file data (copying up %q, %d bytes)", a.maxBytes, p, st.Size)
		}
		a.bytes += st.Size
		if err := copyData(lfd, fd, base, &st); err != nil {
			return err
		}
	case unix.S_IFLNK:
		target, err := readlinkAt(lfd, base)
		if err != nil {
			return err
		}
		if err := unix.Symlinkat(target, fd, base); err != nil {
			return err
		}
	default:
		if err := unix.Mknodat(fd, base, st.Mode, int(st.Rdev)); err != nil {
			return err
		}
	}
	_, err = copyMeta(lfd, base, fd, base)
	return err
}

// whiteout applies ".wh.name" in dir: name is deleted, and in an upper,
// whatever the lower still shows there is hidden by a whiteout device.
func (a *applier) whiteout(dir, name string) error {
	if name == "" || name == "." || name == ".." {
		return errdefs.Invalid("whiteout names no file")
	}
	canon, err := a.locate(dir)
	if err != nil {
		return err
	}
	fd, err := openDir(a.root, canon)
	switch {
	case err == unix.ENOENT || err == unix.ENOTDIR:
	case err != nil:
		return err
	default:
		err := a.remove(fd, canon, name)
		unix.Close(fd)
		if err != nil {
			return err
		}
	}
	if !a.upper() {
		return nil
	}
	p := joinPath(canon, name)
	v, err := a.lookup(p)
	if err != nil || v.mode == 0 {
		return err
	}
	fd, err = a.mkdirAll(canon)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if err := a.noteDir(fd, canon); err != nil {
		return err
	}
	return unix.Mknodat(fd, name, unix.S_IFCHR, 0)
}

// remove deletes name, with everything below it, from the directory dir
// (open as fd); a missing name is not an error.
func (a *applier) remove(fd int, dir, name string) error {
	var st unix.Stat_t
	if err := unix.Fstatat(fd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		if err == unix.ENOENT {
			return nil
		}
		return err
	}
	if err := a.noteDir(fd, dir); err != nil {
		return err
	}
	return removeAt(fd, name)
}

// opaque applies ".wh..wh..opq" in dir: everything this layer did not
// create there is removed, and in an upper the directory is marked opaque
// so the lower's entries stay hidden too.
func (a *applier) opaque(dir string) error {
	canon, err := a.locate(dir)
	if err != nil {
		return err
	}
	var fd int
	if a.upper() {
		fd, err = a.mkdirAll(canon)
	} else {
		fd, err = openDir(a.root, canon)
		if err == unix.ENOENT || err == unix.ENOTDIR {
			return nil
		}
	}
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if err := a.removeUntouched(fd, canon); err != nil {
		return err
	}
	a.touch(canon)
	if a.upper() {
		if err := unix.Setxattr(fdPath(fd), opaqueXattr, []byte("y"), 0); err != nil {
			return fmt.Errorf("setting %s: %w", opaqueXattr, err)
		}
	}
	return nil
}

// removeUntouched removes, below the directory p open as fd, every entry
// this layer did not create.
func (a *applier) removeUntouched(fd int, p string) error {
	names, err := readDirNames(fd)
	if err != nil {
		return err
	}
	for _, n := range names {
		cp := joinPath(p, n)
		if !a.touched[cp] {
			if err := a.remove(fd, p, n); err != nil {
				return err
			}
			continue
		}
		sub, err := openDir(fd, n)
		if err == unix.ENOTDIR || err == unix.ELOOP {
			continue
		}
		if err != nil {
			return err
		}
		err = a.removeUntouched(sub, cp)
		unix.Close(sub)
		if err != nil {
			return err
		}
	}
	return nil
}

// finishLayer puts back the mtimes of directories the layer changed but
// did not describe, then applies the layer's directory headers, deepest
// first, so that a directory made unsearchable does not block its
// children. A path no longer a directory (a later entry replaced it) is
// skipped.
func (a *applier) finishLayer() error {
	for p, ts := range a.mtimes {
		if a.dirs[p] != nil {
			continue
		}
		err := a.atDir(p, func(dirfd int, name string) error {
			omit := unix.Timespec{Nsec: unix.UTIME_OMIT}
			return unix.UtimesNanoAt(dirfd, name, []unix.Timespec{omit, ts}, unix.AT_SYMLINK_NOFOLLOW)
		})
		if err != nil {
			return fmt.Errorf("restoring mtime of %q: %w", p, err)
		}
	}
	paths := make([]string, 0, len(a.dirs))
	for p := range a.dirs {
		paths = append(paths, p)
	}
	depth := func(p string) int {
		if p == "." {
			return 0
		}
		return strings.Count(p, "/") + 1
	}
	slices.SortFunc(paths, func(x, y string) int { return depth(y) - depth(x) })
	for _, p := range paths {
		hdr := a.dirs[p]
		err := a.atDir(p, func(dirfd int, name string) error { return setMeta(dirfd, name, hdr, false) })
		if err != nil {
			return fmt.Errorf("extracting %q: %w", hdr.Name, classify(err))
		}
	}
	return nil
}

// atDir calls fn with the parent and name of the directory p, unless p is
// no longer a directory.
func (a *applier) atDir(p string, fn func(dirfd int, name string) error) error {
	dir, base := splitPath(p)
	if p == "." {
		dir, base = ".", "."
	}
	fd, err := openDir(a.root, dir)
	if err == unix.ENOENT || err == unix.ENOTDIR || err == unix.ELOOP {
		return nil
	}
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstatat(fd, base, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		if err == unix.ENOENT {
			return nil
		}
		return err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return nil
	}
	return fn(fd, base)
}

// keepXattr says which xattrs of a layer are applied. user.* is the
// image's own data; security.capability is how images grant file
// capabilities (ping, newuidmap). trusted.* would steer the host's
// overlayfs (trusted.overlay.opaque, .redirect, .metacopy) and
// security.selinux/ima labels belong to the host's policy: dropped.
func keepXattr(name string) bool {
	return strings.HasPrefix(name, "user.") || name == "security.capability"
}

// setMeta applies owner, mode, xattrs and times from hdr to the entry name
// of dirfd, never following it. The order matters: chown clears setuid bits
// and file capabilities, and every other change but the times moves the
// ctime only.
func setMeta(dirfd int, name string, hdr *tar.Header, isLink bool) error {
	if err := unix.Fchownat(dirfd, name, hdr.Uid, hdr.Gid, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("chown: %w", err)
	}
	if !isLink { // symlinks have no mode of their own
		if err := unix.Fchmodat(dirfd, name, uint32(hdr.Mode)&0o7777, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return fmt.Errorf("chmod: %w", err)
		}
		keys := make([]string, 0, len(hdr.PAXRecords))
		for k := range hdr.PAXRecords {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		for _, k := range keys {
			x, ok := strings.CutPrefix(k, "SCHILY.xattr.")
			if !ok || !keepXattr(x) {
				continue
			}
			err := unix.Lsetxattr(procPath(dirfd, name), x, []byte(hdr.PAXRecords[k]), 0)
			// A filesystem without the namespace, or the kernel's refusal
			// of user.* on devices and fifos: the image is still usable.
			if err == nil || err == unix.ENOTSUP || (err == unix.EPERM && strings.HasPrefix(x, "user.")) {
				continue
			}
			return fmt.Errorf("setting xattr %s: %w", x, err)
		}
	}
	atime := unix.Timespec{Nsec: unix.UTIME_OMIT}
	if !hdr.AccessTime.IsZero() {
		atime = unix.NsecToTimespec(hdr.AccessTime.UnixNano())
	}
	mtime := unix.NsecToTimespec(hdr.ModTime.UnixNano())
	if err := unix.UtimesNanoAt(dirfd, name, []unix.Timespec{atime, mtime}, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("setting times: %w", err)
	}
	return nil
}

// copyMeta gives the entry dname of dfd the owner, mode, xattrs (but
// trusted.*) and times of sname of sfd, and returns the mtime.
func copyMeta(sfd int, sname string, dfd int, dname string) (unix.Timespec, error) {
	var st unix.Stat_t
	if err := unix.Fstatat(sfd, sname, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return st.Mtim, err
	}
	if err := unix.Fchownat(dfd, dname, int(st.Uid), int(st.Gid), unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return st.Mtim, fmt.Errorf("chown: %w", err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFLNK {
		if err := unix.Fchmodat(dfd, dname, st.Mode&0o7777, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return st.Mtim, fmt.Errorf("chmod: %w", err)
		}
		names, err := listXattrs(procPath(sfd, sname))
		if err != nil {
			return st.Mtim, err
		}
		for _, n := range names {
			if strings.HasPrefix(n, "trusted.") {
				continue
			}
			v, err := getXattr(procPath(sfd, sname), n)
			if err != nil {
				return st.Mtim, err
			}
			if err := unix.Lsetxattr(procPath(dfd, dname), n, v, 0); err != nil && err != unix.ENOTSUP {
				return st.Mtim, fmt.Errorf("setting xattr %s: %w", n, err)
			}
		}
	}
	ts := []unix.Timespec{st.Atim, st.Mtim}
	if err := unix.UtimesNanoAt(dfd, dname, ts, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return st.Mtim, fmt.Errorf("setting times: %w", err)
	}
	return st.Mtim, nil
}

// copyData copies the regular file name of sfd to a new file in dfd.
func copyData(sfd, dfd int, name string, st *unix.Stat_t) error {
	// O_NONBLOCK and the inode check: never hang on, or read, anything
	// but the regular file we stat'ed.
	ifd, err := openat2(sfd, name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_NOCTTY, noSymlinks)
	if err != nil {
		return err
	}
	in := os.NewFile(uintptr(ifd), name)
	defer in.Close()
	var fst unix.Stat_t
	if err := unix.Fstat(ifd, &fst); err != nil {
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

// replace removes whatever is at name in dirfd, so a non-directory entry
// can be created there: a later entry of the same name wins.
func replace(dirfd int, name string) error {
	var st unix.Stat_t
	if err := unix.Fstatat(dirfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		if err == unix.ENOENT {
			return nil
		}
		return err
	}
	if st.Mode&unix.S_IFMT == unix.S_IFDIR {
		return removeAt(dirfd, name)
	}
	return unix.Unlinkat(dirfd, name, 0)
}

func isWhiteout(st *unix.Stat_t) bool {
	return st.Mode&unix.S_IFMT == unix.S_IFCHR && st.Rdev == 0
}

// openDir opens the directory rel of dirfd as an O_PATH fd, refusing any
// symlink on the way.
func openDir(dirfd int, rel string) (int, error) {
	return openat2(dirfd, rel, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW, noSymlinks)
}

// openat2 retries the transient failures: EAGAIN is what RESOLVE_IN_ROOT
// returns when a rename raced a ".." step, EINTR is the Go runtime's signals.
func openat2(dirfd int, rel string, flags int, resolve uint64) (int, error) {
	how := unix.OpenHow{Flags: uint64(flags | unix.O_CLOEXEC), Resolve: resolve}
	for range 128 {
		fd, err := unix.Openat2(dirfd, rel, &how)
		if err == unix.EAGAIN || err == unix.EINTR {
			continue
		}
		return fd, err
	}
	return -1, unix.EAGAIN
}

// fdPath names an open fd through /proc; xattr calls on it reach the very
// inode held, which is how an O_PATH directory fd gets an xattr.
func fdPath(fd int) string { return "/proc/self/fd/" + strconv.Itoa(fd) }

// procPath names the entry name of the directory open as dirfd. The
// xattr calls take only paths; through /proc/self/fd they resolve the
// directory by descriptor, and their l-variants never follow name itself.
func procPath(dirfd int, name string) string { return fdPath(dirfd) + "/" + name }

// removeAt removes name of dirfd with everything below it. os.RemoveAll
// walks with openat and O_NOFOLLOW and reaches the parent by descriptor.
func removeAt(dirfd int, name string) error { return os.RemoveAll(procPath(dirfd, name)) }

func readDirNames(fd int) ([]string, error) {
	rfd, err := openat2(fd, ".", unix.O_RDONLY|unix.O_DIRECTORY, noSymlinks)
	if err != nil {
		return nil, err
	}
	f := os.NewFile(uintptr(rfd), ".")
	defer f.Close()
	names, err := f.Readdirnames(-1)
	slices.Sort(names)
	return names, err
}

func readlinkAt(dirfd int, name string) (string, error) {
	buf := make([]byte, unix.PathMax)
	n, err := unix.Readlinkat(dirfd, name, buf)
	if err != nil {
		return "", err
	}
	return string(buf[:n]), nil
}

func listXattrs(p string) ([]string, error) {
	for {
		n, err := unix.Llistxattr(p, nil)
		if err == unix.ENOTSUP || n == 0 {
			return nil, nil
		}
		if err != nil {
			return nil, fmt.Errorf("listing xattrs: %w", err)
		}
		buf := make([]byte, n)
		n, err = unix.Llistxattr(p, buf)
		if err == unix.ERANGE {
			continue // grew meanwhile
		}
		if err != nil {
			return nil, fmt.Errorf("listing xattrs: %w", err)
		}
		var out []string
		for _, s := range strings.Split(string(buf[:n]), "\x00") {
			if s != "" {
				out = append(out, s)
			}
		}
		return out, nil
	}
}

// getXattr returns the value of attr on p (not followed), nil if unset.
func getXattr(p, attr string) ([]byte, error) {
	for {
		n, err := unix.Lgetxattr(p, attr, nil)
		if err == unix.ENODATA || err == unix.ENOTSUP {
			return nil, nil
		}
		if err != nil {
			return nil, fmt.Errorf("reading xattr %s: %w", attr, err)
		}
		buf := make([]byte, n)
		n, err = unix.Lgetxattr(p, attr, buf)
		if err == unix.ERANGE {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("reading xattr %s: %w", attr, err)
		}
		return buf[:n], nil
	}
}

// ctxReader stops a long copy when ctx is done.
type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

func (c *ctxReader) Read(b []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	return c.r.Read(b)
}
