// Package api holds the wire types of the dsec REST API (API.md) and embeds
// the OpenAPI document that describes them. It is public: the Go SDK, the
// apiserver and the edge all speak these types, so a field renamed here is a
// contract break.
package api

import "time"

// Sandbox backends.
const (
	BackendContainer = "container"
	BackendGVisor    = "gvisor"
	BackendMicroVM   = "microvm"
)

// Sandbox states.
const (
	StateCreating = "creating"
	StateRunning  = "running"
	StatePaused   = "paused"
	StateStopped  = "stopped"
	StateFailed   = "failed"
)

// Layer kinds.
const (
	KindBase      = "base"
	KindWorkspace = "workspace"
	KindToolkit   = "toolkit"
	KindSnapshot  = "snapshot"
)

// NetworkPolicy is a sandbox's egress allowlist (enforced from the host side).
type NetworkPolicy struct {
	Allow []string `json:"allow,omitempty"`
	Deny  []string `json:"deny,omitempty"`
}

// SandboxSpec is what a caller asks for in POST /v1/sandboxes.
type SandboxSpec struct {
	Backend     string            `json:"backend,omitempty"`
	Base        string            `json:"base,omitempty"`
	Image       string            `json:"image,omitempty"`
	Workspace   string            `json:"workspace,omitempty"`
	Toolkits    []string          `json:"toolkits,omitempty"`
	Snapshot    string            `json:"snapshot,omitempty"`
	CPU         float64           `json:"cpu,omitempty"`
	MemoryMB    int64             `json:"memory_mb,omitempty"`
	DiskMB      int64             `json:"disk_mb,omitempty"`
	Pids        int64             `json:"pids,omitempty"`
	TTL         int64             `json:"ttl,omitempty"`
	IdleTimeout int64             `json:"idle_timeout,omitempty"`
	Network     *NetworkPolicy    `json:"network,omitempty"`
	Env         map[string]string `json:"env,omitempty"`
	User        string            `json:"user,omitempty"`
	Workdir     string            `json:"workdir,omitempty"`
	Labels      map[string]string `json:"labels,omitempty"`
	QoS         string            `json:"qos,omitempty"`
	// NodeSelector places the sandbox only on nodes carrying all these
	// labels (dsec edge --node-labels), e.g. {"gpu": "a100"}.
	NodeSelector map[string]string `json:"node_selector,omitempty"`
	// UserNS runs the sandbox in a user namespace: root inside is an
	// unprivileged uid on the host. Left out, the node decides: container
	// sandboxes get one where the node's launcher makes it (dsec up
	// --userns-default); the sandbox's record says which it got. false
	// asks for none: root inside is then host root (without most of its
	// capabilities).
	UserNS *bool `json:"userns,omitempty"`
	// MemoryCgroup is "own" (the default: a memory cgroup per sandbox,
	// needed for memory_mb, memory stats and reclaim on pause) or
	// "shared" (the sandbox is charged to one memory cgroup of the node,
	// shared with the other "shared" sandboxes: about 4x less host memory
	// per idle sandbox, see docs/operating.md "Density").
	MemoryCgroup string `json:"memory_cgroup,omitempty"`
	// Project is the project the sandbox belongs to: the caller's key's
	// project when empty, or one below it.
	Project string `json:"project,omitempty"`
}

// InUserNS reports whether the spec asks for a user namespace (after the
// node's default, whether the sandbox has one).
func (s SandboxSpec) InUserNS() bool { return s.UserNS != nil && *s.UserNS }

// Values of SandboxSpec.MemoryCgroup.
const (
	MemoryCgroupOwn    = "own"
	MemoryCgroupShared = "shared"
)

// Sandbox is the API's view of one sandbox.
type Sandbox struct {
	ID      string `json:"id"`
	Node    string `json:"node"`
	Project string `json:"project,omitempty"`
	// CreateSeq is the node's sequence number of the sandbox's create
	// (Node.CreateSeq): a node's view with a CreateSeq at least this
	// counts the sandbox. Quotas use it.
	CreateSeq    uint64            `json:"create_seq,omitempty"`
	Backend      string            `json:"backend"`
	State        string            `json:"state"`
	Spec         SandboxSpec       `json:"spec"`
	CreatedAt    time.Time         `json:"created_at"`
	ExpiresAt    *time.Time        `json:"expires_at,omitempty"`
	LastActiveAt *time.Time        `json:"last_active_at,omitempty"`
	Labels       map[string]string `json:"labels,omitempty"`
	// Layers are the digests the sandbox's rootfs is composed of, bottom first.
	Layers []string `json:"layers,omitempty"`
	// Error explains a failed or stopped state.
	Error string `json:"error,omitempty"`
	// PausedAt is when the sandbox was paused (state paused only).
	PausedAt *time.Time `json:"paused_at,omitempty"`
	// PauseReason says why the node paused the sandbox itself (empty for
	// a pause a caller asked for; a resume clears it): see
	// PauseReasonDiskPressure.
	PauseReason string `json:"pause_reason,omitempty"`
}

