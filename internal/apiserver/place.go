package apiserver

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/cluster"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/iam"
	"github.com/dsecproject/dsec/internal/placement"
)

// maxPlaceAttempts bounds the nodes that refuse one create, maxUnreachable
// those that cannot be reached (a refused connection costs little, and
// when many nodes die at once the view shows them all down only a poll
// later), and maxResends the times a create whose answer was lost is sent
// to its node again.
const (
	maxPlaceAttempts = 3
	maxUnreachable   = 16
	maxResends       = 3
)

// place creates a prepared sandbox on a node placement picks.
func (s *Server) place(ctx context.Context, spec api.SandboxSpec, st layerStack) (*api.Sandbox, error) {
	path, err := s.pathOf(spec.Project)
	if err != nil {
		return nil, err
	}
	lineage, err := s.deps.IAM.Lineage(spec.Project)
	if err != nil {
		return nil, err
	}
	dedicated, err := s.dedicatedOf(lineage)
	if err != nil {
		return nil, err
	}
	t, err := s.quotas.admit(ctx, spec, lineage)
	if err != nil {
		return nil, err
	}
	// One token for every node this create tries: each makes at most one
	// sandbox for it, however often it is sent (edgeapi.CreateRequest).
	token := createToken()
	var sb *api.Sandbox
	err = s.onSomeNode(ctx, spec, st.digests, dedicated, token, func(ctx context.Context, e edgeapi.Edge) error {
		var err error
		sb, err = e.Create(ctx, edgeapi.CreateRequest{Spec: spec, Digests: st.digests, Below: st.below, ProjectPath: path, Dedicated: dedicated, Token: token})
		return err
	})
	settle(t, sb, err)
	return sb, err
}

// createToken is a create's token: 128 random bits.
func createToken() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// dedicatedOf is the path of the nearest project on lineage (a project,
// then its ancestors) that asks for dedicated nodes, "" if none does.
func (s *Server) dedicatedOf(lineage []iam.Project) (string, error) {
	for _, p := range lineage {
		if p.DedicatedNodes {
			return s.pathOf(p.ID)
		}
	}
	return "", nil
}

// settle ends a create's quota reservation: its sandbox is made, or the
// create failed. A create whose node was lost after the request left may
// have made one: the reservation then stays until it expires.
func settle(t *ticket, sb *api.Sandbox, err error) {
	switch {
	case err == nil && sb != nil:
		t.done(sb.Node, sb.CreateSeq)
	case edgeapi.IsUnreachable(err):
	default:
		t.release()
	}
}

// onSomeNode runs fn (a create of spec) on a node placement picks. A node
// that refuses for capacity, or that could not be reached before the
// request was sent, is left out and another is tried (at most
// maxPlaceAttempts refusals and maxUnreachable unreachable nodes); then
// the answer is 503 with what each said. With a token, a create whose
// answer was lost is sent to its node again (see below).
func (s *Server) onSomeNode(ctx context.Context, spec api.SandboxSpec, digests []string, dedicated, token string, fn func(context.Context, edgeapi.Edge) error) error {
	req := placement.Request{Backend: spec.Backend, Selector: spec.NodeSelector, Layers: digests,
		Job: spec.Labels[api.JobLabel], Exclude: map[string]bool{}, Dedicated: dedicated}
	var said []string
	refused, unreachable := 0, 0
	for attempt := 0; refused < maxPlaceAttempts && unreachable < maxUnreachable; attempt++ {
		node, undo, err := s.pick(req)
		if err != nil {
			s.metrics.placements.WithLabelValues("none").Inc()
			if len(said) > 0 {
				return errdefs.Exhausted("no node took the sandbox: %s; then %v", strings.Join(said, "; "), err)
			}
			return err
		}
		if attempt > 0 {
			s.metrics.placeRetries.Inc()
		}
		err = s.runOn(ctx, node, undo, fn)
		if err != nil && token != "" && lostAnswer(err) {
			// The node may have made it: sent again to the same node the
			// create makes nothing twice (its token). A node that then
			// cannot be reached is down: the token is recorded as
			// abandoned there (should it come back having made the
			// sandbox, it deletes it) before another node is asked. (A
			// dying edge may break a resend on another of its kept-alive
			// connections too: hence a few.)
			lost := err
			for try := 0; try < maxResends && lostAnswer(err) && ctx.Err() == nil; try++ {
				s.metrics.placements.WithLabelValues("resent").Inc()
				err = s.runOn(ctx, node, func() {}, fn)
				s.log.Info("a create's answer was lost: sent again to the same node", "node", node, "lost", lost, "then", err)
			}
			if notSent(err) {
				if aerr := cluster.Abandon(s.stateStore(), node, token); aerr != nil {
					s.log.Warn("recording an abandoned create", "node", node, "err", aerr)
					return lost
				}
			}
		}
		if err == nil {
			s.metrics.placements.WithLabelValues("placed").Inc()
			return nil
		}
		switch {
		case errors.Is(err, errdefs.ErrExhausted):
			refused++
			s.metrics.placements.WithLabelValues("refused").Inc()
		case notSent(err):
			unreachable++
			s.metrics.placements.WithLabelValues("unreachable").Inc()
			s.deps.Nodes.MarkFailed(node, err)
		default:
			// The edge may have made it (a connection lost mid-way):
			// trying another node could make two.
			return err
		}
		req.Exclude[node] = true
		said = append(said, fmt.Sprintf("%s: %v", node, err))
	}
	return errdefs.Exhausted("no node took the sandbox after %d tries: %s", len(said), strings.Join(said, "; "))
}

