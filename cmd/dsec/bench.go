package main

import (
	"archive/tar"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"text/tabwriter"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/hostfs"
	"github.com/dsecproject/dsec/internal/layer"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

// `dsec bench` measures dsec through its API against the floor: the bare
// OCI runtime driven directly on the same EROFS layer with its own overlay,
// in the same run, so a noisy machine affects both sides alike.

type benchOpts struct {
	count       int
	concurrency int
	stateDir    string
	base        string
	jsonOut     bool
	noBaseline  bool
	diskMB      int64
	allow       stringList
	poolGap     time.Duration
	userns      *bool
	// nestedDepth > 0 compares creates with the caller's key against
	// creates with a member key of a project that many levels deep.
	nestedDepth int
	// backend other than container: create and exec measure it and the
	// container backend side by side, the container as the baseline.
	backend string
	// cmd is what bench exec runs (a shell command; "" = /bin/true).
	cmd string
}

// benchRow is one measure of the report.
type benchRow struct {
	Measure     string  `json:"measure"`
	Count       int     `json:"count"`
	Concurrency int     `json:"concurrency"`
	P50MS       float64 `json:"p50_ms"`
	P99MS       float64 `json:"p99_ms"`
	PerSec      float64 `json:"per_sec"`
	Failures    int     `json:"failures"`
	BaseP50MS   float64 `json:"baseline_p50_ms,omitempty"`
	BaseP99MS   float64 `json:"baseline_p99_ms,omitempty"`
	BasePerSec  float64 `json:"baseline_per_sec,omitempty"`
	Baseline    string  `json:"baseline,omitempty"`
	RatioP50    float64 `json:"ratio_p50,omitempty"`
	// FreedBytesAvg is the memory a pause gave back, on average.
	FreedBytesAvg float64 `json:"freed_bytes_avg,omitempty"`
	// MemoryAvg is the memory charged to an idle sandbox (its cgroup), on
	// average, and BaseMemoryAvg the baseline's.
	MemoryAvg     float64 `json:"memory_per_sandbox_bytes,omitempty"`
	BaseMemoryAvg float64 `json:"baseline_memory_per_sandbox_bytes,omitempty"`
}

func runBench(args []string) error {
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" {
		fmt.Print("usage: dsec bench create|exec|pause|snapshot|fork|pool|envsetup|density|soak|cluster|e2b|control-plane|images|merge [flags]\n\n" +
			"  create  create → ready latency and throughput through the API, then delete\n" +
			"  exec    exec round trip of `true` through the API\n" +
			"  pause   pause (freeze + reclaim) and resume latency, memory freed per pause\n" +
			"  snapshot  snapshot time for a 1 MiB and a 100 MiB diff\n" +
			"  fork    fork --count sandboxes from one sandbox in one call\n" +
			"  pool    creates served from a warm pool and fncall round trips\n" +
			"  envsetup  N sandboxes on base+workspace+toolkit layers running a tool-call\n" +
			"            sequence, against tar.gz extraction per sandbox (DSec §8 E2)\n" +
			"  density   fill the node with idle sandboxes: memory, tasks, daemon RSS/fds\n" +
			"            per sandbox, exec latency at density, teardown rate, leak check\n" +
			"  soak      create, use and delete in a loop with adversarial workloads mixed in\n" +
			"            (floods, fork bombs, deep trees, disk fill, memory hog, open sessions),\n" +
			"            then check mounts, cgroups, loops, veths, nft, fds, RSS, disk are back\n" +
			"  cluster   start a dsec up and a cluster side by side and price the extra hop:\n" +
			"            create and exec latency, a burst over the edges (its own daemons)\n" +
			"  e2b       create → run `echo hi` → kill through the E2B JS SDK, libdsec and the\n" +
			"            REST API, interleaved: what the E2B path costs over the native one\n" +
			"  control-plane  etcd, apiservers and hollow edges (simulated sandboxes) at scale:\n" +
			"            creates/s and latency to full concurrency, placement, list/pause/delete\n" +
			"            of a job by label, CPU, memory and etcd (its own daemons)\n" +
			"  images    a burst from multi-GB bases kept in a registry (its own, on loopback):\n" +
			"            pulled whole first, read on demand, and pre-pulled (DSec §9 E1)\n" +
			"  merge     one image of many layers imported per image layer, merged into a\n" +
			"            few runs (--merge-under) and merged whole: layers stacked, mounts,\n" +
			"            create and task latency, interleaved (DSec §3.4)\n\n" +
			"Each prints the same measure for the bare OCI runtime (crun/runc run -d,\n" +
			"exec, delete) on the same EROFS layer with an overlay, measured in the same run.\n" +
			"Needs a running `dsec up` (DSEC_ENDPOINT/DSEC_API_KEY or its config file) and,\n" +
			"for the baseline, root and the daemon's --state-dir.\n")
		if len(args) == 0 {
			return errors.New("bench: missing subcommand")
		}
		return errHelpShown
	}
	switch args[0] {
	case "cluster":
		return runBenchCluster(args[1:])
	case "envsetup":
		return runBenchEnv(args[1:])
	case "density":
		return runBenchDensity(args[1:])
	case "soak":
		return runBenchSoak(args[1:])
	case "e2b":
		return runBenchE2B(args[1:])
	case "control-plane":
		return runBenchControlPlane(args[1:])
	case "images":
		return runBenchImages(args[1:])
	case "merge":
		return runBenchMerge(args[1:])
	}
	sub := args[0]
	var o benchOpts
	f := newCmdFlags("bench "+sub, "[flags]", "Benchmark "+sub+" against the bare runtime.")
	f.IntVar(&o.count, "count", 100, "operations to measure")
	f.IntVar(&o.concurrency, "concurrency", 8, "operations in flight at once")
	f.StringVar(&o.stateDir, "state-dir", "/var/lib/dsec", "the daemon's state dir (for the baseline's layer blob)")
	f.StringVar(&o.base, "base", "", "base layer ref to use (default: build base/bench:busybox from the host's busybox)")
	f.BoolVar(&o.jsonOut, "json", false, "print JSON instead of a table")
	f.BoolVar(&o.noBaseline, "no-baseline", false, "skip the bare-runtime baseline")
	f.Int64Var(&o.diskMB, "disk-mb", 0, "create: give each sandbox a disk of this many MiB (disk_mb)")
	f.DurationVar(&o.poolGap, "pool-gap", 100*time.Millisecond, "pool: pause between measured creates (lets the pool refill)")
	f.Var(optBool{&o.userns}, "userns", "create, exec, snapshot: user-namespace sandboxes (--userns=false: none; left out: the node's default)")
	f.IntVar(&o.nestedDepth, "nested-key-depth", 0, "create: also create with a member key of a project this many levels below root (0-64), and with a quota on that chain, interleaved one at a time with the caller's key: the price of authorization and quotas")
	f.Var(&o.allow, "allow", "create: egress allow rule for each sandbox (repeatable; gives it a veth)")
	f.StringVar(&o.backend, "backend", api.BackendContainer, "create, exec, snapshot: the backend to measure; other than container, the container backend is measured in the same run as its baseline")
	f.StringVar(&o.cmd, "cmd", "", "exec: the shell command to run (default: /bin/true); e.g. a syscall-heavy loop to compare backends")
	if _, err := f.parseN(args[1:], 0, 0); err != nil {
		return err
	}
	if o.count < 1 || o.concurrency < 1 || o.concurrency > 1024 {
		return errors.New("bench: --count must be ≥ 1 and --concurrency between 1 and 1024")
	}
	if o.nestedDepth < 0 || o.nestedDepth > 64 || o.nestedDepth > 0 && sub != "create" {
		return errors.New("bench: --nested-key-depth is 0-64, for bench create only")
	}
	if o.backend != api.BackendContainer && sub != "create" && sub != "exec" && sub != "snapshot" {
		return errors.New("bench: --backend is for bench create, exec and snapshot")
	}
	if o.cmd != "" && sub != "exec" {
		return errors.New("bench: --cmd is for bench exec")
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	c, err := newClient()
	if err != nil {
		return err
	}
	ref, digest, err := benchBase(ctx, c, o.base)
	if err != nil {
		return err
	}
	nodes, err := c.ListNodes(ctx)
	if err != nil {
		return err
	}
	rt := "crun"
	if len(nodes) > 0 && nodes[0].Runtime != "" {
		rt = nodes[0].Runtime
	}
	var rows []benchRow
	switch sub {
	case "create":
		if o.nestedDepth > 0 {
			rows, err = benchCreateNested(ctx, c, o, ref)
			break
		}
		rows, err = benchCreate(ctx, c, o, ref, digest, rt)
	case "exec":
		rows, err = benchExec(ctx, c, o, ref, digest, rt)
	case "pause":
		rows, err = benchPause(ctx, c, o, ref)
	case "snapshot":
		rows, err = benchSnapshot(ctx, c, o, ref)
	case "fork":
		rows, err = benchFork(ctx, c, o, ref)
	case "pool":
		rows, err = benchPool(ctx, c, o, ref)
	default:
		return fmt.Errorf("bench: unknown subcommand %q (want create, exec, pause, snapshot, fork, pool, envsetup, density, soak, cluster or e2b)", sub)
	}
	if err != nil {
		return err
	}
	return printBench(rows, o.jsonOut)
}

// benchBase returns the base layer to use, building one from the host's
// busybox when none is given.
func benchBase(ctx context.Context, c *dsec.Client, ref string) (string, string, error) {
	return benchBaseOf(ctx, c, ref, "busybox", hostfs.Options{})
}

// benchBaseOf returns ref, or when it is empty base/bench:TAG, built from
// the host's busybox and what opts add unless the catalog has it.
func benchBaseOf(ctx context.Context, c *dsec.Client, ref, tag string, opts hostfs.Options) (string, string, error) {
	if ref != "" {
		l, err := c.GetLayer(ctx, ref)
		if err != nil {
			return "", "", err
		}
		return ref, l.Digest, nil
	}
	ref = "base/bench:" + tag
	if l, err := c.GetLayer(ctx, ref); err == nil {
		return ref, l.Digest, nil
	}
	dir, err := os.MkdirTemp("", "dsec-bench-rootfs-")
	if err != nil {
		return "", "", err
	}
	defer os.RemoveAll(dir)
	if err := hostfs.Build(dir, opts); err != nil {
		return "", "", err
	}
	pr, pw := io.Pipe()
	go func() { pw.CloseWithError(tarDir(dir, pw)) }()
	l, err := c.BuildLayer(ctx, "base", "bench", tag, pr)
	if err != nil {
		return "", "", fmt.Errorf("building the bench base layer: %w", err)
	}
	fmt.Fprintf(os.Stderr, "built %s (%s)\n", ref, l.Digest)
	return ref, l.Digest, nil
}

// tarDir writes dir as a tar stream (regular files, dirs, symlinks).
func tarDir(dir string, w io.Writer) error {
	tw := tar.NewWriter(w)
	if err := tarInto(tw, dir, ""); err != nil {
		return err
	}
	return tw.Close()
}

// runParallel runs fn count times with at most conc in flight and returns
// each call's duration, the failures and the wall time.
func runParallel(count, conc int, fn func(i int) error) ([]time.Duration, int, time.Duration, error) {
	var mu sync.Mutex
	durs := make([]time.Duration, 0, count)
	fails := 0
	var firstErr error
	sem := make(chan struct{}, conc)
	var wg sync.WaitGroup
	start := time.Now()
	for i := range count {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			t0 := time.Now()
			err := fn(i)
			d := time.Since(t0)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				fails++
				if firstErr == nil {
					firstErr = err
				}
				return
			}
			durs = append(durs, d)
		}()
	}
	wg.Wait()
	return durs, fails, time.Since(start), firstErr
}

