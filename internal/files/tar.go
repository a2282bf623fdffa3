package files

import (
	"archive/tar"
	"bufio"
	"compress/gzip"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
)

// TarOptions bounds and shapes ExtractTar. The zero value suits archives
// from API clients: no limits, no ownership, no devices.
type TarOptions struct {
	MaxBytes      int64 // total regular-file bytes allowed (0 = unlimited)
	MaxFiles      int   // entries allowed (0 = unlimited)
	PreserveOwner bool  // chown entries to the tar's uid/gid (used when building layers as root)
	AllowDevices  bool  // create char/block devices and fifos (layer builds); otherwise such entries are refused with Invalid
	// Diff marks the archive as an overlay writable layer packed by an
	// untrusted writer (a VM's agent, which root in the VM controls):
	// owners and setuid/setgid bits are kept, as the sandbox had them;
	// whiteouts (0:0 character devices) and fifos are created, any other
	// device is refused with Invalid; of the xattrs only user.*,
	// security.capability and trusted.overlay.opaque="y" are applied,
	// so the writer cannot steer the overlays the layer goes under
	// (trusted.overlay.redirect, .metacopy, .origin) or the host's
	// security labels.
	Diff bool
	// Owner, without PreserveOwner, owns every entry created and the
	// missing parents of the destination (host IDs: Root.HostOwner); nil
	// means the root's owner (Root.SetOwner), if any.
	Owner *Owner
}

// Mode bits ExtractTar applies. PreserveOwner marks the archive as trusted
// (a layer build): besides owner, it keeps setuid/setgid bits and
// security.* / trusted.* xattrs. Without it only permission and sticky bits
// and user.* xattrs are applied, so an API client cannot smuggle privilege
// (or overlayfs's trusted.overlay.* markers) into a sandbox.
const (
	// opaqueXattr marks an overlay directory that hides the lowers'.
	opaqueXattr       = "trusted.overlay.opaque"
	keptModeBits      = 0o1777
	privilegedModeBit = 0o6000
)

// WriteTar writes a tar stream of p to w. A directory (p itself followed if
// it is a symlink inside the root) becomes "./" followed by its tree with
// names relative to p; anything else becomes one entry named after its last
// component. Symlinks are stored as symlinks and never followed; hard links
// within the tree are stored once; devices and FIFOs are stored as headers,
// never opened; sockets are skipped. Mode, owner and mtime are kept.
func (r *Root) WriteTar(p string, w io.Writer) error {
	return r.writeTar(p, w, false)
}

// WriteDiffTar is WriteTar with every entry's xattrs (as PAX
// SCHILY.xattr records, trusted.* included when the caller may read
// them): the form in which an overlay's writable layer, whiteouts and
// opaque directories included, travels to ExtractTar with
// TarOptions.Diff.
func (r *Root) WriteDiffTar(p string, w io.Writer) error {
	return r.writeTar(p, w, true)
}

func (r *Root) writeTar(p string, w io.Writer, xattrs bool) error {
	if err := r.hold(); err != nil {
		return err
	}
	defer r.release()
	clean, err := CleanPath(p)
	if err != nil {
		return err
	}
	pfd, err := openat2(r.fd, relPath(clean), unix.O_PATH, 0, inRoot)
	if err != nil {
		return opErr("archiving", clean, err)
	}
	defer unix.Close(pfd)
	var st unix.Stat_t
	if err := unix.Fstat(pfd, &st); err != nil {
		return opErr("archiving", clean, err)
	}
	t := &tarWriter{r: r, tw: tar.NewWriter(w), links: map[fileID]string{}, xattrs: xattrs}
	if isDir(&st) {
		// O_PATH fds cannot be read; "." reopens the very same directory.
		dfd, err := openat2(pfd, ".", unix.O_RDONLY|unix.O_DIRECTORY, 0, noSymlinks)
		if err != nil {
			return opErr("archiving", clean, err)
		}
		defer unix.Close(dfd)
		if err := t.writeHeader(t.withXattrs(pfd, ".", header(&st, "./", ""))); err != nil {
			return err
		}
		if err := t.dir(dfd, "", clean, 1); err != nil {
			return err
		}
	} else if err := t.single(pfd, &st, path.Base(clean), clean); err != nil {
		return err
	}
	if err := t.tw.Close(); err != nil {
		return fmt.Errorf("writing archive: %w", err)
	}
	return nil
}

