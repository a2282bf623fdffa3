// Package edgetest has a fake edge for the tests of the edge's callers
// (apiserver, watcher, the internal API). Only tests import it.
package edgetest

import (
	"context"
	"encoding/base64"
	"fmt"
	"net"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/sandbox"
)

// Fake is an in-memory edgeapi.Edge: it stands in for a node so that the
// apiserver's own logic (auth, validation, routing, pagination, error
// mapping) and the internal API are tested without root. The real edge is
// tested end to end. Its canned behaviours:
//   - Exec of "fail-after-output" streams one event, then fails;
//   - the file calls act on a small in-memory tree per sandbox (files.go),
//     except that ReadFile of a path nothing was written to serves File
//     (default "data") unless the path is under /nope, and WriteFile
//     under /full fails as on a full disk;
//   - WriteTar of "/nope" is not found, of "/broken" fails after 10 bytes;
//   - DialPort connects to PortAddr if set;
//   - Pause, Resume and Keepalive change the state and expiry as an edge
//     does (pausing a paused sandbox, or resuming a running one, succeeds).
type Fake struct {
	name string
	// MaxSandboxes is the capacity Info reports (default 100).
	MaxSandboxes int
	// Labels are reported by Info.
	Labels map[string]string

	mu        sync.Mutex
	sandboxes map[string]api.Sandbox
	// paths are the sandboxes' project paths (CreateRequest.ProjectPath):
	// Get, List, Delete and Exec honour the caller's scope as the real
	// edge does (edgeapi.WithScope).
	paths map[string]string
	n     int
	// ExecErr fails every exec; PanicOn panics a Get of that id.
	ExecErr error
	PanicOn string
	// File is what ReadFile serves.
	File []byte
	// PortAddr is where DialPort connects (a test listener).
	PortAddr string
	// Written is what the last WriteFile or ExtractTar received.
	Written []byte
	// Creates counts Create calls (failed ones included), Execs Exec calls.
	Creates, Execs int
	// openPorts counts port connections not yet released (done).
	openPorts int
	// Refuse makes Create answer resource_exhausted.
	Refuse bool
	// SnapshotFn, if set, answers Snapshot (otherwise refused).
	SnapshotFn func(id string, o edgeapi.SnapshotOptions) (*edgeapi.SnapshotResult, error)
	// procs are the processes by sandbox (process.go); pids numbers them.
	procs map[string][]*fakeProc
	pids  int
	// trees are the sandboxes' file trees, and watches the watches
	// running (files.go).
	trees   map[string]map[string]*fakeFile
	watches []*fakeWatch
}

var _ edgeapi.Edge = (*Fake)(nil)

// NewFake returns an empty fake edge named name.
func NewFake(name string) *Fake {
	return &Fake{name: name, MaxSandboxes: 100, sandboxes: map[string]api.Sandbox{}, paths: map[string]string{}, File: []byte("data")}
}

// Counts returns how many Create and Exec calls the fake has had.
func (f *Fake) Counts() (creates, execs int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.Creates, f.Execs
}

// OpenPorts returns how many port connections are open (their done not
// yet called).
func (f *Fake) OpenPorts() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.openPorts
}

// SetRefuse makes Create answer resource_exhausted (or not).
func (f *Fake) SetRefuse(v bool) {
	f.mu.Lock()
	f.Refuse = v
	f.mu.Unlock()
}

// Put adds a sandbox as if an earlier Create had made it.
func (f *Fake) Put(sb api.Sandbox) {
	f.mu.Lock()
	f.sandboxes[sb.ID] = sb
	f.mu.Unlock()
}

// Len is how many sandboxes the fake holds.
func (f *Fake) Len() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.sandboxes)
}

// Name implements edgeapi.Edge.
func (f *Fake) Name() string { return f.name }

// Info implements edgeapi.Edge.
func (f *Fake) Info(ctx context.Context) (api.Node, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	projects := map[string]api.ProjectUsage{}
	for id, sb := range f.sandboxes {
		path := f.paths[id]
		if path == "" {
			path = edgeapi.RootPath
		}
		u := projects[path]
		u.Add(api.ProjectUsage{Sandboxes: 1, CPU: sb.Spec.CPU, MemoryMB: sb.Spec.MemoryMB, DiskMB: sb.Spec.DiskMB})
		projects[path] = u
	}
	return api.Node{Name: f.name, Healthy: true, Backends: []string{"container"}, Labels: f.Labels,
		Capacity: api.Capacity{MaxSandboxes: f.MaxSandboxes}, Counts: map[string]int{"running": len(f.sandboxes)}, Projects: projects,
		CreateSeq: uint64(f.n)}, nil
}

// LayerUsers implements edgeapi.Edge.
func (f *Fake) LayerUsers(ctx context.Context, digest string) (int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 0
	for _, s := range f.sandboxes {
		for _, d := range s.Layers {
			if d == digest {
				n++
			}
		}
	}
	return n, nil
}

