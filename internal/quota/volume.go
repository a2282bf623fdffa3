package quota

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/cleanup"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/mountinfo"
)

// Volume is a filesystem that enforces XFS project quotas, holding the
// directories given to Set. It is safe for concurrent use.
type Volume struct {
	dir    string // Options.Dir, cleaned and with symlinks resolved
	dev    uint64 // st_dev of the filesystem; Set refuses other filesystems
	source string // mount source (block device) for quotactl(2)
	useDev bool   // the kernel lacks quotactl_fd: name the fs by source
	loop   string // loop device this Volume mounted or adopted; "" for the operator's fs

	mu       sync.Mutex
	closed   bool
	reserved map[uint32]bool // IDs handed out by Allocate and not yet cleared
}

// Dir returns the data directory.
func (v *Volume) Dir() string { return v.dir }

// Device returns the block device the filesystem was mounted from.
func (v *Volume) Device() string { return v.source }

// Loop reports whether Close will unmount the volume and detach its loop
// device, which is the case when Prepare mounted the image or adopted a
// mount of it left by an earlier process.
func (v *Volume) Loop() bool { return v.loop != "" }

// Prepare readies opts.Dir for quota'd directories. If the directory is on
// an XFS filesystem mounted with prjquota it is used as it is. Otherwise, in
// ModeLoop, the image opts.Image is created (sparse, then mkfs.xfs) if it
// does not exist, attached to a loop device and mounted with prjquota at
// opts.Dir; a mount of that image already at opts.Dir (left by a daemon that
// was killed) is adopted rather than stacked on. When neither works the
// error is an errdefs precondition whose message tells the operator what to
// do.
func Prepare(opts Options) (*Volume, error) {
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(opts.Dir, 0o700); err != nil {
		return nil, fmt.Errorf("preparing quota volume: %w", err)
	}
	dir, err := filepath.EvalSymlinks(opts.Dir)
	if err != nil {
		return nil, fmt.Errorf("preparing quota volume: %w", err)
	}
	v, why := probe(dir)
	if why == nil {
		if opts.Mode == ModeLoop {
			if err := v.adopt(opts.Image); err != nil {
				return nil, fmt.Errorf("preparing quota volume: %w", err)
			}
		}
		return v, nil
	}
	if !errors.Is(why, errdefs.ErrPrecondition) {
		return nil, fmt.Errorf("preparing quota volume: %w", why)
	}
	if opts.Mode == ModeDirect {
		return nil, errdefs.Precondition("preparing quota volume: %v; mount an XFS filesystem with -o prjquota at %s, or use quota mode %q to have dsec mount an image file there", why, dir, ModeLoop)
	}
	if err := mountImage(dir, opts.Image, opts.ImageSize, "prjquota"); err != nil {
		return nil, errdefs.Precondition("preparing quota volume: %v, and cannot mount an image there: %v; or mount an XFS filesystem with -o prjquota at %s and use quota mode %q", why, err, dir, ModeDirect)
	}
	v, err = probe(dir)
	if err == nil {
		err = v.adopt(opts.Image)
	}
	if err != nil {
		unix.Unmount(dir, 0)
		return nil, fmt.Errorf("preparing quota volume: after mounting %s: %w", opts.Image, err)
	}
	return v, nil
}

