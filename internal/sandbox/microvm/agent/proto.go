// Package agent is the microVM backend's in-guest agent and the host's
// client of it. The agent is the guest's pid 1 (cmd/dsec-agent, a static
// binary in the guest's initramfs): it mounts the kernel's filesystems,
// loads the modules the initramfs lists, finds the virtio-serial port the
// host named PortName and serves the host on it.
//
// The protocol is one JSON object (a Msg) per line in each direction,
// multiplexed by request id, so that commands run concurrently and stream
// their output: the host sends "exec" with an id, then "stdin" and
// "stdin_close" for it; the agent answers "started" (with the pid inside),
// "stdout" and "stderr" chunks as they come, and "exit". Requests that are
// not processes ("setup", "signal", "kill", "ping") are answered "ok" or
// "error" with their id; "ack" (flow control, see Msg.Window) is not
// answered. Every connection begins with the agent's "ready":
// the host may go and come back (an edge restart), and the agent serves
// the next connection the same way, killing the processes the previous one
// started and left running.
//
// This package must build without cgo: it runs in a guest that has no libc.
package agent

import "github.com/dsecproject/dsec/api"

// PortName is the name of the virtio-serial port the agent serves.
const PortName = "dsec.agent"

// ModulesDir is where the initramfs keeps the kernel modules the agent
// loads, and ModulesList the file naming them in load order.
const (
	ModulesDir  = "/lib/dsec/modules"
	ModulesList = "/lib/dsec/modules/order"
)

// Msg is one line of the protocol, in either direction. Which fields mean
// something depends on Op.
type Msg struct {
	ID uint64 `json:"id,omitempty"`
	Op string `json:"op"`

	// exec: the command, run in the sandbox's root once setup made one
	// (else in the agent's own). User is a name, uid or uid:gid, looked
	// up in the sandbox's /etc/passwd ("" is root). A Cwd of "~" or
	// beginning "~/" is in the user's home.
	Args []string `json:"args,omitempty"`
	Env  []string `json:"env,omitempty"`
	Cwd  string   `json:"cwd,omitempty"`
	User string   `json:"user,omitempty"`
	// TTY runs it on a new terminal of Rows×Cols in the sandbox (its
	// controlling terminal, in a session of its own): its output is all
	// "stdout". resize: a new size for the terminal of exec request Of.
	TTY  bool   `json:"tty,omitempty"`
	Rows uint16 `json:"rows,omitempty"`
	Cols uint16 `json:"cols,omitempty"`
	// Private runs the command in a pid namespace beside the sandbox's
	// (the "private" feature), which no process of the sandbox can see:
	// pid 1 there, with a /proc of its own; what it leaves running ends
	// with it. Its started Pid is 0.
	Private bool `json:"private,omitempty"`

	// stdin, stdout, stderr: a chunk of a stream.
	Data []byte `json:"data,omitempty"`

	// signal: sig to process Pid (with Self) and its descendants (with
	// Tree). kill: SIGKILL to the process of exec request Of and its
	// descendants (nothing once it exited). started: the process's Pid.
	Of     uint64 `json:"of,omitempty"`
	Pid    int    `json:"pid,omitempty"`
	Signal int    `json:"signal,omitempty"`
	Self   bool   `json:"self,omitempty"`
	Tree   bool   `json:"tree,omitempty"`

	// exit: the exit code (128+signal when killed).
	Code int `json:"code,omitempty"`

	// error: what failed; Kind is "invalid" when the request was at
	// fault (a user the sandbox does not have), else "".
	Error string `json:"error,omitempty"`
	Kind  string `json:"kind,omitempty"`

	// setup: the sandbox's root filesystem and limits.
	Setup *Setup `json:"setup,omitempty"`

	// fs: a file operation on the sandbox's root (FS), answered by an
	// "exit" carrying FSResult (or Error and Kind, an errdefs code);
	// ReadFile and WriteTar first answer "started" (with FSResult's
	// Entry) and stream the data as "stdout"; WriteFile and ExtractTar
	// take theirs as "stdin".
	FS       *FSRequest `json:"fs,omitempty"`
	FSResult *FSResult  `json:"fs_result,omitempty"`

	// Flow control. ready, and the answer to a ping, list the agent's
	// Features; with "window", an exec or fs request may carry Window:
	// the bytes of stdout, stderr and file data the host takes for it
	// before the agent waits for an "ack" (Acked: the bytes of that
	// request the host has written out in all, so that a lost ack is
	// made good by the next). A consumer that
	// reads slowly then holds up its own request alone, not the
	// connection; the host acks data of a request it gave up on at once.
	Features []string `json:"features,omitempty"`
	Window   int64    `json:"window,omitempty"`
	Acked    int64    `json:"acked,omitempty"`
}

