package main

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
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// tarStats counts what a tar stream held.
type tarStats struct {
	Entries int   // headers written or extracted
	Bytes   int64 // regular file content
	Skipped int   // entries left out (sockets; devices when extracting)
}

// writeTarDir streams the tree under dir as a tar archive to w, with names
// relative to dir and without an entry for dir itself. Symlinks are stored
// as links (never followed), hard links as links to the first name, and
// modes, ownership (numeric only) and mtimes (whole seconds) are kept.
// Sockets cannot be archived and are skipped.
func writeTarDir(w io.Writer, dir string) (tarStats, error) {
	var st tarStats
	root, err := filepath.EvalSymlinks(dir)
	if err != nil {
		return st, err
	}
	if fi, err := os.Stat(root); err != nil {
		return st, err
	} else if !fi.IsDir() {
		return st, fmt.Errorf("%s is not a directory", dir)
	}
	tw := tar.NewWriter(w)
	firstName := map[[2]uint64]string{} // (dev, inode) of multiply linked files
	err = filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(root, p)
		if err != nil {
			return err
		}
		if rel == "." {
			return nil
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		if info.Mode()&fs.ModeSocket != 0 {
			st.Skipped++
			return nil
		}
		var link string
		if info.Mode()&fs.ModeSymlink != 0 {
			if link, err = os.Readlink(p); err != nil {
				return err
			}
		}
		hdr, err := tar.FileInfoHeader(info, link)
		if err != nil {
			return fmt.Errorf("archiving %s: %w", p, err)
		}
		hdr.Name = filepath.ToSlash(rel)
		if info.IsDir() {
			hdr.Name += "/"
		}
		// Numeric ids only, second-resolution mtime and no atime/ctime: the
		// archive then fits the plain formats and the same tree gives the
		// same bytes, which lets the server dedupe identical layers.
		hdr.Uname, hdr.Gname = "", ""
		hdr.ModTime = info.ModTime().Truncate(time.Second)
		hdr.AccessTime, hdr.ChangeTime = time.Time{}, time.Time{}
		hdr.Format = tar.FormatUnknown
		if sys, ok := info.Sys().(*syscall.Stat_t); ok && info.Mode().IsRegular() && sys.Nlink > 1 {
			key := [2]uint64{uint64(sys.Dev), uint64(sys.Ino)}
			if first, seen := firstName[key]; seen {
				hdr.Typeflag, hdr.Linkname, hdr.Size = tar.TypeLink, first, 0
			} else {
				firstName[key] = hdr.Name
			}
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		st.Entries++
		if hdr.Typeflag != tar.TypeReg {
			return nil
		}
		f, err := os.Open(p)
		if err != nil {
			return err
		}
		defer f.Close()
		// Copy exactly the size announced in the header; a file that
		// changes while we read it must not corrupt the archive.
		n, err := io.CopyN(tw, f, hdr.Size)
		st.Bytes += n
		if err != nil {
			return fmt.Errorf("archiving %s (changed while reading?): %w", p, err)
		}
		return nil
	})
	if err != nil {
		return st, err
	}
	return st, tw.Close()
}

// extractTar unpacks a tar stream (plain or gzip) into dir, which must
// exist. Entries whose name is absolute or climbs out with "..", and hard
// links pointing out, are refused with an error; writes through symlinks
// that point out of dir are refused by os.Root. Devices and FIFOs are
// skipped (they need privileges and are not what a user pulls files for).
// Modes and mtimes are restored; ownership is not.
func extractTar(r io.Reader, dir string) (tarStats, error) {
	var st tarStats
	br := bufio.NewReader(r)
	if magic, _ := br.Peek(2); len(magic) == 2 && magic[0] == 0x1f && magic[1] == 0x8b {
		zr, err := gzip.NewReader(br)
		if err != nil {
			return st, err
		}
		defer zr.Close()
		r = zr
	} else {
		r = br
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		return st, err
	}
	defer root.Close()

	type dirMeta struct {
		name  string
		mode  fs.FileMode
		mtime time.Time
	}
	var dirs []dirMeta // applied last: a read-only dir would block its children
	tr := tar.NewReader(r)
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return st, fmt.Errorf("reading tar: %w", err)
		}
		if hdr.Typeflag == tar.TypeXGlobalHeader {
			continue
		}
		name, err := localTarName(hdr.Name)
		if err != nil {
			return st, err
		}
		if name == "." {
			continue // the archive's own root: dir already exists
		}
		mode := hdr.FileInfo().Mode().Perm()
		if parent := path.Dir(name); parent != "." {
			if err := root.MkdirAll(parent, 0o755); err != nil {
				return st, fmt.Errorf("extracting %s: %w", name, err)
			}
		}
		switch hdr.Typeflag {
		case tar.TypeDir:
			if err := root.MkdirAll(name, 0o755); err != nil {
				return st, fmt.Errorf("extracting %s: %w", name, err)
			}
			dirs = append(dirs, dirMeta{name, mode, hdr.ModTime})
		case tar.TypeReg:
			if err := removeNonDir(root, name); err != nil {
				return st, err
			}
			f, err := root.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
			if err != nil {
				return st, fmt.Errorf("extracting %s: %w", name, err)
			}
			n, err := io.Copy(f, tr)
			st.Bytes += n
			if cerr := f.Close(); err == nil {
				err = cerr
			}
			if err != nil {
				return st, fmt.Errorf("extracting %s: %w", name, err)
			}
			if err := root.Chmod(name, mode); err != nil {
				return st, err
			}
			_ = root.Chtimes(name, hdr.ModTime, hdr.ModTime)
		case tar.TypeSymlink:
			if err := removeNonDir(root, name); err != nil {
				return st, err
			}
			if err := root.Symlink(hdr.Linkname, name); err != nil {
				return st, fmt.Errorf("extracting %s: %w", name, err)
			}
		case tar.TypeLink:
			target, err := localTarName(hdr.Linkname)
			if err != nil || target == "." {
				return st, fmt.Errorf("refusing hard link %s -> %s: target outside %s", hdr.Name, hdr.Linkname, dir)
			}
			if err := removeNonDir(root, name); err != nil {
				return st, err
			}
			if err := root.Link(target, name); err != nil {
				return st, fmt.Errorf("extracting %s: %w", name, err)
			}
		default:
			st.Skipped++
			continue
		}
		st.Entries++
	}
	for i := len(dirs) - 1; i >= 0; i-- { // children before parents
		d := dirs[i]
		if err := root.Chmod(d.name, d.mode); err != nil {
			return st, err
		}
		_ = root.Chtimes(d.name, d.mtime, d.mtime)
	}
	return st, nil
}

// localTarName validates a tar entry name and returns it cleaned, with
// forward slashes; "." for the archive's root.
func localTarName(name string) (string, error) {
	trimmed := strings.TrimSuffix(name, "/")
	if trimmed == "" || trimmed == "." {
		return ".", nil
	}
	if !filepath.IsLocal(filepath.FromSlash(trimmed)) {
		return "", fmt.Errorf("refusing tar entry %q: it would land outside the target directory", name)
	}
	return path.Clean(trimmed), nil
}

// removeNonDir removes whatever non-directory sits at name, so that an
// entry replaces it instead of writing through an old symlink.
func removeNonDir(root *os.Root, name string) error {
	fi, err := root.Lstat(name)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if fi.IsDir() {
		return fmt.Errorf("extracting %s: a directory is in the way", name)
	}
	return root.Remove(name)
}
