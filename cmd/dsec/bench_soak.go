package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"os/signal"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edge/host"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

// `dsec bench soak` creates, uses and deletes sandboxes in a loop, with an
// adversarial workload (an output flood, a fork bomb, a deep directory
// tree, a disk fill, a memory hog, a session left open) instead of every
// --adversarial-every-th use, and then checks that the host is back where
// it was before the loop: mounts, cgroups, loop devices, veths, nftables
// objects, the trash, the daemon's fds, goroutines, sessions and RSS, and
// the state dir's disk usage. Each adversarial cycle also records whether
// the sandbox contained it.

// Limits of the adversarial sandboxes and sizes of their workloads. Each
// workload ends in seconds whatever the sandbox does, and none can reach
// the host beyond the sandbox's limits.
const (
	soakPids        = 64          // spec.pids of the fork bomb
	soakForks       = 1000        // background processes the fork bomb tries
	soakDiskMB      = 64          // spec.disk_mb of the disk fill
	soakFillMB      = 256         // what the disk fill tries to write
	soakMemoryMB    = 64          // spec.memory_mb of the memory hog
	soakHogBytes    = 300_000_000 // what the memory hog tries to hold
	soakFloodBytes  = 200_000_000 // what the flood prints
	soakFloodCap    = 64 << 10    // its max_output_bytes
	soakTreeDepth   = 3000        // levels of the deep tree
	soakUsePayload  = 4 << 10     // bytes a use writes and reads back
	soakSandboxTTL  = 900         // seconds: a soak killed half-way leaves nothing for long
	soakAllow       = "192.0.2.1/32"
	soakSettleMax   = 60 * time.Second
	soakSettlePoll  = 2 * time.Second
	soakDeleteGrace = 15 * time.Second // a session's running command must end this soon after the delete
)

// Slack of the comparison with the baseline. The daemon's RSS and the
// state dir's usage move for reasons that are not leaks (the Go heap's
// high-water mark, the store's pages and the audit log), so they get a
// margin; every count must be back exactly (fewer is fine).
const (
	soakRSSSlack       = 32 << 20 // or soakRSSSlackPct of the baseline, the larger
	soakRSSSlackPct    = 20
	soakDiskSlack      = 64 << 20 // or soakDiskSlackPct of the baseline, the larger
	soakDiskSlackPct   = 10
	soakGoroutineSlack = 20 // plus two per connection of the bench's more than before
)

// soakKind is a cycle's workload.
type soakKind int

const (
	soakUse    soakKind = iota // create, exec, write and read a file, delete
	soakUseNet                 // the same with an egress policy (a veth, nft sets)
	soakFlood
	soakForkBomb
	soakDeepTree
	soakDiskFill
	soakMemHog
	soakOpenSession
	soakKinds // the number of kinds
)

// soakAdversarial are the adversarial workloads, in the order they take
// turns.
var soakAdversarial = []soakKind{soakFlood, soakForkBomb, soakDeepTree, soakDiskFill, soakMemHog, soakOpenSession}

func (k soakKind) String() string {
	switch k {
	case soakUse:
		return "use"
	case soakUseNet:
		return "use, networked"
	case soakFlood:
		return "output flood"
	case soakForkBomb:
		return "fork bomb"
	case soakDeepTree:
		return "deep tree"
	case soakDiskFill:
		return "disk fill"
	case soakMemHog:
		return "memory hog"
	case soakOpenSession:
		return "session open at delete"
	}
	return fmt.Sprintf("kind %d", int(k))
}

// soakWorkload is what cycle i (from 0) runs: every every-th cycle the
// next adversarial workload in turn (none when every is 0), the others a
// use, every other one networked when net is set.
func soakWorkload(i, every int, net bool) soakKind {
	if every > 0 && (i+1)%every == 0 {
		return soakAdversarial[((i+1)/every-1)%len(soakAdversarial)]
	}
	if net && i%2 == 1 {
		return soakUseNet
	}
	return soakUse
}

// soakSpec is the spec of a sandbox for k.
func soakSpec(k soakKind, ref, label string) api.SandboxSpec {
	spec := api.SandboxSpec{Base: ref, TTL: soakSandboxTTL, Labels: map[string]string{"bench": label}}
	switch k {
	case soakUseNet:
		spec.Network = &api.NetworkPolicy{Allow: []string{soakAllow}}
	case soakForkBomb:
		spec.Pids = soakPids
	case soakDiskFill:
		spec.DiskMB = soakDiskMB
	case soakMemHog:
		spec.MemoryMB = soakMemoryMB
	}
	return spec
}

type soakOpts struct {
	cycles, concurrency, every int
	base, stateDir             string
	jsonOut                    bool
}

// soakOutcome is what the adversarial cycles of one kind did.
type soakOutcome struct {
	Kind       string `json:"kind"`
	Runs       int    `json:"runs"`
	Contained  int    `json:"contained"`
	Violations int    `json:"violations"`
	// Failed are the runs that could not be judged: the workload or a
	// call around it failed (counted in the failures too).
	Failed int `json:"failed"`
	// Last is the last contained run, FirstViolation the first one that
	// was not, in words.
	Last           string `json:"last,omitempty"`
	FirstViolation string `json:"first_violation,omitempty"`
}

