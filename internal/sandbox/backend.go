// Package sandbox defines the Backend interface every sandbox runtime
// implements (container and gVisor today; microVM later), the process and
// limit types the edge hands to it, and pure validation of sandbox specs.
// Implementations live in sibling packages (sandbox/container,
// sandbox/gvisor, sandbox/fake); a shared
// conformance suite lives in sandbox/sandboxtest.
// The edge is the only production caller.
package sandbox

import (
	"context"
	"io"
	"os"
	"syscall"

	"github.com/dsecproject/dsec/api"
)

// Backend runs sandboxes on one node. The edge composes each sandbox's root
// filesystem (overlay over read-only layers) before calling Create and
// removes it after Destroy; the backend owns only what it creates itself
// (runtime state, bundle, cgroup, namespaces).
//
// Implementations must be safe for concurrent use across different ids.
// Calls for one id are serialised by the edge.
type Backend interface {
	// Name is the backend's name as used in the API ("container").
	Name() string
	// Create starts the sandbox described by cfg. When it returns nil the
	// sandbox is ready for Exec. On error nothing created by the backend
	// for cfg.ID is left behind.
	Create(ctx context.Context, cfg Config) error
	// Exec starts a process inside a running sandbox.
	Exec(ctx context.Context, id string, p Process) (Proc, error)
	// Destroy stops the sandbox and removes everything the backend created
	// for it. Destroying an unknown id is not an error.
	Destroy(ctx context.Context, id string) error
	// Status reports the runtime's view of id (errdefs.ErrNotFound if it has none).
	Status(ctx context.Context, id string) (Status, error)
	// List returns the ids the backend has state for, including ones the
	// edge may have forgotten (used for reaping after a crash).
	List(ctx context.Context) ([]string, error)
}

// Status is the runtime's view of a sandbox.
type Status struct {
	Running bool
	// Pid is the host pid of the sandbox's init, when running.
	Pid int
	// Paused says a Pauser backend holds the sandbox paused (Running
	// stays true: it is there to resume).
	Paused bool
}

// Config describes one sandbox to a backend.
type Config struct {
	ID string
	// Dir is a private directory path the backend may create and use
	// (bundle files); the caller removes it after Create. Backends that
	// need no files leave it uncreated.
	Dir string
	// Rootfs is the composed root filesystem: a mounted overlay, or with
	// RootfsMount an empty directory to attach it at.
	Rootfs string
	// RootfsMount, if set, is the rootfs as a detached mount (see
	// layer.DetachedOverlay), which the backend attaches at Rootfs only
	// inside the sandbox's own mount namespace, so the host's mount table
	// does not grow with sandboxes. The sandbox's mounts then hold the
	// overlay; it goes away with them. Only backends that implement
	// DetachedRootfs get one; the caller closes it after Create.
	RootfsMount *os.File
	// Images are the layer images, bottom first, and Upper an empty
	// directory for the writable layer, for backends that implement
	// LayerImages (Rootfs is then unset).
	Images   []string
	Upper    string
	Hostname string
	// CgroupPath is the cgroup of the sandbox relative to the hierarchy
	// roots, e.g. "/dsec/sb-node1-abc".
	CgroupPath string
	Limits     Limits
	// ResolvConf, if set, is a host file shown read-only at
	// /etc/resolv.conf.
	ResolvConf string
	// AttachNetwork, if set, is called by a NetworkFirst backend once the
	// sandbox's network namespace exists and before its first process
	// runs, with a host pid in that namespace; an error fails the create.
	AttachNetwork func(pid int) error
	// UserNS, if set, runs the sandbox in a new user namespace in which IDs
	// 0..Size-1 are host IDs HostID.. (uids and gids alike). The rootfs
	// must already show files with those host IDs (idmapped lowers, an
	// upper owned by HostID).
	UserNS *IDMap
}

// IDMap is a contiguous ID mapping (see Config.UserNS).
type IDMap struct {
	HostID uint32
	Size   uint32
	// Owner, if not 0, is the host uid that makes (owns) the user
	// namespace. The kernel charges the per-user counts of the sandbox's
	// processes (inotify instances and watches, pending signals, message
	// queue bytes, processes) to it at the host's level: a uid of the
	// sandbox's own keeps them apart from host root's and from other
	// sandboxes'. 0: the runtime makes it, as root.
	Owner uint32
}

