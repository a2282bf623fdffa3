package cgroup

import (
	"errors"
	"fmt"
	"io/fs"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Slots hands out the cgroups of sandboxes under one parent and takes them
// back when a sandbox is gone, so that the next sandbox reuses an emptied
// cgroup instead of the runtime creating a new one.
//
// Why: a cgroup costs a mkdir in every hierarchy (11 on a hybrid host),
// and each new memory cgroup allocates per-cgroup kernel state sized by
// the host's shrinker count, which grows with every superblock ever
// mounted (several per sandbox). Removing one offlines the memory cgroup,
// which walks every list_lru and shrinker of the host under cgroup_mutex;
// the cgroup then lingers as a dying memcg for as long as page cache
// charged to it stays cached. In a burst of 1,000 deletes that offline
// work was a third of the node's CPU (issue 7's profile).
//
// A slot is reused only when it provably holds nothing: no process in any
// hierarchy, no child cgroup, and every limit and setting dsec or the
// runtime may have written set back to the kernel's default. Memory still
// charged to it (page cache of the layers the sandbox read, slab) is
// reclaimed down to slotReclaimAbove. Anything short of that (memory that
// does not come back included) and the slot is removed instead.
//
// Slots are named s-N below the parent. A sandbox's record stores the
// path it got, so nothing derives a sandbox's cgroup from its id.
type Slots struct {
	info   *Info
	parent string
	// max is the number of free slots kept; Put removes slots beyond it.
	max int

	mu   sync.Mutex
	free []string // LIFO: the most recently emptied slot is reused first
	// owner maps each slot handed out (Get, Claim) and not yet put back
	// to the sandbox holding it. Only that sandbox's Put is taken: a
	// second Put (a teardown retried after it released the slot, a dead
	// sandbox's record still naming a slot given to another since) could
	// otherwise reset or kill the slot's new sandbox, or hand one cgroup
	// to two sandboxes.
	owner map[string]string
	// resetting counts Puts between the check against max and the
	// append, so that concurrent Puts do not keep more than max.
	resetting int
	next      uint64
	lastGet   time.Time
}

// slotPrefix starts every slot's name.
const slotPrefix = "s-"

// NewSlots returns the slots below parent, keeping at most max free ones.
// Call Seen for every existing child of parent before the first Get, so
// new names do not collide with cgroups left by an earlier run.
func (i *Info) NewSlots(parent string, max int) (*Slots, error) {
	if err := checkRel(parent); err != nil {
		return nil, err
	}
	return &Slots{info: i, parent: parent, max: max, next: 1, owner: map[string]string{}}, nil
}

// Claim marks rel, the cgroup a record found at recovery names, as held
// by sandbox id, so that id's Put is taken. It reports false when another
// sandbox holds rel already (claim the live sandboxes first) or rel is
// free (put back by another record naming it).
func (s *Slots) Claim(rel, id string) bool {
	if !s.Owns(rel) {
		return true
	}
	s.Seen(path.Base(rel))
	s.mu.Lock()
	defer s.mu.Unlock()
	if o, held := s.owner[rel]; held && o != id {
		return false
	}
	if slices.Contains(s.free, rel) {
		return false
	}
	s.owner[rel] = id
	return true
}

// Seen records an existing child cgroup name of the parent, so that Get
// never names a new slot after it.
func (s *Slots) Seen(name string) {
	n, ok := slotNumber(name)
	if !ok {
		return
	}
	s.mu.Lock()
	s.next = max(s.next, n+1)
	s.mu.Unlock()
}

func slotNumber(name string) (uint64, bool) {
	num, ok := strings.CutPrefix(name, slotPrefix)
	if !ok {
		return 0, false
	}
	n, err := strconv.ParseUint(num, 10, 64)
	return n, err == nil && strconv.FormatUint(n, 10) == num
}

// Get returns the cgroup path for new sandbox id: an emptied slot when
// there is one, else a new name for the runtime to create. cpuBase is the
// CPU time the slot has already counted (cgroup v2's cpu.stat cannot be
// reset): the sandbox's own use is the counter minus cpuBase.
func (s *Slots) Get(id string) (rel string, cpuBase uint64) {
	s.mu.Lock()
	s.lastGet = time.Now()
	if n := len(s.free); n > 0 {
		rel = s.free[n-1]
		s.free = s.free[:n-1]
		s.mu.Unlock()
		base, err := s.info.cpuUsage(rel)
		if err != nil {
			// It vanished or cannot be read: a fresh slot instead, the
			// old one removed (it is nobody's now).
			_ = s.info.Remove(rel)
			return s.Get(id)
		}
		s.mu.Lock()
		s.owner[rel] = id
		s.mu.Unlock()
		return rel, base
	}
	rel = path.Join(s.parent, slotPrefix+strconv.FormatUint(s.next, 10))
	s.next++
	s.owner[rel] = id
	s.mu.Unlock()
	return rel, 0
}

// Owns reports whether rel is one of these slots (a record written by an
// older dsec names its cgroup after the sandbox instead).
func (s *Slots) Owns(rel string) bool {
	dir, name := path.Split(rel)
	_, ok := slotNumber(name)
	return ok && path.Clean(dir) == s.parent
}

// Put takes rel back once its sandbox's processes are gone. It resets the
// slot for the next sandbox, or removes it (killing anything left) when
// the slot is not provably empty, a reset fails, or max slots are free
// already. A path that is not a slot is removed; a slot sandbox id does
// not hold (put back already, perhaps handed to another) is left alone.
func (s *Slots) Put(rel, id string) error {
	if !s.Owns(rel) {
		return s.info.Remove(rel)
	}
	s.mu.Lock()
	if o, held := s.owner[rel]; !held || o != id {
		s.mu.Unlock()
		return nil
	}
	delete(s.owner, rel)
	full := len(s.free)+s.resetting >= s.max
	if !full {
		s.resetting++
	}
	s.mu.Unlock()
	if full {
		return s.info.Remove(rel)
	}
	err := s.info.resetSlot(rel)
	s.mu.Lock()
	s.resetting--
	if err == nil {
		s.free = append(s.free, rel)
	}
	s.mu.Unlock()
	if err != nil {
		return s.info.Remove(rel)
	}
	return nil
}

// Free returns the number of free slots.
func (s *Slots) Free() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.free)
}

