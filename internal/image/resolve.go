package image

import (
	"slices"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// Path resolution inside the tree being written, in the merged view when
// it is an overlay upper. See applier for the vocabulary.

// locate resolves dir to its canonical path without creating anything.
func (a *applier) locate(dir string) (string, error) {
	fd, err := openDir(a.root, dir)
	if err == nil {
		unix.Close(fd)
		return dir, nil
	}
	return a.resolve(dir)
}

// resolve finds the canonical path of dir in the (merged) tree by walking
// it a component at a time, as the kernel would: ".." and absolute symlink
// targets stop at the root, symlinks are followed (at most maxSymlinks),
// and a missing component is kept, to be created as a directory. The
// result has no symlink in it, so what is opened with it cannot leave the
// tree, and it names the same place the image's own filesystem would.
func (a *applier) resolve(dir string) (string, error) {
	var out []string
	rest := strings.Split(dir, "/")
	links := 0
	for len(rest) > 0 {
		c := rest[0]
		rest = rest[1:]
		switch c {
		case "", ".":
			continue
		case "..":
			if len(out) > 0 {
				out = out[:len(out)-1]
			}
			continue
		}
		cand := strings.Join(append(slices.Clip(out), c), "/")
		v, err := a.lookup(cand)
		if err != nil {
			return "", err
		}
		switch v.mode {
		case 0, unix.S_IFDIR:
			out = append(out, c)
		case unix.S_IFLNK:
			if links++; links > maxSymlinks {
				return "", errdefs.Invalid("resolving %q: too many levels of symbolic links", dir)
			}
			target, err := a.readlink(cand, v.inUpper)
			if err != nil {
				return "", err
			}
			if strings.HasPrefix(target, "/") {
				out = out[:0]
			}
			rest = append(strings.Split(target, "/"), rest...)
		default:
			return "", errdefs.Invalid("resolving %q: %q is not a directory", dir, cand)
		}
	}
	if len(out) == 0 {
		return ".", nil
	}
	return strings.Join(out, "/"), nil
}

// view is what the (merged) tree shows at a path: mode is the file type
// (0 when nothing is there), inUpper whether root (not lower) holds it.
type view struct {
	mode    uint32
	inUpper bool
}

// lookup says what the tree shows at p, whose ancestors are canonical or
// missing. For an upper it applies overlayfs's rules: the upper's entry
// wins, a whiteout hides, and the lower shows through only below upper
// directories that are neither missing-from-lower nor opaque.
func (a *applier) lookup(p string) (view, error) {
	if p == "." {
		return view{mode: unix.S_IFDIR, inUpper: true}, nil
	}
	cur, err := openDir(a.root, ".")
	if err != nil {
		return view{}, err
	}
	defer func() { unix.Close(cur) }()
	lowerShows := a.upper()
	comps := strings.Split(p, "/")
	for i, c := range comps {
		var st unix.Stat_t
		err := unix.Fstatat(cur, c, &st, unix.AT_SYMLINK_NOFOLLOW)
		if err == unix.ENOENT {
			if lowerShows {
				return a.lookupLower(p)
			}
			return view{}, nil
		}
		if err != nil {
			return view{}, err
		}
		typ := st.Mode & unix.S_IFMT
		if a.upper() && isWhiteout(&st) {
			return view{}, nil
		}
		if i == len(comps)-1 {
			return view{mode: typ, inUpper: true}, nil
		}
		if typ != unix.S_IFDIR {
			return view{}, nil
		}
		if lowerShows {
			v, err := getXattr(procPath(cur, c), opaqueXattr)
			if err != nil {
				return view{}, err
			}
			lowerShows = string(v) != "y"
		}
		next, err := openDir(cur, c)
		if err != nil {
			return view{}, err
		}
		unix.Close(cur)
		cur = next
	}
	panic("unreachable")
}

// lookupLower says what the lower tree has at p. The lower is a plain tree
// and p canonical in the merged view; a symlink or non-directory on the way
// in the lower means the upper replaced it, so nothing of the lower shows.
func (a *applier) lookupLower(p string) (view, error) {
	dir, base := splitPath(p)
	fd, err := openDir(a.lower, dir)
	if err == unix.ENOENT || err == unix.ENOTDIR || err == unix.ELOOP {
		return view{}, nil
	}
	if err != nil {
		return view{}, err
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstatat(fd, base, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		if err == unix.ENOENT {
			return view{}, nil
		}
		return view{}, err
	}
	return view{mode: st.Mode & unix.S_IFMT}, nil
}

func (a *applier) readlink(p string, inUpper bool) (string, error) {
	tree := a.root
	if !inUpper {
		tree = a.lower
	}
	dir, base := splitPath(p)
	fd, err := openDir(tree, dir)
	if err != nil {
		return "", err
	}
	defer unix.Close(fd)
	return readlinkAt(fd, base)
}
