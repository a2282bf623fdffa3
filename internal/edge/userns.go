package edge

import (
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/layer"
	"github.com/dsecproject/dsec/internal/sandbox"
)

// User-namespace mode (spec.userns): the sandbox runs in a user namespace
// in which IDs 0..UserNSSize-1 are host IDs Config.UserNSBase.., so root
// inside is an unprivileged uid on the host, holding no capability over
// anything outside its namespaces.
//
// Its root filesystem must show files with those host IDs:
//   - each read-only layer is seen through an idmapped mount of the node's
//     shared EROFS mount (<dir>/lower/<i>), so a file owned by k in the
//     image appears owned by base+k; the images are unchanged;
//   - the upper dir is owned by base, and what the sandbox writes lands on
//     disk with host IDs (base+k): overlayfs cannot use an idmapped upper
//     when it is mounted from the host namespace (it creates its work
//     dirs as host root, which the mapping cannot represent);
//   - the files API chowns what it creates to base;
//   - a snapshot copies the upper and shifts its IDs back (base+k → k)
//     before packing, so snapshot layers look like any other layer.
//
// Each user-namespace sandbox whose backend allows it
// (sandbox.IDRangePerSandbox) has an ID range of its own, tied to its
// owner: the owner base+UserNSSize+slot maps the sandbox's IDs to
// base+2*UserNSSize+slot*UserNSSize.., so the counts the kernel keeps per
// host uid (epoll watches, pipe buffer pages, fds in flight over unix
// sockets) are not shared between sandboxes either, and a process that
// got out of one sandbox's namespaces would own none of another's files.
// The others (a runtime joins the namespace before it reaches the
// rootfs) share the node's one range at base, and the state directory
// is opened to its group (prepareUserNSDirs); so do sandboxes whose
// owner's range would pass 2^32-1 (a high --userns-base).

// UserNSSize is how many IDs a user-namespace sandbox has.
const UserNSSize = 65536

// Each user-namespace sandbox's namespace is made by a host uid of its own
// (its owner, sandbox.IDMap.Owner), taken from the UserNSSize uids right
// after the mapped range: UserNSBase+UserNSSize+slot. The kernel charges
// the per-user counts of a namespace's processes (inotify instances,
// pending signals, message queues, processes) at the host's level to the
// namespace's owner, so sandboxes do not share them with host root or
// with each other. UserNSReserved is how many host IDs from UserNSBase
// the node uses. Several edges on one host with the same base share the
// owners' range, and may give two sandboxes the same owner.
const UserNSReserved = 2 * UserNSSize

// takeOwnerLocked takes a free owner uid for a new sandbox (e.mu held). The
// search starts after the last one taken, so a freed uid is not given
// again at once.
func (e *Edge) takeOwnerLocked() (uint32, error) {
	for i := uint32(0); i < UserNSSize; i++ {
		slot := (e.ownerNext + i) % UserNSSize
		o := e.cfg.UserNSBase + UserNSSize + slot
		if !e.owners[o] {
			e.holdOwnerLocked(o)
			e.ownerNext = slot + 1
			return o, nil
		}
	}
	return 0, errdefs.Exhausted("node %s has no free user-namespace owner uid (%d user-namespace sandboxes)", e.cfg.Name, len(e.owners))
}

// holdOwnerLocked marks owner taken (e.mu held).
func (e *Edge) holdOwnerLocked(owner uint32) {
	if e.owners == nil {
		e.owners = map[uint32]bool{}
	}
	e.owners[owner] = true
}

// The OCI runtime sets up a user-namespace sandbox's mounts as the
// sandbox's root, so that uid must be able to reach the rootfs: every
// directory above it must be searchable by it. The edge makes its own
// directories (the state dir, sandboxes/, each sandbox's dir) root-owned
// with group base and mode 0710: searchable by that group only, listable by
// nobody but root. Directories above the state dir must be searchable by
// others (as /var/lib is); if one is not, user-namespace sandboxes are
// refused with the reason.

// prepareUserNSDirs opens the edge's directories to the mapped group, or
// returns why user-namespace sandboxes cannot work under this state dir.
func prepareUserNSDirs(stateDir string, base uint32) error {
	abs, err := filepath.Abs(stateDir)
	if err != nil {
		return err
	}
	for _, d := range []string{filepath.Dir(abs), abs, filepath.Join(abs, "sandboxes")} {
		if err := groupSearchable(d, base); err != nil {
			return err
		}
	}
	for p := filepath.Dir(filepath.Dir(abs)); ; p = filepath.Dir(p) {
		var st unix.Stat_t
		if err := unix.Stat(p, &st); err != nil {
			return err
		}
		if st.Mode&0o001 == 0 {
			return fmt.Errorf("%s is not searchable by other users (mode %o), so a sandbox's root cannot reach its rootfs below it; chmod o+x it or move the state dir", p, st.Mode&0o777)
		}
		if p == "/" {
			return nil
		}
	}
}