// PauseReasonDiskPressure is Sandbox.PauseReason for a sandbox the node
// paused because its state filesystem fell below its floor of free space
// (dsec up --min-free-disk-mb) while the sandbox, without a disk of its
// own, wrote the most to it. Unlike a pause asked for, it does not stop
// the sandbox's TTL.
const PauseReasonDiskPressure = "disk_pressure"

// BatchCreateRequest is the body of POST /v1/sandboxes:batch.
type BatchCreateRequest struct {
	Count int         `json:"count"`
	Spec  SandboxSpec `json:"spec"`
}

// BatchError is one failed item of a batch.
type BatchError struct {
	Index int         `json:"index"`
	Error ErrorDetail `json:"error"`
}

// BatchResult is returned by batch create and fork.
type BatchResult struct {
	Sandboxes []Sandbox    `json:"sandboxes"`
	Errors    []BatchError `json:"errors"`
}

// SandboxList is returned by GET /v1/sandboxes.
type SandboxList struct {
	Sandboxes     []Sandbox `json:"sandboxes"`
	NextPageToken string    `json:"next_page_token,omitempty"`
	// UnreachableNodes are nodes that could not be asked (down or cut
	// off): the answer leaves out their sandboxes.
	UnreachableNodes []string `json:"unreachable_nodes,omitempty"`
}

// LabelsRequest selects sandboxes by labels (delete/pause/resume by labels).
type LabelsRequest struct {
	Labels map[string]string `json:"labels"`
}

// DeleteResult is returned by POST /v1/sandboxes:delete.
type DeleteResult struct {
	Deleted int `json:"deleted"`
	// UnreachableNodes are nodes that could not be asked (down or cut
	// off): the answer leaves out their sandboxes.
	UnreachableNodes []string `json:"unreachable_nodes,omitempty"`
}

// PauseResult is returned by POST /v1/sandboxes/{id}/pause: the paused
// sandbox and what reclaiming its memory achieved.
type PauseResult struct {
	Sandbox           Sandbox `json:"sandbox"`
	MemoryBeforeBytes uint64  `json:"memory_before_bytes"`
	MemoryAfterBytes  uint64  `json:"memory_after_bytes"`
	MemoryFreedBytes  uint64  `json:"memory_freed_bytes"`
	// ReclaimMethod names the kernel interface used (memory.reclaim on
	// cgroup v2, memory.force_empty on v1), or "backend" when the backend
	// paused the sandbox itself (the figures are then the working set
	// before and after).
	ReclaimMethod string `json:"reclaim_method,omitempty"`
	DurationMS    int64  `json:"duration_ms"`
}

// CountResult is returned by pause and resume by labels.
type CountResult struct {
	Count int `json:"count"`
	// UnreachableNodes are nodes that could not be asked (down or cut
	// off): the answer leaves out their sandboxes.
	UnreachableNodes []string `json:"unreachable_nodes,omitempty"`
}

// KeepaliveRequest extends a sandbox's lifetime: it expires TTL seconds from now.
type KeepaliveRequest struct {
	TTL int64 `json:"ttl"`
}

// Stats is a sandbox's current resource use.
type Stats struct {
	CPUUsageNS     uint64 `json:"cpu_usage_ns"`
	MemoryBytes    uint64 `json:"memory_bytes"`
	MemoryMaxBytes uint64 `json:"memory_limit_bytes,omitempty"`
	Pids           uint64 `json:"pids"`
	DiskBytes      uint64 `json:"disk_bytes"`
	// DiskLimitBytes, Inodes and InodeLimit are set for sandboxes with
	// disk_mb (their writable layer is a filesystem of its own).
	DiskLimitBytes uint64 `json:"disk_limit_bytes,omitempty"`
	Inodes         uint64 `json:"inodes,omitempty"`
	InodeLimit     uint64 `json:"inode_limit,omitempty"`
	// MemorySource says where MemoryBytes comes from: "cgroup" (the
	// sandbox's memory cgroup: working set) or "rss" (memory_cgroup
	// shared: the sum of its processes' resident sets).
	MemorySource string `json:"memory_source,omitempty"`
}

