// Package edge is the node daemon: it admits sandboxes, composes their root
// filesystems from layers, drives the sandbox backend, serves exec, sessions
// and files, enforces TTL and idle timeouts, and after its own restart
// re-adopts live sandboxes and reaps whatever belongs to none. It owns the
// truth about its sandboxes in a state directory on local disk. The
// apiserver calls it (in-process for `dsec up`).
package edge

import (
	"context"
	"crypto/rand"
	"encoding/base32"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/cgroup"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/layer"
	"github.com/dsecproject/dsec/internal/netpolicy"
	"github.com/dsecproject/dsec/internal/quota"
	"github.com/dsecproject/dsec/internal/sandbox"
)

// Config configures an edge.
type Config struct {
	// Name identifies the node; it is part of every sandbox id.
	Name string
	// StateDir holds sandboxes/, mnt/ (layer mounts) and runtime state.
	StateDir string
	// MaxSandboxes is the admission limit (live sandboxes on this node).
	MaxSandboxes int
	// Labels are the node's labels, which specs select with node_selector.
	Labels map[string]string
	// Policy bounds specs.
	Policy sandbox.Policy
	// CgroupParent is the parent cgroup of every sandbox ("/dsec").
	CgroupParent string
	// BundleDir holds each sandbox's OCI bundle (<BundleDir>/<id>) while
	// the backend starts it; "" puts it in the sandbox's dir. Either way
	// it is removed once the sandbox runs: the runtime keeps its own copy
	// of the config.
	BundleDir string
	// CgroupPool is how many emptied sandbox cgroups are kept for reuse
	// (cgroup.Slots); 0 creates and removes one per sandbox. It needs a
	// backend that leaves cgroups to the edge (container.KeepCgroups).
	CgroupPool int
	// SharedMemoryMB limits the memory of all memory_cgroup "shared"
	// sandboxes together (0: no limit).
	SharedMemoryMB int64
	// StoppedRetention is how long a stopped sandbox's record stays
	// readable after TTL or idle expiry.
	StoppedRetention time.Duration
	// ReapInterval is how often TTL and idle timeouts are checked.
	ReapInterval time.Duration
	// MaxUploadBytes bounds one file or tar upload.
	MaxUploadBytes int64
	// MaxSessions bounds the open sessions and running processes
	// (process.go) of one sandbox, together.
	MaxSessions int
	// HostReserveMB and HostReservePids are what the host keeps of its
	// memory and pids whatever the sandboxes do: the top dsec cgroup
	// (the first level of CgroupParent, shared by every instance on the
	// host) gets the rest as its limit (0: no limit; -1: the defaults,
	// see reserve.go).
	HostReserveMB   int64
	HostReservePids int64
	// PidMax is what kernel.pid_max is raised to at start if it is lower
	// (0: left as it is): the kernel's default of 32,768 is eight
	// default sandboxes.
	PidMax int64
	// DefaultDiskMB is the disk_mb of a sandbox whose spec has none (0:
	// none; such a sandbox writes to the state filesystem). It needs
	// DiskQuota loop.
	DefaultDiskMB int64
	// MinFreeDiskMB is the state filesystem's floor: creates and file
	// writes are refused while less is free (0: no floor; -1: 2% of the
	// filesystem, 1 to 20 GiB).
	MinFreeDiskMB int64
	// MaxSessionsTotal bounds the open sessions of the whole node (slots;
	// 0: 4096).
	MaxSessionsTotal int
	// MaxStreams bounds the commands (exec, streamed or not, and fncall)
	// and port connections running on the node at once (slots; 0: 4096).
	MaxStreams int
	// OutputBufferMB bounds the output one-shot execs, session runs and
	// fncalls may buffer at once on this node (outputBudget; 0:
	// DefaultOutputBufferMB of the host's memory).
	OutputBufferMB int64
	// CmdLog bounds each sandbox's command log (zero fields: defaults).
	CmdLog CmdLogConfig
	// MaxPaused stops a sandbox that stays paused longer (0: never).
	MaxPaused time.Duration
	// SnapshotLabels, when set, restricts snapshots to sandboxes carrying
	// all these labels (builder sandboxes, say).
	SnapshotLabels map[string]string
	// UserNSBase is the first host ID of user-namespace sandboxes
	// (userns.go); 0 refuses spec.userns.
	UserNSBase uint32
	// UserNSDefault gives a sandbox whose spec leaves userns out a user
	// namespace where its backend makes one by default
	// (sandbox.UserNSDefault) and the node can (userns.go).
	UserNSDefault bool
	// DiskQuota is how disk_mb is enforced: DiskLoop (a disk per
	// sandbox) or DiskOff (disk_mb refused).
	DiskQuota string
	// PoolMax caps each warm pool (pool.go); 0 turns pools off.
	PoolMax int
	// PoolMin is the floor of each warm pool whose class was created in
	// the last PoolIdle, whatever its demand (at most PoolMax).
	PoolMin int
	// MaxSnapshotDepth is how many snapshot layers may stack under one
	// sandbox; a snapshot that would go deeper merges the chain into one
	// layer (zero: DefaultSnapshotDepth).
	MaxSnapshotDepth int
}