// probe returns a Volume for dir if dir is on XFS with project quota
// accounting and enforcement on, or else a precondition error saying why
// not.
func probe(dir string) (*Volume, error) {
	var sfs unix.Statfs_t
	if err := unix.Statfs(dir, &sfs); err != nil {
		return nil, fmt.Errorf("probing %s: %w", dir, err)
	}
	if sfs.Type != unix.XFS_SUPER_MAGIC {
		return nil, errdefs.Precondition("%s is on %s, not XFS", dir, fsName(int64(sfs.Type)))
	}
	entries, err := mountinfo.Read()
	if err != nil {
		return nil, fmt.Errorf("probing %s: %w", dir, err)
	}
	m, ok := containingMount(entries, dir)
	if !ok {
		return nil, fmt.Errorf("probing %s: no mount holds it in /proc/self/mountinfo", dir)
	}
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		return nil, fmt.Errorf("probing %s: %w", dir, err)
	}
	v := &Volume{dir: dir, dev: st.Dev, source: m.Source, reserved: map[uint32]bool{}}
	var qs fsQuotaStat
	err = v.quotactl(-1, qXGetQStat, 0, unsafe.Pointer(&qs))
	if errors.Is(err, unix.ENOSYS) {
		v.useDev = true
		err = v.quotactl(-1, qXGetQStat, 0, unsafe.Pointer(&qs))
	}
	if err != nil {
		if errors.Is(err, unix.ENOSYS) && xfsQuotaBuiltIn() == no {
			return nil, errdefs.Precondition("the XFS at %s (holding %s) cannot enforce project quotas: this kernel was built without CONFIG_XFS_QUOTA", m.MountPoint, dir)
		}
		return nil, errdefs.Precondition("the XFS at %s (holding %s) answers no quota query: %v", m.MountPoint, dir, err)
	}
	if qs.Flags&fsQuotaPdqAcct == 0 || qs.Flags&fsQuotaPdqEnfd == 0 {
		return nil, errdefs.Precondition("the XFS at %s (holding %s) is mounted without prjquota, and XFS cannot turn quotas on by remounting", m.MountPoint, dir)
	}
	return v, nil
}

// containingMount returns the mount that holds path: the one with the
// longest mount point that is path or an ancestor of it, the last listed
// (topmost) one among equals. path must be clean, absolute and free of
// symlinks.
func containingMount(entries []mountinfo.Entry, path string) (mountinfo.Entry, bool) {
	var best mountinfo.Entry
	found := false
	for _, e := range entries {
		mp := e.MountPoint
		if mp != path && mp != "/" && !strings.HasPrefix(path, mp+"/") {
			continue
		}
		if !found || len(mp) >= len(best.MountPoint) {
			best, found = e, true
		}
	}
	return best, found
}

// adopt marks v as owning its mount if it is a mount of image at v.dir
// through a loop device, so that Close unmounts it.
func (v *Volume) adopt(image string) error {
	entries, err := mountinfo.Read()
	if err != nil {
		return err
	}
	m, ok := containingMount(entries, v.dir)
	if !ok || m.MountPoint != v.dir || !strings.HasPrefix(m.Source, "/dev/loop") {
		return nil // the operator's filesystem
	}
	var img unix.Stat_t
	if err := unix.Stat(image, &img); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil
		}
		return fmt.Errorf("checking image %s: %w", image, err)
	}
	same, err := loopBacks(m.Source, &img)
	if err != nil {
		return err
	}
	if same {
		v.loop = m.Source
	}
	return nil
}

// loopBacks reports whether loop device dev is bound to the file img
// describes. Device and inode numbers are compared rather than paths, which
// the kernel records as they were spelled at attach time.
func loopBacks(dev string, img *unix.Stat_t) (bool, error) {
	fd, err := unix.Open(dev, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return false, fmt.Errorf("checking loop device %s: %w", dev, err)
	}
	defer unix.Close(fd)
	info, err := unix.IoctlLoopGetStatus64(fd)
	if errors.Is(err, unix.ENXIO) {
		return false, nil // not bound
	}
	if err != nil {
		return false, fmt.Errorf("checking loop device %s: %w", dev, err)
	}
	return info.Device == img.Dev && info.Inode == img.Ino, nil
}

