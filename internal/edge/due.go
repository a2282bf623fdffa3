package edge

import (
	"container/heap"
	"sync"
	"time"

	"github.com/dsecproject/dsec/api"
)

// The reaper learns when each sandbox next needs a look (its TTL, idle
// timeout, pause limit or stopped retention) from a queue ordered by that
// time, instead of examining every sandbox every second: every change
// that can move the time (the same transitions that recount the node,
// plus keepalive) queues the sandbox again; a popped sandbox with nothing
// due yet is queued for its new time (an idle timeout moves with every
// request). Stale entries are harmless: each pop checks the sandbox as it
// is. The reaper's full pass (every livenessEvery ticks: init liveness,
// pooled sandboxes) rebuilds the queue from every sandbox, which bounds
// its stale entries and catches anything a change failed to queue.

type dueEntry struct {
	at time.Time
	s  *sbx
}

type dueHeap []dueEntry

func (h dueHeap) Len() int           { return len(h) }
func (h dueHeap) Less(i, j int) bool { return h[i].at.Before(h[j].at) }
func (h dueHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *dueHeap) Push(x any)        { *h = append(*h, x.(dueEntry)) }
func (h *dueHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

// dueQueue's lock is taken under s.mu and e.mu; nothing is taken under it.
type dueQueue struct {
	mu sync.Mutex
	h  dueHeap
}

func (q *dueQueue) push(at time.Time, s *sbx) {
	q.mu.Lock()
	heap.Push(&q.h, dueEntry{at, s})
	q.mu.Unlock()
}

// popDue takes every entry due at now, each sandbox once.
func (q *dueQueue) popDue(now time.Time) []*sbx {
	q.mu.Lock()
	defer q.mu.Unlock()
	var out []*sbx
	seen := map[*sbx]bool{}
	for len(q.h) > 0 && !q.h[0].at.After(now) {
		s := heap.Pop(&q.h).(dueEntry).s
		if !seen[s] {
			seen[s] = true
			out = append(out, s)
		}
	}
	return out
}

// add queues many entries at once.
func (q *dueQueue) add(entries []dueEntry) {
	q.mu.Lock()
	q.h = append(q.h, entries...)
	heap.Init(&q.h)
	q.mu.Unlock()
}

func (q *dueQueue) clear() {
	q.mu.Lock()
	q.h = nil
	q.mu.Unlock()
}

func (q *dueQueue) len() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.h)
}

// nextDueLocked is the earliest time the reaper has something to check on
// s (s.mu held); zero: nothing (pooled sandboxes are only looked at by
// the full pass).
func (e *Edge) nextDueLocked(s *sbx) time.Time {
	if !s.listed || s.pooled {
		return time.Time{}
	}
	var at time.Time
	earliest := func(t time.Time) {
		if at.IsZero() || t.Before(at) {
			at = t
		}
	}
	r := &s.rec
	switch st := r.Sandbox.State; {
	case st == api.StateRunning:
		if r.Sandbox.ExpiresAt != nil {
			earliest(*r.Sandbox.ExpiresAt)
		}
		if idle := r.Sandbox.Spec.IdleTimeout; idle > 0 {
			earliest(s.active.get().Add(time.Duration(idle) * time.Second))
		}
	case st == api.StatePaused:
		if e.cfg.MaxPaused > 0 && r.Sandbox.PausedAt != nil {
			earliest(r.Sandbox.PausedAt.Add(e.cfg.MaxPaused))
		}
		// The node's own pause does not stop the TTL (diskguard.go).
		if r.Sandbox.PauseReason == api.PauseReasonDiskPressure && r.Sandbox.ExpiresAt != nil {
			earliest(*r.Sandbox.ExpiresAt)
		}
	case !holdsResources(st):
		if r.StoppedAt != nil {
			earliest(r.StoppedAt.Add(e.cfg.StoppedRetention))
		}
	}
	return at
}

// scheduleLocked queues s for its next due time (s.mu held).
func (e *Edge) scheduleLocked(s *sbx) {
	if at := e.nextDueLocked(s); !at.IsZero() {
		e.due.push(at, s)
	}
}