// Limits are the resource limits applied to the whole sandbox. Zero means
// "no limit" for each field.
type Limits struct {
	CPU         float64 // cores (CFS quota); also scales cpu weight
	MemoryBytes int64
	Pids        int64
	// BestEffort selects the best-effort QoS class (SCHED_IDLE-like weight).
	BestEffort bool
}

// Process is a process to start inside a sandbox.
type Process struct {
	Args []string
	Env  []string
	Cwd  string
	UID  uint32
	GID  uint32
	// User is set instead of UID and GID for a LayerImages backend, whose
	// files the node cannot read: the user as the caller gave it (a name,
	// uid or uid:gid; "" for the image's default), resolved by the backend
	// inside the sandbox, which also sets HOME and USER. Cwd may then be
	// "~" or begin with "~/": the user's home, as the backend found it.
	User string
	// AdditionalGIDs are supplementary groups.
	AdditionalGIDs []uint32
	Stdin          io.Reader
	Stdout         io.Writer
	Stderr         io.Writer
	// TTY says Stdin, Stdout and Stderr are one terminal (the slave of a
	// pseudo-terminal, an *os.File): the process leads a new session with
	// it as its controlling terminal. Backends that cannot do that refuse
	// the process with errdefs.ErrPrecondition.
	TTY bool
	// Private runs the process where the sandbox's own processes cannot
	// see, signal, trace or read it (a grader's run): for containers, a
	// pid namespace beside the sandbox's with its own /proc. Its
	// descendants end with it. Backends that cannot refuse it with
	// errdefs.ErrPrecondition.
	Private bool
}

// Proc is a started process.
type Proc interface {
	// Wait waits for the process to exit and its output to be copied, and
	// returns its exit code (128+signal when killed by a signal).
	Wait() (int, error)
	// Kill kills the process and every process it started that is still
	// its descendant. Safe to call more than once and after exit.
	Kill() error
	// Pid is the host pid of the process, or 0 if not yet known.
	Pid() int
}

// Resizer is implemented by the Procs of a backend whose terminals are
// its own rather than the pseudo-terminal the edge made (a VM's, inside
// the guest, which the backend joins to the edge's): the edge tells them
// each new size it gives its terminal.
type Resizer interface {
	Resize(ctx context.Context, rows, cols uint16) error
}

// Pinner is implemented by backends that give every sandbox a shell the
// sandbox cannot modify (a read-only mount of a static shell): sessions and
// graders use it so that a sandbox that overwrites its own /bin/sh or
// /bin/bash cannot intercept the platform's commands.
type Pinner interface {
	// PinnedShell returns the shell's path inside the sandbox, or "".
	PinnedShell() string
}

// DetachedRootfs is implemented by backends that can take the rootfs as a
// detached mount (Config.RootfsMount).
type DetachedRootfs interface {
	TakesDetachedRootfs() bool
}

// UserNSDefault is implemented by backends whose sandboxes run in a user
// namespace of their own by default when the spec leaves userns out:
// those that make one at little cost (the container backend's launcher).
type UserNSDefault interface {
	UserNSByDefault() bool
}

// IDRangePerSandbox is implemented by backends that can give each
// user-namespace sandbox an ID range of its own: nothing of the sandbox's
// on the host needs to be reachable by its mapped IDs (dsec's launcher
// makes every mount as host root; a runtime that joins the namespace
// first reaches the rootfs as the mapped root, through directories open
// to the node's one range).
type IDRangePerSandbox interface {
	IDRangePerSandbox() bool
}

// Pauser is implemented by backends that pause and resume sandboxes
// themselves (a VM's own pause, a simulated runtime) rather than by the
// edge freezing the sandbox's cgroup. Pause of a paused sandbox and
// Resume of a running one succeed and do nothing.
type Pauser interface {
	Pause(ctx context.Context, id string) error
	Resume(ctx context.Context, id string) error
}

