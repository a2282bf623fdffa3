package edge

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/cleanup"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/files"
	"github.com/dsecproject/dsec/internal/layer"
	"github.com/dsecproject/dsec/internal/sandbox"
)

// LayerBuilder seals a directory into a catalogued layer, or into a
// staged one that the caller publishes; layer.Store implements it. The
// edge uses it to pack a sandbox's writable layer.
type LayerBuilder interface {
	BuildFromDir(ctx context.Context, ref layer.Ref, dir string, opts layer.BuildOptions, progress io.Writer) (api.Layer, error)
	Stage(ctx context.Context, ref layer.Ref, dir string, opts layer.BuildOptions, progress io.Writer) (api.Layer, layer.Staged, error)
}

// maxStack bounds the layers under one sandbox (base, workspace, toolkits
// and snapshots). Overlayfs takes up to 500; deep stacks cost lookups.
const maxStack = 64

// DefaultSnapshotDepth is Config.MaxSnapshotDepth when it is left at zero.
const DefaultSnapshotDepth = 8

// Snapshot packs the sandbox's writable layer (the overlay upper, with its
// whiteouts and opaque directories) into a new EROFS snapshot layer
// (pack_diff). A running sandbox is frozen for the time of the pack and
// thawed after; a paused one stays paused. A backend whose writable layer
// the node cannot read (a VM) exports it instead (sandbox.DiffExporter),
// consistent by its own means, into a staging directory packed the same
// way. Include keeps only the given
// paths; exclude scrubs paths (e.g. /root/.cache, a builder's answers); both
// apply to what the sandbox changed and are recorded with the snapshot.
// Files written through the files API while the pack runs may or may not be
// in it.
//
// A sandbox started from a snapshot stacks that snapshot's layers. When the
// new snapshot would make the stack of snapshot layers deeper than
// Config.MaxSnapshotDepth, the earlier snapshot layers and the sandbox's
// changes are merged into one layer instead (layer.ApplyDiff), which then
// sits right on base, workspace and toolkits; sandboxes started from it see
// the same files as from the chain.
func (e *Edge) Snapshot(ctx context.Context, id string, o edgeapi.SnapshotOptions) (*edgeapi.SnapshotResult, error) {
	req := o.Request
	ref, err := layer.ParseRef(req.Ref)
	if err != nil {
		return nil, err
	}
	if ref.Kind != api.KindSnapshot {
		return nil, errdefs.Invalid("snapshot ref %s must be of kind snapshot (snapshot/NAME:TAG)", req.Ref)
	}
	s, err := e.get(ctx, id)
	if err != nil {
		return nil, err
	}
	if e.deps.Layers == nil {
		return nil, errdefs.Precondition("this edge cannot build layers")
	}
	s.life.Lock()
	defer s.life.Unlock()
	s.mu.Lock()
	rec := s.rec
	s.mu.Unlock()
	if sel := e.cfg.SnapshotLabels; len(sel) > 0 && !sandbox.LabelsMatch(rec.Sandbox.Labels, sel) {
		return nil, errdefs.PermissionDenied("snapshots are restricted to sandboxes labelled %v on this node", sel)
	}
	switch rec.Sandbox.State {
	case api.StateRunning, api.StatePaused:
	default:
		return nil, errdefs.Precondition("sandbox %s is %s; only a running or paused sandbox can be snapshotted", id, rec.Sandbox.State)
	}
	var exporter sandbox.DiffExporter
	if rec.Images {
		// Its writable layer is the backend's, in a form of its own,
		// which the backend exports if it can.
		var ok bool
		if exporter, ok = e.backendOf(s).(sandbox.DiffExporter); !ok {
			return nil, errdefs.Precondition("sandbox %s runs on the %s backend, whose writable layer the node cannot pack: snapshots do not serve it",
				id, rec.Sandbox.Backend)
		}
	}
	// The layers above base, workspace and toolkits are the snapshot
	// layers the sandbox was started on.
	n := edgeapi.StackBelow(rec.Below, rec.Sandbox.Spec)
	if n > len(rec.Digests) {
		return nil, fmt.Errorf("snapshotting %s: its spec names %d layers but it stacks %d", id, n, len(rec.Digests))
	}
	below, chain := rec.Digests[:n], rec.Digests[n:]
	flatten := len(chain)+1 > e.snapshotDepth() || len(rec.Digests)+1 > maxStack
	if n+1 > maxStack {
		return nil, errdefs.Precondition("sandbox %s stacks %d base, workspace and toolkit layers; a snapshot would exceed %d", id, n, maxStack)
	}

	var cl cleanup.Stack
	defer cl.Run()
	var stage string
	if flatten {
		// The snapshot layers are immutable: merge them before freezing,
		// so that the sandbox stops only for the copy of its own changes.
		if stage, err = e.stageChain(ctx, chain, &cl); err != nil {
			return nil, err
		}
	}
	thaw, upper := func() {}, s.upperDir()
	if exporter != nil {
		// The backend makes its export consistent itself (a VM freezes
		// its disk); the copy is all the pack needs from the sandbox.
		if upper, err = e.exportDiff(ctx, exporter, id, &cl); err != nil {
			return nil, err
		}
	} else {
		if thaw, err = e.freeze(ctx, id, rec); err != nil {
			return nil, err
		}
		defer thaw()
	}
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
		Spec: rec.Sandbox.Spec, CreatedBy: o.Principal, Below: n,
	}
	src := upper
	if flatten {
		// The rules apply to the sandbox's changes only, as they do
		// without flattening: an include must not drop what earlier
		// snapshots added.
		if err := layer.ApplyDiffExcluding(stage, upper, excludes); err != nil {
			return nil, fmt.Errorf("flattening snapshot of %s: %w", id, err)
		}
		thaw() // the staged copy is all the pack needs from the sandbox
		src, excludes = stage, nil
		info.Layers, info.Flattened = append([]string(nil), below...), len(chain)
		if rec.UserNS {
			if err := unshiftTree(stage, e.userNSMapOf(&rec)); err != nil {
				return nil, fmt.Errorf("snapshotting %s: %w", id, err)
			}
		}
	} else if rec.UserNS {
		// The upper holds host IDs; the layer must hold the sandbox's.
		if stage, err = e.newStage(&cl); err != nil {
			return nil, err
		}
		if out, err := exec.CommandContext(ctx, "cp", "-a", upper+"/.", stage).CombinedOutput(); err != nil {
			return nil, fmt.Errorf("copying the changes of %s: %v: %s", id, err, strings.TrimSpace(string(out)))
		}
		thaw()
		if err := unshiftTree(stage, e.userNSMapOf(&rec)); err != nil {
			return nil, fmt.Errorf("snapshotting %s: %w", id, err)
		}
		src = stage
	}
	opts := layer.BuildOptions{Exclude: excludes, Snapshot: info, Project: o.Project}
	var res edgeapi.SnapshotResult
	if o.Stage {
		var st layer.Staged
		res.Layer, st, err = e.deps.Layers.Stage(ctx, ref, src, opts, nil)
		res.Staged = &st
	} else {
		res.Layer, err = e.deps.Layers.BuildFromDir(ctx, ref, src, opts, nil)
	}
	if err != nil {
		return nil, err
	}
	e.log.Info("snapshot taken", "sandbox_id", id, "ref", res.Ref, "digest", res.Digest,
		"size_bytes", res.SizeBytes, "flattened", info.Flattened, "staged", o.Stage, "ms", time.Since(start).Milliseconds())
	return &res, nil
}