// Deps are the edge's collaborators.
type Deps struct {
	// Backend is the node's default backend; Others are the other
	// backends it offers, each chosen per sandbox by spec.backend (by
	// Name). A record that names no backend is the default's.
	Backend sandbox.Backend
	Others  []sandbox.Backend
	// Blobs provides layer images to mount (the layer store).
	Blobs   layer.Source
	Cgroups *cgroup.Info
	Log     *slog.Logger
	Metrics *Metrics
	// Runtime names the OCI runtime in use, and Launcher what starts
	// sandboxes ("dsec" or the runtime), for the node's info.
	Runtime, Launcher string
	// Layers builds snapshot layers (nil: snapshots unavailable).
	Layers LayerBuilder
	// Net runs sandbox networking (nil: every sandbox is loopback-only and
	// allow rules are refused).
	Net *netpolicy.Manager
}

// Edge is one node's daemon.
type Edge struct {
	cfg     Config
	deps    Deps
	log     *slog.Logger
	mounter *layer.Mounter
	metrics *Metrics
	// noDetached is set once the kernel refused a detached overlay: every
	// rootfs is then mounted on the host (see detachedRootfs).
	noDetached atomic.Bool
	// noDetachedLowers is set once the kernel refused a detached overlay
	// on detached idmapped layers (userns.go): user-namespace sandboxes
	// then get their idmapped layers mounted on the host.
	noDetachedLowers atomic.Bool
	// nodeCap is what the node's sandboxes have together (capacity).
	nodeCap api.Capacity
	// output bounds the node's buffered command output.
	output *outputBudget
	// sessions and streams bound the node's open sessions and its running
	// commands and port connections (slots.go).
	sessions, streams *slots
	// own and shared are the parent cgroups of sandboxes with a memory
	// cgroup of their own and without (cgroups.go); nil without cgroups.
	own, shared *cgroupTree

	mu        sync.RWMutex
	sandboxes map[string]*sbx
	// tally holds the counts Info reports (tally.go).
	tally *tally
	// labels indexes the sandboxes by label (labelindex.go).
	labels *labelIndex
	// tokens are the creates' tokens, under tokMu (tokens.go).
	tokMu  sync.Mutex
	tokens map[string]*tokenEntry
	// due orders the sandboxes by when the reaper next looks (due.go).
	due dueQueue
	// live counts sandboxes holding node resources (creating, running,
	// paused): what admission checks against MaxSandboxes.
	live int
	// tenancy counts them by record.Dedicated (pooled ones excluded):
	// tenancy.go.
	tenancy map[string]int
	// createSeq numbers the sandboxes handed to a project, in the order
	// they join the node's counts (Info reports the last): it starts at
	// the edge's start time in microseconds, so it grows across restarts.
	createSeq uint64

	// idmap is the user namespace idmapped layer mounts use, made on the
	// first user-namespace sandbox.
	pool *pool
	// deleteSem bounds background deletes (fncall sandboxes).
	deleteSem chan struct{}

	// owners are the host uids holding the user namespaces of listed
	// sandboxes, and ownerNext the slot the next search starts at
	// (userns.go; under mu).
	owners    map[uint32]bool
	ownerNext uint32
	idmapMu   sync.Mutex
	idmap     *os.File
	// usernsBroken says why user-namespace sandboxes cannot run here.
	usernsBroken error

	// trashKick wakes the janitor (trash.go); trashSeq names trash entries.
	trashKick chan struct{}
	trashSeq  atomic.Uint64
	// trashRetries are the trash entries that failed to go, owned by
	// emptyTrash; rmTree replaces files.RemoveAll in tests.
	trashRetries map[string]*trashRetry
	rmTree       func(string) error

	stop chan struct{}
	wg   sync.WaitGroup
}

