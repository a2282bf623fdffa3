package main

import (
	"archive/tar"
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/signal"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/hostfs"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

// `dsec bench merge` prices layer merging (DSec §3.4): one image of many
// layers imported as one EROFS layer per image layer, merged into a few
// runs, and merged whole, then sandboxes created on each, interleaved one
// at a time so that the machine's noise falls on all alike. The image is
// real content: a busybox root with the host's python3, and the host's
// Python standard library spread over the other layers, as pip layers
// would be; each sandbox's task imports modules from many of them.

type mergeBenchOpts struct {
	layers   int
	count    int
	midRuns  int
	jsonOut  bool
	keep     bool
	pyLib    string
	taskCmd  string
	userNS   *bool
	progress io.Writer
}

// mergeVariant is one way of importing the bench image.
type mergeVariant struct {
	Name       string `json:"name"`
	MergeUnder int64  `json:"merge_under_bytes"`
	ref        string

	Layers      int     `json:"layers_stacked"`
	StoredBytes int64   `json:"stored_bytes"`
	ImportMS    int64   `json:"import_ms"`
	NodeMounts  int     `json:"node_mounts_first_sandbox"`
	HostMounts  float64 `json:"host_mounts_per_sandbox"`
	FirstMS     float64 `json:"first_create_ms"`
	CreateP50   float64 `json:"create_p50_ms"`
	CreateP99   float64 `json:"create_p99_ms"`
	TaskP50     float64 `json:"task_p50_ms"`
	TaskP99     float64 `json:"task_p99_ms"`
	Failures    int     `json:"failures"`

	creates, tasks []time.Duration
	ids            []string
}

func runBenchMerge(args []string) error {
	var o mergeBenchOpts
	f := newCmdFlags("bench merge", "[flags]",
		"Import one image of --layers layers three ways: one EROFS layer per image\n"+
			"layer (--merge-under 1), merged into --mid-runs runs, and merged whole\n"+
			"(the default import); then create --count sandboxes on each, one at a\n"+
			"time, interleaved, each running a task that imports Python modules\n"+
			"spread over the layers. Prints layers stacked, mounts on the host, first\n"+
			"(cold) and warm create latency and task latency per variant.\n"+
			"Needs a running `dsec up` on this host, as root (it reads the host's\n"+
			"mount table).")
	f.IntVar(&o.layers, "layers", 16, "image layers (2-64): a base, and the Python library spread over the rest")
	f.IntVar(&o.count, "count", 30, "sandboxes created per variant")
	f.IntVar(&o.midRuns, "mid-runs", 4, "runs the middle variant merges the image into (its --merge-under is the image size divided by this)")
	f.BoolVar(&o.jsonOut, "json", false, "print JSON")
	f.BoolVar(&o.keep, "keep", false, "keep the layers (base/bench-merge-*) afterwards")
	f.StringVar(&o.pyLib, "python-lib", "", "the host's Python library to spread over the layers (default: python3's own)")
	f.StringVar(&o.taskCmd, "task", "", "the task each sandbox runs (default: python3 importing a dozen modules)")
	f.Var(optBool{&o.userNS}, "userns", "user-namespace sandboxes (--userns=false: none; left out: the node's default)")
	if _, err := f.parseN(args, 0, 0); err != nil {
		return err
	}
	if o.layers < 2 || o.layers > 64 || o.count < 1 || o.midRuns < 2 || o.midRuns >= o.layers {
		return errors.New("bench merge: --layers is 2-64, --count at least 1, --mid-runs between 2 and --layers minus 1")
	}
	o.progress = os.Stderr
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	c, err := newClient()
	if err != nil {
		return err
	}
	work, err := os.MkdirTemp("", "dsec-bench-merge-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)
	archive, sizes, err := mergeBenchImage(work, &o)
	if err != nil {
		return err
	}
	var total int64
	for _, s := range sizes {
		total += s
	}
	fmt.Fprintf(o.progress, "image: %d layers, %s\n", len(sizes), humanBytes(total))

	vs := []*mergeVariant{
		{Name: "per image layer", MergeUnder: 1},
		{Name: fmt.Sprintf("merged under %s", humanBytes(total/int64(o.midRuns))), MergeUnder: total / int64(o.midRuns)},
		{Name: "merged whole"},
	}
	for i, v := range vs {
		v.ref = fmt.Sprintf("base/bench-merge-%d:v%d", i, len(sizes))
		_ = c.DeleteLayer(ctx, v.ref) // a leftover of an interrupted run
		if err := v.importImage(ctx, c, archive); err != nil {
			return err
		}
		if !o.keep {
			defer c.DeleteLayer(context.Background(), v.ref)
		}
	}
	if err := runMergeBench(ctx, c, &o, vs); err != nil {
		return err
	}
	return printMergeBench(vs, &o)
}

// importImage imports the archive as v asks and records what it stored.
func (v *mergeVariant) importImage(ctx context.Context, c *dsec.Client, archive string) error {
	f, err := os.Open(archive)
	if err != nil {
		return err
	}
	defer f.Close()
	res, err := c.ImportImage(ctx, f, dsec.ImportOptions{Ref: v.ref, MergeUnder: v.MergeUnder}, nil)
	if err != nil {
		return fmt.Errorf("importing the bench image (%s): %w", v.Name, err)
	}
	v.ImportMS = res.DurationMS
	v.Layers = 1
	for _, l := range res.Layers {
		v.Layers += len(l.Lowers)
		v.StoredBytes += l.SizeBytes
		v.StoredBytes += l.LowersBytes
	}
	fmt.Fprintf(os.Stderr, "imported %s: %d layers in %d ms\n", v.Name, v.Layers, v.ImportMS)
	return nil
}

// runMergeBench creates the variants' sandboxes one at a time, in turn,
// timing each create and its task, and counts the host's mounts.
func runMergeBench(ctx context.Context, c *dsec.Client, o *mergeBenchOpts, vs []*mergeVariant) error {
	task := o.taskCmd
	if task == "" {
		task = "python3 -S -c 'import json, email.parser, http.client, xml.dom.minidom, asyncio, sqlite3, " +
			"decimal, unittest, logging.handlers, argparse, csv, difflib' 2>&1 || python3 -S -c 'import json, email.parser, http.client'"
	}
	label := map[string]string{"bench": "merge"}
	defer func() {
		for _, v := range vs {
			for _, id := range v.ids {
				_ = c.DeleteSandbox(context.Background(), id)
			}
		}
	}()
	// Each create is a class of its own (its pids limit differs), so no
	// warm pool serves it: every create mounts and starts a sandbox.
	seq := int64(0)
	create := func(v *mergeVariant) (time.Duration, error) {
		seq++
		t0 := time.Now()
		sb, err := c.CreateSandbox(ctx, api.SandboxSpec{Base: v.ref, Labels: label, UserNS: o.userNS, Pids: 2000 + seq})
		d := time.Since(t0)
		if err != nil {
			return d, err
		}
		v.ids = append(v.ids, sb.ID)
		t1 := time.Now()
		res, err := c.Exec(ctx, sb.ID, api.ExecRequest{Cmd: task, Timeout: 120})
		if err == nil && res.ExitCode != 0 {
			err = fmt.Errorf("task exited %d: %s%s", res.ExitCode, res.Stdout, res.Stderr)
		}
		if err != nil {
			return d, err
		}
		v.tasks = append(v.tasks, time.Since(t1))
		return d, nil
	}
	// The first sandbox of each variant mounts its layers on the node.
	for _, v := range vs {
		before, err := hostMounts()
		if err != nil {
			return err
		}
		d, err := create(v)
		if err != nil {
			return fmt.Errorf("first sandbox on %s: %w", v.ref, err)
		}
		after, _ := hostMounts()
		v.FirstMS, v.NodeMounts = float64(d.Microseconds())/1000, after-before
	}
	for i := 0; i < o.count-1; i++ {
		for _, v := range vs {
			d, err := create(v)
			if err != nil {
				v.Failures++
				fmt.Fprintf(os.Stderr, "%s: %v\n", v.Name, err)
				continue
			}
			v.creates = append(v.creates, d)
		}
		if (i+1)%10 == 0 {
			fmt.Fprintf(os.Stderr, "%d/%d sandboxes per variant\n", i+2, o.count)
		}
	}
	// Mounts per sandbox: what deleting each variant's sandboxes but its
	// first gives back (the first holds the node's mounts of its layers).
	for _, v := range vs {
		before, _ := hostMounts()
		for _, id := range v.ids[1:] {
			_ = c.DeleteSandbox(ctx, id)
		}
		after, _ := hostMounts()
		if len(v.ids) > 1 {
			v.HostMounts = float64(before-after) / float64(len(v.ids)-1)
		}
		v.ids = v.ids[:1]
		v.CreateP50, v.CreateP99 = pct(v.creates, .5), pct(v.creates, .99)
		v.TaskP50, v.TaskP99 = pct(v.tasks, .5), pct(v.tasks, .99)
	}
	return nil
}

// hostMounts counts the host's mounts (this process's mount namespace).
func hostMounts() (int, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return 0, err
	}
	defer f.Close()
	n := 0
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		n++
	}
	return n, sc.Err()
}