// ExecRequest is the body of POST /v1/sandboxes/{id}/exec. Exactly one of
// Cmd (run by /bin/sh -c) and Argv is given.
type ExecRequest struct {
	Cmd            string            `json:"cmd,omitempty"`
	Argv           []string          `json:"argv,omitempty"`
	Cwd            string            `json:"cwd,omitempty"`
	Env            map[string]string `json:"env,omitempty"`
	User           string            `json:"user,omitempty"`
	Stdin          string            `json:"stdin,omitempty"`
	StdinB64       string            `json:"stdin_b64,omitempty"`
	Timeout        int64             `json:"timeout,omitempty"`
	MaxOutputBytes int64             `json:"max_output_bytes,omitempty"`
	// Private runs the command where the sandbox's own processes cannot
	// see, signal, trace or read it (for graders): its own pid namespace
	// and /proc; what it starts ends with it.
	Private bool `json:"private,omitempty"`
}

// ExecResult is the result of a one-shot exec or a session run. Stdout and
// Stderr hold the output as text; when it is not valid UTF-8 the exact bytes
// are also given base64-encoded in the _b64 fields.
type ExecResult struct {
	ExitCode   int    `json:"exit_code"`
	Stdout     string `json:"stdout"`
	Stderr     string `json:"stderr"`
	StdoutB64  string `json:"stdout_b64,omitempty"`
	StderrB64  string `json:"stderr_b64,omitempty"`
	TimedOut   bool   `json:"timed_out"`
	Truncated  bool   `json:"truncated"`
	DurationMS int64  `json:"duration_ms"`
}

// FnCallRequest is the body of POST /v1/fncall: a short stateless job run
// in a fresh sandbox. Files (base64) are written under /work, the command
// runs there, and FetchFiles (paths relative to /work) come back.
type FnCallRequest struct {
	Base     string            `json:"base"`
	Cmd      string            `json:"cmd,omitempty"`
	Argv     []string          `json:"argv,omitempty"`
	Files    map[string]string `json:"files,omitempty"`
	Env      map[string]string `json:"env,omitempty"`
	Stdin    string            `json:"stdin,omitempty"`
	StdinB64 string            `json:"stdin_b64,omitempty"`
	Timeout  int64             `json:"timeout,omitempty"`
	// MaxOutputBytes caps each output stream, as ExecRequest's does.
	MaxOutputBytes int64    `json:"max_output_bytes,omitempty"`
	MemoryMB       int64    `json:"memory_mb,omitempty"`
	FetchFiles     []string `json:"fetch_files,omitempty"`
}

// FnCallResult is the answer of POST /v1/fncall. Stdout and Stderr are
// text; when the output is not valid UTF-8 the exact bytes are also in the
// _b64 fields, as in ExecResult.
type FnCallResult struct {
	ExitCode   int               `json:"exit_code"`
	Stdout     string            `json:"stdout"`
	Stderr     string            `json:"stderr"`
	StdoutB64  string            `json:"stdout_b64,omitempty"`
	StderrB64  string            `json:"stderr_b64,omitempty"`
	TimedOut   bool              `json:"timed_out"`
	Truncated  bool              `json:"truncated"`
	DurationMS int64             `json:"duration_ms"`
	Files      map[string]string `json:"files,omitempty"`
	// Missing lists fetch_files that were not regular files (absent, a
	// directory, ...) when the command ended.
	Missing []string `json:"missing,omitempty"`
}

// ExecEvent is one NDJSON line of a streaming exec: exactly one of the output
// fields, or the final status (ExitCode non-nil), or an error.
type ExecEvent struct {
	Stdout     string       `json:"stdout,omitempty"`
	Stderr     string       `json:"stderr,omitempty"`
	StdoutB64  string       `json:"stdout_b64,omitempty"`
	StderrB64  string       `json:"stderr_b64,omitempty"`
	ExitCode   *int         `json:"exit_code,omitempty"`
	TimedOut   bool         `json:"timed_out,omitempty"`
	Truncated  bool         `json:"truncated,omitempty"`
	DurationMS int64        `json:"duration_ms,omitempty"`
	Error      *ErrorDetail `json:"error,omitempty"`
}

// SessionRequest opens a persistent shell.
type SessionRequest struct {
	Shell string            `json:"shell,omitempty"`
	Cwd   string            `json:"cwd,omitempty"`
	Env   map[string]string `json:"env,omitempty"`
	User  string            `json:"user,omitempty"`
}

// Session identifies an open shell session.
type Session struct {
	SessionID string `json:"session_id"`
}

// SessionRunRequest runs one command in a session's shell.
type SessionRunRequest struct {
	Command        string `json:"command"`
	Timeout        int64  `json:"timeout,omitempty"`
	MaxOutputBytes int64  `json:"max_output_bytes,omitempty"`
}

