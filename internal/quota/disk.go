package quota

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/cleanup"
	"github.com/dsecproject/dsec/internal/layer"
)

// A per-sandbox disk is the fallback where no filesystem with project
// quotas is at hand (kernels built without CONFIG_XFS_QUOTA, hosts whose
// data disk is not XFS): the sandbox's upper and work directories live on
// an ext4 filesystem of its own, in a sparse image file attached to a loop
// device. The filesystem's size caps the bytes and its inode count caps the
// files; a full disk is ENOSPC inside the sandbox and touches nothing else.
// The image is sparse, so only what is written takes room on the host, and
// the loop device uses direct I/O where the host filesystem allows it, so
// data is cached once (in the sandbox's filesystem), not twice.

// MinDiskBytes is the smallest per-sandbox disk (ext4 needs some room for
// its own metadata).
const MinDiskBytes = 16 << 20

// DiskInodes is the inode count given to a disk of bytes: one per 16 KiB
// (mke2fs's default ratio), at least 4096.
func DiskInodes(bytes uint64) uint64 {
	return max(bytes/16384, 4096)
}

// CreateDisk creates a sparse image of bytes at image holding an empty ext4
// filesystem with inodes inodes, and mounts it at dir (an existing empty
// directory). With templates (a directory) the image is a sparse copy of a
// formatted one of that size kept there (made by the first disk of that
// size; see template), which costs a fraction of a millisecond where
// formatting cost 25-60 ms here; "" formats every one. On error nothing is
// left: no mount, no loop device, no image.
func CreateDisk(image, dir string, bytes, inodes uint64, templates string) error {
	if bytes < MinDiskBytes {
		return fmt.Errorf("creating disk: %d bytes is below the minimum of %d", bytes, MinDiskBytes)
	}
	var undo cleanup.Stack
	defer undo.Run()
	// Both ways create the image exclusively and remove what they made
	// if they fail: an image already there (someone else's) stays.
	copied := false
	if templates != "" {
		// Twice: a template another create evicted between its lookup
		// and its copy is made again. A copy that fails otherwise (a
		// filesystem without copy_file_range) falls back to formatting.
		for try := 0; try < 2 && !copied; try++ {
			tmpl, err := template(templates, bytes, inodes)
			if err != nil {
				return err
			}
			err = copySparse(tmpl, image)
			copied = err == nil
			if errors.Is(err, os.ErrExist) {
				return fmt.Errorf("creating disk image: %w", err)
			}
			if err != nil && !errors.Is(err, os.ErrNotExist) {
				break
			}
		}
	}
	if !copied {
		if err := format(image, bytes, inodes); err != nil {
			return err
		}
	}
	undo.Add(func() { os.Remove(image) })
	loop, err := attachLoopDirect(image)
	if err != nil {
		return err
	}
	// Autoclear detaches the device at unmount (or now, if mount fails).
	defer loop.Close()
	if err := unix.Mount(loop.Name(), dir, "ext4", unix.MS_NOATIME, ""); err != nil {
		return fmt.Errorf("mounting disk %s at %s: %w", loop.Name(), dir, err)
	}
	undo.Release()
	return nil
}

// format creates a sparse image of bytes at image (which must not exist)
// and formats it as ext4 with inodes inodes.
func format(image string, bytes, inodes uint64) error {
	mkfs, err := exec.LookPath("mkfs.ext4")
	if err != nil {
		return fmt.Errorf("creating disk: mkfs.ext4 not found (apt-get install e2fsprogs): %w", err)
	}
	f, err := os.OpenFile(image, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("creating disk: %w", err)
	}
	err = f.Truncate(int64(bytes))
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(image)
		return fmt.Errorf("creating disk image: %w", err)
	}
	// No journal: a sandbox's processes do not survive a host crash, so
	// neither needs its scratch filesystem; without one, formatting is a
	// few milliseconds and a small disk keeps its room. No reserved blocks:
	// the sandbox gets all of what it asked for.
	args := []string{"-q", "-F", "-t", "ext4", "-m", "0", "-N", strconv.FormatUint(inodes, 10),
		"-O", "^has_journal", "-E", "nodiscard,root_owner=0:0", image}
	if out, err := exec.Command(mkfs, args...).CombinedOutput(); err != nil {
		os.Remove(image)
		return fmt.Errorf("formatting disk image: %w: %s", err, strings.TrimSpace(string(out)))
	}
	return nil
}

