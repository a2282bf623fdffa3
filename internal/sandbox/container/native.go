package container

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/cgroup"
	"github.com/dsecproject/dsec/internal/sandbox"
	"github.com/dsecproject/dsec/internal/sandbox/container/nsexec"
)

// dsec's own launcher starts a sandbox's init from the edge, with the
// mounts, namespaces, cgroups, capabilities, rlimits and seccomp filter of
// the OCI spec the runtime would get (spec.go), without a runtime process
// (nsexec/launch.c). Everything after the start already bypasses the
// runtime: exec (the exec helper), destroy, status and list read the state
// file, which the launcher writes in crun's format.
//
// Why: in a burst of creates crun was ~70% of the node's CPU, much of it
// its own start (exec, dynamic loading of ten libraries, JSON parsing,
// its forks and sync pipes) rather than the kernel work the sandbox needs.
//
// Differences from the runtime's result, all deliberate:
//   - Device nodes in /dev are read-only bind mounts of the host's (no
//     chmod or chown of the host's nodes from inside), and /dev itself
//     and the rootfs (with every mount under it) are nodev: a node root
//     inside makes with mknod opens nothing, whatever the device cgroup
//     says (v1 hierarchies still get the allow-list, cgroup.MakeSandbox;
//     cgroup v2 needs no BPF device program for it).
//   - Mount points reached through a symlink are refused (runc and crun
//     refuse them too), /etc/resolv.conf excepted (see launch.h).
//   - Every masked directory, /proc ones included, is a bind of the empty
//     mask dir (runc refuses mounts in /proc; crun would use a tmpfs).
//   - /dev/shm is a directory of the /dev tmpfs (rebound nosuid, nodev,
//     noexec), not a tmpfs of its own; /dev/mqueue is not mounted (POSIX
//     message queues need no mount: mq_open is a system call); /sys is a
//     read-only clone of one sysfs the backend made once, in a network
//     namespace of its own (sharedSysfs), so
//     /sys/class/net does not show the sandbox's interfaces (ip and
//     /proc/net do). Each of the three was a superblock per sandbox, and
//     the kernel keeps per-superblock state in every memory cgroup:
//     the cost per sandbox grows with the number of sandboxes (see
//     maskMounts). A sandbox now has 6: overlay, proc and devpts, the
//     /dev tmpfs, and the proc and mqueue the kernel makes for every pid
//     and ipc namespace.
//   - A sandbox in a user namespace (Config.UserNS) has its namespace
//     made by its owner uid (a task of the launcher, not a holder process
//     as for the runtime) and joined by init last, once
//     its mounts are made as host root; its other namespaces belong to
//     the host's user namespace, so root inside can never mount, unmount
//     or set the hostname in them (under a runtime it may, with
//     CAP_SYS_ADMIN, which the sandbox is not given). Every user may
//     bind any port in its network namespace (ip_unprivileged_port_start
//     is 0 there), which CAP_NET_BIND_SERVICE over that namespace would
//     otherwise be needed for.

// nativeLauncher reports whether this backend can start sandboxes itself.
func nativeLauncher(cfg Config, filter bool) (bool, string) {
	switch {
	case !cfg.Native:
		return false, "not asked for"
	case !nsexec.Available:
		return false, "a build without cgo"
	case os.Geteuid() != 0:
		return false, "not root"
	case cfg.Cgroups == nil:
		return false, "the host's cgroup layout is unknown"
	case cfg.MaskDir == "":
		return false, "no mask dir"
	case !filter:
		return false, "commands go through the runtime's exec"
	}
	return true, ""
}

// Launcher names what starts sandboxes: "dsec" (own launcher) or the
// runtime's flavour.
func (c *Container) Launcher() string {
	if c.native {
		return "dsec"
	}
	return c.flavor
}

// UserNSByDefault implements sandbox.UserNSDefault: the launcher makes a
// sandbox's user namespace for a few percent of a create (the runtime for
// about 5x).
func (c *Container) UserNSByDefault() bool { return c.launchesUserNS() }

// suidDumpable reads fs.suid_dumpable (tests replace it).
var suidDumpable = func() string {
	b, _ := os.ReadFile("/proc/sys/fs/suid_dumpable")
	return strings.TrimSpace(string(b))
}

// launchesUserNS reports whether the launcher starts user-namespace
// sandboxes. Not where fs.suid_dumpable is 1: the owner task and init
// change credentials while they share the edge's memory, and the kernel
// then sets that memory's dumpable flag to fs.suid_dumpable; at 1 the
// edge would be open to ptrace by the owner uid, which holds every
// capability over the sandbox's namespace (0 and 2 leave it to root).
// Such sandboxes then go through the runtime, whose holder is a process
// of its own.
func (c *Container) launchesUserNS() bool { return c.native && suidDumpable() != "1" }