func pct(durs []time.Duration, p float64) float64 {
	if len(durs) == 0 {
		return 0
	}
	s := append([]time.Duration(nil), durs...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	idx := int(float64(len(s)-1) * p)
	return float64(s[idx].Microseconds()) / 1000
}

func row(measure string, count, conc int, durs []time.Duration, fails int, wall time.Duration) benchRow {
	return benchRow{Measure: measure, Count: count, Concurrency: conc, P50MS: pct(durs, .5), P99MS: pct(durs, .99),
		PerSec: float64(len(durs)) / wall.Seconds(), Failures: fails}
}

func withBaseline(r benchRow, b benchRow, name string) benchRow {
	r.BaseP50MS, r.BaseP99MS, r.BasePerSec, r.Baseline = b.P50MS, b.P99MS, b.PerSec, name
	if b.P50MS > 0 {
		r.RatioP50 = r.P50MS / b.P50MS
	}
	return r
}

func benchCreate(ctx context.Context, c *dsec.Client, o benchOpts, ref, digest, rt string) ([]benchRow, error) {
	if o.backend != api.BackendContainer {
		// The named backend, then the container backend, in one run.
		other, err := createRound(ctx, c, o, ref, o.backend)
		if err != nil {
			return nil, err
		}
		ctr, err := createRound(ctx, c, o, ref, api.BackendContainer)
		if err != nil {
			return nil, err
		}
		rows := []benchRow{withBaseline(other[0], ctr[0], "container"), withBaseline(other[1], ctr[1], "container"), withBaseline(other[2], ctr[2], "container")}
		rows[0].BaseMemoryAvg = ctr[0].MemoryAvg
		return rows, nil
	}
	rows, err := createRound(ctx, c, o, ref, o.backend)
	if err != nil || o.noBaseline {
		return rows, err
	}
	return withRuntimeBaseline(o, rows[0], rows[1], digest, rt)
}

// createRound creates count sandboxes of backend, runs /bin/true in each
// as soon as it is created, reads the memory each holds once idle, and
// deletes them: the create, delete and create-to-first-exec rows (the
// last is a VM's boot to its first command).
func createRound(ctx context.Context, c *dsec.Client, o benchOpts, ref, backend string) ([]benchRow, error) {
	label := fmt.Sprintf("bench-%d", time.Now().UnixNano())
	ids := make([]string, o.count)
	creates := make([]time.Duration, o.count)
	fmt.Fprintf(os.Stderr, "dsec: creating %d %s sandboxes, %d at a time...\n", o.count, backend, o.concurrency)
	durs, fails, wall, ferr := runParallel(o.count, o.concurrency, func(i int) error {
		start := time.Now()
		defer func() { creates[i] = time.Since(start) }()
		spec := api.SandboxSpec{Base: ref, Backend: backend, Labels: map[string]string{"bench": label}, DiskMB: o.diskMB, UserNS: o.userns}
		if len(o.allow) > 0 {
			spec.Network = &api.NetworkPolicy{Allow: o.allow}
		}
		sb, err := c.CreateSandbox(ctx, spec)
		if err == nil {
			ids[i] = sb.ID
		}
		return err
	})
	if ferr != nil {
		fmt.Fprintf(os.Stderr, "first create failure: %v\n", ferr)
	}
	what := "create"
	if backend != api.BackendContainer {
		what += " " + backend
	}
	if o.diskMB > 0 {
		what += fmt.Sprintf(" disk_mb=%d", o.diskMB)
	}
	if len(o.allow) > 0 {
		what += " allow=" + strings.Join(o.allow, ",")
	}
	if o.userns != nil {
		what += map[bool]string{true: " userns", false: " no-userns"}[*o.userns]
	}
	create := row(what, o.count, o.concurrency, durs, fails, wall)
	// Each sandbox's first command, timed apart and added to its create:
	// from the create call to the first command's answer (a VM's boot to
	// its first exec).
	var fmu sync.Mutex
	var fdurs []time.Duration
	_, _, _, _ = runParallel(o.count, o.concurrency, func(i int) error {
		if ids[i] == "" {
			return nil
		}
		start := time.Now()
		r, err := c.Exec(ctx, ids[i], api.ExecRequest{Argv: []string{"/bin/true"}})
		if err != nil || r.ExitCode != 0 {
			return fmt.Errorf("first exec: %v %+v", err, r)
		}
		fmu.Lock()
		fdurs = append(fdurs, creates[i]+time.Since(start))
		fmu.Unlock()
		return nil
	})
	first := row(strings.Replace(what, "create", "create to first exec", 1), o.count, o.concurrency, fdurs, o.count-len(fdurs), wall)
	first.PerSec = 0
	create.MemoryAvg = idleMemory(ctx, c, ids)
	fmt.Fprintf(os.Stderr, "dsec: deleting...\n")
	ddurs, dfails, dwall, _ := runParallel(o.count, o.concurrency, func(i int) error {
		if ids[i] == "" {
			return nil
		}
		return c.DeleteSandbox(ctx, ids[i])
	})
	del := row(strings.Replace(what, "create", "delete", 1), o.count, o.concurrency, ddurs, dfails, dwall)
	return []benchRow{create, del, first}, nil
}

// idleMemory waits a second for the sandboxes to settle, then returns the
// mean of the memory their stats report (0 if none answers).
func idleMemory(ctx context.Context, c *dsec.Client, ids []string) float64 {
	time.Sleep(time.Second)
	var sum float64
	n := 0
	for _, id := range ids {
		if id == "" {
			continue
		}
		if st, err := c.Stats(ctx, id); err == nil {
			sum += float64(st.MemoryBytes)
			n++
		}
	}
	if n == 0 {
		return 0
	}
	return sum / float64(n)
}

// withRuntimeBaseline runs the bare runtime's create and delete and puts
// them beside dsec's.
func withRuntimeBaseline(o benchOpts, create, del benchRow, digest, rt string) ([]benchRow, error) {
	b, err := newBaseline(o.stateDir, digest, rt)
	if err != nil {
		return nil, fmt.Errorf("baseline: %w (use --no-baseline to skip)", err)
	}
	defer b.close()
	fmt.Fprintf(os.Stderr, "baseline: %s run -d ×%d...\n", rt, o.count)
	names := make([]string, o.count)
	bd, bf, bw, berr := runParallel(o.count, o.concurrency, func(i int) error {
		n, err := b.run(i)
		names[i] = n
		return err
	})
	if berr != nil {
		fmt.Fprintf(os.Stderr, "first baseline failure: %v\n", berr)
	}
	bcreate := row("create", o.count, o.concurrency, bd, bf, bw)
	dd, df, dw, _ := runParallel(o.count, o.concurrency, func(i int) error {
		if names[i] == "" {
			return nil
		}
		return b.remove(names[i])
	})
	bdel := row("delete", o.count, o.concurrency, dd, df, dw)
	return []benchRow{
		withBaseline(create, bcreate, rt+" run -d"),
		withBaseline(del, bdel, rt+" delete -f"),
	}, nil
}

func benchExec(ctx context.Context, c *dsec.Client, o benchOpts, ref, digest, rt string) ([]benchRow, error) {
	if o.backend != api.BackendContainer {
		other, err := execRound(ctx, c, o, ref, o.backend)
		if err != nil {
			return nil, err
		}
		ctr, err := execRound(ctx, c, o, ref, api.BackendContainer)
		if err != nil {
			return nil, err
		}
		return []benchRow{withBaseline(other, ctr, "container")}, nil
	}
	r, err := execRound(ctx, c, o, ref, o.backend)
	if err != nil || o.noBaseline || o.cmd != "" {
		return []benchRow{r}, err
	}
	b, err := newBaseline(o.stateDir, digest, rt)
	if err != nil {
		return nil, fmt.Errorf("baseline: %w (use --no-baseline to skip)", err)
	}
	defer b.close()
	name, err := b.run(0)
	if err != nil {
		return nil, err
	}
	defer b.remove(name)
	fmt.Fprintf(os.Stderr, "baseline: %s exec ×%d...\n", rt, o.count)
	bd, bf, bw, berr := runParallel(o.count, o.concurrency, func(int) error {
		return b.exec(name)
	})
	if berr != nil {
		fmt.Fprintf(os.Stderr, "first baseline failure: %v\n", berr)
	}
	return []benchRow{withBaseline(r, row("exec", o.count, o.concurrency, bd, bf, bw), rt+" exec")}, nil
}

// execRound runs the exec measure in one sandbox of backend.
func execRound(ctx context.Context, c *dsec.Client, o benchOpts, ref, backend string) (benchRow, error) {
	sb, err := c.CreateSandbox(ctx, api.SandboxSpec{Base: ref, Backend: backend, Labels: map[string]string{"bench": "exec"}, UserNS: o.userns})
	if err != nil {
		return benchRow{}, err
	}
	defer c.DeleteSandbox(context.Background(), sb.ID)
	req, what := api.ExecRequest{Argv: []string{"/bin/true"}}, "exec true"
	if o.cmd != "" {
		req, what = api.ExecRequest{Cmd: o.cmd, Timeout: 600}, "exec --cmd"
	}
	if backend != api.BackendContainer {
		what += " (" + backend + ")"
	}
	fmt.Fprintf(os.Stderr, "dsec: %s ×%d in a %s sandbox, %d at a time...\n", what, o.count, backend, o.concurrency)
	durs, fails, wall, ferr := runParallel(o.count, o.concurrency, func(int) error {
		res, err := c.Exec(ctx, sb.ID, req)
		if err == nil && res.ExitCode != 0 {
			err = fmt.Errorf("exit %d: %s", res.ExitCode, res.Stderr)
		}
		return err
	})
	if ferr != nil {
		fmt.Fprintf(os.Stderr, "first exec failure: %v\n", ferr)
	}
	return row(what, o.count, o.concurrency, durs, fails, wall), nil
}

// benchPause creates count sandboxes that each hold a 16 MiB file in page
// cache plus a sleeping process, then pauses and resumes them all. There
// is no baseline: the runtime's own pause only freezes.
func benchPause(ctx context.Context, c *dsec.Client, o benchOpts, ref string) ([]benchRow, error) {
	label := fmt.Sprintf("bench-pause-%d", time.Now().UnixNano())
	fmt.Fprintf(os.Stderr, "dsec: creating %d sandboxes with 16 MiB of page cache each...\n", o.count)
	res, err := c.CreateSandboxes(ctx, o.count, api.SandboxSpec{Base: ref, Labels: map[string]string{"bench": label}})
	if err != nil {
		return nil, err
	}
	defer c.DeleteSandboxes(context.Background(), map[string]string{"bench": label})
	if len(res.Errors) > 0 {
		return nil, fmt.Errorf("creating: %d failed, first: %s", len(res.Errors), res.Errors[0].Error.Message)
	}
	ids := make([]string, len(res.Sandboxes))
	for i, sb := range res.Sandboxes {
		ids[i] = sb.ID
	}
	_, fails, _, ferr := runParallel(len(ids), o.concurrency, func(i int) error {
		r, err := c.Exec(ctx, ids[i], api.ExecRequest{Cmd: "dd if=/dev/zero of=/tmp/cache bs=1M count=16 2>/dev/null; (sleep 100000 &)"})
		if err == nil && r.ExitCode != 0 {
			err = fmt.Errorf("exit %d: %s", r.ExitCode, r.Stderr)
		}
		return err
	})
	if fails > 0 {
		return nil, fmt.Errorf("preparing sandboxes: %w", ferr)
	}
	var mu sync.Mutex
	var freed float64
	fmt.Fprintf(os.Stderr, "dsec: pausing...\n")
	pd, pf, pw, perr := runParallel(len(ids), o.concurrency, func(i int) error {
		r, err := c.Pause(ctx, ids[i])
		if err == nil {
			mu.Lock()
			freed += float64(r.MemoryFreedBytes)
			mu.Unlock()
		}
		return err
	})
	if perr != nil {
		fmt.Fprintf(os.Stderr, "first pause failure: %v\n", perr)
	}
	fmt.Fprintf(os.Stderr, "dsec: resuming...\n")
	rd, rf, rw, rerr := runParallel(len(ids), o.concurrency, func(i int) error {
		_, err := c.Resume(ctx, ids[i])
		return err
	})
	if rerr != nil {
		fmt.Fprintf(os.Stderr, "first resume failure: %v\n", rerr)
	}
	pause := row("pause", len(ids), o.concurrency, pd, pf, pw)
	if n := len(pd); n > 0 {
		pause.FreedBytesAvg = freed / float64(n)
	}
	return []benchRow{pause, row("resume", len(ids), o.concurrency, rd, rf, rw)}, nil
}

// benchSnapshot measures pack_diff: a sandbox writes a diff of random data
// (1 MiB, then 100 MiB), and each snapshot is timed --count times.
func benchSnapshot(ctx context.Context, c *dsec.Client, o benchOpts, ref string) ([]benchRow, error) {
	if o.backend == api.BackendContainer {
		return snapshotRound(ctx, c, o, ref, o.backend)
	}
	// The named backend, then the container backend, in one run.
	other, err := snapshotRound(ctx, c, o, ref, o.backend)
	if err != nil {
		return nil, err
	}
	ctr, err := snapshotRound(ctx, c, o, ref, api.BackendContainer)
	if err != nil {
		return nil, err
	}
	for i := range other {
		other[i] = withBaseline(other[i], ctr[i], "container")
	}
	return other, nil
}

// snapshotRound snapshots a sandbox of backend count times, with a diff
// of 1 MiB and then one of 100 MiB.
func snapshotRound(ctx context.Context, c *dsec.Client, o benchOpts, ref, backend string) ([]benchRow, error) {
	var rows []benchRow
	for _, mib := range []int{1, 100} {
		sb, err := c.CreateSandbox(ctx, api.SandboxSpec{Base: ref, Backend: backend, Labels: map[string]string{"bench": "snapshot"}, UserNS: o.userns})
		if err != nil {
			return nil, err
		}
		r, err := c.Exec(ctx, sb.ID, api.ExecRequest{Cmd: fmt.Sprintf("head -c %d /dev/urandom > /root/diff", mib<<20), Timeout: 600})
		if err == nil && r.ExitCode != 0 {
			err = fmt.Errorf("writing the diff: exit %d: %s", r.ExitCode, r.Stderr)
		}
		if err != nil {
			_ = c.DeleteSandbox(context.Background(), sb.ID)
			return nil, err
		}
		what := fmt.Sprintf("snapshot %d MiB", mib)
		if backend != api.BackendContainer {
			what += " (" + backend + ")"
		}
		fmt.Fprintf(os.Stderr, "dsec: %s ×%d in a %s sandbox...\n", what, o.count, backend)
		var refs []string
		var mu sync.Mutex
		durs, fails, wall, ferr := runParallel(o.count, 1, func(i int) error {
			sref := fmt.Sprintf("snapshot/bench-%d:%d-%d", mib, time.Now().UnixNano(), i)
			_, err := c.Snapshot(ctx, sb.ID, api.SnapshotRequest{Ref: sref})
			if err == nil {
				mu.Lock()
				refs = append(refs, sref)
				mu.Unlock()
			}
			return err
		})
		_ = c.DeleteSandbox(context.Background(), sb.ID)
		for _, r := range refs {
			_ = c.DeleteLayer(context.Background(), r)
		}
		if ferr != nil {
			fmt.Fprintf(os.Stderr, "first snapshot failure: %v\n", ferr)
		}
		rows = append(rows, row(what, o.count, 1, durs, fails, wall))
	}
	return rows, nil
}

// benchFork forks --count sandboxes from one sandbox in one call and
// reports the call's time (one snapshot, then count creates).
func benchFork(ctx context.Context, c *dsec.Client, o benchOpts, ref string) ([]benchRow, error) {
	label := fmt.Sprintf("bench-fork-%d", time.Now().UnixNano())
	sb, err := c.CreateSandbox(ctx, api.SandboxSpec{Base: ref, Labels: map[string]string{"bench": label}})
	if err != nil {
		return nil, err
	}
	defer c.DeleteSandboxes(context.Background(), map[string]string{"bench": label})
	if _, err := c.Exec(ctx, sb.ID, api.ExecRequest{Cmd: "head -c 1048576 /dev/urandom > /root/state"}); err != nil {
		return nil, err
	}
	fmt.Fprintf(os.Stderr, "dsec: fork ×%d in one call...\n", o.count)
	start := time.Now()
	res, err := c.Fork(ctx, sb.ID, o.count, nil)
	if err != nil {
		return nil, err
	}
	wall := time.Since(start)
	r := benchRow{Measure: fmt.Sprintf("fork of %d (one call)", o.count), Count: o.count, Concurrency: 1,
		P50MS: float64(wall.Microseconds()) / 1000, P99MS: float64(wall.Microseconds()) / 1000,
		PerSec: float64(len(res.Sandboxes)) / wall.Seconds(), Failures: len(res.Errors)}
	return []benchRow{r}, nil
}

// baseline drives the OCI runtime directly: the layer blob mounted once,
// an overlay and a minimal bundle per container, no dsec in the path.
type baseline struct {
	dir, lower, runtime, root string
}

func newBaseline(stateDir, digest, rt string) (*baseline, error) {
	if os.Geteuid() != 0 {
		return nil, errors.New("needs root to mount the layer and run the runtime")
	}
	blob := filepath.Join(stateDir, "layers", "blobs", "sha256", strings.TrimPrefix(digest, "sha256:")+".erofs")
	if _, err := os.Stat(blob); err != nil {
		return nil, fmt.Errorf("layer blob not found under --state-dir %s: %w", stateDir, err)
	}
	dir, err := os.MkdirTemp("", "dsec-bench-")
	if err != nil {
		return nil, err
	}
	b := &baseline{dir: dir, lower: filepath.Join(dir, "lower"), runtime: rt, root: filepath.Join(dir, "state")}
	_ = os.MkdirAll(b.lower, 0o755)
	if err := unix.Mount(blob, b.lower, "erofs", unix.MS_RDONLY, ""); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("mounting layer: %w", err)
	}
	return b, nil
}