type fileID struct{ dev, ino uint64 }

type tarWriter struct {
	r      *Root
	tw     *tar.Writer
	links  map[fileID]string // first tar name of each multiply-linked file
	xattrs bool              // record each entry's xattrs (WriteDiffTar)
}

// withXattrs adds the xattrs of entry name of dirfd to h when the writer
// records them. An entry whose xattrs cannot be read (gone meanwhile, or
// a filesystem without them) is written without.
func (t *tarWriter) withXattrs(dirfd int, name string, h *tar.Header) *tar.Header {
	if !t.xattrs {
		return h
	}
	// Through the directory's descriptor; the l-calls never follow name
	// ("." is the directory itself).
	p := fdPath(dirfd) + "/" + name
	names, err := ListXattrs(p)
	if err != nil {
		return h
	}
	for _, x := range names {
		v, err := GetXattr(p, x)
		if err != nil || v == nil {
			continue
		}
		if h.PAXRecords == nil {
			h.PAXRecords = map[string]string{}
		}
		h.PAXRecords["SCHILY.xattr."+x] = string(v)
	}
	if h.PAXRecords != nil {
		h.Format = tar.FormatPAX
	}
	return h
}

// single writes the non-directory p, already open as the O_PATH fd pfd.
func (t *tarWriter) single(pfd int, st *unix.Stat_t, name, apiPath string) error {
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
		fd, err := unix.Open(fdPath(pfd), unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NOCTTY, 0)
		if err != nil {
			return opErr("archiving", apiPath, err)
		}
		f := newFile(fd, apiPath)
		defer f.Close()
		return t.regular(f, header(st, name, ""), st.Size, apiPath)
	case unix.S_IFCHR, unix.S_IFBLK, unix.S_IFIFO:
		return t.writeHeader(header(st, name, ""))
	}
	return errdefs.Invalid("archiving %s: unsupported file type", apiPath)
}

func (t *tarWriter) writeHeader(h *tar.Header) error {
	if err := t.tw.WriteHeader(h); err != nil {
		return fmt.Errorf("writing archive: %w", err)
	}
	return nil
}

// regular writes one regular file. A file that shrinks while we read it is
// padded with zeros, one that grows is cut at the size in its header, so the
// stream stays a valid tar whatever the sandbox does meanwhile.
func (t *tarWriter) regular(f io.Reader, h *tar.Header, size int64, apiPath string) error {
	if err := t.writeHeader(h); err != nil {
		return err
	}
	if _, err := io.CopyN(t.tw, io.MultiReader(f, zeros{}), size); err != nil {
		var pe *fs.PathError
		if errors.As(err, &pe) {
			return opErr("archiving", apiPath, pe.Err)
		}
		return fmt.Errorf("writing archive: %w", err)
	}
	return nil
}

type zeros struct{}

func (zeros) Read(b []byte) (int, error) {
	clear(b)
	return len(b), nil
}