var _ edgeapi.Edge = (*Edge)(nil)

// CheckName validates a node name (edgeapi.CheckNodeName).
func CheckName(name string) error { return edgeapi.CheckNodeName(name) }

// New validates cfg and prepares the state directory. Call Start before use.
func New(cfg Config, deps Deps) (*Edge, error) {
	if err := CheckName(cfg.Name); err != nil {
		return nil, err
	}
	switch {
	case cfg.DefaultDiskMB < 0 || cfg.DefaultDiskMB > 0 && cfg.DefaultDiskMB < sandbox.MinDiskMB:
		return nil, errdefs.Invalid("--default-disk-mb %d: want 0 (none) or at least %d", cfg.DefaultDiskMB, sandbox.MinDiskMB)
	case cfg.DefaultDiskMB > 0 && cfg.DiskQuota != DiskLoop:
		return nil, errdefs.Precondition("--default-disk-mb %d needs disks per sandbox, which this node does not make (--disk-quota %s)", cfg.DefaultDiskMB, cfg.DiskQuota)
	}
	if cfg.MaxSandboxes <= 0 {
		cfg.MaxSandboxes = 4096
	}
	if cfg.CgroupParent == "" {
		cfg.CgroupParent = "/dsec"
	}
	if cfg.StoppedRetention == 0 {
		cfg.StoppedRetention = 10 * time.Minute
	}
	if cfg.ReapInterval == 0 {
		cfg.ReapInterval = time.Second
	}
	if cfg.MaxUploadBytes == 0 {
		cfg.MaxUploadBytes = 1 << 30
	}
	if cfg.MaxSessions == 0 {
		cfg.MaxSessions = 64
	}
	if cfg.MaxSessionsTotal == 0 {
		cfg.MaxSessionsTotal = 4096
	}
	if cfg.MaxStreams == 0 {
		cfg.MaxStreams = 4096
	}
	if cfg.OutputBufferMB == 0 {
		cfg.OutputBufferMB = DefaultOutputBufferMB(uint64(hostMemTotal()))
	}
	if deps.Log == nil {
		deps.Log = slog.Default()
	}
	if deps.Metrics == nil {
		deps.Metrics = NewMetrics(nil)
	}
	if deps.Backend != nil {
		// The policy offers what the node runs.
		cfg.Policy.Backends = nil
		for _, b := range append([]sandbox.Backend{deps.Backend}, deps.Others...) {
			if slices.Contains(cfg.Policy.Backends, b.Name()) {
				return nil, fmt.Errorf("two backends named %q", b.Name())
			}
			cfg.Policy.Backends = append(cfg.Policy.Backends, b.Name())
		}
	}
	for _, d := range []string{filepath.Join(cfg.StateDir, "sandboxes"), filepath.Join(cfg.StateDir, "mnt"), filepath.Join(cfg.StateDir, "trash"), cfg.BundleDir} {
		if d == "" {
			continue
		}
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, fmt.Errorf("creating state dir: %w", err)
		}
	}
	if deps.Net != nil {
		// Every sandbox resolves through the edge's DNS proxy; the file
		// is bind-mounted read-only, so a later policy change needs no
		// remount. Without a veth the address is simply unreachable.
		rc := fmt.Sprintf("nameserver %s\noptions timeout:2 attempts:2\n", deps.Net.Nameserver())
		if err := os.WriteFile(filepath.Join(cfg.StateDir, "resolv.conf"), []byte(rc), 0o644); err != nil {
			return nil, fmt.Errorf("writing resolv.conf: %w", err)
		}
	}
	e := &Edge{createSeq: uint64(time.Now().UnixMicro()),
		cfg:          cfg,
		output:       &outputBudget{limit: cfg.OutputBufferMB << 20},
		sessions:     newSlots(cfg.MaxSessionsTotal),
		streams:      newSlots(cfg.MaxStreams),
		deps:         deps,
		log:          deps.Log.With("node", cfg.Name),
		metrics:      deps.Metrics,
		sandboxes:    map[string]*sbx{},
		tally:        newTally(),
		labels:       newLabelIndex(),
		tokens:       map[string]*tokenEntry{},
		stop:         make(chan struct{}),
		trashKick:    make(chan struct{}, 1),
		trashRetries: map[string]*trashRetry{},
		pool:         newPool(),
		deleteSem:    make(chan struct{}, 4),
	}
	e.mounter = layer.NewMounter(filepath.Join(cfg.StateDir, "mnt"), deps.Blobs, e.log)
	if err := e.newCgroupTrees(); err != nil {
		return nil, err
	}
	if cfg.UserNSBase != 0 {
		if err := prepareUserNSDirs(cfg.StateDir, cfg.UserNSBase); err != nil {
			e.usernsBroken = err
			e.log.Warn("user-namespace sandboxes unavailable", "err", err)
		}
	}
	if cfg.UserNSDefault {
		var by []string
		for _, b := range e.backends() {
			if e.userNSByDefault(b.Name()) {
				by = append(by, b.Name())
			}
		}
		e.log.Info("user namespaces by default", "backends", by)
	}
	e.nodeCap = e.capacity()
	e.metrics.bind(e)
	return e, nil
}

