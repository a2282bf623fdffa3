package apiserver

import (
	"context"
	"io"
	"net"
	"net/http"
	"os"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edge"
	"github.com/dsecproject/dsec/internal/errdefs"
)

// EdgeClient is what the apiserver needs from an edge. *edge.Edge implements
// it in-process (`dsec up`); a remote edge gets an HTTP implementation.
type EdgeClient interface {
	Name() string
	Info() api.Node
	// PlacementInfo is Info for placement, whose counts may be a moment
	// old: it is asked on every create.
	PlacementInfo() api.Node
	LayerUsers(digest string) int

	Create(ctx context.Context, req edge.CreateRequest) (*api.Sandbox, error)
	Get(ctx context.Context, id string) (*api.Sandbox, error)
	List(ctx context.Context, f edge.ListFilter) []api.Sandbox
	Delete(ctx context.Context, id string) error
	DeleteByLabels(ctx context.Context, sel map[string]string) (int, error)
	Keepalive(ctx context.Context, id string, ttl int64) (*api.Sandbox, error)
	Stats(ctx context.Context, id string) (*api.Stats, error)
	Pause(ctx context.Context, id string) (*api.PauseResult, error)
	Snapshot(ctx context.Context, id string, o edge.SnapshotOptions) (*api.Layer, error)
	Resume(ctx context.Context, id string) (*api.Sandbox, error)
	PauseByLabels(ctx context.Context, sel map[string]string) (int, error)
	ResumeByLabels(ctx context.Context, sel map[string]string) (int, error)
	SetNetwork(ctx context.Context, id string, np api.NetworkPolicy) (*api.Sandbox, error)
	FnCall(ctx context.Context, req api.FnCallRequest, cr edge.CreateRequest) (*api.FnCallResult, error)
	// DialPort connects to a port on the sandbox's loopback; done is
	// called once the connection is no longer used.
	DialPort(ctx context.Context, id string, port int) (c net.Conn, done func(), err error)

	Exec(ctx context.Context, id string, req api.ExecRequest, emit func(api.ExecEvent) error) (*api.ExecResult, error)
	OpenSession(ctx context.Context, id string, req api.SessionRequest) (*api.Session, error)
	RunInSession(ctx context.Context, id, sid string, req api.SessionRunRequest) (*api.ExecResult, error)
	CloseSession(ctx context.Context, id, sid string) error

	ReadFile(ctx context.Context, id, path string) (io.ReadCloser, api.FileEntry, error)
	WriteFile(ctx context.Context, id, path string, data io.Reader, mode os.FileMode) (api.FileEntry, error)
	StatFile(ctx context.Context, id, path string) (api.FileEntry, error)
	ListFiles(ctx context.Context, id, path string, depth int) ([]api.FileEntry, error)
	RemoveFile(ctx context.Context, id, path string, recursive bool) error
	WriteTar(ctx context.Context, id, path string, w io.Writer) error
	ExtractTar(ctx context.Context, id, path string, rd io.Reader) (api.TarResult, error)

	// ReadLog returns the command log entries with seq > sinceSeq, at most
	// limit; it serves stopped and failed sandboxes too.
	ReadLog(ctx context.Context, id string, sinceSeq int64, limit int) (*api.LogPage, error)
}

var _ EdgeClient = (*edge.Edge)(nil)

// edgeOf returns the edge that owns sandbox id.
func (s *Server) edgeOf(id string) (EdgeClient, error) {
	node, ok := edge.NodeOf(id)
	if !ok {
		return nil, errdefs.NotFound("sandbox %s not found (malformed id)", id)
	}
	e := s.edges[node]
	if e == nil {
		return nil, errdefs.NotFound("sandbox %s not found (unknown node %s)", id, node)
	}
	return e, nil
}

// forward serves a per-sandbox call: it finds the edge that owns the
// sandbox named in the path and writes fn's result as JSON with status, or
// the error. A nil result with no error answers 204.
func (s *Server) forward(w http.ResponseWriter, r *http.Request, status int, fn func(e EdgeClient, id string) (any, error)) {
	id := r.PathValue("id")
	e, err := s.edgeOf(id)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	v, err := fn(e, id)
	switch {
	case err != nil:
		s.writeError(w, r, err)
	case v == nil:
		w.WriteHeader(http.StatusNoContent)
	default:
		writeJSON(w, status, v)
	}
}

// inUse reports whether any edge has a sandbox using the layer digest.
func (s *Server) inUse(digest string) bool {
	for _, e := range s.edges {
		if e.LayerUsers(digest) > 0 {
			return true
		}
	}
	return false
}

func (s *Server) nodes() []api.Node {
	out := make([]api.Node, 0, len(s.edges))
	for _, e := range s.deps.Edges {
		out = append(out, e.Info())
	}
	return out
}

// placementNodes is nodes for placement.Pick (PlacementInfo).
func (s *Server) placementNodes() []api.Node {
	out := make([]api.Node, 0, len(s.edges))
	for _, e := range s.deps.Edges {
		out = append(out, e.PlacementInfo())
	}
	return out
}
