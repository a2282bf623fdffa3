package layer

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// Overlay options, the same for every sandbox:
//
//   - index=off: the inode index only serves hard-link copy-up and NFS
//     export, and with it on an upper becomes bound to the exact lower
//     stack it was first used with, which would stop pack_diff/fork from
//     reusing an upper over a rebuilt stack.
//   - redirect_dir=off, metacopy=off: an upper then describes its changes
//     with plain files, whiteouts and opaque dirs only, never with pointers
//     back into a lower, so it can be packed into a snapshot layer on its
//     own. (Renaming a lower directory returns EXDEV and mv falls back to
//     copying, as under Docker's overlay2 on most distribution kernels.)
//   - xino=auto: with lowers on several EROFS filesystems, it makes st_dev
//     the same for every file and st_ino unique, which tools such as find
//     -xdev, du -x and tar rely on; the kernel falls back silently when
//     inode numbers are too wide.
var overlayOptions = [][2]string{
	{"index", "off"},
	{"redirect_dir", "off"},
	{"metacopy", "off"},
	{"xino", "auto"},
}

// MountOverlay mounts at target an overlay of lowers (topmost first) under
// the writable upper, with work as overlayfs's scratch directory (same
// filesystem as upper). Upper layers win on lookups, writes go to upper
// only, and the lowers are never modified.
//
// It uses the new mount API, giving each lower with its own "lowerdir+"
// call, so that neither the number of layers nor the length of their paths
// is limited by mount(2)'s single 4 KiB option page. On kernels without
// fsopen or "lowerdir+" (before 6.8) it falls back to mount(2).
func MountOverlay(lowers []string, upper, work, target string) error {
	if err := checkOverlayPaths(lowers, upper, work, target); err != nil {
		return err
	}
	if fi, err := os.Stat(target); err != nil || !fi.IsDir() {
		return errdefs.Invalid("mounting overlay: target %s is not a directory", target)
	}
	err := mountOverlayNew(lowers, upper, work, target)
	if errors.Is(err, errNoNewMountAPI) {
		err = mountOverlayLegacy(lowers, upper, work, target)
	}
	if err != nil {
		return fmt.Errorf("mounting overlay at %s: %w", target, err)
	}
	return nil
}

var errNoNewMountAPI = errors.New("new mount API unavailable")

// checkOverlayPaths refuses an overlay without lowers or with a relative
// path among lowers and others.
func checkOverlayPaths(lowers []string, others ...string) error {
	if len(lowers) == 0 {
		return errdefs.Invalid("mounting overlay: no lower layers")
	}
	for _, p := range append(append([]string(nil), lowers...), others...) {
		if !filepath.IsAbs(p) {
			return errdefs.Invalid("mounting overlay: path %q is not absolute", p)
		}
	}
	return nil
}

func mountOverlayNew(lowers []string, upper, work, target string) error {
	mfd, err := newOverlayMount(lowers, upper, work)
	if err != nil {
		return err
	}
	defer mfd.Close()
	if err := unix.MoveMount(int(mfd.Fd()), "", unix.AT_FDCWD, target, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("move_mount: %w", err)
	}
	return nil
}

// DetachedOverlay builds the overlay MountOverlay would mount, but leaves
// it detached: the returned file is a mount that belongs to no mount
// namespace until someone attaches it with move_mount(2). A sandbox backend
// attaches it inside the sandbox's own mount namespace, so the host's mount
// table does not grow with every sandbox (every new mount namespace copies
// that table, and every read of mountinfo prints it). The mount goes away
// when the last namespace using it does and the file is closed.
//
// ErrNoDetachedMount means this kernel cannot (no fsopen or "lowerdir+",
// before 6.8); MountOverlay still works there.
func DetachedOverlay(lowers []string, upper, work string) (*os.File, error) {
	if err := checkOverlayPaths(lowers, upper, work); err != nil {
		return nil, err
	}
	f, err := newOverlayMount(lowers, upper, work)
	if errors.Is(err, errNoNewMountAPI) {
		return nil, ErrNoDetachedMount
	}
	if err != nil {
		return nil, fmt.Errorf("mounting overlay: %w", err)
	}
	return f, nil
}

