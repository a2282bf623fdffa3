package netpolicy

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// Config configures a Manager.
type Config struct {
	// Instance tells this edge's objects (nftables table, veth names,
	// DNS address label) from another edge's on the same host: 5 lower-case
	// hex digits.
	Instance string
	// Pool is where sandbox addresses come from: a /30 per sandbox; the
	// first one is the DNS proxy's. Two edges on one host need two pools.
	Pool netip.Prefix
	// Upstreams are the DNS servers ("host:port") permitted names are
	// resolved with.
	Upstreams []string
	// AdmitPrivate are ranges that are not globally routable whose
	// addresses an answer for a permitted name may still admit (an
	// internal package mirror's network); see CheckAdmitPrivate. Without
	// them only globally routable addresses are admitted. Sandbox pools
	// and the host's own addresses never are.
	AdmitPrivate []netip.Prefix
	// Deny are ranges no sandbox reaches, whatever its policy: the
	// networks of the cluster's control plane (etcd, apiservers, the
	// edges' internal API) and anything else off limits (CheckDeny). An
	// allow entry inside one is refused; one that overlaps one stops at
	// its edge; a DNS answer never admits an address inside one.
	Deny []netip.Prefix
	// Presets are the named domain lists policies may use.
	Presets map[string]Preset
	// MinAdmit is how long an address a permitted name resolved to stays
	// reachable after the lookup, at least (DNS TTLs are often shorter than
	// a download). Zero means 10 minutes.
	MinAdmit time.Duration
	Log      *slog.Logger
}

// DefaultPool is the default sandbox address pool.
var DefaultPool = netip.MustParsePrefix("10.200.0.0/16")

var instanceRE = regexp.MustCompile(`^[0-9a-f]{5}$`)

// Attachment is what the edge records for a sandbox that has a veth: its
// slot (addresses and interface name derive from it).
type Attachment struct {
	Slot int `json:"slot"`
}

// Manager owns the networking of one edge's sandboxes. Safe for concurrent
// use; calls for one sandbox must be serialised by the caller.
type Manager struct {
	cfg    Config
	l      layout
	log    *slog.Logger
	filter *addrFilter // what DNS answers may admit

	mu      sync.Mutex
	slots   map[int]*slot
	bySrc   map[netip.Addr]*slot
	next    int // where the search for a free slot starts
	started bool
	dns     *dnsProxy
	// claim is the pool's note on the host, held (ClaimPool).
	claim *poolClaim
}

// slot is one sandbox with a veth.
type slot struct {
	n      int
	id     string
	policy *Policy
	// admitted are the DNS-admitted entries: when they expire and the
	// names that resolved to them.
	admitted map[dynKey]*admission
}

type admission struct {
	expires time.Time
	names   map[string]bool
}

type dynKey struct {
	addr  netip.Addr
	ports Ports
}