func printMergeBench(vs []*mergeVariant, o *mergeBenchOpts) error {
	if o.jsonOut {
		return printJSON(map[string]any{"time": time.Now().UTC(), "variants": vs})
	}
	fmt.Printf("%-22s %6s %10s %8s %11s %12s %9s %9s %9s %9s %9s %5s\n", "VARIANT", "LAYERS", "STORED", "IMPORT",
		"NEW MOUNTS", "MOUNTS/SBX", "FIRST ms", "P50 ms", "P99 ms", "TASK P50", "TASK P99", "FAIL")
	for _, v := range vs {
		fmt.Printf("%-22s %6d %10s %6dms %11d %12.1f %9.1f %9.1f %9.1f %9.1f %9.1f %5d\n", v.Name, v.Layers,
			humanBytes(v.StoredBytes), v.ImportMS, v.NodeMounts, v.HostMounts, v.FirstMS, v.CreateP50, v.CreateP99,
			v.TaskP50, v.TaskP99, v.Failures)
	}
	per, whole := vs[0], vs[len(vs)-1]
	if whole.CreateP50 > 0 && whole.TaskP50 > 0 {
		fmt.Printf("merging whole saves %d layers and %.1f host mounts per sandbox; create p50 %.2fx, task p50 %.2fx, first create %.2fx of one layer per image layer\n",
			per.Layers-whole.Layers, per.HostMounts-whole.HostMounts, whole.CreateP50/per.CreateP50, whole.TaskP50/per.TaskP50, whole.FirstMS/per.FirstMS)
	}
	return nil
}