// groupSearchable makes the root-owned directory d mode 0710 with group gid.
func groupSearchable(d string, gid uint32) error {
	if err := os.Chown(d, 0, int(gid)); err != nil {
		return fmt.Errorf("opening %s to user-namespace sandboxes: %w", d, err)
	}
	if err := os.Chmod(d, 0o710); err != nil {
		return fmt.Errorf("opening %s to user-namespace sandboxes: %w", d, err)
	}
	return nil
}

// userNSMap is the node's shared range.
func (e *Edge) userNSMap() layer.IDMap {
	return layer.IDMap{HostID: e.cfg.UserNSBase, Size: UserNSSize}
}

// userNSMapOf is the range of the sandbox of rec.
func (e *Edge) userNSMapOf(rec *record) layer.IDMap {
	if rec.UserNSHost != 0 {
		return layer.IDMap{HostID: rec.UserNSHost, Size: UserNSSize}
	}
	return e.userNSMap()
}

// rangeOf returns the first host ID of owner's own range, or 0 where it
// would pass 2^32-1.
func (e *Edge) rangeOf(owner uint32) uint32 {
	slot := uint64(owner) - uint64(e.cfg.UserNSBase) - UserNSSize
	first := uint64(e.cfg.UserNSBase) + 2*UserNSSize + slot*UserNSSize
	if first+UserNSSize-1 > 1<<32-2 { // 2^32-1 is no ID
		return 0
	}
	return uint32(first)
}

// idmapNSFor returns a namespace with the mapping of rec's sandbox for
// idmapped views of its layers, and what to call once they are made (the
// mounts hold the namespace from then on).
func (e *Edge) idmapNSFor(rec *record) (*os.File, func(), error) {
	if rec.UserNSHost == 0 {
		ns, err := e.idmapNS()
		return ns, func() {}, err
	}
	ns, err := layer.NewIDMapNS(e.userNSMapOf(rec))
	if err != nil {
		return nil, nil, err
	}
	return ns, func() { ns.Close() }, nil
}

// normalize is sandbox.Normalize with the node's choice of spec.UserNS
// where the spec leaves it out: a user namespace where the sandbox's
// backend makes one by default and the node can run one.
func (e *Edge) normalize(spec *api.SandboxSpec) error {
	if err := sandbox.Normalize(spec, e.cfg.Policy); err != nil {
		return err
	}
	if spec.UserNS == nil {
		on := e.userNSByDefault(spec.Backend)
		spec.UserNS = &on
	}
	// Not for a backend that makes its rootfs from the layer images (a
	// VM): its writable disk is a file of a fixed size already, which a
	// host disk under it would only make a VM that stops when it fills.
	if spec.DiskMB == 0 && e.cfg.DefaultDiskMB > 0 && !takesImages(e.backend(spec.Backend)) {
		spec.DiskMB = min(e.cfg.DefaultDiskMB, e.cfg.Policy.MaxDiskMB)
	}
	return nil
}

// userNSByDefault reports whether a sandbox of backend gets a user
// namespace when its spec does not say.
func (e *Edge) userNSByDefault(backend string) bool {
	if !e.cfg.UserNSDefault {
		return false
	}
	be := e.backend(backend)
	d, ok := be.(sandbox.UserNSDefault)
	return ok && d.UserNSByDefault() && e.checkUserNS(be, true) == nil
}

// checkUserNS refuses userns on a node without it.
func (e *Edge) checkUserNS(be sandbox.Backend, want bool) error {
	if !want {
		return nil
	}
	if e.cfg.UserNSBase == 0 {
		return errdefs.Precondition("node %s does not run user-namespace sandboxes (dsec up --userns-base 0); omit userns", e.cfg.Name)
	}
	if takesImages(be) {
		return errdefs.Precondition("node %s's %s backend makes its sandboxes' root filesystems itself: userns (idmapped layers over the host's overlay) does not apply; omit it", e.cfg.Name, be.Name())
	}
	if _, own := be.(sandbox.InnerSignaler); own {
		return errdefs.Precondition("the %s backend runs sandboxes on a kernel of its own, whose root is not the host's: userns does not apply; omit it", be.Name())
	}
	if e.usernsBroken != nil {
		return errdefs.Precondition("node %s cannot run user-namespace sandboxes: %v", e.cfg.Name, e.usernsBroken)
	}
	return nil
}