// dir writes the entries of the directory open at dirfd, recursively.
// Each name is lstat'ed, and every open uses O_NOFOLLOW with noSymlinks,
// so a name swapped for a symlink after the stat is skipped, not followed.
func (t *tarWriter) dir(dirfd int, prefix, apiPath string, level int) error {
	if level > t.r.maxNesting {
		return errdefs.Invalid("archiving %s: tree nested deeper than %d levels", apiPath, t.r.maxNesting)
	}
	names, err := readNames(dirfd, t.r.maxDirEntries)
	if err == errTooMany {
		return errdefs.Invalid("archiving %s: directory has more than %d entries", apiPath, t.r.maxDirEntries)
	}
	if err != nil {
		return opErr("archiving", apiPath, err)
	}
	for _, name := range names {
		tarName, child := prefix+name, path.Join(apiPath, name)
		var st unix.Stat_t
		if err := unix.Fstatat(dirfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			if err == unix.ENOENT {
				continue
			}
			return opErr("archiving", child, err)
		}
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFDIR:
			if err := t.writeHeader(t.withXattrs(dirfd, name, header(&st, tarName+"/", ""))); err != nil {
				return err
			}
			fd, err := openat2(dirfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW, 0, noSymlinks)
			if err != nil {
				if raced(err) || err == unix.EXDEV {
					continue // EXDEV: a mount point, archived empty
				}
				return opErr("archiving", child, err)
			}
			err = t.dir(fd, tarName+"/", child, level+1)
			unix.Close(fd)
			if err != nil {
				return err
			}
		case unix.S_IFREG:
			id := fileID{uint64(st.Dev), st.Ino}
			if st.Nlink > 1 {
				if first, ok := t.links[id]; ok {
					h := header(&st, tarName, first)
					h.Typeflag, h.Size = tar.TypeLink, 0
					if err := t.writeHeader(h); err != nil {
						return err
					}
					continue
				}
			}
			f, fst, err := openRegular(dirfd, name, unix.O_NOFOLLOW, noSymlinks, child)
			if err != nil {
				if raced(err) || err == errNotRegular || err == unix.EISDIR || err == unix.EXDEV {
					continue // EXDEV: a file bind-mounted over, not the sandbox's
				}
				return opErr("archiving", child, err)
			}
			err = t.regular(f, t.withXattrs(dirfd, name, header(&fst, tarName, "")), fst.Size, child)
			f.Close()
			if err != nil {
				return err
			}
			if fst.Nlink > 1 {
				t.links[id] = tarName
			}
		case unix.S_IFLNK:
			target, err := readlinkat(dirfd, name)
			if err != nil {
				if raced(err) {
					continue
				}
				return opErr("archiving", child, err)
			}
			if err := t.writeHeader(t.withXattrs(dirfd, name, header(&st, tarName, target))); err != nil {
				return err
			}
		case unix.S_IFCHR, unix.S_IFBLK, unix.S_IFIFO:
			if err := t.writeHeader(t.withXattrs(dirfd, name, header(&st, tarName, ""))); err != nil {
				return err
			}
		}
	}
	return nil
}

func newFile(fd int, name string) *os.File { return os.NewFile(uintptr(fd), name) }

// raced reports errors that mean the sandbox changed a name under us; the
// walk skips such names rather than failing.
func raced(err error) bool {
	return err == unix.ENOENT || err == unix.ELOOP || err == unix.ENOTDIR || err == unix.EINVAL
}

// header builds a tar header from a stat. User and group names are left
// empty on purpose: the host's passwd database says nothing about the
// sandbox's users.
func header(st *unix.Stat_t, name, link string) *tar.Header {
	h := &tar.Header{
		Name:     name,
		Linkname: link,
		Mode:     int64(st.Mode & 07777),
		Uid:      int(st.Uid),
		Gid:      int(st.Gid),
		ModTime:  time.Unix(st.Mtim.Sec, st.Mtim.Nsec),
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
		h.Typeflag, h.Size = tar.TypeReg, st.Size
	case unix.S_IFDIR:
		h.Typeflag = tar.TypeDir
	case unix.S_IFLNK:
		h.Typeflag = tar.TypeSymlink
	case unix.S_IFCHR:
		h.Typeflag = tar.TypeChar
	case unix.S_IFBLK:
		h.Typeflag = tar.TypeBlock
	case unix.S_IFIFO:
		h.Typeflag = tar.TypeFifo
	}
	if h.Typeflag == tar.TypeChar || h.Typeflag == tar.TypeBlock {
		h.Devmajor = int64(unix.Major(uint64(st.Rdev)))
		h.Devminor = int64(unix.Minor(uint64(st.Rdev)))
	}
	return h
}