// mountImage mounts image (creating and formatting it first if it does not
// exist) at dir with the given XFS mount options. A failure leaves no loop
// device, no mount and no image it created.
func mountImage(dir, image string, size uint64, options string) error {
	var undo cleanup.Stack
	defer undo.Run()

	entries, err := mountinfo.Read()
	if err != nil {
		return err
	}
	if m, ok := containingMount(entries, dir); ok && m.MountPoint == dir {
		return fmt.Errorf("%s is already a mount point (%s from %s); unmount it first", dir, m.FSType, m.Source)
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	if len(ents) > 0 {
		return fmt.Errorf("%s is not empty and mounting the image would hide %s; move its contents away", dir, ents[0].Name())
	}
	created, err := ensureImage(image, size)
	if err != nil {
		return err
	}
	if created {
		undo.Add(func() { os.Remove(image) })
	}
	loop, err := attachLoop(image)
	if err != nil {
		return err
	}
	// With autoclear the kernel detaches the device once nothing holds it:
	// when this file is closed if the mount fails, at unmount otherwise, and
	// at process death if we are killed in between.
	defer loop.Close()
	if err := unix.Mount(loop.Name(), dir, "xfs", 0, options); err != nil {
		if errors.Is(err, unix.EINVAL) && strings.Contains(options, "prjquota") && xfsQuotaBuiltIn() == no {
			return fmt.Errorf("mounting %s at %s with %s: %w: this kernel was built without CONFIG_XFS_QUOTA, so XFS cannot enforce project quotas", image, dir, options, err)
		}
		return fmt.Errorf("mounting %s (%s) at %s with %q: %w", loop.Name(), image, dir, options, err)
	}
	undo.Release()
	return nil
}

// ensureImage creates image as a formatted sparse XFS image of size bytes if
// it does not exist, and reports whether it did. It formats a temporary file
// and renames it into place, so an image that exists is always formatted
// even if an earlier attempt was killed half-way.
func ensureImage(image string, size uint64) (bool, error) {
	if _, err := os.Stat(image); err == nil {
		return false, nil
	} else if !errors.Is(err, os.ErrNotExist) {
		return false, fmt.Errorf("checking image: %w", err)
	}
	mkfs, err := exec.LookPath("mkfs.xfs")
	if err != nil {
		return false, fmt.Errorf("creating image %s: mkfs.xfs not found (install xfsprogs): %w", image, err)
	}
	if err := os.MkdirAll(filepath.Dir(image), 0o700); err != nil {
		return false, fmt.Errorf("creating image: %w", err)
	}
	tmp := image + ".tmp"
	var undo cleanup.Stack
	defer undo.Run()
	f, err := os.OpenFile(tmp, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return false, fmt.Errorf("creating image: %w", err)
	}
	undo.Add(func() { os.Remove(tmp) })
	err = f.Truncate(int64(size))
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return false, fmt.Errorf("creating image %s: %w", tmp, err)
	}
	if out, err := exec.Command(mkfs, "-q", tmp).CombinedOutput(); err != nil {
		return false, fmt.Errorf("formatting image %s: %w: %s", tmp, err, strings.TrimSpace(string(out)))
	}
	if err := os.Rename(tmp, image); err != nil {
		return false, fmt.Errorf("creating image: %w", err)
	}
	undo.Release()
	return true, nil
}

