package cluster

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

// TestEveryCallThroughBothServers: a sandbox made through one apiserver is
// served by the other for every per-sandbox call, streamed ones included.
func TestEveryCallThroughBothServers(t *testing.T) {
	need(t)
	for made := range 2 {
		used := 1 - made
		t.Run(fmt.Sprintf("made-on-s%d", made), func(t *testing.T) {
			sb, err := c.perServer[made].CreateSandbox(ctx(t), api.SandboxSpec{Base: baseRef, Labels: map[string]string{"job": "every"}})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = c.client.DeleteSandbox(context.Background(), sb.ID) })
			cl := c.perServer[used]
			if got, err := cl.GetSandbox(ctx(t), sb.ID); err != nil || got.Node != sb.Node {
				t.Fatalf("get: %+v %v", got, err)
			}
			if out := mustExec(t, cl, sb.ID, "echo hi; echo err >&2"); out != "hi\n" {
				t.Fatalf("exec stdout %q", out)
			}
			var streamed []string
			final, err := cl.ExecStream(ctx(t), sb.ID, api.ExecRequest{Cmd: "for i in 1 2 3; do echo $i; sleep 0.1; done"}, func(ev api.ExecEvent) error {
				streamed = append(streamed, ev.Stdout)
				return nil
			})
			if err != nil || *final.ExitCode != 0 || strings.Join(streamed, "") != "1\n2\n3\n" {
				t.Fatalf("stream: %v %+v %q", err, final, streamed)
			}
			sid, err := cl.CreateSession(ctx(t), sb.ID, api.SessionRequest{})
			if err != nil {
				t.Fatal(err)
			}
			if _, err := cl.SessionRun(ctx(t), sb.ID, sid, api.SessionRunRequest{Command: "cd /tmp; X=7"}); err != nil {
				t.Fatal(err)
			}
			res, err := cl.SessionRun(ctx(t), sb.ID, sid, api.SessionRunRequest{Command: "echo $PWD $X"})
			if err != nil || res.Stdout != "/tmp 7\n" {
				t.Fatalf("session state: %+v %v", res, err)
			}
			if err := cl.CloseSession(ctx(t), sb.ID, sid); err != nil {
				t.Fatal(err)
			}
			// Files both ways, a tar both ways.
			if err := cl.WriteFile(ctx(t), sb.ID, "/data/a.txt", strings.NewReader("payload\n"), 0o640); err != nil {
				t.Fatal(err)
			}
			if b, err := c.perServer[made].ReadFile(ctx(t), sb.ID, "/data/a.txt"); err != nil || string(b) != "payload\n" {
				t.Fatalf("read back %q %v", b, err)
			}
			if fe, err := cl.StatFile(ctx(t), sb.ID, "/data/a.txt"); err != nil || fe.Mode != "0640" {
				t.Fatalf("stat %+v %v", fe, err)
			}
			if l, err := cl.ListFiles(ctx(t), sb.ID, "/data", 1); err != nil || len(l) != 1 {
				t.Fatalf("list %+v %v", l, err)
			}
			var tb bytes.Buffer
			tw := tar.NewWriter(&tb)
			_ = tw.WriteHeader(&tar.Header{Name: "t/b.txt", Mode: 0o644, Size: 3})
			_, _ = tw.Write([]byte("tar"))
			_ = tw.Close()
			if res, err := cl.UploadTar(ctx(t), sb.ID, "/data", bytes.NewReader(tb.Bytes())); err != nil || res.Files != 1 {
				t.Fatalf("upload tar %+v %v", res, err)
			}
			var down bytes.Buffer
			if _, err := c.perServer[made].DownloadTar(ctx(t), sb.ID, "/data", &down); err != nil {
				t.Fatal(err)
			}
			names := tarNames(t, down.Bytes())
			if !strings.Contains(strings.Join(names, ","), "b.txt") || !strings.Contains(strings.Join(names, ","), "a.txt") {
				t.Fatalf("download tar: %v", names)
			}
			if err := cl.DeleteFile(ctx(t), sb.ID, "/data/a.txt", false); err != nil {
				t.Fatal(err)
			}
			// A service in the sandbox, through the ports proxy.
			mustExec(t, cl, sb.ID, "mkdir -p /www && echo served > /www/index.html && (httpd -p 127.0.0.1:8080 -h /www &)")
			var body string
			deadline := time.Now().Add(10 * time.Second)
			for {
				req, _ := http.NewRequest("GET", cl.PortURL(sb.ID, 8080), nil)
				req.Header.Set("Authorization", "Bearer "+adminKey)
				resp, err := http.DefaultClient.Do(req)
				if err == nil {
					b, _ := io.ReadAll(resp.Body)
					resp.Body.Close()
					body = string(b)
					if resp.StatusCode == 200 {
						break
					}
				}
				if time.Now().After(deadline) {
					t.Fatalf("ports proxy: %v %q", err, body)
				}
				time.Sleep(100 * time.Millisecond)
			}
			if body != "served\n" {
				t.Fatalf("ports proxy body %q", body)
			}
			// Lifecycle.
			if _, err := cl.Pause(ctx(t), sb.ID); err != nil {
				t.Fatal(err)
			}
			if got, _ := c.perServer[made].GetSandbox(ctx(t), sb.ID); got.State != api.StatePaused {
				t.Fatalf("state after pause: %s", got.State)
			}
			if _, err := cl.Resume(ctx(t), sb.ID); err != nil {
				t.Fatal(err)
			}
			if err := cl.Keepalive(ctx(t), sb.ID, time.Hour); err != nil {
				t.Fatal(err)
			}
			if st, err := cl.Stats(ctx(t), sb.ID); err != nil || st.Pids == 0 {
				t.Fatalf("stats %+v %v", st, err)
			}
			if _, err := cl.SetNetwork(ctx(t), sb.ID, api.NetworkPolicy{Allow: []string{"10.9.9.9/32:443/tcp"}}); err != nil {
				t.Fatal(err)
			}
			log, err := cl.ReadAllLog(ctx(t), sb.ID, 0)
			if err != nil || len(log) < 5 {
				t.Fatalf("command log: %d entries, %v", len(log), err)
			}
		})
	}
}

