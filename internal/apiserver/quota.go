package apiserver

// Project quotas, enforced at every create (single, batch, fork, fncall).
//
// A create in project P is admitted only if, for every project on P's
// lineage that sets a limit, what its subtree holds plus what is being
// created in it plus the new sandbox stays within the limit. What the
// subtree holds comes from the nodes (the watcher's view, about a second
// old); what is being created, from reservations that every apiserver
// shares through the store:
//
//   - admission writes a reservation with compare-and-set into the ledger
//     of the lineage's top-most limited project (every create that shares
//     a limited ancestor shares that ledger, since the path above the
//     ancestor is common), so two apiservers admitting at once cannot
//     both take the last unit: the quota is never exceeded;
//   - once the sandbox exists, its reservation becomes a done entry with
//     the node's sequence number of the create (api.Sandbox.CreateSeq),
//     which counts only for an apiserver whose view of that node has a
//     lower api.Node.CreateSeq, i.e. does not count the sandbox yet: no
//     clocks are compared, and nothing counts twice; it is dropped after
//     reservationDoneTTL once the writing apiserver's view counts it
//     (else after reservationTTL);
//     a failed create drops its reservation at once;
//   - a reservation of an apiserver that died mid-create expires after
//     reservationTTL.
//
// Concurrent admissions of one apiserver on one ledger go in one
// compare-and-set (a burst costs a store write per batch, not per create).
// A project whose lineage sets no limit costs nothing.
//
// Counting errs on the side of refusing in one way only: a sandbox
// deleted a moment ago still counts until the next poll of its node.

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"sync"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/iam"
	"github.com/dsecproject/dsec/internal/store"
)

// quotaBucket holds the ledgers, by the id of their project.
const quotaBucket = "quota"

// reservationDoneTTL is how long a done reservation is kept at least:
// every apiserver's view of its node has usually polled since (about a
// second). It is kept longer, up to reservationTTL, while the writing
// apiserver's view does not count it yet (polls held up by a slow store or
// a busy node): dropped earlier, the sandbox would count nowhere, and a
// burst got one past its quota that way. A variable for tests.
var reservationDoneTTL = 5 * time.Second

const (
	// reservationTTL bounds a reservation whose create never finished
	// (its apiserver died).
	reservationTTL = 2 * time.Minute
	// quotaBatch bounds the admissions of one compare-and-set.
	quotaBatch = 256
	// quotaLinger is how long a lone completion waits for an admission
	// to travel with.
	quotaLinger = 20 * time.Millisecond
)

// reservation is a create in flight.
type reservation struct {
	ID      string           `json:"id"`
	Path    string           `json:"path"`
	Amount  api.ProjectUsage `json:"amount"`
	Expires time.Time        `json:"expires"`
}

// doneEntry is a create that was done on Node as its sequence number Seq,
// and when (for its expiry).
type doneEntry struct {
	Node   string           `json:"node"`
	Seq    uint64           `json:"seq"`
	Path   string           `json:"path"`
	Amount api.ProjectUsage `json:"amount"`
	At     time.Time        `json:"at"`
}

type quotaLedger struct {
	InFlight []reservation `json:"in_flight,omitempty"`
	Done     []doneEntry   `json:"done,omitempty"`
}

// limit is one project of a lineage that sets a quota.
type limit struct {
	id, path string
	q        iam.Quota
}

type quotaOp struct {
	// An admission: add, if it fits every limit.
	add    *reservation
	limits []limit
	// Or a completion (node set, seq its create's number there) or a
	// release of reservation id.
	id, node string
	seq      uint64
	err      error
	done     chan struct{} // admissions only
}

type quotas struct {
	s  *Server
	st store.Store

	mu      sync.Mutex
	queues  map[string][]*quotaOp
	running map[string]bool
	kick    map[string]chan struct{}
}

func newQuotas(s *Server, st store.Store) *quotas {
	if st == nil {
		st = store.NewMemory() // one process: nobody to share with
	}
	return &quotas{s: s, st: st, queues: map[string][]*quotaOp{}, running: map[string]bool{}, kick: map[string]chan struct{}{}}
}

// ticket is an admitted create's reservation; its zero value (no quota on
// the lineage) does nothing.
type ticket struct {
	q       *quotas
	ledger  string
	id      string
	settled bool
}

// done marks the reservation's sandbox made on node as its create seq.
func (t *ticket) done(node string, seq uint64) {
	if t == nil || t.ledger == "" || t.settled {
		return
	}
	t.settled = true
	t.q.enqueue(t.ledger, &quotaOp{id: t.id, node: node, seq: seq})
}