// maxTemplates bounds the formatted images kept (one per size asked for):
// past it the least recently used go.
const maxTemplates = 16

var templateMu sync.Mutex

// template returns the formatted image of bytes and inodes in dir, made
// (atomically: formatted under a temporary name) if it is not there. Its
// mtime is its last use.
func template(dir string, bytes, inodes uint64) (string, error) {
	name := filepath.Join(dir, fmt.Sprintf("ext4-%d-%d.img", bytes, inodes))
	now := time.Now()
	if os.Chtimes(name, now, now) == nil {
		return name, nil
	}
	templateMu.Lock()
	defer templateMu.Unlock()
	if os.Chtimes(name, now, now) == nil {
		return name, nil
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", fmt.Errorf("creating disk templates: %w", err)
	}
	tmp := name + ".tmp"
	os.Remove(tmp)
	if err := format(tmp, bytes, inodes); err != nil {
		return "", err
	}
	if err := os.Rename(tmp, name); err != nil {
		os.Remove(tmp)
		return "", fmt.Errorf("creating disk template: %w", err)
	}
	// Past the bound, the least recently used others go (a disk being
	// copied from one keeps its own descriptor; the next of that size
	// formats it again).
	if ents, _ := filepath.Glob(filepath.Join(dir, "ext4-*.img")); len(ents) > maxTemplates {
		type aged struct {
			path string
			t    time.Time
		}
		var all []aged
		for _, p := range ents {
			if fi, err := os.Stat(p); err == nil && p != name {
				all = append(all, aged{p, fi.ModTime()})
			}
		}
		slices.SortFunc(all, func(a, b aged) int { return a.t.Compare(b.t) })
		for _, a := range all[:max(0, len(all)-(maxTemplates-1))] {
			os.Remove(a.path)
		}
	}
	return name, nil
}

// copySparse copies src to dst (which must not exist) extent by extent:
// holes stay holes, and the data is copied in the kernel. On error a dst
// it made is removed.
func copySparse(src, dst string) (err error) {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	fi, err := in.Stat()
	if err != nil {
		return err
	}
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	defer func() {
		out.Close()
		if err != nil {
			os.Remove(dst)
		}
	}()
	size := fi.Size()
	if err := out.Truncate(size); err != nil {
		return err
	}
	for off := int64(0); off < size; {
		data, err := unix.Seek(int(in.Fd()), off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break // only a hole is left
		}
		if err != nil {
			return err
		}
		hole, err := unix.Seek(int(in.Fd()), data, unix.SEEK_HOLE)
		if err != nil {
			return err
		}
		for roff, woff := data, data; roff < hole; {
			n, err := unix.CopyFileRange(int(in.Fd()), &roff, int(out.Fd()), &woff, int(hole-roff), 0)
			if err != nil {
				return err
			}
			if n == 0 {
				return fmt.Errorf("copying %s: short copy at %d", src, roff)
			}
		}
		off = hole
	}
	return out.Close()
}

// RemoveDisk unmounts a disk (its loop device then detaches itself) and
// deletes its image. Both steps tolerate what is already gone.
func RemoveDisk(image, dir string) error {
	if err := layer.UnmountOverlay(dir); err != nil { // any mount type
		return fmt.Errorf("unmounting disk: %w", err)
	}
	if err := os.Remove(image); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("removing disk image: %w", err)
	}
	return nil
}

// DiskUsage reports what is used of the filesystem mounted at dir.
func DiskUsage(dir string) (Usage, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return Usage{}, fmt.Errorf("reading disk usage: %w", err)
	}
	bs := uint64(st.Bsize)
	return Usage{
		Bytes: (st.Blocks - st.Bfree) * bs, ByteLimit: st.Blocks * bs,
		Inodes: st.Files - st.Ffree, InodeLimit: st.Files,
	}, nil
}

// attachLoopDirect is attachLoop with direct I/O turned on afterwards when
// the backing filesystem supports it (it is an optimisation: the disk works
// without it).
func attachLoopDirect(image string) (*os.File, error) {
	dev, err := attachLoop(image)
	if err != nil {
		return nil, err
	}
	_ = unix.IoctlSetInt(int(dev.Fd()), unix.LOOP_SET_DIRECT_IO, 1)
	return dev, nil
}
