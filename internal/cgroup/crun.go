package cgroup

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// CrunCompatible reports whether crun can run on this host as it is now.
// crun (1.8) refuses hybrid hosts whose cgroup2 tree still has controllers;
// then it returns false and a reason an operator can act on. It rereads
// cgroup.controllers, so it reflects changes made since Detect.
func (i *Info) CrunCompatible() (bool, string) {
	if i.Mode != Hybrid {
		return true, ""
	}
	ctrls, err := readList(filepath.Join(i.V2Root, "cgroup.controllers"))
	if err != nil {
		return false, fmt.Sprintf("reading cgroup v2 controllers: %v", err)
	}
	if len(ctrls) > 0 {
		return false, fmt.Sprintf("cgroups are hybrid and the cgroup2 tree at %s still has controllers (%s); crun refuses that: bind them to v1 hierarchies (PrepareForCrun) or use runc",
			i.V2Root, strings.Join(ctrls, " "))
	}
	return true, ""
}

// PrepareForCrun makes a hybrid host acceptable to crun by binding every
// controller still available in the cgroup2 tree to a v1 hierarchy of its
// own, mounted at <dir of the cgroup2 tree>/<controller> (for example
// /sys/fs/cgroup/hugetlb, where runtimes look for it). Binding a
// controller to v1 removes it from the cgroup2 tree, which is what crun
// wants. It returns what it did, for the caller to log.
//
// It is a no-op on V1 and V2 hosts and on hybrid hosts already prepared.
// It refreshes i from the host, so call it before sharing i, and before
// EnsureParent, which must see the new hierarchies to create the parent
// in them too.
func (i *Info) PrepareForCrun() ([]string, error) {
	if i.Mode != Hybrid {
		return nil, nil
	}
	fresh, mounts, err := detect()
	if err != nil {
		return nil, err
	}
	*i = *fresh
	if i.Mode != Hybrid || len(i.UnifiedControllers) == 0 {
		return nil, nil
	}

	base := filepath.Dir(i.V2Root)
	var actions []string
	for _, c := range i.UnifiedControllers {
		target := filepath.Join(base, c)
		for _, m := range mounts {
			if m.MountPoint == target {
				return actions, errdefs.Precondition("binding %s to cgroup v1: %s is already a mountpoint (%s); not mounting over it", c, target, m.FSType)
			}
		}
		created := false
		if err := os.Mkdir(target, 0o755); err == nil {
			created = true
		} else if !errors.Is(err, os.ErrExist) {
			if errors.Is(err, unix.EROFS) {
				return actions, errdefs.Precondition("binding %s to cgroup v1: %s is read-only; remount it read-write (mount -o remount,rw %s) or mount the hierarchy by hand", c, base, base)
			}
			return actions, fmt.Errorf("creating %s: %w", target, err)
		}
		if err := unix.Mount("cgroup", target, "cgroup", 0, c); err != nil {
			if created {
				os.Remove(target)
			}
			if errors.Is(err, unix.EBUSY) {
				// The kernel will not move a controller that some cgroup in
				// the v2 tree has enabled in cgroup.subtree_control.
				return actions, errdefs.Precondition("binding %s to cgroup v1: controller is in use in the cgroup2 tree (enabled in some cgroup.subtree_control under %s); disable it there first", c, i.V2Root)
			}
			return actions, fmt.Errorf("mounting cgroup v1 hierarchy %s at %s: %w", c, target, err)
		}
		if created {
			actions = append(actions, "created directory "+target)
		}
		actions = append(actions, fmt.Sprintf("mounted cgroup v1 hierarchy %s at %s (was in the cgroup2 tree)", c, target))
	}

	fresh, err = Detect()
	if err != nil {
		return actions, err
	}
	*i = *fresh
	if ok, reason := i.CrunCompatible(); !ok {
		return actions, errdefs.Precondition("preparing cgroups for crun: %s", reason)
	}
	return actions, nil
}
