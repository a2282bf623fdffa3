package edge

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/layer"
	"github.com/dsecproject/dsec/internal/mountinfo"
)

// holdsResources reports whether a sandbox in state holds node resources
// (runtime, mounts, layer references).
func holdsResources(state string) bool {
	return state == api.StateCreating || state == api.StateRunning || state == api.StatePaused
}

// recover rebuilds the in-memory state from the state directory and the
// runtime after a restart (or a crash), re-adopting live sandboxes, and
// reaps everything that belongs to no sandbox: runtime containers, cgroups,
// overlay and layer mounts, directories.
func (e *Edge) recover(ctx context.Context) error {
	dir := filepath.Join(e.cfg.StateDir, "sandboxes")
	ents, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	mounted, err := mountpoints(e.cfg.StateDir)
	if err != nil {
		return err
	}
	live := map[string]bool{}
	liveCgroups := map[string]bool{} // cgroup paths of live sandboxes
	// Which sandboxes survived, first: a dead one's record may name a
	// cgroup slot a live one holds now (the edge died after its teardown
	// released the slot, before its record said so), and releasing the
	// dead one's cgroup must not touch the live one's.
	statusErr := map[string]error{}
	type readRec struct {
		rec *record
		err error
	}
	recs := make(map[string]readRec, len(ents))
	for _, ent := range ents {
		id := ent.Name()
		rec, err := readRecord(filepath.Join(dir, id))
		recs[id] = readRec{rec, err}
		if err != nil || !ent.IsDir() || rec.Sandbox.State == api.StateCreating || rec.Pooled || !holdsResources(rec.Sandbox.State) {
			continue
		}
		status, serr := e.backendFor(rec).Status(ctx, id)
		if serr != nil || !status.Running || !(mounted[rootfsDir(filepath.Join(dir, id))] || rec.PrivateRootfs || rec.Images) {
			statusErr[id] = serr
			continue
		}
		live[id] = true
		liveCgroups[rec.CgroupPath] = true
		if !e.claimCgroup(rec.CgroupPath, id) {
			e.log.Warn("two live sandboxes name one cgroup", "sandbox_id", id, "cgroup", rec.CgroupPath)
		}
	}
	refs := map[string]int{}
	adopted, failed, reaped := 0, 0, 0
	// What the sandboxes that died while the edge was down held is
	// released after this loop, many at a time: an edge back from a long
	// outage may have thousands, each a runtime destroy, unmounts and a
	// record write.
	var dead []func()
	var deadIDs []string
	for _, ent := range ents {
		id := ent.Name()
		sdir := filepath.Join(dir, id)
		rec, err := recs[id].rec, recs[id].err
		if err != nil || !ent.IsDir() {
			e.log.Warn("reaping sandbox dir without a valid record", "sandbox_id", id, "err", err)
			e.reapDir(ctx, id, sdir)
			reaped++
			continue
		}
		st := rec.Sandbox.State
		switch {
		case rec.Pooled:
			// The warm pool is made anew; nobody knew this one.
			e.log.Info("dropping a warm-pool sandbox of the previous run", "sandbox_id", id)
			e.reapDir(ctx, id, sdir)
			reaped++
			continue
		case st == api.StateCreating:
			e.log.Warn("reaping sandbox whose creation was interrupted", "sandbox_id", id)
			e.reapDir(ctx, id, sdir)
			reaped++
			continue
		case holdsResources(st):
			if live[id] {
				if !rec.Images {
					for _, d := range rec.Digests {
						refs[d]++
					}
				}
				adopted++
				break
			}
			// The sandbox died while the edge was down: release what it
			// held, keep its record as failed so the owner can see why.
			e.log.Debug("sandbox did not survive the edge restart", "sandbox_id", id, "err", statusErr[id])
			cg := rec.CgroupPath
			if liveCgroups[cg] || !e.claimCgroup(cg, id) {
				cg = "" // a live sandbox's now, or released already
			}
			now := time.Now().UTC()
			rec.Sandbox.State = api.StateFailed
			rec.Sandbox.Error = "sandbox exited while the edge was down"
			rec.Net = nil // its slot is freed by restoreNetwork
			rec.CgroupPath = ""
			rec.StoppedAt = &now
			dead = append(dead, func() {
				e.destroyRuntime(ctx, e.backendFor(rec), id, cg)
				if err := releaseHost(sdir); err != nil {
					// Its mounts stay (and its files under them) until a
					// later start manages: the record says failed either way.
					e.log.Warn("releasing the host state of a dead sandbox", "sandbox_id", id, "err", err)
				} else {
					e.clearRuntime(sdir)
				}
				if err := writeRecord(sdir, rec); err != nil {
					e.log.Warn("persisting failed sandbox", "sandbox_id", id, "err", err)
				}
			})
			deadIDs = append(deadIDs, id)
			failed++
		}
		s := &sbx{dir: sdir, rec: *rec}
		s.touch()
		if live[id] {
			e.reconcileFreezer(s)
			if rec.Images {
				// The backend holds the images again: so does the edge.
				var releases []func()
				if _, err := e.openImages(ctx, rec.Digests, &releases); err != nil {
					e.log.Warn("reopening the layer images of an adopted sandbox", "sandbox_id", id, "err", err)
				}
				s.releaseImages = func() {
					for _, r := range releases {
						r()
					}
				}
			}
		}
		e.mu.Lock()
		e.listLocked(id, s)
		if holdsResources(rec.Sandbox.State) {
			e.live++
			e.tenancyAddLocked(rec.Dedicated, 1)
		}
		e.mu.Unlock()
	}
	if len(dead) > 0 {
		e.log.Warn("sandboxes did not survive the edge restart: releasing what they held; their records say failed",
			"count", len(dead), "first", strings.Join(deadIDs[:min(len(deadIDs), 5)], ","))
		runAll(dead, recoverParallel)
	}
	if err := e.mounter.Recover(refs); err != nil {
		return err
	}
	// Runtime state and cgroups that belong to no live sandbox.
	for _, b := range e.backends() {
		ids, err := b.List(ctx)
		if err != nil {
			return err
		}
		for _, id := range ids {
			if !live[id] {
				e.log.Warn("reaping orphan runtime container", "sandbox_id", id, "backend", b.Name())
				e.destroyRuntime(ctx, b, id, e.cfg.CgroupParent+"/"+id)
				reaped++
			}
		}
	}
	for _, t := range e.cgroupTrees() {
		kids, err := e.deps.Cgroups.Children(t.parent)
		if err != nil {
			return err
		}
		// Free cgroup slots of the last run are removed too: which
		// were free was never written down, and the next creates make
		// new ones.
		for _, k := range kids {
			if t.slots != nil {
				t.slots.Seen(k)
			}
			rel := t.parent + "/" + k
			if liveCgroups[rel] {
				continue
			}
			if t.slots != nil && t.slots.Owns(rel) {
				e.log.Debug("removing cgroup slot of no live sandbox", "cgroup", rel)
			} else {
				e.log.Warn("reaping orphan cgroup", "cgroup", rel)
				reaped++
			}
			if err := e.deps.Cgroups.Remove(rel); err != nil {
				e.log.Warn("removing orphan cgroup", "cgroup", rel, "err", err)
			}
		}
	}
	// Bundles are needed only while a create runs.
	if e.cfg.BundleDir != "" {
		left, _ := os.ReadDir(e.cfg.BundleDir)
		for _, b := range left {
			_ = os.RemoveAll(filepath.Join(e.cfg.BundleDir, b.Name()))
		}
	}
	// Mounts under the sandboxes dir that belong to no live sandbox.
	if mounted, err = mountpoints(dir); err == nil {
		for mp := range mounted {
			id := strings.SplitN(strings.TrimPrefix(mp, dir+"/"), "/", 2)[0]
			if !live[id] {
				e.log.Warn("reaping orphan mount", "path", mp)
				_ = layer.UnmountOverlay(mp)
				reaped++
			}
		}
	}
	e.log.Info("recovery done", "adopted", adopted, "failed", failed, "reaped", reaped)
	return nil
}

