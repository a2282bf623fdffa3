package edge

import (
	"context"
	"encoding/json"
	"sync"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
)

// Warm pools. A create is served from a pool when one holds a ready
// sandbox of the same environment class: the same layers and the same
// container-level settings (backend, cpu, memory, pids, disk, qos, userns,
// network policy). What only matters per call (labels, env, user, workdir,
// ttl, idle timeout) is applied when the sandbox is handed out, so a pool
// sandbox is never one somebody used: it was created for the pool, nothing
// ran in it, and it is invisible (not listed, not addressable) until
// claimed.
//
// Pools size themselves by demand: a class's target is the number of
// creates it saw in the last DemandWindow divided by DemandDivisor, rounded
// down (about ten seconds' worth; a class asked for fewer than three times
// gets none), at least Config.PoolMin for a class created in the last
// PoolIdle, capped at Config.PoolMax; classes without a create for
// PoolIdle are drained. Sandboxes a pool holds beyond its target when
// demand falls stay until then. One background worker refills them one
// sandbox at a time, so that refills never compete with callers for more
// than one create's worth of CPU. A pooled sandbox counts against
// MaxSandboxes; a create that finds the node full evicts one.

// Pool tuning.
const (
	DemandWindow  = 30 * time.Second
	DemandDivisor = 3
	PoolIdle      = 5 * time.Minute
	// RefillDelay is how long a refill waits after a create: the caller
	// who just got a sandbox usually execs in it at once.
	RefillDelay = 20 * time.Millisecond
	// RefillBackoff is how long a class whose refill failed is left
	// alone, so that it neither fills the log nor holds up the others.
	RefillBackoff = 30 * time.Second
)

type poolKey string

// keyOf is the environment class of a normalized spec on its layers.
func keyOf(spec api.SandboxSpec, digests []string) poolKey {
	class := struct {
		Digests []string
		Backend string
		CPU     float64
		Memory  int64
		Pids    int64
		Disk    int64
		QoS     string
		UserNS  bool
		Network *api.NetworkPolicy
		MemCG   string
	}{digests, spec.Backend, spec.CPU, spec.MemoryMB, spec.Pids, spec.DiskMB, spec.QoS, spec.InUserNS(), spec.Network, spec.MemoryCgroup}
	b, _ := json.Marshal(class)
	return poolKey(b)
}

type pool struct {
	mu sync.Mutex
	// ready are claimable sandboxes, oldest first.
	ready map[poolKey][]*sbx
	// seen are the recent creates of each class; template a create to
	// refill it with.
	seen     map[poolKey][]time.Time
	template map[poolKey]edgeapi.CreateRequest
	// retryAt holds back refills of a class whose last one failed.
	retryAt map[poolKey]time.Time
	kick    chan struct{}
}

func newPool() *pool {
	return &pool{
		ready: map[poolKey][]*sbx{}, seen: map[poolKey][]time.Time{},
		template: map[poolKey]edgeapi.CreateRequest{}, retryAt: map[poolKey]time.Time{},
		kick: make(chan struct{}, 1),
	}
}