// Create implements edgeapi.Edge.
func (f *Fake) Create(ctx context.Context, req edgeapi.CreateRequest) (*api.Sandbox, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.Creates++
	if f.Refuse || len(f.sandboxes) >= f.MaxSandboxes {
		return nil, errdefs.Exhausted("node %s is full", f.name)
	}
	f.n++
	sb := api.Sandbox{ID: fmt.Sprintf("sb-%s-%04d", f.name, f.n), Node: f.name, State: "running", Backend: req.Spec.Backend,
		Spec: req.Spec, Labels: req.Spec.Labels, Layers: req.Digests, CreatedAt: time.Now(), Project: req.Spec.Project,
		CreateSeq: uint64(f.n)}
	if req.Spec.TTL > 0 {
		exp := sb.CreatedAt.Add(time.Duration(req.Spec.TTL) * time.Second)
		sb.ExpiresAt = &exp
	}
	f.sandboxes[sb.ID] = sb
	f.paths[sb.ID] = req.ProjectPath
	return &sb, nil
}

// Get implements edgeapi.Edge.
func (f *Fake) Get(ctx context.Context, id string) (*api.Sandbox, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if id == f.PanicOn {
		panic("boom")
	}
	sb, ok := f.sandboxes[id]
	if !ok || !edgeapi.InScope(ctx, f.paths[id]) {
		return nil, errdefs.NotFound("sandbox %s not found", id)
	}
	return &sb, nil
}

