package cgroup

import (
	"fmt"
	"slices"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/mountinfo"
)

// FavorDynMods turns on the kernel's favordynmods cgroup mount option, if
// it is not on already, and reports whether it changed anything.
//
// Every task migration between cgroups (a runtime writing a new sandbox's
// init into cgroup.procs, an exec joining its sandbox) takes the global
// cgroup_threadgroup_rwsem for writing, and by default that waits for an
// RCU grace period: ~10-15 ms on this kind of machine, serialised across
// all concurrent creates. With favordynmods the lock stays in its slow
// mode, so a migration costs microseconds and forks/exits pay a little
// more. The lock is global, so remounting one hierarchy is enough: the
// cgroup2 tree when there is one, else the first v1 hierarchy. The
// setting outlives the process (it is a property of the mount).
func (i *Info) FavorDynMods() (bool, error) {
	mounts, err := mountinfo.Read()
	if err != nil {
		return false, err
	}
	target, opts, ok := dynModsTarget(i, mounts)
	if !ok {
		return false, fmt.Errorf("no cgroup mount found to remount")
	}
	if slices.Contains(opts, "favordynmods") {
		return false, nil
	}
	// A remount resets the root's flags to exactly the options given, so
	// the existing ones (nsdelegate, memory_recursiveprot, controllers of
	// a v1 hierarchy) go along.
	keep := []string{"favordynmods"}
	for _, o := range opts {
		if o != "rw" && o != "ro" {
			keep = append(keep, o)
		}
	}
	if err := unix.Mount("", target, "", unix.MS_REMOUNT, strings.Join(keep, ",")); err != nil {
		return false, fmt.Errorf("remounting %s with favordynmods: %w", target, err)
	}
	return true, nil
}

// dynModsTarget picks the mount FavorDynMods remounts and returns its
// super options.
func dynModsTarget(i *Info, mounts []mountinfo.Entry) (string, []string, bool) {
	want := i.V2Root
	if want == "" {
		if roots := i.v1Roots(); len(roots) > 0 {
			want = roots[0]
		}
	}
	for _, m := range mounts {
		if m.MountPoint == want && (m.FSType == "cgroup2" || m.FSType == "cgroup") {
			return want, m.SuperOptionList(), true
		}
	}
	return "", nil, false
}
