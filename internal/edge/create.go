package edge

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/cgroup"
	"github.com/dsecproject/dsec/internal/cleanup"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/layer"
	"github.com/dsecproject/dsec/internal/sandbox"
)

// Create admits, composes and starts one sandbox. On any failure nothing is
// left behind: no mount, cgroup, runtime state, directory or record.
func (e *Edge) Create(ctx context.Context, req edgeapi.CreateRequest) (*api.Sandbox, error) {
	start := time.Now()
	sb, err := e.createOnce(ctx, req, func() (*api.Sandbox, error) { return e.create(ctx, req) })
	if err != nil {
		e.metrics.createFailures.WithLabelValues(errdefs.Code(err)).Inc()
		return nil, err
	}
	e.metrics.createSeconds.Observe(time.Since(start).Seconds())
	return sb, nil
}

func (e *Edge) create(ctx context.Context, req edgeapi.CreateRequest) (*api.Sandbox, error) {
	if e.cfg.PoolMax <= 0 {
		s, err := e.createSbx(ctx, req, false)
		if err != nil {
			return nil, err
		}
		v := s.view()
		return &v, nil
	}
	spec := req.Spec
	if err := e.normalize(&spec); err != nil {
		return nil, err
	}
	if err := e.checkSelector(spec); err != nil {
		return nil, err // before the pool: a pooled sandbox is on this node too
	}
	k := keyOf(spec, req.Digests)
	if v := e.claim(spec, req); v != nil {
		e.pool.note(k, req, time.Now())
		return v, nil
	}
	e.metrics.poolClaims.WithLabelValues("miss").Inc()
	s, err := e.createSbx(ctx, req, false)
	if errdefs.Code(err) == "resource_exhausted" && e.evictPooled() {
		s, err = e.createSbx(ctx, req, false)
	}
	if err != nil {
		return nil, err
	}
	e.pool.note(k, req, time.Now())
	v := s.view()
	return &v, nil
}

// checkSelector refuses a spec whose node_selector this node does not
// match. Placement saw other labels: another node may match, so the
// refusal is resource_exhausted (the apiserver tries another).
func (e *Edge) checkSelector(spec api.SandboxSpec) error {
	if !sandbox.LabelsMatch(e.cfg.Labels, spec.NodeSelector) {
		return errdefs.Exhausted("node %s does not carry the labels node_selector asks for (%v)", e.cfg.Name, spec.NodeSelector)
	}
	return nil
}