// cleanEntryName sanitises a tar entry (or hard link target) name into a
// clean path relative to the extraction directory: leading slashes are
// dropped ("/a/b" is "a/b"), the result is cleaned, and a name that would
// climb out ("../x", "a/../../b") or holds a NUL byte is refused. "." means
// the extraction directory itself.
func cleanEntryName(name string) (string, error) {
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
		return "", errdefs.Invalid("entry name %q escapes the destination", name)
	}
	return c, nil
}

// ExtractTar extracts the tar stream rd (gzip-compressed or not, told by its
// magic bytes) into the directory p, creating p if missing (following
// symlinks inside the root, like any API path).
//
// Inside p nothing is followed: each entry's parent is resolved from p with
// RESOLVE_NO_SYMLINKS, so an entry that reaches through a symlink — planted
// by the sandbox or by an earlier entry ("x -> /etc" then "x/passwd") — is
// refused with Invalid. The entry itself is created exclusively (an existing
// non-directory, or empty directory, is unlinked first; a non-empty one is
// refused). Hard link targets must lie inside p. Directory modes and mtimes
// are applied last, so a read-only directory in the archive can still be
// filled and its mtime is not disturbed by its children.
//
// A corrupt or truncated archive, an unsafe name and an exceeded limit are
// Invalid; read errors from rd come back unclassified. On error the
// extraction is left partial: layer builds discard their staging directory,
// while in a sandbox the entries written before the error stay.
//
// The archive must end with its end-of-archive marker. archive/tar alone
// takes a stream that stops exactly between two entries (or right after an
// extended header) for a complete archive, so a cut-short upload would pass
// for a whole one; ExtractTar checks for the marker itself (see
// tarTail.marked) and reports such a stream as Invalid ("archive is
// truncated"), naming how many entries of the partial upload were written.
// For gzip input the check applies to the decompressed stream. An empty
// stream has no marker and is refused likewise; an empty archive is 1024
// zero bytes.
func (r *Root) ExtractTar(p string, rd io.Reader, opts TarOptions) (api.TarResult, error) {
	if err := r.hold(); err != nil {
		return api.TarResult{}, err
	}
	defer r.release()
	var res api.TarResult
	clean, err := CleanPath(p)
	if err != nil {
		return res, err
	}
	// The destination's missing parents go to the entries' owner, or
	// with PreserveOwner or Diff (a layer build: no entry names them) to
	// the root's.
	dirOwner := r.owner
	if !opts.PreserveOwner && !opts.Diff {
		opts.Owner = r.ownerOr(opts.Owner)
		dirOwner = opts.Owner
	}
	dest, err := r.mkdirAll(relPath(clean), dirOwner)
	if err == unix.ENOTDIR {
		return res, errdefs.Invalid("extracting into %s: not a directory", clean)
	}
	if err != nil {
		return res, opErr("extracting into", clean, err)
	}
	defer unix.Close(dest)

	src := &sourceReader{r: rd}
	in := io.Reader(bufio.NewReaderSize(src, 64<<10))
	if magic, _ := in.(*bufio.Reader).Peek(2); len(magic) == 2 && magic[0] == 0x1f && magic[1] == 0x8b {
		zr, err := gzip.NewReader(in)
		if err != nil {
			return res, src.wrap(err)
		}
		in = zr
	}
	x := &extractor{dest: dest, opts: opts, src: src}
	tail := &tarTail{r: in}
	tr := tar.NewReader(tail)
	for {
		start := tail.n
		hdr, err := tr.Next()
		if err == io.EOF {
			if !tail.marked(start) {
				return res, errdefs.Invalid("archive is truncated: no end-of-archive marker; the upload is partial: "+
					"the stream ended after %d entries, which were extracted into %s", res.Files, clean)
			}
			break
		}
		// ErrInsecurePath comes with a usable header; cleanEntryName is
		// our own, stricter, judge of names.
		if err != nil && err != tar.ErrInsecurePath {
			return res, src.wrap(err)
		}
		if hdr.Typeflag == tar.TypeXGlobalHeader {
			continue
		}
		if opts.MaxFiles > 0 && res.Files >= opts.MaxFiles {
			return res, errdefs.Invalid("extracting into %s: archive exceeds limit of %d entries", clean, opts.MaxFiles)
		}
		n, err := x.entry(hdr, tr, &res)
		if err != nil {
			return res, err
		}
		res.Files++
		res.Bytes += n
	}
	if err := x.finishDirs(); err != nil {
		return res, err
	}
	return res, nil
}