// soakReport is the summary of `bench soak` in JSON.
type soakReport struct {
	Cycles           int     `json:"cycles"`
	CyclesRun        int     `json:"cycles_run"`
	Concurrency      int     `json:"concurrency"`
	AdversarialEvery int     `json:"adversarial_every"`
	WallSeconds      float64 `json:"wall_seconds"`
	PerSec           float64 `json:"cycles_per_sec"`
	// Networked: every other use has an egress policy (the node has
	// sandbox networking).
	Networked bool `json:"networked"`
	// Failures are failed calls by stage (create, exec, write, read,
	// delete, and the adversarial workloads by kind).
	Failures     map[string]int    `json:"failures"`
	FirstFailure map[string]string `json:"first_failure,omitempty"`
	Adversarial  []soakOutcome     `json:"adversarial"`
	Violations   int               `json:"violations"`
	// Held is how many sandboxes the node held (warm pools, other
	// clients) at the baseline and after; PerHeld what one costs the
	// daemon, measured in the warm-up.
	Held     [2]int      `json:"held_sandboxes_before_after"`
	PerHeld  soakPer     `json:"per_held_sandbox"`
	Readings []soakCheck `json:"readings"`
	// DiskGrowth is where the state dir grew, by directory.
	DiskGrowth map[string]int64 `json:"disk_growth_bytes,omitempty"`
	Leaks      []string         `json:"leaks,omitempty"`
	OK         bool             `json:"ok"`
}

