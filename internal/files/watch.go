package files

import (
	"path"
	"sort"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
)

// A Watch follows the names below one directory of a root by scanning it
// again at each Poll and comparing the scans. It is polling, not inotify,
// on purpose: an inotify watch set from the host sees the writes made
// through the host's view of the sandbox's filesystem, but a sandbox
// whose overlay is mounted only in its own mount namespace (and a
// microVM's disk) changes below the host's view without telling it, while
// a scan through the confined root sees every backend the same way.
//
// A scan is bounded: at most maxEntries names (more is an error that says
// so, rather than a watch that silently misses some), depth levels below
// the directory, and it descends neither symlinks nor mount points, as
// List does. A Watch is not safe for concurrent use.
type Watch struct {
	r          *Root
	dir        string // the watched directory, a cleaned API path
	depth      int
	maxEntries int
	last       map[string]node
}

// node is what a scan records of one name: enough to tell a change.
type node struct {
	mode     uint32 // type and permission bits
	uid, gid uint32
	size     int64
	mtime    unix.Timespec
	dev, ino uint64
}

func nodeOf(st *unix.Stat_t) node {
	return node{mode: st.Mode, uid: st.Uid, gid: st.Gid, size: st.Size, mtime: st.Mtim, dev: st.Dev, ino: st.Ino}
}

// Watch starts watching the directory p (followed if it is a symlink
// inside the root) depth levels deep (1: its children), taking the first
// scan. A missing p is NotFound, a non-directory Invalid, and more than
// maxEntries names below it Invalid.
func (r *Root) Watch(p string, depth, maxEntries int) (*Watch, error) {
	clean, err := CleanPath(p)
	if err != nil {
		return nil, err
	}
	if depth < 1 || maxEntries < 1 {
		return nil, errdefs.Invalid("watching %s: depth and entry bound must be at least 1", clean)
	}
	w := &Watch{r: r, dir: clean, depth: min(depth, r.maxNesting), maxEntries: maxEntries}
	if w.last, err = w.scan(); err != nil {
		return nil, err
	}
	return w, nil
}

// Dir is the watched directory.
func (w *Watch) Dir() string { return w.dir }

// Poll scans again and returns the changes since the previous scan,
// ordered by name; each carries the entry as it is now unless it is a
// removal (or the old name of a rename). The watched directory gone is
// NotFound.
func (w *Watch) Poll() ([]api.FileEvent, error) {
	snap, err := w.scan()
	if err != nil {
		return nil, err
	}
	evs := diff(w.last, snap)
	w.last = snap
	for i := range evs {
		ev := &evs[i]
		if ev.Type == api.FileEventRemove || ev.Type == api.FileEventRename {
			continue
		}
		if i > 0 && evs[i-1].Name == ev.Name && evs[i-1].Entry != nil {
			ev.Entry = evs[i-1].Entry
			continue
		}
		if e, err := w.r.Stat(path.Join(w.dir, ev.Name)); err == nil {
			ev.Entry = &e
		}
	}
	return evs, nil
}

// scan records every name below the watched directory.
func (w *Watch) scan() (map[string]node, error) {
	if err := w.r.hold(); err != nil {
		return nil, err
	}
	defer w.r.release()
	fd, err := w.r.openDir(w.dir)
	if err != nil {
		return nil, err
	}
	defer unix.Close(fd)
	snap := map[string]node{}
	if err := w.scanDir(fd, "", 1, snap); err != nil {
		return nil, err
	}
	return snap, nil
}

func (w *Watch) tooMany() error {
	return errdefs.Invalid("watching %s: more than %d entries below it; watch a smaller directory, or not recursively", w.dir, w.maxEntries)
}

