package edge

import (
	"context"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/sandbox"
)

// Pause freezes a running sandbox (cgroup freezer, v1 or v2) and then
// reclaims its memory, reporting how much was freed. Pausing a paused
// sandbox succeeds and frees nothing. The TTL does not run while paused;
// commands in flight are frozen with the sandbox and finish (or time out)
// after it resumes.
func (e *Edge) Pause(ctx context.Context, id string) (*api.PauseResult, error) {
	return e.pause(ctx, id, "")
}

// pause is Pause, recording reason (api.Sandbox.PauseReason) when the
// node pauses the sandbox of its own accord.
func (e *Edge) pause(ctx context.Context, id, reason string) (*api.PauseResult, error) {
	s, err := e.get(ctx, id)
	if err != nil {
		return nil, err
	}
	pauser, byBackend := e.backendOf(s).(sandbox.Pauser)
	if !byBackend && e.deps.Cgroups == nil {
		return nil, errdefs.Precondition("pause needs cgroups, which this edge runs without")
	}
	start := time.Now()
	if reason == "" {
		s.life.Lock()
	} else if !s.life.TryLock() {
		// The node's own pause does not wait behind a snapshot or a
		// delete: the guard looks again in a moment.
		return nil, errdefs.Unavailable("sandbox %s is busy (a snapshot, fork or delete); not paused now", id)
	}
	defer s.life.Unlock()
	s.mu.Lock()
	state, cg := s.rec.Sandbox.State, s.rec.CgroupPath
	s.mu.Unlock()
	switch state {
	case api.StatePaused:
		if reason == "" {
			// Paused by the node, and now asked for: the caller's pause,
			// which stops the TTL.
			s.mu.Lock()
			if s.rec.Sandbox.PauseReason != "" {
				s.rec.Sandbox.PauseReason = ""
				if err := s.persistLocked(); err != nil {
					e.log.Warn("persisting a pause asked for", "sandbox_id", id, "err", err)
				}
			}
			s.mu.Unlock()
		}
		return &api.PauseResult{Sandbox: s.view()}, nil
	case api.StateRunning:
	default:
		return nil, errdefs.Precondition("sandbox %s is %s; only a running sandbox can be paused", id, state)
	}
	res := &api.PauseResult{}
	thaw := func() { _ = e.deps.Cgroups.Thaw(cg) }
	if byBackend {
		// What the sandbox's cgroup holds before and after: a backend
		// whose pause ends its processes (a VM saved to a file) gives
		// their memory back; one that stops them keeps it.
		var before uint64
		if e.deps.Cgroups != nil && cg != "" {
			if st, err := e.deps.Cgroups.Stats(cg); err == nil {
				before = st.MemoryBytes
			}
		}
		if err := pauser.Pause(ctx, id); err != nil {
			return nil, err
		}
		thaw = func() { _ = pauser.Resume(context.Background(), id) }
		if e.deps.Cgroups != nil && cg != "" && before > 0 {
			if st, err := e.deps.Cgroups.Stats(cg); err == nil {
				res.MemoryBeforeBytes, res.MemoryAfterBytes = before, st.MemoryBytes
				if st.MemoryBytes < before {
					res.MemoryFreedBytes = before - st.MemoryBytes
				}
				res.ReclaimMethod = "backend"
			}
		}
	} else {
		if err := e.deps.Cgroups.Freeze(ctx, cg); err != nil {
			return nil, err
		}
		// The node's own pause stops writes and keeps the memory:
		// reclaiming it would write its dirty pages back onto the
		// filesystem short of space, and take long doing it.
		if reason == "" {
			rec, err := e.deps.Cgroups.Reclaim(cg)
			if err != nil {
				// The sandbox is paused all the same; it just keeps its memory.
				e.log.Warn("reclaiming memory of paused sandbox", "sandbox_id", id, "err", err)
			} else {
				res.MemoryBeforeBytes, res.MemoryAfterBytes, res.MemoryFreedBytes = rec.BeforeBytes, rec.AfterBytes, rec.Freed()
				res.ReclaimMethod = rec.Method
			}
		}
	}
	now := time.Now().UTC()
	s.mu.Lock()
	s.rec.Sandbox.State = api.StatePaused
	s.rec.Sandbox.PausedAt = &now
	s.rec.Sandbox.PauseReason = reason
	e.recountLocked(s)
	err = s.persistLocked()
	s.mu.Unlock()
	if err != nil {
		// Keep memory and disk in agreement: undo the freeze.
		thaw()
		s.mu.Lock()
		s.rec.Sandbox.State, s.rec.Sandbox.PausedAt, s.rec.Sandbox.PauseReason = api.StateRunning, nil, ""
		e.recountLocked(s)
		s.mu.Unlock()
		return nil, err
	}
	res.Sandbox = s.view()
	res.DurationMS = time.Since(start).Milliseconds()
	e.metrics.pauseSeconds.Observe(time.Since(start).Seconds())
	e.metrics.pauseFreed.Observe(float64(res.MemoryFreedBytes))
	e.log.Info("sandbox paused", "sandbox_id", id, "freed_bytes", res.MemoryFreedBytes, "ms", res.DurationMS)
	return res, nil
}