func tarNames(t *testing.T, b []byte) []string {
	t.Helper()
	tr := tar.NewReader(bytes.NewReader(b))
	var names []string
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return names
		}
		if err != nil {
			t.Fatalf("reading tar: %v", err)
		}
		names = append(names, h.Name)
	}
}

// TestSpanningCalls: a batch spreads over the nodes; listing pages across
// nodes with tokens that work on either apiserver; pause, resume and delete
// by labels reach every node.
func TestSpanningCalls(t *testing.T) {
	need(t)
	const n = 12
	res, err := c.perServer[0].CreateSandboxes(ctx(t), n, api.SandboxSpec{Base: baseRef, Labels: map[string]string{"job": "span"}})
	if err != nil || len(res.Sandboxes) != n || len(res.Errors) != 0 {
		t.Fatalf("batch: %d made, errors %+v, %v", len(res.Sandboxes), res.Errors, err)
	}
	t.Cleanup(func() { _, _ = c.client.DeleteSandboxes(context.Background(), map[string]string{"job": "span"}) })
	perNode := map[string]int{}
	for _, sb := range res.Sandboxes {
		perNode[sb.Node]++
	}
	if len(perNode) != 3 {
		t.Fatalf("a job of %d went to %v, want all three nodes", n, perNode)
	}
	for node, k := range perNode {
		if k > n/2 {
			t.Errorf("node %s got %d of %d: the job is not spread", node, k, n)
		}
	}
	var ids []string
	token := ""
	for page := 0; ; page++ {
		l, err := c.perServer[page%2].ListSandboxes(ctx(t), dsec.ListOptions{Labels: map[string]string{"job": "span"}, Limit: 5, PageToken: token})
		if err != nil {
			t.Fatalf("page %d: %v", page, err)
		}
		if len(l.UnreachableNodes) > 0 {
			t.Fatalf("unreachable nodes %v", l.UnreachableNodes)
		}
		for _, sb := range l.Sandboxes {
			ids = append(ids, sb.ID)
		}
		if l.NextPageToken == "" {
			break
		}
		token = l.NextPageToken
	}
	if len(ids) != n || !sort.StringsAreSorted(ids) {
		t.Fatalf("paged list: %d ids (sorted %v), want %d", len(ids), sort.StringsAreSorted(ids), n)
	}
	if k, err := c.perServer[1].PauseSandboxes(ctx(t), map[string]string{"job": "span"}); err != nil || k != n {
		t.Fatalf("pause by labels: %d %v", k, err)
	}
	if l, err := c.perServer[0].ListSandboxes(ctx(t), dsec.ListOptions{Labels: map[string]string{"job": "span"}, State: api.StatePaused, Limit: 100}); err != nil || len(l.Sandboxes) != n {
		t.Fatalf("paused: %d %v", len(l.Sandboxes), err)
	}
	if k, err := c.perServer[0].ResumeSandboxes(ctx(t), map[string]string{"job": "span"}); err != nil || k != n {
		t.Fatalf("resume by labels: %d %v", k, err)
	}
	if k, err := c.perServer[1].DeleteSandboxes(ctx(t), map[string]string{"job": "span"}); err != nil || k != n {
		t.Fatalf("delete by labels: %d %v", k, err)
	}
	if l, _ := c.perServer[0].ListSandboxes(ctx(t), dsec.ListOptions{Labels: map[string]string{"job": "span"}}); len(l.Sandboxes) != 0 {
		t.Fatalf("%d left after delete by labels", len(l.Sandboxes))
	}
}

