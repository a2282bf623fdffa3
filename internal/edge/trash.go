package edge

import (
	"errors"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/files"
)

// A deleted sandbox's directory (its writable layer, record and work
// dirs) is renamed into <state>/edge/trash and removed there by one
// background goroutine at a low CPU priority, instead of in the delete:
// removing a tree on a filesystem mounted with discard (this host's ext4)
// was a quarter of the edge's CPU in a burst of deletes. By the time
// DELETE returns the sandbox is gone: processes, cgroup, mounts, network
// and record; only its files wait for the janitor, and the next start
// empties what a stop left.
//
// The tree is the sandbox's own and may be hostile: files.RemoveAll
// removes it with a bounded number of descriptors at any depth, never
// following a symlink or entering a mount. An entry that still cannot be
// removed is retried with a growing pause (trashRetryMin to trashRetryMax)
// and its failure logged once, cut to maxLoggedError bytes, and again only
// when it changes.

const (
	trashRetryMin = time.Minute
	trashRetryMax = time.Hour
	// maxLoggedError bounds an error message in a log line: errors about
	// a sandbox's files may quote the sandbox's names.
	maxLoggedError = 512
)

// trashRetry is an entry of the trash the janitor failed to remove.
type trashRetry struct {
	next     time.Time     // not tried again before
	wait     time.Duration // the pause after the next failure is twice this
	failures int
	logged   string // the failure last logged
}

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
		return e.removeTree(dir)
	}
	select {
	case e.trashKick <- struct{}{}:
	default:
	}
	return nil
}

// janitor empties the trash whenever something lands in it, and retries
// what it could not remove when its pause ends, until the edge stops. It
// runs on an OS thread of its own at nice 10 (the thread ends with it),
// so in a burst the removals wait for the creates and deletes.
func (e *Edge) janitor() {
	runtime.LockOSThread()
	_ = unix.Setpriority(unix.PRIO_PROCESS, unix.Gettid(), 10)
	for {
		retry := e.emptyTrash()
		var due <-chan time.Time
		var t *time.Timer
		if !retry.IsZero() {
			t = time.NewTimer(time.Until(retry))
			due = t.C
		}
		select {
		case <-e.stop:
			return
		case <-e.trashKick:
		case <-due:
		}
		if t != nil {
			t.Stop()
		}
	}
}

// emptyTrash removes everything in the trash that is not waiting for a
// retry, and returns when the next retry is due (zero: none).
//
// Preconditions: called by one goroutine at a time (the janitor, then
// Close once it has stopped); it owns e.trashRetries.
func (e *Edge) emptyTrash() (retry time.Time) {
	ents, err := os.ReadDir(e.trashDir())
	if err != nil {
		if !errors.Is(err, os.ErrNotExist) {
			e.log.Warn("reading the trash", "err", clip(err.Error(), maxLoggedError))
		}
		return time.Time{}
	}
	now := time.Now()
	present := make(map[string]bool, len(ents))
	for _, ent := range ents {
		name := ent.Name()
		present[name] = true
		r := e.trashRetries[name]
		if r != nil && now.Before(r.next) {
			retry = earliest(retry, r.next)
			continue
		}
		err := e.removeTree(filepath.Join(e.trashDir(), name))
		if err == nil {
			if r != nil {
				e.log.Info("removed a deleted sandbox's files", "path", name, "attempts", r.failures+1)
				delete(e.trashRetries, name)
			}
			continue
		}
		if r == nil {
			r = &trashRetry{wait: trashRetryMin / 2}
			e.trashRetries[name] = r
		}
		r.failures++
		r.wait = min(2*r.wait, trashRetryMax)
		r.next = now.Add(r.wait)
		retry = earliest(retry, r.next)
		if msg := clip(err.Error(), maxLoggedError); msg != r.logged {
			r.logged = msg
			e.log.Warn("removing a deleted sandbox's files", "path", name, "err", msg, "attempts", r.failures, "retry_in", r.wait)
		}
	}
	for name := range e.trashRetries {
		if !present[name] {
			delete(e.trashRetries, name)
		}
	}
	return retry
}

func earliest(a, b time.Time) time.Time {
	if a.IsZero() || b.Before(a) {
		return b
	}
	return a
}

// clip cuts s to at most n bytes, marking the cut.
func clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "...(" + strconv.Itoa(len(s)-n) + " more bytes)"
}

// removeTree is files.RemoveAll, or a test's stand-in.
func (e *Edge) removeTree(path string) error {
	if e.rmTree != nil {
		return e.rmTree(path)
	}
	return files.RemoveAll(path)
}
