package cgroup

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
)

// ErrNoIdle is returned by SetIdle on kernels without cpu.idle (before 5.15).
var ErrNoIdle = errors.New("cpu.idle not available (kernel 5.15 or later)")

// SetIdle marks the cgroup rel as an idle group (cpu.idle = 1): the
// scheduler then treats the whole group as SCHED_IDLE against its
// siblings, so its tasks run only on CPU time nobody else at the sandbox
// level wants. It covers every process that ever joins the group (exec'd
// commands included), which a per-task SCHED_IDLE set on init would not:
// commands started by `runtime exec` are not init's descendants. The file
// exists in the v1 cpu hierarchy and in cgroup2 alike.
func (i *Info) SetIdle(rel string) error {
	if err := checkRel(rel); err != nil {
		return err
	}
	var dir string
	if root, ok := i.V1["cpu"]; ok {
		dir = filepath.Join(root, rel)
	} else if i.V2Root != "" {
		dir = filepath.Join(i.V2Root, rel)
	} else {
		return errors.New("no cpu controller on this host")
	}
	p := filepath.Join(dir, "cpu.idle")
	if _, err := os.Stat(p); errors.Is(err, os.ErrNotExist) {
		if !isDir(dir) {
			return fmt.Errorf("setting cpu.idle: cgroup %s not found", rel)
		}
		return ErrNoIdle
	}
	if err := writeFile(p, "1"); err != nil {
		return fmt.Errorf("setting cpu.idle of %s: %w", rel, err)
	}
	return nil
}