// release drops the reservation of a create that failed.
func (t *ticket) release() {
	if t == nil || t.ledger == "" || t.settled {
		return
	}
	t.settled = true
	t.q.enqueue(t.ledger, &quotaOp{id: t.id})
}

// admit reserves what a sandbox of spec (normalized) takes against every
// quota on lineage (spec.Project's, from IAM.Lineage), or refuses with
// quota_exceeded.
func (q *quotas) admit(ctx context.Context, spec api.SandboxSpec, lineage []iam.Project) (*ticket, error) {
	amount := api.ProjectUsage{Sandboxes: 1, CPU: spec.CPU, MemoryMB: spec.MemoryMB, DiskMB: spec.DiskMB}
	var limits []limit
	top := ""
	for _, p := range lineage {
		if p.Quota == (iam.Quota{}) {
			continue
		}
		// A sandbox that sets no limit of its own would hold any amount:
		// where the lineage limits a resource, the spec must say how much.
		for _, c := range []struct {
			limited bool
			asked   bool
			field   string
		}{{p.Quota.CPU > 0, spec.CPU > 0, "cpu"}, {p.Quota.MemoryMB > 0, spec.MemoryMB > 0, "memory_mb"}, {p.Quota.DiskMB > 0, spec.DiskMB > 0, "disk_mb"}} {
			if c.limited && !c.asked {
				return nil, errdefs.Invalid("project %s has a %s quota: the sandbox must set %s", p.ID, c.field, c.field)
			}
		}
		path, err := q.s.pathOf(p.ID)
		if err != nil {
			return nil, err
		}
		limits = append(limits, limit{id: p.ID, path: path, q: p.Quota})
		top = p.ID
	}
	if len(limits) == 0 {
		return &ticket{}, nil
	}
	path, err := q.s.pathOf(spec.Project)
	if err != nil {
		return nil, err
	}
	r := &reservation{ID: newNonce(), Path: path, Amount: amount}
	op := &quotaOp{add: r, limits: limits, done: make(chan struct{})}
	q.enqueue(top, op)
	select {
	case <-op.done:
	case <-ctx.Done():
		// The worker still decides; a reservation it makes expires.
		go func() {
			<-op.done
			if op.err == nil {
				q.enqueue(top, &quotaOp{id: r.ID})
			}
		}()
		return nil, ctx.Err()
	}
	if op.err != nil {
		return nil, op.err
	}
	return &ticket{q: q, ledger: top, id: r.ID}, nil
}

func (q *quotas) enqueue(ledger string, op *quotaOp) {
	q.mu.Lock()
	q.queues[ledger] = append(q.queues[ledger], op)
	k := q.kick[ledger]
	if k == nil {
		k = make(chan struct{}, 1)
		q.kick[ledger] = k
	}
	if !q.running[ledger] {
		q.running[ledger] = true
		go q.drain(ledger, k)
	}
	q.mu.Unlock()
	select {
	case k <- struct{}{}:
	default:
	}
}

// drain writes the queued operations of one ledger until none is left.
func (q *quotas) drain(ledger string, kick chan struct{}) {
	lingered := false
	for {
		q.mu.Lock()
		ops := q.queues[ledger]
		if len(ops) == 0 {
			q.running[ledger] = false
			q.mu.Unlock()
			return
		}
		admissions := false
		for _, op := range ops {
			admissions = admissions || op.add != nil
		}
		if !admissions && !lingered {
			q.mu.Unlock()
			t := time.NewTimer(quotaLinger)
			select {
			case <-kick:
			case <-t.C:
			}
			t.Stop()
			lingered = true
			continue
		}
		n := min(len(ops), quotaBatch)
		batch := ops[:n:n]
		q.queues[ledger] = ops[n:]
		q.mu.Unlock()
		lingered = false
		q.write(ledger, batch)
	}
}