// IDRangePerSandbox implements sandbox.IDRangePerSandbox: the launcher
// makes a sandbox's mounts as host root before init joins its user
// namespace.
func (c *Container) IDRangePerSandbox() bool { return c.launchesUserNS() }

// LauncherWhy is Launcher and, when it is not "dsec", why not.
func (c *Container) LauncherWhy() (string, string) { return c.Launcher(), c.nativeWhy }

// SharedSysfsErr says why sandboxes of the launcher each get a sysfs of
// their own instead of a clone of a shared one (nil: they do not).
func (c *Container) SharedSysfsErr() error { return c.sysfsErr }

// NetnsPool reports how many fresh network namespaces wait for creates,
// and whether there is a pool.
func (c *Container) NetnsPool() (free int, ok bool) {
	c.closing.RLock()
	defer c.closing.RUnlock()
	if c.netns == nil {
		return 0, false
	}
	return c.netns.Free(), true
}

// launchable reports whether cfg can go through the own launcher.
func (c *Container) launchable(cfg sandbox.Config) bool {
	return c.native && (cfg.UserNS == nil || (cfg.UserNS.Owner != 0 && c.launchesUserNS()))
}

// defaultLaunchDeadline is how long a launch may take before the
// sandbox's cgroup is killed.
const defaultLaunchDeadline = time.Minute

// deviceNodes are bind-mounted from the host's /dev into every sandbox's.
var deviceNodes = []string{"null", "zero", "full", "random", "urandom", "tty"}

// devSymlinks are the standard links in a sandbox's /dev.
var devSymlinks = [][2]string{
	{"/dev/ptmx", "pts/ptmx"}, {"/dev/fd", "/proc/self/fd"},
	{"/dev/stdin", "/proc/self/fd/0"}, {"/dev/stdout", "/proc/self/fd/1"}, {"/dev/stderr", "/proc/self/fd/2"},
}

// mountAttrs maps OCI mount options to MOUNT_ATTR_* bits; the rest are
// filesystem parameters.
var mountAttrs = map[string]uint32{
	"ro": unix.MOUNT_ATTR_RDONLY, "nosuid": unix.MOUNT_ATTR_NOSUID, "nodev": unix.MOUNT_ATTR_NODEV,
	"noexec": unix.MOUNT_ATTR_NOEXEC, "strictatime": unix.MOUNT_ATTR_STRICTATIME,
	"relatime": unix.MOUNT_ATTR_RELATIME, "noatime": unix.MOUNT_ATTR_NOATIME,
}

// launchMounts translates the spec's mounts into the launcher's mount
// program, adding /dev's nodes and links and the masks, with the
// differences listed at the top of this file.
func (c *Container) launchMounts(spec *specs.Spec) ([]nsexec.Mount, error) {
	var out []nsexec.Mount
	for _, m := range spec.Mounts {
		switch {
		case m.Type == "bind" && m.Source == c.cfg.MaskDir:
			continue // the runtime's masks; c.maskOps below
		case m.Destination == "/dev/mqueue":
			continue
		case m.Destination == "/dev/shm":
			out = append(out, nsexec.Mount{Kind: nsexec.MountDir, Target: m.Destination, Arg1: "1777",
				Attr: unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NODEV | unix.MOUNT_ATTR_NOEXEC})
			continue
		case m.Destination == "/sys" && c.sysfs != nil:
			out = append(out, nsexec.Mount{Kind: nsexec.MountTree, Target: m.Destination, Arg1: strconv.Itoa(int(c.sysfs.Fd())),
				Attr: unix.MOUNT_ATTR_RDONLY | unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NODEV | unix.MOUNT_ATTR_NOEXEC})
			continue
		}
		var attr uint32
		var params []string
		for _, o := range m.Options {
			if a, ok := mountAttrs[o]; ok {
				attr |= a
			} else if o != "bind" && o != "rbind" {
				params = append(params, o)
			}
		}
		if m.Type == "bind" {
			st, err := os.Stat(m.Source)
			if err != nil {
				return nil, fmt.Errorf("bind mount source: %w", err)
			}
			kind := byte(nsexec.MountBindFile)
			switch {
			case st.IsDir():
				kind = nsexec.MountBindDir
			case m.Destination == "/etc/resolv.conf":
				// Often a symlink in images (to systemd's stub).
				kind = nsexec.MountBindFileFollow
			}
			out = append(out, nsexec.Mount{Kind: kind, Target: m.Destination, Arg1: m.Source, Attr: attr})
			continue
		}
		if m.Destination == "/dev" {
			attr |= unix.MOUNT_ATTR_NODEV
		}
		out = append(out, nsexec.Mount{Kind: nsexec.MountFS, Target: m.Destination, Arg1: m.Type,
			Arg2: strings.Join(params, ","), Attr: attr})
		if m.Destination == "/dev" {
			// Read-only: reads and writes reach the device all the same,
			// but root inside (CAP_CHOWN, CAP_FOWNER) cannot chmod or
			// chown the host's nodes through them (EROFS).
			for _, d := range deviceNodes {
				out = append(out, nsexec.Mount{Kind: nsexec.MountBindFile, Target: "/dev/" + d, Arg1: "/dev/" + d,
					Attr: unix.MOUNT_ATTR_RDONLY | unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NOEXEC})
			}
			for _, l := range devSymlinks {
				out = append(out, nsexec.Mount{Kind: nsexec.MountSymlink, Target: l[0], Arg1: l[1]})
			}
		}
	}
	return append(out, c.maskOps...), nil
}