// recoverParallel is how many dead sandboxes recovery releases at once
// (a backend bounds its own runtime calls further).
const recoverParallel = 16

// reapDir undoes whatever a sandbox dir may hold and removes it.
func (e *Edge) reapDir(ctx context.Context, id, sdir string) {
	for _, b := range e.backends() {
		e.destroyRuntime(ctx, b, id, e.cfg.CgroupParent+"/"+id)
	}
	if err := releaseHost(sdir); err != nil {
		e.log.Warn("releasing the host state of an orphan sandbox dir", "sandbox_id", id, "err", err)
		return
	}
	if err := e.removeTree(sdir); err != nil {
		e.log.Warn("removing orphan sandbox dir", "sandbox_id", id, "err", clip(err.Error(), maxLoggedError))
	}
}

// mountpoints returns the mount points at or below prefix.
func mountpoints(prefix string) (map[string]bool, error) {
	entries, err := mountinfo.Read()
	if err != nil {
		return nil, err
	}
	out := map[string]bool{}
	for _, m := range mountinfo.Under(entries, prefix) {
		out[m.MountPoint] = true
	}
	return out, nil
}

// reapLoop enforces TTL and idle timeouts and forgets stopped sandboxes
// after their retention.
func (e *Edge) reapLoop() {
	t := time.NewTicker(e.cfg.ReapInterval)
	defer t.Stop()
	for tick := 1; ; tick++ {
		select {
		case <-e.stop:
			return
		case <-t.C:
			e.reapOnce(time.Now(), tick%livenessEvery == 0)
			if tick%strayFreezeEvery == 0 {
				e.checkStrayFreezes(e.allSandboxes())
			}
		}
	}
}