// TestForkAcrossNodes: a snapshot taken on one edge is in the shared
// catalog and starts sandboxes on the others; a layer in use anywhere is
// not deleted.
func TestForkAcrossNodes(t *testing.T) {
	need(t)
	src := newSandbox(t, api.SandboxSpec{})
	mustExec(t, c.client, src.ID, "echo forked-state > /root/state")
	res, err := c.perServer[1].Fork(ctx(t), src.ID, 6, map[string]string{"job": "forks"})
	if err != nil || len(res.Sandboxes) != 6 {
		t.Fatalf("fork: %+v %v", res, err)
	}
	t.Cleanup(func() { _, _ = c.client.DeleteSandboxes(context.Background(), map[string]string{"job": "forks"}) })
	nodes := map[string]bool{}
	for _, f := range res.Sandboxes {
		nodes[f.Node] = true
		if out := mustExec(t, c.client, f.ID, "cat /root/state"); out != "forked-state\n" {
			t.Fatalf("fork %s on %s reads %q", f.ID, f.Node, out)
		}
	}
	if len(nodes) != 3 {
		t.Fatalf("6 forks of one job on %v, want every node", nodes)
	}
	snap := res.Sandboxes[0].Spec.Snapshot
	l, err := c.perServer[0].GetLayer(ctx(t), snap)
	if err != nil {
		t.Fatalf("the fork's snapshot %s is not in the catalog seen by s0: %v", snap, err)
	}
	// The edge staged it and s1 published it (edges may not write the
	// catalog): recorded as s1 knows it, and no staged image is left.
	if l.Snapshot == nil || l.Snapshot.Sandbox != src.ID || l.Project != src.Project {
		t.Fatalf("the fork's snapshot records %+v, project %q; want sandbox %s of project %q", l.Snapshot, l.Project, src.ID, src.Project)
	}
	if left, _ := filepath.Glob(filepath.Join(c.layersDir(), "outbox", "*", "image-*")); len(left) > 0 {
		t.Fatalf("staged images left: %v", left)
	}
	err = c.perServer[0].DeleteLayer(ctx(t), snap)
	wantCode(t, err, "failed_precondition")
	if _, err := c.client.DeleteSandboxes(ctx(t), map[string]string{"job": "forks"}); err != nil {
		t.Fatal(err)
	}
	if err := c.perServer[0].DeleteLayer(ctx(t), snap); err != nil {
		t.Fatalf("deleting the unused snapshot: %v", err)
	}
}