// Resume prefetches a paused sandbox's file-backed memory (asynchronous
// readahead) and thaws it; its expiry moves later by the time it was
// paused. Resuming a running sandbox succeeds and does nothing.
func (e *Edge) Resume(ctx context.Context, id string) (*api.Sandbox, error) {
	s, err := e.get(ctx, id)
	if err != nil {
		return nil, err
	}
	start := time.Now()
	s.life.Lock()
	defer s.life.Unlock()
	s.mu.Lock()
	state, cg := s.rec.Sandbox.State, s.rec.CgroupPath
	s.mu.Unlock()
	switch state {
	case api.StateRunning:
		// Running, unless a pause or snapshot was cut short after its
		// freeze: then resume is what thaws it.
		e.thawStray(s, "resume")
		v := s.view()
		return &v, nil
	case api.StatePaused:
	default:
		return nil, errdefs.Precondition("sandbox %s is %s; only a paused sandbox can be resumed", id, state)
	}
	ranges := 0
	if pauser, ok := e.backendOf(s).(sandbox.Pauser); ok {
		if err := pauser.Resume(ctx, id); err != nil {
			return nil, err
		}
	} else {
		if e.deps.Cgroups == nil {
			return nil, errdefs.Precondition("resume needs cgroups, which this edge runs without")
		}
		// Start reading back the reclaimed file pages before the
		// processes run again, so they do not fault their working set
		// in one page at a time.
		var perr error
		if ranges, perr = e.deps.Cgroups.Prefetch(cg); perr != nil {
			e.log.Debug("prefetching before resume", "sandbox_id", id, "err", perr)
		}
		if err := e.deps.Cgroups.Thaw(cg); err != nil {
			return nil, err
		}
	}
	now := time.Now().UTC()
	s.mu.Lock()
	// A pause asked for stops the TTL; the node's own does not.
	if p := s.rec.Sandbox.PausedAt; p != nil && s.rec.Sandbox.ExpiresAt != nil && s.rec.Sandbox.PauseReason == "" {
		exp := s.rec.Sandbox.ExpiresAt.Add(now.Sub(*p))
		s.rec.Sandbox.ExpiresAt = &exp
	}
	if s.rec.Sandbox.PauseReason == api.PauseReasonDiskPressure {
		s.diskResumed = now
	}
	s.rec.Sandbox.State, s.rec.Sandbox.PausedAt, s.rec.Sandbox.PauseReason = api.StateRunning, nil, ""
	e.recountLocked(s)
	err = s.persistLocked()
	v := s.viewLocked()
	s.mu.Unlock()
	s.touch()
	if err != nil {
		// Running in memory and on the host; the record catches up at the
		// next write. Say so rather than fail a resume that happened.
		e.log.Warn("persisting resumed sandbox", "sandbox_id", id, "err", err)
	}
	e.metrics.resumeSeconds.Observe(time.Since(start).Seconds())
	e.log.Info("sandbox resumed", "sandbox_id", id, "prefetched_ranges", ranges, "ms", time.Since(start).Milliseconds())
	return &v, nil
}

// PauseByLabels pauses every running sandbox whose labels contain sel.
func (e *Edge) PauseByLabels(ctx context.Context, sel map[string]string) (int, error) {
	return e.byLabels(ctx, sel, api.StateRunning, func(id string) error {
		_, err := e.Pause(ctx, id)
		return err
	})
}

// ResumeByLabels resumes every paused sandbox whose labels contain sel.
func (e *Edge) ResumeByLabels(ctx context.Context, sel map[string]string) (int, error) {
	return e.byLabels(ctx, sel, api.StatePaused, func(id string) error {
		_, err := e.Resume(ctx, id)
		return err
	})
}