// idmapNS returns the node's id-mapping namespace, creating it once.
func (e *Edge) idmapNS() (*os.File, error) {
	e.idmapMu.Lock()
	defer e.idmapMu.Unlock()
	if e.idmap != nil {
		return e.idmap, nil
	}
	f, err := layer.NewIDMapNS(e.userNSMap())
	if err != nil {
		return nil, err
	}
	e.idmap = f
	return f, nil
}

// detachedUserNSRootfs makes a user-namespace sandbox's overlay as a
// detached mount on detached idmapped views of the layer mounts mps: no
// mount of the sandbox's is on the host at all (with host mounts, each of
// a node's sandboxes would add one per layer to the host's mount table).
// It returns nil where the backend takes no detached rootfs or the kernel
// refuses (then, once, it says why and the caller mounts the views on the
// host, idmapLowers).
func (e *Edge) detachedUserNSRootfs(be sandbox.Backend, ns *os.File, mps []string, upper, work string) (*os.File, error) {
	if b, ok := be.(sandbox.DetachedRootfs); !ok || !b.TakesDetachedRootfs() || e.noDetached.Load() || e.noDetachedLowers.Load() {
		return nil, nil
	}
	views := make([]*os.File, 0, len(mps))
	defer func() {
		for _, v := range views {
			v.Close()
		}
	}()
	lowers := make([]string, len(mps))
	for i, mp := range mps {
		v, err := layer.IDMapClone(mp, ns)
		if err != nil {
			return nil, err
		}
		views = append(views, v)
		lowers[i] = "/proc/self/fd/" + strconv.Itoa(int(v.Fd()))
	}
	mnt, err := layer.DetachedOverlay(lowers, upper, work)
	if err != nil {
		// A kernel before 6.15 takes no detached mount as a layer; one
		// before 6.8 builds no detached overlay at all.
		if !e.noDetachedLowers.Swap(true) {
			e.log.Info("user-namespace sandboxes get their idmapped layers mounted on the host", "reason", err)
		}
		return nil, nil
	}
	return mnt, nil
}

// idmapLowers mounts idmapped views of the layer mounts mps at
// <dir>/lower/<i> and returns their paths.
func (e *Edge) idmapLowers(dir string, ns *os.File, mps []string) ([]string, error) {
	if err := os.MkdirAll(filepath.Join(dir, "lower"), 0o700); err != nil {
		return nil, fmt.Errorf("creating sandbox dir: %w", err)
	}
	out := make([]string, len(mps))
	for i, mp := range mps {
		p := filepath.Join(dir, "lower", strconv.Itoa(i))
		if err := os.Mkdir(p, 0o755); err != nil {
			return out, fmt.Errorf("creating sandbox dir: %w", err)
		}
		if err := layer.IDMapMount(mp, p, ns); err != nil {
			return out, err
		}
		out[i] = p
	}
	return out, nil
}

// unmountLowers unmounts whatever is mounted under <dir>/lower.
func unmountLowers(dir string) error {
	ents, err := os.ReadDir(filepath.Join(dir, "lower"))
	if err != nil {
		if os.IsNotExist(err) {
			return nil
		}
		return err
	}
	for _, ent := range ents {
		if err := layer.UnmountOverlay(filepath.Join(dir, "lower", ent.Name())); err != nil {
			return fmt.Errorf("unmounting idmapped layer: %w", err)
		}
	}
	return nil
}

// sandboxIDMap is the backend's view of the mapping of rec's sandbox.
func (e *Edge) sandboxIDMap(rec *record) *sandbox.IDMap {
	m := e.userNSMapOf(rec)
	return &sandbox.IDMap{HostID: m.HostID, Size: m.Size, Owner: rec.UserNSOwner}
}

// unshiftTree rewrites the owners of every entry under root from the
// sandbox's host IDs back to the IDs inside it (base+k → k). IDs outside
// the range (layers staged from snapshots, which are unshifted already)
// are left alone.
func unshiftTree(root string, m layer.IDMap) error {
	return filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return err
		}
		uid, gid := st.Uid, st.Gid
		if m.Contains(uid) {
			uid -= m.HostID
		}
		if m.Contains(gid) {
			gid -= m.HostID
		}
		if uid == st.Uid && gid == st.Gid {
			return nil
		}
		// lchown clears setuid/setgid bits and file capabilities: put
		// the mode back (not the capabilities: a snapshot of a userns
		// sandbox does not keep security.capability).
		if err := unix.Lchown(p, int(uid), int(gid)); err != nil {
			return fmt.Errorf("shifting owner of %s: %w", p, err)
		}
		if st.Mode&unix.S_IFMT != unix.S_IFLNK && st.Mode&(unix.S_ISUID|unix.S_ISGID) != 0 {
			if err := unix.Chmod(p, st.Mode&0o7777); err != nil {
				return fmt.Errorf("restoring mode of %s: %w", p, err)
			}
		}
		return nil
	})
}