// Start recovers state left by a previous run, reaps leftovers and starts
// the TTL/idle reaper.
func (e *Edge) Start(ctx context.Context) error {
	if e.deps.Cgroups != nil {
		if err := e.deps.Cgroups.EnsureParent(e.cfg.CgroupParent); err != nil {
			return fmt.Errorf("preparing cgroup parent %s: %w", e.cfg.CgroupParent, err)
		}
		e.raisePidMax()
		e.reserveForHost()
		e.repairDevNull()
	}
	started := time.Now()
	if err := e.recover(ctx); err != nil {
		return fmt.Errorf("recovering sandboxes: %w", err)
	}
	var adopted []*sbx
	for _, s := range e.allSandboxes() {
		s.mu.Lock()
		if holdsResources(s.rec.Sandbox.State) {
			adopted = append(adopted, s)
		}
		s.mu.Unlock()
	}
	if err := e.ensureSharedAtStart(); err != nil {
		return err
	}
	if err := e.restoreNetwork(ctx); err != nil {
		return fmt.Errorf("recovering sandbox networks: %w", err)
	}
	e.wg.Add(4)
	go func() {
		defer e.wg.Done()
		e.reapLoop()
	}()
	go func() {
		defer e.wg.Done()
		e.diskGuard()
	}()
	go func() {
		defer e.wg.Done()
		e.sweepTemps(adopted, started)
	}()
	go func() {
		defer e.wg.Done()
		e.janitor()
	}()
	if e.cfg.PoolMax > 0 {
		e.wg.Add(1)
		go func() {
			defer e.wg.Done()
			e.poolLoop()
		}()
	}
	return nil
}

