package edge

import (
	"context"
	"io/fs"
	"path/filepath"
	"sort"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/api"
)

// The disk guard holds the state filesystem's floor against what running
// sandboxes write. A sandbox without a disk of its own (disk_mb) has its
// writable layer on that filesystem, where admission (checkDiskFloor)
// cannot bound it: it may write until the filesystem is full, and a full
// one fails every sandbox's writes and the edge's records alike. Every
// diskGuardEvery the guard reads the free space (one statfs). Below the
// floor it measures the writable layers of the running sandboxes without
// a disk of their own (their allocated blocks) and, from the second look
// on, pauses the one whose layer grew the most since the look before,
// with PauseReason disk_pressure: one per look, until free space is back
// above the floor. Its writes stop with it; what it wrote stays (a pause
// frees no disk), for its owner to look at, resume and clean up, or
// delete. A sandbox that does not write is never paused: when the space
// went to something else, the guard only says so (once a minute) and
// looks less often.
//
// What gets past it is what sandboxes write in about two looks, plus the
// time to walk their writable layers (a layer of a million files takes
// seconds): the floor (1 GiB at least by default) is the margin.

// diskGuardEvery is how often the guard reads the free space, and
// measures the writable layers while it is below the floor and they grow;
// diskGuardIdle is how often it measures them while nothing grows.
const (
	diskGuardEvery = 100 * time.Millisecond
	diskGuardIdle  = time.Second
)

// diskResumeGrace is how long a sandbox the guard paused is left alone
// after a resume, to remove what it wrote, unless free space falls below
// half the floor.
const diskResumeGrace = 30 * time.Second

// stateFree returns the state filesystem's free space and the floor it is
// held at (Config.MinFreeDiskMB; -1 resolved); ok is false without a
// floor or when the filesystem cannot be read.
func (e *Edge) stateFree() (free, floor int64, ok bool) {
	floor = e.cfg.MinFreeDiskMB << 20
	if floor == 0 {
		return 0, 0, false
	}
	var st unix.Statfs_t
	if err := unix.Statfs(e.cfg.StateDir, &st); err != nil {
		return 0, 0, false
	}
	size, free := int64(st.Blocks)*st.Bsize, int64(st.Bavail)*st.Bsize
	if floor < 0 {
		floor = min(max(size/50, 1<<30), 20<<30)
	}
	return free, floor, true
}

// diskGuard runs the guard until the edge stops.
func (e *Edge) diskGuard() {
	if e.cfg.MinFreeDiskMB == 0 {
		return
	}
	t := time.NewTicker(diskGuardEvery)
	defer t.Stop()
	var (
		last       map[string]int64 // writable layers at the last look; nil above the floor
		nextLook   time.Time
		quietUntil time.Time
	)
	for {
		select {
		case <-e.stop:
			return
		case <-t.C:
		}
		free, floor, ok := e.stateFree()
		if !ok || free >= floor {
			last = nil
			continue
		}
		now := time.Now()
		if now.Before(nextLook) {
			continue
		}
		first := last == nil
		var grew bool
		last, grew = e.relieveDisk(last, free, floor)
		nextLook = now.Add(diskGuardEvery)
		if !grew && !first {
			nextLook = now.Add(diskGuardIdle)
			if now.After(quietUntil) {
				quietUntil = now.Add(time.Minute)
				e.log.Warn("the state filesystem is below its floor and no running sandbox without a disk of its own is writing to it",
					"node", e.cfg.Name, "free_mib", free>>20, "floor_mib", floor>>20)
			}
		}
	}
}

// relieveDisk measures the writable layers of the sandboxes the guard may
// pause, and pauses the one that grew the most since last (the sizes at
// the look before; nil at the first look below the floor). It returns the
// sizes now, and whether a layer grew.
func (e *Edge) relieveDisk(last map[string]int64, free, floor int64) (map[string]int64, bool) {
	type held struct {
		id          string
		bytes, grew int64
	}
	start := time.Now()
	var cands []held
	sizes := map[string]int64{}
	for _, s := range e.allSandboxes() {
		s.mu.Lock()
		id, state := s.rec.Sandbox.ID, s.rec.Sandbox.State
		skip := state != api.StateRunning || s.going || s.pooled || s.rec.Disk || s.rec.Images ||
			start.Sub(s.diskResumed) < diskResumeGrace && free > floor/2
		s.mu.Unlock()
		if skip {
			continue
		}
		n := allocatedBytes(s.upperDir())
		sizes[id] = n
		if before, ok := last[id]; ok && n > before {
			cands = append(cands, held{id: id, bytes: n, grew: n - before})
		}
	}
	sort.Slice(cands, func(i, j int) bool { return cands[i].grew > cands[j].grew })
	for _, c := range cands {
		if _, err := e.pause(context.Background(), c.id, api.PauseReasonDiskPressure); err != nil {
			e.log.Warn("pausing a sandbox for disk pressure", "sandbox_id", c.id, "err", err)
			continue
		}
		delete(sizes, c.id)
		e.metrics.diskPressurePauses.Inc()
		e.log.Warn("state filesystem below its floor: paused the sandbox writing the most to it",
			"sandbox_id", c.id, "grew_mib", c.grew>>20, "holds_mib", c.bytes>>20,
			"free_mib", free>>20, "floor_mib", floor>>20, "took_ms", time.Since(start).Milliseconds())
		break
	}
	return sizes, len(cands) > 0
}

// allocatedBytes is what the files and directories below dir take on disk
// (their allocated blocks: a sparse file counts what it holds).
func allocatedBytes(dir string) int64 {
	var n int64
	_ = filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		if info, err := d.Info(); err == nil {
			if st, ok := info.Sys().(*syscall.Stat_t); ok {
				n += st.Blocks * 512
			}
		}
		return nil
	})
	return n
}
