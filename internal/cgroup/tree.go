package cgroup

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// v2 controllers the runtime needs to apply the OCI spec's resources.
var (
	v2Required = []string{"cpu", "memory", "pids"}
	v2Optional = []string{"io"}
)

// EnsureParent creates the cgroup rel (for example "/dsec") in every
// hierarchy so the runtime can create sandbox cgroups below it. It is
// idempotent. On a v1 cpuset hierarchy it copies cpuset.cpus and
// cpuset.mems from the parent, since a cpuset with empty ones accepts no
// tasks and children would inherit the emptiness, and sets
// cgroup.clone_children, so that the kernel gives each new child the same
// at mkdir: writing cpuset.cpus rebuilds the scheduler domains, which
// walks every cpuset on the host (0.25 ms a sandbox among 1,000 others,
// 0.6 ms among 5,000, measured here; issue 15's profile). On V2 it enables cpu,
// memory, pids (and io when available) in cgroup.subtree_control of the
// root and of every level down to rel. On failure, directories it created
// are removed again.
func (i *Info) EnsureParent(rel string) error { return i.ensureParent(rel, false) }

// ensureParent is EnsureParent; with noMemory, rel's own subtree_control
// on the cgroup2 tree gets every controller but memory.
func (i *Info) ensureParent(rel string, noMemory bool) error {
	if err := checkRel(rel); err != nil {
		return err
	}
	var created []string
	ok := false
	defer func() {
		if ok {
			return
		}
		for _, d := range slices.Backward(created) {
			os.Remove(d)
		}
	}()
	mkdir := func(dir string) error {
		err := os.Mkdir(dir, 0o755)
		if err == nil {
			created = append(created, dir)
			return nil
		}
		if errors.Is(err, fs.ErrExist) {
			return nil
		}
		return fmt.Errorf("creating cgroup %s: %w", dir, err)
	}

	if i.Mode == V2 {
		if err := i.ensureV2(rel, mkdir, noMemory); err != nil {
			return err
		}
		ok = true
		return nil
	}
	for _, root := range i.roots() {
		isCpuset := root == i.V1["cpuset"]
		for _, lvl := range levels(rel) {
			dir := filepath.Join(root, lvl)
			if err := mkdir(dir); err != nil {
				return err
			}
			if isCpuset {
				if err := inheritCpuset(root, dir); err != nil {
					return err
				}
				if err := writeFile(filepath.Join(dir, "cgroup.clone_children"), "1"); err != nil {
					return fmt.Errorf("setting cgroup.clone_children of %s: %w", dir, err)
				}
			}
		}
	}
	ok = true
	return nil
}

// EnsureSharedMemoryParent is EnsureParent for Info.SharedMemory: on the
// cgroup2 tree it leaves memory out of the parent's subtree_control, so
// its children get no memory cgroup of their own and are charged to it;
// on a v1 memory hierarchy they are simply not created there
// (MakeSandbox).
//
// Memory is never enabled there, not even for a moment: live children
// (after a restart) would each get a memory cgroup.
func (i *Info) EnsureSharedMemoryParent() error {
	rel := i.SharedMemory
	if err := i.ensureParent(rel, true); err != nil {
		return err
	}
	if i.Mode != V2 {
		return nil
	}
	// Only a parent some other code enabled memory in gets here with it.
	file := filepath.Join(i.V2Root, rel, "cgroup.subtree_control")
	have, err := readList(file)
	if err != nil {
		return fmt.Errorf("reading %s: %w", file, err)
	}
	if slices.Contains(have, "memory") {
		if err := writeFile(file, "-memory"); err != nil {
			return fmt.Errorf("disabling memory in %s: %w", file, err)
		}
	}
	return nil
}

// SetSharedMemoryLimit sets the memory limit of SharedMemory, all its
// sandboxes together (0: none).
func (i *Info) SetSharedMemoryLimit(bytes int64) error {
	if bytes > 0 {
		return i.writeLimits(i.SharedMemory, Limits{MemoryBytes: bytes})
	}
	for _, w := range i.slotDefaults(i.SharedMemory) {
		if strings.Contains(filepath.Base(w.file), "memory.") {
			if err := w.apply(); err != nil {
				return fmt.Errorf("lifting the memory limit of %s: %w", i.SharedMemory, err)
			}
		}
	}
	return nil
}

