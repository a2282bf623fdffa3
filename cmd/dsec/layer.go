package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dsecproject/dsec/api"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

var layerKinds = []string{api.KindBase, api.KindWorkspace, api.KindToolkit, api.KindSnapshot}

func runLayer(ctx context.Context, args []string) error {
	return dispatchGroup(ctx, "layer", []subcommand{
		{"build", "build a layer from a directory or tar", layerBuild},
		{"list", "list layers", layerList},
		{"get", "show one layer", layerGet},
		{"delete", "remove a layer ref", layerDelete},
		{"push", "store a layer in an OCI registry", layerPush},
		{"add", "register a layer kept in an OCI registry, read on demand", layerAdd},
		{"gc", "remove layer blobs no ref names and no sandbox uses", layerGC},
	}, args)
}

func layerBuild(ctx context.Context, args []string) error {
	fs := newCmdFlags("layer build", "--kind K --name N --tag T [--json] DIR_OR_TAR",
		"Build a layer KIND/NAME:TAG. A directory is tarred on the fly (modes,\n"+
			"symlinks and hard links kept); a file (.tar or .tar.gz) is sent as is.\n"+
			"Progress goes to stderr, the layer to stdout.")
	kind := fs.String("kind", "", "layer kind: "+strings.Join(layerKinds, " | ")+" (required)")
	name := fs.String("name", "", "layer name (required)")
	tag := fs.String("tag", "", "layer tag (required: refs have no implicit latest)")
	asJSON := fs.Bool("json", false, "print the API response as JSON")
	pos, err := fs.parseN(args, 1, 1)
	if err != nil {
		return err
	}
	if !slices.Contains(layerKinds, *kind) {
		return fmt.Errorf("layer build: --kind must be one of %s", strings.Join(layerKinds, ", "))
	}
	if *name == "" {
		return fmt.Errorf("layer build: --name is required")
	}
	if *tag == "" {
		return fmt.Errorf("layer build: --tag is required")
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	layer, _, err := uploadLayer(ctx, c, *kind, *name, *tag, pos[0])
	if err != nil {
		return err
	}
	if *asJSON {
		return printJSON(layer)
	}
	printf(os.Stdout, "%s %s %s\n", layer.Ref, layer.Digest, humanBytes(layer.SizeBytes))
	return nil
}

// uploadLayer has the server build kind/name:tag from src, a directory
// (tarred on the fly) or a .tar/.tar.gz file (sent as is), with upload
// progress on stderr. The stats describe the tar made from a directory
// and are zero for a file. `layer build` and `image bootstrap` share it.
func uploadLayer(ctx context.Context, c *dsec.Client, kind, name, tag, src string) (*api.Layer, tarStats, error) {
	var st tarStats
	fi, err := os.Stat(src)
	if err != nil {
		return nil, st, err
	}
	if !fi.IsDir() && !fi.Mode().IsRegular() {
		return nil, st, fmt.Errorf("%s is neither a directory nor a tar file", src)
	}
	sent := &countingReader{}
	stopProgress := showProgress(sent)
	var layer *api.Layer
	send := func(body io.Reader) error {
		var err error
		layer, err = c.BuildLayer(ctx, kind, name, tag, body)
		return err
	}
	if fi.IsDir() {
		st, err = streamDirTar(src, sent, send)
	} else {
		var f *os.File
		if f, err = os.Open(src); err == nil {
			sent.r = f
			err = send(sent) // the SDK closes sent, and so f
		}
	}
	stopProgress()
	if err != nil {
		return nil, st, err
	}
	if st.Skipped > 0 {
		fmt.Fprintf(os.Stderr, "dsec: skipped %d sockets\n", st.Skipped)
	}
	return layer, st, nil
}

// countingReader counts the bytes read through it; Close reaches the
// underlying reader so that net/http can stop a producer on an early answer.
type countingReader struct {
	r io.Reader
	n atomic.Int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n.Add(int64(n))
	return n, err
}

func (c *countingReader) Close() error {
	if cl, ok := c.r.(io.Closer); ok {
		return cl.Close()
	}
	return nil
}

// showProgress reports the bytes read through r on stderr: a line redrawn
// twice a second on a terminal, and a summary when the returned stop is
// called.
func showProgress(r *countingReader) (stop func()) {
	start := time.Now()
	quit := make(chan struct{})
	var wg sync.WaitGroup
	if isTerminal(os.Stderr) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			t := time.NewTicker(500 * time.Millisecond)
			defer t.Stop()
			for {
				select {
				case <-quit:
					fmt.Fprint(os.Stderr, "\r\033[K")
					return
				case <-t.C:
					fmt.Fprintf(os.Stderr, "\r\033[Ksent %s", humanBytes(r.n.Load()))
				}
			}
		}()
	}
	return func() {
		close(quit)
		wg.Wait()
		el := time.Since(start)
		fmt.Fprintf(os.Stderr, "sent %s in %s\n", humanBytes(r.n.Load()), el.Round(100*time.Millisecond))
	}
}