// lostAnswer reports whether err says a call reached, or may have reached,
// the edge and its answer never came back.
func lostAnswer(err error) bool {
	var u *edgeapi.Unreachable
	return errors.As(err, &u) && !u.NotSent
}

// notSent reports whether err says the request never reached the edge
// (its connection could not be made), so that retrying elsewhere cannot
// make a second sandbox.
func notSent(err error) bool {
	var u *edgeapi.Unreachable
	return errors.As(err, &u) && u.NotSent
}

// pick runs placement over the view plus this apiserver's placements that
// the view does not show yet, and counts the choice in flight at once
// (undo takes it back if the create fails): picks are serialised, so that
// a burst placed concurrently sees each of its own placements. When the
// view has every candidate full, the least loaded is asked anyway: the
// view is up to a poll old (a delete since may have made room) and the
// edge has the final say.
func (s *Server) pick(req placement.Request) (node string, undo func(), err error) {
	snap := s.deps.Nodes.Snapshot()
	s.pickMu.Lock()
	defer s.pickMu.Unlock()
	cands := make([]placement.Candidate, len(snap))
	for i := range snap {
		v := &snap[i]
		cands[i] = placement.Candidate{Node: &v.Node}
		if !s.deps.Placement.NoOverlay {
			c := &cands[i]
			c.InFlight, c.InFlightJob, c.InFlightOther = s.inflight.since(v.Name, req.Job, req.Dedicated, v.PolledAt)
		}
	}
	node, err = placement.Pick(cands, req, s.deps.Placement, nil)
	var nn *placement.NoNode
	if errors.As(err, &nn) && nn.OnlyFull() {
		req.IgnoreCapacity = true
		all := s.deps.Placement // its pools and hollow setting, every node
		all.K = placement.AllNodes
		node, err = placement.Pick(cands, req, all, nil)
	}
	if err != nil {
		return "", nil, err
	}
	return node, s.inflight.add(node, req.Job, req.Dedicated), nil
}

// runOn runs fn on node; a failure takes its in-flight placement back.
func (s *Server) runOn(ctx context.Context, node string, undo func(), fn func(context.Context, edgeapi.Edge) error) error {
	e, err := s.deps.Nodes.Edge(ctx, node)
	if err != nil {
		undo()
		return err
	}
	if err := fn(ctx, e); err != nil {
		undo()
		return err
	}
	return nil
}

// inflight remembers when this apiserver placed sandboxes on each node
// (and of which job), so that placements since a node's last poll count
// as load (DSec's placement engines overlay their own recent placements
// the same way; no coordination between apiservers is needed).
type inflight struct {
	mu sync.Mutex
	at map[string][]placed // node → placements, oldest first
}

type placed struct {
	t       time.Time
	job     string
	tenancy string
}

// inflightKeep is how long a placement is remembered: far longer than a
// poll, so that a slow poll does not forget placements it has not seen.
const inflightKeep = 10 * time.Second

func newInflight() *inflight { return &inflight{at: map[string][]placed{}} }

// add records a placement of job on node now; the returned func takes it
// back.
func (f *inflight) add(node, job, tenancy string) func() {
	now := time.Now()
	f.mu.Lock()
	defer f.mu.Unlock()
	l := f.at[node]
	cut := 0
	for cut < len(l) && now.Sub(l[cut].t) > inflightKeep {
		cut++
	}
	f.at[node] = append(l[cut:], placed{t: now, job: job, tenancy: tenancy})
	return func() {
		f.mu.Lock()
		defer f.mu.Unlock()
		l := f.at[node]
		for i := len(l) - 1; i >= 0; i-- {
			if l[i].t.Equal(now) && l[i].job == job {
				f.at[node] = append(l[:i], l[i+1:]...)
				return
			}
		}
	}
}

// since counts the placements on node made after t (a poll's start), and
// how many of them were of job.
func (f *inflight) since(node, job, tenancy string, t time.Time) (n, ofJob, other int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	l := f.at[node]
	for i := len(l) - 1; i >= 0 && l[i].t.After(t); i-- {
		n++
		if job != "" && l[i].job == job {
			ofJob++
		}
		if l[i].tenancy != tenancy {
			other++
		}
	}
	return n, ofJob, other
}