// FeatureWindow is the flow control feature (Msg.Window).
const FeatureWindow = "window"

// FeaturePrivate is Msg.Private, and with it the sandbox's processes in
// namespaces of their own (contain_linux.go): an agent without it would
// run a private command as an ordinary one.
const FeaturePrivate = "private"

// FSRequest is a file operation, as the files API has them.
type FSRequest struct {
	// Method is read, write, stat, list, remove, mkdir, rename, tar_out,
	// tar_in, watch, watch_poll or watch_stop, on the sandbox's root; or
	// diff_out: the overlay's
	// writable layer (whiteouts and opaque directories included, xattrs
	// as PAX records; see files.Root.WriteDiffTar), read while its
	// filesystem is frozen, streamed as tar_out streams.
	Method    string `json:"method"`
	Path      string `json:"path"`
	Dest      string `json:"dest,omitempty"`
	Mode      uint32 `json:"mode,omitempty"`
	MaxBytes  int64  `json:"max_bytes,omitempty"`
	MaxFiles  int    `json:"max_files,omitempty"`
	Depth     int    `json:"depth,omitempty"`
	Recursive bool   `json:"recursive,omitempty"`
	// Owner is a user of the sandbox (as exec's User) that what the call
	// creates belongs to ("": root).
	Owner string `json:"owner,omitempty"`
	// watch starts a directory watch of Path, Depth levels deep, of at
	// most MaxFiles names (files.Root.Watch), answered with its id in
	// FSResult.Watch; watch_poll (Watch: the id) answers the changes
	// since the last poll in FSResult.Events; watch_stop ends it. A
	// connection's watches end with it.
	Watch uint64 `json:"watch,omitempty"`
}

// FSResult is what a file operation returns.
type FSResult struct {
	Entry   *api.FileEntry  `json:"entry,omitempty"`
	Entries []api.FileEntry `json:"entries,omitempty"`
	Tar     *api.TarResult  `json:"tar,omitempty"`
	Watch   uint64          `json:"watch,omitempty"`
	Events  []api.FileEvent `json:"events,omitempty"`
}

// MaxWatches bounds the directory watches of one connection.
const MaxWatches = 64

// Setup makes the sandbox inside the guest: the root filesystem from the
// layer disks and the writable disk, its hostname and its limits.
type Setup struct {
	// Layers are the serials of the read-only layer disks (EROFS),
	// bottom first; Upper the serial of the writable disk (ext4).
	Layers []string `json:"layers"`
	Upper  string   `json:"upper"`
	// Hostname is the guest's hostname.
	Hostname string `json:"hostname,omitempty"`
	// Pids bounds the sandbox's processes (0: no bound).
	Pids int64 `json:"pids,omitempty"`
	// Net configures the guest's network interface (nil: only lo).
	Net *NetSetup `json:"net,omitempty"`
	// ResolvConf is shown at the sandbox's /etc/resolv.conf.
	ResolvConf []byte `json:"resolv_conf,omitempty"`
	// Seccomp is the filter every process of the sandbox runs under
	// (the container backend's profile as classic BPF: a raw sock_filter
	// array, little-endian), installed by the sandbox's init and by each
	// private run before they drop their capabilities. None: no filter.
	Seccomp []byte `json:"seccomp,omitempty"`
	// Masked and ReadOnly are the paths of the sandbox's /proc and /sys
	// its init hides (a file under /dev/null, a directory under an empty
	// read-only tmpfs) and makes read-only: the container backend's. None
	// given: the init's own few.
	Masked   []string `json:"masked,omitempty"`
	ReadOnly []string `json:"read_only,omitempty"`
}

// NetSetup is the address of the guest's interface (the one with MAC) and
// its default gateway.
type NetSetup struct {
	MAC     string `json:"mac"`
	Addr    string `json:"addr"` // CIDR
	Gateway string `json:"gateway"`
}

// Root is where the agent mounts the sandbox's root filesystem.
const Root = "/sandbox"

// upperDir is the overlay's writable layer, on the writable disk.
const upperDir = "/rw/upper"

// ChunkSize bounds the data of one stdin, stdout or stderr Msg.
const ChunkSize = 32 << 10