// FileEntry describes one file in a listing or stat.
type FileEntry struct {
	Path       string    `json:"path"`
	Type       string    `json:"type"` // file | dir | symlink | other
	Size       int64     `json:"size"`
	Mode       string    `json:"mode"` // octal permission bits, e.g. "0644"
	MTime      time.Time `json:"mtime"`
	LinkTarget string    `json:"link_target,omitempty"`
	// UID and GID own the entry, as the sandbox sees them (a user
	// namespace's IDs, not the host's).
	UID uint32 `json:"uid"`
	GID uint32 `json:"gid"`
}

// FileEvent is one change under a watched directory (the edge's WatchDir,
// served to E2B clients as envd's WatchDir stream). Name is the path
// relative to the watched directory ("a.txt", "sub/a.txt"); Entry
// describes the name after the change (absent for remove and for the old
// name of a rename).
type FileEvent struct {
	Name  string     `json:"name"`
	Type  string     `json:"type"`
	Entry *FileEntry `json:"entry,omitempty"`
}

// File event types (FileEvent.Type). A watch begins with one start event,
// which names nothing: from then on, changes are reported.
const (
	FileEventStart  = "start"
	FileEventCreate = "create"
	FileEventWrite  = "write"
	FileEventRemove = "remove"
	FileEventRename = "rename"
	FileEventChmod  = "chmod"
)

// FileList is returned by files:list.
type FileList struct {
	Entries []FileEntry `json:"entries"`
}

// TarResult is returned by PUT files:tar.
type TarResult struct {
	Files int   `json:"files"`
	Bytes int64 `json:"bytes"`
}

// Command log entry kinds.
const (
	LogExec          = "exec"
	LogSessionOpen   = "session.open"
	LogSessionRun    = "session.run"
	LogSessionClose  = "session.close"
	LogFilesRead     = "files.read"
	LogFilesWrite    = "files.write"
	LogFilesStat     = "files.stat"
	LogFilesList     = "files.list"
	LogFilesRemove   = "files.remove"
	LogFilesTarOut   = "files.tar_out"
	LogFilesTarIn    = "files.tar_in"
	LogFilesMkdir    = "files.mkdir"
	LogFilesMove     = "files.move"
	LogFilesWatch    = "files.watch"
	LogTruncatedKind = "log.truncated"
)

// LogEntry is one operation in a sandbox's command log
// (GET /v1/sandboxes/{id}/log). Seq numbers start at 1, grow by one per
// entry and are never reused; entries are in seq order, which is the order
// the operations finished in.
type LogEntry struct {
	Seq  int64     `json:"seq"`
	Time time.Time `json:"time"` // when the operation started
	Kind string    `json:"kind"`
	// Request and Result are bounded summaries: never file contents,
	// stdin or environment values.
	Request LogRequest `json:"request"`
	Result  LogResult  `json:"result"`
}

// LogRequest summarises what an operation asked for. Long strings are cut
// and end in "…[truncated]".
type LogRequest struct {
	Cmd        string   `json:"cmd,omitempty"`
	Argv       []string `json:"argv,omitempty"`
	Cwd        string   `json:"cwd,omitempty"`
	User       string   `json:"user,omitempty"`
	Timeout    int64    `json:"timeout,omitempty"`
	StdinBytes int64    `json:"stdin_bytes,omitempty"`
	Stream     bool     `json:"stream,omitempty"`
	Shell      string   `json:"shell,omitempty"`
	SessionID  string   `json:"session_id,omitempty"`
	Command    string   `json:"command,omitempty"`
	Path       string   `json:"path,omitempty"`
	Dest       string   `json:"dest,omitempty"`
	Mode       string   `json:"mode,omitempty"`
	Recursive  bool     `json:"recursive,omitempty"`
	Depth      int      `json:"depth,omitempty"`
	Tag        string   `json:"tag,omitempty"`
	Private    bool     `json:"private,omitempty"`
}

// LogResult summarises how an operation ended: the error, or what it
// produced. A log.truncated entry gives the dropped seq range instead.
type LogResult struct {
	ExitCode     *int         `json:"exit_code,omitempty"`
	TimedOut     bool         `json:"timed_out,omitempty"`
	Truncated    bool         `json:"truncated,omitempty"`
	DurationMS   int64        `json:"duration_ms"`
	StdoutHead   string       `json:"stdout_head,omitempty"`
	StderrHead   string       `json:"stderr_head,omitempty"`
	SessionID    string       `json:"session_id,omitempty"`
	SessionEnded bool         `json:"session_ended,omitempty"`
	PID          *int         `json:"pid,omitempty"`
	Type         string       `json:"type,omitempty"`
	Size         *int64       `json:"size,omitempty"`
	Entries      *int         `json:"entries,omitempty"`
	Files        *int         `json:"files,omitempty"`
	Bytes        *int64       `json:"bytes,omitempty"`
	FirstSeq     int64        `json:"first_seq,omitempty"`
	LastSeq      int64        `json:"last_seq,omitempty"`
	Error        *ErrorDetail `json:"error,omitempty"`
}