// exportDiff unpacks the writable layer a backend exports into a new
// staging directory and returns it; cl removes it. The archive comes from
// inside the sandbox: it is unpacked as an untrusted diff (no devices but
// whiteouts, no xattrs that would steer an overlay or the host), bounded
// as layer builds are.
func (e *Edge) exportDiff(ctx context.Context, be sandbox.DiffExporter, id string, cl *cleanup.Stack) (string, error) {
	dir, err := e.newStage(cl)
	if err != nil {
		return "", err
	}
	r, err := files.Open(dir)
	if err != nil {
		return "", fmt.Errorf("staging the changes of %s: %w", id, err)
	}
	defer r.Close()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	pr, pw := io.Pipe()
	exported := make(chan error, 1)
	go func() {
		err := be.ExportDiff(ctx, id, pw)
		pw.CloseWithError(err)
		exported <- err
	}()
	start := time.Now()
	res, xerr := r.ExtractTar("/", pr, files.TarOptions{Diff: true, MaxBytes: layer.DefaultMaxBytes, MaxFiles: layer.DefaultMaxFiles})
	if xerr != nil {
		cancel() // the export stops
	}
	// Its writes fail from now on: what follows the archive's end (none
	// from a sound agent) is not waited for.
	pr.CloseWithError(errors.New("the archive has ended"))
	eerr := <-exported
	if eerr != nil && xerr == nil {
		xerr = eerr
	}
	if xerr != nil {
		if eerr != nil && !errors.Is(eerr, context.Canceled) {
			xerr = eerr // the export's own failure explains the archive's
		}
		return "", fmt.Errorf("exporting the changes of %s: %w", id, xerr)
	}
	e.log.Info("sandbox changes exported", "sandbox_id", id, "files", res.Files, "bytes", res.Bytes, "ms", time.Since(start).Milliseconds())
	return dir, nil
}