// sourceReader remembers the caller's reader failing, so a broken upload is
// not reported as a corrupt archive.
type sourceReader struct {
	r   io.Reader
	err error
}

func (s *sourceReader) Read(b []byte) (int, error) {
	n, err := s.r.Read(b)
	if err != nil && err != io.EOF && s.err == nil {
		s.err = err
	}
	return n, err
}

// tarBlock is the tar block size: headers, padded file data and the
// end-of-archive marker all come in whole blocks.
const tarBlock = 512

// tarTail sits between the (decompressed) stream and archive/tar, which
// reads exactly what it decodes and buffers nothing, so n is the offset
// archive/tar has reached. It keeps the last tarBlock bytes consumed, byte
// at offset o in ring[o%tarBlock].
type tarTail struct {
	r    io.Reader
	n    int64
	ring [tarBlock]byte
}

func (t *tarTail) Read(b []byte) (int, error) {
	n, err := t.r.Read(b)
	p, off := b[:n], t.n
	if len(p) > tarBlock {
		off += int64(len(p) - tarBlock)
		p = p[len(p)-tarBlock:]
	}
	for len(p) > 0 {
		c := copy(t.ring[off%tarBlock:], p)
		p, off = p[c:], off+int64(c)
	}
	t.n += int64(n)
	return n, err
}

// marked reports whether the tar.Reader.Next call that began at offset
// start and returned io.EOF ended on the end-of-archive marker rather than
// on the stream merely stopping.
//
// Such a call consumes, in order: the previous entry's padding (under one
// block; ExtractTar has read the entry's data itself), any extended headers
// (PAX, GNU long names) with their data, and then whatever it took for a
// header. archive/tar returns io.EOF there after two zero blocks, after one
// zero block followed by the end of the stream, or when the stream ends
// right at a header boundary: the last is a truncated archive. So the
// marker is there exactly when the call consumed at least a block and,
// block-aligned, its last block is all zeros: padding alone is under a
// block, and an extended header's last block holds its (non-zero) data.
// Comparing against the whole stream's last block instead would be fooled
// by a file whose data ends in a zero block.
//
// POSIX asks for two zero blocks, and both GNU tar and tar.Writer write
// two; one is accepted, as archive/tar and GNU tar themselves accept it,
// since some writers emit a single block and the second adds no safety
// against truncation: a cut between the two still leaves a whole archive.
func (t *tarTail) marked(start int64) bool {
	if t.n-start < tarBlock || t.n%tarBlock != 0 {
		return false
	}
	for _, c := range t.ring {
		if c != 0 {
			return false
		}
	}
	return true
}

// wrap classifies an error met while decoding the archive.
func (s *sourceReader) wrap(err error) error {
	if s.err != nil {
		return fmt.Errorf("reading archive: %w", s.err)
	}
	if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) {
		return errdefs.Invalid("reading archive: truncated")
	}
	return errdefs.Invalid("reading archive: %v", err)
}

type extractor struct {
	dest int // O_PATH fd of the extraction directory
	opts TarOptions
	src  *sourceReader
	dirs []*tar.Header // directories, with cleaned names, to finish last
}