// livenessEvery is how many reaper ticks pass between liveness checks of
// every running sandbox's init (a state-file and /proc read each).
const livenessEvery = 5

// reapOnce stops what has expired or died and forgets old records: the
// sandboxes due by now (due.go), or with full every sandbox, their inits'
// liveness checked, and the due queue rebuilt.
func (e *Edge) reapOnce(now time.Time, full bool) {
	checkLiveness := full
	var all []*sbx
	var rebuilt []dueEntry
	if full {
		all = e.allSandboxes()
		e.due.clear()
		rebuilt = make([]dueEntry, 0, len(all))
		defer func() { e.due.add(rebuilt) }()
	} else {
		all = e.due.popDue(now)
	}
	sem := make(chan struct{}, 8)
	for _, s := range all {
		// Only what the checks read (a whole record is a large copy, and
		// this runs every second over every sandbox).
		s.mu.Lock()
		id, state := s.rec.Sandbox.ID, s.rec.Sandbox.State
		expires, paused, stopped := s.rec.Sandbox.ExpiresAt, s.rec.Sandbox.PausedAt, s.rec.StoppedAt
		nodePaused := state == api.StatePaused && s.rec.Sandbox.PauseReason == api.PauseReasonDiskPressure
		idle := s.rec.Sandbox.Spec.IdleTimeout
		busy := s.going
		inFlight := s.ops
		// Queued again for when it is next due: whatever is done below
		// queues it anew (a stop, a forget unlists it), and with nothing
		// due yet this is its next look. (A full pass rebuilds the queue
		// in one go.)
		if full {
			if at := e.nextDueLocked(s); !at.IsZero() {
				rebuilt = append(rebuilt, dueEntry{at, s})
			}
		} else {
			e.scheduleLocked(s)
		}
		s.mu.Unlock()
		if busy {
			continue
		}
		if s.isPooled() {
			// No TTL or idle timeout in a pool; a dead one is dropped.
			if checkLiveness && !e.initAlive(id) {
				e.pool.drop(s)
				e.deletePooled(s)
			}
			continue
		}
		reason, final := "", api.StateStopped
		switch {
		case checkLiveness && state == api.StateRunning && !e.initAlive(id):
			reason, final = "sandbox init exited", api.StateFailed
		case (state == api.StateRunning || nodePaused) && expires != nil && now.After(*expires):
			reason = "ttl expired"
		case state == api.StatePaused && e.cfg.MaxPaused > 0 && paused != nil &&
			now.Sub(*paused) > e.cfg.MaxPaused:
			reason = "paused too long"
		case state == api.StateRunning && idle > 0 && inFlight == 0 &&
			now.Sub(s.active.get()) > time.Duration(idle)*time.Second:
			reason = "idle timeout"
		case !holdsResources(state) && stopped != nil && now.Sub(*stopped) > e.cfg.StoppedRetention:
			e.forget(s)
			continue
		default:
			continue
		}
		sem <- struct{}{}
		go func() {
			defer func() { <-sem }()
			e.stopSandbox(context.Background(), s, final, reason)
		}()
	}
	for range cap(sem) {
		sem <- struct{}{}
	}
	for _, t := range e.cgroupTrees() {
		if t.slots != nil {
			t.slots.Trim(slotsKeep, slotsTrimPerTick, slotsIdle)
		}
	}
}