// createSbx does the work of a create; pooled makes a pool sandbox.
func (e *Edge) createSbx(ctx context.Context, req edgeapi.CreateRequest, pooled bool) (*sbx, error) {
	spec := req.Spec
	if err := e.normalize(&spec); err != nil {
		return nil, err
	}
	if len(req.Digests) == 0 {
		return nil, errdefs.Invalid("no layers to compose")
	}
	if err := e.checkSelector(spec); err != nil {
		return nil, err
	}
	for _, d := range req.Digests {
		if !layer.IsDigest(d) {
			return nil, errdefs.Invalid("bad layer digest %q", d)
		}
	}
	if req.Below < 0 || req.Below > len(req.Digests) || req.Below > 0 && req.Below < edgeapi.StackBelow(0, spec) {
		return nil, errdefs.Invalid("below %d: the sandbox stacks %d layers, at least %d of them base, workspace and toolkits",
			req.Below, len(req.Digests), edgeapi.StackBelow(0, spec))
	}
	netp, err := e.compileNetwork(spec.Network)
	if err != nil {
		return nil, err
	}
	if err := e.checkDisk(spec.DiskMB); err != nil {
		return nil, err
	}
	be := e.backend(spec.Backend)
	if be == nil { // Normalize checked it against the node's policy
		return nil, errdefs.Precondition("node %s does not offer the %s backend", e.cfg.Name, spec.Backend)
	}
	if err := e.checkUserNS(be, spec.InUserNS()); err != nil {
		return nil, err
	}
	var undo cleanup.Stack
	defer undo.Run()

	id := e.newID()
	dir := e.sandboxDir(id)
	now := time.Now().UTC()
	exp := now.Add(time.Duration(spec.TTL) * time.Second)
	rec := record{
		Sandbox: api.Sandbox{
			ID: id, Node: e.cfg.Name, Project: spec.Project, Backend: spec.Backend, State: api.StateCreating,
			Spec: spec, CreatedAt: now, ExpiresAt: &exp, Labels: spec.Labels, Layers: req.Digests,
		},
		ProjectPath: req.ProjectPath,
		Dedicated:   req.Dedicated,
		Digests:     req.Digests,
		Below:       req.Below,
		Disk:        spec.DiskMB > 0,
		UserNS:      spec.InUserNS(),
		Pooled:      pooled,
		Token:       req.Token,
		Images:      takesImages(be),
	}
	// Admission counts sandboxes holding resources, this one included from
	// here on. It is visible as "creating" (and its layers as in use) while
	// it is set up; a delete that arrives meanwhile waits on life.
	s := &sbx{dir: dir, rec: rec, pooled: pooled}
	s.touch()
	s.life.Lock()
	defer s.life.Unlock()
	if err := e.checkDiskFloor(); err != nil {
		return nil, err
	}
	e.mu.Lock()
	if e.live >= e.cfg.MaxSandboxes {
		e.mu.Unlock()
		return nil, errdefs.Exhausted("node %s is full (%d sandboxes)", e.cfg.Name, e.cfg.MaxSandboxes)
	}
	if !pooled {
		if err := e.tenancyAdmitLocked(req.Dedicated); err != nil {
			e.mu.Unlock()
			return nil, err
		}
	}
	if rec.UserNS {
		owner, err := e.takeOwnerLocked()
		if err != nil {
			if !pooled {
				e.tenancyAddLocked(req.Dedicated, -1)
			}
			e.mu.Unlock()
			return nil, err
		}
		// Held from here until the sandbox is unlisted (unlistLocked).
		rec.UserNSOwner, s.rec.UserNSOwner = owner, owner
		if r, ok := be.(sandbox.IDRangePerSandbox); ok && r.IDRangePerSandbox() {
			host := e.rangeOf(owner)
			rec.UserNSHost, s.rec.UserNSHost = host, host
		}
	}
	e.live++
	if !pooled {
		// In the node's counts (as creating) from now on: numbered so.
		e.createSeq++
		rec.Sandbox.CreateSeq = e.createSeq
		s.rec.Sandbox.CreateSeq = e.createSeq
	}
	e.listLocked(id, s)
	e.mu.Unlock()
	undo.Add(func() {
		e.mu.Lock()
		e.live--
		if !pooled {
			e.tenancyAddLocked(req.Dedicated, -1)
		}
		e.unlistLocked(id, s)
		e.mu.Unlock()
	})
	rec.CgroupPath, rec.CgroupCPUBase, err = e.cgroupFor(id, spec.MemoryCgroup == api.MemoryCgroupShared)
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	s.rec.CgroupPath, s.rec.CgroupCPUBase = rec.CgroupPath, rec.CgroupCPUBase
	s.mu.Unlock()
	// Runs last: after the runtime below is destroyed.
	undo.Add(func() { e.releaseCgroup(id, rec.CgroupPath) })

	if err := os.Mkdir(dir, 0o700); err != nil {
		return nil, fmt.Errorf("creating sandbox dir: %w", err)
	}
	undo.Add(func() {
		// Not through mounts that would not go (composeRootfs's undo,
		// which ran before this one, has said why): recovery reaps it.
		if releaseHost(dir) == nil {
			_ = e.removeTree(dir)
		}
	})
	if rec.UserNS && rec.UserNSHost == 0 {
		if err := groupSearchable(dir, e.cfg.UserNSBase); err != nil {
			return nil, err
		}
	}
	// The backend makes the bundle dir if it needs one (a runtime does;
	// dsec's launcher writes no files), and it goes once the sandbox runs:
	// the runtime keeps its own copy of the config.
	bundle := e.bundleDir(id)
	defer os.RemoveAll(bundle)
	// The record goes first, marked creating: if the edge dies mid-create,
	// recovery finds it and undoes everything below. No fsync: a daemon
	// crash keeps it (page cache), and after a host crash a directory
	// whose record is missing or torn is reaped all the same.
	if err := writeRecordSync(dir, &rec, false); err != nil {
		return nil, err
	}
	var root composed
	if rec.Images {
		root, err = e.composeImages(ctx, dir, &rec, req.Digests, &undo)
	} else {
		root, err = e.composeRootfs(dir, &rec, req.Digests, &undo)
	}
	if err != nil {
		return nil, err
	}
	if root.mnt != nil {
		defer root.mnt.Close()
		rec.PrivateRootfs = true
	}

	cfg := sandbox.Config{
		ID: id, Dir: bundle, Rootfs: root.rootfs, RootfsMount: root.mnt, Images: root.images, Upper: root.upper, Hostname: "sandbox",
		CgroupPath: rec.CgroupPath,
		Limits: sandbox.Limits{
			CPU: spec.CPU, MemoryBytes: spec.MemoryMB << 20, Pids: spec.Pids,
			BestEffort: spec.QoS == "be",
		},
	}
	if rec.Images {
		cfg.Rootfs = "" // the backend makes it
	}
	if e.deps.Net != nil {
		cfg.ResolvConf = filepath.Join(e.cfg.StateDir, "resolv.conf")
	}
	if rec.UserNS {
		cfg.UserNS = e.sandboxIDMap(&rec)
	}
	// Registered before the create: a failed one may have left state or
	// processes (its cgroup is released by the undo above).
	undo.Add(func() { e.destroyRuntime(context.Background(), be, id, "") })
	// A backend whose network must exist before the sandbox starts gets
	// it attached from inside Create.
	nf, netFirst := be.(sandbox.NetworkFirst)
	netFirst = netFirst && nf.NetworkFirst() && !netp.Empty()
	if netFirst {
		cfg.AttachNetwork = func(pid int) error {
			att, err := e.deps.Net.Apply(ctx, id, pid, nil, netp)
			if err != nil {
				return err
			}
			undo.Add(func() { e.releaseNetwork(context.Background(), id, att) })
			rec.Net = att
			return nil
		}
	}
	if err := be.Create(ctx, cfg); err != nil {
		return nil, fmt.Errorf("starting sandbox: %w", err)
	}
	if spec.QoS == "be" && e.deps.Cgroups != nil {
		// Best effort: CPU shares 2 (set by the backend) and an idle
		// group, so LS sandboxes always win the CPU.
		if err := e.deps.Cgroups.SetIdle(rec.CgroupPath); err != nil {
			if !errors.Is(err, cgroup.ErrNoIdle) {
				return nil, err
			}
			e.log.Debug("best-effort sandbox without cpu.idle", "sandbox_id", id, "err", err)
		}
	}

	if !netp.Empty() && !netFirst {
		pid, err := e.initPid(ctx, id)
		if err != nil {
			return nil, err
		}
		att, err := e.deps.Net.Apply(ctx, id, pid, nil, netp)
		if err != nil {
			return nil, err
		}
		undo.Add(func() { e.releaseNetwork(context.Background(), id, att) })
		rec.Net = att
	}

	rec.Sandbox.State = api.StateRunning
	// No fsync either: after a host crash the sandbox's processes are gone
	// whatever the record says; a record still saying "creating" is
	// reaped, one saying "running" is marked failed, and both lose the
	// writable layer. The fsync was 8% of a create.
	if err := writeRecordSync(dir, &rec, false); err != nil {
		return nil, err
	}
	s.mu.Lock()
	s.rec = rec
	s.releaseImages = root.release
	e.recountLocked(s)
	s.mu.Unlock()
	undo.Release()
	e.log.Info("sandbox created", "sandbox_id", id, "project", spec.Project, "base", spec.Base, "layers", len(req.Digests), "for_pool", pooled)
	return s, nil
}