// LogPage is returned by GET /v1/sandboxes/{id}/log: the entries after
// since_seq, and the since_seq that continues after them.
type LogPage struct {
	Entries []LogEntry `json:"entries"`
	NextSeq int64      `json:"next_seq"`
}

// Layer is one EROFS layer in the catalog.
type Layer struct {
	Digest    string    `json:"digest"`
	Ref       string    `json:"ref"`
	Kind      string    `json:"kind"`
	SizeBytes int64     `json:"size_bytes"`
	CreatedAt time.Time `json:"created_at"`
	// Snapshot describes where a snapshot layer came from (kind snapshot).
	Snapshot *SnapshotInfo `json:"snapshot,omitempty"`
	// Image is the configuration of the image a base layer was imported
	// from; sandboxes on the base take their defaults from it.
	Image *ImageConfig `json:"image,omitempty"`
	// Project is the project of the key that published the layer
	// (absent: root's). A key sees the layers of its project, of the
	// projects above it (what it inherits) and of those below it.
	Project string `json:"project,omitempty"`
	// Remote, if set, says the layer's image is not in the layer directory
	// but in an OCI registry, where edges read it: on demand, chunk by
	// chunk (pull "lazy"), or whole before first use (pull "full").
	Remote *LayerRemote `json:"remote,omitempty"`
	// Lowers are the digests of the layers this base layer sits on,
	// bottom first: an image cut by a merge threshold (merge_under) into
	// runs of its layers is its top run's layer over the others. A
	// sandbox on the base stacks them all.
	Lowers []string `json:"lowers,omitempty"`
	// LowersBytes is the size of the lowers' images together.
	LowersBytes int64 `json:"lowers_bytes,omitempty"`
}

// LayerRemote is where a registry-backed layer's image lives.
type LayerRemote struct {
	// Source is the artifact's reference as given: oci://HOST/REPO:TAG.
	Source string `json:"source"`
	// Manifest is the digest of the artifact's manifest when it was added.
	Manifest string `json:"manifest"`
	// Index is the digest of the chunk index blob, IndexSize its size and
	// ChunkSize the bytes each of its digests covers.
	Index     string `json:"index"`
	IndexSize int64  `json:"index_size"`
	ChunkSize int    `json:"chunk_size"`
	// Meta and MetaSize name the artifact's metadata pack: the image's
	// superblock, inodes and directories, which a node fetches whole
	// when it first mounts the layer (absent in older artifacts).
	Meta     string `json:"meta,omitempty"`
	MetaSize int64  `json:"meta_size,omitempty"`
	// Insecure talks plain HTTP to the registry.
	Insecure bool `json:"insecure,omitempty"`
	// Pull is "lazy" (read on demand, the default) or "full" (fetched
	// whole to the node before the first sandbox starts).
	Pull string `json:"pull"`
}

// Pull modes of a registry-backed layer.
const (
	PullLazy = "lazy"
	PullFull = "full"
)

// LayerPushRequest is the body of POST /v1/layers:push.
type LayerPushRequest struct {
	Ref      string `json:"ref"`
	Target   string `json:"target"`
	Insecure bool   `json:"insecure,omitempty"`
	// ChunkSize is the bytes each chunk index entry covers (a multiple
	// of 4 KiB, 4 KiB to 16 MiB; 0: 256 KiB).
	ChunkSize int `json:"chunk_size,omitempty"`
	// Username and Password are sent where the registry asks for
	// credentials; used for this call only, never stored.
	Username string `json:"username,omitempty"`
	Password string `json:"password,omitempty"`
}

// LayerAddRequest is the body of POST /v1/layers:add.
type LayerAddRequest struct {
	Ref      string `json:"ref"`
	Source   string `json:"source"`
	Insecure bool   `json:"insecure,omitempty"`
	Pull     string `json:"pull,omitempty"`
	Replace  bool   `json:"replace,omitempty"`
	// Username and Password are sent where the registry asks for
	// credentials while the server checks the artifact; never stored
	// (nodes read with their own, --registry-config).
	Username string `json:"username,omitempty"`
	Password string `json:"password,omitempty"`
}

// LayerGCResult answers POST /v1/layers:gc: the blobs removed (with
// dry_run, those that would be), which no ref named and no sandbox used,
// and the bytes they held.
type LayerGCResult struct {
	Removed      []string `json:"removed"`
	RemovedBytes int64    `json:"removed_bytes"`
	// DryRun: removed lists what would go, and nothing went.
	DryRun bool `json:"dry_run,omitempty"`
}