// close removes every container and mount the baseline made, including
// those of a run cut short (Ctrl-C, a failed create).
func (b *baseline) close() {
	ents, _ := os.ReadDir(b.dir)
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), "bench-") {
			_ = exec.Command(b.runtime, "--root", b.root, "delete", "-f", e.Name()).Run()
			_ = layer.UnmountOverlay(filepath.Join(b.dir, e.Name(), "rootfs"))
		}
	}
	_ = unix.Unmount(b.lower, unix.MNT_DETACH)
	_ = os.RemoveAll(b.dir)
}

// baselineSpec is a minimal bundle: the runtime's defaults for namespaces
// and mounts, pid1 a long sleep.
func baselineSpec(rootfs string) []byte {
	spec := map[string]any{
		"ociVersion": "1.0.2",
		"process": map[string]any{
			"args": []string{"/bin/sleep", "100000"}, "cwd": "/",
			"env":  []string{"PATH=/bin:/usr/bin"},
			"user": map[string]any{"uid": 0, "gid": 0},
		},
		"root":     map[string]any{"path": rootfs},
		"hostname": "bench",
		"mounts": []map[string]any{
			{"destination": "/proc", "type": "proc", "source": "proc"},
			{"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": []string{"nosuid", "mode=755"}},
		},
		"linux": map[string]any{
			"namespaces": []map[string]string{{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}, {"type": "network"}},
		},
	}
	b, _ := json.Marshal(spec)
	return b
}

