package main

import (
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math/rand/v2"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/hostfs"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

// `dsec bench envsetup` is DSec's §8 E2 comparison: N sandboxes composed
// from base + workspace + toolkit EROFS layers under an overlay, against
// extracting the same three trees from tar.gz into a fresh directory per
// sandbox and running the bare OCI runtime on it. Every sandbox runs the
// same short recorded tool-call sequence and is deleted, so the workload's
// completion time compares like the paper's (79 min tar vs 45 min EROFS).

// envLayerName is the name of every layer the bench builds; the tag is a
// hash of the tree, so a rerun on the same host reuses the layers and a
// changed host gets new ones instead of a silently different tree.
const envLayerName = "bench-env"

// envPaperSpeedup is DSec's E2 completion-time speedup (§8).
const envPaperSpeedup = 1.76

// envToolCalls is the recorded tool-call sequence of one sandbox: look at
// the repo, read a file, run a toolkit script (which starts python3 from
// the base), edit a file, search. Each must exit 0.
var envToolCalls = []string{
	"ls -la /workspace/repo",
	"cat /workspace/repo/README.md",
	"sh /opt/toolkit/bin/check.sh /workspace/repo",
	"printf 'def patched():\\n    return 42\\n' >> /workspace/repo/src/benchpkg/mod001.py",
	"grep -rn 'def patched' /workspace/repo/src",
}

// envTree is one of the three layers: the tree it is built from, its
// tar.gz (the baseline's input) and the ref dsec composes.
type envTree struct {
	kind  string
	dir   string
	tgz   string
	ref   string
	files int
	bytes int64 // of the tar.gz
}

// envSummary is what the table's rows do not carry: the workload's
// completion time on each side and the layers used.
type envSummary struct {
	Sandboxes      int               `json:"sandboxes"`
	ToolCalls      int               `json:"tool_calls_per_sandbox"`
	Failed         int               `json:"failed"`
	BaselineFailed int               `json:"baseline_failed,omitempty"`
	WallS          float64           `json:"wall_s"`
	BaselineWallS  float64           `json:"baseline_wall_s,omitempty"`
	Speedup        float64           `json:"completion_speedup,omitempty"`
	SetupSpeedup   float64           `json:"setup_speedup_p50,omitempty"`
	PaperSpeedup   float64           `json:"paper_speedup"`
	Layers         map[string]string `json:"layers"`
	LayerFiles     map[string]int    `json:"layer_files"`
	TarGzBytes     map[string]int64  `json:"tar_gz_bytes"`
}

func runBenchEnv(args []string) error {
	var o benchOpts
	f := newCmdFlags("bench envsetup", "[flags]",
		"Environment setup: N sandboxes on base + workspace + toolkit layers, each running a\n"+
			"short tool-call sequence, against tar.gz extraction + the bare runtime (DSec §8 E2).")
	f.IntVar(&o.count, "count", 50, "sandboxes in the workload")
	f.IntVar(&o.concurrency, "concurrency", 8, "sandboxes in flight at once")
	f.StringVar(&o.stateDir, "state-dir", "/var/lib/dsec", "the daemon's state dir (the baseline extracts next to it; --base blobs are read from it)")
	f.StringVar(&o.base, "base", "", "base layer ref to use (default: build base/bench-env:HASH from the host's busybox, bash and python3)")
	f.BoolVar(&o.jsonOut, "json", false, "print JSON instead of a table")
	f.BoolVar(&o.noBaseline, "no-baseline", false, "skip the tar.gz baseline")
	if _, err := f.parseN(args, 0, 0); err != nil {
		return err
	}
	if o.count < 1 || o.concurrency < 1 || o.concurrency > 1024 {
		return errors.New("bench: --count must be ≥ 1 and --concurrency between 1 and 1024")
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	c, err := newClient()
	if err != nil {
		return err
	}
	rt, _, err := benchNode(ctx, c)
	if err != nil {
		return err
	}
	work, err := os.MkdirTemp("", "dsec-bench-env-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)
	trees, err := envLayers(ctx, c, o, rt, work)
	if err != nil {
		return err
	}
	sum := envSummary{Sandboxes: o.count, ToolCalls: len(envToolCalls), PaperSpeedup: envPaperSpeedup,
		Layers: map[string]string{}, LayerFiles: map[string]int{}, TarGzBytes: map[string]int64{}}
	for _, t := range trees {
		sum.Layers[t.kind] = t.ref
		sum.LayerFiles[t.kind] = t.files
		sum.TarGzBytes[t.kind] = t.bytes
	}

	ph, wall := envRunDsec(ctx, c, o, trees)
	rows := ph.rows(o, wall)
	sum.WallS, sum.Failed = wall.Seconds(), ph.fails
	if !o.noBaseline {
		bph, bwall, err := envRunBaseline(ctx, o, rt, trees)
		if err != nil {
			return fmt.Errorf("baseline: %w (use --no-baseline to skip)", err)
		}
		brows := bph.rows(o, bwall)
		names := []string{
			"tar -xzf ×3 + " + rt + " run -d",
			rt + " exec ×" + fmt.Sprint(len(envToolCalls)),
			rt + " delete -f + rm -rf",
			"tar.gz workload",
		}
		for i := range rows {
			rows[i] = withBaseline(rows[i], brows[i], names[i])
		}
		sum.BaselineWallS, sum.BaselineFailed = bwall.Seconds(), bph.fails
		if ph.ok() == o.count && bph.ok() == o.count {
			sum.Speedup = bwall.Seconds() / wall.Seconds()
		}
		if rows[0].P50MS > 0 {
			sum.SetupSpeedup = rows[0].BaseP50MS / rows[0].P50MS
		}
	}
	return printBenchSummary(rows, sum, envSummaryLines(sum), o.jsonOut)
}

// envSummaryLines is the text under the table.
func envSummaryLines(s envSummary) []string {
	lines := []string{fmt.Sprintf("layers: base %s (%d files, %s tar.gz), workspace %s (%d files, %s), toolkit %s (%d files, %s)",
		s.Layers["base"], s.LayerFiles["base"], humanBytes(s.TarGzBytes["base"]),
		s.Layers["workspace"], s.LayerFiles["workspace"], humanBytes(s.TarGzBytes["workspace"]),
		s.Layers["toolkit"], s.LayerFiles["toolkit"], humanBytes(s.TarGzBytes["toolkit"]))}
	w := fmt.Sprintf("workload: %d sandboxes × %d tool calls in %.2f s with dsec (%.2f sandboxes/s)",
		s.Sandboxes, s.ToolCalls, s.WallS, float64(s.Sandboxes)/s.WallS)
	if s.BaselineWallS > 0 {
		w += fmt.Sprintf(", %.2f s with tar.gz extraction (%.2f sandboxes/s)", s.BaselineWallS, float64(s.Sandboxes)/s.BaselineWallS)
	}
	lines = append(lines, w)
	if s.Failed > 0 || s.BaselineFailed > 0 {
		lines = append(lines, fmt.Sprintf("FAILED: %d sandboxes with dsec, %d with tar.gz (first failures on stderr); no speedup given",
			s.Failed, s.BaselineFailed))
	}
	if s.Speedup > 0 {
		lines = append(lines, fmt.Sprintf("completion speedup %.2fx, setup p50 speedup %.2fx (DSec paper, E2: %.2fx)",
			s.Speedup, s.SetupSpeedup, s.PaperSpeedup))
	}
	return lines
}

// printBenchSummary prints the rows like printBench, then the summary: as
// lines under the table, or as "summary" next to "results" in JSON.
func printBenchSummary(rows []benchRow, summary any, lines []string, asJSON bool) error {
	if asJSON {
		return printJSON(map[string]any{"time": time.Now().UTC(), "results": rows, "summary": summary})
	}
	if err := printBench(rows, false); err != nil {
		return err
	}
	for _, l := range lines {
		fmt.Println(l)
	}
	return nil
}

// benchNode returns the runtime of the (first) node and the node itself.
func benchNode(ctx context.Context, c *dsec.Client) (string, api.Node, error) {
	nodes, err := c.ListNodes(ctx)
	if err != nil {
		return "", api.Node{}, err
	}
	if len(nodes) == 0 {
		return "", api.Node{}, errors.New("bench: the apiserver knows no node")
	}
	rt := "crun"
	if nodes[0].Runtime != "" {
		rt = nodes[0].Runtime
	}
	return rt, nodes[0], nil
}

// envLayers builds the three trees under work, their tar.gz files, and the
// layers (reused when a layer of the same content exists). With --base the
// base tree is the given layer's blob, mounted read-only to be archived.
func envLayers(ctx context.Context, c *dsec.Client, o benchOpts, rt, work string) ([]*envTree, error) {
	trees := []*envTree{{kind: api.KindBase}, {kind: api.KindWorkspace}, {kind: api.KindToolkit}}
	for _, t := range trees {
		t.dir = filepath.Join(work, "tree-"+t.kind)
		t.tgz = filepath.Join(work, t.kind+".tar.gz")
	}
	fmt.Fprintf(os.Stderr, "dsec: building the bench trees...\n")
	if o.base != "" {
		l, err := c.GetLayer(ctx, o.base)
		if err != nil {
			return nil, err
		}
		b, err := newBaseline(o.stateDir, l.Digest, rt)
		if err != nil {
			return nil, fmt.Errorf("reading --base %s for the tar.gz baseline: %w", o.base, err)
		}
		defer b.close()
		trees[0].dir, trees[0].ref = b.lower, o.base
	} else {
		if err := envBuildBase(trees[0].dir); err != nil {
			return nil, fmt.Errorf("building the base tree: %w", err)
		}
	}
	if err := envBuildWorkspace(trees[1].dir); err != nil {
		return nil, fmt.Errorf("building the workspace tree: %w", err)
	}
	if err := envBuildToolkit(trees[2].dir); err != nil {
		return nil, fmt.Errorf("building the toolkit tree: %w", err)
	}
	for _, t := range trees {
		if t.ref == "" {
			if err := stampTree(t.dir, envEpoch); err != nil {
				return nil, err
			}
		}
		sum, files, err := writeTarGz(t.dir, t.tgz)
		if err != nil {
			return nil, fmt.Errorf("archiving the %s tree: %w", t.kind, err)
		}
		t.files = files
		if fi, err := os.Stat(t.tgz); err == nil {
			t.bytes = fi.Size()
		}
		if t.ref != "" {
			continue
		}
		tag := sum[:16]
		t.ref = t.kind + "/" + envLayerName + ":" + tag
		if _, err := c.GetLayer(ctx, t.ref); err == nil {
			continue
		} else if !errors.Is(err, dsec.ErrNotFound) {
			return nil, err
		}
		fh, err := os.Open(t.tgz)
		if err != nil {
			return nil, err
		}
		l, err := c.BuildLayer(ctx, t.kind, envLayerName, tag, fh)
		if err != nil {
			return nil, fmt.Errorf("building layer %s: %w", t.ref, err)
		}
		fmt.Fprintf(os.Stderr, "built %s (%s, %d files)\n", t.ref, l.Digest, t.files)
	}
	return trees, nil
}

// envEpoch dates every file of the generated trees, so the same host gives
// the same archives and the layers' content-hash tags are stable.
var envEpoch = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// envBuildBase is busybox + bash + python3 with its whole standard library
// (about 1,500 files and 50 MiB): the file count is what makes extraction
// cost what it costs.
func envBuildBase(dir string) error {
	py := "/usr/bin/python3"
	if err := hostfs.Build(dir, hostfs.Options{Bash: true, Extra: []string{py}}); err != nil {
		return err
	}
	out, err := exec.Command(py, "-c", "import sysconfig; print(sysconfig.get_paths()['stdlib'])").Output()
	if err != nil {
		return fmt.Errorf("finding python3's standard library: %w", err)
	}
	stdlib := strings.TrimSpace(string(out))
	return copyTree(stdlib, filepath.Join(dir, stdlib))
}

// envBuildWorkspace writes a synthetic task repository under
// /workspace/repo: a package of 300 modules and their tests, and 8 MiB of
// git history.
func envBuildWorkspace(dir string) error {
	repo := filepath.Join(dir, "workspace", "repo")
	files := map[string]string{
		"README.md": "# benchpkg\n\nA synthetic task repository for `dsec bench envsetup`.\n" +
			"Run the checks with /opt/toolkit/bin/check.sh.\n",
		"setup.py":                   "from setuptools import setup\nsetup(name='benchpkg', packages=['benchpkg'], package_dir={'': 'src'})\n",
		"src/benchpkg/__init__.py":   "\"\"\"benchpkg: generated.\"\"\"\n",
		"tests/__init__.py":          "",
		".gitignore":                 "__pycache__/\n*.pyc\n",
		"docs/index.md":              "# Documentation\n",
		"src/benchpkg/data/seed.txt": strings.Repeat("0123456789abcdef", 4096),
	}
	// A cloned repository carries its history: an incompressible pack,
	// the same bytes on every run.
	pack := make([]byte, 8<<20)
	_, _ = rand.NewChaCha8([32]byte{'d', 's', 'e', 'c'}).Read(pack)
	files[".git/objects/pack/pack-bench.pack"] = string(pack)
	files[".git/HEAD"] = "ref: refs/heads/main\n"
	for i := range 300 {
		files[fmt.Sprintf("src/benchpkg/mod%03d.py", i)] = envModule(i)
		files[fmt.Sprintf("tests/test_mod%03d.py", i)] = fmt.Sprintf(
			"from benchpkg import mod%03d\n\n\ndef test_func_0():\n    assert mod%03d.func_0(1) == 1\n", i, i)
	}
	return writeFiles(repo, files, 0o644)
}

// envModule is generated module i: a few small functions and a class.
func envModule(i int) string {
	var b strings.Builder
	fmt.Fprintf(&b, "\"\"\"Module %d of benchpkg.\"\"\"\n\nimport math\n\n", i)
	for j := range 8 {
		fmt.Fprintf(&b, "\ndef func_%d(x):\n    \"\"\"Return x scaled by %d.\"\"\"\n    return x * %d + int(math.sqrt(%d))\n\n", j, j+1, j+1, j*j)
	}
	fmt.Fprintf(&b, "\nclass Thing%d:\n    def __init__(self, n):\n        self.n = n\n\n    def total(self):\n        return sum(func_0(k) for k in range(self.n))\n", i)
	return b.String()
}

// envBuildToolkit writes /opt/toolkit: the check script the tool calls
// run, a python helper it starts, and a library of helpers.
func envBuildToolkit(dir string) error {
	tk := filepath.Join(dir, "opt", "toolkit")
	files := map[string]string{
		"bin/check.sh": "#!/bin/sh\n# Counts the repo's python files and has python parse one module.\nset -e\n" +
			"n=$(find \"$1\" -name '*.py' | wc -l)\n" +
			"if command -v python3 >/dev/null; then\n" +
			"  python3 /opt/toolkit/bin/summarize.py \"$1/src/benchpkg/mod000.py\" \"$n\"\n" +
			"else\n  echo \"{\\\"files\\\": $n}\"  # a --base without python3\nfi\n",
		"bin/summarize.py": "import ast, json, sys\n" +
			"tree = ast.parse(open(sys.argv[1]).read())\n" +
			"fns = sum(isinstance(n, ast.FunctionDef) for n in ast.walk(tree))\n" +
			"print(json.dumps({'files': int(sys.argv[2]), 'functions': fns}))\n",
	}
	for i := range 60 {
		files[fmt.Sprintf("lib/helper%02d.py", i)] = envModule(1000 + i)
	}
	if err := writeFiles(tk, files, 0o644); err != nil {
		return err
	}
	return os.Chmod(filepath.Join(tk, "bin", "check.sh"), 0o755)
}

// writeFiles writes name → content under dir, creating parents.
func writeFiles(dir string, files map[string]string, mode os.FileMode) error {
	for name, content := range files {
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(p, []byte(content), mode); err != nil {
			return err
		}
	}
	return nil
}

// copyTree copies the directories, regular files and symlinks of src to
// dst; anything else (sockets, devices) is skipped.
func copyTree(src, dst string) error {
	return filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(src, p)
		target := filepath.Join(dst, rel)
		info, err := d.Info()
		if err != nil {
			return err
		}
		switch {
		case d.IsDir():
			return os.MkdirAll(target, info.Mode().Perm())
		case d.Type()&fs.ModeSymlink != 0:
			link, err := os.Readlink(p)
			if err != nil {
				return err
			}
			return os.Symlink(link, target)
		case d.Type().IsRegular():
			in, err := os.Open(p)
			if err != nil {
				return err
			}
			defer in.Close()
			out, err := os.OpenFile(target, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, info.Mode().Perm())
			if err != nil {
				return err
			}
			if _, err := io.Copy(out, in); err != nil {
				out.Close()
				return err
			}
			return out.Close()
		}
		return nil
	})
}

// stampTree sets the times of everything under dir (symlinks themselves,
// not their targets) to t.
func stampTree(dir string, t time.Time) error {
	ts := []unix.Timespec{unix.NsecToTimespec(t.UnixNano()), unix.NsecToTimespec(t.UnixNano())}
	return filepath.WalkDir(dir, func(p string, _ fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		return unix.UtimesNanoAt(unix.AT_FDCWD, p, ts, unix.AT_SYMLINK_NOFOLLOW)
	})
}

// writeTarGz archives dir into path (gzip, default level) and returns the
// hex sha256 of the uncompressed tar and the number of entries.
func writeTarGz(dir, path string) (string, int, error) {
	f, err := os.Create(path)
	if err != nil {
		return "", 0, err
	}
	defer f.Close()
	zw := gzip.NewWriter(f)
	h := sha256.New()
	if err := tarDir(dir, io.MultiWriter(zw, h)); err != nil {
		return "", 0, err
	}
	if err := zw.Close(); err != nil {
		return "", 0, err
	}
	if err := f.Close(); err != nil {
		return "", 0, err
	}
	n := 0
	err = filepath.WalkDir(dir, func(p string, _ fs.DirEntry, err error) error {
		if err == nil && p != dir {
			n++
		}
		return err
	})
	return hex.EncodeToString(h.Sum(nil)), n, err
}

// envPhases holds each sandbox's time in the workload's phases; a zero
// total marks a sandbox that failed.
type envPhases struct {
	setup, calls, teardown, total []time.Duration
	fails                         int
}

func newEnvPhases(n int) *envPhases {
	return &envPhases{setup: make([]time.Duration, n), calls: make([]time.Duration, n),
		teardown: make([]time.Duration, n), total: make([]time.Duration, n)}
}

// ok counts the sandboxes that went through every phase.
func (p *envPhases) ok() int {
	n := 0
	for _, d := range p.total {
		if d > 0 {
			n++
		}
	}
	return n
}

// rows gives setup, tool calls, teardown and the whole workload, each over
// the sandboxes that completed; throughput is sandboxes/s of the workload.
func (p *envPhases) rows(o benchOpts, wall time.Duration) []benchRow {
	done := func(ds []time.Duration) []time.Duration {
		var out []time.Duration
		for i, d := range ds {
			if p.total[i] > 0 {
				out = append(out, d)
			}
		}
		return out
	}
	mk := func(name string, ds []time.Duration) benchRow {
		return row(name, o.count, o.concurrency, done(ds), p.fails, wall)
	}
	return []benchRow{
		mk("setup: create → ready", p.setup),
		mk(fmt.Sprintf("tool calls: %d execs", len(envToolCalls)), p.calls),
		mk("teardown: delete", p.teardown),
		mk("workload: per sandbox", p.total),
	}
}

// envRunDsec runs the workload through the API.
func envRunDsec(ctx context.Context, c *dsec.Client, o benchOpts, trees []*envTree) (*envPhases, time.Duration) {
	label := fmt.Sprintf("bench-env-%d", time.Now().UnixNano())
	defer c.DeleteSandboxes(context.Background(), map[string]string{"bench": label})
	spec := api.SandboxSpec{Base: trees[0].ref, Workspace: trees[1].ref, Toolkits: []string{trees[2].ref},
		Labels: map[string]string{"bench": label}}
	ph := newEnvPhases(o.count)
	var done atomic.Int64
	stopProgress := startProgress("dsec: sandboxes done", o.count, &done)
	fmt.Fprintf(os.Stderr, "dsec: %d sandboxes on %s + %s + %s, %d at a time...\n",
		o.count, spec.Base, spec.Workspace, spec.Toolkits[0], o.concurrency)
	_, fails, wall, ferr := runParallel(o.count, o.concurrency, func(i int) error {
		defer done.Add(1)
		t0 := time.Now()
		sb, err := c.CreateSandbox(ctx, spec)
		if err != nil {
			return fmt.Errorf("create: %w", err)
		}
		t1 := time.Now()
		for _, cmd := range envToolCalls {
			r, err := c.Exec(ctx, sb.ID, api.ExecRequest{Cmd: cmd})
			if err == nil && r.ExitCode != 0 {
				err = fmt.Errorf("exit %d: %s", r.ExitCode, r.Stderr)
			}
			if err != nil {
				_ = c.DeleteSandbox(context.Background(), sb.ID)
				return fmt.Errorf("tool call %q: %w", cmd, err)
			}
		}
		t2 := time.Now()
		if err := c.DeleteSandbox(ctx, sb.ID); err != nil {
			return fmt.Errorf("delete: %w", err)
		}
		t3 := time.Now()
		ph.setup[i], ph.calls[i], ph.teardown[i], ph.total[i] = t1.Sub(t0), t2.Sub(t1), t3.Sub(t2), t3.Sub(t0)
		return nil
	})
	stopProgress()
	ph.fails = fails
	if ferr != nil {
		fmt.Fprintf(os.Stderr, "first dsec failure: %v\n", ferr)
	}
	return ph, wall
}

// envRunBaseline runs the same workload on tar.gz extraction: per sandbox
// a fresh directory next to the daemon's state dir (the filesystem the
// sandboxes' writable layers live on), the three archives extracted into
// it with tar, a bundle, `run -d`, the tool calls with `exec`, then
// `delete -f` and the directory removed.
func envRunBaseline(ctx context.Context, o benchOpts, rt string, trees []*envTree) (*envPhases, time.Duration, error) {
	if os.Geteuid() != 0 {
		return nil, 0, errors.New("needs root to run the runtime")
	}
	tarBin, err := exec.LookPath("tar")
	if err != nil {
		return nil, 0, fmt.Errorf("finding tar: %w", err)
	}
	abs, err := filepath.Abs(o.stateDir)
	if err != nil {
		return nil, 0, err
	}
	dir, err := os.MkdirTemp(filepath.Dir(abs), ".dsec-bench-env-")
	if err != nil {
		return nil, 0, err
	}
	root := filepath.Join(dir, "state")
	defer func() {
		ents, _ := os.ReadDir(dir)
		for _, e := range ents {
			if strings.HasPrefix(e.Name(), "bench-") {
				_ = exec.Command(rt, "--root", root, "delete", "-f", e.Name()).Run()
			}
		}
		_ = os.RemoveAll(dir)
	}()
	ph := newEnvPhases(o.count)
	var done atomic.Int64
	stopProgress := startProgress("baseline: sandboxes done", o.count, &done)
	fmt.Fprintf(os.Stderr, "baseline: %d × (tar -xzf ×3, %s run -d, exec ×%d, delete -f), %d at a time...\n",
		o.count, rt, len(envToolCalls), o.concurrency)
	_, fails, wall, ferr := runParallel(o.count, o.concurrency, func(i int) error {
		defer done.Add(1)
		if ctx.Err() != nil {
			return ctx.Err()
		}
		name := fmt.Sprintf("bench-%d", i)
		cd := filepath.Join(dir, name)
		rootfs := filepath.Join(cd, "rootfs")
		t0 := time.Now()
		if err := os.MkdirAll(rootfs, 0o755); err != nil {
			return err
		}
		for _, t := range trees {
			if out, err := exec.Command(tarBin, "-xzf", t.tgz, "-C", rootfs).CombinedOutput(); err != nil {
				return fmt.Errorf("extracting %s: %v: %s", t.kind, err, out)
			}
		}
		if err := os.WriteFile(filepath.Join(cd, "config.json"), baselineSpec(rootfs), 0o600); err != nil {
			return err
		}
		logPath := filepath.Join(cd, "runtime.log")
		if err := exec.Command(rt, "--root", root, "--log", logPath, "run", "-d", "--bundle", cd, name).Run(); err != nil {
			out, _ := os.ReadFile(logPath)
			return fmt.Errorf("%s run: %v: %s", rt, err, out)
		}
		t1 := time.Now()
		for _, cmd := range envToolCalls {
			if out, err := exec.Command(rt, "--root", root, "exec", name, "/bin/sh", "-c", cmd).CombinedOutput(); err != nil {
				return fmt.Errorf("tool call %q: %v: %s", cmd, err, out)
			}
		}
		t2 := time.Now()
		if out, err := exec.Command(rt, "--root", root, "delete", "-f", name).CombinedOutput(); err != nil {
			return fmt.Errorf("%s delete: %v: %s", rt, err, out)
		}
		if err := os.RemoveAll(cd); err != nil {
			return err
		}
		t3 := time.Now()
		ph.setup[i], ph.calls[i], ph.teardown[i], ph.total[i] = t1.Sub(t0), t2.Sub(t1), t3.Sub(t2), t3.Sub(t0)
		return nil
	})
	stopProgress()
	ph.fails = fails
	if ferr != nil {
		fmt.Fprintf(os.Stderr, "first baseline failure: %v\n", ferr)
	}
	return ph, wall, nil
}