// detachedRootfs builds the sandbox's overlay as a detached mount when the
// backend can attach it inside the sandbox's own mount namespace. It
// returns nil (and no error) when the backend or the kernel cannot; the
// caller then mounts the overlay on the host.
//
// Why: a mount on the host is one more line in the host's mount table for
// every sandbox, and every create copies that table (a new mount
// namespace) and the runtime reads it (mountinfo) several times, so create
// time grew with the number of live sandboxes.
func (e *Edge) detachedRootfs(be sandbox.Backend, lowers []string, upper, work string) (*os.File, error) {
	b, ok := be.(sandbox.DetachedRootfs)
	if !ok || !b.TakesDetachedRootfs() || e.noDetached.Load() {
		return nil, nil
	}
	mnt, err := layer.DetachedOverlay(lowers, upper, work)
	if errors.Is(err, layer.ErrNoDetachedMount) {
		if !e.noDetached.Swap(true) {
			e.log.Info("sandbox rootfs mounts stay on the host", "reason", err)
		}
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("mounting overlay: %w", err)
	}
	return mnt, nil
}

// bundleDir is where sandbox id's OCI bundle is written while the backend
// starts it.
func (e *Edge) bundleDir(id string) string {
	if e.cfg.BundleDir == "" {
		return filepath.Join(e.sandboxDir(id), "bundle")
	}
	return filepath.Join(e.cfg.BundleDir, id)
}