// New checks cfg. Nothing on the host changes until the first sandbox gets
// a veth (or Restore finds state of a previous run).
func New(cfg Config) (*Manager, error) {
	if !instanceRE.MatchString(cfg.Instance) {
		return nil, errdefs.Invalid("network instance %q: want 5 hex digits", cfg.Instance)
	}
	if err := CheckPool(cfg.Pool); err != nil {
		return nil, err
	}
	for _, p := range cfg.AdmitPrivate {
		if err := CheckAdmitPrivate(p); err != nil {
			return nil, err
		}
	}
	for _, p := range cfg.Deny {
		if err := CheckDeny(p); err != nil {
			return nil, err
		}
		// The pool holds the sandboxes and their DNS proxy.
		if p.Overlaps(cfg.Pool) {
			return nil, errdefs.Invalid("denied range %v overlaps the sandbox address pool %v", p, cfg.Pool.Masked())
		}
	}
	cfg.Deny = outermost(cfg.Deny)
	if cfg.Presets == nil {
		cfg.Presets = DefaultPresets()
	}
	for name, p := range cfg.Presets {
		if _, _, err := parseEntry(name, cfg.Presets); err != nil {
			return nil, fmt.Errorf("preset %q: %w", name, err)
		}
		if len(p.Domains) == 0 {
			return nil, errdefs.Invalid("preset %q has no domains", name)
		}
	}
	if cfg.MinAdmit == 0 {
		cfg.MinAdmit = 10 * time.Minute
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	return &Manager{
		cfg: cfg, l: layout{instance: cfg.Instance, pool: cfg.Pool.Masked(), deny: cfg.Deny}, log: cfg.Log,
		filter: newAddrFilter(cfg.Pool, cfg.AdmitPrivate, cfg.Deny),
		slots:  map[int]*slot{}, bySrc: map[netip.Addr]*slot{}, next: 1,
	}, nil
}

// CheckPool validates a sandbox address pool: private IPv4, /12 to /28.
func CheckPool(p netip.Prefix) error {
	if !p.IsValid() || !p.Addr().Is4() {
		return errdefs.Invalid("sandbox address pool %v: want an IPv4 prefix", p)
	}
	if p.Bits() < 12 || p.Bits() > 28 {
		return errdefs.Invalid("sandbox address pool %v: want a prefix length from /12 to /28", p)
	}
	private := false
	for _, s := range []string{"10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10"} {
		r := netip.MustParsePrefix(s)
		if r.Bits() <= p.Bits() && r.Contains(p.Addr()) {
			private = true
		}
	}
	if !private {
		return errdefs.Invalid("sandbox address pool %v: want a private range (10/8, 172.16/12, 192.168/16, 100.64/10)", p)
	}
	return nil
}

// outermost is ps without the ranges inside another one of ps (and
// without repeats), in address order: an nft interval set refuses
// overlapping elements, and --sandbox-deny ranges overlap etcd's
// addresses as a rule.
func outermost(ps []netip.Prefix) []netip.Prefix {
	var out []netip.Prefix
	for i, p := range ps {
		inside := false
		for j, q := range ps {
			if i != j && q.Overlaps(p) && (q.Bits() < p.Bits() || q.Bits() == p.Bits() && j < i) {
				inside = true
				break
			}
		}
		if !inside {
			out = append(out, p)
		}
	}
	slices.SortFunc(out, func(a, b netip.Prefix) int { return a.Addr().Compare(b.Addr()) })
	return out
}

// Compile compiles a sandbox's allow and deny lists with this node's
// presets. An allow entry inside a denied range (Config.Deny) is refused.
func (m *Manager) Compile(allow, deny []string) (*Policy, error) {
	return m.compile(allow, deny, true)
}

// Recompile is Compile for a policy that was accepted before: an allow
// entry inside a range denied since is kept (the rules refuse its
// traffic all the same), so the rest of the policy holds as it was.
func (m *Manager) Recompile(allow, deny []string) (*Policy, error) {
	return m.compile(allow, deny, false)
}

func (m *Manager) compile(allow, deny []string, refuseDenied bool) (*Policy, error) {
	p, err := Compile(allow, deny, m.cfg.Presets)
	if err != nil {
		return nil, err
	}
	// Sandboxes never accept connections from one another (only replies
	// come in), so an allow entry towards the pool could not work.
	for _, e := range p.Allow {
		if e.Prefix.Overlaps(m.l.pool) && e.Prefix.Bits() >= m.l.pool.Bits() {
			return nil, errdefs.Invalid("network entry %s: sandboxes cannot connect to each other (%s is the sandbox address pool); use the ports proxy or a shared service", e.Prefix, m.l.pool)
		}
		for _, d := range m.cfg.Deny {
			if refuseDenied && d.Bits() <= e.Prefix.Bits() && d.Contains(e.Prefix.Addr()) {
				return nil, errdefs.Invalid("network entry %s: %s is closed to sandboxes on this node (the cluster's control plane, or the operator's --sandbox-deny)", e.Prefix, d)
			}
		}
	}
	return p, nil
}

// Nameserver is the address sandboxes resolve names through.
func (m *Manager) Nameserver() netip.Addr { return m.l.dnsAddr() }

// Addr returns the sandbox-side address of an attachment.
func (m *Manager) Addr(a *Attachment) netip.Addr {
	_, s := m.l.slotAddrs(a.Slot)
	return s
}

// Apply gives sandbox id (whose init is pid) policy p. A sandbox without an
// attachment whose policy lets nothing out stays loopback-only (nil is
// returned); otherwise it gets (or keeps) a slot, its rules are replaced
// atomically, and a veth is added if it had none. On error the sandbox is
// left as it was.
func (m *Manager) Apply(ctx context.Context, id string, pid int, prev *Attachment, p *Policy) (*Attachment, error) {
	if prev == nil && p.Empty() {
		return nil, nil
	}
	if err := m.ensureStarted(ctx); err != nil {
		return nil, err
	}
	m.mu.Lock()
	var s *slot
	fresh := prev == nil
	if prev != nil {
		s = m.slots[prev.Slot]
		if s == nil || s.id != id {
			m.mu.Unlock()
			return nil, fmt.Errorf("network slot %d is not sandbox %s's", prev.Slot, id)
		}
	} else {
		n, err := m.allocLocked()
		if err != nil {
			m.mu.Unlock()
			return nil, err
		}
		s = &slot{n: n, id: id, admitted: map[dynKey]*admission{}}
		m.slots[n] = s
	}
	// Admitted addresses stay only for names the new policy still permits.
	kept := m.keptLocked(s, p)
	var dyn []dynEntry
	for k, a := range kept {
		dyn = append(dyn, dynEntry{k.addr, k.ports, a.expires})
	}
	m.mu.Unlock()

	script := m.l.slotScript(s.n, p, dyn, time.Now())
	err := nft(ctx, script)
	if err == nil && fresh {
		host, sbx := m.l.slotAddrs(s.n)
		if err = addVeth(pid, m.l.hostIf(s.n), host, sbx); err != nil {
			_ = nft(context.Background(), m.l.removeScript(s.n))
		}
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if err != nil {
		if fresh {
			delete(m.slots, s.n)
		}
		return nil, fmt.Errorf("applying network policy: %w", err)
	}
	s.policy = p
	s.admitted = kept
	_, sbx := m.l.slotAddrs(s.n)
	m.bySrc[sbx] = s
	return &Attachment{Slot: s.n}, nil
}

// keptLocked returns the admitted entries of s that p still permits: an
// address stays only while a name that resolved to it is permitted on its
// ports, so taking a name away cuts its connections at once.
// Preconditions: m.mu held.
func (m *Manager) keptLocked(s *slot, p *Policy) map[dynKey]*admission {
	out := map[dynKey]*admission{}
	for k, a := range s.admitted {
		names := map[string]bool{}
		for name := range a.names {
			if ports, ok := p.Match(name); ok && slices.Contains(ports, k.ports) {
				names[name] = true
			}
		}
		if len(names) > 0 {
			out[k] = &admission{expires: a.expires, names: names}
		}
	}
	return out
}

func (m *Manager) allocLocked() (int, error) {
	max := m.l.slots()
	for i := 0; i < max; i++ {
		n := (m.next-1+i)%max + 1
		if m.slots[n] == nil {
			m.next = n%max + 1
			return n, nil
		}
	}
	return 0, errdefs.Exhausted("no free sandbox network address in pool %s (%d in use)", m.l.pool, max)
}

// Release removes a sandbox's veth, rules and slot. Safe to call twice.
func (m *Manager) Release(ctx context.Context, id string, a *Attachment) error {
	if a == nil {
		return nil
	}
	var errs []error
	if err := delVeth(m.l.hostIf(a.Slot)); err != nil {
		errs = append(errs, err)
	}
	if err := nft(ctx, m.l.removeScript(a.Slot)); err != nil {
		errs = append(errs, fmt.Errorf("removing network rules: %w", err))
	}
	m.mu.Lock()
	if s := m.slots[a.Slot]; s != nil && s.id == id {
		delete(m.slots, a.Slot)
		_, sbx := m.l.slotAddrs(a.Slot)
		delete(m.bySrc, sbx)
	}
	m.mu.Unlock()
	return errors.Join(errs...)
}

// Live is a sandbox that Restore re-adopts.
type Live struct {
	ID     string
	Att    Attachment
	Policy *Policy
}

// Restore re-adopts the attachments of sandboxes that survived an edge
// restart (their rules are rewritten; addresses the DNS proxy admitted are
// dropped and come back at the next lookup) and removes the veths and
// rules of every other slot.
func (m *Manager) Restore(ctx context.Context, live []Live) error {
	slots, exists, err := m.l.tableSlots(ctx)
	if err != nil {
		return err
	}
	veths, err := hostVeths(m.l.ifPrefix())
	if err != nil {
		return err
	}
	if !exists && len(live) == 0 && len(veths) == 0 {
		return nil // this instance never had a network
	}
	if err := m.ensureStarted(ctx); err != nil {
		return err
	}
	keep := map[int]bool{}
	m.mu.Lock()
	for _, l := range live {
		if l.Att.Slot < 1 || l.Att.Slot > m.l.slots() || m.slots[l.Att.Slot] != nil {
			m.mu.Unlock()
			return fmt.Errorf("sandbox %s: bad or duplicate network slot %d", l.ID, l.Att.Slot)
		}
		s := &slot{n: l.Att.Slot, id: l.ID, policy: l.Policy, admitted: map[dynKey]*admission{}}
		m.slots[s.n] = s
		_, sbx := m.l.slotAddrs(s.n)
		m.bySrc[sbx] = s
		keep[s.n] = true
	}
	m.mu.Unlock()
	for _, l := range live {
		if err := nft(ctx, m.l.slotScript(l.Att.Slot, l.Policy, nil, time.Now())); err != nil {
			return fmt.Errorf("restoring network rules of %s: %w", l.ID, err)
		}
	}
	removed := 0
	for _, n := range sortedSlots(slots) {
		if !keep[n] {
			if err := nft(ctx, m.l.removeScript(n)); err != nil {
				return fmt.Errorf("removing stale network rules: %w", err)
			}
			removed++
		}
	}
	for _, v := range veths {
		var n int
		if _, err := fmt.Sscanf(strings.TrimPrefix(v, m.l.ifPrefix()), "%x", &n); err == nil && keep[n] {
			continue
		}
		if err := delVeth(v); err != nil {
			return err
		}
		removed++
	}
	if removed > 0 {
		m.log.Info("removed stale sandbox network state", "objects", removed)
	}
	return nil
}

// ensureStarted prepares the host the first time a sandbox needs a route
// out: IPv4 forwarding, the nftables table, the DNS proxy's address and
// listeners.
func (m *Manager) ensureStarted(ctx context.Context) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.started {
		return nil
	}
	if who, err := poolInUse(m.l.pool, m.l.ifPrefix(), m.l.dnsAddr()); err != nil {
		return err
	} else if who != "" {
		return errdefs.Precondition("sandbox address pool %s is already in use on this host (%s): give each dsec on this host a pool of its own (--sandbox-cidr)", m.l.pool, who)
	}
	if err := nft(ctx, m.l.baseScript()); err != nil {
		return fmt.Errorf("creating nftables table (is nftables in the kernel and nft installed?): %w", err)
	}
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_forward"); err != nil || strings.TrimSpace(string(b)) != "1" {
		if err := writeSysctl("ipv4/ip_forward", "1"); err != nil {
			return fmt.Errorf("enabling IPv4 forwarding: %w", err)
		}
		m.log.Info("enabled IPv4 forwarding on the host (net.ipv4.ip_forward=1) for sandbox egress")
	}
	if err := ensureLoAddr(m.l.dnsAddr(), m.l.ifPrefix()); err != nil {
		return err
	}
	d, err := startDNS(m, m.l.dnsAddr())
	if err != nil {
		return err
	}
	m.dns = d
	m.started = true
	m.log.Info("sandbox networking ready", "pool", m.l.pool.String(), "dns", m.l.dnsAddr().String(),
		"table", "inet "+m.l.table(), "upstreams", strings.Join(m.cfg.Upstreams, ","))
	return nil
}