// Close stops background work and deletes pool sandboxes. Sandboxes handed
// out keep running: a restarted edge
// re-adopts them.
func (e *Edge) Close() {
	close(e.stop)
	e.wg.Wait()
	// Pool sandboxes are nobody's: they do not outlive the edge.
	e.drainAll()
	e.emptyTrash()
	e.mu.Lock()
	networked := 0
	for _, s := range e.sandboxes {
		s.closeSessions()
		s.killProcs()
		s.mu.Lock()
		if s.rec.Net != nil && holdsResources(s.rec.Sandbox.State) {
			networked++
		}
		s.mu.Unlock()
	}
	left := len(e.sandboxes)
	e.mu.Unlock()
	if e.deps.Net != nil {
		if networked == 0 {
			// No sandbox needs this instance's table and DNS address
			// any more: a stopped edge leaves none on the host.
			if err := e.deps.Net.Teardown(context.Background()); err != nil {
				e.log.Warn("removing sandbox networking from the host", "err", err)
			}
		} else {
			e.deps.Net.Close()
		}
	}
	if st, ok := e.deps.Blobs.(layer.EdgeStopper); ok {
		st.EdgeStopped()
	}
	// Free cgroup slots are nobody's either.
	for _, t := range e.cgroupTrees() {
		if t.slots != nil {
			if err := t.slots.Drain(); err != nil {
				e.log.Warn("removing free sandbox cgroups", "err", err)
			}
		}
	}
	// With nothing left to recover, the instance's parent cgroups go too:
	// a state dir that is never started again leaves no cgroup behind.
	if left == 0 {
		for _, t := range e.cgroupTrees() {
			if gone, err := e.deps.Cgroups.RemoveParent(t.parent); err != nil {
				e.log.Warn("removing the instance's cgroup", "cgroup", t.parent, "err", err)
			} else if gone && t == e.own {
				e.log.Info("removed the instance's cgroup (no sandbox left)", "cgroup", t.parent)
			}
		}
	}
}

// Name returns the node name.
func (e *Edge) Name() string { return e.cfg.Name }

func (e *Edge) sandboxDir(id string) string {
	return filepath.Join(e.cfg.StateDir, "sandboxes", id)
}

var idEncoding = base32.NewEncoding("abcdefghijklmnopqrstuvwxyz234567").WithPadding(base32.NoPadding)

func (e *Edge) newID() string {
	var b [10]byte
	_, _ = rand.Read(b[:])
	return "sb-" + e.cfg.Name + "-" + idEncoding.EncodeToString(b[:])
}

// get returns the sandbox or NotFound (also for a pooled one: it is not
// anybody's yet).
//
// A sandbox outside the scope of ctx (edgeapi.WithScope: another
// tenant's) is not found either: every call that names a sandbox looks
// it up here.
func (e *Edge) get(ctx context.Context, id string) (*sbx, error) {
	e.mu.RLock()
	s := e.sandboxes[id]
	e.mu.RUnlock()
	if s != nil {
		s.mu.Lock()
		ok := !s.pooled && edgeapi.InScope(ctx, s.rec.ProjectPath)
		s.mu.Unlock()
		if ok {
			return s, nil
		}
	}
	return nil, errdefs.NotFound("sandbox %s not found", id)
}

// begin admits one operation on a running sandbox: a paused sandbox is
// resumed first (transparently, as for exec, sessions and files); it fails
// with failed_precondition unless the sandbox is then running and not
// being stopped or deleted, and counts the operation as in flight (the
// idle reaper does not stop a sandbox while a command runs in it). Call the
// returned func when the operation ends.
func (e *Edge) begin(ctx context.Context, id string) (*sbx, func(), error) {
	return e.admit(ctx, id, true)
}

// beginNoWake is begin for calls that leave a paused sandbox paused
// (keepalive, stats).
func (e *Edge) beginNoWake(ctx context.Context, id string) (*sbx, func(), error) {
	return e.admit(ctx, id, false)
}

func (e *Edge) admit(ctx context.Context, id string, wake bool) (*sbx, func(), error) {
	s, err := e.get(ctx, id)
	if err != nil {
		return nil, nil, err
	}
	s.mu.Lock()
	state := s.rec.Sandbox.State
	s.mu.Unlock()
	if state == api.StatePaused && wake {
		if _, err := e.Resume(ctx, id); err != nil {
			return nil, nil, err
		}
	}
	s.mu.Lock()
	state, reason, going := s.rec.Sandbox.State, s.rec.Sandbox.Error, s.going
	ok := (state == api.StateRunning || state == api.StatePaused && !wake) && !going
	if ok {
		s.ops++
	}
	s.mu.Unlock()
	if !ok {
		msg := fmt.Sprintf("sandbox %s is %s", id, state)
		switch {
		case going:
			msg = fmt.Sprintf("sandbox %s is being stopped or deleted", id)
		case reason != "":
			msg += " (" + reason + ")"
		}
		return nil, nil, errdefs.Precondition("%s", msg)
	}
	s.touch()
	return s, func() {
		s.touch()
		s.mu.Lock()
		s.ops--
		s.mu.Unlock()
	}, nil
}