// destroyRuntime stops the sandbox's processes and removes its runtime
// state, then releases its cgroup (releaseCgroup; "" keeps it). Best
// effort: errors are logged; what is left is reaped at the next start of
// the edge.
func (e *Edge) destroyRuntime(ctx context.Context, b sandbox.Backend, id, cgroupPath string) {
	if err := b.Destroy(ctx, id); err != nil {
		e.log.Warn("destroying sandbox runtime", "sandbox_id", id, "err", err)
	}
	e.releaseCgroup(id, cgroupPath)
}

// Delete removes a sandbox and everything it holds. Deleting an unknown
// sandbox succeeds (idempotent). A delete that arrives while the reaper
// stops the sandbox waits for it, then removes the record too.
func (e *Edge) Delete(ctx context.Context, id string) error {
	s, err := e.get(ctx, id)
	if err != nil {
		// Absent, pooled (not handed out: not the caller's) or another
		// tenant's: already gone, as far as the caller can tell.
		return nil
	}
	return e.remove(ctx, s)
}

// remove deletes the sandbox s with everything it holds.
func (e *Edge) remove(ctx context.Context, s *sbx) error {
	s.mu.Lock()
	id := s.rec.Sandbox.ID
	s.mu.Unlock()
	s.life.Lock()
	defer s.life.Unlock()
	e.mu.RLock()
	gone := e.sandboxes[id] != s
	e.mu.RUnlock()
	if gone {
		return nil // deleted while we waited
	}
	s.mu.Lock()
	s.going = true
	s.mu.Unlock()
	if err := e.teardown(ctx, s, true); err != nil {
		s.mu.Lock()
		s.going = false
		s.mu.Unlock()
		return err
	}
	e.mu.Lock()
	e.unlistLocked(id, s)
	e.mu.Unlock()
	s.mu.Lock()
	project := s.rec.Sandbox.Project
	s.mu.Unlock()
	e.log.Info("sandbox deleted", "sandbox_id", id, "project", project)
	return nil
}

// teardown releases a sandbox's node resources. With remove it also deletes
// its directory (writable layer included); without, it keeps the record as
// a stopped sandbox.
func (e *Edge) teardown(ctx context.Context, s *sbx, remove bool) error {
	s.closeSessions()
	s.killProcs()
	s.mu.Lock()
	rec := s.rec
	if s.root != nil {
		_ = s.root.Close()
		s.root = nil
	}
	s.mu.Unlock()
	id := rec.Sandbox.ID
	if rec.Sandbox.State == api.StatePaused && e.deps.Cgroups != nil {
		// A kill stays pending on a task frozen by the v1 freezer.
		_ = e.deps.Cgroups.Thaw(rec.CgroupPath)
	}
	if holdsResources(rec.Sandbox.State) {
		e.destroyRuntime(ctx, e.backendOf(s), id, rec.CgroupPath)
		e.releaseNetwork(ctx, id, rec.Net)
		s.mu.Lock()
		s.rec.Net = nil
		// The cgroup may serve another sandbox from now on: should a step
		// below fail, nothing of this one (stats, pause, a retried
		// teardown) may touch it.
		s.rec.CgroupPath = ""
		s.mu.Unlock()
		// (A private rootfs went with the sandbox's mount namespace.)
		if err := releaseHost(s.dir); err != nil {
			return err
		}
		if rec.Images {
			s.mu.Lock()
			release := s.releaseImages
			s.releaseImages = nil
			s.mu.Unlock()
			if release != nil {
				release()
			}
		} else {
			for _, d := range rec.Digests {
				if err := e.mounter.Release(d); err != nil {
					e.log.Warn("releasing layer", "sandbox_id", id, "digest", d, "err", err)
				}
			}
		}
		s.mu.Lock()
		pooled := s.pooled
		s.mu.Unlock()
		e.mu.Lock()
		e.live--
		if !pooled {
			e.tenancyAddLocked(rec.Dedicated, -1)
		}
		e.mu.Unlock()
	}
	if remove {
		if err := e.discard(s.dir); err != nil {
			return fmt.Errorf("removing sandbox dir: %w", err)
		}
	}
	return nil
}