// note records a successful create of class k at now (a create that
// failed is not demand a pool could serve).
func (p *pool) note(k poolKey, req edgeapi.CreateRequest, now time.Time) {
	p.mu.Lock()
	p.seen[k] = append(trimBefore(p.seen[k], now.Add(-PoolIdle)), now)
	p.template[k] = req
	p.mu.Unlock()
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

func trimBefore(ts []time.Time, t time.Time) []time.Time {
	i := 0
	for i < len(ts) && ts[i].Before(t) {
		i++
	}
	return ts[i:]
}

// target is how many ready sandboxes class k should have: its recent
// demand, at least floor while it was created in the last PoolIdle, at
// most ceiling.
// Preconditions: p.mu held.
func (p *pool) targetLocked(k poolKey, now time.Time, floor, ceiling int) int {
	seen := p.seen[k] // oldest first
	n := len(trimBefore(seen, now.Add(-DemandWindow)))
	// Rounded down: a class asked for once or twice gets no pool (but
	// the floor).
	target := n / DemandDivisor
	if len(seen) > 0 && now.Sub(seen[len(seen)-1]) <= PoolIdle {
		target = max(target, floor)
	}
	return min(ceiling, target)
}

// take pops a ready sandbox of class k, or nil.
func (p *pool) take(k poolKey) *sbx {
	p.mu.Lock()
	defer p.mu.Unlock()
	list := p.ready[k]
	if len(list) == 0 {
		return nil
	}
	s := list[0]
	p.ready[k] = list[1:]
	return s
}

// claim hands out a pooled sandbox of req's class, or returns nil. spec is
// req.Spec normalized.
func (e *Edge) claim(spec api.SandboxSpec, req edgeapi.CreateRequest) *api.Sandbox {
	k := keyOf(spec, req.Digests)
	for {
		// The tenancy is taken before the sandbox is (e.mu is not taken
		// under s.mu); refused, the create goes on and is refused the
		// same way.
		e.mu.Lock()
		terr := e.tenancyAdmitLocked(req.Dedicated)
		e.mu.Unlock()
		if terr != nil {
			return nil
		}
		s := e.pool.take(k)
		if s == nil {
			e.mu.Lock()
			e.tenancyAddLocked(req.Dedicated, -1)
			e.mu.Unlock()
			return nil
		}
		s.life.Lock()
		s.mu.Lock()
		ok := s.pooled && !s.going && s.rec.Sandbox.State == api.StateRunning
		if ok {
			now := time.Now().UTC()
			exp := now.Add(time.Duration(spec.TTL) * time.Second)
			s.rec.Sandbox.Spec = spec
			s.rec.Sandbox.Labels = spec.Labels
			s.rec.Sandbox.Project, s.rec.ProjectPath, s.rec.Dedicated = spec.Project, req.ProjectPath, req.Dedicated
			s.rec.Sandbox.CreatedAt, s.rec.Sandbox.ExpiresAt = now, &exp
			s.rec.Pooled, s.rec.Token = false, req.Token
			if err := s.persistClaimLocked(); err != nil {
				e.log.Warn("claiming pooled sandbox", "sandbox_id", s.rec.Sandbox.ID, "err", err)
				ok = false
			} else {
				s.pooled = false
				e.recountLocked(s)
			}
		}
		v := s.viewLocked()
		s.mu.Unlock()
		s.life.Unlock()
		if !ok {
			e.mu.Lock()
			e.tenancyAddLocked(req.Dedicated, -1)
			e.mu.Unlock()
			continue // died or being removed: try the next one
		}
		// In the node's counts from now on: numbered after that.
		e.mu.Lock()
		e.createSeq++
		seq := e.createSeq
		e.mu.Unlock()
		s.mu.Lock()
		s.rec.Sandbox.CreateSeq = seq
		s.mu.Unlock()
		v.CreateSeq = seq
		s.touch()
		e.metrics.poolClaims.WithLabelValues("hit").Inc()
		e.log.Info("sandbox created", "sandbox_id", v.ID, "project", spec.Project, "base", spec.Base, "pooled", true)
		return &v
	}
}

// poolLoop refills pools and drains idle ones until the edge stops.
func (e *Edge) poolLoop() {
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-e.stop:
			return
		case <-tick.C:
		case <-e.pool.kick:
			// Let the request that claimed (and usually execs right
			// away) have the CPU before a refill competes for it.
			select {
			case <-e.stop:
				return
			case <-time.After(RefillDelay):
			}
		}
		for e.refillOne() {
			select {
			case <-e.stop:
				return
			default:
			}
		}
		e.drainIdle()
	}
}

// refillOne creates one pooled sandbox for the class furthest below its
// target and reports whether it tried (a class whose refill fails is left
// alone for RefillBackoff, so the next call tries another).
func (e *Edge) refillOne() bool {
	best, req, ok := e.pool.pick(time.Now(), e.cfg.PoolMin, e.cfg.PoolMax)
	if !ok {
		return false
	}
	// Never fill the node with pool sandboxes: keep a quarter free.
	e.mu.RLock()
	full := e.live >= e.cfg.MaxSandboxes*3/4
	e.mu.RUnlock()
	if full {
		return false
	}
	req.Spec.Labels, req.Spec.Env = nil, nil
	s, err := e.createPooled(context.Background(), req)
	if err != nil {
		e.log.Warn("refilling warm pool", "base", req.Spec.Base, "err", err, "retry_in", RefillBackoff)
		e.pool.mu.Lock()
		e.pool.retryAt[best] = time.Now().Add(RefillBackoff)
		e.pool.mu.Unlock()
		return true
	}
	e.pool.mu.Lock()
	e.pool.ready[best] = append(e.pool.ready[best], s)
	delete(e.pool.retryAt, best)
	e.pool.mu.Unlock()
	return true
}