// Get returns one sandbox.
func (e *Edge) Get(ctx context.Context, id string) (*api.Sandbox, error) {
	s, err := e.get(ctx, id)
	if err != nil {
		return nil, err
	}
	v := s.view()
	return &v, nil
}

// List returns the sandboxes matching f, sorted by id.
func (e *Edge) List(ctx context.Context, f edgeapi.ListFilter) ([]api.Sandbox, error) {
	return e.list(ctx, f), nil
}

// list is List. It filters on the records and sorts the ids, building the
// API view of only the sandboxes it returns: a page of 100 out of 10,000
// costs no 10,000 views. A filter on labels looks only at the sandboxes
// the label index has under the least common of them (labelindex.go), and
// a filter on labels or state is applied before the sort, so that a
// selective one (a job's label; a takeover looking for the one sandbox an
// attempt made) sorts only what it keeps.
//
// Sandboxes outside the scope of ctx are left out.
func (e *Edge) list(ctx context.Context, f edgeapi.ListFilter) []api.Sandbox {
	match := func(s *sbx) bool { // s.mu held
		return !s.pooled && (f.State == "" || s.rec.Sandbox.State == f.State) && sandbox.LabelsMatch(s.rec.Sandbox.Labels, f.Labels) &&
			edgeapi.InScope(ctx, s.rec.ProjectPath)
	}
	selective := f.State != "" || len(f.Labels) > 0
	all, indexed := e.labels.candidates(f.Labels, f.After)
	if !indexed {
		e.mu.RLock()
		all = make([]entry, 0, len(e.sandboxes))
		for id, s := range e.sandboxes {
			if id > f.After {
				all = append(all, entry{id, s})
			}
		}
		e.mu.RUnlock()
	}
	if selective {
		kept := all[:0]
		for _, en := range all {
			en.s.mu.Lock()
			ok := match(en.s)
			en.s.mu.Unlock()
			if ok {
				kept = append(kept, en)
			}
		}
		all = kept
	}
	slices.SortFunc(all, func(a, b entry) int { return strings.Compare(a.id, b.id) })
	var out []api.Sandbox
	for _, en := range all {
		s := en.s
		s.mu.Lock()
		ok := match(s) // again: it may have changed since
		var v api.Sandbox
		if ok {
			v = s.viewLocked()
		}
		s.mu.Unlock()
		if !ok {
			continue
		}
		out = append(out, v)
		if f.Limit > 0 && len(out) >= f.Limit {
			break
		}
	}
	if out == nil {
		out = []api.Sandbox{}
	}
	return out
}

// countsByBackend counts the sandboxes that are not pooled by backend and
// state (a record naming no backend is the default's), from the node's
// counts kept as sandboxes change (tally.go).
func (e *Edge) countsByBackend() map[[2]string]int {
	c := e.tally.byBackendState()
	def := ""
	if e.deps.Backend != nil {
		def = e.deps.Backend.Name()
	}
	for k, v := range c {
		if k[0] == "" {
			delete(c, k)
			c[[2]string{def, k[1]}] += v
		}
	}
	return c
}

// Info describes the node for the watcher: counts by state, live
// sandboxes by backend and by job label, and the layers mounted. It walks
// every sandbox; the watcher asks about once a second.
func (e *Edge) Info(ctx context.Context) (api.Node, error) {
	n := api.Node{
		Name:     e.cfg.Name,
		Healthy:  true,
		Backends: slices.Clone(e.cfg.Policy.Backends),
		Runtime:  e.deps.Runtime,
		Launcher: e.deps.Launcher,
		Capacity: e.nodeCap,
		Labels:   e.cfg.Labels,
	}
	if e.deps.Cgroups != nil {
		n.CgroupMode = e.deps.Cgroups.Mode.String()
	}
	e.tally.fill(&n)
	e.mu.RLock()
	n.DedicatedTo = e.dedicatedToLocked()
	n.CreateSeq = e.createSeq
	e.mu.RUnlock()
	for d := range e.mounter.Refs() {
		n.Layers = append(n.Layers, d)
	}
	slices.Sort(n.Layers)
	return n, nil
}