// ErrNoDetachedMount is DetachedOverlay's answer on kernels before 6.8.
var ErrNoDetachedMount = errors.New("this kernel cannot build a detached overlay mount (needs fsopen with lowerdir+, Linux 6.8)")

// newOverlayMount configures an overlay superblock with the new mount API
// and returns it as a detached mount.
func newOverlayMount(lowers []string, upper, work string) (*os.File, error) {
	fd, err := unix.Fsopen("overlay", unix.FSOPEN_CLOEXEC)
	if errors.Is(err, unix.ENOSYS) {
		return nil, errNoNewMountAPI
	}
	if err != nil {
		return nil, fmt.Errorf("fsopen overlay: %w", err)
	}
	defer unix.Close(fd)

	for i, l := range lowers {
		if err := unix.FsconfigSetString(fd, "lowerdir+", l); err != nil {
			msg := fsLog(fd)
			if i == 0 && errors.Is(err, unix.EINVAL) && strings.Contains(msg, "Unknown parameter") {
				// The key itself is unknown: a kernel before 6.8.
				return nil, errNoNewMountAPI
			}
			return nil, withLog(fmt.Errorf("lowerdir+ %s: %w", l, err), msg)
		}
	}
	config := [][2]string{{"upperdir", upper}, {"workdir", work}}
	for _, kv := range append(config, overlayOptions...) {
		if err := unix.FsconfigSetString(fd, kv[0], kv[1]); err != nil {
			return nil, fsError(fd, kv[0]+"="+kv[1], err)
		}
	}
	if err := unix.FsconfigCreate(fd); err != nil {
		return nil, fsError(fd, "creating superblock", err)
	}
	mfd, err := unix.Fsmount(fd, unix.FSMOUNT_CLOEXEC, 0)
	if err != nil {
		return nil, fsError(fd, "fsmount", err)
	}
	return os.NewFile(uintptr(mfd), "overlay"), nil
}

// fsLog drains the messages the kernel queued on a filesystem context.
func fsLog(fd int) string {
	var msgs []string
	buf := make([]byte, 1024)
	for range 32 {
		n, err := unix.Read(fd, buf)
		if err != nil || n <= 0 {
			break
		}
		msgs = append(msgs, strings.TrimSpace(string(buf[:n])))
	}
	return strings.Join(msgs, "; ")
}

// fsError adds the kernel's explanation, which is usually much better than
// the errno alone (e.g. "overlayfs: workdir and upperdir must be separate
// subtrees").
func fsError(fd int, step string, err error) error {
	return withLog(fmt.Errorf("%s: %w", step, err), fsLog(fd))
}

func withLog(err error, msg string) error {
	if msg == "" {
		return err
	}
	return fmt.Errorf("%w (%s)", err, msg)
}

func mountOverlayLegacy(lowers []string, upper, work, target string) error {
	for _, p := range append(append([]string(nil), lowers...), upper, work) {
		if strings.ContainsAny(p, ",:\\") {
			return errdefs.Invalid("path %q contains a character mount(2) options cannot carry", p)
		}
	}
	opts := []string{"lowerdir=" + strings.Join(lowers, ":"), "upperdir=" + upper, "workdir=" + work}
	for _, kv := range overlayOptions {
		opts = append(opts, kv[0]+"="+kv[1])
	}
	data := strings.Join(opts, ",")
	if len(data) >= os.Getpagesize() {
		return errdefs.Invalid("%d lower layers need %d bytes of mount options; this kernel takes at most %d (it lacks fsopen lowerdir+)",
			len(lowers), len(data), os.Getpagesize()-1)
	}
	if err := unix.Mount("overlay", target, "overlay", 0, data); err != nil {
		return fmt.Errorf("mount -t overlay: %w", err)
	}
	return nil
}

// UnmountOverlay unmounts the overlay at target, detaching it if it is busy
// (a process still has its cwd or a file there), and verifies that target is
// no longer a mountpoint. Unmounting a target that is not mounted succeeds.
func UnmountOverlay(target string) error {
	if err := unmountAll(target); err != nil {
		return fmt.Errorf("unmounting overlay: %w", err)
	}
	return nil
}
