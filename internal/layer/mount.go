package layer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/mountinfo"
)

// erofsMountFlags: read-only, and nosuid/nodev so that nobody on the host
// can use a setuid binary or device node straight from <mntDir>/<hex>.
// Inside a sandbox these flags do not apply: execve and device opens go
// through the overlay mount, whose own flags decide (checked on this
// kernel with a setuid binary in a lower).
const erofsMountFlags = unix.MS_RDONLY | unix.MS_NOSUID | unix.MS_NODEV

// Mounter mounts layer images read-only, once per node, at <mntDir>/<hex>,
// and counts the sandboxes using each. It is safe for concurrent use: any
// number of Acquire calls for one digest produce a single mount.
//
// A mount is removed as soon as its count drops to zero. A grace period
// would spare a remount when sandboxes on one base churn, but mounting a
// file-backed EROFS image costs well under a millisecond to a few ms and the
// blob's page cache survives the unmount, so immediacy (and a mount table
// that says exactly what is in use) wins.
type Mounter struct {
	dir string
	src Source
	log *slog.Logger

	mu sync.Mutex
	// mounts holds digests that are mounted or being mounted.
	mounts map[string]*erofsMount
	// releases give back what the source opened, per mounted digest.
	releases map[string]func()
	// closing holds digests being unmounted; the channel closes when done.
	closing map[string]chan struct{}
}

type erofsMount struct {
	refs int
	done chan struct{} // closed when the mount attempt has finished
	err  error         // result of the attempt; written before done closes
}

// Source is where a Mounter finds a layer's EROFS image as a file. The
// layer directory (local, or a shared mount in a cluster) is one
// (*Store); an on-demand source, a remote image read through a file of a
// FUSE filesystem of the edge's own, fits the same shape.
type Source interface {
	// Open returns the path of digest's image, readable until release is
	// called (once the image is unmounted). A missing image is
	// errdefs.ErrNotFound.
	Open(ctx context.Context, digest string) (path string, release func(), err error)
}

// EdgeStopper is implemented by sources that hold resources of the node
// (a daemon serving remote images): the edge tells them when it stops,
// after it has released what it could.
type EdgeStopper interface {
	EdgeStopped()
}

// NewMounter returns a Mounter that mounts under mntDir the images src
// provides. Call Recover before the first Acquire after a restart.
func NewMounter(mntDir string, src Source, log *slog.Logger) *Mounter {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	// mountinfo shows resolved paths; so must our prefix (a mntDir under
	// a symlink such as /var/run would otherwise hide its mounts from
	// Recover).
	if abs, err := filepath.Abs(mntDir); err == nil {
		mntDir = abs
	}
	if real, err := filepath.EvalSymlinks(mntDir); err == nil {
		mntDir = real
	}
	return &Mounter{
		dir:      filepath.Clean(mntDir),
		src:      src,
		releases: make(map[string]func()),
		log:      log,
		mounts:   make(map[string]*erofsMount),
		closing:  make(map[string]chan struct{}),
	}
}

// Mountpoint returns where digest is (or would be) mounted.
func (m *Mounter) Mountpoint(digest string) string {
	return filepath.Join(m.dir, strings.TrimPrefix(digest, "sha256:"))
}

// Acquire mounts the image of digest if it is not mounted yet, takes one
// reference on it, and returns the mountpoint. Every successful Acquire
// must be paired with one Release.
func (m *Mounter) Acquire(digest string) (string, error) {
	if !IsDigest(digest) {
		return "", errdefs.Invalid("mounting layer: %q is not a sha256 digest", digest)
	}
	for {
		m.mu.Lock()
		if ch := m.closing[digest]; ch != nil {
			m.mu.Unlock()
			<-ch
			continue
		}
		if mt := m.mounts[digest]; mt != nil {
			mt.refs++
			m.mu.Unlock()
			<-mt.done
			if mt.err != nil {
				m.drop(digest, mt)
				return "", mt.err
			}
			return m.Mountpoint(digest), nil
		}
		mt := &erofsMount{refs: 1, done: make(chan struct{})}
		m.mounts[digest] = mt
		m.mu.Unlock()

		mt.err = m.mount(digest)
		close(mt.done)
		if mt.err != nil {
			m.drop(digest, mt)
			return "", mt.err
		}
		return m.Mountpoint(digest), nil
	}
}