// maskOps returns the masks and read-only paths of a sandbox as mount
// steps, for the paths this kernel has: the same for every sandbox, so the
// backend builds them once. Directories are binds of the empty mask dir,
// files of /dev/null.
func maskOps(maskDir string) []nsexec.Mount {
	var out []nsexec.Mount
	const ro uint32 = unix.MOUNT_ATTR_RDONLY | unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NODEV | unix.MOUNT_ATTR_NOEXEC
	dirs, files := maskMounts(maskDir, maskedPaths, "dsec")
	for _, m := range dirs {
		out = append(out, nsexec.Mount{Kind: nsexec.MountMask, Target: m.Destination, Arg1: m.Source, Attr: ro})
	}
	for _, p := range files {
		if _, err := os.Lstat(p); err != nil {
			continue // not on this kernel
		}
		out = append(out, nsexec.Mount{Kind: nsexec.MountMask, Target: p, Arg1: "/dev/null",
			Attr: unix.MOUNT_ATTR_RDONLY | unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NOEXEC})
	}
	for _, p := range readonlyPaths {
		if _, err := os.Lstat(p); err != nil {
			continue // not on this kernel
		}
		out = append(out, nsexec.Mount{Kind: nsexec.MountReadOnly, Target: p, Attr: ro})
	}
	return out
}

// launch is Create through the own launcher.
func (c *Container) launch(ctx context.Context, cfg sandbox.Config) (err error) {
	// The fds the launch passes by number (sysfs, null) stay open.
	c.closing.RLock()
	defer c.closing.RUnlock()
	if c.null == nil {
		return errors.New("starting sandbox: backend closed")
	}
	spec := c.spec(cfg, "")
	mounts, err := c.launchMounts(spec)
	if err != nil {
		return fmt.Errorf("starting sandbox: %w", err)
	}
	limits := cgroup.Limits{MemoryBytes: cfg.Limits.MemoryBytes, Pids: cfg.Limits.Pids, LowWeight: cfg.Limits.BestEffort}
	if cfg.Limits.CPU > 0 {
		limits.CPUQuotaUs = int64(cfg.Limits.CPU * 100000)
	}
	release, err := acquire(ctx, c.creating)
	if err != nil {
		return fmt.Errorf("starting sandbox: %w", err)
	}
	defer release()
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("starting sandbox: %w", err)
	}
	procs, err := c.cfg.Cgroups.MakeSandbox(cfg.CgroupPath, limits)
	if err != nil {
		return fmt.Errorf("starting sandbox: %w", err)
	}
	pidfd := -1
	defer func() {
		if pidfd >= 0 {
			if err != nil {
				_ = unix.PidfdSendSignal(pidfd, unix.SIGKILL, nil, 0)
				_ = waitPidfd(context.Background(), pidfd)
			}
			unix.Close(pidfd)
		}
		if err == nil {
			return
		}
		_ = os.RemoveAll(filepath.Join(c.cfg.StateRoot, cfg.ID))
		if !c.cfg.KeepCgroups {
			_ = c.cfg.Cgroups.Remove(cfg.CgroupPath)
		}
		err = fmt.Errorf("starting sandbox: %w", err)
	}()
	var nofile uint64
	if r := spec.Process.Rlimits; len(r) > 0 {
		nofile = r[0].Hard
	}
	var userns *nsexec.IDMap // nil: the host's
	if m := cfg.UserNS; m != nil {
		userns = &nsexec.IDMap{Owner: m.Owner, HostID: m.HostID, Size: m.Size}
	}
	var netns *os.File // nil: init makes its own
	if c.netns != nil {
		// Used or not, it is never handed out again.
		if netns = c.netns.take(); netns != nil {
			defer netns.Close()
		}
	}
	// A launch that does not end (init stopped during its setup by
	// something allowed to signal it: the owner uid holds every
	// capability over its user namespace) would hold its slot for good:
	// past the deadline, whatever is in the cgroup is killed, and the
	// launch fails.
	deadline := c.launchDeadline
	if deadline == 0 {
		deadline = defaultLaunchDeadline
	}
	var overdue atomic.Bool
	watchdog := time.AfterFunc(deadline, func() {
		overdue.Store(true)
		_ = c.cfg.Cgroups.Kill(cfg.CgroupPath)
	})
	pid, fd, err := nsexec.Launch(nsexec.LaunchConfig{
		RootfsMount: cfg.RootfsMount, Rootfs: cfg.Rootfs, Mounts: mounts,
		Hostname: cfg.Hostname, CgroupProcs: procs, CgroupNS: c.cfg.CgroupNS, NetNS: netns, UserNS: userns, OwnerWait: c.ownerWait,
		Caps: capMask(defaultCaps), NoFile: nofile, Filter: c.filter,
		Argv: spec.Process.Args, Env: spec.Process.Env, Null: c.null,
	})
	watchdog.Stop()
	if err == nil && overdue.Load() {
		unix.Close(fd)
		err = fmt.Errorf("init did not start within %v (killed)", deadline)
	}
	if err != nil {
		var le *nsexec.LaunchError
		if errors.As(err, &le) && le.Killed {
			// init may still be starting: only its cgroup finds it.
			_ = c.cfg.Cgroups.Kill(cfg.CgroupPath)
		}
		return err
	}
	pidfd = fd
	// The start time read while the pidfd's process still runs is its
	// own (its pid cannot have been reused yet).
	start, running, err := procStart(pid)
	if err != nil {
		return err
	}
	if err := unix.PidfdSendSignal(pidfd, 0, nil, 0); err != nil || !running {
		return fmt.Errorf("sandbox init %d died as it started", pid)
	}
	if err := writeState(filepath.Join(c.cfg.StateRoot, cfg.ID), pid, start); err != nil {
		return err
	}
	return ctx.Err()
}