func (w *Watch) scanDir(dirfd int, rel string, level int, snap map[string]node) error {
	names, err := readNames(dirfd, min(w.maxEntries, w.r.maxDirEntries))
	if err == errTooMany {
		return w.tooMany()
	}
	if err != nil {
		return opErr("watching", path.Join(w.dir, rel), err)
	}
	for _, name := range names {
		child := name
		if rel != "" {
			child = rel + "/" + name
		}
		var st unix.Stat_t
		if err := unix.Fstatat(dirfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			if err == unix.ENOENT {
				continue // removed since we read the directory
			}
			return opErr("watching", path.Join(w.dir, child), err)
		}
		if len(snap) >= w.maxEntries {
			return w.tooMany()
		}
		snap[child] = nodeOf(&st)
		if !isDir(&st) || level >= w.depth {
			continue
		}
		fd, err := openat2(dirfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW, 0, noSymlinks)
		if err != nil {
			if err == unix.ENOENT || err == unix.ELOOP || err == unix.ENOTDIR || err == unix.EXDEV {
				continue // swapped for a link since the stat, or a mount point: not entered
			}
			return opErr("watching", path.Join(w.dir, child), err)
		}
		err = w.scanDir(fd, child, level+1, snap)
		unix.Close(fd)
		if err != nil {
			return err
		}
	}
	return nil
}

// diff turns two scans into events, the way inotify would have reported
// what happened between them, as far as a scan can tell:
//
//   - a new name is create, and a new non-empty regular file also write
//     (it was created, then written);
//   - a gone name is remove, unless another name now holds its inode:
//     then the old name gets rename and the new one create (or write, if
//     it replaced a file there), as inotify's moved-from and moved-to are
//     reported;
//   - a regular file whose inode, size or modification time changed is
//     write (a new inode: replaced by a rename over it, as atomic writers
//     and dsec's own WriteFile do); any other name whose type or inode
//     changed is remove then create;
//   - changed permission bits or owner are chmod.
//
// Events are ordered by name, the events of one name in the order above.
func diff(old, cur map[string]node) []api.FileEvent {
	type key struct {
		dev, ino uint64
		typ      uint32
	}
	keyOf := func(n node) key { return key{n.dev, n.ino, n.mode & unix.S_IFMT} }
	gone := map[key]bool{}
	for name, o := range old {
		if _, ok := cur[name]; !ok {
			gone[keyOf(o)] = true
		}
	}
	born := map[key]bool{}
	names := make([]string, 0, len(old))
	for name := range old {
		names = append(names, name)
	}
	for name, n := range cur {
		o, ok := old[name]
		if !ok {
			names = append(names, name)
		}
		if !ok || keyOf(o) != keyOf(n) {
			// A new name, or a name that now holds another inode (a
			// rename over it): a gone name of this inode was renamed.
			born[keyOf(n)] = true
		}
	}
	sort.Strings(names)
	var evs []api.FileEvent
	add := func(name, typ string) { evs = append(evs, api.FileEvent{Name: name, Type: typ}) }
	for _, name := range names {
		o, had := old[name]
		n, has := cur[name]
		switch {
		case !had:
			add(name, api.FileEventCreate)
			if !gone[keyOf(n)] && n.mode&unix.S_IFMT == unix.S_IFREG && n.size > 0 {
				add(name, api.FileEventWrite)
			}
		case !has:
			if born[keyOf(o)] {
				add(name, api.FileEventRename)
			} else {
				add(name, api.FileEventRemove)
			}
		default:
			sameType := o.mode&unix.S_IFMT == n.mode&unix.S_IFMT
			sameInode := o.dev == n.dev && o.ino == n.ino
			switch {
			case sameType && n.mode&unix.S_IFMT == unix.S_IFREG:
				if !sameInode || o.size != n.size || o.mtime != n.mtime {
					add(name, api.FileEventWrite)
				}
			case !sameType || !sameInode:
				add(name, api.FileEventRemove)
				add(name, api.FileEventCreate)
				continue // a new object: its mode is not a change
			}
			if o.mode&07777 != n.mode&07777 || o.uid != n.uid || o.gid != n.gid {
				add(name, api.FileEventChmod)
			}
		}
	}
	return evs
}
