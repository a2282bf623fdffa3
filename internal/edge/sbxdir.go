package edge

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"github.com/dsecproject/dsec/internal/cleanup"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/layer"
	"github.com/dsecproject/dsec/internal/sandbox"
)

// A sandbox's directory on the node, <state dir>/sandboxes/<id>. This file
// is the one owner of its layout and of the host state it holds; the rest
// of the edge names its parts through the helpers below.
//
//	sandbox.json    the sandbox's record (state.go): outlives the runtime
//	cmdlog.jsonl    the command log (cmdlog.go): outlives it too
//	rootfs/         where the overlay is mounted on the host (empty when
//	                the backend took it as a detached mount)
//	upper/ work/    the writable layer, without disk_mb
//	disk.img vol/   the sandbox's own disk with disk_mb (disk.go), holding
//	                vol/upper and vol/work
//	lower/<i>       idmapped views of the layers (user namespaces)
//	bundle/         the OCI bundle while a runtime starts the sandbox
//
// Everything but the record and the command log is the runtime's part:
// composeRootfs makes it (composeImages, for a backend that makes the
// rootfs itself from the layer images: only the writable layer's
// directory), releaseHost undoes its mounts and clearRuntime
// removes it. Every path that ends a sandbox's runtime (a failed create,
// teardown, recovery of a sandbox that died, reaping a directory) goes
// through releaseHost, which is idempotent.

// recordFile is the sandbox's record (cmdLogFile is the command log).
const recordFile = "sandbox.json"

// runtimeParts are the runtime's part of a sandbox directory.
var runtimeParts = []string{"rootfs", "upper", "work", "lower", "vol", "disk.img", "bundle"}

// rootfsDir is where a sandbox's overlay is (or would be) mounted.
func rootfsDir(dir string) string { return filepath.Join(dir, "rootfs") }

// releaseHost undoes the host mounts a sandbox directory may hold, in the
// order that lets each go: the overlay (which holds the layers and the
// writable layer), the idmapped layer views, the disk. A step with nothing
// to undo does nothing, so releaseHost may run on any directory, any number
// of times; it stops at the first step that fails, and the directory must
// then not be removed (its mounts are still there).
func releaseHost(dir string) error {
	if err := layer.UnmountOverlay(rootfsDir(dir)); err != nil {
		return fmt.Errorf("unmounting sandbox rootfs: %w", err)
	}
	if err := unmountLowers(dir); err != nil {
		return err
	}
	if err := removeDisk(dir); err != nil {
		return fmt.Errorf("removing sandbox disk: %w", err)
	}
	return nil
}

// clearRuntime removes the runtime's part of a sandbox directory (after
// releaseHost), keeping its record and command log.
func (e *Edge) clearRuntime(dir string) {
	for _, p := range runtimeParts {
		_ = e.removeTree(filepath.Join(dir, p))
	}
}

// composed is a sandbox's root filesystem, ready for the backend.
type composed struct {
	// rootfs is the mount point (rootfsDir); with mnt set it stays empty
	// and the backend attaches mnt there inside the sandbox.
	rootfs string
	mnt    *os.File
	// images and upper are what a LayerImages backend gets instead, and
	// release gives the images back.
	images  []string
	upper   string
	release func()
}

// takesImages reports whether the backend makes rootfs itself from the
// layer images (sandbox.LayerImages).
func takesImages(be sandbox.Backend) bool {
	b, ok := be.(sandbox.LayerImages)
	return ok && b.TakesLayerImages()
}

// makeWritable makes the sandbox's writable layer: upper and work dirs, on
// a disk of its own with rec.Disk (undone by releaseHost).
func (e *Edge) makeWritable(dir string, rec *record) (upper, work string, err error) {
	upper, work = layerDirs(dir, rec.Disk)
	if rec.Disk {
		if err := os.Mkdir(filepath.Join(dir, "vol"), 0o755); err != nil {
			return "", "", fmt.Errorf("creating sandbox dir: %w", err)
		}
		if err := e.createDisk(dir, rec.Sandbox.Spec.DiskMB); err != nil {
			return "", "", err
		}
	}
	for _, d := range []string{upper, work} {
		if err := os.Mkdir(d, 0o755); err != nil {
			return "", "", fmt.Errorf("creating sandbox dir: %w", err)
		}
	}
	if rec.UserNS {
		// The upper's root is the sandbox's "/": its root must own it.
		base := int(e.userNSMapOf(rec).HostID)
		if err := os.Chown(upper, base, base); err != nil {
			return "", "", fmt.Errorf("creating sandbox dir: %w", err)
		}
	}
	return upper, work, nil
}