// byLabels applies fn to the sandboxes in state matching sel, a few at a
// time, and returns how many succeeded and the first error.
func (e *Edge) byLabels(ctx context.Context, sel map[string]string, state string, fn func(id string) error) (int, error) {
	if len(sel) == 0 {
		return 0, errdefs.Invalid("labels are required")
	}
	list := e.list(ctx, edgeapi.ListFilter{State: state, Labels: sel})
	errs := make([]error, len(list))
	fns := make([]func(), len(list))
	for i, sb := range list {
		fns[i] = func() { errs[i] = fn(sb.ID) }
	}
	runAll(fns, 8)
	n := 0
	var first error
	for _, err := range errs {
		if err == nil {
			n++
		} else if first == nil {
			first = err
		}
	}
	return n, first
}

// thawStray thaws a sandbox whose record says running but whose cgroup is
// frozen: a pause or a snapshot cut short between its freeze and its
// record write or thaw (the edge killed in between), which would
// otherwise hang every exec for good. The caller holds s.life, so no
// pause, resume or snapshot of the sandbox is under way. It reports
// whether it thawed anything.
func (e *Edge) thawStray(s *sbx, why string) bool {
	s.mu.Lock()
	state, cg, id := s.rec.Sandbox.State, s.rec.CgroupPath, s.rec.Sandbox.ID
	s.mu.Unlock()
	if state != api.StateRunning {
		return false
	}
	be := e.backendOf(s)
	if pauser, ok := be.(sandbox.Pauser); ok {
		// A backend that pauses by itself (gVisor's Sentry stops its
		// tasks, a VM is saved): a pause cut short after the backend's
		// and before the record's leaves it paused.
		st, err := be.Status(context.Background(), id)
		if err != nil || !st.Paused {
			return false
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := pauser.Resume(ctx, id); err != nil {
			e.log.Warn("resuming a running sandbox left paused", "sandbox_id", id, "why", why, "err", err)
			return false
		}
		e.metrics.strayThaws.Inc()
		e.log.Warn("resumed a running sandbox left paused (an interrupted pause)", "sandbox_id", id, "why", why)
		return true
	}
	if e.deps.Cgroups == nil || cg == "" {
		return false
	}
	frozen, err := e.deps.Cgroups.Frozen(cg)
	if err != nil || !frozen {
		return false
	}
	if err := e.deps.Cgroups.Thaw(cg); err != nil {
		e.log.Warn("thawing a running sandbox left frozen", "sandbox_id", id, "why", why, "err", err)
		return false
	}
	e.metrics.strayThaws.Inc()
	e.log.Warn("thawed a running sandbox left frozen (an interrupted pause or snapshot)", "sandbox_id", id, "why", why)
	return true
}

func isPauser(be sandbox.Backend) bool { _, ok := be.(sandbox.Pauser); return ok }

// strayFreezeEvery is how many reaper ticks pass between checks that no
// running sandbox is frozen (a cgroup file read each).
const strayFreezeEvery = 10

// checkStrayFreezes thaws every running sandbox left frozen, skipping
// those a pause, resume or snapshot holds now.
func (e *Edge) checkStrayFreezes(all []*sbx) {
	for _, s := range all {
		if !s.life.TryLock() {
			continue
		}
		e.thawStray(s, "liveness check")
		s.life.Unlock()
	}
}

// reconcileFreezer brings an adopted sandbox's record and its freezer
// into agreement after a restart: running but frozen (a pause or snapshot
// cut short after its freeze) is thawed; paused but thawed (a resume cut
// short after its thaw) is running, as the resume asked.
func (e *Edge) reconcileFreezer(s *sbx) {
	if e.thawStray(s, "recovery") {
		return
	}
	s.mu.Lock()
	state, cg, id := s.rec.Sandbox.State, s.rec.CgroupPath, s.rec.Sandbox.ID
	s.mu.Unlock()
	if state != api.StatePaused {
		return
	}
	if be := e.backendOf(s); isPauser(be) {
		st, err := be.Status(context.Background(), id)
		if err != nil || !st.Running || st.Paused {
			return
		}
	} else if e.deps.Cgroups == nil || cg == "" {
		return
	} else if frozen, err := e.deps.Cgroups.Frozen(cg); err != nil || frozen {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.rec.Sandbox.State != api.StatePaused {
		return
	}
	s.rec.Sandbox.State, s.rec.Sandbox.PausedAt, s.rec.Sandbox.PauseReason = api.StateRunning, nil, ""
	e.recountLocked(s)
	if err := s.persistLocked(); err != nil {
		e.log.Warn("persisting a sandbox found thawed", "sandbox_id", s.rec.Sandbox.ID, "err", err)
	}
	e.log.Warn("a paused sandbox was found thawed (a resume cut short): running", "sandbox_id", s.rec.Sandbox.ID)
}