// List implements edgeapi.Edge.
func (f *Fake) List(ctx context.Context, flt edgeapi.ListFilter) ([]api.Sandbox, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := []api.Sandbox{}
	for _, s := range f.sandboxes {
		if sandbox.LabelsMatch(s.Labels, flt.Labels) && (flt.State == "" || flt.State == s.State) && s.ID > flt.After &&
			edgeapi.InScope(ctx, f.paths[s.ID]) {
			out = append(out, s)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	if flt.Limit > 0 && len(out) > flt.Limit {
		out = out[:flt.Limit]
	}
	return out, nil
}

// Delete implements edgeapi.Edge.
func (f *Fake) Delete(ctx context.Context, id string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if edgeapi.InScope(ctx, f.paths[id]) {
		delete(f.sandboxes, id)
		delete(f.paths, id)
	}
	return nil
}

// DeleteByLabels implements edgeapi.Edge.
func (f *Fake) DeleteByLabels(ctx context.Context, sel map[string]string) (int, error) {
	l, _ := f.List(ctx, edgeapi.ListFilter{Labels: sel})
	for _, s := range l {
		_ = f.Delete(ctx, s.ID)
	}
	return len(l), nil
}

// Keepalive implements edgeapi.Edge: the sandbox expires ttl seconds
// from now (its spec's ttl when 0).
func (f *Fake) Keepalive(ctx context.Context, id string, ttl int64) (*api.Sandbox, error) {
	return f.update(ctx, id, func(sb *api.Sandbox) {
		if ttl == 0 {
			ttl = sb.Spec.TTL
		}
		exp := time.Now().Add(time.Duration(ttl) * time.Second)
		sb.ExpiresAt = &exp
	})
}

// update applies fn to sandbox id as the caller of ctx sees it.
func (f *Fake) update(ctx context.Context, id string, fn func(*api.Sandbox)) (*api.Sandbox, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	sb, ok := f.sandboxes[id]
	if !ok || !edgeapi.InScope(ctx, f.paths[id]) {
		return nil, errdefs.NotFound("sandbox %s not found", id)
	}
	fn(&sb)
	f.sandboxes[id] = sb
	return &sb, nil
}

// Stats implements edgeapi.Edge.
func (f *Fake) Stats(ctx context.Context, id string) (*api.Stats, error) {
	if _, err := f.Get(ctx, id); err != nil {
		return nil, err
	}
	return &api.Stats{Pids: 1}, nil
}

// Exec implements edgeapi.Edge.
func (f *Fake) Exec(ctx context.Context, id string, req api.ExecRequest, emit func(api.ExecEvent) error) (*api.ExecResult, error) {
	if _, err := f.Get(ctx, id); err != nil {
		return nil, err
	}
	f.mu.Lock()
	f.Execs++
	f.mu.Unlock()
	if f.ExecErr != nil {
		return nil, f.ExecErr
	}
	if req.Cmd == "wait-for-cancel" {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	if _, err := f.Get(ctx, id); err != nil {
		return nil, err
	}
	if emit != nil {
		if err := emit(api.ExecEvent{Stdout: "streamed"}); err != nil {
			return nil, err
		}
		if req.Cmd == "fail-after-output" {
			return nil, errdefs.Precondition("sandbox %s stopped mid-command", id)
		}
		return &api.ExecResult{ExitCode: 3}, nil
	}
	if req.StdinB64 != "" {
		// Echo: stdin's exact bytes come back as stdout, and reversed
		// as stderr, in the edge's in-memory form (api.OutputText).
		in, err := base64.StdEncoding.DecodeString(req.StdinB64)
		if err != nil {
			return nil, errdefs.Invalid("stdin_b64: %v", err)
		}
		rev := slices.Clone(in)
		slices.Reverse(rev)
		res := &api.ExecResult{ExitCode: 3}
		res.Stdout, res.StdoutB64 = api.OutputText(in)
		res.Stderr, res.StderrB64 = api.OutputText(rev)
		return res, nil
	}
	return &api.ExecResult{ExitCode: 3, Stdout: req.Cmd}, nil
}

// OpenSession implements edgeapi.Edge.
func (f *Fake) OpenSession(ctx context.Context, id string, req api.SessionRequest) (*api.Session, error) {
	return &api.Session{SessionID: "ss-1"}, nil
}

// RunInSession implements edgeapi.Edge.
func (f *Fake) RunInSession(ctx context.Context, id, sid string, req api.SessionRunRequest) (*api.ExecResult, error) {
	return &api.ExecResult{Stdout: req.Command}, nil
}

// CloseSession implements edgeapi.Edge.
func (f *Fake) CloseSession(ctx context.Context, id, sid string) error { return nil }

// ReadLog implements edgeapi.Edge.
func (f *Fake) ReadLog(ctx context.Context, id string, sinceSeq int64, limit int) (*api.LogPage, error) {
	if _, err := f.Get(ctx, id); err != nil {
		return nil, err
	}
	page := &api.LogPage{Entries: []api.LogEntry{}, NextSeq: sinceSeq}
	for seq := sinceSeq + 1; seq <= 3 && len(page.Entries) < limit; seq++ {
		page.Entries = append(page.Entries, api.LogEntry{Seq: seq, Kind: api.LogExec})
		page.NextSeq = seq
	}
	return page, nil
}

// Pause implements edgeapi.Edge. As on a real edge, pausing a paused
// sandbox succeeds.
func (f *Fake) Pause(ctx context.Context, id string) (*api.PauseResult, error) {
	sb, err := f.update(ctx, id, func(sb *api.Sandbox) {
		if sb.State != api.StatePaused {
			now := time.Now()
			sb.State, sb.PausedAt = api.StatePaused, &now
		}
	})
	if err != nil {
		return nil, err
	}
	return &api.PauseResult{Sandbox: *sb}, nil
}

// Resume implements edgeapi.Edge. Resuming a running sandbox succeeds.
func (f *Fake) Resume(ctx context.Context, id string) (*api.Sandbox, error) {
	return f.update(ctx, id, func(sb *api.Sandbox) { sb.State, sb.PausedAt = api.StateRunning, nil })
}

// PauseByLabels implements edgeapi.Edge.
func (f *Fake) PauseByLabels(ctx context.Context, sel map[string]string) (int, error) {
	l, err := f.List(ctx, edgeapi.ListFilter{Labels: sel})
	return len(l), err
}

// ResumeByLabels implements edgeapi.Edge.
func (f *Fake) ResumeByLabels(ctx context.Context, sel map[string]string) (int, error) {
	l, err := f.List(ctx, edgeapi.ListFilter{Labels: sel})
	return len(l), err
}

// SetNetwork implements edgeapi.Edge.
func (f *Fake) SetNetwork(ctx context.Context, id string, np api.NetworkPolicy) (*api.Sandbox, error) {
	return f.Get(ctx, id)
}

// FnCall implements edgeapi.Edge.
func (f *Fake) FnCall(ctx context.Context, req api.FnCallRequest, cr edgeapi.CreateRequest) (*api.FnCallResult, error) {
	return nil, errdefs.Unavailable("no fncall in the fake edge")
}

// DialPort implements edgeapi.Edge.
func (f *Fake) DialPort(ctx context.Context, id string, port int) (net.Conn, func(), error) {
	if _, err := f.Get(ctx, id); err != nil {
		return nil, nil, err
	}
	if f.PortAddr == "" {
		return nil, nil, errdefs.Unavailable("nothing answers on port %d in sandbox %s", port, id)
	}
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", f.PortAddr)
	if err != nil {
		return nil, nil, errdefs.Unavailable("nothing answers on port %d in sandbox %s: %v", port, id, err)
	}
	f.mu.Lock()
	f.openPorts++
	f.mu.Unlock()
	var once sync.Once
	return c, func() {
		once.Do(func() {
			f.mu.Lock()
			f.openPorts--
			f.mu.Unlock()
		})
	}, nil
}

// Snapshot implements edgeapi.Edge.
func (f *Fake) Snapshot(ctx context.Context, id string, o edgeapi.SnapshotOptions) (*edgeapi.SnapshotResult, error) {
	if f.SnapshotFn != nil {
		return f.SnapshotFn(id, o)
	}
	return nil, errdefs.Precondition("the fake edge takes no snapshots")
}