func (b *baseline) run(i int) (string, error) {
	name := fmt.Sprintf("bench-%d", i)
	cd := filepath.Join(b.dir, name)
	for _, s := range []string{"upper", "work", "rootfs"} {
		if err := os.MkdirAll(filepath.Join(cd, s), 0o755); err != nil {
			return "", err
		}
	}
	if err := layer.MountOverlay([]string{b.lower}, filepath.Join(cd, "upper"), filepath.Join(cd, "work"), filepath.Join(cd, "rootfs")); err != nil {
		return "", err
	}
	if err := os.WriteFile(filepath.Join(cd, "config.json"), baselineSpec(filepath.Join(cd, "rootfs")), 0o600); err != nil {
		return "", err
	}
	// The container inherits the runtime's stdio: /dev/null, errors via --log.
	logPath := filepath.Join(cd, "runtime.log")
	cmd := exec.Command(b.runtime, "--root", b.root, "--log", logPath, "run", "-d", "--bundle", cd, name)
	if err := cmd.Run(); err != nil {
		out, _ := os.ReadFile(logPath)
		return "", fmt.Errorf("%s run: %v: %s", b.runtime, err, out)
	}
	return name, nil
}

func (b *baseline) exec(name string) error {
	out, err := exec.Command(b.runtime, "--root", b.root, "exec", name, "/bin/true").CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s exec: %v: %s", b.runtime, err, out)
	}
	return nil
}