// Close stops the DNS proxy and ends the pool's claim. Rules, veths and
// the proxy's address stay: the sandboxes keep running and a restarted
// edge re-adopts them.
func (m *Manager) Close() {
	m.mu.Lock()
	d := m.dns
	m.dns = nil
	m.started = false
	m.releaseClaimLocked()
	m.mu.Unlock()
	if d != nil {
		d.close()
	}
}

// Teardown removes everything this instance put on the host (table, DNS
// address). Only for when no sandbox of it is left (tests, uninstall).
func (m *Manager) Teardown(ctx context.Context) error {
	m.Close()
	_, exists, err := m.l.tableSlots(ctx)
	if err != nil {
		return err
	}
	if exists {
		if err := nft(ctx, "delete table inet "+m.l.table()+"\n"); err != nil {
			return err
		}
	}
	return delLoAddr(m.l.dnsAddr())
}

// admit adds addresses a permitted name resolved to for the sandbox at
// src. Addresses admitted recently enough are not re-sent to nft.
func (m *Manager) admit(src netip.Addr, name string, addrs []netip.Addr, ports []Ports, ttl time.Duration) error {
	if ttl < m.cfg.MinAdmit {
		ttl = m.cfg.MinAdmit
	}
	if ttl > 24*time.Hour {
		ttl = 24 * time.Hour
	}
	now := time.Now()
	exp := now.Add(ttl)
	m.mu.Lock()
	s := m.bySrc[src]
	if s == nil {
		m.mu.Unlock()
		return errors.New("sandbox gone")
	}
	var dyn []dynEntry
	for _, a := range addrs {
		for _, p := range ports {
			k := dynKey{a, p}
			if old, ok := s.admitted[k]; ok && old.names[name] && old.expires.Sub(now) > ttl/2 {
				continue
			}
			dyn = append(dyn, dynEntry{a, p, exp})
		}
	}
	n := s.n
	m.mu.Unlock()
	if len(dyn) == 0 {
		return nil
	}
	script := m.l.dynScript(n, dyn, now)
	if script == "" {
		return nil
	}
	// Adding an element that exists keeps its old timeout, hence refresh.
	if err := nft(context.Background(), refreshScript(script)); err != nil {
		return err
	}
	m.mu.Lock()
	if cur := m.slots[n]; cur == s {
		for _, d := range dyn {
			k := dynKey{d.addr, d.ports}
			a := s.admitted[k]
			if a == nil {
				a = &admission{names: map[string]bool{}}
				s.admitted[k] = a
			}
			a.expires = d.expires
			a.names[name] = true
		}
	}
	m.mu.Unlock()
	return nil
}

// refreshScript turns "add element ... { e timeout Xs, ... }" into a
// script that replaces those elements with fresh timeouts: add (so the
// delete cannot fail), delete, add.
func refreshScript(add string) string {
	del := strings.Replace(add, "add element", "delete element", 1)
	// delete takes keys without timeouts.
	del = timeoutRE.ReplaceAllString(del, "")
	return add + del + add
}

var timeoutRE = regexp.MustCompile(` timeout [0-9]+s`)

// policyFor returns the policy of the sandbox at src, or nil.
func (m *Manager) policyFor(src netip.Addr) *Policy {
	m.mu.Lock()
	defer m.mu.Unlock()
	if s := m.bySrc[src]; s != nil {
		return s.policy
	}
	return nil
}