// mergeBenchImage writes the bench image as an OCI layout tar under work
// and returns its path and its layers' sizes: layer 0 a busybox root with
// the host's python3, the others the Python library's entries dealt out
// in turn (largest first, so the layers come out of similar size).
func mergeBenchImage(work string, o *mergeBenchOpts) (string, []int64, error) {
	lib := o.pyLib
	if lib == "" {
		target, err := filepath.EvalSymlinks("/usr/bin/python3")
		if err != nil {
			return "", nil, fmt.Errorf("bench merge: no python3 on the host (%v): give --python-lib and --task", err)
		}
		lib = filepath.Join("/usr/lib", filepath.Base(target))
	}
	if fi, err := os.Stat(lib); err != nil || !fi.IsDir() {
		return "", nil, fmt.Errorf("bench merge: %s is not a directory (give --python-lib)", lib)
	}
	root := filepath.Join(work, "root")
	opts := hostfs.Options{}
	if o.taskCmd == "" {
		opts.Extra = []string{"/usr/bin/python3"}
	}
	if err := hostfs.Build(root, opts); err != nil {
		return "", nil, err
	}
	entries, err := os.ReadDir(lib)
	if err != nil {
		return "", nil, err
	}
	type item struct {
		name string
		size int64
	}
	var items []item
	for _, e := range entries {
		n, err := treeBytes(filepath.Join(lib, e.Name()))
		if err != nil {
			return "", nil, err
		}
		items = append(items, item{e.Name(), n})
	}
	sort.Slice(items, func(i, j int) bool { return items[i].size > items[j].size })
	groups := make([][]string, o.layers-1)
	load := make([]int64, o.layers-1)
	for _, it := range items {
		k := 0
		for j := range load {
			if load[j] < load[k] {
				k = j
			}
		}
		groups[k] = append(groups[k], it.name)
		load[k] += it.size
	}

	blobs := filepath.Join(work, "oci", "blobs", "sha256")
	if err := os.MkdirAll(blobs, 0o755); err != nil {
		return "", nil, err
	}
	var descs []map[string]any
	var diffIDs []string
	var sizes []int64
	addLayer := func(write func(*tar.Writer) error) error {
		tmp := filepath.Join(work, "layer.tar")
		f, err := os.Create(tmp)
		if err != nil {
			return err
		}
		h := sha256.New()
		tw := tar.NewWriter(io.MultiWriter(f, h))
		err = write(tw)
		if cerr := tw.Close(); err == nil {
			err = cerr
		}
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return err
		}
		d := hex.EncodeToString(h.Sum(nil))
		fi, err := os.Stat(tmp)
		if err != nil {
			return err
		}
		if err := os.Rename(tmp, filepath.Join(blobs, d)); err != nil {
			return err
		}
		descs = append(descs, map[string]any{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": "sha256:" + d, "size": fi.Size()})
		diffIDs = append(diffIDs, "sha256:"+d)
		sizes = append(sizes, fi.Size())
		return nil
	}
	if err := addLayer(func(tw *tar.Writer) error { return tarInto(tw, root, "") }); err != nil {
		return "", nil, err
	}
	rel := strings.TrimPrefix(lib, "/")
	for _, g := range groups {
		err := addLayer(func(tw *tar.Writer) error {
			// The parents, so each layer stands alone.
			parts := strings.Split(rel, "/")
			for i := range parts {
				if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: strings.Join(parts[:i+1], "/") + "/", Mode: 0o755,
					ModTime: time.Unix(0, 0)}); err != nil {
					return err
				}
			}
			for _, name := range g {
				if err := tarInto(tw, filepath.Join(lib, name), rel+"/"+name); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			return "", nil, err
		}
	}
	put := func(b []byte) (map[string]any, error) {
		sum := sha256.Sum256(b)
		d := hex.EncodeToString(sum[:])
		return map[string]any{"digest": "sha256:" + d, "size": len(b)}, os.WriteFile(filepath.Join(blobs, d), b, 0o644)
	}
	cfg, _ := json.Marshal(map[string]any{"architecture": "amd64", "os": "linux",
		"rootfs": map[string]any{"type": "layers", "diff_ids": diffIDs}})
	cd, err := put(cfg)
	if err != nil {
		return "", nil, err
	}
	cd["mediaType"] = "application/vnd.oci.image.config.v1+json"
	man, _ := json.Marshal(map[string]any{"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
		"config": cd, "layers": descs})
	md, err := put(man)
	if err != nil {
		return "", nil, err
	}
	md["mediaType"] = "application/vnd.oci.image.manifest.v1+json"
	idx, _ := json.Marshal(map[string]any{"schemaVersion": 2, "manifests": []any{md}})
	if err := os.WriteFile(filepath.Join(work, "oci", "index.json"), idx, 0o644); err != nil {
		return "", nil, err
	}
	if err := os.WriteFile(filepath.Join(work, "oci", "oci-layout"), []byte(`{"imageLayoutVersion":"1.0.0"}`), 0o644); err != nil {
		return "", nil, err
	}
	archive := filepath.Join(work, "image.tar")
	f, err := os.Create(archive)
	if err != nil {
		return "", nil, err
	}
	tw := tar.NewWriter(f)
	err = tarInto(tw, filepath.Join(work, "oci"), "")
	if cerr := tw.Close(); err == nil {
		err = cerr
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return archive, sizes, err
}

// tarInto writes the tree at dir into tw under the name prefix ("" for
// its root's contents): directories, regular files and symlinks, owners
// and modes kept.
func tarInto(tw *tar.Writer, dir, prefix string) error {
	return filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		name := filepath.ToSlash(filepath.Join(prefix, rel))
		if rel == "." {
			if prefix == "" {
				return nil
			}
			name = prefix
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		link := ""
		if info.Mode()&os.ModeSymlink != 0 {
			if link, err = os.Readlink(p); err != nil {
				return err
			}
		} else if !info.Mode().IsRegular() && !info.IsDir() {
			return nil // sockets, fifos, devices: not in a library tree
		}
		h, err := tar.FileInfoHeader(info, link)
		if err != nil {
			return err
		}
		h.Name = name
		if info.IsDir() {
			h.Name += "/"
		}
		h.Uname, h.Gname = "", ""
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if info.Mode().IsRegular() {
			f, err := os.Open(p)
			if err != nil {
				return err
			}
			_, err = io.Copy(tw, f)
			f.Close()
			return err
		}
		return nil
	})
}

// treeBytes is the regular-file bytes under p.
func treeBytes(p string) (int64, error) {
	var n int64
	err := filepath.WalkDir(p, func(_ string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.Type().IsRegular() {
			info, err := d.Info()
			if err != nil {
				return err
			}
			n += info.Size()
		}
		return nil
	})
	return n, err
}
