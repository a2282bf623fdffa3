// Package edgeapi is the seam between the apiserver and the edges: the
// interface an apiserver drives a node through (Edge), the wire types of
// the calls, an HTTP server that serves an Edge (the internal API, mutual
// TLS in a cluster), and a Client that implements Edge over that API. The
// in-process edge (`dsec up`) and a remote one (`dsec edge`) look the same
// to the apiserver: it imports this package and never internal/edge.
//
// Errors keep their class across the wire: the server writes the API
// error body ({"error": {"code", "message"}}) and the client rebuilds the
// errdefs class from the code, so errors.Is works on both sides.
package edgeapi

import (
	"context"
	"io"
	"net"
	"os"
	"regexp"
	"strings"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/layer"
)

// Edge is what an apiserver needs from one node. Every call takes a
// context and can fail: a remote edge may be unreachable, which is an
// errdefs.ErrUnavailable error.
type Edge interface {
	// Name is the node's name, the one sandbox ids carry.
	Name() string
	// Info describes the node now: health, capacity, counts, layers.
	Info(ctx context.Context) (api.Node, error)
	// LayerUsers counts the node's sandboxes that use the layer digest.
	LayerUsers(ctx context.Context, digest string) (int, error)

	Create(ctx context.Context, req CreateRequest) (*api.Sandbox, error)
	Get(ctx context.Context, id string) (*api.Sandbox, error)
	// List returns the sandboxes matching f, sorted by id.
	List(ctx context.Context, f ListFilter) ([]api.Sandbox, error)
	Delete(ctx context.Context, id string) error
	DeleteByLabels(ctx context.Context, sel map[string]string) (int, error)
	Keepalive(ctx context.Context, id string, ttl int64) (*api.Sandbox, error)
	Stats(ctx context.Context, id string) (*api.Stats, error)
	Pause(ctx context.Context, id string) (*api.PauseResult, error)
	Resume(ctx context.Context, id string) (*api.Sandbox, error)
	PauseByLabels(ctx context.Context, sel map[string]string) (int, error)
	ResumeByLabels(ctx context.Context, sel map[string]string) (int, error)
	Snapshot(ctx context.Context, id string, o SnapshotOptions) (*SnapshotResult, error)
	SetNetwork(ctx context.Context, id string, np api.NetworkPolicy) (*api.Sandbox, error)
	FnCall(ctx context.Context, req api.FnCallRequest, cr CreateRequest) (*api.FnCallResult, error)
	// DialPort connects to a port on the sandbox's loopback; done is
	// called once the connection is no longer used.
	DialPort(ctx context.Context, id string, port int) (c net.Conn, done func(), err error)

	// Exec runs a command; with emit non-nil, output events are passed
	// to emit as they come (streaming) and the result carries no output.
	Exec(ctx context.Context, id string, req api.ExecRequest, emit func(api.ExecEvent) error) (*api.ExecResult, error)
	OpenSession(ctx context.Context, id string, req api.SessionRequest) (*api.Session, error)
	RunInSession(ctx context.Context, id, sid string, req api.SessionRunRequest) (*api.ExecResult, error)
	CloseSession(ctx context.Context, id, sid string) error

	// The calls that create files (WriteFile, ExtractTar, MakeDir) take
	// the owner of what they create (the file or directory, the missing
	// parents; never what was there already): a user of the sandbox,
	// NAME, UID, NAME:GROUP or UID:GID as Exec's user, looked up in the
	// sandbox's own /etc/passwd and /etc/group. "" leaves it to root (in
	// a user namespace, the sandbox's root). An owner the sandbox does
	// not have is an errdefs.ErrInvalid error, and nothing is written.
	// It is a parameter, not a context value: what owns a file is part
	// of the request, as its mode is.

	ReadFile(ctx context.Context, id, path string) (io.ReadCloser, api.FileEntry, error)
	WriteFile(ctx context.Context, id, path string, data io.Reader, mode os.FileMode, owner string) (api.FileEntry, error)
	StatFile(ctx context.Context, id, path string) (api.FileEntry, error)
	ListFiles(ctx context.Context, id, path string, depth int) ([]api.FileEntry, error)
	RemoveFile(ctx context.Context, id, path string, recursive bool) error
	// WriteTar streams a tar of path to w. An error after bytes were
	// written means w holds a broken archive.
	WriteTar(ctx context.Context, id, path string, w io.Writer) error
	ExtractTar(ctx context.Context, id, path string, rd io.Reader, owner string) (api.TarResult, error)
	// MakeDir creates the directory path and its missing parents. A
	// directory already there is an errdefs.ErrAlreadyExists error.
	MakeDir(ctx context.Context, id, path, owner string) (api.FileEntry, error)
	// MoveFile renames src to dst as rename(2) does (a file, or an empty
	// directory, at dst is replaced), creating dst's missing parents, and
	// describes the entry at dst.
	MoveFile(ctx context.Context, id, src, dst string) (api.FileEntry, error)
	// WatchDir reports the changes below the directory path (its
	// children; with recursive, its tree to a bounded depth) to emit
	// until ctx ends. An error setting the watch up (no such directory,
	// too many entries to watch) is returned before anything is
	// emitted; once the watch is set up, the first event is one of type
	// api.FileEventStart. It returns ctx's error when ctx ends, emit's
	// error, or what ended the watch: the directory gone (not found),
	// grown past the bound (invalid), the sandbox no longer running
	// (unavailable).
	WatchDir(ctx context.Context, id, path string, recursive bool, emit func(api.FileEvent) error) error

	// ReadLog returns the command log entries with seq > sinceSeq, at most
	// limit; it serves stopped and failed sandboxes too.
	ReadLog(ctx context.Context, id string, sinceSeq int64, limit int) (*api.LogPage, error)

	// Processes (ProcessRequest): long-lived commands with input,
	// terminals, and streams that may detach and attach again.

	// StartProcess starts a process and passes its events to emit (start
	// first, end last). When ctx ends or emit fails the stream detaches
	// and the process goes on.
	StartProcess(ctx context.Context, id string, req ProcessRequest, emit func(ProcessEvent) error) error
	// ConnectProcess attaches a stream to a process: start, its output
	// from now on, its end.
	ConnectProcess(ctx context.Context, id string, sel ProcessSelector, emit func(ProcessEvent) error) error
	ListProcesses(ctx context.Context, id string) ([]ProcessInfo, error)
	ProcessInput(ctx context.Context, id string, sel ProcessSelector, data []byte) error
	CloseProcessStdin(ctx context.Context, id string, sel ProcessSelector) error
	SignalProcess(ctx context.Context, id string, sel ProcessSelector, signal int) error
	ResizeProcess(ctx context.Context, id string, sel ProcessSelector, size PTYSize) error
}

