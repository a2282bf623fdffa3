package host

import (
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// The run dir, <state>/runtime, holds what every create writes and every
// delete removes: the OCI runtime's per-container state (<runtime>/<id>)
// and the bundles the runtime starts from (bundles/<id>, removed once the
// sandbox runs). dsec keeps it on a tmpfs, as runtimes do with /run: on
// the reference machine's ext4 (mounted with discard) removing those few
// small files cost ~2 ms per delete, and in a burst of 1,000 deletes
// moving them to tmpfs took teardown from ~195 to ~255 per second.
//
// Sandboxes must outlive a restart of dsec, so the tmpfs is unmounted only
// when no container state is left in it, and a run dir that still holds
// state on disk (written by a dsec before this one) stays on disk until a
// start finds it empty.

// runDirSize bounds the run dir's tmpfs: the runtime's state is ~12 KiB
// per sandbox (config, seccomp program, status, a page each).
func runDirSize(maxSandboxes int) int64 {
	return max(256<<20, int64(maxSandboxes)*64<<10)
}

// mountRunDir mounts a tmpfs at dir unless dir is on a tmpfs already or
// holds files (state of sandboxes from an earlier run, which must stay
// where the runtime finds them). It reports whether a tmpfs is mounted at
// dir itself, which unmountRunDir may then unmount.
func mountRunDir(dir string, size int64, log *slog.Logger) (bool, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return false, fmt.Errorf("creating %s: %w", dir, err)
	}
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return false, fmt.Errorf("statfs %s: %w", dir, err)
	}
	if st.Type == unix.TMPFS_MAGIC {
		// Left mounted by a run that stopped with sandboxes alive, or
		// the whole state dir is on a tmpfs (nothing to mount then).
		return isMountPoint(dir), nil
	}
	if holdsFiles(dir) {
		log.Info("runtime state stays on disk: sandboxes of an earlier dsec keep theirs there; a start that finds it empty moves it to a tmpfs", "dir", dir)
		return false, nil
	}
	opts := fmt.Sprintf("mode=0700,size=%d", size)
	if err := unix.Mount("tmpfs", dir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, opts); err != nil {
		log.Warn("runtime state stays on disk: mounting a tmpfs failed", "dir", dir, "err", err)
		return false, nil
	}
	return true, nil
}

// unmountRunDir unmounts the run dir's tmpfs when the runtime keeps no
// container's state in it, so a stopped instance leaves no mount behind.
// With sandboxes left it stays for the next start to recover them.
func unmountRunDir(dir, runtimeRoot string, log *slog.Logger) {
	ents, err := os.ReadDir(runtimeRoot)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		log.Warn("keeping the runtime state tmpfs", "dir", dir, "err", err)
		return
	}
	if len(ents) > 0 {
		return
	}
	if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
		log.Warn("unmounting the runtime state tmpfs", "dir", dir, "err", err)
	}
}

// isMountPoint reports whether dir is the root of a mount (its device
// differs from its parent's).
func isMountPoint(dir string) bool {
	var a, b unix.Stat_t
	if unix.Stat(dir, &a) != nil || unix.Stat(filepath.Dir(dir), &b) != nil {
		return false
	}
	return a.Dev != b.Dev
}

// holdsFiles reports whether the tree at dir has anything but directories.
func holdsFiles(dir string) bool {
	found := false
	_ = filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err != nil || !d.IsDir() {
			found = true
			return filepath.SkipAll
		}
		return nil
	})
	return found
}