// composeImages is composeRootfs for a LayerImages backend: the writable
// layer's directory and the layer images, opened from the node's layer
// source (held until c.release) rather than mounted.
func (e *Edge) composeImages(ctx context.Context, dir string, rec *record, digests []string, undo *cleanup.Stack) (composed, error) {
	var releases []func()
	c := composed{release: func() {
		for _, r := range releases {
			r()
		}
	}}
	undo.Add(func() {
		if err := releaseHost(dir); err != nil {
			e.log.Warn("undoing a failed create", "sandbox_id", rec.Sandbox.ID, "err", err)
		}
		c.release()
	})
	upper, _, err := e.makeWritable(dir, rec)
	if err != nil {
		return composed{}, err
	}
	c.upper = upper
	images, err := e.openImages(ctx, digests, &releases)
	if err != nil {
		return composed{}, err
	}
	c.images = images
	return c, nil
}

// openImages opens the layer images of digests, bottom first, adding what
// gives each back to releases.
func (e *Edge) openImages(ctx context.Context, digests []string, releases *[]func()) ([]string, error) {
	if e.deps.Blobs == nil {
		return nil, errdefs.Unavailable("node %s has no layer source", e.cfg.Name)
	}
	images := make([]string, len(digests))
	for i, d := range digests {
		p, release, err := e.deps.Blobs.Open(ctx, d)
		if err != nil {
			return nil, fmt.Errorf("opening layer %s: %w", d, err)
		}
		*releases = append(*releases, release)
		images[i] = p
	}
	return images, nil
}

// composeRootfs makes the runtime's part of the sandbox directory dir (which
// exists, with its record) for rec: the writable layer (on a disk of its
// own with rec.Disk), the layers of digests (bottom first) acquired from
// the node's mounts, their idmapped views with rec.UserNS, and the overlay,
// as a detached mount when the backend takes one, else mounted at
// rootfsDir. What it makes is undone by undo: releaseHost first, then the
// layers are released, so the overlay is gone before the mounts under it.
// The caller closes mnt once the backend has it.
func (e *Edge) composeRootfs(dir string, rec *record, digests []string, undo *cleanup.Stack) (composed, error) {
	var acquired []string
	undo.Add(func() {
		if err := releaseHost(dir); err != nil {
			e.log.Warn("undoing a failed create", "sandbox_id", rec.Sandbox.ID, "err", err)
		}
		for _, d := range acquired {
			_ = e.mounter.Release(d)
		}
	})
	if err := os.Mkdir(rootfsDir(dir), 0o755); err != nil {
		return composed{}, fmt.Errorf("creating sandbox dir: %w", err)
	}
	upper, work, err := e.makeWritable(dir, rec)
	if err != nil {
		return composed{}, err
	}
	lowers := make([]string, len(digests))
	for i, d := range digests {
		mp, err := e.mounter.Acquire(d)
		if err != nil {
			return composed{}, err // names the layer already
		}
		acquired = append(acquired, d)
		// Overlay wants the topmost lower first.
		lowers[len(digests)-1-i] = mp
	}
	c := composed{rootfs: rootfsDir(dir)}
	if rec.UserNS {
		ns, release, err := e.idmapNSFor(rec)
		if err != nil {
			return composed{}, err
		}
		defer release()
		mnt, err := e.detachedUserNSRootfs(e.backend(rec.Sandbox.Backend), ns, lowers, upper, work)
		if err != nil {
			return composed{}, err
		}
		if mnt != nil {
			c.mnt = mnt
			return c, nil
		}
		if lowers, err = e.idmapLowers(dir, ns, lowers); err != nil {
			return composed{}, err
		}
	}
	mnt, err := e.detachedRootfs(e.backend(rec.Sandbox.Backend), lowers, upper, work)
	if err != nil {
		return composed{}, err
	}
	if mnt != nil {
		c.mnt = mnt
		return c, nil
	}
	if err := layer.MountOverlay(lowers, upper, work, c.rootfs); err != nil {
		return composed{}, fmt.Errorf("mounting overlay: %w", err)
	}
	return c, nil
}