func (b *baseline) remove(name string) error {
	out, err := exec.Command(b.runtime, "--root", b.root, "delete", "-f", name).CombinedOutput()
	_ = layer.UnmountOverlay(filepath.Join(b.dir, name, "rootfs"))
	if err != nil {
		return fmt.Errorf("%s delete: %v: %s", b.runtime, err, out)
	}
	return nil
}

func printBench(rows []benchRow, asJSON bool) error {
	if asJSON {
		return printJSON(map[string]any{"time": time.Now().UTC(), "results": rows})
	}
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0) // dsec's own numbers: nothing to escape
	fmt.Fprintln(tw, "MEASURE\tN\tCONC\tP50 ms\tP99 ms\tPER SEC\tFAIL\tBASELINE\tB P50 ms\tB P99 ms\tB PER SEC\tP50 RATIO")
	for _, r := range rows {
		base := "-\t-\t-\t-\t-"
		if r.Baseline != "" {
			base = fmt.Sprintf("%s\t%.1f\t%.1f\t%.0f\t%.2fx", r.Baseline, r.BaseP50MS, r.BaseP99MS, r.BasePerSec, r.RatioP50)
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%.1f\t%.1f\t%.0f\t%d\t%s\n",
			r.Measure, r.Count, r.Concurrency, r.P50MS, r.P99MS, r.PerSec, r.Failures, base)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, r := range rows {
		if r.FreedBytesAvg > 0 {
			fmt.Printf("%s: memory freed per sandbox %.1f MiB on average\n", r.Measure, r.FreedBytesAvg/(1<<20))
		}
		if r.MemoryAvg > 0 {
			fmt.Printf("%s: memory per idle sandbox %.1f MiB", r.Measure, r.MemoryAvg/(1<<20))
			if r.BaseMemoryAvg > 0 {
				fmt.Printf(" (%s: %.1f MiB, %.2fx)", r.Baseline, r.BaseMemoryAvg/(1<<20), r.MemoryAvg/r.BaseMemoryAvg)
			}
			fmt.Println()
		}
	}
	return nil
}