// write applies a batch to the ledger in one compare-and-set.
func (q *quotas) write(ledger string, batch []*quotaOp) {
	byPath, polled := q.view()
	var refusals []error
	err := q.st.Update(quotaBucket, ledger, func(old []byte) ([]byte, error) {
		refusals = make([]error, len(batch))
		var l quotaLedger
		if old != nil {
			if err := json.Unmarshal(old, &l); err != nil {
				return nil, fmt.Errorf("decoding quota ledger %s: %w", ledger, err)
			}
		}
		now := time.Now()
		byID := map[string]int{}
		for i, r := range l.InFlight {
			byID[r.ID] = i
		}
		gone := map[string]bool{}
		for _, op := range batch {
			i, ok := byID[op.id]
			if op.add != nil || !ok || gone[op.id] {
				continue
			}
			gone[op.id] = true
			if op.node == "" {
				continue // released
			}
			r := l.InFlight[i]
			l.Done = append(l.Done, doneEntry{Node: op.node, Seq: op.seq, Path: r.Path, Amount: r.Amount, At: now})
		}
		inFlight := l.InFlight[:0]
		for _, r := range l.InFlight {
			if !gone[r.ID] && now.Before(r.Expires) {
				inFlight = append(inFlight, r)
			}
		}
		l.InFlight = inFlight
		done := l.Done[:0]
		for _, d := range l.Done {
			seen, ok := polled[d.Node]
			uncounted := ok && d.Seq != 0 && seen < d.Seq
			if now.Before(d.At.Add(reservationDoneTTL)) || uncounted && now.Before(d.At.Add(reservationTTL)) {
				done = append(done, d)
			}
		}
		l.Done = done
		// What counts: in flight, or done but not yet in this view of its
		// node.
		reserved := map[string]api.ProjectUsage{}
		count := func(path string, a api.ProjectUsage) {
			u := reserved[path]
			u.Add(a)
			reserved[path] = u
		}
		for _, r := range l.InFlight {
			count(r.Path, r.Amount)
		}
		for _, d := range l.Done {
			// Seq 0: a node that does not number its creates; counted
			// until the entry expires.
			if seen, ok := polled[d.Node]; !ok || d.Seq == 0 || seen < d.Seq {
				count(d.Path, d.Amount)
			}
		}
		for i, op := range batch {
			if op.add == nil {
				continue
			}
			if err := fits(op, byPath, reserved); err != nil {
				refusals[i] = err
				continue
			}
			r := *op.add
			r.Expires = now.Add(reservationTTL)
			l.InFlight = append(l.InFlight, r)
			count(r.Path, r.Amount)
		}
		if len(l.InFlight) == 0 && len(l.Done) == 0 {
			return nil, nil
		}
		return json.Marshal(l)
	})
	for i, op := range batch {
		if op.done == nil {
			if err != nil {
				q.s.log.Warn("updating a quota ledger", "ledger", ledger, "err", err)
			}
			continue
		}
		switch {
		case err != nil:
			op.err = fmt.Errorf("checking the quota of project %s: %w", ledger, err)
		default:
			op.err = refusals[i]
		}
		close(op.done)
	}
}

// view is the usage the nodes report, by project path, and the last
// create each node's counts include.
func (q *quotas) view() (map[string]api.ProjectUsage, map[string]uint64) {
	byPath := map[string]api.ProjectUsage{}
	polled := map[string]uint64{}
	for _, v := range q.s.deps.Nodes.Snapshot() {
		polled[v.Name] = v.CreateSeq
		for path, u := range v.Projects {
			t := byPath[path]
			t.Add(u)
			byPath[path] = t
		}
	}
	return byPath, polled
}

// fits checks an admission against each of its limits.
func fits(op *quotaOp, byPath, reserved map[string]api.ProjectUsage) error {
	a := op.add.Amount
	for _, l := range op.limits {
		used := usageBelow(byPath, l.path)
		used.Add(usageBelow(reserved, l.path))
		over := func(field string, quota, inUse, ask float64) error {
			if quota > 0 && inUse+ask > quota+1e-9 {
				return errdefs.Quota("project %s: %s quota %s reached (%s in use or being created, this sandbox asks %s)",
					l.id, field, num(quota), num(inUse), num(ask))
			}
			return nil
		}
		for _, err := range []error{
			over("sandboxes", float64(l.q.Sandboxes), float64(used.Sandboxes), float64(a.Sandboxes)),
			over("cpu", l.q.CPU, used.CPU, a.CPU),
			over("memory_mb", float64(l.q.MemoryMB), float64(used.MemoryMB), float64(a.MemoryMB)),
			over("disk_mb", float64(l.q.DiskMB), float64(used.DiskMB), float64(a.DiskMB)),
		} {
			if err != nil {
				return err
			}
		}
	}
	return nil
}

func num(v float64) string {
	if v == math.Trunc(v) {
		return fmt.Sprintf("%.0f", v)
	}
	return fmt.Sprintf("%g", v)
}