// sharedSysfs makes a read-only sysfs as a detached mount, from a thread
// moved into a new network namespace (sysfs shows the mounter's network
// namespace in /sys/class/net): every sandbox gets a clone of it instead
// of a sysfs superblock of its own. The thread is never unlocked, so Go
// ends it with the goroutine, and the namespace with it: its
// /sys/class/net is then empty.
func sharedSysfs() (*os.File, error) {
	type result struct {
		f   *os.File
		err error
	}
	ch := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			ch <- result{nil, fmt.Errorf("unshare(CLONE_NEWNET): %w", err)}
			return
		}
		fd, err := unix.Fsopen("sysfs", unix.FSOPEN_CLOEXEC)
		if err != nil {
			ch <- result{nil, fmt.Errorf("fsopen sysfs: %w", err)}
			return
		}
		defer unix.Close(fd)
		if err := unix.FsconfigCreate(fd); err != nil {
			ch <- result{nil, fmt.Errorf("creating sysfs: %w", err)}
			return
		}
		attr := unix.MOUNT_ATTR_RDONLY | unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NODEV | unix.MOUNT_ATTR_NOEXEC
		mfd, err := unix.Fsmount(fd, unix.FSMOUNT_CLOEXEC, attr)
		if err != nil {
			ch <- result{nil, fmt.Errorf("fsmount sysfs: %w", err)}
			return
		}
		// Sandboxes get clones of it (open_tree(OPEN_TREE_CLONE) on a
		// mount no mount namespace holds), which kernels before 6.15
		// refuse (EINVAL): found out here, not in every create.
		clone, err := unix.OpenTree(mfd, "", unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC|unix.AT_EMPTY_PATH)
		if err != nil {
			unix.Close(mfd)
			ch <- result{nil, fmt.Errorf("this kernel cannot clone a detached mount (open_tree: %w)", err)}
			return
		}
		unix.Close(clone)
		ch <- result{os.NewFile(uintptr(mfd), "sysfs"), nil}
	}()
	r := <-ch
	return r.f, r.err
}

// writeState records init in dir/status, in crun's format (readStateFile).
func writeState(dir string, pid int, start uint64) error {
	if err := os.Mkdir(dir, 0o700); err != nil {
		return fmt.Errorf("creating sandbox state: %w", err)
	}
	b, err := json.Marshal(struct {
		Pid      int    `json:"pid"`
		Start    uint64 `json:"process-start-time"`
		Launcher string `json:"launcher"`
	}{pid, start, "dsec"})
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "status"), b, 0o600); err != nil {
		return fmt.Errorf("writing sandbox state: %w", err)
	}
	return nil
}