func runBenchSoak(args []string) error {
	var o soakOpts
	f := newCmdFlags("bench soak", "[flags]",
		"Soak: create, use and delete sandboxes in a loop with adversarial workloads mixed in\n"+
			"(output flood, fork bomb, deep tree, disk fill, memory hog, session open at delete), then\n"+
			"check that mounts, cgroups, loop devices, veths, nft objects, the daemon's fds, goroutines\n"+
			"and RSS and the state dir's usage are back to the baseline. Run it as root on the\n"+
			"daemon's host (it reads /proc, /sys and the state dir there). Exits non-zero on a leak\n"+
			"or a containment violation.")
	f.IntVar(&o.cycles, "cycles", 10000, "create → use → delete cycles")
	f.IntVar(&o.concurrency, "concurrency", 8, "cycles in flight at once")
	f.IntVar(&o.every, "adversarial-every", 10, "every N-th cycle is an adversarial workload, each kind in turn (0 = none)")
	f.StringVar(&o.stateDir, "state-dir", "/var/lib/dsec", "the daemon's state dir")
	f.StringVar(&o.base, "base", "", "base layer ref to use (default: build base/bench:busybox from the host's busybox)")
	f.BoolVar(&o.jsonOut, "json", false, "print JSON instead of a table")
	if _, err := f.parseN(args, 0, 0); err != nil {
		return err
	}
	if o.cycles < 1 || o.concurrency < 1 || o.concurrency > 1024 || o.every < 0 {
		return errors.New("bench soak: --cycles must be ≥ 1, --concurrency between 1 and 1024, --adversarial-every ≥ 0")
	}
	if os.Geteuid() != 0 {
		return errors.New("bench soak: needs root: it reads the daemon's cgroups, loop devices, nftables table and state dir")
	}
	abs, err := filepath.Abs(o.stateDir)
	if err != nil {
		return err
	}
	o.stateDir = abs
	edgeDir := filepath.Join(o.stateDir, "edge")
	if _, err := os.Stat(filepath.Join(edgeDir, "sandboxes")); err != nil {
		return fmt.Errorf("bench soak: %s is not a daemon's state dir (no edge/sandboxes): pass the daemon's --state-dir", o.stateDir)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	c, err := newClient()
	if err != nil {
		return err
	}
	_, node, err := benchNode(ctx, c)
	if err != nil {
		return err
	}
	ref, _, err := benchBase(ctx, c, o.base)
	if err != nil {
		return err
	}
	s := &soakRun{
		c: c, o: o, ref: ref, label: fmt.Sprintf("bench-soak-%d", time.Now().UnixNano()),
		probe: &soakProbe{
			c: c, stateDir: o.stateDir, edgeDir: edgeDir,
			parent: host.CgroupParent(node.Name, o.stateDir), instance: host.InstanceID(o.stateDir),
			ours: map[string]bool{},
		},
		durs: map[soakKind][]time.Duration{}, runs: map[soakKind]int{}, kindFails: map[soakKind]int{},
		fails: map[string]int{}, firstFail: map[string]string{}, outcomes: map[soakKind]*soakOutcome{},
	}
	defer func() {
		// Whatever happened, nothing of the soak's stays behind.
		_, _ = c.DeleteSandboxes(context.Background(), map[string]string{"bench": s.label})
	}()
	rep, rows, err := s.run(ctx)
	if err != nil {
		return fmt.Errorf("bench soak: %w", err)
	}
	if err := printBenchSummary(rows, rep, soakLines(rep), o.jsonOut); err != nil {
		return err
	}
	if !rep.OK {
		return fmt.Errorf("bench soak: %d leaks, %d containment violations", len(rep.Leaks), rep.Violations)
	}
	return nil
}

// soakRun is one soak.
type soakRun struct {
	c     *dsec.Client
	o     soakOpts
	ref   string
	label string
	net   bool // the node has sandbox networking
	probe *soakProbe

	done, failed, violated atomic.Int64

	mu        sync.Mutex
	durs      map[soakKind][]time.Duration // cycles that went through
	runs      map[soakKind]int
	kindFails map[soakKind]int
	fails     map[string]int // by stage
	firstFail map[string]string
	outcomes  map[soakKind]*soakOutcome
}

func (s *soakRun) run(ctx context.Context) (soakReport, []benchRow, error) {
	rep := soakReport{Cycles: s.o.cycles, Concurrency: s.o.concurrency, AdversarialEvery: s.o.every}
	// Does the node have sandbox networking? A networked create says.
	sb, err := s.c.CreateSandbox(ctx, soakSpec(soakUseNet, s.ref, s.label))
	switch {
	case err == nil:
		s.net = true
		s.probe.addOurs(sb.ID)
		if err := s.c.DeleteSandbox(context.Background(), sb.ID); err != nil {
			return rep, nil, fmt.Errorf("deleting the network probe: %w", err)
		}
	case errors.Is(err, dsec.ErrPrecondition):
		fmt.Fprintf(os.Stderr, "dsec: the node has no sandbox networking (%v): uses without veths\n", err)
	default:
		return rep, nil, fmt.Errorf("creating a sandbox: %w", err)
	}
	rep.Networked = s.net

	per, before, err := s.warmUp(ctx)
	if err != nil {
		return rep, nil, err
	}
	rep.PerHeld = per
	if before.err != nil {
		return rep, nil, fmt.Errorf("reading the host: %w", before.err)
	}

	fmt.Fprintf(os.Stderr, "dsec: %d cycles, %d at a time, every %d-th adversarial...\n", s.o.cycles, s.o.concurrency, s.o.every)
	stopProgress := s.progress()
	start := time.Now()
	_, _, _, _ = runParallel(s.o.cycles, s.o.concurrency, func(i int) error {
		s.cycle(ctx, i)
		return nil
	})
	wall := time.Since(start)
	stopProgress()
	if err := ctx.Err(); err != nil {
		return rep, nil, err
	}
	rep.CyclesRun = int(s.done.Load())
	rep.WallSeconds = wall.Seconds()
	rep.PerSec = float64(rep.CyclesRun) / wall.Seconds()

	fmt.Fprintf(os.Stderr, "dsec: waiting up to %s for the cleanup to settle...\n", soakSettleMax)
	after, checks := s.probe.back(ctx, before, per, s.label)
	if err := ctx.Err(); err != nil {
		return rep, nil, err
	}
	if after.err != nil {
		return rep, nil, fmt.Errorf("reading the host: %w", after.err)
	}
	rep.Held = [2]int{before.held, after.held}
	rep.Readings = checks
	rep.DiskGrowth = diskGrowth(before.diskByDir, after.diskByDir)
	for _, c := range checks {
		if !c.OK {
			rep.Leaks = append(rep.Leaks, c.String())
		}
	}

	s.mu.Lock()
	defer s.mu.Unlock()
	rep.Failures, rep.FirstFailure = s.fails, s.firstFail
	for _, k := range soakAdversarial {
		if o := s.outcomes[k]; o != nil {
			rep.Adversarial = append(rep.Adversarial, *o)
			rep.Violations += o.Violations
		}
	}
	rep.OK = len(rep.Leaks) == 0 && rep.Violations == 0
	var rows []benchRow
	for k := soakKind(0); k < soakKinds; k++ {
		if s.runs[k] == 0 {
			continue
		}
		r := row(k.String(), s.runs[k], s.o.concurrency, s.durs[k], s.kindFails[k], wall)
		rows = append(rows, r)
	}
	return rep, rows, nil
}

// warmUp creates and deletes 2×concurrency sandboxes of the uses' specs and
// one of each adversarial spec, so that the node's recycled cgroups, netns
// pool and warm pools are at the state the loop keeps them in, and
// measures what a sandbox held costs the daemon (fds, goroutines, RSS):
// the baseline and the end may find different numbers of sandboxes in the
// node's warm pools. It returns that and the baseline, read once the host
// has settled after the deletes.
func (s *soakRun) warmUp(ctx context.Context) (soakPer, soakSample, error) {
	var kinds []soakKind
	for i := range 2 * s.o.concurrency {
		kinds = append(kinds, soakWorkload(i, 0, s.net))
	}
	kinds = append(kinds, soakForkBomb, soakDiskFill, soakMemHog)
	fmt.Fprintf(os.Stderr, "dsec: warm-up: %d sandboxes...\n", len(kinds))
	ids := make([]string, len(kinds))
	_, fails, _, ferr := runParallel(len(kinds), s.o.concurrency, func(i int) error {
		sb, err := s.c.CreateSandbox(ctx, soakSpec(kinds[i], s.ref, s.label))
		if err != nil {
			return err
		}
		s.probe.addOurs(sb.ID)
		ids[i] = sb.ID
		return nil
	})
	if ctx.Err() != nil {
		return soakPer{}, soakSample{}, ctx.Err()
	}
	if fails > 0 {
		return soakPer{}, soakSample{}, fmt.Errorf("warm-up: %d of %d creates failed, first: %w", fails, len(kinds), ferr)
	}
	if err := settle(ctx); err != nil {
		return soakPer{}, soakSample{}, err
	}
	alive := s.probe.read(ctx)
	_, dfails, _, derr := runParallel(len(ids), s.o.concurrency, func(i int) error {
		return s.c.DeleteSandbox(context.Background(), ids[i])
	})
	if dfails > 0 {
		return soakPer{}, soakSample{}, fmt.Errorf("warm-up: %d deletes failed, first: %w", dfails, derr)
	}
	fmt.Fprintf(os.Stderr, "dsec: waiting for the host to settle before the baseline...\n")
	gone, err := s.probe.settled(ctx)
	if err != nil {
		return soakPer{}, soakSample{}, err
	}
	return perHeld(alive, gone, len(ids)), gone, nil
}

// perHeld is what one sandbox the node holds costs the daemon: the
// difference between a reading with n of the bench's sandboxes alive
// and one after they are gone, over the difference in sandboxes held.
func perHeld(alive, gone soakSample, n int) soakPer {
	d := float64(alive.held + n - gone.held)
	if d <= 0 || alive.host.metrics == nil || gone.host.metrics == nil {
		return soakPer{}
	}
	fa, _ := daemonFDs(alive.host)
	fg, _ := daemonFDs(gone.host)
	ma, mg := alive.host.metrics, gone.host.metrics
	return soakPer{
		FDs:        max(0, (fa-fg)/d),
		Goroutines: max(0, (ma["go_goroutines"]-mg["go_goroutines"])/d),
		RSSBytes:   max(0, (ma["process_resident_memory_bytes"]-mg["process_resident_memory_bytes"])/d),
	}
}

// progress reports cycles, rate, failures and violations on stderr every
// few seconds until the returned function is called.
func (s *soakRun) progress() func() {
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		start := time.Now()
		t := time.NewTicker(densityProgressEvery)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-t.C:
				n := s.done.Load()
				fmt.Fprintf(os.Stderr, "dsec: soak: %d/%d cycles (%.1f/s), %d failures, %d containment violations\n",
					n, s.o.cycles, float64(n)/time.Since(start).Seconds(), s.failed.Load(), s.violated.Load())
			}
		}
	}()
	return func() { close(stop); wg.Wait() }
}