// Free cgroup slots beyond slotsKeep are removed, slotsTrimPerTick per
// reaper tick, once no create took one for slotsIdle: a burst's slots
// serve the next burst, and a quiet node gives their kernel memory back.
const (
	slotsKeep        = 32
	slotsTrimPerTick = 32
	slotsIdle        = 30 * time.Second
)

// initAlive reports whether the backend still runs the sandbox. Errors
// other than not-found count as alive: a failed probe must not kill it.
func (e *Edge) initAlive(id string) bool {
	st, err := e.backendByID(id).Status(context.Background(), id)
	if errors.Is(err, errdefs.ErrNotFound) {
		return false
	}
	return err != nil || st.Running
}

// forget removes a stopped sandbox's record. Its directory goes to the
// trash, whose janitor retries what it cannot remove with a growing pause
// (the reaper would try again every second).
func (e *Edge) forget(s *sbx) {
	s.life.Lock()
	defer s.life.Unlock()
	s.mu.Lock()
	id := s.rec.Sandbox.ID
	s.mu.Unlock()
	if err := e.discard(s.dir); err != nil {
		e.log.Warn("removing stopped sandbox", "sandbox_id", id, "err", clip(err.Error(), maxLoggedError))
		return
	}
	e.mu.Lock()
	e.unlistLocked(id, s)
	e.mu.Unlock()
}

// A file write goes to a temporary file beside its target, renamed over it
// at the end (files.Root.WriteFile): an edge killed mid-write leaves the
// temporary in the sandbox for good (41 MB in the red team's run).
// tempName is how each one's name ends: ".dsec-tmp-" and 16 hex digits.
var tempName = regexp.MustCompile(`\.dsec-tmp-[0-9a-f]{16}$`)

// maxTempSweep bounds the entries one sandbox's sweep looks at.
const maxTempSweep = 1 << 20

// sweepTemps removes from the writable layers of the sandboxes adopted at
// start the temporary files of writes the last run left unfinished:
// regular files named as files.Root.WriteFile names them and older than
// this run (a write of this run's is left alone). The walk is on the host
// and follows no symlink; each removal goes through the sandbox's
// confined root, so a sandbox swapping a directory for a symlink
// meanwhile can make it remove nothing outside.
func (e *Edge) sweepTemps(adopted []*sbx, since time.Time) {
	for _, s := range adopted {
		select {
		case <-e.stop:
			return
		default:
		}
		upper := s.upperDir()
		var found []string
		seen := 0
		_ = filepath.WalkDir(upper, func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return nil
			}
			if seen++; seen > maxTempSweep {
				return filepath.SkipAll
			}
			if !d.Type().IsRegular() || !tempName.MatchString(d.Name()) {
				return nil
			}
			if info, err := d.Info(); err != nil || !info.ModTime().Before(since) {
				return nil
			}
			if rel, err := filepath.Rel(upper, p); err == nil {
				found = append(found, "/"+rel)
			}
			return nil
		})
		if len(found) == 0 {
			continue
		}
		root, err := e.root(s)
		if err != nil {
			continue
		}
		removed := 0
		for _, p := range found {
			if err := root.Remove(p, false); err == nil {
				removed++
			}
		}
		s.mu.Lock()
		id := s.rec.Sandbox.ID
		s.mu.Unlock()
		e.log.Info("removed the temporary files of interrupted file writes", "sandbox_id", id, "files", removed)
	}
}

// allSandboxes returns the node's sandboxes as they are now, for a walk
// that must not hold e.mu.
func (e *Edge) allSandboxes() []*sbx {
	e.mu.RLock()
	defer e.mu.RUnlock()
	all := make([]*sbx, 0, len(e.sandboxes))
	for _, s := range e.sandboxes {
		all = append(all, s)
	}
	return all
}