// LayerImages is implemented by backends that make a sandbox's root
// filesystem themselves from the layer images, as a microVM does with
// disks (and a simulated backend does with nothing). The edge then mounts
// no layer and composes no overlay: Config.Images and Config.Upper stand
// in for Config.Rootfs, and the host has no view of the sandbox's files
// (the files API and snapshots, which read the rootfs from the host, are
// refused for such sandboxes).
type LayerImages interface {
	TakesLayerImages() bool
}

// NetworkFirst is implemented by backends whose sandboxes must have their
// network interfaces before they start (gVisor's network stack copies
// them once, at start). The edge hands them Config.AttachNetwork instead
// of attaching the network after Create.
type NetworkFirst interface {
	NetworkFirst() bool
}

// InnerSignaler is implemented by backends whose sandbox processes have no
// host pids the edge could signal (a user-space kernel, a VM): their
// Proc.Pid is 0, and the edge reaches a process by its pid in the
// backend's kernel (InnerPid: for a VM the pid inside, for gVisor the pid
// in the Sentry's root pid namespace, which the sandbox's own differs
// from).
type InnerSignaler interface {
	// Signal sends sig to process pid of sandbox id (with self) and to
	// every descendant of it (with tree).
	Signal(ctx context.Context, id string, pid int, sig syscall.Signal, self, tree bool) error
}

// InnerProc is implemented by the Procs of an InnerSignaler backend.
type InnerProc interface {
	// InnerPid is the process's pid in the backend's kernel, the one
	// InnerSignaler.Signal takes (0 if unknown).
	InnerPid() int
}

// OwnKernel is implemented by backends whose sandboxes run on a kernel of
// their own (a VM): what a sandbox's root can do to its kernel (mount,
// load modules, read the kernel log) stays in its VM, so the container
// masks and the host-kernel probes of the attack suite do not apply.
type OwnKernel interface {
	OwnKernel() bool
}

// DiffExporter is implemented by LayerImages backends that can hand out
// a sandbox's writable layer for a snapshot (pack_diff), which the node
// cannot read itself: a tar of the overlay upper in the overlay's own
// form (whiteouts as 0:0 character devices, opaque directories with
// trusted.overlay.opaque="y", xattrs as PAX SCHILY.xattr records), as it
// was at one moment. A paused sandbox is paused again after. The tar is
// made inside the sandbox, so whoever is root there controls it: the edge
// unpacks it with files.TarOptions.Diff.
type DiffExporter interface {
	ExportDiff(ctx context.Context, id string, w io.Writer) error
}

// FileServer is implemented by backends that serve a sandbox's files
// themselves, from inside it, because the node cannot reach them (a VM's
// disk): the edge's files API then goes through Files instead of a
// host-side view of the rootfs.
type FileServer interface {
	Files(ctx context.Context, id string) (Files, error)
}

// Files is a sandbox's files as the files API acts on them: paths are the
// sandbox's, confined to its root; owners are users of the sandbox (as
// exec's user; "" is root); errors are classified as package errdefs
// does.
type Files interface {
	ReadFile(ctx context.Context, path string) (io.ReadCloser, api.FileEntry, error)
	WriteFile(ctx context.Context, path string, data io.Reader, mode os.FileMode, maxBytes int64, owner string) (api.FileEntry, error)
	Stat(ctx context.Context, path string) (api.FileEntry, error)
	List(ctx context.Context, path string, depth int) ([]api.FileEntry, error)
	Remove(ctx context.Context, path string, recursive bool) error
	Mkdir(ctx context.Context, path, owner string) (api.FileEntry, error)
	Rename(ctx context.Context, src, dst string) (api.FileEntry, error)
	WriteTar(ctx context.Context, path string, w io.Writer) error
	ExtractTar(ctx context.Context, path string, rd io.Reader, maxBytes int64, maxFiles int, owner string) (api.TarResult, error)
	// Watch starts watching the directory path, depth levels deep (1:
	// its children), of at most maxEntries names, as files.Root.Watch
	// does; the caller closes it.
	Watch(ctx context.Context, path string, depth, maxEntries int) (Watcher, error)
}

// Watcher is a directory watch of Files: each Poll returns the changes
// since the one before (files.Watch.Poll). Polls come one at a time.
type Watcher interface {
	Poll(ctx context.Context) ([]api.FileEvent, error)
	Close()
}
