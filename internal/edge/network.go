package edge

import (
	"context"
	"fmt"
	"net"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/netpolicy"
	"github.com/dsecproject/dsec/internal/sandbox"
)

// compileNetwork checks a spec's network policy against this node's
// presets. Without a network manager only a policy that lets nothing out
// is accepted.
func (e *Edge) compileNetwork(np *api.NetworkPolicy) (*netpolicy.Policy, error) {
	var allow, deny []string
	if np != nil {
		allow, deny = np.Allow, np.Deny
	}
	if e.deps.Net == nil {
		if len(allow) > 0 {
			return nil, errdefs.Precondition("node %s has no sandbox networking (nftables unavailable or disabled): sandboxes are loopback-only; omit network.allow", e.cfg.Name)
		}
		return &netpolicy.Policy{}, nil
	}
	return e.deps.Net.Compile(allow, deny)
}

// recompileNetwork compiles the policy of a sandbox that had it before
// (a restart): an entry inside a range the node denies since is kept, its
// traffic refused by the rules, and the rest holds.
func (e *Edge) recompileNetwork(np *api.NetworkPolicy) (*netpolicy.Policy, error) {
	if np == nil || e.deps.Net == nil {
		return e.compileNetwork(np)
	}
	return e.deps.Net.Recompile(np.Allow, np.Deny)
}

// initPid returns the host pid of a sandbox's init.
func (e *Edge) initPid(ctx context.Context, id string) (int, error) {
	st, err := e.backendByID(id).Status(ctx, id)
	if err != nil {
		return 0, fmt.Errorf("finding sandbox init: %w", err)
	}
	if !st.Running || st.Pid <= 0 {
		return 0, errdefs.Precondition("sandbox %s has no running init", id)
	}
	return st.Pid, nil
}

// SetNetwork replaces a sandbox's network policy, live: connections the new
// policy does not permit stop passing at once, in both directions. A
// paused sandbox stays paused.
func (e *Edge) SetNetwork(ctx context.Context, id string, np api.NetworkPolicy) (*api.Sandbox, error) {
	p, err := e.compileNetwork(&np)
	if err != nil {
		return nil, err
	}
	s, done, err := e.beginNoWake(ctx, id)
	if err != nil {
		return nil, err
	}
	defer done()
	s.netMu.Lock()
	defer s.netMu.Unlock()
	s.mu.Lock()
	prev := s.rec.Net
	s.mu.Unlock()
	if nf, ok := e.backendOf(s).(sandbox.NetworkFirst); ok && nf.NetworkFirst() && prev == nil && !p.Empty() {
		// Its network stack took its interfaces when it started.
		return nil, errdefs.Precondition("sandbox %s runs on the %s backend, which takes its network interfaces once, when it starts: it was created without network access and cannot be given it now; create it with network.allow", id, e.backendOf(s).Name())
	}
	var att *netpolicy.Attachment
	if e.deps.Net != nil {
		pid, err := e.initPid(ctx, id)
		if err != nil {
			return nil, err
		}
		if att, err = e.deps.Net.Apply(ctx, id, pid, prev, p); err != nil {
			return nil, err
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.rec.Net = att
	if len(np.Allow) == 0 && len(np.Deny) == 0 {
		s.rec.Sandbox.Spec.Network = nil
	} else {
		s.rec.Sandbox.Spec.Network = &np
	}
	if err := s.persistLocked(); err != nil {
		return nil, err
	}
	e.log.Info("sandbox network policy changed", "sandbox_id", id, "allow", len(np.Allow), "deny", len(np.Deny))
	v := s.viewLocked()
	return &v, nil
}

// releaseNetwork removes a sandbox's veth and rules, if it has any.
func (e *Edge) releaseNetwork(ctx context.Context, id string, att *netpolicy.Attachment) {
	if att == nil || e.deps.Net == nil {
		return
	}
	if err := e.deps.Net.Release(ctx, id, att); err != nil {
		e.log.Warn("releasing sandbox network", "sandbox_id", id, "err", err)
	}
}

// DialPort connects to a TCP port on a sandbox's loopback (a paused
// sandbox is resumed). The returned done must be called when the
// connection is finished with: the sandbox counts as busy until then.
func (e *Edge) DialPort(ctx context.Context, id string, port int) (net.Conn, func(), error) {
	if port < 1 || port > 65535 {
		return nil, nil, errdefs.Invalid("port must be between 1 and 65535, got %d", port)
	}
	s, end, err := e.begin(ctx, id)
	if err != nil {
		return nil, nil, err
	}
	if _, own := e.backendOf(s).(sandbox.InnerSignaler); own {
		// Its loopback is its own kernel's, not a host network namespace's.
		end()
		return nil, nil, errdefs.Precondition("sandbox %s runs on the %s backend, whose loopback the node cannot dial: port connections are not offered for it", id, e.backendOf(s).Name())
	}
	release, ok := e.streams.take()
	if !ok {
		end()
		return nil, nil, e.streamsFull()
	}
	done := func() {
		release()
		end()
	}
	pid, err := e.initPid(ctx, id)
	if err != nil {
		done()
		return nil, nil, err
	}
	c, err := netpolicy.DialLoopback(ctx, pid, port)
	if err != nil {
		done()
		return nil, nil, errdefs.Unavailable("nothing answers on port %d in sandbox %s: %v", port, id, err)
	}
	return c, done, nil
}

// restoreNetwork re-adopts the network state of sandboxes that survived a
// restart and removes the rest.
func (e *Edge) restoreNetwork(ctx context.Context) error {
	if e.deps.Net == nil {
		return nil
	}
	var live []netpolicy.Live
	e.mu.RLock()
	for id, s := range e.sandboxes {
		s.mu.Lock()
		rec := s.rec
		s.mu.Unlock()
		if rec.Net == nil || !holdsResources(rec.Sandbox.State) {
			continue
		}
		p, err := e.recompileNetwork(rec.Sandbox.Spec.Network)
		if err != nil {
			// The node's presets changed under it: let nothing out
			// rather than guess.
			e.log.Warn("sandbox network policy no longer compiles; blocking its egress", "sandbox_id", id, "err", err)
			p = &netpolicy.Policy{}
		}
		live = append(live, netpolicy.Live{ID: id, Att: *rec.Net, Policy: p})
	}
	e.mu.RUnlock()
	return e.deps.Net.Restore(ctx, live)
}