func layerList(ctx context.Context, args []string) error {
	fs := newCmdFlags("layer list", "[--kind K] [--json]", "List the layer catalog.")
	kind := fs.String("kind", "", "only this kind: "+strings.Join(layerKinds, " | "))
	asJSON := fs.Bool("json", false, "print a JSON array")
	if _, err := fs.parseN(args, 0, 0); err != nil {
		return err
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	layers, err := c.ListLayers(ctx, *kind)
	if err != nil {
		return err
	}
	if *asJSON {
		return printJSONList(layers)
	}
	tw := newTable()
	tw.printf("REF\tDIGEST\tSIZE\tAGE\n")
	now := time.Now()
	for _, l := range layers {
		tw.printf("%s\t%s\t%s\t%s\n", orDash(l.Ref), shortDigest(l.Digest), humanBytes(l.SizeBytes), humanAge(l.CreatedAt, now))
	}
	return tw.Flush()
}

// shortDigest keeps "sha256:" and 12 hex digits, as image tools do.
func shortDigest(d string) string {
	const keep = len("sha256:") + 12
	if strings.HasPrefix(d, "sha256:") && len(d) > keep {
		return d[:keep]
	}
	return d
}

func layerGet(ctx context.Context, args []string) error {
	fs := newCmdFlags("layer get", "[--json] REF_OR_DIGEST", "Show one layer, by ref (kind/name:tag) or digest.")
	asJSON := fs.Bool("json", false, "print the API response as JSON")
	pos, err := fs.parseN(args, 1, 1)
	if err != nil {
		return err
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	l, err := c.GetLayer(ctx, pos[0])
	if err != nil {
		return err
	}
	if *asJSON {
		return printJSON(l)
	}
	tw := newTable()
	tw.printf("Ref:\t%s\n", orDash(l.Ref))
	tw.printf("Digest:\t%s\n", l.Digest)
	tw.printf("Kind:\t%s\n", l.Kind)
	tw.printf("Size:\t%s (%d bytes)\n", humanBytes(l.SizeBytes), l.SizeBytes)
	if !l.CreatedAt.IsZero() {
		tw.printf("Created:\t%s\n", l.CreatedAt.Local().Format(time.RFC3339))
	}
	return tw.Flush()
}

func layerDelete(ctx context.Context, args []string) error {
	fs := newCmdFlags("layer delete", "REF", "Remove a ref from the layer catalog.")
	pos, err := fs.parseN(args, 1, 1)
	if err != nil {
		return err
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	return c.DeleteLayer(ctx, pos[0])
}

func layerGC(ctx context.Context, args []string) error {
	fs := newCmdFlags("layer gc", "[--dry-run] [--json]",
		"Remove the layer blobs that no ref names and no sandbox uses: those of refs\n"+
			"re-pointed with replace, and what a build or import that died left (its pins\n"+
			"go stale 10 minutes after it died). Takes a builder or admin key of the root\n"+
			"project; every node must answer (a blob is kept while any sandbox uses it).")
	asJSON := fs.Bool("json", false, "print the API response as JSON")
	dry := fs.Bool("dry-run", false, "list what would be removed, and remove nothing")
	if _, err := fs.parseN(args, 0, 0); err != nil {
		return err
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	gc := c.GCLayers
	if *dry {
		gc = c.UnusedLayers
	}
	res, err := gc(ctx)
	if err != nil {
		return err
	}
	if *asJSON {
		return printJSON(res)
	}
	verb, done := "removed", "removed"
	if res.DryRun {
		verb, done = "would remove", "would be removed"
	}
	for _, d := range res.Removed {
		printf(os.Stdout, "%s %s\n", verb, d)
	}
	printf(os.Stdout, "%d blobs %s, %s\n", len(res.Removed), done, humanBytes(res.RemovedBytes))
	return nil
}

func runNodes(ctx context.Context, args []string) error {
	fs := newCmdFlags("nodes", "[--json]", "List the edges the apiserver knows, with capacity and sandbox counts\n(and, for a node counted as down, why).")
	asJSON := fs.Bool("json", false, "print a JSON array")
	if _, err := fs.parseN(args, 0, 0); err != nil {
		return err
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	nodes, err := c.ListNodes(ctx)
	if err != nil {
		return err
	}
	if *asJSON {
		return printJSONList(nodes)
	}
	tw := newTable()
	tw.printf("NAME\tSTATUS\tBACKENDS\tCPU\tMEMORY\tRUNNING\tSANDBOXES\tMAX\n")
	var down []string
	for _, n := range nodes {
		status := "healthy"
		if !n.Healthy {
			status = "unhealthy"
			if n.Unhealthy != "" {
				down = append(down, n.Name+": "+n.Unhealthy)
			}
		}
		total := 0
		for _, v := range n.Counts {
			total += v
		}
		tw.printf("%s\t%s\t%s\t%g\t%s\t%d\t%d\t%d\n", n.Name, status, orDash(strings.Join(n.Backends, ",")),
			n.Capacity.CPU, humanBytes(n.Capacity.MemoryMB<<20), n.Counts[api.StateRunning], total, n.Capacity.MaxSandboxes)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	// Why a node is down, under the table (a reason is a sentence).
	for _, d := range down {
		printf(os.Stdout, "%s\n", d)
	}
	return nil
}

func runHealth(ctx context.Context, args []string) error {
	fs := newCmdFlags("health", "", "Check that the API endpoint answers GET /healthz.")
	if _, err := fs.parseN(args, 0, 0); err != nil {
		return err
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	if err := c.Health(ctx); err != nil {
		return err
	}
	fmt.Printf("ok %s\n", c.Endpoint())
	return nil
}

func layerPush(ctx context.Context, args []string) error {
	fs := newCmdFlags("layer push", "[--insecure] [--username U --password-stdin] [--docker-config PATH] [--chunk-kib N] [--json] REF oci://HOST/REPO:TAG",
		"Store layer REF in an OCI registry as an artifact: its EROFS image, a chunk\n"+
			"index (what edges read on demand by) and a small config. Blobs the registry\n"+
			"already has are not sent. The server does the push: HOST is reached from it.\n"+
			"Credentials: --username with --password-stdin, else the registry's entry in\n"+
			"--docker-config (default $DOCKER_CONFIG/config.json or ~/.docker/config.json),\n"+
			"sent to the server for this push only.")
	insecure := fs.Bool("insecure", false, "talk plain HTTP to the registry")
	creds := addCredFlags(fs)
	chunkKiB := fs.Int("chunk-kib", 256, "KiB each chunk of the index covers: what an edge fetches at least per miss (4 to 16384, a multiple of 4)")
	asJSON := fs.Bool("json", false, "print the API response as JSON")
	pos, err := fs.parseN(args, 2, 2)
	if err != nil {
		return err
	}
	if *chunkKiB < 4 || *chunkKiB > 16384 || *chunkKiB%4 != 0 {
		return fmt.Errorf("layer push: --chunk-kib %d: want a multiple of 4 from 4 to 16384", *chunkKiB)
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	req := api.LayerPushRequest{Ref: pos[0], Target: pos[1], Insecure: *insecure, ChunkSize: *chunkKiB << 10}
	if req.Username, req.Password, err = creds.resolve("layer push", pos[1]); err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "pushing %s to %s ...\n", pos[0], pos[1])
	res, err := c.PushLayer(ctx, req)
	if err != nil {
		return err
	}
	if *asJSON {
		return printJSON(res)
	}
	fmt.Printf("pushed %s to %s: %s, %d blob(s) sent, manifest %s\n", res.Ref, res.Target, humanBytes(res.SizeBytes), res.Uploaded, res.Manifest)
	return nil
}

func layerAdd(ctx context.Context, args []string) error {
	fs := newCmdFlags("layer add", "[--insecure] [--username U --password-stdin] [--docker-config PATH] [--pull lazy|full] [--replace] [--json] REF oci://HOST/REPO:TAG",
		"Register REF as the layer artifact at oci://HOST/REPO:TAG (made by dsec layer\n"+
			"push) without copying it: edges read its image from the registry, chunk by\n"+
			"chunk as sandboxes touch it (--pull lazy, the default), or whole before the\n"+
			"first sandbox starts (--pull full). The server checks the artifact and that\n"+
			"the registry serves byte ranges before it records the layer. Credentials, as\n"+
			"for layer push, are the server's for this check only: nodes read with their\n"+
			"own (dsec up/edge --registry-config).")
	insecure := fs.Bool("insecure", false, "talk plain HTTP to the registry")
	creds := addCredFlags(fs)
	pull := fs.String("pull", api.PullLazy, "lazy (read on demand) or full (fetched whole to each node first)")
	replace := fs.Bool("replace", false, "re-point REF if it exists")
	asJSON := fs.Bool("json", false, "print the API response as JSON")
	pos, err := fs.parseN(args, 2, 2)
	if err != nil {
		return err
	}
	if *pull != api.PullLazy && *pull != api.PullFull {
		return fmt.Errorf("layer add: --pull %q: want lazy or full", *pull)
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	req := api.LayerAddRequest{Ref: pos[0], Source: pos[1], Insecure: *insecure, Pull: *pull, Replace: *replace}
	if req.Username, req.Password, err = creds.resolve("layer add", pos[1]); err != nil {
		return err
	}
	l, err := c.AddLayer(ctx, req)
	if err != nil {
		return err
	}
	if *asJSON {
		return printJSON(l)
	}
	fmt.Printf("%s\t%s\t%s\t%s (pull %s)\n", l.Ref, l.Digest, humanBytes(l.SizeBytes), l.Remote.Source, l.Remote.Pull)
	return nil
}