// entry validates and creates one entry, returning the regular-file bytes
// it wrote.
func (x *extractor) entry(hdr *tar.Header, tr io.Reader, res *api.TarResult) (int64, error) {
	name, err := cleanEntryName(hdr.Name)
	if err != nil {
		return 0, fmt.Errorf("extracting: %w", err)
	}
	// Validate everything the header alone decides before touching disk.
	switch hdr.Typeflag {
	case tar.TypeDir:
	case tar.TypeReg:
		if x.opts.MaxBytes > 0 && hdr.Size > x.opts.MaxBytes-res.Bytes {
			return 0, errdefs.Invalid("extracting %q: archive exceeds limit of %d bytes", hdr.Name, x.opts.MaxBytes)
		}
	case tar.TypeSymlink:
		if hdr.Linkname == "" || strings.IndexByte(hdr.Linkname, 0) >= 0 {
			return 0, errdefs.Invalid("extracting %q: bad symlink target", hdr.Name)
		}
	case tar.TypeLink:
		if _, err := cleanEntryName(hdr.Linkname); err != nil {
			return 0, fmt.Errorf("extracting %q: hard link: %w", hdr.Name, err)
		}
	case tar.TypeChar, tar.TypeBlock, tar.TypeFifo:
		if x.opts.Diff {
			if hdr.Typeflag == tar.TypeFifo || (hdr.Typeflag == tar.TypeChar && hdr.Devmajor == 0 && hdr.Devminor == 0) {
				break
			}
			return 0, errdefs.Invalid("extracting %q: a writable layer may hold whiteouts (0:0 character devices) and fifos, not device %d:%d",
				hdr.Name, hdr.Devmajor, hdr.Devminor)
		}
		if !x.opts.AllowDevices {
			return 0, errdefs.Invalid("extracting %q: device and fifo entries are not allowed", hdr.Name)
		}
	default:
		return 0, errdefs.Invalid("extracting %q: unsupported entry type %q", hdr.Name, hdr.Typeflag)
	}
	if name == "." {
		if hdr.Typeflag != tar.TypeDir {
			return 0, errdefs.Invalid("extracting %q: only a directory may name the destination", hdr.Name)
		}
		h := *hdr
		h.Name = name
		x.dirs = append(x.dirs, &h)
		return 0, nil
	}

	dir, base := path.Split(name)
	parent, err := x.mkdirAll(path.Clean(dir))
	if err != nil {
		return 0, x.fail(hdr, err)
	}
	defer unix.Close(parent)
	isDirNow, err := x.clear(parent, base, hdr.Typeflag == tar.TypeDir)
	if err != nil {
		return 0, x.fail(hdr, err)
	}

	switch hdr.Typeflag {
	case tar.TypeDir:
		// Created private and finished last (see finishDirs).
		if !isDirNow {
			if err := unix.Mkdirat(parent, base, 0700); err != nil {
				return 0, x.fail(hdr, err)
			}
		}
		h := *hdr
		h.Name = name
		x.dirs = append(x.dirs, &h)
		return 0, nil
	case tar.TypeReg:
		return x.regular(parent, base, hdr, tr)
	case tar.TypeLink:
		target, _ := cleanEntryName(hdr.Linkname)
		tdir, tbase := path.Split(target)
		tparent, err := openat2(x.dest, path.Clean(tdir), unix.O_PATH|unix.O_DIRECTORY, 0, noSymlinks)
		if err != nil {
			return 0, x.fail(hdr, err)
		}
		defer unix.Close(tparent)
		// Flags 0: a symlink target is linked itself, never followed.
		if err := unix.Linkat(tparent, tbase, parent, base, 0); err != nil {
			if err == unix.EPERM {
				return 0, errdefs.Invalid("extracting %q: cannot hard link to %q", hdr.Name, hdr.Linkname)
			}
			return 0, x.fail(hdr, err)
		}
		return 0, nil
	case tar.TypeSymlink:
		if err := unix.Symlinkat(hdr.Linkname, parent, base); err != nil {
			return 0, x.fail(hdr, err)
		}
		return 0, x.finish(parent, base, unix.S_IFLNK, hdr)
	default: // char, block, fifo: allowed above
		typ := map[byte]uint32{tar.TypeChar: unix.S_IFCHR, tar.TypeBlock: unix.S_IFBLK, tar.TypeFifo: unix.S_IFIFO}[hdr.Typeflag]
		dev := unix.Mkdev(uint32(hdr.Devmajor), uint32(hdr.Devminor))
		if err := unix.Mknodat(parent, base, typ|0600, int(dev)); err != nil {
			return 0, x.fail(hdr, err)
		}
		return 0, x.finish(parent, base, typ, hdr)
	}
}

