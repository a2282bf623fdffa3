package cgroup

import (
	"context"
	"fmt"
	"path/filepath"
	"time"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// freezeTimeout bounds Freeze even when the caller's context does not. A
// task in uninterruptible sleep (say, on a hung NFS server) can keep a
// cgroup FREEZING forever.
const freezeTimeout = 5 * time.Second

// Freeze stops every process in cgroup rel and its descendants and returns
// once the kernel reports the cgroup frozen. It uses the v1 freezer
// hierarchy when there is one (freezer.state), else the cgroup2 tree
// (cgroup.freeze, confirmed by "frozen 1" in cgroup.events). If the cgroup
// does not freeze before ctx ends or freezeTimeout passes, Freeze thaws it
// again and returns an error, so a failed Freeze leaves nothing half-frozen.
func (i *Info) Freeze(ctx context.Context, rel string) error {
	dir, v1, err := i.freezerDir(rel)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, freezeTimeout)
	defer cancel()

	wait := time.Millisecond
	for {
		frozen, err := freezeStep(dir, v1)
		if err != nil {
			return fmt.Errorf("freezing cgroup %s: %w", rel, err)
		}
		if frozen {
			return nil
		}
		select {
		case <-ctx.Done():
			if err := thaw(dir, v1); err != nil {
				return fmt.Errorf("thawing cgroup %s after failing to freeze it: %w", rel, err)
			}
			return fmt.Errorf("freezing cgroup %s: %w", rel, ctx.Err())
		case <-time.After(wait):
		}
		wait = min(2*wait, 100*time.Millisecond)
	}
}

// freezeStep asks for the cgroup to freeze and reports whether it is.
// On v1 the request is repeated on every step: the kernel retries tasks
// that could not be frozen the last time (runc does the same).
func freezeStep(dir string, v1 bool) (bool, error) {
	if v1 {
		file := filepath.Join(dir, "freezer.state")
		if err := writeFile(file, "FROZEN"); err != nil {
			return false, err
		}
		state, err := readString(file)
		return state == "FROZEN", err
	}
	if err := writeFile(filepath.Join(dir, "cgroup.freeze"), "1"); err != nil {
		return false, err
	}
	ev, err := readKeyed(filepath.Join(dir, "cgroup.events"))
	return ev["frozen"] == 1, err
}

// Thaw resumes the processes of cgroup rel frozen by Freeze. Thawing a
// cgroup that is not frozen is not an error.
func (i *Info) Thaw(rel string) error {
	dir, v1, err := i.freezerDir(rel)
	if err != nil {
		return err
	}
	if err := thaw(dir, v1); err != nil {
		return fmt.Errorf("thawing cgroup %s: %w", rel, err)
	}
	return nil
}

// thaw needs no polling: both freezers report thawed as soon as asked.
func thaw(dir string, v1 bool) error {
	if v1 {
		return writeFile(filepath.Join(dir, "freezer.state"), "THAWED")
	}
	return writeFile(filepath.Join(dir, "cgroup.freeze"), "0")
}

// freezerDir returns the directory whose freezer controls rel, and whether
// it is a v1 freezer.
func (i *Info) freezerDir(rel string) (string, bool, error) {
	if err := checkRel(rel); err != nil {
		return "", false, err
	}
	dir, v1 := "", false
	switch root, ok := i.V1["freezer"]; {
	case ok:
		dir, v1 = filepath.Join(root, rel), true
	case i.V2Root != "":
		dir = filepath.Join(i.V2Root, rel)
	default:
		return "", false, errdefs.Precondition("no cgroup freezer on this host")
	}
	if !isDir(dir) {
		return "", false, errdefs.NotFound("cgroup %s not found", rel)
	}
	return dir, v1, nil
}

// Frozen reports whether cgroup rel is frozen or freezing: a freeze was
// asked for and not undone (v1 freezer.state FROZEN or FREEZING; on the
// cgroup2 tree, cgroup.freeze 1).
func (i *Info) Frozen(rel string) (bool, error) {
	dir, v1, err := i.freezerDir(rel)
	if err != nil {
		return false, err
	}
	if v1 {
		state, err := readString(filepath.Join(dir, "freezer.state"))
		return state == "FROZEN" || state == "FREEZING", err
	}
	v, err := readString(filepath.Join(dir, "cgroup.freeze"))
	return v == "1", err
}
