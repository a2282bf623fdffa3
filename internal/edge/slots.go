package edge

import (
	"sync"
	"sync/atomic"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// An open session holds its shell's process and pipes (~4 descriptors),
// a running command (exec, streamed or not, and fncall) its pipes and exec
// helper, and a port connection a socket into the sandbox. The
// per-sandbox limits alone let a caller open them on every sandbox until
// the daemon ran out of descriptors, and then every exec on the node
// failed. slots bound each kind node-wide (--max-sessions-total,
// --max-streams): a call past the bound is refused with resource_exhausted
// before it starts anything, and the caller may retry.
type slots struct {
	limit int64
	used  atomic.Int64
}

func newSlots(limit int) *slots { return &slots{limit: int64(limit)} }

// take claims a slot; release gives it back and may be called more than
// once.
func (s *slots) take() (release func(), ok bool) {
	if s.used.Add(1) > s.limit {
		s.used.Add(-1)
		return nil, false
	}
	var once sync.Once
	return func() { once.Do(func() { s.used.Add(-1) }) }, true
}

func (s *slots) inUse() int64 { return s.used.Load() }

// Default node-wide bounds for a daemon that may hold nofile descriptors:
// a sixteenth of them each (a session or command holds about four, so
// each kind may take a quarter of the descriptors; connections take
// another quarter, see cmd/dsec), at least 64 and at most 16,384.
func DefaultMaxSessionsTotal(nofile uint64) int { return sixteenth(nofile) }

// DefaultMaxStreams: see DefaultMaxSessionsTotal.
func DefaultMaxStreams(nofile uint64) int { return sixteenth(nofile) }

func sixteenth(nofile uint64) int { return int(min(max(nofile/16, 64), 16384)) }

func (e *Edge) sessionsFull() error {
	return errdefs.Exhausted("node %s has %d sessions open, its limit (--max-sessions-total); close sessions or retry later",
		e.cfg.Name, e.cfg.MaxSessionsTotal)
}

func (e *Edge) streamsFull() error {
	return errdefs.Exhausted("node %s is running %d commands, port connections and file transfers, its limit (--max-streams); retry later",
		e.cfg.Name, e.cfg.MaxStreams)
}