// stageError is a failed call of a cycle, by stage.
type stageError struct {
	stage string
	err   error
}

func (e *stageError) Error() string { return e.stage + ": " + e.err.Error() }
func (e *stageError) Unwrap() error { return e.err }

func staged(stage string, err error) error {
	if err == nil {
		return nil
	}
	return &stageError{stage, err}
}

// cycle runs cycle i: a sandbox created, used (or attacked) and deleted.
func (s *soakRun) cycle(ctx context.Context, i int) {
	if ctx.Err() != nil {
		return
	}
	k := soakWorkload(i, s.o.every, s.net)
	t0 := time.Now()
	sb, err := s.c.CreateSandbox(ctx, soakSpec(k, s.ref, s.label))
	if err != nil {
		s.record(ctx, k, t0, staged("create", err), nil)
		return
	}
	s.probe.addOurs(sb.ID)
	var once sync.Once
	var delErr error
	del := func() error {
		once.Do(func() { delErr = s.c.DeleteSandbox(context.Background(), sb.ID) })
		return delErr
	}
	var v *soakVerdict
	if k == soakUse || k == soakUseNet {
		err = s.use(ctx, sb.ID, i)
	} else {
		v, err = s.attack(ctx, k, sb.ID, del)
	}
	if derr := del(); derr != nil {
		if v != nil {
			// An attacked sandbox that cannot be deleted is not contained.
			v = &soakVerdict{false, "delete failed after the workload: " + derr.Error()}
		} else if err == nil {
			err = staged("delete", derr)
		}
	}
	s.record(ctx, k, t0, err, v)
}

// soakVerdict is whether an adversarial workload was contained, and what
// happened, in words.
type soakVerdict struct {
	contained bool
	detail    string
}

// record counts a cycle: its duration when it went through, its failure
// by stage, the verdict of an adversarial one. A cycle cut short by the
// bench's own stop counts as nothing.
func (s *soakRun) record(ctx context.Context, k soakKind, t0 time.Time, err error, v *soakVerdict) {
	if ctx.Err() != nil {
		return
	}
	d := time.Since(t0)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.done.Add(1)
	s.runs[k]++
	var o *soakOutcome
	if k != soakUse && k != soakUseNet {
		if o = s.outcomes[k]; o == nil {
			o = &soakOutcome{Kind: k.String()}
			s.outcomes[k] = o
		}
		o.Runs++
	}
	if err != nil {
		stage := k.String()
		var se *stageError
		if errors.As(err, &se) && (k == soakUse || k == soakUseNet || se.stage == "create") {
			stage = se.stage
		}
		s.fails[stage]++
		if _, ok := s.firstFail[stage]; !ok {
			s.firstFail[stage] = clipText(err.Error(), 300)
		}
		s.kindFails[k]++
		s.failed.Add(1)
		if o != nil {
			o.Failed++
		}
		return
	}
	s.durs[k] = append(s.durs[k], d)
	if o == nil || v == nil {
		return
	}
	if v.contained {
		o.Contained++
		o.Last = v.detail
		return
	}
	o.Violations++
	s.violated.Add(1)
	if o.FirstViolation == "" {
		o.FirstViolation = v.detail
	}
}