// FreeSlots returns the free slots' paths, most recently freed last.
func (s *Slots) FreeSlots() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.free...)
}

// Trim removes up to n of the longest-free slots beyond keep, but only
// when no Get came for idle: free slots cost kernel memory, so a pool a
// burst left behind shrinks back once creates stop. It returns how many
// it removed. Slots are taken off the list one at a time, as each is
// removed, so at most one is neither free nor gone (bench density counts
// on that).
func (s *Slots) Trim(keep, n int, idle time.Duration) int {
	removed := 0
	for removed < n {
		s.mu.Lock()
		if len(s.free) <= keep || time.Since(s.lastGet) < idle {
			s.mu.Unlock()
			break
		}
		rel := s.free[0]
		s.free = s.free[1:]
		s.mu.Unlock()
		_ = s.info.Remove(rel)
		removed++
	}
	return removed
}

// Drain removes every free slot.
func (s *Slots) Drain() error {
	s.mu.Lock()
	victims := s.free
	s.free = nil
	s.mu.Unlock()
	var errs []error
	for _, rel := range victims {
		errs = append(errs, s.info.Remove(rel))
	}
	return errors.Join(errs...)
}

// errNotReusable says a slot cannot be reused; the caller removes it.
var errNotReusable = errors.New("cgroup slot not reusable")

// resetSlot checks that rel holds nothing in any hierarchy and puts every
// setting a sandbox's runtime or dsec may have written back to the
// kernel's default, after reclaiming memory still charged to it.
//
// The sandbox itself cannot have changed anything here: it has no
// cgroupfs mounted and no capability to mount one (CAP_SYS_ADMIN is not
// in its set; in a user namespace the kernel refuses v1 mounts, and a
// cgroup2 mount is checked for child cgroups below).
func (i *Info) resetSlot(rel string) error {
	if err := checkRel(rel); err != nil {
		return err
	}
	for _, root := range i.rootsOf(rel) {
		dir := filepath.Join(root, rel)
		pids, err := readPids(filepath.Join(dir, "cgroup.procs"))
		if err != nil {
			return fmt.Errorf("%w: %v", errNotReusable, err)
		}
		if len(pids) > 0 {
			return fmt.Errorf("%w: %d processes left in %s", errNotReusable, len(pids), dir)
		}
	}
	if i.V2Root != "" {
		st, err := readKeyed(filepath.Join(i.V2Root, rel, "cgroup.stat"))
		if err != nil {
			return fmt.Errorf("%w: %v", errNotReusable, err)
		}
		if st["nr_descendants"] > 0 {
			return fmt.Errorf("%w: %d child cgroups", errNotReusable, st["nr_descendants"])
		}
	}
	if err := i.shrinkSlot(rel); err != nil {
		return fmt.Errorf("%w: %v", errNotReusable, err)
	}
	for _, w := range i.slotDefaults(rel) {
		if err := w.apply(); err != nil {
			return fmt.Errorf("%w: resetting %s: %v", errNotReusable, w.file, err)
		}
	}
	return nil
}

// slotReclaimAbove is the memory a free slot may stay charged with (page
// cache of the layers its last sandbox read, a little slab). Past it,
// shrinkSlot reclaims. Below, reclaiming costs more than it gives back:
// a kill leaves some 20-30 KiB of kernel memory that no reclaim frees,
// and memory.force_empty retries on that with 100 ms waits.
const slotReclaimAbove = 4 << 20