// LayerPushResult answers POST /v1/layers:push.
type LayerPushResult struct {
	Ref      string `json:"ref"`
	Target   string `json:"target"`
	Manifest string `json:"manifest"`
	// Uploaded counts the blobs sent; the rest the registry had.
	Uploaded  int   `json:"uploaded"`
	SizeBytes int64 `json:"size_bytes"`
}

// SnapshotInfo is the record of a pack_diff snapshot: the sandbox it was
// taken from, the layers it sits on, and the scrub rules applied.
type SnapshotInfo struct {
	Sandbox string `json:"sandbox"`
	// Layers are the digests below the snapshot, bottom first (base,
	// workspace, toolkits, earlier snapshots unless it was flattened). A
	// sandbox started from the snapshot stacks the snapshot on top of them.
	Layers  []string `json:"layers"`
	Include []string `json:"include,omitempty"`
	Exclude []string `json:"exclude,omitempty"`
	// Spec is the spec of the source sandbox, reused for forks.
	Spec SandboxSpec `json:"spec"`
	// CreatedBy is the principal that took the snapshot.
	CreatedBy string `json:"created_by,omitempty"`
	// Flattened is how many earlier snapshot layers were merged into this
	// one (the stack reached the edge's snapshot depth); zero when the
	// snapshot holds only its sandbox's changes.
	Flattened int `json:"flattened,omitempty"`
	// Below is how many of Layers are the base (with its lowers),
	// workspace and toolkits; the rest are earlier snapshots. 0 in
	// records older than lower layers: one base, the workspace if any and
	// the toolkits.
	Below int `json:"below,omitempty"`
}

// SnapshotRequest is the body of POST /v1/sandboxes/{id}/snapshot.
type SnapshotRequest struct {
	Ref     string   `json:"ref"`
	Include []string `json:"include,omitempty"`
	Exclude []string `json:"exclude,omitempty"`
}

// ForkRequest is the body of POST /v1/sandboxes/{id}/fork.
type ForkRequest struct {
	Count int `json:"count"`
	// Labels are added to the forks' labels.
	Labels map[string]string `json:"labels,omitempty"`
}

// LayerList is returned by GET /v1/layers.
type LayerList struct {
	Layers []Layer `json:"layers"`
}

// Template is an alias the E2B API's templateID may name (docs/e2b.md):
// a stack of layer refs and a user, as a sandbox spec gives them. POST
// /v1/templates takes Name, Base, Workspace, Toolkits and User; the
// server fills Project and CreatedAt.
type Template struct {
	Name      string   `json:"name"`
	Base      string   `json:"base"`
	Workspace string   `json:"workspace,omitempty"`
	Toolkits  []string `json:"toolkits,omitempty"`
	// User runs the sandbox's processes; empty: the base image's user.
	User string `json:"user,omitempty"`
	// Backend is the backend its sandboxes run on (SandboxSpec.Backend);
	// empty: the default, container.
	Backend string `json:"backend,omitempty"`
	// Project is the project of the key that made the alias; it is seen
	// as layers are (its project, those above and those below it).
	Project   string    `json:"project,omitempty"`
	CreatedAt time.Time `json:"created_at"`
}

// TemplateList is returned by GET /v1/templates.
type TemplateList struct {
	Templates []Template `json:"templates"`
}

// Node is an edge as seen by the apiserver.
type Node struct {
	Name     string   `json:"name"`
	Healthy  bool     `json:"healthy"`
	Backends []string `json:"backends"`
	Runtime  string   `json:"runtime,omitempty"`
	// Launcher is what starts sandboxes: "dsec" (dsec's own launcher) or
	// the runtime's name (see dsec up --launcher).
	Launcher   string         `json:"launcher,omitempty"`
	CgroupMode string         `json:"cgroup_mode,omitempty"`
	Capacity   Capacity       `json:"capacity"`
	Counts     map[string]int `json:"counts"` // sandboxes by state
	// BackendCounts are the live sandboxes (creating, running, paused)
	// by backend, and Jobs by the value of their "job" label.
	BackendCounts map[string]int `json:"backend_counts,omitempty"`
	Jobs          map[string]int `json:"jobs,omitempty"`
	// Projects is what the live sandboxes hold, by the path of their
	// project ("root/team-a"; the project's own sandboxes, not its
	// descendants').
	Projects map[string]ProjectUsage `json:"projects,omitempty"`
	// DedicatedTo is the path of the project with dedicated nodes whose
	// sandboxes this node holds (it then holds no other's); "" when it
	// holds none of such a project.
	DedicatedTo string `json:"dedicated_to,omitempty"`
	// CreateSeq is the sequence number of the last create the node's
	// counts include: it grows with every create, across restarts of the
	// node.
	CreateSeq uint64 `json:"create_seq,omitempty"`
	// Labels are the node's labels (dsec edge --node-labels), which
	// spec.node_selector selects on.
	Labels map[string]string `json:"labels,omitempty"`
	// Layers are the layer digests mounted on the node now.
	Layers []string `json:"layers,omitempty"`
	// Address is where the node's internal API listens (clusters only).
	Address string `json:"address,omitempty"`
	// LastSeen is when the watcher last heard from the node, and
	// Unhealthy why it counts the node as down (clusters and dsec up).
	LastSeen  *time.Time `json:"last_seen,omitempty"`
	Unhealthy string     `json:"unhealthy_reason,omitempty"`
	// Hollow marks a simulated edge (load tests of the control plane).
	Hollow bool `json:"hollow,omitempty"`
}