// CreateRequest is a sandbox to create: a normalized spec plus the layer
// digests its refs resolved to (bottom first: base, workspace, toolkits,
// snapshots).
type CreateRequest struct {
	Spec    api.SandboxSpec `json:"spec"`
	Digests []string        `json:"digests"`
	// Below is how many of Digests, bottom first, are the base (with its
	// lowers, api.Layer.Lowers), workspace and toolkits; the rest are
	// snapshot layers. 0: one base, the workspace if the spec names one
	// and the toolkits (StackBelow).
	Below int `json:"below,omitempty"`
	// ProjectPath is the path of Spec.Project in the project tree
	// (scope.go); empty: the root's.
	ProjectPath string `json:"project_path,omitempty"`
	// Dedicated is the path of the nearest project on the lineage that
	// asks for dedicated nodes ("" for none): the node refuses the
	// sandbox while it holds sandboxes of another (or shared ones), and
	// holding it, refuses every other tenant's.
	Dedicated string `json:"dedicated,omitempty"`
	// Token names this create across retries (at most MaxTokenLen
	// characters; empty: none). The node makes one sandbox per token: a
	// repeat while the first is under way waits for it, a repeat after it
	// succeeded answers the sandbox it made (while it exists), a repeat
	// after it failed tries again. The client sends it as Idempotency-Key,
	// which lets its HTTP transport resend a create whose kept-alive
	// connection died before an answer.
	Token string `json:"token,omitempty"`
}

// StackBelow is how many of a sandbox's layers are its base, workspace and
// toolkits: below if set (CreateRequest.Below, api.SnapshotInfo.Below),
// else what spec names, each one layer.
func StackBelow(below int, spec api.SandboxSpec) int {
	if below > 0 {
		return below
	}
	n := 1 + len(spec.Toolkits)
	if spec.Workspace != "" {
		n++
	}
	return n
}

// MaxTokenLen bounds CreateRequest.Token.
const MaxTokenLen = 64

// ListFilter selects sandboxes.
type ListFilter struct {
	State  string            `json:"state,omitempty"`
	Labels map[string]string `json:"labels,omitempty"`
	// After and Limit page the list: only sandboxes whose id sorts after
	// After, and at most Limit of them (0: all).
	After string `json:"after,omitempty"`
	Limit int    `json:"limit,omitempty"`
}

// SnapshotOptions carry what the apiserver knows about a snapshot request.
type SnapshotOptions struct {
	Request api.SnapshotRequest `json:"request"`
	// Principal names who asks, recorded with the snapshot, and Project
	// is its project, which owns the layer.
	Principal string `json:"principal,omitempty"`
	Project   string `json:"project,omitempty"`
	// Stage asks the edge to seal the snapshot and leave it staged for
	// the caller to publish (layer.Store.Adopt) rather than publish it:
	// an apiserver of a cluster asks so, and its edges may not write the
	// layer catalog. An edge of an earlier version publishes anyway.
	Stage bool `json:"stage,omitempty"`
}

// SnapshotResult is an edge's answer to a snapshot: the layer, published,
// or, if it was asked to stage it, sealed and staged (Staged set; the
// layer is not in the catalog yet). On the wire the layer's fields sit at
// the top level, as before staging existed, so that either side may be
// of an earlier version.
type SnapshotResult struct {
	api.Layer
	Staged *layer.Staged `json:"staged,omitempty"`
}

// Command log page bounds (GET /v1/sandboxes/{id}/log?limit=).
const (
	DefaultLogLimit = 1000
	MaxLogLimit     = 10000
)

// nodeNameRE admits host names as most clusters spell them (lowercase
// letters, digits, inner '-' and '.'), up to 40 characters: the name is
// part of every sandbox id.
var nodeNameRE = regexp.MustCompile(`^[a-z0-9]([a-z0-9.-]{0,38}[a-z0-9])?$`)

// CheckNodeName validates a node name.
func CheckNodeName(name string) error {
	if !nodeNameRE.MatchString(name) {
		return errdefs.Invalid("node name %q must be 1-40 lowercase letters, digits, '-' or '.', starting and ending with a letter or digit", name)
	}
	return nil
}

// NodeOf returns the node encoded in a sandbox id (sb-<node>-<random>).
func NodeOf(id string) (string, bool) {
	rest, ok := strings.CutPrefix(id, "sb-")
	if !ok {
		return "", false
	}
	i := strings.LastIndexByte(rest, '-')
	if i <= 0 {
		return "", false
	}
	return rest[:i], true
}