func (e *Edge) snapshotDepth() int {
	if e.cfg.MaxSnapshotDepth > 0 {
		return e.cfg.MaxSnapshotDepth
	}
	return DefaultSnapshotDepth
}

// freeze freezes a running sandbox's cgroup and returns the function that
// thaws it, which may be called more than once. A paused sandbox is frozen
// already and stays so.
func (e *Edge) freeze(ctx context.Context, id string, rec record) (thaw func(), err error) {
	if rec.Sandbox.State != api.StateRunning || e.deps.Cgroups == nil {
		return func() {}, nil
	}
	if err := e.deps.Cgroups.Freeze(ctx, rec.CgroupPath); err != nil {
		return nil, fmt.Errorf("freezing for the snapshot: %w", err)
	}
	thawed := false
	return func() {
		if thawed {
			return
		}
		thawed = true
		if err := e.deps.Cgroups.Thaw(rec.CgroupPath); err != nil {
			e.log.Warn("thawing after snapshot", "sandbox_id", id, "err", err)
		}
	}, nil
}

// newStage makes an empty staging directory under <state>/snapstage; cl
// removes it.
func (e *Edge) newStage(cl *cleanup.Stack) (string, error) {
	root := filepath.Join(e.cfg.StateDir, "snapstage")
	// Staged trees hold setuid files and device nodes: root only.
	if err := os.MkdirAll(root, 0o700); err != nil {
		return "", fmt.Errorf("staging snapshot layers: %w", err)
	}
	e.clearStaleStages(root)
	dir, err := os.MkdirTemp(root, strconv.Itoa(os.Getpid())+"-*")
	if err != nil {
		return "", fmt.Errorf("staging snapshot layers: %w", err)
	}
	cl.Add(func() {
		if err := e.removeTree(dir); err != nil {
			e.log.Warn("removing snapshot staging", "dir", dir, "err", clip(err.Error(), maxLoggedError))
		}
	})
	return dir, nil
}

// stageChain merges the snapshot layers of chain (bottom first) into a new
// directory under <state>/snapstage and returns it; cl removes it. The
// layers are mounted already (the sandbox uses them); the reference taken
// here keeps them mounted while they are read.
func (e *Edge) stageChain(ctx context.Context, chain []string, cl *cleanup.Stack) (string, error) {
	dir, err := e.newStage(cl)
	if err != nil {
		return "", err
	}
	for _, d := range chain {
		if err := ctx.Err(); err != nil {
			return "", fmt.Errorf("staging snapshot layers: %w", err)
		}
		mp, err := e.mounter.Acquire(d)
		if err != nil {
			return "", fmt.Errorf("staging snapshot layers: %w", err)
		}
		err = layer.ApplyDiff(dir, mp)
		if rerr := e.mounter.Release(d); rerr != nil {
			e.log.Warn("releasing snapshot layer", "digest", d, "err", rerr)
		}
		if err != nil {
			return "", fmt.Errorf("staging snapshot layers: %w", err)
		}
	}
	return dir, nil
}

// clearStaleStages removes what flattenings of earlier daemons left in
// root (a crash between staging and cleanup). Stages are named after the
// pid of the daemon that made them: a state dir has one daemon at a time
// (dsec.db is locked), so any other pid's stage is abandoned, while this
// daemon's may belong to a snapshot of another sandbox running now.
func (e *Edge) clearStaleStages(root string) {
	ents, err := os.ReadDir(root)
	if err != nil {
		e.log.Warn("listing snapshot staging", "dir", root, "err", err)
		return
	}
	mine := strconv.Itoa(os.Getpid()) + "-"
	for _, ent := range ents {
		if strings.HasPrefix(ent.Name(), mine) {
			continue
		}
		if err := e.removeTree(filepath.Join(root, ent.Name())); err != nil {
			e.log.Warn("removing stale snapshot staging", "dir", ent.Name(), "err", clip(err.Error(), maxLoggedError))
			continue
		}
		e.log.Info("removed stale snapshot staging", "dir", ent.Name())
	}
}