// TestNodeSelectorAndLayersOnEveryNode: one layer, built through one
// apiserver, runs on every edge.
func TestNodeSelectorAndLayersOnEveryNode(t *testing.T) {
	need(t)
	for i := 1; i <= 3; i++ {
		sb := newSandbox(t, api.SandboxSpec{NodeSelector: map[string]string{"zone": fmt.Sprintf("z%d", i)}})
		if sb.Node != fmt.Sprintf("e%d", i) {
			t.Fatalf("zone z%d placed on %s", i, sb.Node)
		}
		mustExec(t, c.client, sb.ID, "test -x /bin/bash")
	}
	_, err := c.client.CreateSandbox(ctx(t), api.SandboxSpec{Base: baseRef, NodeSelector: map[string]string{"zone": "nowhere"}})
	wantCode(t, err, "resource_exhausted")
}

// TestIdempotencyAcrossServers: a keyed create repeated on the other
// apiserver returns the first sandbox; the key with another body is 409.
func TestIdempotencyAcrossServers(t *testing.T) {
	need(t)
	kctx := dsec.WithIdempotencyKey(ctx(t), fmt.Sprintf("idem-%d", time.Now().UnixNano()))
	spec := api.SandboxSpec{Base: baseRef, Labels: map[string]string{"job": "idem"}}
	a, err := c.perServer[0].CreateSandbox(kctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.client.DeleteSandbox(context.Background(), a.ID) })
	b, err := c.perServer[1].CreateSandbox(kctx, spec)
	if err != nil || b.ID != a.ID {
		t.Fatalf("repeat on s1: %v %v, want %s", b, err, a.ID)
	}
	spec.Labels["other"] = "x"
	_, err = c.perServer[1].CreateSandbox(kctx, spec)
	wantCode(t, err, "failed_precondition")
	l, _ := c.client.ListSandboxes(ctx(t), dsec.ListOptions{Labels: map[string]string{"job": "idem"}})
	if len(l.Sandboxes) != 1 {
		t.Fatalf("%d sandboxes for one key", len(l.Sandboxes))
	}
}

// TestTarThroughAnApiserverIsStreamed: a 1 GiB archive crosses an
// apiserver without the apiserver holding it: its resident memory grows by
// far less than the archive.
func TestTarThroughAnApiserverIsStreamed(t *testing.T) {
	need(t)
	sb := newSandbox(t, api.SandboxSpec{})
	mustExec(t, c.client, sb.ID, "mkdir /big && truncate -s 1G /big/zeros")
	srv := c.servers[0]
	before := rss(srv.pid())
	var peak int64
	done := make(chan struct{})
	go func() {
		for {
			select {
			case <-done:
				return
			case <-time.After(20 * time.Millisecond):
				if r := rss(srv.pid()); r > peak {
					peak = r
				}
			}
		}
	}()
	start := time.Now()
	n, err := c.perServer[0].DownloadTar(ctx(t), sb.ID, "/big", io.Discard)
	close(done)
	if err != nil || n < 1<<30 {
		t.Fatalf("download: %d bytes, %v", n, err)
	}
	el := time.Since(start)
	t.Logf("1 GiB tar through s0 in %v (%.0f MiB/s): apiserver RSS %d MiB before, peak %d MiB", el.Round(time.Millisecond),
		float64(n)/(1<<20)/el.Seconds(), before>>20, peak>>20)
	if peak-before > 64<<20 {
		t.Fatalf("the apiserver's RSS grew by %d MiB while streaming 1 GiB", (peak-before)>>20)
	}
}

// TestMetricsOfBothProcesses: apiservers and edges serve /metrics.
func TestMetricsOfBothProcesses(t *testing.T) {
	need(t)
	get := func(url string) string {
		resp, err := http.Get(url)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return string(b)
	}
	m := get("http://" + c.servers[0].addr + "/metrics")
	for _, want := range []string{"dsec_api_requests_total", "dsec_placements_total", "dsec_watcher_view_age_seconds", "dsec_forward_seconds", "dsec_nodes_healthy 3"} {
		if !strings.Contains(m, want) {
			t.Errorf("apiserver /metrics lacks %q", want)
		}
	}
	var metricsAddr string
	for i, a := range c.edges[0].args {
		if a == "--metrics-listen" {
			metricsAddr = c.edges[0].args[i+1]
		}
	}
	m = get("http://" + metricsAddr + "/metrics")
	if !strings.Contains(m, "dsec_sandbox_create_seconds") {
		t.Errorf("edge /metrics lacks dsec_sandbox_create_seconds:\n%s", lastLines(m, 5))
	}
}