// regular creates base in parent exclusively and fills it from tr. The
// header's size was checked against MaxBytes, and tr yields exactly that
// many bytes, so nothing beyond the limit is ever written.
func (x *extractor) regular(parent int, base string, hdr *tar.Header, tr io.Reader) (int64, error) {
	fd, err := openat2(parent, base, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW, 0600, noSymlinks)
	if err != nil {
		return 0, x.fail(hdr, err)
	}
	f := newFile(fd, hdr.Name)
	defer f.Close()
	n, err := io.CopyN(f, tr, hdr.Size)
	if err == nil {
		err = x.meta(fd, false, hdr)
	}
	if err != nil {
		unlinkat(parent, base, 0)
		var pe *fs.PathError
		if errors.As(err, &pe) {
			return 0, x.fail(hdr, pe.Err)
		}
		if _, ok := err.(unix.Errno); ok {
			return 0, x.fail(hdr, err)
		}
		return 0, x.src.wrap(err)
	}
	return n, nil
}

// finish applies metadata to a non-regular entry we just created, through
// an O_PATH fd, after checking it is still what we created.
func (x *extractor) finish(parent int, base string, typ uint32, hdr *tar.Header) error {
	fd, err := openat2(parent, base, unix.O_PATH|unix.O_NOFOLLOW, 0, noSymlinks)
	if err != nil {
		return x.fail(hdr, err)
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return x.fail(hdr, err)
	}
	if st.Mode&unix.S_IFMT != typ {
		return errdefs.Precondition("extracting %q: entry replaced while extracting", hdr.Name)
	}
	if err := x.meta(fd, typ == unix.S_IFLNK, hdr); err != nil {
		return x.fail(hdr, err)
	}
	return nil
}

// finishDirs applies directory metadata, deepest-last-seen first. Names are
// resolved afresh with noSymlinks; one that is no longer a directory (the
// archive replaced it, or the sandbox did) is skipped.
func (x *extractor) finishDirs() error {
	for i := len(x.dirs) - 1; i >= 0; i-- {
		hdr := x.dirs[i]
		fd, err := openat2(x.dest, hdr.Name, unix.O_PATH|unix.O_NOFOLLOW|unix.O_DIRECTORY, 0, noSymlinks)
		if err != nil {
			if raced(err) {
				continue
			}
			return x.fail(hdr, err)
		}
		err = x.meta(fd, false, hdr)
		unix.Close(fd)
		if err != nil {
			return x.fail(hdr, err)
		}
	}
	return nil
}

// meta applies owner, mode, xattrs and times from hdr to the inode at fd
// (an O_PATH fd or an open file), in that order: chown clears setuid bits
// and file capabilities, and every change but utimes touches ctime only.
func (x *extractor) meta(fd int, isLink bool, hdr *tar.Header) error {
	keepOwner := x.opts.PreserveOwner || x.opts.Diff
	if keepOwner {
		if err := unix.Fchownat(fd, "", hdr.Uid, hdr.Gid, unix.AT_EMPTY_PATH|unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return err
		}
	} else if o := x.opts.Owner; o != nil {
		if err := unix.Fchownat(fd, "", o.UID, o.GID, unix.AT_EMPTY_PATH|unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return err
		}
	}
	if !isLink {
		mode := uint32(hdr.Mode) & keptModeBits
		if keepOwner {
			mode |= uint32(hdr.Mode) & privilegedModeBit
		}
		if err := chmodFd(fd, mode); err != nil {
			return err
		}
		for k, v := range hdr.PAXRecords {
			name, ok := strings.CutPrefix(k, "SCHILY.xattr.")
			if !ok {
				continue
			}
			user := strings.HasPrefix(name, "user.")
			switch {
			case x.opts.Diff:
				if !user && name != "security.capability" && (name != opaqueXattr || v != "y") {
					continue
				}
			case !user && !x.opts.PreserveOwner:
				continue
			}
			err := unix.Setxattr(fdPath(fd), name, []byte(v), 0)
			// "Where the fs allows": tmpfs and others lack some namespaces,
			// and the kernel refuses user.* on special files.
			if err == nil || err == unix.ENOTSUP || (user && err == unix.EPERM) {
				continue
			}
			return err
		}
	}
	mtime := unix.NsecToTimespec(hdr.ModTime.UnixNano())
	atime := unix.Timespec{Nsec: unix.UTIME_OMIT}
	if !hdr.AccessTime.IsZero() {
		atime = unix.NsecToTimespec(hdr.AccessTime.UnixNano())
	}
	return unix.UtimesNanoAt(fd, "", []unix.Timespec{atime, mtime}, unix.AT_EMPTY_PATH|unix.AT_SYMLINK_NOFOLLOW)
}