// drop gives back the reference of an Acquire whose mount failed; the last
// one out forgets the failed attempt so that a later Acquire retries.
func (m *Mounter) drop(digest string, mt *erofsMount) {
	m.mu.Lock()
	defer m.mu.Unlock()
	mt.refs--
	if mt.refs == 0 && m.mounts[digest] == mt {
		delete(m.mounts, digest)
	}
}

// mount mounts the blob of digest at its mountpoint, or adopts a mount that
// is already there (a previous daemon's, not yet reaped by Recover) rather
// than stacking a second one on top.
func (m *Mounter) mount(digest string) error {
	target := m.Mountpoint(digest)
	if m.src == nil {
		return errdefs.Precondition("mounting layer %s: this node has no layer source", digest)
	}
	blob, release, err := m.src.Open(context.Background(), digest)
	if err != nil {
		return fmt.Errorf("mounting layer %s: %w", digest, err)
	}
	ok := false
	defer func() {
		if ok {
			m.mu.Lock()
			m.releases[digest] = release
			m.mu.Unlock()
		} else {
			release()
		}
	}()
	if err := os.MkdirAll(m.dir, 0o700); err != nil {
		return fmt.Errorf("mounting layer %s: %w", digest, err)
	}
	if err := os.Mkdir(target, 0o700); err != nil && !errors.Is(err, os.ErrExist) {
		return fmt.Errorf("mounting layer %s: %w", digest, err)
	}
	mounted, err := isMountRoot(target)
	if err != nil {
		return fmt.Errorf("mounting layer %s: %w", digest, err)
	}
	if mounted {
		m.log.Warn("adopting existing layer mount", "digest", digest, "mountpoint", target)
		ok = true
		return nil
	}
	// File-backed EROFS (kernel 6.12+) needs no loop device.
	if err := unix.Mount(blob, target, "erofs", erofsMountFlags, ""); err != nil {
		unix.Rmdir(target)
		return fmt.Errorf("mounting layer %s: mount -t erofs %s %s: %w", digest, blob, target, err)
	}
	ok = true
	return nil
}

// Release drops one reference on digest and unmounts it at zero.
func (m *Mounter) Release(digest string) error {
	m.mu.Lock()
	mt := m.mounts[digest]
	if mt == nil || mt.refs <= 0 {
		m.mu.Unlock()
		return errdefs.Precondition("releasing layer %s: not acquired", digest)
	}
	mt.refs--
	if mt.refs > 0 {
		m.mu.Unlock()
		return nil
	}
	delete(m.mounts, digest)
	ch := make(chan struct{})
	m.closing[digest] = ch
	m.mu.Unlock()

	err := m.unmount(digest)

	m.mu.Lock()
	delete(m.closing, digest)
	if err != nil {
		// Still mounted: keep it, unreferenced, for the next Acquire.
		done := make(chan struct{})
		close(done)
		m.mounts[digest] = &erofsMount{done: done}
	}
	m.mu.Unlock()
	close(ch)
	return err
}

func (m *Mounter) unmount(digest string) error {
	target := m.Mountpoint(digest)
	if err := unmountAll(target); err != nil {
		return fmt.Errorf("unmounting layer %s: %w", digest, err)
	}
	m.mu.Lock()
	release := m.releases[digest]
	delete(m.releases, digest)
	m.mu.Unlock()
	if release != nil {
		release()
	}
	if err := unix.Rmdir(target); err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("unmounting layer %s: removing mountpoint: %w", digest, err)
	}
	return nil
}

// Refs returns the reference count of every acquired digest.
func (m *Mounter) Refs() map[string]int {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make(map[string]int, len(m.mounts))
	for d, mt := range m.mounts {
		if mt.refs > 0 {
			out[d] = mt.refs
		}
	}
	return out
}

// InUse reports whether any sandbox holds a reference on digest.
func (m *Mounter) InUse(digest string) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	mt := m.mounts[digest]
	return mt != nil && mt.refs > 0
}

