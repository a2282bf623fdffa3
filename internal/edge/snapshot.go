package edge

import (
	"context"
	"fmt"
	"io"
	"path/filepath"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/layer"
	"github.com/dsecproject/dsec/internal/sandbox"
)

// LayerBuilder seals a directory into a catalogued layer; layer.Store
// implements it. The edge uses it to pack a sandbox's writable layer.
type LayerBuilder interface {
	BuildFromDir(ctx context.Context, ref layer.Ref, dir string, opts layer.BuildOptions, progress io.Writer) (api.Layer, error)
}

// maxStack bounds the layers under one sandbox (base, workspace, toolkits
// and snapshots). Overlayfs takes up to 500; deep stacks cost lookups.
const maxStack = 64

// SnapshotOptions carry what the apiserver knows about a snapshot request.
type SnapshotOptions struct {
	Request api.SnapshotRequest
	// Principal names who asks, recorded with the snapshot.
	Principal string
}

// Snapshot packs the sandbox's writable layer (the overlay upper, with its
// whiteouts and opaque directories) into a new EROFS snapshot layer
// (pack_diff). A running sandbox is frozen for the time of the pack and
// thawed after; a paused one stays paused. Include keeps only the given
// paths; exclude scrubs paths (e.g. /root/.cache, a builder's answers); both
// are recorded with the snapshot. Files written through the files API while
// the pack runs may or may not be in it.
func (e *Edge) Snapshot(ctx context.Context, id string, o SnapshotOptions) (*api.Layer, error) {
	req := o.Request
	ref, err := layer.ParseRef(req.Ref)
	if err != nil {
		return nil, err
	}
	if ref.Kind != api.KindSnapshot {
		return nil, errdefs.Invalid("snapshot ref %s must be of kind snapshot (snapshot/NAME:TAG)", req.Ref)
	}
	if e.deps.Layers == nil {
		return nil, errdefs.Precondition("this edge cannot build layers")
	}
	s, err := e.get(id)
	if err != nil {
		return nil, err
	}
	s.life.Lock()
	defer s.life.Unlock()
	s.mu.Lock()
	rec := s.rec
	s.mu.Unlock()
	if sel := e.cfg.SnapshotLabels; len(sel) > 0 && !sandbox.LabelsMatch(rec.Sandbox.Labels, sel) {
		return nil, errdefs.PermissionDenied("snapshots are restricted to sandboxes labelled %v on this node", sel)
	}
	if len(rec.Digests)+1 > maxStack {
		return nil, errdefs.Precondition("sandbox %s already stacks %d layers; a snapshot would exceed %d (flattening is not supported yet)", id, len(rec.Digests), maxStack)
	}
	switch rec.Sandbox.State {
	case api.StateRunning:
		if e.deps.Cgroups != nil {
			if err := e.deps.Cgroups.Freeze(ctx, rec.CgroupPath); err != nil {
				return nil, fmt.Errorf("freezing for the snapshot: %w", err)
			}
			defer func() {
				if err := e.deps.Cgroups.Thaw(rec.CgroupPath); err != nil {
					e.log.Warn("thawing after snapshot", "sandbox_id", id, "err", err)
				}
			}()
		}
	case api.StatePaused:
	default:
		return nil, errdefs.Precondition("sandbox %s is %s; only a running or paused sandbox can be snapshotted", id, rec.Sandbox.State)
	}
	upper := filepath.Join(s.dir, "upper")
	excludes := append([]string(nil), req.Exclude...)
	if len(req.Include) > 0 {
		more, err := layer.ExcludesForInclude(upper, req.Include)
		if err != nil {
			return nil, err
		}
		excludes = append(excludes, more...)
	}
	start := time.Now()
	info := &api.SnapshotInfo{
		Sandbox: id, Layers: rec.Digests, Include: req.Include, Exclude: req.Exclude,
		Spec: rec.Sandbox.Spec, CreatedBy: o.Principal,
	}
	l, err := e.deps.Layers.BuildFromDir(ctx, ref, upper, layer.BuildOptions{Exclude: excludes, Snapshot: info}, nil)
	if err != nil {
		return nil, err
	}
	e.log.Info("snapshot taken", "sandbox_id", id, "ref", l.Ref, "digest", l.Digest,
		"size_bytes", l.SizeBytes, "ms", time.Since(start).Milliseconds())
	return &l, nil
}