// pick chooses the class furthest below its target (floor and ceiling as
// for targetLocked), skipping those whose refill failed less than
// RefillBackoff ago, and returns it with the create to refill it with.
func (p *pool) pick(now time.Time, floor, ceiling int) (poolKey, edgeapi.CreateRequest, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var best poolKey
	gap := 0
	for k := range p.seen {
		if now.Before(p.retryAt[k]) {
			continue
		}
		if g := p.targetLocked(k, now, floor, ceiling) - len(p.ready[k]); g > gap {
			best, gap = k, g
		}
	}
	return best, p.template[best], gap > 0
}

// drainIdle forgets the classes nobody asked for in PoolIdle and deletes
// their pooled sandboxes.
func (e *Edge) drainIdle() {
	for _, s := range e.pool.forgetIdle(time.Now()) {
		e.deletePooled(s)
	}
}

// forgetIdle drops every class without a create in PoolIdle, pooled or
// not (its template holds a caller's request), and returns its pooled
// sandboxes, to be deleted.
func (p *pool) forgetIdle(now time.Time) (drop []*sbx) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for k := range p.seen {
		seen := trimBefore(p.seen[k], now.Add(-PoolIdle))
		p.seen[k] = seen
		if len(seen) == 0 {
			drop = append(drop, p.ready[k]...)
			delete(p.ready, k)
			delete(p.seen, k)
			delete(p.template, k)
			delete(p.retryAt, k)
		}
	}
	return drop
}

// evictPooled deletes one pooled sandbox (the oldest of the largest pool)
// to make room for a create, and reports whether there was one.
func (e *Edge) evictPooled() bool {
	e.pool.mu.Lock()
	var best poolKey
	n := 0
	for k, list := range e.pool.ready {
		if len(list) > n {
			best, n = k, len(list)
		}
	}
	var s *sbx
	if n > 0 {
		s = e.pool.ready[best][0]
		e.pool.ready[best] = e.pool.ready[best][1:]
	}
	e.pool.mu.Unlock()
	if s == nil {
		return false
	}
	e.deletePooled(s)
	return true
}

func (e *Edge) deletePooled(s *sbx) {
	s.mu.Lock()
	id := s.rec.Sandbox.ID
	s.mu.Unlock()
	if err := e.remove(context.Background(), s); err != nil {
		e.log.Warn("deleting pooled sandbox", "sandbox_id", id, "err", err)
	}
}

// PoolSizes returns the ready sandboxes per base ref (for metrics and
// tests).
func (e *Edge) PoolSizes() map[string]int {
	e.pool.mu.Lock()
	defer e.pool.mu.Unlock()
	out := map[string]int{}
	for k, list := range e.pool.ready {
		out[e.pool.template[k].Spec.Base] += len(list)
	}
	return out
}

// createPooled creates a sandbox for the pool: like create, but invisible
// until claimed.
func (e *Edge) createPooled(ctx context.Context, req edgeapi.CreateRequest) (*sbx, error) {
	spec := req.Spec
	if err := e.normalize(&spec); err != nil {
		return nil, err
	}
	req.Spec = spec
	return e.createSbx(ctx, req, true)
}

// drop removes s from the ready lists, if it is there.
func (p *pool) drop(s *sbx) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for k, list := range p.ready {
		for i, x := range list {
			if x == s {
				p.ready[k] = append(list[:i:i], list[i+1:]...)
				return
			}
		}
	}
}

func (s *sbx) isPooled() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.pooled
}

// drainAll deletes every pooled sandbox (at shutdown).
func (e *Edge) drainAll() {
	e.pool.mu.Lock()
	var all []*sbx
	for k, list := range e.pool.ready {
		all = append(all, list...)
		delete(e.pool.ready, k)
	}
	e.pool.mu.Unlock()
	for _, s := range all {
		e.deletePooled(s)
	}
}
