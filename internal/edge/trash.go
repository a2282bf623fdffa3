package edge

import (
	"errors"
	"os"
	"path/filepath"
	"runtime"
	"strconv"

	"golang.org/x/sys/unix"
)

// A deleted sandbox's directory (its writable layer, record and work
// dirs) is renamed into <state>/edge/trash and removed there by one
// background goroutine at a low CPU priority, instead of in the delete:
// removing a tree on a filesystem mounted with discard (this host's ext4)
// was a quarter of the edge's CPU in a burst of deletes. By the time
// DELETE returns the sandbox is gone: processes, cgroup, mounts, network
// and record; only its files wait for the janitor, and the next start
// empties what a stop left.

// trashDir is where deleted sandboxes' directories wait for removal.
func (e *Edge) trashDir() string { return filepath.Join(e.cfg.StateDir, "trash") }

// discard moves a sandbox directory into the trash, or removes it in
// place if it cannot be moved.
func (e *Edge) discard(dir string) error {
	dst := filepath.Join(e.trashDir(), filepath.Base(dir)+"."+strconv.FormatUint(e.trashSeq.Add(1), 10))
	err := os.Rename(dir, dst)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		if err := os.RemoveAll(dir); err != nil && !errors.Is(err, os.ErrNotExist) {
			return err
		}
		return nil
	}
	select {
	case e.trashKick <- struct{}{}:
	default:
	}
	return nil
}

// janitor empties the trash whenever something lands in it, until the
// edge stops. It runs on an OS thread of its own at nice 10 (the thread
// ends with it), so in a burst the removals wait for the creates and
// deletes.
func (e *Edge) janitor() {
	runtime.LockOSThread()
	_ = unix.Setpriority(unix.PRIO_PROCESS, unix.Gettid(), 10)
	for {
		e.emptyTrash()
		select {
		case <-e.stop:
			return
		case <-e.trashKick:
		}
	}
}

// emptyTrash removes everything in the trash.
func (e *Edge) emptyTrash() {
	ents, err := os.ReadDir(e.trashDir())
	if err != nil {
		if !errors.Is(err, os.ErrNotExist) {
			e.log.Warn("reading the trash", "err", err)
		}
		return
	}
	for _, ent := range ents {
		if err := os.RemoveAll(filepath.Join(e.trashDir(), ent.Name())); err != nil {
			e.log.Warn("removing a deleted sandbox's files", "path", ent.Name(), "err", err)
		}
	}
}