// shrinkSlot reclaims the memory still charged to an emptied slot when
// there is more than slotReclaimAbove: on v1 by lowering its limit to
// that (the kernel reclaims until under it, stopping at the first pass
// that frees nothing, EBUSY), on v2 through memory.reclaim. The limit
// is set back by slotDefaults. A slot still above slotReclaimAbove after
// that is not reusable: its next sandbox would start with the last one's
// memory counted against its limit.
func (i *Info) shrinkSlot(rel string) error {
	if i.MemoryShared(rel) {
		return nil // charged to SharedMemory
	}
	var file string
	var shrink func(dir string, usage uint64) error
	if root, ok := i.V1["memory"]; ok {
		file = filepath.Join(root, rel, "memory.usage_in_bytes")
		shrink = func(dir string, _ uint64) error {
			err := writeFile(filepath.Join(dir, "memory.limit_in_bytes"), strconv.Itoa(slotReclaimAbove))
			if errors.Is(err, syscall.EBUSY) {
				return nil
			}
			return err
		}
	} else if i.V2Root != "" {
		file = filepath.Join(i.V2Root, rel, "memory.current")
		shrink = func(dir string, usage uint64) error {
			err := writeFile(filepath.Join(dir, "memory.reclaim"), strconv.FormatUint(usage-slotReclaimAbove, 10))
			if errors.Is(err, syscall.EAGAIN) {
				return nil
			}
			return err
		}
	} else {
		return nil
	}
	usage, err := readUint(file)
	if err != nil || usage <= slotReclaimAbove {
		return err
	}
	if err := shrink(filepath.Dir(file), usage); err != nil {
		return err
	}
	if usage, err = readUint(file); err != nil {
		return err
	}
	if usage > slotReclaimAbove {
		return fmt.Errorf("%d bytes still charged after reclaim", usage)
	}
	return nil
}

type slotWrite struct {
	file, value string
	optional    bool // a file this kernel or layout may lack
}

// apply writes the default unless the file holds it already. Reading
// first is not only cheaper: every write of a CPU quota walks the whole
// host's task-group tree under a global mutex (tg_set_cfs_bandwidth), 10%
// of the CPU of a burst of deletes when written unconditionally.
func (w slotWrite) apply() error {
	cur, err := readString(w.file)
	if w.optional && errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if isDefault(cur, w.value) {
		return nil
	}
	return writeFile(w.file, w.value)
}

// isDefault reports whether a control file reading cur holds the default
// want: "-1" (v1 limits, read back as -1 or as the largest counter
// value), "max" (cgroup2 limits; cpu.max reads "max PERIOD"), or a literal.
func isDefault(cur, want string) bool {
	switch want {
	case "-1":
		if cur == "-1" {
			return true
		}
		n, err := strconv.ParseUint(cur, 10, 64)
		return err == nil && n >= v1Unlimited
	case "max":
		return cur == "max" || strings.HasPrefix(cur, "max ")
	}
	return cur == want
}

// slotDefaults lists the writes that set back what a sandbox's creation
// may have set: the limits the runtime writes from the OCI spec (memory,
// CPU quota and weight, pids), cpu.idle (best-effort sandboxes) and the
// freezer (pause). Limits a spec leaves out are not written by the
// runtime, so a reused slot must not keep its last sandbox's. Order
// matters: memory's swap limit goes first on v1 (the kernel refuses a
// memory limit above it), and cpu.idle before the CPU weight (the kernel
// refuses a weight for an idle group).
func (i *Info) slotDefaults(rel string) []slotWrite {
	var out []slotWrite
	add := func(dir, file, value string, optional bool) {
		out = append(out, slotWrite{filepath.Join(dir, rel, file), value, optional})
	}
	v2 := i.V2Root
	if root, ok := i.V1["memory"]; i.MemoryShared(rel) {
		// No memory cgroup of its own to reset.
	} else if ok {
		add(root, "memory.memsw.limit_in_bytes", "-1", true)
		add(root, "memory.limit_in_bytes", "-1", false)
	} else if v2 != "" {
		add(v2, "memory.max", "max", false)
		add(v2, "memory.swap.max", "max", true)
	}
	if root, ok := i.V1["cpu"]; ok {
		add(root, "cpu.idle", "0", true)
		add(root, "cpu.cfs_quota_us", "-1", false)
		add(root, "cpu.shares", "1024", false)
	} else if v2 != "" {
		add(v2, "cpu.idle", "0", true)
		add(v2, "cpu.max", "max", false)
		add(v2, "cpu.weight", "100", false)
	}
	if root, ok := i.V1["pids"]; ok {
		add(root, "pids.max", "max", false)
	} else if v2 != "" {
		add(v2, "pids.max", "max", false)
	}
	if root, ok := i.V1["freezer"]; ok {
		add(root, "freezer.state", "THAWED", false)
	} else if v2 != "" {
		add(v2, "cgroup.freeze", "0", false)
	}
	return out
}

// cpuUsage reads the CPU time counted in cgroup rel, in nanoseconds: the
// same counter Stats reports.
func (i *Info) cpuUsage(rel string) (uint64, error) {
	if root, ok := i.V1["cpuacct"]; ok {
		return readUint(filepath.Join(root, rel, "cpuacct.usage"))
	}
	if i.V2Root == "" {
		return 0, nil
	}
	st, err := readKeyed(filepath.Join(i.V2Root, rel, "cpu.stat"))
	if err != nil {
		return 0, err
	}
	return st["usage_usec"] * 1000, nil
}