// stopSandbox ends a sandbox for a reason (ttl, idle timeout: final state
// stopped; its init died: failed) but keeps its record readable for
// StoppedRetention.
func (e *Edge) stopSandbox(ctx context.Context, s *sbx, final, reason string) {
	s.life.Lock()
	defer s.life.Unlock()
	s.mu.Lock()
	if !holdsResources(s.rec.Sandbox.State) {
		s.mu.Unlock()
		return // deleted or stopped while we waited
	}
	s.going = true
	id := s.rec.Sandbox.ID
	s.mu.Unlock()
	if err := e.teardown(ctx, s, false); err != nil {
		e.log.Warn("stopping sandbox", "sandbox_id", id, "err", err)
		s.mu.Lock()
		s.going = false
		s.mu.Unlock()
		return
	}
	// The writable layer goes with the runtime: a stopped sandbox cannot be
	// restarted, so keeping it would only leak disk.
	e.clearRuntime(s.dir)
	now := time.Now().UTC()
	s.mu.Lock()
	s.rec.Sandbox.State = final
	s.rec.Sandbox.Error = reason
	s.rec.StoppedAt = &now
	e.recountLocked(s)
	if err := s.persistLocked(); err != nil {
		e.log.Warn("persisting stopped sandbox", "sandbox_id", id, "err", err)
	}
	s.going = false
	s.mu.Unlock()
	e.metrics.reaped.WithLabelValues(reason).Inc()
	e.log.Info("sandbox stopped", "sandbox_id", id, "state", final, "reason", reason)
}

// DeleteByLabels deletes every sandbox whose labels contain sel.
func (e *Edge) DeleteByLabels(ctx context.Context, sel map[string]string) (int, error) {
	if len(sel) == 0 {
		return 0, errdefs.Invalid("labels are required (refusing to delete every sandbox)")
	}
	return e.deleteMatching(ctx, sel)
}

// DeleteAll deletes every sandbox of the node (--cleanup-on-exit).
func (e *Edge) DeleteAll(ctx context.Context) (int, error) { return e.deleteMatching(ctx, nil) }

// deleteMatching deletes the sandboxes whose labels contain sel (every
// one for an empty sel).
func (e *Edge) deleteMatching(ctx context.Context, sel map[string]string) (int, error) {
	// Several at a time: one delete mostly waits (for init to die, for
	// the kernel's cgroup_mutex), and the backend bounds its own work.
	ids := make(chan string)
	var mu sync.Mutex
	var wg sync.WaitGroup
	n := 0
	var firstErr error
	for range deleteParallel {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for id := range ids {
				err := e.Delete(ctx, id)
				mu.Lock()
				if err == nil {
					n++
				} else if firstErr == nil {
					firstErr = err
				}
				mu.Unlock()
			}
		}()
	}
	for _, v := range e.list(ctx, edgeapi.ListFilter{Labels: sel}) {
		if ctx.Err() != nil {
			break
		}
		ids <- v.ID
	}
	close(ids)
	wg.Wait()
	if firstErr == nil && ctx.Err() != nil {
		firstErr = ctx.Err()
	}
	return n, firstErr
}

// deleteParallel is how many deletes DeleteByLabels runs at once.
const deleteParallel = 8