// mkdirAll opens dir (relative to the extraction directory) as an O_PATH fd,
// creating missing components with mode 0755. Any symlink on the way, even
// one pointing inside p, is refused: the archive cannot reach through links.
func (x *extractor) mkdirAll(dir string) (int, error) {
	fd, err := openat2(x.dest, dir, unix.O_PATH|unix.O_DIRECTORY, 0, noSymlinks)
	if err != unix.ENOENT {
		return fd, err
	}
	cur, err := unix.Dup(x.dest)
	if err != nil {
		return -1, err
	}
	for _, c := range strings.Split(dir, "/") {
		next, err := openat2(cur, c, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW, 0, noSymlinks)
		if err == unix.ENOENT {
			merr := unix.Mkdirat(cur, c, 0755)
			if merr == nil && !x.opts.PreserveOwner {
				merr = chownNew(cur, c, x.opts.Owner)
			}
			if merr != nil && merr != unix.EEXIST {
				unix.Close(cur)
				return -1, merr
			}
			next, err = openat2(cur, c, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW, 0, noSymlinks)
		}
		unix.Close(cur)
		if err != nil {
			return -1, err
		}
		cur = next
	}
	return cur, nil
}

// clear makes room for base in parent: an existing non-directory is
// unlinked (never written through); an existing directory is kept when a
// directory is wanted, removed if empty otherwise.
func (x *extractor) clear(parent int, base string, wantDir bool) (isDir bool, err error) {
	var st unix.Stat_t
	if err := unix.Fstatat(parent, base, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		if err == unix.ENOENT {
			return false, nil
		}
		return false, err
	}
	if st.Mode&unix.S_IFMT == unix.S_IFDIR {
		if wantDir {
			return true, nil
		}
		return false, unlinkat(parent, base, unix.AT_REMOVEDIR)
	}
	return false, unlinkat(parent, base, 0)
}

// fail wraps a syscall error met while creating an entry. Errors the
// archive's content provokes (a symlinked or missing parent, a hard link to
// nowhere, a non-empty directory in the way) are Invalid.
func (x *extractor) fail(hdr *tar.Header, err error) error {
	switch err {
	case unix.ELOOP:
		return errdefs.Invalid("extracting %q: path crosses a symbolic link", hdr.Name)
	case unix.ENOTDIR:
		return errdefs.Invalid("extracting %q: a parent is not a directory", hdr.Name)
	case unix.ENOENT:
		return errdefs.Invalid("extracting %q: target does not exist", hdr.Name)
	case unix.ENOTEMPTY:
		return errdefs.Invalid("extracting %q: would replace a non-empty directory", hdr.Name)
	case unix.EEXIST:
		return errdefs.Invalid("extracting %q: already exists", hdr.Name)
	case unix.EISDIR, unix.EXDEV, unix.ENAMETOOLONG, unix.EINVAL:
		return errdefs.Invalid("extracting %q: %v", hdr.Name, err)
	}
	return fmt.Errorf("extracting %q: %w", hdr.Name, classify(err))
}