// JobLabel is the label that groups a job's sandboxes: placement spreads a
// job over nodes, and nodes count their sandboxes per job.
const JobLabel = "job"

// Capacity is what a node can hold.
type Capacity struct {
	MaxSandboxes int     `json:"max_sandboxes"`
	CPU          float64 `json:"cpu"`
	MemoryMB     int64   `json:"memory_mb"`
}

// NodeList is returned by GET /v1/nodes.
type NodeList struct {
	Nodes []Node `json:"nodes"`
}

// ErrorDetail is the body of every error: {"error": {...}}.
type ErrorDetail struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

// ErrorBody wraps ErrorDetail as API.md specifies.
type ErrorBody struct {
	Error ErrorDetail `json:"error"`
}

// ImageConfig is the part of an OCI image's configuration dsec keeps with a
// base layer imported from the image. A sandbox created on that base gets
// Env under its spec's env, and WorkingDir and User when its spec leaves
// workdir and user empty. Entrypoint, Cmd and Labels are recorded only.
type ImageConfig struct {
	Env        []string          `json:"env,omitempty"`
	WorkingDir string            `json:"workdir,omitempty"`
	User       string            `json:"user,omitempty"`
	Entrypoint []string          `json:"entrypoint,omitempty"`
	Cmd        []string          `json:"cmd,omitempty"`
	Labels     map[string]string `json:"labels,omitempty"`
}

// ImageResult is the answer of POST /v1/images:import and :pull: the
// layers built (base first, then the workspace of a split import) and what
// was read from the image.
type ImageResult struct {
	Layers []Layer `json:"layers"`
	// Digest is the image manifest's digest; empty for a `docker save`
	// archive, which has no manifest blob.
	Digest   string      `json:"digest,omitempty"`
	Platform string      `json:"platform"`
	Config   ImageConfig `json:"config"`
	// ImageLayers is how many layers the image has; Split how many of them
	// went into the base (the rest made the workspace), 0 when not split.
	ImageLayers int `json:"image_layers"`
	Split       int `json:"split,omitempty"`
	// Runs is how many layers a merge threshold (merge_under) cut the
	// image into: the base's own and its lowers. 0 when not given.
	Runs int `json:"runs,omitempty"`
	// Files and Bytes count the entries and regular-file bytes unpacked.
	Files      int   `json:"files"`
	Bytes      int64 `json:"bytes"`
	DurationMS int64 `json:"duration_ms"`
}

// ImagePullRequest is the body of POST /v1/images:pull.
type ImagePullRequest struct {
	// Image is REGISTRY/REPO[:TAG][@DIGEST]; a name without a registry is
	// Docker Hub's.
	Image string `json:"image"`
	// Ref names the base layer to build, base/NAME:TAG.
	Ref string `json:"ref"`
	// Workspace and Split import the image as two layers: image layers
	// [0, Split) become the base, the rest the workspace
	// (workspace/NAME:TAG) as an overlay diff over it.
	Workspace string `json:"workspace,omitempty"`
	Split     int    `json:"split,omitempty"`
	// MergeUnder, in bytes, cuts the image into runs of consecutive layers
	// whose sizes (compressed, as the registry stores them) add up to at
	// most it, bottom first, each run one EROFS layer: the base is the top
	// run's, sitting on the others (Layer.Lowers). 0: the whole image is
	// one layer. Not with Split.
	MergeUnder int64 `json:"merge_under,omitempty"`
	// Platform is os/arch[/variant] to pick from a multi-arch index;
	// linux/amd64 when empty.
	Platform string `json:"platform,omitempty"`
	// Insecure talks plain HTTP to the registry.
	Insecure bool `json:"insecure,omitempty"`
	// Username and Password are sent where the registry asks for
	// credentials.
	Username string `json:"username,omitempty"`
	Password string `json:"password,omitempty"`
}

