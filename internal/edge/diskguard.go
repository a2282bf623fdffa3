package edge

import (
	"context"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/api"
)

// The disk guard holds the state filesystem's floor against what running
// sandboxes write. A sandbox without a disk of its own (disk_mb) has its
// writable layer on that filesystem, where admission (checkDiskFloor)
// cannot bound it: it may write until the filesystem is full, and a full
// one fails every sandbox's writes and the edge's records alike.
//
// Every diskGuardEvery the guard reads the free space (one statfs). Below
// the floor, and while the free space keeps falling, it measures what the
// running container and gVisor sandboxes without a disk of their own
// write: the bytes their processes dirtied (write_bytes of /proc/<pid>/io,
// per process over the sandbox's cgroup: it counts writes to files
// removed while open, and a reaped process's count goes to its parent),
// every look; and the allocated blocks of their writable layers (which
// also see fallocate), every diskGuardWalk, as walking a large layer is
// costly. It pauses the sandbox that grew the fastest by either measure
// since the look before, at least diskGuardMinRate, with PauseReason
// disk_pressure: one per look. While free space is less than twice the
// floor the bytes written are also sampled every diskGuardNear, so that
// the first look below the floor can already act on them; far from the
// floor the guard costs one statfs a look. The paused sandbox's writes
// stop with it; what it wrote stays (a pause frees no disk) for its owner
// to look at, resume and clean up, or delete, and its TTL runs on.
//
// What gets past it is what sandboxes write in about a look (two walks
// for fallocate), plus the time to measure and to freeze: the floor (1 GiB
// at least by default) is the margin. A single call that allocates more
// than the floor at once (fallocate of a large file) is beyond any look;
// a sandbox that must not be able to do that gets disk_mb.