// ensureV2 creates rel in the cgroup2 tree with the controllers the
// runtime needs enabled for rel's children (but memory with noMemory).
func (i *Info) ensureV2(rel string, mkdir func(string) error, noMemory bool) error {
	avail, err := readList(filepath.Join(i.V2Root, "cgroup.controllers"))
	if err != nil {
		return fmt.Errorf("reading cgroup v2 controllers: %w", err)
	}
	var want []string
	for _, c := range v2Required {
		if !slices.Contains(avail, c) {
			return errdefs.Precondition("cgroup v2 controller %s is not available at %s (have: %s); it may be bound to a v1 hierarchy or disabled on the kernel command line",
				c, i.V2Root, strings.Join(avail, " "))
		}
		want = append(want, c)
	}
	for _, c := range v2Optional {
		if slices.Contains(avail, c) {
			want = append(want, c)
		}
	}
	if err := enableControllers(i.V2Root, want); err != nil {
		return err
	}
	for _, lvl := range levels(rel) {
		dir := filepath.Join(i.V2Root, lvl)
		if err := mkdir(dir); err != nil {
			return err
		}
		enable := want
		if noMemory && lvl == rel {
			enable = slices.DeleteFunc(slices.Clone(want), func(c string) bool { return c == "memory" })
		}
		if err := enableControllers(dir, enable); err != nil {
			return err
		}
	}
	return nil
}

// enableControllers enables want in dir's cgroup.subtree_control, one at a
// time so that an error names the controller.
func enableControllers(dir string, want []string) error {
	file := filepath.Join(dir, "cgroup.subtree_control")
	have, err := readList(file)
	if err != nil {
		return fmt.Errorf("reading %s: %w", file, err)
	}
	for _, c := range want {
		if slices.Contains(have, c) {
			continue
		}
		if err := writeFile(file, "+"+c); err != nil {
			if errors.Is(err, unix.EBUSY) {
				// "No internal processes": a non-root cgroup with
				// processes of its own cannot enable controllers.
				return errdefs.Precondition("enabling %s in %s: cgroup has processes of its own", c, file)
			}
			return fmt.Errorf("enabling %s in %s: %w", c, file, err)
		}
	}
	return nil
}

// inheritCpuset copies cpus and mems from dir's parent when dir's are
// empty. Hierarchies mounted with noprefix name the files without
// "cpuset.".
func inheritCpuset(root, dir string) error {
	prefix := "cpuset."
	if _, err := os.Stat(filepath.Join(root, "cpuset.cpus")); err != nil {
		prefix = ""
	}
	for _, name := range []string{prefix + "cpus", prefix + "mems"} {
		cur, err := readString(filepath.Join(dir, name))
		if err != nil {
			return fmt.Errorf("reading cpuset: %w", err)
		}
		if cur != "" {
			continue
		}
		val, err := readString(filepath.Join(filepath.Dir(dir), name))
		if err != nil {
			return fmt.Errorf("reading cpuset: %w", err)
		}
		if err := writeFile(filepath.Join(dir, name), val); err != nil {
			return fmt.Errorf("copying %s to %s: %w", name, dir, err)
		}
	}
	return nil
}

// Children lists the names of the child cgroups of rel, unioned across
// hierarchies and sorted, so leftovers present in only one hierarchy are
// found too. A missing rel has no children.
func (i *Info) Children(rel string) ([]string, error) {
	if err := checkRel(rel); err != nil {
		return nil, err
	}
	var names []string
	for _, root := range i.roots() {
		ents, err := os.ReadDir(filepath.Join(root, rel))
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("listing cgroup %s: %w", rel, err)
		}
		for _, e := range ents {
			if e.IsDir() && !slices.Contains(names, e.Name()) {
				names = append(names, e.Name())
			}
		}
	}
	slices.Sort(names)
	return names, nil
}

// Bounds for Remove: rmdir, kill, wait, repeat. A process killed by
// SIGKILL leaves its cgroup within milliseconds unless it is stuck in the
// kernel (uninterruptible I/O), so the whole wait is kept short.
const (
	removeTimeout   = 3 * time.Second
	removeFirstWait = 5 * time.Millisecond
	removeMaxWait   = 200 * time.Millisecond
)

// Remove removes the cgroup rel and its descendants in every hierarchy.
// When processes remain it kills them (cgroup.kill on the cgroup2 tree;
// SIGKILL of every pid in cgroup.procs on v1, thawing a v1 freezer
// since frozen tasks do not die) and retries for a bounded time. A missing
// rel is not an error. Processes that outlive the bound give
// errdefs.ErrUnavailable.
func (i *Info) Remove(rel string) error {
	if err := checkRel(rel); err != nil {
		return err
	}
	wait := removeFirstWait
	deadline := time.Now().Add(removeTimeout)
	for {
		busy, err := i.rmdirTree(rel)
		if err != nil {
			return err
		}
		if len(busy) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return errdefs.Unavailable("removing cgroup %s: still busy after %s: %s", rel, removeTimeout, strings.Join(busy, ", "))
		}
		if err := i.kill(rel); err != nil {
			return err
		}
		time.Sleep(wait)
		wait = min(2*wait, removeMaxWait)
	}
}