// Recover rebuilds the Mounter's state after a daemon restart. inUse maps
// each digest still used by surviving sandboxes to its number of users.
// Mounts of those digests already under mntDir are adopted, missing ones are
// mounted, and every other mount and directory under mntDir is unmounted and
// removed. Call it before the first Acquire.
func (m *Mounter) Recover(inUse map[string]int) error {
	mounts, err := mountinfo.Read()
	if err != nil {
		return fmt.Errorf("recovering layer mounts: %w", err)
	}
	// Deepest and newest first, so stacked and nested mounts come off in
	// the right order.
	var stray []string
	adopted := make(map[string]bool)
	for i := len(mounts) - 1; i >= 0; i-- {
		mp := mounts[i].MountPoint
		rel, ok := strings.CutPrefix(mp, m.dir+"/")
		if !ok {
			continue
		}
		d := "sha256:" + rel
		if IsDigest(d) && inUse[d] > 0 && mounts[i].FSType == "erofs" {
			adopted[d] = true
			continue
		}
		stray = append(stray, mp)
	}
	sort.SliceStable(stray, func(i, j int) bool { return len(stray[i]) > len(stray[j]) })

	var errs []error
	for _, mp := range stray {
		if err := unmountAll(mp); err != nil {
			errs = append(errs, fmt.Errorf("reaping stray mount %s: %w", mp, err))
			continue
		}
		m.log.Info("reaped stray layer mount", "mountpoint", mp)
	}
	// Remove the directories of layers nobody uses; Rmdir (never
	// RemoveAll) so that a mount we failed to reap is never walked into.
	if entries, err := os.ReadDir(m.dir); err == nil {
		for _, e := range entries {
			d := "sha256:" + e.Name()
			if inUse[d] > 0 && IsDigest(d) {
				continue
			}
			if err := unix.Rmdir(filepath.Join(m.dir, e.Name())); err != nil && !errors.Is(err, unix.ENOENT) {
				errs = append(errs, fmt.Errorf("removing stray layer dir %s: %w", e.Name(), err))
			}
		}
	} else if !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, fmt.Errorf("recovering layer mounts: %w", err))
	}

	recovered := make(map[string]*erofsMount, len(inUse))
	for d, n := range inUse {
		if n <= 0 {
			continue
		}
		if !IsDigest(d) {
			errs = append(errs, errdefs.Invalid("recovering layer mounts: %q is not a digest", d))
			continue
		}
		if !adopted[d] {
			// Its sandboxes survived but the mount did not (the node
			// rebooted, or someone unmounted it): mount it again so that
			// refs > 0 always means mounted.
			if err := m.mount(d); err != nil {
				errs = append(errs, err)
				continue
			}
		} else if m.src != nil {
			// What the source opened for the previous daemon (a pulled
			// image, a registration) is given back when the last
			// reference goes, as for a mount made now.
			if _, release, err := m.src.Open(context.Background(), d); err != nil {
				m.log.Warn("reopening an adopted layer's image at its source; it is kept until the node next uses it", "digest", d, "err", err)
			} else {
				m.mu.Lock()
				m.releases[d] = release
				m.mu.Unlock()
			}
		}
		done := make(chan struct{})
		close(done)
		recovered[d] = &erofsMount{refs: n, done: done}
	}
	m.mu.Lock()
	for d, mt := range recovered {
		m.mounts[d] = mt
	}
	m.mu.Unlock()
	m.log.Info("recovered layer mounts", "adopted", len(adopted), "reaped", len(stray), "in_use", len(recovered))
	return errors.Join(errs...)
}

// unmountAll unmounts everything stacked at target. A busy mount is
// detached (MNT_DETACH): it leaves the namespace now and goes away when its
// last user does, which is what a caller tearing down wants. Not being
// mounted is not an error.
func unmountAll(target string) error {
	for range 16 {
		err := unix.Unmount(target, unix.UMOUNT_NOFOLLOW)
		if errors.Is(err, unix.EBUSY) {
			err = unix.Unmount(target, unix.MNT_DETACH|unix.UMOUNT_NOFOLLOW)
		}
		switch {
		case errors.Is(err, unix.EINVAL), errors.Is(err, unix.ENOENT), errors.Is(err, unix.EPERM):
			// Not a mountpoint (any more), or gone; or not ours to
			// unmount (no CAP_SYS_ADMIN), which is only an error if
			// something is mounted there.
			mounted, merr := isMountRoot(target)
			if merr != nil {
				return merr
			}
			if mounted {
				return fmt.Errorf("umount %s: %w", target, err)
			}
			return nil
		case err != nil:
			return fmt.Errorf("umount %s: %w", target, err)
		}
	}
	return fmt.Errorf("umount %s: still mounted after 16 unmounts", target)
}