const (
	// diskGuardEvery is how often the guard reads the free space, and
	// below the floor the bytes written.
	diskGuardEvery = 100 * time.Millisecond
	// diskGuardWalk is how often, below the floor, it walks the writable
	// layers.
	diskGuardWalk = time.Second
	// diskGuardNear is how often it samples the bytes written while free
	// space is above the floor but less than twice it.
	diskGuardNear = time.Second
	// diskGuardMinRate is the least a sandbox must have written a second
	// since the look before to be paused: a log line is not the cause of
	// a full disk.
	diskGuardMinRate = 10 << 20
	// diskGuardPauseTimeout bounds one pause by the guard.
	diskGuardPauseTimeout = 30 * time.Second
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

// diskSample is what the guard measured of one sandbox at a time: the
// allocated bytes of its writable layer (-1: not walked then) and the
// bytes each of its processes had written.
type diskSample struct {
	at      time.Time
	written map[int]int64
	// layer was measured at layerAt: by the last walk, carried over
	// looks that do not walk.
	layer   int64
	layerAt time.Time
}

// diskGuard runs the guard until the edge stops.
func (e *Edge) diskGuard() {
	if e.cfg.MinFreeDiskMB == 0 {
		return
	}
	t := time.NewTicker(diskGuardEvery)
	defer t.Stop()
	var (
		last       map[string]diskSample // at the last look (or sample near the floor)
		lastFree   int64
		lastLook   time.Time
		lastWalk   time.Time // zero: not below the floor at the last look
		quietUntil time.Time
	)
	for {
		select {
		case <-e.stop:
			return
		case <-t.C:
		}
		free, floor, ok := e.stateFree()
		if !ok {
			continue
		}
		now := time.Now()
		if free >= floor {
			// Near the floor, what is written is sampled now and then,
			// so that the first look below it can already tell who
			// writes; far from it, nothing is.
			lastWalk = time.Time{}
			if free >= 2*floor {
				last = nil
			} else if now.Sub(lastLook) >= diskGuardNear {
				last, _ = e.relieveDisk(last, false, false, free, floor)
				lastLook = now
			}
			lastFree = free
			continue
		}
		crossed := lastWalk.IsZero()
		falling := crossed || free < lastFree
		lastFree = free
		walk := crossed || now.Sub(lastWalk) >= diskGuardWalk
		if !falling && !walk {
			continue
		}
		if walk {
			lastWalk = now
		}
		var paused bool
		last, paused = e.relieveDisk(last, walk, falling, free, floor)
		lastLook = now
		if falling && !crossed && !paused && walk && now.After(quietUntil) {
			quietUntil = now.Add(time.Minute)
			e.log.Warn("the state filesystem is below its floor and losing space, but no running sandbox without a disk of its own is writing much to it",
				"node", e.cfg.Name, "free_mib", free>>20, "floor_mib", floor>>20)
		}
	}
}

// relieveDisk measures the sandboxes the guard may pause (their layers
// only with walk) and, with pause, pauses the one that wrote the most a
// second since last (nil at the first look below the floor). It returns
// the samples now, and whether it paused a sandbox.
func (e *Edge) relieveDisk(last map[string]diskSample, walk, pause bool, free, floor int64) (map[string]diskSample, bool) {
	type grown struct {
		id          string
		rate, layer int64
	}
	start := time.Now()
	var cands []grown
	samples := map[string]diskSample{}
	for _, s := range e.allSandboxes() {
		s.mu.Lock()
		id, state, cg := s.rec.Sandbox.ID, s.rec.Sandbox.State, s.rec.CgroupPath
		skip := state != api.StateRunning || s.going || s.pooled || s.rec.Disk || s.rec.Images ||
			start.Sub(s.diskResumed) < diskResumeGrace && free > floor/2
		s.mu.Unlock()
		if skip {
			continue
		}
		before, seen := last[id]
		now := diskSample{at: time.Now(), layer: -1, written: e.writtenByPid(cg)}
		if walk {
			now.layer, now.layerAt = allocatedBytes(s.upperDir()), now.at
		} else if seen {
			now.layer, now.layerAt = before.layer, before.layerAt
		}
		samples[id] = now
		if !seen {
			continue
		}
		// What each process wrote since: a process new since then counts
		// whole, one whose count fell (its pid reused) not at all; a
		// reaped child's count moves to its parent, which counts it
		// again, which only points at a sandbox that writes.
		var grew int64
		for pid, w := range now.written {
			grew += max(0, w-before.written[pid])
		}
		perSec := func(n int64, since time.Time) int64 {
			return int64(float64(n) / max(now.at.Sub(since).Seconds(), diskGuardEvery.Seconds()))
		}
		rate := perSec(grew, before.at)
		if walk && before.layer >= 0 {
			rate = max(rate, perSec(now.layer-before.layer, before.layerAt))
		}
		if rate >= diskGuardMinRate {
			cands = append(cands, grown{id: id, rate: rate, layer: now.layer})
		}
	}
	if !pause {
		return samples, false
	}
	sort.Slice(cands, func(i, j int) bool { return cands[i].rate > cands[j].rate })
	for _, c := range cands {
		ctx, cancel := context.WithTimeout(context.Background(), diskGuardPauseTimeout)
		res, err := e.pause(ctx, c.id, api.PauseReasonDiskPressure)
		cancel()
		if err != nil {
			e.log.Warn("pausing a sandbox for disk pressure", "sandbox_id", c.id, "err", err)
			continue
		}
		delete(samples, c.id)
		if res.Sandbox.PauseReason != api.PauseReasonDiskPressure {
			continue // paused by its owner meanwhile
		}
		e.metrics.diskPressurePauses.Inc()
		e.log.Warn("state filesystem below its floor: paused the sandbox writing the most to it",
			"sandbox_id", c.id, "mib_per_s", c.rate>>20, "layer_mib", c.layer>>20,
			"free_mib", free>>20, "floor_mib", floor>>20, "took_ms", time.Since(start).Milliseconds())
		return samples, true
	}
	return samples, false
}

// writtenByPid is what each process in cgroup cg has written (dirtied)
// since it started, with what its reaped children wrote: nil without
// cgroups.
func (e *Edge) writtenByPid(cg string) map[int]int64 {
	if e.deps.Cgroups == nil || cg == "" {
		return nil
	}
	pids, err := e.deps.Cgroups.Procs(cg)
	if err != nil {
		return nil
	}
	out := make(map[int]int64, len(pids))
	for _, pid := range pids {
		b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/io")
		if err != nil {
			continue // gone
		}
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "write_bytes: "); ok {
				out[pid], _ = strconv.ParseInt(v, 10, 64)
			}
		}
	}
	return out
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