// LayerUsers returns how many sandboxes of this node use the layer digest.
func (e *Edge) LayerUsers(ctx context.Context, digest string) (int, error) {
	e.mu.RLock()
	defer e.mu.RUnlock()
	n := 0
	for _, s := range e.sandboxes {
		s.mu.Lock()
		for _, d := range s.rec.Digests {
			if d == digest && holdsResources(s.rec.Sandbox.State) && !s.pooled {
				n++
				break
			}
		}
		s.mu.Unlock()
	}
	return n, nil
}

// Keepalive extends a sandbox's lifetime to ttl seconds from now (the
// spec's ttl when ttl is 0).
func (e *Edge) Keepalive(ctx context.Context, id string, ttl int64) (*api.Sandbox, error) {
	if ttl < 0 || ttl > e.cfg.Policy.MaxTTL {
		return nil, errdefs.Invalid("ttl must be between 0 and %d seconds, got %d", e.cfg.Policy.MaxTTL, ttl)
	}
	s, done, err := e.beginNoWake(ctx, id)
	if err != nil {
		return nil, err
	}
	defer done()
	s.mu.Lock()
	if ttl == 0 {
		ttl = s.rec.Sandbox.Spec.TTL
	}
	exp := time.Now().Add(time.Duration(ttl) * time.Second).UTC()
	s.rec.Sandbox.ExpiresAt = &exp
	e.scheduleLocked(s)
	err = s.persistLocked()
	v := s.viewLocked()
	s.mu.Unlock()
	if err != nil {
		return nil, err
	}
	return &v, nil
}

// Stats returns a sandbox's resource use.
func (e *Edge) Stats(ctx context.Context, id string) (*api.Stats, error) {
	s, done, err := e.beginNoWake(ctx, id)
	if err != nil {
		return nil, err
	}
	defer done()
	var st api.Stats
	if e.deps.Cgroups != nil {
		cs, err := e.deps.Cgroups.Stats(s.rec.CgroupPath)
		if err != nil {
			return nil, fmt.Errorf("reading cgroup stats: %w", err)
		}
		// A reused cgroup counted its earlier sandboxes' CPU time too.
		cs.CPUUsageNS -= min(cs.CPUUsageNS, s.rec.CgroupCPUBase)
		st.CPUUsageNS, st.MemoryBytes, st.MemoryMaxBytes, st.Pids = cs.CPUUsageNS, cs.MemoryBytes, cs.MemoryLimitBytes, cs.Pids
		st.MemorySource = "cgroup"
		if cs.MemoryFromRSS {
			st.MemorySource = "rss"
		}
	}
	s.mu.Lock()
	disk := s.rec.Disk
	s.mu.Unlock()
	if disk {
		u, err := quota.DiskUsage(filepath.Join(s.dir, "vol"))
		if err != nil {
			return nil, err
		}
		st.DiskBytes, st.DiskLimitBytes, st.Inodes, st.InodeLimit = u.Bytes, u.ByteLimit, u.Inodes, u.InodeLimit
	} else {
		st.DiskBytes = dirSize(s.upperDir())
	}
	return &st, nil
}

// dirSize sums the sizes of the regular files under dir without following
// symlinks.
func dirSize(dir string) uint64 {
	var n uint64
	_ = filepath.WalkDir(dir, func(_ string, d os.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		if info, err := d.Info(); err == nil && info.Mode().IsRegular() {
			n += uint64(info.Size())
		}
		return nil
	})
	return n
}

// activity clock shared by sandboxes; unix nanos.
type clock struct{ v atomic.Int64 }

func (c *clock) set(t time.Time) { c.v.Store(t.UnixNano()) }
func (c *clock) get() time.Time  { return time.Unix(0, c.v.Load()) }

// runAll runs every fn, n at a time, and waits for them.
func runAll(fns []func(), n int) {
	sem := make(chan struct{}, n)
	var wg sync.WaitGroup
	for _, fn := range fns {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			fn()
		}()
	}
	wg.Wait()
}