// ImageEvent is one NDJSON line of an image import or pull streamed with
// Accept: application/x-ndjson: a progress message, or the final result,
// or an error (which ends the stream too).
type ImageEvent struct {
	Progress string       `json:"progress,omitempty"`
	Result   *ImageResult `json:"result,omitempty"`
	Error    *ErrorDetail `json:"error,omitempty"`
}

// ProjectQuota is a project's limits (POST and PATCH /v1/projects). A zero
// field sets no limit of its own: the project is then bound by its
// nearest ancestor that sets one.
type ProjectQuota struct {
	Sandboxes int     `json:"sandboxes"`
	CPU       float64 `json:"cpu"`
	MemoryMB  int64   `json:"memory_mb"`
	DiskMB    int64   `json:"disk_mb"`
}

// ProjectUsage is what a project and all its descendants hold now: the
// live sandboxes (creating, running, paused) and the resources their
// specs ask for.
type ProjectUsage struct {
	Sandboxes int     `json:"sandboxes"`
	CPU       float64 `json:"cpu"`
	MemoryMB  int64   `json:"memory_mb"`
	DiskMB    int64   `json:"disk_mb"`
}

// Add adds o to u.
func (u *ProjectUsage) Add(o ProjectUsage) {
	u.Sandboxes += o.Sandboxes
	u.CPU += o.CPU
	u.MemoryMB += o.MemoryMB
	u.DiskMB += o.DiskMB
}

// Project is a node of the project tree.
type Project struct {
	ID     string `json:"id"`
	Name   string `json:"name"`
	Parent string `json:"parent,omitempty"`
	// Path is the project's lineage from the root, "/"-separated
	// ("root/team-a/job-7").
	Path           string       `json:"path"`
	Quota          ProjectQuota `json:"quota"`
	Usage          ProjectUsage `json:"usage"`
	Children       []string     `json:"children"`
	DedicatedNodes bool         `json:"dedicated_nodes"`
	CreatedAt      time.Time    `json:"created_at"`
}

// CreateProjectRequest is the body of POST /v1/projects.
type CreateProjectRequest struct {
	// Parent is a project ID or "root".
	Parent         string       `json:"parent"`
	Name           string       `json:"name"`
	Quota          ProjectQuota `json:"quota"`
	DedicatedNodes bool         `json:"dedicated_nodes,omitempty"`
}

// UpdateProjectRequest is the body of PATCH /v1/projects/{id}: the fields
// given are changed.
type UpdateProjectRequest struct {
	Quota          *ProjectQuota `json:"quota,omitempty"`
	DedicatedNodes *bool         `json:"dedicated_nodes,omitempty"`
}

// ProjectList is returned by GET /v1/projects.
type ProjectList struct {
	Projects      []Project `json:"projects"`
	NextPageToken string    `json:"next_page_token,omitempty"`
}

// CreateKeyRequest is the body of POST /v1/projects/{id}/keys.
type CreateKeyRequest struct {
	Role string `json:"role"`
	Name string `json:"name,omitempty"`
	// ExpiresIn is the key's lifetime in seconds (0: it does not expire).
	ExpiresIn int64 `json:"expires_in,omitempty"`
}

// APIKey describes a key. Key, the secret, is set only in the answer to
// the create; it is stored hashed and never shown again.
type APIKey struct {
	ID        string     `json:"id"`
	Key       string     `json:"key,omitempty"`
	Name      string     `json:"name,omitempty"`
	Project   string     `json:"project"`
	Role      string     `json:"role"`
	CreatedAt time.Time  `json:"created_at"`
	ExpiresAt *time.Time `json:"expires_at,omitempty"`
}

// KeyList is returned by GET /v1/projects/{id}/keys.
type KeyList struct {
	Keys []APIKey `json:"keys"`
}

// WhoAmI is returned by GET /v1/whoami.
type WhoAmI struct {
	Principal   string   `json:"principal"`
	Project     string   `json:"project"`
	Role        string   `json:"role"`
	Permissions []string `json:"permissions"`
}

// AuditEntry is one management action (GET /v1/audit).
type AuditEntry struct {
	Time      time.Time `json:"time"`
	Principal string    `json:"principal"`
	Project   string    `json:"project"`
	Action    string    `json:"action"`
	Target    string    `json:"target"`
	Detail    string    `json:"detail,omitempty"`
}

// AuditList is returned by GET /v1/audit.
type AuditList struct {
	Entries []AuditEntry `json:"entries"`
}
