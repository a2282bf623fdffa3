package edge

import (
	"testing"
	"time"

	"github.com/dsecproject/dsec/internal/edgeapi"
)

func TestValidateProcess(t *testing.T) {
	for _, tc := range []struct {
		name string
		req  edgeapi.ProcessRequest
		ok   bool
	}{
		{"plain", edgeapi.ProcessRequest{Argv: []string{"sh"}}, true},
		{"no argv", edgeapi.ProcessRequest{}, false},
		{"empty command", edgeapi.ProcessRequest{Argv: []string{""}}, false},
		{"NUL in argv", edgeapi.ProcessRequest{Argv: []string{"sh", "a\x00b"}}, false},
		{"relative cwd", edgeapi.ProcessRequest{Argv: []string{"sh"}, Cwd: "repo"}, false},
		{"relative cwd from home", edgeapi.ProcessRequest{Argv: []string{"sh"}, Cwd: "repo", CwdHome: true}, true},
		{"NUL in cwd", edgeapi.ProcessRequest{Argv: []string{"sh"}, Cwd: "/a\x00", CwdHome: true}, false},
		{"bad user", edgeapi.ProcessRequest{Argv: []string{"sh"}, User: "a b"}, false},
		{"negative timeout", edgeapi.ProcessRequest{Argv: []string{"sh"}, TimeoutMS: -1}, false},
		{"timeout past 30 days", edgeapi.ProcessRequest{Argv: []string{"sh"}, TimeoutMS: maxProcessTimeoutMS + 1}, false},
		{"terminal", edgeapi.ProcessRequest{Argv: []string{"sh"}, PTY: &edgeapi.PTYSize{Cols: 80, Rows: 24}}, true},
		{"terminal of no size", edgeapi.ProcessRequest{Argv: []string{"sh"}, PTY: &edgeapi.PTYSize{}}, false},
		{"terminal too wide", edgeapi.ProcessRequest{Argv: []string{"sh"}, PTY: &edgeapi.PTYSize{Cols: 5000, Rows: 24}}, false},
		{"long tag", edgeapi.ProcessRequest{Argv: []string{"sh"}, Tag: string(make([]byte, 300))}, false},
	} {
		if err := validateProcess(&tc.req); (err == nil) != tc.ok {
			t.Errorf("%s: %v, want ok=%v", tc.name, err, tc.ok)
		}
	}
}

func TestProcessTable(t *testing.T) {
	ended := func(at time.Time) *mproc {
		m := &mproc{done: make(chan struct{}), endedAt: at}
		close(m.done)
		return m
	}
	running := &mproc{done: make(chan struct{}), info: edgeapi.ProcessInfo{PID: 10, Tag: "svc"}}
	s := &sbx{procs: map[int]*mproc{10: running, 11: ended(time.Now()), 12: ended(time.Now().Add(-2 * endedRetention))}}
	s.procs[11].info = edgeapi.ProcessInfo{PID: 11, Tag: "svc"}
	s.mu.Lock()
	s.pruneProcsLocked()
	n := s.liveProcs()
	s.mu.Unlock()
	if _, ok := s.procs[12]; ok || len(s.procs) != 2 || n != 1 {
		t.Fatalf("after prune: %d kept, %d live; want the old end gone, 2 kept, 1 live", len(s.procs), n)
	}
	// A tag finds the running process over an ended one of that tag.
	if m, err := s.findProc("sb", edgeapi.ProcessSelector{Tag: "svc"}, false); err != nil || m != running {
		t.Fatalf("by tag: %v %v", m, err)
	}
	// An ended process answers connects, not input.
	if _, err := s.findProc("sb", edgeapi.ProcessSelector{PID: 11}, false); err == nil {
		t.Error("an ended process took a call for running ones")
	}
	if _, err := s.findProc("sb", edgeapi.ProcessSelector{PID: 11}, true); err != nil {
		t.Errorf("an ended process within its retention: %v", err)
	}
	if _, err := s.findProc("sb", edgeapi.ProcessSelector{}, true); err == nil {
		t.Error("an empty selector found a process")
	}
	// Past endedKept, the oldest ends go.
	for i := range endedKept + 10 {
		s.procs[100+i] = ended(time.Now().Add(time.Duration(i) * time.Millisecond))
	}
	s.mu.Lock()
	s.pruneProcsLocked()
	s.mu.Unlock()
	if len(s.procs) != endedKept+1 {
		t.Errorf("%d kept, want %d ended and the running one", len(s.procs), endedKept)
	}
}
