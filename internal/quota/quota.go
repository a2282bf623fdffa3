// Package quota owns the disk limits of sandbox writable layers, in two
// ways. The one the edge uses (disk.go): a sandbox's overlayfs upper and
// work directories live on an ext4 filesystem of its own, a sparse image on
// a loop device, whose size and inode count are the limits. The other, for
// hosts whose kernel has XFS quotas (this project's CI kernel does not, so
// the edge does not use it yet): each sandbox's directories live under one
// directory that carries an XFS project ID, and the project's hard limits
// cap the bytes and inodes the sandbox can write, as Docker's overlay2
// "size=" option does.
//
// It owns the data volume those directories live on (Prepare/Close): either
// an XFS filesystem the operator mounted with prjquota, or a sparse image
// file that the package formats, attaches to a loop device and mounts at the
// data directory. The pure parts (options, sizes, project ID derivation,
// block arithmetic) do no I/O; everything else needs root.
//
// Importers: edge (which creates and deletes sandboxes) and cmd/dsec (which
// parses the operator's options).
package quota

import (
	"fmt"
	"hash/fnv"
	"math"
	"math/bits"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// Mode says how Prepare may obtain a filesystem with project quotas.
type Mode string

const (
	// ModeDirect uses the data directory only if it already sits on an XFS
	// filesystem mounted with prjquota (or pquota).
	ModeDirect Mode = "direct"
	// ModeLoop does what ModeDirect does when it can, and otherwise mounts
	// an XFS image file (created sparse and formatted on first use) at the
	// data directory through a loop device.
	ModeLoop Mode = "loop"
)

// ParseMode parses an operator-supplied mode name.
func ParseMode(s string) (Mode, error) {
	switch m := Mode(strings.TrimSpace(s)); m {
	case ModeDirect, ModeLoop:
		return m, nil
	}
	return "", errdefs.Invalid("parsing quota mode %q: want %q or %q", s, ModeDirect, ModeLoop)
}

// MinImageSize is the smallest image ModeLoop formats: mkfs.xfs (xfsprogs
// 5.19 and later) refuses filesystems below 300 MiB.
const MinImageSize = 300 << 20

// Options configures Prepare.
type Options struct {
	// Dir is the absolute path under which the quota'd directories will be
	// created. In ModeLoop it is also the mount point of the image.
	Dir string
	// Mode is ModeDirect or ModeLoop.
	Mode Mode
	// Image is the absolute path of the XFS image file. It must not be under
	// Dir. ModeDirect ignores it and ImageSize.
	Image string
	// ImageSize is the apparent size in bytes of the image when Prepare
	// creates it; the file is sparse, so this is a ceiling, not an
	// allocation. An existing image is used at whatever size it has.
	ImageSize uint64
}

// Validate checks o without touching the filesystem.
func (o Options) Validate() error {
	if o.Dir == "" || !filepath.IsAbs(o.Dir) {
		return errdefs.Invalid("quota options: data directory %q is not an absolute path", o.Dir)
	}
	switch o.Mode {
	case ModeDirect:
		return nil // Image and ImageSize are ignored.
	case ModeLoop:
	default:
		return errdefs.Invalid("quota options: unknown mode %q", o.Mode)
	}
	if o.Image == "" || !filepath.IsAbs(o.Image) {
		return errdefs.Invalid("quota options: image %q is not an absolute path", o.Image)
	}
	dir, img := filepath.Clean(o.Dir), filepath.Clean(o.Image)
	if img == dir || strings.HasPrefix(img, dir+"/") || dir == "/" {
		return errdefs.Invalid("quota options: image %s would be hidden by its own mount at %s", o.Image, o.Dir)
	}
	if o.ImageSize < MinImageSize {
		return errdefs.Invalid("quota options: image size %d is below the %d bytes mkfs.xfs accepts", o.ImageSize, MinImageSize)
	}
	return nil
}

// ParseSize parses a byte count such as "64G", "512MiB", "10gb" or "4096".
// Every suffix is binary (k = 1024), as in Docker's size= option; a bare
// number is bytes.
func ParseSize(s string) (uint64, error) {
	t := strings.ToLower(strings.TrimSpace(s))
	i := strings.IndexFunc(t, func(r rune) bool { return r < '0' || r > '9' })
	num, unit := t, ""
	if i >= 0 {
		num, unit = t[:i], strings.TrimSpace(t[i:])
	}
	if num == "" {
		return 0, errdefs.Invalid("parsing size %q: no number", s)
	}
	n, err := strconv.ParseUint(num, 10, 64)
	if err != nil {
		return 0, errdefs.Invalid("parsing size %q: %v", s, err)
	}
	shift, ok := map[string]uint{
		"": 0, "b": 0,
		"k": 10, "kb": 10, "kib": 10,
		"m": 20, "mb": 20, "mib": 20,
		"g": 30, "gb": 30, "gib": 30,
		"t": 40, "tb": 40, "tib": 40,
		"p": 50, "pb": 50, "pib": 50,
	}[unit]
	if !ok {
		return 0, errdefs.Invalid("parsing size %q: unknown unit %q", s, unit)
	}
	if n > math.MaxUint64>>shift {
		return 0, errdefs.Invalid("parsing size %q: too large", s)
	}
	return n << shift, nil
}

// basicBlockSize is the unit of fs_disk_quota's block fields (XFS "BB").
const basicBlockSize = 512

// basicBlocks converts a byte limit to basic blocks, rounding up so the
// limit is never below what was asked for.
func basicBlocks(bytes uint64) uint64 {
	bb := bytes / basicBlockSize
	if bytes%basicBlockSize != 0 {
		bb++
	}
	return bb
}

// bytesOf converts basic blocks to bytes, saturating instead of wrapping.
func bytesOf(bb uint64) uint64 {
	hi, lo := bits.Mul64(bb, basicBlockSize)
	if hi != 0 {
		return math.MaxUint64
	}
	return lo
}

// Project IDs derived from sandbox IDs fall in [MinDerivedID, MaxDerivedID].
// The range stays clear of small IDs an operator may use in /etc/projects
// and below 1<<31, where some tools treat IDs as signed.
const (
	MinDerivedID uint32 = 1 << 20
	MaxDerivedID uint32 = 1<<31 - 1
)

// ProjectID derives a stable project ID for sandboxID: the same input gives
// the same ID in every process and version, so an edge restarted after a
// crash finds its sandboxes' quotas again. Distinct sandboxes may collide
// (about n²/4·10⁹ for n live sandboxes); callers detect that with
// Volume.InUse, or use Volume.Allocate, which probes ProjectIDAttempt.
func ProjectID(sandboxID string) uint32 { return ProjectIDAttempt(sandboxID, 0) }

// ProjectIDAttempt is the attempt-th candidate ID for sandboxID; attempt 0 is
// ProjectID. Each attempt is an independent hash, so probing does not
// cluster.
func ProjectIDAttempt(sandboxID string, attempt int) uint32 {
	h := fnv.New64a()
	fmt.Fprintf(h, "dsec-quota\x00%d\x00%s", attempt, sandboxID)
	span := uint64(MaxDerivedID-MinDerivedID) + 1
	return MinDerivedID + uint32(h.Sum64()%span)
}

// Usage is a project's consumption and hard limits; a zero limit means
// none.
type Usage struct {
	Bytes      uint64 // allocated bytes, including delayed allocations
	Inodes     uint64
	ByteLimit  uint64 // hard limit rounded up to 512 bytes
	InodeLimit uint64
}

func usageOf(d *fsDiskQuota) Usage {
	return Usage{
		Bytes:      bytesOf(d.Bcount),
		Inodes:     d.Icount,
		ByteLimit:  bytesOf(d.BlkHardlimit),
		InodeLimit: d.InoHardlimit,
	}
}