// RemoveIdle removes the cgroup rel and its descendants in every hierarchy
// if no process is in them, and kills nothing: a cgroup still in use gives
// errdefs.ErrPrecondition, naming where. A missing rel is not an error.
func (i *Info) RemoveIdle(rel string) error {
	if err := checkRel(rel); err != nil {
		return err
	}
	busy, err := i.rmdirTree(rel)
	if err != nil {
		return err
	}
	if len(busy) > 0 {
		return errdefs.Precondition("cgroup %s is in use: %s", rel, strings.Join(busy, ", "))
	}
	return nil
}

// rmdirTree removes rel's subtree, deepest first, in every hierarchy and
// returns the directories that are still busy.
func (i *Info) rmdirTree(rel string) ([]string, error) {
	var busy []string
	for _, root := range i.roots() {
		dirs, err := subtree(filepath.Join(root, rel))
		if err != nil {
			return nil, err
		}
		for _, d := range slices.Backward(dirs) {
			err := unix.Rmdir(d)
			switch {
			case err == nil, errors.Is(err, unix.ENOENT):
			case errors.Is(err, unix.EBUSY), errors.Is(err, unix.ENOTEMPTY):
				busy = append(busy, d)
			default:
				return nil, fmt.Errorf("removing cgroup %s: %w", d, err)
			}
		}
	}
	return busy, nil
}

// Kill kills every process in rel's subtree in every hierarchy, leaving
// the cgroups in place.
func (i *Info) Kill(rel string) error {
	if err := checkRel(rel); err != nil {
		return err
	}
	return i.kill(rel)
}

// kill kills every process in rel's subtree in every hierarchy.
func (i *Info) kill(rel string) error {
	if i.V2Root != "" {
		dir := filepath.Join(i.V2Root, rel)
		err := writeFile(filepath.Join(dir, "cgroup.kill"), "1")
		switch {
		case err == nil, !isDir(dir):
		case errors.Is(err, fs.ErrNotExist):
			// Kernel older than 5.14: no cgroup.kill.
			if err := killProcs(dir); err != nil {
				return err
			}
		default:
			return fmt.Errorf("killing cgroup %s: %w", dir, err)
		}
	}
	for _, root := range i.v1Roots() {
		if err := killProcs(filepath.Join(root, rel)); err != nil {
			return err
		}
	}
	// SIGKILL stays pending on a task frozen by the v1 freezer, so thaw.
	if root, ok := i.V1["freezer"]; ok {
		dirs, err := subtree(filepath.Join(root, rel))
		if err != nil {
			return err
		}
		for _, d := range dirs {
			if err := writeFile(filepath.Join(d, "freezer.state"), "THAWED"); err != nil && !errors.Is(err, fs.ErrNotExist) {
				return fmt.Errorf("thawing cgroup %s: %w", d, err)
			}
		}
	}
	return nil
}

// killProcs sends SIGKILL to every process in dir's subtree. The usual pid
// reuse race of signalling by pid applies; cgroup.kill avoids it where the
// kernel has it.
func killProcs(dir string) error {
	dirs, err := subtree(dir)
	if err != nil {
		return err
	}
	for _, d := range dirs {
		pids, err := readPids(filepath.Join(d, "cgroup.procs"))
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return fmt.Errorf("reading processes of cgroup %s: %w", d, err)
		}
		for _, pid := range pids {
			if err := unix.Kill(pid, unix.SIGKILL); err != nil && !errors.Is(err, unix.ESRCH) {
				return fmt.Errorf("killing pid %d of cgroup %s: %w", pid, d, err)
			}
		}
	}
	return nil
}

// RemoveParent removes the cgroup rel from every hierarchy where it is
// empty (no child cgroups, no processes) and reports whether it is gone
// everywhere. The edge calls it when it stops with no sandbox left, so an
// instance that never starts again leaves no cgroup behind; a non-empty
// parent stays for the next start to recover.
func (i *Info) RemoveParent(rel string) (bool, error) {
	if err := checkRel(rel); err != nil {
		return false, err
	}
	gone := true
	for _, root := range i.roots() {
		err := os.Remove(filepath.Join(root, rel))
		switch {
		case err == nil, errors.Is(err, fs.ErrNotExist):
		case errors.Is(err, unix.EBUSY), errors.Is(err, unix.ENOTEMPTY):
			gone = false
		default:
			return false, fmt.Errorf("removing cgroup %s: %w", filepath.Join(root, rel), err)
		}
	}
	return gone, nil
}

// SetLimits writes l to the existing cgroup rel (a parent: its children
// count against it), leaving what l does not set as it is.
func (i *Info) SetLimits(rel string, l Limits) error {
	if err := checkRel(rel); err != nil {
		return err
	}
	return i.writeLimits(rel, l)
}