func clipText(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

// soakPayload is what use i writes and reads back.
func soakPayload(i int) []byte {
	b := make([]byte, soakUsePayload)
	x := uint32(i)*2654435761 + 1
	for j := range b {
		x ^= x << 13
		x ^= x >> 17
		x ^= x << 5
		b[j] = byte(x)
	}
	return b
}

// use runs a command, writes a file and reads it back.
func (s *soakRun) use(ctx context.Context, id string, i int) error {
	want := fmt.Sprintf("soak-%d", i)
	r, err := s.c.Exec(ctx, id, api.ExecRequest{Cmd: "echo " + want, Timeout: 30})
	if err != nil {
		return staged("exec", err)
	}
	if r.ExitCode != 0 || strings.TrimSpace(r.Stdout) != want {
		return staged("exec", fmt.Errorf("exit %d, stdout %q, stderr %q", r.ExitCode, clipText(r.Stdout, 80), clipText(r.Stderr, 200)))
	}
	data := soakPayload(i)
	if err := s.c.WriteFile(ctx, id, "/root/soak.bin", bytes.NewReader(data), 0o644); err != nil {
		return staged("write", err)
	}
	got, err := s.c.ReadFile(ctx, id, "/root/soak.bin")
	if err != nil {
		return staged("read", err)
	}
	if !bytes.Equal(got, data) {
		return staged("read", fmt.Errorf("read back %d bytes that differ from the %d written", len(got), len(data)))
	}
	return nil
}

// attack runs adversarial workload k in sandbox id and judges it. del
// deletes the sandbox (once; later calls return the first answer). An
// error means the workload could not be run or judged.
func (s *soakRun) attack(ctx context.Context, k soakKind, id string, del func() error) (*soakVerdict, error) {
	switch k {
	case soakFlood:
		return s.flood(ctx, id)
	case soakForkBomb:
		return s.forkBomb(ctx, id)
	case soakDeepTree:
		return s.deepTree(ctx, id, del)
	case soakDiskFill:
		return s.diskFill(ctx, id)
	case soakMemHog:
		return s.memHog(ctx, id)
	case soakOpenSession:
		return s.openSession(ctx, id, del)
	}
	return nil, fmt.Errorf("no workload %v", k)
}

// answers reports whether the sandbox still runs a command.
func (s *soakRun) answers(ctx context.Context, id string) error {
	r, err := s.c.Exec(ctx, id, api.ExecRequest{Cmd: "echo ok", Timeout: 30})
	if err != nil {
		return err
	}
	if r.ExitCode != 0 || strings.TrimSpace(r.Stdout) != "ok" {
		return fmt.Errorf("exit %d, stdout %q, stderr %q", r.ExitCode, clipText(r.Stdout, 80), clipText(r.Stderr, 200))
	}
	return nil
}

// flood prints far more than max_output_bytes: the answer must be capped
// and truncated, and the sandbox still answer.
func (s *soakRun) flood(ctx context.Context, id string) (*soakVerdict, error) {
	r, err := s.c.Exec(ctx, id, api.ExecRequest{Cmd: fmt.Sprintf("yes | head -c %d", soakFloodBytes), MaxOutputBytes: soakFloodCap, Timeout: 60})
	if err != nil {
		return nil, err
	}
	n := len(dsec.OutputBytes(r.Stdout, r.StdoutB64))
	detail := fmt.Sprintf("%d of %d bytes returned (max_output_bytes %d), truncated %v, %d ms", n, soakFloodBytes, soakFloodCap, r.Truncated, r.DurationMS)
	if !r.Truncated || n > soakFloodCap {
		return &soakVerdict{false, detail}, nil
	}
	if err := s.answers(ctx, id); err != nil {
		return &soakVerdict{false, detail + "; then the sandbox did not answer: " + err.Error()}, nil
	}
	return &soakVerdict{true, detail}, nil
}

// forkBomb starts background sleeps until fork fails: the sandbox's pids
// limit must stop it, and the exec must end.
func (s *soakRun) forkBomb(ctx context.Context, id string) (*soakVerdict, error) {
	cmd := fmt.Sprintf(`i=0; while [ $i -lt %d ]; do sleep 30 >/dev/null 2>&1 & i=$((i+1)); echo $i > /tmp/forks; done`, soakForks)
	r, err := s.c.Exec(ctx, id, api.ExecRequest{Cmd: cmd, Timeout: 20, MaxOutputBytes: 4096})
	if err != nil {
		return nil, err
	}
	// Neither the files API nor stats needs a process in the sandbox.
	b, err := s.c.ReadFile(ctx, id, "/tmp/forks")
	if err != nil {
		return nil, fmt.Errorf("reading the fork count: %w", err)
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return nil, fmt.Errorf("fork count %q: %w", clipText(string(b), 40), err)
	}
	st, err := s.c.Stats(ctx, id)
	if err != nil {
		return nil, fmt.Errorf("stats: %w", err)
	}
	detail := fmt.Sprintf("%d of %d background processes started (pids %d), %d pids in the sandbox after, exit %d, timed out %v",
		n, soakForks, soakPids, st.Pids, r.ExitCode, r.TimedOut)
	return &soakVerdict{n < soakPids && st.Pids <= soakPids, detail}, nil
}

// deepTree makes a directory tree soakTreeDepth levels deep, far beyond
// PATH_MAX; the delete must remove it. No path the shell uses may be
// longer than PATH_MAX (its cd goes by the whole path), so the tree grows
// from the top: each round makes 100 new levels and moves the tree so far
// under them.
func (s *soakRun) deepTree(ctx context.Context, id string, del func() error) (*soakVerdict, error) {
	cmd := fmt.Sprintf(`cd /tmp && c=d && j=1 && while [ $j -lt 100 ]; do c=$c/d; j=$((j+1)); done; `+
		`mkdir -p t/$c && n=100 && while [ $n -lt %d ]; do mkdir -p u/$c && mv t/d u/$c/ && rmdir t && mv u t || break; n=$((n+100)); done; echo $n`, soakTreeDepth)
	r, err := s.c.Exec(ctx, id, api.ExecRequest{Cmd: cmd, Timeout: 120, MaxOutputBytes: 4096})
	if err != nil {
		return nil, err
	}
	depth, _ := strconv.Atoi(strings.TrimSpace(r.Stdout))
	if depth < soakTreeDepth {
		return nil, fmt.Errorf("built %d levels of %d: exit %d, stderr %q", depth, soakTreeDepth, r.ExitCode, clipText(r.Stderr, 200))
	}
	t0 := time.Now()
	if err := del(); err != nil {
		return &soakVerdict{false, fmt.Sprintf("delete of a tree %d levels deep failed: %v", depth, err)}, nil
	}
	dd := time.Since(t0)
	// The directory goes to the edge's trash at once; its removal is
	// checked with the trash at the end.
	if _, err := os.Stat(filepath.Join(s.probe.edgeDir, "sandboxes", id)); err == nil {
		return &soakVerdict{false, fmt.Sprintf("%d levels: the sandbox's directory is still there after the delete", depth)}, nil
	}
	return &soakVerdict{true, fmt.Sprintf("%d levels, delete %d ms", depth, dd.Milliseconds())}, nil
}

// diskFill writes until the sandbox's disk (disk_mb) is full: the write
// must fail near the limit, and the sandbox still answer.
func (s *soakRun) diskFill(ctx context.Context, id string) (*soakVerdict, error) {
	cmd := fmt.Sprintf(`dd if=/dev/zero of=/root/fill bs=1M count=%d 2>/dev/null; echo $?`, soakFillMB)
	r, err := s.c.Exec(ctx, id, api.ExecRequest{Cmd: cmd, Timeout: 60, MaxOutputBytes: 4096})
	if err != nil {
		return nil, err
	}
	rc := strings.TrimSpace(r.Stdout)
	fe, err := s.c.StatFile(ctx, id, "/root/fill")
	if err != nil {
		return nil, fmt.Errorf("stat of the fill: %w", err)
	}
	detail := fmt.Sprintf("wrote %s of %d MiB before the disk was full (disk_mb %d), dd exit %s", humanBytes(fe.Size), soakFillMB, soakDiskMB, rc)
	if st, err := s.c.Stats(ctx, id); err == nil && st.DiskLimitBytes > 0 {
		detail += fmt.Sprintf(", disk %s of %s", humanBytes(int64(st.DiskBytes)), humanBytes(int64(st.DiskLimitBytes)))
	}
	if rc == "0" || fe.Size > soakDiskMB<<20 {
		return &soakVerdict{false, detail}, nil
	}
	if err := s.answers(ctx, id); err != nil {
		return &soakVerdict{false, detail + "; then the sandbox did not answer: " + err.Error()}, nil
	}
	return &soakVerdict{true, detail}, nil
}

// memHog holds more memory than memory_mb (tail keeps a line with no end
// in memory): the kernel must kill it inside the sandbox.
func (s *soakRun) memHog(ctx context.Context, id string) (*soakVerdict, error) {
	cmd := fmt.Sprintf(`head -c %d /dev/zero | tail >/dev/null; echo $?`, soakHogBytes)
	r, err := s.c.Exec(ctx, id, api.ExecRequest{Cmd: cmd, Timeout: 60, MaxOutputBytes: 4096})
	if err != nil {
		return nil, err
	}
	rc := strings.TrimSpace(r.Stdout)
	if rc == "" {
		rc = strconv.Itoa(r.ExitCode) // the shell went with it
	}
	detail := fmt.Sprintf("exit %s (memory_mb %d, %d bytes asked), timed out %v", rc, soakMemoryMB, soakHogBytes, r.TimedOut)
	if st, err := s.c.Stats(ctx, id); err == nil {
		detail += fmt.Sprintf(", memory %s of %s after", humanBytes(int64(st.MemoryBytes)), humanBytes(int64(st.MemoryMaxBytes)))
	}
	// 137: killed by SIGKILL, which is what the OOM killer sends.
	return &soakVerdict{rc == "137" && !r.TimedOut, detail}, nil
}

// openSession leaves a session open, with a command running in it, when
// the sandbox is deleted: the delete must go through, the running command
// return, and the session be gone.
func (s *soakRun) openSession(ctx context.Context, id string, del func() error) (*soakVerdict, error) {
	sid, err := s.c.CreateSession(ctx, id, api.SessionRequest{})
	if err != nil {
		return nil, fmt.Errorf("opening a session: %w", err)
	}
	r, err := s.c.SessionRun(ctx, id, sid, api.SessionRunRequest{Command: "sleep 600 >/dev/null 2>&1 & cd /tmp && echo ready", Timeout: 30})
	if err != nil {
		return nil, fmt.Errorf("session run: %w", err)
	}
	if strings.TrimSpace(r.Stdout) != "ready" {
		return nil, fmt.Errorf("session run: exit %d, stdout %q", r.ExitCode, clipText(r.Stdout, 80))
	}
	runCtx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	running := make(chan error, 1)
	go func() {
		_, err := s.c.SessionRun(runCtx, id, sid, api.SessionRunRequest{Command: "sleep 60", Timeout: 90})
		running <- err
	}()
	select {
	case <-time.After(300 * time.Millisecond): // the command is running
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	t0 := time.Now()
	if err := del(); err != nil {
		return &soakVerdict{false, "delete with a session open failed: " + err.Error()}, nil
	}
	dd := time.Since(t0)
	var runErr error
	select {
	case runErr = <-running:
	case <-time.After(soakDeleteGrace):
		return &soakVerdict{false, fmt.Sprintf("the session's running command had not returned %s after the delete", soakDeleteGrace)}, nil
	}
	after := time.Since(t0)
	if _, err := s.c.SessionRun(ctx, id, sid, api.SessionRunRequest{Command: "true", Timeout: 10}); err == nil {
		return &soakVerdict{false, "the session still runs commands after the delete"}, nil
	}
	how := "returned"
	if runErr != nil {
		how = "failed (" + clipText(runErr.Error(), 80) + ")"
	}
	return &soakVerdict{true, fmt.Sprintf("delete %d ms with the session open; its running command %s %d ms after the delete began", dd.Milliseconds(), how, after.Milliseconds())}, nil
}

// soakPer is what one sandbox held by the node costs the daemon.
type soakPer struct {
	FDs        float64 `json:"fds"`
	Goroutines float64 `json:"goroutines"`
	RSSBytes   float64 `json:"rss_bytes"`
}

// soakCheck is one reading compared with the baseline.
type soakCheck struct {
	Reading string  `json:"reading"`
	Before  float64 `json:"before"`
	After   float64 `json:"after"`
	Max     float64 `json:"max"` // the most After may be
	Bytes   bool    `json:"bytes,omitempty"`
	OK      bool    `json:"ok"`
}

func (c soakCheck) fmt(v float64) string {
	if c.Bytes {
		return humanBytes(int64(v))
	}
	return strconv.FormatFloat(v, 'f', -1, 64)
}

func (c soakCheck) String() string {
	return fmt.Sprintf("%s %s, %s before (at most %s)", c.Reading, c.fmt(c.After), c.fmt(c.Before), c.fmt(c.Max))
}

// soakCompare compares the reading after the loop with the baseline. Counts
// are of what no sandbox the node holds at the reading holds (see
// soakSample), and must be back exactly; the daemon's fds, goroutines and
// RSS may grow by what the sandboxes held more than at the baseline cost
// (per, from the warm-up) plus a slack, and the state dir's usage by a
// slack.
func soakCompare(b, a soakSample, per soakPer) []soakCheck {
	var out []soakCheck
	add := func(name string, before, after, most float64, bytes bool) {
		out = append(out, soakCheck{Reading: name, Before: before, After: after, Max: most, Bytes: bytes, OK: after <= most})
	}
	count := func(name string, before, after int) {
		add(name, float64(before), float64(after), float64(before), false)
	}
	none := func(name string, before, after int) {
		add(name, float64(before), float64(after), 0, false)
	}
	count("live sandboxes on the node", b.host.sandboxes, a.host.sandboxes)
	none("soak sandboxes still listed", b.listed, a.listed)
	none("records of deleted soak sandboxes", b.ourRecords, a.ourRecords)
	none("mounts of deleted soak sandboxes", b.host.ourMounts, a.host.ourMounts)
	count("mounts under the state dir", b.host.mounts-b.host.heldMounts, a.host.mounts-a.host.heldMounts)
	count("cgroups holding processes", b.host.busyCgroups-b.host.heldBusyCgroups, a.host.busyCgroups-a.host.heldBusyCgroups)
	if idle, most, ok := emptyCgroups(a.host); ok {
		bidle, _, _ := emptyCgroups(b.host)
		add("empty cgroups (the edge's free slots +1, per hierarchy)", float64(bidle), float64(idle), float64(most), false)
	}
	count("loop devices backed under the state dir", b.loops, a.loops)
	count("veths of the instance", b.veths, a.veths)
	count("nft sets and chains of the instance", b.nftObjects, a.nftObjects)
	count("nft set and map elements of the instance", b.nftElems, a.nftElems)
	count("trash entries", b.trash, a.trash)
	extra := float64(max(0, a.held-b.held))
	if fb, ok := daemonFDs(b.host); ok {
		if fa, ok := daemonFDs(a.host); ok {
			add("daemon fds (not the bench's connections)", fb, fa, fb+daemonFDSlack+math.Ceil(extra*per.FDs), false)
		}
	}
	if b.host.metrics != nil && a.host.metrics != nil {
		bm, am := b.host.metrics, a.host.metrics
		conns := float64(max(0, a.host.ownSockets-b.host.ownSockets))
		add("daemon goroutines", bm["go_goroutines"], am["go_goroutines"],
			bm["go_goroutines"]+soakGoroutineSlack+2*conns+math.Ceil(extra*per.Goroutines), false)
		add("daemon sessions open", bm["dsec_sessions_open"], am["dsec_sessions_open"], bm["dsec_sessions_open"], false)
		add("daemon streams open", bm["dsec_streams_open"], am["dsec_streams_open"], bm["dsec_streams_open"], false)
		rb := bm["process_resident_memory_bytes"]
		add("daemon RSS", rb, am["process_resident_memory_bytes"],
			rb+max(soakRSSSlack, rb*soakRSSSlackPct/100)+extra*per.RSSBytes, true)
	}
	db := float64(b.diskBytes)
	add("state dir usage (outside held sandboxes)", db, float64(a.diskBytes), db+max(soakDiskSlack, db*soakDiskSlackPct/100), true)
	return out
}

// diskGrowth is the directories of the state dir that grew, and by how
// much.
func diskGrowth(before, after map[string]int64) map[string]int64 {
	out := map[string]int64{}
	for d, n := range after {
		if g := n - before[d]; g > 0 {
			out[d] = g
		}
	}
	return out
}

// soakLines renders the outcomes and the readings under the cycles' rows.
func soakLines(rep soakReport) []string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "\n%d cycles (%d run) at %d in %.1f s: %.1f cycles/s", rep.Cycles, rep.CyclesRun, rep.Concurrency, rep.WallSeconds, rep.PerSec)
	if rep.Networked {
		sb.WriteString("; every other use networked (egress policy, veth)")
	}
	sb.WriteString("\n")
	if len(rep.Failures) == 0 {
		sb.WriteString("failures: none\n")
	} else {
		stages := make([]string, 0, len(rep.Failures))
		for st := range rep.Failures {
			stages = append(stages, st)
		}
		sort.Strings(stages)
		for _, st := range stages {
			fmt.Fprintf(&sb, "failures: %s %d, first: %s\n", st, rep.Failures[st], rep.FirstFailure[st])
		}
	}
	tw := tabwriter.NewWriter(&sb, 0, 4, 2, ' ', 0)
	if len(rep.Adversarial) > 0 {
		fmt.Fprintln(tw, "\nADVERSARIAL\tRUNS\tCONTAINED\tVIOLATIONS\tFAILED\tLAST CONTAINED / FIRST VIOLATION")
		for _, o := range rep.Adversarial {
			what := o.Last
			if o.FirstViolation != "" {
				what = "VIOLATION: " + o.FirstViolation
			}
			fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%s\n", o.Kind, o.Runs, o.Contained, o.Violations, o.Failed, what)
		}
	}
	fmt.Fprintln(tw, "\nREADING\tBASELINE\tAFTER\tAT MOST\tBACK")
	for _, c := range rep.Readings {
		ok := "yes"
		if !c.OK {
			ok = "NO"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", c.Reading, c.fmt(c.Before), c.fmt(c.After), c.fmt(c.Max), ok)
	}
	_ = tw.Flush()
	lines := strings.Split(strings.TrimSuffix(sb.String(), "\n"), "\n")
	lines = append(lines, fmt.Sprintf("(counts leave out what the sandboxes the node holds hold, warm-pool and other clients' ones: %d at the baseline, %d after;"+
		" the daemon's fds, goroutines and RSS may grow by what each one more costs, %.2f fds, %.2f goroutines and %s as measured in the warm-up;"+
		" slack: fds +%d, goroutines +%d, RSS +%s or +%d%%, state dir +%s or +%d%%)",
		rep.Held[0], rep.Held[1], rep.PerHeld.FDs, rep.PerHeld.Goroutines, humanBytes(int64(rep.PerHeld.RSSBytes)),
		daemonFDSlack, soakGoroutineSlack, humanBytes(soakRSSSlack), soakRSSSlackPct, humanBytes(soakDiskSlack), soakDiskSlackPct))
	if len(rep.DiskGrowth) > 0 {
		dirs := make([]string, 0, len(rep.DiskGrowth))
		for d := range rep.DiskGrowth {
			dirs = append(dirs, d)
		}
		sort.Slice(dirs, func(i, j int) bool { return rep.DiskGrowth[dirs[i]] > rep.DiskGrowth[dirs[j]] })
		var parts []string
		for _, d := range dirs[:min(len(dirs), 5)] {
			parts = append(parts, fmt.Sprintf("%s +%s", d, humanBytes(rep.DiskGrowth[d])))
		}
		lines = append(lines, "state dir growth: "+strings.Join(parts, ", "))
	}
	switch {
	case len(rep.Leaks) == 0:
		lines = append(lines, "leak check: ok")
	default:
		lines = append(lines, "leak check: FAILED: "+strings.Join(rep.Leaks, "; "))
	}
	if rep.Violations > 0 {
		lines = append(lines, fmt.Sprintf("containment: %d VIOLATIONS", rep.Violations))
	} else {
		lines = append(lines, "containment: every adversarial workload contained")
	}
	return lines
}