// attachLoop binds image to a free loop device and returns the open device.
//
// It uses LOOP_CTL_GET_FREE and LOOP_CONFIGURE (Linux 5.8) rather than
// `losetup --find --show`: no util-linux at run time and no output to parse,
// and LOOP_CONFIGURE binds the file and sets autoclear in one call, so there
// is no moment at which a crash would leave a bound device that nothing
// detaches. Another process can take the free device between the two calls;
// then LOOP_CONFIGURE fails with EBUSY and we ask again, as losetup does.
func attachLoop(image string) (*os.File, error) {
	img, err := os.OpenFile(image, os.O_RDWR, 0)
	if err != nil {
		return nil, fmt.Errorf("attaching loop device: %w", err)
	}
	defer img.Close() // the loop device holds its own reference
	ctl, err := os.OpenFile("/dev/loop-control", os.O_RDWR, 0)
	if err != nil {
		return nil, fmt.Errorf("attaching loop device: %w", err)
	}
	defer ctl.Close()
	for range 16 {
		n, err := unix.IoctlRetInt(int(ctl.Fd()), unix.LOOP_CTL_GET_FREE)
		if err != nil {
			return nil, fmt.Errorf("attaching loop device: finding a free one: %w", err)
		}
		dev, err := os.OpenFile(fmt.Sprintf("/dev/loop%d", n), os.O_RDWR, 0)
		if err != nil {
			return nil, fmt.Errorf("attaching loop device: %w", err)
		}
		cfg := unix.LoopConfig{Fd: uint32(img.Fd())}
		cfg.Info.Flags = unix.LO_FLAGS_AUTOCLEAR
		copy(cfg.Info.File_name[:len(cfg.Info.File_name)-1], image)
		err = unix.IoctlLoopConfigure(int(dev.Fd()), &cfg)
		if err == nil {
			return dev, nil
		}
		dev.Close()
		if !errors.Is(err, unix.EBUSY) {
			return nil, fmt.Errorf("attaching loop device: LOOP_CONFIGURE %s (needs Linux 5.8): %w", dev.Name(), err)
		}
	}
	return nil, fmt.Errorf("attaching loop device: every free device was taken before we could bind it")
}

// Close unmounts the volume and waits for its loop device to be detached if
// Prepare mounted it (or adopted its mount); it does nothing to an
// operator's filesystem. Every overlay whose upper is on the volume must be
// unmounted first, or Close fails and leaves the volume mounted. Close may
// be called more than once.
func (v *Volume) Close() error {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.closed {
		return nil
	}
	if v.loop == "" {
		v.closed = true
		return nil
	}
	if err := unix.Unmount(v.dir, 0); err != nil {
		if errors.Is(err, unix.EBUSY) {
			return errdefs.Precondition("unmounting quota volume %s: still in use (sandbox overlays mounted?): %v", v.dir, err)
		}
		return fmt.Errorf("unmounting quota volume %s: %w", v.dir, err)
	}
	v.closed = true
	// Autoclear detaches the device when the unmount drops the last
	// reference; wait for it so that callers can rely on it.
	backing := filepath.Join("/sys/block", filepath.Base(v.loop), "loop", "backing_file")
	for deadline := time.Now().Add(5 * time.Second); ; {
		if _, err := os.Stat(backing); errors.Is(err, os.ErrNotExist) {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("closing quota volume %s: loop device %s still attached (held open elsewhere)", v.dir, v.loop)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

type tristate int

const (
	unknown tristate = iota
	yes
	no
)

// xfsQuotaBuiltIn says whether the kernel's XFS has quota support: XFS
// creates /proc/fs/xfs/xqm only when built with CONFIG_XFS_QUOTA. Without
// it, a prjquota mount fails with a bare EINVAL (the reason goes to the
// kernel log only), so Prepare uses this to tell the operator why.
func xfsQuotaBuiltIn() tristate {
	if _, err := os.Stat("/proc/fs/xfs/xqm"); err == nil {
		return yes
	}
	if _, err := os.Stat("/proc/fs/xfs"); err == nil {
		return no
	}
	return unknown // XFS not loaded yet
}

// fsName names common filesystem magic numbers for error messages.
func fsName(magic int64) string {
	switch magic {
	case unix.EXT4_SUPER_MAGIC:
		return "ext4"
	case unix.TMPFS_MAGIC:
		return "tmpfs"
	case unix.BTRFS_SUPER_MAGIC:
		return "btrfs"
	case unix.OVERLAYFS_SUPER_MAGIC:
		return "overlay"
	case unix.XFS_SUPER_MAGIC:
		return "xfs"
	}
	return fmt.Sprintf("0x%x", magic)
}
